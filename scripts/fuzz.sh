#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (with ASan and UBSan) and runs
# each for a bounded time: the TCPStore frame parser (bytes off the
# network), the safetensors header parser (the first bytes of a
# checkpoint file) and the .pt file's zip directory parser and unpickler.
#   scripts/fuzz.sh [SECONDS=60 per target] [WORK_DIR=build/fuzz]
set -euo pipefail
seconds=${1:-60}
work=${2:-build/fuzz}
root=$(cd "$(dirname "$0")/.." && pwd)
cxx=${CLANGXX:-clang++}
if ! command -v "$cxx" >/dev/null; then
  echo "fuzz.sh: $cxx not found; install clang (scripts/install-deps.sh does)" >&2
  exit 1
fi
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$root/include" -I"$root/src")

# fuzz NAME SEEDS SOURCES...: builds NAME and runs it over its corpus
# (the checked-in seeds plus whatever earlier runs found).
fuzz() {
  local name=$1 seeds=$2
  shift 2
  mkdir -p "$work/$name.corpus"
  "$cxx" "${flags[@]}" "$@" -o "$work/$name"
  echo "== $name, ${seconds} s"
  "$work/$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=512 -malloc_limit_mb=128 -max_len=262144 \
    -print_final_stats=1 -artifact_prefix="$work/$name-" "$work/$name.corpus" "$seeds" 2>&1 | tail -n 15
}

fuzz store_frame_fuzzer "$root/fuzz/corpus" \
  "$root/fuzz/store_frame_fuzzer.cpp" "$root/src/store/wire.cpp"
fuzz safetensors_header_fuzzer "$root/fuzz/corpus_safetensors" \
  "$root/fuzz/safetensors_header_fuzzer.cpp" "$root/src/formats/safetensors_header.cpp" "$root/src/util/json_reader.cpp"
# The .pt layer includes c10's ScalarType header and calls into libc10
# (LibTorch 1.13 from Debian: /usr/include, libc10.so); nothing else of
# LibTorch.
fuzz dcp_metadata_fuzzer "$root/fuzz/corpus_dcp" \
  "$root/fuzz/dcp_metadata_fuzzer.cpp" "$root/src/formats/dcp_metadata.cpp" \
  "$root/src/formats/dcp_metadata_writer.cpp" "$root/src/formats/pt_value.cpp" \
  "$root/src/formats/pickle_writer.cpp" "$root/src/formats/pickle_reader.cpp" \
  "$root/src/formats/pickle_dcp.cpp" "$root/src/formats/file_io.cpp" -DTDIST_HAVE_ISAL=0 -lc10 -lz
fuzz pt_file_fuzzer "$root/fuzz/corpus_pt" \
  "$root/fuzz/pt_file_fuzzer.cpp" "$root/src/formats/pt_value.cpp" "$root/src/formats/pickle_writer.cpp" \
  "$root/src/formats/pickle_reader.cpp" "$root/src/formats/pickle_dcp.cpp" "$root/src/formats/zip_writer.cpp" \
  "$root/src/formats/zip_reader.cpp" -lc10
