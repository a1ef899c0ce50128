/* [SECTION] hostmem: the memory slots of the host backends (cpu: shm, tcp, hier; mpi)
   What the reducer asks of a backend's memory: the alloc, release, zero, copy_in_scaled, copy_out and
   accumulate slots of ddp__backend (internal.h). Buckets are in the backend's memory (host memory for cpu and mpi;
   device memory for nccl, where the copies run on the group's stream). Besides these, finalize and the rebuild pass small host arrays to
   ddp_all_gather and ddp_broadcast (the model check, the ready order) and broadcast parameters and
   buffers where they are: a backend whose collectives take device memory accepts host memory for
   those (nccl runs them on its host transport). The functions below are the host versions, which every
   backend but nccl uses. */
#include "internal.h"

/* Bucket memory comes from ddp_alloc (zero-filled): on a group that shares one host it lives in this
   rank's arena of the shared segment, so the buckets' all-reduces read the peers' buckets directly (the
   single-copy design, (3p-1)N bytes of memory traffic instead of (5p+1)N); elsewhere it is heap memory. */
static void *ddp__host_alloc(ddp_group *g, size_t bytes) { return ddp_alloc(g, bytes); }
static void ddp__host_release(ddp_group *g, void *p) { ddp_free(g, p); }
static void ddp__host_zero(ddp_group *g, void *dst, size_t bytes) {
    ddp__devbuf_plan plan;
    const void *none = NULL;
    int staged = bytes ? ddp__devbuf_copy_begin(g, &dst, bytes, &none, 0, &plan) : 0; /* device memory: devbuf.c */
    if (staged < 0) return;
    if (bytes) memset(dst, 0, bytes);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

/* The copies on host memory; a gradient or parameter in device memory (on the cpu and mpi backends, in a
   build with DDP_CUDA) is staged through the group's pinned memory around them (devbuf.c). */
static void ddp__host_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                    size_t count, double scale) {
    ddp__devbuf_plan plan;
    int staged = count ? ddp__devbuf_copy_begin(g, &dst, count * ddp_dtype_size(dst_t), &src,
                                                count * ddp_dtype_size(src_t), &plan) : 0;
    if (staged < 0) return;
    ddp__host_convert_scaled(dst, dst_t, src, src_t, count, scale);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

static void ddp__host_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    ddp__devbuf_plan plan;
    int staged = count ? ddp__devbuf_copy_begin(g, &dst, count * ddp_dtype_size(dst_t), &src,
                                                count * ddp_dtype_size(src_t), &plan) : 0;
    if (staged < 0) return;
    ddp__host_convert(dst, dst_t, src, src_t, count);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

/* The reducer's own slices are host memory on these backends (devbuf.c stages only the program's device
   tensors), so the add needs no staging. */
static void ddp__host_accumulate(ddp_group *g, void *dst, const void *src, ddp_dtype t, size_t count) {
    (void)g;
    ddp__reduce(dst, src, count, t, DDP_SUM);
}
