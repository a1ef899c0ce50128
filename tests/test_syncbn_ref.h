/* test_syncbn_ref.h: serial BatchNorm in f64, written independently of ddp.h's SyncBatchNorm (textbook two-pass formulas),
   plus test data helpers. Shared by tests/test_syncbn*.c. Include after testlib.h. */

/* Index of (n, c, s) in a batch of C channels and S spatial positions, in either layout. */
static int64_t ref_index(int channels_last, int64_t n, int64_t c, int64_t s, int64_t C, int64_t S) {
    return channels_last ? (n * S + s) * C + c : (n * C + c) * S + s;
}

static float ref_uniform(uint64_t *st) { return (float)((double)(tl_rand(st) >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

/* Fill v with offset + scale * uniform(-1, 1). */
static void ref_fill(float *v, int64_t n, uint64_t *st, float offset, float scale) {
    int64_t i;
    for (i = 0; i < n; i++) v[i] = offset + scale * ref_uniform(st);
}

typedef struct ref_bn {
    int C, channels_last, affine, track; /* track: running stats */
    double eps, momentum;                /* momentum < 0: cumulative */
    const float *weight, *bias;
    double *running_mean, *running_var; /* C each when track */
    int64_t nbt;
} ref_bn;

/* Training forward + backward of plain BatchNorm on one batch (N, S in ref->channels_last layout):
   y, dx (N*S*C), grad_weight, grad_bias (C) are written; running stats updated. */
static void ref_bn_train(ref_bn *b, const float *x, const float *dy, int64_t N, int64_t S, double *y, double *dx,
                         double *gw, double *gb) {
    const int64_t C = b->C, n = N * S;
    int64_t c, i, k;
    if (b->track) b->nbt++;
    for (c = 0; c < C; c++) {
        double mean = 0, var = 0, invstd, w = b->weight ? b->weight[c] : 1.0, bb = b->bias ? b->bias[c] : 0.0;
        double sdy = 0, sdyxhat = 0, f;
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) mean += x[ref_index(b->channels_last, i, c, k, C, S)];
        mean /= (double)n;
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) {
                double d = x[ref_index(b->channels_last, i, c, k, C, S)] - mean;
                var += d * d;
            }
        invstd = 1.0 / sqrt(var / (double)n + b->eps);
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) {
                int64_t j = ref_index(b->channels_last, i, c, k, C, S);
                double xhat = (x[j] - mean) * invstd;
                y[j] = xhat * w + bb;
                sdy += dy[j];
                sdyxhat += dy[j] * xhat;
            }
        for (i = 0; i < N; i++)
            for (k = 0; k < S; k++) {
                int64_t j = ref_index(b->channels_last, i, c, k, C, S);
                double xhat = (x[j] - mean) * invstd;
                dx[j] = w * invstd / (double)n * ((double)n * dy[j] - sdy - xhat * sdyxhat);
            }
        gw[c] = sdyxhat;
        gb[c] = sdy;
        if (b->track) {
            f = b->momentum < 0 ? 1.0 / (double)b->nbt : b->momentum;
            b->running_mean[c] = (1 - f) * b->running_mean[c] + f * mean;
            b->running_var[c] = (1 - f) * b->running_var[c] + f * var / (double)(n - 1);
        }
    }
}

/* Largest |a - b| over the largest |b| (0 when b is all zero and a equals it). */
static double ref_rel_err_f32(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= num)) num = d; /* NaN propagates */
        if (fabs(b[i]) > den) den = fabs(b[i]);
    }
    return den > 0 ? num / den : num;
}
