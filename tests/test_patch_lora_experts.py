"""PEFT's LoRA on MoE experts' 3-D parameters (``target_parameters``): PEFT registers a parametrization around its
call of the experts and removes it before the backward. Such experts used to run untiled, with a warning (a tile
recomputed in the backward would have read the bare weight); they are now tiled, and every grad (LoRA factors,
attention LoRA, router, base weights made trainable, the input) equals the untiled float64 reference."""

from __future__ import annotations

import copy
import warnings
from typing import Callable, TypeVar

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import tiledmlp
from conftest import assert_rel, rel_err
from models import build
from tiledmlp.patching import TiledForward

SHARDS = 3
T = TypeVar("T")
EXPERT_PARAMS = ["gate_up_proj", "down_proj"]


def _lora(model: nn.Module, prefix: str = "mlp.experts.", modules: tuple[str, ...] = ("q_proj",)) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # init_lora_weights=False: non-zero B, so the adapters change the forward and every grad
    config = LoraConfig(r=4, target_modules=list(modules), target_parameters=[prefix + p for p in EXPERT_PARAMS],
                        init_lora_weights=False)
    return get_peft_model(model, config).double()


def _tiled(model: nn.Module) -> list[TiledForward]:
    return [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]


def _step(model: nn.Module, ids: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Loss (with the router's aux loss), every parameter grad and the input-embedding grad of one step."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, embeds.grad


def _assert_same(got: tuple, ref: tuple) -> float:
    """Loss, grads and input grad equal to 1e-12 (relative); returns the largest absolute grad difference."""
    assert_rel(got[0], ref[0], 1e-12, "loss")
    assert got[1].keys() == ref[1].keys()
    for name, g in got[1].items():
        assert_rel(g, ref[1][name], 1e-12, name)
    assert_rel(got[2], ref[2], 1e-12, "input grad")
    return max((got[2] - ref[2]).abs().max().item(), *((g - ref[1][n]).abs().max().item() for n, g in got[1].items()))


def _no_tiledmlp_warning(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, asserting that tiledmlp warned of nothing (its untiled fallback warns)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn(*args)
    assert not [w for w in seen if "tiledmlp" in str(w.message)], [str(w.message) for w in seen]
    return out


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_lora_on_expert_parameters_is_tiled_exactly(family: str, batch: int) -> None:
    """LoRA on the fused 3-D expert weights and on q_proj, the router trainable: the experts run 3 uneven tiles and
    every grad equals the untiled one (before: 1 tile and a warning)."""
    ids = torch.randint(0, 96, (batch, 23), generator=torch.Generator().manual_seed(0))  # 23 or 46 tokens: uneven
    model = _lora(build(family))
    for name, p in model.named_parameters():
        if name.endswith((".gate.weight", ".router.weight", ".router.bias")):
            p.requires_grad_(True)
    ref = _step(copy.deepcopy(model), ids)
    assert sum("experts" in n and "lora_" in n for n in ref[1]) == 4 * len(EXPERT_PARAMS)  # 2 layers x A, B
    assert any(n.endswith(("gate.weight", "router.weight")) for n in ref[1])
    tiledmlp.patch(model, num_shards=SHARDS, norms=False)
    got = _no_tiledmlp_warning(_step, model, ids)
    assert [t.last_num_tiles for t in _tiled(model)] == [SHARDS, SHARDS]
    print(f"{family} bs {batch}: {SHARDS} tiles, max abs grad diff {_assert_same(got, ref):.1e}")


@pytest.mark.parametrize("order", ["patch-then-lora", "lora-then-patch"])
def test_trainable_base_expert_weights_get_their_grads_through_the_parametrization(order: str) -> None:
    """The bare 3-D weights trainable too (LoRA's base frozen is the usual case, not the only one): their grads
    come through the recomputed parametrization, once per backward, whichever was applied first."""
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1))
    base = build("qwen3-moe")
    ref_model = _lora(copy.deepcopy(base))
    if order == "patch-then-lora":
        tiledmlp.patch(base, num_shards=SHARDS, norms=False)
    model = _lora(base)
    tiledmlp.patch(model, num_shards=SHARDS, norms=False)  # options updated where patched already
    for m in (ref_model, model):
        for name, p in m.named_parameters():
            if name.endswith(tuple(EXPERT_PARAMS)):
                p.requires_grad_(True)
    ref = _step(ref_model, ids)
    assert sum(n.endswith(tuple(EXPERT_PARAMS)) for n in ref[1]) == 4
    got = _no_tiledmlp_warning(_step, model, ids)
    assert [t.last_num_tiles for t in _tiled(model)] == [SHARDS, SHARDS]
    _assert_same(got, ref)


@pytest.mark.parametrize("base_trainable", [False, True])
def test_lora_experts_under_activation_checkpointing(base_trainable: bool) -> None:
    """With gradient checkpointing the layer is run again in the backward, PEFT registering its parametrization
    again: the grads still equal the untiled ones."""
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(2))
    model = _lora(build("mixtral"))
    for name, p in model.named_parameters():
        if base_trainable and name.endswith(tuple(EXPERT_PARAMS)):
            p.requires_grad_(True)
    ref = _step(copy.deepcopy(model), ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiledmlp.patch(model, num_shards=SHARDS, norms=False)
    got = _no_tiledmlp_warning(_step, model, ids)
    assert [t.last_num_tiles for t in _tiled(model)] == [SHARDS, SHARDS]
    _assert_same(got, ref)


class DropoutExperts(nn.Module):
    """Routed experts with fused 3-D weights (as transformers' ``...Experts``) and a dropout inside each expert."""

    def __init__(self, experts: int = 4, hidden: int = 8, inner: int = 12) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)
        self.dropout = nn.Dropout(0.3)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eoh->teo", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        inner = self.dropout(nn.functional.silu(gate) * up)
        every = torch.einsum("tei,ehi->teh", inner, self.down_proj)
        chosen = every.gather(1, top_k_index[..., None].expand(-1, -1, every.shape[-1]))
        return (chosen * top_k_weights[..., None]).sum(1)


class DropoutMoeBlock(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, 4, bias=False)
        self.experts = DropoutExperts(hidden=hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x.reshape(-1, x.shape[-1]), index.reshape(-1, 2), weights.reshape(-1, 2)).view(x.shape)


def _same_tiles(experts: nn.Module, splits: list[int]) -> None:
    """Make unpatched experts run the patched one's tiles, in order, with a full graph: the same dropout masks."""
    forward = type(experts).forward

    def tiles(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.cat([forward(experts, *cut) for cut in zip(x.split(splits), index.split(splits),
                                                                  weights.split(splits))])

    experts.forward = tiles


def _dropout_step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, x.grad


@pytest.mark.parametrize("batch", [1, 2])
def test_dropout_inside_lora_experts_replays_its_masks(batch: int) -> None:
    """PEFT refuses lora_dropout on parameters, but the experts may draw random numbers themselves: each tile's
    recompute, parametrization restored, redraws the mask it drew in the forward (reference: the same tiles run
    with a full graph from the same seed)."""
    torch.manual_seed(0)
    model = _lora(DropoutMoeBlock().double(), prefix="experts.", modules=("gate",))
    ref_model = copy.deepcopy(model)
    x = torch.randn(batch, 11, 8, dtype=torch.float64)
    splits = tiledmlp.plan_shards(batch * 11, num_shards=SHARDS)
    assert len(set(splits)) > 1
    _same_tiles(ref_model.base_model.model.experts.get_base_layer(), splits)
    tiledmlp.patch(model, num_shards=SHARDS, norms=False)
    got, ref = _no_tiledmlp_warning(_dropout_step, model, x, 7), _dropout_step(ref_model, x, 7)
    assert [t.last_num_tiles for t in _tiled(model)] == [SHARDS]
    assert sum("lora_" in n for n in ref[1]) == 6  # experts' two weights and the router, A and B each
    _assert_same(got, ref)
    other = _dropout_step(ref_model, x, 8)  # other masks give clearly other grads: the comparison sees the masks
    assert rel_err(other[2], ref[2]) > 0.01


class _Scale(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, size, dtype=torch.float64))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale[:, None]


def test_lasting_parametrization_is_tiled_and_a_changed_one_refused() -> None:
    """A parametrization registered for good (weight scaling here; weight_norm alike) is tiled too, its own
    parameters getting their grads; one changed between the forward and the backward cannot be recomputed."""
    mlp = build("llama").model.layers[0].mlp
    parametrize.register_parametrization(mlp.up_proj, "weight", _Scale(mlp.up_proj.out_features))
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    ref_model = copy.deepcopy(mlp)
    ref = _dropout_step(ref_model, x, 0)
    tiledmlp.patch(mlp, num_shards=SHARDS)
    got = _no_tiledmlp_warning(_dropout_step, mlp, x, 0)
    assert mlp.forward.last_num_tiles == SHARDS and mlp.forward.path() == "generic"
    assert any("parametrizations.weight.0.scale" in n for n in got[1])
    _assert_same(got, ref)
    out = mlp(x.requires_grad_())
    parametrize.register_parametrization(mlp.up_proj, "weight", _Scale(mlp.up_proj.out_features))
    with pytest.raises(RuntimeError, match="parametrization of .*Linear.weight changed between the forward and"):
        out.sum().backward()
