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
    ddp_dtype dtype;          /* of x, y, dy, dx: DDP_F32, DDP_F16 or DDP_BF16 */
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

#endif /* DDP_CUDA */
