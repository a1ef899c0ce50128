#!/usr/bin/env bash
# ddp_cuda.cu's kernels, run on the CPU: ddp_cuda.cu and tests/test_cuda_kernels.cpp built by a host
# C++17 compiler (-Wall -Wextra -Werror -pedantic) against the CUDA execution harness in
# tests/cuda_harness, then run twice: optimised, and under AddressSanitizer + UndefinedBehaviorSanitizer
# (out-of-bounds kernel accesses on the test's exactly sized buffers, undefined arithmetic). Each time
# also tests/test_syncbn_device.cpp: ddp_syncbn_forward/backward's device path on these kernels, 1 and 3
# ranks, against the host path. Needs
# neither a GPU nor the CUDA toolkit. HARNESS_UCONTEXT=1 also runs the quick set on the portable
# ucontext fiber switch (the one used off x86-64).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
CXX=${CXX:-g++}
out="$BUILD/cuda_harness"
mkdir -p "$out"
make -s ddp.h >/dev/null || { echo "FAIL: cannot generate ddp.h"; exit 1; } # regenerated only when src/ changed
flags=(-std=c++17 -Wall -Wextra -Werror -pedantic -I. -Itests/cuda_harness)

# build NAME "KERNEL FLAGS" "TEST FLAGS" [LINK FLAGS]: the two translation units at once (the test's
# own code, mostly f64 references, needs less optimisation than the kernels), then link with the
# kernels' object first, so that its copies of the harness's inline functions are the ones kept.
build() {
  local name=$1 kflags=$2 tflags=$3 lflags=${4:-} pid1 pid2 ok=1
  # shellcheck disable=SC2086
  "$CXX" "${flags[@]}" $kflags -x c++ -c ddp_cuda.cu -o "$out/ddp_cuda$name.o" & pid1=$!
  # shellcheck disable=SC2086
  "$CXX" "${flags[@]}" $tflags -c tests/test_cuda_kernels.cpp -o "$out/test_cuda_kernels$name.o" & pid2=$!
  wait $pid1 || ok=0
  wait $pid2 || ok=0
  # shellcheck disable=SC2086
  [ $ok = 1 ] && "$CXX" $lflags "$out/ddp_cuda$name.o" "$out/test_cuda_kernels$name.o" -lm -o "$out/test_cuda_kernels$name"
}

echo "== optimised (-O2)"
build "" "-O2" "-O1" || { echo "FAIL: ddp_cuda.cu or the kernel test does not build with $CXX and the harness"; exit 1; }
"$out/test_cuda_kernels" || { echo "FAIL: kernels (optimised build)"; exit 1; }

# SyncBN's device path in the library (src/syncbn.c with DDP_CUDA) on these kernels: tests/test_syncbn_device.cpp
# (the library compiled into it; device memory is the harness's cudaMalloc, the exchange on 3 ranks staged by
# src/devbuf.c). $1: extra flags, $2: suffix.
# shellcheck disable=SC2086 # $1: flags, split on purpose
device_path() {
  "$CXX" -std=c++17 -Wall -Wextra -Werror -pedantic -I. -Itests/cuda_harness -O1 -pthread $1 -c tests/test_syncbn_device.cpp \
    -o "$out/test_syncbn_device$2.o" &&
    "$CXX" $1 "$out/ddp_cuda$2.o" "$out/test_syncbn_device$2.o" -lm -pthread -o "$out/test_syncbn_device$2" &&
    "$out/test_syncbn_device$2"
}
echo "== SyncBN's device path (ddp_syncbn_* on \"device\" memory) against its host path"
device_path "" "" || { echo "FAIL: SyncBN's device path"; exit 1; }

# A grid of at most 5 blocks makes every grid-stride loop of the kernels take many turns (at the
# default 8192 blocks the test's shapes need one turn per thread), and makes the run fast.
echo "== AddressSanitizer + UndefinedBehaviorSanitizer, grid-stride loops at most 5 blocks wide"
san="-g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
build "-san" "-O1 $san -DDDP__CU_MAX_GRID=5" "-O0 $san" "$san" || { echo "FAIL: the sanitizer build"; exit 1; }
"$out/test_cuda_kernels-san" || { echo "FAIL: kernels under AddressSanitizer + UndefinedBehaviorSanitizer"; exit 1; }
device_path "$san" "-san" || { echo "FAIL: SyncBN's device path under AddressSanitizer + UndefinedBehaviorSanitizer"; exit 1; }

if [ "${HARNESS_UCONTEXT:-0}" = 1 ]; then
  echo "== ucontext fibers (quick set)"
  build "-ucontext" "-O1 -DDDP_HARNESS_UCONTEXT" "-O1 -DDDP_HARNESS_UCONTEXT" || { echo "FAIL: the ucontext build"; exit 1; }
  "$out/test_cuda_kernels-ucontext" --quick || { echo "FAIL: kernels on ucontext fibers"; exit 1; }
fi
echo "ok"
