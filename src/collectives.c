/* [SECTION] collectives: the public collectives, their fingerprints, dispatch to the backend, async work
   (torch.distributed.all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier)

   A call goes through four steps, the same for every collective and every backend:
     1. validate the arguments on the caller's thread (a bad call never reaches the wire);
     2. take the group's next sequence number: the fingerprint (seq, collective, count, dtype, op,
        root) that every message of the call carries (transport.c, shm.c) and that ranks compare;
     3. synchronous: wait for queued async work, then run it on the calling thread through
        g->backend->run; asynchronous: queue it for the group's progress thread (or give it to the
        backend's enqueue, which nccl uses to queue device work on its stream at once);
     4. on failure the group is broken (every rank fails; later calls return DDP_ERR_STATE) and the
        message lands in ddp_last_error(g) and in this thread's ddp_last_error(NULL).
   The algorithms live in the backends (tcp.c, shm.c, hier.c, mpi.c, nccl.c); tcp.c explains why a
   mismatch is an error on every rank. */
#include "internal.h"

/* Chunk i of `count` elements cut into n nearly equal parts (the first count % n get one more). */
static void ddp__chunk(size_t count, int n, int i, size_t *off, size_t *len) {
    size_t base = count / (size_t)n, rem = count % (size_t)n, ui = (size_t)i;
    *off = ui * base + DDP__MIN(ui, rem);
    *len = base + (ui < rem ? 1 : 0);
}

/* Staging memory owned by the group (one collective runs at a time on a group). */
static void *ddp__scratch(ddp_group *g, size_t bytes) {
    if (bytes > g->scratch_size) {
        void *p = ddp__malloc(bytes);
        if (!p) return NULL;
        ddp__free(g->scratch);
        g->scratch = p;
        g->scratch_size = bytes;
    }
    return g->scratch;
}

static ddp_result ddp__no_memory(ddp_group *g, size_t bytes) {
    return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory: could not allocate %zu bytes of staging memory", bytes);
}

static ddp__call ddp__make_call(ddp__coll_kind kind, const void *send, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                int root) {
    ddp__call k;
    k.kind = kind;
    k.send = send;
    k.buf = buf;
    k.count = count;
    k.dtype = t;
    k.op = op;
    k.root = root;
    return k;
}

/* ---- running a call ---- */

static ddp_result ddp__run(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c) {
    ddp_result r;
    if (g->broken) {
        ddp__trace_ended(g, c, DDP_ERR_STATE);
        return DDP_ERR_STATE;
    }
    g->mesh.waiting_for = -1;
    ddp__trace_started(g, c);
    r = b->run(g, k, c);
    ddp__trace_ended(g, c, r);
    return r;
}

/* Check a call's arguments on the caller's thread; a bad call never reaches the wire. */
static ddp_result ddp__validate(ddp_group *g, const ddp__call *k) {
    const char *name = ddp__coll_name(k->kind);
    size_t es, ranks, limit;
    ddp_result r = ddp__group_check(g, name);
    if (r) return r;
    if (k->kind == DDP__BARRIER) return DDP_SUCCESS;
    if (!ddp__dtype_valid(k->dtype))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)k->dtype);
    if ((k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER) && !ddp__op_valid(k->op))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a ddp_op (DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX)",
                         name, (int)k->op);
    if ((k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE) && (k->root < 0 || k->root >= g->world_size))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of this group (world size %d)", name, k->root,
                         g->world_size);
    es = ddp_dtype_size(k->dtype);
    ranks = (k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) ? (size_t)g->world_size : 1;
    limit = (size_t)(DDP__MAX_BUFFER_BYTES / es / ranks);
    if (k->count > limit)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is above the limit of %zu elements of %s%s: the call's "
                         "largest buffer (count x %zu bytes%s) must stay under 2^47 bytes (128 TiB), more than any "
                         "process can map; is the count computed right?", name, k->count, limit, ddp_dtype_name(k->dtype),
                         ranks > 1 ? " per rank" : "", es, ranks > 1 ? " x the world size" : "");
    if (k->count && !k->buf)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the buffer is NULL with count %zu", name, k->count);
    if (k->count && (k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) && !k->send)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send buffer is NULL with count %zu", name, k->count);
    return DDP_SUCCESS;
}

static void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c) {
    int takes_op = k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER;
    c->seq = ++g->seq;
    c->kind = (uint8_t)k->kind;
    c->count = k->kind == DDP__BARRIER ? 0 : k->count;
    c->dtype = (uint8_t)(k->kind == DDP__BARRIER ? 0 : k->dtype);
    c->op = (uint8_t)(takes_op ? k->op : DDP__NO_OP);
    c->root = (k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE) ? k->root : -1;
    ddp__trace_queued(g, c);
}

/* The message for a call on a group that an earlier error broke; written to out (DDP__ERR_MAX). */
static const char *ddp__broken_message(const ddp_group *g, const ddp__call *k, char *out) {
    snprintf(out, DDP__ERR_MAX, "%s: the group is broken by an earlier error and cannot be used; destroy it. The "
             "error was: %.800s", ddp__coll_name(k->kind), g->broken_msg);
    return out;
}

/* ---- the progress thread: runs queued work in issue order ---- */

static void *ddp__progress_main(void *arg) {
    ddp_group *g = (ddp_group *)arg;
    pthread_mutex_lock(&g->async.mu);
    for (;;) {
        ddp_work *w;
        ddp_result r;
        while (!g->async.head && !g->async.stop) pthread_cond_wait(&g->async.cv, &g->async.mu);
        if (!g->async.head) break;
        w = g->async.head;
        pthread_mutex_unlock(&g->async.mu);
        if (g->broken) {
            r = DDP_ERR_STATE;
            ddp__trace_ended(g, &w->coll, r);
            ddp__broken_message(g, &w->call, w->error);
        } else if ((r = ddp__run(g, g->backend, &w->call, &w->coll)) != DDP_SUCCESS) {
            snprintf(w->error, sizeof w->error, "%s", g->broken_msg);
        }
        pthread_mutex_lock(&g->async.mu);
        w->result = r;
        w->done = 1;
        g->async.head = w->next; /* dequeued only when done: "queue empty" means "nothing in flight" */
        if (!g->async.head) g->async.tail = NULL;
        pthread_cond_broadcast(&g->async.cv);
    }
    pthread_mutex_unlock(&g->async.mu);
    return NULL;
}

/* Wait until every queued async collective has finished (so a synchronous one runs after them). */
static void ddp__drain(ddp_group *g) {
    pthread_mutex_lock(&g->async.mu);
    while (g->async.head) pthread_cond_wait(&g->async.cv, &g->async.mu);
    pthread_mutex_unlock(&g->async.mu);
}

/* Stop the progress thread (group teardown); queued work is finished first. */
static void ddp__progress_stop(ddp_group *g) {
    if (!g->async.running) return;
    pthread_mutex_lock(&g->async.mu);
    g->async.stop = 1;
    pthread_cond_broadcast(&g->async.cv);
    pthread_mutex_unlock(&g->async.mu);
    pthread_join(g->async.thread, NULL);
    g->async.running = 0;
}

static ddp_result ddp__collective_on(ddp_group *g, const ddp__backend *b, const ddp__call *k) {
    char c_msg[DDP__ERR_MAX];
    ddp__coll c;
    ddp_result r = ddp__validate(g, k);
    if (r) return r;
    ddp__drain(g);
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, k, c_msg));
    ddp__fingerprint(g, k, &c);
    r = ddp__run(g, b, k, &c);
    if (r) return ddp__fail(g, r, "%s", g->broken_msg);
    return DDP_SUCCESS;
}

static ddp_result ddp__collective(ddp_group *g, const ddp__call *k) {
    ddp_result r = ddp__group_check(g, ddp__coll_name(k->kind)); /* before g->backend is read */
    if (r) return r;
    return ddp__collective_on(g, g->backend, k);
}

/* ---- work handles ----
   Every handle an async call returns is live (registry.c) and on its group's `issued` list until
   ddp_wait takes it, which happens once: a second ddp_wait (or ddp_test) on it finds it gone and fails
   without touching it. A group that ends frees the handles nobody waited on (ddp__work_release_all). */

/* Record w as issued on g and live; 0 when out of memory (w is then not returned). */
static int ddp__work_issue(ddp_group *g, ddp_work *w) {
    if (!ddp__live_add(w, DDP__LIVE_WORK)) return 0;
    pthread_mutex_lock(&g->async.mu);
    w->issued_prev = NULL;
    w->issued_next = g->async.issued;
    if (g->async.issued) g->async.issued->issued_prev = w;
    g->async.issued = w;
    pthread_mutex_unlock(&g->async.mu);
    return 1;
}

static void ddp__work_unlink(ddp_group *g, ddp_work *w) {
    pthread_mutex_lock(&g->async.mu);
    if (w->issued_prev) w->issued_prev->issued_next = w->issued_next;
    else g->async.issued = w->issued_next;
    if (w->issued_next) w->issued_next->issued_prev = w->issued_prev;
    w->issued_prev = w->issued_next = NULL;
    pthread_mutex_unlock(&g->async.mu);
}

/* The group is going away (its progress thread stopped): free the handles nobody waited on, so a later
   ddp_wait on one is an error instead of a use after free. */
static void ddp__work_release_all(ddp_group *g) {
    while (g->async.issued) {
        ddp_work *w = g->async.issued;
        g->async.issued = w->issued_next;
        ddp__live_remove(w, DDP__LIVE_WORK);
        ddp__free(w);
    }
}

static ddp_result ddp__spent_work(const char *fn, const ddp_work *w) {
    return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: work handle %p is not live: it was already waited on (call "
                     "ddp_wait exactly once per handle), or its group was destroyed (which releases the handles not "
                     "waited on), or it never came from an async collective", fn, (const void *)w);
}

static ddp_result ddp__collective_async(ddp_group *g, const ddp__call *k, ddp_work **out) {
    ddp_work *w;
    ddp_result r;
    if ((r = ddp__group_check(g, ddp__coll_name(k->kind))) != DDP_SUCCESS) return r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s_async: the ddp_work **out argument is NULL", ddp__coll_name(k->kind));
    *out = NULL;
    if ((r = ddp__validate(g, k)) != DDP_SUCCESS) return r;
    if (g->backend->enqueue && g->backend->enqueue(g, k, out, &r)) { /* the backend took it (nccl: device work) */
        if (r == DDP_SUCCESS && !ddp__work_issue(g, *out)) {
            r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work; the collective was queued: "
                          "destroy the group");
            *out = NULL;
        }
        return r;
    }
    w = (ddp_work *)ddp__calloc(1, sizeof *w);
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    if (!ddp__work_issue(g, w)) {
        ddp__free(w);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work");
    }
    w->g = g;
    w->call = *k;
    pthread_mutex_lock(&g->async.mu);
    if (!g->async.running) {
        if (pthread_create(&g->async.thread, NULL, ddp__progress_main, g) != 0) {
            pthread_mutex_unlock(&g->async.mu);
            ddp__live_remove(w, DDP__LIVE_WORK);
            ddp__work_unlink(g, w);
            ddp__free(w);
            return ddp__fail(g, DDP_ERR_SYSTEM, "could not start the progress thread: %s", strerror(errno));
        }
        g->async.running = 1;
    }
    ddp__fingerprint(g, k, &w->coll); /* under the lock: seq order is issue order */
    if (g->async.tail)
        g->async.tail->next = w;
    else
        g->async.head = w;
    g->async.tail = w;
    pthread_cond_broadcast(&g->async.cv);
    pthread_mutex_unlock(&g->async.mu);
    *out = w;
    return DDP_SUCCESS;
}

static ddp_result ddp__group_abort(ddp_group *g, ddp_result code, const char *msg) {
    ddp__drain(g);
    return ddp__group_break(g, code, msg);
}

DDP_API ddp_result ddp_wait(ddp_work *w) {
    ddp_group *g;
    ddp_result r;
    if (!w) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_wait: the work handle is NULL");
    if (!ddp__live_take(w, DDP__LIVE_WORK)) return ddp__spent_work("ddp_wait", w);
    g = w->g;
    ddp__work_unlink(g, w);
    if (w->owner) { /* the backend's own work (nccl: device work), freed by its wait */
        ddp__coll c = w->coll;
        r = w->owner->wait(w);
        ddp__trace_ended(g, &c, r);
        return r;
    }
    pthread_mutex_lock(&g->async.mu);
    while (!w->done) pthread_cond_wait(&g->async.cv, &g->async.mu);
    pthread_mutex_unlock(&g->async.mu);
    r = w->result;
    if (r) ddp__fail(g, r, "%s", w->error);
    ddp__free(w);
    return r;
}

DDP_API int ddp_test(ddp_work *w) {
    int done;
    if (!w) return 1;
    if (!ddp__live_has(w, DDP__LIVE_WORK)) { /* ddp_wait would not block: it fails at once */
        ddp__spent_work("ddp_test", w);
        return 1;
    }
    if (w->owner) return w->owner->test(w);
    pthread_mutex_lock(&w->g->async.mu);
    done = w->done;
    pthread_mutex_unlock(&w->g->async.mu);
    return done;
}

/* ---- the public collectives: describe the call, then run it now or queue it ---- */

DDP_API ddp_result ddp_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_gather(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_reduce_scatter(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                      ddp_op op) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_barrier(ddp_group *g) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective(g, &k);
}

DDP_API ddp_result ddp_all_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_broadcast_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_gather_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                        ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_scatter_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                            ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_barrier_async(ddp_group *g, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}
