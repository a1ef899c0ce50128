/* ddp_mlp: data-parallel training of a small MLP with ddp.h's reducer (PyTorch's DistributedDataParallel).

   What it shows: registering parameters, the backward pass calling ddp_reducer_grad_ready() where PyTorch's
   autograd hook would fire (output layer first), gradient accumulation with no_sync, and the statistics.
   Every rank trains on its own shard of each batch; after end_backward the gradients are the average over
   all ranks, so every rank takes the same SGD step and the weights stay identical everywhere.

   Run it:
       make build/ddp_mlp build/ddprun
       build/ddprun --nproc-per-node 2 build/ddp_mlp          (or: torchrun --nproc_per_node 2 --no_python ...)
       build/ddp_mlp                                            (one process: the same final weights) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HID = 32, OUT = 2, GLOBAL_BATCH = 96, STEPS = 200, ACCUM = 2 };

static float W1[HID * IN], b1[HID], W2[OUT * HID], b2[OUT];     /* torch's Linear layout: W is out x in */
static float gW1[HID * IN], gb1[HID], gW2[OUT * HID], gb2[OUT]; /* their gradients */

static float frand(unsigned *s) { return (float)((*s = *s * 1664525u + 1013904223u) >> 8) / 16777216.0f * 2.0f - 1.0f; }

/* The data: y = sin(sum of x) and cos(first half - second half), sample i of step s. */
static void sample(int s, int i, float *x, float *y) {
    unsigned seed = (unsigned)(s * 100003 + i * 7919 + 1);
    float a = 0, d = 0;
    int k;
    for (k = 0; k < IN; k++) x[k] = frand(&seed), a += x[k], d += k < IN / 2 ? x[k] : -x[k];
    y[0] = sinf(a), y[1] = cosf(d);
}

/* Forward and backward for n samples; ADDS gradients of the mean squared error (over the micro-batch) and
   reports each as it is complete. Returns the loss. */
static float train_micro(ddp_reducer *red, const int *ix, int n, const float *x, const float *y, int mean_over) {
    float loss = 0;
    int s, j, k;
    for (s = 0; s < n; s++) {
        float h[HID], dout[OUT], dh[HID];
        const float *xs = x + s * IN;
        for (j = 0; j < HID; j++) {
            float z = b1[j];
            for (k = 0; k < IN; k++) z += W1[j * IN + k] * xs[k];
            h[j] = tanhf(z);
        }
        for (j = 0; j < OUT; j++) {
            float z = b2[j];
            for (k = 0; k < HID; k++) z += W2[j * HID + k] * h[k];
            dout[j] = 2.0f * (z - y[s * OUT + j]) / (float)(mean_over * OUT);
            loss += (z - y[s * OUT + j]) * (z - y[s * OUT + j]) / (float)(mean_over * OUT);
        }
        for (k = 0; k < HID; k++) {
            dh[k] = 0;
            for (j = 0; j < OUT; j++) dh[k] += dout[j] * W2[j * HID + k];
            dh[k] *= 1.0f - h[k] * h[k];
        }
        for (j = 0; j < OUT; j++) {
            gb2[j] += dout[j];
            for (k = 0; k < HID; k++) gW2[j * HID + k] += dout[j] * h[k];
        }
        for (j = 0; j < HID; j++) {
            gb1[j] += dh[j];
            for (k = 0; k < IN; k++) gW1[j * IN + k] += dh[j] * xs[k];
        }
    }
    /* A real backward pass reports each layer as soon as it is done; here all samples are done now. */
    ddp_reducer_grad_ready(red, ix[2]);
    ddp_reducer_grad_ready(red, ix[3]);
    ddp_reducer_grad_ready(red, ix[0]);
    ddp_reducer_grad_ready(red, ix[1]);
    return loss;
}

int main(void) {
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    int ix[4], step, micro, rank, world, i, shard;
    unsigned seed = 42;
    float x[GLOBAL_BATCH * IN], y[GLOBAL_BATCH * OUT], loss = 0;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    rank = ddp_rank(g), world = ddp_world_size(g);
    if (GLOBAL_BATCH % (world * ACCUM)) return fprintf(stderr, "the batch of %d does not split into %d ranks x %d micro-batches\n", GLOBAL_BATCH, world, ACCUM), 1;
    shard = GLOBAL_BATCH / world / ACCUM; /* samples per rank per micro-batch */
    for (i = 0; i < HID * IN; i++) W1[i] = frand(&seed) / sqrtf(IN);
    for (i = 0; i < OUT * HID; i++) W2[i] = frand(&seed) / sqrtf(HID);

    memset(&d, 0, sizeof d); /* PyTorch's defaults: 25 MiB buckets, no unused parameters, f32 */
    if (ddp_reducer_create(g, &d, &red) || ddp_reducer_add_param(red, "fc1.weight", W1, gW1, HID * IN, DDP_F32, &ix[0]) ||
        ddp_reducer_add_param(red, "fc1.bias", b1, gb1, HID, DDP_F32, &ix[1]) ||
        ddp_reducer_add_param(red, "fc2.weight", W2, gW2, OUT * HID, DDP_F32, &ix[2]) ||
        ddp_reducer_add_param(red, "fc2.bias", b2, gb2, OUT, DDP_F32, &ix[3]) ||
        ddp_reducer_finalize(red)) /* checks the model on every rank, copies rank 0's weights everywhere */
        return fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g)), 1;

    for (step = 0; step < STEPS; step++) {
        loss = 0;
        for (micro = 0; micro < ACCUM; micro++) {
            int first = (micro * world + rank) * shard; /* this rank's samples of this micro-batch */
            for (i = 0; i < shard; i++) sample(step, first + i, x + i * IN, y + i * OUT);
            ddp_reducer_set_sync(red, micro == ACCUM - 1); /* no_sync() for all but the last micro-batch */
            ddp_reducer_begin_backward(red);
            loss += train_micro(red, ix, shard, x, y, shard * ACCUM);
            if (ddp_reducer_end_backward(red) != DDP_SUCCESS)
                return fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g)), 1;
        }
        for (i = 0; i < HID * IN; i++) W1[i] -= 0.1f * gW1[i];
        for (i = 0; i < HID; i++) b1[i] -= 0.1f * gb1[i];
        for (i = 0; i < OUT * HID; i++) W2[i] -= 0.1f * gW2[i];
        for (i = 0; i < OUT; i++) b2[i] -= 0.1f * gb2[i];
        ddp_reducer_zero_grad(red);
        if (rank == 0 && step % 50 == 0) printf("step %3d  loss on rank 0's shard %.4f\n", step, (double)loss);
    }
    ddp_reducer_stats(red, &st);
    if (rank == 0)
        printf("done: %d ranks, %llu synchronised steps, %d bucket(s), %llu bytes reduced per step, W2[0] = %.6f "
               "(the same on every rank)\n", world, (unsigned long long)st.iterations, st.buckets,
               (unsigned long long)st.bytes_reduced, (double)W2[0]);
    ddp_reducer_destroy(red);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
