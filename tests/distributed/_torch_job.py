"""DDP, FSDP2 and FSDP1 checks, run as ``torchrun --nproc_per_node 2 _torch_job.py`` (gloo, CPU).

Each check trains a patched model for 2 optimizer steps of 2 micro-batches per rank and records the largest
relative error of the gathered grads and the params against the untiled single-process reference.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from _common import (EPS, LENGTHS, LR, STEPS, Job, batch, clean, compare, count_reduce_scatters, init, llama,
                     lm_head_output_dims, loss_of, qwen3_moe, tiles_run)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import tiledmlp

SHARDS = 4
REDUCE_SCATTERS = [0]


def train(model: torch.nn.Module, rank: int, grads: Callable[[], dict], params: Callable[[], dict],
          no_sync: Callable[[], Any] | None = None) -> tuple[list[tuple[dict, dict]], list[int]]:
    """2 steps x 2 micro-batches; returns (grads, params) per step and reduce-scatters per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    out, scatters = [], []
    micro = len(LENGTHS[rank])
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        before = REDUCE_SCATTERS[0]
        for m in range(micro):
            ctx = no_sync() if no_sync is not None and m < micro - 1 else contextlib.nullcontext()
            with ctx:
                (loss_of(model, batch(step, rank, m)) / micro).backward()
        scatters.append(REDUCE_SCATTERS[0] - before)
        g = grads()
        opt.step()
        out.append((g, params()))
    return out, scatters


def ddp_check(job: Job, kind: str, norms: bool = False) -> dict[str, Any]:
    """``norms``: the RMSNorms row-tiled too (3 tiles), compared on the first step only (see _first_step)."""
    model = llama() if kind == "llama" else qwen3_moe()
    report = tiledmlp.patch(model, num_shards=SHARDS, norms=3 if norms else True)
    ddp = DDP(model)  # default flags: no static_graph, find_unused_parameters=False
    steps, _ = train(ddp, job.rank, lambda: {clean(n): p.grad.clone() for n, p in ddp.named_parameters()},
                     lambda: {clean(n): p.detach().clone() for n, p in ddp.named_parameters()}, ddp.no_sync)
    paths = sorted({path for _, _, path in report.patched})
    tiles = tiles_run(model)  # a patch that tiled nothing reports none
    if norms:
        steps = _first_step(steps, report.norms_patched)
    return {**compare(steps, job.ref(kind)[: len(steps)]), "paths": paths, "tiles": tiles} if job.rank == 0 else {}


def _first_step(steps: list, norms_patched: int) -> list:
    """Tiled norms sum in another order than autograd (their weights' grads per tile; in float32 models their
    input grad meets the residual's after, not between, its two parts): 1e-7 differences. AdamW's first update
    is lr * sign(grad), so an element whose grad is rounding noise flips, and the next step's grads move by far
    more. Runs with tiled norms are therefore compared on the first step's grads."""
    assert norms_patched > 0
    return steps[:1]


def _fsdp2(model: torch.nn.Module, mlp_unit: bool, linear_units: bool, mp: MixedPrecisionPolicy | None) -> None:
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        if linear_units:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                fully_shard(proj, **kw)
        if mlp_unit:
            fully_shard(layer.mlp, **kw)
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp2_run(rank: int, tiled: bool, mlp_unit: bool, mp: MixedPrecisionPolicy | None,
              norms: bool = False) -> tuple[list, list, list[int]]:
    """(grads, params) per step, reduce-scatters per step, and the tile counts the MLPs ran."""
    model = llama()
    if tiled:
        assert tiledmlp.patch(model, num_shards=SHARDS, norms=3 if norms else True).norms_patched > 0
    _fsdp2(model, mlp_unit, False, mp)
    steps, scatters = train(model, rank, lambda: {n: _full(p.grad).clone() for n, p in model.named_parameters()},
                            lambda: {n: _full(p.detach()).clone() for n, p in model.named_parameters()})
    return steps, scatters, tiles_run(model)


def fsdp2_check(job: Job, mlp_unit: bool) -> dict[str, Any]:
    steps, scatters, tiles = fsdp2_run(job.rank, True, mlp_unit, None)
    _, untiled_scatters, _ = fsdp2_run(job.rank, False, mlp_unit, None)
    result = {"reduce_scatters_per_step": scatters, "untiled_reduce_scatters_per_step": untiled_scatters,
              "tiles": tiles}
    return {**compare(steps, job.ref("llama")), **result} if job.rank == 0 else {}


def fsdp2_norms_check(job: Job) -> dict[str, Any]:
    """FSDP2 with the RMSNorms row-tiled as well (the norms' weights are in each layer's unit)."""
    steps, _, tiles = fsdp2_run(job.rank, True, False, None, norms=True)
    return {**compare(_first_step(steps, 1), job.ref("llama")[:1]), "tiles": tiles} if job.rank == 0 else {}


def fsdp2_bf16_check(job: Job) -> dict[str, Any]:
    """Tiled vs untiled FSDP2 under the same bf16 policy, each also measured against the fp32 reference."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tiled, scatters, tiles = fsdp2_run(job.rank, True, False, mp)
    untiled, untiled_scatters, _ = fsdp2_run(job.rank, False, False, mp)
    if job.rank != 0:
        return {}
    vs_untiled = compare(tiled, untiled)
    return {"tiled_vs_untiled_grad_rel": vs_untiled["grad_rel"], "tiled_vs_untiled_param_rel": vs_untiled["param_rel"],
            "tiled_vs_fp32_grad_rel": compare(tiled, job.ref("llama"))["grad_rel"],
            "untiled_vs_fp32_grad_rel": compare(untiled, job.ref("llama"))["grad_rel"],
            "tiled_vs_fp32_param_rel": compare(tiled, job.ref("llama"))["param_rel"],
            "untiled_vs_fp32_param_rel": compare(untiled, job.ref("llama"))["param_rel"],
            "reduce_scatters_per_step": scatters, "untiled_reduce_scatters_per_step": untiled_scatters,
            "tiles": tiles}


def _refusal(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def inner_units_check(job: Job) -> dict[str, Any]:
    """Each Linear of the MLP its own FSDP2 / FSDP1 unit: refused at patch and at the first forward."""
    model = llama()
    _fsdp2(model, False, True, None)
    at_patch = _refusal(lambda: tiledmlp.patch(model, num_shards=SHARDS))
    model = llama()
    tiledmlp.patch(model, num_shards=SHARDS)
    _fsdp2(model, False, True, None)
    at_forward = _refusal(lambda: loss_of(model, batch(0, job.rank, 0)))
    fsdp1 = FSDP(llama(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), use_orig_params=True,
                 device_id=torch.device("cpu"))
    fsdp1_at_patch = _refusal(lambda: tiledmlp.patch(fsdp1, num_shards=SHARDS))
    return {"fsdp2_at_patch": at_patch, "fsdp2_at_forward": at_forward, "fsdp1_at_patch": fsdp1_at_patch}


def fsdp1_check(job: Job, loss: bool = False) -> dict[str, Any]:
    model = llama()
    tiledmlp.patch(model, num_shards=SHARDS, loss=loss)
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=True,
                device_id=torch.device("cpu"))  # on GPUs: the rank's device

    def gathered(grad: bool) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(fsdp, with_grads=grad):
            return {clean(n): (p.grad if grad else p).detach().clone() for n, p in fsdp.named_parameters()}

    head_dims = lm_head_output_dims(fsdp)
    steps, _ = train(fsdp, job.rank, lambda: gathered(True), lambda: gathered(False))
    figures = {"lm_head_output_dims": sorted(set(head_dims)), "tiles": tiles_run(model)}
    return {**compare(steps, job.ref("llama")), **figures} if job.rank == 0 else {}


def fsdp1_flat_params_check(job: Job) -> dict[str, Any]:
    """``use_orig_params=False``: the MLPs hold no parameters, their weights are views of the unit's flat
    parameter; a hooked gate_proj sends them down the generic path. One micro-batch's sharded flat-param grads,
    tiled vs untiled under the same wrapping (with ``with_grads``, summon_full_params needs use_orig_params)."""
    def flat_grads(tiled: bool) -> tuple[list[torch.Tensor], list[str]]:
        model = llama().double()  # float64: tiled and untiled agree to rounding
        for layer in model.model.layers:
            layer.mlp.gate_proj.register_forward_hook(lambda module, args, out: None)
        paths = sorted({p for _, _, p in tiledmlp.patch(model, num_shards=SHARDS).patched}) if tiled else []
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=False,
                    device_id=torch.device("cpu"))
        loss_of(fsdp, batch(0, job.rank, 0)).backward()
        return [p.grad.clone() for p in fsdp.parameters()], paths

    ref, _ = flat_grads(False)
    got, paths = flat_grads(True)
    err = torch.tensor([max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))], dtype=torch.float64)
    torch.distributed.all_reduce(err, op=torch.distributed.ReduceOp.MAX)
    return {"max_rel_err": float(err), "paths": paths} if job.rank == 0 else {}


def main() -> None:
    init()
    count_reduce_scatters(REDUCE_SCATTERS)
    job = Job()
    checks = {
        "ddp_llama": lambda: ddp_check(job, "llama"),
        "ddp_moe": lambda: ddp_check(job, "qwen3-moe"),
        "ddp_llama_norms": lambda: ddp_check(job, "llama", norms=True),
        "fsdp2_norms": lambda: fsdp2_norms_check(job),
        "fsdp2_layer_unit": lambda: fsdp2_check(job, mlp_unit=False),
        "fsdp2_mlp_unit": lambda: fsdp2_check(job, mlp_unit=True),
        "fsdp2_bf16": lambda: fsdp2_bf16_check(job),
        "fsdp_inner_linear_units": lambda: inner_units_check(job),
        "fsdp1_use_orig_params": lambda: fsdp1_check(job),
        "fsdp1_tiled_loss": lambda: fsdp1_check(job, loss=True),  # lm_head inside the root unit
        "fsdp1_flat_params": lambda: fsdp1_flat_params_check(job),
    }
    job.run(checks)


if __name__ == "__main__":
    main()
