/* syncbn_dump: runs ddp.h's SyncBatchNorm on R ranks and writes every input and output to files, for
   tests/interop/syncbn_check.py to compare with torch.nn.BatchNorm1d/2d/3d on the concatenated batch.
   Usage: syncbn_dump OUTDIR R     (R = 1: plain BatchNorm without a group; R > 1: forked ranks)
   Layout of OUTDIR: meta.txt (one line per case, "key=value ..."), and per case a folder
   case<k>/ with s<step>_r<rank>_<name>.f32 raw little-endian floats: the per-step inputs x, dy and outputs
   y, dx, gw, gb (this rank's local grad_weight/grad_bias), rm, rv (running stats after the step), and the
   initial w, b, rm0, rv0 (init_<name>.f32). Step "e" is an eval forward + backward on the last x.
   Ranks' batches rotate over the steps so that each rank is sometimes the empty one. */
#include "testlib.h"

#include <sys/stat.h>

#define STEPS 3

typedef struct tcase {
    int ndim_spatial; /* 0: (N, C); 1: (N, C, L); 2: (N, C, H, W); 3: (N, C, D, H, W) */
    int dims[3];
    int C, channels_last, affine, track, subgroups; /* subgroups: 2 = ranks split in two halves */
    double momentum, eps;                           /* as in ddp_syncbn_desc */
} tcase;

static const tcase cases[] = {
    {0, {1, 1, 1}, 5, 0, 1, 1, 0, 0.0, 0.0},      /* BatchNorm1d (N, C) */
    {1, {7, 1, 1}, 3, 0, 1, 1, 0, 0.3, 1e-3},     /* BatchNorm1d (N, C, L) */
    {2, {5, 6, 1}, 16, 0, 1, 1, 0, 0.0, 0.0},     /* BatchNorm2d */
    {2, {3, 5, 1}, 19, 1, 1, 1, 0, -1.0, 0.0},    /* BatchNorm2d channels_last, momentum None */
    {3, {3, 4, 5}, 4, 0, 0, 1, 0, 0.0, 0.0},      /* BatchNorm3d, affine=False */
    {3, {2, 3, 4}, 9, 1, 1, 0, 0, 0.0, 0.0},      /* BatchNorm3d channels_last, track_running_stats=False */
    {2, {4, 4, 1}, 8, 0, 1, 1, 2, 0.1, 0.0},      /* BatchNorm2d on two subgroups */
};
#define NCASES (int)(sizeof cases / sizeof cases[0])

static const char *outdir;

/* The batch of `rank` at `step`: a fixed list per world size, rotated by the step. */
static int64_t batch_of(int R, int rank, int step) {
    static const int64_t b1[] = {6}, b2[] = {5, 0}, b3[] = {4, 0, 3}, b4[] = {2, 5, 0, 1};
    static const int64_t *lists[] = {NULL, b1, b2, b3, b4};
    if (R > 4) return (rank + step) % 3; /* 0, 1 or 2: many small and empty batches */
    return lists[R][(rank + step) % R];
}

static void dump(int k, const char *name, const float *v, int64_t n) {
    char path[512];
    FILE *f;
    snprintf(path, sizeof path, "%s/case%d/%s.f32", outdir, k, name);
    f = fopen(path, "wb");
    CHECK(f != NULL, "cannot write %s", path);
    CHECK(n == 0 || fwrite(v, sizeof(float), (size_t)n, f) == (size_t)n, "short write to %s", path);
    fclose(f);
}

static void fill(float *v, int64_t n, uint64_t seed, float offset, float scale) {
    int64_t i;
    for (i = 0; i < n; i++) v[i] = offset + scale * (float)((double)(tl_rand(&seed) >> 11) / 9007199254740992.0 * 2 - 1);
}

static int64_t spatial_of(const tcase *t) {
    int64_t s = 1;
    int i;
    for (i = 0; i < t->ndim_spatial; i++) s *= t->dims[i];
    return s;
}

/* One case on this rank: create, STEPS training steps, one eval step; dump everything. */
static void run_case(int k, ddp_group *world, ddp_group *sub, int rank, int R) {
    const tcase *t = &cases[k];
    const int64_t S = spatial_of(t), C = t->C, max_n = 8 * S * C;
    float *x = (float *)malloc(sizeof(float) * (size_t)max_n), *dy = (float *)malloc(sizeof(float) * (size_t)max_n);
    float *y = (float *)malloc(sizeof(float) * (size_t)max_n), *dx = (float *)malloc(sizeof(float) * (size_t)max_n);
    float w[64], b[64], rm[64], rv[64], gw[64], gb[64];
    char name[64];
    ddp_syncbn_desc d;
    ddp_syncbn *bn;
    int64_t batch = 0;
    int step;
    CHECK(x && dy && y && dx && C <= 64, "case %d: no memory", k);
    fill(w, C, 11u + (uint64_t)k, 1.0f, 0.5f);
    fill(b, C, 22u + (uint64_t)k, 0.0f, 0.5f);
    fill(rm, C, 33u + (uint64_t)k, 0.0f, 0.3f);
    fill(rv, C, 44u + (uint64_t)k, 1.0f, 0.3f);
    if (rank == 0) {
        dump(k, "init_w", w, C);
        dump(k, "init_b", b, C);
        dump(k, "init_rm", rm, C);
        dump(k, "init_rv", rv, C);
    }
    memset(&d, 0, sizeof d);
    d.num_features = t->C;
    d.eps = t->eps;
    d.momentum = t->momentum;
    d.channels_last = t->channels_last;
    d.weight = t->affine ? w : NULL;
    d.bias = t->affine ? b : NULL;
    d.running_mean = t->track ? rm : NULL;
    d.running_var = t->track ? rv : NULL;
    d.group = sub;
    CHECK_OK(ddp_syncbn_create(world, &d, &bn), world);
    for (step = 0; step <= STEPS; step++) {
        const int eval = step == STEPS;
        const char *tag = eval ? "e" : NULL;
        char s[8];
        if (!eval) {
            batch = batch_of(R, rank, step);
            fill(x, batch * S * C, 1000u * (uint64_t)k + 10u * (uint64_t)step + (uint64_t)rank, 0.7f * (float)(rank - 1),
                 1.0f + 0.25f * (float)rank);
            fill(dy, batch * S * C, 0x9e3779b9u + 5000u * (uint64_t)k + 10u * (uint64_t)step + (uint64_t)rank, 0.2f, 1.0f);
            snprintf(s, sizeof s, "%d", step);
            tag = s;
        }
        memset(gw, 0, sizeof gw);
        memset(gb, 0, sizeof gb);
        CHECK_OK(ddp_syncbn_forward(bn, x, y, batch, S, !eval), world);
        CHECK_OK(ddp_syncbn_backward(bn, x, dy, dx, gw, gb, batch, S), world);
#define DUMP(NAME, V, N)                                                  \
    do {                                                                  \
        snprintf(name, sizeof name, "s%s_r%d_" NAME, tag, rank);          \
        dump(k, name, V, N);                                              \
    } while (0)
        DUMP("x", x, batch * S * C);
        DUMP("dy", dy, batch * S * C);
        DUMP("y", y, batch * S * C);
        DUMP("dx", dx, batch * S * C);
        DUMP("gw", gw, C);
        DUMP("gb", gb, C);
        DUMP("rm", rm, C);
        DUMP("rv", rv, C);
        snprintf(name, sizeof name, "s%s_r%d_nbt", tag, rank);
        {
            float nbt = (float)ddp_syncbn_num_batches_tracked(bn);
            dump(k, name, &nbt, 1);
        }
#undef DUMP
    }
    ddp_syncbn_destroy(bn);
    free(x);
    free(dy);
    free(y);
    free(dx);
}

static int run_rank(int rank, int R, void *arg) {
    ddp_group *world = NULL, *halves[2] = {NULL, NULL};
    int k;
    (void)arg;
    if (R > 1) {
        int lo[64], hi[64], i;
        CHECK_OK(ddp_init(NULL, &world), NULL);
        for (i = 0; i < R / 2; i++) lo[i] = i;
        for (i = R / 2; i < R; i++) hi[i - R / 2] = i;
        CHECK_OK(ddp_new_group(world, lo, R / 2, &halves[0]), world);
        CHECK_OK(ddp_new_group(world, hi, R - R / 2, &halves[1]), world);
    }
    for (k = 0; k < NCASES; k++) {
        ddp_group *sub = NULL;
        if (cases[k].subgroups && R < 4) continue; /* needs two halves of 2+ ranks */
        if (cases[k].subgroups) sub = halves[rank < R / 2 ? 0 : 1];
        run_case(k, world, sub, rank, R);
    }
    if (halves[0]) ddp_destroy(halves[0]);
    if (halves[1]) ddp_destroy(halves[1]);
    if (world) CHECK_OK(ddp_destroy(world), NULL);
    return 0;
}

int main(int argc, char **argv) {
    FILE *meta;
    char path[512];
    int R, k, step, r;
    if (argc != 3 || (R = atoi(argv[2])) < 1 || R > 64) {
        fprintf(stderr, "usage: syncbn_dump OUTDIR RANKS(1..64)\n");
        return 2;
    }
    outdir = argv[1];
    snprintf(path, sizeof path, "%s/meta.txt", outdir);
    meta = fopen(path, "w");
    CHECK(meta != NULL, "cannot write %s", path);
    for (k = 0; k < NCASES; k++) {
        const tcase *t = &cases[k];
        if (t->subgroups && R < 4) continue;
        snprintf(path, sizeof path, "%s/case%d", outdir, k);
        CHECK(mkdir(path, 0777) == 0 || errno == EEXIST, "mkdir %s: %s", path, strerror(errno));
        fprintf(meta, "case=%d ranks=%d steps=%d ndim=%d dims=%d,%d,%d C=%d channels_last=%d affine=%d track=%d "
                      "subgroups=%d momentum=%.17g eps=%.17g batches=",
                k, R, STEPS, t->ndim_spatial, t->dims[0], t->dims[1], t->dims[2], t->C, t->channels_last, t->affine,
                t->track, t->subgroups, t->momentum, t->eps);
        for (step = 0; step < STEPS; step++)
            for (r = 0; r < R; r++) fprintf(meta, "%s%lld", step + r ? "," : "", (long long)batch_of(R, r, step));
        fprintf(meta, "\n");
    }
    fclose(meta);
    if (R == 1) return run_rank(0, 1, NULL);
    return tl_run_ranks(R, run_rank, NULL, 120);
}
