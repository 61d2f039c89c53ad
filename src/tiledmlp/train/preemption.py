"""Stopping on a signal without losing work: SIGTERM or SIGUSR1 ends training after the optimizer step that is
running, on every rank after the same step, with a checkpoint to resume from.

Schedulers send SIGTERM some seconds before they kill a job (Kubernetes, SLURM's ``scancel`` and time limit), and
SLURM's ``--signal=USR1@SECONDS`` sends SIGUSR1 that long before the time limit. Trainer itself dies mid-step, and
a long-sequence run loses every step since its last ``--save_steps`` checkpoint: minutes to hours. Ranks agree
through ``Accelerator.check_trigger`` (an all-reduce of one flag per step), so a signal that reached one rank
stops all of them after the same step, and FSDP's and ZeRO-3's checkpoint collectives run on every rank.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from types import FrameType
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

__all__ = ["StopOnSignal", "STOP_SIGNALS", "STOPPED_EXIT_CODE", "MEASUREMENT_ENV", "last_complete_checkpoint"]

# set in a ``--compare`` phase's environment: a measurement, stopped by a signal without a checkpoint (it saves
# none, and one would make the next comparison into the same folder refuse to start)
MEASUREMENT_ENV = "TILEDMLP_COMPARE_PHASE"

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# the exit code of a run stopped this way, on every rank whichever signal it got: 128 + SIGTERM, as a shell reports a
# terminated process, so job scripts and launchers tell it from a finished run
STOPPED_EXIT_CODE = 128 + int(signal.SIGTERM)


class StopOnSignal(TrainerCallback):
    """While training, SIGTERM and SIGUSR1 only raise a flag; at the end of each optimizer step the ranks combine
    their flags, and if any is up every rank saves a checkpoint and stops. ``stopped_at`` is then that step. A flag
    raised during the last step stops nothing (a checkpoint there would resume past the end): the run finishes as
    usual and ``came_at_end`` says so. The stop checkpoint is a full one (optimizer, scheduler, random state)
    even under ``--save_only_model true``: it exists to be resumed, and weights alone would resume with a fresh
    optimizer (``--resume_from_checkpoint`` refuses those)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.received: int | None = None  # the signal this process got
        self.stopped_at: int | None = None
        self.came_at_end = False
        self._previous: dict[int, Any] = {}
        self._weights_only = False  # --save_only_model, turned off for the stop checkpoint

    def _raise_flag(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        # --auto_find_batch_size begins training again after an out-of-memory error: the handlers to put back are
        # the ones found the first time, not this callback's own
        if not self._previous and threading.current_thread() is threading.main_thread():  # signals: main thread
            self._previous = {s: signal.signal(s, self._raise_flag) for s in STOP_SIGNALS}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.received is not None:
            self.accelerator.set_trigger()
        if self.accelerator.check_trigger():  # every rank, every step: the all-reduce must match
            if state.global_step >= state.max_steps:
                self.came_at_end = True
                return
            self.stopped_at = state.global_step
            control.should_training_stop = True
            if os.environ.get(MEASUREMENT_ENV):
                return
            control.should_save = True
            self._weights_only = self._weights_only or bool(args.save_only_model)
            args.save_only_model = False  # Trainer reads it when it saves, right after this step
            control.should_evaluate = False  # the grace period is for the checkpoint
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self._weights_only:
            args.save_only_model, self._weights_only = True, False
        self.restore()

    def outcome(self, max_steps: int, output_dir: str) -> str | None:
        """What the signal did, for the log: the checkpoint this run saved (not the folder's newest, which may be an
        earlier run's) and how to resume it, or that it came as the run finished; None without a signal."""
        if self.stopped_at is not None and os.environ.get(MEASUREMENT_ENV):
            return f"stopped by a signal after step {self.stopped_at} of {max_steps}: a --compare phase, nothing saved"
        if self.stopped_at is not None:
            saved = os.path.join(output_dir, f"checkpoint-{self.stopped_at}")
            resume = "last" if last_complete_checkpoint(output_dir) == saved else saved
            return (f"stopped by a signal after step {self.stopped_at} of {max_steps}: {saved} saved; add "
                    f"--resume_from_checkpoint {resume} to go on")
        if self.came_at_end:
            name = "a stop signal (another rank's)" if self.received is None else signal.Signals(self.received).name
            return f"{name} came during the last step ({max_steps} of {max_steps}): the run finished instead of " \
                   "stopping"
        return None

    def restore(self) -> None:
        """The signals' earlier handlers back (also after a failed run: a raised flag must not outlive training)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` holding its ``trainer_state.json``, which Trainer writes last:
    a save cut short (out of memory while gathering the optimizer state) leaves a folder without it that cannot be
    resumed. None when there is none; ``--resume_from_checkpoint last`` resumes this one."""
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(output_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", name))
             and os.path.isfile(os.path.join(output_dir, name, "trainer_state.json"))]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None
