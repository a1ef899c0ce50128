/* tests/nccl/test_nccl.c: the nccl backend (built and run by tests/test_nccl.sh, which compiles this file
   with -DDDP_CUDA and links it with ddp_cuda.o, -lcudart and -lnccl).

   Usage: test_nccl devices      print how many CUDA devices are visible (0 when none): run it in its own
                                 process, since a process that touched CUDA must not fork CUDA users
          test_nccl nogpu        on a machine without a GPU: backend "nccl" fails on every rank with the
                                 "no CUDA device visible ... use the cpu backend" message; the default
                                 backend is cpu; ddp_set_stream takes a cpu group's stream
          test_nccl check        no GPU needed: the nccl backend's call check (ddp__nccl_check) on cpu
                                 groups of 3 ranks and host memory: a rank with no buffers agrees with
                                 either side; all_to_all_v's split sizes and all_gather_v's counts that
                                 differ are DDP_ERR_MISMATCH on every rank, with the TCP backend's message
          test_nccl gpu N        N ranks (one GPU each) run every collective and dtype on device memory
                                 through NCCL, checked against host math written here (gather, scatter,
                                 all_to_all, all_to_all_v, all_gather_v too, uneven and zero sizes, in
                                 place, async); also a host-memory call on the nccl group, and mismatches
                                 (count, split sizes, counts) that must fail on every rank */
#include "../testlib.h"

#include <cuda_runtime_api.h>

/* ---- test data: small integers, exact in every dtype and every reduction here ---- */

static double value(int rank, size_t i, ddp_op op) {
    if (op == DDP_PROD) { /* 1, -1, 2: products stay small */
        static const double v[3] = {1, -1, 2};
        return v[(i + (size_t)rank) % 3];
    }
    return (double)((i * 7 + (size_t)rank * 3) % 7) - 3.0; /* -3 .. 3 */
}

static int is_unsigned(ddp_dtype t) { return t == DDP_U8; }

static void put(void *p, ddp_dtype t, size_t i, double v) {
    switch (t) {
    case DDP_F32: ((float *)p)[i] = (float)v; break;
    case DDP_F64: ((double *)p)[i] = v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16((float)v); break; /* exact: small integers */
    case DDP_BF16: ((uint16_t *)p)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I8: ((int8_t *)p)[i] = (int8_t)v; break;
    case DDP_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case DDP_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((int64_t *)p)[i] = (int64_t)v; break;
    }
}

static double get(const void *p, ddp_dtype t, size_t i) {
    switch (t) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return ((const double *)p)[i];
    case DDP_F16: return tl_decode_f16(((const uint16_t *)p)[i]); /* the test's own decoders */
    case DDP_BF16: return tl_decode_bf16(((const uint16_t *)p)[i]);
    case DDP_I8: return ((const int8_t *)p)[i];
    case DDP_U8: return ((const uint8_t *)p)[i];
    case DDP_I32: return ((const int32_t *)p)[i];
    default: return (double)((const int64_t *)p)[i];
    }
}

static double input(int rank, size_t i, ddp_dtype t, ddp_op op) {
    double v = value(rank, i, op);
    return is_unsigned(t) ? (op == DDP_PROD ? (v < 0 ? 3 : v) : v + 3) : v;
}

/* op over ranks 0..n-1 of input(r, i), as the collective must compute it */
static double expect(int n, size_t i, ddp_dtype t, ddp_op op) {
    double acc = input(0, i, t, op);
    int r;
    for (r = 1; r < n; r++) {
        double v = input(r, i, t, op);
        if (op == DDP_SUM || op == DDP_AVG) acc += v;
        else if (op == DDP_PROD) acc *= v;
        else if (op == DDP_MIN) acc = v < acc ? v : acc;
        else acc = v > acc ? v : acc;
    }
    if (op == DDP_AVG) acc = ddp__dtype_is_float(t) ? acc / n : (double)((long long)acc / n); /* ints truncate */
    return acc;
}

#define CU(call) CHECK((call) == cudaSuccess, "%s failed", #call)

static void *dev_with(size_t bytes, const void *host) {
    void *d = NULL;
    CU(cudaMalloc(&d, bytes ? bytes : 1));
    if (host && bytes) CU(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
enum { N_DTYPES = 8, COUNT = 1000 };

static void check_all_reduce(ddp_group *g, ddp_dtype t, ddp_op op, int async) {
    int rank = ddp_rank(g), n = ddp_world_size(g);
    size_t es = ddp_dtype_size(t), i;
    unsigned char *h = (unsigned char *)malloc(COUNT * es);
    void *d;
    for (i = 0; i < COUNT; i++) put(h, t, i, input(rank, i, t, op));
    d = dev_with(COUNT * es, h);
    if (async) {
        ddp_work *w = NULL;
        CHECK_OK(ddp_all_reduce_async(g, d, COUNT, t, op, &w), g);
        CHECK_OK(ddp_wait(w), g);
    } else {
        CHECK_OK(ddp_all_reduce(g, d, COUNT, t, op), g);
    }
    CU(cudaMemcpy(h, d, COUNT * es, cudaMemcpyDeviceToHost));
    for (i = 0; i < COUNT; i++)
        CHECK(get(h, t, i) == expect(n, i, t, op), "all_reduce %s %s%s [%zu]: %g, expected %g", ddp_dtype_name(t),
              ddp_op_name(op), async ? " async" : "", i, get(h, t, i), expect(n, i, t, op));
    CU(cudaFree(d));
    free(h);
}

static void check_rooted(ddp_group *g, ddp_dtype t) {
    int rank = ddp_rank(g), n = ddp_world_size(g), root = n - 1;
    size_t es = ddp_dtype_size(t), i;
    unsigned char *h = (unsigned char *)malloc(COUNT * es);
    void *d;
    /* broadcast from the last rank */
    for (i = 0; i < COUNT; i++) put(h, t, i, input(rank, i, t, DDP_SUM));
    d = dev_with(COUNT * es, h);
    CHECK_OK(ddp_broadcast(g, d, COUNT, t, root), g);
    CU(cudaMemcpy(h, d, COUNT * es, cudaMemcpyDeviceToHost));
    for (i = 0; i < COUNT; i++) CHECK(get(h, t, i) == input(root, i, t, DDP_SUM), "broadcast %s [%zu]", ddp_dtype_name(t), i);
    /* reduce (MAX) to the last rank; the others keep their input */
    for (i = 0; i < COUNT; i++) put(h, t, i, input(rank, i, t, DDP_MAX));
    CU(cudaMemcpy(d, h, COUNT * es, cudaMemcpyHostToDevice));
    CHECK_OK(ddp_reduce(g, d, COUNT, t, DDP_MAX, root), g);
    CU(cudaMemcpy(h, d, COUNT * es, cudaMemcpyDeviceToHost));
    for (i = 0; i < COUNT; i++) {
        double want = rank == root ? expect(n, i, t, DDP_MAX) : input(rank, i, t, DDP_MAX);
        CHECK(get(h, t, i) == want, "reduce %s [%zu]: %g, expected %g", ddp_dtype_name(t), i, get(h, t, i), want);
    }
    CU(cudaFree(d));
    free(h);
}

static void check_gather_scatter(ddp_group *g, ddp_dtype t) {
    int rank = ddp_rank(g), n = ddp_world_size(g), r;
    size_t es = ddp_dtype_size(t), i, cpr = 37, total = cpr * (size_t)n;
    unsigned char *h = (unsigned char *)malloc(total * es);
    void *send, *recv;
    /* all_gather: rank r contributes input(r, i) */
    for (i = 0; i < cpr; i++) put(h, t, i, input(rank, i, t, DDP_SUM));
    send = dev_with(cpr * es, h);
    recv = dev_with(total * es, NULL);
    CHECK_OK(ddp_all_gather(g, send, recv, cpr, t), g);
    CU(cudaMemcpy(h, recv, total * es, cudaMemcpyDeviceToHost));
    for (r = 0; r < n; r++)
        for (i = 0; i < cpr; i++)
            CHECK(get(h, t, (size_t)r * cpr + i) == input(r, i, t, DDP_SUM), "all_gather %s [%d][%zu]", ddp_dtype_name(t), r, i);
    CU(cudaFree(send));
    /* reduce_scatter (SUM) with send == recv (allowed by ddp.h): slice `rank` of the sum */
    for (i = 0; i < total; i++) put(h, t, i, input(rank, i, t, DDP_SUM));
    CU(cudaMemcpy(recv, h, total * es, cudaMemcpyHostToDevice));
    CHECK_OK(ddp_reduce_scatter(g, recv, recv, cpr, t, DDP_SUM), g);
    CU(cudaMemcpy(h, recv, cpr * es, cudaMemcpyDeviceToHost));
    for (i = 0; i < cpr; i++) {
        double want = expect(n, (size_t)rank * cpr + i, t, DDP_SUM);
        CHECK(get(h, t, i) == want, "reduce_scatter %s [%zu]: %g, expected %g", ddp_dtype_name(t), i, get(h, t, i), want);
    }
    CU(cudaFree(recv));
    free(h);
}


/* ---- gather, scatter, all_to_all, all_to_all_v, all_gather_v: blocks moved, not reduced ---- */

/* Element i of the block rank `from` sends rank `to`: -5 .. 5 (0 .. 10 unsigned), exact in every dtype. */
static double moved(ddp_dtype t, int from, int to, size_t i) {
    double v = (double)((from * 5 + to * 3 + (int)(i % 11)) % 11) - 5;
    return is_unsigned(t) ? v + 5 : v;
}

/* all_to_all_v's split size from `from` to `to`: 0 .. 3 (zeros included); variant 1: the last rank
   sends and receives nothing (a rank with no buffers at all). */
static size_t split(int from, int to, int n, int variant) {
    if (variant == 1 && n > 1 && (from == n - 1 || to == n - 1)) return 0;
    return (size_t)((from + 2 * to + 1) % 4);
}

/* Fill count elements of a host buffer with moved(from, to, i), i from `first`. */
static void fill(void *h, ddp_dtype t, size_t at, size_t count, int from, int to) {
    size_t i;
    for (i = 0; i < count; i++) put(h, t, at + i, moved(t, from, to, i));
}

/* Compare count elements at `at` of a host copy with moved(from, to, i). */
static void expect_block(const char *what, const void *h, ddp_dtype t, size_t at, size_t count, int from, int to) {
    size_t i;
    for (i = 0; i < count; i++)
        CHECK(get(h, t, at + i) == moved(t, from, to, i), "%s %s: block from rank %d to rank %d [%zu] = %g, expected %g",
              what, ddp_dtype_name(t), from, to, i, get(h, t, at + i), moved(t, from, to, i));
}

static void *to_host(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    if (bytes) CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* After a call that may have been async (*w set by it: read here, after the call). */
static void wait_or_sync(ddp_group *g, ddp_work **w, ddp_result r) {
    CHECK_OK(r, g);
    if (*w) CHECK_OK(ddp_wait(*w), g);
}

static void check_gather_scatter_rooted(ddp_group *g, ddp_dtype t, int async) {
    int rank = ddp_rank(g), n = ddp_world_size(g), root = n - 1, r;
    size_t es = ddp_dtype_size(t), cpr = 29, total = cpr * (size_t)n;
    unsigned char *h = (unsigned char *)malloc(total * es);
    void *send, *recv = NULL, *back;
    ddp_work *w = NULL;
    const char *what = async ? "gather (async)" : "gather";
    /* gather to the last rank: recv only there (NULL elsewhere) */
    fill(h, t, 0, cpr, rank, root);
    send = dev_with(cpr * es, h);
    if (rank == root) recv = dev_with(total * es, NULL);
    wait_or_sync(g, &w, async ? ddp_gather_async(g, send, recv, cpr, t, root, &w) : ddp_gather(g, send, recv, cpr, t, root));
    if (rank == root) {
        back = to_host(recv, total * es);
        for (r = 0; r < n; r++) expect_block(what, back, t, (size_t)r * cpr, cpr, r, root);
        free(back);
    }
    CU(cudaFree(send));
    /* gather in place on the root (send = recv + root*cpr): the same result */
    if (rank == root) {
        CU(cudaMemset(recv, 0, total * es));
        CU(cudaMemcpy((char *)recv + (size_t)root * cpr * es, h, cpr * es, cudaMemcpyHostToDevice));
        send = (char *)recv + (size_t)root * cpr * es;
    } else {
        send = dev_with(cpr * es, h);
    }
    CHECK_OK(ddp_gather(g, send, recv, cpr, t, root), g);
    if (rank == root) {
        back = to_host(recv, total * es);
        for (r = 0; r < n; r++) expect_block("gather (in place)", back, t, (size_t)r * cpr, cpr, r, root);
        free(back);
        CU(cudaFree(recv));
    } else {
        CU(cudaFree(send));
    }
    /* scatter from rank 0: send only there, block r = moved(0, r) */
    send = NULL;
    if (rank == 0) {
        for (r = 0; r < n; r++) fill(h, t, (size_t)r * cpr, cpr, 0, r);
        send = dev_with(total * es, h);
    }
    recv = dev_with(cpr * es, NULL);
    w = NULL;
    wait_or_sync(g, &w, async ? ddp_scatter_async(g, send, recv, cpr, t, 0, &w) : ddp_scatter(g, send, recv, cpr, t, 0));
    back = to_host(recv, cpr * es);
    expect_block(async ? "scatter (async)" : "scatter", back, t, 0, cpr, 0, rank);
    free(back);
    CU(cudaFree(recv));
    if (send) CU(cudaFree(send));
    free(h);
}

static void check_all_to_all(ddp_group *g, ddp_dtype t, int in_place, int async) {
    int rank = ddp_rank(g), n = ddp_world_size(g), p;
    size_t es = ddp_dtype_size(t), cpr = 23, total = cpr * (size_t)n;
    unsigned char *h = (unsigned char *)malloc(total * es);
    void *send, *recv, *back;
    ddp_work *w = NULL;
    for (p = 0; p < n; p++) fill(h, t, (size_t)p * cpr, cpr, rank, p);
    send = dev_with(total * es, h);
    recv = in_place ? send : dev_with(total * es, NULL);
    wait_or_sync(g, &w, async ? ddp_all_to_all_async(g, send, recv, cpr, t, &w) : ddp_all_to_all(g, send, recv, cpr, t));
    back = to_host(recv, total * es);
    for (p = 0; p < n; p++)
        expect_block(in_place ? "all_to_all (in place)" : async ? "all_to_all (async)" : "all_to_all", back, t,
                     (size_t)p * cpr, cpr, p, rank);
    free(back);
    if (!in_place) CU(cudaFree(recv));
    CU(cudaFree(send));
    free(h);
}

static void check_all_to_all_v(ddp_group *g, ddp_dtype t, int variant, int async) {
    int rank = ddp_rank(g), n = ddp_world_size(g), p;
    size_t es = ddp_dtype_size(t), *sc = (size_t *)calloc((size_t)n, sizeof *sc), *rc = (size_t *)calloc((size_t)n, sizeof *rc);
    size_t st = 0, rt = 0, at;
    unsigned char *h;
    void *send = NULL, *recv = NULL, *back;
    ddp_work *w = NULL;
    for (p = 0; p < n; p++) sc[p] = split(rank, p, n, variant), rc[p] = split(p, rank, n, variant), st += sc[p], rt += rc[p];
    h = (unsigned char *)malloc((st + 1) * es);
    for (p = 0, at = 0; p < n; at += sc[p], p++) fill(h, t, at, sc[p], rank, p);
    if (st) send = dev_with(st * es, h); /* a rank with nothing to send passes NULL */
    if (rt) recv = dev_with(rt * es, NULL);
    wait_or_sync(g, &w, async ? ddp_all_to_all_v_async(g, send, sc, recv, rc, t, &w) : ddp_all_to_all_v(g, send, sc, recv, rc, t));
    back = to_host(recv, rt * es);
    for (p = 0, at = 0; p < n; at += rc[p], p++)
        expect_block(async ? "all_to_all_v (async)" : "all_to_all_v", back, t, at, rc[p], p, rank);
    free(back);
    if (send) CU(cudaFree(send));
    if (recv) CU(cudaFree(recv));
    free(h);
    free(sc);
    free(rc);
}

/* all_gather_v: rank r gives 3r+1 elements (rank 0: none when n > 1); in place: send inside recv. */
static void check_all_gather_v(ddp_group *g, ddp_dtype t, int in_place, int async) {
    int rank = ddp_rank(g), n = ddp_world_size(g), p;
    size_t es = ddp_dtype_size(t), *counts = (size_t *)calloc((size_t)n, sizeof *counts), total = 0, mine_at = 0, at;
    unsigned char *h;
    void *send, *recv, *back;
    ddp_work *w = NULL;
    for (p = 0; p < n; p++) {
        counts[p] = p == 0 && n > 1 ? 0 : (size_t)(3 * p + 1);
        if (p < rank) mine_at += counts[p];
        total += counts[p];
    }
    h = (unsigned char *)malloc((total + 1) * es);
    fill(h, t, 0, counts[rank], rank, 0);
    recv = dev_with(total * es, NULL);
    if (in_place) {
        send = (char *)recv + mine_at * es;
        if (counts[rank]) CU(cudaMemcpy(send, h, counts[rank] * es, cudaMemcpyHostToDevice));
    } else {
        send = counts[rank] ? dev_with(counts[rank] * es, h) : NULL;
    }
    wait_or_sync(g, &w, async ? ddp_all_gather_v_async(g, send, counts[rank], recv, counts, t, &w)
                             : ddp_all_gather_v(g, send, counts[rank], recv, counts, t));
    back = to_host(recv, total * es);
    for (p = 0, at = 0; p < n; at += counts[p], p++)
        expect_block(in_place ? "all_gather_v (in place)" : async ? "all_gather_v (async)" : "all_gather_v", back, t, at,
                     counts[p], p, 0);
    free(back);
    if (!in_place && send) CU(cudaFree(send));
    CU(cudaFree(recv));
    free(h);
    free(counts);
}

static void check_moves(ddp_group *g, ddp_dtype t) {
    int async;
    for (async = 0; async < 2; async++) {
        check_gather_scatter_rooted(g, t, async);
        check_all_to_all(g, t, 0, async);
        check_all_to_all_v(g, t, 0, async);
        check_all_to_all_v(g, t, 1, async);
        check_all_gather_v(g, t, 0, async);
    }
    check_all_to_all(g, t, 1, 0);
    check_all_to_all(g, t, 1, 1);
    check_all_gather_v(g, t, 1, 0);
}

/* Before a mismatched call: every rank has returned from its calls before it, met outside ddp.h (a
   counter in memory mapped before tl_run_ranks forks; main zeroes it before each run). With 3 or more
   ranks, two ranks could otherwise find the mismatch while a third still finishes the call before it
   (its peers done with it, its data on the way): their ABORT fails that call there (the group broke,
   as ddp.h does for a lost peer too), e.g. ddp_init's last agreement, instead of the mismatched one. */
static volatile int *met;

static void meet(int n) {
    double deadline = tl_now() + 60;
    __sync_fetch_and_add(met, 1);
    while (*met < n) {
        CHECK(tl_now() < deadline, "the ranks did not all reach the mismatched call within 60 s");
        usleep(1000);
    }
}

/* Sizes per rank that differ (device memory): DDP_ERR_MISMATCH on every rank, the same message as
   the TCP backend's, and nothing queued on NCCL (no hang). what: "split" or "counts". */
static int rank_gpu_sizes_differ(int rank, int n, void *arg) {
    const char *what = (const char *)arg;
    ddp_init_desc d;
    ddp_group *g = NULL;
    size_t c[8] = {2, 2, 2, 2, 2, 2, 2, 2}, rc[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    void *send, *recv;
    ddp_result r;
    memset(&d, 0, sizeof d);
    d.backend = "nccl";
    d.timeout_seconds = 60;
    CHECK(n >= 2 && n <= 8, "2 to 8 ranks");
    CHECK_OK(ddp_init(&d, &g), NULL); /* sets this rank's device: allocate after it */
    send = dev_with(64 * sizeof(float), NULL);
    recv = dev_with(64 * sizeof(float), NULL);
    meet(n);
    if (strcmp(what, "split") == 0) { /* rank 0 sends rank 1 three elements; rank 1 expects two */
        if (rank == 0) c[1] = 3;
        r = ddp_all_to_all_v(g, send, c, recv, rc, DDP_F32);
        CHECK(r == DDP_ERR_MISMATCH && strstr(ddp_last_error(g), "split sizes differ") &&
                  strstr(ddp_last_error(g), "rank 0 sends 3 elements to rank 1") &&
                  strstr(ddp_last_error(g), "rank 1 expects 2 from rank 0"),
              "all_to_all_v with split sizes that differ returned %d: %s", (int)r, ddp_last_error(g));
    } else { /* rank 1 swaps counts[0] and counts[1]: the same total, other blocks */
        if (rank == 1) c[0] = 1, c[1] = 3;
        r = ddp_all_gather_v(g, send, c[rank], recv, c, DDP_F32);
        CHECK(r == DDP_ERR_MISMATCH && strstr(ddp_last_error(g), "counts differ") &&
                  strstr(ddp_last_error(g), "rank 0 passes counts[0] = 2 while rank 1 passes counts[0] = 1"),
              "all_gather_v with counts that differ returned %d: %s", (int)r, ddp_last_error(g));
    }
    ddp_destroy(g);
    CU(cudaFree(send));
    CU(cudaFree(recv));
    return 0;
}

static int rank_gpu(int rank, int n, void *arg) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    cudaStream_t stream;
    int k, j, host[4] = {1, 2, 3, 4};
    ddp_op ops[5] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
    (void)arg;
    memset(&d, 0, sizeof d);
    d.backend = "nccl";
    d.timeout_seconds = 60;
    CHECK_OK(ddp_init(&d, &g), NULL);
    CHECK(strcmp(ddp_backend_name(g), "nccl") == 0, "backend %s", ddp_backend_name(g));
    CU(cudaStreamCreate(&stream));
    CHECK_OK(ddp_set_stream(g, stream), g);
    for (k = 0; k < N_DTYPES; k++) {
        for (j = 0; j < 5; j++) check_all_reduce(g, dtypes[k], ops[j], 0);
        check_all_reduce(g, dtypes[k], DDP_SUM, 1);
        check_rooted(g, dtypes[k]);
        check_gather_scatter(g, dtypes[k]);
        check_moves(g, dtypes[k]);
    }
    CHECK_OK(ddp_barrier(g), g);
    /* host memory on an nccl group: the cpu path */
    CHECK_OK(ddp_all_reduce(g, host, 4, DDP_I32, DDP_SUM), g);
    for (k = 0; k < 4; k++) CHECK(host[k] == (k + 1) * n, "host all_reduce [%d] = %d", k, host[k]);
    if (n > 1) { /* a mismatch: rank 0 reduces 4 elements, the others 5; an error everywhere, not a hang */
        void *x = dev_with(5 * sizeof(float), NULL);
        ddp_result r;
        meet(n);
        r = ddp_all_reduce(g, x, rank == 0 ? 4 : 5, DDP_F32, DDP_SUM);
        CHECK(r == DDP_ERR_MISMATCH, "mismatched all_reduce returned %d: %s", (int)r, ddp_last_error(g));
        CHECK(strstr(ddp_last_error(g), "all_reduce"), "message: %s", ddp_last_error(g));
        CU(cudaFree(x));
    }
    ddp_destroy(g);
    CU(cudaStreamDestroy(stream));
    if (rank == 0) printf("nccl: %d rank(s): every collective and dtype matched host math\n", n);
    return 0;
}

/* ---- the call check without a GPU: ddp__nccl_check on cpu groups, host memory ---- */

/* One rank's check of call k (fingerprinted here, as collectives.c does): the result, *where the side.
   A failure breaks the group with the message (g->broken_msg; ddp_last_error is the public calls'). */
static ddp_result run_check(ddp_group *g, const ddp__call *k, int *where) {
    ddp__coll c;
    memset(&c, 0, sizeof c);
    ddp__fingerprint(g, k, &c, 1);
    *where = ddp__nccl_where(g, k);
    return ddp__nccl_check(g, k, &c, where);
}

static int rank_check(int rank, int n, void *arg) {
    const char *what = (const char *)arg;
    ddp_group *g = NULL;
    float send[16] = {0}, recv[16] = {0};
    size_t sc[3] = {1, 1, 0}, rc[3] = {1, 1, 0}, c[3] = {2, 2, 2};
    ddp__call k;
    ddp_result r;
    int where = -1;
    CHECK(n == 3, "3 ranks");
    CHECK_OK(ddp_init(NULL, &g), NULL);
    if (strcmp(what, "none") == 0) {
        /* rank 2 has nothing to send or receive (NULL buffers): its vote agrees with the host side */
        if (rank == 2) sc[0] = sc[1] = rc[0] = rc[1] = 0;
        k = ddp__v_call(DDP__ALL_TO_ALL_V, rank == 2 ? NULL : send, sc, rank == 2 ? NULL : recv, rc, 0, DDP_F32);
        CHECK(ddp__nccl_where(g, &k) == (rank == 2 ? DDP__NCCL_NONE : DDP__NCCL_HOST), "rank %d's vote: %d", rank,
              ddp__nccl_where(g, &k));
        CHECK_OK(run_check(g, &k, &where), g);
        CHECK(where == DDP__NCCL_HOST, "all_to_all_v with an empty rank: side %d, not host", where);
        /* gather: recv exists on the root alone */
        k = ddp__make_call(DDP__GATHER, send, rank == 1 ? recv : NULL, 4, DDP_F32, DDP_SUM, 1);
        CHECK_OK(run_check(g, &k, &where), g);
        CHECK(where == DDP__NCCL_HOST, "gather: side %d, not host", where);
        /* nothing anywhere (count 0): the host side, which only agrees */
        k = ddp__make_call(DDP__ALL_TO_ALL, NULL, NULL, 0, DDP_F32, DDP_SUM, -1);
        CHECK(ddp__nccl_where(g, &k) == DDP__NCCL_NONE, "all_to_all of 0: vote %d", ddp__nccl_where(g, &k));
        CHECK_OK(run_check(g, &k, &where), g);
        CHECK(where == DDP__NCCL_HOST, "all_to_all of 0: side %d, not host", where);
    } else if (strcmp(what, "split") == 0) { /* rank 0 sends rank 1 two elements; rank 1 expects one */
        if (rank == 0) sc[1] = 2;
        k = ddp__v_call(DDP__ALL_TO_ALL_V, send, sc, recv, rc, 0, DDP_F32);
        r = run_check(g, &k, &where);
        CHECK(r == DDP_ERR_MISMATCH && strstr(g->broken_msg, "split sizes differ in all_to_all_v") &&
                  strstr(g->broken_msg, "rank 0 sends 2 elements to rank 1 (its send_counts[1]) while rank 1 "
                                            "expects 1 from rank 0 (its recv_counts[0])"),
              "rank %d: split sizes that differ gave %d: %s", rank, (int)r, g->broken_msg);
    } else { /* rank 2 passes counts {1, 3, 2}, the others {2, 2, 2}: the same total */
        if (rank == 2) c[0] = 1, c[1] = 3;
        k = ddp__v_call(DDP__ALL_GATHER_V, send, NULL, recv, c, c[rank], DDP_F32);
        r = run_check(g, &k, &where);
        CHECK(r == DDP_ERR_MISMATCH && strstr(g->broken_msg, "counts differ in all_gather_v") &&
                  strstr(g->broken_msg, "rank 0 passes counts[0] = 2 while rank 2 passes counts[0] = 1"),
              "rank %d: counts that differ gave %d: %s", rank, (int)r, g->broken_msg);
    }
    ddp_destroy(g);
    return 0;
}

/* ---- without a GPU ---- */

static int rank_no_gpu(int rank, int n, void *arg) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    ddp_result r;
    const char *via = (const char *)arg;
    (void)n;
    memset(&d, 0, sizeof d);
    d.timeout_seconds = 30;
    if (strcmp(via, "env") == 0) setenv("DDP_BACKEND", "nccl", 1);
    else d.backend = "nccl";
    r = ddp_init(&d, &g);
    CHECK(r == DDP_ERR_UNSUPPORTED && g == NULL, "backend nccl without a GPU returned %d (%s)", (int)r, ddp_last_error(NULL));
    CHECK(strstr(ddp_last_error(NULL), "no CUDA device visible") && strstr(ddp_last_error(NULL), "use the cpu backend"),
          "unclear message: %s", ddp_last_error(NULL));
    if (rank == 0) printf("backend nccl (%s) on rank 0: %s\n", via, ddp_last_error(NULL));
    return 0;
}

static int rank_default(int rank, int n, void *arg) {
    ddp_group *g = NULL;
    int x = rank + 1;
    (void)arg;
    unsetenv("DDP_BACKEND");
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK(strcmp(ddp_backend_name(g), "cpu") == 0, "the default backend is %s", ddp_backend_name(g));
    CHECK_OK(ddp_set_stream(g, NULL), g); /* a cpu group's stream stages device buffers (src/devbuf.c) */
    CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_I32, DDP_SUM), g);
    CHECK(x == n * (n + 1) / 2, "all_reduce on the default backend: %d", x);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(int argc, char **argv) {
    int count = 0;
    if (argc >= 2 && strcmp(argv[1], "devices") == 0) {
        if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
        printf("%d\n", count);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "nogpu") == 0) {
        CHECK(tl_run_ranks(2, rank_no_gpu, (void *)"desc", 60) == 0, "backend nccl (descriptor) without a GPU");
        CHECK(tl_run_ranks(2, rank_no_gpu, (void *)"env", 60) == 0, "DDP_BACKEND=nccl without a GPU");
        CHECK(tl_run_ranks(2, rank_default, NULL, 60) == 0, "the default backend");
        printf("default backend: cpu; ddp_set_stream accepted on it (the stream that stages device buffers)\n");
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "check") == 0) {
        CHECK(tl_run_ranks(3, rank_check, (void *)"none", 60) == 0, "a rank with no buffers");
        CHECK(tl_run_ranks(3, rank_check, (void *)"split", 60) == 0, "all_to_all_v split sizes that differ");
        CHECK(tl_run_ranks(3, rank_check, (void *)"counts", 60) == 0, "all_gather_v counts that differ");
        printf("call check: empty ranks agree; split sizes and counts that differ fail every rank\n");
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "gpu") == 0) {
        int n = atoi(argv[2]);
        CHECK(n >= 1 && n <= 64, "bad rank count %s", argv[2]);
        met = (volatile int *)mmap(NULL, sizeof(int), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        CHECK(met != (volatile int *)MAP_FAILED, "mmap of the ranks' meeting counter");
        *met = 0;
        CHECK(tl_run_ranks(n, rank_gpu, NULL, 300) == 0, "nccl with %d rank(s)", n);
        if (n >= 2) {
            *met = 0;
            CHECK(tl_run_ranks(n, rank_gpu_sizes_differ, (void *)"split", 120) == 0, "all_to_all_v split sizes that differ");
            *met = 0;
            CHECK(tl_run_ranks(n, rank_gpu_sizes_differ, (void *)"counts", 120) == 0, "all_gather_v counts that differ");
        }
        return 0;
    }
    fprintf(stderr, "usage: test_nccl devices | nogpu | check | gpu N\n");
    return 2;
}
