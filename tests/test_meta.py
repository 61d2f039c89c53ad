"""A patched model on the ``meta`` device (a shape-only dry run, as tracing and FLOP counters do) runs as the unpatched
one does: same output shapes and dtypes, grads of the right shapes, and nothing allocated. Before, the GLU path asked
``torch.is_autocast_enabled("meta")``, which raises, and LoRA dropout asked for a ``torch.meta`` generator."""

from __future__ import annotations

import copy

import pytest
import torch

import tiledmlp
from models import build
from tiledmlp.bench.configs import build_mlp

META = torch.device("meta")


def _shapes(module: torch.nn.Module, x: torch.Tensor) -> tuple:
    x = x.detach().requires_grad_()
    out = module(x)
    out.sum().backward()
    grads = {n: (p.grad.shape, p.grad.dtype, p.grad.device.type) for n, p in module.named_parameters()
             if p.grad is not None}
    return out.shape, out.dtype, out.device.type, x.grad.shape, x.grad.dtype, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gpt2", "swiglu-lora", "swiglu-lora-dropout", "swiglu-fused"])
@pytest.mark.parametrize("shards", [3, "auto"])
def test_patched_mlp_on_meta_gives_the_unpatched_shapes(kind: str, dtype: torch.dtype, shards: object) -> None:
    plain = build_mlp(kind, 64, 192, dtype).to(META).train()
    tiled = copy.deepcopy(plain)
    report = tiledmlp.patch(tiled, num_shards=shards)
    assert report.patched, "the MLP must be patched for this test to say anything"
    x = torch.empty(2, 300, 64, dtype=dtype, device=META)
    got, want = _shapes(tiled, x), _shapes(plain, x)
    assert got == want
    assert got[2] == "meta" and got[5], "grads of the trained weights, on meta"


@pytest.mark.parametrize("shards", [3, "auto"])
def test_patched_moe_block_on_meta_gives_the_unpatched_shapes(shards: object) -> None:
    """The bench's MoE block (its experts on transformers' grouped matmul, whose meta kernel takes bf16 only, the
    unpatched block's too): patched, its experts are tiled and the shapes are the unpatched ones."""
    plain = build_mlp("moe", 64, 192, torch.bfloat16).to(META).train()
    tiled = copy.deepcopy(plain)
    assert tiledmlp.patch(tiled, num_shards=shards).patched == [("experts", "Qwen3MoeExperts", "generic")]
    x = torch.empty(2, 300, 64, dtype=torch.bfloat16, device=META)
    got, want = _shapes(tiled, x), _shapes(plain, x)
    assert got == want and sorted(got[5]) == ["experts.down_proj", "experts.gate_up_proj", "gate.weight"]


def test_patched_causal_lm_on_meta_runs_mlps_norms_and_loss() -> None:
    """MLPs, row-tiled norms and the loss patched: a meta forward with labels and its backward run as unpatched (the
    loss falls back to the model's own: on meta it costs nothing)."""
    plain = build("llama", torch.float32).to(META)
    tiled = copy.deepcopy(plain)
    tiledmlp.patch(tiled, num_shards=3)
    tiledmlp.patch_loss(tiled)
    ids = torch.zeros(2, 40, dtype=torch.long, device=META)
    outs = {}
    for name, model in (("plain", plain), ("tiled", tiled)):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs[name] = (out.loss.shape, out.loss.device.type,
                      sorted((n, p.grad.shape) for n, p in model.named_parameters() if p.grad is not None))
    assert outs["tiled"] == outs["plain"]
    assert len(outs["tiled"][2]) == len(list(tiled.parameters()))
    assert tiled.model.layers[0].mlp.forward.last_num_tiles == 3  # the tiled MLP ran


def test_tiled_loss_on_meta_hidden_states_names_the_fix() -> None:
    """Called directly on meta tensors, the tiled loss refuses with its own error (was autocast's RuntimeError)."""
    hidden = torch.empty(2, 8, 16, device=META)
    weight = torch.empty(32, 16, device=META)
    labels = torch.zeros(2, 8, dtype=torch.long, device=META)
    with pytest.raises(ValueError, match="one real device"):
        tiledmlp.tiled_causal_lm_loss(hidden, weight, labels)
