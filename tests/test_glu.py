"""The gated fast path: exact for any activation, fused or separate projections, biases, autocast, bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiledmlp
from conftest import assert_rel
from tiledmlp.glu import GLUWeights
from tiledmlp.tiling import even_splits

H, I = 24, 56


def make_spec(fused: bool, bias: bool, act, dtype=torch.float64) -> GLUWeights:
    def p(*shape):
        return (torch.randn(*shape, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()

    rows = 2 * I if fused else I
    return GLUWeights(p(rows, H), p(rows) if bias else None, None if fused else p(I, H),
                      p(I) if bias and not fused else None, p(H, I), p(H) if bias else None, act)


def untiled(spec: GLUWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = spec.gate_up(x)
    return F.linear(spec.act(gate) * up, spec.down_weight, spec.down_bias)


ACTS = {"silu": F.silu, "gelu-tanh": nn.GELU(approximate="tanh"), "relu": torch.relu, "identity": nn.Identity()}


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_glu_parity_float64(act, fused, bias, kernels):
    spec = make_spec(fused, bias, ACTS[act])
    x = torch.randn(3, 29, H, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(3, 29, H, dtype=torch.float64)
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    ref = torch.autograd.grad(untiled(spec, x), inputs, grad_out)
    for splits in ([87], [30, 29, 28], [22, 22, 22, 21], [1] * 87):
        out = tiledmlp.glu_tiled_call(spec, x, splits)
        got = torch.autograd.grad(out, inputs, grad_out)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert_rel(g, r, 1e-12, f"{act} fused={fused} bias={bias} splits={len(splits)} input {k}")


def test_backward_recomputes_gate_up_of_all_tiles_but_the_last():
    spec = make_spec(False, False, F.silu)
    calls = {"n": 0}
    original = spec.gate_up

    def counting(x, *masks):
        calls["n"] += 1
        return original(x, *masks)

    object.__setattr__(spec, "gate_up", counting)
    x = torch.randn(1, 40, H, dtype=torch.float64, requires_grad=True)
    out = tiledmlp.glu_tiled_call(spec, x, [10, 10, 10, 10])
    assert calls["n"] == 4
    out.sum().backward()
    assert calls["n"] == 4 + 3, "the last tile's gate/up are kept from the forward"


def test_frozen_weights_get_no_grad_and_x_without_grad():
    spec = make_spec(False, True, F.silu)
    spec.gate_weight.requires_grad_(False)
    x = torch.randn(2, 20, H, dtype=torch.float64)
    trainable = [t for t in spec.tensors() if t is not None and t.requires_grad]
    ref = torch.autograd.grad(untiled(spec, x).square().sum(), trainable)
    got = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [7, 7, 6, 6, 7, 7]).square().sum(), trainable)
    for g, r in zip(got, ref):
        assert_rel(g, r, 1e-12)


def _spy_stacks(monkeypatch) -> list[bool]:
    """Records, per compiled-tile backward (eager tiles never stack), whether its weight grads come from stacks."""
    from tiledmlp import glu

    seen, real = [], glu._Stacks.make

    def spy(*args):
        stacks = real(*args)
        seen.append(stacks is not None)
        return stacks

    monkeypatch.setattr(glu._Stacks, "make", staticmethod(spy))
    return seen


@pytest.mark.parametrize("seq,tiles", [(64, 4), (12, 2)], ids=["sums", "stacks"])  # stacks: compiled tiles only
def test_autocast_matches_untiled_autocast(seq, tiles, kernels, monkeypatch):
    seen = _spy_stacks(monkeypatch)
    spec = make_spec(False, True, F.silu, dtype=torch.float32)
    x = torch.randn(2, seq, H, requires_grad=True)
    grad_out = torch.randn(2, seq, H, dtype=torch.bfloat16)
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = untiled(spec, x)
        out = tiledmlp.glu_tiled_call(spec, x, even_splits(2 * seq, tiles))
    assert out.dtype == ref_out.dtype == torch.bfloat16
    ref = torch.autograd.grad(ref_out, inputs, grad_out)
    got = torch.autograd.grad(out, inputs, grad_out)
    assert_rel(out.float(), ref_out.float(), 1e-2, "output")
    for k, (g, r) in enumerate(zip(got, ref)):
        assert g.dtype == r.dtype, f"input {k}"
        assert_rel(g, r, 2e-2, f"autocast grad {k}")
    assert seen == ([tiles == 2] if kernels == "compiled" else [])


def test_double_backward_refused():
    spec = make_spec(False, False, F.silu)
    x = torch.randn(1, 8, H, dtype=torch.float64, requires_grad=True)
    out = tiledmlp.glu_tiled_call(spec, x, [4, 4])
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("act", ["silu", "gelu-tanh"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_weight_grads_float64_exact(act, fused, bias, kernels, monkeypatch):
    """Few tokens (16 against H = 24, float64) and tiles not tiny (memory.glu_stacks_fit): compiled tiles stack
    gate/up's grads and the product for all tokens and form each weight grad as one matmul at the end; exact."""
    seen = _spy_stacks(monkeypatch)
    spec = make_spec(fused, bias, ACTS[act])
    x = torch.randn(2, 8, H, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 8, H, dtype=torch.float64)
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    ref = torch.autograd.grad(untiled(spec, x), inputs, grad_out)
    for splits in ([8, 8], [9, 7], [1] * 16):
        got = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, splits), inputs, grad_out)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert_rel(g, r, 1e-12, f"{act} fused={fused} bias={bias} splits={len(splits)} input {k}")
    # one-token tiles: the sums' loop holds less than the stacks' end would (memory.glu_stacks_fit), so sums
    assert seen == ([True, True, False] if kernels == "compiled" else [])
    x_long = torch.randn(1, 3 * H, H, dtype=torch.float64, requires_grad=True)  # T = 3H: float64 sums instead
    tiledmlp.glu_tiled_call(spec, x_long, [3 * H // 2] * 2).sum().backward()
    assert seen[3:] == ([False] if kernels == "compiled" else [])


@pytest.mark.parametrize("fused", [False, True])
def test_stacked_bf16_error_no_worse_than_untiled(fused, kernels, monkeypatch):
    """bf16, 4 tiles, T = 5H/3 (the stacks hold fewer bytes than the float32 sums): each weight grad is one bf16
    matmul over all tokens, one rounding as untiled; error against float64 within 1.5x untiled's."""
    seen = _spy_stacks(monkeypatch)
    spec64 = make_spec(fused, True, F.silu)
    spec = GLUWeights(*[None if t is None else t.detach().bfloat16().requires_grad_() for t in spec64.tensors()],
                      F.silu)
    x64 = torch.randn(2, 20, H, dtype=torch.float64).bfloat16().double().requires_grad_()
    x = x64.detach().bfloat16().requires_grad_()
    grad_out = torch.randn(2, 20, H, dtype=torch.float64).bfloat16()
    ref = torch.autograd.grad(untiled(spec64, x64), [x64, *(t for t in spec64.tensors() if t is not None)],
                              grad_out.double())
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    plain = torch.autograd.grad(untiled(spec, x), inputs, grad_out)
    tiled = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [10, 10, 10, 10]), inputs, grad_out)
    assert seen == ([True] if kernels == "compiled" else [])
    for k, (t, u, r) in enumerate(zip(tiled, plain, ref)):
        assert t.dtype == torch.bfloat16
        err_t = float((t.double() - r).norm() / r.norm())
        err_u = float((u.double() - r).norm() / r.norm())
        assert err_t <= 1.5 * err_u + 1e-6, f"input {k}: tiled {err_t:.2e} untiled {err_u:.2e}"
