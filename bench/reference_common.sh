# Shared by bench/compare_*.sh (sourced): running a Python PyTorch reference.
# The caller sets failed=0 first; a reference whose run fails sets failed=1.

# run_reference NAME PYTHON HINT JSON SCRIPT ARGS...: runs SCRIPT with PYTHON
# when that can import torch.distributed with Gloo, else says why not. Lines
# with "warn" on its stderr are dropped; everything else stays visible.
run_reference() {
  local name=$1 py=$2 hint=$3 json=$4 err rc=0
  shift 4
  rm -f "$json"
  if [ ! -x "$py" ]; then
    echo "# (no $py: no $name reference; $hint)"
    return 0
  fi
  if ! err=$("$py" -c 'import torch.distributed as d
assert d.is_available() and d.is_gloo_available(), "torch.distributed without Gloo"' 2>&1); then
    echo "# ($py cannot import torch.distributed ($(printf '%s\n' "$err" | tail -n 1)): no $name reference; $hint)"
    return 0
  fi
  "$py" "$@" --json "$json" 2> >(grep -v -i warn >&2) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "# ($name reference failed with exit status $rc, see its errors above: left out)"
    rm -f "$json"
    failed=1
  fi
}
