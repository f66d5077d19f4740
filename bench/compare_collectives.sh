#!/usr/bin/env bash
# Collectives side by side, interleaved: REPEATS rounds (3 by default), each
# running, at every world size of WORLDS (2 and 4), tdist's shm backend,
# OpenMPI (when installed), tdist's gloo backend and PyTorch's Gloo under
# both PyTorch versions (1.13: Debian's python3-torch; 2.x: the venv of
# scripts/torch2.sh) one after the other, so that a noisy spell on a shared
# machine hits all of them alike. float32, SUM, OPS (all_reduce, broadcast,
# reduce_scatter, all_gather) from 4 B to MAX_BYTES (256M), every op timed
# call by call. tdist's ops are synchronous calls (async_op=false, as MPI's
# blocking calls and torch.distributed's default); ASYNC=1 times them queued
# and waited for instead (tdist-bench --async). BARRIER_EACH=1 puts an untimed
# barrier before every timed call in every tool (--barrier-each), so that no
# rank runs ahead (a small broadcast's root otherwise does, OpenMPI's by many
# calls). The summary gives, per world
# size, op and size, the median over the rounds of each tool's median time
# (and of tdist shm's p99), busbw, and tdist shm's busbw as a multiple of the
# others'; tdist shm's "of ceil" is its fraction of the memory-model ceiling
# (bench/collective_model.h) measured in the same round. Everything is kept
# as JSON in OUT_DIR: <tool>-<round>.json at world size 2 (what
# bench/plot.py draws), <tool>-w<W>-<round>.json at the others.
#   [REPEATS=3] [WORLDS="2 4"] [OPS=...] [MAX_BYTES=256M] [SECONDS_PER_ROW=0.25] [ASYNC=0] [BARRIER_EACH=0]
#   [TORCH1_PYTHON=/usr/bin/python3] [TORCH2_PYTHON=<repo>/.venv/bin/python]
#     bench/compare_collectives.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
# (WORLD=N is still read: WORLDS=N.) A world of 4 on fewer cores is
# oversubscribed: its times say more about scheduling than about the tools.
# A PyTorch whose interpreter cannot import torch.distributed with Gloo is
# left out, with one line saying why, as is an op its Gloo lacks; a run that
# fails is left out of the table too, and the script then exits non-zero.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/bench}
mkdir -p "$out"
repeats=${REPEATS:-3}
worlds=${WORLDS:-${WORLD:-2 4}}
ops=${OPS:-all_reduce,broadcast,reduce_scatter,all_gather}
max_bytes=${MAX_BYTES:-256M}
seconds=${SECONDS_PER_ROW:-0.25}
call_flags=()
[ "${ASYNC:-0}" = 1 ] && call_flags=(--async)
each_flags=()
[ "${BARRIER_EACH:-0}" = 1 ] && each_flags=(--barrier-each)
sizes=(--min-bytes 4 --max-bytes "$max_bytes" --step-factor 4 --seconds "$seconds" ${each_flags[@]+"${each_flags[@]}"})
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

have_mpi=0
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  mpicc -O2 -o "$out/mpi_collectives_reference" "$here/mpi_collectives_reference.c"
  have_mpi=1
else
  echo "# (OpenMPI not installed: no MPI reference; apt-get install openmpi-bin libopenmpi-dev)"
fi

tools=(tdist-shm openmpi tdist-gloo torch-gloo torch2-gloo)
# Only this run's worlds are cleared: a later run at another world size
# (WORLDS=4 after WORLDS=2) keeps what the first left.
for f in "${tools[@]}"; do
  for world in $worlds; do
    if [ "$world" = 2 ]; then rm -f "$out/$f"-[0-9]*.json; else rm -f "$out/$f-w$world"-*.json; fi
  done
done
name() {  # tool world round -> the JSON file's name
  if [ "$2" = 2 ]; then echo "$out/$1-$3.json"; else echo "$out/$1-w$2-$3.json"; fi
}
for ((r = 1; r <= repeats; r++)); do
  for world in $worlds; do
    echo "#### round $r of $repeats, world size $world"
    "$build/bin/tdist-bench" collectives --backend shm --world-size "$world" --op "$ops" "${sizes[@]}" \
      ${call_flags[@]+"${call_flags[@]}"} --json "$(name tdist-shm "$world" "$r")" || failed=1
    if [ $have_mpi = 1 ]; then
      mpirun --allow-run-as-root --oversubscribe -np "$world" "$out/mpi_collectives_reference" \
        ${each_flags[@]+"${each_flags[@]}"} "$ops" 4 \
        "$(bytes "$max_bytes")" 4 "$seconds" "$(name openmpi "$world" "$r")" || failed=1
    fi
    "$build/bin/tdist-bench" collectives --backend gloo --world-size "$world" --op "$ops" "${sizes[@]}" \
      ${call_flags[@]+"${call_flags[@]}"} --json "$(name tdist-gloo "$world" "$r")" || failed=1
    run_reference "PyTorch 1.13 Gloo" "$torch1_python" "apt-get install python3-torch" "$(name torch-gloo "$world" "$r")" \
      "$here/torch_collectives_reference.py" --world-size "$world" --op "$ops" "${sizes[@]}"
    run_reference "PyTorch 2.x Gloo" "$torch2_python" "bash scripts/torch2.sh python installs it" \
      "$(name torch2-gloo "$world" "$r")" "$here/torch_collectives_reference.py" --world-size "$world" --op "$ops" \
      "${sizes[@]}"
  done
done

# "tool op bytes time p99 busbw of_ceiling" lines from every round's JSON
# at world size $2.
rows() {
  local tool=$1 world=$2 f
  local pattern="$out/$tool-[0-9]*.json"
  [ "$world" = 2 ] || pattern="$out/$tool-w$world-[0-9]*.json"
  for f in $pattern; do
    [ -f "$f" ] || continue
    grep -o '"op": "[a-z_]*"\|"bytes": [0-9.e+]*\|"time_us": [0-9.e+-]*\|"p99_us": [0-9.e+-]*\|"busbw_GBps": [0-9.e+-]*\|"of_ceiling": [0-9.e+-]*' "$f" |
      sed 's/"op": "\(.*\)"/op \1/; s/"\([a-z_0-9A-Z]*\)": /\1 /' |
      awk -v tool="$tool" '
        function emit() { if (op != "") printf "%s %s %d %s %s %s %s\n", tool, op, b, t, p, bw, c }
        $1 == "op" { emit(); op = $2; c = "-" }
        $1 == "bytes" { b = $2 } $1 == "time_us" { t = $2 } $1 == "p99_us" { p = $2 }
        $1 == "busbw_GBps" { bw = $2 } $1 == "of_ceiling" { c = $2 }
        END { emit() }'
  done
}

torch_version() {  # tool default -> major.minor of the torch_version its rows record
  local v=""
  v=$(cat "$out/$1"-*.json 2>/dev/null | grep -o '"torch_version": "[^"]*"' | head -n 1 |
      sed 's/.*: "\([0-9]*\.[0-9]*\).*/\1/') || true
  echo "${v:-$2}"
}
for world in $worlds; do
for f in "${tools[@]}"; do rows "$f" "$world"; done > "$out/all-rows-w$world.txt"
echo
echo "# world size $world, float32, medians over $repeats interleaved rounds: time (us) / busbw (GB/s);"
echo "# tdist shm also p99 (us) and its fraction of the memory ceiling; last columns: tdist shm busbw as a"
echo "# multiple of OpenMPI's, PyTorch $(torch_version torch-gloo 1.13)'s Gloo and PyTorch $(torch_version torch2-gloo 2.x)'s Gloo"
awk '
  function median(key,    n, i, j, v, tmp) {
    n = split(vals[key], v, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j - 1] + 0 > v[j] + 0; j--) { tmp = v[j]; v[j] = v[j - 1]; v[j - 1] = tmp }
    return n == 0 ? "" : (n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2)
  }
  function add(key, x) { vals[key] = (key in vals) ? vals[key] " " x : x }
  {
    k = $1 SUBSEP $2 SUBSEP $3
    add(k SUBSEP "t", $4); add(k SUBSEP "p", $5); add(k SUBSEP "b", $6); if ($7 != "-") add(k SUBSEP "c", $7)
    if (!(($2, $3) in seen)) { seen[$2, $3] = 1; order[++n] = $2 SUBSEP $3 }
    have[$1, $2, $3] = 1
  }
  function cell(tool, op, s,    k) {
    k = tool SUBSEP op SUBSEP s
    return (tool, op, s) in have ? sprintf("  %9.1f / %6.2f", median(k SUBSEP "t"), median(k SUBSEP "b")) : sprintf("  %9s / %6s", "-", "-")
  }
  function ratio(tool, op, s,    k, o) {
    if (!((tool, op, s) in have) || !(("tdist-shm", op, s) in have)) return sprintf(" %7s", "-")
    o = median(tool SUBSEP op SUBSEP s SUBSEP "b")
    return o > 0 ? sprintf(" %7.1f", median("tdist-shm" SUBSEP op SUBSEP s SUBSEP "b") / o) : sprintf(" %7s", "-")
  }
  END {
    last = ""
    for (i = 1; i <= n; i++) {
      split(order[i], a, SUBSEP); op = a[1]; s = a[2]
      if (op != last) {
        printf "\n## %s\n%12s %18s %9s %7s %18s %18s %18s %18s %7s %7s %7s\n", op, "size(B)", "tdist shm", "p99", "of ceil",
               "openmpi", "tdist gloo", "torch1 gloo", "torch2 gloo", "x mpi", "x torch1", "x torch2"
        last = op
      }
      k = "tdist-shm" SUBSEP op SUBSEP s
      line = sprintf("%12d", s) cell("tdist-shm", op, s)
      line = line sprintf(" %9s", ("tdist-shm", op, s) in have ? sprintf("%.1f", median(k SUBSEP "p")) : "-")
      line = line sprintf(" %7s", (k SUBSEP "c") in vals ? sprintf("%.2f", median(k SUBSEP "c")) : "-")
      line = line cell("openmpi", op, s) cell("tdist-gloo", op, s) cell("torch-gloo", op, s) cell("torch2-gloo", op, s)
      print line ratio("openmpi", op, s) ratio("torch-gloo", op, s) ratio("torch2-gloo", op, s)
    }
  }' "$out/all-rows-w$world.txt"
done
exit $failed
