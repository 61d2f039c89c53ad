"""The plan of a vision-language model (Qwen2.5-VL, Llava, Gemma 3's ``*ForConditionalGeneration``, which
``tiledmlp train`` loads for Gemma 3 4B and up): its text decoder read as a causal LM's, the vision tower's weights
counted. Until 2026-11-28 the norms were probed in the vision tower's first layer (a LayerNorm: Gemma 3 planned
0.59-0.93 of its measured peak) and Qwen2.5-VL's and Llava's configs were refused."""

from __future__ import annotations

import pytest
import torch
from test_loss_vlm import tiny
from test_plan import RECIPES, assert_within
from trainrun import one_thread  # noqa: F401 (autouse: tiny models run fastest on one thread; the plan reads it)

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.measure import measure_step_peak


@pytest.mark.hollow_matmuls  # bytes only: tests/test_hollow_matmul.py's plan-* cases
@pytest.mark.parametrize("recipe", ["untiled", "tiled+loss", "tiled+loss+ckpt"])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava", "gemma3"])
def test_vlm_plan_matches_the_measured_peak(model_type: str, recipe: str) -> None:
    """bf16, 2048 text tokens (no image: the plan counts no vision activations)."""
    tiled, loss, ckpt = RECIPES[recipe]
    model = tiny(model_type, vocab_size=257, intermediate_size=172).to(torch.bfloat16)
    if tiled:
        tiledmlp.patch(model, loss=loss)
    if ckpt:
        enable_checkpointing(model, {"use_reentrant": False})
    measured = measure_step_peak(model, torch.randint(3, 90, (1, 2048)))
    setup = Setup(dtype=torch.bfloat16, tiled_mlp=tiled, tiled_loss=loss, checkpointing=ckpt, device_type="cpu")
    assert_within(measured, predict_step_peak(ModelShape.from_config(model.config), setup, 2048).peak_bytes)


def test_the_text_decoders_norms_and_positions_are_read() -> None:
    """The same layout as the text model alone: Gemma 3's pre- and post-norms, row-tiled RMSNorms, no learned
    position embeddings (the vision tower's are not the decoder's)."""
    vlm = tiny("gemma3", vocab_size=257)
    shape, text = ModelShape.from_config(vlm.config), ModelShape.from_config(vlm.config.text_config)
    assert shape.norms == text.norms and shape.norms.post and shape.norms.row_tiled
    assert shape.position_params == 0 and shape.multimodal and not text.multimodal
    assert shape.num_params > text.num_params  # the vision tower's weights
