#!/usr/bin/env bash
# All-reduce side by side, in one session: tdist's shm backend, tdist's gloo
# backend, PyTorch's Gloo under both PyTorch versions (1.13: Debian's
# python3-torch; 2.x: the venv of scripts/torch2.sh) and OpenMPI (when
# installed), float32 SUM at world size 2 over the same sizes. Prints each
# tool's table, then one summary table; writes everything as JSON to OUT_DIR
# (tdist-shm.json, tdist-gloo.json, torch-gloo.json, torch2-gloo.json,
# openmpi.json).
#   [MAX_BYTES=64M] [TORCH1_PYTHON=/usr/bin/python3] [TORCH2_PYTHON=<repo>/.venv/bin/python]
#     bench/compare_collectives.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
# A PyTorch whose interpreter cannot import torch.distributed with Gloo is
# left out, with one line saying why; one whose run fails is left out of the
# table too, and the script then exits non-zero after printing it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/bench}
mkdir -p "$out"
max_bytes=${MAX_BYTES:-64M}
sizes=(--min-bytes 4 --max-bytes "$max_bytes" --step-factor 4)
world=2
torch1_python=${TORCH1_PYTHON:-/usr/bin/python3}
torch2_python=${TORCH2_PYTHON:-$root/.venv/bin/python}
failed=0

bytes() {  # 64M -> 67108864 (K, M, G: powers of 1024, as tdist-bench reads them)
  case $1 in
    *[kK]) echo $(( ${1%?} << 10 )) ;;
    *[mM]) echo $(( ${1%?} << 20 )) ;;
    *[gG]) echo $(( ${1%?} << 30 )) ;;
    *) echo $(( $1 )) ;;
  esac
}

# shellcheck source=bench/reference_common.sh
source "$here/reference_common.sh"

"$build/bin/tdist-bench" collectives --backend shm --world-size $world "${sizes[@]}" --json "$out/tdist-shm.json"
"$build/bin/tdist-bench" collectives --backend gloo --world-size $world "${sizes[@]}" --json "$out/tdist-gloo.json"

run_reference "PyTorch 1.13 Gloo" "$torch1_python" "apt-get install python3-torch" "$out/torch-gloo.json" \
  "$here/torch_collectives_reference.py" --world-size $world "${sizes[@]}"
run_reference "PyTorch 2.x Gloo" "$torch2_python" "bash scripts/torch2.sh python installs it" "$out/torch2-gloo.json" \
  "$here/torch_collectives_reference.py" --world-size $world "${sizes[@]}"

if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  mpicc -O2 -o "$out/mpi_allreduce_reference" "$here/mpi_allreduce_reference.c"
  mpirun --allow-run-as-root --oversubscribe -np $world "$out/mpi_allreduce_reference" 4 "$(bytes "$max_bytes")" 4 0.25 \
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
torch_version() {  # file default -> major.minor of the torch_version its rows record
  local v=""
  [ -f "$1" ] && v=$(grep -o '"torch_version": "[^"]*"' "$1" | head -n 1 | sed 's/.*: "\([0-9]*\.[0-9]*\).*/\1/')
  echo "${v:-$2}"
}
tsvs=()
for f in tdist-shm tdist-gloo torch-gloo torch2-gloo openmpi; do
  extract "$out/$f.json" > "$out/$f.tsv"
  tsvs+=("$out/$f.tsv")
done
echo
echo "# all_reduce float32, world size $world: time (us) / busbw (GB/s); last columns: tdist shm busbw as a multiple"
echo "# (x torch: of PyTorch $(torch_version "$out/torch-gloo.json" 1.13)'s Gloo, x torch2: of PyTorch $(torch_version "$out/torch2-gloo.json" 2.x)'s)"
# Files are read in BEGIN with getline, so that an empty one (a reference
# left out) keeps its column.
awk -v h3="torch $(torch_version "$out/torch-gloo.json" 1.13) gloo" \
    -v h4="torch $(torch_version "$out/torch2-gloo.json" 2.x) gloo" '
  function ratio(f, s) {  # tdist shm busbw / file f busbw at size s
    return sprintf(((f, s) in b && b[f, s] > 0) ? " %9.1f" : " %9s", ((f, s) in b && b[f, s] > 0) ? b[1, s] / b[f, s] : "-")
  }
  BEGIN {
    for (f = 1; f < ARGC; f++)
      while ((getline line < ARGV[f]) > 0) {
        split(line, a, " ")
        t[f, a[1]] = a[2]; b[f, a[1]] = a[3]
        if (f == 1) order[++n] = a[1]
      }
    printf "%12s %20s %20s %20s %20s %20s %9s %9s %9s\n", "size(B)", "tdist shm", "tdist gloo", h3, h4, "openmpi",
           "x torch", "x torch2", "x mpi"
    for (i = 1; i <= n; i++) {
      s = order[i]
      line = sprintf("%12d", s)
      for (f = 1; f <= 5; f++) line = line sprintf(((f, s) in t) ? "  %9.1f / %7.2f" : "  %9s / %7s", ((f, s) in t) ? t[f, s] : "-", ((f, s) in t) ? b[f, s] : "-")
      print line ratio(3, s) ratio(4, s) ratio(5, s)
    }
  }' "${tsvs[@]}"
exit $failed
