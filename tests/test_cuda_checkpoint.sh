#!/usr/bin/env bash
# Checkpoints of device tensors (src/checkpoint.c: staged through pinned host memory on the group's
# stream), without a GPU: ddp_cuda.cu (its staging glue) and tests/test_cuda_checkpoint.cpp (the
# implementation with DDP_CUDA, and the test) built by a host C++17 compiler (-Wall -Wextra -Werror
# -pedantic) against the CUDA harness in tests/cuda_harness, whose "device" memory the host cannot touch
# and whose async copies run only when synchronised; then 1, 2 and 3 ranks save, save_async, load and
# shard device tensors against files saved from host memory. Needs neither a GPU nor the CUDA toolkit. SAN=1 builds and runs it under AddressSanitizer + UndefinedBehaviorSanitizer instead.
exec "$(dirname "$0")/cuda_harness/run_test.sh" test_cuda_checkpoint "checkpoints of device tensors"
