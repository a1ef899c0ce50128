/* tests/cuda_harness/cuda_fp16.h — the CPU harness's stand-in for CUDA's <cuda_fp16.h>: the half types and their
   conversions are in cuda_runtime.h. */
#include "cuda_runtime.h"
