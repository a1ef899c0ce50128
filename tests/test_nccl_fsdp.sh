#!/usr/bin/env bash
# FSDP (zero_stage 3) on the nccl backend without a GPU: tests/test_nccl_fsdp.cpp built by a host C++17
# compiler against the CUDA harness and its fake NCCL (tests/cuda_harness/nccl.h; NCCL=1), 1-4 ranks on
# backend nccl (device memory, NCCL's all-gather and reduce-scatter) against the same program on backend
# cpu and a serial model. SAN=1 builds and runs it under AddressSanitizer + UndefinedBehaviorSanitizer.
NCCL=1 exec "$(dirname "$0")/cuda_harness/run_test.sh" test_nccl_fsdp "zero_stage 3 on the nccl backend (fake NCCL)"
