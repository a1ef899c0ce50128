#!/usr/bin/env bash
# run_test.sh NAME WHAT: build ddp_cuda.cu and tests/NAME.cpp (a multi-rank test of the cpu backend's
# device paths, DDP_CUDA on) with a host C++17 compiler (-Wall -Wextra -Werror -pedantic) against the CUDA
# harness in tests/cuda_harness, link and run it; WHAT names it in the failure line. SAN=1 builds and
# runs it under AddressSanitizer + UndefinedBehaviorSanitizer instead. Used by tests/test_cuda_devbuf.sh
# and tests/test_cuda_checkpoint.sh.
set -u
cd "$(dirname "$0")/../.." || exit 1
test=$1 what=$2
BUILD=${BUILD:-build}
CXX=${CXX:-g++}
out="$BUILD/cuda_harness"
mkdir -p "$out"
make -s ddp.h >/dev/null || { echo "FAIL: cannot generate ddp.h"; exit 1; } # regenerated only when src/ changed
flags=(-std=c++17 -Wall -Wextra -Werror -pedantic -I. -Itests -Itests/cuda_harness -pthread)
name=$test opt=(-O1) lflags=()
if [ "${SAN:-0}" = 1 ]; then
  name=$test-san
  opt=(-O1 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  lflags=("${opt[@]}")
fi
"$CXX" "${flags[@]}" "${opt[@]}" -x c++ -c ddp_cuda.cu -o "$out/ddp_cuda_$name.o" &&
  "$CXX" "${flags[@]}" "${opt[@]}" -c "tests/$test.cpp" -o "$out/$name.o" &&
  "$CXX" "${lflags[@]}" -pthread "$out/ddp_cuda_$name.o" "$out/$name.o" -lm -o "$out/$name" ||
  { echo "FAIL: ddp_cuda.cu or tests/$test.cpp does not build with $CXX and the harness"; exit 1; }
"$out/$name" || { echo "FAIL: $what"; exit 1; }
