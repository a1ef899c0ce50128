/* tests/test_cuda_devbuf.cpp: device buffers on the cpu backend (src/devbuf.c), without a GPU. Built by
   tests/test_cuda_devbuf.sh with a host C++17 compiler against the CUDA harness (tests/cuda_harness),
   whose memory API keeps "device" memory PROT_NONE to the host (an unstaged access is a SIGSEGV) and
   runs async copies only when something synchronises (a missing wait reads stale memory). This file
   is the implementation (DDP_IMPLEMENTATION with DDP_CUDA) and ddp_cuda.cu's harness build supplies the
   staging glue; the NCCL glue, absent from that build, is stubbed below (backend nccl is not asked for).

   2, 3 and 4 ranks, over shared memory and over TCP, with "device" buffers on a stream set by
   ddp_set_stream: every collective (all_reduce, broadcast, reduce, all_gather, reduce_scatter, gather,
   scatter, all_to_all, all_to_all_v, all_gather_v, send/recv), every dtype where it applies, uneven
   counts and split sizes with zeros, the in-place forms, host and device buffers mixed within a rank
   and across ranks, the async variants, calls back to back without a read in between, a subgroup (its
   stream is the parent's), and isend/irecv refusing device memory; against serial references computed
   here. The reducer on device parameters and gradients is bit for bit equal to one on host buffers (plain,
   flat, bf16, find_unused; zero_grad; ZeRO-1: 3 optimizer steps on the shards + gather_params), and
   ZeRO-2 and grad_stats on device parameters are refused by finalize; FSDP (zero_stage 3) with device
   parameters (gathered units and unit gradients on the device, shards on the host) equals a host model. The copies must go through pinned memory on the
   group's stream (the harness counts them); a copy refused on one rank fails every rank. SAN=1 (the
   script's): under ASan+UBSan. */
#define DDP_CUDA
#include "testlib.h"

#include <cuda_runtime.h>

#include "nccl_absent.h" /* the NCCL glue, never reached here */
#include "device_ranks.h" /* device_rank_begin / device_rank_end */

/* ---- values and buffers ---- */

static const ddp_dtype all_dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
#define NDTYPES (int)(sizeof all_dtypes / sizeof all_dtypes[0])

/* Rank r's element i of a buffer labelled salt: a small integer (0..12), exact in every dtype and in
   sums of 4 ranks (also int8, f16 and bf16); written and read with testlib.h's tl_store_value / tl_load_value. */
static double val(int rank, size_t i, int salt) { return (double)((rank * 7 + (int)(i % 1000) * 3 + salt) % 13); }

static cudaStream_t stream;

static void *dev(size_t bytes) {
    void *p = NULL;
    CHECK(cudaMalloc(&p, bytes) == cudaSuccess, "cudaMalloc(%zu)", bytes);
    return p;
}

/* A device buffer of count elements of t, element i = val(rank, i, salt); and one of NaN-like garbage. */
static void *dev_filled(ddp_dtype t, size_t count, int rank, int salt) {
    size_t bytes = (count ? count : 1) * ddp_dtype_size(t), i;
    void *h = malloc(bytes), *d = dev(bytes);
    for (i = 0; i < count; i++) tl_store_value(h, i, t, val(rank, i, salt));
    CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy to the device");
    free(h);
    return d;
}
static void *dev_garbage(ddp_dtype t, size_t count) {
    size_t bytes = (count ? count : 1) * ddp_dtype_size(t);
    void *d = dev(bytes);
    CHECK(cudaMemset(d, 0x5a, bytes) == cudaSuccess, "cudaMemset");
    return d;
}

/* The host's copy of a device buffer, read as a program would: a copy on the group's stream, then wait. */
static void *host_of(const void *d, ddp_dtype t, size_t count) {
    size_t bytes = (count ? count : 1) * ddp_dtype_size(t);
    void *pinned = NULL, *h = malloc(bytes);
    CHECK(cudaMallocHost(&pinned, bytes) == cudaSuccess, "cudaMallocHost");
    CHECK(cudaMemcpyAsync(pinned, d, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess, "cudaMemcpyAsync");
    CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "cudaStreamSynchronize");
    memcpy(h, pinned, bytes);
    cudaFreeHost(pinned);
    return h;
}

/* expect(i) is element i's value; what names the call in messages. */
template <typename F>
static void check_dev(const char *what, const void *d, ddp_dtype t, size_t count, F expect, double tol = 0) {
    void *h = host_of(d, t, count);
    size_t i;
    for (i = 0; i < count; i++) {
        double got = tl_load_value(h, i, t), want = expect(i);
        CHECK(fabs(got - want) <= tol * fabs(want), "%s (%s): element %zu is %g, expected %g", what, ddp_dtype_name(t), i,
              got, want);
    }
    free(h);
}

static double reduce_ref(ddp_op op, int n, size_t i, int salt) {
    double acc = val(0, i, salt);
    int r;
    for (r = 1; r < n; r++) {
        double v = val(r, i, salt);
        acc = op == DDP_MAX ? (v > acc ? v : acc) : op == DDP_MIN ? (v < acc ? v : acc) : acc + v;
    }
    return op == DDP_AVG ? acc / n : acc;
}


/* ---- the collectives ---- */

static void t_all_reduce(ddp_group *g, int rank, int n) {
    static const ddp_op ops[] = {DDP_SUM, DDP_MAX, DDP_MIN, DDP_AVG};
    for (int d = 0; d < NDTYPES; d++)
        for (int o = 0; o < 4; o++) {
            ddp_dtype t = all_dtypes[d];
            ddp_op op = ops[o];
            size_t count = 1001 + (size_t)d * 17; /* uneven over any world size */
            int salt = d * 4 + o;
            if (op == DDP_AVG && !(t == DDP_F32 || t == DDP_F64)) continue;
            void *buf = dev_filled(t, count, rank, salt);
            CHECK_OK(ddp_all_reduce(g, buf, count, t, op), g);
            check_dev("all_reduce", buf, t, count, [&](size_t i) { return reduce_ref(op, n, i, salt); },
                      op == DDP_AVG ? 1e-6 : 0);
            cudaFree(buf);
        }
}

static void t_broadcast_reduce(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        int root = d % n, salt = 40 + d;
        size_t count = 257 + (size_t)d;
        void *buf = dev_filled(t, count, rank, salt);
        CHECK_OK(ddp_broadcast(g, buf, count, t, root), g);
        check_dev("broadcast", buf, t, count, [&](size_t i) { return val(root, i, salt); });
        cudaFree(buf);
    }
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        int root = (d + 1) % n, salt = 50 + d;
        ddp_op op = d % 2 ? DDP_MAX : DDP_SUM;
        size_t count = 99;
        void *buf = dev_filled(t, count, rank, salt);
        CHECK_OK(ddp_reduce(g, buf, count, t, op, root), g);
        if (rank == root) check_dev("reduce", buf, t, count, [&](size_t i) { return reduce_ref(op, n, i, salt); });
        cudaFree(buf);
    }
}

static void t_all_gather(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++)
        for (int in_place = 0; in_place < 2; in_place++) {
            ddp_dtype t = all_dtypes[d];
            size_t count = 67, es = ddp_dtype_size(t);
            int salt = 60 + d;
            void *recv = dev_garbage(t, count * (size_t)n), *send;
            if (in_place) { /* this rank's block of recv holds its data */
                void *mine = dev_filled(t, count, rank, salt);
                send = (char *)recv + (size_t)rank * count * es;
                CHECK(cudaMemcpy((void *)send, mine, count * es, cudaMemcpyDeviceToDevice) == cudaSuccess, "d2d");
                cudaFree(mine);
            } else {
                send = dev_filled(t, count, rank, salt);
            }
            CHECK_OK(ddp_all_gather(g, send, recv, count, t), g);
            check_dev(in_place ? "all_gather in place" : "all_gather", recv, t, count * (size_t)n,
                      [&](size_t i) { return val((int)(i / count), i % count, salt); });
            if (!in_place) cudaFree(send);
            cudaFree(recv);
        }
}

static void t_reduce_scatter(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        ddp_op op = d % 3 == 0 ? DDP_MIN : DDP_SUM;
        size_t count = 45 + (size_t)d;
        int salt = 70 + d;
        void *send = dev_filled(t, count * (size_t)n, rank, salt), *recv = dev_garbage(t, count);
        CHECK_OK(ddp_reduce_scatter(g, send, recv, count, t, op), g);
        check_dev("reduce_scatter", recv, t, count,
                  [&](size_t i) { return reduce_ref(op, n, (size_t)rank * count + i, salt); });
        cudaFree(send);
        cudaFree(recv);
    }
}

static void t_gather_scatter(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t count = 33, es = ddp_dtype_size(t);
        int root = d % n, salt = 80 + d, in_place = d % 2;
        void *recv = rank == root ? dev_garbage(t, count * (size_t)n) : NULL, *send;
        if (in_place && rank == root) {
            void *mine = dev_filled(t, count, rank, salt);
            send = (char *)recv + (size_t)root * count * es;
            CHECK(cudaMemcpy(send, mine, count * es, cudaMemcpyDeviceToDevice) == cudaSuccess, "d2d");
            cudaFree(mine);
        } else {
            send = dev_filled(t, count, rank, salt);
        }
        CHECK_OK(ddp_gather(g, send, recv, count, t, root), g);
        if (rank == root)
            check_dev("gather", recv, t, count * (size_t)n, [&](size_t i) { return val((int)(i / count), i % count, salt); });
        if (!(in_place && rank == root)) cudaFree(send);
        if (recv) cudaFree(recv);
    }
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t count = 31;
        int root = (n - 1 + d) % n, salt = 90 + d;
        void *send = rank == root ? dev_filled(t, count * (size_t)n, rank, salt) : NULL, *recv = dev_garbage(t, count);
        CHECK_OK(ddp_scatter(g, send, recv, count, t, root), g);
        check_dev("scatter", recv, t, count, [&](size_t i) { return val(root, (size_t)rank * count + i, salt); });
        if (send) cudaFree(send);
        cudaFree(recv);
    }
}

static void t_all_to_all(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t count = 11;
        int salt = 100 + d, in_place = d % 2;
        /* rank r's block p (for rank p) holds val(r, p * count + j) */
        void *send = dev_filled(t, count * (size_t)n, rank, salt), *recv = in_place ? send : dev_garbage(t, count * (size_t)n);
        CHECK_OK(ddp_all_to_all(g, send, recv, count, t), g);
        check_dev(in_place ? "all_to_all in place" : "all_to_all", recv, t, count * (size_t)n,
                  [&](size_t i) { return val((int)(i / count), (size_t)rank * count + i % count, salt); });
        if (!in_place) cudaFree(recv);
        cudaFree(send);
    }
}

/* all_to_all_v: rank r sends (r + 2p) % 4 elements to rank p (zeros among them); block values
   val(r, j, salt + p). */
static size_t a2av(int from, int to) { return (size_t)((from + 2 * to) % 4); }

static void t_all_to_all_v(ddp_group *g, int rank, int n) {
    size_t sc[8], rc[8], soff[8], roff[8], stot = 0, rtot = 0;
    for (int p = 0; p < n; p++) {
        sc[p] = a2av(rank, p), rc[p] = a2av(p, rank);
        soff[p] = stot, roff[p] = rtot;
        stot += sc[p], rtot += rc[p];
    }
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t es = ddp_dtype_size(t);
        int salt = 110 + d;
        void *h = malloc((stot ? stot : 1) * es), *send = dev_garbage(t, stot), *recv = dev_garbage(t, rtot);
        for (int p = 0; p < n; p++)
            for (size_t j = 0; j < sc[p]; j++) tl_store_value(h, soff[p] + j, t, val(rank, j, salt + p));
        CHECK(cudaMemcpy(send, h, (stot ? stot : 1) * es, cudaMemcpyHostToDevice) == cudaSuccess, "h2d");
        free(h);
        CHECK_OK(ddp_all_to_all_v(g, send, sc, recv, rc, t), g);
        check_dev("all_to_all_v", recv, t, rtot, [&](size_t i) {
            int p = 0;
            while (p + 1 < n && roff[p + 1] <= i) p++;
            return val(p, i - roff[p], salt + rank);
        });
        cudaFree(send);
        cudaFree(recv);
    }
}

static void t_all_gather_v(ddp_group *g, int rank, int n) {
    size_t counts[8], off[8], tot = 0;
    for (int p = 0; p < n; p++) counts[p] = (size_t)(3 * p + 1) % 5, off[p] = tot, tot += counts[p]; /* 1, 4, 2, 0 */
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t es = ddp_dtype_size(t);
        int salt = 120 + d, in_place = d % 2;
        void *recv = dev_garbage(t, tot), *send;
        if (in_place) {
            void *mine = dev_filled(t, counts[rank], rank, salt);
            send = (char *)recv + off[rank] * es;
            if (counts[rank])
                CHECK(cudaMemcpy(send, mine, counts[rank] * es, cudaMemcpyDeviceToDevice) == cudaSuccess, "d2d");
            cudaFree(mine);
        } else {
            send = dev_filled(t, counts[rank], rank, salt);
        }
        CHECK_OK(ddp_all_gather_v(g, send, counts[rank], recv, counts, t), g);
        check_dev("all_gather_v", recv, t, tot, [&](size_t i) {
            int p = 0;
            while (p + 1 < n && off[p + 1] <= i) p++;
            return val(p, i - off[p], salt);
        });
        if (!in_place) cudaFree(send);
        cudaFree(recv);
    }
}

static void t_send_recv(ddp_group *g, int rank, int n) {
    for (int d = 0; d < NDTYPES; d++) {
        ddp_dtype t = all_dtypes[d];
        size_t count = 129 + (size_t)d;
        int salt = 130 + d, next = (rank + 1) % n, prev = (rank + n - 1) % n;
        void *out = dev_filled(t, count, rank, salt), *in = dev_garbage(t, count);
        if (rank == 0) { /* a ring: rank 0 sends first, everyone else receives first */
            CHECK_OK(ddp_send(g, out, count, t, next, d), g);
            CHECK_OK(ddp_recv(g, in, count, t, prev, d), g);
        } else {
            CHECK_OK(ddp_recv(g, in, count, t, prev, d), g);
            CHECK_OK(ddp_send(g, out, count, t, next, d), g);
        }
        check_dev("send/recv", in, t, count, [&](size_t i) { return val(prev, i, salt); });
        cudaFree(out);
        cudaFree(in);
    }
}

/* ---- around the calls ---- */

/* Host and device buffers together: within a call (host send, device recv and the reverse), across
   ranks (rank 0 host memory, the others device memory), and queued host work before a device call. */
static void t_mixed(ddp_group *g, int rank, int n) {
    size_t count = 50;
    float *hsend = (float *)malloc(count * sizeof *hsend), *hrecv = (float *)malloc(count * (size_t)n * sizeof *hrecv);
    void *drecv = dev_garbage(DDP_F32, count * (size_t)n), *dsend = dev_filled(DDP_F32, count, rank, 141);
    for (size_t i = 0; i < count; i++) hsend[i] = (float)val(rank, i, 140);
    CHECK_OK(ddp_all_gather(g, hsend, drecv, count, DDP_F32), g);
    check_dev("all_gather host -> device", drecv, DDP_F32, count * (size_t)n,
              [&](size_t i) { return val((int)(i / count), i % count, 140); });
    CHECK_OK(ddp_all_gather(g, dsend, hrecv, count, DDP_F32), g);
    for (size_t i = 0; i < count * (size_t)n; i++)
        CHECK(hrecv[i] == (float)val((int)(i / count), i % count, 141), "all_gather device -> host: element %zu", i);
    cudaFree(drecv);
    cudaFree(dsend);
    free(hsend);
    free(hrecv);

    { /* rank 0 host memory, the others device memory */
        int64_t host[40];
        void *buf = rank == 0 ? (void *)host : dev_filled(DDP_I64, 40, rank, 142);
        for (size_t i = 0; i < 40; i++) host[i] = (int64_t)val(rank, i, 142);
        CHECK_OK(ddp_all_reduce(g, buf, 40, DDP_I64, DDP_SUM), g);
        if (rank == 0) {
            for (size_t i = 0; i < 40; i++) CHECK(host[i] == (int64_t)reduce_ref(DDP_SUM, n, i, 142), "mixed ranks: %zu", i);
        } else {
            check_dev("all_reduce, rank 0 on host memory", buf, DDP_I64, 40, [&](size_t i) { return reduce_ref(DDP_SUM, n, i, 142); });
            cudaFree(buf);
        }
    }
}

/* The async variants: a device call returns completed work, after the host work queued before it. */
static void t_async(ddp_group *g, int rank, int n) {
    int32_t host[64];
    ddp_work *wh = NULL, *wd = NULL;
    void *d = dev_filled(DDP_F64, 300, rank, 150);
    for (int i = 0; i < 64; i++) host[i] = (int32_t)val(rank, (size_t)i, 151);
    CHECK_OK(ddp_all_reduce_async(g, host, 64, DDP_I32, DDP_MAX, &wh), g);
    CHECK_OK(ddp_all_reduce_async(g, d, 300, DDP_F64, DDP_SUM, &wd), g);
    CHECK(ddp_test(wd), "a staged async call returns complete work");
    CHECK_OK(ddp_wait(wd), g);
    CHECK_OK(ddp_wait(wh), g);
    check_dev("all_reduce_async", d, DDP_F64, 300, [&](size_t i) { return reduce_ref(DDP_SUM, n, i, 150); });
    for (int i = 0; i < 64; i++) CHECK(host[i] == (int32_t)reduce_ref(DDP_MAX, n, (size_t)i, 151), "host async %d", i);
    cudaFree(d);
}

/* Calls back to back with nothing read in between: the second call's host collective must not
   overwrite pinned memory that the first call's queued copy back to the device still reads. */
static void t_back_to_back(ddp_group *g, int rank, int n) {
    void *a = dev_filled(DDP_I32, 500, rank, 160), *b = dev_filled(DDP_I32, 500, rank, 161);
    void *c = dev_filled(DDP_F32, 700, rank, 162);
    CHECK_OK(ddp_broadcast(g, a, 500, DDP_I32, 0), g);
    CHECK_OK(ddp_broadcast(g, b, 500, DDP_I32, n - 1), g);
    CHECK_OK(ddp_all_reduce(g, c, 700, DDP_F32, DDP_SUM), g);
    check_dev("first broadcast", a, DDP_I32, 500, [&](size_t i) { return val(0, i, 160); });
    check_dev("second broadcast", b, DDP_I32, 500, [&](size_t i) { return val(n - 1, i, 161); });
    check_dev("all_reduce after them", c, DDP_F32, 700, [&](size_t i) { return reduce_ref(DDP_SUM, n, i, 162); });
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
}

/* A subgroup (every rank, in reverse order) stages on its parent's stream. */
static void t_subgroup(ddp_group *g, int rank, int n) {
    int ranks[8];
    ddp_group *sub = NULL;
    for (int i = 0; i < n; i++) ranks[i] = n - 1 - i;
    CHECK_OK(ddp_new_group(g, ranks, n, &sub), g);
    ddp_harness::memory_stats.last_stream = NULL;
    void *d = dev_filled(DDP_BF16, 77, rank, 170);
    CHECK_OK(ddp_all_reduce(sub, d, 77, DDP_BF16, DDP_SUM), sub);
    CHECK(ddp_harness::memory_stats.last_stream == stream, "the subgroup's copies went to stream %p, not the parent's %p",
          (void *)ddp_harness::memory_stats.last_stream, (void *)stream);
    check_dev("all_reduce on a subgroup", d, DDP_BF16, 77, [&](size_t i) { return reduce_ref(DDP_SUM, n, i, 170); });
    cudaFree(d);
    CHECK_OK(ddp_destroy(sub), NULL);
}

/* isend / irecv outlive the call: device memory is refused at once (nothing sent, the group fine). */
static void t_p2p_async_refused(ddp_group *g, int rank, int n) {
    void *d = dev_filled(DDP_F32, 8, rank, 180);
    ddp_work *w = NULL;
    CHECK(ddp_isend(g, d, 8, DDP_F32, (rank + 1) % n, 1, &w) == DDP_ERR_UNSUPPORTED && !w, "isend of device memory");
    CHECK(strstr(ddp_last_error(g), "device memory") && strstr(ddp_last_error(g), "ddp_send"), "isend's message: %s",
          ddp_last_error(g));
    CHECK(ddp_irecv(g, d, 8, DDP_F32, (rank + 1) % n, 1, &w) == DDP_ERR_UNSUPPORTED && !w, "irecv of device memory");
    cudaFree(d);
}

/* ---- the reducer with parameters and gradients in device memory ----
   Side by side on one group: a reducer over host buffers and one over device buffers holding the same
   values (parameters differ by rank, so finalize's broadcast from rank 0 shows); after finalize and each
   of 3 steps (the gradients set, ready in reverse order, averaged), the device buffers must equal the
   host ones bit for bit (the same host arithmetic runs on both: staging only moves the bytes). Modes:
   plain (f32, bf16 and f64 parameters, separate buffers), flat (two f32 gradients side by side in one
   device allocation: the bucket is that memory), bf16 compression, find_unused_parameters (one
   parameter without a gradient on odd ranks). Then zero_grad zeroes the device gradients. */
struct rmodel {
    void *param[3], *grad[3];
    char *flat; /* flat mode: the allocation holding grad[0] and grad[1] */
};
static const size_t r_count[3] = {1000, 333, 7};

static ddp_dtype r_dtype(int flat, int i) { return flat ? (i < 2 ? DDP_F32 : DDP_F64) : (i == 0 ? DDP_F32 : i == 1 ? DDP_BF16 : DDP_F64); }

static void r_fill(void *p, int device, ddp_dtype t, size_t count, int rank, int salt) {
    size_t bytes = count * ddp_dtype_size(t);
    void *h = calloc(1, bytes);
    for (size_t i = 0; i < count; i++) tl_store_value(h, i, t, val(rank, i, salt) - 6); /* -6..6 */
    if (device) CHECK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess, "h2d");
    else memcpy(p, h, bytes);
    free(h);
}

static void r_model(rmodel *m, int device, int flat, int rank) {
    memset(m, 0, sizeof *m);
    if (flat) {
        size_t bytes = (r_count[0] + r_count[1]) * sizeof(float);
        m->flat = device ? (char *)dev(bytes) : (char *)malloc(bytes);
    }
    for (int i = 0; i < 3; i++) {
        size_t bytes = r_count[i] * ddp_dtype_size(r_dtype(flat, i));
        m->param[i] = device ? dev(bytes) : malloc(bytes);
        m->grad[i] = flat && i < 2 ? (void *)(m->flat + (i ? r_count[0] * sizeof(float) : 0)) : device ? dev(bytes) : malloc(bytes);
        r_fill(m->param[i], device, r_dtype(flat, i), r_count[i], rank, 200 + i);
        r_fill(m->grad[i], device, r_dtype(flat, i), r_count[i], rank, 210 + i);
    }
}

static void r_free(rmodel *m, int device) {
    for (int i = 0; i < 3; i++) {
        if (device) cudaFree(m->param[i]);
        else free(m->param[i]);
        if (m->flat && i < 2) continue;
        if (device) cudaFree(m->grad[i]);
        else free(m->grad[i]);
    }
    if (m->flat) {
        if (device) cudaFree(m->flat);
        else free(m->flat);
    }
}

static void r_same(const char *what, const void *host, const void *d, size_t bytes) {
    char *h = (char *)host_of(d, DDP_U8, bytes);
    CHECK(memcmp(h, host, bytes) == 0, "reducer: %s differs between the host and the device model", what);
    free(h);
}

/* ZeRO's optimizer step, as a program runs it on its shards: param -= grad / 4 (exact in every dtype
   here), host or device memory alike (cudaMemcpyDefault: a kernel on a GPU). */
static void r_sgd(const ddp_shard *s, ddp_dtype t) {
    const size_t bytes = s->count * ddp_dtype_size(t);
    void *p = malloc(bytes), *gr = malloc(bytes);
    CHECK(cudaMemcpy(p, s->param_data, bytes, cudaMemcpyDefault) == cudaSuccess &&
              cudaMemcpy(gr, s->grad, bytes, cudaMemcpyDefault) == cudaSuccess, "reading a shard");
    for (size_t i = 0; i < s->count; i++) tl_store_value(p, i, t, tl_load_value(p, i, t) - tl_load_value(gr, i, t) / 4);
    CHECK(cudaMemcpy(s->param_data, p, bytes, cudaMemcpyDefault) == cudaSuccess, "writing a shard");
    free(p), free(gr);
}

/* ZeRO-1 (zero_stage 1) with device parameters and gradients: the shards point into the program's
   device memory; 3 steps of reduce-scatter, an optimizer step on the shards and gather_params give the
   host model's parameters bit for bit. ZeRO-2 is refused on device parameters (its gradient slices
   would be the reducer's host memory, which a device optimizer cannot read). */
static void t_reducer_zero(ddp_group *g, int rank) {
    static const char *names[3] = {"w", "b", "s"};
    rmodel hm, dm;
    ddp_reducer *red[2];
    ddp_reducer_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.zero_stage = 1;
    desc.bucket_cap_bytes = 2048; /* several buckets */
    r_model(&hm, 0, 0, rank);
    r_model(&dm, 1, 0, rank);
    for (int d = 0; d < 2; d++) {
        rmodel *m = d ? &dm : &hm;
        CHECK_OK(ddp_reducer_create(g, &desc, &red[d]), g);
        for (int i = 0; i < 3; i++) CHECK_OK(ddp_reducer_add_param(red[d], names[i], m->param[i], m->grad[i], r_count[i], r_dtype(0, i), NULL), g);
        CHECK_OK(ddp_reducer_finalize(red[d]), g);
    }
    for (int step = 0; step < 3; step++)
        for (int d = 0; d < 2; d++) {
            rmodel *m = d ? &dm : &hm;
            const ddp_shard *sh;
            CHECK_OK(ddp_reducer_begin_backward(red[d]), g);
            for (int i = 2; i >= 0; i--) {
                r_fill(m->grad[i], d, r_dtype(0, i), r_count[i], rank, 230 + 3 * step + i);
                CHECK_OK(ddp_reducer_grad_ready(red[d], i), g);
            }
            CHECK_OK(ddp_reducer_end_backward(red[d]), g);
            const int ns = ddp_reducer_shards(red[d], &sh);
            CHECK(ns >= 0, "ddp_reducer_shards: %s", ddp_last_error(g));
            for (int j = 0; j < ns; j++) {
                CHECK(!d || (ddp__cuda_is_device_pointer(sh[j].param_data) && ddp__cuda_is_device_pointer(sh[j].grad)),
                      "zero_stage 1: shard %d of the device model is not device memory", j);
                r_sgd(&sh[j], r_dtype(0, sh[j].param));
            }
            CHECK_OK(ddp_reducer_gather_params(red[d]), g);
            if (d)
                for (int i = 0; i < 3; i++)
                    r_same("a parameter after a ZeRO-1 step", hm.param[i], dm.param[i], r_count[i] * ddp_dtype_size(r_dtype(0, i)));
        }
    ddp_reducer_destroy(red[0]);
    ddp_reducer_destroy(red[1]);
    /* ZeRO-2: refused at finalize, on every rank alike (every rank's model is device memory) */
    desc.zero_stage = 2;
    CHECK_OK(ddp_reducer_create(g, &desc, &red[1]), g);
    for (int i = 0; i < 3; i++) CHECK_OK(ddp_reducer_add_param(red[1], names[i], dm.param[i], dm.grad[i], r_count[i], r_dtype(0, i), NULL), g);
    CHECK(ddp_reducer_finalize(red[1]) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(g), "zero_stage = 2") &&
              strstr(ddp_last_error(g), "device memory") && strstr(ddp_last_error(g), "\"w\""),
          "ZeRO-2 on device parameters with backend cpu: %s", ddp_last_error(g));
    ddp_reducer_destroy(red[1]);
    /* grad_stats (the norm and inf check on the host, in the pass back): refused alike, at every stage */
    desc.zero_stage = 1;
    desc.grad_stats = 1;
    CHECK_OK(ddp_reducer_create(g, &desc, &red[1]), g);
    for (int i = 0; i < 3; i++) CHECK_OK(ddp_reducer_add_param(red[1], names[i], dm.param[i], dm.grad[i], r_count[i], r_dtype(0, i), NULL), g);
    CHECK(ddp_reducer_finalize(red[1]) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(g), "grad_stats") &&
              strstr(ddp_last_error(g), "device memory") && strstr(ddp_last_error(g), "\"w\""),
          "grad_stats on device gradients with backend cpu: %s", ddp_last_error(g));
    ddp_reducer_destroy(red[1]);
    r_free(&hm, 0);
    r_free(&dm, 1);
}

/* FSDP (zero_stage 3) with the model in device memory on backend cpu (CPUOffloadPolicy's data flow): the
   gathered units and the unit gradient buffers are device memory, the master shards and gradient slices
   (ddp_reducer_shards) host memory. Three units (a KEEP one of 64 elements, 1000, 333), prefetch 1, two
   SGD steps on the shards: every gathered parameter and every shard equals a host model's run bit for bit. */
static void t_reducer_fsdp(ddp_group *g, int rank) {
    static const size_t count[3] = {64, 1000, 333};
    void *param[2][3];
    ddp_reducer *red[2];
    ddp_reducer_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.zero_stage = 3, desc.prefetch = 1;
    for (int d = 0; d < 2; d++) {
        CHECK_OK(ddp_reducer_create(g, &desc, &red[d]), g);
        for (int u = 0; u < 3; u++) {
            char name[8] = {'u', (char)('0' + u), 0};
            param[d][u] = d ? dev(count[u] * 4) : malloc(count[u] * 4);
            r_fill(param[d][u], d, DDP_F32, count[u], rank, 240 + u);
            CHECK(ddp_fsdp_unit(red[d], name, u ? 0 : DDP_FSDP_KEEP) == u, "unit %d: %s", u, ddp_last_error(g));
            name[0] = 'w';
            CHECK_OK(ddp_reducer_add_param(red[d], name, param[d][u], NULL, count[u], DDP_F32, NULL), g);
        }
        CHECK_OK(ddp_reducer_finalize(red[d]), g);
    }
    for (int step = 0; step <= 2; step++) {
        for (int d = 0; d < 2; d++) /* forward: every unit gathered */
            for (int u = 0; u < 3; u++) CHECK_OK(ddp_fsdp_wait(red[d], u), g);
        for (int u = 0; u < 3; u++) {
            CHECK(ddp__cuda_is_device_pointer(ddp_fsdp_param(red[1], u)) == 1, "unit %d gathered on the host", u);
            r_same("a gathered unit", ddp_fsdp_param(red[0], u), ddp_fsdp_param(red[1], u), count[u] * 4);
        }
        for (int d = 0; d < 2; d++) CHECK_OK(ddp_fsdp_release(red[d], 1), g); /* the last stays for backward */
        if (step == 2) break;
        for (int d = 0; d < 2; d++) {
            const ddp_shard *sh;
            CHECK_OK(ddp_reducer_begin_backward(red[d]), g);
            for (int u = 2; u >= 0; u--) {
                void *gr = ddp_fsdp_grad(red[d], u);
                CHECK(gr && (d == 0) != (ddp__cuda_is_device_pointer(gr) == 1), "unit %d's gradient buffer", u);
                r_fill(gr, d, DDP_F32, count[u], rank, 250 + 3 * step + u);
                CHECK_OK(ddp_fsdp_grads_ready(red[d], u), g);
                CHECK_OK(ddp_fsdp_release(red[d], u), g);
            }
            CHECK_OK(ddp_reducer_end_backward(red[d]), g);
            const int ns = ddp_reducer_shards(red[d], &sh);
            for (int j = 0; j < ns; j++) {
                CHECK(!ddp__cuda_is_device_pointer(sh[j].param_data) && !ddp__cuda_is_device_pointer(sh[j].grad),
                      "zero_stage 3: shard %d is not host memory", j);
                r_sgd(&sh[j], DDP_F32);
            }
        }
    }
    for (int d = 0; d < 2; d++) {
        ddp_reducer_destroy(red[d]);
        for (int u = 0; u < 3; u++) d ? (void)cudaFree(param[d][u]) : free(param[d][u]);
    }
}

static void t_reducer(ddp_group *g, int rank, int n) {
    static const char *names[3] = {"w", "b", "s"};
    (void)n;
    for (int mode = 0; mode < 4; mode++) { /* plain, flat, bf16 compression, find_unused */
        int flat = mode == 1;
        rmodel hm, dm;
        ddp_reducer *red[2];
        ddp_reducer_desc desc;
        memset(&desc, 0, sizeof desc);
        if (mode == 2) desc.comm_dtype = DDP_BF16;
        if (mode == 3) desc.find_unused_parameters = 1;
        r_model(&hm, 0, flat, rank);
        r_model(&dm, 1, flat, rank);
        for (int d = 0; d < 2; d++) {
            rmodel *m = d ? &dm : &hm;
            CHECK_OK(ddp_reducer_create(g, &desc, &red[d]), g);
            for (int i = 0; i < 3; i++)
                CHECK_OK(ddp_reducer_add_param(red[d], names[i], m->param[i], m->grad[i], r_count[i], r_dtype(flat, i), NULL), g);
            CHECK_OK(ddp_reducer_finalize(red[d]), g);
        }
        for (int i = 0; i < 3; i++)
            r_same("a parameter after finalize", hm.param[i], dm.param[i], r_count[i] * ddp_dtype_size(r_dtype(flat, i)));
        for (int step = 0; step < 3; step++)
            for (int d = 0; d < 2; d++) {
                rmodel *m = d ? &dm : &hm;
                CHECK_OK(ddp_reducer_begin_backward(red[d]), g);
                for (int i = 2; i >= 0; i--) {
                    if (mode == 3 && i == 1 && rank % 2) continue; /* unused on odd ranks */
                    r_fill(m->grad[i], d, r_dtype(flat, i), r_count[i], rank, 220 + 3 * step + i);
                    CHECK_OK(ddp_reducer_grad_ready(red[d], i), g);
                }
                CHECK_OK(ddp_reducer_end_backward(red[d]), g);
                if (d)
                    for (int i = 0; i < 3; i++)
                        r_same("a gradient after end_backward", hm.grad[i], dm.grad[i],
                               r_count[i] * ddp_dtype_size(r_dtype(flat, i)));
            }
        if (flat) {
            ddp_reducer_statistics st;
            CHECK_OK(ddp_reducer_get_statistics(red[1], &st), g);
            CHECK(st.flat_buckets >= 1, "flat mode: %d flat buckets on device memory", st.flat_buckets);
        }
        CHECK_OK(ddp_reducer_zero_grad(red[1]), g);
        for (int i = 0; i < 3; i++)
            check_dev("a gradient after zero_grad", dm.grad[i], r_dtype(flat, i), r_count[i], [](size_t) { return 0.0; });
        ddp_reducer_destroy(red[0]);
        ddp_reducer_destroy(red[1]);
        r_free(&hm, 0);
        r_free(&dm, 1);
    }
}

static int rank_main(int rank, int n, void *arg) {
    ddp_harness::memory_stats_t before;
    ddp_group *g = device_rank_begin(&stream, &before); /* its ddp_set_stream: refused on a cpu group before device buffers were staged */
    (void)arg;
    t_all_reduce(g, rank, n);
    t_broadcast_reduce(g, rank, n);
    t_all_gather(g, rank, n);
    t_reduce_scatter(g, rank, n);
    t_gather_scatter(g, rank, n);
    t_all_to_all(g, rank, n);
    t_all_to_all_v(g, rank, n);
    t_all_gather_v(g, rank, n);
    t_send_recv(g, rank, n);
    t_mixed(g, rank, n);
    t_async(g, rank, n);
    t_back_to_back(g, rank, n);
    t_subgroup(g, rank, n);
    t_p2p_async_refused(g, rank, n);
    t_reducer(g, rank, n);
    t_reducer_zero(g, rank);
    t_reducer_fsdp(g, rank);
    CHECK(!strcmp(ddp_backend_name(g), "cpu"), "backend %s", ddp_backend_name(g));
    device_rank_end(g, stream, before); /* every copy staged through pinned memory on the group's stream */
    return 0;
}

/* A copy that CUDA refuses while staging (rank n-1's device buffer is shorter than the count: the
   harness, as cudaMemcpyAsync, refuses a range past its allocation) breaks the group: that rank gets
   DDP_ERR_SYSTEM naming the copy, every other rank an error naming that rank, none hangs; later calls
   are DDP_ERR_STATE. */
static int rank_fault(int rank, int n, void *arg) {
    ddp_group *g = NULL;
    int bad = n - 1;
    double t0;
    ddp_result r;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    void *d = rank == bad ? dev(8 * sizeof(float)) : dev_filled(DDP_F32, 1000, rank, 190);
    t0 = tl_now();
    r = ddp_all_reduce(g, d, 1000, DDP_F32, DDP_SUM);
    CHECK(r != DDP_SUCCESS, "rank %d: an all_reduce whose staging failed on rank %d succeeded", rank, bad);
    if (rank == bad)
        CHECK(r == DDP_ERR_SYSTEM && strstr(ddp_last_error(g), "cudaMemcpyAsync") &&
              strstr(ddp_last_error(g), "pinned host memory"), "the failing rank: %d %s", (int)r, ddp_last_error(g));
    else {
        char who[32];
        snprintf(who, sizeof who, "rank %d", bad);
        CHECK(strstr(ddp_last_error(g), who), "rank %d does not name rank %d: %s", rank, bad, ddp_last_error(g));
    }
    CHECK(tl_now() - t0 < 10, "rank %d took %.1f s to fail", rank, tl_now() - t0);
    if (rank == 0)
        printf("staging refused on rank %d: rank 0 failed after %.2f ms: %s\n", bad, (tl_now() - t0) * 1e3, ddp_last_error(g));
    CHECK(ddp_barrier(g) == DDP_ERR_STATE, "a call after the failure");
    cudaFree(d);
    ddp_destroy(g);
    return 0;
}

/* The harness itself: a host access to device memory is a SIGSEGV (so an unstaged call cannot pass). */
static void check_guard(void) {
    pid_t pid;
    int status = 0;
    fflush(stdout);
    fflush(stderr);
    if ((pid = fork()) == 0) {
        void *d = dev(64);
        signal(SIGSEGV, SIG_DFL);
        volatile char c = *(volatile char *)d;
        (void)c;
        _exit(0);
    }
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork");
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV, "a host read of harness device memory did not fault");
}

int main(void) {
    static const char *transports[2] = {"auto", "tcp"};
    check_guard();
    printf("harness: a host access to device memory faults\n");
    for (int t = 0; t < 2; t++)
        for (int n = 2; n <= 4; n++) {
            double t0 = tl_now();
            setenv("DDP_TRANSPORT", transports[t], 1);
            CHECK(tl_run_ranks(n, rank_main, NULL, 120) == 0, "%d ranks over %s", n, transports[t]);
            printf("%d ranks over %s: every collective on device buffers, staged (%.1f s)\n", n,
                   t ? "tcp" : "shared memory", tl_now() - t0);
        }
    setenv("DDP_TRANSPORT", "auto", 1);
    CHECK(tl_run_ranks(3, rank_fault, NULL, 60) == 0, "a staging copy refused on one rank");
    printf("ok\n");
    return 0;
}
