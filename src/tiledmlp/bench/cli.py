"""``tiledmlp bench``: argument parsing and the run (memory in subprocesses, then interleaved timing)."""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import time
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .. import measure
from .configs import (IMPLS, MLPS, Config, build_forward, build_inputs, peer_available, plan_for, predicted_bytes,
                      step_for)
from .from_model import mlp_of_model
from .report import OUTPUTS, MiB, cell, columns, write_outputs
from .timing import median_ms, time_interleaved

__all__ = ["main", "build_parser", "resolve", "resolve_device", "out_note", "UsageError", "SEEDS"]

# The seeds' published table (ms-swift PR #7090): one MLP, hidden 4096, intermediate 12288, bf16, 4 shards.
SEEDS = {"hidden": 4096, "intermediate": 12288, "dtype": "bfloat16", "shards": "4", "mlp": "swiglu",
         "seq": [2048 * 2**k for k in range(7)]}
CPU_SEQ_SCALE = 64


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value is a usage error naming the flag, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated ints >= 1, at least one."""
    try:
        values = [_positive_int(t) for t in text.split(",") if t.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The ``tiledmlp bench`` options; unset ones fall back to the preset, then to the defaults shown."""
    p = argparse.ArgumentParser(
        prog="tiledmlp bench", description="Regular vs tiled MLP, side by side: median fwd+bwd time and peak memory "
        "per sequence length and tile count, as ratios to untiled at the same length (bench.md, bench.json, "
        "bench.png under --out).")
    p.add_argument("--hidden", type=_positive_int, help="hidden size (default 1024)")
    p.add_argument("--intermediate", type=_positive_int, help="intermediate size (default 2816)")
    p.add_argument("--seq", type=_positive_ints,
                   help="comma-separated sequence lengths (default 2048,4096,8192,16384)")
    p.add_argument("--shards", help="comma-separated shard requests, ints or 'auto' (default 4,auto)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--mlp", choices=MLPS, help="default swiglu (LlamaMLP); geglu = GemmaMLP; gpt2 = GPT2MLP; "
                   "swiglu-lora = LlamaMLP with PEFT LoRA (rank 16) on its projections, base weights frozen; "
                   "swiglu-lora-dropout = the same with lora_dropout 0.05; swiglu-qlora = the same LoRA over "
                   "bitsandbytes NF4 base weights computing in --dtype (pip install 'tiledmlp[qlora]'); "
                   "swiglu-fused = Phi3MLP (one gate_up projection); moe = Qwen3-MoE's sparse block (router + "
                   "SwiGLU experts of width --intermediate)")
    p.add_argument("--experts", type=_positive_int, help="--mlp moe: routed experts (default 8)")
    p.add_argument("--top_k", type=_positive_int, help="--mlp moe: the experts each token is routed to (default 2)")
    p.add_argument("--impls", default="untiled,tiledmlp,tiledmlp-generic,deepspeed",
                   help=f"comma-separated, from {','.join(IMPLS)} (default untiled,tiledmlp,tiledmlp-generic,"
                        "deepspeed); unavailable peers are skipped with a note")
    p.add_argument("--repeat", type=_positive_int, default=5, help="timed fwd+bwd per variant (median reported)")
    p.add_argument("--out", default="bench-out", help="directory for bench.md, bench.json, bench.png")
    p.add_argument("--preset", choices=["seeds"], help="seeds: h4096 i12288 bf16 4 shards, seq 2k..131k")
    p.add_argument("--model", help="a model (local folder, hub id, smollm2-135m): bench its MLP, read off its config "
                   "(--mlp, --hidden, --intermediate and, where the config names one, --dtype)")
    p.add_argument("--threads", type=_positive_int,
                   help="torch CPU threads here and in the memory children (default: torch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter (synchronised on accelerators); cpu: process CPU time, for a CPU box "
                        "shared with other jobs (use with --threads 1)")
    p.add_argument("--device", help="where to run (default: the accelerator torch finds, else cpu)")
    p.add_argument("--no-rss", action="store_true", help="skip the RSS cross-check (profiler/allocator peak only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


class UsageError(ValueError):
    """A bad combination of options, found after parsing: ``main`` hands it to ``parser.error`` (exit 2)."""


def resolve_device(text: str | None) -> torch.device:
    """``--device``: the default accelerator (else CPU) when unset; a named one must exist here (a typo or a
    missing CUDA is a usage error, not a traceback from the first tensor put there)."""
    try:
        device = measure.resolve_device(text)
    except RuntimeError:
        raise UsageError(f"--device {text}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu":
        return device
    try:
        module = torch.get_device_module(device)
        count = module.device_count() if module.is_available() else 0
    except (RuntimeError, AttributeError, AssertionError):
        count = 0
    if count <= (device.index or 0):
        raise UsageError(f"--device {text}: not available here (torch finds {count} {device.type} device(s)); "
                         "pass --device cpu or leave --device out")
    return device


def _unique(values: list[Any]) -> list[Any]:
    """``values`` without repeats, in first-seen order (``--seq 64,64`` measures and prints 64 once)."""
    return list(dict.fromkeys(values))


def resolve(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    """Merge explicit flags over the preset over the defaults; returns the settings and notes to print. Raises
    :class:`UsageError` for bad shards or impls, or when every impl asked for is skipped here."""
    notes: list[str] = []
    base: dict[str, Any] = {"hidden": 1024, "intermediate": 2816, "dtype": "float32", "shards": "4,auto",
                            "mlp": "swiglu", "seq": [2048, 4096, 8192, 16384], "experts": 8, "top_k": 2}
    if args.preset == "seeds":
        base.update(SEEDS)
        if device.type == "cpu" and args.seq is None:  # an explicit --seq is run as given, and not noted as scaled
            base["seq"] = [s // CPU_SEQ_SCALE for s in SEEDS["seq"]]
            notes.append(f"--preset seeds on CPU: sequence axis scaled down {CPU_SEQ_SCALE}x "
                         f"({base['seq'][0]}..{base['seq'][-1]} instead of 2048..131072); "
                         "shapes and dtype as published")
    if args.model is not None:
        given = [f"--{k}" for k in ("preset", "mlp", "hidden", "intermediate", "experts", "top_k")
                 if getattr(args, k) is not None]
        if given:
            raise UsageError(f"--model sets the MLP and its widths; drop {', '.join(given)} (or --model)")
        try:
            read, note = mlp_of_model(args.model)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        base.update(read)
        notes.append(note)
    for key in ("hidden", "intermediate", "dtype", "shards", "mlp", "experts", "top_k"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    routing = [f"--{k}" for k in ("experts", "top_k") if getattr(args, k) is not None]
    if routing and base["mlp"] != "moe":
        raise UsageError(f"{' and '.join(routing)} size --mlp moe's experts; add --mlp moe or drop them")
    if base["top_k"] > base["experts"]:
        raise UsageError(f"--top_k {base['top_k']} routes each token to more experts than the {base['experts']} "
                         "there are (--experts)")
    if args.seq is not None:
        base["seq"] = args.seq
    base["seq"] = _unique(base["seq"])
    shards = [s.strip() for s in str(base["shards"]).split(",") if s.strip()]
    for s in shards or [str(base["shards"])]:
        if s != "auto" and not (s.isascii() and s.isdigit() and int(s) >= 1):  # "²" is a digit int() refuses
            raise UsageError(f"--shards takes comma-separated positive ints or 'auto', got {s!r}")
    base["shards"] = _unique([s if s == "auto" else str(int(s)) for s in shards])
    impls = _unique([i.strip() for i in args.impls.split(",") if i.strip()])
    if not impls:
        raise UsageError(f"--impls takes comma-separated names from {', '.join(IMPLS)}, got {args.impls!r}")
    reasons: dict[str, str] = {}
    for impl in impls:
        if impl not in IMPLS:
            raise UsageError(f"--impls: unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
        reasons[impl] = peer_available(impl, device, base["dtype"])
    skipped = [f"{impl} skipped: {why}" for impl, why in reasons.items() if why]
    base["impls"] = [impl for impl, why in reasons.items() if not why]
    if not base["impls"]:
        raise UsageError(f"nothing to run: every impl in --impls is skipped on {device} ({'; '.join(skipped)}); "
                         "add untiled or tiledmlp")
    return base, notes + skipped


def _progress(total: int, enabled: bool) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A rich progress bar (or nothing): returns ``advance(description)`` and ``close()``."""
    if not enabled:
        return (lambda _d: None), (lambda: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=False)
    task = bar.add_task("bench", total=total)
    bar.start()
    return (lambda d: bar.update(task, advance=1, description=d)), bar.stop


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its outputs; returns a process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
        settings, notes = resolve(args, device)
        if args.clock == "cpu" and device.type != "cpu":
            raise UsageError("--clock cpu only makes sense on CPU; accelerators are timed on the wall")
        taken = next((p for p in (Path(args.out), *Path(args.out).parents) if p.exists() and not p.is_dir()), None)
        if taken is not None:  # found now, not when the first length's files are written
            raise UsageError(f"--out {args.out}: {taken} is a file; give a directory (made if missing)")
        try:  # made now: a folder that cannot be made lost the measured lengths with a traceback
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: cannot make it ({exc.strerror}); give a directory you can write "
                             "to") from exc
    except UsageError as exc:
        parser.error(str(exc))  # exits 2
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, device, settings, notes)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, argv: list[str] | None, device: torch.device, settings: dict[str, Any],
         notes: list[str]) -> int:
    child_env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    out = Path(args.out)
    print(out_note(out), flush=True)
    configs = [Config(settings["mlp"], settings["hidden"], settings["intermediate"], seq, args.batch,
                      settings["dtype"], impl, "1" if impl == "untiled" else shards, str(device),
                      settings["experts"], settings["top_k"])
               for seq in settings["seq"] for impl in settings["impls"]
               for shards in (["1"] if impl == "untiled" else settings["shards"])]
    # Configurations with the same impl and the same tiles are measured once (e.g. "4" and "auto" at 4k tokens).
    unique: dict[tuple[Any, ...], Config] = {}
    for cfg in configs:
        unique.setdefault(_key(cfg), cfg)
    by_seq: dict[int, list[Config]] = {}
    for cfg in unique.values():
        by_seq.setdefault(cfg.seq, []).append(cfg)
    total = len(unique) + sum((1 + args.repeat) * len(v) for v in by_seq.values())
    advance, close = _progress(total, not args.no_progress)
    mem: dict[tuple[Any, ...], dict[str, int]] = {}
    times: dict[tuple[Any, ...], tuple[float, list[tuple[int, int]], float | None]] = {}
    meta = {"command": "tiledmlp bench " + shlex.join(argv or []),
            "hidden": settings["hidden"], "intermediate": settings["intermediate"], "dtype": settings["dtype"],
            "mlp": settings["mlp"], "batch": args.batch, "repeat": args.repeat, "clock": args.clock,
            "device": str(device), "torch": torch.__version__, "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(), "load_before": _load(),
            "notes": notes}
    if settings["mlp"] == "moe":
        meta.update(experts=settings["experts"], top_k=settings["top_k"])
    rows: list[dict[str, Any]] = []
    try:
        for seq, cfgs in by_seq.items():
            try:
                inputs = _shared_inputs(cfgs[0], device)
            except Exception as exc:  # e.g. out of memory for the input itself: the other lengths still run
                notes.append(f"seq {seq} skipped: {_last_line(exc)}")
                for _ in range(len(cfgs) * (2 + args.repeat)):  # its memory and timing steps
                    advance(f"skipped seq {seq}")
                inputs, cfgs = None, []  # nothing runs; the files are still rewritten below, with this note
            for cfg in list(cfgs):
                try:
                    mem[_key(cfg)] = _measure(cfg, device, rss=not args.no_rss, env=child_env, inputs=inputs)
                except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
                    notes.append(f"{cfg.impl} ({cfg.shards}) failed at seq {seq}: {_last_line(exc)}")
                    cfgs.remove(cfg)
                advance(f"memory  seq {seq} {cfg.impl} {cfg.shards}")
            if cfgs:
                try:
                    times.update(_time_seq(cfgs, args.repeat, device, advance, clock, inputs))
                except Exception as exc:  # the memory rows of this length stay; its times are reported missing
                    notes.append(f"timing at seq {seq} failed: {_last_line(exc)}")
            del inputs
            rows = _rows([c for c in configs if _key(c) in mem], mem, times)
            if rows:  # written after each length: a run cut short still leaves what it measured
                write_outputs(out, {**meta, "load_after": _load()}, rows)
    finally:
        close()
    if not rows:  # every configuration failed: no table to write
        print("tiledmlp bench: error: nothing ran: " + "; ".join(notes), file=sys.stderr, flush=True)
        return 1
    _print_table(rows, notes)
    print("wrote " + ", ".join(str(out / name) for name in OUTPUTS))
    return 0


def _shared_inputs(cfg: Config, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """Accelerators: one MLP and input per length, made on the device and shared by its configurations. CPU: None
    (each configuration's memory is measured in its own process)."""
    return None if device.type == "cpu" else build_inputs(cfg)


def _last_line(exc: BaseException) -> str:
    """The last non-empty line of an error (a child's traceback ends with it), cut for a one-line note."""
    last = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [type(exc).__name__]
    return last[0][:200]


def out_note(out: Path) -> str:
    """Where the outputs go, said before the run: a rerun into the same ``--out`` (the usual use) replaces them."""
    replaced = [name for name in OUTPUTS if (out / name).exists()]
    return f"tiledmlp bench: writing {', '.join(str(out / name) for name in OUTPUTS)}" + \
        (f" (replacing the {', '.join(replaced)} there)" if replaced else "")


def _measure(cfg: Config, device: torch.device, rss: bool, env: dict[str, str],
             inputs: tuple[torch.nn.Module, torch.Tensor] | None) -> dict[str, int]:
    """Peak bytes of one configuration above its step's baseline. CPU: in a fresh process (profiler + RSS), so
    one configuration cannot pollute the next. Accelerators: here, on the length's shared ``inputs``, after a
    warm-up step; the caching allocator's peak counter is exact per configuration (reset before, read after), and
    no process start or CUDA init is paid per row."""
    if inputs is None:
        return measure.measure_in_subprocess("tiledmlp.bench.configs:make_step", cfg.kwargs(), rss=rss, env=env)
    mlp, x = inputs
    step = step_for(build_forward(cfg, mlp), mlp, x)
    try:
        step()  # compiles kernels, creates library workspaces: not part of a step's peak
        return {"profiler_peak_bytes": measure.profiler_peak_bytes(step, device=device)}
    finally:
        del step
        gc.collect()
        if device.type != "cpu":
            torch.get_device_module(device).empty_cache()


def _key(cfg: Config) -> tuple[Any, ...]:
    return (cfg.seq, cfg.impl, tuple(plan_for(cfg)))


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _time_seq(cfgs: list[Config], repeat: int, device: torch.device, advance: Callable[[str], None],
              clock: Callable[[], float], inputs: tuple[torch.nn.Module, torch.Tensor] | None
              ) -> dict[tuple[Any, ...], tuple[float, list[tuple[int, int]], float | None]]:
    """Median ms of each configuration at one sequence length, all sharing one MLP and one input; per timed call
    the allocator's device allocations and retries (settling call, timed call; zeros on CPU); on CUDA the median
    device ms with a head start (else None)."""
    mlp, x = inputs if inputs is not None else build_inputs(cfgs[0])
    steps = {str(_key(c)): step_for(build_forward(c, mlp), mlp, x) for c in cfgs}
    names = {str(_key(c)): f"time  seq {c.seq} {c.impl} {c.shards}" for c in cfgs}
    events: dict[str, list[tuple[int, int]]] = {}
    device_s: dict[str, list[float]] = {}
    # accelerators: each timed call after one of its own (bench.timing), its allocator state that of a training loop;
    # on CUDA that call is timed on the device after a head start
    result = time_interleaved(steps, repeat=repeat, warmup=1, device=device, clock=clock,
                              on_step=lambda name: advance(names[name]), settle=device.type != "cpu", events=events,
                              device_seconds=device_s)
    return {_key(c): (median_ms(result[str(_key(c))]), events.get(str(_key(c)), []),
                      median_ms(device_s[str(_key(c))]) if device_s.get(str(_key(c))) else None) for c in cfgs}


def _rows(configs: list[Config], mem: dict[tuple[Any, ...], dict[str, int]],
          times: dict[tuple[Any, ...], tuple[float, list[tuple[int, int]], float | None]]) -> list[dict[str, Any]]:
    rows = []
    base: dict[int, tuple[float | None, float | None, float | None]] = {}
    for cfg in configs:
        if cfg.impl == "untiled":
            base[cfg.seq] = (times.get(_key(cfg), (None,))[0], mem[_key(cfg)].get("profiler_peak_bytes"),
                             times.get(_key(cfg), (None, None, None))[2])
    for cfg in configs:
        m, (ms, events, device_ms) = mem[_key(cfg)], times.get(_key(cfg), (None, [], None))
        peak = m["profiler_peak_bytes"]
        pred = predicted_bytes(cfg)
        base_ms, base_peak, base_device = base.get(cfg.seq, (None, None, None))
        rows.append({
            "seq": cfg.seq, "impl": cfg.impl, "shards": "-" if cfg.impl == "untiled" else cfg.shards,
            "tiles": len(plan_for(cfg)), "ms": ms, "time_ratio": ms / base_ms if ms and base_ms else None,
            "peak_mib": peak / MiB, "mem_ratio": peak / base_peak if base_peak else None,
            "rss_mib": m["rss_peak_bytes"] / MiB if "rss_peak_bytes" in m else None,
            "predicted_mib": None if pred is None else pred / MiB,
            "peak_bytes": peak, "predicted_bytes": pred,
            # device allocations + retries per timed call: (in its settling call, in the timed call itself)
            "allocator_events": events,
            "device_ms": device_ms, "device_ratio": device_ms / base_device if device_ms and base_device else None,
        })
    return rows


def _print_table(rows: list[dict[str, Any]], notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tiledmlp bench (ratios to untiled at the same seq)")
    shown = columns(rows)
    for _, header, _ in shown:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(cell(row, k, f) for k, _, f in shown))
    console = Console(width=max(120, Console().width))
    console.print(table)
    for row in rows:  # a timed call that still allocated device memory or freed the cache: its time includes it
        if any(timed for _, timed in row.get("allocator_events") or []):
            notes.append(f"{row['impl']} ({row['shards']}) at seq {row['seq']}: device allocations or cache frees "
                         f"inside timed calls: {[timed for _, timed in row['allocator_events']]}")
    for note in notes:
        console.print(f"note: {note}")
