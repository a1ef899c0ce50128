/* all_reduce on plain (malloc) buffers over shared memory through cross-memory attach
   (process_vm_readv/writev): the single-copy algorithm reaching peers' own address spaces.
   - every dtype x op on malloc buffers just below, at and above the size from which CMA runs
     (CMA_MIN, = DDP__SHM_CMA_MIN_BYTES in src/shm.c), odd counts, and a few larger calls, on world
     sizes 2, 3, 4, 8, each rank's buffer at a different misalignment; in place (all_reduce always is);
     results against a serial reference computed here (small integers: every reduction order is exact,
     so results must match bit for bit); the debug log must say "cross-memory attach" exactly for the
     calls of CMA_MIN bytes and more;
   - library buffers on odd ranks and malloc on even ranks: CMA for the plain ones, the arena for the others;
   - async all-reduces of malloc buffers, several in flight;
   - DDP_SHM_CMA=0 on one rank only: the whole group stages (no "cross-memory attach"), same results;
   - one rank under a seccomp filter that refuses process_vm_readv/writev with EPERM (as Docker's default
     profile does): the set-up probe fails there, the whole group stages, same results;
   - a rank whose CMA calls start failing (the seccomp filter installed after set-up): the next all_reduce
     fails on every rank with a clear error, no hang, no crash;
   - a rank killed (SIGKILL) in the middle of CMA all-reduces: the others fail with DDP_ERR_PEER_LOST.
   Where the machine refuses CMA (seccomp, Yama ptrace_scope >= 1), the results are still checked
   (staged), and the test then exits 77 saying so. TEST_QUICK=1 (sanitizer runs): fewer worlds and ops. */
#include "testlib.h"

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
static const ddp_op ops[] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
#define NDT (sizeof dtypes / sizeof dtypes[0])
#define NOPS (sizeof ops / sizeof ops[0])
#define CMA_MIN ((size_t)1 << 20) /* bytes per rank from which a plain-buffer all_reduce goes through CMA */

static int cma_works = 1; /* in main: whether the machine allows CMA (the first group said so) */

/* ---- the serial reference ---- */

/* The value rank r contributes at element i: a small integer that every dtype holds exactly. */
static int64_t value(int r, size_t i, ddp_dtype t, ddp_op op, int salt) {
    uint64_t h = ((uint64_t)i * 0x9E3779B1u) ^ ((uint64_t)r * 0x85EBCA6Bu + (uint64_t)salt * 0xC2B2AE35u);
    h ^= h >> 13;
    if (op == DDP_PROD) { /* products over 8 ranks stay small: factors 1, 2, -1 (u8: 1, 2) */
        int k = (int)(h % 3);
        if (t == DDP_U8) return k == 2 ? 1 : k + 1;
        return k == 0 ? 1 : k == 1 ? 2 : -1;
    }
    if (t == DDP_U8) return (int64_t)(h % 5);
    return (int64_t)(h % 11) - 5;
}


/* ---- groups whose log is watched ---- */

static int cma_calls; /* debug messages saying an all_reduce went through cross-memory attach */
static int cma_on;    /* the set-up said cross-memory attach is on */

static void watch_log(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)user;
    if (strstr(msg, "cross-memory attach (process_vm")) __atomic_add_fetch(&cma_calls, 1, __ATOMIC_RELAXED);
    if (strstr(msg, "cross-memory attach on")) cma_on = 1;
    if (level <= DDP_LOG_WARN) fprintf(stderr, "[ddp rank %d] %s\n", rank, msg);
}
static int calls(void) { return __atomic_load_n(&cma_calls, __ATOMIC_RELAXED); }

static ddp_group *init_watched(void) { return tl_init_logged(watch_log); }

/* ---- all_reduce on plain buffers ---- */

typedef struct case_arg {
    int mixed;    /* odd ranks pass ddp_alloc memory */
    int off_rank; /* this rank sets DDP_SHM_CMA=0 (-1: none) */
    int seccomp_rank; /* this rank refuses itself process_vm_readv/writev (-1: none) */
    int expect;   /* CMA expected for the large calls */
} case_arg;

/* One all_reduce of count elements on this rank's buffer (malloc, misaligned per rank, or ddp_alloc). */
static int one(ddp_group *g, const case_arg *a, ddp_dtype t, ddp_op op, size_t count, int salt) {
    int rank = ddp_rank(g), n = ddp_world_size(g), lib = a->mixed && rank % 2 == 1, before;
    size_t es = ddp_dtype_size(t), shift = es * (size_t)(rank % 3);
    char *block = lib ? (char *)ddp_alloc(g, count * es) : (char *)malloc(count * es + 3 * es), *p;
    char what[160];
    CHECK(block != NULL, "out of memory for %zu elements", count);
    p = lib ? block : block + shift;
    tl_fill(value, p, count, rank, t, op, ++salt);
    snprintf(what, sizeof what, "all_reduce(%s, %s, count %zu, %zu bytes)%s", ddp_dtype_name(t), ddp_op_name(op), count,
             count * es, lib ? " library buffer" : a->mixed ? " malloc, mixed" : " malloc");
    before = calls();
    CHECK_OK(ddp_all_reduce(g, p, count, t, op), g);
    tl_check_reduced(value, p, count, t, n, op, salt, what, rank);
    CHECK((calls() > before) == (a->expect && count * es >= CMA_MIN), "rank %d: %s: %s cross-memory attach", rank, what,
          calls() > before ? "went through" : "did not go through");
    if (lib) ddp_free(g, block);
    else free(block);
    return salt;
}

/* A seccomp filter on this process: process_vm_readv/writev fail with EPERM, everything else runs. */
static void refuse_cma(void) {
    struct sock_filter f[5] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_writev, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
    };
    struct sock_fprog prog;
    prog.len = 5;
    prog.filter = f;
    CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS: %s", strerror(errno));
    CHECK(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0, "seccomp filter: %s", strerror(errno));
}

static int worker(int rank, int n, void *arg) {
    const case_arg *a = (const case_arg *)arg;
    int quick = getenv("TEST_QUICK") != NULL, salt = 0, k;
    ddp_group *g;
    size_t di, oi;
    if (rank == a->off_rank) setenv("DDP_SHM_CMA", "0", 1);
    if (rank == a->seccomp_rank) refuse_cma();
    g = init_watched();
    (void)n;
    for (di = 0; di < NDT; di++) {
        ddp_dtype t = dtypes[di];
        size_t es = ddp_dtype_size(t);
        salt = one(g, a, t, DDP_SUM, CMA_MIN / es - 1, salt); /* just below: staged */
        salt = one(g, a, t, DDP_MAX, CMA_MIN / es, salt);     /* exactly at */
        for (oi = 0; oi < NOPS; oi++) { /* just above, an odd count, every op */
            if (quick && oi > 1 && di > 0) continue;
            salt = one(g, a, t, ops[oi], CMA_MIN / es + 7, salt);
        }
    }
    if (!quick || n == 2) { /* larger: several chunks per slice, each reduction kernel kind */
        salt = one(g, a, DDP_F32, DDP_SUM, ((size_t)3 << 19) / 4 + 3, salt);
        salt = one(g, a, DDP_F32, DDP_AVG, ((size_t)5 << 20) / 4 + 1, salt);
        salt = one(g, a, DDP_BF16, DDP_SUM, ((size_t)3 << 19) / 2 + 5, salt);
        salt = one(g, a, DDP_I32, DDP_MAX, ((size_t)3 << 19) / 4 + 1, salt);
    }
    { /* async all-reduces of malloc buffers, several in flight (the progress thread runs them) */
        enum { Q = 3 };
        size_t count = ((size_t)1 << 20) / 4 + 11, i;
        float *b[Q];
        ddp_work *w[Q];
        int before = calls();
        for (k = 0; k < Q; k++) {
            CHECK((b[k] = (float *)malloc(count * 4)) != NULL, "out of memory");
            tl_fill(value, b[k], count, rank, DDP_F32, DDP_SUM, salt + k);
            CHECK_OK(ddp_all_reduce_async(g, b[k], count, DDP_F32, DDP_SUM, &w[k]), g);
        }
        for (k = Q - 1; k >= 0; k--) CHECK_OK(ddp_wait(w[k]), g);
        for (k = 0; k < Q; k++) {
            for (i = 0; i < count; i++)
                CHECK(b[k][i] == tl_expected(value, n, i, DDP_F32, DDP_SUM, salt + k), "rank %d: async %d: element %zu", rank, k, i);
            free(b[k]);
        }
        CHECK((calls() - before == Q) == (a->expect != 0), "rank %d: async: %d of %d went through cross-memory attach", rank,
              calls() - before, Q);
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Whether this machine lets a group use CMA: the group's set-up says so at info level. */
static int probe_worker(int rank, int n, void *arg) {
    ddp_group *g = init_watched();
    (void)n;
    (void)arg;
    CHECK_OK(ddp_destroy(g), NULL);
    return rank == 0 && !cma_on ? 3 : 0;
}

/* ---- CMA refused after set-up: a clean error on every rank ---- */

static int refused_worker(int rank, int n, void *arg) {
    ddp_group *g = init_watched();
    size_t count = ((size_t)1 << 20) / 4 + 1;
    float *b = (float *)malloc(count * 4);
    ddp_result r;
    (void)n;
    (void)arg;
    CHECK(b != NULL, "out of memory");
    tl_fill(value, b, count, rank, DDP_F32, DDP_SUM, 5);
    CHECK_OK(ddp_all_reduce(g, b, count, DDP_F32, DDP_SUM), g);
    tl_check_reduced(value, b, count, DDP_F32, n, DDP_SUM, 5, "all_reduce before the filter", rank);
    if (rank == 1) refuse_cma();
    r = ddp_all_reduce(g, b, count, DDP_F32, DDP_SUM);
    CHECK(r == DDP_ERR_SYSTEM, "rank %d: got %s (%s), expected DDP_ERR_SYSTEM", rank, ddp_result_string(r), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "process_vm_") != NULL, "rank %d: the error does not say what failed: %s", rank, ddp_last_error(g));
    ddp_destroy(g); /* broken: its result is the error */
    free(b);
    return 0;
}

/* ---- a rank killed in the middle of CMA all-reduces ---- */

static int crash_worker(int rank, int n, void *arg) {
    int victim = *(const int *)arg;
    ddp_group *g = init_watched();
    size_t count = ((size_t)4 << 20) / 4 + 3, it;
    float *b = (float *)malloc(count * 4);
    double t0;
    ddp_result r = DDP_SUCCESS;
    (void)n;
    CHECK(b != NULL, "out of memory");
    tl_fill(value, b, count, rank, DDP_F32, DDP_SUM, 3);
    CHECK_OK(ddp_barrier(g), g);
    t0 = tl_now();
    for (it = 0; r == DDP_SUCCESS; it++) {
        if (rank == victim && tl_now() - t0 > 0.3) raise(SIGKILL); /* after some all-reduces, at any point of one */
        r = ddp_all_reduce(g, b, count, DDP_F32, DDP_MAX);
        CHECK(tl_now() - t0 < 60, "rank %d: still running after 60 s", rank);
    }
    CHECK(r == DDP_ERR_PEER_LOST, "rank %d: got %s (%s), expected DDP_ERR_PEER_LOST", rank, ddp_result_string(r), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "rank") != NULL, "the error does not name the lost rank: %s", ddp_last_error(g));
    ddp_destroy(g); /* broken: its result is the error */
    free(b);
    return 0;
}

static void crash_case(int n, int victim) {
    int codes[8], i;
    double t0 = tl_now();
    tl_run_ranks_status(n, crash_worker, &victim, 120, codes);
    for (i = 0; i < n; i++)
        CHECK(codes[i] == (i == victim ? -SIGKILL : 0), "%d ranks, rank %d killed: rank %d ended with %d", n, victim, i, codes[i]);
    printf("%d ranks, rank %d killed in CMA all-reduces: the others fail with PEER_LOST (%.1f s)\n", n, victim, tl_now() - t0);
}

static void run(int n, case_arg *a, const char *what) {
    double t0 = tl_now();
    CHECK(tl_run_ranks(n, worker, a, 300) == 0, "%s, %d ranks: failed", what, n);
    printf("%s, %d ranks (%.1f s)\n", what, n, tl_now() - t0);
    fflush(stdout);
}

int main(void) {
    static const int worlds[] = {2, 3, 4, 8};
    int i, quick = getenv("TEST_QUICK") != NULL, codes[2];
    case_arg plain, mixed, off, sec;
    setenv("DDP_TIMEOUT", "120", 0);
    unsetenv("DDP_TRANSPORT");
    unsetenv("DDP_SHM_CMA");
    tl_run_ranks_status(2, probe_worker, NULL, 60, codes);
    CHECK(codes[0] == 0 || codes[0] == 3, "the probe group failed (rank 0 ended with %d)", codes[0]);
    cma_works = codes[0] == 0;
    plain.mixed = 0;
    plain.off_rank = -1;
    plain.seccomp_rank = -1;
    plain.expect = cma_works;
    mixed = plain;
    mixed.mixed = 1;
    off = plain;
    off.off_rank = 1;
    off.expect = 0;
    sec = plain;
    sec.seccomp_rank = 2;
    sec.expect = 0;
    for (i = 0; i < (quick ? 2 : 4); i++) run(worlds[i], &plain, "malloc buffers: every dtype x op around CMA_MIN matches the serial reference");
    run(quick ? 3 : 4, &mixed, "ddp_alloc on odd ranks, malloc on even: same results");
    run(3, &off, "DDP_SHM_CMA=0 on rank 1: the whole group stages, same results");
    run(3, &sec, "rank 2 under seccomp refusing process_vm_readv/writev: the whole group stages, same results");
    if (!cma_works) {
        printf("cross-memory attach is refused on this machine (seccomp or Yama ptrace_scope): only the staged path was tested\n");
        return 77;
    }
    CHECK(tl_run_ranks(3, refused_worker, NULL, 120) == 0, "CMA refused after set-up: failed");
    printf("rank 1 refuses CMA after set-up: the next all_reduce fails on every rank with DDP_ERR_SYSTEM\n");
    crash_case(2, 1);
    crash_case(3, 0);
    return 0;
}
