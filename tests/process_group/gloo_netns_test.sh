#!/usr/bin/env bash
# Gloo across two network namespaces joined by a veth pair: two "hosts" that
# share nothing but that link. Makes and removes everything itself; needs
# root and network namespaces (exits 77, which ctest reports as skipped,
# otherwise; under CI=true, where it must run, exits 1 instead, as
# tests/util/skip.h does).
#   tests/process_group/gloo_netns_test.sh BIN_DIR
set -euo pipefail
bin=${1:?usage: gloo_netns_test.sh BIN_DIR}
skip_or_fail_in_ci() {  # why
  if [ "${CI:-}" = true ]; then
    echo "FAILED: this test would skip, but CI=true, where it must run: $1"
    exit 1
  fi
  echo "SKIPPED: $1"
  exit 77
}
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
  skip_or_fail_in_ci "needs root and iproute2 to make network namespaces"
fi
id=$$
a=tdA$id b=tdB$id va=vA$id vb=vB$id
# 198.18.0.0/15 is reserved for benchmarking: nothing real lives there, and
# these addresses exist only inside the two namespaces made here.
ip_a=198.18.0.1 ip_b=198.18.0.2
work=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# Entering a namespace (ip -n, ip netns exec) also remounts /sys in a mount
# namespace of its own, which a chroot whose "/" is no mount point refuses.
err=$({ ip netns add "$a" && ip netns exec "$a" true; } 2>&1) ||
  skip_or_fail_in_ci "no network namespaces here: $err"
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add "$ip_a/24" dev "$va"
ip -n "$b" addr add "$ip_b/24" dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up

port=29777
run_rank() {  # namespace rank
  ip netns exec "$1" env MASTER_ADDR=$ip_a MASTER_PORT=$port RANK=$2 WORLD_SIZE=2 OMP_NUM_THREADS=1 \
    timeout 120 "$bin/allreduce_demo" --backend gloo --iters 30 --numel 300000 >"$work/rank$2.log" 2>&1
}
run_rank "$a" 0 & p0=$!
run_rank "$b" 1 & p1=$!
rc=0
wait $p0 || rc=1
wait $p1 || rc=1
cat "$work/rank0.log" "$work/rank1.log"
if [ $rc -ne 0 ]; then
  echo "FAILED: a rank exited non-zero"
  exit 1
fi
grep -q "30 all_reduces of 300000 floats on 2 ranks (gloo): all correct" "$work/rank0.log" || {
  echo "FAILED: rank 0 did not report correct all_reduces"
  exit 1
}
# "auto" sees two namespaces of one kernel: it may pick shm; gloo was forced above.
echo "PASSED: gloo across network namespaces $a ($ip_a) and $b ($ip_b)"
