"""Predicting the peak memory of an MLP step, tiled or not.

The model counts, in elements of ``dtype``, what is alive at the worst moment of one forward+backward of a
gated MLP (``down(act(gate(x)) * up(x))``), above a baseline that already holds ``x`` and the weights:

untiled   saved gate, up, act(gate), product (4 T*I) + output, grad_output, grad_input (3 T*H)
          + in backward dh and d(gate|up) (2 T*I) + weight grads (3 H*I)
tiled     output, grad_output, grad_input (3 T*H) + weight grads (3 H*I, fp32 accumulators when the
          weights are 16-bit) + the largest tile's backward working set (6 t*I + 2 t*H)
          + the last tile's gate/up kept from the forward (2 t_last*I)
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["tile_activation_bytes", "predict_mlp_peak_bytes"]

# Elements per token of one tile's backward working set, in units of intermediate_size:
# recomputed gate and up, act(gate), their product, d(product), d(gate) and d(up) overlap to ~6.
_GLU_TILE_FACTOR = 6
_GLU_SAVED_FACTOR = 4
_GLU_BACKWARD_EXTRA = 2


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tile_activation_bytes(num_tokens: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype) -> int:
    """Bytes of transient activations while one tile of ``num_tokens`` is recomputed and back-propagated."""
    per_token = _GLU_TILE_FACTOR * intermediate_size + 2 * hidden_size
    return num_tokens * per_token * _itemsize(dtype)


def predict_mlp_peak_bytes(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    splits: Sequence[int] | None,
    dtype: torch.dtype = torch.float32,
    keep_last_tile: bool = True,
) -> int:
    """Predicted peak bytes above baseline of one gated-MLP forward+backward; ``splits=None`` means untiled."""
    size = _itemsize(dtype)
    t, h, i = num_tokens, hidden_size, intermediate_size
    grad_size = 4 if size < 4 else size
    if not splits or len(splits) <= 1:
        acts = (_GLU_SAVED_FACTOR + _GLU_BACKWARD_EXTRA) * t * i + 3 * t * h
        return acts * size + 3 * h * i * size
    kept = 2 * splits[-1] * i * size if keep_last_tile else 0
    return 3 * t * h * size + 3 * h * i * grad_size + tile_activation_bytes(max(splits), h, i, dtype=dtype) + kept
