#!/usr/bin/env bash
# The network-fault matrix: elastic jobs across network namespaces playing
# the nodes (tests/net/netlab.sh), each row a fault, for a DDP job
# (fashion_mnist) and an FSDP job (fsdp_mnist), NODES nodes x NPROC ranks
# over gloo, one tdist-run --nnodes (NODES-1):NODES per node, checkpoints
# every CHECKPOINT_EVERY steps to a directory all nodes share.
#
#   sudo bench/netfaults.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/bench/netfaults]
#
# Rows (ROWS, default all of the built-in ones; JOBS, default "ddp fsdp"):
#   none         no fault: the reference run (time, weights)
#   loss1        1 % of every packet between nodes dropped (on its receiver's
#                ingress: each packet at risk once), from the start
#   loss10       10 %, from the start
#   delay        one-way latency 50 +- 20 ms (uniform, order kept) on every packet
#                between nodes (nfq_delay on every node's ingress), from the start
#   rate         node 1's link at RATE (default 20mbit) for RATE_FOR s, mid-run
#   part_short   node 1 cut off (all packets dropped) for SHORT s (< TIMEOUT and
#                < the launchers' 10 s silence): to be ridden out
#   part_long    node 1 cut off for LONG s (> TIMEOUT), then back: to be named,
#                the job going on without it, then letting it in again
#   freeze       node 1 frozen (SIGSTOP of its launcher and ranks) for FREEZE_FOR s
#   part_store   node 0, the rendezvous store's host, cut off for LONG s: the
#                built-in store's known limit (the job is expected to end loudly)
#   etcd_part_leader, etcd_kill_first   the same jobs with --rdzv-backend etcd (a
#                member per node): the etcd leader's node cut off for LONG s; node 0
#                (the first launcher, its member with it) killed. Run only when
#                asked for in ROWS (and tdist-run has the backend).
# Mid-run faults start FAULT_AT s after the job's first step. REPEAT_LOSS=N
# (default 0) adds N interleaved pairs of none/loss1 runs of the DDP job and
# reports the median ms per step of each (a noisy machine: one pair proves
# little).
#
# For each row: the outcome (finished / restarted elastically / ended with an
# error), restarts, the final world size, the seconds from the fault to the
# first line about it and to the first line naming the node (its round's
# node index or one of its ranks), steps lost at each restart (the step the
# job had reached, from tdist-run --status-interval 1's lines, less the step
# of the checkpoint it resumed from), whether a rank alive at the fault
# outlived the fault + TIMEOUT + MARGIN (rows where ranks must end), and the
# final weights against the reference run's. Every run is bounded by
# ROW_LIMIT s (a run killed there is reported as too slow when its step
# still grew in its last 30 s, else as hung). Columns: world (at the end),
# wall_s, ms/step (DDP's, from its JSON), notice and named (s after the
# fault), lost (steps, per restart), ended (s from the fault to the last
# rank of that time ending), late (those ranks that outlived the fault +
# TIMEOUT + MARGIN, in rows where they must end), same (weights equal to
# the reference). Prints a table and
# writes OUT_DIR/netfaults.json; logs per row under OUT_DIR/JOB/ROW/.
# Needs root, nftables, iptables (latency), tc; exits 77 otherwise (1 under
# CI=true).
set -euo pipefail
build=${1:-build}
out=${2:-$build/bench/netfaults}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../tests/net/netlab.sh
source "$here/tests/net/netlab.sh"

NODES=${NODES:-3}
NPROC=${NPROC:-2}
STEPS=${STEPS:-200}
BATCH=${BATCH:-32}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-20}
TIMEOUT=${TIMEOUT:-20}          # the ranks' collective timeout (the examples' --timeout)
FAULT_AT=${FAULT_AT:-8}
SHORT=${SHORT:-5}
LONG=${LONG:-35}
FREEZE_FOR=${FREEZE_FOR:-35}
RATE=${RATE:-20mbit}
RATE_FOR=${RATE_FOR:-15}
MARGIN=${MARGIN:-15}            # a launcher's peer wait (3 s) and grace (5 s), and slack
ROW_LIMIT=${ROW_LIMIT:-360}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-60}
REPEAT_LOSS=${REPEAT_LOSS:-0}
JOBS=${JOBS:-"ddp fsdp"}
ROWS=${ROWS:-"none loss1 loss10 delay rate part_short part_long freeze part_store"}
ETCD_ROWS="etcd_part_leader etcd_kill_first"

run="$build/bin/tdist-run"
for f in "$run" "$build/bin/fashion_mnist" "$build/bin/fsdp_mnist"; do
  [ -x "$f" ] || { echo "netfaults.sh: no $f (build first: make build)" >&2; exit 2; }
done
case " $ROWS " in *" delay "*)
  [ -x "$build/bin/nfq_delay" ] || { echo "netfaults.sh: no $build/bin/nfq_delay (libnetfilter-queue-dev, then build)" >&2; exit 2; } ;;
esac
[ "$NODES" -ge 2 ] || { echo "netfaults.sh: NODES must be at least 2" >&2; exit 2; }
netlab_require
build=$(cd "$build" && pwd)
run="$build/bin/tdist-run"
NETLAB_NFQ_DELAY="$build/bin/nfq_delay"
rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)
netlab_up "$NODES"
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
min_nodes=$((NODES - 1))
port=29400
now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# Every line of a launcher's output, stamped with its arrival time.
stamp() { local line; while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done; }

job_args() {  # JOB DIR: the program and its flags
  local prog
  case $1 in
    ddp) prog=("$build/bin/fashion_mnist" --warmup-steps 10) ;;
    fsdp) prog=("$build/bin/fsdp_mnist") ;;
  esac
  printf '%s\n' "${prog[@]}" --backend gloo --epochs 1 --max-steps "$STEPS" --batch-size "$BATCH" \
    --timeout "$TIMEOUT" --checkpoint-dir "$2/ckpt" --checkpoint-every "$CHECKPOINT_EVERY" --json "$2/result.json"
}

# No fault, no process left from the last run.
reset_lab() {
  local k i
  for ((k = 0; k < NODES; k++)); do
    netlab_clear "$k"
    netlab_kill "$k"
  done
  for ((i = 0; i < 50; i++)); do
    local left=""
    for ((k = 0; k < NODES; k++)); do left+=$(netlab_pids "$k"); done
    [ -z "$left" ] && return 0
    for ((k = 0; k < NODES; k++)); do netlab_kill "$k"; done
    sleep 0.2
  done
  echo "netfaults.sh: processes outlive SIGKILL in the namespaces" >&2
  return 1
}

launcher_pids=()
launch() {  # K JOB DIR BACKEND
  local k=$1 job=$2 dir=$3 backend=$4 rdzv=() prog=()
  mapfile -t prog < <(job_args "$job" "$dir")
  if [ "$backend" = etcd ]; then
    rdzv=(--rdzv-backend etcd --rdzv-endpoint "$NETLAB_ETCD_ENDPOINTS")
  else
    rdzv=(--rdzv-endpoint "$(netlab_ip 0):$port")
  fi
  ( timeout -s KILL $((ROW_LIMIT + 30)) ip netns exec "$(netlab_ns "$k")" \
      env TDIST_STORE_TOKEN="$token" TDIST_DUMP_DIR="$dir/dumps" OMP_NUM_THREADS=1 \
      "$run" --nnodes "$min_nodes:$NODES" --nproc-per-node "$NPROC" "${rdzv[@]}" --rdzv-id "r$port" \
      --local-addr "$(netlab_ip "$k")" --max-restarts 3 --status-interval 1 \
      --rdzv-conf "join_timeout=$JOIN_TIMEOUT,last_call_timeout=3" "${prog[@]}" 2>&1
    echo "exit $?" ) | stamp > "$dir/node$k.log" &
  launcher_pids[$k]=$!
  disown "$!"  # no "Killed" notice when the row's end kills it
}

running() {  # any launcher of the row still running?
  local p
  for p in "${launcher_pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}

# The fault of a row: its node, when it starts ("start": before the job;
# "mid": FAULT_AT s into training), how long it lasts (0: to the end), and
# whether the ranks must end (a fault longer than their timeout).
fault_node() { case $1 in part_store) echo 0 ;; etcd_part_leader) netlab_etcd_leader ;; etcd_kill_first) echo 0 ;; *) echo 1 ;; esac; }
fault_when() { case $1 in none|loss1|loss10|delay) echo start ;; *) echo mid ;; esac; }
fault_for() {
  case $1 in
    rate) echo "$RATE_FOR" ;; part_short) echo "$SHORT" ;; part_long|part_store|etcd_part_leader) echo "$LONG" ;;
    freeze) echo "$FREEZE_FOR" ;; *) echo 0 ;;
  esac
}
ranks_must_end() { case $1 in part_long|freeze|part_store|etcd_part_leader|etcd_kill_first) return 0 ;; *) return 1 ;; esac; }
fault_on() {  # ROW NODE
  local k
  case $1 in
    none) ;;
    loss1) for ((k = 0; k < NODES; k++)); do netlab_loss "$k" 1; done ;;
    loss10) for ((k = 0; k < NODES; k++)); do netlab_loss "$k" 10; done ;;
    delay) for ((k = 0; k < NODES; k++)); do netlab_delay "$k" 50 20; done ;;
    rate) netlab_rate "$2" "$RATE" ;;
    part_short|part_long|part_store|etcd_part_leader) netlab_partition "$2" ;;
    freeze) netlab_freeze "$2" ;;
    etcd_kill_first) netlab_kill "$2" ;;
  esac
}
fault_off() { netlab_clear "$2"; }

json_str() { printf '"%s"' "$(printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g')"; }
fp() { sed -n 's/.*"weights_fingerprint": "\([0-9a-f]*\)".*/\1/p' "$1" 2>/dev/null; }
field() { sed -n "s/.*\"$2\": \([0-9.e+-]*\).*/\1/p" "$1" 2>/dev/null; }

declare -A ref_fp
rows_json=()

# Whether process P has ended (gone, or a zombie its parent has not reaped:
# a launcher blocked elsewhere reaps late).
ended() { [ ! -r "/proc/$1/stat" ] || [ "$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" = Z ]; }

# run_row JOB ROW [TAG]: one run; appends its JSON to rows_json and prints its line.
run_row() {
  local job=$1 row=$2 tag=${3:-$2}
  local dir="$out/$job/$tag" backend=c10d k p node="" when dur t0 t_train="" t_fault="" t_heal="" t_end
  local fault_at="" heal_at="" deadline hang=no
  local -A exit_at=() rank_node=()
  mkdir -p "$dir"
  reset_lab
  port=$((port + 1))
  case $row in etcd_*) backend=etcd ;; esac
  if [ "$backend" = etcd ]; then
    netlab_etcd_up > "$dir/etcd.log" 2>&1 || { echo "netfaults.sh: etcd did not start" >&2; cat "$dir/etcd.log" >&2; return 1; }
  fi
  when=$(fault_when "$row")
  dur=$(fault_for "$row")
  launcher_pids=()
  t0=$(now)
  deadline=$(awk -v t="$t0" -v l="$ROW_LIMIT" 'BEGIN { printf "%.3f", t + l }')
  past() { awk -v t="$(now)" -v d="$1" 'BEGIN { exit !(t >= d) }'; }
  if [ "$when" = start ]; then fault_on "$row" ""; t_fault=$t0; fi
  # Node 0 first: with the built-in backend it hosts the rendezvous store.
  launch 0 "$job" "$dir" "$backend"
  for ((k = 0; k < 100; k++)); do
    grep -q "tdist-run: \(hosting\|joined\)" "$dir/node0.log" 2>/dev/null && break
    sleep 0.1
  done
  for ((k = 1; k < NODES; k++)); do launch "$k" "$job" "$dir" "$backend"; done
  # Until every launcher is done (bounded): the fault FAULT_AT s after the
  # first step (a status line with step 1 or more), its end `dur` s later;
  # the ranks alive at the fault watched until each has ended.
  while running && ! past "$deadline"; do
    if [ -z "$t_train" ] && grep -hq "status: .*(step [1-9]" "$dir"/node*.log 2>/dev/null; then
      t_train=$(now)
      [ "$when" = mid ] && fault_at=$(awk -v t="$t_train" -v s="$FAULT_AT" 'BEGIN { printf "%.3f", t + s }')
    fi
    if [ -n "$fault_at" ] && past "$fault_at"; then
      fault_at=""
      node=$(fault_node "$row")
      for ((k = 0; k < NODES; k++)); do
        for p in $(netlab_pids "$k"); do
          case $(cat "/proc/$p/comm" 2>/dev/null) in fashion_mnist|fsdp_mnist) rank_node[$p]=$k ;; esac
        done
      done
      fault_on "$row" "$node"
      t_fault=$(now)
      echo "$t_fault fault $row on node $node" >> "$dir/faults.log"
      [ "$dur" -gt 0 ] && heal_at=$(awk -v t="$t_fault" -v s="$dur" 'BEGIN { printf "%.3f", t + s }')
    fi
    if [ -n "$heal_at" ] && past "$heal_at"; then
      heal_at=""
      fault_off "$row" "$node"
      t_heal=$(now)
      echo "$t_heal heal node $node" >> "$dir/faults.log"
    fi
    for p in "${!rank_node[@]}"; do
      [ -z "${exit_at[$p]:-}" ] && ended "$p" && exit_at[$p]=$(now)
    done
    sleep 0.2
  done
  if running; then
    hang=yes
    echo "netfaults.sh: $job/$tag: still running after ${ROW_LIMIT} s: killed" >&2
  fi
  t_end=$(now)
  # Each rank of the fault's time had until the fault + TIMEOUT + MARGIN to
  # end (a frozen node's: until its thaw + MARGIN), in rows that must end them.
  local last_exit="-" past_timeout="-"
  if [ ${#rank_node[@]} -gt 0 ]; then
    local latest=0 late="" due
    for p in "${!rank_node[@]}"; do
      local e=${exit_at[$p]:-$t_end}
      latest=$(awk -v a="$latest" -v b="$e" -v f="$t_fault" 'BEGIN { print (b - f > a ? b - f : a) }')
      if [ "$row" = freeze ] && [ "${rank_node[$p]}" = "$node" ] && [ -n "$t_heal" ]; then
        due=$(awk -v t="$t_heal" -v m="$MARGIN" 'BEGIN { printf "%.3f", t + m }')
      else
        due=$(awk -v t="$t_fault" -v s="$TIMEOUT" -v m="$MARGIN" 'BEGIN { printf "%.3f", t + s + m }')
      fi
      if [ -z "${exit_at[$p]:-}" ] || awk -v e="$e" -v d="$due" 'BEGIN { exit !(e > d) }'; then
        late+="${late:+,}$p@node${rank_node[$p]}"
      fi
    done
    if ranks_must_end "$row"; then
      past_timeout=${late:-none}
      last_exit=$(printf '%.1f' "$latest")
    fi
  fi
  reset_lab
  summarize "$job" "$row" "$tag" "$dir" "$t0" "$t_end" "${t_fault:-}" "${node:-}" "$hang" "$past_timeout" "$last_exit"
}

# The results of one run, from its logs.
summarize() {
  local job=$1 row=$2 tag=$3 dir=$4 t0=$5 t_end=$6 t_fault=$7 node=$8 hang=$9 hung_ranks=${10} last_exit=${11}
  local merged="$dir/all.log"
  for f in "$dir"/node*.log; do sed "s/^\([0-9.]*\) /\1 [$(basename "$f" .log)] /" "$f"; done | sort -n -s -k1,1 > "$merged"
  local wall world="" fingerprint="" same="-" ms="" exits outcome first_error="" notice_s="-" notice="" named_s="-" lost="" restarts
  wall=$(elapsed "$t0" "$t_end")
  restarts=$(grep -ho "tdist-run: round [0-9]*:" "$dir"/node*.log | sort -u | wc -l)
  restarts=$((restarts > 0 ? restarts - 1 : 0))
  exits=$(for f in "$dir"/node*.log; do tail -n 1 "$f" | sed -n 's/.* exit \([0-9]*\)$/\1/p'; done | tr '\n' ' ')
  if [ -s "$dir/result.json" ]; then
    fingerprint=$(fp "$dir/result.json")
    world=$(field "$dir/result.json" world_size)
    ms=$(field "$dir/result.json" ms_per_step)
  fi
  [ "$row" = none ] && [ -n "$fingerprint" ] && [ -z "${ref_fp[$job]:-}" ] && ref_fp[$job]=$fingerprint
  if [ -n "$fingerprint" ] && [ -n "${ref_fp[$job]:-}" ]; then
    [ "$fingerprint" = "${ref_fp[$job]}" ] && same=yes || same=no
  fi
  first_error=$(grep -v "status:" "$merged" | grep -m1 -iE "error|failed|timed out|gone|giving the job up|given up" |
                cut -d' ' -f2- | cut -c1-220 || true)
  if [ "$hang" = yes ]; then
    # Slow or stuck? The highest step the status lines show, and when it last grew.
    local prog
    prog=$(awk '/ tdist-run: status: .*\(step [0-9]+/ { match($0, /\(step [0-9]+/); s = substr($0, RSTART + 6, RLENGTH - 6) + 0
                                                        if (s > m) { m = s; t = $1 } }
                END { printf "%d %s", m, t }' "$merged")
    local top=${prog% *} grew=${prog#* }
    if [ -n "$grew" ] && awk -v g="$grew" -v e="$t_end" 'BEGIN { exit !(e - g < 30) }'; then
      outcome="too slow: step $top of $STEPS at ${ROW_LIMIT} s, still going"
    else
      outcome="hung at step $top (killed after $ROW_LIMIT s)"
    fi
  elif [ -n "$fingerprint" ] && [ "$restarts" -eq 0 ]; then
    outcome="finished"
  elif [ -n "$fingerprint" ]; then
    outcome="restarted elastically ($restarts), finished"
  else
    outcome="ended: ${first_error:-no result}"
  fi
  # The first line about the fault, and the first naming its node.
  if [ -n "$t_fault" ] && [ -n "$node" ]; then
    local line ranks_re node_re round_line
    line=$(awk -v t="$t_fault" '$1 >= t' "$merged" | grep -v "status:\|\[rank [0-9]*\]: epoch" |
           grep -m1 -iE "restart|silent|timed out|gone|answer|never arrived|failed|error|lost|unreachable|stall|cannot reach|stopped" || true)
    if [ -n "$line" ]; then
      notice_s=$(elapsed "$t_fault" "${line%% *}")
      notice=$(cut -d' ' -f2- <<< "$line" | cut -c1-200)
    fi
    # The faulty node's place in the round it was in: "round R: node I of N, ranks A to B".
    round_line=$(awk -v t="$t_fault" '$1 < t' "$dir/node$node.log" | grep "tdist-run: round [0-9]*: node" | tail -n 1 || true)
    if [ -n "$round_line" ]; then
      local i a b r
      i=$(sed -n 's/.*: node \([0-9]*\) of.*/\1/p' <<< "$round_line")
      a=$(sed -n 's/.*ranks \([0-9]*\) to.*/\1/p' <<< "$round_line")
      b=$(sed -n 's/.*ranks [0-9]* to \([0-9]*\) of.*/\1/p' <<< "$round_line")
      node_re="node $i "
      ranks_re=""
      for ((r = a; r <= b; r++)); do ranks_re+="${ranks_re:+|}ranks? ([0-9]+, )*$r([^0-9]|$)"; done
      line=$(awk -v t="$t_fault" '$1 >= t' "$merged" | grep -v "status:" |
             grep -m1 -E "$node_re(of round|went silent|:)|$ranks_re" || true)
      [ -n "$line" ] && named_s=$(elapsed "$t_fault" "${line%% *}")
    fi
  fi
  # Steps lost at each restart: the highest step the status lines showed
  # before it, less the step of the checkpoint resumed from.
  lost=$(awk '
    / tdist-run: status: .*\(step [0-9]+/ { if (!stopped) { match($0, /\(step [0-9]+/); s = substr($0, RSTART + 6, RLENGTH - 6) + 0; if (s > reached) reached = s } }
    / tdist-run: (this node.s ranks were stopped|to the rendezvous again|restarting)/ { if (!stopped) { stopped = 1; at = reached } }
    /\[rank 0\]: resumed from .*\(step [0-9]+ at world size/ {
      match($0, /\(step [0-9]+/); s = substr($0, RSTART + 6, RLENGTH - 6) + 0
      if (stopped) { d = at - s; printf "%s%d", (n++ ? "," : ""), (d > 0 ? d : 0) }
      stopped = 0; reached = s }' "$merged")
  local row_json
  row_json="{\"job\": \"$job\", \"row\": \"$tag\", \"fault\": \"$row\", \"node\": $(json_str "$node"),"
  row_json+=" \"outcome\": $(json_str "$outcome"), \"restarts\": $restarts, \"world_size\": $(json_str "$world"),"
  row_json+=" \"wall_s\": $wall, \"ms_per_step\": $(json_str "$ms"), \"notice_s\": $(json_str "$notice_s"),"
  row_json+=" \"notice\": $(json_str "$notice"), \"named_s\": $(json_str "$named_s"), \"steps_lost\": [${lost}],"
  row_json+=" \"checkpoint_every\": $CHECKPOINT_EVERY, \"ranks_past_timeout\": $(json_str "$hung_ranks"),"
  row_json+=" \"last_rank_of_fault_ended_s\": $(json_str "$last_exit"),"
  row_json+=" \"hung\": \"$hang\", \"exit_codes\": $(json_str "$exits"), \"weights_fingerprint\": $(json_str "$fingerprint"),"
  row_json+=" \"weights_equal_reference\": \"$same\"}"
  rows_json+=("$row_json")
  printf "%-5s %-17s %-40.40s %5s %6s %7s %6s %6s %-9s %6s %-9s %-4s\n" "$job" "$tag" "$outcome" "${world:--}" "$wall" \
    "$(printf '%.0f' "${ms:-0}" | sed 's/^0$/-/')" "$notice_s" "$named_s" "${lost:--}" "$last_exit" "$hung_ranks" "$same"
  [ -z "$notice" ] || echo "      first line about it: $notice"
}

echo "# netfaults: $NODES nodes x $NPROC ranks (network namespaces on one machine, $(nproc) CPUs), gloo, elastic"
echo "#   tdist-run --nnodes $min_nodes:$NODES; $STEPS steps of $BATCH per rank, a checkpoint every $CHECKPOINT_EVERY steps;"
echo "#   collective timeout $TIMEOUT s; mid-run faults $FAULT_AT s into training; load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-5s %-17s %-40s %5s %6s %7s %6s %6s %-9s %6s %-9s %-4s\n" job row outcome world wall_s ms/step notice named lost ended late same
for job in $JOBS; do
  case " $ROWS " in *" none "*) ;; *) run_row "$job" none ;; esac  # the reference goes first
  for row in $ROWS; do
    case " $ETCD_ROWS " in
      *" $row "*) "$run" --help 2>&1 | grep -q "rdzv-backend" || { echo "$job $row: skipped: no --rdzv-backend in tdist-run"; continue; } ;;
    esac
    run_row "$job" "$row"
  done
done

# The interleaved pairs: no loss, 1 % loss, and again.
if [ "$REPEAT_LOSS" -gt 0 ]; then
  echo
  echo "# interleaved: none, loss1, none, loss1, ... ($REPEAT_LOSS each), ddp"
  for ((i = 1; i <= REPEAT_LOSS; i++)); do
    run_row ddp none "none#$i"
    run_row ddp loss1 "loss1#$i"
  done
  med() { sort -n | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
  m0=$(for ((i = 1; i <= REPEAT_LOSS; i++)); do field "$out/ddp/none#$i/result.json" ms_per_step; done | med)
  m1=$(for ((i = 1; i <= REPEAT_LOSS; i++)); do field "$out/ddp/loss1#$i/result.json" ms_per_step; done | med)
  same_all=yes
  for ((i = 1; i <= REPEAT_LOSS; i++)); do
    [ "$(fp "$out/ddp/loss1#$i/result.json")" = "${ref_fp[ddp]:-x}" ] || same_all=no
  done
  ratio=$(awk -v a="$m0" -v b="$m1" 'BEGIN { printf "%.2f", b / a }')
  printf "median ms/step: no loss %.1f, 1 %% loss %.1f: %sx; weights equal the reference in every 1 %% run: %s\n" \
    "$m0" "$m1" "$ratio" "$same_all"
  rows_json+=("{\"job\": \"ddp\", \"row\": \"loss1_interleaved\", \"runs\": $REPEAT_LOSS, \"median_ms_per_step_none\": $m0, \"median_ms_per_step_loss1\": $m1, \"slowdown\": $ratio, \"weights_equal_reference\": \"$same_all\"}")
fi

{
  echo "{\"nodes\": $NODES, \"nproc_per_node\": $NPROC, \"steps\": $STEPS, \"batch\": $BATCH, \"checkpoint_every\": $CHECKPOINT_EVERY,"
  echo " \"timeout_s\": $TIMEOUT, \"fault_at_s\": $FAULT_AT, \"short_s\": $SHORT, \"long_s\": $LONG, \"freeze_s\": $FREEZE_FOR,"
  echo " \"rate\": \"$RATE\", \"rate_for_s\": $RATE_FOR, \"margin_s\": $MARGIN, \"row_limit_s\": $ROW_LIMIT, \"cpus\": $(nproc),"
  echo " \"rows\": ["
  for ((i = 0; i < ${#rows_json[@]}; i++)); do
    printf '  %s%s\n' "${rows_json[$i]}" "$([ $((i + 1)) -lt ${#rows_json[@]} ] && echo ,)"
  done
  echo "]}"
} > "$out/netfaults.json"
echo
echo "JSON: $out/netfaults.json"
