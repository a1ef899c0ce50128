/* tests/nccl/test_nccl.c: the nccl backend (built and run by tests/test_nccl.sh, which compiles this file
   with -DDDP_CUDA and links it with ddp_cuda.o, -lcudart and -lnccl).

   Usage: test_nccl devices      print how many CUDA devices are visible (0 when none): run it in its own
                                 process, since a process that touched CUDA must not fork CUDA users
          test_nccl nogpu        on a machine without a GPU: backend "nccl" fails on every rank with the
                                 "no CUDA device visible ... use the cpu backend" message; the default
                                 backend is cpu; ddp_set_stream refuses a cpu group
          test_nccl gpu N        N ranks (one GPU each) run every collective and dtype on device memory
                                 through NCCL, checked against host math written here; also async work,
                                 a host-memory call on the nccl group, and a mismatch that must fail */
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
    }
    CHECK_OK(ddp_barrier(g), g);
    /* host memory on an nccl group: the cpu path */
    CHECK_OK(ddp_all_reduce(g, host, 4, DDP_I32, DDP_SUM), g);
    for (k = 0; k < 4; k++) CHECK(host[k] == (k + 1) * n, "host all_reduce [%d] = %d", k, host[k]);
    if (n > 1) { /* a mismatch: rank 0 reduces 4 elements, the others 5; an error everywhere, not a hang */
        void *x = dev_with(5 * sizeof(float), NULL);
        ddp_result r = ddp_all_reduce(g, x, rank == 0 ? 4 : 5, DDP_F32, DDP_SUM);
        CHECK(r == DDP_ERR_MISMATCH, "mismatched all_reduce returned %d: %s", (int)r, ddp_last_error(g));
        CHECK(strstr(ddp_last_error(g), "all_reduce"), "message: %s", ddp_last_error(g));
        CU(cudaFree(x));
    }
    ddp_destroy(g);
    CU(cudaStreamDestroy(stream));
    if (rank == 0) printf("nccl: %d rank(s): every collective and dtype matched host math\n", n);
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
    CHECK(ddp_set_stream(g, NULL) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(g), "nccl"),
          "ddp_set_stream on a cpu group: %s", ddp_last_error(g));
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
        printf("default backend: cpu; ddp_set_stream refused on it\n");
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "gpu") == 0) {
        int n = atoi(argv[2]);
        CHECK(n >= 1 && n <= 64, "bad rank count %s", argv[2]);
        CHECK(tl_run_ranks(n, rank_gpu, NULL, 300) == 0, "nccl with %d rank(s)", n);
        return 0;
    }
    fprintf(stderr, "usage: test_nccl devices | nogpu | gpu N\n");
    return 2;
}
