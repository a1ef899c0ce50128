/* test_cuda_kernels.cpp: ddp_cuda.cu's kernels, run on the CPU by the harness of tests/cuda_harness
   (built by tests/test_cuda_kernels.sh: this file and ddp_cuda.cu compiled by g++ with
   -Itests/cuda_harness), checked through their C entry points against serial references written here:
   - SyncBatchNorm: for many shapes (C = 1, 3, 33, 257; spatial 1, 7, 1000; batches of 0 to thousands,
     over 1 to 3 simulated ranks), both layouts and f32/f16/bf16, every stage (stats, gather_stats,
     eval_stats, elemt, backward_reduce, backward_elemt) against f64 two-pass formulas, with tolerances
     that fit f32 accumulation plus the rounding of the output dtype.
   - SyncBatchNorm's device path (ddp_syncbn_forward/backward on device memory): the glue's sequence
     ddp__cuda_bn_forward/backward on 1-3 simulated ranks (the exchange plays the collectives), every
     rank's y, dx, local gradients, running stats and an eval step against BatchNorm over the whole batch.
   - Reducer: bucket copy-in / copy-out for every pair of f32/f64/f16/bf16, packed and scattered
     offsets, tensor counts across the per-launch table size, odd sizes across chunk boundaries, NULL
     gradients; the inf/nan check and unscale with infinities and NaNs in chosen places. These are exact
     (bit for bit): the documented arithmetic is a product in f32 (f64) and one rounding.
   - The harness itself: its f16/bf16 conversions against nearbyint-based rounding written here, shuffles
     and votes against the CUDA guide's definitions, a block reduction that is right with __syncthreads
     and caught without it, and every misuse it promises to report.
   Usage: test_cuda_kernels [--quick]   (--quick: the harness tests and a few shapes) */
#define DDP_CUDA
#define DDP__CUDA_GLUE /* also the private glue's declarations: ddp__cuda_bn_forward/backward (SyncBN's device path) */
#include "ddp.h" /* the declarations only: the test is independent of the library's own code */

#include "cuda_runtime.h" /* the harness (tests/cuda_harness), for its own tests */

#include <algorithm>
#include <cmath>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

/* CHECK(cond, "format", ...): on failure print where and why, and exit 1 (tests/check.h, not testlib.h,
   which would compile the whole library into this test, doubling the build time). */
#include "check.h"

/* CHECK_OK(call, err): the entry point must succeed; prints its message (the args' err buffer) if not. */
#define CHECK_OK(call, err)                                                                   \
    do {                                                                                      \
        ddp_result r_ = (call);                                                               \
        CHECK(r_ == DDP_SUCCESS, "%s returned %d: %s", #call, (int)r_, err);                  \
    } while (0)

static int g_quick;
static uint64_t g_rng = 0x5eed5eedull;

/* splitmix64 */
static uint64_t rnd() {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double uniform(double lo, double hi) { return lo + (hi - lo) * (double)(rnd() >> 11) / 9007199254740992.0; }
static int64_t irand(int64_t n) { return (int64_t)(rnd() % (uint64_t)n); }

/* ---- f16 / bf16 by arithmetic, independent of the harness's bit manipulation ----
   Rounding: scale x so that the format's grid becomes the integers and let nearbyint round half to
   even. Decoding: ldexp. Encoding a value already on the grid: frexp. */
static float ref_round(double x, int mantissa_bits, int min_exp, double max_finite) {
    int e;
    if (std::isnan(x) || x == 0.0 || std::isinf(x)) return (float)x;
    frexp(fabs(x), &e); /* |x| = m 2^e, m in [0.5, 1) */
    if (e - 1 < min_exp) e = min_exp + 1; /* subnormals: one fixed grid */
    const double ulp = ldexp(1.0, e - 1 - mantissa_bits), q = nearbyint(x / ulp) * ulp;
    if (fabs(q) > max_finite) return x > 0 ? INFINITY : -INFINITY;
    return (float)q;
}
static float ref_f16(double x) { return ref_round(x, 10, -14, 65504.0); }
static float ref_bf16(double x) { return ref_round((float)x, 7, -126, 3.3895313892515355e38); }
static float dec_f16(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (float)((h & 0x8000) ? -v : v);
}
static float dec_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t enc_f16(float v) { /* v on the f16 grid */
    const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
    const double a = fabs(v);
    int e;
    if (std::isnan(v)) return sign | 0x7e00;
    if (std::isinf(v)) return sign | 0x7c00;
    if (a < 0x1p-14) return (uint16_t)(sign | (uint16_t)(a * 0x1p24));
    const double m = frexp(a, &e);
    return (uint16_t)(sign | (e + 14) << 10 | (int)((m * 2 - 1) * 1024));
}
static uint16_t enc_bf16(float v) { /* v on the bf16 grid */
    uint32_t u;
    memcpy(&u, &v, 4);
    return std::isnan(v) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)(u >> 16);
}
static size_t dtype_bytes(ddp_dtype t) { return t == DDP_F64 ? 8 : t == DDP_F16 || t == DDP_BF16 ? 2 : 4; }

static const char *dtype_name(ddp_dtype t) {
    switch (t) {
    case DDP_F32: return "f32";
    case DDP_F64: return "f64";
    case DDP_F16: return "f16";
    case DDP_BF16: return "bf16";
    default: return "?";
    }
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }
static bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b)); }

/* A tensor of one dtype in host memory (the harness's device memory), read and written as f64 with the
   conversions above. */
struct tensor {
    ddp_dtype t;
    std::vector<unsigned char> bytes;
    tensor(ddp_dtype type, size_t n) : t(type), bytes(n * dtype_bytes(type)) {}
    size_t size() const { return bytes.size() / dtype_bytes(t); }
    void *data() { return bytes.data(); }
    double get(size_t i) const {
        const unsigned char *p = bytes.data() + i * dtype_bytes(t);
        uint16_t h;
        float f;
        double d;
        switch (t) {
        case DDP_F64: memcpy(&d, p, 8); return d;
        case DDP_F16: memcpy(&h, p, 2); return dec_f16(h);
        case DDP_BF16: memcpy(&h, p, 2); return dec_bf16(h);
        default: memcpy(&f, p, 4); return f;
        }
    }
    /* v rounded to the dtype (through f32 for the 16-bit ones). */
    void set(size_t i, double v) {
        unsigned char *p = bytes.data() + i * dtype_bytes(t);
        uint16_t h;
        const float f = (float)v;
        switch (t) {
        case DDP_F64: memcpy(p, &v, 8); break;
        case DDP_F16: h = enc_f16(ref_f16(f)); memcpy(p, &h, 2); break;
        case DDP_BF16: h = enc_bf16(ref_bf16(f)); memcpy(p, &h, 2); break;
        default: memcpy(p, &f, 4); break;
        }
    }
};

/* v rounded into dtype t (through f32 for the 16-bit ones), as tensor::set stores it. */
static double round_to(ddp_dtype t, double v) {
    switch (t) {
    case DDP_F64: return v;
    case DDP_F16: return ref_f16((float)v);
    case DDP_BF16: return ref_bf16((float)v);
    default: return (float)v;
    }
}

/* Relative rounding error allowed on an output of dtype t (one unit in the last place), and the
   smallest step near zero. */
static double out_rel(ddp_dtype t) { return t == DDP_F16 ? 0x1p-10 : t == DDP_BF16 ? 0x1p-7 : 0x1p-23; }
static double out_abs(ddp_dtype t) { return t == DDP_F16 ? 0x1p-24 : 1e-38; }

/* ======================================================================================== harness */

#define H_LAUNCH(kernel, grid, block) ddp_harness::launch(kernel, grid, block, 0, nullptr)

/* Expect the previous launch to have failed with a report containing `words`. */
static void expect_harness_error(cudaError_t want, const char *words) {
    cudaError_t e = cudaGetLastError();
    CHECK(e == want, "expected %s, got %s (%s)", cudaGetErrorName(want), cudaGetErrorName(e), cudaGetErrorString(e));
    CHECK(strstr(cudaGetErrorString(e), words), "the report \"%s\" does not say \"%s\"", cudaGetErrorString(e), words);
    CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError did not reset");
}

static void test_conversions() {
    /* every half and bfloat16 to float */
    for (uint32_t b = 0; b < 65536; b++) {
        __half h;
        __nv_bfloat16 bf;
        h.__x = (unsigned short)b;
        bf.__x = (unsigned short)b;
        const float want = dec_f16((uint16_t)b), got = __half2float(h);
        CHECK(same_bits(got, want) || (std::isnan(got) && std::isnan(want)), "__half2float(0x%04x) = %a, want %a", b, got, want);
        CHECK(same_bits(__bfloat162float(bf), dec_bf16((uint16_t)b)), "__bfloat162float(0x%04x)", b);
    }
    /* float to half / bfloat16: every representable value, the midpoints (ties) and their neighbours,
       specials, and random floats of every exponent */
    std::vector<float> xs = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.996f, 65520.0f, -65520.0f,
                             1e30f, 3.4028235e38f, -3.4028235e38f, 0x1p-24f, 0x1p-25f, 0x1.000002p-25f, 0x1.8p-24f,
                             0x1p-14f, 0x1.ff8p-15f, 1e-45f, -1e-45f, 1.0f, 1.0f / 3.0f};
    for (uint32_t b = 0; b < 0x7c00; b++) {
        const float v = dec_f16((uint16_t)b), next = dec_f16((uint16_t)(b + 1)), mid = (v + next) / 2;
        xs.push_back(v);
        xs.push_back(-mid);
        xs.push_back(mid);
        xs.push_back(nextafterf(mid, 0.0f));
        xs.push_back(nextafterf(mid, INFINITY));
    }
    for (uint32_t b = 0; b < 0x7f80; b += 7) {
        const float v = dec_bf16((uint16_t)b), next = dec_bf16((uint16_t)(b + 1)), mid = (v + next) / 2;
        xs.push_back(mid);
        xs.push_back(-nextafterf(mid, 0.0f));
        xs.push_back(nextafterf(mid, INFINITY));
    }
    for (int i = 0; i < 200000; i++) {
        const uint32_t u = (uint32_t)rnd();
        float f;
        memcpy(&f, &u, 4);
        xs.push_back(f);
    }
    for (float x : xs) {
        const float h = __half2float(__float2half_rn(x)), b = __bfloat162float(__float2bfloat16_rn(x));
        if (std::isnan(x)) {
            CHECK(std::isnan(h) && std::isnan(b), "NaN %a did not stay NaN (f16 %a, bf16 %a)", x, h, b);
            continue;
        }
        CHECK(same_bits(h, ref_f16(x)), "__float2half_rn(%a) = %a, want %a", x, h, ref_f16(x));
        CHECK(same_bits(b, ref_bf16(x)), "__float2bfloat16_rn(%a) = %a, want %a", x, b, ref_bf16(x));
    }
    printf("harness: f16/bf16 conversions agree with the reference on %zu floats and every 16-bit pattern\n", xs.size());
}

/* ---- kernels of the harness tests ---- */

/* out[block] = the sum of the block's values: warp shuffles, then the warps' partials through shared
   memory. sync = 0 leaves out the __syncthreads between writing and reading the partials. */
__global__ void hk_block_sum(const float *in, float *out, int sync) {
    __shared__ float partial[32];
    const unsigned nt = blockDim.x * blockDim.y, t = threadIdx.y * blockDim.x + threadIdx.x;
    float v = in[blockIdx.x * nt + t];
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (t % 32 == 0) partial[t / 32] = v;
    if (sync) __syncthreads();
    if (t < 32) {
        v = t < nt / 32 ? partial[t] : 0.0f;
        for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
        if (t == 0) out[blockIdx.x] = v;
    }
}

/* Every shuffle kind with width w, each lane exchanging a value that names it; 7 results per lane. */
__global__ void hk_shuffles(int *out, int w) {
    const int lane = (int)threadIdx.x % 32, v = 1000 * (int)blockIdx.x + (int)threadIdx.x;
    int *o = out + ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 7;
    o[0] = __shfl_up_sync(0xffffffffu, v, 3, w);
    o[1] = __shfl_down_sync(0xffffffffu, v, 5, w);
    o[2] = __shfl_xor_sync(0xffffffffu, v, 6, w);
    o[3] = __shfl_sync(0xffffffffu, v, 7 * lane + 2, w);
    o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
    o[5] = __any_sync(0xffffffffu, lane == 17 && blockIdx.x == 1);
    o[6] = __all_sync(0xffffffffu, lane < 32 && blockIdx.x != 2);
    __syncwarp();
    /* a 64-bit value, and a shuffle among the 16 lanes of a half-warp mask */
    const double d = __shfl_xor_sync(0xffffffffu, (double)v + 0.5, 1);
    if (d != (double)(v ^ 1) + 0.5) o[0] = -1; /* 1000 * block is even: v ^ 1 is the neighbour's value */
    if (lane < 16) {
        const int h = __shfl_down_sync(0x0000ffffu, v, 2, 16);
        if (h != (lane + 2 < 16 ? v + 2 : v)) o[1] = -1;
    }
}

__global__ void hk_returns_before_sync(int *out) {
    if (threadIdx.x < 5) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
__global__ void hk_deadlock(int *out) {
    if (threadIdx.x == 0)
        __syncthreads();
    else
        out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void hk_full_mask(int *out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1); }
__global__ void hk_mixed_ops(int *out) {
    const int v = (int)threadIdx.x;
    out[threadIdx.x] = threadIdx.x % 2 ? __shfl_down_sync(0xffffffffu, v, 1) : __shfl_xor_sync(0xffffffffu, v, 1);
}
__global__ void hk_mask_without_self(int *out) { out[threadIdx.x] = __shfl_sync(0x1u, (int)threadIdx.x, 0); }
__global__ void hk_reads_outside_mask(int *out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, (int)threadIdx.x, 1);
}
__global__ void hk_bad_width(int *out) { out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 1, 12); }
__global__ void hk_fill(int *out, int value) {
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x] = value;
}

static void test_block_sum() {
    const int blocks = 12;
    const dim3 shapes[] = {dim3(256), dim3(32, 8), dim3(64)};
    for (const dim3 &block : shapes) {
        const int nt = (int)(block.x * block.y);
        std::vector<float> in((size_t)blocks * nt), out(blocks);
        for (size_t i = 0; i < in.size(); i++) in[i] = (float)irand(100);
        H_LAUNCH(hk_block_sum, blocks, block)(in.data(), out.data(), 1);
        CHECK(cudaGetLastError() == cudaSuccess, "block sum: %s", cudaGetErrorString(cudaSuccess));
        int wrong = 0;
        for (int b = 0; b < blocks; b++) {
            float want = 0;
            for (int t = 0; t < nt; t++) want += in[(size_t)b * nt + t];
            CHECK(out[b] == want, "block sum of block %d: %g, want %g", b, out[b], want);
        }
        /* the same without the barrier: the harness's thread orders make some block read partials that
           were not written yet */
        H_LAUNCH(hk_block_sum, blocks, block)(in.data(), out.data(), 0);
        CHECK(cudaGetLastError() == cudaSuccess, "block sum without barrier");
        for (int b = 0; b < blocks; b++) {
            float want = 0;
            for (int t = 0; t < nt; t++) want += in[(size_t)b * nt + t];
            wrong += out[b] != want;
        }
        CHECK(wrong > 0, "a block reduction without __syncthreads gave the right sum in every block (%ux%u)", block.x,
              block.y);
        printf("harness: block sum (%ux%u) right with __syncthreads; without it %d of %d blocks wrong\n", block.x, block.y,
               wrong, blocks);
    }
}

static void test_shuffles() {
    const int blocks = 3, nt = 64;
    for (int w = 1; w <= 32; w *= 2) {
        std::vector<int> out((size_t)blocks * nt * 7);
        H_LAUNCH(hk_shuffles, blocks, nt)(out.data(), w);
        CHECK(cudaGetLastError() == cudaSuccess, "shuffles");
        for (int b = 0; b < blocks; b++)
            for (int t = 0; t < nt; t++) {
                /* CUDA programming guide, warp shuffle functions: lanes are grouped in segments of w */
                const int lane = t % 32, base = t - lane, seg = lane / w * w, pos = lane % w;
                const int *o = &out[((size_t)b * nt + t) * 7];
                auto val = [&](int l) { return 1000 * b + base + l; };
                const int up = pos >= 3 ? val(lane - 3) : val(lane);
                const int down = pos + 5 < w ? val(lane + 5) : val(lane);
                const int x = lane ^ 6, xr = x < seg + w ? val(x) : val(lane);
                const int idx = val(seg + (7 * lane + 2) % w);
                unsigned ballot = 0;
                for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
                CHECK(o[0] == up, "w %d lane %d: shfl_up %d, want %d", w, t, o[0], up);
                CHECK(o[1] == down, "w %d lane %d: shfl_down %d, want %d", w, t, o[1], down);
                CHECK(o[2] == xr, "w %d lane %d: shfl_xor %d, want %d", w, t, o[2], xr);
                CHECK(o[3] == idx, "w %d lane %d: shfl %d, want %d", w, t, o[3], idx);
                CHECK((unsigned)o[4] == ballot, "ballot 0x%08x", (unsigned)o[4]);
                CHECK(o[5] == (b == 1), "any: block %d thread %d: %d", b, t, o[5]);
                CHECK(o[6] == (b != 2), "all: block %d: %d", b, o[6]);
            }
    }
    printf("harness: shuffles (up, down, xor, idx; widths 1..32; 32- and 64-bit), ballot/any/all as specified\n");
}

static void test_misuse() {
    std::vector<int> out(2048);
    printf("harness: misuse on purpose; the 10 \"cuda harness:\" reports on stderr are expected\n");
    fflush(stdout);
    H_LAUNCH(hk_returns_before_sync, 1, 64)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "have returned");
    H_LAUNCH(hk_deadlock, 2, 64)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "deadlock");
    H_LAUNCH(hk_full_mask, 1, 48)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "do not exist");
    H_LAUNCH(hk_mixed_ops, 1, 32)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "different warp operations");
    H_LAUNCH(hk_mask_without_self, 1, 32)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "does not contain its own lane");
    H_LAUNCH(hk_reads_outside_mask, 1, 32)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "not in the mask");
    H_LAUNCH(hk_bad_width, 1, 32)(out.data());
    expect_harness_error(cudaErrorLaunchFailure, "power of 2");
    H_LAUNCH(hk_fill, 1, 2048)(out.data(), 1);
    expect_harness_error(cudaErrorInvalidConfiguration, "invalid launch configuration");
    H_LAUNCH(hk_fill, dim3(1, 70000), 32)(out.data(), 1);
    expect_harness_error(cudaErrorInvalidConfiguration, "invalid launch configuration");
    ddp_harness::launch(hk_fill, 1, 32, 16, nullptr)(out.data(), 1);
    expect_harness_error(cudaErrorInvalidValue, "dynamic shared memory");
    /* after all that, launches work again; every thread runs once with its own indices */
    std::fill(out.begin(), out.end(), 0);
    H_LAUNCH(hk_fill, dim3(4, 2), dim3(16, 16))(out.data(), 7);
    CHECK(cudaGetLastError() == cudaSuccess, "a launch after errors");
    for (int i = 0; i < 2048; i++) CHECK(out[i] == 7, "element %d: %d", i, out[i]);
    printf("harness: reports returned threads at __syncthreads, deadlocks, masks naming missing, exited or other lanes, "
           "mismatched warp operations, bad widths and configurations\n");
}

/* ======================================================================================== SyncBN */

struct bn_case {
    int C;
    int64_t S;
    int channels_last;
    ddp_dtype t;
    std::vector<int64_t> batches; /* one per simulated rank */
};

static int64_t bn_index(const bn_case &k, int64_t n, int64_t c, int64_t s) {
    return k.channels_last ? (n * k.S + s) * k.C + c : (n * k.C + c) * k.S + s;
}

/* Per channel statistics of one rank's (or all ranks') values, two-pass in f64. */
struct ref_stats {
    std::vector<double> n, mean, m2, spread; /* spread: the values' standard deviation or 1 */
};

static ref_stats bn_ref_stats(const bn_case &k, const std::vector<const tensor *> &xs,
                              const std::vector<int64_t> &batches) {
    ref_stats r;
    r.n.assign(k.C, 0);
    r.mean.assign(k.C, 0);
    r.m2.assign(k.C, 0);
    r.spread.assign(k.C, 1);
    for (int c = 0; c < k.C; c++) {
        double sum = 0, n = 0;
        for (size_t q = 0; q < xs.size(); q++)
            for (int64_t i = 0; i < batches[q]; i++)
                for (int64_t s = 0; s < k.S; s++) sum += xs[q]->get((size_t)bn_index(k, i, c, s)), n++;
        const double mean = n > 0 ? sum / n : 0;
        double m2 = 0;
        for (size_t q = 0; q < xs.size(); q++)
            for (int64_t i = 0; i < batches[q]; i++)
                for (int64_t s = 0; s < k.S; s++) {
                    const double d = xs[q]->get((size_t)bn_index(k, i, c, s)) - mean;
                    m2 += d * d;
                }
        r.n[c] = n;
        r.mean[c] = mean;
        r.m2[c] = m2;
        if (n > 1 && m2 > 0) r.spread[c] = sqrt(m2 / n);
    }
    return r;
}

static void close_to(double got, double want, double tol, const char *what, const bn_case &k, int c) {
    CHECK(fabs(got - want) <= tol, "%s (C=%d S=%lld %s %s, channel %d): %.9g, want %.9g (tolerance %.3g)", what, k.C,
          (long long)k.S, k.channels_last ? "channels_last" : "planar", dtype_name(k.t), c, got, want, tol);
}

/* NaN-filled scratch: a kernel that reads what it did not write shows. */
static std::vector<float> nan_work(int C) { return std::vector<float>(DDP_CUDA_BN_WORK_FLOATS(C), NAN); }

static void run_bn_case(const bn_case &k, int variant) {
    const int C = k.C, R = (int)k.batches.size();
    const double eps = 1e-5, factor = variant / 2 % 2 ? 0.1 : 0.5;
    const bool affine = variant % 3 != 2, track = variant % 4 != 3, in_place = variant % 2 == 1;
    char err[256] = "";
    ddp_cuda_bn_args a;
    std::vector<tensor> xs, dys;
    std::vector<const tensor *> xp;
    std::vector<float> weight(C), bias(C), rmean(C), rvar(C);
    memset(&a, 0, sizeof a);
    a.dtype = k.t == DDP_F32 && variant % 5 == 0 ? DDP_DTYPE_DEFAULT : k.t;
    a.spatial = k.S;
    a.channels = C;
    a.channels_last = k.channels_last;
    a.err = err;
    a.err_size = sizeof err;
    for (int c = 0; c < C; c++) {
        weight[c] = (float)uniform(0.5, 2.0);
        bias[c] = (float)uniform(-1, 1);
        rmean[c] = (float)uniform(-1, 1);
        rvar[c] = (float)uniform(0.5, 2);
    }
    /* Data: channel c centred at an offset of its own (Welford must cope), dy of both signs. */
    for (int q = 0; q < R; q++) {
        const size_t n = (size_t)(k.batches[q] * k.S * C);
        xs.emplace_back(k.t, n);
        dys.emplace_back(k.t, n);
        for (int64_t i = 0; i < k.batches[q]; i++)
            for (int c = 0; c < C; c++)
                for (int64_t s = 0; s < k.S; s++) {
                    const size_t j = (size_t)bn_index(k, i, c, s);
                    xs[q].set(j, (c % 7) - 2.5 + uniform(-1, 1) * (1 + c % 3));
                    dys[q].set(j, uniform(-1, 1));
                }
    }
    for (int q = 0; q < R; q++) xp.push_back(&xs[q]);

    /* ---- stats, per rank ---- */
    std::vector<double> records((size_t)R * (2 * C + 1));
    for (int q = 0; q < R; q++) {
        std::vector<float> work = nan_work(C);
        std::vector<double> rec(2 * C + 1, NAN);
        a.batch = k.batches[q];
        CHECK_OK(ddp_cuda_bn_stats(&a, xs[q].data(), work.data(), rec.data()), err);
        const ref_stats r = bn_ref_stats(k, {&xs[q]}, {k.batches[q]});
        CHECK(rec[2 * C] == (double)(k.batches[q] * k.S), "stats count %g", rec[2 * C]);
        for (int c = 0; c < C; c++) {
            close_to(rec[c], r.mean[c], 2e-6 * (fabs(r.mean[c]) + r.spread[c]), "stats mean", k, c);
            close_to(rec[C + c], r.m2[c], 1e-5 * r.m2[c] + 1e-30, "stats M2", k, c);
        }
        /* the gather below merges the exact records: each stage is checked on its own */
        double *dst = &records[(size_t)q * (2 * C + 1)];
        for (int c = 0; c < C; c++) dst[c] = r.mean[c], dst[C + c] = r.m2[c];
        dst[2 * C] = (double)(k.batches[q] * k.S);
    }

    /* ---- gather_stats ---- */
    const ref_stats g = bn_ref_stats(k, xp, k.batches);
    const double n = (double)[&] {
        int64_t t = 0;
        for (int64_t b : k.batches) t += b * k.S;
        return t;
    }();
    std::vector<float> mean(C, NAN), invstd(C, NAN), rm = rmean, rv = rvar;
    double count = NAN;
    CHECK_OK(ddp_cuda_bn_gather_stats(&a, records.data(), R, eps, factor, track ? rm.data() : NULL,
                                      track ? rv.data() : NULL, mean.data(), invstd.data(), &count),
             err);
    CHECK(count == n, "gathered count %g, want %g", count, n);
    for (int c = 0; c < C; c++) {
        const double want_invstd = n > 0 ? 1.0 / sqrt(g.m2[c] / n + eps) : 0.0;
        close_to(mean[c], g.mean[c], 1e-6 * (fabs(g.mean[c]) + g.spread[c]), "gathered mean", k, c);
        close_to(invstd[c], want_invstd, 1e-6 * want_invstd, "gathered invstd", k, c);
        if (!track) continue;
        const double want_rm = n >= 2 ? (1 - factor) * rmean[c] + factor * g.mean[c] : rmean[c];
        const double want_rv = n >= 2 ? (1 - factor) * rvar[c] + factor * g.m2[c] / (n - 1) : rvar[c];
        close_to(rm[c], want_rm, 1e-6 * (fabs(want_rm) + 1), "running_mean", k, c);
        close_to(rv[c], want_rv, 1e-6 * want_rv, "running_var", k, c);
    }

    /* ---- eval_stats ---- */
    {
        std::vector<float> m2(C, NAN), i2(C, NAN);
        CHECK_OK(ddp_cuda_bn_eval_stats(&a, rmean.data(), rvar.data(), eps, m2.data(), i2.data()), err);
        for (int c = 0; c < C; c++) {
            CHECK(m2[c] == rmean[c], "eval mean");
            close_to(i2[c], 1.0 / sqrt((double)rvar[c] + eps), 1e-7 / sqrt((double)rvar[c] + eps), "eval invstd", k, c);
        }
    }

    /* ---- elemt (training statistics), per rank; in place for odd variants ---- */
    for (int q = 0; q < R; q++) {
        tensor y(k.t, xs[q].size());
        if (in_place) y = xs[q];
        a.batch = k.batches[q];
        CHECK_OK(ddp_cuda_bn_elemt(&a, in_place ? y.data() : xs[q].data(), y.data(), affine ? weight.data() : NULL,
                                   affine ? bias.data() : NULL, mean.data(), invstd.data()),
                 err);
        for (int64_t i = 0; i < k.batches[q]; i++)
            for (int c = 0; c < C; c++)
                for (int64_t s = 0; s < k.S; s++) {
                    const size_t j = (size_t)bn_index(k, i, c, s);
                    const double w = affine ? weight[c] : 1.0, b = affine ? bias[c] : 0.0, x = xs[q].get(j);
                    const double scale = (double)invstd[c] * w, want = (x - mean[c]) * scale + b;
                    const double tol = out_rel(k.t) * fabs(want) + out_abs(k.t) +
                                       4e-7 * ((fabs(x) + fabs(mean[c])) * fabs(scale) + fabs(b));
                    close_to(y.get(j), want, tol, "elemt y", k, c);
                }
    }

    /* ---- backward_reduce, per rank ---- */
    std::vector<double> total(2 * C, 0.0);
    for (int q = 0; q < R; q++) {
        std::vector<float> work = nan_work(C), gw(C), gb(C);
        std::vector<double> sums(2 * C, NAN);
        for (int c = 0; c < C; c++) gw[c] = (float)uniform(-1, 1), gb[c] = (float)uniform(-1, 1);
        const std::vector<float> gw0 = gw, gb0 = gb;
        a.batch = k.batches[q];
        CHECK_OK(ddp_cuda_bn_backward_reduce(&a, dys[q].data(), xs[q].data(), mean.data(), invstd.data(), work.data(),
                                             sums.data(), affine ? gw.data() : NULL, affine ? gb.data() : NULL),
                 err);
        for (int c = 0; c < C; c++) {
            double sdy = 0, sdyx = 0, ady = 0, adyx = 0;
            for (int64_t i = 0; i < k.batches[q]; i++)
                for (int64_t s = 0; s < k.S; s++) {
                    const size_t j = (size_t)bn_index(k, i, c, s);
                    const double d = dys[q].get(j), xm = xs[q].get(j) - mean[c];
                    sdy += d, sdyx += d * xm, ady += fabs(d), adyx += fabs(d * xm);
                }
            close_to(sums[c], sdy, 1e-6 * ady + 1e-30, "sum_dy", k, c);
            close_to(sums[C + c], sdyx, 1e-6 * adyx + 1e-30, "sum_dy_xmu", k, c);
            if (affine) {
                close_to(gw[c], gw0[c] + sdyx * invstd[c], 1e-6 * (adyx * invstd[c] + fabs(gw0[c])), "grad_weight", k, c);
                close_to(gb[c], gb0[c] + sdy, 1e-6 * (ady + fabs(gb0[c])), "grad_bias", k, c);
            }
            total[c] += sdy;
            total[C + c] += sdyx;
        }
    }

    /* ---- backward_elemt with the all-reduced sums (training), then without (eval) ---- */
    for (int q = 0; q < R; q++)
        for (int eval = 0; eval < 2; eval++) {
            std::vector<float> work = nan_work(C);
            tensor dx(k.t, dys[q].size());
            if (in_place) dx = dys[q];
            a.batch = k.batches[q];
            CHECK_OK(ddp_cuda_bn_backward_elemt(&a, in_place ? dx.data() : dys[q].data(), xs[q].data(), dx.data(),
                                                affine ? weight.data() : NULL, mean.data(), invstd.data(),
                                                eval ? NULL : total.data(), eval ? NULL : &count, work.data()),
                     err);
            for (int64_t i = 0; i < k.batches[q]; i++)
                for (int c = 0; c < C; c++) {
                    const double w = affine ? weight[c] : 1.0, is = invstd[c], scale = is * w;
                    const double mdy = eval ? 0 : total[c] / n, proj = eval ? 0 : is * is * total[C + c] / n;
                    for (int64_t s = 0; s < k.S; s++) {
                        const size_t j = (size_t)bn_index(k, i, c, s);
                        const double d = dys[q].get(j), xm = xs[q].get(j) - mean[c];
                        const double want = (d - mdy - xm * proj) * scale;
                        const double tol = out_rel(k.t) * fabs(want) + out_abs(k.t) +
                                           4e-7 * (fabs(d) + fabs(mdy) + (fabs(xs[q].get(j)) + fabs(mean[c])) * fabs(proj)) *
                                               fabs(scale);
                        close_to(dx.get(j), want, tol, eval ? "backward_elemt dx (eval)" : "backward_elemt dx", k, c);
                    }
                }
        }
}

static void test_syncbn() {
    std::vector<bn_case> cases;
    const ddp_dtype types[] = {DDP_F32, DDP_F16, DDP_BF16};
    const int Cs[] = {1, 3, 33, 257};
    const int64_t Ss[] = {1, 7, 1000};
    int combo = 0;
    for (int C : Cs)
        for (int64_t S : Ss)
            for (int cl = 0; cl < 2; cl++, combo++)
                for (ddp_dtype t : types) {
                    std::vector<int64_t> b;
                    /* 257 channels planar or over 1000 positions cost the harness most: one dtype each */
                    if (C == 257 && (S == 1000 || (!cl && S > 1)) && t != types[combo % 3]) continue;
                    if (S == 1000)
                        b = C == 257 ? std::vector<int64_t>{1} : C == 33 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{3, 0, 2};
                    else if (S == 7)
                        b = C >= 33 ? std::vector<int64_t>{5, 2} : std::vector<int64_t>{9, 1, 4};
                    else
                        b = C >= 33 ? std::vector<int64_t>{37, 1, 0} : std::vector<int64_t>{301, 2};
                    cases.push_back(bn_case{C, S, cl, t, b});
                }
    /* Reductions spread over several blocks per channel (more than 16 x 256 values per channel). */
    cases.push_back(bn_case{3, 1000, 0, DDP_F32, {24, 5}});
    cases.push_back(bn_case{2, 500, 1, DDP_BF16, {30}});
    cases.push_back(bn_case{5, 1, 0, DDP_F16, {20001, 3}});
    cases.push_back(bn_case{9, 1, 1, DDP_F32, {9000}});
    /* Degenerate batches: one value in all, nothing at all. */
    cases.push_back(bn_case{3, 1, 0, DDP_F32, {1, 0}});
    cases.push_back(bn_case{4, 7, 1, DDP_F16, {0, 0}});
    if (g_quick) cases = {bn_case{33, 7, 0, DDP_F16, {5, 2}}, bn_case{33, 7, 1, DDP_BF16, {5, 2}}, bn_case{3, 1, 0, DDP_F32, {301, 2}}};
    int variant = 0;
    for (const bn_case &k : cases) run_bn_case(k, variant++);
    printf("syncbn: %zu shapes x ranks x layouts x dtypes: stats, gather_stats, eval_stats, elemt, backward_reduce, "
           "backward_elemt agree with the f64 reference\n", cases.size());
}

static void test_syncbn_errors() {
    char err[256] = "";
    ddp_cuda_bn_args a;
    float work[96], mean[1], invstd[1];
    double record[3];
    memset(&a, 0, sizeof a);
    a.err = err;
    a.err_size = sizeof err;
    CHECK(ddp_cuda_bn_stats(&a, NULL, work, record) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "channels is 0"), "%s", err);
    a.channels = 1;
    a.dtype = DDP_I8;
    CHECK(ddp_cuda_bn_elemt(&a, NULL, NULL, NULL, NULL, mean, invstd) == DDP_ERR_UNSUPPORTED, "%s", err);
    a.dtype = DDP_F16;
    a.batch = 2;
    a.spatial = 3;
    CHECK(ddp_cuda_bn_stats(&a, NULL, work, record) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "x"), "%s", err);
    CHECK(ddp_cuda_bn_gather_stats(&a, record, 1, 0.0, 0.1, NULL, NULL, mean, invstd, record) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(err, "eps"),
          "%s", err);
    CHECK(ddp_cuda_bn_stats(NULL, NULL, work, record) == DDP_ERR_INVALID_ARGUMENT, "NULL args");
}

/* ---- SyncBN's device path (ddp_syncbn_forward/backward on device memory): the glue's sequence ----
   ddp__cuda_bn_forward/backward, which src/syncbn.c calls for x in device memory, run here for each
   rank of R simulated ranks, with an exchange that plays the group's collectives: the all_gather
   fills the other ranks' records by running the statistics kernel on their batches, the all_reduce
   adds their backward sums. Every rank's y, dx, local parameter gradients and running stats, then an
   eval forward + backward, are checked against BatchNorm over the concatenated batch in f64 (two-pass,
   textbook formulas written here). */

struct dev_rank {
    std::vector<float> x, dy;
    int64_t batch;
};

struct dev_sim {
    int C, channels_last, me;
    int64_t S;
    const std::vector<dev_rank> *ranks;
    int gathers, reduces;
};

static ddp_cuda_bn_args dev_args(const dev_sim &sim, int64_t batch, char *err) {
    ddp_cuda_bn_args a;
    memset(&a, 0, sizeof a);
    a.dtype = DDP_F32, a.batch = batch, a.spatial = sim.S, a.channels = sim.C, a.channels_last = sim.channels_last;
    a.err = err, a.err_size = 256;
    return a;
}

static ddp_result dev_exchange(void *user, int what, double *buf, size_t count) {
    dev_sim *sim = (dev_sim *)user;
    const std::vector<dev_rank> &ranks = *sim->ranks;
    const int C = sim->C;
    char err[256] = "";
    std::vector<float> work = nan_work(C), mean(C), invstd(C), gw(C), gb(C);
    std::vector<double> sums(2 * C);
    if (what == DDP__CUDA_BN_GATHER) {
        sim->gathers++;
        CHECK(count == (size_t)(2 * C + 1), "gather of %zu doubles", count);
        for (int p = 0; p < (int)ranks.size(); p++) {
            if (p == sim->me) continue;
            ddp_cuda_bn_args a = dev_args(*sim, ranks[p].batch, err);
            CHECK_OK(ddp_cuda_bn_stats(&a, ranks[p].x.data(), work.data(), buf + (size_t)p * count), err);
        }
        return DDP_SUCCESS;
    }
    sim->reduces++;
    CHECK(what == DDP__CUDA_BN_REDUCE && count == (size_t)(2 * C), "exchange %d of %zu doubles", what, count);
    return DDP_SUCCESS; /* the sums of the other ranks are added by dev_exchange_sums (needs mean, invstd) */
}

/* The all_reduce, given the statistics every rank shares (this rank's mean and invstd after forward). */
struct dev_sim_reduce {
    dev_sim sim;
    const float *mean, *invstd;
};

static ddp_result dev_exchange_sums(void *user, int what, double *buf, size_t count) {
    dev_sim_reduce *sr = (dev_sim_reduce *)user;
    const std::vector<dev_rank> &ranks = *sr->sim.ranks;
    const int C = sr->sim.C;
    char err[256] = "";
    if (what == DDP__CUDA_BN_GATHER) return dev_exchange(&sr->sim, what, buf, count);
    dev_exchange(&sr->sim, what, buf, count);
    std::vector<float> work = nan_work(C);
    std::vector<double> sums(2 * C);
    for (int p = 0; p < (int)ranks.size(); p++) {
        if (p == sr->sim.me) continue;
        ddp_cuda_bn_args a = dev_args(sr->sim, ranks[p].batch, err);
        CHECK_OK(ddp_cuda_bn_backward_reduce(&a, ranks[p].dy.data(), ranks[p].x.data(), sr->mean, sr->invstd, work.data(),
                                             sums.data(), NULL, NULL),
                 err);
        for (size_t i = 0; i < count; i++) buf[i] += sums[i];
    }
    return DDP_SUCCESS;
}

static void run_device_path_case(int C, int64_t S, int channels_last, const std::vector<int64_t> &batches, bool affine) {
    const int R = (int)batches.size();
    const double eps = 1e-5, momentum = 0.1;
    std::vector<dev_rank> ranks(R);
    std::vector<float> weight(C), bias(C);
    for (int c = 0; c < C; c++) weight[c] = (float)uniform(0.5, 2.0), bias[c] = (float)uniform(-1, 1);
    for (int p = 0; p < R; p++) {
        ranks[p].batch = batches[p];
        ranks[p].x.resize((size_t)(batches[p] * S * C));
        ranks[p].dy.resize(ranks[p].x.size());
        for (size_t i = 0; i < ranks[p].x.size(); i++) ranks[p].x[i] = (float)uniform(-2, 3), ranks[p].dy[i] = (float)uniform(-1, 1);
    }
    auto at = [&](int64_t n, int c, int64_t s) { return channels_last ? (n * S + s) * C + c : (n * C + c) * S + s; };
    /* the f64 reference over the concatenated batch */
    std::vector<double> mean(C), var(C), invstd(C), sdy(C), sdyxmu(C), n(C);
    for (int c = 0; c < C; c++) {
        double sum = 0, m2 = 0;
        for (const dev_rank &r : ranks)
            for (int64_t i = 0; i < r.batch; i++)
                for (int64_t s = 0; s < S; s++) sum += r.x[at(i, c, s)], n[c]++;
        mean[c] = sum / n[c];
        for (const dev_rank &r : ranks)
            for (int64_t i = 0; i < r.batch; i++)
                for (int64_t s = 0; s < S; s++) {
                    const double d = r.x[at(i, c, s)] - mean[c];
                    m2 += d * d;
                    sdy[c] += r.dy[at(i, c, s)];
                    sdyxmu[c] += r.dy[at(i, c, s)] * d;
                }
        var[c] = m2 / n[c];
        invstd[c] = 1.0 / sqrt(var[c] + eps);
    }
    for (int me = 0; me < R; me++) {
        const dev_rank &r = ranks[me];
        const size_t total = r.x.size();
        char err[256] = "";
        std::vector<float> work = nan_work(C), bmean(C, NAN), binvstd(C, NAN), rm(C, 0.0f), rv(C, 1.0f), y(total, NAN),
            dx(total, NAN), gw(C, 0.0f), gb(C, 0.0f);
        std::vector<double> records((size_t)R * (2 * C + 1), NAN), sums(2 * C, NAN), count(1, NAN);
        dev_sim_reduce sr;
        sr.sim = dev_sim{C, channels_last, me, S, &ranks, 0, 0};
        sr.mean = bmean.data(), sr.invstd = binvstd.data();
        ddp__cuda_bn b;
        memset(&b, 0, sizeof b);
        b.a = dev_args(sr.sim, r.batch, err);
        b.nranks = R, b.rank = me, b.eps = eps;
        b.weight = affine ? weight.data() : NULL, b.bias = affine ? bias.data() : NULL;
        b.running_mean = rm.data(), b.running_var = rv.data();
        b.work = work.data(), b.mean = bmean.data(), b.invstd = binvstd.data();
        b.records = records.data(), b.sums = sums.data(), b.count = count.data();
        b.exchange = dev_exchange_sums, b.user = &sr;
        const int mode = R > 1 ? DDP__CUDA_BN_SYNCED : DDP__CUDA_BN_LOCAL;
        CHECK_OK(ddp__cuda_bn_forward(&b, mode, r.x.data(), y.data(), momentum), err);
        CHECK_OK(ddp__cuda_bn_backward(&b, mode, r.dy.data(), r.x.data(), dx.data(), gw.data(), gb.data()), err);
        CHECK(sr.sim.gathers == (R > 1) && sr.sim.reduces == (R > 1), "rank %d of %d: %d gathers, %d reduces", me, R,
              sr.sim.gathers, sr.sim.reduces);
        for (int c = 0; c < C; c++) {
            const double w = affine ? weight[c] : 1.0, bb = affine ? bias[c] : 0.0;
            double lgw = 0, lgb = 0, ymax = 1, dxmax = 1e-3;
            for (int64_t i = 0; i < r.batch; i++)
                for (int64_t s = 0; s < S; s++) {
                    const int64_t j = at(i, c, s);
                    const double xmu = r.x[j] - mean[c];
                    const double want_y = xmu * invstd[c] * w + bb;
                    const double want_dx = (r.dy[j] - sdy[c] / n[c] - xmu * invstd[c] * invstd[c] * sdyxmu[c] / n[c]) * invstd[c] * w;
                    ymax = std::max(ymax, fabs(want_y)), dxmax = std::max(dxmax, fabs(want_dx));
                    CHECK(fabs(y[j] - want_y) <= 2e-5 * ymax + 1e-5, "rank %d/%d c %d: y %.9g, want %.9g", me, R, c, y[j], want_y);
                    CHECK(fabs(dx[j] - want_dx) <= 1e-4 * dxmax, "rank %d/%d c %d: dx %.9g, want %.9g", me, R, c, dx[j], want_dx);
                    lgw += r.dy[j] * xmu * invstd[c];
                    lgb += r.dy[j];
                }
            CHECK(fabs(gw[c] - lgw) <= 1e-4 * (1 + fabs(lgw)) && fabs(gb[c] - lgb) <= 1e-4 * (1 + fabs(lgb)),
                  "rank %d/%d c %d: local grad_weight %.9g grad_bias %.9g, want %.9g %.9g", me, R, c, gw[c], gb[c], lgw, lgb);
            const double want_rm = momentum * mean[c], want_rv = (1 - momentum) + momentum * var[c] * n[c] / (n[c] - 1);
            CHECK(fabs(rm[c] - want_rm) <= 1e-5 * (1 + fabs(want_rm)) && fabs(rv[c] - want_rv) <= 1e-5 * (1 + want_rv),
                  "rank %d/%d c %d: running %.9g %.9g, want %.9g %.9g", me, R, c, rm[c], rv[c], want_rm, want_rv);
        }
        /* eval with the running stats just updated: no exchange, dx = dy * weight / sqrt(running_var + eps) */
        std::fill(gw.begin(), gw.end(), 0.0f);
        CHECK_OK(ddp__cuda_bn_forward(&b, DDP__CUDA_BN_EVAL, r.x.data(), y.data(), 0.0), err);
        CHECK_OK(ddp__cuda_bn_backward(&b, DDP__CUDA_BN_EVAL, r.dy.data(), r.x.data(), dx.data(), gw.data(), NULL), err);
        CHECK(sr.sim.gathers == (R > 1) && sr.sim.reduces == (R > 1), "eval exchanged (rank %d of %d)", me, R);
        for (int c = 0; c < C; c++) {
            const double w = affine ? weight[c] : 1.0, bb = affine ? bias[c] : 0.0, is = 1.0 / sqrt((double)rv[c] + eps);
            double lgw = 0;
            for (int64_t i = 0; i < r.batch; i++)
                for (int64_t s = 0; s < S; s++) {
                    const int64_t j = at(i, c, s);
                    const double want_y = (r.x[j] - (double)rm[c]) * is * w + bb, want_dx = r.dy[j] * is * w;
                    CHECK(fabs(y[j] - want_y) <= 1e-5 * (1 + fabs(want_y)), "eval rank %d c %d: y %.9g, want %.9g", me, c, y[j], want_y);
                    CHECK(fabs(dx[j] - want_dx) <= 1e-5 * (1 + fabs(want_dx)), "eval rank %d c %d: dx %.9g, want %.9g", me, c, dx[j], want_dx);
                    lgw += r.dy[j] * (r.x[j] - (double)rm[c]) * is;
                }
            CHECK(fabs(gw[c] - lgw) <= 1e-4 * (1 + fabs(lgw)), "eval rank %d c %d: grad_weight %.9g, want %.9g", me, c, gw[c], lgw);
        }
    }
}

static void test_syncbn_device_path() {
    run_device_path_case(3, 5, 0, {6}, true);                 /* one rank: local statistics, no exchange */
    run_device_path_case(5, 1, 1, {4, 0, 3}, true);           /* three ranks, one with an empty batch */
    run_device_path_case(4, 7, 0, {3, 2}, false);             /* two ranks, planar, no affine parameters */
    run_device_path_case(33, 3, 1, {2, 5}, true);             /* channels-last, more channels than a warp */
    printf("syncbn device path: ddp__cuda_bn_forward/backward (stats, exchange, gather_stats, elemt; backward_reduce, "
           "exchange, backward_elemt; eval) on 1-3 simulated ranks agree with BatchNorm over the whole batch\n");
}

/* ======================================================================================== reducer */

/* The documented arithmetic: v = g * scale in f32 (f64 when either side is f64), rounded into the
   destination through f32 for f16/bf16. The test's own encoders and decoders do the rounding. */
static double ref_scaled(double g, ddp_dtype src, ddp_dtype dst, double scale) {
    if (src == DDP_F64 || dst == DDP_F64) return g * scale;
    return (double)((float)g * (float)scale);
}

static ddp_dtype pick(int i) {
    const ddp_dtype t[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16};
    return t[i % 4];
}

/* Random tensor sizes: mostly small and odd, some empty, some across the 1024-element chunks. */
static int64_t random_numel() {
    const int64_t special[] = {0, 1, 1023, 1024, 1025, 4095, 4096, 4097, 8191, 12289, 3};
    const int64_t r = irand(20);
    if (r < 3) return special[irand((int64_t)(sizeof special / sizeof special[0]))];
    if (r < 5) return 1000 + irand(9000);
    return 1 + irand(300);
}

static void run_bucket_case(int count, ddp_dtype gt, ddp_dtype bt, double scale, bool scattered, int null_every) {
    char err[256] = "";
    std::vector<tensor> grads;
    std::vector<void *> ptrs(count);
    std::vector<int64_t> numels(count), offsets(count);
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        numels[i] = random_numel();
        if (scattered) total += irand(5); /* gaps between slots; the order of slots is reversed below */
        offsets[i] = total;
        total += numels[i];
    }
    if (scattered) /* slots in the opposite order of the list, as buckets in reverse registration order */
        for (int i = 0; i < count; i++) offsets[i] = total - offsets[i] - numels[i];
    for (int i = 0; i < count; i++) {
        grads.emplace_back(gt, (size_t)numels[i]);
        for (int64_t j = 0; j < numels[i]; j++) grads[i].set((size_t)j, uniform(-3, 3) * pow(2.0, (double)irand(40) - 20));
        ptrs[i] = null_every && i % null_every == null_every - 1 ? NULL : grads[i].data();
    }
    const int64_t bucket_numel = total + 3;
    tensor bucket(bt, (size_t)bucket_numel);
    for (int64_t j = 0; j < bucket_numel; j++) bucket.set((size_t)j, -7.25); /* a sentinel in the gaps */
    ddp_cuda_grads_args a;
    memset(&a, 0, sizeof a);
    a.count = count;
    a.grads = ptrs.data();
    a.numels = numels.data();
    a.dtype = gt == DDP_F32 && count % 2 ? DDP_DTYPE_DEFAULT : gt;
    a.err = err;
    a.err_size = sizeof err;
    const int64_t *offs = scattered ? offsets.data() : NULL;

    CHECK_OK(ddp_cuda_bucket_copy_in(&a, bucket.data(), bt, bucket_numel, offs, scale), err);
    std::vector<bool> covered((size_t)bucket_numel, false);
    for (int i = 0; i < count; i++)
        for (int64_t j = 0; j < numels[i]; j++) {
            const size_t at = (size_t)(offsets[i] + j);
            const double want = round_to(bt, ptrs[i] ? ref_scaled(grads[i].get((size_t)j), gt, bt, scale) : 0.0);
            covered[at] = true;
            CHECK(same_value(bucket.get(at), want), "copy_in %s -> %s, %d tensors, tensor %d[%lld]: %.9g, want %.9g",
                  dtype_name(gt), dtype_name(bt), count, i, (long long)j, bucket.get(at), want);
        }
    for (int64_t j = 0; j < bucket_numel; j++)
        CHECK(covered[(size_t)j] || bucket.get((size_t)j) == -7.25, "copy_in wrote outside the slots at %lld", (long long)j);

    /* the bucket as an all-reduce would leave it, then back into the gradients */
    for (int64_t j = 0; j < bucket_numel; j++) bucket.set((size_t)j, uniform(-2, 2));
    std::vector<tensor> before = grads;
    const double back = scale == 1.0 ? 1.0 : 3.0;
    CHECK_OK(ddp_cuda_bucket_copy_out(&a, bucket.data(), bt, bucket_numel, offs, back), err);
    for (int i = 0; i < count; i++)
        for (int64_t j = 0; j < numels[i]; j++) {
            const double want = ptrs[i] ? round_to(gt, ref_scaled(bucket.get((size_t)(offsets[i] + j)), bt, gt, back))
                                        : before[i].get((size_t)j);
            CHECK(same_value(grads[i].get((size_t)j), want), "copy_out %s -> %s, tensor %d[%lld]: %.9g, want %.9g",
                  dtype_name(bt), dtype_name(gt), i, (long long)j, grads[i].get((size_t)j), want);
        }

    /* the nccl backend's accumulate: grads += bucket, the sum in the copy's arithmetic, rounded once */
    before = grads;
    CHECK_OK(ddp__cuda_bucket_add(&a, bucket.data(), bt, bucket_numel, offs), err);
    for (int i = 0; i < count; i++)
        for (int64_t j = 0; j < numels[i]; j++) {
            const double old = before[i].get((size_t)j), b = bucket.get((size_t)(offsets[i] + j));
            const double sum = gt == DDP_F64 || bt == DDP_F64 ? old + b : (double)((float)old + (float)b);
            const double want = ptrs[i] ? round_to(gt, sum) : old;
            CHECK(same_value(grads[i].get((size_t)j), want), "add %s into %s, tensor %d[%lld]: %.9g, want %.9g",
                  dtype_name(bt), dtype_name(gt), i, (long long)j, grads[i].get((size_t)j), want);
        }
}

static void test_buckets() {
    const int counts[] = {0, 1, 2, 5, 47, 48, 49, 100, 130};
    int runs = 0;
    for (int gi = 0; gi < 4; gi++)
        for (int bi = 0; bi < 4; bi++) {
            const int r = gi * 4 + bi;
            const int count = counts[r % 9], n2 = counts[(r + 4) % 9];
            run_bucket_case(count, pick(gi), pick(bi), 1.0 / 3.0, r % 2 == 0, r % 3 == 0 ? 4 : 0);
            run_bucket_case(n2, pick(gi), pick(bi), 1.0, r % 2 == 1, 0);
            runs += 2;
            if (g_quick && r >= 3) break;
        }
    /* gradient_as_bucket_view: the gradients are their own slots, scaled in place */
    {
        tensor bucket(DDP_F32, 10000);
        std::vector<int64_t> numels = {4097, 5903};
        void *ptrs[2] = {bucket.data(), (float *)bucket.data() + 4097};
        std::vector<double> before(10000);
        for (size_t j = 0; j < 10000; j++) bucket.set(j, uniform(-1, 1)), before[j] = bucket.get(j);
        ddp_cuda_grads_args a;
        char err[256] = "";
        memset(&a, 0, sizeof a);
        a.err = err;
        a.err_size = sizeof err;
        a.count = 2;
        a.grads = ptrs;
        a.numels = numels.data();
        a.dtype = DDP_F32;
        CHECK_OK(ddp_cuda_bucket_copy_in(&a, bucket.data(), DDP_DTYPE_DEFAULT, 10000, NULL, 0.25), err);
        for (size_t j = 0; j < 10000; j++) CHECK(bucket.get(j) == before[j] * 0.25, "in place at %zu", j);
    }
    printf("reducer: %d bucket copy-in/copy-out/add runs (every pair of f32/f64/f16/bf16, 0..130 tensors, packed and "
           "scattered slots, NULL gradients) exact, and in place\n", runs);
}

static void run_unscale_case(ddp_dtype t, int count, float inv_scale, int bad, float found0) {
    std::vector<tensor> grads;
    std::vector<void *> ptrs(count);
    std::vector<int64_t> numels(count);
    std::vector<tensor> before;
    const double specials[] = {INFINITY, -INFINITY, NAN};
    for (int i = 0; i < count; i++) {
        numels[i] = random_numel();
        grads.emplace_back(t, (size_t)numels[i]);
        for (int64_t j = 0; j < numels[i]; j++) grads[i].set((size_t)j, uniform(-100, 100));
        ptrs[i] = i == 3 ? NULL : grads[i].data();
    }
    /* bad: 0 none, 1 the first element of the first non-empty tensor, 2 the last of the last one, 3 the
       middle of one past the first launch's table of 48 tensors */
    int placed = 0;
    auto place = [&](int i, int64_t j, double v) {
        if (i < count && i != 3 && j >= 0 && j < numels[i]) grads[i].set((size_t)j, v), placed++;
    };
    for (int i = 0; bad == 1 && i < count && !placed; i++) place(i, 0, specials[i % 3]);
    for (int i = count - 1; bad == 2 && i >= 0 && !placed; i--) place(i, numels[i] - 1, specials[(i + 1) % 3]);
    for (int i = 49; bad == 3 && i < count && !placed; i++) place(i, numels[i] / 2, NAN);
    before = grads;
    float found = found0, inv = inv_scale;
    ddp_cuda_grads_args a;
    char err[256] = "";
    memset(&a, 0, sizeof a);
    a.count = count;
    a.grads = ptrs.data();
    a.numels = numels.data();
    a.dtype = t;
    a.err = err;
    a.err_size = sizeof err;
    CHECK_OK(ddp_cuda_non_finite_check_and_unscale(&a, &found, &inv), err);
    bool any = false;
    for (int i = 0; i < count; i++)
        for (int64_t j = 0; j < numels[i]; j++) {
            const double g = before[i].get((size_t)j);
            double want = g;
            if (i != 3) {
                any |= !std::isfinite(g);
                if (inv_scale != 1.0f)
                    want = round_to(t, t == DDP_F64 ? g * (double)inv_scale : (double)((float)g * inv_scale));
            }
            CHECK(same_value(grads[i].get((size_t)j), want), "unscale %s tensor %d[%lld]: %.9g, want %.9g", dtype_name(t),
                  i, (long long)j, grads[i].get((size_t)j), want);
        }
    CHECK(any == (bad != 0 && placed > 0), "test setup: bad %d placed %d", bad, placed);
    CHECK(found == (any || found0 != 0 ? 1.0f : 0.0f), "found_inf %g (non-finite present: %d, initially %g)", found, any,
          found0);
}

static void test_unscale() {
    int runs = 0;
    for (int ti = 0; ti < 4; ti++)
        for (int bad = 0; bad < 4; bad++) {
            const int count = bad == 3 ? 60 : 1 + 7 * bad + ti;
            run_unscale_case(pick(ti), count, bad % 2 ? 1.0f / 65536.0f : bad ? 1.0f : 0.3f, bad, 0.0f);
            runs++;
            if (g_quick) break;
        }
    run_unscale_case(DDP_F16, 9, 0.5f, 0, 1.0f); /* found_inf is never cleared */
    run_unscale_case(DDP_F32, 0, 0.5f, 0, 0.0f);
    printf("reducer: %d inf/nan check + unscale runs (f32/f64/f16/bf16, infinities and NaNs placed first, last, "
           "past the first launch) exact; found_inf set only when due and never cleared\n", runs + 2);
}

static void test_reducer_errors() {
    char err[256] = "";
    float buf[16], found = 0, inv = 1;
    void *ptrs[2] = {buf, buf + 8};
    int64_t numels[2] = {8, 8}, offsets[2] = {0, 9};
    ddp_cuda_grads_args a;
    memset(&a, 0, sizeof a);
    a.err = err;
    a.err_size = sizeof err;
    a.count = -1;
    CHECK(ddp_cuda_bucket_copy_in(&a, buf, DDP_F32, 16, NULL, 1.0) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "count"), "%s",
          err);
    a.count = 2;
    CHECK(ddp_cuda_bucket_copy_out(&a, buf, DDP_F32, 16, NULL, 1.0) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "grads"),
          "%s", err);
    a.grads = ptrs;
    a.numels = numels;
    a.dtype = DDP_I32;
    CHECK(ddp_cuda_non_finite_check_and_unscale(&a, &found, &inv) == DDP_ERR_UNSUPPORTED && strstr(err, "dtype"), "%s", err);
    a.dtype = DDP_F16;
    CHECK(ddp_cuda_bucket_copy_in(&a, buf, DDP_U8, 16, NULL, 1.0) == DDP_ERR_UNSUPPORTED && strstr(err, "bucket_dtype"), "%s",
          err);
    CHECK(ddp_cuda_bucket_copy_in(&a, buf, DDP_F32, 15, NULL, 1.0) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "16 elements"),
          "%s", err);
    CHECK(ddp_cuda_bucket_copy_in(&a, buf, DDP_F32, 16, offsets, 1.0) == DDP_ERR_INVALID_ARGUMENT &&
              strstr(err, "tensor 1 (8 elements at offset 9)"),
          "%s", err);
    CHECK(ddp_cuda_bucket_copy_in(&a, NULL, DDP_F32, 16, NULL, 1.0) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "bucket"), "%s",
          err);
    CHECK(ddp_cuda_bucket_copy_out(&a, buf, DDP_F32, 16, NULL, NAN) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "scale"), "%s",
          err);
    numels[1] = -1;
    CHECK(ddp_cuda_bucket_copy_in(&a, buf, DDP_F32, 16, NULL, 1.0) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "numels[1]"),
          "%s", err);
    numels[1] = 8;
    CHECK(ddp_cuda_non_finite_check_and_unscale(&a, NULL, &inv) == DDP_ERR_INVALID_ARGUMENT && strstr(err, "found_inf"),
          "%s", err);
    CHECK(ddp_cuda_non_finite_check_and_unscale(NULL, &found, &inv) == DDP_ERR_INVALID_ARGUMENT, "NULL args");
}

int main(int argc, char **argv) {
    g_quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    test_conversions();
    test_block_sum();
    test_shuffles();
    test_misuse();
    test_syncbn_errors();
    test_reducer_errors();
    test_buckets();
    test_unscale();
    test_syncbn();
    test_syncbn_device_path();
    printf("ok\n");
    return 0;
}
