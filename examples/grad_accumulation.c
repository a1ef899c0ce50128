/* grad_accumulation: gradient accumulation with no_sync, as in PyTorch's
       for i, micro in enumerate(micro_batches):
           ctx = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
           with ctx: loss_fn(model(micro)).backward()       # only the last backward all-reduces
       optimizer.step(); optimizer.zero_grad()

   Shows: ddp_reducer_set_sync(red, 0) for every micro-batch but the last, so the gradients add up
   locally (the program ADDS to its gradient buffers) and only the last backward all-reduces the sum:
   one all-reduce per optimizer step instead of one per micro-batch. Also: registering parameters,
   grad_ready() where autograd's hook would fire (output layer first), and the reducer's statistics.
   Every step trains on a global batch of 96 samples: 96 / world samples per rank, in ACCUM = 2
   micro-batches. At the end rank 0 trains the same model in one process on the whole 96-sample batch
   per step, with no accumulation, and prints the largest weight difference (rounding only).

   Run:  make build/grad_accumulation build/ddprun
         build/ddprun --nproc-per-node 2 build/grad_accumulation     (1, 2, 3, 4, 6 or 8 ranks) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HID = 32, OUT = 2, GLOBAL_BATCH = 96, STEPS = 150, ACCUM = 2 };
enum { W1, B1, W2, B2, NPARAM };
static const int sizes[NPARAM] = {HID * IN, HID, OUT * HID, OUT};
static const char *const names[NPARAM] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

typedef struct mlp {
    float w[NPARAM][HID * IN]; /* each parameter, torch's Linear layout (out x in); room for the largest */
    float grad[NPARAM][HID * IN];
    int index[NPARAM];         /* the parameter's index in the reducer */
} mlp;

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* Sample i of step s: x uniform in [-1, 1]^8, y = (sin(sum x), cos(first half - second half)). */
static void sample(int s, int i, float *x, float *y) {
    unsigned seed = (unsigned)(s * 100003 + i * 7919 + 1);
    float a = 0, d = 0;
    int k;
    for (k = 0; k < IN; k++) {
        x[k] = frand(&seed);
        a += x[k];
        d += k < IN / 2 ? x[k] : -x[k];
    }
    y[0] = sinf(a), y[1] = cosf(d);
}

static void init(mlp *m) {
    unsigned seed = 42;
    int i;
    memset(m, 0, sizeof *m);
    for (i = 0; i < HID * IN; i++) m->w[W1][i] = frand(&seed) / sqrtf(IN);
    for (i = 0; i < OUT * HID; i++) m->w[W2][i] = frand(&seed) / sqrtf(HID);
}

/* Forward and backward of samples first .. first+n-1 of step s: ADDS the gradient of
   sum over them of squared error / (mean_over * OUT) to m->grad (a micro-batch's share of the mean). */
static void accumulate(mlp *m, int s, int first, int n, int mean_over) {
    int i, j, k;
    for (i = first; i < first + n; i++) {
        float x[IN], y[OUT], h[HID], dout[OUT], dh[HID];
        sample(s, i, x, y);
        for (j = 0; j < HID; j++) {
            float z = m->w[B1][j];
            for (k = 0; k < IN; k++) z += m->w[W1][j * IN + k] * x[k];
            h[j] = tanhf(z);
        }
        for (j = 0; j < OUT; j++) {
            float z = m->w[B2][j];
            for (k = 0; k < HID; k++) z += m->w[W2][j * HID + k] * h[k];
            dout[j] = 2.0f * (z - y[j]) / (float)(mean_over * OUT);
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

static void sgd(mlp *m) {
    int p, i;
    for (p = 0; p < NPARAM; p++)
        for (i = 0; i < sizes[p]; i++) m->w[p][i] -= 0.1f * m->grad[p][i];
}

#define TRY(call)                                                                              \
    do {                                                                                       \
        if ((call) != DDP_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

int main(void) {
    static mlp m, one; /* the DDP replica; the single-process model of the check */
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    int p, i, step, micro, rank, world, shard;
    double worst = 0;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g), world = ddp_world_size(g);
    if (GLOBAL_BATCH % (world * ACCUM)) {
        fprintf(stderr, "a batch of %d does not split into %d ranks x %d micro-batches\n", GLOBAL_BATCH, world, ACCUM);
        return 1;
    }
    shard = GLOBAL_BATCH / world / ACCUM; /* samples per rank per micro-batch */
    init(&m);

    memset(&d, 0, sizeof d); /* PyTorch's defaults: 25 MiB buckets, f32 */
    TRY(ddp_reducer_create(g, &d, &red));
    for (p = 0; p < NPARAM; p++) TRY(ddp_reducer_add_param(red, names[p], m.w[p], m.grad[p], (size_t)sizes[p], DDP_F32, &m.index[p]));
    TRY(ddp_reducer_finalize(red)); /* the same model on every rank? then rank 0's weights everywhere */

    for (step = 0; step < STEPS; step++) {
        for (micro = 0; micro < ACCUM; micro++) {
            int first = (micro * world + rank) * shard; /* this rank's samples of this micro-batch */
            TRY(ddp_reducer_set_sync(red, micro == ACCUM - 1)); /* no_sync() but for the last micro-batch */
            TRY(ddp_reducer_begin_backward(red));
            accumulate(&m, step, first, shard, shard * ACCUM);
            /* backward's hooks, output layer first (here all samples finish at once) */
            TRY(ddp_reducer_grad_ready(red, m.index[B2]));
            TRY(ddp_reducer_grad_ready(red, m.index[W2]));
            TRY(ddp_reducer_grad_ready(red, m.index[B1]));
            TRY(ddp_reducer_grad_ready(red, m.index[W1]));
            TRY(ddp_reducer_end_backward(red)); /* after the last micro-batch: the average over ranks */
        }
        sgd(&m);
        TRY(ddp_reducer_zero_grad(red));
    }
    memset(&st, 0, sizeof st);
    TRY(ddp_reducer_get_statistics(red, &st));
    if (rank == 0)
        printf("%d ranks: %llu optimizer steps, %llu backward passes under no_sync, %d bucket(s) of %llu bytes "
               "all-reduced once per step\n", world, (unsigned long long)st.iterations,
               (unsigned long long)st.local_iterations, st.buckets, (unsigned long long)st.bytes_reduced);
    ddp_reducer_destroy(red);
    TRY(ddp_destroy(g));
    if (rank != 0) return 0;

    init(&one); /* one process, the whole batch at once, no accumulation */
    for (step = 0; step < STEPS; step++) {
        accumulate(&one, step, 0, GLOBAL_BATCH, GLOBAL_BATCH);
        sgd(&one);
        memset(one.grad, 0, sizeof one.grad);
    }
    for (p = 0; p < NPARAM; p++)
        for (i = 0; i < sizes[p]; i++) worst = fmax(worst, fabs((double)m.w[p][i] - one.w[p][i]));
    printf("largest difference from one process on the whole batch: %.3g (%s)\n", worst,
           worst <= 1e-5 ? "rounding only" : "TOO LARGE");
    return worst <= 1e-5 ? 0 : 1;
}
