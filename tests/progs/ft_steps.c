/* Test helper for tests/test_ddprun.sh: a fault-tolerant training loop (src/ft.h) under ddprun --ft.
   ddp_init(NULL) from the launcher's environment (DDP_FT=1 turns fault tolerance on), then two epochs
   (FT_EPOCHS; FT_STEP_US of sleep per step) of a 240-sample data set in steps of 8 samples per initial rank, as src/ft.h's loop: ddp_ft_begin,
   this rank's share of the step (ddp_sampler_step_batch), a backward pass through the reducer weighted
   by the share (ddp_reducer_set_local_samples), ddp_ft_commit, SGD on DDP_SUCCESS; a pass or a vote
   that meets DDP_ERR_VIEW_CHANGED is redone. The model is w (two tensors, two buckets) with the loss
   0.5 |w - i|^2 per sample i: after each step w moves towards the mean index of the step's batch.
   DDP_FT_TEST_KILL=id:step:point makes a member SIGKILL itself there (the library's test hook). w is
   registered (ddp_ft_register): a replacement that ddprun --ft --max-restarts starts (DDP_FT_JOIN=1)
   receives it with its admission, then trains on with the others.
   Prints "member ID: rank R of W at the end, S steps committed, w sums to X" (ID: RANK; S counts this
   process's commits; X: the weights' sum, equal on every member at the end) and exits 0, or says what
   failed and exits 1. */
#define _DEFAULT_SOURCE /* usleep */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DATASET 240
#define BATCH 8 /* per rank of the first view */
#define COUNT 64

static int fail(int id, const char *what, ddp_group *g) {
    fprintf(stderr, "member %d: %s: %s\n", id, what, ddp_last_error(g));
    return 1;
}

int main(void) {
    static float w[2][COUNT], grad[2][COUNT];
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc rd;
    ddp_sampler s;
    ddp_sampler_desc sd;
    ddp_ft_step st;
    int64_t idx[DATASET];
    size_t got, k;
    int id, r0, t, e, steps = 0;
    int epochs = getenv("FT_EPOCHS") ? atoi(getenv("FT_EPOCHS")) : 2; /* (longer: a replacement has time to join) */
    long step_us = getenv("FT_STEP_US") ? atol(getenv("FT_STEP_US")) : 0; /* "compute" per step */
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fail(-1, "ddp_init", NULL);
    id = atoi(getenv("RANK")), r0 = atoi(getenv("WORLD_SIZE")); /* (a joiner's group is of 1 until admitted) */
    memset(&rd, 0, sizeof rd);
    rd.bucket_cap_bytes = rd.first_bucket_bytes = COUNT * sizeof(float); /* one bucket per tensor */
    if (ddp_reducer_create(g, &rd, &red) != DDP_SUCCESS) return fail(id, "ddp_reducer_create", g);
    for (t = 0; t < 2; t++)
        if (ddp_reducer_add_param(red, t ? "b" : "a", w[t], grad[t], COUNT, DDP_F32, NULL) != DDP_SUCCESS)
            return fail(id, "ddp_reducer_add_param", g);
    if (ddp_reducer_finalize(red) != DDP_SUCCESS) return fail(id, "ddp_reducer_finalize", g);
    if (ddp_ft_register(g, "w", w, sizeof w) != DDP_SUCCESS) return fail(id, "ddp_ft_register", g);
    memset(&sd, 0, sizeof sd);
    sd.dataset_size = DATASET, sd.num_replicas = r0, sd.seed = 3;
    if (ddp_sampler_init(&s, &sd) != DDP_SUCCESS) return fail(id, "ddp_sampler_init", NULL);
    memset(&st, 0, sizeof st);
    for (;;) {
        ddp_result res;
        if (ddp_ft_begin(g, &st) != DDP_SUCCESS) return fail(id, "ddp_ft_begin", g);
        if (ddp_sampler_step_batch(&s, &st, (uint64_t)BATCH * (uint64_t)r0, idx, &got) != DDP_SUCCESS)
            return fail(id, "ddp_sampler_step_batch", NULL);
        if (got == 0 && st.step > 0) { /* past the epoch's end */
            if (++st.epoch == (uint64_t)epochs) break;
            st.step = 0;
            continue;
        }
        if (step_us > 0) usleep((useconds_t)step_us);
        for (t = 0; t < 2; t++) /* the mean over this rank's samples of w - i */
            for (e = 0; e < COUNT; e++) {
                double sum = 0;
                for (k = 0; k < got; k++) sum += (double)w[t][e] - (double)idx[k];
                grad[t][e] = got ? (float)(sum / (double)got) : 0.0f;
            }
        if ((res = ddp_reducer_begin_backward(red)) == DDP_SUCCESS) res = ddp_reducer_set_local_samples(red, got);
        for (t = 1; t >= 0 && res == DDP_SUCCESS; t--) res = ddp_reducer_grad_ready(red, t);
        if (res == DDP_SUCCESS) res = ddp_reducer_end_backward(red);
        if (res == DDP_SUCCESS) res = ddp_ft_commit(g, &st);
        if (res == DDP_ERR_VIEW_CHANGED) continue; /* the step is void: run it again in the new view */
        if (res != DDP_SUCCESS) return fail(id, "the step", g);
        for (t = 0; t < 2; t++)
            for (e = 0; e < COUNT; e++) w[t][e] -= 0.5f * grad[t][e];
        steps++;
    }
    {
        double sum = 0;
        for (t = 0; t < 2; t++)
            for (e = 0; e < COUNT; e++) sum += (double)w[t][e];
        printf("member %d: rank %d of %d at the end, %d steps committed, w sums to %.9g\n", id, st.rank, st.world_size,
               steps, sum);
    }
    fflush(stdout);
    ddp_sampler_free(&s);
    ddp_reducer_destroy(red);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
