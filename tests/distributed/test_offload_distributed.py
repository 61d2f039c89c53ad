"""Activation offloading under DDP, FSDP2 and ZeRO-3 (2 processes, gloo), whole and split layers: bit-for-bit the
run without it.

One torchrun launch runs all three checks (``_offload_job.py``); ZeRO-3 is left out when deepspeed is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from test_backends import shared_job

pytestmark = pytest.mark.slow

BACKENDS = ["ddp", "fsdp2", "zero3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return shared_job(tmp_path_factory, "_offload_job.py", {"DS_ACCELERATOR": "cpu"}, timeout=600)


@pytest.mark.parametrize("split", [False, True], ids=["whole-layers", "split-layers"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_offloaded_training_is_bit_identical(results: dict[str, Any], backend: str, split: bool) -> None:
    if backend == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: pip install 'tiledmlp[deepspeed]' to run the ZeRO-3 check")
    r = results[backend]
    assert "error" not in r, r["error"]
    k = "split_" if split else ""
    assert r[f"{k}steps"] == 2 and r[f"{k}same_names"] and r[f"{k}tensors_compared"] > 0, r
    assert r[f"{k}max_abs_diff"] == 0.0, r
    stats = r[f"{k}offload_stats"]
    assert stats["offloaded"] > 0 and stats["waited"] == 0 and stats["prefetched"] == stats["offloaded"], stats
    if split:  # one more checkpointed input per layer and micro-batch than whole layers
        assert stats["offloaded"] > r["offload_stats"]["offloaded"], (stats, r["offload_stats"])
