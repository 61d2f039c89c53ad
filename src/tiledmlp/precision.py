"""Float32 weight-grad products for 16-bit matmuls, so a tiled grad carries one rounding like an untiled one.

An untiled bf16 matmul forms its weight grad in float32 internally and rounds it once. Tiled, each tile's
partial grad would be rounded to bf16 before the float32 sum, N roundings instead of one, which doubled the
error against float64 on random data. Two places avoid that:

- the GLU path (:mod:`tiledmlp.glu`) forms its per-tile products with :func:`acc_mm` / :func:`acc_add`;
- the generic engine recomputes each tile under :class:`WideWeightGrads`, a ``TorchFunctionMode`` that
  routes the matmuls reading a declared parameter (``F.linear``, ``torch.addmm``, ``torch.matmul`` / ``@``,
  ``torch.mm``; the parameter itself or a view of it, e.g. one expert of a 3-D MoE weight) through
  :class:`_WideGradMatmul`. Its forward is the same op on the same operands; its backward gives autograd the
  input grad as usual and adds the weight (and bias) grad, formed in float32, straight into the engine's
  float32 sum. Autograd is told nothing for the weight, so it is not rounded on the way. Any other use of a
  parameter keeps the plain autograd path and is summed as before.

The mode only acts when the op computes in 16 bits (16-bit weights, or autocast) and the accumulator is wider;
float32/float64 runs never see it.

Rounding the sum once costs memory at the end: a float32 sum cast into a new 16-bit gradient holds both, 3x the
weight's bytes (at a 128k vocabulary that moment was the tiled loss's peak). :class:`SplitSum` keeps the sum as
two row blocks, the top one exactly as many bytes as the whole 16-bit gradient, and narrows the sum into it in
place; :func:`scale_in_chunks_` scales a 16-bit sum in float32 without a sum-sized float32 copy.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .recompute import LOW_PRECISION, GradSum, autocast_on

__all__ = ["acc_mm", "acc_add", "wide_mm_available", "WideWeightGrads", "wide_weight_grads", "SplitSum",
           "scale_in_chunks_", "NARROW_CHUNK", "COPY_CHUNK", "pass_cap", "copy_rows", "matmul_scratch", "scratch_rows"]


# (device type, operand dtype) -> whether ``mm``/``addmm`` take a wider ``out_dtype`` there (CUDA, torch >= 2.8)
_WIDE_MM: dict[tuple[str, torch.dtype], bool] = {}


def wide_mm_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether 16-bit ``dtype`` products can be written in float32 by the matmul itself on ``device_type``."""
    key = (device_type, dtype)
    if key not in _WIDE_MM:
        if device_type == "cpu" or not hasattr(torch.ops.aten.addmm, "dtype_out"):
            _WIDE_MM[key] = False
        else:
            try:
                a = torch.ones((2, 2), dtype=dtype, device=device_type)
                acc = torch.ones((2, 2), dtype=torch.float32, device=device_type)
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                _WIDE_MM[key] = bool((acc == 3).all())
            except (RuntimeError, NotImplementedError, TypeError):
                _WIDE_MM[key] = False
    return _WIDE_MM[key]


def matmul_scratch(dtype: torch.dtype, device_type: str) -> int:
    """Bytes per output element that a matmul of ``dtype`` operands allocates besides its output while it runs.

    4 for bf16 on an x86 CPU with AVX512 but neither AVX512-BF16 nor AMX: oneDNN forms the product in a float32
    buffer there (profiler: 4.0 bytes per output element for every product above 16x16x16). 0 elsewhere: CUDA, and
    the AVX2 and AVX512-BF16/AMX CPUs the memory models were first fitted on.
    """
    return _cpu_bf16_scratch() if device_type == "cpu" and dtype == torch.bfloat16 else 0


@functools.lru_cache(maxsize=None)
def _cpu_bf16_scratch() -> int:
    has = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731 -- private, so looked up
    native = has("_is_amx_tile_supported") or has("_is_avx512_bf16_supported")
    return 0 if native or not has("_is_avx512_supported") else 4


def acc_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``total = a @ b`` (first) or ``total += a @ b``, the product kept in ``total``'s precision.

    A float32 accumulator for 16-bit operands gets a float32 product, so no tile's partial grad is rounded to
    16 bits before the sum: on CUDA the matmul itself accumulates into ``total`` (``addmm`` with
    ``out_dtype=float32``, beta 1: no temporary, no separate add); elsewhere the operands are upcast. A 16-bit
    ``total`` where this CPU's matmul forms its product in a float32 buffer (:func:`matmul_scratch`) is written in
    row blocks of :data:`NARROW_CHUNK` elements, so that buffer is 4 MiB, not 2x a weight-sized sum.
    """
    if total.dtype != a.dtype:
        if total.is_contiguous() and wide_mm_available(a.device.type, a.dtype):
            if first:
                torch.mm(a, b, out_dtype=total.dtype, out=total)
            else:
                torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
            return
        a, b = a.to(total.dtype), b.to(total.dtype)
    step = scratch_rows(total.shape[1], total.dtype, total.device.type) or total.shape[0]
    for start in range(0, total.shape[0], max(1, step)):
        block, a_rows = total[start : start + step], a[start : start + step]
        if first:
            torch.mm(a_rows, b, out=block)
        else:
            block.addmm_(a_rows, b)


def scratch_rows(width: int, dtype: torch.dtype, device_type: str) -> int | None:
    """Rows per block of a ``width``-wide 16-bit product where :func:`matmul_scratch` says matmuls hold a float32
    copy of their output (:data:`NARROW_CHUNK` elements), else None: one product."""
    return max(1, NARROW_CHUNK // max(1, width)) if matmul_scratch(dtype, device_type) else None


def acc_add(total: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    if first:
        total.copy_(value)
    else:
        total.add_(value)


# Elements per pass where a cast on store goes through a temporary in the computing dtype (TensorIterator off
# CUDA): bounds that temporary to 4 MiB of float32. CUDA kernels cast in registers, so passes there are unbounded.
NARROW_CHUNK = 2**20
_HEAD = 2**16  # the first top-block elements overlap their own result: narrowed through a copy this small


def pass_cap(device_type: str) -> int | None:
    """Elements per pass of work whose temporaries scale with the pass (:data:`NARROW_CHUNK`), or None on CUDA:
    one pass."""
    return None if device_type == "cuda" else NARROW_CHUNK


# Elements per block of the LoRA adapters' float32 copies on CUDA, where casts need no temporaries but the copies
# themselves (a cast input, a product) are tile-sized: 128 MiB of float32, about 2.7k rows of a 12288-wide tile,
# so a 32k-token tile takes 12 blocks and launches stay small against its matmuls
COPY_CHUNK = 2**25


def copy_rows(width: int, device_type: str) -> int:
    """Rows per block of work that makes ``width``-wide copies: :func:`pass_cap`'s elements, :data:`COPY_CHUNK` on
    CUDA."""
    return max(1, (pass_cap(device_type) or COPY_CHUNK) // max(1, width))


def _narrow_passes(top: int, bottom: int, device_type: str) -> list[tuple[int, int, int]]:
    """``(block, start, stop)``: the element ranges :meth:`SplitSum.narrow_` converts, in order (block 0: top).

    Past the head, a top range ``[a, b)`` has ``b <= 2a``: its results land on bytes ``[2a, 2b)`` (2-byte results
    over 4-byte sums, say), which held top elements below ``a``, already converted, and miss its own ``[4a, 4b)``.
    The bottom block then fills the top block's second half, whose sums are all converted by then."""
    cap = pass_cap(device_type)
    passes = [(0, 0, min(top, _HEAD))] if top else []
    start = passes[0][2] if passes else 0
    while start < top:
        stop = min(2 * start, top, start + (cap or top))
        passes.append((0, start, stop))
        start = stop
    step = cap or max(bottom, 1)
    return passes + [(1, a, min(a + step, bottom)) for a in range(0, bottom, step)]


class SplitSum:
    """A sum of a weight's gradient in a dtype twice the weight's width (float32 for bf16) that turns into that
    gradient in its own memory: peak 2x the gradient's bytes instead of 3x, and the gradient owns its storage.

    The sum is two row blocks; the top one has ``ceil(rows / 2)`` rows, as many bytes as the whole narrow
    gradient. :meth:`narrow_` writes ``(sum * g)``, rounded once, over the top block front to back (every pass only
    over sums already read), then the bottom block's behind it, and lets the bottom block go.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, result_dtype: torch.dtype, device: torch.device,
                 zero: bool = False) -> None:
        new = torch.zeros if zero else torch.empty
        self.shape, self.dtype, self.result_dtype = torch.Size(shape), dtype, result_dtype
        self.split = (self.shape[0] + 1) // 2
        self.top: torch.Tensor | None = new((self.split, *self.shape[1:]), dtype=dtype, device=device)
        self.bottom: torch.Tensor | None = new((self.shape[0] - self.split, *self.shape[1:]), dtype=dtype,
                                               device=device)

    @staticmethod
    def fits(shape: Sequence[int], dtype: torch.dtype, result_dtype: torch.dtype) -> bool:
        """Whether a sum in ``dtype`` for a ``result_dtype`` gradient of ``shape`` can be narrowed in place."""
        return len(shape) >= 1 and shape[0] >= 1 and dtype.is_floating_point and result_dtype.is_floating_point \
            and dtype.itemsize == 2 * result_dtype.itemsize

    @staticmethod
    def temp_bytes(shape: Sequence[int], sum_itemsize: int, result_itemsize: int, device_type: str) -> int:
        """The most temporary bytes :meth:`narrow_` holds at once (what ``tiledmlp plan`` counts)."""
        rows, cols = shape[0], math.prod(shape[1:])
        top = (rows + 1) // 2 * cols
        passes = _narrow_passes(top, (rows - (rows + 1) // 2) * cols, device_type)
        head = passes[0][2] * (sum_itemsize + result_itemsize) if passes else 0
        cast = 0 if pass_cap(device_type) is None else max(b - a for _, a, b in passes[1:] or [(0, 0, 0)])
        return max(head, cast * sum_itemsize)

    def blocks(self) -> list[tuple[slice, torch.Tensor]]:
        """``(rows, block)`` pairs: where each block's sums sit in the gradient."""
        if self.top is None or self.bottom is None:
            raise RuntimeError("tiledmlp: this SplitSum was already narrowed into its gradient")
        return [(slice(0, self.split), self.top), (slice(self.split, self.shape[0]), self.bottom)]

    def scaled(self, g: torch.Tensor) -> torch.Tensor:
        """``(sum * g)`` rounded once into a new gradient; the sum is kept (a retained graph reads it again)."""
        blocks = self.blocks()
        out = torch.empty(self.shape, dtype=self.result_dtype, device=blocks[0][1].device)
        for rows, block in blocks:
            src, dst = block.view(-1), out[rows].view(-1)
            step = pass_cap(g.device.type) or max(src.numel(), 1)
            for a in range(0, src.numel(), step):
                torch.mul(src[a : a + step], g, out=dst[a : a + step])
        return out

    def narrow_(self, g: torch.Tensor) -> torch.Tensor:
        """``(sum * g)`` rounded once, in the top block's memory; the sum is gone afterwards."""
        blocks = [block.view(-1) for _, block in self.blocks()]
        out = blocks[0].view(self.result_dtype)  # twice as many narrow slots over the same bytes
        top = blocks[0].numel()
        for block, a, b in _narrow_passes(top, blocks[1].numel(), g.device.type):
            dst = out[a:b] if block == 0 else out[top + a : top + b]
            if block == 0 and a == 0:
                dst.copy_(torch.mul(blocks[0][a:b], g).to(self.result_dtype))
            else:
                torch.mul(blocks[block][a:b], g, out=dst)
        self.top = self.bottom = None
        return out[: self.shape.numel()].view(self.shape)


def scale_in_chunks_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x *= g`` computed in ``g``'s dtype and rounded once to ``x``'s, in place, through one float32 chunk of at
    most :data:`NARROW_CHUNK` elements at a time (the eager twin of :func:`tiledmlp.pointwise.scale_`)."""
    flat = x.view(-1)
    for a in range(0, flat.numel(), NARROW_CHUNK):
        part = flat[a : a + NARROW_CHUNK]
        part.copy_(part.to(g.dtype).mul_(g))
    return x


@dataclass
class _Call:
    """One matched matmul: ``out = x @ matrix(weight) + bias``, and where its weight/bias grads land."""

    func: Callable[..., Any]
    rebuild: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[tuple, dict]]
    transposed: bool  # F.linear: weight is [out, in], matrix = weight.t()
    sums: GradSum
    weight_slot: int
    bias_slot: int | None
    weight: torch.Tensor  # the caller's weight (a parameter or a view of one)
    bias: torch.Tensor | None
    compute_dtype: torch.dtype


class _WideGradMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        # weight/bias are inputs only so autograd reaches this node (and runs its backward) when x needs no grad
        dtype = call.compute_dtype
        xc, wc = x.detach().to(dtype), weight.detach().to(dtype)
        bc = None if bias is None else bias.detach().to(dtype)
        ctx.call = call
        ctx.save_for_backward(xc, wc)
        args, kwargs = call.rebuild(xc, wc, bc)
        with _no_autocast(x.device.type):  # the operands are already in the dtype autocast would pick
            return call.func(*args, **kwargs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        call: _Call = ctx.call
        xc, wc = ctx.saved_tensors
        g2 = grad.to(call.compute_dtype).reshape(-1, grad.shape[-1])
        x2 = xc.reshape(-1, xc.shape[-1])
        matrix = wc.t() if call.transposed else wc
        with _no_autocast(grad.device.type):
            grad_x = (g2 @ matrix.t()).view(xc.shape) if ctx.needs_input_grad[1] else None
            region = call.sums.region(call.weight_slot, call.weight)
            if call.transposed:
                acc_mm(region, g2.t(), x2, first=False)
            else:
                acc_mm(region, x2.t(), g2, first=False)
            if call.bias_slot is not None:
                region = call.sums.region(call.bias_slot, call.bias)
                region.add_(g2.sum(0, dtype=region.dtype))
        return None, grad_x, None, None


def _no_autocast(device_type: str) -> ContextManager[None]:
    if autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _linear(args: tuple, kwargs: dict):
    x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    return x, w, b, True, lambda xc, wc, bc: ((xc, wc, bc), {})


def _addmm(args: tuple, kwargs: dict):
    if _arg(args, kwargs, 3, "beta", 1) != 1 or _arg(args, kwargs, 4, "alpha", 1) != 1:
        return None
    b, x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mat1"), _arg(args, kwargs, 2, "mat2")
    return x, w, b, False, lambda xc, wc, bc: ((bc, xc, wc), {})


def _matmul(args: tuple, kwargs: dict):
    x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other", _arg(args, kwargs, 1, "mat2"))
    return x, w, None, False, lambda xc, wc, bc: ((xc, wc), {})


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor subclasses (DTensor, ...) keep autograd's own path

_MATCHERS = {
    F.linear: _linear,
    torch.addmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.mm: _matmul,
    torch.Tensor.mm: _matmul,
}


class WideWeightGrads(TorchFunctionMode):
    """While a tile is recomputed, 16-bit matmuls that read a declared parameter land its grad in float32."""

    def __init__(self, sums: GradSum) -> None:
        super().__init__()
        self.sums = sums
        self.slots = {id(p): k for k, p in enumerate(sums.params)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        matcher = _MATCHERS.get(func)
        matched = matcher(args, kwargs) if matcher is not None and torch.is_grad_enabled() else None
        call = self._match(func, matched)
        if call is None:
            return func(*args, **kwargs)
        return _WideGradMatmul.apply(call, matched[0], call.weight, call.bias)

    def _slot(self, t: Any) -> int | None:
        """The sum slot of a declared parameter ``t`` is, or is a same-dtype view of (None: not landable)."""
        if type(t) not in _PLAIN or not t.requires_grad:
            return None
        base = t if t._base is None else t._base
        k = self.slots.get(id(base))
        if k is None or base.dtype != t.dtype or not base.is_contiguous():
            return None
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            return None  # a broadcast view (expand): its grad is a sum, which autograd does
        return k

    def _match(self, func: Callable[..., Any], matched: tuple | None) -> _Call | None:
        if matched is None:
            return None
        x, w, b, transposed, rebuild = matched
        if type(x) not in _PLAIN or type(w) not in _PLAIN or x.dim() < 2 or w.dim() != 2:
            return None
        if b is not None and (type(b) not in _PLAIN or b.dim() != 1):
            return None
        dtype = _compute_dtype(x, w)
        if dtype not in LOW_PRECISION:
            return None
        w_slot, b_slot = self._slot(w), self._slot(b)
        if w_slot is None or self.sums.dtypes[w_slot] == dtype:
            return None
        if b is not None and b.requires_grad and b_slot is None:
            return None  # a bias we cannot land (not declared): leave the whole op to autograd
        return _Call(func, rebuild, transposed, self.sums, w_slot, b_slot, w, b, dtype)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """The dtype the matmul computes in (None when its operands' dtypes differ), see :func:`matmul_dtype`."""
    return matmul_dtype(x.dtype, w.dtype, x.device.type)


def matmul_dtype(a: torch.dtype, b: torch.dtype, device_type: str) -> torch.dtype | None:
    """The dtype a matmul of ``a`` and ``b`` operands computes in, None when they differ once autocast is applied.

    Autocast's own rule: where it is on for the device, floating operands are cast to its dtype except float64 ones.
    """
    if autocast_on(device_type):
        low = torch.get_autocast_dtype(device_type)
        a, b = (low if d.is_floating_point and d != torch.float64 else d for d in (a, b))
    return a if a == b else None


def wide_weight_grads(sums: GradSum, autocast: bool) -> ContextManager[None]:
    """The mode when some product may compute in 16 bits against a wider sum, else a no-op context."""
    if autocast or any(p.dtype in LOW_PRECISION and d != p.dtype for p, d in zip(sums.params, sums.dtypes)):
        return WideWeightGrads(sums)
    return contextlib.nullcontext()
