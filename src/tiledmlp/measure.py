"""Measuring the peak memory of a step, device-agnostic: :func:`profiler_peak_bytes` (exact; profiler ``[memory]``
events on CPU, the allocator's peak on accelerators), :func:`rss_peak_bytes` / :func:`measure_in_subprocess` (end-to-end
resident memory of a fresh process, the cross-check). :mod:`tiledmlp.memory` predicts the peaks these measure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from typing import Callable, Iterator, Mapping

import torch

__all__ = ["profiler_peak_bytes", "rss_peak_bytes", "measure_in_subprocess", "synchronize", "resolve_device"]


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``None`` means the current accelerator when there is one (that is where a step's tensors live), else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type)
    return torch.device("cpu")


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued accelerator work so a timer or a peak counter sees all of it (no-op on CPU)."""
    dev = resolve_device(device)
    if dev.type != "cpu":
        torch.get_device_module(dev).synchronize(dev)


def profiler_peak_bytes(step: Callable[[], object], *, device: torch.device | str | None = None) -> int:
    """Exact peak bytes allocated above the pre-step baseline while ``step()`` runs (its result is dropped).

    CPU: the torch profiler's ``[memory]`` events (allocations positive, frees negative), sorted by time, running
    sum, maximum; deterministic and blind to allocator caching. Frees count only for blocks the step made (by
    address), so on CPU this is the peak of the step's own allocations.
    Accelerators: the device allocator's
    ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before the step.
    ``device=None`` picks the current accelerator if there is one, else CPU.
    """
    with _no_gc():
        return _profiler_peak_bytes(step, resolve_device(device))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Garbage from earlier work collected first, none during the step: a cycle freed mid-step would subtract
    blocks allocated before it from the running sum and make the peak look smaller."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _profiler_peak_bytes(step: Callable[[], object], dev: torch.device) -> int:
    if dev.type != "cpu":  # the device module's allocator stats (cuda, xpu, npu, ...; torch >= 2.2)
        module = torch.get_device_module(dev)
        synchronize(dev)
        module.reset_peak_memory_stats(dev)
        before = module.memory_allocated(dev)
        result = step()
        synchronize(dev)
        del result
        return max(0, module.max_memory_allocated(dev) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
        del result
    allocation = torch._C._profiler._ExtraFields_Allocation
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        fields = node.extra_fields
        if isinstance(fields, allocation) and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        nodes.extend(node.children)
    events.sort(key=lambda event: event[0])
    # a free counts only where this step made the block: torch's CPU memory reporter may know the size of a block
    # made before the step (its table keeps blocks an earlier profile saw made and that were freed while none
    # ran, and a later block at the same address inherits the entry) and then reports its free (tests/test_memory:
    # a 1 MiB step measured at 24 KiB once, after a 2 MiB block made before it was freed in it)
    made: set[int] = set()
    running = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            made.add(ptr)
        elif ptr in made:
            made.discard(ptr)
        else:
            continue
        running += nbytes
        peak = max(peak, running)
    return peak


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_peak_bytes(step: Callable[[], object]) -> int:
    """Resident-set high-water mark above the pre-step RSS during ``step()`` (Linux only).

    Resets the kernel's mark by writing ``5`` to ``/proc/self/clear_refs`` and reads ``VmHWM``. Only honest in a
    process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (else glibc keeps freed blocks and tiling looks free):
    use :func:`measure_in_subprocess`. Includes allocator and library overhead the profiler does not see.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _proc_status_kib("VmRSS")
    result = step()
    del result
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


def measure_in_subprocess(
    target: str,
    kwargs: Mapping[str, object] | None = None,
    *,
    warmup: int = 1,
    rss: bool = True,
    profiler: bool = True,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Build a step in a fresh Python and measure its peak there, so one configuration cannot pollute the next.

    ``target`` is ``"module:function"``; ``function(**kwargs)`` must return a step callable that leaves no state
    behind (e.g. clears ``.grad``). The child (started with ``MALLOC_MMAP_THRESHOLD_=65536``) runs ``warmup``
    steps (library init, thread pools), then measures :func:`rss_peak_bytes` and :func:`profiler_peak_bytes`.
    ``env`` adds variables (e.g. ``OMP_NUM_THREADS``). Returns ``"rss_peak_bytes"`` and/or ``"profiler_peak_bytes"``.
    """
    # one merge, ``env`` last: ``dict(..., KINETO_LOG_LEVEL=..., **env)`` raised TypeError when env named it too
    child_env = {**os.environ, "KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "5"), **(env or {})}
    child_env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    payload = json.dumps({"target": target, "kwargs": dict(kwargs or {}), "warmup": warmup, "rss": rss,
                          "profiler": profiler})
    proc = subprocess.run(
        [sys.executable, "-m", "tiledmlp.measure", payload],
        env=child_env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement child failed ({proc.returncode}) for {target}: {proc.stderr[-2000:]}")
    return {k: int(v) for k, v in json.loads(lines[-1]).items()}


def _child_main(payload: str) -> int:
    import importlib

    spec = json.loads(payload)
    module_name, func_name = spec["target"].split(":")
    step = getattr(importlib.import_module(module_name), func_name)(**spec["kwargs"])
    for _ in range(spec["warmup"]):
        step()
    result = {}
    if spec["rss"]:
        result["rss_peak_bytes"] = rss_peak_bytes(step)
    if spec["profiler"]:
        result["profiler_peak_bytes"] = profiler_peak_bytes(step, device="cpu")  # the CPU method, GPU or not
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
