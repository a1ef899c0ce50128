/* bench_reducer: DDP's per-step overhead on the cpu backend, the same shapes as
   bench/peers/torch_ddp_overhead.py (a 25M-parameter MLP: 5 x (Linear(2236, 2236), Tanh), MSELoss,
   SGD lr 1e-3, one thread per rank). Step time of R ranks with the reducer minus step time of one process
   without it, same per-rank batch; medians of the timed steps after 2 warm-up steps.

       build/bench_reducer [ranks=2] [batch=32] [steps=10]
       build/bench_reducer join [ranks=2] [steps=2000] [floats=16384]
       build/bench_reducer zero [ranks=2] [steps=60] [floats=4000000]
       build/bench_reducer flat [ranks=1] [steps=20]

   bench/bench_reducer.sh runs it beside torch DDP (gloo) and prints the ratio of the overheads.
   Rows: "ddp.h (copy: DDP default)" (gradients in the program's buffers, copied into buckets and back, as DDP by default) and
   "ddp.h gradient_as_bucket_view" (the gradients are the buckets), "ddp.h uneven_inputs (Join)" (the
   default with uneven_inputs = 1: one join round, a 12-byte-per-rank all_gather, per step) and "ddp.h flat
   grads_memory" (every gradient in one block in registration order, as llm.c keeps them: the buckets are
   slices of it, no copies; issue #20). Columns: median step time of 1 rank
   without DDP and of R ranks with it (rank 0's), their difference (the overhead) and ratio; buckets; the
   reducer's stats averaged over the timed steps: comm (first bucket started to last one done) and exposed
   (time inside end_backward); CPU overhead: rank 0's CPU time per step (all its threads) minus the
   single process's, which is what the overhead is on an otherwise idle machine whose cores all compute,
   and which other programs running on the machine do not inflate.

   The join mode measures what uneven_inputs costs where it shows most: steps with no compute, one
   parameter of `floats` f32, two reducers on the same group (uneven_inputs 0 and 1) taking turns in
   blocks of 50 steps; the median step of each and their ratio (rank 0's).

   The flat mode measures what flat buckets save: the MLP's ten gradients without compute, registered once
   as ten separate buffers (every bucket of several gradients copies them in and back) and once as slices
   of one grads_memory in registration order (the buckets are slices of it), two reducers on the same
   group taking turns in blocks of 5 steps (begin_backward, grad_ready for each in backward order,
   end_backward); the median step of each (rank 0's):
       build/bench_reducer flat [ranks=1] [steps=20]

   The zero mode compares ZeRO stages 1 and 2 with DDP on the optimizer step they are for: a model of about
   `floats` f32 in 40 parameters of sizes that do not divide the world size (0.5 to 1.5 times floats / 40,
   odd) and one of 7, buckets of 1 MiB (every stage), three reducers on the same group taking turns in
   blocks of 5 steps: stage 0 (all-reduce, AdamW on the whole model), stage 1 (reduce-scatter, AdamW on
   this rank's shards, ddp_reducer_gather_params) and stage 2 (the same, the gradient slices kept by the
   reducer; the program computes every gradient into ONE scratch buffer of the largest parameter's size
   just before its grad_ready), and stage 2 again with grad_stats = 1 (the norm and found_inf of the
   averaged gradients, summed as their slices land; one 16-byte all-reduce): its ratio to stage 2's step
   is what grad_stats costs (FSDP.md G5: at most 3%). A step is: write the gradients, backward (grad_ready
   in reverse order, no compute), end_backward, AdamW (and the gather). Printed: the median step of each (rank 0's), the
   optimizer-state bytes (AdamW's m and v) per rank, and the gradient memory per rank: the reducer's
   (statistics' gradient_bytes) and the program's gradient buffers. */
#define DDP_IMPLEMENTATION
#include "ddp.h"
#include "bench_util.h" /* free_port */

#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WIDTH 2236
#define LAYERS 5
#define LR 1e-3f

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds of this process, all threads (the progress thread's communication included). */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct net {
    int batch;
    float *W[LAYERS], *b[LAYERS], *dW[LAYERS], *db[LAYERS]; /* dW/db: the program's gradient buffers */
    float *h[LAYERS + 1], *dh, *dz, *target;
} net;

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void net_init(net *m, int batch) {
    uint64_t s = 1;
    size_t i, ww = (size_t)WIDTH * WIDTH, hb = (size_t)batch * WIDTH;
    int l;
    m->batch = batch;
    for (l = 0; l < LAYERS; l++) {
        m->W[l] = (float *)malloc(ww * sizeof(float));
        m->b[l] = (float *)malloc(WIDTH * sizeof(float));
        m->dW[l] = (float *)calloc(ww, sizeof(float));
        m->db[l] = (float *)calloc(WIDTH, sizeof(float));
        for (i = 0; i < ww; i++) m->W[l][i] = frand(&s) / sqrtf((float)WIDTH);
        for (i = 0; i < WIDTH; i++) m->b[l][i] = frand(&s) / sqrtf((float)WIDTH);
    }
    for (l = 0; l <= LAYERS; l++) m->h[l] = (float *)malloc(hb * sizeof(float));
    m->dh = (float *)malloc(hb * sizeof(float));
    m->dz = (float *)malloc(hb * sizeof(float));
    m->target = (float *)malloc(hb * sizeof(float));
    for (i = 0; i < hb; i++) m->h[0][i] = frand(&s), m->target[i] = frand(&s);
}

/* Dot product with 8 independent sums, so the compiler can vectorise it without -ffast-math. */
static float dot(const float *a, const float *b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, r;
    int i, k;
    for (i = 0; i + 8 <= n; i += 8)
        for (k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    r = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

static void axpy(float *y, float a, const float *x, int n) {
    int i;
    for (i = 0; i < n; i++) y[i] += a * x[i];
}

/* Forward, MSE loss, backward; hook(ctx, k) after parameter k's gradient (W_l = 2l, b_l = 2l + 1). Every
   loop walks W once (row by row) while the batch's activations stay in cache. */
static void step(net *m, float **dW, float **db, void (*hook)(void *, int), void *ctx) {
    int B = m->batch, l, j, s;
    for (l = 0; l < LAYERS; l++)
        for (j = 0; j < WIDTH; j++)
            for (s = 0; s < B; s++)
                m->h[l + 1][s * WIDTH + j] = tanhf(m->b[l][j] + dot(m->h[l] + (size_t)s * WIDTH, m->W[l] + (size_t)j * WIDTH, WIDTH));
    for (s = 0; s < B * WIDTH; s++) m->dh[s] = 2.0f * (m->h[LAYERS][s] - m->target[s]) / (float)(B * WIDTH);
    for (l = LAYERS - 1; l >= 0; l--) {
        const float *x = m->h[l];
        for (s = 0; s < B * WIDTH; s++) m->dz[s] = m->dh[s] * (1.0f - m->h[l + 1][s] * m->h[l + 1][s]);
        if (l > 0) memset(m->dh, 0, sizeof(float) * (size_t)(B * WIDTH));
        for (j = 0; j < WIDTH; j++) {
            const float *w = m->W[l] + (size_t)j * WIDTH;
            float *gw = dW[l] + (size_t)j * WIDTH;
            for (s = 0; s < B; s++) {
                float d = m->dz[s * WIDTH + j];
                db[l][j] += d;
                axpy(gw, d, x + (size_t)s * WIDTH, WIDTH);
                if (l > 0) axpy(m->dh + (size_t)s * WIDTH, d, w, WIDTH);
            }
        }
        if (hook) hook(ctx, 2 * l), hook(ctx, 2 * l + 1);
    }
}

static void sgd(net *m, float **dW, float **db) {
    size_t i, ww = (size_t)WIDTH * WIDTH;
    int l;
    for (l = 0; l < LAYERS; l++) {
        for (i = 0; i < ww; i++) m->W[l][i] -= LR * dW[l][i];
        for (i = 0; i < WIDTH; i++) m->b[l][i] -= LR * db[l][i];
    }
}

static void zero(float **dW, float **db) {
    int l;
    for (l = 0; l < LAYERS; l++) {
        memset(dW[l], 0, sizeof(float) * (size_t)WIDTH * WIDTH);
        memset(db[l], 0, sizeof(float) * WIDTH);
    }
}

/* One process, no reducer: the baseline. *cpu_ms: CPU time per timed step. */
static double single_ms(int batch, int steps, double *cpu_ms) {
    net m;
    double *t = (double *)malloc(sizeof(double) * (size_t)steps), med, c0 = 0;
    int i;
    net_init(&m, batch);
    for (i = -2; i < steps; i++) {
        double t0 = now();
        if (i == 0) c0 = cpu_now();
        zero(m.dW, m.db);
        step(&m, m.dW, m.db, NULL, NULL);
        sgd(&m, m.dW, m.db);
        if (i >= 0) t[i] = now() - t0;
    }
    *cpu_ms = (cpu_now() - c0) / steps * 1e3;
    qsort(t, (size_t)steps, sizeof *t, cmp_double);
    med = t[steps / 2] * 1e3;
    free(t);
    return med;
}

static void ready(void *ctx, int k) {
    ddp_result r = ddp_reducer_grad_ready((ddp_reducer *)ctx, k);
    if (r) fprintf(stderr, "grad_ready: %s\n", ddp_last_error(NULL)), exit(1);
}

typedef struct result {
    double step_ms, cpu_ms, comm_ms, wait_ms;
    int buckets;
} result;

/* One rank of the DDP run; rank 0 writes its result to fd. */
static int ddp_rank_main(int batch, int steps, int mode, int fd) {
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    net m;
    float *dW[LAYERS], *db[LAYERS];
    double *t = (double *)malloc(sizeof(double) * (size_t)steps), comm = 0, wait = 0, c0 = 0;
    result res;
    int l, i, view = mode == 1;
    float *grads_memory = NULL;
    memset(&st, 0, sizeof st);
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    net_init(&m, batch);
    if (mode == 3) { /* one block, W0 b0 W1 b1 ..., as llm.c's grads_memory */
        size_t at = 0, ww = (size_t)WIDTH * WIDTH;
        if (!(grads_memory = (float *)calloc((ww + WIDTH) * LAYERS, sizeof(float)))) return fprintf(stderr, "out of memory\n"), 1;
        for (l = 0; l < LAYERS; l++, at += ww + WIDTH) {
            free(m.dW[l]);
            free(m.db[l]);
            m.dW[l] = grads_memory + at, m.db[l] = grads_memory + at + ww;
        }
    }
    memset(&d, 0, sizeof d);
    d.gradient_as_bucket_view = view;
    d.uneven_inputs = mode == 2;
    if (ddp_reducer_create(g, &d, &red)) return fprintf(stderr, "%s\n", ddp_last_error(g)), 1;
    for (l = 0; l < LAYERS; l++) {
        char name[32];
        snprintf(name, sizeof name, "%d.weight", 2 * l);
        ddp_reducer_add_param(red, name, m.W[l], view ? NULL : m.dW[l], (size_t)WIDTH * WIDTH, DDP_F32, NULL);
        snprintf(name, sizeof name, "%d.bias", 2 * l);
        ddp_reducer_add_param(red, name, m.b[l], view ? NULL : m.db[l], WIDTH, DDP_F32, NULL);
    }
    if (ddp_reducer_finalize(red)) return fprintf(stderr, "finalize: %s\n", ddp_last_error(g)), 1;
    for (i = -2; i < steps; i++) {
        double t0 = now();
        if (i == 0) c0 = cpu_now();
        for (l = 0; l < LAYERS; l++) { /* views move after the first step: read them every step */
            dW[l] = (float *)ddp_reducer_grad(red, 2 * l);
            db[l] = (float *)ddp_reducer_grad(red, 2 * l + 1);
        }
        ddp_reducer_zero_grad(red);
        ddp_reducer_begin_backward(red);
        step(&m, dW, db, ready, red);
        if (ddp_reducer_end_backward(red)) return fprintf(stderr, "end_backward: %s\n", ddp_last_error(g)), 1;
        for (l = 0; l < LAYERS; l++) {
            dW[l] = (float *)ddp_reducer_grad(red, 2 * l);
            db[l] = (float *)ddp_reducer_grad(red, 2 * l + 1);
        }
        sgd(&m, dW, db);
        if (i >= 0) {
            t[i] = now() - t0;
            ddp_reducer_get_statistics(red, &st);
            comm += st.comm_seconds;
            wait += st.wait_seconds;
        }
    }
    res.cpu_ms = (cpu_now() - c0) / steps * 1e3;
    qsort(t, (size_t)steps, sizeof *t, cmp_double);
    ddp_reducer_get_statistics(red, &st);
    res.step_ms = t[steps / 2] * 1e3;
    res.comm_ms = comm / steps * 1e3;
    res.wait_ms = wait / steps * 1e3;
    res.buckets = st.buckets;
    if (ddp_rank(g) == 0 && write(fd, &res, sizeof res) != (ssize_t)sizeof res) return 1;
    ddp_reducer_destroy(red);
    ddp_destroy(g);
    free(t);
    free(grads_memory);
    return 0;
}

/* The join mode's rank: two reducers (uneven_inputs 0 and 1) on one group, alternating blocks of steps
   without compute; rank 0 writes {median step without, median step with} (ms) to fd. */
static int join_rank_main(int floats, int steps, int fd) {
    enum { BLOCK = 50 };
    ddp_group *g;
    ddp_reducer *red[2];
    float *w[2], *gw[2];
    double *t[2], med[2];
    int k, i, b, n[2] = {0, 0};
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    for (k = 0; k < 2; k++) {
        ddp_reducer_desc d;
        memset(&d, 0, sizeof d);
        d.uneven_inputs = k;
        w[k] = (float *)calloc((size_t)floats, sizeof(float));
        gw[k] = (float *)calloc((size_t)floats, sizeof(float));
        t[k] = (double *)malloc(sizeof(double) * (size_t)steps);
        if (ddp_reducer_create(g, &d, &red[k]) || ddp_reducer_add_param(red[k], "w", w[k], gw[k], (size_t)floats, DDP_F32, NULL) ||
            ddp_reducer_finalize(red[k]))
            return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
    }
    for (b = -2; n[0] < steps || n[1] < steps; b++) { /* two warm-up blocks, then turns */
        k = (b + 2) % 2;
        for (i = 0; i < BLOCK; i++) {
            double t0 = now();
            if (ddp_reducer_begin_backward(red[k]) || ddp_reducer_grad_ready(red[k], 0) || ddp_reducer_end_backward(red[k]))
                return fprintf(stderr, "step: %s\n", ddp_last_error(g)), 1;
            if (b >= 0 && n[k] < steps) t[k][n[k]++] = now() - t0;
        }
    }
    for (k = 0; k < 2; k++) {
        qsort(t[k], (size_t)steps, sizeof(double), cmp_double);
        med[k] = t[k][steps / 2] * 1e3;
        ddp_reducer_destroy(red[k]);
        free(w[k]), free(gw[k]), free(t[k]);
    }
    if (ddp_rank(g) == 0 && write(fd, med, sizeof med) != (ssize_t)sizeof med) return 1;
    ddp_destroy(g);
    return 0;
}

/* The flat mode's rank: reducer 0 on separate gradient buffers, reducer 1 on one grads_memory; rank 0 writes
   {median step copying, median step flat, flat buckets of reducer 1, buckets} to fd. */
static int flat_rank_main(int steps, int fd) {
    enum { BLOCK = 5 };
    size_t ww = (size_t)WIDTH * WIDTH, total = (ww + WIDTH) * LAYERS;
    ddp_group *g;
    ddp_reducer *red[2];
    float *w = (float *)calloc(total, sizeof(float)), *grads_memory = (float *)calloc(total, sizeof(float)), *sep[2 * LAYERS];
    double *t[2], out[4];
    int k, i, b, l, n[2] = {0, 0};
    ddp_reducer_statistics st;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    for (l = 0; l < 2 * LAYERS; l++) sep[l] = (float *)calloc(l % 2 ? WIDTH : ww, sizeof(float));
    for (k = 0; k < 2; k++) {
        ddp_reducer_desc d;
        size_t at = 0;
        memset(&d, 0, sizeof d);
        t[k] = (double *)malloc(sizeof(double) * (size_t)steps);
        if (ddp_reducer_create(g, &d, &red[k])) return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
        for (l = 0; l < 2 * LAYERS; l++) { /* W0 b0 W1 b1 ...: the parameters share w (not read here) */
            size_t count = l % 2 ? WIDTH : ww;
            char name[32];
            snprintf(name, sizeof name, "%d.%s", l / 2 * 2, l % 2 ? "bias" : "weight");
            if (ddp_reducer_add_param(red[k], name, w + at, k ? grads_memory + at : sep[l], count, DDP_F32, NULL))
                return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
            at += count;
        }
        if (ddp_reducer_finalize(red[k])) return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
    }
    for (b = -2; n[0] < steps || n[1] < steps; b++) { /* two warm-up blocks, then turns */
        k = (b + 2) % 2;
        for (i = 0; i < BLOCK; i++) {
            double t0 = now();
            if (ddp_reducer_begin_backward(red[k])) return fprintf(stderr, "step: %s\n", ddp_last_error(g)), 1;
            for (l = 2 * LAYERS - 1; l >= 0; l--)
                if (ddp_reducer_grad_ready(red[k], l)) return fprintf(stderr, "step: %s\n", ddp_last_error(g)), 1;
            if (ddp_reducer_end_backward(red[k])) return fprintf(stderr, "step: %s\n", ddp_last_error(g)), 1;
            if (b >= 0 && n[k] < steps) t[k][n[k]++] = now() - t0;
        }
    }
    ddp_reducer_get_statistics(red[1], &st);
    out[2] = st.flat_buckets, out[3] = st.buckets;
    for (k = 0; k < 2; k++) {
        qsort(t[k], (size_t)steps, sizeof(double), cmp_double);
        out[k] = t[k][steps / 2] * 1e3;
        ddp_reducer_destroy(red[k]);
        free(t[k]);
    }
    if (ddp_rank(g) == 0 && write(fd, out, sizeof out) != (ssize_t)sizeof out) return 1;
    ddp_destroy(g);
    for (l = 0; l < 2 * LAYERS; l++) free(sep[l]);
    free(w);
    free(grads_memory);
    return 0;
}

/* ---- the zero mode ---- */

#define ZERO_NP 41 /* 40 of about floats / 40, and one of 7 */
#define ZERO_BLOCK 5
#define ZERO_STAGES 4 /* stages 0, 1, 2, then stage 2 with grad_stats (the norm and found_inf) */
#define ZERO_STAGE_OF(k) ((k) < 3 ? (k) : 2)
#define ZERO_CAP ((size_t)1 << 20)

static void zero_adamw(float *p, const float *g, float *m, float *v, size_t n, int t) {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr = 1e-3f, wd = 1e-2f;
    float c1 = 1.0f - powf(b1, (float)t), c2 = 1.0f - powf(b2, (float)t);
    size_t i;
    for (i = 0; i < n; i++) {
        p[i] -= lr * wd * p[i];
        m[i] = b1 * m[i] + (1.0f - b1) * g[i];
        v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        p[i] -= lr * (m[i] / c1) / (sqrtf(v[i] / c2) + eps);
    }
}

typedef struct zero_model {
    ddp_reducer *red;
    float *w[ZERO_NP], *gw[ZERO_NP], *scratch, **m, **v;
    size_t count[ZERO_NP], *n; /* per optimizer tensor: elements */
    const ddp_shard *sh;
    int tensors, t;
    double state_bytes, grad_bytes; /* AdamW's m and v; the program's gradient buffers */
} zero_model;

static int zero_model_build(ddp_group *g, int stage, int grad_stats, int floats, zero_model *z) {
    ddp_reducer_desc d;
    size_t largest = 0;
    int p;
    memset(z, 0, sizeof *z);
    memset(&d, 0, sizeof d);
    d.zero_stage = stage;
    d.grad_stats = grad_stats;
    d.first_bucket_bytes = d.bucket_cap_bytes = ZERO_CAP;
    if (ddp_reducer_create(g, &d, &z->red)) return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
    for (p = 0; p < ZERO_NP; p++) { /* odd sizes: no world size divides them */
        z->count[p] = p == ZERO_NP - 1 ? 7 : (size_t)((0.5 + (double)(p % 11) / 10.0) * floats / (ZERO_NP - 1)) | 1;
        largest = z->count[p] > largest ? z->count[p] : largest;
    }
    if (stage == 2 && !(z->scratch = (float *)calloc(largest, sizeof(float)))) return 1; /* every gradient, in turn */
    z->grad_bytes = (double)largest * sizeof(float) * (stage == 2);
    for (p = 0; p < ZERO_NP; p++) {
        char name[16];
        z->w[p] = (float *)calloc(z->count[p], sizeof(float));
        z->gw[p] = stage == 2 ? z->scratch : (float *)calloc(z->count[p], sizeof(float));
        if (stage != 2) z->grad_bytes += (double)z->count[p] * sizeof(float);
        snprintf(name, sizeof name, "p%d", p);
        if (!z->w[p] || !z->gw[p] || ddp_reducer_add_param(z->red, name, z->w[p], z->gw[p], z->count[p], DDP_F32, NULL))
            return fprintf(stderr, "reducer: %s\n", ddp_last_error(g)), 1;
    }
    if (ddp_reducer_finalize(z->red)) return fprintf(stderr, "finalize: %s\n", ddp_last_error(g)), 1;
    z->tensors = stage ? ddp_reducer_shards(z->red, &z->sh) : ZERO_NP;
    z->m = (float **)calloc((size_t)z->tensors + 1, sizeof *z->m);
    z->v = (float **)calloc((size_t)z->tensors + 1, sizeof *z->v);
    z->n = (size_t *)calloc((size_t)z->tensors + 1, sizeof *z->n);
    for (p = 0; p < z->tensors; p++) { /* AdamW's state: the shards only under ZeRO */
        z->n[p] = stage ? z->sh[p].count : z->count[p];
        z->m[p] = (float *)calloc(z->n[p], sizeof(float));
        z->v[p] = (float *)calloc(z->n[p], sizeof(float));
        z->state_bytes += 2.0 * (double)z->n[p] * sizeof(float);
    }
    return 0;
}

static int zero_step(ddp_group *g, zero_model *z, int stage) {
    int p;
    size_t i;
    ddp_reducer_zero_grad(z->red);
    if (ddp_reducer_begin_backward(z->red)) return 1;
    for (p = ZERO_NP - 1; p >= 0; p--) {
        for (i = 0; i < z->count[p]; i++) z->gw[p][i] = (float)((int)(i + (size_t)ddp_rank(g)) % 7 - 3) * 0.1f;
        if (ddp_reducer_grad_ready(z->red, p)) return 1;
    }
    if (ddp_reducer_end_backward(z->red)) return 1;
    z->t++;
    for (p = 0; p < z->tensors; p++)
        zero_adamw(stage ? (float *)z->sh[p].param_data : z->w[p], stage ? (const float *)z->sh[p].grad : z->gw[p], z->m[p],
                   z->v[p], z->n[p], z->t);
    return stage && ddp_reducer_gather_params(z->red) ? 1 : 0;
}

/* Rank 0 writes, per stage 0, 1, 2: {median step (ms), optimizer state bytes, reducer gradient_bytes,
   program gradient bytes, buckets}. */
#define ZERO_OUT 5
static int zero_rank_main(int floats, int steps, int fd) {
    ddp_group *g;
    zero_model z[ZERO_STAGES];
    double *t[ZERO_STAGES], out[ZERO_STAGES * ZERO_OUT];
    int k, i, b, p, n[ZERO_STAGES] = {0, 0, 0, 0};
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    for (k = 0; k < ZERO_STAGES; k++) {
        if (zero_model_build(g, ZERO_STAGE_OF(k), k == 3, floats, &z[k])) return 1;
        t[k] = (double *)malloc(sizeof(double) * (size_t)steps);
    }
    for (b = -ZERO_STAGES; n[0] < steps || n[1] < steps || n[2] < steps || n[3] < steps; b++) { /* a warm-up block each, then turns */
        k = (b + ZERO_STAGES) % ZERO_STAGES;
        for (i = 0; i < ZERO_BLOCK; i++) {
            double t0 = now();
            if (zero_step(g, &z[k], ZERO_STAGE_OF(k))) return fprintf(stderr, "step: %s\n", ddp_last_error(g)), 1;
            if (b >= 0 && n[k] < steps) t[k][n[k]++] = now() - t0;
        }
    }
    for (k = 0; k < ZERO_STAGES; k++) {
        ddp_reducer_statistics st;
        ddp_reducer_get_statistics(z[k].red, &st);
        qsort(t[k], (size_t)steps, sizeof(double), cmp_double);
        out[k * ZERO_OUT + 0] = t[k][steps / 2] * 1e3;
        out[k * ZERO_OUT + 1] = z[k].state_bytes;
        out[k * ZERO_OUT + 2] = (double)st.gradient_bytes;
        out[k * ZERO_OUT + 3] = z[k].grad_bytes;
        out[k * ZERO_OUT + 4] = st.buckets;
        ddp_reducer_destroy(z[k].red);
        for (p = 0; p < ZERO_NP; p++) {
            free(z[k].w[p]);
            if (!z[k].scratch) free(z[k].gw[p]);
        }
        for (p = 0; p < z[k].tensors; p++) free(z[k].m[p]), free(z[k].v[p]);
        free(z[k].scratch), free(z[k].m), free(z[k].v), free(z[k].n), free(t[k]);
    }
    if (ddp_rank(g) == 0 && write(fd, out, sizeof out) != (ssize_t)sizeof out) return 1;
    ddp_destroy(g);
    return 0;
}

/* Fork R ranks with torchrun's environment; returns rank 0's result (out_bytes of it). mode 4: the join
   mode (batch = floats); mode 5: the zero mode; mode 6: the flat mode. */
static int run_ddp(int R, int batch, int steps, int mode, void *out, size_t out_bytes) {
    int p[2], i, st, failed = 0;
    char v[16];
    pid_t pids[64];
    if (pipe(p) != 0) return 1;
    snprintf(v, sizeof v, "%d", free_port());
    setenv("MASTER_PORT", v, 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    snprintf(v, sizeof v, "%d", R);
    setenv("WORLD_SIZE", v, 1);
    setenv("LOCAL_WORLD_SIZE", v, 1);
    fflush(stdout);
    for (i = 0; i < R; i++) {
        if ((pids[i] = fork()) == 0) {
            snprintf(v, sizeof v, "%d", i);
            setenv("RANK", v, 1);
            setenv("LOCAL_RANK", v, 1);
            close(p[0]);
            exit(mode == 6 ? flat_rank_main(steps, p[1]) : mode == 5 ? zero_rank_main(batch, steps, p[1])
                 : mode == 4 ? join_rank_main(batch, steps, p[1]) : ddp_rank_main(batch, steps, mode, p[1]));
        }
    }
    close(p[1]);
    if (read(p[0], out, out_bytes) != (ssize_t)out_bytes) failed = 1;
    close(p[0]);
    for (i = 0; i < R; i++)
        if (waitpid(pids[i], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
    return failed;
}

/* bench_reducer join [ranks] [steps] [floats] */
static int join_main(int argc, char **argv) {
    int R = argc > 2 ? atoi(argv[2]) : 2, steps = argc > 3 ? atoi(argv[3]) : 2000, floats = argc > 4 ? atoi(argv[4]) : 16384;
    double med[2];
    if (R < 1 || R > 64 || steps < 1 || floats < 1) return fprintf(stderr, "usage: bench_reducer join [ranks] [steps] [floats]\n"), 2;
    if (run_ddp(R, floats, steps, 4, med, sizeof med)) return fprintf(stderr, "bench_reducer: a rank failed\n"), 1;
    printf("bench_reducer join: %d ranks, %d f32 (%d bytes) per step, no compute, median of %d steps each, taking turns "
           "in blocks of 50 (transport %s)\n", R, floats, floats * 4, steps, getenv("DDP_TRANSPORT") ? getenv("DDP_TRANSPORT") : "auto");
    printf("  uneven_inputs 0: %.4f ms/step\n  uneven_inputs 1: %.4f ms/step (+%.4f ms, ratio %.2f)\n", med[0], med[1],
           med[1] - med[0], med[1] / med[0]);
    return 0;
}

/* bench_reducer flat [ranks] [steps] */
static int flat_main(int argc, char **argv) {
    int R = argc > 2 ? atoi(argv[2]) : 1, steps = argc > 3 ? atoi(argv[3]) : 20;
    double out[4];
    if (R < 1 || R > 64 || steps < 1) return fprintf(stderr, "usage: bench_reducer flat [ranks] [steps]\n"), 2;
    if (run_ddp(R, 0, steps, 6, out, sizeof out)) return fprintf(stderr, "bench_reducer: a rank failed\n"), 1;
    printf("bench_reducer flat: %d ranks, the MLP's %.1fM gradients without compute, median of %d steps each, taking turns "
           "in blocks of 5\n", R, LAYERS * ((double)WIDTH * WIDTH + WIDTH) / 1e6, steps);
    printf("  separate gradient buffers (copied in and out): %.2f ms/step\n  one grads_memory (%g of %g buckets flat): "
           "%.2f ms/step (ratio %.2f)\n", out[0], out[2], out[3], out[1], out[1] / out[0]);
    return 0;
}

/* bench_reducer zero [ranks] [steps] [floats] */
static int zero_main(int argc, char **argv) {
    static const char *const what[ZERO_STAGES] = {"stage 0 (all-reduce, full AdamW)", "stage 1 (reduce-scatter, shards)",
                                                  "stage 2 (+ gradient slices only)", "stage 2 + grad_stats (norm, inf)"};
    int R = argc > 2 ? atoi(argv[2]) : 2, steps = argc > 3 ? atoi(argv[3]) : 60, floats = argc > 4 ? atoi(argv[4]) : 4000000, k;
    double out[ZERO_STAGES * ZERO_OUT];
    if (R < 1 || R > 64 || steps < 1 || floats < 1000) return fprintf(stderr, "usage: bench_reducer zero [ranks] [steps] [floats >= 1000]\n"), 2;
    if (run_ddp(R, floats, steps, 5, out, sizeof out)) return fprintf(stderr, "bench_reducer: a rank failed\n"), 1;
    printf("bench_reducer zero: %d ranks, about %d f32 parameters in %d tensors (sizes not divisible by the world size), "
           "%g buckets of about %zu KiB, AdamW, median of %d steps each, taking turns in blocks of %d (transport %s)\n", R, floats,
           ZERO_NP, out[4], ZERO_CAP >> 10, steps, ZERO_BLOCK, getenv("DDP_TRANSPORT") ? getenv("DDP_TRANSPORT") : "auto");
    printf("  %-34s %9s %6s %16s %16s %16s\n", "", "ms/step", "ratio", "AdamW state B", "reducer grad B", "program grad B");
    for (k = 0; k < ZERO_STAGES; k++) {
        const double *o = out + k * ZERO_OUT;
        printf("  %-34s %9.2f %6.2f %16.0f %16.0f %16.0f\n", what[k], o[0], o[0] / out[0], o[1], o[2], o[3]);
    }
    printf("  grad_stats: stage 2's step x %.3f\n", out[3 * ZERO_OUT] / out[2 * ZERO_OUT]);
    return 0;
}

int main(int argc, char **argv) {
    int R, batch, steps, mode;
    double single, single_cpu;
    static const char *const names[4] = {"ddp.h (copy: DDP default)", "ddp.h gradient_as_bucket_view", "ddp.h uneven_inputs (Join)",
                                         "ddp.h flat grads_memory"};
    if (argc > 1 && strcmp(argv[1], "join") == 0) return join_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "flat") == 0) return flat_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "zero") == 0) return zero_main(argc, argv);
    R = argc > 1 ? atoi(argv[1]) : 2, batch = argc > 2 ? atoi(argv[2]) : 32, steps = argc > 3 ? atoi(argv[3]) : 10;
    if (R < 1 || R > 64 || batch < 1 || steps < 1) return fprintf(stderr, "usage: bench_reducer [ranks] [batch] [steps]\n"), 2;
    printf("bench_reducer: %.1fM parameters (%d x Linear(%d, %d) + Tanh), per-rank batch %d, %d ranks, 1 thread each, "
           "median of %d steps\n", LAYERS * ((double)WIDTH * WIDTH + WIDTH) / 1e6, LAYERS, WIDTH, WIDTH, batch, R, steps);
    single = single_ms(batch, steps, &single_cpu);
    printf("%-30s %12s %12s %13s %6s %8s %10s %12s %17s\n", "mode", "1 rank (ms)", "R ranks (ms)", "overhead (ms)", "ratio",
           "buckets", "comm (ms)", "exposed (ms)", "CPU overhead (ms)");
    for (mode = 0; mode <= 3; mode++) {
        result r;
        if (run_ddp(R, batch, steps, mode, &r, sizeof r)) return fprintf(stderr, "bench_reducer: a rank failed\n"), 1;
        printf("%-30s %12.1f %12.1f %13.1f %6.2f %8d %10.1f %12.1f %17.1f\n", names[mode],
               single, r.step_ms, r.step_ms - single, r.step_ms / single, r.buckets, r.comm_ms, r.wait_ms, r.cpu_ms - single_cpu);
    }
    return 0;
}
