/* [SECTION] bn-math: SyncBatchNorm formulas shared by the CPU code (src/syncbn.c) and the CUDA kernels
   Private (ddp__ names): the implementation (DDP_IMPLEMENTATION) and ddp_cuda.cu, which compiles them
   for the device (it defines DDP__CUDA_GLUE), see them; a user's program does not. Per channel,
   statistics travel as a record per rank of 2C + 1 doubles: [mean(C), M2(C), count], M2 being the sum
   of squared deviations from that rank's mean. */
#if (defined(DDP_IMPLEMENTATION) || defined(DDP__CUDA_GLUE)) && !defined(DDP__BN_MATH_INCLUDED)
#define DDP__BN_MATH_INCLUDED

#ifndef DDP_HOST_DEVICE
#if defined(__CUDACC__)
#define DDP_HOST_DEVICE __host__ __device__
#else
#define DDP_HOST_DEVICE
#endif
#endif

/* Chan et al.'s parallel merge: fold the statistics (nb, mean_b, m2_b) of one set into (n, mean, m2).
   An empty set on either side leaves the other exactly as it was. */
static inline DDP_HOST_DEVICE void ddp__bn_merge(double *n, double *mean, double *m2, double nb, double mean_b,
                                                 double m2_b) {
    double total, delta;
    if (nb <= 0) return;
    if (*n <= 0) {
        *n = nb;
        *mean = mean_b;
        *m2 = m2_b;
        return;
    }
    total = *n + nb;
    delta = mean_b - *mean;
    *mean += delta * (nb / total);
    *m2 += m2_b + delta * delta * (*n * (nb / total));
    *n = total;
}

/* The same in f32, for the CUDA kernels' reductions inside a block. */
static inline DDP_HOST_DEVICE void ddp__bn_merge_f32(float *n, float *mean, float *m2, float nb, float mean_b,
                                                     float m2_b) {
    float total, delta;
    if (nb <= 0) return;
    if (*n <= 0) {
        *n = nb;
        *mean = mean_b;
        *m2 = m2_b;
        return;
    }
    total = *n + nb;
    delta = mean_b - *mean;
    *mean += delta * (nb / total);
    *m2 += m2_b + delta * delta * (*n * (nb / total));
    *n = total;
}

/* Welford's update with one value (the CUDA kernels' per-thread accumulation, as torch's). */
static inline DDP_HOST_DEVICE void ddp__bn_welford_add(float *n, float *mean, float *m2, float x) {
    float delta = x - *mean;
    *n += 1.0f;
    *mean += delta / *n;
    *m2 += delta * (x - *mean);
}

/* Merge channel c of the gathered records of nranks ranks, in rank order, into (n, mean, m2). */
static inline DDP_HOST_DEVICE void ddp__bn_merge_ranks(const double *records, int nranks, int channels, int c,
                                                       double *n, double *mean, double *m2) {
    int r;
    const int64_t stride = 2 * (int64_t)channels + 1;
    *n = 0;
    *mean = 0;
    *m2 = 0;
    for (r = 0; r < nranks; r++) {
        const double *rec = records + r * stride;
        ddp__bn_merge(n, mean, m2, rec[2 * channels], rec[c], rec[channels + c]);
    }
}

/* The running-stats factor of a training forward: momentum, or 1 / num_batches_tracked (already
   incremented) for the cumulative average (momentum < 0, torch's momentum=None). */
static inline DDP_HOST_DEVICE double ddp__bn_factor(double momentum, int64_t num_batches_tracked) {
    return momentum < 0 ? 1.0 / (double)num_batches_tracked : momentum;
}

/* running <- (1 - f) running + f batch, with the unbiased variance M2 / (n - 1) over the global n (>= 2). */
static inline DDP_HOST_DEVICE void ddp__bn_update_running(float *running_mean, float *running_var, double mean,
                                                          double m2, double n, double f) {
    *running_mean = (float)((1.0 - f) * (double)*running_mean + f * mean);
    *running_var = (float)((1.0 - f) * (double)*running_var + f * (m2 / (n - 1.0)));
}

/* y = (x - mean) * scale + shift, with scale = invstd * weight and shift = bias. */
static inline DDP_HOST_DEVICE float ddp__bn_normalize(float x, float mean, float scale, float shift) {
    return (x - mean) * scale + shift;
}

/* Per-channel factors of the input gradient from the all-reduced sums and the global count n:
   mean_dy = sum_dy / n, proj = invstd^2 sum_dy_xmu / n, scale = invstd * weight. */
static inline DDP_HOST_DEVICE void ddp__bn_backward_coeffs(double sum_dy, double sum_dy_xmu, double n, float invstd,
                                                           float weight, float *mean_dy, float *proj,
                                                           float *scale) {
    *mean_dy = (float)(sum_dy / n);
    *proj = (float)((double)invstd * (double)invstd * sum_dy_xmu / n);
    *scale = invstd * weight;
}

/* dx = (dy - mean_dy - (x - mean) * proj) * scale */
static inline DDP_HOST_DEVICE float ddp__bn_grad_input(float dy, float x, float mean, float mean_dy, float proj,
                                                       float scale) {
    return (dy - mean_dy - (x - mean) * proj) * scale;
}

#endif /* DDP__BN_MATH_INCLUDED */
