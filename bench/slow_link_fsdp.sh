#!/usr/bin/env bash
# FSDP across hosts over a slow link: WORLDS (default "2 4") nodes, each a
# network namespace on one bridge (tests/net/netlab.sh) whose link is
# rate-limited both ways with tc (RATE, default 100mbit), one rank of
# `tdist-bench fsdp --backend gloo` per node. For each world size and
# VARIANTS (default "full_shard no_shard") it reports, per rank and step:
#   - the TCP bytes the busiest rank sent (wire), the ring collectives'
#     bound for the same gathers and reductions ((N-1)/N of each all-gather
#     and reduce-scatter, 2(N-1)/N of each all-reduce), and wire / bound
#     (target: at most 1.05);
#   - the step time, and the time those bytes take at RATE (bytes * 8 /
#     rate), and step / that (target: at most 1.1: the link never idles).
# The model is the bench's MLP at MODEL_ARGS (default 8 blocks of
# 256 -> 1024 -> 256, 4.2 M parameters: about 2 s of wire a step at
# 100 Mbit/s), STEPS timed steps (default 3) after two untimed, with FSDP's
# forward_prefetch on (what a job bound by its link sets: each unit's
# forward queues the next unit's gather before waiting for its own, so the
# link does not idle while a unit computes; FORWARD_PREFETCH=0 turns it off).
# Before the variants of each world size it times plain TCP round the same
# ring (bench/tcp_ring_floor.py: each node streams FLOOR_BYTES, default
# 24M, to the next while it takes as much from the one before) and prints
# the steady part's time (the last three quarters) against those bytes'
# time at RATE: what TCP's headers and ACKs and the shaper leave of the
# link, the floor under "x rate" (FLOOR=0 skips it; it needs python3).
# Prints a table and writes OUT_DIR/slow_link_fsdp.json. Needs root.
#
#   [WORLDS="2 4"] [RATE=100mbit] [VARIANTS="full_shard no_shard"] [STEPS=3] [FORWARD_PREFETCH=1]
#   [FLOOR=1] [FLOOR_BYTES=24M]
#   bench/slow_link_fsdp.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out=${2:-$build/bench}
WORLDS=${WORLDS:-"2 4"}
RATE=${RATE:-100mbit}
VARIANTS=${VARIANTS:-"full_shard no_shard"}
STEPS=${STEPS:-3}
prefetch=(--forward-prefetch) fp_json=true
[ "${FORWARD_PREFETCH:-1}" != 0 ] || { prefetch=(); fp_json=false; }
MODEL_ARGS=${MODEL_ARGS:-"--model mlp --blocks 8 --width 256 --hidden 1024 --batch 8"}
bench="$(cd "$build" && pwd)/bin/tdist-bench"
[ -x "$bench" ] || { echo "slow_link_fsdp.sh: $bench not built (make build)" >&2; exit 2; }
# shellcheck source=../tests/net/netlab.sh
source "$here/../tests/net/netlab.sh"
netlab_require
mkdir -p "$out"

# RATE in bits per second (tc's units: kbit, mbit, gbit).
rate_bps=$(awk -v r="$RATE" 'BEGIN {
  n = r + 0; u = tolower(substr(r, length(n "") + 1));
  m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : (u == "bit" || u == "") ? 1 : -1;
  if (m < 0) exit 1; printf "%.0f", n * m }') || { echo "slow_link_fsdp.sh: RATE=$RATE: use bit, kbit, mbit or gbit" >&2; exit 2; }

max_world=0
for w in $WORLDS; do [ "$w" -gt "$max_world" ] && max_world=$w; done
netlab_up "$max_world"
for ((k = 0; k < max_world; ++k)); do netlab_rate "$k" "$RATE"; done

json="$out/slow_link_fsdp.json"
echo "[" >"$json"
first=1
port=29900
echo "# FSDP over gloo, one rank per network namespace, every link at $RATE both ways; per rank and step" \
  "(forward_prefetch: $fp_json)"
echo "# wire: TCP bytes the busiest rank sent; bound: what ring collectives must send; at rate: wire * 8 / rate"
printf "%-6s %-12s %10s %10s %8s %10s %10s %8s\n" world variant "wire MiB" "bound MiB" "x bound" "step s" "at rate s" "x rate"
floor_bytes=$(awk -v b="${FLOOR_BYTES:-24M}" 'BEGIN {
  n = b + 0; u = toupper(substr(b, length(n "") + 1));
  m = (u == "K") ? 1024 : (u == "M") ? 1048576 : (u == "G") ? 1073741824 : (u == "") ? 1 : -1;
  if (m < 0 || n * m < 4194304) exit 1; printf "%.0f", n * m }') ||
  { echo "slow_link_fsdp.sh: FLOOR_BYTES=$FLOOR_BYTES: at least 4M (bytes, K, M or G)" >&2; exit 2; }
# What the floor's streams may take: three times their bytes at RATE, and 30 s.
floor_timeout=$(awk -v b="$floor_bytes" -v bps="$rate_bps" 'BEGIN { printf "%d", 3 * b * 8 / bps + 30 }')
# Plain TCP round a ring of W nodes: prints the slowest node's time over
# the bytes' time at RATE ("" when it cannot run).
tcp_ring_floor() {  # W
  local w=$1 k ips="" start pids=() rc=0 slowest
  [ "${FLOOR:-1}" != 0 ] && [ "$w" -ge 2 ] && command -v python3 >/dev/null || return 0
  for ((k = 0; k < w; ++k)); do ips+="${ips:+,}$(netlab_ip "$k")"; done
  start=$(python3 -c 'import time; print(time.time() + 2)')
  for ((k = 0; k < w; ++k)); do
    netlab_exec "$k" timeout $((floor_timeout + 10)) python3 "$here/tcp_ring_floor.py" --rank "$k" --ips "$ips" \
      --bytes "$floor_bytes" --start "$start" --timeout "$floor_timeout" >"$NETLAB_DIR/floor$w.$k" 2>&1 &
    pids+=($!)
  done
  for k in "${pids[@]}"; do wait "$k" || rc=1; done
  if [ $rc -ne 0 ]; then
    echo "slow_link_fsdp.sh: the TCP floor at world $w failed:" >&2
    cat "$NETLAB_DIR/floor$w".* >&2
    return 0
  fi
  slowest=$(sort -g "$NETLAB_DIR/floor$w".* | tail -1)
  awk -v s="$slowest" -v b="$floor_bytes" -v bps="$rate_bps" 'BEGIN { printf "%.3f", s / ((b - int(b / 4)) * 8 / bps) }'
}

for w in $WORLDS; do
  floor=$(tcp_ring_floor "$w")
  [ -z "$floor" ] || echo "# world $w: plain TCP round the ring takes ${floor}x its bytes' time at $RATE (the floor under x rate)"
  for v in $VARIANTS; do
    port=$((port + 1))
    dir="$NETLAB_DIR/$w-$v"
    mkdir -p "$dir"
    pids=()
    for ((k = 0; k < w; ++k)); do
      # shellcheck disable=SC2086
      netlab_exec "$k" env RANK=$k WORLD_SIZE=$w MASTER_ADDR="$(netlab_ip 0)" MASTER_PORT=$port OMP_NUM_THREADS=1 \
        TDIST_GLOO_IFNAME=eth0 timeout 900 "$bench" fsdp --backend gloo --world-size "$w" $MODEL_ARGS \
        "${prefetch[@]}" --steps "$STEPS" --rounds 1 --run-variant "$v" --result "$dir/result" >"$dir/rank$k.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    if [ $rc -ne 0 ] || [ ! -s "$dir/result" ]; then
      echo "slow_link_fsdp.sh: world $w, $v failed:" >&2
      tail -5 "$dir"/rank*.log >&2
      exit 1
    fi
    # The result's fields (fsdp_bench.cpp, Result): ms first, wire and its bound last.
    read -r -a f <"$dir/result"
    line=$(awk -v ms="${f[0]}" -v wire="${f[9]}" -v bound="${f[10]}" -v bps="$rate_bps" 'BEGIN {
      at = wire * 8 / bps; s = ms / 1000;
      printf "%.2f %.2f %.3f %.2f %.2f %.3f", wire / 1048576, bound / 1048576, (bound > 0 ? wire / bound : 0), s, at, (at > 0 ? s / at : 0) }')
    read -r wire_mib bound_mib x_bound step_s at_s x_rate <<<"$line"
    printf "%-6s %-12s %10s %10s %8s %10s %10s %8s\n" "$w" "$v" "$wire_mib" "$bound_mib" "$x_bound" "$step_s" "$at_s" "$x_rate"
    [ $first -eq 1 ] || echo "," >>"$json"
    first=0
    echo -n "  {\"world_size\": $w, \"variant\": \"$v\", \"forward_prefetch\": $fp_json, \"rate\": \"$RATE\", \"wire_bytes_per_step\": ${f[9]}, \"wire_bound_bytes_per_step\": ${f[10]}, \"wire_over_bound\": $x_bound, \"step_s\": $step_s, \"wire_at_rate_s\": $at_s, \"step_over_wire_time\": $x_rate, \"tcp_ring_over_wire_time\": ${floor:-null}}" >>"$json"
  done
done
echo >>"$json"
echo "]" >>"$json"
echo
echo "JSON: $json"
