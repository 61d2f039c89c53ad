"""What stands between a module and its call is never bypassed: an overridden forward, hooks of every kind,
accelerate's forward-replacing hooks (``device_map``, offloading). Where tiling cannot read the weights directly,
the module is called (generic path) and the result stays exact in float64."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator

import pytest
import torch
from accelerate import cpu_offload
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import tiledmlp
from conftest import assert_rel
from models import build, loss_and_grads


def _mlp() -> LlamaMLP:
    return LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).double()


class DoubledMLP(LlamaMLP):
    """A subclass of a registered class with a forward of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class Halve(ModelHook):
    """An accelerate hook that changes the input: it must act on every call of the module it is on."""

    def pre_forward(self, module, *args, **kwargs):
        return (args[0] * 0.5, *args[1:]), kwargs


def _output_and_grads(fn, params, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn(x)
    return out.detach(), list(torch.autograd.grad(out.square().sum(), [x, *params]))


def test_subclass_with_its_own_forward_is_not_tiled_as_its_parent() -> None:
    mlp = DoubledMLP(LlamaConfig(hidden_size=32, intermediate_size=88)).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    params = list(mlp.parameters())
    ref_out, ref = _output_and_grads(mlp, params, x)
    report = tiledmlp.patch(mlp, num_shards=4)
    assert report.patched[0][2] == "generic"
    out, got = _output_and_grads(mlp, params, x)
    assert mlp.forward.last_num_tiles == 4
    assert_rel(out, ref_out, 1e-12, "output")
    for g, r in zip(got, ref):
        assert_rel(g, r, 1e-12)


def test_a_class_only_named_like_a_builtin_entry_is_recognised_afresh() -> None:
    class LlamaMLP(torch.nn.Module):  # not transformers': same name, another computation
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 8).double() for _ in range(3))
            self.act_fn = torch.nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    mlp = LlamaMLP()
    x = torch.randn(20, 8, dtype=torch.float64)
    ref = mlp(x)
    assert tiledmlp.patch(mlp, num_shards=3).patched[0][2] == "generic"
    assert_rel(mlp(x), ref, 1e-12)


@pytest.mark.parametrize("hook", ["backward", "backward_pre", "accelerate", "global"])
def test_hooked_projection_sends_the_mlp_down_the_generic_path(hook: str) -> None:
    model = build("llama")
    ids = torch.randint(0, 96, (2, 40))
    gate = model.model.layers[0].mlp.gate_proj

    def install() -> object:
        if hook == "backward":  # scales the projection's input grad: must act on every tile
            return gate.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
        if hook == "backward_pre":
            return gate.register_full_backward_pre_hook(lambda m, go: (go[0] * 3,))
        if hook == "accelerate":
            return add_hook_to_module(gate, Halve())
        return torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)

    handle = install()
    try:
        ref_loss, ref = loss_and_grads(model, ids)
        report = tiledmlp.patch(model, num_shards=3)
        assert [p for _, _, p in report.patched] == ["generic", "generic" if hook == "global" else "glu"]
        loss, got = loss_and_grads(model, ids)
    finally:
        if hook == "accelerate":
            remove_hook_from_module(gate)
        else:
            handle.remove()
    assert_rel(loss, ref_loss, 1e-12, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)


def test_cpu_offloaded_model_is_exact_with_tiled_mlp_and_loss() -> None:
    """accelerate.cpu_offload keeps every weight on "meta" and loads it in a hook around each module's call: the
    tiled MLPs must call the projections, and the tiled loss must run inside lm_head's hook."""
    ids = torch.randint(0, 96, (2, 40))
    labels = ids.clone()
    labels[0, :9] = -100
    plain = build("llama", torch.float32).eval()
    with torch.no_grad():
        ref = plain(input_ids=ids, labels=labels).loss
    model = build("llama", torch.float32).eval()
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert model.lm_head.weight.device.type == "meta"
    report = tiledmlp.patch(model, num_shards=3, norms=False)
    tiledmlp.patch_loss(model, tile_eval=True)
    assert {p for _, _, p in report.patched} == {"generic"}
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # the tiled loss ran
    assert model.model.layers[0].mlp.forward.last_num_tiles == 3
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=0)  # transformers rounds logits to float32


def test_lm_head_hooked_after_patching_still_runs_its_hook() -> None:
    model = build("llama")
    ids = torch.randint(0, 96, (2, 40))
    ref_loss, ref = loss_and_grads(model, ids)
    tiledmlp.patch_loss(model)
    add_hook_to_module(model.lm_head, Halve())  # on top of the tiled loss's own lm_head forward
    halved_loss, _ = loss_and_grads(model, ids)
    remove_hook_from_module(model.lm_head)
    loss, got = loss_and_grads(model, ids)
    assert abs(float(halved_loss) - float(ref_loss)) > 1e-3  # the hook acted on the tiled loss's input
    assert_rel(loss, ref_loss.double(), 1e-6, "loss")  # transformers' loss is float32 (logits upcast)
    assert_rel(got["lm_head.weight"], ref["lm_head.weight"], 1e-6, "lm_head")


def test_quantized_like_linear_head_is_refused() -> None:
    class ScaledHead(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) / 4

    model = build("llama")
    model.lm_head = ScaledHead(32, 96, bias=False).double()
    with pytest.raises(ValueError, match="subclass with its own forward"):
        tiledmlp.patch_loss(model)


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps one process-wide state: a Trainer run earlier in this worker leaves it set (on a GPU
    machine to cuda, where ``cpu=True`` is then ignored), so the test starts and ends with none."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_unpatch_loss_after_accelerate_wrapped_the_forward() -> None:
    from accelerate import Accelerator

    model = build("llama", torch.float32)
    ids = torch.randint(0, 96, (2, 24))
    tiledmlp.patch_loss(model)
    model = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    assert model(input_ids=ids, labels=ids).logits is None
    assert tiledmlp.unpatch_loss(model) == 1
    assert model(input_ids=ids, labels=ids).logits.shape == (2, 24, 96)
    assert tiledmlp.patch_loss(model) == 1  # and again
    assert model(input_ids=ids, labels=ids).logits is None


def test_tiled_mlp_wrapper_fires_the_wrapped_modules_hooks() -> None:
    mlp = _mlp()
    fired = []
    mlp.register_forward_pre_hook(lambda m, a: fired.append("pre") or (a[0] * 2,))
    mlp.register_forward_hook(lambda m, a, o: fired.append("post") or o + 1)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    ref = mlp(x)
    wrapped = tiledmlp.TiledMLP(mlp, num_shards=4)
    fired.clear()
    assert_rel(wrapped(x), ref, 1e-12)
    assert fired == ["pre", "post"] and wrapped._tiled.last_num_tiles == 4
    assert "forward" not in mlp.__dict__  # left untouched between calls
    patched = _mlp()
    tiledmlp.patch(patched)
    with pytest.raises(ValueError, match="tiled already"):
        tiledmlp.TiledMLP(patched)


def test_patched_model_pickles() -> None:
    model = build("phi3")  # the fused gate_up reader too
    tiledmlp.patch(model, num_shards=3, loss=True)
    copy = pickle.loads(pickle.dumps(model))
    ids = torch.randint(0, 96, (2, 40))
    assert_rel(loss_and_grads(copy, ids)[0], loss_and_grads(model, ids)[0], 1e-12, "loss")
    assert copy.model.layers[0].mlp.forward.module is copy.model.layers[0].mlp


def test_float64_model_under_autocast_stays_float64() -> None:
    """Autocast leaves float64 matmuls alone: so must the tiled paths (GLU and generic)."""
    for which in ("llama", "gpt2"):
        model = build(which)
        ids = torch.randint(0, 96, (2, 40))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss, ref = loss_and_grads(model, ids)
        tiledmlp.patch(model, num_shards=3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, got = loss_and_grads(model, ids)
        assert_rel(loss, ref_loss, 1e-12, f"{which} loss")
        for name in ref:
            assert_rel(got[name], ref[name], 1e-12, f"{which} {name}")


def test_target_gb_when_intermediate_equals_hidden() -> None:
    model = build("llama")
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.gate_proj, mlp.up_proj = torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False)
        mlp.down_proj = torch.nn.Linear(32, 32, bias=False)
    model.double()
    layer0 = model.model.layers[0].mlp
    layer0.gate_proj.register_forward_hook(lambda *a: None)  # one generic path, one GLU path
    ids = torch.randint(0, 96, (2, 40))
    ref_loss, _ = loss_and_grads(model, ids)
    tiledmlp.patch(model, target_gb=1e-6)
    loss, _ = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert layer0.forward.last_num_tiles > 1 and model.model.layers[1].mlp.forward.last_num_tiles > 1


def _same_loss_and_grads(got: tuple[torch.Tensor, dict], ref: tuple[torch.Tensor, dict]) -> None:
    assert_rel(got[0], ref[0], 1e-12, "loss")
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        assert_rel(got[1][name], ref[1][name], 1e-12, name)


@pytest.mark.parametrize("change", ["hook removed", "hook added", "eval", "frozen"])
def test_a_module_changed_between_forward_and_backward_is_refused(change: str) -> None:
    """The backward recomputes each tile with the MLP as it is then. A hook registered around the forward only (a
    steering or tracing context) was left out of the recompute: gate_proj's grad was 0.5 off, float64, no error.
    Untiled, PyTorch differentiates the forward that ran; tiled, a change is refused by name. Unchanged, the same
    hooked MLP is exact."""
    model = build("llama")
    ids = torch.randint(0, 96, (2, 40))
    down = model.model.layers[0].mlp.down_proj
    double = down.register_forward_hook(lambda m, a, out: out * 2.0)
    ref = loss_and_grads(model, ids)
    tiledmlp.patch(model, num_shards=4)
    _same_loss_and_grads(loss_and_grads(model, ids), ref)
    loss = model(input_ids=ids, labels=ids).loss
    if change == "hook removed":
        double.remove()
    elif change == "hook added":
        down.register_forward_hook(lambda m, a, out: out + 1.0)
    elif change == "eval":
        model.eval()
    else:
        model.model.layers[0].mlp.gate_proj.requires_grad_(False)
    with pytest.raises(RuntimeError, match="model.layers.0.mlp changed between the forward and the backward of its "
                                           "tiled call.*run the backward inside the same context as the forward"):
        loss.backward()


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_a_spectral_normed_projection_is_refused_in_training(style: str) -> None:
    """Spectral norm steps its power iteration at each read of the weight in training: tiled, once a tile and again
    in each tile's recompute, so the loss, the grads and its vectors were another run's (4 tiles, float64: grads
    6e-3 off), without an error. Refused by name; one tile, or eval mode, is the untiled call, exact."""
    from torch.nn.utils import parametrizations, spectral_norm

    model = build("llama")
    ids = torch.randint(0, 96, (2, 40))
    down = model.model.layers[0].mlp.down_proj
    parametrizations.spectral_norm(down) if style == "parametrization" else spectral_norm(down)
    untiled = copy.deepcopy(model)
    tiledmlp.patch(model, num_shards=1)
    _same_loss_and_grads(loss_and_grads(model, ids), loss_and_grads(untiled, ids))
    tiledmlp.patch(model, num_shards=4)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp's .*\.weight is spectral-normed.* remove spectral_norm"):
        model(input_ids=ids, labels=ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
