/* [SECTION] cuda-glue: the nccl backend's communicator, implemented in ddp_cuda.cu (with DDP_CUDA)
   torch's ProcessGroupNCCL. Private: ddp.h's implementation (src/nccl.c) calls these when a program
   asks for backend "nccl" (ddp_init), and ddp_cuda.cu (which defines DDP__CUDA_GLUE before including
   ddp.h) defines them; a user's program sees none of it and uses the group's collectives. Unlike the
   other private functions they are not static: ddp_cuda.cu defines them and the linker joins the two.
   Link with -lcudart -lnccl (NCCL >= 2.10: ncclAvg, ncclBfloat16). Every call makes the communicator's
   device current for its duration and restores the caller's. Errors go to err (err_size bytes;
   NULL = none). Thread safety: one thread at a time per communicator. */
#if defined(DDP_CUDA) && (defined(DDP_IMPLEMENTATION) || defined(DDP__CUDA_GLUE)) && !defined(DDP__CUDA_GLUE_INCLUDED)
#define DDP__CUDA_GLUE_INCLUDED

#define DDP__CUDA_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */
typedef struct ddp__cuda_nccl ddp__cuda_nccl;

/* The collectives, numbered as ddp.h numbers them internally. */
typedef enum ddp__cuda_coll {
    DDP__CUDA_ALL_REDUCE = 1,
    DDP__CUDA_BROADCAST,
    DDP__CUDA_REDUCE,
    DDP__CUDA_ALL_GATHER,
    DDP__CUDA_REDUCE_SCATTER,
    DDP__CUDA_BARRIER, /* a 1-element all-reduce, as torch's barrier on NCCL */
    /* data movement, as torch's ProcessGroupNCCL: ncclSend/ncclRecv between ncclGroupStart and
       ncclGroupEnd, the rank's own block a device-to-device copy on the stream */
    DDP__CUDA_GATHER,
    DDP__CUDA_SCATTER,
    DDP__CUDA_ALL_TO_ALL,
    DDP__CUDA_ALL_TO_ALL_V,  /* ddp__cuda_nccl_enqueue_v only */
    DDP__CUDA_ALL_GATHER_V   /* ddp__cuda_nccl_enqueue_v only */
} ddp__cuda_coll;

/* ddp__cuda_nccl_device: choose this rank's GPU and make it the calling thread's current device
   (cudaSetDevice): local_rank when local_rank < the number of visible devices; device 0 when exactly
   one is visible (each rank given its own GPU, e.g. srun --gpus-per-task=1). *device receives it.
   Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED when no device is visible ("no CUDA device visible
   (cudaGetDeviceCount = 0): use the cpu backend") or when local_rank has no device of its own;
   DDP_ERR_SYSTEM when cudaSetDevice fails. */
DDP_API ddp_result ddp__cuda_nccl_device(int local_rank, int *device, char *err, size_t err_size);

/* ddp__cuda_nccl_unique_id: ncclGetUniqueId into id (DDP__CUDA_NCCL_ID_BYTES opaque bytes), made by one rank
   and handed to the others (ddp.h passes it through the store). DDP_ERR_SYSTEM when NCCL fails. */
DDP_API ddp_result ddp__cuda_nccl_unique_id(unsigned char *id, char *err, size_t err_size);

/* ddp__cuda_nccl_create: ncclCommInitRank(nranks, id, rank) on device; collective over the nranks ranks
   that share id (it returns once all have joined). The stream starts as NULL (the legacy default
   stream). fault_tolerant: a non-blocking communicator (ncclCommInitRankConfig, blocking = 0, NCCL 2.14+)
   whose calls may stay in progress at most timeout seconds, and which a failure leaves for
   ddp__cuda_nccl_shrink (revoked where NCCL has ncclCommRevoke) instead of aborting it. Return:
   DDP_SUCCESS; DDP_ERR_SYSTEM (CUDA or NCCL failed: the message has their text); DDP_ERR_PEER_LOST (NCCL
   said ncclRemoteError); DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_result ddp__cuda_nccl_create(const unsigned char *id, int rank, int nranks, int device, int fault_tolerant,
                                        double timeout, ddp__cuda_nccl **out, char *err, size_t err_size);

/* ddp__cuda_nccl_shrink: ncclCommShrink (NCCL 2.27+): the ranks of parent not in exclude (parent's rank
   numbers) make a communicator of their own, in parent's order, on parent's device and stream, without a
   unique id; collective over them. parent stays (destroy it with abort). Return: as create;
   DDP_ERR_UNSUPPORTED where NCCL has no shrink or parent was aborted (then abort and create anew). */
/* ddp__cuda_nccl_can_shrink: nonzero when c can be shrunk: this NCCL has ncclCommShrink, c is
   fault-tolerant and was not aborted. */
DDP_API int ddp__cuda_nccl_can_shrink(const ddp__cuda_nccl *c);
DDP_API ddp_result ddp__cuda_nccl_shrink(ddp__cuda_nccl *parent, const int *exclude, int nexclude, ddp__cuda_nccl **out,
                                        char *err, size_t err_size);

/* ddp__cuda_nccl_destroy: ncclCommDestroy (which first completes the communicator's operations), or
   ncclCommAbort when abort is nonzero (after an error: nothing is waited for); frees c. NULL: no-op. */
DDP_API void ddp__cuda_nccl_destroy(ddp__cuda_nccl *c, int abort);

/* The stream (cudaStream_t; NULL = the legacy default stream) that collectives and copies are queued
   on, and the device of c. */
DDP_API void ddp__cuda_nccl_set_stream(ddp__cuda_nccl *c, void *stream);
DDP_API void *ddp__cuda_nccl_stream(const ddp__cuda_nccl *c);
DDP_API int ddp__cuda_nccl_device_of(const ddp__cuda_nccl *c);

/* ddp__cuda_is_device_pointer: 1 when p is memory a GPU kernel can use as device memory (cudaMalloc'd,
   or managed), 0 for host memory (pageable or pinned), NULL, or when CUDA cannot tell. */
DDP_API int ddp__cuda_is_device_pointer(const void *p);

/* ddp__cuda_nccl_enqueue: queue one collective on c's stream, then record a CUDA event after it.
   send/recv as ddp.h's collectives (all_reduce, broadcast, reduce: recv is the in-place buffer and send
   is ignored; all_gather / reduce_scatter: count per rank, send may be recv's own slice or recv
   itself; gather / scatter / all_to_all: count per rank, the root's big buffer NULL elsewhere, in place
   as ddp.h allows it). op AVG is ncclAvg. *event receives the event, for ddp__cuda_nccl_wait / _test (exactly one
   ddp__cuda_nccl_wait per event releases it). Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED (dtype or op);
   DDP_ERR_SYSTEM when NCCL or CUDA refuses (the communicator is then aborted); DDP_ERR_STATE when an
   earlier error aborted it. */
DDP_API ddp_result ddp__cuda_nccl_enqueue(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, void *recv,
                                         size_t count, ddp_dtype dtype, ddp_op op, int root, void **event,
                                         char *err, size_t err_size);

/* ddp__cuda_nccl_enqueue_v: as ddp__cuda_nccl_enqueue for the calls with a size per rank (kind
   DDP__CUDA_ALL_TO_ALL_V or DDP__CUDA_ALL_GATHER_V), counts in elements, nranks entries each, blocks
   packed in rank order (the displacements are the sums of the counts before). all_to_all_v: send_counts[p]
   elements go to rank p, recv_counts[p] come from it (the ranks' counts were checked to match before:
   NCCL would hang or corrupt memory on a difference). all_gather_v: send_counts is ignored, recv_counts
   are every rank's counts (this rank sends recv_counts[rank] elements; send may be its own block of
   recv). Zero counts move nothing. Return: as ddp__cuda_nccl_enqueue; DDP_ERR_INVALID_ARGUMENT for
   another kind or a NULL count array. */
DDP_API ddp_result ddp__cuda_nccl_enqueue_v(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send,
                                           const size_t *send_counts, void *recv, const size_t *recv_counts,
                                           ddp_dtype dtype, void **event, char *err, size_t err_size);

/* ddp__cuda_nccl_copy: bytes from src to dst (device or host memory, either side) queued on c's stream.
   When either side is host memory, *event receives an event to wait for before the host memory is
   used again (else *event = NULL). Return: DDP_SUCCESS or DDP_ERR_SYSTEM. */
DDP_API ddp_result ddp__cuda_nccl_copy(ddp__cuda_nccl *c, void *dst, const void *src, size_t bytes, void **event,
                                      char *err, size_t err_size);

/* Device memory on c's device: ddp__cuda_nccl_alloc gives bytes of zeroed memory (NULL for 0 bytes);
   ddp__cuda_nccl_zero queues a memset on c's stream; ddp__cuda_nccl_free releases (NULL: no-op; it waits
   for the device, as cudaFree does). */
DDP_API ddp_result ddp__cuda_nccl_alloc(ddp__cuda_nccl *c, size_t bytes, void **out, char *err, size_t err_size);
DDP_API ddp_result ddp__cuda_nccl_zero(ddp__cuda_nccl *c, void *dst, size_t bytes, char *err, size_t err_size);
DDP_API void ddp__cuda_nccl_free(ddp__cuda_nccl *c, void *p);

/* ddp__cuda_nccl_wait: the watchdog (torch's ProcessGroupNCCL watchdog, on the waiting thread). Polls the
   event (cudaEventQuery) until the work before it is complete; meanwhile checks ncclCommGetAsyncError,
   the deadline (timeout seconds after the event was recorded) and, when watch is not NULL,
   watch(user) (ddp.h looks at the other ranks' connections there). On an NCCL error, a CUDA error, the
   deadline or a failed watch, the communicator is aborted (ncclCommAbort), so that no rank hangs.
   what names the operation in messages ("all_reduce(count=4, f32, sum) as collective #7"). Releases
   the event in every case. Return: DDP_SUCCESS; DDP_ERR_TIMEOUT; DDP_ERR_SYSTEM (NCCL or CUDA error);
   watch's error; DDP_ERR_STATE when an earlier error had aborted the communicator. */
DDP_API ddp_result ddp__cuda_nccl_wait(ddp__cuda_nccl *c, void *event, double timeout, const char *what,
                                      ddp_result (*watch)(void *user), void *user, char *err, size_t err_size);

/* ddp__cuda_nccl_test: nonzero when the work before event is complete (or failed: then
   ddp__cuda_nccl_wait returns at once with the error). Does not release the event. */
DDP_API int ddp__cuda_nccl_test(ddp__cuda_nccl *c, void *event);

/* ---- cuda-stage: device buffers on the cpu and mpi backends (src/devbuf.c), staged through pinned
   host memory (torch's Gloo backend with CUDA tensors). These calls (and ddp__cuda_is_device_pointer
   above) need no NCCL: ddp_cuda.cu defines them for every build, also for the tests' CPU harness. A
   ddp__cuda_stage is one group's pinned staging memory: one call at a time uses it. ---- */
typedef struct ddp__cuda_stage ddp__cuda_stage;

/* ddp__cuda_stage_host: *host receives at least bytes of pinned host memory (cudaMallocHost) from *s,
   which is made on first use (*s NULL) and grown when too small. It first waits for the copies that
   the previous user of *s queued out of that memory (ddp__cuda_stage_queued), so a call never
   overwrites what a queued copy still reads. Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY; DDP_ERR_SYSTEM
   when CUDA fails (the message has its text). */
DDP_API ddp_result ddp__cuda_stage_host(ddp__cuda_stage **s, size_t bytes, void **host, char *err, size_t err_size);

/* ddp__cuda_stage_copy: queue a copy of bytes from src to dst (device or pinned host memory, either
   side: cudaMemcpyAsync with cudaMemcpyDefault) on stream (a cudaStream_t; NULL = the legacy default
   stream). Return: DDP_SUCCESS or DDP_ERR_SYSTEM. */
DDP_API ddp_result ddp__cuda_stage_copy(void *dst, const void *src, size_t bytes, void *stream, char *err, size_t err_size);

/* ddp__cuda_stage_sync: wait until the work queued on stream so far is done (cudaStreamSynchronize). */
DDP_API ddp_result ddp__cuda_stage_sync(void *stream, char *err, size_t err_size);

/* ddp__cuda_stage_queued: the copies out of s's memory have been queued on stream: record an event
   after them that the next ddp__cuda_stage_host waits for (when the event cannot be recorded there,
   e.g. a stream of another device than the current one, it waits for the stream now instead). */
DDP_API ddp_result ddp__cuda_stage_queued(ddp__cuda_stage *s, void *stream, char *err, size_t err_size);

/* ddp__cuda_stage_free: wait for s's queued copies, free its pinned memory and s. NULL: no-op. */
DDP_API void ddp__cuda_stage_free(ddp__cuda_stage *s);

/* ---- SyncBatchNorm on device memory (gpucheck): ddp_syncbn_forward/backward's device path ----------
   torch's SyncBatchNorm on CUDA, queued on one stream with no host synchronisation:
     forward (synced)  ddp_cuda_bn_stats -> exchange GATHER of the records -> ddp_cuda_bn_gather_stats -> elemt
     forward (local)   the same on this rank's record alone, no exchange (one rank, or eval without
                       running stats)
     forward (eval)    ddp_cuda_bn_eval_stats -> elemt
     backward          ddp_cuda_bn_backward_reduce -> exchange REDUCE of the sums (synced only)
                       -> ddp_cuda_bn_backward_elemt (sums NULL in eval)
   The exchange is the caller's: src/syncbn.c passes the group's collective (queued on the same stream
   on the nccl backend); the tests pass a simulation of other ranks. The kernels only queue work. */
enum { DDP__CUDA_BN_SYNCED = 1, DDP__CUDA_BN_LOCAL, DDP__CUDA_BN_EVAL };
enum { DDP__CUDA_BN_GATHER = 1, DDP__CUDA_BN_REDUCE };

/* exchange(user, DDP__CUDA_BN_GATHER, records, 2C + 1): all_gather in place, this rank's record at
   records + rank * (2C + 1); exchange(user, DDP__CUDA_BN_REDUCE, sums, 2C): all_reduce SUM in place.
   Device memory, f64. Return DDP_SUCCESS or the collective's error. */
typedef ddp_result (*ddp__cuda_bn_exchange)(void *user, int what, double *buf, size_t count);

/* A layer's device state: what every call of the device path needs. */
typedef struct ddp__cuda_bn {
    ddp_cuda_bn_args a;                /* batch, spatial, channels, layout, stream, err (dtype DDP_F32) */
    int nranks, rank;                  /* of the exchange (1 and 0 without one) */
    double eps;
    const float *weight, *bias;        /* device, C floats each, or NULL (1 and 0) */
    float *running_mean, *running_var; /* device, C floats each, or both NULL */
    float *work, *mean, *invstd;       /* device scratch: DDP_CUDA_BN_WORK_FLOATS(C), C, C floats */
    double *records, *sums, *count;    /* device scratch: nranks * (2C + 1), 2C, 1 doubles */
    ddp__cuda_bn_exchange exchange;
    void *user;
} ddp__cuda_bn;

/* ddp__cuda_bn_forward: y = BatchNorm(x) in mode DDP__CUDA_BN_SYNCED, _LOCAL or _EVAL; the running
   stats (if any) move by factor in the first two when the global count is >= 2. Leaves mean, invstd
   and count for backward. Return: DDP_SUCCESS, the kernels' errors, or the exchange's. */
DDP_API ddp_result ddp__cuda_bn_forward(ddp__cuda_bn *b, int mode, const void *x, void *y, double factor);

/* ddp__cuda_bn_backward: after a forward in the same mode; grad_weight, grad_bias (device, C floats,
   NULL = not wanted) accumulate this rank's local sums; dx NULL = not wanted (the exchange still runs
   when synced). */
DDP_API ddp_result ddp__cuda_bn_backward(ddp__cuda_bn *b, int mode, const void *dy, const void *x, void *dx,
                                        float *grad_weight, float *grad_bias);

/* Device memory on the calling thread's current device (zeroed; NULL for 0 bytes), and its release
   (NULL: no-op). cudaMalloc + cudaMemset; defined beside the cuda-stage calls, so every build of
   ddp_cuda.cu has them (also the tests' CPU harness, whose cudaMalloc memory is the same device memory
   that devbuf.c stages and ddp__cuda_is_device_pointer recognises). */
DDP_API ddp_result ddp__cuda_device_alloc(size_t bytes, void **out, char *err, size_t err_size);
DDP_API void ddp__cuda_device_free(void *p);
/* ---- end of SyncBatchNorm on device memory ---- */

/* ddp__cuda_bucket_add: grads[i][j] += bucket[offsets[i] + j], converted to a->dtype, the sum taken in the
   bucket copy's arithmetic (f32; f64 when either side is f64) and rounded once, as the CPU reducer's add
   (ddp__reduce): the nccl backend's accumulate, which zero_stage 3 uses to add a no_sync pass's averaged
   slice to the ones before. Parameters and return as ddp_cuda_bucket_copy_out (cuda_api.h). */
DDP_API ddp_result ddp__cuda_bucket_add(const ddp_cuda_grads_args *a, const void *bucket, ddp_dtype bucket_dtype,
                                       int64_t bucket_numel, const int64_t *offsets);

#endif /* DDP__CUDA_GLUE_INCLUDED */
