"""``tiledmlp plan`` on ALiBi eager attention (Bloom, MPT) against exact CPU profiler peaks.

Bloom's attention keeps its ``[heads, seq, seq]`` scores and masked scores alive to its end, beside the float32
softmax, and each layer returns its probabilities, which the model's loop keeps through the next layer: the peak
of a checkpointed step is the last layer's attention forward (float32, 1024 tokens: four float32 score buffers,
67 MB, and the mask), which the plan did not have (0.787 of the measured peak). MPT passes every layer a float32
ALiBi bias over ``max_seq_len`` (1 MiB here, whatever the length) and a boolean mask, kept with the checkpoints
(bf16, 256 tokens: 0.848 before). Both are read off the modules by ``plan.probe.probe_eager_scores``.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_plan import assert_within, measured_and_planned
from trainrun import one_thread  # noqa: F401 (autouse: tiny models run fastest on one thread; the plan reads it)

from tiledmlp.plan import ModelShape, Setup, predict_step_peak


def bloom_config() -> tf.BloomConfig:
    return tf.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=257, hidden_dropout=0.0,
                          attention_dropout=0.0)


def mpt_config() -> tf.MptConfig:
    return tf.MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=257, expansion_ratio=4, max_seq_len=65536)


CONFIGS = {"bloom": bloom_config, "mpt": mpt_config}


@pytest.mark.hollow_matmuls
@pytest.mark.parametrize("seq", [256, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["untiled", "ckpt", "tiled+ckpt"])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_alibi_plan_matches_profiler_peak(model: str, recipe: str, dtype: torch.dtype, seq: int) -> None:
    assert_within(*measured_and_planned(CONFIGS[model](), dtype, recipe, seq))


def test_bloom_peak_is_its_attention_forward() -> None:
    """Checkpointed, Bloom's step peaks in its last layer's attention forward: 12 bytes per score element held
    there (scores, masked scores, float32 softmax) and the previous layer's returned float32 probabilities."""
    shape = ModelShape.from_config(bloom_config())
    assert shape.attn_impl == "eager"
    probed = {e.size: e for e in shape.eager_forward}
    assert (probed[4].held, probed[4].kept, probed[2].held, probed[2].kept) == (12, 4, 12, 2)
    plan = predict_step_peak(shape, Setup(dtype=torch.float32, checkpointing=True, device_type="cpu"), 1024)
    assert plan.moment == "attention forward"
    assert plan.terms["previous_probabilities"] == 4 * 1024 * 1024 * 4


def test_mpt_fixed_alibi_bias_is_kept_with_the_checkpoints() -> None:
    """MPT's float32 ALiBi bias spans ``max_seq_len`` whatever the length, its mask is boolean."""
    shape = ModelShape.from_config(mpt_config())
    e = {e.size: e for e in shape.eager_forward}[2]
    assert (e.inputs_fixed, e.inputs_per_square) == (4 * 4 * 65536, 1)
    plan = predict_step_peak(shape, Setup(dtype=torch.bfloat16, checkpointing=True, device_type="cpu"), 256)
    assert plan.terms["checkpointed_mask"] == 4 * 4 * 65536 + 256 * 256
