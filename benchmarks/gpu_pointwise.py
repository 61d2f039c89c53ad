"""Which formulation of the tiled GLU's elementwise backward runs fastest on this GPU (one short CUDA call).

On an H100 the compiled in-place backward of a 32k-token tile (``glu_backward_``: reads dh, gate, up, overwrites
all three) moved its 6 passes at ~1.25 TB/s while the compiled forward product ran at ~2.5 TB/s. Each variant here
computes d_gate = dh*up*act'(gate), d_up = dh*act(gate) and the product act(gate)*up for one tile, is checked
against a float32 eager reference first, then all are timed interleaved (CUDA events, median):

- ``tiledmlp``: the library's ``glu_backward_`` as the tiled MLP calls it (dynamic shapes, in place);
- ``static``: the same body compiled with ``dynamic=False`` (do the dynamic shapes cost bandwidth?);
- ``outofplace``: compiled, returning three new tensors (are the in-place writes the slowdown?);
- ``two_kernels``: the product into a new tensor, then the two grads in place (8 passes, not 6);
- ``manual``: silu only, a hand-derived formula in float32, in place (is the vjp-derived graph the problem?);
- ``eager``: ``torch.autograd.grad`` through ``act(gate) * up`` (what DeepSpeed/Liger effectively run);
- ``forward``: ``glu_product`` (3 passes), the bandwidth to aim for.

GB/s counts 6 passes of a tile for every backward variant and 3 for the forward.

    python benchmarks/gpu_pointwise.py --out pointwise.json [--rows 32768,8192,2048 --cols 12288 --act gelu_tanh]
    python benchmarks/gpu_pointwise.py --tiny      # a CPU smoke run: tiny float32 shapes, wall-clock timing
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from kernel_timing import device_for, interleaved_ms
from tiledmlp import pointwise

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tensors]
ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": torch.nn.GELU(approximate="tanh")}  # a module: the library needs a shareable key


def variants(act: Callable[[torch.Tensor], torch.Tensor], silu: bool, compiled: bool = True) -> dict[str, Variant]:
    """Each variant takes (dh, gate, up) and returns (d_gate, d_up, product); built per shape, so each compiled one
    is compiled for that shape (``dynamic=False`` functions have code objects of their own per variant)."""
    key = pointwise.fusable_activation(act)

    def tiledmlp(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors:
        pointwise.glu_backward_(key, dh, gate, up)
        return gate, up, dh

    def static(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
        pointwise._backward_(act, dh, gate, up)

    def outofplace(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors:
        h, vjp = torch.func.vjp(lambda g, u: act(g) * u, gate, up)
        d_gate, d_up = vjp(dh)
        return d_gate, d_up, h

    def product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up

    def grads_(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
        _, vjp = torch.func.vjp(lambda g, u: act(g) * u, gate, up)
        d_gate, d_up = vjp(dh)
        gate.copy_(d_gate)
        up.copy_(d_up)

    def manual_(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
        d, g, u = dh.float(), gate.float(), up.float()
        s = torch.sigmoid(g)  # all three before any write: in float32 .float() aliases the inputs
        d_gate, d_up, h = d * u * s * (1 + g * (1 - s)), d * g * s, g * s * u
        gate.copy_(d_gate)
        up.copy_(d_up)
        dh.copy_(h)

    def eager(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors:
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            h = act(g) * u
            d_gate, d_up = torch.autograd.grad(h, (g, u), dh)
        return d_gate, d_up, h.detach()

    # --tiny runs this script's own formulations eagerly (their math checked; each CPU compile costs seconds) and
    # only the library's kernels compiled
    build = functools.partial(torch.compile, dynamic=False) if compiled else (lambda fn: fn)
    static_c, outofplace_c, manual_c = build(static), build(outofplace), build(manual_)
    product_c, grads_c = build(product), build(grads_)

    def two_kernels(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors:
        h = product_c(gate, up)
        grads_c(dh, gate, up)
        return gate, up, h

    def forward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors:
        return gate, up, pointwise.glu_product(key, act, gate, up, True)  # the grads are not its job: not compared

    out: dict[str, Variant] = {
        "tiledmlp": tiledmlp,
        "static": lambda dh, g, u: (static_c(dh, g, u), (g, u, dh))[1],
        "outofplace": outofplace_c,
        "two_kernels": two_kernels,
    }
    if silu:
        out["manual"] = lambda dh, g, u: (manual_c(dh, g, u), (g, u, dh))[1]
    out["eager"] = eager
    out["forward"] = forward
    return out


def reference(act: Callable[[torch.Tensor], torch.Tensor], dh: torch.Tensor, gate: torch.Tensor,
              up: torch.Tensor) -> Tensors:
    """(d_gate, d_up, product) by float32 eager autograd from the same (rounded) inputs."""
    with torch.enable_grad():
        g, u = gate.float().requires_grad_(), up.float().requires_grad_()
        h = act(g) * u
        d_gate, d_up = torch.autograd.grad(h, (g, u), dh.float())
    return d_gate, d_up, h.detach()


def errors(got: Tensors, ref: Tensors, product_only: bool) -> tuple[float, float]:
    """Largest |got - ref| over the outputs compared, and the largest |ref| among them."""
    pairs = list(zip(got, ref))[2:] if product_only else list(zip(got, ref))
    err = max(float((a.float() - b).abs().max()) for a, b in pairs)
    return err, max(float(b.abs().max()) for _, b in pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32768,8192,2048",  # the largest first: a run cut by its time limit keeps it
                   help="tile lengths (tokens), comma-separated, run in this order")
    p.add_argument("--cols", type=int, default=12288, help="intermediate size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--act", default="silu", choices=sorted(ACTS))
    p.add_argument("--repeat", type=int, default=20, help="timed rounds (variants interleaved)")
    p.add_argument("--flush", action="store_true", help="evict L2 (write 256 MiB) before each timed call")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: rows 16, cols 64, float32, repeat 2; this script's own formulations run "
                        "eagerly, the library's kernels compiled")
    p.add_argument("--out", default=None, help="write the table as JSON here (after each shape)")
    args = p.parse_args()
    if args.tiny:
        args.rows, args.cols, args.dtype, args.repeat = "16", 64, "float32", 2
    device = device_for(args.tiny, "gpu_pointwise.py")
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    act = ACTS[args.act]
    pointwise.set_fused(True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.dtype}, act {args.act}, cols {args.cols}", flush=True)
    meta = {"device": name, "torch": torch.__version__, "dtype": args.dtype, "act": args.act, "cols": args.cols,
            "repeat": args.repeat, "tiny": args.tiny, "flush": args.flush}
    rows_out: list[dict] = []
    flush = torch.empty(64 << 20, dtype=torch.float32, device=device) if args.flush and cuda else None
    torch.manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        rows_out += run_shape(act, args.act == "silu", rows, args.cols, dtype, device, args.repeat, flush)
        if cuda:
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows_out}, f, indent=1)


@torch.no_grad()
def run_shape(act: Callable[[torch.Tensor], torch.Tensor], silu: bool, rows: int, cols: int, dtype: torch.dtype,
              device: torch.device, repeat: int, flush: torch.Tensor | None) -> list[dict]:
    """Check, warm up and time every variant at one tile shape; print and return its rows."""
    saved = tuple(torch.randn(rows, cols, device=device).to(dtype) for _ in range(3))  # dh, gate, up
    work = tuple(t.clone() for t in saved)
    ref = reference(act, *saved)
    itemsize = saved[0].element_size()
    table: dict[str, dict] = {}
    live: dict[str, Variant] = {}

    def refill() -> None:  # untimed: in-place variants overwrote their inputs
        for w, s in zip(work, saved):
            w.copy_(s)
        if flush is not None:
            flush.zero_()

    for name, fn in variants(act, silu, compiled=device.type == "cuda").items():
        row = {"rows": rows, "cols": cols, "variant": name, "ms": None, "gbps": None, "ratio": None,
               "max_abs_err": None, "ref_max": None, "rel_err": None, "note": ""}
        table[name] = row
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(2):  # the first call compiles; its result is the one checked
                    refill()
                    got = fn(*work)
                    if i == 0:
                        err, big = errors(got, ref, name == "forward")
                    del got
            if any("could not build" in str(w.message) for w in caught):
                row["note"] = "compile failed: ran eagerly"
        except Exception as exc:  # noqa: BLE001 -- an Inductor/Dynamo failure marks the variant, not the run
            row["note"] = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            continue
        row.update(max_abs_err=err, ref_max=big, rel_err=err / big if big else err)
        live[name] = fn
    times = interleaved_ms({name: functools.partial(fn, *work) for name, fn in live.items()}, repeat, device,
                           before=refill)
    numel = rows * cols
    for name, samples in times.items():
        ms = statistics.median(samples)
        passes = 3 if name == "forward" else 6
        table[name].update(ms=ms, gbps=passes * numel * itemsize / (ms * 1e-3) / 1e9)
    base = table["tiledmlp"]["ms"]
    for row in table.values():
        if row["ms"] is not None and base:
            row["ratio"] = row["ms"] / base
    print(f"\nrows {rows} x cols {cols} ({saved[0].dtype}), median of {repeat}")
    print(f"{'variant':<12} {'ms':>9} {'GB/s':>8} {'x tiledmlp':>10} {'max abs err':>11} {'rel err':>9}  note")
    for name, r in table.items():
        if r["ms"] is None:
            print(f"{name:<12} {'-':>9} {'-':>8} {'-':>10} {'-':>11} {'-':>9}  {r['note']}")
            continue
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{name:<12} {r['ms']:>9.4f} {r['gbps']:>8.1f} {ratio:>10} {r['max_abs_err']:>11.3e} "
              f"{r['rel_err']:>9.2e}  {r['note']}", flush=True)
    del saved, work, ref, live
    return list(table.values())


if __name__ == "__main__":
    main()
