"""What a model's norms save for the backward, and where a decoder layer puts them: probed, not assumed.

Norm classes differ in what autograd keeps: Llama's RMSNorm saves its float32 input, one rsqrt per row and
``x * rsqrt`` cast back to the input's dtype; Gemma's ``(1 + w.float()) * normed`` and OLMo2's
``(w * normed_fp32).to(dtype)`` keep the float32 product instead (2 bytes per element more in 16-bit: their
plans were 9-13% under with the Llama assumption); a LayerNorm saves its input, mean and rstd. So one norm of
the model's own class runs on the CPU over a few rows, and the tensors it saves are counted per element and per
row of its input. Where the norms sit (before attention and the MLP as in Llama, over their outputs as in OLMo2,
both as in Gemma 2/3, full-width or per-head q/k norms) is read off one forward of the first decoder layer of
the meta-device instance: which norm reads a Linear's output, and which reads the residual stream. Under eager
attention, the same forward through two layers counts the ``[seq, seq]`` buffers alive at once and what each layer
is called with besides its hidden states (:func:`probe_eager_scores`: Bloom's and MPT's ALiBi attention).
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NormCost", "NormLayout", "probe_norms", "probe_eager_scores", "EagerForward"]


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


PROBE_SIZES = {4: torch.float32, 2: torch.bfloat16}  # element size: the dtype a probe runs in

_F = TypeVar("_F", bound=Callable[..., Any])


def keeps_cpu_rng(fn: _F) -> _F:
    """``fn`` with the CPU generator restored after it: a probe's random inputs must not move the random stream
    of the run that plans or patches (its data order, its dropout masks)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# (weight, input) element sizes the plan asks: as-is in 32 and 16 bits; float32 weights over a 16-bit input
# (autocast: q/k norms and post-norms read a Linear's bf16 output)
_PAIRS = ((4, 4), (2, 2), (4, 2))


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, nn.Linear)


def _cost(norm: nn.Module, width: int, weight_size: int, input_size: int, trainable: bool) -> NormCost:
    """Run a CPU copy of ``norm`` over a few rows and count the bytes of what autograd saves (its parameters
    aside), by storage: ``[rows, width]`` tensors per element, ``[rows]``-sized ones per row."""
    rows = 5
    module = copy.deepcopy(norm).to_empty(device="cpu").to(PROBE_SIZES[weight_size])
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)
    module.requires_grad_(trainable)
    x = torch.randn(rows, width, dtype=PROBE_SIZES[input_size], requires_grad=True)
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


def decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder (``get_decoder()``): a vision-language model's vision tower has layers and norms too."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return model
    return decoder if isinstance(decoder, nn.Module) else model


def _first_layer(model: nn.Module) -> nn.Module | None:
    """The first element of the text decoder's first ModuleList holding matmuls: decoder layer 0."""
    for module in decoder_of(model).modules():
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


@keeps_cpu_rng
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


class ShapeTracker(TorchDispatchMode):
    """Bytes alive in tensors ending in ``[seq, seq]`` created while ``on``: scores, probabilities, their casts."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq, self.on, self.live, self.peak = seq, False, 0, 0
        self.sizes: dict[int, int] = {}
        self.finalizers: list[weakref.finalize] = []

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.on:
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and self._tracked(t):
                    storage = t.untyped_storage()
                    key = storage._cdata
                    if key not in inputs and key not in self.sizes:  # a new buffer, not a view or an in-place op
                        self.sizes[key] = storage.nbytes()
                        self.live += self.sizes[key]
                        self.peak = max(self.peak, self.live)
                        # freed with its storage: a tensor object can die while autograd still saves its buffer
                        # (ReLU's output, saved as ``result``: a tensor's finalizer counted it gone in backward)
                        self.finalizers.append(weakref.finalize(storage, self._free, key))
        return out

    def _tracked(self, t: torch.Tensor) -> bool:
        return t.dim() >= 2 and t.shape[-1] == t.shape[-2] == self.seq


@dataclass(frozen=True)
class EagerForward:
    """What an eager attention's forward holds, per element size of the model's weights (probed): ``held`` and
    ``kept`` bytes per ``heads x seq x seq`` element (the ``[seq, seq]`` buffers of one layer's forward at once;
    those still alive when the next layer starts), and the tensors every decoder layer receives besides its hidden
    states (mask, ALiBi bias: kept with the checkpoints), bytes per ``seq x seq``, per token, and fixed."""

    size: int
    held: float
    kept: float
    inputs_per_square: float = 0.0
    inputs_per_token: float = 0.0
    inputs_fixed: int = 0
    saved: float | None = None  # bytes per element one layer saves for its backward; None: not probed
    backward: float | None = None  # the most bytes per element its backward holds beyond those

    def inputs(self, batch: int, seq: int) -> int:
        return int(batch * (seq * seq * self.inputs_per_square + seq * self.inputs_per_token) + self.inputs_fixed)


def _layer_inputs(seq: int, args: tuple, kwargs: dict) -> dict[str, float]:
    """Bytes of the tensors a decoder layer is called with besides its hidden states (the first one), by how they
    grow: ``[.., seq, seq]`` (a mask), with one ``seq`` dimension (Bloom's ALiBi), or not at all (MPT's ALiBi over
    ``max_seq_len``)."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    hidden = leaves[0].untyped_storage()._cdata if leaves else None
    found: dict[int, torch.Tensor] = {}
    for t in leaves:
        if t.untyped_storage()._cdata != hidden:
            found.setdefault(t.untyped_storage()._cdata, t)
    grown = {"inputs_per_square": 0.0, "inputs_per_token": 0.0, "inputs_fixed": 0}
    for t in found.values():
        n, dims = t.untyped_storage().nbytes(), sum(d == seq for d in t.shape)
        key = "inputs_per_square" if dims >= 2 else "inputs_per_token" if dims == 1 else "inputs_fixed"
        grown[key] += n / (seq * seq if dims >= 2 else seq if dims == 1 else 1)
    grown["inputs_fixed"] = int(grown["inputs_fixed"])
    return grown


def _backward_squares(model: nn.Module, layer: nn.Module, seq: int) -> tuple[int, int] | None:
    """(saved, backward) bytes of the ``[.., seq, seq]`` buffers ``layer`` makes: those alive when its forward ends
    (what it saves for its backward) and the most its backward holds beyond them, read off a grad-mode forward of
    the meta-device ``model`` stopped after that layer and the layer's backward. transformers'
    ``eager_attention_forward``: the float32 softmax and, over 16-bit weights, its cast (4 + 2 bytes an element
    saved); in its backward the float32 gradients in and out, the cast freed (8 - 2). XGLM's attention also saves
    the masked scores its ``torch.max`` clamps (8 bytes in float32), whose backward holds two boolean masks beside
    the gradients (10). None where the meta device cannot run it."""
    track, out = ShapeTracker(seq), []

    def start(*_: Any) -> None:
        track.on = True

    def stop(_: nn.Module, __: tuple, output: Any) -> None:
        out.append(output[0] if isinstance(output, tuple) else output)
        raise _Stop()

    hooks = [layer.register_forward_pre_hook(start), layer.register_forward_hook(stop)]
    try:
        with torch.enable_grad(), track:
            try:
                model(input_ids=torch.zeros(1, seq, dtype=torch.long, device="meta"), use_cache=False)
            except _Stop:
                pass
            saved = track.peak = track.live
            params = [p for p in layer.parameters() if p.requires_grad]
            torch.autograd.grad(out[0], params, torch.ones_like(out[0]), allow_unused=True)
        return saved, track.peak - saved
    except Exception:  # noqa: BLE001 - a model the meta device cannot run with grad
        return None
    finally:
        for h in hooks:
            h.remove()
        for f in track.finalizers:
            f.detach()


@keeps_cpu_rng
def probe_eager_scores(model: nn.Module, heads: int, seq: int = 37) -> tuple[EagerForward, ...]:
    """:class:`EagerForward` in float32 and bf16, read off one no-grad forward of the meta-device ``model`` through
    its first two decoder layers: the ``[seq, seq]`` buffers its eager attention's forward holds at once (Bloom keeps
    its scores and masked scores to the end of the attention, beside the float32 softmax: 12 bytes; MPT 8 in
    float32) and those alive when the next layer starts (the probabilities Bloom's and MPT's layers return, which
    the model's loop keeps through the next layer), and what layer 0 is called with. Empty where the meta-device
    forward does not run (Llama's packed-sequence check reads a value: Llama's eager terms were fitted apart)."""
    layer = _first_layer(model)
    stack = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and m[0] is layer), None)
    if stack is None:
        return ()
    dtype = next(model.parameters()).dtype
    found = []
    try:
        for size, cast in PROBE_SIZES.items():
            model.to(cast)  # meta parameters: no storage, restored below
            track, kept, inputs = ShapeTracker(seq), [], {}

            def start(_: nn.Module, args: tuple, kwargs: dict) -> None:
                inputs.update(_layer_inputs(seq, args, kwargs))
                track.on = True

            hooks = [layer.register_forward_pre_hook(start, with_kwargs=True)]
            if len(stack) > 1:
                hooks.append(stack[1].register_forward_pre_hook(lambda *_: kept.append((track.peak, track.live))))
            hooks.append(stack[min(1, len(stack) - 1)].register_forward_hook(
                lambda *_: (_ for _ in ()).throw(_Stop())))
            try:
                with torch.no_grad(), track:
                    model(input_ids=torch.zeros(1, seq, dtype=torch.long, device="meta"), use_cache=False)
            except _Stop:
                pass
            finally:
                for h in hooks:
                    h.remove()
                for f in track.finalizers:
                    f.detach()
            first, held = kept[0] if kept else (track.peak, 0)
            unit = heads * seq * seq
            squares = _backward_squares(model, layer, seq)
            saved, backward = (None, None) if squares is None else (squares[0] / unit, squares[1] / unit)
            found.append(EagerForward(size, max(first, track.peak - held) / unit, held / unit, **inputs,
                                      saved=saved, backward=backward))
    except Exception:  # noqa: BLE001 - a model the meta device cannot run: no term
        return ()
    finally:
        model.to(dtype)
    return tuple(found)
