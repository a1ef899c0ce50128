/* Many ranks on one machine (issue #25), every rank a process, far more ranks than cores:
   - 300 ranks over TCP: init, small and large all_reduce, broadcast, all_gather, barrier, each result
     checked on every rank against serial math; and the sockets each rank holds afterwards, which must
     stay O(log N), within 4 ceil(log2 N) + 4 (connections are made on first use, src/link.c), not the
     N - 1 of a full mesh.
   - 128 ranks, one killed in the middle of the collectives: every other rank fails naming it, within
     10 s (the notice floods the connections: no rank watches N - 1 sockets).
   - 64 ranks with the open-file limit (soft and hard) of every rank but 0 at 40: below the 68 a full
     mesh needed, above what sparse connections need.
   Sizes can be set: test_scale [RANKS_BIG [RANKS_KILL [RANKS_LIMIT]]]. */
#include "testlib.h"

#include <dirent.h>
#include <sys/resource.h>

static int log2_ceil(int n) {
    int k = 0;
    while ((1 << k) < n) k++;
    return k;
}

/* Sockets this process holds (store client, listener, connections to other ranks; rank 0 also its
   store server's). */
static int count_sockets(void) {
    char path[64], target[64];
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) {
        ssize_t k;
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/fd/%.40s", e->d_name);
        k = readlink(path, target, sizeof target - 1);
        if (k > 0 && (target[k] = '\0', strncmp(target, "socket:", 7) == 0)) n++;
    }
    closedir(d);
    return n;
}

static ddp_group *join(double timeout) { return tl_init(timeout, DDP_LOG_DEFAULT, NULL); }

/* The collectives at scale, each checked against what serial math gives. */
static int many_ranks(int rank, int n, void *arg) {
    enum { SMALL = 5, LARGE = 20000 }; /* LARGE floats: 80 KB, above recursive doubling's limit: the ring */
    ddp_group *g;
    int64_t small[SMALL], gathered_one = 0, *gathered, counts[2];
    float *large = (float *)malloc(LARGE * sizeof(float));
    double bcast[3];
    int i, sockets, bound = 4 * log2_ceil(n) + 4;
    (void)arg;
    setenv("DDP_TRANSPORT", "tcp", 1);
    g = join(240);
    gathered = (int64_t *)calloc((size_t)n, sizeof *gathered);
    CHECK(large && gathered, "out of memory");
    for (i = 0; i < SMALL; i++) small[i] = (int64_t)rank * 1000 + i;
    CHECK_OK(ddp_all_reduce(g, small, SMALL, DDP_I64, DDP_SUM), g);
    for (i = 0; i < SMALL; i++)
        CHECK(small[i] == (int64_t)n * (n - 1) / 2 * 1000 + (int64_t)n * i, "rank %d: small all_reduce[%d] = %lld", rank, i,
              (long long)small[i]);
    for (i = 0; i < LARGE; i++) large[i] = (float)((rank + i) % 7); /* small integers: the sum is exact in f32 */
    CHECK_OK(ddp_all_reduce(g, large, LARGE, DDP_F32, DDP_SUM), g);
    for (i = 0; i < LARGE; i++) {
        int r, want = 0;
        if (i % 997 != 0 && i != LARGE - 1) continue; /* a sample of positions, the whole sum each */
        for (r = 0; r < n; r++) want += (r + i) % 7;
        CHECK(large[i] == (float)want, "rank %d: large all_reduce[%d] = %g, want %d", rank, i, (double)large[i], want);
    }
    for (i = 0; i < 3; i++) bcast[i] = rank == n - 1 ? 0.5 * i + 7 : -1;
    CHECK_OK(ddp_broadcast(g, bcast, 3, DDP_F64, n - 1), g);
    for (i = 0; i < 3; i++) CHECK(bcast[i] == 0.5 * i + 7, "rank %d: broadcast[%d] = %g", rank, i, bcast[i]);
    gathered_one = (int64_t)rank * rank;
    CHECK_OK(ddp_all_gather(g, &gathered_one, gathered, 1, DDP_I64), g);
    for (i = 0; i < n; i++) CHECK(gathered[i] == (int64_t)i * i, "rank %d: all_gather[%d] = %lld", rank, i, (long long)gathered[i]);
    CHECK_OK(ddp_barrier(g), g);

    sockets = count_sockets();
    if (rank != 0) /* rank 0 also holds a store connection per rank */
        CHECK(sockets >= 3 && sockets <= bound, "rank %d of %d holds %d sockets; connections made on first use keep it "
              "within 4 ceil(log2 N) + 4 = %d (a full mesh would be %d)", rank, n, sockets, bound, n);
    counts[0] = rank == 0 ? 0 : sockets, counts[1] = counts[0];
    CHECK_OK(ddp_all_reduce(g, &counts[0], 1, DDP_I64, DDP_SUM), g);
    CHECK_OK(ddp_all_reduce(g, &counts[1], 1, DDP_I64, DDP_MAX), g);
    if (rank == 0)
        printf("%d ranks: sockets per rank (but rank 0) mean %.1f, max %lld (bound %d); rank 0 holds %d\n", n,
               (double)counts[0] / (n - 1), (long long)counts[1], bound, sockets);
    CHECK_OK(ddp_destroy(g), NULL);
    free(large);
    free(gathered);
    return 0;
}

/* One rank exits in the middle of a run of all_reduces; the others fail promptly, naming it. */
static int one_rank_killed(int rank, int n, void *arg) {
    int victim = n * 3 / 5, step;
    ddp_group *g;
    double start = 0;
    ddp_result r = DDP_SUCCESS;
    float x[8] = {0};
    (void)arg;
    setenv("DDP_TRANSPORT", "tcp", 1);
    g = join(120);
    for (step = 0; step < 50 && r == DDP_SUCCESS; step++) { /* fails at step 19 or 20 */
        if (step == 20 && rank == victim) _exit(3); /* no goodbye, no ABORT: its sockets just close */
        if (step == 19) start = tl_now(); /* the exit can also fail step 19 on a rank still reading it */
        r = ddp_all_reduce(g, x, 8, DDP_F32, DDP_SUM);
    }
    CHECK(r == DDP_ERR_PEER_LOST, "rank %d: expected DDP_ERR_PEER_LOST after rank %d exited, got %s: %s", rank, victim,
          ddp_result_string(r), ddp_last_error(g));
    {
        char want[32];
        snprintf(want, sizeof want, "lost rank %d ", victim);
        CHECK(strstr(ddp_last_error(g), want) != NULL, "rank %d: the message does not name rank %d: %s", rank, victim,
              ddp_last_error(g));
    }
    CHECK(tl_now() - start < 10.0, "rank %d: took %.1f s to notice rank %d exit", rank, tl_now() - start, victim);
    ddp_destroy(g);
    return 0;
}

/* Every rank but 0 under `ulimit -n 40` (soft and hard): the full mesh needed N + 4 = 68 here. */
static int low_open_file_limit(int rank, int n, void *arg) {
    ddp_group *g;
    float x[4] = {1, 2, 3, 4};
    (void)arg;
    setenv("DDP_TRANSPORT", "tcp", 1);
    if (rank != 0) {
        struct rlimit rl;
        rl.rlim_cur = rl.rlim_max = 40;
        CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit: %s", strerror(errno));
    }
    g = join(120);
    CHECK_OK(ddp_all_reduce(g, x, 4, DDP_F32, DDP_SUM), g);
    CHECK(x[3] == 4.0f * n, "rank %d: all_reduce gave %g", rank, (double)x[3]);
    CHECK_OK(ddp_barrier(g), g);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(int argc, char **argv) {
    int big = argc > 1 ? atoi(argv[1]) : 300, kill = argc > 2 ? atoi(argv[2]) : 128, limit = argc > 3 ? atoi(argv[3]) : 64;
    double t;
    int failed = 0;
    t = tl_now();
    failed |= tl_run_ranks(big, many_ranks, NULL, 300);
    printf("collectives at %d ranks: %s (%.1f s)\n", big, failed ? "FAILED" : "ok", tl_now() - t);
    t = tl_now();
    {
        int i, bad = 0, victim = kill * 3 / 5, codes[TL_MAX_RANKS];
        tl_run_ranks_status(kill, one_rank_killed, NULL, 200, codes);
        for (i = 0; i < kill; i++)
            if (codes[i] != (i == victim ? 3 : 0)) bad = 1;
        if (bad) failed = 1, printf("a rank killed at %d ranks: FAILED\n", kill);
        else printf("a rank killed at %d ranks: ok (%.1f s)\n", kill, tl_now() - t);
    }
    t = tl_now();
    if (tl_run_ranks(limit, low_open_file_limit, NULL, 200)) failed = 1, printf("ulimit -n 40 at %d ranks: FAILED\n", limit);
    else printf("ulimit -n 40 at %d ranks: ok (%.1f s)\n", limit, tl_now() - t);
    return failed;
}
