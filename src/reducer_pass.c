/* [SECTION] reducer-pass: the Reducer's passes: backward, between passes, uneven inputs (Join)
   (reducer.c's head comment has the life of a reducer; reducer.h the API). */
#include "internal.h"
#include "reducer_state.h"

/* ---- backward ---- */

static ddp_result ddp__join_announce(ddp_reducer *r, int kind, const char *fn, int *root);

DDP_API void *ddp_reducer_grad(ddp_reducer *r, int index) {
    if (!r || index < 0 || index >= r->nparams) return NULL;
    if (!ddp__reducer_is_view(r)) return r->params[index].grad;
    return r->L.buckets ? ddp__layout_view(r, &r->L, index) : NULL;
}

DDP_API ddp_result ddp_reducer_begin_backward(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_begin_backward");
    int b;
    if (res) return res;
    if (r->in_backward && r->pass_view != r->g->ft_views) /* the view changed under it: the pass is void */
        ddp__reducer_stop(r, DDP_ERR_VIEW_CHANGED);
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_begin_backward: the previous backward pass has not ended; call "
                         "ddp_reducer_end_backward after each backward pass");
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res; /* forward has read the parameters */
    ddp__timing_finish(r);
    r->samples_due = r->pass_joined = 0; /* (the join round sets them) */
    if (r->desc.uneven_inputs && (res = ddp__join_announce(r, DDP__JOIN_STEP, "ddp_reducer_begin_backward", NULL)) != DDP_SUCCESS)
        return res;
    r->in_backward = 1;
    r->pass_view = r->g->ft_views;
    /* zero_stage 3 reduce-scatters in every pass, unless accumulate_unsharded (see "FSDP") */
    r->pass_sync = r->sync || (ddp__fsdp(r) && !r->desc.accumulate_unsharded);
    r->pass_user_sync = r->sync;
    /* grad_stats: the synchronised pass (zero_stage 3: not the no_sync passes, whose slices it adds to) */
    if (r->pass_sync) ddp__amp_begin(&r->amp, ddp__grad_stats_on(r) && r->sync, r->desc.loss_scale); /* reads the scale */
    r->next_bucket = 0;
    r->norder = 0;
    r->grad_scale = 1.0 / (double)ddp_world_size(r->g); /* until ddp_reducer_set_local_samples says otherwise */
    r->pass_handed = r->samples_done = 0;
    memset(r->ready, 0, ddp__reducer_n(r));
    for (b = 0; b < r->L.nbuckets; b++) r->L.buckets[b].pending = r->L.buckets[b].n;
    r->t_begin = ddp__now();
    r->t_first_start = 0;
    return DDP_SUCCESS;
}

/* ---- local samples: a batch split unevenly over the ranks ----
   Each rank's gradient is the mean over its n local samples; the mean over every rank's samples is
   sum_r n_r g_r / N with N = sum_r n_r, so rank r's share is n_r / N instead of 1/world. set_local_samples
   all-reduces {n, n out of range} (two i64, SUM: the same N on every rank, exact) and sets grad_scale, which
   ddp__reducer_take_from applies wherever 1/world applied: every bucket at every zero_stage, compression
   (the cast multiplies by it), find_unused's accumulated gradients; begin_backward sets 1/world again. When
   every n is equal, n / (world n) is 1/world exactly (a correctly rounded quotient of the same real number),
   so the pass is bit for bit an unweighted one. A joined rank (uneven_inputs) contributes no samples: the
   ranks with data announce a weighted pass in the join round (flag SAMPLES, from their first
   set_local_samples on), and the joined rank takes part in its count with n = 0 before it shadows the
   buckets. */

/* The pass's sample count: every rank's {n, n > DDP__SAMPLES_MAX} summed, in host memory on every backend,
   as a collective of its own purpose (never mixed with the program's own all-reduce of 2 x i64). */
static ddp_result ddp__samples_sum(ddp_reducer *r, size_t n, int64_t sums[2]) {
    ddp_result res;
    int big = (uint64_t)n > (uint64_t)DDP__SAMPLES_MAX; /* (a 32-bit size_t never is) */
    sums[0] = big ? 0 : (int64_t)n;
    sums[1] = big;
    r->g->purpose = DDP__PURPOSE(DDP__PHASE_SAMPLES, -1);
    res = ddp_all_reduce(r->g, sums, 2, DDP_I64, DDP_SUM);
    r->g->purpose = 0;
    return res;
}

/* uneven_inputs: a pass announced as weighted must be weighted before its first gradient is handed over
   (the joined ranks wait in its sample count, which a bucket's all-reduce would meet instead). */
static ddp_result ddp__samples_check_due(ddp_reducer *r, const char *fn) {
    if (!r->samples_due || r->samples_done) return DDP_SUCCESS;
    return ddp__fail(r->g, DDP_ERR_STATE, "%s: uneven_inputs: this rank called ddp_reducer_set_local_samples in an "
                     "earlier pass, so every synchronised pass after it is announced as weighted and the ranks that "
                     "joined take part in its sample count: call ddp_reducer_set_local_samples(r, n) in this pass too, "
                     "after ddp_reducer_begin_backward and before the first gradient is handed over", fn);
}

DDP_API ddp_result ddp_reducer_set_local_samples(ddp_reducer *r, size_t n) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_set_local_samples");
    int64_t sums[2];
    if (res) return res;
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_local_samples(%zu): not in a backward pass; call it "
                         "after ddp_reducer_begin_backward and before the pass's first ddp_reducer_grad_ready (zero_stage "
                         "3: ddp_fsdp_grads_ready)", n);
    if (!r->pass_sync)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_local_samples(%zu): this pass runs under no_sync "
                         "(ddp_reducer_set_sync(r, 0)) and reduces nothing; call it in the synchronised pass that ends "
                         "the accumulation, with n = the samples of every micro-batch accumulated since the last "
                         "synchronised pass", n);
    if (r->pass_handed)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_local_samples(%zu): a gradient of this pass was handed "
                         "over already (and scaled by 1/world_size); call it right after ddp_reducer_begin_backward, "
                         "before the first ddp_reducer_grad_ready (zero_stage 3: ddp_fsdp_grads_ready)", n);
    if (r->samples_done)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_local_samples(%zu): called twice in one backward pass; "
                         "call it once per pass, with the pass's n", n);
    if (r->pass_joined && !r->samples_due)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_local_samples(%zu): uneven_inputs: %d rank%s joined "
                         "before the first weighted pass and shadow%s this one unweighted; with uneven_inputs, weight "
                         "every synchronised pass from one before the first rank runs out of data on (the pass goes on "
                         "unweighted: 1/world_size)", n, r->pass_joined, r->pass_joined == 1 ? " has" : "s have",
                         r->pass_joined == 1 ? "s" : "");
    r->samples_done = r->samples_sticky = 1;
    if ((res = ddp__samples_sum(r, n, sums)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    if (sums[1])
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_set_local_samples(%zu): %lld rank%s passed more "
                         "than 2^40 samples; the pass goes on unweighted (1/world_size)", n, (long long)sums[1],
                         sums[1] == 1 ? "" : "s");
    if (!sums[0])
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_set_local_samples(%zu): no rank has samples in "
                         "this pass (every rank passed n = 0), so there is no mean to take; the pass goes on unweighted "
                         "(1/world_size): finish it and skip the optimizer step", n);
    r->grad_scale = (double)n / (double)sums[0];
    return DDP_SUCCESS;
}

/* Start bucket k's collective on `data` (its comm memory; a joined rank's zeros): DDP's SUM all-reduce,
   or with zero_stage a SUM reduce-scatter of the padded buffer into this rank's slice (k->owned).
   The one place that chooses a bucket's collective, for the ranks with data and the joined ones alike. */
static ddp_result ddp__bucket_start(ddp_reducer *r, ddp__bucket *k, void *data) {
    ddp_result res;
    if (k->unit >= 0) r->g->purpose = DDP__PURPOSE(DDP__PHASE_REDUCE, k->unit); /* ranks must agree on the unit */
    if (ddp__zero2(r)) res = ddp_reduce_scatter_async(r->g, data, ddp__zero2_land(r, k), k->per, k->comm_dtype, DDP_SUM, &k->work);
    else if (ddp__reducer_zero(r)) res = ddp_reduce_scatter_async(r->g, data, k->owned, k->per, k->comm_dtype, DDP_SUM, &k->work);
    else res = ddp_all_reduce_async(r->g, data, k->count, k->comm_dtype, DDP_SUM, &k->work);
    r->g->purpose = 0;
    if (r->g->ft) ddp__ft_test_kill(r->g, "bucket"); /* DDP_FT_TEST_KILL: mid-backward, a bucket in flight */
    return res;
}

/* Start every complete bucket that is next in line. */
static ddp_result ddp__reducer_start_ready(ddp_reducer *r) {
    while (r->next_bucket < r->L.nbuckets && r->L.buckets[r->next_bucket].pending == 0) {
        ddp__bucket *k = &r->L.buckets[r->next_bucket];
        ddp_result res;
        k->t_started = ddp__timeline_on() ? ddp__now() : 0;
        if ((res = ddp__bucket_start(r, k, k->comm)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
        if (!r->t_first_start) r->t_first_start = ddp__now();
        if (++r->next_bucket == r->L.nbuckets) r->t_ready = ddp__now();
    }
    return DDP_SUCCESS;
}

/* Copy parameter i's gradient into its bucket slot, times the pass's grad_scale, 1/world or this rank's share
   of the samples (in place for views): from src, of dtype t (the program's gradient; at zero_stage 3 its
   unit's gradient buffer, in param_dtype). A share of 0 writes zeros, whatever the gradient holds (NaN too). */
static void ddp__reducer_take_from(ddp_reducer *r, int i, const void *src, ddp_dtype t) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    void *slot = (char *)k->comm + r->L.param_offset[i] * ddp_dtype_size(k->comm_dtype);
    if (r->grad_scale == 0.0) r->ops->zero(r->g, slot, r->params[i].count * ddp_dtype_size(k->comm_dtype));
    else r->ops->copy_in_scaled(r->g, slot, k->comm_dtype, src, t, r->params[i].count, r->grad_scale);
    k->pending--;
}
static void ddp__reducer_take(ddp_reducer *r, int i) {
    const ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    const ddp__rtensor *p = &r->params[i];
    const void *src = k->storage ? (const void *)((char *)k->storage + r->L.param_offset[i] * ddp_dtype_size(k->dtype)) : p->grad;
    ddp__reducer_take_from(r, i, src, p->dtype);
}

DDP_API ddp_result ddp_reducer_grad_ready(ddp_reducer *r, int index) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_grad_ready");
    if (res) return res;
    if (index < 0 || index >= r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_grad_ready: index %d is not a parameter (0 .. %d)",
                         index, r->nparams - 1);
    if (ddp__fsdp(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_grad_ready(\"%s\"): at zero_stage 3 a unit's gradients are "
                         "handed over together: call ddp_fsdp_grads_ready(r, unit)", r->params[index].name);
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_grad_ready(\"%s\"): not in a backward pass; call "
                         "ddp_reducer_begin_backward first", r->params[index].name);
    if (r->ready[index])
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_grad_ready(\"%s\"): called twice in one backward pass; a "
                         "gradient is reduced once per pass (PyTorch: \"Expected to mark a variable ready only once\"). "
                         "A parameter used twice in forward gets one gradient: add both parts, then call it once",
                         r->params[index].name);
    if ((res = ddp__samples_check_due(r, "ddp_reducer_grad_ready")) != DDP_SUCCESS) return res;
    r->pass_handed = 1;
    r->ready[index] = 1;
    r->used[index] = 1;
    if (!r->pass_sync) return DDP_SUCCESS;
    if (r->rebuild_pending) r->order[r->norder++] = index;
    if (ddp__zero2(r) && !r->L.buckets[r->L.param_bucket[index]].comm &&
        (res = ddp__zero2_acquire(r, r->L.param_bucket[index])) != DDP_SUCCESS)
        return res;
    ddp__reducer_take(r, index);
    return ddp__reducer_start_ready(r);
}

/* A gradient is missing without find_unused_parameters. The ranks may now have started different
   buckets, so they cannot agree on later collectives: finish what this rank started (every rank either
   completes those or fails), then break the group so every rank fails at once with this message. */
static ddp_result ddp__reducer_missing(ddp_reducer *r) {
    char msg[DDP__ERR_MAX];
    size_t len;
    int i, missing = 0, listed = 0, b;
    for (i = 0; i < r->nparams; i++) missing += !r->ready[i];
    len = (size_t)snprintf(msg, sizeof msg, "ddp_reducer_end_backward: rank %d: %d parameter%s got no gradient in this "
                           "backward pass:", ddp_rank(r->g), missing, missing == 1 ? "" : "s");
    for (i = 0; i < r->nparams && len < 600; i++)
        if (!r->ready[i]) {
            len += (size_t)snprintf(msg + len, sizeof msg - len, "%s \"%s\"", listed ? "," : "", r->params[i].name);
            listed++;
        }
    if (listed < missing && len < sizeof msg) len += (size_t)snprintf(msg + len, sizeof msg - len, " and %d more", missing - listed);
    if (len < sizeof msg)
        snprintf(msg + len, sizeof msg - len, ". Call ddp_reducer_grad_ready for every parameter in every synchronised "
                 "backward, or set find_unused_parameters = 1 (PyTorch: \"Expected to have finished reduction in the "
                 "prior iteration\"). %s", ddp_world_size(r->g) > 1 ? "The group is broken; destroy it and the reducer"
                 : "Destroy the reducer");
    for (b = 0; b < r->next_bucket; b++)
        if (r->L.buckets[b].work) {
            ddp_wait(r->L.buckets[b].work);
            r->L.buckets[b].work = NULL;
        }
    if (ddp_world_size(r->g) > 1) ddp__group_abort(r->g, DDP_ERR_STATE, msg);
    r->failed = DDP_ERR_STATE;
    r->in_backward = 0;
    return ddp__fail(r->g, DDP_ERR_STATE, "%s", msg);
}

/* find_unused_parameters: what of parameter i's gradient must survive the pass in case no rank uses it
   (ddp__reducer_finish_unused puts it back then), saved into / restored from the stash at `at`: a view's
   gradient without compression (its bucket is reduced in place), or under zero_stage 2 this rank's owned
   piece of it (the reduce-scatter lands there). Returns its bytes (0: nothing to keep); at NULL: only
   the size. At zero_stage 3, where units may be handed over unused in the middle of backward (see
   ddp_fsdp_grads_ready), the stash mirrors every bucket's owned slice at a fixed place (the bucket's
   stash_at) and `at` only says whether to copy. */
static size_t ddp__unused_keep(ddp_reducer *r, int i, char *at, int restore) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    const ddp__rtensor *p = &r->params[i];
    size_t count = p->count, lo, a, e;
    char *grad;
    if (ddp__zero2(r)) {
        if (!ddp__zero_piece(r, i, &lo, &a, &e)) return 0;
        grad = (char *)k->owned + (a - lo) * ddp_dtype_size(k->dtype);
        count = e - a;
        if (at && ddp__fsdp(r)) at = (char *)r->stash + k->stash_at + (a - lo) * ddp_dtype_size(k->dtype);
    } else if (ddp__bucket_in_place(k)) {
        grad = (char *)k->storage + r->L.param_offset[i] * ddp_dtype_size(k->dtype);
    } else {
        return 0;
    }
    if (at) r->ops->copy_out(r->g, restore ? grad : at, p->dtype, restore ? at : grad, p->dtype, count);
    return count * ddp_dtype_size(p->dtype);
}

/* The stash can hold what the parameters not used here (all: every parameter, as in a joined rank's
   shadow pass) keep across the pass; it grows only when more must be kept than ever before. */
static ddp_result ddp__stash_reserve(ddp_reducer *r, int all, const char *fn) {
    size_t need = 0;
    int i;
    for (i = 0; i < r->nparams && !ddp__fsdp(r); i++)
        if (all || !r->used[i]) need += ddp__unused_keep(r, i, NULL, 0);
    for (i = 0; i < r->L.nbuckets && ddp__fsdp(r); i++) { /* zero_stage 3: a mirror of the owned slices */
        r->L.buckets[i].stash_at = need;
        need += r->L.buckets[i].per * ddp_dtype_size(r->L.buckets[i].dtype);
    }
    if (need <= r->stash_bytes) return DDP_SUCCESS;
    if (r->stash) r->ops->release(r->g, r->stash);
    r->stash_bytes = 0;
    if (!(r->stash = r->ops->alloc(r->g, need)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes)", fn, need);
    r->stash_bytes = need;
    return DDP_SUCCESS;
}

/* Parameter i got no gradient on this rank: it contributes zero, after what it must keep went into the
   stash at *off (ddp__unused_keep). */
static void ddp__reducer_take_zero(ddp_reducer *r, int i, size_t *off) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t cs = ddp_dtype_size(k->comm_dtype);
    *off += ddp__unused_keep(r, i, (char *)r->stash + *off, 0);
    r->ops->zero(r->g, (char *)k->comm + r->L.param_offset[i] * cs, r->params[i].count * cs);
    k->pending--;
}

/* find_unused_parameters: fill the slots of the parameters not ready in this pass, bucket by bucket in
   bucket order, starting each as soon as it is complete (so under zero_stage 2 a bucket that needs a
   pool buffer finds the buckets before it started, and waits for the oldest instead of growing the
   pool). One that got a gradient in an earlier no_sync pass contributes what it accumulated; the others
   contribute zero, after what they must keep went into the stash (ddp__unused_keep). */
static ddp_result ddp__reducer_fill_unused(ddp_reducer *r) {
    size_t off = 0;
    ddp_result res;
    int b, j, i;
    r->stats.unused_parameters = 0;
    for (i = 0; i < r->nparams; i++) r->stats.unused_parameters += !r->used[i];
    if ((res = ddp__stash_reserve(r, 0, "ddp_reducer_end_backward")) != DDP_SUCCESS) return res;
    for (b = 0; b < r->L.nbuckets; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        if (!k->pending) continue;
        if (ddp__zero2(r) && !k->comm && (res = ddp__zero2_acquire(r, b)) != DDP_SUCCESS) return res;
        for (j = k->first; j < k->first + k->n; j++) {
            i = r->L.params[j];
            if (r->ready[i]) continue;
            if (r->used[i]) ddp__reducer_take(r, i);
            else ddp__reducer_take_zero(r, i, &off);
        }
        if ((res = ddp__reducer_start_ready(r)) != DDP_SUCCESS) return res;
    }
    return DDP_SUCCESS;
}

/* u's gradient buffer for this pass, zeroed (see "unit gradients" in reducer_fsdp.c):
   - a unit whose gradients have the comm dtype (no param_dtype cast, no compression) in host memory: its
     bucket's comm buffer itself, borrowed from stage 2's pool as a first grad_ready would; grads_ready
     then scales it in place, so the gradients take no memory of their own (stage 2's formula);
   - a KEEP unit: its own buffer (held from its first take to end_backward: a tied embedding's gradient
     is written first and last in backward, and may not hold a pool buffer that long); with
     accumulate_unsharded every unit's own, zeroed only at the first take after a synchronised pass (the
     no_sync passes add into it);
   - else a buffer of the gradient pool, which grows by one when all are taken.
   NULL when out of memory, or when a pool buffer could not be had (the error is set). */
static void *ddp__fsdp_grad_take(ddp_reducer *r, ddp__unit *u) {
    ddp__bucket *k = &r->L.buckets[u->bucket];
    int s = 0;
    if (u->grad) return u->grad;
    if (ddp__fsdp_in_comm(r, u)) {
        if (!k->comm && ddp__zero2_acquire(r, u->bucket) != DDP_SUCCESS) return NULL;
        u->grad = k->comm;
    } else if (u->grad_own) {
        u->grad = u->grad_own;
        if (u->grad_held) return u->grad; /* accumulate_unsharded: the no_sync passes' sum so far */
        u->grad_held = r->desc.accumulate_unsharded;
    } else {
        while (s < r->ngradpool && r->gradpool_holder[s] >= 0) s++;
        if (s == r->ngradpool) {
            if (!(r->gradpool[s] = ddp__fsdp_alloc(r, r->gradpool_bytes))) {
                ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_fsdp_grad: out of memory for gradient buffer %d (%zu bytes)", s,
                          r->gradpool_bytes);
                return NULL;
            }
            r->ngradpool++;
            r->stats.gradient_bytes += r->gradpool_bytes;
        }
        r->gradpool_holder[s] = (int)(u - r->units);
        u->grad_slot = s;
        u->grad = r->gradpool[s];
    }
    r->ops->zero(r->g, u->grad, k->count * ddp_dtype_size(ddp__fsdp_dtype(r, k)));
    return u->grad;
}

DDP_API void *ddp_fsdp_grad(ddp_reducer *r, int index) {
    ddp__unit *u;
    if (!r || index < 0 || index >= r->nparams || ddp__fsdp_check(r, r->params[index].unit, "ddp_fsdp_grad")) return NULL;
    u = &r->units[r->params[index].unit];
    if (!r->in_backward || u->grads_done) {
        ddp__fail(r->g, DDP_ERR_STATE, "ddp_fsdp_grad(\"%s\"): %s", r->params[index].name, !r->in_backward ?
                  "not in a backward pass; call ddp_reducer_begin_backward first" :
                  "its unit's gradients were handed over (ddp_fsdp_grads_ready) in this pass already");
        return NULL;
    }
    if (!ddp__fsdp_grad_take(r, u)) return NULL;
    return (char *)u->grad + r->L.param_offset[index] * ddp_dtype_size(ddp__fsdp_dtype(r, &r->L.buckets[u->bucket]));
}

/* zero_stage 3: grad_ready for every parameter of the unit at once, from its gradient buffer, which then
   goes back to the pool. A unit whose gradients were never taken in this pass contributes zeros; with
   find_unused_parameters it is also "not used on this rank" (as a parameter without grad_ready). */
DDP_API ddp_result ddp_fsdp_grads_ready(ddp_reducer *r, int unit) {
    ddp_result res = ddp__fsdp_check(r, unit, "ddp_fsdp_grads_ready");
    ddp__unit *u;
    ddp__bucket *k;
    size_t ps;
    int i;
    if (res) return res;
    u = &r->units[unit];
    k = &r->L.buckets[u->bucket];
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_fsdp_grads_ready(unit %d \"%s\"): not in a backward pass; call "
                         "ddp_reducer_begin_backward first", unit, u->name);
    if (u->grads_done)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_fsdp_grads_ready(unit %d \"%s\"): called twice in one backward pass; a "
                         "unit's gradients are reduced once per pass", unit, u->name);
    r->pass_handed = 1;
    if (!r->pass_sync) { /* accumulate_unsharded under no_sync: the gradients stay in the unit's buffer */
        for (i = u->first; i < u->first + u->n; i++) {
            r->ready[i] = 1;
            r->used[i] |= u->grad != NULL;
        }
        u->grads_done = 1;
        ddp__fsdp_grad_put_back(r, u);
        return DDP_SUCCESS;
    }
    if (!u->grad && u->grad_held) u->grad = u->grad_own; /* what the no_sync passes accumulated */
    if (!k->comm && (res = ddp__zero2_acquire(r, u->bucket)) != DDP_SUCCESS) return res;
    if (!u->grad && r->desc.find_unused_parameters) { /* not used on this rank: zeros, and the used map says so */
        size_t off = 0;
        if ((res = ddp__stash_reserve(r, 1, "ddp_fsdp_grads_ready")) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
        for (i = u->first; i < u->first + u->n; i++) {
            r->ready[i] = 1;
            ddp__reducer_take_zero(r, i, &off);
        }
        u->grads_done = 1;
        return ddp__reducer_start_ready(r);
    }
    if (!ddp__fsdp_grad_take(r, u)) return DDP_ERR_OUT_OF_MEMORY;
    ps = ddp_dtype_size(ddp__fsdp_dtype(r, k));
    for (i = u->first; i < u->first + u->n; i++) {
        r->ready[i] = r->used[i] = 1;
        ddp__reducer_take_from(r, i, (char *)u->grad + r->L.param_offset[i] * ps, ddp__fsdp_dtype(r, k));
    }
    u->grads_done = 1;
    ddp__fsdp_grad_put_back(r, u);
    return ddp__reducer_start_ready(r);
}

/* The reduced value of parameter i goes back to where the program reads its gradient (grad_stats: and
   is unscaled and counted there, while it is in cache). */
static void ddp__reducer_give_back(ddp_reducer *r, int i) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t off = r->L.param_offset[i];
    const void *src = (char *)k->comm + off * ddp_dtype_size(k->comm_dtype);
    void *grad = k->storage ? (void *)((char *)k->storage + off * ddp_dtype_size(k->dtype)) : r->params[i].grad;
    if (ddp__reducer_zero(r)) {
        ddp__zero_give_back(r, i);
        return;
    }
    if (!ddp__bucket_in_place(k)) r->ops->copy_out(r->g, grad, r->params[i].dtype, src, k->comm_dtype, r->params[i].count);
    ddp__amp_add(&r->amp, grad, r->params[i].dtype, r->params[i].count);
}

/* After the used map: gradients of parameters unused here (all: every parameter, a joined rank's shadow
   pass under zero_stage) but used elsewhere come back (zero_stage 2: they are in the owned slices
   already); those no rank used keep their old value (out of the stash, in the order it was filled). */
static void ddp__reducer_finish_unused(ddp_reducer *r, int all) {
    size_t off = 0;
    int b, j;
    for (b = 0; b < r->L.nbuckets; b++)
        for (j = r->L.buckets[b].first; j < r->L.buckets[b].first + r->L.buckets[b].n; j++) {
            int i = r->L.params[j];
            if (!all && r->used[i]) continue;
            if (r->used_global[i] && !ddp__zero2(r)) ddp__reducer_give_back(r, i);
            off += ddp__unused_keep(r, i, r->used_global[i] ? NULL : (char *)r->stash + off, 1);
        }
}

/* Wait for every bucket in order, giving each back as soon as it is done (the gradients of unused
   parameters wait for the used map). Returns the first error; every handle is released. */
static ddp_result ddp__reducer_collect(ddp_reducer *r, ddp_work *used_work) {
    ddp_result first = DDP_SUCCESS, res;
    char why[DDP__ERR_MAX];
    int b, j, find_unused = r->desc.find_unused_parameters;
    for (b = 0; b < r->L.nbuckets; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        double ran[3];
        if (!k->work) continue;
        res = ddp__wait_times(k->work, ran);
        k->work = NULL;
        if (ran[1] > 0 && k->t_started > 0) { /* the timeline: the bucket's collective, on the lane that ran it */
            static const char *const names[3] = {"index", "bytes", "ready_us"};
            double values[3];
            values[0] = b, values[1] = (double)(k->count * ddp_dtype_size(k->comm_dtype));
            values[2] = ran[0] > k->t_started ? (ran[0] - k->t_started) * 1e6 : 0;
            ddp__timeline_span_on((int)ran[2], "reducer.bucket", ran[0], ran[1], names, values, 3, NULL, NULL);
        }
        if (res && !first) {
            first = res;
            snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        }
        if (ddp__zero2(r)) ddp__zero2_finish(r, k, !first); /* the slice stays in the reducer */
        if (first || ddp__zero2(r)) continue;
        for (j = k->first; j < k->first + k->n; j++)
            if (!find_unused || r->used[r->L.params[j]]) ddp__reducer_give_back(r, r->L.params[j]);
    }
    if (used_work) {
        res = ddp_wait(used_work);
        if (res && !first) {
            first = res;
            snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        }
        if (!first) {
            r->ops->copy_out(r->g, r->used_global, DDP_U8, r->used_comm, DDP_U8, ddp__reducer_n(r));
            ddp__reducer_finish_unused(r, 0);
        }
    }
    /* the first failure says what happened; later ones only say that the group is broken */
    if (!first) return DDP_SUCCESS;
    return ddp__fail(r->g, first, "%s%s", strncmp(why, "ddp_reducer_", 12) ? "ddp_reducer_end_backward: " : "", why);
}

/* Once, after the first synchronised pass: buckets in the order rank 0 saw the gradients ready. */
static ddp_result ddp__reducer_rebuild(ddp_reducer *r) {
    ddp_result res;
    int taken;
    r->rebuild_pending = 0;
    if ((res = ddp_broadcast(r->g, r->order, ddp__reducer_n(r), DDP_I32, 0)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    if ((res = ddp__reducer_relayout(r, r->order, &taken)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    r->stats.rebuilt = taken;
    return DDP_SUCCESS;
}

/* The timeline's reducer.backward: this pass, from begin_backward to `end` (its reducer.wait follows
   once the straggler is known: ddp__timing_account). */
static void ddp__reducer_timeline_pass(const ddp_reducer *r, double end) {
    static const char *const names[2] = {"iteration", "sync"};
    double values[2];
    if (!ddp__timeline_on()) return;
    values[0] = (double)(r->stats.iterations + r->stats.local_iterations), values[1] = r->pass_sync;
    ddp__timeline_span("reducer.backward", r->t_begin, end, names, values, 2, NULL, NULL);
}

DDP_API ddp_result ddp_reducer_end_backward(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_end_backward");
    ddp_work *used_work = NULL;
    double t_enter = ddp__now(), t_done;
    int i;
    if (res) return res;
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_end_backward: no backward pass to end; call "
                         "ddp_reducer_begin_backward before the backward pass");
    if (!r->pass_sync) {
        r->in_backward = 0;
        if (ddp__fsdp(r) && (res = ddp__fsdp_reshard_all(r)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
        r->stats.local_iterations++;
        ddp__reducer_timeline_pass(r, t_enter);
        return DDP_SUCCESS;
    }
    if ((res = ddp__samples_check_due(r, "ddp_reducer_end_backward")) != DDP_SUCCESS) return res;
    if (r->desc.find_unused_parameters) {
        if ((res = ddp__reducer_fill_unused(r)) != DDP_SUCCESS) ddp__reducer_stop(r, res);
    } else {
        for (i = 0; i < r->nparams; i++)
            if (!r->ready[i]) return ddp__reducer_missing(r);
        r->stats.unused_parameters = 0;
    }
    if (!res) res = ddp__reducer_start_ready(r);
    if (!res && r->desc.find_unused_parameters) { /* PyTorch's local_used_map, reduced after the buckets */
        r->ops->copy_out(r->g, r->used_comm, DDP_U8, r->used, DDP_U8, ddp__reducer_n(r));
        if ((res = ddp_all_reduce_async(r->g, r->used_comm, ddp__reducer_n(r), DDP_U8, DDP_MAX, &used_work)) != DDP_SUCCESS)
            ddp__reducer_stop(r, res);
    }
    {
        ddp_result waited = ddp__reducer_collect(r, used_work);
        if (!res) res = waited;
    }
    r->in_backward = 0;
    memset(r->used, 0, ddp__reducer_n(r));
    if (ddp__fsdp(r)) {
        ddp_result resharded = ddp__fsdp_reshard_all(r);
        if (!res) res = resharded;
        r->accumulate = !r->pass_user_sync; /* the next pass adds to this one's slices */
        for (i = 0; i < r->nunits; i++) r->units[i].grad_held = 0; /* accumulate_unsharded: reduced now */
    }
    if (res) return ddp__reducer_stop(r, res);
    /* grad_stats: the pass's sums complete; under ZeRO one 16-byte all-reduce (the joined ranks' shadow too) */
    if ((res = ddp__amp_finish(r->g, &r->amp, ddp__reducer_zero(r))) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    t_done = ddp__now();
    if (ddp__fsdp(r) && !r->pass_user_sync) r->stats.local_iterations++;
    else r->stats.iterations++;
    r->stats.bytes_reduced = r->desc.find_unused_parameters ? (uint64_t)r->nparams : 0;
    for (i = 0; i < r->L.nbuckets; i++)
        r->stats.bytes_reduced += r->L.buckets[i].count * ddp_dtype_size(r->L.buckets[i].comm_dtype);
    r->stats.backward_seconds = t_enter - r->t_begin;
    r->stats.comm_seconds = r->t_first_start ? t_done - r->t_first_start : 0;
    r->stats.wait_seconds = t_done - t_enter;
    r->stats.total_comm_seconds += r->stats.comm_seconds;
    r->stats.total_wait_seconds += r->stats.wait_seconds;
    r->t_enter = t_enter;
    r->t_done = t_done;
    r->timed_pass = (double)(r->stats.iterations + r->stats.local_iterations);
    r->wall_minus_mono = ddp__wall_seconds() - ddp__now();
    ddp__reducer_timeline_pass(r, t_done);
    if ((res = ddp__timing_start(r, 0)) != DDP_SUCCESS) return res;
    if (r->rebuild_pending) return ddp__reducer_rebuild(r);
    return DDP_SUCCESS;
}

/* ---- between backward passes ---- */

DDP_API ddp_result ddp_reducer_set_sync(ddp_reducer *r, int sync) {
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_set_sync: the reducer is NULL");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_sync(%d): called during a backward pass; set it before "
                         "ddp_reducer_begin_backward (as DDP's no_sync() wraps forward and backward)", sync);
    r->sync = sync != 0;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_zero_grad(ddp_reducer *r) {
    int i;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_zero_grad: the reducer is NULL");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_zero_grad: called during a backward pass; zero the "
                         "gradients after end_backward (after the optimizer step)");
    if (ddp__reducer_is_view(r)) {
        for (i = 0; i < r->L.nbuckets; i++)
            r->ops->zero(r->g, r->L.buckets[i].storage, r->L.buckets[i].count * ddp_dtype_size(r->L.buckets[i].dtype));
        return DDP_SUCCESS;
    }
    for (i = 0; ddp__zero2(r) && i < r->L.nbuckets; i++) /* the shards' gradients, which live here */
        r->ops->zero(r->g, r->L.buckets[i].owned, r->L.buckets[i].per * ddp_dtype_size(r->L.buckets[i].dtype));
    for (i = 0; i < r->nparams; i++)
        if (r->params[i].grad) r->ops->zero(r->g, r->params[i].grad, ddp__tensor_bytes(&r->params[i])); /* 3: none */
    for (i = 0; i < r->nunits; i++) r->units[i].grad_held = 0; /* 3, accumulate_unsharded: zeroed when next taken */
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_broadcast_buffers(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_broadcast_buffers");
    int root = 0;
    if (res) return res;
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_broadcast_buffers: called during a backward pass; call it "
                         "before the forward pass");
    if (r->desc.uneven_inputs && (res = ddp__join_announce(r, DDP__JOIN_BUFFERS, "ddp_reducer_broadcast_buffers", &root)) != DDP_SUCCESS)
        return res;
    return ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, root);
}

DDP_API ddp_result ddp_reducer_get_statistics(const ddp_reducer *r, ddp_reducer_statistics *out) {
    if (!r || !out)
        return ddp__fail(r ? r->g : NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_get_statistics: NULL argument");
    ddp__timing_finish((ddp_reducer *)r); /* the reducer is the caller's, not const memory: const only in the API */
    *out = r->stats;
    return DDP_SUCCESS;
}

/* The deprecated name (until 2026-11-24) of ddp_reducer_get_statistics. */
DDP_API ddp_result ddp_reducer_stats(const ddp_reducer *r, ddp_reducer_statistics *out) {
    return ddp_reducer_get_statistics(r, out);
}

DDP_API int ddp_reducer_param_bucket(const ddp_reducer *r, int index, size_t *offset) {
    if (!r || !r->L.buckets || index < 0 || index >= r->nparams) return -1;
    if (offset) *offset = r->L.param_offset[index];
    return r->L.param_bucket[index];
}

DDP_API int ddp_reducer_param_used(const ddp_reducer *r, int index) {
    if (!r || !r->finalized || index < 0 || index >= r->nparams) {
        if (!r) ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_used: the reducer is NULL");
        else if (!r->finalized) ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_param_used: call ddp_reducer_finalize first");
        else ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_used: index %d is not a parameter (0 .. %d)", index,
                       r->nparams - 1);
        return -1;
    }
    if (!r->stats.iterations && !r->stats.shadowed_iterations) return 0;
    return r->desc.find_unused_parameters ? r->used_global[index] != 0 : 1;
}

/* For zero_state.c: a reducer whose ZeRO shards can be read (finalized, healthy, zero_stage, not in a
   backward pass), its group, and its parameters' element counts. */
static ddp_result ddp__reducer_zero_model(ddp_reducer *r, const char *fn, ddp_group **g, int *nparams) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created with zero_stage = 0: every rank holds the "
                         "whole optimizer state; save it as it is (set zero_stage = 1 to shard it)", fn);
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: called during a backward pass; call it between steps", fn);
    *g = r->g;
    *nparams = r->nparams;
    return DDP_SUCCESS;
}
static size_t ddp__reducer_param_count(const ddp_reducer *r, int i) { return r->params[i].count; }

DDP_API void ddp_reducer_destroy(ddp_reducer *r) {
    int i;
    if (!r) return;
    ddp__zero_gather_settle(r);
    ddp__fsdp_reshard_all(r); /* gathers in flight are waited for */
    for (i = 0; r->L.buckets && i < r->L.nbuckets; i++)
        if (r->L.buckets[i].work) ddp_wait(r->L.buckets[i].work);
    if (r->ready_work) ddp_wait(r->ready_work);
    if (r->ready_comm) r->ops->release(r->g, r->ready_comm);
    ddp__free(r->ready_ns);
    ddp__layout_free(r, &r->L);
    for (i = 0; i < r->nparams; i++) ddp__free(r->params[i].name);
    for (i = 0; i < r->nbuffers; i++) ddp__free(r->buffers[i].name);
    ddp__free(r->params);
    ddp__free(r->buffers);
    ddp__free(r->ready);
    ddp__free(r->used);
    ddp__free(r->order);
    ddp__free(r->used_global);
    if (r->used_comm) r->ops->release(r->g, r->used_comm);
    if (r->stash) r->ops->release(r->g, r->stash);
    if (r->bstage) r->ops->release(r->g, r->bstage);
    if (r->shadow) r->ops->release(r->g, r->shadow);
    ddp__free(r->join_table);
    ddp__free(r->shards);
    ddp__free(r->shard_bucket);
    for (i = 0; i < r->npool; i++) r->ops->release(r->g, r->pool[i]);
    ddp__free(r->pool);
    ddp__free(r->pool_holder);
    ddp__fsdp_free(r);
    ddp__free(r);
}

/* ---- uneven inputs: torch's Join context manager with DistributedDataParallel ----
   (torch/distributed/algorithms/join.py; _DDPJoinHook and the join parts of DistributedDataParallel in
   torch/nn/parallel/distributed.py)

   With uneven_inputs, each collective step of the reducer is announced first: every rank that still has
   data all_gathers a record {kind, flags, steps} at the start of every backward pass (begin_backward: kind
   STEP, flag SYNC unless under no_sync; torch's per-forward join all-reduce and its
   _check_global_requires_backward_grad_sync in one) and of every ddp_reducer_broadcast_buffers (kind
   BUFFERS). A rank without data calls ddp_reducer_join, which takes part in the same all_gathers with kind
   JOINED (flag FIRST in its first round) and answers each round as the active ranks' records say:
     no active rank left    the join is over: parameters and buffers are broadcast from the highest rank
                            among the last joiners (torch's _sync_final_model), and every rank returns
     STEP with SYNC         (flag SAMPLES: the pass's sample count with n = 0, see "local samples") one SUM
                            all-reduce of zeros per bucket, in bucket order and comm dtype (torch's
                            _match_all_reduce_for_bwd_pass), the used map with zeros (find_unused_parameters,
                            _match_unused_params_allreduce), then the bucket rebuild if it is still pending
     STEP without SYNC      nothing: the active ranks only accumulate locally
     BUFFERS                the buffer broadcast, from the highest active rank (torch's _find_common_rank)
   Active ranks scale their gradients by 1/(initial world size) as always, so the average includes the
   joined ranks' zeros (torch's divide_by_initial_world_size=True); a weighted pass by n / (the active
   ranks' N), the joined ranks counting no samples. ddp_reducer_join_step answers rounds
   until it has shadowed one synchronised pass (it returns, *all_joined = 0) or no active rank is left
   (*all_joined = 1); ddp_reducer_join is its loop. With zero_stage the shadow is the reduce-scatter of
   zeros, and its result, the active ranks' sum / initial world size, goes into this rank's owned gradient
   elements: the program runs its optimizer on ddp_reducer_shards and calls ddp_reducer_gather_params,
   which meets the active ranks' gather_params of the same step (torch's _ZeROJoinHook runs zero.step()).
   Every rank sees every record, so every rank checks the same things and reaches the same verdict: active
   ranks announcing different things (a no_sync pass against a synchronised one, a buffer broadcast against
   a backward pass) are DDP_ERR_MISMATCH on every rank; with join_fail_early, a round with both active and joined ranks is DDP_ERR_UNEVEN_INPUTS
   on every rank. Either way every rank took part in the same all_gathers: the group stays usable.
   Cost when the ranks are even: one all_gather of 12 bytes per rank per backward pass (torch: two 4-byte
   all-reduces per forward). */

typedef struct ddp__join_round { /* what one round's records say */
    int active, joined;  /* ranks with data / ranks in ddp_reducer_join */
    int first_active;    /* the lowest active rank, whose record the others must match (-1: none) */
    int last_active;     /* the highest active rank: buffers come from it */
    int last_joiner;     /* the highest rank in its first join round (-1: none) */
    int disagree;        /* the first active rank whose announcement differs from first_active's (-1: none) */
    int kind, sync;      /* first_active's announcement */
    int samples;         /* and its pass is weighted (ddp_reducer_set_local_samples): the joined ranks count n = 0 */
    int steps;           /* first_active's passes since the last join */
    int joined_steps;    /* the first joined rank's */
} ddp__join_round;

/* One round: every rank all_gathers {kind, flags, this rank's passes since the last join}. A failure
   (most often another collective of a rank with data, meeting this all_gather) breaks the group. */
static ddp_result ddp__join_exchange(ddp_reducer *r, const char *fn, int kind, int flags, ddp__join_round *v) {
    int world = ddp_world_size(r->g), k;
    int32_t *mine = r->join_table + (size_t)world * DDP__JOIN_FIELDS;
    ddp_result res;
    mine[0] = kind;
    mine[1] = flags;
    mine[2] = r->join_steps;
    if ((res = ddp_all_gather(r->g, mine, r->join_table, DDP__JOIN_FIELDS, DDP_I32)) != DDP_SUCCESS) {
        char why[DDP__ERR_MAX];
        snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        ddp__reducer_stop(r, res);
        return ddp__fail(r->g, res, "%s: the join round (uneven_inputs: an all_gather of 3 x i32 at every backward pass, "
                         "buffer broadcast and join) failed: %s. Until every rank has joined, the ranks with data may "
                         "issue only the reducer's collectives (ddp_reducer_join shadows nothing else)", fn, why);
    }
    memset(v, 0, sizeof *v);
    v->first_active = v->last_active = v->last_joiner = v->disagree = -1;
    for (k = 0; k < world; k++) {
        const int32_t *e = r->join_table + (size_t)k * DDP__JOIN_FIELDS;
        int sync = (e[1] & DDP__JOIN_SYNC) != 0, samples = (e[1] & DDP__JOIN_SAMPLES) != 0;
        if (e[0] == DDP__JOIN_JOINED) {
            if (!v->joined++) v->joined_steps = e[2];
            if (e[1] & DDP__JOIN_FIRST) v->last_joiner = k;
            continue;
        }
        v->active++;
        v->last_active = k;
        if (v->first_active < 0) {
            v->first_active = k;
            v->kind = e[0];
            v->sync = sync;
            v->samples = samples;
            v->steps = e[2];
        } else if (v->disagree < 0 && (e[0] != v->kind || sync != v->sync || samples != v->samples)) {
            v->disagree = k;
        }
    }
    return DDP_SUCCESS;
}

static const char *ddp__join_kind_name(int kind, int flags) {
    if (kind == DDP__JOIN_BUFFERS) return "ddp_reducer_broadcast_buffers";
    if (flags & DDP__JOIN_SAMPLES) return "a synchronised backward pass weighted by ddp_reducer_set_local_samples";
    if (flags & DDP__JOIN_SYNC) return "a synchronised backward pass";
    return "a backward pass under no_sync (ddp_reducer_set_sync(r, 0))";
}

static ddp_result ddp__join_disagree(ddp_reducer *r, const char *fn, const ddp__join_round *v) {
    const int32_t *e = r->join_table + (size_t)v->disagree * DDP__JOIN_FIELDS;
    return ddp__fail(r->g, DDP_ERR_MISMATCH, "%s: uneven_inputs: the ranks that still have data disagree at step %d: "
                     "rank %d began %s, rank %d began %s. Every rank with data must make the same reducer calls in the "
                     "same order (the same set_sync, ddp_reducer_broadcast_buffers on all or none); the group is still "
                     "usable", fn, v->steps + 1, v->first_active,
                     ddp__join_kind_name(v->kind, (v->sync ? DDP__JOIN_SYNC : 0) | (v->samples ? DDP__JOIN_SAMPLES : 0)),
                     v->disagree, ddp__join_kind_name(e[0], e[1]));
}

/* "0, 2, 5" for the ranks whose record is (or is not) JOINED; the first 24, then "and N more". */
static void ddp__join_list(const ddp_reducer *r, int joined, char *out, size_t cap) {
    int world = ddp_world_size(r->g), k, listed = 0, more = 0;
    size_t len = 0;
    out[0] = '\0';
    for (k = 0; k < world; k++) {
        if ((r->join_table[(size_t)k * DDP__JOIN_FIELDS] == DDP__JOIN_JOINED) != joined) continue;
        if (listed == 24) {
            more++;
            continue;
        }
        if (len < cap) len += (size_t)snprintf(out + len, cap - len, "%s%d", listed ? ", " : "", k);
        listed++;
    }
    if (more && len < cap) snprintf(out + len, cap - len, " and %d more", more);
}

/* join_fail_early: some ranks ran out while others have data. Every rank builds this same message. */
static ddp_result ddp__join_uneven(ddp_reducer *r, const char *fn, const ddp__join_round *v) {
    char joined[200], active[200];
    ddp__join_list(r, 1, joined, sizeof joined);
    ddp__join_list(r, 0, active, sizeof active);
    r->join_steps = 0; /* every rank stops this epoch here; a later one counts from 0 again */
    return ddp__fail(r->g, DDP_ERR_UNEVEN_INPUTS, "%s: uneven inputs at step %d: rank%s %s ran out of data after %d "
                     "step%s (called ddp_reducer_join) while rank%s %s still had data. join_fail_early = 1 stops every "
                     "rank here (torch's throw_on_early_termination); the group and the reducer are still usable. End "
                     "the epoch on every rank, or set join_fail_early = 0 to let the ranks without data shadow the others",
                     fn, v->steps + 1, v->joined == 1 ? "" : "s", joined, v->joined_steps, v->joined_steps == 1 ? "" : "s",
                     v->active == 1 ? "" : "s", active);
}

/* The active side of a round: announce a backward pass (weighted, from the first set_local_samples on) or a
   buffer broadcast; *root gets the rank whose buffers every rank takes (the highest active one, as torch's
   _find_common_rank). */
static ddp_result ddp__join_announce(ddp_reducer *r, int kind, const char *fn, int *root) {
    ddp__join_round v;
    int step = kind == DDP__JOIN_STEP && r->sync, flags = step ? DDP__JOIN_SYNC : 0;
    ddp_result res = ddp__join_exchange(r, fn, kind, step && r->samples_sticky ? flags | DDP__JOIN_SAMPLES : flags, &v);
    if (res) return res;
    if (v.disagree >= 0) return ddp__join_disagree(r, fn, &v);
    if (v.joined && r->desc.join_fail_early) return ddp__join_uneven(r, fn, &v);
    if (kind == DDP__JOIN_STEP) r->join_steps++;
    if (step) r->samples_due = r->samples_sticky, r->pass_joined = v.joined;
    if (root) *root = v.last_active;
    return DDP_SUCCESS;
}

/* Zeros for the buckets whose comm memory is the program's gradient (views without compression); the
   other buckets' comm memory is the reducer's own and carries the zeros itself. */
static ddp_result ddp__join_shadow_memory(ddp_reducer *r) {
    size_t need = 0;
    int b;
    for (b = 0; b < r->L.nbuckets; b++)
        if (ddp__bucket_in_place(&r->L.buckets[b])) need += r->L.buckets[b].count * ddp_dtype_size(r->L.buckets[b].comm_dtype);
    if (need <= r->shadow_bytes) return DDP_SUCCESS;
    if (r->shadow) r->ops->release(r->g, r->shadow);
    r->shadow_bytes = 0;
    if (!(r->shadow = r->ops->alloc(r->g, need)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_join: out of memory (%zu bytes of zero buckets)", need);
    r->shadow_bytes = need;
    return DDP_SUCCESS;
}

/* A synchronised backward pass of the active ranks, shadowed: its sample count with n = 0 when it is weighted
   (`samples`), zeros into every bucket's all-reduce (all
   in flight at once, started in bucket order like the active ranks'), the used map, the rebuild. The
   program's gradients are not touched, except under zero_stage: the reduce-scatter's result (the active
   ranks' average) goes to this rank's owned elements, for its optimizer step (stage 2: the reducer's
   owned slices, which the shards point at; each bucket borrows a pool buffer for its zeros as in a pass
   with data, waiting for the oldest reduce-scatter when none is free). */
static ddp_result ddp__join_shadow_backward(ddp_reducer *r, int samples) {
    ddp_work *used_work = NULL;
    ddp_result res, waited;
    size_t off = 0, kept = 0;
    int b, j, keep = ddp__reducer_zero(r) && r->desc.find_unused_parameters, i;
    int64_t sums[2];
    if (samples && (res = ddp__samples_sum(r, 0, sums)) != DDP_SUCCESS) return ddp__reducer_stop(r, res); /* no samples here */
    if ((res = ddp__join_shadow_memory(r)) != DDP_SUCCESS) return res;
    if (ddp__reducer_zero(r)) ddp__amp_begin(&r->amp, ddp__grad_stats_on(r), r->desc.loss_scale); /* its shards' stats */
    if (keep && (res = ddp__stash_reserve(r, 1, "ddp_reducer_join_step")) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    for (b = 0; b < r->L.nbuckets && !res; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        size_t bytes = k->count * ddp_dtype_size(k->comm_dtype);
        void *zeros;
        if (ddp__zero2(r) && (res = ddp__zero2_acquire(r, b)) != DDP_SUCCESS) break;
        for (j = k->first; keep && j < k->first + k->n; j++) /* no parameter is used here: any may be unused everywhere */
            kept += ddp__unused_keep(r, r->L.params[j], (char *)r->stash + kept, 0);
        zeros = ddp__bucket_in_place(k) ? (char *)r->shadow + off : k->comm;
        if (ddp__bucket_in_place(k)) off += bytes;
        r->ops->zero(r->g, zeros, bytes);
        res = ddp__bucket_start(r, k, zeros);
    }
    if (!res && r->desc.find_unused_parameters) {
        r->ops->zero(r->g, r->used_comm, ddp__reducer_n(r));
        res = ddp_all_reduce_async(r->g, r->used_comm, ddp__reducer_n(r), DDP_U8, DDP_MAX, &used_work);
    }
    for (b = 0; b < r->L.nbuckets; b++)
        if (r->L.buckets[b].work) {
            waited = ddp_wait(r->L.buckets[b].work);
            r->L.buckets[b].work = NULL;
            if (!res) res = waited;
            if (ddp__zero2(r)) ddp__zero2_finish(r, &r->L.buckets[b], !res); /* the slice stays in the reducer */
        }
    if (used_work && (waited = ddp_wait(used_work)) != DDP_SUCCESS && !res) res = waited;
    if (res) return ddp__reducer_stop(r, res);
    if (used_work) r->ops->copy_out(r->g, r->used_global, DDP_U8, r->used_comm, DDP_U8, ddp__reducer_n(r));
    if (keep) ddp__reducer_finish_unused(r, 1); /* a parameter no rank used keeps what it held */
    for (i = 0; !keep && ddp__reducer_zero(r) && !ddp__zero2(r) && i < r->nparams; i++) ddp__zero_give_back(r, i);
    if (ddp__reducer_zero(r) && (res = ddp__amp_finish(r->g, &r->amp, 1)) != DDP_SUCCESS) return ddp__reducer_stop(r, res);
    r->stats.shadowed_iterations++;
    ddp__timing_finish(r);
    if ((res = ddp__timing_start(r, 1)) != DDP_SUCCESS) return res;
    if (r->rebuild_pending) return ddp__reducer_rebuild(r);
    return DDP_SUCCESS;
}

/* What join and join_step refuse before any round (nothing collective has happened then). */
static ddp_result ddp__join_check(ddp_reducer *r, const char *fn) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!r->desc.uneven_inputs)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created without uneven_inputs; set uneven_inputs = 1 "
                         "in its ddp_reducer_desc (on every rank) to let ranks run out of data", fn);
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: called during a backward pass; end it first (ddp_reducer_end_backward), "
                         "then join when there is no data left", fn);
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res;
    if (r->join_gather_due)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the last join step gave this rank's shards the averaged gradients; run "
                         "the optimizer on ddp_reducer_shards and call ddp_reducer_gather_params (the ranks with data are "
                         "in theirs) before the next ddp_reducer_join_step", fn);
    return DDP_SUCCESS;
}

/* Rounds until one synchronised pass of the active ranks is shadowed (*all_joined = 0) or none is left
   (*all_joined = 1: the final model and buffers from the last joiner). An error ends this rank's join:
   the next call announces a first round again. */
static ddp_result ddp__join_step(ddp_reducer *r, const char *fn, int *all_joined) {
    ddp__join_round v;
    ddp_result res;
    for (;;) {
        int flags = r->join_joined ? 0 : DDP__JOIN_FIRST;
        if ((res = ddp__join_exchange(r, fn, DDP__JOIN_JOINED, flags, &v)) != DDP_SUCCESS) return res;
        r->join_joined = 1;
        if (v.active == 0) break;
        if (v.disagree >= 0 || r->desc.join_fail_early) {
            r->join_joined = 0; /* this rank's join ends with the error */
            return v.disagree >= 0 ? ddp__join_disagree(r, fn, &v) : ddp__join_uneven(r, fn, &v);
        }
        if (v.kind == DDP__JOIN_BUFFERS)
            res = ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, v.last_active);
        else if (v.sync && (res = ddp__join_shadow_backward(r, v.samples)) == DDP_SUCCESS) {
            r->join_gather_due = ddp__reducer_zero(r);
            return DDP_SUCCESS;
        }
        if (res) return ddp__reducer_stop(r, res);
    }
    r->join_joined = 0;
    r->join_steps = 0;
    if ((res = ddp__reducer_sync_states(r, v.last_joiner >= 0 ? v.last_joiner : 0, fn)) != DDP_SUCCESS)
        return ddp__reducer_stop(r, res);
    *all_joined = 1;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_join_step(ddp_reducer *r, int *all_joined) {
    ddp_result res;
    if (all_joined) *all_joined = 0;
    if ((res = ddp__join_check(r, "ddp_reducer_join_step")) != DDP_SUCCESS) return res;
    if (!all_joined) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_join_step: all_joined is NULL");
    return ddp__join_step(r, "ddp_reducer_join_step", all_joined);
}

/* join_step's loop, for stage 0: between shadowed passes this rank has nothing to do. */
DDP_API ddp_result ddp_reducer_join(ddp_reducer *r) {
    ddp_result res = ddp__join_check(r, "ddp_reducer_join");
    int all_joined = 0;
    if (res) return res;
    if (ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_join: zero_stage = %d: a joined rank still owns slices of the "
                         "model, which its optimizer must update at every step of the others: call "
                         "ddp_reducer_join_step(r, &all_joined) in a loop, with the optimizer step on ddp_reducer_shards "
                         "and ddp_reducer_gather_params after each step that returns all_joined = 0", r->desc.zero_stage);
    while (!all_joined)
        if ((res = ddp__join_step(r, "ddp_reducer_join", &all_joined)) != DDP_SUCCESS) return res;
    return DDP_SUCCESS;
}

