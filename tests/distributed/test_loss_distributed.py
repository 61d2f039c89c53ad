"""The tiled loss under DDP and FSDP2: 2 CPU processes over gloo, grads against a single-process reference."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import launch
import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

import _loss_worker  # noqa: E402


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """One 2-process spawn runs every job (start-up dominates); returns each rank's {job: "ok" | traceback}."""
    def spawn() -> list[dict[str, str]]:
        out = tmp_path_factory.mktemp("loss_dist")
        # daemonic: if the test times out, a hung worker must not hold the interpreter at exit
        mp.spawn(_loss_worker.main, args=(launch.free_port(), str(out)), nprocs=_loss_worker.WORLD, join=True,
                 daemon=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(_loss_worker.WORLD)]

    return launch.once_per_run(tmp_path_factory, "loss_worker", spawn)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("job", list(_loss_worker.JOBS))
def test_tiled_loss_grads_match_single_process(outcomes: list[dict[str, str]], job: str) -> None:
    """ddp: hidden, proj and lm_head grads (loss scaled by 0.25) match; the weight grad lands once per backward.
    ddp_hf: a Llama patched through its DDP wrapper; every grad (loss / 40) matches, logits are None.
    fsdp2: lm_head its own unit (a DTensor shard outside its forward), patched after fully_shard; every gathered
    grad (loss * 3) matches, one reduce-scatter per unit.
    bf16: a bf16 Llama (the head's float32 sum narrowed in place) under DDP and FSDP2 gets the average of the
    per-rank grads one process computes.
    fsdp2_moe: a Mixtral (its aux loss added to the tiled loss in place) under FSDP2 with accelerate's final-norm +
    lm_head unit; every gathered grad matches (a segfault in the backward before the loss stopped being a view).
    fsdp2_mixed_precision: FSDP2 with accelerate's --bf16 policy (bf16 outputs) casts the loss lm_head returns; the
    tiled grads are within 1e-2 of the untiled ones under the same policy (refused as a hook's change before)."""
    for rank, results in enumerate(outcomes):
        assert results.get(job) == "ok", f"rank {rank}, {job}:\n{results.get(job)}"
