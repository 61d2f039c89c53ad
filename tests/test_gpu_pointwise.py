"""benchmarks/gpu_pointwise.py at tiny float32 shapes on CPU: every formulation of the GLU backward it times
computes the same grads and product as float32 autograd, and its JSON has a timed row per shape and variant, so a
rare GPU session gets a working script and numbers it can trust."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import launch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"tiledmlp", "static", "outofplace", "two_kernels", "manual", "eager", "forward"}


def test_pointwise_tiny_run_checks_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "pointwise.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = launch.run([sys.executable, str(ROOT / "benchmarks" / "gpu_pointwise.py"), "--tiny", "--out", str(out)],
                      timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["tiny"] and data["meta"]["dtype"] == "float32"
    rows = data["rows"]
    assert sorted((r["rows"], r["variant"]) for r in rows) == sorted((n, v) for n in (16, 32) for v in VARIANTS)
    ran = [r for r in rows if r["ms"] is not None]
    # the library's own path and the eager one never depend on Inductor building a kernel here
    assert {r["variant"] for r in ran} >= {"tiledmlp", "eager", "forward"}
    for r in ran:
        assert r["ms"] > 0 and r["gbps"] > 0 and r["ratio"] > 0, r
        assert r["ref_max"] > 1, r  # randn inputs: the grads and product are O(1), so the bound below is not vacuous
        assert r["max_abs_err"] <= 1e-5 * r["ref_max"], r
    by = {(r["rows"], r["variant"]): r for r in rows}
    assert all(by[n, "tiledmlp"]["ratio"] == 1.0 for n in (16, 32))
    assert "x tiledmlp" in proc.stdout and "max abs err" in proc.stdout
