/* ddp_reducer_set_local_samples: ranks with different shares of the batch. Each rank's gradient is the mean
   over its n local samples (some ranks have n = 0, and write NaN into the gradients they hand over: a rank
   without samples must contribute exact zeros whatever it holds); after end_backward the averaged gradient
   must be the mean over every rank's samples, sum_r n_r g_r / sum_r n_r. Checked every step against a
   serial reference computed here in f64 (the ranks' gradients are a function of rank, step, micro-step,
   parameter and element), within 1e-6 of |value| + 1 (bf16 communication: 2e-2), at zero_stage 0 (plain,
   views, flat gradient memory, find_unused_parameters, bf16), 1, 2 and 3 (FSDP units; bf16; find_unused),
   with and without no_sync: at stages 0-2, and stage 3 with accumulate_unsharded, the synchronised pass is
   weighted by the samples of every accumulated micro-batch; at stage 3 without it every pass is weighted
   by its own n. With the same n on every rank the pass must equal an unweighted reducer's bit for bit (a
   second reducer runs the same passes without the call). On 1-4 ranks over shared memory, 2-3 over TCP.
   Uneven inputs (stage 0 with ddp_reducer_join, stage 1 with the join_step loop): a joined rank counts
   n = 0, and its shards get the weighted average of the step it shadowed. Errors: outside a pass, in a
   no_sync pass, after a gradient was handed over, twice in a pass (DDP_ERR_STATE, no collective: the pass
   goes on); N = 0 and an n above 2^40 (DDP_ERR_INVALID_ARGUMENT on every rank, the pass goes on
   unweighted); uneven_inputs' rules (a weighted reducer's pass without the call; a first call after a rank
   joined); the program's own all-reduce against the sample count is DDP_ERR_MISMATCH naming the call. */
#include "testlib.h"

#define NP 4
#define STEPS 3
#define MAXA 2
static const size_t COUNT[NP] = {7, 333, 1001, 61}; /* no size divides 2, 3 or 4 */
#define MAXC 1001

typedef struct mode {
    const char *name;
    int stage, accum, unused, view, flat, unsharded, equal;
    ddp_dtype comm;
    double tol;
} mode;

static const mode MODES[] = {
    {"stage 0", 0, 1, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 0 no_sync x2", 0, 2, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 0 view no_sync x2", 0, 2, 0, 1, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 0 flat find_unused", 0, 1, 1, 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 0 bf16 find_unused no_sync x2", 0, 2, 1, 0, 0, 0, 0, DDP_BF16, 2e-2},
    {"stage 0 equal n", 0, 1, 0, 0, 0, 0, 1, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 0 equal n view bf16 no_sync x2", 0, 2, 0, 1, 0, 0, 1, DDP_BF16, 2e-2},
    {"stage 1", 1, 1, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 1 bf16 no_sync x2", 1, 2, 0, 0, 0, 0, 0, DDP_BF16, 2e-2},
    {"stage 1 equal n find_unused", 1, 1, 1, 0, 0, 0, 1, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 2", 2, 1, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 2 find_unused no_sync x2", 2, 2, 1, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 2 equal n bf16", 2, 1, 0, 0, 0, 0, 1, DDP_BF16, 2e-2},
    {"stage 3", 3, 1, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 3 no_sync x2 (every pass weighted)", 3, 2, 0, 0, 0, 0, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 3 no_sync x2 accumulate_unsharded", 3, 2, 0, 0, 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6},
    {"stage 3 bf16 find_unused", 3, 1, 1, 0, 0, 0, 0, DDP_BF16, 2e-2},
    {"stage 3 equal n no_sync x2", 3, 2, 0, 0, 0, 0, 1, DDP_DTYPE_DEFAULT, 1e-6},
};
#define NMODES ((int)(sizeof MODES / sizeof MODES[0]))

/* Rank r's gradient of parameter p, element i, in micro-step a of step s (the mean over its samples). */
static float grad_of(int r, int s, int a, int p, size_t i) {
    return sinf(0.37f * (float)i + 0.9f * (float)p + 0.31f * (float)r + 0.53f * (float)s + 0.23f * (float)a);
}

/* Rank r's samples in micro-step a of step s: rank 0 always has some, the last rank none in step 1, the
   others 0 .. 3. Equal n: 3 (n / (3 world) must round as 1 / world does). */
static size_t micro_samples(const mode *m, int world, int r, int s, int a) {
    if (m->equal) return 3;
    if (r == 0) return (size_t)(1 + (s + a) % 3);
    if (r == world - 1 && s == 1) return 0;
    return (size_t)((r * 5 + s * 3 + a) % 4);
}

/* Every pass reduces (and is weighted by its own n): stage 3 without accumulate_unsharded. */
static int per_pass(const mode *m) { return m->stage == 3 && !m->unsharded; }

/* The n that rank r passes in micro-step a of step s; -1: no call in that pass (a no_sync pass that
   reduces nothing). The synchronised pass of an accumulation counts every micro-batch. */
static long pass_samples(const mode *m, int world, int r, int s, int a) {
    size_t n = 0;
    int b;
    if (per_pass(m)) return (long)micro_samples(m, world, r, s, a);
    if (a != m->accum - 1) return -1;
    for (b = 0; b < m->accum; b++) n += micro_samples(m, world, r, s, b);
    return (long)n;
}

/* find_unused: rank r uses no gradient of parameter p in step s (none of its micro-steps). */
static int skips(const mode *m, int r, int s, int p) { return m->unused && (r + s + p) % 3 == 0; }

/* The serial reference of step s: the mean over every rank's samples, in f64. Stages 0-2 (and stage 3 with
   accumulate_unsharded) weight what the program accumulated in f32, sum_a g, by the step's samples; stage 3
   adds each pass's own weighted mean. A parameter no rank used keeps its zeroed gradient. */
static double reference(const mode *m, int world, int s, int p, size_t i) {
    double sum = 0;
    int r, a, used = 0;
    for (a = 0; a < m->accum; a++) {
        double N = 0, part = 0;
        if (pass_samples(m, world, 0, s, a) < 0) continue;
        for (r = 0; r < world; r++) N += (double)pass_samples(m, world, r, s, a);
        for (r = 0; r < world; r++) {
            float acc = 0;
            int b;
            if (skips(m, r, s, p)) continue;
            used = 1;
            if (per_pass(m)) acc = grad_of(r, s, a, p, i);
            else
                for (b = 0; b < m->accum; b++) acc += grad_of(r, s, b, p, i); /* as the program adds them */
            part += (double)pass_samples(m, world, r, s, a) * (double)acc;
        }
        sum += part / N;
    }
    return used ? sum : 0.0;
}

typedef struct side {
    ddp_reducer *r;
    float *grad[NP]; /* the program's gradients (stages 0-2 without views) */
    float *block;    /* flat: every gradient in one block */
    float *param[NP];
} side;

static void side_init(side *sd, ddp_group *g, const mode *m) {
    ddp_reducer_desc d;
    size_t total = 0, at = 0;
    int p, idx;
    memset(sd, 0, sizeof *sd);
    memset(&d, 0, sizeof d);
    d.zero_stage = m->stage;
    d.comm_dtype = m->comm;
    d.find_unused_parameters = m->unused;
    d.gradient_as_bucket_view = m->view;
    d.accumulate_unsharded = m->unsharded;
    d.bucket_cap_bytes = 2048, d.first_bucket_bytes = 1024; /* several buckets */
    CHECK_OK(ddp_reducer_create(g, &d, &sd->r), g);
    for (p = 0; p < NP; p++) total += COUNT[p];
    if (m->flat) sd->block = (float *)calloc(total, sizeof(float));
    for (p = 0; p < NP; p++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        if (m->stage == 3) CHECK(ddp_fsdp_unit(sd->r, name, 0) == p, "unit %d", p); /* one parameter a unit */
        sd->param[p] = (float *)calloc(COUNT[p], sizeof(float));
        if (!m->view && m->stage < 3) sd->grad[p] = m->flat ? sd->block + at : (float *)calloc(COUNT[p], sizeof(float));
        at += COUNT[p];
        CHECK_OK(ddp_reducer_add_param(sd->r, name, sd->param[p], sd->grad[p], COUNT[p], DDP_F32, &idx), g);
    }
    CHECK_OK(ddp_reducer_finalize(sd->r), g);
}

static void side_free(side *sd, const mode *m) {
    int p;
    ddp_reducer_destroy(sd->r);
    for (p = 0; p < NP; p++) {
        if (!m->flat) free(sd->grad[p]);
        free(sd->param[p]);
    }
    free(sd->block);
}

/* One step of rank `rank` on sd: its micro-steps, weighted when `weighted`. A pass whose n is 0 hands over
   NaN (what it accumulated is overwritten): the weight 0 must make zeros of it. */
static void step(ddp_group *g, side *sd, const mode *m, int s, int weighted) {
    int rank = ddp_rank(g), world = ddp_world_size(g), a, p;
    size_t i;
    for (a = 0; a < m->accum; a++) {
        long n = pass_samples(m, world, rank, s, a);
        int nan = weighted && n == 0;
        CHECK_OK(ddp_reducer_set_sync(sd->r, a == m->accum - 1), g);
        CHECK_OK(ddp_reducer_begin_backward(sd->r), g);
        if (weighted && n >= 0) CHECK_OK(ddp_reducer_set_local_samples(sd->r, (size_t)n), g);
        for (p = NP - 1; p >= 0; p--) {
            float *G;
            if (skips(m, rank, s, p)) {
                if (m->stage == 3) CHECK_OK(ddp_fsdp_grads_ready(sd->r, p), g); /* no gradient: zeros, unused here */
                continue;
            }
            G = (float *)(m->stage == 3 ? ddp_fsdp_grad(sd->r, p) : ddp_reducer_grad(sd->r, p));
            CHECK(G != NULL, "%s: no gradient buffer for p%d: %s", m->name, p, ddp_last_error(g));
            for (i = 0; i < COUNT[p]; i++) G[i] = nan ? NAN : G[i] + grad_of(rank, s, a, p, i);
            CHECK_OK(m->stage == 3 ? ddp_fsdp_grads_ready(sd->r, p) : ddp_reducer_grad_ready(sd->r, p), g);
        }
        CHECK_OK(ddp_reducer_end_backward(sd->r), g);
    }
}

/* The averaged gradient elements this rank holds: every one at stage 0, its shards' otherwise. */
static void collect(side *sd, const mode *m, float (*out)[MAXC], unsigned char (*have)[MAXC]) {
    const ddp_shard *sh;
    int p, j, n;
    size_t i;
    memset(have, 0, sizeof(unsigned char) * NP * MAXC);
    if (m->stage == 0) {
        for (p = 0; p < NP; p++) {
            const float *G = (const float *)ddp_reducer_grad(sd->r, p);
            for (i = 0; i < COUNT[p]; i++) out[p][i] = G[i], have[p][i] = 1;
        }
        return;
    }
    n = ddp_reducer_shards(sd->r, &sh);
    for (j = 0; j < n; j++)
        for (i = 0; i < sh[j].count; i++) {
            out[sh[j].param][sh[j].offset + i] = ((const float *)sh[j].grad)[i];
            have[sh[j].param][sh[j].offset + i] = 1;
        }
}

static void after_step(side *sd, const mode *m) {
    if (m->stage == 1 || m->stage == 2) CHECK_OK(ddp_reducer_gather_params(sd->r), NULL);
    CHECK_OK(ddp_reducer_zero_grad(sd->r), NULL);
}

static float got_w[NP][MAXC], got_u[NP][MAXC];
static unsigned char have_w[NP][MAXC], have_u[NP][MAXC];

static void run_mode(ddp_group *g, const mode *m) {
    int rank = ddp_rank(g), world = ddp_world_size(g), s, p;
    side w, u;
    size_t i, checked = 0;
    double worst = 0;
    side_init(&w, g, m);
    if (m->equal) side_init(&u, g, m);
    for (s = 0; s < STEPS; s++) {
        step(g, &w, m, s, 1);
        collect(&w, m, got_w, have_w);
        for (p = 0; p < NP; p++)
            for (i = 0; i < COUNT[p]; i++) {
                double want = reference(m, world, s, p, i), d = fabs((double)got_w[p][i] - want);
                if (!have_w[p][i]) continue;
                CHECK(d <= m->tol * (fabs(want) + 1), "%s, %d ranks, rank %d, step %d: p%d[%zu] = %.9g, the mean over "
                      "every rank's samples is %.9g", m->name, world, rank, s, p, i, (double)got_w[p][i], want);
                worst = fmax(worst, d / (fabs(want) + 1));
                checked++;
            }
        if (m->equal) { /* the same n everywhere: an unweighted pass, bit for bit */
            step(g, &u, m, s, 0);
            collect(&u, m, got_u, have_u);
            for (p = 0; p < NP; p++)
                for (i = 0; i < COUNT[p]; i++)
                    CHECK(have_w[p][i] == have_u[p][i] && (!have_w[p][i] || memcmp(&got_w[p][i], &got_u[p][i], 4) == 0),
                          "%s, %d ranks, rank %d, step %d: p%d[%zu] = %.9g weighted by equal n, %.9g unweighted", m->name,
                          world, rank, s, p, i, (double)got_w[p][i], (double)got_u[p][i]);
            after_step(&u, m);
        }
        after_step(&w, m);
    }
    CHECK(checked > 0 || m->stage > 0, "%s: nothing checked", m->name);
    if (rank == 0) printf("  %d ranks %-44s max diff %.1e of |mean| + 1\n", world, m->name, worst);
    if (m->equal) side_free(&u, m);
    side_free(&w, m);
}

static int modes_main(int rank, int n, void *arg) {
    ddp_group *g;
    int k;
    (void)rank, (void)n, (void)arg;
    g = tl_init(30, DDP_LOG_DEFAULT, NULL);
    for (k = 0; k < NMODES; k++) run_mode(g, &MODES[k]);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- uneven inputs: a joined rank counts n = 0 ---- */
#define JNP 2
static const size_t JCOUNT[JNP] = {333, 61};
static const int JLEN[3][4] = {{3, 1}, {2, 4, 1}, {3, 1, 2, 4}}; /* steps per rank, 2-4 ranks */

/* Rank r's samples in step s: rank 1 has none in step 0 (while it still has data). */
static size_t join_samples(int r, int s) { return r == 1 && s == 0 ? 0 : (size_t)(1 + (r * 5 + s * 3) % 4); }

static double join_reference(int world, int s, int p, size_t i) {
    double sum = 0, N = 0;
    int r;
    for (r = 0; r < world; r++)
        if (JLEN[world - 2][r] > s) {
            sum += (double)join_samples(r, s) * (double)grad_of(r, s, 0, p, i);
            N += (double)join_samples(r, s);
        }
    return sum / N;
}

static void join_check(ddp_reducer *red, int stage, int world, int s, float **grad, const char *who) {
    const ddp_shard *sh;
    int p, j, n;
    size_t i;
    if (!stage) {
        for (p = 0; p < JNP; p++)
            for (i = 0; i < JCOUNT[p]; i++) {
                double want = join_reference(world, s, p, i);
                CHECK(fabs(grad[p][i] - want) <= 1e-6 * (fabs(want) + 1), "join, %d ranks, %s, step %d: p%d[%zu] = %.9g, want "
                      "%.9g", world, who, s, p, i, (double)grad[p][i], want);
            }
        return;
    }
    n = ddp_reducer_shards(red, &sh);
    for (j = 0; j < n; j++)
        for (i = 0; i < sh[j].count; i++) {
            double want = join_reference(world, s, sh[j].param, sh[j].offset + i), got = ((const float *)sh[j].grad)[i];
            CHECK(fabs(got - want) <= 1e-6 * (fabs(want) + 1), "join (stage %d), %d ranks, %s, step %d: shard of p%d[%zu] = "
                  "%.9g, want %.9g", stage, world, who, s, sh[j].param, sh[j].offset + i, got, want);
        }
}

static void join_train(ddp_group *g, int stage) {
    int rank = ddp_rank(g), world = ddp_world_size(g), mine = JLEN[world - 2][rank], s, p, all_joined = 0;
    float *param[JNP], *grad[JNP];
    ddp_reducer_desc d;
    ddp_reducer *red;
    size_t i;
    memset(&d, 0, sizeof d);
    d.uneven_inputs = 1;
    d.zero_stage = stage;
    d.bucket_cap_bytes = 1024, d.first_bucket_bytes = 256;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (p = 0; p < JNP; p++) {
        param[p] = (float *)calloc(JCOUNT[p], sizeof(float));
        grad[p] = (float *)calloc(JCOUNT[p], sizeof(float));
        CHECK_OK(ddp_reducer_add_param(red, p ? "b" : "a", param[p], grad[p], JCOUNT[p], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(red), g);
    for (s = 0; s < mine; s++) {
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        CHECK_OK(ddp_reducer_set_local_samples(red, join_samples(rank, s)), g);
        for (p = JNP - 1; p >= 0; p--) {
            for (i = 0; i < JCOUNT[p]; i++) grad[p][i] = join_samples(rank, s) ? grad_of(rank, s, 0, p, i) : NAN;
            CHECK_OK(ddp_reducer_grad_ready(red, p), g);
        }
        CHECK_OK(ddp_reducer_end_backward(red), g);
        join_check(red, stage, world, s, grad, "a rank with data");
        if (stage) CHECK_OK(ddp_reducer_gather_params(red), g);
        CHECK_OK(ddp_reducer_zero_grad(red), g);
    }
    if (!stage) CHECK_OK(ddp_reducer_join(red), g);
    for (s = mine; stage && !all_joined; s++) { /* the shards of a joined rank get each shadowed step's mean */
        CHECK_OK(ddp_reducer_join_step(red, &all_joined), g);
        if (all_joined) break;
        join_check(red, stage, world, s, grad, "a joined rank");
        CHECK_OK(ddp_reducer_gather_params(red), g);
    }
    ddp_reducer_destroy(red);
    for (p = 0; p < JNP; p++) free(param[p]), free(grad[p]);
}

static int join_main(int rank, int n, void *arg) {
    ddp_group *g;
    (void)rank, (void)n, (void)arg;
    g = tl_init(30, DDP_LOG_DEFAULT, NULL);
    join_train(g, 0);
    join_train(g, 1);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- errors, on 2 ranks ---- */
static ddp_reducer *small_reducer(ddp_group *g, int uneven, float *param, float *grad) {
    ddp_reducer_desc d;
    ddp_reducer *red;
    memset(&d, 0, sizeof d);
    d.uneven_inputs = uneven;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    CHECK_OK(ddp_reducer_add_param(red, "w", param, grad, 8, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(red), g);
    return red;
}

#define CHECK_ERR(call, code, text)                                                                                       \
    do {                                                                                                                  \
        ddp_result e_ = (call);                                                                                           \
        CHECK(e_ == (code) && strstr(ddp_last_error(g), text), "%s returned %d, want %d with \"%s\": %s", #call, (int)e_, \
              (int)(code), text, ddp_last_error(g));                                                                      \
    } while (0)

/* One synchronised pass handing over grad = rank + 1, with the samples n when n >= 0. */
static void small_pass(ddp_group *g, ddp_reducer *red, float *grad, long n) {
    int k;
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    if (n >= 0) CHECK_OK(ddp_reducer_set_local_samples(red, (size_t)n), g);
    for (k = 0; k < 8; k++) grad[k] = (float)(ddp_rank(g) + 1);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
}

static void check_all(ddp_group *g, const float *grad, float want, const char *what) {
    int k;
    for (k = 0; k < 8; k++) CHECK(grad[k] == want, "rank %d: %s: grad[%d] = %g, want %g", ddp_rank(g), what, k, (double)grad[k], (double)want);
}

static int errors_main(int rank, int n, void *arg) {
    float param[8] = {0}, grad[8] = {0};
    ddp_group *g;
    ddp_reducer *red;
    int k, all_joined;
    int64_t mine[2] = {1, 2};
    (void)n, (void)arg;
    g = tl_init(30, DDP_LOG_NONE, NULL); /* the mismatch at the end is expected: no error log */
    red = small_reducer(g, 0, param, grad);
    CHECK_ERR(ddp_reducer_set_local_samples(red, 3), DDP_ERR_STATE, "not in a backward pass");
    CHECK_ERR(ddp_reducer_set_local_samples(NULL, 3), DDP_ERR_INVALID_ARGUMENT, "");
    /* a no_sync pass reduces nothing: refused, and the pass goes on */
    CHECK_OK(ddp_reducer_set_sync(red, 0), g);
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_ERR(ddp_reducer_set_local_samples(red, 3), DDP_ERR_STATE, "no_sync");
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    CHECK_OK(ddp_reducer_set_sync(red, 1), g);
    CHECK_OK(ddp_reducer_zero_grad(red), g);
    /* after the first hand-over, and twice: refused, the first call's weight stays (rank 0: 1 of 4 samples) */
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_OK(ddp_reducer_set_local_samples(red, rank ? 3 : 1), g);
    CHECK_ERR(ddp_reducer_set_local_samples(red, 3), DDP_ERR_STATE, "called twice");
    for (k = 0; k < 8; k++) grad[k] = (float)(rank + 1);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_ERR(ddp_reducer_set_local_samples(red, 3), DDP_ERR_STATE, "handed over");
    CHECK_OK(ddp_reducer_end_backward(red), g);
    check_all(g, grad, (1.0f * 1 + 3.0f * 2) / 4, "n = 1 and 3"); /* 1/4 and 3/4 are exact: so is the sum */
    /* the next pass is unweighted again */
    small_pass(g, red, grad, -1);
    check_all(g, grad, 1.5f, "the pass after a weighted one");
    /* N = 0 on every rank: DDP_ERR_INVALID_ARGUMENT everywhere, the pass goes on unweighted */
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_ERR(ddp_reducer_set_local_samples(red, 0), DDP_ERR_INVALID_ARGUMENT, "no rank has samples");
    for (k = 0; k < 8; k++) grad[k] = (float)(rank + 1);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    check_all(g, grad, 1.5f, "after N = 0");
    /* an n too large on one rank: every rank hears of it */
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_ERR(ddp_reducer_set_local_samples(red, rank ? (size_t)1 << 41 : 5), DDP_ERR_INVALID_ARGUMENT, "2^40");
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    ddp_reducer_destroy(red);

    /* uneven_inputs: once weighted, every synchronised pass is announced weighted and must be */
    red = small_reducer(g, 1, param, grad);
    small_pass(g, red, grad, rank ? 3 : 1);
    check_all(g, grad, 1.75f, "uneven_inputs, weighted");
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    CHECK_ERR(ddp_reducer_grad_ready(red, 0), DDP_ERR_STATE, "in this pass too");
    CHECK_ERR(ddp_reducer_end_backward(red), DDP_ERR_STATE, "in this pass too");
    CHECK_OK(ddp_reducer_set_local_samples(red, 2), g); /* equal n: the plain mean */
    for (k = 0; k < 8; k++) grad[k] = (float)(rank + 1);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    check_all(g, grad, 1.5f, "uneven_inputs, equal n");
    /* rank 1 runs out: it counts n = 0 (rank 0's gradient is the mean alone) */
    if (rank == 0) {
        small_pass(g, red, grad, 5);
        check_all(g, grad, 1.0f, "uneven_inputs, rank 1 joined");
    }
    CHECK_OK(ddp_reducer_join(red), g);
    ddp_reducer_destroy(red);

    /* uneven_inputs: the first weighted pass after a rank joined is refused (its shadow would not count) */
    red = small_reducer(g, 1, param, grad);
    if (rank == 0) {
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        CHECK_ERR(ddp_reducer_set_local_samples(red, 5), DDP_ERR_STATE, "joined before the first weighted pass");
        for (k = 0; k < 8; k++) grad[k] = 1.0f;
        CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
        CHECK_OK(ddp_reducer_end_backward(red), g);
        check_all(g, grad, 0.5f, "unweighted after the refusal (sum / initial world size)");
    }
    all_joined = 0;
    while (!all_joined) CHECK_OK(ddp_reducer_join_step(red, &all_joined), g);
    ddp_reducer_destroy(red);

    /* the sample count has a purpose of its own: the program's all-reduce of 2 x i64 does not meet it */
    red = small_reducer(g, 0, param, grad);
    if (rank == 0) {
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        CHECK_ERR(ddp_reducer_set_local_samples(red, 5), DDP_ERR_MISMATCH, "ddp_reducer_set_local_samples' sample count");
    } else {
        CHECK_ERR(ddp_all_reduce(g, mine, 2, DDP_I64, DDP_SUM), DDP_ERR_MISMATCH, "ddp_reducer_set_local_samples' sample count");
    }
    if (rank == 0) printf("  errors: %s\n", ddp_last_error(g));
    ddp_reducer_destroy(red);
    ddp_destroy(g);
    return 0;
}

int main(int argc, char **argv) {
    static const int sizes[] = {1, 2, 3, 4};
    int k, t;
    (void)argc, (void)argv;
    for (t = 0; t < 2; t++) {
        setenv("DDP_TRANSPORT", tl_transport(t), 1);
        for (k = 0; k < 4; k++) {
            double t0 = tl_now();
            if (t && (sizes[k] == 1 || sizes[k] == 4)) continue; /* TCP: 2 and 3 ranks */
            CHECK(tl_run_ranks(sizes[k], modes_main, NULL, 60) == 0, "%d ranks over %s failed", sizes[k], tl_transport(t));
            printf("%d ranks over %s: every mode matches the mean over all samples (%.2f s)\n", sizes[k], tl_transport_name(t),
                   tl_now() - t0);
            fflush(stdout);
        }
    }
    setenv("DDP_TRANSPORT", "auto", 1);
    for (k = 2; k <= 4; k++) {
        CHECK(tl_run_ranks(k, join_main, NULL, 60) == 0, "join on %d ranks failed", k);
        printf("uneven inputs, %d ranks: joined ranks count no samples (stage 0 join, stage 1 join_step)\n", k);
    }
    CHECK(tl_run_ranks(2, errors_main, NULL, 60) == 0, "errors failed");
    printf("test_reducer_samples: ok\n");
    return 0;
}
