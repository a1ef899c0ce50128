/* scale_probe: the probe of issue #25's table, a job as small as a job can be: ddp_init, one
   ddp_barrier, two ddp_all_reduce of a small buffer, ddp_destroy. Its peer is bench/peers/gloo_scale.py
   (the same steps with torch.distributed's gloo backend); bench/scale_table.sh runs both at many ranks.

       build/ddprun --standalone --nproc-per-node N build/scale_probe

   Rank, world size and master come from the launcher's environment (ddp_init(NULL, ...)); DDP_TRANSPORT
   picks TCP or shared memory as for any program. Each rank prints one line on stdout:

       scale_probe backend=ddp rank=R world=N init_s=X run_s=Y t_start=T0 t_init=T1

   init_s: seconds in ddp_init; run_s: seconds from just before ddp_init to just after ddp_destroy (the
   whole job less process start-up); both on CLOCK_MONOTONIC. t_start, t_init: when this rank entered and
   left ddp_init, in seconds since the epoch (CLOCK_REALTIME, comparable between the processes of one
   machine): the latest t_init less the latest t_start is the rendezvous's own time, without the
   spread of the ranks' start-up that the slowest rank's init_s also contains.

   The all_reduces are checked against serial math: rank r contributes (r+1)*(i+1) at element i, so the
   first sum is S*(i+1) with S = N(N+1)/2, and the second (of the first's result) N*S*(i+1). f64 keeps
   every partial sum an exact integer far beyond any N this runs at. A wrong element, or any failed call,
   prints what and where on stderr and exits 1 (ddprun then stops the other ranks and says which failed). */
#define DDP_IMPLEMENTATION
#include "ddp.h"
#include "bench_util.h" /* bench_now */

#include <stdio.h>
#include <time.h>

#define PROBE_COUNT 8

/* Seconds since the epoch (CLOCK_REALTIME): the same clock in every process of the machine. */
static double epoch_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A failed call: name it, with the library's reason, and end this rank. */
static int probe_fail(int rank, const char *call, const char *why) {
    fprintf(stderr, "scale_probe rank %d: %s failed: %s\n", rank, call, why);
    return 1;
}

/* 0 when buf[i] == factor*(i+1) for every element, else 1 after saying where it differs. */
static int check_sum(int rank, int which, const double *buf, double factor) {
    int i;
    for (i = 0; i < PROBE_COUNT; i++) {
        double expected = factor * (double)(i + 1);
        if (buf[i] != expected) {
            fprintf(stderr, "scale_probe rank %d: all_reduce #%d element %d is %.17g, expected %.17g (serial sum)\n",
                    rank, which, i, buf[i], expected);
            return 1;
        }
    }
    return 0;
}

int main(void) {
    ddp_group *g = NULL;
    double buf[PROBE_COUNT], start, init_s, n, sum_of_ranks, t_start, t_init;
    int i, rank, world;
    t_start = epoch_now();
    start = bench_now();
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return probe_fail(-1, "ddp_init", ddp_last_error(NULL));
    init_s = bench_now() - start;
    t_init = epoch_now();
    rank = ddp_rank(g);
    world = ddp_world_size(g);
    n = (double)world;
    sum_of_ranks = n * (n + 1) / 2; /* sum over r of (r+1) */
    for (i = 0; i < PROBE_COUNT; i++) buf[i] = (double)(rank + 1) * (double)(i + 1);
    if (ddp_barrier(g) != DDP_SUCCESS) return probe_fail(rank, "ddp_barrier", ddp_last_error(g));
    if (ddp_all_reduce(g, buf, PROBE_COUNT, DDP_F64, DDP_SUM) != DDP_SUCCESS)
        return probe_fail(rank, "ddp_all_reduce #1", ddp_last_error(g));
    if (check_sum(rank, 1, buf, sum_of_ranks)) return 1;
    if (ddp_all_reduce(g, buf, PROBE_COUNT, DDP_F64, DDP_SUM) != DDP_SUCCESS)
        return probe_fail(rank, "ddp_all_reduce #2", ddp_last_error(g));
    if (check_sum(rank, 2, buf, n * sum_of_ranks)) return 1;
    if (ddp_destroy(g) != DDP_SUCCESS) return probe_fail(rank, "ddp_destroy", ddp_last_error(NULL));
    printf("scale_probe backend=ddp rank=%d world=%d init_s=%.4f run_s=%.4f t_start=%.6f t_init=%.6f\n", rank, world,
           init_s, bench_now() - start, t_start, t_init);
    return 0;
}
