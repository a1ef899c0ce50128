/* mpi_alltoall.c: the Open MPI peer of bench/compare_collectives.sh for all_to_all, gather and scatter.

   Measures MPI_Alltoall, MPI_Gather or MPI_Scatter (root 0) of float blocks on malloc buffers at every
   block size min_bytes, x4, ... up to max_bytes per rank, and prints one row per size in the columns of
   build/bench_collectives (rank 0 only; a header line, then rows whose first field is a number):

           size    time_us  algbw_GBs  busbw_GBs

   size is the bytes per rank (one block), time_us the mean time of one call, algbw = size x n / time
   (the whole send or receive buffer, as nccl-tests' alltoall), busbw = algbw * (n - 1) / n. Each size runs
   two warm-up calls and a barrier, then 200 timed calls below 16 KiB and 20 from there (as
   bench_collectives).

   Build and run (as root, Open MPI needs --allow-run-as-root; --oversubscribe lets ranks exceed cores):
       mpicc -O2 -o mpi_alltoall bench/peers/mpi_alltoall.c
       mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_alltoall all_to_all 4194304 8 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void call(const char *op, float *a, float *b, int count) {
    if (!strcmp(op, "all_to_all")) MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(op, "gather")) MPI_Gather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else MPI_Scatter(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    int rank, n;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const char *op = argc > 1 ? argv[1] : "all_to_all";
    size_t max_bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)4 << 20;
    size_t min_bytes = argc > 3 ? strtoull(argv[3], NULL, 10) : 8;
    if (strcmp(op, "all_to_all") && strcmp(op, "gather") && strcmp(op, "scatter")) {
        if (rank == 0) fprintf(stderr, "mpi_alltoall: unknown op %s (all_to_all, gather, scatter)\n", op);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t whole = max_bytes * (size_t)n + 64;
    float *a = malloc(whole), *b = malloc(whole);
    if (!a || !b) {
        fprintf(stderr, "mpi_alltoall: cannot allocate 2 x %zu bytes\n", whole);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(a, 1, whole);
    memset(b, 0, whole);
    if (rank == 0) printf("%12s %10s %10s %10s\n", "size", "time_us", "algbw_GBs", "busbw_GBs");
    for (size_t bytes = min_bytes < 4 ? 4 : min_bytes; bytes <= max_bytes; bytes *= 4) {
        int count = (int)(bytes / 4), iters = bytes < 16384 ? 200 : 20;
        call(op, a, b, count);
        call(op, a, b, count);
        MPI_Barrier(MPI_COMM_WORLD);
        double total = 0;
        for (int i = 0; i < iters; i++) { /* each call timed on its own, as bench_collectives does */
            double t0 = MPI_Wtime();
            call(op, a, b, count);
            total += MPI_Wtime() - t0;
        }
        double t = total / iters, algbw = (double)bytes * n / t / 1e9;
        if (rank == 0) printf("%12zu %10.2f %10.3f %10.3f\n", bytes, t * 1e6, algbw, algbw * (n - 1) / n);
        fflush(stdout);
    }
    free(a);
    free(b);
    MPI_Finalize();
    return 0;
}
