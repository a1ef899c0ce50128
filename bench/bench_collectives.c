/* bench_collectives: nccl-tests style table for ddp.h's collectives.

   Usage (under any launcher):  ddprun --nproc-per-node 2 build/bench_collectives [--lib] [--loop] [op] [max_bytes] [min_bytes]
     op: all_reduce (default) | all_gather | reduce_scatter | broadcast | barrier (one row, size 0)
         | all_to_all | gather | scatter (root 0) | all_to_all_v | all_gather_v: for these, size is the bytes
         per rank (count x 4; the _v calls' blocks are uneven, 1/2, 1 or 3/2 of it, as in the MPI peer)
     --lib: the buffers come from ddp_alloc (library buffers: single-copy over shared memory), not malloc
     --loop (all_to_all ... all_gather_v): time as nccl-tests does, the whole loop of back-to-back calls on
         every rank, divided by the calls and averaged over the ranks (without it: rank 0 times each call
         on its own; for gather and scatter that is the root's time alone, which hides ranks still waiting)
   Sizes grow x4 from min_bytes (default 4) to max_bytes (default 256 MiB), f32, sum. Before every
   iteration the buffer is rewritten (untimed; all_to_all, gather, scatter: once per size); each collective call is timed on its own and the
   table gives the mean; after the loop the last iteration's result is checked on every rank.
   Columns as nccl-tests: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce,
   * (n-1)/n for all_gather and reduce_scatter (bytes = the whole gathered/scattered buffer), * 1 for broadcast.
   all_to_all, gather, scatter: size = bytes per rank (a block), algbw = size x n / time (the whole send or
   receive buffer, as nccl-tests' alltoall), busbw = algbw * (n-1)/n; bench/compare_collectives.sh sets
   them beside Open MPI (bench/peers/mpi_alltoall.c prints the same columns). */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The value rank `from` sends to rank `to` at element i of iteration it (small integers: exact in f32). */
static float cell(int from, int to, size_t i, int it) { return (float)(from * 7 + to * 3 + it + (int)(i & 7)); }

/* all_to_all_v / all_gather_v's uneven blocks, the same in bench/peers/mpi_alltoall.c: rank `from` sends
   rank `to` (all_gather_v: every rank) per/2, per or 3 per/2 elements, per on average. */
static size_t split(int from, int to, size_t per) { return per / 2 + per * (size_t)((from + 2 * to) % 3) / 2; }

/* all_to_all, gather, scatter (root 0), all_to_all_v, all_gather_v: blocks of `bytes` per rank (the _v
   calls: on average), send and recv of n blocks each. */
static int bench_per_rank(ddp_group *g, const char *op, int lib, int loop, size_t max_bytes, size_t min_bytes) {
    int rank = ddp_rank(g), n = ddp_world_size(g), bad = 0, a2a = !strcmp(op, "all_to_all"), gather = !strcmp(op, "gather");
    int a2av = !strcmp(op, "all_to_all_v"), agv = !strcmp(op, "all_gather_v");
    size_t whole = max_bytes * (size_t)n * 3 / 2 + 64, bytes, *sc = (size_t *)calloc((size_t)n * 3, sizeof *sc), *rc = sc + n,
           *counts = sc + 2 * n;
    float *a = (float *)(lib ? ddp_alloc(g, whole) : malloc(whole)), *b = (float *)(lib ? ddp_alloc(g, whole) : malloc(whole));
    if (!a || !b || !sc) {
        fprintf(stderr, "rank %d: out of memory: %s\n", rank, ddp_last_error(g));
        return 3;
    }
    memset(a, 0, whole);
    memset(b, 0, whole);
    if (rank == 0)
        printf("# ddp.h %s, %d ranks, transport %s, %s buffers; size = bytes per rank\n%12s %12s %6s %6s %10s %10s %10s\n", op, n,
               getenv("DDP_TRANSPORT") ? getenv("DDP_TRANSPORT") : "auto", lib ? "ddp_alloc" : "malloc", "size", "count", "type",
               "op", "time_us", "algbw_GBs", "busbw_GBs");
    for (bytes = min_bytes < 4 ? 4 : min_bytes; bytes <= max_bytes; bytes *= 4) {
        size_t per = bytes / 4, i, at;
        int iters = bytes < 16384 ? 200 : 20, it, j, v = a2av || agv; /* 20 at every large size: a mean of 5 was one descheduling away from 2x */
        double total = 0, alg, start = 0;
        for (j = 0; j < n; j++) { /* the blocks' sizes: per, or uneven for the _v calls */
            sc[j] = a2av ? split(rank, j, per) : per;
            rc[j] = a2av ? split(j, rank, per) : per;
            counts[j] = agv ? split(j, 0, per) : per;
        }
        /* Filled once per size, as Open MPI's peer does: a refill between calls would let the ranks drift
           apart by its time, which the next call's wait then measures. */
        for (j = 0, at = 0; j < (agv ? 1 : n); at += sc[j], j++) /* block j: what this rank sends to rank j (scatter: the */
            for (i = 0; i < (agv ? counts[rank] : sc[j]); i++)   /* root's block for j; all_gather_v: its one block) */
                a[at + i] = cell(rank, gather || agv ? 0 : j, i, (int)bytes & 15);
        /* only what this size uses: ranks that finish their loop first (a small gather's other ranks run
           ahead) would otherwise clear the whole buffer (24 MiB per rank at 4 MiB) while the root still
           runs, and on oversubscribed cores that time was charged to the root's last calls */
        memset(b, 0, bytes * (size_t)n * 3 / 2 + 64); /* <= whole */
        for (it = -2; it < iters; it++) {
            double t0;
            ddp_result r;
            if (it == 0 && ddp_barrier(g) != DDP_SUCCESS) return 1; /* after the warm-up, start together (as the peer does) */
            t0 = now();
            if (it == 0) start = t0;
            if (a2a) r = ddp_all_to_all(g, a, b, per, DDP_F32);
            else if (gather) r = ddp_gather(g, a, b, per, DDP_F32, 0);
            else if (a2av) r = ddp_all_to_all_v(g, a, sc, b, rc, DDP_F32);
            else if (agv) r = ddp_all_gather_v(g, a, counts[rank], b, counts, DDP_F32);
            else r = ddp_scatter(g, a, b, per, DDP_F32, 0);
            if (it >= 0 && !loop) total += now() - t0;
            if (r != DDP_SUCCESS) {
                fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g));
                return 1;
            }
        }
        if (loop) { /* nccl-tests: every rank's time for the whole loop, averaged over the ranks */
            total = now() - start;
            if (ddp_all_reduce(g, &total, 1, DDP_F64, DDP_AVG) != DDP_SUCCESS) return 1;
        }
        for (j = 0, at = 0; j < n && !bad && (a2a || a2av || agv || (gather && rank == 0) || (!gather && j == 0)); j++) {
            size_t len = a2av ? rc[j] : agv ? counts[j] : per; /* the last call's result: block j of recv */
            for (i = 0; i < len && !bad; i++) {
                float want = cell(v || a2a || gather ? j : 0, gather || agv ? 0 : rank, i, (int)bytes & 15);
                if (b[at + i] != want) {
                    fprintf(stderr, "rank %d: %s at %zu bytes per rank: block %d element %zu is %g, want %g\n", rank, op, bytes, j, i,
                            b[at + i], want);
                    bad = 1;
                }
            }
            at += len;
        }
        alg = (double)bytes * n / (total / iters) / 1e9;
        if (rank == 0) printf("%12zu %12zu %6s %6s %10.2f %10.3f %10.3f\n", bytes, per, "float", "none", total / iters * 1e6, alg,
                              alg * (n - 1) / n);
        fflush(stdout);
    }
    if (lib) {
        ddp_free(g, a);
        ddp_free(g, b);
    } else {
        free(a);
        free(b);
    }
    free(sc);
    ddp_destroy(g);
    return bad;
}

int main(int argc, char **argv) {
    int lib = 0, loop = 0;
    const char *op;
    for (; argc > 1 && (!strcmp(argv[1], "--lib") || !strcmp(argv[1], "--loop")); argc--, argv++) /* flags, any order */
        *(!strcmp(argv[1], "--lib") ? &lib : &loop) = 1;
    op = argc > 1 ? argv[1] : "all_reduce";
    size_t max_bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
    size_t min_bytes = argc > 3 ? strtoull(argv[3], NULL, 10) : 4, bytes;
    ddp_group *g;
    float *a, *b;
    int rank, n, bad = 0, per_rank, barrier = !strcmp(op, "barrier");
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g);
    n = ddp_world_size(g);
    per_rank = !strcmp(op, "all_to_all") || !strcmp(op, "gather") || !strcmp(op, "scatter") || !strcmp(op, "all_to_all_v") ||
               !strcmp(op, "all_gather_v");
    if (strcmp(op, "all_reduce") && strcmp(op, "all_gather") && strcmp(op, "reduce_scatter") && strcmp(op, "broadcast") &&
        !barrier && !per_rank) {
        fprintf(stderr, "unknown op %s (all_reduce, all_gather, reduce_scatter, broadcast, barrier, all_to_all, gather, scatter, "
                        "all_to_all_v, all_gather_v)\n", op);
        return 2;
    }
    if (per_rank) return bench_per_rank(g, op, lib, loop, max_bytes, min_bytes);
    a = (float *)(lib ? ddp_alloc(g, max_bytes + 64) : malloc(max_bytes + 64));
    b = (float *)(lib ? ddp_alloc(g, max_bytes + 64) : malloc(max_bytes + 64));
    if (!a || !b) {
        fprintf(stderr, "rank %d: out of memory: %s\n", rank, ddp_last_error(g));
        return 3;
    }
    memset(a, 0, max_bytes);
    memset(b, 0, max_bytes);
    if (rank == 0)
        printf("# ddp.h %s, %d ranks, transport %s, %s buffers\n%12s %12s %6s %6s %10s %10s %10s\n", op, n,
               getenv("DDP_TRANSPORT") ? getenv("DDP_TRANSPORT") : "auto", lib ? "ddp_alloc" : "malloc", "size", "count", "type", "op", "time_us",
               "algbw_GBs", "busbw_GBs");
    if (barrier) min_bytes = max_bytes = 0;
    for (bytes = min_bytes; bytes <= max_bytes; bytes = barrier ? max_bytes + 1 : bytes * 4) {
        size_t count = bytes / 4, per = count / (size_t)n, i;
        int iters = bytes < 65536 ? 200 : (bytes < (1u << 22) ? 20 : 5), it, warm = 2;
        double total = 0, alg, bus;
        for (it = -warm; it < iters; it++) {
            double t0;
            ddp_result r;
            for (i = 0; i < count; i++) a[i] = (float)(rank + it + (int)(i & 7));
            t0 = now();
            if (barrier) r = ddp_barrier(g);
            else if (!strcmp(op, "all_reduce")) r = ddp_all_reduce(g, a, count, DDP_F32, DDP_SUM);
            else if (!strcmp(op, "broadcast")) r = ddp_broadcast(g, a, count, DDP_F32, 0);
            else if (!strcmp(op, "all_gather")) r = ddp_all_gather(g, a + (size_t)rank * per, b, per, DDP_F32);
            else r = ddp_reduce_scatter(g, a, b, per, DDP_F32, DDP_SUM);
            if (it >= 0) total += now() - t0;
            if (r != DDP_SUCCESS) {
                fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g));
                return 1;
            }
        }
        /* check the last iteration (it = iters - 1) */
        for (i = 0; i < count && !bad; i++) {
            int k = iters - 1 + (int)(i & 7), r = (int)(i / (per ? per : 1));
            float want;
            if (!strcmp(op, "all_reduce")) want = (float)(n * k + n * (n - 1) / 2);
            else if (!strcmp(op, "broadcast")) want = (float)k;
            else if (!strcmp(op, "all_gather")) { if (i >= per * (size_t)n) break; want = (float)(r + iters - 1 + (int)((i - (size_t)r * per + (size_t)r * per) & 7)); }
            else { if (i >= per) break; want = (float)(n * (iters - 1 + (int)((i + (size_t)rank * per) & 7)) + n * (n - 1) / 2); }
            if ((!strcmp(op, "all_reduce") || !strcmp(op, "broadcast") ? a[i] : b[i]) != want) {
                fprintf(stderr, "rank %d: %s at %zu bytes: element %zu wrong\n", rank, op, bytes, i);
                bad = 1;
            }
        }
        alg = (double)bytes / (total / iters) / 1e9;
        bus = alg * (!strcmp(op, "all_reduce") ? 2.0 * (n - 1) / n : !strcmp(op, "broadcast") ? 1.0 : (double)(n - 1) / n);
        if (rank == 0) printf("%12zu %12zu %6s %6s %10.2f %10.3f %10.3f\n", bytes, count, "float", "sum", total / iters * 1e6, alg, bus);
        fflush(stdout);
    }
    if (lib) {
        ddp_free(g, a);
        ddp_free(g, b);
    } else {
        free(a);
        free(b);
    }
    ddp_destroy(g);
    return bad;
}
