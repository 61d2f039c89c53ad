"""What is alive at the peak of one training step on a GPU: the allocator's history replayed, blocks grouped by site.

The Llama-3.2-1B-shaped model of ``offload_gpu.py`` (bf16, AdamW with its state created, checkpointing, tiled MLP +
tiled loss), one step recorded with ``torch.cuda.memory._record_memory_history`` per (tokens, mode). The trace is
replayed (``alloc`` adds, ``free_completed`` subtracts) to find the moment of the peak; the blocks alive then are
grouped by where they were allocated (the innermost frames in tiledmlp / transformers / torch.utils.checkpoint;
blocks made by autograd's C++ backward have no Python frame and are grouped by size).

    python benchmarks/gpu_peak.py --seq 128k,256k --modes plain,offload [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_gpu import LLAMA_1B, build, tokens  # noqa: E402

import tiledmlp  # noqa: E402

GIB = 2**30
KEEP = ("tiledmlp/", "transformers/", "torch/utils/checkpoint", "benchmarks/")


def site(frames: list[dict]) -> str:
    """Up to three innermost frames from our code, transformers or checkpointing, innermost first."""
    picked = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in frames
              if any(k in f["filename"] for k in KEEP)][:3]
    return " < ".join(picked) if picked else "(no python frame)"


def replay(trace: list[dict], baseline: int) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the event that reached it, blocks alive then) from one device's trace."""
    live: dict[int, dict] = {}
    now = best = baseline
    best_at, best_live = -1, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > best:
                best, best_at, best_live = now, i, dict(live)
        elif e["action"] == "free_completed":  # a block from before the record was part of the baseline
            now -= live.pop(e["addr"], e)["size"]
    return best, best_at, best_live


def report(trace: list[dict], baseline: int, measured: int, rows: int) -> list[str]:
    peak, at, live = replay(trace, baseline)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        key = site(e.get("frames", []))
        if key == "(no python frame)":
            key += f" {e['size'] / 2**20:,.0f} MiB blocks"
        groups[key][0] += e["size"]
        groups[key][1] += 1
    out = [f"baseline {baseline / GIB:.2f} GiB, replayed peak {peak / GIB:.2f} GiB (allocator: {measured / GIB:.2f}), "
           f"at event {at} of {len(trace)}; allocated then: {site(trace[at].get('frames', [])) if at >= 0 else '-'}"]
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]:
        out.append(f"  {size / GIB:7.3f} GiB  {count:4d}  {key}")
    small = sum(s for s, _ in list(groups.values())[rows:])
    out.append(f"  (alive above baseline: {(peak - baseline) / GIB:.3f} GiB in {len(live)} blocks)")
    return out + ([f"  ({small / GIB:.3f} GiB in smaller groups)"] if small else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="128k,256k")
    parser.add_argument("--modes", default="plain,offload")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", default=None, help="folder for the pickled snapshots (large)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_peak.py needs CUDA (the allocator's history)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    seqs = [tokens(s) for s in args.seq.split(",")]
    model = build(LLAMA_1B, max(seqs), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # AdamW's state exists from here on, as in every step after the first
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    warm = torch.randint(0, LLAMA_1B["vocab_size"], (1, 4096), device=device)
    model(input_ids=warm, labels=warm).loss.backward()  # compiles the pointwise kernels outside the record
    opt.zero_grad(set_to_none=True)
    for seq in seqs:
        ids = torch.randint(0, LLAMA_1B["vocab_size"], (1, seq), device=device)
        for mode in args.modes.split(","):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            start = time.perf_counter()
            ctx = tiledmlp.offload_activations(model, checkpointing=False) if mode == "offload" \
                else contextlib.nullcontext()
            with ctx:
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"== {seq} tokens, {mode}: {seconds:.1f} s", flush=True)
            trace = snap["device_traces"][torch.cuda.current_device()]
            for line in report(trace, baseline, torch.cuda.max_memory_allocated(), args.rows):
                print(line, flush=True)
            if args.out:
                import pickle

                Path(args.out).mkdir(parents=True, exist_ok=True)
                with open(Path(args.out) / f"snapshot-{seq}-{mode}.pickle", "wb") as f:
                    pickle.dump(snap, f)
            del snap, trace
    return 0


if __name__ == "__main__":
    sys.exit(main())
