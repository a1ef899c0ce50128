/* FSDP / ZeRO-3 (zero_stage = 3): units gathered from master shards, gradients reduce-scattered from the
   units' buffers. A model of 5 units (a KEEP root "emb" and 4 layers of a weight and a bias; layers 1 and 4
   have the same size) trained for STEPS steps of AdamW on the shards, against two references:
   (a) the same model at zero_stage 2 with the same units as buckets, side by side on the same group, its
       program holding every parameter and gradient: after every pass stage 3's shard gradients, and after
       every step its master shards, equal stage 2's bit for bit; every gathered parameter equals stage 2's
       after its gather_params (param_dtype bf16: its bf16 rounding, the stage 2 program rounding weights
       and gradients to bf16 at use as a bf16 program would);
   (b) a serial reference computed in the test: every rank's gradient (a function of the weights, the
       rank and the step) averaged in f64, AdamW (tests/ref_optim.h) on the whole model: within 1e-6 of
       |value| + 1 (bf16 communication: 2e-2).
   Modes: prefetch 0, 1, 2; no_sync x2 (every micro-step reduce-scatters and the slices accumulate: equal to
   stage 2 within 1e-6, as the sums are taken in another order); comm_dtype bf16; find_unused_parameters
   (ranks skip units by a rule, a unit skipped everywhere keeps its gradient slice and AdamW skips it on both
   sides); param_dtype bf16. World sizes 1-4 over shared memory, 2-4 over TCP.
   Then, on 2 and 3 ranks: param_bytes_peak and gradient_bytes by the documented formulas, computed here
   from the unit sizes; a gather beyond the pool is DDP_ERR_STATE naming the units that hold it, with no
   collective started (the group goes on); the refused calls and combinations; and ranks gathering different
   units of the same size (1 and 4) fail with DDP_ERR_MISMATCH naming both units on every rank. */
#include "testlib.h"
#include "ref_optim.h"

#include "fsdp_model.h"

#define STEPS 4

static const mode MODES[] = {
    {"prefetch 1", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0},
    {"prefetch 0", 0, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0},
    {"prefetch 2", 2, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0},
    {"no_sync x2", 1, 2, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 0, 1, 0, -1, 0},
    {"bf16 comm", 1, 1, 0, DDP_BF16, DDP_DTYPE_DEFAULT, 2e-2, 1, 0, 0, -1, 0},
    {"find_unused", 1, 1, 1, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 1, 0, -1, 0},
    {"param_dtype bf16", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_BF16, 1e-6, 1, 0, 0, -1, 0},
    {"grad_stats", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 1, 0, -1, 0},
    {"loss_scale, an inf at step 1", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 1, 1024, 1, 0},
    {"loss_scale, no_sync x2", 1, 2, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 0, 1, 4096, 2, 0},
    {"no_sync x3, accumulate_unsharded", 1, 3, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 1, 0, -1, 1},
    {"no_sync x2, find_unused, accumulate_unsharded", 0, 2, 1, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 1},
    {"no_sync x2, loss_scale, accumulate_unsharded", 1, 2, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 1, 4096, 1, 1},
};

/* Stage 3's parameters of unit u, gathered: equal to stage 2's (at use: bf16-rounded). */
static void check_gathered(side *s3, side *s2, const mode *m, int u, const char *when) {
    int i;
    size_t j;
    for (i = 0; i < NP; i++) {
        const void *got = ddp_fsdp_param(s3->r, i);
        if (UNIT_OF[i] != u) continue;
        CHECK(got, "%s: parameter %d of gathered unit %d is NULL", m->name, i, u);
        for (j = 0; j < COUNT[i]; j++) {
            float have = m->param == DDP_BF16 ? tl_decode_bf16(((const uint16_t *)got)[j]) : ((const float *)got)[j];
            CHECK(m->exact ? have == at_use(m, s2->p[i][j]) : fsdp_close(have, s2->p[i][j], 1e-6), "%s, %s: unit %d param %d[%zu]: stage 3 %.9g, stage 2 %.9g", m->name, when,
                  u, i, j, have, at_use(m, s2->p[i][j]));
        }
    }
}

/* g2: stage 2's own group (the same ranks): with find_unused the two reducers' collectives interleave
   differently on different ranks (a skipped unit's reduce-scatter moves to end_backward at stage 2). */
static void train(ddp_group *g, ddp_group *g2, const mode *m) {
    int rank = ddp_rank(g), world = ddp_world_size(g), step, a, u, i, j, t = 0;
    float S; /* the loss scale the program multiplies its gradients by (scaler.scale(loss)) */
    side s2, s3;
    serial ref;
    ddp_reducer_statistics st;
    size_t e;
    side_init(&s2, g2, m, 2);
    side_init(&s3, g, m, 3);
    CHECK(s2.nsh == s3.nsh, "%s: %d shards at stage 2, %d at stage 3", m->name, s2.nsh, s3.nsh);
    for (j = 0; j < s3.nsh; j++)
        CHECK(s2.sh[j].param == s3.sh[j].param && s2.sh[j].offset == s3.sh[j].offset && s2.sh[j].count == s3.sh[j].count,
              "%s: shard %d differs", m->name, j);
    serial_init(&ref);
    for (step = 0; step < STEPS; step++) {
        S = m->scale > 0 ? (float)s3.scaler.scale : 1.0f;
        for (a = 0; a < m->accum; a++) {
            int sync = a == m->accum - 1;
            CHECK_OK(ddp_reducer_set_sync(s2.r, sync), NULL);
            CHECK_OK(ddp_reducer_set_sync(s3.r, sync), NULL);
            /* forward: unit by unit, prefetching as far as the pool allows (the last one stays for backward) */
            CHECK_OK(ddp_fsdp_wait(s3.r, 0), NULL);
            for (u = 1; u <= m->prefetch && u < NU; u++) CHECK_OK(ddp_fsdp_gather(s3.r, u), NULL);
            for (u = 0; u < NU; u++) {
                CHECK_OK(ddp_fsdp_wait(s3.r, u), NULL);
                check_gathered(&s3, &s2, m, u, "forward");
                if (u + 1 < NU) CHECK_OK(ddp_fsdp_release(s3.r, u), NULL);
                if (u + 1 + m->prefetch < NU) CHECK_OK(ddp_fsdp_gather(s3.r, u + 1 + m->prefetch), NULL);
            }
            /* backward, last unit first; the next one down prefetched */
            CHECK_OK(ddp_reducer_begin_backward(s2.r), NULL);
            CHECK_OK(ddp_reducer_begin_backward(s3.r), NULL);
            for (u = NU - 1; u >= 0; u--) {
                CHECK_OK(ddp_fsdp_wait(s3.r, u), NULL);
                if (u > 1 && m->prefetch) CHECK_OK(ddp_fsdp_gather(s3.r, u - 1), NULL);
                if (skips(m, u, rank, step, a)) { /* handed over without its gradients: not used on this rank */
                    CHECK_OK(ddp_fsdp_grads_ready(s3.r, u), NULL);
                    CHECK_OK(ddp_fsdp_release(s3.r, u), NULL);
                    continue;
                }
                for (i = NP - 1; i >= 0; i--) {
                    float *g3;
                    const void *w3 = ddp_fsdp_param(s3.r, i);
                    if (UNIT_OF[i] != u) continue;
                    g3 = (float *)ddp_fsdp_grad(s3.r, i);
                    CHECK(g3 && w3, "%s: unit %d: grad %p, param %p", m->name, u, (void *)g3, w3);
                    for (e = 0; e < COUNT[i]; e++) {
                        float w = m->param == DDP_BF16 ? tl_decode_bf16(((const uint16_t *)w3)[e]) : ((const float *)w3)[e];
                        float gval = at_use(m, grad_of(w, rank, step, a, i, e)) * S;
                        if (m->param == DDP_BF16) tl_store_value(g3, e, DDP_BF16, tl_load_value(g3, e, DDP_BF16) + gval);
                        else g3[e] += gval;
                        /* stage 2's program: the same gradient from its own weights, accumulated under no_sync */
                        s2.gr[i][e] += at_use(m, grad_of(at_use(m, s2.p[i][e]), rank, step, a, i, e)) * S;
                    }
                    if (step == m->inf_step && rank == world - 1 && u == 2 && a == 0) /* one rank overflows */
                        g3[0] = s2.gr[i][0] = INFINITY;
                    CHECK_OK(ddp_reducer_grad_ready(s2.r, i), NULL);
                }
                CHECK_OK(ddp_fsdp_grads_ready(s3.r, u), NULL);
                CHECK_OK(ddp_fsdp_release(s3.r, u), NULL);
            }
            CHECK_OK(ddp_reducer_end_backward(s2.r), NULL);
            CHECK_OK(ddp_reducer_end_backward(s3.r), NULL);
            CHECK(ddp_fsdp_param(s3.r, 0) == NULL, "%s: the KEEP unit is still gathered after end_backward", m->name);
        }
        for (j = 0; j < s3.nsh; j++)
            for (e = 0; e < s3.sh[j].count; e++) {
                float a3 = ((const float *)s3.sh[j].grad)[e], a2 = ((const float *)s2.sh[j].grad)[e];
                CHECK(m->exact ? a3 == a2 : fsdp_close(a3, a2, 1e-6), "%s, step %d: shard %d gradient [%zu]: stage 3 "
                      "%.9g, stage 2 %.9g", m->name, step, j, e, a3, a2);
            }
        if (m->stats) { /* the norm and found_inf: the same on every rank, stage 3's = stage 2's */
            double n2, n3, both[2];
            int inf3 = ddp_reducer_found_inf(s3.r);
            CHECK_OK(ddp_reducer_grad_norm(s2.r, &n2), NULL);
            CHECK_OK(ddp_reducer_grad_norm(s3.r, &n3), NULL);
            CHECK(inf3 == (step == m->inf_step) && ddp_reducer_found_inf(s2.r) == inf3, "%s, step %d: found_inf %d (stage 2: "
                  "%d)", m->name, step, inf3, ddp_reducer_found_inf(s2.r));
            CHECK(m->exact ? n3 == n2 || (n3 != n3 && n2 != n2) : fsdp_close(n3, n2, 1e-6), "%s, step %d: norm %.17g, "
                  "stage 2 %.17g", m->name, step, n3, n2);
            both[0] = n3, both[1] = -n3;
            if (!inf3) {
                CHECK_OK(ddp_all_reduce(g, both, 2, DDP_F64, DDP_MAX), NULL);
                CHECK(both[0] == n3 && -both[1] == n3, "%s: the norm differs between ranks", m->name);
                CHECK(fsdp_close(n3, serial_norm(&ref, m, world, step), 1e-5), "%s, step %d: norm %.9g, serial %.9g", m->name,
                      step, n3, serial_norm(&ref, m, world, step));
            }
        }
        if (m->scale > 0) { /* GradScaler.step + update: every rank skips the step with the inf */
            int take = ddp_grad_scaler_update(&s3.scaler, ddp_reducer_found_inf(s3.r));
            CHECK(take == ddp_grad_scaler_update(&s2.scaler, ddp_reducer_found_inf(s2.r)), "%s: scalers differ", m->name);
            CHECK(take == (step != m->inf_step) && s3.scaler.scale == (step >= m->inf_step ? m->scale / 2 : m->scale),
                  "%s, step %d: step %d, scale %g", m->name, step, take, s3.scaler.scale);
            if (!take) {
                CHECK_OK(ddp_reducer_gather_params(s2.r), NULL);
                CHECK_OK(ddp_reducer_zero_grad(s2.r), NULL);
                CHECK_OK(ddp_reducer_zero_grad(s3.r), NULL);
                continue;
            }
        }
        t++;
        adamw_shards(&s2, t);
        adamw_shards(&s3, t);
        serial_step(&ref, m, world, step, t);
        for (j = 0; j < s3.nsh; j++)
            for (e = 0; e < s3.sh[j].count; e++) {
                float a3 = ((const float *)s3.sh[j].param_data)[e], a2 = ((const float *)s2.sh[j].param_data)[e];
                float want = ref.p[s3.sh[j].param][s3.sh[j].offset + e];
                CHECK(m->exact ? a3 == a2 : fsdp_close(a3, a2, 1e-6), "%s, step %d: shard %d [%zu]: stage 3 %.9g, stage "
                      "2 %.9g", m->name, step, j, e, a3, a2);
                CHECK(fsdp_close(a3, want, m->tol), "%s, step %d: shard %d [%zu]: stage 3 %.9g, serial %.9g", m->name, step,
                      j, e, a3, want);
            }
        CHECK_OK(ddp_reducer_gather_params(s2.r), NULL);
        CHECK_OK(ddp_reducer_zero_grad(s2.r), NULL);
        CHECK_OK(ddp_reducer_zero_grad(s3.r), NULL);
    }
    CHECK_OK(ddp_reducer_get_statistics(s3.r, &st), NULL);
    CHECK(st.iterations == STEPS && st.local_iterations == (uint64_t)(STEPS * (m->accum - 1)), "%s: %llu iterations, %llu "
          "local", m->name, (unsigned long long)st.iterations, (unsigned long long)st.local_iterations);
    CHECK(st.unprefetched_waits == (uint64_t)(STEPS * m->accum * (m->prefetch ? 1 : NU - 1)),
          "%s: %llu unprefetched waits", m->name, (unsigned long long)st.unprefetched_waits);
    CHECK(st.gather_seconds >= 0 && st.gather_wait_seconds >= 0 && st.gathers > 0, "%s: gather statistics", m->name);
    serial_free(&ref);
    side_free(&s2);
    side_free(&s3);
}

static int train_main(int rank, int n, void *arg) {
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL), *g2;
    int all[4] = {0, 1, 2, 3};
    size_t k;
    (void)rank, (void)arg;
    CHECK_OK(ddp_new_group(g, all, n, &g2), NULL);
    for (k = 0; k < sizeof MODES / sizeof MODES[0]; k++) train(g, g2, &MODES[k]);
    CHECK_OK(ddp_destroy(g2), NULL);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* The memory statistics by their formulas (reducer.h "FSDP"), from the unit sizes. */
static void memory(ddp_group *g, int prefetch, ddp_dtype param, int unsharded) {
    mode m = MODES[0];
    float *p[NP], *gr[NP];
    ddp_reducer_statistics st;
    size_t world = (size_t)ddp_world_size(g), ps = param == DDP_BF16 ? 2 : 4, per[NU], count[NU], masters = 0, largest = 0;
    size_t grad_largest = 0, slices = 0, pool = 0, all_units = 0;
    uint64_t want;
    int i, u;
    ddp_reducer *r;
    m.prefetch = prefetch, m.param = param, m.unsharded = unsharded;
    memset(count, 0, sizeof count);
    for (i = 0; i < NP; i++) count[UNIT_OF[i]] += COUNT[i];
    for (u = 0; u < NU; u++) {
        per[u] = (count[u] + world - 1) / world;
        masters += per[u] * 4;
        slices += per[u] * 4;
        if (u) largest = per[u] * world > largest ? per[u] * world : largest;
        if (u) grad_largest = count[u] > grad_largest ? count[u] : grad_largest;
        all_units += count[u] * ps;
        pool = per[u] * world * 4 > pool ? per[u] * world * 4 : pool; /* stage 2's comm pool: f32 */
    }
    r = make(g, &m, 3, p, gr, NULL);
    CHECK_OK(ddp_reducer_get_statistics(r, &st), NULL);
    want = masters + (uint64_t)(1 + prefetch) * largest * ps + per[0] * world * ps;
    CHECK(st.param_bytes_peak == want, "param_bytes_peak %llu, formula %llu (prefetch %d, %s)",
          (unsigned long long)st.param_bytes_peak, (unsigned long long)want, prefetch, ddp_dtype_name(param));
    /* stage 2's: slices + 2 comm buffers (64-aligned; no landing area without compression) + the KEEP unit's
       (accumulate_unsharded: every unit's) */
    {
        size_t full = (pool + 63) / 64 * 64;
        want = slices + 2 * full + (unsharded ? all_units : count[0] * ps);
        CHECK(st.gradient_bytes == want, "gradient_bytes %llu, formula %llu before any pass",
              (unsigned long long)st.gradient_bytes, (unsigned long long)want);
        CHECK_OK(ddp_reducer_begin_backward(r), NULL);
        for (u = NU - 1; u >= 0; u--) {
            for (i = 0; i < NP; i++)
                if (UNIT_OF[i] == u) CHECK(ddp_fsdp_grad(r, i), "grad");
            CHECK_OK(ddp_fsdp_grads_ready(r, u), NULL);
        }
        CHECK_OK(ddp_reducer_end_backward(r), NULL);
        CHECK_OK(ddp_reducer_get_statistics(r, &st), NULL);
        if (param == DDP_BF16 && !unsharded) want += grad_largest * ps; /* one pool buffer: each unit gave its own back first */
        CHECK(st.gradient_bytes == want, "gradient_bytes %llu, formula %llu after a pass", (unsigned long long)st.gradient_bytes,
              (unsigned long long)want);
    }
    ddp_reducer_destroy(r);
    for (i = 0; i < NP; i++) free(p[i]), free(gr[i]);
}

/* G5: 100 passes with a loss scale; in every other one a rank (a different one each time) writes an inf
   (or a NaN) into one element of a unit's gradient: every rank sees found_inf, skips and halves the scale,
   in every round; the clean rounds step (test_amp checks the growth rule). */
static void inf_rounds(ddp_group *g) {
    mode m = MODES[0];
    float *p[NP], *gr[NP];
    ddp_grad_scaler s;
    ddp_reducer *r;
    int rank = ddp_rank(g), world = ddp_world_size(g), round, u, i, skipped = 0;
    double want = 1024;
    m.scale = 1024;
    r = make(g, &m, 3, p, gr, &s);
    for (round = 0; round < 100; round++) {
        int bad = round % 2 ? -1 : (round / 2) % world, bad_unit = round % NU;
        CHECK_OK(ddp_reducer_begin_backward(r), NULL);
        for (u = NU - 1; u >= 0; u--) {
            for (i = 0; i < NP; i++) {
                float *gv;
                if (UNIT_OF[i] != u) continue;
                gv = (float *)ddp_fsdp_grad(r, i);
                gv[0] = rank == bad && u == bad_unit ? (round % 4 ? INFINITY : NAN) : 1.0f;
            }
            CHECK_OK(ddp_fsdp_grads_ready(r, u), NULL);
        }
        CHECK_OK(ddp_reducer_end_backward(r), NULL);
        CHECK(ddp_reducer_found_inf(r) == (bad >= 0), "round %d: found_inf %d, an inf on rank %d", round,
              ddp_reducer_found_inf(r), bad);
        CHECK(ddp_grad_scaler_update(&s, ddp_reducer_found_inf(r)) == (bad < 0), "round %d: the step decision", round);
        want = bad >= 0 ? want * 0.5 : want; /* torch: x backoff on an inf (never 2000 clean steps in a row here) */
        skipped += bad >= 0;
        CHECK(s.scale == want, "round %d: scale %g, want %g", round, s.scale, want);
    }
    CHECK(skipped == 50, "skipped %d", skipped);
    ddp_reducer_destroy(r);
    for (i = 0; i < NP; i++) free(p[i]), free(gr[i]);
}

static void expect(ddp_group *g, ddp_result res, ddp_result want, const char *text, const char *what) {
    CHECK(res == want && strstr(ddp_last_error(g), text), "%s: %s (want %s): %s", what, ddp_result_string(res),
          ddp_result_string(want), ddp_last_error(g));
}

/* Refused calls, the pool overrun, then (last: it breaks the group) ranks that gather different units. */
/* A one-unit reducer from d whose finalize must be DDP_ERR_MISMATCH on every rank, naming `text`. */
static void finalize_refused(ddp_group *g, const ddp_reducer_desc *d, const char *text, const char *what) {
    float x[4] = {0};
    ddp_reducer *bad;
    CHECK_OK(ddp_reducer_create(g, d, &bad), NULL);
    CHECK(ddp_fsdp_unit(bad, "u", 0) == 0, "unit");
    CHECK_OK(ddp_reducer_add_param(bad, "x", x, NULL, 4, DDP_F32, NULL), NULL);
    expect(g, ddp_reducer_finalize(bad), DDP_ERR_MISMATCH, text, what);
    ddp_reducer_destroy(bad);
}

static int errors_main(int rank, int n, void *arg) {
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    mode m = MODES[1]; /* prefetch 0: a pool of one buffer */
    float *p[NP], *gr[NP], x[4] = {0}, gx[4];
    ddp_reducer *r, *bad;
    ddp_reducer_desc d;
    ddp_result res;
    double t0;
    int prefetch, i;
    (void)arg;
    for (prefetch = 0; prefetch <= 2; prefetch++) memory(g, prefetch, prefetch == 1 ? DDP_BF16 : DDP_DTYPE_DEFAULT, 0);
    memory(g, 1, DDP_DTYPE_DEFAULT, 1);
    memory(g, 0, DDP_BF16, 1);
    inf_rounds(g);
    memset(&d, 0, sizeof d);
    d.zero_stage = 3;
    CHECK_OK(ddp_reducer_create(g, &d, &bad), NULL);
    expect(g, ddp_reducer_add_param(bad, "x", x, NULL, 4, DDP_F32, NULL), DDP_ERR_INVALID_ARGUMENT, "call ddp_fsdp_unit first",
           "a parameter outside a unit");
    CHECK(ddp_fsdp_unit(bad, "u", 0) == 0, "unit");
    expect(g, ddp_reducer_add_param(bad, "x", x, gx, 4, DDP_F32, NULL), DDP_ERR_INVALID_ARGUMENT, "pass grad = NULL",
           "a gradient buffer at stage 3");
    expect(g, (ddp_result)ddp_fsdp_unit(bad, "v", 0), DDP_ERR_INVALID_ARGUMENT, "got no parameters", "an empty unit");
    ddp_reducer_destroy(bad);
    d.uneven_inputs = 1;
    expect(g, ddp_reducer_create(g, &d, &bad), DDP_ERR_UNSUPPORTED, "uneven_inputs", "stage 3 with uneven_inputs");
    d.uneven_inputs = 0, d.zero_stage = 2, d.prefetch = 1;
    expect(g, ddp_reducer_create(g, &d, &bad), DDP_ERR_INVALID_ARGUMENT, "zero_stage 3's", "prefetch at stage 2");
    /* ranks with different pools, or no_sync modes (a no_sync pass would reduce-scatter on some ranks only):
       every rank refuses at finalize (a pool overrun on one rank alone would leave the others waiting) */
    d.zero_stage = 3, d.prefetch = rank == 1 ? 2 : 1;
    finalize_refused(g, &d, "rank 0 has 1 / default / 0, rank 1 has 2 / default / 0", "prefetch differs");
    d.prefetch = 1, d.accumulate_unsharded = rank == 1;
    finalize_refused(g, &d, "rank 0 has 1 / default / 0, rank 1 has 1 / default / 1", "accumulate_unsharded differs");
    d.accumulate_unsharded = 0;

    r = make(g, &m, 3, p, gr, NULL);
    expect(g, ddp_reducer_gather_params(r), DDP_ERR_STATE, "ddp_fsdp_gather", "gather_params at stage 3");
    CHECK_OK(ddp_reducer_begin_backward(r), NULL);
    expect(g, ddp_reducer_grad_ready(r, 1), DDP_ERR_STATE, "ddp_fsdp_grads_ready", "grad_ready at stage 3");
    CHECK_OK(ddp_fsdp_grads_ready(r, 4), NULL);
    expect(g, ddp_fsdp_grads_ready(r, 4), DDP_ERR_STATE, "called twice", "grads_ready twice");
    CHECK(ddp_fsdp_grad(r, 7) == NULL, "a gradient after grads_ready");
    for (i = 3; i >= 0; i--) CHECK_OK(ddp_fsdp_grads_ready(r, i), NULL);
    CHECK_OK(ddp_reducer_end_backward(r), NULL);
    /* the pool: one buffer. A second gather fails on every rank before any collective; the group goes on */
    CHECK_OK(ddp_fsdp_gather(r, 1), NULL);
    CHECK_OK(ddp_fsdp_gather(r, 1), NULL); /* in flight already: nothing */
    expect(g, ddp_fsdp_gather(r, 2), DDP_ERR_STATE, "hold units 1 (\"layer1\")", "a gather beyond the pool");
    CHECK_OK(ddp_fsdp_wait(r, 1), NULL);
    CHECK_OK(ddp_fsdp_release(r, 1), NULL);
    CHECK(ddp_fsdp_param(r, 1) == NULL, "a released unit's parameter");
    CHECK_OK(ddp_fsdp_wait(r, 2), NULL);
    CHECK_OK(ddp_fsdp_wait(r, 0), NULL); /* KEEP: its own buffer, beside the pool's */
    CHECK(ddp_fsdp_param(r, 0) && ddp_fsdp_param(r, 3), "gathered");
    CHECK_OK(ddp_fsdp_release(r, 2), NULL);
    CHECK_OK(ddp_barrier(g), NULL);
    /* rank 1 gathers unit 4 while the others gather unit 1 (the same size): every rank fails, naming both */
    t0 = tl_now();
    res = ddp_fsdp_wait(r, rank == 1 ? 4 : 1);
    CHECK(res == DDP_ERR_MISMATCH, "different units: %s: %s", ddp_result_string(res), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "FSDP unit 1's all-gather") && strstr(ddp_last_error(g), "FSDP unit 4's all-gather"),
          "the message names both units: %s", ddp_last_error(g));
    CHECK(tl_now() - t0 < 5, "the mismatch took %.1f s", tl_now() - t0);
    if (rank == 0) printf("ranks gathering different units (%d ranks), %.3f s: %s\n", n, tl_now() - t0, ddp_last_error(g));
    ddp_reducer_destroy(r);
    for (i = 0; i < NP; i++) free(p[i]), free(gr[i]);
    ddp_destroy(g);
    return 0;
}

int main(int argc, char **argv) {
    static char *sizes[] = {NULL, (char *)"1", (char *)"2", (char *)"3", (char *)"4"};
    int n;
    if (argc == 1) sizes[0] = argv[0], argc = 5, argv = sizes;
    tl_sweep(argc, argv, train_main, 120, "zero_stage 3 equals zero_stage 2 and the serial reference in every mode", NULL);
    for (n = 2; n <= 3; n++) {
        setenv("DDP_TRANSPORT", tl_transport(n - 2), 1);
        CHECK(tl_run_ranks(n, errors_main, NULL, 60) == 0, "errors, %d ranks", n);
    }
    printf("test_reducer_fsdp: ok\n");
    return 0;
}
