"""``tiledmlp`` command line: ``tiledmlp bench ...``, ``tiledmlp train ...`` and ``tiledmlp plan ...``.

Each subcommand owns its own parser (``bench`` uses argparse for its few options, ``train`` uses
``transformers.HfArgumentParser`` so every ``TrainingArguments`` flag works); this module only dispatches.
"""

from __future__ import annotations

import sys
from typing import Sequence

_USAGE = """usage: tiledmlp {bench,train,plan} [options] | --version

  bench   regular-vs-tiled speed and memory table (tiledmlp bench --help)
  train   long-sequence fine-tuning on the HF Trainer engine (tiledmlp train --help)
  plan    predicted peak memory per recipe and the longest sequence that fits (tiledmlp plan --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("-V", "--version"):
        print(_version())
        return 0
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    if command == "train":
        from .train.cli import main as train_main

        return train_main(rest)
    if command == "plan":
        from .plan.cli import main as plan_main

        return plan_main(rest)
    print(f"tiledmlp: unknown command {command!r}\n{_USAGE}", end="", file=sys.stderr)
    return 2


def _version() -> str:
    """This package's version and the versions its exactness depends on, for bug reports."""
    import torch
    import transformers

    from . import __version__

    return f"tiledmlp {__version__} (torch {torch.__version__}, transformers {transformers.__version__})"


if __name__ == "__main__":
    sys.exit(main())
