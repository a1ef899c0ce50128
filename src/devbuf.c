/* [SECTION] devbuf: device buffers on the cpu and mpi backends, staged through pinned host memory
   (torch's Gloo backend with CUDA tensors: ProcessGroupGloo copies them to pinned host memory on the
   current stream, runs the host algorithm, and copies the result back)

   In a build with -DDDP_CUDA (the implementation file) linked with ddp_cuda.o, every collective and
   ddp_send / ddp_recv of a group whose backend is cpu (shm, tcp, hier) or mpi also takes buffers in
   device memory (cudaMalloc'd or managed; ddp__cuda_is_device_pointer asks cudaPointerGetAttributes).
   So several ranks can share one GPU (NCCL refuses two ranks on one device), and a machine with one GPU
   runs a multi-rank job end to end. Each rank decides for itself: ranks may pass different kinds of
   memory, and one buffer of a call may be host memory while the other is device memory.

   One call, on the calling thread (collectives.c's ddp__run_staged):
     1. the plan: the device buffers this rank reads or writes (send and recv, with their real extents:
        count x world size where the count is per rank, the sums of the split sizes for the _v calls;
        gather's recv and scatter's send on the root only), merged into one region when they overlap
        (the in-place forms); a region is copied in when the call reads it (and always when merged),
        copied out when it writes it;
     2. the group's pinned memory (ddp__cuda_stage_host: cudaMallocHost, kept and grown as needed,
        freed with the group) after the copies the previous call queued out of it are done;
     3. device -> pinned copies on the group's stream (ddp_set_stream; NULL = the legacy default
        stream), then cudaStreamSynchronize: the call reads what the caller's work queued on that
        stream before the call wrote;
     4. the host collective on the pinned copies, through the group's backend as any host call;
     5. pinned -> device copies queued on the stream, and an event after them (waited for before the
        pinned memory is used again). The call returns without waiting for them.
   Ordering: the result is ready for the work queued on the group's stream after the call returns (as
   NCCL's results are), and for the host after a cudaStreamSynchronize or a cudaMemcpy from that stream;
   work on another stream must wait for the group's stream (an event) first, as with NCCL.
   The async variants stage the same way inside the call: they return a ddp_work that is already
   complete (ddp_wait returns its result at once). ddp_isend / ddp_irecv refuse device memory
   (DDP_ERR_UNSUPPORTED): their buffers outlive the call, which one shared staging area cannot serve.
   A CUDA failure while staging breaks the group (every rank fails, as for any error in a collective). */
#include "internal.h"

#ifdef DDP_CUDA

struct ddp__devbuf {
    void *stream;           /* cudaStream_t; NULL = the legacy default stream */
    ddp__cuda_stage *stage; /* ddp_cuda.cu's pinned memory; NULL until the first staged call */
};

static struct ddp__devbuf *ddp__devbuf_of(ddp_group *g) {
    if (!g->devbuf) g->devbuf = (struct ddp__devbuf *)ddp__calloc(1, sizeof *g->devbuf);
    return g->devbuf;
}

static uint64_t ddp__devbuf_sum(const size_t *counts, int n) {
    uint64_t sum = 0;
    int i;
    for (i = 0; i < n; i++) sum += (uint64_t)counts[i]; /* validated: the sums fit */
    return sum;
}

/* The elements of k's send and recv buffers that this rank reads or writes (0: none), and whether the
   call reads recv (the in-place calls) and writes it (every call but broadcast on its root). */
static void ddp__devbuf_extents(const ddp_group *g, const ddp__call *k, uint64_t *send_n, uint64_t *recv_n, int *recv_in,
                                int *recv_out) {
    uint64_t n = (uint64_t)g->world_size, count = (uint64_t)k->count;
    int root = g->rank == k->root;
    *send_n = 0, *recv_n = 0, *recv_in = 0, *recv_out = 1;
    switch (k->kind) {
    case DDP__ALL_REDUCE:
    case DDP__REDUCE: *recv_n = count, *recv_in = 1; break; /* reduce: the non-roots' buffers as the backend leaves them */
    case DDP__BROADCAST: *recv_n = count, *recv_in = root, *recv_out = !root; break;
    case DDP__ALL_GATHER: *send_n = count, *recv_n = count * n; break;
    case DDP__REDUCE_SCATTER: *send_n = count * n, *recv_n = count; break;
    case DDP__GATHER: *send_n = count, *recv_n = root ? count * n : 0; break;
    case DDP__SCATTER: *send_n = root ? count * n : 0, *recv_n = count; break;
    case DDP__ALL_TO_ALL: *send_n = count * n, *recv_n = count * n; break;
    case DDP__ALL_TO_ALL_V:
        *send_n = ddp__devbuf_sum(k->send_counts, g->world_size);
        *recv_n = ddp__devbuf_sum(k->recv_counts, g->world_size);
        break;
    case DDP__ALL_GATHER_V: *send_n = count, *recv_n = ddp__devbuf_sum(k->recv_counts, g->world_size); break;
    case DDP__SEND: *send_n = count; break;
    case DDP__RECV: *recv_n = count; break;
    default: break; /* barrier, monitored_barrier, broadcast_bytes: no buffers of the caller's */
    }
}

static int ddp__devbuf_is_device(const void *p, uint64_t elements) {
    return elements && p && ddp__cuda_is_device_pointer(p) == 1;
}

static int ddp__devbuf_wanted(ddp_group *g, const ddp__call *k) {
    uint64_t send_n, recv_n;
    int recv_in, recv_out;
    if (g->nccl) return 0; /* NCCL takes device memory itself */
    ddp__devbuf_extents(g, k, &send_n, &recv_n, &recv_in, &recv_out);
    return ddp__devbuf_is_device(k->send, send_n) || ddp__devbuf_is_device(k->buf, recv_n);
}

/* Step 1: the regions of a source (read) and a destination (read when dst_in, written when dst_out),
   each only when it is device memory. Two regions that overlap become one, copied in (it holds what the
   call reads) and out (it holds what it writes). */
static void ddp__devbuf_plan_two(ddp__devbuf_plan *plan, const void *src, size_t src_bytes, void *dst, size_t dst_bytes,
                                 int dst_in, int dst_out) {
    ddp__devbuf_region *a, *b;
    memset(plan, 0, sizeof *plan);
    if (ddp__devbuf_is_device(src, src_bytes)) {
        a = &plan->region[plan->n++];
        a->device = (char *)src, a->bytes = src_bytes, a->in = 1;
    }
    if (ddp__devbuf_is_device(dst, dst_bytes)) {
        a = &plan->region[plan->n++];
        a->device = (char *)dst, a->bytes = dst_bytes, a->in = dst_in, a->out = dst_out;
    }
    if (plan->n < 2) return;
    a = &plan->region[0], b = &plan->region[1];
    if (a->device < b->device + b->bytes && b->device < a->device + a->bytes) {
        char *lo = DDP__MIN(a->device, b->device), *hi = DDP__MAX(a->device + a->bytes, b->device + b->bytes);
        a->out |= b->out;
        a->in = 1;
        a->device = lo, a->bytes = (size_t)(hi - lo);
        plan->n = 1;
    }
}

static void ddp__devbuf_plan_of(const ddp_group *g, const ddp__call *k, ddp__devbuf_plan *plan) {
    uint64_t send_n, recv_n;
    size_t es = ddp_dtype_size(k->dtype);
    int recv_in, recv_out;
    ddp__devbuf_extents(g, k, &send_n, &recv_n, &recv_in, &recv_out);
    ddp__devbuf_plan_two(plan, k->send, (size_t)send_n * es, k->buf, (size_t)recv_n * es, recv_in, recv_out);
}

/* Where p (a device pointer of a region, or host memory) is for the host call. */
static void *ddp__devbuf_host_of(const ddp__devbuf_plan *plan, const void *p) {
    int i;
    for (i = 0; p && i < plan->n; i++) {
        const ddp__devbuf_region *r = &plan->region[i];
        if ((const char *)p >= r->device && (const char *)p < r->device + r->bytes)
            return r->host + ((const char *)p - r->device);
    }
    return (void *)p;
}

/* A CUDA failure while staging breaks the group; step says which (the message names the call and rank). */
static ddp_result ddp__devbuf_fail(ddp_group *g, const ddp__coll *c, ddp_result r, const char *step, const char *err) {
    char desc[160];
    if (c) ddp__coll_describe(g, c, desc, sizeof desc);
    else snprintf(desc, sizeof desc, "the reducer's copy of a gradient or parameter"); /* ddp__devbuf_copy_begin */
    return ddp__coll_fail(g, r, "%s on rank %d: %s failed: %s (backend %s stages device buffers through pinned host "
                          "memory: is each buffer device memory of at least the call's elements?)", desc, g->rank, step,
                          err, g->backend->family);
}

/* Steps 2 and 3 for a plan: its regions' places in the pinned memory, and the copies in. */
static ddp_result ddp__devbuf_stage_plan(ddp_group *g, const ddp__coll *c, ddp__devbuf_plan *plan) {
    char err[DDP__ERR_MAX] = "";
    struct ddp__devbuf *d = ddp__devbuf_of(g);
    size_t total = 0, at = 0;
    char *host = NULL;
    ddp_result r = DDP_SUCCESS;
    int i, copied = 0;
    if (!d) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "rank %d: out of memory staging device buffers", g->rank);
    for (i = 0; i < plan->n; i++) total += (plan->region[i].bytes + 63) & ~(size_t)63; /* each region 64-byte aligned */
    if ((r = ddp__cuda_stage_host(&d->stage, total ? total : 1, (void **)&host, err, sizeof err)) != DDP_SUCCESS)
        return ddp__devbuf_fail(g, c, r, "getting pinned host memory to stage device buffers", err);
    for (i = 0; i < plan->n && r == DDP_SUCCESS; i++) {
        ddp__devbuf_region *reg = &plan->region[i];
        reg->host = host + at;
        at += (reg->bytes + 63) & ~(size_t)63;
        if (reg->in && reg->bytes) {
            r = ddp__cuda_stage_copy(reg->host, reg->device, reg->bytes, d->stream, err, sizeof err);
            copied = 1;
        }
    }
    if (r == DDP_SUCCESS && copied) r = ddp__cuda_stage_sync(d->stream, err, sizeof err);
    if (r != DDP_SUCCESS) return ddp__devbuf_fail(g, c, r, "copying device memory to pinned host memory", err);
    return DDP_SUCCESS;
}

static ddp_result ddp__devbuf_stage(ddp_group *g, const ddp__call *k, const ddp__coll *c, ddp__call *host_call,
                                   ddp__devbuf_plan *plan) {
    ddp_result r;
    ddp__devbuf_plan_of(g, k, plan);
    if ((r = ddp__devbuf_stage_plan(g, c, plan)) != DDP_SUCCESS) return r;
    *host_call = *k;
    host_call->send = ddp__devbuf_host_of(plan, k->send);
    host_call->buf = ddp__devbuf_host_of(plan, k->buf);
    return DDP_SUCCESS;
}

static ddp_result ddp__devbuf_unstage(ddp_group *g, const ddp__coll *c, const ddp__devbuf_plan *plan) {
    char err[DDP__ERR_MAX] = "";
    struct ddp__devbuf *d = g->devbuf;
    ddp_result r = DDP_SUCCESS;
    int i, copied = 0;
    for (i = 0; i < plan->n && r == DDP_SUCCESS; i++) {
        const ddp__devbuf_region *reg = &plan->region[i];
        if (!reg->out || !reg->bytes) continue;
        r = ddp__cuda_stage_copy(reg->device, reg->host, reg->bytes, d->stream, err, sizeof err);
        copied = 1;
    }
    if (r == DDP_SUCCESS && copied) r = ddp__cuda_stage_queued(d->stage, d->stream, err, sizeof err);
    if (r == DDP_SUCCESS) return r;
    return ddp__devbuf_fail(g, c, r, "copying the result from pinned host memory to device memory", err);
}

/* The reducer's copies (reducer.c's host memory functions) when a gradient or parameter is device
   memory: the same staging, synchronous on the way in (the reducer converts at once) and queued on the
   way out. The reducer runs them on the thread that issues the group's calls, one at a time, as the
   staged collectives, so they share the group's pinned memory. */
static int ddp__devbuf_copy_begin(ddp_group *g, void **dst, size_t dst_bytes, const void **src, size_t src_bytes,
                                  ddp__devbuf_plan *plan) {
    if (g->nccl) return 0;
    ddp__devbuf_plan_two(plan, *src, src_bytes, *dst, dst_bytes, 0, 1);
    if (!plan->n) return 0;
    if (ddp__devbuf_stage_plan(g, NULL, plan) != DDP_SUCCESS) return -1;
    *src = ddp__devbuf_host_of(plan, *src);
    *dst = ddp__devbuf_host_of(plan, *dst);
    return 1;
}

static void ddp__devbuf_copy_end(ddp_group *g, const ddp__devbuf_plan *plan) { ddp__devbuf_unstage(g, NULL, plan); }

static ddp_result ddp__devbuf_set_stream(ddp_group *g, void *stream) {
    struct ddp__devbuf *d = ddp__devbuf_of(g);
    if (!d) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_set_stream: out of memory");
    d->stream = stream;
    return DDP_SUCCESS;
}

static void *ddp__devbuf_stream(const ddp_group *g) { return g->devbuf ? g->devbuf->stream : NULL; }

static ddp_result ddp__devbuf_inherit(ddp_group *sub, const ddp_group *parent) {
    if (!parent->devbuf || !parent->devbuf->stream) return DDP_SUCCESS;
    return ddp__devbuf_set_stream(sub, parent->devbuf->stream);
}

static void ddp__devbuf_free(ddp_group *g) {
    if (!g->devbuf) return;
    ddp__cuda_stage_free(g->devbuf->stage);
    ddp__free(g->devbuf);
    g->devbuf = NULL;
}

#else /* !DDP_CUDA: every pointer is host memory */

struct ddp__devbuf {
    int unused;
};

static int ddp__devbuf_wanted(ddp_group *g, const ddp__call *k) {
    (void)g, (void)k;
    return 0;
}
static ddp_result ddp__devbuf_stage(ddp_group *g, const ddp__call *k, const ddp__coll *c, ddp__call *host_call,
                                     ddp__devbuf_plan *plan) {
    (void)c;
    memset(plan, 0, sizeof *plan);
    *host_call = *k;
    (void)g;
    return DDP_SUCCESS;
}
static ddp_result ddp__devbuf_unstage(ddp_group *g, const ddp__coll *c, const ddp__devbuf_plan *plan) {
    (void)g, (void)c, (void)plan;
    return DDP_SUCCESS;
}
static int ddp__devbuf_copy_begin(ddp_group *g, void **dst, size_t dst_bytes, const void **src, size_t src_bytes,
                                  ddp__devbuf_plan *plan) {
    (void)g, (void)dst, (void)dst_bytes, (void)src, (void)src_bytes, (void)plan;
    return 0;
}
static void ddp__devbuf_copy_end(ddp_group *g, const ddp__devbuf_plan *plan) { (void)g, (void)plan; }
static ddp_result ddp__devbuf_set_stream(ddp_group *g, void *stream) {
    (void)stream;
    return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_set_stream: CUDA streams need a build with -DDDP_CUDA");
}
static void *ddp__devbuf_stream(const ddp_group *g) {
    (void)g;
    return NULL;
}
static ddp_result ddp__devbuf_inherit(ddp_group *sub, const ddp_group *parent) {
    (void)sub, (void)parent;
    return DDP_SUCCESS;
}
static void ddp__devbuf_free(ddp_group *g) { (void)g; }

#endif /* DDP_CUDA */
