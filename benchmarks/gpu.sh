#!/usr/bin/env bash
# The GPU benchmark, on a machine with a CUDA GPU and no network (see docs/benchmarks.md):
#   benchmarks/gpu.sh [all|tests|mlp|models|summary|offload|kernels|plan|qlora] [OUT_DIR]
# mlp: tiledmlp bench --preset seeds at 8k/32k/131k with DeepSpeed and Liger (and ours with bf16 weight-grad sums,
# to show what the float32 sums cost); models: the tiled loss alone and the Llama-3.2-1B-shaped step vs Liger's
# recipe; tests: the whole suite there (pytest-xdist workers where installed), last in all (GPU_SH_TESTS: the
# test paths or node ids to run instead, e.g. the ones a previous run failed); summary: one table
# and the targets, with the GPU's clocks and slowdowns sampled by nvidia-smi during mlp, models and kernels;
# offload (not part of all: 4-5 minutes alone): the 1B step at 128k/256k with and without offloading, whole and
# split layers (benchmarks/offload_gpu.py); plan (not part of all, ~6 minutes): tiledmlp plan against the
# allocator, GPT-2 small under bf16 autocast, the Llama-1B shape under it, then in bf16 (benchmarks/plan_gpu.py),
# and the allocator's live blocks at the bf16 64k step's peak (benchmarks/gpu_peak.py);
# kernels (not part of all, ~5 minutes): profiles of the 8k and 131k 4-tile steps (and untiled) with their wall time
# and idle gaps (benchmarks/gpu_profile.py --trace), the weight-grad products into bf16 and float32 sums per layout
# (benchmarks/gpu_matmul.py), the GLU backward's elementwise step in several formulations vs the forward product,
# per tile shape (benchmarks/gpu_pointwise.py), then (unless GPU_SH_NO_LORA is set) the MLP bench with LoRA at 32k.
# qlora (not part of all, ~2 minutes; needs bitsandbytes, which the GPU image lacks: add its wheel to .gpu/whl with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux_2_24_x86_64 bitsandbytes==0.50.2 -d .gpu/whl`, 43 MB, which keeps .gpu under the 64 MiB carried): the
# MLP bench over NF4 weights with LoRA (--mlp swiglu-qlora), Llama-3-8B's MLP widths, bf16, at 8k and 32k tokens:
# the GLU engine's rows against the generic engine's (what QLoRA took before 2026-11-30) and the peers'.
# Missing packages travel as wheels in .gpu/whl (built here by ../shared/gpu/make-wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
out=${2:-${OUT:-gpu-out}}
mkdir -p "$out"
if [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; print('device:', torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee "$out/device.txt"
rc=0
: > "$out/stages.txt"  # seconds per stage (the summary checks all's total against the 9 minutes asked)
stage_done() { echo "$1 $((SECONDS - started))" >> "$out/stages.txt"; started=$SECONDS; }
started=$SECONDS
stage_done setup
# the GPU's clocks, power and slowdown reasons every 250 ms while the benchmarks run (the summary's "GPU while the
# benchmarks ran" line): an H100 at its power cap runs the big matmuls slower, by a margin that differs per machine
sampler=
if [[ " all mlp models kernels " == *" $stage "* ]] && command -v nvidia-smi >/dev/null; then
  reasons=clocks_event_reasons.active  # or, where the driver does not know it, its older name
  nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=utilization.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,$reasons \
    --format=csv,noheader,nounits -lms 250 > "$out/clocks.csv" 2>&1 &
  sampler=$!
  trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null' EXIT
  trap 'exit 143' TERM  # a time limit's SIGTERM still stops the sampler
fi
if [ "$stage" = all ] || [ "$stage" = mlp ]; then
  # each stage has a time limit of its own: a hang (a stuck JIT build lock, say) costs that stage, not the call;
  # the bench writes its files after each length, so a cut run still leaves the lengths it finished
  timeout -k 10 "${GPU_SH_MLP_LIMIT:-240}" python3 -m tiledmlp.cli bench --preset seeds --seq 8192,32768,131072 \
    --shards 4,auto --impls untiled,tiledmlp,tiledmlp-bf16acc,deepspeed,liger --repeat 5 --out "$out/bench" 2>&1 \
    | tee "$out/bench.log" || rc=1
  stage_done mlp
fi
if [ "$stage" = all ] || [ "$stage" = models ]; then
  timeout -k 10 "${GPU_SH_MODELS_LIMIT:-240}" python3 benchmarks/gpu_models.py --seq 32768,131072 --repeat 2,1 \
    --out "$out/models.json" 2>&1 | tee "$out/models.log" || rc=1
  stage_done models
fi
if [ "$stage" = all ] || [ "$stage" = tests ]; then
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null; sampler=  # the benchmarks are done
  # the whole suite, last in `all`: the benchmarks that settle the targets come back first, and the suite gets
  # what is left of the budget (GPU_SH_BUDGET seconds, 540 by default: the 9 minutes asked; with the 30 s grace
  # to stop and the summary, one 600 s device call). A test not started 40 s before its end is skipped as past
  # TILEDMLP_TEST_DEADLINE (the suite's conftest), so the run ends with its summary: the failures named, the
  # durations, what did not run. A SIGINT at the end stops whatever still runs (OUT/tests.rc is then 124; under
  # xdist that loses the summary). The suite's conftest starts the CUDA paths' tests first where CUDA is, so a
  # stopped suite has run them. Spread over 14 worker processes (of the 16 cores) where pytest-xdist is there
  # (the GPU image has it; GPU_SH_WORKERS=N for another count).
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_SH_WORKERS:-14}")
  # loadgroup (xdist >= 2.5): the tests sharing one multi-process job stay on one worker, so each job runs once
  # (the suite's conftest groups them; pytest 9.2 with xdist 3.8 ignores the groups, and then each test is its own
  # unit), while the other tests spread over the workers as they free up
  python3 -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (2, 5))" \
    2>/dev/null && workers+=(--dist loadgroup)
  # a selection is recorded, so the summary names it and does not count it as the whole suite
  if [ -n "${GPU_SH_TESTS:-}" ]; then echo "$GPU_SH_TESTS" > "$out/tests.subset"; else rm -f "$out/tests.subset"; fi
  left=$(( ${GPU_SH_BUDGET:-540} - SECONDS ))
  [ "$stage" = tests ] && left=${GPU_SH_BUDGET:-540}
  if [ "$left" -lt 30 ]; then
    echo "tests: skipped, ${left} s of the budget left" | tee "$out/tests.log"; echo 124 > "$out/tests.rc"; rc=1
  else
    # one compile thread per worker: Inductor's default is a pool of one process per core (16) in every worker
    # that compiles, 14 x 16 processes each importing torch
    TILEDMLP_TEST_DEADLINE=$(( $(date +%s) + left - 40 )) \
      OMP_NUM_THREADS=2 TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT -k 30 "$left" \
      python3 -m pytest ${GPU_SH_TESTS:-tests} "${workers[@]}" -q -rfEs -p no:cacheprovider --durations=0 --durations-min=5 > "$out/tests.log" 2>&1
    trc=$?
    echo "$trc" > "$out/tests.rc"
    [ "$trc" = 0 ] || rc=1
    tail -n 1 "$out/tests.log"  # pytest -q ends with the counts
  fi
  stage_done tests
fi
if [ "$stage" = kernels ]; then
  # where the 4-tile rows' time goes, first (the most asked): the step's wall time against its GPU span, and the
  # idle gaps by host op, tiled and untiled at 8k, tiled at 131k (untiled there: its kernel time only)
  # (and at 131k the bf16-sum variant: which kernels the float32 sums' 2% there comes from, in place)
  for run in "8192 4 tiledmlp --trace" "8192 4 untiled --trace" "131072 4 tiledmlp --trace" "131072 4 untiled" \
      "131072 4 tiledmlp-bf16acc"; do
    set -- $run
    timeout -k 10 90 python3 benchmarks/gpu_profile.py --seq $1 --shards $2 --impl $3 --rows 15 ${4:+$4 /tmp/trace.json} \
      2>&1 | grep -v Warning | tee "$out/profile-$3-$1.log" || rc=1
  done
  timeout -k 10 60 python3 benchmarks/gpu_matmul.py --tokens 32768 --out "$out/matmul.json" 2>&1 \
    | tee "$out/matmul.log" || rc=1
  timeout -k 10 120 python3 benchmarks/gpu_pointwise.py --rows 32768,2048 --out "$out/pointwise.json" 2>&1 \
    | tee "$out/pointwise.log" || rc=1
  # LoRA on the GLU path, without and with dropout (see docs/benchmarks.md "Not done"): the seeds' shape at 32k,
  # 4 tiles; with dropout the peers draw other masks in their backward (a speed figure only)
  [ -n "${GPU_SH_NO_LORA:-}" ] && exit $rc
  for mlp in swiglu-lora swiglu-lora-dropout; do
    timeout -k 10 90 python3 -m tiledmlp.cli bench --mlp $mlp --hidden 4096 --intermediate 12288 \
      --dtype bfloat16 --seq 32768 --shards 4 --impls untiled,tiledmlp,deepspeed,liger --repeat 5 --no-progress \
      --out "$out/bench-$mlp" 2>&1 | tee "$out/bench-$mlp.log" || rc=1
  done
  exit $rc
fi
if [ "$stage" = qlora ]; then
  python3 -c "import bitsandbytes" 2>/dev/null || { echo "qlora: no bitsandbytes (see the header)"; exit 1; }
  timeout -k 10 240 python3 -m tiledmlp.cli bench --mlp swiglu-qlora --hidden 4096 --intermediate 14336 \
    --dtype bfloat16 --seq 8192,32768 --shards 4,auto --impls untiled,tiledmlp,tiledmlp-generic,deepspeed,liger \
    --repeat 5 --no-progress --out "$out/bench-qlora" 2>&1 | grep -v Warning | tee "$out/bench-qlora.log" || rc=1
  exit $rc
fi
if [ "$stage" = offload ]; then
  python3 benchmarks/offload_gpu.py --seq 128k,256k --warmup 0 --steps 1 2>&1 | tee "$out/offload.log" || rc=1
  exit $rc
fi
if [ "$stage" = plan ]; then  # tiledmlp plan against the allocator: GPT-2 under autocast (<1 min), the Llama-1B
  # shape in float32 under autocast (~1), then in bf16 (~3); then what is alive at the peak of the bf16 64k step,
  # which the plan put 3% under on the H200 (2026-11-29; ~1 min)
  for model in --gpt2 --autocast ""; do
    timeout -k 10 240 python3 benchmarks/plan_gpu.py $model 2>&1 | grep -v Warning | tee -a "$out/plan.log" || rc=1
  done
  timeout -k 10 150 python3 benchmarks/gpu_peak.py --seq 64k --modes plain 2>&1 | grep -v Warning \
    | tee "$out/peak.log" || rc=1
  exit $rc
fi
python3 benchmarks/gpu_summary.py "$out"
exit $rc
