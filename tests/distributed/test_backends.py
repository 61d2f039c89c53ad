"""Two processes over gloo, per backend: a patched model trains exactly like the untiled reference.

Each job (one launch by torchrun's agent, a free port each: ``tests/forkrun.py``, which forks the workers from one
process that imported torch once) runs several checks to save start-up time and writes one JSON
file of figures; the tests below assert on them and print them (``pytest -s`` shows the numbers).
Errors are relative (``|a - b| / |b|`` per tensor, the largest over all params and both steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import launch
import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits: unit roundoff u = 2**-8. The untiled bf16 run is itself ~5u from the fp32
# reference after two layers (measured 1.8e-2). Tiled and untiled bf16 round at different points (per-tile
# fp32 sums vs one matmul), so their difference may reach the sum of both errors; we allow 8u, and require
# the tiled bf16 error vs fp32 to be no worse than 1.5x the untiled bf16 error (the project's bf16 rule).
BF16_TOL = 8 * 2**-8
SHARDS = 4  # num_shards of the jobs' fixed-count checks


def _run_job(script: str, tmp: Path, extra_env: dict[str, str], timeout: int, processes: int = 2,
             args: tuple[str, ...] = ()) -> dict[str, Any]:
    out = tmp / f"{Path(script).stem}.json"
    # gloo on CPU whatever the machine has (FSDP2 and DeepSpeed would otherwise pick a visible GPU)
    env = {**os.environ, "TILEDMLP_RESULTS": str(out), "PYTHONWARNINGS": "ignore::FutureWarning",
           "CUDA_VISIBLE_DEVICES": "", **extra_env}
    cmd = launch.forkrun(processes, str(HERE / script), *args)
    proc = launch.run(cmd, env=env, cwd=HERE, timeout=timeout, what=script)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = json.loads(out.read_text())
    print(f"\n{script}: " + json.dumps(results, indent=1))
    return results


def shared_job(tmp_path_factory: pytest.TempPathFactory, script: str, extra_env: dict[str, str], timeout: int,
               args: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`_run_job` for a module fixture: launched once per test run, whichever workers draw its tests."""
    return launch.once_per_run(
        tmp_path_factory, "-".join((Path(script).stem, *args)),
        lambda: _run_job(script, tmp_path_factory.mktemp(Path(script).stem), extra_env, timeout, args=args))


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return shared_job(tmp_path_factory, "_torch_job.py", {}, timeout=300)


def deepspeed_job(tmp_path_factory: pytest.TempPathFactory, script: str, timeout: int) -> dict[str, Any]:
    """:func:`shared_job` for a job on DeepSpeed's CPU accelerator; skipped where DeepSpeed is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"deepspeed is not installed: pip install 'tiledmlp[deepspeed]' to run {script}'s tests")
    return shared_job(tmp_path_factory, script, {"DS_ACCELERATOR": "cpu"}, timeout=timeout)


@pytest.fixture(scope="module")
def ds_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return deepspeed_job(tmp_path_factory, "_ds_job.py", timeout=600)


def _like_torch(result: dict[str, Any]) -> None:
    """A DeepSpeed run (fp32, gradient clipping off: DeepSpeed's own default clips at 1.0) against the single-process
    untiled torch AdamW reference: grads and params of both steps. Before 2026-11-27 the jobs left DeepSpeed's
    clipping on (the tiny Llama's first grad norm is 1.10), so its params after a step differed from torch's by ~1e-4,
    and only the first step's grads were held to this bound."""
    for key in ("tiled_vs_torch_first_step_grad_rel", "tiled_vs_torch_grad_rel", "tiled_vs_torch_param_rel"):
        assert result.get(key, 1.0) <= FP32_TOL, f"{key}: {result.get(key)} ({result})"


def _exact(result: dict[str, Any], what: str, tol: float = FP32_TOL) -> None:
    """Exact, and tiled: a patch that tiled nothing (no tiled MLPs, or 1 tile each) matches untiled trivially."""
    assert "error" not in result, f"{what}: {result['error']}"
    assert max(result["tiles"], default=0) > 1, f"{what}: nothing was tiled (tiles run: {result['tiles']})"
    assert result["steps"] == 2, f"{what}: ran {result['steps']} steps"
    assert result["grad_rel"] <= tol, f"{what}: grads {result['grad_rel']:.2e} off ({result['grad_worst']})"
    assert result["param_rel"] <= tol, f"{what}: params {result['param_rel']:.2e} off ({result['param_worst']})"


@pytest.mark.parametrize("check", ["ddp_llama", "ddp_moe"])
def test_ddp_default_flags_exact(torch_results: dict[str, Any], check: str) -> None:
    """The Llama's MLPs on the GLU path, the MoE's experts on the generic one, 4 tiles each."""
    r = torch_results[check]
    _exact(r, check)
    assert r["paths"] == [{"ddp_llama": "glu", "ddp_moe": "generic"}[check]] and r["tiles"] == [SHARDS], r


@pytest.mark.parametrize("check", ["ddp_llama_norms", "fsdp2_norms"])
def test_row_tiled_norms_exact_under_ddp_and_fsdp2(torch_results: dict[str, Any], check: str) -> None:
    """RMSNorms row-tiled as well: the first step's grads (why not later steps: _torch_job._first_step)."""
    result = torch_results[check]
    assert "error" not in result, f"{check}: {result['error']}"
    assert result["tiles"] == [SHARDS], result
    assert result["steps"] == 1 and result["grad_rel"] <= FP32_TOL, result


@pytest.mark.parametrize("check", ["fsdp2_layer_unit", "fsdp2_mlp_unit"])
def test_fsdp2_exact_and_no_extra_reduce_scatter(torch_results: dict[str, Any], check: str) -> None:
    result = torch_results[check]
    _exact(result, check)
    assert result["reduce_scatters_per_step"] == result["untiled_reduce_scatters_per_step"], result
    assert min(result["reduce_scatters_per_step"]) > 0, "the reduce-scatter counter saw nothing"


def test_fsdp2_bf16_mixed_precision(torch_results: dict[str, Any]) -> None:
    r = torch_results["fsdp2_bf16"]
    assert "error" not in r, r["error"]
    assert r["tiles"] == [SHARDS], r
    assert r["tiled_vs_untiled_grad_rel"] <= BF16_TOL, r
    assert r["tiled_vs_untiled_param_rel"] <= BF16_TOL, r
    assert r["tiled_vs_fp32_grad_rel"] <= 1.5 * r["untiled_vs_fp32_grad_rel"], r
    assert r["tiled_vs_fp32_param_rel"] <= 1.5 * r["untiled_vs_fp32_param_rel"], r
    assert r["reduce_scatters_per_step"] == r["untiled_reduce_scatters_per_step"], r


def test_fsdp_units_inside_the_mlp_are_refused(torch_results: dict[str, Any]) -> None:
    r = torch_results["fsdp_inner_linear_units"]
    assert "error" not in r, r["error"]
    for where in ("fsdp2_at_patch", "fsdp2_at_forward", "fsdp1_at_patch"):
        assert "wrap the decoder layer" in r[where] and "gate_proj" in r[where], (where, r[where])


@pytest.mark.parametrize("check,head_dims", [("fsdp1_use_orig_params", [3]), ("fsdp1_tiled_loss", [0])])
def test_fsdp1_use_orig_params_exact(torch_results: dict[str, Any], check: str, head_dims: list[int]) -> None:
    """fsdp1_tiled_loss: patch(model, loss=True); lm_head returned the loss (0 dims), never logits (3 dims)."""
    _exact(torch_results[check], check)
    assert torch_results[check]["lm_head_output_dims"] == head_dims, torch_results[check]


def test_fsdp1_flattened_params_on_the_generic_path(torch_results: dict[str, Any]) -> None:
    """FSDP1 use_orig_params=False: the MLP's weights are views of a flat parameter, not parameters; tiled on the
    generic path their grads flow on into it (before 2026-11-25: refused as tensors 'not passed as params')."""
    r = torch_results["fsdp1_flat_params"]
    assert "error" not in r, r["error"]
    assert r["paths"] == ["generic"] and r["max_rel_err"] <= 1e-12, r


@pytest.mark.parametrize("check", ["zero1_llama", "zero2_llama", "zero2_moe", "zero3_llama", "zero3_llama_tiled_loss"])
def test_deepspeed_zero_exact(ds_results: dict[str, Any], check: str) -> None:
    """Grads and params of both steps vs the single-process untiled torch reference, and tiled vs untiled DeepSpeed."""
    r = ds_results[check]
    _like_torch(r)
    _exact(r, check)
    assert r["tiles"] == [SHARDS], r
    # ZeRO-3 lands per tile (tiles run on each rank: 4 per MLP call); ZeRO-1/2 take the engine's one landing
    zero3_tiles = SHARDS * r["tiled_mlps"] * r["forwards"] if check.startswith("zero3") else 0
    assert r["zero3_tiles_run_per_rank"] == [zero3_tiles] * 2, r
    # zero3_llama_tiled_loss: the loss ran tiled inside lm_head's call (ZeRO-3 gathered its weight around it)
    assert r["lm_head_output_dims"] == ([0] if check.endswith("tiled_loss") else [3]), r


@pytest.mark.parametrize("check", ["zero3_llama_uneven_auto", "zero3_moe_uneven_target",
                                   "zero3_frozen_mlp_uneven_auto"])
def test_zero3_ranks_agree_on_tile_count(ds_results: dict[str, Any], check: str) -> None:
    """Rank 0 at 96 tokens, rank 1 at 160: local plans differ, tiles run (and ZeRO-3 gathers) do not."""
    r = ds_results[check]
    _like_torch(r)
    _exact(r, check)
    plans = r["local_plan_tiles_per_rank"]
    assert plans[0] != plans[1], f"the ranks' own plans should differ here: {plans}"
    # last_num_tiles is what ran, the count the ranks agreed on (it reported the rank's own plan before 2026-11-26)
    assert r["last_num_tiles_per_rank"] == [[max(p) for p in zip(*plans)]] * 2, r
    assert len(set(r["zero3_tiles_run_per_rank"])) == 1, r["zero3_tiles_run_per_rank"]
    assert len(set(r["gate_proj_calls_per_rank"])) == 1, r["gate_proj_calls_per_rank"]
    assert r["agreement_collectives"] == r["forwards"], "expected one all-reduce per forward, not per layer call"


@pytest.mark.parametrize("check", ["zero2_llama_one_vs_two_tiles", "zero2_moe_one_vs_two_tiles",
                                   "zero1_overlap_llama_one_vs_two_tiles", "zero2_llama_uneven_auto"])
def test_zero2_ranks_with_different_tile_counts_exact(ds_results: dict[str, Any], check: str) -> None:
    """ZeRO-2 (and ZeRO-1 with overlap_comm) pack each grad into a reduce bucket as it becomes ready and reduce the
    bucket by position. Where rank 0 runs an MLP call as 1 tile and rank 1 as 2 (target_gb; "auto" plans 2 vs 3
    and 1 vs 2 here), both must make the MLP's grads ready in the same order. Before 2026-11-26 a 1-tile call ran
    plain autograd (down, up, gate) and a tiled one the Function (gate, up, down): grads 1.16 relative off untiled
    (0.84 for "auto"), on both the GLU path (Llama) and the generic one (MoE experts)."""
    r = ds_results[check]
    _like_torch(r)
    _exact(r, check)
    plans = r["local_plan_tiles_per_rank"]
    assert 1 in plans[0] and all(a < b for a, b in zip(*plans)), f"rank 0 should plan fewer tiles, some 1: {plans}"
    assert r["last_num_tiles_per_rank"] == plans and r["zero3_tiles_run_per_rank"] == [0, 0], r  # no agreement


@pytest.mark.parametrize("check", ["zero2_llama_bf16", "zero3_llama_bf16"])
def test_deepspeed_bf16_error_no_worse_than_untiled(ds_results: dict[str, Any], check: str) -> None:
    """bf16 under ZeRO-2/3 (4 tiles): every param's first-step grad, tiled and untiled, against the float32 torch
    reference; tiled may not be worse than 1.5x untiled for any param (ZeRO-3 lands per tile into DeepSpeed's
    grads, outside the engine's float32 sums)."""
    r = ds_results[check]
    assert "error" not in r, r["error"]
    assert r["untiled_vs_fp32_grad_rel"] > 1e-3, "bf16 should be visible in the untiled error"
    assert r["worst_ratio"] <= 1.5, r


def test_zero3_checkpointed_recompute_skips_the_tiles(ds_results: dict[str, Any]) -> None:
    """ZeRO-3 with transformers' (non-reentrant) activation checkpointing: exact, and the recompute stops before the
    tiled MLP, so gate_proj runs (and ZeRO-3 gathers it) as often as without checkpointing: forward + backward tiles."""
    r = ds_results["zero3_llama_checkpointed"]
    _like_torch(r)
    _exact(r, "zero3_llama_checkpointed")
    assert r["agreement_collectives"] == 2 * r["forwards"], "the checkpoint recompute should call the MLPs again"
    assert r["gate_proj_calls_per_rank"] == ds_results["zero3_llama"]["gate_proj_calls_per_rank"], r
