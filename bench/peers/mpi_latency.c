/* mpi_latency: bench/bench_latency.c's loop with Open MPI's collectives, for bench/compare_latency.sh.
   mpirun -np 2 mpi_latency [op] [count] [calls] [reps]; same ops, arguments and output as bench_latency. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    static const char *ops[] = {"all_reduce", "barrier", "all_to_all", "gather", "scatter", "all_to_all_v", "all_gather_v"};
    const char *name = argc > 1 ? argv[1] : "all_reduce";
    int count = argc > 2 ? atoi(argv[2]) : 16, reps = argc > 4 ? atoi(argv[4]) : 3, op, rep, n, rank, j;
    long calls = argc > 3 ? atol(argv[3]) : 300000, i;
    float *send, *recv;
    int *counts, *displs;
    double *t;
    MPI_Comm w = MPI_COMM_WORLD;
    for (op = 0; op < 7 && strcmp(name, ops[op]) != 0; op++) {}
    if (op == 7 || calls < 1 || reps < 1) {
        fprintf(stderr, "usage: mpi_latency [all_reduce|barrier|all_to_all|gather|scatter|all_to_all_v|all_gather_v] "
                        "[count] [calls >= 1] [reps >= 1]\n");
        return 2;
    }
    MPI_Init(&argc, &argv);
    MPI_Comm_size(w, &n), MPI_Comm_rank(w, &rank);
    send = calloc((size_t)count * n + 1, sizeof *send), recv = calloc((size_t)count * n + 1, sizeof *recv);
    counts = calloc(n, sizeof *counts), displs = calloc(n, sizeof *displs), t = calloc(reps, sizeof *t);
    for (j = 0; j < n; j++) counts[j] = count, displs[j] = j * count;
    for (rep = 0; rep < reps; rep++) {
        double t0;
        MPI_Barrier(w);
        t0 = MPI_Wtime();
        for (i = 0; i < calls; i++) {
            switch (op) {
            case 0: MPI_Allreduce(MPI_IN_PLACE, send, count, MPI_FLOAT, MPI_SUM, w); break;
            case 1: MPI_Barrier(w); break;
            case 2: MPI_Alltoall(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, w); break;
            case 3: MPI_Gather(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, 0, w); break;
            case 4: MPI_Scatter(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, 0, w); break;
            case 5: MPI_Alltoallv(send, counts, displs, MPI_FLOAT, recv, counts, displs, MPI_FLOAT, w); break;
            default: MPI_Allgatherv(send, count, MPI_FLOAT, recv, counts, displs, MPI_FLOAT, w);
            }
        }
        t[rep] = (MPI_Wtime() - t0) / (double)calls * 1e6;
        if (rank == 0) printf("%s count %d ranks %d: %.3f us per call\n", name, count, n, t[rep]);
    }
    qsort(t, reps, sizeof *t, by_value);
    if (rank == 0) printf("median_us %.4f\n", t[reps / 2]);
    free(send), free(recv), free(counts), free(displs), free(t);
    MPI_Finalize();
    return 0;
}
