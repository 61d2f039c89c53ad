"""MLPs whose forward takes the residual they add (Bloom's and MPT's ``forward(hidden_states, residual)``, which
dropout-add it): ``patch()`` tiles them with the residual cut with the tokens, exactly; any other second input, or
a residual not shaped per token, stays untiled. Before, both families were skipped ("forward needs 2 positional
inputs") and ``patch()`` found no MLP in them at all."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import transformers as tf
from torch import nn

import tiledmlp
from conftest import assert_rel, rel_err

H, VOCAB, SHARDS = 32, 96, 3


def _bloom(dropout: float = 0.0, **extra: object) -> nn.Module:
    config = tf.BloomConfig(hidden_size=H, n_layer=2, n_head=4, vocab_size=VOCAB, hidden_dropout=dropout,
                            attention_dropout=dropout, **extra)
    return tf.BloomForCausalLM(config)


def _mpt(dropout: float = 0.0) -> nn.Module:
    model = tf.MptForCausalLM(tf.MptConfig(d_model=H, n_layers=2, n_heads=4, vocab_size=VOCAB, expansion_ratio=4))
    for block in model.transformer.blocks:  # MptAttentionConfig types attn_pdrop as int: set the float on the modules
        block.ffn.hidden_dropout = block.attn.attn_dropout_p = block.resid_attn_dropout.p = dropout
    return model


FAMILIES: dict[str, Callable[..., nn.Module]] = {"bloom": _bloom, "mpt": _mpt}
MLP_CLASS = {"bloom": "BloomMLP", "mpt": "MptMLP"}


def _build(family: str, dropout: float = 0.0, **extra: object) -> nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family](dropout, **extra).double().train()
    for p in model.parameters():  # LayerNorms and biases start as constants: randomise for sharper tests
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _mlps(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m).__name__ in MLP_CLASS.values()}


def _step(model: nn.Module, ids: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """Loss, parameter grads and input-embedding grad of one step from ``seed``, and the RNG state after it."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, embeds.grad, torch.get_rng_state()


def _assert_same_step(got: tuple, ref: tuple, model: nn.Module, what: str) -> float:
    """Loss, every parameter grad and the input-embedding grad of two steps equal to 1e-12; returns the worst
    relative error seen."""
    assert_rel(got[0], ref[0], 1e-12, f"{what} loss")
    assert got[1].keys() == ref[1].keys() == {n for n, _ in model.named_parameters()}, "every parameter has a grad"
    for name, g in got[1].items():
        assert_rel(g, ref[1][name], 1e-12, f"{what} grad of {name}")
    assert_rel(got[2], ref[2], 1e-12, f"{what} input-embedding grad")
    return max(rel_err(got[0], ref[0]), rel_err(got[2], ref[2]), *(rel_err(g, ref[1][n]) for n, g in got[1].items()))


def _patch_and_check(model: nn.Module, family: str) -> tiledmlp.PatchReport:
    report = tiledmlp.patch(model, num_shards=SHARDS)
    assert not report.skipped, str(report)
    assert [(n, c, p) for n, c, p in report.patched] == [(n, MLP_CLASS[family], "generic") for n in _mlps(model)]
    assert len(report) == 2, str(report)
    return report


def _ids(batch: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (batch, 13))  # 13 tokens a row: 3 uneven tiles (5+4+4 or 9+9+8)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_residual_mlp_tiled_exactly(family: str, batch: int) -> None:
    """Loss, every parameter grad and the input-embedding grad of the patched model equal the unpatched copy's."""
    model = _build(family)
    ref_model = copy.deepcopy(model)
    _patch_and_check(model, family)
    what = f"{family} b{batch}"
    ids = _ids(batch)
    got = _step(model, ids)
    assert [m.forward.last_num_tiles for m in _mlps(model).values()] == [SHARDS, SHARDS]
    worst = _assert_same_step(got, _step(ref_model, ids), model, what)
    print(f"{what}: worst relative error {worst:.2e}")


def test_bloom_residual_is_the_mlp_input() -> None:
    """Bloom's ``apply_residual_connection_post_layernorm`` passes the MLP's input as its residual too: one tensor
    as two tiled inputs, its grad the sum of both."""
    model = _build("bloom", apply_residual_connection_post_layernorm=True)
    ref_model = copy.deepcopy(model)
    _patch_and_check(model, "bloom")
    ids = _ids(2)
    worst = _assert_same_step(_step(model, ids), _step(ref_model, ids), model, "bloom aliased")
    print(f"bloom aliased residual: worst relative error {worst:.2e}")


def _same_tiles(mlp: nn.Module, num_tokens: int) -> None:
    """Make an unpatched MLP run the tiles the patched one runs, in order, with a full graph: its dropout masks are
    then the ones each tile of the patched model draws (the reference of tests/test_engine.py's dropout case)."""
    forward, splits = type(mlp).forward, tiledmlp.plan_shards(num_tokens, num_shards=SHARDS)

    def tiles(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        flat = zip(hidden.reshape(-1, hidden.shape[-1]).split(splits), residual.reshape(-1, H).split(splits))
        outs = [forward(mlp, h.unsqueeze(0), r.unsqueeze(0)).reshape(-1, H) for h, r in flat]
        return torch.cat(outs).view(residual.shape)

    mlp.forward = tiles


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_residual_mlp_dropout_replays_masks(family: str) -> None:
    """Train mode with dropout 0.3 in and around the MLPs, the same seed: the patched model's loss and grads equal
    the unpatched model's running the same tiles (same masks, drawn in the same order), and the backward's
    recompute leaves the caller's RNG where the reference leaves it."""
    model = _build(family, dropout=0.3)
    ref_model = copy.deepcopy(model)
    _patch_and_check(model, family)
    ids = _ids(2)
    for mlp in _mlps(ref_model).values():
        _same_tiles(mlp, ids.numel())
    what = f"{family} dropout"
    got, ref = _step(model, ids, seed=7), _step(ref_model, ids, seed=7)
    assert [m.forward.last_num_tiles for m in _mlps(model).values()] == [SHARDS, SHARDS]
    worst = _assert_same_step(got, ref, model, what)
    assert torch.equal(got[3], ref[3]), "the recompute must not move the caller's RNG"
    other = _step(ref_model, ids, seed=8)  # other masks give clearly other grads: the comparison sees the masks
    moved = rel_err(other[2], ref[2])
    assert moved > 0.01
    print(f"{what}: worst relative error {worst:.2e}; another seed's input grad differs by {moved:.2f}")


class _ResidualMLP(nn.Module):
    """``forward(x, residual)`` like Bloom's, counting its calls: a tiled call runs it once per tile."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.calls = nn.Linear(8, 32), nn.Linear(32, 8), 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.down(torch.nn.functional.gelu(self.up(x))) + residual


class _IndexedMLP(_ResidualMLP):
    """A second input that is no residual (VitPose's MoE MLP takes per-sample dataset ``indices``)."""

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, indices)


class _Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


@pytest.mark.parametrize("shapes", [((2, 6, 8), (2, 6, 8)), ((6, 8), (6, 8)), ((2, 6, 8), (2, 6, 1))],
                         ids=["bsh", "th", "per-token-scalar"])
def test_residual_cut_with_the_tokens(shapes: tuple) -> None:
    """A residual with the hidden states' token dims is cut with them (a per-token scalar broadcasts within its
    token), input and residual grads exact."""
    torch.manual_seed(0)
    mlp = _ResidualMLP().double()
    ref = copy.deepcopy(mlp)
    tiledmlp.patch(_Block(mlp), num_shards=SHARDS)
    x, r = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes)
    out = mlp(x, r)
    assert mlp.calls == SHARDS and mlp.forward.last_num_tiles == SHARDS
    grads = torch.autograd.grad(out.square().sum(), (x, r, *mlp.parameters()))
    ref_out = ref(x, r)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), (x, r, *ref.parameters()))
    assert_rel(out, ref_out, 1e-12, "output")
    for k, (g, e) in enumerate(zip(grads, ref_grads)):
        assert_rel(g, e, 1e-12, f"grad {k}")


@pytest.mark.parametrize("residual_shape,by_keyword", [((1, 6, 8), False), ((8,), False), ((6,), False),
                                                       ((2, 6, 8), True)],
                         ids=["broadcast-over-batch", "broadcast-over-tokens", "fewer-dims", "keyword"])
def test_residual_not_per_token_runs_untiled(residual_shape: tuple, by_keyword: bool) -> None:
    """A residual that broadcasts across tokens (or across the features: ``[T]`` against ``[T, H]``), or one passed
    by keyword, is not cut: the module runs once, untiled, exactly (tiled, these were wrong or an error)."""
    torch.manual_seed(0)
    mlp = _ResidualMLP().double()
    tiledmlp.patch(_Block(mlp), num_shards=SHARDS)
    x = torch.randn((6, 8) if residual_shape == (6,) else (2, 6, 8), dtype=torch.float64)
    if residual_shape == (6,):
        mlp.down = nn.Linear(32, 6).double()  # out [6, 6] + residual [6]: the residual runs along the features
    r = torch.randn(residual_shape, dtype=torch.float64)
    out = mlp(x, residual=r) if by_keyword else mlp(x, r)
    assert mlp.calls == 1
    assert torch.equal(out, type(mlp).forward(mlp, x, r))


def test_other_second_input_is_skipped() -> None:
    """Only a second input named ``residual`` is taken for one per token: anything else is reported as skipped,
    with the reason (and ``TiledMLP`` refuses it)."""
    model = nn.Sequential(_Block(_IndexedMLP()), _Block(_ResidualMLP()))
    report = tiledmlp.patch(model, num_shards=SHARDS)
    assert [(n, c) for n, c, _ in report.patched] == [("1.mlp", "_ResidualMLP")]
    assert [(n, c) for n, c, _ in report.skipped] == [("0.mlp", "_IndexedMLP")]
    assert "forward needs 2 positional inputs" in report.skipped[0][2]
    with pytest.raises(ValueError, match="TiledMLP cannot tile this _IndexedMLP"):
        tiledmlp.TiledMLP(_IndexedMLP(), num_shards=SHARDS)
