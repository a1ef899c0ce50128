/* Checkpoint throughput, single process (g == NULL), against the floor of the same bytes written raw.
     crc32c     GB/s of the SSE4.2 instruction path and of the portable slicing-by-8 path
     save       ddp_checkpoint_save (CRC32C, header, tmp file, fsync, rename, directory fsync) vs a raw
                write + fsync + rename + directory fsync of the same bytes
     load       ddp_checkpoint_load (header parse, pread into the tensors, CRC32C verify), page cache
                warm, vs a raw pread of the same bytes
   Medians of REPS runs. The directory is $TMPDIR (default /tmp); sizes in MiB as arguments
   (default 4 64). Run: make build/bench_checkpoint && build/bench_checkpoint [MiB ...]
   --async [MiB ...] (default 256 2048): the training thread's stall, ddp_checkpoint_save (the whole
   save) against ddp_checkpoint_save_async (the call: the staging copy), and the async save's time to
   completion (ddp_wait). The first async call allocates the staging buffer (page faults: reported on
   its own); the median is over the REPS calls after it, which reuse the buffer. Needs twice the
   checkpoint's size in memory (tensors + staging copy) and its size on disk. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 5
#define NT 8 /* the checkpoint is split over this many tensors, like a small model */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static void raw_save(const char *path, const char *tmp, const char *dir, const ddp_tensor *t, int n) {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644), i, dfd;
    for (i = 0; i < n; i++) {
        size_t bytes = (size_t)t[i].shape[0] * 4, off = 0;
        while (off < bytes) {
            ssize_t w = write(fd, (char *)t[i].data + off, bytes - off);
            if (w <= 0) {
                perror("write");
                exit(1);
            }
            off += (size_t)w;
        }
    }
    fsync(fd);
    close(fd);
    if (rename(tmp, path) != 0) perror("rename");
    dfd = open(dir, O_RDONLY | O_DIRECTORY);
    fsync(dfd);
    close(dfd);
}

static void raw_load(const char *path, ddp_tensor *t, int n) {
    int fd = open(path, O_RDONLY), i;
    off_t at = 0;
    for (i = 0; i < n; i++) {
        size_t bytes = (size_t)t[i].shape[0] * 4, off = 0;
        while (off < bytes) {
            ssize_t r = pread(fd, (char *)t[i].data + off, bytes - off, at);
            if (r <= 0) {
                perror("pread");
                exit(1);
            }
            off += (size_t)r;
            at += r;
        }
    }
    close(fd);
}

/* The tensors of a mib-MiB checkpoint, NT of them (the caller frees their data). */
static size_t make_tensors(int mib, ddp_tensor *t, char (*names)[16]) {
    size_t per = ((size_t)mib << 20) / NT / 4;
    uint64_t seed = 1;
    int i;
    for (i = 0; i < NT; i++) {
        size_t k;
        float *d = (float *)malloc(per * 4);
        if (!d) {
            fprintf(stderr, "out of memory for %d MiB of tensors\n", mib);
            exit(1);
        }
        for (k = 0; k < per; k++) d[k] = (float)(seed = seed * 6364136223846793005ull + 1442695040888963407ull) * 1e-19f;
        snprintf(names[i], 16, "layer%d", i);
        memset(&t[i], 0, sizeof t[i]);
        t[i].name = names[i];
        t[i].dtype = DDP_F32;
        t[i].ndim = 1;
        t[i].shape[0] = (int64_t)per;
        t[i].data = d;
    }
    return per * 4 * NT;
}

static void check(ddp_result r, const char *what) {
    if (r != DDP_SUCCESS) {
        fprintf(stderr, "%s: %s\n", what, ddp_last_error(NULL));
        exit(1);
    }
}

/* --async: the training thread's stall, sync save against async save. */
static int bench_async(const char *dir, int nsizes, char **sizes) {
    static const int defaults[] = {256, 2048};
    char path[300];
    int s;
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    printf("%8s %14s %16s %16s %10s %16s\n", "MiB", "sync save ms", "async call ms", "(first call ms)", "ratio", "async done ms");
    for (s = 0; s < (nsizes ? nsizes : 2); s++) {
        int mib = nsizes ? atoi(sizes[s]) : defaults[s], i, r;
        ddp_tensor t[NT];
        char names[NT][16];
        double sync_ms[REPS], call_ms[REPS], done_ms[REPS], first = 0;
        ddp_work *w;
        make_tensors(mib, t, names);
        for (r = -1; r < REPS; r++) { /* r = -1: the first async call, which allocates the staging buffer */
            double t0 = now(), t1;
            check(ddp_checkpoint_save_async(NULL, path, t, NT, NULL, &w), "async save");
            t1 = now();
            ((float *)t[0].data)[0] += 1.0f; /* the next step may write the tensors now */
            check(ddp_wait(w), "async save (ddp_wait)");
            if (r < 0) {
                first = (t1 - t0) * 1e3;
                continue;
            }
            call_ms[r] = (t1 - t0) * 1e3;
            done_ms[r] = (now() - t0) * 1e3;
            t0 = now();
            check(ddp_checkpoint_save(NULL, path, t, NT, NULL), "sync save");
            sync_ms[r] = (now() - t0) * 1e3;
        }
        {
            double a = median(sync_ms, REPS), b = median(call_ms, REPS);
            printf("%8d %14.1f %16.2f %16.2f %9.0fx %16.1f\n", mib, a, b, first, a / b, median(done_ms, REPS));
        }
        for (i = 0; i < NT; i++) free(t[i].data);
        fflush(stdout);
    }
    unlink(path);
    rmdir(dir);
    printf("\nratio = sync save / async call: how much less the training thread stalls (medians of %d; the first call's "
           "page faults apart)\n", REPS);
    return 0;
}

int main(int argc, char **argv) {
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char dir[256], path[300], tmp[310], rawp[300];
    static const int defaults[] = {4, 64};
    int nsizes = argc > 1 ? argc - 1 : 2, s;
    snprintf(dir, sizeof dir, "%s/bench_ckpt_XXXXXX", base);
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    if (argc > 1 && strcmp(argv[1], "--async") == 0) return bench_async(dir, argc - 2, argv + 2);
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    snprintf(rawp, sizeof rawp, "%s/raw.bin", dir);
    snprintf(tmp, sizeof tmp, "%s/raw.bin.tmp", dir);

    {
        size_t n = (size_t)64 << 20;
        unsigned char *buf = (unsigned char *)malloc(n);
        double hw[REPS], sw[REPS];
        int r;
        uint32_t sink = 0;
        memset(buf, 0x5a, n);
        for (r = 0; r < REPS; r++) {
            double t0 = now();
            sink ^= ddp__ck_crc32c(buf, n, 1);
            hw[r] = (double)n / (now() - t0) / 1e9;
            t0 = now();
            sink ^= ddp__ck_crc32c(buf, n, 0);
            sw[r] = (double)n / (now() - t0) / 1e9;
        }
        printf("crc32c over 64 MiB: instruction path %.2f GB/s, slicing-by-8 %.2f GB/s (median of %d; sink %08x)\n\n",
               median(hw, REPS), median(sw, REPS), REPS, (unsigned)sink);
        free(buf);
    }

    printf("%8s %12s %12s %8s %12s %12s %8s\n", "MiB", "save GB/s", "raw GB/s", "ratio", "load GB/s", "raw GB/s", "ratio");
    for (s = 0; s < nsizes; s++) {
        int mib = argc > 1 ? atoi(argv[s + 1]) : defaults[s], i, r;
        ddp_tensor t[NT];
        char names[NT][16];
        double sv[REPS], rs[REPS], ld[REPS], rl[REPS];
        size_t total = make_tensors(mib, t, names);
        for (r = 0; r < REPS; r++) {
            double t0 = now();
            if (ddp_checkpoint_save(NULL, path, t, NT, NULL) != DDP_SUCCESS) {
                fprintf(stderr, "save: %s\n", ddp_last_error(NULL));
                return 1;
            }
            sv[r] = (double)total / (now() - t0) / 1e9;
            t0 = now();
            raw_save(rawp, tmp, dir, t, NT);
            rs[r] = (double)total / (now() - t0) / 1e9;
            t0 = now();
            if (ddp_checkpoint_load(NULL, path, t, NT, NULL) != DDP_SUCCESS) {
                fprintf(stderr, "load: %s\n", ddp_last_error(NULL));
                return 1;
            }
            ld[r] = (double)total / (now() - t0) / 1e9;
            t0 = now();
            raw_load(rawp, t, NT);
            rl[r] = (double)total / (now() - t0) / 1e9;
        }
        {
            double a = median(sv, REPS), b = median(rs, REPS), c = median(ld, REPS), d = median(rl, REPS);
            printf("%8d %12.3f %12.3f %8.2f %12.3f %12.3f %8.2f\n", mib, a, b, a / b, c, d, c / d);
        }
        for (i = 0; i < NT; i++) free(t[i].data);
    }
    unlink(path);
    unlink(rawp);
    rmdir(dir);
    printf("\nratio = ddp.h / raw (1.00 = no overhead over writing or reading the bytes themselves)\n");
    return 0;
}
