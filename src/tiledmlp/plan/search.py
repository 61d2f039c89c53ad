"""The longest sequence whose plan fits a budget: ``tiledmlp plan``'s ``max seq`` and ``tiledmlp train``'s fit report.

The planned peak does not only rise with the length. Where a tile plan splits into one more tile, the largest tile
shrinks, and the peak can drop: by 0.8 GiB where SmolLM2's RMSNorms start running in row tiles (116,736 tokens),
by tens of MiB where the tiled loss takes one more tile. A doubling-then-bisecting search, which assumes a rising
peak, stopped below such a drop (7 GiB: 111,616 tokens reported while 129,024 fit). The peak does rise with the
length while the tile plans keep their sizes (:func:`~tiledmlp.plan.model.predict_with_tiles`), so every length
in a stretch ``[lo, hi]`` plans at least the peak of ``lo`` with each tile as small as it can get in the stretch:
its count at ``hi`` spread over ``lo``'s tokens, in each state (tiled or not) the stretch holds. A stretch whose
floor is over the budget holds no fitting length; the search splits the others, highest first.
"""

from __future__ import annotations

import math
from typing import Iterator

from ..tiling import plan_shards
from .model import Tiles, norm_tiles, predict_with_tiles, step_tiles
from .setup import Setup
from .shapes import ModelShape

__all__ = ["max_seq_that_fits", "searched_limit", "step_of", "MAX_TOKENS", "SEARCH_LIMIT"]

STEP = 1024  # max_seq is reported to this many tokens
# Tokens per device step (batch x seq) the plan evaluates: past it the tile-size lists of a tiny model's tiled
# recipes alone take gigabytes (2**31 tokens: about 10 s and 0.9 GB here)
MAX_TOKENS = 2**31
SEARCH_LIMIT = 2**24  # max_seq's search stops here; a recipe that fits it is reported as ">= SEARCH_LIMIT"


def step_of(sp: int) -> int:
    """max_seq's granularity: a multiple of 1024 tokens and of the SP size."""
    return math.lcm(STEP, sp)


def searched_limit(setup: Setup, batch: int = 1, limit: int = SEARCH_LIMIT) -> int:
    """The longest sequence :func:`max_seq_that_fits` tries: ``limit`` (and ``MAX_TOKENS`` over the batch) rounded
    down to its step. A result equal to it means "this or longer"."""
    step = step_of(setup.sequence_parallel_size)
    return min(limit, MAX_TOKENS // batch) // step * step


def _spread(tokens: int, count: int) -> int:
    """Tokens of the largest of ``count`` even tiles over ``tokens``."""
    return -(-tokens // count)


def _floors(shape: ModelShape, setup: Setup, lo: int, hi: int, last: Tiles, batch: int) -> Iterator[Tiles]:
    """Tile plans no larger than those of any length in ``[lo, hi]`` (``last``: ``hi``'s): each count at ``hi``
    (counts never fall as the length grows) spread over ``lo``'s tokens, one plan per state the stretch may hold
    (norms tiled at ``lo`` or ``hi``; the MLP untiled, then tiled: its planner's choice flips near its threshold)."""
    t = batch * lo // setup.sequence_parallel_size
    first = len(norm_tiles(shape, setup, t))
    norms = {(1, t) if n == 1 else (n, _spread(t, last.norm_tiles)) for n in (first, last.norm_tiles)}
    loss = (last.loss_tiles, _spread(t, last.loss_tiles)) if last.loss_tiles else (0, 0)
    for n, rows in norms:
        yield Tiles(n, rows, None, 0, *loss, last.head_groups)
    count = len(last.mlp) if last.mlp else _mlp_count(shape, setup, batch * hi // setup.sequence_parallel_size)
    if count > 1 and t > 1:  # tiled somewhere in the stretch, in at most hi's count of tiles
        size = _spread(t, count)
        mlp = [size] * (t // size) + ([t % size] if t % size else [])
        for n, rows in norms:
            yield Tiles(n, rows, mlp, t // count, *loss, last.head_groups)


def _mlp_count(shape: ModelShape, setup: Setup, tokens: int) -> int:
    """The MLP tiles ``patch()`` would make of ``tokens`` were tiling not refused where it saves nothing (1 where
    the MLP is not tiled, or ``--tiled_mlp_target_gb`` gives one tile)."""
    if not setup.tiled_mlp or setup.mlp_target_gb is not None:
        return 1
    return len(plan_shards(tokens, num_shards=setup.mlp_num_shards, hidden_size=shape.hidden))


class _Plans:
    """One recipe's plans by length, each length's tile plans made once (long ones are most of the search's time)."""

    def __init__(self, shape: ModelShape, setup: Setup, batch: int) -> None:
        self.shape, self.setup, self.batch = shape, setup, batch
        self._tiles: dict[int, Tiles] = {}
        self._peaks: dict[int, int] = {}

    def tiles(self, seq: int) -> Tiles:
        if seq not in self._tiles:
            self._tiles[seq] = step_tiles(self.shape, self.setup, seq, self.batch)
        return self._tiles[seq]

    def peak(self, seq: int) -> int:
        if seq not in self._peaks:
            self._peaks[seq] = predict_with_tiles(self.shape, self.setup, seq, self.batch, self.tiles(seq)).peak_bytes
        return self._peaks[seq]

    def floors(self, lo: int, hi: int) -> Iterator[int]:
        """Peaks of which the least is a lower bound on the plan of every sequence length in ``[lo, hi]``."""
        for tiles in _floors(self.shape, self.setup, lo, hi, self.tiles(hi), self.batch):
            yield predict_with_tiles(self.shape, self.setup, lo, self.batch, tiles).peak_bytes


def max_seq_that_fits(shape: ModelShape, setup: Setup, budget_bytes: float, batch: int = 1,
                      limit: int = SEARCH_LIMIT) -> int:
    """The longest multiple of 1024 tokens (and of the SP size) up to :func:`searched_limit` whose predicted peak
    fits; 0 if none does. Shorter lengths may not fit (the peak can drop as tiles split: module docstring)."""
    step = step_of(setup.sequence_parallel_size)
    top = searched_limit(setup, batch, limit) // step
    plans = _Plans(shape, setup, batch)
    if top >= 1 and plans.peak(top * step) <= budget_bytes:  # the caller reports ">= top * step"
        return top * step
    stretches = [(1, top)] if top > 1 else []  # in steps; popped highest first
    while stretches:
        lo, hi = stretches.pop()
        if plans.peak(hi * step) <= budget_bytes:
            return hi * step
        if lo == hi or all(floor > budget_bytes for floor in plans.floors(lo * step, hi * step)):
            continue
        # split wide stretches at their geometric middle (long lengths are the costly ones to plan); the upper
        # part keeps hi, whose plans are made
        mid = math.isqrt(lo * hi) if hi > 4 * lo else (lo + hi) // 2
        stretches += [(lo, mid), (mid + 1, hi)]
    return 0
