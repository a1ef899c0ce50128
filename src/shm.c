/* [SECTION] shm: shared-memory transport for the ranks of a group that share one host
   When every rank of a group runs on one host (same hostname, boot and network namespace), the ranks
   map one shared segment and the collectives move data through it instead of TCP. The TCP mesh stays
   up beside it: it carries the ABORT frames and shows a dead peer (its sockets close).

   Segment: a header, one control block per rank, per rank a staging area in two halves, per rank a
   ring of small slots (see "Running ahead"), then per rank an arena for ddp_alloc (sparse: it takes
   memory only where blocks are allocated).

       | header | ctl 0 | ... | rank 0: half 0 | half 1 | ... | ring 0 | ... | arena 0 | ... | arena n-1 |

   Every algorithm is a sequence of steps numbered by the group (g->shm_step), the same on every rank.
   A step: write my part into my half (step % 2), publish `posted = step`, wait until every rank has
   posted step, read what I need. Two halves are enough: a rank starts writing half h for step t only
   after all ranks posted t-1, and each rank posted t-1 only after it had finished reading step t-2,
   the last user of half h. The first step of each collective also compares every rank's fingerprint
   (seq, collective, dtype, op, root, count), so a mismatch fails every rank inside the same call (but
   see "Running ahead" below for small gathers and scatters). A rank writes its fingerprint after its
   data and before its counter, in an entry of its own for that collective, so a first step waits on
   the fingerprint instead of the counter: one cache line fetched from each peer instead of two.

   all_reduce, small messages (one-shot): copy in, one step, every rank reduces all n inputs itself.
   all_reduce, large (two-shot, in rounds small enough to stay in cache from copy-in to copy-out):
   copy in every segment but my own; reduce my own 1/n segment over all inputs in my own buffer and
   copy it to my half; publish `reduced = step`; wait; copy the other segments out. Memory traffic
   for N bytes on p ranks: (5p-1)N, against 2pN for the floor. reduce (to a root) does the same in
   the halves, since the other ranks' buffers must stay as they were.

   Single-copy (library buffers, above the one-shot size): every rank's first step publishes, with
   its fingerprint, where its buffer is in its arena (or that it is not in one). When all are, no data
   is staged. all_reduce: rank i owns slice i of the buffer; it reduces slice i out of every rank's
   buffer into its own, one L1-sized chunk at a time, and copies each finished chunk straight into
   slice i of every other rank's buffer; a last step keeps every rank in the call until all have
   finished. Every input is read once and every output written once: 2pN traffic, the floor.
   No hazard: slice i of every buffer is read and written by rank i alone, and the program gets its
   buffer back only after the last step. When some ranks' buffers are library buffers and some not,
   the first step carried no data from the former: every rank stages from the next step on (same
   decision everywhere, read from the same published offsets). broadcast needs only the root's buffer
   in its arena; all_gather needs every rank's send buffer there.

   Single-copy on plain memory (all_reduce from DDP__SHM_CMA_MIN_BYTES up): Linux Cross-Memory Attach
   (process_vm_readv/writev, as Open MPI's shared-memory BTL uses) reaches a peer's own address space.
   The first step then publishes every rank's buffer address too, and the same slice-ownership
   algorithm runs: rank i reads slice i of a peer's buffer in L2-sized chunks into a scratch chunk
   (one system call moves a chunk), reduces it into its own buffer and writes the finished chunk into
   every peer's buffer; peers whose buffer is a library buffer are reached through the arena as above.
   Traffic: 2pN plus the scratch chunk, which stays in cache. Availability is probed once at set-up
   (each rank reads a word from every peer and checks its value); seccomp filters (Docker's default
   profile) or Yama ptrace_scope >= 1 refuse it, and then the group stages as before. This library does
   not call prctl(PR_SET_PTRACER) to get around Yama: that would let any process of the same user
   ptrace the program. DDP_SHM_CMA=0 on any rank turns it off for the group. A transfer that fails in
   the middle of a collective (the peer died: ESRCH) fails the collective with DDP_ERR_PEER_LOST.

   Waiting: spin a little (the peer is usually a few hundred nanoseconds away; 256 pauses, or only 16
   when the host has more of the group's ranks than CPUs, where the peer being waited for is likely
   queued behind this very rank), then yield for up to a millisecond (a peer on the same core runs at
   once), then sleep on a futex in the header; posters bump it and wake sleepers only when someone
   sleeps, so the fast path makes no system call and writes no shared line. While sleeping a
   rank wakes every millisecond to check the TCP mesh for a lost or aborting peer and its deadline.

   Running ahead (small gather and scatter, as MPI's eager sends): the ranks that write (a small
   scatter's root, a small gather's other ranks) put their data in a ring of DDP__SHM_AHEAD slots of
   their own, slot seq % DDP__SHM_AHEAD, stamped with the call's fingerprint in the data's first cache
   line (a reader polls that line and finds the data in it), post the step and return without waiting
   for anyone; a small scatter's other ranks wait for the root alone (at 2 ranks, everyone: they owe
   nothing) and copy their block out of its slot; a small gather's root waits for all, as in any step.
   The waits for every rank and the fingerprint checks that a rank skipped are queued and made later:
   all of them before its next collective of another kind writes anything (ddp__shm_settle;
   monitored_barrier excepted), and the oldest whenever it would otherwise reuse a slot that another
   rank may still read (ddp__shm_make_room: every rank must have begun the collective
   after the slot's last one). So a producer runs up to DDP__SHM_AHEAD - 2 calls ahead of its
   consumers, and the halves keep their invariant, as if every rank had waited. Fingerprints are kept
   for 2 x DDP__SHM_AHEAD collectives, so none is rewritten before every rank has made the checks it
   owes on it. A mismatch is still an error on every rank: the first rank to compare the two
   fingerprints fails, the others learn it from the break, at the latest in their next collective of
   another kind (or ddp_destroy's barrier), and a rank that finds it late says so in its message. */
#include "internal.h"

#include <linux/futex.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#if defined(__GLIBC__) && !defined(__USE_GNU) /* <sys/uio.h> read without _GNU_SOURCE (see internal.h) */
extern ssize_t process_vm_readv(pid_t pid, const struct iovec *lvec, unsigned long int liovcnt,
                                const struct iovec *rvec, unsigned long int riovcnt, unsigned long int flags);
extern ssize_t process_vm_writev(pid_t pid, const struct iovec *lvec, unsigned long int liovcnt,
                                 const struct iovec *rvec, unsigned long int riovcnt, unsigned long int flags);
#endif

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

/* Ring slots per rank (a rank runs at most DDP__SHM_AHEAD - 2 calls ahead), and fingerprints per rank:
   twice as many, so that a fingerprint is rewritten only after every rank has made the checks it
   owes on it (a rank that ran ahead makes them at the latest DDP__SHM_AHEAD - 2 calls later). */
#define DDP__SHM_AHEAD 32
#define DDP__SHM_FPS (2 * DDP__SHM_AHEAD)
#define DDP__SHM_SLOT_BYTES ((size_t)2 << 10) /* a ring slot: the data of one small gather or scatter */

typedef struct ddp__shm_stamp { /* which collective a rank called: written before the data it describes is read */
    uint64_t seq, count;           /* seq last, with release: a reader that sees seq sees the rest */
    int32_t root;
    uint8_t kind, dtype, op, pad;
    uint32_t purpose;
} ddp__shm_stamp;

typedef struct ddp__shm_fp { /* the fingerprint of one of this rank's collectives, at seq % DDP__SHM_FPS */
    ddp__shm_stamp id;
    uint64_t lib;  /* arena offset of this rank's buffer, or DDP__SHM_NOT_LIB */
    uint64_t addr; /* its address in this rank's own address space, for CMA (0: not published) */
    uint64_t step; /* the step that published it (broadcast_bytes publishes twice under one seq) */
    char line[8];  /* one cache line each */
} ddp__shm_fp;

/* A ring slot begins with the stamp of the call whose data follows it, in the same cache line, so a
   reader polls the line it then copies from (see "Running ahead"). */
#define DDP__SHM_SLOT_DATA 32 /* where the data starts in a slot */
#define DDP__SHM_SLOT_STRIDE (DDP__SHM_SLOT_BYTES + 64)

typedef struct ddp__shm_ctl {
    uint64_t posted;  /* last step whose data this rank has placed */
    uint64_t reduced; /* last step whose reduced segment this rank has placed (two-shot) */
    char pad[48];
    ddp__shm_fp fp[DDP__SHM_FPS];
} ddp__shm_ctl;


struct ddp__shm {
    void *base;
    size_t bytes;
    ddp__shm_header *hdr;
    ddp__shm_ctl *ctl; /* world entries */
    char *data;        /* world * 2 halves */
    char *ring;        /* world * DDP__SHM_AHEAD slots, see "Running ahead" */
    size_t half;       /* bytes of one half */
    uint64_t step;     /* steps taken by this group */
    ddp__arena arena;  /* ddp_alloc's arenas (alloc.c): base NULL when there are none */
    int cma;     /* every rank can reach every other with process_vm_readv/writev (probed at set-up) */
    unsigned spins; /* pauses before a waiting rank starts to yield its core */
    pid_t *pids; /* world entries: each rank's process id, for CMA (NULL when cma is 0) */
    struct {        /* the steps this rank posted without waiting, oldest first (see "Running ahead") */
        ddp__coll coll[DDP__SHM_AHEAD];
        uint64_t step[DDP__SHM_AHEAD];
        unsigned first, n;
    } owed;
};

#define DDP__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DDP__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static char *ddp__shm_half(const ddp__shm *s, int rank, uint64_t step) {
    return s->data + ((size_t)rank * 2 + (size_t)(step & 1)) * s->half;
}

/* Rank j's fingerprint of collective seq, and its ring slot for it. */
static ddp__shm_fp *ddp__shm_fp_of(const ddp__shm *s, int j, uint64_t seq) { return &s->ctl[j].fp[seq % DDP__SHM_FPS]; }
static ddp__shm_stamp *ddp__shm_slot_stamp(const ddp__shm *s, int j, uint64_t seq) {
    return (ddp__shm_stamp *)(void *)(s->ring + ((size_t)j * DDP__SHM_AHEAD + (size_t)(seq % DDP__SHM_AHEAD)) * DDP__SHM_SLOT_STRIDE);
}
static char *ddp__shm_slot(const ddp__shm *s, int j, uint64_t seq) {
    return (char *)ddp__shm_slot_stamp(s, j, seq) + DDP__SHM_SLOT_DATA;
}

static void ddp__shm_stamp_write(ddp__shm_stamp *k, const ddp__coll *c) {
    k->count = c->count;
    k->root = c->root;
    k->kind = c->kind;
    k->dtype = c->dtype;
    k->op = c->op;
    k->purpose = c->purpose;
    DDP__STORE(&k->seq, c->seq);
}

/* Does stamp k (read after its seq: acquire) describe collective c? */
static int ddp__shm_stamp_is(const ddp__shm_stamp *k, uint64_t seq, const ddp__coll *c) {
    return seq == c->seq && k->count == c->count && k->root == c->root && k->kind == c->kind && k->dtype == c->dtype && k->op == c->op &&
           k->purpose == c->purpose;
}

/* Post: store the counter, then wake sleepers if there are any. The wake word is bumped only then, so
   the fast path writes no shared line but this rank's own. No lost wake-up: in the single order of
   sequentially consistent operations, either this load of sleepers comes after a sleeper's increment
   (and the bump makes its FUTEX_WAIT return), or before it, and then the sleeper's re-check of the
   counter, which follows its increment, sees this store. */
static void ddp__shm_publish(ddp__shm *s, uint64_t *counter, uint64_t step) {
    __atomic_store_n(counter, step, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->hdr->sleepers, __ATOMIC_SEQ_CST)) {
        __atomic_add_fetch(&s->hdr->wake, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &s->hdr->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
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
static ddp_result ddp__shm_check_fp(ddp_group *g, const ddp__coll *c, int j, int late) {
    const ddp__shm_stamp *k = &ddp__shm_fp_of(g->shm, j, c->seq)->id;
    ddp__coll t;
    char ours[160], theirs[160];
    t.seq = DDP__LOAD(&k->seq);
    if (t.seq > c->seq || ddp__shm_stamp_is(k, t.seq, c)) return DDP_SUCCESS;
    t.count = k->count;
    t.root = k->root;
    t.kind = k->kind;
    t.dtype = k->dtype;
    t.op = k->op;
    t.purpose = k->purpose;
    ddp__coll_describe(g, c, ours, sizeof ours);
    ddp__coll_describe(g, &t, theirs, sizeof theirs);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                          "rank must call the same collectives in the same order with the same count, dtype, op and root%s",
                          j, theirs, g->rank, ours, late ? " (found after this rank had run ahead: small gathers and scatters "
                          "return without waiting for every rank)" : "");
}

/* The number of the newest collective that rank j has entered over shared memory (0: none, or no
   segment): a recv waiting for j's message sees from it that j went on to a collective instead. */
static uint64_t ddp__shm_peer_seq(const ddp_group *g, int j) {
    uint64_t newest = 0;
    int i;
    if (!g->shm) return 0;
    for (i = 0; i < DDP__SHM_FPS; i++) newest = DDP__MAX(newest, DDP__LOAD(&g->shm->ctl[j].fp[i].id.seq));
    return newest;
}

/* The backend's abort slot (ddp__group_break, transport.c): make every rank's next wait notice at once. */
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

static uint64_t *ddp__shm_counter(const ddp__shm *s, int j, int which) { return which ? &s->ctl[j].reduced : &s->ctl[j].posted; }

/* Has rank j posted step (which 0) or its reduced segment of step (which 1)? On a collective's first
   step (check 1) the fingerprint says it: a rank writes it after its data and before its counter, and
   it sits in a line of its own for this collective, so a waiter fetches one line, not the counter's and
   then the fingerprint's. Its step tells a second first step under the same seq (broadcast_bytes) from
   the first. The same seq with another collective in it is posted too (a mismatch, found by the check
   that follows). */
static int ddp__shm_posted(const ddp__shm *s, int j, const ddp__coll *c, int which, uint64_t step, int check) {
    if (check == 1) {
        const ddp__shm_fp *k = ddp__shm_fp_of(s, j, c->seq);
        uint64_t seq = DDP__LOAD(&k->id.seq);
        if (seq != c->seq) return seq > c->seq;
        return DDP__LOAD(&k->step) >= step || !ddp__shm_stamp_is(&k->id, seq, c);
    }
    return DDP__LOAD(ddp__shm_counter(s, j, which)) >= step;
}

/* Wait until ranks from..to-1 have posted step (or reduced it: `which`); on a collective's first step
   (check 1) also check their fingerprints; check 2: the same, for a step this rank ran ahead of. */
static ddp_result ddp__shm_wait(ddp_group *g, const ddp__coll *c, int which, uint64_t step, int check, int from, int to) {
    ddp__shm *s = g->shm;
    double deadline = 0;
    int j;
    for (j = from; j < to; j++) {
        unsigned spins = 0;
        double yield_until = 0;
        int lost;
        while (!ddp__shm_posted(s, j, c, which, step, check)) {
            ddp_result r;
            if ((spins & 255) == 255 && (r = ddp__shm_check_abort(g, c)) != DDP_SUCCESS) return r;
            if (++spins < s->spins) { /* the peer is usually running on another core: a few hundred ns */
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
                /* the counter, not the fingerprint: ddp__shm_publish's argument needs the counter's order */
                if (__atomic_load_n(ddp__shm_counter(s, j, which), __ATOMIC_SEQ_CST) < step)
                    syscall(SYS_futex, &s->hdr->wake, FUTEX_WAIT, w, &ts, NULL, 0);
                __atomic_sub_fetch(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
            }
            /* Only the rank waited for, and only if it has still not posted: a rank that posted this
               step and then left (it went on, found an error in a later collective and closed the
               group, or exited) has done its part here. A rank that broke the group in this collective
               says so in the header (ddp__shm_check_abort). It posts before it closes, so reading the
               counter after seeing the hang-up is enough. */
            g->mesh.waiting_for = j;
            if ((lost = ddp__hung_up_peer(g, j)) >= 0 && !ddp__shm_posted(s, j, c, which, step, check))
                return ddp__peer_failed(g, lost, c);
            if (deadline == 0) deadline = ddp__now() + ddp__quiet_limit(g);
            if (ddp__now() > deadline) return ddp__peer_timed_out(g, j, c);
        }
        if (check) {
            ddp_result r = ddp__shm_check_fp(g, c, j, check == 2);
            if (r) return r;
        }
    }
    return ddp__shm_check_abort(g, c); /* a post made before its rank gave up does not count */
}

static ddp_result ddp__shm_wait_all(ddp_group *g, const ddp__coll *c, int which, uint64_t step, int check) {
    return ddp__shm_wait(g, c, which, step, check, 0, g->world_size);
}

/* Wait for rank j's ring slot for collective c (posted as step): poll the slot's stamp, which shares
   its cache line with the data, for as long as a wait spins; when it shows c, the data is there (one
   line fetched instead of the counter's, the fingerprint's and the data's). Anything else (not yet, a
   mismatch, a peer lost or asleep) is left to the ordinary wait and its fingerprint check. */
static ddp_result ddp__shm_wait_slot(ddp_group *g, const ddp__coll *c, uint64_t step, int j) {
    const ddp__shm_stamp *k = ddp__shm_slot_stamp(g->shm, j, c->seq);
    unsigned spins;
    for (spins = 0; spins < g->shm->spins; spins++) {
        uint64_t seq = DDP__LOAD(&k->seq);
        if (seq == c->seq) {
            if (ddp__shm_stamp_is(k, seq, c)) return ddp__shm_check_abort(g, c);
            break;
        }
        ddp__cpu_relax();
    }
    return ddp__shm_wait(g, c, 0, step, 1, j, j + 1);
}

/* One step: (the caller has written its half) publish, wait for all, check fingerprints if first.
   The first step also publishes lib, where this rank's buffer is in its arena (DDP__SHM_NOT_LIB: not).
   A first step for CMA also publishes addr, where the buffer is in this process (0: not published). */
static void ddp__shm_post(ddp_group *g, const ddp__coll *c, uint64_t step, int first, uint64_t lib, uint64_t addr) {
    ddp__shm *s = g->shm;
    if (first) {
        ddp__shm_fp *me = ddp__shm_fp_of(s, g->rank, c->seq);
        me->lib = lib;
        me->addr = addr;
        DDP__STORE(&me->step, step);
        if (DDP__LOAD(&me->id.seq) != c->seq) ddp__shm_stamp_write(&me->id, c); /* else it says c already */
    }
    ddp__shm_publish(s, &s->ctl[g->rank].posted, step);
}

static ddp_result ddp__shm_step_at(ddp_group *g, const ddp__coll *c, uint64_t step, int first, uint64_t lib, uint64_t addr) {
    ddp__shm_post(g, c, step, first, lib, addr);
    return ddp__shm_wait_all(g, c, 0, step, first);
}

/* Make the oldest wait (and checks) that this rank owes for running ahead. A break found here is that
   collective's: ddp__shm_abort publishes its number, which fails at once every rank still inside it. */
static ddp_result ddp__shm_settle_oldest(ddp_group *g) {
    ddp__shm *s = g->shm;
    unsigned i = s->owed.first;
    uint64_t running = g->running_seq;
    ddp_result r;
    s->owed.first = (i + 1) % DDP__SHM_AHEAD;
    s->owed.n--;
    g->running_seq = s->owed.coll[i].seq;
    r = ddp__shm_wait_all(g, &s->owed.coll[i], 0, s->owed.step[i], 2);
    g->running_seq = running;
    return r;
}

/* Make every wait this rank owes: before a collective that is not a run-ahead writes anything. */
static ddp_result ddp__shm_settle(ddp_group *g) {
    ddp_result r = DDP_SUCCESS;
    while (g->shm->owed.n && r == DDP_SUCCESS) r = ddp__shm_settle_oldest(g);
    g->shm->owed.n = 0;
    return r;
}

/* Room to run ahead into collective c: settle the oldest owed steps until every rank has begun
   collective c->seq - DDP__SHM_AHEAD + 1, so it is done with the slot that c reuses. */
static ddp_result ddp__shm_make_room(ddp_group *g, const ddp__coll *c) {
    ddp__shm *s = g->shm;
    while (s->owed.n && s->owed.coll[s->owed.first].seq + DDP__SHM_AHEAD < c->seq + 2) {
        ddp_result r = ddp__shm_settle_oldest(g);
        if (r) return r;
    }
    return DDP_SUCCESS;
}

/* Queue the wait for every rank (and their fingerprint checks) that this rank owes for step. */
static void ddp__shm_owe(ddp_group *g, const ddp__coll *c, uint64_t step) {
    ddp__shm *s = g->shm;
    unsigned i = (s->owed.first + s->owed.n++) % DDP__SHM_AHEAD;
    s->owed.coll[i] = *c;
    s->owed.step[i] = step;
}

static ddp_result ddp__shm_step(ddp_group *g, const ddp__coll *c, uint64_t step, int first, uint64_t lib) {
    return ddp__shm_step_at(g, c, step, first, lib, 0);
}

/* The end of a single-copy collective: nobody returns (giving its program the buffer back) while a
   peer may still be reading from or writing into that buffer. */
static ddp_result ddp__shm_finish(ddp_group *g, const ddp__coll *c) { return ddp__shm_step(g, c, ++g->shm->step, 0, 0); }

/* ---- library buffers: where they are ---- */

/* Rank j's buffer as published in this collective's first step (it stays put until the collective ends). */
static char *ddp__lib_peer(ddp_group *g, const ddp__coll *c, int j) {
    ddp__shm *s = g->shm;
    return s->arena.base + (size_t)j * s->arena.bytes + (size_t)ddp__shm_fp_of(s, j, c->seq)->lib;
}

/* How many ranks published a library buffer in this collective's first step (read after that step,
   when every rank has published; the same answer on every rank). */
static int ddp__lib_count(ddp_group *g, const ddp__coll *c) {
    int j, k = 0;
    for (j = 0; j < g->world_size; j++) k += ddp__shm_fp_of(g->shm, j, c->seq)->lib != DDP__SHM_NOT_LIB;
    return k;
}

/* Say at debug level that a collective runs single-copy (for tests, and for users who wonder). */
static void ddp__lib_note(ddp_group *g, const ddp__coll *c) {
    char desc[160];
    if (g->log_level < DDP_LOG_DEBUG) return;
    ddp__coll_describe(g, c, desc, sizeof desc);
    ddp__log(g, DDP_LOG_DEBUG, "%s: single-copy, straight from the ranks' library buffers", desc);
}

/* ---- the algorithms ---- */

#define DDP__SHM_ONE_SHOT_BYTES ((size_t)64 << 10) /* below this, every rank reduces all inputs itself */
/* Staged two-shot rounds (at most one half): small enough that a round's input, halves and output stay in
   the cores' caches between its copy-in, reduction and copy-out; measured best at 128-256 KiB here. */
#define DDP__SHM_STAGE_ROUND ((size_t)256 << 10)
#define DDP__SHM_DIRECT_CHUNK ((size_t)16 << 10) /* single-copy: reduce then copy out a chunk while it is in L1 */

#define DDP__SHM_CMA_CHUNK ((size_t)64 << 10)  /* CMA: one system call per chunk, the chunk still in L2 */
#define DDP__SHM_CMA_MIN_BYTES ((size_t)1 << 20) /* CMA all_reduce on plain memory from this size up: below it staging was faster (bench/README.md) */
/* all_to_all, gather, scatter: single-copy (arena or CMA) above this many bytes in the whole buffer (n
   blocks); from 64 KiB per rank on 2 ranks it beat staging (bench/README.md) */
#define DDP__SHM_MOVE_DIRECT_BYTES ((size_t)64 << 10)

/* Move bytes between local memory and rank j's address space at remote (write: to it). A failure
   means the peer is gone or unreachable: give its reason (over TCP) a moment to arrive, else fail. */
static ddp_result ddp__cma_move(ddp_group *g, const ddp__coll *c, int j, char *local, uint64_t remote, size_t bytes,
                                int write) {
    pid_t pid = g->shm->pids[j];
    char name[DDP__PEER_NAME_MAX];
    while (bytes) {
        struct iovec l, rm;
        ssize_t k;
        double deadline;
        int e;
        l.iov_base = local;
        l.iov_len = bytes;
        rm.iov_base = (void *)(uintptr_t)remote;
        rm.iov_len = bytes;
        k = write ? process_vm_writev(pid, &l, 1, &rm, 1, 0) : process_vm_readv(pid, &l, 1, &rm, 1, 0);
        if (k > 0) {
            local += k;
            remote += (uint64_t)k;
            bytes -= (size_t)k;
            continue;
        }
        e = k < 0 ? errno : EIO;
        if (e == EINTR) continue;
        for (deadline = ddp__now() + 1.0; ddp__now() < deadline; ddp__sleep(0.001)) { /* a dying peer's sockets close last */
            ddp_result r = ddp__check_peers(g, c);
            if (r) return r;
        }
        return ddp__coll_fail(g, e == ESRCH ? DDP_ERR_PEER_LOST : DDP_ERR_SYSTEM, "process_vm_%s on rank %d (%s) failed: %s%s",
                              write ? "writev" : "readv", j, ddp__peer_name(g, j, name, sizeof name), strerror(e),
                              e == ESRCH ? ": the process is gone" : " (DDP_SHM_CMA=0 stages through shared memory instead)");
    }
    return DDP_SUCCESS;
}

/* Single-copy all_reduce (the first step is done; every rank's buffer is a library buffer, or, with
   cma, any rank's may be plain memory reached by CMA): my slice, reduced chunk by chunk out of every
   buffer into mine, then copied into every peer's buffer. How a peer's slice is reached: through its
   arena when it published a library buffer, else with process_vm_readv/writev through scratch. */
static ddp_result ddp__shm_all_reduce_direct(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t,
                                             ddp_op op, int cma) {
    int n = g->world_size, r = g->rank, j;
    size_t es = ddp_dtype_size(t), per = (cma ? DDP__SHM_CMA_CHUNK : DDP__SHM_DIRECT_CHUNK) / es, off, len, k, m;
    char *mine, *tmp = NULL;
    ddp_result res;
    if (cma) {
        char desc[160];
        if (!(tmp = (char *)ddp__scratch(g, per * es))) return ddp__no_memory(g, per * es);
        if (g->log_level >= DDP_LOG_DEBUG) {
            ddp__coll_describe(g, c, desc, sizeof desc);
            ddp__log(g, DDP_LOG_DEBUG, "%s: cross-memory attach (process_vm_readv/writev) on the ranks' own buffers", desc);
        }
    } else {
        ddp__lib_note(g, c);
    }
    ddp__chunk(count, n, r, &off, &len);
    for (k = 0; k < len; k += m) {
        size_t at = (off + k) * es;
        m = DDP__MIN(len - k, per);
        mine = (char *)buf + at;
        for (j = 0; j < n; j++) {
            if (j == r) continue;
            const ddp__shm_fp *fp = ddp__shm_fp_of(g->shm, j, c->seq);
            if (fp->lib != DDP__SHM_NOT_LIB) {
                ddp__reduce(mine, ddp__lib_peer(g, c, j) + at, m, t, op);
                continue;
            }
            if ((res = ddp__cma_move(g, c, j, tmp, fp->addr + at, m * es, 0)) != DDP_SUCCESS) return res;
            ddp__reduce(mine, tmp, m, t, op);
        }
        if (op == DDP_AVG) ddp__divide(mine, m, t, n);
        for (j = 0; j < n; j++) {
            if (j == r) continue;
            const ddp__shm_fp *fp = ddp__shm_fp_of(g->shm, j, c->seq);
            if (fp->lib != DDP__SHM_NOT_LIB)
                memcpy(ddp__lib_peer(g, c, j) + at, mine, m * es);
            else if ((res = ddp__cma_move(g, c, j, mine, fp->addr + at, m * es, 1)) != DDP_SUCCESS)
                return res;
        }
    }
    return ddp__shm_finish(g, c);
}

/* all_reduce (root < 0) and reduce (only root copies the result out; the others' buffers stay as
   they were, since only copies of them are reduced). */
static ddp_result ddp__shm_reduce_impl(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                       int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = DDP__MIN(s->half, DDP__SHM_STAGE_ROUND) / es, done = 0;
    int n = g->world_size, r = g->rank, first = 1, j, gets = root < 0 || root == r;
    int may_lib = root < 0 && count * es > DDP__SHM_ONE_SHOT_BYTES; /* every rank computes the same */
    int may_cma = may_lib && s->cma && count * es >= DDP__SHM_CMA_MIN_BYTES; /* the same too (cma: agreed at set-up) */
    uint64_t lib = may_lib ? ddp__lib_offset(g, buf, count * es) : DDP__SHM_NOT_LIB;
    char *out = (char *)buf;
    ddp_result res;
    if (lib != DDP__SHM_NOT_LIB || may_cma) { /* a first step without data: where my buffer is */
        if ((res = ddp__shm_step_at(g, c, ++s->step, 1, lib, may_cma ? (uint64_t)(uintptr_t)buf : 0)) != DDP_SUCCESS) return res;
        if (ddp__lib_count(g, c) == n) return ddp__shm_all_reduce_direct(g, c, buf, count, t, op, 0);
        if (may_cma) return ddp__shm_all_reduce_direct(g, c, buf, count, t, op, 1);
        first = 0; /* some rank's buffer is not a library buffer: stage, from the next step */
    }
    for (;;) {
        size_t m = DDP__MIN(count - done, per), bytes = m * es, off, len;
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step), *dst = out + done * es;
        int two_shot = bytes > DDP__SHM_ONE_SHOT_BYTES;
        ddp__chunk(m, n, r, &off, &len);
        if (two_shot && root < 0) { /* nobody reads my own segment's input from my half */
            memcpy(mine, dst, off * es);
            memcpy(mine + (off + len) * es, dst + (off + len) * es, (m - off - len) * es);
        } else if (bytes) {
            memcpy(mine, dst, bytes);
        }
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        if (first && may_lib && ddp__lib_count(g, c) > 0) {
            first = 0; /* the ranks with library buffers posted no data in that step: every rank repeats it */
            continue;
        }
        first = 0;
        if (!two_shot) { /* one-shot: inputs in rank order, the same on every rank */
            if (gets && bytes) {
                memcpy(dst, ddp__shm_half(s, 0, step), bytes);
                for (j = 1; j < n; j++) ddp__reduce(dst, ddp__shm_half(s, j, step), m, t, op);
                if (op == DDP_AVG) ddp__divide(dst, m, t, n);
            }
        } else if (root < 0) { /* two-shot all_reduce: my segment in my buffer, a copy in my half for the others */
            for (j = 0; j < n; j++)
                if (j != r) ddp__reduce(dst + off * es, ddp__shm_half(s, j, step) + off * es, len, t, op);
            if (op == DDP_AVG) ddp__divide(dst + off * es, len, t, n);
            memcpy(mine + off * es, dst + off * es, len * es);
            ddp__shm_publish(s, &s->ctl[r].reduced, step);
            if ((res = ddp__shm_wait_all(g, c, 1, step, 0)) != DDP_SUCCESS) return res;
            for (j = 0; j < n; j++) {
                if (j == r) continue;
                ddp__chunk(m, n, j, &off, &len);
                memcpy(dst + off * es, ddp__shm_half(s, j, step) + off * es, len * es);
            }
        } else { /* two-shot reduce: reduce my segment in place in my half, then the root gathers */
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
        if (done >= count) return DDP_SUCCESS;
    }
}

/* broadcast: staged in rounds of one half, or, when the root's buffer is a library buffer (above the
   one-shot size), copied by every other rank straight out of it. */
static ddp_result ddp__shm_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0;
    int first = 1, may_lib = count * es > DDP__SHM_ONE_SHOT_BYTES;
    uint64_t lib = may_lib && g->rank == root ? ddp__lib_offset(g, buf, count * es) : DDP__SHM_NOT_LIB;
    ddp_result res;
    do {
        size_t m = DDP__MIN(count - done, per);
        uint64_t step = ++s->step;
        char *p = (char *)buf + done * es;
        if (g->rank == root && m && lib == DDP__SHM_NOT_LIB) memcpy(ddp__shm_half(s, root, step), p, m * es);
        if ((res = ddp__shm_step(g, c, step, first, lib)) != DDP_SUCCESS) return res;
        if (first && may_lib && ddp__shm_fp_of(s, root, c->seq)->lib != DDP__SHM_NOT_LIB) {
            ddp__lib_note(g, c);
            if (g->rank != root) memcpy(buf, ddp__lib_peer(g, c, root), count * es);
            return ddp__shm_finish(g, c);
        }
        first = 0;
        if (g->rank != root && m) memcpy(p, ddp__shm_half(s, root, step), m * es);
        done += m;
    } while (done < count);
    return DDP_SUCCESS;
}

/* Single-copy all_gather (every rank's send buffer in its arena; the first step is done). */
static ddp_result ddp__shm_all_gather_direct(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                             ddp_dtype t) {
    size_t bytes = cpr * ddp_dtype_size(t);
    int k;
    ddp__lib_note(g, c);
    for (k = 0; k < g->world_size; k++) {
        char *dst = (char *)recv + (size_t)k * bytes;
        if (k != g->rank) memcpy(dst, ddp__lib_peer(g, c, k), bytes);
        else if (dst != (const char *)send) memcpy(dst, send, bytes); /* they do not overlap (checked) */
    }
    return ddp__shm_finish(g, c);
}

static ddp_result ddp__shm_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0, bytes = cpr * es;
    int first = 1, k, may_lib = bytes > DDP__SHM_ONE_SHOT_BYTES;
    uint64_t lib = may_lib ? ddp__lib_offset(g, send, bytes) : DDP__SHM_NOT_LIB;
    const char *sp = (const char *)send, *rp = (const char *)recv, *mine = rp + (size_t)g->rank * bytes;
    ddp_result res;
    /* peers read send while this rank writes recv: single-copy only if they overlap nowhere but in place */
    if (lib != DDP__SHM_NOT_LIB && sp != mine && sp < rp + (size_t)g->world_size * bytes && rp < sp + bytes)
        lib = DDP__SHM_NOT_LIB;
    if (lib != DDP__SHM_NOT_LIB) {
        if ((res = ddp__shm_step(g, c, ++s->step, 1, lib)) != DDP_SUCCESS) return res;
        if (ddp__lib_count(g, c) == g->world_size) return ddp__shm_all_gather_direct(g, c, send, recv, cpr, t);
        first = 0;
    }
    for (;;) {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        if (m) memcpy(ddp__shm_half(s, g->rank, step), sp + done * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        if (first && may_lib && ddp__lib_count(g, c) > 0) {
            first = 0; /* as in all_reduce: some ranks posted no data; every rank repeats the step */
            continue;
        }
        first = 0;
        for (k = 0; k < g->world_size && m; k++) /* memmove: in place, send is this rank's part of recv */
            memmove((char *)recv + ((size_t)k * cpr + done) * es, ddp__shm_half(s, k, step), m * es);
        done += m;
        if (done >= cpr) return DDP_SUCCESS;
    }
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
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
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

/* ---- all_to_all, gather, scatter ----
   Staged (small messages, or a rank's buffers that cannot be reached): in rounds of one step. all_to_all:
   every rank writes the next m elements of its block for each rank k at k*m in its half (the layout of
   reduce_scatter), one step, then copies slot `rank` out of every rank's half. gather: every rank but
   the root writes its next m elements into its half; the root copies them out. scatter: the root writes
   the next m elements of every rank's block at k*m in its half; each rank copies its slot. A rank's own
   block never goes through the segment.
   Single-copy (above DDP__SHM_MOVE_DIRECT_BYTES, the whole buffer): the first step carries no data but,
   with the fingerprint, where the buffers are: a library buffer's arena offset, or, with cross-memory
   attach, its address. all_to_all: every rank publishes its recv buffer (when it overlaps its send
   buffer nowhere: in place, it publishes nothing) and, when every rank did, writes its block for each
   peer j straight into slot `rank` of j's recv buffer (memcpy into the arena, or one process_vm_writev;
   pushing measured 2-3x faster than pulling with process_vm_readv at 1 MiB per rank on 2 ranks here).
   gather / scatter: the root publishes its recv / send buffer, and every other rank writes / reads its
   own block there, all at once. A last step keeps every rank in the call until all copies are done.
   When a buffer that was needed was not published, every rank stages from the next step on (the same
   decision everywhere, read from the same published fingerprints). */

/* Where rank j published its buffer in this collective's first step is reachable: an arena or CMA. */
static int ddp__shm_reachable(ddp_group *g, const ddp__coll *c, int j) {
    const ddp__shm_fp *k = ddp__shm_fp_of(g->shm, j, c->seq);
    return k->lib != DDP__SHM_NOT_LIB || (g->shm->cma && k->addr != 0);
}

/* Copy bytes between local memory and rank j's published buffer at offset `at` (write: into it). */
static ddp_result ddp__shm_peer_move(ddp_group *g, const ddp__coll *c, int j, char *local, size_t at, size_t bytes, int write) {
    const ddp__shm_fp *k = ddp__shm_fp_of(g->shm, j, c->seq);
    if (!bytes) return DDP_SUCCESS;
    if (k->lib != DDP__SHM_NOT_LIB) {
        char *peer = ddp__lib_peer(g, c, j) + at;
        memcpy(write ? peer : local, write ? local : peer, bytes);
        return DDP_SUCCESS;
    }
    return ddp__cma_move(g, c, j, local, k->addr + at, bytes, write);
}

/* The first step of a single-copy all_to_all/gather/scatter: publish buf (or nothing, when publish is 0). */
static ddp_result ddp__shm_publish_buffer(ddp_group *g, const ddp__coll *c, const void *buf, size_t bytes, int publish) {
    uint64_t lib = publish ? ddp__lib_offset(g, buf, bytes) : DDP__SHM_NOT_LIB;
    uint64_t addr = publish && g->shm->cma && lib == DDP__SHM_NOT_LIB ? (uint64_t)(uintptr_t)buf : 0;
    return ddp__shm_step_at(g, c, ++g->shm->step, 1, lib, addr);
}

/* Say at debug level that an all_to_all/gather/scatter runs single-copy (tests watch for it). */
static void ddp__shm_move_note(ddp_group *g, const ddp__coll *c) {
    char desc[160];
    if (g->log_level < DDP_LOG_DEBUG) return;
    ddp__coll_describe(g, c, desc, sizeof desc);
    ddp__log(g, DDP_LOG_DEBUG, "%s: single-copy, straight between the ranks' buffers (library buffers or cross-memory attach)", desc);
}

/* Do two byte ranges overlap? */
static int ddp__overlap(const void *a, size_t an, const void *b, size_t bn) {
    const char *x = (const char *)a, *y = (const char *)b;
    return an && bn && x < y + bn && y < x + an;
}

static ddp_result ddp__shm_all_to_all(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j, k;
    size_t es = ddp_dtype_size(t), block = cpr * es, per = s->half / (es * (size_t)n), done = 0;
    const char *sp = (const char *)send;
    char *rp = (char *)recv;
    ddp_result res;
    if (block * (size_t)n > DDP__SHM_MOVE_DIRECT_BYTES && (s->cma || s->arena.base)) { /* the same on every rank */
        int apart = !ddp__overlap(send, block * (size_t)n, recv, block * (size_t)n), all = 1;
        if ((res = ddp__shm_publish_buffer(g, c, recv, block * (size_t)n, apart)) != DDP_SUCCESS) return res;
        for (j = 0; j < n; j++) all &= ddp__shm_reachable(g, c, j);
        if (all) {
            ddp__shm_move_note(g, c);
            memcpy(rp + (size_t)r * block, sp + (size_t)r * block, block);
            for (k = 1; k < n; k++) { /* rank r+k first: the ranks do not all write into one peer at once */
                char *mine = (char *)(uintptr_t)sp + (size_t)((r + k) % n) * block; /* only read (a write moves it out) */
                if ((res = ddp__shm_peer_move(g, c, (r + k) % n, mine, (size_t)r * block, block, 1)) != DDP_SUCCESS) return res;
            }
            return ddp__shm_finish(g, c);
        }
        first = 0;
    }
    if (sp != rp) memcpy(rp + (size_t)r * block, sp + (size_t)r * block, block); /* in place: it is there */
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step);
        for (k = 0; k < n && m; k++)
            if (k != r) memcpy(mine + (size_t)k * m * es, sp + ((size_t)k * cpr + done) * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        first = 0;
        for (j = 0; j < n && m; j++) /* in place: block j's rows done..done+m were copied into my half above */
            if (j != r) memcpy(rp + ((size_t)j * cpr + done) * es, ddp__shm_half(s, j, step) + (size_t)r * m * es, m * es);
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

/* Does a gather or scatter of cpr elements of t per rank go through the ring slots ("Running ahead")?
   The same answer on every rank that made the same call. */
static int ddp__shm_rings(const ddp_group *g, size_t cpr, ddp_dtype t, int scatter) {
    return g->world_size > 1 && cpr * ddp_dtype_size(t) * (size_t)(scatter ? g->world_size : 1) <= DDP__SHM_SLOT_BYTES;
}

/* Is call k one that this rank runs ahead of: a small scatter (any rank), or a small gather's other rank? */
static int ddp__shm_runs_ahead(const ddp_group *g, const ddp__call *k) {
    int scatter = k->kind == DDP__SCATTER;
    if (!scatter && k->kind != DDP__GATHER) return 0;
    return ddp__shm_rings(g, k->count, k->dtype, scatter) && (scatter || g->rank != k->root);
}

/* gather (scatter = 0: the root's recv <- every rank's send) and scatter (the root's send -> every rank's recv). */
static ddp_result ddp__shm_rooted(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t,
                                  int root, int scatter) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j;
    size_t es = ddp_dtype_size(t), block = cpr * es, per = s->half / (es * (size_t)(scatter ? n : 1)), done = 0;
    char *big = r == root ? (char *)(scatter ? (void *)(uintptr_t)send : recv) : NULL; /* the root's n blocks */
    char *own = (char *)(scatter ? recv : (void *)(uintptr_t)send);                    /* this rank's block */
    ddp_result res;
    if (block * (size_t)n > DDP__SHM_MOVE_DIRECT_BYTES && (s->cma || s->arena.base)) { /* the same on every rank */
        if ((res = ddp__shm_publish_buffer(g, c, big, block * (size_t)n, r == root)) != DDP_SUCCESS) return res;
        if (ddp__shm_reachable(g, c, root)) {
            ddp__shm_move_note(g, c);
            if (r != root && (res = ddp__shm_peer_move(g, c, root, own, (size_t)r * block, block, !scatter)) != DDP_SUCCESS)
                return res;
            if (r == root && own != big + (size_t)r * block) memcpy(scatter ? own : big + (size_t)r * block,
                                                                    scatter ? big + (size_t)r * block : own, block);
            return ddp__shm_finish(g, c);
        }
        first = 0;
    }
    if (r == root && own != big + (size_t)r * block) /* in place: it is there */
        memcpy(scatter ? own : big + (size_t)r * block, scatter ? big + (size_t)r * block : own, block);
    if (ddp__shm_rings(g, cpr, t, scatter)) { /* small: through the ring slots, see "Running ahead" */
        uint64_t step = ++s->step;
        if (!scatter && r == root) { /* reads every rank's slot: waits for all, as a step does (it owes nothing) */
            ddp__shm_post(g, c, step, 1, DDP__SHM_NOT_LIB, 0);
            for (j = 0; j < n; j++)
                if (j != r && (res = ddp__shm_wait_slot(g, c, step, j)) != DDP_SUCCESS) return res;
            for (j = 0; j < n && block; j++)
                if (j != r) memcpy(big + (size_t)j * block, ddp__shm_slot(s, j, c->seq), block);
            return DDP_SUCCESS;
        }
        if ((res = ddp__shm_make_room(g, c)) != DDP_SUCCESS) return res;
        if (scatter && r == root) {
            for (j = 0; j < n && block; j++)
                if (j != r) memcpy(ddp__shm_slot(s, r, c->seq) + (size_t)j * block, big + (size_t)j * block, block);
        } else if (!scatter && block) {
            memcpy(ddp__shm_slot(s, r, c->seq), own, block);
        }
        ddp__shm_stamp_write(ddp__shm_slot_stamp(s, r, c->seq), c);
        ddp__shm_post(g, c, step, 1, DDP__SHM_NOT_LIB, 0);
        if (scatter && r != root) { /* waits for the root alone; the others are owed */
            if ((res = ddp__shm_wait_slot(g, c, step, root)) != DDP_SUCCESS) return res;
            if (block) memcpy(own, ddp__shm_slot(s, root, c->seq) + (size_t)r * block, block);
            if (n == 2) return DDP_SUCCESS; /* the root is every other rank: nothing is owed */
        }
        ddp__shm_owe(g, c, step);
        return DDP_SUCCESS;
    }
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step);
        if (scatter && r == root)
            for (j = 0; j < n && m; j++)
                if (j != r) memcpy(mine + (size_t)j * m * es, big + ((size_t)j * cpr + done) * es, m * es);
        if (!scatter && r != root && m) memcpy(mine, own + done * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        first = 0;
        if (scatter && r != root && m) memcpy(own + done * es, ddp__shm_half(s, root, step) + (size_t)r * m * es, m * es);
        if (!scatter && r == root)
            for (j = 0; j < n && m; j++)
                if (j != r) memcpy(big + ((size_t)j * cpr + done) * es, ddp__shm_half(s, j, step), m * es);
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

/* ---- all_to_all_v and all_gather_v: blocks whose sizes differ by rank ----
   The first step publishes, at the start of the rank's half, what the others must know of its sizes
   (and its recv buffer for single-copy, as all_to_all does):
     all_to_all_v: send_counts[0..n), then where each sender's block starts in recv (the n + 1 prefix
                   sums of recv_counts), the total sent, the largest block sent, and a flag;
     all_gather_v: this rank's count, a hash of its counts[], and a flag.
   The flag says that the rank's blocks are in that same step too, in the slots after the numbers (a
   rank sends that way when its whole send buffer is at most DDP__SHM_MOVE_DIRECT_BYTES and each block
   fits a slot): when every rank's flag is up, the call is one step, as all_to_all's.
   After the step every rank checks the sizes before it copies anything out. all_gather_v: every rank
   compares each peer's count and hash of counts with its own, so when any two ranks' counts differ,
   every rank finds a difference. all_to_all_v, up to DDP__SHM_V_FULL_CHECK ranks: every rank checks the
   whole matrix (rank i's send_counts[j] against rank j's recv_counts[i]) in the same order, so all fail
   alike; above it, each rank checks its own row and column (what j sends me is what I expect; what j
   expects from me is what I send) and one more step follows, which a rank that failed never posts (it
   breaks the group), so the others fail there. Then, from the same published numbers, the same decision
   on every rank: single-copy when the average rank's share is above DDP__SHM_MOVE_DIRECT_BYTES and every
   rank published a reachable buffer where one is needed; else staged, `per` elements of every block a
   round, as many rounds as the largest block needs. Single-copy all_to_all_v pushes: each rank writes its
   blocks into the receivers' recv buffers (published by every rank that receives from others), as
   all_to_all does. all_gather_v pulls: each rank reads every peer's block out of the peer's send buffer
   (published by every rank with a block), which took 0.72-0.95 of the time of pushing on 2 ranks at 256
   KiB - 4 MiB a rank (bench/README.md; pulling made all_to_all no faster, so it pushes still). */

#define DDP__SHM_V_FULL_CHECK 32 /* ranks up to which all_to_all_v checks the whole matrix of sizes (n^2 reads) */

/* The published numbers take `words`; the slots start at the next cache line. */
static size_t ddp__shm_v_slots_at(size_t words) { return (words * sizeof(uint64_t) + 63) & ~(size_t)63; }

static const uint64_t *ddp__shm_meta(const ddp__shm *s, int rank, uint64_t step) {
    return (const uint64_t *)(const void *)ddp__shm_half(s, rank, step);
}

/* The half holds neither the numbers nor an element of every block (tens of thousands of ranks on one
   host): run over the TCP mesh after one step here, so a rank in a shared-memory collective at this
   number meets the fingerprints in that step (DDP_ERR_MISMATCH), not TCP frames it never reads. */
static ddp_result ddp__shm_v_over_tcp(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp_result r = ddp__shm_step(g, c, ++g->shm->step, 1, DDP__SHM_NOT_LIB);
    return r ? r : ddp__tcp_run(g, k, c);
}

/* Is the average rank's share of `total` elements (all ranks' blocks together) worth moving single-copy? */
static int ddp__shm_v_direct(const ddp_group *g, uint64_t total, size_t es) {
    return (g->shm->cma || g->shm->arena.base) && total * es > (uint64_t)g->world_size * DDP__SHM_MOVE_DIRECT_BYTES;
}

/* all_to_all_v's checks after the first step (see above): the sizes of rank i -> rank j. */
static ddp_result ddp__shm_a2av_check(ddp_group *g, const ddp__coll *c, uint64_t step, int i, int j) {
    const uint64_t *from = ddp__shm_meta(g->shm, i, step), *to = ddp__shm_meta(g->shm, j, step);
    int n = g->world_size;
    uint64_t expected = to[n + i + 1] - to[n + i];
    return from[j] == expected ? DDP_SUCCESS : ddp__sizes_differ(g, c, i, j, from[j], expected);
}

/* all_to_all_v, the round that moves elements done.. of every block: my pieces into the slots of my half
   (pack), or every peer's piece for me out of its half (unpack); a piece is at most per elements. */
static void ddp__a2av_pack(char *slots, const char *sp, const size_t *sc, int n, int r, size_t per, size_t es, size_t done) {
    size_t from = 0;
    int j;
    for (j = 0; j < n; from += sc[j], j++) /* slot j: my next piece of block j */
        if (j != r && sc[j] > done) memcpy(slots + (size_t)j * per * es, sp + (from + done) * es, DDP__MIN(per, sc[j] - done) * es);
}

static void ddp__a2av_unpack(const ddp__shm *s, uint64_t step, size_t base, char *rp, const size_t *rc, int n, int r, size_t per,
                             size_t es, size_t done) {
    size_t at = 0;
    int j;
    for (j = 0; j < n; at += rc[j], j++) /* slot r of j's half: j's next piece for me */
        if (j != r && rc[j] > done)
            memcpy(rp + (at + done) * es, ddp__shm_half(s, j, step) + base + (size_t)r * per * es, DDP__MIN(per, rc[j] - done) * es);
}

static ddp_result ddp__shm_all_to_all_v(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, j, i, all = 1, here = 1, full = n <= DDP__SHM_V_FULL_CHECK;
    size_t es = ddp_dtype_size(k->dtype), words = (size_t)n * 2 + 4, base = ddp__shm_v_slots_at(words), from, mine = 0, at;
    size_t per = s->half > base ? (s->half - base) / (es * (size_t)n) : 0;
    const size_t *sc = k->send_counts, *rc = k->recv_counts;
    const char *sp = (const char *)k->send;
    char *rp = (char *)k->buf, *half;
    uint64_t *meta, total = 0, largest = 0, step, rounds, round;
    ddp_result res;
    if (per == 0) return ddp__shm_v_over_tcp(g, k, c);
    half = ddp__shm_half(s, r, s->step + 1); /* the half of the step published next */
    meta = (uint64_t *)(void *)half;
    for (j = 0, at = 0; j < n; at += rc[j], j++) {
        meta[j] = sc[j];
        meta[n + j] = at;
        total += sc[j];
        largest = DDP__MAX(largest, (uint64_t)sc[j]);
        if (j < r) mine += sc[j];
    }
    meta[2 * n] = at, meta[2 * n + 1] = total, meta[2 * n + 2] = largest;
    meta[2 * n + 3] = total * es <= DDP__SHM_MOVE_DIRECT_BYTES && largest <= per; /* my blocks come in this step */
    if (meta[2 * n + 3]) ddp__a2av_pack(half + base, sp, sc, n, r, per, es, 0);
    if ((res = ddp__shm_publish_buffer(g, c, rp, at * es, s->cma || s->arena.base)) != DDP_SUCCESS) return res;
    step = s->step;
    total = largest = 0;
    /* every peer's numbers and my slot in its half, asked for at once: their misses overlap instead of
       coming one after the other (64 B blocks, 2 ranks: 6-10% less time per call; all_gather_v's block
       is in the line after its numbers, which the core fetches with them, and it gained nothing) */
    for (j = 0; j < n; j++)
        if (j != r) {
            DDP__PREFETCH_READ(ddp__shm_meta(s, j, step));
            DDP__PREFETCH_READ(ddp__shm_half(s, j, step) + base + (size_t)r * per * es);
        }
    for (j = 0; j < n; j++) { /* the sizes, then what every rank decides alike */
        const uint64_t *m = ddp__shm_meta(s, j, step);
        for (i = 0; i < n && full; i++)
            if ((res = ddp__shm_a2av_check(g, c, step, j, i)) != DDP_SUCCESS) return res;
        if (!full && ((res = ddp__shm_a2av_check(g, c, step, j, r)) != DDP_SUCCESS ||
                      (res = ddp__shm_a2av_check(g, c, step, r, j)) != DDP_SUCCESS))
            return res;
        total += m[2 * n + 1];
        largest = DDP__MAX(largest, m[2 * n + 2]);
        here &= m[2 * n + 3] == 1;
        all &= ddp__shm_reachable(g, c, j) || m[2 * n] == m[j]; /* reachable, or it receives from itself alone */
    }
    if (sc[r]) memcpy(rp + meta[n + r] * es, sp + mine * es, sc[r] * es);
    if (here) { /* every block came in the first step: its round 0 */
        ddp__a2av_unpack(s, step, base, rp, rc, n, r, per, es, 0);
        return full ? DDP_SUCCESS : ddp__shm_finish(g, c);
    }
    if (all && ddp__shm_v_direct(g, total, es)) {
        ddp__shm_move_note(g, c);
        for (i = 1, from = mine + sc[r]; i < n; from += sc[j], i++) { /* rank r+1 first, as all_to_all */
            j = (r + i) % n;
            if (j == 0) from = 0;
            res = ddp__shm_peer_move(g, c, j, (char *)(uintptr_t)(sp + from * es), ddp__shm_meta(s, j, step)[n + r] * es,
                                     sc[j] * es, 1);
            if (res) return res;
        }
        return ddp__shm_finish(g, c);
    }
    rounds = (largest + per - 1) / per; /* at least 1: some rank's blocks did not fit */
    for (round = 0; round < rounds; round++) {
        uint64_t st = ++s->step;
        size_t done = (size_t)round * per;
        ddp__a2av_pack(ddp__shm_half(s, r, st) + base, sp, sc, n, r, per, es, done);
        if ((res = ddp__shm_step(g, c, st, 0, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        ddp__a2av_unpack(s, st, base, rp, rc, n, r, per, es, done);
    }
    return DDP_SUCCESS;
}

/* all_gather_v, the round that moves elements done.. of every block: every peer's piece out of its half. */
static void ddp__agv_unpack(const ddp__shm *s, uint64_t step, size_t base, char *rp, const size_t *counts, int n, int r,
                            size_t per, size_t es, size_t done) {
    size_t at = 0;
    int j;
    for (j = 0; j < n; at += counts[j], j++)
        if (j != r && counts[j] > done) memcpy(rp + (at + done) * es, ddp__shm_half(s, j, step) + base, DDP__MIN(per, counts[j] - done) * es);
}

static ddp_result ddp__shm_all_gather_v(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, j, all = 1, here = 1, apart;
    size_t es = ddp_dtype_size(k->dtype), base = ddp__shm_v_slots_at(3), per = (s->half - base) / es, count = k->count;
    size_t mine = 0, total = 0, largest = 0;
    const size_t *counts = k->recv_counts;
    const char *sp = (const char *)k->send;
    char *rp = (char *)k->buf, *half, desc[160];
    uint64_t *meta, hash = ddp__hash_bytes(DDP__FNV_OFFSET, counts, (size_t)n * sizeof *counts), step, rounds, round;
    ddp_result res;
    for (j = 0; j < n; j++) {
        if (j < r) mine += counts[j];
        total += counts[j];
        largest = DDP__MAX(largest, counts[j]);
    }
    /* peers read send while this rank writes recv: publish send only if they overlap nowhere but in place */
    apart = sp == rp + mine * es || !ddp__overlap(sp, count * es, rp, total * es);
    half = ddp__shm_half(s, r, s->step + 1);
    meta = (uint64_t *)(void *)half;
    meta[0] = count, meta[1] = hash, meta[2] = total * es <= DDP__SHM_MOVE_DIRECT_BYTES && largest <= per;
    if (meta[2] && count) memcpy(half + base, sp, count * es); /* my block comes in this step */
    if ((res = ddp__shm_publish_buffer(g, c, sp, count * es, apart && count && (s->cma || s->arena.base))) != DDP_SUCCESS)
        return res;
    step = s->step;
    for (j = 0; j < n; j++) {
        const uint64_t *m = ddp__shm_meta(s, j, step);
        if (m[0] != counts[j]) return ddp__sizes_differ(g, c, j, r, m[0], counts[j]);
        if (m[1] != hash) {
            ddp__coll_describe(g, c, desc, sizeof desc);
            return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank %d's counts are not rank %d's (with the "
                                  "same total); every rank must pass the same counts", desc, j, r);
        }
        here &= m[2] == 1;
        all &= counts[j] == 0 || ddp__shm_reachable(g, c, j); /* its block can be read (every rank decides alike) */
    }
    if (here) { /* every block came in the first step: its round 0 */
        ddp__agv_unpack(s, step, base, rp, counts, n, r, per, es, 0);
    } else if (all && ddp__shm_v_direct(g, (uint64_t)total * (uint64_t)n, es)) {
        size_t at = 0;
        ddp__shm_move_note(g, c);
        if (sp != rp + mine * es && count) memcpy(rp + mine * es, sp, count * es);
        for (j = 0; j < n; at += counts[j], j++) /* pulled: every peer's block out of its send buffer */
            if (j != r && (res = ddp__shm_peer_move(g, c, j, rp + at * es, 0, counts[j] * es, 0)) != DDP_SUCCESS) return res;
        return ddp__shm_finish(g, c);
    } else {
        rounds = (largest + per - 1) / per; /* at least 1: some block did not fit */
        for (round = 0; round < rounds; round++) {
            uint64_t st = ++s->step;
            size_t done = (size_t)round * per;
            if (count > done) memcpy(ddp__shm_half(s, r, st) + base, sp + done * es, DDP__MIN(per, count - done) * es);
            if ((res = ddp__shm_step(g, c, st, 0, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
            ddp__agv_unpack(s, st, base, rp, counts, n, r, per, es, done);
        }
    }
    if (sp != rp + mine * es && count) memmove(rp + mine * es, sp, count * es); /* last: send may lie in recv */
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_call(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp_result r;
    if (k->kind == DDP__MONITORED_BARRIER) /* rank 0 must see who is missing: TCP's deadlines. It writes nothing */
        return ddp__tcp_run(g, k, c);        /* here, so what a rank owes for running ahead waits for the next call */
    if (!ddp__shm_runs_ahead(g, k) && (r = ddp__shm_settle(g)) != DDP_SUCCESS) return r; /* see "Running ahead" */
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, -1);
    case DDP__REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__BROADCAST: return ddp__shm_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__ALL_GATHER: return ddp__shm_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__shm_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    case DDP__BARRIER: return ddp__shm_step(g, c, ++g->shm->step, 1, DDP__SHM_NOT_LIB);
    case DDP__ALL_TO_ALL: return ddp__shm_all_to_all(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__GATHER: return ddp__shm_rooted(g, c, k->send, k->buf, k->count, k->dtype, k->root, 0);
    case DDP__SCATTER: return ddp__shm_rooted(g, c, k->send, k->buf, k->count, k->dtype, k->root, 1);
    case DDP__ALL_TO_ALL_V: return ddp__shm_all_to_all_v(g, k, c);
    case DDP__ALL_GATHER_V: return ddp__shm_all_gather_v(g, k, c);
    default: return ddp__tcp_run(g, k, c);
    }
}

/* ---- setting up and tearing down ---- */

/* The running collective's number is what ddp__shm_abort publishes when this rank breaks the group. */
static ddp_result ddp__shm_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp_result r;
    g->running_seq = c->seq;
    r = ddp__shm_call(g, k, c);
    g->running_seq = 0;
    return r;
}

/* Unmap the segment (its arenas' blocks go with it). */
static void ddp__shm_close(ddp_group *g, int orderly) {
    (void)orderly;
    if (!g->shm) return;
    g->lib.arena = NULL;
    munmap(g->shm->base, g->shm->bytes);
    if (g->shm->arena.fd >= 0) close(g->shm->arena.fd);
    ddp__free(g->shm->arena.blocks);
    ddp__free(g->shm->pids);
    ddp__free(g->shm);
    g->shm = NULL;
}

/* Every rank of the group on this host. Library buffers (ddp_alloc) live in the segment's arenas. */
static const ddp__backend ddp__backend_shm = {
    "shm", "cpu", ddp__shm_run, NULL, NULL, NULL, ddp__shm_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out,
    ddp__host_accumulate,
    ddp__shm_abort, ddp__shm_peer_seq, NULL, NULL};

/* Can this rank read every peer's memory with process_vm_readv? pub holds, per rank, its pid, the
   address of a word in its process and the word's value; each peer's word must read back as published
   (a pid from another pid namespace names another process, or none). */
static int ddp__cma_probe(ddp_group *g, const uint64_t *pub) {
    int j;
    for (j = 0; j < g->world_size; j++) {
        uint64_t got = 0;
        struct iovec l, rm;
        if (j == g->rank) continue;
        l.iov_base = &got;
        l.iov_len = sizeof got;
        rm.iov_base = (void *)(uintptr_t)pub[3 * j + 1];
        rm.iov_len = sizeof got;
        if (process_vm_readv((pid_t)pub[3 * j], &l, 1, &rm, 1, 0) != (ssize_t)sizeof got || got != pub[3 * j + 2]) {
            ddp__log(g, DDP_LOG_DEBUG, "cross-memory attach to rank %d unavailable (%s): all_reduce stages plain memory through "
                     "the segment", j, strerror(errno));
            return 0;
        }
    }
    return 1;
}

/* Rank 0 could not make the segment (errnum from shm_open, or from posix_fallocate on fd): the group
   stays on TCP, which is slower, so say so at the default level, with the numbers and the fixes. */
static void ddp__shm_unavailable(ddp_group *g, int errnum, size_t need, int fd) {
    struct statvfs st;
    char why[DDP__ERR_MAX];
    const char *fix = "or set DDP_TRANSPORT=tcp to use TCP without this warning";
    if (fd >= 0 && fstatvfs(fd, &st) == 0 && (errnum == ENOSPC || errnum == EFBIG)) {
        ddp__log(g, DDP_LOG_WARN, "shared memory unavailable: /dev/shm has %.1f MiB free (of %.1f MiB), and a group of %d "
                 "ranks needs a segment of %.1f MiB; using TCP, which is slower. Make /dev/shm larger (Docker: "
                 "docker run --shm-size=%zum; Kubernetes: an emptyDir with medium Memory on /dev/shm), %s",
                 (double)st.f_bavail * (double)st.f_frsize / 1048576.0, (double)st.f_blocks * (double)st.f_frsize / 1048576.0,
                 g->world_size, (double)need / 1048576.0, (need >> 20) + 64, fix);
        return;
    }
    if (ddp__out_of_descriptors(errnum)) ddp__fail_descriptors(why, errnum, "cannot open the shared-memory segment");
    else snprintf(why, sizeof why, "%s the segment of %.1f MiB in /dev/shm: %s", fd >= 0 ? "cannot reserve" : "cannot create",
                  (double)need / 1048576.0, strerror(errnum));
    ddp__log(g, DDP_LOG_WARN, "shared memory unavailable (%s); using TCP, which is slower; %s", why, fix);
}

/* Map one segment for a group whose ranks all share this host (group.c decides that). Collective over
   the group's TCP mesh; every rank reaches the same decision. Any failure to set up shared memory (a
   full /dev/shm, say) is not an error: the group keeps using TCP; a failure to map the arenas only
   turns library buffers into plain memory. The name is unlinked as soon as every rank has the segment
   mapped, so no exit (a crash included) leaves it behind in /dev/shm. */
static ddp_result ddp__shm_setup(ddp_group *g) {
    int i, ok[3] = {1, 1, 1}, fd = -1; /* ok: the segment, the arenas, cross-memory attach */
    uint64_t word, mine[3], *pub = NULL; /* the CMA probe: my pid, &word, word; every rank's */
    long cma_env = 1;
    char err[DDP__ERR_MAX];
    struct {
        char name[64];
        uint64_t arena_bytes;
    } info;
    size_t half, head, arenas_at, bytes;
    ddp__shm *s;
    ddp_result r;
    half = DDP__MIN(DDP__MAX(((size_t)8 << 20) / (size_t)g->world_size, (size_t)256 << 10), (size_t)4 << 20);
    half &= ~(size_t)63; /* every half starts on a cache line, so every dtype is aligned */
    head = sizeof(ddp__shm_header) + (size_t)g->world_size * (sizeof(ddp__shm_ctl) + 2 * half + DDP__SHM_AHEAD * DDP__SHM_SLOT_STRIDE);
    arenas_at = (head + DDP__ARENA_ALIGN - 1) & ~(DDP__ARENA_ALIGN - 1);
    memset(&info, 0, sizeof info);
    if (g->rank == 0) {
        snprintf(info.name, sizeof info.name, "/ddp.%d.%llx", (int)getpid(), (unsigned long long)(ddp__hash(g->member.prefix) ^ (uint64_t)ddp__now()));
        fd = shm_open(info.name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0 && !g->ft_mode) info.arena_bytes = ddp__arena_size(g, fd); /* FT: a view change maps a new segment */
        /* the arenas are a sparse tail; a file system that refuses the size gets none */
        if (fd >= 0 && info.arena_bytes && ftruncate(fd, (off_t)(arenas_at + (size_t)g->world_size * info.arena_bytes)) != 0)
            info.arena_bytes = 0;
        if (fd < 0) {
            ddp__shm_unavailable(g, errno, head, 0);
            ok[0] = 0;
        } else if ((i = posix_fallocate(fd, 0, (off_t)head)) != 0) { /* a full /dev/shm fails here, not with SIGBUS later */
            ddp__shm_unavailable(g, i, head, fd);
            ok[0] = 0;
        }
    }
    if ((r = ddp__mesh_broadcast(g, &info, sizeof info, DDP_U8, 0)) != DDP_SUCCESS) goto done;
    if (g->rank != 0 && info.name[0]) fd = shm_open(info.name, O_RDWR, 0600);
    s = (ddp__shm *)ddp__calloc(1, sizeof *s);
    bytes = info.arena_bytes ? arenas_at + (size_t)g->world_size * (size_t)info.arena_bytes : head;
    if (fd >= 0 && ok[0] && s) {
        s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (s->base == MAP_FAILED && bytes > head) { /* no address space for the arenas (ulimit -v): without them */
            bytes = head;
            s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        }
        if (s->base == MAP_FAILED) s->base = NULL;
    }
    if (!s || !s->base) ok[0] = 0;
    if (!info.arena_bytes || bytes == head) ok[1] = 0;
    /* Cross-memory attach: publish a word, read every peer's (the all_reduce below keeps every word
       alive until all have read). Every rank takes part even when it will not use it. */
    word = ddp__hash(g->member.prefix) ^ ((uint64_t)getpid() << 20) ^ (uint64_t)(ddp__now() * 1e9);
    mine[0] = (uint64_t)getpid();
    mine[1] = (uint64_t)(uintptr_t)&word;
    mine[2] = word;
    if (ddp__env_int("DDP_SHM_CMA", 0, 1, &cma_env, err) < 0) ddp__log(g, DDP_LOG_WARN, "%s; cross-memory attach stays on", err);
    if (!(pub = (uint64_t *)ddp__calloc((size_t)g->world_size * 3, sizeof *pub))) {
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory setting up shared memory");
    } else if ((r = ddp__mesh_all_gather(g, mine, pub, 3, DDP_I64)) == DDP_SUCCESS) {
        if (s && cma_env && (s->pids = (pid_t *)ddp__calloc((size_t)g->world_size, sizeof *s->pids)) != NULL)
            for (i = 0; i < g->world_size; i++) s->pids[i] = (pid_t)pub[3 * i];
        ok[2] = s && s->pids && ddp__cma_probe(g, pub);
        r = ddp__mesh_all_reduce(g, ok, 3, DDP_I32, DDP_MIN);
    }
    if (s && (r || !ok[2])) {
        ddp__free(s->pids);
        s->pids = NULL;
    }
    if (r || !ok[0]) {
        if (s && s->base) munmap(s->base, bytes);
        if (s) ddp__free(s->pids); /* no segment (a full /dev/shm): the CMA probe may still have filled them */
        ddp__free(s);
        goto done;
    }
    s->cma = ok[2]; /* the same on every rank */
    /* Oversubscribed (more ranks here than CPUs): spinning only delays the rank being waited for. Measured
       on 2 cores (bench/README.md): 4 B all_reduce on 4 ranks 2.0-3.8 us against 3.7-6.0 with 256 pauses;
       2 ranks unchanged. A local policy only: ranks need not agree on it. */
    s->spins = ddp__oversubscribed(g->world_size) ? 16 : 256;
    s->bytes = bytes;
    s->half = half;
    s->hdr = (ddp__shm_header *)s->base;
    s->ctl = (ddp__shm_ctl *)((char *)s->base + sizeof(ddp__shm_header));
    s->data = (char *)(s->ctl + g->world_size);
    s->ring = s->data + (size_t)g->world_size * 2 * half;
    s->arena.fd = -1;
    if (ok[1]) { /* every rank mapped every arena */
        s->arena.base = (char *)s->base + arenas_at;
        s->arena.bytes = (size_t)info.arena_bytes;
        s->arena.file_off = (off_t)arenas_at;
        s->arena.fd = fd;
        fd = -1;
#ifdef MADV_DONTDUMP
        /* a core dump would read the arenas' holes, and reading a hole of shared memory allocates it */
        madvise(s->arena.base, (size_t)g->world_size * s->arena.bytes, MADV_DONTDUMP);
#endif
    }
    /* Still over TCP: every rank has the segment mapped (so the name can go), and no collective has
       run over it yet. The segment is zero-filled: steps and fingerprints start at 0, below any seq. */
    if ((r = ddp__mesh_barrier(g)) != DDP_SUCCESS) {
        munmap(s->base, bytes);
        if (s->arena.fd >= 0) close(s->arena.fd);
        ddp__free(s->pids);
        ddp__free(s);
        goto done;
    }
    g->shm = s;
    if (s->arena.base) g->lib.arena = &s->arena;
    g->backend = g->host_backend = &ddp__backend_shm;
    ddp__log(g, DDP_LOG_INFO, "shared memory: %zu-byte halves, %zu-byte arenas for ddp_alloc, cross-memory attach %s", half,
             s->arena.bytes, s->cma ? "on" : "off");
done:
    ddp__free(pub);
    if (fd >= 0) close(fd);
    if (g->rank == 0 && info.name[0]) shm_unlink(info.name);
    return r;
}

