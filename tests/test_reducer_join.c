/* Uneven inputs (torch's Join with DistributedDataParallel): ranks with shards of different lengths
   (one of them empty) train with uneven_inputs = 1 and call ddp_reducer_join when their data ends.
   Checked against a serial reference computed here, independent of the library: after each step every
   rank with data holds sum over the ranks with data of their gradients / INITIAL world size (torch's
   divide_by_initial_world_size); after the join every rank holds the parameters of that SGD run (the
   last joiner's), buffers come from the highest rank with data, a joined rank's own gradients are left
   alone and it shadowed exactly the synchronised passes it missed. On 1-4 ranks (one shard empty), plain,
   views, no_sync accumulation, find_unused_parameters, bf16 compression, buffers and flat gradients (one
   grads_memory). join_fail_early: every rank
   gets DDP_ERR_UNEVEN_INPUTS at the step where the first rank runs out, naming it, and the group and the
   reducer stay usable (also with zero_stage = 1, the joined ranks in ddp_reducer_join_step). Ranks with data
   that disagree about no_sync: DDP_ERR_MISMATCH on every rank. ZeRO-1 and ZeRO-2 (4 buckets, a pool of 2)
   with uneven inputs on 1-4 ranks (shards of 3,4 / 3,0,5 / 0,4,5,6 / 3,4,5 steps, and 3 on one rank;
   parameters of 7, 333, 1001, 61 elements): ranks with data and joined ranks (the join_step loop) run
   AdamW on their shards only, against a serial AdamW reference (tests/ref_optim.h; each step's sum over
   the ranks with data / initial world size): shard gradients and every parameter after every step (1e-5
   relative; bf16 2e-2), plain, no_sync x2 + buffers, view, flat, bf16, find_unused; a joined rank's
   unowned gradients untouched; ddp_reducer_join on a ZeRO reducer and join_step before gather_params:
   DDP_ERR_STATE. See "ZeRO stage 1 with uneven inputs" below. */
#include "testlib.h"
#include "ref_optim.h" /* ref_adamw: the serial AdamW of the ZeRO part */

#define NP 4
#define MAXR 4
#define MAXSTEPS 8
#define LR 0.5
static const size_t COUNT[NP] = {37, 5, 64, 3};

typedef struct mode {
    const char *name;
    int view, accum, find_unused, buffers;
    ddp_dtype comm;
    double tol;
    int flat; /* the gradients in one block (flat buckets: the join must not touch them either) */
} mode;

static const mode MODES[] = {
    {"plain", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-6, 0},
    {"view", 1, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-6, 0},
    {"accum", 0, 2, 0, 1, DDP_DTYPE_DEFAULT, 1e-6, 0},
    {"unused+view", 1, 1, 1, 0, DDP_DTYPE_DEFAULT, 1e-6, 0},
    {"bf16+view+accum", 1, 2, 0, 1, DDP_BF16, 2e-2, 0},
    {"flat", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-6, 1},
    {"flat+unused+accum", 0, 2, 1, 1, DDP_DTYPE_DEFAULT, 1e-6, 1},
};

typedef struct shards {
    int R, len[MAXR];
} shards;

/* Rank r's gradient contribution in step s, micro-batch m: small multiples of 1/4. Under find_unused,
   odd ranks never use parameter 2. */
static double contrib(const mode *md, int r, int s, int m, int p, size_t i) {
    if (md->find_unused && p == 2 && r % 2) return 0.0;
    return (double)((r * 7 + s * 3 + m * 2 + p * 13 + (int)i * 5) % 11 - 5) * 0.25;
}

static double init_value(int p, size_t i) { return (double)((p * 31 + (int)i * 17) % 23) * 0.1 - 1.0; }

static int longest(const shards *sh) {
    int r, n = 0;
    for (r = 0; r < sh->R; r++) n = sh->len[r] > n ? sh->len[r] : n;
    return n;
}

/* The highest rank that still has data in step s. */
static int highest_active(const shards *sh, int s) {
    int r, h = -1;
    for (r = 0; r < sh->R; r++)
        if (sh->len[r] > s) h = r;
    return h;
}

/* Serial reference: the averaged gradient of step s. */
static double ref_grad(const mode *md, const shards *sh, int s, int p, size_t i) {
    double sum = 0;
    int r, m;
    for (r = 0; r < sh->R; r++)
        if (sh->len[r] > s)
            for (m = 0; m < md->accum; m++) sum += contrib(md, r, s, m, p, i);
    return sum / (double)sh->R;
}

static void train(ddp_group *g, const mode *md, const shards *sh) {
    int rank = ddp_rank(g), mine = sh->len[rank], steps = longest(sh), p, s, m;
    float *param[NP], *grad[NP], before[NP][64], buf[3], *grads_memory = NULL;
    size_t at = 0;
    double ref[NP][64];
    ddp_reducer *red;
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    size_t i;
    memset(&d, 0, sizeof d);
    d.uneven_inputs = 1;
    d.gradient_as_bucket_view = md->view;
    d.find_unused_parameters = md->find_unused;
    d.comm_dtype = md->comm;
    d.first_bucket_bytes = d.bucket_cap_bytes = 64; /* several buckets */
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    for (p = 0; p < NP; p++) at += COUNT[p];
    if (md->flat) CHECK((grads_memory = (float *)calloc(at, sizeof(float))) != NULL, "out of memory");
    for (p = 0, at = 0; p < NP; at += COUNT[p], p++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        param[p] = (float *)malloc(COUNT[p] * sizeof(float));
        grad[p] = md->view ? NULL : md->flat ? grads_memory + at : (float *)calloc(COUNT[p], sizeof(float));
        for (i = 0; i < COUNT[p]; i++) param[p][i] = rank == 0 ? (float)init_value(p, i) : 99.0f; /* finalize: rank 0's */
        for (i = 0; i < COUNT[p]; i++) ref[p][i] = init_value(p, i);
        CHECK_OK(ddp_reducer_add_param(red, name, param[p], grad[p], COUNT[p], DDP_F32, NULL), g);
    }
    if (md->buffers) CHECK_OK(ddp_reducer_add_buffer(red, "running", buf, 3, DDP_F32), g);
    CHECK_OK(ddp_reducer_finalize(red), g);
    for (s = 0; s < steps; s++) {
        if (s < mine && md->buffers) { /* buffers come from the highest rank with data (torch's _find_common_rank) */
            buf[0] = buf[1] = buf[2] = (float)(rank * 100 + s);
            CHECK_OK(ddp_reducer_broadcast_buffers(red), g);
            CHECK(buf[1] == (float)(highest_active(sh, s) * 100 + s), "%s rank %d step %d: buffer %g, want rank %d's", md->name,
                  rank, s, (double)buf[1], highest_active(sh, s));
        }
        for (m = 0; s < mine && m < md->accum; m++) {
            CHECK_OK(ddp_reducer_set_sync(red, m == md->accum - 1), g);
            CHECK_OK(ddp_reducer_begin_backward(red), g);
            for (p = NP - 1; p >= 0; p--) {
                float *gp = (float *)ddp_reducer_grad(red, p);
                if (md->find_unused && p == 2 && rank % 2) continue;
                for (i = 0; i < COUNT[p]; i++) gp[i] += (float)contrib(md, rank, s, m, p, i);
                CHECK_OK(ddp_reducer_grad_ready(red, p), g);
            }
            CHECK_OK(ddp_reducer_end_backward(red), g);
        }
        for (p = 0; p < NP; p++) { /* the reference: every rank follows the SGD run of the ranks with data */
            const float *gp = (const float *)ddp_reducer_grad(red, p);
            for (i = 0; i < COUNT[p]; i++) {
                double want = ref_grad(md, sh, s, p, i);
                if (s < mine)
                    CHECK(fabs(gp[i] - want) <= md->tol, "%s, %d ranks, rank %d step %d: grad p%d[%zu] = %.7g, reference %.7g",
                          md->name, sh->R, rank, s, p, i, (double)gp[i], want);
                ref[p][i] -= LR * want;
                if (s < mine) param[p][i] -= (float)(LR * gp[i]);
            }
        }
        if (s < mine) CHECK_OK(ddp_reducer_zero_grad(red), g);
    }
    for (p = 0; p < NP; p++) { /* something recognisable that the join must not touch */
        float *gp = (float *)ddp_reducer_grad(red, p);
        for (i = 0; i < COUNT[p]; i++) gp[i] = before[p][i] = (float)(rank + 0.5 * (double)i);
    }
    if (md->accum > 1) { /* the loop ddp_reducer_join is, by hand: one return per synchronised pass shadowed
                            (the no_sync passes and buffer broadcasts between them answered inside) */
        int all_joined = 0, returns = 0;
        for (;;) {
            CHECK_OK(ddp_reducer_join_step(red, &all_joined), g);
            if (all_joined) break;
            returns++;
        }
        CHECK(returns == steps - mine, "%s rank %d: join_step returned %d times before all_joined, want %d", md->name, rank,
              returns, steps - mine);
    } else {
        CHECK_OK(ddp_reducer_join(red), g);
    }
    for (p = 0; p < NP; p++) {
        const float *gp = (const float *)ddp_reducer_grad(red, p);
        for (i = 0; i < COUNT[p]; i++) {
            CHECK(fabs(param[p][i] - ref[p][i]) <= md->tol * 4, "%s, %d ranks, rank %d (%d of %d steps) after the join: "
                  "p%d[%zu] = %.7g, reference %.7g", md->name, sh->R, rank, mine, steps, p, i, (double)param[p][i], ref[p][i]);
            CHECK(gp[i] == before[p][i], "%s rank %d: the join changed gradient p%d[%zu]", md->name, rank, p, i);
        }
    }
    if (md->buffers) { /* the last joiner's: the highest rank with the longest shard, after its last broadcast */
        int last = highest_active(sh, steps - 1);
        CHECK(buf[2] == (float)(last * 100 + steps - 1), "%s rank %d: buffer after the join %g, want %d", md->name, rank,
              (double)buf[2], last * 100 + steps - 1);
    }
    CHECK_OK(ddp_reducer_get_statistics(red, &st), g);
    CHECK(st.shadowed_iterations == (uint64_t)(steps - mine), "%s rank %d: shadowed %llu synchronised passes, want %d",
          md->name, rank, (unsigned long long)st.shadowed_iterations, steps - mine);
    CHECK(st.iterations == (uint64_t)mine, "%s rank %d: %llu iterations", md->name, rank, (unsigned long long)st.iterations);
    CHECK(st.flat_buckets == (md->flat ? st.buckets : st.flat_buckets), "%s: %d of %d buckets flat", md->name, st.flat_buckets,
          st.buckets);
    ddp_reducer_destroy(red);
    for (p = 0; p < NP; p++) free(param[p]), free(md->flat ? NULL : grad[p]);
    free(grads_memory);
}

/* ---- join_fail_early ---- */

static float fw[8], fgw[8];
static int fail_zero; /* the same with zero_stage = 1 (set before the ranks start) */

static ddp_reducer *fail_model(ddp_group *g) {
    ddp_reducer *r;
    ddp_reducer_desc d;
    memset(&d, 0, sizeof d);
    d.uneven_inputs = 1;
    d.join_fail_early = 1;
    d.zero_stage = fail_zero;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", fw, fgw, 8, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    return r;
}

static void one_step(ddp_group *g, ddp_reducer *r, float value) {
    int i;
    for (i = 0; i < 8; i++) fgw[i] = value;
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
}

static int fail_main(int rank, int n, void *arg) {
    const shards *sh = (const shards *)arg;
    ddp_group *g;
    ddp_reducer *r;
    ddp_result res;
    int s, first = sh->len[0], k;
    float ones = 1.0f;
    char want[160];
    double t0;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (k = 0; k < n; k++) first = sh->len[k] < first ? sh->len[k] : first;
    r = fail_model(g);
    for (s = 0; s < sh->len[rank] && s < first; s++) one_step(g, r, (float)rank);
    t0 = tl_now();
    if (fail_zero && sh->len[rank] == first) {
        int all_joined = 0;
        res = ddp_reducer_join_step(r, &all_joined);
    } else {
        res = sh->len[rank] > first ? ddp_reducer_begin_backward(r) : ddp_reducer_join(r);
    }
    CHECK(res == DDP_ERR_UNEVEN_INPUTS, "rank %d: %s (%s)", rank, ddp_result_string(res), ddp_last_error(g));
    CHECK(tl_now() - t0 < 10, "rank %d: the error took %.1f s", rank, tl_now() - t0);
    { /* "rank 1" or "ranks 2, 3": every rank whose shard is the shortest */
        int len = snprintf(want, sizeof want, "uneven inputs at step %d: rank", first + 1), listed = 0;
        for (k = 0; k < n; k++) listed += sh->len[k] == first;
        if (listed > 1) len += snprintf(want + len, sizeof want - (size_t)len, "s");
        for (listed = 0, k = 0; k < n; k++)
            if (sh->len[k] == first) len += snprintf(want + len, sizeof want - (size_t)len, "%s %d", listed++ ? "," : "", k);
    }
    CHECK(strstr(ddp_last_error(g), want) != NULL, "rank %d: the message lacks \"%s\": %s", rank, want, ddp_last_error(g));
    snprintf(want, sizeof want, "ran out of data after %d step%s", first, first == 1 ? "" : "s");
    CHECK(strstr(ddp_last_error(g), want) != NULL, "rank %d: the message lacks \"%s\": %s", rank, want, ddp_last_error(g));
    if (rank == 0) printf("  fail early%s, %d ranks, detected in %.1f ms: %s\n", fail_zero ? " (zero_stage 1, join_step)" : "",
                          n, (tl_now() - t0) * 1e3, ddp_last_error(g));
    /* the group and the reducer are still usable: a collective, then a synchronised step on every rank */
    CHECK_OK(ddp_all_reduce(g, &ones, 1, DDP_F32, DDP_SUM), g);
    CHECK(ones == (float)n, "rank %d: all_reduce after the error gave %g", rank, (double)ones);
    one_step(g, r, (float)(rank + 1));
    if (fail_zero) { /* the elements this rank owns are averaged */
        const ddp_shard *sh;
        int j, all_joined = 0, ns = ddp_reducer_shards(r, &sh);
        size_t i;
        for (j = 0; j < ns; j++)
            for (i = 0; i < sh[j].count; i++)
                CHECK(fabsf(((const float *)sh[j].grad)[i] - (float)(n + 1) / 2.0f) < 1e-6f, "rank %d: the step after the "
                      "error averaged %g", rank, (double)((const float *)sh[j].grad)[i]);
        CHECK_OK(ddp_reducer_gather_params(r), g);
        CHECK_OK(ddp_reducer_join_step(r, &all_joined), g); /* everyone at once: returns, nothing to shadow */
        CHECK(all_joined == 1, "rank %d: join_step with every rank joined returned all_joined = %d", rank, all_joined);
    } else {
        CHECK(fabsf(fgw[3] - (float)(n + 1) / 2.0f) < 1e-6f, "rank %d: the step after the error averaged %g", rank,
              (double)fgw[3]);
        CHECK_OK(ddp_reducer_join(r), g); /* everyone at once: returns, nothing to shadow */
    }
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- ranks with data disagree about no_sync; misuse ---- */

static int disagree_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_reducer *r;
    ddp_reducer_desc d;
    ddp_result res;
    double t0;
    float w[2] = {0, 0}, gw[2] = {0, 0};
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.join_fail_early = 1;
    CHECK(ddp_reducer_create(g, &d, &r) == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "uneven_inputs"),
          "join_fail_early without uneven_inputs: %s", ddp_last_error(g));
    d.join_fail_early = 0;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gw, 2, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    res = ddp_reducer_join(r);
    CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "uneven_inputs = 1"), "join without uneven_inputs: %s",
          ddp_last_error(g));
    ddp_reducer_destroy(r);
    d.uneven_inputs = 1;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, gw, 2, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_reducer_set_sync(r, rank != 1), g);
    res = ddp_reducer_begin_backward(r);
    CHECK(res == DDP_ERR_MISMATCH && strstr(ddp_last_error(g), "rank 0 began a synchronised backward pass, rank 1 began a "
          "backward pass under no_sync"), "rank %d: %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    CHECK_OK(ddp_reducer_set_sync(r, 1), g);
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK(ddp_reducer_join(r) == DDP_ERR_STATE, "join during a backward pass");
    CHECK_OK(ddp_reducer_end_backward(r), g);
    CHECK_OK(ddp_reducer_join(r), g);
    /* a rank with data calls another collective while the other has joined: the join round's all_gather
       meets it, a mismatch on both ranks at once (not a wait for the timeout) */
    t0 = tl_now();
    if (rank == 0) {
        float loss = 1.0f;
        res = ddp_all_reduce(g, &loss, 1, DDP_F32, DDP_SUM);
    } else {
        res = ddp_reducer_join(r);
    }
    CHECK(res == DDP_ERR_MISMATCH && strstr(ddp_last_error(g), "all_gather"), "rank %d: a collective against the join "
          "round: %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    CHECK(tl_now() - t0 < 10, "rank %d: the mismatch took %.1f s", rank, tl_now() - t0);
    CHECK(rank == 0 || strstr(ddp_last_error(g), "ddp_reducer_join: the join round"), "rank 1: %s", ddp_last_error(g));
    if (rank == 0) printf("  another collective against the join round: %.1f ms: %s\n", (tl_now() - t0) * 1e3, ddp_last_error(g));
    ddp_reducer_destroy(r);
    ddp_destroy(g);
    return 0;
}

/* ---- ZeRO stage 1 with uneven inputs: the join_step loop ----
   Every rank runs AdamW on its shards only; a rank without data loops ddp_reducer_join_step, steps its
   shards with the averaged gradients each call gives and calls gather_params with the others. Reference,
   serial and computed here: one full model, and at step s the gradient sum over the ranks with data in
   step s of their gradients / INITIAL world size, AdamW on every element (step counter s + 1). After
   every step on every rank (with data or joined) the shards' gradients equal the reference's and every
   parameter equals the reference model; a joined rank's gradient elements it does not own are untouched.
   The +unused modes add find_unused_parameters: ranks with data skip parameters (zskips()); the reference
   averages over all ranks what those that used a parameter contributed, and a parameter no rank used in a
   step keeps its gradient (the test writes 42 into its shards' gradients before the step, on every rank,
   joined or not: still 42 after it), is not stepped by AdamW and has its own step count (torch's AdamW on
   a .grad of None); ddp_reducer_param_used must say which. */

#define ZNP 4
static const size_t ZCOUNT[ZNP] = {7, 333, 1001, 61}; /* no size divides 2, 3 or 4 */
#define ZMAX 1001

typedef struct zmode {
    const char *name;
    int view, accum, flat, buffers;
    ddp_dtype comm;
    double tol;
    int stage;  /* zero_stage 1 or 2 */
    int unused; /* find_unused_parameters, and ranks skip parameters (zskips) */
} zmode;

static const zmode ZMODES[] = {
    {"zero1", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 1, 0},
    {"zero1+accum+buffers", 0, 2, 0, 1, DDP_DTYPE_DEFAULT, 1e-5, 1, 0},
    {"zero1+view", 1, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 1, 0},
    {"zero1+flat", 0, 1, 1, 0, DDP_DTYPE_DEFAULT, 1e-5, 1, 0},
    {"zero1+bf16+view+accum", 1, 2, 0, 0, DDP_BF16, 2e-2, 1, 0},
    {"zero2", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 2, 0}, /* more buckets than pool buffers: the shadow borrows in turn */
    {"zero2+accum+buffers", 0, 2, 0, 1, DDP_DTYPE_DEFAULT, 1e-5, 2, 0},
    {"zero2+flat", 0, 1, 1, 0, DDP_DTYPE_DEFAULT, 1e-5, 2, 0},
    {"zero2+bf16+accum", 0, 2, 0, 0, DDP_BF16, 2e-2, 2, 0},
    {"zero1+unused", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 1, 1},
    {"zero1+unused+view+accum", 1, 2, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 1, 1},
    {"zero2+unused", 0, 1, 0, 0, DDP_DTYPE_DEFAULT, 1e-5, 2, 1},
    {"zero2+unused+accum+bf16", 0, 2, 0, 0, DDP_BF16, 2e-2, 2, 1},
};

/* +unused modes: does rank r leave parameter p without a gradient in step s? p0 on every rank in odd steps
   (no rank uses it), the others on some ranks (on all of them only when few ranks have data). */
static int zskips(const zmode *md, int r, int s, int p) { return md->unused && (p == 0 ? s % 2 == 1 : (r + s + p) % 3 == 0); }

#define ZKEPT 42.0f /* written into the gradients of a parameter no rank uses in the step: it must stay */

/* Rank r's gradient in step s, micro-batch m: a sign per element and step shared by every rank (the
   average never cancels to rounding noise, which AdamW would magnify), a size per rank, and a term in
   the parameter's value (a stale parameter shows). */
static float zcontrib(int r, int s, int m, int p, size_t i, float param) {
    float sign = ((s + p + (int)i) % 3) ? 1.0f : -1.0f;
    return sign * (1.0f + (float)((r * 7 + s * 3 + m * 2 + p * 13 + (int)i * 5) % 11) * 0.125f) + 0.05f * param;
}

static int zclose(double got, double want, double tol) { return fabs(got - want) <= tol * (fabs(want) + 1.0); }

typedef struct zref { /* the serial model */
    float param[ZNP][ZMAX], m[ZNP][ZMAX], v[ZNP][ZMAX], grad[ZNP][ZMAX];
    int used[ZNP], t[ZNP]; /* the last step: did any rank use the parameter; AdamW steps taken per parameter */
} zref;

/* Does any rank with data in step s use parameter p? */
static int zused(const zmode *md, const shards *sh, int s, int p) {
    int r;
    for (r = 0; r < sh->R; r++)
        if (sh->len[r] > s && !zskips(md, r, s, p)) return 1;
    return 0;
}

/* The reference's step s: averaged gradient of the ranks with data (those that used the parameter), then
   AdamW on every parameter some rank used. */
static void zref_step(zref *Z, const zmode *md, const shards *sh, int s) {
    int p, r, m;
    size_t i;
    for (p = 0; p < ZNP; p++) {
        if (!(Z->used[p] = zused(md, sh, s, p))) continue;
        for (i = 0; i < ZCOUNT[p]; i++) {
            float sum = 0;
            for (r = 0; r < sh->R; r++)
                for (m = 0; sh->len[r] > s && !zskips(md, r, s, p) && m < md->accum; m++) sum += zcontrib(r, s, m, p, i, Z->param[p][i]);
            Z->grad[p][i] = sum / (float)sh->R;
        }
        ref_adamw(Z->param[p], Z->grad[p], Z->m[p], Z->v[p], ZCOUNT[p], ++Z->t[p]);
    }
}

/* Before step s: 42 into this rank's shards' gradients of the parameters no rank uses in it. */
static void zmark_kept(const zmode *md, const shards *sh, const ddp_shard *shs, int n, int s) {
    int j;
    size_t i;
    for (j = 0; j < n; j++)
        for (i = 0; i < shs[j].count && !zused(md, sh, s, shs[j].param); i++) ((float *)shs[j].grad)[i] = ZKEPT;
}

typedef struct zrun { /* one rank's ZeRO-1 model */
    ddp_reducer *red;
    float *param[ZNP], *grad[ZNP], *grads_memory, buf[2];
    const ddp_shard *sh;
    int n;
    float **m, **v;
} zrun;

static void zrun_build(ddp_group *g, const zmode *md, zrun *Z) {
    ddp_reducer_desc d;
    size_t total = 0, i;
    int p, j;
    memset(&d, 0, sizeof d);
    memset(Z, 0, sizeof *Z);
    d.zero_stage = md->stage;
    d.uneven_inputs = 1;
    d.find_unused_parameters = md->unused;
    d.gradient_as_bucket_view = md->view;
    d.comm_dtype = md->comm;
    d.first_bucket_bytes = d.bucket_cap_bytes = 1024; /* several buckets, slices across parameters */
    CHECK_OK(ddp_reducer_create(g, &d, &Z->red), g);
    for (p = 0; p < ZNP; p++) total += ZCOUNT[p];
    if (md->flat) CHECK((Z->grads_memory = (float *)calloc(total, sizeof(float))) != NULL, "out of memory");
    for (p = 0, total = 0; p < ZNP; total += ZCOUNT[p], p++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        Z->param[p] = (float *)malloc(ZCOUNT[p] * sizeof(float));
        Z->grad[p] = md->view ? NULL : md->flat ? Z->grads_memory + total : (float *)calloc(ZCOUNT[p], sizeof(float));
        for (i = 0; i < ZCOUNT[p]; i++) Z->param[p][i] = ddp_rank(g) == 0 ? (float)init_value(p, i) : 99.0f;
        CHECK_OK(ddp_reducer_add_param(Z->red, name, Z->param[p], Z->grad[p], ZCOUNT[p], DDP_F32, NULL), g);
    }
    if (md->buffers) CHECK_OK(ddp_reducer_add_buffer(Z->red, "running", Z->buf, 2, DDP_F32), g);
    CHECK_OK(ddp_reducer_finalize(Z->red), g);
    Z->n = ddp_reducer_shards(Z->red, &Z->sh);
    CHECK(Z->n >= 0, "ddp_reducer_shards: %d", Z->n);
    Z->m = (float **)calloc((size_t)Z->n + 1, sizeof *Z->m);
    Z->v = (float **)calloc((size_t)Z->n + 1, sizeof *Z->v);
    for (j = 0; j < Z->n; j++) { /* optimizer state for the shards only */
        Z->m[j] = (float *)calloc(Z->sh[j].count, sizeof(float));
        Z->v[j] = (float *)calloc(Z->sh[j].count, sizeof(float));
    }
}

static void zrun_free(zrun *Z) {
    int p, j;
    ddp_reducer_destroy(Z->red);
    for (j = 0; j < Z->n; j++) free(Z->m[j]), free(Z->v[j]);
    free(Z->m), free(Z->v);
    for (p = 0; p < ZNP; p++) {
        free(Z->param[p]);
        if (!Z->grads_memory) free(Z->grad[p]);
    }
    free(Z->grads_memory);
}

/* The program's optimizer step on its shards (AdamW, each parameter's own step count), then
   gather_params. Checks the shards' gradients against the reference's averaged gradient of step t first
   (a parameter no rank used: still 42, and ddp_reducer_param_used 0). */
static void zrun_step(ddp_group *g, const zmode *md, const shards *sh, zrun *Z, const zref *R, int t, const char *who) {
    int j;
    size_t i;
    for (j = 0; j < Z->n; j++) {
        const ddp_shard *s = &Z->sh[j];
        const float *gp = (const float *)s->grad;
        CHECK(ddp_reducer_param_used(Z->red, s->param) == R->used[s->param], "%s, %d ranks, rank %d (%s) step %d: "
              "ddp_reducer_param_used(p%d) = %d, want %d", md->name, sh->R, ddp_rank(g), who, t, s->param,
              ddp_reducer_param_used(Z->red, s->param), R->used[s->param]);
        if (!R->used[s->param]) {
            for (i = 0; i < s->count; i++)
                CHECK(gp[i] == ZKEPT, "%s, %d ranks, rank %d (%s) step %d: shard grad p%d[%zu] = %g: no rank used it, it must "
                      "stay %g", md->name, sh->R, ddp_rank(g), who, t, s->param, s->offset + i, (double)gp[i], (double)ZKEPT);
            continue;
        }
        for (i = 0; i < s->count; i++)
            CHECK(zclose(gp[i], R->grad[s->param][s->offset + i], md->tol), "%s, %d ranks, rank %d (%s) step %d: shard grad "
                  "p%d[%zu] = %.8g, reference %.8g", md->name, sh->R, ddp_rank(g), who, t, s->param, s->offset + i,
                  (double)gp[i], (double)R->grad[s->param][s->offset + i]);
        ref_adamw((float *)s->param_data, gp, Z->m[j], Z->v[j], s->count, R->t[s->param]);
    }
    CHECK_OK(ddp_reducer_gather_params(Z->red), g);
}

static void zcheck_params(ddp_group *g, const zmode *md, const shards *sh, const zrun *Z, const zref *R, int s, const char *who) {
    int p;
    size_t i;
    for (p = 0; p < ZNP; p++)
        for (i = 0; i < ZCOUNT[p]; i++)
            CHECK(zclose(Z->param[p][i], R->param[p][i], md->tol), "%s, %d ranks, rank %d (%s) after step %d: p%d[%zu] = %.8g, "
                  "reference %.8g", md->name, sh->R, ddp_rank(g), who, s, p, i, (double)Z->param[p][i], (double)R->param[p][i]);
}

/* A joined rank's gradient elements outside its shards: set to a mark before the join, never written. */
static void zmark_unowned(zrun *Z, int check, const char *what) {
    static unsigned char owned[ZNP][ZMAX];
    int p, j;
    size_t i;
    memset(owned, 0, sizeof owned);
    for (j = 0; j < Z->n; j++) memset(&owned[Z->sh[j].param][Z->sh[j].offset], 1, Z->sh[j].count);
    for (p = 0; p < ZNP; p++) {
        float *gp = (float *)ddp_reducer_grad(Z->red, p);
        for (i = 0; i < ZCOUNT[p]; i++) {
            float mark = 1000.0f + (float)p + (float)i * 0.5f;
            if (owned[p][i]) continue;
            if (check) CHECK(gp[i] == mark, "%s: join_step wrote gradient p%d[%zu], which this rank does not own", what, p, i);
            gp[i] = mark;
        }
    }
}

static void zero_train(ddp_group *g, const zmode *md, const shards *sh) {
    int rank = ddp_rank(g), mine = sh->len[rank], steps = longest(sh), s, m, p, all_joined = 0;
    zrun Z;
    zref *R = (zref *)calloc(1, sizeof *R);
    ddp_reducer_statistics st;
    ddp_result res;
    size_t i;
    CHECK(R != NULL, "out of memory");
    for (p = 0; p < ZNP; p++)
        for (i = 0; i < ZCOUNT[p]; i++) R->param[p][i] = (float)init_value(p, i);
    zrun_build(g, md, &Z);
    for (s = 0; s < mine; s++) { /* the ranks with data: as always */
        if (md->buffers) {
            Z.buf[0] = Z.buf[1] = (float)(rank * 100 + s);
            CHECK_OK(ddp_reducer_broadcast_buffers(Z.red), g);
            CHECK(Z.buf[1] == (float)(highest_active(sh, s) * 100 + s), "%s rank %d step %d: buffer %g", md->name, rank, s,
                  (double)Z.buf[1]);
        }
        zmark_kept(md, sh, Z.sh, Z.n, s);
        for (m = 0; m < md->accum; m++) {
            CHECK_OK(ddp_reducer_set_sync(Z.red, m == md->accum - 1), g);
            CHECK_OK(ddp_reducer_begin_backward(Z.red), g);
            for (p = ZNP - 1; p >= 0; p--) {
                float *gp = (float *)ddp_reducer_grad(Z.red, p);
                if (zskips(md, rank, s, p)) continue;
                for (i = 0; i < ZCOUNT[p]; i++) gp[i] += zcontrib(rank, s, m, p, i, Z.param[p][i]);
                CHECK_OK(ddp_reducer_grad_ready(Z.red, p), g);
            }
            CHECK_OK(ddp_reducer_end_backward(Z.red), g);
        }
        zref_step(R, md, sh, s);
        zrun_step(g, md, sh, &Z, R, s + 1, "with data");
        zcheck_params(g, md, sh, &Z, R, s, "with data");
        CHECK_OK(ddp_reducer_zero_grad(Z.red), g);
    }
    res = ddp_reducer_join(Z.red); /* refused at once, nothing collective: the optimizer must run */
    CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "ddp_reducer_join_step"), "%s rank %d: ddp_reducer_join under "
          "zero_stage: %s: %s", md->name, rank, ddp_result_string(res), ddp_last_error(g));
    zmark_unowned(&Z, 0, md->name);
    for (s = mine;; s++) { /* joined: shadow one step, step the shards, gather */
        zmark_kept(md, sh, Z.sh, Z.n, s);
        CHECK_OK(ddp_reducer_join_step(Z.red, &all_joined), g);
        if (all_joined) break;
        CHECK(s < steps, "%s rank %d: join_step shadowed step %d of %d", md->name, rank, s, steps);
        zmark_unowned(&Z, 1, md->name);
        if (s == mine) {
            res = ddp_reducer_join_step(Z.red, &all_joined);
            CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "ddp_reducer_gather_params"), "%s rank %d: join_step "
                  "before gather_params: %s: %s", md->name, rank, ddp_result_string(res), ddp_last_error(g));
        }
        zref_step(R, md, sh, s);
        zrun_step(g, md, sh, &Z, R, s + 1, "joined");
        zcheck_params(g, md, sh, &Z, R, s, "joined");
    }
    CHECK(s == steps, "%s rank %d: the join ended after step %d, the longest shard has %d", md->name, rank, s, steps);
    zcheck_params(g, md, sh, &Z, R, s, "after the join");
    CHECK(!md->buffers || Z.buf[0] == (float)(highest_active(sh, steps - 1) * 100 + steps - 1), "%s rank %d: buffer after "
          "the join %g", md->name, rank, (double)Z.buf[0]);
    CHECK_OK(ddp_reducer_get_statistics(Z.red, &st), g);
    CHECK(st.shadowed_iterations == (uint64_t)(steps - mine) && st.iterations == (uint64_t)mine, "%s rank %d: shadowed "
          "%llu, iterations %llu", md->name, rank, (unsigned long long)st.shadowed_iterations,
          (unsigned long long)st.iterations);
    zrun_free(&Z);
    free(R);
}

/* One rank of a training run on shards arg: every mode of the join test (MODES, train), or with zero_modes
   set before the ranks start, every mode of the ZeRO part (ZMODES, zero_train). */
static int zero_modes;
static int train_main(int rank, int n, void *arg) {
    const shards *sh = (const shards *)arg;
    ddp_group *g;
    size_t k;
    (void)rank, (void)n;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (k = 0; !zero_modes && k < sizeof MODES / sizeof MODES[0]; k++) train(g, &MODES[k], sh);
    for (k = 0; zero_modes && k < sizeof ZMODES / sizeof ZMODES[0]; k++) zero_train(g, &ZMODES[k], sh);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    static const shards TRAIN[] = {{2, {5, 3}}, {3, {4, 0, 6}}, {4, {3, 5, 0, 5}}, {3, {0, 4, 2}}, {1, {3}}};
    static const shards FAIL[] = {{3, {4, 2, 5}}, {2, {3, 0}}, {4, {3, 3, 1, 1}}};
    static const shards ZERO[] = {{2, {3, 4}}, {3, {3, 0, 5}}, {4, {0, 4, 5, 6}}, {3, {3, 4, 5}}, {1, {3}}};
    size_t k;
    for (k = 0; k < sizeof TRAIN / sizeof TRAIN[0]; k++) {
        CHECK(tl_run_ranks(TRAIN[k].R, train_main, (void *)&TRAIN[k], 60) == 0, "join training, %d ranks", TRAIN[k].R);
        printf("join, %d ranks, shards of", TRAIN[k].R);
        for (int r = 0; r < TRAIN[k].R; r++) printf(" %d", TRAIN[k].len[r]);
        printf(" steps: every mode equals the serial reference\n");
    }
    for (k = 0; k < sizeof FAIL / sizeof FAIL[0]; k++)
        CHECK(tl_run_ranks(FAIL[k].R, fail_main, (void *)&FAIL[k], 60) == 0, "join_fail_early, %d ranks", FAIL[k].R);
    for (fail_zero = 1, k = 0; k < sizeof FAIL / sizeof FAIL[0]; k++)
        CHECK(tl_run_ranks(FAIL[k].R, fail_main, (void *)&FAIL[k], 60) == 0, "join_fail_early, zero_stage 1, %d ranks", FAIL[k].R);
    for (zero_modes = 1, k = 0; k < sizeof ZERO / sizeof ZERO[0]; k++) {
        CHECK(tl_run_ranks(ZERO[k].R, train_main, (void *)&ZERO[k], 60) == 0, "ZeRO-1 and 2 join training, %d ranks", ZERO[k].R);
        printf("ZeRO-1 and 2 + join_step, %d ranks, shards of", ZERO[k].R);
        for (int r = 0; r < ZERO[k].R; r++) printf(" %d", ZERO[k].len[r]);
        printf(" steps: every rank's AdamW on its shards equals the serial reference\n");
    }
    CHECK(tl_run_ranks(2, disagree_main, NULL, 60) == 0, "no_sync disagreement");
    printf("test_reducer_join: ok\n");
    return 0;
}
