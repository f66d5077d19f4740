#!/usr/bin/env bash
# tdist's FSDP against PyTorch's own, on CPU: the same model, initial
# weights, data and optimizer (formulas, no random numbers; see
# bench/torch_fsdp_reference.py), FULL_SHARD with one unit per block.
# Runs tdist-fsdp-compare (shm) from BUILD_DIR (LibTorch 1.13) and, if it has
# one, from BUILD2_DIR (tdist built against LibTorch 2.x), and PyTorch 2.x's
# FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel) on Gloo, at world
# sizes 2 and 3, in two configurations:
#   parity  W=64 H=128 B=4, global batch 16, 30 steps; also PyTorch FSDP2 in
#           float64, to show how far each float32 run is from the exact result
#   timing  W=1024 H=4096 B=4, global batch 64, 13 steps
# Prints per parameter max|a - b| / max|b| for each pair of runs, and per run
# ms/step (median after 3 warm-up steps, slowest rank) and peak RSS (VmHWM,
# largest rank). Writes OUT_DIR/summary.json and, per run, result.json and
# weights.bin; diff-A~B.json per comparison.
#   [WORLDS="2 3"] [CONFIGS="parity timing"] [TOLERANCE=1e-5] [CROSS_TOLERANCE=1e-4]
#   [TORCH2_PYTHON=<repo>/.venv/bin/python]
#   [TORCH1_PYTHON=/usr/bin/python3]
#   bench/compare_fsdp.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/fsdp-compare] [BUILD2_DIR=build-torch2]
# Exits 1 when a run fails or when, in the parity configuration, a tdist
# run's weights differ from a PyTorch run's by more than TOLERANCE (tdist
# built against LibTorch 2.x: the same kernels as PyTorch 2.x) or
# CROSS_TOLERANCE (tdist built against LibTorch 1.13) in some parameter.
# Reading the differences: Adam divides by sqrt(v) + 1e-8, so a gradient
# element near 1e-8 turns float32 rounding into a visible step; PyTorch's own
# float32 run lies 1e-5..4e-5 (max-relative) from float64 here, and tdist
# built against LibTorch 1.13 (other kernels) lies as far from PyTorch 2.x.
# The timing configuration's loss leaves 2.6 for ~1e5 after one step; from
# there on every run drifts (FSDP1 from FSDP2 too), so its weights are shown
# but not held to TOLERANCE.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/fsdp-compare}
build2=${3:-build-torch2}
worlds=${WORLDS:-2 3}
configs=${CONFIGS:-parity timing}
tolerance=${TOLERANCE:-1e-5}
cross_tolerance=${CROSS_TOLERANCE:-1e-4}
py=${TORCH2_PYTHON:-$root/.venv/bin/python}
py1=${TORCH1_PYTHON:-/usr/bin/python3}
ref="$here/torch_fsdp_reference.py"
failed=0
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in bench/

if [ ! -x "$build/bin/tdist-fsdp-compare" ]; then
  echo "no $build/bin/tdist-fsdp-compare (cmake --build $build --target tdist-fsdp-compare)" >&2
  exit 2
fi
[ -x "$py" ] || { echo "no $py (bash scripts/torch2.sh install puts PyTorch 2.x there)" >&2; exit 2; }
tdists=(tdist)
[ -x "$build2/bin/tdist-fsdp-compare" ] && tdists+=(tdist2) ||
  echo "# (no $build2/bin/tdist-fsdp-compare: tdist on LibTorch 2.x left out)"
rm -rf "$out"
mkdir -p "$out"

config_args() {
  case $1 in
    parity) echo "--width 64 --hidden 128 --blocks 4 --batch 16 --steps 30 --warmup 3" ;;
    timing) echo "--width 1024 --hidden 4096 --blocks 4 --batch 64 --steps 13 --warmup 3" ;;
    *) echo "unknown configuration $1" >&2; exit 2 ;;
  esac
}
quiet() { grep -v -i warn >&2 || true; }  # PyTorch's warnings off stderr, its errors kept
compare() {  # DIR A B GATE [TOLERANCE]: A's weights against B's
  local rc=0
  [ -f "$1/$2/result.json" ] && [ -f "$1/$3/result.json" ] || return 0
  "$py" "$ref" --compare "$1/$2" "$1/$3" --tolerance "${5:-$tolerance}" --json "$1/diff-$2~$3.json" \
    > "$1/diff-$2~$3.txt" || rc=$?
  if [ "$rc" -ne 0 ] && { [ "$4" = gate ] || [ ! -f "$1/diff-$2~$3.json" ]; }; then
    echo "# $1: $2 against $3: $(tail -n 1 "$1/diff-$2~$3.txt") (per parameter: diff-$2~$3.txt, and below)"
    failed=1
  fi
}

for config in $configs; do
  read -r -a args <<< "$(config_args "$config")"
  for w in $worlds; do
    dir="$out/$config-w$w"
    mkdir -p "$dir"
    "$build/bin/tdist-fsdp-compare" --world-size "$w" "${args[@]}" --out "$dir/tdist" || failed=1
    if [ "${#tdists[@]}" -gt 1 ]; then
      "$build2/bin/tdist-fsdp-compare" --world-size "$w" "${args[@]}" --out "$dir/tdist2" || failed=1
    fi
    runs=(fsdp2 fsdp1)
    [ "$config" = parity ] && runs+=(f64)
    for run in "${runs[@]}"; do
      case $run in
        f64) extra=(--api fsdp2 --dtype float64) ;;
        *) extra=(--api "$run") ;;
      esac
      if ! "$py" "$ref" "${extra[@]}" --world-size "$w" "${args[@]}" --out "$dir/$run" 2> >(quiet); then
        echo "# PyTorch $run failed ($config, world $w), its error above: left out"
        rm -rf "${dir:?}/$run"
        failed=1
      fi
    done
    gate=info
    [ "$config" = parity ] && gate=gate
    for t in "${tdists[@]}"; do
      tol=$tolerance
      [ "$t" = tdist ] && tol=$cross_tolerance  # LibTorch 1.13's kernels against PyTorch 2.x's
      compare "$dir" "$t" fsdp2 $gate "$tol"
      compare "$dir" "$t" fsdp1 $gate "$tol"
    done
    compare "$dir" fsdp1 fsdp2 info
    for r in "${tdists[@]}" fsdp2 fsdp1; do compare "$dir" "$r" f64 info; done
  done
done

# The tables, from what the runs and comparisons wrote.
"$py" - "$out" "$tolerance" "$cross_tolerance" <<'EOF'
import json, os, sys
out, tolerance, cross_tolerance = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
summary = []
RUNS = ["tdist", "tdist2", "fsdp2", "fsdp1", "f64"]
load = lambda *p: json.load(open(os.path.join(out, *p)))
for case in sorted(os.listdir(out)):
    if not os.path.isdir(os.path.join(out, case)):
        continue
    files = sorted(os.listdir(os.path.join(out, case)))
    order = lambda run: RUNS.index(run) if run in RUNS else len(RUNS)
    pairs = sorted((f[5:-5].split("~") for f in files if f.startswith("diff-") and f.endswith(".json")),
                   key=lambda ab: (ab[1] == "f64", order(ab[0]), order(ab[1])))
    diffs = {f"{a}:{b}": load(case, f"diff-{a}~{b}.json") for a, b in pairs}
    if diffs:
        print(f"\n# {case}: per parameter max|A - B| / max|B| after training (column A:B; f64: PyTorch FSDP2 in "
              f"float64, the exact result)")
        print(f"{'parameter':<18}" + "".join(f" {c:>13}" for c in diffs))
        for i, row in enumerate(next(iter(diffs.values()))["params"]):
            print(f"{row['name']:<18}" + "".join(f" {d['params'][i]['max_rel_diff']:>13.2e}" for d in diffs.values()))
        print(f"{'worst':<18}" + "".join(f" {d['worst']:>13.2e}" for d in diffs.values()))
        print(f"{'worst |A-B|/|B|':<18}" + "".join(f" {d['worst_norm_rel']:>13.2e}" for d in diffs.values()))
    print(f"\n# {case}: ms/step (median after the warm-up steps, slowest rank), peak RSS (VmHWM, largest rank) and its"
          f" growth after init_process_group;\n# loss[0], final loss: the first and last steps' (mean over ranks);"
          f" vs fsdp2, vs f64: the worst max|A - B| / max|B| of this run"
          f" against PyTorch FSDP2, against the float64 run")
    print(f"{'run':<6} {'implementation':<42} {'ms/step':>8} {'peak MiB':>9} {'growth':>7} {'loss[0]':>10} "
          f"{'final loss':>10} {'vs fsdp2':>9} {'vs f64':>9}")
    worst = lambda a, b: format(diffs[f"{a}:{b}"]["worst"], ".2e") if f"{a}:{b}" in diffs else "-"
    for run in sorted((r for r in files if os.path.isfile(os.path.join(out, case, r, "result.json"))), key=order):
        r = load(case, run, "result.json")
        print(f"{run:<6} {r['impl']:<42} {r['ms_per_step']:>8.2f} {r['peak_rss_mib']:>9.1f} "
              f"{r['peak_rss_mib'] - r['baseline_rss_mib']:>7.1f} {(r['step_loss'] or [0])[0]:>10.7g} "
              f"{r['final_loss']:>10.7g} "
              f"{worst(run, 'fsdp2') if run != 'f64' else worst('fsdp2', 'f64'):>9} {worst(run, 'f64'):>9}")
        summary.append(dict(case=case, run=run, impl=r["impl"], world_size=r["world_size"],
                            ms_per_step=r["ms_per_step"], peak_rss_mib=r["peak_rss_mib"],
                            rss_growth_mib=r["peak_rss_mib"] - r["baseline_rss_mib"], final_loss=r["final_loss"],
                            diffs={k[len(run) + 1:]: dict(worst=v["worst"], worst_norm_rel=v["worst_norm_rel"],
                                                          per_param={p["name"]: p["max_rel_diff"] for p in v["params"]})
                                   for k, v in diffs.items() if k.startswith(run + ":")}))
json.dump(dict(tolerance=tolerance, cross_tolerance=cross_tolerance, runs=summary), open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF

# PyTorch 1.13 (Debian's python3-torch): can its FSDP even be imported?
echo
if [ ! -x "$py1" ]; then
  echo "# PyTorch 1.13: no $py1"
elif err=$("$py1" -c 'from torch.distributed.fsdp import FullyShardedDataParallel' 2>&1); then
  echo "# PyTorch 1.13 ($py1) imports FSDP; not compared here (try: $py1 $ref --api fsdp1 --out DIR)"
else
  echo "# PyTorch $("$py1" -c 'import torch; print(torch.__version__)' 2>/dev/null) ($py1) has no FSDP to compare:" \
       "importing torch.distributed.fsdp fails: $(printf '%s\n' "$err" | tail -n 1)"
fi
echo "# $( [ $failed = 0 ] && echo "parity within $tolerance (tdist on LibTorch 1.13: within $cross_tolerance)" || echo FAILED: see above); files in $out"
exit $failed
