#!/usr/bin/env bash
# Installs the Debian packages tdist needs to build, test and run its demo.
# (LibTorch 2.x comes from PyPI into .venv: scripts/torch2.sh.)
# Idempotent: checks what is installed first and does nothing when all is there.
# As root it runs apt-get; otherwise it prints the exact command to run.
#   scripts/install-deps.sh          what building, testing and the demo need
#   scripts/install-deps.sh --bench  the same (the benchmarks' references are in .venv)
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  clang libclang-rt-dev          # libFuzzer target and sanitizers
  libtorch-dev                   # LibTorch 1.13 (CPU)
  libopenblas0-openmp            # ~15x faster training than the reference BLAS
  libgloo-dev                    # the gloo backend
  libssl-dev                     # HMAC for store authentication
  libisal-dev                    # CRC-32 of checkpoints at ~10 GB/s (zlib: ~4)
  libgtest-dev libgmock-dev      # the test framework
  dataset-fashion-mnist          # the demo's data set
  fortunes fortunes-min          # English text: examples/gpt.cpp's default corpus
  iproute2                       # network namespaces in multi-host tests
  nftables iptables libnetfilter-queue-dev  # network faults (tests/net/netlab.sh): loss, partitions,
                                 # and tools/netdelay/nfq_delay's NFQUEUE for latency
  etcd-server etcd-client        # tdist-run --rdzv-backend etcd: its tests, make etcd
  openmpi-bin libopenmpi-dev     # the mpi backend, and its tests under mpirun
  python3-venv                   # .venv for LibTorch 2.x from PyPI (scripts/torch2.sh)
  libcli11-dev nlohmann-json3-dev  # command lines and JSON of the tools, benchmarks, examples
  rustc                          # the C ABI's test from Rust (tests/rust/)
  python3-torch                  # torch.load 1.13 reads tdist's files in the tests (also
                                 # PyTorch's Gloo, TCPStore, DDP: the benchmarks' references)
)

# The benchmarks need nothing more from Debian (their extra Python, the torch
# wheel's dependencies and matplotlib, goes into .venv: scripts/torch2.sh
# python, scripts/python-ref.sh bench); --bench is accepted for them.
case "${1:-}" in ''|--bench) ;; *) echo "usage: $0 [--bench]" >&2; exit 2 ;; esac

missing=()
for p in "${PACKAGES[@]}"; do
  # dpkg-query fails for a package it has never seen: that is "missing".
  status=$(dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null || true)
  grep -q "install ok installed" <<< "$status" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "tdist: missing Debian packages. Run as root:" >&2
  echo "  apt-get update && $cmd" >&2
  exit 1
fi

echo "tdist: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { echo "tdist: FAILED: apt-get update" >&2; exit 1; }
apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
  { echo "tdist: FAILED: apt-get install ${missing[*]}" >&2; exit 1; }
