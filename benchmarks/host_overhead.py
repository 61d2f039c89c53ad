"""Host (Python) time of one tiled MLP step, which a GPU waits on wherever the host is not ahead of it.

Tiny shapes, so the kernels cost next to nothing and what is timed is the host's work: the forward call up to
its first matmul (the GPU is idle until then: the step starts from a synchronised device), the whole forward,
the backward call up to its first matmul (tiled: a Python ``torch.mm``; autograd's own untiled matmuls are not
seen), the whole backward; untiled alongside. Medians over interleaved steps.

    .venv/bin/python benchmarks/host_overhead.py [--steps 500] [--shards 4] [--eager]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tiledmlp
from tiledmlp import adapters, pointwise
from tiledmlp.bench.configs import build_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--eager", action="store_true", help="eager tiles instead of the compiled kernels")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pointwise.set_fused(not args.eager)
    tiled, plain = build_mlp("swiglu", 64, 192, torch.float32), build_mlp("swiglu", 64, 192, torch.float32)
    tiledmlp.patch(tiled, num_shards=args.shards)
    x = torch.randn(1, 256, 64, requires_grad=True)
    first: dict[str, float] = {}
    linear, mm = F.linear, torch.mm

    def spy(real, key):
        def call(*a, **k):
            first.setdefault(key, time.perf_counter())
            return real(*a, **k)
        return call

    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in ("fwd_first", "fwd", "bwd_first", "bwd")}
                                                for n in ("tiled", "untiled")}
    try:
        adapters.F.linear = spy(linear, "fwd")  # the GLU path's projections; untiled: nn.Linear's own F.linear
        F.linear = spy(linear, "fwd")
        for step in range(args.steps + 50):
            for name, model in (("tiled", tiled), ("untiled", plain))[:: 1 if step % 2 else -1]:
                first.clear()
                t0 = time.perf_counter()
                out = model(x)
                t1 = time.perf_counter()
                grad = torch.ones_like(out)
                torch.mm = spy(mm, "bwd")
                t2 = time.perf_counter()
                out.backward(grad)
                t3 = time.perf_counter()
                torch.mm = mm
                x.grad = None
                for p in model.parameters():
                    p.grad = None
                if step >= 50:
                    got = times[name]
                    got["fwd_first"].append(first["fwd"] - t0)
                    got["fwd"].append(t1 - t0)
                    got["bwd_first"].append(first.get("bwd", t3) - t2)
                    got["bwd"].append(t3 - t2)
    finally:
        adapters.F.linear = F.linear = linear
        torch.mm = mm
    print(f"host time per step, median of {args.steps} (us; {args.shards} tiles, "
          f"{'eager' if args.eager else 'compiled'} tiles)")
    print(f"{'':8} {'fwd->1st mm':>12} {'fwd':>8} {'bwd->1st mm':>12} {'bwd':>8}")
    for name, got in times.items():
        row = [statistics.median(got[k]) * 1e6 for k in ("fwd_first", "fwd", "bwd_first", "bwd")]
        bwd_first = f"{row[2]:12.1f}" if name == "tiled" else f"{'-':>12}"
        print(f"{name:8} {row[0]:12.1f} {row[1]:8.1f} {bwd_first} {row[3]:8.1f}")


if __name__ == "__main__":
    main()
