"""The plan's Ulysses terms against a measured sequence-parallel rank, one ``torchrun --nproc_per_node 2`` launch
(gloo, CPU, SP 2 over both ranks).

Each check builds a Llama (under ``deepspeed.zero.Init`` for ZeRO-3), registers DeepSpeed's Ulysses attention
(``UlyssesSPAttentionHF``, as Accelerate does for ``tiledmlp train --sequence_parallel_size``), wraps the model with
``deepspeed.initialize`` and its sequence-parallel groups, and gives each rank its shard of one sequence as the SP
data-loader adapter does (``input_ids``, ``position_ids`` and the pre-shifted ``shift_labels``, ``seq / 2``
tokens each). The peak is measured as in ``_plan_zero_job.py``: the bytes of every tensor alive before the step plus
the profiler's exact peak of the step, the least of ``REPEATS`` steps, on the rank that holds the most (ZeRO-1)
or rank 0 (ZeRO-3).
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
from _common import run_plan_checks
from _plan_fsdp_job import _qlora
from _plan_zero_job import _live_bytes, llama, measured_peak

import tiledmlp
from tiledmlp.plan import ModelShape, Setup, predict_step_peak

SP = 2
# name: (recipe, ZeRO stage, --bf16, tokens, batch, vocabulary, KV heads, QLoRA). 4 heads, 2 a rank after the
# all-to-all; with fewer KV heads than ranks DeepSpeed repeats them, one a rank. Over 512 words a layer's backward
# is the peak; over 8192, the tiled loss's forward (the examples' ZeRO-3 recipe); untiled, the saved activations.
# QLoRA (since 2026-11-30): LoRA r 8 on every Linear over the 4-bit base as tiledmlp train loads it
CHECKS = {
    "saved-fp32-z1-mqa": ("untiled", 1, False, 4096, 1, 512, 1, False),
    "layer-fp32-z1-mqa": ("tiled+loss+ckpt", 1, False, 4096, 1, 512, 1, False),
    "layer-bf16-z1-mqa": ("tiled+loss+ckpt", 1, True, 8192, 1, 512, 1, False),
    "split-bf16-z3-gqa": ("tiled+loss+split", 3, True, 8192, 1, 512, 2, False),
    "loss-bf16-z3": ("tiled+loss+ckpt", 3, True, 4096, 1, 8192, 4, False),
    "batch2-bf16-z1": ("tiled+loss+ckpt", 1, True, 4096, 2, 8192, 4, False),
    "qlora-fp32-z1": ("tiled+loss+ckpt", 1, False, 4096, 1, 8192, 4, True),
}
_SDPA: list[Any] = []


def _ulysses(model: torch.nn.Module, seq: int, batch: int) -> Any:
    """DeepSpeed's Ulysses attention over sdpa for ``model``'s heads, and its groups, registered as Accelerate does
    for ``tiledmlp train`` (a fixed sequence length); again for each model, over transformers' own sdpa."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _SDPA:
        deepspeed.init_distributed(dist_backend="gloo")
        _SDPA.append(ALL_ATTENTION_FUNCTIONS["sdpa"])
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _SDPA[0]
    parallel_state_sp._release_sequence_parallel_groups()
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SP, micro_batch_size=batch,
        seq_length=seq, seq_length_is_variable=False)


def measure(recipe: str, stage: int, bf16: bool, seq: int, batch: int, vocab: int, kv_heads: int, qlora: bool,
            world: int, rank: int) -> dict[str, Any]:
    before = _live_bytes()
    model, config, ds = llama(stage, bf16, seq, vocab, kv_heads)
    if qlora:  # the same weights read back in 4 bits (float32 storage and compute), LoRA on every Linear
        model = _qlora(config, torch.float32).train()
    tiled = recipe != "untiled"
    offload, split = recipe.endswith(("+offload", "+split")), recipe.endswith("+split")
    if tiled:
        tiledmlp.patch(model, loss=True)
    if offload:
        tiledmlp.offload_activations(model, split_layers=split)
    elif tiled:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds,
                                      mpu=_ulysses(model, seq, batch))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    shard = slice(rank % SP * seq // SP, (rank % SP + 1) * seq // SP)
    inputs = {"input_ids": ids[:, shard], "position_ids": torch.arange(seq).expand(batch, seq)[:, shard],
              "labels": labels[:, shard], "shift_labels": labels[:, shard]}
    measured = measured_peak(engine, inputs, before, stage)
    del engine, model
    if rank != 0:
        return {}
    setup = Setup(dtype=torch.bfloat16 if bf16 else torch.float32, tiled_mlp=tiled, tiled_loss=tiled,
                  checkpointing=tiled, offload=offload, split_layers=split, device_type="cpu", world_size=world,
                  zero_stage=stage, sequence_parallel_size=SP, load_in_4bit=qlora, lora_r=8 if qlora else 0)
    planned = predict_step_peak(ModelShape.from_config(config), setup, seq, batch=batch)
    return {"measured": measured, "planned": planned.peak_bytes, "moment": planned.moment,
            "ratio": round(planned.peak_bytes / measured, 3)}


if __name__ == "__main__":
    run_plan_checks(CHECKS, measure)
