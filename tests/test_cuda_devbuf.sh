#!/usr/bin/env bash
# Device buffers on the cpu backend (src/devbuf.c: staged through pinned host memory on the group's
# stream), without a GPU: ddp_cuda.cu (its staging glue) and tests/test_cuda_devbuf.cpp (the
# implementation with DDP_CUDA, and the test) built by a host C++17 compiler (-Wall -Wextra -Werror
# -pedantic) against the CUDA harness in tests/cuda_harness, whose "device" memory the host cannot touch
# and whose async copies run only when synchronised; then 2, 3 and 4 ranks over shared memory and TCP
# run every collective on device buffers against serial references. Needs neither a GPU nor the CUDA
# toolkit. SAN=1 builds and runs it under AddressSanitizer + UndefinedBehaviorSanitizer instead.
exec "$(dirname "$0")/cuda_harness/run_test.sh" test_cuda_devbuf "device buffers on the cpu backend"
