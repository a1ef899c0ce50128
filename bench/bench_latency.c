/* bench_latency: the time of one small collective, called back to back many times.

   Usage (under any launcher):  ddprun --nproc-per-node 2 build/bench_latency [op] [count] [calls] [reps]
     op: all_reduce (default) | barrier | all_to_all | gather | scatter (root 0) | all_to_all_v |
         all_gather_v (even blocks of count)
     count: f32 elements per rank (default 16: 64 bytes); calls per rep (default 300000); reps (default 3)
   Every rank runs `reps` rounds of `calls` calls after a barrier; rank 0 prints each round's time per
   call (us) and, last, "median_us <t>": the median round. Many calls in a row, not a few timed one by
   one, so what is measured is the library's per-call cost (the call path, the waits, the cache lines
   that move between cores), not the clock. bench/compare_latency.sh runs it beside Open MPI
   (bench/peers/mpi_latency.c, the same loop) and, optionally, beside an older ddp.h. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ddp_result call(ddp_group *g, int op, float *send, float *recv, size_t count, const size_t *counts) {
    switch (op) {
    case 0: return ddp_all_reduce(g, send, count, DDP_F32, DDP_SUM);
    case 1: return ddp_barrier(g);
    case 2: return ddp_all_to_all(g, send, recv, count, DDP_F32);
    case 3: return ddp_gather(g, send, recv, count, DDP_F32, 0);
    case 4: return ddp_scatter(g, send, recv, count, DDP_F32, 0);
    case 5: return ddp_all_to_all_v(g, send, counts, recv, counts, DDP_F32);
    default: return ddp_all_gather_v(g, send, count, recv, counts, DDP_F32);
    }
}

int main(int argc, char **argv) {
    static const char *ops[] = {"all_reduce", "barrier", "all_to_all", "gather", "scatter", "all_to_all_v", "all_gather_v"};
    const char *name = argc > 1 ? argv[1] : "all_reduce";
    size_t count = argc > 2 ? strtoul(argv[2], NULL, 10) : 16;
    long calls = argc > 3 ? atol(argv[3]) : 300000, i;
    int reps = argc > 4 ? atoi(argv[4]) : 3, op, rep, n, rank, j;
    ddp_group *g = NULL;
    float *send, *recv;
    size_t *counts;
    double *t;
    for (op = 0; op < 7 && strcmp(name, ops[op]) != 0; op++) {}
    if (op == 7 || calls < 1 || reps < 1) {
        fprintf(stderr, "usage: bench_latency [all_reduce|barrier|all_to_all|gather|scatter|all_to_all_v|all_gather_v] "
                        "[count] [calls >= 1] [reps >= 1]\n");
        return 2;
    }
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "bench_latency: %s\n", ddp_last_error(NULL));
        return 1;
    }
    n = ddp_world_size(g), rank = ddp_rank(g);
    send = (float *)calloc(count * (size_t)n + 1, sizeof *send);
    recv = (float *)calloc(count * (size_t)n + 1, sizeof *recv);
    counts = (size_t *)calloc((size_t)n, sizeof *counts);
    t = (double *)calloc((size_t)reps, sizeof *t);
    if (!send || !recv || !counts || !t) return 1;
    for (j = 0; j < n; j++) counts[j] = count;
    for (rep = 0; rep < reps; rep++) {
        double t0;
        if (ddp_barrier(g) != DDP_SUCCESS) break;
        t0 = bench_now();
        for (i = 0; i < calls; i++)
            if (call(g, op, send, recv, count, counts) != DDP_SUCCESS) {
                fprintf(stderr, "bench_latency: rank %d: %s\n", rank, ddp_last_error(g));
                return 1;
            }
        t[rep] = (bench_now() - t0) / (double)calls * 1e6;
        if (rank == 0) printf("%s count %zu ranks %d: %.3f us per call\n", name, count, n, t[rep]);
    }
    qsort(t, (size_t)reps, sizeof *t, bench_cmp_double);
    if (rank == 0) printf("median_us %.4f\n", t[reps / 2]);
    free(send), free(recv), free(counts), free(t);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
