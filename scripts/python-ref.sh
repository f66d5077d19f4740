#!/usr/bin/env bash
# The Python packages tdist's tests check its files against, in the
# project's .venv (the one scripts/torch2.sh uses): safetensors and Hugging
# Face transformers, pinned, and an importable torch 2.x (scripts/torch2.sh
# importable), whose torch.load the tests run on tdist's .pt files and whose
# GPT2LMHeadModel they hold examples/gpt.cpp against.
# tdist itself never needs Python; the tests use it to show that the files
# it writes load in the Python tools people use.
#
#   scripts/python-ref.sh install   creates .venv if needed, installs what is missing
#   scripts/python-ref.sh bench     also matplotlib, pinned, for make bench's charts (bench/plot.py)
#   scripts/python-ref.sh python    prints the interpreter's path
#
# Idempotent. Nothing is downloaded except by pip from PyPI. VENV overrides
# the location.
set -euo pipefail

SAFETENSORS_VERSION=0.8.0
TRANSFORMERS_VERSION=5.24.0
MATPLOTLIB_VERSION=3.10.8

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
py=$venv/bin/python

# pip install ARGS..., stopping the script with pip's status and a line that
# names what failed (pip's own errors are above it).
pip_install() {
  local rc=0
  "$py" -m pip install --quiet --disable-pip-version-check "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "tdist: FAILED: pip install $* (exit status $rc; package index: ${PIP_INDEX_URL:-PyPI})" >&2
    exit "$rc"
  fi
}

have() {
  "$py" - "$1" "$2" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version(sys.argv[1]) == sys.argv[2] else 1)
PYEOF
}

install() {
  if [ ! -x "$py" ]; then
    echo "tdist: creating $venv" >&2
    /usr/bin/python3 -m venv "$venv"
  fi
  if ! have safetensors "$SAFETENSORS_VERSION"; then
    echo "tdist: installing safetensors $SAFETENSORS_VERSION into $venv" >&2
    pip_install "safetensors==$SAFETENSORS_VERSION"
  fi
  VENV=$venv bash "$root/scripts/torch2.sh" importable
  if ! have transformers "$TRANSFORMERS_VERSION"; then
    echo "tdist: installing transformers $TRANSFORMERS_VERSION into $venv" >&2
    pip_install "transformers==$TRANSFORMERS_VERSION"
  fi
}

install_bench() {
  install
  if ! have matplotlib "$MATPLOTLIB_VERSION"; then
    echo "tdist: installing matplotlib $MATPLOTLIB_VERSION into $venv (make bench's charts)" >&2
    pip_install "matplotlib==$MATPLOTLIB_VERSION"
  fi
}

case "${1:-}" in
  install) install ;;
  bench) install_bench ;;
  python) echo "$py" ;;
  *) echo "usage: $0 install|bench|python" >&2; exit 2 ;;
esac
