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
    """``target`` under the real torchrun or under ``forkrun.py`` (its workers forked), on CPU: ``forkrun`` from
    this process's forkrun server (as the suite's jobs), ``forkrun-alone`` as a process of its own."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if launcher == "forkrun-alone":
        return subprocess.run(launch.forkrun(processes, *target), env=env, capture_output=True, text=True,
                              timeout=120)
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
line = " ".join(map(str, ("rank", *(os.environ.get(k) is not None for k in keys), os.environ["RANK"], int(total),
                           sys.argv[1:], __name__, "threads", torch.get_num_threads())))
sys.stdout.write(line + "\\n")  # one write: the ranks share the pipe (print's pieces had interleaved: "rankrank")
sys.stdout.flush()
dist.destroy_process_group()
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)  # sys.exit(0) on every rank but a failing one
"""


@pytest.mark.parametrize("launcher", ["torchrun", "forkrun", "forkrun-alone"])
def test_forkrun_sets_ranks_up_as_torchrun_does(tmp_path: Path, launcher: str) -> None:
    """forkrun.py's workers (forked, modules preloaded) see what torchrun's see: every launcher variable, a
    working gloo group, their arguments, ``__main__``; ``sys.exit(0)`` ends a rank normally, another code fails
    the launch."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = _launch(launcher, 2, str(script), "0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    # one intra-op thread each, as OMP_NUM_THREADS=1 says (before 2026-11-28 forked ranks kept the launcher's 2)
    assert lines == [f"rank True True True True True True {r} 3 ['0'] __main__ threads 1" for r in (0, 1)], done.stdout
    failed = _launch(launcher, 2, str(script), "3")
    assert failed.returncode != 0 and "exitcode  : 3" in failed.stderr, failed.stderr[-3000:]


def test_forkrun_refuses_a_visible_gpu_setting() -> None:
    """It forks after importing DeepSpeed, whose accelerator probe can touch CUDA: CPU jobs only, said so."""
    done = subprocess.run(launch.forkrun(1, "-m", "json.tool"), env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "set CUDA_VISIBLE_DEVICES=''" in done.stderr


# a rank that reports the variable and directory of its launch, then sleeps unless told not to
ENV_AND_CWD = """
import os, sys, time
sys.stdout.write(f"launch {os.environ.get('LAUNCH_MARK')} {os.getcwd()}\\n")  # one write: ranks share stdout
sys.stdout.flush()
time.sleep(float(sys.argv[1]))
"""


def test_a_served_launch_has_its_own_environment_and_directory_and_its_timeout_ends_it_alone(tmp_path: Path) -> None:
    """The forkrun server forks each launch from one process: each must still see the environment and directory
    it was given, and a timed-out one must be killed with its workers while the server goes on serving."""
    script = tmp_path / "mark.py"
    script.write_text(ENV_AND_CWD)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 5 s") as failure:
        launch.run(launch.forkrun(2, str(script), "600"), env={**env, "LAUNCH_MARK": "first"}, cwd=tmp_path,
                   timeout=5, what="sleeping ranks")
    assert time.perf_counter() - start < 60 and f"launch first {tmp_path}" in str(failure.value)
    assert psutil.Process(launch._forkrun_server().proc.pid).children(recursive=True) == []  # launcher and ranks
    done = launch.run(launch.forkrun(1, str(script), "0"), env={**env, "LAUNCH_MARK": "second"}, cwd=tmp_path.parent,
                      timeout=120)
    assert done.returncode == 0 and f"launch second {tmp_path.parent}" in done.stdout, done.stderr[-2000:]


# what a plain process reports of itself: its name, argv, first path entry, a launcher's variable, threads, parent
PLAIN = """
import os, sys, torch
print(__name__, sys.argv[1:], sys.path[0], os.environ.get("RANK"), os.environ.get("PLAIN_MARK"),
      torch.get_num_threads(), os.getppid())
sys.exit(int(sys.argv[-1]))
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_plain_command_runs_as_python_would(tmp_path: Path, how: str) -> None:
    """``launch.plain`` with the GPUs hidden: forked from this process's forkrun server, the target runs as ``python
    script.py`` / ``python -m module`` would: ``__main__``, its arguments, the script's folder (or the working
    directory) first on the path, no launcher variables, ``OMP_NUM_THREADS`` threads, its exit code."""
    (tmp_path / "probe.py").write_text(PLAIN)
    target = ["-m", "probe"] if how == "module" else [str(tmp_path / "probe.py")]
    env = {k: v for k, v in launch.cpu_env().items() if k != "RANK"}
    done = launch.run(launch.plain(*target, "a b", "3"), env={**env, "PLAIN_MARK": "seen"},
                      cwd=tmp_path if how == "module" else tmp_path.parent, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    server = launch._forkrun_server().proc.pid
    assert done.stdout.split("\n")[0] == f"__main__ ['a b', '3'] {tmp_path} None seen 1 {server}", done.stdout


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
