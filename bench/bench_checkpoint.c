/* Checkpoint throughput, single process (g == NULL), against the floor of the same bytes written raw.
     crc32c     GB/s of the SSE4.2 instruction path and of the portable slicing-by-8 path
     save       ddp_checkpoint_save (CRC32C, header, tmp file, fsync, rename, directory fsync) vs a raw
                write + fsync + rename + directory fsync of the same bytes
     load       ddp_checkpoint_load (header parse, pread into the tensors, CRC32C verify), page cache
                warm, vs a raw pread of the same bytes
   Medians of REPS runs. The directory is $TMPDIR (default /tmp); sizes in MiB as arguments
   (default 4 64). Run: make build/bench_checkpoint && build/bench_checkpoint [MiB ...] */
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
        size_t per = ((size_t)mib << 20) / NT / 4, total = per * 4 * NT;
        ddp_tensor t[NT];
        char names[NT][16];
        double sv[REPS], rs[REPS], ld[REPS], rl[REPS];
        uint64_t seed = 1;
        for (i = 0; i < NT; i++) {
            size_t k;
            float *d = (float *)malloc(per * 4);
            for (k = 0; k < per; k++) d[k] = (float)(seed = seed * 6364136223846793005ull + 1442695040888963407ull) * 1e-19f;
            snprintf(names[i], sizeof names[i], "layer%d", i);
            memset(&t[i], 0, sizeof t[i]);
            t[i].name = names[i];
            t[i].dtype = DDP_F32;
            t[i].ndim = 1;
            t[i].shape[0] = (int64_t)per;
            t[i].data = d;
        }
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
