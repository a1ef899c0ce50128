/* Test helper for tests/test_ddprun.sh: a real distributed program under ddprun.
   ddp_init(NULL) from the launcher's environment, then all_reduce (f64 SUM, i32 MAX) checked
   against the values worked out here; prints "rank R of W: all_reduce ok" or what went wrong.
   With DIE_RANK=R in the environment, rank R kills itself (SIGKILL) instead of joining the
   all_reduce, leaving the others blocked in it until the launcher stops them. With HOLD_FILE=PATH,
   each rank keeps the group (and rank 0 its store) after the all_reduce until PATH exists (60 s at
   most), so that another job can meet it on the same port. With STUCK_RANK=R, rank R stops for 60 s
   between the two all_reduces (as a rank stuck in its own code does): the others time out in the
   second one (DDP_TIMEOUT), and ddprun's flight-recorder summary should name rank R as behind. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define N 1000

int main(void) {
    static double x[N];
    int32_t m;
    ddp_group *g;
    int rank, n, i;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g);
    n = ddp_world_size(g);
    for (i = 0; i < N; i++) x[i] = (double)rank * N + i;
    m = rank;
    if (getenv("DIE_RANK") && atoi(getenv("DIE_RANK")) == rank) raise(SIGKILL);
    if (ddp_all_reduce(g, x, N, DDP_F64, DDP_SUM) != DDP_SUCCESS ||
        (getenv("STUCK_RANK") && atoi(getenv("STUCK_RANK")) == rank && sleep(60) > 100) ||
        ddp_all_reduce(g, &m, 1, DDP_I32, DDP_MAX) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: all_reduce: %s\n", rank, ddp_last_error(g));
        return 1;
    }
    for (i = 0; i < N; i++) {
        /* sum over r of (r*N + i) = N*n(n-1)/2 + n*i, exact in double */
        double want = (double)N * n * (n - 1) / 2 + (double)n * i;
        if (x[i] != want) {
            fprintf(stderr, "rank %d: sum[%d] = %.17g, want %.17g\n", rank, i, x[i], want);
            return 1;
        }
    }
    if (m != n - 1) {
        fprintf(stderr, "rank %d: max = %d, want %d\n", rank, (int)m, n - 1);
        return 1;
    }
    printf("rank %d of %d: all_reduce ok\n", rank, n);
    fflush(stdout);
    for (i = 0; getenv("HOLD_FILE") && access(getenv("HOLD_FILE"), F_OK) != 0 && i < 6000; i++) usleep(10000);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
