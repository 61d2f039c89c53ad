"""The gated-MLP fast path: ``down(act(gate(x)) * up(x))`` with a backward that recomputes only gate/up.

Untiled, one gated MLP costs 3 matmuls forward and 6 backward. A tiled MLP that recomputes the whole MLP per
tile costs 12 (1.33x). Here the backward of each tile recomputes gate and up only (down's output is never
needed for a gradient) and the last tile keeps its gate/up from the forward, so at n tiles the cost is
``9 + 2 (n-1)/n`` matmuls: 10.5 at 4 tiles (1.17x). The elementwise part (any activation) is differentiated by
autograd, so no activation derivative is hand-written. Works for separate gate/up projections and for one
fused ``gate_up`` projection (gate rows first, as Phi-3 stores it), with or without biases, and with PEFT LoRA
adapters on any of the projections (``adapters.py``: frozen base weights, 5 large matmuls per tile's backward; with
LoRA dropout each tile's backward redraws its forward's masks from the generator state recorded before them),
over bitsandbytes 4-bit base weights too (``quantized.py``: bitsandbytes' own products).

Where :func:`tiledmlp.pointwise.fused_enabled` (CUDA by default), the elementwise work of a tile is one compiled
kernel each way (forward: the product; backward: both derivatives written over gate/up and the product over
d(product), all in place), the float32 weight-grad sums are
accumulated by the matmuls themselves (or, with few tokens, replaced by per-token stacks and one matmul per
weight at the end: :class:`_Stacks`), and each tile's output is written by its matmul straight into the
preallocated output. The last tile's gate/up are kept from the forward (one tile's recompute saved) except under
saved-tensor hooks; in the backward that tile goes first, so it adds nothing to one MLP's peak.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .adapters import LoRAFactors, a_grad, add_input_grad_, b_grad, dropped, input_grad_factor
from .engine import _check_splits, grads_bucketed_in_ready_order, refuse_double_backward
from .glu_spec import NO_MASKS, GLUWeights, Masks, joined_rows, linear_into, plain_activation
from .memory import glu_stacks_fit
from .pointwise import fusable_activation, fused_enabled, glu_backward_, glu_product
from .precision import acc_add, acc_mm, copy_rows, matmul_dtype, wide_mm_available
from .quantized import Dequantized
from .recompute import (ReplayState, check_accumulate_dtype, check_unmodified, functorch_active, generator_state,
                        pack_inputs_first, resolve_accumulate_dtype, save_inputs, saved_inputs,
                        saved_tensor_hooks_active, set_generator_state, tensor_versions)

__all__ = ["GLUWeights", "glu_tiled_call", "plain_activation"]


class _GLUTiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: GLUWeights, splits: Sequence[int], accumulate_dtype: object, x: torch.Tensor,
                *tensors: torch.Tensor | None) -> torch.Tensor:
        ctx.spec, ctx.splits, ctx.accumulate_dtype = spec, list(splits), accumulate_dtype
        # no generator to replay but LoRA dropout's (its own per-tile states, below): a GLU-path activation draws
        # nothing (glu_spec.plain_activation)
        ctx.replay = ReplayState(x.device, rng=bool(spec.dropout))
        ctx.versions = tensor_versions(spec.all_tensors())  # referenced, not saved: an in-place change is refused
        ctx.act_key = fusable_activation(spec.act)
        ctx.fused = ctx.act_key is not None and fused_enabled(x.device)
        # the last tile's gate/up are kept for the backward, except under saved-tensor hooks (checkpointing,
        # offload): a tensor held by reference would stay alive per layer, out of the hooks' reach
        keep = not saved_tensor_hooks_active()
        ctx.kept = None
        # LoRA dropout: the generator's state before each tile's draws, from which its backward redraws them
        ctx.tile_rng = [] if spec.dropout else None
        flat = x.reshape(-1, x.shape[-1])
        out = rows = None
        start = 0
        for t, size in enumerate(splits):
            masks = NO_MASKS
            if ctx.tile_rng is not None:
                ctx.tile_rng.append(generator_state(x.device))
                masks = spec.draw_masks((size,), x.device)
            gate, up = spec.gate_up(flat[start : start + size], masks)
            h = glu_product(ctx.act_key, spec.act, gate, up, ctx.fused)
            if keep and t == len(splits) - 1:
                ctx.kept = (gate, up)
            del gate, up
            if out is None:
                dtype = matmul_dtype(h.dtype, spec.down_weight.dtype, x.device.type) \
                    or torch.promote_types(h.dtype, spec.down_weight.dtype)
                # returned itself, not a view of it: callers may add to it in place (a view made in a Function
                # cannot be); written through the flat ``rows``
                out = torch.empty((*x.shape[:-1], spec.down_weight.shape[0]), dtype=dtype, device=h.device)
                rows = out.view(-1, out.shape[-1])
            if spec.lora[2] is None:
                linear_into(rows[start : start + size], h, spec.down_weight, spec.down_bias)
            else:
                rows[start : start + size] = spec.down(h, masks[2])
            del h, masks
            start += size
        save_inputs(ctx, [x])  # the weights are referenced by spec
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        refuse_double_backward()
        spec: GLUWeights = ctx.spec
        tensors = spec.all_tensors()
        check_unmodified(tensors, ctx.versions)
        (x,) = saved_inputs(ctx)
        need_x, need = ctx.needs_input_grad[3], list(ctx.needs_input_grad[4:])
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        enabled, low, _ = ctx.replay.autocast.get(flat.device.type, (False, None, None))
        # the forward's autocast, by its own rule: float64 operands are not cast
        cast = enabled and torch.float64 not in (flat.dtype, spec.gate_weight.dtype)
        compute = low if cast else torch.promote_types(flat.dtype, spec.gate_weight.dtype)
        ctx.adapter_dtype = low if cast else None  # else each adapter's own dtype, as PEFT casts to it
        stacks = _Stacks.make(spec, need, ctx.accumulate_dtype, flat, ctx.splits, compute) if ctx.fused else None
        # written (not added) by the first tile processed, so no zero fill
        acc = [
            torch.empty(p.shape, dtype=resolve_accumulate_dtype(ctx.accumulate_dtype, p.dtype), device=p.device)
            if p is not None and n and (stacks is None or k not in stacks.WEIGHTS) else None
            for k, (p, n) in enumerate(zip(tensors, need))
        ]
        dx = torch.empty_like(flat) if need_x else None
        cast: dict[tuple[int, torch.dtype], torch.Tensor] = {}

        def as_(k: int, dtype: torch.dtype) -> torch.Tensor:
            if (k, dtype) not in cast:
                cast[(k, dtype)] = tensors[k].to(dtype)
            return cast[(k, dtype)]

        starts = [sum(ctx.splits[:t]) for t in range(len(ctx.splits))]
        last = len(ctx.splits) - 1
        # a kept last tile goes first, so its gate/up are freed before any other tile is recomputed
        order = [last, *range(last)] if ctx.kept is not None else list(range(last + 1))
        tile_backward = _tile_backward_fused if ctx.fused else _tile_backward
        with ctx.replay.replay():
            for i, t in enumerate(order):
                start, end = starts[t], starts[t] + ctx.splits[t]
                x_t = flat[start:end]
                kept = ctx.kept if t == last else None
                ctx.kept = None if t == last else ctx.kept
                masks = NO_MASKS
                if ctx.tile_rng is not None:  # the state the forward recorded: the same masks are redrawn
                    set_generator_state(flat.device, ctx.tile_rng[t])
                    masks = spec.draw_masks((end - start,), flat.device)
                # the tile's [gate, up], handed over: the eager tile frees each as soon as it is used
                gu = list(stacks.gate_up(spec, x_t, start, end, kept, masks) if stacks is not None
                          else kept if kept is not None else spec.gate_up(x_t, masks))
                del kept
                if stacks is not None:
                    pieces = _tile_backward_fused(ctx, acc, as_, gu, grad_flat[start:end], i == 0, masks,
                                                  buf=stacks.product[start:end])
                else:
                    pieces = tile_backward(ctx, acc, as_, gu, grad_flat[start:end], i == 0, masks)
                _project_back(ctx, acc, dx, as_, x_t, pieces, start, end, i == 0, masks)
                del pieces, masks
            stacked = {} if stacks is None else stacks.weight_grads(spec, flat, grad_flat, tensors)
        grads = []
        for k, p in enumerate(tensors):  # one float32 accumulator freed per cast, not all at the end
            grads.append(stacked[k] if k in stacked else None if acc[k] is None else acc[k].to(p.dtype))
            acc[k] = None
        return (None, None, None, None if dx is None else dx.view(x.shape), *grads)


class _Stacks:
    """Per-token operands of the weight grads, for all tokens: gate/up's grads (written over the recomputed gate
    and up) and the product. Where ``memory.glu_stacks_fit`` (few tokens: ``T * s <= H * a``, a ``[T, I]`` stack no
    larger than a weight-sized float32 sum, and a peak no higher) each weight grad is instead one matmul over all
    tokens at the end, as an untiled backward forms it: one rounding, no per-tile read and write of a float32 sum,
    no casts, no per-tile buffers. Compiled tiles only (the CUDA default; eager tiles keep their fitted model)."""

    WEIGHTS = (0, 2, 4)  # indices into GLUWeights.tensors(): gate (or gate_up), up, down

    def __init__(self, joined: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor, product: torch.Tensor
                 ) -> None:
        self.joined, self.gate, self.up, self.product = joined, gate, up, product

    @staticmethod
    def make(spec: GLUWeights, need: list[bool], accumulate_dtype: object, flat: torch.Tensor, splits: list[int],
             compute: torch.dtype) -> "_Stacks | None":
        """The stacks (in the tiles' ``compute`` dtype) where they cost no memory over the sums, else None."""
        weights = [k for k in _Stacks.WEIGHTS if spec.tensors()[k] is not None]
        if not all(need[k] for k in weights):
            return None  # frozen weights (LoRA) have no grads to form
        tokens, hidden = flat.shape
        acc = resolve_accumulate_dtype(accumulate_dtype, spec.gate_weight.dtype)
        if not glu_stacks_fit(tokens, hidden, max(splits), compute.itemsize, acc.itemsize,
                              spec.down_weight.dtype.itemsize, joined=spec.fused):
            return None
        width = spec.down_weight.shape[1]
        new = lambda cols: torch.empty((tokens, cols), dtype=compute, device=flat.device)  # noqa: E731
        joined = new(2 * width) if spec.fused else None
        gate, up = joined.chunk(2, dim=-1) if joined is not None else (new(width), new(width))
        return _Stacks(joined, gate, up, new(width))

    def gate_up(self, spec: GLUWeights, x_t: torch.Tensor, start: int, end: int,
                kept: tuple[torch.Tensor, torch.Tensor] | None, masks: Masks) -> tuple[torch.Tensor, torch.Tensor]:
        """This tile's gate/up, written into the stacks (the kept last tile copied there)."""
        gate, up = self.gate[start:end], self.up[start:end]
        if kept is not None or any(lora is not None for lora in spec.lora[:2]):
            kept = spec.gate_up(x_t, masks) if kept is None else kept
            gate.copy_(kept[0])
            up.copy_(kept[1])
        elif self.joined is not None:
            linear_into(self.joined[start:end], x_t, spec.gate_weight, spec.gate_bias)
        else:
            linear_into(gate, x_t, spec.gate_weight, spec.gate_bias)
            linear_into(up, x_t, spec.up_weight, spec.up_bias)
        return gate, up

    def weight_grads(self, spec: GLUWeights, flat: torch.Tensor, grad_flat: torch.Tensor,
                     tensors: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """Each weight's grad as one matmul over all tokens, a stack freed after each (a fused ``gate_up``'s
        first: its stack is two of the three)."""
        compute = self.product.dtype
        x_c = flat.to(compute)
        grads = {}
        if self.joined is not None:
            grads[0] = _full_mm(self.joined.t(), x_c, tensors[0].dtype)
            self.joined = self.gate = self.up = None
        grads[4] = _full_mm(grad_flat.to(compute).t(), self.product, tensors[4].dtype)
        self.product = None
        if self.gate is not None:
            grads[0] = _full_mm(self.gate.t(), x_c, tensors[0].dtype)
            self.gate = None
            grads[2] = _full_mm(self.up.t(), x_c, tensors[2].dtype)
        self.joined = self.gate = self.up = None
        return grads


def _full_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype``: a float32 result of 16-bit operands straight from the matmul where it can (CUDA)."""
    if dtype == a.dtype:
        return torch.mm(a, b)
    if dtype == torch.float32 and wide_mm_available(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).to(dtype)


Pieces = list[tuple[int, int, slice, torch.Tensor]]


def _adapter_dtype(ctx: Any, lora: LoRAFactors) -> torch.dtype:
    return ctx.adapter_dtype or lora.a.dtype


def _adapter_input(ctx: Any, lora: LoRAFactors, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What the adapter's A multiplied in the forward, in the backward's compute dtype for it."""
    dtype = _adapter_dtype(ctx, lora)
    return x.to(dtype) if mask is None else dropped(x, lora, mask).to(dtype)


def _down_factor(ctx, as_, go) -> torch.Tensor | None:
    """Down's adapter's ``g`` (:func:`adapters.input_grad_factor`), or None without one."""
    lora = ctx.spec.lora[2]
    return None if lora is None else input_grad_factor(lora, 10, as_, go.to(_adapter_dtype(ctx, lora)), slice(None))


def _down_input_grad(ctx, as_, go, g, mask, out=None) -> torch.Tensor:
    """d(product): ``go @ W_down`` (into ``out``) plus, with down's adapter's ``g``, its term ``g @ A`` (through
    its dropout's ``mask``)."""
    down = ctx.spec.down_weight
    if isinstance(down, Dequantized):  # bitsandbytes' product, its weight dequantized for it and freed
        dh = down.input_grad(go)
        dh = dh if out is None else out.copy_(dh)
    else:
        dh = torch.mm(go, as_(4, go.dtype), out=out)
    return dh if g is None else add_input_grad_(dh, g, as_(10, g.dtype), ctx.spec.lora[2], mask)


def _down_grads(ctx, acc: list, as_, go: torch.Tensor, h: torch.Tensor, g: torch.Tensor | None, first: bool,
                mask: torch.Tensor | None) -> None:
    """Down projection's weight and bias grads (and its adapter's, from its ``g`` and dropout ``mask``) from the
    tile's product ``h`` and upstream grad ``go``."""
    if acc[4] is not None:
        acc_mm(acc[4], go.t(), h, first)
    if acc[5] is not None:
        acc_add(acc[5], go.sum(0, dtype=acc[5].dtype), first)
    lora = ctx.spec.lora[2]
    if lora is None:
        return
    # where the adapter's input is a copy (cast or dropped), in row blocks (precision.copy_rows): the copy is a
    # block's, not the tile's; the blocks' products are summed in the adapters' accumulators
    copied = mask is not None or _adapter_dtype(ctx, lora) != h.dtype
    rows = copy_rows(h.shape[1], h.device.type) if copied else max(1, h.shape[0])
    for k, r in enumerate(range(0, max(1, h.shape[0]), rows)):  # a 0-token tile too: it writes the sums' zeros
        part = slice(r, r + rows)
        h_a = _adapter_input(ctx, lora, h[part], None if mask is None else mask[part])
        b_grad(lora, 10, as_, acc, h_a, go[part].to(h_a.dtype), slice(None), first and k == 0)
        a_grad(10, acc, h_a, g[part], first and k == 0)


def _tile_backward(ctx, acc, as_, gu: list, go, first, masks: Masks) -> Pieces:
    """Eager tile: autograd through ``act(gate)`` for d(gate); the product rule by hand for d(act) and d(up), as
    autograd's mul backward forms them (the same bits). Takes ``gu`` (``[gate, up]``) over and frees each
    buffer when it has been used, so a tile holds at most five ``[t, I]`` buffers: gate (saved by the activation),
    up, act, d(product) (then d(act), in place) and d(up), then d(gate) where up is gone."""
    spec: GLUWeights = ctx.spec
    gate, up = gu
    gu.clear()
    go = go.to(gate.dtype)
    with torch.enable_grad():
        gate_l = gate.detach().requires_grad_()
        act = spec.act(gate_l)
    del gate
    h = act.detach() * up
    g = _down_factor(ctx, as_, go)
    _down_grads(ctx, acc, as_, go, h, g, first, masks[2])
    del h
    dh = _down_input_grad(ctx, as_, go, g, masks[2])  # a new tensor: d(act) is written over it
    d_up = dh * act.detach()
    d_act = dh.mul_(up)
    del dh, up
    (d_gate,) = torch.autograd.grad(act, gate_l, d_act)
    del act, gate_l, d_act
    return [(w, b, rows, d) for (w, b, rows), d in zip(spec.projections(), (d_gate, d_up))]


def _tile_backward_fused(ctx, acc, as_, gu: list, go, first, masks: Masks, buf=None) -> Pieces:
    """Compiled tile: one kernel overwrites gate/up (``gu``, taken over) with their grads and d(product) with the
    product, which then gives down's grads; a tile's working set is gate, up and that one ``[t, I]`` buffer
    (``buf``: given)."""
    spec: GLUWeights = ctx.spec
    gate, up = gu
    gu.clear()
    go = go.to(gate.dtype)
    g = _down_factor(ctx, as_, go)
    buf = _down_input_grad(ctx, as_, go, g, masks[2], out=buf)  # d(product)
    glu_backward_(ctx.act_key, buf, gate, up)
    _down_grads(ctx, acc, as_, go, buf, g, first, masks[2])  # buf now holds the product
    del buf
    joined = joined_rows(gate, up) if spec.fused else None
    if joined is not None:  # one [t, 2I] operand: one matmul for dx and one for the weight grad
        return [(0, 1, slice(None), joined)]
    return [(w, b, rows, d) for (w, b, rows), d in zip(spec.projections(), (gate, up))]


def _project_back(ctx, acc, dx, as_, x_t, pieces: Pieces, start, end, first, masks: Masks) -> None:
    """dx rows and the gate/up weight and bias grads (and their adapters', through their dropout ``masks``) from the
    tile's d(gate), d(up).

    ``first``: the first tile processed writes the accumulators instead of adding to them.
    """
    compute = pieces[0][3].dtype
    x_c = x_t.to(compute)
    # dx rows are written in place when dtypes allow (autocast makes compute dtype differ from x's)
    dx_t = None if dx is None else dx[start:end] if dx.dtype == compute else torch.empty_like(x_c)
    factors: dict[int, torch.Tensor] = {}  # each adapter's g, summed over its projection's row pieces
    x_a: dict[object, torch.Tensor] = {}  # each adapter's input, made once: shared by dtype where nothing is dropped

    def x_in(w: int) -> torch.Tensor:
        lora, mask = ctx.spec.adapter(w), masks[w // 2]
        key = _adapter_dtype(ctx, lora) if mask is None else w
        if key not in x_a:
            x_a[key] = _adapter_input(ctx, lora, x_t, mask)
        return x_a[key]

    quantized = ctx.spec.dequantized()
    for k, (w, b, rows, d) in enumerate(pieces):
        if dx_t is not None and w in quantized:  # bitsandbytes' product, its weight dequantized for it and freed
            part = quantized[w].input_grad(d, rows)
            dx_t.copy_(part) if k == 0 else dx_t.add_(part)
            del part
        elif dx_t is not None:
            acc_mm(dx_t, d, as_(w, compute)[rows], k == 0)
        if acc[w] is not None:
            acc_mm(acc[w][rows], d.t(), x_c, first)
        if acc[b] is not None:
            acc_add(acc[b][rows], d.sum(0, dtype=acc[b].dtype), first)
        lora = ctx.spec.adapter(w)
        if lora is not None:
            dtype = _adapter_dtype(ctx, lora)
            d_a = d.to(dtype)
            b_grad(lora, 6 + w, as_, acc, x_in(w), d_a, rows, first)
            g = input_grad_factor(lora, 6 + w, as_, d_a, rows)
            factors[w] = factors[w].add_(g) if w in factors else g
            del d_a
    for w, g in factors.items():
        a_grad(6 + w, acc, x_in(w), g, first)
        if dx_t is not None:
            add_input_grad_(dx_t, g, as_(6 + w, g.dtype), ctx.spec.adapter(w), masks[w // 2])
    if dx_t is not None and dx_t.data_ptr() != dx[start:end].data_ptr():
        dx[start:end].copy_(dx_t)


@torch.compiler.disable
def glu_tiled_call(spec: GLUWeights, x: torch.Tensor, splits: Sequence[int], accumulate_dtype: object = "auto"
                   ) -> torch.Tensor:
    """The gated MLP ``spec`` applied to ``x`` tile by tile (``splits`` over flattened tokens), exactly."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor of [..., hidden] tokens, got {getattr(x, 'shape', type(x).__name__)}")
    _check_splits(splits, x.numel() // x.shape[-1] if x.shape[-1] else 0)
    if not plain_activation(spec.act):
        raise ValueError(f"glu_tiled_call: the activation {type(spec.act).__name__} has parameters, draws random "
                         "numbers or works in place, which this path cannot recompute exactly; use tiledmlp.tiled_call")
    tensors = spec.all_tensors()
    check_accumulate_dtype(accumulate_dtype, [t for t in tensors if t is not None], "the GLU's weights")
    trainable = [t is not None and t.requires_grad for t in tensors]
    if functorch_active():  # torch.func's transforms take no tiled Function: the formula untiled, exact
        return _no_grad_tiles(spec, x, [])
    if not torch.is_grad_enabled() or not (x.requires_grad or any(trainable)) \
            or (len(splits) <= 1 and not grads_bucketed_in_ready_order(tensors)):
        return _no_grad_tiles(spec, x, splits)
    (x,) = pack_inputs_first([x])
    # under ZeRO-1/2 one tile (kept from the forward: nothing recomputed) or 0 tokens run here too, as one tile
    return _GLUTiledFunction.apply(spec, list(splits) or [0], accumulate_dtype, x, *tensors)


def _no_grad_tiles(spec: GLUWeights, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    if len(splits) <= 1:  # untiled, possibly with autograd: plain ops (on x itself: autocast caches a leaf's cast)
        masks = spec.draw_masks(tuple(x.shape[:-1]), x.device)
        gate, up = spec.gate_up(x, masks)
        return spec.down(spec.act(gate) * up, masks[2])
    key = fusable_activation(spec.act)
    fused = key is not None and fused_enabled(x.device)
    flat = x.reshape(-1, x.shape[-1])
    out, start = None, 0
    for size in splits:
        masks = spec.draw_masks((size,), x.device)
        gate, up = spec.gate_up(flat[start : start + size], masks)
        y = spec.down(glu_product(key, spec.act, gate, up, fused), masks[2])
        if out is None:
            out = torch.empty((flat.shape[0], y.shape[-1]), dtype=y.dtype, device=y.device)
        out[start : start + size] = y
        start += size
    return out.view(*x.shape[:-1], out.shape[-1])
