/* ZeRO-1 checkpoints: AdamW state (m, v) that lives in shards (ddp_reducer_shards), saved
   (1) consolidated, as torch's ZeroRedundancyOptimizer.consolidate_state_dict: ddp_reducer_consolidate_state
       gathers every rank's shard state into full arrays on rank 0, which writes one ordinary checkpoint
       (parameters, "<param>.exp_avg", "<param>.exp_avg_sq"); every rank loads it and ddp_reducer_shard_state
       takes its shards' pieces out;
   (2) per rank, as slices: ddp_checkpoint_save_slices with one ddp_slice per shard (parameters too: each
       rank saves the values it owns), loaded by ddp_checkpoint_load_slices with the loading reducer's shards.
   Parameters of 7, 1000, 333, 4097 elements (none divides by the world size) in 3 buckets, 3 ranks:
   - N steps, both saves, M more steps: the reference. Fresh processes load each save and run the same M
     steps: parameters (and the final m, v, consolidated) equal the reference BIT FOR BIT;
   - the consolidated m and v equal a stage 0 reducer's full AdamW state run side by side (to rounding:
     the reduce-scatter adds in another order than the all-reduce);
   - another world size (2 ranks): resuming from the consolidated file and from the 3-rank slices gives
     bit-identical models after M steps;
   - placement on 1-4 ranks, root the last rank: f64 and u8 shard states whose values name their element
     land exactly at that element of the full arrays, and shard_state gives each rank its values back;
   - errors: a shard_count that is not the rank's total (one rank) or a wrong full_count on root is
     DDP_ERR_INVALID_ARGUMENT on every rank with that rank's message, at once; ranks that pass different
     nstates, or a root that is no rank, likewise; zero_stage 0 is DDP_ERR_STATE.
   AdamW on both sides is tests/ref_optim.h's. */
#include "testlib.h"
#include "ref_optim.h" /* ref_adamw: the program's AdamW on the shards (or on everything at stage 0) */

#define NP 4
#define N_STEPS 4
#define M_STEPS 3
static const size_t COUNT[NP] = {7, 1000, 333, 4097};
static char dir[256];

static float init_value(int p, size_t i) { return (float)((p * 31 + (int)i * 17) % 23) * 0.1f - 1.0f; }
/* Global sample k of step s (rank r of W takes samples r, r + W, ... of 6): the same data whatever the
   world size, so runs on 2 and 3 ranks see the same gradients up to the order of the additions. */
static float grad_of(int k, int s, int p, size_t i, float param) {
    return (float)((k * 7 + s * 3 + p * 13 + (int)i * 5) % 11 - 5) * 0.25f + 0.5f * param;
}
#define SAMPLES 6

typedef struct model {
    ddp_reducer *red;
    float *param[NP], *grad[NP];
    int n; /* shards */
    const ddp_shard *sh;
    size_t mine, total; /* shard elements; model elements */
    float *m, *v;       /* zero: shard state (mine); stage 0: full (total) */
} model;

static void model_build(ddp_group *g, int zero, model *M) {
    ddp_reducer_desc d;
    int p;
    size_t i;
    memset(&d, 0, sizeof d);
    memset(M, 0, sizeof *M);
    d.zero_stage = zero;
    d.first_bucket_bytes = d.bucket_cap_bytes = 4096; /* buckets {4097}, {333, 1000}, {7} */
    CHECK_OK(ddp_reducer_create(g, &d, &M->red), g);
    for (p = 0; p < NP; p++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        M->param[p] = (float *)malloc(COUNT[p] * sizeof(float));
        M->grad[p] = (float *)calloc(COUNT[p], sizeof(float));
        for (i = 0; i < COUNT[p]; i++) M->param[p][i] = init_value(p, i);
        M->total += COUNT[p];
        CHECK_OK(ddp_reducer_add_param(M->red, name, M->param[p], M->grad[p], COUNT[p], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(M->red), g);
    M->n = ddp_reducer_shards(M->red, &M->sh);
    M->mine = zero ? 0 : M->total;
    for (p = 0; zero && p < M->n; p++) M->mine += M->sh[p].count;
    M->m = (float *)calloc(M->mine + 1, sizeof(float));
    M->v = (float *)calloc(M->mine + 1, sizeof(float));
}

static void model_free(model *M) {
    int p;
    ddp_reducer_destroy(M->red);
    for (p = 0; p < NP; p++) free(M->param[p]), free(M->grad[p]);
    free(M->m), free(M->v);
}

/* Step s (from 0): backward of this rank's samples, averaged; AdamW on the shards (or everything). */
static void step(ddp_group *g, model *M, int zero, int s) {
    int p, k, j, world = ddp_world_size(g);
    size_t i, at = 0;
    CHECK_OK(ddp_reducer_begin_backward(M->red), g);
    for (p = NP - 1; p >= 0; p--) {
        for (k = ddp_rank(g); k < SAMPLES; k += world)
            for (i = 0; i < COUNT[p]; i++) M->grad[p][i] += grad_of(k, s, p, i, M->param[p][i]) * (float)world / SAMPLES;
        CHECK_OK(ddp_reducer_grad_ready(M->red, p), g);
    }
    CHECK_OK(ddp_reducer_end_backward(M->red), g);
    if (zero) {
        for (j = 0; j < M->n; at += M->sh[j].count, j++)
            ref_adamw((float *)M->sh[j].param_data, (const float *)M->sh[j].grad, M->m + at, M->v + at, M->sh[j].count, s + 1);
        CHECK_OK(ddp_reducer_gather_params(M->red), g);
    } else {
        for (p = 0; p < NP; at += COUNT[p], p++) ref_adamw(M->param[p], M->grad[p], M->m + at, M->v + at, COUNT[p], s + 1);
    }
    CHECK_OK(ddp_reducer_zero_grad(M->red), g);
}

/* The tensors of a full checkpoint: p<i>, p<i>.exp_avg, p<i>.exp_avg_sq (m and v point into full arrays). */
static char tnames[3 * NP][32];
static int full_tensors(model *M, float *m, float *v, ddp_tensor *t) {
    int p, k = 0;
    size_t at = 0;
    for (p = 0; p < NP; at += COUNT[p], p++) {
        static const char *const suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
        float *data[3];
        int s;
        data[0] = M->param[p], data[1] = m + at, data[2] = v + at;
        for (s = 0; s < 3; s++, k++) {
            memset(&t[k], 0, sizeof t[k]);
            snprintf(tnames[k], sizeof tnames[k], "p%d%s", p, suffix[s]);
            t[k].name = tnames[k], t[k].dtype = DDP_F32, t[k].ndim = 1, t[k].shape[0] = (int64_t)COUNT[p], t[k].data = data[s];
        }
    }
    return k;
}

/* Per-rank slices: for each shard its parameter values, m and v; with whole = 1 the whole parameters
   (what a loading rank needs of them) instead of the owned values. */
static int shard_slices(model *M, int whole, ddp_slice *s) {
    int j, k = 0, p;
    size_t at = 0;
    for (p = 0; whole && p < NP; p++, k++) {
        s[k].name = tnames[3 * p], s[k].dtype = DDP_F32, s[k].global_count = COUNT[p];
        s[k].offset = 0, s[k].count = COUNT[p], s[k].data = M->param[p];
    }
    for (j = 0; j < M->n; at += M->sh[j].count, j++) {
        const ddp_shard *sh = &M->sh[j];
        float *data[3];
        int x;
        data[0] = (float *)sh->param_data, data[1] = M->m + at, data[2] = M->v + at;
        for (x = whole ? 1 : 0; x < 3; x++, k++) {
            s[k].name = tnames[3 * sh->param + x], s[k].dtype = DDP_F32, s[k].global_count = COUNT[sh->param];
            s[k].offset = sh->offset, s[k].count = sh->count, s[k].data = data[x];
        }
    }
    return k;
}

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

/* Rank 0: the final model and its consolidated state, for the comparisons (one process, g NULL). */
static void final_save(ddp_group *g, model *M, const char *name) {
    float *m = NULL, *v = NULL;
    void *full[2];
    const void *st[2];
    ddp_tensor t[3 * NP];
    char path[300];
    if (ddp_rank(g) == 0) m = (float *)calloc(M->total, sizeof(float)), v = (float *)calloc(M->total, sizeof(float));
    full[0] = m, full[1] = v, st[0] = M->m, st[1] = M->v;
    CHECK_OK(ddp_reducer_consolidate_state(M->red, DDP_F32, 2, st, M->mine, full, M->total, 0), g);
    full_tensors(M, m, v, t);
    path_of(path, sizeof path, name);
    CHECK_OK(ddp_checkpoint_save(g, path, t, 3 * NP, NULL), g);
    free(m), free(v);
}

/* The reference, on 3 ranks: N steps (a stage 0 model beside it), both saves, M steps, the final model. */
static int reference_main(int rank, int n, void *arg) {
    ddp_group *g;
    model Z, A;
    int s, k;
    size_t i;
    float *m = NULL, *v = NULL;
    void *full[2];
    const void *st[2];
    ddp_tensor t[3 * NP];
    ddp_slice sl[3 * (NP + 4)];
    char path[300];
    double worst = 0;
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    model_build(g, 1, &Z);
    model_build(g, 0, &A);
    for (s = 0; s < N_STEPS; s++) step(g, &Z, 1, s), step(g, &A, 0, s);
    if (rank == 0) m = (float *)calloc(Z.total, sizeof(float)), v = (float *)calloc(Z.total, sizeof(float));
    full[0] = m, full[1] = v, st[0] = Z.m, st[1] = Z.v;
    CHECK_OK(ddp_reducer_consolidate_state(Z.red, DDP_F32, 2, st, Z.mine, full, Z.total, 0), g);
    if (rank == 0) /* the consolidated state is stage 0's full AdamW state, to rounding */
        for (i = 0; i < Z.total; i++) {
            CHECK(fabs(m[i] - A.m[i]) <= 1e-6 * (fabs(A.m[i]) + 1) && fabs(v[i] - A.v[i]) <= 1e-6 * (fabs(A.v[i]) + 1),
                  "element %zu of the model: consolidated m %.9g v %.9g, stage 0 m %.9g v %.9g", i, (double)m[i],
                  (double)v[i], (double)A.m[i], (double)A.v[i]);
            worst = fmax(worst, fmax(fabs(m[i] - A.m[i]), fabs(v[i] - A.v[i])));
        }
    full_tensors(&Z, m, v, t);
    path_of(path, sizeof path, "consolidated.safetensors");
    CHECK_OK(ddp_checkpoint_save(g, path, t, 3 * NP, NULL), g);
    k = shard_slices(&Z, 0, sl);
    path_of(path, sizeof path, "slices.safetensors");
    CHECK_OK(ddp_checkpoint_save_slices(g, path, sl, k, NULL, NULL), g);
    if (rank == 0) printf("  3 ranks, %d steps: consolidated m, v = stage 0's AdamW state (largest difference %.3g)\n", N_STEPS, worst);
    for (s = N_STEPS; s < N_STEPS + M_STEPS; s++) step(g, &Z, 1, s);
    final_save(g, &Z, "reference.safetensors");
    free(m), free(v);
    model_free(&Z);
    model_free(&A);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Fresh processes: a model with other values, the state from a save (arg: "consolidated" or "slices"),
   M steps, the final model to "<how>-<world>.safetensors". */
static int resume_main(int rank, int n, void *arg) {
    const char *how = (const char *)arg;
    ddp_group *g;
    model Z;
    int s, p, k;
    size_t i;
    char path[300], name[64];
    (void)rank;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    model_build(g, 1, &Z);
    for (p = 0; p < NP; p++)
        for (i = 0; i < COUNT[p]; i++) Z.param[p][i] = 99.0f; /* the load must replace all */
    if (!strcmp(how, "consolidated")) {
        float *m = (float *)calloc(Z.total, sizeof(float)), *v = (float *)calloc(Z.total, sizeof(float));
        void *st[2];
        const void *full[2];
        ddp_tensor t[3 * NP];
        full_tensors(&Z, m, v, t);
        path_of(path, sizeof path, "consolidated.safetensors");
        CHECK_OK(ddp_checkpoint_load(g, path, t, 3 * NP, NULL), g);
        full[0] = m, full[1] = v, st[0] = Z.m, st[1] = Z.v;
        CHECK_OK(ddp_reducer_shard_state(Z.red, DDP_F32, 2, full, Z.total, st, Z.mine), g);
        free(m), free(v);
    } else {
        ddp_slice sl[3 * (NP + 4)];
        ddp_tensor names[3 * NP];
        full_tensors(&Z, Z.m, Z.v, names); /* (for the names) */
        k = shard_slices(&Z, 1, sl);
        path_of(path, sizeof path, "slices.safetensors");
        CHECK_OK(ddp_checkpoint_load_slices(g, path, sl, k, NULL), g);
    }
    for (s = N_STEPS; s < N_STEPS + M_STEPS; s++) step(g, &Z, 1, s);
    snprintf(name, sizeof name, "%s-%d.safetensors", how, n);
    final_save(g, &Z, name);
    model_free(&Z);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* The final models (parameters, consolidated m and v) of two runs: equal bit for bit. */
static void same_bits(const char *a, const char *b) {
    char pa[300], pb[300];
    float *x = (float *)malloc(4097 * sizeof(float)), *y = (float *)malloc(4097 * sizeof(float));
    ddp_checkpoint_load_desc one;
    int p, s;
    memset(&one, 0, sizeof one);
    one.allow_unexpected = 1; /* one tensor at a time */
    path_of(pa, sizeof pa, a);
    path_of(pb, sizeof pb, b);
    for (p = 0; p < NP; p++)
        for (s = 0; s < 3; s++) {
            ddp_tensor ta, tb;
            memset(&ta, 0, sizeof ta);
            snprintf(tnames[0], sizeof tnames[0], "p%d%s", p, s == 0 ? "" : s == 1 ? ".exp_avg" : ".exp_avg_sq");
            ta.name = tnames[0], ta.dtype = DDP_F32, ta.ndim = 1, ta.shape[0] = (int64_t)COUNT[p];
            tb = ta, ta.data = x, tb.data = y;
            CHECK_OK(ddp_checkpoint_load_ex(NULL, pa, &ta, 1, NULL, &one), NULL);
            CHECK_OK(ddp_checkpoint_load_ex(NULL, pb, &tb, 1, NULL, &one), NULL);
            CHECK(memcmp(x, y, COUNT[p] * sizeof(float)) == 0, "%s and %s differ in %s", a, b, ta.name);
        }
    free(x), free(y);
}

/* Placement, any dtype: a shard state (f64, and a u8 one) whose value names its element (parameter p,
   element i: p * 1e6 + i) consolidates on the last rank to full arrays in which element k of the model holds
   exactly that name; shard_state gives every rank its values back. */
static int placement_main(int rank, int n, void *arg) {
    ddp_group *g;
    model Z;
    double *mine, *full = NULL, *back;
    unsigned char *b8, *f8 = NULL;
    void *fp[1], *bp[1];
    const void *st[1];
    size_t i, at = 0, k;
    int j, p;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    model_build(g, 1, &Z);
    mine = (double *)calloc(Z.mine + 1, sizeof(double)), back = (double *)calloc(Z.mine + 1, sizeof(double));
    b8 = (unsigned char *)calloc(Z.mine + 1, 1);
    for (j = 0; j < Z.n; j++)
        for (i = 0; i < Z.sh[j].count; i++, at++) {
            mine[at] = Z.sh[j].param * 1e6 + (double)(Z.sh[j].offset + i);
            b8[at] = (unsigned char)(rank + 1);
        }
    if (rank == n - 1) full = (double *)calloc(Z.total, sizeof(double)), f8 = (unsigned char *)calloc(Z.total, 1);
    st[0] = mine, fp[0] = full;
    CHECK_OK(ddp_reducer_consolidate_state(Z.red, DDP_F64, 1, st, Z.mine, fp, Z.total, n - 1), g);
    st[0] = b8, fp[0] = f8;
    CHECK_OK(ddp_reducer_consolidate_state(Z.red, DDP_U8, 1, st, Z.mine, fp, Z.total, n - 1), g);
    if (rank == n - 1) {
        for (p = 0, k = 0; p < NP; p++)
            for (i = 0; i < COUNT[p]; i++, k++) {
                CHECK(full[k] == p * 1e6 + (double)i, "%d ranks: element %zu of the full array holds %.0f, not p%d[%zu]", n, k,
                      full[k], p, i);
                CHECK(f8[k] >= 1 && f8[k] <= n, "%d ranks: element %zu came from no rank (%d)", n, k, f8[k]);
            }
    } else {
        full = (double *)calloc(Z.total, sizeof(double));
        for (p = 0, k = 0; p < NP; p++)
            for (i = 0; i < COUNT[p]; i++, k++) full[k] = p * 1e6 + (double)i;
    }
    fp[0] = full, bp[0] = back;
    CHECK_OK(ddp_reducer_shard_state(Z.red, DDP_F64, 1, (const void *const *)fp, Z.total, bp, Z.mine), g);
    CHECK(memcmp(back, mine, Z.mine * sizeof(double)) == 0, "%d ranks, rank %d: shard_state gave other values", n, rank);
    free(mine), free(back), free(full), free(b8), free(f8);
    model_free(&Z);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Bad arguments: every rank fails at once with the guilty rank's message; nothing hangs. */
static int errors_main(int rank, int n, void *arg) {
    ddp_group *g;
    model Z, A;
    float *full = NULL;
    void *fp[2];
    const void *st[2];
    ddp_result res;
    double t0;
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    model_build(g, 1, &Z);
    full = (float *)calloc(Z.total + 1, sizeof(float));
    fp[0] = fp[1] = full, st[0] = st[1] = Z.m;
    t0 = tl_now();
    res = ddp_reducer_consolidate_state(Z.red, DDP_F32, 1, st, Z.mine + (rank == 1), fp, Z.total, 0);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "rank 1: shard_count is"), "rank %d: one rank's "
          "shard_count wrong: %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    CHECK(tl_now() - t0 < 10, "rank %d: took %.1f s", rank, tl_now() - t0);
    if (rank == 0) printf("  a wrong shard_count on rank 1: every rank in %.2f ms: %s\n", (tl_now() - t0) * 1e3, ddp_last_error(g));
    t0 = tl_now();
    res = ddp_reducer_consolidate_state(Z.red, DDP_F32, 1, st, Z.mine, fp, Z.total + 1, 0);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "rank 0: full_count is"), "rank %d: root's "
          "full_count wrong: %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    res = ddp_reducer_consolidate_state(Z.red, DDP_F32, 1 + (rank == 2), st, Z.mine, fp, Z.total, 0);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "rank 0 passed nstates 1, rank 2 passed 2"),
          "rank %d: nstates differ: %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    res = ddp_reducer_consolidate_state(Z.red, DDP_F32, 1, st, Z.mine, fp, Z.total, 3);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "root 3 is not a rank"), "rank %d: root 3: %s", rank,
          ddp_last_error(g));
    CHECK(tl_now() - t0 < 10, "rank %d: took %.1f s", rank, tl_now() - t0);
    /* the local inverse */
    res = ddp_reducer_shard_state(Z.red, DDP_F32, 1, (const void *const *)fp, Z.total - 1, (void *const *)fp, Z.mine);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "full_count is"), "shard_state full_count: %s",
          ddp_last_error(g));
    /* the group still works: a good call after the bad ones */
    CHECK_OK(ddp_reducer_consolidate_state(Z.red, DDP_F32, 2, st, Z.mine, fp, Z.total, 0), g);
    model_build(g, 0, &A);
    res = ddp_reducer_consolidate_state(A.red, DDP_F32, 1, st, 0, fp, A.total, 0);
    CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "zero_stage = 0"), "zero_stage 0: %s", ddp_last_error(g));
    model_free(&A);
    model_free(&Z);
    free(full);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    char cmd[300];
    int w;
    snprintf(dir, sizeof dir, "%s/zero_ckpt_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir), "mkdtemp");
    CHECK(tl_run_ranks(3, reference_main, NULL, 60) == 0, "reference run");
    CHECK(tl_run_ranks(3, resume_main, (void *)"consolidated", 60) == 0, "resume from the consolidated file");
    same_bits("reference.safetensors", "consolidated-3.safetensors");
    printf("  3 ranks: resumed from the consolidated file = the uninterrupted run, bit for bit (%d + %d steps)\n", N_STEPS,
           M_STEPS);
    CHECK(tl_run_ranks(3, resume_main, (void *)"slices", 60) == 0, "resume from the per-rank slices");
    same_bits("reference.safetensors", "slices-3.safetensors");
    printf("  3 ranks: resumed from the per-rank slices = the uninterrupted run, bit for bit\n");
    CHECK(tl_run_ranks(2, resume_main, (void *)"consolidated", 60) == 0, "2 ranks from the consolidated file");
    CHECK(tl_run_ranks(2, resume_main, (void *)"slices", 60) == 0, "2 ranks from the 3 ranks' slices");
    same_bits("consolidated-2.safetensors", "slices-2.safetensors");
    printf("  2 ranks: resumed from 3 ranks' slices = resumed from the consolidated file, bit for bit\n");
    for (w = 1; w <= 4; w++) CHECK(tl_run_ranks(w, placement_main, NULL, 60) == 0, "placement, %d ranks", w);
    printf("  1-4 ranks: every model element consolidated to its place (f64, u8; root = the last rank) and back\n");
    CHECK(tl_run_ranks(3, errors_main, NULL, 60) == 0, "bad arguments");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "rm");
    printf("test_reducer_zero_ckpt: ok\n");
    return 0;
}
