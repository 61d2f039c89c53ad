"""PEFT LoRA on MoE experts' 3-D parameters, tiled vs untiled, per backend; run as
``torchrun --nproc_per_node 2 _lora_experts_job.py <check>...`` (gloo, CPU; ``DS_ACCELERATOR=cpu`` for ZeRO-3).

PEFT registers a parametrization on the experts' weights around its call and removes it after: a tile recomputed
in the backward rebuilds the weight from the LoRA factors the forward held. Each check trains one accumulation
step (2 micro-batches per rank, 96 and 72 tokens on rank 0, 160 and 120 on rank 1) of a tiny Qwen3-MoE with LoRA
on its experts and on q_proj, tiled and untiled under the same wrapping, and records the losses, the full LoRA
grads' largest relative difference and the tile counts the experts ran.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from _common import (LENGTHS, Job, all_ranks, batch, clean, init, llama, loss_of, max_rel, qwen3_moe, rel_err,
                     tiled_forwards)
from torch import nn

import tiledmlp
from tiledmlp import distributed as tdist
from tiledmlp.memory import tile_activation_bytes

SHARDS = 4
# the experts' 40-token tiles (hidden 64, expert intermediate 32, top-2)
MOE_TARGET_GB = 40 * tile_activation_bytes(1, 64, 32, dtype=torch.float32, path="generic", top_k=2) / 2**30
EXPERT_WEIGHTS = (".gate_up_proj", ".down_proj")  # the experts' fused 3-D weights (no other module has these names)


def lora_model(base_trainable: bool, dense: bool = False) -> nn.Module:
    """The same LoRA model on every rank; ``init_lora_weights=False``: B is not 0, so every factor gets a grad.
    ``base_trainable``: the experts' own 3-D weights train too (under ZeRO-3: landed per tile, beside the factors).
    ``dense``: a tiny Llama with LoRA on its MLPs' three projections and q_proj (the GLU path reads the adapters)."""
    from peft import LoraConfig, get_peft_model

    model = llama() if dense else qwen3_moe()
    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], init_lora_weights=False) \
        if dense else LoraConfig(r=4, target_modules=["q_proj"],
                                 target_parameters=[f"mlp.experts{w}" for w in EXPERT_WEIGHTS], init_lora_weights=False)
    model = get_peft_model(model, config)
    for name, p in model.named_parameters():
        if base_trainable and name.endswith(EXPERT_WEIGHTS):
            p.requires_grad_(True)
    return model


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.get_base_model().model.layers


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _fsdp1(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=True,
                device_id=torch.device("cpu"))


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)  # default flags: no static_graph, find_unused_parameters=False


def _zero(model: nn.Module, stage: int) -> nn.Module:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": len(LENGTHS[0]),
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    return engine


def _grads(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full (all-reduced, unsharded) grad after the accumulation step."""
    if hasattr(wrapped, "optimizer") and hasattr(wrapped, "module"):  # a DeepSpeed engine
        from deepspeed.utils import safe_get_full_grad

        return {clean(n): safe_get_full_grad(p).detach().clone() for n, p in wrapped.module.named_parameters()
                if p.requires_grad}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    gather = FSDP.summon_full_params(wrapped, with_grads=True) if isinstance(wrapped, FSDP) else nullcontext()
    with gather:
        return {clean(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                for n, p in wrapped.named_parameters() if p.requires_grad}


WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {"ddp": _ddp, "fsdp1": _fsdp1, "fsdp2": _fsdp2,
                                                      "zero1": lambda m: _zero(m, 1),
                                                      "zero2": lambda m: _zero(m, 2), "zero3": lambda m: _zero(m, 3)}


def run(rank: int, backend: str, options: dict[str, Any], base_trainable: bool, dense: bool = False
        ) -> dict[str, Any]:
    """One accumulation step; the losses, grads and, per micro-batch, the tiles each tiled experts module ran."""
    model = lora_model(base_trainable, dense)
    report = tiledmlp.patch(model, norms=False, **options)
    tiled = len(report.patched)
    wrapped = WRAPS[backend](model)
    losses, tiles = [], []
    before = tdist.TILE_AGREEMENT.tiles_run
    micro = len(LENGTHS[rank])
    for m in range(micro):
        loss = loss_of(wrapped, batch(0, rank, m)) / micro
        tiles.append([f.last_num_tiles for f in tiled_forwards(model)])
        losses.append(loss.item())
        if backend.startswith("zero"):
            wrapped.backward(loss)
            if backend != "zero3" and m < micro - 1:  # ZeRO-1/2 count micro-batches in step(): the last backward
                wrapped.step()  # is then the accumulation boundary, which reduces the grads read below
        else:
            loss.backward()
    result = {"losses": losses, "tiles": tiles, "tiled_mlps": tiled, "grads": _grads(wrapped),
              "paths": sorted({path for _, _, path in report.patched}),
              "zero3_tiles_run": tdist.TILE_AGREEMENT.tiles_run - before}
    if backend.startswith("zero"):
        wrapped.destroy()
    return result


def lora_check(job: Job, backend: str, base_trainable: bool = False, dense: bool = False, **options: Any
               ) -> dict[str, Any]:
    """Tiled (``patch`` ``options``, else 4 tiles) vs untiled under ``backend``: every rank's losses, the tiles the
    experts (``dense``: the MLPs) ran, and the largest relative difference of the grads."""
    got = run(job.rank, backend, options or {"num_shards": SHARDS}, base_trainable, dense)
    want = run(job.rank, backend, {"num_shards": 1}, base_trainable, dense)
    names = sorted(n for n in want["grads"] if ("mlp" if dense else "experts") in n and "lora_" in n)
    base = sum(n.endswith(EXPERT_WEIGHTS) for n in want["grads"])
    rel, worst = max_rel(got["grads"], want["grads"])
    diff = max((got["grads"][n] - want["grads"][n]).abs().max().item() for n in want["grads"])
    experts = max(rel_err(got["grads"][n], want["grads"][n]) for n in names)
    figures = {"grad_rel": rel, "grad_worst": worst, "grad_max_abs_diff": diff, "expert_lora_grad_rel": experts,
               "expert_lora_grads": len(names), "expert_base_grads": base, "tiled_mlps": got["tiled_mlps"], "losses_per_rank": all_ranks(got["losses"]),
               "untiled_losses_per_rank": all_ranks(want["losses"]), "tiles_per_rank": all_ranks(got["tiles"]),
               "zero3_tiles_run_per_rank": all_ranks(got["zero3_tiles_run"]), "paths": got["paths"]}
    return figures if job.rank == 0 else {}


def main() -> None:
    init()
    job = Job()
    checks = {"ddp": lambda: lora_check(job, "ddp"), "fsdp2": lambda: lora_check(job, "fsdp2"),
              "ddp_dense": lambda: lora_check(job, "ddp", dense=True),
              "fsdp2_dense": lambda: lora_check(job, "fsdp2", dense=True),
              "fsdp1_dense": lambda: lora_check(job, "fsdp1", dense=True),
              "zero1_dense": lambda: lora_check(job, "zero1", dense=True),
              "zero2_dense": lambda: lora_check(job, "zero2", dense=True),
              # 40-token tiles: 3 at rank 0's 96 tokens, 4 at rank 1's 160 (2 vs 3 for the second micro-batch), so
              # rank 0 pads with a 0-token tile
              "zero3_uneven_target": lambda: lora_check(job, "zero3", target_gb=MOE_TARGET_GB),
              "zero3_base_trainable": lambda: lora_check(job, "zero3", base_trainable=True, target_gb=MOE_TARGET_GB)}
    job.run(checks)


if __name__ == "__main__":
    main()
