#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, against the PyTorch of a GPU machine
# that cannot build it itself or reach a package index, and packs it into one
# folder to carry there:
#
#   scripts/gpu-pack.sh TORCH_VERSION PACK_DIR [BUILD_DIR=build-gpu]
#
# TORCH_VERSION is the GPU machine's torch (e.g. 2.11.0: `python3 -c 'import
# torch; print(torch.__version__)'` there); it is installed here into its own
# venv (/var/cache/tdist-gpu-venv-VERSION, with the NCCL of its pin) through
# scripts/torch2.sh. The build leaves out what that machine lacks (OpenMPI,
# ISA-L). PACK_DIR gets bin/ (cuda_test, nccl_test, tdist-bench, stripped)
# and lib/ (libtdist, its plugins, and the Debian libraries they need that a
# machine with only PyTorch lacks: libgloo and what it pulls in). On the GPU
# machine:
#
#   bash scripts/gpu-check.sh PACK_DIR/bin PACK_DIR/lib OUT_DIR
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 TORCH_VERSION PACK_DIR [BUILD_DIR]" >&2; exit 2; }
version=$1 pack=$2 build=${3:-build-gpu}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${GPU_VENV:-/var/cache/tdist-gpu-venv-$version}

bash "$root/scripts/install-deps.sh"
prefix=$(VENV=$venv TORCH2_VERSION=$version bash "$root/scripts/torch2.sh" prefix)
generator=$(command -v ninja >/dev/null && echo "-G Ninja" || true)
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" $generator -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
  -DTDIST_WITH_MPI=OFF -DTDIST_WITH_ISAL=OFF -DTDIST_WITH_CUDA=ON -DTDIST_WITH_NCCL=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target cuda_test nccl_test tdist-bench tdist_cuda tdist_nccl

rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib"
for b in cuda_test nccl_test tdist-bench; do strip -o "$pack/bin/$b" "$build/bin/$b"; done
for l in "$build"/lib/libtdist*.so*; do
  if [ -L "$l" ]; then cp -P "$l" "$pack/lib/"; else strip -o "$pack/lib/$(basename "$l")" "$l"; fi
done
# The libraries outside torch, CUDA and the base system that the carried
# files load (gloo's, from Debian). A copy that fails stops the script
# (grep's "no such library" is the only status let through).
deps=$(for f in "$pack"/bin/* "$pack"/lib/*.so*; do
  ldd "$f" || { echo "gpu-pack: ldd $f failed" >&2; exit 1; }
done | awk '/=> \// {print $3}' | sort -u)
extra=$(grep -E '^/(usr/)?lib/(x86_64-linux-gnu/)?lib(gloo|ibverbs|nl-3|nl-route-3|hiredis|uv)[.-]' <<< "$deps") || true
for l in $extra; do cp -L "$l" "$pack/lib/"; done
du -sh "$pack"
