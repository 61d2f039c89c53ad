"""Finding and wrapping modules across model families: cases that had been tiled wrongly, crashed after a report
that said they were tiled, or were never tiled while the report said they were."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import tiledmlp
from conftest import assert_rel
from models import build, loss_and_grads
from tiledmlp.patching import TiledForward


def _grads(module: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = module(*inputs)
    out = getattr(out, "last_hidden_state", out)
    params = [p for p in module.parameters() if p.requires_grad]
    return out.detach(), list(torch.autograd.grad(out.square().sum(), params, allow_unused=True))


def _assert_same(got: tuple, ref: tuple) -> None:
    assert_rel(got[0], ref[0], 1e-12, "output")
    for g, r in zip(got[1], ref[1]):
        assert (g is None) == (r is None)
        if r is not None:
            assert_rel(g, r, 1e-12)


def test_tiled_mlp_refuses_what_patch_skips() -> None:
    """TiledMLP(moe_block) had tiled a Qwen3-MoE block whole: its router ran per tile, and the router's weight grad
    came out 85% off (the loss unchanged); patch() skips such a block and tiles its experts."""
    block = build("qwen3-moe").model.layers[0].mlp
    with pytest.raises(ValueError, match="TiledMLP cannot tile this Qwen3MoeSparseMoeBlock: sparse MoE block"):
        tiledmlp.TiledMLP(block, num_shards=2)
    tiledmlp.TiledMLP(block.experts, num_shards=2)  # its routed experts are what to wrap
    with pytest.raises(ValueError, match="forward needs 2 positional inputs"):
        tiledmlp.TiledMLP(_TwoInputMLP(), num_shards=2)  # had run untiled at every call without a word


class _TwoInputMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale


def _llama4_vision() -> nn.Module:
    config = tf.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                   image_size=32, patch_size=4, projector_input_dim=32, projector_output_dim=32,
                                   vision_output_dim=32, pixel_shuffle_ratio=0.5, rope_theta=10000)
    torch.manual_seed(0)
    return tf.models.llama4.modeling_llama4.Llama4VisionModel(config).double()


def test_an_mlp_that_moves_tokens_is_skipped_with_the_reason() -> None:
    """Llama-4's vision adapter (Llama4VisionPixelShuffleMLP) pixel-shuffles its patches into a square grid: patched,
    the vision model raised "shape '[1, 5, 5, -1]' is invalid" on a 32-patch tile, after a report listing it tiled."""
    model = _llama4_vision()
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _grads(model, pixels)
    report = tiledmlp.patch(model, num_shards=4, norms=False)
    assert [(n, c) for n, c, _ in report.patched] == [("model.layers.0.mlp", "Llama4VisionMLP")]
    ((name, cls, reason),) = report.skipped
    assert (name, cls) == ("vision_adapter", "Llama4VisionPixelShuffleMLP") and "not token-wise" in reason
    assert "pixel_shuffle" in reason and "pixel_shuffle" in str(report)
    _assert_same(_grads(model, pixels), ref)
    assert model.model.layers[0].mlp.forward.last_num_tiles == 4


class _ChannelsFirstMLP(nn.Module):
    """A pointwise MLP of 1x1 convolutions over ``[B, C, L]`` (as Sam3-LiteText's ConvMLP over feature maps)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv1d(8, 16, 1), nn.Conv1d(16, 8, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(hidden_states)))


class _MixerMLP(nn.Module):
    """GroupViT's token mixer: an MLP across the 8 tokens (``x.transpose(1, 2)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("cls, uses", [(_ChannelsFirstMLP, "Conv1d"), (_MixerMLP, "transpose")])
def test_convolutions_and_transposes_are_not_tiled(cls: type, uses: str) -> None:
    """Their channels (or tokens) sit where a tile cuts: patched, they had raised at the first tiled call."""
    model = nn.ModuleDict({"mlp": cls(), "ok": _PlainMLP()}).double()
    x = torch.randn(2, 8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = _grads(model["mlp"], x)
    report = tiledmlp.patch(model, num_shards=4)
    assert report.patched == [("ok", "_PlainMLP", "generic")]
    assert report.skipped[0][:2] == ("mlp", cls.__name__) and uses in report.skipped[0][2]
    _assert_same(_grads(model["mlp"], x), ref)
    tiledmlp.register_mlp(cls)  # a user who knows better can still have it tiled (and own the result)
    try:
        assert ("mlp", cls.__name__, "generic") in tiledmlp.patch(model, num_shards=2).patched
    finally:
        from tiledmlp.architectures import _REGISTRY

        _REGISTRY.pop(cls.__name__)


class _PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _zamba2() -> nn.Module:
    config = tf.Zamba2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=96, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8,
                             layers_block_type=["mamba", "hybrid"], adapter_rank=4, attention_head_dim=16,
                             num_mem_blocks=1, use_mem_rope=False)
    torch.manual_seed(0)
    return tf.Zamba2ForCausalLM(config).double().train()


def test_an_mlp_called_with_a_layer_index_is_tiled() -> None:
    """Zamba2's shared MLP is called as ``feed_forward(hidden_states, layer_idx)``: the extra argument had sent every
    call to the untiled forward (0 tiles), while the report listed the MLP as tiled."""
    model = _zamba2()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    ref_loss, ref = loss_and_grads(model, ids)
    report = tiledmlp.patch(model, num_shards=3, norms=False)
    assert [c for _, c, _ in report.patched] == ["Zamba2MLP"]
    loss, got = loss_and_grads(model, ids)
    tiled = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]
    assert [m.forward.last_num_tiles for m in tiled] == [3]
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)


def test_tensor_or_mutable_extra_arguments_still_run_untiled() -> None:
    """Only immutable constants are handed to every tile: a tensor (it may be per token) or a list (a call may
    change it) still runs the module's own forward, as before."""

    class ScaledMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, scale: object = 1.0) -> torch.Tensor:
            if isinstance(scale, list):
                scale.append(len(scale))
                scale = float(len(scale))
            return self.fc(x) * scale

    mlp = ScaledMLP().double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    ref = {k: mlp(x, v) for k, v in (("const", 2.0), ("tensor", torch.full((2, 9, 1), 2.0, dtype=torch.float64)))}
    tiledmlp.patch(mlp, num_shards=3)
    assert_rel(mlp(x, 2.0), ref["const"], 1e-12)
    assert mlp.forward.last_num_tiles == 3
    mlp.forward.last_num_tiles = 0
    assert_rel(mlp(x, torch.full((2, 9, 1), 2.0, dtype=torch.float64)), ref["tensor"], 1e-12)
    calls: list[int] = []
    mlp(x, calls)
    assert calls == [0] and mlp.forward.last_num_tiles == 0


def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # init_lora_weights=False: non-zero B, so the adapters change the forward and every grad
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], init_lora_weights=False)
    return get_peft_model(model, config).double()


@pytest.mark.parametrize("order", ["patch-then-lora", "lora-then-patch"])
def test_lora_on_moe_expert_weights_keeps_every_grad(order: str) -> None:
    """PEFT puts LoRA on Qwen3-MoE's 3-D expert weights by wrapping the experts and parametrizing them only while it
    calls them: a tile recomputed in the backward read the bare weights, so the experts' LoRA factors got no grad
    at all and the attention's LoRA grads came out 52-75% off (the loss unchanged). Such experts then ran untiled;
    each tile's recompute now restores the parametrization, so they are tiled with every grad exact."""
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    base = build("qwen3-moe")
    ref_loss, ref = loss_and_grads(_lora(copy.deepcopy(base)), ids)
    assert any("experts.lora_A" in name for name in ref)
    if order == "patch-then-lora":
        tiledmlp.patch(base, num_shards=3, norms=False)
        model = _lora(base)
    else:
        model = _lora(base)
        tiledmlp.patch(model, num_shards=3, norms=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tiledmlp")  # no untiled fallback
        loss, got = loss_and_grads(model, ids)
    tiled = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]
    assert [t.last_num_tiles for t in tiled] == [3, 3]
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == ref.keys()
    for name in ref:
        assert_rel(got[name], ref[name], 1e-12, name)
