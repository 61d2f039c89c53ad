"""``tiledmlp bench --model M``: a model's MLP benched as the bench MLP computing the same, at its widths, read off
its config (no weights); MLPs no bench MLP computes are refused with their widths."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from tiledmlp.bench.cli import UsageError, build_parser, resolve
from tiledmlp.train.models import tiny_llama_config

SMALL = dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, vocab_size=100)


def _resolve(flags: list[str]) -> tuple[dict, list[str]]:
    return resolve(build_parser().parse_args([*flags, "--impls", "untiled,tiledmlp"]), torch.device("cpu"))


def _saved(tmp_path, name: str, config) -> str:
    config.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def test_a_models_mlp_is_benched_at_its_widths_and_dtype(tmp_path) -> None:
    cfg = tiny_llama_config()
    settings, notes = _resolve(["--model", "tiny-llama"])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"]) == \
        ("swiglu", cfg.hidden_size, cfg.intermediate_size)
    assert any(n.startswith("--model tiny-llama: LlamaMLP (model.layers.0.mlp) benched as --mlp swiglu") for n in notes)
    gemma = _saved(tmp_path, "gemma", tf.GemmaConfig(hidden_size=32, intermediate_size=96, head_dim=16,
                                                    hidden_activation="gelu_pytorch_tanh", dtype="bfloat16", **SMALL))
    settings, _ = _resolve(["--model", gemma])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"], settings["dtype"]) == \
        ("geglu", 32, 96, "bfloat16")
    assert _resolve(["--model", gemma, "--dtype", "float32"])[0]["dtype"] == "float32"  # a flag beside it wins
    phi3 = _saved(tmp_path, "phi3", tf.Phi3Config(hidden_size=32, intermediate_size=64, pad_token_id=0, **SMALL))
    settings, _ = _resolve(["--model", phi3])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"]) == ("swiglu-fused", 32, 64)
    gpt2 = _saved(tmp_path, "gpt2", tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    settings, _ = _resolve(["--model", gpt2])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"]) == ("gpt2", 32, 128)


@pytest.mark.parametrize("config, message", [
    (tf.LlamaConfig(hidden_size=32, intermediate_size=64, mlp_bias=True, **SMALL),
     "its MLP (LlamaMLP at model.layers.0.mlp) has no bench MLP that computes the same"),
    (tf.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, **SMALL), "Qwen3MoeExperts at model.layers.0.mlp.experts"),
    (tf.LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="gelu", **SMALL), "LlamaMLP"),
])
def test_an_mlp_no_bench_mlp_computes_is_refused_with_its_widths(tmp_path, config, message: str) -> None:
    with pytest.raises(UsageError, match="bench one of those at its widths") as info:
        _resolve(["--model", _saved(tmp_path, "m", config)])
    assert message in str(info.value)


def test_model_sets_the_mlp_and_refuses_flags_that_would_too() -> None:
    with pytest.raises(UsageError, match=r"--model sets the MLP and its widths; drop --mlp, --hidden"):
        _resolve(["--model", "tiny-llama", "--mlp", "geglu", "--hidden", "64"])
    with pytest.raises(UsageError, match="--model: no such file or directory: /no/such/model"):
        _resolve(["--model", "/no/such/model"])
