"""CUDA kernel-time profile of one tiled LlamaMLP fwd+bwd (seeds' shape) or of the tiled loss, top kernels.

    python benchmarks/gpu_profile.py --seq 8192 --shards 4 [--impl tiledmlp|untiled|deepspeed|liger]
    python benchmarks/gpu_profile.py --loss --seq 32768          # tiled loss, hidden 2048, vocab 128256
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
    p.add_argument("--loss", action="store_true", help="profile tiled_causal_lm_loss instead of the MLP")
    args = p.parse_args()
    step = _loss_step(args.seq) if args.loss else make_step(
        **Config("swiglu", 4096, 12288, args.seq, 1, "bfloat16", args.impl, args.shards, "cuda").kwargs())
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


def _loss_step(tokens: int, hidden: int = 2048, vocab: int = 128256):
    import tiledmlp

    h = torch.randn(tokens, hidden, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")

    def step() -> None:
        tiledmlp.tiled_causal_lm_loss(h, w, y, shift=False).backward()
        h.grad = w.grad = None

    return step


if __name__ == "__main__":
    main()
