"""What transformers renamed within 5.x, in one place, so tiledmlp runs on every transformers 5 release.

5.23 renamed gradient checkpointing to activation checkpointing: ``model.activation_checkpointing_enable``,
``model.is_activation_checkpointing`` and ``TrainingArguments(activation_checkpointing=...)``. There the old names
are deprecated aliases (each warns); 5.0-5.22 have only the old ones. tiledmlp calls whichever this transformers
has, and ``tiledmlp train`` accepts both spellings of the flags on every 5.x (see :func:`checkpointing_flags`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["enable_checkpointing", "is_checkpointing", "checkpointing_flags"]


def _kind(model: nn.Module) -> str:
    return "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"


def enable_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None = None) -> None:
    """Turn on transformers' layer checkpointing; ``kwargs`` go to ``torch.utils.checkpoint`` (None: its default)."""
    kind = _kind(model)
    getattr(model, f"{kind}_checkpointing_enable")(**{f"{kind}_checkpointing_kwargs": kwargs})


def is_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' layer checkpointing is on for ``model``."""
    return bool(getattr(model, f"is_{_kind(model)}_checkpointing"))


def checkpointing_flags(training_fields: set[str]) -> dict[str, str]:
    """Flag renames that make both spellings work with a ``TrainingArguments`` having ``training_fields``: the new
    names mapped to the old ones before 5.23 (after it, transformers maps the old ones itself)."""
    if "activation_checkpointing" in training_fields:
        return {}
    return {"activation_checkpointing": "gradient_checkpointing",
            "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}
