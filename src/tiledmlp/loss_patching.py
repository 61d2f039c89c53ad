"""Making a Hugging Face causal LM compute its training loss with :func:`tiledmlp.tiled_causal_lm_loss`.

``patch_loss(model)`` sets an instance-level ``forward`` on each supported ``*ForCausalLM`` found in ``model``,
on a vision-language or audio model's ``*ForConditionalGeneration`` and on an older ``*LMHeadModel`` (GPT-2's) that
the check below admits (so PEFT, DDP and FSDP wrappers around it are fine), and a dispatching ``forward`` on its
``lm_head``. When ``labels`` are given while training (``model.training`` or grad enabled) and
``logits_to_keep == 0``, the model's own forward runs -- its base model, its MoE aux loss, its outputs -- with two
stand-ins for the call:

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

Which classes qualify is read from their forward's syntax tree (:mod:`tiledmlp.loss_support`), not from a list:
``logits`` may only come from ``self.lm_head(hidden_states)``, be scaled by a number the model holds (Granite's
``config.logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``), be soft-capped under
``if self.config.final_logit_softcapping is not None``, go into ``self.loss_function`` and into the output. The
tiled loss scales and caps them itself, and those numbers read 1 and None during the call, so the forward leaves
the scalar it gets in place of logits as it is. A forward that does anything else with them -- a z-loss, a
branch on them -- is refused, never silently changed; so is a forward hook on ``lm_head`` that changes what the
head returned, by returning another tensor or by changing the loss in place (a temperature).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .distributed import refuse_data_parallel
from .loss import tiled_causal_lm_loss
from .loss_support import (_SCALINGS, _causal_lms, _forward_check, _head_linears, _owner, check_label_smoothing,
                           check_shift_labels, loss_targets, softcap_config, tiled_loss_refusal)
from .norms import FORWARD_SLOTS, class_forward
from .recompute import functorch_active, resolve_accumulate_dtype, tensor_versions
from .tiling import NumShards, validate_num_shards

__all__ = ["patch_loss", "unpatch_loss", "tiled_loss_refusal", "loss_targets", "loss_options"]

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
    loss_version: int | None = 0  # the loss's version as lm_head computed it: a hook changing it in place is caught too
    loss_copy: torch.Tensor | None = None  # its value instead, for an inference tensor (no version counter)
    vocab: int = 0  # the rows of the head that computed it


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
            fn = self.original if self.original is not None else class_forward(self.head)
            return fn(*args, **kwargs)
        (hidden_states,) = args
        request.vocab = self.head.weight.shape[0]
        request.loss = tiled_causal_lm_loss(
            hidden_states, self.head.weight, request.labels, lm_head_bias=self.head.bias,
            num_shards=request.num_shards, ignore_index=request.ignore_index,
            num_items_in_batch=request.num_items_in_batch, logit_softcap=request.softcap, shift=request.shift,
            accumulate_dtype=request.accumulate_dtype, logit_scale=request.logit_scale,
            label_smoothing=request.label_smoothing)
        # an inference tensor (torch.inference_mode) has no version counter: its value is kept instead (a scalar)
        (request.loss_version,) = tensor_versions([request.loss])
        request.loss_copy = request.loss.detach().clone() if request.loss_version is None else None
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
        params = list(self.signature.parameters)[1:]
        self.labels_at = params.index("labels") if "labels" in params else len(params)  # its place among *args
        # Trainer reads inspect.signature(model.forward) to decide which dataset columns to keep
        self.__signature__ = inspect.signature(self._original())
        self.last_used_tiled = False

    def _original(self) -> Callable[..., Any]:
        return self.original if self.original is not None else class_forward(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("labels") is None and len(args) <= self.labels_at:  # no labels (generation): untiled, and
            self.last_used_tiled = False  # under torch.compile traced straight through, with no graph break
            return self._original()(*args, **kwargs)
        # Dynamo traces the model's forward in between, not the argument binding and source checks: they run
        # eagerly (one graph break each), as the tiled loss itself does
        call = self._enter(args, kwargs)
        if call is None:
            return self._original()(*args, **kwargs)
        return_dict, kwargs, undo = call
        try:
            out = self._original()(*args, return_dict=True, **kwargs)
        finally:
            _leave(undo)
        # the same output, its ``logits`` (the loss the lm_head call returned) left out
        out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
        return out if return_dict else out.to_tuple()

    @torch.compiler.disable
    def _enter(self, args: tuple, kwargs: dict[str, Any]) -> tuple[bool, dict[str, Any], _Undo] | None:
        """None where the call runs untiled; else ``return_dict``, the kwargs left to pass and what to undo after
        the call, the tiled loss's request set on the heads (whichever of them the lm_head call runs answers it)."""
        model = self.model
        bound = self.signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        extra = dict(a.get("kwargs", {}))
        keep = a["logits_to_keep"]
        inputs = a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")
        # on "meta" (a shape-only run) nothing is allocated, so the model's own loss costs nothing: it runs as is
        meta = isinstance(inputs, torch.Tensor) and inputs.device.type == "meta"
        tiled = (not self.disabled and a["labels"] is not None and isinstance(keep, int) and keep == 0
                 and (self.tile_eval or model.training or torch.is_grad_enabled()) and not meta
                 and not functorch_active())  # torch.func's transforms take no tiled Function
        self.last_used_tiled = tiled
        if not tiled:
            return None
        reason = tiled_loss_refusal(model)  # a custom loss, a hook or an adapter on the head added since patch_loss
        if reason:
            raise ValueError(f"tiledmlp: {type(model).__name__} was changed after patch_loss and cannot take the "
                             f"tiled loss now: {reason}; or unpatch_loss(model) first")
        if isinstance(inputs, torch.Tensor):
            refuse_data_parallel(model, inputs)
        kwargs = dict(kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        shift_labels = extra.get("shift_labels")
        if shift_labels is not None:
            check_shift_labels(shift_labels, a.get("input_ids"), a.get("inputs_embeds"))
        found = _forward_check(type(model))
        # the numbers the forward applies to its logits: applied by the tiled loss, neutral for the call
        cap = getattr(softcap_config(model, found), "final_logit_softcapping", None) if found.softcap else None
        neutral = [(softcap_config(model, found), "final_logit_softcapping", None)] if cap is not None else []
        scale = 1.0
        for text in found.scalings:
            path, factor = _SCALINGS[text]
            owner, name = _owner(model, path)
            scale *= factor(getattr(owner, name))
            neutral.append((owner, name, 1.0))
        request = _LossRequest(
            labels=a["labels"] if shift_labels is None else shift_labels, shift=shift_labels is None,
            ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
            softcap=cap, num_shards=self.num_shards,
            accumulate_dtype=self.accumulate_dtype, label_smoothing=self.label_smoothing,
            logit_scale=None if scale == 1.0 else scale)
        undo = _Undo(model, _install_head(model), "_loss_function" in model.__dict__,
                     model.__dict__.get("_loss_function"),
                     [(owner, name, getattr(owner, name)) for owner, name, _ in neutral])
        try:  # everything set for the call is undone however it ends: a failed call left the next one logits-less
            for head in undo.heads:
                head.request = request
            model.loss_function = functools.partial(_hand_back, request)
            for owner, name, value in neutral:
                _assign(owner, name, value)
        except BaseException:
            _leave(undo)
            raise
        return return_dict, kwargs, undo


@dataclass
class _Undo:
    """What a tiled call set on the model, to be put back after it."""
    model: nn.Module
    heads: list[_HeadForward]
    had_own: bool  # the instance had its own ``loss_function``
    own: Any
    saved: list[tuple[Any, str, Any]]  # (owner, name, value) of the numbers made neutral for the call


@torch.compiler.disable
def _leave(undo: _Undo) -> None:
    """Put back what ``_enter`` set, however the call ended (outside Dynamo's trace, like ``_enter``)."""
    for head in undo.heads:
        head.request = None
    for owner, name, value in undo.saved:
        _assign(owner, name, value)
    if undo.had_own:
        undo.model.loss_function = undo.own
    else:
        undo.model.__dict__.pop("_loss_function", None)


def _assign(owner: object, name: str, value: object) -> None:
    """``setattr``, past a strict config's validation where it refuses the call's neutral value: Gemma3n's config
    types ``final_logit_softcapping`` as a float, so ``None`` (no soft-cap, the tiled loss applies it) was refused
    and every training step failed. The value is restored after the call, so the config never holds it beyond."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        setattr(owner, name, value)
    except StrictDataclassError:
        object.__setattr__(owner, name, value)


def _hand_back(request: _LossRequest, logits: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The model's ``loss_function`` during a tiled call: what its ``lm_head`` call returned in place of logits.

    That is the tiled loss as the module's hooks passed it on (DeepSpeed ZeRO-3 routes a module's outputs through
    its pre-backward Function, so it may be another tensor than the one computed; FSDP2's mixed precision, as
    accelerate sets it for ``--bf16``, casts it to its ``output_dtype``, as it casts the untiled model's loss at the
    root): it is returned as handed over, FSDP2's backward hooks on it.
    """
    if request.loss is None or not isinstance(logits, torch.Tensor) or logits.shape != request.loss.shape:
        raise RuntimeError("tiledmlp: the patched causal LM's loss_function was not handed the tiled loss its lm_head "
                           "computed; this model's forward is not one patch_loss supports (unpatch_loss it)")
    vocab = kwargs.get("vocab_size", args[1] if len(args) > 1 else None)
    if vocab is not None and vocab != request.vocab:  # untiled, ForCausalLMLoss would view the logits as [-1, vocab]
        raise ValueError(f"tiledmlp: the model's loss is over a vocabulary of {vocab} (its config's vocab_size) but "
                         f"its lm_head has {request.vocab} rows; set the config's vocab_size to the head's (as "
                         "resize_token_embeddings does), or unpatch_loss(model)")
    changed = (not torch.equal(request.loss, request.loss_copy) if request.loss_version is None
               else request.loss._version != request.loss_version)
    if changed or (logits is not request.loss
                   and not torch.equal(logits.detach(), request.loss.detach().to(logits.dtype))):
        raise ValueError("tiledmlp: a forward hook on lm_head changed what it returned, which under patch_loss is the "
                         "loss, not the logits (a temperature, a bias): remove the hook, or unpatch_loss(model)")
    return logits


# Where a patched forward may sit: ``forward``, the one accelerate's hooks wrap, the one its Accelerator wrapped
_SLOTS = (*FORWARD_SLOTS, "_original_forward")


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


def loss_options(model: nn.Module) -> dict[str, Any]:
    """The options of the first causal LM in ``model`` patched now (``num_shards``, ``label_smoothing``,
    ``tile_eval``), so that :func:`tiledmlp.patch` updating the loss keeps them; empty where none is patched."""
    for _, module in _causal_lms(model):
        current = _found(module, _TiledLossForward)
        if current is not None and not current.disabled:
            return {"num_shards": current.num_shards, "label_smoothing": current.label_smoothing,
                    "tile_eval": current.tile_eval}
    return {}


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
    found = loss_targets(model)
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
