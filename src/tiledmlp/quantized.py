"""bitsandbytes 4-bit projections (QLoRA's base weights) on the GLU fast path.

bitsandbytes' ``Linear4bit`` computes ``F.linear(x, W)`` with ``W`` dequantized from its packed 4-bit blocks for
each matmul (forward, and again for the input grad), freed after. Until 2026-11-30 such an MLP took the generic
engine, which calls the module per tile and recomputes the whole MLP in the backward (down's matmul and its
dequantizing too). Read as a :class:`Dequantized` weight instead, it takes the GLU path, whose products are
bitsandbytes' own: ``matmul_4bit`` forward (each tile, and each tile's recompute of gate/up), and for an input grad
the weight dequantized as its backward does it, freed after: a call holds one dense weight at a time, as untiled.

The module's casts are made too: the input to its ``compute_dtype`` and the output back (a float32 residual
stream over bf16 matmuls, as QLoRA on a GPU runs), and in the backward the grad to the compute dtype and the input
grad back. Under FSDP2 the gathered weight is a plain tensor of the packed bytes (in their storage dtype), whose
quantization state bitsandbytes keeps on the module: read as well. Not read (the generic engine runs the module):
a bias, autocast, a weight repacked for the CPU inference kernel (:func:`reads_exactly`, per call).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

__all__ = ["Dequantized", "dequantized_weight", "quant_state", "reads_exactly"]


@dataclass(frozen=True, eq=False)
class Dequantized:
    """A ``Linear4bit``'s weight as the GLU path reads it: the logical ``[out, in]`` shape and the dtype it
    computes in, its products as the module forms them (:meth:`linear`, :meth:`input_grad`). ``packed`` is the
    parameter itself, handed to the tiled Function (its version counter, its ``requires_grad``: False, so no grad
    is formed for it)."""

    module: nn.Module

    @property
    def packed(self) -> torch.Tensor:
        return self.module.weight

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.module.out_features, self.module.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.module.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    @property
    def requires_grad(self) -> bool:
        return False

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` as the module computes it: ``x`` cast to the compute dtype, bitsandbytes' ``matmul_4bit``
        (under autograd its Function, which keeps the packed weight, not a dense copy, for the input grad), the
        output cast back to ``x``'s dtype."""
        state = quant_state(self.module)
        y = sys.modules["bitsandbytes"].matmul_4bit(x.to(self.dtype), self.module.weight, quant_state=state)
        return y.to(x.dtype)

    def input_grad(self, dy: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """``dy @ W[rows]`` as autograd forms it through :meth:`linear`: ``dy`` cast to the compute dtype, times the
        weight dequantized as bitsandbytes' backward makes it (into the dtype it was quantized from, then cast;
        freed after), the product cast back to ``dy``'s dtype."""
        weight = self.module.weight
        dense = sys.modules["bitsandbytes.functional"].dequantize_4bit(weight.data, quant_state(self.module))
        dense = dense if dense.dtype == self.dtype else dense.to(self.dtype)
        return torch.mm(dy.to(self.dtype), dense[rows]).to(dy.dtype)


def quant_state(module: nn.Module) -> object | None:
    """The quantization state of ``module``'s 4-bit weight: the weight's own (``Params4bit``), or, where FSDP2 put
    its gathered weight in as a plain tensor, the one bitsandbytes keeps on the module for that case."""
    state = getattr(module.weight, "quant_state", None)
    return state if state is not None else getattr(module, "quant_state", None)


def dequantized_weight(module: nn.Module) -> Dequantized | None:
    """``module``'s weight as a :class:`Dequantized` where ``module`` is exactly bitsandbytes' ``Linear4bit`` (or
    its NF4/FP4 subclasses, which only fix the quantization type) holding its packed weight (``Params4bit``, or
    FSDP2's gathered plain tensor of the packed bytes in their storage dtype, not a sharded ``DTensor``) and its
    quantization state, with a set ``compute_dtype`` and no bias; else None (the generic engine calls it)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    nn4 = bnb.nn
    if type(module) not in (nn4.Linear4bit, nn4.LinearNF4, nn4.LinearFP4) or module.bias is not None:
        return None
    weight, state = module.weight, quant_state(module)
    if not isinstance(weight, torch.Tensor) or type(weight).__name__ == "DTensor" or weight.dim() != 2 \
            or weight.shape[1] != 1 or state is None or getattr(state, "packing_format_for_cpu", False) \
            or not isinstance(module.compute_dtype, torch.dtype) or not module.compute_dtype.is_floating_point:
        return None
    return Dequantized(module)


def reads_exactly(weights: Iterable[Dequantized], x: torch.Tensor) -> bool:
    """Whether the GLU path computes the 4-bit ``weights``' projections as their modules would for input ``x``:
    outside autocast (under which the module's casts and bitsandbytes' matmul do not follow autocast's rule for
    ``F.linear``, which the GLU path replays), and not repacked for the CPU inference kernel since it was read."""
    weights = list(weights)
    if weights and torch.is_autocast_enabled(x.device.type):
        return False
    return not any(getattr(quant_state(w.module), "packing_format_for_cpu", False) for w in weights)
