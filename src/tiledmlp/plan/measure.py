"""Measuring the peak memory of one whole training step, to check the plan against.

"The peak of a step" is the highest memory in use at any moment of a *steady-state* optimizer step: weights,
buffers and optimizer states exist before it starts (the first step created the states); gradients start as
``None`` (``zero_grad(set_to_none=True)``, what Trainer does) and are created in the backward; the step is
forward (loss), backward, ``optimizer.step()``, ``zero_grad``. The first step of a run is lower or equal: the
states it creates exist only from its ``optimizer.step()`` on, when activations are gone. Measured as the bytes
alive before the step (summed over the tensors that hold them) plus :func:`tiledmlp.measure.profiler_peak_bytes`
of the step (CPU: exact profiler ``[memory]`` events; accelerators: ``max_memory_allocated``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..measure import profiler_peak_bytes, resolve_device

__all__ = ["build_training_step", "persistent_bytes", "measure_step_peak"]


def persistent_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, *tensors: torch.Tensor) -> int:
    """Bytes of every distinct storage held by the model, the optimizer state and ``tensors`` (deduplicated, so
    tied weights count once)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for t in list(model.parameters()) + list(model.buffers()) + list(tensors):
        add(t)
        add(t.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(seen.values())


def build_training_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """One Trainer-like step over ``input_ids`` (labels = inputs): the loss forward (outputs other than the loss
    dropped before the backward, as Trainer does), backward, AdamW step, ``zero_grad(set_to_none=True)``.
    ``autocast_dtype`` wraps the forward in autocast (``--bf16 true`` with float32 weights). The forward runs
    with ``use_cache=False``, as ``tiledmlp train`` does: HF's default returns a KV cache (every layer's k after
    RoPE and v, float32 under autocast) that would sit on the forward's peak, 9% above the plan (4 layers, 2048
    tokens)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer if optimizer is not None else torch.optim.AdamW(params, lr=1e-5)
    device = input_ids.device

    def loss() -> torch.Tensor:
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    def step() -> None:
        if autocast_dtype is not None:
            with torch.autocast(device.type, dtype=autocast_dtype):
                value = loss()
        else:
            value = loss()
        value.backward()
        del value
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def measure_step_peak(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> int:
    """Peak bytes of a steady-state training step (see the module docstring): one warm-up step creates the
    optimizer states, then the second step is measured."""
    step, opt = build_training_step(model, input_ids, optimizer=optimizer, autocast_dtype=autocast_dtype)
    step()
    device = resolve_device(input_ids.device)
    if device.type != "cpu":
        module = torch.get_device_module(device)
        module.synchronize(device)
        return profiler_peak_bytes(step, device=device) + module.memory_allocated(device)
    return persistent_bytes(model, opt, input_ids) + profiler_peak_bytes(step, device=device)
