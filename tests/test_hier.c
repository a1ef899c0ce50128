/* The hierarchical all_reduce (src/hier.c) of groups whose ranks sit on several hosts, some with
   several ranks. Hosts are played on one machine: the last ranks of a world enter a UTS namespace of
   their own with another host name, so the set-up finds two hosts (shared memory within each, TCP
   between them). Needs root for the namespaces; skips (77) otherwise.
   - results: worlds 3 (2 + 1), 4 (2 + 2), 5 (3 + 2), 6 (3 + 3); all_reduce above the recursive-doubling
     size, every dtype x op, in place, compared with a serial reference computed here (small integer
     values: exact for every dtype and op but AVG of floats, which must be within rounding); every
     rank's result bytes are compared with every other rank's (all_gather); the debug log must show
     that the calls ran hierarchically, and that calls at or below the threshold did not.
   - mismatches across hosts: a rank with another count, a rank in a broadcast, a rank that skips the
     call; every rank must fail with DDP_ERR_MISMATCH (a hang would end in DDP_ERR_TIMEOUT).
   - FSDP / ZeRO-3 (tests/fsdp_model.h's two-unit run) on 3 + 2 hosts.
   - a rank killed during hierarchical all_reduces: every other rank fails (no hang).
   TEST_QUICK=1: fewer dtypes (sanitizer builds). */
#include "testlib.h"
#include "ref_optim.h"
#include "fsdp_model.h"

#include <sched.h>

#define BIG (DDP__RD_MAX_BYTES / 4 + 777) /* f32 elements: above the recursive-doubling size */
static const ddp_dtype dtypes[] = {DDP_F32, DDP_BF16, DDP_I32, DDP_F64, DDP_F16, DDP_I8, DDP_U8, DDP_I64};
static const ddp_op ops[] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
#define NOPS (sizeof ops / sizeof ops[0])

typedef struct plan {
    int other; /* how many of the last ranks play the other host */
} plan;

static int hierarchical_calls; /* debug messages saying an all_reduce ran hierarchically, in this process */

static void watch_log(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)user;
    if (strstr(msg, ": hierarchical")) __atomic_add_fetch(&hierarchical_calls, 1, __ATOMIC_RELAXED);
    else if (level <= DDP_LOG_WARN && !getenv("TEST_HIER_QUIET")) fprintf(stderr, "[ddp rank %d] %s\n", rank, msg);
}
static int hier_count(void) { return __atomic_load_n(&hierarchical_calls, __ATOMIC_RELAXED); }

/* Join the group, the last p->other ranks as another host. */
static ddp_group *join(int rank, int n, const plan *p) {
    if (rank >= n - p->other)
        CHECK(unshare(CLONE_NEWUTS) == 0 && sethostname("ddp-other-host", 14) == 0, "rank %d: cannot play another host: %s",
              rank, strerror(errno));
    return tl_init_logged(watch_log);
}

/* Small integers, so that every dtype holds every sum, product, min and max exactly (u8: shifted up
   so that none is negative). */
static double value(int r, size_t i, ddp_dtype t, ddp_op op) {
    if (op == DDP_PROD) return (double)(1 + (i + (size_t)r) % 2); /* 1 or 2: products up to 2^6 */
    return (double)((int)((i * 7 + (size_t)r * 13) % 11) - (t == DDP_U8 ? 0 : 5));
}

static double reference(int n, size_t i, ddp_dtype t, ddp_op op) {
    int64_t vals[64] = {0};
    int r;
    for (r = 0; r < n && r < 64; r++) vals[r] = (int64_t)value(r, i, t, op);
    return tl_reduce_small(vals, n, t, op);
}

static int results_worker(int rank, int n, void *arg) {
    ddp_group *g = join(rank, n, (const plan *)arg);
    size_t nd = getenv("TEST_QUICK") ? 3 : sizeof dtypes / sizeof dtypes[0], d, o, i, most = DDP__RD_MAX_BYTES + 777;
    unsigned char *buf = (unsigned char *)malloc(most * 8), *all = (unsigned char *)malloc(most * 8 * (size_t)n);
    int before, r;
    CHECK(buf && all, "out of memory");
    for (d = 0; d < nd; d++) {
        ddp_dtype t = dtypes[d];
        size_t es = ddp_dtype_size(t), count = DDP__RD_MAX_BYTES / es + 777; /* above the threshold, ragged */
        int is_f = t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16;
        for (o = 0; o < NOPS; o++) {
            ddp_op op = ops[o];
            for (i = 0; i < count; i++) tl_store_value(buf, i, t, value(rank, i, t, op));
            before = hier_count();
            CHECK_OK(ddp_all_reduce(g, buf, count, t, op), g);
            CHECK(hier_count() == before + 1, "rank %d: all_reduce of %zu %s did not run hierarchically", rank, count,
                  ddp_dtype_name(t));
            for (i = 0; i < count; i++) {
                double want = reference(n, i, t, op), got = tl_load_value(buf, i, t);
                CHECK(is_f && op == DDP_AVG ? fabs(got - want) <= 1e-2 * (1 + fabs(want)) : got == want,
                      "rank %d, world %d: %s %s element %zu = %g, expected %g", rank, n, ddp_dtype_name(t), ddp_op_name(op), i,
                      got, want);
            }
            CHECK_OK(ddp_all_gather(g, buf, all, count * es, DDP_U8), g);
            for (r = 0; r < n; r++)
                CHECK(memcmp(all + (size_t)r * count * es, buf, count * es) == 0, "rank %d: %s %s differs from rank %d's",
                      rank, ddp_dtype_name(t), ddp_op_name(op), r);
        }
    }
    before = hier_count(); /* at the threshold: recursive doubling over the group's own connections */
    CHECK_OK(ddp_all_reduce(g, buf, DDP__RD_MAX_BYTES / 4, DDP_F32, DDP_SUM), g);
    CHECK(hier_count() == before, "rank %d: a %zu-byte all_reduce ran hierarchically", rank, (size_t)DDP__RD_MAX_BYTES);
    free(buf);
    free(all);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- mismatches: the odd rank out is on the other host (the last rank) or on the first (rank 0) ---- */

typedef struct mismatch {
    const char *name;
    int odd; /* 0: rank 0 is odd, 1: the last rank */
    int kind; /* 0: another count, 1: broadcast instead, 2: skips the call */
    plan p;
} mismatch;

static int mismatch_worker(int rank, int n, void *arg) {
    const mismatch *m = (const mismatch *)arg;
    ddp_group *g = join(rank, n, &m->p);
    size_t count = BIG;
    float *x = (float *)calloc(count + 64, sizeof *x);
    int odd = rank == (m->odd ? n - 1 : 0);
    ddp_result r;
    CHECK(x != NULL, "out of memory");
    CHECK_OK(ddp_all_reduce(g, x, count, DDP_F32, DDP_SUM), g); /* one good call first */
    if (odd && m->kind == 0) r = ddp_all_reduce(g, x, count + 64, DDP_F32, DDP_SUM);
    else if (odd && m->kind == 1) r = ddp_broadcast(g, x, count, DDP_F32, 0);
    else if (odd && m->kind == 2) r = ddp_barrier(g); /* skipped the all_reduce: the next call is a barrier */
    else r = ddp_all_reduce(g, x, count, DDP_F32, DDP_SUM);
    if (r == DDP_SUCCESS) r = ddp_barrier(g);
    CHECK(r == DDP_ERR_MISMATCH, "rank %d (%s): got %s, expected DDP_ERR_MISMATCH: %s", rank, m->name, ddp_result_string(r),
          ddp_last_error(g));
    ddp_destroy(g);
    free(x);
    return 0;
}

/* ---- a rank killed in the middle ---- */

/* FSDP / ZeRO-3 across the hosts: tests/fsdp_model.h's two-unit run (its all-gathers, reduce-scatters
   and fingerprints cross the TCP link between the hosts). */
static int fsdp_worker(int rank, int n, void *arg) {
    ddp_group *g = join(rank, n, (const plan *)arg);
    fsdp_two_units(g);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

static int kill_worker(int rank, int n, void *arg) {
    ddp_group *g = join(rank, n, (const plan *)arg);
    size_t count = (size_t)1 << 20;
    float *x = (float *)calloc(count, sizeof *x);
    ddp_result r = DDP_SUCCESS;
    int i;
    CHECK(x != NULL, "out of memory");
    for (i = 0; i < 1000000 && r == DDP_SUCCESS; i++) {
        if (i == 5 && rank == n - 1) kill(getpid(), SIGKILL); /* on the other host, mid-run */
        r = ddp_all_reduce(g, x, count, DDP_F32, DDP_SUM);
    }
    CHECK(r == DDP_ERR_PEER_LOST || r == DDP_ERR_STATE, "rank %d: after a rank was killed: %s: %s", rank,
          ddp_result_string(r), ddp_last_error(g));
    ddp_destroy(g);
    free(x);
    return 0;
}

int main(void) {
    static const int worlds[][2] = {{3, 1}, {4, 2}, {5, 2}, {6, 3}};
    static const char *kinds[] = {"another count", "broadcast instead", "skipped call"};
    size_t w;
    int failed = 0, kind, odd, codes[8];
    if (!tl_can_play_hosts()) {
        printf("needs root (a UTS namespace per played host)\n");
        return 77;
    }
    unsetenv("DDP_TRANSPORT");
    setenv("DDP_TIMEOUT", "20", 1);
    for (w = 0; w < sizeof worlds / sizeof worlds[0]; w++) {
        plan p;
        double t0 = tl_now();
        int rc;
        p.other = worlds[w][1];
        rc = tl_run_ranks(worlds[w][0], results_worker, &p, 300);
        printf("results: world %d (%d + %d hosts), every dtype x op: %s (%.1f s)\n", worlds[w][0], worlds[w][0] - p.other,
               p.other, rc ? "FAILED" : "ok", tl_now() - t0);
        fflush(stdout);
        failed |= rc;
    }
    setenv("TEST_HIER_QUIET", "1", 1); /* the failures below are expected: do not print their log lines */
    for (kind = 0; kind < 3; kind++)
        for (odd = 0; odd < 2; odd++) {
            mismatch m;
            double t0 = tl_now();
            int rc;
            m.name = kinds[kind];
            m.odd = odd;
            m.kind = kind;
            m.p.other = 2;
            rc = tl_run_ranks(5, mismatch_worker, &m, 60);
            printf("mismatch, %s on %s, world 5 (3 + 2 hosts): %s (%.1f s)\n", kinds[kind], odd ? "the last rank" : "rank 0",
                   rc ? "FAILED" : "ok", tl_now() - t0);
            fflush(stdout);
            failed |= rc;
        }
    {
        plan p;
        double t0 = tl_now();
        int rc;
        p.other = 2;
        rc = tl_run_ranks(5, fsdp_worker, &p, 60);
        printf("FSDP / ZeRO-3, world 5 (3 + 2 hosts): %s (%.1f s)\n", rc ? "FAILED" : "ok", tl_now() - t0);
        failed |= rc;
    }
    {
        plan p;
        double t0 = tl_now();
        int rc, i;
        p.other = 2;
        tl_run_ranks_status(4, kill_worker, &p, 60, codes); /* fails: the last rank is killed */
        rc = codes[3] != -SIGKILL;
        for (i = 0; i < 3; i++) rc |= codes[i] != 0; /* the others saw the loss and passed their checks */
        printf("a rank killed during hierarchical all_reduces, world 4 (2 + 2 hosts): %s (%.1f s)\n", rc ? "FAILED" : "ok",
               tl_now() - t0);
        failed |= rc;
    }
    return failed;
}
