/* [SECTION] shm: shared-memory transport for the ranks of a group that share one host
   When every rank of a group runs on one host (same hostname, boot and network namespace), the ranks
   map one shared segment and the collectives move data through it instead of TCP. The TCP mesh stays
   up beside it: it carries the ABORT frames and shows a dead peer (its sockets close).

   Segment: a header, one control block per rank, then per rank a staging area in two halves.

       | header | ctl 0 | ctl 1 | ... | rank 0: half 0 | half 1 | rank 1: half 0 | half 1 | ...

   Every algorithm is a sequence of steps numbered by the group (g->shm_step), the same on every rank.
   A step: write my part into my half (step % 2), publish `posted = step`, wait until every rank has
   posted step, read what I need. Two halves are enough: a rank starts writing half h for step t only
   after all ranks posted t-1, and each rank posted t-1 only after it had finished reading step t-2,
   the last user of half h. The first step of each collective also compares every rank's fingerprint
   (seq, collective, dtype, op, root, count), so a mismatch fails every rank inside the same call.

   all_reduce, small messages (one-shot): copy in, one step, every rank reduces all n inputs itself.
   all_reduce, large (two-shot, in rounds of at most one half): copy in; each rank reduces its 1/n
   segment over all inputs, in place in its own half; publish `reduced = step`; wait; copy every
   segment out. Memory traffic for N bytes on p ranks: (5p+1)N, against 2pN for the floor.

   Waiting: spin a little (the peer is usually a few hundred nanoseconds away), then yield for up to
   a millisecond (a peer on the same core runs at once), then sleep on a futex in the header; posters wake sleepers only when someone sleeps, so the fast path makes no
   system call. While sleeping a rank wakes every millisecond to check the TCP mesh for a lost or
   aborting peer and its deadline. */
#include "internal.h"

#include <linux/futex.h>

#define DDP__SHM_MAGIC 0x53504444u /* "DDPS" */

typedef struct ddp__shm_header {
    uint32_t magic;
    int32_t world;
    uint64_t half_bytes;
    uint32_t wake;     /* futex word: bumped by every post */
    uint32_t sleepers; /* ranks sleeping on wake */
    uint32_t pad0;
    uint64_t aborted;  /* seq of the collective in which a rank broke the group (0: none); its ABORT frame follows over TCP */
    char pad[24];
} ddp__shm_header;

typedef struct ddp__shm_ctl {
    uint64_t posted;  /* last step whose data this rank has placed */
    uint64_t reduced; /* last step whose reduced segment this rank has placed (two-shot) */
    struct {          /* the fingerprint of this rank's collective, by seq parity */
        uint64_t seq, count;
        int32_t root;
        uint8_t kind, dtype, op, pad;
    } fp[2];
    char pad[64];
} ddp__shm_ctl;

struct ddp__shm {
    void *base;
    size_t bytes;
    ddp__shm_header *hdr;
    ddp__shm_ctl *ctl; /* world entries */
    char *data;        /* world * 2 halves */
    size_t half;       /* bytes of one half */
    uint64_t step;     /* steps taken by this group */
};

#define DDP__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DDP__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static char *ddp__shm_half(const ddp__shm *s, int rank, uint64_t step) {
    return s->data + ((size_t)rank * 2 + (size_t)(step & 1)) * s->half;
}

static void ddp__shm_publish(ddp__shm *s, uint64_t *counter, uint64_t step) {
    DDP__STORE(counter, step);
    __atomic_add_fetch(&s->hdr->wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->hdr->sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &s->hdr->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void ddp__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Compare rank j's fingerprint with ours. A rank already past this collective (newer seq) has
   itself checked ours before finishing, so it is skipped. */
static ddp_result ddp__shm_check_fp(ddp_group *g, const ddp__coll *c, int j) {
    const ddp__shm_ctl *k = &g->shm->ctl[j];
    int par = (int)(c->seq & 1);
    ddp__coll t;
    char ours[160], theirs[160];
    t.seq = DDP__LOAD(&k->fp[par].seq);
    if (t.seq > c->seq) return DDP_SUCCESS;
    t.count = k->fp[par].count;
    t.root = k->fp[par].root;
    t.kind = k->fp[par].kind;
    t.dtype = k->fp[par].dtype;
    t.op = k->fp[par].op;
    if (t.seq == c->seq && t.count == c->count && t.root == c->root && t.kind == c->kind && t.dtype == c->dtype && t.op == c->op)
        return DDP_SUCCESS;
    ddp__coll_describe(c, ours, sizeof ours);
    ddp__coll_describe(&t, theirs, sizeof theirs);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                          "rank must call the same collectives in the same order with the same count, dtype, op and root",
                          j, theirs, g->rank, ours);
}

/* Called by ddp__group_break (transport.c): make every rank's next wait notice at once. */
static void ddp__shm_abort(ddp_group *g) {
    uint64_t seq = g->running_seq ? g->running_seq : 1, zero = 0; /* outside a collective: fail every one */
    if (!g->shm) return;
    __atomic_compare_exchange_n(&g->shm->hdr->aborted, &zero, seq, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&g->shm->hdr->wake, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &g->shm->hdr->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Another rank broke the group in this collective or an earlier one: fail with its reason, which
   arrives as an ABORT frame over TCP. A break in a later collective (the others finished this one and
   moved on) does not fail this one; the next collective sees it. */
static ddp_result ddp__shm_check_abort(ddp_group *g, const ddp__coll *c) {
    double deadline;
    uint64_t at = __atomic_load_n(&g->shm->hdr->aborted, __ATOMIC_ACQUIRE);
    if (!at || at > c->seq) return DDP_SUCCESS;
    for (deadline = ddp__now() + 2.0; ddp__now() < deadline; ddp__sleep(0.001)) {
        ddp_result r = ddp__check_peers(g, c);
        if (r) return r;
    }
    return ddp__coll_fail(g, DDP_ERR_PEER_LOST, "another rank broke the group (its reason did not arrive); see the other ranks' errors");
}

/* Wait until every rank's counter (posted or reduced: `which`) reaches step; on a collective's first
   step also check the fingerprints. */
static ddp_result ddp__shm_wait_all(ddp_group *g, const ddp__coll *c, int which, uint64_t step, int check) {
    ddp__shm *s = g->shm;
    double deadline = 0;
    int j;
    for (j = 0; j < g->world_size; j++) {
        uint64_t *counter = which ? &s->ctl[j].reduced : &s->ctl[j].posted;
        unsigned spins = 0;
        double yield_until = 0;
        while (DDP__LOAD(counter) < step) {
            ddp_result r;
            if ((spins & 255) == 255 && (r = ddp__shm_check_abort(g, c)) != DDP_SUCCESS) return r;
            if (++spins < 256) { /* the peer is usually running on another core: a few hundred ns */
                ddp__cpu_relax();
                continue;
            }
            /* Then yield for up to a millisecond: if the peer shares this core (oversubscribed, or
               the scheduler put both here) it runs at once, which a spinning rank would prevent. */
            if (yield_until == 0) yield_until = ddp__now() + 1e-3;
            if ((spins & 63) != 0 || ddp__now() < yield_until) {
                sched_yield();
                continue;
            }
            { /* sleep until the next post, or 1 ms, then look at the peers and the clock */
                uint32_t w = __atomic_load_n(&s->hdr->wake, __ATOMIC_SEQ_CST);
                struct timespec ts = {0, 1000000};
                __atomic_add_fetch(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
                if (DDP__LOAD(counter) < step) syscall(SYS_futex, &s->hdr->wake, FUTEX_WAIT, w, &ts, NULL, 0);
                __atomic_sub_fetch(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
            }
            if ((r = ddp__check_peers(g, c)) != DDP_SUCCESS) return r;
            if (deadline == 0) deadline = ddp__now() + g->timeout;
            if (ddp__now() > deadline) {
                char desc[160];
                ddp__coll_describe(c, desc, sizeof desc);
                return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s in %s waiting for rank %d (%s), which is "
                                      "alive but not taking part: is it stuck, stopped, or in a different collective? "
                                      "(DDP_TIMEOUT sets the limit)", g->timeout, desc, j, g->peer_names[j]);
            }
        }
        if (check) {
            ddp_result r = ddp__shm_check_fp(g, c, j);
            if (r) return r;
        }
    }
    return ddp__shm_check_abort(g, c); /* a post made before its rank gave up does not count */
}

/* One step: (the caller has written its half) publish, wait for all, check fingerprints if first. */
static ddp_result ddp__shm_step(ddp_group *g, const ddp__coll *c, uint64_t step, int first) {
    ddp__shm *s = g->shm;
    if (first) {
        ddp__shm_ctl *me = &s->ctl[g->rank];
        int par = (int)(c->seq & 1);
        me->fp[par].count = c->count;
        me->fp[par].root = c->root;
        me->fp[par].kind = c->kind;
        me->fp[par].dtype = c->dtype;
        me->fp[par].op = c->op;
        DDP__STORE(&me->fp[par].seq, c->seq);
    }
    ddp__shm_publish(s, &s->ctl[g->rank].posted, step);
    return ddp__shm_wait_all(g, c, 0, step, first);
}

/* ---- the algorithms ---- */

#define DDP__SHM_ONE_SHOT_BYTES ((size_t)64 << 10) /* below this, every rank reduces all inputs itself */

/* all_reduce (root < 0) and reduce (only root copies the result out; the others' buffers stay as
   they were, since only copies of them are reduced). */
static ddp_result ddp__shm_reduce_impl(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                       int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0;
    int n = g->world_size, r = g->rank, first = 1, j, gets = root < 0 || root == r;
    char *out = (char *)buf;
    ddp_result res;
    do {
        size_t m = DDP__MIN(count - done, per), bytes = m * es, off, len;
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step), *dst = out + done * es;
        if (bytes) memcpy(mine, dst, bytes);
        if ((res = ddp__shm_step(g, c, step, first)) != DDP_SUCCESS) return res;
        first = 0;
        if (bytes <= DDP__SHM_ONE_SHOT_BYTES) { /* one-shot: inputs in rank order, the same on every rank */
            if (gets && bytes) {
                memcpy(dst, ddp__shm_half(s, 0, step), bytes);
                for (j = 1; j < n; j++) ddp__reduce(dst, ddp__shm_half(s, j, step), m, t, op);
                if (op == DDP_AVG) ddp__divide(dst, m, t, n);
            }
        } else { /* two-shot: reduce my segment in place, then gather every segment */
            ddp__chunk(m, n, r, &off, &len);
            for (j = 0; j < n; j++)
                if (j != r) ddp__reduce(mine + off * es, ddp__shm_half(s, j, step) + off * es, len, t, op);
            if (op == DDP_AVG) ddp__divide(mine + off * es, len, t, n);
            ddp__shm_publish(s, &s->ctl[r].reduced, step);
            if ((res = ddp__shm_wait_all(g, c, 1, step, 0)) != DDP_SUCCESS) return res;
            for (j = 0; j < n && gets; j++) {
                ddp__chunk(m, n, j, &off, &len);
                memcpy(dst + off * es, ddp__shm_half(s, j, step) + off * es, len * es);
            }
        }
        done += m;
    } while (done < count);
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0;
    int first = 1;
    ddp_result res;
    do {
        size_t m = DDP__MIN(count - done, per);
        uint64_t step = ++s->step;
        char *p = (char *)buf + done * es;
        if (g->rank == root && m) memcpy(ddp__shm_half(s, root, step), p, m * es);
        if ((res = ddp__shm_step(g, c, step, first)) != DDP_SUCCESS) return res;
        first = 0;
        if (g->rank != root && m) memcpy(p, ddp__shm_half(s, root, step), m * es);
        done += m;
    } while (done < count);
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0;
    int first = 1, k;
    ddp_result res;
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        if (m) memcpy(ddp__shm_half(s, g->rank, step), (const char *)send + done * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first)) != DDP_SUCCESS) return res;
        first = 0;
        for (k = 0; k < g->world_size && m; k++) /* memmove: in place, send is this rank's part of recv */
            memmove((char *)recv + ((size_t)k * cpr + done) * es, ddp__shm_half(s, k, step), m * es);
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_reduce_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                          ddp_dtype t, ddp_op op) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j, k;
    size_t es = ddp_dtype_size(t), per = s->half / (es * (size_t)n), done = 0;
    ddp_result res;
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step), *dst = (char *)recv + done * es;
        for (k = 0; k < n && m; k++) memcpy(mine + (size_t)k * m * es, (const char *)send + ((size_t)k * cpr + done) * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first)) != DDP_SUCCESS) return res;
        first = 0;
        if (m) {
            memcpy(dst, ddp__shm_half(s, 0, step) + (size_t)r * m * es, m * es);
            for (j = 1; j < n; j++) ddp__reduce(dst, ddp__shm_half(s, j, step) + (size_t)r * m * es, m, t, op);
            if (op == DDP_AVG) ddp__divide(dst, m, t, n);
        }
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, -1);
    case DDP__REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__BROADCAST: return ddp__shm_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__ALL_GATHER: return ddp__shm_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__shm_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    default: return ddp__shm_step(g, c, ++g->shm->step, 1); /* barrier */
    }
}

/* ---- setting up and tearing down ---- */

/* Ranks share memory only within one host and one network namespace (tests put "hosts" in
   namespaces on one machine; each namespace counts as a host). */
static uint64_t ddp__host_key(void) {
    char buf[512] = "", ns[128] = "";
    FILE *f;
    ssize_t k = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    gethostname(buf, 200);
    buf[200] = '\0';
    snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "|%s|", ns);
    if ((f = fopen("/proc/sys/kernel/random/boot_id", "r")) != NULL) {
        size_t len = strlen(buf);
        if (fgets(buf + len, (int)(sizeof buf - len), f) == NULL) buf[len] = '\0';
        fclose(f);
    }
    return ddp__hash(buf);
}

static void ddp__shm_free(ddp_group *g) {
    if (!g->shm) return;
    munmap(g->shm->base, g->shm->bytes);
    ddp__free(g->shm);
    g->shm = NULL;
}

/* Map one segment for the group when all its ranks share a host (and DDP_TRANSPORT allows it).
   Collective over the group's TCP mesh; every rank reaches the same decision. Any failure to set up
   shared memory (a full /dev/shm, say) is not an error: the group keeps using TCP. */
static ddp_result ddp__shm_setup(ddp_group *g) {
    const char *transport = ddp__env("DDP_TRANSPORT");
    uint64_t key = ddp__host_key(), *keys;
    int i, same = 1, ok = 1, fd = -1;
    char name[64];
    size_t half, bytes;
    ddp__shm *s;
    ddp_result r;
    if (g->world_size < 2 || (transport && strcmp(transport, "tcp") == 0)) return DDP_SUCCESS;
    keys = (uint64_t *)ddp__calloc((size_t)g->world_size, sizeof *keys);
    if (!keys) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory setting up shared memory");
    r = ddp_all_gather(g, &key, keys, 1, DDP_I64);
    for (i = 0; i < g->world_size && r == DDP_SUCCESS; i++) same &= keys[i] == key;
    ddp__free(keys);
    if (r || !same) return r;

    half = DDP__MIN(DDP__MAX(((size_t)8 << 20) / (size_t)g->world_size, (size_t)256 << 10), (size_t)4 << 20);
    half &= ~(size_t)63; /* every half starts on a cache line, so every dtype is aligned */
    bytes = sizeof(ddp__shm_header) + (size_t)g->world_size * (sizeof(ddp__shm_ctl) + 2 * half);
    memset(name, 0, sizeof name);
    if (g->rank == 0) {
        snprintf(name, sizeof name, "/ddp.%d.%llx", (int)getpid(), (unsigned long long)(ddp__hash(g->prefix) ^ (uint64_t)ddp__now()));
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0 || posix_fallocate(fd, 0, (off_t)bytes) != 0) { /* fallocate: a full /dev/shm fails here, not with SIGBUS later */
            ddp__log(g, DDP_LOG_INFO, "shared memory unavailable (%s): using TCP", fd < 0 ? strerror(errno) : "cannot reserve the segment");
            ok = 0;
        }
    }
    if ((r = ddp_broadcast(g, name, sizeof name, DDP_U8, 0)) != DDP_SUCCESS) goto done;
    if (g->rank != 0 && name[0]) fd = shm_open(name, O_RDWR, 0600);
    s = (ddp__shm *)ddp__calloc(1, sizeof *s);
    if (fd >= 0 && ok && s) {
        s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (s->base == MAP_FAILED) s->base = NULL;
    }
    if (!s || !s->base) ok = 0;
    if (fd >= 0) close(fd);
    if ((r = ddp_all_reduce(g, &ok, 1, DDP_I32, DDP_MIN)) != DDP_SUCCESS || !ok) {
        if (s && s->base) munmap(s->base, bytes);
        ddp__free(s);
        goto done;
    }
    s->bytes = bytes;
    s->half = half;
    s->hdr = (ddp__shm_header *)s->base;
    s->ctl = (ddp__shm_ctl *)((char *)s->base + sizeof(ddp__shm_header));
    s->data = (char *)(s->ctl + g->world_size);
    /* Still over TCP: every rank has the segment mapped (so the name can go), and no collective has
       run over it yet. The segment is zero-filled: steps and fingerprints start at 0, below any seq. */
    if ((r = ddp_barrier(g)) != DDP_SUCCESS) {
        munmap(s->base, bytes);
        ddp__free(s);
        goto done;
    }
    g->shm = s;
    ddp__log(g, DDP_LOG_INFO, "shared memory: %zu bytes, %zu-byte halves", bytes, half);
done:
    if (g->rank == 0 && name[0]) shm_unlink(name);
    return r;
}
