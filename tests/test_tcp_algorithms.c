/* all_reduce over TCP picks its algorithm by size: recursive doubling up to DDP__RD_MAX_BYTES, the ring
   above; broadcast picks the binomial tree on dissemination's frames up to DDP__BROADCAST_TREE_MAX_BYTES,
   the pipelined chain above; all_gather Bruck's up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered, the ring
   above; barrier is dissemination. This test runs both sides of those lines (DDP_TRANSPORT=tcp):
   - results: counts 1, 2, 3, 7, threshold-1, threshold, threshold+1 elements and a large one, every
     dtype x op, worlds 2..8 (3, 5, 6, 7 fold ranks away); each result is compared with a serial
     reference computed here from the stored inputs (exact for integers, MIN and MAX; within a bound
     for float sums and products of random values), and every rank's result bytes are compared with
     every other rank's (all_gather): recursive doubling must give bitwise identical floats everywhere.
   - broadcast: every root, counts on both sides of its threshold and a chain of several slices; every
     rank's buffer must equal the root's bytes (computed here), the root's must stay as it was.
   - all_gather: element sizes 1, 2, 4, 8, per-rank counts 0, 1, 2, 3, 7, on both sides of the
     threshold and large, in place and out of place: every rank's result must be the concatenation of
     every rank's bytes (computed here), bit for bit, and nothing written past it.
   - shape: the frames each rank sends in a barrier and a small broadcast, counted per connection by
     wrapping the library's sendmsg: exactly one to rank + 2^k for each 2^k < n (ceil(log2 n) steps),
     carrying the payload only on the binomial tree's edges (pos -> pos + 2^k for pos < 2^k); and in a
     small all_gather one frame to rank + 2^k with min(2^k, n - 2^k) blocks (Bruck's).
   - barrier semantics: one rank sleeps before entering; no rank may leave before it entered
     (timestamps of the same monotonic clock, gathered).
   - a rank killed (SIGKILL) while the others wait in a barrier, a small broadcast or a small
     all_gather: every survivor
     fails with DDP_ERR_PEER_LOST naming it, within 5 s.
   - mismatches that straddle the algorithms (one rank above the threshold, one rank in a broadcast or
     a barrier, a skipped collective, broadcasts naming different roots, all_gathers of different
     counts on either side of its threshold or meeting a barrier or an all_reduce), worlds 3, 4, 5, 8,
     DDP_TIMEOUT=20: every rank must fail with DDP_ERR_MISMATCH, not DDP_ERR_TIMEOUT (which is what a
     hang would end in).
   - no false alarm: the first calls right after ddp_init (whose own collectives restart the count),
     on one host and on mixed hosts (one rank in its own UTS namespace; skipped without root).
   - no spinning when oversubscribed: a small all_reduce at 2 ranks spins (sched_yield) before poll(),
     at CPUs+1 ranks a wait yields once, then blocks (this program counts its sched_yield calls).
   Usage: test_tcp_algorithms [world sizes...] (default 2 3 4 5 6 7 8 for results); TEST_QUICK=1 skips
   the large count (for sanitizer builds). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sys/socket.h>

/* ddp__exchange sends every frame with sendmsg (and nothing else does): the implementation compiled
   into this test calls counted_sendmsg instead, which adds the bytes sent to each descriptor. */
static ssize_t counted_sendmsg(int fd, const struct msghdr *mh, int flags);
#define sendmsg counted_sendmsg
#include "testlib.h"
#undef sendmsg

#include <sched.h>

#define COUNTED_FDS 4096
static uint64_t bytes_sent_on[COUNTED_FDS];

static ssize_t counted_sendmsg(int fd, const struct msghdr *mh, int flags) {
    ssize_t k = sendmsg(fd, mh, flags);
    if (k > 0 && fd >= 0 && fd < COUNTED_FDS) bytes_sent_on[fd] += (uint64_t)k;
    return k;
}

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
static const ddp_op ops[] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
#define NDT (sizeof dtypes / sizeof dtypes[0])
#define NOPS (sizeof ops / sizeof ops[0])
#define NCOUNTS 8

/* The element counts to try for a dtype of es bytes: small ones, the threshold's neighbours, large. */
static void counts_for(size_t es, size_t *out) {
    size_t t = DDP__RD_MAX_BYTES / es;
    out[0] = 1, out[1] = 2, out[2] = 3, out[3] = 7;
    out[4] = t - 1, out[5] = t, out[6] = t + 1;
    out[7] = 4 * DDP__RD_MAX_BYTES + 1001; /* the ring for every dtype, with a ragged last chunk */
}


/* The value rank r puts at element i: random floats (so that the order of additions shows in the
   low bits), zeros of both signs among them for MIN / MAX, factors near 1 for PROD; small integers
   for the integer types. */
static double value(int r, size_t i, ddp_dtype t, ddp_op op, int salt) {
    uint64_t st = ((uint64_t)i << 20) ^ ((uint64_t)r << 8) ^ (uint64_t)salt, h = tl_rand(&st);
    double u = (double)(h >> 11) / 9007199254740992.0; /* [0, 1) */
    if (!tl_is_float(t)) {
        if (op == DDP_PROD) return t == DDP_U8 ? (double)(h % 2 + 1) : (h % 3 == 0 ? -1.0 : (double)(h % 3));
        return t == DDP_U8 ? (double)(h % 4) : (double)(h % 7) - 3.0;
    }
    if (op == DDP_PROD) return 0.5 + u;
    if ((op == DDP_MIN || op == DDP_MAX) && h % 4 == 0) return (h & 16) ? -0.0 : 0.0;
    return 2.0 * u - 1.0;
}

/* Unit roundoff of a float dtype. */
static double eps_of(ddp_dtype t) {
    switch (t) {
    case DDP_F64: return 1.0 / 9007199254740992.0;
    case DDP_F32: return 1.0 / 16777216.0;
    case DDP_F16: return 1.0 / 2048.0;
    default: return 1.0 / 256.0;
    }
}

/* The reference for element i from every rank's stored input (stored as the dtype, read back with the
   test's own decoders), and how far a correct float result may be from it. */
static double reference(int n, size_t i, ddp_dtype t, ddp_op op, int salt, double *tol) {
    unsigned char cell[8];
    double acc = 0, mag = 0;
    int64_t iacc = 0;
    int r;
    for (r = 0; r < n; r++) {
        double v;
        tl_store_value(cell, 0, t, value(r, i, t, op, salt));
        v = tl_load_value(cell, 0, t);
        mag += fabs(v);
        if (r == 0) {
            acc = v, iacc = (int64_t)v;
            continue;
        }
        switch (op) {
        case DDP_SUM: case DDP_AVG: acc += v, iacc += (int64_t)v; break;
        case DDP_PROD: acc *= v, iacc *= (int64_t)v; break;
        case DDP_MIN: acc = v < acc ? v : acc, iacc = (int64_t)acc; break;
        case DDP_MAX: acc = v > acc ? v : acc, iacc = (int64_t)acc; break;
        default: break;
        }
    }
    *tol = 0;
    if (!tl_is_float(t)) return op == DDP_AVG ? (double)(tl_wrap(iacc, t) / n) : (double)tl_wrap(iacc, t);
    if (op == DDP_SUM || op == DDP_AVG) /* + f16's subnormal spacing, for sums of tiny values */
        *tol = 2.0 * n * mag * eps_of(t) / (op == DDP_AVG ? n : 1) + eps_of(t) * (op == DDP_AVG) + n / 16777216.0;
    if (op == DDP_PROD) *tol = 2.0 * n * fabs(acc) * eps_of(t);
    return op == DDP_AVG ? acc / n : acc;
}


/* One all_reduce: against the reference, then byte for byte against every other rank. */
static void check_one(ddp_group *g, int rank, int n, ddp_dtype t, ddp_op op, size_t count, int salt) {
    size_t es = ddp_dtype_size(t), bytes = count * es, i;
    unsigned char *buf = tl_xalloc(bytes), *all = tl_xalloc(bytes * (size_t)n);
    int r;
    for (i = 0; i < count; i++) tl_store_value(buf, i, t, value(rank, i, t, op, salt));
    CHECK_OK(ddp_all_reduce(g, buf, count, t, op), g);
    for (i = 0; i < count; i++) {
        double tol, want = reference(n, i, t, op, salt, &tol), got = tl_load_value(buf, i, t);
        CHECK(fabs(got - want) <= tol, "rank %d: all_reduce(count=%zu, %s, %s) on %d ranks: element %zu is %.17g, expected "
              "%.17g (+- %.3g)", rank, count, ddp_dtype_name(t), ddp_op_name(op), n, i, got, want, tol);
    }
    CHECK_OK(ddp_all_gather(g, buf, all, bytes, DDP_U8), g);
    for (r = 0; r < n; r++)
        CHECK(memcmp(all + (size_t)r * bytes, buf, bytes) == 0, "rank %d: all_reduce(count=%zu, %s, %s) on %d ranks: rank %d's "
              "result differs from this rank's in its bits", rank, count, ddp_dtype_name(t), ddp_op_name(op), n, r);
    free(buf);
    free(all);
}

static int results_worker(int rank, int n, void *arg) {
    ddp_group *g;
    size_t d, o, k, counts[NCOUNTS];
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (d = 0; d < NDT; d++) {
        counts_for(ddp_dtype_size(dtypes[d]), counts);
        for (o = 0; o < NOPS; o++)
            for (k = 0; k < NCOUNTS; k++) {
                if (k == NCOUNTS - 1 && getenv("TEST_QUICK")) continue; /* sanitizer runs: threshold+1 runs the ring too */
                check_one(g, rank, n, dtypes[d], ops[o], counts[k], (int)(d * 100 + o * 10 + k));
            }
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- broadcast: both algorithms, every root ---- */

#define TREE_MAX DDP__BROADCAST_TREE_MAX_BYTES
#define CHAIN_BYTES (3 * ((size_t)256 << 10) + 5) /* several of the chain's slices, a ragged last one */

static unsigned char pattern(int root, size_t i, int salt) {
    uint64_t st = ((uint64_t)i << 24) ^ ((uint64_t)root << 8) ^ (uint64_t)salt;
    return (unsigned char)tl_rand(&st);
}

/* One broadcast of `count` elements of t from root: every rank must end with the root's bytes. */
static void check_broadcast(ddp_group *g, int rank, int n, ddp_dtype t, size_t count, int root, int salt) {
    size_t bytes = count * ddp_dtype_size(t), i;
    unsigned char *buf = tl_xalloc(bytes + 1);
    for (i = 0; i < bytes; i++) buf[i] = rank == root ? pattern(root, i, salt) : 0xEE;
    CHECK_OK(ddp_broadcast(g, buf, count, t, root), g);
    for (i = 0; i < bytes; i++)
        CHECK(buf[i] == pattern(root, i, salt), "rank %d: broadcast(count=%zu, %s, root=%d) on %d ranks: byte %zu is 0x%02x, "
              "the root's is 0x%02x", rank, count, ddp_dtype_name(t), root, n, i, buf[i], pattern(root, i, salt));
    free(buf);
}

static int broadcast_worker(int rank, int n, void *arg) {
    const size_t u8_counts[] = {0, 1, 4, TREE_MAX - 1, TREE_MAX, TREE_MAX + 1, CHAIN_BYTES};
    ddp_group *g;
    size_t k;
    int root;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (root = 0; root < n; root++) {
        for (k = 0; k < sizeof u8_counts / sizeof u8_counts[0]; k++) {
            if (k == sizeof u8_counts / sizeof u8_counts[0] - 1 && getenv("TEST_QUICK")) continue;
            check_broadcast(g, rank, n, DDP_U8, u8_counts[k], root, (int)k);
        }
        check_broadcast(g, rank, n, DDP_F16, 3, root, 100);
        check_broadcast(g, rank, n, DDP_F64, TREE_MAX / 8, root, 101);     /* the tree's largest */
        check_broadcast(g, rank, n, DDP_F64, TREE_MAX / 8 + 1, root, 102); /* the chain's smallest */
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- all_gather: Bruck's up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered, the ring above ---- */

#define BRUCK_MAX DDP__ALLGATHER_BRUCK_MAX_BYTES

/* One all_gather of cpr elements of t per rank, out of place or in place: every rank must end with the
   concatenation of every rank's bytes (pattern(rank, i, salt), computed here), bit for bit, and an out
   of place send buffer must stay as it was. */
static void check_all_gather(ddp_group *g, int rank, int n, ddp_dtype t, size_t cpr, int in_place, int salt) {
    size_t es = ddp_dtype_size(t), block = cpr * es, i;
    unsigned char *recv = tl_xalloc(block * (size_t)n + 1), *send = in_place ? recv + (size_t)rank * block : tl_xalloc(block + 1);
    int r;
    memset(recv, 0xEE, block * (size_t)n + 1);
    for (i = 0; i < block; i++) send[i] = pattern(rank, i, salt);
    CHECK_OK(ddp_all_gather(g, send, recv, cpr, t), g);
    for (r = 0; r < n; r++)
        for (i = 0; i < block; i++)
            CHECK(recv[(size_t)r * block + i] == pattern(r, i, salt), "rank %d: all_gather(count=%zu, %s, %s) on %d ranks "
                  "(%zu bytes gathered, Bruck's up to %zu): byte %zu of rank %d's block is 0x%02x, expected 0x%02x", rank, cpr,
                  ddp_dtype_name(t), in_place ? "in place" : "out of place", n, block * (size_t)n, (size_t)BRUCK_MAX, i, r,
                  recv[(size_t)r * block + i], pattern(r, i, salt));
    CHECK(recv[block * (size_t)n] == 0xEE, "rank %d: all_gather(count=%zu, %s) on %d ranks wrote past the gathered buffer", rank,
          cpr, ddp_dtype_name(t), n);
    if (!in_place)
        for (i = 0; i < block; i++)
            CHECK(send[i] == pattern(rank, i, salt), "rank %d: all_gather(count=%zu, %s) changed the send buffer", rank, cpr,
                  ddp_dtype_name(t));
    if (!in_place) free(send);
    free(recv);
}

/* every element size (1, 2, 4, 8 bytes); per-rank counts small, on both sides of the threshold (the
   gathered bytes at most BRUCK_MAX, and one element more), and large (the ring, ragged) */
static int all_gather_worker(int rank, int n, void *arg) {
    static const ddp_dtype sizes[] = {DDP_U8, DDP_BF16, DDP_F32, DDP_I64};
    ddp_group *g;
    size_t d, k;
    int in_place;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (d = 0; d < sizeof sizes / sizeof sizes[0]; d++) {
        size_t es = ddp_dtype_size(sizes[d]), t = BRUCK_MAX / es / (size_t)n;
        size_t counts[] = {0, 1, 2, 3, 7, t - 1, t, t + 1, 4 * t + 13};
        for (k = 0; k < sizeof counts / sizeof counts[0]; k++)
            for (in_place = 0; in_place < 2; in_place++) {
                if (k == sizeof counts / sizeof counts[0] - 1 && getenv("TEST_QUICK")) continue;
                check_all_gather(g, rank, n, sizes[d], counts[k], in_place, (int)(d * 100 + k * 2 + (size_t)in_place));
            }
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- shape: which frames each rank sends in a barrier and in a small broadcast ---- */

/* The bytes this rank sent to each peer since the last call (from the counted sendmsg), into out[n]. */
static void take_bytes_sent(ddp_group *g, uint64_t *out) {
    int i;
    for (i = 0; i < g->world_size; i++) {
        int fd = g->mesh.peers[i].fd;
        out[i] = fd >= 0 && fd < COUNTED_FDS ? bytes_sent_on[fd] : 0;
    }
    memset(bytes_sent_on, 0, sizeof bytes_sent_on);
}

/* Dissemination: one frame to rank + 2^k for every 2^k < n, nothing to anyone else; the frame carries
   `payload` bytes when it is a binomial tree edge from root (pos < 2^k, pos + 2^k < n), else none. */
static void check_shape(ddp_group *g, int rank, int n, const char *what, size_t payload, int root) {
    uint64_t got[256], want[256];
    int i, dist, pos = ((rank - root) % n + n) % n;
    take_bytes_sent(g, got);
    memset(want, 0, sizeof want);
    for (dist = 1; dist < n; dist *= 2)
        want[(rank + dist) % n] += sizeof(ddp__frame) + (pos < dist && pos + dist < n ? payload : 0);
    for (i = 0; i < n; i++)
        CHECK(got[i] == want[i], "rank %d of %d: %s sent %llu bytes to rank %d, expected %llu (one %zu-byte frame header to "
              "each rank + 2^k, payload %zu on the tree's edges)", rank, n, what, (unsigned long long)got[i], i,
              (unsigned long long)want[i], sizeof(ddp__frame), payload);
}

/* Bruck's all_gather: one frame to rank + 2^k for every 2^k < n (ceil(log2 n) steps; the ring sent n-1
   frames to rank + 1), carrying min(2^k, n - 2^k) blocks of `block` bytes; nothing to anyone else. */
static void check_bruck_shape(ddp_group *g, int rank, int n, size_t block) {
    uint64_t got[256], want[256];
    int i, dist;
    take_bytes_sent(g, got);
    memset(want, 0, sizeof want);
    for (dist = 1; dist < n; dist *= 2) want[(rank + dist) % n] += sizeof(ddp__frame) + (size_t)(dist < n - dist ? dist : n - dist) * block;
    for (i = 0; i < n; i++)
        CHECK(got[i] == want[i], "rank %d of %d: all_gather(count=%zu, u8) sent %llu bytes to rank %d, expected %llu (Bruck's: one "
              "frame to each rank + 2^k with min(2^k, n - 2^k) blocks)", rank, n, block, (unsigned long long)got[i], i,
              (unsigned long long)want[i]);
}

static int shape_worker(int rank, int n, void *arg) {
    unsigned char buf[4] = {1, 2, 3, 4}, gathered[3 * 256];
    ddp_group *g;
    uint64_t discard[256];
    int root, round;
    char what[64];
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_barrier(g), g); /* a slow rank's frames of ddp_init are all sent */
    for (round = 0; round < 3; round++) {
        take_bytes_sent(g, discard);
        CHECK_OK(ddp_barrier(g), g);
        check_shape(g, rank, n, "barrier()", 0, 0);
        for (root = 0; root < n; root++) {
            snprintf(what, sizeof what, "broadcast(count=4, u8, root=%d)", root);
            CHECK_OK(ddp_broadcast(g, buf, 4, DDP_U8, root), g);
            check_shape(g, rank, n, what, 4, root);
        }
        CHECK_OK(ddp_all_gather(g, buf + 1, gathered, 3, DDP_U8), g);
        check_bruck_shape(g, rank, n, 3);
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- barrier semantics: nobody leaves before the last rank entered ---- */

#define SLEEP_S 0.1

static int barrier_order_worker(int rank, int n, void *arg) {
    ddp_group *g;
    double times[2], *all = (double *)tl_xalloc(sizeof(double) * 2 * (size_t)n);
    int sleeper, i, j;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (sleeper = 0; sleeper < n; sleeper++) {
        CHECK_OK(ddp_barrier(g), g);
        if (rank == sleeper) usleep((useconds_t)(SLEEP_S * 1e6));
        times[0] = tl_now(); /* entered (at most this early) */
        CHECK_OK(ddp_barrier(g), g);
        times[1] = tl_now(); /* left (at least this late) */
        CHECK_OK(ddp_all_gather(g, times, all, 2, DDP_F64), g);
        for (i = 0; i < n; i++)
            for (j = 0; j < n; j++)
                CHECK(all[2 * j + 1] >= all[2 * i], "%d ranks, rank %d slept %.1f s before the barrier: rank %d left it %.3f s "
                      "before rank %d entered it", n, sleeper, SLEEP_S, j, all[2 * i] - all[2 * j + 1], i);
        CHECK(all[2 * rank + 1] - all[2 * sleeper] < 10.0, "rank %d left the barrier %.1f s after rank %d entered", rank,
              all[2 * rank + 1] - all[2 * sleeper], sleeper);
    }
    free(all);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- a rank killed while the others wait ---- */

typedef struct victim {
    int rank; /* the one that dies */
    int wait; /* what the others wait in: 0 a barrier, 1 a small broadcast, 2 a small all_gather */
} victim;

static const char *const victim_waits[] = {"barrier", "broadcast", "all_gather"};

static int killed_worker(int rank, int n, void *arg) {
    const victim *v = (const victim *)arg;
    ddp_group *g;
    unsigned char b[8 * 256] = {0};
    char name[32];
    double t0;
    ddp_result r;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_barrier(g), g);
    if (rank == v->rank) {
        usleep(200000); /* the others are waiting by now */
        kill(getpid(), SIGKILL);
    }
    t0 = tl_now();
    r = v->wait == 1 ? ddp_broadcast(g, b, 8, DDP_U8, (v->rank + 1) % n)
        : v->wait == 2 ? ddp_all_gather(g, b + 8 * rank, b, 8, DDP_U8) : ddp_barrier(g);
    snprintf(name, sizeof name, "rank %d", v->rank);
    CHECK(r == DDP_ERR_PEER_LOST, "rank %d of %d: %s with rank %d killed returned %s (%s), expected DDP_ERR_PEER_LOST", rank, n,
          victim_waits[v->wait], v->rank, ddp_result_string(r), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), name) != NULL, "rank %d: the error does not name %s: %s", rank, name, ddp_last_error(g));
    CHECK(tl_now() - t0 < 5.0, "rank %d: it took %.1f s to see rank %d killed (at most 5 s)", rank, tl_now() - t0, v->rank);
    if (rank == 0) printf("  rank 0 failed %.2f s after it entered (rank %d slept 0.2 s, then died)\n", tl_now() - t0, v->rank);
    ddp_destroy(g);
    return 0;
}

static int run_killed(void) {
    static const int worlds[] = {5, 8};
    int failed = 0, w, b;
    for (w = 0; w < 2; w++)
        for (b = 0; b < 3; b++) {
            victim v;
            int codes[256], rc, i;
            v.rank = worlds[w] - 2, v.wait = b;
            tl_run_ranks_status(worlds[w], killed_worker, &v, 60, codes);
            for (rc = 0, i = 0; i < worlds[w]; i++) rc |= i == v.rank ? codes[i] != -SIGKILL : codes[i] != 0;
            printf("rank %d of %d killed while the others wait in a %s: %s\n", v.rank, worlds[w], victim_waits[b],
                   rc ? "FAILED" : "ok");
            fflush(stdout);
            failed |= rc;
        }
    return failed;
}

/* ---- mismatches across the two algorithms ---- */

#define SMALL 16                          /* f32 elements: recursive doubling */
#define LARGE (2 * DDP__RD_MAX_BYTES / 4) /* f32 elements: the ring */
#define LARGE_BROADCAST (DDP__BROADCAST_TREE_MAX_BYTES / 4 + 1) /* f32 elements: the chain */
static float mismatch_buf[LARGE > LARGE_BROADCAST ? LARGE : LARGE_BROADCAST];

static ddp_result small_all_reduce(ddp_group *g) { return ddp_all_reduce(g, mismatch_buf, SMALL, DDP_F32, DDP_SUM); }
static ddp_result large_all_reduce(ddp_group *g) { return ddp_all_reduce(g, mismatch_buf, LARGE, DDP_F32, DDP_SUM); }

/* the last rank's count is above the threshold (the ring), the others' below (recursive doubling) */
static ddp_result count_straddles(ddp_group *g, int rank, int n) {
    return rank == n - 1 ? large_all_reduce(g) : small_all_reduce(g);
}

/* the lower half of the ranks above the threshold, the upper half below: on 4 ranks 0 and 1 run the
   ring (0 -> 1 -> 2) while 2 and 3 exchange, then 2 sends to 0 and 3 to 1; 0 waits on 3, 3 on 1, 1 on
   0, and the mismatched frames sit in connections nobody reads from */
static ddp_result half_straddles(ddp_group *g, int rank, int n) {
    return rank < n / 2 ? large_all_reduce(g) : small_all_reduce(g);
}

/* rank 1 broadcasts (as the root: it sends first) while the others all_reduce a few elements */
static ddp_result broadcast_as_root(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 1 ? ddp_broadcast(g, mismatch_buf, SMALL, DDP_F32, 1) : small_all_reduce(g);
}

/* the last rank waits in a broadcast from rank 0 (it sends nothing) while the others all_reduce */
static ddp_result broadcast_waiting(ddp_group *g, int rank, int n) {
    return rank == n - 1 ? ddp_broadcast(g, mismatch_buf, SMALL, DDP_F32, 0) : small_all_reduce(g);
}

/* rank 1 all_reduces while the others wait in a broadcast from rank 1: only rank 1 can send first. On
   3 and 5 ranks recursive doubling folds rank 1 into rank 0, so this needs the fold's answer
   (2i+1 -> 2i) to go out at once, or nobody would send anything and every rank would time out. */
static ddp_result broadcast_from_reducer(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 1 ? small_all_reduce(g) : ddp_broadcast(g, mismatch_buf, SMALL, DDP_F32, 1);
}

/* rank 0 skips the small all_reduce: its large one (the ring) meets the others' small one */
static ddp_result skipped_small(ddp_group *g, int rank, int n) {
    ddp_result r = rank == 0 ? DDP_SUCCESS : small_all_reduce(g);
    (void)n;
    return r ? r : large_all_reduce(g);
}

/* rank 0 calls barrier (a ring) while the others all_reduce */
static ddp_result barrier_vs_small(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 0 ? ddp_barrier(g) : small_all_reduce(g);
}

/* every rank broadcasts a few elements, each naming the next rank as the root: no rank is the root in
   its own call (a chain would have nobody send, and every rank would time out) */
static ddp_result roots_differ(ddp_group *g, int rank, int n) {
    return ddp_broadcast(g, mismatch_buf, SMALL, DDP_F32, (rank + 1) % n);
}

/* rank 0 calls barrier while the others broadcast a few elements from rank 0: dissemination both */
static ddp_result barrier_vs_broadcast(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 0 ? ddp_barrier(g) : ddp_broadcast(g, mismatch_buf, SMALL, DDP_F32, 0);
}

/* the last rank broadcasts above the tree's threshold (the chain, waiting on its left neighbour) while
   the others broadcast a few elements (the tree) from the same root */
static ddp_result broadcast_straddles(ddp_group *g, int rank, int n) {
    return ddp_broadcast(g, mismatch_buf, rank == n - 1 ? LARGE_BROADCAST : SMALL, DDP_F32, 0);
}

/* all_gather: 4 f32 a rank (Bruck's), one more on the last rank or (AG_LARGE) above the threshold (the
   ring, which sends to rank + 1 where Bruck's first step does too) */
#define AG_SMALL 4
#define AG_LARGE (DDP__ALLGATHER_BRUCK_MAX_BYTES / 4 + 1)
static float gather_buf[8 * AG_LARGE];

static ddp_result all_gather_of(ddp_group *g, size_t count) { return ddp_all_gather(g, mismatch_buf, gather_buf, count, DDP_F32); }

static ddp_result gather_counts_differ(ddp_group *g, int rank, int n) {
    return all_gather_of(g, rank == n - 1 ? AG_SMALL + 1 : AG_SMALL);
}

static ddp_result gather_count_straddles(ddp_group *g, int rank, int n) {
    return all_gather_of(g, rank == n - 1 ? AG_LARGE : AG_SMALL);
}

/* rank 0 calls barrier (dissemination: the same peers as Bruck's, empty frames) while the others gather */
static ddp_result gather_vs_barrier(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 0 ? ddp_barrier(g) : all_gather_of(g, AG_SMALL);
}

/* rank 1 all_reduces a few elements (recursive doubling) while the others gather */
static ddp_result gather_vs_all_reduce(ddp_group *g, int rank, int n) {
    (void)n;
    return rank == 1 ? small_all_reduce(g) : all_gather_of(g, AG_SMALL);
}

typedef struct scenario {
    const char *name;
    ddp_result (*fn)(ddp_group *g, int rank, int n);
    int warm_up; /* a matching small all_reduce first, so that the mismatch is not the first call */
} scenario;

static const scenario scenarios[] = {
    {"one count above the threshold", count_straddles, 1},
    {"half the counts above the threshold", half_straddles, 1},
    {"broadcast (root) vs all_reduce", broadcast_as_root, 1},
    {"broadcast (waiting) vs all_reduce", broadcast_waiting, 1},
    {"broadcast from a rank in all_reduce", broadcast_from_reducer, 1},
    {"skipped small all_reduce", skipped_small, 0},
    {"barrier vs all_reduce, first call", barrier_vs_small, 0},
    {"barrier vs all_reduce, later call", barrier_vs_small, 1},
    {"broadcasts naming different roots", roots_differ, 1},
    {"barrier vs broadcast", barrier_vs_broadcast, 1},
    {"broadcast count across the threshold", broadcast_straddles, 1},
    {"all_gather counts differ", gather_counts_differ, 1},
    {"all_gather count across the threshold", gather_count_straddles, 1},
    {"all_gather counts differ, first call", gather_counts_differ, 0},
    {"all_gather vs barrier", gather_vs_barrier, 1},
    {"all_gather vs all_reduce", gather_vs_all_reduce, 1},
};

/* Every rank must fail with DDP_ERR_MISMATCH. A rank still finishing the call before (ddp_init's own
   barrier, or the warm-up) when a faster rank, already in the next call, finds the mismatch gets the
   error there: the group breaks at once, and that rank's last call is the one that fails. One exception,
   seen once in a ThreadSanitizer run with 8 ranks on 2 cores (a rank 19 s into ddp_init): a rank still
   in ddp_init's rendezvous when rank 0 has failed and ended its store finds the store gone before it
   reads the abort reason there, and fails with DDP_ERR_PEER_LOST naming the store (an error, not a
   hang; rank 0 does not keep its store up for ranks that never finished joining). */
static int mismatch_worker(int rank, int n, void *arg) {
    const scenario *s = (const scenario *)arg;
    ddp_group *g = NULL;
    double t0 = tl_now();
    ddp_result r = ddp_init(NULL, &g);
    if (r == DDP_ERR_PEER_LOST && strstr(ddp_last_error(NULL), "lost the connection to the store")) {
        printf("rank %d of %d: %s: still in ddp_init when the store ended: %s\n", rank, n, s->name, ddp_last_error(NULL));
        return 0;
    }
    if (r == DDP_SUCCESS && s->warm_up) r = small_all_reduce(g);
    if (r == DDP_SUCCESS) r = s->fn(g, rank, n);
    CHECK(r == DDP_ERR_MISMATCH, "rank %d of %d: %s returned %s (%s) after %.1f s, expected DDP_ERR_MISMATCH", rank, n, s->name,
          ddp_result_string(r), ddp_last_error(g), tl_now() - t0);
    CHECK(strstr(ddp_last_error(g), "collective mismatch") != NULL, "rank %d of %d: %s: message \"%s\"", rank, n, s->name,
          ddp_last_error(g));
    ddp_destroy(g);
    return 0;
}

static int run_mismatches(void) {
    static const int worlds[] = {3, 4, 5, 8};
    size_t s, w;
    int failed = 0;
    for (w = 0; w < sizeof worlds / sizeof worlds[0]; w++)
        for (s = 0; s < sizeof scenarios / sizeof scenarios[0]; s++) {
            double t0 = tl_now();
            int rc = tl_run_ranks(worlds[w], mismatch_worker, (void *)&scenarios[s], 60);
            printf("mismatch: %-36s world %d: %s (%.1f s)\n", scenarios[s].name, worlds[w], rc == 0 ? "ok" : "FAILED",
                   tl_now() - t0);
            fflush(stdout);
            failed |= rc;
        }
    return failed;
}

/* ddp_init runs collectives of its own (the connect barrier #1; on mixed hosts also the shared-memory
   set-up's all_gather #2) and then restarts the count, so a fast rank's first user calls (#1, #2) can
   reach a slow rank still in ddp_init's: early data, not a mismatch. Several short runs, as the
   timing decides whether it happens. arg non-NULL: the last rank plays another host (its own UTS
   namespace and host name), so that the set-up finds mixed hosts and everything goes over TCP. */
static int first_call_worker(int rank, int n, void *arg) {
    ddp_group *g;
    float x[4] = {1, 2, 3, 4};
    if (arg && rank == n - 1)
        CHECK(unshare(CLONE_NEWUTS) == 0 && sethostname("ddp-other-host", 14) == 0, "rank %d: cannot play another host: %s",
              rank, strerror(errno));
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_all_reduce(g, x, 4, DDP_F32, DDP_SUM), g);
    CHECK_OK(ddp_all_reduce(g, x, 4, DDP_F32, DDP_SUM), g);
    CHECK(x[3] == 4.0f * (float)(n * n), "rank %d: two all_reduces gave %g, expected %g", rank, x[3], 4.0 * n * n);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- no spinning when oversubscribed (issue #25 item 7) ----
   This program holds the library itself, so its own sched_yield stands in for libc's and counts the
   calls: the TCP wait's spin is the only caller on a TCP group. With more ranks than CPUs online a
   wait yields once and then blocks in poll(); with no more ranks than CPUs it spins up to 50 us. */
static int yields;
int sched_yield(void) {
    __atomic_add_fetch(&yields, 1, __ATOMIC_RELAXED);
    return (int)syscall(SYS_sched_yield);
}

/* expect_spin 1: some yields (2 ranks). 0 (more ranks than CPUs): rank n-1 sleeps 20 ms before each of 20
   all_reduces, so the others wait with a core idle, where the 50 us spin yields again and again (measured
   before this change at 3 ranks on 2 CPUs: 9-14 yields a call); oversubscribed, a wait yields once and then
   blocks (measured: 1.5 a call): at most 5 a call. */
static int spin_worker(int rank, int n, void *arg) {
    ddp_group *g = NULL;
    int expect_spin = *(const int *)arg, i, counted, calls = expect_spin ? 200 : 20;
    int64_t x;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    __atomic_store_n(&yields, 0, __ATOMIC_RELAXED);
    for (i = 0; i < calls; i++) {
        x = rank;
        if (!expect_spin && rank == n - 1) usleep(20 * 1000);
        CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_I64, DDP_SUM), g);
        CHECK(x == (int64_t)n * (n - 1) / 2, "rank %d: sum of ranks %lld", rank, (long long)x);
    }
    counted = __atomic_load_n(&yields, __ATOMIC_RELAXED);
    x = counted;
    CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_I64, DDP_SUM), g);
    if (getenv("TEST_DEBUG")) fprintf(stderr, "%d ranks: rank %d yielded %d times in %d calls (%lld in all)\n", n, rank, counted, calls, (long long)x);
    CHECK(expect_spin ? x > 0 : (rank == n - 1 || counted <= 5 * calls), "%d ranks on %ld CPUs: rank %d yielded %d times "
          "(%lld in all) in %d small all_reduces over TCP; expected %s", n, sysconf(_SC_NPROCESSORS_ONLN), rank, counted,
          (long long)x, calls, expect_spin ? "some (it spins)" : "at most 5 a call (oversubscribed: one yield a wait)");
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

static int run_spin(void) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int spin = 1, no_spin = 0, failed = 0;
    if (cpus >= 2) failed |= tl_run_ranks(2, spin_worker, &spin, 120);
    if (cpus + 1 <= 16) failed |= tl_run_ranks((int)cpus + 1, spin_worker, &no_spin, 120);
    else printf("SKIP-PART oversubscribed: %ld CPUs here, the test runs at most 16 ranks\n", cpus);
    printf("small all_reduces over TCP spin before poll() at 2 ranks, yield once with %ld ranks on %ld CPUs: %s\n", cpus + 1, cpus,
           failed ? "FAILED" : "ok");
    fflush(stdout);
    return failed;
}

static int run_first_calls(void) {
    int i, failed = 0, mixed = 1, runs = getenv("TEST_QUICK") ? 5 : 20; /* sanitizer builds: fewer */
    for (i = 0; i < runs; i++) failed |= tl_run_ranks(8, first_call_worker, NULL, 60);
    printf("first calls right after ddp_init, 8 ranks, %d runs: %s\n", runs, failed ? "FAILED" : "ok");
    fflush(stdout);
    if (!tl_can_play_hosts()) {
        printf("first calls on mixed hosts: skipped (needs root for a UTS namespace)\n");
        return failed;
    }
    unsetenv("DDP_TRANSPORT"); /* the set-up must look for shared memory and find mixed hosts */
    for (i = 0; i < runs; i++) failed |= tl_run_ranks(8, first_call_worker, &mixed, 60);
    setenv("DDP_TRANSPORT", "tcp", 1);
    printf("first calls on mixed hosts (7 + 1), 8 ranks, %d runs: %s\n", runs, failed ? "FAILED" : "ok");
    return failed;
}

int main(int argc, char **argv) {
    int sizes[8] = {2, 3, 4, 5, 6, 7, 8}, nsizes = 7, i, failed = 0;
    if (argc > 1) {
        nsizes = 0;
        for (i = 1; i < argc && nsizes < 8; i++) sizes[nsizes++] = atoi(argv[i]);
    }
    setenv("DDP_TRANSPORT", "tcp", 1);
    setenv("DDP_LOG_LEVEL", "none", 0);
    setenv("DDP_TIMEOUT", "20", 1);
    for (i = 0; i < nsizes; i++) {
        double t0 = tl_now();
        int rc = tl_run_ranks(sizes[i], results_worker, NULL, 300);
        printf("results: world %d over tcp, %zu dtypes x %zu ops x %d counts: %s (%.1f s)\n", sizes[i], NDT, NOPS, NCOUNTS,
               rc == 0 ? "ok" : "FAILED", tl_now() - t0);
        fflush(stdout);
        failed |= rc;
    }
    for (i = 0; i < nsizes; i++) {
        double t0 = tl_now();
        int rc = tl_run_ranks(sizes[i], all_gather_worker, NULL, 300);
        printf("all_gather results: world %d over tcp, 4 element sizes x 9 counts x in/out of place: %s (%.1f s)\n", sizes[i],
               rc == 0 ? "ok" : "FAILED", tl_now() - t0);
        fflush(stdout);
        failed |= rc;
    }
    for (i = 0; i < nsizes; i++) {
        double t0 = tl_now();
        int rc = tl_run_ranks(sizes[i], broadcast_worker, NULL, 300);
        rc |= tl_run_ranks(sizes[i], shape_worker, NULL, 60);
        rc |= tl_run_ranks(sizes[i], barrier_order_worker, NULL, 60);
        printf("broadcast results, frames per rank, barrier order: world %d over tcp: %s (%.1f s)\n", sizes[i],
               rc == 0 ? "ok" : "FAILED", tl_now() - t0);
        fflush(stdout);
        failed |= rc;
    }
    failed |= run_killed();
    failed |= run_spin();
    failed |= run_first_calls();
    failed |= run_mismatches();
    return failed;
}
