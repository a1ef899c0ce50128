/* Mixed precision (torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_, FSDP's ShardedGradScaler): the
   reducer's grad_stats and loss_scale at zero_stage 0, 1 and 2 on 1-4 ranks, and amp.h's helpers.
   (a) The norm: each rank's gradients are N * k * 2^-6 with small integers k, so that every rank's share
       (times 1/N in f32, also 1/3) and every partial sum is exact in f32 and bf16: the averaged gradient is
       then exactly the serial f64 average, whatever order the reduction adds in. On every rank the
       gradients the optimizer reads (stage 0: every parameter's; ZeRO: the shards) equal that serial
       average bit for bit, ddp_reducer_grad_norm is within 1e-12 (relative) of sqrt(sum of squares) of it
       computed here in f64, and its bits are the same on every rank (all_gather of the norms). Modes:
       plain (4 buckets), gradient_as_bucket_view (not at stage 2, which refuses it), one flat
       grads_memory, bf16 comm with loss_scale, bf16 gradients, find_unused_parameters (a parameter no
       rank uses holds 42 before the pass and after it, and is not counted; parameters some ranks skip
       average those ranks' zeros) with and without loss_scale.
   (b) Loss scaling, 100 rounds per stage and world size: the program multiplies its gradients by the
       scaler's scale (a power of two: 2^16, halved and doubled), the reducer unscales them after the
       reduction, and the gradients equal the unscaled serial average exactly. Every 7th round ONE rank
       (a different one each time) writes an inf (NaN every 14th) into one gradient element: every rank's
       ddp_reducer_found_inf is 1, ddp_grad_scaler_update says skip on every rank, and the scale follows
       the rule written out here from torch's _amp_update_scale_cpu_kernel (growth_interval 4, so it grows
       in between).
   (c) ddp_reducer_clip_coef against max_norm / (norm + 1e-6) clamped to 1, computed from the reference
       norm; ddp_reducer_clip_grad_norm returns the norm and multiplies the owned gradients by it (the
       unused parameter's 42 stays).
   (d) uneven_inputs at stage 1 and 2 on 2 ranks: rank 1 joins after one step; in the pass it shadows
       (join_step) it takes part in the statistics' all-reduce, and both ranks agree on the norm of the
       average (rank 0's gradients / 2).
   (e) Errors: no grad_stats (DDP_ERR_STATE naming the field), no pass yet, found_inf -1.
   (f) amp.h on one process: ddp_grad_scaler_init's torch defaults; ddp_grad_scaler_update over 3000
       steps of a pseudo-random found_inf sequence, with torch's factors and with 1.5 / 0.7 (f32 rounding
       of the products), and near FLT_MAX (a growth to inf is not taken), against the rule written out
       here in f32 as torch's kernel does; ddp_non_finite_check_and_unscale in f32, f64, f16 and bf16
       against the multiply computed here (f32 reciprocal of the f64 1 / scale); found_inf set by inf and
       by NaN, never cleared. ddp_any_nonfinite and ddp_sum_sq on 1-4 ranks. */
#include "testlib.h"

#define NP 4
#define ROUNDS_INF 100
#define KEPT 42.0
static const size_t COUNT[NP] = {7, 300, 33, 1025};

typedef struct mode {
    const char *name;
    int view, flat, unused, scaled; /* scaled: loss_scale, the program scales its gradients */
    ddp_dtype comm, dt;             /* comm_dtype; the parameters' dtype */
    int rounds;                     /* synchronised passes; ROUNDS_INF: inject infs (b) */
} mode;

static const mode MODES[] = {
    {"plain", 0, 0, 0, 0, DDP_DTYPE_DEFAULT, DDP_F32, 3},
    {"loss_scale + inf on one rank", 0, 0, 0, 1, DDP_DTYPE_DEFAULT, DDP_F32, ROUNDS_INF},
    {"loss_scale + bf16 comm", 0, 0, 0, 1, DDP_BF16, DDP_F32, 3},
    {"gradient_as_bucket_view", 1, 0, 0, 1, DDP_DTYPE_DEFAULT, DDP_F32, 3},
    {"flat grads_memory", 0, 1, 0, 1, DDP_DTYPE_DEFAULT, DDP_F32, 3},
    {"bf16 gradients", 0, 0, 0, 1, DDP_DTYPE_DEFAULT, DDP_BF16, 3},
    {"find_unused", 0, 0, 1, 0, DDP_DTYPE_DEFAULT, DDP_F32, 4},
    {"find_unused + loss_scale", 0, 0, 1, 1, DDP_DTYPE_DEFAULT, DDP_F32, 4},
};
#define NMODES ((int)(sizeof MODES / sizeof MODES[0]))

/* torch's _amp_update_scale_cpu_kernel, written out: an f32 scale, f64 products stored back into it. */
typedef struct ref_scaler {
    float scale;
    int tracker;
} ref_scaler;
static int ref_update(ref_scaler *s, int found_inf, double growth, double backoff, int interval) {
    if (found_inf) {
        s->scale = (float)(s->scale * backoff);
        s->tracker = 0;
        return 0;
    }
    if (s->tracker + 1 == interval) {
        float grown = (float)(s->scale * growth);
        if (isfinite(grown)) s->scale = grown;
        s->tracker = 0;
    } else {
        s->tracker++;
    }
    return 1;
}

/* Rank r's gradient element i of parameter p in round s, before loss scaling: n * k * 2^-6, |k| <= 31. */
static double grad_of(int n, int r, int s, int p, size_t i) {
    int k = (int)((r * 7 + s * 3 + p * 13 + (long)i * 5) % 63) - 31;
    return (double)n * k / 64.0;
}

/* find_unused modes: rank r leaves parameter p without a gradient in round s. p0 on every rank in odd
   rounds (no rank uses it); the others on some ranks (on every rank when there is one). */
static int skips(const mode *md, int r, int s, int p) {
    if (!md->unused) return 0;
    return p == 0 ? s % 2 == 1 : (r + s + p) % 3 == 0;
}
static int used_anywhere(const mode *md, int n, int s, int p) {
    int r;
    for (r = 0; r < n; r++)
        if (!skips(md, r, s, p)) return 1;
    return 0;
}

/* The serial f64 average of parameter p's element i (what the optimizer must read). */
static double ref_avg(const mode *md, int n, int s, int p, size_t i) {
    double sum = 0;
    int r;
    for (r = 0; r < n; r++)
        if (!skips(md, r, s, p)) sum += grad_of(n, r, s, p, i);
    return sum / n;
}

/* The serial f64 sum of squares of every used parameter's average. */
static double ref_sumsq(const mode *md, int n, int s) {
    double sum = 0, a;
    size_t i;
    int p;
    for (p = 0; p < NP; p++)
        for (i = 0; used_anywhere(md, n, s, p) && i < COUNT[p]; i++) a = ref_avg(md, n, s, p, i), sum += a * a;
    return sum;
}

/* Round s of mode (b): which rank injects a non-finite value (-1: none), and where. */
static int inject_rank(const mode *md, int n, int s) { return md->rounds == ROUNDS_INF && s % 7 == 3 ? (s / 7) % n : -1; }

typedef struct model {
    ddp_reducer *red;
    void *param[NP], *grad[NP], *flat;
} model;

static void model_build(ddp_group *g, const mode *md, int stage, ddp_grad_scaler *scaler, model *M) {
    ddp_reducer_desc d;
    size_t es = ddp_dtype_size(md->dt), total = 0, i;
    int p;
    memset(&d, 0, sizeof d);
    memset(M, 0, sizeof *M);
    d.zero_stage = stage;
    d.find_unused_parameters = md->unused;
    d.gradient_as_bucket_view = md->view;
    d.comm_dtype = md->comm;
    d.bucket_cap_bytes = d.first_bucket_bytes = 1024; /* 4 buckets: {1025}, {33}, {300}, {7} */
    d.grad_stats = 1;
    d.loss_scale = md->scaled ? scaler : NULL;
    CHECK_OK(ddp_reducer_create(g, &d, &M->red), g);
    for (p = 0; p < NP; p++) total += COUNT[p];
    if (md->flat) M->flat = tl_xalloc(total * es);
    for (p = 0, total = 0; p < NP; p++) {
        char name[16];
        M->param[p] = tl_xalloc(COUNT[p] * es);
        for (i = 0; i < COUNT[p]; i++) tl_store_value(M->param[p], i, md->dt, 0.5);
        M->grad[p] = md->view ? NULL : md->flat ? (void *)((char *)M->flat + total * es) : (void *)tl_xalloc(COUNT[p] * es);
        total += COUNT[p];
        snprintf(name, sizeof name, "p%d", p);
        CHECK_OK(ddp_reducer_add_param(M->red, name, M->param[p], M->grad[p], COUNT[p], md->dt, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(M->red), g);
}

static void model_free(model *M) {
    int p;
    ddp_reducer_destroy(M->red);
    for (p = 0; p < NP; p++) {
        free(M->param[p]);
        if (!M->flat) free(M->grad[p]);
    }
    free(M->flat);
}

/* The gradient element this rank's optimizer reads for parameter p, element i (stage 0: the whole
   gradient; ZeRO: only the shards; NULL when this rank does not own it). */
static void *owned_grad(const model *M, const mode *md, int stage, int p, size_t i) {
    const ddp_shard *sh;
    int n = ddp_reducer_shards(M->red, &sh), j;
    if (stage == 0) return (char *)ddp_reducer_grad(M->red, p) + i * ddp_dtype_size(md->dt);
    for (j = 0; j < n; j++)
        if (sh[j].param == p && i >= sh[j].offset && i < sh[j].offset + sh[j].count)
            return (char *)sh[j].grad + (i - sh[j].offset) * ddp_dtype_size(md->dt);
    return NULL;
}

/* One synchronised pass of round s: gradients (times the scale), a non-finite value on one rank. */
static void run_pass(ddp_group *g, const mode *md, int stage, model *M, int s, double scale) {
    int n = ddp_world_size(g), rank = ddp_rank(g), p, bad = inject_rank(md, n, s);
    size_t i;
    for (p = 0; p < NP; p++) /* a parameter no rank uses keeps what its gradient held: 42 */
        if (!used_anywhere(md, n, s, p))
            for (i = 0; i < COUNT[p]; i++) {
                void *at = owned_grad(M, md, stage, p, i);
                if (at) tl_store_value(at, 0, md->dt, KEPT);
            }
    CHECK_OK(ddp_reducer_begin_backward(M->red), g);
    for (p = NP - 1; p >= 0; p--) {
        void *grad = ddp_reducer_grad(M->red, p);
        if (skips(md, rank, s, p)) continue;
        for (i = 0; i < COUNT[p]; i++) tl_store_value(grad, i, md->dt, grad_of(n, rank, s, p, i) * scale);
        if (bad == rank && p == s % NP) tl_store_value(grad, (size_t)s * 7 % COUNT[p], md->dt, s % 14 == 10 ? NAN : INFINITY);
        CHECK_OK(ddp_reducer_grad_ready(M->red, p), g);
    }
    CHECK_OK(ddp_reducer_end_backward(M->red), g);
}

/* After round s: the statistics, the gradients, the scaler (see (a), (b), (c) at the top). */
static void check_pass(ddp_group *g, const mode *md, int stage, model *M, int s, ddp_grad_scaler *sc, ref_scaler *ref) {
    int n = ddp_world_size(g), found = inject_rank(md, n, s) >= 0, p, k;
    double norm, want = sqrt(ref_sumsq(md, n, s)), norms[8];
    size_t i;
    CHECK_OK(ddp_reducer_grad_norm(M->red, &norm), g);
    CHECK(ddp_reducer_found_inf(M->red) == found, "%s, stage %d, round %d: found_inf %d, want %d", md->name, stage, s,
          ddp_reducer_found_inf(M->red), found);
    CHECK_OK(ddp_all_gather(g, &norm, norms, 1, DDP_F64), g);
    for (k = 0; k < n; k++)
        CHECK(!memcmp(&norms[k], &norm, sizeof norm), "%s, stage %d, round %d: rank %d's norm %.17g, this rank's %.17g",
              md->name, stage, s, k, norms[k], norm);
    if (found) {
        CHECK(!isfinite(norm), "%s, stage %d, round %d: norm %g with an inf", md->name, stage, s, norm);
    } else {
        CHECK(fabs(norm - want) <= 1e-12 * want, "%s, stage %d, round %d: norm %.17g, serial %.17g", md->name, stage, s,
              norm, want);
        for (p = 0; p < NP; p++)
            for (i = 0; i < COUNT[p]; i++) {
                void *at = owned_grad(M, md, stage, p, i);
                double got, avg = used_anywhere(md, n, s, p) ? ref_avg(md, n, s, p, i) : KEPT;
                if (!at) continue;
                got = tl_load_value(at, 0, md->dt);
                CHECK(got == avg, "%s, stage %d, round %d: p%d[%zu] = %.9g, serial average %.9g", md->name, stage, s, p, i,
                      got, avg);
            }
    }
    if (md->scaled) {
        int step = ddp_grad_scaler_update(sc, ddp_reducer_found_inf(M->red));
        CHECK(step == ref_update(ref, found, 2.0, 0.5, 4) && sc->scale == ref->scale && sc->growth_tracker == ref->tracker,
              "%s, stage %d, round %d: step %d, scale %g, tracker %d; torch's rule: scale %g, tracker %d", md->name, stage,
              s, step, sc->scale, sc->growth_tracker, ref->scale, ref->tracker);
    }
}

/* (c): the coefficient by its formula; clip_grad_norm on the last round's gradients. */
static void check_clip(ddp_group *g, const mode *md, int stage, model *M, int s) {
    int n = ddp_world_size(g), p;
    double want = sqrt(ref_sumsq(md, n, s)), max_norm = want / 3, coef = max_norm / (want + 1e-6), got, total;
    size_t i;
    got = ddp_reducer_clip_coef(M->red, max_norm);
    CHECK(fabs(got - coef) <= 1e-12 * coef, "%s, stage %d: clip_coef %.17g, formula %.17g", md->name, stage, got, coef);
    CHECK(ddp_reducer_clip_coef(M->red, want * 10) == 1.0, "clip_coef not clamped to 1");
    CHECK(ddp_reducer_clip_coef(M->red, 0) == -1.0 && strstr(ddp_last_error(g), "max_norm"), "max_norm 0: %s",
          ddp_last_error(g));
    CHECK_OK(ddp_reducer_clip_grad_norm(M->red, max_norm, &total), g);
    CHECK(fabs(total - want) <= 1e-12 * want, "clip_grad_norm's total norm %.17g, serial %.17g", total, want);
    for (p = 0; p < NP; p++)
        for (i = 0; i < COUNT[p]; i++) {
            void *at = owned_grad(M, md, stage, p, i);
            double v, ref = used_anywhere(md, n, s, p) ? ref_avg(md, n, s, p, i) * coef : KEPT;
            if (!at) continue;
            v = tl_load_value(at, 0, md->dt);
            CHECK(fabs(v - ref) <= (md->dt == DDP_BF16 ? 4e-3 : 1e-6) * fabs(ref) + 1e-30, "%s, stage %d: clipped p%d[%zu] "
                  "= %.9g, want %.9g", md->name, stage, p, i, v, ref);
        }
}

static int train_main(int rank, int n, void *arg) {
    ddp_group *g;
    int stage, m, s;
    (void)rank, (void)n, (void)arg;
    g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    for (stage = 0; stage <= 2; stage++)
        for (m = 0; m < NMODES; m++) {
            const mode *md = &MODES[m];
            ddp_grad_scaler sc;
            ref_scaler ref = {65536.0f, 0};
            model M;
            if (stage == 2 && md->view) continue; /* refused: test_reducer_zero */
            ddp_grad_scaler_init(&sc);
            sc.growth_interval = 4;
            model_build(g, md, stage, &sc, &M);
            for (s = 0; s < md->rounds; s++) {
                run_pass(g, md, stage, &M, s, md->scaled ? sc.scale : 1.0);
                check_pass(g, md, stage, &M, s, &sc, &ref);
            }
            check_clip(g, md, stage, &M, md->rounds - 1);
            model_free(&M);
        }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* (d): rank 1 has one batch, rank 0 two; rank 1 shadows rank 0's second pass. */
static int join_main(int rank, int n, void *arg) {
    int stage = *(const int *)arg, joined = 0, p, k;
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    ddp_reducer_desc d;
    ddp_reducer *red;
    float *param[NP], *grad[NP];
    double norm, norms[2], want = 0;
    size_t i;
    memset(&d, 0, sizeof d);
    d.zero_stage = stage, d.uneven_inputs = 1, d.grad_stats = 1, d.bucket_cap_bytes = d.first_bucket_bytes = 1024;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (p = 0; p < NP; p++) {
        char name[16];
        param[p] = (float *)tl_xalloc(COUNT[p] * sizeof(float));
        grad[p] = (float *)tl_xalloc(COUNT[p] * sizeof(float));
        snprintf(name, sizeof name, "p%d", p);
        CHECK_OK(ddp_reducer_add_param(red, name, param[p], grad[p], COUNT[p], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(red), g);
    for (k = 0; k < (rank == 0 ? 2 : 1); k++) {
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        for (p = NP - 1; p >= 0; p--) {
            for (i = 0; i < COUNT[p]; i++) grad[p][i] = (float)grad_of(n, rank, k, p, i);
            CHECK_OK(ddp_reducer_grad_ready(red, p), g);
        }
        CHECK_OK(ddp_reducer_end_backward(red), g);
        CHECK_OK(ddp_reducer_gather_params(red), g);
    }
    if (rank == 1) {
        CHECK_OK(ddp_reducer_join_step(red, &joined), g); /* shadows rank 0's second pass */
        CHECK(!joined, "rank 1: every rank joined before rank 0's second pass");
        CHECK_OK(ddp_reducer_gather_params(red), g);       /* meets rank 0's of that step */
    }
    CHECK_OK(ddp_reducer_grad_norm(red, &norm), g);
    CHECK(ddp_reducer_found_inf(red) == 0, "found_inf in the shadowed pass");
    for (p = 0; p < NP; p++) /* the average of rank 0's gradients and the joined rank's zeros */
        for (i = 0; i < COUNT[p]; i++) want += (grad_of(n, 0, 1, p, i) / 2) * (grad_of(n, 0, 1, p, i) / 2);
    want = sqrt(want);
    CHECK(fabs(norm - want) <= 1e-12 * want, "stage %d, rank %d: norm of the shadowed pass %.17g, serial %.17g", stage, rank,
          norm, want);
    CHECK_OK(ddp_all_gather(g, &norm, norms, 1, DDP_F64), g);
    CHECK(!memcmp(&norms[0], &norms[1], sizeof norm), "stage %d: norms differ: %.17g, %.17g", stage, norms[0], norms[1]);
    for (;;) {
        CHECK_OK(ddp_reducer_join_step(red, &joined), g);
        if (joined) break;
        CHECK_OK(ddp_reducer_gather_params(red), g);
    }
    ddp_reducer_destroy(red);
    for (p = 0; p < NP; p++) free(param[p]), free(grad[p]);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* (e) and the collectives of amp.h. */
static int errors_main(int rank, int n, void *arg) {
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    ddp_reducer_desc d;
    ddp_reducer *red;
    float w[5] = {0}, gw[5] = {1, 2, 3, 4, 5};
    double norm, total;
    int any, k;
    (void)arg;
    memset(&d, 0, sizeof d);
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    CHECK_OK(ddp_reducer_add_param(red, "w", w, gw, 5, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(red), g);
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    CHECK(ddp_reducer_grad_norm(red, &norm) == DDP_ERR_STATE && strstr(ddp_last_error(g), "grad_stats"), "no grad_stats: %s",
          ddp_last_error(g));
    CHECK(ddp_reducer_found_inf(red) == -1, "found_inf without grad_stats");
    ddp_reducer_destroy(red);
    d.grad_stats = 1;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    CHECK_OK(ddp_reducer_add_param(red, "w", w, gw, 5, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(red), g);
    CHECK(ddp_reducer_grad_norm(red, &norm) == DDP_ERR_STATE && strstr(ddp_last_error(g), "no synchronised backward pass"),
          "before a pass: %s", ddp_last_error(g));
    CHECK(ddp_reducer_clip_grad_norm(red, 1.0, &norm) == DDP_ERR_STATE, "clip before a pass");
    ddp_reducer_destroy(red);
    for (k = 0; k < 2; k++) { /* any rank's flag reaches every rank; the sums of squares add up */
        CHECK_OK(ddp_any_nonfinite(g, k == 1 && rank == n - 1 ? 7 : 0, &any), g);
        CHECK(any == (k == 1), "ddp_any_nonfinite: %d in round %d", any, k);
    }
    CHECK_OK(ddp_sum_sq(g, (double)(rank + 1) * (rank + 1), &total), g);
    CHECK(total == n * (n + 1) * (2.0 * n + 1) / 6, "ddp_sum_sq: %g", total);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* (f) on one process. */
static void check_scaler(double growth, double backoff, int interval, double init, int steps) {
    ddp_grad_scaler s;
    ref_scaler ref;
    uint64_t rng = 12345;
    int k;
    ddp_grad_scaler_init(&s);
    s.growth_factor = growth, s.backoff_factor = backoff, s.growth_interval = interval, s.scale = init;
    ref.scale = (float)init, ref.tracker = 0;
    for (k = 0; k < steps; k++) {
        int found = tl_rand(&rng) % 11 == 0, step = ddp_grad_scaler_update(&s, found), want = ref_update(&ref, found, growth, backoff, interval);
        CHECK(step == want && s.scale == (double)ref.scale && s.growth_tracker == ref.tracker, "scaler (%g, %g, %d) step %d: "
              "%d, scale %.9g, tracker %d; torch's rule: %d, %.9g, %d", growth, backoff, interval, k, step, s.scale,
              s.growth_tracker, want, (double)ref.scale, ref.tracker);
    }
}

static void check_unscale(ddp_dtype t) {
    enum { N = 64 };
    double vals[N], scale = 65536.0, inv = 1.0 / scale;
    float finv = (float)inv;
    unsigned char buf[N * 8];
    int found = 0, k;
    for (k = 0; k < N; k++) {
        vals[k] = (k - 32) * 1.25 * (k % 3 ? 1024.0 : 3.0e-3);
        tl_store_value(buf, (size_t)k, t, vals[k]);
        vals[k] = tl_load_value(buf, (size_t)k, t); /* what the buffer holds in t */
    }
    CHECK_OK(ddp_non_finite_check_and_unscale(buf, N, t, inv, &found), NULL);
    CHECK(found == 0, "%s: found_inf without an inf", ddp_dtype_name(t));
    for (k = 0; k < N; k++) {
        double want = t == DDP_F64 ? vals[k] * (double)finv : (double)((float)vals[k] * finv), got = tl_load_value(buf, (size_t)k, t);
        if (t == DDP_F16) want = tl_ref_f16((float)want);
        if (t == DDP_BF16) want = tl_ref_bf16((float)want);
        CHECK(got == want, "%s: element %d: %.17g * %.9g = %.17g, want %.17g", ddp_dtype_name(t), k, vals[k], (double)finv, got,
              want);
    }
    tl_store_value(buf, 5, t, INFINITY);
    CHECK_OK(ddp_non_finite_check_and_unscale(buf, N, t, 1.0, &found), NULL);
    CHECK(found == 1, "%s: an inf not found", ddp_dtype_name(t));
    tl_store_value(buf, 5, t, 1.0);
    CHECK_OK(ddp_non_finite_check_and_unscale(buf, N, t, 1.0, &found), NULL);
    CHECK(found == 1, "%s: found_inf was cleared", ddp_dtype_name(t));
    found = 0;
    tl_store_value(buf, N - 1, t, NAN);
    CHECK_OK(ddp_non_finite_check_and_unscale(buf, N, t, 0.5, &found), NULL);
    CHECK(found == 1, "%s: a NaN not found", ddp_dtype_name(t));
}

static void check_single(void) {
    ddp_grad_scaler s;
    int found = 0;
    ddp_grad_scaler_init(&s);
    CHECK(s.scale == 65536.0 && s.growth_factor == 2.0 && s.backoff_factor == 0.5 && s.growth_interval == 2000 &&
          s.growth_tracker == 0, "torch.amp.GradScaler's defaults");
    check_scaler(2.0, 0.5, 2000, 65536.0, 3000);
    check_scaler(2.0, 0.5, 3, 65536.0, 3000);
    check_scaler(1.5, 0.7, 3, 1000.1, 3000);      /* products that f32 must round */
    check_scaler(2.0, 0.5, 1, 1.0e38, 40);        /* a growth past FLT_MAX is not taken */
    CHECK(ddp_grad_scaler_update(NULL, 0) == -1 && ddp_grad_scaler_update(&s, -1) == -1 && s.scale == 65536.0,
          "update's errors");
    check_unscale(DDP_F32);
    check_unscale(DDP_F64);
    check_unscale(DDP_F16);
    check_unscale(DDP_BF16);
    CHECK(ddp_non_finite_check_and_unscale(&s, 1, DDP_I32, 1.0, &found) == DDP_ERR_INVALID_ARGUMENT, "an integer dtype");
    CHECK(ddp_non_finite_check_and_unscale(&s, 1, DDP_F32, 0.0, &found) == DDP_ERR_INVALID_ARGUMENT, "inv_scale 0");
}

int main(void) {
    int world, stage;
    double t0 = tl_now();
    check_single();
    printf("GradScaler's update and the inf/NaN check and unscale: as torch's kernels\n");
    for (world = 1; world <= 4; world++) {
        CHECK(tl_run_ranks(world, train_main, NULL, 120) == 0, "grad_stats, %d ranks", world);
        printf("%d rank%s, stages 0-2: norms equal on every rank and the serial f64 norm; infs skip and halve everywhere "
               "(%.1f s)\n", world, world == 1 ? "" : "s", tl_now() - t0);
        CHECK(tl_run_ranks(world, errors_main, NULL, 60) == 0, "errors, ddp_any_nonfinite, ddp_sum_sq, %d ranks", world);
    }
    setenv("DDP_TRANSPORT", "tcp", 1);
    CHECK(tl_run_ranks(3, train_main, NULL, 120) == 0, "grad_stats, 3 ranks over tcp");
    printf("3 ranks over tcp: the same (%.1f s)\n", tl_now() - t0);
    unsetenv("DDP_TRANSPORT");
    for (stage = 1; stage <= 2; stage++) CHECK(tl_run_ranks(2, join_main, &stage, 60) == 0, "uneven_inputs, stage %d", stage);
    printf("uneven_inputs, stages 1-2: the joined rank takes part in the statistics\n");
    printf("test_amp: ok (%.1f s)\n", tl_now() - t0);
    return 0;
}
