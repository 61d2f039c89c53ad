"""Ulysses sequence parallelism for ``tiledmlp train`` (``--sequence_parallel_size N``, with ``--deepspeed``).

Nothing here moves tensors between ranks: DeepSpeed's ALST implementation does (``UlyssesSPAttentionHF``, an
all-to-all around attention, and ``UlyssesSPDataLoaderAdapter``, which shards every batch on the sequence dim).
Both are switched on the way Accelerate and ``transformers.Trainer`` already provide: a ``ParallelismConfig``
with the DeepSpeed SP backend in ``TrainingArguments.parallelism_config``. This module checks the input before
anything starts (each problem one :class:`UsageError` line), builds that config, initialises the process group
where Accelerate would not (CPU), and adds the ``position_ids`` every SP batch must carry.

Each rank then holds ``seq / N`` tokens: tiled MLPs plan their tiles on that shard, and the tiled loss gets the
shard's pre-shifted ``shift_labels``. Trainer combines the ranks' losses (each a mean over its labelled tokens)
weighted by their labelled-token counts, which is the full sequence's mean; the tiled loss returns 0 with zero
grads for a shard with no labelled token, so any mix of masked tokens per rank is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainingArguments, default_data_collator

from .args import UsageError

__all__ = ["SP_ATTENTION", "check_args", "check_model", "enable", "sp_size", "collate_with_position_ids"]

# Attention kernels Ulysses can wrap through Accelerate (DeepSpeed also takes flex_attention, Accelerate refuses
# it; eager needs a full 4-D mask, which SP drops). Hub-hosted flash kernels ("org/flash-attn...") work too.
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def _usable_attention(name: str) -> bool:
    return name in SP_ATTENTION or ("/" in name and "flash-attn" in name)


def check_args(n: int, max_seq_length: int, train_args: TrainingArguments, attn_implementation: str | None,
               world_size: int) -> None:
    """The checks that need no model: run by ``parse_args`` so bad flags fail in milliseconds."""
    if n < 1:
        raise UsageError(f"--sequence_parallel_size must be >= 1, got {n}")
    if n == 1:
        return
    if not train_args.deepspeed:
        raise UsageError(f"--sequence_parallel_size {n} needs --deepspeed CONFIG.json (Ulysses SP is DeepSpeed's "
                         "ALST implementation, e.g. examples/ds_zero3.json)")
    if train_args.fsdp:
        raise UsageError(f"--sequence_parallel_size {n} runs on DeepSpeed; drop --fsdp")
    if max_seq_length % n:
        raise UsageError(f"--max_seq_length {max_seq_length} is not divisible by --sequence_parallel_size {n}; "
                         f"use a multiple of {n}")
    if world_size % n:
        raise UsageError(f"--sequence_parallel_size {n} does not divide the {world_size} process(es) launched; "
                         f"launch a multiple of {n} (torchrun --nproc_per_node {n})")
    if attn_implementation is not None and not _usable_attention(attn_implementation):
        raise UsageError(f"--attn_implementation {attn_implementation} cannot run under --sequence_parallel_size; "
                         f"use one of {', '.join(SP_ATTENTION)}")


def check_model(model: torch.nn.Module, n: int) -> str:
    """Heads and attention kernel of the loaded model; returns the attention implementation to wrap."""
    config = model.config.get_text_config()
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if not _usable_attention(attn):
        raise UsageError(f"--sequence_parallel_size {n}: the model's attention is {attn!r}, which Ulysses SP cannot "
                         f"wrap; pass --attn_implementation sdpa (or {', '.join(SP_ATTENTION[1:])})")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if n > heads:
        raise UsageError(f"--sequence_parallel_size {n} is more SP ranks than the model's {heads} attention heads "
                         "(Ulysses gives each rank whole heads); use a divisor of the head count")
    if heads % n:
        raise UsageError(f"--sequence_parallel_size {n} does not divide the model's {heads} attention heads; "
                         "use a divisor of the head count")
    if kv_heads % n and n % kv_heads:
        raise UsageError(f"--sequence_parallel_size {n} and the model's {kv_heads} key/value heads: one must divide "
                         "the other (DeepSpeed replicates kv heads only by a whole factor)")
    return attn


def _init_deepspeed_comm() -> None:
    """On CPU, Accelerate's state for ``use_cpu`` starts torch's process group but not DeepSpeed's communication
    layer, which Ulysses' group setup asserts while the model is prepared: start it (it reuses the group)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def enable(train_args: TrainingArguments, model: torch.nn.Module, n: int, seq_length: int) -> None:
    """Set ``train_args.parallelism_config`` to DeepSpeed Ulysses with ``n`` ranks (checks the model first)."""
    attn = check_model(model, n)
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if train_args.device.type == "cpu":
        _init_deepspeed_comm()
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_length, sp_seq_length_is_variable=False,
                                              sp_attn_implementation=attn)
    train_args.parallelism_config = ParallelismConfig(sp_size=n, sp_backend="deepspeed", sp_handler=handler)


def sp_size(train_args: TrainingArguments) -> int:
    """The SP degree ``train_args`` runs with (1 without sequence parallelism)."""
    config = getattr(train_args, "parallelism_config", None)
    return int(config.sp_size or 1) if config is not None and config.sp_backend == "deepspeed" else 1


def collate_with_position_ids(features: list[dict[str, Any]]) -> dict[str, Any]:
    """``default_data_collator`` plus ``position_ids`` (0..S-1 per row): the adapter shards them with the tokens,
    so after Ulysses' all-gather every rank's attention sees the global positions."""
    batch = default_data_collator(features)
    rows, length = batch["input_ids"].shape
    batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
    return batch
