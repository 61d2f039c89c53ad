#!/usr/bin/env bash
# Quick regular-vs-tiled table (~60 s of CPU time; 6 fresh measurement processes + interleaved timing).
# Small SwiGLU shape, two sequence lengths, the GLU fast path and DeepSpeed's TiledMLP beside untiled.
# One torch thread and process CPU time keep the ratios meaningful on a machine shared with other jobs.
# Usage: benchmarks/quick.sh [OUT_DIR] [extra tiledmlp bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
OUT="${1:-bench-quick}"
shift || true
exec "$PY" -m tiledmlp.cli bench --hidden 512 --intermediate 1408 --seq 1024,4096 --shards auto \
  --impls untiled,tiledmlp,deepspeed --repeat 3 --threads 1 --clock cpu --out "$OUT" "$@"
