/* ZeRO stage 1 and 2 (torch's ZeroRedundancyOptimizer with DDP, DeepSpeed stage 1/2): zero_stage = 1
   reduce-scatters each bucket, ddp_reducer_shards lists this rank's slices, the program runs AdamW on exactly
   those, and ddp_reducer_gather_params all-gathers the updated slices; zero_stage = 2 does the same through
   a pool of 2 comm buffers and keeps only the owned slices (the shards' grad points into the reducer).
   Parameter sizes that do not divide the world size (7, 1000, 333, 4097) in several buckets, on 1-4 ranks:
   (a) ownership: every element of every parameter is owned by exactly one rank (an all-reduce of the
       ranks' ownership maps, computed in the test from the shard lists), and each rank's shards are what
       the documented rule gives (bucket of count elements, per = ceil(count / world), rank r owns bucket
       elements [r * per, min(count, (r + 1) * per)), computed here from ddp_reducer_param_bucket);
   (b) training: a ZeRO-1 reducer whose AdamW state covers only its shards, against a stage 0 reducer with
       full AdamW on every rank (both tests/ref_optim.h's), same data, side by side on the same group: after
       each of 5 steps the shards' gradients equal stage 0's averaged gradients and every parameter equals stage 0's (1e-6 of |value| + 1;
       bf16 compression: 2e-2, as test_reducer), plain, no_sync x2, bf16, one flat grads_memory and
       gradient_as_bucket_view; shared memory by default, DDP_TRANSPORT=tcp too. ZeRO-2 likewise (but
       view), and: 4 buckets for a pool of 2 (buckets wait for the oldest reduce-scatter to take its
       buffer; gradient_bytes shows the pool stayed at 2), gradients ready in forward order (the pool
       grows to one buffer per bucket), ONE scratch gradient buffer shared by every parameter (each
       gradient computed into it just before grad_ready and overwritten with NaN just after), the shards'
       gradients in the reducer's memory (not the program's) and zeroed by zero_grad; gradient_bytes by its
       formula. Overlapped gather (4 buckets, stage 1 and 2, f32 and bf16): ddp_reducer_gather_params_async,
       then ddp_reducer_wait_param before each parameter is read in forward order: every parameter equals
       stage 0's right after its wait.
       find_unused_parameters (stage 1 and 2, plain, 4 buckets, bf16, no_sync x2, view): ranks skip
       parameters (skips()), a parameter used on no rank in a step gets 42 written into its gradient (stage
       0: the program's buffer; ZeRO: its shards' gradients) before backward, which must still be 42 after
       it; ddp_reducer_param_used against the test's own rule; AdamW skips unused parameters on both sides.
   (c) the refused combinations: zero_stage 2 with gradient_as_bucket_view (stage 1 and 2 with
       uneven_inputs, with or without find_unused_parameters, work: test_reducer_join); gather_params
       without zero_stage; ranks with different zero_stage (0 against 1, 1 against 2): DDP_ERR_MISMATCH on
       every rank at finalize.
   (d) gradient memory (statistics' gradient_bytes) for 64 parameters in 32 buckets: stage 0 = the
       buckets, stage 1 = padded comm + slices, stage 2 = slices + 2 pool buffers <= stage 0 / world + the
       pool, each by its formula. */
#include "testlib.h"
#include "ref_optim.h" /* ref_adamw: AdamW (torch.optim.AdamW), the program's optimizer on both sides */

#define NP 4
#define STEPS 5
static const size_t COUNT[NP] = {7, 1000, 333, 4097};

typedef struct mode {
    const char *name;
    int view, accum, flat;
    ddp_dtype comm;
    double tol;     /* relative, parameters and gradients */
    size_t cap;     /* bucket cap and first bucket bytes (0: 4096: buckets {4097}, {333, 1000}, {7}) */
    int nbuckets;   /* what that cap gives */
    int scratch;    /* zero_stage 2 only: one gradient buffer for every parameter */
    int forward;    /* gradients ready in registration order (against the buckets' order) */
    int npool;      /* zero_stage 2: comm buffers the pool ends with */
    int overlap;    /* gather_params_async, then wait_param before each parameter is read (forward order) */
    int unused;     /* find_unused_parameters: ranks skip parameters (see skips()) */
} mode;

static const mode MODES[] = {
    {"plain", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 0},
    {"no_sync x2", 0, 2, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 0},
    {"bf16", 0, 1, 0, DDP_BF16, 2e-2, 0, 3, 0, 0, 2, 0, 0}, /* test_reducer's bf16 tolerance: bf16 keeps 8 significant bits */
    {"flat grads_memory", 0, 1, 1, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 0},
    {"view+no_sync x2", 1, 2, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 0},
    {"4 buckets", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 1024, 4, 0, 0, 2, 0, 0},     /* {4097}, {333}, {1000}, {7} */
    {"4 buckets bf16", 0, 1, 0, DDP_BF16, 2e-2, 1024, 4, 0, 0, 2, 0, 0},
    {"forward order", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 1024, 4, 0, 1, 4, 0, 0},
    {"scratch grad", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 1024, 4, 1, 0, 2, 0, 0},
    {"overlapped gather", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 1024, 4, 0, 0, 2, 1, 0},
    {"overlapped gather bf16", 0, 1, 0, DDP_BF16, 2e-2, 1024, 4, 0, 0, 2, 1, 0},
    {"find_unused", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 1},
    {"find_unused 4 buckets", 0, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 1024, 4, 0, 0, 2, 0, 1},
    {"find_unused bf16", 0, 1, 0, DDP_BF16, 2e-2, 1024, 4, 0, 0, 2, 0, 1},
    {"find_unused no_sync x2", 0, 2, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 1},
    {"find_unused view", 1, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 0, 3, 0, 0, 2, 0, 1},
};

static float init_value(int p, size_t i) { return (float)((p * 31 + (int)i * 17) % 23) * 0.1f - 1.0f; }

/* Rank r's gradient of micro-batch m in step s: depends on the parameter (so stale parameters would show). */
static float grad_of(int r, int s, int m, int p, size_t i, float param) {
    return (float)((r * 7 + s * 3 + m * 2 + p * 13 + (int)i * 5) % 11 - 5) * 0.25f + 0.5f * param;
}

/* Equal to rounding: |got - want| <= tol * (|want| + scale). Relative for large values; near zero relative
   to `scale`, the size of the terms: an averaged gradient is a sum of terms of size ~1 that may cancel,
   added in another order by a reduce-scatter than by an all-reduce (in bf16 that is an ulp of 2^-8), and
   parameters are of size ~1 too. */
static int close_enough(double got, double want, double tol, double scale) { return fabs(got - want) <= tol * (fabs(want) + scale); }

/* find_unused modes: does rank r leave parameter p without a gradient in step s (every micro-batch)? p0 on
   every rank in odd steps (no rank uses it: its gradient must be left as it was); the others on some ranks
   (used elsewhere: the average over all ranks, this rank's part zero), on every rank only with 1 rank. */
static int skips(int r, int s, int p) { return p == 0 ? s % 2 == 1 : (r + s + p) % 3 == 0; }

/* ... and in micro-batch m of accum: with accumulation, some parameters also skip the synchronised
   micro-batch alone (a gradient from an earlier no_sync pass, not ready in the synchronised one). */
static int skips_micro(int r, int s, int m, int accum, int p) {
    return skips(r, s, p) || (accum > 1 && m == accum - 1 && p != 0 && (r + s + p) % 3 == 1);
}

static int used_anywhere(int world, int s, int p) {
    int r;
    for (r = 0; r < world; r++)
        if (!skips(r, s, p)) return 1;
    return 0;
}

#define KEPT 42.0f /* what a test writes into the gradients of a parameter that no rank uses in the step */

typedef struct model {
    ddp_reducer *red;
    float *param[NP], *grad[NP], *grads_memory, *scratch;
} model;

static void model_build(ddp_group *g, const mode *md, int zero, model *M) {
    ddp_reducer_desc d;
    size_t total = 0, i;
    int p;
    memset(&d, 0, sizeof d);
    memset(M, 0, sizeof *M);
    d.zero_stage = zero;
    d.find_unused_parameters = md->unused;
    d.gradient_as_bucket_view = md->view;
    d.comm_dtype = md->comm;
    d.first_bucket_bytes = d.bucket_cap_bytes = md->cap ? md->cap : 4096;
    CHECK_OK(ddp_reducer_create(g, &d, &M->red), g);
    for (p = 0; p < NP; p++) total += COUNT[p];
    if (md->flat) M->grads_memory = (float *)calloc(total, sizeof(float));
    if (md->scratch && zero == 2) M->scratch = (float *)calloc(COUNT[NP - 1], sizeof(float)); /* the largest */
    for (p = 0, total = 0; p < NP; p++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        M->param[p] = (float *)malloc(COUNT[p] * sizeof(float));
        M->grad[p] = md->view ? NULL : M->scratch ? M->scratch : md->flat ? M->grads_memory + total
                   : (float *)calloc(COUNT[p], sizeof(float));
        total += COUNT[p];
        for (i = 0; i < COUNT[p]; i++) M->param[p][i] = ddp_rank(g) == 0 ? init_value(p, i) : 99.0f; /* rank 0's */
        CHECK_OK(ddp_reducer_add_param(M->red, name, M->param[p], M->grad[p], COUNT[p], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(M->red), g);
}

static void model_free(model *M) {
    int p;
    ddp_reducer_destroy(M->red);
    for (p = 0; p < NP; p++) {
        free(M->param[p]);
        if (!M->grads_memory && !M->scratch) free(M->grad[p]);
    }
    free(M->grads_memory);
    free(M->scratch);
}

/* One step's backward: accum micro-batches, the last synchronised. With one scratch buffer each gradient
   is written into it just before grad_ready and spoiled (NaN) just after: the reducer must have taken it. */
static void backward(ddp_group *g, const mode *md, model *M, int s) {
    int m, q, p;
    size_t i;
    for (m = 0; m < md->accum; m++) {
        CHECK_OK(ddp_reducer_set_sync(M->red, m == md->accum - 1), g);
        CHECK_OK(ddp_reducer_begin_backward(M->red), g);
        for (q = 0; q < NP; q++) {
            float *gp;
            p = md->forward ? q : NP - 1 - q;
            if (md->unused && skips_micro(ddp_rank(g), s, m, md->accum, p)) continue;
            gp = (float *)ddp_reducer_grad(M->red, p);
            if (M->scratch)
                for (i = 0; i < COUNT[p]; i++) gp[i] = grad_of(ddp_rank(g), s, m, p, i, M->param[p][i]);
            else
                for (i = 0; i < COUNT[p]; i++) gp[i] += grad_of(ddp_rank(g), s, m, p, i, M->param[p][i]);
            CHECK_OK(ddp_reducer_grad_ready(M->red, p), g);
            if (M->scratch)
                for (i = 0; i < COUNT[NP - 1]; i++) M->scratch[i] = NAN;
        }
        CHECK_OK(ddp_reducer_end_backward(M->red), g);
    }
}

/* Does pointer x lie in one of the program's gradient buffers? */
static int in_program_grads(const model *M, const void *x) {
    int p;
    for (p = 0; p < NP; p++)
        if (M->grad[p] && (const float *)x >= M->grad[p] && (const float *)x < M->grad[p] + COUNT[p]) return 1;
    return 0;
}

/* zero_stage 2's gradient_bytes by the documented layout: the owned slices (per = ceil(count / world)
   elements of f32 per bucket) + npool buffers of world * max(per) f32 rounded up to 64 bytes, + under
   compression a landing area of max(per) comm elements. */
static uint64_t stage2_bytes(ddp_reducer *red, int world, int npool, size_t comm_size) {
    size_t count[2 * NP] = {0}, per, maxper = 0, off, total = 0, pool;
    int p, b, nb = 0;
    for (p = 0; p < NP; p++) {
        b = ddp_reducer_param_bucket(red, p, &off);
        count[b] += COUNT[p];
        nb = b + 1 > nb ? b + 1 : nb;
    }
    for (b = 0; b < nb; b++) {
        per = (count[b] + (size_t)world - 1) / (size_t)world;
        total += per * sizeof(float);
        maxper = per > maxper ? per : maxper;
    }
    pool = ((size_t)world * maxper * sizeof(float) + 63) / 64 * 64 + (comm_size != sizeof(float) ? maxper * comm_size : 0);
    return total + (uint64_t)npool * pool;
}

/* (a) every element owned by exactly one rank, and the shards are the documented rule's. */
static void check_ownership(ddp_group *g, const char *what, ddp_reducer *red) {
    int world = ddp_world_size(g), rank = ddp_rank(g), n, j, p, k = 0;
    size_t total = 0, at[NP], bucket_count[NP] = {0}, off[NP], mine = 0, i;
    int bucket[NP];
    const ddp_shard *sh;
    int32_t *owners;
    for (p = 0; p < NP; p++) at[p] = total, total += COUNT[p];
    owners = (int32_t *)calloc(total, sizeof *owners);
    n = ddp_reducer_shards(red, &sh);
    CHECK(n >= 0, "%s: ddp_reducer_shards: %d", what, n);
    for (j = 0; j < n; j++) {
        CHECK(sh[j].param >= 0 && sh[j].param < NP && sh[j].offset + sh[j].count <= COUNT[sh[j].param] && sh[j].count > 0,
              "%s rank %d: shard %d {param %d, offset %zu, count %zu} out of range", what, rank, j, sh[j].param,
              sh[j].offset, sh[j].count);
        for (i = 0; i < sh[j].count; i++) owners[at[sh[j].param] + sh[j].offset + i]++;
        mine += sh[j].count;
    }
    CHECK_OK(ddp_all_reduce(g, owners, total, DDP_I32, DDP_SUM), g);
    for (i = 0; i < total; i++) CHECK(owners[i] == 1, "%s, %d ranks: element %zu of the model is owned by %d ranks", what, world, i, owners[i]);
    /* the rule, from the bucket layout */
    for (p = 0; p < NP; p++) {
        bucket[p] = ddp_reducer_param_bucket(red, p, &off[p]);
        CHECK(bucket[p] >= 0 && bucket[p] < NP, "%s: bucket of p%d", what, p);
        bucket_count[bucket[p]] += COUNT[p];
    }
    memset(owners, 0, total * sizeof *owners);
    for (j = 0; j < n; j++)
        for (i = 0; i < sh[j].count; i++) owners[at[sh[j].param] + sh[j].offset + i] = 1;
    for (p = 0; p < NP; p++)
        for (i = 0; i < COUNT[p]; i++) {
            size_t per = (bucket_count[bucket[p]] + (size_t)world - 1) / (size_t)world, e = off[p] + i;
            int want = e >= (size_t)rank * per && e < (size_t)(rank + 1) * per;
            CHECK(owners[at[p] + i] == want, "%s, %d ranks, rank %d: p%d[%zu] (bucket %d element %zu, slices of %zu) owned %d, "
                  "the rule says %d", what, world, rank, p, i, bucket[p], e, per, owners[at[p] + i], want);
            k += want;
        }
    CHECK((size_t)k == mine, "%s: shard elements %zu, rule %d", what, mine, k);
    free(owners);
}

static void train(ddp_group *g, const mode *md, int stage) {
    int world = ddp_world_size(g), rank = ddp_rank(g), s, p, j, n;
    model A, B; /* A: stage 0 with full AdamW; B: ZeRO-1 or 2 */
    float *mA[NP], *vA[NP], **mB, **vB;
    const ddp_shard *sh;
    size_t i, state = 0, total = 0;
    model_build(g, md, 0, &A);
    model_build(g, md, stage, &B);
    check_ownership(g, md->name, B.red);
    {
        ddp_reducer_statistics st;
        CHECK_OK(ddp_reducer_get_statistics(B.red, &st), g);
        CHECK(st.buckets == md->nbuckets && (stage == 2 ? st.flat_buckets == 0 : !md->flat || st.flat_buckets == md->nbuckets),
              "%s, stage %d: %d buckets, %d flat (stage 2 copies)", md->name, stage, st.buckets, st.flat_buckets);
    }
    n = ddp_reducer_shards(B.red, &sh);
    mB = (float **)calloc((size_t)n + 1, sizeof *mB);
    vB = (float **)calloc((size_t)n + 1, sizeof *vB);
    for (j = 0; j < n; j++) { /* optimizer state for the shards only */
        mB[j] = (float *)calloc(sh[j].count, sizeof(float));
        vB[j] = (float *)calloc(sh[j].count, sizeof(float));
        state += 2 * sh[j].count * sizeof(float);
    }
    for (p = 0; p < NP; p++) {
        mA[p] = (float *)calloc(COUNT[p], sizeof(float));
        vA[p] = (float *)calloc(COUNT[p], sizeof(float));
        total += COUNT[p];
    }
    /* balance: at most one element per bucket above an even share (3 buckets) */
    CHECK(state <= 2 * sizeof(float) * (total / (size_t)world + 3), "%s rank %d: %zu bytes of optimizer state, model %zu "
          "elements on %d ranks", md->name, rank, state, total, world);
    for (s = 0; s < STEPS; s++) {
        int used[NP];
        for (p = 0; p < NP; p++) { /* a gradient no rank touches in this step must come out as it went in */
            float *ga = (float *)ddp_reducer_grad(A.red, p);
            used[p] = !md->unused || used_anywhere(world, s, p);
            for (i = 0; i < COUNT[p] && !used[p]; i++) ga[i] = KEPT;
            for (j = 0; j < n && !used[p]; j++)
                if (sh[j].param == p)
                    for (i = 0; i < sh[j].count; i++) ((float *)sh[j].grad)[i] = KEPT;
        }
        backward(g, md, &A, s);
        backward(g, md, &B, s);
        CHECK(ddp_reducer_param_used(B.red, NP) == -1 && strstr(ddp_last_error(g), "index 4 is not a parameter (0 .. 3)") &&
              ddp_reducer_param_used(NULL, 0) == -1 && strstr(ddp_last_error(NULL), "the reducer is NULL"),
              "ddp_reducer_param_used with a bad argument: %s", ddp_last_error(g));
        for (p = 0; p < NP; p++) {
            const float *ga = (const float *)ddp_reducer_grad(A.red, p);
            CHECK(ddp_reducer_param_used(A.red, p) == used[p] && ddp_reducer_param_used(B.red, p) == used[p], "%s, stage %d, "
                  "step %d: ddp_reducer_param_used(p%d) = %d (stage 0: %d), want %d", md->name, stage, s, p,
                  ddp_reducer_param_used(B.red, p), ddp_reducer_param_used(A.red, p), used[p]);
            for (i = 0; i < COUNT[p] && !used[p]; i++)
                CHECK(ga[i] == KEPT, "%s, stage 0, step %d: p%d[%zu] = %g: no rank used it, its gradient must stay %g",
                      md->name, s, p, i, (double)ga[i], (double)KEPT);
        }
        for (j = 0; j < n; j++) { /* the shards' gradients are stage 0's averages */
            const float *ga = (const float *)ddp_reducer_grad(A.red, sh[j].param) + sh[j].offset;
            const float *gb = (const float *)sh[j].grad;
            if (stage == 1)
                CHECK(gb == (const float *)ddp_reducer_grad(B.red, sh[j].param) + sh[j].offset, "%s: shard %d's grad pointer",
                      md->name, j);
            else /* the reducer's owned slice, never the program's buffers */
                CHECK(!in_program_grads(&B, gb) && !in_program_grads(&B, gb + sh[j].count - 1), "%s, stage 2: shard %d's "
                      "grad points into the program's gradient buffers", md->name, j);
            for (i = 0; i < sh[j].count && !used[sh[j].param]; i++)
                CHECK(gb[i] == KEPT, "%s, stage %d, step %d: shard %d (p%d) grad [%zu] = %g: no rank used it, it must stay %g",
                      md->name, stage, s, j, sh[j].param, i, (double)gb[i], (double)KEPT);
            for (i = 0; i < sh[j].count; i++)
                CHECK(close_enough(gb[i], ga[i], md->tol, 1.0), "%s, stage %d, %d ranks, rank %d step %d: grad p%d[%zu] = "
                      "%.8g, stage 0 %.8g", md->name, stage, world, rank, s, sh[j].param, sh[j].offset + i, (double)gb[i],
                      (double)ga[i]);
        }
        for (p = 0; p < NP; p++) /* torch's optimizers skip a parameter whose .grad is None */
            if (used[p]) ref_adamw(A.param[p], (const float *)ddp_reducer_grad(A.red, p), mA[p], vA[p], COUNT[p], s + 1);
        for (j = 0; j < n; j++)
            if (ddp_reducer_param_used(B.red, sh[j].param))
                ref_adamw((float *)sh[j].param_data, (const float *)sh[j].grad, mB[j], vB[j], sh[j].count, s + 1);
        if (md->overlap) CHECK_OK(ddp_reducer_gather_params_async(B.red), g);
        else CHECK_OK(ddp_reducer_gather_params(B.red), g);
        for (p = 0; p < NP; p++) { /* forward reads them in registration order */
            CHECK_OK(ddp_reducer_wait_param(B.red, p), g);
            for (i = 0; i < COUNT[p]; i++)
                CHECK(close_enough(B.param[p][i], A.param[p][i], md->tol, 1.0), "%s, stage %d, %d ranks, rank %d after step "
                      "%d: p%d[%zu] = %.8g, stage 0 %.8g", md->name, stage, world, rank, s, p, i, (double)B.param[p][i],
                      (double)A.param[p][i]);
        }
        CHECK_OK(ddp_reducer_zero_grad(A.red), g);
        CHECK_OK(ddp_reducer_zero_grad(B.red), g);
        for (j = 0; j < n; j++) /* zero_grad reaches the shards' gradients wherever they live */
            for (i = 0; i < sh[j].count; i++)
                CHECK(((const float *)sh[j].grad)[i] == 0.0f, "%s, stage %d: shard %d's gradient [%zu] = %g after zero_grad",
                      md->name, stage, j, i, (double)((const float *)sh[j].grad)[i]);
    }
    if (stage == 2) { /* find_unused: a bucket whose gradients never came may find the pool held by later ones */
        ddp_reducer_statistics st;
        int npool, fits = 0;
        CHECK_OK(ddp_reducer_get_statistics(B.red, &st), g);
        for (npool = md->npool; npool <= (md->unused ? md->nbuckets : md->npool); npool++)
            fits |= st.gradient_bytes == stage2_bytes(B.red, world, npool, md->comm == DDP_BF16 ? 2 : sizeof(float));
        CHECK(fits, "%s, stage 2, %d ranks: gradient_bytes %llu, want %llu (%d pool buffers%s)", md->name, world,
              (unsigned long long)st.gradient_bytes,
              (unsigned long long)stage2_bytes(B.red, world, md->npool, md->comm == DDP_BF16 ? 2 : sizeof(float)), md->npool,
              md->unused ? " or up to one per bucket" : "");
    }
    if (rank == 0)
        printf("  %-18s stage %d, %d ranks: = stage 0 for %d AdamW steps; optimizer state %zu of %zu bytes on rank 0\n",
               md->name, stage, world, STEPS, state, 2 * total * sizeof(float));
    for (j = 0; j < n; j++) free(mB[j]), free(vB[j]);
    for (p = 0; p < NP; p++) free(mA[p]), free(vA[p]);
    free(mB);
    free(vB);
    model_free(&A);
    model_free(&B);
}

/* (d) gradient memory for a model of MP parameters of MC f32, two per bucket (MB buckets), stage 0, 1, 2,
   after one synchronised pass (the pool must not have grown with gradients in bucket order). The
   gradients of stage 0 and 1 lie apart (a gap after each), so no bucket is flat (flat buckets are the
   program's memory and count 0); stage 2 uses one scratch gradient buffer for every parameter. */
#define MP 64
#define MC 1000
#define MB (MP / 2)
static void memory(ddp_group *g) {
    int world = ddp_world_size(g), stage, p;
    size_t per = (2 * MC + (size_t)world - 1) / (size_t)world, pool = ((size_t)world * per * 4 + 63) / 64 * 64, i;
    uint64_t got[3], want[3];
    float *param = (float *)calloc((size_t)MP * MC, sizeof(float)), *grad = (float *)calloc((size_t)MP * MC * 2, sizeof(float));
    want[0] = (uint64_t)MP * MC * 4;                              /* a comm bucket per bucket */
    want[1] = (uint64_t)MB * (per * (size_t)world * 4 + per * 4); /* padded comm + the slice (gather = comm) */
    want[2] = (uint64_t)MB * per * 4 + 2 * pool;                  /* the slices + the pool of 2 */
    for (stage = 0; stage <= 2; stage++) {
        ddp_reducer_desc d;
        ddp_reducer *red;
        ddp_reducer_statistics st;
        memset(&d, 0, sizeof d);
        d.zero_stage = stage;
        d.first_bucket_bytes = d.bucket_cap_bytes = 2 * MC * 4; /* two parameters per bucket */
        CHECK_OK(ddp_reducer_create(g, &d, &red), g);
        for (p = 0; p < MP; p++) {
            char name[16];
            snprintf(name, sizeof name, "w%d", p);
            CHECK_OK(ddp_reducer_add_param(red, name, param + (size_t)p * MC, stage == 2 ? grad : grad + (size_t)p * 2 * MC,
                                           MC, DDP_F32, NULL), g);
        }
        CHECK_OK(ddp_reducer_finalize(red), g);
        CHECK_OK(ddp_reducer_begin_backward(red), g);
        for (p = MP - 1; p >= 0; p--) {
            for (i = 0; i < MC; i++) grad[(stage == 2 ? 0 : (size_t)p * 2 * MC) + i] = (float)p;
            CHECK_OK(ddp_reducer_grad_ready(red, p), g);
        }
        CHECK_OK(ddp_reducer_end_backward(red), g);
        CHECK_OK(ddp_reducer_get_statistics(red, &st), g);
        CHECK(st.buckets == MB && st.flat_buckets == 0, "memory: stage %d: %d buckets", stage, st.buckets);
        if (stage == 2) { /* every parameter's averaged gradient is p (to rounding: p * (1/world) summed), in its owner's slice */
            const ddp_shard *sh;
            int n = ddp_reducer_shards(red, &sh), j;
            for (j = 0; j < n; j++)
                for (i = 0; i < sh[j].count; i++)
                    CHECK(close_enough(((const float *)sh[j].grad)[i], sh[j].param, 1e-6, 1.0), "memory: stage 2: w%d[%zu] = %.8g, want %d",
                          sh[j].param, sh[j].offset + i, (double)((const float *)sh[j].grad)[i], sh[j].param);
        }
        got[stage] = st.gradient_bytes;
        CHECK(got[stage] == want[stage], "memory, %d ranks: stage %d holds %llu gradient bytes, want %llu", world, stage,
              (unsigned long long)got[stage], (unsigned long long)want[stage]);
        ddp_reducer_destroy(red);
    }
    CHECK(got[2] <= got[0] / (uint64_t)world + 2 * pool + MB * 4, "memory, %d ranks: stage 2 holds %llu bytes, stage 0 %llu",
          world, (unsigned long long)got[2], (unsigned long long)got[0]); /* padding: under one element per bucket */
    if (ddp_rank(g) == 0)
        printf("  gradient_bytes, %d buckets of %d f32, %d ranks: stage 0 %llu, stage 1 %llu, stage 2 %llu\n", MB, 2 * MC, world,
               (unsigned long long)got[0], (unsigned long long)got[1], (unsigned long long)got[2]);
    free(param);
    free(grad);
}

static int train_main(int rank, int n, void *arg) {
    ddp_group *g;
    size_t k;
    (void)rank, (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (k = 0; k < sizeof MODES / sizeof MODES[0]; k++) {
        if (!MODES[k].scratch) train(g, &MODES[k], 1);
        if (!MODES[k].view) train(g, &MODES[k], 2);
    }
    memory(g);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* (c) what is refused, clearly. */
static void refused(ddp_group *g, int stage, int uneven, int unused, int view, const char *want) {
    ddp_reducer_desc d;
    ddp_reducer *r = (ddp_reducer *)&d;
    ddp_result res;
    memset(&d, 0, sizeof d);
    d.zero_stage = stage, d.uneven_inputs = uneven, d.find_unused_parameters = unused, d.gradient_as_bucket_view = view;
    res = ddp_reducer_create(g, &d, &r);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && r == NULL && strstr(ddp_last_error(g), want), "zero_stage %d, uneven_inputs "
          "%d, find_unused %d, view %d: %s: %s", stage, uneven, unused, view, ddp_result_string(res), ddp_last_error(g));
}

static int refuse_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_reducer *r;
    float w[3] = {1, 2, 3}, gw[3];
    const ddp_shard *sh = (const ddp_shard *)w;
    (void)rank, (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    refused(g, 2, 0, 0, 1, "zero_stage = 2 with gradient_as_bucket_view = 1 is not supported");
    refused(g, 4, 0, 0, 0, "zero_stage 4 is not 0");
    refused(g, 3, 0, 0, 1, "zero_stage = 3 with gradient_as_bucket_view = 1");
    CHECK_OK(ddp_reducer_create(g, NULL, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gw, 3, DDP_F32, NULL), g);
    CHECK(ddp_reducer_shards(r, &sh) == -1 && sh == NULL, "shards before finalize");
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK(ddp_reducer_shards(r, &sh) == 0 && sh == NULL, "zero_stage 0 has no shards");
    CHECK(ddp_reducer_gather_params(r) == DDP_ERR_STATE && strstr(ddp_last_error(g), "zero_stage = 0"), "gather_params "
          "without zero_stage: %s", ddp_last_error(g));
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Ranks that disagree about zero_stage would issue a reduce-scatter against an all-reduce (or a pool
   reuse against a bucket's own buffer): finalize says so on every rank, at once. arg: rank 1's stage;
   the others use stage - 1. */
static int disagree_main(int rank, int n, void *arg) {
    int other = *(const int *)arg;
    char want[96];
    ddp_group *g;
    ddp_reducer *r;
    ddp_reducer_desc d;
    float w[5] = {0}, gw[5];
    ddp_result res;
    double t0;
    (void)n;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.zero_stage = rank == 1 ? other : other - 1;
    snprintf(want, sizeof want, "different zero_stage: rank 0 has %d, rank 1 has %d", other - 1, other);
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gw, 5, DDP_F32, NULL), g);
    t0 = tl_now();
    res = ddp_reducer_finalize(r);
    CHECK(res == DDP_ERR_MISMATCH && strstr(ddp_last_error(g), want), "rank %d: zero_stage %d against %d: %s: %s", rank,
          other - 1, other, ddp_result_string(res), ddp_last_error(g));
    CHECK(tl_now() - t0 < 10, "rank %d: the mismatch took %.1f s", rank, tl_now() - t0);
    if (rank == 0) printf("  zero_stage %d against %d: %.2f ms: %s\n", other - 1, other, (tl_now() - t0) * 1e3, ddp_last_error(g));
    CHECK_OK(ddp_barrier(g), g); /* the group is still usable */
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    int world, other;
    for (world = 1; world <= 4; world++) {
        CHECK(tl_run_ranks(world, train_main, NULL, 120) == 0, "ZeRO-1 and 2 training, %d ranks", world);
        printf("ZeRO-1 and 2, %d ranks: every element owned once, as the rule says; every mode equals stage 0 + AdamW\n",
               world);
    }
    CHECK(tl_run_ranks(2, refuse_main, NULL, 60) == 0, "refused combinations");
    for (other = 1; other <= 2; other++) {
        CHECK(tl_run_ranks(2, disagree_main, &other, 60) == 0, "zero_stage differs between ranks");
        CHECK(tl_run_ranks(3, disagree_main, &other, 60) == 0, "zero_stage differs between ranks");
    }
    printf("test_reducer_zero: ok\n");
    return 0;
}
