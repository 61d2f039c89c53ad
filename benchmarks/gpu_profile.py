"""CUDA kernel-time profile of one tiled LlamaMLP fwd+bwd (seeds' shape) or of the tiled loss, top kernels.

    python benchmarks/gpu_profile.py --seq 8192 --shards 4 [--impl tiledmlp|untiled|deepspeed|liger]
    python benchmarks/gpu_profile.py --loss --seq 32768          # tiled loss, hidden 2048, vocab 128256
    python benchmarks/gpu_profile.py --seq 8192 --trace t.json   # + the GPU's idle gaps and the host op behind each
    python benchmarks/gpu_profile.py --seq 8192 --trace t.json --stacks   # + the Python function behind each gap

Before profiling, the step's wall time (synchronised, median of ``--wall`` runs) is printed: against the trace's
GPU span it shows the host time before the first kernel and after the last. The idle report reads the Chrome
trace: the GPU's busy time (kernels, copies, fills) against the span of the steps, and each gap before a kernel
charged to the host op that launched that kernel (innermost ``cpu_op`` and Python function around its launch),
since a gap means the host had not launched the next kernel yet.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

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
    p.add_argument("--steps", type=int, default=1, help="profiled steps (default 1)")
    p.add_argument("--trace", default=None, help="write the Chrome trace here and print the GPU's idle gaps")
    p.add_argument("--stacks", action="store_true",
                   help="record Python stacks too (names the function behind a gap, but slows the host enough to "
                        "make gaps of its own)")
    p.add_argument("--wall", type=int, default=9, help="unprofiled timed steps for the wall-time median")
    args = p.parse_args()
    step = _loss_step(args.seq) if args.loss else make_step(
        **Config("swiglu", 4096, 12288, args.seq, 1, "bfloat16", args.impl, args.shards, "cuda").kwargs())
    for _ in range(2):
        step()
    walls = []
    for _ in range(args.wall):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    if walls:
        print(f"{args.impl} seq {args.seq} shards {args.shards}: wall {1000 * statistics.median(walls):.2f} ms "
              f"(median of {len(walls)} unprofiled steps)")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=args.stacks) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{args.impl} seq {args.seq} shards {args.shards}: CUDA kernel time {total / 1000:.2f} ms")
    print(events.table(sort_by="cuda_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print("\n".join(idle_report(args.trace, args.rows)))


def idle_report(path: str, rows: int) -> list[str]:
    """GPU busy vs span, and the idle gaps grouped by the host op (and Python function) that launched the next
    kernel late."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not gpu:
        return ["no GPU events in the trace"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]

    def around(t: float, tid: object, cat: str) -> str:
        inside = [e for e in host if e["cat"] == cat and e["tid"] == tid and e["ts"] <= t <= e["ts"] + e["dur"]]
        return min(inside, key=lambda e: e["dur"])["name"][:70] if inside else "-"

    busy, end, gaps = 0.0, gpu[0]["ts"], collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        gap = e["ts"] - end
        if gap > 2.0:
            launch = launches.get(e.get("args", {}).get("correlation"))
            key = "(no launch record)" if launch is None else " | ".join(
                around(launch["ts"], launch["tid"], cat) for cat in ("cpu_op", "python_function"))
            gaps[key][0] += gap
            gaps[key][1] += 1
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    span = end - gpu[0]["ts"]
    out = [f"GPU span {span / 1000:.2f} ms, busy {busy / 1000:.2f} ms, idle {(span - busy) / 1000:.2f} ms "
           f"({len(gpu)} GPU events); idle gaps > 2 us by the host op that launched the next kernel:"]
    for key, (total, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:rows]:
        out.append(f"  {total / 1000:7.3f} ms  {count:4d}  {key}")
    return out


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
