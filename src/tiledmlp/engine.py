"""The tiled autograd Function: forward tile by tile without a graph, backward by per-tile recompute.

Forward: every tile of the flattened tokens runs ``fn`` under no-grad and is written into one preallocated
output (no concatenation peak); only the inputs are saved. Backward: each tile is recomputed under the
forward's RNG/autocast state and differentiated with ``torch.autograd.grad`` with respect to the tile inputs
and the explicit ``params``; input grads are written tile by tile into one buffer and weight grads are summed
and returned once, so ``AccumulateGrad`` (and the DDP/FSDP/ZeRO hooks behind it) fires once per backward, and a
hook on a param (``p.register_hook``) is paused for the per-tile grads so that it runs once, on the sum.
Under DeepSpeed ZeRO-1/2 a 1-tile call goes through the Function too (:func:`grads_bucketed_in_ready_order`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .graph import refuse_params_computed_from_params, refuse_unlisted
from .precision import wide_weight_grads
from .recompute import (GradSum, ReplayState, check_accumulate_dtype, check_unmodified, functorch_active,
                        pack_inputs_first, save_inputs, saved_inputs, tensor_versions)
from .tiling import NumShards, plan_shards, validate_num_shards

__all__ = ["tiled_call", "grads_bucketed_in_ready_order", "TileLayout", "run_tiles_no_grad", "forward_tiles",
           "flat_grad_outputs", "refuse_double_backward", "as_tuple"]


@dataclass(frozen=True)
class TileLayout:
    """Inputs with leading token dims ``lead`` are flattened to ``[T, ...]`` and cut into ``splits``."""

    lead: tuple[int, ...]
    splits: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.splits)

    def bounds(self) -> Iterable[tuple[int, int]]:
        start = 0
        for size in self.splits:
            yield start, start + size
            start += size

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.num_tokens, *t.shape[len(self.lead) :])

    def tile_view(self, flat: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """A tile shaped like the caller's input: ``[1, t, H]`` for ``[B, S, H]``, ``[t, H]`` for ``[T, H]``."""
        ones = (1,) * (len(self.lead) - 1)
        return flat[start:end].view(*ones, end - start, *flat.shape[1:])

    def flatten_output(self, out: torch.Tensor, tile_tokens: int, index: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One tile's output ``index`` as ``[t, ...]``, and the shape the untiled output has."""
        n = len(self.lead)
        if tuple(out.shape[:n]) == (*(1,) * (n - 1), tile_tokens):
            return out.reshape(tile_tokens, *out.shape[n:]), (*self.lead, *out.shape[n:])
        if n > 1 and out.dim() >= 1 and out.shape[0] == tile_tokens:  # e.g. router logits as [B*S, E]
            return out.reshape(tile_tokens, *out.shape[1:]), (self.num_tokens, *out.shape[1:])
        raise ValueError(
            f"tiled fn must be token-wise: output {index} of a {tile_tokens}-token tile has shape {tuple(out.shape)}, "
            "but each output needs the tile's token dims first (a tile cannot change the number of tokens)"
        )


def as_tuple(result: Any) -> tuple[tuple[torch.Tensor | None, ...], bool]:
    """``fn``'s result as a tuple of tensors (or None), and whether it was a tuple: anything else is refused."""
    if isinstance(result, torch.Tensor):
        return (result,), False
    if isinstance(result, (tuple, list)):
        for k, item in enumerate(result):
            if item is not None and not isinstance(item, torch.Tensor):
                raise TypeError(f"tiled fn output {k} is a {type(item).__name__}; only tensors (or None) can be tiled")
        return tuple(result), True
    raise TypeError(f"tiled fn returned a {type(result).__name__}; it must return a tensor or a tuple of tensors")


def run_tiles_no_grad(
    fn: Callable[..., Any],
    layout: TileLayout,
    flat_inputs: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], list[torch.Size | None], bool]:
    """Run ``fn`` over every tile without a graph, writing into preallocated outputs.

    Returns the outputs in their untiled shapes, the flat ``[T, ...]`` shape of each, and whether ``fn`` returned a
    tuple. The outputs are the allocated tensors themselves, not views of them: a caller may add to them in place
    (Llama-4 adds its routed experts into its shared expert's output), which autograd forbids on a view made
    inside a Function.
    """
    outs: list[torch.Tensor | None] = []
    bufs: list[torch.Tensor | None] = []  # flat views of ``outs``, written tile by tile
    is_tuple = False
    # with grad enabled, nothing passed in needs grad: a trainable tensor fn reads unlisted would make every tile
    # keep its graph (no memory saved). The first tile runs with grad to find one; the others never keep a graph
    check = torch.is_grad_enabled()
    for t, (start, end) in enumerate(layout.bounds()):
        with contextlib.nullcontext() if check and t == 0 else torch.no_grad():
            result, is_tuple = as_tuple(fn(*(layout.tile_view(f, start, end) for f in flat_inputs)))
        if check and t == 0:
            refuse_unlisted([r for r in result if isinstance(r, torch.Tensor) and r.requires_grad], [])
        if t == 0:
            outs, bufs = [None] * len(result), [None] * len(result)
        elif len(result) != len(bufs):
            raise ValueError(f"tiled fn returned {len(result)} outputs for tile {t} but {len(bufs)} for tile 0")
        for k, r in enumerate(result):
            if r is None:
                if bufs[k] is not None:
                    raise ValueError(f"tiled fn output {k} is None for some tiles only")
                continue
            tile_flat, shape = layout.flatten_output(r, end - start, k)
            if t == 0:
                outs[k] = torch.empty(shape, dtype=r.dtype, device=r.device)
                bufs[k] = outs[k].view(layout.num_tokens, *tile_flat.shape[1:])
            elif bufs[k] is None:
                raise ValueError(f"tiled fn output {k} is None for some tiles only")
            bufs[k][start:end].copy_(tile_flat)
    return tuple(outs), [None if b is None else b.shape for b in bufs], is_tuple


def refuse_double_backward() -> None:
    """Raise a clear error when the backward was asked to build a graph (``create_graph=True``)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "tiledmlp: double backward (create_graph=True) through a tiled MLP is not supported; "
            "untile that module (tiledmlp.unpatch or num_shards=1) for higher-order gradients"
        )


def forward_tiles(
    ctx: Any, fn: Callable[..., Any], layout: TileLayout, token_inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor | None, ...], bool]:
    """The forward shared by the tiled Functions: tiles without a graph, inputs saved, outputs described."""
    ctx.replay = ReplayState(token_inputs[0].device)
    outs, ctx.flat_shapes, is_tuple = run_tiles_no_grad(fn, layout, [layout.flat(t) for t in token_inputs])
    save_inputs(ctx, token_inputs)
    ctx.mark_non_differentiable(*(o for o in outs if o is not None and not o.is_floating_point()))
    ctx.differentiable = [o is not None and o.is_floating_point() for o in outs]
    return outs, is_tuple


def flat_grad_outputs(ctx: Any, grad_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Incoming grads as flat ``[T, ...]`` tensors (None for non-differentiable or unused outputs)."""
    return [g.reshape(s) if g is not None and d else None
            for g, d, s in zip(grad_outputs, ctx.differentiable, ctx.flat_shapes)]


@dataclass
class _Plan:
    fn: Callable[..., Any]
    layout: TileLayout
    num_token_inputs: int
    accumulate_dtype: object
    is_tuple: bool = False


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *tensors: torch.Tensor) -> Any:
        ctx.plan = plan
        # an output the loss does not use gets None, not zeros: its params then get no grad, as untiled (zeros
        # would be stepped by an optimizer's decay and momentum), and no tile recomputes for it
        ctx.set_materialize_grads(False)
        # Params are kept by reference, not saved: the recompute differentiates with respect to the very tensors
        # fn reads (a saved-tensor unpack, e.g. under non-reentrant checkpointing, may hand back another object,
        # whose grads autograd.grad would silently report as unused).
        ctx.params = tensors[plan.num_token_inputs :]
        ctx.param_versions = tensor_versions(ctx.params)  # an in-place change before the backward is refused
        outs, plan.is_tuple = forward_tiles(ctx, plan.fn, plan.layout, tensors[: plan.num_token_inputs])
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        refuse_double_backward()
        check_unmodified(ctx.params, ctx.param_versions)
        plan: _Plan = ctx.plan
        layout = plan.layout
        token_inputs, params = saved_inputs(ctx), ctx.params
        needs = ctx.needs_input_grad[1:]
        need_in = [needs[i] for i in range(plan.num_token_inputs)]
        grad_params = [p for p, n in zip(params, needs[plan.num_token_inputs :]) if n]
        flat = [layout.flat(t) for t in token_inputs]
        grad_bufs = [torch.empty_like(f) if n else None for f, n in zip(flat, need_in)]
        reached = [False] * len(grad_bufs)  # an input no tile's used outputs reach gets None, as untiled (not zeros)
        flat_grads = flat_grad_outputs(ctx, grad_outputs)
        sums = GradSum(grad_params, plan.accumulate_dtype)
        checked = False
        with ctx.replay.replay():
            for start, end in layout.bounds():
                tile_in = [layout.tile_view(f, start, end).detach().requires_grad_(n) for f, n in zip(flat, need_in)]
                with torch.enable_grad(), wide_weight_grads(sums, ctx.replay.autocast_enabled):
                    result, _ = as_tuple(plan.fn(*tile_in))
                pairs = [
                    (r, g[start:end].view(r.shape))
                    for r, g in zip(result, flat_grads)
                    if g is not None and r is not None and r.requires_grad
                ]
                if not pairs:
                    for buf in grad_bufs:
                        if buf is not None:
                            buf[start:end].zero_()
                    continue
                outs, grads = zip(*pairs)
                wrt = [t for t, n in zip(tile_in, need_in) if n] + grad_params
                if not checked:
                    refuse_unlisted(outs, [*tile_in, *params])
                    checked = True
                with _tensor_hooks_paused(grad_params), _landed_as_produced(sums) as landed:
                    got = _tile_grads(outs, wrt, grads)
                it = iter(got)
                for k, (buf, n) in enumerate(zip(grad_bufs, need_in)):
                    if n:
                        g = next(it)
                        if g is None:
                            buf[start:end].zero_()
                        else:
                            buf[start:end].copy_(g.reshape(end - start, *buf.shape[1:]))
                            reached[k] = True
                for k, g in enumerate(it):
                    if k not in landed:
                        sums.add(k, g)
                del result, outs, grads, got, g  # this tile's graph and grads, before the next tile's recompute
        in_grads = [b.view(t.shape) if b is not None and r else None
                    for b, r, t in zip(grad_bufs, reached, token_inputs)]
        param_iter = iter(sums.results())
        param_grads = [next(param_iter) if n else None for n in needs[plan.num_token_inputs :]]
        return (None, *in_grads, *param_grads)


@contextlib.contextmanager
def _tensor_hooks_paused(tensors: Sequence[torch.Tensor]) -> Any:
    """Hooks registered on the params (``p.register_hook``: grad scaling, clipping by value) skip the per-tile
    grads: they run once, on the summed grad the Function hands to autograd, as they would untiled."""
    paused = [(hooks, list(hooks.items())) for hooks in (t._backward_hooks for t in tensors) if hooks]
    for hooks, _ in paused:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in paused:
            hooks.update(items)


@contextlib.contextmanager
def _landed_as_produced(sums: GradSum) -> Any:
    """Each stacked leaf param's tile grad (3-D and up: MoE experts' weights, each a whole MLP's per expert) is added
    to its sum when autograd makes it (a hook), and autograd keeps a zero-stride stand-in: those grads are then held
    one at a time, not all together until the tile's backward ends (down's, a third of the experts' weights, less
    at the peak), and a 16-bit grad is upcast into its float32 sum an eighth at a time. Yields the slots landed so.
    2-D weights, non-leaf params (a parametrization's computed weight, whose grad flows on through its graph) and
    tensor subclasses keep the returned grads, which the memory models of dense MLPs (``memory.generic_tile_work``,
    ``ungated_tile_bytes``) are fitted to."""
    landed: set[int] = set()
    handles = []

    def hook(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def land(grad: torch.Tensor | None) -> torch.Tensor | None:
            if grad is None:  # an undefined grad (a tile that does not reach the param)
                return None
            sums.add(k, grad, pieces=8)  # an eighth of the sum for its upcast copy
            landed.add(k)
            return grad.new_zeros(()).expand(grad.shape)

        return land

    for k, p in enumerate(sums.params):
        if p.dim() >= 3 and p.grad_fn is None and type(p) in (torch.Tensor, nn.Parameter):
            handles.append(p.register_hook(hook(k)))
    try:
        yield landed
    finally:
        for handle in handles:
            handle.remove()


def _tile_grads(outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple:
    try:
        return torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    except RuntimeError as exc:
        if "second time" not in str(exc):
            raise
        raise RuntimeError(
            "tiledmlp: the tiled fn reads a tensor computed outside it (e.g. w = W * mask) and params= names the "
            "leaf behind it: each tile's backward would run through that computation again. Pass the computed "
            "tensor itself in params= (its gradient flows on to W), or compute it inside fn") from exc


def _trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``params`` that need grads, each once (a tied weight listed twice gets its grad once)."""
    if isinstance(params, (torch.Tensor, torch.nn.Module)) or not isinstance(params, Iterable):
        raise TypeError(f"params must be an iterable of tensors (e.g. module.parameters()), got "
                        f"{type(params).__name__}")
    unique: dict[int, torch.Tensor] = {}
    for k, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{k}] is a {type(p).__name__}; params must hold tensors (e.g. module.parameters())")
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def grads_bucketed_in_ready_order(params: Iterable[torch.Tensor | None]) -> bool:
    """Whether a backend packs these params' grads into reduce buckets in the order they become ready: DeepSpeed's
    ZeRO-1/2 optimizer (which gives each param it trains a ``param_idx_in_group``; ZeRO-2, and ZeRO-1 with
    ``overlap_comm``, append each grad to a bucket from its post-accumulate hook and reduce the bucket by position).

    Every rank must then make its grads ready in the same order, whatever its token count. Plain autograd makes a
    gated MLP's ready in graph order (down, up, gate); a tiled Function hands them to autograd together, which lands
    them in another (gate, up, down in a Llama): so there a 1-tile call (0 tokens included) runs the Function too,
    as one tile. Decided from the params alone, the same on every rank.
    """
    if "deepspeed" not in sys.modules:  # the attribute comes from DeepSpeed's optimizer
        return False
    return any(p is not None and p.requires_grad and hasattr(p, "param_idx_in_group") for p in params)


def _check_splits(splits: Sequence[int], num_tokens: int) -> None:
    container = isinstance(splits, (list, tuple)) or (  # lists first: the abc check costs the GPU host time
        not isinstance(splits, (str, torch.Tensor)) and isinstance(splits, Sequence))
    if not container or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in splits) or sum(splits) != num_tokens:
        raise ValueError(f"splits must be a list of ints >= 0 summing to the {num_tokens} tokens, got {splits!r}")


@torch.compiler.disable
def tiled_call(
    fn: Callable[..., Any],
    x: torch.Tensor,
    *token_args: torch.Tensor,
    params: Iterable[torch.Tensor] = (),
    num_shards: NumShards = "auto",
    accumulate_dtype: object = "auto",
    splits: Sequence[int] | None = None,
) -> Any:
    """``fn(x, *token_args)`` computed tile by tile over the flattened tokens, with exact gradients.

    ``fn`` must be token-wise (output token ``i`` depends only on input token ``i``); ``x`` is ``[..., H]`` and
    each of ``token_args`` has the same leading token dims (e.g. MoE routing indices and weights). ``params`` are
    the tensors ``fn`` uses that may need gradients (one computed outside ``fn``, such as a masked weight, is passed
    itself: its grad flows on; not beside one it is computed from, which is refused); ones with
    ``requires_grad=False`` are ignored, ones listed twice count once. ``splits``
    overrides ``num_shards`` with explicit tile sizes (used by the distributed adapters). One tile runs ``fn`` as it
    is, except for DeepSpeed ZeRO-1/2 params (:func:`grads_bucketed_in_ready_order`).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (a module or a function of the tokens), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims ([T, H] or [B, S, H]), got shape {tuple(x.shape)}")
    validate_num_shards(num_shards)
    lead = tuple(x.shape[:-1])
    for k, a in enumerate(token_args):
        if not isinstance(a, torch.Tensor) or tuple(a.shape[: len(lead)]) != lead:
            hint = "; pass the weights by keyword: params=..." if isinstance(a, nn.Parameter) or not isinstance(
                a, torch.Tensor) else ""
            raise ValueError(f"token_args[{k}] must be a tensor with leading dims {lead} like x{hint}")
    num_tokens = math.prod(lead)
    params = _trainable(params)
    check_accumulate_dtype(accumulate_dtype, params)  # here, not in the backward (GradSum checks again)
    if splits is None:
        splits = plan_shards(num_tokens, num_shards=num_shards, hidden_size=x.shape[-1])
    else:
        _check_splits(splits, num_tokens)
    if functorch_active() or (len(splits) <= 1 and not (torch.is_grad_enabled()
                                                         and grads_bucketed_in_ready_order(params))):
        return fn(x, *token_args)  # torch.func's transforms take no tiled Function: the call untiled, exact
    layout = TileLayout(lead, tuple(splits) or (0,))  # 0 tokens under ZeRO-1/2: one empty tile
    inputs = (x, *token_args)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (*inputs, *params)):
        outs, _, is_tuple = run_tiles_no_grad(fn, layout, [layout.flat(t) for t in inputs])
    else:
        refuse_params_computed_from_params(params)
        plan = _Plan(fn, layout, len(inputs), accumulate_dtype)
        outs = _TiledFunction.apply(plan, *pack_inputs_first(inputs), *params)
        is_tuple = plan.is_tuple
    return outs if is_tuple else outs[0]
