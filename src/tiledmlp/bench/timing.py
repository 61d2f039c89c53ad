"""Round-robin timing for ``tiledmlp bench``: every configuration takes its turn in each round, so machine-load
drift hits all alike, and a median per configuration (robust to one slow call on a shared box)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence

import torch

from ..measure import synchronize

__all__ = ["time_interleaved", "median_ms", "allocator_events"]


def allocator_events(device: torch.device | str | None) -> int:
    """Device allocations plus allocation retries (each retry freed the cache, a device-wide sync) the caching
    allocator of ``device`` has made so far; 0 where there is no such allocator (CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    module = getattr(torch, dev.type, None)
    stats = getattr(module, "memory_stats", None) if dev.type != "cpu" else None
    if stats is None:
        return 0
    got = stats(dev)
    return int(got.get("num_device_alloc", 0)) + int(got.get("num_alloc_retries", 0))


def time_interleaved(
    steps: Mapping[str, Callable[[], object]],
    *,
    repeat: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    on_step: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    settle: bool = False,
    events: dict[str, list[tuple[int, int]]] | None = None,
    device_seconds: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each step, run round-robin (A B C, B C A, ...) so machine-load drift hits all alike.

    ``warmup`` rounds are run first and discarded; accelerators are synchronised around each call.
    ``on_step(name)`` is called after every timed or warm-up call (for a progress bar). ``clock`` may be
    ``time.process_time`` on a shared CPU box: CPU seconds of this process, unaffected by other jobs taking turns
    on the cores (pair it with one torch thread, or idle OpenMP spinning is counted too).

    ``settle``: each timed call follows an untimed call of the same step, so the caching allocator serves it from
    the blocks its own last call freed, as in training, where one step repeats; round-robin, a step otherwise
    finds the cache as another configuration left it and may allocate device memory (slow at gigabytes) or free
    the cache (a device-wide sync) inside the timed call. ``events[name]``, if given, receives per timed call
    (:func:`allocator_events` in the settling call, in the timed call): what the allocator did in each.
    ``device_seconds[name]``, if given on CUDA, receives the settling call's device time with a head start: the GPU
    spins (``torch.cuda._sleep``) while the host queues the step, and CUDA events time the step's own kernels and
    any wait for the host beyond that start. Inside a model the host queues a layer while the GPU runs the layers
    before it, so this is the time the step costs there; the synchronised wall time also counts the host's work
    before the first kernel.
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
            before = allocator_events(device)
            if settle and r >= warmup:
                if device_seconds is not None and _on_cuda(device):
                    device_seconds.setdefault(name, []).append(_head_start_seconds(steps[name]))
                else:
                    steps[name]()
            synchronize(device)
            settled = allocator_events(device)
            t0 = clock()
            result = steps[name]()
            synchronize(device)
            elapsed = clock() - t0
            del result
            if r >= warmup:
                times[name].append(elapsed)
                if events is not None:
                    events.setdefault(name, []).append((settled - before, allocator_events(device) - settled))
            if on_step is not None:
                on_step(name)
    return times


HEAD_START_CYCLES = 20_000_000  # ~10 ms of GPU spin at H100 clocks: more than a step's host lead over its kernels


def _on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _head_start_seconds(step: Callable[[], object]) -> float:
    """One call of ``step`` timed by CUDA events after a head start (see :func:`time_interleaved`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HEAD_START_CYCLES)
    start.record()
    result = step()
    end.record()
    del result
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def median_ms(seconds: Sequence[float]) -> float:
    """Median of a list of durations in seconds, in milliseconds (robust to one slow outlier on a shared box)."""
    return statistics.median(seconds) * 1000.0
