#!/usr/bin/env bash
# bench/bench_scale.c, the scale benchmark of docs/SCALE.md, on small worlds (2, 8 and 24 ranks): every rank gets through
# ddp_init, a barrier and ddp_destroy, with ranks as threads and as processes, and each row's numbers
# hold what any store-based rendezvous must: rank 0's store served at least one request and one
# connection per rank, its thread used some CPU (from 8 ranks: 2 ranks take under the 1 ms printed), every other rank holds at least its own connections
# and at most one per peer plus the store's and its listening socket, and rank 0's process at least N descriptors. A benchmark
# that breaks when the rendezvous or the connection scheme changes (it reads the store server's
# counters through the rank-0 group) fails here, not in the next person's measurement.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
make -s BUILD="$BUILD" SAN="${SAN:-}" "$BUILD/bench_scale" || { echo "cannot build $BUILD/bench_scale"; exit 1; }
fail=0
# check_row N LINE: the row's columns against the bounds above
check_row() {
  local n=$1 line=$2
  awk -F'|' -v n="$n" '
    function num(s) { gsub(/[^0-9.]/, "", s); return s + 0 }
    {
      split($6, req, "("); split($7, cpu, "("); split($8, sock, ",")
      if ($2 + 0 != n) { print "row for N=" n " names N=" $2; exit 1 }
      if ($4 !~ /[0-9]/ || num($4) > 30) { print "N=" n ": init time " $4 " s not in [0, 30]"; exit 1 } # 2 ranks: 0.00
      if (num(req[1]) < n) { print "N=" n ": rank 0 served " req[1] " requests, fewer than one per rank"; exit 1 }
      if (n >= 8 && num(cpu[1]) <= 0) { print "N=" n ": store CPU " cpu[1] " s is not positive"; exit 1 } # 2 ranks: under 1 ms, printed 0.000
      if (num(sock[1]) < 1 || num(sock[2]) > n + 1) { print "N=" n ": sockets per rank " $8 " not in [1, " n + 1 "]"; exit 1 }
      if (num($10) < n) { print "N=" n ": rank 0 holds " $10 " descriptors, fewer than " n; exit 1 }
    }' <<<"$line"
}
run() { # run "OPTIONS" N...: every row of a run, checked; the run must exit 0
  local opts=$1 out rc n line
  shift
  out=$(timeout 120 "$BUILD/bench_scale" --limit 60 $opts "$@" 2>&1); rc=$?
  echo "$out"
  [ $rc -eq 0 ] || { echo "FAILED: bench_scale $opts $* exited $rc"; fail=1; return; }
  for n in "$@"; do
    line=$(grep -E "^\| $n \|" <<<"$out" | head -1)
    [ -n "$line" ] || { echo "FAILED: no row for N=$n"; fail=1; continue; }
    check_row "$n" "$line" || fail=1
  done
}
run "" 2 8 24            # 16 processes at most: 24 ranks are threads, 3 or 2 a process
run "--procs 7" 8        # a process per rank, as ddprun runs them
[ $fail -eq 0 ] && echo "test_bench_scale: all passed"
exit $fail
