"""The data flags a checkpoint was trained with, saved beside it and compared on resume.

A resumed Trainer skips the batches its checkpoint had seen, counted in its own packed sequences: with another
``--max_seq_length``, dataset, split or text column those are other samples, and the run would go on silently
over data it had trained on, or skip data it never saw. Each checkpoint gets ``tiledmlp_data.json``; a resume
with other values is refused up front, naming the flag, unless ``--ignore_data_skip true`` (Trainer then skips
nothing: the run goes on from the first batch of the data given, which may be other data). The same file holds the
base model's quantization flags, checked apart (``quantization.check_quantization_record``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .args import DataArguments, UsageError

__all__ = ["DATA_RECORD", "data_record", "RecordData", "check_data_record"]

DATA_RECORD = "tiledmlp_data.json"
_FLAGS = ("dataset", "dataset_config", "dataset_split", "text_field", "max_seq_length")


def _where(value: Any) -> Any:
    """A local path as an absolute one (the same folder given relative or absolute is the same data)."""
    if isinstance(value, str) and os.path.exists(os.path.expanduser(value)):
        return os.path.abspath(os.path.expanduser(value))
    return value


def data_record(data_args: DataArguments) -> dict[str, Any]:
    return {flag: _where(getattr(data_args, flag)) for flag in _FLAGS}


class RecordData(TrainerCallback):
    """Writes :func:`data_record` into each checkpoint Trainer saves (the main process only)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            with open(os.path.join(folder, DATA_RECORD), "w") as f:
                json.dump(self.record, f, indent=1)


def check_data_record(folder: str, data_args: DataArguments) -> None:
    """Refuse resuming ``folder`` with data flags other than those it recorded (none recorded: nothing to check)."""
    path = os.path.join(folder, DATA_RECORD)
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return
    now = data_record(data_args)
    for flag in _FLAGS:
        if flag in saved and saved[flag] != now[flag]:
            raise UsageError(f"--resume_from_checkpoint {folder} was trained with --{flag} {saved[flag]} "
                             f"({DATA_RECORD}), not {now[flag]}: its data position would point at other samples; "
                             f"pass --{flag} {saved[flag]}, --ignore_data_skip true to go on from the first batch "
                             "of this data, or start a new run from its weights with --model")
