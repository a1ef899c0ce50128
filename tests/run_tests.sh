#!/usr/bin/env bash
# Runs every test: the programs $BUILD/test_* and the scripts tests/test_*.sh.
# A test passes with exit 0, is skipped with exit 77 (it says why), and fails otherwise.
# Each test's output goes to $BUILD/logs/NAME.log and is printed when it fails. Each test may run
# TEST_TIMEOUT seconds (default 900; twice that for the sanitizer runs).
# Ends with the summary line "N passed, N failed, N skipped"; exits 1 when any failed.
# TESTS="name1 name2" runs only those.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export BUILD
TIMEOUT=${TEST_TIMEOUT:-900}
mkdir -p "$BUILD/logs"
passed=0 failed=0 skipped=0 failures=""
run_one() {
  local name=$1; shift
  if [ -n "${TESTS:-}" ] && ! [[ " $TESTS " == *" $name "* ]]; then return; fi
  local log="$BUILD/logs/$name.log" start end rc limit=$TIMEOUT
  # the sanitizer runs build ~20 instrumented programs first: 6-12 minutes seen on a 2-core machine
  case $name in test_sanitizers*) limit=$((TIMEOUT * 2)) ;; esac
  start=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s%N)
  local ms=$(( (end - start) / 1000000 )) secs
  secs=$(printf '%d.%d' $((ms / 1000)) $(((ms % 1000) / 100)))
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); echo "PASS $name (${secs}s)"
  elif [ $rc -eq 77 ]; then
    skipped=$((skipped + 1)); echo "SKIP $name: $(tail -n 1 "$log")"
  else
    failed=$((failed + 1)); failures="$failures $name"
    echo "FAIL $name (exit $rc, ${secs}s) -- last lines of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
  fi
}
for t in "$BUILD"/test_*; do
  [ -x "$t" ] || continue
  run_one "$(basename "$t")" "$t"
done
for s in tests/test_*.sh; do
  [ -f "$s" ] || continue
  run_one "$(basename "$s" .sh)" bash "$s"
done
[ -n "$failures" ] && echo "failed:$failures"
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
