#!/usr/bin/env bash
# run_test.sh NAME WHAT [ARGS...]: build ddp_cuda.cu and tests/NAME.cpp (a multi-rank test of the cpu backend's
# device paths, DDP_CUDA on) with a host C++17 compiler (-Wall -Wextra -Werror -pedantic) against the CUDA
# harness in tests/cuda_harness, the two translation units side by side, link and run it with ARGS; WHAT names
# it in the failure line. NAME may instead be a path to a .c or .cpp file (tests/nccl/test_nccl.c): a .c file
# is compiled as C++ with -DDDP_CUDA (a C test written for nvcc builds, which sets it on the command line).
#   SAN=1         build and run it under AddressSanitizer + UndefinedBehaviorSanitizer instead
#   NCCL=1        with the harness's fake NCCL (tests/cuda_harness/nccl.h): -DDDP_HARNESS_NCCL in both
#                 translation units, so ddp_cuda.cu's NCCL glue is compiled and backend "nccl" runs on the
#                 ranks tl_run_ranks forks (cudaGetDeviceCount: 4; nccl_absent.h then defines nothing); the
#                 fake plays NCCL 2.18.5. NCCL=2.28: the same, the fake playing 2.28.0 (shrink, revoke)
#   BUILD_ONLY=1  build, print the program's path, run nothing
# The program is $BUILD/cuda_harness/<name>[-nccl][-san]. Used by tests/test_cuda_devbuf.sh,
# tests/test_cuda_checkpoint.sh and tests/test_nccl_harness.sh. E.g. a ZeRO-3 test on the nccl backend:
#   NCCL=1 tests/cuda_harness/run_test.sh test_X "what it checks"      (tests/test_X.cpp)
set -u
cd "$(dirname "$0")/../.." || exit 1
test=$1 what=$2
shift 2
BUILD=${BUILD:-build}
CXX=${CXX:-g++}
out="$BUILD/cuda_harness"
mkdir -p "$out"
make -s ddp.h >/dev/null || { echo "FAIL: cannot generate ddp.h"; exit 1; } # regenerated only when src/ changed
flags=(-std=c++17 -Wall -Wextra -Werror -pedantic -I. -Itests -Itests/cuda_harness -pthread)
src="tests/$test.cpp" name=$test tflags=()
case $test in
  *.c) src=$test name=$(basename "$test" .c) tflags=(-x c++ -DDDP_CUDA) ;;
  *.cpp) src=$test name=$(basename "$test" .cpp) ;;
esac
if [ "${NCCL:-0}" = 1 ]; then
  name=$name-nccl
  flags+=(-DDDP_HARNESS_NCCL)
elif [ "${NCCL:-0}" = 2.28 ]; then # the fake playing NCCL 2.28: ncclCommShrink and ncclCommRevoke
  name=$name-nccl228
  flags+=(-DDDP_HARNESS_NCCL -DDDP_FAKE_NCCL_2_28)
fi
opt=(-O1) lflags=()
if [ "${SAN:-0}" = 1 ]; then
  name=$name-san
  opt=(-O1 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  lflags=("${opt[@]}")
fi
"$CXX" "${flags[@]}" "${opt[@]}" -x c++ -c ddp_cuda.cu -o "$out/ddp_cuda_$name.o" & pid=$!
"$CXX" "${flags[@]}" "${opt[@]}" "${tflags[@]}" -c "$src" -o "$out/$name.o"; rc=$?
wait $pid || rc=1
[ $rc = 0 ] && "$CXX" "${lflags[@]}" -pthread "$out/ddp_cuda_$name.o" "$out/$name.o" -lm -o "$out/$name" ||
  { echo "FAIL: ddp_cuda.cu or $src does not build with $CXX and the harness"; exit 1; }
[ "${BUILD_ONLY:-0}" = 1 ] && { echo "$out/$name"; exit 0; }
"$out/$name" "$@" || { echo "FAIL: $what"; exit 1; }
