#!/usr/bin/env bash
# Checkpoints of device tensors (src/checkpoint.c: staged through pinned host memory on the group's
# stream), without a GPU: ddp_cuda.cu (its staging glue) and tests/test_cuda_checkpoint.cpp (the
# implementation with DDP_CUDA, and the test) built by a host C++17 compiler (-Wall -Wextra -Werror
# -pedantic) against the CUDA harness in tests/cuda_harness, whose "device" memory the host cannot touch
# and whose async copies run only when synchronised; then 1, 2 and 3 ranks save, save_async, load and
# shard device tensors against files saved from host memory. Needs neither a GPU nor the CUDA toolkit. SAN=1 builds and runs it under AddressSanitizer + UndefinedBehaviorSanitizer instead.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
CXX=${CXX:-g++}
out="$BUILD/cuda_harness"
mkdir -p "$out"
make -s ddp.h >/dev/null || { echo "FAIL: cannot generate ddp.h"; exit 1; } # regenerated only when src/ changed
flags=(-std=c++17 -Wall -Wextra -Werror -pedantic -I. -Itests -Itests/cuda_harness -pthread)
name=test_cuda_checkpoint opt=(-O1) lflags=()
if [ "${SAN:-0}" = 1 ]; then
  name=test_cuda_checkpoint-san
  opt=(-O1 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  lflags=("${opt[@]}")
fi
"$CXX" "${flags[@]}" "${opt[@]}" -x c++ -c ddp_cuda.cu -o "$out/ddp_cuda_$name.o" &&
  "$CXX" "${flags[@]}" "${opt[@]}" -c tests/test_cuda_checkpoint.cpp -o "$out/$name.o" &&
  "$CXX" "${lflags[@]}" -pthread "$out/ddp_cuda_$name.o" "$out/$name.o" -lm -o "$out/$name" ||
  { echo "FAIL: ddp_cuda.cu or tests/test_cuda_checkpoint.cpp does not build with $CXX and the harness"; exit 1; }
"$out/$name" || { echo "FAIL: checkpoints of device tensors"; exit 1; }
