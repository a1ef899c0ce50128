/* zero_adamw: ZeRO stage 1 with AdamW, as PyTorch's
       model = DDP(model)
       opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
       for batch in my_shard:
           loss_fn(model(batch)).backward(); opt.step(); opt.zero_grad()
   (DeepSpeed's ZeRO stage 1, llm.c's -z 1).

   AdamW keeps two values per parameter (m and v): twice the model again, on every rank. With
   zero_stage = 1 the reducer reduce-scatters each bucket instead of all-reducing it: each rank receives
   the averaged gradient of ITS slice of the model only, runs AdamW on exactly that slice (so it keeps
   m and v for 1/world of the model), and ddp_reducer_gather_params then all-gathers the updated slices
   so that every rank has the whole model again for the next forward. The slices come from
   ddp_reducer_shards: {parameter, offset, count, pointer to the values, pointer to the gradient}; a
   slice may cut a parameter anywhere (no size needs to divide by the world size: here 128, 16, 32, 2).
   Every rank then repeats the run serially, one process averaging the ranks' batch gradients and running
   AdamW on the whole model, and checks that its weights are that run's.

   Checkpoints (ZeroRedundancyOptimizer's consolidate_state_dict): `--save PATH` stops halfway, gathers
   every rank's m and v to rank 0 (ddp_reducer_consolidate_state), which writes one ordinary checkpoint
   (weights, "<name>.exp_avg", "<name>.exp_avg_sq"); `--resume PATH` (on any number of ranks) loads it
   on every rank, takes its own slices' m and v out (ddp_reducer_shard_state) and runs the second half:
   the final weights are still the serial run's. (Per-rank files instead: ddp_checkpoint_save_slices
   with one ddp_slice per slice, see "ZeRO checkpoints" in ddp.h.)

   --uneven: rank r has 10 - 4r batches (rank 3 none), as torch's
       with Join([model, opt]): for batch in my_shard: ...
   (uneven_inputs = 1). A rank whose data has ended still owns its slices, so it keeps stepping them: it
   loops ddp_reducer_join_step, which shadows one step of the ranks with data and leaves in its slices'
   gradients that step's average (sum over the ranks with data / world size, its own part zero), runs
   AdamW on them and calls gather_params with the others, until every rank has joined. The serial run
   then averages, at each step, the batches of the ranks that still had data.

   --stage 2 (DeepSpeed's ZeRO stage 2): the reducer also keeps only this rank's slices of the averaged
   gradients (sh[j].grad then points into the reducer) and reduces through 2 borrowed comm buffers, so its
   gradient memory is about 1/world of the model's plus those buffers; the program's gradient buffers are
   only read at grad_ready (a program may then compute every gradient into one scratch buffer). The loop is
   the same.

   Run:  make build/zero_adamw build/ddprun
         build/ddprun --nproc-per-node 3 build/zero_adamw [--stage 2]     (1 to 4 ranks or more)
         build/ddprun --nproc-per-node 3 build/zero_adamw --save /tmp/z.safetensors
         build/ddprun --nproc-per-node 2 build/zero_adamw --resume /tmp/z.safetensors
         build/ddprun --nproc-per-node 4 build/zero_adamw --uneven */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 8, HID = 16, OUT = 2, BATCH = 8 };
enum { W1, B1, W2, B2, NPARAM };
static const int sizes[NPARAM] = {HID * IN, HID, OUT * HID, OUT};
static const char *const names[NPARAM] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

typedef struct mlp {
    float w[NPARAM][HID * IN]; /* torch's Linear layout (out x in); room for the largest parameter */
    float grad[NPARAM][HID * IN];
} mlp;

static float frand(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* Sample i of rank r's batch s: x uniform in [-1, 1]^8, y = (sin(sum x), cos(x0 - x7)). */
static void sample(int r, int s, int i, float *x, float *y) {
    unsigned seed = (unsigned)(r * 1000003 + s * 100003 + i * 7919 + 1);
    float a = 0;
    int k;
    for (k = 0; k < IN; k++) a += x[k] = frand(&seed);
    y[0] = sinf(a), y[1] = cosf(x[0] - x[IN - 1]);
}

static void init(mlp *m) {
    unsigned seed = 42;
    int i;
    memset(m, 0, sizeof *m);
    for (i = 0; i < HID * IN; i++) m->w[W1][i] = frand(&seed) / sqrtf(IN);
    for (i = 0; i < OUT * HID; i++) m->w[W2][i] = frand(&seed) / sqrtf(HID);
}

/* Forward and backward of rank r's batch s: ADDS scale * the gradient of the batch's mean squared error. */
static void accumulate(mlp *m, int r, int s, float scale) {
    int i, j, k;
    for (i = 0; i < BATCH; i++) {
        float x[IN], y[OUT], h[HID], dout[OUT], dh[HID];
        sample(r, s, i, x, y);
        for (j = 0; j < HID; j++) {
            float z = m->w[B1][j];
            for (k = 0; k < IN; k++) z += m->w[W1][j * IN + k] * x[k];
            h[j] = tanhf(z);
        }
        for (j = 0; j < OUT; j++) {
            float z = m->w[B2][j];
            for (k = 0; k < HID; k++) z += m->w[W2][j * HID + k] * h[k];
            dout[j] = scale * 2.0f * (z - y[j]) / (float)(BATCH * OUT);
        }
        for (k = 0; k < HID; k++) {
            dh[k] = 0;
            for (j = 0; j < OUT; j++) dh[k] += dout[j] * m->w[W2][j * HID + k];
            dh[k] *= 1.0f - h[k] * h[k];
        }
        for (j = 0; j < OUT; j++) {
            m->grad[B2][j] += dout[j];
            for (k = 0; k < HID; k++) m->grad[W2][j * HID + k] += dout[j] * h[k];
        }
        for (j = 0; j < HID; j++) {
            m->grad[B1][j] += dh[j];
            for (k = 0; k < IN; k++) m->grad[W1][j * IN + k] += dh[j] * x[k];
        }
    }
}

enum { STEPS = 10 };

/* AdamW (torch.optim.AdamW, lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2) on n values;
   m and v are this slice's state; t counts steps from 1. */
static void adamw(float *w, const float *grad, float *m, float *v, size_t n, int t) {
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 1e-2f;
    float c1 = 1.0f - powf(b1, (float)t), c2 = 1.0f - powf(b2, (float)t);
    size_t i;
    for (i = 0; i < n; i++) {
        w[i] -= lr * wd * w[i];
        m[i] = b1 * m[i] + (1.0f - b1) * grad[i];
        v[i] = b2 * v[i] + (1.0f - b2) * grad[i] * grad[i];
        w[i] -= lr * (m[i] / c1) / (sqrtf(v[i] / c2) + eps);
    }
}

/* Rank r's batches: STEPS, or with --uneven 10 - 4r (none from rank 3 on). */
static int batches(int r, int uneven) { return !uneven ? STEPS : STEPS - 4 * r > 0 ? STEPS - 4 * r : 0; }

/* The serial run: each step averages the batch gradients of the ranks that have a batch in it (divided by
   the whole world size) and runs AdamW on the whole model (the first `first` steps over the batches of
   world_before ranks: those of a resumed run's checkpoint). */
static double serial_difference(const mlp *ddp, int world_before, int first, int world, int uneven) {
    static mlp one;
    static float m[NPARAM][HID * IN], v[NPARAM][HID * IN];
    double worst = 0;
    int s, r, p, i;
    init(&one);
    for (s = 0; s < STEPS; s++) {
        int w = s < first ? world_before : world;
        for (r = 0; r < w; r++)
            if (s < batches(r, uneven)) accumulate(&one, r, s, 1.0f / (float)w);
        for (p = 0; p < NPARAM; p++) {
            adamw(one.w[p], one.grad[p], m[p], v[p], (size_t)sizes[p], s + 1);
            memset(one.grad[p], 0, sizeof one.grad[p]);
        }
    }
    for (p = 0; p < NPARAM; p++)
        for (i = 0; i < sizes[p]; i++) worst = fmax(worst, fabs(ddp->w[p][i] - one.w[p][i]));
    return worst;
}

#define TRY(call)                                                                              \
    do {                                                                                       \
        if ((call) != DDP_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

/* AdamW step t on this rank's slices only (their state concatenated in am, av). */
static void optimizer_step(const ddp_shard *sh, int n, float *am, float *av, int t) {
    size_t at = 0;
    int j;
    for (j = 0; j < n; at += sh[j].count, j++)
        adamw((float *)sh[j].param_data, (const float *)sh[j].grad, am + at, av + at, sh[j].count, t);
}

/* The consolidated checkpoint's tensors: per parameter its weights, m and v (m, v: full arrays). */
static void ckpt_tensors(mlp *m, float *fm, float *fv, ddp_tensor *t, char (*tn)[32]) {
    size_t at = 0;
    int p, k;
    for (p = 0; p < NPARAM; at += (size_t)sizes[p], p++)
        for (k = 0; k < 3; k++) {
            ddp_tensor *x = &t[3 * p + k];
            snprintf(tn[3 * p + k], 32, "%s%s", names[p], k == 0 ? "" : k == 1 ? ".exp_avg" : ".exp_avg_sq");
            memset(x, 0, sizeof *x);
            x->name = tn[3 * p + k], x->dtype = DDP_F32, x->ndim = 1, x->shape[0] = sizes[p];
            x->data = k == 0 ? m->w[p] : (k == 1 ? fm : fv) + at;
        }
}

int main(int argc, char **argv) {
    static mlp m;
    ddp_reducer_statistics rs;
    ddp_group *g;
    ddp_reducer *red;
    ddp_reducer_desc d;
    const ddp_shard *sh;
    float *am, *av, *fm, *fv; /* AdamW's state for this rank's slices only (concatenated); full copies */
    void *full[2], *st[2];
    ddp_tensor t[3 * NPARAM];
    char tn[3 * NPARAM][32];
    ddp_meta meta;
    const char *save = NULL, *resume = NULL;
    size_t mine = 0, total = 0;
    int p, j, n, step = 0, rank, world, stage = 1, uneven = 0, all_joined = 0, mine_batches, a;
    int64_t first = 0, world_before = 0;
    double diff;
    for (a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--uneven")) uneven = 1;
        else if (a + 1 == argc) break;
        else if (!strcmp(argv[a], "--stage")) stage = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--save")) save = argv[++a];
        else if (!strcmp(argv[a], "--resume")) resume = argv[++a];
        else break;
    }
    if (a != argc || (stage != 1 && stage != 2) || (uneven && (stage != 1 || save || resume))) {
        fprintf(stderr, "usage: zero_adamw [--stage 1|2] [--save PATH | --resume PATH] | --uneven\n");
        return 2;
    }
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g), world = ddp_world_size(g);
    mine_batches = batches(rank, uneven);
    memset(&meta, 0, sizeof meta); /* an empty map */
    init(&m);
    memset(&d, 0, sizeof d);
    d.zero_stage = stage; /* reduce-scatter: each rank gets the averaged gradients of its slices */
    d.uneven_inputs = uneven;
    TRY(ddp_reducer_create(g, &d, &red));
    for (p = 0; p < NPARAM; p++) TRY(ddp_reducer_add_param(red, names[p], m.w[p], m.grad[p], (size_t)sizes[p], DDP_F32, NULL));
    TRY(ddp_reducer_finalize(red));

    n = ddp_reducer_shards(red, &sh); /* the same slices every step */
    for (j = 0; j < n; j++) mine += sh[j].count;
    for (p = 0; p < NPARAM; p++) total += (size_t)sizes[p];
    am = (float *)calloc(mine + 1, sizeof(float)), av = (float *)calloc(mine + 1, sizeof(float));
    fm = (float *)calloc(total, sizeof(float)), fv = (float *)calloc(total, sizeof(float));
    st[0] = am, st[1] = av, full[0] = fm, full[1] = fv;
    ckpt_tensors(&m, fm, fv, t, tn);
    if (resume) { /* every rank reads the whole file, then keeps its slices of m and v */
        TRY(ddp_checkpoint_load(g, resume, t, 3 * NPARAM, &meta));
        TRY(ddp_meta_get_int(&meta, DDP_META_STEP, &first));
        TRY(ddp_meta_get_int(&meta, DDP_META_WORLD_SIZE, &world_before));
        TRY(ddp_reducer_shard_state(red, DDP_F32, 2, (const void *const *)full, total, st, mine));
        if (rank == 0)
            printf("resumed from %s at step %lld (saved by %lld ranks) on %d ranks\n", resume, (long long)first,
                   (long long)world_before, world);
    }

    for (step = (int)first; step < mine_batches; step++) {
        if (save && step == STEPS / 2) { /* consolidate_state_dict(to=0), then rank 0 writes */
            TRY(ddp_reducer_consolidate_state(red, DDP_F32, 2, (const void *const *)st, mine, full, total, 0));
            TRY(ddp_meta_set_int(&meta, DDP_META_STEP, step));
            TRY(ddp_meta_set_int(&meta, DDP_META_WORLD_SIZE, world));
            TRY(ddp_checkpoint_save(g, save, t, 3 * NPARAM, &meta));
            if (rank == 0) printf("saved weights and AdamW state at step %d to %s\n", step, save);
            break;
        }
        TRY(ddp_reducer_begin_backward(red));
        accumulate(&m, rank, step, 1.0f); /* backward; a real program calls grad_ready per layer */
        for (p = NPARAM - 1; p >= 0; p--) TRY(ddp_reducer_grad_ready(red, p));
        TRY(ddp_reducer_end_backward(red)); /* this rank's slices now hold the averaged gradient */
        optimizer_step(sh, n, am, av, step + 1); /* the optimizer on this rank's slices only */
        TRY(ddp_reducer_gather_params(red));      /* every rank gets every updated slice */
        TRY(ddp_reducer_zero_grad(red));
    }
    while (uneven) { /* no data left: shadow the others' steps, still stepping this rank's slices */
        TRY(ddp_reducer_join_step(red, &all_joined)); /* one step of the ranks with data */
        if (all_joined) break;                        /* every rank has joined: the models are equal */
        optimizer_step(sh, n, am, av, ++step);        /* the slices hold that step's averaged gradient */
        TRY(ddp_reducer_gather_params(red));          /* with the others' gather_params */
    }
    diff = save ? 0 : serial_difference(&m, (int)world_before, (int)first, world, uneven);
    if (uneven) printf("rank %d: %d batches, then %d steps as a joined rank; ", rank, mine_batches, step - mine_batches);
    else if (!save) printf("rank %d: ", rank);
    if (!save)
        printf("AdamW state for %zu of %zu parameters in %d slice(s); final weights vs the serial run: %s\n", mine, total,
               n, diff < 1e-5 ? "equal (rounding only)" : "DIFFERENT");
    TRY(ddp_reducer_get_statistics(red, &rs));
    if (rank == 0 && !save)
        printf("zero_stage %d: the reducer holds %llu bytes of gradient memory per rank (the model's gradients: %zu)\n",
               stage, (unsigned long long)rs.gradient_bytes, total * sizeof(float));
    free(am), free(av), free(fm), free(fv);
    ddp_meta_free(&meta);
    ddp_reducer_destroy(red);
    ddp_destroy(g);
    return diff < 1e-5 ? 0 : 1;
}
