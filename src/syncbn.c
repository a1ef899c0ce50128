/* [SECTION] syncbn (implementation): SyncBatchNorm on the CPU, f32 data, f64 statistics
   The algorithm is described with the declarations (src/syncbn.h). Here: how the passes are laid out.

   Every stage is one pass over its inputs: statistics (x), normalisation (x -> y), backward sums
   (x, dy), input gradient (x, dy -> dx). The unit of work is 8 "columns" by some rows. In the
   channels-first layout a (sample, channel) plane is one run of `spatial` floats, cut into rows of 8
   lanes that belong to the same channel (summed at the end). In the channels-last layout (and
   channels-first with spatial 1: the same memory) x is read row by row in memory order, a row's C
   channels 8 at a time, their per-channel accumulators staying in cache (walking a tile of rows one
   group of channels at a time was slower: strided reads that the prefetchers do not follow).
   Fixed-width lanes with their own accumulators let compilers vectorise the loops at -O2 without
   -ffast-math (no sum is reassociated). Statistics are sums of (x - shift) and (x - shift)^2 in f64,
   shift being the channel's first value, so the one-pass variance does not cancel catastrophically. */
#include "internal.h"

#define DDP__BN_LANES 8

/* Compiler hints, neither needed for correctness: inline the column kernels into the passes (so the
   width 8 is a constant there), and unroll the lanes (so their accumulators stay in registers: without
   it GCC -O2 keeps them in memory and runs at half speed). */
#if defined(__GNUC__) || defined(__clang__)
#define DDP__BN_INLINE static inline __attribute__((always_inline))
#else
#define DDP__BN_INLINE static inline
#endif
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) /* nvcc warns on the GCC pragma (#1675) */
#define DDP__BN_UNROLL _Pragma("GCC unroll 8")
#else
#define DDP__BN_UNROLL
#endif

/* What the last forward saved for backward. */
enum { DDP__BN_SAVED_NONE = 0, DDP__BN_SAVED_SYNCED, DDP__BN_SAVED_LOCAL, DDP__BN_SAVED_EVAL };

#ifdef DDP_CUDA
/* The device path (a build with DDP_CUDA and ddp_cuda.o; see ddp__bn_dev_forward): the kernels' state,
   and the group's collectives of the last step that are waited one step later. */
typedef struct ddp__bn_device {
    ddp__cuda_bn cu;
    int ready;             /* the scratch in cu is allocated (a forward ran on the device) */
    int mode;              /* the last forward's DDP__CUDA_BN_* mode on the device; 0: it ran on the host */
    ddp_work *pending[2];  /* the last all_gather [0] and all_reduce [1] on the nccl backend, not yet waited */
    char err[DDP__ERR_MAX]; /* the kernels' messages */
} ddp__bn_device;
static void ddp__bn_dev_release(ddp_syncbn *bn);
#endif

struct ddp_syncbn {
    ddp_group *errors; /* the group given to create: errors are reported there (NULL: thread-local) */
    ddp_group *group;  /* statistics are merged over it; NULL = no communication */
    int nranks, rank;  /* in group (1 and 0 without one) */
    int channels, channels_last;
    double eps, momentum; /* momentum < 0: cumulative average */
    float *weight, *bias, *running_mean, *running_var;
    int64_t *num_batches_tracked; /* the program's counter (desc.num_batches_tracked) or &own_count; host memory */
    int64_t own_count;            /* the counter when the program gives none */

    int saved; /* DDP__BN_SAVED_*: what mean/invstd hold */
    int64_t saved_batch, saved_spatial;
    double saved_count; /* n of the saved statistics (over the group when synced) */
    float *mean, *invstd; /* C each: what the last forward normalised with */

    double *records; /* nranks * (2C + 1): the all-gathered [mean, M2, count] of every rank */
    int records_ranks; /* how many ranks' records it holds room for */
    double *sums;    /* 2C: per-channel accumulators of the current pass */
    double *shift;   /* C: per-channel shift of the statistics pass; then mean in f64 for backward */
    float *coef;     /* 3C: per-channel factors of the element-wise passes */
#ifdef DDP_CUDA
    ddp__bn_device dev; /* the device path (x in device memory): scratch, pending collectives */
#endif
};

/* ---- the column kernels: w columns of `rows` rows, row r at x + r * stride ----
   w is always a constant at the call, DDP__BN_LANES or 1 (tails), so that after inlining every lane
   loop has a fixed trip count: vectorised, and no false maybe-uninitialized warnings from GCC. */

DDP__BN_INLINE void ddp__bn_cols_stats(const float *x, int64_t stride, int64_t rows, int w, const double *shift,
                                       double *s1, double *s2) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], k[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = s1[j];
        a2[j] = s2[j];
        k[j] = shift[j];
    }
    for (r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        DDP__BN_UNROLL for (j = 0; j < w; j++) {
            double d = (double)row[j] - k[j];
            a1[j] += d;
            a2[j] += d * d;
        }
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        s1[j] = a1[j];
        s2[j] = a2[j];
    }
}

DDP__BN_INLINE void ddp__bn_cols_normalize(const float *x, float *y, int64_t stride, int64_t rows, int w,
                                           const float *mean, const float *scale, const float *shift) {
    float m[DDP__BN_LANES], a[DDP__BN_LANES], b[DDP__BN_LANES], t[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        m[j] = mean[j];
        a[j] = scale[j];
        b[j] = shift[j];
    }
    for (r = 0; r < rows; r++) {
        DDP__BN_UNROLL for (j = 0; j < w; j++) t[j] = x[r * stride + j]; /* loaded first: y may be x */
        DDP__BN_UNROLL for (j = 0; j < w; j++) y[r * stride + j] = ddp__bn_normalize(t[j], m[j], a[j], b[j]);
    }
}

DDP__BN_INLINE void ddp__bn_cols_backward_sums(const float *dy, const float *x, int64_t stride, int64_t rows, int w,
                                               const double *mean, double *sum_dy, double *sum_dy_xmu) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], m[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = sum_dy[j];
        a2[j] = sum_dy_xmu[j];
        m[j] = mean[j];
    }
    for (r = 0; r < rows; r++) {
        const float *g = dy + r * stride, *v = x + r * stride;
        DDP__BN_UNROLL for (j = 0; j < w; j++) {
            double d = (double)g[j];
            a1[j] += d;
            a2[j] += d * ((double)v[j] - m[j]);
        }
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        sum_dy[j] = a1[j];
        sum_dy_xmu[j] = a2[j];
    }
}

DDP__BN_INLINE void ddp__bn_cols_grad_input(const float *dy, const float *x, float *dx, int64_t stride, int64_t rows,
                                            int w, const float *mean, const float *mean_dy, const float *proj,
                                            const float *scale) {
    float m[DDP__BN_LANES], md[DDP__BN_LANES], p[DDP__BN_LANES], a[DDP__BN_LANES];
    float g[DDP__BN_LANES], v[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        m[j] = mean[j];
        md[j] = mean_dy[j];
        p[j] = proj[j];
        a[j] = scale[j];
    }
    for (r = 0; r < rows; r++) {
        DDP__BN_UNROLL for (j = 0; j < w; j++) { /* loaded first: dx may be dy */
            g[j] = dy[r * stride + j];
            v[j] = x[r * stride + j];
        }
        DDP__BN_UNROLL for (j = 0; j < w; j++)
            dx[r * stride + j] = ddp__bn_grad_input(g[j], v[j], m[j], md[j], p[j], a[j]);
    }
}

/* One row of w (DDP__BN_LANES or 1) channels into per-channel accumulators in memory (channels-last):
   everything loaded before anything is stored, so the lanes vectorise. */
DDP__BN_INLINE void ddp__bn_row_stats(const float *x, int w, const double *shift, double *s1, double *s2) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], d[DDP__BN_LANES];
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = s1[j];
        a2[j] = s2[j];
        d[j] = (double)x[j] - shift[j];
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) s1[j] = a1[j] + d[j]; /* one array after the other: */
    DDP__BN_UNROLL for (j = 0; j < w; j++) s2[j] = a2[j] + d[j] * d[j]; /* no store reordering needed */
}

DDP__BN_INLINE void ddp__bn_row_backward_sums(const float *dy, const float *x, int w, const double *mean,
                                              double *sum_dy, double *sum_dy_xmu) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], g[DDP__BN_LANES], v[DDP__BN_LANES];
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = sum_dy[j];
        a2[j] = sum_dy_xmu[j];
        g[j] = (double)dy[j];
        v[j] = (double)x[j] - mean[j];
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) sum_dy[j] = a1[j] + g[j];
    DDP__BN_UNROLL for (j = 0; j < w; j++) sum_dy_xmu[j] = a2[j] + g[j] * v[j];
}

/* ---- the passes over a whole batch, in either layout ---- */

/* Channels-first with spatial > 1 is the only layout whose channel is not the fastest index. */
static int ddp__bn_planar(const ddp_syncbn *bn, int64_t spatial) { return !bn->channels_last && spatial > 1; }

static void ddp__bn_fill_f64(double *v, int n, double value) {
    int j;
    for (j = 0; j < n; j++) v[j] = value;
}

static void ddp__bn_fill_f32(float *v, int n, float value) {
    int j;
    for (j = 0; j < n; j++) v[j] = value;
}

/* Sum the first n lanes. */
static double ddp__bn_lanes_sum(const double *lanes, int n) {
    double s = 0;
    int j;
    for (j = 0; j < n; j++) s += lanes[j];
    return s;
}

/* Per channel c: s1[c] = sum (x - shift[c]), s2[c] = sum (x - shift[c])^2 over the batch. */
static void ddp__bn_pass_stats(const ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, double *s1,
                               double *s2) {
    const int C = bn->channels;
    const double *shift = bn->shift;
    int64_t n, r0, r;
    int c;
    memset(s1, 0, sizeof(double) * (size_t)C);
    memset(s2, 0, sizeof(double) * (size_t)C);
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const float *run = x + (n * C + c) * spatial;
                double k[DDP__BN_LANES], a1[DDP__BN_LANES] = {0}, a2[DDP__BN_LANES] = {0};
                ddp__bn_fill_f64(k, DDP__BN_LANES, shift[c]);
                ddp__bn_cols_stats(run, DDP__BN_LANES, full, DDP__BN_LANES, k, a1, a2);
                ddp__bn_cols_stats(run + full * DDP__BN_LANES, 1, tail, 1, k, a1, a2); /* the tail: lane 0 */
                s1[c] += ddp__bn_lanes_sum(a1, DDP__BN_LANES);
                s2[c] += ddp__bn_lanes_sum(a2, DDP__BN_LANES);
            }
        return;
    }
    r = batch * spatial; /* row by row in memory order, the accumulators of a row's channels in cache */
    for (r0 = 0; r0 < r; r0++) {
        const float *row = x + r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_row_stats(row + c, DDP__BN_LANES, shift + c, s1 + c, s2 + c);
        for (; c < C; c++) ddp__bn_row_stats(row + c, 1, shift + c, s1 + c, s2 + c);
    }
}

/* y = (x - mean[c]) * scale[c] + shift[c] */
static void ddp__bn_pass_normalize(const ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                   const float *mean, const float *scale, const float *shift) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                float m[DDP__BN_LANES], a[DDP__BN_LANES], b[DDP__BN_LANES];
                ddp__bn_fill_f32(m, DDP__BN_LANES, mean[c]);
                ddp__bn_fill_f32(a, DDP__BN_LANES, scale[c]);
                ddp__bn_fill_f32(b, DDP__BN_LANES, shift[c]);
                ddp__bn_cols_normalize(x + off, y + off, DDP__BN_LANES, full, DDP__BN_LANES, m, a, b);
                ddp__bn_cols_normalize(x + off + t, y + off + t, 1, tail, 1, m, a, b);
            }
        return;
    }
    r = batch * spatial; /* element-wise: row by row, in memory order */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_cols_normalize(x + off + c, y + off + c, 0, 1, DDP__BN_LANES, mean + c, scale + c, shift + c);
        for (; c < C; c++) ddp__bn_cols_normalize(x + off + c, y + off + c, 0, 1, 1, mean + c, scale + c, shift + c);
    }
}

/* sum_dy[c] = sum dy, sum_dy_xmu[c] = sum dy * (x - mean[c]) (mean in f64) */
static void ddp__bn_pass_backward_sums(const ddp_syncbn *bn, const float *dy, const float *x, int64_t batch,
                                       int64_t spatial, const double *mean, double *sum_dy, double *sum_dy_xmu) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    memset(sum_dy, 0, sizeof(double) * (size_t)C);
    memset(sum_dy_xmu, 0, sizeof(double) * (size_t)C);
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                double m[DDP__BN_LANES], a1[DDP__BN_LANES] = {0}, a2[DDP__BN_LANES] = {0};
                ddp__bn_fill_f64(m, DDP__BN_LANES, mean[c]);
                ddp__bn_cols_backward_sums(dy + off, x + off, DDP__BN_LANES, full, DDP__BN_LANES, m, a1, a2);
                ddp__bn_cols_backward_sums(dy + off + t, x + off + t, 1, tail, 1, m, a1, a2);
                sum_dy[c] += ddp__bn_lanes_sum(a1, DDP__BN_LANES);
                sum_dy_xmu[c] += ddp__bn_lanes_sum(a2, DDP__BN_LANES);
            }
        return;
    }
    r = batch * spatial; /* row by row in memory order, the accumulators of a row's channels in cache */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_row_backward_sums(dy + off + c, x + off + c, DDP__BN_LANES, mean + c, sum_dy + c, sum_dy_xmu + c);
        for (; c < C; c++) ddp__bn_row_backward_sums(dy + off + c, x + off + c, 1, mean + c, sum_dy + c, sum_dy_xmu + c);
    }
}

/* dx = (dy - mean_dy[c] - (x - mean[c]) * proj[c]) * scale[c] */
static void ddp__bn_pass_grad_input(const ddp_syncbn *bn, const float *dy, const float *x, float *dx, int64_t batch,
                                    int64_t spatial, const float *mean, const float *mean_dy, const float *proj,
                                    const float *scale) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                float m[DDP__BN_LANES], md[DDP__BN_LANES], p[DDP__BN_LANES], a[DDP__BN_LANES];
                ddp__bn_fill_f32(m, DDP__BN_LANES, mean[c]);
                ddp__bn_fill_f32(md, DDP__BN_LANES, mean_dy[c]);
                ddp__bn_fill_f32(p, DDP__BN_LANES, proj[c]);
                ddp__bn_fill_f32(a, DDP__BN_LANES, scale[c]);
                ddp__bn_cols_grad_input(dy + off, x + off, dx + off, DDP__BN_LANES, full, DDP__BN_LANES, m, md, p, a);
                ddp__bn_cols_grad_input(dy + off + t, x + off + t, dx + off + t, 1, tail, 1, m, md, p, a);
            }
        return;
    }
    r = batch * spatial; /* element-wise: row by row, in memory order */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_cols_grad_input(dy + off + c, x + off + c, dx + off + c, 0, 1, DDP__BN_LANES, mean + c,
                                    mean_dy + c, proj + c, scale + c);
        for (; c < C; c++)
            ddp__bn_cols_grad_input(dy + off + c, x + off + c, dx + off + c, 0, 1, 1, mean + c, mean_dy + c, proj + c,
                                    scale + c);
    }
}

/* ---- the layer ---- */

DDP_API ddp_result ddp_syncbn_create(ddp_group *g, const ddp_syncbn_desc *d, ddp_syncbn **out) {
    ddp_syncbn *bn;
    size_t C;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_syncbn_create");
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_create: out is NULL");
    *out = NULL;
    if (!d) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_create: the descriptor d is NULL");
    if (d->num_features <= 0 || d->num_features > (INT_MAX - 1) / 2)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: num_features is %d; give the number of channels C (1 .. %d)",
                         d->num_features, (INT_MAX - 1) / 2);
    if (!(d->eps >= 0) || d->eps > 1e30)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: eps is %g; give a small positive number (0 = the default 1e-5)", d->eps);
    if (d->momentum != d->momentum || d->momentum > 1)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: momentum is %g; give a factor in (0, 1], 0 for the default 0.1, or a "
                         "negative number for the cumulative average (momentum=None)",
                         d->momentum);
    if ((d->running_mean == NULL) != (d->running_var == NULL))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: running_mean is %s but running_var is %s; give both (track running "
                         "stats) or neither",
                         d->running_mean ? "set" : "NULL", d->running_var ? "set" : "NULL");
    if (d->num_batches_tracked && !d->running_mean)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: num_batches_tracked is set but running_mean and running_var are NULL; a "
                         "layer without running stats has no num_batches_tracked (torch: track_running_stats=False)");
    if (d->num_batches_tracked && *d->num_batches_tracked < 0)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: *num_batches_tracked is %lld; it counts batches, so it is >= 0 (0 for a "
                         "new layer)",
                         (long long)*d->num_batches_tracked);
    bn = (ddp_syncbn *)ddp__calloc(1, sizeof *bn);
    if (!bn) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_syncbn_create: out of memory");
    bn->errors = g;
    bn->group = d->group ? d->group : g;
    bn->nranks = bn->group ? ddp_world_size(bn->group) : 1;
    bn->rank = bn->group ? ddp_rank(bn->group) : 0;
    bn->channels = d->num_features;
    bn->channels_last = d->channels_last != 0;
    bn->eps = d->eps > 0 ? d->eps : 1e-5;
    bn->momentum = d->momentum == 0 ? 0.1 : d->momentum;
    bn->weight = d->weight;
    bn->bias = d->bias;
    bn->running_mean = d->running_mean;
    bn->running_var = d->running_var;
    bn->num_batches_tracked = d->num_batches_tracked ? d->num_batches_tracked : &bn->own_count;
    C = (size_t)bn->channels;
    bn->mean = (float *)ddp__calloc(C, sizeof(float));
    bn->invstd = (float *)ddp__calloc(C, sizeof(float));
    bn->coef = (float *)ddp__calloc(3 * C, sizeof(float));
    bn->sums = (double *)ddp__calloc(2 * C, sizeof(double));
    bn->shift = (double *)ddp__calloc(C, sizeof(double));
    if (bn->nranks >= 1 && (size_t)bn->nranks <= SIZE_MAX / sizeof(double) / (2 * C + 1))
        bn->records = (double *)ddp__calloc((size_t)bn->nranks * (2 * C + 1), sizeof(double));
    bn->records_ranks = bn->nranks;
    if (!bn->mean || !bn->invstd || !bn->coef || !bn->sums || !bn->shift || !bn->records) {
        const int nranks = bn->nranks;
        ddp_syncbn_destroy(bn);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_syncbn_create: out of memory for %d channels on %d ranks",
                         d->num_features, nranks);
    }
    *out = bn;
    return DDP_SUCCESS;
}

DDP_API void ddp_syncbn_destroy(ddp_syncbn *bn) {
    if (!bn) return;
#ifdef DDP_CUDA
    ddp__bn_dev_release(bn);
#endif
    ddp__free(bn->mean);
    ddp__free(bn->invstd);
    ddp__free(bn->coef);
    ddp__free(bn->sums);
    ddp__free(bn->shift);
    ddp__free(bn->records);
    ddp__free(bn);
}

DDP_API int64_t ddp_syncbn_num_batches_tracked(const ddp_syncbn *bn) { return bn ? *bn->num_batches_tracked : 0; }

DDP_API ddp_result ddp_syncbn_set_num_batches_tracked(ddp_syncbn *bn, int64_t value) {
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_set_num_batches_tracked: bn is NULL");
    if (value < 0)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_set_num_batches_tracked: value is %lld; it counts batches, so it is >= 0",
                         (long long)value);
    *bn->num_batches_tracked = value;
    return DDP_SUCCESS;
}

/* Shape and pointer checks shared by forward and backward; *count receives batch * spatial. */
static ddp_result ddp__bn_check(const ddp_syncbn *bn, const char *fn, int64_t batch, int64_t spatial, const void *a,
                                const char *a_name, const void *b, const char *b_name, int64_t *count) {
    if (batch < 0 || spatial < 0)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld, spatial=%lld; both must be >= 0 (spatial is the product of the spatial "
                         "sizes, 1 for (N, C) input)",
                         fn, (long long)batch, (long long)spatial);
    if (spatial > 0 && batch > INT64_MAX / spatial / bn->channels) {
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld x spatial=%lld x C=%d elements overflow 64 bits", fn, (long long)batch,
                         (long long)spatial, bn->channels);
    }
    *count = batch * spatial;
    if (*count > 0 && (uint64_t)(*count * bn->channels) > SIZE_MAX / sizeof(float))
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT, "%s: %lld x %d floats do not fit in memory", fn,
                         (long long)*count, bn->channels);
    if (*count > 0 && (!a || !b))
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with batch=%lld, spatial=%lld", fn,
                         !a ? a_name : b_name, (long long)batch, (long long)spatial);
    return DDP_SUCCESS;
}

/* A collective on bn->group failed: report it in bn->errors' message, naming the step. */
static ddp_result ddp__bn_comm_failed(ddp_syncbn *bn, ddp_result r, const char *what) {
    char msg[DDP__ERR_MAX];
    snprintf(msg, sizeof msg, "%s", ddp_last_error(bn->group)); /* copied first: it may be the same buffer */
    return ddp__fail(bn->errors, r, "%s failed: %s", what, msg);
}

#ifdef DDP_CUDA
/* ---- the device path: x in device memory (torch's SyncBatchNorm on CUDA) ----
   When x is device memory (the glue's ddp__cuda_is_device_pointer; for an empty batch: when the layer
   ran on the device before or its weight or running_mean is device memory), forward and backward run
   ddp_cuda.cu's kernels through ddp__cuda_bn_forward/backward (src/cuda_glue.h), all queued on the
   group's stream (ddp_set_stream; the legacy default stream when none was set or without a group),
   the stream the exchange's collectives use too (on the cpu backend devbuf.c stages them there, so a
   non-blocking stream still orders the kernels before the copies), and the host never waits for the
   device:
   - y, dy, dx, grad_weight, grad_bias and the layer's weight, bias and running stats are then device
     memory too (checked: the message names the host array);
   - the exchange is the group's collective on the device records / sums: on the nccl backend an async
     all_gather / all_reduce queued on the same stream behind the statistics kernel, its ddp_work waited
     (the watchdog) one step later, just before the next all_gather (all_reduce) of this layer, or in
     ddp_syncbn_destroy; so a failure of step k's collective is reported by step k + 1's call (the group
     is broken meanwhile, so every other collective fails too). Other backends: the synchronous
     collective (the cpu backend stages device buffers through host memory);
   - the count check that needs the global count: n == 1 on one rank (or without exchange) is
     DDP_ERR_INVALID_ARGUMENT as on the host; n == 1 over 2+ ranks is not detected (as torch's
     SyncBatchNorm), the running stats are then left unchanged.
   Scratch (C-sized statistics, the nranks records) is allocated on the current device at the first
   device forward and freed by ddp_syncbn_destroy. */

static int ddp__bn_dev_wanted(const ddp_syncbn *bn, const void *x, int64_t count) {
    if (count > 0) return ddp__cuda_is_device_pointer(x);
    return bn->dev.ready || ddp__cuda_is_device_pointer(bn->weight) || ddp__cuda_is_device_pointer(bn->running_mean);
}

/* Wait for the pending collective of a slot (0: all_gather, 1: all_reduce), if any. */
static ddp_result ddp__bn_dev_settle(ddp_syncbn *bn, int slot) {
    ddp_work *w = bn->dev.pending[slot];
    ddp_result r;
    if (!w) return DDP_SUCCESS;
    bn->dev.pending[slot] = NULL;
    r = ddp_wait(w);
    if (r == DDP_SUCCESS) return r;
    return ddp__bn_comm_failed(bn, r, slot ? "ddp_syncbn_backward: the previous step's all_reduce of sum_dy and sum_dy_xmu"
                                           : "ddp_syncbn_forward: the previous step's all_gather of the batch statistics");
}

/* The kernels' exchange: the group's collective on device memory (see the top of this part). */
static ddp_result ddp__bn_dev_exchange(void *user, int what, double *buf, size_t count) {
    ddp_syncbn *bn = (ddp_syncbn *)user;
    const int slot = what == DDP__CUDA_BN_REDUCE;
    const char *step = slot ? "ddp_syncbn_backward: all_reduce of sum_dy and sum_dy_xmu"
                            : "ddp_syncbn_forward: all_gather of the batch statistics";
    double *mine = buf + (size_t)bn->rank * count;
    ddp_result r = ddp__bn_dev_settle(bn, slot);
    if (r != DDP_SUCCESS) return r;
    if (bn->group->nccl)
        r = slot ? ddp_all_reduce_async(bn->group, buf, count, DDP_F64, DDP_SUM, &bn->dev.pending[slot])
                 : ddp_all_gather_async(bn->group, mine, buf, count, DDP_F64, &bn->dev.pending[slot]);
    else
        r = slot ? ddp_all_reduce(bn->group, buf, count, DDP_F64, DDP_SUM)
                 : ddp_all_gather(bn->group, mine, buf, count, DDP_F64);
    return r == DDP_SUCCESS ? r : ddp__bn_comm_failed(bn, r, step);
}

/* The first of the given arrays that is not device memory (NULL: all are, or are NULL). */
static const char *ddp__bn_dev_host_array(const void *const *arrays, const char *const *names, int n) {
    int i;
    for (i = 0; i < n; i++)
        if (arrays[i] && !ddp__cuda_is_device_pointer(arrays[i])) return names[i];
    return NULL;
}

/* Check the layer's arrays and the call's, allocate the scratch once, describe the call to the kernels. */
static ddp_result ddp__bn_dev_prepare(ddp_syncbn *bn, const char *fn, const void *const *call, const char *const *names,
                                      int n, int64_t batch, int64_t spatial) {
    const void *layer[4];
    static const char *const layer_names[4] = {"weight", "bias", "running_mean", "running_var"};
    ddp__cuda_bn *cu = &bn->dev.cu;
    const size_t C = (size_t)bn->channels;
    const char *host;
    layer[0] = bn->weight, layer[1] = bn->bias, layer[2] = bn->running_mean, layer[3] = bn->running_var;
    if ((host = ddp__bn_dev_host_array(call, names, n)) != NULL || (host = ddp__bn_dev_host_array(layer, layer_names, 4)))
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: %s is host memory, but this call runs on the device (x of the forward is device "
                         "memory): then every array of the layer and of the call is device memory (cudaMalloc'd)",
                         fn, host);
    if (!bn->dev.ready) {
        void *p[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
        const size_t bytes[6] = {DDP_CUDA_BN_WORK_FLOATS(C) * sizeof(float), C * sizeof(float), C * sizeof(float),
                                 (size_t)bn->nranks * (2 * C + 1) * sizeof(double), 2 * C * sizeof(double), sizeof(double)};
        ddp_result r = DDP_SUCCESS;
        int i;
        for (i = 0; i < 6 && r == DDP_SUCCESS; i++) r = ddp__cuda_device_alloc(bytes[i], &p[i], bn->dev.err, sizeof bn->dev.err);
        if (r != DDP_SUCCESS) {
            for (i = 0; i < 6; i++) ddp__cuda_device_free(p[i]);
            return ddp__fail(bn->errors, r, "%s: device scratch for %d channels: %s", fn, bn->channels, bn->dev.err);
        }
        cu->work = (float *)p[0], cu->mean = (float *)p[1], cu->invstd = (float *)p[2];
        cu->records = (double *)p[3], cu->sums = (double *)p[4], cu->count = (double *)p[5];
        bn->dev.ready = 1;
    }
    cu->a.dtype = DDP_F32;
    cu->a.batch = batch;
    cu->a.spatial = spatial;
    cu->a.channels = bn->channels;
    cu->a.channels_last = bn->channels_last;
    cu->a.stream = !bn->group ? NULL
                   : bn->group->nccl ? ddp__cuda_nccl_stream(bn->group->nccl->comm)
                                     : ddp__devbuf_stream(bn->group); /* where devbuf.c stages the exchange */
    cu->a.err = bn->dev.err;
    cu->a.err_size = sizeof bn->dev.err;
    cu->nranks = bn->nranks;
    cu->rank = bn->rank;
    cu->eps = bn->eps;
    cu->weight = bn->weight, cu->bias = bn->bias;
    cu->running_mean = bn->running_mean, cu->running_var = bn->running_var;
    cu->exchange = ddp__bn_dev_exchange;
    cu->user = bn;
    bn->dev.err[0] = '\0';
    return DDP_SUCCESS;
}

/* A failed kernel call (its message in dev.err) or exchange (already reported). */
static ddp_result ddp__bn_dev_failed(ddp_syncbn *bn, const char *fn, ddp_result r) {
    if (!bn->dev.err[0]) return r;
    return ddp__fail(bn->errors, r, "%s (device): %s", fn, bn->dev.err);
}

static ddp_result ddp__bn_dev_forward(ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                      int training) {
    const char *fn = "ddp_syncbn_forward";
    const void *call[2];
    static const char *const names[2] = {"x", "y"};
    int mode = training || !bn->running_mean ? (training && bn->nranks > 1 ? DDP__CUDA_BN_SYNCED : DDP__CUDA_BN_LOCAL)
                                             : DDP__CUDA_BN_EVAL;
    double factor = 0;
    ddp_result r;
    call[0] = x, call[1] = y;
    if ((r = ddp__bn_dev_prepare(bn, fn, call, names, 2, batch, spatial)) != DDP_SUCCESS) return r;
    if (mode == DDP__CUDA_BN_LOCAL && batch * spatial == 1)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: expected more than 1 value per channel when training, got 1 in the batch (batch=%lld, "
                         "spatial=%lld on this rank); running stats left unchanged",
                         fn, (long long)batch, (long long)spatial);
    if (training && bn->running_mean) {
        factor = ddp__bn_factor(bn->momentum, ++*bn->num_batches_tracked);
    }
    if ((r = ddp__cuda_bn_forward(&bn->dev.cu, mode, x, y, factor)) != DDP_SUCCESS) return ddp__bn_dev_failed(bn, fn, r);
    bn->dev.mode = mode;
    bn->saved = mode == DDP__CUDA_BN_SYNCED ? DDP__BN_SAVED_SYNCED : mode == DDP__CUDA_BN_LOCAL ? DDP__BN_SAVED_LOCAL
                                                                                                : DDP__BN_SAVED_EVAL;
    return DDP_SUCCESS;
}

static ddp_result ddp__bn_dev_backward(ddp_syncbn *bn, const float *x, const float *dy, float *dx, float *grad_weight,
                                       float *grad_bias, int64_t batch, int64_t spatial) {
    const char *fn = "ddp_syncbn_backward";
    const void *call[5];
    static const char *const names[5] = {"x", "dy", "dx", "grad_weight", "grad_bias"};
    ddp_result r;
    call[0] = x, call[1] = dy, call[2] = dx, call[3] = grad_weight, call[4] = grad_bias;
    if (!bn->dev.mode)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: x is device memory but the last forward ran on host memory; pass that forward's arrays", fn);
    if ((r = ddp__bn_dev_prepare(bn, fn, call, names, 5, batch, spatial)) != DDP_SUCCESS) return r;
    r = ddp__cuda_bn_backward(&bn->dev.cu, bn->dev.mode, dy, x, dx, grad_weight, grad_bias);
    return r == DDP_SUCCESS ? r : ddp__bn_dev_failed(bn, fn, r);
}

/* Wait for what is still pending (errors were or will be reported by the group) and free the scratch. */
static void ddp__bn_dev_release(ddp_syncbn *bn) {
    ddp__cuda_bn *cu = &bn->dev.cu;
    int i;
    for (i = 0; i < 2; i++)
        if (bn->dev.pending[i]) ddp_wait(bn->dev.pending[i]);
    if (!bn->dev.ready) return;
    ddp__cuda_device_free(cu->work), ddp__cuda_device_free(cu->mean), ddp__cuda_device_free(cu->invstd);
    ddp__cuda_device_free(cu->records), ddp__cuda_device_free(cu->sums), ddp__cuda_device_free(cu->count);
}
#endif /* DDP_CUDA */

/* The group's size and this rank's place as they are now: a fault-tolerant group (src/ft.h) changes
   both at a view change. The records grow with the group (on the device: the scratch is made again). */
static ddp_result ddp__bn_follow_group(ddp_syncbn *bn) {
    int world, C = bn->channels;
    if (!bn->group) return DDP_SUCCESS;
    world = ddp_world_size(bn->group);
    if (world > bn->records_ranks) {
        double *more = (double *)ddp__calloc((size_t)world * (2 * (size_t)C + 1), sizeof(double));
        if (!more) return ddp__fail(bn->errors, DDP_ERR_OUT_OF_MEMORY, "ddp_syncbn_forward: out of memory for %d ranks' "
                                    "statistics", world);
        ddp__free(bn->records);
        bn->records = more, bn->records_ranks = world;
#ifdef DDP_CUDA
        ddp__bn_dev_release(bn);
        bn->dev.ready = 0;
#endif
    }
    bn->nranks = world;
    bn->rank = ddp_rank(bn->group);
    return DDP_SUCCESS;
}

/* This rank's record [mean(C), M2(C), count] from one pass over x. */
static void ddp__bn_local_stats(ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, double *record) {
    const int C = bn->channels;
    const double n = (double)(batch * spatial);
    double *s1 = bn->sums, *s2 = bn->sums + C;
    int c;
    for (c = 0; c < C; c++) /* the channel's first value: a shift close to the mean, so no cancellation */
        bn->shift[c] = n > 0 ? (double)x[bn->channels_last || spatial <= 1 ? c : (int64_t)c * spatial] : 0.0;
    if (n > 0) ddp__bn_pass_stats(bn, x, batch, spatial, s1, s2);
    for (c = 0; c < C; c++) {
        double m2 = n > 0 ? s2[c] - s1[c] * (s1[c] / n) : 0.0;
        record[c] = n > 0 ? bn->shift[c] + s1[c] / n : 0.0;
        record[C + c] = m2 > 0 ? m2 : 0.0;
    }
    record[2 * C] = n;
}

/* Training (or no running stats): batch statistics, merged over the group when synced. Sets bn->mean,
   bn->invstd and what was saved; updates the running stats in training. */
static ddp_result ddp__bn_batch_stats(ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, int training) {
    const int C = bn->channels, synced = training && bn->nranks > 1;
    double *records = bn->records, *mine = bn->records + (int64_t)bn->rank * (2 * C + 1);
    double n = 0, mean, m2, factor = 0;
    int c;
    ddp__bn_local_stats(bn, x, batch, spatial, mine);
    if (synced) {
        ddp_result r = ddp_all_gather(bn->group, mine, records, (size_t)(2 * C + 1), DDP_F64);
        if (r != DDP_SUCCESS) return ddp__bn_comm_failed(bn, r, "ddp_syncbn_forward: all_gather of the batch statistics");
    } else {
        records = mine;
    }
    ddp__bn_merge_ranks(records, synced ? bn->nranks : 1, C, 0, &n, &mean, &m2); /* n: the same for every c */
    if (n == 1) /* torch: "Expected more than 1 value per channel when training"; every rank sees the same n */
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_forward: expected more than 1 value per channel when training, got 1 %s "
                         "(batch=%lld, spatial=%lld on this rank); running stats left unchanged",
                         synced ? "over all ranks of the group" : "in the batch", (long long)batch, (long long)spatial);
    if (training && bn->running_mean) { /* counted even for an empty batch, as torch's module does */
        factor = ddp__bn_factor(bn->momentum, ++*bn->num_batches_tracked);
    }
    for (c = 0; c < C; c++) {
        ddp__bn_merge_ranks(records, synced ? bn->nranks : 1, C, c, &n, &mean, &m2);
        bn->mean[c] = (float)mean;
        bn->invstd[c] = n > 0 ? (float)(1.0 / sqrt(m2 / n + bn->eps)) : 0.0f;
        if (training && bn->running_mean && n > 0) /* an empty batch leaves them, as torch's CPU kernel */
            ddp__bn_update_running(&bn->running_mean[c], &bn->running_var[c], mean, m2, n, factor);
    }
    bn->saved = synced ? DDP__BN_SAVED_SYNCED : DDP__BN_SAVED_LOCAL;
    bn->saved_count = n;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_syncbn_forward(ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                      int training) {
    const char *fn = "ddp_syncbn_forward";
    float *scale, *shift;
    int64_t count = 0;
    int c;
    ddp_result r;
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_forward: bn is NULL");
    r = ddp__bn_check(bn, fn, batch, spatial, x, "x", y, "y", &count);
    if (r != DDP_SUCCESS) return r;
    if (training && bn->running_mean && *bn->num_batches_tracked < 0) /* the program's counter, written directly */
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: num_batches_tracked is %lld; it counts batches, so it is >= 0 (nothing changed)", fn,
                         (long long)*bn->num_batches_tracked);
    bn->saved = DDP__BN_SAVED_NONE;
    if ((r = ddp__bn_follow_group(bn)) != DDP_SUCCESS) return r;
#ifdef DDP_CUDA
    bn->dev.mode = 0;
    if (ddp__bn_dev_wanted(bn, x, count)) {
        r = ddp__bn_dev_forward(bn, x, y, batch, spatial, training);
        bn->saved_batch = batch;
        bn->saved_spatial = spatial;
        return r;
    }
#endif
    if (training || !bn->running_mean) {
        r = ddp__bn_batch_stats(bn, x, batch, spatial, training);
        if (r != DDP_SUCCESS) return r;
    } else {
        for (c = 0; c < bn->channels; c++) {
            bn->mean[c] = bn->running_mean[c];
            bn->invstd[c] = (float)(1.0 / sqrt((double)bn->running_var[c] + bn->eps));
        }
        bn->saved = DDP__BN_SAVED_EVAL;
    }
    bn->saved_batch = batch;
    bn->saved_spatial = spatial;
    scale = bn->coef;
    shift = bn->coef + bn->channels;
    for (c = 0; c < bn->channels; c++) {
        scale[c] = bn->invstd[c] * (bn->weight ? bn->weight[c] : 1.0f);
        shift[c] = bn->bias ? bn->bias[c] : 0.0f;
    }
    if (count > 0) ddp__bn_pass_normalize(bn, x, y, batch, spatial, bn->mean, scale, shift);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_syncbn_backward(ddp_syncbn *bn, const float *x, const float *dy, float *dx, float *grad_weight,
                                       float *grad_bias, int64_t batch, int64_t spatial) {
    const char *fn = "ddp_syncbn_backward";
    double *sum_dy, *sum_dy_xmu, *mean64;
    int64_t count = 0;
    int C, c, eval;
    ddp_result r;
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_backward: bn is NULL");
    r = ddp__bn_check(bn, fn, batch, spatial, x, "x", dy, "dy", &count);
    if (r != DDP_SUCCESS) return r;
    if (bn->saved == DDP__BN_SAVED_NONE)
        return ddp__fail(bn->errors, DDP_ERR_STATE,
                         "%s: no statistics to differentiate: call ddp_syncbn_forward first (a failed forward saves none)",
                         fn);
    if (batch != bn->saved_batch || spatial != bn->saved_spatial)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld, spatial=%lld, but the last forward had batch=%lld, spatial=%lld; pass that "
                         "forward's input",
                         fn, (long long)batch, (long long)spatial, (long long)bn->saved_batch,
                         (long long)bn->saved_spatial);
#ifdef DDP_CUDA
    if (ddp__bn_dev_wanted(bn, x, count) || bn->dev.mode)
        return ddp__bn_dev_backward(bn, x, dy, dx, grad_weight, grad_bias, batch, spatial);
#endif
    C = bn->channels;
    eval = bn->saved == DDP__BN_SAVED_EVAL;
    sum_dy = bn->sums;
    sum_dy_xmu = bn->sums + C;
    mean64 = bn->shift;
    for (c = 0; c < C; c++) mean64[c] = (double)bn->mean[c];
    if (count > 0 && (!eval || grad_weight || grad_bias))
        ddp__bn_pass_backward_sums(bn, dy, x, batch, spatial, mean64, sum_dy, sum_dy_xmu);
    else
        memset(bn->sums, 0, sizeof(double) * 2 * (size_t)C);
    for (c = 0; c < C; c++) { /* local: the reducer averages parameters' gradients over ranks */
        if (grad_weight) grad_weight[c] += (float)(sum_dy_xmu[c] * (double)bn->invstd[c]);
        if (grad_bias) grad_bias[c] += (float)sum_dy[c];
    }
    if (bn->saved == DDP__BN_SAVED_SYNCED) { /* every rank, whether it wants dx or not */
        r = ddp_all_reduce(bn->group, bn->sums, 2 * (size_t)C, DDP_F64, DDP_SUM);
        if (r != DDP_SUCCESS) return ddp__bn_comm_failed(bn, r, "ddp_syncbn_backward: all_reduce of sum_dy and sum_dy_xmu");
    }
    if (!dx || count == 0) return DDP_SUCCESS;
    for (c = 0; c < C; c++) {
        float *mean_dy = bn->coef, *proj = bn->coef + C, *scale = bn->coef + 2 * C;
        const float w = bn->weight ? bn->weight[c] : 1.0f;
        if (eval) { /* the statistics were constants */
            mean_dy[c] = 0;
            proj[c] = 0;
            scale[c] = bn->invstd[c] * w;
        } else {
            ddp__bn_backward_coeffs(sum_dy[c], sum_dy_xmu[c], bn->saved_count, bn->invstd[c], w, &mean_dy[c],
                                    &proj[c], &scale[c]);
        }
    }
    ddp__bn_pass_grad_input(bn, dy, x, dx, batch, spatial, bn->mean, bn->coef, bn->coef + C, bn->coef + 2 * C);
    return DDP_SUCCESS;
}
