"""Tests written from mutation testing (each names the mutant it kills): paths whose gradients no other test pinned
down. float64, against untiled references computed with plain torch ops."""

from __future__ import annotations

from typing import Any, Callable

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

    def spy(self, x_t, *masks):
        seen.append([r() is not None for r in alive])
        return recompute(self, x_t, *masks)

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


def _llama_mlp() -> nn.Module:
    """A float64 LlamaMLP (hidden 32, intermediate 88), seeded."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).double()


def _grads_as_untiled(mlp: nn.Module, grads: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    """``grads()`` of ``mlp`` unpatched, then patched into 3 tiles (which run): equal to 1e-12."""
    ref = grads()
    tiledmlp.patch(mlp, num_shards=3)
    got = grads()
    assert mlp.forward.last_num_tiles == 3
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_rel(g, r, 1e-12, f"grad {k}")


def _packed_in_one_group(views: list[torch.Tensor]) -> tuple[Any, list[Any]]:
    """A pass with one group holding ``views`` packed in order, each in the region ``_Pass.region`` gives it."""
    from tiledmlp.offload import _Pass
    from tiledmlp.offload_copies import Lane, Layout, Packed

    owner = _Pass()
    owner.new_group()
    return owner, [Packed(Lane(v.device), v, Layout(v), owner, 0, owner.region(v)) for v in views]


def test_offload_views_of_one_storage_in_two_dtypes_come_back_in_their_own_dtypes() -> None:
    """A storage saved as float64 and, in the same group, as an int64 view of it: two regions (a region's buffer
    has one dtype), each tensor back with its dtype and bits. Kills: offload.py's ``_Pass.region`` keying the
    storage without ``tensor.dtype`` (the int64 view came back as float64 values of its integers)."""
    t = torch.randn(4, 8, dtype=F64)
    as_int = t.view(torch.int64)
    owner, packs = _packed_in_one_group([t, as_int])
    assert packs[0].region is not packs[1].region
    for packed in packs:
        packed.release()
    packs[1].fetch()
    packs[0].fetch()
    for packed, want in zip(packs, (t, as_int)):
        got = packed.take()
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_parametrization_removed_then_its_chain_changed_is_refused_in_the_backward() -> None:
    """PEFT's pattern (registered around the call, removed before the backward), but the removed chain then gets
    another step: the forward's weight cannot be recomputed, so the backward refuses instead of recomputing with
    the new chain. Kills: parametrized.py's ``with_parametrizations`` refusing only ``now is not None`` (the changed
    chain was recomputed silently: wrong grads)."""
    import pytest
    from test_patch_lora_experts import _Scale
    from torch.nn.utils import parametrize

    mlp = _llama_mlp()
    tiledmlp.patch(mlp, num_shards=3)
    parametrize.register_parametrization(mlp.up_proj, "weight", _Scale(mlp.up_proj.out_features))
    out = mlp(torch.randn(2, 13, 32, dtype=F64, requires_grad=True))
    chain = mlp.up_proj.parametrizations.weight
    parametrize.remove_parametrizations(mlp.up_proj, "weight", leave_parametrized=False)
    chain.append(_Scale(mlp.up_proj.out_features))
    with pytest.raises(RuntimeError, match="changed between the forward and the backward"):
        out.sum().backward()


def test_a_recompute_failing_under_a_removed_parametrization_restores_the_bare_weight() -> None:
    """A parametrization removed before the backward (as PEFT does) is stood in for each recomputed tile; a tile that
    raises must still give the module its own parameter back, not leave the tile's computed weight registered.
    Kills: parametrized.py's ``standing_in`` restoring outside a ``finally``."""
    import pytest
    from test_patch_lora_experts import _Scale
    from torch.nn.utils import parametrize

    class Boom(nn.Module):
        armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise ValueError("boom")
            return nn.functional.silu(x)

    mlp = _llama_mlp()
    mlp.act_fn = Boom()
    weight = mlp.up_proj.weight
    tiledmlp.patch(mlp, num_shards=3)
    parametrize.register_parametrization(mlp.up_proj, "weight", _Scale(mlp.up_proj.out_features))
    out = mlp(torch.randn(2, 13, 32, dtype=F64, requires_grad=True))
    parametrize.remove_parametrizations(mlp.up_proj, "weight", leave_parametrized=False)
    assert mlp.up_proj._parameters["weight"] is weight
    mlp.act_fn.armed = True
    with pytest.raises(ValueError, match="boom"):
        out.sum().backward()
    assert mlp.up_proj._parameters["weight"] is weight


def test_tensors_held_by_a_parametrizations_submodule_get_their_grads() -> None:
    """A parametrization step whose child module holds a computed tensor as a plain attribute (``a @ b``, as PEFT
    holds its factors): the tiled MLP passes that tensor's grads on, so ``a``, ``b`` and every other grad equal the
    untiled float64 ones. Kills: parametrized.py's ``held_tensors`` reading only each step's own attributes, not its
    submodules' (``step.modules()``)."""
    from torch.nn.utils import parametrize

    class Holder(nn.Module):
        delta: torch.Tensor

    class AddDelta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.holder = Holder()

        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight + self.holder.delta

    mlp = _llama_mlp()
    step = AddDelta()
    a = torch.randn(88, 3, dtype=F64, requires_grad=True)
    b = torch.randn(3, 32, dtype=F64, requires_grad=True)
    step.holder.delta = a @ b
    parametrize.register_parametrization(mlp.up_proj, "weight", step)
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 13, 32, dtype=F64)
    wrt = [x, a, b, *(p for p in mlp.parameters() if p.requires_grad)]

    def grads() -> tuple[torch.Tensor, ...]:
        step.holder.delta = a @ b
        return torch.autograd.grad(mlp(x), wrt, grad_out)

    _grads_as_untiled(mlp, grads)


def test_a_region_member_still_held_keeps_the_region_and_its_tensor() -> None:
    """Views of one storage in one group: while any member holds its device tensor the address still names that
    storage, so a later view joins the region; fetching a released member copies back only what is not resident
    (the held member keeps its tensor, not a second copy). Kills: offload_copies.py's ``Region.holds_storage`` with
    ``all`` for ``any``, and ``Region.fetch`` copying every member, resident ones too."""
    t = torch.randn(4, 8, dtype=F64)
    halves = [t[:2], t[2:]]
    owner, packs = _packed_in_one_group(halves)
    assert packs[0].region is packs[1].region
    packs[0].release()
    assert owner.region(t[1:]) is packs[0].region  # packs[1] still holds the storage
    packs[0].fetch()
    assert packs[1].device is halves[1]
    for packed, want in zip(packs, halves):
        assert torch.equal(packed.take(), want)


def test_a_parametrized_weight_read_twice_is_computed_once_per_tile() -> None:
    """A weight read twice by the MLP's forward is computed once per tile (``parametrize.cached``), in the forward
    and in each tile's recompute, and the grads are the untiled float64 ones. Kills: parametrized.py's
    ``with_parametrizations`` without ``parametrize.cached()`` (the chain ran at every read: twice per tile)."""
    from test_patch_lora_experts import _Scale
    from torch.nn.utils import parametrize

    class TwoReads(nn.Module):
        def __init__(self, out_features: int, in_features: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(out_features, in_features, dtype=F64) / 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight) * 0.25 + nn.functional.linear(x.square(), self.weight)

    calls = []

    class Counted(_Scale):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return super().forward(weight)

    mlp = _llama_mlp()
    mlp.up_proj = TwoReads(88, 32)
    parametrize.register_parametrization(mlp.up_proj, "weight", Counted(88))
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 13, 32, dtype=F64)
    wrt = [x, *mlp.parameters()]
    ref = torch.autograd.grad(mlp(x), wrt, grad_out)
    tiledmlp.patch(mlp, num_shards=3)
    calls.clear()
    got = torch.autograd.grad(mlp(x), wrt, grad_out)
    assert mlp.forward.last_num_tiles == 3 and len(calls) == 2 * 3, len(calls)
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_rel(g, r, 1e-12, f"grad {k}")


def test_a_parametrized_buffer_removed_before_the_backward_is_recomputed_per_tile() -> None:
    """A parametrization on a buffer (not a parameter), registered around the call and removed before the backward
    as PEFT does with its weights, the step holding a computed tensor as PEFT holds its factors: the activation has
    no parameter and takes the generic path all the same, each tile's recompute stands the recomputed buffer in,
    and the grads (input, weights, the leaf behind the held tensor) are the untiled float64 ones. Kills:
    parametrized.py's ``standing_in`` reading ``module._parameters`` only (a buffer was a KeyError), and the GLU path
    taken whatever the live parametrizations (``glu = None if constants or kwargs else ...``: the recompute read
    the bare buffer)."""
    from torch.nn.utils import parametrize

    class MixedSiLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mix", torch.linspace(0.5, 1.5, 88, dtype=F64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.silu(x) * self.mix

    class Times(nn.Module):
        s: torch.Tensor

        def forward(self, b: torch.Tensor) -> torch.Tensor:
            return b * self.s

    mlp, step = _llama_mlp(), Times()
    mlp.act_fn = MixedSiLU()
    leaf = torch.linspace(2.0, -1.0, 88, dtype=F64, requires_grad=True)
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 13, 32, dtype=F64)
    wrt = [x, leaf, *mlp.parameters()]

    def grads() -> tuple[torch.Tensor, ...]:
        step.s = leaf.exp()
        parametrize.register_parametrization(mlp.act_fn, "mix", step)
        out = mlp(x)
        parametrize.remove_parametrizations(mlp.act_fn, "mix", leave_parametrized=False)
        return torch.autograd.grad(out, wrt, grad_out)

    _grads_as_untiled(mlp, grads)


def test_zero3_landing_with_only_computed_extra_tensors_needing_grad() -> None:
    """The ZeRO-3 landing where nothing but a computed extra tensor needs a grad (LoRA factors on frozen experts, an
    input that needs none): each tile is still back-propagated into the extra's sum, so the adapters get the untiled
    float64 grads. Kills: zero3.py's ``if wrt or computed`` as ``if wrt`` (the tiles were skipped: no grads)."""
    from tiledmlp import distributed as tdist

    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=F64)
    a, b = torch.randn(8, 2, dtype=F64, requires_grad=True), torch.randn(2, 8, dtype=F64, requires_grad=True)
    x, upstream = torch.randn(2, 7, 8, dtype=F64), torch.randn(2, 7, 8, dtype=F64)

    def grads(tiled: bool) -> tuple[torch.Tensor, ...]:
        delta = a @ b

        def fn(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t @ (w + delta))

        out = tdist._zero3_tiled(fn, x, (), [w], [3, 4, 7], extra=[delta]) if tiled else fn(x)
        return torch.autograd.grad(out, [a, b], upstream)

    for g, r in zip(grads(True), grads(False)):
        assert_rel(g, r, 1e-12, "factor grad")



def test_a_hook_on_a_child_of_the_activation_sends_the_mlp_down_the_generic_path() -> None:
    """The activation is a container (``nn.Sequential(nn.SiLU())``) whose child carries a forward hook changing its
    output: the module must be called, so the MLP takes the generic path and gives the untiled output and grads.
    Kills: architectures.py's ``_unhooked`` looking at the module itself, not ``module.modules()``."""
    mlp = _llama_mlp()
    mlp.act_fn = nn.Sequential(nn.SiLU())
    mlp.act_fn[0].register_forward_hook(lambda m, args, out: out * 2 + 0.5)
    _patched_equals_untiled(mlp, torch.randn(2, 30, 32, dtype=F64, requires_grad=True), 3, "generic", 1e-12)


def test_a_forward_pre_hook_on_the_activation_sends_the_mlp_down_the_generic_path() -> None:
    """A forward pre-hook on the activation changing its input: the module must be called with it, so the MLP
    takes the generic path and gives the untiled output and grads. Kills: architectures.py's ``_unhooked``
    without ``m._forward_pre_hooks``."""
    mlp = _llama_mlp()
    mlp.act_fn = nn.SiLU()
    mlp.act_fn.register_forward_pre_hook(lambda m, args: (args[0] * 2 - 0.25,))
    _patched_equals_untiled(mlp, torch.randn(2, 30, 32, dtype=F64, requires_grad=True), 3, "generic", 1e-12)


def test_zero3_landing_sums_the_grad_of_an_extra_tensor_that_is_its_nodes_second_output() -> None:
    """A computed extra tensor that is the second output of its node (the second half of ``(a @ b).chunk(2)``): the
    sum reads the grad of that output, so the adapters get the untiled float64 grads. Kills: zero3.py's
    ``_summed_into`` reading output 0 of the node (``e.output_nr`` ignored)."""
    from tiledmlp import distributed as tdist

    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=F64, requires_grad=True)
    a, b = torch.randn(16, 2, dtype=F64, requires_grad=True), torch.randn(2, 8, dtype=F64, requires_grad=True)
    x, upstream = torch.randn(2, 7, 8, dtype=F64, requires_grad=True), torch.randn(2, 7, 8, dtype=F64)

    def grads(tiled: bool) -> tuple[torch.Tensor, ...]:
        _, second = (a @ b).chunk(2)

        def fn(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t @ (w + second))

        out = tdist._zero3_tiled(fn, x, (), [w], [3, 4, 7], extra=[second]) if tiled else fn(x)
        for t in (w, x):
            t.grad = None
        out.backward(upstream)
        return a.grad, b.grad, w.grad, x.grad

    want = [g.clone() for g in grads(False)]
    a.grad = b.grad = None
    for k, (g, r) in enumerate(zip(grads(True), want)):
        assert_rel(g, r, 1e-12, f"grad {k}")


def test_zero3_landing_drops_each_tiles_graph_before_the_next_recompute() -> None:
    """With a computed extra tensor the landing retains the graph (the extra's own nodes are run by every tile), so
    each tile's outputs must be let go before the next tile is recomputed: one tile's graph alive at a time, and the
    grads still the untiled float64 ones. Kills: zero3.py's backward keeping ``result, pairs`` (a tile's graph
    lived through the next tile's recompute)."""
    import weakref

    from tiledmlp import distributed as tdist

    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=F64)
    a, b = torch.randn(8, 2, dtype=F64, requires_grad=True), torch.randn(2, 8, dtype=F64, requires_grad=True)
    x, upstream = torch.randn(2, 7, 8, dtype=F64, requires_grad=True), torch.randn(2, 7, 8, dtype=F64)
    recomputed: list[weakref.ReferenceType[torch.Tensor]] = []
    alive_at_call: list[int] = []

    def grads(tiled: bool) -> tuple[torch.Tensor, ...]:
        delta = a @ b

        def fn(t: torch.Tensor) -> torch.Tensor:
            out = torch.tanh(t @ (w + delta))
            if tiled and torch.is_grad_enabled():
                alive_at_call.append(sum(r() is not None for r in recomputed))
                recomputed.append(weakref.ref(out))
            return out

        out = tdist._zero3_tiled(fn, x, (), [w], [3, 4, 7], extra=[delta]) if tiled else fn(x)
        return torch.autograd.grad(out, [x, a, b], upstream)

    ref = grads(False)
    got = grads(True)
    assert alive_at_call == [0, 0, 0], alive_at_call
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_rel(g, r, 1e-12, f"grad {k}")


def test_a_lasting_parametrization_of_two_steps_is_tiled_exactly() -> None:
    """A weight parametrized by a chain of two steps, registered for good: still registered as in the forward when
    each tile is recomputed, so it is tiled (not refused as changed) and every grad, the steps' own parameters
    included, is the untiled float64 one. Kills: parametrized.py's ``live_parametrizations`` recording only part of
    the chain (``tuple(chain)[:1]``: every chain of two steps was refused as changed in the backward)."""
    from test_patch_lora_experts import _Scale
    from torch.nn.utils import parametrize

    mlp = _llama_mlp()
    for _ in range(2):
        parametrize.register_parametrization(mlp.up_proj, "weight", _Scale(mlp.up_proj.out_features))
    _patched_equals_untiled(mlp, torch.randn(2, 13, 32, dtype=F64, requires_grad=True), 3, "generic", 1e-12)
