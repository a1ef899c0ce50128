/* tests/cuda_harness/cuda_runtime_api.h — the CPU harness's stand-in for CUDA's <cuda_runtime_api.h> (which C
   programs such as tests/nccl/test_nccl.c include): the runtime API is in cuda_runtime.h. */
#include "cuda_runtime.h"
