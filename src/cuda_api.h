/* [SECTION] cuda: entry points implemented in ddp_cuda.cu (declared with DDP_CUDA)
   ddp_cuda.cu is compiled by nvcc and linked beside the C program; these declarations need no CUDA
   header: a cudaStream_t travels as void *. Device pointers are marked "device" below. Every call only
   queues work on the stream (kernel launches): nothing waits for the device, so results are ready when
   the stream reaches them. Return: DDP_SUCCESS, DDP_ERR_INVALID_ARGUMENT for bad arguments, or
   DDP_ERR_SYSTEM when CUDA refuses a launch; the message goes to args->err when it is not NULL.
   Thread safety: any thread; calls on one stream run in the order issued. */
#ifdef DDP_CUDA

/* ---- SyncBatchNorm kernels (torch's batch_norm_stats, batch_norm_gather_stats_with_counts,
   batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt) --------------------------
   One training step on the device, around the group's collectives (all on the same stream):
     forward:  ddp_cuda_bn_stats -> all_gather(record, 2C+1 f64) -> ddp_cuda_bn_gather_stats -> ddp_cuda_bn_elemt
     backward: ddp_cuda_bn_backward_reduce -> all_reduce(sums, 2C f64, SUM) -> ddp_cuda_bn_backward_elemt
   Eval: ddp_cuda_bn_eval_stats -> ddp_cuda_bn_elemt; backward: ddp_cuda_bn_backward_reduce (for the
   parameters' gradients) and ddp_cuda_bn_backward_elemt with sums = NULL.
   Data (x, y, dy, dx) is f32, f16 or bf16; statistics, weight, bias and running stats are f32, the
   exchanged records and sums f64, laid out as ddp_syncbn's CPU code lays them out (src/syncbn.h). */

/* What every SyncBatchNorm entry point is told about the batch and the call. */
typedef struct ddp_cuda_bn_args {
    ddp_dtype dtype;          /* of x, y, dy, dx: DDP_F32 (or DDP_DTYPE_DEFAULT), DDP_F16 or DDP_BF16 */
    int64_t batch, spatial;   /* as ddp_syncbn_forward: N and the product of the spatial sizes */
    int channels;             /* C */
    int channels_last;        /* (N, spatial..., C) instead of (N, C, spatial...) */
    void *stream;             /* cudaStream_t; NULL = the legacy default stream */
    char *err;                /* receives a message on failure (NULL = none) */
    size_t err_size;          /* bytes at err */
} ddp_cuda_bn_args;

/* Floats of device scratch the stats and backward calls need for C channels. */
#define DDP_CUDA_BN_WORK_FLOATS(C) ((size_t)(C) * 96u)

/* This rank's statistics: record (device, 2C + 1 doubles) <- [mean(C), M2(C), count].
   x: device, batch * spatial * C values; work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_stats(const ddp_cuda_bn_args *a, const void *x, float *work, double *record);

/* Merge the records of nranks ranks (device, nranks * (2C + 1) doubles, as all_gather leaves them; ranks
   with count 0 drop out) into mean and invstd (device, C floats each) and the global count (device,
   1 double). When running_mean/running_var (device, C floats each; NULL = none) are given and the global
   count is at least 2, they move by `factor` (momentum, or 1 / num_batches_tracked for momentum=None)
   with the unbiased variance. A global count of 1 (an error in ddp_syncbn_forward) leaves them unchanged:
   the caller reads *count when it next synchronises. Uses a->channels, a->stream, a->err only. */
DDP_API ddp_result ddp_cuda_bn_gather_stats(const ddp_cuda_bn_args *a, const double *records, int nranks, double eps,
                                            double factor, float *running_mean, float *running_var, float *mean,
                                            float *invstd, double *count);

/* Eval statistics: mean = running_mean, invstd = 1 / sqrt(running_var + eps) (device, C floats each). */
DDP_API ddp_result ddp_cuda_bn_eval_stats(const ddp_cuda_bn_args *a, const float *running_mean,
                                          const float *running_var, double eps, float *mean, float *invstd);

/* y = (x - mean) * invstd * weight + bias; weight, bias may be NULL (1 and 0). y may be x. */
DDP_API ddp_result ddp_cuda_bn_elemt(const ddp_cuda_bn_args *a, const void *x, void *y, const float *weight,
                                     const float *bias, const float *mean, const float *invstd);

/* sums (device, 2C doubles) <- [sum dy, sum dy (x - mean)] over this rank's batch; grad_weight +=
   sum dy (x - mean) invstd and grad_bias += sum dy (device, C floats each; NULL = not wanted).
   work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_backward_reduce(const ddp_cuda_bn_args *a, const void *dy, const void *x,
                                               const float *mean, const float *invstd, float *work, double *sums,
                                               float *grad_weight, float *grad_bias);

/* dx = (dy - sum_dy / n - (x - mean) invstd^2 sum_dy_xmu / n) * invstd * weight, with sums all-reduced
   over the group and n = *count (device), both from the calls above; sums = NULL: eval, dx = dy * invstd
   * weight. weight may be NULL (1). dx may be dy. work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_backward_elemt(const ddp_cuda_bn_args *a, const void *dy, const void *x, void *dx,
                                              const float *weight, const float *mean, const float *invstd,
                                              const double *sums, const double *count, float *work);

/* ---- Reducer kernels: gradient buckets (torch's Reducer copies and fp16/bf16 compression hooks) and the
   GradScaler's inf/nan check (torch._amp_foreach_non_finite_check_and_unscale_) -------------------------
   One training step of the GPU reducer, per bucket, on the stream that produced the gradients:
       ddp_cuda_bucket_copy_in(grads, bucket, scale = 1 / world_size) -> all_reduce(bucket, SUM)
       -> ddp_cuda_bucket_copy_out(grads, bucket, scale = 1)
   With compression the bucket is DDP_F16 or DDP_BF16 and the copies cast (fp16_compress_hook: cast,
   divide by the world size, all-reduce, cast back; here the division happens in f32 before the single
   rounding to f16, as the CPU reducer does). torch's gradient_predivide_factor p splits the scale:
   copy_in with 1 / p, copy_out with p / world_size. Mixed precision: before the optimizer step,
   ddp_cuda_non_finite_check_and_unscale over every gradient, then read found_inf.
   Multi-tensor: each call takes a list of tensors, described by host arrays that are read before the
   call returns (nothing to keep alive or copy to the device); kernels take up to 48 tensors per launch,
   in a table passed by value as the kernel argument, so a list of n tensors costs ceil(n / 48) launches.
   Arithmetic: f32 (f64 when a side is DDP_F64), rounded to nearest even into the destination dtype
   (through f32 for f16/bf16), exactly as the CPU reducer's copies. */

/* The tensors of a multi-tensor call and the call's settings. Zero-initialised: an empty f32 list. */
typedef struct ddp_cuda_grads_args {
    int count;               /* number of tensors (>= 0) */
    void *const *grads;      /* host array of count device pointers; NULL entries: see each call */
    const int64_t *numels;   /* host array of count element counts (>= 0; 0 = nothing to do) */
    ddp_dtype dtype;         /* of every tensor: DDP_F32 (or DDP_DTYPE_DEFAULT), DDP_F64, DDP_F16 or DDP_BF16 */
    void *stream;            /* cudaStream_t; NULL = the legacy default stream */
    char *err;               /* receives a message on failure (NULL = none) */
    size_t err_size;         /* bytes at err */
} ddp_cuda_grads_args;

/* ddp_cuda_bucket_copy_in: bucket[offsets[i] + j] = grads[i][j] * scale for every tensor i, converted to
   bucket_dtype: the reducer's copy of ready gradients into their bucket, scaled by 1 / world_size (or
   1 / gradient_predivide_factor), and the compression hooks' cast when bucket_dtype is DDP_F16/DDP_BF16.
   Parameters: a: the gradients (a->dtype); a NULL gradient fills its slot with zeros (a parameter
               that got no gradient, as torch's find_unused_parameters). bucket: device, bucket_numel
               elements of bucket_dtype (DDP_F32, DDP_F64, DDP_F16 or DDP_BF16; DDP_DTYPE_DEFAULT: the
               gradients' dtype). offsets: host array of
               count element offsets into the bucket, or NULL: the tensors packed in order from 0.
               Every slot must lie inside the bucket; slots must not overlap, except that a gradient
               may be its own slot (same dtype: gradient_as_bucket_view, scaled in place). scale: finite.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT (a count, offset or pointer that does not fit; the
           message names it); DDP_ERR_UNSUPPORTED for another dtype; DDP_ERR_SYSTEM when CUDA refuses a
           launch. Queued on a->stream only. */
DDP_API ddp_result ddp_cuda_bucket_copy_in(const ddp_cuda_grads_args *a, void *bucket, ddp_dtype bucket_dtype,
                                           int64_t bucket_numel, const int64_t *offsets, double scale);

/* ddp_cuda_bucket_copy_out: grads[i][j] = bucket[offsets[i] + j] * scale, converted to a->dtype: the
   averaged bucket back into the gradients after the all-reduce (scale 1, or p / world_size with a
   gradient_predivide_factor p), casting back from a compressed bucket. NULL gradients are skipped.
   Parameters and return as ddp_cuda_bucket_copy_in (the bucket is only read). */
DDP_API ddp_result ddp_cuda_bucket_copy_out(const ddp_cuda_grads_args *a, const void *bucket, ddp_dtype bucket_dtype,
                                            int64_t bucket_numel, const int64_t *offsets, double scale);

/* ddp_cuda_non_finite_check_and_unscale: torch._amp_foreach_non_finite_check_and_unscale_(grads,
   found_inf, inv_scale): every element of every gradient is multiplied in place by *inv_scale (left as
   it is when *inv_scale is 1; in f32, or f64 for DDP_F64 gradients), and *found_inf is set to 1.0 when
   some element was an infinity or a NaN. *found_inf is never cleared: zero it before the first call of
   a step, and read it (after synchronising) to decide whether the optimizer step runs.
   Parameters: a: the gradients (NULL entries skipped); found_inf, inv_scale: device, one float each.
   Return: DDP_SUCCESS, DDP_ERR_INVALID_ARGUMENT, DDP_ERR_UNSUPPORTED or DDP_ERR_SYSTEM, as above. */
DDP_API ddp_result ddp_cuda_non_finite_check_and_unscale(const ddp_cuda_grads_args *a, float *found_inf,
                                                         const float *inv_scale);

#endif /* DDP_CUDA */

/* The nccl backend's glue, also in ddp_cuda.cu, is private: src/cuda_glue.h. */
#include "cuda_glue.h"
