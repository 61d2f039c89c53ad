"""Modes that must compose with patching: LoRA (PEFT), activation checkpointing, torch.compile."""

from __future__ import annotations

import pytest
import torch

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from conftest import assert_rel
from models import build, loss_and_grads


def _ids(seq: int = 36) -> torch.Tensor:
    return torch.randint(0, 96, (2, seq))


@pytest.mark.parametrize("order", ["patch-then-peft", "peft-then-patch"])
def test_lora_adapters_get_exact_grads(order):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"],
                        lora_dropout=0.0, init_lora_weights=False)
    ids = _ids()
    ref_model = get_peft_model(build("llama"), config)
    ref_loss, ref = loss_and_grads(ref_model, ids)
    assert any("lora_A" in n for n in ref)
    if order == "patch-then-peft":
        base = build("llama")
        tiledmlp.patch(base, num_shards=3)
        model = get_peft_model(base, config)
    else:
        model = get_peft_model(build("llama"), config)
        report = tiledmlp.patch(model, num_shards=3)
        assert {p for _, _, p in report.patched} == {"glu"}, "PEFT LoRA projections are read by the GLU path"
    model.load_state_dict(ref_model.state_dict())
    loss, got = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3-moe"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(arch, reentrant):
    """Reference: the same checkpointed model unpatched (reentrant checkpointing itself drops the grads of
    hook-recorded router logits, tiled or not). Non-reentrant: llama/gpt2/qwen3-moe skip the tiled MLP in the
    recompute, gemma2 (post-feed-forward norm) reruns it (tests/test_checkpointing.py counts the calls)."""
    ids = _ids()
    model = build(arch)
    enable_checkpointing(model, {"use_reentrant": reentrant})
    ref_loss, ref = loss_and_grads(model, ids)
    tiledmlp.patch(model, num_shards=3)
    loss, got = loss_and_grads(model, ids)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)


def test_torch_compile_same_grads():
    """aot_eager runs dynamo and AOTAutograd around the tiled region (a graph break, by design); inductor gives
    the same grads too (3.6e-7 here) but compiling C++ takes minutes on 2 CPU cores, so it is not in the suite."""
    ids = _ids()
    model = build("llama", torch.float32)
    ref_loss, ref = loss_and_grads(model, ids)
    tiledmlp.patch(model, num_shards=3)
    compiled = torch.compile(model, backend="aot_eager")
    loss, got = loss_and_grads(compiled, ids)
    got = {name.removeprefix("_orig_mod."): g for name, g in got.items()}
    assert_rel(loss, ref_loss, 1e-5, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-5, name)
