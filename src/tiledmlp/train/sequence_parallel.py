"""Ulysses sequence parallelism for ``tiledmlp train`` (``--sequence_parallel_size N``, with ``--deepspeed``).

Nothing here moves tensors between ranks: DeepSpeed's ALST implementation does (``UlyssesSPAttentionHF``, an
all-to-all around attention, and ``UlyssesSPDataLoaderAdapter``, which shards every batch on the sequence dim).
Both are switched on the way Accelerate and ``transformers.Trainer`` already provide: a ``ParallelismConfig``
with the DeepSpeed SP backend in ``TrainingArguments.parallelism_config``. This module checks the input before
anything starts (each problem one :class:`UsageError` line), builds that config, initialises the process group
where Accelerate would not (CPU), and adds the ``position_ids`` every SP batch must carry.

Each rank then holds ``seq / N`` tokens: tiled MLPs plan their tiles on that shard, and the tiled loss gets the
shard's pre-shifted ``shift_labels`` and returns the mean over the shard's labelled tokens (0 with zero grads for
a shard with none). :class:`SequenceParallelTrainer` turns those into the loss Trainer computes without SP: the
sum of token losses over every rank, micro-batch (gradient accumulation) and data-parallel group of the step,
divided by their labelled-token count (Trainer's ``num_items_in_batch``, counted here over the shards), however
the masked tokens fall across ranks.

Why a subclass: how DeepSpeed reduces gradients under SP decides what each rank's backward must produce, and its
ZeRO stages differ (deepspeed 0.19.8): ZeRO-0/1/2 sum over the SP ranks and divide by the data-parallel degree;
ZeRO-3's reduce-scatter averages over every rank, SP ranks included. Trainer's own SP loss (transformers 5.23,
``deepspeed_sp_compute_loss``) combines through a differentiable all-gather whose backward hands each rank N
times its share: right under ZeRO-3, N times too large under ZeRO-1/2 (measured: 2.000x at SP=2; Adam's scale
invariance hides it from the losses, not from gradient clipping or the logged grad norm). It also averages
micro-batches and data-parallel groups with equal weight (``num_items_in_batch`` is switched off under SP).
Here each rank's backward carries exactly the share its ZeRO stage needs. ZeRO-3 with ``reduce_scatter: false``
reduces some buckets one way and some the other, so it is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments, default_data_collator

from .args import UsageError

__all__ = ["SP_ATTENTION", "check_args", "check_model", "check_router_aux_loss", "enable", "sp_size",
           "collate_with_position_ids", "combine_shard_losses", "SequenceParallelTrainer"]

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
    zero = (getattr(train_args, "hf_deepspeed_config", None) and
            train_args.hf_deepspeed_config.config.get("zero_optimization")) or {}
    if zero.get("stage") == 3 and zero.get("reduce_scatter", True) is False:
        raise UsageError(f"--sequence_parallel_size {n} with ZeRO-3 needs \"reduce_scatter\": true in the "
                         "DeepSpeed config (without it ZeRO-3 scales SP gradients inconsistently)")
    if attn_implementation is not None and not _usable_attention(attn_implementation):
        raise UsageError(f"--attn_implementation {attn_implementation} cannot run under --sequence_parallel_size; "
                         f"use one of {', '.join(SP_ATTENTION)}")
    if max_seq_length % n:
        raise UsageError(f"--max_seq_length {max_seq_length} is not divisible by --sequence_parallel_size {n}; "
                         f"use a multiple of {n}")
    if world_size % n:
        raise UsageError(f"--sequence_parallel_size {n} does not divide the {world_size} process(es) launched; "
                         f"launch a multiple of {n} (torchrun --nproc_per_node {n})")


def check_router_aux_loss(config: Any, n: int) -> None:
    """Refuse a MoE router load-balancing loss under SP. It multiplies two means over the whole sequence (the
    fraction of tokens routed to each expert and their mean router probability); each SP rank sees only its shard,
    so its per-shard value, re-weighted like the token loss, gives other losses and router grads than one
    process (measured at SP=2: router grads 14% off)."""
    if n == 1:
        return
    configs = {id(c): c for c in (config, config.get_text_config())}.values()
    for c in configs:
        coef = getattr(c, "router_aux_loss_coef", None)
        if getattr(c, "output_router_logits", False) and coef != 0:
            raise UsageError(
                f"--sequence_parallel_size {n} cannot train the model's router load-balancing loss "
                f"(output_router_logits=True, router_aux_loss_coef={coef}): it depends on the whole sequence, each "
                "SP rank holds a shard. Set \"output_router_logits\": false (or \"router_aux_loss_coef\": 0) in the "
                "model's config.json to train without it, or train with --sequence_parallel_size 1")


def check_model(model: torch.nn.Module, n: int) -> str:
    """Heads, attention kernel and router aux loss of the loaded model; returns the attention implementation to
    wrap."""
    check_router_aux_loss(model.config, n)
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
    # Accelerate sizes DeepSpeed's train_batch_size from the data-parallel size it is told (ZeRO's own DP degree
    # is world / n); left at 1, SP x DP fails DeepSpeed's batch-size check
    train_args.parallelism_config = ParallelismConfig(sp_size=n, sp_backend="deepspeed", sp_handler=handler,
                                                      dp_shard_size=train_args.world_size // n)


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


def combine_shard_losses(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any, num_items: torch.Tensor,
                         dp: int, grad_scale: float, ignore_index: int = -100) -> torch.Tensor:
    """This rank's part of the step's loss, from ``loss`` (the mean over the shard's labelled tokens).

    Gradient: ``grad_scale`` x (the shard's summed token loss) / ``num_items``. Value: the SP group's summed token
    loss x ``dp`` / ``num_items``, so Trainer's logged loss (summed over micro-batches, averaged over ranks) is the
    step's mean over every labelled token.
    """
    count = (shift_labels != ignore_index).sum().to(loss.dtype)
    # a shard with no labelled token contributes nothing (transformers' untiled loss is NaN there, 0/0)
    local_sum = torch.where(count > 0, loss, torch.zeros_like(loss)) * count
    group_sum = local_sum.detach().clone()
    dist.all_reduce(group_sum, group=group)
    items = num_items.to(loss.dtype).clamp(min=1)
    share = local_sum * grad_scale / items
    return share + (group_sum * dp / items - share).detach()


class SequenceParallelTrainer(Trainer):
    """``Trainer`` whose loss under DeepSpeed SP is the one without SP: same value, same gradient (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if sp_size(self.args) > 1:
            self.loss_is_scaled_for_ga = True  # divided by the step's labelled tokens, not per micro-batch

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Resuming skips the batches trained already with accelerate's ``skip_first_batches``, which rebuilds a
        ``DataLoader`` from the one it is handed: under SP that is DeepSpeed's data-loader adapter, which has no
        ``dataset`` (an AttributeError after the model had loaded, so an SP run could not be resumed). Here the
        adapter itself is advanced past them, every SP rank alike (each of its batches is gathered over them)."""
        import transformers.trainer as module

        real = module.skip_first_batches

        def skip(dataloader: Any, num_batches: int = 0) -> Any:
            if type(dataloader).__name__ != "UlyssesSPDataLoaderAdapter":
                return real(dataloader, num_batches)
            for _ in range(num_batches):
                next(dataloader)
            return dataloader

        module.skip_first_batches = skip
        try:
            return super().train(*args, **kwargs)
        finally:
            module.skip_first_batches = real

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The step's labelled tokens over all ranks: the shards' ``shift_labels`` (the SP data-loader adapter
        drops ``labels``) summed over every rank, as Trainer does without SP (average_tokens_across_devices)."""
        if sp_size(self.args) == 1 or not all("shift_labels" in b for b in batch_samples):
            return super()._get_num_items_in_batch(batch_samples, device)
        count = sum(int((b["shift_labels"] != -100).sum()) for b in batch_samples)
        total = torch.tensor(count, dtype=torch.int64, device=device)
        dist.all_reduce(total)
        return total

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        n = sp_size(self.args)
        if not model.training or n == 1:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        from deepspeed.utils import groups

        if "labels" not in inputs:  # the SP data-loader adapter replaced them by the pre-shifted shift_labels
            inputs["labels"] = inputs["shift_labels"]
        outputs = model(**inputs)
        world = dist.get_world_size()
        stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else 0
        loss = combine_shard_losses(outputs.loss, inputs["shift_labels"], groups._get_sequence_parallel_group(),
                                    num_items_in_batch, dp=world // n,
                                    grad_scale=float(world if stage == 3 else world // n))
        return (loss, outputs) if return_outputs else loss
