"""Per-step progress for ``tiledmlp train``: loss, tokens/s and peak memory of each optimizer step.

Peak memory is the device's ``max_memory_allocated`` on accelerators; on CPU it is the process RSS high-water
mark (``VmHWM``), reset at every step through ``/proc/self/clear_refs``. The CPU figure is only meaningful when
the process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (otherwise glibc keeps freed blocks in the heap and RSS
never falls); ``--compare`` starts its phases that way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ProgressCallback

__all__ = ["PeakMemory", "StepRecord", "EvalRecord", "StepReporter", "NonFiniteLoss", "format_bytes"]

_GIB = 1024 ** 3


def format_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 1024 ** 2:.0f} MiB"


class NonFiniteLoss(RuntimeError):
    """The training loss was NaN or infinite: the run stopped there, saving nothing more (exit 1)."""


class PeakMemory:
    """Peak memory since the last :meth:`reset`, on the training device (rank-local)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "rss-hwm" if device.type == "cpu" else f"{device.type}-max-allocated"

    def reset(self) -> None:
        if self.device.type == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # not Linux or not permitted: the high-water mark then covers the whole run
                pass
        else:
            module = getattr(torch, self.device.type, None)
            if module is not None and hasattr(module, "reset_peak_memory_stats"):
                module.reset_peak_memory_stats(self.device)

    def read(self) -> int:
        if self.device.type == "cpu":
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            return int(line.split()[1]) * 1024
            except OSError:
                pass
            return 0
        module = getattr(torch, self.device.type, None)
        return int(module.max_memory_allocated(self.device)) if module is not None else 0


@dataclass
class StepRecord:
    step: int
    seconds: float
    tokens: int
    peak_bytes: int
    loss: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seconds": self.seconds, "tokens": self.tokens, "peak_bytes": self.peak_bytes,
                "loss": self.loss}


@dataclass
class EvalRecord:
    step: int
    loss: float
    seconds: float
    peak_bytes: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "perplexity": self.perplexity, "seconds": self.seconds,
                "peak_bytes": self.peak_bytes}


class StepReporter(ProgressCallback):
    """Trainer's progress bar (unless ``--disable_tqdm``), with one readable line per logged step or evaluation
    instead of a raw dict; keeps a :class:`StepRecord` per optimizer step and an :class:`EvalRecord` per
    evaluation for the final report. An evaluation's time and peak are its own, not the next step's. A logged loss
    that is not finite stops training at that step through Trainer's control flags, before it evaluates or saves
    (the weights that gave it are not finite either); ``non_finite_step`` is then that step."""

    def __init__(self, peak: PeakMemory, tokens_per_step: int) -> None:
        super().__init__()
        self.peak = peak
        self.tokens_per_step = tokens_per_step
        self.records: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.non_finite_step: int | None = None
        self._t0 = 0.0

    def evals_at(self, step: int) -> bool:
        """Whether the model of optimizer step ``step`` was evaluated."""
        return any(e.step == step for e in self.evals)

    def _write(self, line: str) -> None:
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not args.disable_tqdm:
            super().on_train_begin(args, state, control, **kw)
        self.peak.reset()
        self._t0 = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        now = time.perf_counter()
        self.records.append(StepRecord(state.global_step, now - self._t0, self.tokens_per_step, self.peak.read()))
        self.peak.reset()
        self._t0 = now
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kw)

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kw: Any) -> None:
        if not args.disable_tqdm:
            super().on_prediction_step(args, state, control, **kw)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kw: Any) -> None:
        super().on_evaluate(args, state, control, **kw)  # closes the evaluation's progress bar
        now = time.perf_counter()
        loss = (metrics or {}).get("eval_loss")
        if loss is not None:
            record = EvalRecord(state.global_step, float(loss), now - self._t0, self.peak.read())
            self.evals.append(record)
            if state.is_world_process_zero:
                self._write(f"eval after step {record.step:>4}  loss {record.loss:.4f}  perplexity "
                            f"{record.perplexity:.2f}  {record.seconds:.1f} s  peak {format_bytes(record.peak_bytes)} "
                            f"({self.peak.kind})")
        self.peak.reset()
        self._t0 = now

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """A checkpoint is saved after ``on_step_end``: its time and peak (an FSDP or ZeRO-3 gather) are not the
        next step's (they were, until 2026-11-27: 2.9 s and 22 tok/s for a 1 s step after SmolLM2's save)."""
        self.restart()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kw: Any) -> None:
        logs = logs or {}
        if any(key.startswith("eval_") for key in logs):
            return  # on_evaluate wrote its line
        record = self.records[-1] if self.records and self.records[-1].step == state.global_step else None
        if "loss" not in logs or record is None:
            if self.training_bar is not None:
                super().on_log(args, state, control, logs=logs, **kw)
            return
        record.loss = float(logs["loss"])
        finite = math.isfinite(record.loss)
        if not finite and self.non_finite_step is None:  # every rank logs the same gathered loss: all stop here
            self.non_finite_step = record.step
            control.should_training_stop = True
            control.should_evaluate = control.should_save = False
        if state.is_world_process_zero:
            line = (f"step {record.step:>4}/{state.max_steps}  loss {record.loss:.4f}  "
                    f"{record.tokens / max(record.seconds, 1e-9):,.0f} tok/s  {record.seconds:.1f} s  "
                    f"peak {format_bytes(record.peak_bytes)} ({self.peak.kind})"
                    f"{'' if finite else '  NOT FINITE: stopping'}")
            self._write(line)

    def non_finite_message(self) -> str:
        """What stopped the run and what to change (after a ``non_finite_step``)."""
        step = self.non_finite_step or 0
        loss = next((r.loss for r in self.records if r.step == step), float("nan"))
        earlier = f"; the weights it was computed with may not be finite (nor a checkpoint-{step - 1})" \
            if step > 1 else ""
        return (f"the training loss is {loss} at step {step}: stopped there, with no checkpoint at that step and no "
                f"final model{earlier}; lower --learning_rate or set --max_grad_norm (float16 weights: use --dtype "
                "bfloat16)")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kw)

    def restart(self) -> None:
        """Time and peak from now: an evaluation after training measures itself, not the saves before it."""
        self.peak.reset()
        self._t0 = time.perf_counter()
