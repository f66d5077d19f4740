#!/usr/bin/env bash
# All-reduce side by side, in one session: tdist's shm backend, tdist's gloo
# backend, PyTorch's Gloo (python3-torch) and OpenMPI (when installed), float32
# SUM at world size 2 over the same sizes. Prints each tool's table, then one
# summary table; writes everything as JSON to OUT_DIR.
#   bench/compare_collectives.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
set -euo pipefail
build=${1:-build}
out=${2:-$build/bench}
mkdir -p "$out"
sizes=(--min-bytes 4 --max-bytes 64M --step-factor 4)
world=2

"$build/bin/tdist-bench" collectives --backend shm --world-size $world "${sizes[@]}" --json "$out/tdist-shm.json"
"$build/bin/tdist-bench" collectives --backend gloo --world-size $world "${sizes[@]}" --json "$out/tdist-gloo.json"

if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  /usr/bin/python3 "$(dirname "$0")/torch_collectives_reference.py" --world-size $world "${sizes[@]}" \
    --json "$out/torch-gloo.json" 2> >(grep -v -i warn >&2)
else
  echo "# (python3-torch not installed: no PyTorch Gloo reference)"
  rm -f "$out/torch-gloo.json"
fi

if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  mpicc -O2 -o "$out/mpi_allreduce_reference" "$(dirname "$0")/mpi_allreduce_reference.c"
  mpirun --allow-run-as-root --oversubscribe -np $world "$out/mpi_allreduce_reference" 4 $((64 << 20)) 4 0.25 \
    "$out/openmpi.json"
else
  echo "# (OpenMPI not installed: no MPI reference; apt-get install openmpi-bin libopenmpi-dev)"
  rm -f "$out/openmpi.json"
fi

# One row per size: time (us) and busbw (GB/s) of each, and tdist shm's
# busbw as a multiple of the others'.
extract() {  # file -> "bytes time busbw" lines
  [ -f "$1" ] || return 0
  grep -o '"bytes": [0-9.e+]*\|"time_us": [0-9.e+-]*\|"busbw_GBps": [0-9.e+-]*' "$1" |
    awk -F': ' '{v[NR%3]=$2} NR%3==0 {printf "%d %s %s\n", v[1], v[2], v[0]}'
}
for f in tdist-shm tdist-gloo torch-gloo openmpi; do extract "$out/$f.json" > "$out/$f.tsv"; done
echo
echo "# all_reduce float32, world size $world: time (us) / busbw (GB/s); last columns: tdist shm busbw as a multiple"
awk '
  FNR == 1 { file++ }
  { t[file, $1] = $2; b[file, $1] = $3; if (file == 1) order[++n] = $1 }
  END {
    printf "%12s %20s %20s %20s %20s %9s %9s\n", "size(B)", "tdist shm", "tdist gloo", "torch gloo", "openmpi", "x torch", "x mpi"
    for (i = 1; i <= n; i++) {
      s = order[i]
      line = sprintf("%12d", s)
      for (f = 1; f <= 4; f++) line = line sprintf(((f, s) in t) ? "  %9.1f / %7.2f" : "  %9s / %7s", ((f, s) in t) ? t[f, s] : "-", ((f, s) in t) ? b[f, s] : "-")
      line = line sprintf(((3, s) in b && b[3, s] > 0) ? " %9.1f" : " %9s", ((3, s) in b && b[3, s] > 0) ? b[1, s] / b[3, s] : "-")
      line = line sprintf(((4, s) in b && b[4, s] > 0) ? " %9.1f" : " %9s", ((4, s) in b && b[4, s] > 0) ? b[1, s] / b[4, s] : "-")
      print line
    }
  }' "$out/tdist-shm.tsv" "$out/tdist-gloo.tsv" "$out/torch-gloo.tsv" "$out/openmpi.tsv"
