/* tests/test_nccl_fsdp.cpp: FSDP (zero_stage 3) on the nccl backend, without a GPU. Built by
   tests/test_nccl_fsdp.sh with a host C++17 compiler against the CUDA harness (tests/cuda_harness) and its
   fake NCCL (tests/cuda_harness/nccl.h: NCCL's calls between processes, on the harness's device memory,
   which the host cannot touch), with ddp_cuda.cu's NCCL glue built for it. This file is the implementation
   (DDP_IMPLEMENTATION with DDP_CUDA).

   The model of the FSDP tests (tests/fsdp_model.h: a KEEP root and 4 layers) is trained for STEPS AdamW
   steps twice with the same program: first on backend cpu with host memory, then on backend nccl with its
   parameters registered in device memory (the master shards, gradient slices, gather pool and unit
   gradients are then device memory: cudaMalloc'd by the backend, filled by its kernels and NCCL's
   all-gather and reduce-scatter). After every step, each rank's master shards on nccl equal those of the
   cpu run (bit for bit at 1 and 2 ranks, where a sum of two has one order; within 1e-6 at 3 and 4, whose
   sums NCCL and the cpu backend take in different orders), and the serial model (fsdp_model.h: every
   rank's gradient averaged in f64) within the mode's tolerance. Modes: prefetch 1, no_sync x 2 (the
   slices accumulate on the device: the backend's accumulate kernel), param_dtype bf16, bf16 comm,
   find_unused, no_sync x 2 with accumulate_unsharded (the unit gradients accumulate on the device). ddp_fsdp_save_full from nccl (units gathered into a device buffer on root, copied to the
   host) writes the same file as from cpu at 1 and 2 ranks. */
#define DDP_CUDA
#include "testlib.h"
#include "ref_optim.h"

#include <cuda_runtime.h>

#include "fsdp_model.h"

#define STEPS 3

static const mode MODES[] = {
    {"prefetch 1", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0},
    {"no_sync x2", 1, 2, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 0, 0, 0, -1, 0},
    {"param_dtype bf16", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_BF16, 1e-6, 1, 0, 0, -1, 0},
    {"bf16 comm", 1, 1, 0, DDP_BF16, DDP_DTYPE_DEFAULT, 2e-2, 1, 0, 0, -1, 0},
    {"find_unused", 0, 1, 1, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0},
    {"no_sync x2, accumulate_unsharded", 1, 2, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 1},
};
#define NMODES (int)(sizeof MODES / sizeof MODES[0])

static char dir[256]; /* the cpu run's shards, per rank and mode, for the nccl run to compare with */

/* bytes between host and device memory either way (the harness's cudaMemcpy checks the ranges). */
static void copy(void *dst, const void *src, size_t bytes) {
    CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess, "cudaMemcpy of %zu bytes", bytes);
}

/* Parameter i of unit u as the program reads it: gathered (param_dtype), into w as floats. */
static void read_param(ddp_reducer *r, const mode *m, int i, float *w) {
    const size_t es = m->param == DDP_BF16 ? 2 : 4;
    void *h = malloc(COUNT[i] * es);
    const void *p = ddp_fsdp_param(r, i);
    CHECK(p, "%s: parameter %d is not gathered", m->name, i);
    copy(h, p, COUNT[i] * es);
    for (size_t e = 0; e < COUNT[i]; e++) w[e] = (float)tl_load_value(h, e, m->param == DDP_BF16 ? DDP_BF16 : DDP_F32);
    free(h);
}

/* The program's backward for unit u: its gradients from the gathered weights added into ddp_fsdp_grad's
   buffer (zeroed when taken; with accumulate_unsharded it holds the no_sync passes' sum), then handed over. */
static void unit_backward(ddp_reducer *r, const mode *m, int u, int rank, int step, int a) {
    const ddp_dtype gt = m->param == DDP_BF16 ? DDP_BF16 : DDP_F32;
    float w[1000];
    for (int i = NP - 1; i >= 0; i--) {
        if (UNIT_OF[i] != u) continue;
        void *gr = ddp_fsdp_grad(r, i), *h = malloc(COUNT[i] * 4);
        CHECK(gr, "%s: unit %d: no gradient buffer", m->name, u);
        read_param(r, m, i, w);
        copy(h, gr, COUNT[i] * ddp_dtype_size(gt));
        for (size_t e = 0; e < COUNT[i]; e++)
            tl_store_value(h, e, gt, tl_load_value(h, e, gt) + at_use(m, grad_of(w[e], rank, step, a, i, e)));
        copy(gr, h, COUNT[i] * ddp_dtype_size(gt));
        free(h);
    }
    CHECK_OK(ddp_fsdp_grads_ready(r, u), NULL);
}

/* One run of the mode on this rank's group: params in device memory when on_device. Each step's master
   shards go to (cpu run) or are compared with (nccl run) the file dir/shards.<mode>.<rank>. */
static void train(ddp_group *g, const mode *m, int k, int on_device) {
    const int rank = ddp_rank(g), world = ddp_world_size(g);
    ddp_reducer_desc d;
    ddp_reducer *r;
    const ddp_shard *sh;
    void *param[NP];
    float *mm[64], *vv[64], *hp[64], *hg[64];
    serial ref;
    char path[400];
    FILE *f;
    int t = 0;
    memset(&d, 0, sizeof d);
    d.zero_stage = 3, d.prefetch = m->prefetch, d.param_dtype = m->param, d.comm_dtype = m->comm;
    d.find_unused_parameters = m->unused, d.accumulate_unsharded = m->unsharded;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    for (int i = 0, u = -1; i < NP; i++) {
        char name[32];
        float *h = (float *)malloc(COUNT[i] * 4);
        if (UNIT_OF[i] != u) {
            u = UNIT_OF[i];
            snprintf(name, sizeof name, u ? "layer%d" : "root", u);
            CHECK(ddp_fsdp_unit(r, name, u ? 0 : DDP_FSDP_KEEP) == u, "unit %d", u);
        }
        for (size_t e = 0; e < COUNT[i]; e++) h[e] = rank ? 99.0f : initial(i, e); /* rank 0's values win */
        if (on_device) {
            CHECK(cudaMalloc(&param[i], COUNT[i] * 4) == cudaSuccess, "cudaMalloc");
            copy(param[i], h, COUNT[i] * 4);
            free(h);
        } else {
            param[i] = h;
        }
        param_name(i, name, sizeof name);
        CHECK_OK(ddp_reducer_add_param(r, name, param[i], NULL, COUNT[i], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_param_shape(r, 1, 2, L1W_SHAPE), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    const int nsh = ddp_reducer_shards(r, &sh);
    CHECK(nsh > 0 && nsh <= 64, "%d shards", nsh);
    for (int j = 0; j < nsh; j++) {
        CHECK(ddp__cuda_is_device_pointer(sh[j].param_data) == on_device, "%s: shard %d's memory", m->name, j);
        mm[j] = (float *)calloc(sh[j].count, 4), vv[j] = (float *)calloc(sh[j].count, 4);
        hp[j] = (float *)malloc(sh[j].count * 4), hg[j] = (float *)malloc(sh[j].count * 4);
    }
    snprintf(path, sizeof path, "%s/shards.%d.%d", dir, k, rank);
    CHECK((f = fopen(path, on_device ? "rb" : "wb")) != NULL, "open %s", path);
    serial_init(&ref);
    for (int step = 0; step < STEPS; step++) {
        for (int a = 0; a < m->accum; a++) {
            CHECK_OK(ddp_reducer_set_sync(r, a == m->accum - 1), g);
            CHECK_OK(ddp_fsdp_wait(r, 0), g); /* forward: prefetching as far as the pool allows */
            for (int u = 1; u <= m->prefetch && u < NU; u++) CHECK_OK(ddp_fsdp_gather(r, u), g);
            for (int u = 0; u < NU; u++) {
                CHECK_OK(ddp_fsdp_wait(r, u), g);
                if (u + 1 < NU) CHECK_OK(ddp_fsdp_release(r, u), g);
                if (u + 1 + m->prefetch < NU) CHECK_OK(ddp_fsdp_gather(r, u + 1 + m->prefetch), g);
            }
            CHECK_OK(ddp_reducer_begin_backward(r), g);
            for (int u = NU - 1; u >= 0; u--) {
                CHECK_OK(ddp_fsdp_wait(r, u), g);
                if (u > 1 && m->prefetch) CHECK_OK(ddp_fsdp_gather(r, u - 1), g);
                if (skips(m, u, rank, step, a)) CHECK_OK(ddp_fsdp_grads_ready(r, u), g); /* not used on this rank */
                else unit_backward(r, m, u, rank, step, a);
                CHECK_OK(ddp_fsdp_release(r, u), g);
            }
            CHECK_OK(ddp_reducer_end_backward(r), g);
        }
        t++;
        serial_step(&ref, m, world, step, t);
        for (int j = 0; j < nsh; j++) { /* AdamW on the shards (on the host: the model's optimizer is ref_optim.h's) */
            copy(hp[j], sh[j].param_data, sh[j].count * 4);
            copy(hg[j], sh[j].grad, sh[j].count * 4);
            if (ddp_reducer_param_used(r, sh[j].param)) ref_adamw(hp[j], hg[j], mm[j], vv[j], sh[j].count, t);
            copy(sh[j].param_data, hp[j], sh[j].count * 4);
            for (size_t e = 0; e < sh[j].count; e++) {
                float want = ref.p[sh[j].param][sh[j].offset + e], cpu;
                CHECK(fsdp_close(hp[j][e], want, m->tol), "%s (%s), step %d: shard %d [%zu]: %.9g, serial %.9g", m->name,
                      on_device ? "nccl" : "cpu", step, j, e, hp[j][e], want);
                if (!on_device) {
                    CHECK(fwrite(&hp[j][e], 4, 1, f) == 1, "write %s", path);
                    continue;
                }
                CHECK(fread(&cpu, 4, 1, f) == 1, "read %s", path);
                CHECK(world <= 2 ? hp[j][e] == cpu : fsdp_close(hp[j][e], cpu, 1e-6), "%s, step %d: shard %d [%zu]: "
                      "nccl %.9g, cpu %.9g", m->name, step, j, e, hp[j][e], cpu);
            }
        }
    }
    fclose(f);
    if (k == 0) { /* the whole model, written from this run's shards */
        snprintf(path, sizeof path, "%s/full.%s.safetensors", dir, on_device ? "nccl" : "cpu");
        CHECK_OK(ddp_fsdp_save_full(r, path, world - 1, NULL), g);
    }
    serial_free(&ref);
    ddp_reducer_destroy(r);
    for (int j = 0; j < nsh; j++) free(mm[j]), free(vv[j]), free(hp[j]), free(hg[j]);
    for (int i = 0; i < NP; i++) on_device ? (void)cudaFree(param[i]) : free(param[i]);
}

static int rank_main(int rank, int n, void *arg) {
    const int on_device = arg != NULL;
    ddp_group *g = NULL;
    (void)rank, (void)n;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK(!strcmp(ddp_backend_name(g), on_device ? "nccl" : "cpu"), "backend %s", ddp_backend_name(g));
    for (int k = 0; k < NMODES; k++) train(g, &MODES[k], k, on_device);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* The whole file's bytes. */
static char *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    CHECK(f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0, "read %s", path);
    buf = (char *)malloc((size_t)n);
    CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n, "read %s", path);
    fclose(f);
    *size = (size_t)n;
    return buf;
}

int main(void) {
    char tmpl[] = "/tmp/ddp_nccl_fsdp.XXXXXX";
    CHECK(mkdtemp(tmpl), "mkdtemp");
    snprintf(dir, sizeof dir, "%s", tmpl);
    for (int n = 1; n <= 4; n++) {
        double t0 = tl_now();
        setenv("DDP_BACKEND", "cpu", 1);
        CHECK(tl_run_ranks(n, rank_main, NULL, 120) == 0, "%d ranks on backend cpu", n);
        setenv("DDP_BACKEND", "nccl", 1);
        CHECK(tl_run_ranks(n, rank_main, (void *)1, 120) == 0, "%d ranks on backend nccl", n);
        if (n <= 2) {
            char a[400], b[400];
            size_t sa, sb;
            snprintf(a, sizeof a, "%s/full.cpu.safetensors", dir);
            snprintf(b, sizeof b, "%s/full.nccl.safetensors", dir);
            char *fa = slurp(a, &sa), *fb = slurp(b, &sb);
            CHECK(sa == sb && memcmp(fa, fb, sa) == 0, "%d ranks: ddp_fsdp_save_full from nccl differs from cpu's", n);
            free(fa), free(fb);
        }
        printf("%d rank(s): zero_stage 3 on nccl (device memory) = cpu %s, serial within the tolerance; %d modes, "
               "%d steps (%.1f s)\n", n, n <= 2 ? "bit for bit, save_full's file too" : "within 1e-6", NMODES, STEPS,
               tl_now() - t0);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    printf("ok\n");
    return 0;
}
