/* hello_collectives: a tour of ddp.h's collectives, each result checked against the value it must have.

   Shows: ddp_init from the launcher's environment, all_reduce (sum and average), broadcast, reduce,
   all_gather, reduce_scatter, barrier, an asynchronous all_reduce, and error reporting.

   Run:  make && build/ddprun --nproc-per-node 4 build/hello_collectives
         (or: torchrun --standalone --nproc_per_node 4 --no_python build/hello_collectives,
              mpirun -np 4 build/hello_collectives, or just build/hello_collectives for one rank) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>

/* Print the outcome of one collective on rank 0, and count failures on every rank. */
static int report(ddp_group *g, const char *what, int ok) {
    int all_ok = ok;
    ddp_all_reduce(g, &all_ok, 1, DDP_I32, DDP_MIN); /* ok only if it is ok on every rank */
    if (ddp_rank(g) == 0) printf("  %-58s %s\n", what, all_ok ? "ok" : "WRONG");
    return all_ok ? 0 : 1;
}

#define TRY(call)                                                                                \
    do {                                                                                         \
        ddp_result r_ = (call);                                                                  \
        if (r_ != DDP_SUCCESS) {                                                                 \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                            \
        }                                                                                        \
    } while (0)

int main(void) {
    ddp_group *g;
    int rank, n, i, failures = 0;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g);
    n = ddp_world_size(g);
    if (rank == 0) printf("ddp.h %d.%d.%d: %d ranks on the %s backend\n", DDP_VERSION_MAJOR, DDP_VERSION_MINOR,
                          DDP_VERSION_PATCH, n, ddp_backend_name(g));

    { /* all_reduce: every rank contributes rank+1; the sum is n(n+1)/2 everywhere */
        float x[2] = {(float)(rank + 1), 1.0f}, r = (float)rank;
        TRY(ddp_all_reduce(g, x, 2, DDP_F32, DDP_SUM));
        failures += report(g, "all_reduce(sum) of rank+1 = n(n+1)/2", x[0] == n * (n + 1) / 2.0f && x[1] == (float)n);
        TRY(ddp_all_reduce(g, &r, 1, DDP_F32, DDP_AVG));
        failures += report(g, "all_reduce(avg) of rank = (n-1)/2", r == (n - 1) / 2.0f);
    }
    { /* broadcast: rank 0's numbers reach everyone */
        int64_t seed[2] = {rank == 0 ? 1234 : -1, rank == 0 ? 5678 : -1};
        TRY(ddp_broadcast(g, seed, 2, DDP_I64, 0));
        failures += report(g, "broadcast from rank 0", seed[0] == 1234 && seed[1] == 5678);
    }
    { /* reduce: the maximum lands on the last rank only */
        double v = rank * 10.0;
        TRY(ddp_reduce(g, &v, 1, DDP_F64, DDP_MAX, n - 1));
        failures += report(g, "reduce(max) to the last rank", rank == n - 1 ? v == (n - 1) * 10.0 : v == rank * 10.0);
    }
    { /* all_gather: everyone learns every rank's value */
        int mine = rank * rank, *all = (int *)malloc(sizeof(int) * (size_t)n);
        int ok = 1;
        TRY(ddp_all_gather(g, &mine, all, 1, DDP_I32));
        for (i = 0; i < n; i++) ok &= all[i] == i * i;
        failures += report(g, "all_gather of rank^2", ok);
        free(all);
    }
    { /* reduce_scatter: rank r receives the sum over ranks of element r */
        int *send = (int *)malloc(sizeof(int) * (size_t)n), got = -1;
        for (i = 0; i < n; i++) send[i] = i + rank;
        TRY(ddp_reduce_scatter(g, send, &got, 1, DDP_I32, DDP_SUM));
        failures += report(g, "reduce_scatter(sum): rank r gets n*r + n(n-1)/2", got == n * rank + n * (n - 1) / 2);
        free(send);
    }
    { /* async: start an all_reduce, do other work, then wait */
        static float grad[1 << 20];
        ddp_work *w;
        for (i = 0; i < (1 << 20); i++) grad[i] = 1.0f;
        TRY(ddp_all_reduce_async(g, grad, 1 << 20, DDP_F32, DDP_SUM, &w));
        TRY(ddp_wait(w));
        failures += report(g, "all_reduce_async of 1M floats", grad[0] == (float)n && grad[(1 << 20) - 1] == (float)n);
    }
    TRY(ddp_barrier(g));
    if (rank == 0) printf("%s\n", failures ? "SOME RESULTS WERE WRONG" : "all collectives verified");
    ddp_destroy(g);
    return failures ? 1 : 0;
}
