/* fsdp: training a model that no rank holds whole, as PyTorch's
       for layer in model.layers: fully_shard(layer)            # FSDP2: one unit per layer
       fully_shard(model)
       opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
       for batch in my_shard:
           loss_fn(model(batch)).backward(); opt.step(); opt.zero_grad()
   (FSDP FULL_SHARD, DeepSpeed's ZeRO stage 3).

   With zero_stage = 3 each rank keeps only its slice of every layer's parameters (its master shard), of
   their averaged gradients and of the AdamW state: about 1/world of each. A layer is a UNIT
   (ddp_fsdp_unit): before the layer runs, its unit is all-gathered into one of a few pool buffers
   (ddp_fsdp_gather starts it, ddp_fsdp_wait waits, ddp_fsdp_param says where each parameter is), and
   released after. The next layer's gather is started before this layer computes (prefetch = 1), so the
   communication hides behind the compute. Backward runs the layers in reverse: gather, compute the
   gradients into ddp_fsdp_grad's buffers, ddp_fsdp_grads_ready (averaged and reduce-scattered into this
   rank's slice), release. AdamW then runs on ddp_reducer_shards: the master shards and their gradients.

   The same layer functions also run serially on every rank (the whole model, the ranks' batch gradients
   averaged), and the example checks that its weights are that run's. `--save PATH` writes the trained
   model as one ordinary safetensors file (ddp_fsdp_save_full: gathered unit by unit on rank 0, never
   whole in memory), which torch's safetensors.torch.load_file reads.

   Run:  make build/fsdp build/ddprun
         build/ddprun --nproc-per-node 3 build/fsdp [--save /tmp/model.safetensors]     (1 to 4 ranks or more) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 4, H = 24, BATCH = 8, STEPS = 12 };

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* Sample i of rank r's batch s: x in [-1, 1]^H, the target y = sin(x) reversed. */
static void sample(int r, int s, int i, float *x, float *y) {
    unsigned seed = (unsigned)(r * 1000003 + s * 100003 + i * 7919 + 1);
    int k;
    for (k = 0; k < H; k++) x[k] = frand(&seed);
    for (k = 0; k < H; k++) y[k] = sinf(2.0f * x[H - 1 - k]);
}

/* Layer l: out = tanh(W in + b) (the last layer without tanh); W is H x H (torch's out x in). */
static void layer_forward(int l, const float *w, const float *b, const float *in, float *out) {
    int j, k;
    for (j = 0; j < H; j++) {
        float z = b[j];
        for (k = 0; k < H; k++) z += w[j * H + k] * in[k];
        out[j] = l == LAYERS - 1 ? z : tanhf(z);
    }
}

/* Its backward: given dL/dout, ADDS dL/dW and dL/db and writes dL/din. */
static void layer_backward(int l, const float *w, const float *in, const float *out, const float *dout, float *dw, float *db,
                           float *din) {
    float dz[H];
    int j, k;
    for (j = 0; j < H; j++) dz[j] = l == LAYERS - 1 ? dout[j] : dout[j] * (1.0f - out[j] * out[j]);
    for (k = 0; k < H; k++) din[k] = 0;
    for (j = 0; j < H; j++) {
        db[j] += dz[j];
        for (k = 0; k < H; k++) dw[j * H + k] += dz[j] * in[k], din[k] += dz[j] * w[j * H + k];
    }
}

/* AdamW (torch.optim.AdamW: lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2) on n values. */
static void adamw(float *w, const float *g, float *m, float *v, size_t n, int t) {
    float c1 = 1.0f - powf(0.9f, (float)t), c2 = 1.0f - powf(0.999f, (float)t);
    size_t i;
    for (i = 0; i < n; i++) {
        w[i] -= 1e-2f * 1e-2f * w[i];
        m[i] = 0.9f * m[i] + 0.1f * g[i];
        v[i] = 0.999f * v[i] + 0.001f * g[i] * g[i];
        w[i] -= 1e-2f * (m[i] / c1) / (sqrtf(v[i] / c2) + 1e-8f);
    }
}

/* The initial weights (rank 0's are used: the reducer broadcasts them at finalize). */
static void init(float w[LAYERS][H * H], float b[LAYERS][H]) {
    unsigned seed = 42;
    int l, i;
    for (l = 0; l < LAYERS; l++) {
        for (i = 0; i < H * H; i++) w[l][i] = frand(&seed) / sqrtf(H);
        for (i = 0; i < H; i++) b[l][i] = 0;
    }
}

/* The serial twin: one process, the whole model, the ranks' batch gradients averaged, AdamW on all. */
static void serial_run(int world, float w[LAYERS][H * H], float b[LAYERS][H]) {
    static float gw[LAYERS][H * H], gb[LAYERS][H], mw[LAYERS][H * H], vw[LAYERS][H * H], mb[LAYERS][H], vb[LAYERS][H];
    float act[LAYERS + 1][H], grad[H], din[H], y[H];
    int step, r, i, l, k;
    init(w, b);
    for (step = 0; step < STEPS; step++) {
        memset(gw, 0, sizeof gw), memset(gb, 0, sizeof gb);
        for (r = 0; r < world; r++)
            for (i = 0; i < BATCH; i++) {
                sample(r, step, i, act[0], y);
                for (l = 0; l < LAYERS; l++) layer_forward(l, w[l], b[l], act[l], act[l + 1]);
                for (k = 0; k < H; k++) grad[k] = 2.0f * (act[LAYERS][k] - y[k]) / (float)(BATCH * H * world);
                for (l = LAYERS - 1; l >= 0; l--) {
                    layer_backward(l, w[l], act[l], act[l + 1], grad, gw[l], gb[l], din);
                    memcpy(grad, din, sizeof grad);
                }
            }
        for (l = 0; l < LAYERS; l++) {
            adamw(w[l], gw[l], mw[l], vw[l], H * H, step + 1);
            adamw(b[l], gb[l], mb[l], vb[l], H, step + 1);
        }
    }
}

int main(int argc, char **argv) {
    static float w0[LAYERS][H * H], b0[LAYERS][H], ws[LAYERS][H * H], bs[LAYERS][H];
    const char *save = argc > 2 && !strcmp(argv[1], "--save") ? argv[2] : NULL;
    float act[BATCH][LAYERS + 1][H], grad[BATCH][H], din[H], y[H], **m, **v, worst = 0, loss = 0;
    int unit[LAYERS], iw[LAYERS], ib[LAYERS], rank, world, step, i, l, k, j, n;
    const int64_t shape[2] = {H, H};
    ddp_reducer_desc d;
    ddp_reducer_statistics st;
    ddp_reducer *red;
    const ddp_shard *sh;
    ddp_group *g;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL)), 1;
    rank = ddp_rank(g), world = ddp_world_size(g);

    /* the model: one unit per layer; the values are read once, at finalize, and may be freed after */
    memset(&d, 0, sizeof d);
    d.zero_stage = 3;
    d.prefetch = 1;
    ddp_reducer_create(g, &d, &red);
    init(w0, b0);
    for (l = 0; l < LAYERS; l++) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d", l);
        unit[l] = ddp_fsdp_unit(red, name, 0);
        snprintf(name, sizeof name, "layers.%d.weight", l);
        ddp_reducer_add_param(red, name, w0[l], NULL, H * H, DDP_F32, &iw[l]);
        ddp_reducer_param_shape(red, iw[l], 2, shape); /* saved as H x H, torch's Linear weight */
        snprintf(name, sizeof name, "layers.%d.bias", l);
        ddp_reducer_add_param(red, name, b0[l], NULL, H, DDP_F32, &ib[l]);
    }
    if (ddp_reducer_finalize(red) != DDP_SUCCESS) return fprintf(stderr, "finalize: %s\n", ddp_last_error(g)), 1;
    n = ddp_reducer_shards(red, &sh); /* this rank's slices: AdamW state for them only */
    m = (float **)calloc((size_t)n + 1, sizeof *m), v = (float **)calloc((size_t)n + 1, sizeof *v);
    for (j = 0; j < n; j++) m[j] = (float *)calloc(sh[j].count, 4), v[j] = (float *)calloc(sh[j].count, 4);

    for (step = 0; step < STEPS; step++) {
        /* forward, layer by layer: the next unit's all-gather runs while this layer computes */
        ddp_fsdp_gather(red, unit[0]);
        for (l = 0; l < LAYERS; l++) {
            ddp_fsdp_wait(red, unit[l]);
            if (l + 1 < LAYERS) ddp_fsdp_gather(red, unit[l + 1]);
            for (i = 0; i < BATCH; i++) {
                if (l == 0) sample(rank, step, i, act[i][0], y);
                layer_forward(l, (const float *)ddp_fsdp_param(red, iw[l]), (const float *)ddp_fsdp_param(red, ib[l]), act[i][l],
                              act[i][l + 1]);
            }
            if (l + 1 < LAYERS) ddp_fsdp_release(red, unit[l]); /* the last one stays for backward */
        }
        for (i = 0, loss = 0; i < BATCH; i++) {
            sample(rank, step, i, act[i][0], y);
            for (k = 0; k < H; k++) {
                float e = act[i][LAYERS][k] - y[k];
                grad[i][k] = 2.0f * e / (float)(BATCH * H), loss += e * e / (float)(BATCH * H);
            }
        }
        /* backward, last layer first: gradients into the units' buffers, then averaged into the slices */
        ddp_reducer_begin_backward(red);
        for (l = LAYERS - 1; l >= 0; l--) {
            ddp_fsdp_wait(red, unit[l]);
            if (l > 0) ddp_fsdp_gather(red, unit[l - 1]);
            for (i = 0; i < BATCH; i++) {
                layer_backward(l, (const float *)ddp_fsdp_param(red, iw[l]), act[i][l], act[i][l + 1], grad[i],
                               (float *)ddp_fsdp_grad(red, iw[l]), (float *)ddp_fsdp_grad(red, ib[l]), din);
                memcpy(grad[i], din, sizeof din);
            }
            ddp_fsdp_grads_ready(red, unit[l]);
            ddp_fsdp_release(red, unit[l]);
        }
        if (ddp_reducer_end_backward(red) != DDP_SUCCESS) return fprintf(stderr, "%s\n", ddp_last_error(g)), 1;
        for (j = 0; j < n; j++) adamw((float *)sh[j].param_data, (const float *)sh[j].grad, m[j], v[j], sh[j].count, step + 1);
        ddp_all_reduce(g, &loss, 1, DDP_F32, DDP_AVG);
        if (rank == 0 && (step % 4 == 0 || step == STEPS - 1)) printf("step %2d: loss %.5f\n", step, loss);
    }

    /* every rank's slices against the serial run's weights */
    serial_run(world, ws, bs);
    for (j = 0; j < n; j++) {
        const float *got = (const float *)sh[j].param_data;
        for (l = 0; l < LAYERS && sh[j].param != iw[l] && sh[j].param != ib[l]; l++) continue;
        for (k = 0; k < (int)sh[j].count; k++) {
            float want = sh[j].param == iw[l] ? ws[l][sh[j].offset + (size_t)k] : bs[l][sh[j].offset + (size_t)k];
            worst = fmaxf(worst, fabsf(got[k] - want) / (fabsf(want) + 1.0f));
        }
    }
    ddp_all_reduce(g, &worst, 1, DDP_F32, DDP_MAX);
    ddp_reducer_get_statistics(red, &st);
    if (rank == 0) {
        printf("%d ranks: every slice %s the serial run's weights (worst relative difference %.1e)\n", world,
               worst < 1e-5f ? "equals" : "DIFFERS FROM", worst);
        printf("%d ranks: parameter memory per rank %llu bytes of the model's %d (its shards + %d gather buffers)\n", world,
               (unsigned long long)st.param_bytes_peak, LAYERS * (H * H + H) * 4, 1 + d.prefetch);
        printf("the program waited for %.0f%% of the gathers' time (the rest was hidden behind compute)\n",
               st.gather_seconds > 0 ? 100.0 * st.gather_wait_seconds / st.gather_seconds : 0.0);
    }
    if (save && ddp_fsdp_save_full(red, save, 0, NULL) != DDP_SUCCESS) return fprintf(stderr, "%s\n", ddp_last_error(g)), 1;
    if (save && rank == 0) printf("saved the whole model to %s\n", save);
    for (j = 0; j < n; j++) free(m[j]), free(v[j]);
    free(m), free(v);
    ddp_reducer_destroy(red);
    ddp_destroy(g);
    return worst < 1e-5f ? 0 : 1;
}
