/* mpi_alltoall.c: the Open MPI peer of bench/compare_collectives.sh for all_to_all, gather, scatter,
   all_to_all_v and all_gather_v.

   Measures MPI_Alltoall, MPI_Gather or MPI_Scatter (root 0), MPI_Alltoallv or MPI_Allgatherv of float
   blocks on malloc buffers at every block size min_bytes, x4, ... up to max_bytes per rank (the v calls:
   uneven blocks of 1/2, 1 or 3/2 of it, as bench_collectives), and prints one row per size in the columns of
   build/bench_collectives (rank 0 only; a header line, then rows whose first field is a number):

           size    time_us  algbw_GBs  busbw_GBs

   size is the bytes per rank (one block), time_us the mean time of one call on rank 0 (with a fourth
   argument "loop": as nccl-tests, every rank's time for the whole loop of back-to-back calls divided by
   the calls, averaged over the ranks, as bench_collectives --loop), algbw = size x n / time
   (the whole send or receive buffer, as nccl-tests' alltoall), busbw = algbw * (n - 1) / n. Each size runs
   two warm-up calls and a barrier, then 200 timed calls below 16 KiB and 20 from there (as
   bench_collectives).

   Build and run (as root, Open MPI needs --allow-run-as-root; --oversubscribe lets ranks exceed cores):
       mpicc -O2 -o mpi_alltoall bench/peers/mpi_alltoall.c
       mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_alltoall all_to_all 4194304 8 [loop] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The _v calls' uneven blocks, as bench_collectives' split(): rank `from` sends rank `to` (all_gather_v:
   every rank) count/2, count or 3 count/2 elements. */
static int split(int from, int to, int count) { return count / 2 + count * ((from + 2 * to) % 3) / 2; }

/* v: the counts and displacements of the _v calls (send counts, send displs, recv counts, recv displs). */
static void call(const char *op, float *a, float *b, int count, int *v[4], int rank) {
    if (!strcmp(op, "all_to_all")) MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(op, "gather")) MPI_Gather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else if (!strcmp(op, "all_to_all_v")) MPI_Alltoallv(a, v[0], v[1], MPI_FLOAT, b, v[2], v[3], MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(op, "all_gather_v")) MPI_Allgatherv(a, v[2][rank], MPI_FLOAT, b, v[2], v[3], MPI_FLOAT, MPI_COMM_WORLD);
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
    int loop = argc > 4 && !strcmp(argv[4], "loop");
    if (strcmp(op, "all_to_all") && strcmp(op, "gather") && strcmp(op, "scatter") && strcmp(op, "all_to_all_v") &&
        strcmp(op, "all_gather_v")) {
        if (rank == 0) fprintf(stderr, "mpi_alltoall: unknown op %s (all_to_all, gather, scatter, all_to_all_v, all_gather_v)\n", op);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t whole = max_bytes * (size_t)n * 3 / 2 + 64;
    float *a = malloc(whole), *b = malloc(whole);
    int *v[4], agv = !strcmp(op, "all_gather_v");
    for (int i = 0; i < 4; i++) v[i] = calloc((size_t)n, sizeof(int));
    if (!a || !b || !v[0] || !v[1] || !v[2] || !v[3]) {
        fprintf(stderr, "mpi_alltoall: cannot allocate 2 x %zu bytes\n", whole);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(a, 1, whole);
    memset(b, 0, whole);
    if (rank == 0) printf("%12s %10s %10s %10s\n", "size", "time_us", "algbw_GBs", "busbw_GBs");
    for (size_t bytes = min_bytes < 4 ? 4 : min_bytes; bytes <= max_bytes; bytes *= 4) {
        int count = (int)(bytes / 4), iters = bytes < 16384 ? 200 : 20;
        for (int j = 0; j < n; j++) {
            v[0][j] = split(rank, j, count), v[2][j] = agv ? split(j, 0, count) : split(j, rank, count);
            v[1][j] = j ? v[1][j - 1] + v[0][j - 1] : 0, v[3][j] = j ? v[3][j - 1] + v[2][j - 1] : 0;
        }
        call(op, a, b, count, v, rank);
        call(op, a, b, count, v, rank);
        MPI_Barrier(MPI_COMM_WORLD);
        double total = 0, start = MPI_Wtime();
        for (int i = 0; i < iters; i++) { /* each call timed on its own, as bench_collectives does */
            double t0 = MPI_Wtime();
            call(op, a, b, count, v, rank);
            total += MPI_Wtime() - t0;
        }
        if (loop) { /* nccl-tests: the whole loop on every rank, averaged over the ranks */
            total = MPI_Wtime() - start;
            MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            total /= n;
        }
        double t = total / iters, algbw = (double)bytes * n / t / 1e9;
        if (rank == 0) printf("%12zu %10.2f %10.3f %10.3f\n", bytes, t * 1e6, algbw, algbw * (n - 1) / n);
        fflush(stdout);
    }
    free(a);
    free(b);
    for (int i = 0; i < 4; i++) free(v[i]);
    MPI_Finalize();
    return 0;
}
