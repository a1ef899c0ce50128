/* Test helper for tests/test_netns.sh (the cut-link run): one rank that runs collectives in a loop until
   one fails, so that the link between its hosts can be cut while the group is busy.
   usage (with torchrun's variables set): collective_loop SECONDS
   Each iteration all-reduces floats (SUM), 4096 (16 KiB: recursive doubling) and 65536 (256 KiB: the
   hierarchical all_reduce across hosts) in turn, checks them against the sum worked out here, then
   runs a barrier. After the first iteration it prints "rank R: looping"; when a call fails it prints
   "rank R: FAILED after N iterations, S s into the failing call (destroy took D s): MESSAGE" and exits 1.
   Exits 0 only if the loop ran its SECONDS without an error (the link was never cut), 2 on a wrong sum. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N_SMALL 4096
#define N_LARGE 65536

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Report the failed call, destroy the broken group (timed: it must not hang either), exit 1. */
static int failed(ddp_group *g, int rank, long iter, double call_start) {
    char msg[1024];
    double t0 = now(), took = t0 - call_start;
    snprintf(msg, sizeof msg, "%s", ddp_last_error(g));
    ddp_destroy(g);
    printf("rank %d: FAILED after %ld iterations, %.1f s into the failing call (destroy took %.1f s): %s\n", rank,
           iter, took, now() - t0, msg);
    fflush(stdout);
    return 1;
}

int main(int argc, char **argv) {
    static float x[N_LARGE];
    ddp_group *g;
    double seconds = argc > 1 ? atof(argv[1]) : 60, end, t;
    long iter;
    int rank, n, i;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        printf("ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g);
    n = ddp_world_size(g);
    end = now() + seconds;
    for (iter = 0; now() < end; iter++) {
        /* rank r contributes r + (i % 7): the sum over ranks is n(n-1)/2 + n (i % 7), exact in float */
        int count = iter % 2 ? N_LARGE : N_SMALL;
        for (i = 0; i < count; i++) x[i] = (float)(rank + i % 7);
        t = now();
        if (ddp_all_reduce(g, x, (size_t)count, DDP_F32, DDP_SUM) != DDP_SUCCESS) return failed(g, rank, iter, t);
        for (i = 0; i < count; i++)
            if (x[i] != (float)(n * (n - 1) / 2 + n * (i % 7))) {
                printf("rank %d: iteration %ld: sum[%d] = %g, want %d\n", rank, iter, i, (double)x[i],
                       n * (n - 1) / 2 + n * (i % 7));
                return 2;
            }
        t = now();
        if (ddp_barrier(g) != DDP_SUCCESS) return failed(g, rank, iter, t);
        if (iter == 0) {
            printf("rank %d: looping\n", rank);
            fflush(stdout);
        }
    }
    printf("rank %d: %ld iterations in %.0f s, no failure\n", rank, iter, seconds);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
