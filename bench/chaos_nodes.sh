#!/usr/bin/env bash
# Training through lost nodes: NODES network namespaces (tests/net/netlab.sh:
# each its own address on one bridge), each a node with an etcd member and a
# tdist-run launcher of RANKS ranks (fashion_mnist over gloo), in one elastic
# job (--nnodes NODES-1:NODES --rdzv-backend etcd). Every KILL_EVERY seconds
# a node is lost whole (SIGKILL of everything in its namespace: launcher,
# ranks, etcd member); the first loss is the node that started the job
# (round 0's node 0). DOWN seconds later the node comes back (its etcd
# member on its data, a new launcher) and joins. The same job without
# losses goes first (and again after, with INTERLEAVE=1). Reports:
#   - goodput: the loss-free run's time (with INTERLEAVE=1, the two's mean;
#     straight_s in the JSON) over the chaos run's;
#   - per loss: seconds from the loss to the survivors' next round, and to
#     rank 0's "resumed from" line; steps redone;
#   - whether the final weights equal a by-hand replay: the same starts,
#     each from the same checkpoint at the same world size, run one after
#     another by a single-node tdist-run (bit for bit: weights_fingerprint).
# Exits non-zero when a run fails or the weights differ. Needs root.
#   [NODES=3] [RANKS=2] [KILL_EVERY=600] [DOWN=30] [STEPS=3000 | EPOCHS=N] [CHECKPOINT_EVERY=50]
#   [BATCH=64] [LAST_CALL=2] [INTERLEAVE=0] [REPLAY_ONLY=0] bench/chaos_nodes.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench/chaos-nodes]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out=${2:-$build/bench/chaos-nodes}
nodes=${NODES:-3}
ranks=${RANKS:-2}
kill_every=${KILL_EVERY:-600}
down=${DOWN:-30}
steps=${STEPS:-3000}
every=${CHECKPOINT_EVERY:-50}
batch=${BATCH:-64}
last_call=${LAST_CALL:-2}
build=$(cd "$build" && pwd)
run="$build/bin/tdist-run"
example="$build/bin/fashion_mnist"
for f in "$run" "$example"; do
  [ -x "$f" ] || { echo "chaos_nodes.sh: no $f (build first: make build)" >&2; exit 2; }
done
replay_only=${REPLAY_ONLY:-0}  # 1: the analysis and the replay again, of OUT_DIR's runs
# 1: the loss-free run again after the chaos run, and goodput against the
# two's mean (this VM's pace drifts by several per cent in 20 minutes).
interleave=${INTERLEAVE:-0}
if [ "$replay_only" != 1 ]; then
  # shellcheck source=../tests/net/netlab.sh
  source "$here/../tests/net/netlab.sh"
  netlab_require
  rm -rf "$out"
  mkdir -p "$out"
  netlab_up "$nodes"
  netlab_etcd_up
fi
out=$(cd "$out" && pwd)
now() { date +%s.%N; }
export TDIST_DUMP_DIR="$out/dumps"  # the ranks' flight-recorder dumps at a peer's failure, with the rest
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
world=$((nodes * ranks))
# The job's length is in epochs: samples, the same at every world size
# (--max-steps counts steps of the world size of the moment, so a stretch at
# a smaller world would end the job early, with less trained than the
# loss-free run: the runs before d679de7 did). STEPS sets it: about that
# many steps of the whole world.
epochs=${EPOCHS:-$(( (steps * world * batch + 30000) / 60000 ))}
[ "$epochs" -ge 1 ] || epochs=1
base=("$example" --backend gloo --batch-size "$batch" --epochs "$epochs" --quiet --checkpoint-every "$every")
train=("${base[@]}")

# start_node K RUN_ID LOG [ARGS...]: node K's launcher, every line stamped.
start_node() {
  local k=$1 id=$2 log=$3
  shift 3
  ( netlab_exec "$k" env TDIST_STORE_TOKEN="$token" OMP_NUM_THREADS=1 "$run" --nnodes "$((nodes - 1)):$nodes" \
      --nproc-per-node "$ranks" --rdzv-backend etcd --rdzv-endpoint "$NETLAB_ETCD_ENDPOINTS" --rdzv-id "$id" \
      --local-addr "$(netlab_ip "$k")" --rdzv-conf "last_call_timeout=$last_call" --max-restarts 1000 "$@" 2>&1 |
      while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done >> "$log" ) &
}
# The etcd member of node K again, on its data (it rejoins its cluster).
restart_etcd() {
  local k=$1 ip
  ip=$(netlab_ip "$k")
  netlab_exec "$k" etcd --name "n$k" --data-dir "$NETLAB_DIR/etcd.$k" --listen-client-urls "http://$ip:2379" \
    --advertise-client-urls "http://$ip:2379" --listen-peer-urls "http://$ip:2380" \
    --initial-advertise-peer-urls "http://$ip:2380" >> "$NETLAB_DIR/etcd.$k.log" 2>&1 &
  disown $!
}
wait_all() {  # the launchers' pids; fails when one fails
  local rc=0 p
  for p in "$@"; do wait "$p" || rc=1; done
  return $rc
}

if [ "$replay_only" != 1 ]; then
  echo "# chaos across nodes: $nodes nodes x $ranks ranks (fashion_mnist, gloo), etcd rendezvous, $epochs epochs,"
  echo "# $batch per rank a step, a checkpoint every $every steps; a node lost every $kill_every s, back after $down s"
  # straight NAME: the job without losses, its own rendezvous and checkpoints;
  # prints its seconds.
  straight() {
    local name=$1 t k pids=()
    t=$(now)
    for ((k = 0; k < nodes; k++)); do
      start_node "$k" "$name-$$" "$out/$name.$k.log" "${train[@]}" --checkpoint-dir "$out/$name-ckpt" \
        --json "$out/$name.$k.json"
      pids+=($!)
    done
    wait_all "${pids[@]}" || { echo "chaos_nodes.sh: the loss-free run failed" >&2; tail -5 "$out/$name".*.log >&2; exit 1; }
    echo "$(now) - $t" | bc -l
  }
  straight_s=$(straight straight)
  printf "loss-free: %.1f s\n" "$straight_s"

  t0=$(now)
  declare -A pid_of
  for ((k = 0; k < nodes; k++)); do
    start_node "$k" "chaos-$$" "$out/chaos.$k.log" "${train[@]}" --checkpoint-dir "$out/ckpt" --json "$out/chaos.$k.json"
    pid_of[$k]=$!
  done
  alive() { local k; for k in "${!pid_of[@]}"; do kill -0 "${pid_of[$k]}" 2>/dev/null && return 0; done; return 1; }
  : > "$out/losses.txt"
  losses=0
  while alive; do
    slept=0
    while [ "$slept" -lt "$kill_every" ] && alive; do sleep 1; slept=$((slept + 1)); done
    alive || break
    victim=""
    if [ "$losses" -eq 0 ]; then
      victim=$(grep -l "round 0: node 0 of" "$out"/chaos.*.log | head -1 | sed 's/.*chaos\.\([0-9]*\)\.log/\1/')
    fi
    [ -n "$victim" ] || victim=$((RANDOM % nodes))
    echo "$(now) $victim" >> "$out/losses.txt"
    netlab_kill "$victim"
    losses=$((losses + 1))
    echo "lost node $victim at $(printf '%.0f' "$(echo "$(now) - $t0" | bc -l)") s"
    sleep "$down"
    alive || break
    restart_etcd "$victim"
    start_node "$victim" "chaos-$$" "$out/chaos.$victim.log" "${train[@]}" --checkpoint-dir "$out/ckpt" \
      --json "$out/chaos.$victim.json"
    pid_of[$victim]=$!
  done
  for k in "${!pid_of[@]}"; do wait "${pid_of[$k]}" 2>/dev/null || true; done
  chaos_s=$(echo "$(now) - $t0" | bc -l)
  json=$(grep -l '"weights_fingerprint"' "$out"/chaos.*.json 2>/dev/null | head -1 || true)
  [ -n "$json" ] || { echo "chaos_nodes.sh: the chaos run did not finish" >&2; tail -5 "$out"/chaos.*.log >&2; exit 1; }
  sort -n "$out"/chaos.*.log > "$out/chaos.log"
  if [ "$interleave" = 1 ]; then
    again_s=$(straight straight2)
    printf "loss-free again: %.1f s\n" "$again_s"
    straight_s=$(echo "($straight_s + $again_s) / 2" | bc -l)
  fi
  echo "straight_s=$straight_s chaos_s=$chaos_s losses=$losses again_s=${again_s:-}" > "$out/times.txt"
else
  source "$out/times.txt"
  json=$(grep -l '"weights_fingerprint"' "$out"/chaos.*.json | head -1)
fi
printf "chaos: %.1f s, %d nodes lost\n" "$chaos_s" "$losses"

# Per loss: seconds to the first sign of it in a survivor's launcher (a
# restart asked or ranks stopped), to the next round, to rank 0's resume.
awk 'NR == FNR { loss[++n] = $1; next }
     function first(a, t) { for (i = 1; i <= n; i++) if (!a[i] && t > loss[i] && (i == n || t < loss[i + 1])) { a[i] = t; return } }
     / tdist-run: (this node.s ranks were stopped|rank [0-9]+ .*failed|to the rendezvous again)/ { first(noticed, $1) }
     / tdist-run: round [0-9]+: node / { first(round, $1) }
     /\[rank 0\]: resumed from/ { first(resumed, $1) }
     function d(a, i) { return a[i] ? sprintf("%.1f", a[i] - loss[i]) : "-1" }
     END { for (i = 1; i <= n; i++) print d(noticed, i), d(round, i), d(resumed, i) }' \
  "$out/losses.txt" "$out/chaos.log" > "$out/loss-times.txt"
echo "per loss: seconds to notice it, to the next round, to rank 0's resume:"
sed 's/^/  /' "$out/loss-times.txt"

# The by-hand replay: each "resumed from … (step S at world size W):
# continuing at step T at world size V" line is a start at world V from the
# checkpoint of step S, which the replay reaches by running the world of
# the start before it to step S (a start that saved nothing since it
# resumed left the checkpoint as it was: nothing to run).
awk '/\[rank 0\]: resumed from .*\(step [0-9]+ at world size [0-9]+\): continuing at step/ {
       match($0, /\(step [0-9]+ at world size [0-9]+\)/); split(substr($0, RSTART + 1, RLENGTH - 2), f, " ")
       v = f[6]; if (match($0, /continuing at step [0-9]+ at world size [0-9]+/)) { n = split(substr($0, RSTART, RLENGTH), g, " "); v = g[n] }
       print f[2], f[6], v }' "$out/chaos.log" > "$out/starts.txt"
cur=$world
hand="$out/hand-ckpt"
rm -rf "$hand" "$out/hand.log"
hs="" hw=""  # the (step, world) of the replay's latest checkpoint
while read -r s w v; do
  if [ "$s $w" != "$hs $hw" ]; then
    # A checkpoint the replay does not have yet: the start before wrote it.
    [ "$w" = "$cur" ] || { echo "chaos_nodes.sh: a start from step $s at world $w follows one at world $cur" >&2; exit 1; }
    OMP_NUM_THREADS=1 "$run" --nproc-per-node "$cur" "${base[@]}" --max-steps "$s" --checkpoint-dir "$hand" \
      >> "$out/hand.log" 2>&1 || { echo "chaos_nodes.sh: the replay failed" >&2; exit 1; }
    hs=$s hw=$w
  fi
  cur=$v
done < "$out/starts.txt"
OMP_NUM_THREADS=1 "$run" --nproc-per-node "$cur" "${train[@]}" --checkpoint-dir "$hand" --json "$out/hand.json" \
  >> "$out/hand.log" 2>&1 || { echo "chaos_nodes.sh: the replay failed" >&2; exit 1; }
fp() { sed -n 's/.*"weights_fingerprint": "\([0-9a-f]*\)".*/\1/p' "$1"; }
same=no
[ -n "$(fp "$json")" ] && [ "$(fp "$json")" = "$(fp "$out/hand.json")" ] && same=yes
goodput=$(echo "$straight_s / $chaos_s" | bc -l)
printf "goodput %.1f %% of the loss-free rate (%d losses in %.0f s)\n" "$(echo "100 * $goodput" | bc -l)" "$losses" "$chaos_s"
echo "starts (checkpoint step, its world, the new world): $(tr '\n' ';' < "$out/starts.txt")"
echo "final weights equal to the by-hand replay's: $same"
num() { printf '%.4f' "$1"; }
again_json=null
[ -z "${again_s:-}" ] || again_json=$(num "$again_s")
cat > "$out/chaos-nodes-summary.json" <<EOF
{"nodes": $nodes, "ranks_per_node": $ranks, "epochs": $epochs, "checkpoint_every": $every, "kill_every_s": $kill_every,
 "down_s": $down, "straight_s": $(num "$straight_s"), "straight_again_s": $again_json,
 "chaos_s": $(num "$chaos_s"), "losses": $losses,
 "goodput": $(num "$goodput"), "loss_times_s": [$(awk '{ printf "%s[%s,%s,%s]", (NR > 1 ? "," : ""), $1, $2, $3 }' "$out/loss-times.txt")],
 "weights_equal_replay": "$same"}
EOF
[ "$same" = yes ]
