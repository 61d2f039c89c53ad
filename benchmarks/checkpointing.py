"""Tiled vs untiled SwiGLU blocks under non-reentrant activation checkpointing: time, peak memory, MLP recomputes.

Each block is ``h + checkpoint(mlp, h)`` (transformers' LlamaMLP). Tiled, the checkpoint's recompute stops at
the MLP's input (the last tensor the block saves), so the tiled MLP is not run a second time; ``early-stop off``
(``torch.utils.checkpoint.set_checkpoint_early_stop(False)``) shows what that recompute would cost. Times are
CPU seconds of one torch thread, configurations interleaved, medians; peaks are the torch profiler's exact
allocation peaks (``tiledmlp.measure.profiler_peak_bytes``).

    .venv/bin/python benchmarks/checkpointing.py [--tokens 8192] [--hidden 1024] [--intermediate 2816]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import tiledmlp
from tiledmlp import glu
from tiledmlp.bench.timing import time_interleaved
from tiledmlp.measure import profiler_peak_bytes

MIB = 2**20


def make_step(blocks: int, tokens: int, hidden: int, intermediate: int, shards: int, early_stop: bool
              ) -> Callable[[], None]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate)
    mlps = nn.ModuleList(LlamaMLP(config) for _ in range(blocks))
    if shards > 1:
        tiledmlp.patch(mlps, num_shards=shards)
    x = torch.randn(1, tokens, hidden, requires_grad=True)

    def step() -> None:
        with contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False):
            h = x
            for mlp in mlps:
                h = h + checkpoint(mlp, h, use_reentrant=False)
            h.sum().backward()
        x.grad = None
        mlps.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = dict(blocks=args.blocks, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate)
    steps = {
        "untiled": make_step(**shape, shards=1, early_stop=True),
        f"tiled x{args.shards}": make_step(**shape, shards=args.shards, early_stop=True),
        f"tiled x{args.shards}, early-stop off": make_step(**shape, shards=args.shards, early_stop=False),
    }
    gate_up_calls = {}
    original = glu.GLUWeights.gate_up
    for name, step in steps.items():
        calls = [0]

        def counting(self, t, calls=calls):
            calls[0] += 1
            return original(self, t)

        glu.GLUWeights.gate_up = counting
        try:
            step()
        finally:
            glu.GLUWeights.gate_up = original
        gate_up_calls[name] = calls[0] // args.blocks
    peaks = {name: profiler_peak_bytes(step) for name, step in steps.items()}
    times = time_interleaved(steps, repeat=args.repeat, warmup=0, clock=time.process_time)
    base_t, base_m = statistics.median(times["untiled"]), peaks["untiled"]
    print(f"{args.blocks} checkpointed SwiGLU blocks, {args.tokens} tokens, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, float32, 1 thread, median of {args.repeat}")
    print(f"{'':28s} {'s/step':>8s} {'time':>6s} {'peak MiB':>9s} {'peak':>6s} {'gate/up calls per block':>24s}")
    for name in steps:
        t = statistics.median(times[name])
        calls = gate_up_calls[name] if name != "untiled" else "-"
        print(f"{name:28s} {t:8.2f} {t / base_t:5.2f}x {peaks[name] / MIB:9.1f} {peaks[name] / base_m:5.2f}x "
              f"{calls!s:>24s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
