#!/usr/bin/env bash
# `make test`: the whole suite against each LibTorch this project supports,
# every suite always run (a failing first suite does not hide the second),
# then one summary line per suite and a total: passed, failed and skipped
# (ctest counts a skipped test as passed; here it is not), with the names of
# the tests that did not run. Exits non-zero when any suite failed or could
# not run, and under CI=true also when any test was skipped: CI runs as
# root, where every test can run, so a skip there means a test that should
# have run did not.
#
#   scripts/test-suites.sh [SUITE ...]     SUITE: a make target (test-1.13, test-2)
#
# MAKE (the calling make) and MAKEFLAGS pass through, so `make test BUILD=x`
# reaches the suites.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
make_cmd=${MAKE:-make}
[ $# -gt 0 ] || set -- test-1.13 test-2
in_ci=0
[ "${CI:-}" = true ] && in_ci=1
max_names=20  # names of failed or skipped tests shown per suite

declare -A title=([test-1.13]="LibTorch 1.13 (Debian)" [test-2]="LibTorch 2.x (PyPI wheel)")
logdir=$(mktemp -d "${TMPDIR:-/tmp}/tdist-test.XXXXXX")
trap 'rm -rf "$logdir"' EXIT

summary=()
total_pass=0 total_fail=0 total_skip=0 not_run=0 status=0
# names "WHAT" FILE: up to max_names lines of FILE, indented, under WHAT.
names() {
  local n
  n=$(wc -l < "$2")
  [ "$n" -gt 0 ] || return 0
  summary+=("  $1:")
  while read -r t; do summary+=("    $t"); done < <(head -n "$max_names" "$2")
  [ "$n" -le "$max_names" ] || summary+=("    ... and $((n - max_names)) more (see the suite's output above)")
}
# list HEADER FILE: the entries ("12 - Name (Skipped)") of ctest's list
# under HEADER in FILE.
list() {
  awk -v h="$1" '$0 == h { on = 1; next } on && /^[ \t]+[0-9]+ - / { sub(/^[ \t]+/, ""); print; next } { on = 0 }' "$2"
}
for suite in "$@"; do
  log=$logdir/$suite.log
  t0=$SECONDS
  "$make_cmd" -C "$root" --no-print-directory "$suite" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$((SECONDS - t0))
  time=$(printf '%d min %02d s' $((secs / 60)) $((secs % 60)))
  name="${title[$suite]:-$suite}"
  # ctest's closing line: "97% tests passed, 4 tests failed out of 698";
  # after it, its lists of the tests that did not run ("(Skipped)", and
  # "(Disabled)", which the count "out of" leaves out) and of those that
  # failed ("(Failed)", "(Timeout)", "(Not Run)": no executable, ...).
  at=$(grep -nE '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1 | cut -d: -f1)
  if [ -n "$at" ]; then
    tail -n "+$at" "$log" > "$logdir/$suite.end"
    line=$(head -n 1 "$logdir/$suite.end")
    failed=$(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<< "$line")
    all=$(sed -E 's/.*failed out of ([0-9]+).*/\1/' <<< "$line")
    list "The following tests did not run:" "$logdir/$suite.end" > "$logdir/$suite.skipped"
    list "The following tests FAILED:" "$logdir/$suite.end" > "$logdir/$suite.failed"
    skipped=$(wc -l < "$logdir/$suite.skipped")
    disabled=$(grep -c ' (Disabled)$' "$logdir/$suite.skipped")
    passed=$((all - failed - (skipped - disabled)))
    total_pass=$((total_pass + passed))
    total_fail=$((total_fail + failed))
    total_skip=$((total_skip + skipped))
    counts=$(printf '%d passed, %d failed, %d skipped' "$passed" "$failed" "$skipped")
    if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ]; then
      status=1
      summary+=("$(printf '%-28s %s (%s) FAILED (rc %d)' "$name:" "$counts" "$time" "$rc")")
    elif [ "$skipped" -ne 0 ] && [ "$in_ci" -eq 1 ]; then
      status=1
      summary+=("$(printf '%-28s %s (%s) FAILED: CI=true, where no test may skip' "$name:" "$counts" "$time")")
    else
      summary+=("$(printf '%-28s %s (%s)' "$name:" "$counts" "$time")")
    fi
    names "failed" "$logdir/$suite.failed"
    names "skipped (did not run)" "$logdir/$suite.skipped"
  else
    status=1
    not_run=$((not_run + 1))
    why="make $suite stopped before its tests"
    grep -q 'No tests were found' "$log" && why="ctest found no tests"
    summary+=("$(printf '%-28s not run: %s (rc %d, %s; see above)' "$name:" "$why" "$rc" "$time")")
  fi
done

echo
echo "==== make test: one line per suite ===="
printf '%s\n' "${summary[@]}"
total="total: $total_pass passed, $total_fail failed, $total_skip skipped"
[ "$not_run" -eq 0 ] || total="$total; $not_run of $# suites not run"
[ "$total_skip" -eq 0 ] || [ "$in_ci" -eq 0 ] || total="$total; FAILED: tests skipped under CI=true"
echo "$total"
exit $status
