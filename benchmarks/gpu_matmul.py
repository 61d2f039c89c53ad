"""What a float32 weight-grad sum costs inside the matmul, per layout, at the seeds' tile shapes (one short GPU call).

On an H100 (131k tokens, 4 tiles of 32k) the tiled GLU's weight-grad products that accumulate into a float32 sum
(``addmm`` with ``out_dtype=float32``, beta 1) took 4.70 ms each where a bf16-output product of the same operands
took 4.29-4.62 ms: the float32 rows of the step cost 10.7 ms over bf16 sums, more than the accumulator's traffic
(0.4 GB per product) explains. cuBLASLt picks its kernel per layout and output type, so each variant here forms one
tile's gate weight grad ``d[T, I]^T @ x[T, H]`` (and the down grad ``go[T, H]^T @ h[T, I]``):

- ``bf16``: ``torch.mm`` into a new bf16 result (the untiled backward's product);
- ``bf16_acc``: ``addmm_`` into a bf16 sum (``accumulate_dtype=torch.bfloat16``);
- ``f32_first`` / ``f32_acc``: ``mm``/``addmm`` with ``out_dtype=float32`` into the ``[I, H]`` sum, as ``acc_mm`` does;
- ``f32_acc_t``: the same sum kept transposed, ``[H, I]``, formed as ``x^T @ d`` (the other output layout);
- ``f32_add``: a new float32-output product, then added into the sum (two launches, the product not rounded);
- ``bf16_add``: a new bf16 product added into the float32 sum (the peers' kind of rounding, per tile).

    python benchmarks/gpu_matmul.py [--tokens 32768,8192 --hidden 4096 --inter 12288 --repeat 20]
    python benchmarks/gpu_matmul.py --tiny     # a CPU smoke run: the float32-output variants are n/a there
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from kernel_timing import device_for, interleaved_ms
from tiledmlp.precision import wide_mm_available

Step = Callable[[], object]


def variants(a: torch.Tensor, b: torch.Tensor) -> tuple[dict[str, Step | None], Step]:
    """One weight grad ``a^T @ b`` per variant (None where this device has no float32-output matmul), and a reset
    that zeroes the sums."""
    out_shape, f32 = (a.shape[1], b.shape[1]), torch.float32
    acc = torch.zeros(out_shape, dtype=f32, device=a.device)
    acc_t = torch.zeros(out_shape[::-1], dtype=f32, device=a.device)
    low = torch.zeros(out_shape, dtype=a.dtype, device=a.device)
    wide = wide_mm_available(a.device.type, a.dtype)
    steps: dict[str, Step | None] = {
        "bf16": lambda: torch.mm(a.t(), b),
        "bf16_acc": lambda: low.addmm_(a.t(), b),
        "f32_first": (lambda: torch.mm(a.t(), b, out_dtype=f32, out=acc)) if wide else None,
        "f32_acc": (lambda: torch.addmm(acc, a.t(), b, out_dtype=f32, out=acc)) if wide else None,
        "f32_acc_t": (lambda: torch.addmm(acc_t, b.t(), a, out_dtype=f32, out=acc_t)) if wide else None,
        "f32_add": (lambda: acc.add_(torch.mm(a.t(), b, out_dtype=f32))) if wide else None,
        "bf16_add": lambda: acc.add_(torch.mm(a.t(), b)),
    }
    return steps, lambda: [t.zero_() for t in (acc, acc_t, low)]


def check(steps: dict[str, Step | None], reset: Step, a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Each variant from zeroed sums against ``a^T @ b`` in float64: relative error."""
    ref = a.double().t() @ b.double()
    errors = {}
    for name, step in steps.items():
        if step is not None:
            reset()
            got = step().double()
            got = got.t() if name.endswith("_t") else got
            errors[name] = float((got - ref).norm() / ref.norm())
    return errors


def time_steps(steps: dict[str, Step], repeat: int, device: torch.device) -> dict[str, float]:
    """Median ms per step, the steps interleaved round-robin after two warm-up calls each."""
    for step in steps.values():
        step()
        step()
    return {name: statistics.median(v) for name, v in interleaved_ms(steps, repeat, device).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="32768,8192", help="tile lengths (the K of each product)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=12288)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tokens 64, hidden 32, inter 48, repeat 2")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if args.tiny:
        args.tokens, args.hidden, args.inter, args.repeat = "64", 32, 48, 2
    device = device_for(args.tiny, "gpu_matmul.py")
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {name}, torch {torch.__version__}, bf16 operands, hidden {args.hidden}, inter {args.inter}")
    rows = []
    torch.manual_seed(0)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x, d = (torch.randn(tokens, n, device=device, dtype=torch.bfloat16) for n in (args.hidden, args.inter))
        for grad, (a, b) in (("gate", (d, x)), ("down", (x, d))):  # down: go[T, H]^T @ h[T, I]
            steps, reset = variants(a, b)
            errors = check(steps, reset, a, b)
            times = time_steps({k: s for k, s in steps.items() if s is not None}, args.repeat, device)
            flop = 2 * tokens * a.shape[1] * b.shape[1]
            print(f"\n{grad} weight grad, K = {tokens} tokens, [{a.shape[1]}, {b.shape[1]}], median of {args.repeat}")
            for variant, step in steps.items():
                ms = times.get(variant)
                row = {"tokens": tokens, "grad": grad, "variant": variant, "ms": ms,
                       "tflops": None if ms is None else flop / (ms * 1e-3) / 1e12,
                       "ratio": None if ms is None else ms / times["bf16"], "rel_err": errors.get(variant)}
                rows.append(row)
                text = "n/a (no float32-output matmul here)" if ms is None else \
                    f"{ms:9.4f} ms {row['tflops']:8.1f} TFLOP/s {row['ratio']:6.3f}x bf16  rel err {row['rel_err']:.1e}"
                print(f"  {variant:<10} {text}", flush=True)
        del x, d
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
