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


def test_a_vision_language_models_text_mlp_is_benched(tmp_path) -> None:
    """Not its vision tower's (first in the model, on fewer tokens; Gemma 3's SigLIP MLP was refused as the model's
    MLP): the text decoder's. Qwen2.5-VL's config, not a causal LM's, is read too."""
    text = dict(hidden_size=32, intermediate_size=96, head_dim=16, **SMALL)
    gemma3 = tf.Gemma3Config(text_config={**text, "hidden_activation": "gelu_pytorch_tanh"},
                             vision_config=dict(hidden_size=16, intermediate_size=48, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=28, patch_size=14))
    settings, notes = _resolve(["--model", _saved(tmp_path, "gemma3", gemma3)])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"]) == ("geglu", 32, 96)
    assert any("Gemma3MLP (model.language_model.layers.0.mlp)" in n for n in notes), notes
    qwen = tf.Qwen2_5_VLConfig(text_config={**text, "head_dim": None}, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=48, num_heads=2, out_hidden_size=32))
    settings, _ = _resolve(["--model", _saved(tmp_path, "qwen", qwen)])
    assert (settings["mlp"], settings["hidden"], settings["intermediate"]) == ("swiglu", 32, 96)


MOE = dict(hidden_size=32, intermediate_size=64, num_experts_per_tok=2, **{**SMALL, "num_hidden_layers": 2})


@pytest.mark.parametrize("config, name", [
    # layer 0 dense (mlp_only_layers): the experts of layer 1 are benched, not the dense MLP before them
    (tf.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, mlp_only_layers=[0], **MOE),
     "Qwen3MoeExperts (model.layers.1.mlp.experts)"),
    (tf.MixtralConfig(**{**MOE, "intermediate_size": 16}, num_local_experts=4),
     "MixtralExperts (model.layers.0.mlp.experts)"),
    (tf.OlmoeConfig(**{**MOE, "intermediate_size": 16}, num_experts=4), "OlmoeExperts (model.layers.0.mlp.experts)"),
])
def test_a_moe_models_routed_experts_are_benched_as_moe(tmp_path, config, name: str) -> None:
    settings, notes = _resolve(["--model", _saved(tmp_path, "m", config)])
    assert {k: settings[k] for k in ("mlp", "hidden", "intermediate", "experts", "top_k")} == \
        {"mlp": "moe", "hidden": 32, "intermediate": 16, "experts": 4, "top_k": 2}
    assert any(f"{name} benched as --mlp moe --hidden 32 --intermediate 16 --experts 4 --top_k 2" in n for n in notes)


@pytest.mark.parametrize("config, message", [
    (tf.LlamaConfig(hidden_size=32, intermediate_size=64, mlp_bias=True, **SMALL),
     "its MLP (LlamaMLP at model.layers.0.mlp) has no bench MLP that computes the same"),
    # a shared expert beside the routed ones: the bench block has none
    (tf.Qwen2MoeConfig(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4, **MOE),
     "Qwen2MoeExperts at model.layers.0.mlp.experts"),
    (tf.GptOssConfig(**{**MOE, "intermediate_size": 16}, num_local_experts=4, head_dim=16),  # biases, clamped GLU
     "GptOssExperts at model.layers.0.mlp.experts"),
    (tf.LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="gelu", **SMALL), "LlamaMLP"),
])
def test_an_mlp_no_bench_mlp_computes_is_refused_with_its_widths(tmp_path, config, message: str) -> None:
    with pytest.raises(UsageError, match="bench one of those at its widths") as info:
        _resolve(["--model", _saved(tmp_path, "m", config)])
    assert message in str(info.value)


def test_model_sets_the_mlp_and_refuses_flags_that_would_too() -> None:
    with pytest.raises(UsageError, match=r"--model sets the MLP and its widths; drop --mlp, --hidden"):
        _resolve(["--model", "tiny-llama", "--mlp", "geglu", "--hidden", "64"])
    with pytest.raises(UsageError, match=r"--model sets the MLP and its widths; drop --top_k \(or --model\)"):
        _resolve(["--model", "tiny-llama", "--top_k", "1"])
    with pytest.raises(UsageError, match="--model: no such file or directory: /no/such/model"):
        _resolve(["--model", "/no/such/model"])


def test_the_routing_flags_are_for_moe_and_checked() -> None:
    settings, _ = _resolve(["--mlp", "moe", "--experts", "16", "--top_k", "4"])
    assert (settings["mlp"], settings["experts"], settings["top_k"]) == ("moe", 16, 4)
    assert _resolve(["--mlp", "moe"])[0]["experts"] == 8  # the defaults: 8 experts, top-2
    with pytest.raises(UsageError, match=r"^--experts and --top_k size --mlp moe's experts; add --mlp moe or drop"):
        _resolve(["--experts", "16", "--top_k", "4"])
    with pytest.raises(UsageError, match=r"^--top_k 3 routes each token to more experts than the 2 there are"):
        _resolve(["--mlp", "moe", "--experts", "2", "--top_k", "3"])


def test_a_moe_bench_runs_and_names_its_routing(tmp_path) -> None:
    """``--mlp moe`` end to end on the CPU (memory in fresh processes, which rebuild the block from the row's
    settings): the tiled experts hold less than the untiled block, and the files name the experts and top-k."""
    import json

    from tiledmlp.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--mlp", "moe", "--hidden", "64", "--intermediate", "96", "--experts", "4", "--top_k", "2",
                 "--seq", "512", "--shards", "4", "--impls", "untiled,tiledmlp", "--repeat", "1", "--threads", "1",
                 "--no-progress", "--device", "cpu", "--no-rss", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert (data["meta"]["mlp"], data["meta"]["experts"], data["meta"]["top_k"]) == ("moe", 4, 2)
    untiled, tiled = data["rows"]
    assert tiled["tiles"] == 4 and tiled["peak_bytes"] < 0.7 * untiled["peak_bytes"]
    assert "moe MLP, hidden 64, intermediate 96 (4 experts, each token to 2), float32" in (out / "bench.md").read_text()
