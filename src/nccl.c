/* [SECTION] nccl: the nccl backend, collectives on device memory through NCCL (built with -DDDP_CUDA)
   (torch.distributed's "nccl" backend, ProcessGroupNCCL)

   A program compiled with -DDDP_CUDA and linked with ddp_cuda.o (nvcc -c ddp_cuda.cu), -lcudart and
   -lnccl can ask for backend "nccl" (ddp_init_desc.backend or DDP_BACKEND=nccl). ddp_init first does
   what the cpu backend does (store, rendezvous, the TCP mesh), then ddp__nccl_attach:
     1. every rank picks its GPU (cudaSetDevice(local_rank)); the ranks agree over the mesh that all
        have one, so a rank without a GPU fails every rank with its reason instead of a hang;
     2. rank 0 makes an ncclUniqueId and puts it in the store under the group's prefix; all get it;
     3. ncclCommInitRank on every rank (subgroups: their own id and communicator, on the same device).

   Dispatch by memory: a collective whose buffers are device memory runs on NCCL, queued on the group's
   stream (ddp_set_stream; NULL = the legacy default stream); one whose buffers are host memory (the
   library's own small agreements: the reducer's model check, ddp_new_group, ...) runs on the cpu path.
   A barrier is a 1-element NCCL all-reduce (torch's barrier on NCCL), so it also waits for the GPUs.
   gather, scatter, all_to_all, all_to_all_v and all_gather_v on device memory move their blocks as
   torch's ProcessGroupNCCL does: grouped ncclSend/ncclRecv (ddp_cuda.cu); monitored_barrier runs over TCP.

   The call check. NCCL trusts its callers: ranks that call different collectives hang or corrupt
   memory. So before each collective the ranks all-gather a small vote (host or device memory) over TCP
   with the call's fingerprint in every frame, as the cpu backend's algorithms do: a rank that
   calls something else (kind, count, dtype, op, root, sequence number) or passes the other kind of
   memory gets DDP_ERR_MISMATCH on every rank. all_to_all_v and all_gather_v first compare their sizes
   per rank over TCP too (ddp__nccl_vote_counts: one more small step), so split sizes or counts that
   differ are DDP_ERR_MISMATCH on every rank, never NCCL work that cannot match. Cost: ceil(log2 world_size) small TCP steps per
   collective (Bruck's all_gather, tcp.c), on the calling thread (tens of microseconds per step within a
   host), paid before the GPU work is queued.

   Completion. A synchronous collective queues its NCCL call, records a CUDA event and waits for it; an
   async one returns a ddp_work holding the event, and ddp_wait waits for it. Waiting is the watchdog
   (ddp__cuda_nccl_wait): it polls the event, ncclCommGetAsyncError, the group's timeout (counted from
   the queueing) and the other ranks' TCP connections; on any failure the communicator is aborted, the
   group breaks (the other ranks hear of it over TCP and abort theirs) and the error names the
   operation and its sequence number. Waiting happens on the calling thread: ddp_wait for nccl work
   must come from the thread that issues the group's collectives. */
#include "internal.h"

#ifdef DDP_CUDA

struct ddp__nccl {
    ddp__cuda_nccl *comm;
    int device;
};

/* Where a rank's buffers of a call are: NONE when it has none to move (gather's non-root without data,
   all_to_all_v's rank whose counts are all 0), which agrees with either side. */
enum { DDP__NCCL_HOST = 0, DDP__NCCL_DEVICE = 1, DDP__NCCL_MIXED = 2, DDP__NCCL_NONE = 3 };

/* Backend "nccl" can be asked for (the message when not: the !DDP_CUDA branch below). */
static ddp_result ddp__nccl_built(char *err) {
    (void)err;
    return DDP_SUCCESS;
}

/* One rank's outcome of an init step, for ddp__nccl_agree. */
typedef struct ddp__nccl_status {
    int32_t code;
    char msg[508];
} ddp__nccl_status;

/* Every rank learns every rank's outcome of a step (over the TCP mesh: g->nccl is not set yet), so
   all fail together with the first failing rank's reason. */
static ddp_result ddp__nccl_agree(ddp_group *g, ddp_result mine, const char *msg, const char *step) {
    ddp__nccl_status me, *all;
    ddp_result r;
    int i;
    memset(&me, 0, sizeof me);
    me.code = (int32_t)mine;
    snprintf(me.msg, sizeof me.msg, "%s", mine ? msg : "");
    if (g->world_size == 1) return mine ? ddp__fail(g, mine, "backend nccl: %s", msg) : DDP_SUCCESS;
    all = (ddp__nccl_status *)ddp__calloc((size_t)g->world_size, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "backend nccl: out of memory");
    if ((r = ddp__mesh_all_gather(g, &me, all, sizeof me, DDP_U8)) != DDP_SUCCESS) {
        ddp__free(all);
        return r;
    }
    for (i = 0; i < g->world_size && r == DDP_SUCCESS; i++) {
        if (all[i].code == DDP_SUCCESS) continue;
        all[i].msg[sizeof all[i].msg - 1] = '\0';
        if (i == g->rank) r = ddp__fail(g, mine, "backend nccl: %s", msg);
        else r = ddp__fail(g, ddp__peer_code(all[i].code, DDP_ERR_INIT), "backend nccl: rank %d could not %s: %s", i, step,
                           all[i].msg);
    }
    ddp__free(all);
    return r;
}

/* Step 2: rank 0's unique id, through the store (a group of one needs no store). */
static ddp_result ddp__nccl_share_id(ddp_group *g, unsigned char *id) {
    char err[DDP__ERR_MAX] = "", key[160];
    size_t size = 0;
    ddp_result r = DDP_SUCCESS;
    if (g->rank == 0) r = ddp__cuda_nccl_unique_id(id, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "make the NCCL unique id")) != DDP_SUCCESS || g->world_size == 1) return r;
    snprintf(key, sizeof key, "%snccl_id", g->member.prefix);
    if (g->rank == 0) r = ddp_store_set(g->member.store, key, id, DDP__CUDA_NCCL_ID_BYTES);
    else r = ddp_store_get(g->member.store, key, id, DDP__CUDA_NCCL_ID_BYTES, &size);
    if (r) snprintf(err, sizeof err, "the NCCL unique id through the store: %.900s", ddp_store_last_error(g->member.store));
    else if (g->rank != 0 && size != DDP__CUDA_NCCL_ID_BYTES)
        r = ddp__fail_to(err, DDP_ERR_FORMAT, "the store's %s holds %zu bytes, not an NCCL unique id (%d bytes)", key, size,
                         DDP__CUDA_NCCL_ID_BYTES);
    return ddp__nccl_agree(g, r, err, "receive the NCCL unique id");
}

static void ddp__nccl_close(ddp_group *g, int orderly) {
    if (g->nccl) { /* (a view's old data plane has none left: ddp__nccl_retire aborted it) */
        ddp__cuda_nccl_destroy(g->nccl->comm, g->broken != DDP_SUCCESS);
        ddp__free(g->nccl);
        g->nccl = NULL;
    }
    if (g->host_backend->close) g->host_backend->close(g, orderly); /* the transport under it */
}

/* Where one buffer is (NONE when it holds no elements), and two buffers of one rank together. */
static int ddp__nccl_where_buf(const void *p, uint64_t elements) {
    if (!elements) return DDP__NCCL_NONE;
    return ddp__cuda_is_device_pointer(p) ? DDP__NCCL_DEVICE : DDP__NCCL_HOST;
}

static int ddp__nccl_both(int a, int b) {
    if (a == DDP__NCCL_NONE) return b;
    if (b == DDP__NCCL_NONE) return a;
    return a == b ? a : DDP__NCCL_MIXED;
}

static uint64_t ddp__nccl_sum(const size_t *counts, int n) {
    uint64_t sum = 0;
    int i;
    for (i = 0; i < n; i++) sum += (uint64_t)counts[i]; /* validated: the sums fit */
    return sum;
}

/* Where a call's buffers are, on this rank. A barrier is always NCCL's; a call of 0 elements of the
   first six kinds always the cpu path's (no memory to look at, and the same choice on every rank);
   monitored_barrier runs over TCP. The other calls count only the buffers this rank moves data in or
   out of (gather's recv and scatter's send on the root alone): NONE when it has none. */
static int ddp__nccl_where(const ddp_group *g, const ddp__call *k) {
    int n = g->world_size, root = g->rank == k->root;
    switch (k->kind) {
    case DDP__BARRIER: return DDP__NCCL_DEVICE;
    case DDP__MONITORED_BARRIER:
    case DDP__BROADCAST_BYTES: return DDP__NCCL_HOST; /* (broadcast_bytes never reaches a backend) */
    case DDP__GATHER:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count), ddp__nccl_where_buf(k->buf, root ? k->count : 0));
    case DDP__SCATTER:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, root ? k->count : 0), ddp__nccl_where_buf(k->buf, k->count));
    case DDP__ALL_TO_ALL:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count), ddp__nccl_where_buf(k->buf, k->count));
    case DDP__ALL_TO_ALL_V:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, ddp__nccl_sum(k->send_counts, n)),
                              ddp__nccl_where_buf(k->buf, ddp__nccl_sum(k->recv_counts, n)));
    case DDP__ALL_GATHER_V:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count),
                              ddp__nccl_where_buf(k->buf, ddp__nccl_sum(k->recv_counts, n)));
    default: break;
    }
    if (k->count == 0) return DDP__NCCL_HOST;
    if (k->kind != DDP__ALL_GATHER && k->kind != DDP__REDUCE_SCATTER) return ddp__nccl_where_buf(k->buf, 1);
    return ddp__nccl_both(ddp__nccl_where_buf(k->buf, 1), ddp__nccl_where_buf(k->send, 1));
}

/* One rank's part of the call check: where its buffers are and, for the _v calls, the first split size
   or count of its own that disagrees with another rank's (at = -1: none). */
typedef struct ddp__nccl_vote {
    uint8_t where;
    uint8_t pad[3];
    int32_t at;     /* all_to_all_v: the sender whose size differs; all_gather_v: the index in counts */
    uint64_t other; /* all_to_all_v: what rank `at` sends this rank; all_gather_v: rank 0's counts[at] */
    uint64_t mine;  /* this rank's recv_counts[at] / counts[at] */
} ddp__nccl_vote;

/* The sizes per rank of the _v calls, which the fingerprint cannot carry (they differ by rank), as the
   TCP backend checks them frame by frame (transport.c) but before any NCCL work is queued: all_to_all_v
   exchanges the send counts (one 8-byte block per pair, pairwise over TCP) and each rank compares what
   every rank will send it with its recv_counts; all_gather_v broadcasts rank 0's counts (a binomial
   tree) and each rank compares its own. Both under the call's fingerprint, so a rank that called
   something else fails there. The finding goes into the vote, which every rank then sees. */
static ddp_result ddp__nccl_vote_counts(ddp_group *g, const ddp__call *k, const ddp__coll *c, ddp__nccl_vote *v) {
    int n = g->world_size, p;
    uint64_t *out, *in;
    ddp__call x;
    ddp_result r;
    v->at = -1;
    if (n == 1 || (k->kind != DDP__ALL_TO_ALL_V && k->kind != DDP__ALL_GATHER_V)) return DDP_SUCCESS;
    if (!(out = (uint64_t *)ddp__calloc(2 * (size_t)n, sizeof *out)))
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory (%d counts)", ddp__coll_name(k->kind), 2 * n);
    in = out + n;
    memset(&x, 0, sizeof x);
    x.dtype = DDP_I64; /* moved, never reduced: the bits of the uint64_t counts */
    x.op = DDP_SUM;
    if (k->kind == DDP__ALL_TO_ALL_V) {
        for (p = 0; p < n; p++) out[p] = (uint64_t)k->send_counts[p];
        x.kind = DDP__ALL_TO_ALL, x.send = out, x.buf = in, x.count = 1, x.root = -1;
    } else {
        for (p = 0; g->rank == 0 && p < n; p++) in[p] = (uint64_t)k->recv_counts[p];
        x.kind = DDP__BROADCAST, x.buf = in, x.count = (size_t)n, x.root = 0;
    }
    if ((r = ddp__tcp_run(g, &x, c)) == DDP_SUCCESS) {
        for (p = 0; p < n && in[p] == (uint64_t)k->recv_counts[p]; p++) {
        }
        if (p < n) v->at = p, v->other = in[p], v->mine = (uint64_t)k->recv_counts[p];
    }
    ddp__free(out);
    return r;
}

/* A _v call's sizes differ: the same message on every rank (the smallest (sender, receiver) pair for
   all_to_all_v, as the mpi backend picks it; the first rank and index for all_gather_v). */
static ddp_result ddp__nccl_counts_differ(ddp_group *g, const ddp__coll *c, const ddp__nccl_vote *all, const char *desc) {
    int n = g->world_size, i, best = -1;
    int64_t key, best_key = INT64_MAX;
    for (i = 0; i < n; i++) {
        if (all[i].at < 0) continue;
        key = c->kind == DDP__ALL_TO_ALL_V ? (int64_t)all[i].at * n + i : (int64_t)i * n + all[i].at;
        if (key < best_key) best_key = key, best = i;
    }
    if (best < 0) return DDP_SUCCESS;
    if (c->kind == DDP__ALL_TO_ALL_V)
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "split sizes differ in %s: rank %d sends %llu elements to rank %d "
                              "(its send_counts[%d]) while rank %d expects %llu from rank %d (its recv_counts[%d]); "
                              "rank i's send_counts[j] must equal rank j's recv_counts[i]", desc, (int)all[best].at,
                              (unsigned long long)all[best].other, best, best, best, (unsigned long long)all[best].mine,
                              (int)all[best].at, (int)all[best].at);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank 0 passes counts[%d] = %llu while rank %d passes "
                          "counts[%d] = %llu; every rank must pass the same counts (rank r's count is counts[r])", desc,
                          (int)all[best].at, (unsigned long long)all[best].other, best, (int)all[best].at,
                          (unsigned long long)all[best].mine);
}

/* The call check (see the top): each rank's vote (where its buffers are; for the _v calls, after
   ddp__nccl_vote_counts, whether its sizes agree) gathered over TCP (Bruck's: ceil(log2 N) steps)
   under the call's fingerprint. Every rank sees every vote, so all decide alike: one rank's buffers
   in both kinds of memory, sizes that differ, or device memory on one rank and host memory on
   another fail every rank; else *where becomes the call's side (NONE votes agree with either; all
   NONE: the host side, which moves nothing and only agrees). */
static ddp_result ddp__nccl_check(ddp_group *g, const ddp__call *k, const ddp__coll *c, int *where) {
    static const char *names[] = {"host", "device", "host and device", "no"};
    char desc[160];
    ddp__nccl_vote me, *all = &me;
    int i, n = g->world_size, ref = -1, bad = -1;
    ddp_result r;
    memset(&me, 0, sizeof me);
    me.where = (uint8_t)*where;
    if ((r = ddp__nccl_vote_counts(g, k, c, &me)) != DDP_SUCCESS) return r;
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (n > 1) {
        if (!(all = (ddp__nccl_vote *)ddp__calloc((size_t)n, sizeof *all)))
            return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", desc);
        all[g->rank] = me;
        if ((r = ddp__do_all_gather(g, c, all + g->rank, all, sizeof me, DDP_U8)) != DDP_SUCCESS) {
            ddp__free(all);
            return r;
        }
    }
    for (i = 0; i < n && bad < 0; i++)
        if (all[i].where > DDP__NCCL_NONE || all[i].where == DDP__NCCL_MIXED) bad = i;
    if (bad >= 0) {
        r = ddp__coll_fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: rank %d passed one buffer in device memory and one in host "
                           "memory; on the nccl backend both are device memory (NCCL) or both host memory", desc, bad);
    } else if ((r = ddp__nccl_counts_differ(g, c, all, desc)) == DDP_SUCCESS) {
        for (i = 0; i < n && bad < 0; i++) {
            if (all[i].where == DDP__NCCL_NONE) continue;
            if (ref < 0) ref = i;
            else if (all[i].where != all[ref].where) bad = i;
        }
        if (bad >= 0)
            r = ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d passed %s memory while rank %d passed %s memory; on the "
                               "nccl backend every rank passes device memory (NCCL) or every rank host memory", desc, bad,
                               names[all[bad].where], ref, names[all[ref].where]);
        *where = ref < 0 ? (int)DDP__NCCL_HOST : (int)all[ref].where;
    }
    if (all != &me) ddp__free(all);
    return r;
}

static ddp__cuda_coll ddp__nccl_kind(int kind) {
    switch (kind) {
    case DDP__ALL_REDUCE: return DDP__CUDA_ALL_REDUCE;
    case DDP__BROADCAST: return DDP__CUDA_BROADCAST;
    case DDP__REDUCE: return DDP__CUDA_REDUCE;
    case DDP__ALL_GATHER: return DDP__CUDA_ALL_GATHER;
    case DDP__REDUCE_SCATTER: return DDP__CUDA_REDUCE_SCATTER;
    case DDP__GATHER: return DDP__CUDA_GATHER;
    case DDP__SCATTER: return DDP__CUDA_SCATTER;
    case DDP__ALL_TO_ALL: return DDP__CUDA_ALL_TO_ALL;
    case DDP__ALL_TO_ALL_V: return DDP__CUDA_ALL_TO_ALL_V;
    case DDP__ALL_GATHER_V: return DDP__CUDA_ALL_GATHER_V;
    default: return DDP__CUDA_BARRIER;
    }
}

/* Queue the NCCL call and its event (after the call check). */
static ddp_result ddp__nccl_enqueue(ddp_group *g, const ddp__call *k, const ddp__coll *c, void **event) {
    char err[DDP__ERR_MAX] = "", desc[160];
    ddp_result r;
    if (k->kind == DDP__ALL_TO_ALL_V || k->kind == DDP__ALL_GATHER_V)
        r = ddp__cuda_nccl_enqueue_v(g->nccl->comm, ddp__nccl_kind(k->kind), k->send, k->send_counts, k->buf, k->recv_counts,
                                     k->dtype, event, err, sizeof err);
    else
        r = ddp__cuda_nccl_enqueue(g->nccl->comm, ddp__nccl_kind(k->kind), k->send, k->buf, k->count, k->dtype, k->op,
                                   k->root, event, err, sizeof err);
    if (r == DDP_SUCCESS) return r;
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__coll_fail(g, r, "%s on rank %d: %s", desc, g->rank, err);
}

/* What the watchdog looks at besides NCCL: the other ranks' connections (a failed rank says why). */
typedef struct ddp__nccl_watching {
    ddp_group *g;
    const ddp__coll *c;
} ddp__nccl_watching;

static ddp_result ddp__nccl_watch(void *user) {
    ddp__nccl_watching *w = (ddp__nccl_watching *)user;
    return ddp__check_peers(w->g, w->c);
}

/* Wait for an event under the watchdog; on failure the group is broken with the message. */
/* Wait for event under the watchdog; desc names the work in messages, c is what the watch checks
   the peers against. */
static ddp_result ddp__nccl_wait_described(ddp_group *g, const ddp__coll *c, const char *desc, void *event) {
    char err[DDP__ERR_MAX] = "";
    ddp__nccl_watching w;
    ddp_result r;
    w.g = g;
    w.c = c;
    r = ddp__cuda_nccl_wait(g->nccl->comm, event, ddp__quiet_limit(g), desc, ddp__nccl_watch, &w, err, sizeof err);
    if (r == DDP_SUCCESS) return r;
    if (g->broken) return g->broken; /* the watch broke the group with the other rank's reason */
    return ddp__coll_fail(g, r, "rank %d: %s", g->rank, err);
}

static ddp_result ddp__nccl_wait_event(ddp_group *g, const ddp__coll *c, void *event) {
    char desc[160];
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__nccl_wait_described(g, c, desc, event);
}

/* Device calls run on NCCL; host calls, once checked, on the transport the group had before NCCL. A
   rank with nothing to move in a device call (all_to_all_v with all its counts 0) queues nothing: the
   others' ncclSend/ncclRecv pairs do not involve it. */
static ddp_result ddp__nccl_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    int mine = ddp__nccl_where(g, k), where = mine;
    void *event = NULL;
    ddp_result r;
    if ((r = ddp__nccl_check(g, k, c, &where)) != DDP_SUCCESS) return r;
    if (where == DDP__NCCL_HOST) return g->host_backend->run(g, k, c);
    if (mine == DDP__NCCL_NONE) return DDP_SUCCESS;
    if ((r = ddp__nccl_enqueue(g, k, c, &event)) != DDP_SUCCESS) return r;
    return ddp__nccl_wait_event(g, c, event);
}

/* The backend's enqueue: a device call is checked and queued on the stream now, on the calling thread
   (so it is ordered after the caller's kernels), and its ddp_work holds the event. Returns 0 for a host
   call, which the progress thread runs as on the cpu backend, and for a rank with nothing to move (its
   check runs there too; the call's side is known only after it). */
static int ddp__nccl_enqueue_async(ddp_group *g, const ddp__call *k, ddp_work **out, ddp_result *res) {
    char msg[DDP__ERR_MAX];
    ddp_work *w;
    ddp_result r;
    int where = ddp__nccl_where(g, k);
    if (where == DDP__NCCL_HOST || where == DDP__NCCL_NONE) return 0; /* the progress thread runs it */
    ddp__drain(g); /* queued host work uses the mesh: let it finish first */
    if (g->broken) {
        *res = ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, k, msg));
        return 1;
    }
    if (!(w = (ddp_work *)ddp__calloc(1, sizeof *w))) {
        *res = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
        return 1;
    }
    w->g = g;
    w->call = *k;
    w->owner = g->backend;
    pthread_mutex_lock(&g->async.mu);
    ddp__fingerprint(g, k, &w->coll, 0);
    pthread_mutex_unlock(&g->async.mu);
    r = ddp__nccl_check(g, k, &w->coll, &where); /* DEVICE (or MIXED) here: an error unless every rank agrees */
    if (r == DDP_SUCCESS) r = ddp__nccl_enqueue(g, k, &w->coll, &w->handle);
    if (r != DDP_SUCCESS) {
        ddp__free(w);
        *res = ddp__fail(g, r, "%s", g->broken_msg);
        return 1;
    }
    *out = w;
    *res = DDP_SUCCESS;
    return 1;
}

/* The backend's wait for the work enqueue took: wait for its event under the watchdog, release w. */
static ddp_result ddp__nccl_wait_work(ddp_work *w) {
    ddp_group *g = w->g;
    ddp_result r;
    if (g->broken) { /* release the event; the communicator is aborted if its work is not done */
        char msg[DDP__ERR_MAX];
        ddp__cuda_nccl_wait(g->nccl->comm, w->handle, 0, "", NULL, NULL, NULL, 0);
        r = ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, &w->call, msg));
    } else if ((r = ddp__nccl_wait_event(g, &w->coll, w->handle)) != DDP_SUCCESS) {
        ddp__fail(g, r, "%s", g->broken_msg);
    }
    ddp__free(w);
    return r;
}

static int ddp__nccl_test_work(ddp_work *w) { return ddp__cuda_nccl_test(w->g->nccl->comm, w->handle); }

DDP_API ddp_result ddp_set_stream(ddp_group *g, void *cuda_stream) {
    ddp_result r = ddp__group_check(g, "ddp_set_stream"); /* NULL: DDP_ERR_INVALID_ARGUMENT; destroyed: DDP_ERR_STATE */
    if (r) return r;
    if (!g->nccl) return ddp__devbuf_set_stream(g, cuda_stream); /* the stream that stages device buffers (devbuf.c) */
    ddp__cuda_nccl_set_stream(g->nccl->comm, cuda_stream);
    return DDP_SUCCESS;
}

/* ---- what the reducer asks of the nccl backend (ddp__backend's memory functions): buckets in
   device memory; the copies are ddp_cuda.cu's bucket kernels on the group's stream. The reducer calls
   them on the thread that issues the group's collectives, whose current device ddp_init set. ---- */

static void ddp__nccl_report(ddp_group *g, ddp_result r, const char *err) {
    if (r) ddp__coll_fail(g, r, "reducer (nccl): %s", err); /* breaks the group: the next collective fails */
}

static void *ddp__nccl_alloc(ddp_group *g, size_t bytes) {
    char err[DDP__ERR_MAX] = "";
    void *p = NULL;
    if (ddp__cuda_nccl_alloc(g->nccl->comm, bytes ? bytes : 1, &p, err, sizeof err) != DDP_SUCCESS)
        ddp__log(g, DDP_LOG_ERROR, "reducer (nccl): %s", err);
    return p;
}

static void ddp__nccl_release(ddp_group *g, void *p) { ddp__cuda_nccl_free(g->nccl->comm, p); }

static void ddp__nccl_zero(ddp_group *g, void *dst, size_t bytes) {
    char err[DDP__ERR_MAX] = "";
    ddp__nccl_report(g, ddp__cuda_nccl_zero(g->nccl->comm, dst, bytes, err, sizeof err), err);
}

/* The bucket kernels' table for one tensor of *numel elements of t at *slot, on g's stream. */
static void ddp__nccl_one_tensor(ddp_group *g, ddp_cuda_grads_args *a, void **slot, const int64_t *numel, ddp_dtype t,
                                 char *err) {
    memset(a, 0, sizeof *a);
    a->count = 1;
    a->grads = slot;
    a->numels = numel;
    a->dtype = t;
    a->stream = ddp__cuda_nccl_stream(g->nccl->comm);
    a->err = err;
    a->err_size = DDP__ERR_MAX;
}

/* dst = src * scale converted, by the bucket kernel: one tensor, dst as a bucket of count elements. */
static void ddp__nccl_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                     size_t count, double scale) {
    char err[DDP__ERR_MAX] = "";
    void *slot = (void *)src;
    int64_t numel = (int64_t)count;
    ddp_cuda_grads_args a;
    ddp__nccl_one_tensor(g, &a, &slot, &numel, src_t, err);
    ddp__nccl_report(g, ddp_cuda_bucket_copy_in(&a, dst, dst_t, numel, NULL, scale), err);
}

/* dst = src converted. Equal dtypes are a plain copy, which also moves the used map between host and
   device memory: then it waits for the copy under the watchdog before the host memory is touched. */
static void ddp__nccl_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    char err[DDP__ERR_MAX] = "";
    ddp_result r;
    if (dst_t == src_t) {
        void *event = NULL;
        ddp__coll c;
        char desc[160];
        size_t bytes = count * ddp_dtype_size(dst_t);
        r = ddp__cuda_nccl_copy(g->nccl->comm, dst, src, bytes, &event, err, sizeof err);
        if (r || !event) {
            ddp__nccl_report(g, r, err);
            return;
        }
        memset(&c, 0, sizeof c); /* the watch only needs the peers' state; no collective is running */
        c.seq = g->seq;
        c.kind = DDP__BARRIER;
        snprintf(desc, sizeof desc, "the reducer's copy of %zu bytes (after collective #%llu)", bytes,
                 (unsigned long long)(g->seq - g->seq_base));
        ddp__nccl_wait_described(g, &c, desc, event);
        return;
    }
    {
        void *slot = dst;
        int64_t numel = (int64_t)count;
        ddp_cuda_grads_args a;
        ddp__nccl_one_tensor(g, &a, &slot, &numel, dst_t, err);
        ddp__nccl_report(g, ddp_cuda_bucket_copy_out(&a, src, src_t, numel, NULL, 1.0), err);
    }
}

/* dst += src (device memory, the same dtype) by the bucket kernel's add, on g's stream. */
static void ddp__nccl_accumulate(ddp_group *g, void *dst, const void *src, ddp_dtype t, size_t count) {
    char err[DDP__ERR_MAX] = "";
    void *slot = dst;
    int64_t numel = (int64_t)count;
    ddp_cuda_grads_args a;
    ddp__nccl_one_tensor(g, &a, &slot, &numel, t, err);
    ddp__nccl_report(g, ddp__cuda_bucket_add(&a, src, t, numel, NULL), err);
}

/* Collectives on device memory through NCCL, on host memory through the group's transport. */
static const ddp__backend ddp__backend_nccl = {
    "nccl", "nccl", ddp__nccl_run, ddp__nccl_enqueue_async, ddp__nccl_wait_work, ddp__nccl_test_work, ddp__nccl_close,
    ddp__nccl_alloc, ddp__nccl_release, ddp__nccl_zero, ddp__nccl_copy_in_scaled, ddp__nccl_copy_out,
    ddp__nccl_accumulate,
    NULL, NULL, NULL, NULL};

/* Give g an NCCL communicator: on the device chosen by local rank for the world group (parent NULL),
   on the parent's device and stream for a subgroup. Collective over g, which must be connected (mesh
   and store) and not have one yet. Then the nccl backend takes g's calls. */
static ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent) {
    char err[DDP__ERR_MAX] = "", key[160];
    unsigned char id[DDP__CUDA_NCCL_ID_BYTES];
    ddp__cuda_nccl *comm = NULL;
    struct ddp__nccl *n;
    ddp_result r = DDP_SUCCESS;
    int device = parent ? parent->device : -1;
    if (!parent) r = ddp__cuda_nccl_device(g->local_rank, &device, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "use a GPU")) != DDP_SUCCESS) return r;
    if ((r = ddp__nccl_share_id(g, id)) != DDP_SUCCESS) return r;
    r = ddp__cuda_nccl_create(id, g->rank, g->world_size, device, g->ft_mode, g->timeout, &comm, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "create its NCCL communicator")) != DDP_SUCCESS) {
        ddp__cuda_nccl_destroy(comm, 1);
        return r;
    }
    if (g->rank == 0 && g->world_size > 1) { /* everyone has read it */
        snprintf(key, sizeof key, "%snccl_id", g->member.prefix);
        ddp_store_delete(g->member.store, key, NULL);
    }
    if (!(n = (struct ddp__nccl *)ddp__calloc(1, sizeof *n))) {
        ddp__cuda_nccl_destroy(comm, 1);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "backend nccl: out of memory");
    }
    n->comm = comm;
    n->device = device;
    if (parent) ddp__cuda_nccl_set_stream(comm, ddp__cuda_nccl_stream(parent->comm));
    g->nccl = n;
    g->backend = &ddp__backend_nccl; /* host_backend stays: host-memory calls keep their transport */
    ddp__log(g, DDP_LOG_INFO, "nccl: rank %d of %d on CUDA device %d", g->rank, g->world_size, device);
    return DDP_SUCCESS;
}

/* ---- fault tolerance (ft.c): the communicator of a new view ----
   A view change builds the new view's data plane as a fresh group v (group.c ddp__group_open_view); before
   the program's handle g adopts it, v gets its communicator, one of two ways, the same on every member
   (they agree over v's mesh first, so none waits in a call the others do not make):
   - shrink: the view only lost members, and every member's NCCL has ncclCommShrink (2.27+) and kept its
     communicator (a fault-tolerant one is revoked, not aborted, on a failure: ddp_cuda.cu): the old one,
     minus the lost ranks, without a unique id or a store round;
   - re-init: otherwise (joiners came, an older NCCL, a communicator aborted): a new unique id through the
     view's store and a non-blocking ncclCommInitRankConfig, as ddp_init's, on the device and stream the
     member had (its local rank in the new view may differ: the device does not).
   lost: the old communicator's ranks that are not in v; grown: v has members the old one did not. The old
   communicator is aborted when g adopts v (ddp__nccl_retire). */
static ddp_result ddp__nccl_renew(ddp_group *g, ddp_group *v, const int *lost, int nlost, int grown) {
    char err[DDP__ERR_MAX] = "";
    ddp__cuda_nccl *comm = NULL;
    struct ddp__nccl *n;
    uint8_t mine, *all;
    int i, shrink;
    ddp_result r = DDP_SUCCESS;
    if (!g->nccl) return DDP_SUCCESS;
    mine = (uint8_t)(!grown && ddp__cuda_nccl_can_shrink(g->nccl->comm));
    shrink = mine;
    if (v->world_size > 1) {
        if (!(all = (uint8_t *)ddp__calloc((size_t)v->world_size, 1))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory");
        r = ddp__mesh_all_gather(v, &mine, all, 1, DDP_U8);
        for (i = 0; i < v->world_size; i++) shrink &= all[i];
        ddp__free(all);
        if (r != DDP_SUCCESS) return ddp__fail(g, r, "nccl: agreeing how to make the new view's communicator: %s", v->error);
    }
    if (!shrink) {
        if ((r = ddp__nccl_attach(v, g->nccl)) != DDP_SUCCESS) return ddp__fail(g, r, "%s", v->error);
        ddp__log(g, DDP_LOG_INFO, "nccl: the new view's communicator made anew (ncclCommInitRankConfig)");
        return DDP_SUCCESS;
    }
    r = ddp__cuda_nccl_shrink(g->nccl->comm, lost, nlost, &comm, err, sizeof err);
    if ((r = ddp__nccl_agree(v, r, err, "shrink the NCCL communicator")) != DDP_SUCCESS) {
        ddp__cuda_nccl_destroy(comm, 1);
        return ddp__fail(g, r, "%s", v->error);
    }
    if (!(n = (struct ddp__nccl *)ddp__calloc(1, sizeof *n))) {
        ddp__cuda_nccl_destroy(comm, 1);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "backend nccl: out of memory");
    }
    n->comm = comm;
    n->device = g->nccl->device;
    v->nccl = n;
    v->backend = &ddp__backend_nccl;
    ddp__log(g, DDP_LOG_INFO, "nccl: the new view's communicator shrunk from the old one (ncclCommShrink, %d lost)", nlost);
    return DDP_SUCCESS;
}

/* After g adopted a view: its old communicator (now v's) is aborted, never destroyed in order: its lost
   members would never answer. */
static void ddp__nccl_retire(ddp_group *v) {
    if (!v->nccl) return;
    ddp__cuda_nccl_destroy(v->nccl->comm, 1);
    ddp__free(v->nccl);
    v->nccl = NULL;
}

/* The stream a group's device copies go on: NCCL's, else the device staging's (NULL: legacy default). */
static void *ddp__group_stream(ddp_group *g) {
    return g->nccl ? ddp__cuda_nccl_stream(g->nccl->comm) : ddp__devbuf_stream(g);
}

#else /* !DDP_CUDA: the backend is not in this build */

struct ddp__nccl {
    int unused;
};

static ddp_result ddp__nccl_built(char *err) {
    return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "backend \"nccl\" is not available in this build: compile the file that "
                        "defines DDP_IMPLEMENTATION with -DDDP_CUDA and link it with ddp_cuda.o (nvcc -c ddp_cuda.cu), "
                        "-lcudart and -lnccl; or use backend \"cpu\" (or NULL for the default)");
}

static ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent) {
    (void)parent;
    return ddp__fail(g, DDP_ERR_STATE, "internal error: an nccl group in a build without DDP_CUDA");
}

static ddp_result ddp__nccl_renew(ddp_group *g, ddp_group *v, const int *lost, int nlost, int grown) {
    (void)g, (void)v, (void)lost, (void)nlost, (void)grown;
    return DDP_SUCCESS; /* no communicator without DDP_CUDA */
}

static void ddp__nccl_retire(ddp_group *v) { (void)v; }

static void *ddp__group_stream(ddp_group *g) {
    (void)g;
    return NULL;
}

DDP_API ddp_result ddp_set_stream(ddp_group *g, void *cuda_stream) {
    ddp_result r = ddp__group_check(g, "ddp_set_stream");
    (void)cuda_stream;
    if (r) return r;
    return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_set_stream: this build has no CUDA (the group's backend is \"%s\"): "
                     "compile the implementation with -DDDP_CUDA and link ddp_cuda.o for device buffers and streams",
                     g->backend->family);
}

#endif /* DDP_CUDA */
