#!/usr/bin/env bash
# Runs the tests: the programs $BUILD/test_* (built from tests/test_*.c) and the scripts tests/test_*.sh.
#   TIER=quick   the unit and multi-process correctness tests that need only a C compiler (`make test-quick`)
#   TIER=full    everything (the default; `make test`): quick + sanitizers, valgrind, fuzzing, torch/MPI
#                interop, CUDA/NCCL builds, CMake, network namespaces
#   TESTS="name1 name2"  runs only those, whatever their tier (a name that is no test fails)
# A test passes with exit 0, is skipped with exit 77 (its last line says why), and fails otherwise. A test
# that passes may also report a part of itself that could not run here (no GPU, too little memory): it
# prints a line "SKIP-PART <part>: <why>", and each such line counts as one more skipped entry
# ("SKIP name (<part>): <why>"), so what did not run is never counted as passed.
# Each test's output goes to $BUILD/logs/NAME.log and is printed when it fails. Each test may run
# TEST_TIMEOUT seconds (default 900; twice that for the sanitizer runs).
# A few heavy tests that leave a core idle run side by side with another (TOGETHER below).
# Ends with the ten slowest tests (wall and CPU seconds), the suite's wall time and, as the last line,
# "N passed, N failed, N skipped"; exits 1 when any failed. tests/README.md lists every test.
set -u
cd "$(dirname "$0")/.." || exit 1
# `make test` runs this script with make's job server in MAKEFLAGS; the tests' own make calls start afresh
unset MAKEFLAGS MFLAGS

# The tier of every test, in this one place (tests/README.md describes each). A test missing here runs
# only in the full tier, and the runner says so.
QUICK="
  test_amp test_auth test_checkpoint test_checkpoint_fault test_checkpoint_ranks test_collectives test_dtype
  test_more_collectives
  test_errors test_hier test_init test_reducer test_reducer_buckets test_reducer_errors test_reducer_join
  test_reducer_zero test_reducer_zero_ckpt test_reducer_fsdp test_reducer_fsdp_ckpt test_reducer_samples test_llmc_fsdp
  test_sampler test_sampler_step test_ft_view test_ft
  test_shm_alloc test_shm_cma test_spawn test_store test_syncbn test_syncbn_ranks test_tcp_algorithms
  test_ddprun test_examples test_demo test_trace test_timeline test_bench_scale test_cuda_devbuf test_cuda_checkpoint
  test_nccl_harness test_nccl_fsdp
"
FULL="
  test_compile test_faults test_cuda_kernels test_sanitizers test_sanitizers_thread test_sanitizers_scripts test_valgrind test_fuzz
  test_interop_checkpoint test_interop_ddprun test_interop_reducer test_interop_sampler test_interop_store
  test_interop_syncbn test_interop_torch_current test_launchers test_mpi test_cmake test_cuda_compile test_nccl
  test_netns test_scale test_scale_table
  test_gpu_check
"

BUILD=${BUILD:-build}
export BUILD
TIER=${TIER:-full}
case $TIER in quick|full) ;; *) echo "TIER must be quick or full, not '$TIER'"; exit 2 ;; esac
TIMEOUT=${TEST_TIMEOUT:-900}
mkdir -p "$BUILD/logs"
passed=0 failed=0 skipped=0 failures="" times="" seen=" "
suite_start=$(date +%s%N)
tier_of() {
  if [[ " $(echo $QUICK) " == *" $1 "* ]]; then echo quick
  elif [[ " $(echo $FULL) " == *" $1 "* ]]; then echo full
  else echo unknown; fi
}
# CPU time (user + system) of the runner's finished children so far, in ms, into $cpu_ms: a test's share is
# the difference around it (the processes it waited for), shown beside its wall time in the slowest list.
# `times` runs in this shell (a $(...) subshell would count its own children), its output through a file.
children_cpu_ms() {  # children_cpu_ms NAME (the file it goes through is NAME's: tests of a group run at once)
  times >"$BUILD/logs/.times.$1"
  cpu_ms=$(tail -n 1 "$BUILD/logs/.times.$1" | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub("s", "", p[2]);
                                                    t += p[1] * 60 + p[2] } printf "%d\n", t * 1000 }')
}
# Tests that run side by side, a group a line: they share no files, ports or build directories, and each
# group's members together keep about two cores busy where one alone leaves one idle (the sanitizer runs use
# ~1.3 cores each; the current-torch chroot's Python, gpu-check's nvcc builds, MPI's and NCCL's builds one
# each). A group starts when the runner reaches its first member; the others wait for it. CPU seconds
# printed for a test are its own processes' either way.
# Each line runs its slots side by side; a slot "a+b" runs a, then b (the shorter runs of a line chained so
# that the slots take about as long). Measured in a clean clone on the 2-core machine (wall s, CPU s): ASan
# 639 (596) + gpu_check 142 (149) against TSan 573 (502) + the ASan scripts 139 (114) + the harness kernels
# 57 (62); current torch 382 (381) against mpi 79 + nccl 127 + the fake NCCL's 58 + the namespaces' 134; and
# three pairs of a test that keeps about one core busy with tests that mostly wait (timeouts, peers,
# launchers): cuda_compile 46 beside init, auth, trace and more_collectives (76 together); cmake 35 beside
# ft and launchers (59); ddprun 54 beside timeline 44 and the fake NCCL's FSDP 22. The two sanitizer lanes
# and the torch lane keep both cores busy: the suite's length is its CPU time now, not its packing.
TOGETHER="
  test_sanitizers+test_gpu_check test_sanitizers_thread+test_sanitizers_scripts+test_cuda_kernels
  test_interop_torch_current test_mpi+test_nccl+test_nccl_harness+test_netns
  test_cuda_compile test_init+test_auth+test_trace+test_more_collectives
  test_cmake test_ft+test_launchers
  test_ddprun test_timeline+test_nccl_fsdp
"
# selected NAME: does NAME run in this invocation (TESTS, TIER)? Says so when it is in no tier.
selected() {
  local tier; tier=$(tier_of "$1")
  if [ -n "${TESTS:-}" ]; then
    [[ " $TESTS " == *" $1 "* ]]
  else
    [ "$tier" = unknown ] && echo "note: $1 is in no tier in tests/run_tests.sh: it runs in the full tier only"
    ! { [ "$TIER" = quick ] && [ "$tier" != quick ]; }
  fi
}
# command_of NAME: how NAME runs (its program, or its script), empty when it has neither
command_of() {
  if [ -x "$BUILD/$1" ] && [ -f "$BUILD/$1" ]; then echo "$BUILD/$1"
  elif [ -f "tests/$1.sh" ]; then echo "bash tests/$1.sh"; fi
}
# exec_one NAME: run it under its time limit, its output into its log and "rc ms cpu_ms" into its result
exec_one() {
  local name=$1 log="$BUILD/logs/$1.log" start end rc limit=$TIMEOUT cpu0 cmd
  cmd=$(command_of "$name")
  # the sanitizer runs build ~20 instrumented programs first: 6-12 minutes seen on a 2-core machine
  case $name in test_sanitizers*) limit=$((TIMEOUT * 2)) ;; esac
  children_cpu_ms "$name"; cpu0=$cpu_ms
  start=$(date +%s%N)
  # shellcheck disable=SC2086 # the command is a program path, or "bash" and a script path
  timeout --kill-after=10 "$limit" $cmd >"$log" 2>&1
  rc=$?
  end=$(date +%s%N)
  children_cpu_ms "$name"
  rm -f "$BUILD/logs/.times.$name"
  echo "$rc $(( (end - start) / 1000000 )) $(( cpu_ms - cpu0 ))" >"$BUILD/logs/$name.result"
}
# report_one NAME: its line (PASS, SKIP, FAIL with the log's end), the counters, the slowest list's entry
report_one() {
  local name=$1 log="$BUILD/logs/$1.log" rc ms cpu secs part
  read -r rc ms cpu <"$BUILD/logs/$name.result"
  secs=$(printf '%d.%d' $((ms / 1000)) $(((ms % 1000) / 100)))
  times="$times$secs $name $((cpu / 1000))"$'\n'
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1)); echo "PASS $name (${secs}s)"
    while IFS= read -r part; do
      skipped=$((skipped + 1)); echo "SKIP $name (${part%%:*}):${part#*:}"
    done < <(sed -n 's/^SKIP-PART //p' "$log")
  elif [ "$rc" -eq 77 ]; then
    skipped=$((skipped + 1)); echo "SKIP $name: $(tail -n 1 "$log")"
  else
    failed=$((failed + 1)); failures="$failures $name"
    echo "FAIL $name (exit $rc, ${secs}s) -- last lines of $log:"
    tail -n 40 "$log" | sed 's/^/    /'
  fi
}
# group_of NAME: the slots of NAME's TOGETHER line (NAME alone when it is in none)
group_of() {
  local line
  while IFS= read -r line; do
    [[ " ${line//+/ } " == *" $1 "* ]] && { echo $line; return; }
  done <<<"$TOGETHER"
  echo "$1"
}
run_one() {
  local name=$1 members="" slots="" slot chain m
  [[ "$seen" == *" $name "* ]] && return # ran with its group
  for slot in $(group_of "$name"); do
    chain=""
    for m in ${slot//+/ }; do
      seen="$seen$m "
      selected "$m" && [ -n "$(command_of "$m")" ] && chain="$chain+$m" && members="$members $m"
    done
    [ -n "$chain" ] && slots="$slots ${chain#+}"
  done
  [ -n "$members" ] || return
  for slot in $slots; do (for m in ${slot//+/ }; do exec_one "$m"; done) & done
  wait
  for m in $members; do report_one "$m"; done
}
for t in "$BUILD"/test_*; do
  [ -x "$t" ] && [ -f "$t" ] || continue
  run_one "$(basename "$t")"
done
for s in tests/test_*.sh; do
  [ -f "$s" ] || continue
  run_one "$(basename "$s" .sh)"
done
for n in ${TESTS:-}; do
  [[ "$seen" == *" $n "* ]] && continue
  failed=$((failed + 1)); failures="$failures $n"
  echo "FAIL $n: no such test (no $BUILD/$n program -- run make first -- and no tests/$n.sh)"
done
if [ -n "$times" ]; then
  echo "slowest (wall seconds, CPU seconds of its processes):"
  printf '%s' "$times" | sort -rn | head -n 10 | awk '{ printf "  %8.1fs  %7ds cpu  %s\n", $1, $3, $2 }'
fi
suite_end=$(date +%s%N)
wall=$(( (suite_end - suite_start) / 1000000000 ))
if [ -n "${TESTS:-}" ]; then what="TESTS=\"$TESTS\""; else what="TIER=$TIER"; fi
echo "wall time: $((wall / 60))m$((wall % 60))s ($what)"
[ -n "$failures" ] && echo "failed:$failures"
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
