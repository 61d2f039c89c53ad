"""A patched model across its life as users handle it: generation, compiling, hooks added on an MLP's activation.

A hook on ``act_fn`` had not sent the MLP down the generic path as a hook on a projection does: the GLU path
multiplied the activation's output by ``up`` in place, so what a forward hook kept (an interpretability probe) was
overwritten with ``act(gate) * up`` (1.01 relative error), and the compiled per-tile kernels (CUDA's default)
skipped a backward hook on it (grads up to 0.67 off, float64).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tiledmlp
from conftest import assert_rel
from models import build, loss_and_grads
from tiledmlp import pointwise

IDS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(params=[False, True], ids=["eager", "fused"])
def fused(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The per-tile kernels eager (CPU's default) and compiled (CUDA's default)."""
    pointwise.set_fused(request.param)
    try:
        yield request.param
    finally:
        pointwise.set_fused("auto")


def _hook_act(model: nn.Module, kind: str, seen: list[torch.Tensor]) -> None:
    """A user's hook on layer 0's activation, registered on ``model`` as it is."""
    act = model.model.layers[0].mlp.act_fn
    if kind == "record":  # keeps what the activation returned, as an interpretability probe does
        act.register_forward_hook(lambda m, args, out: seen.append(out))
    elif kind == "steer":
        act.register_forward_hook(lambda m, args, out: out * 2)
    else:
        act.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 3,))


@pytest.mark.parametrize("kind", ["record", "steer", "backward"])
def test_a_hook_on_the_activation_acts_and_sees_its_own_output(fused: bool, kind: str) -> None:
    """float64: loss and every grad as untiled with the same hook; what a hook recorded is the activation's output
    (per tile: the forward's tiles come first), not ``act(gate) * up`` written over it later."""
    reference, model = build("llama"), build("llama")
    ref_seen: list[torch.Tensor] = []
    _hook_act(reference, kind, ref_seen)
    ref_loss, ref = loss_and_grads(reference, IDS)
    tiledmlp.patch(model, num_shards=3, norms=False)
    seen: list[torch.Tensor] = []
    _hook_act(model, kind, seen)
    loss, got = loss_and_grads(model, IDS)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
    if kind == "record":
        width = ref_seen[0].shape[-1]
        forward_tiles = torch.cat([t.reshape(-1, width) for t in seen[:3]])
        assert_rel(forward_tiles, ref_seen[0].reshape(-1, width), 1e-12, "recorded activation")
    assert [layer.mlp.forward.path() for layer in model.model.layers] == ["generic", "glu"]  # hooked: called


@pytest.mark.parametrize("family", ["gpt2", "qwen3-moe"])
def test_a_hook_on_a_parameter_runs_once_on_the_generic_path(family: str) -> None:
    """``p.register_hook(lambda g: g * 2)`` (grad scaling, clipping by value): untiled it runs once per backward;
    on the generic path (GPT-2's MLP, MoE experts) it ran 4 times at 3 tiles (on each tile's grad, then on their
    sum) and the grads came out 2x (float64)."""
    runs = []
    for patched in (False, True):
        model = build(family)
        if patched:
            tiledmlp.patch(model, num_shards=3, norms=False)
        calls: list[str] = []
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name: calls.append(name) or g * 2)
        runs.append((*loss_and_grads(model, IDS), sorted(calls)))
    (ref_loss, ref, ref_calls), (loss, got, calls) = runs
    assert_rel(loss, ref_loss, 1e-12, "loss")
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
    assert calls == ref_calls


def _generate(model: nn.Module, prompt: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=6, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3-moe"])
def test_generate_with_padding_gives_the_same_tokens(family: str) -> None:
    """Batch of 2, one left-padded; greedy with the KV cache (1-token decode steps) and without, and sampling."""
    model = build(family, torch.float32).eval()
    model.config.output_router_logits = False  # transformers' aux loss fails on padded decode steps, tiled or not
    prompt = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0

    def runs() -> list[torch.Tensor]:
        torch.manual_seed(3)
        return [_generate(model, prompt, mask, do_sample=False), _generate(model, prompt, mask, use_cache=False),
                _generate(model, prompt, mask, do_sample=True, top_k=0)]

    ref = runs()
    tiledmlp.patch(model, num_shards=3, norms=2, loss=family == "llama")
    got = runs()
    for r, g in zip(ref, got):
        assert torch.equal(g, r)


def test_compiled_patched_model_grads_equal_eager_float64() -> None:
    """``torch.compile`` breaks its graph around the tiled calls, which run eagerly: loss and grads as the same
    patched model's uncompiled (aot_eager: Inductor's kernels round the RMSNorms' float32 steps otherwise than eager,
    tiled or not: 2e-7 here); ``fullgraph=True`` raises Dynamo's Unsupported (its wording and the call it stops at
    differ between torch 2.11 and 2.13) rather than tracing through the tiled calls."""
    eager, model = build("llama"), build("llama")
    for m in (eager, model):
        tiledmlp.patch(m, num_shards=3, loss=True, norms=2)
    ref_loss, ref = loss_and_grads(eager, IDS)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    model.model.layers[0].mlp.forward.last_num_tiles = 0
    loss = compiled(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert model.model.layers[0].mlp.forward.last_num_tiles == 3 and model.forward.last_used_tiled
    assert_rel(loss.detach(), ref_loss, 1e-12, "loss")
    for name, p in model.named_parameters():
        assert_rel(p.grad, ref[name], 1e-12, name)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=IDS)
