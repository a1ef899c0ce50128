/* join_uneven: training when the ranks have different amounts of data, as PyTorch's
       with model.join():                       # torch.distributed.algorithms.join.Join
           for batch in my_shard:                # some ranks run out before others
               loss_fn(model(batch)).backward(); optimizer.step(); optimizer.zero_grad()

   Real data loaders often give the ranks different numbers of batches (files of different sizes, a
   filter, the last partial shard; the evaluation sampler's shards differ by one too). Without Join the
   first rank to run out stops taking part in the all-reduces and the others wait for it: an error (or a
   hang, in torch). With uneven_inputs = 1, a rank that has no data left calls ddp_reducer_join(red): it
   contributes zero gradients to the others' steps until every rank has joined. Gradients are divided by
   the INITIAL world size, as torch's default (divide_by_initial_world_size=True), so step s averages
       sum over the ranks that still have data of their batch gradient / world size.
   When the last rank joins, every rank gets its model, so all end with the same weights.
   Here rank r has 10 - 4r batches (2 ranks: 10 and 6; 4 ranks: 10, 6, 2 and none at all). Every rank
   then repeats the whole run serially, one process computing each step's average as above, and checks
   that its weights are that run's.
   With --fail-early (join_fail_early = 1, torch's throw_on_early_termination=True) every rank stops with
   DDP_ERR_UNEVEN_INPUTS at the step where the first rank runs out, naming it.

   Run:  make build/join_uneven build/ddprun
         build/ddprun --nproc-per-node 3 build/join_uneven [--fail-early]     (1 to 4 ranks) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HID = 16, OUT = 2, BATCH = 8 };
enum { W1, B1, W2, B2, NPARAM };
static const int sizes[NPARAM] = {HID * IN, HID, OUT * HID, OUT};
static const char *const names[NPARAM] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

typedef struct mlp {
    float w[NPARAM][HID * IN]; /* torch's Linear layout (out x in); room for the largest parameter */
    float grad[NPARAM][HID * IN];
} mlp;

static int batches(int rank) { return rank < 3 ? 10 - 4 * rank : 0; }

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* Sample i of rank r's batch s: x uniform in [-1, 1]^8, y = (sin(sum x), cos(x0 - x7)). */
static void sample(int r, int s, int i, float *x, float *y) {
    unsigned seed = (unsigned)(r * 1000003 + s * 100003 + i * 7919 + 1);
    float a = 0;
    int k;
    for (k = 0; k < IN; k++) a += x[k] = frand(&seed);
    y[0] = sinf(a), y[1] = cosf(x[0] - x[IN - 1]);
}

static void init(mlp *m) {
    unsigned seed = 42;
    int i;
    memset(m, 0, sizeof *m);
    for (i = 0; i < HID * IN; i++) m->w[W1][i] = frand(&seed) / sqrtf(IN);
    for (i = 0; i < OUT * HID; i++) m->w[W2][i] = frand(&seed) / sqrtf(HID);
}

/* Forward and backward of rank r's batch s: ADDS scale * the gradient of the batch's mean squared error. */
static void accumulate(mlp *m, int r, int s, float scale) {
    int i, j, k;
    for (i = 0; i < BATCH; i++) {
        float x[IN], y[OUT], h[HID], dout[OUT], dh[HID];
        sample(r, s, i, x, y);
        for (j = 0; j < HID; j++) {
            float z = m->w[B1][j];
            for (k = 0; k < IN; k++) z += m->w[W1][j * IN + k] * x[k];
            h[j] = tanhf(z);
        }
        for (j = 0; j < OUT; j++) {
            float z = m->w[B2][j];
            for (k = 0; k < HID; k++) z += m->w[W2][j * HID + k] * h[k];
            dout[j] = scale * 2.0f * (z - y[j]) / (float)(BATCH * OUT);
        }
        for (k = 0; k < HID; k++) {
            dh[k] = 0;
            for (j = 0; j < OUT; j++) dh[k] += dout[j] * m->w[W2][j * HID + k];
            dh[k] *= 1.0f - h[k] * h[k];
        }
        for (j = 0; j < OUT; j++) {
            m->grad[B2][j] += dout[j];
            for (k = 0; k < HID; k++) m->grad[W2][j * HID + k] += dout[j] * h[k];
        }
        for (j = 0; j < HID; j++) {
            m->grad[B1][j] += dh[j];
            for (k = 0; k < IN; k++) m->grad[W1][j * IN + k] += dh[j] * x[k];
        }
    }
}

static void sgd_and_zero(mlp *m) {
    int p, i;
    for (p = 0; p < NPARAM; p++)
        for (i = 0; i < sizes[p]; i++) m->w[p][i] -= 0.2f * m->grad[p][i], m->grad[p][i] = 0;
}

/* The serial run: step s averages the batches of the ranks that still have data over the world size. */
static double serial_difference(const mlp *ddp, int world) {
    static mlp one;
    double worst = 0;
    int s, r, p, i, steps = batches(0);
    init(&one);
    for (s = 0; s < steps; s++) {
        for (r = 0; r < world; r++)
            if (s < batches(r)) accumulate(&one, r, s, 1.0f / (float)world);
        sgd_and_zero(&one);
    }
    for (p = 0; p < NPARAM; p++)
        for (i = 0; i < sizes[p]; i++) worst = fmax(worst, fabs(ddp->w[p][i] - one.w[p][i]));
    return worst;
}

#define TRY(call)                                                                              \
    do {                                                                                       \
        if ((call) != DDP_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

int main(int argc, char **argv) {
    static mlp m;
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    ddp_result res;
    int p, step, rank, world, fail_early = argc > 1 && strcmp(argv[1], "--fail-early") == 0;
    double diff;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g), world = ddp_world_size(g);
    if (world > 4) {
        if (rank == 0) fprintf(stderr, "join_uneven: run it on 1 to 4 ranks\n");
        ddp_destroy(g);
        return 1;
    }
    init(&m);
    memset(&d, 0, sizeof d);
    d.uneven_inputs = 1;            /* ranks may run out of data: ddp_reducer_join */
    d.join_fail_early = fail_early; /* or stop every rank when the first one runs out */
    TRY(ddp_reducer_create(g, &d, &red));
    for (p = 0; p < NPARAM; p++) TRY(ddp_reducer_add_param(red, names[p], m.w[p], m.grad[p], (size_t)sizes[p], DDP_F32, NULL));
    TRY(ddp_reducer_finalize(red));

    res = DDP_SUCCESS;
    for (step = 0; step < batches(rank); step++) { /* this rank's shard */
        res = ddp_reducer_begin_backward(red);  /* with uneven_inputs also: "I still have data" */
        if (res == DDP_ERR_UNEVEN_INPUTS) break; /* join_fail_early: some rank has run out */
        TRY(res);
        accumulate(&m, rank, step, 1.0f);       /* backward; a real program calls grad_ready per layer */
        for (p = NPARAM - 1; p >= 0; p--) TRY(ddp_reducer_grad_ready(red, p));
        TRY(ddp_reducer_end_backward(red));     /* sum over the ranks with data / world size */
        sgd_and_zero(&m);
    }
    if (!res) res = ddp_reducer_join(red); /* out of data: shadow the others until every rank has joined */
    if (res == DDP_ERR_UNEVEN_INPUTS) {    /* every rank gets it, at the same step */
        printf("rank %d: stopped at step %d: DDP_ERR_UNEVEN_INPUTS\n", rank, step + 1);
        if (rank == 0) printf("%s\n", ddp_last_error(g));
        ddp_reducer_destroy(red);
        ddp_destroy(g);
        return 0;
    }
    TRY(res);
    TRY(ddp_reducer_get_statistics(red, &st));
    diff = serial_difference(&m, world);
    printf("rank %d: %d batches, then shadowed %llu steps of the others; final weights vs the serial run: %s\n", rank,
           batches(rank), (unsigned long long)st.shadowed_iterations, diff < 1e-5 ? "equal (rounding only)" : "DIFFERENT");
    ddp_reducer_destroy(red);
    ddp_destroy(g);
    return diff < 1e-5 ? 0 : 1;
}
