"""LoRA adapters on the GLU fast path: one projection's ``base(x) + s * B(A(x))``, forward and backward.

PEFT's ``lora.Linear`` sits between an MLP and ``F.linear``, so before 2026-11-26 a LoRA-wrapped MLP took the
generic engine, which recomputes the whole MLP (down's forward too) per tile. Reading the adapter's factors
instead lets the GLU path run it: the base weights are frozen, so a tile's backward is gate/up's recompute and
the three input-grad products (5 large matmuls, not 6), plus rank-wide products for the adapters.

The forward (and each tile's recompute) runs PEFT's own operations in PEFT's order: the input cast to the
adapter's dtype, ``B(A(x)) * s`` added to the base's output in the wider dtype, the sum rounded once to the
base's. The backward is autograd's for those operations, with the scale applied to the rank-wide side
(``d^T @ (s u)`` rather than ``(s d)^T @ u``: the same product, without a ``[t, I]`` scaled copy).

LoRA dropout (``lora_dropout > 0``, a module in training mode) drops the adapter's input: ``s * B(A(x * m / (1-p)))``.
Each tile draws its masks (:func:`draw_mask`, one bool per input element) from the device's generator; the GLU
path records the generator's state before a tile's draws and restores it before the tile's backward, so the
backward redraws the very masks its forward used, whatever order the tiles go in (no mask is stored between).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .precision import acc_mm, copy_rows
from .quantized import Dequantized

__all__ = ["LoRAFactors", "project", "draw_mask", "dropped", "dropout_grad_", "input_grad_factor", "add_input_grad_",
           "b_grad", "a_grad"]


@dataclass(frozen=True, eq=False)  # equal when the same object: tensors compare elementwise
class LoRAFactors:
    """One projection's adapter: ``scaling * B(A(dropout(x)))`` with ``a`` ``[r, in]``, ``b`` ``[out, r]``, no
    biases; ``dropout`` is the probability of dropping an input element (0: none, as PEFT's in eval mode).
    ``rounded``: the term is rounded to the base output's dtype before the sum (PEFT's layer over a 4-bit base),
    not the sum once (its ``lora.Linear``); the same where the adapter is as wide as the base."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: float = 0.0
    rounded: bool = False

    def __post_init__(self) -> None:
        p = self.dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"LoRAFactors.dropout must be a probability in [0, 1) (the share of the adapter's input "
                             f"elements dropped; 0 for none), got {p!r}")


def draw_mask(lora: LoRAFactors | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The keep-mask of ``lora``'s dropout (True with probability ``1 - p``) over an input of ``shape``, drawn from
    ``device``'s default generator; None without dropout (nothing drawn)."""
    if lora is None or not lora.dropout:
        return None
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1 - lora.dropout)


def dropped(x: torch.Tensor, lora: LoRAFactors, mask: torch.Tensor | None) -> torch.Tensor:
    """The adapter's input as PEFT forms it: ``x`` cast to the adapter's dtype, then, with a ``mask``, the dropped
    elements zeroed and the kept ones scaled by ``1 / (1 - p)``."""
    x_a = x.to(lora.a.dtype)
    if mask is None:
        return x_a
    # zeroed by where / masked_fill, not by a product with the mask: that would cast the bool mask to x's dtype
    # first (a temporary of x's size); a cast copy is zeroed in place
    x_a = torch.where(mask, x_a, 0) if x_a is x else x_a.masked_fill_(mask.logical_not(), 0)
    return x_a.mul_(1 / (1 - lora.dropout))


def dropout_grad_(grad: torch.Tensor, lora: LoRAFactors, mask: torch.Tensor | None) -> torch.Tensor:
    """The grad of :func:`dropped`'s output carried back to its input, in place (``grad`` must be a fresh tensor)."""
    if mask is None:
        return grad
    return grad.masked_fill_(mask.logical_not(), 0).mul_(1 / (1 - lora.dropout))  # a bool temporary, not a cast


def project(x: torch.Tensor, weight: torch.Tensor | Dequantized, bias: torch.Tensor | None,
            lora: LoRAFactors | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus the adapter's term, bit for bit as PEFT's ``lora.Linear`` forms it, with
    ``mask`` (:func:`draw_mask`) for the keep-mask PEFT's dropout would draw itself (a 4-bit ``weight``'s product is
    bitsandbytes' own)."""
    y = weight.linear(x) if isinstance(weight, Dequantized) else F.linear(x, weight, bias)
    if lora is None:
        return y
    if torch.is_grad_enabled():  # untiled, under autograd: PEFT's own expression
        term = F.linear(F.linear(dropped(x, lora, mask), lora.a), lora.b) * lora.scaling
        return y + term.to(y.dtype) if lora.rounded else (y + term).to(y.dtype)
    # in a tile (no graph): the same sum and one rounding, a row block at a time (precision.copy_rows), so the
    # term (float32 over a 16-bit base) and the casts are a block's size: in the term's buffer, then into y's rows
    flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    flat_m = None if mask is None else mask.reshape(-1, mask.shape[-1])
    rows = copy_rows(flat_y.shape[1], y.device.type)
    for r in range(0, flat_y.shape[0], rows):
        part = slice(r, r + rows)
        x_b = dropped(flat_x[part], lora, None if flat_m is None else flat_m[part])
        term = F.linear(F.linear(x_b, lora.a), lora.b).mul_(lora.scaling)
        if lora.rounded:
            flat_y[part].add_(term.to(y.dtype))
        elif term.dtype != y.dtype and term.dtype == torch.promote_types(term.dtype, y.dtype):
            flat_y[part].copy_(term.add_(flat_y[part]))
        else:
            flat_y[part].add_(term)
    return y


Cast = Callable[[int, torch.dtype], torch.Tensor]  # a tensor of GLUWeights.all_tensors() by index, in a dtype (cached)


def input_grad_factor(lora: LoRAFactors, index: int, as_: Cast, dy: torch.Tensor, rows: slice) -> torch.Tensor:
    """``s * dy @ B[rows]`` (``[t, r]``, in ``dy``'s dtype, the adapter's compute dtype): what the adapter's input
    grad (``g @ A``) and A's grad (``g^T @ x``) are made of. ``index``: A's in ``GLUWeights.all_tensors()``, B's next."""
    return torch.mm(dy, as_(index + 1, dy.dtype)[rows]).mul_(lora.scaling)


def add_input_grad_(total: torch.Tensor, g: torch.Tensor, a: torch.Tensor, lora: LoRAFactors,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """``total += g @ a`` (the adapter's input-grad term, through its dropout ``mask``): by the matmul itself where
    the dtypes agree and nothing is dropped, else in row blocks (:func:`precision.copy_rows`), each product
    (a float32 adapter's over a 16-bit base: its own dtype) added with one rounding of the sum, so the temporaries
    (the product, the add's cast, the mask's inverse) are a block's, not ``total``'s size."""
    if mask is None and g.dtype == total.dtype:
        return total.addmm_(g, a)
    rows = copy_rows(total.shape[1], total.device.type)
    for r in range(0, total.shape[0], rows):
        block = torch.mm(g[r : r + rows], a)
        total[r : r + rows].add_(dropout_grad_(block, lora, None if mask is None else mask[r : r + rows]))
    return total


def b_grad(lora: LoRAFactors, index: int, as_: Cast, acc: list, x: torch.Tensor, dy: torch.Tensor, rows: slice,
           first: bool) -> None:
    """B's ``rows`` of grad, ``dy^T @ (s x A^T)`` from the projection's input and output grad (both in the adapter's
    compute dtype), into ``acc[index + 1]`` where it is wanted (written when ``first``)."""
    if acc[index + 1] is not None:
        u = torch.mm(x, as_(index, x.dtype).t()).mul_(lora.scaling)
        acc_mm(acc[index + 1][rows], dy.t(), u, first)


def a_grad(index: int, acc: list, x: torch.Tensor, g: torch.Tensor, first: bool) -> None:
    """A's grad ``g^T @ x`` (``g``: :func:`input_grad_factor`, summed over a projection's row pieces) into
    ``acc[index]`` where it is wanted (written when ``first``)."""
    if acc[index] is not None:
        acc_mm(acc[index], g.t(), x, first)
