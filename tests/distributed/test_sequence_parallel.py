"""Ulysses sequence parallelism in ``tiledmlp train``, for real: torchrun over gloo, DeepSpeed on CPU.

One job per topology (``_sp_job.py``; each trains the tiny Llama with tiled MLP + tiled loss and the tiny
Qwen3-MoE with tiled experts, 3 steps, labels masked unevenly so some SP ranks hold no labelled token) compared
with one untiled process trained on the same sequences, whose step loss is the sum of token losses over all of
the step's sequences over their labelled tokens (Trainer's ``num_items_in_batch`` semantics):

- SP=2 (2 processes, ZeRO-1, 2 accumulated micro-batches per step), SP=4 (4 processes, ZeRO-1: 4 SP ranks
  over 2 kv heads, DeepSpeed replicates them), SP=2 x DP=2 (4 processes, ZeRO-3); the last two with activation
  offloading (and the checkpointing it turns on) as well, SP=2 x DP=2 with split layers.

float32 tolerances: per-step loss 1e-5 absolute (losses ~5.6; measured <= 4.3e-7); first-step grads 1e-5
relative per tensor (measured <= 7.8e-7); params after 3 AdamW steps 1e-4 relative (measured <= 2.3e-5: Adam
divides by sqrt(v), which magnifies float32 noise in near-zero grad elements).
Flags in ``EXTRA_FLAGS`` are appended to every training run (e.g. ``--activation_offloading true``).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
from test_backends import _run_job

pytestmark = pytest.mark.slow

EXTRA_FLAGS: list[str] = []
OFFLOAD = ["--activation_offloading", "true"]  # turns on checkpointing too; on CPU its hooks run, nothing moves
TOPOLOGIES = {"sp2": (2, ["--sp", "2", "--zero", "1", "--gradient_accumulation_steps", "2"]),
              "sp4": (4, ["--sp", "4", "--zero", "1", *OFFLOAD]),
              "sp2xdp2": (4, ["--sp", "2", "--zero", "3", *OFFLOAD, "--activation_offloading_split_layers", "true"])}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_sequence_parallel_equals_one_untiled_process(topology: str, tmp_path: Path) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: pip install 'tiledmlp[deepspeed]'")
    processes, args = TOPOLOGIES[topology]
    sp = int(args[1])
    start = time.perf_counter()
    results = _run_job("_sp_job.py", tmp_path, {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                                                "HF_HUB_OFFLINE": "1"}, timeout=400, processes=processes,
                       args=(*args, *EXTRA_FLAGS))
    print(f"{topology}: {processes} processes, {time.perf_counter() - start:.0f} s")
    assert set(results) == {"tiny-llama", "tiny-qwen3-moe"}
    for kind, r in results.items():
        assert r["sequence_parallel_size"] == sp
        assert len(r["sp_groups"]) == processes // sp and all(len(g) == sp for g in r["sp_groups"])
        assert r["mlp_tokens_per_rank"] == [[64 // sp]] * processes  # each rank's MLP saw its seq / N shard
        assert r["sequences_from_dataset"] and r["position_ids_global"]
        counts = [c for step in r["labelled_tokens_per_rank_per_step"] for c in step]
        assert 0 in counts and len(set(counts)) > 2  # some rank had no labelled token; the mix is uneven
        assert r["tiled_loss"] is True  # MoE models too (their forward runs around the tiled loss)
        assert r["tiles"] and set(r["tiles"].values()) == {2}
        assert r["offloading"] is ("--activation_offloading" in args)
        assert (r["split_halves"] > 0) is ("--activation_offloading_split_layers" in args), r["split_halves"]
        assert r["loss_abs"] <= 1e-5, (kind, r["losses"], r["ref_losses"])
        assert r["grad_rel"][0] <= 1e-5, (kind, r["grad_rel"])
        assert r["param_rel"][0] <= 1e-4, (kind, r["param_rel"])
