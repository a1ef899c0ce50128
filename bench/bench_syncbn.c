/* bench_syncbn: SyncBatchNorm forward (training) + backward throughput on the CPU, both layouts.
   Shape: the global batch N x C x H x W (default 32 x 64 x 56 x 56, the shape of the peer
   bench/peers/torch_bn.py), split over R ranks (1 = plain BatchNorm without a group, 2+ =
   forked ranks in a group: statistics all_gather + gradient all_reduce every step). Prints one row per
   layout and rank count: the median step time over the slowest rank and GB/s of x processed.
   Usage: bench_syncbn [ranks...]   (default: 1 2); BENCH_SHAPE="N C H W" overrides the shape.
   bench/bench_syncbn.sh runs it beside the torch peer and prints the ratios. */
#include "../tests/testlib.h"

#define ITERS 8  /* as the peer: 8 steps, the first 2 are warm-up */
#define WARMUP 2

static int64_t N = 32, C = 64, H = 56, W = 56;

typedef struct job {
    int channels_last;
    double *times; /* shared memory: ranks x ITERS seconds */
} job;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One rank: its share of the batch (the remainder goes to the first ranks). */
static int run_rank(int rank, int nranks, void *arg) {
    job *jb = (job *)arg;
    ddp_group *g = NULL;
    ddp_syncbn *bn;
    ddp_syncbn_desc d;
    int64_t batch = N / nranks + (rank < N % nranks), n, i;
    float *x, *y, *dy, *dx, *w, *b, *rm, *rv, *gw, *gb;
    uint64_t st = 1234 + (uint64_t)rank;
    int it;
    if (nranks > 1 && ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: ddp_init: %s\n", rank, ddp_last_error(NULL));
        return 1;
    }
    n = batch * C * H * W;
    x = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    y = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    dy = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    dx = (float *)malloc(sizeof(float) * (size_t)(n + 1));
    w = (float *)calloc((size_t)C, sizeof(float));
    b = (float *)calloc((size_t)C, sizeof(float));
    rm = (float *)calloc((size_t)C, sizeof(float));
    rv = (float *)calloc((size_t)C, sizeof(float));
    gw = (float *)calloc((size_t)C, sizeof(float));
    gb = (float *)calloc((size_t)C, sizeof(float));
    if (!x || !y || !dy || !dx || !w || !b || !rm || !rv || !gw || !gb) return 2;
    for (i = 0; i < n; i++) {
        x[i] = (float)((double)(tl_rand(&st) >> 40) / 16777216.0 * 4.0 - 2.0);
        dy[i] = (float)((double)(tl_rand(&st) >> 40) / 16777216.0 * 2.0 - 1.0);
    }
    for (i = 0; i < C; i++) {
        w[i] = 1;
        rv[i] = 1;
    }
    memset(&d, 0, sizeof d);
    d.num_features = (int)C;
    d.channels_last = jb->channels_last;
    d.weight = w;
    d.bias = b;
    d.running_mean = rm;
    d.running_var = rv;
    if (ddp_syncbn_create(g, &d, &bn) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g));
        return 1;
    }
    for (it = 0; it < ITERS; it++) {
        double t0;
        if (g && ddp_barrier(g) != DDP_SUCCESS) return 1;
        t0 = tl_now();
        if (ddp_syncbn_forward(bn, x, y, batch, H * W, 1) != DDP_SUCCESS ||
            ddp_syncbn_backward(bn, x, dy, dx, gw, gb, batch, H * W) != DDP_SUCCESS) {
            fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error(g));
            return 1;
        }
        jb->times[rank * ITERS + it] = tl_now() - t0;
    }
    ddp_syncbn_destroy(bn);
    if (g) ddp_destroy(g);
    free(x);
    free(y);
    free(dy);
    free(dx);
    free(w);
    free(b);
    free(rm);
    free(rv);
    free(gw);
    free(gb);
    return 0;
}

/* Median over the measured steps of the slowest rank's time. */
static double median_step(const double *times, int nranks) {
    double step[ITERS];
    int it, r;
    for (it = 0; it < ITERS; it++) {
        step[it] = 0;
        for (r = 0; r < nranks; r++)
            if (times[r * ITERS + it] > step[it]) step[it] = times[r * ITERS + it];
    }
    qsort(step + WARMUP, ITERS - WARMUP, sizeof(double), cmp_double);
    return step[WARMUP + (ITERS - WARMUP) / 2];
}

int main(int argc, char **argv) {
    static const char *layouts[] = {"channels_first", "channels_last"};
    int ranks[16], nr = 0, i, l;
    const char *shape = getenv("BENCH_SHAPE");
    if (shape && sscanf(shape, "%lld %lld %lld %lld", (long long *)&N, (long long *)&C, (long long *)&H,
                        (long long *)&W) != 4) {
        fprintf(stderr, "BENCH_SHAPE must be \"N C H W\"\n");
        return 2;
    }
    for (i = 1; i < argc && nr < 16; i++) ranks[nr++] = atoi(argv[i]);
    if (nr == 0) {
        ranks[0] = 1;
        ranks[1] = 2;
        nr = 2;
    }
    printf("# SyncBatchNorm fwd(train)+bwd, f32, global batch %lld x %lld x %lld x %lld (%.0f MiB of x), "
           "median of %d steps\n",
           (long long)N, (long long)C, (long long)H, (long long)W, (double)(N * C * H * W) * 4 / 1048576.0,
           ITERS - WARMUP);
    printf("%-15s %5s %10s %12s\n", "layout", "ranks", "ms/step", "GB/s_of_x");
    for (l = 0; l < 2; l++)
        for (i = 0; i < nr; i++) {
            job jb;
            double t;
            jb.channels_last = l;
            jb.times = (double *)mmap(NULL, sizeof(double) * ITERS * (size_t)ranks[i], PROT_READ | PROT_WRITE,
                                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
            if (jb.times == MAP_FAILED) return 1;
            if (ranks[i] == 1) {
                if (run_rank(0, 1, &jb) != 0) return 1;
            } else if (tl_run_ranks(ranks[i], run_rank, &jb, 300) != 0) {
                return 1;
            }
            t = median_step(jb.times, ranks[i]);
            printf("%-15s %5d %10.2f %12.2f\n", layouts[l], ranks[i], t * 1e3, (double)(N * C * H * W) * 4 / t / 1e9);
            fflush(stdout);
            munmap(jb.times, sizeof(double) * ITERS * (size_t)ranks[i]);
        }
    return 0;
}
