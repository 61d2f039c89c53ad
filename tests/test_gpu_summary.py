"""benchmarks/gpu_summary.py reads what benchmarks/gpu.sh leaves: the suite's outcome and the stages' seconds
become targets, a suite cut at the budget or with a failure never counts as passed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _summary():
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "benchmarks" / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("log, rc, ok", [
    ("collected\n" + "=" * 20 + " 850 passed, 2 skipped, 3 warnings in 231.40s (0:03:51) " + "=" * 20, 0, True),
    ("FAILED tests/test_x.py::test_y - assert 1 passed\n1 failed, 849 passed in 230.00s", 1, False),
    ("!!!! KeyboardInterrupt !!!!\n700 passed, 2 skipped in 541.02s (0:09:01)", 124, False),
    ("bringing up nodes...\n", 124, False),
    ("ERROR tests/test_x.py\n849 passed, 1 error in 200.00s", 1, False),
])
def test_suite_outcome_is_the_last_counts_line(log: str, rc: int, ok: bool) -> None:
    text, passed = _summary().suite_line(log, rc)
    assert passed is ok
    assert ("stopped at the budget" in text) is (rc == 124)
    assert ("no result" in text) is ("passed" not in log)


def test_summary_checks_the_suite_and_the_total_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tests.log").write_text("850 passed, 2 skipped in 231.40s (0:03:51)\n")
    (tmp_path / "tests.rc").write_text("0\n")
    (tmp_path / "stages.txt").write_text("setup 12\nmlp 130\nmodels 160\ntests 245\n")
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary == capsys.readouterr().out
    assert "- [x] whole suite on this GPU in one run: 850 passed, 2 skipped" in summary
    assert "- [ ] gpu.sh all (whole suite, MLP table, models) in 547 s (< 540)" in summary
