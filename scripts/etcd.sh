#!/usr/bin/env bash
# A local etcd for tdist-run --rdzv-backend etcd (Debian's etcd-server):
# one member on this host, or --members N on this host's loopback (to try
# losing one). For a real job, run one member on each of three or more
# hosts (docs/launching.md, "etcd") so that no one host is the job's.
#   scripts/etcd.sh start [--members N] [--port P] [--dir DIR]
#   scripts/etcd.sh stop  [--dir DIR]
#   scripts/etcd.sh status [--dir DIR]
# Members listen on 127.0.0.1, client ports P, P+2, ... and peer ports P+1,
# P+3, ... (P: 2379); data and logs under DIR (build/etcd). `start` prints
# the --rdzv-endpoint to give tdist-run.
set -euo pipefail
cmd=${1:-}
shift || true
members=1 port=2379 dir=build/etcd
while [ $# -gt 0 ]; do
  case "$1" in
    --members) members=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) echo "etcd.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$members" in [1-9]) ;; *) echo "etcd.sh: --members takes 1 to 9" >&2; exit 2 ;; esac
endpoints() {
  local s="" i
  for ((i = 0; i < members; i++)); do s+="${s:+,}127.0.0.1:$((port + 2 * i))"; done
  echo "$s"
}
case "$cmd" in
  start)
    command -v etcd >/dev/null || { echo "etcd.sh: no etcd (make deps installs Debian's etcd-server)" >&2; exit 1; }
    mkdir -p "$dir"
    initial=""
    for ((i = 0; i < members; i++)); do initial+="${initial:+,}e$i=http://127.0.0.1:$((port + 2 * i + 1))"; done
    for ((i = 0; i < members; i++)); do
      c=http://127.0.0.1:$((port + 2 * i)) p=http://127.0.0.1:$((port + 2 * i + 1))
      if [ -f "$dir/e$i.pid" ] && kill -0 "$(cat "$dir/e$i.pid")" 2>/dev/null; then
        echo "etcd.sh: member e$i already runs (pid $(cat "$dir/e$i.pid"))" >&2; exit 1
      fi
      nohup etcd --name "e$i" --data-dir "$dir/e$i" --listen-client-urls "$c" --advertise-client-urls "$c" \
        --listen-peer-urls "$p" --initial-advertise-peer-urls "$p" --initial-cluster "$initial" \
        --initial-cluster-state new --initial-cluster-token "tdist-$$" > "$dir/e$i.log" 2>&1 &
      echo $! > "$dir/e$i.pid"
    done
    # Ready when the cluster takes a write (a leader is elected), within 30 s.
    for _ in $(seq 1 150); do
      if ETCDCTL_API=3 etcdctl --endpoints "$(endpoints)" put tdist-etcd-check ok >/dev/null 2>&1; then
        echo "etcd: $members member(s) in $dir; tdist-run --rdzv-backend etcd --rdzv-endpoint $(endpoints)"
        exit 0
      fi
      sleep 0.2
    done
    echo "etcd.sh: the cluster did not come up in 30 s; see $dir/e*.log" >&2
    exit 1 ;;
  stop)
    for f in "$dir"/e*.pid; do
      [ -f "$f" ] || continue
      kill "$(cat "$f")" 2>/dev/null || true
      rm -f "$f"
    done
    echo "etcd: stopped (data kept in $dir; rm -rf it for a fresh cluster)" ;;
  status)
    ETCDCTL_API=3 etcdctl --endpoints "$(endpoints)" endpoint status -w table ;;
  *) echo "usage: scripts/etcd.sh start|stop|status [--members N] [--port P] [--dir DIR]" >&2; exit 2 ;;
esac
