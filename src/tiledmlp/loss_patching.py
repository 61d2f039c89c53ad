"""Making a Hugging Face causal LM compute its training loss with :func:`tiledmlp.tiled_causal_lm_loss`.

``patch_loss(model)`` sets an instance-level ``forward`` on each supported ``*ForCausalLM`` found in ``model``
(so PEFT, DDP and FSDP wrappers around it are fine) and a dispatching ``forward`` on its ``lm_head``. When
``labels`` are given while training (``model.training`` or grad enabled) and ``logits_to_keep == 0``, the model's
own forward runs -- its base model, its MoE aux loss, its outputs -- with two stand-ins for the call:

- ``self.lm_head(hidden_states)`` computes the tiled loss *inside* the ``lm_head`` module's call, so the module's
  hooks fire around it -- FSDP2's pre-forward unshard (and its pre-backward unshard and post-backward
  reduce-scatter) and DeepSpeed ZeRO-3's gather -- and the weight read there is the full weight, not a shard. It
  returns that scalar loss where the logits were;
- ``self.loss_function(logits, labels, ...)`` (an instance attribute for the call) hands that loss back.

The returned ``loss`` equals the untiled one (same shift, ignore_index, ``num_items_in_batch``, ``shift_labels``,
Gemma-2/3 final soft-capping, a MoE model's router aux loss) while ``logits`` is ``None``: the point is never to
build them. Everything else (no labels, eval under no-grad, a non-zero ``logits_to_keep``) runs the original
forward unchanged, logits included; ``patch_loss(model, tile_eval=True)`` tiles eval under no-grad too, for an
evaluation that needs only the loss (at long sequences its logits would not fit where training does).

Which classes qualify is read from their forward's syntax tree (:func:`tiled_loss_refusal`), not from a list:
``logits`` may only come from ``self.lm_head(hidden_states)``, be scaled by a number the model holds (Granite's
``config.logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``), be soft-capped under
``if self.config.final_logit_softcapping is not None``, go into ``self.loss_function`` and into the output. The
tiled loss scales and caps them itself, and those numbers read 1 and None during the call, so the forward leaves
the scalar it gets in place of logits as it is. A forward that does anything else with them -- a z-loss, a
branch on them -- is refused, never silently changed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .distributed import refuse_data_parallel
from .loss import check_label_smoothing, tiled_causal_lm_loss
from .recompute import resolve_accumulate_dtype
from .tiling import NumShards, validate_num_shards

__all__ = ["patch_loss", "unpatch_loss", "tiled_loss_refusal"]

# Statements that scale the logits by a number the model holds: (where it is, from the model; the factor it makes).
# The tiled loss scales them itself (``logit_scale``); during the call that number reads 1, so the forward's own
# statement leaves the scalar it gets in place of logits as it is.
_SCALINGS: dict[str, tuple[tuple[str, ...], Callable[[float], float]]] = {
    "logits = logits / self.config.logits_scaling": (("config", "logits_scaling"), lambda v: 1.0 / v),  # Granite
    "logits = logits * self.logit_scale": (("logit_scale",), lambda v: v),  # Cohere
    "logits = self.lm_head(hidden_states) * self.model.lm_head_multiplier":  # Falcon-H1
        (("model", "lm_head_multiplier"), lambda v: v),
}
# The statements that may read or write ``logits`` in a supported forward (``ast.unparse`` spelling).
_ALLOWED = [re.compile(re.escape(text)) for text in _SCALINGS] + [re.compile(p) for p in (
    r"logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)",
    r"logits = logits / self\.config\.final_logit_softcapping",
    r"logits = torch\.tanh\(logits\)",
    r"logits = logits \* self\.config\.final_logit_softcapping",
    r"loss = self\.loss_function\((logits=)?logits, (labels=)?labels, "
    r"(vocab_size=)?self\.(config\.)?vocab_size, \*\*kwargs\)",
)]
_SOFTCAP = "logits = torch.tanh(logits)"
_SOFTCAP_GUARD = "self.config.final_logit_softcapping is not None"


@dataclass(frozen=True)
class _Forward:
    """What the syntax check found in a causal LM's forward."""

    refusal: str = ""  # why the tiled loss cannot stand in, or ""
    softcap: bool = False  # soft-caps its logits by config.final_logit_softcapping
    scalings: tuple[str, ...] = ()  # its statements in _SCALINGS


@functools.lru_cache(maxsize=None)
def _forward_check(cls: type) -> _Forward:
    """What ``cls.forward`` does with its logits (see the module docstring)."""
    params = inspect.signature(cls.forward).parameters
    if not {"labels", "logits_to_keep"} <= params.keys() or not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _Forward("its forward takes no labels, logits_to_keep and **kwargs")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return _Forward("its forward's source cannot be read")
    softcap, heads, losses, scalings = False, 0, 0, []
    guarded = {id(st) for node in ast.walk(tree.body[0]) if isinstance(node, ast.If)
               and ast.unparse(node.test) == _SOFTCAP_GUARD for st in node.body}
    for node in ast.walk(tree.body[0]):
        if not isinstance(node, ast.stmt) or isinstance(node, (ast.FunctionDef, ast.If, ast.For, ast.While, ast.With,
                                                               ast.Try)):
            continue
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == "logits"]
        if not names:
            continue
        text = ast.unparse(node)
        if isinstance(node, ast.Return):  # only as the output's ``logits=logits``
            call = node.value
            passed = [k for k in getattr(call, "keywords", []) if k.arg == "logits"
                      and isinstance(k.value, ast.Name) and k.value.id == "logits"]
            if isinstance(call, ast.Call) and len(passed) == len(names):
                continue
            return _Forward(f"its forward returns logits in another way ({text[:80]})")
        if not any(p.fullmatch(text) for p in _ALLOWED):
            return _Forward(f"its forward does more with the logits than the tiled loss can ({text[:80]})")
        if "final_logit_softcapping" in text or text == _SOFTCAP:
            if id(node) not in guarded:
                return _Forward(f"its forward soft-caps the logits unconditionally ({text[:80]})")
            softcap = True
        if text in _SCALINGS:
            scalings.append(text)
        heads += text.startswith("logits = self.lm_head")
        losses += text.startswith("loss = self.loss_function")
    # tests of ``if``/``while`` statements reading logits are caught too: their ``logits`` names sit in the test
    for node in ast.walk(tree.body[0]):
        if isinstance(node, (ast.If, ast.While)) and any(
                isinstance(n, ast.Name) and n.id == "logits" for n in ast.walk(node.test)):
            return _Forward(f"its forward branches on the logits ({ast.unparse(node.test)[:80]})")
    if heads != 1 or losses != 1:
        return _Forward("its forward does not compute logits = self.lm_head(...) and loss = self.loss_function(...) "
                        "once")
    return _Forward("", softcap, tuple(scalings))


def _owner(model: nn.Module, path: tuple[str, ...]) -> tuple[Any, str]:
    """The object holding the number at ``path`` (from ``model``) and its attribute name."""
    owner = model
    for name in path[:-1]:
        owner = getattr(owner, name)
    return owner, path[-1]


def tiled_loss_refusal(model: nn.Module) -> str:
    """Why ``model`` (a ``*ForCausalLM``) cannot compute its loss tiled, or "" when it can."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    found = _forward_check(type(model))
    if found.refusal:
        return found.refusal
    for text in found.scalings:
        owner, name = _owner(model, _SCALINGS[text][0])
        value = getattr(owner, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
            return f"its logit scale {'.'.join(_SCALINGS[text][0])} is {value!r}, not a non-zero number"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or head is not getattr(model, "lm_head", None):
        return "its output embeddings are not self.lm_head"
    if _head_linears(head) is None:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return (f"lm_head is a {kind}, not an nn.Linear (or PEFT's modules_to_save copy of one); a Linear subclass "
                "with its own forward (a quantized head) is not one either. A LoRA adapter on "
                "lm_head is not supported: leave lm_head out of the LoRA target_modules (modules_to_save=['lm_head'] "
                "works)")
    if getattr(model, "loss_function", None) is not LOSS_MAPPING["ForCausalLM"]:
        return "it uses a custom loss_function; the tiled loss only replaces transformers' ForCausalLMLoss"
    return ""


@dataclass
class _LossRequest:
    """What ``lm_head`` needs to return the loss instead of logits, and the loss it returned."""

    labels: torch.Tensor
    shift: bool
    ignore_index: int
    num_items_in_batch: Any
    softcap: float | None
    num_shards: NumShards
    accumulate_dtype: object
    label_smoothing: float = 0.0
    logit_scale: float | None = None
    loss: torch.Tensor | None = field(default=None)


class _HeadForward:
    """``lm_head.forward``: the tiled loss while a request is pending, the original forward otherwise. Under
    accelerate's hooks it is the forward they wrap (``_old_forward``): they move the input, load offloaded weights."""

    def __init__(self, head: nn.Module, original: Callable[..., Any] | None) -> None:
        self.head = head
        self.original = original
        self.request: _LossRequest | None = None
        self.disabled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request, self.request = self.request, None  # for the forward's one lm_head call only
        if request is None or self.disabled:
            fn = self.original if self.original is not None else type(self.head).forward.__get__(self.head)
            return fn(*args, **kwargs)
        (hidden_states,) = args
        request.loss = tiled_causal_lm_loss(
            hidden_states, self.head.weight, request.labels, lm_head_bias=self.head.bias,
            num_shards=request.num_shards, ignore_index=request.ignore_index,
            num_items_in_batch=request.num_items_in_batch, logit_softcap=request.softcap, shift=request.shift,
            accumulate_dtype=request.accumulate_dtype, logit_scale=request.logit_scale,
            label_smoothing=request.label_smoothing)
        return request.loss


class _TiledLossForward:
    """The instance-level ``forward`` of a patched causal LM."""

    def __init__(self, model: nn.Module, num_shards: NumShards, accumulate_dtype: object, label_smoothing: float,
                 tile_eval: bool) -> None:
        self.model = model
        self.num_shards = num_shards
        self.accumulate_dtype = accumulate_dtype
        self.label_smoothing = label_smoothing
        self.tile_eval = tile_eval
        self.original: Callable[..., Any] | None = model.__dict__.get("forward")
        self.disabled = False  # unpatched while something (accelerate's autocast wrapper) still calls it
        self.signature = inspect.signature(type(model).forward)
        # Trainer reads inspect.signature(model.forward) to decide which dataset columns to keep
        self.__signature__ = inspect.signature(self._original())
        self.last_used_tiled = False

    def _original(self) -> Callable[..., Any]:
        return self.original if self.original is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        bound = self.signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        extra = dict(a.get("kwargs", {}))
        keep = a["logits_to_keep"]
        tiled = (not self.disabled and a["labels"] is not None and isinstance(keep, int) and keep == 0
                 and (self.tile_eval or model.training or torch.is_grad_enabled()))
        self.last_used_tiled = tiled
        if not tiled:
            return self._original()(*args, **kwargs)
        inputs = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
        if isinstance(inputs, torch.Tensor):
            refuse_data_parallel(model, inputs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        shift_labels = extra.get("shift_labels")
        found = _forward_check(type(model))
        # the numbers the forward applies to its logits: applied by the tiled loss, neutral for the call
        neutral = [(*_owner(model, ("config", "final_logit_softcapping")), None)] if found.softcap else []
        scale = 1.0
        for text in found.scalings:
            path, factor = _SCALINGS[text]
            owner, name = _owner(model, path)
            scale *= factor(getattr(owner, name))
            neutral.append((owner, name, 1.0))
        request = _LossRequest(
            labels=a["labels"] if shift_labels is None else shift_labels, shift=shift_labels is None,
            ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
            softcap=model.config.final_logit_softcapping if found.softcap else None, num_shards=self.num_shards,
            accumulate_dtype=self.accumulate_dtype, label_smoothing=self.label_smoothing,
            logit_scale=None if scale == 1.0 else scale)
        heads = _install_head(model)
        for head in heads:  # whichever of them the lm_head call runs answers the request
            head.request = request
        had_own = "_loss_function" in model.__dict__
        own = model.__dict__.get("_loss_function")
        model.loss_function = functools.partial(_hand_back, request)
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in neutral]
        for owner, name, value in neutral:
            setattr(owner, name, value)
        try:
            out = self._original()(*args, return_dict=True, **kwargs)
        finally:
            for head in heads:
                head.request = None
            for owner, name, value in saved:
                setattr(owner, name, value)
            if had_own:
                model.loss_function = own
            else:
                del model._loss_function
        # the same output, its ``logits`` (the loss the lm_head call returned) left out
        out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
        return out if return_dict else out.to_tuple()


def _hand_back(request: _LossRequest, logits: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The model's ``loss_function`` during a tiled call: what its ``lm_head`` call returned in place of logits.

    That is the tiled loss as the module's hooks passed it on (DeepSpeed ZeRO-3 routes a module's outputs through
    its pre-backward Function, so it may be another tensor than the one computed): it is returned as handed over.
    """
    if request.loss is None or not isinstance(logits, torch.Tensor) or logits.shape != request.loss.shape:
        raise RuntimeError("tiledmlp: the patched causal LM's loss_function was not handed the tiled loss its lm_head "
                           "computed; this model's forward is not one patch_loss supports (unpatch_loss it)")
    return logits


def _head_linears(head: nn.Module) -> list[nn.Linear] | None:
    """The Linears an ``lm_head`` call may run: the head itself, or under PEFT's ``modules_to_save`` wrapper its
    original (adapters disabled) and each adapter's trained copy; None for anything else."""
    if _linear(head):
        return [head]
    original, copies = getattr(head, "original_module", None), getattr(head, "modules_to_save", None)
    if type(head).__name__ == "ModulesToSaveWrapper" and _linear(original) \
            and isinstance(copies, nn.ModuleDict) and all(_linear(m) for m in copies.values()):
        return [original, *copies.values()]
    return None


def _linear(module: object) -> bool:
    """An ``nn.Linear`` computing ``F.linear`` (a subclass with its own forward, e.g. a quantized one, is not)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


# Where a patched forward may sit: ``forward``, the one accelerate's hooks wrap, the one its Accelerator wrapped
_SLOTS = ("forward", "_old_forward", "_original_forward")


def _found(module: nn.Module, kind: type) -> Any:
    return next((f for f in map(module.__dict__.get, _SLOTS) if isinstance(f, kind)), None)


def _install_head(model: nn.Module) -> list[_HeadForward]:
    """The dispatching forwards of the current ``lm_head``'s Linears, set where missing (again, if the head was
    replaced, e.g. by a resize, or PEFT added an adapter's copy). Their modules' hooks fire around the loss."""
    found = []
    for head in _head_linears(model.get_output_embeddings()) or []:
        dispatch = _found(head, _HeadForward)
        if dispatch is None:
            slot = "_old_forward" if hasattr(head, "_hf_hook") and "_old_forward" in head.__dict__ else "forward"
            dispatch = _HeadForward(head, head.__dict__.get(slot))
            setattr(head, slot, dispatch)
        found.append(dispatch)
    return found


def _causal_lms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each transformers ``*ForCausalLM`` in ``model`` (not PEFT's wrapper of one; FSDP2
    swaps the class for ``FSDP<Name>``, so the MRO is searched)."""
    from transformers import PreTrainedModel

    return [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel)
            and any(c.__name__.endswith("ForCausalLM") and not c.__name__.startswith("FSDP") for c in type(m).__mro__)]


def patch_loss(model: nn.Module, *, num_shards: NumShards = "auto", accumulate_dtype: object = "auto",
               label_smoothing: float = 0.0, tile_eval: bool = False) -> int:
    """Make every causal LM in ``model`` compute its training loss tiled; returns how many were patched.

    ``accumulate_dtype`` and ``label_smoothing`` are :func:`tiledmlp.loss.tiled_causal_lm_loss`'s (what the head's
    weight grad is summed in; the smoothing of the targets). Works on bare models and through PEFT / DDP / FSDP
    wrappers; patching again updates the options. While the patch is active, a training forward with ``labels``
    returns ``logits=None``. An eval-mode forward under no-grad keeps its logits (metrics need them) unless
    ``tile_eval`` is True: then it too returns only the loss, which at long sequences is what lets evaluation fit
    wherever training does. Label smoothing belongs here, not in ``Trainer``'s ``label_smoothing_factor``: that one
    takes the labels away from the model and smooths full logits, so the tiled loss never runs.
    Raises ValueError naming the class and the reason when ``model`` holds no causal LM, or one whose forward the
    tiled loss cannot stand in for (see :func:`tiled_loss_refusal`).
    """
    validate_num_shards(num_shards)
    resolve_accumulate_dtype(accumulate_dtype, torch.float32)  # ValueError/TypeError on a bad value
    check_label_smoothing(label_smoothing)
    if not isinstance(tile_eval, bool):
        raise TypeError(f"tile_eval must be True or False, got {type(tile_eval).__name__}")
    found = _causal_lms(model)
    if not found:
        classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("LM")})
        raise ValueError(f"patch_loss: no *ForCausalLM in {type(model).__name__} (found {classes or 'none'}); "
                         "call tiledmlp.tiled_causal_lm_loss on the hidden states directly")
    for name, module in found:
        reason = tiled_loss_refusal(module)
        if reason:
            raise ValueError(f"patch_loss: {name or 'model'} ({type(module).__name__}) cannot take the tiled loss: "
                             f"{reason}")
    for _, module in found:
        current = module.__dict__.get("forward")
        if isinstance(current, _TiledLossForward) and not current.disabled:
            current.num_shards, current.accumulate_dtype = num_shards, accumulate_dtype
            current.label_smoothing, current.tile_eval = float(label_smoothing), tile_eval
        else:
            module.forward = _TiledLossForward(module, num_shards, accumulate_dtype, float(label_smoothing), tile_eval)
        _install_head(module)
    return len(found)


def unpatch_loss(model: nn.Module) -> int:
    """Restore the original forwards set by :func:`patch_loss`; returns how many causal LMs were restored.
    One wrapped since (accelerate's mixed precision) stays in that chain, switched off: it calls what it wrapped."""
    restored = 0
    for module in model.modules():
        for slot in _SLOTS:
            current = module.__dict__.get(slot)
            if not isinstance(current, (_TiledLossForward, _HeadForward)) or current.disabled:
                continue
            current.disabled = True
            if slot == "forward" and current.original is None:
                del module.forward
            elif slot != "_original_forward":  # accelerate's hook calls ``_old_forward``: it must stay callable
                setattr(module, slot, current.original or type(module).forward.__get__(module))
            restored += isinstance(current, _TiledLossForward)
    return restored
