"""Edges of the core a review found silently wrong (float64 against untiled): an activation with parameters of its
own, random or in place on the GLU path; float64 under autocast on the compiled per-token stacks; an output the
loss does not use; and the GLU entry point's own arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import tiledmlp
from conftest import assert_rel
from tiledmlp import glu
from tiledmlp.glu import GLUWeights

F64 = torch.float64


def _grads(forward, params: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor | None]:
    out = forward(x)
    return list(torch.autograd.grad(out, [x, *params], torch.randn_like(out, generator=_gen()), allow_unused=True))


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


@pytest.mark.parametrize("act", ["xielu", "prelu", "silu_inplace", "rrelu"])
def test_an_activation_the_glu_path_cannot_recompute_takes_the_generic_path(act: str, kernels: str) -> None:
    """transformers' xIELU (trainable alpha_p, alpha_n) had lost its parameters' grads (None where untiled gives
    14.7); a random activation's grads were 7e-2 off the slopes drawn, an in-place one failed in the backward."""
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=2, hidden_act="xielu" if act == "xielu" else "silu"))
    if act != "xielu":
        mlp.act_fn = {"prelu": nn.PReLU(), "silu_inplace": nn.SiLU(inplace=True), "rrelu": nn.RReLU()}[act]
    mlp = mlp.to(F64)
    reference = [p for p in mlp.parameters()]
    x = torch.randn(2, 30, 16, dtype=F64, requires_grad=True)
    torch.manual_seed(5)
    expected = _grads(mlp, reference, x) if act != "rrelu" else None
    report = tiledmlp.patch(mlp, num_shards=3)
    assert report.patched[0][2] == "generic"
    torch.manual_seed(5)
    got = _grads(mlp, reference, x)
    if act == "rrelu":  # the tiles draw their own slopes: exactness is checked by the generic engine's own tests
        assert all(g is not None for g in got)
        return
    for g, e in zip(got, expected):
        assert_rel(g, e, 1e-12)
    with pytest.raises(ValueError, match="cannot recompute exactly; use tiledmlp.tiled_call"):
        spec = GLUWeights(mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None, mlp.act_fn)
        tiledmlp.glu_tiled_call(spec, x, [10, 10, 40])


@pytest.mark.slow  # compile-heavy: 80-96 s each on the H100 (Triton kernels for many variants)
def test_float64_under_autocast_on_the_compiled_stacks(kernels: str) -> None:
    """Autocast leaves float64 alone; the compiled path's per-token stacks had been bf16 (grads 4e-3 off)."""
    seen: list[bool] = []
    make = glu._Stacks.make

    def spy(*args):
        stacks = make(*args)
        seen.append(stacks is not None)
        return stacks

    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, dtype=F64) * 0.3).requires_grad_()

    spec = GLUWeights(p(48, 32), None, p(48, 32), None, p(32, 48), None, F.silu)
    x = torch.randn(12, 32, dtype=F64, requires_grad=True)
    params = [spec.gate_weight, spec.up_weight, spec.down_weight]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _grads(lambda t: F.linear(F.silu(F.linear(t, params[0])) * F.linear(t, params[1]), params[2]),
                          params, x)
        glu._Stacks.make = staticmethod(spy)
        try:
            got = _grads(lambda t: tiledmlp.glu_tiled_call(spec, t, [6, 6]), params, x)
        finally:
            glu._Stacks.make = staticmethod(make)
    assert seen == ([True] if kernels == "compiled" else [])  # the compiled path ran on the stacks
    for g, e in zip(got, expected):
        assert_rel(g, e, 1e-12)


def test_an_output_the_loss_does_not_use_gives_its_params_no_grad() -> None:
    """Untiled, ``V`` feeding only an unused output gets None; tiled it had got zeros (stepped by weight decay)."""
    U, V = (torch.randn(4, 4, dtype=F64, requires_grad=True) for _ in range(2))
    x = torch.randn(12, 4, dtype=F64, requires_grad=True)

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t @ U, t @ V

    y, _ = tiledmlp.tiled_call(fn, x, params=[U, V], num_shards=3)
    y.sum().backward()
    assert V.grad is None and U.grad is not None
    assert_rel(U.grad, x.detach().t() @ torch.ones(12, 4, dtype=F64), 1e-12)


@pytest.mark.parametrize("splits, x_shape, match", [
    ([5, 5], (20, 8), "summing to the 20 tokens"), ([25, -5], (20, 8), "ints >= 0"), (4, (20, 8), "a list of ints"),
    ([8], (8,), r"\[\.\.\., hidden\] tokens")])
def test_glu_tiled_call_checks_its_arguments(splits, x_shape: tuple[int, ...], match: str) -> None:
    """Splits short of the tokens had returned uninitialised rows (|diff| 5e294), without an error."""
    w = torch.randn(12, 8, dtype=F64)
    spec = GLUWeights(w, None, w.clone(), None, torch.randn(8, 12, dtype=F64), None, F.silu)
    with pytest.raises(ValueError, match=match):
        tiledmlp.glu_tiled_call(spec, torch.randn(*x_shape, dtype=F64), splits)


def test_a_trainable_tensor_not_listed_is_refused_when_nothing_listed_needs_grad() -> None:
    """With ``x`` not requiring grad (frozen embeddings) an unlisted trainable weight had kept every tile's graph:
    right grads, no memory saved, no error. Now it is refused as when ``x`` requires grad; listed, it is exact."""
    W = torch.randn(4, 4, dtype=F64, requires_grad=True)
    x = torch.randn(12, 4, dtype=F64)
    with pytest.raises(RuntimeError, match="not passed as params"):
        tiledmlp.tiled_call(lambda t: t @ W, x, num_shards=3)
    y = tiledmlp.tiled_call(lambda t: t @ W, x, params=[W], num_shards=3)
    (grad,) = torch.autograd.grad(y.sum(), [W])
    assert_rel(grad, x.t() @ torch.ones(12, 4, dtype=F64), 1e-12)
    with torch.no_grad():  # no graph wanted: nothing to check
        assert torch.equal(tiledmlp.tiled_call(lambda t: t @ W, x, num_shards=3), x @ W)
