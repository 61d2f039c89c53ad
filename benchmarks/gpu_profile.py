"""CUDA kernel-time profile of one tiled LlamaMLP fwd+bwd (seeds' shape), the top kernels as a table.

    python benchmarks/gpu_profile.py --seq 8192 --shards 4 [--impl tiledmlp|untiled|deepspeed|liger]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tiledmlp.bench.configs import Config, make_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--shards", default="4")
    p.add_argument("--impl", default="tiledmlp")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    cfg = Config("swiglu", 4096, 12288, args.seq, 1, "bfloat16", args.impl, args.shards, "cuda")
    step = make_step(**cfg.kwargs())
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{args.impl} seq {args.seq} shards {args.shards}: CUDA kernel time {total / 1000:.2f} ms")
    print(events.table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
