"""benchmarks/gpu_pointwise.py at tiny float32 shapes on CPU: every formulation of the GLU backward it times
computes the same grads and product as float32 autograd, and its JSON has a timed row per shape and variant, so a
rare GPU session gets a working script and numbers it can trust."""

from __future__ import annotations

from pathlib import Path

import launch

VARIANTS = {"tiledmlp", "static", "outofplace", "two_kernels", "manual", "eager", "forward"}


def test_pointwise_tiny_run_checks_every_variant(tmp_path: Path) -> None:
    result = launch.tiny_benchmark("gpu_pointwise.py", tmp_path / "pointwise.json", timeout=240)
    data = result["json"]
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
    assert "x tiledmlp" in result["stdout"] and "max abs err" in result["stdout"]
