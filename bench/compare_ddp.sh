#!/usr/bin/env bash
# DDP step time side by side, in one session: tdist-bench ddp (shm) built
# against each LibTorch (1.13: BUILD_DIR; 2.x: BUILD2_DIR when it has
# tdist-bench) and PyTorch's Python DDP on Gloo under both PyTorch versions
# (1.13: Debian's python3-torch; 2.x: the venv of scripts/torch2.sh), same
# model, data, optimizer, variants and arguments. Prints each tool's table,
# then one summary table, tdist against PyTorch of the same version; writes
# each as JSON to OUT_DIR (tdist-ddp.json, tdist2-ddp.json, torch-ddp.json,
# torch2-ddp.json).
#   [ROUNDS=30] [TORCH1_PYTHON=/usr/bin/python3] [TORCH2_PYTHON=<repo>/.venv/bin/python]
#     bench/compare_ddp.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench] [BUILD2_DIR=build-torch2]
# A PyTorch whose interpreter cannot import torch.distributed with Gloo is
# left out, with one line saying why; one whose run fails is left out of the
# table too, and the script then exits non-zero after printing it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/bench}
build2=${3:-build-torch2}
mkdir -p "$out"
world=2
rounds=${ROUNDS:-30}
torch1_python=${TORCH1_PYTHON:-/usr/bin/python3}
torch2_python=${TORCH2_PYTHON:-$root/.venv/bin/python}
failed=0

# shellcheck source=bench/reference_common.sh
source "$here/reference_common.sh"

"$build/bin/tdist-bench" ddp --backend shm --world-size $world --rounds "$rounds" --json "$out/tdist-ddp.json"
rm -f "$out/tdist2-ddp.json"
if [ -x "$build2/bin/tdist-bench" ]; then
  "$build2/bin/tdist-bench" ddp --backend shm --world-size $world --rounds "$rounds" --json "$out/tdist2-ddp.json"
else
  echo "# (no $build2/bin/tdist-bench: no tdist on LibTorch 2.x; make build-2 builds it)"
fi
# Both PyTorch runs get the same arguments. --zero-grad zero: every step
# zeroes the gradients in place (optimizer.zero_grad(set_to_none=False)) on
# both versions, as tdist-bench ddp built against LibTorch 1.13 does
# (Optimizer::zero_grad() zeroes there) and as PyTorch 1.13's Python default;
# PyTorch 2.x's default would drop them (set_to_none=True).
ref_args=(--world-size "$world" --rounds "$rounds" --zero-grad zero)
run_reference "PyTorch 1.13 DDP" "$torch1_python" "apt-get install python3-torch" "$out/torch-ddp.json" \
  "$here/torch_ddp_reference.py" "${ref_args[@]}"
run_reference "PyTorch 2.x DDP" "$torch2_python" "bash scripts/torch2.sh python installs it" "$out/torch2-ddp.json" \
  "$here/torch_ddp_reference.py" "${ref_args[@]}"

extract() {  # file -> "variant ms ratio" lines
  [ -f "$1" ] || return 0
  grep -o '"variant": "[a-z0-9_]*"\|"ms_per_step": [0-9.e+-]*\|"ratio_vs_local": [0-9.e+-]*' "$1" |
    sed 's/"//g' | awk -F': ' '{v[NR%3]=$2} NR%3==0 {printf "%s %s %s\n", v[1], v[2], v[0]}'
}
torch_version() {  # file default -> major.minor of the torch_version its rows record
  local v=""
  [ -f "$1" ] && v=$(grep -o '"torch_version": "[^"]*"' "$1" | head -n 1 | sed 's/.*: "\([0-9]*\.[0-9]*\).*/\1/')
  echo "${v:-$2}"
}
for f in tdist-ddp torch-ddp tdist2-ddp torch2-ddp; do extract "$out/$f.json" > "$out/$f.tsv"; done
echo
echo "# DDP, MLP 784-1024-1024-10, batch 64/rank, world size $world: ms/step (x local alone);"
echo "# speed-up: PyTorch's ms/step over tdist's, each tdist against PyTorch of its own LibTorch version"
# Files are read in BEGIN with getline, so that an empty one (a run left
# out) keeps its column.
awk -v v1="$(torch_version "$out/torch-ddp.json" 1.13)" -v v2="$(torch_version "$out/torch2-ddp.json" 2.x)" '
  BEGIN {
    for (f = 1; f < ARGC; f++)
      while ((getline line < ARGV[f]) > 0) {
        split(line, a, " ")
        ms[f, a[1]] = a[2]; r[f, a[1]] = a[3]
        if (!(a[1] in seen)) { seen[a[1]] = 1; order[++n] = a[1] }
      }
    printf "%-20s %17s %17s %9s %17s %17s %9s\n", "variant", "tdist/" v1 " (shm)", "PyTorch " v1, "speed-up",
           "tdist/" v2 " (shm)", "PyTorch " v2, "speed-up"
    for (i = 1; i <= n; i++) {
      v = order[i]
      line = sprintf("%-20s", v)
      for (pair = 0; pair < 2; pair++) {
        t = 1 + 2 * pair; p = t + 1
        for (f = t; f <= p; f++)
          line = line sprintf(" %17s", ((f, v) in ms) ? sprintf("%7.2f (%5.2fx)", ms[f, v], r[f, v]) : "-")
        line = line sprintf(" %9s", ((t, v) in ms && (p, v) in ms && ms[t, v] > 0) ? sprintf("%.2fx", ms[p, v] / ms[t, v]) : "-")
      }
      print line
    }
  }' "$out/tdist-ddp.tsv" "$out/torch-ddp.tsv" "$out/tdist2-ddp.tsv" "$out/torch2-ddp.tsv"
exit $failed
