"""A patched model as users go on handling it: a loss function, a hook or an adapter on the head added after
patching, accelerate's hooks added after patching, patching again, a refused loss. Each had given a wrong loss,
a misleading error or a model left half patched."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from transformers.loss.loss_utils import ForCausalLMLoss

import tiledmlp
from conftest import rel_err
from models import build, loss_and_grads
from tiledmlp.norms import FORWARD_SLOTS, TiledNormForward
from tiledmlp.patching import TiledForward

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


def _z_loss(logits, labels, vocab_size, **kwargs):  # cross-entropy plus a z-loss: not transformers' own
    return ForCausalLMLoss(logits, labels, vocab_size, **kwargs) + 1e-2 * torch.logsumexp(logits, -1).pow(2).mean()


def _tiled(model: torch.nn.Module) -> list[tuple[str, str]]:
    return [(name, slot) for name, m in model.named_modules() for slot in FORWARD_SLOTS
            if isinstance(m.__dict__.get(slot), (TiledForward, TiledNormForward))]


def test_a_loss_function_set_after_patching_is_refused_at_the_call() -> None:
    """It had been replaced by plain cross-entropy without a word (4.6025 vs 4.8117 with a z-loss)."""
    model = build("llama")
    tiledmlp.patch(model, loss=True)
    model.loss_function = _z_loss
    with pytest.raises(ValueError, match="changed after patch_loss .* custom loss_function"):
        model(input_ids=IDS, labels=IDS)
    with pytest.raises(ValueError, match="custom loss_function"):  # and before patching, as it was
        tiledmlp.patch_loss(model)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_on_the_head_that_changes_its_output_is_refused(when: str) -> None:
    """A forward hook on lm_head (a temperature: logits / 2) had been applied to the scalar loss: 2.29 vs 4.57. A
    hook that only looks sees the loss and changes nothing; a backward pre-hook (it would get the loss's gradient)
    is refused at patch time, before anything is patched."""
    model, reference = build("llama"), build("llama")
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dim()))
    if when == "before":
        tiledmlp.patch(model, loss=True)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out / 2)
    if when == "after":
        tiledmlp.patch(model, loss=True)
    with pytest.raises(ValueError, match="a forward hook on lm_head changed what it returned"):
        model(input_ids=IDS, labels=IDS)
    handle.remove()
    loss, _ = loss_and_grads(model, IDS)
    ref_loss, _ = loss_and_grads(reference, IDS)
    assert seen[-1] == 0 and abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()

    hooked = build("llama")
    hooked.lm_head.register_full_backward_pre_hook(lambda module, grad_output: None)
    with pytest.raises(ValueError, match=r"lm_head has a backward pre-hook \(.*<lambda>\)"):
        tiledmlp.patch(hooked, loss=True)
    assert not _tiled(hooked)


def test_a_lora_adapter_on_the_head_added_after_patching_is_named() -> None:
    """The call had failed with 'loss_function was not handed the tiled loss', which names nothing to change."""
    from peft import LoraConfig, get_peft_model

    model = build("llama")
    tiledmlp.patch(model, loss=True)
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match="A LoRA adapter on lm_head is not supported"):
        peft(input_ids=IDS, labels=IDS)


def test_a_refused_loss_leaves_the_model_unpatched() -> None:
    """A loss the tiled loss cannot stand in for (a custom ``loss_function``; GPT-2's, until 2026-11-29):
    patch(loss=True) had raised with the MLPs already tiled."""
    model = build("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().logsumexp(-1).mean()
    with pytest.raises(ValueError, match="custom loss_function"):
        tiledmlp.patch(model, loss=True)
    assert not _tiled(model)
    assert len(tiledmlp.patch(model)) == 2 and _tiled(model)  # its MLPs alone it tiles


def test_accelerate_hooks_added_after_patching_unpatch_and_repatch() -> None:
    """dispatch_model / cpu_offload on a patched model move the tiled forwards into ``_old_forward``: unpatch had
    left them there (returned 1: the loss only) and patching again nested tiles in tiles."""
    reference, model = build("llama"), build("llama")
    tiledmlp.patch(model, num_shards=3, loss=True, norms=2)
    for module in model.modules():
        if type(module).__name__ in ("LlamaMLP", "LlamaRMSNorm"):
            add_hook_to_module(module, AlignDevicesHook(execution_device="cpu"))
    assert all(slot == "_old_forward" for _, slot in _tiled(model)) and len(_tiled(model)) == 2 * 3 + 1
    report = tiledmlp.patch(model, num_shards=2)  # options reach the tiled forwards under the hooks
    assert all("already patched" in how for _, _, how in report.patched) and len(report.patched) == 2
    assert model.model.layers[0].mlp._old_forward.options.num_shards == 2
    ref_loss, ref = loss_and_grads(reference, IDS)
    loss, got = loss_and_grads(model, IDS)
    assert model.model.layers[0].mlp._old_forward.last_num_tiles == 2
    # transformers' loss rounds the logits to float32: that rounding is the whole difference
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert got.keys() == ref.keys() and all(rel_err(got[n], ref[n]) <= 1e-6 for n in ref)
    assert tiledmlp.unpatch(model) == 1 + 2 + 5 and not _tiled(model)
    loss, got = loss_and_grads(model, IDS)  # plain again, through the hooks
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[n], ref[n]) for n in ref)


def test_patch_with_loss_keeps_what_patch_loss_set() -> None:
    """patch(loss=True) after patch_loss(label_smoothing=0.1, tile_eval=True) had reset both (the loss changed)."""
    model = build("llama")
    tiledmlp.patch_loss(model, num_shards=3, label_smoothing=0.1, tile_eval=True)
    smoothed = model(input_ids=IDS, labels=IDS).loss.detach()
    tiledmlp.patch(copy.deepcopy(model), loss=True)  # a copy: deep copies keep their own forwards
    tiledmlp.patch(model, num_shards=2, loss=True, accumulate_dtype="param")
    forward = model.forward
    assert (forward.num_shards, forward.label_smoothing, forward.tile_eval, forward.accumulate_dtype) == \
        (3, 0.1, True, "param")
    torch.testing.assert_close(model(input_ids=IDS, labels=IDS).loss.detach(), smoothed, rtol=1e-12, atol=0)


def test_train_plans_the_loss_tiles_itself() -> None:
    """--tiled_mlp_num_shards 4 had also cut the loss into 4 tiles of [tokens / 4, vocab] float32 logits."""
    from tiledmlp.train.args import TilingArguments
    from tiledmlp.train.runner import _apply_tiled_loss

    model = build("llama")
    _apply_tiled_loss(model, TilingArguments(tiled_mlp_num_shards="4"), 0.0, False)
    assert model.forward.num_shards == "auto"
