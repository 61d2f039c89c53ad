"""``tiledmlp train``: long-sequence fine-tuning with tiled MLPs (and a tiled loss) on ``transformers.Trainer``.

The command is :func:`tiledmlp.train.cli.main`; :func:`prepare` and :func:`run` are the same steps for callers
that build their arguments in Python.
"""

from .args import DataArguments, ModelArguments, TilingArguments, UsageError, parse_args

__all__ = ["ModelArguments", "DataArguments", "TilingArguments", "UsageError", "parse_args", "prepare", "run"]


def __getattr__(name: str) -> object:  # lazy: importing Trainer is slow and the parent of --compare never trains
    if name in ("prepare", "run"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)
