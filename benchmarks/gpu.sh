#!/usr/bin/env bash
# The GPU benchmark, on a machine with a CUDA GPU and no network (see docs/benchmarks.md):
#   benchmarks/gpu.sh [all|tests|mlp|models|summary|offload] [OUT_DIR]
# tests: the whole suite there; mlp: tiledmlp bench --preset seeds at 8k/32k/131k with DeepSpeed and Liger (and
# ours with bf16 weight-grad sums, to show what the float32 sums cost);
# models: the tiled loss alone and the Llama-3.2-1B-shaped step vs Liger's recipe; summary: one table + targets;
# offload (not part of all: about 6 minutes alone): the 1B step at 128k/256k with and without offloading, whole and
# split layers (benchmarks/offload_gpu.py).
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
if [ "$stage" = all ] || [ "$stage" = tests ]; then
  # four concurrent groups (one after the other the suite takes over 10 minutes there; like this about 4-6)
  groups=("tests/distributed" "tests/test_plan.py"
    "tests/test_train.py tests/test_train_data.py tests/test_train_fit.py tests/test_train_preemption.py tests/test_train_distributed.py tests/test_train_sp.py tests/test_training_modes.py
     tests/test_smollm2.py tests/test_readme.py tests/test_bench.py tests/test_checkpointing.py tests/test_hf_families.py"
    "tests/test_cuda.py tests/test_engine.py tests/test_glu.py tests/test_loss.py tests/test_loss_patching.py
     tests/test_memory.py tests/test_norms.py tests/test_offload.py tests/test_offload_streams.py tests/test_patch.py
     tests/test_pointwise.py tests/test_precision.py tests/test_tiling.py tests/test_launch.py
     tests/test_split_layers.py tests/test_hf_compat.py")
  for k in "${!groups[@]}"; do
    # shellcheck disable=SC2086  # a group is several paths
    OMP_NUM_THREADS=4 python3 -m pytest ${groups[$k]} -q -rfE -p no:cacheprovider > "$out/tests-$k.log" 2>&1 &
  done
  for k in "${!groups[@]}"; do wait -n || rc=1; done
  tail -n 3 "$out"/tests-*.log | tee "$out/tests.log"
fi
if [ "$stage" = all ] || [ "$stage" = mlp ]; then
  python3 -m tiledmlp.cli bench --preset seeds --seq 8192,32768,131072 --shards 4,auto \
    --impls untiled,tiledmlp,tiledmlp-bf16acc,deepspeed,liger --repeat 5 --out "$out/bench" 2>&1 | tee "$out/bench.log" || rc=1
fi
if [ "$stage" = all ] || [ "$stage" = models ]; then
  python3 benchmarks/gpu_models.py --seq 32768,131072 --out "$out/models.json" 2>&1 | tee "$out/models.log" || rc=1
fi
if [ "$stage" = offload ]; then
  python3 benchmarks/offload_gpu.py --seq 128k,256k --warmup 0 --steps 1 2>&1 | tee "$out/offload.log" || rc=1
  exit $rc
fi
python3 benchmarks/gpu_summary.py "$out"
exit $rc
