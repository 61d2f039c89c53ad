"""Case 9: 16-bit params: per-tile weight grads formed and summed in float32, cast once (GLU path and generic engine)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiledmlp
from conftest import rel_err
from test_engine import H, Swiglu
from test_glu import make_spec, untiled
from tiledmlp import precision
from tiledmlp.glu import GLUWeights
from tiledmlp.recompute import GradSum


def _grads(mlp, x, grad_out, tiled, num_shards=8, **kw):
    params = list(mlp.parameters())
    fn = (lambda t: tiledmlp.tiled_call(mlp, t, params=params, num_shards=num_shards, **kw)) if tiled else mlp
    return torch.autograd.grad(fn(x), [x, *params], grad_out)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_case9_low_precision_error_no_worse_than_untiled(dtype, seed, kernels):
    """Gated MLPs (the GLU path every HF gated MLP takes): weight and bias products per tile are formed in float32
    and summed in float32, so the tiled grads carry one rounding, like untiled's; checked over several seeds."""
    torch.manual_seed(seed)
    spec = make_spec(False, True, F.silu, dtype=dtype)
    ref_spec = GLUWeights(*(None if t is None else t.detach().double().requires_grad_() for t in spec.tensors()),
                          act=F.silu)
    x = torch.randn(2, 256, H).to(dtype).requires_grad_()
    grad_out = torch.randn(2, 256, H).to(dtype)
    x64 = x.detach().double().requires_grad_()
    ref = torch.autograd.grad(untiled(ref_spec, x64), [x64, *(t for t in ref_spec.tensors() if t is not None)],
                              grad_out.double())
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    plain = torch.autograd.grad(untiled(spec, x), inputs, grad_out)
    tiled = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [64] * 8), inputs, grad_out)
    for k, (t, u, r) in enumerate(zip(tiled, plain, ref)):
        assert t.dtype == dtype
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"input {k}: tiled {rel_err(t, r):.2e} vs {rel_err(u, r):.2e}"


def test_case9_accumulator_dtype_spy(monkeypatch):
    seen = []
    original = GradSum.__init__

    def spy(self, params, accumulate_dtype):
        original(self, params, accumulate_dtype)
        seen.extend(self.dtypes)

    monkeypatch.setattr(GradSum, "__init__", spy)
    mlp = Swiglu(dtype=torch.bfloat16)
    x = torch.randn(1, 64, H, dtype=torch.bfloat16, requires_grad=True)
    _grads(mlp, x, torch.randn_like(x), tiled=True)
    assert seen and all(d == torch.float32 for d in seen)
    seen.clear()
    _grads(mlp, x, torch.randn_like(x), tiled=True, accumulate_dtype=torch.bfloat16)
    assert seen and all(d == torch.bfloat16 for d in seen)


# ---------------------------------------------------------------------------------------------- generic engine
class _GeluMLP(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 56, dtype=dtype), nn.Linear(56, H, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _MatmulMLP(nn.Module):
    """Weights used with ``@`` (``torch.matmul``), one of them through a transposed view."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Parameter(0.2 * torch.randn(H, 56, dtype=dtype))
        self.w2 = nn.Parameter(0.2 * torch.randn(H, 56, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x @ self.w1) @ self.w2.t()


def _gpt2_mlp(dtype: torch.dtype) -> nn.Module:
    """Hugging Face GPT2MLP: Conv1D layers, i.e. ``torch.addmm`` with ``[in, out]`` weights."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    return GPT2MLP(56, GPT2Config(n_embd=H, resid_pdrop=0.0)).to(dtype)


def _lora_mlp(dtype: torch.dtype) -> nn.Module:
    """PEFT LoRA on both linears: base weights frozen, adapters trained (B initialised non-zero)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_GeluMLP(dtype), LoraConfig(r=4, target_modules=["fc1", "fc2"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.2)
    return model


def _experts(impl: str):
    """Hugging Face Qwen3-MoE experts (3-D weights, one expert a view) with routing as token args."""

    def build(dtype: torch.dtype) -> nn.Module:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2)
        config._experts_implementation = impl
        experts = Qwen3MoeExperts(config)
        for p in experts.parameters():
            nn.init.normal_(p, std=0.2)
        return experts.to(dtype)

    return build


GENERIC = {
    "linear-gelu": _GeluMLP,
    "gpt2-conv1d-addmm": _gpt2_mlp,
    "matmul": _MatmulMLP,
    "lora": _lora_mlp,
    "moe-eager": _experts("eager"),
    "moe-grouped_mm": _experts("grouped_mm"),
    "moe-batched_mm": _experts("batched_mm"),
}


def _generic_case(kind: str, dtype: torch.dtype, autocast: bool, seed: int):
    """(tiled, untiled, float64) grads of x, token args and every trainable param of one generic MLP."""
    torch.manual_seed(seed)
    model = GENERIC[kind](torch.float32)
    ref_model = copy.deepcopy(model).double()
    if hasattr(ref_model, "config"):
        ref_model.config._experts_implementation = "eager"  # grouped_mm/batched_mm have no float64 kernels here
    if not autocast:
        model = model.to(dtype)
    data_dtype = torch.float32 if autocast else dtype
    x = torch.randn(2, 256, H).to(data_dtype)
    token_args = []
    if kind.startswith("moe"):
        x = x.view(512, H)
        index = torch.stack([torch.randperm(4)[:2] for _ in range(512)])
        token_args = [index, torch.rand(512, 2).to(data_dtype)]
    grad_out = torch.randn_like(x)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(m, ps, cast, fn):
        inputs = [cast(x).requires_grad_(), *(cast(a).requires_grad_() if a.is_floating_point() else a
                                             for a in token_args)]
        wrt = [t for t in inputs if t.requires_grad] + ps
        with torch.autocast("cpu", dtype=dtype, enabled=autocast and m is model):
            out = fn(m, inputs, ps)
        return torch.autograd.grad(out, wrt, cast(grad_out).to(out.dtype))

    def plain(m, inputs, ps):
        return m(*inputs)

    def tiled(m, inputs, ps):
        return tiledmlp.tiled_call(m, *inputs, params=ps, num_shards=8)

    ref_params = [p for p in ref_model.parameters() if p.requires_grad]
    ref = grads(ref_model, ref_params, lambda t: t.detach().double(), plain)
    same = lambda t: t.detach().clone()  # noqa: E731
    return grads(model, params, same, tiled), grads(model, params, same, plain), ref


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(GENERIC))
def test_case9_generic_engine_error_no_worse_than_untiled(kind, dtype, seed):
    """16-bit weights on the generic engine (any MLP that is not a plain gated one), 8 tiles: the matmuls that read a
    weight land its per-tile grad in float32 (tiledmlp.precision), so tiled carries one rounding like untiled."""
    tiled, plain, ref = _generic_case(kind, dtype, autocast=False, seed=seed)
    for k, (t, u, r) in enumerate(zip(tiled, plain, ref)):
        assert t.dtype == u.dtype
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"grad {k}: tiled {rel_err(t, r):.2e} vs {rel_err(u, r):.2e}"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", ["linear-gelu", "gpt2-conv1d-addmm", "matmul", "moe-eager"])
def test_case9_generic_engine_autocast_error_no_worse_than_untiled(kind, seed):
    """float32 weights under bf16 autocast: autograd would round each tile's weight grad to bf16 before casting it to
    float32; landing the product in float32 keeps the tiled error at the untiled one."""
    tiled, plain, ref = _generic_case(kind, torch.bfloat16, autocast=True, seed=seed)
    for k, (t, u, r) in enumerate(zip(tiled, plain, ref)):
        assert t.dtype == u.dtype
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"grad {k}: tiled {rel_err(t, r):.2e} vs {rel_err(u, r):.2e}"


def _count_landed(monkeypatch) -> list[int]:
    calls = [0]
    original = precision._WideGradMatmul.apply

    def counting(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(precision._WideGradMatmul, "apply", counting)
    return calls


@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_landed_grads_are_summed_exactly(monkeypatch, x_needs_grad):
    """Small integers make every product and sum exact in bf16, so tiled grads must equal the float64 ones bit for
    bit: a landed grad lost, doubled or put in the wrong place (bias, ``@`` on a transposed view, ``addmm`` on one
    expert of a 3-D weight, a weight also used outside any matmul) shows. With x needing no grad the landing
    matmuls still run their backward (the weights keep them in the graph)."""
    calls = _count_landed(monkeypatch)

    def ints(*shape, dtype=torch.bfloat16):
        return torch.randint(-1, 2, shape).to(dtype)

    w, b, m, experts = ints(8, 6), ints(8), ints(8, 6), ints(3, 6, 8)
    x, grad_out = ints(2, 6, 6), ints(2, 6, 8)

    def fn(x, w, b, m, experts):
        h = F.relu(F.linear(x, w, b)) + x @ m.t()
        h = h + torch.addmm(b, x.reshape(-1, 6), experts[1]).view_as(h)
        return h * w[:, 0]

    def grads(dtype, tiled):
        params = [t.to(dtype).requires_grad_() for t in (w, b, m, experts)]
        xs = x.to(dtype).requires_grad_(x_needs_grad)
        out = (tiledmlp.tiled_call(lambda t: fn(t, *params), xs, params=params, num_shards=4) if tiled
               else fn(xs, *params))
        return torch.autograd.grad(out, ([xs] if x_needs_grad else []) + params, grad_out.to(dtype))

    ref = grads(torch.float64, tiled=False)
    assert [torch.equal(u.double(), r) for u, r in zip(grads(torch.bfloat16, tiled=False), ref)] == [True] * len(ref)
    calls[0] = 0
    tiled = grads(torch.bfloat16, tiled=True)
    assert calls[0] == 4 * 3  # linear, @ and addmm in each of the 4 recomputed tiles
    for k, (t, r) in enumerate(zip(tiled, ref)):
        assert t.dtype == torch.bfloat16 and torch.equal(t.double(), r), f"grad {k}"


def test_full_precision_never_enters_the_landing_path(monkeypatch):
    """float32/float64 runs keep autograd's own products (their exactness tests run through plain autograd)."""
    calls = _count_landed(monkeypatch)
    for dtype in (torch.float32, torch.float64):
        mlp = _GeluMLP(dtype)
        x = torch.randn(2, 40, H, dtype=dtype, requires_grad=True)
        tiledmlp.tiled_call(mlp, x, params=list(mlp.parameters()), num_shards=4).sum().backward()
    assert calls[0] == 0
    mlp = _GeluMLP(torch.bfloat16)
    tiledmlp.tiled_call(mlp, torch.randn(2, 40, H, dtype=torch.bfloat16), params=list(mlp.parameters()),
                        num_shards=4).sum().backward()
    assert calls[0] == 4 * 2


def test_broadcast_weight_views_keep_autograd(monkeypatch):
    """A weight reached through ``expand`` (several grad elements per parameter element) is left to autograd, and
    its grad is still right: small integers, exact in bf16, so tiled equals the float64 reference bit for bit."""
    calls = _count_landed(monkeypatch)
    row, x, grad_out = (torch.randint(-1, 2, shape).double() for shape in [(1, 8), (2, 12, 6), (2, 12, 8)])

    def grads(dtype, tiled):
        r, t = row.to(dtype, copy=True).requires_grad_(), x.to(dtype, copy=True).requires_grad_()
        fn = lambda v: v @ r.expand(6, 8)  # noqa: E731
        out = tiledmlp.tiled_call(fn, t, params=[r], num_shards=3) if tiled else fn(t)
        return torch.autograd.grad(out, [t, r], grad_out.to(dtype))

    ref = grads(torch.float64, tiled=False)
    got = grads(torch.bfloat16, tiled=True)
    assert calls[0] == 0
    assert all(torch.equal(g.double(), r) for g, r in zip(got, ref))


def test_param_sums_are_each_weights_own_dtype() -> None:
    """``accumulate_dtype="param"``: a 16-bit weight's sums in its own dtype (bit for bit the explicit dtype, for
    the tiled MLP and the tiled loss), a float32 weight's in float32 (bit for bit ``"auto"``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tiledmlp.recompute import resolve_accumulate_dtype

    assert resolve_accumulate_dtype("param", torch.bfloat16) is torch.bfloat16
    assert resolve_accumulate_dtype("param", torch.float32) is torch.float32
    for dtype, same_as in ((torch.bfloat16, torch.bfloat16), (torch.float32, "auto")):
        torch.manual_seed(0)
        mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).to(dtype)
        x = torch.randn(2, 24, 32, dtype=dtype)
        w = (torch.randn(50, 32) * 0.2).to(dtype)
        y = torch.randint(0, 50, (2, 24))
        grads = {}
        for acc in ("param", same_as, "auto"):
            tiled = tiledmlp.TiledMLP(copy.deepcopy(mlp), num_shards=3, accumulate_dtype=acc)
            head, h = w.clone().requires_grad_(), x.clone().requires_grad_()
            loss = tiledmlp.tiled_causal_lm_loss(tiled(h), head, y, num_shards=4, accumulate_dtype=acc)
            loss.backward()
            grads[acc] = [loss.detach(), h.grad, head.grad] + [p.grad for p in tiled.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads["param"], grads[same_as])), dtype
        assert all(g.dtype == dtype for g in grads["param"][1:])
        if dtype == torch.bfloat16:  # and not the float32 sums: some weight grad rounds differently
            assert not all(torch.equal(a, b) for a, b in zip(grads["param"][2:], grads["auto"][2:]))
