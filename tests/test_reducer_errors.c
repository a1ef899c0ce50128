/* Reducer errors: misuse is DDP_ERR_STATE naming the parameter; bad arguments (a duplicate name included)
   are DDP_ERR_INVALID_ARGUMENT; different models on different ranks are DDP_ERR_MISMATCH on every rank naming
   the first differing entry; a missing gradient without find_unused_parameters fails every rank quickly
   (no hang) with the parameter's name; finalize makes every rank hold rank 0's parameters and buffers. */
#include "testlib.h"

#define CHECK_ERR(call, g, code, needle)                                                                          \
    do {                                                                                                          \
        ddp_result e_ = (call);                                                                                   \
        CHECK(e_ == (code), "%s returned %s, expected %s (%s)", #call, ddp_result_string(e_), ddp_result_string(code), \
              ddp_last_error(g));                                                                                 \
        CHECK(strstr(ddp_last_error(g), (needle)) != NULL, "%s: the message does not mention \"%s\": %s", #call, (needle), \
              ddp_last_error(g));                                                                                 \
    } while (0)

static float w1[32], b1[4], w2[8], b2[2], gw1[32], gb1[4], gw2[8], gb2[2];

static ddp_reducer *small_model(ddp_group *g, const ddp_reducer_desc *d) {
    ddp_reducer *r;
    CHECK_OK(ddp_reducer_create(g, d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "fc1.weight", w1, gw1, 32, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_param(r, "fc1.bias", b1, gb1, 4, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_param(r, "fc2.weight", w2, gw2, 8, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_param(r, "fc2.bias", b2, gb2, 2, DDP_F32, NULL), g);
    return r;
}

/* ---- misuse on one rank ---- */
static int misuse_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_reducer *r;
    ddp_reducer_desc d;
    int i;
    float junk[4];
    (void)rank, (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);

    CHECK_ERR(ddp_reducer_create(NULL, &d, &r), NULL, DDP_ERR_INVALID_ARGUMENT, "group is NULL");
    d.comm_dtype = DDP_I32;
    CHECK_ERR(ddp_reducer_create(g, &d, &r), g, DDP_ERR_INVALID_ARGUMENT, "comm_dtype");
    d.comm_dtype = DDP_DTYPE_DEFAULT;

    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_ERR(ddp_reducer_finalize(r), g, DDP_ERR_STATE, "no parameters");
    CHECK_ERR(ddp_reducer_add_param(r, NULL, w1, gw1, 4, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT, "name");
    CHECK_ERR(ddp_reducer_add_param(r, "x", w1, gw1, 0, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT, "count is 0");
    CHECK_ERR(ddp_reducer_add_param(r, "steps", w1, gw1, 4, DDP_I64, NULL), g, DDP_ERR_INVALID_ARGUMENT, "add_buffer");
    CHECK_ERR(ddp_reducer_add_param(r, "nograd", w1, NULL, 4, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT, "nograd");
    CHECK_ERR(ddp_reducer_add_buffer(r, "buf", NULL, 4, DDP_F32), g, DDP_ERR_INVALID_ARGUMENT, "buf");
    CHECK_ERR(ddp_reducer_begin_backward(r), g, DDP_ERR_STATE, "finalize");
    /* a name registered twice, as parameter or buffer (issue #18): refused, naming it and the first one */
    CHECK_OK(ddp_reducer_add_param(r, "fc1.weight", w1, gw1, 4, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_buffer(r, "bn.mean", junk, 4, DDP_F32), g);
    CHECK_ERR(ddp_reducer_add_param(r, "fc1.weight", w2, gw2, 4, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT,
              "ddp_reducer_add_param(\"fc1.weight\"): the name is already registered, as parameter 0");
    CHECK_ERR(ddp_reducer_add_buffer(r, "fc1.weight", junk, 4, DDP_F32), g, DDP_ERR_INVALID_ARGUMENT,
              "already registered, as parameter 0");
    CHECK_ERR(ddp_reducer_add_param(r, "bn.mean", w2, gw2, 4, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT,
              "already registered, as buffer 0");
    ddp_reducer_destroy(r);

    d.gradient_as_bucket_view = 1;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_ERR(ddp_reducer_add_param(r, "fc1.weight", w1, gw1, 32, DDP_F32, NULL), g, DDP_ERR_INVALID_ARGUMENT, "grad = NULL");
    CHECK(ddp_reducer_grad(r, 0) == NULL, "a view before finalize");
    ddp_reducer_destroy(r);
    d.gradient_as_bucket_view = 0;

    r = small_model(g, &d);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_ERR(ddp_reducer_finalize(r), g, DDP_ERR_STATE, "already");
    CHECK_ERR(ddp_reducer_add_param(r, "late.weight", junk, junk, 4, DDP_F32, NULL), g, DDP_ERR_STATE, "late.weight");
    CHECK_ERR(ddp_reducer_grad_ready(r, 1), g, DDP_ERR_STATE, "fc1.bias");
    CHECK_ERR(ddp_reducer_end_backward(r), g, DDP_ERR_STATE, "begin_backward");
    CHECK(ddp_reducer_grad(r, 4) == NULL && ddp_reducer_grad(r, -1) == NULL && ddp_reducer_grad(r, 2) == (void *)gw2,
          "ddp_reducer_grad");
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    CHECK_ERR(ddp_reducer_begin_backward(r), g, DDP_ERR_STATE, "has not ended");
    CHECK_ERR(ddp_reducer_grad_ready(r, 4), g, DDP_ERR_INVALID_ARGUMENT, "index 4");
    CHECK_OK(ddp_reducer_grad_ready(r, 3), g);
    CHECK_ERR(ddp_reducer_grad_ready(r, 3), g, DDP_ERR_STATE, "\"fc2.bias\"): called twice");
    CHECK_ERR(ddp_reducer_set_sync(r, 0), g, DDP_ERR_STATE, "during a backward");
    CHECK_ERR(ddp_reducer_zero_grad(r), g, DDP_ERR_STATE, "during a backward");
    CHECK_ERR(ddp_reducer_broadcast_buffers(r), g, DDP_ERR_STATE, "during a backward");
    /* the mistakes above changed nothing: the pass still completes */
    for (i = 0; i < 3; i++) CHECK_OK(ddp_reducer_grad_ready(r, i), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    /* a missing gradient: named, and the reducer stops */
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 2), g);
    CHECK_ERR(ddp_reducer_end_backward(r), g, DDP_ERR_STATE, "\"fc1.bias\", \"fc2.bias\"");
    CHECK_ERR(ddp_reducer_begin_backward(r), g, DDP_ERR_STATE, "earlier error");
    ddp_reducer_destroy(r);

    /* with find_unused_parameters the same pass is fine */
    d.find_unused_parameters = 1;
    r = small_model(g, &d);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    ddp_reducer_destroy(r);
    ddp_reducer_destroy(NULL);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- a missing gradient on some ranks: every rank fails fast, naming it ----
   The rank that misses it breaks the group; the others fail in whatever call they are in by then (a rank
   can still be inside finalize's broadcast when a fast peer already reaches end_backward), so the test
   checks the first call that fails, and that one does. */
static ddp_result first_failure(ddp_result *first, ddp_result r) {
    if (r && !*first) *first = r;
    return *first;
}

static int missing_main(int rank, int n, void *arg) {
    int everyone = *(int *)arg, i;
    ddp_group *g;
    ddp_reducer *r;
    ddp_reducer_desc d;
    ddp_result first = DDP_SUCCESS;
    (void)n;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.first_bucket_bytes = 16; /* buckets {fc2.bias, fc2.weight}, {fc1.bias}, {fc1.weight} */
    d.bucket_cap_bytes = 16;
    r = small_model(g, &d);
    /* rank 1 (or every rank) forgets fc2.weight: it starts no bucket, the others start all three */
    if (!first_failure(&first, ddp_reducer_finalize(r)) && !first_failure(&first, ddp_reducer_begin_backward(r)))
        for (i = 3; i >= 0 && !first; i--)
            if (i != 2 || (rank != 1 && !everyone)) first_failure(&first, ddp_reducer_grad_ready(r, i));
    if (!first) first_failure(&first, ddp_reducer_end_backward(r));
    CHECK(first == DDP_ERR_STATE, "rank %d: the first failure is %s: %s", rank, ddp_result_string(first), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "\"fc2.weight\"") != NULL, "rank %d: %s", rank, ddp_last_error(g));
    ddp_reducer_destroy(r);
    ddp_destroy(g); /* broken: its result is the error */
    return 0;
}

/* ---- model mismatch ---- */
typedef struct mm_case {
    const char *what;
    int bad_rank;
    const char *needle1, *needle2;
} mm_case;

static const mm_case CASES[] = {
    {"count", 2, "entry #2: rank 0 has parameter \"fc2.weight\" (8 x f32), rank 2 has parameter \"fc2.weight\" (7 x f32)", ""},
    {"name", 1, "rank 0 has parameter \"fc1.bias\"", "rank 1 has parameter \"fc1.b\""},
    {"dtype", 1, "buffer \"bn.running_mean\" (3 x f32)", "(3 x f64)"},
    {"extra", 2, "entry #4: rank 0 has buffer \"bn.running_mean\"", "rank 2 has parameter \"extra.bias\""},
    {"fewer", 0, "entry #4: rank 0 has nothing", "rank 1 has buffer \"bn.running_mean\""},
    {"none", 1, "entry #0: rank 0 has parameter \"fc1.weight\" (32 x f32), rank 1 has nothing", ""},
};

static int mismatch_main(int rank, int n, void *arg) {
    ddp_group *g;
    size_t c;
    static double dbuf[3];
    static float fbuf[3];
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        const mm_case *k = &CASES[c];
        int bad = rank == k->bad_rank;
        ddp_reducer *r;
        CHECK_OK(ddp_reducer_create(g, NULL, &r), g);
        if (bad && !strcmp(k->what, "none")) { /* registers nothing at all: still no hang */
            CHECK_ERR(ddp_reducer_finalize(r), g, DDP_ERR_MISMATCH, k->needle1);
            ddp_reducer_destroy(r);
            continue;
        }
        CHECK_OK(ddp_reducer_add_param(r, "fc1.weight", w1, gw1, 32, DDP_F32, NULL), g);
        CHECK_OK(ddp_reducer_add_param(r, bad && !strcmp(k->what, "name") ? "fc1.b" : "fc1.bias", b1, gb1, 4, DDP_F32, NULL), g);
        CHECK_OK(ddp_reducer_add_param(r, "fc2.weight", w2, gw2, bad && !strcmp(k->what, "count") ? 7 : 8, DDP_F32, NULL), g);
        CHECK_OK(ddp_reducer_add_param(r, "fc2.bias", b2, gb2, 2, DDP_F32, NULL), g);
        if (bad && !strcmp(k->what, "extra")) CHECK_OK(ddp_reducer_add_param(r, "extra.bias", b2, gb2, 2, DDP_F32, NULL), g);
        if (!(bad && !strcmp(k->what, "fewer"))) {
            if (bad && !strcmp(k->what, "dtype"))
                CHECK_OK(ddp_reducer_add_buffer(r, "bn.running_mean", dbuf, 3, DDP_F64), g);
            else
                CHECK_OK(ddp_reducer_add_buffer(r, "bn.running_mean", fbuf, 3, DDP_F32), g);
        }
        CHECK_ERR(ddp_reducer_finalize(r), g, DDP_ERR_MISMATCH, k->needle1);
        CHECK(strstr(ddp_last_error(g), k->needle2) != NULL, "case %s, rank %d: %s", k->what, rank, ddp_last_error(g));
        ddp_reducer_destroy(r);
    }
    /* rank 2 runs a look-alike all_gather (5 x i64, the size of finalize's records) instead of finalize:
       the others say so */
    {
        ddp_reducer *r;
        int64_t mine[5] = {1, 2, 3, 4, 0}, all[15];
        if (rank == 2) {
            CHECK_OK(ddp_all_gather(g, mine, all, 5, DDP_I64), g);
        } else {
            CHECK_OK(ddp_reducer_create(g, NULL, &r), g);
            CHECK_OK(ddp_reducer_add_param(r, "fc1.weight", w1, gw1, 32, DDP_F32, NULL), g);
            CHECK_ERR(ddp_reducer_finalize(r), g, DDP_ERR_MISMATCH, "rank 2 is not in ddp_reducer_finalize");
            ddp_reducer_destroy(r);
        }
    }
    /* the group is still healthy after those errors */
    CHECK_OK(ddp_barrier(g), g);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- finalize and broadcast_buffers: rank 0's values everywhere ---- */
#define BIG (600 * 1024) /* 2.4 MB: broadcast in place; the small ones are packed together */
static int broadcast_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_reducer *r;
    float *big = (float *)malloc(BIG * sizeof(float)), *gbig = (float *)calloc(BIG, sizeof(float));
    float small[5], gsmall[5], mean[3];
    double var[2];
    int64_t steps[1];
    uint16_t half[3], ghalf[3];
    int i;
    (void)n, (void)arg;
    for (i = 0; i < BIG; i++) big[i] = (float)(i % 1000) + (float)rank * 1e4f;
    for (i = 0; i < 5; i++) small[i] = (float)(rank * 10 + i);
    for (i = 0; i < 3; i++) mean[i] = (float)(rank + i), half[i] = ddp_f32_to_f16((float)(rank * 3 + i));
    var[0] = rank, var[1] = -rank;
    steps[0] = 1000 + rank;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_reducer_create(g, NULL, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "small", small, gsmall, 5, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_param(r, "big", big, gbig, BIG, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_add_param(r, "half", half, ghalf, 3, DDP_F16, NULL), g);
    CHECK_OK(ddp_reducer_add_buffer(r, "mean", mean, 3, DDP_F32), g);
    CHECK_OK(ddp_reducer_add_buffer(r, "var", var, 2, DDP_F64), g);
    CHECK_OK(ddp_reducer_add_buffer(r, "num_batches_tracked", steps, 1, DDP_I64), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    for (i = 0; i < BIG; i++) CHECK(big[i] == (float)(i % 1000), "rank %d: big[%d] = %g", rank, i, (double)big[i]);
    for (i = 0; i < 5; i++) CHECK(small[i] == (float)i, "rank %d: small[%d] = %g", rank, i, (double)small[i]);
    for (i = 0; i < 3; i++) CHECK(mean[i] == (float)i && ddp_f16_to_f32(half[i]) == (float)i, "rank %d: mean/half", rank);
    CHECK(var[0] == 0 && var[1] == 0 && steps[0] == 1000, "rank %d: var/steps", rank);
    /* buffers drift (a local BatchNorm update); broadcast_buffers restores rank 0's */
    mean[1] = 100.0f + (float)rank;
    steps[0] = 2000 + rank;
    CHECK_OK(ddp_reducer_broadcast_buffers(r), g);
    CHECK(mean[1] == 100.0f && steps[0] == 2000, "rank %d: broadcast_buffers gave %g, %lld", rank, (double)mean[1],
          (long long)steps[0]);
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    free(big);
    free(gbig);
    return 0;
}

int main(void) {
    int zero = 0, one = 1;
    setenv("DDP_TIMEOUT", "120", 1); /* a pass below is never the timeout's doing: the runs get 60 s */
    setenv("DDP_LOG_LEVEL", "none", 1);
    CHECK(tl_run_ranks(1, misuse_main, NULL, 60) == 0, "misuse");
    CHECK(tl_run_ranks(3, missing_main, &zero, 60) == 0, "a gradient missing on rank 1");
    CHECK(tl_run_ranks(2, missing_main, &one, 60) == 0, "a gradient missing on every rank");
    CHECK(tl_run_ranks(3, mismatch_main, NULL, 60) == 0, "model mismatch");
    CHECK(tl_run_ranks(3, broadcast_main, NULL, 60) == 0, "broadcast at finalize");
    printf("test_reducer_errors: ok\n");
    return 0;
}
