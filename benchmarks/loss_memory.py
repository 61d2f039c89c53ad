"""Peak memory of one causal-LM loss step (lm_head + cross-entropy, forward + backward): untiled vs tiled.

Default: SmolLM2-135M's head (hidden 576, vocab 49152), 16k tokens, float32, CPU. Peaks are exact allocation
peaks above the pre-step baseline (hidden states, weight and labels already allocated), from the torch
profiler's memory events (``tiledmlp.measure.profiler_peak_bytes``); gradients created by the step count.

    .venv/bin/python benchmarks/loss_memory.py [--tokens 16384] [--vocab 49152] [--hidden 576] [--check 0.2]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from tiledmlp.loss import plan_loss_tiles, tiled_causal_lm_loss
from tiledmlp.measure import profiler_peak_bytes

MIB = 2**20


def untiled_step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    """What a Hugging Face causal LM does: full logits, float upcast, shift, mean cross-entropy, backward."""
    logits = F.linear(hidden, weight).float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)
    del logits
    loss.backward()


def tiled_step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_shards: object) -> None:
    tiled_causal_lm_loss(hidden, weight, labels, num_shards=num_shards).backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1, help="the tokens are split into this many sequences")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-shards", default="auto", help="'auto' or an int")
    parser.add_argument("--check", type=float, default=None, help="exit 1 if tiled/untiled exceeds this ratio")
    args = parser.parse_args(argv)
    num_shards: object = args.num_shards if args.num_shards == "auto" else int(args.num_shards)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    seq = args.tokens // args.batch
    hidden = torch.randn(args.batch, seq, args.hidden, dtype=dtype, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.batch, seq))

    def run(step):  # type: ignore[no-untyped-def]
        hidden.grad = weight.grad = None
        return profiler_peak_bytes(step, device="cpu")

    tiles = len(plan_loss_tiles(args.batch * (seq - 1), args.vocab, num_shards))
    untiled = run(lambda: untiled_step(hidden, weight, labels))
    tiled = run(lambda: tiled_step(hidden, weight, labels, num_shards))
    ratio = tiled / untiled
    print(f"loss step peak, {args.batch}x{seq} tokens, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}, "
          f"{tiles} tiles (num_shards={args.num_shards})")
    print(f"untiled: {untiled / MIB:9.1f} MiB")
    print(f"tiled:   {tiled / MIB:9.1f} MiB")
    print(f"ratio:   {ratio:9.3f}")
    if args.check is not None and ratio > args.check:
        print(f"FAIL: ratio {ratio:.3f} > {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
