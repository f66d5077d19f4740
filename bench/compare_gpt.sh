#!/usr/bin/env bash
# tdist's examples/gpt.cpp against Hugging Face's GPT2LMHeadModel under
# PyTorch's FSDP2 and DDP (bench/torch_gpt_reference.py), on CPU, side by
# side: the same initial weights (a GPT2LMHeadModel saved by transformers),
# the same text (Debian's fortunes, as gpt.cpp reads them), data order,
# optimizer and schedule. For each world size, precision and mode the two
# run one after the other (tdist first, then PyTorch, ROUNDS times,
# interleaved) and the table shows tokens/s (median step, slowest rank),
# peak RSS per rank (VmHWM, largest rank) and how far the final weights lie
# apart (max |a - b| / max |b| over each tensor, the worst tensor).
#   [WORLDS="2 3"] [STEPS=20] [ROUNDS=1] [MODES="fsdp ddp"] [PRECISIONS="fp32 bf16"]
#   [SHAPE="--n-layer 4 --n-head 4 --n-embd 128 --n-positions 128"] [BLOCK=128] [BATCH=8]
#   [BIG=1: also GPT-2 124M's shape (12 layers, 12 heads, 768 wide, vocabulary 50257), BIG_STEPS=4 steps]
#   [TORCH2_PYTHON=<repo>/.venv/bin/python]
#   bench/compare_gpt.sh [BUILD_DIR=build] [OUT_DIR=BUILD_DIR/gpt-compare]
# Writes OUT_DIR/summary.json. Exits 1 when a run fails or an fp32 run's
# weights differ by more than TOLERANCE: by default 1e-5 when BUILD_DIR's
# tdist is built against LibTorch 2.x (PyTorch's own kernels), 1e-4 against
# LibTorch 1.13 (other kernels; as bench/compare_fsdp.sh holds them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:-build}
out=${2:-$build/gpt-compare}
worlds=${WORLDS:-2 3}
steps=${STEPS:-20}
rounds=${ROUNDS:-1}
modes=${MODES:-fsdp ddp}
precisions=${PRECISIONS:-fp32 bf16}
shape=${SHAPE:---n-layer 4 --n-head 4 --n-embd 128 --n-positions 128}
block=${BLOCK:-128}
batch=${BATCH:-8}
if grep -q '^Torch_DIR.*\.venv' "$build/CMakeCache.txt" 2>/dev/null; then
  tolerance=${TOLERANCE:-1e-5}
else
  tolerance=${TOLERANCE:-1e-4}
fi
py=${TORCH2_PYTHON:-$root/.venv/bin/python}
check="$root/tests/examples/gpt_hf_check.py"
export PYTHONDONTWRITEBYTECODE=1

[ -x "$build/bin/gpt" ] || { echo "no $build/bin/gpt (cmake --build $build --target gpt tdist-run)" >&2; exit 2; }
[ -x "$py" ] || { echo "no $py (bash scripts/python-ref.sh install)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out"
# The text gpt.cpp trains on by default: the fortunes files without an
# extension, in name order (examples/gpt_data.h).
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' -printf '%f\n' | LC_ALL=C sort |
  while read -r f; do cat "/usr/share/games/fortunes/$f"; done > "$out/text.txt"
[ -s "$out/text.txt" ] || { echo "no text in /usr/share/games/fortunes (apt-get install fortunes fortunes-min)" >&2; exit 2; }

common="--data $out/text.txt --steps $steps --batch-size $batch --block-size $block"
rows="$out/rows.jsonl"
: > "$rows"
failed=0

one() {  # one() NAME SHAPE_ARGS STEPS WORLD MODE PRECISION ROUND
  local name=$1 shape_args=$2 n=$3 world=$4 mode=$5 precision=$6 round=$7
  local init="$out/init-$name" tag="$name-w$world-$mode-$precision-r$round"
  [ -d "$init" ] || "$py" "$check" make "$init" $shape_args --seed 0 > /dev/null 2>&1
  local args="--data $out/text.txt --steps $n --batch-size $batch --block-size $block --from-pretrained $init"
  local tmode="--fsdp full" pmode=fsdp2
  [ "$mode" = ddp ] && tmode="--ddp" && pmode=ddp
  echo "# $tag: tdist"
  if ! "$build/bin/tdist-run" --nproc-per-node "$world" "$build/bin/gpt" $args $tmode --precision "$precision" \
      --quiet --sample-bytes 0 --skip-eval --json "$out/tdist-$tag.json" --save-pretrained "$out/tdist-$tag" > "$out/tdist-$tag.log" 2>&1; then
    echo "tdist failed: $out/tdist-$tag.log" >&2; tail -5 "$out/tdist-$tag.log" >&2; failed=1; return
  fi
  echo "# $tag: PyTorch"
  if ! "$py" "$here/torch_gpt_reference.py" --init "$init" --data "$out/text.txt" --steps "$n" --batch-size "$batch" \
      --block-size "$block" --world-size "$world" --mode "$pmode" --precision "$precision" --out "$out/torch-$tag" \
      > "$out/torch-$tag.log" 2>&1; then
    echo "PyTorch failed: $out/torch-$tag.log" >&2; tail -5 "$out/torch-$tag.log" >&2; failed=1; return
  fi
  local diff
  diff=$("$py" "$check" same "$out/tdist-$tag" "$out/torch-$tag" | sed -n 's/max_rel_diff=//p')
  "$py" - "$out/tdist-$tag.json" "$out/torch-$tag/result.json" "$name" "$world" "$mode" "$precision" "$diff" >> "$rows" <<'PY'
import json, sys
t, p = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print(json.dumps(dict(shape=sys.argv[3], world=int(sys.argv[4]), mode=sys.argv[5], precision=sys.argv[6],
                      max_rel_diff=float(sys.argv[7]), tdist_tokens_per_s=t["tokens_per_s"],
                      torch_tokens_per_s=p["tokens_per_s"], tdist_peak_rss=max(t["peak_rss_bytes"]),
                      torch_peak_rss=max(p["peak_rss_bytes"]), parameters=t["parameters"],
                      tdist_final_loss=t["train_loss"][-1], torch_final_loss=p["train_loss"][-1])))
PY
}

for world in $worlds; do
  for mode in $modes; do
    for precision in $precisions; do
      [ "$mode" = ddp ] && [ "$precision" = bf16 ] && continue  # bf16 is FSDP's mixed precision
      for round in $(seq 1 "$rounds"); do one small "$shape" "$steps" "$world" "$mode" "$precision" "$round"; done
    done
  done
done
if [ "${BIG:-0}" = 1 ]; then
  one gpt2-124M "--n-layer 12 --n-head 12 --n-embd 768 --n-positions 1024 --vocab 50257" "${BIG_STEPS:-4}" 2 fsdp fp32 1
fi

"$py" - "$rows" "$out/summary.json" "$tolerance" <<'PY' || failed=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
tol = float(sys.argv[3])
print(f"{'shape':<10} {'world':>5} {'mode':<5} {'prec':<5} {'tdist tok/s':>12} {'torch tok/s':>12} {'ratio':>6}"
      f" {'tdist MiB':>10} {'torch MiB':>10} {'weights rel diff':>17}")
bad = 0
for r in rows:
    ratio = r["tdist_tokens_per_s"] / r["torch_tokens_per_s"] if r["torch_tokens_per_s"] else 0
    over = r["precision"] == "fp32" and r["shape"] == "small" and r["max_rel_diff"] > tol
    bad |= over
    print(f"{r['shape']:<10} {r['world']:>5} {r['mode']:<5} {r['precision']:<5} {r['tdist_tokens_per_s']:>12.0f}"
          f" {r['torch_tokens_per_s']:>12.0f} {ratio:>6.2f} {r['tdist_peak_rss'] / 2**20:>10.0f}"
          f" {r['torch_peak_rss'] / 2**20:>10.0f} {r['max_rel_diff']:>17.2e}{'  > ' + str(tol) if over else ''}")
sys.exit(1 if bad else 0)
PY
exit $failed
