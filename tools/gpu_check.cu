/* gpu_check.cu: the device checks and benchmarks that tools/gpu-check.sh runs on a GPU machine.
   One program, run by ddprun (any number of ranks; the backend from DDP_BACKEND: nccl, or cpu with
   device buffers for several ranks on one GPU):
     gpu_check syncbn          ddp_syncbn_forward/backward on device memory (the device path) against the
                               same calls on host memory (the CPU code) over the same group: y, dx, local
                               parameter gradients and running stats, 2 training steps and 1 eval step,
                               both layouts, with and without affine parameters
     gpu_check reducer         the reducer on device gradients: finalize broadcasts rank 0's parameters,
                               end_backward leaves the average over ranks; and FSDP (zero_stage 3) on
                               the nccl backend against its closed form
     gpu_check devbuf          several ranks on one GPU: the cpu backend with device buffers (run it with
                               DDP_BACKEND=cpu), the group's stream a non-blocking one (ddp_set_stream):
                               all_reduce, all_gather, broadcast and reduce_scatter of cudaMalloc'd
                               buffers (an input queued on the stream just before the call) against host
                               references, then the syncbn and reducer checks above on that group, and
                               ZeRO-1 (zero_stage 1) on device parameters against the same steps on host
                               memory; ZeRO-2 on device parameters must be refused; FSDP (zero_stage 3)
                               on device parameters (CPUOffloadPolicy) against the same steps on host memory
     gpu_check bench-syncbn [N C S]   SyncBN forward+backward (training) GB/s on the device path, and
                               the device's copy bandwidth (cudaMemcpy device to device) on the same bytes
     gpu_check bench-allreduce ddp_all_reduce of device memory, 4 KiB .. 256 MiB: algbw and busbw
     gpu_check bench-reducer   the reducer's step (begin_backward, grad_ready x P, end_backward) against
                               one all_reduce of the same bytes: its overhead per step, with the gradients
                               in P allocations (copied into buckets) and as slices of one (reduced in place)
     gpu_check nccl-version    the NCCL this program loaded (ncclGetVersion): "nccl_version=X.Y.Z"; no group
   Every check prints "ok ..." and exits 0, or prints FAIL and exits 1. Benchmarks print key=value
   lines (rank 0) that gpu-check.sh puts in its report.
   Build: nvcc -std=c++17 -O2 -I. -o gpu_check tools/gpu_check.cu ddp_cuda.o -lnccl (gpu-check.sh does). */
#define DDP_CUDA
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <algorithm>
#include <vector>

#define CUDA_OK(call)                                                                                  \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)
#define DDP_OK(call, g)                                                                                  \
    do {                                                                                                 \
        ddp_result r_ = (call);                                                                          \
        if (r_ != DDP_SUCCESS) {                                                                         \
            fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, ddp_last_error(g));       \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

static ddp_group *g_group;
static int g_rank, g_world;
static cudaStream_t g_stream; /* the group's stream on the nccl backend and in devbuf mode; else NULL (legacy default) */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void start(int own_stream) {
    ddp_init_desc d;
    memset(&d, 0, sizeof d);
    DDP_OK(ddp_init(&d, &g_group), NULL);
    g_rank = ddp_rank(g_group), g_world = ddp_world_size(g_group);
    if (strcmp(ddp_backend_name(g_group), "nccl") == 0) {
        CUDA_OK(cudaStreamCreate(&g_stream));
        DDP_OK(ddp_set_stream(g_group, g_stream), g_group);
    } else {
        CUDA_OK(cudaSetDevice(0)); /* several ranks on one GPU: the cpu backend with device buffers */
        if (own_stream) { /* devbuf: staging and SyncBN's kernels on a stream that does not sync with the default one */
            CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
            DDP_OK(ddp_set_stream(g_group, g_stream), g_group);
        }
    }
}

static void finish(void) {
    DDP_OK(ddp_destroy(g_group), NULL);
    if (g_stream) cudaStreamDestroy(g_stream);
}

/* Device copies of host arrays (NULL stays NULL), one allocation each. */
static float *to_device(const float *host, size_t n) {
    float *d = NULL;
    if (!host) return NULL;
    CUDA_OK(cudaMalloc(&d, n * sizeof(float) + 1));
    CUDA_OK(cudaMemcpy(d, host, n * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize()); /* a pageable copy may still be in flight for a non-blocking stream */
    return d;
}

/* n floats of device memory, every byte `fill`. */
static float *dalloc(int64_t n, int fill) {
    float *d = NULL;
    CUDA_OK(cudaMalloc(&d, (size_t)n * sizeof(float) + 1));
    CUDA_OK(cudaMemset(d, fill, (size_t)n * sizeof(float)));
    return d;
}

static std::vector<float> to_host(const float *dev, size_t n) {
    std::vector<float> h(n);
    CUDA_OK(cudaDeviceSynchronize()); /* the group's stream too, when it is a non-blocking one */
    if (n) CUDA_OK(cudaMemcpy(h.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static float uniform(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Largest |a - b| over max(1, largest |b|). */
static double rel_err(const std::vector<float> &a, const float *b, size_t n) {
    double num = 0, den = 1;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= num)) num = d;
        if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
    }
    return num / den;
}

/* ---- syncbn: the device path against the host path over the same group ---- */

static int syncbn_case(int C, int64_t S, int channels_last, int affine, double momentum) {
    const int64_t batch = 3 + g_rank % 3, total = batch * S * C; /* ranks differ in batch size */
    uint64_t seed = 12345 + (uint64_t)g_rank * 977 + (uint64_t)C * 31 + (uint64_t)S;
    std::vector<float> x(total), dy(total), w(C), b(C), rm(C, 0.0f), rv(C, 1.0f), y(total), dx(total), gw(C, 0.0f),
        gb(C, 0.0f);
    for (auto &v : x) v = 2.0f + 3.0f * uniform(&seed);
    for (auto &v : dy) v = uniform(&seed);
    for (int c = 0; c < C; c++) w[c] = 1.0f + 0.5f * (float)c / (float)C, b[c] = 0.25f * (float)(c % 3);
    float *dx_ = to_device(x.data(), (size_t)total), *ddy = to_device(dy.data(), (size_t)total);
    float *dy_out = to_device(y.data(), (size_t)total), *ddx = to_device(dx.data(), (size_t)total);
    float *dw = affine ? to_device(w.data(), C) : NULL, *db = affine ? to_device(b.data(), C) : NULL;
    float *drm = to_device(rm.data(), C), *drv = to_device(rv.data(), C);
    float *dgw = to_device(gw.data(), C), *dgb = to_device(gb.data(), C);
    ddp_syncbn_desc hd, dd;
    ddp_syncbn *host_bn, *dev_bn;
    int64_t dev_nbt = 0; /* the device layer's num_batches_tracked: host memory of the program */
    memset(&hd, 0, sizeof hd);
    hd.num_features = C, hd.momentum = momentum, hd.channels_last = channels_last;
    dd = hd;
    hd.weight = affine ? w.data() : NULL, hd.bias = affine ? b.data() : NULL, hd.running_mean = rm.data(),
    hd.running_var = rv.data();
    dd.weight = dw, dd.bias = db, dd.running_mean = drm, dd.running_var = drv, dd.num_batches_tracked = &dev_nbt;
    DDP_OK(ddp_syncbn_create(g_group, &hd, &host_bn), g_group);
    DDP_OK(ddp_syncbn_create(g_group, &dd, &dev_bn), g_group);
    double worst = 0;
    for (int step = 0; step < 3; step++) {
        const int training = step < 2;
        DDP_OK(ddp_syncbn_forward(host_bn, x.data(), y.data(), batch, S, training), g_group);
        DDP_OK(ddp_syncbn_backward(host_bn, x.data(), dy.data(), dx.data(), gw.data(), gb.data(), batch, S), g_group);
        DDP_OK(ddp_syncbn_forward(dev_bn, dx_, dy_out, batch, S, training), g_group);
        DDP_OK(ddp_syncbn_backward(dev_bn, dx_, ddy, ddx, dgw, dgb, batch, S), g_group);
        CUDA_OK(cudaDeviceSynchronize());
        const double e[6] = {rel_err(to_host(dy_out, total), y.data(), total), rel_err(to_host(ddx, total), dx.data(), total),
                             rel_err(to_host(dgw, C), gw.data(), C), rel_err(to_host(dgb, C), gb.data(), C),
                             rel_err(to_host(drm, C), rm.data(), C), rel_err(to_host(drv, C), rv.data(), C)};
        static const char *names[6] = {"y", "dx", "grad_weight", "grad_bias", "running_mean", "running_var"};
        for (int k = 0; k < 6; k++) {
            if (e[k] > worst) worst = e[k];
            if (!(e[k] <= 1e-4)) {
                printf("FAIL syncbn rank %d/%d C=%d S=%lld %s affine=%d step %d: %s differs from the host path by %.3g\n",
                       g_rank, g_world, C, (long long)S, channels_last ? "channels_last" : "planar", affine, step, names[k],
                       e[k]);
                exit(1); /* the other ranks then fail on their next collective (the peer is lost) */
            }
        }
    }
    if (ddp_syncbn_num_batches_tracked(dev_bn) != 2 || dev_nbt != 2) {
        printf("FAIL syncbn: num_batches_tracked %lld (the program's counter %lld), want 2\n",
               (long long)ddp_syncbn_num_batches_tracked(dev_bn), (long long)dev_nbt);
        return 1;
    }
    { /* the device running stats and the host counter as buffers of a reducer: rank 0's on every rank */
        ddp_reducer *red;
        ddp_reducer_desc rd;
        int iw;
        float *dpar = to_device(w.data(), C), *dgrad = to_device(gw.data(), C);
        const std::vector<float> rm0 = to_host(drm, C);
        memset(&rd, 0, sizeof rd);
        DDP_OK(ddp_reducer_create(g_group, &rd, &red), g_group);
        DDP_OK(ddp_reducer_add_param(red, "bn.weight", dpar, dgrad, C, DDP_F32, &iw), g_group);
        DDP_OK(ddp_reducer_add_buffer(red, "bn.running_mean", drm, C, DDP_F32), g_group);
        DDP_OK(ddp_reducer_add_buffer(red, "bn.num_batches_tracked", &dev_nbt, 1, DDP_I64), g_group);
        DDP_OK(ddp_reducer_finalize(red), g_group);
        dev_nbt = 2 + 10 * g_rank; /* a rank drifts: the broadcast gives it rank 0's 2 back */
        DDP_OK(ddp_reducer_broadcast_buffers(red), g_group);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<float> all((size_t)C * g_world);
        DDP_OK(ddp_all_gather(g_group, rm0.data(), all.data(), C, DDP_F32), g_group);
        const std::vector<float> rm1 = to_host(drm, C);
        if (dev_nbt != 2 || memcmp(rm1.data(), all.data(), sizeof(float) * C) != 0) {
            printf("FAIL syncbn rank %d: after broadcast_buffers the counter is %lld (want 2) and running_mean %s rank 0's\n",
                   g_rank, (long long)dev_nbt, memcmp(rm1.data(), all.data(), sizeof(float) * C) ? "differs from" : "is");
            return 1;
        }
        ddp_reducer_destroy(red);
        cudaFree(dpar), cudaFree(dgrad);
    }
    ddp_syncbn_destroy(dev_bn);
    ddp_syncbn_destroy(host_bn);
    cudaFree(dx_), cudaFree(ddy), cudaFree(dy_out), cudaFree(ddx), cudaFree(dw), cudaFree(db), cudaFree(drm),
        cudaFree(drv), cudaFree(dgw), cudaFree(dgb);
    if (g_rank == 0)
        printf("  C=%d S=%lld %s affine=%d momentum=%g: worst relative difference %.2g\n", C, (long long)S,
               channels_last ? "channels_last" : "planar", affine, momentum, worst);
    return 0;
}

static int check_syncbn(void) {
    int bad = 0;
    bad |= syncbn_case(3, 17, 0, 1, 0.1);
    bad |= syncbn_case(33, 1, 1, 1, -1); /* momentum None: cumulative average */
    bad |= syncbn_case(8, 64 * 64, 0, 0, 0.1);
    bad |= syncbn_case(256, 9, 1, 1, 0.1);
    if (!bad && g_rank == 0)
        printf("ok syncbn: the device path matches the host path on %d rank(s), backend %s\n", g_world,
               ddp_backend_name(g_group));
    return bad;
}

/* ---- reducer: device gradients averaged over the ranks ---- */

static int check_reducer(void) {
    const int64_t sizes[5] = {1000, 3, 70001, 1, 4096};
    std::vector<float *> params(5), grads(5);
    int idx[5];
    ddp_reducer *red;
    DDP_OK(ddp_reducer_create(g_group, NULL, &red), g_group);
    for (int p = 0; p < 5; p++) {
        std::vector<float> v((size_t)sizes[p]);
        for (int64_t i = 0; i < sizes[p]; i++) v[i] = (float)(g_rank * 1000 + p) + 0.001f * (float)(i % 1000);
        params[p] = to_device(v.data(), v.size());
        for (int64_t i = 0; i < sizes[p]; i++) v[i] = (float)(g_rank + 1) * (float)((i % 7) + p);
        grads[p] = to_device(v.data(), v.size());
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        DDP_OK(ddp_reducer_add_param(red, name, params[p], grads[p], sizes[p], DDP_F32, &idx[p]), g_group);
    }
    DDP_OK(ddp_reducer_finalize(red), g_group);
    DDP_OK(ddp_reducer_begin_backward(red), g_group);
    for (int p = 4; p >= 0; p--) DDP_OK(ddp_reducer_grad_ready(red, idx[p]), g_group);
    DDP_OK(ddp_reducer_end_backward(red), g_group);
    CUDA_OK(cudaDeviceSynchronize());
    for (int p = 0; p < 5; p++) {
        std::vector<float> gp = to_host(grads[p], (size_t)sizes[p]), pp = to_host(params[p], (size_t)sizes[p]);
        for (int64_t i = 0; i < sizes[p]; i++) {
            const double want_g = (double)((i % 7) + p) * (g_world + 1) / 2.0;
            const float want_p = (float)p + 0.001f * (float)(i % 1000);
            if (fabs(gp[i] - want_g) > 1e-5 * (1 + want_g) || pp[i] != want_p) {
                printf("FAIL reducer rank %d/%d: param %d element %lld: grad %.9g (want the mean %.9g), param %.9g (want "
                       "rank 0's %.9g)\n", g_rank, g_world, p, (long long)i, gp[i], want_g, pp[i], want_p);
                return 1;
            }
        }
        cudaFree(params[p]), cudaFree(grads[p]);
    }
    ddp_reducer_destroy(red);
    if (g_rank == 0)
        printf("ok reducer: device gradients averaged over %d rank(s), rank 0's parameters broadcast (backend %s)\n", g_world,
               ddp_backend_name(g_group));
    return 0;
}

/* ---- devbuf: the cpu backend's collectives on device buffers (several ranks on one GPU) ---- */

/* Rank r's element i: a small integer, exact in f32 and in sums over the ranks. */
static float dv(int r, int64_t i) { return (float)((r + 1) * ((int)(i % 17) - 8)); }
static double dv_sum(int64_t i) { return (double)((int)(i % 17) - 8) * g_world * (g_world + 1) / 2.0; }

/* A device buffer of n elements f(i), queued on the group's stream from a device source (so the call
   that follows must read what its stream queued before it, not what the host last saw). */
template <typename F>
static float *queued_input(int64_t n, F f) {
    std::vector<float> h((size_t)n);
    for (int64_t i = 0; i < n; i++) h[(size_t)i] = f(i);
    float *src = to_device(h.data(), (size_t)n), *dst = dalloc(n, 0);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, g_stream));
    CUDA_OK(cudaFreeAsync(src, g_stream));
    return dst;
}

static int devbuf_compare(const char *what, const float *dev, int64_t n, double (*want)(int64_t, void *), void *arg) {
    std::vector<float> h = to_host(dev, (size_t)n);
    for (int64_t i = 0; i < n; i++)
        if ((double)h[(size_t)i] != want(i, arg)) {
            printf("FAIL devbuf rank %d/%d (backend %s): %s element %lld is %.9g, want %.9g\n", g_rank, g_world,
                   ddp_backend_name(g_group), what, (long long)i, (double)h[(size_t)i], want(i, arg));
            exit(1); /* the other ranks then fail on their next collective */
        }
    return 0;
}

static int check_devbuf_collectives(void) {
    const int64_t n = 1000003, W = g_world; /* odd, 4 MB: more than one staging chunk of the transports */
    const int root = 1 % g_world;
    float *a = queued_input(n, [](int64_t i) { return dv(g_rank, i); });
    DDP_OK(ddp_all_reduce(g_group, a, (size_t)n, DDP_F32, DDP_SUM), g_group);
    devbuf_compare("all_reduce(sum)", a, n, [](int64_t i, void *) { return dv_sum(i); }, NULL);
    float *send = queued_input(n, [](int64_t i) { return dv(g_rank, i) + 0.5f; }), *all = dalloc(n * W, 0);
    DDP_OK(ddp_all_gather(g_group, send, all, (size_t)n, DDP_F32), g_group);
    devbuf_compare("all_gather", all, n * W, [](int64_t i, void *p) {
        const int64_t per = *(const int64_t *)p;
        return (double)dv((int)(i / per), i % per) + 0.5; }, (void *)&n);
    float *b = queued_input(n, [](int64_t i) { return dv(g_rank, i) * 3; });
    DDP_OK(ddp_broadcast(g_group, b, (size_t)n, DDP_F32, root), g_group);
    devbuf_compare("broadcast", b, n, [](int64_t i, void *p) { return (double)dv(*(const int *)p, i) * 3; }, (void *)&root);
    float *rs_in = queued_input(n * W, [](int64_t i) { return dv(g_rank, i); }), *rs_out = dalloc(n, 0);
    DDP_OK(ddp_reduce_scatter(g_group, rs_in, rs_out, (size_t)n, DDP_F32, DDP_SUM), g_group);
    devbuf_compare("reduce_scatter(sum)", rs_out, n, [](int64_t i, void *p) {
        return dv_sum((int64_t)g_rank * *(const int64_t *)p + i); }, (void *)&n);
    cudaFree(a), cudaFree(send), cudaFree(all), cudaFree(b), cudaFree(rs_in), cudaFree(rs_out);
    if (g_rank == 0)
        printf("ok devbuf: all_reduce, all_gather, broadcast, reduce_scatter of %lld floats of device memory on %d rank(s), "
               "backend %s, a non-blocking stream\n", (long long)n, g_world, ddp_backend_name(g_group));
    return 0;
}

/* ZeRO-1 on device parameters: 2 steps (the same gradients; SGD on the shards, here through the host as a
   kernel would do on the device) give the same parameters as the same reducer over host memory; ZeRO-2
   on device parameters is refused by finalize. */
static void zero_sgd(const ddp_shard *sh, int n) {
    for (int j = 0; j < n; j++) {
        std::vector<float> p(sh[j].count), gr(sh[j].count);
        CUDA_OK(cudaMemcpy(p.data(), sh[j].param_data, sh[j].count * 4, cudaMemcpyDefault));
        CUDA_OK(cudaMemcpy(gr.data(), sh[j].grad, sh[j].count * 4, cudaMemcpyDefault));
        for (size_t i = 0; i < sh[j].count; i++) p[i] -= 0.25f * gr[i];
        CUDA_OK(cudaMemcpy(sh[j].param_data, p.data(), sh[j].count * 4, cudaMemcpyDefault));
    }
    /* A pageable host-to-device cudaMemcpy may return before its DMA lands, and the group's stream is a
       non-blocking one, which does not wait for the legacy stream: without this, gather_params may read
       a shard's old values (seen once on an H200 at 2 ranks). */
    CUDA_OK(cudaDeviceSynchronize());
}

static int check_devbuf_zero(void) {
    const int64_t sizes[3] = {70001, 5, 4096};
    std::vector<float> hp[3], hg[3];
    float *dp[3], *dg[3];
    ddp_reducer *red[2];
    ddp_reducer_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.zero_stage = 1;
    desc.bucket_cap_bytes = 64 << 10;
    for (int p = 0; p < 3; p++) {
        hp[p].resize((size_t)sizes[p]), hg[p].resize((size_t)sizes[p]);
        for (int64_t i = 0; i < sizes[p]; i++) hp[p][(size_t)i] = (float)(g_rank + p) + 0.001f * (float)(i % 1000);
        dp[p] = to_device(hp[p].data(), hp[p].size()), dg[p] = dalloc(sizes[p], 0);
    }
    for (int d = 0; d < 2; d++) {
        DDP_OK(ddp_reducer_create(g_group, &desc, &red[d]), g_group);
        for (int p = 0; p < 3; p++) {
            char name[16];
            snprintf(name, sizeof name, "p%d", p);
            DDP_OK(ddp_reducer_add_param(red[d], name, d ? (void *)dp[p] : hp[p].data(), d ? (void *)dg[p] : hg[p].data(),
                                         (size_t)sizes[p], DDP_F32, NULL), g_group);
        }
        DDP_OK(ddp_reducer_finalize(red[d]), g_group);
    }
    for (int step = 0; step < 2; step++)
        for (int d = 0; d < 2; d++) {
            const ddp_shard *sh;
            DDP_OK(ddp_reducer_begin_backward(red[d]), g_group);
            for (int p = 2; p >= 0; p--) {
                std::vector<float> v((size_t)sizes[p]);
                for (int64_t i = 0; i < sizes[p]; i++) v[(size_t)i] = dv(g_rank, i + p + step);
                if (d) {
                    CUDA_OK(cudaMemcpy(dg[p], v.data(), v.size() * 4, cudaMemcpyHostToDevice));
                    CUDA_OK(cudaDeviceSynchronize());
                } else {
                    std::copy(v.begin(), v.end(), hg[p].begin()); /* registered: keep its storage */
                }
                DDP_OK(ddp_reducer_grad_ready(red[d], p), g_group);
            }
            DDP_OK(ddp_reducer_end_backward(red[d]), g_group);
            CUDA_OK(cudaDeviceSynchronize());
            const int nsh = ddp_reducer_shards(red[d], &sh);
            if (nsh < 0) DDP_OK(DDP_ERR_STATE, g_group);
            zero_sgd(sh, nsh);
            DDP_OK(ddp_reducer_gather_params(red[d]), g_group);
        }
    for (int p = 0; p < 3; p++) {
        std::vector<float> got = to_host(dp[p], (size_t)sizes[p]);
        if (memcmp(got.data(), hp[p].data(), got.size() * 4) != 0) {
            printf("FAIL devbuf rank %d/%d: ZeRO-1 parameter p%d on device memory differs from the same steps on host memory\n",
                   g_rank, g_world, p);
            exit(1);
        }
    }
    ddp_reducer_destroy(red[0]), ddp_reducer_destroy(red[1]);
    desc.zero_stage = 2;
    DDP_OK(ddp_reducer_create(g_group, &desc, &red[1]), g_group);
    for (int p = 0; p < 3; p++) {
        char name[16];
        snprintf(name, sizeof name, "z%d", p);
        DDP_OK(ddp_reducer_add_param(red[1], name, dp[p], dg[p], (size_t)sizes[p], DDP_F32, NULL), g_group);
    }
    const ddp_result r2 = ddp_reducer_finalize(red[1]);
    if (strcmp(ddp_backend_name(g_group), "nccl") && r2 != DDP_ERR_UNSUPPORTED) {
        printf("FAIL devbuf rank %d: ZeRO-2 on device parameters with backend %s: finalize returned %d, want "
               "DDP_ERR_UNSUPPORTED (%s)\n", g_rank, ddp_backend_name(g_group), (int)r2, ddp_last_error(g_group));
        exit(1);
    }
    ddp_reducer_destroy(red[1]);
    for (int p = 0; p < 3; p++) cudaFree(dp[p]), cudaFree(dg[p]);
    if (g_rank == 0)
        printf("ok devbuf: ZeRO-1 on device parameters = on host memory over %d rank(s); ZeRO-2 on device parameters "
               "refused (backend %s)\n", g_world, ddp_backend_name(g_group));
    return 0;
}

/* FSDP (zero_stage 3) on device parameters, 3 units (a KEEP one), prefetch 1, two SGD steps on the shards:
   every gathered unit equals, on the cpu backend (CPUOffloadPolicy: shards on the host), the same reducer
   over host memory, bit for bit; on the nccl backend (everything on the device: shards, pools, NCCL's
   all-gather and reduce-scatter) the closed form, exact for 1, 2 and 4 ranks (small integers, 1/world a
   power of two). */
static int check_devbuf_fsdp(void) {
    const int64_t sizes[3] = {4096, 70001, 5};
    const int nccl = !strcmp(ddp_backend_name(g_group), "nccl");
    std::vector<float> hp[3];
    float *dp[3];
    ddp_reducer *red[2] = {NULL, NULL};
    ddp_reducer_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.zero_stage = 3, desc.prefetch = 1;
    for (int p = 0; p < 3; p++) {
        hp[p].resize((size_t)sizes[p]);
        for (int64_t i = 0; i < sizes[p]; i++) hp[p][(size_t)i] = (float)p + 0.001f * (float)(i % 1000);
        dp[p] = to_device(hp[p].data(), hp[p].size());
    }
    for (int d = nccl; d < 2; d++) {
        DDP_OK(ddp_reducer_create(g_group, &desc, &red[d]), g_group);
        for (int p = 0; p < 3; p++) {
            char name[16];
            snprintf(name, sizeof name, "u%d", p);
            if (ddp_fsdp_unit(red[d], name, p ? 0 : DDP_FSDP_KEEP) != p) DDP_OK(DDP_ERR_STATE, g_group);
            name[0] = 'w';
            DDP_OK(ddp_reducer_add_param(red[d], name, d ? (void *)dp[p] : hp[p].data(), NULL, (size_t)sizes[p], DDP_F32, NULL),
                   g_group);
        }
        DDP_OK(ddp_reducer_finalize(red[d]), g_group);
    }
    for (int step = 0; step <= 2; step++) {
        for (int d = nccl; d < 2; d++)
            for (int u = 0; u < 3; u++) DDP_OK(ddp_fsdp_wait(red[d], u), g_group);
        CUDA_OK(cudaDeviceSynchronize());
        for (int u = 0; u < 3; u++) {
            std::vector<float> got = to_host((const float *)ddp_fsdp_param(red[1], u), (size_t)sizes[u]);
            const void *want = nccl ? (const void *)hp[u].data() : ddp_fsdp_param(red[0], u);
            if (memcmp(got.data(), want, got.size() * 4) != 0) {
                printf("FAIL devbuf rank %d/%d: FSDP unit %d gathered in device memory differs from %s (step %d, backend %s)\n",
                       g_rank, g_world, u, nccl ? "the closed form" : "host memory", step, ddp_backend_name(g_group));
                exit(1);
            }
        }
        if (step == 2) break;
        for (int d = nccl; d < 2; d++) {
            const ddp_shard *sh;
            DDP_OK(ddp_fsdp_release(red[d], 1), g_group);
            DDP_OK(ddp_reducer_begin_backward(red[d]), g_group);
            for (int u = 2; u >= 0; u--) {
                std::vector<float> v((size_t)sizes[u]);
                void *gr = ddp_fsdp_grad(red[d], u);
                if (!gr) DDP_OK(DDP_ERR_STATE, g_group);
                for (int64_t i = 0; i < sizes[u]; i++) v[(size_t)i] = dv(g_rank, i + u + step);
                if (d) {
                    CUDA_OK(cudaMemcpy(gr, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
                    CUDA_OK(cudaDeviceSynchronize());
                } else {
                    memcpy(gr, v.data(), v.size() * 4);
                }
                DDP_OK(ddp_fsdp_grads_ready(red[d], u), g_group);
                DDP_OK(ddp_fsdp_release(red[d], u), g_group);
            }
            DDP_OK(ddp_reducer_end_backward(red[d]), g_group);
            const int nsh = ddp_reducer_shards(red[d], &sh);
            if (nsh < 0) DDP_OK(DDP_ERR_STATE, g_group);
            zero_sgd(sh, nsh);
        }
        for (int u = 0; nccl && u < 3; u++) /* the closed form: the same SGD on the averaged gradient */
            for (int64_t i = 0; i < sizes[u]; i++) hp[u][(size_t)i] -= 0.25f * (float)(dv_sum(i + u + step) / g_world);
    }
    ddp_reducer_destroy(red[0]), ddp_reducer_destroy(red[1]);
    for (int p = 0; p < 3; p++) cudaFree(dp[p]);
    if (g_rank == 0)
        printf("ok fsdp: zero_stage 3 on device parameters = %s over %d rank(s) (backend %s)\n",
               nccl ? "the closed form" : "on host memory", g_world, ddp_backend_name(g_group));
    return 0;
}

static int check_devbuf(void) {
    int bad = check_devbuf_collectives();
    bad |= check_syncbn();
    bad |= check_reducer();
    bad |= check_devbuf_zero();
    bad |= check_devbuf_fsdp();
    return bad;
}

/* ---- benchmarks ---- */

/* Seconds per call of fn over iters calls after warm calls, the device synchronised around. */
template <typename F>
static double timed(int warm, int iters, F fn) {
    for (int i = 0; i < warm; i++) fn();
    CUDA_OK(cudaDeviceSynchronize());
    DDP_OK(ddp_barrier(g_group), g_group);
    double t0 = now();
    for (int i = 0; i < iters; i++) fn();
    CUDA_OK(cudaDeviceSynchronize());
    return (now() - t0) / iters;
}

/* Bytes a training forward + backward moves at the least: forward reads x twice (statistics, normalise)
   and writes y; backward reads dy and x twice (sums, input gradient) and writes dx: 8 passes of 4 bytes. */
static int bench_syncbn(int64_t N, int C, int64_t S) {
    const int64_t total = N * C * S;
    const double bytes = 8.0 * 4.0 * (double)total;
    float *x = dalloc(total, 0x3f), *y = dalloc(total, 0), *dy = dalloc(total, 0x3e), *dx = dalloc(total, 0); /* 0x3f..: finite */
    float *w = dalloc(C, 0), *b = dalloc(C, 0), *rm = dalloc(C, 0), *rv = dalloc(C, 0), *gw = dalloc(C, 0), *gb = dalloc(C, 0);
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    memset(&d, 0, sizeof d);
    d.num_features = C, d.weight = w, d.bias = b, d.running_mean = rm, d.running_var = rv;
    DDP_OK(ddp_syncbn_create(g_group, &d, &bn), g_group);
    const double t = timed(3, 20, [&] {
        DDP_OK(ddp_syncbn_forward(bn, x, y, N, S, 1), g_group);
        DDP_OK(ddp_syncbn_backward(bn, x, dy, dx, gw, gb, N, S), g_group);
    });
    const double tc = timed(3, 20, [&] { CUDA_OK(cudaMemcpyAsync(y, x, total * 4, cudaMemcpyDeviceToDevice, g_stream)); });
    if (g_rank == 0) {
        printf("syncbn_shape=N%lld_C%d_S%lld ranks=%d backend=%s\n", (long long)N, C, (long long)S, g_world,
               ddp_backend_name(g_group));
        printf("syncbn_ms=%.4f\nsyncbn_GBps=%.1f\ncopy_GBps=%.1f\nsyncbn_vs_copy=%.2f\n", t * 1e3, bytes / t / 1e9,
               2.0 * 4.0 * (double)total / tc / 1e9, (bytes / t) / (2.0 * 4.0 * (double)total / tc));
    }
    ddp_syncbn_destroy(bn);
    cudaFree(x), cudaFree(y), cudaFree(dy), cudaFree(dx), cudaFree(w), cudaFree(b), cudaFree(rm), cudaFree(rv),
        cudaFree(gw), cudaFree(gb);
    return 0;
}

static int bench_allreduce(void) {
    const size_t max_bytes = (size_t)256 << 20;
    float *buf;
    CUDA_OK(cudaMalloc(&buf, max_bytes));
    CUDA_OK(cudaMemset(buf, 0, max_bytes));
    if (g_rank == 0) printf("allreduce ranks=%d backend=%s\n| bytes | time (us) | algbw (GB/s) | busbw (GB/s) |\n|---|---|---|---|\n",
                            g_world, ddp_backend_name(g_group));
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
        const int iters = bytes >= ((size_t)64 << 20) ? 5 : 20;
        const double t = timed(2, iters, [&] { DDP_OK(ddp_all_reduce(g_group, buf, bytes / 4, DDP_F32, DDP_SUM), g_group); });
        const double alg = (double)bytes / t / 1e9, bus = alg * 2.0 * (g_world - 1) / g_world;
        if (g_rank == 0) printf("| %zu | %.1f | %.2f | %.2f |\n", bytes, t * 1e6, alg, bus);
    }
    cudaFree(buf);
    return 0;
}

/* One reducer step (begin_backward, grad_ready of every parameter in reverse, end_backward) over P
   parameters of numel floats, in seconds. flat = 0: every parameter and gradient its own cudaMalloc, so the
   buckets copy the gradients in and out; flat = 1: the gradients are slices of one allocation, in order,
   which the reducer reduces in place (no copies, as for llm.c's grads_memory). */
static double reducer_step(int P, int64_t numel, int flat) {
    std::vector<float *> params(P), grads(P);
    std::vector<int> idx(P);
    float *all_grads = flat ? dalloc((int64_t)P * numel, 0) : NULL;
    ddp_reducer *red;
    DDP_OK(ddp_reducer_create(g_group, NULL, &red), g_group);
    for (int p = 0; p < P; p++) {
        params[p] = dalloc(numel, 0), grads[p] = flat ? all_grads + (size_t)p * numel : dalloc(numel, 0);
        char name[16];
        snprintf(name, sizeof name, "p%d", p);
        DDP_OK(ddp_reducer_add_param(red, name, params[p], grads[p], numel, DDP_F32, &idx[p]), g_group);
    }
    DDP_OK(ddp_reducer_finalize(red), g_group);
    const double t = timed(2, 10, [&] {
        DDP_OK(ddp_reducer_begin_backward(red), g_group);
        for (int p = P - 1; p >= 0; p--) DDP_OK(ddp_reducer_grad_ready(red, idx[p]), g_group);
        DDP_OK(ddp_reducer_end_backward(red), g_group);
    });
    ddp_reducer_destroy(red);
    for (int p = 0; p < P; p++) cudaFree(params[p]);
    if (flat) cudaFree(all_grads);
    else for (int p = 0; p < P; p++) cudaFree(grads[p]);
    return t;
}

static int bench_reducer(void) {
    const int P = 64;
    const int64_t numel = 256 * 1024; /* 64 x 1 MiB of f32: 64 MiB of gradients */
    const double t_red = reducer_step(P, numel, 0), t_red_flat = reducer_step(P, numel, 1);
    float *flat = dalloc((int64_t)P * numel, 0);
    const double t_flat = timed(2, 10, [&] { DDP_OK(ddp_all_reduce(g_group, flat, (size_t)P * numel, DDP_F32, DDP_SUM), g_group); });
    cudaFree(flat);
    if (g_rank == 0)
        printf("reducer_params=%d\nreducer_MiB=%d\nreducer_ranks=%d\nreducer_backend=%s\nreducer_step_ms=%.3f\n"
               "reducer_inplace_step_ms=%.3f\nflat_allreduce_ms=%.3f\nreducer_overhead_ms=%.3f\n"
               "reducer_inplace_overhead_ms=%.3f\n", P, (int)(P * numel * 4 >> 20), g_world, ddp_backend_name(g_group),
               t_red * 1e3, t_red_flat * 1e3, t_flat * 1e3, (t_red - t_flat) * 1e3, (t_red_flat - t_flat) * 1e3);
    return 0;
}

/* The NCCL the dynamic loader gave this program (not the header's): NCCL_VERSION_CODE's encoding,
   major * 10000 + minor * 100 + patch from 2.9 on. */
static int print_nccl_version(void) {
    int v = 0;
    ncclResult_t rc = ncclGetVersion(&v);
    if (rc != ncclSuccess) {
        printf("FAIL ncclGetVersion: %s\n", ncclGetErrorString(rc));
        return 1;
    }
    printf("nccl_version=%d.%d.%d\nok nccl-version (code %d; header %d)\n", v / 10000, v / 100 % 100, v % 100, v,
           NCCL_VERSION_CODE);
    return 0;
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "";
    int rc;
    if (!strcmp(what, "nccl-version")) return print_nccl_version();
    if (strcmp(what, "syncbn") && strcmp(what, "reducer") && strcmp(what, "devbuf") && strcmp(what, "bench-syncbn") &&
        strcmp(what, "bench-allreduce") && strcmp(what, "bench-reducer")) {
        fprintf(stderr, "usage: gpu_check syncbn | reducer | devbuf | bench-syncbn [N C S] | bench-allreduce | bench-reducer | "
                "nccl-version\n");
        return 2;
    }
    start(!strcmp(what, "devbuf"));
    if (!strcmp(what, "syncbn")) rc = check_syncbn();
    else if (!strcmp(what, "devbuf")) rc = check_devbuf();
    else if (!strcmp(what, "reducer")) rc = check_reducer() | check_devbuf_fsdp(); /* nccl: zero_stage 3 on the device */
    else if (!strcmp(what, "bench-syncbn"))
        rc = bench_syncbn(argc > 4 ? atoll(argv[2]) : 32, argc > 4 ? atoi(argv[3]) : 128, argc > 4 ? atoll(argv[4]) : 56 * 56);
    else if (!strcmp(what, "bench-allreduce")) rc = bench_allreduce();
    else rc = bench_reducer();
    finish();
    return rc;
}
