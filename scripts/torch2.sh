#!/usr/bin/env bash
# LibTorch 2.x for tdist, from the `torch` wheel on PyPI, in a project-local
# virtual environment (.venv). The one place the version is pinned.
#
#   scripts/torch2.sh install   LibTorch for C++: the wheel without its Python
#                               dependencies, plus the two CUDA runtime
#                               libraries libtorch_cpu.so needs to load
#                               (libcudart, libcupti: ~14 MB) and NCCL at
#                               the wheel's pin (~240 MB), which tdist's nccl
#                               backend is built against
#   scripts/torch2.sh importable  what `import torch` needs to load on a
#                               machine without a GPU: the CUDA libraries
#                               libtorch_cuda.so links that the C++ install
#                               lacks (cufile, cuSPARSELt, NVSHMEM, NCCL, at
#                               the wheel's pins: ~450 MB) and the pure-Python
#                               dependencies; what the tests' torch.load needs
#   scripts/torch2.sh python    everything torch depends on (the CUDA
#                               libraries: ~2 GB), for the comparison scripts
#   scripts/torch2.sh prefix    prints the LibTorch prefix (for
#                               CMAKE_PREFIX_PATH), installing first if needed
#   scripts/torch2.sh version   prints the pinned version
#
# Idempotent: a venv that already holds the pinned version is left alone.
# Nothing is downloaded except by pip from PyPI. VENV overrides the location.
set -euo pipefail

TORCH2_VERSION=${TORCH2_VERSION:-2.15.0}  # the pin; TORCH2_VERSION=... builds against another (a GPU machine's)

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
py=$venv/bin/python

log() { echo "tdist: $*" >&2; }

# Debian's python3 (3.11) with python3-venv: the wheel needs Python >= 3.11.
make_venv() {
  [ -x "$py" ] && return 0
  local base=/usr/bin/python3
  [ -x "$base" ] || base=$(command -v python3)
  log "creating $venv"
  "$base" -m venv "$venv"
}

installed_version() {
  "$py" - <<'EOF' 2>/dev/null || true
import importlib.metadata as m
print(m.version("torch").split("+")[0])
EOF
}

# The wheel's own pin of NVIDIA's cuda-toolkit meta-package (torch's
# Requires-Dist), so that the CUDA runtime matches the wheel exactly.
cuda_toolkit_pin() {
  "$py" - <<'EOF'
import importlib.metadata as m, re
for r in m.requires("torch") or []:
    g = re.match(r"cuda-toolkit\[[^\]]*\]\s*(==\s*[0-9.]+)", r)
    if g:
        print(g.group(1).replace(" ", ""))
        break
EOF
}

site_torch() {
  "$py" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.dirname(spec.origin))
EOF
}

die() {
  log "$*"
  exit 1
}

# torch is installed without its Python dependencies on purpose, so pip's
# report of them as missing is noise here; everything else pip says stays.
# A pip that fails stops the script (with pip's exit status), whatever it
# printed: the statuses of the pipeline are read in the one command that
# runs when it fails (grep's 1 only says that it passed no line on).
pip_install() {
  local st=(0 0)
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 >&2 |
    grep -v -e "^ERROR: pip's dependency resolver" -e "^torch [0-9.+a-z]* requires " >&2 || st=("${PIPESTATUS[@]}")
  if [ "${st[0]}" -ne 0 ]; then
    log "FAILED: pip install $* (exit status ${st[0]}; package index: ${PIP_INDEX_URL:-PyPI})"
    exit "${st[0]}"
  fi
  [ "${st[1]}" -le 1 ] || die "FAILED: pip install $*: its output could not be read (grep exit status ${st[1]})"
}

install_cpp() {
  make_venv
  if [ "$(installed_version)" != "$TORCH2_VERSION" ]; then
    log "installing torch==$TORCH2_VERSION (LibTorch $TORCH2_VERSION for C++) into $venv"
    pip_install --no-deps "torch==$TORCH2_VERSION"
  fi
  local prefix pin
  prefix=$(site_torch)
  # libtorch_cpu.so NEEDs libcudart.so.13 and libcupti.so.13 and finds them
  # through its RUNPATH in site-packages/nvidia/cu*/lib.
  if ! ls "$prefix"/../nvidia/cu*/lib/libcudart.so.* >/dev/null 2>&1 ||
     ! ls "$prefix"/../nvidia/cu*/lib/libcupti.so.* >/dev/null 2>&1; then
    pin=$(cuda_toolkit_pin)
    if [ -n "$pin" ]; then
      log "installing the CUDA runtime libtorch_cpu.so loads: cuda-toolkit[cudart,cupti]$pin"
      pip_install "cuda-toolkit[cudart,cupti]$pin"
    fi
  fi
  # The NCCL that torch itself loads, for tdist's nccl backend
  # (cmake/TdistCuda.cmake looks beside torch first).
  if ! ls "$prefix"/../nvidia/nccl/lib/libnccl.so.* >/dev/null 2>&1; then
    pin=$(requirement_pin nvidia-nccl-cu13)
    log "installing NCCL for the nccl backend: nvidia-nccl-cu13$pin"
    pip_install --no-deps "nvidia-nccl-cu13$pin"
    # The build (make build-2) requires the nccl backend: without this
    # library it would stop at configure, so say here what is missing.
    ls "$prefix"/../nvidia/nccl/lib/libnccl.so.* >/dev/null 2>&1 ||
      die "FAILED: nvidia-nccl-cu13$pin installed, but no libnccl.so.* in $(cd "$prefix/.." && pwd)/nvidia/nccl/lib"
  fi
  # What tdist links must load: every library libtorch_cpu.so needs is found
  # (a CUDA runtime left out above would otherwise show only at link time).
  local lib=$prefix/lib/libtorch_cpu.so deps missing
  deps=$(ldd "$lib" 2>&1) || die "FAILED: ldd $lib: $deps"
  missing=$(grep "not found" <<< "$deps") || return 0
  die "FAILED: LibTorch $TORCH2_VERSION in $venv cannot load; libtorch_cpu.so needs:"$'\n'"$missing"
}

# The wheel's own pin of a dependency (its Requires-Dist), e.g. "==0.8.1".
requirement_pin() {
  "$py" - "$1" <<'EOF'
import importlib.metadata as m, re, sys
for r in m.requires("torch") or []:
    g = re.match(re.escape(sys.argv[1]) + r"\s*(==\s*[0-9.]+)", r)
    if g:
        print(g.group(1).replace(" ", ""))
        break
EOF
}

install_importable() {
  install_cpp
  if ! "$py" -c 'import numpy, torch' >/dev/null 2>&1; then
    log "installing what import torch==$TORCH2_VERSION needs (cufile, cuSPARSELt, NVSHMEM, NCCL: ~450 MB) into $venv"
    pip_install "cuda-toolkit[cufile]$(cuda_toolkit_pin)" \
      "nvidia-cusparselt-cu13$(requirement_pin nvidia-cusparselt-cu13)" \
      "nvidia-nvshmem-cu13$(requirement_pin nvidia-nvshmem-cu13)" \
      "nvidia-nccl-cu13$(requirement_pin nvidia-nccl-cu13)" \
      typing_extensions sympy networkx jinja2 fsspec filelock numpy
  fi
  # The rest (cuBLAS, cuDNN, cuFFT, …) comes from the CUDA toolkit of a
  # machine of this project's kind (/usr/local/cuda, on the loader's path).
  # Where there is none, the wheels of all of torch's dependencies.
  local why
  if ! why=$("$py" -c 'import numpy, torch' 2>&1); then
    log "import torch still fails ($(tail -n 1 <<< "$why")): no CUDA toolkit here to lend its libraries"
    install_python
  fi
}

install_python() {
  install_cpp
  if ! "$py" -c 'import torch, torch.distributed' >/dev/null 2>&1; then
    log "installing torch==$TORCH2_VERSION's Python dependencies (the CUDA libraries, ~2 GB) into $venv"
    pip_install "torch==$TORCH2_VERSION" numpy
  fi
  local why
  why=$("$py" -c 'import numpy, torch, torch.distributed' 2>&1) ||
    die "FAILED: import torch fails in $venv after installing all of torch==$TORCH2_VERSION's dependencies: $(tail -n 1 <<< "$why")"
}

case "${1:-}" in
  install) install_cpp ;;
  importable) install_importable ;;
  python) install_python ;;
  prefix) install_cpp; site_torch ;;
  version) echo "$TORCH2_VERSION" ;;
  *) echo "usage: $0 install|importable|python|prefix|version" >&2; exit 2 ;;
esac
