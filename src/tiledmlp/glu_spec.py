"""What a gated MLP is to the fast path: its tensors (LoRA adapters included), its projections and how they
are computed into buffers, and which activations the fast path computes exactly.

Apart from ``glu.py`` (the autograd Function and its tiles) so that each reads on its own: this is the data,
that the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import LoRAFactors, draw_mask, project
from .quantized import Dequantized
from .recompute import autocast_on

__all__ = ["GLUWeights", "Masks", "NO_MASKS", "plain_activation", "linear_into", "joined_rows"]

Masks = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]  # gate's, up's, down's LoRA dropout
NO_MASKS: Masks = (None, None, None)


@dataclass(frozen=True)
class GLUWeights:
    """The tensors of one gated MLP. ``gate_up`` fused: ``up_weight`` is None and gate is rows ``[:I]``. A weight
    may be a bitsandbytes 4-bit one (:class:`~tiledmlp.quantized.Dequantized`: frozen, bitsandbytes' products)."""

    gate_weight: torch.Tensor | Dequantized
    gate_bias: torch.Tensor | None
    up_weight: torch.Tensor | Dequantized | None
    up_bias: torch.Tensor | None
    down_weight: torch.Tensor | Dequantized
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    name: str = field(default="GLUWeights.gate_weight", compare=False)  # the gate (or gate_up) weight, in errors
    # PEFT LoRA adapters of gate (or gate_up), up and down, or None each (adapters.py)
    lora: tuple[LoRAFactors | None, LoRAFactors | None, LoRAFactors | None] = (None, None, None)

    def __post_init__(self) -> None:
        """Refuse a fused ``gate_up`` that does not split into two halves of the down projection's width here,
        once per call, rather than with torch's size error from inside a tile; and an ``up_bias`` without
        ``up_weight``, which the fused projection would ignore (its grad would be uninitialised memory)."""
        gate, down = self.gate_weight, self.down_weight
        if self.fused and self.up_bias is not None:
            raise ValueError(f"{self.name}: up_bias was given without up_weight; a fused gate_up projection's bias is "
                             "gate_bias (the gate's values, then the up's): pass it there and up_bias=None")
        if self.fused and gate.dim() == down.dim() == 2 and gate.shape[0] != 2 * down.shape[1]:
            raise ValueError(f"{self.name}: a fused gate_up weight must have 2 * intermediate_size rows (the gate's, "
                             f"then the up's), 2 * {down.shape[1]} for a down projection of {down.shape[1]} inputs; "
                             f"got {gate.shape[0]} rows")
        for lora, weight, what in zip(self.lora, (gate, self.up_weight, down), ("gate", "up", "down")):
            if lora is not None and (weight is None or lora.a.shape[1:] != weight.shape[1:]
                                     or lora.b.shape != (weight.shape[0], lora.a.shape[0])):
                raise ValueError(f"{self.name}: the {what} projection's LoRA factors {tuple(lora.a.shape)} (A) and "
                                 f"{tuple(lora.b.shape)} (B) do not fit its weight "
                                 f"{None if weight is None else tuple(weight.shape)}: A must be [r, in], B [out, r]")

    @property
    def fused(self) -> bool:
        return self.up_weight is None

    def tensors(self) -> list[torch.Tensor | None]:
        """Weights and biases of gate, up, down: the constructor's six tensors, in its order (a 4-bit weight's
        packed parameter: its version counter is checked, and no grad is formed for it)."""
        tensors = [self.gate_weight, self.gate_bias, self.up_weight, self.up_bias, self.down_weight, self.down_bias]
        return [t.packed if isinstance(t, Dequantized) else t for t in tensors]

    def dequantized(self) -> dict[int, Dequantized]:
        """The 4-bit weights by their index in :meth:`tensors`, whose products go through :class:`Dequantized`."""
        weights = {0: self.gate_weight, 2: self.up_weight, 4: self.down_weight}
        return {k: w for k, w in weights.items() if isinstance(w, Dequantized)}

    def all_tensors(self) -> list[torch.Tensor | None]:
        """:meth:`tensors` (indices 0-5), then each projection's LoRA A and B (gate's at 6, 7; None where none)."""
        adapters = [t for lora in self.lora for t in ((None, None) if lora is None else (lora.a, lora.b))]
        return [*self.tensors(), *adapters]

    def adapter(self, weight: int) -> LoRAFactors | None:
        """The LoRA adapter of the projection whose weight is ``tensors()[weight]`` (A: ``all_tensors()[6 + weight]``)."""
        return self.lora[weight // 2]

    @property
    def dropout(self) -> bool:
        """Whether an adapter drops its input (then each tile draws masks: :meth:`draw_masks`)."""
        return any(lora is not None and lora.dropout for lora in self.lora)

    def lora_tile(self) -> tuple[bool, int] | None:
        """What a tile's adapters add, for ``target_gb`` (:func:`tiledmlp.memory.tile_activation_bytes`): whether
        they are wider than the base (float32 over 16-bit: float32 copies), and the input elements a token has
        where they drop it (one bool mask element each). None without adapters."""
        if not any(lora is not None for lora in self.lora):
            return None
        ins = (self.gate_weight.shape[1], self.gate_weight.shape[1], self.down_weight.shape[1])
        cast = any(lora is not None and lora.a.dtype.itemsize > self.gate_weight.dtype.itemsize for lora in self.lora)
        return cast, sum(n for lora, n in zip(self.lora, ins) if lora is not None and lora.dropout > 0)

    def draw_masks(self, tokens: tuple[int, ...], device: torch.device) -> Masks:
        """LoRA dropout keep-masks for inputs of ``tokens`` rows (a tile's ``(t,)``, or the leading dims of an
        untiled input), drawn in a fixed order (gate's, up's, down's) so that a tile's backward, from the same
        generator state, redraws the same ones."""
        ins = (self.gate_weight.shape[1], self.gate_weight.shape[1], self.down_weight.shape[1])
        return tuple(draw_mask(lora, (*tokens, n), device)  # type: ignore[return-value]
                     for lora, n in zip(self.lora, ins))

    def gate_up(self, x: torch.Tensor, masks: Masks = NO_MASKS) -> tuple[torch.Tensor, torch.Tensor]:
        gate = project(x, self.gate_weight, self.gate_bias, self.lora[0], masks[0])
        if self.fused:
            return gate.chunk(2, dim=-1)
        return gate, project(x, self.up_weight, self.up_bias, self.lora[1], masks[1])

    def down(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return project(h, self.down_weight, self.down_bias, self.lora[2], mask)

    def projections(self) -> list[tuple[int, int, slice]]:
        """(weight index, bias index, rows) for gate then up, indices into :meth:`tensors`."""
        if self.fused:
            rows = self.gate_weight.shape[0] // 2
            return [(0, 1, slice(0, rows)), (0, 1, slice(rows, 2 * rows))]
        return [(0, 1, slice(None)), (2, 3, slice(None))]


def linear_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | Dequantized,
                bias: torch.Tensor | None) -> None:
    """``out[:] = F.linear(h, weight, bias)``, written by the matmul itself when no autocast or cast is involved."""
    if isinstance(weight, Dequantized):  # bitsandbytes' product (no bias: quantized.dequantized_weight)
        out.copy_(weight.linear(h))
    elif h.dtype == weight.dtype == out.dtype and (bias is None or bias.dtype == out.dtype) \
            and not autocast_on(h.device.type):
        if bias is None:
            torch.mm(h, weight.t(), out=out)
        else:
            torch.addmm(bias, h, weight.t(), out=out)
    else:
        out.copy_(F.linear(h, weight, bias))


def joined_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The ``[t, 2I]`` rows whose two halves ``gate`` and ``up`` are (a fused ``gate_up`` projection), else None."""
    base = gate._base
    if base is None or up._base is not base or base.dim() != 2 or not base.is_contiguous() \
            or base.shape[1] != 2 * gate.shape[1] or gate.stride() != base.stride():
        return None
    row_bytes = base.stride(0) * base.element_size()
    offset = gate.data_ptr() - base.data_ptr()
    if offset % row_bytes or up.data_ptr() != gate.data_ptr() + gate.shape[1] * base.element_size():
        return None
    return base[offset // row_bytes : offset // row_bytes + gate.shape[0]]


def plain_activation(act: object) -> bool:
    """Whether the GLU path, which differentiates the activation for gate/up only, recomputes the kept last tile
    first and may run it as a compiled kernel, computes this activation exactly: not one with parameters of its own
    (transformers' xIELU: their grads would be lost), one that draws random numbers (RReLU, a dropout inside) or one
    that works in place (it would overwrite the kept tile's gate). Those take the generic path."""
    if not isinstance(act, nn.Module):
        return True
    modules = act.modules() if act._modules else (act,)  # read at every call: a leaf is checked without a walk
    return not any(any(p is not None for p in m._parameters.values()) or getattr(m, "inplace", False)
                   or isinstance(m, (nn.RReLU, nn.modules.dropout._DropoutNd)) for m in modules)
