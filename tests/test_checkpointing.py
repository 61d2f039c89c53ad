"""Activation checkpointing and saved-tensor hooks: nothing kept out of the hooks' reach, and no needless recompute.

Grads under checkpointing are checked against the unpatched checkpointed model in test_training_modes.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tiledmlp
from models import build
from tiledmlp import glu
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.measure import profiler_peak_bytes

SHARDS = 4


def _count_gate_up(monkeypatch) -> list[int]:
    calls = [0]
    original = glu.GLUWeights.gate_up

    def counting(self, x, *masks):
        calls[0] += 1
        return original(self, x, *masks)

    monkeypatch.setattr(glu.GLUWeights, "gate_up", counting)
    return calls


def _checkpointed(arch: str, reentrant: bool) -> nn.Module:
    model = build(arch)
    enable_checkpointing(model, {"use_reentrant": reentrant})
    tiledmlp.patch(model, num_shards=SHARDS)
    return model


@pytest.mark.parametrize("arch,reentrant,per_layer", [
    ("llama", False, (SHARDS, 0, SHARDS)),  # the recompute stops at the MLP's input: the MLP is not rerun
    ("gemma2", False, (SHARDS, SHARDS, SHARDS)),  # its post-feed-forward norm saves the MLP output: rerun
    ("llama", True, (SHARDS, SHARDS, SHARDS - 1)),  # reentrant: forward without grad; recompute keeps a tile
])
def test_checkpoint_recompute_runs_the_tiled_mlp_only_when_needed(monkeypatch, arch, reentrant, per_layer):
    """gate/up tile computations per layer in (forward, checkpoint recompute, tiled backward)."""
    calls = _count_gate_up(monkeypatch)
    model = _checkpointed(arch, reentrant)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 96, (2, 36))
    loss = model(input_ids=ids, labels=ids).loss
    assert calls[0] == per_layer[0] * layers
    loss.backward()
    assert calls[0] == sum(per_layer) * layers


def test_generic_path_skips_the_recompute_too():
    """GPT-2 (generic engine): c_fc runs once per tile in the forward and once per tile in the backward."""
    model = _checkpointed("gpt2", reentrant=False)
    calls = [0]
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(0, 96, (2, 36))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2 * SHARDS


def _kept_nodes(loss: torch.Tensor) -> tuple[int, int]:
    """(GLU nodes, GLU nodes holding a kept tile) in the graph of ``loss``."""
    seen, stack, nodes, kept = set(), [loss.grad_fn], 0, 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "kept"):
            nodes += 1
            kept += node.kept is not None
        stack.extend(n for n, _ in node.next_functions)
    return nodes, kept


@pytest.mark.parametrize("mode", ["plain", "checkpoint", "save_on_cpu"])
def test_no_tile_kept_by_reference_under_saved_tensor_hooks(mode):
    """Hooks (checkpointing, CPU offload) must see everything the backward keeps; without hooks the last tile's
    gate/up are kept (it saves recomputing them)."""
    model = build("llama")
    tiledmlp.patch(model, num_shards=SHARDS)
    if mode == "checkpoint":
        enable_checkpointing(model, {"use_reentrant": False})
    ids = torch.randint(0, 96, (2, 36))
    with torch.autograd.graph.save_on_cpu() if mode == "save_on_cpu" else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    nodes, kept = _kept_nodes(loss)
    assert nodes == model.config.num_hidden_layers
    assert kept == (nodes if mode == "plain" else 0)
    loss.backward()


def test_checkpointed_stack_memory_grows_by_the_layer_inputs_only():
    """8 vs 2 checkpointed SwiGLU blocks (2048 tokens, 4 tiles): the peak grows by what checkpointing keeps per
    block, its input. (A tile kept by reference added 2 MiB per block here: 4x the input.)"""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    tokens, hidden = 2048, 64

    def peak(num_layers: int, tiled: bool) -> int:
        torch.manual_seed(0)
        mlps = nn.ModuleList(LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=512))
                             for _ in range(num_layers))
        if tiled:
            tiledmlp.patch(mlps, num_shards=SHARDS)
        x = torch.randn(1, tokens, hidden, requires_grad=True)

        def step() -> None:
            h = x
            for mlp in mlps:
                h = h + checkpoint(mlp, h, use_reentrant=False)
            h.sum().backward()

        return profiler_peak_bytes(step, device="cpu")

    input_bytes = tokens * hidden * 4
    for tiled in (False, True):
        growth = (peak(8, tiled) - peak(2, tiled)) / 6
        assert growth <= 1.05 * input_bytes, f"tiled={tiled}: {growth / 2**20:.2f} MiB per block"
    assert peak(8, True) < peak(8, False)
