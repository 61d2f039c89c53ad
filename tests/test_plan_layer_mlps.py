"""``tiledmlp plan`` for models whose MLP is no module: OPT's and BioGPT's ``fc1`` / activation / ``fc2`` sit in the
decoder layer, where ``tiledmlp.patch`` finds nothing to tile (and says so; ``tiledmlp train`` adds "pass
--use_tiled_mlp false"). Until 2026-11-29 the plan refused OPT ("no MLP width": its config names it ``ffn_dim``) and
gave BioGPT a ``tiled MLP`` row, later rows built on it, and the advice ``--use_tiled_mlp true``, all of it a run
``train`` refuses; its untiled rows planned a gated MLP there (BioGPT's is GELU, OPT's ReLU: ungated). XGLM's MLP
sits in its decoder layer too, beside an eager attention of its own, which until 2026-11-29 the plan counted as
transformers' ``eager_attention_forward`` (0.65-0.70 of the measured peak in float32, 1.18-1.27 in bf16): what it
saves and its backward holds are probed now (``plan.probe._backward_squares``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from test_plan import assert_within
from test_plan_families import biogpt_config
from trainrun import one_thread  # noqa: F401 (autouse: tiny models run fastest on one thread; the plan reads it)

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.cli import PlanArguments, main, recipes
from tiledmlp.plan.measure import measure_step_peak
from tiledmlp.train.fit import fitting_changes
from tiledmlp.train.models import tiny_llama_config


def opt_config() -> tf.OPTConfig:  # ReLU, learned positions (offset 2), LayerNorms with biases, biased matmuls
    return tf.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=256, vocab_size=257,
                        word_embed_proj_dim=64, max_position_embeddings=4096, dropout=0.0, attention_dropout=0.0,
                        pad_token_id=1, bos_token_id=2, eos_token_id=2)


def xglm_config() -> tf.XGLMConfig:  # its own eager attention (no sdpa): clamps the masked scores by torch.max
    return tf.XGLMConfig(d_model=64, ffn_dim=256, num_layers=2, attention_heads=4, vocab_size=257,
                         max_position_embeddings=4096, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


CONFIGS = {"opt": (opt_config, tf.OPTForCausalLM), "biogpt": (biogpt_config, tf.BioGptForCausalLM),
           "xglm": (xglm_config, tf.XGLMForCausalLM)}
TAKES_THE_LOSS = {"opt", "xglm"}  # patch_loss refuses BioGPT's (its head is output_projection)


@pytest.mark.parametrize("model", list(CONFIGS))
def test_no_tiled_mlp_row_where_patch_finds_no_mlp(model: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The rows ``train`` can run: untiled, the tiled loss alone where ``patch_loss`` takes the model (OPT's; BioGPT's
    it refuses), offloading over that; none with a tiled MLP, and no advice to turn it on."""
    make, cls = CONFIGS[model]
    with pytest.raises(ValueError, match="found no MLP to tile"):
        tiledmlp.patch(cls(make()))
    shape = ModelShape.from_config(make())
    assert cls.__name__ in shape.mlp_refusal and not ModelShape.from_config(tiny_llama_config()).mlp_refusal
    rows = recipes(PlanArguments(dtype="bfloat16"), shape)
    taken = ["tiled loss"] if model in TAKES_THE_LOSS else []
    assert list(rows) == ["untiled", *taken, "+ offload", "+ SP 1"], list(rows)
    assert not any(setup.tiled_mlp for setup in rows.values())
    assert rows["+ offload"].tiled_loss == (model in TAKES_THE_LOSS) and rows["+ offload"].offload
    base = Setup(dtype=torch.bfloat16)
    flags, _ = fitting_changes(shape, base, 32768, 1, predict_step_peak(shape, rows["+ offload"], 32768).peak_bytes)
    assert flags[0] == ("--use_tiled_loss true" if model in TAKES_THE_LOSS else "--activation_checkpointing true"), \
        flags
    flags, _ = fitting_changes(shape, base, 32768, 1, 1) or ([], 0)  # nothing fits: every flag tried
    assert not any("--use_tiled_mlp" in f for f in flags), flags
    make().save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--seq", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["recipes"]) == list(rows) and "finds no MLP module" in out["assumptions"]["tiled_mlp"]
    assert main(["--model", str(tmp_path), "--seq", "4096"]) == 0
    assert "no tiled MLP row: tiledmlp.patch finds no MLP module" in " ".join(capsys.readouterr().out.split())


def test_the_layers_matmuls_are_read_as_an_ungated_mlp() -> None:
    """``fc1`` and ``fc2`` are the MLP's matmuls (OPT's width read from ``ffn_dim``); its activation probed off the
    decoder layer: ReLU keeps its output, GELU its input and output."""
    opt, biogpt = ModelShape.from_config(opt_config()), ModelShape.from_config(biogpt_config())
    assert (opt.intermediate, opt.mlp_linear_in, opt.mlp_gated) == (256, (64, 256), False)
    assert (biogpt.intermediate, biogpt.mlp_linear_in, biogpt.mlp_gated) == (256, (64, 256), False)
    assert dict(biogpt.activation) == {4: 8, 2: 4} and opt.activation


@pytest.mark.hollow_matmuls  # bytes only: tests/test_hollow_matmul.py's plan-*-layer-mlp cases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loss, ckpt", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["untiled", "ckpt", "loss", "loss+ckpt"])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_plan_matches_profiler_peak(model: str, loss: bool, ckpt: bool, dtype: torch.dtype) -> None:
    """The rows' steps at 1024 tokens (BioGPT's loss is refused: its loss rows are OPT's only)."""
    if loss and model not in TAKES_THE_LOSS:
        pytest.skip("patch_loss refuses BioGPT (its head is output_projection): no such row")
    measured, planned = measured_and_planned(model, dtype, loss, ckpt, 1024)
    assert_within(measured, planned)


def prepared(model: str, dtype: torch.dtype, loss: bool, ckpt: bool) -> torch.nn.Module:
    make, cls = CONFIGS[model]
    torch.manual_seed(0)
    lm = cls(make()).to(dtype)
    lm.train()
    if loss:
        tiledmlp.patch_loss(lm)
    if ckpt:
        enable_checkpointing(lm, {"use_reentrant": False})
    return lm


def measured_and_planned(model: str, dtype: torch.dtype, loss: bool, ckpt: bool, seq: int) -> tuple[int, int]:
    lm = prepared(model, dtype, loss, ckpt)
    measured = measure_step_peak(lm, torch.randint(3, lm.config.vocab_size, (1, seq)))
    setup = Setup(dtype=dtype, tiled_loss=loss, checkpointing=ckpt, device_type="cpu")
    return measured, predict_step_peak(ModelShape.from_config(lm.config), setup, seq).peak_bytes
