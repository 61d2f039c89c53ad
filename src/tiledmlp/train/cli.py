"""``tiledmlp train``: parse, validate, train (or ``--compare`` untiled vs tiled in two fresh processes).

Exit codes: 0 success, 2 bad input (one ``tiledmlp train: error: ...`` line on stderr, nothing written), 1 out of
memory (the allocator's traceback, then what to change and the checkpoint to resume from) or a training loss that
is not finite (NaN/inf: the run stops at that step, saving nothing more), 143 when SIGTERM or
SIGUSR1 stopped it after a step (a checkpoint saved), or the failing phase's code under ``--compare``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from transformers import TrainingArguments

from .args import DataArguments, ModelArguments, TilingArguments, UsageError, parse_args

__all__ = ["main", "compare_summaries", "tiled_phase_label"]

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks go back to the OS, so RSS high-water is the peak


def _error(message: str) -> int:
    print(f"tiledmlp train: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        from .args import help_parser

        help_parser().print_help()
        return 0
    try:
        model_args, data_args, tiling, train_args = parse_args(argv)
        if tiling.compare:
            from .data import load_raw_text

            # fail before the first phase starts
            load_raw_text(data_args.dataset, data_args.text_field, "--dataset", data_args.dataset_config,
                          data_args.dataset_split)
            return _compare(argv, train_args.output_dir, data_args.sequence_parallel_size)
    except UsageError as exc:
        return _error(str(exc))
    with _one_process_launcher_env(train_args.deepspeed):
        return _train(model_args, data_args, tiling, train_args)


def _train(model_args: ModelArguments, data_args: DataArguments, tiling: TilingArguments,
           train_args: TrainingArguments) -> int:
    """Prepare and run one training process (``main`` without the parsing and ``--compare``)."""
    from .runner import prepare, run

    try:
        prepared = prepare(model_args, data_args, tiling, train_args)
    except UsageError as exc:
        return _error(str(exc))
    from .callbacks import NonFiniteLoss
    from .fit import RunOutOfMemory

    try:
        summary = run(prepared, train_args, save_final_model=model_args.save_final_model)
    except UsageError as exc:
        return _error(str(exc))
    except NonFiniteLoss as exc:
        print(f"tiledmlp train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except RunOutOfMemory as exc:  # the allocator's traceback, then what to change (last, where it is read)
        traceback.print_exception(exc.__cause__)
        print(f"tiledmlp train: error: {exc}", file=sys.stderr, flush=True)
        return 1  # peers blocked in a collective are ended by the launcher when this rank exits
    from ..distributed import close_process_group

    close_process_group()
    from .preemption import STOPPED_EXIT_CODE

    return STOPPED_EXIT_CODE if summary["stopped_by_signal"] else 0  # a checkpoint saved, the run not finished


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def _one_process_launcher_env(deepspeed: object) -> Iterator[None]:
    """DeepSpeed's engine finds its process group in a launcher's environment and, without one, looks for MPI: a
    plain ``tiledmlp train --deepspeed ds.json`` stopped in ``deepspeed.initialize`` with a traceback (no module
    ``mpi4py``). One process started without a launcher gets what ``torchrun --nproc_per_node 1`` would set, for
    the run only (``main`` called in-process leaves the environment as it found it)."""
    if not deepspeed or any(key in os.environ for key in _LAUNCHER_ENV):
        yield
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    added = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}
    added = {k: v for k, v in added.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _launcher(processes: int) -> list[str]:
    """``python -m`` for one process; ``torchrun --nproc_per_node N`` (local, a free port) for sequence parallelism."""
    if processes == 1:
        return [sys.executable, "-m"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
            "127.0.0.1", "--master_port", str(port), "-m"]


def _phase(argv: list[str], label: str, overrides: list[str], output_dir: str, report: str,
           processes: int = 1) -> tuple[int, float]:
    """Run one ``--compare`` phase as ``python -m tiledmlp.cli train`` (under torchrun with ``processes`` > 1) with
    its own RSS high-water mark; rank 0 writes the report. A phase is a measurement: it saves no checkpoints and no
    final model, so running the comparison again into the same folder measures the same steps again."""
    cmd = [*_launcher(processes), "tiledmlp.cli", "train", *argv, "--compare", "false", "--save_final_model", "false",
           "--save_strategy", "no", *overrides, "--output_dir", os.path.join(output_dir, label)]
    from .preemption import MEASUREMENT_ENV, STOP_SIGNALS

    env = {**os.environ, **_MALLOC_ENV, "TILEDMLP_TRAIN_REPORT": report, MEASUREMENT_ENV: label}
    print(f"\n=== --compare phase {label}{(': ' + ' '.join(overrides)) if overrides else ''}", flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env)
    # a stop signal for this process is the phase's too (it stops after its step, saving nothing); left to the
    # default it would kill this process alone and leave the phase running
    previous = {s: signal.signal(s, lambda signum, _frame: child.send_signal(signum)) for s in STOP_SIGNALS}
    try:
        rc = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return rc, time.perf_counter() - start


def compare_summaries(untiled: dict[str, Any], tiled: dict[str, Any]) -> dict[str, Any]:
    """Peaks, their ratio (tiled / untiled) and the max |loss difference| over the steps both ran. A loss that is
    not finite makes the max difference NaN and is listed under ``non_finite_steps`` (a NaN difference must not
    read as agreement)."""
    steps = sorted(set(untiled["losses"]) & set(tiled["losses"]), key=int)
    pairs = {s: (untiled["losses"][s], tiled["losses"][s]) for s in steps
             if untiled["losses"][s] is not None and tiled["losses"][s] is not None}
    diffs = {s: abs(a - b) for s, (a, b) in pairs.items()}
    bad = [s for s, (a, b) in pairs.items() if not (math.isfinite(a) and math.isfinite(b))]
    ratio = tiled["peak_bytes"] / untiled["peak_bytes"] if untiled["peak_bytes"] else float("nan")
    largest = float("nan") if bad or not diffs else max(diffs.values())
    result = {"steps": len(steps), "untiled_peak_bytes": untiled["peak_bytes"],
              "tiled_peak_bytes": tiled["peak_bytes"], "peak_ratio": ratio, "max_abs_loss_diff": largest,
              "loss_diffs": diffs, "non_finite_steps": bad}
    evals = [abs(a["loss"] - b["loss"]) for a, b in zip(untiled.get("evals", []), tiled.get("evals", []))]
    if evals:
        result["max_abs_eval_loss_diff"] = float("nan") if any(math.isnan(d) for d in evals) else max(evals)
    return result


def loss_diff_line(diffs: dict[str, float]) -> str:
    """``step:diff`` pairs for the summary line: all of them up to 8 steps, else the first and last 4 (every step
    is in compare.json; a 400-step run had printed one enormous line)."""
    shown: list[tuple[str, float | None]] = list(diffs.items())
    if len(shown) > 8:
        shown = [*shown[:4], ("...", None), *shown[-4:]]
    return "  ".join(step if d is None else f"{step}:{d:.2e}" for step, d in shown)


def tiled_phase_label(summary: dict[str, Any]) -> str:
    """What the second ``--compare`` phase tiled, from its summary (its flags may turn either part off)."""
    parts = (["MLP"] if summary["tiles"] else []) + (["loss"] if summary["tiled_loss"] else [])
    return f"tiled {' + '.join(parts)}" if parts else "nothing tiled"


def _compare(argv: list[str], output_dir: str, sp: int = 1) -> int:
    from .callbacks import format_bytes

    with tempfile.TemporaryDirectory(prefix="tiledmlp-compare-") as tmp:
        summaries: dict[str, dict[str, Any]] = {}
        walls: dict[str, float] = {}
        phases = [("untiled", ["--use_tiled_mlp", "false", "--use_tiled_loss", "false"]), ("tiled", [])]
        for label, overrides in phases:
            report = os.path.join(tmp, f"{label}.json")
            rc, walls[label] = _phase(argv, label, overrides, output_dir, report, sp)
            if rc != 0:
                from .preemption import STOPPED_EXIT_CODE

                why = "was stopped by a signal (nothing saved: run the comparison again)" \
                    if rc == STOPPED_EXIT_CODE else f"failed with exit code {rc}"
                print(f"tiledmlp train: --compare phase {label!r} {why}", file=sys.stderr)
                return rc
            with open(report) as f:
                summaries[label] = json.load(f)
    result = compare_summaries(summaries["untiled"], summaries["tiled"])
    untiled, tiled = summaries["untiled"], summaries["tiled"]
    print("\n=== tiledmlp train --compare (same steps, same data, fresh process each)")
    for label, name, peak in (("untiled", "untiled", result["untiled_peak_bytes"]),
                              (tiled_phase_label(tiled), "tiled", result["tiled_peak_bytes"])):
        print(f"  {label:<17} peak {format_bytes(peak):>10}  {summaries[name]['tokens_per_second']:>8,.0f} tok/s  "
              f"wall {walls[name]:.0f} s")
    print(f"  peak ratio tiled/untiled: {result['peak_ratio']:.3f}  ({untiled['peak_kind']}"
          f"{f', rank 0 of {sp}: sequence parallel over {sp} ranks' if sp > 1 else ''})")
    print(f"  max |loss difference| over {result['steps']} steps: {result['max_abs_loss_diff']:.2e}  "
          f"({loss_diff_line(result['loss_diffs'])})")
    if result["non_finite_steps"]:
        print(f"  NOT FINITE: a loss is NaN or inf at step(s) {', '.join(result['non_finite_steps'])}: the runs "
              "cannot be compared there")
    if "max_abs_eval_loss_diff" in result:
        print(f"  max |eval loss difference| over {len(tiled['evals'])} evaluation(s): "
              f"{result['max_abs_eval_loss_diff']:.2e}")
    os.makedirs(output_dir, exist_ok=True)
    whole = {**result, "sequence_parallel_size": sp, "untiled": untiled, "tiled": tiled, "wall_seconds": walls}
    from .runner import REPORT_ENV

    # the caller's report file (a run's summary there) gets the comparison: the phases wrote theirs elsewhere
    for path in (os.path.join(output_dir, "compare.json"), os.environ.get(REPORT_ENV)):
        if path:
            with open(path, "w") as f:
                json.dump(whole, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
