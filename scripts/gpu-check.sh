#!/bin/bash
# The GPU checks of issue 20, on a machine with an NVIDIA GPU and a
# PyTorch 2.x: tdist's CUDA and nccl tests, and the DDP step benchmark on
# the GPU next to PyTorch's own DDP. Run from the repository root:
#
#   bash scripts/gpu-check.sh BIN_DIR LIB_DIR OUT_DIR
#
# BIN_DIR holds cuda_test, nccl_test and tdist-bench, LIB_DIR libtdist and
# its plugins (and any library the machine lacks), both built against the
# PyTorch of that machine (same version). Everything goes to OUT_DIR.
set -u
bin=$1 lib=$2 out=$3
mkdir -p "$out"
py=${PYTHON:-python3}
site=$($py -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nvlibs=$(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$lib:$site/torch/lib:$nvlibs${LD_LIBRARY_PATH:-}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  ldd "$bin/cuda_test" | grep -E "not found|torch|c10|cudart" || true
  ldd "$lib/libtdist_nccl.so" | grep -E "not found|nccl" || true
} 2>&1 | tee -a "$out/log.txt"

run() {  # name, timeout, command...
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$out/run.log" 2>&1
  local rc=$?
  { echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; cat "$out/run.log"; } >> "$out/log.txt"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" >> "$out/summary.txt"
  rm -f "$out/run.log"
}

# PARTS: which of tests, bench (tdist's and PyTorch's) to run; BENCH: the
# tdist configurations to benchmark ("backend world", comma-separated),
# TORCH_BENCH PyTorch's (empty: none).
parts=${PARTS:-tests bench}
if [[ " $parts " == *" tests "* ]]; then
  run nccl_test 120 "$bin/nccl_test"
  run cuda_test 300 "$bin/cuda_test" ${CUDA_TEST_ARGS:-}
fi
variants=local,ddp_allreduce,ddp_fp16,ddp_allreduce_view
IFS=, read -ra cfgs <<< "${BENCH:-nccl 1,shm 2,gloo 2}"
[[ " $parts " == *" bench "* ]] || cfgs=()
for cfg in "${cfgs[@]}"; do
  set -- $cfg
  run "bench_tdist_$1_$2" 150 "$bin/tdist-bench" ddp --device cuda --backend "$1" --world-size "$2" \
      --steps 20 --rounds 5 --variants "$variants" --json "$out/bench_tdist_$1_$2.json"
done
IFS=, read -ra cfgs <<< "${TORCH_BENCH-nccl 1,gloo 2}"
[[ " $parts " == *" bench "* ]] || cfgs=()
for cfg in "${cfgs[@]}"; do
  set -- $cfg
  run "bench_torch_$1_$2" 150 $py bench/torch_ddp_reference.py --device cuda --backend "$1" --world-size "$2" \
      --steps 20 --rounds 5 --variants "$variants" --json "$out/bench_torch_$1_$2.json"
done
grep -E "^\[  FAILED|^\[ (rank|watchdog)|^=== |^[a-z_]+ +[0-9.]+ +[0-9.]+" "$out/log.txt"
