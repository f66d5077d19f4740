#!/usr/bin/env bash
# Builds the libFuzzer target for the TCPStore frame parser with clang
# (with ASan and UBSan) and runs it for a bounded time.
#   scripts/fuzz.sh [SECONDS=60] [WORK_DIR=build/fuzz]
set -euo pipefail
seconds=${1:-60}
work=${2:-build/fuzz}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work/corpus"
cxx=${CLANGXX:-clang++}
if ! command -v "$cxx" >/dev/null; then
  echo "fuzz.sh: $cxx not found; install clang (scripts/install-deps.sh does)" >&2
  exit 1
fi
"$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/include" -I"$root/src" \
  "$root/fuzz/store_frame_fuzzer.cpp" "$root/src/store/wire.cpp" \
  -o "$work/store_frame_fuzzer"
# Seeds: the checked-in corpus plus whatever earlier runs found.
"$work/store_frame_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$root/fuzz/corpus" 2>&1 | tail -n 15
