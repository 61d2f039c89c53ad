"""tiledmlp.patch on tiny Hugging Face models: exact loss and grads vs the unpatched model in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tiledmlp
from conftest import assert_rel
from models import BUILDERS, EXPECTED_PATH, MOE_FAMILIES, build, loss_and_grads

SEQ = 40


def _ids(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq))


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_architecture_parity_float64(arch):
    model = build(arch)
    ids = _ids()
    ref_loss, ref = loss_and_grads(model, ids)
    report = tiledmlp.patch(model, num_shards=3)
    assert len(report) == 2, str(report)
    assert {path for _, _, path in report.patched} == {EXPECTED_PATH.get(arch, "glu")}
    loss, got = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
    tiles = [m.forward.last_num_tiles for m in model.modules() if isinstance(m.forward, tiledmlp.patching.TiledForward)]
    assert tiles == [3, 3]


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_moe_router_logits_keep_gradients(arch):
    model = build(arch)
    ids = _ids()
    model(input_ids=ids, labels=ids).aux_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if "gate.weight" in n and "experts" not in n}
    assert ref and all(g.abs().sum() > 0 for g in ref.values())
    model.zero_grad(set_to_none=True)
    tiledmlp.patch(model, num_shards=4)
    out = model(input_ids=ids, labels=ids)
    out.aux_loss.backward()
    for name, p in model.named_parameters():
        if name in ref:
            assert_rel(p.grad, ref[name], 1e-12, name)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape[0] == ids.numel()


# What patch() must tile in each family (MOE_FAMILIES in models.py), and what it must leave whole
MOE_TILED = {
    "gpt-oss": {"GptOssExperts"},  # its block, GptOssMLP, holds the router: not tiled whole
    "llama4": {"Llama4TextMLP"},  # the shared expert; Llama4TextExperts takes tokens grouped by expert
    "granitemoe": {"GraniteMoeExperts"},
    "deepseek-v2": {"DeepseekV2Experts", "DeepseekV2MLP"},
    "glm4-moe": {"Glm4MoeExperts", "Glm4MoeMLP"},
    "dbrx": {"DbrxExperts"},  # was reported tiled and ran untiled: its routing is over the flattened tokens
}


@pytest.mark.parametrize("arch", sorted(MOE_FAMILIES))
def test_moe_families_tile_every_expert_and_keep_router_grads(arch):
    """Routed experts are found by their routing signature whatever the block is called, routers stay untiled (so
    the aux loss, part of these models' loss, back-propagates exactly), and an expert's output can be added to in
    place (Llama-4 does)."""
    model = build(arch)
    ids = _ids()
    try:
        aux = getattr(model(input_ids=ids, labels=ids), "aux_loss", None)
    except AttributeError as exc:  # the untouched model, e.g. transformers 5.17's GraniteMoe: `int.to` on its aux loss
        pytest.skip(f"this transformers' own {arch} forward fails: {exc}")
    if arch in ("gpt-oss", "granitemoe"):  # the others balance their experts without an aux loss
        assert aux is not None
    ref_loss, ref = loss_and_grads(model, ids)
    report = tiledmlp.patch(model, num_shards=3)
    tiled = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), tiledmlp.patching.TiledForward)]
    assert {type(m).__name__ for m in tiled} == MOE_TILED[arch], str(report)
    assert not any("Router" in type(m).__name__ for m in tiled)
    loss, got = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
    assert all(m.forward.last_num_tiles == 3 for m in tiled)


def test_report_patch_twice_and_unpatch():
    """Patching again applies the new options (like unpatch + patch): tiles, accumulation dtype, norms."""
    from tiledmlp.norms import TiledNormForward

    model = build("llama")
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    first = tiledmlp.patch(model, num_shards=2)
    tiled = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), tiledmlp.patching.TiledForward)]
    second = tiledmlp.patch(model, num_shards=5, accumulate_dtype=torch.float64, norms=3)
    assert len(first) == len(second) == 2
    assert all("already patched; options updated" in path for _, _, path in second.patched)
    model.model.layers[0].mlp(x)
    assert tiled[0].forward.last_num_tiles == 5
    assert all(m.forward.options.accumulate_dtype is torch.float64 for m in tiled)
    norms = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledNormForward)]
    assert len(norms) == 5 and all(m.forward.num_tiles == 3 for m in norms)
    text = str(first)
    assert "model.layers.0.mlp" in text and "LlamaMLP" in text and "glu" in text
    assert first.norms_patched == 5 and second.norms_patched == 0  # 2 per layer + the final norm, once
    tiledmlp.patch(model, norms=False)  # the norms go back to their own forwards
    assert not any(isinstance(m.__dict__.get("forward"), TiledNormForward) for m in model.modules())
    assert tiledmlp.unpatch(model) == 2
    assert tiledmlp.unpatch(model) == 0
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_state_dict_keys_unchanged():
    model = build("llama")
    keys = list(model.state_dict())
    tiledmlp.patch(model)
    assert list(model.state_dict()) == keys


def test_nothing_to_patch_raises_with_classes_seen():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="Sequential, Linear, ReLU|Linear, ReLU, Sequential"):
        tiledmlp.patch(model)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="num_shards"):
        tiledmlp.patch(build("llama"), num_shards=0)
    with pytest.raises(ValueError, match="target_gb"):
        tiledmlp.patch(build("llama"), target_gb=-1)
    with pytest.raises(TypeError, match="model"):
        tiledmlp.patch("llama")
    with pytest.raises(TypeError, match="TiledMLP wraps an nn.Module"):
        tiledmlp.TiledMLP(build("llama").model.layers[0].mlp.forward)
    with pytest.raises(TypeError, match="fn must be callable"):
        tiledmlp.tiled_call(None, torch.randn(2, 8, 64), num_shards=2)


class TwoInputMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale


class MyGatedBlock(nn.Module):
    """A custom gated MLP registered by the user in three lines."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(8, 20, bias=False), nn.Linear(8, 20, bias=False), nn.Linear(20, 8)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def test_extra_positional_args_are_skipped_with_reason_and_registry_works():
    model = nn.ModuleDict({"a": TwoInputMLP(), "b": MyGatedBlock()}).double()
    with pytest.raises(ValueError, match="TwoInputMLP .*positional"):
        tiledmlp.patch(model)
    tiledmlp.register_mlp(MyGatedBlock, glu=tiledmlp.glu_from_attrs("w1", "w3", "w2", "act"))
    report = tiledmlp.patch(model, num_shards=4)
    assert report.patched == [("b", "MyGatedBlock", "glu")]
    assert report.skipped[0][0] == "a" and "positional" in report.skipped[0][2]
    x = torch.randn(3, 10, 8, dtype=torch.float64, requires_grad=True)
    params = list(model["b"].parameters())
    got = torch.autograd.grad(model["b"](x).square().sum(), [x, *params])
    tiledmlp.unpatch(model)
    ref = torch.autograd.grad(model["b"](x).square().sum(), [x, *params])
    for g, r in zip(got, ref):
        assert_rel(g, r, 1e-12)


def test_generic_mlp_by_class_name():
    class TinyMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, hidden_states):
            return self.proj(torch.tanh(self.fc(hidden_states)))

    report = tiledmlp.patch(nn.ModuleList([TinyMLP()]))
    assert report.patched == [("0", "TinyMLP", "generic")]


def test_eval_and_no_grad_use_no_autograd_function():
    model = build("llama")
    model.eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    tiledmlp.patch(model, num_shards=4)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert out.grad_fn is None
    assert_rel(out, ref, 1e-12, "eval logits")


def test_patch_with_loss_keeps_loss_and_grads():
    """float32: transformers' own loss upcasts logits to float32 (downcasting a float64 model's), so the
    model-level reference is only float32-exact; tests/test_loss.py checks the tiled loss in float64."""
    model = build("llama", torch.float32)
    ids = _ids()
    ref_loss, ref = loss_and_grads(model, ids)
    report = tiledmlp.patch(model, num_shards=3, loss=True)
    assert report.loss_patched == 1 and "tiled loss" in str(report)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    loss, got = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-5, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-5, name)
    assert tiledmlp.unpatch(model) == 3 + report.norms_patched
    assert model(input_ids=ids, labels=ids).logits is not None


def test_patch_accumulate_dtype_reaches_the_tiled_loss(monkeypatch):
    """``patch(accumulate_dtype=..., loss=True)``: the head's weight grad is summed like the MLPs' (a bf16 sum asked
    for memory would otherwise leave the largest float32 accumulator, vocab x hidden, in place)."""
    import tiledmlp.loss as loss_mod

    seen = []
    real = loss_mod._add_weight_grad
    monkeypatch.setattr(loss_mod, "_add_weight_grad", lambda acc, *a: seen.append(acc.dtype) or real(acc, *a))
    model = build("llama", torch.bfloat16)
    tiledmlp.patch(model, num_shards=2, accumulate_dtype=torch.bfloat16, loss=True)
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    assert seen and set(seen) == {torch.bfloat16}
    tiledmlp.unpatch(model)
    seen.clear()
    tiledmlp.patch(model, num_shards=2, loss=True)  # "auto": float32 sums for bf16 weights
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    assert seen and set(seen) == {torch.float32}


def test_module_hooks_fire_once_per_call_not_per_tile():
    model = build("llama")
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    mlp.register_forward_hook(lambda module, args, out: calls.append("post"))
    tiledmlp.patch(model, num_shards=4)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == ["pre", "post"]
    assert mlp.forward.last_num_tiles == 4


def test_tiled_mlp_wrapper_module():
    model = build("gpt2")
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 30, 32, dtype=torch.float64, requires_grad=True)
    params = list(mlp.parameters())
    ref = torch.autograd.grad(mlp(x).square().sum(), [x, *params])
    wrapped = tiledmlp.TiledMLP(mlp, num_shards=5)
    assert [n for n, _ in wrapped.named_parameters()] == [f"mlp.{n}" for n, _ in mlp.named_parameters()]
    got = torch.autograd.grad(wrapped(x).square().sum(), [x, *params])
    for g, r in zip(got, ref):
        assert_rel(g, r, 1e-12)
    assert wrapped._tiled.last_num_tiles == 5


@pytest.mark.parametrize("which", ["glu", "generic", "norm"])
def test_tiled_outputs_can_be_modified_in_place(which: str) -> None:
    """A tiled output is a tensor of its own, not a view made inside an autograd Function (autograd refuses in-place
    ops on those): models add to it (Llama-4's shared expert) and the grads stay exact."""
    model = build("gpt2" if which == "generic" else "llama")
    module = {"glu": lambda: model.model.layers[0].mlp, "generic": lambda: model.transformer.h[0].mlp,
              "norm": lambda: model.model.norm}[which]()
    x = torch.randn(2, 30, 32, dtype=torch.float64, requires_grad=True)
    params = list(module.parameters())

    def grads() -> list[torch.Tensor]:
        out = module(x)
        out.mul_(2).add_(x)
        return torch.autograd.grad(out.square().sum(), [x, *params])

    ref = grads()
    tiledmlp.patch(model, num_shards=3, norms=3)
    got = grads()
    assert module.forward.last_num_tiles == 3
    for g, r in zip(got, ref):
        assert_rel(g, r, 1e-12)


def test_patched_generic_mlp_takes_a_single_token_vector() -> None:
    """A [H] input (no token dims to tile) runs the module's own forward, as untiled."""
    mlp = build("gpt2").transformer.h[0].mlp
    x = torch.randn(32, dtype=torch.float64)
    ref = mlp(x)
    tiledmlp.patch(mlp, num_shards=3)
    assert_rel(mlp(x), ref, 1e-12)
