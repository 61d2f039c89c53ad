"""Round-robin timing for ``tiledmlp bench``: every configuration takes its turn in each round, so machine-load
drift hits all alike, and a median per configuration (robust to one slow call on a shared box)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import torch

from ..memory import synchronize

__all__ = ["time_interleaved", "median_ms"]


def time_interleaved(
    steps: Mapping[str, Callable[[], object]],
    *,
    repeat: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    on_step: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each step, run round-robin (A B C, B C A, ...) so machine-load drift hits all alike.

    ``warmup`` rounds are run first and discarded; accelerators are synchronised around each call.
    ``on_step(name)`` is called after every timed or warm-up call (for a progress bar). ``clock`` may be
    ``time.process_time`` on a shared CPU box: CPU seconds of this process, unaffected by other jobs taking turns
    on the cores (pair it with one torch thread, or idle OpenMP spinning is counted too).
    """
    for name, value, least in (("repeat", repeat, 1), ("warmup", warmup, 0)):  # a negative warmup ate timed rounds
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= {least} (rounds of every step), got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name} must be an int >= {least} (rounds of every step), got {value}")
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeat):
        shift = r % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            t0 = clock()
            result = steps[name]()
            synchronize(device)
            elapsed = clock() - t0
            del result
            if r >= warmup:
                times[name].append(elapsed)
            if on_step is not None:
                on_step(name)
    return times


def median_ms(seconds: Sequence[float]) -> float:
    """Median of a list of durations in seconds, in milliseconds (robust to one slow outlier on a shared box)."""
    return statistics.median(seconds) * 1000.0
