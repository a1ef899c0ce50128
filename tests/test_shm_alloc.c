/* ddp_alloc / ddp_free and single-copy collectives on library buffers.
   - all_reduce (every dtype x op), broadcast, all_gather, reduce, reduce_scatter and async all_reduce on
     ddp_alloc memory, on world sizes 2, 3, 4, 8, from 1 element to several MiB (odd counts), against a
     serial reference computed here (small integers: every reduction order is exact, so results must
     match bit for bit). Each rank allocates in a different order and passes a different sub-range of
     its block, so the ranks' buffers sit at different arena offsets.
   - the same with every odd rank passing malloc memory ("mixed"): same results, and no rank may have
     gone single-copy (the library logs "single-copy" at debug level; a log callback counts it), while
     with library buffers everywhere the large calls must have gone single-copy (mixed large all-reduces
     go through cross-memory attach where the machine allows it, which logs differently: test_shm_cma);
   - the reducer on one host: its buckets are library memory, so its all-reduces go single-copy;
   - ddp_alloc on a TCP group (DDP_TRANSPORT=tcp) and on one rank, on a tiny arena (falls back to plain
     memory); alignment, zero fill, many allocations and frees (no overlap), from several threads while
     collectives run; double free, foreign pointers and NULL give clear errors and no crash;
   - a rank killed (SIGKILL) in the middle of single-copy all-reduces: the others fail with
     DDP_ERR_PEER_LOST and no name of the group is left in /dev/shm;
   - /dev/shm too small for the segment (a 1 MiB tmpfs in a mount namespace; root only): the group runs on
     TCP and rank 0 warns at the default level with /dev/shm's size, the segment's and the fixes.
   TEST_QUICK=1 (sanitizer runs): one large case, fewer ops above one-shot size, no 8-rank and fewer mixed runs. */
#include "testlib.h"

#include <dirent.h>
#include <pthread.h>
#include <sys/mount.h>

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
static const ddp_op ops[] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
#define NDT (sizeof dtypes / sizeof dtypes[0])
#define NOPS (sizeof ops / sizeof ops[0])
#define BIG ((size_t)1 << 20) /* a call of at least this many bytes per rank must go single-copy */

/* ---- the serial reference ---- */

/* The value rank r contributes at element i: a small integer that every dtype holds exactly. */
static int64_t value(int r, size_t i, ddp_dtype t, ddp_op op, int salt) {
    uint64_t h = (uint64_t)i * 2654435761u + (uint64_t)r * 40503u + (uint64_t)salt * 977u;
    if (op == DDP_PROD) { /* products over 8 ranks stay small: factors 1, 2, -1 (u8: 1, 2) */
        int k = (int)((h >> 7) % 3);
        if (t == DDP_U8) return k == 2 ? 1 : k + 1;
        return k == 0 ? 1 : k == 1 ? 2 : -1;
    }
    if (t == DDP_U8) return (int64_t)((h >> 7) % 4);
    return (int64_t)((h >> 7) % 9) - 4;
}


/* ---- groups whose debug log is watched for "single-copy" ---- */

static int single_copies; /* debug messages saying a collective ran single-copy, in this process */

static void watch_log(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)user;
    if (strstr(msg, "single-copy")) __atomic_add_fetch(&single_copies, 1, __ATOMIC_RELAXED);
    else if (level <= DDP_LOG_WARN && !strstr(msg, "not a live block")) /* the bad frees that the test makes */
        fprintf(stderr, "[ddp rank %d] %s\n", rank, msg);
}
static int copies(void) { return __atomic_load_n(&single_copies, __ATOMIC_RELAXED); }

static ddp_group *init_watched(void) { return tl_init_logged(watch_log); }

/* A buffer of bytes: library memory (a sub-range shift bytes into a block) or malloc memory. */
typedef struct buffer {
    void *block, *p;
    int plain;
} buffer;

static buffer buf_get(ddp_group *g, int plain, size_t bytes, size_t shift) {
    buffer b;
    b.plain = plain;
    b.block = plain ? malloc(bytes + shift + 1) : ddp_alloc(g, bytes + shift);
    CHECK(b.block != NULL, "%s(%zu bytes) failed: %s", plain ? "malloc" : "ddp_alloc", bytes + shift, ddp_last_error(g));
    CHECK(((uintptr_t)b.block & 63) == 0 || plain, "ddp_alloc returned %p, not 64-byte aligned", b.block);
    b.p = (char *)b.block + shift;
    return b;
}
static void buf_put(ddp_group *g, buffer *b) {
    if (b->plain) free(b->block);
    else ddp_free(g, b->block);
    b->block = b->p = NULL;
}

/* ---- collectives on library buffers, all ranks or mixed ---- */

typedef struct coll_arg {
    int mixed; /* odd ranks pass malloc memory */
    int tcp;   /* DDP_TRANSPORT=tcp: nothing goes single-copy */
} coll_arg;

static size_t big_count(size_t es) { return (getenv("TEST_QUICK") ? ((size_t)5 << 19) : ((size_t)3 << 20)) / es + 3; }

/* all_reduce of every op on one count; returns the salt used last */
static int all_reduce_ops(ddp_group *g, const coll_arg *a, size_t di, size_t count, int salt) {
    int rank = ddp_rank(g), n = ddp_world_size(g), plain = a->mixed && rank % 2 == 1;
    ddp_dtype t = dtypes[di];
    size_t es = ddp_dtype_size(t), oi;
    int big = count * es >= BIG;
    for (oi = 0; oi < NOPS; oi++) {
        ddp_op op = ops[oi];
        buffer b;
        char what[128];
        int before;
        if (big && !(t == DDP_F32 && (op == DDP_SUM || op == DDP_AVG)) && !(t == DDP_BF16 && op == DDP_SUM) &&
            !(t == DDP_I32 && op == DDP_MAX))
            continue; /* large: a few (dtype, op) pairs, each for a different reduction kernel */
        if (getenv("TEST_QUICK") && ((big && (t != DDP_F32 || op != DDP_SUM)) || (count > 7 && (op == DDP_PROD || op == DDP_MIN))))
            continue;
        b = buf_get(g, plain, count * es, (size_t)64 * (size_t)(rank % 3));
        tl_fill(value, b.p, count, rank, t, op, ++salt);
        snprintf(what, sizeof what, "all_reduce(%s, %s, count %zu)%s", ddp_dtype_name(t), ddp_op_name(op), count,
                 a->mixed ? " mixed" : "");
        before = copies();
        CHECK_OK(ddp_all_reduce(g, b.p, count, t, op), g);
        tl_check_reduced(value, b.p, count, t, n, op, salt, what, rank);
        if (big) CHECK((copies() > before) == (!a->mixed && !a->tcp), "rank %d: %s: single-copy or not, wrongly", rank, what);
        buf_put(g, &b);
    }
    return salt;
}

static int broadcast_gather(ddp_group *g, const coll_arg *a, ddp_dtype t, size_t count, int salt) {
    int rank = ddp_rank(g), n = ddp_world_size(g), plain = a->mixed && rank % 2 == 1, root, k, before;
    size_t es = ddp_dtype_size(t), r, i;
    int big = count * es >= BIG;
    char what[128];
    buffer b, recv;
    salt++;
    for (root = 0; root < n; root += n - 1) { /* the first and the last rank */
        b = buf_get(g, plain, count * es, 64);
        tl_fill(value, b.p, count, rank, t, DDP_SUM, salt);
        snprintf(what, sizeof what, "broadcast(%s, count %zu, root %d)%s", ddp_dtype_name(t), count, root, a->mixed ? " mixed" : "");
        before = copies();
        CHECK_OK(ddp_broadcast(g, b.p, count, t, root), g);
        for (i = 0; i < count; i++)
            CHECK(tl_load_value(b.p, i, t) == (double)value(root, i, t, DDP_SUM, salt), "rank %d: %s: element %zu", rank, what, i);
        /* single-copy needs only the root's buffer in its arena */
        if (big) CHECK((copies() > before) == (!(a->mixed && root % 2 == 1) && !a->tcp), "rank %d: %s: single-copy or not, wrongly", rank, what);
        buf_put(g, &b);
        if (n == 1) break;
    }
    for (k = 0; k < 2; k++) { /* out of place (plain receive buffer), then in place */
        void *send;
        recv = buf_get(g, k == 0 || plain, count * es * (size_t)n, 0);
        b.block = NULL;
        if (k == 0) {
            b = buf_get(g, plain, count * es, 128);
            send = b.p;
        } else {
            send = (char *)recv.p + (size_t)rank * count * es;
        }
        tl_fill(value, send, count, rank, t, DDP_SUM, salt);
        snprintf(what, sizeof what, "all_gather(%s, count %zu, %s)%s", ddp_dtype_name(t), count, k ? "in place" : "out of place",
                 a->mixed ? " mixed" : "");
        before = copies();
        CHECK_OK(ddp_all_gather(g, send, recv.p, count, t), g);
        for (r = 0; r < (size_t)n; r++)
            for (i = 0; i < count; i++)
                CHECK(tl_load_value(recv.p, r * count + i, t) == (double)value((int)r, i, t, DDP_SUM, salt),
                      "rank %d: %s: rank %zu's element %zu", rank, what, r, i);
        if (big) CHECK((copies() > before) == (!a->mixed && !a->tcp), "rank %d: %s: single-copy or not, wrongly", rank, what);
        if (b.block) buf_put(g, &b);
        buf_put(g, &recv);
    }
    return salt;
}

/* reduce and reduce_scatter have no single-copy path: library buffers must simply work */
static int reduce_scatter(ddp_group *g, const coll_arg *a, ddp_dtype t, size_t count, int salt) {
    int rank = ddp_rank(g), n = ddp_world_size(g), plain = a->mixed && rank % 2 == 1;
    size_t es = ddp_dtype_size(t), i;
    buffer b = buf_get(g, plain, count * es * (size_t)n, 0), recv = buf_get(g, plain, count * es, 0);
    tl_fill(value, b.p, count, rank, t, DDP_MAX, ++salt);
    CHECK_OK(ddp_reduce(g, b.p, count, t, DDP_MAX, n - 1), g);
    for (i = 0; i < count; i++) {
        double want = rank == n - 1 ? tl_expected(value, n, i, t, DDP_MAX, salt) : (double)value(rank, i, t, DDP_MAX, salt);
        CHECK(tl_load_value(b.p, i, t) == want, "rank %d: reduce(%s, count %zu): element %zu", rank, ddp_dtype_name(t), count, i);
    }
    tl_fill(value, b.p, count * (size_t)n, rank, t, DDP_SUM, ++salt);
    CHECK_OK(ddp_reduce_scatter(g, b.p, recv.p, count, t, DDP_SUM), g);
    for (i = 0; i < count; i++)
        CHECK(tl_load_value(recv.p, i, t) == tl_expected(value, n, (size_t)rank * count + i, t, DDP_SUM, salt),
              "rank %d: reduce_scatter(%s, count %zu): element %zu", rank, ddp_dtype_name(t), count, i);
    buf_put(g, &b);
    buf_put(g, &recv);
    return salt;
}

static int coll_worker(int rank, int n, void *arg) {
    const coll_arg *a = (const coll_arg *)arg;
    ddp_group *g = init_watched();
    void *holes[8];
    size_t di, ci;
    int salt = 0, k;
    /* a different allocation history on each rank: the buffers land at different arena offsets */
    for (k = 0; k <= rank % 4; k++) CHECK((holes[k] = ddp_alloc(g, (size_t)(k + 1) * 5000)) != NULL, "%s", ddp_last_error(g));
    for (k = 0; k <= rank % 4; k += 2) ddp_free(g, holes[k]);
    for (di = 0; di < NDT; di++) {
        size_t es = ddp_dtype_size(dtypes[di]);
        size_t counts[4];
        counts[0] = 1;
        counts[1] = 7;
        counts[2] = 70001; /* above 64 KiB for every dtype, one round */
        counts[3] = big_count(es);
        for (ci = 0; ci < 4; ci++) {
            salt = all_reduce_ops(g, a, di, counts[ci], salt);
            if (ci < 3 || dtypes[di] == DDP_F32) salt = broadcast_gather(g, a, dtypes[di], counts[ci], salt);
            if (ci < 3) salt = reduce_scatter(g, a, dtypes[di], counts[ci], salt);
        }
    }
    { /* several async all-reduces of library buffers in flight at once */
        enum { Q = 3 };
        size_t count = big_count(4), i;
        buffer b[Q];
        ddp_work *w[Q];
        for (k = 0; k < Q; k++) {
            b[k] = buf_get(g, a->mixed && rank % 2 == 1, count * 4, 0);
            tl_fill(value, b[k].p, count, rank, DDP_F32, DDP_SUM, salt + k);
            CHECK_OK(ddp_all_reduce_async(g, b[k].p, count, DDP_F32, DDP_SUM, &w[k]), g);
        }
        for (k = Q - 1; k >= 0; k--) CHECK_OK(ddp_wait(w[k]), g);
        for (k = 0; k < Q; k++) {
            for (i = 0; i < count; i += 97)
                CHECK(tl_load_value(b[k].p, i, DDP_F32) == tl_expected(value, n, i, DDP_F32, DDP_SUM, salt + k), "async %d", k);
            buf_put(g, &b[k]);
        }
    }
    for (k = 1; k <= rank % 4; k += 2) ddp_free(g, holes[k]);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- the reducer's buckets are library memory ---- */

static int reducer_worker(int rank, int n, void *arg) {
    static const size_t sizes[] = {300001, 5, 200003, 70001, 1000};
    enum { P = sizeof sizes / sizeof sizes[0] };
    ddp_group *g = init_watched();
    ddp_reducer *red;
    ddp_reducer_desc d;
    float *param[P], *grad[P];
    int idx[P], p, step, view = *(const int *)arg;
    size_t i;
    memset(&d, 0, sizeof d);
    d.gradient_as_bucket_view = view;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (p = 0; p < P; p++) {
        char name[16];
        param[p] = (float *)calloc(sizes[p], sizeof(float));
        grad[p] = view ? NULL : (float *)calloc(sizes[p], sizeof(float));
        CHECK(param[p] && (view || grad[p]), "out of memory");
        snprintf(name, sizeof name, "p%d", p);
        CHECK_OK(ddp_reducer_add_param(red, name, param[p], grad[p], sizes[p], DDP_F32, &idx[p]), g);
    }
    CHECK_OK(ddp_reducer_finalize(red), g);
    for (step = 0; step < 3; step++) {
        int before = copies();
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        for (p = P - 1; p >= 0; p--) {
            float *gr = (float *)ddp_reducer_grad(red, idx[p]);
            for (i = 0; i < sizes[p]; i++) gr[i] = (float)value(rank, i, DDP_F32, DDP_SUM, step * 10 + p);
            CHECK_OK(ddp_reducer_grad_ready(red, idx[p]), g);
        }
        CHECK_OK(ddp_reducer_end_backward(red), g);
        CHECK(copies() > before, "rank %d: step %d: no bucket all-reduce went single-copy", rank, step);
        for (p = 0; p < P; p++) {
            const float *gr = (const float *)ddp_reducer_grad(red, idx[p]);
            for (i = 0; i < sizes[p]; i++) {
                double want = 0;
                int r;
                for (r = 0; r < n; r++) want += (double)value(r, i, DDP_F32, DDP_SUM, step * 10 + p);
                want /= n;
                CHECK(fabs(gr[i] - want) <= 1e-6 * (1 + fabs(want)), "rank %d: step %d: param %d grad[%zu] = %g, expected %g", rank,
                      step, p, i, gr[i], want);
            }
        }
        CHECK_OK(ddp_reducer_zero_grad(red), g);
    }
    ddp_reducer_destroy(red);
    for (p = 0; p < P; p++) {
        free(param[p]);
        free(grad[p]);
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- the allocator itself ---- */

typedef struct churn_arg {
    ddp_group *g;
    uint64_t seed;
} churn_arg;

/* Allocate, fill, check and free blocks of random sizes: every new block is aligned and zero-filled,
   and no block overlaps another (each keeps its own pattern until it is freed). */
static void *churn(void *arg) {
    churn_arg *c = (churn_arg *)arg;
    enum { LIVE = 12 };
    unsigned char *live[LIVE] = {0}, tag[LIVE];
    size_t size[LIVE] = {0}, i;
    int it, k;
    for (it = 0; it < 300; it++) {
        k = (int)(tl_rand(&c->seed) % LIVE);
        if (live[k]) {
            for (i = 0; i < size[k]; i++)
                CHECK(live[k][i] == tag[k], "block %d byte %zu was overwritten", k, i);
            ddp_free(c->g, live[k]);
            live[k] = NULL;
            continue;
        }
        size[k] = (size_t)(tl_rand(&c->seed) % 3 == 0 ? tl_rand(&c->seed) % 300000 : tl_rand(&c->seed) % 5000);
        live[k] = (unsigned char *)ddp_alloc(c->g, size[k]);
        CHECK(live[k] != NULL, "ddp_alloc(%zu): %s", size[k], ddp_last_error(c->g));
        CHECK(((uintptr_t)live[k] & 63) == 0, "ddp_alloc returned %p, not 64-byte aligned", (void *)live[k]);
        for (i = 0; i < size[k]; i++) CHECK(live[k][i] == 0, "a new block of %zu bytes is not zero at byte %zu", size[k], i);
        tag[k] = (unsigned char)(1 + tl_rand(&c->seed) % 255);
        memset(live[k], tag[k], size[k]);
    }
    for (k = 0; k < LIVE; k++) ddp_free(c->g, live[k]);
    return NULL;
}

static void expect_free_error(ddp_group *g, void *p, const char *what) {
    ddp_free(g, p);
    CHECK(strstr(ddp_last_error(g), "not a live block from ddp_alloc") != NULL, "ddp_free(%s) left the message \"%s\"", what,
          ddp_last_error(g));
}

static int alloc_worker(int rank, int n, void *arg) {
    ddp_group *g, *sub = NULL;
    void *a, *b, *z0, *z1;
    int local = 1, k, *all = (int *)malloc(sizeof(int) * (size_t)n);
    size_t count = ((size_t)1 << 20) / 4 + 11, i;
    pthread_t th[3];
    churn_arg ca[3];
    buffer big;
    (void)arg;
    CHECK(all != NULL, "out of memory");
    /* no group */
    CHECK(ddp_alloc(NULL, 16) == NULL && strstr(ddp_last_error(NULL), "group is NULL"), "ddp_alloc(NULL): %s", ddp_last_error(NULL));
    g = init_watched();
    CHECK(ddp_alloc(g, SIZE_MAX) == NULL && strstr(ddp_last_error(g), "ddp_alloc"), "ddp_alloc(SIZE_MAX): %s", ddp_last_error(g));
    z0 = ddp_alloc(g, 0);
    z1 = ddp_alloc(g, 0);
    CHECK(z0 && z1 && z0 != z1, "ddp_alloc(0) must give distinct valid blocks (%p, %p)", z0, z1);
    ddp_free(g, NULL); /* a no-op */
    /* double free, a pointer into a block, malloc memory, a stack address: errors, no crash */
    a = ddp_alloc(g, 1000);
    CHECK(a != NULL, "%s", ddp_last_error(g));
    ddp_free(g, a);
    expect_free_error(g, a, "a freed block");
    b = ddp_alloc(g, 4096);
    CHECK(b != NULL, "%s", ddp_last_error(g));
    expect_free_error(g, (char *)b + 64, "a pointer inside a block");
    memset(b, 7, 4096); /* still the caller's */
    {
        void *m = malloc(100);
        expect_free_error(g, m, "malloc memory");
        free(m);
        expect_free_error(g, &local, "a stack address");
    }
    ddp_free(g, b);
    /* a block from another group is not this group's */
    for (k = 0; k < n; k++) all[k] = k;
    CHECK_OK(ddp_new_group(g, all, n, &sub), g);
    a = ddp_alloc(sub, 10000);
    CHECK(a != NULL, "%s", ddp_last_error(sub));
    expect_free_error(g, a, "another group's block");
    ddp_free(sub, a);
    CHECK_OK(ddp_destroy(sub), g);
    /* several threads allocate and free while this one runs collectives on a library buffer */
    for (k = 0; k < 3; k++) {
        ca[k].g = g;
        ca[k].seed = (uint64_t)(rank * 10 + k + 1);
        CHECK(pthread_create(&th[k], NULL, churn, &ca[k]) == 0, "pthread_create");
    }
    big = buf_get(g, 0, count * 4, 0);
    for (k = 0; k < 10; k++) {
        tl_fill(value, big.p, count, rank, DDP_F32, DDP_SUM, 1000 + k);
        CHECK_OK(ddp_all_reduce(g, big.p, count, DDP_F32, DDP_SUM), g);
        tl_check_reduced(value, big.p, count, DDP_F32, n, DDP_SUM, 1000 + k, "all_reduce beside allocating threads", rank);
    }
    for (k = 0; k < 3; k++) pthread_join(th[k], NULL);
    /* freed memory comes back zero-filled */
    memset(big.p, 0x5a, count * 4);
    buf_put(g, &big);
    big = buf_get(g, 0, count * 4, 0);
    for (i = 0; i < count * 4; i++) CHECK(((unsigned char *)big.p)[i] == 0, "a reused block is not zero at byte %zu", i);
    /* big, z0 and z1 are left for ddp_destroy to release */
    CHECK_OK(ddp_destroy(g), NULL);
    free(all);
    return 0;
}

/* ---- a tiny arena: blocks that do not fit are plain memory, and collectives on them stage ---- */

static int small_arena_worker(int rank, int n, void *arg) {
    ddp_group *g = init_watched();
    size_t fits = ((size_t)256 << 10) / 4 + 5, spills = ((size_t)2 << 20) / 4 + 5;
    buffer a = buf_get(g, 0, fits * 4, 0), b = buf_get(g, 0, spills * 4, 0);
    int before, arena_bytes = *(const int *)arg;
    tl_fill(value, a.p, fits, rank, DDP_F32, DDP_SUM, 1);
    tl_fill(value, b.p, spills, rank, DDP_F32, DDP_SUM, 2);
    before = copies();
    CHECK_OK(ddp_all_reduce(g, a.p, fits, DDP_F32, DDP_SUM), g);
    tl_check_reduced(value, a.p, fits, DDP_F32, n, DDP_SUM, 1, "all_reduce in a 1 MiB arena", rank);
    CHECK((copies() > before) == (arena_bytes > 0), "rank %d: a block that fits the arena went single-copy: %d", rank, copies() > before);
    before = copies();
    CHECK_OK(ddp_all_reduce(g, b.p, spills, DDP_F32, DDP_SUM), g);
    tl_check_reduced(value, b.p, spills, DDP_F32, n, DDP_SUM, 2, "all_reduce of a block bigger than the arena", rank);
    CHECK(copies() == before, "rank %d: a block bigger than the arena went single-copy", rank);
    buf_put(g, &a);
    buf_put(g, &b);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- a rank killed in the middle of single-copy all-reduces ---- */

typedef struct crash_arg {
    int victim;
    int pid_pipe; /* each rank writes its pid here */
} crash_arg;

static int crash_worker(int rank, int n, void *arg) {
    const crash_arg *c = (const crash_arg *)arg;
    ddp_group *g = init_watched();
    size_t count = ((size_t)4 << 20) / 4, it;
    buffer b = buf_get(g, 0, count * 4, 0);
    pid_t pid = getpid();
    double t0;
    ddp_result r = DDP_SUCCESS;
    (void)n;
    CHECK(write(c->pid_pipe, &pid, sizeof pid) == (ssize_t)sizeof pid, "write");
    tl_fill(value, b.p, count, rank, DDP_F32, DDP_SUM, 3);
    CHECK_OK(ddp_barrier(g), g);
    t0 = tl_now();
    for (it = 0; r == DDP_SUCCESS; it++) {
        if (rank == c->victim && tl_now() - t0 > 0.3) raise(SIGKILL); /* after some all-reduces, at any point of one */
        r = ddp_all_reduce(g, b.p, count, DDP_F32, DDP_MAX);
        CHECK(tl_now() - t0 < 60, "rank %d: still running after 60 s", rank);
    }
    CHECK(r == DDP_ERR_PEER_LOST, "rank %d: got %s (%s), expected DDP_ERR_PEER_LOST", rank, ddp_result_string(r), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "rank") != NULL, "the error does not name the lost rank: %s", ddp_last_error(g));
    ddp_destroy(g); /* broken: its result is the error */
    return 0;
}

/* Names in /dev/shm that a group of these pids made ("ddp.<rank 0's pid>.<hex>"). */
static int shm_leftovers(const pid_t *pids, int n) {
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    int found = 0, i;
    if (!d) return 0;
    while ((e = readdir(d)) != NULL)
        for (i = 0; i < n; i++) {
            char prefix[32];
            snprintf(prefix, sizeof prefix, "ddp.%d.", (int)pids[i]);
            if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
                fprintf(stderr, "left behind: /dev/shm/%s\n", e->d_name);
                found++;
            }
        }
    closedir(d);
    return found;
}

static void crash_case(int n, int victim) {
    int fds[2], codes[8], i;
    pid_t pids[8];
    crash_arg c;
    double t0 = tl_now();
    CHECK(pipe(fds) == 0, "pipe");
    c.victim = victim;
    c.pid_pipe = fds[1];
    tl_run_ranks_status(n, crash_worker, &c, 120, codes);
    close(fds[1]);
    for (i = 0; i < n; i++) CHECK(read(fds[0], &pids[i], sizeof pids[i]) == (ssize_t)sizeof pids[i], "rank pids");
    close(fds[0]);
    for (i = 0; i < n; i++)
        CHECK(codes[i] == (i == victim ? -SIGKILL : 0), "%d ranks, rank %d killed: rank %d ended with %d", n, victim, i, codes[i]);
    CHECK(shm_leftovers(pids, n) == 0, "a killed rank left shared memory behind in /dev/shm");
    printf("%d ranks, rank %d killed in single-copy all-reduces: the others fail with PEER_LOST, /dev/shm is clean (%.1f s)\n", n,
           victim, tl_now() - t0);
}

/* ---- /dev/shm too small (issue #25 item 7) ---- */

static char shm_warning[DDP__ERR_MAX]; /* rank 0's warning about shared memory, if any */

static void shm_warning_log(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)rank, (void)user;
    if (level == DDP_LOG_WARN && strstr(msg, "shared memory")) snprintf(shm_warning, sizeof shm_warning, "%s", msg);
    else if (level <= DDP_LOG_WARN) fprintf(stderr, "[ddp rank %d] %s\n", rank, msg);
}

/* At the default log level, rank 0 warns that the group stays on TCP, naming /dev/shm's size (1 MiB,
   mounted by small_dev_shm_case), the segment's (more than that) and both fixes; the group works. */
static int small_dev_shm_worker(int rank, int n, void *arg) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    double need = 0;
    int64_t x = rank + 1;
    const char *at;
    (void)arg;
    memset(&d, 0, sizeof d);
    d.log_fn = shm_warning_log; /* d.log_level 0: the default level */
    CHECK_OK(ddp_init(&d, &g), NULL);
    CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_I64, DDP_SUM), g);
    CHECK(x == (int64_t)n * (n + 1) / 2, "rank %d: all_reduce over TCP gave %lld", rank, (long long)x);
    if (rank == 0) {
        CHECK(strstr(shm_warning, "/dev/shm has 1.0 MiB free (of 1.0 MiB)"), "no warning naming /dev/shm's 1 MiB: \"%s\"", shm_warning);
        at = strstr(shm_warning, "needs a segment of ");
        CHECK(at && sscanf(at, "needs a segment of %lf MiB", &need) == 1 && need > 1.0,
              "the warning does not name a segment larger than /dev/shm: \"%s\"", shm_warning);
        CHECK(strstr(shm_warning, "--shm-size=") && strstr(shm_warning, "DDP_TRANSPORT=tcp") && strstr(shm_warning, "TCP"),
              "the warning does not say what to do: \"%s\"", shm_warning);
    } else {
        CHECK(shm_warning[0] == 0, "rank %d warned too: \"%s\"", rank, shm_warning);
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* A private mount namespace with a 1 MiB tmpfs on /dev/shm (a container's /dev/shm too small for the
   group's segment), made in a child so that this process keeps the real one. Needs root. */
static void small_dev_shm_case(void) {
    double t0 = tl_now();
    int st;
    pid_t p = fork();
    if (p == 0) {
        if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount("ddp-test-shm", "/dev/shm", "tmpfs", 0, "size=1m") != 0) {
            printf("SKIP-PART /dev/shm too small: cannot mount a small tmpfs on /dev/shm here (%s; needs root)\n", strerror(errno));
            exit(77);
        }
        unsetenv("DDP_LOG_LEVEL");
        exit(tl_run_ranks(2, small_dev_shm_worker, NULL, 60));
    }
    CHECK(p > 0 && waitpid(p, &st, 0) == p && WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 77),
          "/dev/shm too small: failed");
    if (WEXITSTATUS(st) == 0)
        printf("/dev/shm too small (1 MiB): rank 0 warns with the sizes and the fixes, the group runs on TCP (%.1f s)\n", tl_now() - t0);
    fflush(stdout);
}

static void run(int n, int (*fn)(int, int, void *), void *arg, const char *what) {
    double t0 = tl_now();
    CHECK(tl_run_ranks(n, fn, arg, 300) == 0, "%s, %d ranks: failed", what, n);
    printf("%s, %d ranks (%.1f s)\n", what, n, tl_now() - t0);
    fflush(stdout);
}

int main(int argc, char **argv) {
    static const int worlds[] = {2, 3, 4, 8};
    coll_arg all_lib, mixed, tcp;
    int i, zero = 0, one = 1, mib = 1 << 20, quick = getenv("TEST_QUICK") != NULL;
    unsetenv("DDP_TRANSPORT");
    small_dev_shm_case();
    if (argc > 1 && strcmp(argv[1], "small-dev-shm") == 0) return 0; /* test_shm_alloc small-dev-shm: only that */
    all_lib.mixed = 0;
    mixed.mixed = 1;
    all_lib.tcp = mixed.tcp = 0;
    tcp.mixed = 0;
    tcp.tcp = 1;
    setenv("DDP_TIMEOUT", "120", 0);
    unsetenv("DDP_TRANSPORT");
    unsetenv("DDP_SHM_ARENA_BYTES");
    for (i = 0; i < (quick ? 3 : 4); i++)
        run(worlds[i], coll_worker, &all_lib, "library buffers on every rank: every collective matches the serial reference, large ones single-copy");
    for (i = 1; i < (quick ? 2 : 4); i++) run(worlds[i], coll_worker, &mixed, "library buffers on even ranks only: same results, not single-copy through the arenas");
    run(2, reducer_worker, &zero, "reducer: bucket all-reduces single-copy, gradients averaged");
    run(3, reducer_worker, &one, "reducer with gradient_as_bucket_view: single-copy, gradients averaged");
    run(1, alloc_worker, NULL, "ddp_alloc/ddp_free alone");
    run(3, alloc_worker, NULL, "ddp_alloc/ddp_free over shared memory: alignment, zero fill, no overlap, threads, bad frees");
    setenv("DDP_SHM_ARENA_BYTES", "1048576", 1);
    run(2, small_arena_worker, &mib, "1 MiB arenas: a bigger block is plain memory and stages");
    setenv("DDP_SHM_ARENA_BYTES", "0", 1);
    run(2, small_arena_worker, &zero, "no arenas: every block is plain memory");
    unsetenv("DDP_SHM_ARENA_BYTES");
    setenv("DDP_TRANSPORT", "tcp", 1);
    run(2, alloc_worker, NULL, "ddp_alloc/ddp_free on a TCP group");
    run(3, coll_worker, &tcp, "library buffers on a TCP group");
    unsetenv("DDP_TRANSPORT");
    crash_case(2, 1);
    crash_case(3, 0);
    return 0;
}
