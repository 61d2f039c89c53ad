"""Stopping on a signal without losing work: SIGTERM or SIGUSR1 ends training after the optimizer step that is
running, on every rank after the same step, with a checkpoint to resume from.

Schedulers send SIGTERM some seconds before they kill a job (Kubernetes, SLURM's ``scancel`` and time limit), and
SLURM's ``--signal=USR1@SECONDS`` sends SIGUSR1 that long before the time limit. Trainer itself dies mid-step, and
a long-sequence run loses every step since its last ``--save_steps`` checkpoint: minutes to hours. Ranks agree
through ``Accelerator.check_trigger`` (an all-reduce of one flag per step), so a signal that reached one rank
stops all of them after the same step, and FSDP's and ZeRO-3's checkpoint collectives run on every rank.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

__all__ = ["StopOnSignal", "STOP_SIGNALS", "STOPPED_EXIT_CODE"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# the exit code of a run stopped this way, on every rank whichever signal it got: 128 + SIGTERM, as a shell reports a
# terminated process, so job scripts and launchers tell it from a finished run
STOPPED_EXIT_CODE = 128 + int(signal.SIGTERM)


class StopOnSignal(TrainerCallback):
    """While training, SIGTERM and SIGUSR1 only raise a flag; at the end of each optimizer step the ranks combine
    their flags, and if any is up every rank saves a checkpoint and stops. ``stopped_at`` is then that step."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.received: int | None = None  # the signal this process got
        self.stopped_at: int | None = None
        self._previous: dict[int, Any] = {}

    def _raise_flag(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if threading.current_thread() is threading.main_thread():  # Python takes signals in the main thread only
            self._previous = {s: signal.signal(s, self._raise_flag) for s in STOP_SIGNALS}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.received is not None:
            self.accelerator.set_trigger()
        if self.accelerator.check_trigger():  # every rank, every step: the all-reduce must match
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_evaluate = False  # the grace period is for the checkpoint
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """The signals' earlier handlers back (also after a failed run: a raised flag must not outlive training)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
