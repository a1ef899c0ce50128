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

/* ---- NCCL glue: the nccl backend's communicator (torch's ProcessGroupNCCL) -------------------------
   ddp.h's implementation calls these when a program asks for backend "nccl" (ddp_init): programs use
   the group's collectives, not these. Link with -lcudart -lnccl (NCCL >= 2.10: ncclAvg, ncclBfloat16).
   Every call makes the communicator's device current for its duration and restores the caller's.
   Errors go to err (err_size bytes; NULL = none). Thread safety: one thread at a time per communicator. */

#define DDP_CUDA_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */
typedef struct ddp_cuda_nccl ddp_cuda_nccl;

/* The collectives, numbered as ddp.h numbers them internally. */
typedef enum ddp_cuda_coll {
    DDP_CUDA_ALL_REDUCE = 1,
    DDP_CUDA_BROADCAST,
    DDP_CUDA_REDUCE,
    DDP_CUDA_ALL_GATHER,
    DDP_CUDA_REDUCE_SCATTER,
    DDP_CUDA_BARRIER /* a 1-element all-reduce, as torch's barrier on NCCL */
} ddp_cuda_coll;

/* ddp_cuda_nccl_device: choose this rank's GPU and make it the calling thread's current device
   (cudaSetDevice): local_rank when local_rank < the number of visible devices; device 0 when exactly
   one is visible (each rank given its own GPU, e.g. srun --gpus-per-task=1). *device receives it.
   Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED when no device is visible ("no CUDA device visible
   (cudaGetDeviceCount = 0): use the cpu backend") or when local_rank has no device of its own;
   DDP_ERR_SYSTEM when cudaSetDevice fails. */
DDP_API ddp_result ddp_cuda_nccl_device(int local_rank, int *device, char *err, size_t err_size);

/* ddp_cuda_nccl_unique_id: ncclGetUniqueId into id (DDP_CUDA_NCCL_ID_BYTES opaque bytes), made by one rank
   and handed to the others (ddp.h passes it through the store). DDP_ERR_SYSTEM when NCCL fails. */
DDP_API ddp_result ddp_cuda_nccl_unique_id(unsigned char *id, char *err, size_t err_size);

/* ddp_cuda_nccl_create: ncclCommInitRank(nranks, id, rank) on device; collective over the nranks ranks
   that share id (it returns once all have joined). The stream starts as NULL (the legacy default
   stream). Return: DDP_SUCCESS; DDP_ERR_SYSTEM (CUDA or NCCL failed: the message has their text);
   DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_result ddp_cuda_nccl_create(const unsigned char *id, int rank, int nranks, int device,
                                        ddp_cuda_nccl **out, char *err, size_t err_size);

/* ddp_cuda_nccl_destroy: ncclCommDestroy (which first completes the communicator's operations), or
   ncclCommAbort when abort is nonzero (after an error: nothing is waited for); frees c. NULL: no-op. */
DDP_API void ddp_cuda_nccl_destroy(ddp_cuda_nccl *c, int abort);

/* The stream (cudaStream_t; NULL = the legacy default stream) that collectives and copies are queued
   on, and the device of c. */
DDP_API void ddp_cuda_nccl_set_stream(ddp_cuda_nccl *c, void *stream);
DDP_API void *ddp_cuda_nccl_stream(const ddp_cuda_nccl *c);
DDP_API int ddp_cuda_nccl_device_of(const ddp_cuda_nccl *c);

/* ddp_cuda_is_device_pointer: 1 when p is memory a GPU kernel can use as device memory (cudaMalloc'd,
   or managed), 0 for host memory (pageable or pinned), NULL, or when CUDA cannot tell. */
DDP_API int ddp_cuda_is_device_pointer(const void *p);

/* ddp_cuda_nccl_enqueue: queue one collective on c's stream, then record a CUDA event after it.
   send/recv as ddp.h's collectives (all_reduce, broadcast, reduce: recv is the in-place buffer and send
   is ignored; all_gather / reduce_scatter: count per rank, send may be recv's own slice or recv
   itself). op AVG is ncclAvg. *event receives the event, for ddp_cuda_nccl_wait / _test (exactly one
   ddp_cuda_nccl_wait per event releases it). Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED (dtype or op);
   DDP_ERR_SYSTEM when NCCL or CUDA refuses (the communicator is then aborted); DDP_ERR_STATE when an
   earlier error aborted it. */
DDP_API ddp_result ddp_cuda_nccl_enqueue(ddp_cuda_nccl *c, ddp_cuda_coll kind, const void *send, void *recv,
                                         size_t count, ddp_dtype dtype, ddp_op op, int root, void **event,
                                         char *err, size_t err_size);

/* ddp_cuda_nccl_copy: bytes from src to dst (device or host memory, either side) queued on c's stream.
   When either side is host memory, *event receives an event to wait for before the host memory is
   used again (else *event = NULL). Return: DDP_SUCCESS or DDP_ERR_SYSTEM. */
DDP_API ddp_result ddp_cuda_nccl_copy(ddp_cuda_nccl *c, void *dst, const void *src, size_t bytes, void **event,
                                      char *err, size_t err_size);

/* Device memory on c's device: ddp_cuda_nccl_alloc gives bytes of zeroed memory (NULL for 0 bytes);
   ddp_cuda_nccl_zero queues a memset on c's stream; ddp_cuda_nccl_free releases (NULL: no-op; it waits
   for the device, as cudaFree does). */
DDP_API ddp_result ddp_cuda_nccl_alloc(ddp_cuda_nccl *c, size_t bytes, void **out, char *err, size_t err_size);
DDP_API ddp_result ddp_cuda_nccl_zero(ddp_cuda_nccl *c, void *dst, size_t bytes, char *err, size_t err_size);
DDP_API void ddp_cuda_nccl_free(ddp_cuda_nccl *c, void *p);

/* ddp_cuda_nccl_wait: the watchdog (torch's ProcessGroupNCCL watchdog, on the waiting thread). Polls the
   event (cudaEventQuery) until the work before it is complete; meanwhile checks ncclCommGetAsyncError,
   the deadline (timeout seconds after the event was recorded) and, when watch is not NULL,
   watch(user) (ddp.h looks at the other ranks' connections there). On an NCCL error, a CUDA error, the
   deadline or a failed watch, the communicator is aborted (ncclCommAbort), so that no rank hangs.
   what names the operation in messages ("all_reduce(count=4, f32, sum) as collective #7"). Releases
   the event in every case. Return: DDP_SUCCESS; DDP_ERR_TIMEOUT; DDP_ERR_SYSTEM (NCCL or CUDA error);
   watch's error; DDP_ERR_STATE when an earlier error had aborted the communicator. */
DDP_API ddp_result ddp_cuda_nccl_wait(ddp_cuda_nccl *c, void *event, double timeout, const char *what,
                                      ddp_result (*watch)(void *user), void *user, char *err, size_t err_size);

/* ddp_cuda_nccl_test: nonzero when the work before event is complete (or failed: then
   ddp_cuda_nccl_wait returns at once with the error). Does not release the event. */
DDP_API int ddp_cuda_nccl_test(ddp_cuda_nccl *c, void *event);

#endif /* DDP_CUDA */
