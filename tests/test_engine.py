"""The generic engine (`tiled_call`) against an untiled float64 reference: issue 2's cases 1-8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiledmlp
from conftest import assert_rel, rel_err

H, I = 24, 56
F64 = torch.float64


class Swiglu(nn.Module):
    def __init__(self, h: int = H, i: int = I, dtype: torch.dtype = F64, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up = nn.Linear(h, i, bias=True, dtype=dtype)
        self.down = nn.Linear(i, h, bias=True, dtype=dtype)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.silu(self.gate(x)) * self.up(x)))


def grads_of(fn, x, params, grad_out):
    """Output and grads of x and params after ``fn(x).backward(grad_out)`` from fresh grads."""
    x = x.detach().requires_grad_(x.requires_grad)
    for p in params:
        p.grad = None
    out = fn(x)
    out.backward(grad_out)
    return out.detach(), x.grad, [p.grad for p in params]


def check_parity(mlp, x, num_shards, grad_out=None, tol=1e-12):
    params = list(mlp.parameters())
    grad_out = torch.randn_like(mlp(x)) if grad_out is None else grad_out
    ref = grads_of(mlp, x, params, grad_out)
    got = grads_of(lambda t: tiledmlp.tiled_call(mlp, t, params=params, num_shards=num_shards), x, params, grad_out)
    assert_rel(got[0], ref[0], tol, "output")
    assert_rel(got[1], ref[1], tol, "x.grad")
    for k, (a, b) in enumerate(zip(got[2], ref[2])):
        assert_rel(a, b, tol, f"param {k} grad")


@pytest.mark.parametrize("shape", [(1, 50, H), (3, 37, H), (2, 64, H)])
@pytest.mark.parametrize("num_shards", [1, 2, 4, 7])
def test_case1_batch_sizes_float64(shape, num_shards):
    check_parity(Swiglu(), torch.randn(*shape, dtype=F64, requires_grad=True), num_shards)


def test_case1_float32_tolerance():
    check_parity(Swiglu(dtype=torch.float32), torch.randn(2, 45, H, requires_grad=True), 4, tol=1e-5)


@pytest.mark.parametrize(
    "shape,num_shards",
    [((37, H), 4), ((3, H), 8), ((1, H), 4), ((1, 1, H), 3), ((0, H), 4), ((2, 0, H), 2), ((4, 5, H), 64)],
    ids=["uneven-2d", "fewer-tokens-than-shards", "one-token", "one-token-3d", "zero-tokens", "zero-3d", "bs4"],
)
def test_case2_edge_shapes(shape, num_shards):
    check_parity(Swiglu(), torch.randn(*shape, dtype=F64, requires_grad=True), num_shards)


def test_case2_non_contiguous_x_and_grad():
    mlp = Swiglu()
    x = torch.randn(H, 40, 2, dtype=F64).permute(2, 1, 0).requires_grad_()
    grad_out = torch.randn(H, 40, 2, dtype=F64).permute(2, 1, 0)
    assert not x.is_contiguous() and not grad_out.is_contiguous()
    check_parity(mlp, x, 3, grad_out)


def test_case3_stacked_mlps_nonuniform_grads():
    a, b = Swiglu(), Swiglu()
    params = [*a.parameters(), *b.parameters()]
    x = torch.randn(2, 41, H, dtype=F64, requires_grad=True)
    scale = torch.linspace(0.1, 10.0, 2 * 41, dtype=F64).view(2, 41, 1)
    grad_out = torch.randn(2, 41, H, dtype=F64) * scale
    ref = grads_of(lambda t: b(a(t)), x, params, grad_out)

    def tiled(t):
        mid = tiledmlp.tiled_call(a, t, params=list(a.parameters()), num_shards=4)
        return tiledmlp.tiled_call(b, mid, params=list(b.parameters()), num_shards=3)

    got = grads_of(tiled, x, params, grad_out)
    assert_rel(got[1], ref[1], 1e-12, "x.grad through two tiled MLPs")
    for k, (g, r) in enumerate(zip(got[2], ref[2])):
        assert_rel(g, r, 1e-12, f"param {k}")


def test_case4_two_micro_batches_accumulate():
    mlp = Swiglu()
    params = list(mlp.parameters())
    xs = [torch.randn(2, 30, H, dtype=F64), torch.randn(1, 47, H, dtype=F64)]
    for p in params:
        p.grad = None
    for x in xs:
        mlp(x).square().sum().backward()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    for x in xs:
        tiledmlp.tiled_call(mlp, x, params=params, num_shards=4).square().sum().backward()
    for k, (g, r) in enumerate(zip([p.grad for p in params], ref)):
        assert_rel(g, r, 1e-12, f"accumulated param {k}")


def test_case5_dropout_replays_forward_masks():
    """Reference: the same tiles run with a full graph from the same seed (each tile draws its mask in order)."""
    mlp = Swiglu(dropout=0.5)
    params = list(mlp.parameters())
    x = torch.randn(2, 40, H, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 40, H, dtype=F64)
    splits = tiledmlp.plan_shards(80, num_shards=4)

    def reference(t):
        flat = t.reshape(-1, H)
        return torch.cat([mlp(c.view(1, -1, H)).view(-1, H) for c in flat.split(splits)]).view(t.shape)

    torch.manual_seed(7)
    ref = grads_of(reference, x, params, grad_out)
    torch.manual_seed(7)
    got = grads_of(lambda t: tiledmlp.tiled_call(mlp, t, params=params, num_shards=4), x, params, grad_out)
    assert_rel(got[0], ref[0], 1e-12, "output with dropout")
    assert_rel(got[1], ref[1], 1e-12, "x.grad with dropout")
    for k, (g, r) in enumerate(zip(got[2], ref[2])):
        assert_rel(g, r, 1e-12, f"param {k} with dropout")
    torch.manual_seed(8)  # other masks give clearly other grads: the comparison above is sensitive to the masks
    other = grads_of(reference, x, params, grad_out)
    assert rel_err(other[1], ref[1]) > 0.1


def test_case5_rng_state_after_backward_is_callers():
    mlp = Swiglu(dropout=0.5)
    x = torch.randn(1, 16, H, dtype=F64, requires_grad=True)
    out = tiledmlp.tiled_call(mlp, x, params=list(mlp.parameters()), num_shards=4)
    state = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), state), "the recompute must not advance the caller's RNG"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the CUDA generator")
def test_case5_dropout_cuda_generator():
    mlp = Swiglu(dropout=0.5).cuda()
    x = torch.randn(2, 40, H, dtype=F64, device="cuda", requires_grad=True)
    params = list(mlp.parameters())
    torch.manual_seed(3)
    out = tiledmlp.tiled_call(mlp, x, params=params, num_shards=4)
    grad_x = torch.autograd.grad(out, x, torch.ones_like(out))[0]
    # d out / d x is zero exactly where every unit of a token was dropped: recompute must reuse the masks
    torch.manual_seed(3)
    splits = tiledmlp.plan_shards(80, num_shards=4)
    ref = torch.cat([mlp(c.view(1, -1, H)).view(-1, H) for c in x.reshape(-1, H).split(splits)]).view(x.shape)
    grad_ref = torch.autograd.grad(ref, x, torch.ones_like(ref))[0]
    assert_rel(grad_x, grad_ref, 1e-12, "x.grad with CUDA dropout")


def test_case6_autocast_recompute_dtype():
    """Forward under CPU bf16 autocast: the recompute runs under the same autocast state."""
    mlp = Swiglu(dtype=torch.float32)
    params = list(mlp.parameters())
    seen = []

    def spy(t):
        out = mlp(t)
        seen.append((torch.is_grad_enabled(), out.dtype))
        return out

    x = torch.randn(2, 32, H, requires_grad=True)
    grad_out = torch.randn(2, 32, H, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = mlp(x)
    ref = torch.autograd.grad(ref_out, [x, *params], grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiledmlp.tiled_call(spy, x, params=params, num_shards=4)
    got = torch.autograd.grad(out, [x, *params], grad_out)
    assert out.dtype == torch.bfloat16
    recompute = [dtype for grad_enabled, dtype in seen if grad_enabled]
    assert recompute == [torch.bfloat16] * 4, recompute
    assert_rel(out.float(), ref_out.float(), 1e-2, "autocast output")
    for k, (g, r) in enumerate(zip(got, ref)):
        assert g.dtype == r.dtype
        assert_rel(g, r, 2e-2, f"autocast grad {k}")


class Router(nn.Module):
    """A token-wise fn with two differentiable outputs, like an MoE block returning router logits."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Swiglu()
        self.router = nn.Linear(H, 5, bias=False, dtype=F64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.router(x).reshape(-1, 5)  # [B*S, E] like transformers' router logits
        return self.mlp(x), logits, logits.argmax(-1)


def test_case7_tuple_outputs_all_differentiable_outputs_get_grads():
    model = Router()
    params = list(model.parameters())
    x = torch.randn(2, 33, H, dtype=F64, requires_grad=True)

    def loss_of(outs):
        out, logits, idx = outs
        aux = torch.logsumexp(logits, -1).square().mean()  # a z-loss style aux loss on router logits
        return out.square().sum() + 3.0 * aux, idx

    ref_loss, ref_idx = loss_of(model(x))
    ref = torch.autograd.grad(ref_loss, [x, *params])
    outs = tiledmlp.tiled_call(model, x, params=params, num_shards=4)
    assert isinstance(outs, tuple) and len(outs) == 3
    assert outs[1].shape == (66, 5) and outs[2].dtype == torch.int64 and not outs[2].requires_grad
    loss, idx = loss_of(outs)
    assert torch.equal(idx, ref_idx)
    got = torch.autograd.grad(loss, [x, *params])
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_rel(g, r, 1e-12, f"grad {k}")
    assert got[-1].abs().sum() > 0, "router weight must get its gradient from the aux loss"


def test_case8_frozen_params_and_x_without_grad():
    mlp = Swiglu()
    mlp.gate.weight.requires_grad_(False)
    mlp.down.bias.requires_grad_(False)
    x = torch.randn(2, 30, H, dtype=F64)  # no grad on x
    params = list(mlp.parameters())
    trainable = [p for p in params if p.requires_grad]
    mlp(x).square().sum().backward()
    ref = [p.grad.clone() for p in trainable]
    for p in trainable:
        p.grad = None
    tiledmlp.tiled_call(mlp, x, params=params, num_shards=3).square().sum().backward()
    for k, (p, r) in enumerate(zip(trainable, ref)):
        assert_rel(p.grad, r, 1e-12, f"trainable param {k}")
    assert mlp.gate.weight.grad is None and mlp.down.bias.grad is None


def test_no_grad_runs_tiles_without_a_function():
    mlp = Swiglu()
    x = torch.randn(2, 30, H, dtype=F64, requires_grad=True)
    with torch.no_grad():
        out = tiledmlp.tiled_call(mlp, x, params=list(mlp.parameters()), num_shards=4)
        ref = mlp(x)
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, ref) or (out - ref).abs().max() < 1e-14


def test_undeclared_trainable_tensor_is_refused():
    mlp = Swiglu()
    x = torch.randn(1, 20, H, dtype=F64, requires_grad=True)
    out = tiledmlp.tiled_call(mlp, x, params=list(mlp.gate.parameters()), num_shards=2)
    with pytest.raises(RuntimeError, match="not passed as params"):
        out.sum().backward()
