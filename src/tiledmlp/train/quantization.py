"""QLoRA in ``tiledmlp train`` (``--load_in_4bit``): the base model's Linear weights held in 4 bits by bitsandbytes,
frozen, with LoRA adapters trained over them.

The weights are quantized by transformers' own loader (``BitsAndBytesConfig``); PEFT's
``prepare_model_for_kbit_training`` then casts what stays unquantized (embeddings, head, norms) to float32, as TRL
does. Under FSDP2 (``--fsdp``) the packed 4-bit weights are held in a floating storage (``bnb_4bit_quant_storage``:
float32, or bf16 under ``--bf16``), which FSDP2 shards like the other weights; accelerate leaves bitsandbytes'
default uint8 storage whole on every rank. The tiled MLPs take the generic engine over such a model: each tile runs
the module itself, bitsandbytes dequantizing its weights, so the grads are the untiled model's
(``tests/test_qlora.py``).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import tempfile
from typing import Any

import torch
from transformers import TrainingArguments

from .args import ModelArguments, UsageError, first_line

__all__ = ["check_quantization", "quant_storage", "quantization_config", "requantize", "prepare_quantized",
           "quantization_record", "check_quantization_record"]

QUANT_TYPES = ("nf4", "fp4")
_FLAGS = ("load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant")


def check_quantization(m: ModelArguments, train_args: TrainingArguments, zero_stage: int) -> None:
    """Flag checks before anything loads: a 4-bit base trains only through adapters, on one process, DDP, ZeRO-1/2
    (``zero_stage`` the DeepSpeed config's; the base whole on every rank, Ulysses sequence parallelism too) or FSDP2
    (sharded)."""
    if not m.load_in_4bit:
        if m.bnb_4bit_quant_type != "nf4" or m.use_bnb_nested_quant:
            flag = "--use_bnb_nested_quant" if m.use_bnb_nested_quant else "--bnb_4bit_quant_type"
            raise UsageError(f"{flag} sets up 4-bit weights: pass --load_in_4bit true too, or drop it")
        return
    if m.lora_r <= 0:
        raise UsageError("--load_in_4bit freezes the base model's weights in 4 bits: train LoRA adapters over them "
                         "(QLoRA) with --lora_r N (8-64 is usual), or drop --load_in_4bit")
    if m.bnb_4bit_quant_type not in QUANT_TYPES:
        raise UsageError(f"--bnb_4bit_quant_type must be nf4 or fp4, got {m.bnb_4bit_quant_type!r}")
    if zero_stage >= 3:
        raise UsageError("--load_in_4bit with --deepspeed ZeRO-3 is not supported here: shard a 4-bit base with "
                         "--fsdp (FSDP2), or run one process, DDP or DeepSpeed ZeRO-1/2")
    if train_args.fsdp and (train_args.fsdp_plugin_args or {}).get("fsdp_version") == 1:
        raise UsageError("--load_in_4bit with FSDP1 (fsdp_config version 1) is not supported here: use FSDP2 "
                         "(fsdp_config version 2, the default), which shards the 4-bit weights")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--load_in_4bit needs bitsandbytes: pip install 'tiledmlp[qlora]'")


def quant_storage(train_args: TrainingArguments) -> torch.dtype:
    """The dtype the packed 4-bit weights are stored in. Under FSDP2 the dtype its all-gather casts every weight to:
    ``--bf16``'s (accelerate's mixed precision), else float32 (every other weight's once prepared); a cast would
    rewrite the packed bytes (``shape '[64, 32]' is invalid for input of size 1024``). Else bitsandbytes' uint8."""
    if not train_args.fsdp:
        return torch.uint8
    return torch.bfloat16 if train_args.bf16 else torch.float16 if train_args.fp16 else torch.float32


def quantization_config(m: ModelArguments, dtype: torch.dtype, storage: torch.dtype = torch.uint8) -> Any:
    """transformers' ``BitsAndBytesConfig`` for these flags; the matmuls compute in the weights' ``--dtype``, the
    packed weights stored in ``storage`` (:func:`quant_storage`)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=m.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=m.use_bnb_nested_quant, bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_quant_storage=storage)


def requantize(model: torch.nn.Module, quant: Any, device: torch.device) -> torch.nn.Module:
    """``model`` loaded again through ``quant``: for models that cannot be quantized as they load (the embedded
    GGUF SmolLM2, which transformers expands to float32 and refuses to combine with a quantization config, and the
    tiny test models built in code). Written to a temporary checkpoint, freed, then read back in 4 bits onto
    ``device`` (the Trainer moves no quantized model); under torchrun by every rank for itself."""
    with tempfile.TemporaryDirectory(prefix="tiledmlp-4bit-") as folder:
        # every rank reads its own copy back: transformers writes files on rank 0 only once a process group exists
        model.should_save_on_this_rank = lambda is_main_process: True
        model.save_pretrained(folder)
        model_class, name = type(model), model.name_or_path
        del model
        gc.collect()
        try:
            model = model_class.from_pretrained(folder, quantization_config=quant, device_map={"": device})
        except (ValueError, ImportError, RuntimeError) as exc:
            raise UsageError(f"--load_in_4bit: {first_line(exc)}") from exc
    model.name_or_path = model.config.name_or_path = name
    return model


def prepare_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's preparation of a quantized model for training (what TRL runs): unquantized weights in float32,
    nothing trainable until the adapters come. Checkpointing stays with the Trainer's flags."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quantization_record(m: ModelArguments) -> dict[str, Any]:
    """The base's quantization flags, recorded in each checkpoint beside its data flags (``data_record.py``)."""
    return {flag: getattr(m, flag) for flag in _FLAGS}


def check_quantization_record(folder: str, m: ModelArguments) -> None:
    """Refuse resuming ``folder``'s adapter over a base quantized otherwise than it was trained over (the adapter
    alone does not say): it would go on training silently against other base weights. A checkpoint that recorded
    nothing is not checked."""
    from .data_record import DATA_RECORD

    try:
        with open(os.path.join(folder, DATA_RECORD)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return
    now = quantization_record(m)
    for flag in _FLAGS:
        if flag in saved and saved[flag] != now[flag]:
            value = str(saved[flag]).lower() if isinstance(saved[flag], bool) else saved[flag]
            raise UsageError(f"--resume_from_checkpoint {folder} was trained with --{flag} {value} "
                             f"({DATA_RECORD}), not {now[flag]}: its adapter would go on over other base weights; "
                             f"pass --{flag} {value}, or start a new run")
