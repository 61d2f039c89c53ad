"""plan_shards and the refusals of bad input."""

from __future__ import annotations

import math

import pytest
import torch

import tiledmlp
from tiledmlp.memory import tile_activation_bytes


@pytest.mark.parametrize("tokens", [0, 1, 2, 5, 37, 100, 4097])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 64])
def test_splits_are_balanced_and_bounded(tokens, shards):
    splits = tiledmlp.plan_shards(tokens, num_shards=shards)
    assert sum(splits) == tokens
    assert len(splits) == min(shards, tokens)
    if splits:
        assert min(splits) >= 1 and max(splits) - min(splits) <= 1


def test_fewer_chunks_than_requested_is_explicit():
    # torch.chunk(5 rows, 4) returns 3 chunks; plan_shards returns 4 tiles and says so by its length
    assert tiledmlp.plan_shards(5, num_shards=4) == [2, 1, 1, 1]


def test_auto_is_the_alst_rule():
    assert tiledmlp.plan_shards(16384, hidden_size=1024) == tiledmlp.plan_shards(16384, num_shards=16)
    assert len(tiledmlp.plan_shards(5000, hidden_size=1024)) == math.ceil(5000 / 1024)
    assert tiledmlp.plan_shards(100, hidden_size=1024) == [100]


def test_target_gb_fewest_tiles_that_fit():
    h, i = 1024, 2816
    per_token = tile_activation_bytes(1, h, i, dtype=torch.float32)
    target = 1000 * per_token / 2**30  # exactly 1000 tokens per tile
    splits = tiledmlp.plan_shards(16000, target_gb=target, hidden_size=h, intermediate_size=i)
    assert len(splits) == 16 and max(splits) <= 1000
    assert tile_activation_bytes(max(splits), h, i, dtype=torch.float32) <= target * 2**30
    fewer = tiledmlp.plan_shards(16000, num_shards=15)
    assert tile_activation_bytes(max(fewer), h, i, dtype=torch.float32) > target * 2**30


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("four", ValueError),
                                     (True, TypeError), (None, TypeError)])
def test_bad_num_shards(bad, exc):
    with pytest.raises(exc, match="num_shards"):
        tiledmlp.plan_shards(10, num_shards=bad)
    with pytest.raises(exc, match="num_shards"):
        tiledmlp.tiled_call(lambda t: t, torch.randn(4, 3), num_shards=bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_bad_target_gb(bad):
    with pytest.raises(ValueError, match="target_gb"):
        tiledmlp.plan_shards(10, target_gb=bad, hidden_size=4, intermediate_size=8)
    with pytest.raises(ValueError, match="target_gb"):
        tiledmlp.patch(torch.nn.ModuleDict({"mlp": torch.nn.Linear(2, 2)}), target_gb=bad)


def test_huge_target_gb_is_one_tile():
    assert tiledmlp.plan_shards(10, target_gb=1e300, hidden_size=4, intermediate_size=8) == [10]


@pytest.mark.parametrize("kw,exc,match", [
    (dict(hidden_size="8"), ValueError, "hidden_size must be an int"), (dict(hidden_size=True), ValueError, "hidden"),
    (dict(hidden_size=-1), ValueError, "hidden_size"), (dict(intermediate_size=-5), ValueError, "intermediate_size"),
    (dict(intermediate_size="x"), ValueError, "intermediate_size"), (dict(dtype="bf16"), TypeError, "dtype must be"),
    (dict(dtype=torch.int64), TypeError, "floating torch.dtype"),
    (dict(weight_dtype="fp32"), TypeError, "weight_dtype must be")])
def test_bad_shapes_and_dtype_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        tiledmlp.plan_shards(10, **{"hidden_size": 4, **kw})


def test_tiled_call_arguments_are_checked():
    x = torch.randn(16, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="splits must be a list of ints"):
        tiledmlp.tiled_call(lambda t: t, x, splits=[8.0, 8.0])
    with pytest.raises(ValueError, match="splits must be a list of ints"):
        tiledmlp.tiled_call(lambda t: t, x, splits=[8, 7])
    with pytest.raises(ValueError, match="num_shards"):  # checked even when splits decide the tiles
        tiledmlp.tiled_call(lambda t: t, x, splits=[8, 8], num_shards=0)
    with pytest.raises(TypeError, match="params must be an iterable of tensors"):
        tiledmlp.tiled_call(lambda t: t, x, params=torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"params\[1\]"):
        tiledmlp.tiled_call(lambda t: t, x, params=[x, "w"])


def test_a_parameter_listed_twice_gets_its_grad_once():
    """A tied weight reached through two modules' parameters() is one tensor: one gradient, not two."""
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(16, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad((x @ w).square().sum(), w)[0]
    out = tiledmlp.tiled_call(lambda t: t @ w, x, params=[w, w], num_shards=4)
    torch.testing.assert_close(torch.autograd.grad(out.square().sum(), w)[0], ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad,exc", [(dict(num_token_args=-1), ValueError), (dict(num_token_args="0"), ValueError),
                                     (dict(glu="a"), TypeError), (dict(spec=dict), TypeError),
                                     (dict(spec=tiledmlp.MLPSpec(), num_token_args=1), ValueError)])
def test_register_mlp_checks_its_arguments(bad, exc):
    with pytest.raises(exc):
        tiledmlp.register_mlp("NeverUsedMLP", **bad)
    with pytest.raises(TypeError, match="gate"):
        tiledmlp.glu_from_attrs(None, "up", "down", "act")


def test_unpatch_needs_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        tiledmlp.unpatch("x")


def test_target_gb_needs_shapes():
    with pytest.raises(ValueError, match="intermediate_size"):
        tiledmlp.plan_shards(10, target_gb=1.0, hidden_size=4)


def test_x_needs_two_dims():
    with pytest.raises(ValueError, match="at least 2 dims"):
        tiledmlp.tiled_call(lambda t: t, torch.randn(8), num_shards=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        tiledmlp.tiled_call(lambda t: t, [1.0, 2.0], num_shards=2)


def test_bad_accumulate_dtype():
    with pytest.raises(TypeError, match="accumulate_dtype"):
        tiledmlp.tiled_call(lambda t: t, torch.randn(4, 3), accumulate_dtype=torch.int32)
    with pytest.raises(ValueError, match="accumulate_dtype"):
        tiledmlp.tiled_call(lambda t: t, torch.randn(4, 3), accumulate_dtype="fp32")


def test_non_tensor_output_is_refused():
    with pytest.raises(TypeError, match="tensor"):
        tiledmlp.tiled_call(lambda t: {"out": t}, torch.randn(8, 3), num_shards=2)
    with pytest.raises(TypeError, match="output 1"):
        tiledmlp.tiled_call(lambda t: (t, 3), torch.randn(8, 3), num_shards=2)


def test_shape_changing_output_is_refused():
    with pytest.raises(ValueError, match="token-wise"):
        tiledmlp.tiled_call(lambda t: t.sum(0, keepdim=True), torch.randn(8, 3), num_shards=2)
    with pytest.raises(ValueError, match="token-wise"):
        tiledmlp.tiled_call(lambda t: t[..., :1, :], torch.randn(1, 8, 3), num_shards=2)


def test_double_backward_is_refused():
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    out = tiledmlp.tiled_call(lambda t: torch.tanh(t @ w), x, params=[w], num_shards=2)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_a_weight_computed_outside_fn_can_be_a_param():
    """``w = W * mask`` passed in params gets its grad, which flows on to W; naming W instead is a clear error."""
    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(8, 8) > 0.3).double()

    def grad_of_W(params) -> torch.Tensor:
        w = W * mask
        fn = lambda t: torch.tanh(t @ w.t())  # noqa: E731
        out = fn(x) if params is None else tiledmlp.tiled_call(fn, x, params=params(w), num_shards=3)
        return torch.autograd.grad(out.square().sum(), W)[0]

    torch.testing.assert_close(grad_of_W(lambda w: [w]), grad_of_W(None), rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match="computed outside it .* Pass the computed tensor itself"):
        grad_of_W(lambda w: [W])


@pytest.mark.parametrize("computed", ["W.t()", "W + 1", "W[:, :4]", "W * mask", "(W + 1) * 2 from W + 1"])
def test_a_param_computed_from_another_listed_one_is_refused(computed: str) -> None:
    """``fn`` reads W and ``V = f(W)``, both listed: each tile's grad of W already holds the path through V, and V's
    grad flowed on to W again: W's grad was 0.65-1.00 off, silently (until 2026-11-27; with ``W * mask`` the
    "second time" error asked for what was given). Now refused before any tile runs, and the fix it names, V
    computed inside fn, is exact."""
    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) > 0.3).double()
    make = {"W.t()": lambda: W.t(), "W + 1": lambda: W + 1, "W[:, :4]": lambda: W[:, :4],
            "W * mask": lambda: W * mask, "(W + 1) * 2 from W + 1": None}[computed]
    if make is None:  # two computed tensors, one from the other: U = W + 1, V = 2 U
        U = W + 1
        V = U * 2
        listed, fn = [V, U], lambda t: torch.tanh(t @ U) * (t @ V).sum(-1, keepdim=True)
    else:
        V = make()
        listed, fn = [V, W], lambda t: torch.tanh(t @ W) * (t @ V).sum(-1, keepdim=True)
    with pytest.raises(ValueError, match="params lists a tensor .* computed from another it lists .* compute the "
                                         "first inside fn from the second"):
        tiledmlp.tiled_call(fn, x, params=listed, num_shards=3)
    if make is None:
        return
    inside = lambda t: torch.tanh(t @ W) * (t @ make()).sum(-1, keepdim=True)  # noqa: E731
    ref = torch.autograd.grad(inside(x).square().sum(), [x, W])
    got = torch.autograd.grad(tiledmlp.tiled_call(inside, x, params=[W], num_shards=3).square().sum(), [x, W])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=0)


def test_a_token_input_only_unused_outputs_read_gets_no_grad() -> None:
    """``fn(a, b) = (tanh(a W), 3 b)`` with the second output unused: b's producer gets no grad, as untiled (zeros
    before 2026-11-27, which an optimizer's weight decay and momentum would then step)."""
    up = torch.nn.Linear(8, 8).double()
    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: (torch.tanh(a @ W), b * 3)  # noqa: E731
    grads = {}
    for mode in ("untiled", "tiled"):
        up.zero_grad(set_to_none=True)
        W.grad = x.grad = None
        r = up(torch.randn(2, 6, 8, dtype=torch.float64))
        out = fn(x, r) if mode == "untiled" else tiledmlp.tiled_call(fn, x, r, params=[W], num_shards=3)
        out[0].square().sum().backward()
        grads[mode] = (up.weight.grad, W.grad.clone(), x.grad.clone())
    assert grads["untiled"][0] is None and grads["tiled"][0] is None
    for g, r in zip(grads["tiled"][1:], grads["untiled"][1:]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=0)
