"""Row-tiled RMSNorms (tiledmlp.norms): grads against the untiled norm, float32 weight grads, the tile policy,
what is and is not tiled, refusals, and the memory they save."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from models import build, loss_and_grads
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.norms import NORM_TILE_BYTES, TiledNormForward, plan_norm_tiles

TILES = 4


def _tiled_norms(model: nn.Module) -> list[TiledNormForward]:
    return [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledNormForward)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # w * x, per-head q/k norms too, (1 + w) * x
@pytest.mark.parametrize("batch,seq", [(1, 37), (2, 29)])
def test_float64_grads_match_untiled(arch: str, batch: int, seq: int) -> None:
    """Stacked layers, uneven tiles, bs 1 and 2: loss and every grad equal the untiled model's to float64
    rounding; every patched norm ran in 4 tiles. Gemma-3's norm computes in float32 whatever the dtype
    (``x.float()``), so its weights' grads are float32 sums either way: compared to float32 rounding."""
    reference, model = build(arch), build(arch)
    report = tiledmlp.patch(model, num_shards=1, norms=TILES)
    layers = model.config.num_hidden_layers
    assert report.norms_patched >= 2 * layers + 1 and f"{report.norms_patched} RMSNorm(s)" in str(report)
    ids = torch.randint(0, 96, (batch, seq))
    ref_loss, ref = loss_and_grads(reference, ids)
    loss, got = loss_and_grads(model, ids)
    assert all(f.last_num_tiles == TILES for f in _tiled_norms(model))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    assert got.keys() == ref.keys()
    for name in ref:
        if arch == "gemma3" and "norm" in name:
            assert (got[name] - ref[name]).abs().max() <= 1e-6 * ref[name].abs().max(), name
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-11, atol=1e-15, msg=name)


def test_bf16_model_grads_bit_identical_but_norm_weights() -> None:
    """bf16: the per-row math is the module's own, so the loss and every grad but the norms' weights are
    bit-identical to the untiled model's (the norm weights': next test)."""
    untiled = build("llama", torch.bfloat16)
    model = copy.deepcopy(untiled)
    tiledmlp.patch(model, num_shards=1, norms=TILES)
    ids = torch.randint(0, 96, (2, 64))
    base_loss, base = loss_and_grads(untiled, ids)
    loss, got = loss_and_grads(model, ids)
    assert torch.equal(loss, base_loss)
    norm_weights = [n for n in base if "norm" in n]
    assert len(norm_weights) == 5
    for name in base:
        if name not in norm_weights:
            assert torch.equal(got[name], base[name]), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_norm_weight_grad_is_no_worse_than_untiled(dtype: torch.dtype, device: str) -> None:
    """One 16-bit norm, the same inputs and upstream grad: against float64 math on those very values, the tiled
    weight grad (float32 products summed in float32, rounded once) is no further off than the untiled one
    (16-bit products), and the input grad is the untiled one bit for bit."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64).to(device, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    x = torch.randn(3, 500, 64, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(3, 500, 64, dtype=dtype, device=device)
    exact = copy.deepcopy(norm).double()
    x64 = x.detach().double().requires_grad_()
    exact(x64).backward(g.double())
    norm(x).backward(g)
    base_dx, base_dw = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    tiledmlp.norms.patch_norms(norm, 7)
    norm(x).backward(g)
    assert torch.equal(x.grad, base_dx)
    err_tiled = (norm.weight.grad.double() - exact.weight.grad).norm()
    err_untiled = (base_dw.double() - exact.weight.grad).norm()
    assert err_tiled <= err_untiled, (float(err_tiled), float(err_untiled))


def test_checkpointing_and_offloading_keep_grads() -> None:
    """Under non-reentrant checkpointing and activation offloading (host copy path forced), float64 grads are
    bit-identical to the same tiled model checkpointed without offloading, and match the untiled one."""
    reference, model = build("llama"), build("llama")
    tiledmlp.patch(model, num_shards=3, norms=TILES)
    enable_checkpointing(model)
    ids = torch.randint(0, 96, (2, 40))
    _, ref = loss_and_grads(reference, ids)
    _, plain = loss_and_grads(model, ids)
    with tiledmlp.offload_activations(model, min_bytes=0, _copy_on_cpu=True) as off:
        _, offloaded = loss_and_grads(model, ids)
    assert off.stats.offloaded > 0
    for name in ref:
        assert torch.equal(offloaded[name], plain[name]), name
        torch.testing.assert_close(plain[name], ref[name], rtol=1e-11, atol=1e-15, msg=name)


def test_16bit_norms_probed_inside_a_checkpointed_first_step() -> None:
    """A 16-bit norm is probed at its first tiled call, which under non-reentrant checkpointing is inside the
    layer's first forward: the probe's own saved tensors had counted as the layer's, and the recomputation (probe
    cached) saved fewer: CheckpointError at the first backward (the 1B model at 128k tokens on an H200). The
    checkpointed step now runs and its grads are bit-identical to the same tiled model's without checkpointing."""
    plain, checkpointed = build("llama", torch.bfloat16), build("llama", torch.bfloat16)
    for model in (plain, checkpointed):
        tiledmlp.patch(model, num_shards=3, norms=TILES)
    enable_checkpointing(checkpointed)
    ids = torch.randint(0, 96, (2, 40))
    loss, expected = loss_and_grads(plain, ids)
    ck_loss, got = loss_and_grads(checkpointed, ids)
    assert torch.equal(ck_loss, loss)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_lora_frozen_norms_get_input_grads_only() -> None:
    from peft import LoraConfig, get_peft_model

    def lora(model: nn.Module) -> nn.Module:
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                init_lora_weights=False))

    reference, model = lora(build("llama")), lora(build("llama"))
    tiledmlp.patch(model, num_shards=2, norms=TILES)
    ids = torch.randint(0, 96, (1, 33))
    _, ref = loss_and_grads(reference, ids)
    _, got = loss_and_grads(model, ids)
    assert got.keys() == ref.keys() and all("lora" in n for n in got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-11, atol=1e-15, msg=name)


def test_auto_policy_and_what_is_tiled() -> None:
    """auto: a tile's float32 copy stays within 256 MiB, so short inputs run the module untouched; only
    RMSNorm-like leaves (a 1-D weight and nothing else) are patched; no_grad output equals the module's."""
    rows = NORM_TILE_BYTES // (4 * 2048)
    assert rows == 32768
    assert plan_norm_tiles(rows, 2048) == [rows]
    assert len(plan_norm_tiles(2 * rows, 2048)) == 2 and len(plan_norm_tiles(262144, 2048)) == 8
    assert plan_norm_tiles(10, 8, 3) == [4, 3, 3]

    class WithBias(LlamaRMSNorm):
        def __init__(self, n: int) -> None:
            super().__init__(n)
            self.bias = nn.Parameter(torch.zeros(n))

    model = nn.ModuleDict({"rms": LlamaRMSNorm(8), "layer": nn.LayerNorm(8), "biased": WithBias(8)})
    assert tiledmlp.norms.patch_norms(model, 3) == 1
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = type(model["rms"]).forward(model["rms"], x)
        assert torch.equal(model["rms"](x), expected) and model["rms"].forward.last_num_tiles == 3
    model["rms"].forward.num_tiles = "auto"
    model["rms"](x)
    assert model["rms"].forward.last_num_tiles == 1
    assert tiledmlp.norms.unpatch_norms(model) == 1 and "forward" not in model["rms"].__dict__


def test_norms_false_leaves_them_and_the_train_flag_passes_it() -> None:
    from tiledmlp.train.args import TilingArguments

    assert tiledmlp.patch(build("llama"), norms=False).norms_patched == 0
    assert TilingArguments().use_tiled_norms is True  # tiledmlp train --use_tiled_norms false turns it off


@pytest.mark.parametrize("norms,exc", [("some", ValueError), (0, ValueError), (2.5, TypeError)])
def test_bad_norms_argument_is_refused(norms: object, exc: type) -> None:
    with pytest.raises(exc, match="norms"):
        tiledmlp.patch(build("llama"), norms=norms)


def test_tiled_norm_step_peak_is_a_fraction_of_the_untiled() -> None:
    """bf16 RMSNorm fwd+bwd over 16k tokens x 256 (CPU profiler, exact): 8 tiles keep the float32 working set
    to one tile's; the untiled norm saves a float32 copy of its input and its backward holds several more."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(256).to(torch.bfloat16)
    x = torch.randn(1, 16384, 256, dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        norm(x).backward(torch.ones_like(x))
        x.grad = norm.weight.grad = None

    untiled = profiler_peak_bytes(step, device="cpu")
    tiledmlp.norms.patch_norms(norm, 8)
    tiled = profiler_peak_bytes(step, device="cpu")
    tensor = x.numel() * 2  # measured here: untiled 14.0 tensors of x's size, tiled 5.0
    assert untiled >= 12 * tensor and tiled <= 0.4 * untiled, (untiled / tensor, tiled / tensor)


def test_bf16_autocast_over_float32_weights() -> None:
    """--bf16 autocast (float32 weights and residual stream): the recompute replays the forward's autocast state;
    the loss is bit-identical and the grads differ by float32 summation order only (the norm's input grad meets
    the residual's after its two parts are summed, not between them)."""
    untiled = build("llama", torch.float32)
    model = copy.deepcopy(untiled)
    tiledmlp.patch(model, num_shards=1, norms=TILES)
    ids = torch.randint(0, 96, (2, 40))

    def run(m: nn.Module) -> tuple[torch.Tensor, dict]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_and_grads(m, ids)

    (base_loss, base), (loss, got) = run(untiled), run(model)
    assert torch.equal(loss, base_loss)
    for name in base:  # measured: 1.5e-7 at most
        assert (got[name] - base[name]).abs().max() <= 1e-6 * base[name].abs().max(), name


class CenteredRMSNorm(nn.Module):
    """A norm that rounds ``1 + w`` in the weight's dtype (as transformers' MuseSpark centered norm does): with the
    float32 weight copy the tiled backward recomputes with, its output and input grad would change."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight).float()).to(x.dtype)


@pytest.mark.parametrize("norm_cls, tiled", [(CenteredRMSNorm, False), (LlamaRMSNorm, True)])
def test_a_norm_computing_in_its_weights_dtype_runs_untiled(norm_cls: type, tiled: bool) -> None:
    """bf16: a forward that reads the weight's dtype is not recomputed with a float32 copy (the input grad had
    differed from the module's own in 2403 of 8192 elements); it runs as the module, bit-identical. Llama's
    norm, the same with either weight, stays tiled."""
    untiled = norm_cls(64).to(torch.bfloat16)
    norm = copy.deepcopy(untiled)
    norm.forward = TiledNormForward(norm, TILES)
    x = torch.randn(2, 128, 64, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    outs = []
    for module in (untiled, norm):
        x_l = x.clone().requires_grad_()
        y = module(x_l)
        y.backward(grad)
        outs.append((y, x_l.grad, module.weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert norm.forward.wide_weight_exact(torch.bfloat16) is tiled
    assert (y1.grad_fn is not None and "TiledNorm" in type(y1.grad_fn).__name__) is tiled
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert torch.equal(dw1, dw0) if not tiled else (dw1 - dw0).abs().max() <= 2**-7 * dw0.abs().max()


def test_a_norm_weight_changed_in_place_before_the_backward_is_refused_like_untiled() -> None:
    """A row-tiled norm keeps its weight by reference and recomputes from it in the backward: a weight changed in
    place after the forward (an optimizer step, ``copy_``) is refused with autograd's error, as the untiled norm
    (which saved the weight) refuses it, instead of differentiating the changed weight silently."""
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    outcomes = []
    for tiled in (False, True):
        norm = LlamaRMSNorm(16).double()
        if tiled:  # patch() wants an MLP to tile beside the norm
            mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=2))
            tiledmlp.patch(nn.Sequential(norm, mlp.double()), num_shards=1, norms=3)
            assert isinstance(norm.__dict__.get("forward"), TiledNormForward)
        y = norm(x)
        with torch.no_grad():
            norm.weight.mul_(1.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        outcomes.append(tiled)
    assert outcomes == [False, True]
