/* Reducer buckets: PyTorch's assignment rule (reverse registration order, first bucket 1 MiB, then
   25 MiB, the crossing parameter stays, one dtype per bucket), the rebuild in rank 0's ready order after
   the first synchronised pass (views move and keep their gradients; not with find_unused_parameters;
   not before a synchronised pass), buckets starting as soon as they are complete and strictly in order
   (white-box: the test sees the reducer's state), f16/bf16 rounding: scaled in f32, rounded once, and
   the statistics' split of end_backward's wait into waiting for a late rank and moving data: a rank 200 ms
   late in backward is the others' straggler_wait (>= 150 ms, transfer < 100 ms) and last_ready_rank, and
   the late rank waits for nobody. */
#include "testlib.h"

typedef struct expect {
    int bucket;
    size_t offset;
} expect;

/* Register params of these counts and dtypes (world size 1), finalize, compare the layout. */
static void check_layout(ddp_group *g, const char *what, const ddp_reducer_desc *d, int n, const size_t *count,
                         const ddp_dtype *dtype, const expect *want, int nbuckets) {
    ddp_reducer *r;
    void *p[8];
    int i;
    ddp_reducer_statistics st;
    CHECK_OK(ddp_reducer_create(g, d, &r), g);
    for (i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        p[i] = calloc(count[i], ddp_dtype_size(dtype[i]));
        CHECK_OK(ddp_reducer_add_param(r, name, p[i], NULL, count[i], dtype[i], NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(r), g);
    for (i = 0; i < n; i++) {
        size_t off = 0;
        int b = ddp_reducer_param_bucket(r, i, &off);
        CHECK(b == want[i].bucket && off == want[i].offset, "%s: p%d is in bucket %d at %zu, expected bucket %d at %zu", what,
              i, b, off, want[i].bucket, want[i].offset);
        CHECK(r->L.buckets[b].dtype == dtype[i], "%s: bucket %d mixes dtypes", what, b);
        CHECK((char *)ddp_reducer_grad(r, i) == (char *)r->L.buckets[b].storage + off * ddp_dtype_size(dtype[i]),
              "%s: the view of p%d is not its bucket slice", what, i);
    }
    CHECK_OK(ddp_reducer_get_statistics(r, &st), g);
    CHECK(st.buckets == nbuckets, "%s: %d buckets, expected %d", what, st.buckets, nbuckets);
    ddp_reducer_destroy(r);
    for (i = 0; i < n; i++) free(p[i]);
}

static void layout_rules(ddp_group *g) {
    ddp_reducer_desc d;
    memset(&d, 0, sizeof d);
    d.gradient_as_bucket_view = 1; /* saves the test a copy of the 25 MB gradient */
    {   /* defaults. Reverse walk: p5 p4 | p3 p2 p1 | p0 (p4 + p5 = 1 MiB exactly; the second bucket crosses
           25 MiB = 26214400 bytes at p1: 400 + 1048576 + 25168000 = 26216976) */
        size_t count[6] = {10, 6292000, 262144, 100, 262143, 1};
        ddp_dtype t[6] = {DDP_F32, DDP_F32, DDP_F32, DDP_F32, DDP_F32, DDP_F32};
        expect want[6] = {{2, 0}, {1, 262244}, {1, 100}, {1, 0}, {0, 1}, {0, 0}};
        check_layout(g, "defaults, limits reached", &d, 6, count, t, want, 3);
    }
    {   /* 4 bytes less each: the first bucket takes p3, and p0 joins the second */
        size_t count[6] = {10, 6291000, 262144, 100, 262142, 1};
        ddp_dtype t[6] = {DDP_F32, DDP_F32, DDP_F32, DDP_F32, DDP_F32, DDP_F32};
        expect want[6] = {{1, 6291000 + 262144}, {1, 262144}, {1, 0}, {0, 262143}, {0, 1}, {0, 0}};
        check_layout(g, "defaults, limits not reached", &d, 6, count, t, want, 2);
    }
    {   /* two dtypes, first = 100 B, cap = 200 B. Reverse walk: f (f64, 160 B: closes f64's first bucket),
           e (f32, 120 B: closes f32's first), d (f64) opens bucket 2, c (f32) opens bucket 3, b joins 2,
           a joins 3; neither reaches 200 B */
        size_t count[6] = {10, 10, 20, 5, 30, 20};
        ddp_dtype t[6] = {DDP_F32, DDP_F64, DDP_F32, DDP_F64, DDP_F32, DDP_F64};
        expect want[6] = {{3, 20}, {2, 5}, {3, 0}, {2, 0}, {1, 0}, {0, 0}};
        d.first_bucket_bytes = 100;
        d.bucket_cap_bytes = 200;
        check_layout(g, "two dtypes", &d, 6, count, t, want, 4);
    }
}

static int single_main(int rank, int n, void *arg) {
    ddp_group *g;
    (void)rank, (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    layout_rules(g);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- rebuild, order, overlap: 2 ranks, 6 f32 parameters of 100 40 120 20 80 60 bytes,
   first bucket 100 B, cap 150 B.
   initial (reverse walk): {p5 p4} {p3 p2 p1} {p0}
   rank 0's ready order p0 p1 p2 p3 p4 p5 gives {p0} {p1 p2} {p3 p4 p5}; rank 1 reports p5 p3 p1 p4 p2 p0. */
static const size_t SIZES[6] = {25, 10, 30, 5, 20, 15};
static const expect INITIAL[6] = {{2, 0}, {1, 35}, {1, 5}, {1, 0}, {0, 15}, {0, 0}};
static const expect REBUILT[6] = {{0, 0}, {1, 0}, {1, 10}, {2, 0}, {2, 5}, {2, 25}};
static const int ORDER0[6] = {0, 1, 2, 3, 4, 5}, ORDER1[6] = {5, 3, 1, 4, 2, 0};

static void check_expect(ddp_reducer *r, const expect *want, const char *what, int rank) {
    int i;
    for (i = 0; i < 6; i++) {
        size_t off = 0;
        int b = ddp_reducer_param_bucket(r, i, &off);
        CHECK(b == want[i].bucket && off == want[i].offset, "%s, rank %d: p%d in bucket %d at %zu, expected %d at %zu", what,
              rank, i, b, off, want[i].bucket, want[i].offset);
    }
}

/* One synchronised pass: rank-dependent gradients in this rank's order; checks the average. */
static void pass(ddp_reducer *r, int rank, int sync, const char *what) {
    const int *order = rank == 0 ? ORDER0 : ORDER1;
    int j, k;
    size_t i;
    CHECK_OK(ddp_reducer_set_sync(r, sync), NULL);
    CHECK_OK(ddp_reducer_begin_backward(r), NULL);
    for (j = 0; j < 6; j++) {
        float *gp = (float *)ddp_reducer_grad(r, order[j]);
        for (i = 0; i < SIZES[order[j]]; i++) gp[i] = (float)((rank + 1) * (order[j] + 1)) + (float)i;
        CHECK_OK(ddp_reducer_grad_ready(r, order[j]), NULL);
    }
    CHECK_OK(ddp_reducer_end_backward(r), NULL);
    if (!sync) return;
    for (k = 0; k < 6; k++) {
        float *gp = (float *)ddp_reducer_grad(r, k);
        for (i = 0; i < SIZES[k]; i++)
            CHECK(gp[i] == 1.5f * (float)(k + 1) + (float)i, "%s, rank %d: p%d[%zu] = %g, expected %g", what, rank, k, i,
                  (double)gp[i], 1.5 * (k + 1) + (double)i);
    }
}

static ddp_reducer *six(ddp_group *g, int view, int find_unused, float **params, float **grads) {
    ddp_reducer_desc d;
    ddp_reducer *r;
    int k;
    memset(&d, 0, sizeof d);
    d.first_bucket_bytes = 100;
    d.bucket_cap_bytes = 150;
    d.gradient_as_bucket_view = view;
    d.find_unused_parameters = find_unused;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    for (k = 0; k < 6; k++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", k);
        params[k] = (float *)calloc(SIZES[k], sizeof(float));
        grads[k] = view ? NULL : (float *)calloc(SIZES[k], sizeof(float));
        CHECK_OK(ddp_reducer_add_param(r, name, params[k], grads[k], SIZES[k], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(r), g);
    return r;
}

static void six_free(ddp_reducer *r, float **params, float **grads) {
    int k;
    ddp_reducer_destroy(r);
    for (k = 0; k < 6; k++) free(params[k]), free(grads[k]);
}

static void rebuild_tests(ddp_group *g, int rank) {
    float *P[6], *G[6];
    ddp_reducer *r;
    ddp_reducer_statistics st;
    int view;
    for (view = 0; view <= 1; view++) {
        const char *what = view ? "bucket view" : "plain";
        void *before;
        r = six(g, view, 0, P, G);
        check_expect(r, INITIAL, what, rank);
        pass(r, rank, 0, what); /* a no_sync pass: records nothing */
        CHECK_OK(ddp_reducer_get_statistics(r, &st), g);
        CHECK(!st.rebuilt, "%s: rebuilt after a no_sync pass", what);
        check_expect(r, INITIAL, what, rank);
        before = ddp_reducer_grad(r, 5);
        pass(r, rank, 1, what); /* checks the values at the (moved) gradients */
        check_expect(r, REBUILT, what, rank);
        CHECK_OK(ddp_reducer_get_statistics(r, &st), g);
        CHECK(st.rebuilt && st.buckets == 3, "%s: rebuilt %d, %d buckets", what, st.rebuilt, st.buckets);
        CHECK(view ? ddp_reducer_grad(r, 5) != before : ddp_reducer_grad(r, 5) == (void *)G[5], "%s: gradient pointer", what);
        pass(r, rank, 1, what);
        check_expect(r, REBUILT, what, rank);
        six_free(r, P, G);
    }
    /* find_unused_parameters: never rebuilt */
    r = six(g, 0, 1, P, G);
    pass(r, rank, 1, "find_unused");
    pass(r, rank, 1, "find_unused");
    check_expect(r, INITIAL, "find_unused", rank);
    CHECK_OK(ddp_reducer_get_statistics(r, &st), g);
    CHECK(!st.rebuilt, "find_unused: rebuilt");
    six_free(r, P, G);
}

/* Buckets start as soon as they are complete, and in order (white-box). */
static void overlap_test(ddp_group *g, int rank) {
    float *P[6], *G[6];
    ddp_reducer *r = six(g, 0, 0, P, G);
    ddp__bucket *b;
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    b = r->L.buckets;
    CHECK_OK(ddp_reducer_grad_ready(r, 3), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 2), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 1), g);
    CHECK(!b[0].work && !b[1].work && r->next_bucket == 0, "rank %d: bucket 1 is complete but must wait for bucket 0", rank);
    CHECK_OK(ddp_reducer_grad_ready(r, 5), g);
    CHECK(!b[0].work, "rank %d: bucket 0 started before it was complete", rank);
    CHECK_OK(ddp_reducer_grad_ready(r, 4), g);
    CHECK(b[0].work && b[1].work && !b[2].work && r->next_bucket == 2, "rank %d: buckets 0 and 1 should be in flight", rank);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK(b[2].work && r->next_bucket == 3, "rank %d: bucket 2 should be in flight before end_backward", rank);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    b = r->L.buckets; /* the first pass rebuilt them */
    CHECK(!b[0].work && !b[1].work && !b[2].work, "rank %d: end_backward left work behind", rank);
    six_free(r, P, G);
}

/* f32 gradients, bf16 communication, 2 ranks: each rank rounds x/2 to bf16 once; the ring adds the two
   in f32 and rounds to bf16; the result comes back as f32. */
static void bf16_path(ddp_group *g, int rank) {
    enum { N = 257 };
    static float w[N], gr[N];
    float x[2][N];
    ddp_reducer_desc d;
    ddp_reducer *r;
    uint64_t s = 99;
    int i, k;
    memset(&d, 0, sizeof d);
    d.comm_dtype = DDP_BF16;
    for (k = 0; k < 2; k++)
        for (i = 0; i < N; i++) x[k][i] = (float)((double)(tl_rand(&s) >> 11) / 9007199254740992.0 * 6.0 - 3.0);
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gr, N, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    memcpy(gr, x[rank], sizeof gr);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    for (i = 0; i < N; i++) {
        float want = tl_ref_bf16(tl_ref_bf16(x[0][i] * 0.5f) + tl_ref_bf16(x[1][i] * 0.5f));
        CHECK(gr[i] == want, "rank %d: bf16 result [%d] = %.9g, expected %.9g", rank, i, (double)gr[i], (double)want);
    }
    ddp_reducer_destroy(r);
}

/* Statistics tell waiting for a slower rank from moving data: the rank whose backward is 200 ms late
   (it sleeps before its gradients are ready) makes the other's end_backward wait; that wait is
   straggler_wait (>= 150 ms) naming the late rank, its transfer part stays small; the late rank itself
   waits for nobody. Generous bounds: the numbers are only checked to be on the right side. */
static void straggler_test(ddp_group *g, int rank) {
    enum { N = 4096 };
    static float w[N], gr[N];
    ddp_reducer *r;
    ddp_reducer_statistics st;
    double total = 0;
    int step, late;
    memset(&st, 0, sizeof st);
    CHECK_OK(ddp_reducer_create(g, NULL, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gr, N, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    for (step = 0; step < 4; step++) {
        late = step < 2 ? 1 : 0; /* rank 1 is late twice, then rank 0 */
        CHECK_OK(ddp_reducer_begin_backward(r), g);
        if (rank == late) usleep(200000);
        CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
        CHECK_OK(ddp_reducer_end_backward(r), g);
        CHECK_OK(ddp_reducer_get_statistics(r, &st), g);
        CHECK(st.last_ready_rank == late, "rank %d step %d: last_ready_rank %d, rank %d was late", rank, step, st.last_ready_rank, late);
        CHECK(fabs(st.straggler_wait_seconds + st.transfer_seconds - st.wait_seconds) < 1e-9, "rank %d: %g + %g != wait %g", rank,
              st.straggler_wait_seconds, st.transfer_seconds, st.wait_seconds);
        if (rank == late)
            CHECK(st.straggler_wait_seconds < 0.05, "rank %d step %d (the late one): straggler wait %.3f s", rank, step,
                  st.straggler_wait_seconds);
        else
            CHECK(st.straggler_wait_seconds >= 0.15 && st.transfer_seconds < 0.1, "rank %d step %d: waited %.3f s for rank %d, "
                  "transfer %.3f s (wait %.3f s)", rank, step, st.straggler_wait_seconds, late, st.transfer_seconds, st.wait_seconds);
        total += st.straggler_wait_seconds;
        if (rank == 0 && step == 0)
            printf("straggler: rank 0 waited %.1f ms for rank 1 (straggler_wait), %.3f ms transfer, of %.1f ms in end_backward\n",
                   st.straggler_wait_seconds * 1e3, st.transfer_seconds * 1e3, st.wait_seconds * 1e3);
    }
    CHECK(fabs(st.total_straggler_wait_seconds - total) < 1e-9, "rank %d: total straggler wait %g, sum %g", rank,
          st.total_straggler_wait_seconds, total);
    ddp_reducer_destroy(r);
}

static int pair_main(int rank, int n, void *arg) {
    ddp_group *g;
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    rebuild_tests(g, rank);
    overlap_test(g, rank);
    bf16_path(g, rank);
    straggler_test(g, rank);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Scaling an f16 gradient by 1/3 into an f16 bucket: f32 math, one rounding (not f16 arithmetic). */
static void rounding_unit(void) {
    enum { N = 4096 };
    static uint16_t x[N], y[N];
    int i, naive_differs = 0;
    float third = (float)(1.0 / 3.0);
    for (i = 0; i < N; i++) /* finite normal f16 values of both signs across the range */
        x[i] = (uint16_t)((1024 + (i * 7) % 29696) | (i & 1 ? 0x8000 : 0));
    ddp__host_copy_in_scaled(NULL, y, DDP_F16, x, DDP_F16, N, 1.0 / 3.0);
    for (i = 0; i < N; i++) {
        float v = tl_decode_f16(x[i]);
        float want = tl_ref_f16(v * third);
        float naive = tl_ref_f16(v * tl_ref_f16(third));
        CHECK(tl_decode_f16(y[i]) == want, "f16 %g / 3 = %g, expected %g", (double)v, (double)tl_decode_f16(y[i]), (double)want);
        naive_differs += naive != want;
    }
    CHECK(naive_differs > 0, "the check cannot tell f32 scaling from f16 arithmetic");
    ddp__host_copy_in_scaled(NULL, y, DDP_BF16, x, DDP_BF16, N, 0.25); /* bf16 in place-style, any bits */
    for (i = 0; i < N; i++)
        CHECK(tl_decode_bf16(y[i]) == tl_ref_bf16(tl_decode_bf16(x[i]) * 0.25f) || tl_decode_bf16(x[i]) != tl_decode_bf16(x[i]),
              "bf16 scaling at %d", i);
}

int main(void) {
    rounding_unit();
    CHECK(tl_run_ranks(1, single_main, NULL, 120) == 0, "layout rules");
    CHECK(tl_run_ranks(2, pair_main, NULL, 120) == 0, "rebuild / overlap / bf16 / straggler statistics");
    printf("test_reducer_buckets: ok\n");
    return 0;
}
