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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .recompute import LOW_PRECISION, GradSum

__all__ = ["acc_mm", "acc_add", "wide_mm_available", "WideWeightGrads", "wide_weight_grads"]


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


def acc_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``total = a @ b`` (first) or ``total += a @ b``, the product kept in ``total``'s precision.

    A float32 accumulator for 16-bit operands gets a float32 product, so no tile's partial grad is rounded to
    16 bits before the sum: on CUDA the matmul itself accumulates into ``total`` (``addmm`` with
    ``out_dtype=float32``, beta 1: no temporary, no separate add); elsewhere the operands are upcast.
    """
    if total.dtype != a.dtype:
        if total.is_contiguous() and wide_mm_available(a.device.type, a.dtype):
            if first:
                torch.mm(a, b, out_dtype=total.dtype, out=total)
            else:
                torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
            return
        a, b = a.to(total.dtype), b.to(total.dtype)
    if first:
        torch.mm(a, b, out=total)
    else:
        total.addmm_(a, b)


def acc_add(total: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    if first:
        total.copy_(value)
    else:
        total.add_(value)


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
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
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
    """The dtype the matmul computes in: autocast's when it is on for this device, else the operands' own."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        if x.is_floating_point() and w.is_floating_point():
            return torch.get_autocast_dtype(device_type)
    return x.dtype if x.dtype == w.dtype else None


def wide_weight_grads(sums: GradSum, autocast: bool) -> ContextManager[None]:
    """The mode when some product may compute in 16 bits against a wider sum, else a no-op context."""
    if autocast or any(p.dtype in LOW_PRECISION and d != p.dtype for p, d in zip(sums.params, sums.dtypes)):
        return WideWeightGrads(sums)
    return contextlib.nullcontext()
