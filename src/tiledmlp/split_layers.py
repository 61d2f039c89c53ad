"""Two checkpoints per decoder layer, for activation offloading: the attention half and the MLP half.

With one checkpoint per layer, the backward recomputes the whole layer before the MLP's backward can start, so
attention's recomputed tensors (the first norm's input and output, q, k, v and attention's output) stay on the
device through the MLP's and the second norm's backward, and on to attention's own. At 256k tokens of a
Llama-3.2-1B shape that is 4.5 GiB under every point of the layer's backward. Checkpointed as two halves, the MLP
half's backward runs with only its own recomputed tensors: the attention half has not been recomputed yet.
Without offloading that costs device memory (the attention half's output, one more ``[tokens, hidden]`` tensor
per layer, is kept); with :func:`tiledmlp.offload_activations` it costs host memory and one more copy each way,
so ``offload_activations(model, split_layers=True)`` is where it is used.

Attention itself then peaks in its backward kernel: flash attention's float32 dq accumulator and, under GQA, dk/dv
for every query head before they are summed (4 GiB there). Inside a split layer, ``scaled_dot_product_attention``
runs per group of KV heads (:class:`AttentionByHeadGroups`), which divides that workspace by the number of
groups. Their outputs are concatenated; the concatenation is what ``o_proj`` saves, and ``o_proj``'s backward
frees it before attention's backward starts. Heads are independent, so outputs and gradients are bit-identical.

The halves are residual: ``x + post1(attn(pre1(x)))``, then ``h + post2(mlp(pre2(h)))``, each norm optional
(Llama: pre-norms; OLMo-2/3: post-norms; Gemma-2/3, GLM-4: both). A layer qualifies when its forward's statements
are exactly that, compared on the syntax tree (attention's keyword arguments aside), and it has the children they
name: a scaled residual branch (Granite), weighted terms (MiniMax), a residual dropout (Phi-3), a branch (Llama-4)
or a parallel MLP are not split, and ``split_layers=True`` is refused for a model with no such layer. The families
tested bit for bit against whole-layer checkpointing are listed in ``docs/train.md``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import re
import textwrap
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionByHeadGroups", "SplitLayerCheckpoint", "head_groups", "splittable"]

# Attention is split into at most ``tokens // TOKENS_PER_CHUNK`` head groups: below twice this many tokens it runs
# whole (a short sequence's kernel needs all its heads to fill a GPU; its workspace is small anyway).
TOKENS_PER_CHUNK = 8192
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# A layer's forward, statement by statement (``ast.unparse`` spelling), is two residual halves and a return:
#   residual = hidden_states; <child calls on hidden_states, in order>; hidden_states = residual + hidden_states
# attention's call among the first half's, none in the second's. Nothing else may be computed: Granite scales the
# residual branch, MiniMax weighs both terms, Phi-3 adds a residual dropout, Llama-4 branches on MoE layers.
_KEEP, _ADD, _RETURN = "residual = hidden_states", "hidden_states = residual + hidden_states", "return hidden_states"
_ATTENTION = re.compile(r"hidden_states, _ = self\.(\w+)\(hidden_states=hidden_states(, [^()]*)?\)")
_CALL = re.compile(r"hidden_states(, _)? = self\.(\w+)\(hidden_states\)")  # ", _": GPT-OSS's block returns a pair

Half = tuple[tuple[str, str], ...]  # (child, "plain" | "pair" | "attention") in call order


def _read_half(texts: list[str], attention: bool) -> tuple[Half, list[str]] | None:
    """The residual half at the start of ``texts`` (with one attention call if ``attention``) and the rest."""
    if not texts or texts[0] != _KEEP:
        return None
    calls: list[tuple[str, str]] = []
    k = 1
    while k < len(texts) and texts[k] != _ADD:
        if (m := _ATTENTION.fullmatch(texts[k])) and attention and _passed_through(m.group(2)):
            calls.append((m.group(1), "attention"))
        elif m := _CALL.fullmatch(texts[k]):
            calls.append((m.group(2), "pair" if m.group(1) else "plain"))
        else:
            return None
        k += 1
    if k == len(texts) or sum(kind == "attention" for _, kind in calls) != int(attention) or not calls:
        return None
    return tuple(calls), texts[k + 1 :]


def _passed_through(arguments: str | None) -> bool:
    """Whether attention's other arguments are the layer's own, unchanged (``name=name`` or ``**kwargs``): the half
    hands attention the layer call's keyword arguments."""
    return all(a == "**kwargs" or re.fullmatch(r"(\w+)=\1", a) for a in (arguments or "").split(", ")[1:])


@functools.lru_cache(maxsize=None)  # per forward function: looked up at every layer call
def _forward_recipe(forward: Any) -> tuple[Half, Half] | None:
    """(attention half, MLP half) when ``forward`` is exactly two residual halves, else None."""
    try:
        func = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(func, ast.FunctionDef) or len(func.args.args) < 2 or func.args.args[1].arg != "hidden_states":
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = _read_half([ast.unparse(st) for st in body], attention=True)
    second = None if first is None else _read_half(first[1], attention=False)
    if second is None or second[1] != [_RETURN]:
        return None
    return first[0], second[0]


def _recipe(layer: nn.Module, forward: Any = None) -> tuple[Half, Half] | None:
    """The halves of ``layer`` (see :func:`_forward_recipe`) when it has every child they call, else None."""
    found = _forward_recipe(forward if forward is not None else type(layer).forward)
    children = dict(layer.named_children())
    if found is None or not all(name in children for half in found for name, _ in half):
        return None
    return found


def splittable(layer: nn.Module) -> bool:
    """Whether ``layer`` is a decoder layer this module can checkpoint in two halves."""
    return _recipe(layer) is not None


class AttentionByHeadGroups(TorchFunctionMode):
    """``scaled_dot_product_attention`` per group of KV heads (with their query heads), outputs concatenated;
    ``on_backward`` (if given) is called once attention's backward has produced the query's gradient."""

    def __init__(self, on_backward: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_backward = on_backward
        self.hooked = False  # whether a forward registered ``on_backward``

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # any of SDPA's arguments may come by keyword (``query=q``): bind them all by name
            options = {**dict(zip(_SDPA_ARGUMENTS, args)), **kwargs}
            qkv = [options.pop(name, None) for name in _SDPA_ARGUMENTS[:3]]
            if len(args) > len(_SDPA_ARGUMENTS) or not all(isinstance(t, torch.Tensor) for t in qkv):
                return func(*args, **kwargs)  # arguments this module does not know of, or SDPA's own error
            if self.on_backward is not None and qkv[0].requires_grad:
                qkv[0].register_hook(self._done)
                self.hooked = True
            chunks = _chunks(qkv[0], qkv[1], options)
            if chunks > 1:
                return _by_head_groups(chunks, *qkv, options)
        return func(*args, **kwargs)

    def _done(self, grad: torch.Tensor) -> None:
        self.on_backward()


def _chunks(q: torch.Tensor, k: torch.Tensor, options: dict) -> int:
    """How many head groups to run (:func:`head_groups`); 1 where splitting would change the result (dropout draws
    its mask over all heads) or a mask's head dimension matches neither 1 nor the query heads."""
    if q.dim() != 4 or k.dim() != 4 or options.get("dropout_p", 0.0):
        return 1
    mask = options.get("attn_mask")
    if isinstance(mask, torch.Tensor) and (mask.dim() > 4 or _mask_heads(mask) not in (1, q.shape[1])):
        return 1
    return head_groups(q.shape[1], k.shape[1], q.shape[-2])


def _mask_heads(mask: torch.Tensor) -> int:
    """The size of a mask's head dimension: broadcasting aligns the mask's last three dimensions with the query's
    [heads, tokens, keys], so a 3-D mask's first one is per head too."""
    return mask.shape[-3] if mask.dim() >= 3 else 1


def head_groups(heads: int, kv_heads: int, tokens: int) -> int:
    """Attention over ``tokens`` runs in the most groups that divide both head counts, one per
    :data:`TOKENS_PER_CHUNK` tokens at most (the plan models the same split)."""
    common = math.gcd(heads, kv_heads)
    most = min(common, tokens // TOKENS_PER_CHUNK)
    return max((c for c in range(1, most + 1) if common % c == 0), default=1)


def _by_head_groups(chunks: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict) -> torch.Tensor:
    mask = options.pop("attn_mask", None)
    qs, ks, vs = (t.split(t.shape[1] // chunks, dim=1) for t in (q, k, v))
    per_head = isinstance(mask, torch.Tensor) and _mask_heads(mask) > 1
    masks = mask.split(mask.shape[-3] // chunks, dim=-3) if per_head else (mask,) * chunks
    outs = [F.scaled_dot_product_attention(*qkv, attn_mask=m, **options) for *qkv, m in zip(qs, ks, vs, masks)]
    # joined in [batch, tokens, heads, dim] memory, the layout of a fused kernel's output (transformers transposes
    # it back and calls .contiguous(): a no-op then, a copy of the whole output otherwise)
    return torch.cat([o.transpose(1, 2) for o in outs], dim=2).transpose(1, 2)


def _half(layer: nn.Module, calls: Half, x: torch.Tensor, attention_kwargs: dict | None = None,
          mode: AttentionByHeadGroups | None = None) -> torch.Tensor:
    """``x + f_k(... f_1(x))`` with the layer's own children (attention with ``attention_kwargs``, under ``mode``)."""
    y = x
    for name, kind in calls:
        module = getattr(layer, name)
        if kind == "attention":
            with mode or AttentionByHeadGroups():
                y = module(hidden_states=y, **attention_kwargs)[0]
        else:
            y = module(y)[0] if kind == "pair" else module(y)
    return x + y


class SplitLayerCheckpoint:
    """Stands in for a decoder layer's ``_gradient_checkpointing_func`` (transformers' layer checkpointing calls
    it with the layer's bound forward): checkpoints the two halves with ``original``, the function it replaces.

    ``offloader`` (the :class:`tiledmlp.ActivationOffloader` that installed it) is told when an attention half's
    input went to the host, and when that attention's backward is done: it fetches the previous layer's MLP-half
    input then, not while attention's backward, the layer's widest point, runs."""

    def __init__(self, original: Callable[..., Any], offloader: Any = None) -> None:
        self.original = original
        self.offloader = offloader

    def __call__(self, fn: Any, *args: Any) -> Any:
        layer, kwargs = _bound_layer(fn)
        recipe = None if layer is None else _recipe(layer, getattr(fn, "func", None) if fn.args else None)
        if recipe is None or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            warnings.warn(f"tiledmlp split_layers: cannot split this call ({type(layer).__name__}); checkpointing the "
                          "whole layer", RuntimeWarning, stacklevel=2)
            return self.original(fn, *args)
        attention, mlp = recipe
        off = self.offloader
        mode = AttentionByHeadGroups(None if off is None else off.attention_backward_done)
        moved = None if off is None else off.stats.offloaded
        h = self.original(functools.partial(_half, layer, attention, attention_kwargs=kwargs, mode=mode), args[0])
        if off is not None and mode.hooked and off.stats.offloaded > moved:  # the input's group is the newest
            off.fetch_previous_after_attention()
        return self.original(functools.partial(_half, layer, mlp), h)


def _bound_layer(fn: Any) -> tuple[nn.Module | None, dict]:
    """The layer and keyword arguments of transformers' checkpointed call: ``partial(forward, layer, **kw)``
    (transformers 5) or ``partial(layer.__call__, **kw)`` (4.x)."""
    if not isinstance(fn, functools.partial):
        return None, {}
    if len(fn.args) == 1 and isinstance(fn.args[0], nn.Module):
        return fn.args[0], dict(fn.keywords)
    owner = getattr(fn.func, "__self__", None)
    return (owner, dict(fn.keywords)) if isinstance(owner, nn.Module) and not fn.args else (None, {})
