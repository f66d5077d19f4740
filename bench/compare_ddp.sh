#!/usr/bin/env bash
# DDP step time side by side, in one session: tdist-bench ddp (shm) and
# PyTorch's Python DDP on Gloo under both PyTorch versions (1.13: Debian's
# python3-torch; 2.x: the venv of scripts/torch2.sh), same model, data,
# optimizer, variants and arguments. Prints each tool's table, then one
# summary table; writes each as JSON to OUT_DIR (tdist-ddp.json,
# torch-ddp.json, torch2-ddp.json).
#   [ROUNDS=30] [TORCH1_PYTHON=/usr/bin/python3] [TORCH2_PYTHON=<repo>/.venv/bin/python]
#     bench/compare_ddp.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
# A PyTorch whose interpreter cannot import torch.distributed with Gloo is
# left out, with one line saying why; one whose run fails is left out of the
# table too, and the script then exits non-zero after printing it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/bench}
mkdir -p "$out"
world=2
rounds=${ROUNDS:-30}
torch1_python=${TORCH1_PYTHON:-/usr/bin/python3}
torch2_python=${TORCH2_PYTHON:-$root/.venv/bin/python}
failed=0

# run_reference NAME PYTHON HINT JSON SCRIPT ARGS...: runs SCRIPT with PYTHON
# when that can import torch.distributed with Gloo, else says why not. Lines
# with "warn" on its stderr are dropped; everything else stays visible.
run_reference() {
  local name=$1 py=$2 hint=$3 json=$4 err rc=0
  shift 4
  rm -f "$json"
  if [ ! -x "$py" ]; then
    echo "# (no $py: no $name reference; $hint)"
    return 0
  fi
  if ! err=$("$py" -c 'import torch.distributed as d
assert d.is_available() and d.is_gloo_available(), "torch.distributed without Gloo"' 2>&1); then
    echo "# ($py cannot import torch.distributed ($(printf '%s\n' "$err" | tail -n 1)): no $name reference; $hint)"
    return 0
  fi
  "$py" "$@" --json "$json" 2> >(grep -v -i warn >&2) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "# ($name reference failed with exit status $rc, see its errors above: left out)"
    rm -f "$json"
    failed=1
  fi
}

"$build/bin/tdist-bench" ddp --backend shm --world-size $world --rounds $rounds --json "$out/tdist-ddp.json"
# Both PyTorch runs get the same arguments. --zero-grad zero: every step
# zeroes the gradients in place (optimizer.zero_grad(set_to_none=False)) on
# both versions, as tdist-bench ddp built against LibTorch 1.13 does
# (Optimizer::zero_grad() zeroes there) and as PyTorch 1.13's Python default;
# PyTorch 2.x's default would drop them (set_to_none=True).
ref_args=(--world-size $world --rounds $rounds --zero-grad zero)
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
extract "$out/tdist-ddp.json" > "$out/tdist-ddp.tsv"
extract "$out/torch-ddp.json" > "$out/torch-ddp.tsv"
extract "$out/torch2-ddp.json" > "$out/torch2-ddp.tsv"
echo
echo "# DDP, MLP 784-1024-1024-10, batch 64/rank, world size $world: ms/step (x local alone); speed-up: tdist against each"
# Files are read in BEGIN with getline, so that an empty one (a reference
# left out) keeps its column.
awk -v h1="PyTorch $(torch_version "$out/torch-ddp.json" 1.13) DDP (gloo)" \
    -v h2="PyTorch $(torch_version "$out/torch2-ddp.json" 2.x) DDP (gloo)" '
  BEGIN {
    for (f = 1; f < ARGC; f++)
      while ((getline line < ARGV[f]) > 0) {
        split(line, a, " ")
        ms[f, a[1]] = a[2]; r[f, a[1]] = a[3]
        if (f == 1) order[++n] = a[1]
      }
    s1 = "speed-up " substr(h1, 9, index(substr(h1, 9), " ") - 1)
    s2 = "speed-up " substr(h2, 9, index(substr(h2, 9), " ") - 1)
    printf "%-20s %17s %24s %24s %14s %14s\n", "variant", "tdist (shm)", h1, h2, s1, s2
    for (i = 1; i <= n; i++) {
      v = order[i]
      line = sprintf("%-20s %17s", v, sprintf("%8.2f (%5.2fx)", ms[1, v], r[1, v]))
      for (f = 2; f <= 3; f++)
        line = line sprintf(" %24s", ((f, v) in ms) ? sprintf("%8.2f (%5.2fx)", ms[f, v], r[f, v]) : "-")
      for (f = 2; f <= 3; f++)
        line = line sprintf(" %14s", ((f, v) in ms && ms[1, v] > 0) ? sprintf("%.2fx", ms[f, v] / ms[1, v]) : "-")
      print line
    }
  }' "$out/tdist-ddp.tsv" "$out/torch-ddp.tsv" "$out/torch2-ddp.tsv"
exit $failed
