/* tests/nccl/test_nccl_ft.c: fault tolerance on the nccl backend (src/nccl.c "fault tolerance", src/ft.c).
   Built by tests/test_nccl_harness.sh against the CPU harness's fake NCCL twice: playing NCCL 2.18 (a view's
   communicator is made anew: abort + re-init) and 2.28 (ncclCommRevoke on a failure, ncclCommShrink when a
   view only lost members); tests/test_nccl.sh builds it with nvcc against the real NCCL, and with 3 or more
   GPUs it runs there too.

   The ranks train a model of P floats whose weights and gradients are device memory, through the reducer
   on NCCL (device buckets) and ddp_ft_begin / ddp_ft_commit, the weights registered (ddp_ft_register on
   device memory: a joiner receives them through NCCL, CRC-checked on a host copy). Step s's global batch is
   the samples s*G .. s*G+G-1; in a view of W members, member r takes the positions j with j % W == r and
   says how many (ddp_reducer_set_local_samples), so the averaged gradient is the global batch's mean in
   every view. A member is SIGKILLed at a library kill point (DDP_FT_TEST_KILL); the parent checks, with its
   own arithmetic:
   - the victims die by SIGKILL, every other process exits 0;
   - the survivors' final weights are equal bit for bit, and within 1e-5 of a serial f64 replay of S steps
     (so no step was lost or applied twice);
   - which way the view's communicator was made (the fake's counters): shrunk where NCCL has
     ncclCommShrink and the view only lost members, made anew otherwise.
   Usage: test_nccl_ft all     every case (the harness; needs 4 devices)
          test_nccl_ft devices print the CUDA device count */
#include "../testlib.h"

#include <cuda_runtime_api.h>
#include <nccl.h> /* NCCL_VERSION_CODE; the harness's fake: its counters */

#define P 257
#define G 12 /* the global batch */
#define S 24 /* steps */
#define LR 0.25

static double target(int64_t i, size_t e) { return sin(0.011 * (double)i * (double)(e % 7 + 1) + 0.3 * (double)e); }

static const char *g_dir;

static void cu(cudaError_t e, const char *what) { CHECK(e == cudaSuccess, "%s: %s", what, cudaGetErrorString(e)); }

static int worker(int rank, int n, void *arg) {
    ddp_init_desc desc;
    ddp_group *g;
    ddp_reducer_desc rd;
    ddp_reducer *r;
    ddp_ft_step st;
    float w[P], gr[P], *w_dev = NULL, *g_dev = NULL;
    const char *log_id = getenv("FT_TEST_LOG");
    char path[512];
    unsigned long long shrinks = 0, inits = 0;
    size_t e;
    ddp_result res;
    FILE *f;
    (void)n, (void)arg;
    memset(&desc, 0, sizeof desc);
    desc.backend = "nccl";
    desc.fault_tolerant = 1;
    desc.suspect_seconds = 1;
    desc.timeout_seconds = 30;
    CHECK_OK(ddp_init(&desc, &g), NULL);
    CHECK(strcmp(ddp_backend_name(g), "nccl") == 0, "backend %s", ddp_backend_name(g));
    cu(cudaMalloc((void **)&w_dev, sizeof w), "cudaMalloc");
    cu(cudaMalloc((void **)&g_dev, sizeof gr), "cudaMalloc");
    for (e = 0; e < P; e++) w[e] = getenv("DDP_FT_JOIN") ? 0.0f : (float)(0.1 * (double)e / P); /* a joiner: zeros */
    cu(cudaMemcpy(w_dev, w, sizeof w, cudaMemcpyHostToDevice), "cudaMemcpy");
    memset(&rd, 0, sizeof rd);
    CHECK_OK(ddp_reducer_create(g, &rd, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w_dev, g_dev, P, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_ft_register(g, "w", w_dev, sizeof w), g);
    memset(&st, 0, sizeof st);
    for (;;) {
        int got = 0, j;
        CHECK_OK(ddp_ft_begin(g, &st), g);
        if (st.step == S) break;
        usleep(20000); /* compute: a joiner can come in mid-run */
        cu(cudaMemcpy(w, w_dev, sizeof w, cudaMemcpyDeviceToHost), "cudaMemcpy"); /* (a joiner's arrived here) */
        for (e = 0; e < P; e++) {
            double sum = 0;
            for (j = st.rank, got = 0; j < G; j += st.world_size, got++)
                sum += (double)w[e] - target((int64_t)st.step * G + j, e);
            gr[e] = got ? (float)(sum / got) : 0.0f;
        }
        cu(cudaMemcpy(g_dev, gr, sizeof gr, cudaMemcpyHostToDevice), "cudaMemcpy");
        CHECK_OK(ddp_reducer_begin_backward(r), g);
        res = ddp_reducer_set_local_samples(r, (size_t)got);
        if (res == DDP_SUCCESS) res = ddp_reducer_grad_ready(r, 0);
        if (res == DDP_SUCCESS) res = ddp_reducer_end_backward(r);
        if (res == DDP_ERR_VIEW_CHANGED) continue; /* the pass is void: redo the step in the new view */
        CHECK(res == DDP_SUCCESS, "rank %d: the pass failed: %s", rank, ddp_last_error(g));
        res = ddp_ft_commit(g, &st);
        if (res == DDP_ERR_VIEW_CHANGED) continue;
        CHECK(res == DDP_SUCCESS, "rank %d: ddp_ft_commit: %s", rank, ddp_last_error(g));
        cu(cudaMemcpy(gr, g_dev, sizeof gr, cudaMemcpyDeviceToHost), "cudaMemcpy");
        for (e = 0; e < P; e++) w[e] -= (float)LR * gr[e];
        cu(cudaMemcpy(w_dev, w, sizeof w, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
#ifdef DDP_HARNESS_NCCL
    shrinks = ddp_harness::nccl_stats.shrinks;
    inits = ddp_harness::nccl_stats.inits - shrinks;
#endif
    snprintf(path, sizeof path, "%s/weights.%s", g_dir, log_id ? log_id : getenv("RANK"));
    CHECK((f = fopen(path, "wb")) != NULL, "open %s", path);
    CHECK(fwrite(w, sizeof(float), P, f) == P && fprintf(f, "%llu %llu", inits, shrinks) > 0, "write %s", path);
    fclose(f);
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    cu(cudaFree(w_dev), "cudaFree");
    cu(cudaFree(g_dev), "cudaFree");
    return 0;
}

/* The serial replay: S steps of SGD on each global batch's mean gradient, in f64. */
static void reference(double *w) {
    size_t e;
    int s, j;
    for (e = 0; e < P; e++) w[e] = (float)(0.1 * (double)e / P);
    for (s = 0; s < S; s++)
        for (e = 0; e < P; e++) {
            double sum = 0;
            for (j = 0; j < G; j++) sum += w[e] - target((int64_t)s * G + j, e);
            w[e] -= LR * (sum / G);
        }
}

/* One case: n ranks, DDP_FT_TEST_KILL = spec (victims: the ranks named in it), and with join a replacement
   started once the first victim is gone. shrink_views: view changes that only lost members. */
static void run_case(int n, const char *spec, int join, int shrink_views, const char *what) {
    pid_t pids[8];
    int status[8], codes[8], i, total = n + (join ? 1 : 0), victim[8] = {0}, first_victim = -1, ref_ok = 0;
    char port[16], path[600];
    double ref[P], t0 = tl_now();
    float first[P];
    const char *c;
    for (c = spec; *c; c++)
        if ((c == spec || c[-1] == ',') && *c >= '0' && *c <= '9') {
            victim[*c - '0'] = 1;
            if (first_victim < 0) first_victim = *c - '0';
        }
    reference(ref);
    snprintf(port, sizeof port, "%d", tl_free_port());
    setenv("DDP_FT_TEST_KILL", spec, 1);
    for (i = 0; i < total; i++) {
        snprintf(path, sizeof path, "%s/weights.%d", g_dir, i);
        unlink(path);
        status[i] = -1;
    }
    for (i = 0; i < n; i++) pids[i] = tl_fork_rank(i, n, port, worker, NULL);
    if (join) { /* as ddprun --ft --max-restarts: the replacement starts once the victim is gone (its device) */
        char id[8];
        CHECK(waitpid(pids[first_victim], &status[first_victim], 0) == pids[first_victim], "waitpid");
        snprintf(id, sizeof id, "%d", n);
        setenv("DDP_FT_JOIN", "1", 1);
        setenv("FT_TEST_LOG", id, 1);
        unsetenv("DDP_FT_TEST_KILL");
        pids[n] = tl_fork_rank(first_victim, n, port, worker, NULL);
        unsetenv("DDP_FT_JOIN");
        unsetenv("FT_TEST_LOG");
    }
    tl_wait_ranks(pids, total, tl_now() + 120, status, NULL);
    unsetenv("DDP_FT_TEST_KILL");
    for (i = 0; i < total; i++) {
        codes[i] = tl_exit_code(status[i]);
        CHECK(codes[i] == (i < n && victim[i] ? -SIGKILL : 0), "%s: process %d ended with %d", what, i, codes[i]);
    }
    for (i = 0; i < total; i++) {
        float w[P];
        unsigned long long inits = 0, shrinks = 0;
        FILE *f;
        size_t e;
        if (i < n && victim[i]) continue;
        snprintf(path, sizeof path, "%s/weights.%d", g_dir, i);
        CHECK((f = fopen(path, "rb")) != NULL, "%s: process %d wrote no weights", what, i);
        CHECK(fread(w, sizeof(float), P, f) == P && fscanf(f, "%llu %llu", &inits, &shrinks) == 2, "%s: read %s", what, path);
        fclose(f);
        if (!ref_ok) {
            memcpy(first, w, sizeof w);
            for (e = 0; e < P; e++)
                CHECK(fabs(w[e] - ref[e]) <= 1e-5, "%s: weight %zu is %.9g, the serial replay's %.9g", what, e, w[e], ref[e]);
            ref_ok = 1;
        }
        CHECK(memcmp(w, first, sizeof w) == 0, "%s: process %d's weights differ from the first survivor's", what, i);
#ifdef DDP_HARNESS_NCCL
        if (i < n) { /* the members' communicators: the first, then one per view change */
            unsigned long long want_shrinks = NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0) ? (unsigned long long)shrink_views : 0;
            CHECK(shrinks == want_shrinks, "%s: process %d shrank its communicator %llu times, not %llu (NCCL %d)", what, i,
                  shrinks, want_shrinks, NCCL_VERSION_CODE);
            CHECK(inits >= 1 + (unsigned long long)join + (unsigned long long)shrink_views - want_shrinks,
                  "%s: process %d made %llu communicators", what, i, inits);
        }
#else
        (void)shrink_views;
#endif
    }
    printf("ok: %s (%.1f s)\n", what, tl_now() - t0);
    fflush(stdout);
}

int main(int argc, char **argv) {
    char dir[] = "/tmp/ddp_nccl_ft_XXXXXX";
    int count = 0;
    if (argc >= 2 && strcmp(argv[1], "devices") == 0) {
        if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
        printf("%d\n", count);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "all") != 0) {
        fprintf(stderr, "usage: test_nccl_ft all | devices\n");
        return 2;
    }
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    g_dir = dir;
    setenv("DDP_LOG_LEVEL", "error", 0); /* the survivors' view-change warnings are expected */
    run_case(3, "2:3:bucket", 0, 1, "3 ranks, member 2 killed mid-bucket at step 3");
    run_case(3, "0:4:vote", 0, 1, "3 ranks, the coordinator (member 0) killed in the vote of step 4");
    run_case(4, "1:2:begin,3:6:bucket", 0, 2, "4 ranks, member 1 killed at step 2 and member 3 at step 6");
    run_case(3, "1:3:begin", 1, 1, "3 ranks, member 1 killed at step 3 and replaced by a joiner (device state)");
    tl_rm_dir(dir);
    printf("nccl fault tolerance (NCCL %d): every case ok\n", NCCL_VERSION_CODE);
    return 0;
}
