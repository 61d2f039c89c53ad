"""benchmarks/gpu_pointwise.py and gpu_matmul.py at tiny shapes on CPU: every formulation of the GLU backward that
gpu_pointwise.py times computes the same grads and product as float32 autograd, gpu_matmul.py's products equal
``a^T @ b``, and each JSON has a row per shape and variant, so a rare GPU session gets working scripts and numbers
it can trust."""

from __future__ import annotations

from pathlib import Path

import launch

VARIANTS = {"tiledmlp", "static", "outofplace", "two_kernels", "manual", "eager", "forward"}


def test_pointwise_tiny_run_checks_every_variant(tmp_path: Path) -> None:
    result = launch.tiny_benchmark("gpu_pointwise.py", tmp_path / "pointwise.json", timeout=240)
    data = result["json"]
    assert data["meta"]["tiny"] and data["meta"]["dtype"] == "float32"
    rows = data["rows"]
    assert sorted((r["rows"], r["variant"]) for r in rows) == sorted((n, v) for n in (16,) for v in VARIANTS)
    ran = [r for r in rows if r["ms"] is not None]
    # the library's own path and the eager one never depend on Inductor building a kernel here
    assert {r["variant"] for r in ran} >= {"tiledmlp", "eager", "forward"}
    for r in ran:
        assert r["ms"] > 0 and r["gbps"] > 0 and r["ratio"] > 0, r
        assert r["ref_max"] > 1, r  # randn inputs: the grads and product are O(1), so the bound below is not vacuous
        assert r["max_abs_err"] <= 1e-5 * r["ref_max"], r
    by = {(r["rows"], r["variant"]): r for r in rows}
    assert all(by[n, "tiledmlp"]["ratio"] == 1.0 for n in (16,))
    assert "x tiledmlp" in result["stdout"] and "max abs err" in result["stdout"]


def test_matmul_tiny_run_checks_each_layout(tmp_path: Path) -> None:
    """benchmarks/gpu_matmul.py on CPU: the bf16 products run and equal ``a^T @ b`` to bf16 rounding; the
    float32-output ones (CUDA only) are reported n/a, not run through another path."""
    rows = launch.tiny_benchmark("gpu_matmul.py", tmp_path / "matmul.json", timeout=120)["json"]["rows"]
    assert {(r["grad"], r["variant"]) for r in rows} == {
        (g, v) for g in ("gate", "down")
        for v in ("bf16", "bf16_acc", "f32_first", "f32_acc", "f32_acc_t", "f32_add", "bf16_add")}
    for r in rows:
        if r["variant"].startswith("bf16"):
            assert r["ms"] > 0 and 0 < r["rel_err"] < 1e-2, r  # one bf16 rounding of the product
        else:
            assert r["ms"] is None and r["rel_err"] is None, r
