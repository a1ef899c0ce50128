#!/usr/bin/env bash
# The nccl backend without a GPU: ddp_cuda.cu with its NCCL glue and tests/nccl/test_nccl.c (the implementation
# with DDP_CUDA, and the test) built by a host C++17 compiler (-Wall -Wextra -Werror -pedantic) against the CUDA
# harness in tests/cuda_harness and its fake NCCL (nccl.h, -DDDP_HARNESS_NCCL: ranks are processes sharing a
# POSIX shared memory segment, each call runs to completion inside it; "device" memory the host cannot touch).
# Runs test_nccl's modes: check (the call check on cpu groups), gpu 1, 2, 3 and 4 (every collective and dtype
# on device memory through NCCL: gather, scatter, all_to_all(_v), all_gather_v through grouped ncclSend/ncclRecv,
# async, in place, mismatches that must fail every rank), gpu 3 again with 256-byte chunks (every call many
# rounds, the send rings wrapping), gpu 2 over TCP, nogpu with DDP_HARNESS_DEVICES=0 (the "no CUDA device
# visible" error from ddp_cuda.cu itself); then the fake's own test (tests/cuda_harness/fake_nccl_test.cpp:
# every collective, type and op against references, send/receive, failures); no segment may be left in
# /dev/shm. Then tests/nccl/test_nccl_ft.c (fault tolerance on nccl: members killed mid-step, a joiner
# receiving device state) with the fake playing NCCL 2.18 (a new view's communicator made anew) and 2.28
# (revoked, then shrunk). Each run is timed. Needs neither a GPU, nor the CUDA toolkit, nor NCCL.
# SAN=1 builds and runs it all under AddressSanitizer + UndefinedBehaviorSanitizer instead.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
CXX=${CXX:-g++}
out="$BUILD/cuda_harness"
mkdir -p "$out/logs"
now() { date +%s%N; }
secs() { local ms=$((($(now) - $1) / 1000000)); printf '%d.%02d' $((ms / 1000)) $((ms % 1000 / 10)); }
start=$(now)
marker="$out/.nccl_harness_start.$$"
touch "$marker"
trap 'rm -f "$marker"' EXIT

suffix="" opt=(-O1)
if [ "${SAN:-0}" = 1 ]; then
  suffix=-san
  opt=(-O1 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
fi
# the fake's own test (one translation unit, no ddp.h) beside run_test.sh's two
"$CXX" -std=c++17 -Wall -Wextra -Werror -pedantic -Itests -Itests/cuda_harness -pthread -DDDP_HARNESS_NCCL "${opt[@]}" \
  tests/cuda_harness/fake_nccl_test.cpp -o "$out/fake_nccl_test$suffix" & fake_pid=$!
prog=$(NCCL=1 BUILD_ONLY=1 tests/cuda_harness/run_test.sh tests/nccl/test_nccl.c "test_nccl") || { echo "$prog"; exit 1; }
wait $fake_pid || { echo "FAIL: tests/cuda_harness/fake_nccl_test.cpp does not build with $CXX and the harness"; exit 1; }
echo "built with $CXX${suffix:+ (AddressSanitizer + UBSan)} in $(secs "$start") s: $prog, $out/fake_nccl_test$suffix"

# run WHAT COMMAND...: its output into a log (shown when it fails), its time
run() {
  local what=$1 t0 log rc
  shift
  log="$out/logs/nccl_harness$suffix-${what//[^A-Za-z0-9]/_}.log"
  t0=$(now)
  "$@" >"$log" 2>&1
  rc=$?
  if [ $rc != 0 ]; then
    grep -v '^\[ddp rank [0-9]*\] error:   ' "$log" | tail -n 30 # without the flight recorder's lines
    echo "FAIL: $what (exit $rc, $(secs "$t0") s; the whole output: $log)"
    exit 1
  fi
  printf '%-44s ok (%s s)\n' "$what" "$(secs "$t0")"
}

devices=$("$prog" devices)
[ "$devices" = 4 ] || { echo "FAIL: test_nccl devices says $devices; the harness with the fake NCCL reports 4"; exit 1; }
run "check (call check, cpu groups)" "$prog" check
for n in 1 2 3 4; do run "gpu $n" "$prog" gpu $n; done
run "gpu 3, 256-byte chunks and rings" env DDP_FAKE_NCCL_CHUNK=256 "$prog" gpu 3
run "gpu 2 over TCP" env DDP_TRANSPORT=tcp "$prog" gpu 2
run "nogpu (DDP_HARNESS_DEVICES=0)" env DDP_HARNESS_DEVICES=0 "$prog" nogpu
run "the fake NCCL's own test" "$out/fake_nccl_test$suffix"
# fault tolerance on nccl, the fake playing both NCCL lines: 2.18 (abort + re-init), 2.28 (revoke, shrink)
for line in 1 2.28; do
  ft=$(NCCL=$line BUILD_ONLY=1 tests/cuda_harness/run_test.sh tests/nccl/test_nccl_ft.c "test_nccl_ft") || { echo "$ft"; exit 1; }
  run "fault tolerance, fake NCCL ${line/1/2.18}" "$ft" all
done

left=$(find /dev/shm -maxdepth 1 -name 'ddp-fake-nccl-*' -newer "$marker" 2>/dev/null)
[ -z "$left" ] || { echo "FAIL: segments left in /dev/shm: $left"; exit 1; }
echo "ok ($(secs "$start") s)"
