"""Users' and libraries' hooks where they meet the row-tiled norms, the tiled loss, the offloader and split layers.

Three had gone wrong: a forward hook on ``lm_head`` that changed the tiled loss *in place* (``out.div_(2)``, a
temperature) halved the loss silently, where one returning a new tensor is refused; under the offloader, a layer's
input changed in place after its checkpoint saved it (a user's forward hook) was recomputed from the new values,
silently (grads 0.36 off), where plain checkpointing raises -- autograd skips its check under saved-tensor hooks;
and a norm whose weight was parametrized after patching failed in its backward (``KeyError: 'weight'``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import tiledmlp
from conftest import assert_rel
from models import build, loss_and_grads
from tiledmlp.hf_compat import enable_checkpointing

IDS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))


def _norm(model: nn.Module) -> nn.Module:
    return model.model.layers[0].input_layernorm


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_head_hook_changing_the_loss_in_place_is_refused(when: str) -> None:
    """Untiled, ``out.div_(2)`` divides the logits; tiled it had divided the loss (0.50 relative error, no error)."""
    model = build("llama")
    if when == "after":
        tiledmlp.patch(model, loss=True, norms=False)
    model.lm_head.register_forward_hook(lambda module, args, out: out.div_(2))
    if when == "before":
        tiledmlp.patch(model, loss=True, norms=False)
    with pytest.raises(ValueError, match="a forward hook on lm_head changed what it returned"):
        model(input_ids=IDS, labels=IDS)


def _change_layer_input_after(model: nn.Module) -> None:
    """A user's forward hook on layer 1 that rescales the layer's input in place once the layer has run."""
    def rescale(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        args[0].mul_(2)

    model.model.layers[1].register_forward_hook(rescale)


@pytest.mark.parametrize("split,copy", [(False, False), (True, False), (True, True)],
                         ids=["whole-shared-memory", "split-shared-memory", "split-below-min-bytes"])
def test_a_layer_input_changed_in_place_after_its_checkpoint_saved_it_is_refused(split: bool, copy: bool) -> None:
    """As plain non-reentrant checkpointing refuses it. Tensors that stay on the device (CPU's shared memory; on a
    GPU, those below ``min_bytes``) had passed unchecked and the recompute used the changed input: grads 0.36 off."""
    plain = build("llama")
    enable_checkpointing(plain, {"use_reentrant": False})
    _change_layer_input_after(plain)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_and_grads(plain, IDS)
    model = build("llama")
    enable_checkpointing(model, {"use_reentrant": False})
    _change_layer_input_after(model)
    with tiledmlp.offload_activations(model, split_layers=split, min_bytes=1 << 30, _copy_on_cpu=copy):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss_and_grads(model, IDS)


class _Scaled(nn.Module):
    """A parametrization of a norm's weight (a learned reparametrization, as ``torch.nn.utils.parametrize`` does)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 1.5


def test_a_norm_parametrized_after_patching_matches_unpatched() -> None:
    """float64: loss and every grad as unpatched with the same parametrization (it had raised KeyError: 'weight' in
    the tiled backward); it runs untiled, as a norm with a parametrization at patch time does."""
    runs = []
    for patched in (False, True):
        model = build("llama")
        if patched:
            tiledmlp.patch(model, num_shards=3, norms=3)
        parametrize.register_parametrization(_norm(model), "weight", _Scaled())
        runs.append(loss_and_grads(model, IDS))
    (ref_loss, ref), (loss, got) = runs
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)


def _add_norm_hooks(model: nn.Module, kind: str, calls: list[str]) -> None:
    """Hooks on layer 0's input norm (on every norm weight for ``weight``), appending to ``calls`` as they fire."""
    norm = _norm(model)
    if kind == "pre":  # changes the input
        norm.register_forward_pre_hook(lambda m, args: calls.append("pre") or (args[0] * 2,))
    elif kind == "forward-in-place":  # changes the output in place
        norm.register_forward_hook(lambda m, args, out: calls.append("fwd") or out.mul_(2))
    elif kind == "backward":
        norm.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append("bw") or (grad_in[0] * 3,))
        norm.register_full_backward_pre_hook(lambda m, grad_out: calls.append("bwpre") or (grad_out[0] * 5,))
    else:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.register_hook(lambda g, name=name: calls.append(name) or g * 2)
                p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append("acc " + name))


@pytest.mark.parametrize("kind", ["pre", "forward-in-place", "backward", "weight"])
def test_hooks_on_a_tiled_norm_act_once_as_untiled(kind: str) -> None:
    """float64, 3 row tiles: loss, every grad and the hooks' calls as unpatched."""
    runs = []
    for patched in (False, True):
        model = build("llama")
        if patched:
            tiledmlp.patch(model, num_shards=3, norms=3)
        calls: list[str] = []
        _add_norm_hooks(model, kind, calls)
        runs.append((*loss_and_grads(model, IDS), sorted(calls)))
    (ref_loss, ref, ref_calls), (loss, got, calls) = runs
    assert _norm(model).forward.last_num_tiles == 3
    assert_rel(loss, ref_loss, 1e-12, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
    assert calls == ref_calls and calls


def test_hooks_on_the_head_under_the_tiled_loss_run_once() -> None:
    """A hook on lm_head's weight runs once on its summed grad (x2: that grad doubles), as does a full backward hook
    scaling the grad of the head's input (x4: every other grad too); float64 against the hookless tiled run (powers
    of two: the norms' float32 steps round a scaled grad alike)."""
    model = build("llama")
    tiledmlp.patch(model, loss=True, norms=False)
    _, ref = loss_and_grads(model, IDS)
    calls: list[str] = []
    model.lm_head.weight.register_hook(lambda g: calls.append("weight") or g * 2)
    model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: calls.append("accumulated"))
    model.lm_head.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append("bw") or (grad_in[0] * 4,))
    _, got = loss_and_grads(model, IDS)
    assert sorted(calls) == ["accumulated", "bw", "weight"]
    for name in ref:
        assert_rel(got[name], ref[name] * (2 if name == "lm_head.weight" else 4), 1e-12, name)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch notes a hooked call with no grad inputs
def test_split_layers_fire_the_layers_hooks_as_whole_layer_checkpoints() -> None:
    """Hooks on a layer and its children fire as with whole-layer checkpoints (the layer's outside the checkpoint,
    its children's again in the recompute) once checkpoints recompute all (early stop off: by default the attention
    half's recompute stops inside attention, so its forward hook fires once, not twice)."""
    counts = []
    for split in (False, True):
        model = build("llama")
        enable_checkpointing(model, {"use_reentrant": False})
        calls: list[str] = []
        layer = model.model.layers[1]
        for name in ("", "input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            child = layer.get_submodule(name)
            child.register_forward_pre_hook(lambda *a, name=name: calls.append("pre " + name))
            child.register_forward_hook(lambda *a, name=name: calls.append("fwd " + name))
            child.register_full_backward_hook(lambda *a, name=name: calls.append("bw " + name))
        with tiledmlp.offload_activations(model, split_layers=split), \
                torch.utils.checkpoint.set_checkpoint_early_stop(False):
            loss_and_grads(model, IDS)
        counts.append(sorted(calls))
    assert counts[0] == counts[1]
    assert counts[0].count("fwd self_attn") == 2 and counts[0].count("pre ") == 1
