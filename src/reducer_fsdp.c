/* [SECTION] reducer-fsdp: FSDP units: ZeRO stage 3's gather pool, gathered parameters, unit gradients
   (reducer.h "FSDP" has the API and its rules; reducer_pass.c sends the unit gradients on).

   A unit is a run of registered parameters and one bucket (reducer.c's layout cuts buckets at unit
   boundaries). At zero_stage 3 each rank keeps the bucket's slice of the parameters, its MASTER shard
   (per elements, the registered dtype, padded with zeros), besides stage 2's gradient slice. Gathering
   a unit:
       take a free buffer of the gather pool (1 + prefetch buffers of world * per elements of the largest
       unit, in param_dtype; a KEEP unit has its own buffer)
       copy the master shard into the buffer at rank * per, cast to param_dtype
       all_gather in place (send = this rank's part of the buffer), fingerprinted with the unit and the
       phase (DDP__PURPOSE): ranks gathering different units fail with DDP_ERR_MISMATCH naming both
   The buffer then holds the unit in its bucket layout: parameter i at its bucket offset. Nothing is
   allocated after finalize, except the gradient pool, which grows by one buffer when every one is taken
   (as stage 2's comm pool does). A unit's gradient buffer is taken at the first ddp_fsdp_grad of a pass
   (reducer_pass.c), zeroed, and read by ddp_fsdp_grads_ready (x 1/world into stage 2's comm buffer, whose
   reduce-scatter leaves this rank's slice): when the gradients have the comm dtype it IS that comm
   buffer, scaled in place (no memory of its own); with param_dtype or compression it is a buffer of the
   gradient pool (the unit's count in param_dtype), given back after the copy; a KEEP unit's is its own. */
#include "internal.h"
#include "reducer_state.h"

/* The dtype of a bucket's gathered parameters and of the gradients the program writes for it. */
static ddp_dtype ddp__fsdp_dtype(const ddp_reducer *r, const ddp__bucket *k) {
    return ddp__fsdp(r) && r->desc.param_dtype != DDP_DTYPE_DEFAULT ? r->desc.param_dtype : k->dtype;
}

/* Does unit u's gradient buffer live in its bucket's comm buffer (reducer_pass.c's ddp__fsdp_grad_take)?
   When the program's gradients have the comm dtype, are in host memory, the unit is not KEEP and its
   gradients are not kept across no_sync passes (accumulate_unsharded). */
static int ddp__fsdp_in_comm(const ddp_reducer *r, const ddp__unit *u) {
    const ddp__bucket *k = &r->L.buckets[u->bucket];
    return !(u->flags & DDP_FSDP_KEEP) && ddp__fsdp_dtype(r, k) == k->comm_dtype && !r->offload &&
           !r->desc.accumulate_unsharded;
}

/* ---- device parameters on a host backend (CPUOffloadPolicy) ----
   With DDP_CUDA, a model registered in device memory on the cpu or mpi backend: what the program reads and
   writes (the gathered units and the unit gradient buffers) is device memory, the rest stays on the host
   (master shards, gradient slices, stage 2's comm pool, and so the optimizer: ddp_reducer_shards is host
   memory). The collectives and copies stage the device side through the group's pinned memory
   (devbuf.c): a unit's all-gather runs into its device buffer, its gradients go from the device into the
   host comm buffer, scaled, before their reduce-scatter. torch FSDP2's CPUOffloadPolicy moves the same
   data the same way. Exact: the same host arithmetic; slow: each copy waits for the group's stream. */
static void *ddp__fsdp_alloc(ddp_reducer *r, size_t bytes) {
#ifdef DDP_CUDA
    if (r->offload) {
        char err[DDP__ERR_MAX];
        void *p = NULL;
        if (ddp__cuda_device_alloc(bytes, &p, err, sizeof err) != DDP_SUCCESS) {
            ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "zero_stage 3: %s", err);
            return NULL;
        }
        return p;
    }
#endif
    return r->ops->alloc(r->g, bytes);
}

static void ddp__fsdp_free_mem(ddp_reducer *r, void *p) {
    if (!p) return;
#ifdef DDP_CUDA
    if (r->offload) {
        ddp__cuda_device_free(p);
        return;
    }
#endif
    r->ops->release(r->g, p);
}

/* Device parameters or host ones, alike for every parameter (checked at finalize). */
static ddp_result ddp__fsdp_memory_kind(ddp_reducer *r) {
#ifdef DDP_CUDA
    int i, first = ddp__cuda_is_device_pointer(r->params[0].data) == 1;
    for (i = 1; i < r->nparams; i++)
        if ((ddp__cuda_is_device_pointer(r->params[i].data) == 1) != first)
            return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_finalize: zero_stage 3: parameter \"%s\" is %s memory "
                             "but \"%s\" is %s: register every parameter in device memory (the units are gathered there) "
                             "or every one in host memory", r->params[i].name, first ? "host" : "device", r->params[0].name,
                             first ? "device" : "host");
    r->offload = first && strcmp(r->ops->family, "nccl") != 0;
#else
    (void)r;
#endif
    return DDP_SUCCESS;
}

DDP_API int ddp_fsdp_unit(ddp_reducer *r, const char *name, int flags) {
    ddp__unit *u;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_fsdp_unit: the reducer is NULL");
    if (!name || !*name) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_fsdp_unit: the name is NULL or empty");
    if (r->finalized)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_fsdp_unit(\"%s\"): the reducer is already finalized; open every unit "
                         "before ddp_reducer_finalize", name);
    if (flags & ~DDP_FSDP_KEEP)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_fsdp_unit(\"%s\"): flags 0x%x: the only flag is DDP_FSDP_KEEP",
                         name, (unsigned)flags);
    if (r->nunits && r->units[r->nunits - 1].n == 0)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_fsdp_unit(\"%s\"): unit \"%s\" got no parameters; register a "
                         "unit's parameters (ddp_reducer_add_param) before opening the next", name,
                         r->units[r->nunits - 1].name);
    if (r->nunits == 0 && r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_fsdp_unit(\"%s\"): %d parameters were registered before the "
                         "first unit; with units, every parameter belongs to one: open the first unit before registering",
                         name, r->nparams);
    if (r->nunits == r->cap_units) {
        int nc = r->cap_units ? r->cap_units * 2 : 16;
        ddp__unit *p = (ddp__unit *)DDP_REALLOC(r->units, (size_t)nc * sizeof *p);
        if (!p) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_fsdp_unit(\"%s\"): out of memory", name);
        r->units = p;
        r->cap_units = nc;
    }
    u = &r->units[r->nunits];
    memset(u, 0, sizeof *u);
    if (!(u->name = ddp__strdup(name))) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_fsdp_unit(\"%s\"): out of memory", name);
    u->flags = flags;
    u->first = r->nparams;
    u->slot = u->grad_slot = -1;
    return r->nunits++;
}

DDP_API ddp_result ddp_reducer_param_shape(ddp_reducer *r, int param, int ndim, const int64_t *shape) {
    int64_t numel = 1;
    int d;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_shape: the reducer is NULL");
    if (r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_param_shape: call it before ddp_reducer_finalize");
    if (param < 0 || param >= r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_shape: %d is not a parameter (0 .. %d)", param,
                         r->nparams - 1);
    if (ndim < 0 || ndim > 8 || (ndim && !shape))
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_shape(\"%s\"): ndim %d is not 0 .. 8 (with a "
                         "shape)", r->params[param].name, ndim);
    for (d = 0; d < ndim; d++) numel = shape[d] >= 0 && numel <= INT64_MAX / (shape[d] ? shape[d] : 1) ? numel * shape[d] : -1;
    if (ndim && numel != (int64_t)r->params[param].count)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_shape(\"%s\"): the shape holds %lld elements, the "
                         "parameter %zu", r->params[param].name, (long long)numel, r->params[param].count);
    r->params[param].ndim = ndim;
    for (d = 0; d < ndim; d++) r->params[param].shape[d] = shape[d];
    return DDP_SUCCESS;
}

/* ---- at finalize ---- */

/* Stage 3's memory besides the buckets' (reducer.c gives each its master shard and slice): the gather
   pool, the KEEP units' buffers, one gradient buffer to start the gradient pool; then the master shards
   get this rank's slices of the (broadcast) initial values. Called once the layout and shards exist. */
static ddp_result ddp__fsdp_finalize(ddp_reducer *r) {
    size_t world = (size_t)ddp_world_size(r->g), gather = 0, grads = 0;
    int b, s;
    ddp_result res;
    if (!ddp__fsdp(r)) return DDP_SUCCESS;
    if ((res = ddp__fsdp_memory_kind(r)) != DDP_SUCCESS) return res;
    for (b = 0; b < r->L.nbuckets; b++) {
        const ddp__bucket *k = &r->L.buckets[b];
        size_t ps = ddp_dtype_size(ddp__fsdp_dtype(r, k));
        r->units[k->unit].bucket = b;
        if (r->units[k->unit].flags & DDP_FSDP_KEEP) continue;
        gather = DDP__MAX(gather, k->per * world * ps);
        grads = DDP__MAX(grads, k->count * ps);
    }
    r->gpool_bytes = gather, r->gradpool_bytes = grads;
    r->ngpool = 1 + r->desc.prefetch;
    r->gpool = (void **)ddp__calloc((size_t)r->ngpool, sizeof *r->gpool);
    r->gpool_holder = (int *)ddp__calloc((size_t)r->ngpool, sizeof *r->gpool_holder);
    r->gradpool = (void **)ddp__calloc((size_t)r->nunits, sizeof *r->gradpool);
    r->gradpool_holder = (int *)ddp__calloc((size_t)r->nunits, sizeof *r->gradpool_holder);
    if (!r->gpool || !r->gpool_holder || !r->gradpool || !r->gradpool_holder) goto oom;
    for (s = 0; s < r->ngpool; s++) r->gpool_holder[s] = -1;
    for (s = 0; s < r->ngpool && gather; s++)
        if (!(r->gpool[s] = ddp__fsdp_alloc(r, gather))) goto oom;
    for (b = 0; b < r->L.nbuckets; b++) {
        const ddp__bucket *k = &r->L.buckets[b];
        ddp__unit *u = &r->units[k->unit];
        size_t ps = ddp_dtype_size(ddp__fsdp_dtype(r, k));
        if ((u->flags & DDP_FSDP_KEEP) && !(u->own = ddp__fsdp_alloc(r, k->per * world * ps))) goto oom;
        if (((u->flags & DDP_FSDP_KEEP) || r->desc.accumulate_unsharded) && !(u->grad_own = ddp__fsdp_alloc(r, k->count * ps)))
            goto oom;
    }
    for (s = 0; s < r->nshards; s++) { /* the master shards: this rank's slices of the initial values */
        const ddp_shard *sh = &r->shards[s];
        const ddp__rtensor *p = &r->params[sh->param];
        r->ops->copy_out(r->g, sh->param_data, p->dtype, (char *)p->data + sh->offset * ddp_dtype_size(p->dtype), p->dtype,
                         sh->count);
    }
    r->stats.param_bytes_peak = (uint64_t)r->ngpool * gather;
    for (b = 0; b < r->L.nbuckets; b++) {
        const ddp__bucket *k = &r->L.buckets[b];
        r->stats.param_bytes_peak += k->per * ddp_dtype_size(k->dtype);
        if (r->units[k->unit].flags & DDP_FSDP_KEEP)
            r->stats.param_bytes_peak += k->per * world * ddp_dtype_size(ddp__fsdp_dtype(r, k));
    }
    return DDP_SUCCESS;
oom:
    return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: zero_stage 3: out of memory for the gather pool "
                     "(%d x %zu bytes), a KEEP unit's buffers or (accumulate_unsharded) a unit's gradient buffer", r->ngpool,
                     gather);
}

/* ---- gathering ---- */

/* Unit id valid at zero_stage 3, the reducer usable: else the error, naming fn. */
static ddp_result ddp__fsdp_check(ddp_reducer *r, int unit, const char *fn) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!ddp__fsdp(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created with zero_stage = %d; units are gathered and "
                         "released at zero_stage = 3 only (at stages 0-2 every rank holds every parameter)", fn,
                         r->desc.zero_stage);
    if (unit < 0 || unit >= r->nunits)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "%s: unit %d is not a unit (0 .. %d)", fn, unit, r->nunits - 1);
    return DDP_SUCCESS;
}

/* "3 (\"layer3\"), 4 (\"layer4\")": the units holding the gather pool, for the overrun message. */
static void ddp__fsdp_holders(const ddp_reducer *r, char *out, size_t cap) {
    size_t len = 0;
    int s;
    out[0] = '\0';
    for (s = 0; s < r->ngpool && len < cap; s++)
        len += (size_t)snprintf(out + len, cap - len, "%s%d (\"%s\")", s ? ", " : "", r->gpool_holder[s],
                                r->units[r->gpool_holder[s]].name);
}

DDP_API ddp_result ddp_fsdp_gather(ddp_reducer *r, int unit) {
    ddp_result res = ddp__fsdp_check(r, unit, "ddp_fsdp_gather");
    ddp__unit *u;
    ddp__bucket *k;
    ddp_dtype pt;
    size_t ps, mine;
    int s = 0;
    if (res) return res;
    u = &r->units[unit];
    if (u->state != DDP__UNIT_SHARDED) return DDP_SUCCESS; /* gathered or on its way */
    k = &r->L.buckets[u->bucket];
    if (u->flags & DDP_FSDP_KEEP) {
        u->gathered = u->own;
    } else {
        char held[400];
        while (s < r->ngpool && r->gpool_holder[s] >= 0) s++;
        if (s == r->ngpool) {
            ddp__fsdp_holders(r, held, sizeof held);
            return ddp__fail(r->g, DDP_ERR_STATE, "ddp_fsdp_gather(unit %d \"%s\"): the gather pool is full: its %d "
                             "buffers (1 + prefetch %d) hold units %s. Release a unit (ddp_fsdp_release) before gathering "
                             "the next, or raise prefetch in ddp_reducer_desc; nothing was started", unit, u->name,
                             r->ngpool, r->desc.prefetch, held);
        }
        r->gpool_holder[s] = unit;
        u->slot = s;
        u->gathered = r->gpool[s];
    }
    pt = ddp__fsdp_dtype(r, k);
    ps = ddp_dtype_size(pt);
    mine = (size_t)ddp_rank(r->g) * k->per * ps;
    r->ops->copy_out(r->g, (char *)u->gathered + mine, pt, k->master, k->dtype, k->per);
    u->t_issued = ddp__now();
    r->g->purpose = DDP__PURPOSE(DDP__PHASE_GATHER, unit);
    res = ddp_all_gather_async(r->g, (char *)u->gathered + mine, u->gathered, k->per, pt, &u->work);
    r->g->purpose = 0;
    r->stats.gathers++;
    u->state = DDP__UNIT_GATHERING;
    if (res) ddp__reducer_stop(r, res);
    return res;
}

/* Wait for u's all-gather in flight (if any): its time into the statistics. */
static ddp_result ddp__fsdp_finish(ddp_reducer *r, ddp__unit *u) {
    double ran[3];
    ddp_result res;
    if (u->state != DDP__UNIT_GATHERING) return DDP_SUCCESS;
    res = ddp__wait_times(u->work, ran);
    u->work = NULL;
    u->state = DDP__UNIT_GATHERED;
    r->stats.gather_seconds += (ran[1] > 0 ? ran[1] : ddp__now()) - u->t_issued;
    if (res) ddp__reducer_stop(r, res);
    return res;
}

DDP_API ddp_result ddp_fsdp_wait(ddp_reducer *r, int unit) {
    ddp_result res = ddp__fsdp_check(r, unit, "ddp_fsdp_wait");
    double t0 = ddp__now();
    ddp__unit *u;
    if (res) return res;
    u = &r->units[unit];
    if (u->state == DDP__UNIT_SHARDED) {
        r->stats.unprefetched_waits++;
        if ((res = ddp_fsdp_gather(r, unit)) != DDP_SUCCESS) return res;
    }
    res = ddp__fsdp_finish(r, u);
    r->stats.gather_wait_seconds += ddp__now() - t0;
    return res;
}

DDP_API void *ddp_fsdp_param(ddp_reducer *r, int index) {
    const ddp__unit *u;
    const ddp__bucket *k;
    if (!r || !r->finalized || !ddp__fsdp(r) || index < 0 || index >= r->nparams) return NULL;
    u = &r->units[r->params[index].unit];
    if (u->state != DDP__UNIT_GATHERED) return NULL;
    k = &r->L.buckets[u->bucket];
    return (char *)u->gathered + r->L.param_offset[index] * ddp_dtype_size(ddp__fsdp_dtype(r, k));
}

/* Back to SHARDED: a gather in flight is waited for first; the pool buffer is free again. */
static ddp_result ddp__fsdp_reshard(ddp_reducer *r, ddp__unit *u) {
    ddp_result res = ddp__fsdp_finish(r, u);
    if (u->slot >= 0) r->gpool_holder[u->slot] = -1;
    u->slot = -1;
    u->gathered = NULL;
    u->state = DDP__UNIT_SHARDED;
    return res;
}

DDP_API ddp_result ddp_fsdp_release(ddp_reducer *r, int unit) {
    ddp_result res = ddp__fsdp_check(r, unit, "ddp_fsdp_release");
    if (res) return res;
    if (r->units[unit].flags & DDP_FSDP_KEEP) return DDP_SUCCESS; /* resharded by end_backward */
    return ddp__fsdp_reshard(r, &r->units[unit]);
}

/* end_backward (and destroy): every unit sharded again, KEEP units too; every gradient buffer back. The
   first error is returned; every gather in flight is waited for. */
static ddp_result ddp__fsdp_reshard_all(ddp_reducer *r) {
    ddp_result res = DDP_SUCCESS, one;
    int i;
    for (i = 0; i < r->nunits && ddp__fsdp(r); i++) {
        if ((one = ddp__fsdp_reshard(r, &r->units[i])) != DDP_SUCCESS && !res) res = one;
        ddp__fsdp_grad_put_back(r, &r->units[i]);
        r->units[i].grads_done = 0;
    }
    return res;
}

/* ---- unit gradients ---- */

/* u's gradient buffer goes back (a pool buffer is free again; a KEEP unit's stays its own). */
static void ddp__fsdp_grad_put_back(ddp_reducer *r, ddp__unit *u) {
    if (u->grad_slot >= 0) r->gradpool_holder[u->grad_slot] = -1;
    u->grad_slot = -1;
    u->grad = NULL;
}

/* ---- for fsdp_checkpoint.c ---- */

/* A zero_stage 3 reducer between passes (fn names the caller): its group, units and parameters. */
static ddp_result ddp__fsdp_model(ddp_reducer *r, const char *fn, ddp_group **g, int *nunits, int *nparams) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!ddp__fsdp(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created with zero_stage = %d; at stages 0-2 every rank "
                         "holds the whole model: save it with ddp_checkpoint_save", fn, r->desc.zero_stage);
    if (r->in_backward) return ddp__fail(r->g, DDP_ERR_STATE, "%s: called during a backward pass; call it between steps", fn);
    *g = r->g, *nunits = r->nunits, *nparams = r->nparams;
    return DDP_SUCCESS;
}

/* Parameter i as a tensor of the full model (name, registered dtype, its shape or 1-D; data NULL), its
   unit, and where it sits in that unit's gathered master (elements). */
static void ddp__fsdp_param_tensor(const ddp_reducer *r, int i, ddp_tensor *t, int *unit, size_t *at) {
    const ddp__rtensor *p = &r->params[i];
    int d;
    memset(t, 0, sizeof *t);
    t->name = p->name, t->dtype = p->dtype;
    t->ndim = p->ndim ? p->ndim : 1;
    t->shape[0] = (int64_t)p->count;
    for (d = 0; d < p->ndim; d++) t->shape[d] = p->shape[d];
    *unit = p->unit;
    *at = r->L.param_offset[i];
}

/* Bytes of the largest unit's gathered master (world * per elements, registered dtype). */
static size_t ddp__fsdp_master_bytes(const ddp_reducer *r) {
    size_t most = 0, world = (size_t)ddp_world_size(r->g);
    int b;
    for (b = 0; b < r->L.nbuckets; b++)
        most = DDP__MAX(most, r->L.buckets[b].per * world * ddp_dtype_size(r->L.buckets[b].dtype));
    return most;
}

/* Where root gathers a unit's master before copying it to host memory: NULL on the host backends (into the
   host buffer directly); on nccl, whose master shards are device memory, a device buffer of the largest
   unit (*failed: out of memory). ddp__fsdp_master_unstage frees it. */
static void *ddp__fsdp_master_stage(ddp_reducer *r, int *failed) {
    void *p = NULL;
    if (strcmp(r->ops->family, "nccl") == 0 && !(p = r->ops->alloc(r->g, ddp__fsdp_master_bytes(r)))) *failed = 1;
    return p;
}

static void ddp__fsdp_master_unstage(ddp_reducer *r, void *stage) {
    if (stage) r->ops->release(r->g, stage);
}

/* Collective: unit u's master shards, every rank's, into buf on root (host memory; the unit in its bucket
   layout), through stage (ddp__fsdp_master_stage) when there is one. */
static ddp_result ddp__fsdp_gather_master(ddp_reducer *r, int u, void *buf, void *stage, int root) {
    const ddp__bucket *k = &r->L.buckets[r->units[u].bucket];
    const size_t n = k->per * (size_t)ddp_world_size(r->g);
    ddp_result res;
    r->g->purpose = DDP__PURPOSE(DDP__PHASE_GATHER, u);
    res = ddp_gather(r->g, k->master, stage ? stage : buf, k->per, k->dtype, root);
    r->g->purpose = 0;
    if (!res && stage && ddp_rank(r->g) == root) r->ops->copy_out(r->g, buf, k->dtype, stage, k->dtype, n);
    return res; /* a failed copy breaks the group (the backend's copy_out): the next collective fails */
}

/* destroy: the memory of the units and the pools (every gather was waited for by reshard_all). */
static void ddp__fsdp_free(ddp_reducer *r) {
    int i;
    for (i = 0; i < r->nunits; i++) {
        ddp__fsdp_free_mem(r, r->units[i].own);
        ddp__fsdp_free_mem(r, r->units[i].grad_own);
        ddp__free(r->units[i].name);
    }
    for (i = 0; r->gpool && i < r->ngpool; i++) ddp__fsdp_free_mem(r, r->gpool[i]);
    for (i = 0; i < r->ngradpool; i++) ddp__fsdp_free_mem(r, r->gradpool[i]);
    ddp__free(r->units);
    ddp__free(r->gpool);
    ddp__free(r->gpool_holder);
    ddp__free(r->gradpool);
    ddp__free(r->gradpool_holder);
}
