#!/usr/bin/env bash
# The nccl backend (tests/nccl/test_nccl.c). (1) ddp_cuda.cu (with its NCCL glue) compiles with nvcc for
# sm_75, sm_80 and sm_90 (those this nvcc supports), every warning an error; the test program, which
# compiles ddp.h's implementation with -DDDP_CUDA, compiles warning-free as C99 and as C++17 and is linked
# by nvcc with ddp_cuda.o and -lnccl; the GPU example builds with make GPU=1. (2) Without a GPU: backend
# "nccl" fails on both ranks with "no CUDA device visible ... use the cpu backend" (from the descriptor
# and from DDP_BACKEND), also under AddressSanitizer + UBSan; the default backend is cpu; the backend's call
# check (no GPU needed, cpu groups of 3 ranks: a rank with no buffers, all_to_all_v split sizes and
# all_gather_v counts that differ: DDP_ERR_MISMATCH on every rank), also under the sanitizers. (3) With a
# CUDA device visible: every collective and dtype through NCCL at world size 1, and 2 when there are 2
# GPUs (gather, scatter, all_to_all(_v), all_gather_v through grouped ncclSend/ncclRecv included, and
# their split sizes / counts that differ), checked against host math (passed on an H200 at 1 rank,
# docs/GPU.md; the 2-GPU part not run there); fault tolerance (tests/nccl/test_nccl_ft.c: members killed,
# a joiner) with 4 GPUs (not run on GPUs so far; tests/test_nccl_harness.sh runs it on the fake NCCL);
# without one the script passes for (1) and (2) and prints "SKIP-PART gpu part: ...", which
# tests/run_tests.sh counts as a skipped entry (likewise the 2-GPU and fault-tolerance parts).
# Skips (77) when nvcc or nccl.h is absent (tools/nccl-env.sh looks for NCCL, a pip wheel's too).
# PREBUILT=1: use the test program already in $BUILD/nccl when it loads (built on another machine with
# BUILD_ONLY=1, which builds part (1) and runs nothing): tools/gpu-check.sh --build-only / --prebuilt.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
NVCC=${NVCC:-nvcc}
CC=${CC:-cc}
CXX=${CXX:-g++}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; else
    echo "skipped: nvcc not found (set NVCC or install the CUDA toolkit)"; exit 77
  fi
fi
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
. tools/nccl-env.sh # NCCL_INCLUDE, NCCL_LIB, nccl_env_loads; also a pip wheel's NCCL (pip's torch brings one)
[ -n "$NCCL_INCLUDE" ] || { echo "skipped: nccl.h not found (set NCCL_HOME)"; exit 77; }
out="$BUILD/nccl"
mkdir -p "$out"
[ -f ddp.h ] || { echo "FAIL: no ddp.h (make header writes it)"; exit 1; }
inc=(-I. -isystem "$CUDA_HOME/include") # CUDA's headers are not -pedantic C99: system headers
if [ "${PREBUILT:-0}" = 1 ] && nccl_env_loads "$out/test_nccl"; then
  # built on another machine (tools/gpu-check.sh --build-only there, --prebuilt here): part (1) ran there
  echo "== (1) prebuilt: $out/test_nccl ($(cat "$out/.prebuilt" 2>/dev/null || echo 'origin unknown'))"
else
  listed=$("$NVCC" --list-gpu-arch 2>/dev/null)
  gencode=() built=""
  for sm in 75 80 90; do
    if grep -qx "compute_$sm" <<<"$listed"; then gencode+=(-gencode "arch=compute_$sm,code=sm_$sm"); built="$built sm_$sm"; fi
  done
  [ ${#gencode[@]} -gt 0 ] || { echo "FAIL: this nvcc supports none of sm_75/80/90"; exit 1; }
  echo "== (1) build for:$built"
  strict=(-std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -Xptxas -Werror -I.)
  "$NVCC" "${strict[@]}" "${gencode[@]}" -c ddp_cuda.cu -o "$out/ddp_cuda.o" || { echo "FAIL: ddp_cuda.cu"; exit 1; }
  "$CC" -std=c99 -Wall -Wextra -Werror -pedantic -O2 -pthread "${inc[@]}" -DDDP_CUDA -c tests/nccl/test_nccl.c -o "$out/test_nccl.o" ||
    { echo "FAIL: tests/nccl/test_nccl.c as C99 with -DDDP_CUDA"; exit 1; }
  "$CXX" -std=c++17 -Wall -Wextra -Werror -pedantic -O2 -pthread "${inc[@]}" -DDDP_CUDA -x c++ -c tests/nccl/test_nccl.c \
    -o "$out/test_nccl_cpp.o" || { echo "FAIL: tests/nccl/test_nccl.c as C++17 with -DDDP_CUDA"; exit 1; }
  "$NVCC" "${gencode[@]}" -Xcompiler -pthread -o "$out/test_nccl" "$out/test_nccl.o" "$out/ddp_cuda.o" -lnccl -lm ||
    { echo "FAIL: linking with nvcc, ddp_cuda.o and -lnccl"; exit 1; }
  "$CC" -std=c99 -Wall -Wextra -Werror -pedantic -O2 -pthread "${inc[@]}" -DDDP_CUDA -c tests/nccl/test_nccl_ft.c \
    -o "$out/test_nccl_ft.o" && "$NVCC" "${gencode[@]}" -Xcompiler -pthread -o "$out/test_nccl_ft" "$out/test_nccl_ft.o" \
    "$out/ddp_cuda.o" -lnccl -lm || { echo "FAIL: tests/nccl/test_nccl_ft.c (C99, -DDDP_CUDA, linked with -lnccl)"; exit 1; }
  echo "test programs: C99 and C++17 with -DDDP_CUDA, linked by nvcc with ddp_cuda.o -lnccl (fault tolerance's too)"
  if ! make -s GPU=1 BUILD="$BUILD/gpu" NVCC="$NVCC" "$BUILD/gpu/train_gpu" >"$out/make_gpu.log" 2>&1; then
    cat "$out/make_gpu.log"; echo "FAIL: make GPU=1 cannot build examples/gpu/train_gpu.cu"; exit 1
  fi
  echo "make GPU=1: examples/gpu/train_gpu.cu built"
  echo "built on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), for:$built" >"$out/.prebuilt"
fi
[ "${BUILD_ONLY:-0}" = 1 ] && { echo "built (BUILD_ONLY=1: nothing run)"; exit 0; }

devices=$("$out/test_nccl" devices) || { echo "FAIL: cannot count CUDA devices"; exit 1; }
"$out/test_nccl" check || { echo "FAIL: the nccl backend's call check (cpu groups, host memory)"; exit 1; }
echo "== (2) CUDA devices visible: $devices"
if [ "$devices" = 0 ]; then
  "$out/test_nccl" nogpu || { echo "FAIL: backend nccl without a GPU"; exit 1; }
  san=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  "$CC" -std=c99 -Wall -Wextra -Werror -pedantic -O1 -g "${san[@]}" -pthread "${inc[@]}" -DDDP_CUDA -c tests/nccl/test_nccl.c \
    -o "$out/test_nccl_san.o" &&
    "$CXX" "${san[@]}" -o "$out/test_nccl_san" "$out/test_nccl_san.o" "$out/ddp_cuda.o" -L"$CUDA_HOME/lib64" -lcudart -lnccl \
      -lm -pthread || { echo "FAIL: the sanitizer build"; exit 1; }
  "$out/test_nccl_san" nogpu >/dev/null || { echo "FAIL: backend nccl without a GPU, under ASan + UBSan"; exit 1; }
  "$out/test_nccl_san" check >/dev/null || { echo "FAIL: the call check under ASan + UBSan"; exit 1; }
  echo "the same under AddressSanitizer + UBSan: ok"
  echo "SKIP-PART gpu part: no CUDA device visible (NCCL collectives on device memory not run)"
  echo "SKIP-PART fault tolerance on GPUs: no CUDA device visible (tests/nccl/test_nccl_ft.c needs 4; the harness runs it)"
  echo "ok (the GPU part did not run)"
  exit 0
fi
"$out/test_nccl" gpu 1 || { echo "FAIL: nccl with 1 rank"; exit 1; }
if [ "$devices" -ge 2 ]; then
  "$out/test_nccl" gpu 2 || { echo "FAIL: nccl with 2 ranks"; exit 1; }
else
  echo "SKIP-PART 2-GPU part: one CUDA device visible (NCCL with 2 ranks not run)"
fi
if [ "$devices" -ge 4 ]; then
  "$out/test_nccl_ft" all || { echo "FAIL: fault tolerance on the nccl backend"; exit 1; }
else
  echo "SKIP-PART fault tolerance on GPUs: $devices CUDA device(s) visible, tests/nccl/test_nccl_ft.c needs 4"
fi
echo "ok"
