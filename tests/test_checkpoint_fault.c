/* Crash safety: a child process saves checkpoints in a loop and is SIGKILLed at random moments; after
   every kill the newest checkpoint must load, pass its checksums and hold exactly the data of the step
   its metadata names, and it must be no older than the last save the child reported as finished.
     atomic      20 kills, the child overwrites one path
     async       20 kills at evenly spread delays, the child saves with ddp_checkpoint_save_async (and
                 overwrites its tensors right after the call)
     rotation    10 kills, the child saves step-numbered files with keep_last = 2; ddp_checkpoint_latest
                 finds the newest, and every file of the family that is left must load
     self-check  20 kills of a naive writer (open with O_TRUNC, write in pieces): the same verification
                 must catch torn files, which shows that the checks above can fail */
#include "testlib.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#define WN (128 * 256)
#define BN 1000

static char dir[256];
static int use_async; /* save with ddp_checkpoint_save_async + ddp_wait */

typedef struct state {
    float w[WN];
    uint16_t b[BN];
    int64_t s;
} state;

static void fill(state *st, int64_t step) {
    uint64_t seed = (uint64_t)step * 7919u + 1;
    int i;
    for (i = 0; i < WN; i++) st->w[i] = (float)(int32_t)tl_rand(&seed) * 1e-9f;
    for (i = 0; i < BN; i++) st->b[i] = (uint16_t)tl_rand(&seed);
    st->s = step;
}

static void tensors(state *st, ddp_tensor *t) {
    memset(t, 0, 3 * sizeof *t);
    t[0].name = "w";
    t[0].dtype = DDP_F32;
    t[0].ndim = 2;
    t[0].shape[0] = 128;
    t[0].shape[1] = 256;
    t[0].data = st->w;
    t[1].name = "b";
    t[1].dtype = DDP_BF16;
    t[1].ndim = 1;
    t[1].shape[0] = BN;
    t[1].data = st->b;
    t[2].name = "s";
    t[2].dtype = DDP_I64;
    t[2].ndim = 0;
    t[2].data = &st->s;
}

static ddp_result save_step(const char *path, int64_t step, int keep_last) {
    static state st;
    ddp_tensor t[3];
    ddp_meta m = {0, 0, 0};
    ddp_checkpoint_save_desc d;
    ddp_result r;
    memset(&d, 0, sizeof d);
    d.keep_last = keep_last;
    fill(&st, step);
    tensors(&st, t);
    ddp_meta_set_int(&m, DDP_META_STEP, step);
    if (use_async) { /* the training thread overwrites the tensors while the background writes */
        ddp_work *w;
        r = ddp_checkpoint_save_async_ex(NULL, path, t, 3, &m, &d, &w);
        memset(&st, 0x5A, sizeof st);
        if (r == DDP_SUCCESS) r = ddp_wait(w);
    } else {
        r = ddp_checkpoint_save_ex(NULL, path, t, 3, &m, &d);
    }
    ddp_meta_free(&m);
    return r;
}

/* Load path and check it is step S's data throughout. Returns S, or -1 when it does not load (with
   the reason in ddp_last_error). */
static int64_t verify(const char *path) {
    static state got, want;
    ddp_tensor t[3];
    ddp_meta m = {0, 0, 0};
    int64_t step;
    ddp_result r;
    tensors(&got, t);
    r = ddp_checkpoint_load(NULL, path, t, 3, &m);
    if (r != DDP_SUCCESS) {
        ddp_meta_free(&m);
        return -1;
    }
    CHECK_OK(ddp_meta_get_int(&m, DDP_META_STEP, &step), NULL);
    ddp_meta_free(&m);
    fill(&want, step);
    CHECK(got.s == step && memcmp(got.w, want.w, sizeof want.w) == 0 && memcmp(got.b, want.b, sizeof want.b) == 0,
          "%s loads but its data is not step %lld's", path, (long long)step);
    return step;
}

/* The child: save steps first, first+1, ... forever, reporting each finished step on fd. */
static void saver(int fd, int64_t first, int rotate) {
    int64_t step;
    char path[512];
    for (step = first;; step++) {
        if (rotate) snprintf(path, sizeof path, "%s/rot_%08lld.safetensors", dir, (long long)step);
        else snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
        if (save_step(path, step, rotate ? 2 : 0) != DDP_SUCCESS) {
            fprintf(stderr, "child: %s\n", ddp_last_error(NULL));
            _exit(3);
        }
        if (write(fd, &step, sizeof step) != (ssize_t)sizeof step) _exit(4);
    }
}

/* The naive writer of the self-check: rewrite path in place from two images, in 4 KiB pieces. */
static void naive_writer(const char *path, const unsigned char *const *img, const size_t *size) {
    int k;
    for (k = 0;; k ^= 1) {
        size_t off = 0;
        int fd = open(path, O_WRONLY | O_TRUNC);
        if (fd < 0) _exit(5);
        while (off < size[k]) {
            size_t n = size[k] - off < 4096 ? size[k] - off : 4096;
            if (write(fd, img[k] + off, n) != (ssize_t)n) _exit(6);
            off += n;
        }
        close(fd);
    }
}

/* Fork fn's child, kill it after delay_us, and return the last step it reported (or first - 1). */
static int64_t run_and_kill(int64_t first, int rotate, int naive, const unsigned char *const *img, const size_t *size, long delay_us) {
    int fds[2], st;
    int64_t step, last = first - 1;
    pid_t pid;
    CHECK(pipe(fds) == 0, "pipe");
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        char path[512];
        close(fds[0]);
        snprintf(path, sizeof path, "%s/naive.safetensors", dir);
        if (naive) naive_writer(path, img, size);
        saver(fds[1], first, rotate);
    }
    close(fds[1]);
    usleep((useconds_t)delay_us);
    kill(pid, SIGKILL);
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "the child ended on its own (status %d): it failed", st);
    while (read(fds[0], &step, sizeof step) == (ssize_t)sizeof step) last = step;
    close(fds[0]);
    return last;
}

static int family_members(void) { return tl_count_files(dir, "rot_", ".safetensors"); }

int main(void) {
    char path[512], latest[512], prev[512];
    uint64_t rng = (uint64_t)time(NULL);
    double t0, save_s;
    long span_us;
    int trial, newer = 0, same = 0, caught = 0;
    int64_t step = 1, last, got, num;
    snprintf(dir, sizeof dir, "%s/ckpt_fault_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir), "mkdtemp");
    printf("seed %llu (time)\n", (unsigned long long)rng);

    /* how long one save takes here, to spread the kills over whole saves (start, write, fsync,
       rename, directory sync) */
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    t0 = tl_now();
    CHECK_OK(save_step(path, 0, 0), NULL);
    save_s = tl_now() - t0;
    span_us = (long)(4e6 * save_s) + 2000;
    printf("one save: %.2f ms; kills at random delays in [0, %.1f ms]\n", save_s * 1e3, span_us / 1e3);

    for (trial = 0; trial < 20; trial++) {
        last = run_and_kill(step, 0, 0, NULL, NULL, (long)(tl_rand(&rng) % (uint64_t)span_us));
        got = verify(path);
        CHECK(got >= 0, "atomic trial %d: the checkpoint does not load after the kill: %s", trial, ddp_last_error(NULL));
        CHECK(got >= last && got <= last + 1, "atomic trial %d: file holds step %lld, the child had finished %lld", trial, (long long)got, (long long)last);
        if (got == last + 1 && got >= step) newer++;
        else same++;
        step = got + 1;
    }
    printf("atomic: 20 kills, every time the file loaded and verified (%d caught after a rename the child "
           "had not reported, %d at the last reported step)\n", newer, same);

    /* async (issue #21): the child saves with ddp_checkpoint_save_async, overwrites its tensors at once,
       then waits; kills at 20 delays spread evenly over four saves' time (staging, the background's
       write, fsync, rename, directory sync); the file must always be a whole earlier or newer step */
    use_async = 1;
    newer = same = 0;
    for (trial = 0; trial < 20; trial++) {
        last = run_and_kill(step, 0, 0, NULL, NULL, span_us * trial / 20);
        got = verify(path);
        CHECK(got >= 0, "async trial %d (kill at %.2f ms): the checkpoint does not load after the kill: %s", trial,
              span_us * trial / 20 / 1e3, ddp_last_error(NULL));
        CHECK(got >= last && got <= last + 1, "async trial %d: file holds step %lld, the child had finished %lld", trial, (long long)got, (long long)last);
        if (got == last + 1 && got >= step) newer++;
        else same++;
        step = got + 1;
    }
    use_async = 0;
    printf("async: 20 kills at delays 0 .. %.1f ms, every time the file loaded and verified (%d caught after a rename the "
           "child had not reported, %d at the last reported step)\n", span_us * 19 / 20 / 1e3, newer, same);

    snprintf(path, sizeof path, "%s/rot_*.safetensors", dir);
    for (trial = 0; trial < 10; trial++) {
        last = run_and_kill(step, 1, 0, NULL, NULL, (long)(tl_rand(&rng) % (uint64_t)span_us));
        CHECK_OK(ddp_checkpoint_latest(path, latest, sizeof latest, &num), NULL);
        if (last < step) { /* nothing finished in this trial: the previous family (if any) must stand */
            if (num < 0) continue;
        }
        got = verify(latest);
        CHECK(got >= 0, "rotation trial %d: newest %s does not load: %s", trial, latest, ddp_last_error(NULL));
        CHECK(got == num && got >= last && got <= last + 1, "rotation trial %d: newest is step %lld, the child had finished %lld", trial,
              (long long)got, (long long)last);
        snprintf(prev, sizeof prev, "%s/rot_%08lld.safetensors", dir, (long long)(num - 1));
        CHECK(access(prev, F_OK) != 0 || verify(prev) == num - 1, "rotation trial %d: %s does not load: %s", trial, prev, ddp_last_error(NULL));
        /* a save that returned has rotated, leaving 2; at most one more rename can follow it */
        CHECK(last < step || family_members() <= 3, "rotation trial %d: %d files kept with keep_last 2", trial, family_members());
        step = got + 1;
    }
    printf("rotation: 10 kills, the newest file and its predecessor always loaded and verified\n");

    /* self-check: a writer without tmp + fsync + rename is caught */
    {
        const unsigned char *img[2];
        size_t size[2];
        unsigned char *buf[2];
        int k;
        for (k = 0; k < 2; k++) {
            struct stat sb;
            FILE *f;
            snprintf(path, sizeof path, "%s/image%d.safetensors", dir, k);
            CHECK_OK(save_step(path, 1000 + k, 0), NULL);
            CHECK(stat(path, &sb) == 0, "stat");
            size[k] = (size_t)sb.st_size;
            buf[k] = (unsigned char *)malloc(size[k]);
            f = fopen(path, "rb");
            CHECK(f && fread(buf[k], 1, size[k], f) == size[k], "read image");
            fclose(f);
            img[k] = buf[k];
        }
        snprintf(path, sizeof path, "%s/naive.safetensors", dir);
        snprintf(prev, sizeof prev, "%s/image0.safetensors", dir);
        CHECK(rename(prev, path) == 0, "rename");
        for (trial = 0; trial < 20; trial++) {
            run_and_kill(0, 0, 1, img, size, (long)(tl_rand(&rng) % (uint64_t)span_us) + 500);
            got = verify(path);
            if (got < 0) {
                CHECK(strstr(ddp_last_error(NULL), "truncated") || strstr(ddp_last_error(NULL), "corrupt") ||
                          strstr(ddp_last_error(NULL), "shorter"),
                      "torn file refused for an unexpected reason: %s", ddp_last_error(NULL));
                caught++;
            }
        }
        free(buf[0]);
        free(buf[1]);
        printf("self-check: the naive writer left a torn file in %d of 20 kills, each refused with DDP_ERR_FORMAT\n", caught);
        CHECK(caught > 0, "the verification never caught the naive writer: the fault test cannot fail");
    }

    tl_rm_dir(dir);
    printf("fault test passed\n");
    return 0;
}
