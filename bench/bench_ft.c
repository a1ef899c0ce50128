/* bench_ft: what fault-tolerant mode costs a step when nothing fails (FT.md's G7: ddp_ft_commit <= 10 us on
   2 ranks over shared memory), beside a plain 8-byte all_reduce (FT.md's size of the vote; ddp_ft_commit
   votes 16 bytes, {finished, -joiners waiting}, and rank 0 first looks for a joiner at its listener).

   Usage: build/bench_ft [ranks] [calls] [rounds]   (default 2 ranks, 100000 calls, 7 rounds)
   It starts the ranks itself (ddp_spawn, one host: shared memory unless DDP_TRANSPORT says otherwise), two
   groups per round: one with fault tolerance off, then one with it on (ddp_init_desc.fault_tolerant). In
   each, after a barrier, every rank makes `calls` calls in a row of
     all_reduce 8 B, FT off        ddp_all_reduce of one int64, MIN, in a plain group
     all_reduce 8 B, FT on         the same in a fault-tolerant group (the data plane ddp_ft_begin built)
     ddp_ft_commit                 the vote alone: its all_reduce, the step's status, rank 0's look for joiners
     ddp_ft_begin + ddp_ft_commit  a whole step's fault-tolerance calls, as the training loop makes them
   and rank 0 keeps the time per call. Many calls in a row, as bench_latency does: the per-call cost, not the
   clock's. Rounds alternate the groups so that a noisy neighbour on a shared machine slows both alike; the
   table is the median round of each row, with the fastest and slowest. bench/bench_ft.sh also times the
   training demo with and without --ft. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { ROWS = 4 };

typedef struct bench {
    int ft;       /* this group is fault-tolerant */
    long calls;
    double *row;  /* this round's ROWS results, in memory shared with the parent (rank 0 writes them) */
} bench;

/* `calls` calls of op (0: all_reduce, 1: commit, 2: begin + commit) after a barrier; seconds per call. */
static double time_calls(ddp_group *g, int op, long calls, ddp_ft_step *st) {
    int64_t ok = 1;
    double t0;
    long i;
    ddp_result r = ddp_barrier(g);
    for (t0 = bench_now(), i = 0; i < calls && r == DDP_SUCCESS; i++) {
        if (op == 2) r = ddp_ft_begin(g, st);
        if (r == DDP_SUCCESS) r = op == 0 ? ddp_all_reduce(g, &ok, 1, DDP_I64, DDP_MIN) : ddp_ft_commit(g, st);
    }
    if (r != DDP_SUCCESS) {
        fprintf(stderr, "bench_ft: %s\n", ddp_last_error(g));
        exit(1);
    }
    return (bench_now() - t0) / (double)calls;
}

static int run(int rank, int world, void *arg) {
    const bench *b = (const bench *)arg;
    ddp_init_desc desc;
    ddp_ft_step st;
    ddp_group *g;
    int op;
    (void)world;
    memset(&desc, 0, sizeof desc);
    desc.fault_tolerant = b->ft;
    if (ddp_init(&desc, &g) != DDP_SUCCESS) {
        fprintf(stderr, "bench_ft: %s\n", ddp_last_error(NULL));
        return 1;
    }
    memset(&st, 0, sizeof st);
    if (b->ft && ddp_ft_begin(g, &st) != DDP_SUCCESS) { /* the first is collective: it connects the members */
        fprintf(stderr, "bench_ft: ddp_ft_begin: %s\n", ddp_last_error(g));
        return 1;
    }
    for (op = 0; op < (b->ft ? 3 : 1); op++) {
        double t = time_calls(g, op, b->calls, &st);
        if (rank == 0) b->row[b->ft + op] = t;
    }
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}

int main(int argc, char **argv) {
    static const char *names[ROWS] = {"all_reduce 8 B, FT off", "all_reduce 8 B, FT on", "ddp_ft_commit",
                                      "ddp_ft_begin + ddp_ft_commit"};
    int ranks = argc > 1 ? atoi(argv[1]) : 2, rounds = argc > 3 ? atoi(argv[3]) : 7, k, row;
    double *all, col[1024];
    bench b;
    b.calls = argc > 2 ? atol(argv[2]) : 100000;
    if (ranks < 1 || b.calls < 1 || rounds < 1 || rounds > 1024) {
        fprintf(stderr, "usage: bench_ft [ranks >= 1] [calls >= 1] [rounds 1..1024]\n");
        return 2;
    }
    /* the workers are forked from here: what rank 0 writes into a shared mapping, the parent reads */
    all = (double *)mmap(NULL, sizeof(double) * ROWS * (size_t)rounds, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    if (all == MAP_FAILED) return 1;
    for (k = 0; k < rounds; k++)
        for (b.ft = 0; b.ft < 2; b.ft++) {
            b.row = all + ROWS * k;
            if (ddp_spawn(ranks, run, &b) != DDP_SUCCESS) {
                fprintf(stderr, "bench_ft: %s\n", ddp_last_error(NULL));
                return 1;
            }
        }
    printf("# bench_ft: %d ranks on one host (ddp_spawn), %ld calls in a row x %d rounds; us per call\n", ranks,
           b.calls, rounds);
    printf("%-30s %10s %10s %10s\n", "call", "median", "fastest", "slowest");
    for (row = 0; row < ROWS; row++) {
        for (k = 0; k < rounds; k++) col[k] = all[ROWS * k + row] * 1e6;
        qsort(col, (size_t)rounds, sizeof *col, bench_cmp_double);
        printf("%-30s %10.3f %10.3f %10.3f\n", names[row], col[(rounds - 1) / 2], col[0], col[rounds - 1]);
    }
    munmap(all, sizeof(double) * ROWS * (size_t)rounds);
    return 0;
}
