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
} 2>&1 | tee "$out/env.txt"

run() {  # name, timeout, command...
  local name=$1 t=$2
  shift 2
  echo "=== $name" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout "$t" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log"
}

run nccl_test 120 "$bin/nccl_test"
run cuda_test 300 "$bin/cuda_test" --gtest_output="xml:$out/cuda_test.xml"
variants=local,ddp_allreduce,ddp_fp16,ddp_allreduce_view
for cfg in "nccl 1" "shm 2" "gloo 2"; do
  set -- $cfg
  run "bench_tdist_$1_$2" 150 "$bin/tdist-bench" ddp --device cuda --backend "$1" --world-size "$2" \
      --steps 20 --rounds 5 --variants "$variants" --json "$out/bench_tdist_$1_$2.json"
done
for cfg in "nccl 1" "gloo 2"; do
  set -- $cfg
  run "bench_torch_$1_$2" 150 $py bench/torch_ddp_reference.py --device cuda --backend "$1" --world-size "$2" \
      --steps 20 --rounds 5 --variants "$variants" --json "$out/bench_torch_$1_$2.json"
done
cat "$out/summary.txt"
