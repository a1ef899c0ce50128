/* ddp_cuda.cu — the CUDA half of ddp.h: kernels (and, with the nccl backend, the NCCL glue) that need
   nvcc. Compile it beside your program and link both; its C entry points are declared in ddp.h when
   DDP_CUDA is defined (the [SECTION] cuda of the header; the nccl backend's private glue, which only
   the library calls, in [SECTION] cuda-glue, seen here because this file defines DDP__CUDA_GLUE):
       nvcc -O2 -c ddp_cuda.cu -o ddp_cuda.o          (with -I the folder of ddp.h)
   It includes ddp.h without DDP_IMPLEMENTATION: the library proper lives in your one implementation
   file; this file adds device code only. It refuses to build against a ddp.h of another version.

   INDEX
   [SECTION] cuda-common: version check, launches, errors, loads and stores, block reductions
   [SECTION] cuda-syncbn: SyncBatchNorm kernels and their C entry points
   [SECTION] cuda-reducer: gradient bucket copies and the inf/nan check (multi-tensor kernels)
   [SECTION] cuda-nccl: the nccl backend's communicator, collectives on a stream, events, the watchdog
   [SECTION] cuda-stage: device buffers on the cpu and mpi backends, staged through pinned host memory

   The kernels are written so that the CPU execution harness of the tests (tests/cuda_harness) runs
   their source too: every launch goes through DDP__CU_LAUNCH; blockDim, threadIdx and blockIdx are
   used plainly; __syncthreads and __shfl_down_sync only, reached by every thread of the block (warp);
   static shared memory; no cooperative groups and no atomics. */

/* [SECTION] cuda-common: version check, launches, errors, loads and stores, block reductions */
#ifndef DDP_CUDA
#define DDP_CUDA
#endif
#define DDP__CUDA_GLUE /* ddp.h's private parts this file needs: the ddp__bn_* formulas, the nccl glue */
#include "ddp.h"

#if DDP_VERSION_NUMBER != 100
#error "ddp_cuda.cu was written for ddp.h 0.1.0 (DDP_VERSION_NUMBER 100): use the ddp_cuda.cu from the same release as ddp.h"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <new>

/* DDP__CU_LAUNCH(kernel, grid, block, shmem, stream)(args...) launches a kernel: <<<>>> under nvcc;
   under a host C++ compiler with the tests' CPU harness on the include path (tests/cuda_harness), the
   harness runs it on the CPU. A template kernel of several parameters (a comma in its name) is launched
   through a function pointer. */
#if defined(__CUDACC__)
#define DDP__CU_LAUNCH(kernel, grid, block, shmem, stream) kernel<<<grid, block, shmem, stream>>>
#elif defined(DDP_CUDA_HARNESS)
#define DDP__CU_LAUNCH(kernel, grid, block, shmem, stream) ddp_harness::launch(kernel, grid, block, shmem, stream)
#else
#error "ddp_cuda.cu is compiled by nvcc (or, in the tests, by a host compiler with -Itests/cuda_harness)"
#endif

#define DDP__CU_THREADS 256  /* threads of 1-D blocks */
#define DDP__CU_WARP 32
#define DDP__CU_ROWS_Y 8     /* channels-last reductions: blocks of 32 channels x 8 rows */
#define DDP__CU_MAX_SPLITS 32 /* blocks per channel in the reductions; DDP_CUDA_BN_WORK_FLOATS holds 3 each */
#ifndef DDP__CU_MAX_GRID
#define DDP__CU_MAX_GRID 8192 /* blocks of the grid-stride loops (the harness tests lower it to make them loop) */
#endif

/* Errors go to the caller's buffer: a->err (a: ddp_cuda_bn_args or ddp_cuda_grads_args). */
template <typename Args>
static ddp_result ddp__cu_fail(const Args *a, ddp_result code, const char *fmt, ...) {
    va_list ap;
    if (!a || !a->err || a->err_size == 0) return code;
    va_start(ap, fmt);
    vsnprintf(a->err, a->err_size, fmt, ap);
    va_end(ap);
    return code;
}

/* After launches: report what CUDA said about them (the launch only; the kernels run later). */
template <typename Args>
static ddp_result ddp__cu_launched(const Args *a, const char *fn) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return DDP_SUCCESS;
    return ddp__cu_fail(a, DDP_ERR_SYSTEM, "%s: kernel launch failed: %s (%s)", fn, cudaGetErrorString(e),
                        cudaGetErrorName(e));
}

/* Elements are computed in f32 (f64 for f64 data); loads widen, stores round to nearest even. */
__device__ __forceinline__ float ddp__cu_load(const float *p) { return *p; }
__device__ __forceinline__ double ddp__cu_load(const double *p) { return *p; }
__device__ __forceinline__ float ddp__cu_load(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float ddp__cu_load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void ddp__cu_store(float *p, float v) { *p = v; }
__device__ __forceinline__ void ddp__cu_store(double *p, double v) { *p = v; }
__device__ __forceinline__ void ddp__cu_store(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void ddp__cu_store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

/* The value type of loads and stores of T: float, or double for double. */
template <typename T>
struct ddp__cu_value {
    typedef float type;
};
template <>
struct ddp__cu_value<double> {
    typedef double type;
};

/* Welford triples (count, mean, M2) of a warp merged into lane 0 (tree order: lane 0 only ever reads
   lanes that hold their own subtree). */
__device__ __forceinline__ void ddp__cu_warp_merge(float *n, float *mean, float *m2) {
    for (int offset = DDP__CU_WARP / 2; offset > 0; offset /= 2) {
        float nb = __shfl_down_sync(0xffffffffu, *n, offset);
        float mb = __shfl_down_sync(0xffffffffu, *mean, offset);
        float m2b = __shfl_down_sync(0xffffffffu, *m2, offset);
        ddp__bn_merge_f32(n, mean, m2, nb, mb, m2b);
    }
}

/* The same for two plain sums. */
__device__ __forceinline__ void ddp__cu_warp_sum2(float *a, float *b) {
    for (int offset = DDP__CU_WARP / 2; offset > 0; offset /= 2) {
        *a += __shfl_down_sync(0xffffffffu, *a, offset);
        *b += __shfl_down_sync(0xffffffffu, *b, offset);
    }
}

/* Welford triples of a 1-D block of DDP__CU_THREADS threads merged into thread 0. */
__device__ void ddp__cu_block_merge(float *n, float *mean, float *m2) {
    __shared__ float s_n[DDP__CU_THREADS / DDP__CU_WARP], s_mean[DDP__CU_THREADS / DDP__CU_WARP],
        s_m2[DDP__CU_THREADS / DDP__CU_WARP];
    const int lane = threadIdx.x % DDP__CU_WARP, warp = threadIdx.x / DDP__CU_WARP;
    ddp__cu_warp_merge(n, mean, m2);
    if (lane == 0) {
        s_n[warp] = *n;
        s_mean[warp] = *mean;
        s_m2[warp] = *m2;
    }
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < DDP__CU_THREADS / DDP__CU_WARP;
        *n = has ? s_n[lane] : 0.0f;
        *mean = has ? s_mean[lane] : 0.0f;
        *m2 = has ? s_m2[lane] : 0.0f;
        ddp__cu_warp_merge(n, mean, m2);
    }
}

/* Two sums of a 1-D block of DDP__CU_THREADS threads into thread 0. */
__device__ void ddp__cu_block_sum2(float *a, float *b) {
    __shared__ float s_a[DDP__CU_THREADS / DDP__CU_WARP], s_b[DDP__CU_THREADS / DDP__CU_WARP];
    const int lane = threadIdx.x % DDP__CU_WARP, warp = threadIdx.x / DDP__CU_WARP;
    ddp__cu_warp_sum2(a, b);
    if (lane == 0) {
        s_a[warp] = *a;
        s_b[warp] = *b;
    }
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < DDP__CU_THREADS / DDP__CU_WARP;
        *a = has ? s_a[lane] : 0.0f;
        *b = has ? s_b[lane] : 0.0f;
        ddp__cu_warp_sum2(a, b);
    }
}

/* [SECTION] cuda-syncbn: SyncBatchNorm kernels and their C entry points
   Mirrors torch's CUDA SyncBatchNorm (aten/src/ATen/native/cuda/Normalization.cuh); the formulas are the
   DDP_HOST_DEVICE helpers of src/bn_math.h, shared with the CPU code.
   Reductions (statistics, backward sums) run in two kernels with no atomics: a grid of
   (channels, splits) blocks each reduces its share of a channel to a partial in `work`, then one thread
   per channel merges that channel's partials in a fixed order (deterministic) and writes f64.
     channels-first (spatial > 1): block (256) = one channel, a range of samples; thread j walks
                                   the range's values of the channel j, j+256, ...
     channels-last (or spatial 1): block (32 x 8) = 32 neighbouring channels (coalesced rows), rows
                                   strided by 8 x splits; the 8 row-threads are merged through shared memory
   Per-thread statistics are f32 Welford (as torch's); partials merge with Chan's formula in f64.
   Element-wise kernels are grid-stride loops. */

/* Channels-first with spatial > 1 is the only layout whose channel is not the fastest index. */
static bool ddp__cu_planar(const ddp_cuda_bn_args *a) { return !a->channels_last && a->spatial > 1; }

/* Blocks per channel of a reduction over `values` values of each channel, at most `limit` (>= 1). */
static int ddp__cu_splits(int64_t values, int64_t limit) {
    int64_t s = values / (16 * DDP__CU_THREADS); /* at least ~16 values per thread */
    if (s > DDP__CU_MAX_SPLITS) s = DDP__CU_MAX_SPLITS;
    if (s > limit) s = limit;
    return s < 1 ? 1 : (int)s;
}

static unsigned ddp__cu_grid_1d(int64_t total) {
    int64_t blocks = (total + DDP__CU_THREADS - 1) / DDP__CU_THREADS;
    return (unsigned)(blocks < 1 ? 1 : blocks > DDP__CU_MAX_GRID ? DDP__CU_MAX_GRID : blocks);
}

/* Position (c, s) of value i = (q * C + c) * S + s (any q), kept up to date along a grid-stride loop
   i += step with no division per step (64-bit division would dominate these memory-bound loops).
   The channels-last layout (and spatial 1) is S = 1. */
struct ddp__cu_channel_walk {
    int64_t s, S, ds;
    int c, C, dc;
};

__device__ __forceinline__ void ddp__cu_walk_init(ddp__cu_channel_walk *w, int64_t i, int64_t step, int64_t S, int C) {
    w->S = S;
    w->C = C;
    w->s = i % S;
    w->c = (int)((i / S) % C);
    w->ds = step % S;
    w->dc = (int)((step / S) % C);
}

__device__ __forceinline__ void ddp__cu_walk_next(ddp__cu_channel_walk *w) {
    w->s += w->ds;
    w->c += w->dc;
    if (w->s >= w->S) {
        w->s -= w->S;
        w->c++;
    }
    if (w->c >= w->C) w->c -= w->C; /* c < 2C here */
}

/* Sample n (from 0) and position s of the j-th value of one channel in a channels-first batch
   (j = n * S + s), along j += step with no division per step. */
struct ddp__cu_plane_walk {
    int64_t n, s, S, dn, ds;
};

__device__ __forceinline__ void ddp__cu_plane_init(ddp__cu_plane_walk *w, int64_t j, int64_t step, int64_t S) {
    w->S = S;
    w->n = j / S;
    w->s = j % S;
    w->dn = step / S;
    w->ds = step % S;
}

__device__ __forceinline__ void ddp__cu_plane_next(ddp__cu_plane_walk *w) {
    w->s += w->ds;
    w->n += w->dn;
    if (w->s >= w->S) {
        w->s -= w->S;
        w->n++;
    }
}

/* ---- statistics ---- */

template <typename T>
__global__ void ddp__cu_bn_stats_planar(const T *x, int64_t batch, int64_t spatial, int channels, float *work) {
    const int c = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int64_t n0 = batch * split / splits, n1 = batch * (split + 1) / splits, m = (n1 - n0) * spatial;
    float n = 0.0f, mean = 0.0f, m2 = 0.0f;
    ddp__cu_plane_walk w;
    ddp__cu_plane_init(&w, threadIdx.x, blockDim.x, spatial);
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x, ddp__cu_plane_next(&w))
        ddp__bn_welford_add(&n, &mean, &m2, ddp__cu_load(x + ((n0 + w.n) * channels + c) * spatial + w.s));
    ddp__cu_block_merge(&n, &mean, &m2);
    if (threadIdx.x == 0) {
        float *w = work + ((int64_t)c * splits + split) * 3;
        w[0] = n;
        w[1] = mean;
        w[2] = m2;
    }
}

template <typename T>
__global__ void ddp__cu_bn_stats_rows(const T *x, int64_t rows, int channels, float *work) {
    __shared__ float s_n[DDP__CU_ROWS_Y][DDP__CU_WARP], s_mean[DDP__CU_ROWS_Y][DDP__CU_WARP],
        s_m2[DDP__CU_ROWS_Y][DDP__CU_WARP];
    const int c = blockIdx.x * DDP__CU_WARP + threadIdx.x, split = blockIdx.y, splits = gridDim.y;
    float n = 0.0f, mean = 0.0f, m2 = 0.0f;
    if (c < channels)
        for (int64_t r = (int64_t)split * DDP__CU_ROWS_Y + threadIdx.y; r < rows; r += (int64_t)splits * DDP__CU_ROWS_Y)
            ddp__bn_welford_add(&n, &mean, &m2, ddp__cu_load(x + r * channels + c));
    s_n[threadIdx.y][threadIdx.x] = n;
    s_mean[threadIdx.y][threadIdx.x] = mean;
    s_m2[threadIdx.y][threadIdx.x] = m2;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        float *w = work + ((int64_t)c * splits + split) * 3;
        for (int k = 1; k < DDP__CU_ROWS_Y; k++)
            ddp__bn_merge_f32(&n, &mean, &m2, s_n[k][threadIdx.x], s_mean[k][threadIdx.x], s_m2[k][threadIdx.x]);
        w[0] = n;
        w[1] = mean;
        w[2] = m2;
    }
}

/* record <- [mean(C), M2(C), count]: channel c's `splits` partials merged in order. */
__global__ void ddp__cu_bn_stats_finish(const float *work, int splits, int channels, double count, double *record) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    double n = 0.0, mean = 0.0, m2 = 0.0;
    if (c >= channels) return;
    for (int s = 0; s < splits; s++) {
        const float *w = work + ((int64_t)c * splits + s) * 3;
        ddp__bn_merge(&n, &mean, &m2, (double)w[0], (double)w[1], (double)w[2]);
    }
    record[c] = mean;
    record[channels + c] = m2;
    if (c == 0) record[2 * channels] = count;
}

/* ---- merge over ranks, running stats, eval statistics ---- */

__global__ void ddp__cu_bn_gather(const double *records, int nranks, int channels, double eps, double factor,
                                  float *running_mean, float *running_var, float *mean_out, float *invstd_out,
                                  double *count_out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    double n, mean, m2;
    if (c >= channels) return;
    ddp__bn_merge_ranks(records, nranks, channels, c, &n, &mean, &m2);
    mean_out[c] = (float)mean;
    invstd_out[c] = n > 0 ? (float)(1.0 / sqrt(m2 / n + eps)) : 0.0f;
    if (running_mean && running_var && n >= 2)
        ddp__bn_update_running(&running_mean[c], &running_var[c], mean, m2, n, factor);
    if (c == 0) *count_out = n;
}

__global__ void ddp__cu_bn_eval_stats(const float *running_mean, const float *running_var, int channels, double eps,
                                      float *mean, float *invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    mean[c] = running_mean[c];
    invstd[c] = (float)(1.0 / sqrt((double)running_var[c] + eps));
}

/* ---- element-wise ---- */

template <typename T>
__global__ void ddp__cu_bn_elemt(const T *x, T *y, int64_t total, int64_t spatial, int channels, int planar,
                                 const float *weight, const float *bias, const float *mean, const float *invstd) {
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
    ddp__cu_channel_walk w;
    ddp__cu_walk_init(&w, first, step, planar ? spatial : 1, channels);
    for (int64_t i = first; i < total; i += step, ddp__cu_walk_next(&w)) {
        const int c = w.c;
        const float scale = invstd[c] * (weight ? weight[c] : 1.0f), shift = bias ? bias[c] : 0.0f;
        ddp__cu_store(y + i, ddp__bn_normalize(ddp__cu_load(x + i), mean[c], scale, shift));
    }
}

/* ---- backward ---- */

template <typename T>
__global__ void ddp__cu_bn_bwd_planar(const T *dy, const T *x, int64_t batch, int64_t spatial, int channels,
                                      const float *mean, float *work) {
    const int c = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int64_t n0 = batch * split / splits, n1 = batch * (split + 1) / splits, m = (n1 - n0) * spatial;
    const float mu = mean[c];
    float sum_dy = 0.0f, sum_dy_xmu = 0.0f;
    ddp__cu_plane_walk w;
    ddp__cu_plane_init(&w, threadIdx.x, blockDim.x, spatial);
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x, ddp__cu_plane_next(&w)) {
        const int64_t k = ((n0 + w.n) * channels + c) * spatial + w.s;
        const float g = ddp__cu_load(dy + k);
        sum_dy += g;
        sum_dy_xmu += g * (ddp__cu_load(x + k) - mu);
    }
    ddp__cu_block_sum2(&sum_dy, &sum_dy_xmu);
    if (threadIdx.x == 0) {
        float *w = work + ((int64_t)c * splits + split) * 3;
        w[0] = sum_dy;
        w[1] = sum_dy_xmu;
    }
}

template <typename T>
__global__ void ddp__cu_bn_bwd_rows(const T *dy, const T *x, int64_t rows, int channels, const float *mean,
                                    float *work) {
    __shared__ float s_a[DDP__CU_ROWS_Y][DDP__CU_WARP], s_b[DDP__CU_ROWS_Y][DDP__CU_WARP];
    const int c = blockIdx.x * DDP__CU_WARP + threadIdx.x, split = blockIdx.y, splits = gridDim.y;
    float sum_dy = 0.0f, sum_dy_xmu = 0.0f;
    if (c < channels) {
        const float mu = mean[c];
        for (int64_t r = (int64_t)split * DDP__CU_ROWS_Y + threadIdx.y; r < rows; r += (int64_t)splits * DDP__CU_ROWS_Y) {
            const float g = ddp__cu_load(dy + r * channels + c);
            sum_dy += g;
            sum_dy_xmu += g * (ddp__cu_load(x + r * channels + c) - mu);
        }
    }
    s_a[threadIdx.y][threadIdx.x] = sum_dy;
    s_b[threadIdx.y][threadIdx.x] = sum_dy_xmu;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        float *w = work + ((int64_t)c * splits + split) * 3;
        for (int k = 1; k < DDP__CU_ROWS_Y; k++) {
            sum_dy += s_a[k][threadIdx.x];
            sum_dy_xmu += s_b[k][threadIdx.x];
        }
        w[0] = sum_dy;
        w[1] = sum_dy_xmu;
    }
}

/* sums <- the partials' totals; the parameters' local gradients accumulate. */
__global__ void ddp__cu_bn_bwd_finish(const float *work, int splits, int channels, const float *invstd, double *sums,
                                      float *grad_weight, float *grad_bias) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    double sum_dy = 0.0, sum_dy_xmu = 0.0;
    if (c >= channels) return;
    for (int s = 0; s < splits; s++) {
        const float *w = work + ((int64_t)c * splits + s) * 3;
        sum_dy += (double)w[0];
        sum_dy_xmu += (double)w[1];
    }
    sums[c] = sum_dy;
    sums[channels + c] = sum_dy_xmu;
    if (grad_weight) grad_weight[c] += (float)(sum_dy_xmu * (double)invstd[c]);
    if (grad_bias) grad_bias[c] += (float)sum_dy;
}

/* work <- [mean_dy(C), proj(C), scale(C)]; sums NULL: eval (the statistics were constants). */
__global__ void ddp__cu_bn_bwd_coeffs(const double *sums, const double *count, int channels, const float *weight,
                                      const float *invstd, float *work) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    float w;
    if (c >= channels) return;
    w = weight ? weight[c] : 1.0f;
    if (sums && *count > 0) {
        ddp__bn_backward_coeffs(sums[c], sums[channels + c], *count, invstd[c], w, &work[c], &work[channels + c],
                                &work[2 * channels + c]);
    } else {
        work[c] = 0.0f;
        work[channels + c] = 0.0f;
        work[2 * channels + c] = invstd[c] * w;
    }
}

template <typename T>
__global__ void ddp__cu_bn_bwd_elemt(const T *dy, const T *x, T *dx, int64_t total, int64_t spatial, int channels,
                                     int planar, const float *mean, const float *coeffs) {
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
    ddp__cu_channel_walk w;
    ddp__cu_walk_init(&w, first, step, planar ? spatial : 1, channels);
    for (int64_t i = first; i < total; i += step, ddp__cu_walk_next(&w)) {
        const int c = w.c;
        const float g = ddp__cu_load(dy + i), v = ddp__cu_load(x + i);
        ddp__cu_store(dx + i, ddp__bn_grad_input(g, v, mean[c], coeffs[c], coeffs[channels + c],
                                                 coeffs[2 * channels + c]));
    }
}

/* ---- host side ---- */

/* Argument checks shared by the entry points; *total receives batch * spatial * C. */
static ddp_result ddp__cu_check(const ddp_cuda_bn_args *a, const char *fn, bool data, int64_t *total) {
    if (!a) return DDP_ERR_INVALID_ARGUMENT;
    if (a->channels <= 0)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: channels is %d; give C > 0", fn, a->channels);
    *total = 0;
    if (!data) return DDP_SUCCESS;
    if (a->dtype != DDP_DTYPE_DEFAULT && a->dtype != DDP_F32 && a->dtype != DDP_F16 && a->dtype != DDP_BF16)
        return ddp__cu_fail(a, DDP_ERR_UNSUPPORTED, "%s: dtype %d; SyncBatchNorm data is DDP_F32, DDP_F16 or DDP_BF16",
                            fn, (int)a->dtype);
    if (a->batch < 0 || a->spatial < 0 ||
        (a->spatial > 0 && a->batch > INT64_MAX / a->spatial / a->channels))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: batch=%lld, spatial=%lld, C=%d: not a valid size", fn,
                            (long long)a->batch, (long long)a->spatial, a->channels);
    *total = a->batch * a->spatial * a->channels;
    return DDP_SUCCESS;
}

static unsigned ddp__cu_channel_blocks(int channels) { return (unsigned)((channels + DDP__CU_THREADS - 1) / DDP__CU_THREADS); }

/* The channels-last reductions' grid: blocks of 32 channels x splits. */
static dim3 ddp__cu_rows_grid(int channels, int splits) {
    return dim3((unsigned)((channels + DDP__CU_WARP - 1) / DDP__CU_WARP), (unsigned)splits);
}

template <typename T>
static void ddp__cu_launch_stats(const ddp_cuda_bn_args *a, const T *x, float *work, double *record) {
    cudaStream_t st = (cudaStream_t)a->stream;
    const int64_t rows = a->batch * a->spatial;
    int splits = 0;
    if (rows > 0 && ddp__cu_planar(a)) {
        splits = ddp__cu_splits(rows, a->batch);
        DDP__CU_LAUNCH(ddp__cu_bn_stats_planar<T>, dim3((unsigned)a->channels, (unsigned)splits), DDP__CU_THREADS, 0, st)(
            x, a->batch, a->spatial, a->channels, work);
    } else if (rows > 0) {
        splits = ddp__cu_splits(rows, (rows + DDP__CU_ROWS_Y - 1) / DDP__CU_ROWS_Y);
        DDP__CU_LAUNCH(ddp__cu_bn_stats_rows<T>, ddp__cu_rows_grid(a->channels, splits), dim3(DDP__CU_WARP, DDP__CU_ROWS_Y),
                       0, st)(x, rows, a->channels, work);
    }
    DDP__CU_LAUNCH(ddp__cu_bn_stats_finish, ddp__cu_channel_blocks(a->channels), DDP__CU_THREADS, 0, st)(
        work, splits, a->channels, (double)rows, record);
}

template <typename T>
static void ddp__cu_launch_elemt(const ddp_cuda_bn_args *a, int64_t total, const T *x, T *y, const float *weight,
                                 const float *bias, const float *mean, const float *invstd) {
    if (total == 0) return;
    DDP__CU_LAUNCH(ddp__cu_bn_elemt<T>, ddp__cu_grid_1d(total), DDP__CU_THREADS, 0, (cudaStream_t)a->stream)(
        x, y, total, a->spatial, a->channels, ddp__cu_planar(a), weight, bias, mean, invstd);
}

template <typename T>
static void ddp__cu_launch_backward_reduce(const ddp_cuda_bn_args *a, const T *dy, const T *x, const float *mean,
                                           const float *invstd, float *work, double *sums, float *grad_weight,
                                           float *grad_bias) {
    cudaStream_t st = (cudaStream_t)a->stream;
    const int64_t rows = a->batch * a->spatial;
    int splits = 0;
    if (rows > 0 && ddp__cu_planar(a)) {
        splits = ddp__cu_splits(rows, a->batch);
        DDP__CU_LAUNCH(ddp__cu_bn_bwd_planar<T>, dim3((unsigned)a->channels, (unsigned)splits), DDP__CU_THREADS, 0, st)(
            dy, x, a->batch, a->spatial, a->channels, mean, work);
    } else if (rows > 0) {
        splits = ddp__cu_splits(rows, (rows + DDP__CU_ROWS_Y - 1) / DDP__CU_ROWS_Y);
        DDP__CU_LAUNCH(ddp__cu_bn_bwd_rows<T>, ddp__cu_rows_grid(a->channels, splits), dim3(DDP__CU_WARP, DDP__CU_ROWS_Y), 0,
                       st)(dy, x, rows, a->channels, mean, work);
    }
    DDP__CU_LAUNCH(ddp__cu_bn_bwd_finish, ddp__cu_channel_blocks(a->channels), DDP__CU_THREADS, 0, st)(
        work, splits, a->channels, invstd, sums, grad_weight, grad_bias);
}

template <typename T>
static void ddp__cu_launch_backward_elemt(const ddp_cuda_bn_args *a, int64_t total, const T *dy, const T *x, T *dx,
                                          const float *weight, const float *mean, const float *invstd,
                                          const double *sums, const double *count, float *work) {
    cudaStream_t st = (cudaStream_t)a->stream;
    if (total == 0) return;
    DDP__CU_LAUNCH(ddp__cu_bn_bwd_coeffs, ddp__cu_channel_blocks(a->channels), DDP__CU_THREADS, 0, st)(
        sums, count, a->channels, weight, invstd, work);
    DDP__CU_LAUNCH(ddp__cu_bn_bwd_elemt<T>, ddp__cu_grid_1d(total), DDP__CU_THREADS, 0, st)(
        dy, x, dx, total, a->spatial, a->channels, ddp__cu_planar(a), mean, work);
}

extern "C" {

DDP_API ddp_result ddp_cuda_bn_stats(const ddp_cuda_bn_args *a, const void *x, float *work, double *record) {
    const char *fn = "ddp_cuda_bn_stats";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, true, &total);
    if (r != DDP_SUCCESS) return r;
    if ((total > 0 && !x) || !work || !record)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !record ? "record" : !work ? "work" : "x");
    switch (a->dtype) {
    case DDP_F16: ddp__cu_launch_stats(a, (const __half *)x, work, record); break;
    case DDP_BF16: ddp__cu_launch_stats(a, (const __nv_bfloat16 *)x, work, record); break;
    default: ddp__cu_launch_stats(a, (const float *)x, work, record); break;
    }
    return ddp__cu_launched(a, fn);
}

DDP_API ddp_result ddp_cuda_bn_gather_stats(const ddp_cuda_bn_args *a, const double *records, int nranks, double eps,
                                            double factor, float *running_mean, float *running_var, float *mean,
                                            float *invstd, double *count) {
    const char *fn = "ddp_cuda_bn_gather_stats";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, false, &total);
    if (r != DDP_SUCCESS) return r;
    if (!records || !mean || !invstd || !count || nranks < 1 || !(eps > 0) || !(factor >= 0 && factor <= 1) ||
        (!running_mean) != (!running_var))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT,
                            "%s: need records, mean, invstd and count, nranks >= 1 (%d), eps > 0 (%g), factor in "
                            "[0, 1] (%g), and running_mean and running_var both or neither",
                            fn, nranks, eps, factor);
    DDP__CU_LAUNCH(ddp__cu_bn_gather, ddp__cu_channel_blocks(a->channels), DDP__CU_THREADS, 0, (cudaStream_t)a->stream)(
        records, nranks, a->channels, eps, factor, running_mean, running_var, mean, invstd, count);
    return ddp__cu_launched(a, fn);
}

DDP_API ddp_result ddp_cuda_bn_eval_stats(const ddp_cuda_bn_args *a, const float *running_mean,
                                          const float *running_var, double eps, float *mean, float *invstd) {
    const char *fn = "ddp_cuda_bn_eval_stats";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, false, &total);
    if (r != DDP_SUCCESS) return r;
    if (!running_mean || !running_var || !mean || !invstd || !(eps > 0))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT,
                            "%s: need running_mean, running_var, mean and invstd, and eps > 0 (%g)", fn, eps);
    DDP__CU_LAUNCH(ddp__cu_bn_eval_stats, ddp__cu_channel_blocks(a->channels), DDP__CU_THREADS, 0, (cudaStream_t)a->stream)(
        running_mean, running_var, a->channels, eps, mean, invstd);
    return ddp__cu_launched(a, fn);
}

DDP_API ddp_result ddp_cuda_bn_elemt(const ddp_cuda_bn_args *a, const void *x, void *y, const float *weight,
                                     const float *bias, const float *mean, const float *invstd) {
    const char *fn = "ddp_cuda_bn_elemt";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, true, &total);
    if (r != DDP_SUCCESS) return r;
    if (total > 0 && (!x || !y || !mean || !invstd))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: x, y, mean and invstd are needed", fn);
    switch (a->dtype) {
    case DDP_F16: ddp__cu_launch_elemt(a, total, (const __half *)x, (__half *)y, weight, bias, mean, invstd); break;
    case DDP_BF16:
        ddp__cu_launch_elemt(a, total, (const __nv_bfloat16 *)x, (__nv_bfloat16 *)y, weight, bias, mean, invstd);
        break;
    default: ddp__cu_launch_elemt(a, total, (const float *)x, (float *)y, weight, bias, mean, invstd); break;
    }
    return ddp__cu_launched(a, fn);
}

DDP_API ddp_result ddp_cuda_bn_backward_reduce(const ddp_cuda_bn_args *a, const void *dy, const void *x,
                                               const float *mean, const float *invstd, float *work, double *sums,
                                               float *grad_weight, float *grad_bias) {
    const char *fn = "ddp_cuda_bn_backward_reduce";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, true, &total);
    if (r != DDP_SUCCESS) return r;
    if ((total > 0 && (!dy || !x)) || !mean || !invstd || !work || !sums)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: dy, x, mean, invstd, work and sums are needed", fn);
    switch (a->dtype) {
    case DDP_F16:
        ddp__cu_launch_backward_reduce(a, (const __half *)dy, (const __half *)x, mean, invstd, work, sums, grad_weight,
                                       grad_bias);
        break;
    case DDP_BF16:
        ddp__cu_launch_backward_reduce(a, (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)x, mean, invstd, work,
                                       sums, grad_weight, grad_bias);
        break;
    default:
        ddp__cu_launch_backward_reduce(a, (const float *)dy, (const float *)x, mean, invstd, work, sums, grad_weight,
                                       grad_bias);
        break;
    }
    return ddp__cu_launched(a, fn);
}

DDP_API ddp_result ddp_cuda_bn_backward_elemt(const ddp_cuda_bn_args *a, const void *dy, const void *x, void *dx,
                                              const float *weight, const float *mean, const float *invstd,
                                              const double *sums, const double *count, float *work) {
    const char *fn = "ddp_cuda_bn_backward_elemt";
    int64_t total;
    ddp_result r = ddp__cu_check(a, fn, true, &total);
    if (r != DDP_SUCCESS) return r;
    if (total > 0 && (!dy || !x || !dx || !mean || !invstd || !work || (sums && !count)))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT,
                            "%s: dy, x, dx, mean, invstd and work are needed (and count with sums)", fn);
    switch (a->dtype) {
    case DDP_F16:
        ddp__cu_launch_backward_elemt(a, total, (const __half *)dy, (const __half *)x, (__half *)dx, weight, mean,
                                      invstd, sums, count, work);
        break;
    case DDP_BF16:
        ddp__cu_launch_backward_elemt(a, total, (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)x,
                                      (__nv_bfloat16 *)dx, weight, mean, invstd, sums, count, work);
        break;
    default:
        ddp__cu_launch_backward_elemt(a, total, (const float *)dy, (const float *)x, (float *)dx, weight, mean, invstd,
                                      sums, count, work);
        break;
    }
    return ddp__cu_launched(a, fn);
}

} /* extern "C" */

/* ---- SyncBatchNorm on device memory (gpucheck): the device path of ddp_syncbn_forward/backward ----
   The sequence of torch's SyncBatchNorm on CUDA (see src/cuda_glue.h), every step queued on b->a.stream;
   the exchange (the group's collective) is the caller's. */

extern "C" {

DDP_API ddp_result ddp__cuda_bn_forward(ddp__cuda_bn *b, int mode, const void *x, void *y, double factor) {
    ddp_result r;
    const int C = b->a.channels;
    if (mode == DDP__CUDA_BN_EVAL) {
        r = ddp_cuda_bn_eval_stats(&b->a, b->running_mean, b->running_var, b->eps, b->mean, b->invstd);
    } else {
        const int synced = mode == DDP__CUDA_BN_SYNCED && b->nranks > 1;
        double *mine = b->records + (synced ? (int64_t)b->rank * (2 * C + 1) : 0);
        r = ddp_cuda_bn_stats(&b->a, x, b->work, mine);
        if (r == DDP_SUCCESS && synced) r = b->exchange(b->user, DDP__CUDA_BN_GATHER, b->records, (size_t)(2 * C + 1));
        if (r == DDP_SUCCESS)
            r = ddp_cuda_bn_gather_stats(&b->a, b->records, synced ? b->nranks : 1, b->eps, factor, b->running_mean,
                                         b->running_var, b->mean, b->invstd, b->count);
    }
    if (r != DDP_SUCCESS) return r;
    return ddp_cuda_bn_elemt(&b->a, x, y, b->weight, b->bias, b->mean, b->invstd);
}

DDP_API ddp_result ddp__cuda_bn_backward(ddp__cuda_bn *b, int mode, const void *dy, const void *x, void *dx,
                                        float *grad_weight, float *grad_bias) {
    ddp_result r = DDP_SUCCESS;
    const int eval = mode == DDP__CUDA_BN_EVAL;
    if (!eval || grad_weight || grad_bias)
        r = ddp_cuda_bn_backward_reduce(&b->a, dy, x, b->mean, b->invstd, b->work, b->sums, grad_weight, grad_bias);
    if (r == DDP_SUCCESS && mode == DDP__CUDA_BN_SYNCED && b->nranks > 1)
        r = b->exchange(b->user, DDP__CUDA_BN_REDUCE, b->sums, 2 * (size_t)b->a.channels);
    if (r != DDP_SUCCESS || !dx) return r;
    return ddp_cuda_bn_backward_elemt(&b->a, dy, x, dx, b->weight, b->mean, b->invstd, eval ? NULL : b->sums, b->count,
                                      b->work);
}

} /* extern "C" */

/* [SECTION] cuda-reducer: gradient bucket copies and the inf/nan check (multi-tensor kernels)
   Mirrors the device side of torch's DDP Reducer (torch/csrc/distributed/c10d/reducer.cpp: a ready
   gradient is copied into its bucket view and divided by the world size, the bucket is copied back
   after the all-reduce), its fp16/bf16 compression hooks (cast the bucket, all-reduce, cast back) and
   the GradScaler's _amp_foreach_non_finite_check_and_unscale_ (aten/src/ATen/native/cuda/AmpKernels.cu).

   Multi-tensor launches, as torch's multi_tensor_apply: the caller's list of tensors is cut into
   launches of up to DDP__CU_MT_TENSORS tensors, each described by a table passed by value as the
   kernel argument (1.5 KiB, under the 4 KiB limit of kernel arguments): no device memory, no copy to
   the device, no synchronisation. Each tensor is cut into chunks of DDP__CU_MT_CHUNK elements; the table
   holds the prefix sums of the chunk counts, so a block finds its tensor by binary search and walks the
   chunk with its threads (a grid-stride loop over chunks when there are more than DDP__CU_MAX_GRID).

       tensors   [ g0: 3 chunks ][ g1: 1 ][ g2: 2 ]        first_chunk = {0, 3, 4}, chunks = 6
       blocks      0  1  2         3       4  5            block 4: largest k with first_chunk[k] <= 4: g2 */

#define DDP__CU_MT_TENSORS 48
/* 1024 elements: 4 per thread of a block, so a 1 MiB f32 gradient is 256 blocks. With 4096 (64 blocks on an
   H200's 132 multiprocessors) one such copy took 8.4-9.4 us (ncu), ~230 GB/s, and a reducer step of 64 of
   them was almost all of it (docs/GPU.md). */
#define DDP__CU_MT_CHUNK 1024

struct ddp__cu_mt_table {
    int count;                               /* tensors, all of them non-empty */
    int64_t chunks;                          /* in all */
    void *ptr[DDP__CU_MT_TENSORS];           /* device; NULL: a parameter without gradient */
    int64_t numel[DDP__CU_MT_TENSORS];
    int64_t offset[DDP__CU_MT_TENSORS];      /* of the tensor in the bucket, in elements */
    int64_t first_chunk[DDP__CU_MT_TENSORS]; /* chunks of the tensors before it */
};

/* The tensor of a chunk: the last whose first chunk is <= chunk. */
__device__ __forceinline__ int ddp__cu_mt_find(const ddp__cu_mt_table &t, int64_t chunk) {
    int lo = 0, hi = t.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (t.first_chunk[mid] <= chunk)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The arithmetic of a copy between dtypes G and B: f32, or f64 when either is f64 (as the CPU reducer). */
template <typename G, typename B>
struct ddp__cu_acc {
    typedef float type;
};
template <typename B>
struct ddp__cu_acc<double, B> {
    typedef double type;
};
template <typename G>
struct ddp__cu_acc<G, double> {
    typedef double type;
};
template <>
struct ddp__cu_acc<double, double> {
    typedef double type;
};

/* Rounded to B (through f32 for f16/bf16, as the CPU reducer), then stored. */
template <typename B, typename A>
__device__ __forceinline__ void ddp__cu_put(B *p, A v) {
    ddp__cu_store(p, (typename ddp__cu_value<B>::type)v);
}

/* bucket[offset + i] = grad[i] * scale (0 for a tensor without gradient). */
template <typename G, typename B>
__global__ void ddp__cu_bucket_in(ddp__cu_mt_table t, B *bucket, double scale) {
    typedef typename ddp__cu_acc<G, B>::type A;
    const A s = (A)scale;
    for (int64_t chunk = blockIdx.x; chunk < t.chunks; chunk += gridDim.x) {
        const int k = ddp__cu_mt_find(t, chunk);
        const int64_t begin = (chunk - t.first_chunk[k]) * DDP__CU_MT_CHUNK;
        const int64_t end = t.numel[k] - begin < DDP__CU_MT_CHUNK ? t.numel[k] : begin + DDP__CU_MT_CHUNK;
        const G *g = (const G *)t.ptr[k];
        B *dst = bucket + t.offset[k];
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
            ddp__cu_put(dst + i, g ? (A)ddp__cu_load(g + i) * s : (A)0);
    }
}

/* grad[i] = bucket[offset + i] * scale, or with Add grad[i] += bucket[offset + i] * scale, the sum in the
   copy's arithmetic rounded once to G (as the CPU reducer's add; tensors without gradient are skipped). */
template <typename G, typename B, bool Add>
__global__ void ddp__cu_bucket_out(ddp__cu_mt_table t, const B *bucket, double scale) {
    typedef typename ddp__cu_acc<G, B>::type A;
    const A s = (A)scale;
    for (int64_t chunk = blockIdx.x; chunk < t.chunks; chunk += gridDim.x) {
        const int k = ddp__cu_mt_find(t, chunk);
        const int64_t begin = (chunk - t.first_chunk[k]) * DDP__CU_MT_CHUNK;
        const int64_t end = t.numel[k] - begin < DDP__CU_MT_CHUNK ? t.numel[k] : begin + DDP__CU_MT_CHUNK;
        G *g = (G *)t.ptr[k];
        const B *src = bucket + t.offset[k];
        if (!g) continue;
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
            ddp__cu_put(g + i, Add ? (A)ddp__cu_load(g + i) + (A)ddp__cu_load(src + i) * s : (A)ddp__cu_load(src + i) * s);
    }
}

/* NaN compares false, infinities exceed the largest finite value. */
__device__ __forceinline__ bool ddp__cu_finite(float v) { return fabsf(v) <= FLT_MAX; }
__device__ __forceinline__ bool ddp__cu_finite(double v) { return fabs(v) <= DBL_MAX; }

/* grad *= inv_scale in place; *found_inf = 1 when some element is not finite (torch's functor: every
   thread that sees one writes the same 1.0, so the race is harmless; the flag is never cleared here). */
template <typename G>
__global__ void ddp__cu_unscale(ddp__cu_mt_table t, float *found_inf, const float *inv_scale) {
    typedef typename ddp__cu_value<G>::type A;
    const float s = *inv_scale;
    for (int64_t chunk = blockIdx.x; chunk < t.chunks; chunk += gridDim.x) {
        const int k = ddp__cu_mt_find(t, chunk);
        const int64_t begin = (chunk - t.first_chunk[k]) * DDP__CU_MT_CHUNK;
        const int64_t end = t.numel[k] - begin < DDP__CU_MT_CHUNK ? t.numel[k] : begin + DDP__CU_MT_CHUNK;
        G *g = (G *)t.ptr[k];
        if (!g) continue;
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const A v = ddp__cu_load(g + i);
            if (!ddp__cu_finite(v)) *found_inf = 1.0f;
            ddp__cu_store(g + i, s == 1.0f ? v : v * (A)s);
        }
    }
}

/* ---- host side ---- */

/* DDP_DTYPE_DEFAULT (a zeroed field) is DDP_F32, which the switches below handle as their default case. */
static bool ddp__cu_float_dtype(ddp_dtype t) {
    return t == DDP_DTYPE_DEFAULT || t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16;
}

/* Argument checks of the tensor list; *packed receives the sum of the counts (checked against overflow). */
static ddp_result ddp__cu_check_grads(const ddp_cuda_grads_args *a, const char *fn, int64_t *packed) {
    if (!a) return DDP_ERR_INVALID_ARGUMENT;
    *packed = 0;
    if (a->count < 0) return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: count is %d; give count >= 0", fn, a->count);
    if (a->count > 0 && (!a->grads || !a->numels))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with count %d", fn, !a->grads ? "grads" : "numels",
                            a->count);
    if (!ddp__cu_float_dtype(a->dtype))
        return ddp__cu_fail(a, DDP_ERR_UNSUPPORTED, "%s: dtype %d; gradients are DDP_F32, DDP_F64, DDP_F16 or DDP_BF16", fn,
                            (int)a->dtype);
    for (int i = 0; i < a->count; i++) {
        if (a->numels[i] < 0 || a->numels[i] > INT64_MAX - *packed)
            return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: numels[%d] is %lld; give counts >= 0", fn, i,
                                (long long)a->numels[i]);
        *packed += a->numels[i];
    }
    return DDP_SUCCESS;
}

/* The checks of the bucket side of a copy: every tensor's slot lies inside the bucket. */
static ddp_result ddp__cu_check_bucket(const ddp_cuda_grads_args *a, const char *fn, const void *bucket,
                                       ddp_dtype bucket_dtype, int64_t bucket_numel, const int64_t *offsets,
                                       double scale, int64_t packed) {
    if (!ddp__cu_float_dtype(bucket_dtype))
        return ddp__cu_fail(a, DDP_ERR_UNSUPPORTED, "%s: bucket_dtype %d; buckets are DDP_F32, DDP_F64, DDP_F16 or DDP_BF16",
                            fn, (int)bucket_dtype);
    if (!(fabs(scale) <= DBL_MAX))
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: scale is %g; give a finite factor", fn, scale);
    if (bucket_numel < 0)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: bucket_numel is %lld; give the bucket's size", fn,
                            (long long)bucket_numel);
    if (packed > 0 && !bucket) return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: bucket is NULL", fn);
    if (!offsets && packed > bucket_numel)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: the tensors hold %lld elements, the bucket %lld", fn,
                            (long long)packed, (long long)bucket_numel);
    for (int i = 0; offsets && i < a->count; i++)
        if (offsets[i] < 0 || bucket_numel < a->numels[i] || offsets[i] > bucket_numel - a->numels[i])
            return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT,
                                "%s: tensor %d (%lld elements at offset %lld) does not fit in the bucket of %lld elements",
                                fn, i, (long long)a->numels[i], (long long)offsets[i], (long long)bucket_numel);
    return DDP_SUCCESS;
}

/* Call launch(table) for each launch's share of the non-empty tensors (offsets NULL: packed in order). */
template <typename Launch>
static void ddp__cu_mt_launches(const ddp_cuda_grads_args *a, const int64_t *offsets, Launch launch) {
    ddp__cu_mt_table t;
    int64_t packed = 0;
    memset(&t, 0, sizeof t);
    for (int i = 0; i < a->count; i++) {
        const int64_t n = a->numels[i], offset = offsets ? offsets[i] : packed;
        packed += n;
        if (n == 0) continue;
        t.ptr[t.count] = a->grads[i];
        t.numel[t.count] = n;
        t.offset[t.count] = offset;
        t.first_chunk[t.count] = t.chunks;
        t.chunks += (n + DDP__CU_MT_CHUNK - 1) / DDP__CU_MT_CHUNK;
        if (++t.count < DDP__CU_MT_TENSORS) continue;
        launch(t);
        memset(&t, 0, sizeof t);
    }
    if (t.count) launch(t);
}

static unsigned ddp__cu_mt_grid(const ddp__cu_mt_table &t) {
    return (unsigned)(t.chunks < DDP__CU_MAX_GRID ? t.chunks : DDP__CU_MAX_GRID);
}

/* The directions of a bucket copy: into the bucket, out of it, or out of it added to the tensors. */
enum ddp__cu_copy_dir { DDP__CU_IN, DDP__CU_OUT, DDP__CU_ADD };

template <typename G, typename B>
static void ddp__cu_launch_bucket(const ddp_cuda_grads_args *a, const int64_t *offsets, void *bucket, double scale,
                                  ddp__cu_copy_dir dir) {
    cudaStream_t st = (cudaStream_t)a->stream;
    void (*const copy_in)(ddp__cu_mt_table, B *, double) = ddp__cu_bucket_in<G, B>;
    void (*const copy_out)(ddp__cu_mt_table, const B *, double) =
        dir == DDP__CU_ADD ? ddp__cu_bucket_out<G, B, true> : ddp__cu_bucket_out<G, B, false>;
    ddp__cu_mt_launches(a, offsets, [&](const ddp__cu_mt_table &t) {
        if (dir == DDP__CU_IN)
            DDP__CU_LAUNCH(copy_in, ddp__cu_mt_grid(t), DDP__CU_THREADS, 0, st)(t, (B *)bucket, scale);
        else
            DDP__CU_LAUNCH(copy_out, ddp__cu_mt_grid(t), DDP__CU_THREADS, 0, st)(t, (const B *)bucket, scale);
    });
}

template <typename G>
static void ddp__cu_launch_bucket_to(const ddp_cuda_grads_args *a, const int64_t *offsets, void *bucket,
                                     ddp_dtype bucket_dtype, double scale, ddp__cu_copy_dir dir) {
    switch (bucket_dtype) {
    case DDP_F64: ddp__cu_launch_bucket<G, double>(a, offsets, bucket, scale, dir); break;
    case DDP_F16: ddp__cu_launch_bucket<G, __half>(a, offsets, bucket, scale, dir); break;
    case DDP_BF16: ddp__cu_launch_bucket<G, __nv_bfloat16>(a, offsets, bucket, scale, dir); break;
    default: ddp__cu_launch_bucket<G, float>(a, offsets, bucket, scale, dir); break;
    }
}

/* Both directions of the bucket copy: checks, then the launches for the gradients' dtype. */
static ddp_result ddp__cu_bucket_copy(const ddp_cuda_grads_args *a, const char *fn, void *bucket, ddp_dtype bucket_dtype,
                                      int64_t bucket_numel, const int64_t *offsets, double scale, ddp__cu_copy_dir dir) {
    int64_t packed;
    ddp_result r = ddp__cu_check_grads(a, fn, &packed);
    if (r != DDP_SUCCESS) return r;
    r = ddp__cu_check_bucket(a, fn, bucket, bucket_dtype, bucket_numel, offsets, scale, packed);
    if (r != DDP_SUCCESS) return r;
    if (bucket_dtype == DDP_DTYPE_DEFAULT) bucket_dtype = a->dtype;
    switch (a->dtype) {
    case DDP_F64: ddp__cu_launch_bucket_to<double>(a, offsets, bucket, bucket_dtype, scale, dir); break;
    case DDP_F16: ddp__cu_launch_bucket_to<__half>(a, offsets, bucket, bucket_dtype, scale, dir); break;
    case DDP_BF16: ddp__cu_launch_bucket_to<__nv_bfloat16>(a, offsets, bucket, bucket_dtype, scale, dir); break;
    default: ddp__cu_launch_bucket_to<float>(a, offsets, bucket, bucket_dtype, scale, dir); break;
    }
    return ddp__cu_launched(a, fn);
}

template <typename G>
static void ddp__cu_launch_unscale(const ddp_cuda_grads_args *a, float *found_inf, const float *inv_scale) {
    cudaStream_t st = (cudaStream_t)a->stream;
    ddp__cu_mt_launches(a, NULL, [&](const ddp__cu_mt_table &t) {
        DDP__CU_LAUNCH(ddp__cu_unscale<G>, ddp__cu_mt_grid(t), DDP__CU_THREADS, 0, st)(t, found_inf, inv_scale);
    });
}

extern "C" {

DDP_API ddp_result ddp_cuda_bucket_copy_in(const ddp_cuda_grads_args *a, void *bucket, ddp_dtype bucket_dtype,
                                           int64_t bucket_numel, const int64_t *offsets, double scale) {
    return ddp__cu_bucket_copy(a, "ddp_cuda_bucket_copy_in", bucket, bucket_dtype, bucket_numel, offsets, scale, DDP__CU_IN);
}

DDP_API ddp_result ddp_cuda_bucket_copy_out(const ddp_cuda_grads_args *a, const void *bucket, ddp_dtype bucket_dtype,
                                            int64_t bucket_numel, const int64_t *offsets, double scale) {
    return ddp__cu_bucket_copy(a, "ddp_cuda_bucket_copy_out", (void *)bucket, bucket_dtype, bucket_numel, offsets, scale,
                               DDP__CU_OUT);
}

DDP_API ddp_result ddp__cuda_bucket_add(const ddp_cuda_grads_args *a, const void *bucket, ddp_dtype bucket_dtype,
                                       int64_t bucket_numel, const int64_t *offsets) {
    return ddp__cu_bucket_copy(a, "ddp__cuda_bucket_add", (void *)bucket, bucket_dtype, bucket_numel, offsets, 1.0, DDP__CU_ADD);
}

DDP_API ddp_result ddp_cuda_non_finite_check_and_unscale(const ddp_cuda_grads_args *a, float *found_inf,
                                                         const float *inv_scale) {
    const char *fn = "ddp_cuda_non_finite_check_and_unscale";
    int64_t packed;
    ddp_result r = ddp__cu_check_grads(a, fn, &packed);
    if (r != DDP_SUCCESS) return r;
    if (!found_inf || !inv_scale)
        return ddp__cu_fail(a, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !found_inf ? "found_inf" : "inv_scale");
    switch (a->dtype) {
    case DDP_F64: ddp__cu_launch_unscale<double>(a, found_inf, inv_scale); break;
    case DDP_F16: ddp__cu_launch_unscale<__half>(a, found_inf, inv_scale); break;
    case DDP_BF16: ddp__cu_launch_unscale<__nv_bfloat16>(a, found_inf, inv_scale); break;
    default: ddp__cu_launch_unscale<float>(a, found_inf, inv_scale); break;
    }
    return ddp__cu_launched(a, fn);
}

} /* extern "C" */

/* [SECTION] cuda-nccl: the nccl backend's communicator, collectives on a stream, events, the watchdog
   (torch's ProcessGroupNCCL: one communicator per group, work ordered on a CUDA stream, completion seen
   through CUDA events, a watchdog that aborts the communicator on an error or a timeout).

   A collective is queued on the group's stream (ncclAllReduce ... ) and a CUDA event is recorded after
   it; waiting polls the event. NCCL calls on a healthy communicator return as soon as the work is queued,
   so a rank whose peers never make the matching call would wait for ever: while it polls, the waiting
   thread checks ncclCommGetAsyncError (network failures, a peer's abort), the deadline, and the other
   ranks' TCP connections (ddp.h's watch callback: a peer that failed tells everyone); any of these
   aborts the communicator (ncclCommAbort kills its kernels, so the stream moves on) and the error names
   the operation and its sequence number. Blocking communicators (NCCL's default mode); the other
   ranks' readiness is agreed over ddp.h's TCP connections before ncclCommInitRank, so a rank without a
   GPU fails every rank quickly instead of leaving them in ncclCommInitRank. */
#if !defined(DDP_CUDA_HARNESS) || defined(DDP_HARNESS_NCCL) /* the tests' CPU harness: with its fake NCCL only */
#include <nccl.h>
#include <time.h>

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "ddp_cuda.cu needs NCCL 2.10 or newer (ncclAvg, ncclBfloat16)"
#endif

/* What this NCCL line offers fault tolerance (src/nccl.c, "fault tolerance"): ncclCommShrink (2.27) makes
   the survivors' communicator from the old one without a new unique id; ncclCommRevoke (2.28) stops a
   failed communicator's in-flight work while keeping it for the shrink. Older lines abort and re-init. */
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0) /* ncclConfig_t: non-blocking communicators */
#define DDP__CU_CAN_CONFIG 1
#else
#define DDP__CU_CAN_CONFIG 0
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define DDP__CU_CAN_SHRINK 1
#else
#define DDP__CU_CAN_SHRINK 0
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define DDP__CU_CAN_REVOKE 1
#else
#define DDP__CU_CAN_REVOKE 0
#endif

struct ddp__cuda_nccl {
    ncclComm_t comm; /* NULL once aborted */
    int device, rank, nranks;
    cudaStream_t stream;
    float *one;     /* the barrier's element */
    bool ft;        /* fault-tolerant: a non-blocking communicator, kept after a failure where it can be shrunk */
    bool failed;    /* kept after a failure (ft): refuses work; ncclCommShrink or ncclCommAbort ends it */
    double timeout; /* ft: how long a non-blocking call may stay in progress */
};

/* The event of one queued operation and when it was queued (the watchdog's deadline counts from it). */
struct ddp__cu_event {
    cudaEvent_t ev;
    double queued;
};

/* Where messages go: ddp__cu_fail writes to any struct with err and err_size. */
struct ddp__cu_msg {
    char *err;
    size_t err_size;
};

static double ddp__cu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void ddp__cu_sleep(double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}

/* Makes c's device current for the scope of a call and gives the caller's back afterwards. */
struct ddp__cu_device_scope {
    int saved;
    bool changed;
    explicit ddp__cu_device_scope(int device) : saved(-1), changed(false) {
        if (cudaGetDevice(&saved) == cudaSuccess && saved != device) changed = cudaSetDevice(device) == cudaSuccess;
    }
    ~ddp__cu_device_scope() {
        if (changed) cudaSetDevice(saved);
    }
};

static ncclDataType_t ddp__cu_nccl_type(ddp_dtype t, bool *ok) {
    *ok = true;
    switch (t) {
    case DDP_F32: return ncclFloat32;
    case DDP_F64: return ncclFloat64;
    case DDP_F16: return ncclFloat16;
    case DDP_BF16: return ncclBfloat16;
    case DDP_I8: return ncclInt8;
    case DDP_U8: return ncclUint8;
    case DDP_I32: return ncclInt32;
    case DDP_I64: return ncclInt64;
    default: *ok = false; return ncclFloat32;
    }
}

/* Bytes per element (ddp_dtype_size lives in the program's implementation file: not linked here). */
static size_t ddp__cu_dtype_size(ddp_dtype t) {
    switch (t) {
    case DDP_F64:
    case DDP_I64: return 8;
    case DDP_F32:
    case DDP_I32: return 4;
    case DDP_F16:
    case DDP_BF16: return 2;
    default: return 1;
    }
}

static ncclRedOp_t ddp__cu_nccl_op(ddp_op op, bool *ok) {
    *ok = true;
    switch (op) {
    case DDP_SUM: return ncclSum;
    case DDP_AVG: return ncclAvg;
    case DDP_PROD: return ncclProd;
    case DDP_MIN: return ncclMin;
    case DDP_MAX: return ncclMax;
    default: *ok = false; return ncclSum;
    }
}

/* After an error: abort the communicator so that no operation of it can block anyone again. */
static void ddp__cu_nccl_abort(ddp__cuda_nccl *c) {
    if (!c->comm) return;
    ncclCommAbort(c->comm);
    c->comm = NULL;
}

/* A non-blocking communicator's call (ft) may answer ncclInProgress: it is done when ncclCommGetAsyncError
   says so. Waits for that, at most c->timeout seconds (then ncclSystemError, and the caller aborts). */
static ncclResult_t ddp__cu_nccl_settle(ddp__cuda_nccl *c, ncclResult_t rc) {
    double deadline = ddp__cu_now() + c->timeout, nap = 1e-6;
    while (rc == ncclInProgress && c->comm) {
        if (ncclCommGetAsyncError(c->comm, &rc) != ncclSuccess) return ncclSystemError;
        if (rc != ncclInProgress) break;
        if (ddp__cu_now() > deadline) return ncclSystemError;
        ddp__cu_sleep(nap);
        nap = nap < 1e-3 ? nap * 2 : 1e-3;
    }
    return rc;
}

/* After an error: no operation of c may block anyone again. Aborted, unless c is fault-tolerant and this
   NCCL can shrink it: then it is kept (failed) for ncclCommShrink, revoked first where NCCL can (its
   in-flight work stops; 2.27 leaves that to the shrink's NCCL_SHRINK_ABORT). */
static void ddp__cu_nccl_stop(ddp__cuda_nccl *c) {
    if (!c->comm || c->failed) return;
#if DDP__CU_CAN_SHRINK
    if (c->ft) {
        c->failed = true;
#if DDP__CU_CAN_REVOKE
        if (ddp__cu_nccl_settle(c, ncclCommRevoke(c->comm, NCCL_REVOKE_DEFAULT)) != ncclSuccess) ddp__cu_nccl_abort(c);
#endif
        return;
    }
#endif
    ddp__cu_nccl_abort(c);
}

/* What an NCCL failure is: a remote process gone or a network error is a lost peer, the rest a system error. */
static ddp_result ddp__cu_nccl_code(ncclResult_t rc) { return rc == ncclRemoteError ? DDP_ERR_PEER_LOST : DDP_ERR_SYSTEM; }

/* An NCCL call failed: the message (with NCCL's last error text) and the abort. */
static ddp_result ddp__cu_nccl_failed(ddp__cuda_nccl *c, const ddp__cu_msg *m, ncclResult_t rc, const char *call) {
    const char *detail = c->comm ? ncclGetLastError(c->comm) : "";
    ddp_result code = ddp__cu_nccl_code(rc);
    ddp__cu_fail(m, code, "%s failed: %s%s%s; the NCCL communicator was stopped", call, ncclGetErrorString(rc),
                 detail && *detail ? ": " : "", detail ? detail : "");
    ddp__cu_nccl_stop(c);
    return code;
}

/* ---- data movement (gather, scatter, all_to_all, all_to_all_v, all_gather_v), as torch's
   ProcessGroupNCCL moves it: every block between two ranks is one ncclSend matched by one ncclRecv,
   all of a call's between ncclGroupStart and ncclGroupEnd (NCCL then runs them together, so no order
   of the pairs can deadlock); the rank's own block is a device-to-device copy queued on the stream
   before the group. Blocks move as bytes (ncclUint8): no dtype matters for a copy. Zero-sized blocks
   move nothing on either side (torch skips them too; the sizes were checked to match over TCP first,
   so both sides skip the same pairs). ---- */

/* The first failure of a run of queued calls; later calls are skipped. */
struct ddp__cu_moves {
    ddp__cuda_nccl *c;
    ncclResult_t rc;
};

static void ddp__cu_move_self(ddp__cu_moves *mv, void *dst, const void *src, size_t bytes) {
    if (mv->rc != ncclSuccess || !bytes || dst == src) return;
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, mv->c->stream) != cudaSuccess)
        mv->rc = ncclUnhandledCudaError;
}

static void ddp__cu_move_send(ddp__cu_moves *mv, const void *src, size_t bytes, int peer) {
    if (mv->rc == ncclSuccess && bytes) mv->rc = ncclSend(src, bytes, ncclUint8, peer, mv->c->comm, mv->c->stream);
}

static void ddp__cu_move_recv(ddp__cu_moves *mv, void *dst, size_t bytes, int peer) {
    if (mv->rc == ncclSuccess && bytes) mv->rc = ncclRecv(dst, bytes, ncclUint8, peer, mv->c->comm, mv->c->stream);
}

static void ddp__cu_group_start(ddp__cu_moves *mv) {
    if (mv->rc == ncclSuccess) mv->rc = ncclGroupStart();
}

/* Closes the group even after a failed call inside it (NCCL wants every ncclGroupStart ended). */
static void ddp__cu_group_end(ddp__cu_moves *mv, bool started) {
    ncclResult_t rc;
    if (!started) return;
    rc = ncclGroupEnd();
    if (mv->rc == ncclSuccess) mv->rc = rc;
}

/* gather, scatter, all_to_all: blocks of `bytes` per rank. all_to_all in place (send overlapping recv)
   sends from a stream-ordered copy of send, freed on the stream after the group. */
static ncclResult_t ddp__cu_nccl_blocks(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, void *recv, size_t bytes,
                                        int root) {
    ddp__cu_moves mv = {c, ncclSuccess};
    const char *from = (const char *)send;
    char *to = (char *)recv, *copy = NULL;
    int me = c->rank, n = c->nranks, p;
    bool started;
    size_t all = bytes * (size_t)n;
    if (kind == DDP__CUDA_ALL_TO_ALL && all && from < to + all && to < from + all) {
        if (cudaMallocAsync((void **)&copy, all, c->stream) != cudaSuccess ||
            cudaMemcpyAsync(copy, send, all, cudaMemcpyDeviceToDevice, c->stream) != cudaSuccess) {
            if (copy) cudaFreeAsync(copy, c->stream);
            return ncclUnhandledCudaError;
        }
        from = copy;
    }
    if (kind == DDP__CUDA_GATHER && me == root) ddp__cu_move_self(&mv, to + (size_t)me * bytes, from, bytes);
    if (kind == DDP__CUDA_SCATTER && me == root) ddp__cu_move_self(&mv, to, from + (size_t)me * bytes, bytes);
    if (kind == DDP__CUDA_ALL_TO_ALL) ddp__cu_move_self(&mv, to + (size_t)me * bytes, from + (size_t)me * bytes, bytes);
    ddp__cu_group_start(&mv);
    started = mv.rc == ncclSuccess;
    if (kind == DDP__CUDA_GATHER && me != root) ddp__cu_move_send(&mv, from, bytes, root);
    if (kind == DDP__CUDA_SCATTER && me != root) ddp__cu_move_recv(&mv, to, bytes, root);
    for (p = 0; p < n; p++) {
        if (p == me) continue;
        if (kind == DDP__CUDA_GATHER && me == root) ddp__cu_move_recv(&mv, to + (size_t)p * bytes, bytes, p);
        if (kind == DDP__CUDA_SCATTER && me == root) ddp__cu_move_send(&mv, from + (size_t)p * bytes, bytes, p);
        if (kind == DDP__CUDA_ALL_TO_ALL) {
            ddp__cu_move_send(&mv, from + (size_t)p * bytes, bytes, p);
            ddp__cu_move_recv(&mv, to + (size_t)p * bytes, bytes, p);
        }
    }
    ddp__cu_group_end(&mv, started);
    if (copy && cudaFreeAsync(copy, c->stream) != cudaSuccess && mv.rc == ncclSuccess) mv.rc = ncclUnhandledCudaError;
    return mv.rc;
}

/* all_to_all_v and all_gather_v: blocks of the given sizes (elements of es bytes), packed in rank order. */
static ncclResult_t ddp__cu_nccl_blocks_v(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, const size_t *send_counts,
                                          void *recv, const size_t *recv_counts, size_t es) {
    ddp__cu_moves mv = {c, ncclSuccess};
    const char *from = (const char *)send;
    char *to = (char *)recv;
    int me = c->rank, n = c->nranks, p;
    size_t *at = new (std::nothrow) size_t[2 * ((size_t)n + 1)], *send_at, *recv_at;
    bool started;
    if (!at) return ncclSystemError;
    send_at = at, recv_at = at + n + 1;
    send_at[0] = recv_at[0] = 0;
    for (p = 0; p < n; p++) {
        send_at[p + 1] = send_at[p] + (kind == DDP__CUDA_ALL_TO_ALL_V ? send_counts[p] : 0);
        recv_at[p + 1] = recv_at[p] + recv_counts[p];
    }
    if (kind == DDP__CUDA_ALL_TO_ALL_V)
        ddp__cu_move_self(&mv, to + recv_at[me] * es, from + send_at[me] * es, send_counts[me] * es);
    else
        ddp__cu_move_self(&mv, to + recv_at[me] * es, from, recv_counts[me] * es); /* in place: the same address */
    ddp__cu_group_start(&mv);
    started = mv.rc == ncclSuccess;
    for (p = 0; p < n; p++) {
        if (p == me) continue;
        if (kind == DDP__CUDA_ALL_TO_ALL_V) ddp__cu_move_send(&mv, from + send_at[p] * es, send_counts[p] * es, p);
        else ddp__cu_move_send(&mv, from, recv_counts[me] * es, p); /* all_gather_v: this rank's block to everyone */
        ddp__cu_move_recv(&mv, to + recv_at[p] * es, recv_counts[p] * es, p);
    }
    ddp__cu_group_end(&mv, started);
    delete[] at;
    return mv.rc;
}

/* Queue the collective itself. */
static ncclResult_t ddp__cu_nccl_call(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, void *recv, size_t count,
                                      ncclDataType_t type, ncclRedOp_t op, int root, size_t es) {
    char *mine;
    switch (kind) {
    case DDP__CUDA_ALL_REDUCE: return ncclAllReduce(recv, recv, count, type, op, c->comm, c->stream);
    case DDP__CUDA_BROADCAST: return ncclBroadcast(recv, recv, count, type, root, c->comm, c->stream);
    case DDP__CUDA_REDUCE: return ncclReduce(recv, recv, count, type, op, root, c->comm, c->stream);
    case DDP__CUDA_ALL_GATHER:
        /* NCCL's in-place form is send == this rank's slice of recv; any other send is copied there first
           (send == recv, allowed by ddp.h, does not overlap the slice of a rank other than 0) */
        mine = (char *)recv + (size_t)c->rank * count * es;
        if (send != mine && count &&
            cudaMemcpyAsync(mine, send, count * es, cudaMemcpyDeviceToDevice, c->stream) != cudaSuccess)
            return ncclUnhandledCudaError;
        return ncclAllGather(mine, recv, count, type, c->comm, c->stream);
    case DDP__CUDA_REDUCE_SCATTER:
        /* recv == send (allowed by ddp.h) would overlap the ranks' input: reduce into this rank's slice of
           send (NCCL's in-place form), then move it to the front */
        if (send == recv && c->rank > 0) {
            ncclResult_t rc;
            mine = (char *)recv + (size_t)c->rank * count * es;
            rc = ncclReduceScatter(send, mine, count, type, op, c->comm, c->stream);
            if (rc == ncclSuccess && count &&
                cudaMemcpyAsync(recv, mine, count * es, cudaMemcpyDeviceToDevice, c->stream) != cudaSuccess)
                return ncclUnhandledCudaError;
            return rc;
        }
        return ncclReduceScatter(send, recv, count, type, op, c->comm, c->stream);
    case DDP__CUDA_GATHER:
    case DDP__CUDA_SCATTER:
    case DDP__CUDA_ALL_TO_ALL: return ddp__cu_nccl_blocks(c, kind, send, recv, count * es, root);
    default: return ncclAllReduce(c->one, c->one, 1, ncclFloat32, ncclSum, c->comm, c->stream);
    }
}

/* An event recorded on c's stream now. */
static ddp_result ddp__cu_record(ddp__cuda_nccl *c, const ddp__cu_msg *m, void **event) {
    ddp__cu_event *e = new (std::nothrow) ddp__cu_event;
    cudaError_t ce;
    if (!e) return ddp__cu_fail(m, DDP_ERR_OUT_OF_MEMORY, "out of memory for a CUDA event");
    if ((ce = cudaEventCreateWithFlags(&e->ev, cudaEventDisableTiming)) != cudaSuccess) {
        delete e;
        return ddp__cu_fail(m, DDP_ERR_SYSTEM, "cudaEventCreateWithFlags failed: %s", cudaGetErrorString(ce));
    }
    if ((ce = cudaEventRecord(e->ev, c->stream)) != cudaSuccess) {
        cudaEventDestroy(e->ev);
        delete e;
        return ddp__cu_fail(m, DDP_ERR_SYSTEM, "cudaEventRecord failed: %s", cudaGetErrorString(ce));
    }
    e->queued = ddp__cu_now();
    *event = e;
    return DDP_SUCCESS;
}

/* After queueing (rc: how it went): the event, or the failure (the communicator is then aborted). */
static ddp_result ddp__cu_queued(ddp__cuda_nccl *c, const ddp__cu_msg *m, ncclResult_t rc, void **event) {
    if (rc == ncclInProgress) rc = ddp__cu_nccl_settle(c, rc); /* non-blocking (ft): queued once it settles */
    if (rc != ncclSuccess) return ddp__cu_nccl_failed(c, m, rc, "queueing the NCCL collective");
    if (ddp__cu_record(c, m, event) != DDP_SUCCESS) {
        ddp__cu_nccl_stop(c); /* the collective is queued but cannot be waited for: nobody may rely on it */
        return DDP_ERR_SYSTEM;
    }
    return DDP_SUCCESS;
}

extern "C" {

DDP_API ddp_result ddp__cuda_nccl_device(int local_rank, int *device, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    int n = 0, d;
    cudaError_t ce = cudaGetDeviceCount(&n);
    if (ce != cudaSuccess || n <= 0) {
        cudaGetLastError(); /* not sticky: clear it */
        return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "no CUDA device visible (cudaGetDeviceCount = 0): use the cpu backend "
                            "(backend \"cpu\" or DDP_BACKEND=cpu). CUDA said: %s (%s); check the driver and "
                            "CUDA_VISIBLE_DEVICES", cudaGetErrorName(ce), cudaGetErrorString(ce));
    }
    if (local_rank < 0) local_rank = 0;
    if (local_rank < n) d = local_rank;
    else if (n == 1) d = 0;
    else
        return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "local rank %d has no GPU of its own: %d CUDA devices are visible "
                            "(cudaGetDeviceCount = %d); start at most %d ranks per host, or give each rank one device "
                            "with CUDA_VISIBLE_DEVICES", local_rank, n, n, n);
    if ((ce = cudaSetDevice(d)) != cudaSuccess)
        return ddp__cu_fail(&m, DDP_ERR_SYSTEM, "cudaSetDevice(%d) failed: %s (%s)", d, cudaGetErrorName(ce),
                            cudaGetErrorString(ce));
    *device = d;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp__cuda_nccl_unique_id(unsigned char *id, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    ncclUniqueId u;
    ncclResult_t rc;
    static_assert(sizeof(ncclUniqueId) == DDP__CUDA_NCCL_ID_BYTES, "ncclUniqueId is not DDP__CUDA_NCCL_ID_BYTES bytes");
    if (!id) return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_unique_id: id is NULL");
    if ((rc = ncclGetUniqueId(&u)) != ncclSuccess)
        return ddp__cu_fail(&m, DDP_ERR_SYSTEM, "ncclGetUniqueId failed: %s", ncclGetErrorString(rc));
    memcpy(id, &u, sizeof u);
    return DDP_SUCCESS;
}

/* A communicator's host side, before NCCL makes it: device, rank, the barrier's element. */
static ddp_result ddp__cu_nccl_new(const ddp__cu_msg *m, int rank, int nranks, int device, int fault_tolerant,
                                   double timeout, ddp__cuda_nccl **out) {
    ddp__cuda_nccl *c;
    cudaError_t ce;
    if (!(*out = c = new (std::nothrow) ddp__cuda_nccl))
        return ddp__cu_fail(m, DDP_ERR_OUT_OF_MEMORY, "out of memory for an NCCL communicator");
    c->comm = NULL;
    c->device = device;
    c->rank = rank;
    c->nranks = nranks;
    c->stream = NULL;
    c->one = NULL;
    c->ft = fault_tolerant != 0;
    c->failed = false;
    c->timeout = timeout > 0 ? timeout : 600;
    if ((ce = cudaMalloc((void **)&c->one, sizeof(float))) != cudaSuccess ||
        (ce = cudaMemset(c->one, 0, sizeof(float))) != cudaSuccess) {
        cudaFree(c->one);
        delete c;
        *out = NULL;
        return ddp__cu_fail(m, DDP_ERR_SYSTEM, "cudaMalloc of 4 bytes on device %d failed: %s", device, cudaGetErrorString(ce));
    }
    return DDP_SUCCESS;
}

/* NCCL could not make c's communicator: c goes, with the message. */
static ddp_result ddp__cu_nccl_unmade(ddp__cuda_nccl *c, const ddp__cu_msg *m, ncclResult_t rc, const char *call) {
    ddp_result code = ddp__cu_nccl_code(rc);
    ddp__cu_fail(m, code, "%s(rank %d of %d, device %d) failed: %s%s", call, c->rank, c->nranks, c->device,
                 ncclGetErrorString(rc), rc == ncclSystemError && c->ft ? " (or it stayed in progress past the timeout)" : "");
    if (c->comm) ncclCommAbort(c->comm);
    cudaFree(c->one);
    delete c;
    return code;
}

DDP_API ddp_result ddp__cuda_nccl_create(const unsigned char *id, int rank, int nranks, int device, int fault_tolerant,
                                        double timeout, ddp__cuda_nccl **out, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    ncclUniqueId u;
    ncclResult_t rc;
    ddp_result r;
    ddp__cuda_nccl *c;
    if (!id || !out || nranks < 1 || rank < 0 || rank >= nranks || device < 0)
        return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_create: bad arguments (rank %d of %d, device %d)",
                            rank, nranks, device);
    *out = NULL;
    ddp__cu_device_scope scope(device);
    if ((r = ddp__cu_nccl_new(&m, rank, nranks, device, fault_tolerant, timeout, &c)) != DDP_SUCCESS) return r;
    memcpy(&u, id, sizeof u);
#if DDP__CU_CAN_CONFIG
    if (c->ft) { /* non-blocking: a member lost while it forms cannot hold the others past the timeout */
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        rc = ddp__cu_nccl_settle(c, ncclCommInitRankConfig(&c->comm, nranks, u, rank, &config));
        if (rc != ncclSuccess) return ddp__cu_nccl_unmade(c, &m, rc, "ncclCommInitRankConfig");
        *out = c;
        return DDP_SUCCESS;
    }
#endif
    if ((rc = ncclCommInitRank(&c->comm, nranks, u, rank)) != ncclSuccess) return ddp__cu_nccl_unmade(c, &m, rc, "ncclCommInitRank");
    *out = c;
    return DDP_SUCCESS;
}

DDP_API int ddp__cuda_nccl_can_shrink(const ddp__cuda_nccl *c) { return DDP__CU_CAN_SHRINK && c && c->comm && c->ft; }

DDP_API ddp_result ddp__cuda_nccl_shrink(ddp__cuda_nccl *parent, const int *exclude, int nexclude, ddp__cuda_nccl **out,
                                        char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    if (!parent || !out || nexclude < 0 || nexclude >= parent->nranks)
        return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_shrink: bad arguments");
    *out = NULL;
#if DDP__CU_CAN_SHRINK
    {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        int below = 0, i;
        ncclResult_t rc;
        ddp_result r;
        ddp__cuda_nccl *c;
        if (!parent->comm) return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "the old NCCL communicator was aborted: nothing to shrink");
        for (i = 0; i < nexclude; i++) below += exclude[i] < parent->rank;
        ddp__cu_device_scope scope(parent->device);
        if ((r = ddp__cu_nccl_new(&m, parent->rank - below, parent->nranks - nexclude, parent->device, parent->ft,
                                  parent->timeout, &c)) != DDP_SUCCESS)
            return r;
        config.blocking = 0;
        /* a revoked parent is quiescent (ddp__cu_nccl_stop); otherwise the shrink stops its work first */
        rc = ncclCommShrink(parent->comm, const_cast<int *>(exclude), nexclude, &c->comm, &config,
                            parent->failed && DDP__CU_CAN_REVOKE ? NCCL_SHRINK_DEFAULT : NCCL_SHRINK_ABORT);
        if ((rc = ddp__cu_nccl_settle(c, rc)) != ncclSuccess) return ddp__cu_nccl_unmade(c, &m, rc, "ncclCommShrink");
        c->stream = parent->stream;
        *out = c;
        return DDP_SUCCESS;
    }
#else
    (void)exclude;
    return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "NCCL %d.%d has no ncclCommShrink (2.27 or newer)", NCCL_MAJOR, NCCL_MINOR);
#endif
}

DDP_API void ddp__cuda_nccl_destroy(ddp__cuda_nccl *c, int abort) {
    if (!c) return;
    {
        ddp__cu_device_scope scope(c->device);
        if (abort) ddp__cu_nccl_abort(c);
        if (c->comm) ncclCommDestroy(c->comm);
        cudaFree(c->one);
    }
    delete c;
}

DDP_API void ddp__cuda_nccl_set_stream(ddp__cuda_nccl *c, void *stream) {
    if (c) c->stream = (cudaStream_t)stream;
}
DDP_API void *ddp__cuda_nccl_stream(const ddp__cuda_nccl *c) { return c ? (void *)c->stream : NULL; }
DDP_API int ddp__cuda_nccl_device_of(const ddp__cuda_nccl *c) { return c ? c->device : -1; }

DDP_API ddp_result ddp__cuda_nccl_enqueue(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, void *recv, size_t count,
                                         ddp_dtype dtype, ddp_op op, int root, void **event, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    bool type_ok = true, op_ok = true;
    ncclDataType_t type = ddp__cu_nccl_type(dtype, &type_ok);
    ncclRedOp_t nop = ddp__cu_nccl_op(op, &op_ok);
    ncclResult_t rc;
    if (!c || !event) return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_enqueue: c or event is NULL");
    *event = NULL;
    if (kind == DDP__CUDA_ALL_TO_ALL_V || kind == DDP__CUDA_ALL_GATHER_V)
        return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_enqueue: kind %d takes counts per rank "
                            "(ddp__cuda_nccl_enqueue_v)", (int)kind);
    if (!c->comm || c->failed) return ddp__cu_fail(&m, DDP_ERR_STATE, "the NCCL communicator was stopped by an earlier error");
    if (kind != DDP__CUDA_BARRIER && !type_ok)
        return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "dtype %d has no NCCL type", (int)dtype);
    if ((kind == DDP__CUDA_ALL_REDUCE || kind == DDP__CUDA_REDUCE || kind == DDP__CUDA_REDUCE_SCATTER) && !op_ok)
        return ddp__cu_fail(&m, DDP_ERR_UNSUPPORTED, "op %d has no NCCL operation", (int)op);
    ddp__cu_device_scope scope(c->device);
    rc = ddp__cu_nccl_call(c, kind, send, recv, count, type, nop, root, ddp__cu_dtype_size(dtype));
    return ddp__cu_queued(c, &m, rc, event);
}

DDP_API ddp_result ddp__cuda_nccl_enqueue_v(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send,
                                           const size_t *send_counts, void *recv, const size_t *recv_counts,
                                           ddp_dtype dtype, void **event, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    ncclResult_t rc;
    if (!c || !event) return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_enqueue_v: c or event is NULL");
    *event = NULL;
    if (kind != DDP__CUDA_ALL_TO_ALL_V && kind != DDP__CUDA_ALL_GATHER_V)
        return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_enqueue_v: kind %d has no counts per rank "
                            "(ddp__cuda_nccl_enqueue)", (int)kind);
    if (!recv_counts || (kind == DDP__CUDA_ALL_TO_ALL_V && !send_counts))
        return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_enqueue_v: %s is NULL",
                            !recv_counts ? "recv_counts" : "send_counts");
    if (!c->comm || c->failed) return ddp__cu_fail(&m, DDP_ERR_STATE, "the NCCL communicator was stopped by an earlier error");
    ddp__cu_device_scope scope(c->device);
    rc = ddp__cu_nccl_blocks_v(c, kind, send, send_counts, recv, recv_counts, ddp__cu_dtype_size(dtype));
    return ddp__cu_queued(c, &m, rc, event);
}

DDP_API ddp_result ddp__cuda_nccl_copy(ddp__cuda_nccl *c, void *dst, const void *src, size_t bytes, void **event, char *err,
                                      size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    cudaError_t ce;
    *event = NULL;
    if (!bytes || dst == src) return DDP_SUCCESS;
    ddp__cu_device_scope scope(c->device);
    if ((ce = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream)) != cudaSuccess)
        return ddp__cu_fail(&m, DDP_ERR_SYSTEM, "cudaMemcpyAsync of %zu bytes failed: %s", bytes, cudaGetErrorString(ce));
    if (ddp__cuda_is_device_pointer(dst) && ddp__cuda_is_device_pointer(src)) return DDP_SUCCESS;
    return ddp__cu_record(c, &m, event);
}

DDP_API ddp_result ddp__cuda_nccl_alloc(ddp__cuda_nccl *c, size_t bytes, void **out, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    cudaError_t ce;
    void *p = NULL;
    *out = NULL;
    if (!bytes) return DDP_SUCCESS;
    ddp__cu_device_scope scope(c->device);
    if ((ce = cudaMalloc(&p, bytes)) != cudaSuccess)
        return ddp__cu_fail(&m, DDP_ERR_OUT_OF_MEMORY, "cudaMalloc(%zu bytes) on device %d failed: %s", bytes, c->device,
                            cudaGetErrorString(ce));
    if ((ce = cudaMemset(p, 0, bytes)) != cudaSuccess) {
        cudaFree(p);
        return ddp__cu_fail(&m, DDP_ERR_SYSTEM, "cudaMemset failed: %s", cudaGetErrorString(ce));
    }
    *out = p;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp__cuda_nccl_zero(ddp__cuda_nccl *c, void *dst, size_t bytes, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    cudaError_t ce;
    if (!bytes) return DDP_SUCCESS;
    ddp__cu_device_scope scope(c->device);
    if ((ce = cudaMemsetAsync(dst, 0, bytes, c->stream)) != cudaSuccess)
        return ddp__cu_fail(&m, DDP_ERR_SYSTEM, "cudaMemsetAsync of %zu bytes failed: %s", bytes, cudaGetErrorString(ce));
    return DDP_SUCCESS;
}

DDP_API void ddp__cuda_nccl_free(ddp__cuda_nccl *c, void *p) {
    if (!c || !p) return;
    ddp__cu_device_scope scope(c->device);
    cudaFree(p);
}

DDP_API ddp_result ddp__cuda_nccl_wait(ddp__cuda_nccl *c, void *event, double timeout, const char *what,
                                      ddp_result (*watch)(void *user), void *user, char *err, size_t err_size) {
    ddp__cu_msg m = {err, err_size};
    ddp__cu_event *e = (ddp__cu_event *)event;
    ddp_result r = DDP_SUCCESS;
    double nap = 1e-6;
    if (!c || !e) return ddp__cu_fail(&m, DDP_ERR_INVALID_ARGUMENT, "ddp__cuda_nccl_wait: c or event is NULL");
    ddp__cu_device_scope scope(c->device);
    for (;;) {
        cudaError_t ce = cudaEventQuery(e->ev);
        ncclResult_t async = ncclSuccess;
        if (ce == cudaSuccess) break;
        if (ce != cudaErrorNotReady) {
            r = ddp__cu_fail(&m, DDP_ERR_SYSTEM, "%s: CUDA error while waiting for it: %s (%s); the NCCL communicator "
                             "was stopped", what, cudaGetErrorName(ce), cudaGetErrorString(ce));
            break;
        }
        if (!c->comm || c->failed) {
            r = ddp__cu_fail(&m, DDP_ERR_STATE, "%s: the NCCL communicator was stopped by an earlier error", what);
            break;
        }
        if (ncclCommGetAsyncError(c->comm, &async) != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            const char *detail = ncclGetLastError(c->comm);
            r = ddp__cu_fail(&m, ddp__cu_nccl_code(async), "%s: NCCL reported an error: %s%s%s; the NCCL communicator was stopped",
                             what, ncclGetErrorString(async), detail && *detail ? ": " : "", detail ? detail : "");
            break;
        }
        if (ddp__cu_now() - e->queued > timeout) {
            r = ddp__cu_fail(&m, DDP_ERR_TIMEOUT, "%s did not complete within %.0f s (watchdog): a rank did not make the "
                             "same call, or is stuck or gone; the NCCL communicator was stopped", what, timeout);
            break;
        }
        if (watch && (r = watch(user)) != DDP_SUCCESS) {
            ddp__cu_fail(&m, r, "%s: another rank failed; the NCCL communicator was stopped", what);
            break;
        }
        ddp__cu_sleep(nap);
        nap = nap < 1e-3 ? nap * 2 : 1e-3;
    }
    if (r != DDP_SUCCESS) ddp__cu_nccl_stop(c);
    cudaEventDestroy(e->ev);
    delete e;
    return r;
}

DDP_API int ddp__cuda_nccl_test(ddp__cuda_nccl *c, void *event) {
    ddp__cu_event *e = (ddp__cu_event *)event;
    if (!c || !e || !c->comm || c->failed) return 1;
    ddp__cu_device_scope scope(c->device);
    return cudaEventQuery(e->ev) != cudaErrorNotReady;
}


} /* extern "C" */
#endif /* !DDP_CUDA_HARNESS || DDP_HARNESS_NCCL */

/* [SECTION] cuda-stage: device buffers on the cpu and mpi backends, staged through pinned host memory
   (src/devbuf.c decides what to copy; src/cuda_glue.h documents the calls). Plain runtime calls, no
   NCCL, so they are built everywhere, also under the tests' CPU harness (tests/cuda_harness), which
   emulates them: device allocations the host cannot touch, copies that run only when synchronised. */
extern "C" {

struct ddp__cuda_stage {
    void *host;         /* pinned (cudaMallocHost) */
    size_t size;        /* bytes at host */
    cudaEvent_t queued; /* recorded after the last copies out of host; NULL until the first */
    int event_device;   /* the device queued was made on (an event is recorded on its own device's streams) */
    bool pending;       /* copies out of host may still be running: wait for queued before reuse */
};

static ddp_result ddp__cu_stage_fail(char *err, size_t err_size, ddp_result code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static ddp_result ddp__cu_stage_fail(char *err, size_t err_size, ddp_result code, const char *fmt, ...) {
    va_list ap;
    if (!err || !err_size) return code;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
    return code;
}

DDP_API int ddp__cuda_is_device_pointer(const void *p) {
    cudaPointerAttributes at;
    if (!p) return 0;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        cudaGetLastError(); /* older runtimes fail on plain host memory; not sticky */
        return 0;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}

/* Wait for the copies still reading s->host. */
static ddp_result ddp__cu_stage_settle(ddp__cuda_stage *s, char *err, size_t err_size) {
    cudaError_t ce;
    if (!s->pending) return DDP_SUCCESS;
    s->pending = false;
    if ((ce = cudaEventSynchronize(s->queued)) != cudaSuccess)
        return ddp__cu_stage_fail(err, err_size, DDP_ERR_SYSTEM, "waiting for the previous copy from pinned host memory to "
                                  "the device failed: %s (%s)", cudaGetErrorName(ce), cudaGetErrorString(ce));
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp__cuda_stage_host(ddp__cuda_stage **sp, size_t bytes, void **host, char *err, size_t err_size) {
    ddp__cuda_stage *s = *sp;
    cudaError_t ce;
    ddp_result r;
    void *p = NULL;
    *host = NULL;
    if (!s) {
        if (!(s = new (std::nothrow) ddp__cuda_stage()))
            return ddp__cu_stage_fail(err, err_size, DDP_ERR_OUT_OF_MEMORY, "out of memory");
        *sp = s;
    }
    if ((r = ddp__cu_stage_settle(s, err, err_size)) != DDP_SUCCESS) return r;
    if (bytes > s->size) { /* grow by at least half, so that slowly growing calls do not reallocate each time */
        size_t want = bytes > s->size + s->size / 2 ? bytes : s->size + s->size / 2;
        if (s->host) cudaFreeHost(s->host);
        s->host = NULL;
        s->size = 0;
        if ((ce = cudaMallocHost(&p, want)) != cudaSuccess) {
            cudaGetLastError();
            return ddp__cu_stage_fail(err, err_size, ce == cudaErrorMemoryAllocation ? DDP_ERR_OUT_OF_MEMORY : DDP_ERR_SYSTEM,
                                      "cudaMallocHost(%zu bytes) for staging device buffers failed: %s (%s)", want,
                                      cudaGetErrorName(ce), cudaGetErrorString(ce));
        }
        s->host = p;
        s->size = want;
    }
    *host = s->host;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp__cuda_stage_copy(void *dst, const void *src, size_t bytes, void *stream, char *err, size_t err_size) {
    cudaError_t ce;
    if (!bytes) return DDP_SUCCESS;
    if ((ce = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream)) != cudaSuccess) {
        cudaGetLastError();
        return ddp__cu_stage_fail(err, err_size, DDP_ERR_SYSTEM, "cudaMemcpyAsync of %zu bytes from %p to %p failed: %s (%s)",
                                  bytes, src, dst, cudaGetErrorName(ce), cudaGetErrorString(ce));
    }
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp__cuda_stage_sync(void *stream, char *err, size_t err_size) {
    cudaError_t ce = cudaStreamSynchronize((cudaStream_t)stream);
    if (ce == cudaSuccess) return DDP_SUCCESS;
    cudaGetLastError();
    return ddp__cu_stage_fail(err, err_size, DDP_ERR_SYSTEM, "cudaStreamSynchronize failed: %s (%s)", cudaGetErrorName(ce),
                              cudaGetErrorString(ce));
}

DDP_API ddp_result ddp__cuda_stage_queued(ddp__cuda_stage *s, void *stream, char *err, size_t err_size) {
    int device = 0;
    cudaGetDevice(&device);
    if (s->queued && s->event_device != device) { /* made on another device: make one on this one */
        cudaEventDestroy(s->queued);
        s->queued = NULL;
    }
    if (!s->queued && cudaEventCreateWithFlags(&s->queued, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        s->queued = NULL;
    }
    s->event_device = device;
    if (s->queued && cudaEventRecord(s->queued, (cudaStream_t)stream) == cudaSuccess) {
        s->pending = true;
        return DDP_SUCCESS;
    }
    cudaGetLastError(); /* no event on this stream: wait for the copies now */
    return ddp__cuda_stage_sync(stream, err, err_size);
}

DDP_API void ddp__cuda_stage_free(ddp__cuda_stage *s) {
    if (!s) return;
    ddp__cu_stage_settle(s, NULL, 0);
    if (s->queued) cudaEventDestroy(s->queued);
    if (s->host) cudaFreeHost(s->host);
    delete s;
}

/* Device memory for the SyncBatchNorm device path (src/syncbn.c): cudaMalloc + cudaMemset on the
   calling thread's current device. Here, beside the staging calls, so that every build has it (the
   tests' CPU harness too, whose cudaMalloc memory the host cannot touch and kernels can). */
DDP_API ddp_result ddp__cuda_device_alloc(size_t bytes, void **out, char *err, size_t err_size) {
    cudaError_t ce;
    void *p = NULL;
    int device = -1;
    *out = NULL;
    if (!bytes) return DDP_SUCCESS;
    cudaGetDevice(&device);
    if ((ce = cudaMalloc(&p, bytes)) != cudaSuccess) {
        return ddp__cu_stage_fail(err, err_size, DDP_ERR_OUT_OF_MEMORY, "cudaMalloc(%zu bytes) on device %d failed: %s",
                                  bytes, device, cudaGetErrorString(ce));
    }
    if ((ce = cudaMemset(p, 0, bytes)) != cudaSuccess) {
        cudaFree(p);
        return ddp__cu_stage_fail(err, err_size, DDP_ERR_SYSTEM, "cudaMemset of %zu bytes on device %d failed: %s", bytes,
                                  device, cudaGetErrorString(ce));
    }
    *out = p;
    return DDP_SUCCESS;
}

DDP_API void ddp__cuda_device_free(void *p) {
    if (p) cudaFree(p);
}

} /* extern "C" */
