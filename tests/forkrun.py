"""``torchrun`` whose workers are forked from one process that has already imported torch, transformers and
DeepSpeed, for the tests that launch many small multi-process jobs.

A torchrun launch on a 2-core machine spends most of its CPU importing: torchrun itself (~2.5 s) and then every
worker again (~6 s each: torch, transformers, peft, datasets, DeepSpeed) for a job that trains a tiny model for a
few seconds. Here the launcher imports once and torch's own elastic agent (the one torchrun runs) forks the workers
(``start_method="fork"``), so each has those modules loaded; they still are separate processes, each with its own
gloo process group, rank environment and rendezvous, exactly as torchrun sets them up. Nothing has run a torch op
in the launcher before it forks (no thread pools to inherit).

Usage, as torchrun's: ``python tests/forkrun.py [torchrun flags] (-m module | script.py) [args...]``.
The tests that are about the launch itself (signals, ``--compare`` starting torchrun) keep the real one.

``python tests/forkrun.py --serve``: the same launcher, its imports paid once per test process rather than once
per launch (~5 s of CPU each, 25 launches in the suite). It reads one request per line on stdin (JSON: the argv
above, the environment, working directory and output files of the launch) and forks a child that is that
launcher, in a session of its own with that environment; it answers the child's pid, then its exit code.
``launch.run`` sends every forkrun command there (``launch.py``).

``python tests/forkrun.py --plain (-m module | script.py) [args...]``: no launcher and no rank variables, one
plain process as ``python -m module`` / ``python script.py`` runs it (sent to the server, it is forked preloaded:
~9 s of CPU less for a ``tiledmlp train`` process), for the tests whose subject is what that process does, not how
it starts.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import sys
import traceback
import warnings
from typing import Any, Sequence

# DeepSpeed's engine imports its Muon optimizer (checking whether ZeRO supports the run's optimizer), which imports
# Inductor's compile_fx: ~5 s of every DeepSpeed rank's CPU (75 s in the suite) until it was preloaded; its Ulysses
# module, every SP rank's
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.trainer", "accelerate", "peft", "datasets",
           "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.sequence_parallel.ulysses_sp",
           "tiledmlp", "tiledmlp.train.cli")


def worker(target: str, is_module: bool, args: Sequence[str]) -> None:
    """One rank: the module or script as ``__main__``, with the argv and first path entry Python would give it."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # a fresh process takes it at torch's import; the preload, forked
        import torch  # into this rank, read the launcher's (or the server's) environment, not the rank's

        torch.set_num_threads(int(threads))
    sys.argv = [target, *args]
    # what ``python -m`` / ``python script.py`` put first on the path: the working directory / the script's folder
    sys.path[0] = os.getcwd() if is_module else os.path.dirname(os.path.abspath(target))
    if is_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed (deepspeed): its workers import what they need
            pass
    # the preload out of the collector's reach in every fork: a rank's full collections walk only what it made
    # (torch, transformers and DeepSpeed are ~10^6 objects, 0.3 s per full collection; DeepSpeed and Trainer call
    # gc.collect themselves)
    gc.collect()
    gc.freeze()


def plain(argv: Sequence[str]) -> None:
    """``--plain``'s process: the target as ``__main__`` in this process, once the preload is done."""
    if not argv or argv[0] == "-m" and len(argv) < 2:
        raise SystemExit("forkrun.py --plain: give -m module or script.py, then its arguments")
    preload()
    module = argv[0] == "-m"
    worker(argv[1] if module else argv[0], module, argv[2:] if module else argv[1:])


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["--plain"]:
        return plain(argv[1:])
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(list(argv))
    if args.run_path or args.no_python:
        raise SystemExit("forkrun.py: --run_path and --no_python are torchrun's alone")
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        # a launcher that touched CUDA (DeepSpeed's accelerator probe does) before forking would break its workers
        raise SystemExit("forkrun.py launches CPU jobs: set CUDA_VISIBLE_DEVICES='' (gloo on CPU, as the tests do)")
    if args.master_port is None:
        args.master_port = 29500
    preload()
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=worker)(args.training_script, bool(args.module),
                                                    list(args.training_script_args))


def _launch_from_request(request: dict[str, Any]) -> None:
    """In the forked child: become ``python forkrun.py <argv>`` run with the request's environment, directory and
    output files, then exit as that process would (its atexit handlers run, its exit code is the status)."""
    code: Any = 1
    try:
        os.setsid()  # as launch.run starts a command: its own session, so a timeout kills its tree alone
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        options = [o for o in request["env"].get("PYTHONWARNINGS", "").split(",") if o]
        if options and hasattr(warnings, "_processoptions"):  # what Python does with PYTHONWARNINGS at startup
            warnings._processoptions(options)
        main(request["argv"])
        code = 0
    except SystemExit as stop:  # Python's own handling of an exit: None is 0, text is printed and is 1
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Preload once, then one forked launcher per request line on stdin, answered with its pid and exit code."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":  # the preload below must not see a GPU either (see main)
        raise SystemExit("forkrun.py --serve launches CPU jobs: start it with CUDA_VISIBLE_DEVICES=''")
    answers = os.fdopen(os.dup(1), "w")  # stdout is for the answers alone: what the imports print goes to stderr
    os.dup2(2, 1)
    preload()
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            answers.close()
            _launch_from_request(json.loads(line))
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:])
