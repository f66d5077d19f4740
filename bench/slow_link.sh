#!/usr/bin/env bash
# Training over a slow link: two network namespaces joined by a veth pair
# whose both ends are rate-limited with tc (token bucket), the Fashion-MNIST
# example on the gloo backend across them, one rank per namespace.
#
#   sudo bench/slow_link.sh [BIN_DIR] [OUT_DIR]
#
# For each rate (RATES, default "1gbit 100mbit") and hook (HOOKS, default
# allreduce, fp16 and PowerSGD rank 1, 2, 4) it runs STEPS training steps
# (default 40; the first WARMUP, default 5, are not timed; PowerSGD starts
# compressing after 2) and reports ms per step and bytes sent per step. Then
# it trains EPOCHS full epochs (default 4, as the demo) with every hook over the first
# rate and reports test accuracy: the arithmetic does not depend on the link.
# Prints a table and writes OUT_DIR/slow_link.json. Needs root; it creates
# and removes only its own namespaces, veth pair and 198.18.0.0/24 addresses.
set -euo pipefail
bin=${1:-build/bin}
out=${2:-build/bench}
RATES=${RATES:-"1gbit 100mbit"}
HOOKS=${HOOKS:-"allreduce fp16 powersgd:1 powersgd:2 powersgd:4"}
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-5}
EPOCHS=${EPOCHS:-4}
ACCURACY=${ACCURACY:-1}  # 0: step times only
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "slow_link.sh: needs root, iproute2 and tc (network namespaces, rate limits)" >&2
  exit 77
fi
[ -x "$bin/fashion_mnist" ] || { echo "slow_link.sh: $bin/fashion_mnist not built (make build)" >&2; exit 2; }
mkdir -p "$out"
id=$$
a=tsA$id b=tsB$id va=sA$id vb=sB$id
# 198.18.0.0/15 is reserved for benchmarking; these addresses exist only in
# the two namespaces made here.
ip_a=198.18.0.1 ip_b=198.18.0.2
work=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add "$ip_a/24" dev "$va"
ip -n "$b" addr add "$ip_b/24" dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up

set_rate() {  # rate, on both ends
  for pair in "$a:$va" "$b:$vb"; do
    ns=${pair%%:*} dev=${pair#*:}
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$1" burst 512kb latency 100ms
  done
}

port=29800
# run NAME HOOK EXTRA...: both ranks; rank 0's JSON lands in $work/NAME.json
run() {
  local name=$1 hook=$2
  shift 2
  local args=(--backend gloo --hook "$hook" --json "$work/$name.json" "$@")
  port=$((port + 1))
  ip netns exec "$a" env MASTER_ADDR=$ip_a MASTER_PORT=$port RANK=0 WORLD_SIZE=2 OMP_NUM_THREADS=1 \
    timeout 1800 "$bin/fashion_mnist" "${args[@]}" >"$work/$name.0.log" 2>&1 &
  local p0=$!
  ip netns exec "$b" env MASTER_ADDR=$ip_a MASTER_PORT=$port RANK=1 WORLD_SIZE=2 OMP_NUM_THREADS=1 \
    timeout 1800 "$bin/fashion_mnist" "${args[@]}" >"$work/$name.1.log" 2>&1 &
  local p1=$! rc=0
  wait $p0 || rc=1
  wait $p1 || rc=1
  if [ $rc -ne 0 ]; then
    echo "slow_link.sh: run $name failed:" >&2
    tail -5 "$work/$name.0.log" "$work/$name.1.log" >&2
    exit 1
  fi
}

hook_args() {  # powersgd:R -> --hook powersgd --powersgd-rank R
  case $1 in
    powersgd:*) echo "powersgd --powersgd-rank ${1#powersgd:} --powersgd-start-iter 2" ;;
    *) echo "$1" ;;
  esac
}

field() { sed -n "s/.*\"$2\": \([^,}]*\).*/\1/p" "$work/$1.json"; }

json="$out/slow_link.json"
echo "[" >"$json"
first=1
emit() { [ $first -eq 1 ] || echo "," >>"$json"; first=0; echo -n "  $1" >>"$json"; }

echo "# Fashion-MNIST MLP, 2 ranks in two network namespaces, gloo, one thread per rank"
echo "# step time: $STEPS steps (first $WARMUP untimed); bytes: per rank per step, once compressing"
printf "%-10s %-12s %12s %14s %10s\n" rate hook ms/step bytes/step "x allreduce"
for rate in $RATES; do
  set_rate "$rate"
  base=""
  for h in $HOOKS; do
    name="step_${rate}_${h/:/_}"
    # shellcheck disable=SC2046
    run "$name" $(hook_args "$h") --epochs 1 --max-steps "$STEPS" --warmup-steps "$WARMUP"
    ms=$(field "$name" ms_per_step)
    bytes=$(field "$name" bytes_per_step)
    [ -n "$base" ] || base=$ms
    speedup=$(awk -v b="$base" -v m="$ms" 'BEGIN { printf "%.1f", b / m }')
    printf "%-10s %-12s %12.1f %14.0f %10s\n" "$rate" "$h" "$ms" "$bytes" "$speedup"
    emit "{\"kind\": \"step\", \"rate\": \"$rate\", \"hook\": \"$h\", \"ms_per_step\": $ms, \"bytes_per_step\": $bytes, \"speedup_vs_allreduce\": $speedup}"
  done
done

rate=${RATES%% *}
set_rate "$rate"
[ "$ACCURACY" = 1 ] || HOOKS=""
echo
echo "# test accuracy after $EPOCHS epoch(s), over $rate"
printf "%-12s %10s %14s\n" hook accuracy "points vs allreduce"
base=""
for h in $HOOKS; do
  name="acc_${h/:/_}"
  # shellcheck disable=SC2046
  run "$name" $(hook_args "$h") --epochs "$EPOCHS"
  acc=$(field "$name" test_accuracy)
  [ -n "$base" ] || base=$acc
  diff=$(awk -v b="$base" -v a="$acc" 'BEGIN { printf "%+.2f", 100 * (a - b) }')
  printf "%-12s %9.2f%% %14s\n" "$h" "$(awk -v a="$acc" 'BEGIN { print 100 * a }')" "$diff"
  emit "{\"kind\": \"accuracy\", \"rate\": \"$rate\", \"hook\": \"$h\", \"epochs\": $EPOCHS, \"test_accuracy\": $acc, \"points_vs_allreduce\": $diff}"
done
echo >>"$json"
echo "]" >>"$json"
echo
echo "JSON: $json"
