#!/usr/bin/env bash
# Training through failures: fashion_mnist (DDP) for a fixed number of
# steps under tdist-run --max-restarts, with --checkpoint-dir, while a
# random rank is killed with SIGKILL every KILL_EVERY seconds; tdist-run
# restarts every rank and they resume from the latest checkpoint by
# themselves. The same run without failures goes first, in the same
# sitting. Reports:
#   - goodput: the failure-free run's time over the chaos run's (useful
#     steps per second against the failure-free rate);
#   - kills, and per failure the seconds lost and the steps redone: the
#     step the job had reached when a rank was killed less the step it
#     resumed at (rank 0's "resumed from ...: continuing at step T"); each,
#     their mean and max. The step reached is rank 0's progress line, which
#     the ranks redraw every 0.2 s (TDIST_TTY=1, as under tdist-run on a
#     terminal; tdist-run, writing to a file, keeps each line's last state):
#     a count may be low by the steps of 0.2 s, printed beside it;
#   - time to resume: from tdist-run's "restarting" line to rank 0's
#     "resumed from" line;
#   - whether the final weights equal the failure-free run's (bit for bit:
#     the examples' weights_fingerprint).
# Exits non-zero when the weights differ or a run fails.
#   [KILL_EVERY=60] [STEPS=6000] [CHECKPOINT_EVERY=100] [WORLD=2] [BATCH=64]
#     bench/chaos.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench/chaos]
# NODES=N (N > 1): whole nodes lost instead, across network namespaces, in
# an elastic job on etcd: bench/chaos_nodes.sh (its own variables).
set -euo pipefail
if [ "${NODES:-1}" -gt 1 ]; then exec bash "$(dirname "$0")/chaos_nodes.sh" "$@"; fi
build=${1:-build}
out=${2:-$build/bench/chaos}
kill_every=${KILL_EVERY:-60}
steps=${STEPS:-6000}
every=${CHECKPOINT_EVERY:-100}
world=${WORLD:-2}
batch=${BATCH:-64}
run="$build/bin/tdist-run"
example="$build/bin/fashion_mnist"
for f in "$run" "$example"; do
  [ -x "$f" ] || { echo "chaos.sh: no $f (build first: make build)" >&2; exit 2; }
done
rm -rf "$out"
mkdir -p "$out"
epochs=$(( (steps * world * batch) / 60000 + 1 ))
args=(--nproc-per-node "$world" "$example" --batch-size "$batch" --epochs "$epochs" --max-steps "$steps")
export TDIST_TTY=1  # rank 0's progress line in place, every 0.2 s (see above); both runs alike
export TDIST_DUMP_DIR="$out/dumps"  # the ranks' flight-recorder dumps at a peer's failure, with the rest
now() { date +%s.%N; }

echo "# chaos: fashion_mnist, world $world, $steps steps of $batch per rank, a checkpoint every $every steps,"
echo "# a random rank killed (SIGKILL) every $kill_every s"
t0=$(now)
"$run" "${args[@]}" --json "$out/straight.json" > "$out/straight.log" 2>&1 || {
  echo "chaos.sh: the failure-free run failed:" >&2; tail -5 "$out/straight.log" >&2; exit 1; }
t1=$(now)
straight_s=$(echo "$t1 - $t0" | bc -l)
printf "failure-free: %.1f s\n" "$straight_s"

# The chaos run; every line of its log stamped with its arrival time.
t0=$(now)
( "$run" --max-restarts 1000 "${args[@]}" --checkpoint-dir "$out/ckpt" --checkpoint-every "$every" \
    --json "$out/chaos.json" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done \
    > "$out/chaos.log" ) &
runner=$!
kills=0
: > "$out/kills.txt"
while kill -0 "$runner" 2>/dev/null; do
  slept=0
  while [ "$slept" -lt "$kill_every" ] && kill -0 "$runner" 2>/dev/null; do sleep 1; slept=$((slept + 1)); done
  kill -0 "$runner" 2>/dev/null || break
  victim=$(pgrep -x fashion_mnist | shuf -n 1 || true)
  if [ -n "$victim" ]; then
    latest=$(head -n 1 "$out/ckpt/latest" 2>/dev/null || echo none)
    if kill -9 "$victim" 2>/dev/null; then
      kills=$((kills + 1))
      echo "$(now) $victim $latest" >> "$out/kills.txt"
    fi
  fi
done
wait "$runner" || true
t1=$(now)
chaos_s=$(echo "$t1 - $t0" | bc -l)
if ! grep -q '"weights_fingerprint"' "$out/chaos.json" 2>/dev/null; then
  echo "chaos.sh: the chaos run did not finish:" >&2; tail -5 "$out/chaos.log" >&2; exit 1
fi

# Time to resume: each "restarting" line to the next "resumed from" line.
resume=$(awk '/tdist-run: restarting/ { r = $1 } /resumed from/ && r { s += $1 - r; n++; r = 0 }
              END { if (n) printf "%.2f %d", s / n, n; else print "0 0" }' "$out/chaos.log")
resume_s=${resume% *}
resumes=${resume#* }
# Steps redone. The log's starts of the job are split by tdist-run's
# "restarting" lines; a start begins at the step it resumed at (0 without a
# "resumed from" line) and reaches the highest step rank 0's progress shows
# ("step X/Y": X counts from the resume). Failure i: start i's step reached
# less start i+1's first step, never below 0 (the job had reached the step
# it resumed at, even when rank 0's line last showed an earlier one).
redone=$(awk 'BEGIN { n = 0 }
  function close_start() { at_[n] = at; reached_[n] = reached; n++; at = 0; reached = 0 }
  /\[rank 0\]: resumed from .*continuing at step [0-9]+/ {
    match($0, /continuing at step [0-9]+/); at = substr($0, RSTART + 19) + 0; if (at > reached) reached = at }
  /\[rank 0\]: / { s = $0
    while (match(s, /step [0-9]+\/[0-9]+/)) {
      x = substr(s, RSTART + 5, RLENGTH - 5); sub(/\/.*/, "", x); if (at + x > reached) reached = at + x
      s = substr(s, RSTART + RLENGTH) } }
  /tdist-run: restarting all ranks/ { close_start() }
  END { close_start(); for (i = 0; i + 1 < n; i++) { d = reached_[i] - at_[i + 1]; printf "%d ", (d > 0 ? d : 0) } }' "$out/chaos.log")
redone_stats=$(echo "$redone" | awk '{ for (i = 1; i <= NF; i++) { s += $i; if (i == 1 || $i > m) m = $i }
                                      if (NF) printf "%.1f %d", s / NF, m; else print "0 0" }')
redone_mean=${redone_stats% *}
redone_max=${redone_stats#* }
# Rank 0 redraws its progress line every 0.2 s: a step reached may be low by the steps of 0.2 s.
redone_slack=$(echo "$steps / $straight_s * 0.2" | bc -l | awk '{ printf "%d", $1 + 0.999 }')
fp() { sed -n 's/.*"weights_fingerprint": "\([0-9a-f]*\)".*/\1/p' "$1"; }
same=no
[ "$(fp "$out/straight.json")" = "$(fp "$out/chaos.json")" ] && same=yes
goodput=$(echo "$straight_s / $chaos_s" | bc -l)
lost=0
[ "$kills" -gt 0 ] && lost=$(echo "($chaos_s - $straight_s) / $kills" | bc -l)
printf "chaos: %.1f s, %d kills, %d resumes\n" "$chaos_s" "$kills" "$resumes"
printf "goodput %.1f %% of the failure-free rate; %.1f s lost per failure; %.2f s from restart to resumed\n" \
  "$(echo "100 * $goodput" | bc -l)" "$lost" "$resume_s"
printf "steps redone per failure: %s(mean %s, max %s; each may be up to %d low; a checkpoint every %d steps)\n" \
  "${redone:-none }" "$redone_mean" "$redone_max" "$redone_slack" "$every"
echo "final weights equal to the failure-free run's: $same"
num() { printf '%.4f' "$1"; }  # bc writes ".82": no JSON number
cat > "$out/chaos-summary.json" <<EOF
{"world_size": $world, "steps": $steps, "checkpoint_every": $every, "kill_every_s": $kill_every,
 "straight_s": $(num "$straight_s"), "chaos_s": $(num "$chaos_s"), "kills": $kills, "resumes": $resumes,
 "goodput": $(num "$goodput"), "seconds_lost_per_failure": $(num "$lost"), "resume_s": $resume_s,
 "steps_redone": [$(echo $redone | tr ' ' ',')], "steps_redone_mean": $redone_mean, "steps_redone_max": $redone_max,
 "steps_redone_slack": $redone_slack, "weights_equal": "$same"}
EOF
[ "$same" = yes ]
