"""ZeRO-3 on a vision-language model (two processes, gloo, DeepSpeed on CPU; ``_vlm_job.py``).

The vision tower's MLPs run first on few patches, the text MLPs after on many tokens. Before 2026-11-26 the tile
agreement all-reduced once per forward, at the first tiled call (a vision MLP), and every text MLP reused that
count: 2 or 3 tiles where the text needed 9 or 10, its memory saving silently lost, while ``last_num_tiles``
reported the rank's own plan. Now each stream agrees on its own count, and ``last_num_tiles`` says what ran.
The tiled run tiles the loss as well (the model is a ``*ForConditionalGeneration``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from test_backends import FP32_TOL, shared_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: pip install 'tiledmlp[deepspeed]' to run the ZeRO tests")
    results = shared_job(tmp_path_factory, "_vlm_job.py", {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                         timeout=300)["vlm"]
    assert "error" not in results, results["error"]
    return results


def _busiest(per_rank: list[list[dict[str, int]]]) -> list[dict[str, int]]:
    """Per micro-batch and MLP, the largest count over the ranks."""
    return [{name: max(rank[k][name] for rank in per_rank) for name in per_rank[0][k]} for k in range(len(per_rank[0]))]


def test_zero3_tiles_each_stream_for_its_own_tokens(vlm: dict[str, Any]) -> None:
    """Every rank runs, per MLP call, the tiles the busiest rank's own plan asks for: vision and text alike, with
    one all-reduce per stream and forward; and the grads equal untiled ZeRO-3's."""
    r = vlm["tiled"]
    plans, tiles = r["local_plan_per_rank"], r["tiles_run_per_rank"]
    assert len({n for n in r["mlps"] if ".visual." in n}) == 2 and len(r["mlps"]) == 4, r["mlps"]
    assert plans[0] != plans[1], f"the ranks' own plans should differ here: {plans}"
    text = [max(k[n] for n in k if "language_model" in n) for k in _busiest(plans)]
    vision = [max(k[n] for n in k if ".visual." in n) for k in _busiest(plans)]
    assert min(text) > max(vision) > 1, (text, vision)  # the text needs more tiles than the first (vision) call
    assert tiles[0] == tiles[1] == _busiest(plans), tiles
    assert r["agreement_collectives_per_rank"] == [[2, 2], [2, 2]], r["agreement_collectives_per_rank"]
    assert r["grad_rel"] <= FP32_TOL, (r["grad_rel"], r["grad_worst"])
    # the loss tiled too (patch(loss=True)): no logits built, on every rank, against transformers' own loss
    assert r["logits_built_per_rank"] == [[False, False]] * 2 and vlm["untiled"]["logits_built_per_rank"] == [
        [True, True]] * 2
    assert vlm["untiled"]["tiles_run_per_rank"] == [[{n: 1 for n in r["mlps"]}] * 2] * 2, vlm["untiled"]


def test_zero3_last_num_tiles_reports_the_tiles_run(vlm: dict[str, Any]) -> None:
    """``last_num_tiles`` (what ``tiledmlp train`` reports per MLP) is the agreed count every rank ran, not the
    rank's own plan."""
    r = vlm["tiled"]
    assert r["last_num_tiles_per_rank"] == r["tiles_run_per_rank"], r
