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
    dev = resolve_device(device)
    with _no_gc(), _collectives_release_here() if dev.type == "cpu" else contextlib.nullcontext():
        return _profiler_peak_bytes(step, dev)


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


# torch.distributed's collectives whose tensor arguments a process group's worker thread (gloo's) holds while it
# runs them: the name and the positions / keywords of those arguments (lists of tensors too)
_COLLECTIVES: dict[str, tuple[tuple[int, str], ...]] = {
    "all_reduce": ((0, "tensor"),), "broadcast": ((0, "tensor"),), "reduce": ((0, "tensor"),),
    "all_gather": ((0, "tensor_list"), (1, "tensor")), "all_gather_into_tensor": ((0, "output_tensor"),
                                                                                   (1, "input_tensor")),
    "reduce_scatter": ((0, "output"), (1, "input_list")), "reduce_scatter_tensor": ((0, "output"), (1, "input")),
    "all_to_all_single": ((0, "output"), (1, "input")), "all_to_all": ((0, "output_tensor_list"),
                                                                       (1, "input_tensor_list")),
}


@contextlib.contextmanager
def _collectives_release_here() -> Iterator[None]:
    """While a CPU step is measured, each blocking ``torch.distributed`` collective returns only once the process
    group's worker thread has let go of its tensors. gloo runs a collective on a thread of its own, which holds the
    tensors a moment after the caller has them back; where the caller drops them first, they are freed on that
    thread, whose frees the profiler (recording this thread) never sees: the block looked alive to the end of the
    step (Ulysses' all-to-all buffers, 2-4 per layer, at random: measured peaks 59-73 MB for one 49 MB step). Here
    the caller's references outlast the worker's, so each block is freed where the step drops it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    real = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            if kwargs.get("async_op"):  # the caller waits on the work: its tensors are the caller's to hold
                return fn(*args, **kwargs)
            held = _tensors([args[i] if i < len(args) else kwargs.get(key) for i, key in _COLLECTIVES[name]])
            counts = [_references(t) for t in held]
            result = fn(*args, **kwargs)
            _wait_released(held, counts)
            return result

        return call

    for name, fn in real.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _tensors(values: list[object]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor))
    return out


def _wait_released(tensors: list[torch.Tensor], counts: list[int], timeout: float = 1.0) -> None:
    """Until every tensor is referenced no more than before the collective (or ``timeout`` seconds)."""
    import time

    deadline = time.monotonic() + timeout
    while any(_references(t) > n for t, n in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(0)


def _references(t: torch.Tensor) -> int:
    """References to the tensor and to its storage (the worker may hold either, or a view)."""
    return t._use_count() + torch._C._storage_Use_Count(t.untyped_storage()._cdata)


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
