/* bench_fsdp: ZeRO stage 3 (FSDP) against stage 2 and plain DDP on the MLP of FSDP.md's goals G1 and G3:
   8 x (Linear(1024, 1024) + ReLU) = 8.4M f32 parameters (33.6 MB), per-rank batch 64, MSE loss, SGD
   lr 1e-2 on what each rank owns; forward and backward with cblas_sgemm from OpenBLAS (Debian's
   libopenblas0, loaded with dlopen at run time, so building needs nothing but the C compiler), one BLAS
   thread per rank. Launched by ddprun (2 ranks: bench/bench_fsdp.sh):

       build/ddprun --standalone --nproc-per-node 2 build/bench_fsdp [steps=20] [block=5]
       build/ddprun --standalone --nproc-per-node 2 build/bench_fsdp mem MODE [steps=3]

   Modes (one reducer each, all on the same group):
     s0      stage 0, plain DDP: gradients registered (copy mode), default 25 MiB buckets, SGD on everything.
     s2      zero_stage 2, one unit per layer (ddp_fsdp_unit: buckets = layers); the program keeps the
             whole model and computes each gradient into one scratch buffer; SGD on the shards, then
             gather_params_async, and the next forward waits for each layer (wait_param): the gather
             overlapped with the forward, the fastest stage 2 loop.
     s3p0    zero_stage 3, prefetch 0: every ddp_fsdp_wait gathers (nothing hidden).
     s3p1    zero_stage 3, prefetch 1, reducer.h's loop: forward gathers unit l+1 while computing layer l;
             backward gathers l-1 while computing l, then ddp_fsdp_grads_ready and release per layer. The
             first wait of each forward has nothing before it to hide behind (an unprefetched wait).
     s3p1e   s3p1 plus unit 0 gathered during the optimizer step (after unit 0's shards are stepped,
             while the other units' are): no unprefetched wait.
   Timing run: the modes take turns in blocks of `block` steps (the first step of each block untimed:
   stage 2's pending gather is drained between blocks), after one untimed round; per mode the median of
   `steps` timed steps of rank 0 (forward, backward, optimizer step: end to end), and its ratio to s2 and
   s0 in this run. Stage 3 rows also give, over the timed steps: exposed = gather_wait_seconds /
   gather_seconds, unprefetched waits per step, and param_bytes_peak against FSDP.md G1's formula
   ceil-per-unit(P/N) + (1 + prefetch) x largest unit. The last lines: a checksum (FNV-1a 64 of the
   final weights' bytes) per mode: every mode ran the same steps on the same data, and s2, s3p0, s3p1 and
   s3p1e must agree bit for bit ("same" / "DIFFERENT"; s0 all-reduces instead, equal too at 2 ranks).

   mem MODE (one mode per process, for VmHWM): glibc's mmap threshold fixed (freed buffers go back to
   the system), the transport and BLAS warmed up, then RSS measured: "setup" = VmHWM growth from before
   the model to after finalize (stage 3: the program's full model is freed after finalize, but it
   existed for rank 0's broadcast), "train" = VmHWM growth over `steps` steps from before the model
   (peak reset by /proc/self/clear_refs after the set-up), next to what the rank is known to hold:
   param_bytes_peak and gradient_bytes (reducer statistics) and the program's own parameter and gradient
   buffers; "other" is the rest (activations and BLAS buffers were allocated before the baseline). */
#define DDP_IMPLEMENTATION
#include "ddp.h"
#include "bench_util.h" /* bench_now, bench_cmp_double */

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#define L 8
#define D 1024
#define B 64
#define LR 1e-2f
#define NMODES 5

/* ---- OpenBLAS through dlopen ---- */
enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_fn sgemm;
static int (*blas_threads)(void);
static char *(*blas_config)(void);

static int load_blas(void) {
    void *h = dlopen("libopenblas.so.0", RTLD_NOW), *s, *t, *c;
    void (*set_threads)(int);
    if (!h) return fprintf(stderr, "bench_fsdp: %s (install Debian's libopenblas0)\n", dlerror()), 0;
    s = dlsym(h, "cblas_sgemm"), t = dlsym(h, "openblas_set_num_threads"), c = dlsym(h, "openblas_get_config");
    if (!s || !t || !c || !dlsym(h, "openblas_get_num_threads")) return fprintf(stderr, "bench_fsdp: OpenBLAS symbols missing\n"), 0;
    memcpy(&sgemm, &s, sizeof s); /* POSIX: a dlsym result converts to a function pointer */
    memcpy(&set_threads, &t, sizeof t);
    memcpy(&blas_config, &c, sizeof c);
    s = dlsym(h, "openblas_get_num_threads");
    memcpy(&blas_threads, &s, sizeof s);
    set_threads(1); /* one thread per rank, whatever OPENBLAS_NUM_THREADS says */
    return 1;
}

/* ---- the program's data: activations shared by the modes (each step writes them before reading) ---- */
static float *H[L + 1], *dH, *dZ, *target;

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static const char *NAMES[NMODES] = {"s0", "s2", "s3p0", "s3p1", "s3p1e"};
static const char *LABELS[NMODES] = {"stage 0 (DDP)", "stage 2", "stage 3 prefetch 0", "stage 3 prefetch 1",
                                     "stage 3 prefetch 1, early u0"};

typedef struct model {
    int mode, stage, prefetch, early, pending; /* pending: s2's gather_params_async in flight */
    ddp_reducer *r;
    float *W[L], *b[L], *gW[L], *gb[L]; /* the program's (s3: none after finalize) */
    const ddp_shard *sh;
    int nsh;
    double *t;
    int nt;
    double gsec, gwait;
    uint64_t unpre;
    size_t program_bytes; /* parameter and gradient memory the program itself holds while training */
} model;

static void die(ddp_group *g, const char *what) {
    fprintf(stderr, "bench_fsdp: %s: %s\n", what, ddp_last_error(g));
    exit(1);
}
#define OK(g, call)                         \
    do {                                    \
        if ((call) != DDP_SUCCESS) die(g, #call); \
    } while (0)

static void model_init(model *m, ddp_group *g, int mode, int steps) {
    ddp_reducer_desc d;
    uint64_t s = 7;
    size_t i;
    int l;
    memset(m, 0, sizeof *m);
    m->mode = mode;
    m->stage = mode == 0 ? 0 : mode == 1 ? 2 : 3;
    m->prefetch = mode >= 3;
    m->early = mode == 4;
    m->t = (double *)malloc(sizeof(double) * (size_t)(steps > 0 ? steps : 1));
    memset(&d, 0, sizeof d);
    d.zero_stage = m->stage;
    d.prefetch = m->prefetch;
    OK(g, ddp_reducer_create(g, &d, &m->r));
    if (m->stage == 2) { /* one scratch gradient for every layer: read at grad_ready */
        float *sw = (float *)calloc((size_t)D * D, sizeof(float)), *sb = (float *)calloc(D, sizeof(float));
        for (l = 0; l < L; l++) m->gW[l] = sw, m->gb[l] = sb;
        m->program_bytes = ((size_t)D * D + D) * sizeof(float) * (L + 1);
    }
    for (l = 0; l < L; l++) {
        char name[32];
        m->W[l] = (float *)malloc((size_t)D * D * sizeof(float));
        m->b[l] = (float *)malloc(D * sizeof(float));
        for (i = 0; i < (size_t)D * D; i++) m->W[l][i] = frand(&s) / 32.0f; /* torch's U(-1/sqrt(in), 1/sqrt(in)) */
        for (i = 0; i < D; i++) m->b[l][i] = frand(&s) / 32.0f;
        if (m->stage == 0) {
            m->gW[l] = (float *)calloc((size_t)D * D, sizeof(float));
            m->gb[l] = (float *)calloc(D, sizeof(float));
        }
        if (m->stage) {
            snprintf(name, sizeof name, "layer%d", l);
            if (ddp_fsdp_unit(m->r, name, 0) != l) die(g, "ddp_fsdp_unit");
        }
        snprintf(name, sizeof name, "%d.weight", 2 * l);
        OK(g, ddp_reducer_add_param(m->r, name, m->W[l], m->stage == 3 ? NULL : m->gW[l], (size_t)D * D, DDP_F32, NULL));
        snprintf(name, sizeof name, "%d.bias", 2 * l);
        OK(g, ddp_reducer_add_param(m->r, name, m->b[l], m->stage == 3 ? NULL : m->gb[l], D, DDP_F32, NULL));
    }
    if (m->stage == 0) m->program_bytes = ((size_t)D * D + D) * sizeof(float) * L * 2;
    OK(g, ddp_reducer_finalize(m->r));
    if (m->stage == 3) /* the master shards hold this rank's slices now */
        for (l = 0; l < L; l++) free(m->W[l]), free(m->b[l]), m->W[l] = m->b[l] = NULL;
    if (m->stage) m->nsh = ddp_reducer_shards(m->r, &m->sh);
}

/* Y = relu(X W^T + b), X: B x D, W: D x D (out x in, torch's layout) */
static void layer_forward(const float *x, const float *w, const float *bias, float *y) {
    int s, j;
    sgemm(RowMajor, NoTrans, Trans, B, D, D, 1.0f, x, D, w, D, 0.0f, y, D);
    for (s = 0; s < B; s++)
        for (j = 0; j < D; j++) {
            float v = y[s * D + j] + bias[j];
            y[s * D + j] = v > 0 ? v : 0;
        }
}

/* layer l's backward from dH (the gradient of its output): gw = dZ^T x, gb = colsum dZ, dH = dZ W (l > 0) */
static void layer_backward(int l, const float *w, float *gw, float *gbias) {
    int s, j;
    for (s = 0; s < B * D; s++) dZ[s] = H[l + 1][s] > 0 ? dH[s] : 0;
    sgemm(RowMajor, Trans, NoTrans, D, D, B, 1.0f, dZ, D, H[l], D, 0.0f, gw, D);
    for (j = 0; j < D; j++) gbias[j] = 0;
    for (s = 0; s < B; s++)
        for (j = 0; j < D; j++) gbias[j] += dZ[s * D + j];
    if (l > 0) sgemm(RowMajor, NoTrans, NoTrans, B, D, D, 1.0f, dZ, D, w, D, 0.0f, dH, D);
}

static const float *param(model *m, int i) {
    if (m->stage == 3) return (const float *)ddp_fsdp_param(m->r, i);
    return i % 2 ? m->b[i / 2] : m->W[i / 2];
}

static void train_step(model *m, ddp_group *g) {
    ddp_reducer *r = m->r;
    int l, j, k, s;
    /* forward */
    if (m->stage == 3) OK(g, ddp_fsdp_wait(r, 0));
    for (l = 0; l < L; l++) {
        if (m->stage == 2 && m->pending) OK(g, ddp_reducer_wait_param(r, 2 * l)); /* the bucket: W and b */
        if (m->stage == 3 && m->prefetch && l + 1 < L) OK(g, ddp_fsdp_gather(r, l + 1));
        layer_forward(H[l], param(m, 2 * l), param(m, 2 * l + 1), H[l + 1]);
        if (m->stage == 3 && l + 1 < L) {
            OK(g, ddp_fsdp_release(r, l));
            OK(g, ddp_fsdp_wait(r, l + 1));
        }
    }
    m->pending = 0;
    for (s = 0; s < B * D; s++) dH[s] = 2.0f * (H[L][s] - target[s]) / (float)(B * D);
    /* backward */
    OK(g, ddp_reducer_begin_backward(r));
    for (l = L - 1; l >= 0; l--) {
        if (m->stage == 3) {
            OK(g, ddp_fsdp_wait(r, l));
            if (l && m->prefetch) OK(g, ddp_fsdp_gather(r, l - 1));
            layer_backward(l, param(m, 2 * l), (float *)ddp_fsdp_grad(r, 2 * l), (float *)ddp_fsdp_grad(r, 2 * l + 1));
            OK(g, ddp_fsdp_grads_ready(r, l));
            OK(g, ddp_fsdp_release(r, l));
        } else {
            layer_backward(l, m->W[l], m->gW[l], m->gb[l]);
            OK(g, ddp_reducer_grad_ready(r, 2 * l));
            OK(g, ddp_reducer_grad_ready(r, 2 * l + 1));
        }
    }
    OK(g, ddp_reducer_end_backward(r));
    /* SGD on what this rank owns */
    if (m->stage == 0) {
        size_t i;
        for (l = 0; l < L; l++) {
            for (i = 0; i < (size_t)D * D; i++) m->W[l][i] -= LR * m->gW[l][i];
            for (i = 0; i < D; i++) m->b[l][i] -= LR * m->gb[l][i];
        }
        return;
    }
    for (k = 0; k < 2; k++) { /* unit 0's shards first, so s3p1e can start its gather before the rest */
        for (j = 0; j < m->nsh; j++) {
            float *p = (float *)m->sh[j].param_data;
            const float *gr = (const float *)m->sh[j].grad;
            size_t i;
            if ((m->sh[j].param < 2) != (k == 0)) continue;
            for (i = 0; i < m->sh[j].count; i++) p[i] -= LR * gr[i];
        }
        if (k == 0 && m->early) OK(g, ddp_fsdp_gather(r, 0));
    }
    if (m->stage == 2) {
        OK(g, ddp_reducer_gather_params_async(r));
        m->pending = 1;
    }
}

/* Drain what a mode leaves in flight between blocks (s2's gather; s3p1e's unit 0), untimed. */
static void settle(model *m, ddp_group *g) {
    if (m->stage == 2 && m->pending) {
        OK(g, ddp_reducer_wait_param(m->r, -1));
        m->pending = 0;
    }
}

static void stats(model *m, ddp_reducer_statistics *st) {
    if (ddp_reducer_get_statistics(m->r, st)) memset(st, 0, sizeof *st);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = (const unsigned char *)p;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

/* FNV-1a of the final weights, W0 b0 W1 b1 ... (stage 3: each unit gathered in turn) */
static uint64_t checksum(model *m, ddp_group *g) {
    uint64_t h = 1469598103934665603ull;
    int l;
    settle(m, g);
    for (l = 0; l < L; l++) {
        if (m->stage == 3) OK(g, ddp_fsdp_wait(m->r, l));
        h = fnv(h, param(m, 2 * l), (size_t)D * D * sizeof(float));
        h = fnv(h, param(m, 2 * l + 1), D * sizeof(float));
        if (m->stage == 3) OK(g, ddp_fsdp_release(m->r, l));
    }
    return h;
}

/* FSDP.md G1's formula: ceil-per-unit(P/N) + (1 + prefetch) x largest unit, in bytes */
static double formula_bytes(int world, int prefetch) {
    size_t unit = (size_t)D * D + D, per = (unit + (size_t)world - 1) / (size_t)world;
    return (double)(L * per * 4 + (size_t)(1 + prefetch) * per * (size_t)world * 4);
}

static void data_init(int rank) {
    uint64_t s = 1000 + (uint64_t)rank;
    size_t i;
    int l;
    for (l = 0; l <= L; l++) H[l] = (float *)calloc((size_t)B * D, sizeof(float));
    dH = (float *)calloc((size_t)B * D, sizeof(float));
    dZ = (float *)calloc((size_t)B * D, sizeof(float));
    target = (float *)calloc((size_t)B * D, sizeof(float));
    for (i = 0; i < (size_t)B * D; i++) H[0][i] = frand(&s), target[i] = frand(&s) * 0.5f;
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, bench_cmp_double);
    return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

static int timing(ddp_group *g, int steps, int block) {
    model m[NMODES];
    double med[NMODES];
    uint64_t sum[NMODES];
    int k, i, round, rounds = (steps + block - 1) / block, rank = ddp_rank(g), world = ddp_world_size(g);
    for (k = 0; k < NMODES; k++) model_init(&m[k], g, k, rounds * block);
    for (round = -1; round < rounds; round++)
        for (k = 0; k < NMODES; k++) {
            ddp_reducer_statistics a, z;
            train_step(&m[k], g); /* untimed: the block's first step */
            stats(&m[k], &a);
            for (i = 0; i < block; i++) {
                double t0 = bench_now();
                train_step(&m[k], g);
                if (round >= 0) m[k].t[m[k].nt++] = bench_now() - t0;
            }
            stats(&m[k], &z);
            if (round >= 0) {
                m[k].gsec += z.gather_seconds - a.gather_seconds;
                m[k].gwait += z.gather_wait_seconds - a.gather_wait_seconds;
                m[k].unpre += z.unprefetched_waits - a.unprefetched_waits;
            }
            settle(&m[k], g);
        }
    for (k = 0; k < NMODES; k++) med[k] = median(m[k].t, m[k].nt), sum[k] = checksum(&m[k], g);
    if (rank == 0) {
        printf("bench_fsdp: %d ranks, MLP %d x (Linear(%d, %d) + ReLU) = %.1fM params, batch %d, SGD; OpenBLAS %d "
               "thread(s): %s\n", world, L, D, D, L * ((double)D * D + D) / 1e6, B, blas_threads(), blas_config());
        printf("%d timed steps per mode, in turns of %d (+1 untimed) after one untimed round; rank 0's median\n",
               rounds * block, block);
        printf("%-30s %9s %6s %6s %8s %10s %11s %11s\n", "mode", "step ms", "/s2", "/s0", "exposed", "unprefetch",
               "param MB", "formula MB");
        for (k = 0; k < NMODES; k++) {
            ddp_reducer_statistics st;
            stats(&m[k], &st);
            printf("%-30s %9.1f %6.3f %6.3f", LABELS[k], med[k] * 1e3, med[k] / med[1], med[k] / med[0]);
            if (m[k].stage == 3)
                printf(" %8.3f %10.2f %11.2f %11.2f\n", m[k].gwait / m[k].gsec, (double)m[k].unpre / m[k].nt,
                       st.param_bytes_peak / 1e6, formula_bytes(world, m[k].prefetch) / 1e6);
            else
                printf(" %8s %10s %11.2f %11s\n", "-", "-", L * ((double)D * D + D) * 4 / 1e6, "-"); /* the program's */
        }
        for (k = 0; k < NMODES; k++)
            printf("checksum %-6s %016llx %s\n", NAMES[k], (unsigned long long)sum[k], sum[k] == sum[1] ? "same as s2" : "DIFFERENT from s2");
    }
    for (k = 0; k < NMODES; k++) {
        ddp_reducer_destroy(m[k].r);
        free(m[k].t);
    }
    return 0;
}

/* ---- mem mode ---- */
static double status_kb(const char *key) {
    char line[256];
    double v = -1;
    size_t n = strlen(key);
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0) v = atof(line + n);
    fclose(f);
    return v;
}

static int reset_hwm(void) { /* VmHWM := VmRSS (Linux >= 4.0) */
    FILE *f = fopen("/proc/self/clear_refs", "w");
    int ok = f && fputs("5", f) >= 0;
    if (f) ok = (fclose(f) == 0) && ok;
    return ok;
}

static int memory(ddp_group *g, int mode, int steps) {
    model m;
    ddp_reducer_statistics st;
    double base, setup, train, held, anon, shmem;
    float *w = (float *)calloc((size_t)D * D, sizeof(float)), *warm = (float *)calloc((size_t)4 << 20, sizeof(float));
    int i, rank = ddp_rank(g), resets;
    /* warm up the transport (large collectives) and BLAS (its buffers) before the baseline */
    OK(g, ddp_all_reduce(g, warm, (size_t)4 << 20, DDP_F32, DDP_SUM));
    OK(g, ddp_broadcast(g, warm, (size_t)4 << 20, DDP_F32, 0));
    OK(g, ddp_all_gather(g, warm, warm + ((size_t)2 << 20), (size_t)1 << 20, DDP_F32));
    for (i = 0; i < 2; i++) { /* two unit-sized gathers and reduce-scatters in flight, as stage 3's */
        ddp_work *w2[2];
        size_t per = ((size_t)D * D + D + 1) / 2;
        float *a = (float *)calloc(4 * per, sizeof(float)), *c = (float *)calloc(4 * per, sizeof(float));
        if (i == 0) {
            OK(g, ddp_all_gather_async(g, a, c, per, DDP_F32, &w2[0]));
            OK(g, ddp_all_gather_async(g, a + 2 * per, c + 2 * per, per, DDP_F32, &w2[1]));
        } else {
            OK(g, ddp_reduce_scatter_async(g, a, c, per, DDP_F32, DDP_SUM, &w2[0]));
            OK(g, ddp_reduce_scatter_async(g, a + 2 * per, c + 2 * per, per, DDP_F32, DDP_SUM, &w2[1]));
        }
        OK(g, ddp_wait(w2[0]));
        OK(g, ddp_wait(w2[1]));
        free(a), free(c);
    }
    layer_forward(H[0], w, w, H[1]);
    layer_backward(1, w, w, w);
    free(w), free(warm);
    base = status_kb("VmRSS:"), anon = status_kb("RssAnon:"), shmem = status_kb("RssShmem:");
    resets = reset_hwm();
    model_init(&m, g, mode, 1);
    setup = status_kb("VmHWM:") - base;
    resets = reset_hwm() && resets;
    for (i = 0; i < steps; i++) train_step(&m, g);
    settle(&m, g);
    train = status_kb("VmHWM:") - base;
    anon = status_kb("RssAnon:") - anon, shmem = status_kb("RssShmem:") - shmem;
    stats(&m, &st);
    held = (double)st.param_bytes_peak + (double)st.gradient_bytes + (double)m.program_bytes;
    printf("mem %-6s rank %d: VmHWM growth setup %7.2f MB, train %7.2f MB%s; param_bytes_peak %7.2f MB, "
           "gradient_bytes %7.2f MB, program %7.2f MB, other %6.2f MB; formula %7.2f MB; now: anon %+.2f MB, shmem %+.2f MB\n",
           NAMES[mode], rank, setup * 1024 / 1e6, train * 1024 / 1e6, resets ? "" : " (clear_refs refused: peaks include set-up)",
           st.param_bytes_peak / 1e6, st.gradient_bytes / 1e6, m.program_bytes / 1e6, (train * 1024 - held) / 1e6,
           m.stage == 3 ? formula_bytes(ddp_world_size(g), m.prefetch) / 1e6 : 0.0, anon * 1024 / 1e6, shmem * 1024 / 1e6);
    ddp_reducer_destroy(m.r);
    return 0;
}

int main(int argc, char **argv) {
    ddp_group *g;
    int rc, mem = argc > 1 && strcmp(argv[1], "mem") == 0, mode = -1, k;
#if defined(__GLIBC__) && defined(M_MMAP_THRESHOLD)
    mallopt(M_MMAP_THRESHOLD, 128 * 1024); /* fixed: large blocks are mmapped, and unmapped when freed */
#endif
    if (!load_blas()) return 2;
    if (mem) {
        for (k = 0; k < NMODES && argc > 2; k++)
            if (strcmp(argv[2], NAMES[k]) == 0) mode = k;
        if (mode < 0) return fprintf(stderr, "usage: bench_fsdp mem s0|s2|s3p0|s3p1|s3p1e [steps=3]\n"), 2;
    }
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    data_init(ddp_rank(g));
    if (mem) rc = memory(g, mode, argc > 3 ? atoi(argv[3]) : 3);
    else {
        int steps = argc > 1 ? atoi(argv[1]) : 20, block = argc > 2 ? atoi(argv[2]) : 5;
        if (steps < 1 || block < 1) return fprintf(stderr, "usage: bench_fsdp [steps=20] [block=5]\n"), 2;
        rc = timing(g, steps, block);
    }
    ddp_destroy(g);
    return rc;
}
