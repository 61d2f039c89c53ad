"""The plan of an MLP activation under autocast: the dtype it runs in there, probed per device type without the device.

CUDA's autocast runs ``pow`` in float32, so GPT-2's tanh GELU holds float32 elements on a GPU under ``--bf16``
(measured on an H100, 2026-11-27), twice what the plan counted from its bf16 probe: GPT-2 small at 16k tokens,
untiled, was planned at 20.81 GiB, now 25.31. CPU autocast does not upcast any activation transformers ships, so
the plan's end-to-end check here uses one that it does upcast: softplus written as a binary cross-entropy with
logits, an op CPU autocast runs in float32 (as CUDA's runs ``softplus`` and ``pow``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_plan import assert_within, measured_and_planned
from test_plan_families import gpt2_config
from torch import nn
from transformers import activations
from trainrun import one_thread  # noqa: F401 (autouse: tiny models run fastest on one thread; the plan reads it)

from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.activation import activation_bytes, autocast_output_sizes


class SoftplusByBCE(nn.Module):
    """``softplus(x)`` as ``BCE-with-logits(x, 0)``: an activation CPU autocast runs in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(x, torch.zeros_like(x), reduction="none")


def _mlp(act: nn.Module) -> nn.Module:
    mlp = nn.Module()
    mlp.up, mlp.act, mlp.down = nn.Linear(4, 8), act, nn.Linear(8, 4)
    return mlp


@pytest.mark.parametrize("name, sizes", [
    ("gelu_new", {"cuda": 4, "xpu": 4, "mps": 4, "cpu": 2}),  # pow
    ("relu2", {"cuda": 4, "xpu": 4, "mps": 4, "cpu": 2}),  # squared ReLU: pow
    ("sqrtsoftplus", {"cuda": 4, "xpu": 4, "mps": 4, "cpu": 2}),  # softplus
    ("silu", {"cuda": 2, "xpu": 2, "mps": 2, "cpu": 2}),
    ("gelu_pytorch_tanh", {"cuda": 2, "xpu": 2, "mps": 2, "cpu": 2}),
])
def test_each_device_types_autocast_is_read_without_the_device(name: str, sizes: dict[str, int]) -> None:
    assert dict(autocast_output_sizes(_mlp(activations.ACT2FN[name]))) == sizes
    assert dict(autocast_output_sizes(_mlp(SoftplusByBCE())))["cpu"] == 4
    assert autocast_output_sizes(nn.Linear(4, 4)) == ()  # no activation: nothing to say


def test_the_probe_allocates_on_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is, torch's ``FakeTensor`` allocates on the devices it is given (2.11: ``cuda`` and ``xpu``; 2.13:
    the current accelerator's): on an H100 under 2.11 the XPU probe failed (a CUDA build has no XPU), so a plan for
    XPU made there counted ``gelu_new``'s bf16 for its float32 (2026-11-27), and under either each probe made a
    CUDA context on device 0. The probe allocates on no device: a machine with one gives what one without does."""
    from torch._subclasses import fake_tensor

    expected = {"cuda": 4, "xpu": 4, "mps": 4, "cpu": 2}
    assert dict(autocast_output_sizes(_mlp(activations.ACT2FN["gelu_new"]))) == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what torch 2.11's FakeTensor asks
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_: torch.device("cuda"))  # torch 2.13's
    init_once = getattr(getattr(fake_tensor, "init_gpu_context", None), "cache_clear", None)
    if init_once is not None:  # FakeTensor makes each device's context once a process: as if none were made yet
        init_once()
    assert dict(autocast_output_sizes(_mlp(activations.ACT2FN["gelu_new"]))) == expected


def test_the_probes_leave_the_generator_and_autocast_as_they_were() -> None:
    """Planning or patching runs the activation on random inputs: the run's random stream (its data order, its
    dropout masks) and the autocast settings it switches on for each device type are restored after."""
    before = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda", "xpu", "mps")}
    mlp = _mlp(activations.ACT2FN["gelu_new"])
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    ModelShape.from_config(gpt2_config())
    activation_bytes(mlp)
    assert torch.equal(torch.rand(3), expected)
    assert {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in before} == before


@pytest.mark.parametrize("recipe", ["untiled", "ckpt"])
def test_the_plan_counts_an_activation_autocast_runs_in_float32(recipe: str, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """GPT-2 with float32 weights under CPU autocast (``--bf16``), its activation upcast there: planned from the
    float32 probe. From its bf16 probe the plan was 0.925 (untiled) and 0.838 (checkpointed) of the measured peak."""
    monkeypatch.setitem(activations.ACT2FN, "softplus_bce", SoftplusByBCE)
    config = gpt2_config()
    config.activation_function, config._attn_implementation = "softplus_bce", "sdpa"
    measured, planned = measured_and_planned(config, torch.float32, recipe, 1024, autocast=True)
    assert_within(measured, planned)
    shape = ModelShape.from_config(config)
    assert dict(shape.activation_autocast)["cpu"] == 4
    setup = Setup(dtype=torch.float32, autocast=True, checkpointing=recipe == "ckpt", device_type="cpu")
    from_bf16 = predict_step_peak(dataclasses.replace(shape, activation_autocast=()), setup, 1024).peak_bytes
    assert from_bf16 < 0.95 * measured < planned


def test_gpt2_on_cuda_under_autocast_is_planned_in_float32() -> None:
    """The same model planned for CUDA and for the CPU: only CUDA's autocast runs its tanh GELU in float32."""
    config = gpt2_config()
    config._attn_implementation = "sdpa"
    shape = ModelShape.from_config(config)
    as_bf16 = dataclasses.replace(shape, activation_autocast=())
    for device, upcast in (("cuda", True), ("cpu", False)):
        setup = Setup(dtype=torch.float32, autocast=True, device_type=device)
        peak, from_bf16 = (predict_step_peak(s, setup, 8192).peak_bytes for s in (shape, as_bf16))
        assert peak > from_bf16 if upcast else peak == from_bf16, device


PARAMETER_FREE = sorted(n for n in activations.ACT2CLS if not list(activations.ACT2FN[n].parameters()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_fake_probe_gives_the_devices_own_autocast_dtype(device: str) -> None:
    """What the plan reads off fake tensors is what the device's autocast gives, for every parameter-free
    activation transformers ships (and the CPU-upcast one above)."""
    acts = {name: activations.ACT2FN[name] for name in PARAMETER_FREE} | {"softplus_bce": SoftplusByBCE()}
    for name, act in acts.items():
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            real = act(torch.randn(2, 8, dtype=torch.bfloat16, device=device)).element_size()
        assert dict(autocast_output_sizes(_mlp(act)))[device] == real, name
