"""Making a Hugging Face causal LM compute its training loss with :func:`tiledmlp.tiled_causal_lm_loss`.

``patch_loss(model)`` sets an instance-level ``forward`` on each supported ``*ForCausalLM`` found in ``model``
(so PEFT, DDP and FSDP wrappers around it are fine) and a dispatching ``forward`` on its ``lm_head``. When
``labels`` are given while training (``model.training`` or grad enabled) and ``logits_to_keep == 0``, the patched
forward runs the base model exactly as the class forward does, then calls ``lm_head(hidden, <loss request>)``:
the tiled loss runs *inside* the ``lm_head`` module's call, so the module's hooks fire around it -- FSDP2's
pre-forward unshard (and its pre-backward unshard and post-backward reduce-scatter) and DeepSpeed ZeRO-3's gather
-- and ``lm_head.weight`` read there is the full weight, not a shard. The returned ``loss`` equals the untiled one
(same shift, ignore_index, ``num_items_in_batch``, ``shift_labels``, Gemma-2/3 final soft-capping) while
``logits`` is ``None``: the point is never to build them. Everything else (no labels, eval under no-grad, a
non-zero ``logits_to_keep``) runs the original forward unchanged, logits included.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .loss import tiled_causal_lm_loss
from .recompute import resolve_accumulate_dtype
from .tiling import NumShards, validate_num_shards

__all__ = ["patch_loss", "unpatch_loss", "SUPPORTED_CAUSAL_LMS"]

# Classes whose forward (transformers 5.x) is exactly: base model -> slice_logits_to_keep -> lm_head
# [-> final_logit_softcapping] -> ForCausalLMLoss. Models that rescale logits (Granite, Cohere) or add an aux
# loss (MoE) are refused rather than silently changed.
SUPPORTED_CAUSAL_LMS = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM", "GlmForCausalLM",
})
_FORWARD_PARAMS = ["self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                   "labels", "use_cache", "logits_to_keep", "kwargs"]
_BASE_ARGS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache")


@dataclass(frozen=True)
class _LossRequest:
    """What ``lm_head`` needs to return a loss instead of logits (not a tensor: FSDP's input casts skip it)."""

    labels: torch.Tensor
    shift: bool
    ignore_index: int
    num_items_in_batch: Any
    softcap: float | None
    num_shards: NumShards
    accumulate_dtype: object


class _HeadForward:
    """``lm_head.forward``: the tiled loss when handed a :class:`_LossRequest`, the original forward otherwise."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.original: Callable[..., Any] | None = head.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 2 or kwargs or not isinstance(args[1], _LossRequest):
            fn = self.original if self.original is not None else type(self.head).forward.__get__(self.head)
            return fn(*args, **kwargs)
        hidden_states, request = args
        return tiled_causal_lm_loss(hidden_states, self.head.weight, request.labels, lm_head_bias=self.head.bias,
                                    num_shards=request.num_shards, ignore_index=request.ignore_index,
                                    num_items_in_batch=request.num_items_in_batch, logit_softcap=request.softcap,
                                    shift=request.shift, accumulate_dtype=request.accumulate_dtype)


class _TiledLossForward:
    """The instance-level ``forward`` of a patched causal LM."""

    def __init__(self, model: nn.Module, num_shards: NumShards, accumulate_dtype: object) -> None:
        self.model = model
        self.num_shards = num_shards
        self.accumulate_dtype = accumulate_dtype
        self.original: Callable[..., Any] | None = model.__dict__.get("forward")
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
        tiled = (a["labels"] is not None and isinstance(keep, int) and keep == 0
                 and (model.training or torch.is_grad_enabled()))
        self.last_used_tiled = tiled
        if not tiled:
            return self._original()(*args, **kwargs)
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        base = getattr(model, model.base_model_prefix)
        outputs = base(**{name: a[name] for name in _BASE_ARGS}, **extra)
        head = _install_head(model)
        shift_labels = extra.get("shift_labels")
        request = _LossRequest(
            labels=a["labels"] if shift_labels is None else shift_labels, shift=shift_labels is None,
            ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
            softcap=getattr(model.config, "final_logit_softcapping", None), num_shards=self.num_shards,
            accumulate_dtype=self.accumulate_dtype)
        loss = head(outputs.last_hidden_state, request)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return out if return_dict else out.to_tuple()


def _install_head(model: nn.Module) -> nn.Module:
    """The current ``lm_head`` with the dispatching forward set (again, if the head was replaced, e.g. by a resize)."""
    head = model.get_output_embeddings()
    if not isinstance(head.__dict__.get("forward"), _HeadForward):
        head.forward = _HeadForward(head)
    return head


def _supported_name(module: nn.Module) -> str | None:
    """The supported class in the MRO (FSDP2 swaps the class for a generated ``FSDP<Name>`` subclass)."""
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in SUPPORTED_CAUSAL_LMS), None)


def _check_supported(module: nn.Module, name: str) -> None:
    from transformers.loss.loss_utils import LOSS_MAPPING

    where = f"{name or 'model'} ({type(module).__name__})"
    params = list(inspect.signature(type(module).forward).parameters)
    if params != _FORWARD_PARAMS:
        raise ValueError(f"patch_loss: {where} has an unexpected forward signature {params}; this transformers "
                         "version is not supported by the tiled loss patch (call tiled_causal_lm_loss directly)")
    head = module.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"patch_loss: {where}.lm_head is a {type(head).__name__}, not an nn.Linear. A LoRA adapter "
                         "or modules_to_save wrapper on lm_head is not supported: leave lm_head out of the PEFT config")
    if getattr(module, "loss_function", None) is not LOSS_MAPPING["ForCausalLM"]:
        raise ValueError(f"patch_loss: {where} uses a custom loss_function; the tiled loss only replaces "
                         "transformers' ForCausalLMLoss")


def patch_loss(model: nn.Module, *, num_shards: NumShards = "auto", accumulate_dtype: object = "auto") -> int:
    """Make every supported causal LM in ``model`` compute its training loss tiled; returns how many were patched.

    ``accumulate_dtype`` is :func:`tiledmlp.loss.tiled_causal_lm_loss`'s (what the head's weight grad is summed
    in). Works on bare models and through PEFT / DDP / FSDP wrappers; patching again updates both. While
    the patch is active, a training forward with ``labels`` returns ``logits=None``.
    Raises ValueError when ``model`` holds no supported causal LM (see ``SUPPORTED_CAUSAL_LMS``).
    """
    validate_num_shards(num_shards)
    resolve_accumulate_dtype(accumulate_dtype, torch.float32)  # ValueError/TypeError on a bad value
    found = [(n, m) for n, m in model.named_modules() if _supported_name(m) is not None]
    if not found:
        classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("LM")})
        raise ValueError(f"patch_loss: no supported causal LM in {type(model).__name__} (found {classes or 'none'}); "
                         f"supported: {', '.join(sorted(SUPPORTED_CAUSAL_LMS))}")
    for name, module in found:
        _check_supported(module, name)
    for _, module in found:
        current = module.__dict__.get("forward")
        if isinstance(current, _TiledLossForward):
            current.num_shards, current.accumulate_dtype = num_shards, accumulate_dtype
        else:
            module.forward = _TiledLossForward(module, num_shards, accumulate_dtype)
        _install_head(module)
    return len(found)


def unpatch_loss(model: nn.Module) -> int:
    """Restore the original forwards set by :func:`patch_loss`; returns how many causal LMs were restored."""
    restored = 0
    for module in model.modules():
        current = module.__dict__.get("forward")
        if isinstance(current, (_TiledLossForward, _HeadForward)):
            if current.original is None:
                del module.forward
            else:
                module.forward = current.original
            restored += isinstance(current, _TiledLossForward)
    return restored
