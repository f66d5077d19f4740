#!/usr/bin/env bash
# A pip that fails stops the install scripts with an error, whatever pip
# printed (issue 49, item 1): scripts/torch2.sh and scripts/python-ref.sh
# against a stand-in for the venv's python (no network, no real pip), whose
# `-m pip install` exits with a chosen status after printing chosen lines.
# The venv looks like one that holds torch and the CUDA runtime but no NCCL,
# so `torch2.sh install` goes on to install the NCCL wheel.
#   tests/scripts/pip_failure_test.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: pip_failure_test.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

venv=$work/venv site=$work/venv/site
mkdir -p "$venv/bin" "$site/torch/lib" "$site/nvidia/cu13/lib"
touch "$site/nvidia/cu13/lib/libcudart.so.13" "$site/nvidia/cu13/lib/libcupti.so.13"
# Any loadable ELF file will do for the scripts' ldd of libtorch_cpu.so.
ln -s "$(type -P true)" "$site/torch/lib/libtorch_cpu.so"

cat > "$venv/bin/python" <<'EOF'
#!/usr/bin/env bash
# FAKE_PIP_RC: pip's exit status; FAKE_PIP_SAYS: what it prints on stderr;
# FAKE_PIP_MAKES: a file it creates when it succeeds.
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-} ${2:-} ${3:-}" = "-m pip install" ]; then
  echo "${*:4}" >> "$here/pip.log"
  [ -z "${FAKE_PIP_SAYS:-}" ] || printf '%s\n' "$FAKE_PIP_SAYS" >&2
  if [ "$FAKE_PIP_RC" -eq 0 ] && [ -n "${FAKE_PIP_MAKES:-}" ]; then
    mkdir -p "$(dirname "$FAKE_PIP_MAKES")" && touch "$FAKE_PIP_MAKES"
  fi
  exit "$FAKE_PIP_RC"
fi
if [ "${1:-}" = - ]; then   # a script on stdin: the scripts' questions
  code=$(cat)
  case "$code" in
    *'version("torch")'*) echo "$FAKE_TORCH" ;;           # torch2.sh: installed torch
    *find_spec*) echo "$here/site/torch" ;;               # torch2.sh: where torch is
    *'m.requires("torch")'*) echo "==2.30.7" ;;           # torch2.sh: a pin of torch's
    *'m.version(sys.argv[1])'*) exit 1 ;;                 # python-ref.sh: not installed
    *) echo "fake python: an unknown script" >&2; exit 3 ;;
  esac
  exit 0
fi
echo "fake python: unexpected arguments $*" >&2
exit 3
EOF
chmod +x "$venv/bin/python"

failures=0 last_out=""
nccl=$site/nvidia/nccl/lib/libnccl.so.2
# expect NAME RC PATTERN COMMAND...: COMMAND exits with RC and prints a line
# matching PATTERN (grep -E; "" for none) on stdout or stderr.
expect() {
  local name=$1 want=$2 pattern=$3 rc=0 out
  shift 3
  rm -f "$venv/pip.log" "$nccl"
  out=$("$@" 2>&1) || rc=$?
  last_out=$out
  if [ "$rc" -ne "$want" ]; then
    echo "FAILED: $name: exit status $rc, expected $want; its output:"; echo "$out"
    failures=$((failures + 1))
  elif [ -n "$pattern" ] && ! grep -qE -- "$pattern" <<< "$out"; then
    echo "FAILED: $name: no line matching '$pattern' in its output:"; echo "$out"
    failures=$((failures + 1))
  else
    echo "ok: $name (exit status $rc)"
  fi
}
torch2() { VENV=$venv FAKE_TORCH=${FAKE_TORCH-2.15.0} TORCH2_VERSION=2.15.0 bash "$src/scripts/torch2.sh" "$@"; }

FAKE_PIP_RC=1 FAKE_PIP_SAYS="" \
  expect "the NCCL wheel fails quietly" 1 "FAILED: pip install --no-deps nvidia-nccl-cu13==2.30.7 \(exit status 1" torch2 install
FAKE_PIP_RC=1 FAKE_PIP_SAYS="ERROR: pip's dependency resolver does not currently take into account all the packages" \
  expect "the NCCL wheel fails, all pip says filtered" 1 "FAILED: pip install --no-deps nvidia-nccl-cu13" torch2 install
FAKE_PIP_RC=2 FAKE_PIP_SAYS="ERROR: No matching distribution found for nvidia-nccl-cu13==2.30.7" \
  expect "the NCCL wheel fails and pip says why" 2 "^ERROR: No matching distribution found" torch2 install
FAKE_PIP_RC=0 FAKE_PIP_SAYS="" \
  expect "pip succeeds but installs no libnccl" 1 "FAILED: nvidia-nccl-cu13==2.30.7 installed, but no libnccl" torch2 install
FAKE_TORCH="" FAKE_PIP_RC=1 FAKE_PIP_SAYS="" \
  expect "the torch wheel fails" 1 "FAILED: pip install --no-deps torch==2.15.0" torch2 install
FAKE_PIP_RC=1 FAKE_PIP_SAYS="" \
  expect "torch2.sh prefix installs first, and fails with it" 1 "FAILED: pip install" torch2 prefix
FAKE_PIP_RC=1 FAKE_PIP_SAYS="" \
  expect "python-ref.sh: safetensors fails" 1 "FAILED: pip install .*safetensors==" \
  env VENV="$venv" bash "$src/scripts/python-ref.sh" install
# The control: pip succeeds with only filtered lines (grep passes nothing
# on), which is no failure, and the filtered line is not shown.
FAKE_PIP_RC=0 FAKE_PIP_MAKES=$nccl FAKE_PIP_SAYS="torch 2.15.0 requires sympy, which is not installed." \
  expect "pip succeeds, all it says filtered" 0 "installing NCCL for the nccl backend" torch2 install
if grep -q "requires sympy" <<< "$last_out"; then
  echo "FAILED: torch2.sh showed pip's line about torch's missing dependencies:"; echo "$last_out"
  failures=$((failures + 1))
fi

if [ "$failures" -ne 0 ]; then
  echo "FAILED: $failures of the cases above"
  exit 1
fi
echo "PASSED: a failed pip install stops torch2.sh and python-ref.sh"
