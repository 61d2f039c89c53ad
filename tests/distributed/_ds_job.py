"""DeepSpeed ZeRO-1/2/3 checks, run as ``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 _ds_job.py`` (gloo).

Each check trains a patched model with ``deepspeed.initialize`` for 2 optimizer steps (gradient accumulation
over 2 micro-batches per rank) and compares the full grads (``safe_get_full_grad``) and fp32 params
(``safe_get_full_fp32_param``) with the untiled single-process reference, which uses the same AdamW.
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
from _common import (EPS, LENGTHS, LR, MODELS, STEPS, Job, all_ranks, batch, compare, count_gate_calls, init,
                     lm_head_output_dims, loss_of, max_rel, tiled_forwards, tiles_run)
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import tiledmlp
from tiledmlp import distributed as tdist
from tiledmlp.memory import tile_activation_bytes

# per-tile activation budget of 40 tokens of the tiny MoE's experts (hidden 64, expert intermediate 32, top-2)
EXPERTS_TOKEN = tile_activation_bytes(1, 64, 32, dtype=torch.float32, path="generic", top_k=2)
MOE_TARGET_GB = 40 * EXPERTS_TOKEN / 2**30
# 100-token tiles: 1 tile on rank 0 (96 and 72 tokens), 2 on rank 1 (160 and 120), for the Llama's MLPs (hidden 64,
# intermediate 172) and the MoE's experts
ONE_VS_TWO = {"llama": 100 * tile_activation_bytes(1, 64, 172, dtype=torch.float32) / 2**30,
              "qwen3-moe": 100 * EXPERTS_TOKEN / 2**30}


def config(stage: int, bf16: bool = False, overlap_comm: bool = False) -> dict[str, Any]:
    micro = len(LENGTHS[0])
    return {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0,
                                                           "torch_adam": True}},
        # DeepSpeed clips grads itself, at 1.0 where its config says nothing (0.19): the torch reference does not
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              **({"overlap_comm": True} if overlap_comm else {})},  # else DeepSpeed's default
        "steps_per_print": 10**9,
    }


def ds_train(job: Job, stage: int, kind: str, options: dict[str, Any], bf16: bool = False, overlap_comm: bool = False
             ) -> tuple[list, dict[str, Any]]:
    """Train under ZeRO-``stage``; returns (grads, params) per step and tile-count figures: per forward, the
    most tiles this rank's own plan asked for and the most ``last_num_tiles`` reported (what ran)."""
    model = MODELS[kind]()
    tiled_mlps = len(tiledmlp.patch(model, **options).patched)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, bf16, overlap_comm))
    gate_calls = count_gate_calls(engine.module)
    head_dims = lm_head_output_dims(engine.module)
    collectives_before = tdist.TILE_AGREEMENT.collectives
    tiles_before = tdist.TILE_AGREEMENT.tiles_run
    planned: list[int] = []

    def plan_hook(module: torch.nn.Module, args: tuple) -> None:
        x, tiled = args[0], module.forward
        top_k = args[1].shape[-1] if tiled.spec.routed else None  # experts: the routing index [T, k]
        planned.append(len(tiled.plan(x.numel() // x.shape[-1], x, top_k=top_k)))

    for f in tiled_forwards(engine.module):
        f.module.register_forward_pre_hook(plan_hook)
    local_tiles: list[int] = []
    reported: list[int] = []
    steps = []
    micro = len(LENGTHS[job.rank])
    for step in range(STEPS):
        for m in range(micro):
            planned.clear()
            loss = loss_of(engine, batch(step, job.rank, m))
            local_tiles.append(max(planned, default=0))
            reported.append(max(tiles_run(engine.module), default=0))
            engine.backward(loss)
            if m == micro - 1:
                grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                         if p.requires_grad}
            engine.step()
        steps.append((grads, {n: _full_param(p) for n, p in engine.module.named_parameters()}))
    figures = {
        "local_plan_tiles_per_rank": all_ranks(local_tiles),
        "last_num_tiles_per_rank": all_ranks(reported),
        "tiles": sorted({t for rank in all_ranks(reported) for t in rank}),
        "tiled_mlps": tiled_mlps,
        "gate_proj_calls_per_rank": all_ranks(gate_calls[0]),
        "agreement_collectives": tdist.TILE_AGREEMENT.collectives - collectives_before,
        "zero3_tiles_run_per_rank": all_ranks(tdist.TILE_AGREEMENT.tiles_run - tiles_before),
        "forwards": STEPS * micro,
        "lm_head_output_dims": sorted(set(head_dims)),
    }
    engine.destroy()
    return steps, figures


def zero_check(job: Job, stage: int, kind: str, overlap_comm: bool = False, **options: Any) -> dict[str, Any]:
    """Tiled vs untiled under the same ZeRO stage (the exactness check), and both vs the torch reference."""
    tiled, figures = ds_train(job, stage, kind, options, overlap_comm=overlap_comm)
    untiled, _ = ds_train(job, stage, kind, {"num_shards": 1}, overlap_comm=overlap_comm)
    if job.rank != 0:
        return {}
    vs_untiled = compare(tiled, untiled)
    vs_torch, untiled_vs_torch = compare(tiled, job.ref(kind)), compare(untiled, job.ref(kind))
    first_grads, _ = max_rel(tiled[0][0], job.ref(kind)[0][0])  # before DeepSpeed's optimizer has run
    return {**vs_untiled, **figures, "tiled_vs_torch_first_step_grad_rel": first_grads,
            "tiled_vs_torch_grad_rel": vs_torch["grad_rel"], "tiled_vs_torch_param_rel": vs_torch["param_rel"],
            "untiled_vs_torch_grad_rel": untiled_vs_torch["grad_rel"],
            "untiled_vs_torch_param_rel": untiled_vs_torch["param_rel"]}


def bf16_check(job: Job, stage: int) -> dict[str, Any]:
    """bf16 under ZeRO-``stage``: tiled and untiled first-step grads, each against the float32 torch reference."""
    tiled, _ = ds_train(job, stage, "llama", {"num_shards": 4}, bf16=True)
    untiled, _ = ds_train(job, stage, "llama", {"num_shards": 1}, bf16=True)
    if job.rank != 0:
        return {}
    ref = job.ref("llama")[0][0]
    t_worst, t_name = max((_rel(tiled[0][0][n], ref[n]), n) for n in ref)
    u_worst, u_name = max((_rel(untiled[0][0][n], ref[n]), n) for n in ref)
    ratio, name = max((_rel(tiled[0][0][n], ref[n]) / _rel(untiled[0][0][n], ref[n]), n) for n in ref)
    return {"tiled_vs_fp32_grad_rel": t_worst, "untiled_vs_fp32_grad_rel": u_worst, "worst_ratio": ratio,
            "worst_ratio_param": name, "tiled_worst": t_name, "untiled_worst": u_name}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _full_param(p: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master copy of a trained param; a frozen one (no master copy) gathered as it is."""
    if p.requires_grad:
        return safe_get_full_fp32_param(p).detach().clone()
    with deepspeed.zero.GatheredParameters([p]):
        return p.detach().clone()


def main() -> None:
    init()
    job = Job()
    checks = {
        "zero1_llama": lambda: zero_check(job, 1, "llama", num_shards=4),
        "zero2_llama": lambda: zero_check(job, 2, "llama", num_shards=4),
        "zero3_llama": lambda: zero_check(job, 3, "llama", num_shards=4),
        # "auto" plans 2 tiles at 96 tokens (rank 0) and 3 at 160 (rank 1): the ranks must agree on 3
        "zero3_llama_uneven_auto": lambda: zero_check(job, 3, "llama", num_shards="auto"),
        # 40-token tiles: 3 tiles at 96 tokens, 4 at 160 (and 2 vs 3 for the second micro-batch)
        "zero3_moe_uneven_target": lambda: zero_check(job, 3, "qwen3-moe", target_gb=MOE_TARGET_GB),
        # nothing to land in the MLPs, but ZeRO-3 still gathers their weights per tile: the ranks must agree
        "zero3_frozen_mlp_uneven_auto": lambda: zero_check(job, 3, "llama-frozen-mlp", num_shards="auto"),
        "zero2_moe": lambda: zero_check(job, 2, "qwen3-moe", num_shards=4),
        # ZeRO-2 (and ZeRO-1 with overlap_comm) fill reduce buckets in the order grads become ready: a 1-tile rank
        # and a 2-tile rank must make them ready in the same order (GLU path, generic path), 2 and 3 tiles too
        "zero2_llama_one_vs_two_tiles": lambda: zero_check(job, 2, "llama", target_gb=ONE_VS_TWO["llama"]),
        "zero2_moe_one_vs_two_tiles": lambda: zero_check(job, 2, "qwen3-moe", target_gb=ONE_VS_TWO["qwen3-moe"]),
        "zero1_overlap_llama_one_vs_two_tiles": lambda: zero_check(job, 1, "llama", overlap_comm=True,
                                                                   target_gb=ONE_VS_TWO["llama"]),
        "zero2_llama_uneven_auto": lambda: zero_check(job, 2, "llama", num_shards="auto"),
        # the tiled loss too: lm_head's weight is gathered around its call, the grad lands once through DeepSpeed
        # checkpointed layers: the recompute stops before the tiled MLP (no tiles, no per-tile gathers there)
        "zero3_llama_checkpointed": lambda: zero_check(job, 3, "llama-checkpointed", num_shards=4),
        "zero3_llama_bf16": lambda: bf16_check(job, 3),
        "zero2_llama_bf16": lambda: bf16_check(job, 2),
        "zero3_llama_tiled_loss": lambda: zero_check(job, 3, "llama", num_shards=4, loss=True),
    }
    job.run(checks)


if __name__ == "__main__":
    main()
