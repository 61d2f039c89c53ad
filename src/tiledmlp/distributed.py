"""Backend detection and the adapters that make tiling exact under DDP, FSDP1/2 and DeepSpeed ZeRO.

DDP, FSDP2 (decoder layer or MLP as the unit) and ZeRO-1/2 need nothing special: the engine returns each weight
grad once, so their per-parameter hooks fire once. What needs care lives here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .engine import tiled_call

__all__ = ["check_tileable", "run_tiled"]


def _sharded_unit_types() -> tuple[type, ...]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


def check_tileable(module: nn.Module, name: str = "") -> None:
    """Refuse an MLP containing its own FSDP units: their hooks would fire per tile inside backward."""
    units = _sharded_unit_types()
    inner = [n for n, m in module.named_modules() if m is not module and isinstance(m, units)]
    if inner:
        raise ValueError(
            f"tiledmlp: {name or type(module).__name__} contains FSDP units ({', '.join(inner)}); wrap the decoder "
            "layer (or the MLP itself) with fully_shard instead of each Linear inside the MLP"
        )


def run_tiled(
    fn: Callable[..., Any],
    x: torch.Tensor,
    *token_args: torch.Tensor,
    params: Sequence[torch.Tensor],
    splits: Sequence[int],
    accumulate_dtype: object,
) -> Any:
    """Run the generic engine with the gradient landing the backend needs."""
    return tiled_call(fn, x, *token_args, params=params, splits=splits, accumulate_dtype=accumulate_dtype)
