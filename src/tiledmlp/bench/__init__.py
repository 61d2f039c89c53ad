"""``tiledmlp bench``: regular-vs-tiled speed and memory of one MLP, with peer implementations in the same run.

Memory of each configuration is measured in a fresh subprocess (:func:`tiledmlp.measure.measure_in_subprocess`);
times are measured round-robin in one process so that machine load hits every variant alike.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point; see ``tiledmlp bench --help``."""
    from .cli import main as _main

    return _main(argv)
