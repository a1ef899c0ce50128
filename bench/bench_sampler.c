/* Benchmark: one rank's DistributedSampler indices at large N -- time and peak memory.
   Same setting as the peer bench/peers/torch_sampler.py: num_replicas 8, rank 3, seed 0, epoch 1.

       bench_sampler [N [REPS]]          table of every configuration (each run in its own process,
                                         so that its peak RSS is its own); medians of REPS runs
       bench_sampler --one CONFIG N      one run, one machine-readable line (bench/bench_sampler.sh)

   Configurations: torch (the default, bit-exact with torch; the iterator, 256 indices a batch),
   torch-array (ddp_sampler_indices into one int64 array, like list(sampler)), eval (evaluation mode),
   streaming (the Feistel permutation, not torch's order).
   time_to_first: set_epoch to the first batch in hand (includes the shuffle); full: the whole epoch. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *const configs[] = {"torch", "torch-array", "eval", "streaming"};
#define NCONFIGS ((int)(sizeof configs / sizeof configs[0]))

typedef struct result {
    double first, full, rss_mib;
    long long first_index, checksum, count;
} result;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int run_one(const char *config, uint64_t n, result *r) {
    ddp_sampler s;
    ddp_sampler_desc d;
    int64_t batch[256];
    size_t got;
    double t0;
    struct rusage ru;
    memset(&d, 0, sizeof d);
    memset(r, 0, sizeof *r);
    d.dataset_size = n;
    d.num_replicas = 8;
    d.rank = 3;
    if (strcmp(config, "eval") == 0) d.mode = DDP_SAMPLER_EVAL;
    if (strcmp(config, "streaming") == 0) d.permutation = DDP_PERMUTATION_STREAMING;
    if (ddp_sampler_init(&s, &d) != DDP_SUCCESS) {
        fprintf(stderr, "%s\n", ddp_last_error(NULL));
        return 1;
    }
    ddp_sampler_set_epoch(&s, 1);
    t0 = now();
    if (strcmp(config, "torch-array") == 0) {
        uint64_t k, count = ddp_sampler_num_samples(&s);
        int64_t *all = (int64_t *)malloc((size_t)count * sizeof *all);
        if (!all || ddp_sampler_indices(&s, all) != DDP_SUCCESS) return 1;
        r->first = r->full = now() - t0;
        r->first_index = all[0];
        for (k = 0; k < count; k++) r->checksum += all[k];
        r->count = (long long)count;
        free(all);
    } else {
        if (ddp_sampler_next_batch(&s, 256, batch, &got) != DDP_SUCCESS || got == 0) return 1;
        r->first = now() - t0;
        r->first_index = batch[0];
        do {
            size_t i;
            for (i = 0; i < got; i++) r->checksum += batch[i];
            r->count += (long long)got;
            if (ddp_sampler_next_batch(&s, 256, batch, &got) != DDP_SUCCESS) return 1;
        } while (got > 0);
        r->full = now() - t0;
    }
    ddp_sampler_free(&s);
    getrusage(RUSAGE_SELF, &ru);
    r->rss_mib = (double)ru.ru_maxrss / 1024.0;
    return 0;
}

/* Run one configuration in a child process and read its result back through a pipe. */
static int run_in_child(const char *config, uint64_t n, result *r) {
    int fds[2], status;
    pid_t pid;
    if (pipe(fds) != 0) return 1;
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        result mine;
        int rc = run_one(config, n, &mine);
        if (rc == 0 && write(fds[1], &mine, sizeof mine) != (ssize_t)sizeof mine) rc = 1;
        _exit(rc);
    }
    close(fds[1]);
    if (pid < 0 || read(fds[0], r, sizeof *r) != (ssize_t)sizeof *r) {
        close(fds[0]);
        if (pid > 0) waitpid(pid, &status, 0);
        return 1;
    }
    close(fds[0]);
    waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
    uint64_t n = 100000000;
    int reps = 3, c, i;
    if (argc == 4 && strcmp(argv[1], "--one") == 0) {
        result r;
        if (run_one(argv[2], (uint64_t)atof(argv[3]), &r) != 0) return 1;
        printf("config=%s n=%.0f num_samples=%lld first_index=%lld checksum=%lld time_to_first=%.3f full=%.3f "
               "peak_rss_mib=%.0f\n",
               argv[2], atof(argv[3]), r.count, r.first_index, r.checksum, r.first, r.full, r.rss_mib);
        return 0;
    }
    if (argc > 1) n = (uint64_t)atof(argv[1]);
    if (argc > 2) reps = atoi(argv[2]);
    if (reps < 1 || reps > 50 || n == 0) {
        fprintf(stderr, "usage: bench_sampler [N [REPS]] | bench_sampler --one CONFIG N\n");
        return 2;
    }
    printf("DistributedSampler, one rank's indices: N=%llu, num_replicas=8, rank=3, seed=0, epoch=1; median of %d\n",
           (unsigned long long)n, reps);
    printf("%-12s %14s %12s %14s %14s %12s\n", "config", "num_samples", "first_index", "time_to_first_s", "full_epoch_s",
           "peak_rss_MiB");
    for (c = 0; c < NCONFIGS; c++) {
        double first[50], full[50], rss[50];
        result r;
        for (i = 0; i < reps; i++) {
            if (run_in_child(configs[c], n, &r) != 0) {
                fprintf(stderr, "bench_sampler: %s failed\n", configs[c]);
                return 1;
            }
            first[i] = r.first;
            full[i] = r.full;
            rss[i] = r.rss_mib;
        }
        printf("%-12s %14lld %12lld %14.3f %14.3f %12.0f\n", configs[c], r.count, r.first_index, median(first, reps),
               median(full, reps), median(rss, reps));
    }
    return 0;
}
