"""How tokens are cut into tiles.

Tiles are always cut over the *flattened* token axis (``B*S``), identically in forward and backward, so a
batch of several sequences is bounded exactly like one long sequence (unsloth's "arctic" mode counts tiles
over ``S`` only and lets ``B>1`` blow the bound). Split sizes are explicit and differ by at most one token:
``torch.chunk`` returns fewer chunks than asked for on small inputs, which is what broke DeepSpeed's
``ds_grad_is_ready`` bookkeeping; here the number of tiles is ``len(splits)`` and nothing else.
"""

from __future__ import annotations

import math
from typing import Union

import torch

NumShards = Union[int, str]

__all__ = ["NumShards", "plan_shards", "even_splits", "validate_num_shards"]


def validate_num_shards(num_shards: object) -> None:
    """Refuse anything but a positive int or ``"auto"``, naming the fix."""
    if isinstance(num_shards, str):
        if num_shards != "auto":
            raise ValueError(f"num_shards must be a positive int or 'auto', got the string {num_shards!r}")
        return
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise TypeError(f"num_shards must be a positive int or 'auto', got {type(num_shards).__name__}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1 (1 disables tiling), got {num_shards}")


def even_splits(num_tokens: int, num_tiles: int) -> list[int]:
    """``num_tiles`` sizes summing to ``num_tokens`` that differ by at most one (larger tiles first)."""
    if num_tokens <= 0:
        return []
    n = max(1, min(num_tiles, num_tokens))
    base, extra = divmod(num_tokens, n)
    return [base + 1] * extra + [base] * (n - extra)


def plan_shards(
    num_tokens: int,
    *,
    num_shards: NumShards = "auto",
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    target_gb: float | None = None,
    path: str = "glu",
    weight_dtype: torch.dtype | None = None,
    device_type: str = "cpu",
    top_k: int | None = None,
    activation: tuple[int, int] | None = None,
    lora: tuple[bool, int] | None = None,
    kernels: str = "eager",
) -> list[int]:
    """Split sizes over ``num_tokens`` flattened tokens.

    - an int: that many tiles (fewer if there are fewer tokens);
    - ``"auto"``: ``ceil(tokens / hidden_size)`` tiles (the ALST rule), except that when
      ``intermediate_size`` is known and the memory planner predicts the tiled peak would not be below the
      untiled one (short sequences), it returns one tile: tiling never costs memory (``path`` says which
      engine's memory model to use: ``"glu"`` fast path or ``"generic"``; ``dtype`` is the dtype the MLP computes
      in and ``weight_dtype`` its weights' where wider, as under autocast; ``device_type`` where it runs);
    - ``target_gb``: the fewest tiles whose predicted per-tile activation memory on ``path`` fits the target
      (:func:`tiledmlp.memory.tile_activation_bytes`: ``top_k`` for experts a token reaches that many of,
      ``activation`` an ungated MLP's probed activation bytes, ``lora`` the GLU path's PEFT adapters, ``kernels``
      ``"compiled"`` where the GLU path runs its compiled kernels; one token per tile where not even one token
      fits); it overrides ``num_shards``.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    validate_num_shards(num_shards)
    if path not in ("glu", "generic"):  # checked here, not only where "auto" consults the planner
        raise ValueError(f"path must be 'glu' or 'generic' (the engine whose memory model 'auto' uses), got {path!r}")
    _check_shape(hidden_size, intermediate_size, dtype)
    if weight_dtype is not None:
        _check_shape(None, None, weight_dtype, "weight_dtype")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1 (the experts each token is routed to), got {top_k!r}")
    if activation is not None and (not isinstance(activation, tuple) or len(activation) != 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in activation)):
        raise ValueError(f"activation must be None or (saved, held) bytes per element, two ints >= 0, "
                         f"got {activation!r}")
    if lora is not None and (not isinstance(lora, tuple) or len(lora) != 2 or not isinstance(lora[0], bool)
                             or isinstance(lora[1], bool) or not isinstance(lora[1], int) or lora[1] < 0):
        raise ValueError(f"lora must be None or (adapters wider than the base: bool, masked input elements a token: "
                         f"int >= 0), got {lora!r}")
    if kernels not in ("eager", "compiled"):
        raise ValueError(f"kernels must be 'eager' or 'compiled' (the GLU path's compiled tile kernels), "
                         f"got {kernels!r}")
    if target_gb is not None:
        return _plan_for_target(num_tokens, target_gb, hidden_size, intermediate_size, dtype, path=path,
                                top_k=top_k, activation=activation, weight_dtype=weight_dtype, lora=lora,
                                device_type=device_type, kernels=kernels)
    if num_tokens == 0:
        return []
    if num_shards != "auto":
        return even_splits(num_tokens, num_shards)
    if hidden_size is None or hidden_size < 1:
        raise ValueError("num_shards='auto' needs hidden_size (a positive int); pass hidden_size= or an int num_shards")
    splits = even_splits(num_tokens, _ceil_div(num_tokens, hidden_size))
    if len(splits) > 1 and intermediate_size is not None:
        from .memory import predict_mlp_peak_bytes

        tiled = predict_mlp_peak_bytes(num_tokens, hidden_size, intermediate_size, splits=splits, dtype=dtype,
                                       path=path, weight_dtype=weight_dtype, device_type=device_type)
        untiled = predict_mlp_peak_bytes(num_tokens, hidden_size, intermediate_size, splits=None, dtype=dtype,
                                         weight_dtype=weight_dtype, device_type=device_type)
        if tiled >= untiled:
            return [num_tokens]
    return splits


def _check_shape(hidden_size: object, intermediate_size: object, dtype: object, dtype_name: str = "dtype") -> None:
    for name, value, least in (("hidden_size", hidden_size, 0), ("intermediate_size", intermediate_size, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an int >= {least} (the model's {name}) or None, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{dtype_name} must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")


def _plan_for_target(
    num_tokens: int,
    target_gb: float,
    hidden_size: int | None,
    intermediate_size: int | None,
    dtype: torch.dtype,
    *,
    path: str,
    top_k: int | None,
    activation: tuple[int, int] | None,
    weight_dtype: torch.dtype | None,
    lora: tuple[bool, int] | None,
    device_type: str,
    kernels: str,
) -> list[int]:
    if isinstance(target_gb, bool) or not isinstance(target_gb, (int, float)):
        raise TypeError(f"target_gb must be a positive number of GiB, got {type(target_gb).__name__}")
    if not 0 < target_gb < math.inf:
        raise ValueError(f"target_gb must be a finite number > 0 (GiB of activation memory per tile), got {target_gb}")
    if hidden_size is None or intermediate_size is None:
        raise ValueError("target_gb needs hidden_size and intermediate_size to predict per-tile memory")
    if num_tokens == 0:
        return []
    from .memory import tile_activation_bytes

    def tile_bytes(tokens: int) -> int:
        return tile_activation_bytes(tokens, hidden_size, intermediate_size, dtype=dtype, path=path, top_k=top_k,
                                     activation=activation, weight_dtype=weight_dtype, lora=lora,
                                     device_type=device_type, kernels=kernels)

    budget = target_gb * 2**30  # an int target stays an int (no float overflow); a float one may be inf
    if budget >= tile_bytes(num_tokens):  # everything fits in one tile (also where the budget is past float range)
        return [num_tokens]
    tokens_per_tile = max(1, int(budget // tile_bytes(1)))
    if lora is not None:  # LoRA's copies stop growing past one row block: the largest tile that fits, searched
        # from there (a tile's bytes never grow faster than its first token's)
        top = num_tokens
        while tokens_per_tile < top:
            mid = (tokens_per_tile + top + 1) // 2
            tokens_per_tile, top = (mid, top) if tile_bytes(mid) <= budget else (tokens_per_tile, mid - 1)
    return even_splits(num_tokens, _ceil_div(num_tokens, tokens_per_tile))


def _ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: float division rounds past 2**53 tokens and would give tiles over the bound."""
    return -(-a // b)
