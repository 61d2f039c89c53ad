"""Edges of the core a second review found: an ``accumulate_dtype`` narrower than the weights (silently coarser
weight-grad sums than untiled), a fused ``gate_up`` weight of the wrong height (torch's size error from inside a
tile), and compiled GLU kernels past Dynamo's recompile limit (silently eager)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, Phi3Config
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

import tiledmlp
from conftest import assert_rel, rel_err
from tiledmlp import pointwise
from tiledmlp.glu import GLUWeights
from tiledmlp.norms import patched_forward
from tiledmlp.patching import TiledForward

F64 = torch.float64
H, I = 16, 24


def _llama(dtype: torch.dtype) -> LlamaMLP:
    return LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=2)).to(dtype)


class _GeluMLP(nn.Module):
    """An MLP the generic path tiles (not a GLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _grads(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(module(x), [x, *module.parameters()], grad_out))


# ------------------------------------------------------------------------------------------- 1. accumulate_dtype
NARROWER = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (F64, torch.float32),
            (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("weights,acc", NARROWER, ids=lambda d: str(d).split(".")[-1])
def test_a_narrower_accumulate_dtype_is_refused_at_patch_time(weights: torch.dtype, acc: torch.dtype) -> None:
    """float16 sums for float32 weights had been accepted: the weight grads were summed over tiles in float16."""
    for make in (_llama, lambda d: _GeluMLP().to(d)):
        mlp = make(weights)
        with pytest.raises(ValueError, match=rf"accumulate_dtype={acc} is narrower than {weights}.*'auto'.*at least "
                                             rf"as wide as {weights}"):
            tiledmlp.patch(mlp, num_shards=2, accumulate_dtype=acc)
        assert patched_forward(mlp, TiledForward) is None, "refused before the module was touched"
        with pytest.raises(ValueError, match=f"accumulate_dtype={acc} is narrower"):
            tiledmlp.TiledMLP(mlp, num_shards=2, accumulate_dtype=acc)


def test_a_narrower_accumulate_dtype_is_refused_in_the_forward_of_every_entry_point() -> None:
    """Weights cast after patching, and the functional entry points, are checked when called (the weights' dtype
    is known only then), before any tile runs."""
    mlp = _llama(torch.bfloat16)
    tiledmlp.patch(mlp, num_shards=2, accumulate_dtype=torch.bfloat16)  # as wide as the weights: accepted
    mlp.float()
    x = torch.randn(1, 8, H, requires_grad=True)
    with pytest.raises(ValueError, match="accumulate_dtype=torch.bfloat16 is narrower than torch.float32"):
        mlp(x)
    generic = _GeluMLP().to(torch.bfloat16)
    tiledmlp.patch(generic, num_shards=2, accumulate_dtype=torch.bfloat16)
    generic.float()
    with pytest.raises(ValueError, match=r"narrower than torch.float32, the dtype of the weights of _GeluMLP"):
        generic(x)

    gate_w, up_w, down_w = (torch.randn(*s, requires_grad=True) for s in ((I, H), (I, H), (H, I)))
    spec = GLUWeights(gate_w, None, up_w, None, down_w, None, F.silu)
    with pytest.raises(ValueError, match="accumulate_dtype=torch.float16 is narrower than torch.float32"):
        tiledmlp.glu_tiled_call(spec, x, [4, 4], accumulate_dtype=torch.float16)
    w = torch.randn(32, H, requires_grad=True)
    with pytest.raises(ValueError, match="narrower than torch.float32, the dtype of lm_head"):
        tiledmlp.tiled_causal_lm_loss(x, w, torch.randint(0, 32, (1, 8)), num_shards=2,
                                      accumulate_dtype=torch.bfloat16)
    lin = nn.Linear(H, H)
    with pytest.raises(ValueError, match="accumulate_dtype=torch.float16 is narrower than torch.float32"):
        tiledmlp.tiled_call(lin, x, params=lin.parameters(), num_shards=2, accumulate_dtype=torch.float16)


@pytest.mark.parametrize("acc", ["auto", "param", F64])
def test_accepted_accumulate_dtypes_stay_exact_float64(acc: object) -> None:
    for make in (_llama, lambda d: _GeluMLP().to(d)):
        mlp = make(F64)
        x = torch.randn(2, 15, H, dtype=F64, requires_grad=True)
        g = torch.randn_like(x)
        expected = _grads(mlp, x, g)
        tiledmlp.patch(mlp, num_shards=3, accumulate_dtype=acc)
        for got, want in zip(_grads(mlp, x, g), expected):
            assert_rel(got, want, 1e-12, f"accumulate_dtype={acc}")


WIDE_ENOUGH = [(torch.float32, "auto"), (torch.float32, "param"), (torch.float32, torch.float32),
               (torch.float32, F64), (torch.bfloat16, "auto"), (torch.bfloat16, torch.float32),
               (torch.bfloat16, F64)]


@pytest.mark.parametrize("weights,acc", WIDE_ENOUGH, ids=str)
def test_accepted_accumulate_dtypes_are_as_close_to_float64_as_untiled(weights: torch.dtype, acc: object) -> None:
    mlp64 = _llama(F64)
    mlp = copy.deepcopy(mlp64).to(weights)
    x64 = torch.randn(2, 32, H, dtype=F64, requires_grad=True)
    g64 = torch.randn_like(x64)
    x = x64.detach().to(weights).requires_grad_()
    reference = _grads(mlp64, x64, g64)
    plain = _grads(mlp, x, g64.to(weights))
    tiledmlp.patch(mlp, num_shards=4, accumulate_dtype=acc)
    for k, (t, u, r) in enumerate(zip(_grads(mlp, x, g64.to(weights)), plain, reference)):
        assert t.dtype == weights and rel_err(t, r) <= 1.5 * rel_err(u, r), (k, rel_err(t, r), rel_err(u, r))


def test_16bit_sums_for_16bit_weights_stay_accepted() -> None:
    """bf16 sums for bf16 weights (as wide as the weights, Liger's choice): accepted, bit for bit ``"param"``."""
    mlp = _llama(torch.bfloat16)
    x = torch.randn(2, 32, H, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    results = []
    for acc in (torch.bfloat16, "param"):
        tiledmlp.patch(mlp, num_shards=4, accumulate_dtype=acc)
        results.append(_grads(mlp, x, g))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_autocast_float32_weights_float32_sums_are_unaffected() -> None:
    """float32 weights, bf16 compute under autocast, float32 sums: accepted, error no worse than untiled."""
    mlp64 = _llama(F64)
    mlp = copy.deepcopy(mlp64).float()
    x64 = torch.randn(2, 32, H, dtype=F64, requires_grad=True)
    g64 = torch.randn_like(x64)
    reference = _grads(mlp64, x64, g64)
    x = x64.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _grads(mlp, x, g64.to(torch.bfloat16))
        tiledmlp.patch(mlp, num_shards=4, accumulate_dtype=torch.float32)
        tiled = _grads(mlp, x, g64.to(torch.bfloat16))
    for k, (t, u, r) in enumerate(zip(tiled, plain, reference)):
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), (k, rel_err(t, r), rel_err(u, r))


# ---------------------------------------------------------------------------------------------- 2. fused gate_up
def _phi3(rows: int) -> Phi3MLP:
    mlp = Phi3MLP(Phi3Config(hidden_size=H, intermediate_size=I, num_attention_heads=2))
    mlp.gate_up_proj = nn.Linear(H, rows, bias=False)
    return mlp.to(F64)


@pytest.mark.parametrize("rows", [2 * I + 1, 2 * I - 1, 2 * I + 2])
def test_a_fused_gate_up_of_the_wrong_height_is_refused_by_name(rows: int) -> None:
    """An odd ``gate_up`` had been patched and then failed inside the first tile with torch's own size error."""
    mlp = _phi3(rows)
    message = rf"Phi3MLP.gate_up_proj: a fused gate_up weight must have 2 \* intermediate_size rows .* got {rows} rows"
    with pytest.raises(ValueError, match=message):
        tiledmlp.patch(mlp, num_shards=2)
    assert patched_forward(mlp, TiledForward) is None, "refused before the module was touched"
    with pytest.raises(ValueError, match=message):
        tiledmlp.TiledMLP(mlp, num_shards=2)
    w = mlp.gate_up_proj.weight
    with pytest.raises(ValueError, match=r"GLUWeights.gate_weight: a fused gate_up weight must have 2 \*"):
        GLUWeights(w, None, None, None, mlp.down_proj.weight, None, F.silu)


def test_a_fused_gate_up_of_the_right_height_still_tiles_exactly() -> None:
    mlp = _phi3(2 * I)
    x = torch.randn(2, 9, H, dtype=F64, requires_grad=True)
    g = torch.randn_like(x)
    expected = _grads(mlp, x, g)
    assert tiledmlp.patch(mlp, num_shards=3).patched[0][2] == "glu"
    for got, want in zip(_grads(mlp, x, g), expected):
        assert_rel(got, want, 1e-12)


# ------------------------------------------------------------------------------------ 3. compiled kernels' budget
TOKEN_COUNTS = [1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 20, 23, 29, 31, 32, 40, 47, 53, 64, 65]  # 20 distinct


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch):
    """Fresh kernels compiled as pointwise compiles them (Inductor builds every graph), with each kernel's graphs
    counted; a kernel past Dynamo's recompile limit raises instead of running eagerly."""
    from torch._inductor.compile_fx import compile_fx

    counts: list[int] = []
    real = torch.compile

    def counting_compile(fn, **kw):
        k = len(counts)
        counts.append(0)

        def backend(gm, example_inputs):
            counts[k] += 1
            return compile_fx(gm, example_inputs)

        return real(fn, backend=backend, **kw)

    monkeypatch.setattr(pointwise.torch, "compile", counting_compile)
    pointwise._compiled.cache_clear()
    pointwise.set_fused(True)
    try:
        with dynamo_config.patch(fail_on_recompile_limit_hit=True):
            yield counts
    finally:
        pointwise.set_fused("auto")
        pointwise._compiled.cache_clear()


@pytest.mark.slow  # compile-heavy: 80-96 s each on the H100 (Triton kernels for many variants)
def test_glu_kernels_over_many_token_counts_stay_within_the_recompile_limit(graphs: list[int]) -> None:
    """20 token counts, two dtypes, separate and fused (strided) gate/up, with and without grad mode: each kernel
    variant holds at most two graphs (one for 1-token tiles), and every result equals float64 autograd. One shared
    kernel had reached its 8 graphs with one dtype and then ran eagerly."""
    fn = ACT2FN["silu"]
    key = pointwise.fusable_activation(fn)
    for dtype in (torch.float32, F64):
        tol = 1e-14 if dtype == F64 else 1e-6
        for joined in (False, True):
            for t in TOKEN_COUNTS:
                gate64, up64, dh64 = (torch.randn(t, I, dtype=F64) for _ in range(3))
                g, u = gate64.clone().requires_grad_(), up64.clone().requires_grad_()
                product = fn(g) * u
                product.backward(dh64)
                if joined:  # the two halves of one [t, 2I] projection, as a fused gate_up gives them
                    gate, up = torch.cat([gate64, up64], dim=1).to(dtype).chunk(2, dim=1)
                else:
                    gate, up = gate64.to(dtype), up64.to(dtype)
                for grad_mode in (False, True):  # eval without no_grad runs the product with grad mode on
                    with torch.set_grad_enabled(grad_mode):
                        h = pointwise.glu_product(key, fn, gate, up, fused=True)
                    assert_rel(h.double(), product.detach(), tol, f"product t={t}")
                dh = dh64.to(dtype)
                pointwise.glu_backward_(key, dh, gate, up)
                assert_rel(gate.double(), g.grad, tol, f"d gate t={t}")
                assert_rel(up.double(), u.grad, tol, f"d up t={t}")
                assert_rel(dh.double(), product.detach(), tol, f"product in dh t={t}")
    assert graphs and max(graphs) <= 2, graphs


@pytest.mark.slow  # compile-heavy: 80-96 s each on the H100 (Triton kernels for many variants)
def test_tiled_glu_over_many_token_counts_is_compiled_and_exact_float64(graphs: list[int]) -> None:
    """The same through glu_tiled_call (forward, backward, the per-token stacks and the no-grad tiles), fused and
    separate projections: no kernel past two graphs, grads equal untiled float64's."""
    for fused in (False, True):
        rows = 2 * I if fused else I
        params = [(torch.randn(*s, dtype=F64) * 0.3).requires_grad_()
                  for s in ((rows, H), (I, H), (H, I))]
        spec = GLUWeights(params[0], None, None if fused else params[1], None, params[2], None, ACT2FN["silu"])
        weights = [params[0], params[2]] if fused else params
        for t in TOKEN_COUNTS[1:]:
            x = torch.randn(t, H, dtype=F64, requires_grad=True)
            dy = torch.randn(t, H, dtype=F64)
            gate, up = spec.gate_up(x)
            untiled = F.linear(F.silu(gate) * up, spec.down_weight)
            expected = torch.autograd.grad(untiled, [x, *weights], dy)
            splits = {1: [1, t - 1], 3: [t - 1, 1]}.get(t % 4, [t - t // 2, t // 2])  # 1-token tiles too
            got = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, splits), [x, *weights], dy)
            for k, (a, b) in enumerate(zip(got, expected)):
                assert_rel(a, b, 1e-12, f"fused={fused} t={t} input {k}")
            with torch.no_grad():
                assert_rel(tiledmlp.glu_tiled_call(spec, x, splits), untiled.detach(), 1e-12, f"no grad t={t}")
            frozen = GLUWeights(*(None if p is None else p.detach() for p in spec.tensors()), spec.act)
            assert_rel(tiledmlp.glu_tiled_call(frozen, x.detach(), splits), untiled.detach(), 1e-12, f"eval t={t}")
    assert graphs and max(graphs) <= 2, graphs


def test_loss_kernels_over_many_variants_stay_within_the_recompile_limit(graphs: list[int]) -> None:
    """The compiled loss tile over 8 variants (2 vocabularies, soft-cap and smoothing or not, gradient or eval;
    each for a tile at offset 0 and one past it): each variant a kernel of its own with one graph, every loss and gradient equal to float64 autograd's.
    One kernel for all held a graph per variant, so a process with a second model or an eval loop reached its 8
    graphs and then ran the tile's eager body (several float32 copies of the tile's logits) from then on."""
    from tiledmlp import tiled_causal_lm_loss

    h64 = torch.randn(37, H, dtype=F64)
    for vocab in (29, 40):
        w64 = torch.randn(vocab, H, dtype=F64)
        y = torch.randint(0, vocab, (37,))
        for softcap, smoothing in ((None, 0.0), (5.0, 0.1)):
            h, w = h64.clone().requires_grad_(), w64.clone().requires_grad_()
            z = F.linear(h, w)
            z = z if softcap is None else softcap * torch.tanh(z / softcap)
            ref = F.cross_entropy(z, y, label_smoothing=smoothing)
            grads = torch.autograd.grad(ref, (h, w))
            hf, wf = h64.float().requires_grad_(), w64.float().requires_grad_()
            kw = dict(num_shards=3, shift=False, logit_softcap=softcap, label_smoothing=smoothing)
            loss = tiled_causal_lm_loss(hf, wf, y, **kw)
            for got, want in zip(torch.autograd.grad(loss, (hf, wf)), grads):
                assert_rel(got.double(), want, 1e-5, f"vocab {vocab} softcap {softcap}")
            with torch.no_grad():  # eval: the tile without its gradient
                assert_rel(tiled_causal_lm_loss(hf, wf, y, **kw).double(), ref.detach(), 1e-5, f"eval {vocab}")
            assert_rel(loss.double(), ref.detach(), 1e-5, f"loss vocab {vocab}")
    if not pointwise.cross_entropy_kernel():  # the eager tiles ran instead (exact, as checked above)
        pytest.skip("this torch cannot build the loss kernel here (torch 2.11's CPU Inductor): no kernels to count")
    assert len(graphs) >= 16 and max(graphs) <= 1, graphs
