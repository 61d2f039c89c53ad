"""Run a command for a test and, when it outlives its time, kill it and every process under it.

torchrun starts its workers in sessions of their own, so killing torchrun's process group leaves them running,
holding the output pipes open: ``communicate()`` then never returns and the suite hangs (seen in CI: a ZeRO-3
launch waiting on a DeepSpeed build lock ran until the CI's own limit). Here the whole tree is found and killed.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import psutil
import pytest
import torch
from filelock import FileLock

T = TypeVar("T")


def cpu_env() -> dict[str, str]:
    """This environment on one CPU thread, the GPUs hidden, offline: a CPU test's command's."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    """A TCP port nobody listens on now, for a launch's ``--master_port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FORKRUN = str(Path(__file__).with_name("forkrun.py"))


def forkrun(processes: int, *target: str) -> list[str]:
    """The command that runs ``target`` (``script.py args`` or ``-m module args``) on ``processes`` CPU ranks the
    way ``torchrun`` does, its workers forked from one process that imported torch and transformers once
    (``forkrun.py``). Its environment must hide the GPUs (``CUDA_VISIBLE_DEVICES=""``). :func:`run` launches it
    from this test process's ``forkrun.py --serve``; run by anything else it is a launcher of its own."""
    return [sys.executable, FORKRUN, "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *target]


def plain(*target: str) -> list[str]:
    """The command that runs ``target`` (``script.py args`` or ``-m module args``) as one plain process, as
    ``python`` would (``forkrun.py --plain``); :func:`run` forks it, preloaded, from this test process's forkrun
    server where its environment hides the GPUs or the machine has none, and starts it afresh where it sees one."""
    return [sys.executable, FORKRUN, "--plain", *target]


class _ForkrunServer:
    """``forkrun.py --serve`` for this test process: started at its first forkrun command, it ends when this
    process does (end of its stdin). Its imports see no GPU and DeepSpeed's CPU accelerator named (no CUDA probe
    before a fork): what every forkrun job runs on anyway."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="forkrun-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, FORKRUN, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, bufsize=0,
                                     env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})
        self.pending = b""
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (end of its stdin) and delete its log: at this test process's exit."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def _answer(self, deadline: float | None) -> dict[str, Any] | None:
        """The server's next answer line, or None at ``deadline``."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                self.log.flush()
                tail = Path(self.log.name).read_text(errors="replace")[-4000:]
                pytest.fail(f"forkrun.py --serve ended (rc {self.proc.wait()}):\n{tail}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: Sequence[str], timeout: float, env: dict[str, str], cwd: str, what: str
            ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"argv": list(argv[2:]), "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = self._answer(None)["pid"]
            done = self._answer(time.monotonic() + timeout)
            if done is None:
                kill_tree(pid)
                self._answer(None)
            text = [path.read_text(errors="replace") if path.exists() else "" for path in (out, err)]
        if done is None:
            pytest.fail(f"{what} did not finish in {timeout:.0f} s\n{text[0][-2000:]}\n{text[1][-4000:]}")
        return subprocess.CompletedProcess(list(argv), done["returncode"], *text)


_SERVER: _ForkrunServer | None = None


def _forkrun_server() -> _ForkrunServer:
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = _ForkrunServer()
    return _SERVER


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
    """Run ``cmd`` with captured text output; past ``timeout`` seconds kill its tree and fail the test. A
    :func:`forkrun` command (its environment hiding the GPUs) and a :func:`plain` one (the same, or no GPU here) run
    from this process's forkrun server."""
    environ = dict(os.environ if env is None else env)
    hidden = environ.get("CUDA_VISIBLE_DEVICES") == "" or cmd[2:3] == ["--plain"] and not torch.cuda.is_available()
    if list(cmd[:2]) == [sys.executable, FORKRUN] and hidden:
        return _forkrun_server().run(cmd, timeout, environ, str(cwd or os.getcwd()), what or "forkrun.py")
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(cmd[:4])} did not finish in {timeout:.0f} s\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def once_per_run(tmp_path_factory: pytest.TempPathFactory, key: str, compute: Callable[[], T]) -> T:
    """``compute()``, run by one pytest-xdist worker of this run and read back by the others.

    A module fixture that launches a multi-process job runs once in every worker that draws one of its module's
    tests, and xdist's load scheduling hands a module's first tests out round-robin (``xdist_group`` would keep
    them together, but pytest 9.2 ignores it: xdist renames items through an attribute pytest no longer reads).
    On a 2-core machine two copies of a job then contend for the cores. Here the first worker computes under a
    file lock in the run's shared temporary directory; the others wait for it and unpickle its value. A failure
    or skip stores nothing: the next worker tries again.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, shared by its workers (each has a popen-gwN below it)
    return once_in(root, key, compute)


def once_in(root: Path, key: str, compute: Callable[[], T]) -> T:
    """``compute()`` once for all processes sharing ``root``: the first stores it there, the rest read it."""
    path = root / f"once-{key}.pickle"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = compute()
        path.write_bytes(pickle.dumps(value))
        return value


def killed_by_signal(stderr: str) -> bool:
    """Whether torchrun reported a worker killed by a signal (a Python error ends a worker with an exit code)."""
    return "Signal " in stderr and "received by PID" in stderr


def tiny_benchmark(script: str, out: Path, timeout: float) -> dict:
    """``benchmarks/<script> --tiny --out <out>`` on one CPU thread (the GPU scripts' CPU smoke run): its JSON,
    once it exited 0."""
    proc = run(plain(str(Path(__file__).resolve().parents[1] / "benchmarks" / script), "--tiny", "--out", str(out)),
               timeout=timeout, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"json": json.loads(out.read_text()), "stdout": proc.stdout}
