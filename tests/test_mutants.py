"""Tests written from mutation testing (each names the mutant it kills): paths whose gradients no other test pinned
down. float64, against untiled references computed with plain torch ops."""

from __future__ import annotations

import torch
from torch import nn

import tiledmlp
from conftest import assert_rel

F64 = torch.float64
H = 24


def _dirty_heap(shape: tuple[int, ...], times: int = 20) -> None:
    """Leave freed NaN-filled blocks of ``shape`` behind, so an ``empty`` buffer never filled reads as garbage."""
    for _ in range(times):
        junk = torch.full(shape, float("nan"), dtype=F64)
        del junk


def test_engine_token_input_unused_by_fn_gets_zero_grad_not_garbage() -> None:
    """A token input that needs grad but that ``fn`` never reads: the untiled call gives it no gradient, the tiled
    Function zeros (its rows of the input-grad buffer are zero-filled where a tile's grad is None). Kills: engine.py
    skipping that ``buf[start:end].zero_()`` (the rows kept ``torch.empty``'s garbage)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(H, 40, dtype=F64), nn.SiLU(), nn.Linear(40, H, dtype=F64))
    params = list(mlp.parameters())
    x = torch.randn(2, 40, H, dtype=F64, requires_grad=True)
    r = torch.randn(2, 40, 3, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 40, H, dtype=F64)
    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref, [x, *params], grad_out)
    out = tiledmlp.tiled_call(lambda a, b: mlp(a), x, r, params=params, num_shards=4)
    _dirty_heap((2 * 40, 3))
    got = torch.autograd.grad(out, [x, r, *params], grad_out, allow_unused=True)
    assert_rel(out, ref, 1e-12, "output")
    assert_rel(got[0], ref_grads[0], 1e-12, "x.grad")
    assert got[1] is None or bool((got[1] == 0).all()), f"unused token input's grad is not zero: {got[1]}"
    for k, (a, b) in enumerate(zip(got[2:], ref_grads[1:])):
        assert_rel(a, b, 1e-12, f"param {k} grad")


def test_mlp_with_an_instance_forward_before_patching_keeps_it_on_every_tile() -> None:
    """An MLP whose instance already had a ``forward`` (accelerate's ``add_hook_to_module`` on the MLP itself) is
    called, not read as a GLU: the hook acts on the whole call, exactly as untiled. Kills: patching.py's
    ``TiledForward._glu`` ignoring ``self.original`` (the GLU fast path then bypassed the hook: output halved)."""
    from accelerate.hooks import ModelHook, add_hook_to_module
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class Halve(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] * 0.5, *args[1:]), kwargs

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).double()
    add_hook_to_module(mlp, Halve())
    _patched_equals_untiled(mlp, torch.randn(2, 30, 32, dtype=F64, requires_grad=True), 3, "generic", 1e-12)


def _patched_equals_untiled(mlp: torch.nn.Module, x: torch.Tensor, shards: int, path: str, tol: float) -> None:
    """``mlp`` patched into ``shards`` tiles takes ``path`` and gives its untiled output and grads (x's, params')."""
    params = list(mlp.parameters())
    grad_out = torch.randn(x.shape, dtype=x.dtype)
    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref, [x, *params], grad_out)
    assert [p for _, _, p in tiledmlp.patch(mlp, num_shards=shards).patched] == [path]
    out = mlp(x)
    got = torch.autograd.grad(out, [x, *params], grad_out)
    assert_rel(out, ref, tol, "output")
    for k, (a, b) in enumerate(zip(got, ref_grads)):
        assert_rel(a, b, tol, f"grad {k}")


def test_16bit_expert_slices_of_a_weight_at_a_storage_offset_land_their_grads_in_place() -> None:
    """A 16-bit weight that is itself a view into a flat buffer (FSDP1's ``use_orig_params``, any packed storage:
    a non-zero storage offset), read per expert as ``w[e]``: the float32 sum's region for ``w[e]`` is located relative
    to the weight, not to the storage. The grads must be those of the same weight stored at offset 0, bit for bit,
    and within bf16 rounding of the float64 untiled ones. Kills: recompute.py's ``GradSum.region`` dropping
    ``- param.storage_offset()`` (out-of-bounds or wrong region)."""
    torch.manual_seed(0)
    E, I2, D = 3, 20, 16
    w64 = torch.randn(E, I2, D, dtype=F64) / 4
    x64 = torch.randn(2, 24, D, dtype=F64)
    route = torch.randint(0, E, (2, 24))
    grad64 = torch.randn(2, 24, I2, dtype=F64)

    def fn(w):
        def f(x, r):  # token-wise: each token through its expert's slice, a 2-D matmul on a view of w
            xs, rs = x.reshape(-1, x.shape[-1]), r.reshape(-1)
            rows = [xs[i : i + 1] @ w[int(rs[i])].t() for i in range(xs.shape[0])]
            return torch.cat(rows).reshape(*x.shape[:-1], w.shape[1])
        return f

    def run(w):
        x = x64.to(torch.bfloat16).requires_grad_()
        out = tiledmlp.tiled_call(fn(w), x, route, params=[w], num_shards=4)
        return torch.autograd.grad(out, [x, w], grad64.to(torch.bfloat16))

    plain = nn.Parameter(w64.to(torch.bfloat16).clone())
    flat = torch.zeros(1000 + w64.numel(), dtype=torch.bfloat16)
    flat[1000:] = w64.to(torch.bfloat16).reshape(-1)
    offset = nn.Parameter(flat[1000:].view(E, I2, D))
    assert offset.storage_offset() == 1000
    ref = run(plain)
    got = run(offset)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # and the tiled grads are the untiled ones (float64) up to bf16 rounding
    w_ref = w64.to(torch.bfloat16).double().requires_grad_()
    x_ref = x64.to(torch.bfloat16).double().requires_grad_()
    out_ref = fn(w_ref)(x_ref, route)
    gx, gw = torch.autograd.grad(out_ref, [x_ref, w_ref], grad64.to(torch.bfloat16).double())
    assert_rel(got[1].double(), gw, 1e-2, "w.grad")
    assert_rel(got[0].double(), gx, 1e-2, "x.grad")


def test_glu_path_float32_grads_match_untiled_float32() -> None:
    """The GLU fast path on float32 weights (the other tests run it in float64 and bf16): the upstream grad is used
    in the tile's own dtype, so the grads are the untiled float32 ones to float32 rounding (the tolerance of
    test_engine's float32 case). Kills: glu.py's ``_tile_backward`` rounding ``go`` through bf16 (4e-3 off)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88, mlp_bias=True))
    _patched_equals_untiled(mlp, torch.randn(2, 45, 32, requires_grad=True), 4, "glu", 1e-5)


def test_offload_moves_a_tensor_of_exactly_min_bytes_and_keeps_smaller_ones() -> None:
    """``min_bytes``: tensors smaller than it stay on the device, one of exactly that size moves (the documented
    threshold). Kills: offload.py's ``size >= self.min_bytes`` turned into ``>``."""
    from test_offload_strides import _Views

    x = torch.randn(6, 8, dtype=F64)
    off = tiledmlp.offload_activations(_Views(), min_bytes=x.numel() * x.element_size(), _copy_on_cpu=True)
    try:
        assert off._moves(x) is not None
        assert off._moves(x[:5]) is None
    finally:
        off.remove()


def test_a_layout_whose_stride_meets_the_reach_overlaps_and_stays_on_the_device() -> None:
    """Sizes (3, 2), strides (1, 2): elements at 0 1 2 | 2 3 4, element 2 twice. Such a tensor cannot be written back
    through its strides (copy_ refuses an overlapping destination), so it stays where it is; and what the offloader
    does move comes back equal. Kills: offload_copies.py's ``Layout.non_overlapping`` with ``stride < reach``
    (equality counted as no overlap)."""
    from test_offload_strides import _Views
    from tiledmlp.offload_copies import Layout

    base = torch.arange(8, dtype=F64)
    overlapping = base.as_strided((3, 2), (1, 2))
    assert not Layout(overlapping).non_overlapping()
    assert Layout(base.as_strided((3, 2), (1, 3))).non_overlapping()  # 0 1 2 | 3 4 5
    off = tiledmlp.offload_activations(_Views(), min_bytes=0, _copy_on_cpu=True)
    try:
        assert off._moves(overlapping) is None
    finally:
        off.remove()


def test_a_glu_mlp_called_with_an_extra_argument_fails_like_untiled() -> None:
    """The GLU formula reads ``x`` only, so a call with any other argument is left to the module's own forward, which
    refuses it as the unpatched module does (instead of silently dropping it). Kills: patching.py taking the GLU
    path whatever the constants/keywords (``glu = self._glu()``)."""
    import pytest
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).double()
    x = torch.randn(2, 30, 32, dtype=F64, requires_grad=True)
    with pytest.raises(TypeError):
        mlp(x, 3)
    assert [p for _, _, p in tiledmlp.patch(mlp, num_shards=3).patched] == ["glu"]
    with pytest.raises(TypeError):
        mlp(x, 3)
    with pytest.raises(TypeError):
        mlp(x, scale=3)



def test_glu_backward_frees_the_kept_last_tile_before_recomputing_any_other(monkeypatch) -> None:
    """The last tile's gate/up, kept from the forward, are back-propagated first and dropped before any other tile's
    gate/up are recomputed, so keeping them adds nothing to one MLP's backward peak (how-it-works: "in the backward
    that tile goes first"); grads stay exact. Kills: glu.py's backward walking the tiles in forward order (the kept
    tile then lives through every recompute)."""
    import weakref

    import torch.nn.functional as F

    from tiledmlp.glu import GLUWeights, glu_tiled_call

    torch.manual_seed(0)
    gw, uw, dw = (torch.randn(40, H, dtype=F64) / 4, torch.randn(40, H, dtype=F64) / 4,
                  torch.randn(H, 40, dtype=F64) / 4)
    weights = [t.requires_grad_() for t in (gw, uw, dw)]
    spec = GLUWeights(gw, None, uw, None, dw, None, F.silu)
    x = torch.randn(2, 30, H, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 30, H, dtype=F64)
    ref = F.linear(F.silu(F.linear(x, gw)) * F.linear(x, uw), dw)
    ref_grads = torch.autograd.grad(ref, [x, *weights], grad_out)
    out = glu_tiled_call(spec, x, [15, 15, 15, 15])
    kept = out.grad_fn.kept
    assert kept is not None
    alive = [weakref.ref(t) for t in kept]
    del kept
    seen = []
    recompute = GLUWeights.gate_up

    def spy(self, x_t):
        seen.append([r() is not None for r in alive])
        return recompute(self, x_t)

    monkeypatch.setattr(GLUWeights, "gate_up", spy)
    got = torch.autograd.grad(out, [x, *weights], grad_out)
    assert len(seen) == 3 and not any(any(s) for s in seen), seen  # 3 recomputed tiles, the kept one already gone
    assert_rel(out, ref, 1e-12, "output")
    for k, (a, b) in enumerate(zip(got, ref_grads)):
        assert_rel(a, b, 1e-12, f"grad {k}")


def test_16bit_matmul_with_a_declared_bias_it_cannot_land_leaves_the_bias_to_autograd() -> None:
    """bf16 weights: a matmul whose declared bias is read through a broadcast view (``b.expand``: its grad is a sum
    over the broadcast, which the float32 landing cannot place) is left whole to autograd, so the bias still gets its
    grad (float64 reference, to bf16 rounding). Kills: precision.py's ``WideWeightGrads._match`` landing the weight
    anyway and dropping the bias (its grad was lost: None)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    w64, b64 = torch.randn(20, H, dtype=F64) / 4, torch.randn(1, dtype=F64)
    x64, g64 = torch.randn(2, 32, H, dtype=F64), torch.randn(2, 32, 20, dtype=F64)

    def fn(w, b):
        return lambda x: F.linear(x, w, b.expand(w.shape[0]))

    w, b = (t.to(torch.bfloat16).requires_grad_() for t in (w64, b64))
    x = x64.to(torch.bfloat16).requires_grad_()
    out = tiledmlp.tiled_call(fn(w, b), x, params=[w, b], num_shards=4)
    got = torch.autograd.grad(out, [x, w, b], g64.to(torch.bfloat16), allow_unused=True)
    wr, br, xr = (t.to(torch.bfloat16).double().requires_grad_() for t in (w64, b64, x64))
    ref = torch.autograd.grad(fn(wr, br)(xr), [xr, wr, br], g64.to(torch.bfloat16).double())
    for name, a, r in zip(("x", "w", "b"), got, ref):
        assert a is not None, f"{name}.grad lost"
        assert_rel(a.double(), r, 1e-2, f"{name}.grad")
