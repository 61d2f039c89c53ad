"""The tests' launcher ends a timed-out command's whole tree, workers in their own sessions included."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
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


def _launch(launcher: str, processes: int, *target: str) -> subprocess.CompletedProcess:
    """``target`` under the real torchrun or under ``forkrun.py`` (its workers forked), on CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = launch.forkrun(processes, *target) if launcher == "forkrun" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
        "127.0.0.1", "--master_port", str(launch.free_port()), *target]
    return launch.run(cmd, env=env, timeout=120, what=launcher)


@pytest.mark.parametrize("launcher", ["torchrun", "forkrun"])
@pytest.mark.parametrize("body,signal", [("import os; os.abort()", True), ("raise ValueError('ours')", False)])
def test_a_worker_killed_by_a_signal_is_told_from_a_python_error(tmp_path, body: str, signal: bool,
                                                                 launcher: str) -> None:
    """What the distributed tests run again (a signal: once seen in CI) and what they never do (our own errors)."""
    script = tmp_path / "worker.py"
    script.write_text(body + "\n")
    proc = _launch(launcher, 1, str(script))
    assert proc.returncode != 0
    assert launch.killed_by_signal(proc.stderr) is signal, proc.stderr[-2000:]


# each rank: its launcher's variables, a gloo all-reduce over the ranks, then its own way of ending
RANKS = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")
print("rank", *(os.environ.get(k) is not None for k in keys), os.environ["RANK"], int(total), sys.argv[1:],
      __name__, flush=True)
dist.destroy_process_group()
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)  # sys.exit(0) on every rank but a failing one
"""


@pytest.mark.parametrize("launcher", ["torchrun", "forkrun"])
def test_forkrun_sets_ranks_up_as_torchrun_does(tmp_path: Path, launcher: str) -> None:
    """forkrun.py's workers (forked, modules preloaded) see what torchrun's see: every launcher variable, a
    working gloo group, their arguments, ``__main__``; ``sys.exit(0)`` ends a rank normally, another code fails
    the launch."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = _launch(launcher, 2, str(script), "0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank True True True True True True {r} 3 ['0'] __main__" for r in (0, 1)], done.stdout
    failed = _launch(launcher, 2, str(script), "3")
    assert failed.returncode != 0 and "exitcode  : 3" in failed.stderr, failed.stderr[-3000:]


def test_forkrun_refuses_a_visible_gpu_setting() -> None:
    """It forks after importing DeepSpeed, whose accelerator probe can touch CUDA: CPU jobs only, said so."""
    done = subprocess.run(launch.forkrun(1, "-m", "json.tool"), env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "set CUDA_VISIBLE_DEVICES=''" in done.stderr


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
