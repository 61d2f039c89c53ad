"""The tests' launcher ends a timed-out command's whole tree, workers in their own sessions included."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import launch
import psutil
import pytest

# a parent that starts a worker in a session of its own (as torchrun does) which holds the output pipe and waits
TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; print('worker', flush=True); time.sleep(600)"],
                 start_new_session=True)
time.sleep(600)
"""


def test_a_timed_out_tree_is_killed_and_the_test_fails_promptly() -> None:
    start = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 3 s") as failure:
        launch.run([sys.executable, "-c", TREE], timeout=3, what="tree")
    assert time.perf_counter() - start < 60
    assert "worker" in str(failure.value)  # its output so far is shown
    me = psutil.Process()
    assert not [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])
                and p.pid != me.pid]


def test_a_finished_command_returns_its_output_and_code() -> None:
    proc = launch.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (3, "out")


@pytest.mark.parametrize("body,signal", [("import os; os.abort()", True), ("raise ValueError('ours')", False)])
def test_a_worker_killed_by_a_signal_is_told_from_a_python_error(tmp_path, body: str, signal: bool) -> None:
    """What the distributed tests run again (a signal: once seen in CI) and what they never do (our own errors)."""
    script = tmp_path / "worker.py"
    script.write_text(body + "\n")
    proc = launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr",
                       "127.0.0.1", "--master_port", "0", str(script)], timeout=120, what="torchrun")
    assert proc.returncode != 0
    assert launch.killed_by_signal(proc.stderr) is signal, proc.stderr[-2000:]


def _count_and_return(root: str) -> str:
    def compute() -> str:
        with open(Path(root, "computed"), "a") as f:
            f.write("x")
        time.sleep(1)  # the other process asks meanwhile
        return f"value of {multiprocessing.current_process().name}"

    return launch.once_in(Path(root), "job", compute)


def test_a_shared_job_is_computed_once_for_all_workers(tmp_path: Path) -> None:
    """Two processes ask at once (as two xdist workers drawing one module's tests): one computes, both get its
    value; a failure stores nothing, so the next one asking computes again."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        values = pool.map(_count_and_return, [str(tmp_path)] * 2)
    assert values[0] == values[1] and values[0].startswith("value of ")
    assert Path(tmp_path, "computed").read_text() == "x"
    with pytest.raises(ZeroDivisionError):
        launch.once_in(tmp_path, "failing", lambda: 1 / 0)
    assert launch.once_in(tmp_path, "failing", lambda: "second try") == "second try"
