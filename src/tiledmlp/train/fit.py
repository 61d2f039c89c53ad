"""Will this run fit its device? ``tiledmlp plan``'s answer, read before training starts and after it ran out.

A long-sequence run that does not fit fails minutes in, after the model loaded and the data packed, with an
allocator message that names bytes, not flags. :func:`fit_report` says, in the run's own flags, what the plan
predicts for it, the longest sequence that fits as it is, and the fewest tricks (one more each time, in the order
of what they cost in speed) that would make this sequence fit; ``tiledmlp train`` prints it as a warning before
the first step and after an out-of-memory error, with the checkpoint to resume from.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..offload import SHARED_MEMORY_DEVICES
from ..plan.checks import ELEMENT_SIZES
from ..plan.cli import max_seq_that_fits, searched_limit
from ..plan.model import predict_step_peak
from ..plan.setup import Setup
from ..plan.shapes import ModelShape
from .args import first_line
from .callbacks import format_bytes
from .preemption import last_complete_checkpoint

__all__ = ["RunOutOfMemory", "is_out_of_memory", "device_memory_bytes", "fitting_changes", "fit_report",
           "check_before_training", "after_out_of_memory", "process_overhead", "planned_vs_measured", "MAX_SP"]

MAX_SP = 64  # the largest --sequence_parallel_size suggested


class RunOutOfMemory(RuntimeError):
    """Training or evaluation ran out of memory; the message says what to change and where the work is kept."""


def is_out_of_memory(exc: BaseException) -> bool:
    """An accelerator's ``torch.OutOfMemoryError``, or the CPU allocator's refusal (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(exc)


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory (CPU: physical memory, or the container's cgroup limit when lower); None where
    torch cannot say."""
    if device.type == "cpu":
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
        try:
            limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()  # cgroup v2; "max" when unlimited
        except OSError:
            return physical
        return min(physical, int(limit)) if limit.isdigit() else physical
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "get_device_properties"):
        return None
    try:
        return int(backend.get_device_properties(device).total_memory)
    except (RuntimeError, AssertionError, AttributeError):
        return None


def _ulysses_splits(shape: ModelShape, sp: int) -> bool:
    """Whether Ulysses can split this model's attention over ``sp`` ranks: whole heads per rank, and kv heads
    split or replicated by a whole factor (what :func:`.sequence_parallel.check_model` lets a run start with)."""
    return shape.heads % sp == 0 and (shape.kv_heads % sp == 0 or sp % shape.kv_heads == 0)


def fitting_changes(shape: ModelShape, setup: Setup, seq: int, batch: int, budget: float,
                    accumulation: int = 1) -> tuple[list[str], int] | None:
    """The flags to add, in order, until the plan for ``seq`` tokens fits ``budget`` bytes, and that plan's peak;
    None when no change short of more than :data:`MAX_SP` sequence-parallel ranks does. The order is the cost in
    speed: the same sequences per optimizer step (``batch`` x ``accumulation``) in micro-batches of one, the tiled
    loss and MLP, checkpointing, offloading (not on CPU or MPS, whose memory is the host's), then more devices. The
    tiled loss only for a model ``patch_loss`` takes, the tiled MLP only for one ``patch()`` finds an MLP in, split
    layers only for one whose layers split (``train`` refuses those flags otherwise)."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if batch > 1:
        n = batch * accumulation
        steps.append((f"--per_device_train_batch_size 1 --gradient_accumulation_steps {n} (batch {batch} x "
                      f"accumulation {accumulation}: the same {n} sequences per step)", {}))
    if not setup.tiled_loss and not shape.loss_refusal:
        steps.append(("--use_tiled_loss true", {"tiled_loss": True}))
    if not setup.tiled_mlp and not shape.mlp_refusal:
        steps.append(("--use_tiled_mlp true", {"tiled_mlp": True}))
    if not setup.checkpointing:
        steps.append(("--activation_checkpointing true", {"checkpointing": True}))
    if setup.device_type not in SHARED_MEMORY_DEVICES:
        if not setup.offload:
            steps.append(("--activation_offloading true", {"offload": True, "checkpointing": True}))
        if not setup.split_layers and shape.splittable_layers:
            steps.append(("--activation_offloading_split_layers true", {"split_layers": True}))
    flags: list[str] = []
    for flag, change in steps:
        setup, batch = replace(setup, **change), 1
        flags.append(flag)
        peak = predict_step_peak(shape, setup, seq, batch=batch).peak_bytes
        if peak <= budget:
            return flags, peak
    sp = setup.sequence_parallel_size * 2
    # Ulysses SP is DeepSpeed's: a run without it (no ZeRO stage, no SP yet) is told to add it; an FSDP run, to
    # move to ZeRO-3, FSDP full_shard's DeepSpeed counterpart
    deepspeed = " --deepspeed ds.json" if setup.zero_stage == 0 and setup.sequence_parallel_size == 1 else ""
    if setup.fsdp:
        deepspeed, setup = " --deepspeed ds.json (ZeRO-3) in place of --fsdp", replace(setup, fsdp="", zero_stage=3)
    while sp <= MAX_SP:
        if seq % sp == 0 and _ulysses_splits(shape, sp):
            trial = replace(setup, sequence_parallel_size=sp, world_size=max(setup.world_size, sp))
            peak = predict_step_peak(shape, trial, seq, batch=batch).peak_bytes
            if peak <= budget:
                return [*flags, f"--sequence_parallel_size {sp}{deepspeed} (over {sp} devices)"], peak
        sp *= 2
    return None


def fit_report(shape: ModelShape, setup: Setup, seq: int, batch: int, budget: float, device: str,
               target: float | None = None, accumulation: int = 1) -> list[str]:
    """Lines saying what the plan predicts for this step against ``budget`` bytes, the longest sequence that fits,
    and what would bring this one's plan under ``target`` (default: the budget)."""
    planned = predict_step_peak(shape, setup, seq, batch=batch).peak_bytes
    lines = [f"tiledmlp plan predicts a {format_bytes(planned)} peak for one step of --max_seq_length {seq} "
             f"(batch {batch}) against {device}'s {format_bytes(budget)}"]
    longest = max_seq_that_fits(shape, setup, budget, batch)
    at_least = "at least " if longest and longest == searched_limit(setup, batch) else ""
    lines.append(f"with these flags the longest sequence the plan fits is {at_least}{longest:,} tokens"
                 if longest else "with these flags no sequence of 1024 tokens or more fits")
    size = 2 if setup.autocast else ELEMENT_SIZES[setup.dtype]
    note = shape.sliding_note(seq, batch, size, setup.checkpointing)
    lines += [note] if note else []
    changes = fitting_changes(shape, setup, seq, batch, budget if target is None else target, accumulation)
    if changes:
        flags, peak = changes
        lines.append(f"to fit {seq:,} tokens add: {' '.join(flags)}  (planned {format_bytes(peak)})")
    else:
        lines.append(f"no recipe up to --sequence_parallel_size {MAX_SP} fits {seq:,} tokens here: shorten "
                     "--max_seq_length")
    return lines


def _shape(model: torch.nn.Module) -> ModelShape | None:
    config = getattr(model, "config", None)
    try:
        return None if config is None else ModelShape.from_config(config)
    except Exception:  # not a causal LM the plan knows: advice only, it never fails a run
        return None


def check_before_training(model: torch.nn.Module, setup: Setup, seq: int, batch: int, device: torch.device,
                          accumulation: int = 1) -> list[str]:
    """The warning to print before the first step when the plan does not fit the device; [] when it fits."""
    budget, shape = device_memory_bytes(device), _shape(model)
    try:
        if not budget or shape is None or predict_step_peak(shape, setup, seq, batch=batch).peak_bytes <= budget:
            return []
        lines = fit_report(shape, setup, seq, batch, budget, str(device), accumulation=accumulation)
    except Exception:  # a setup the plan does not model, e.g. an optimizer it does not know
        return []
    return [lines[0] + ": this run will likely run out of memory", *lines[1:]]


def _plan_advice(shape: ModelShape, setup: Setup, seq: int, batch: int, budget: float, device: str,
                 accumulation: int) -> list[str]:
    planned = predict_step_peak(shape, setup, seq, batch=batch).peak_bytes
    if planned > budget:
        return fit_report(shape, setup, seq, batch, budget, device, accumulation=accumulation)
    lines = [f"tiledmlp plan predicted {format_bytes(planned)}, within {device}'s {format_bytes(budget)}: the rest is "
             "memory the plan leaves out (other processes, the allocator's fragmentation; on CUDA "
             "PYTORCH_ALLOC_CONF=expandable_segments:True reduces it)"]
    # well under the plan that failed
    changes = fitting_changes(shape, setup, seq, batch, 0.85 * planned, accumulation)
    if changes:
        lines.append(f"for a plan 15% lower add: {' '.join(changes[0])}  (planned {format_bytes(changes[1])})")
    return lines


def after_out_of_memory(model: torch.nn.Module, setup: Setup | None, seq: int, batch: int, device: torch.device,
                        when: str, output_dir: str, accumulation: int = 1) -> list[str]:
    """What to do after an out-of-memory error ``when`` ("in the evaluation after training"): the plan's view of
    this run, the changes that would fit, and the checkpoint the work is kept in. ``setup`` None: a run the plan
    does not model (FSDP's CPU offload), whose plan would advise wrong flags."""
    lines = [f"out of memory on {device} {when}"]
    if setup is None:
        lines.append("(tiledmlp plan does not model this run's FSDP setup (CPU offload): no advice on flags)")
    else:
        budget, shape = device_memory_bytes(device), _shape(model)
        try:
            if budget and shape is not None:
                lines += _plan_advice(shape, setup, seq, batch, budget, str(device), accumulation)
        except Exception:  # advice only: it must never hide the out-of-memory error itself
            lines.append("(tiledmlp plan cannot model this run: no advice on flags)")
    last = last_complete_checkpoint(output_dir)
    lines.append(f"the last checkpoint is {last}: add --resume_from_checkpoint last to go on from it" if last else
                 "no checkpoint was saved (--save_strategy steps --save_steps N keeps one every N steps)")
    return lines


# Under this many bytes a CPU step's RSS high-water mark is mostly the allocator's and the libraries' own growth
# (tiny-llama at 64 tokens: 3 MiB planned, 22-73 MiB measured), not the step's tensors.
RSS_RESOLUTION = 256 * 2**20


def process_overhead(model: torch.nn.Module, device: torch.device) -> int:
    """CPU: resident bytes beyond the model's tensors before training (interpreter, libraries, data), which the
    RSS high-water mark includes and a plan of tensors does not; 0 on accelerators (allocator counts tensors)."""
    if device.type != "cpu":
        return 0
    try:
        from ..measure import _proc_status_kib

        rss = _proc_status_kib("VmRSS") * 1024
    except (OSError, RuntimeError):
        return 0
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in list(model.parameters()) + list(model.buffers())}
    return max(0, rss - sum(tensors.values()))


def planned_vs_measured(model: torch.nn.Module, setup: Setup, seq: int, batch: int, summary: dict[str, Any],
                        overhead: int) -> str:
    """One line: ``tiledmlp plan``'s peak for this run next to the measured one, compared like with like (no ratio
    where RSS cannot resolve the step)."""
    from ..plan.model import planned_peak_for_model

    try:
        planned = planned_peak_for_model(model, setup, seq, batch=batch).peak_bytes
    except Exception as exc:  # a line of information: it never fails a finished run
        return f"   planned peak: n/a ({first_line(exc)})"
    measured = summary["peak_bytes"] - overhead
    how = (f"{summary['peak_kind']} minus {format_bytes(overhead)} the process held beyond its tensors at start"
           if overhead else summary["peak_kind"])
    if summary["peak_kind"] == "rss-hwm" and max(planned, measured) < RSS_RESOLUTION:
        ratio = f"n/a (a step under {format_bytes(RSS_RESOLUTION)} is below what RSS resolves)"
    else:
        ratio = f"{planned / measured:.2f}x" if measured > 0 else "n/a"
    return f"   planned peak {format_bytes(planned)} (tiledmlp plan) vs measured {format_bytes(measured)} ({how}): " \
           f"plan/measured {ratio}"
