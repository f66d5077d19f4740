#!/usr/bin/env bash
# DDP step time side by side, in one session: tdist-bench ddp (shm) and
# PyTorch's Python DDP on Gloo (python3-torch), same model, data, optimizer
# and variants. Prints each tool's table, then one summary table; writes both
# as JSON to OUT_DIR.
#   [ROUNDS=30] bench/compare_ddp.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
set -euo pipefail
build=${1:-build}
out=${2:-$build/bench}
mkdir -p "$out"
world=2
rounds=${ROUNDS:-30}

"$build/bin/tdist-bench" ddp --backend shm --world-size $world --rounds $rounds --json "$out/tdist-ddp.json"
if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  /usr/bin/python3 "$(dirname "$0")/torch_ddp_reference.py" --world-size $world --rounds $rounds --json "$out/torch-ddp.json" \
    2> >(grep -v -i warn >&2)
else
  echo "# (python3-torch not installed: no PyTorch DDP reference)"
  rm -f "$out/torch-ddp.json"
fi

extract() {  # file -> "variant ms ratio" lines
  [ -f "$1" ] || return 0
  grep -o '"variant": "[a-z0-9_]*"\|"ms_per_step": [0-9.e+-]*\|"ratio_vs_local": [0-9.e+-]*' "$1" |
    sed 's/"//g' | awk -F': ' '{v[NR%3]=$2} NR%3==0 {printf "%s %s %s\n", v[1], v[2], v[0]}'
}
extract "$out/tdist-ddp.json" > "$out/tdist-ddp.tsv"
extract "$out/torch-ddp.json" > "$out/torch-ddp.tsv"
echo
echo "# DDP, MLP 784-1024-1024-10, batch 64/rank, world size $world: ms/step (x local alone)"
awk '
  FNR == 1 { file++ }
  { ms[file, $1] = $2; r[file, $1] = $3; if (file == 1) order[++n] = $1 }
  END {
    printf "%-20s %22s %22s %10s\n", "variant", "tdist (shm)", "PyTorch DDP (gloo)", "speed-up"
    for (i = 1; i <= n; i++) {
      v = order[i]
      a = sprintf("%8.2f (%5.2fx)", ms[1, v], r[1, v])
      b = ((2, v) in ms) ? sprintf("%8.2f (%5.2fx)", ms[2, v], r[2, v]) : "-"
      s = ((2, v) in ms && ms[1, v] > 0) ? sprintf("%9.2fx", ms[2, v] / ms[1, v]) : "-"
      printf "%-20s %22s %22s %10s\n", v, a, b, s
    }
  }' "$out/tdist-ddp.tsv" "$out/torch-ddp.tsv"
