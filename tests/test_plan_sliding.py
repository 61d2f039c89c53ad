"""The plan of a sliding-window model under sdpa: from ``sliding_window`` tokens on, transformers hands each sliding
layer a ``[batch, 1, seq, seq]`` mask (no ``is_causal`` skip), which torch's sdpa turns into a float mask in q's
dtype and keeps for its backward; checkpointed, the boolean mask is an input of every layer. Until 2026-11-28 the
plan left both out: 0.30-0.77 of the measured peak at 2048 tokens with a 256-token window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from test_plan import assert_within, measured_and_planned
from trainrun import one_thread  # noqa: F401 (autouse: tiny models run fastest on one thread; the plan reads it)

from tiledmlp.plan import ModelShape
from tiledmlp.plan.cli import main

SIZES = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
             head_dim=16, vocab_size=257, max_position_embeddings=65536, attn_implementation="sdpa")


def mistral(window: int | None) -> tf.MistralConfig:  # every layer through the window
    return tf.MistralConfig(sliding_window=window, **SIZES)


def gemma3(window: int | None) -> tf.Gemma3TextConfig:  # one sliding layer, one full
    return tf.Gemma3TextConfig(sliding_window=window, layer_types=["sliding_attention", "full_attention"], **SIZES)


@pytest.mark.hollow_matmuls  # bytes only: tests/test_hollow_matmul.py's plan-* cases
@pytest.mark.parametrize("recipe, dtype", [("untiled", torch.float32), ("tiled+loss", torch.float32),
                                           ("tiled+loss+ckpt", torch.float32), ("untiled", torch.bfloat16),
                                           ("tiled+loss", torch.bfloat16)])
@pytest.mark.parametrize("family", [mistral, gemma3], ids=["mistral", "gemma3"])
def test_sliding_window_masks_are_planned(family: object, recipe: str, dtype: torch.dtype) -> None:
    assert_within(*measured_and_planned(family(256), dtype, recipe, 2048))


def test_which_layers_slide_is_read_from_the_config() -> None:
    assert ModelShape.from_config(mistral(256)).sliding == (256, 2)
    assert ModelShape.from_config(gemma3(256)).sliding == (256, 1)
    assert ModelShape.from_config(mistral(None)).sliding == (0, 0)
    qwen2 = tf.Qwen2Config(use_sliding_window=False, sliding_window=256, **SIZES)  # the window unused
    assert ModelShape.from_config(qwen2).sliding == (0, 0)


def test_below_the_window_or_without_one_nothing_is_added() -> None:
    """Shorter than the window, transformers skips the mask (sdpa's is_causal), as without a window: the same plan."""
    for recipe in ("untiled", "tiled+loss+ckpt"):
        windowed, plain = (measured_and_planned(mistral(w), torch.float32, recipe, 512) for w in (4096, None))
        assert windowed == plain
        assert_within(*plain)


def test_plan_says_what_the_masks_cost_and_what_avoids_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    mistral(4096).save_pretrained(tmp_path / "windowed")
    mistral(None).save_pretrained(tmp_path / "plain")
    notes = {}
    for name in ("windowed", "plain"):
        assert main(["--model", str(tmp_path / name), "--seq", "8192", "--dtype", "bfloat16", "--json"]) == 0
        notes[name] = json.loads(capsys.readouterr().out)["assumptions"]["sliding_masks"]
    assert notes["windowed"].startswith("2 sliding-window layers (window 4,096)") and "0.12 GiB per layer at 8,192" \
        in notes["windowed"] and "flash_attention_2" in notes["windowed"]
    assert notes["plain"] == "none at these lengths"


def test_train_names_the_masks_when_the_plan_does_not_fit() -> None:
    """``tiledmlp train``'s report before the first step (and after an out-of-memory error) says what the masks cost
    and which kernels build none."""
    from tiledmlp.plan import Setup
    from tiledmlp.train.fit import fit_report

    shape = ModelShape.from_config(mistral(1024))
    setup = Setup(dtype=torch.bfloat16, tiled_mlp=True, tiled_loss=True, checkpointing=True, device_type="cuda")
    lines = fit_report(shape, setup, 65536, 1, 2**30, "cuda:0")
    assert any(line.startswith("2 sliding-window layers (window 1,024)") and "8.00 GiB per layer at 65,536 (one at "
               "a time, recomputed)" in line and "flash_attention_2" in line for line in lines), lines
    assert not any("sliding" in line for line in fit_report(ModelShape.from_config(mistral(None)), setup, 65536, 1,
                                                             2**30, "cuda:0"))
