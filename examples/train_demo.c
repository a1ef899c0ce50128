/* train_demo: data-parallel training of a small real model in plain C, with every part of ddp.h.

   The task: points on four interleaved spiral arms (generated here from a fixed seed, nothing to
   download); the model says which arm a point is on. The model is an MLP with BatchNorm:
       2 -> Linear(128) -> BatchNorm1d -> ReLU -> Linear(128) -> BatchNorm1d -> ReLU -> Linear(4)
   trained with softmax cross-entropy and SGD (momentum 0.9, weight decay 5e-4, cosine learning rate).

   What it shows, by the PyTorch name of each piece:
     ddp_init                    init_process_group("env://"), from the launcher's environment
     ddp_sampler + set_epoch     DistributedSampler: a shard per rank, a new shuffle every epoch
     ddp_syncbn                  nn.SyncBatchNorm: batch statistics over every rank's batch
     ddp_reducer                 DistributedDataParallel: backward calls grad_ready() for each parameter as
                                 soon as its gradient is written, so a full bucket's all-reduce runs while
                                 backward goes on through the lower layers
     ddp_all_reduce              averaging the loss and accuracy over the ranks for the log
     ddp_checkpoint_*            torch.save(state) on rank 0 + barrier, every epoch; --resume continues
                                 from the newest one and ends with the same weights, bit for bit
     DDP_SAMPLER_EVAL            evaluation on a held-out set, every sample exactly once over the ranks
     ddp_ft_begin / _commit      with --ft: training goes on without a rank that dies (below; no PyTorch
                                 equivalent in torch itself: torchft's fault-tolerant DDP is the nearest)

   Run it:
       make demo          (= build/ddprun --standalone --nproc-per-node 4 build/train_demo; 20-60 s on 2 cores)
       build/ddprun --standalone --nproc-per-node 4 build/train_demo --quick --stop-at-step 50
       build/ddprun --standalone --nproc-per-node 4 build/train_demo --quick --resume
       make demo-ft       (twice with --ft under ddprun --ft: uninterrupted, and with a rank killed mid-run)
   Stop it (Ctrl-C, SIGKILL a rank, or --stop-at-step N) and start it again with --resume: it continues
   from the newest checkpoint in --dir and ends with exactly the weights an uninterrupted run ends with.

   --ft: fault-tolerant training (src/ft.h), under ddprun --ft, which lets the others go on when a rank
   dies. The loop becomes ddp_ft_begin / ddp_ft_commit's: step s of an epoch is one global batch of
   batch x (the first number of ranks) samples, split over the ranks alive (ddp_sampler_step_batch).
   When a rank dies the others get DDP_ERR_VIEW_CHANGED from whatever they were in (SyncBatchNorm, the
   reducer, the vote, the log's all-reduce), agree on a view without it, and run the same step again on
   the same batch; the optimizer (and BatchNorm's running statistics) change only for a committed step.
   With no rank lost, --ft ends with the same weights as a plain run, bit for bit; with one lost, the
   weights of an uninterrupted run up to float rounding (the survivors add in another order). Under
   ddprun --ft --max-restarts 1 a lost rank is started again as a joiner (DDP_FT_JOIN=1): it registers the
   same state (ddp_ft_register: weights, momentum, BatchNorm's statistics, the step counters), is admitted
   at a step boundary with the members' state, and trains on. It does not: write checkpoints other than
   the final weights (rank 0 of the last view writes them; --resume, --save-every and --stop-at-step are
   refused), count the lost ranks' samples in the epoch's loss line, or survive a rank lost before the
   first step.

   Flags: --epochs N (20)  --samples N (16000 training points)  --batch N (32 per rank)
          --hidden N (128)  --lr X (0.1)  --dir DIR (build/demo_ckpt)  --resume  --quick (4 epochs of
          4000 points)  --save-every N (also checkpoint every N steps inside an epoch; 0 = only at the end
          of each epoch)  --keep N (the newest N checkpoints are kept, 2; 0 = all)  --stop-at-step N (after
          step N, save its checkpoint and exit 0, as if stopped there: a resume test that needs no timing)
          --ft (fault-tolerant training, above)
   Output: DIR/ckpt_<step>.safetensors (the newest --keep) and DIR/final.safetensors, the trained weights
   under torch's state_dict names (fc1.weight, bn1.running_mean, ...): safetensors loads them in Python.

   Is every DDP step the step ONE process would take on the union of the ranks' batches, with plain
   BatchNorm? `make demo-check` runs this demo with --save-every 1 --keep 0 and then tests/demo_check.c,
   which retakes each step from its checkpoints and prints the largest difference (at most 1e-5). */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { IN = 2, CLASSES = 4, NPARAM = 8, NBN = 2 };
enum { FC1_W, BN1_W, BN1_B, FC2_W, BN2_W, BN2_B, FC3_W, FC3_B }; /* registration (forward) order */
static const char *const param_names[NPARAM] = {"fc1.weight", "bn1.weight", "bn1.bias", "fc2.weight",
                                                "bn2.weight", "bn2.bias",   "fc3.weight", "fc3.bias"};

typedef struct config {
    int epochs, samples, batch, hidden, save_every, keep, stop_at_step, resume, ft;
    double lr, momentum, weight_decay;
    const char *dir;
} config;

/* ---- data: four spiral arms ------------------------------------------------------------------ */

/* splitmix64: a tiny, well-mixed generator; the same numbers on every rank and every run. */
static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }
static double rng_normal(uint64_t *s) { /* Box-Muller */
    double u = rng_uniform(s), v = rng_uniform(s);
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

/* Point i lies on arm i % CLASSES, at a random distance t along it, with noise. */
static void make_spirals(uint64_t seed, int n, float *x, int *y) {
    int i;
    for (i = 0; i < n; i++) {
        double t = rng_uniform(&seed), angle, r;
        y[i] = i % CLASSES;
        r = 0.1 + 0.9 * t;
        angle = 6.283185307179586 * y[i] / CLASSES + 1.75 * 3.141592653589793 * t + 0.3 * rng_normal(&seed);
        x[i * IN + 0] = (float)(r * cos(angle) + 0.02 * rng_normal(&seed));
        x[i * IN + 1] = (float)(r * sin(angle) + 0.02 * rng_normal(&seed));
    }
}

/* ---- the model ----------------------------------------------------------------------------------- */

typedef struct param {
    int rows, cols;  /* a weight is rows x cols (out x in, torch's Linear layout); a vector has cols 0 */
    float *w, *grad, *momentum;
    int index;       /* its index in the reducer */
} param;

typedef struct net {
    int hidden, cap;  /* hidden width; the largest batch the activation buffers hold */
    param p[NPARAM];
    float *running_mean[NBN], *running_var[NBN];
    int64_t batches_tracked[NBN]; /* copied to and from the layers around checkpoints */
    ddp_syncbn *bn[NBN];
    /* activations of the last forward, which backward needs, and two gradient scratch buffers */
    float *x, *z1, *a1, *h1, *z2, *a2, *h2, *logits, *dlogits, *dh, *dz;
} net;

static size_t param_size(const param *p) { return (size_t)p->rows * (size_t)(p->cols ? p->cols : 1); }

static float *alloc_floats(size_t n) { return (float *)calloc(n ? n : 1, sizeof(float)); }

/* torch's defaults: Linear weights and biases uniform in +-1/sqrt(fan_in); BatchNorm weight 1, bias 0,
   running mean 0, running variance 1. `bn_group` NULL makes plain BatchNorm layers (one process). */
static ddp_result bn_create(net *m, ddp_group *bn_group);

static ddp_result net_create(net *m, int hidden, int cap, ddp_group *bn_group) {
    const int rows[NPARAM] = {hidden, hidden, hidden, hidden, hidden, hidden, CLASSES, CLASSES};
    const int cols[NPARAM] = {IN, 0, 0, hidden, 0, 0, hidden, 0};
    const int fan_in[NPARAM] = {IN, 0, 0, hidden, 0, 0, hidden, hidden};
    uint64_t seed = 42;
    size_t i, hc = (size_t)cap * (size_t)hidden;
    int k;
    memset(m, 0, sizeof *m);
    m->hidden = hidden, m->cap = cap;
    for (k = 0; k < NPARAM; k++) {
        param *p = &m->p[k];
        p->rows = rows[k], p->cols = cols[k];
        p->w = alloc_floats(param_size(p)), p->grad = alloc_floats(param_size(p));
        p->momentum = alloc_floats(param_size(p));
        if (!p->w || !p->grad || !p->momentum) return DDP_ERR_OUT_OF_MEMORY;
        for (i = 0; i < param_size(p); i++)
            p->w[i] = fan_in[k] ? (float)((2.0 * rng_uniform(&seed) - 1.0) / sqrt((double)fan_in[k])) : 0.0f;
    }
    for (i = 0; i < (size_t)hidden; i++) m->p[BN1_W].w[i] = m->p[BN2_W].w[i] = 1.0f;
    m->x = alloc_floats((size_t)cap * IN), m->logits = alloc_floats((size_t)cap * CLASSES);
    m->dlogits = alloc_floats((size_t)cap * CLASSES);
    m->z1 = alloc_floats(hc), m->a1 = alloc_floats(hc), m->h1 = alloc_floats(hc), m->z2 = alloc_floats(hc);
    m->a2 = alloc_floats(hc), m->h2 = alloc_floats(hc), m->dh = alloc_floats(hc), m->dz = alloc_floats(hc);
    if (!m->x || !m->logits || !m->dlogits || !m->z1 || !m->a1 || !m->h1 || !m->z2 || !m->a2 || !m->h2 ||
        !m->dh || !m->dz)
        return DDP_ERR_OUT_OF_MEMORY;
    for (k = 0; k < NBN; k++) {
        m->running_mean[k] = alloc_floats((size_t)hidden), m->running_var[k] = alloc_floats((size_t)hidden);
        if (!m->running_mean[k] || !m->running_var[k]) return DDP_ERR_OUT_OF_MEMORY;
        for (i = 0; i < (size_t)hidden; i++) m->running_var[k][i] = 1.0f;
    }
    return bn_create(m, bn_group);
}

/* The (Sync)BatchNorm layers over m's weights and running statistics; eps 1e-5, momentum 0.1: BatchNorm1d's
   defaults. Layers made before keep their num_batches_tracked. */
static ddp_result bn_create(net *m, ddp_group *bn_group) {
    int k;
    for (k = 0; k < NBN; k++) {
        ddp_syncbn_desc d;
        int64_t tracked = m->bn[k] ? ddp_syncbn_num_batches_tracked(m->bn[k]) : 0;
        ddp_result r;
        ddp_syncbn_destroy(m->bn[k]);
        memset(&d, 0, sizeof d);
        d.num_features = m->hidden;
        d.weight = m->p[k == 0 ? BN1_W : BN2_W].w, d.bias = m->p[k == 0 ? BN1_B : BN2_B].w;
        d.running_mean = m->running_mean[k], d.running_var = m->running_var[k];
        if ((r = ddp_syncbn_create(bn_group, &d, &m->bn[k])) != DDP_SUCCESS) return r;
        ddp_syncbn_set_num_batches_tracked(m->bn[k], tracked);
    }
    return DDP_SUCCESS;
}

static void net_free(net *m) {
    int k;
    for (k = 0; k < NPARAM; k++) free(m->p[k].w), free(m->p[k].grad), free(m->p[k].momentum);
    for (k = 0; k < NBN; k++) ddp_syncbn_destroy(m->bn[k]), free(m->running_mean[k]), free(m->running_var[k]);
    free(m->x), free(m->z1), free(m->a1), free(m->h1), free(m->z2), free(m->a2), free(m->h2);
    free(m->logits), free(m->dlogits), free(m->dh), free(m->dz);
}

/* y[n x out] = x[n x in] W^T (+ b) */
static void linear(const float *x, int n, int in, const float *w, const float *b, int out, float *y) {
    int s, o, i;
    for (s = 0; s < n; s++)
        for (o = 0; o < out; o++) {
            float acc = b ? b[o] : 0.0f;
            for (i = 0; i < in; i++) acc += x[s * in + i] * w[o * in + i];
            y[s * out + o] = acc;
        }
}

/* gW += dy^T x, gb += column sums of dy */
static void linear_grad_weight(const float *x, const float *dy, int n, int in, int out, float *gw, float *gb) {
    int s, o, i;
    for (s = 0; s < n; s++)
        for (o = 0; o < out; o++) {
            float d = dy[s * out + o];
            for (i = 0; i < in; i++) gw[o * in + i] += d * x[s * in + i];
            if (gb) gb[o] += d;
        }
}

/* dx = dy W */
static void linear_grad_input(const float *dy, int n, int in, int out, const float *w, float *dx) {
    int s, o, i;
    memset(dx, 0, sizeof(float) * (size_t)n * (size_t)in);
    for (s = 0; s < n; s++)
        for (o = 0; o < out; o++) {
            float d = dy[s * out + o];
            for (i = 0; i < in; i++) dx[s * in + i] += d * w[o * in + i];
        }
}

static void relu(const float *a, size_t n, float *h) {
    size_t i;
    for (i = 0; i < n; i++) h[i] = a[i] > 0.0f ? a[i] : 0.0f;
}
static void relu_backward(const float *a, size_t n, float *d) {
    size_t i;
    for (i = 0; i < n; i++) d[i] = a[i] > 0.0f ? d[i] : 0.0f;
}

/* The forward pass over n samples (x is n x IN); training: batch statistics (collective over the BatchNorm
   group), else the running statistics (no communication). Leaves the logits in m->logits. */
static ddp_result net_forward(net *m, const float *x, int n, int training) {
    size_t nh = (size_t)n * (size_t)m->hidden;
    ddp_result r;
    memcpy(m->x, x, sizeof(float) * (size_t)n * IN);
    linear(m->x, n, IN, m->p[FC1_W].w, NULL, m->hidden, m->z1);
    if ((r = ddp_syncbn_forward(m->bn[0], m->z1, m->a1, n, 1, training)) != DDP_SUCCESS) return r;
    relu(m->a1, nh, m->h1);
    linear(m->h1, n, m->hidden, m->p[FC2_W].w, NULL, m->hidden, m->z2);
    if ((r = ddp_syncbn_forward(m->bn[1], m->z2, m->a2, n, 1, training)) != DDP_SUCCESS) return r;
    relu(m->a2, nh, m->h2);
    linear(m->h2, n, m->hidden, m->p[FC3_W].w, m->p[FC3_B].w, CLASSES, m->logits);
    return DDP_SUCCESS;
}

/* Softmax cross-entropy of the logits against y: adds the summed loss and the number of correct predictions
   to sums[0] and sums[1]; dlogits = the gradient of (summed loss / denom). */
static void cross_entropy(net *m, const int *y, int n, double denom, double sums[2]) {
    int s, k;
    for (s = 0; s < n; s++) {
        const float *z = m->logits + s * CLASSES;
        float *d = m->dlogits + s * CLASSES;
        double zmax = z[0], total = 0.0;
        int best = 0;
        for (k = 1; k < CLASSES; k++)
            if (z[k] > zmax) zmax = z[k], best = k;
        for (k = 0; k < CLASSES; k++) total += exp((double)z[k] - zmax);
        for (k = 0; k < CLASSES; k++)
            d[k] = (float)((exp((double)z[k] - zmax) / total - (k == y[s])) / denom);
        sums[0] += log(total) + zmax - z[y[s]];
        sums[1] += best == y[s];
    }
}

/* Tell DDP that parameter k's gradient is complete: PyTorch's autograd hook. red is NULL in one process. */
static ddp_result ready(ddp_reducer *red, const net *m, int k) {
    return red ? ddp_reducer_grad_ready(red, m->p[k].index) : DDP_SUCCESS;
}

#define CHECK_R(call)                                 \
    do {                                              \
        ddp_result r_ = (call);                       \
        if (r_ != DDP_SUCCESS) return r_;             \
    } while (0)

/* Backward from m->dlogits, output layer first. Each parameter is reported the moment its gradient is
   written, in exactly the reverse of the registration order, so the reducer's bucket layout never has to
   change (and a resumed run reduces exactly as an uninterrupted one). */
static ddp_result net_backward(net *m, int n, ddp_reducer *red) {
    size_t nh = (size_t)n * (size_t)m->hidden;
    int h = m->hidden;
    linear_grad_weight(m->h2, m->dlogits, n, h, CLASSES, m->p[FC3_W].grad, m->p[FC3_B].grad);
    CHECK_R(ready(red, m, FC3_B));
    CHECK_R(ready(red, m, FC3_W));
    linear_grad_input(m->dlogits, n, h, CLASSES, m->p[FC3_W].w, m->dh);
    relu_backward(m->a2, nh, m->dh);
    CHECK_R(ddp_syncbn_backward(m->bn[1], m->z2, m->dh, m->dz, m->p[BN2_W].grad, m->p[BN2_B].grad, n, 1));
    CHECK_R(ready(red, m, BN2_B));
    CHECK_R(ready(red, m, BN2_W));
    linear_grad_weight(m->h1, m->dz, n, h, h, m->p[FC2_W].grad, NULL);
    CHECK_R(ready(red, m, FC2_W)); /* the first bucket is full: its all-reduce overlaps what follows */
    linear_grad_input(m->dz, n, h, h, m->p[FC2_W].w, m->dh);
    relu_backward(m->a1, nh, m->dh);
    CHECK_R(ddp_syncbn_backward(m->bn[0], m->z1, m->dh, m->dz, m->p[BN1_W].grad, m->p[BN1_B].grad, n, 1));
    CHECK_R(ready(red, m, BN1_B));
    CHECK_R(ready(red, m, BN1_W));
    linear_grad_weight(m->x, m->dz, n, IN, h, m->p[FC1_W].grad, NULL);
    return ready(red, m, FC1_W);
}

/* torch.optim.SGD(momentum, weight_decay): g = grad + wd w; buf = momentum buf + g; w -= lr buf.
   (torch starts buf as a copy of the first g: the same numbers as momentum * 0 + g.) */
static void sgd_step(net *m, double lr, const config *c) {
    int k;
    size_t i;
    for (k = 0; k < NPARAM; k++) {
        param *p = &m->p[k];
        for (i = 0; i < param_size(p); i++) {
            float g = p->grad[i] + (float)c->weight_decay * p->w[i];
            p->momentum[i] = (float)c->momentum * p->momentum[i] + g;
            p->w[i] -= (float)lr * p->momentum[i];
        }
    }
}

static void zero_grad(net *m) {
    int k;
    for (k = 0; k < NPARAM; k++) memset(m->p[k].grad, 0, sizeof(float) * param_size(&m->p[k]));
}

/* One optimizer step on n samples; sums[0..1] collect the loss and correct count. red: the reducer, or
   NULL in one process (then the loss is already the mean over the whole batch). */
static ddp_result train_step(net *m, ddp_reducer *red, const float *x, const int *y, int n, double lr,
                             const config *c, double sums[2]) {
    CHECK_R(net_forward(m, x, n, 1));
    cross_entropy(m, y, n, n, sums);
    if (red) CHECK_R(ddp_reducer_begin_backward(red));
    CHECK_R(net_backward(m, n, red));
    if (red) CHECK_R(ddp_reducer_end_backward(red)); /* gradients are now the average over the ranks */
    sgd_step(m, lr, c);
    if (red) return ddp_reducer_zero_grad(red);
    zero_grad(m);
    return DDP_SUCCESS;
}

/* The learning rate of an epoch: cosine from lr down to 0 over the run. */
static double epoch_lr(const config *c, int epoch) {
    return c->lr * 0.5 * (1.0 + cos(3.141592653589793 * epoch / c->epochs));
}

/* Copy the samples idx[0..n-1] into a contiguous batch. */
static void gather(const float *x, const int *y, const int64_t *idx, int n, float *bx, int *by) {
    int s;
    for (s = 0; s < n; s++) {
        memcpy(bx + s * IN, x + idx[s] * IN, sizeof(float) * IN);
        by[s] = y[idx[s]];
    }
}

/* ---- checkpoints --------------------------------------------------------------------------------- */

/* The model's state_dict (parameters, then BatchNorm buffers) and, with optimizer, the momentum buffers:
   fills t[] and returns how many. names holds the optimizer tensors' names. */
static int state_tensors(net *m, int optimizer, ddp_tensor *t, char names[NPARAM][64]) {
    static const char *const bn_names[NBN][3] = {
        {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"},
        {"bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked"}};
    int k, n = 0;
    memset(t, 0, sizeof(ddp_tensor) * (optimizer ? 2 * NPARAM + 3 * NBN : NPARAM + 3 * NBN));
    for (k = 0; k < NPARAM; k++, n++) {
        t[n].name = param_names[k], t[n].dtype = DDP_F32, t[n].data = m->p[k].w;
        t[n].ndim = m->p[k].cols ? 2 : 1, t[n].shape[0] = m->p[k].rows, t[n].shape[1] = m->p[k].cols;
    }
    for (k = 0; k < NBN; k++) {
        t[n].name = bn_names[k][0], t[n].dtype = DDP_F32, t[n].ndim = 1, t[n].shape[0] = m->hidden;
        t[n++].data = m->running_mean[k];
        t[n].name = bn_names[k][1], t[n].dtype = DDP_F32, t[n].ndim = 1, t[n].shape[0] = m->hidden;
        t[n++].data = m->running_var[k];
        t[n].name = bn_names[k][2], t[n].dtype = DDP_I64, t[n].ndim = 0; /* a scalar, as in torch */
        t[n++].data = &m->batches_tracked[k];
        m->batches_tracked[k] = ddp_syncbn_num_batches_tracked(m->bn[k]);
    }
    for (k = 0; optimizer && k < NPARAM; k++, n++) {
        sprintf(names[k], "optimizer.%s.momentum_buffer", param_names[k]);
        t[n] = t[k];
        t[n].name = names[k], t[n].data = m->p[k].momentum;
    }
    return n;
}

/* Everything needed to continue: the resume state (step, epoch, sampler position, world size), the run's
   shape (to refuse a checkpoint of another run), and the epoch's loss sums so far (over all ranks). */
static ddp_result make_meta(ddp_meta *meta, const config *c, int64_t step, int64_t epoch, uint64_t position,
                            int world, const double sums[3]) {
    ddp_resume_state rs;
    char text[96];
    memset(&rs, 0, sizeof rs);
    rs.step = step, rs.epoch = epoch, rs.sampler_position = (int64_t)position, rs.world_size = world;
    CHECK_R(ddp_meta_set_resume(meta, &rs));
    CHECK_R(ddp_meta_set_int(meta, "demo.samples", c->samples));
    CHECK_R(ddp_meta_set_int(meta, "demo.batch", c->batch));
    CHECK_R(ddp_meta_set_int(meta, "demo.hidden", c->hidden));
    snprintf(text, sizeof text, "%.17g %.17g %.17g", sums[0], sums[1], sums[2]);
    return ddp_meta_set(meta, "demo.epoch_sums", text);
}

/* Rank 0 writes DIR/ckpt_<step>.safetensors atomically; every rank returns once it is durable. The
   --keep newest are kept. The loss sums so far are summed over the ranks first (collective). */
static ddp_result save_checkpoint(ddp_group *g, net *m, const config *c, int64_t step, int64_t epoch,
                                  uint64_t position, const double sums[3]) {
    ddp_tensor t[2 * NPARAM + 3 * NBN];
    char names[NPARAM][64], path[4096];
    ddp_meta meta;
    ddp_checkpoint_save_desc sd;
    double total[3];
    ddp_result r;
    int n = state_tensors(m, 1, t, names);
    memcpy(total, sums, sizeof total);
    CHECK_R(ddp_all_reduce(g, total, 3, DDP_F64, DDP_SUM));
    memset(&meta, 0, sizeof meta);
    memset(&sd, 0, sizeof sd);
    sd.keep_last = c->keep; /* 0: keep them all */
    snprintf(path, sizeof path, "%s/ckpt_%08lld.safetensors", c->dir, (long long)step);
    r = make_meta(&meta, c, step, epoch, position, ddp_world_size(g), total);
    if (r == DDP_SUCCESS) r = ddp_checkpoint_save_ex(g, path, t, n, &meta, &sd);
    ddp_meta_free(&meta);
    return r;
}

/* Where training continues from: filled from a checkpoint by read_checkpoint. */
typedef struct resume_point {
    int64_t step, epoch;
    uint64_t position;
    int world;      /* the number of ranks that wrote it */
    double sums[3]; /* the epoch's loss sums over all ranks */
    char path[4096];
} resume_point;

static int fail(int rank, const char *what, const char *message) {
    fprintf(stderr, "train_demo rank %d: %s: %s\n", rank, what, message);
    return 1;
}

/* Read the checkpoint rp->path into m and *rp: collective over g (every rank reads the file); g NULL: one
   process. Returns 0, or 1 after printing why. */
static int read_checkpoint(ddp_group *g, net *m, const config *c, resume_point *rp) {
    ddp_tensor t[2 * NPARAM + 3 * NBN];
    char names[NPARAM][64];
    ddp_meta meta;
    ddp_resume_state rs;
    int64_t samples = 0, batch = 0, hidden = 0;
    int k, n = state_tensors(m, 1, t, names), rank = g ? ddp_rank(g) : 0;
    const char *sums;
    memset(&meta, 0, sizeof meta);
    memset(&rs, 0, sizeof rs);
    if (ddp_checkpoint_load(g, rp->path, t, n, &meta) != DDP_SUCCESS) {
        ddp_meta_free(&meta);
        return fail(rank, rp->path, ddp_last_error(g));
    }
    if (ddp_meta_get_resume(&meta, &rs) != DDP_SUCCESS || ddp_meta_get_int(&meta, "demo.samples", &samples) ||
        ddp_meta_get_int(&meta, "demo.batch", &batch) || ddp_meta_get_int(&meta, "demo.hidden", &hidden) ||
        !(sums = ddp_meta_get(&meta, "demo.epoch_sums")) ||
        sscanf(sums, "%lf %lf %lf", &rp->sums[0], &rp->sums[1], &rp->sums[2]) != 3) {
        ddp_meta_free(&meta);
        return fail(rank, rp->path, "not a train_demo checkpoint (metadata missing)");
    }
    ddp_meta_free(&meta);
    if (samples != c->samples || batch != c->batch || hidden != c->hidden) {
        fprintf(stderr, "train_demo rank %d: %s was written by a run with --samples %lld --batch %lld --hidden %lld; "
                "use the same (this run: --samples %d --batch %d --hidden %d)\n", rank, rp->path, (long long)samples,
                (long long)batch, (long long)hidden, c->samples, c->batch, c->hidden);
        return 1;
    }
    for (k = 0; k < NBN; k++) ddp_syncbn_set_num_batches_tracked(m->bn[k], m->batches_tracked[k]);
    rp->step = rs.step, rp->epoch = rs.epoch, rp->position = (uint64_t)rs.sampler_position;
    rp->world = rs.world_size;
    return 0;
}

/* Load the newest checkpoint of DIR into m and *rp (collective). Returns 0, or 1 after printing why. */
static int load_checkpoint(ddp_group *g, net *m, const config *c, resume_point *rp) {
    char pattern[4096];
    int64_t number = -1;
    int rank = ddp_rank(g);
    snprintf(pattern, sizeof pattern, "%s/ckpt_*.safetensors", c->dir);
    /* rank 0 looks and everyone loads what it found: the ranks must agree on one file */
    if (rank == 0 && ddp_checkpoint_latest(pattern, rp->path, sizeof rp->path, &number) != DDP_SUCCESS) {
        fprintf(stderr, "train_demo: %s\n", ddp_last_error(NULL));
        number = -2;
    }
    if (ddp_broadcast(g, &number, 1, DDP_I64, 0) != DDP_SUCCESS) return fail(rank, "broadcast", ddp_last_error(g));
    if (number == -2) return 1;
    if (number < 0) return fail(rank, "--resume", "there is no checkpoint in --dir to resume from");
    snprintf(rp->path, sizeof rp->path, "%s/ckpt_%08lld.safetensors", c->dir, (long long)number);
    if (read_checkpoint(g, m, c, rp)) return 1;
    if (rp->world != ddp_world_size(g)) {
        fprintf(stderr, "train_demo rank %d: %s was written on %d ranks; resume with the same (this run: %d ranks)\n",
                rank, rp->path, rp->world, ddp_world_size(g));
        return 1;
    }
    if (rank != 0) rp->sums[0] = rp->sums[1] = rp->sums[2] = 0.0; /* rank 0 carries the sums so far */
    return 0;
}

/* mkdir -p */
static int make_dirs(const char *dir) {
    char path[4096];
    size_t i;
    snprintf(path, sizeof path, "%s", dir);
    if (!path[0]) return -1;
    for (i = 1; path[i]; i++) {
        if (path[i] != '/') continue;
        path[i] = 0;
        if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
        path[i] = '/';
    }
    return mkdir(path, 0777) != 0 && errno != EEXIST ? -1 : 0;
}

/* A fresh run: rank 0 makes DIR and removes the checkpoints of an earlier run, so that a later --resume
   cannot pick one of them up. */
static int clear_checkpoints(ddp_group *g, const config *c) {
    char pattern[4096], path[4096];
    int64_t number = 0;
    int ok = 1;
    if (ddp_rank(g) == 0) {
        if (make_dirs(c->dir) != 0)
            fprintf(stderr, "train_demo: cannot create %s: %s\n", c->dir, strerror(errno)), ok = 0;
        snprintf(pattern, sizeof pattern, "%s/ckpt_*.safetensors", c->dir);
        while (ok && ddp_checkpoint_latest(pattern, path, sizeof path, &number) == DDP_SUCCESS && number >= 0)
            if (remove(path) != 0) fprintf(stderr, "train_demo: cannot remove %s\n", path), ok = 0;
    }
    if (ddp_all_reduce(g, &ok, 1, DDP_I32, DDP_MIN) != DDP_SUCCESS) return fail(ddp_rank(g), "all_reduce", ddp_last_error(g));
    return ok ? 0 : 1;
}

/* FNV-1a over every parameter's bytes: equal on every rank when DDP kept the replicas identical. */
static int64_t weights_hash(const net *m) {
    uint64_t h = 1469598103934665603ull;
    size_t i;
    int k;
    for (k = 0; k < NPARAM; k++) {
        const unsigned char *b = (const unsigned char *)m->p[k].w;
        for (i = 0; i < param_size(&m->p[k]) * sizeof(float); i++) h = (h ^ b[i]) * 1099511628211ull;
    }
    return (int64_t)h;
}

/* ---- the program ---------------------------------------------------------------------------------- */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_args(int argc, char **argv, config *c) {
    int i;
    memset(c, 0, sizeof *c);
    c->epochs = 20, c->samples = 16000, c->batch = 32, c->hidden = 128, c->keep = 2, c->dir = "build/demo_ckpt";
    c->lr = 0.1, c->momentum = 0.9, c->weight_decay = 5e-4;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--resume")) c->resume = 1;
        else if (!strcmp(a, "--ft")) c->ft = 1;
        else if (!strcmp(a, "--quick")) c->epochs = 4, c->samples = 4000;
        else if (v && !strcmp(a, "--epochs")) c->epochs = atoi(v), i++;
        else if (v && !strcmp(a, "--samples")) c->samples = atoi(v), i++;
        else if (v && !strcmp(a, "--batch")) c->batch = atoi(v), i++;
        else if (v && !strcmp(a, "--hidden")) c->hidden = atoi(v), i++;
        else if (v && !strcmp(a, "--save-every")) c->save_every = atoi(v), i++;
        else if (v && !strcmp(a, "--keep")) c->keep = atoi(v), i++;
        else if (v && !strcmp(a, "--stop-at-step")) c->stop_at_step = atoi(v), i++;
        else if (v && !strcmp(a, "--lr")) c->lr = atof(v), i++;
        else if (v && !strcmp(a, "--dir")) c->dir = v, i++;
        else {
            fprintf(stderr, "train_demo: unknown flag or missing value: %s\nflags: --epochs N --samples N --batch N "
                    "--hidden N --lr X --dir DIR --save-every N --keep N --stop-at-step N --resume --quick --ft\n", a);
            return 1;
        }
    }
    if (c->epochs < 1 || c->samples < 2 || c->batch < 1 || c->hidden < 1 || !(c->lr > 0) || c->save_every < 0 ||
        c->keep < 0 || c->stop_at_step < 0) {
        fprintf(stderr, "train_demo: --epochs, --samples (>= 2), --batch, --hidden and --lr must be positive; "
                "--save-every, --keep and --stop-at-step at least 0\n");
        return 1;
    }
    if (c->ft && (c->resume || c->save_every || c->stop_at_step)) {
        fprintf(stderr, "train_demo: --ft writes no checkpoint but the final weights: --resume, --save-every and "
                "--stop-at-step do not go with it\n");
        return 1;
    }
    return 0;
}

/* Rank 0's progress line while an epoch runs, on a terminal only (it rewrites itself with \r). */
static void progress(int epoch, const config *c, uint64_t done, uint64_t total, const double sums[3]) {
    char bar[31];
    int i, filled = (int)(30 * done / (total ? total : 1));
    for (i = 0; i < 30; i++) bar[i] = i < filled ? '#' : '.';
    bar[30] = 0;
    printf("\repoch %3d/%d [%s] %3d%%  loss %.4f (rank 0)", epoch + 1, c->epochs, bar, (int)(100 * done / (total ? total : 1)),
           sums[0] / (sums[2] > 0 ? sums[2] : 1));
    fflush(stdout);
}

/* The accuracy on the held-out set: each rank its DDP_SAMPLER_EVAL shard (no padding, nothing twice),
   BatchNorm with the running statistics; the counts are summed over the ranks. */
static ddp_result evaluate(ddp_group *g, net *m, const config *c, const float *x, const int *y, int n,
                           double *accuracy) {
    ddp_sampler s;
    ddp_sampler_desc d;
    int64_t idx[256];
    float bx[256 * IN];
    int by[256];
    size_t got;
    double counts[2] = {0, 0}, part[2];
    memset(&d, 0, sizeof d);
    d.dataset_size = (uint64_t)n, d.num_replicas = ddp_world_size(g), d.rank = ddp_rank(g);
    d.mode = DDP_SAMPLER_EVAL, d.no_shuffle = 1;
    CHECK_R(ddp_sampler_init(&s, &d));
    while (ddp_sampler_next_batch(&s, c->batch < 256 ? (size_t)c->batch : 256, idx, &got) == DDP_SUCCESS && got) {
        gather(x, y, idx, (int)got, bx, by);
        CHECK_R(net_forward(m, bx, (int)got, 0));
        part[0] = part[1] = 0;
        cross_entropy(m, by, (int)got, 1, part);
        counts[0] += part[1], counts[1] += (double)got;
    }
    ddp_sampler_free(&s);
    CHECK_R(ddp_all_reduce(g, counts, 2, DDP_F64, DDP_SUM));
    *accuracy = counts[0] / counts[1];
    return DDP_SUCCESS;
}

/* Everything one rank's training holds. */
typedef struct run {
    config c;
    ddp_group *g;
    int rank, world, tty;
    int cap;                 /* the largest batch of one rank: --batch; with --ft a step's global batch */
    ddp_reducer *red;
    ddp_sampler sampler;
    net m;
    float *x, *ex, *bx;      /* training set, held-out set, this rank's batch */
    int *y, *ey, *by, n_eval;
    int64_t *idx, step;      /* the batch's indices; optimizer steps taken */
    double samples_seen;
    /* --ft: the first view's size (the sampler's num_replicas), the current view, and the running
       statistics as they were before the step's forward (put back when the step is redone) */
    int first_world;
    uint64_t gen;
    float *bn_saved;
    int64_t bn_tracked[NBN];
} run;

#define TRY(g, call)                                                            \
    do {                                                                        \
        if ((call) != DDP_SUCCESS) return fail(rank, #call, ddp_last_error(g)); \
    } while (0)

/* Every rank makes the same data set, as every rank would open the same files. */
static int make_data(run *R) {
    const config *c = &R->c;
    R->n_eval = c->samples / 4 > 0 ? c->samples / 4 : 1;
    R->x = alloc_floats((size_t)c->samples * IN), R->y = (int *)malloc(sizeof(int) * (size_t)c->samples);
    R->ex = alloc_floats((size_t)R->n_eval * IN), R->ey = (int *)malloc(sizeof(int) * (size_t)R->n_eval);
    R->bx = alloc_floats((size_t)R->cap * IN), R->by = (int *)malloc(sizeof(int) * (size_t)R->cap);
    R->idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)R->cap);
    if (!R->x || !R->y || !R->ex || !R->ey || !R->bx || !R->by || !R->idx) return fail(R->rank, "malloc", "out of memory");
    make_spirals(1234, c->samples, R->x, R->y);
    make_spirals(5678, R->n_eval, R->ex, R->ey);
    return 0;
}

/* The model, with SyncBatchNorm over the whole group, wrapped in DDP (finalized later, after a resume
   has loaded the weights). The buckets are small (16 KiB) because the model is (18k parameters): fc3, bn2
   and fc2 fill the first bucket, whose all-reduce then runs while backward works through layer 1.
   PyTorch's 25 MiB suits models of millions of parameters. */
static int make_model(run *R) {
    static const char *const buffers[2 * NBN] = {"bn1.running_mean", "bn1.running_var", "bn2.running_mean",
                                                 "bn2.running_var"};
    ddp_reducer_desc rd;
    ddp_group *g = R->g;
    int k, rank = R->rank;
    TRY(NULL, net_create(&R->m, R->c.hidden, R->cap, g));
    memset(&rd, 0, sizeof rd);
    rd.bucket_cap_bytes = rd.first_bucket_bytes = 16 << 10;
    TRY(NULL, ddp_reducer_create(g, &rd, &R->red));
    for (k = 0; k < NPARAM; k++)
        TRY(g, ddp_reducer_add_param(R->red, param_names[k], R->m.p[k].w, R->m.p[k].grad, param_size(&R->m.p[k]),
                                     DDP_F32, &R->m.p[k].index));
    for (k = 0; k < 2 * NBN; k++)
        TRY(g, ddp_reducer_add_buffer(R->red, buffers[k], k % 2 ? R->m.running_var[k / 2] : R->m.running_mean[k / 2],
                                      (size_t)R->c.hidden, DDP_F32));
    return 0;
}

enum { STOPPED = 2 }; /* train_epoch's return value when --stop-at-step was reached */

/* Rank 0's line at the end of an epoch; sums: the epoch's loss, correct predictions and samples, over every rank. */
static void epoch_line(const run *R, int epoch, const double sums[3], double accuracy, double seconds) {
    if (R->rank != 0) return;
    printf("%sepoch %3d/%d  loss %.4f  train acc %5.1f%%  eval acc %5.1f%%  lr %.4f  %.2f s\n", R->tty ? "\r\033[K" : "",
           epoch + 1, R->c.epochs, sums[0] / sums[2], 100.0 * sums[1] / sums[2], 100.0 * accuracy,
           epoch_lr(&R->c, epoch), seconds);
    fflush(stdout);
}

/* One epoch from sampler position `position`; sums starts as the epoch's loss sums so far. Returns 0, 1
   after printing an error, or STOPPED: --stop-at-step's step is taken and its checkpoint saved. */
static int train_epoch(run *R, int epoch, uint64_t position, double sums[3]) {
    ddp_group *g = R->g;
    const config *c = &R->c;
    double lr = epoch_lr(c, epoch), t0 = now(), accuracy;
    uint64_t total = ddp_sampler_num_samples(&R->sampler);
    size_t got;
    int rank = R->rank;
    ddp_sampler_set_epoch(&R->sampler, (uint64_t)epoch); /* a new shuffle every epoch */
    TRY(NULL, ddp_sampler_set_position(&R->sampler, position));
    while (ddp_sampler_next_batch(&R->sampler, (size_t)c->batch, R->idx, &got) == DDP_SUCCESS && got) {
        gather(R->x, R->y, R->idx, (int)got, R->bx, R->by);
        TRY(g, train_step(&R->m, R->red, R->bx, R->by, (int)got, lr, c, sums));
        sums[2] += (double)got, R->samples_seen += (double)got * R->world, R->step++;
        if (rank == 0 && R->tty && R->step % 8 == 0) progress(epoch, c, ddp_sampler_position(&R->sampler), total, sums);
        if (ddp_sampler_position(&R->sampler) == total) break; /* the epoch's end: its checkpoint follows */
        if ((c->save_every && R->step % c->save_every == 0) || R->step == c->stop_at_step)
            TRY(g, save_checkpoint(g, &R->m, c, R->step, epoch, ddp_sampler_position(&R->sampler), sums));
        if (R->step == c->stop_at_step) return STOPPED;
    }
    TRY(g, ddp_all_reduce(g, sums, 3, DDP_F64, DDP_SUM)); /* the epoch's loss over every rank */
    TRY(g, evaluate(g, &R->m, c, R->ex, R->ey, R->n_eval, &accuracy));
    TRY(g, save_checkpoint(g, &R->m, c, R->step, epoch, total, sums));
    epoch_line(R, epoch, sums, accuracy, now() - t0);
    return R->step == c->stop_at_step ? STOPPED : 0;
}

/* The end of the run, collective: rank 0 saves the trained weights (torch state_dict names) for cmp and for
   Python; the reducer's statistics; whether the ranks' weights are all alike (*same). */
static ddp_result save_final(run *R, ddp_reducer_statistics *st, int *same) {
    ddp_tensor t[NPARAM + 3 * NBN];
    char names[NPARAM][64], path[4096];
    int64_t mine = weights_hash(&R->m), *all;
    int k, n = state_tensors(&R->m, 0, t, names);
    ddp_result r;
    snprintf(path, sizeof path, "%s/final.safetensors", R->c.dir);
    CHECK_R(ddp_checkpoint_save(R->g, path, t, n, NULL));
    memset(st, 0, sizeof *st);
    CHECK_R(ddp_reducer_get_statistics(R->red, st));
    /* DDP's promise: the replicas never drift apart, so every rank's weights hash alike */
    if (!(all = (int64_t *)malloc(sizeof(int64_t) * (size_t)R->world))) return DDP_ERR_OUT_OF_MEMORY;
    r = ddp_all_gather(R->g, &mine, all, 1, DDP_I64);
    for (*same = 1, k = 0; k < R->world; k++) *same &= all[k] == mine;
    free(all);
    return r;
}

/* Rank 0 reports on the run; 1 when the ranks' weights differ. */
static int report(const run *R, double seconds, const ddp_reducer_statistics *st, int same) {
    if (R->rank == 0) {
        printf("done: %.0f samples/s over %d ranks; weights in %s/final.safetensors\n", R->samples_seen / seconds,
               R->world, R->c.dir);
        printf("gradient all-reduce: %d bucket(s), %llu bytes a step; %.0f%% of its time hidden behind backward\n",
               st->buckets, (unsigned long long)st->bytes_reduced,
               st->total_comm_seconds > 0 ? 100.0 * (1.0 - st->total_wait_seconds / st->total_comm_seconds) : 0.0);
        printf("the weights are %s on every rank\n", same ? "identical" : "NOT identical");
        fflush(stdout);
    }
    return !same;
}

static int finish(run *R, double seconds) {
    ddp_reducer_statistics st;
    int rank = R->rank, same = 0;
    TRY(R->g, save_final(R, &st, &same));
    return report(R, seconds, &st, same);
}

/* ---- --ft: fault-tolerant training (src/ft.h) ---------------------------------------------------- */

/* The samples of step st over every rank: the global batch G, or what the epoch has left in its last step;
   0 past it. The epoch's list is padded for the first view, as DistributedSampler pads it. */
static uint64_t ft_step_samples(const run *R, const ddp_ft_step *st, uint64_t G) {
    uint64_t padded = ddp_sampler_num_samples(&R->sampler) * (uint64_t)R->first_world, begin = st->step * G;
    return begin >= padded ? 0 : padded - begin < G ? padded - begin : G;
}

/* A training forward moves BatchNorm's running statistics before the step is committed: bn_keep keeps them
   as they were, bn_put_back puts them back when the step is redone (on every member: a member that got
   through a forward another did not has moved them). */
static void bn_keep(run *R) {
    size_t h = (size_t)R->c.hidden;
    int k;
    for (k = 0; k < NBN; k++) {
        memcpy(R->bn_saved + 2 * k * h, R->m.running_mean[k], h * sizeof(float));
        memcpy(R->bn_saved + (2 * k + 1) * h, R->m.running_var[k], h * sizeof(float));
        R->bn_tracked[k] = ddp_syncbn_num_batches_tracked(R->m.bn[k]);
    }
}
static void bn_put_back(run *R) {
    size_t h = (size_t)R->c.hidden;
    int k;
    for (k = 0; k < NBN; k++) {
        memcpy(R->m.running_mean[k], R->bn_saved + 2 * k * h, h * sizeof(float));
        memcpy(R->m.running_var[k], R->bn_saved + (2 * k + 1) * h, h * sizeof(float));
        ddp_syncbn_set_num_batches_tracked(R->m.bn[k], R->bn_tracked[k]);
    }
}

/* This process's place in a new view (SyncBatchNorm follows the group's view by itself). */
static ddp_result ft_new_view(run *R, const ddp_ft_step *st, int changed) {
    R->rank = st->rank, R->world = st->world_size, R->gen = st->gen;
    if (!changed) return DDP_SUCCESS;
    if (R->rank == 0) {
        printf("%strain_demo: view %llu: %d ranks go on, from step %llu of epoch %d\n", R->tty ? "\r\033[K" : "",
               (unsigned long long)st->gen, st->world_size, (unsigned long long)st->step, (int)st->epoch + 1);
        fflush(stdout);
    }
    return DDP_SUCCESS;
}

/* One pass of a step on this rank's n samples (R->idx) of the step's N: forward, then backward through the
   reducer. SyncBatchNorm's statistics join the ranks' samples, so its backward mixes every rank's loss
   gradient: every rank scales its loss alike, by world_size / N, and DDP's average over the ranks is then
   the gradient of the mean loss over all N samples, whatever the shares (a view of 3 splits 128 samples
   43/43/42). ddp_reducer_set_local_samples (each rank's own mean, weighted by n / N) suits samples that do
   not interact; with SyncBatchNorm and unequal shares it would weigh the statistics' terms wrongly. */
static ddp_result ft_pass(run *R, size_t n, uint64_t N, double sums[2]) {
    zero_grad(&R->m); /* a redone pass starts again from zero */
    gather(R->x, R->y, R->idx, (int)n, R->bx, R->by);
    CHECK_R(net_forward(&R->m, R->bx, (int)n, 1));
    cross_entropy(&R->m, R->by, (int)n, (double)N / R->world, sums);
    CHECK_R(ddp_reducer_begin_backward(R->red));
    CHECK_R(net_backward(&R->m, (int)n, R->red));
    return ddp_reducer_end_backward(R->red);
}

/* The end of an epoch: the epoch's loss over the ranks (total) and the held-out accuracy. */
static ddp_result ft_epoch_end(run *R, const double sums[3], double total[3], double *accuracy) {
    memcpy(total, sums, 3 * sizeof(double));
    CHECK_R(ddp_all_reduce(R->g, total, 3, DDP_F64, DDP_SUM));
    return evaluate(R->g, &R->m, &R->c, R->ex, R->ey, R->n_eval, accuracy);
}

/* What a replacement receives when it is admitted (every member registers the same, in the same order):
   the weights, the momentum, BatchNorm's running statistics and counters, and the run's counters. */
static int ft_register(run *R) {
    ddp_group *g = R->g;
    size_t h = (size_t)R->c.hidden * sizeof(float);
    char name[64];
    int k, rank = R->rank;
    for (k = 0; k < NPARAM; k++) {
        size_t bytes = param_size(&R->m.p[k]) * sizeof(float);
        TRY(g, ddp_ft_register(g, param_names[k], R->m.p[k].w, bytes));
        snprintf(name, sizeof name, "%s.momentum", param_names[k]);
        TRY(g, ddp_ft_register(g, name, R->m.p[k].momentum, bytes));
    }
    for (k = 0; k < NBN; k++) {
        snprintf(name, sizeof name, "bn%d.running_mean", k + 1);
        TRY(g, ddp_ft_register(g, name, R->m.running_mean[k], h));
        snprintf(name, sizeof name, "bn%d.running_var", k + 1);
        TRY(g, ddp_ft_register(g, name, R->m.running_var[k], h));
        snprintf(name, sizeof name, "bn%d.num_batches_tracked", k + 1);
        TRY(g, ddp_ft_register(g, name, &R->m.batches_tracked[k], sizeof R->m.batches_tracked[k]));
    }
    TRY(g, ddp_ft_register(g, "step", &R->step, sizeof R->step));
    TRY(g, ddp_ft_register(g, "samples_seen", &R->samples_seen, sizeof R->samples_seen));
    return 0;
}

/* BatchNorm's counters live in the layers: the registered copies follow them before each step (a joiner
   may be admitted there), and a joiner's layers take what it received. */
static void ft_counters(run *R, int to_layers) {
    int k;
    for (k = 0; k < NBN; k++) {
        if (to_layers) ddp_syncbn_set_num_batches_tracked(R->m.bn[k], R->m.batches_tracked[k]);
        else R->m.batches_tracked[k] = ddp_syncbn_num_batches_tracked(R->m.bn[k]);
    }
}

/* --ft: the loop of src/ft.h. Each step runs in a view (the members alive) and ends in one verdict for all:
   COMMIT (apply the optimizer) or REDO (a member was lost: the survivors run the same step again, on the
   same global batch). Every collective of the run is inside a step, so a loss anywhere means a redo: an
   epoch's end (loss over the ranks, evaluation) and the final save are steps of their own. */
static int train_ft(run *R) {
    enum { PASS, EPOCH_END, FINAL } kind;
    ddp_group *g = R->g;
    const config *c = &R->c;
    ddp_ft_step st;
    ddp_reducer_statistics stats;
    uint64_t G = (uint64_t)c->batch * (uint64_t)R->first_world, N = 0; /* the global batch, this step's */
    uint64_t padded = ddp_sampler_num_samples(&R->sampler) * (uint64_t)R->first_world; /* an epoch's samples */
    double sums[3] = {0, 0, 0}, pass[2], total[3], accuracy = 0, start = now(), t0 = start;
    size_t got = 0;
    int rank = R->rank, views = 0, redo = 0, same = 0;
    if (!(R->bn_saved = alloc_floats(2 * NBN * (size_t)c->hidden))) return fail(rank, "malloc", "out of memory");
    if (ft_register(R)) return 1;
    memset(&st, 0, sizeof st);
    for (;;) {
        ddp_result r;
        if (redo) bn_put_back(R), redo = 0;
        ft_counters(R, 0);
        if (ddp_ft_begin(g, &st) != DDP_SUCCESS) return fail(rank, "ddp_ft_begin", ddp_last_error(g));
        if (st.joined) {
            ft_counters(R, 1);
            printf("train_demo: a replacement admitted as rank %d of %d at step %llu of epoch %d, with the members' "
                   "state\n", st.rank, st.world_size, (unsigned long long)st.step, (int)st.epoch + 1);
            fflush(stdout);
        }
        if (!views++ || st.gen != R->gen) TRY(g, ft_new_view(R, &st, views > 1));
        rank = R->rank;
        kind = st.epoch == (uint64_t)c->epochs ? FINAL : (N = ft_step_samples(R, &st, G)) == 0 ? EPOCH_END : PASS;
        if (kind == FINAL) {
            r = save_final(R, &stats, &same);
        } else if (kind == EPOCH_END) {
            r = ft_epoch_end(R, sums, total, &accuracy);
        } else {
            TRY(NULL, ddp_sampler_step_batch(&R->sampler, &st, G, R->idx, &got)); /* this rank's share */
            bn_keep(R), redo = 1;
            pass[0] = pass[1] = 0;
            r = ft_pass(R, got, N, pass);
        }
        if (r == DDP_SUCCESS) r = ddp_ft_commit(g, &st); /* the vote: did every member finish the step? */
        if (r == DDP_ERR_VIEW_CHANGED) continue;          /* the step is void on every member: run it again */
        if (r != DDP_SUCCESS) return fail(rank, "fault-tolerant step", ddp_last_error(g));
        redo = 0;
        if (kind == FINAL) break;
        if (kind == EPOCH_END) {
            epoch_line(R, (int)st.epoch, total, accuracy, now() - t0);
            if (rank == 0 && total[2] < (double)padded)
                printf("    (the loss and train acc above leave out the %.0f samples of the epoch that lost ranks "
                       "trained on)\n", (double)padded - total[2]);
            st.epoch++, st.step = 0, t0 = now();
            sums[0] = sums[1] = sums[2] = 0;
            continue;
        }
        sgd_step(&R->m, epoch_lr(c, (int)st.epoch), c);
        sums[0] += pass[0], sums[1] += pass[1], sums[2] += (double)got;
        R->samples_seen += (double)N, R->step++;
        if (rank == 0 && R->tty && R->step % 8 == 0)
            progress((int)st.epoch, c, st.step * G < padded ? st.step * G : padded, padded, sums);
    }
    free(R->bn_saved);
    return report(R, now() - start, &stats, same);
}

static void free_run(run *R) {
    ddp_reducer_destroy(R->red);
    ddp_sampler_free(&R->sampler);
    net_free(&R->m);
    free(R->x), free(R->y), free(R->ex), free(R->ey), free(R->bx), free(R->by), free(R->idx);
}

int main(int argc, char **argv) {
    run R;
    ddp_init_desc desc;
    ddp_sampler_desc sd;
    resume_point rp;
    ddp_group *g;
    double start;
    int rank, epoch, status = 0, joiner;
    memset(&R, 0, sizeof R);
    if (parse_args(argc, argv, &R.c)) return 2;
    memset(&desc, 0, sizeof desc); /* everything from the launcher's environment */
    desc.fault_tolerant = R.c.ft;  /* --ft (DDP_FT=1, which ddprun --ft sets, turns it on as well) */
    if (ddp_init(&desc, &R.g) != DDP_SUCCESS) return fail(-1, "ddp_init", ddp_last_error(NULL));
    g = R.g, rank = R.rank = ddp_rank(g), R.world = R.first_world = ddp_world_size(g), R.tty = isatty(STDOUT_FILENO);
    joiner = R.c.ft && getenv("DDP_FT_JOIN") && strcmp(getenv("DDP_FT_JOIN"), "1") == 0;
    if (joiner) { /* a replacement: a group of one until admitted; the job's first size is the launcher's */
        R.world = R.first_world = getenv("WORLD_SIZE") ? atoi(getenv("WORLD_SIZE")) : 0;
        if (R.first_world < 1) return fail(rank, "DDP_FT_JOIN=1", "WORLD_SIZE (the job's first size) is not set");
    }
    R.cap = R.c.ft ? R.c.batch * R.world : R.c.batch; /* with --ft one rank may be left with a step's whole batch */
    if (make_data(&R) || make_model(&R)) return 1;

    memset(&rp, 0, sizeof rp);
    if (R.c.resume ? load_checkpoint(g, &R.m, &R.c, &rp) : !joiner && clear_checkpoints(g, &R.c)) return 1;
    TRY(g, ddp_reducer_finalize(R.red)); /* same model everywhere? then rank 0's weights on every rank */
    memset(&sd, 0, sizeof sd);           /* DistributedSampler(shuffle=True, seed=0, drop_last=False) */
    sd.dataset_size = (uint64_t)R.c.samples, sd.num_replicas = R.world, sd.rank = rank;
    TRY(NULL, ddp_sampler_init(&R.sampler, &sd));
    R.step = rp.step, epoch = (int)rp.epoch;
    if (R.c.resume && rp.position >= ddp_sampler_num_samples(&R.sampler)) /* saved at the end of an epoch */
        epoch++, rp.position = 0, rp.sums[0] = rp.sums[1] = rp.sums[2] = 0.0;
    if (joiner) {
        printf("train_demo: a replacement (DDP_FT_JOIN=1) asks to join the running job\n");
        fflush(stdout);
    } else if (rank == 0) {
        printf("train_demo: %d ranks (%s backend), %d samples, batch %d x %d ranks = %d, %d epochs, hidden %d%s\n",
               R.world, ddp_backend_name(g), R.c.samples, R.c.batch, R.world, R.c.batch * R.world, R.c.epochs,
               R.c.hidden, R.c.ft ? ", fault-tolerant (--ft)" : "");
        if (R.c.resume)
            printf("resumed from %s: epoch %d, step %lld, %llu samples of the epoch done on each rank\n", rp.path,
                   epoch + 1, (long long)R.step, (unsigned long long)rp.position);
        fflush(stdout);
    }

    start = now();
    if (R.c.ft) {
        if (train_ft(&R)) return 1;
        rank = R.rank; /* this process's rank in the last view */
    } else {
        for (; epoch < R.c.epochs && !status; epoch++, rp.position = 0, memset(rp.sums, 0, sizeof rp.sums))
            if ((status = train_epoch(&R, epoch, rp.position, rp.sums)) == 1) return 1;
        if (status == STOPPED) { /* as if killed there, but on purpose: the checkpoint is the one to resume from */
            if (rank == 0)
                printf("stopped after step %lld (--stop-at-step), saved in %s/ckpt_%08lld.safetensors: run again with "
                       "--resume to continue\n", (long long)R.step, R.c.dir, (long long)R.step);
        } else if (finish(&R, now() - start))
            return 1;
    }
    free_run(&R);
    if (ddp_destroy(g) != DDP_SUCCESS) return fail(rank, "ddp_destroy", ddp_last_error(NULL));
    return 0;
}
