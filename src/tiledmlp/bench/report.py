"""Rendering benchmark rows: the console table, ``bench.md``, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["COLUMNS", "OUTPUTS", "columns", "markdown_table", "write_outputs", "plot"]

MiB = 2**20
OUTPUTS = ("bench.json", "bench.md", "bench.png")  # what write_outputs writes under --out, in this order

# (key in a row, header, format)
COLUMNS: list[tuple[str, str, str]] = [
    ("seq", "seq", "{}"),
    ("impl", "impl", "{}"),
    ("shards", "shards", "{}"),
    ("tiles", "tiles", "{}"),
    ("ms", "ms", "{:.1f}"),
    ("time_ratio", "time x", "{:.2f}"),
    ("device_ratio", "device x", "{:.3f}"),  # CUDA: device time after a head start (bench.timing), ratio
    ("peak_mib", "peak MiB", "{:.1f}"),
    ("mem_ratio", "mem x", "{:.2f}"),
    ("rss_mib", "RSS MiB", "{:.1f}"),
    ("predicted_mib", "predicted MiB", "{:.1f}"),
]


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """One formatted cell; missing values print as ``-``."""
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def columns(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The columns to show: the device-time column only where some row has one (CUDA)."""
    return [c for c in COLUMNS if c[0] != "device_ratio" or any(r.get("device_ratio") is not None for r in rows)]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a GitHub markdown table."""
    shown = columns(rows)
    lines = ["| " + " | ".join(h for _, h, _ in shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k, f) for k, _, f in shown) + " |")
    return "\n".join(lines)


def checks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Plain statements the issue asks the table to answer (auto never above untiled, per sequence length)."""
    out = []
    for row in rows:
        if row["shards"] == "auto" and row.get("mem_ratio") is not None and row["impl"] == "tiledmlp":
            verdict = "OK" if row["mem_ratio"] <= 1.0 else "ABOVE untiled"
            out.append(f"seq {row['seq']}: tiledmlp auto ({row['tiles']} tiles) "
                       f"peak {row['mem_ratio']:.3f}x untiled: {verdict}")
    return out


def write_outputs(out_dir: Path, meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[Path]:
    """Write bench.json, bench.md and bench.png under ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in OUTPUTS]
    paths[0].write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")
    notes = "".join(f"- {n}\n" for n in meta.get("notes", []))
    check_lines = "".join(f"- {c}\n" for c in checks(rows))
    paths[1].write_text(
        f"# tiledmlp bench\n\n`{meta['command']}`\n\n"
        f"{meta['mlp']} MLP, hidden {meta['hidden']}, intermediate {meta['intermediate']}{_routing(meta)}, "
        f"{meta['dtype']}, "
        f"batch {meta['batch']}, device {meta['device']}, torch {meta['torch']}, "
        f"{meta['cpus']} CPUs ({meta['threads']} torch threads), "
        f"load average {meta['load_before']} before / {meta['load_after']} after.\n"
        f"Time ({'process CPU time' if meta.get('clock') == 'cpu' else 'wall clock'}): median of {meta['repeat']} "
        "fwd+bwd after 1 warm-up, variants interleaved in one process. "
        "Peak: bytes above the pre-step baseline: on CPU the profiler's in a fresh subprocess (RSS: VmHWM of "
        "that subprocess, MALLOC_MMAP_THRESHOLD_=65536); on accelerators the allocator's, in this process after a "
        "warm-up step. Ratios are to untiled at the same seq.\n\n" + markdown_table(rows) + "\n\n"
        + (f"Checks:\n\n{check_lines}\n" if check_lines else "")
        + (f"Notes:\n\n{notes}" if notes else "")
    )
    plot(rows, paths[2], title=f"{meta['mlp']} h{meta['hidden']} i{meta['intermediate']}{_routing(meta, True)} "
                              f"{meta['dtype']}")
    return paths


def _routing(meta: dict[str, Any], short: bool = False) -> str:
    """A MoE bench's experts and top-k (nothing for a dense MLP)."""
    if "experts" not in meta:
        return ""
    return f" e{meta['experts']} k{meta['top_k']}" if short else \
        f" ({meta['experts']} experts, each token to {meta['top_k']})"


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """Memory and time against sequence length, one line per implementation and shard request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = row["impl"] if row["impl"] == "untiled" else f"{row['impl']} ({row['shards']})"
        series.setdefault(label, []).append(row)
    for label, pts in series.items():
        pts = sorted(pts, key=lambda r: r["seq"])
        seqs = [r["seq"] for r in pts]
        if any(r.get("peak_mib") is not None for r in pts):
            ax_mem.plot(seqs, [r.get("peak_mib") for r in pts], marker="o", label=label)
        if any(r.get("ms") is not None for r in pts):
            ax_time.plot(seqs, [r.get("ms") for r in pts], marker="o", label=label)
    for ax, ylabel in ((ax_mem, "peak MiB above baseline"), (ax_time, "fwd+bwd ms (median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_mem.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
