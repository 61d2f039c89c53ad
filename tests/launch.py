"""Run a command for a test and, when it outlives its time, kill it and every process under it.

torchrun starts its workers in sessions of their own, so killing torchrun's process group leaves them running,
holding the output pipes open: ``communicate()`` then never returns and the suite hangs (seen in CI: a ZeRO-3
launch waiting on a DeepSpeed build lock ran until the CI's own limit). Here the whole tree is found and killed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import psutil
import pytest


def free_port() -> int:
    """A TCP port nobody listens on now, for a launch's ``--master_port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (collected first: killed parents orphan their children)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [*root.children(recursive=True), root]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def run(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
        what: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with captured text output; past ``timeout`` seconds kill its tree and fail the test."""
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(cmd[:4])} did not finish in {timeout:.0f} s\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def killed_by_signal(stderr: str) -> bool:
    """Whether torchrun reported a worker killed by a signal (a Python error ends a worker with an exit code)."""
    return "Signal " in stderr and "received by PID" in stderr


def tiny_benchmark(script: str, out: Path, timeout: float) -> dict:
    """``benchmarks/<script> --tiny --out <out>`` on one CPU thread (the GPU scripts' CPU smoke run): its JSON,
    once it exited 0."""
    proc = run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / script), "--tiny",
                "--out", str(out)], timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"json": json.loads(out.read_text()), "stdout": proc.stdout}
