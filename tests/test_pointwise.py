"""The compiled per-tile kernels (pointwise.py): policy, activation keys, exactness, and the memory they save."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from conftest import assert_rel
from tiledmlp import pointwise
from tiledmlp.bench.configs import Config, make_step, predicted_bytes
from tiledmlp.measure import profiler_peak_bytes


def test_policy_defaults_to_accelerators_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILEDMLP_FUSED", raising=False)
    assert not pointwise.fused_enabled(torch.device("cpu"))
    assert pointwise.fused_enabled(torch.device("cuda"))
    monkeypatch.setenv("TILEDMLP_FUSED", "1")
    assert pointwise.fused_enabled(torch.device("cpu"))
    monkeypatch.setenv("TILEDMLP_FUSED", "0")
    assert not pointwise.fused_enabled(torch.device("cuda"))
    pointwise.set_fused(True)  # an explicit choice wins over the environment
    try:
        assert pointwise.fused_enabled(torch.device("cpu"))
    finally:
        pointwise.set_fused("auto")
    with pytest.raises(ValueError, match="set_fused takes True, False or 'auto'"):
        pointwise.set_fused("yes")


def test_activation_keys_are_shared_by_behaviour_not_by_object() -> None:
    """Every HF layer owns its activation module; one compiled kernel must serve them all."""
    a, b = ACT2FN["silu"], ACT2FN["silu"]
    assert a is not b and pointwise.fusable_activation(a) == pointwise.fusable_activation(b) is not None
    tanh, exact = ACT2FN["gelu_pytorch_tanh"], ACT2FN["gelu"]
    assert pointwise.fusable_activation(tanh) != pointwise.fusable_activation(exact)
    assert pointwise.fusable_activation(nn.GELU(approximate="tanh")) != pointwise.fusable_activation(nn.GELU())
    assert pointwise.fusable_activation(F.silu) is F.silu
    assert pointwise.fusable_activation(nn.PReLU()) is None  # has a parameter
    hooked = nn.SiLU()
    hooked.register_forward_hook(lambda *a: None)
    assert pointwise.fusable_activation(hooked) is None
    assert pointwise.fusable_activation(lambda t: t * torch.sigmoid(t)) is None  # unknown code: stays eager


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_glu_kernels_are_compiled_and_equal_autograd_float64(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = []
    real = torch.compile
    monkeypatch.setattr(pointwise.torch, "compile", lambda fn, **kw: compiled.append(fn) or real(fn, **kw))
    pointwise._compiled.cache_clear()
    fn = ACT2FN[act]
    key = pointwise.fusable_activation(fn)
    gate, up, dh = (torch.randn(33, 20, dtype=torch.float64) for _ in range(3))
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    product = fn(g) * u
    product.backward(dh)
    h = pointwise.glu_product(key, fn, gate, up, fused=True)
    assert_rel(h, product.detach(), 1e-14, "product")
    pointwise.glu_backward_(key, dh, gate, up)  # in place
    assert len(compiled) == 2, "both kernels went through torch.compile"
    assert_rel(gate, g.grad, 1e-14, "d gate")
    assert_rel(up, u.grad, 1e-14, "d up")
    assert_rel(dh, product.detach(), 1e-14, "d(product) overwritten by the product")


def test_a_kernel_inductor_cannot_build_runs_eagerly_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's Inductor failed to generate the CPU loss tile (KeyError inside codegen): the same body then
    runs eagerly, warned once, and gives the same numbers."""

    class Broken(Exception):
        pass

    calls = []

    def broken_compile(fn, **kw):
        def run(*args):
            calls.append(1)
            raise Broken("codegen failed")
        return run

    monkeypatch.setattr(pointwise.torch, "compile", broken_compile)
    monkeypatch.setattr(pointwise, "_compile_errors", lambda: (Broken,))
    pointwise._compiled.cache_clear()
    try:
        key = pointwise.fusable_activation(ACT2FN["silu"])
        gate, up = (torch.randn(5, 7, dtype=torch.float64) for _ in range(2))
        with pytest.warns(RuntimeWarning, match="running it eagerly"):
            h = pointwise.glu_product(key, ACT2FN["silu"], gate, up, fused=True)
        assert_rel(h, torch.nn.functional.silu(gate) * up, 1e-15, "product")
        pointwise.glu_product(key, ACT2FN["silu"], gate, up, fused=True)  # no second try, no second warning
        assert len(calls) == 1
    finally:
        pointwise._compiled.cache_clear()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_cross_entropy_tile_equals_autograd_float64(softcap: float | None, smoothing: float) -> None:
    z = torch.randn(9, 31, dtype=torch.float64) * 3
    y = torch.randint(0, 31, (9,))
    ref = z.clone().requires_grad_()
    capped = ref if softcap is None else softcap * torch.tanh(ref / softcap)
    loss = F.cross_entropy(capped, y, reduction="sum", label_smoothing=smoothing)
    (loss * 0.25).backward()
    scale = torch.tensor(0.25, dtype=torch.float64)
    try:
        total = pointwise.cross_entropy_tile_(z, y, scale, softcap, smoothing, True)
    except pointwise.KernelUnavailable:  # this torch cannot compile it here (2.11 on CPU): its body, run eagerly
        total = pointwise._cross_entropy_(z, y, scale, softcap, smoothing, True)
    assert abs(float(total - loss.detach())) <= 1e-12 * abs(float(loss.detach()))
    assert_rel(z, ref.grad, 1e-13, "logits overwritten by their gradient")


_ONLINE_SOFTMAX_PROBE = """
import torch
import torch._inductor.fx_passes.post_grad as post_grad
from tiledmlp import pointwise
seen = []
def probe(match):  # called only where the graph has the softmax pattern; CPU has no online kernel: don't replace
    seen.append(match.kwargs["x"].meta["val"].shape[-1])
    return False
post_grad.prepare_softmax_extra_check = probe
for rows in (9, 13, 6):  # tiles of different lengths, one vocabulary
    z, y = torch.randn(rows, 1000, dtype=torch.bfloat16), torch.randint(0, 1000, (rows,))
    try:
        pointwise.cross_entropy_tile_(z, y, torch.tensor(0.5), None, 0.0, True)
    except pointwise.KernelUnavailable:  # torch 2.11's CPU code generation fails after the pattern passes ran
        break
print(seen)
"""


def test_loss_tile_has_the_shape_of_inductors_online_softmax() -> None:
    """On GPUs Inductor computes a row's max and sum of exponentials in one pass when the graph has its softmax
    pattern and the row length is a constant; the loss tile must keep both (torch.logsumexp's decomposition did
    not match, and a dynamic vocabulary falls back to two passes), or every tile reads its logits once more. The
    pattern check is device-free: a fresh process records it before Inductor's passes are built."""
    from torch._inductor.fx_passes import post_grad

    if not hasattr(post_grad, "prepare_softmax_extra_check"):
        pytest.skip("this torch has no online-softmax pattern in Inductor")
    # the pattern passes run only where Inductor's graph caches miss; its C++ kernel may come from the disk cache
    # (forcing every cache off had compiled it afresh each run: 27 s against 13-16 s, side by side)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", _ONLINE_SOFTMAX_PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "[1000]", out.stdout  # matched once, static vocab, no recompile per tile


def test_compiled_tile_holds_three_tile_buffers_not_five() -> None:
    """Profiler peak of one tiled LlamaMLP step (CPU, float32, 4 tiles): the compiled kernels keep gate, up and one
    [t, I] buffer per tile where eager keeps five; the memory model says so to the byte."""
    cfg = Config("swiglu", 128, 512, 1024, 1, "float32", "tiledmlp", "4")
    peaks = {}
    for mode in (False, True):
        pointwise.set_fused(mode)
        try:
            step = make_step(**cfg.kwargs())
            step()
            peaks[mode] = profiler_peak_bytes(step, device="cpu")
            predicted = predicted_bytes(cfg)
        finally:
            pointwise.set_fused("auto")
        assert predicted is not None and abs(predicted - peaks[mode]) <= 0.02 * peaks[mode], (mode, predicted)
    tile = 256 * 512 * 4
    assert peaks[False] - peaks[True] == 2 * tile


def test_scale_rounds_once_from_float32_in_place() -> None:
    """bf16 ``x * g`` with ``g = 1/40`` (not a bf16 number): the same bits as ``(x.float() * g).to(bf16)``, written
    by one compiled kernel into ``x``'s own buffer."""
    x = torch.randn(10, 7).to(torch.bfloat16)
    g = torch.tensor(1 / 40)
    expected = (x.float() * g).to(torch.bfloat16)
    ptr = x.data_ptr()
    out = pointwise.scale_(x, g)
    assert out.data_ptr() == ptr and torch.equal(out, expected)
