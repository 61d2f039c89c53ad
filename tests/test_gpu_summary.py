"""benchmarks/gpu_summary.py reads what benchmarks/gpu.sh leaves: the suite's outcome and the stages' seconds
become targets, a suite cut at the budget or with a failure never counts as passed; gpu_models.py runs at tiny size."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import launch
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
    ("SKIPPED [2] tests/test_x.py:3: not run: past TILEDMLP_TEST_DEADLINE (the GPU benchmark's time budget)\n"
     "848 passed, 2 skipped in 500.00s", 0, False),
])
def test_suite_outcome_is_the_last_counts_line(log: str, rc: int, ok: bool) -> None:
    text, passed = _summary().suite_line(log, rc)
    assert passed is ok
    assert ("stopped at the budget" in text) is (rc == 124)
    assert ("no result" in text) is ("passed" not in log)


def test_a_suite_past_its_deadline_names_what_did_not_run_and_what_failed() -> None:
    """The tests not started by the budget are skipped with a reason of their own (tests/conftest.py) and counted
    apart from the other skips; failed tests are named, so a cut GPU run still says which to rerun."""
    log = ("FAILED tests/test_a.py::test_b[x] - AssertionError: assert 2 == 4\nFAILED tests/test_a.py::test_b[y]\n"
           "SKIPPED [1] tests/test_c.py:7: needs a CUDA device\n"
           "SKIPPED [3] tests/test_d.py:9: not run: past TILEDMLP_TEST_DEADLINE (the GPU benchmark's time budget)\n"
           "SKIPPED [1] tests/conftest.py:1: not run: past TILEDMLP_TEST_DEADLINE (the GPU benchmark's time budget): "
           "tests/test_e.py::test_f[a b]\n"
           "SKIPPED [1] tests/conftest.py:1: not run: past TILEDMLP_TEST_DEADLINE (the GPU benchmark's time budget): "
           "tests/test_e.py::test_g\n"
           "2 failed, 90 passed, 6 skipped in 500.00s")
    text, passed = _summary().suite_line(log, 1)
    assert not passed
    assert text == ("whole suite on this GPU in one run: 2 failed, 90 passed, 6 skipped in 500.00s (5 of the skipped "
                    "not run: past the budget); not run: tests/test_e.py::test_f[a b], tests/test_e.py::test_g; "
                    "failed: tests/test_a.py::test_b[x], tests/test_a.py::test_b[y]")


def test_tests_not_started_by_the_deadline_are_skipped_with_its_reason(tmp_path: Path) -> None:
    """TILEDMLP_TEST_DEADLINE (benchmarks/gpu.sh) in the past: each test is skipped before its fixtures, and the
    run ends with its summary (a SIGINT had lost it); unset or in the future, the tests run."""
    import os
    import subprocess

    one = f"{Path(__file__).resolve()}::test_selected_tests_are_named_and_never_count_as_the_whole_suite"
    for deadline, counts in (("1", "1 skipped"), ("99999999999", "1 passed")):
        env = {**os.environ, "TILEDMLP_TEST_DEADLINE": deadline}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", one,
                              "--basetemp", str(tmp_path / deadline)], capture_output=True, text=True, env=env,
                             cwd=ROOT)
        assert counts in run.stdout, run.stdout + run.stderr
        assert ("past TILEDMLP_TEST_DEADLINE" in run.stdout) is (deadline == "1")
        if deadline == "1":  # each test named in its own reason, so the summary can list what did not run
            skipped = next(line for line in run.stdout.splitlines() if line.startswith("SKIPPED"))
            assert _summary().suite_line(skipped, 0)[0].endswith(
                "; not run: tests/test_gpu_summary.py::test_selected_tests_are_named_and_never_count_as_the_whole_suite"
            ), skipped


def test_the_summary_names_the_slowest_tests(tmp_path: Path) -> None:
    """pytest's ``--durations`` lines reach summary.md, which a device call returns even when it leaves other
    files out."""
    (tmp_path / "tests.log").write_text("===== slowest durations =====\n5.10s call     tests/test_a.py::test_x[1]\n"
                                        "61.25s setup    tests/test_b.py::test_y\n7.00s call     tests/test_c.py::t\n"
                                        "(12 durations < 5s hidden.)\n3 passed in 80.00s\n")
    (tmp_path / "tests.rc").write_text("0\n")
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert ("Slowest tests: 61 s setup tests/test_b.py::test_y; 7 s call tests/test_c.py::t; "
            "5 s call tests/test_a.py::test_x[1]\n") in summary
    assert _summary().slowest_line("3 passed in 1.00s") is None


def test_summary_checks_the_suite_and_the_total_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tests.log").write_text("850 passed, 2 skipped in 231.40s (0:03:51)\n")
    (tmp_path / "tests.rc").write_text("0\n")
    (tmp_path / "stages.txt").write_text("setup 12\nmlp 130\nmodels 160\ntests 245\n")
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary == capsys.readouterr().out
    assert "- [x] whole suite on this GPU in one run: 850 passed, 2 skipped" in summary
    assert "- [x] tiledmlp bench --preset seeds, all peers, in 130 s (< 180)" in summary
    assert "- [ ] gpu.sh all (whole suite, MLP table, models) in 547 s (< 540)" in summary


def test_selected_tests_are_named_and_never_count_as_the_whole_suite(tmp_path: Path) -> None:
    """GPU_SH_TESTS ran a selection (say, the tests a previous run failed): the summary says which, and neither the
    whole-suite target nor the 9-minute one is met by it."""
    (tmp_path / "tests.log").write_text("12 passed in 31.00s\n")
    (tmp_path / "tests.rc").write_text("0\n")
    (tmp_path / "tests.subset").write_text("tests/test_cuda.py tests/test_memory.py\n")
    (tmp_path / "stages.txt").write_text("setup 12\nmlp 90\nmodels 120\ntests 31\n")
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert ("- [x] selected tests (tests/test_cuda.py tests/test_memory.py), not the whole suite, on this GPU in one "
            "run: 12 passed") in summary
    assert "whole suite on this GPU" not in summary.replace("not the whole suite, on this GPU", "")
    assert "- [ ] gpu.sh all in 253 s, with selected tests only: not timed" in summary


def test_rows_without_a_baseline_and_failed_lengths_are_shown_and_not_judged(tmp_path: Path) -> None:
    """Where untiled failed at a length the bench writes no ratios, and a model length that failed is recorded as
    such: the summary still prints every row, and those targets are marked unmet rather than crashing the last
    step of gpu.sh or going missing."""
    row = {"seq": 131072, "impl": "tiledmlp", "shards": "4", "tiles": 4, "ms": 218.1, "time_ratio": None,
           "peak_mib": 5952.0, "mem_ratio": None, "peak_bytes": 6241124352}
    ok = {**row, "seq": 32768, "ms": 50.0, "time_ratio": 1.1, "mem_ratio": 0.5, "peak_bytes": 10}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench.json").write_text(json.dumps(
        {"meta": {"command": "tiledmlp bench", "device": "cuda", "torch": "2.11"}, "rows": [row, ok]}))
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| 131072 | tiledmlp (4) | 4 | 218.10 | - | - | 5952 | - | 0 |" in summary
    assert "- [ ] tiledmlp (4) at 131072: no untiled baseline to judge against" in summary
    assert "- [x] tiledmlp 4 tiles <= 1.20x untiled at 32768: 1.100" in summary
    (tmp_path / "models.json").write_text(json.dumps({"device": "cuda", "torch": "2.11", "loss": {}, "model": {},
                                                      "errors": {"131072": "OutOfMemoryError: CUDA out of memory"}}))
    assert _summary().main(str(tmp_path)) == 0
    assert "- [ ] model step at 131072: failed (OutOfMemoryError: CUDA out of memory)" in \
        (tmp_path / "summary.md").read_text()


def test_gpu_models_tiny_run_feeds_the_summary(tmp_path: Path) -> None:
    """benchmarks/gpu_models.py at tiny shapes on CPU (the peers skipped): every loss variant runs with its grads
    checked, the planned peaks are there, and the summary reads its JSON; a GPU session finds the script working."""
    result = launch.tiny_benchmark("gpu_models.py", tmp_path / "models.json", timeout=300)["json"]
    loss = result["loss"]
    assert result["repeat"] == {"256": 2}  # the default count, at the one tiny length
    assert set(loss) == {"tiledmlp", "tiledmlp-param", "tiledmlp-halftiles"}
    assert all(r["ms"] > 0 and r["peak_gib"] > 0 and r["dw_rel_err"] < 0.02 for r in loss.values())
    assert loss["tiledmlp-param"]["planned_gib"] < loss["tiledmlp"]["planned_gib"]
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| loss alone | tiledmlp-param |" in summary and "| model step 256 | tiledmlp |" in summary


@pytest.mark.parametrize("repeat", ["2,1,3", "0"])
def test_gpu_models_repeat_is_one_count_or_one_per_length(repeat: str) -> None:
    """``--repeat 2,1`` (gpu.sh: one round of the 15 s 128k step keeps the stage in its budget) sets the rounds per
    length; a list of another length, a zero or a non-number is refused by name before any model is built."""
    proc = launch.run(launch.plain(str(ROOT / "benchmarks" / "gpu_models.py"), "--tiny", "--repeat", repeat),
                      timeout=120, env=launch.cpu_env())
    assert proc.returncode == 2 and "--repeat takes one count >= 1 or one per --seq length (2)" in proc.stderr


def test_the_gpu_clocks_while_busy_are_summarised_and_bad_samples_skipped(tmp_path: Path) -> None:
    """gpu.sh samples nvidia-smi during the benchmarks: the summary says how far the busy GPU's clock fell and why
    (here the power cap, bit 0x4, in 2 of 3 busy samples); idle samples, a header and an error line are left out."""
    (tmp_path / "clocks.csv").write_text(
        "utilization.gpu, clocks.sm\n"
        "0, 345, 1980, 72.05, 700.00, 32, 0x0000000000000001\n"
        "100, 1305, 1980, 630.38, 700.00, 52, 0x0000000000000004\n"
        "100, 1980, 1980, 420.27, 700.00, 38, 0x0000000000000000\n"
        "97, 1200, 1980, 715.69, 700.00, 47, 0x0000000000000044\n"
        "100, [N/A], 1980, 700.00, 700.00, 50, 0x0\n"
        "Field \"clocks_event_reasons.active\" is not a valid field to query.\n")
    assert _summary().main(str(tmp_path)) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert ("GPU while the benchmarks ran (3 busy samples of nvidia-smi): SM clock 1200-1980 MHz, median 1305 of 1980; "
            "power median 630 W of 700, up to 716; 52 C at most; slowed by power cap in 67%, thermal (hardware) in 33%"
            ) in summary
    (tmp_path / "clocks.csv").write_text("0, 345, 1980, 72.05, 700.00, 32, 0x1\n")
    assert _summary().main(str(tmp_path)) == 0
    assert "GPU while" not in (tmp_path / "summary.md").read_text()
