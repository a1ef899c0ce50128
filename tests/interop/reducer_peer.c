/* The ddp.h side of tests/test_interop_reducer.sh (driven by tests/interop/reducer_torch.py).

   reducer_peer train DIR VARIANT R B STEPS ACCUM LR DIMS...
       R ranks (forked, torchrun's environment) train the MLP Linear(d0,d1) Tanh ... Linear(dk-1,dk) with
       ddp.h's reducer, from DIR/init.bin (torch's named_parameters order, f32) on DIR/data.bin (x then t,
       f32, [STEPS][ACCUM][R*B][d]); rank r takes samples r*B .. r*B+B-1. Loss: MSELoss (mean). SGD.
       VARIANT: plain | accum (no_sync on all but the last micro-batch, gradient_as_bucket_view) |
       fp16 (comm_dtype DDP_F16) | join (uneven inputs: rank r trains DIR/steps.txt's r-th number of steps,
       then calls ddp_reducer_join; no_sync and views as accum) | joinfail (the same with join_fail_early:
       every rank stops with DDP_ERR_UNEVEN_INPUTS at the first run-out step) | zero (zero_stage = 1, buckets
       of 256 elements so that slices cut parameters, AdamW (torch's defaults, lr LR) on this rank's
       ddp_reducer_shards, gather_params; then ddp_reducer_consolidate_state gathers m and v to rank 0,
       which writes DIR/ddp_exp_avg.bin and DIR/ddp_exp_avg_sq.bin, the parameters' order) | zerojoin
       (zero_stage = 1 and uneven inputs: the same AdamW step and gather_params; out of data, the
       ddp_reducer_join_step loop with that step and gather_params) | zerounused, zero2unused (zero_stage
       1 / 2 with find_unused_parameters: the last layer is one of two heads of the same shape, the second
       registered after all the others (torch's heads.1); step s on rank r uses head_of(r, s), so a head is
       unused on one rank, or on both in every third step; AdamW skips the shards of parameters that
       ddp_reducer_param_used says no rank used, and counts its step t per parameter, as torch's AdamW
       does for a .grad of None). Rank 0 writes DIR/ddp_final.bin; in the join variants the last rank
       does, which ran out first.
   reducer_peer layout FIRST CAP N SIZE... ORDER...
       One rank: N f32 parameters of SIZE elements; prints the initial bucket of each parameter, then runs
       one backward pass reporting gradients in ORDER and prints the rebuilt buckets. */
#include "testlib.h"

#define MAXL 8
#define MAXP (2 * MAXL + 2) /* the layers' weights and biases, and a second head's */

typedef struct job {
    const char *dir, *variant;
    int R, B, steps, accum, layers, dims[MAXL + 1];
    float lr;
} job;

static float *read_file(const char *dir, const char *name, size_t n) {
    char path[1024];
    float *buf = (float *)malloc(n * sizeof(float));
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "rb");
    CHECK(f && buf && fread(buf, sizeof(float), n, f) == n, "cannot read %zu floats from %s", n, path);
    fclose(f);
    return buf;
}

/* The unused variants' head on rank r in step s: each rank its own (the other unused here, used there),
   and in every third step both head 0 (head 1 unused everywhere). tests/interop/reducer_torch.py: the same. */
static int head_of(int r, int s) { return s % 3 == 2 ? 0 : (r + s) % 2; }

/* y = x W^T + b per layer, tanh between; loss = mean((y - t)^2); gradients ADDED to G (2 per layer).
   Layer l's weight is parameter w[l], its bias w[l] + 1. */
static void fwd_bwd(const job *J, float **P, float **G, const int *w, const float *x, const float *t, int n, ddp_reducer *red) {
    int L = J->layers, l, s, i, j;
    float *h[MAXL + 1], *dz, *dh;
    h[0] = (float *)x;
    for (l = 0; l < L; l++) {
        int in = J->dims[l], out = J->dims[l + 1];
        h[l + 1] = (float *)malloc(sizeof(float) * (size_t)(n * out));
        for (s = 0; s < n; s++)
            for (j = 0; j < out; j++) {
                float z = P[w[l] + 1][j];
                for (i = 0; i < in; i++) z += h[l][s * in + i] * P[w[l]][j * in + i];
                h[l + 1][s * out + j] = l < L - 1 ? tanhf(z) : z;
            }
    }
    dz = (float *)malloc(sizeof(float) * (size_t)(n * J->dims[L]));
    for (i = 0; i < n * J->dims[L]; i++) dz[i] = 2.0f * (h[L][i] - t[i]) / (float)(n * J->dims[L]);
    for (l = L - 1; l >= 0; l--) {
        int in = J->dims[l], out = J->dims[l + 1];
        for (s = 0; s < n; s++)
            for (j = 0; j < out; j++) {
                G[w[l] + 1][j] += dz[s * out + j];
                for (i = 0; i < in; i++) G[w[l]][j * in + i] += dz[s * out + j] * h[l][s * in + i];
            }
        CHECK_OK(ddp_reducer_grad_ready(red, w[l]), NULL);
        CHECK_OK(ddp_reducer_grad_ready(red, w[l] + 1), NULL);
        if (l == 0) break;
        dh = (float *)calloc((size_t)(n * in), sizeof(float));
        for (s = 0; s < n; s++)
            for (i = 0; i < in; i++) {
                float a = 0, hv = h[l][s * in + i];
                for (j = 0; j < out; j++) a += dz[s * out + j] * P[w[l]][j * in + i];
                dh[s * in + i] = a * (1.0f - hv * hv);
            }
        free(dz);
        dz = dh;
    }
    free(dz);
    for (l = 1; l <= L; l++) free(h[l]);
}

/* The join variants: how many steps rank trains (DIR/steps.txt: one number per rank). */
static int rank_steps(const job *J, int rank) {
    char path[1024];
    int k, v = -1;
    FILE *f;
    snprintf(path, sizeof path, "%s/steps.txt", J->dir);
    f = fopen(path, "r");
    CHECK(f != NULL, "cannot read %s", path);
    for (k = 0; k <= rank; k++) CHECK(fscanf(f, "%d", &v) == 1, "%s: no steps for rank %d", path, k);
    fclose(f);
    return v;
}

/* torch.optim.AdamW (betas 0.9, 0.999, eps 1e-8, weight_decay 1e-2), as torch 1.13 computes it: decay,
   the moments, then p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps). t counts steps from 1. */
static void adamw(float *p, const float *g, float *m, float *v, size_t n, int t, float lr) {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 1e-2f;
    float bc1 = 1.0f - powf(b1, (float)t), bc2_sqrt = sqrtf(1.0f - powf(b2, (float)t));
    size_t i;
    for (i = 0; i < n; i++) {
        p[i] *= 1.0f - lr * wd;
        m[i] = m[i] * b1 + (1.0f - b1) * g[i];
        v[i] = v[i] * b2 + (1.0f - b2) * g[i] * g[i];
        p[i] -= (lr / bc1) * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
    }
}

/* zero: AdamW on this rank's shards (state for those only), then every rank gets every parameter. A
   parameter no rank used in the pass is skipped, and t counts each parameter's own steps (torch's AdamW
   skips a .grad of None and keeps a step count per parameter). */
static void zero_step(ddp_group *g, ddp_reducer *red, float *m, float *v, int *t, int nparams, float lr) {
    const ddp_shard *sh;
    int n = ddp_reducer_shards(red, &sh), j;
    size_t at = 0;
    for (j = 0; j < nparams; j++) t[j] += ddp_reducer_param_used(red, j) == 1;
    for (j = 0; j < n; at += sh[j].count, j++)
        if (ddp_reducer_param_used(red, sh[j].param) == 1)
            adamw((float *)sh[j].param_data, (const float *)sh[j].grad, m + at, v + at, sh[j].count, t[sh[j].param], lr);
    CHECK_OK(ddp_reducer_gather_params(red), g);
}

/* zero: m and v consolidated on rank 0 (consolidate_state_dict), written there in the parameters' order. */
static void zero_save(const job *J, ddp_group *g, ddp_reducer *red, float *m, float *v, size_t total) {
    const ddp_shard *sh;
    int n = ddp_reducer_shards(red, &sh), j, k;
    size_t mine = 0;
    float *full[2] = {NULL, NULL};
    const void *st[2];
    void *fp[2];
    for (j = 0; j < n; j++) mine += sh[j].count;
    for (k = 0; k < 2 && ddp_rank(g) == 0; k++) full[k] = (float *)malloc(total * sizeof(float));
    st[0] = m, st[1] = v, fp[0] = full[0], fp[1] = full[1];
    CHECK_OK(ddp_reducer_consolidate_state(red, DDP_F32, 2, st, mine, fp, total, 0), g);
    for (k = 0; k < 2 && ddp_rank(g) == 0; k++) {
        char path[1024];
        FILE *f;
        snprintf(path, sizeof path, "%s/ddp_%s.bin", J->dir, k ? "exp_avg_sq" : "exp_avg");
        f = fopen(path, "wb");
        CHECK(f && fwrite(full[k], sizeof(float), total, f) == total, "cannot write %s", path);
        fclose(f);
    }
    free(full[0]), free(full[1]);
}

static int train_rank(int rank, int n, void *arg) {
    const job *J = (const job *)arg;
    int zero = !strncmp(J->variant, "zero", 4), zerojoin = !strcmp(J->variant, "zerojoin");
    int join = !strncmp(J->variant, "join", 4) || zerojoin, fail_early = !strcmp(J->variant, "joinfail");
    int L = J->layers, k, step, micro, view = !strcmp(J->variant, "accum") || (join && !fail_early && !zero);
    int steps = join ? rank_steps(J, rank) : J->steps, writer = join ? n - 1 : 0;
    int unused = strstr(J->variant, "unused") != NULL, np = 2 * L + 2 * unused, w[MAXL], t[MAXP] = {0};
    size_t cnt[MAXP], total = 0, off = 0, nx, nt;
    float *P[MAXP], *G[MAXP], *init, *data, *zm = NULL, *zv = NULL;
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    (void)n;
    for (k = 0; k < L; k++) {
        cnt[2 * k] = (size_t)J->dims[k + 1] * (size_t)J->dims[k];
        cnt[2 * k + 1] = (size_t)J->dims[k + 1];
        total += cnt[2 * k] + cnt[2 * k + 1];
    }
    for (k = 2 * L; k < np; k++) total += cnt[k] = cnt[k - 2]; /* the second head: the last layer's shape */
    nx = (size_t)J->steps * (size_t)J->accum * (size_t)(J->R * J->B) * (size_t)J->dims[0];
    nt = (size_t)J->steps * (size_t)J->accum * (size_t)(J->R * J->B) * (size_t)J->dims[L];
    init = read_file(J->dir, "init.bin", total);
    data = read_file(J->dir, "data.bin", nx + nt);
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.gradient_as_bucket_view = view;
    if (view) d.bucket_cap_bytes = d.first_bucket_bytes = 1024; /* several buckets */
    if (!strcmp(J->variant, "fp16")) d.comm_dtype = DDP_F16;
    d.uneven_inputs = join;
    d.join_fail_early = fail_early;
    d.zero_stage = zero ? 1 + !strcmp(J->variant, "zero2unused") : 0;
    d.find_unused_parameters = unused;
    if (zero) d.bucket_cap_bytes = d.first_bucket_bytes = 1024; /* slices cut parameters */
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (k = 0; k < np; k++) {
        char name[32];
        snprintf(name, sizeof name, "%d.%s", 2 * (k / 2), k % 2 ? "bias" : "weight");
        /* every rank but 0 starts from garbage: finalize broadcasts rank 0's weights */
        P[k] = (float *)malloc(cnt[k] * sizeof(float));
        if (rank == 0)
            memcpy(P[k], init + off, cnt[k] * sizeof(float));
        else
            for (size_t i = 0; i < cnt[k]; i++) P[k][i] = (float)rank;
        off += cnt[k];
        G[k] = view ? NULL : (float *)calloc(cnt[k], sizeof(float));
        CHECK_OK(ddp_reducer_add_param(red, name, P[k], G[k], cnt[k], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(red), g);
    if (zero) zm = (float *)calloc(total, sizeof(float)), zv = (float *)calloc(total, sizeof(float)); /* >= the shards */
    for (step = 0; step < steps; step++) {
        float *grad[MAXP];
        ddp_result res;
        for (k = 0; k < np; k++) grad[k] = (float *)ddp_reducer_grad(red, k);
        for (k = 0; k < L; k++) w[k] = 2 * k;
        if (unused && head_of(rank, step)) w[L - 1] = 2 * L;
        for (micro = 0; micro < J->accum; micro++) {
            size_t base = ((size_t)step * (size_t)J->accum + (size_t)micro) * (size_t)(J->R * J->B) + (size_t)(rank * J->B);
            CHECK_OK(ddp_reducer_set_sync(red, micro == J->accum - 1), g);
            res = ddp_reducer_begin_backward(red);
            if (fail_early && res == DDP_ERR_UNEVEN_INPUTS) break;
            CHECK_OK(res, g);
            fwd_bwd(J, P, grad, w, data + base * (size_t)J->dims[0], data + nx + base * (size_t)J->dims[L], J->B, red);
            CHECK_OK(ddp_reducer_end_backward(red), g);
        }
        if (micro < J->accum) break; /* joinfail: every rank stops here */
        if (zero) { /* AdamW on this rank's shards, gather_params */
            zero_step(g, red, zm, zv, t, np, J->lr);
            CHECK_OK(ddp_reducer_zero_grad(red), g);
            continue;
        }
        for (k = 0; k < 2 * L; k++) { /* re-read: views move after the first step */
            float *gk = (float *)ddp_reducer_grad(red, k);
            for (size_t i = 0; i < cnt[k]; i++) P[k][i] -= J->lr * gk[i];
        }
        CHECK_OK(ddp_reducer_zero_grad(red), g);
    }
    while (zerojoin) { /* out of data: shadow the others' steps, still stepping this rank's shards */
        int all_joined = 0;
        CHECK_OK(ddp_reducer_join_step(red, &all_joined), g);
        if (all_joined) break;
        zero_step(g, red, zm, zv, t, np, J->lr); /* AdamW on the shards, gather_params */
    }
    if (join && !zero && step == steps) { /* out of data (joinfail: the ranks with data stopped above instead) */
        ddp_result res = ddp_reducer_join(red);
        if (fail_early) {
            CHECK(res == DDP_ERR_UNEVEN_INPUTS, "rank %d: join returned %s (%s)", rank, ddp_result_string(res), ddp_last_error(g));
            printf("joinfail: %s\n", ddp_last_error(g));
        } else {
            CHECK_OK(res, g);
        }
    }
    if (zero && !zerojoin) zero_save(J, g, red, zm, zv, total);
    free(zm), free(zv);
    if (rank == writer) {
        char path[1024];
        FILE *f;
        snprintf(path, sizeof path, "%s/ddp_final.bin", J->dir);
        f = fopen(path, "wb");
        CHECK(f != NULL, "cannot write %s", path);
        for (k = 0; k < np; k++) fwrite(P[k], sizeof(float), cnt[k], f);
        fclose(f);
    }
    ddp_reducer_destroy(red);
    CHECK_OK(ddp_destroy(g), NULL);
    for (k = 0; k < np; k++) free(P[k]), free(G[k]);
    free(init);
    free(data);
    return 0;
}

static int layout(int argc, char **argv) {
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    int n = atoi(argv[4]), i;
    float **p = (float **)calloc((size_t)n, sizeof *p);
    CHECK(argc == 5 + 2 * n, "layout FIRST CAP N SIZE... ORDER...");
    memset(&d, 0, sizeof d);
    d.first_bucket_bytes = (size_t)atol(argv[2]);
    d.bucket_cap_bytes = (size_t)atol(argv[3]);
    d.gradient_as_bucket_view = 1;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (i = 0; i < n; i++) {
        char name[16];
        size_t c = (size_t)atol(argv[5 + i]);
        snprintf(name, sizeof name, "p%d", i);
        p[i] = (float *)calloc(c, sizeof(float));
        CHECK_OK(ddp_reducer_add_param(red, name, p[i], NULL, c, DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(red), g);
    printf("initial");
    for (i = 0; i < n; i++) printf(" %d", ddp_reducer_param_bucket(red, i, NULL));
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    for (i = 0; i < n; i++) CHECK_OK(ddp_reducer_grad_ready(red, atoi(argv[5 + n + i])), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    printf("\nrebuilt");
    for (i = 0; i < n; i++) printf(" %d", ddp_reducer_param_bucket(red, i, NULL));
    printf("\n");
    ddp_reducer_destroy(red);
    CHECK_OK(ddp_destroy(g), NULL);
    for (i = 0; i < n; i++) free(p[i]);
    free(p);
    return 0;
}

int main(int argc, char **argv) {
    job J;
    int i;
    if (argc >= 5 && !strcmp(argv[1], "layout")) return layout(argc, argv);
    CHECK(argc >= 11 && !strcmp(argv[1], "train"), "usage: see the top of reducer_peer.c");
    memset(&J, 0, sizeof J);
    J.dir = argv[2];
    J.variant = argv[3];
    J.R = atoi(argv[4]);
    J.B = atoi(argv[5]);
    J.steps = atoi(argv[6]);
    J.accum = atoi(argv[7]);
    J.lr = (float)atof(argv[8]);
    J.layers = argc - 10;
    CHECK(J.layers >= 1 && J.layers <= MAXL, "1 to %d layers", MAXL);
    for (i = 0; i <= J.layers; i++) J.dims[i] = atoi(argv[9 + i]);
    return tl_run_ranks(J.R, train_rank, &J, 120);
}
