"""Edge cases of the distributed adapters (``tiledmlp/distributed.py``), two processes over gloo.

This file is both the pytest module and the job it launches (``torchrun ... test_distributed_edges.py <check>``).

ZeRO-3 leaf module: routed experts with one Linear per expert, marked a ZeRO-3 leaf module
(``deepspeed.utils.set_z3_leaf_modules``), the setup DeepSpeed recommends for MoE and the one tiledmlp's own
"last tile must reach every parameter" refusal names as the fix. A leaf's params have no per-param reduce hook
(DeepSpeed reduces them in the leaf's backward hook, after every tile), so a tile that misses an expert is harmless.
Before 2026-11-26 the refusal fired anyway when a rank's last tile routed no token to an expert, on that rank only
(the other rank then waited in its next collective).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

H = 16  # hidden size of the toy experts
TOKENS = 8
SHARDS = 2


class ToyExperts(nn.Module):
    """Routed experts, one Linear each (top-1): an expert's weight is used only by the tokens routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(H, H, bias=False) for _ in range(2)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, linear in enumerate(self.experts):
            mask = top_k_index[..., 0] == e
            if mask.any():
                out = out.index_put(mask.nonzero(as_tuple=True), linear(hidden_states[mask]) * top_k_weights[mask])
        return out


class ToyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = ToyExperts()

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.moe(self.inp(x), idx, w).pow(2).sum()


def _routing(rank: int) -> torch.Tensor:
    """Rank 0 routes its first half to expert 1, its second half (the last of 2 tiles) to expert 0 only."""
    pos = torch.arange(TOKENS)
    idx = (pos < TOKENS // 2).long() if rank == 0 else pos % 2
    return idx.view(1, TOKENS, 1)


def _zero3_leaf_train(rank: int, num_shards: int) -> tuple[dict[str, torch.Tensor], int]:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad, set_z3_leaf_modules

    import tiledmlp
    from tiledmlp import distributed as tdist

    torch.manual_seed(0)
    model = ToyMoE()
    tiledmlp.patch(model, num_shards=num_shards, norms=False)
    set_z3_leaf_modules(model, [ToyExperts])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(1, TOKENS, H, generator=g), torch.rand(1, TOKENS, 1, generator=g)
    engine.backward(engine(x, _routing(rank), w))
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    tiles = tdist.last_tile_count(model.moe)
    engine.step()
    engine.destroy()
    return grads, tiles


def zero3_leaf_experts_check(job: Any) -> dict[str, Any]:
    from _common import all_ranks, max_rel

    tiled, tiles = _zero3_leaf_train(job.rank, SHARDS)
    untiled, _ = _zero3_leaf_train(job.rank, 1)
    err, worst = max_rel(tiled, untiled)
    return {"grad_rel": err, "grad_worst": worst, "tiles_per_rank": all_ranks(tiles)}


def _main() -> None:
    from _common import Job, init

    init()
    job = Job()
    checks = {"zero3_leaf_experts": lambda: zero3_leaf_experts_check(job)}
    job.run(checks)


if __name__ == "__main__":
    _main()
else:
    import pytest

    pytestmark = pytest.mark.slow

    @pytest.fixture(scope="module")
    def ds_edges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed: pip install 'tiledmlp[deepspeed]' to run the ZeRO tests")
        from test_backends import _run_job

        return _run_job(Path(__file__).name, tmp_path_factory.mktemp("edges"),
                        {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=150, args=("zero3_leaf_experts",))

    def test_zero3_leaf_module_experts_tile_exactly(ds_edges: dict[str, Any]) -> None:
        """Rank 0's last tile routes no token to expert 1: with the experts a ZeRO-3 leaf module, tiled grads equal
        untiled ZeRO-3's (before: RuntimeError 'the last tile must reach every parameter' on rank 0)."""
        from test_backends import FP32_TOL

        r = ds_edges["zero3_leaf_experts"]
        assert "error" not in r, r["error"]
        assert r["tiles_per_rank"] == [SHARDS, SHARDS], r
        assert r["grad_rel"] <= FP32_TOL, r

    def test_zero3_leaf_params_need_not_be_reached_by_the_last_tile() -> None:
        """The same rule in one process, float64: a param flagged as a ZeRO-3 leaf module's (``ds_z3_leaf_module``,
        what DeepSpeed sets) that only the first tile uses gets its exact grad; an unflagged one is still refused."""
        from tiledmlp import distributed as tdist

        torch.manual_seed(0)
        x = torch.randn(8, H, dtype=torch.float64)
        upstream = torch.randn(8, H, dtype=torch.float64)

        def grad_of(w: torch.Tensor, splits: list[int]) -> torch.Tensor:
            def fn(t: torch.Tensor) -> torch.Tensor:  # w serves the first tile's 5 tokens only
                return t @ w if t.shape[0] == 5 else t * 2

            out = fn(x) if len(splits) == 1 else tdist._zero3_tiled(fn, x, (), [w], splits)
            out.backward(upstream)
            return w.grad

        w0 = torch.randn(H, H, dtype=torch.float64)
        want = (x[:5].T @ upstream[:5])
        leaf_w = w0.clone().requires_grad_()
        leaf_w.ds_z3_leaf_module = object()
        torch.testing.assert_close(grad_of(leaf_w, [5, 3]), want, rtol=1e-12, atol=1e-14)
        with pytest.raises(RuntimeError, match="last tile must reach every parameter"):
            grad_of(w0.clone().requires_grad_(), [5, 3])
