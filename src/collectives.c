/* [SECTION] collectives: ddp_all_reduce ... ddp_gather, ddp_scatter, ddp_all_to_all(_v), ddp_all_gather_v, ddp_broadcast_bytes, ddp_monitored_barrier
   The public collectives, their fingerprints, dispatch to the backend, async work (torch.distributed's
   all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier, gather, scatter, all_to_all_single
   with and without split sizes, all_gather of uneven tensors, broadcast_object_list, monitored_barrier).

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
    ddp__call k; /* field by field, no memset: a memset then narrower stores then the copy out read back
                    as wide loads stalled store forwarding: 57 -> 41 ns per call on a group of one */
    k.kind = kind;
    k.send = send;
    k.buf = buf;
    k.count = count;
    k.dtype = t;
    k.op = op;
    k.root = root;
    k.send_counts = k.recv_counts = NULL;
    k.bytes = NULL;
    k.bytes_size = NULL;
    k.seconds = 0;
    k.tag = 0;
    return k;
}

/* ---- running a call ---- */

/* broadcast_bytes (torch's broadcast_object_list): two broadcasts under the call's one fingerprint, the
   size and then the data, into a buffer that the receivers allocate in between. Every backend runs a
   broadcast with any fingerprint, and both runs carry the same one (shm's first step republishes it). */
static ddp_result ddp__broadcast_bytes_run(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c) {
    uint64_t size = g->rank == k->root ? (uint64_t)*k->bytes_size : 0; /* sent as its 8 bytes: ranks share a byte order */
    ddp__call part = ddp__make_call(DDP__BROADCAST, NULL, &size, 8, DDP_U8, DDP_SUM, k->root);
    char *data = g->rank == k->root ? (char *)*k->bytes : NULL;
    ddp_result r = b->run(g, &part, c);
    if (r) return r;
    if (size > DDP__MAX_BUFFER_BYTES) /* the root checked its own size: this is no size the root sent */
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "broadcast_bytes: rank %d received a size of %llu bytes from the root",
                              g->rank, (unsigned long long)size);
    if (g->rank != k->root && !(data = (char *)ddp__malloc(size ? (size_t)size : 1)))
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "broadcast_bytes: rank %d is out of memory for the root's %llu bytes",
                              g->rank, (unsigned long long)size);
    part = ddp__make_call(DDP__BROADCAST, NULL, data, (size_t)size, DDP_U8, DDP_SUM, k->root);
    if ((r = b->run(g, &part, c)) != DDP_SUCCESS) {
        if (g->rank != k->root) ddp__free(data);
        return r;
    }
    if (g->rank != k->root) {
        *k->bytes = data;
        *k->bytes_size = (size_t)size;
    }
    return DDP_SUCCESS;
}

/* send and recv: no collective number, so the flight recorder (which files calls by it) leaves them out. */
static int ddp__is_p2p(int kind) { return kind == DDP__SEND || kind == DDP__RECV; }

/* Run k on backend b (point-to-point over the mesh, or MPI's own on the mpi backend). */
/* times (NULL: not wanted): the run's start and end (ddp__now) and this thread's timeline lane (0 while the
   timeline is off). */
static ddp_result ddp__run(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c, double *times) {
    int p2p = ddp__is_p2p(k->kind);
    double t0 = times || ddp__timeline_on() ? ddp__now() : 0;
    ddp_result r;
    DDP_ASSERT(k->root >= -1 && k->root < g->world_size); /* validated (-1: a call without a root) */
    if (g->broken) {
        if (!p2p) ddp__trace_ended(g, c, DDP_ERR_STATE);
        return DDP_ERR_STATE;
    }
    g->mesh.waiting_for = -1;
    if (p2p) {
        r = b->p2p_start ? b->run(g, k, c) : ddp__p2p_run(g, k, c); /* the backend's own, or the mesh's */
    } else {
        ddp__trace_started(g, c);
        r = k->kind == DDP__BROADCAST_BYTES ? ddp__broadcast_bytes_run(g, b, k, c) : b->run(g, k, c);
        ddp__trace_ended(g, c, r);
    }
    if (t0 > 0) {
        double t1 = ddp__now();
        if (ddp__timeline_on()) ddp__timeline_coll(g, c, t0, t1, r);
        if (times) times[0] = t0, times[1] = t1, times[2] = ddp__timeline_lane();
    }
    return r;
}

/* Run k on backend b, through pinned host copies when a buffer of k is device memory on a group whose
   backend takes host memory only (devbuf.c). On the calling thread (the async calls run such a call
   here too: ddp__collective_async). */
static ddp_result ddp__run_staged(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c) {
    ddp__devbuf_plan plan;
    ddp__call host_call;
    ddp_result r;
    if (g->broken || !ddp__devbuf_wanted(g, k)) return ddp__run(g, b, k, c, NULL);
    if ((r = ddp__devbuf_stage(g, k, c, &host_call, &plan)) != DDP_SUCCESS) return r;
    if ((r = ddp__run(g, b, &host_call, c, NULL)) != DDP_SUCCESS) return r;
    return ddp__devbuf_unstage(g, c, &plan);
}

/* The sum of a split-size list (world entries), or UINT64_MAX when it passes 2^63 (too large anyway). */
static uint64_t ddp__counts_sum(const size_t *counts, int n) {
    uint64_t sum = 0;
    int i;
    for (i = 0; i < n; i++) {
        if ((uint64_t)counts[i] > ((uint64_t)1 << 63) - sum) return UINT64_MAX;
        sum += (uint64_t)counts[i];
    }
    return sum;
}

/* The elements of a call's largest buffer, for the size limit: count x world size for the calls whose
   count is per rank, the sums of the split sizes for the _v calls (the larger side), else count. */
static uint64_t ddp__call_elements(const ddp_group *g, const ddp__call *k) {
    switch (k->kind) {
    case DDP__ALL_GATHER:
    case DDP__REDUCE_SCATTER:
    case DDP__GATHER:
    case DDP__SCATTER:
    case DDP__ALL_TO_ALL: return (uint64_t)k->count * (uint64_t)g->world_size; /* count <= 2^47 here (checked first) */
    case DDP__ALL_TO_ALL_V: {
        uint64_t a = ddp__counts_sum(k->send_counts, g->world_size), b = ddp__counts_sum(k->recv_counts, g->world_size);
        return DDP__MAX(a, b);
    }
    case DDP__ALL_GATHER_V: return ddp__counts_sum(k->recv_counts, g->world_size);
    default: return k->count;
    }
}

static int ddp__takes_root(int kind) {
    return kind == DDP__BROADCAST || kind == DDP__REDUCE || kind == DDP__GATHER || kind == DDP__SCATTER ||
           kind == DDP__BROADCAST_BYTES;
}

/* Check a call's arguments on the caller's thread; a bad call never reaches the wire. Each buffer is
   checked only where the call reads or writes it: gather's recv and scatter's send on the root alone.
   The caller has checked that g is live (ddp__group_check). */
static ddp_result ddp__validate(ddp_group *g, const ddp__call *k) {
    const char *name = ddp__coll_name(k->kind);
    size_t es;
    uint64_t elements, limit;
    int root, v = k->kind == DDP__ALL_TO_ALL_V || k->kind == DDP__ALL_GATHER_V;
    root = g->rank == k->root;
    if (k->kind == DDP__BARRIER) return DDP_SUCCESS;
    if (k->kind == DDP__MONITORED_BARRIER) {
        if (!(k->seconds == k->seconds) || k->seconds > 1e9) /* NaN, or beyond any job */
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: timeout_seconds %g is not a number of seconds (<= 0: the "
                             "group's timeout)", name, k->seconds);
        return DDP_SUCCESS;
    }
    if (!ddp__dtype_valid(k->dtype))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)k->dtype);
    if ((k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER) && !ddp__op_valid(k->op))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a ddp_op (DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX)",
                         name, (int)k->op);
    if (ddp__takes_root(k->kind) && (k->root < 0 || k->root >= g->world_size))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of this group (world size %d)", name, k->root,
                         g->world_size);
    if (k->kind == DDP__BROADCAST_BYTES) {
        if (!k->bytes || !k->bytes_size)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the %s argument is NULL (every rank passes both: the root "
                             "its data and size, the others where to put them)", name, !k->bytes ? "data" : "size");
        if (root && *k->bytes_size > DDP__MAX_BUFFER_BYTES)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: size %zu is above the limit of 2^47 bytes (128 TiB)", name,
                             *k->bytes_size);
        if (root && *k->bytes_size && !*k->bytes)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the root's data is NULL with size %zu", name, *k->bytes_size);
        return DDP_SUCCESS;
    }
    if (k->kind == DDP__ALL_TO_ALL_V && (!k->send_counts || !k->recv_counts))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL; pass world-size entries (0 for no elements)", name,
                         !k->send_counts ? "send_counts" : "recv_counts");
    if (k->kind == DDP__ALL_TO_ALL_V && k->send_counts[g->rank] != k->recv_counts[g->rank])
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: send_counts[%d] is %zu but recv_counts[%d] is %zu on rank %d: "
                         "the block a rank sends itself is the block it receives from itself", name, g->rank,
                         k->send_counts[g->rank], g->rank, k->recv_counts[g->rank], g->rank);
    if (k->kind == DDP__ALL_GATHER_V && !k->recv_counts)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: counts is NULL; pass world-size entries, one per rank", name);
    if (k->kind == DDP__ALL_GATHER_V && k->recv_counts[g->rank] != k->count)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count is %zu but counts[%d] (this rank's entry) is %zu; they "
                         "must be equal", name, k->count, g->rank, k->recv_counts[g->rank]);
    es = ddp_dtype_size(k->dtype);
    limit = DDP__MAX_BUFFER_BYTES / es;
    elements = k->count > limit ? UINT64_MAX : ddp__call_elements(g, k);
    if (elements > limit) {
        if (v)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the counts add up to more than %llu elements of %s, the limit "
                             "for one buffer (2^47 bytes, 128 TiB); are they computed right?", name,
                             (unsigned long long)limit, ddp_dtype_name(k->dtype));
        int per_rank = k->kind != DDP__ALL_REDUCE && k->kind != DDP__BROADCAST && k->kind != DDP__REDUCE;
        limit /= per_rank ? (uint64_t)g->world_size : 1;
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is above the limit of %llu elements of %s%s: the call's "
                         "largest buffer (count x %zu bytes%s) must stay under 2^47 bytes (128 TiB), more than any "
                         "process can map; is the count computed right?", name, k->count, (unsigned long long)limit,
                         ddp_dtype_name(k->dtype), per_rank ? " per rank" : "", es, per_rank ? " x the world size" : "");
    }
    { /* the buffers this rank touches, and how many elements each holds (in-place calls: buf alone) */
        uint64_t send_n = 0, recv_n = k->count;
        switch (k->kind) {
        case DDP__ALL_GATHER:
        case DDP__REDUCE_SCATTER:
        case DDP__ALL_TO_ALL: send_n = k->count; break;
        case DDP__GATHER: send_n = k->count, recv_n = root ? k->count : 0; break;
        case DDP__SCATTER: send_n = root ? k->count : 0; break;
        case DDP__ALL_TO_ALL_V:
            send_n = ddp__counts_sum(k->send_counts, g->world_size);
            recv_n = ddp__counts_sum(k->recv_counts, g->world_size);
            break;
        case DDP__ALL_GATHER_V: send_n = k->count, recv_n = elements; break;
        default: break;
        }
        if (recv_n && !k->buf)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the %sbuffer is NULL with %llu elements to %s", name,
                             k->kind == DDP__ALL_REDUCE || k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE ? "" : "recv ",
                             (unsigned long long)recv_n, k->kind == DDP__REDUCE || k->kind == DDP__ALL_REDUCE ? "reduce" : "receive");
        if (send_n && !k->send)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send buffer is NULL with %llu elements to send", name,
                             (unsigned long long)send_n);
        if (k->kind == DDP__ALL_TO_ALL_V && send_n && recv_n) { /* blocks move in an order of their own: no in place */
            uintptr_t s0 = (uintptr_t)k->send, r0 = (uintptr_t)k->buf;
            if (s0 < r0 + recv_n * es && r0 < s0 + send_n * es)
                return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send and recv buffers overlap; all_to_all_v does "
                                 "not run in place (ddp_all_to_all does): pass separate buffers", name);
        }
    }
    return DDP_SUCCESS;
}

/* The fingerprint: what every rank must agree on. The _v calls' split sizes differ from rank to rank by
   design; all_gather_v's total is in it, and each frame's size is checked against what its receiver
   expects (transport.c). */
static void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c, int now) {
    int takes_op = k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER;
    int no_data = k->kind == DDP__BARRIER || k->kind == DDP__MONITORED_BARRIER || k->kind == DDP__BROADCAST_BYTES;
    c->seq = ++g->seq;
    c->kind = (uint8_t)k->kind;
    c->count = no_data || k->kind == DDP__ALL_TO_ALL_V ? 0
               : k->kind == DDP__ALL_GATHER_V         ? ddp__counts_sum(k->recv_counts, g->world_size)
                                                       : k->count;
    c->dtype = (uint8_t)(no_data ? 0 : k->dtype);
    c->op = (uint8_t)(takes_op ? k->op : DDP__NO_OP);
    c->root = ddp__takes_root(k->kind) ? k->root : -1;
    c->tag = -1;
    c->purpose = g->purpose;
    c->t_queued = 0; /* ddp__enqueue's, for the timeline */
    ddp__trace_queued(g, c, now);
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
    ddp__timeline_lane_progress(g);
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
            if (!ddp__is_p2p(w->call.kind)) ddp__trace_ended(g, &w->coll, r);
            ddp__broken_message(g, &w->call, w->error);
        } else if ((r = ddp__run(g, g->backend, &w->call, &w->coll, w->times)) != DDP_SUCCESS) {
            snprintf(w->error, sizeof w->error, "%s", g->broken_msg);
        }
        pthread_mutex_lock(&g->async.mu);
        w->result = r;
        w->done = 1;
        /* dequeued only when done: "queue empty" means "nothing in flight" */
        __atomic_store_n(&g->async.head, w->next, __ATOMIC_RELEASE);
        if (!g->async.head) g->async.tail = NULL;
        pthread_cond_broadcast(&g->async.cv);
    }
    pthread_mutex_unlock(&g->async.mu);
    return NULL;
}

/* Wait until every queued async collective has finished (so a synchronous one runs after them). */
static void ddp__drain(ddp_group *g) {
    if (!__atomic_load_n(&g->async.head, __ATOMIC_ACQUIRE)) return; /* nothing queued or in flight (only this thread queues) */
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
    ddp__fingerprint(g, k, &c, 1);
    r = ddp__run_staged(g, b, k, &c);
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
static ddp_result ddp__irecv_wait(ddp_work *w);
static void ddp__work_release_all(ddp_group *g) {
    while (g->async.issued) {
        ddp_work *w = g->async.issued;
        g->async.issued = w->issued_next;
        ddp__live_remove(w, DDP__LIVE_WORK);
        if (w->owner && w->owner->wait == ddp__irecv_wait) ddp__free(w->handle); /* its posted receive */
        if (w->owner && w->owner->p2p_release) w->owner->p2p_release(w); /* a backend's own (mpi) */
        ddp__free(w);
    }
}

static ddp_result ddp__spent_work(const char *fn, const ddp_work *w) {
    return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: work handle %p is not live: it was already waited on (call "
                     "ddp_wait exactly once per handle), or its group was destroyed (which releases the handles not "
                     "waited on), or it never came from an async collective", fn, (const void *)w);
}

/* Queue k (validated) for the progress thread: fingerprinted as g's next collective, or, for an isend,
   under its own description `p2p`. */
static ddp_result ddp__enqueue(ddp_group *g, const ddp__call *k, const ddp__coll *p2p, ddp_work **out) {
    ddp_work *w = (ddp_work *)ddp__calloc(1, sizeof *w);
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
    if (p2p) w->coll = *p2p;
    else ddp__fingerprint(g, k, &w->coll, 0); /* under the lock: seq order is issue order */
    if (ddp__timeline_on()) w->coll.t_queued = ddp__now();
    if (g->async.tail)
        g->async.tail->next = w;
    else
        __atomic_store_n(&g->async.head, w, __ATOMIC_RELEASE); /* ddp__drain reads it without the lock */
    g->async.tail = w;
    pthread_cond_broadcast(&g->async.cv);
    pthread_mutex_unlock(&g->async.mu);
    *out = w;
    return DDP_SUCCESS;
}

/* An async call with device buffers on a group that stages them (devbuf.c): run now, after the queued
   work, on the calling thread (the staging uses the caller's stream and the group's one pinned
   area); the ddp_work returned is complete. A failure is returned here, with no work. */
static ddp_result ddp__collective_staged(ddp_group *g, const ddp__call *k, ddp_work **out) {
    ddp_work *w = (ddp_work *)ddp__calloc(1, sizeof *w);
    ddp_result r;
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    if ((r = ddp__collective_on(g, g->backend, k)) != DDP_SUCCESS) {
        ddp__free(w);
        return r;
    }
    w->g = g;
    w->call = *k;
    w->done = 1;
    if (!ddp__work_issue(g, w)) {
        ddp__free(w);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work (the collective completed)");
    }
    *out = w;
    return DDP_SUCCESS;
}

static ddp_result ddp__collective_async(ddp_group *g, const ddp__call *k, ddp_work **out) {
    ddp_result r;
    if ((r = ddp__group_check(g, ddp__coll_name(k->kind))) != DDP_SUCCESS) return r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s_async: the ddp_work **out argument is NULL", ddp__coll_name(k->kind));
    *out = NULL;
    if ((r = ddp__validate(g, k)) != DDP_SUCCESS) return r;
    if (ddp__devbuf_wanted(g, k)) return ddp__collective_staged(g, k, out);
    if (g->backend->enqueue && g->backend->enqueue(g, k, out, &r)) { /* the backend took it (nccl: device work) */
        if (r == DDP_SUCCESS && !ddp__work_issue(g, *out)) {
            r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work; the collective was queued: "
                          "destroy the group");
            *out = NULL;
        }
        return r;
    }
    return ddp__enqueue(g, k, NULL, out);
}

static ddp_result ddp__group_abort(ddp_group *g, ddp_result code, const char *msg) {
    ddp__drain(g);
    return ddp__group_break(g, code, msg);
}

/* ddp_wait, also giving when the progress thread ran w (times: start and end, ddp__now; both 0 when another
   owner ran it, e.g. nccl's device work): the reducer's buckets on the timeline, FSDP's gather time. */
static ddp_result ddp__wait_times(ddp_work *w, double *times) {
    ddp_group *g;
    ddp_result r;
    times[0] = times[1] = times[2] = 0;
    if (!w) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_wait: the work handle is NULL");
    if (!ddp__live_take(w, DDP__LIVE_WORK)) return ddp__spent_work("ddp_wait", w);
    g = w->g;
    if (g) ddp__work_unlink(g, w); /* an async checkpoint save without a group has none */
    if (w->owner) { /* the backend's own work (nccl: device work; an irecv; a checkpoint save), freed by its wait */
        ddp__coll c = w->coll;
        int traced = c.kind != 0 && !ddp__is_p2p(c.kind); /* kind 0: no collective (a checkpoint save) */
        r = w->owner->wait(w);
        if (traced) ddp__trace_ended(g, &c, r);
        return r;
    }
    pthread_mutex_lock(&g->async.mu);
    while (!w->done) pthread_cond_wait(&g->async.cv, &g->async.mu);
    pthread_mutex_unlock(&g->async.mu);
    r = w->result;
    if (r) ddp__fail(g, r, "%s", w->error);
    memcpy(times, w->times, sizeof w->times);
    ddp__free(w);
    return r;
}

DDP_API ddp_result ddp_wait(ddp_work *w) {
    double times[3];
    return ddp__wait_times(w, times);
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

/* ---- gather, scatter, all_to_all, the uneven calls, broadcast_bytes, monitored_barrier ---- */

static ddp__call ddp__v_call(ddp__coll_kind kind, const void *send, const size_t *send_counts, void *recv,
                             const size_t *recv_counts, size_t count, ddp_dtype t) {
    ddp__call k = ddp__make_call(kind, send, recv, count, t, DDP_SUM, -1);
    k.send_counts = send_counts;
    k.recv_counts = recv_counts;
    return k;
}

static ddp__call ddp__bytes_call(void **data, size_t *size, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST_BYTES, NULL, NULL, 0, DDP_U8, DDP_SUM, root);
    k.bytes = data;
    k.bytes_size = size;
    return k;
}

static ddp__call ddp__monitored_call(double seconds) {
    ddp__call k = ddp__make_call(DDP__MONITORED_BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    k.seconds = seconds;
    return k;
}

DDP_API ddp_result ddp_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__GATHER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_scatter(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__SCATTER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_to_all(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_TO_ALL, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_to_all_v(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                    const size_t *recv_counts, ddp_dtype t) {
    ddp__call k = ddp__v_call(DDP__ALL_TO_ALL_V, send, send_counts, recv, recv_counts, 0, t);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_gather_v(ddp_group *g, const void *send, size_t count, void *recv, const size_t *counts,
                                    ddp_dtype t) {
    ddp__call k = ddp__v_call(DDP__ALL_GATHER_V, send, NULL, recv, counts, count, t);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_broadcast_bytes(ddp_group *g, void **data, size_t *size, int root) {
    ddp__call k = ddp__bytes_call(data, size, root);
    return ddp__collective(g, &k);
}
DDP_API void ddp_free_bytes(void *data) { ddp__free(data); }
DDP_API ddp_result ddp_monitored_barrier(ddp_group *g, double timeout_seconds) {
    ddp__call k = ddp__monitored_call(timeout_seconds);
    return ddp__collective(g, &k);
}

DDP_API ddp_result ddp_gather_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                    ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__GATHER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_scatter_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                     ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__SCATTER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_to_all_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                        ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_TO_ALL, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_to_all_v_async(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                          const size_t *recv_counts, ddp_dtype t, ddp_work **w) {
    ddp__call k = ddp__v_call(DDP__ALL_TO_ALL_V, send, send_counts, recv, recv_counts, 0, t);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_gather_v_async(ddp_group *g, const void *send, size_t count, void *recv, const size_t *counts,
                                          ddp_dtype t, ddp_work **w) {
    ddp__call k = ddp__v_call(DDP__ALL_GATHER_V, send, NULL, recv, counts, count, t);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_broadcast_bytes_async(ddp_group *g, void **data, size_t *size, int root, ddp_work **w) {
    ddp__call k = ddp__bytes_call(data, size, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_monitored_barrier_async(ddp_group *g, double timeout_seconds, ddp_work **w) {
    ddp__call k = ddp__monitored_call(timeout_seconds);
    return ddp__collective_async(g, &k, w);
}

/* ---- point-to-point: ddp_send, ddp_recv, ddp_isend, ddp_irecv ----
   Not collectives: two ranks take part, so a call takes no collective number (the fingerprint that every
   rank compares); it is described by its peer and tag under a number of its own (see ddp__mesh). It goes
   over the TCP mesh whatever the backend (transport.c's matching; the mpi backend sends with MPI).
   ddp_send / ddp_recv run on the calling thread after the group's queued async work, as the synchronous
   collectives do. ddp_isend is queued for the progress thread like an async collective (a send never
   waits for its receive). ddp_irecv is not queued: it is posted at once (a message already stashed
   finishes it there), so a later queued call, or any call that reads frames, can finish it; ddp_wait
   first lets the queued work run, then reads until its message comes; ddp_test looks once when no
   queued work runs. So the exchange patterns work in any order: irecv then isend on every rank, or an
   irecv posted before collectives that its sender calls first. */

/* The arguments of a send or recv, checked on the caller's thread (a bad call breaks nothing). */
static ddp_result ddp__p2p_check(ddp_group *g, const char *name, ddp__coll_kind kind, const void *buf, size_t count,
                                 ddp_dtype t, int peer, int tag) {
    ddp_result r = ddp__group_check(g, name);
    if (r) return r;
    if (!ddp__dtype_valid(t))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)t);
    if (peer < 0 || peer >= g->world_size || peer == g->rank)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %s %d is not another rank of this group (rank %d of %d)", name,
                         kind == DDP__SEND ? "dst" : "src", peer, g->rank, g->world_size);
    if (tag < 0) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tag %d is negative", name, tag);
    if (count > DDP__MAX_BUFFER_BYTES / ddp_dtype_size(t))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is above the limit of 2^47 bytes (128 TiB) of %s", name,
                         count, ddp_dtype_name(t));
    if (count && !buf) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the buffer is NULL with count %zu", name, count);
#if defined(DDP_CUDA)
    if (count && g->nccl && ddp__cuda_is_device_pointer(buf) == 1)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: the nccl backend sends and receives host memory only so far "
                         "(ncclSend/ncclRecv for device memory are not built yet): copy the buffer to host memory", name);
#endif
    return DDP_SUCCESS;
}

/* The call and its description: the peer in root, its own number (no collective's). */
static void ddp__p2p_describe(ddp_group *g, ddp__call *k, ddp__coll *c, ddp__coll_kind kind, const void *send, void *recv,
                              size_t count, ddp_dtype t, int peer, int tag) {
    *k = ddp__make_call(kind, send, recv, count, t, DDP_SUM, peer);
    k->tag = tag;
    memset(c, 0, sizeof *c);
    c->seq = UINT64_MAX - ++g->mesh.p2p_calls; /* see ddp__mesh */
    c->kind = (uint8_t)kind;
    c->count = count;
    c->dtype = (uint8_t)t;
    c->op = DDP__NO_OP;
    c->root = peer;
    c->tag = tag;
}

static ddp_result ddp__p2p(ddp_group *g, ddp__coll_kind kind, const void *send, void *recv, size_t count, ddp_dtype t,
                           int peer, int tag) {
    const char *name = ddp__coll_name(kind);
    char msg[DDP__ERR_MAX];
    ddp__call k;
    ddp__coll c;
    ddp_result r = ddp__p2p_check(g, name, kind, kind == DDP__SEND ? send : recv, count, t, peer, tag);
    if (r) return r;
    ddp__drain(g);
    ddp__p2p_describe(g, &k, &c, kind, send, recv, count, t, peer, tag);
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, &k, msg));
    if ((r = ddp__run_staged(g, g->backend, &k, &c)) != DDP_SUCCESS) return ddp__fail(g, r, "%s", g->broken_msg);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_send(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag) {
    return ddp__p2p(g, DDP__SEND, buf, NULL, count, t, dst, tag);
}
DDP_API ddp_result ddp_recv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag) {
    return ddp__p2p(g, DDP__RECV, NULL, buf, count, t, src, tag);
}

/* Checks shared by ddp_isend and ddp_irecv; *out = NULL. */
static ddp_result ddp__p2p_async_check(ddp_group *g, const char *name, ddp__coll_kind kind, const void *buf, size_t count,
                                       ddp_dtype t, int peer, int tag, ddp_work **out) {
    ddp_result r = ddp__p2p_check(g, name, kind, buf, count, t, peer, tag);
    if (r) return r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the ddp_work **out argument is NULL", name);
    *out = NULL;
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s: the group is broken by an earlier error and cannot be used; "
                                    "destroy it. The error was: %.800s", name, g->broken_msg);
#if defined(DDP_CUDA)
    if (count && !g->nccl && ddp__cuda_is_device_pointer(buf) == 1) /* devbuf.c stages within one call only */
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: the buffer is device memory; on backend \"%s\" device buffers are "
                         "staged through host memory within a call, which %s outlives: use ddp_%s (staged), or copy "
                         "the buffer to host memory", name, g->backend->family, name, kind == DDP__SEND ? "send" : "recv");
#endif
    return DDP_SUCCESS;
}

/* On a backend with point-to-point calls of its own (mpi: MPI's nonblocking calls), started now. */
static ddp_result ddp__backend_p2p_async(ddp_group *g, ddp__coll_kind kind, const void *send, void *recv, size_t count,
                                     ddp_dtype t, int peer, int tag, ddp_work **out) {
    ddp_work *w = (ddp_work *)ddp__calloc(1, sizeof *w);
    ddp_result r;
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    w->g = g;
    ddp__p2p_describe(g, &w->call, &w->coll, kind, send, recv, count, t, peer, tag);
    ddp__drain(g); /* in issue order with the queued collectives */
    if ((r = g->backend->p2p_start(g, w)) != DDP_SUCCESS || !ddp__work_issue(g, w)) {
        if (r == DDP_SUCCESS) { /* started, and nobody can wait for it: the group cannot go on */
            w->owner->p2p_release(w);
            r = ddp__group_abort(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work");
        }
        ddp__free(w);
        return r;
    }
    *out = w;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_isend(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag, ddp_work **w) {
    ddp__call k;
    ddp__coll c;
    ddp_result r = ddp__p2p_async_check(g, "isend", DDP__SEND, buf, count, t, dst, tag, w);
    if (r) return r;
    if (g->backend->p2p_start) return ddp__backend_p2p_async(g, DDP__SEND, buf, NULL, count, t, dst, tag, w);
    ddp__p2p_describe(g, &k, &c, DDP__SEND, buf, NULL, count, t, dst, tag);
    return ddp__enqueue(g, &k, &c, w);
}

/* An irecv's handle: its wait and test (ddp_work.owner); w->handle is its posted receive. */
static ddp_result ddp__irecv_wait(ddp_work *w) {
    ddp_group *g = w->g;
    ddp__posted *p = (ddp__posted *)w->handle;
    ddp_result r;
    ddp__drain(g); /* queued work first: it may bring the message, and it reads the connections meanwhile */
    if (ddp__posted_done(g, p)) r = p->result;
    else if (g->broken) r = g->broken;
    else r = ddp__p2p_wait(g, &w->coll, p, 0);
    if (!ddp__posted_done(g, p)) ddp__p2p_unpost(g, p);
    if (r) ddp__fail(g, r, "%s", g->broken ? g->broken_msg : "irecv failed");
    ddp__free(p);
    ddp__free(w);
    return r;
}

static int ddp__irecv_test(ddp_work *w) {
    ddp_group *g = w->g;
    ddp__posted *p = (ddp__posted *)w->handle;
    int idle;
    if (ddp__posted_done(g, p) || g->broken) return 1;
    pthread_mutex_lock(&g->async.mu);
    idle = g->async.head == NULL; /* no queued work reads the connections now, and only this thread queues more */
    pthread_mutex_unlock(&g->async.mu);
    if (idle) ddp__p2p_wait(g, &w->coll, p, 1);
    return ddp__posted_done(g, p) || g->broken != DDP_SUCCESS;
}

static const ddp__backend ddp__irecv_owner = {"p2p", "cpu", NULL, NULL, ddp__irecv_wait, ddp__irecv_test, NULL,
                                              NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};

DDP_API ddp_result ddp_irecv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag, ddp_work **out) {
    ddp__posted *p;
    ddp_work *w;
    ddp_result r = ddp__p2p_async_check(g, "irecv", DDP__RECV, buf, count, t, src, tag, out);
    if (r) return r;
    if (g->backend->p2p_start) return ddp__backend_p2p_async(g, DDP__RECV, NULL, buf, count, t, src, tag, out);
    w = (ddp_work *)ddp__calloc(1, sizeof *w);
    p = (ddp__posted *)ddp__calloc(1, sizeof *p);
    if (!w || !p || !ddp__work_issue(g, w)) {
        ddp__free(w);
        ddp__free(p);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "irecv: out of memory allocating a ddp_work");
    }
    w->g = g;
    w->owner = &ddp__irecv_owner;
    w->handle = p;
    ddp__p2p_describe(g, &w->call, &w->coll, DDP__RECV, NULL, buf, count, t, src, tag);
    p->src = src;
    p->tag = tag;
    p->buf = buf;
    p->bytes = count * ddp_dtype_size(t);
    p->count = count;
    p->dtype = (uint8_t)t;
    if ((r = ddp__p2p_post(g, p)) != DDP_SUCCESS) { /* a stashed message of another size: the group is broken */
        ddp__live_remove(w, DDP__LIVE_WORK);
        ddp__work_unlink(g, w);
        ddp__free(p);
        ddp__free(w);
        return ddp__fail(g, r, "%s", g->broken_msg);
    }
    *out = w;
    return DDP_SUCCESS;
}

/* ---- agreeing on an outcome ----
   For the library's own multi-step calls (checkpoints, ZeRO state): each rank passes its local result,
   and the first failure (lowest rank) becomes every rank's error with that rank's message, so an error
   anywhere is an error everywhere and nobody is left waiting in a later collective. A group of one (or
   none: g NULL) returns mine. */

/* This rank's own failure, worded as the other ranks word it ("checkpoint save failed on rank 0: ..."),
   so that every rank's message names the operation and the rank that failed. */
static ddp_result ddp__failed_here(ddp_group *g, ddp_result mine, const char *what, const char *own) {
    return ddp__fail(g, mine, "%s failed on rank %d: %.900s", what, g->rank, own);
}

static ddp_result ddp__agree_outcome(ddp_group *g, ddp_result mine, const char *what) {
    int32_t code = (int32_t)mine, *codes;
    char *msgs, own[DDP__ERR_MAX];
    int w, i, bad = -1;
    ddp_result r;
    if (!g || g->world_size <= 1) return mine;
    w = g->world_size;
    memset(own, 0, sizeof own);
    if (mine != DDP_SUCCESS) snprintf(own, sizeof own, "%s", ddp_last_error(g));
    codes = (int32_t *)ddp__calloc((size_t)w, sizeof *codes);
    if (!codes) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory agreeing on the outcome", what);
    r = ddp_all_gather(g, &code, codes, 1, DDP_I32);
    for (i = 0; r == DDP_SUCCESS && i < w && bad < 0; i++)
        if (codes[i] != 0) bad = i;
    if (r != DDP_SUCCESS || bad < 0) {
        ddp__free(codes);
        /* this rank's own failure says more than a collective that broke after it */
        return (r != DDP_SUCCESS && mine != DDP_SUCCESS) ? ddp__failed_here(g, mine, what, own) : r;
    }
    msgs = (char *)ddp__calloc((size_t)w, DDP__ERR_MAX);
    r = msgs ? ddp_all_gather(g, own, msgs, DDP__ERR_MAX, DDP_U8) : DDP_ERR_OUT_OF_MEMORY;
    if (mine != DDP_SUCCESS) r = ddp__failed_here(g, mine, what, own);
    else if (r == DDP_SUCCESS) {
        msgs[(size_t)bad * DDP__ERR_MAX + DDP__ERR_MAX - 1] = '\0';
        r = ddp__fail(g, (ddp_result)codes[bad], "%s failed on rank %d: %s", what, bad, msgs + (size_t)bad * DDP__ERR_MAX);
    } else if (!msgs) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s failed on rank %d (out of memory fetching its message)", what, bad);
    ddp__free(msgs);
    ddp__free(codes);
    return r;
}
