/* Reducer equivalence: R ranks with per-rank batch B end with the same weights as one process with batch
   R*B (SGD, 20 steps), for R = 2, 3, 4, on a small MLP and on a 6-layer model with 12 parameter tensors in
   at least 4 buckets; also with no_sync accumulation, find_unused_parameters (a head that only some ranks
   use, a parameter no rank uses), gradient_as_bucket_view, and f16/bf16 compression.
   The reference is serial math written here: one process, the whole batch, no library.
   Tolerance: max over elements of |a - b| / max(|b|, 0.01) <= 1e-5 (f32 communication), 2e-2 for bf16
   and 2e-3 for f16 compression (bf16 keeps 8 significant bits, f16 11). Flat buckets on one grads_memory
   (malloc'd and ddp_alloc'd): every bucket flat, and the rebuild keeps them so. Also: library
   allocations per steady-state iteration (testlib.h's allocation hooks). */
#define TL_ALLOC_HOOKS /* the library's allocations counted by testlib.h's hooks (tl_allocs, tl_frees) */
#include "testlib.h"

#define STEPS 20
#define BATCH 3     /* per rank */
#define MAXL 8
#define LR 0.05f

/* ---- the model: Linear layers (torch layout: W is out x in, y = x W^T + b), tanh between them, an
   optional "skip head" S (y += S_w x + S_b, only for flagged samples) and an optional parameter U that
   nothing uses. Loss: torch's MSELoss, the mean of (y - t)^2 over samples and outputs. ---- */
typedef struct net_cfg {
    int layers;
    int dims[MAXL + 1];
    int extras; /* S and U */
} net_cfg;

typedef struct net {
    net_cfg c;
    int np;                   /* parameter tensors */
    float *p[2 * MAXL + 3];   /* values */
    size_t n[2 * MAXL + 3];   /* counts */
    char name[2 * MAXL + 3][32];
    int iW[MAXL], ib[MAXL], iSw, iSb, iU; /* tensor index of each parameter */
} net;

static const net_cfg MLP = {2, {8, 16, 4}, 0};
static const net_cfg DEEP = {6, {12, 48, 24, 40, 16, 32, 6}, 0};
static const net_cfg DEEP_X = {6, {12, 48, 24, 40, 16, 32, 6}, 1};

static float urand(uint64_t *s) { return (float)((double)(tl_rand(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

/* Registration order: W1 b1 W2 b2 [U after layer 2] ... WL bL [S_w S_b]. */
static void net_init(net *m, const net_cfg *c, uint64_t seed) {
    int l, k = 0;
    uint64_t s = seed;
    memset(m, 0, sizeof *m);
    m->c = *c;
    m->iSw = m->iSb = m->iU = -1;
    for (l = 0; l < c->layers; l++) {
        m->iW[l] = k;
        m->n[k] = (size_t)c->dims[l + 1] * (size_t)c->dims[l];
        snprintf(m->name[k++], 32, "layer%d.weight", l + 1);
        m->ib[l] = k;
        m->n[k] = (size_t)c->dims[l + 1];
        snprintf(m->name[k++], 32, "layer%d.bias", l + 1);
        if (c->extras && l == 1) {
            m->iU = k;
            m->n[k] = 10;
            snprintf(m->name[k++], 32, "unused.weight");
        }
    }
    if (c->extras) {
        m->iSw = k;
        m->n[k] = (size_t)c->dims[c->layers] * (size_t)c->dims[0];
        snprintf(m->name[k++], 32, "skip.weight");
        m->iSb = k;
        m->n[k] = (size_t)c->dims[c->layers];
        snprintf(m->name[k++], 32, "skip.bias");
    }
    m->np = k;
    for (k = 0; k < m->np; k++) {
        size_t i;
        int fan_in = (k == m->iSw || k == m->iSb) ? c->dims[0] : 16;
        for (l = 0; l < c->layers; l++)
            if (k == m->iW[l] || k == m->ib[l]) fan_in = c->dims[l];
        m->p[k] = (float *)calloc(m->n[k], sizeof(float));
        for (i = 0; i < m->n[k]; i++) m->p[k][i] = urand(&s) / sqrtf((float)fan_in);
    }
}

static void net_free(net *m) {
    int k;
    for (k = 0; k < m->np; k++) free(m->p[k]);
}

/* Sample `gi` (global index in the batch) of micro-batch `micro` of step `step`: input, target, flag.
   The skip head is used by the samples of "rank" 1 + micro (rank = gi / BATCH): so with accumulation
   one rank uses it only in a no_sync pass, and with R = 2 nobody uses it in the second micro-batch. */
static void sample(const net_cfg *c, int step, int micro, int gi, float *x, float *t, int *flag) {
    uint64_t s = 0x5eed0000u + (uint64_t)step * 1000003u + (uint64_t)micro * 7919u + (uint64_t)gi * 104729u;
    int i;
    for (i = 0; i < c->dims[0]; i++) x[i] = urand(&s);
    for (i = 0; i < c->dims[c->layers]; i++) t[i] = urand(&s);
    *flag = c->extras && gi / BATCH == 1 + micro;
}

typedef void (*ready_fn)(void *ctx, int k);

/* Forward and backward over n samples; ADDS the gradient of (sum of squared errors) / norm into G and
   calls ready(ctx, k) when tensor k's gradient is complete (output layer first, weight before bias). */
static void fwd_bwd(const net *m, float **G, const float *x, const float *t, const int *flag, int n, int norm,
                    ready_fn ready, void *ctx) {
    const net_cfg *c = &m->c;
    int L = c->layers, l, s, i, j, any = 0;
    float *h[MAXL + 1], *dz = NULL, *dh;
    h[0] = (float *)x;
    for (l = 0; l < L; l++) {
        int in = c->dims[l], out = c->dims[l + 1];
        const float *W = m->p[m->iW[l]], *b = m->p[m->ib[l]];
        h[l + 1] = (float *)malloc(sizeof(float) * (size_t)(n * out));
        for (s = 0; s < n; s++)
            for (j = 0; j < out; j++) {
                float z = b[j];
                for (i = 0; i < in; i++) z += h[l][s * in + i] * W[j * in + i];
                h[l + 1][s * out + j] = l < L - 1 ? tanhf(z) : z;
            }
    }
    for (s = 0; s < n; s++) any |= flag[s];
    if (c->extras)
        for (s = 0; s < n; s++)
            if (flag[s])
                for (j = 0; j < c->dims[L]; j++) {
                    float z = m->p[m->iSb][j];
                    for (i = 0; i < c->dims[0]; i++) z += x[s * c->dims[0] + i] * m->p[m->iSw][j * c->dims[0] + i];
                    h[L][s * c->dims[L] + j] += z;
                }
    /* dL/dy = 2 (y - t) / (norm * out) */
    dh = (float *)malloc(sizeof(float) * (size_t)(n * c->dims[L]));
    for (i = 0; i < n * c->dims[L]; i++) dh[i] = 2.0f * (h[L][i] - t[i]) / (float)(norm * c->dims[L]);
    if (c->extras && any) {
        for (s = 0; s < n; s++)
            if (flag[s])
                for (j = 0; j < c->dims[L]; j++) {
                    G[m->iSb][j] += dh[s * c->dims[L] + j];
                    for (i = 0; i < c->dims[0]; i++) G[m->iSw][j * c->dims[0] + i] += dh[s * c->dims[L] + j] * x[s * c->dims[0] + i];
                }
        ready(ctx, m->iSw);
        ready(ctx, m->iSb);
    }
    for (l = L - 1; l >= 0; l--) {
        int in = c->dims[l], out = c->dims[l + 1];
        const float *W = m->p[m->iW[l]];
        dz = dh; /* dh of layer l+1's output is dz here: tanh' was applied below */
        for (s = 0; s < n; s++)
            for (j = 0; j < out; j++) {
                G[m->ib[l]][j] += dz[s * out + j];
                for (i = 0; i < in; i++) G[m->iW[l]][j * in + i] += dz[s * out + j] * h[l][s * in + i];
            }
        ready(ctx, m->iW[l]);
        ready(ctx, m->ib[l]);
        if (l == 0) break;
        dh = (float *)calloc((size_t)(n * in), sizeof(float));
        for (s = 0; s < n; s++)
            for (i = 0; i < in; i++) {
                float a = 0, hv = h[l][s * in + i];
                for (j = 0; j < out; j++) a += dz[s * out + j] * W[j * in + i];
                dh[s * in + i] = a * (1.0f - hv * hv);
            }
        free(dz);
    }
    free(dz);
    for (l = 1; l <= L; l++) free(h[l]);
}

static void no_ready(void *ctx, int k) {
    (void)ctx;
    (void)k;
}

/* ---- the variants ---- */
typedef struct variant {
    const char *name;
    const net_cfg *cfg;
    int accum;          /* backward passes per step; all but the last under no_sync */
    int find_unused, view;
    ddp_dtype comm;
    size_t cap, first;  /* bucket sizes (0 = defaults) */
    int min_buckets;
    double tol;
    int flat; /* 0: a calloc per gradient; 1: one malloc'd grads_memory (llm.c's layout); 2: one ddp_alloc block */
} variant;

static const variant VARIANTS[] = {
    {"mlp", &MLP, 1, 0, 0, DDP_DTYPE_DEFAULT, 0, 0, 1, 1e-5, 0},
    {"mlp no_sync x2", &MLP, 2, 0, 0, DDP_DTYPE_DEFAULT, 0, 0, 1, 1e-5, 0},
    {"deep", &DEEP, 1, 0, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep no_sync x3", &DEEP, 3, 0, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep find_unused", &DEEP_X, 1, 1, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep find_unused no_sync x2", &DEEP_X, 2, 1, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep bucket_view no_sync x2", &DEEP, 2, 0, 1, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep bucket_view find_unused no_sync x2", &DEEP_X, 2, 1, 1, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 0},
    {"deep bf16", &DEEP, 1, 0, 0, DDP_BF16, 4096, 1024, 4, 2e-2, 0},
    {"deep bucket_view f16 find_unused", &DEEP_X, 1, 1, 1, DDP_F16, 4096, 1024, 4, 2e-3, 0},
    /* flat gradient memory: the buckets are slices of the program's grads_memory (no copies) */
    {"deep flat", &DEEP, 1, 0, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 1},
    {"deep flat find_unused no_sync x2", &DEEP_X, 2, 1, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 1},
    {"deep flat bf16", &DEEP, 1, 0, 0, DDP_BF16, 4096, 1024, 4, 2e-2, 1},
    {"deep flat ddp_alloc no_sync x3", &DEEP, 3, 0, 0, DDP_DTYPE_DEFAULT, 4096, 1024, 4, 1e-5, 2},
};
#define NVARIANTS ((int)(sizeof VARIANTS / sizeof VARIANTS[0]))

/* One process, the whole batch of R*B samples per micro-batch. */
static void reference(const variant *v, int R, net *m) {
    int step, micro, k, n = R * BATCH, gi;
    const net_cfg *c = v->cfg;
    float *x = (float *)malloc(sizeof(float) * (size_t)(n * c->dims[0]));
    float *t = (float *)malloc(sizeof(float) * (size_t)(n * c->dims[c->layers]));
    int *flag = (int *)malloc(sizeof(int) * (size_t)n);
    float *G[2 * MAXL + 3];
    net_init(m, c, 42);
    for (k = 0; k < m->np; k++) G[k] = (float *)calloc(m->n[k], sizeof(float));
    for (step = 0; step < STEPS; step++) {
        for (k = 0; k < m->np; k++) memset(G[k], 0, m->n[k] * sizeof(float));
        for (micro = 0; micro < v->accum; micro++) {
            for (gi = 0; gi < n; gi++) sample(c, step, micro, gi, x + gi * c->dims[0], t + gi * c->dims[c->layers], &flag[gi]);
            fwd_bwd(m, G, x, t, flag, n, n, no_ready, NULL);
        }
        for (k = 0; k < m->np; k++) {
            size_t i;
            if (k == m->iU) continue;
            for (i = 0; i < m->n[k]; i++) m->p[k][i] -= LR * G[k][i];
        }
    }
    for (k = 0; k < m->np; k++) free(G[k]);
    free(x);
    free(t);
    free(flag);
}

static double max_rel_diff(const float *a, const float *b, size_t n) {
    double worst = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / fmax(fabs((double)b[i]), 0.01);
        if (d != d) return INFINITY;
        worst = fmax(worst, d);
    }
    return worst;
}

typedef struct ctx {
    ddp_reducer *red;
    int idx[2 * MAXL + 3]; /* reducer index of each tensor */
    int calls;
} ctx;

static void on_ready(void *p, int k) {
    ctx *c = (ctx *)p;
    CHECK_OK(ddp_reducer_grad_ready(c->red, c->idx[k]), NULL);
    c->calls++;
}

/* Train variant v on this rank; compare with the reference. */
static void run_variant(ddp_group *g, const variant *v) {
    int rank = ddp_rank(g), R = ddp_world_size(g), step, micro, k, s;
    const net_cfg *c = v->cfg;
    ddp_reducer_desc d;
    ctx cx;
    net m, ref;
    float *grads[2 * MAXL + 3], *G[2 * MAXL + 3], *grads_memory = NULL;
    size_t total = 0, at = 0;
    float x[BATCH * 64], t[BATCH * 64];
    int flag[BATCH];
    ddp_reducer_statistics st;
    long allocs_before = 0, frees_before = 0;
    memset(&st, 0, sizeof st);
    memset(&d, 0, sizeof d);
    memset(&cx, 0, sizeof cx);
    d.find_unused_parameters = v->find_unused;
    d.gradient_as_bucket_view = v->view;
    d.comm_dtype = v->comm;
    d.bucket_cap_bytes = v->cap;
    d.first_bucket_bytes = v->first;
    /* every rank but 0 starts from other weights: finalize must replace them with rank 0's */
    net_init(&m, c, rank == 0 ? 42 : 1000 + (uint64_t)rank);
    CHECK_OK(ddp_reducer_create(g, &d, &cx.red), g);
    for (k = 0; k < m.np; k++) total += m.n[k];
    if (v->flat) { /* every gradient in one block, in registration order, as llm.c lays them out */
        grads_memory = v->flat == 2 ? (float *)ddp_alloc(g, total * sizeof(float)) : (float *)malloc(total * sizeof(float));
        CHECK(grads_memory != NULL, "grads_memory: %s", ddp_last_error(g));
        memset(grads_memory, 0, total * sizeof(float));
    }
    for (k = 0; k < m.np; k++) {
        grads[k] = v->view ? NULL : v->flat ? grads_memory + at : (float *)calloc(m.n[k], sizeof(float));
        at += m.n[k];
        CHECK_OK(ddp_reducer_add_param(cx.red, m.name[k], m.p[k], grads[k], m.n[k], DDP_F32, &cx.idx[k]), g);
        CHECK(cx.idx[k] == k, "index %d for tensor %d", cx.idx[k], k);
    }
    CHECK_OK(ddp_reducer_finalize(cx.red), g);
    for (step = 0; step < STEPS; step++) {
        if (step == 5) {
            allocs_before = __atomic_load_n(&tl_allocs, __ATOMIC_RELAXED);
            frees_before = __atomic_load_n(&tl_frees, __ATOMIC_RELAXED);
        }
        /* pointers are re-read every step: with bucket views they move after the first step */
        for (k = 0; k < m.np; k++) G[k] = (float *)ddp_reducer_grad(cx.red, cx.idx[k]);
        for (micro = 0; micro < v->accum; micro++) {
            int last = micro == v->accum - 1;
            CHECK_OK(ddp_reducer_set_sync(cx.red, last), g);
            CHECK_OK(ddp_reducer_begin_backward(cx.red), g);
            for (s = 0; s < BATCH; s++)
                sample(c, step, micro, rank * BATCH + s, x + s * c->dims[0], t + s * c->dims[c->layers], &flag[s]);
            fwd_bwd(&m, G, x, t, flag, BATCH, BATCH, on_ready, &cx);
            if (last && m.iU >= 0) /* nobody reports U: its gradient must come back untouched */
                for (k = 0; k < (int)m.n[m.iU]; k++) G[m.iU][k] = 7.0f * (float)(rank + 1) + (float)k;
            CHECK_OK(ddp_reducer_end_backward(cx.red), g);
        }
        if (m.iU >= 0)
            for (k = 0; k < (int)m.n[m.iU]; k++)
                CHECK(G[m.iU][k] == 7.0f * (float)(rank + 1) + (float)k, "%s: unused.weight's gradient changed: [%d] = %g",
                      v->name, k, (double)G[m.iU][k]);
        if (step == 0) /* after the rebuild, views may have moved; the averaged gradients moved with them */
            for (k = 0; k < m.np; k++) G[k] = (float *)ddp_reducer_grad(cx.red, cx.idx[k]);
        for (k = 0; k < m.np; k++) {
            size_t i;
            if (k == m.iU) continue;
            for (i = 0; i < m.n[k]; i++) m.p[k][i] -= LR * G[k][i];
        }
        CHECK_OK(ddp_reducer_zero_grad(cx.red), g);
        if (step == 5 + 9) {
            long allocs = __atomic_load_n(&tl_allocs, __ATOMIC_RELAXED) - allocs_before;
            long frees = __atomic_load_n(&tl_frees, __ATOMIC_RELAXED) - frees_before;
            CHECK_OK(ddp_reducer_get_statistics(cx.red, &st), g);
            /* the only allocations are the collectives' own work handles, one per all-reduce and one for the
               statistics' timing all_gather, each freed by its wait */
            CHECK(allocs <= 10L * (st.buckets + v->find_unused + 1) && allocs == frees,
                  "%s: %ld allocations and %ld frees in 10 steady-state steps (%d buckets)", v->name, allocs, frees, st.buckets);
        }
    }
    CHECK_OK(ddp_reducer_get_statistics(cx.red, &st), g);
    CHECK(st.iterations == STEPS && st.local_iterations == (uint64_t)(STEPS * (v->accum - 1)),
          "%s: stats count %llu synchronised and %llu local passes", v->name, (unsigned long long)st.iterations,
          (unsigned long long)st.local_iterations);
    CHECK(st.buckets >= v->min_buckets, "%s: %d buckets, expected at least %d", v->name, st.buckets, v->min_buckets);
    CHECK(st.rebuilt == (!v->find_unused && !v->flat), "%s: rebuilt = %d", v->name, st.rebuilt); /* flat: kept (reducer.c) */
    { /* flat: every bucket is a slice of grads_memory; else only buckets of one gradient are (a calloc each); views: none */
        int per_bucket[2 * MAXL + 3] = {0}, singles = 0;
        for (k = 0; k < m.np; k++) per_bucket[ddp_reducer_param_bucket(cx.red, cx.idx[k], NULL)]++;
        for (k = 0; k < st.buckets; k++) singles += per_bucket[k] == 1;
        CHECK(st.flat_buckets == (v->view ? 0 : v->flat ? st.buckets : singles), "%s: %d of %d buckets are slices of the program's "
              "gradients, expected %d", v->name, st.flat_buckets, st.buckets, v->view ? 0 : v->flat ? st.buckets : singles);
    }
    {
        size_t elems = 0;
        for (k = 0; k < m.np; k++) elems += m.n[k];
        elems *= ddp_dtype_size(v->comm == DDP_DTYPE_DEFAULT ? DDP_F32 : v->comm);
        CHECK(st.bytes_reduced == elems + (size_t)(v->find_unused ? m.np : 0), "%s: %llu bytes reduced, expected %zu",
              v->name, (unsigned long long)st.bytes_reduced, elems + (size_t)(v->find_unused ? m.np : 0));
        CHECK(st.comm_seconds >= 0 && st.wait_seconds >= 0 && st.backward_seconds >= 0, "%s: stats", v->name);
    }
    reference(v, R, &ref);
    for (k = 0; k < m.np; k++) {
        double e = max_rel_diff(m.p[k], ref.p[k], m.n[k]);
        CHECK(e <= v->tol, "%s, R=%d, rank %d: %s differs from the single-process reference by %.3g (tolerance %.g)",
              v->name, R, rank, m.name[k], e, v->tol);
    }
    if (rank == 0) {
        double worst = 0;
        for (k = 0; k < m.np; k++) worst = fmax(worst, max_rel_diff(m.p[k], ref.p[k], m.n[k]));
        printf("R=%d %-42s %2d tensors %2d buckets  max rel diff %.2e (tolerance %.0e)\n", R, v->name, m.np, st.buckets,
               worst, v->tol);
    }
    ddp_reducer_destroy(cx.red);
    for (k = 0; k < m.np && !v->flat; k++) free(grads[k]);
    if (v->flat == 2) ddp_free(g, grads_memory);
    else free(grads_memory);
    net_free(&m);
    net_free(&ref);
}

static int rank_main(int rank, int n, void *arg) {
    ddp_group *g;
    int i;
    (void)rank;
    (void)n;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (i = 0; i < NVARIANTS; i++) run_variant(g, &VARIANTS[i]);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    int R;
    for (R = 2; R <= 4; R++) CHECK(tl_run_ranks(R, rank_main, NULL, 120) == 0, "R=%d failed", R);
    /* the reference itself must be sensitive: R ranks without the reducer do not match it */
    {
        net a, b;
        variant v = VARIANTS[0];
        reference(&v, 2, &a);
        reference(&v, 3, &b);
        CHECK(max_rel_diff(a.p[0], b.p[0], a.n[0]) > 1e-3, "the reference does not depend on the batch");
        net_free(&a);
        net_free(&b);
    }
    printf("test_reducer: all variants match the single-process reference\n");
    return 0;
}
