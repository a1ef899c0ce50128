#!/usr/bin/env bash
# The multi-process tests again, built with AddressSanitizer + UndefinedBehaviorSanitizer (and
# LeakSanitizer, which runs at each rank's exit) and with ThreadSanitizer (the progress thread and
# the store server thread); under ASan also the single-process tests below; with SANITIZER_SCRIPTS_ONLY=1
# only two scripts (test_ddprun, test_examples) with their programs built with ASan. Any report fails the run
# (-fno-sanitize-recover, halt_on_error). Two of the programs run again with DDP_TIMELINE set.
# The large-count collective cases are skipped (TEST_QUICK): they run the same code as small ones.
# SANITIZERS="address thread" picks which; this script runs ASan+UBSan by default, and
# tests/test_sanitizers_thread.sh runs it for TSan (two tests, so each gets run_tests.sh's time limit).
set -eu
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 TEST_QUICK=1
threaded="test_errors test_init test_collectives test_more_collectives test_tcp_algorithms test_hier test_shm_alloc test_shm_cma test_store test_auth test_spawn test_checkpoint test_checkpoint_ranks test_syncbn_ranks test_reducer test_reducer_errors test_reducer_join test_reducer_zero test_reducer_fsdp test_reducer_fsdp_ckpt test_reducer_samples test_ft test_amp test_trace ${SANITIZER_EXTRA_TESTS:-}"
# (test_checkpoint is single-process, but its async saves run a background thread)
# single-process tests: no threads for ThreadSanitizer to watch, but parsers and allocation paths for ASan
single="test_checkpoint_fault test_sampler test_sampler_step test_ft_view test_syncbn test_reducer_buckets test_dtype"
# script tests whose programs (ddprun, the examples) are built with ASan through BUILD/SAN: run by
# SANITIZER_SCRIPTS_ONLY=1 alone (tests/test_sanitizers_scripts.sh, which the suite runs beside the TSan
# run; ASan only: their threads are TSan's already in the programs above). The rest of the scripts pass
# too (`make test SAN=address|thread`, see docs/RELIABILITY.md) but take longer
scripts="test_ddprun test_examples"
if [ "${SANITIZER_SCRIPTS_ONLY:-0}" = 1 ]; then
  for t in $scripts; do
    echo "== $t (its programs under address sanitizer)"
    started=$SECONDS
    BUILD=build-address-scripts SAN=address bash tests/$t.sh # (its own folder: the ASan run may be building in build-address)
    echo "== $t: $((SECONDS - started)) s, its build included"
  done
  echo "sanitizers (address, the scripts' programs): no reports"
  exit 0
fi
for san in ${SANITIZERS:-address}; do
  tests=$threaded
  if [ $san = address ]; then tests="$tests $single"; fi
  targets=""
  for t in $tests; do targets="$targets build-$san/$t"; done
  started=$SECONDS
  make -s -j"$(nproc)" SAN=$san BUILD=build-$san $targets
  echo "== built under $san sanitizer in $((SECONDS - started)) s"
  for t in $tests; do
    echo "== $t under $san sanitizer"
    started=$SECONDS
    if [ "$t" = test_collectives ]; then build-$san/$t 1 2 3 4; else build-$san/$t; fi
    echo "== $t: $((SECONDS - started)) s"
  done
  # the timeline (its buffer is shared by the program's thread, the progress thread and the saver) on the
  # async collectives and the reducer's passes; each rank's last file must be valid
  tl=$(mktemp -d)
  for t in test_collectives test_reducer; do
    echo "== $t with DDP_TIMELINE under $san sanitizer"
    if [ "$t" = test_collectives ]; then DDP_TIMELINE=$tl/$t.%r.json build-$san/$t 2 3 >/dev/null
    else DDP_TIMELINE=$tl/$t.%r.json build-$san/$t >/dev/null; fi
    python3 tests/timeline_check.py "$tl/$t.0.json"
  done
  rm -rf "$tl"
done
echo "sanitizers (${SANITIZERS:-address}): no reports"
