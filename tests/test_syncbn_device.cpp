/* test_syncbn_device.cpp: ddp_syncbn_forward/backward's device path (src/syncbn.c, x in device memory)
   without a GPU. Built by tests/test_cuda_kernels.sh: the library's implementation compiled with
   DDP_CUDA as C++17, linked with ddp_cuda.cu built against the CUDA harness (tests/cuda_harness): its
   kernels run on the CPU, and its memory API is the one notion of device memory here: cudaMalloc'd
   pages PROT_NONE to the host (opened while a kernel runs or a copy is made), async copies deferred
   until synchronised. ddp__cuda_device_alloc / ddp__cuda_is_device_pointer / the cuda-stage calls are
   ddp_cuda.cu's own; only the NCCL glue (absent from the harness build) is stubbed (cpu groups).
   On 1 rank (plain BatchNorm, no group) and 3 forked ranks (a cpu group with a stream set by
   ddp_set_stream: the device path's exchange is the group's all_gather / all_reduce of the device
   records and sums, staged through pinned host memory by src/devbuf.c), a layer on device memory and
   a layer on host memory get the same batches: y, dx, the local parameter gradients and the running
   stats agree after 2 training steps and an eval step, every rank with its own batch size (one
   empty), the device layer counting in the program's host int64_t (desc.num_batches_tracked); and the device path's errors: a host weight or a host dy, a host x after a device forward,
   one value per channel on one rank. */
#define DDP_CUDA
#include "testlib.h"

#include <cuda_runtime.h>
#include <vector>

/* ---- device memory: the harness's cudaMalloc (PROT_NONE to the host; kernels and the memory API open
   it), the same memory ddp__cuda_device_alloc gives and ddp__cuda_is_device_pointer recognises ---- */

static float *dev_copy(const std::vector<float> &v) {
    void *d = NULL;
    const size_t bytes = v.size() * sizeof(float);
    CHECK(ddp__cuda_device_alloc(bytes ? bytes : 1, &d, NULL, 0) == DDP_SUCCESS && d, "ddp__cuda_device_alloc(%zu)", bytes);
    if (bytes) CHECK(cudaMemcpy(d, v.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy to the device");
    return (float *)d;
}

/* The host's copy of n floats of device memory (a cudaMemcpy: it waits for the queued copies). */
static std::vector<float> host_copy(const float *d, size_t n) {
    std::vector<float> h(n);
    if (n) CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess, "cudaMemcpy to the host");
    return h;
}

/* The number of live cudaMalloc blocks (the staging's pinned memory not counted). */
static size_t device_blocks(void) {
    size_t n = 0;
    for (const auto &a : ddp_harness::allocations) n += a.device;
    return n;
}

/* The nccl backend's glue: never called on cpu groups (the harness builds ddp_cuda.cu without NCCL). */
#include "nccl_absent.h"

/* ---- the device path against the host path ---- */

static double max_rel(const float *device, const std::vector<float> &b) {
    const std::vector<float> a = host_copy(device, b.size());
    double num = 0, den = 1;
    for (size_t i = 0; i < b.size(); i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= num)) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return num / den;
}

static void compare_case(ddp_group *g, int rank, int C, int64_t S, int channels_last, int affine, double momentum) {
    const int64_t batch = rank == 1 ? 0 : 2 + rank, total = batch * S * C; /* rank 1: an empty batch */
    uint64_t seed = 99 + (uint64_t)rank * 7919 + (uint64_t)C;
    std::vector<float> x((size_t)total), dy((size_t)total), w((size_t)C), b((size_t)C), rm((size_t)C, 0.0f),
        rv((size_t)C, 1.0f), y((size_t)total), dx((size_t)total), gw((size_t)C, 0.0f), gb((size_t)C, 0.0f);
    for (auto &v : x) v = 1.5f + 2.0f * (float)(tl_rand(&seed) >> 40) / 16777216.0f;
    for (auto &v : dy) v = (float)(tl_rand(&seed) >> 40) / 16777216.0f - 0.5f;
    for (int c = 0; c < C; c++) w[(size_t)c] = 0.5f + (float)c / (float)C, b[(size_t)c] = 0.1f * (float)c;
    float *dx_in = dev_copy(x), *ddy = dev_copy(dy), *dy_out = dev_copy(y), *ddx = dev_copy(dx);
    float *dw = affine ? dev_copy(w) : NULL, *db = affine ? dev_copy(b) : NULL, *drm = dev_copy(rm), *drv = dev_copy(rv);
    float *dgw = dev_copy(gw), *dgb = dev_copy(gb);
    ddp_syncbn_desc hd, dd;
    ddp_syncbn *host, *dev;
    int64_t dev_nbt = 0; /* the device layer's counter: host memory of the program (desc.num_batches_tracked) */
    memset(&hd, 0, sizeof hd);
    hd.num_features = C, hd.momentum = momentum, hd.channels_last = channels_last;
    dd = hd;
    hd.weight = affine ? w.data() : NULL, hd.bias = affine ? b.data() : NULL, hd.running_mean = rm.data(),
    hd.running_var = rv.data();
    dd.weight = dw, dd.bias = db, dd.running_mean = drm, dd.running_var = drv, dd.num_batches_tracked = &dev_nbt;
    CHECK_OK(ddp_syncbn_create(g, &hd, &host), g);
    CHECK_OK(ddp_syncbn_create(g, &dd, &dev), g);
    const size_t blocks_before = device_blocks();
    for (int step = 0; step < 3; step++) {
        const int training = step < 2;
        CHECK_OK(ddp_syncbn_forward(host, x.data(), y.data(), batch, S, training), g);
        CHECK_OK(ddp_syncbn_backward(host, x.data(), dy.data(), dx.data(), gw.data(), gb.data(), batch, S), g);
        CHECK_OK(ddp_syncbn_forward(dev, total ? dx_in : NULL, total ? dy_out : NULL, batch, S, training), g);
        CHECK_OK(ddp_syncbn_backward(dev, total ? dx_in : NULL, total ? ddy : NULL, total ? ddx : NULL, dgw, dgb, batch, S), g);
        CHECK(device_blocks() == blocks_before + 6, "the device layer has %zu blocks of device scratch, want 6 (did it take "
              "the device path?)", device_blocks() - blocks_before);
        const double e[6] = {max_rel(dy_out, y), max_rel(ddx, dx), max_rel(dgw, gw),
                             max_rel(dgb, gb), max_rel(drm, rm), max_rel(drv, rv)};
        static const char *names[6] = {"y", "dx", "grad_weight", "grad_bias", "running_mean", "running_var"};
        for (int k = 0; k < 6; k++)
            CHECK(e[k] <= 2e-5, "rank %d, C=%d S=%lld %s affine=%d, step %d: %s of the device path differs from the "
                  "host path by %.3g", rank, C, (long long)S, channels_last ? "channels_last" : "planar", affine, step,
                  names[k], e[k]);
    }
    CHECK(ddp_syncbn_num_batches_tracked(dev) == 2 && dev_nbt == 2, "num_batches_tracked %lld, the program's counter %lld",
          (long long)ddp_syncbn_num_batches_tracked(dev), (long long)dev_nbt);
    ddp_syncbn_destroy(dev);
    ddp_syncbn_destroy(host);
    float *blocks[10] = {dx_in, ddy, dy_out, ddx, dw, db, drm, drv, dgw, dgb};
    for (float *p : blocks) ddp__cuda_device_free(p);
}

/* The device path's argument errors, on a layer without a group (no communication). */
static void device_errors(void) {
    const int C = 3;
    std::vector<float> hw((size_t)C, 1.0f), v(12, 1.0f);
    float *x = dev_copy(v), *y = dev_copy(v), *dw = dev_copy(hw);
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    memset(&d, 0, sizeof d);
    d.num_features = C, d.channels_last = 1, d.weight = hw.data(); /* a host weight with device data */
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    CHECK(ddp_syncbn_forward(bn, x, y, 4, 1, 1) == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(NULL), "weight is host memory"),
          "host weight: %s", ddp_last_error(NULL));
    ddp_syncbn_destroy(bn);
    d.weight = dw;
    CHECK_OK(ddp_syncbn_create(NULL, &d, &bn), NULL);
    CHECK(ddp_syncbn_forward(bn, x, y, 1, 1, 1) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(ddp_last_error(NULL), "expected more than 1 value per channel"),
          "one value: %s", ddp_last_error(NULL));
    CHECK_OK(ddp_syncbn_forward(bn, x, y, 4, 1, 1), NULL);
    CHECK(ddp_syncbn_backward(bn, x, v.data(), y, NULL, NULL, 4, 1) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(ddp_last_error(NULL), "dy is host memory"),
          "host dy: %s", ddp_last_error(NULL));
    CHECK(ddp_syncbn_backward(bn, v.data(), v.data(), v.data(), NULL, NULL, 4, 1) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(ddp_last_error(NULL), "x is host memory"),
          "host x after a device forward: %s", ddp_last_error(NULL));
    ddp_syncbn_destroy(bn);
    ddp__cuda_device_free(x), ddp__cuda_device_free(y), ddp__cuda_device_free(dw);
    printf("device path errors: a host weight, a host dy, a host x after a device forward, 1 value per channel\n");
}

static cudaStream_t stream; /* the group's, in the ranked cases */

static int ranked(int rank, int n, void *arg) {
    ddp_init_desc d;
    ddp_group *g;
    (void)arg;
    memset(&d, 0, sizeof d);
    CHECK_OK(ddp_init(&d, &g), NULL);
    CHECK(cudaStreamCreate(&stream) == cudaSuccess, "cudaStreamCreate");
    CHECK_OK(ddp_set_stream(g, stream), g);
    compare_case(g, rank, 5, 7, 0, 1, 0.1);
    compare_case(g, rank, 33, 1, 1, 1, -1.0); /* momentum None */
    compare_case(g, rank, 4, 9, 1, 0, 0.3);
    CHECK(ddp_harness::memory_stats.async_d2h > 0 && ddp_harness::memory_stats.async_h2d > 0 &&
              ddp_harness::memory_stats.last_stream == stream,
          "rank %d: the exchange's device records were not staged through pinned memory on the group's stream "
          "(%llu device-to-host and %llu host-to-device async copies)", rank,
          (unsigned long long)ddp_harness::memory_stats.async_d2h, (unsigned long long)ddp_harness::memory_stats.async_h2d);
    CHECK(ddp_harness::last_launch_stream == stream, "rank %d: SyncBN's kernels were queued on stream %p, not on the group's "
          "stream %p where devbuf.c stages the exchange (a non-blocking stream would not order them)", rank,
          (void *)ddp_harness::last_launch_stream, (void *)stream);
    CHECK_OK(ddp_destroy(g), NULL);
    cudaStreamDestroy(stream);
    if (rank == 0) printf("device path = host path on %d ranks (a cpu group: the exchange is its all_gather / all_reduce "
                          "on device memory, staged by devbuf.c)\n", n);
    return 0;
}

int main(void) {
    device_errors();
    compare_case(NULL, 0, 5, 7, 0, 1, 0.1); /* one process, no group: plain BatchNorm */
    compare_case(NULL, 2, 8, 1, 1, 0, -1.0);
    printf("device path = host path without a group\n");
    if (tl_run_ranks(3, ranked, NULL, 60)) return 1;
    printf("ok\n");
    return 0;
}
