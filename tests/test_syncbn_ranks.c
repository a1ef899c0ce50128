/* SyncBatchNorm over forked ranks: uneven and empty per-rank batches, both layouts, subgroups, and the
   counts torch treats specially (1 value per channel over all ranks: an error on every rank; none at
   all: nothing to do). Every rank builds all ranks' data and checks its own slice against the serial
   f64 BatchNorm of test_syncbn_ref.h on the concatenated batch; the sums over ranks of the local
   grad_weight/grad_bias go through shared memory to the parent, which checks them. The counter at the
   program's int64_t (desc.num_batches_tracked), registered as a reducer buffer with the running stats,
   is broadcast from rank 0 by finalize and ddp_reducer_broadcast_buffers (run_buffers). */
#include "testlib.h"
#include "test_syncbn_ref.h"

#include <sys/mman.h>

#define TOL 1e-5
#define STEPS 3
#define MAXC 32

typedef struct scenario {
    int R, C, channels_last, subgroups; /* subgroups: ranks split in two halves, each its own group */
    int64_t S;
    int64_t batches[8]; /* per rank at step 0; step s uses batches[(rank + s) % R] */
} scenario;

typedef struct shared {
    float gw[8][STEPS][MAXC], gb[8][STEPS][MAXC]; /* per rank and step: local grad_weight, grad_bias */
    double ref_gw[2][STEPS][MAXC], ref_gb[2][STEPS][MAXC];
} shared;

static const scenario *cur;
static shared *shm;

static int64_t batch_of(const scenario *sc, int rank, int step) { return sc->batches[(rank + step) % sc->R]; }

/* Rank r's data at a step: x and dy of batch_of(...) * S * C floats. */
static void rank_data(const scenario *sc, int r, int step, float *x, float *dy) {
    uint64_t st = 1000u * (uint64_t)step + (uint64_t)r, st2 = st + 0x51ed27u;
    const int64_t n = batch_of(sc, r, step) * sc->S * sc->C;
    ref_fill(x, n, &st, 0.5f * (float)r - 0.5f, 1.0f + 0.5f * (float)r);
    ref_fill(dy, n, &st2, 0.1f, 1.0f);
}

static int run_rank(int rank, int R, void *arg) {
    const scenario *sc = cur;
    const int64_t C = sc->C, S = sc->S, cap = 64 * S * C;
    const int half = R / 2, lo = sc->subgroups ? (rank < half ? 0 : half) : 0, hi = sc->subgroups ? (rank < half ? half : R) : R;
    float *xall = (float *)malloc(sizeof(float) * (size_t)cap), *dyall = (float *)malloc(sizeof(float) * (size_t)cap);
    float *y = (float *)malloc(sizeof(float) * (size_t)cap), *dx = (float *)malloc(sizeof(float) * (size_t)cap);
    double *ry = (double *)malloc(sizeof(double) * (size_t)cap), *rdx = (double *)malloc(sizeof(double) * (size_t)cap);
    float w[MAXC], b[MAXC], rm[MAXC], rv[MAXC];
    double rrm[MAXC], rrv[MAXC], rgw[MAXC], rgb[MAXC];
    ddp_group *g, *halves[2] = {NULL, NULL};
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    ref_bn ref;
    uint64_t st = 5;
    int step, c, r;
    (void)arg;
    CHECK(xall && dyall && y && dx && ry && rdx && C <= MAXC, "no memory");
    CHECK_OK(ddp_init(NULL, &g), NULL);
    if (sc->subgroups) {
        int first[8], second[8];
        for (r = 0; r < R; r++) {
            if (r < half)
                first[r] = r;
            else
                second[r - half] = r;
        }
        CHECK_OK(ddp_new_group(g, first, half, &halves[0]), g);
        CHECK_OK(ddp_new_group(g, second, R - half, &halves[1]), g);
    }
    ref_fill(w, C, &st, 1.0f, 0.5f);
    ref_fill(b, C, &st, 0.0f, 0.5f);
    for (c = 0; c < C; c++) {
        rrm[c] = rm[c] = 0.1f * (float)c;
        rrv[c] = rv[c] = 1.0f + 0.1f * (float)c;
    }
    memset(&d, 0, sizeof d);
    d.num_features = (int)C;
    d.channels_last = sc->channels_last;
    d.weight = w;
    d.bias = b;
    d.running_mean = rm;
    d.running_var = rv;
    d.momentum = 0.25;
    d.group = sc->subgroups ? halves[rank < half ? 0 : 1] : NULL;
    CHECK_OK(ddp_syncbn_create(g, &d, &bn), g);
    memset(&ref, 0, sizeof ref);
    ref.C = (int)C;
    ref.channels_last = sc->channels_last;
    ref.eps = 1e-5;
    ref.momentum = 0.25;
    ref.weight = w;
    ref.bias = b;
    ref.track = 1;
    ref.running_mean = rrm;
    ref.running_var = rrv;
    for (step = 0; step < STEPS; step++) {
        /* the concatenation of this group's batches; mine starts at `mine` samples */
        int64_t total = 0, mine = 0, n = batch_of(sc, rank, step), off;
        for (r = lo; r < hi; r++) { /* both layouts keep each sample contiguous: concatenation appends */
            if (r == rank) mine = total;
            rank_data(sc, r, step, xall + total * S * C, dyall + total * S * C);
            total += batch_of(sc, r, step);
        }
        CHECK(total <= 64, "scenario too large");
        ref_bn_train(&ref, xall, dyall, total, S, ry, rdx, rgw, rgb);
        off = mine * S * C;
        memset(shm->gw[rank][step], 0, sizeof shm->gw[rank][step]);
        memset(shm->gb[rank][step], 0, sizeof shm->gb[rank][step]);
        CHECK_OK(ddp_syncbn_forward(bn, xall + off, y, n, S, 1), g);
        CHECK_OK(ddp_syncbn_backward(bn, xall + off, dyall + off, rank % 2 ? dx : NULL, shm->gw[rank][step],
                                     shm->gb[rank][step], n, S),
                 g);
        CHECK(ref_rel_err_f32(y, ry + off, n * S * C) <= TOL, "rank %d step %d: y error %.3g", rank, step,
              ref_rel_err_f32(y, ry + off, n * S * C));
        if (rank % 2) /* even ranks asked for no dx: they still took part in the all_reduce */
            CHECK(ref_rel_err_f32(dx, rdx + off, n * S * C) <= TOL, "rank %d step %d: dx error %.3g", rank, step,
                  ref_rel_err_f32(dx, rdx + off, n * S * C));
        CHECK(ref_rel_err_f32(rm, rrm, C) <= TOL && ref_rel_err_f32(rv, rrv, C) <= TOL,
              "rank %d step %d: running stats error %.3g %.3g", rank, step, ref_rel_err_f32(rm, rrm, C),
              ref_rel_err_f32(rv, rrv, C));
        CHECK(ddp_syncbn_num_batches_tracked(bn) == step + 1, "num_batches_tracked");
        if (rank == lo) {
            memcpy(shm->ref_gw[lo ? 1 : 0][step], rgw, sizeof(double) * (size_t)C);
            memcpy(shm->ref_gb[lo ? 1 : 0][step], rgb, sizeof(double) * (size_t)C);
        }
    }
    ddp_syncbn_destroy(bn);
    if (halves[0]) CHECK_OK(ddp_destroy(halves[0]), g);
    if (halves[1]) CHECK_OK(ddp_destroy(halves[1]), g);
    CHECK_OK(ddp_destroy(g), NULL);
    free(xall);
    free(dyall);
    free(y);
    free(dx);
    free(ry);
    free(rdx);
    return 0;
}

static void run_scenario(const scenario *sc) {
    int step, c, r, k;
    cur = sc;
    memset(shm, 0, sizeof *shm);
    CHECK(tl_run_ranks(sc->R, run_rank, NULL, 60) == 0, "R=%d C=%d S=%lld cl=%d: a rank failed", sc->R, sc->C,
          (long long)sc->S, sc->channels_last);
    for (k = 0; k < (sc->subgroups ? 2 : 1); k++) {
        const int lo = k ? sc->R / 2 : 0, hi = sc->subgroups && !k ? sc->R / 2 : sc->R;
        for (step = 0; step < STEPS; step++) {
            float gw[MAXC] = {0}, gb[MAXC] = {0};
            for (r = lo; r < hi; r++)
                for (c = 0; c < sc->C; c++) {
                    gw[c] += shm->gw[r][step][c];
                    gb[c] += shm->gb[r][step][c];
                }
            CHECK(ref_rel_err_f32(gw, shm->ref_gw[k][step], sc->C) <= TOL &&
                      ref_rel_err_f32(gb, shm->ref_gb[k][step], sc->C) <= TOL,
                  "R=%d group %d step %d: sum of grad_weight/grad_bias over ranks: errors %.3g %.3g", sc->R, k, step,
                  ref_rel_err_f32(gw, shm->ref_gw[k][step], sc->C), ref_rel_err_f32(gb, shm->ref_gb[k][step], sc->C));
        }
    }
    printf("R=%d C=%d S=%lld %s%s: ok\n", sc->R, sc->C, (long long)sc->S, sc->channels_last ? "channels_last" : "channels_first",
           sc->subgroups ? ", two subgroups" : "");
}

/* One value per channel over all ranks is an error on every rank, together; no values at all is fine. */
static int run_counts(int rank, int R, void *arg) {
    ddp_group *g;
    ddp_syncbn *bn;
    ddp_syncbn_desc d;
    float rm[2] = {1, 2}, rv[2] = {3, 4}, x[2] = {5, 6}, y[2], one[2];
    ddp_result res;
    (void)arg;
    (void)R;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.num_features = 2;
    d.running_mean = rm;
    d.running_var = rv;
    CHECK_OK(ddp_syncbn_create(g, &d, &bn), g);
    res = ddp_syncbn_forward(bn, x, y, rank == 1 ? 1 : 0, 1, 1);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "more than 1 value per channel"),
          "rank %d: one value over all ranks gave %s: %s", rank, ddp_result_string(res), ddp_last_error(g));
    CHECK(rm[0] == 1 && rv[1] == 4 && ddp_syncbn_num_batches_tracked(bn) == 0, "state changed by a failed forward");
    CHECK_OK(ddp_syncbn_forward(bn, NULL, NULL, 0, 1, 1), g); /* empty everywhere */
    CHECK_OK(ddp_syncbn_backward(bn, NULL, NULL, NULL, NULL, NULL, 0, 1), g);
    CHECK(rm[0] == 1 && rv[1] == 4 && ddp_syncbn_num_batches_tracked(bn) == 1, "empty everywhere");
    one[0] = 7.0f + (float)rank; /* the group still works: 1 value on each of the R ranks */
    one[1] = 1.0f;
    CHECK_OK(ddp_syncbn_forward(bn, one, y, 1, 1, 1), g);
    CHECK(fabsf(rm[0] - (0.9f * 1 + 0.1f * (7.0f + 0.5f * (float)(R - 1)))) < 1e-5f, "rank %d: mean over ranks %g", rank,
          rm[0]);
    ddp_syncbn_destroy(bn);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* A peer that dies: the survivor's forward fails, naming the step, and does not hang. */
static int run_lost(int rank, int R, void *arg) {
    ddp_group *g;
    ddp_syncbn *bn;
    ddp_syncbn_desc d;
    float x[4] = {1, 2, 3, 4}, y[4];
    ddp_result res;
    (void)arg;
    (void)R;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    if (rank == 1) _exit(0); /* gone without a word */
    memset(&d, 0, sizeof d);
    d.num_features = 2;
    CHECK_OK(ddp_syncbn_create(g, &d, &bn), g);
    res = ddp_syncbn_forward(bn, x, y, 2, 1, 1);
    CHECK(res != DDP_SUCCESS && strstr(ddp_last_error(g), "all_gather of the batch statistics"),
          "forward with a lost peer gave %s: %s", ddp_result_string(res), ddp_last_error(g));
    printf("lost peer: %s: %s\n", ddp_result_string(res), ddp_last_error(g));
    ddp_syncbn_destroy(bn);
    ddp_destroy(g);
    return 0;
}

/* desc.num_batches_tracked registered as a buffer of the reducer with the running stats (torch's DDP
   broadcast_buffers=True): ddp_reducer_finalize and ddp_reducer_broadcast_buffers give every rank rank
   0's counter (an I64 buffer) and stats, and the synced forwards then advance the counter in place on
   every rank alike (momentum None: the same factor 1 / num_batches_tracked everywhere). */
static int run_buffers(int rank, int R, void *arg) {
    enum { C = 3 };
    ddp_group *g;
    ddp_syncbn *bn;
    ddp_syncbn_desc d;
    ddp_reducer *red;
    ddp_reducer_desc rd;
    float rm[C], rv[C], w[C] = {1, 1, 1}, gw[C] = {0, 0, 0}, x[4 * C], y[4 * C], all_rm[2 * C];
    int64_t nbt = rank == 0 ? 5 : 17, all_nbt[2];
    uint64_t st = 31 + (uint64_t)rank;
    int c, step, iw;
    (void)arg;
    CHECK(R == 2, "run_buffers is written for 2 ranks");
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (c = 0; c < C; c++) rm[c] = (float)(rank * 10 + c), rv[c] = 1.0f + (float)rank;
    memset(&d, 0, sizeof d);
    d.num_features = C, d.momentum = -1, d.weight = w, d.running_mean = rm, d.running_var = rv, d.num_batches_tracked = &nbt;
    CHECK_OK(ddp_syncbn_create(g, &d, &bn), g);
    memset(&rd, 0, sizeof rd);
    CHECK_OK(ddp_reducer_create(g, &rd, &red), g);
    CHECK_OK(ddp_reducer_add_param(red, "bn.weight", w, gw, C, DDP_F32, &iw), g);
    CHECK_OK(ddp_reducer_add_buffer(red, "bn.running_mean", rm, C, DDP_F32), g);
    CHECK_OK(ddp_reducer_add_buffer(red, "bn.running_var", rv, C, DDP_F32), g);
    CHECK_OK(ddp_reducer_add_buffer(red, "bn.num_batches_tracked", &nbt, 1, DDP_I64), g);
    CHECK_OK(ddp_reducer_finalize(red), g); /* rank 0's state everywhere */
    CHECK(nbt == 5 && ddp_syncbn_num_batches_tracked(bn) == 5 && rm[2] == 2.0f && rv[0] == 1.0f,
          "rank %d after finalize: counter %lld, running_mean[2] %g, running_var[0] %g (rank 0's: 5, 2, 1)", rank,
          (long long)nbt, rm[2], rv[0]);
    for (step = 1; step <= 3; step++) {
        if (step == 3) { /* a rank drifts (its own checkpoint, say): the broadcast before forward fixes it */
            if (rank == 1) nbt = 100, rm[0] += 1.0f;
            CHECK_OK(ddp_reducer_broadcast_buffers(red), g);
            CHECK(nbt == 7, "rank %d: counter %lld after broadcast_buffers, rank 0's is 7", rank, (long long)nbt);
        }
        ref_fill(x, 4 * C, &st, (float)rank, 1.0f);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, 4, 1, 1), g);
        CHECK(nbt == 5 + step && ddp_syncbn_num_batches_tracked(bn) == 5 + step, "rank %d step %d: counter %lld", rank,
              step, (long long)nbt);
    }
    CHECK_OK(ddp_all_gather(g, &nbt, all_nbt, 1, DDP_I64), g);
    CHECK_OK(ddp_all_gather(g, rm, all_rm, C, DDP_F32), g);
    CHECK(all_nbt[0] == 8 && all_nbt[1] == 8 && memcmp(all_rm, all_rm + C, sizeof rm) == 0,
          "rank %d: counters %lld and %lld, running stats %s", rank, (long long)all_nbt[0], (long long)all_nbt[1],
          memcmp(all_rm, all_rm + C, sizeof rm) ? "differ" : "equal");
    if (rank == 0) printf("num_batches_tracked as a reducer buffer: rank 0's counter on both ranks, advanced in place\n");
    ddp_reducer_destroy(red);
    ddp_syncbn_destroy(bn);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    static const scenario scenarios[] = {
        {3, 5, 0, 0, 7, {4, 0, 3}},         /* channels-first, lanes tail, an empty rank */
        {3, 19, 1, 0, 6, {1, 5, 0}},        /* channels-last */
        {2, 6, 0, 0, 1, {9, 0}},            /* BatchNorm1d (N, C), one rank empty */
        {4, 8, 0, 1, 10, {2, 3, 0, 1}},     /* two subgroups of 2 */
        {8, 3, 1, 0, 4, {1, 0, 2, 0, 3, 1, 0, 2}},
    };
    size_t i;
    shm = (shared *)mmap(NULL, sizeof *shm, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(shm != MAP_FAILED, "mmap");
    for (i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) run_scenario(&scenarios[i]);
    CHECK(tl_run_ranks(2, run_counts, NULL, 60) == 0, "count checks on 2 ranks");
    CHECK(tl_run_ranks(3, run_counts, NULL, 60) == 0, "count checks on 3 ranks");
    CHECK(tl_run_ranks(2, run_buffers, NULL, 60) == 0, "num_batches_tracked as a reducer buffer on 2 ranks");
    setenv("DDP_TIMEOUT", "20", 1);
    CHECK(tl_run_ranks(2, run_lost, NULL, 60) == 0, "lost peer");
    printf("test_syncbn_ranks: ok\n");
    return 0;
}
