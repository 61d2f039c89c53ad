"""Edge cases of patched modules: calls the unpatched module accepts must give the same result patched, and what
a patched module reports must be what ran."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as cp
from conftest import assert_rel
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import tiledmlp
from tiledmlp import distributed as tdist
from tiledmlp.norms import TiledNormForward


def _run(norm: torch.nn.Module, x: torch.Tensor, name: str, tiles: int | None) -> tuple[torch.Tensor, ...]:
    norm = copy.deepcopy(norm)
    if tiles is not None:
        norm.forward = TiledNormForward(norm, tiles)
    x = x.clone().requires_grad_()
    y = norm(**{name: x})
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    y.backward(grad)
    if tiles is not None:
        assert norm.forward.last_num_tiles == tiles  # the keyword call is tiled, not passed through
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize(("cls", "name"), [(GemmaRMSNorm, "x"), (LlamaRMSNorm, "hidden_states")])
def test_norm_called_with_its_input_by_keyword_float64(cls: type, name: str) -> None:
    """``norm(x=t)`` works on Gemma's ``forward(self, x)``; patched it raised TypeError (the tiled forward's input
    was named ``hidden_states``). Now it is tiled, with the untiled output and grads."""
    gen = torch.Generator().manual_seed(0)
    norm = cls(16, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=gen)
    ref = _run(norm, x, name, None)
    got = _run(norm, x, name, 3)
    for a, b, what in zip(ref, got, ("output", "input grad", "weight grad")):
        assert_rel(b, a, 1e-6, what)  # Gemma's forward computes in float32: its weight grad's tile sums round there


def test_norm_with_a_wrong_keyword_fails_as_unpatched() -> None:
    norm = GemmaRMSNorm(8)
    norm.forward = TiledNormForward(norm, 2)
    with pytest.raises(TypeError, match="hidden_states"):
        norm(hidden_states=torch.randn(2, 4, 8))


class _ToyMLP(torch.nn.Module):
    """A generic (non-GLU) MLP: under ZeRO-3 every MLP takes this route through ``distributed.run_tiled``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _ToyMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_checkpoint_recompute_keeps_the_agreed_tile_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ZeRO-3 the ranks agree on a tile count that this rank's own plan may not match; ``last_num_tiles``
    (what ``tiledmlp train`` reports) must be the agreed one. A non-reentrant checkpoint's recompute stops inside the
    tiled call once it has what backward needs: before, that left this rank's own plan (2) in ``last_num_tiles``
    after every backward. The agreement is simulated here (one process: a leading 0-token tile, as a rank with fewer
    tokens gets); the grads stay the untiled ones."""
    torch.manual_seed(0)
    block = _Block().double()
    ref_block = copy.deepcopy(block)
    tiledmlp.patch(block, num_shards=2, norms=False)
    monkeypatch.setattr(tdist, "gradient_landing", lambda scope: "zero3")
    monkeypatch.setattr(tdist, "agreed_splits", lambda module, plan, x, splits, group, name: [0, *splits])
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    grads = []
    for b in (ref_block, block):
        xi = x.clone().requires_grad_()
        cp.checkpoint(b, xi, use_reentrant=False).pow(2).sum().backward()
        grads.append([xi.grad, *(p.grad for p in b.parameters())])
    assert block.mlp.forward.last_num_tiles == 3
    for want, got in zip(*grads):
        assert_rel(got, want, 1e-12)


def test_the_per_call_module_walk_is_modules_order_and_finds_what_it_did() -> None:
    """A patched MLP's call walks its submodules once (patching._walk, host time a GPU waits on): the same list as
    ``module.modules()`` (a module registered twice listed once), the first parameter ``parameters()`` yields, and
    the parametrizations ``parametrize.is_parametrized`` finds, over 300 random module trees."""
    import random

    from torch import nn
    from torch.nn.utils import parametrize

    from tiledmlp.parametrized import live_parametrizations
    from tiledmlp.patching import _first_param, _walk

    rng = random.Random(0)

    def tree(depth: int) -> nn.Module:
        m = nn.Module()
        for i in range(rng.randint(0, 3)):
            m.add_module(f"c{i}", tree(depth - 1) if depth and rng.random() < 0.6 else nn.Linear(2, 2))
        return m

    shared = parametrized = 0
    for _ in range(300):
        m = tree(3)
        subs = list(m.modules())
        if len(subs) > 2 and rng.random() < 0.5:
            m.add_module("again", rng.choice(subs[1:]))
            shared += 1
        linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
        if linears and rng.random() < 0.4:
            parametrize.register_parametrization(rng.choice(linears), "weight", nn.Identity())
            parametrized += 1
        walked = _walk(m)
        assert walked == list(m.modules())
        assert _first_param(walked) is next(m.parameters(), None)
        assert [(a, b) for a, b, *_ in live_parametrizations(walked)] == \
            [(x, n) for x in m.modules() if parametrize.is_parametrized(x) for n in x.parametrizations]
    assert shared > 50 and parametrized > 50


def test_torch_func_transforms_run_the_modules_own_forwards_exactly() -> None:
    """``torch.func.grad`` and ``vmap`` (per-sample grads) over a patched model refused the tiled Functions ("must
    override the setup_context staticmethod"); the patched MLPs, norms and loss now run untiled there, equal to the
    unpatched model's float64 grads, and tile again outside."""
    from tiledmlp.train.models import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_llama_config()).double()
    model = copy.deepcopy(ref)
    tiledmlp.patch(model, num_shards=3, norms=2)
    tiledmlp.patch_loss(model, num_shards=2)
    ids = torch.randint(0, 200, (2, 37))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(m, p, x):
        return torch.func.functional_call(m, p, (x,), {"labels": x}).loss

    grads = [torch.func.grad(lambda p: loss(m, p, ids))(params) for m in (model, ref)]
    per_sample = [torch.func.vmap(torch.func.grad(lambda p, x: loss(m, p, x[None])), in_dims=(None, 0))(params, ids)
                  for m in (model, ref)]
    for got, want in (grads, per_sample):
        for name in want:
            assert_rel(got[name], want[name], 1e-12, name)
    model(ids, labels=ids).loss.backward()
    mlp, norm = model.model.layers[0].mlp, model.model.layers[0].input_layernorm
    assert (mlp.forward.last_num_tiles, norm.forward.last_num_tiles, model.forward.last_used_tiled) == (3, 2, True)


def test_torch_func_grad_through_the_public_tiled_calls_is_the_untiled_grad() -> None:
    """``tiled_call`` and ``glu_tiled_call`` under ``torch.func.grad``: the call untiled, float64 grads as plain
    autograd's."""
    import torch.nn.functional as F

    from tiledmlp.glu import GLUWeights

    torch.manual_seed(0)
    w = [torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64),
         torch.randn(8, 16, dtype=torch.float64)]
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def mlp(w, t):
        return F.linear(F.silu(F.linear(t, w[0])) * F.linear(t, w[1]), w[2])

    want = torch.func.grad(lambda w, x: mlp(w, x).sum(), argnums=(0, 1))(w, x)
    glu = torch.func.grad(lambda w, x: tiledmlp.glu_tiled_call(
        GLUWeights(w[0], None, w[1], None, w[2], None, F.silu), x, [3, 3, 4]).sum(), argnums=(0, 1))(w, x)
    generic = torch.func.grad(lambda w, x: tiledmlp.tiled_call(functools.partial(mlp, w), x, params=w,
                                                              num_shards=3).sum(), argnums=(0, 1))(w, x)
    for got in (glu, generic):
        for g, r in zip([*got[0], got[1]], [*want[0], want[1]]):
            assert_rel(g, r, 1e-13, "grad")


def test_the_tiled_loss_called_inside_torch_func_is_refused_in_one_line() -> None:
    h, w = torch.randn(2, 6, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    labels = torch.randint(0, 10, (2, 6))
    message = r"tiled_causal_lm_loss cannot run inside torch.func's transforms \(grad, vmap, jvp\)"
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda w: tiledmlp.tiled_causal_lm_loss(h, w, labels))(w)
    with pytest.raises(RuntimeError, match=message):
        torch.func.vmap(lambda x: tiledmlp.tiled_causal_lm_loss(x[None], w, labels[:1]))(h)
