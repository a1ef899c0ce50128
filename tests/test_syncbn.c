/* SyncBatchNorm without a group (plain BatchNorm): forward/backward in both layouts, every spatial
   size class, affine and running stats on/off, momentum and its cumulative form, eval mode, in-place
   use, and argument errors. Compared with the serial f64 reference in test_syncbn_ref.h. The counter
   num_batches_tracked at the program's int64_t (desc.num_batches_tracked): it advances there, and a
   checkpoint of it (a 0-d I64 tensor) restores a fresh layer that goes on with the same momentum=None
   factor. */
#include "testlib.h"
#include "test_syncbn_ref.h"

#define TOL 1e-5

typedef struct shape {
    int64_t N, C, S;
    int channels_last, affine, track;
    double momentum; /* as in the descriptor: 0 = default, < 0 = cumulative */
} shape;

static double worst; /* the largest relative error seen, printed at the end */

static void check_rel(const char *what, const shape *s, int step, const float *a, const double *b, int64_t n) {
    double e = ref_rel_err_f32(a, b, n);
    if (e > worst) worst = e;
    CHECK(e <= TOL, "%s: N=%lld C=%lld S=%lld cl=%d affine=%d track=%d step %d: relative error %.3g", what,
          (long long)s->N, (long long)s->C, (long long)s->S, s->channels_last, s->affine, s->track, step, e);
}

/* Three training steps on fresh data, then an eval forward + backward; everything against ref_bn. */
static void run_shape(const shape *s, uint64_t seed) {
    const int64_t n = s->N * s->S * s->C;
    float *x = (float *)malloc(sizeof(float) * (size_t)(n + 1)), *dy = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    float *y = (float *)malloc(sizeof(float) * (size_t)(n + 1)), *dx = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    double *ry = (double *)malloc(sizeof(double) * (size_t)(n + 1)), *rdx = (double *)malloc(sizeof(double) * (size_t)(n + 1));
    float w[64], b[64], rm[64], rv[64], gw[64], gb[64];
    double rrm[64], rrv[64], rgw[64], rgb[64];
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    ref_bn ref;
    uint64_t st = seed;
    int step, c;
    CHECK(s->C <= 64, "test shape too wide");
    ref_fill(w, s->C, &st, 1.0f, 0.5f);
    ref_fill(b, s->C, &st, 0.0f, 0.5f);
    ref_fill(rm, s->C, &st, 0.0f, 0.2f);
    ref_fill(rv, s->C, &st, 1.0f, 0.2f);
    for (c = 0; c < s->C; c++) {
        rrm[c] = rm[c];
        rrv[c] = rv[c];
    }
    memset(&d, 0, sizeof d);
    d.num_features = (int)s->C;
    d.momentum = s->momentum;
    d.channels_last = s->channels_last;
    d.weight = s->affine ? w : NULL;
    d.bias = s->affine ? b : NULL;
    d.running_mean = s->track ? rm : NULL;
    d.running_var = s->track ? rv : NULL;
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    memset(&ref, 0, sizeof ref);
    ref.C = (int)s->C;
    ref.channels_last = s->channels_last;
    ref.eps = 1e-5;
    ref.momentum = s->momentum == 0 ? 0.1 : s->momentum;
    ref.weight = d.weight;
    ref.bias = d.bias;
    ref.track = s->track;
    ref.running_mean = rrm;
    ref.running_var = rrv;
    for (step = 0; step < 3; step++) {
        ref_fill(x, n, &st, 2.0f * (float)step - 1.0f, 1.5f);
        ref_fill(dy, n, &st, 0.1f, 1.0f);
        memset(gw, 0, sizeof gw);
        memset(gb, 0, sizeof gb);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, s->N, s->S, 1), NULL);
        CHECK_OK(ddp_syncbn_backward(bn, x, dy, dx, gw, gb, s->N, s->S), NULL);
        ref_bn_train(&ref, x, dy, s->N, s->S, ry, rdx, rgw, rgb);
        check_rel("y", s, step, y, ry, n);
        check_rel("dx", s, step, dx, rdx, n);
        check_rel("grad_weight", s, step, gw, rgw, s->C);
        check_rel("grad_bias", s, step, gb, rgb, s->C);
        if (s->track) {
            check_rel("running_mean", s, step, rm, rrm, s->C);
            check_rel("running_var", s, step, rv, rrv, s->C);
        }
        CHECK(ddp_syncbn_num_batches_tracked(bn) == ref.nbt, "num_batches_tracked %lld, expected %lld",
              (long long)ddp_syncbn_num_batches_tracked(bn), (long long)ref.nbt);
    }
    if (s->track) { /* eval: y = (x - rm) / sqrt(rv + eps) * w + b; dx = dy * w / sqrt(rv + eps) */
        int64_t i, k;
        memset(gw, 0, sizeof gw);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, s->N, s->S, 0), NULL);
        CHECK_OK(ddp_syncbn_backward(bn, x, dy, dx, gw, NULL, s->N, s->S), NULL);
        for (c = 0; c < s->C; c++) rgw[c] = 0;
        for (i = 0; i < s->N; i++)
            for (c = 0; c < s->C; c++)
                for (k = 0; k < s->S; k++) {
                    int64_t j = ref_index(s->channels_last, i, c, k, s->C, s->S);
                    double is = 1.0 / sqrt((double)rv[c] + 1e-5), wc = s->affine ? w[c] : 1.0;
                    ry[j] = ((double)x[j] - rm[c]) * is * wc + (s->affine ? b[c] : 0.0);
                    rdx[j] = dy[j] * is * wc;
                    rgw[c] += dy[j] * ((double)x[j] - rm[c]) * is;
                }
        check_rel("eval y", s, 3, y, ry, n);
        check_rel("eval dx", s, 3, dx, rdx, n);
        check_rel("eval grad_weight", s, 3, gw, rgw, s->C);
        CHECK(ddp_syncbn_num_batches_tracked(bn) == 3, "eval changed num_batches_tracked");
    } else { /* without running stats, eval uses the batch's statistics (as torch) and tracks nothing */
        ref_bn_train(&ref, x, dy, s->N, s->S, ry, rdx, rgw, rgb);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, s->N, s->S, 0), NULL);
        CHECK_OK(ddp_syncbn_backward(bn, x, dy, dx, NULL, NULL, s->N, s->S), NULL);
        check_rel("eval (no running stats) y", s, 3, y, ry, n);
        check_rel("eval (no running stats) dx", s, 3, dx, rdx, n);
        CHECK(ddp_syncbn_num_batches_tracked(bn) == 0, "num_batches_tracked without running stats");
    }
    ddp_syncbn_destroy(bn);
    free(x);
    free(dy);
    free(y);
    free(dx);
    free(ry);
    free(rdx);
}

/* y may be x and dx may be dy. */
static void test_in_place(void) {
    enum { N = 6, C = 5, S = 11 };
    float x[N * C * S], y[N * C * S], dy[N * C * S], dx[N * C * S];
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    uint64_t st = 7;
    int i;
    memset(&d, 0, sizeof d);
    d.num_features = C;
    ref_fill(x, N * C * S, &st, 0.5f, 2.0f);
    ref_fill(dy, N * C * S, &st, 0.0f, 1.0f);
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    CHECK_OK(ddp_syncbn_forward(bn, x, y, N, S, 1), NULL);
    CHECK_OK(ddp_syncbn_backward(bn, x, dy, dx, NULL, NULL, N, S), NULL);
    CHECK_OK(ddp_syncbn_backward(bn, x, dy, dy, NULL, NULL, N, S), NULL);
    for (i = 0; i < N * C * S; i++) CHECK(dy[i] == dx[i], "in-place backward differs at %d", i);
    CHECK_OK(ddp_syncbn_forward(bn, x, x, N, S, 1), NULL);
    for (i = 0; i < N * C * S; i++) CHECK(x[i] == y[i], "in-place forward differs at %d", i);
    ddp_syncbn_destroy(bn);
}

/* Numerically hard data: a large common offset with a small spread (one-pass variance must not cancel). */
static void test_offset(void) {
    enum { N = 64, C = 3, S = 100 };
    static float x[N * C * S], y[N * C * S];
    double vy[N * C * S], mean, var, invstd;
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    float rm[C] = {0, 0, 0}, rv[C] = {1, 1, 1};
    uint64_t st = 99;
    int c, i, k;
    memset(&d, 0, sizeof d);
    d.num_features = C;
    d.running_mean = rm;
    d.running_var = rv;
    d.momentum = 1.0;
    ref_fill(x, N * C * S, &st, 300.0f, 1.0f);
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    CHECK_OK(ddp_syncbn_forward(bn, x, y, N, S, 1), NULL);
    for (c = 0; c < C; c++) {
        mean = var = 0;
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) mean += x[(i * C + c) * S + k];
        mean /= N * S;
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) var += (x[(i * C + c) * S + k] - mean) * (x[(i * C + c) * S + k] - mean);
        CHECK(fabs(rv[c] - var / (N * S - 1)) <= 1e-6 * var / (N * S - 1), "running_var %.9g vs %.9g", rv[c],
              var / (N * S - 1));
        CHECK(fabs(rm[c] - mean) <= 1e-6 * fabs(mean), "running_mean %.9g vs %.9g", rm[c], mean);
        invstd = 1 / sqrt(var / (N * S) + 1e-5);
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) vy[(i * C + c) * S + k] = (x[(i * C + c) * S + k] - mean) * invstd;
    }
    /* x carries f32 rounding of ~300, so y can only be as good as (x - mean) in f32 (as in torch) */
    CHECK(ref_rel_err_f32(y, vy, N * C * S) < 1e-4, "offset data: y relative error %.3g",
          ref_rel_err_f32(y, vy, N * C * S));
    ddp_syncbn_destroy(bn);
}

static void expect_error(ddp_result got, ddp_result want, const char *needle, const char *what) {
    CHECK(got == want, "%s: got %s, expected %s", what, ddp_result_string(got), ddp_result_string(want));
    CHECK(strstr(ddp_last_error(NULL), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, ddp_last_error(NULL),
          needle);
}

static void test_errors(void) {
    ddp_syncbn_desc d;
    ddp_syncbn *bn = (ddp_syncbn *)&d;
    float rm[2] = {0.5f, -0.5f}, rv[2] = {2, 3}, x[4] = {1, 2, 3, 4}, y[4], gw[2] = {5, 5}, gb[2] = {6, 6};
    memset(&d, 0, sizeof d);
    expect_error(ddp_syncbn_create(NULL, NULL, &bn), DDP_ERR_INVALID_ARGUMENT, "descriptor", "NULL desc");
    CHECK(bn == NULL, "create must clear *out on error");
    expect_error(ddp_syncbn_create(NULL, &d, &bn), DDP_ERR_INVALID_ARGUMENT, "num_features", "0 features");
    d.num_features = 2;
    d.eps = -1;
    expect_error(ddp_syncbn_create(NULL, &d, &bn), DDP_ERR_INVALID_ARGUMENT, "eps", "negative eps");
    d.eps = 0;
    d.momentum = 1.5;
    expect_error(ddp_syncbn_create(NULL, &d, &bn), DDP_ERR_INVALID_ARGUMENT, "momentum", "momentum > 1");
    d.momentum = 0;
    d.running_mean = rm;
    expect_error(ddp_syncbn_create(NULL, &d, &bn), DDP_ERR_INVALID_ARGUMENT, "running_var", "half running stats");
    d.running_var = rv;
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    expect_error(ddp_syncbn_backward(bn, x, x, y, NULL, NULL, 2, 1), DDP_ERR_STATE, "ddp_syncbn_forward first",
                 "backward before forward");
    expect_error(ddp_syncbn_forward(bn, x, y, -1, 1, 1), DDP_ERR_INVALID_ARGUMENT, "batch=-1", "negative batch");
    expect_error(ddp_syncbn_forward(bn, NULL, y, 2, 1, 1), DDP_ERR_INVALID_ARGUMENT, "x is NULL", "NULL x");
    expect_error(ddp_syncbn_forward(bn, x, y, INT64_MAX / 2, 3, 1), DDP_ERR_INVALID_ARGUMENT, "overflow", "overflow");
    /* one value per channel: torch raises "Expected more than 1 value per channel when training" */
    expect_error(ddp_syncbn_forward(bn, x, y, 1, 1, 1), DDP_ERR_INVALID_ARGUMENT, "more than 1 value per channel",
                 "count 1");
    CHECK(rm[0] == 0.5f && rv[1] == 3 && ddp_syncbn_num_batches_tracked(bn) == 0, "a failed forward changed state");
    expect_error(ddp_syncbn_backward(bn, x, x, y, NULL, NULL, 1, 1), DDP_ERR_STATE, "failed forward",
                 "backward after a failed forward");
    /* an empty batch: as torch's BatchNorm, running stats unchanged and num_batches_tracked counted */
    CHECK_OK(ddp_syncbn_forward(bn, NULL, NULL, 0, 1, 1), NULL);
    CHECK(rm[0] == 0.5f && rv[1] == 3 && ddp_syncbn_num_batches_tracked(bn) == 1, "empty batch: wrong state");
    CHECK_OK(ddp_syncbn_backward(bn, NULL, NULL, NULL, gw, gb, 0, 1), NULL);
    CHECK(gw[0] == 5 && gw[1] == 5 && gb[0] == 6 && gb[1] == 6, "empty batch: gradients must stay");
    CHECK_OK(ddp_syncbn_forward(bn, x, y, 2, 1, 1), NULL);
    expect_error(ddp_syncbn_backward(bn, x, x, y, NULL, NULL, 1, 2), DDP_ERR_INVALID_ARGUMENT, "last forward had",
                 "backward with another shape");
    CHECK_OK(ddp_syncbn_forward(bn, NULL, NULL, 0, 1, 0), NULL); /* eval of an empty batch is fine */
    CHECK_OK(ddp_syncbn_backward(bn, NULL, NULL, NULL, NULL, NULL, 0, 1), NULL);
    expect_error(ddp_syncbn_set_num_batches_tracked(bn, -1), DDP_ERR_INVALID_ARGUMENT, "value is -1", "negative nbt");
    CHECK_OK(ddp_syncbn_set_num_batches_tracked(bn, 41), NULL);
    CHECK(ddp_syncbn_num_batches_tracked(bn) == 41, "set_num_batches_tracked");
    ddp_syncbn_destroy(bn);
    ddp_syncbn_destroy(NULL);
    CHECK(ddp_syncbn_num_batches_tracked(NULL) == 0, "NULL layer");
}

/* momentum=None: after k steps the running stats are the plain average of the k batch statistics. */
static void test_cumulative(void) {
    enum { N = 4, C = 2, S = 3 };
    float x[N * C * S], y[N * C * S], rm[C] = {5, 5}, rv[C] = {7, 7};
    double sum_mean[C] = {0, 0}, sum_var[C] = {0, 0};
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    uint64_t st = 3;
    int step, c, i;
    memset(&d, 0, sizeof d);
    d.num_features = C;
    d.momentum = -1;
    d.running_mean = rm;
    d.running_var = rv;
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    for (step = 1; step <= 5; step++) {
        ref_fill(x, N * C * S, &st, (float)step, 1.0f);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, N, S, 1), NULL);
        for (c = 0; c < C; c++) {
            double m = 0, v = 0;
            for (i = 0; i < N * S; i++) m += x[(i / S * C + c) * S + i % S];
            m /= N * S;
            for (i = 0; i < N * S; i++) v += pow(x[(i / S * C + c) * S + i % S] - m, 2);
            sum_mean[c] += m;
            sum_var[c] += v / (N * S - 1);
            CHECK(fabs(rm[c] - sum_mean[c] / step) < 1e-5 * (1 + fabs(sum_mean[c] / step)), "cumulative mean");
            CHECK(fabs(rv[c] - sum_var[c] / step) < 1e-5 * (sum_var[c] / step), "cumulative var");
        }
    }
    ddp_syncbn_destroy(bn);
}

/* desc.num_batches_tracked: the counter lives at the program's int64_t and advances there; a 0-d I64
   ddp_tensor over it (torch's "num_batches_tracked", shape []) goes through ddp_checkpoint_save / load
   into a fresh layer, which then goes on with the same cumulative factor 1 / num_batches_tracked
   (momentum None) as a layer that never stopped (the reference ref_bn, run without interruption). */
static void test_counter_storage(void) {
    enum { N = 5, C = 3, S = 4, STEPS = 7, SAVED = 4 };
    float x[N * C * S], dy[N * C * S], y[N * C * S], dx[N * C * S], rm[C] = {0, 0, 0}, rv[C] = {1, 1, 1};
    float rm2[C] = {9, 9, 9}, rv2[C] = {9, 9, 9};
    double ry[N * C * S], rdx[N * C * S], rgw[C], rgb[C], rrm[C] = {0, 0, 0}, rrv[C] = {1, 1, 1};
    int64_t nbt = 0, nbt2 = 0;
    char dir[256], path[300], header[4096];
    ddp_tensor t[3];
    ddp_syncbn_desc d;
    ddp_syncbn *bn, *bn2 = NULL;
    ref_bn ref;
    uint64_t st = 77, hlen = 0;
    int step;
    FILE *f;
    shape sh = {N, C, S, 0, 0, 1, -1};
    memset(&d, 0, sizeof d);
    d.num_features = C, d.momentum = -1, d.running_mean = rm, d.running_var = rv, d.num_batches_tracked = &nbt;
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    memset(&ref, 0, sizeof ref);
    ref.C = C, ref.eps = 1e-5, ref.momentum = -1, ref.track = 1, ref.running_mean = rrm, ref.running_var = rrv;
    snprintf(dir, sizeof dir, "%s/syncbn_nbt_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir), "mkdtemp");
    snprintf(path, sizeof path, "%s/bn.safetensors", dir);
    memset(t, 0, sizeof t);
    t[0].name = "bn.running_mean", t[0].dtype = DDP_F32, t[0].ndim = 1, t[0].shape[0] = C, t[0].data = rm;
    t[1].name = "bn.running_var", t[1].dtype = DDP_F32, t[1].ndim = 1, t[1].shape[0] = C, t[1].data = rv;
    t[2].name = "bn.num_batches_tracked", t[2].dtype = DDP_I64, t[2].ndim = 0, t[2].data = &nbt; /* shape [] */
    for (step = 1; step <= STEPS; step++) {
        ddp_syncbn *cur = step <= SAVED ? bn : bn2;
        ref_fill(x, N * C * S, &st, (float)step - 3.0f, 1.0f + 0.25f * (float)step);
        ref_fill(dy, N * C * S, &st, 0.1f, 1.0f);
        CHECK_OK(ddp_syncbn_forward(cur, x, y, N, S, 1), NULL);
        CHECK_OK(ddp_syncbn_backward(cur, x, dy, dx, NULL, NULL, N, S), NULL);
        ref_bn_train(&ref, x, dy, N, S, ry, rdx, rgw, rgb);
        check_rel("counter storage: y", &sh, step, y, ry, N * C * S);
        check_rel("counter storage: running_mean", &sh, step, step <= SAVED ? rm : rm2, rrm, C);
        check_rel("counter storage: running_var", &sh, step, step <= SAVED ? rv : rv2, rrv, C);
        CHECK((step <= SAVED ? nbt : nbt2) == step && ddp_syncbn_num_batches_tracked(cur) == step,
              "step %d: the program's counter is %lld (the getter says %lld)", step,
              (long long)(step <= SAVED ? nbt : nbt2), (long long)ddp_syncbn_num_batches_tracked(cur));
        if (step == SAVED) {
            CHECK_OK(ddp_checkpoint_save(NULL, path, t, 3, NULL), NULL);
            /* the file says what torch's state_dict holds: a 0-d int64 tensor */
            CHECK((f = fopen(path, "rb")) != NULL, "open %s", path);
            CHECK(fread(&hlen, 8, 1, f) == 1 && hlen < sizeof header && fread(header, 1, (size_t)hlen, f) == hlen,
                  "read the safetensors header");
            fclose(f);
            header[hlen] = '\0';
            CHECK(strstr(header, "\"bn.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[]"), "header: %s", header);
            /* a fresh layer (torch: a new module, then load_state_dict), its counter loaded in place */
            d.running_mean = rm2, d.running_var = rv2, d.num_batches_tracked = &nbt2;
            CHECK_OK(ddp_syncbn_create(NULL, &d, &bn2), NULL);
            t[0].data = rm2, t[1].data = rv2, t[2].data = &nbt2;
            CHECK_OK(ddp_checkpoint_load(NULL, path, t, 3, NULL), NULL);
            CHECK(nbt2 == SAVED && ddp_syncbn_num_batches_tracked(bn2) == SAVED && memcmp(rm2, rm, sizeof rm) == 0 &&
                      memcmp(rv2, rv, sizeof rv) == 0,
                  "loaded counter %lld (getter %lld), want %d", (long long)nbt2,
                  (long long)ddp_syncbn_num_batches_tracked(bn2), SAVED);
        }
    }
    CHECK(nbt == SAVED, "the first layer's counter moved after it stopped: %lld", (long long)nbt);
    /* the getter and setter work on the program's counter */
    CHECK_OK(ddp_syncbn_set_num_batches_tracked(bn2, 41), NULL);
    CHECK(nbt2 == 41 && ddp_syncbn_num_batches_tracked(bn2) == 41, "setter: counter %lld", (long long)nbt2);
    nbt2 = 12;
    CHECK(ddp_syncbn_num_batches_tracked(bn2) == 12, "getter after the program wrote the counter");
    CHECK_OK(ddp_syncbn_forward(bn2, x, y, N, S, 0), NULL); /* eval: not counted */
    CHECK(nbt2 == 12, "eval counted");
    /* errors: a negative counter (at create, or written by the program), a counter without running stats */
    nbt2 = -2;
    memcpy(rm, rm2, sizeof rm);
    CHECK(ddp_syncbn_forward(bn2, x, y, N, S, 1) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(ddp_last_error(NULL), "num_batches_tracked is -2"),
          "negative counter at forward: %s", ddp_last_error(NULL));
    CHECK(nbt2 == -2 && memcmp(rm, rm2, sizeof rm) == 0, "a refused forward changed state");
    ddp_syncbn_destroy(bn2);
    CHECK(ddp_syncbn_create(NULL, &d, &bn2) == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(NULL), "-2"),
          "negative counter at create: %s", ddp_last_error(NULL));
    nbt2 = 0;
    d.running_mean = NULL, d.running_var = NULL;
    CHECK(ddp_syncbn_create(NULL, &d, &bn2) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(ddp_last_error(NULL), "track_running_stats=False"),
          "counter without running stats: %s", ddp_last_error(NULL));
    ddp_syncbn_destroy(bn);
    remove(path);
    rmdir(dir);
}

int main(void) {
    static const shape shapes[] = {
        {9, 5, 1, 0, 1, 1, 0},       /* BatchNorm1d (N, C) */
        {4, 3, 7, 0, 1, 1, 0.3},     /* BatchNorm1d (N, C, L), L below the lane width */
        {3, 6, 37, 0, 1, 1, -1},     /* channels-first, lanes + tail, cumulative momentum */
        {2, 16, 64, 0, 0, 1, 0},     /* no affine */
        {5, 19, 15, 1, 1, 1, 0},     /* channels-last, 2 lane groups + 3 channels */
        {3, 8, 9, 1, 0, 0, 0},       /* channels-last, no affine, no running stats */
        {2, 4, 60, 0, 1, 0, 0},      /* BatchNorm3d-like, no running stats */
        {700, 3, 1, 1, 1, 1, 0},     /* many rows, few channels (tiles) */
        {3, 64, 300, 1, 1, 1, 0.5},  /* channels-last, tiles of 64 rows */
        {3, 7, 1, 1, 1, 1, 0},       /* channels-last (N, C) */
    };
    size_t i;
    (void)tl_run_ranks; /* testlib's multi-rank runner: not needed here */
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) run_shape(&shapes[i], 1000 + i);
    test_in_place();
    test_offset();
    test_cumulative();
    test_counter_storage();
    test_errors();
    printf("test_syncbn: ok (largest relative error %.2g, tolerance %.0e)\n", worst, TOL);
    return 0;
}
