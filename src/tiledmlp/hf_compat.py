"""What transformers renamed within 5.x, in one place: tiledmlp calls the names the installed release has.

5.23 renamed gradient checkpointing to activation checkpointing: ``model.activation_checkpointing_enable``,
``model.is_activation_checkpointing`` and ``TrainingArguments(activation_checkpointing=...)``. There the old names
are deprecated aliases (each warns), so they are not called there; 5.0-5.22 have only the old ones, and
``tiledmlp train`` maps the new flag spellings to them (:func:`checkpointing_flags`). The package requires 5.23 (the
README says what failed on 5.17); these fallbacks keep the checkpointing calls themselves from being what breaks.
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
    """Flag renames that make the two spellings one option with a ``TrainingArguments`` having ``training_fields``:
    the new names mapped to the old ones before 5.23; from 5.23, which has both fields (the new one read first, the
    old ignored where the new is set), the old names to the new ones, so that a flag overrides a ``--config`` key
    in either spelling and a file setting both is refused as two keys for one option."""
    pairs = {"activation_checkpointing": "gradient_checkpointing",
             "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}
    if "activation_checkpointing" in training_fields:
        return {old: new for new, old in pairs.items()}
    return pairs
