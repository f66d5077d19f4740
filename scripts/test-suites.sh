#!/usr/bin/env bash
# `make test`: the whole suite against each LibTorch this project supports,
# every suite always run (a failing first suite does not hide the second),
# then one summary line per suite and a total. Exits non-zero when any suite
# failed or could not run.
#
#   scripts/test-suites.sh [SUITE ...]     SUITE: a make target (test-1.13, test-2)
#
# MAKE (the calling make) and MAKEFLAGS pass through, so `make test BUILD=x`
# reaches the suites.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
make_cmd=${MAKE:-make}
[ $# -gt 0 ] || set -- test-1.13 test-2

declare -A title=([test-1.13]="LibTorch 1.13 (Debian)" [test-2]="LibTorch 2.x (PyPI wheel)")
logdir=$(mktemp -d "${TMPDIR:-/tmp}/tdist-test.XXXXXX")
trap 'rm -rf "$logdir"' EXIT

summary=()
total_pass=0 total_fail=0 not_run=0 status=0
for suite in "$@"; do
  log=$logdir/$suite.log
  t0=$SECONDS
  "$make_cmd" -C "$root" --no-print-directory "$suite" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$((SECONDS - t0))
  # ctest's closing line: "97% tests passed, 4 tests failed out of 698".
  line=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  name="${title[$suite]:-$suite}"
  if [ -n "$line" ]; then
    failed=$(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<< "$line")
    all=$(sed -E 's/.*failed out of ([0-9]+).*/\1/' <<< "$line")
    passed=$((all - failed))
    total_pass=$((total_pass + passed))
    total_fail=$((total_fail + failed))
    if [ "$rc" -eq 0 ] && [ "$failed" -eq 0 ]; then
      summary+=("$(printf '%-28s %d passed, %d failed (%d min %02d s)' "$name:" "$passed" "$failed" $((secs / 60)) $((secs % 60)))")
    else
      status=1
      summary+=("$(printf '%-28s %d passed, %d failed (%d min %02d s) FAILED (rc %d):' "$name:" "$passed" "$failed" $((secs / 60)) $((secs % 60)) "$rc")")
      while read -r t; do summary+=("    $t"); done < <(sed -n '/The following tests FAILED:/,$p' "$log" | grep -E '^\s+[0-9]+ - ' | head -n 20)
    fi
  else
    status=1
    not_run=$((not_run + 1))
    why="make $suite stopped before its tests"
    grep -q 'No tests were found' "$log" && why="ctest found no tests"
    summary+=("$(printf '%-28s not run: %s (rc %d, %d min %02d s; see above)' "$name:" "$why" "$rc" $((secs / 60)) $((secs % 60)))")
  fi
done

echo
echo "==== make test: one line per suite ===="
printf '%s\n' "${summary[@]}"
if [ "$not_run" -gt 0 ]; then
  echo "total: $total_pass passed, $total_fail failed; $not_run of $# suites not run"
else
  echo "total: $total_pass passed, $total_fail failed"
fi
exit $status
