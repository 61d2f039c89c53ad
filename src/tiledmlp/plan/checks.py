"""Input checks of the plan's Python API: a bad argument is refused by name, with the values it takes.

Without them ``predict_step_peak`` planned 0 or negative tokens, an unknown ``accumulate`` or device as if valid,
and failed deep inside on others (a KeyError for ``torch.int8``, ZeroDivisionError for
``sequence_parallel_size=0``, a TypeError from string formatting for ``seq="128"``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ELEMENT_SIZES", "DEVICE_TYPES", "FSDP_MODES", "check_positive_int", "check_dtype", "check_device_type",
           "check_accumulate", "check_setup"]

# Element sizes of the weight dtypes the plan models
ELEMENT_SIZES: dict[torch.dtype, int] = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}
# Device types with terms of their own: CUDA/XPU (compiled tile kernels, foreach AdamW; CUDA's BLAS workspace),
# CPU and MPS (host memory: offloading moves nothing). Any other type torch knows (hpu, an npu its extension
# registers) is planned as a device without them: tiledmlp train passes its Trainer's device type.
DEVICE_TYPES = ("cuda", "xpu", "cpu", "mps")
_ACCUMULATE = ("auto", "param")
# FSDP's sharding strategies the plan models ("": none; Trainer's no_shard is DDP's memory)
FSDP_MODES = ("", "full_shard", "shard_grad_op")


def check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def check_dtype(name: str, dtype: Any) -> None:
    if dtype not in ELEMENT_SIZES:
        allowed = ", ".join(str(d) for d in ELEMENT_SIZES)
        raise ValueError(f"{name} must be one of {allowed}, got {dtype!r}")


def check_device_type(name: str, device_type: Any) -> None:
    if device_type in DEVICE_TYPES:
        return
    try:
        known = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        known = False
    if not known:
        raise ValueError(f"{name} must be a device type torch knows, e.g. {', '.join(map(repr, DEVICE_TYPES))} (no "
                         f"index), got {device_type!r}")


def check_accumulate(name: str, accumulate: Any) -> None:
    if accumulate not in _ACCUMULATE:
        raise ValueError(f"{name} must be 'auto' or 'param' (as --tiled_accumulate_dtype), got {accumulate!r}")


def check_setup(setup: Any, optimizers: dict[str, Any]) -> None:
    """Every field of a :class:`tiledmlp.plan.setup.Setup` that the plan reads as a number or a name."""
    from ..tiling import validate_num_shards

    check_dtype("Setup.dtype", setup.dtype)
    if setup.autocast and setup.dtype != torch.float32:
        raise ValueError(f"Setup.autocast=True autocasts float32 weights (--bf16 true); dtype is {setup.dtype}")
    if setup.optim not in optimizers:
        raise ValueError(f"Setup.optim {setup.optim!r} is not modelled; use one of {', '.join(sorted(optimizers))}")
    check_positive_int("Setup.lora_r", setup.lora_r, minimum=0)
    dropout = setup.lora_dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"Setup.lora_dropout must be a number in [0, 1) (as --lora_dropout), got {dropout!r}")
    if setup.load_in_4bit and (not setup.lora_r or setup.dtype != torch.float32 or setup.zero_stage >= 3):
        raise ValueError("Setup.load_in_4bit (QLoRA) plans LoRA adapters (lora_r > 0) over a 4-bit base whose other "
                         "weights PEFT made float32 (dtype float32), on one process, DDP, ZeRO-1/2 (with sequence "
                         "parallelism too) or FSDP, as tiledmlp train runs it; got "
                         f"lora_r={setup.lora_r}, dtype={setup.dtype}, zero_stage={setup.zero_stage}")
    if setup.bnb_nested_quant and not setup.load_in_4bit:
        raise ValueError("Setup.bnb_nested_quant quantizes 4-bit weights' scales: set load_in_4bit=True too")
    check_positive_int("Setup.sequence_parallel_size", setup.sequence_parallel_size)
    check_positive_int("Setup.world_size", setup.world_size)
    if setup.zero_stage not in (0, 1, 2, 3) or isinstance(setup.zero_stage, bool):
        raise ValueError(f"Setup.zero_stage must be 0, 1, 2 or 3, got {setup.zero_stage!r}")
    if setup.fsdp not in FSDP_MODES:
        raise ValueError(f"Setup.fsdp must be one of {', '.join(map(repr, FSDP_MODES))}, got {setup.fsdp!r}")
    if setup.fsdp and setup.zero_stage:
        raise ValueError(f"Setup.fsdp {setup.fsdp!r} and Setup.zero_stage {setup.zero_stage}: a run shards with "
                         "one of FSDP and DeepSpeed ZeRO, as the Trainer takes one; set the other to its default")
    if setup.fsdp and setup.sequence_parallel_size > 1:
        raise ValueError("Setup.fsdp with Setup.sequence_parallel_size > 1: sequence parallelism runs on DeepSpeed "
                         "(tiledmlp train refuses it beside --fsdp)")
    try:
        validate_num_shards(setup.mlp_num_shards)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"Setup.mlp_num_shards: {exc}") from None
    target = setup.mlp_target_gb
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target < math.inf):  # as patch(target_gb=) takes it
        raise ValueError(f"Setup.mlp_target_gb must be None or a finite number > 0 (GiB per tile), got {target!r}")
    check_accumulate("Setup.accumulate", setup.accumulate)
    check_device_type("Setup.device_type", setup.device_type)
