# netlab.sh: a network of "nodes" on this machine, and faults on it. A
# bash library: source it (from a script with `set -euo pipefail`), then
# call its functions. Needs root, iproute2, nftables and tc (and iptables
# for netlab_delay, etcd for netlab_etcd_up).
#
# The contract:
#   netlab_require                 root, ip, nft, tc and working network namespaces, or exit:
#                                  77 (ctest's skip), or 1 under CI=true, where the test must run
#                                  (as tests/process_group/gloo_netns_test.sh and tests/util/skip.h)
#   netlab_up N                    N node namespaces, each with eth0 on one bridge (in a namespace of
#                                  its own) and lo up; node K is 198.18.0.(10+K)/24 (198.18.0.0/15 is
#                                  reserved for benchmarking: these addresses exist only in these
#                                  namespaces). Names carry NETLAB_ID (default $$), so runs in
#                                  parallel do not meet. Installs an EXIT/INT/TERM trap that tears
#                                  everything down (netlab_on_teardown adds to it: do not replace it).
#   netlab_ns K, netlab_ip K       node K's namespace and address
#   netlab_exec K CMD...           CMD in node K's namespace
#   netlab_pids K                  the processes in node K's namespace (the helpers below excluded)
#   NETLAB_DIR                     a scratch directory, removed at teardown
#
#   Faults (each on node K; each replaces the same fault already there; netlab_clear K ends all):
#   netlab_loss K PCT [ingress|egress|both]   drop PCT % of K's packets at random (nft numgen;
#                                  PCT may have two decimals). Default ingress, as on the wire: the
#                                  sender's kernel never learns (a drop on egress fails the send
#                                  locally, which TCP sees at once). On every node's ingress: each
#                                  packet between nodes is at risk once
#   netlab_delay K MS JITTER_MS [ingress|egress|both]   hold each of K's packets MS +- JITTER_MS
#                                  (uniform) in NETLAB_NFQ_DELAY (tools/netdelay/nfq_delay) through
#                                  NFQUEUE (`bypass`: packets flow unqueued if it is gone; the rule
#                                  is iptables' NFQUEUE target: nft's `queue` needs CONFIG_NFT_QUEUE,
#                                  which this VM's kernel lacks). Default ingress: a packet held on
#                                  its sender's egress still counts against its socket, and TCP's
#                                  small-queue limit then lets about one packet per delay through
#                                  (2 MB took 15 s at 30 ms). Packets keep their order
#   netlab_rate K RATE             tbf at RATE (tc's units: 10mbit) on K's link, both directions
#   netlab_partition K [drop|down] cut K off: drop, silently, all that K receives but on lo and all
#                                  that the other nodes receive from K (default), or set K's link
#                                  down (K's own sends then fail at once)
#   netlab_heal K                  end the partition
#   netlab_freeze K / netlab_thaw K   SIGSTOP / SIGCONT every process of K (its launcher, ranks,
#                                  an etcd member: a node that hangs), the helpers excepted
#   netlab_clear K                 all of K's faults off (a frozen node is thawed)
#   netlab_kill K                  SIGKILL every process of K
#
#   etcd, one member per node (etcd 3.4, /usr/bin/etcd):
#   netlab_etcd_up [NODES...]      a member on each of NODES (default every node), client port
#                                  2379, peer port 2380; waits (bounded) for a leader; sets
#                                  NETLAB_ETCD_ENDPOINTS=ip:2379,ip:2379,...
#   netlab_etcd_leader [FROM...]   the node index of the leader, as the members on FROM (default
#                                  every etcd node) see it; fails when none answers
#
#   netlab_teardown                stops the helpers, SIGKILLs what is left in the namespaces,
#                                  deletes them and NETLAB_DIR; idempotent (the trap calls it)
#
# Every wait here is bounded. Nothing outside the namespaces made here is
# touched, but for NETLAB_DIR.

NETLAB_ID=${NETLAB_ID:-$$}
NETLAB_N=0
NETLAB_DIR=${NETLAB_DIR:-}
NETLAB_NFQ_DELAY=${NETLAB_NFQ_DELAY:-}
NETLAB_ETCD_ENDPOINTS=""
NETLAB_ETCD_NODES=()
_netlab_teardown_hooks=()
_netlab_up=0
_netlab_delays=0

_netlab_skip_or_fail_in_ci() {  # why
  if [ "${CI:-}" = true ]; then
    echo "FAILED: this test would skip, but CI=true, where it must run: $1"
    exit 1
  fi
  echo "SKIPPED: $1"
  exit 77
}

netlab_require() {
  if [ "$(id -u)" -ne 0 ]; then _netlab_skip_or_fail_in_ci "needs root to make network namespaces"; fi
  local tool
  for tool in ip nft tc; do
    command -v "$tool" >/dev/null || _netlab_skip_or_fail_in_ci "needs $tool (iproute2, nftables)"
  done
  # Entering a namespace (ip -n, ip netns exec) also remounts /sys in a mount
  # namespace of its own, which a chroot whose "/" is no mount point refuses;
  # nft in a namespace needs nf_tables.
  local probe="nl${NETLAB_ID}probe" err
  err=$({ ip netns add "$probe" && ip netns exec "$probe" nft list tables; } 2>&1) || {
    ip netns del "$probe" 2>/dev/null || true
    _netlab_skip_or_fail_in_ci "no network namespaces with nftables here: $err"
  }
  ip netns del "$probe"
}

netlab_ns() { echo "nl${NETLAB_ID}n$1"; }
netlab_ip() { echo "198.18.0.$((10 + $1))"; }
_netlab_br() { echo "nl${NETLAB_ID}br"; }
netlab_exec() {
  local k=$1
  shift
  ip netns exec "$(netlab_ns "$k")" "$@"
}

netlab_on_teardown() { _netlab_teardown_hooks+=("$*"); }

netlab_up() {  # N
  local n=$1 k ns br
  [ "$n" -ge 1 ] && [ "$n" -le 200 ] || { echo "netlab_up: 1 to 200 nodes, not $n" >&2; return 1; }
  NETLAB_N=$n
  [ -n "$NETLAB_DIR" ] || NETLAB_DIR=$(mktemp -d "${TMPDIR:-/tmp}/netlab.XXXXXX")
  mkdir -p "$NETLAB_DIR"
  _netlab_up=1
  trap 'netlab_teardown' EXIT
  trap 'netlab_teardown; trap - EXIT; exit 130' INT
  trap 'netlab_teardown; trap - EXIT; exit 143' TERM
  br=$(_netlab_br)
  ip netns add "$br"
  ip -n "$br" link add br0 type bridge
  ip -n "$br" link set br0 up
  ip -n "$br" link set lo up
  for ((k = 0; k < n; k++)); do
    ns=$(netlab_ns "$k")
    ip netns add "$ns"
    # Made inside the namespaces: no name in this machine's own namespace.
    ip -n "$ns" link add eth0 type veth peer name "p$k" netns "$br"
    ip -n "$br" link set "p$k" master br0
    ip -n "$br" link set "p$k" up
    ip -n "$ns" addr add "$(netlab_ip "$k")/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
}

# The processes of node K's namespace, but for the helpers started here.
netlab_pids() {
  local k=$1 p skip=" "
  [ -f "$NETLAB_DIR/helpers.$k" ] && skip=" $(tr '\n' ' ' < "$NETLAB_DIR/helpers.$k") "
  for p in $(ip netns pids "$(netlab_ns "$k")" 2>/dev/null); do
    case "$skip" in *" $p "*) ;; *) echo "$p" ;; esac
  done
}

# An nft table of its own per fault, so that each is replaced and cleared
# alone. Priorities: the partition's drop first (-10), then loss (-5), then
# delay (0, below).
_netlab_nft_table() {  # K NAME PRIORITY DIR RULE
  local k=$1 name=$2 prio=$3 dir=$4 rule=$5
  _netlab_nft_drop "$k" "$name"
  {
    echo "table inet $name {"
    case $dir in egress|both) echo "  chain out { type filter hook output priority $prio; oifname != \"lo\" $rule; }" ;; esac
    case $dir in ingress|both) echo "  chain in { type filter hook input priority $prio; iifname != \"lo\" $rule; }" ;; esac
    echo "}"
  } | netlab_exec "$k" nft -f -
}
_netlab_nft_drop() { netlab_exec "$1" nft delete table inet "$2" 2>/dev/null || true; }

_netlab_dir_arg() {
  case ${1:-ingress} in
    egress|ingress|both) echo "${1:-ingress}" ;;
    *) echo "netlab: direction egress, ingress or both, not '$1'" >&2; return 1 ;;
  esac
}

netlab_loss() {  # K PCT [DIR]
  local k=$1 pct=$2 dir bp
  dir=$(_netlab_dir_arg "${3:-}")
  # Basis points: numgen draws an integer.
  bp=$(awk -v p="$pct" 'BEGIN { if (p !~ /^[0-9]+(\.[0-9]+)?$/ || p > 100) exit 1; printf "%d", p * 100 + 0.5 }') ||
    { echo "netlab_loss: a percentage from 0 to 100, not '$pct'" >&2; return 1; }
  _netlab_nft_table "$k" netlab_loss -5 "$dir" "numgen random mod 10000 < $bp drop"
}

netlab_delay() {  # K MS JITTER_MS [DIR]
  local k=$1 ms=$2 jitter=$3 dir log pid i
  dir=$(_netlab_dir_arg "${4:-}")
  [ -x "$NETLAB_NFQ_DELAY" ] || { echo "netlab_delay: NETLAB_NFQ_DELAY ('$NETLAB_NFQ_DELAY') is no program" >&2; return 1; }
  _netlab_delay_stop "$k"
  log="$NETLAB_DIR/nfq_delay.$k.$((++_netlab_delays)).log"  # a new file: no "ready" of the last one
  # ip netns exec execs the program: $! is its pid (through the function, a subshell's).
  ip netns exec "$(netlab_ns "$k")" "$NETLAB_NFQ_DELAY" --queue 0 --delay "$ms" --jitter "$jitter" > "$log" 2>&1 &
  pid=$!
  disown "$pid"  # no "Killed" notice from the caller's shell at teardown
  echo "$pid" > "$NETLAB_DIR/delay.$k"
  echo "$pid" >> "$NETLAB_DIR/helpers.$k"
  for ((i = 0; i < 100; i++)); do
    grep -q "ready" "$log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "netlab_delay: nfq_delay failed:" >&2; cat "$log" >&2; return 1; }
    sleep 0.1
  done
  grep -q "ready" "$log" || { echo "netlab_delay: nfq_delay not ready after 10 s:" >&2; cat "$log" >&2; return 1; }
  echo "$dir" > "$NETLAB_DIR/delay_dir.$k"
  _netlab_queue_rules "$k" -A "$dir"
}

# nft's own `queue` statement needs CONFIG_NFT_QUEUE, which some kernels
# (this VM's) lack; iptables' NFQUEUE target (xt_NFQUEUE, through
# nft_compat with iptables-nft) needs only CONFIG_NETFILTER_XT_TARGET_NFQUEUE.
# In the filter table, at priority 0: after the partition's and loss's drops.
_netlab_queue_rules() {  # K -A|-D DIR
  local k=$1 op=$2 dir=$3 ipt
  ipt=$(command -v iptables-nft || command -v iptables-legacy || command -v iptables) ||
    { echo "netlab_delay: needs iptables (Debian's iptables) for the NFQUEUE rule" >&2; return 1; }
  case $dir in egress|both) netlab_exec "$k" "$ipt" -w "$op" OUTPUT ! -o lo -j NFQUEUE --queue-num 0 --queue-bypass ;; esac
  case $dir in ingress|both) netlab_exec "$k" "$ipt" -w "$op" INPUT ! -i lo -j NFQUEUE --queue-num 0 --queue-bypass ;; esac
}

_netlab_delay_stop() {  # K: the queue rule first, then the program (it lets go of what it holds)
  local k=$1 pid i
  if [ -f "$NETLAB_DIR/delay_dir.$k" ]; then
    _netlab_queue_rules "$k" -D "$(cat "$NETLAB_DIR/delay_dir.$k")" 2>/dev/null || true
    rm -f "$NETLAB_DIR/delay_dir.$k"
  fi
  [ -f "$NETLAB_DIR/delay.$k" ] || return 0
  pid=$(cat "$NETLAB_DIR/delay.$k")
  rm -f "$NETLAB_DIR/delay.$k"
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 30; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

netlab_rate() {  # K RATE
  local k=$1 rate=$2 q="tbf rate $2 burst 64kb latency 100ms"
  # shellcheck disable=SC2086
  tc -n "$(netlab_ns "$k")" qdisc replace dev eth0 root $q
  # shellcheck disable=SC2086
  tc -n "$(_netlab_br)" qdisc replace dev "p$k" root $q
}

_netlab_rate_clear() {
  tc -n "$(netlab_ns "$1")" qdisc del dev eth0 root 2>/dev/null || true
  tc -n "$(_netlab_br)" qdisc del dev "p$1" root 2>/dev/null || true
}

netlab_partition() {  # K [drop|down]
  local k=$1 how=${2:-drop} j
  case $how in
    drop)
      _netlab_nft_table "$k" netlab_part -10 ingress drop
      for ((j = 0; j < NETLAB_N; j++)); do
        [ "$j" = "$k" ] || _netlab_nft_table "$j" "netlab_part_$k" -10 ingress "ip saddr $(netlab_ip "$k") drop"
      done ;;
    down) ip -n "$(netlab_ns "$k")" link set eth0 down ;;
    *) echo "netlab_partition: drop or down, not '$how'" >&2; return 1 ;;
  esac
}

netlab_heal() {  # K
  local k=$1 j
  _netlab_nft_drop "$k" netlab_part
  for ((j = 0; j < NETLAB_N; j++)); do [ "$j" = "$k" ] || _netlab_nft_drop "$j" "netlab_part_$k"; done
  ip -n "$(netlab_ns "$k")" link set eth0 up
}

netlab_freeze() {  # K: again until no new process shows up (a launcher may be forking)
  local k=$1 p new round
  touch "$NETLAB_DIR/frozen.$k"
  for ((round = 0; round < 5; round++)); do
    new=0
    for p in $(netlab_pids "$k"); do
      grep -qx "$p" "$NETLAB_DIR/frozen.$k" && continue
      kill -STOP "$p" 2>/dev/null && { echo "$p" >> "$NETLAB_DIR/frozen.$k"; new=1; }
    done
    [ $new -eq 1 ] || break
  done
}

netlab_thaw() {  # K
  local k=$1 p
  [ -f "$NETLAB_DIR/frozen.$k" ] || return 0
  for p in $(cat "$NETLAB_DIR/frozen.$k") $(netlab_pids "$k"); do kill -CONT "$p" 2>/dev/null || true; done
  rm -f "$NETLAB_DIR/frozen.$k"
}

netlab_clear() {  # K
  local k=$1
  netlab_thaw "$k"
  netlab_heal "$k"
  _netlab_nft_drop "$k" netlab_loss
  _netlab_delay_stop "$k"
  _netlab_rate_clear "$k"
}

netlab_kill() {  # K
  local p
  for p in $(netlab_pids "$1"); do kill -KILL "$p" 2>/dev/null || true; done
}

netlab_etcd_up() {  # [NODES...]
  local nodes=("$@") k cluster="" eps="" token="netlab-${NETLAB_ID}" i leader
  [ ${#nodes[@]} -gt 0 ] || for ((k = 0; k < NETLAB_N; k++)); do nodes+=("$k"); done
  command -v etcd >/dev/null || { echo "netlab_etcd_up: no etcd" >&2; return 1; }
  for k in "${nodes[@]}"; do
    cluster+="${cluster:+,}n$k=http://$(netlab_ip "$k"):2380"
    eps+="${eps:+,}$(netlab_ip "$k"):2379"
  done
  for k in "${nodes[@]}"; do
    local ip
    ip=$(netlab_ip "$k")
    rm -rf "$NETLAB_DIR/etcd.$k"  # a new cluster each time
    ip netns exec "$(netlab_ns "$k")" etcd --name "n$k" --data-dir "$NETLAB_DIR/etcd.$k" \
      --listen-client-urls "http://$ip:2379" --advertise-client-urls "http://$ip:2379" \
      --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$token" \
      > "$NETLAB_DIR/etcd.$k.log" 2>&1 &
    disown $!
  done
  NETLAB_ETCD_NODES=("${nodes[@]}")
  NETLAB_ETCD_ENDPOINTS=$eps
  for ((i = 0; i < 100; i++)); do
    if leader=$(netlab_etcd_leader 2>/dev/null); then
      echo "netlab: etcd on nodes ${nodes[*]}, leader on node $leader"
      return 0
    fi
    sleep 0.2
  done
  echo "netlab_etcd_up: no etcd leader after 20 s" >&2
  tail -5 "$NETLAB_DIR"/etcd.*.log >&2
  return 1
}

netlab_etcd_leader() {  # [FROM...]: the leader's node, as the first member that answers sees it
  local from=("$@") k out leader_id member_id j
  [ ${#from[@]} -gt 0 ] || from=("${NETLAB_ETCD_NODES[@]}")
  for k in "${from[@]}"; do
    out=$(netlab_exec "$k" env ETCDCTL_API=3 timeout 3 etcdctl --endpoints "http://$(netlab_ip "$k"):2379" \
            --command-timeout=2s endpoint status -w json 2>/dev/null) || continue
    leader_id=$(sed -n 's/.*"leader":\([0-9]*\).*/\1/p' <<< "$out")
    [ -n "$leader_id" ] && [ "$leader_id" != 0 ] || continue
    # Which node's member is the leader: each member's own id.
    for j in "${NETLAB_ETCD_NODES[@]}"; do
      member_id=$(netlab_exec "$j" env ETCDCTL_API=3 timeout 3 etcdctl \
                    --endpoints "http://$(netlab_ip "$k"):2379" --command-timeout=2s member list -w json 2>/dev/null |
                  grep -o "\"ID\":[0-9]*,\"name\":\"n$j\"" | sed 's/"ID":\([0-9]*\),.*/\1/') || true
      [ "$member_id" = "$leader_id" ] && { echo "$j"; return 0; }
    done
  done
  return 1
}

netlab_teardown() {
  [ "$_netlab_up" = 1 ] || return 0
  _netlab_up=0
  local k p i h ns left
  for h in "${_netlab_teardown_hooks[@]}"; do eval "$h" || true; done
  for ((k = 0; k < NETLAB_N; k++)); do
    _netlab_delay_stop "$k" 2>/dev/null || true
  done
  for ns in $(for ((k = 0; k < NETLAB_N; k++)); do netlab_ns "$k"; done) "$(_netlab_br)"; do
    for ((i = 0; i < 20; i++)); do
      left=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$left" ] || break
      for p in $left; do kill -KILL "$p" 2>/dev/null || true; done
      sleep 0.1
    done
    [ -z "$left" ] || echo "netlab: processes $left outlived SIGKILL in $ns" >&2
    ip netns del "$ns" 2>/dev/null || true
  done
  [ -n "$NETLAB_DIR" ] && rm -rf "$NETLAB_DIR"
  return 0
}
