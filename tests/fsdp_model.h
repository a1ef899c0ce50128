/* The model of the FSDP tests (test_reducer_fsdp, test_reducer_fsdp_ckpt): 5 units, a KEEP root "emb" and 4
   layers of a weight and a bias (layers 1 and 4 of the same size); the gradient a rank computes from its
   weights; the program's side of a reducer at any stage; the serial reference (every rank's gradient
   averaged in f64, tests/ref_optim.h's AdamW on the whole model). Include after testlib.h and ref_optim.h. */
#ifndef DDP_TEST_FSDP_MODEL_H
#define DDP_TEST_FSDP_MODEL_H
#define NU 5          /* units: root + 4 layers */
#define NP 9          /* parameters: emb, then w and b per layer */
static const size_t COUNT[NP] = {37, 1000, 7, 333, 7, 257, 7, 1000, 7};
static const int UNIT_OF[NP] = {0, 1, 1, 2, 2, 3, 3, 4, 4};

typedef struct mode {
    const char *name;
    int prefetch, accum, unused;
    ddp_dtype comm, param;
    double tol;   /* against the serial reference */
    int exact;    /* stage 3 equals stage 2 bit for bit */
    int stats;    /* grad_stats: the norm equals stage 2's (bits) and the serial one (1e-5) */
    double scale; /* loss_scale: a ddp_grad_scaler starting here (0: none); the program scales its gradients */
    int inf_step; /* the step at which the last rank writes an inf into unit 2's gradient (-1: none) */
    int unsharded; /* stage 3's accumulate_unsharded */
} mode;


/* Rank r skips unit u (find_unused) at step s, micro-step a; never the root. Unit 2 is skipped by every rank
   at step 1 (a unit no rank used). */
TL_FN int skips(const mode *m, int u, int r, int s, int a) {
    if (!m->unused || u == 0) return 0;
    if (u == 2 && s == 1) return 1;
    return (u + s + r + a) % 3 == 0;
}

TL_FN float initial(int i, size_t j) { return (float)(((int)(j * 7 + (size_t)i * 13) % 23) - 11) * 0.03f; }

/* The gradient a rank computes for parameter i from its (possibly bf16-rounded) weights w. */
TL_FN float grad_of(float w, int rank, int step, int a, int i, size_t j) {
    return sinf(w * 1.7f + 0.3f * (float)rank + 0.01f * (float)j + 0.5f * (float)step + 0.2f * (float)a + 0.1f * (float)i) *
           (1.0f + 0.25f * (float)rank);
}
TL_FN float at_use(const mode *m, float x) { return m->param == DDP_BF16 ? tl_ref_bf16(x) : x; }

typedef struct side { /* one reducer and the program's state for it */
    ddp_reducer *r;
    ddp_grad_scaler scaler;
    float *p[NP], *gr[NP]; /* stage 2: the program's parameters and gradients */
    const ddp_shard *sh;
    int nsh;
    float **m, **v;
} side;

/* "emb", "l1.w", "l1.b", ... */
TL_FN void param_name(int i, char *out, size_t cap) { snprintf(out, cap, i ? "l%d.%c" : "emb", UNIT_OF[i], i % 2 ? 'w' : 'b'); }
static const int64_t L1W_SHAPE[2] = {40, 25};

TL_FN ddp_reducer *make(ddp_group *g, const mode *m, int stage, float **p, float **gr, ddp_grad_scaler *scaler) {
    ddp_reducer_desc d;
    ddp_reducer *r;
    int i, u = -1, rank = ddp_rank(g);
    size_t j;
    memset(&d, 0, sizeof d);
    d.zero_stage = stage;
    d.comm_dtype = m->comm;
    d.find_unused_parameters = m->unused;
    if (stage == 3) d.prefetch = m->prefetch, d.param_dtype = m->param, d.accumulate_unsharded = m->unsharded;
    d.grad_stats = m->stats;
    if (m->scale > 0) {
        ddp_grad_scaler_init(scaler);
        scaler->scale = m->scale;
        d.loss_scale = scaler;
    }
    CHECK_OK(ddp_reducer_create(g, &d, &r), NULL);
    for (i = 0; i < NP; i++) {
        char name[32];
        if (UNIT_OF[i] != u) {
            u = UNIT_OF[i];
            snprintf(name, sizeof name, u ? "layer%d" : "root", u);
            CHECK(ddp_fsdp_unit(r, name, u ? 0 : DDP_FSDP_KEEP) == u, "unit %d", u);
        }
        p[i] = (float *)calloc(COUNT[i], sizeof(float));
        gr[i] = (float *)calloc(COUNT[i], sizeof(float));
        for (j = 0; j < COUNT[i]; j++) p[i][j] = rank ? 99.0f : initial(i, j); /* rank 0's values win */
        param_name(i, name, sizeof name);
        CHECK_OK(ddp_reducer_add_param(r, name, p[i], stage == 3 ? NULL : gr[i], COUNT[i], DDP_F32, NULL), NULL);
    }
    CHECK_OK(ddp_reducer_param_shape(r, 1, 2, L1W_SHAPE), NULL); /* ddp_fsdp_save_full writes it 40 x 25 */
    CHECK_OK(ddp_reducer_finalize(r), NULL);
    return r;
}

TL_FN void side_init(side *s, ddp_group *g, const mode *m, int stage) {
    int j;
    memset(s, 0, sizeof *s);
    s->r = make(g, m, stage, s->p, s->gr, &s->scaler);
    s->nsh = ddp_reducer_shards(s->r, &s->sh);
    CHECK(s->nsh >= 0, "shards");
    s->m = (float **)calloc((size_t)s->nsh + 1, sizeof *s->m);
    s->v = (float **)calloc((size_t)s->nsh + 1, sizeof *s->v);
    for (j = 0; j < s->nsh; j++) {
        s->m[j] = (float *)calloc(s->sh[j].count, sizeof(float));
        s->v[j] = (float *)calloc(s->sh[j].count, sizeof(float));
    }
}

TL_FN void side_free(side *s) {
    int i;
    ddp_reducer_destroy(s->r);
    for (i = 0; i < NP; i++) free(s->p[i]), free(s->gr[i]);
    for (i = 0; i < s->nsh; i++) free(s->m[i]), free(s->v[i]);
    free(s->m), free(s->v);
}

TL_FN void adamw_shards(side *s, int t) {
    int j;
    for (j = 0; j < s->nsh; j++)
        if (ddp_reducer_param_used(s->r, s->sh[j].param))
            ref_adamw((float *)s->sh[j].param_data, (const float *)s->sh[j].grad, s->m[j], s->v[j], s->sh[j].count, t);
}

TL_FN int fsdp_close(double a, double b, double tol) { return a == b || fabs(a - b) <= tol * (fabs(b) + 1); }


/* The serial model: every rank's gradient from the same weights, averaged in f64; AdamW on the whole. */
typedef struct serial {
    float *p[NP], *m[NP], *v[NP];
    double *acc[NP];
    int used[NU];
} serial;

/* The serial gradients of a step (unscaled), averaged in f64, into ref->acc. */
TL_FN void serial_init(serial *ref) {
    int i;
    size_t e;
    for (i = 0; i < NP; i++) {
        ref->p[i] = (float *)malloc(COUNT[i] * sizeof(float));
        ref->m[i] = (float *)calloc(COUNT[i], sizeof(float));
        ref->v[i] = (float *)calloc(COUNT[i], sizeof(float));
        ref->acc[i] = (double *)calloc(COUNT[i], sizeof(double));
        for (e = 0; e < COUNT[i]; e++) ref->p[i][e] = initial(i, e);
    }
}

TL_FN void serial_free(serial *ref) {
    int i;
    for (i = 0; i < NP; i++) free(ref->p[i]), free(ref->m[i]), free(ref->v[i]), free(ref->acc[i]);
}

TL_FN void serial_grads(serial *ref, const mode *m, int world, int step) {
    int i, r, a, u;
    size_t j;
    for (i = 0; i < NP; i++) memset(ref->acc[i], 0, COUNT[i] * sizeof(double));
    for (u = 0; u < NU; u++) {
        int used = 0;
        for (a = 0; a < m->accum; a++)
            for (r = 0; r < world; r++) {
                if (skips(m, u, r, step, a)) continue;
                used = 1;
                for (i = 0; i < NP; i++)
                    for (j = 0; UNIT_OF[i] == u && j < COUNT[i]; j++) {
                        float gval = grad_of(at_use(m, ref->p[i][j]), r, step, a, i, j);
                        ref->acc[i][j] += (double)at_use(m, gval) / world;
                    }
            }
        ref->used[u] = used;
    }
}

/* The norm of the step's averaged gradients (the units some rank used). */
TL_FN double serial_norm(serial *ref, const mode *m, int world, int step) {
    double sum = 0;
    int i;
    size_t j;
    serial_grads(ref, m, world, step);
    for (i = 0; i < NP; i++)
        for (j = 0; ref->used[UNIT_OF[i]] && j < COUNT[i]; j++) sum += ref->acc[i][j] * ref->acc[i][j];
    return sqrt(sum);
}

/* AdamW (its t-th step) on the whole serial model with the step's averaged gradients. */
TL_FN void serial_step(serial *ref, const mode *m, int world, int step, int t) {
    int i, u;
    size_t j;
    serial_grads(ref, m, world, step);
    for (u = 0; u < NU; u++)
        for (i = 0; i < NP && ref->used[u]; i++) {
            float *gf;
            if (UNIT_OF[i] != u) continue;
            gf = (float *)malloc(COUNT[i] * sizeof(float));
            for (j = 0; j < COUNT[i]; j++) gf[j] = (float)ref->acc[i][j];
            ref_adamw(ref->p[i], gf, ref->m[i], ref->v[i], COUNT[i], t);
            free(gf);
        }
}

/* A short FSDP run for other backends (test_mpi's mpi, test_hier's hierarchy): two units (301 and 150
   elements), both gathered ahead; the gathered values, the averaged gradient slices (gradient = rank + 1),
   and after a step on the master shards the next gather, against the closed form. */
TL_FN void fsdp_two_units(ddp_group *g) {
    const int me = ddp_rank(g), world = ddp_world_size(g);
    static const size_t count[2] = {301, 150};
    float w[2][301], *p;
    ddp_reducer *r;
    ddp_reducer_desc d;
    const ddp_shard *sh;
    int u, i, j, n, step, idx[2];
    size_t k;
    memset(&d, 0, sizeof d);
    d.zero_stage = 3, d.prefetch = 1;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    for (u = 0; u < 2; u++) {
        for (k = 0; k < count[u]; k++) w[u][k] = me ? 9.0f : 0.5f; /* rank 0's values win */
        CHECK(ddp_fsdp_unit(r, u ? "b" : "a", 0) == u, "unit %d", u);
        CHECK_OK(ddp_reducer_add_param(r, u ? "wb" : "wa", w[u], NULL, count[u], DDP_F32, &idx[u]), g);
    }
    CHECK_OK(ddp_reducer_finalize(r), g);
    n = ddp_reducer_shards(r, &sh);
    for (step = 0; step < 2; step++) {
        float avg = (float)(world + 1) / 2.0f, want0 = step ? 0.5f - avg : 0.5f;
        CHECK_OK(ddp_fsdp_gather(r, 0), g);
        CHECK_OK(ddp_fsdp_gather(r, 1), g);
        CHECK_OK(ddp_reducer_begin_backward(r), g);
        for (u = 1; u >= 0; u--) {
            CHECK_OK(ddp_fsdp_wait(r, u), g);
            p = (float *)ddp_fsdp_param(r, idx[u]);
            for (k = 0; k < count[u]; k++)
                CHECK(fabsf(p[k] - want0) <= 1e-6f, "step %d: unit %d [%zu] = %g, want %g", step, u, k, p[k], want0);
            p = (float *)ddp_fsdp_grad(r, idx[u]);
            for (k = 0; k < count[u]; k++) p[k] += (float)(me + 1);
            CHECK_OK(ddp_fsdp_grads_ready(r, u), g);
            CHECK_OK(ddp_fsdp_release(r, u), g);
        }
        CHECK_OK(ddp_reducer_end_backward(r), g);
        for (j = 0; j < n; j++)
            for (k = 0; k < sh[j].count; k++) {
                CHECK(fabsf(((float *)sh[j].grad)[k] - avg) <= 1e-6f, "fsdp grad = %g, want %g", ((float *)sh[j].grad)[k], avg);
                ((float *)sh[j].param_data)[k] -= ((float *)sh[j].grad)[k];
            }
    }
    for (i = 0; i < 2; i++) CHECK_OK(ddp_fsdp_wait(r, i), g);
    for (k = 0; k < count[1]; k++)
        CHECK(fabsf(((float *)ddp_fsdp_param(r, idx[1]))[k] - (0.5f - (float)(world + 1))) <= 1e-6f, "after 2 steps");
    ddp_reducer_destroy(r);
}

#endif
