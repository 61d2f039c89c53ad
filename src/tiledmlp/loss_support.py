"""Which Hugging Face causal LMs the tiled loss can stand in for, read from their forward's syntax tree, and the
heads it can compute: split out of :mod:`tiledmlp.loss_patching` (which installs the stand-ins) because what is
checked, at patch time and at every tiled call, is a question of its own.

``logits`` may only come from ``self.lm_head(hidden_states)``, be scaled by a number the model holds, be soft-capped
under ``if self.config.final_logit_softcapping is not None`` (or the text config's: ``_SOFTCAP_GUARDS``), go into
``self.loss_function`` and into the output (statements under ``if not return_dict:`` aside: the patched forward
never runs them); the head must be a plain ``nn.Linear`` (or PEFT's ``modules_to_save``
copies of one) with no backward pre-hook of its own, which would get the loss's gradient in place of the logits';
the loss function must be transformers' own.

:func:`check_args` is the other half of "what can be computed": the arguments of
:func:`~tiledmlp.loss.tiled_causal_lm_loss`, refused with the argument's name before any tile runs.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import numbers
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .recompute import autocast_on

__all__ = ["tiled_loss_refusal", "loss_targets", "check_args", "check_label_smoothing", "check_shift_labels"]

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
    r"logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)(\.contiguous\(\))?",  # OPT: contiguous
    r"logits = logits / (self\.config\.)?final_logit_softcapping",
    r"logits = torch\.tanh\(logits\)",
    r"logits = logits \* (self\.config\.)?final_logit_softcapping",
    # XGLM also passes pad_token_id, which ForCausalLMLoss (the only loss taken: tiled_loss_refusal) ignores
    r"loss = self\.loss_function\((logits=)?logits, (labels=)?labels, "
    r"(vocab_size=)?self\.(config\.(text_config\.|get_text_config\(\)\.)?)?vocab_size, "
    r"(pad_token_id=self\.config\.pad_token_id, )?\*\*kwargs\)",
)]
_SOFTCAP = "logits = torch.tanh(logits)"
# The soft-cap's guard as each family spells it, and which config holds the cap: the model's, or (a multimodal
# model's) its text config. The last reads a local set by _SOFTCAP_LOCAL, which the forward must hold.
_SOFTCAP_GUARDS = {
    "self.config.final_logit_softcapping is not None": "config",  # Gemma 2/3 text
    "(final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None":
        "text_config",  # Gemma 3n, Gemma 4
    "final_logit_softcapping is not None": "text_config",  # PaliGemma
}
_SOFTCAP_LOCAL = "final_logit_softcapping = getattr(self.config.get_text_config(), 'final_logit_softcapping', None)"
# The head's call, whatever the forward names its result (Falcon: ``lm_logits``), and the legacy tuple output's
# branch: :class:`~tiledmlp.loss_patching._TiledLossForward` calls the forward with ``return_dict=True``, so the
# statements under ``if not return_dict:`` (BLOOM, GPT-J, GPT-Neo, CodeGen, MPT, Falcon: ``output = (logits,) +
# ...``) never run there, as long as ``return_dict`` is only ever set to itself or, when None, the config's.
_HEAD_CALL = re.compile(r"self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)(\.contiguous\(\))?")
_RETURN_DICT_DEFAULT = "return_dict = return_dict if return_dict is not None else self.config.return_dict"


@dataclass(frozen=True)
class _Forward:
    """What the syntax check found in a causal LM's forward."""

    refusal: str = ""  # why the tiled loss cannot stand in, or ""
    softcap: str = ""  # soft-caps its logits by final_logit_softcapping of "config" or "text_config", or ""
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
    body = tree.body[0]
    name = _logits_name(body)
    if name is None:
        return _Forward("its forward holds the head's output in more than one name")
    unused = _tuple_output_branch(body)
    softcap, heads, losses, scalings = "", 0, 0, []
    guards = dict(_SOFTCAP_GUARDS)
    if not any(isinstance(node, ast.Assign) and ast.unparse(node) == _SOFTCAP_LOCAL for node in ast.walk(tree)):
        del guards["final_logit_softcapping is not None"]  # that local, then, holds something else
    guarded = {id(st): guards[ast.unparse(node.test)] for node in ast.walk(body)
               if isinstance(node, ast.If) and ast.unparse(node.test) in guards for st in node.body}
    for node in ast.walk(body):
        if not isinstance(node, ast.stmt) or id(node) in unused or isinstance(
                node, (ast.FunctionDef, ast.If, ast.For, ast.While, ast.With, ast.Try)):
            continue
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name]
        if not names:
            continue
        text = ast.unparse(node) if name == "logits" else re.sub(rf"\b{name}\b", "logits", ast.unparse(node))
        if isinstance(node, ast.Return):  # only as the output's ``logits=logits``
            call = node.value
            passed = [k for k in getattr(call, "keywords", []) if k.arg == "logits"
                      and isinstance(k.value, ast.Name) and k.value.id == name]
            if isinstance(call, ast.Call) and len(passed) == len(names):
                continue
            return _Forward(f"its forward returns logits in another way ({text[:80]})")
        if not any(p.fullmatch(text) for p in _ALLOWED):
            return _Forward(f"its forward does more with the logits than the tiled loss can ({text[:80]})")
        if "final_logit_softcapping" in text or text == _SOFTCAP:
            if id(node) not in guarded:
                return _Forward(f"its forward soft-caps the logits unconditionally ({text[:80]})")
            softcap = guarded[id(node)]
        if text in _SCALINGS:
            scalings.append(text)
        heads += text.startswith("logits = self.lm_head")
        losses += text.startswith("loss = self.loss_function")
    # tests of ``if``/``while`` statements reading logits are caught too: their ``logits`` names sit in the test
    for node in ast.walk(body):
        if isinstance(node, (ast.If, ast.While)) and id(node) not in unused and any(
                isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.test)):
            return _Forward(f"its forward branches on the logits ({ast.unparse(node.test)[:80]})")
    if heads != 1 or losses != 1:
        return _Forward("its forward does not compute logits = self.lm_head(...) and loss = self.loss_function(...) "
                        "once")
    return _Forward("", softcap, tuple(scalings))


def _logits_name(body: ast.AST) -> str | None:
    """The name the forward gives the head's output (``logits`` where it calls no head: refused later), None where
    it gives it two (or also holds other ``logits``)."""
    targets = {t.id for node in ast.walk(body) if isinstance(node, ast.Assign) and _HEAD_CALL.fullmatch(
        ast.unparse(node.value)) for t in node.targets if isinstance(t, ast.Name)}
    if len(targets) > 1:
        return None
    name = targets.pop() if targets else "logits"
    if name != "logits" and any(isinstance(n, ast.Name) and n.id == "logits" for n in ast.walk(body)):
        return None
    return name


def _tuple_output_branch(body: ast.AST) -> set[int]:
    """The statements under ``if not return_dict:`` (with everything in them), which a call with
    ``return_dict=True`` never runs; none where the forward sets ``return_dict`` otherwise than to its default."""
    for node in ast.walk(body):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and "return_dict" in {
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} \
                and ast.unparse(node) != _RETURN_DICT_DEFAULT:
            return set()
    return {id(inner) for node in ast.walk(body) if isinstance(node, ast.If) and ast.unparse(node.test) ==
            "not return_dict" for st in node.body for inner in ast.walk(st)}


def softcap_config(model: nn.Module, found: _Forward) -> Any:
    """The config whose ``final_logit_softcapping`` the forward soft-caps its logits by (``found.softcap``)."""
    return model.config if found.softcap == "config" else model.config.get_text_config()


def _owner(model: nn.Module, path: tuple[str, ...]) -> tuple[Any, str]:
    """The object holding the number at ``path`` (from ``model``) and its attribute name."""
    owner = model
    for name in path[:-1]:
        owner = getattr(owner, name)
    return owner, path[-1]


def tiled_loss_refusal(model: nn.Module) -> str:
    """Why ``model`` (a causal LM, see :func:`_causal_lms`) cannot compute its loss tiled, or "" when it can."""
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
                "works). With tied embeddings PEFT puts one (or trainable tokens) there itself for an adapter on "
                "embed_tokens (ensure_weight_tying, trainable_token_indices): train embed_tokens through "
                "modules_to_save=['embed_tokens'] instead")
    if getattr(model, "loss_function", None) is not LOSS_MAPPING["ForCausalLM"]:
        return "it uses a custom loss_function; the tiled loss only replaces transformers' ForCausalLMLoss"
    hooked = [name for module in {head, *_head_linears(head)} for name in _foreign_hooks(module)]
    if hooked:
        return (f"its lm_head has a backward pre-hook ({', '.join(hooked)}), which would get the loss's gradient in "
                "place of the logits'; remove the hook, or compute the loss untiled")
    return ""


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


# Hooks on the head that may stay whatever they do: the engines' own (FSDP, ZeRO-3 gathers), which care about the
# call, not about what it returns. A forward hook of anyone else sees the loss in place of the logits: one that only
# looks may stay, one that changes the output (a new tensor, or the loss in place) is caught at the call
# (loss_patching._hand_back); a backward pre-hook would change the loss's gradient in place of the logits', which
# nothing can check.
_ENGINE_HOOKS = ("torch", "deepspeed", "accelerate", "tiledmlp")


def _hook_origin(hook: Any) -> str:
    fn = getattr(hook, "func", hook)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return (getattr(fn, "__module__", None) or type(fn).__module__ or "").split(".")[0]


def _foreign_hooks(module: nn.Module) -> list[str]:
    """Names of ``module``'s backward pre-hooks that are not an engine's."""
    return [getattr(h, "__qualname__", type(h).__name__) for h in module._backward_pre_hooks.values()
            if _hook_origin(h) not in _ENGINE_HOOKS]


# A model computing a next-token loss over its lm_head's logits is a ``*ForCausalLM``, a multimodal
# ``*ForConditionalGeneration`` whose text decoder does it the same way (Qwen2.5-VL, Llava, Gemma 3, Voxtral:
# transformers maps both names to ForCausalLMLoss), or one of the older ``*LMHeadModel`` classes (GPT-2, CTRL: no
# loss type in the name, so transformers' default, ForCausalLMLoss); the syntax check, not the name, decides whether
# the tiled loss can stand in.
_OTHER_SUFFIXES = ("ForConditionalGeneration", "LMHeadModel")  # admitted where the tiled loss can stand in
_LM_SUFFIXES = ("ForCausalLM", *_OTHER_SUFFIXES)


def _causal_lms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each transformers causal LM in ``model`` (not PEFT's wrapper of one; FSDP2 swaps the
    class for ``FSDP<Name>``, so the MRO is searched): ``*ForCausalLM``, and a ``*ForConditionalGeneration`` or
    ``*LMHeadModel`` the tiled loss can stand in for (an encoder-decoder's, or one computing its loss another way, is
    left to the causal LM it holds, if any, as before it was considered)."""
    from transformers import PreTrainedModel

    found = []
    for name, module in model.named_modules():
        names = [c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP")]
        if not isinstance(module, PreTrainedModel) or not any(n.endswith(_LM_SUFFIXES) for n in names):
            continue
        if any(n.endswith("ForCausalLM") for n in names) or not tiled_loss_refusal(module):
            found.append((name, module))
    return found


def loss_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The causal LMs :func:`patch_loss` would patch; ValueError naming the class and the reason when there is
    none, or one the tiled loss cannot stand in for (checked before anything is patched)."""
    found = _causal_lms(model)
    if not found:
        generation = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith(_OTHER_SUFFIXES)]
        if generation:
            name, module = generation[0]
            raise ValueError(f"patch_loss: {name or 'model'} ({type(module).__name__}) cannot take the tiled loss: "
                             f"{tiled_loss_refusal(module)}")
        classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("LM")})
        raise ValueError(f"patch_loss: no *ForCausalLM in {type(model).__name__} (found {classes or 'none'}); "
                         "call tiledmlp.tiled_causal_lm_loss on the hidden states directly")
    for name, module in found:
        reason = tiled_loss_refusal(module)
        if reason:
            raise ValueError(f"patch_loss: {name or 'model'} ({type(module).__name__}) cannot take the tiled loss: "
                             f"{reason}")
    targets = {id(m) for _, m in found}
    for name, module in model.named_modules():  # Llama-4's: its language model's logits, its own loss over them
        if id(module) not in targets and type(module).__name__.endswith("ForConditionalGeneration") \
                and _computes_own_loss(type(module)) and any(id(m) in targets for m in module.modules()):
            raise ValueError(f"patch_loss: {name or 'model'} ({type(module).__name__}) computes the loss from the "
                             "logits of the causal LM it holds, so that LM's tiled loss would never run: "
                             f"{tiled_loss_refusal(module)}")
    return found


@functools.lru_cache(maxsize=None)
def _computes_own_loss(cls: type) -> bool:
    """Whether ``cls.forward`` computes a loss itself (rather than taking the one its language model returns)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return any(word in source for word in ("self.loss_function(", "CrossEntropyLoss(", "cross_entropy("))


def check_args(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                reduction: str, num_items_in_batch: object, logit_softcap: float | None, label_smoothing: float
                ) -> None:
    """TypeError/ValueError naming the argument of :func:`~tiledmlp.loss.tiled_causal_lm_loss` that is wrong."""
    for name, t in (("hidden_states", hidden), ("lm_head_weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 2:
        raise ValueError(f"hidden_states must be [B, S, H] or [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight must be [vocab, {hidden.shape[-1]}] (nn.Linear layout), "
                         f"got shape {tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"lm_head_bias must be a tensor of shape ({weight.shape[0]},) or None")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden_states without its last dim), "
                         f"got {tuple(labels.shape)}")
    if not autocast_on(hidden.device.type) and hidden.dtype != weight.dtype:
        raise TypeError(f"hidden_states ({hidden.dtype}) and lm_head_weight ({weight.dtype}) must have the same dtype "
                        "(cast one, or run under torch.autocast)")
    devices = {t.device for t in (hidden, weight, bias) if t is not None}
    if len(devices) > 1 or "meta" in {d.type for d in devices}:
        raise ValueError(f"hidden_states, lm_head_weight and lm_head_bias must be on one real device, got "
                         f"{', '.join(sorted(map(str, devices)))} (an offloaded or dispatched head: move it there "
                         "first)")
    if bias is not None and bias.dtype != weight.dtype and not autocast_on(hidden.device.type):
        raise TypeError(f"lm_head_bias ({bias.dtype}) must have lm_head_weight's dtype ({weight.dtype})")
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor) and (
            isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Real)):
        raise TypeError(f"num_items_in_batch must be a number or a one-element tensor (the labelled tokens the loss "
                        f"is divided by), got {num_items_in_batch!r}")
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError(f"num_items_in_batch must be a number or a one-element tensor (the labelled tokens the loss "
                         f"is divided by), got a tensor of shape {tuple(num_items_in_batch.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError("num_items_in_batch replaces the divisor of reduction='mean'; it cannot be used with 'sum'")
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                                      or not 0 < logit_softcap < math.inf):  # inf: inf * tanh(z / inf) is NaN
        raise ValueError(f"logit_softcap must be a finite positive number or None, got {logit_softcap!r}")
    check_label_smoothing(label_smoothing)


def check_label_smoothing(label_smoothing: object, name: str = "label_smoothing") -> None:
    """A number in [0, 1], as ``F.cross_entropy`` takes it; ValueError naming ``name`` otherwise."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1] (0 = no smoothing), got {label_smoothing!r}")


def check_shift_labels(shift_labels: object, input_ids: object, inputs_embeds: object) -> None:
    """A patched model's ``shift_labels`` kwarg (Trainer's context parallelism, DeepSpeed's sequence parallelism):
    refused under its own name, since the tiled loss reads it as its ``labels`` and would name those instead. Its
    shape is checked against the input tokens', not ``labels``' (a sequence-parallel caller may pass whole ones)."""
    if not isinstance(shift_labels, torch.Tensor):
        raise TypeError(f"shift_labels must be a torch.Tensor of token ids, got {type(shift_labels).__name__}")
    tokens = input_ids.shape if isinstance(input_ids, torch.Tensor) else \
        inputs_embeds.shape[:-1] if isinstance(inputs_embeds, torch.Tensor) else shift_labels.shape
    if shift_labels.shape != tokens:
        raise ValueError(f"shift_labels must have the input tokens' shape {tuple(tokens)}, got "
                         f"{tuple(shift_labels.shape)}: build them as labels[..., 1:] padded at the end with "
                         "ignore_index (-100), as transformers' ForCausalLMLoss does, not labels[..., 1:] alone")
