"""Activation offloading under DDP, FSDP2 and DeepSpeed ZeRO-3, one ``torchrun --nproc_per_node 2`` launch (gloo).

Each check trains the checkpointed tiny Llama (tiled MLP + tiled loss) for 2 optimizer steps of 2 micro-batches
per rank, once plainly, once under ``offload_activations`` (``_copy_on_cpu``: every saved tensor really goes
through the host copy and back) and once more with ``split_layers=True`` (attention split into head groups), and
records whether every grad and param came out bit-for-bit the same.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
from _common import EPS, LENGTHS, LR, STEPS, Job, batch, clean, init, llama_checkpointed, loss_of
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import tiledmlp
from tiledmlp import split_layers

split_layers.TOKENS_PER_CHUNK = 32  # the tiny sequences' attention runs in two head groups

Steps = list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def _model(offload: bool | str) -> tuple[torch.nn.Module, tiledmlp.ActivationOffloader | None]:
    model = llama_checkpointed()
    tiledmlp.patch(model, num_shards=4, loss=True, norms=3)
    off = tiledmlp.offload_activations(model, min_bytes=0, split_layers=offload == "split",
                                       _copy_on_cpu=True) if offload else None
    return model, off


def _train(rank: int, model: torch.nn.Module, backward: Callable[[torch.Tensor], None], step: Callable[[], None],
           grads: Callable[[], dict], params: Callable[[], dict]) -> Steps:
    out = []
    micro = len(LENGTHS[rank])
    for s in range(STEPS):
        for m in range(micro):
            backward(loss_of(model, batch(s, rank, m)) / micro)
        g = grads()
        step()
        out.append((g, params()))
    return out


def _torch_train(rank: int, wrapped: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]) -> Steps:
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, eps=EPS, weight_decay=0.0)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _train(rank, wrapped, lambda loss: loss.backward(), step,
                  lambda: {clean(n): full(p.grad).clone() for n, p in wrapped.named_parameters()},
                  lambda: {clean(n): full(p.detach()).clone() for n, p in wrapped.named_parameters()})


def ddp(rank: int, offload: bool | str) -> tuple[Steps, Any]:
    model, off = _model(offload)
    return _torch_train(rank, DDP(model), lambda t: t), off


def fsdp2(rank: int, offload: bool | str) -> tuple[Steps, Any]:
    model, off = _model(offload)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return _torch_train(rank, model, lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t), off


def zero3(rank: int, offload: bool | str) -> tuple[Steps, Any]:
    import deepspeed
    from _ds_job import _full_param, config
    from deepspeed.utils import safe_get_full_grad

    model, off = _model(offload)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(3))
    steps = _train(rank, engine, engine.backward, engine.step,
                   lambda: {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()},
                   lambda: {n: _full_param(p) for n, p in engine.module.named_parameters()})
    engine.destroy()
    return steps, off


def identical(run: Callable[[int, bool | str], tuple[Steps, Any]], rank: int) -> dict[str, Any]:
    plain, _ = run(rank, False)
    out: dict[str, Any] = {}
    for mode, prefix in ((True, ""), ("split", "split_")):
        offloaded, off = run(rank, mode)
        diffs = [float((a[n].double() - b[n].double()).abs().max())
                 for got, want in zip(offloaded, plain) for a, b in zip(got, want) for n in b]
        same_names = all(a.keys() == b.keys() for got, want in zip(offloaded, plain) for a, b in zip(got, want))
        out.update({f"{prefix}steps": len(offloaded), f"{prefix}tensors_compared": len(diffs),
                    f"{prefix}same_names": same_names, f"{prefix}max_abs_diff": max(diffs),
                    f"{prefix}offload_stats": off.stats.as_dict()})
    return out


def main() -> None:
    init()
    job = Job()
    checks = {"ddp": lambda: identical(ddp, job.rank), "fsdp2": lambda: identical(fsdp2, job.rank)}
    if importlib.util.find_spec("deepspeed") is not None:
        checks["zero3"] = lambda: identical(zero3, job.rank)
    job.run(checks)


if __name__ == "__main__":
    main()
