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
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import Sequence

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.trainer", "accelerate", "peft", "datasets",
           "deepspeed", "tiledmlp", "tiledmlp.train.cli")


def worker(target: str, is_module: bool, args: Sequence[str]) -> None:
    """One rank: the module or script as ``__main__``, with the argv and first path entry Python would give it."""
    sys.argv = [target, *args]
    # what ``python -m`` / ``python script.py`` put first on the path: the working directory / the script's folder
    sys.path[0] = os.getcwd() if is_module else os.path.dirname(os.path.abspath(target))
    if is_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str]) -> None:
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
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed (deepspeed): its workers import what they need
            pass
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=worker)(args.training_script, bool(args.module),
                                                    list(args.training_script_args))


if __name__ == "__main__":
    main(sys.argv[1:])
