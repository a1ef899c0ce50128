#!/usr/bin/env bash
# bench/scale_table.sh (issue #25's table: bench/scale_probe.c over TCP and shared memory, and torch's
# gloo) at 4 ranks without gloo, one repetition: its row has a time in every ddp.h cell and "-" in
# gloo's, and the script exits 0. Then the ways a run can fail, each of which must show as "-" with
# "(1 failed)" in the row and exit status 1, never as a number or a hang: a probe that exits 0 but
# prints nothing (/bin/true: no rank's line), one that fails (/bin/false), and one that hangs (sleep,
# with --timeout 2: out in well under the 60 s this allows rather than the sleep's 600 s).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export BUILD
logs=$(mktemp -d "${TMPDIR:-/tmp}/test_scale_table.XXXXXX")
trap 'rm -rf "$logs"' EXIT
fail=0
# row_ok OUTPUT N PATTERN...: the table row for N has the given cells (extended regexps), in order
row_ok() {
  local out=$1 n=$2 row i=2
  shift 2
  row=$(grep -E "^\| $n \|" <<<"$out" | head -1)
  [ -n "$row" ] || { echo "FAILED: no row for N=$n"; return 1; }
  for want in "$@"; do
    i=$((i + 1))
    local cell
    cell=$(awk -F'|' -v k="$i" '{ gsub(/^ +| +$/, "", $k); print $k }' <<<"$row")
    [[ $cell =~ ^($want)$ ]] || { echo "FAILED: N=$n column $((i - 1)) is '$cell', expected /$want/ (row: $row)"; return 1; }
  done
}
num='[0-9]+(\.[0-9]+)? s'
three="$num / $num / -"

out=$(LOGDIR="$logs/ok" timeout 120 bench/scale_table.sh --no-gloo --reps 1 4 2>&1); rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAILED: scale_table.sh --no-gloo --reps 1 4 exited $rc"; fail=1; }
row_ok "$out" 4 "$num" "$num" "$num" "$num" "-" "-" "$num / $num / -" "$three" || fail=1
[ "$(cat "$logs"/ok/N4_tcp_1.log | grep -c '^scale_probe backend=ddp .*world=4 ')" = 4 ] || { echo "FAILED: the TCP run's log has not 4 ranks' lines"; fail=1; }

bad='- \(1 failed\)'
for probe in /bin/true /bin/false "sleep 600"; do
  start=$(date +%s)
  out=$(SCALE_PROBE="$probe" LOGDIR="$logs/bad" timeout 120 bench/scale_table.sh --no-gloo --reps 1 --timeout 2 2 2>&1); rc=$?
  took=$(( $(date +%s) - start ))
  echo "$out"
  [ $rc -eq 1 ] || { echo "FAILED: with SCALE_PROBE='$probe' the script exited $rc, not 1"; fail=1; }
  [ $took -le 60 ] || { echo "FAILED: with SCALE_PROBE='$probe' the script took $took s (limit 60)"; fail=1; }
  row_ok "$out" 2 "$bad" "$bad" "$bad" "$bad" "-" "-" "$bad / $bad / -" "$bad / $bad / -" || fail=1
done
grep -q "timed out after 2 s" <<<"$out" || { echo "FAILED: the hanging probe's run is not reported as timed out"; fail=1; }
[ $fail -eq 0 ] && echo "test_scale_table: all passed"
exit $fail
