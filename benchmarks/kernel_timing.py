"""Shared by the GPU kernel microbenchmarks (gpu_pointwise.py, gpu_matmul.py): the device a run uses, and kernel
times taken interleaved with CUDA events while the GPU is kept busy, so the host's launch work is not timed."""

from __future__ import annotations

import time
from typing import Callable

import torch


def device_for(tiny: bool, script: str) -> torch.device:
    """CPU for a ``--tiny`` smoke run, else CUDA, which must be here."""
    if tiny:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times CUDA kernels and no CUDA device is here; use --tiny for a CPU run")
    return torch.device("cuda")


def interleaved_ms(steps: dict[str, Callable[[], object]], repeat: int, device: torch.device,
                   before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """``repeat`` rounds of every step in turn; ms per call. ``before`` runs untimed ahead of each call (refilling
    inputs a step overwrites). On CUDA each call is timed by events behind a short GPU spin; on CPU by the clock."""
    cuda = device.type == "cuda"
    samples: dict[str, list[float]] = {name: [] for name in steps}
    pending = []
    for _ in range(repeat):
        for name, step in steps.items():
            if before is not None:
                before()
            if cuda:
                torch.cuda._sleep(1_000_000)  # the GPU busy while the host enqueues: the events time the kernels
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                pending.append((name, start, end))
            else:
                t0 = time.perf_counter()
                step()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        for name, start, end in pending:
            samples[name].append(start.elapsed_time(end))
    return samples
