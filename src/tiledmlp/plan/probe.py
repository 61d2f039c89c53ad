"""What a model's norms save for the backward, and where a decoder layer puts them: probed, not assumed.

Norm classes differ in what autograd keeps: Llama's RMSNorm saves its float32 input, one rsqrt per row and
``x * rsqrt`` cast back to the input's dtype; Gemma's ``(1 + w.float()) * normed`` and OLMo2's
``(w * normed_fp32).to(dtype)`` keep the float32 product instead (2 bytes per element more in 16-bit: their
plans were 9-13% under with the Llama assumption); a LayerNorm saves its input, mean and rstd. So one norm of
the model's own class runs on the CPU over a few rows, and the tensors it saves are counted per element and per
row of its input. Where the norms sit (before attention and the MLP as in Llama, over their outputs as in OLMo2,
both as in Gemma 2/3, full-width or per-head q/k norms) is read off one forward of the first decoder layer of
the meta-device instance: which norm reads a Linear's output, and which reads the residual stream.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["NormCost", "NormLayout", "probe_norms", "probe_activation"]


@dataclass(frozen=True)
class NormCost:
    """Bytes one norm saves for its backward per element and per row of its input, for weights and input of the
    given element sizes (``trainable``: its weight needs a gradient); ``keeps_input``: one saved tensor is the
    input itself (a checkpointed layer input is then not held twice)."""

    weight_size: int
    input_size: int
    trainable: bool
    per_element: int
    per_row: int
    keeps_input: bool


@dataclass(frozen=True)
class NormLayout:
    """Where a decoder layer's norms sit and what each saves. The defaults are Llama's (pre-norms, RMSNorm)."""

    pre: bool = True  # before attention and before the MLP: their Linears read the norm's output
    post: bool = False  # over attention's and the MLP's outputs, before the residual add (OLMo2, Gemma 2/3)
    qk_rows: int = 0  # rows per token of the q/k norms: heads + kv heads per head (Qwen3), 2 full-width (OLMo2)
    row_tiled: bool = True  # patch() row-tiles them past 256 MiB (norms.is_tileable_norm: RMSNorms, not LayerNorms)
    costs: tuple[NormCost, ...] = ()  # probed; empty: Llama's RMSNorm formula

    def cost(self, weight_size: int, input_size: int, trainable: bool) -> NormCost:
        """The probed cost, else Llama's RMSNorm: float32 input, rsqrt, ``x * rsqrt`` in the input's dtype (not
        saved for a frozen weight)."""
        for c in self.costs:
            if (c.weight_size, c.input_size, c.trainable) == (weight_size, input_size, trainable):
                return c
        return NormCost(weight_size, input_size, trainable, 4 + (input_size if trainable else 0), 4,
                        input_size == 4)

    def saved(self, width: int, rows: int, *, weight_size: int, input_size: int, trainable: bool) -> int:
        """Bytes per token a norm over ``width`` elements in ``rows`` rows saves (its output not included)."""
        c = self.cost(weight_size, input_size, trainable)
        return c.per_element * width + c.per_row * rows


_SIZES = {4: torch.float32, 2: torch.bfloat16}
# (weight, input) element sizes the plan asks: as-is in 32 and 16 bits; float32 weights over a 16-bit input
# (autocast: q/k norms and post-norms read a Linear's bf16 output)
_PAIRS = ((4, 4), (2, 2), (4, 2))


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, nn.Linear)


def _cost(norm: nn.Module, width: int, weight_size: int, input_size: int, trainable: bool) -> NormCost:
    """Run a CPU copy of ``norm`` over a few rows and count the bytes of what autograd saves (its parameters
    aside), by storage: ``[rows, width]`` tensors per element, ``[rows]``-sized ones per row."""
    rows = 5
    module = copy.deepcopy(norm).to_empty(device="cpu").to(_SIZES[weight_size])
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)
    module.requires_grad_(trainable)
    x = torch.randn(rows, width, dtype=_SIZES[input_size], requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=weight_size != input_size)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    per_element = sum(t.element_size() for t in saved.values() if t.numel() == rows * width)
    per_row = sum(t.element_size() for t in saved.values() if t.numel() == rows)
    keeps = x.untyped_storage().data_ptr() in saved
    return NormCost(weight_size, input_size, trainable, per_element, per_row, keeps)


class _Stop(Exception):
    pass


def _first_layer(model: nn.Module) -> nn.Module | None:
    """The first element of the first ModuleList holding matmuls: decoder layer 0."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            if any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in module[0].modules()):
                return module[0]
    return None


def _layout(model: nn.Module, layer: nn.Module, tokens: int = 8) -> NormLayout:
    """One meta-device forward of the model, stopped at the end of ``layer``: which norms read a matmul's output
    (inside attention: q/k norms; at the layer's level: post-norms) and which the residual stream (pre-norms)."""
    calls: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: calls.append((n, m, a[0] if a else None, o)))
             for n, m in layer.named_modules() if n]
    hooks.append(layer.register_forward_hook(lambda *_: (_ for _ in ()).throw(_Stop())))
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="meta"))
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    matmul_outputs = [o for _, m, _, o in calls if not _is_norm(m) and isinstance(o, torch.Tensor)]

    def from_matmul(x: torch.Tensor) -> bool:
        base = x._base if x._base is not None else x
        return any(o is x or o is base or (o._base is not None and o._base is base) for o in matmul_outputs)

    norms = [(n, x) for n, m, x, _ in calls if _is_norm(m) and isinstance(x, torch.Tensor)]
    if not norms:
        raise ValueError("no norm ran in the first decoder layer")
    top = [(n, x) for n, x in norms if "." not in n]
    qk_rows = sum(x.numel() // (tokens * x.shape[-1]) for n, x in norms if "." in n and from_matmul(x))
    return NormLayout(pre=any(not from_matmul(x) for _, x in top), post=any(from_matmul(x) for _, x in top),
                      qk_rows=qk_rows)


def probe_norms(model: nn.Module, hidden: int) -> NormLayout:
    """The layout and costs of ``model``'s norms (a meta-device instance). Where the forward cannot run on the
    meta device (expert kernels), the layout stays Llama's; where a norm cannot run on the CPU, its cost too."""
    from ..norms import is_tileable_norm

    layer = _first_layer(model)
    norm = next((m for m in layer.modules() if _is_norm(m)), None) if layer is not None else None
    if layer is None or norm is None:
        return NormLayout()
    try:
        layout = _layout(model, layer)
    except Exception:  # noqa: BLE001 - any model the meta device cannot run: Llama's layout, the plan's default
        layout = NormLayout()
    weight = getattr(norm, "weight", None)
    width = weight.shape[-1] if isinstance(weight, torch.Tensor) else hidden
    try:
        costs = tuple(_cost(norm, width, w, i, trainable) for w, i in _PAIRS for trainable in (True, False))
    except Exception:  # noqa: BLE001 - a norm that will not run alone: Llama's RMSNorm formula
        costs = ()
    return NormLayout(pre=layout.pre, post=layout.post, qk_rows=layout.qk_rows, costs=costs,
                      row_tiled=is_tileable_norm(norm))


def probe_activation(mlp: nn.Module) -> tuple[tuple[int, int], ...]:
    """(element size, bytes per input element) the activation of ``mlp`` (a meta-device MLP: its child with no
    parameters, not a dropout) keeps for the backward, its output included, in float32 and bf16: SiLU and GELU keep
    their input (2 elements with the output), GPT-2's tanh GELU in Python ops 5. Empty where none is found or runs."""
    acts = [m for m in mlp.children() if not list(m.parameters()) and not isinstance(m, nn.Dropout)]
    if len(acts) != 1:
        return ()
    found = []
    for size, dtype in _SIZES.items():
        x = torch.randn(3, 8, dtype=dtype, requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = acts[0](x)
        except Exception:  # noqa: BLE001 - an activation that will not run alone: input and output, as SiLU's
            return ()
        saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        found.append((size, sum(saved.values()) // x.numel()))
    return tuple(found)
