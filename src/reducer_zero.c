/* [SECTION] reducer-zero: ZeRO stage 1 and 2 in the Reducer: slices of the buckets, the comm pool
   (reducer.c's head comment says where gradients live at each stage; reducer.h the API). */
#include "internal.h"
#include "reducer_state.h"

/* ---- ZeRO stage 2: the pool of comm buffers ----
   Under zero_stage = 2 a bucket owns only its slice (per elements, the gradients' dtype). The padded
   full-size buffer that the gradients are scaled into and reduce-scattered from is borrowed from a pool
   of DDP__ZERO2_POOL buffers, each big enough for the largest bucket (world * per elements in the larger
   of the comm and gradient dtypes, as gather_params stages the parameters in them too) plus, under
   compression, a landing area of per comm-dtype elements for the reduce-scatter's result:
     grad_ready, first gradient of bucket b: take a free buffer; if none is free, wait for the oldest
       reduce-scatter in flight (buckets start in order, so the lowest-numbered started bucket), finish
       it and take its buffer; if every buffer is held by a bucket that has not started (gradients that
       arrive far out of bucket order) the pool grows by one (at most one buffer per bucket). The buffer's
       padding [count, world * per) is zeroed then (an earlier, larger bucket may have written it).
     finish (the wait in grad_ready or end_backward): under compression the slice is converted from the
       landing area into the owned slice; the buffer is free again.
   Between passes every buffer is free; gather_params uses them in rotation. */
#define DDP__ZERO2_POOL 2

static uint64_t ddp__layout_gradient_bytes(const ddp_reducer *r, const ddp__layout *L);

/* One more pool buffer (the arrays have room for one per bucket). */
static ddp_result ddp__zero2_pool_grow(ddp_reducer *r) {
    void *mem;
    if (r->npool >= r->pool_room || !(mem = r->ops->alloc(r->g, r->pool_bytes)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "zero_stage 2: out of memory for comm buffer %d of the pool (%zu bytes)",
                         r->npool, r->pool_bytes);
    r->pool[r->npool] = mem;
    r->pool_holder[r->npool++] = -1;
    r->stats.gradient_bytes = ddp__layout_gradient_bytes(r, &r->L);
    return DDP_SUCCESS;
}

static ddp_result ddp__zero2_pool_alloc(ddp_reducer *r, const ddp__layout *L) {
    size_t world = (size_t)ddp_world_size(r->g), land = 0, full = 0;
    ddp_result res;
    int b;
    if (r->pool) return DDP_SUCCESS; /* the layout is built once under ZeRO; a retried finalize keeps the pool */
    for (b = 0; b < L->nbuckets; b++) {
        const ddp__bucket *k = &L->buckets[b];
        size_t cs = ddp_dtype_size(k->comm_dtype), gs = ddp_dtype_size(k->dtype);
        full = DDP__MAX(full, k->per * world * DDP__MAX(cs, gs));
        if (cs != gs) land = DDP__MAX(land, k->per * cs);
    }
    r->pool_land = (full + 63) / 64 * 64;
    r->pool_bytes = r->pool_land + land;
    r->pool_room = L->nbuckets;
    r->pool = (void **)ddp__calloc((size_t)L->nbuckets, sizeof *r->pool);
    r->pool_holder = (int *)ddp__calloc((size_t)L->nbuckets, sizeof *r->pool_holder);
    if (!r->pool || !r->pool_holder) {
        ddp__free(r->pool), ddp__free(r->pool_holder);
        r->pool = NULL, r->pool_holder = NULL;
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    }
    while (r->npool < DDP__MIN(DDP__ZERO2_POOL, L->nbuckets))
        if ((res = ddp__zero2_pool_grow(r)) != DDP_SUCCESS) return res;
    return DDP_SUCCESS;
}

/* Where bucket k's reduce-scatter writes this rank's slice: the owned slice itself; under compression
   the landing area of its pool buffer; in a pass that accumulates (zero_stage 3 after no_sync passes,
   without compression) this rank's own slice of the comm buffer, in place. */
static void *ddp__zero2_land(const ddp_reducer *r, const ddp__bucket *k) {
    if (k->comm_dtype != k->dtype) return (char *)r->pool[k->slot] + r->pool_land;
    if (r->accumulate) return (char *)k->comm + (size_t)ddp_rank(r->g) * k->per * ddp_dtype_size(k->comm_dtype);
    return k->owned;
}

/* Bucket k's reduce-scatter was waited for (done: successfully): its slice into the owned slice (added
   to it when the pass accumulates: zero_stage 3 after no_sync passes; the converted slice goes through
   the pool buffer's start, free by now), its buffer back to the pool. grad_stats: the slice is unscaled
   and counted (its padding past the bucket's end holds the reduce-scatter of zeros: it adds nothing). */
static void ddp__zero2_finish(ddp_reducer *r, ddp__bucket *k, int done) {
    void *land = ddp__zero2_land(r, k);
    if (done && r->accumulate) {
        void *sum = land;
        if (k->comm_dtype != k->dtype) {
            sum = r->pool[k->slot];
            r->ops->copy_out(r->g, sum, k->dtype, land, k->comm_dtype, k->per);
        }
        r->ops->accumulate(r->g, k->owned, sum, k->dtype, k->per);
    } else if (done && land != k->owned) {
        r->ops->copy_out(r->g, k->owned, k->dtype, land, k->comm_dtype, k->per);
    }
    if (done) ddp__amp_add(&r->amp, k->owned, k->dtype, k->per);
    r->pool_holder[k->slot] = -1;
    k->comm = NULL;
}

/* Bucket b's first gradient arrives: give it a pool buffer (see above). */
static ddp_result ddp__zero2_acquire(ddp_reducer *r, int b) {
    ddp__bucket *k = &r->L.buckets[b];
    size_t world = (size_t)ddp_world_size(r->g), cs = ddp_dtype_size(k->comm_dtype);
    ddp_result res;
    for (;;) {
        int s, oldest = -1;
        for (s = 0; s < r->npool && r->pool_holder[s] >= 0; s++) {
            const ddp__bucket *h = &r->L.buckets[r->pool_holder[s]];
            if (h->work && (oldest < 0 || r->pool_holder[s] < r->pool_holder[oldest])) oldest = s;
        }
        if (s < r->npool) { /* free */
            r->pool_holder[s] = b;
            k->slot = s;
            k->comm = r->pool[s];
            r->ops->zero(r->g, (char *)k->comm + k->count * cs, (k->per * world - k->count) * cs);
            return DDP_SUCCESS;
        }
        if (oldest >= 0) {
            ddp__bucket *h = &r->L.buckets[r->pool_holder[oldest]];
            res = ddp_wait(h->work);
            h->work = NULL;
            ddp__zero2_finish(r, h, res == DDP_SUCCESS);
            if (res) return ddp__reducer_stop(r, res);
            continue;
        }
        ddp__log(r->g, DDP_LOG_DEBUG, "reducer: zero_stage 2: the gradients of %d buckets arrived before any could start; "
                 "the pool grows to %d comm buffers", r->npool + 1, r->npool + 1);
        if ((res = ddp__zero2_pool_grow(r)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    }
}

/* Give a layout its memory: the comm buckets, and the gradient storage for views (flat buckets have the
   program's). */
static ddp_result ddp__layout_alloc(ddp_reducer *r, ddp__layout *L) {
    ddp_result res;
    int b;
    for (b = 0; b < L->nbuckets; b++) {
        ddp__bucket *k = &L->buckets[b];
        size_t gbytes = k->count * ddp_dtype_size(k->dtype), cbytes = k->count * ddp_dtype_size(k->comm_dtype);
        if (!ddp__reducer_is_view(r) && !ddp__zero2(r) && ddp__bucket_flat(r, L, b)) L->flat_buckets++;
        else if (ddp__reducer_is_view(r) && !(k->storage = r->ops->alloc(r->g, gbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, gbytes);
        if (ddp__reducer_zero(r)) {
            if ((res = ddp__zero_bucket_alloc(r, k, b)) != DDP_SUCCESS) return res;
        } else if (k->storage && k->comm_dtype == k->dtype)
            k->comm = k->storage;
        else if (!(k->comm = r->ops->alloc(r->g, cbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, cbytes);
    }
    return ddp__zero2(r) ? ddp__zero2_pool_alloc(r, L) : DDP_SUCCESS;
}

/* Bytes of gradient memory the reducer holds for a layout (statistics' gradient_bytes): storage it
   allocated (views; flat storage is the program's), comm buffers, owned slices, gather staging, the pool. */
static uint64_t ddp__layout_gradient_bytes(const ddp_reducer *r, const ddp__layout *L) {
    uint64_t total = (uint64_t)r->npool * r->pool_bytes + (uint64_t)r->ngradpool * r->gradpool_bytes;
    uint64_t world = (uint64_t)ddp_world_size(r->g);
    int b;
    for (b = 0; b < L->nbuckets; b++) {
        const ddp__bucket *k = &L->buckets[b];
        uint64_t gs = ddp_dtype_size(k->dtype), cs = ddp_dtype_size(k->comm_dtype);
        if (k->storage && !k->flat) total += k->count * gs;
        if (ddp__fsdp(r) && ((r->units[k->unit].flags & DDP_FSDP_KEEP) || r->desc.accumulate_unsharded))
            total += k->count * ddp_dtype_size(ddp__fsdp_dtype(r, k)); /* a unit's own gradient buffer */
        if (ddp__zero2(r))
            total += k->per * gs;
        else if (ddp__reducer_zero(r))
            total += k->per * world * cs + k->per * cs + (k->gather != k->comm ? k->per * world * gs : 0);
        else if (k->comm != k->storage)
            total += k->count * cs;
    }
    return total;
}

/* Where parameter i's gradient is in a layout's storage (views only). */
static void *ddp__layout_view(const ddp_reducer *r, const ddp__layout *L, int i) {
    const ddp__bucket *k = &L->buckets[L->param_bucket[i]];
    return (char *)k->storage + L->param_offset[i] * ddp_dtype_size(r->params[i].dtype);
}

/* Build the layout for `walk` and switch to it; views carry their gradients over. *taken: the layout
   is now walk's (built, or the same already), 0 when the current one was kept: a
   layout with fewer flat buckets than the current one is not taken, as the ready order (weight then bias,
   layer by layer) cuts a flat grads_memory into runs that are not adjacent, and copying every gradient
   in and out costs more than starting the buckets in the observed order gains. */
static ddp_result ddp__reducer_relayout(ddp_reducer *r, const int *walk, int *taken) {
    ddp__layout L;
    ddp_result res = ddp__layout_assign(r, walk, &L);
    int i;
    *taken = 0;
    if (res) return res;
    if (r->L.buckets && ddp__layout_same(r, &r->L, &L)) {
        ddp__layout_free(r, &L);
        *taken = 1;
        return DDP_SUCCESS;
    }
    if ((res = ddp__layout_alloc(r, &L)) != DDP_SUCCESS) {
        ddp__layout_free(r, &L);
        return res;
    }
    if (r->L.buckets && L.flat_buckets < r->L.flat_buckets) {
        ddp__log(r->g, DDP_LOG_DEBUG, "reducer: the buckets stay in registration order: in the observed ready order %d of "
                 "%d buckets would be slices of the program's gradients, against %d of %d now", L.flat_buckets, L.nbuckets,
                 r->L.flat_buckets, r->L.nbuckets);
        ddp__layout_free(r, &L);
        return DDP_SUCCESS;
    }
    *taken = 1;
    if (r->L.buckets && ddp__reducer_is_view(r))
        for (i = 0; i < r->nparams; i++)
            r->ops->copy_out(r->g, ddp__layout_view(r, &L, i), r->params[i].dtype, ddp__layout_view(r, &r->L, i),
                             r->params[i].dtype, r->params[i].count);
    ddp__layout_free(r, &r->L);
    r->L = L;
    r->stats.buckets = L.nbuckets;
    r->stats.flat_buckets = L.flat_buckets;
    r->stats.gradient_bytes = ddp__layout_gradient_bytes(r, &r->L);
    return DDP_SUCCESS;
}

/* ---- ZeRO stage 1: slices of the buckets ----
   Bucket k (count elements) is cut in world slices of per = ceil(count / world); rank r owns bucket
   elements [r * per, min(count, (r + 1) * per)). The reduce-scatter of the padded comm buffer gives each
   rank exactly that slice of the sum of the 1/world-scaled gradients. A shard is the intersection of the
   owned range with one parameter's range [param_offset, param_offset + param count) in the bucket. */

/* This rank's range of bucket k, in bucket elements ([*lo, *hi), empty when *lo >= *hi). */
static void ddp__zero_owned(const ddp_reducer *r, const ddp__bucket *k, size_t *lo, size_t *hi) {
    *lo = (size_t)ddp_rank(r->g) * k->per;
    *hi = DDP__MIN(k->count, *lo + k->per);
}

/* This rank's piece of parameter i: bucket elements [*a, *e) of its bucket, whose owned range starts at
   *lo. Returns 0 when it owns none of the parameter. */
static int ddp__zero_piece(const ddp_reducer *r, int i, size_t *lo, size_t *a, size_t *e) {
    size_t hi, po = r->L.param_offset[i];
    ddp__zero_owned(r, &r->L.buckets[r->L.param_bucket[i]], lo, &hi);
    *a = DDP__MAX(*lo, po);
    *e = DDP__MIN(hi, po + r->params[i].count);
    return *a < *e;
}

/* Where parameter i's gradient element e is (the program's buffer, or the bucket's storage). */
static char *ddp__zero_grad_at(const ddp_reducer *r, int i, size_t e) {
    const ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t es = ddp_dtype_size(r->params[i].dtype);
    if (k->storage) return (char *)k->storage + (r->L.param_offset[i] + e) * es;
    return (char *)r->params[i].grad + e * es;
}

/* The shard list, once at finalize (the layout never changes under ZeRO). */
static ddp_result ddp__zero_shards(ddp_reducer *r) {
    int b, j, n = 0;
    for (b = 0; b < r->L.nbuckets; b++) n += r->L.buckets[b].n;
    ddp__free(r->shards);
    ddp__free(r->shard_bucket);
    r->nshards = 0;
    r->shards = (ddp_shard *)ddp__calloc((size_t)n + 1, sizeof *r->shards);
    r->shard_bucket = (int *)ddp__calloc((size_t)n + 1, sizeof *r->shard_bucket);
    if (!r->shards || !r->shard_bucket) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    for (b = 0; b < r->L.nbuckets; b++) {
        const ddp__bucket *k = &r->L.buckets[b];
        for (j = k->first; j < k->first + k->n; j++) {
            int i = r->L.params[j];
            size_t lo, a, e;
            ddp_shard *s = &r->shards[r->nshards];
            if (!ddp__zero_piece(r, i, &lo, &a, &e)) continue;
            s->param = i;
            s->offset = a - r->L.param_offset[i];
            s->count = e - a;
            s->param_data = ddp__fsdp(r) ? (void *)((char *)k->master + (a - lo) * ddp_dtype_size(k->dtype))
                                         : (void *)((char *)r->params[i].data + s->offset * ddp_dtype_size(r->params[i].dtype));
            s->grad = ddp__zero2(r) ? (void *)((char *)k->owned + (a - lo) * ddp_dtype_size(k->dtype))
                                    : (void *)ddp__zero_grad_at(r, i, s->offset);
            r->shard_bucket[r->nshards++] = b;
        }
    }
    return DDP_SUCCESS;
}

/* The averaged gradient of this rank's part of parameter i goes back where the program reads it. */
static void ddp__zero_give_back(ddp_reducer *r, int i) {
    const ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t lo, a, e;
    if (!ddp__zero_piece(r, i, &lo, &a, &e)) return;
    r->ops->copy_out(r->g, ddp__zero_grad_at(r, i, a - r->L.param_offset[i]), r->params[i].dtype,
                     (char *)k->owned + (a - lo) * ddp_dtype_size(k->comm_dtype), k->comm_dtype, e - a);
    ddp__amp_add(&r->amp, ddp__zero_grad_at(r, i, a - r->L.param_offset[i]), r->params[i].dtype, e - a); /* grad_stats */
}

DDP_API int ddp_reducer_shards(ddp_reducer *r, const ddp_shard **out) {
    if (!r || !out || !r->finalized) {
        if (out) *out = NULL;
        if (r) ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_shards: %s", !out ? "out is NULL" :
                         "call ddp_reducer_finalize first");
        return -1;
    }
    *out = r->nshards ? r->shards : NULL;
    return r->nshards;
}

/* Bucket b's staging buffer gets this rank's owned parameter values at its slice (shards from *j on,
   which are in bucket order): a plain copy, as the staging has the parameters' dtype. */
static void ddp__zero_gather_fill(ddp_reducer *r, int b, int *j) {
    const ddp__bucket *k = &r->L.buckets[b];
    for (; *j < r->nshards && r->shard_bucket[*j] == b; ++*j) {
        const ddp_shard *s = &r->shards[*j];
        size_t at = r->L.param_offset[s->param] + s->offset;
        r->ops->copy_out(r->g, (char *)k->gather + at * ddp_dtype_size(k->dtype), k->dtype, s->param_data, k->dtype, s->count);
    }
}

/* Wait for bucket k's all_gather (if in flight) and copy every parameter of the bucket back from it (the
   owned part comes back unchanged). Returns res, or the wait's error when res was a success. */
static ddp_result ddp__zero_gather_finish(ddp_reducer *r, ddp__bucket *k, ddp_result res) {
    ddp_result waited;
    int j;
    if (!k->work) return res;
    waited = ddp_wait(k->work);
    k->work = NULL;
    if (!res) res = waited;
    for (j = k->first; j < k->first + k->n && !res; j++) {
        int i = r->L.params[j];
        r->ops->copy_out(r->g, r->params[i].data, r->params[i].dtype,
                         (char *)k->gather + r->L.param_offset[i] * ddp_dtype_size(k->dtype), k->dtype, r->params[i].count);
    }
    if (ddp__zero2(r)) k->gather = NULL; /* the pool buffer is free again */
    return res;
}

/* gather_params, overlapped with the next forward (torch's ZeroRedundancyOptimizer with
   overlap_with_ddp, DeepSpeed's prefetching): each bucket's owned parameter values go into its staging
   buffer at this rank's slice, then an all_gather (send = this rank's slice of recv, in place); when it
   is waited for, every parameter of the bucket is copied back from it. Buckets start in the order forward
   reads their parameters: the LAST bucket first (buckets fill in reverse registration order, so it holds
   the first registered parameters). Stage 1: every bucket has its staging, all start at once. Stage 2:
   the pool's buffers in rotation, so the bucket at start position q first finishes the one at q - npool,
   which held that buffer; the first npool start at once and the rest start when a wait reaches them.
   ddp_reducer_wait_param waits for one parameter's bucket (starting the ones before it if needed);
   begin_backward, the next gather and join settle whatever is left, so nothing reads a stale value. */
static ddp_result ddp__zero_gather_start_next(ddp_reducer *r) {
    int q = r->gather_next++, b = r->L.nbuckets - 1 - q, j = 0;
    ddp__bucket *k = &r->L.buckets[b];
    ddp_result res = DDP_SUCCESS;
    if (ddp__zero2(r)) {
        if (q >= r->npool && (res = ddp__zero_gather_finish(r, &r->L.buckets[b + r->npool], res)) != DDP_SUCCESS) return res;
        k->gather = r->pool[q % r->npool];
    }
    while (j < r->nshards && r->shard_bucket[j] != b) j++; /* the bucket's first shard (shards are in bucket order) */
    ddp__zero_gather_fill(r, b, &j);
    return ddp_all_gather_async(r->g, (char *)k->gather + (size_t)ddp_rank(r->g) * k->per * ddp_dtype_size(k->dtype), k->gather,
                                k->per, k->dtype, &k->work);
}

/* Bucket b's parameters are current: its all_gather (and every one before it in start order) started
   and waited for. */
static ddp_result ddp__zero_gather_wait_bucket(ddp_reducer *r, int b) {
    ddp_result res = DDP_SUCCESS;
    while (!res && r->gather_next <= r->L.nbuckets - 1 - b) res = ddp__zero_gather_start_next(r);
    return ddp__zero_gather_finish(r, &r->L.buckets[b], res);
}

/* Wait for every bucket of an async gather (the first error is kept; every started one is waited for). */
static ddp_result ddp__zero_gather_settle(ddp_reducer *r) {
    ddp_result res = DDP_SUCCESS;
    int b;
    if (!r->gathering) return DDP_SUCCESS;
    for (b = r->L.nbuckets - 1; b >= 0; b--) {
        ddp_result one = res ? ddp__zero_gather_finish(r, &r->L.buckets[b], res) : ddp__zero_gather_wait_bucket(r, b);
        if (!res) res = one;
    }
    if (ddp__zero2(r))
        for (b = 0; b < r->L.nbuckets; b++) r->L.buckets[b].gather = NULL;
    r->gathering = 0;
    if (res) ddp__reducer_stop(r, res);
    return res;
}

DDP_API ddp_result ddp_reducer_gather_params_async(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_gather_params");
    int first;
    if (res) return res;
    if (!ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_gather_params: the reducer was created with zero_stage = 0; "
                         "every rank already has every parameter (set zero_stage = 1 to shard the optimizer)");
    if (ddp__fsdp(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_gather_params: at zero_stage 3 each rank keeps only its master "
                         "shards, which the optimizer updates in place; the units are gathered when they are used "
                         "(ddp_fsdp_gather / ddp_fsdp_wait)");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_gather_params: called during a backward pass; call it after "
                         "end_backward and the optimizer step on this rank's shards");
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res; /* the previous one, not waited for */
    r->gathering = 1;
    r->gather_next = 0;
    first = ddp__zero2(r) ? DDP__MIN(r->npool, r->L.nbuckets) : r->L.nbuckets;
    while (!res && r->gather_next < first) res = ddp__zero_gather_start_next(r);
    r->join_gather_due = 0;
    return res ? ddp__zero_gather_settle(r) : DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_wait_param(ddp_reducer *r, int index) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_wait_param");
    if (res) return res;
    if (index < -1 || index >= r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_wait_param: index %d is not a parameter (0..%d) or -1 "
                         "(all)", index, r->nparams - 1);
    if (!r->gathering) return DDP_SUCCESS;
    if (index < 0) return ddp__zero_gather_settle(r);
    if ((res = ddp__zero_gather_wait_bucket(r, r->L.param_bucket[index])) != DDP_SUCCESS) ddp__zero_gather_settle(r);
    return res;
}

DDP_API ddp_result ddp_reducer_gather_params(ddp_reducer *r) {
    ddp_result res = ddp_reducer_gather_params_async(r);
    return res ? res : ddp__zero_gather_settle(r);
}

/* ZeRO-2 keeps the averaged gradient slices in the reducer's own buckets (ddp_reducer_shards' grad),
   which are the backend's memory: host memory on the cpu and mpi backends. A model in device memory
   there (devbuf.c stages the rest of the reducer) would have an optimizer kernel read host memory, so
   that combination is refused; ZeRO-1's shards point into the program's own gradients and work. */
static ddp_result ddp__zero2_check_memory(ddp_reducer *r) {
#ifdef DDP_CUDA
    int i;
    if (!ddp__zero2(r) || ddp__fsdp(r) || !strcmp(r->ops->family, "nccl")) return DDP_SUCCESS; /* 3: offload */
    for (i = 0; i < r->nparams; i++)
        if (ddp__cuda_is_device_pointer(r->params[i].data) || ddp__cuda_is_device_pointer(r->params[i].grad))
            return ddp__fail(r->g, DDP_ERR_UNSUPPORTED, "ddp_reducer_finalize: zero_stage = %d with parameter \"%s\" in device "
                             "memory on backend %s is not supported: ZeRO's gradient slices would be the reducer's host "
                             "memory, which an optimizer on the device cannot read; use zero_stage = 1 (its shards are "
                             "slices of your device gradients) or backend nccl", r->desc.zero_stage, r->params[i].name,
                             r->ops->family);
#else
    (void)r;
#endif
    return DDP_SUCCESS;
}

/* grad_stats and loss_scale read and write the averaged gradients on the host, in the pass that gives
   them back: gradients in device memory (backend nccl; a device model staged by the cpu and mpi
   backends) would need device kernels there, so that combination is refused. */
static ddp_result ddp__grad_stats_check_memory(ddp_reducer *r) {
#ifdef DDP_CUDA
    int i;
    const char *why = "the reducer computes them on the host; unset grad_stats and loss_scale and run "
                      "ddp_cuda_non_finite_check_and_unscale (and your own norm) on the device gradients";
    if (!ddp__grad_stats_on(r)) return DDP_SUCCESS;
    if (!strcmp(r->ops->family, "nccl"))
        return ddp__fail(r->g, DDP_ERR_UNSUPPORTED, "ddp_reducer_finalize: grad_stats / loss_scale on backend nccl (device "
                         "gradients) is not supported: %s", why);
    for (i = 0; i < r->nparams; i++)
        if (ddp__cuda_is_device_pointer(r->params[i].grad))
            return ddp__fail(r->g, DDP_ERR_UNSUPPORTED, "ddp_reducer_finalize: grad_stats / loss_scale with the gradient of "
                             "\"%s\" in device memory is not supported: %s", r->params[i].name, why);
#else
    (void)r;
#endif
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_finalize(ddp_reducer *r) {
    ddp_result res;
    int i, n;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_finalize: the reducer is NULL");
    if (r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_finalize: already finalized");
    if ((res = ddp__zero2_check_memory(r)) != DDP_SUCCESS) return res; /* local: every rank's model is alike */
    if ((res = ddp__grad_stats_check_memory(r)) != DDP_SUCCESS) return res;
    /* the check comes first, so that a rank with a wrong model still takes part and every rank learns */
    if ((res = ddp__reducer_verify(r)) != DDP_SUCCESS) return res;
    if (r->nparams == 0)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_finalize: no parameters were registered "
                         "(ddp_reducer_add_param); DDP needs at least one");
    n = r->nparams;
    if (!r->ready) r->ready = (unsigned char *)ddp__calloc((size_t)n, 1); /* kept if an earlier finalize failed */
    if (!r->used) r->used = (unsigned char *)ddp__calloc((size_t)n, 1);
    if (!r->order) r->order = (int *)ddp__calloc((size_t)n, sizeof *r->order);
    r->bstage_bytes = ddp__stage_bytes(r->buffers, r->nbuffers);
    if (!r->bstage && r->bstage_bytes) r->bstage = r->ops->alloc(r->g, r->bstage_bytes);
    if (r->desc.find_unused_parameters && !r->used_comm) r->used_comm = (unsigned char *)r->ops->alloc(r->g, (size_t)n);
    if (r->desc.find_unused_parameters && !r->used_global) r->used_global = (unsigned char *)ddp__calloc((size_t)n, 1);
    if (!r->ready || !r->used || !r->order || (r->bstage_bytes && !r->bstage) ||
        (r->desc.find_unused_parameters && (!r->used_comm || !r->used_global)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if (r->desc.uneven_inputs && !r->join_table)
        r->join_table = (int32_t *)ddp__calloc((size_t)ddp_world_size(r->g) + 1, DDP__JOIN_FIELDS * sizeof(int32_t));
    if (r->desc.uneven_inputs && !r->join_table) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if (!r->ready_ns) r->ready_ns = (int64_t *)ddp__calloc((size_t)ddp_world_size(r->g) + 1, sizeof(int64_t));
    if (!r->ready_comm) r->ready_comm = r->ops->alloc(r->g, ((size_t)ddp_world_size(r->g) + 1) * sizeof(int64_t));
    if (!r->ready_ns || !r->ready_comm) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    r->ready_world = ddp_world_size(r->g);
    r->finalized = 1;
    if ((res = ddp__reducer_sync_states(r, 0, "ddp_reducer_finalize")) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    for (i = 0; i < n; i++) r->order[i] = n - 1 - i; /* reverse registration order */
    if ((res = ddp__reducer_relayout(r, r->order, &i)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    if (ddp__reducer_zero(r) && (res = ddp__zero_shards(r)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    if ((res = ddp__fsdp_finalize(r)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    /* no rebuild under ZeRO (shards never move) nor with units (they are the buckets) */
    /* fault-tolerant mode keeps the registration order (a frozen layout, the same in every view) */
    r->rebuild_pending = !r->desc.find_unused_parameters && !ddp__reducer_zero(r) && !r->nunits && !r->g->ft_mode;
    return DDP_SUCCESS;
}

