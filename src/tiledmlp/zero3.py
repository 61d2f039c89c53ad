"""The ZeRO-3 gradient landing: a tiled Function that lands each tile's weight grads into ``param.grad``.

ZeRO-3 partitions parameters (0 elements outside their gather), so a Function cannot take them as inputs and return
their grads: :class:`Zero3Tiled` recomputes each tile in backward and lands its grads with
``torch.autograd.backward(..., inputs=...)``, telling DeepSpeed through ``param.ds_grad_is_ready`` that only the
last tile's grad is final. Tensors computed outside the module (a parametrization's LoRA factors) are no ZeRO-3
params: they are the Function's inputs, their grads summed over the tiles and returned once. The tile count the
ranks agree on, and the entry point, are in :mod:`tiledmlp.distributed`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from .engine import TileLayout, as_tuple, flat_grad_outputs, forward_tiles, refuse_double_backward
from .graph import graph_leaves, refuse_unlisted
from .recompute import GradSum, saved_inputs

__all__ = ["Zero3Plan", "Zero3Tiled"]


@dataclass
class Zero3Plan:
    """What a :class:`Zero3Tiled` call keeps for its backward (not saved tensors: the params are read as they are)."""

    fn: Callable[..., Any]
    layout: TileLayout
    params: list[torch.Tensor]  # the module's own params: landed per tile
    num_inputs: int  # the Function's tensors: token inputs, then the extra tensors
    accumulate_dtype: object
    is_tuple: bool = False


class Zero3Tiled(torch.autograd.Function):
    """Tiled forward without a graph; backward lands each tile's weight grads into ``param.grad``.

    ``anchor`` is an empty tensor requiring grad, so the backward runs even when no token input needs grad
    (the weights still do, and they are not inputs of this Function). Extra tensors computed outside the module
    (LoRA factors) are inputs: their per-tile grads are summed and returned once, to flow on through autograd.
    """

    @staticmethod
    def forward(ctx: Any, plan: Zero3Plan, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.plan = plan
        ctx.extra = tensors[plan.num_inputs:]  # by reference: the recompute reads these very tensors
        outs, plan.is_tuple = forward_tiles(ctx, plan.fn, plan.layout, tensors[:plan.num_inputs])
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        refuse_double_backward()
        plan: Zero3Plan = ctx.plan
        layout = plan.layout
        inputs = saved_inputs(ctx)
        need_in = list(ctx.needs_input_grad[2:2 + plan.num_inputs])
        need_extra = ctx.needs_input_grad[2 + plan.num_inputs:]
        computed = [e for e, n in zip(ctx.extra, need_extra) if n and e.grad_fn is not None]
        # a leaf among the extra tensors is landed per tile like a param (no backend hook sits on it)
        leaves = [e for e, n in zip(ctx.extra, need_extra) if n and e.grad_fn is None]
        sums = GradSum(computed, plan.accumulate_dtype)
        flat = [layout.flat(t) for t in inputs]
        grad_bufs = [torch.zeros_like(f) if n else None for f, n in zip(flat, need_in)]
        got_grad = [False] * len(grad_bufs)  # an input no used output reaches gets None, as untiled (not zeros)
        flat_grads = flat_grad_outputs(ctx, grad_outputs)
        params = [p for p in plan.params if p.requires_grad]
        # a ZeRO-3 leaf module's params have no per-param reduce hook: DeepSpeed reduces them in the leaf's backward
        # hook, after every tile, so no tile has to reach them (the fix the refusal below names)
        leaf = {id(p) for p in params if hasattr(p, "ds_z3_leaf_module")}
        bounds = list(layout.bounds())
        reached_before: set[int] = set()
        first_real = next((t for t, (start, end) in enumerate(bounds) if end > start), 0)
        try:
            with ctx.replay.replay():
                for t, (start, end) in enumerate(bounds):
                    last = t == len(bounds) - 1
                    for p in params:  # DeepSpeed reduces a param's grad only when this is True
                        p.ds_grad_is_ready = last
                    tile_in = [layout.tile_view(f, start, end).detach().requires_grad_(n)
                               for f, n in zip(flat, need_in)]
                    with torch.enable_grad():
                        result, _ = as_tuple(plan.fn(*tile_in))
                    pairs = [(r, g[start:end].view(r.shape)) for r, g in zip(result, flat_grads)
                             if g is not None and r is not None and r.requires_grad]
                    reached = _reached_params([r for r, _ in pairs], params)
                    if last and not reached_before - leaf <= reached:
                        raise RuntimeError(
                            "tiledmlp: under ZeRO-3 the last tile must reach every parameter an earlier tile "
                            "reached (DeepSpeed reduces a grad when its last part lands); this MLP uses some "
                            "weights only for some tokens. Mark it a ZeRO-3 leaf module "
                            "(deepspeed.utils.set_z3_leaf_modules) or untile it (num_shards=1)"
                        )
                    reached_before |= reached
                    if not pairs:
                        continue
                    if t == first_real:
                        refuse_unlisted([r for r, _ in pairs], [*tile_in, *plan.params, *ctx.extra])
                    wrt = [t_in for t_in, n in zip(tile_in, need_in) if n]
                    wrt += [p for p in params if id(p) in reached] + leaves
                    if wrt or computed:
                        outs, grads = zip(*pairs)
                        # the backward runs the computed tensors' own nodes, whose saved tensors every tile (and the
                        # backward past this Function) needs again: retained, and the tile's graph dropped below
                        with _summed_into(sums, computed):
                            torch.autograd.backward(outs, grads, inputs=[*wrt, *map(get_gradient_edge, computed)],
                                                    retain_graph=bool(computed))
                        del outs, grads
                    for k, (buf, t_in) in enumerate(zip(grad_bufs, tile_in)):
                        if buf is not None and t_in.grad is not None:
                            buf[start:end].copy_(t_in.grad.reshape(end - start, *buf.shape[1:]))
                            got_grad[k] = True
                    del result, pairs  # this tile's graph, before the next tile's recompute
        finally:
            for p in params:
                p.ds_grad_is_ready = True
        in_grads = [b.view(t.shape) if b is not None and got else None
                    for b, got, t in zip(grad_bufs, got_grad, inputs)]
        summed = dict(zip(map(id, computed), sums.results()))
        return (None, None, *in_grads, *(summed.get(id(e)) for e in ctx.extra))


@contextlib.contextmanager
def _summed_into(sums: GradSum, computed: Sequence[torch.Tensor]) -> Iterator[None]:
    """Add the grad reaching each of ``computed`` (non-leaf tensors) to ``sums`` while the context lasts, from a
    pre-hook on its grad_fn. A backward with their gradient edges as ``inputs`` goes no further than their own nodes,
    so no tile's grad reaches what they were computed from (nor their ``.grad``, as a tensor input would, retaining
    it): the sums flow on once, from the Function's backward."""
    def add(k: int, index: int, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        sums.add(k, grad_outputs[index])

    handles = [e.grad_fn.register_prehook(functools.partial(add, k, e.output_nr)) for k, e in enumerate(computed)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _reached_params(outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> set[int]:
    """ids of the ``params`` whose grad accumulators the graph of ``outputs`` reaches."""
    wanted = {id(p) for p in params}
    return {id(t) for t in graph_leaves(outputs)} & wanted
