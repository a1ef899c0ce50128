/* checkpoint_resume: save a checkpoint every few steps and, after a crash, continue from the newest one,
   ending with exactly the weights of a run that never crashed. PyTorch's recipe, in C:
       if rank == 0: torch.save({"model": ..., "optimizer": ..., "step": ...}, path)   # then a barrier
       torchrun --max-restarts 1 ...      # a failed worker restarts the group; it loads the checkpoint

   Shows: ddp_checkpoint_save_async_ex (rank 0 copies the tensors and writes them in the background,
   atomically, while training goes on; ddp_wait one step later says the file is durable on every rank;
   keep_last deletes older ones), the resume state in the metadata (ddp_meta_set_resume: step, epoch,
   the epoch's global sample position, world size), ddp_checkpoint_latest, ddp_checkpoint_load on every
   rank, ddp_sampler_resume to continue mid-epoch ON ANY NUMBER OF RANKS, and DDP_RESTART_COUNT, which
   ddprun --max-restarts (or torchrun's TORCHELASTIC_RESTART_COUNT) sets on each restart.
   The model: linear regression, y = w . x + b, trained with SGD and momentum; the gradient is averaged
   over the ranks with one all_reduce (what DDP does, without buckets). On the first attempt the last rank
   crashes at step 23 (--crash-at N; 0 = never); ddprun stops the others and starts the group again; the
   program finds the checkpoint of step 20 and continues.

   Run:  make build/checkpoint_resume build/ddprun
         build/ddprun --nproc-per-node 2 --max-restarts 1 build/checkpoint_resume build/ckpt_example
         build/ddprun --nproc-per-node 2 build/checkpoint_resume build/ckpt_example --crash-at 0
   Both end with the same "final weights" line. A new launch (DDP_RESTART_COUNT 0) starts over, unless
   given --resume.

   Another number of ranks: --max-restarts restarts with the same --nproc-per-node; a job the user starts
   again (after a preemption, on a smaller or bigger allocation) may use another, and continues the same
   epoch where it stopped: every sample of the epoch is seen once across the change (the sampler deals
   the rest of the epoch to the new ranks; see ddp_sampler_resume). The model's tensors do not depend
   on the number of ranks; the gradient average does (a step now averages over M ranks' batches), as
   with torch when the world size changes.
         build/ddprun --nproc-per-node 4 build/checkpoint_resume build/ckpt_example --crash-at 0 --stop-at 20
         build/ddprun --nproc-per-node 3 build/checkpoint_resume build/ckpt_example --resume
   The first stops after step 20 (as a preempted job would); the second continues from step 20's
   checkpoint, in the middle of epoch 3, on 3 ranks. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { F = 4, N = 96, BATCH = 4, EPOCHS = 6, SAVE_EVERY = 5 };

/* The data: y = 2 x0 - x1 + 0.5 x2 + 3 x3 + 1 exactly, x on a fixed pseudo-random grid. */
static void sample(int i, float *x, float *y) {
    static const float true_w[F] = {2.0f, -1.0f, 0.5f, 3.0f};
    int k;
    *y = 1.0f;
    for (k = 0; k < F; k++) {
        x[k] = (float)((i * (7 + 4 * k) + 3 * k) % 17) / 8.0f - 1.0f;
        *y += true_w[k] * x[k];
    }
}

typedef struct state {
    float w[F + 1];        /* weights and, last, the bias */
    float momentum[F + 1]; /* the optimizer's state */
} state;

/* The checkpoint's tensors, pointing into s. */
static void tensors(state *s, ddp_tensor t[2]) {
    memset(t, 0, 2 * sizeof(ddp_tensor));
    t[0].name = "linear.weight_and_bias", t[0].dtype = DDP_F32, t[0].ndim = 1, t[0].shape[0] = F + 1;
    t[0].data = s->w;
    t[1].name = "optimizer.momentum_buffer", t[1].dtype = DDP_F32, t[1].ndim = 1, t[1].shape[0] = F + 1;
    t[1].data = s->momentum;
}

#define TRY(call)                                                                              \
    do {                                                                                       \
        if ((call) != DDP_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

/* A new launch: remove an earlier run's checkpoints, so that a restart cannot pick one of them up. */
static void remove_checkpoints(const char *pattern) {
    char path[1024];
    int64_t number;
    while (ddp_checkpoint_latest(pattern, path, sizeof path, &number) == DDP_SUCCESS && number >= 0)
        if (remove(path) != 0) return;
}

/* The gradient of the mean squared error over this rank's batch, averaged over the ranks, and one step
   of SGD with momentum (torch.optim.SGD(lr=0.05, momentum=0.9)). */
static int train_step(ddp_group *g, state *s, const int64_t *idx, size_t n) {
    float grad[F + 1] = {0}, x[F], y, err;
    size_t i;
    int k;
    for (i = 0; i < n; i++) {
        sample((int)idx[i], x, &y);
        err = s->w[F] - y;
        for (k = 0; k < F; k++) err += s->w[k] * x[k];
        for (k = 0; k < F; k++) grad[k] += 2.0f * err * x[k] / (float)n;
        grad[F] += 2.0f * err / (float)n;
    }
    TRY(ddp_all_reduce(g, grad, F + 1, DDP_F32, DDP_AVG)); /* the average over the ranks */
    for (k = 0; k <= F; k++) {
        s->momentum[k] = 0.9f * s->momentum[k] + grad[k];
        s->w[k] -= 0.05f * s->momentum[k];
    }
    return 0;
}

/* Rank 0 starts writing DIR/ckpt_<step>.safetensors with the resume state, in the background: the call
   returns once the tensors are copied, and *pending completes (ddp_wait) once the file is durable. The
   two newest are kept. */
static int save(ddp_group *g, const char *dir, state *s, const ddp_resume_state *rs, ddp_work **pending) {
    ddp_checkpoint_save_desc keep;
    ddp_meta meta;
    ddp_tensor t[2];
    char path[1024];
    ddp_result r;
    memset(&keep, 0, sizeof keep);
    memset(&meta, 0, sizeof meta);
    keep.keep_last = 2;
    tensors(s, t);
    snprintf(path, sizeof path, "%s/ckpt_%06lld.safetensors", dir, (long long)rs->step);
    r = ddp_meta_set_resume(&meta, rs);
    if (r == DDP_SUCCESS) r = ddp_checkpoint_save_async_ex(g, path, t, 2, &meta, &keep, pending);
    ddp_meta_free(&meta);
    TRY(r);
    return 0;
}

/* The save started one step ago is durable on every rank (or its error is every rank's). */
static int saved(ddp_group *g, ddp_work **pending, int64_t step) {
    if (!*pending) return 0;
    TRY(ddp_wait(*pending));
    *pending = NULL;
    if (ddp_rank(g) == 0) printf("step %lld: saved checkpoint %lld\n", (long long)step, (long long)step - 1);
    return 0;
}

/* Load checkpoint number `latest` of DIR into s and rs (collective: every rank reads the file). */
static int load(ddp_group *g, const char *dir, int64_t latest, state *s, ddp_resume_state *rs) {
    ddp_meta meta;
    ddp_tensor t[2];
    char path[1024];
    ddp_result r;
    memset(&meta, 0, sizeof meta);
    tensors(s, t);
    snprintf(path, sizeof path, "%s/ckpt_%06lld.safetensors", dir, (long long)latest);
    r = ddp_checkpoint_load(g, path, t, 2, &meta);
    if (r == DDP_SUCCESS) r = ddp_meta_get_resume(&meta, rs);
    ddp_meta_free(&meta);
    TRY(r);
    if (ddp_rank(g) == 0) /* any world size: the sampler continues from the epoch's global position */
        printf("resuming from %s (epoch %lld, step %lld, %lld of the epoch's %d samples seen by %d ranks) on %d ranks\n", path,
               (long long)rs->epoch, (long long)rs->step, (long long)rs->sampler_global_position, N, rs->world_size, ddp_world_size(g));
    return 0;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 && argv[1][0] != '-' ? argv[1] : "build/ckpt_example";
    const char *restarts = getenv("DDP_RESTART_COUNT");
    int attempt = restarts ? atoi(restarts) : 0, crash_at = 23, stop_at = 0, resume = 0, rank, world, i;
    char pattern[1024], path[1024];
    int64_t latest = -1, idx[BATCH];
    size_t got;
    ddp_group *g;
    ddp_sampler sampler;
    ddp_sampler_desc sd;
    ddp_resume_state rs;
    ddp_work *pending = NULL;
    state s;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--resume")) resume = 1;
        if (!strcmp(argv[i], "--crash-at") && i + 1 < argc) crash_at = atoi(argv[++i]);
        if (!strcmp(argv[i], "--stop-at") && i + 1 < argc) stop_at = atoi(argv[++i]);
    }
    resume |= attempt > 0; /* a restart by the launcher continues; a new launch starts over */
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g), world = ddp_world_size(g);
    memset(&s, 0, sizeof s);
    memset(&rs, 0, sizeof rs);
    snprintf(pattern, sizeof pattern, "%s/ckpt_*.safetensors", dir);
    if (rank == 0) { /* rank 0 looks for the newest checkpoint; the others learn it from the broadcast */
        printf("attempt %d (DDP_RESTART_COUNT=%d)\n", attempt, attempt);
        if (mkdir(dir, 0777) != 0 && errno != EEXIST) fprintf(stderr, "cannot create %s: %s\n", dir, strerror(errno));
        if (resume) ddp_checkpoint_latest(pattern, path, sizeof path, &latest);
        else remove_checkpoints(pattern);
    }
    TRY(ddp_broadcast(g, &latest, 1, DDP_I64, 0));
    if (latest >= 0 && load(g, dir, latest, &s, &rs)) return 1;

    memset(&sd, 0, sizeof sd); /* DistributedSampler's defaults */
    sd.dataset_size = N, sd.num_replicas = world, sd.rank = rank;
    TRY(ddp_sampler_init(&sampler, &sd));
    for (; rs.epoch < EPOCHS; rs.epoch++, rs.sampler_global_position = 0) {
        /* set_epoch + the global position: mid-epoch after a resume, whatever world size saved it */
        TRY(ddp_sampler_resume(&sampler, (uint64_t)rs.epoch, (uint64_t)rs.sampler_global_position));
        while (ddp_sampler_next_batch(&sampler, BATCH, idx, &got) == DDP_SUCCESS && got) {
            if (train_step(g, &s, idx, got)) return 1; /* the weights change while a save may be in flight */
            rs.step++, rs.world_size = world;
            rs.sampler_position = (int64_t)ddp_sampler_position(&sampler);
            rs.sampler_global_position = (int64_t)ddp_sampler_global_position(&sampler);
            if (saved(g, &pending, rs.step)) return 1;
            if (rs.step % SAVE_EVERY == 0 && save(g, dir, &s, &rs, &pending)) return 1;
            if (rs.step == crash_at && !resume && rank == world - 1) {
                fprintf(stderr, "rank %d: crashing on purpose at step %d\n", rank, crash_at);
                _exit(3); /* as a crash would: no ddp_destroy, no cleanup; the others see this rank vanish */
            }
            if (rs.step == stop_at) break;
        }
        if (rs.step == stop_at) {
            if (saved(g, &pending, rs.step + 1)) return 1;
            if (rank == 0) printf("stopping after step %d, as asked (--stop-at)\n", stop_at);
            ddp_sampler_free(&sampler);
            return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
        }
    }
    if (saved(g, &pending, rs.step + 1)) return 1;
    if (rank == 0) {
        printf("final weights after %lld steps:", (long long)rs.step);
        for (i = 0; i <= F; i++) printf(" %.9g", (double)s.w[i]);
        printf("  (the data's: 2 -1 0.5 3 1)\n");
    }
    ddp_sampler_free(&sampler);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
