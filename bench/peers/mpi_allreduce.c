/* mpi_allreduce.c: the Open MPI peer of bench/compare_allreduce.sh.

   Measures MPI_Allreduce (float, MPI_SUM, in place on a malloc buffer) at every size 4 B, 16 B, 64 B, ...
   (x4 each step) up to max_bytes, and prints one row per size in the nccl-tests columns that
   compare_allreduce.sh parses (rank 0 only; a header line, then rows whose first field is a number):

           bytes    time_us  algbw_GBs  busbw_GBs

   time_us is the mean time of one call, algbw = bytes / time, busbw = algbw * 2 (n - 1) / n (the bytes a
   ring all-reduce moves through each rank's link, so the figure is comparable across rank counts).
   Each size runs one warm-up call and a barrier, then 200 timed calls below 256 KiB, 20 below 16 MiB and
   5 above. The buffer is filled with ones once; repeated sums grow the values (to inf eventually), which
   does not change the speed of the additions on x86.

   Build and run (as root, Open MPI needs --allow-run-as-root; --oversubscribe lets ranks exceed cores):
       mpicc -O2 -o mpi_allreduce bench/peers/mpi_allreduce.c
       mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_allreduce 268435456
       mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl tcp,self ./mpi_allreduce 268435456  (TCP only)
   compare_allreduce.sh does both (its mpi and mpi_tcp columns). max_bytes defaults to 64 MiB. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    int rank, n;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);

    size_t max_count = (argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)64 << 20) / sizeof(float);
    float *buf = malloc((max_count ? max_count : 1) * sizeof(float));
    if (!buf) {
        fprintf(stderr, "mpi_allreduce: cannot allocate %zu bytes\n", max_count * sizeof(float));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < max_count; i++) buf[i] = 1.0f;

    if (rank == 0) printf("%12s %10s %10s %10s\n", "bytes", "time_us", "algbw_GBs", "busbw_GBs");
    for (size_t count = 1; count <= max_count; count *= 4) {
        int iters = count < 65536 ? 200 : count < ((size_t)1 << 22) ? 20 : 5;
        /* warm-up (connections, registration), then start together */
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double t = (MPI_Wtime() - t0) / iters;
        double algbw = count * sizeof(float) / t / 1e9;
        if (rank == 0)
            printf("%12zu %10.1f %10.3f %10.3f\n", count * sizeof(float), t * 1e6, algbw,
                   algbw * 2.0 * (n - 1) / n);
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
