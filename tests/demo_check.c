/* demo_check: is every step of examples/train_demo.c the step ONE process would take?

   Run the demo with a checkpoint after every step, kept, then this program with the same flags:
       build/ddprun --standalone --nproc-per-node 4 build/train_demo --quick --save-every 1 --keep 0 --dir D
       build/demo_check --quick --dir D                                  (make demo-check does both)
   For each step s (1 to the newest checkpoint) it starts from the state before s (the model's initial state for the first step, else
   ckpt_<s-1>: weights, momentum, running statistics, epoch and sampler position), takes the step one
   process would take, and compares the result with ckpt_<s> (the DDP run's state after the step). It
   prints the largest difference over the run and exits 1 when one is above 1e-5 (absolute), or when a
   checkpoint is missing or not where the step should have left the sampler.

   The one-process step is exactly what DDP promises to equal:
     - its batch is the union of the ranks' batches (rank 0's, then rank 1's, ...), rebuilt here from a
       DistributedSampler per rank at the checkpoint's epoch and position, padding duplicates included:
       the ranks' batches always have equal sizes (every shard has ceil(N / R) samples), so the mean loss
       over the union is the average over the ranks of each rank's mean loss, which is what averaging the
       gradients computes;
     - plain BatchNorm over the whole union: SyncBatchNorm's statistics are those of the union, and its
       backward gives each rank the gradient of the sum of all ranks' losses;
     - the same learning rate and optimizer (hence the demo's flags: --epochs and --lr set the schedule).
   Why step by step, not two whole runs side by side: the two compute the same sums in different orders,
   and training amplifies those 1e-8 roundings step after step (two whole runs of the demo, DDP and one
   process, end 1e-2 apart after 2500 steps at learning rates 0.01 to 0.1; both are equally good models).
   Each step starts from the DDP run's own state, which separates DDP's semantics from that chaos.

   The demo's model, data, training step and checkpoint reader are used as they are: its file is included
   here, its main renamed.

   demo_check --compare A B [the demo's flags]: the largest differences between two final weight files of
   the demo (final.safetensors: weights and running statistics), for make demo-ft, which compares a run
   that lost a rank (--ft) with one that did not. */
#define main train_demo_main
#include "../examples/train_demo.c"
#undef main

static const double TOLERANCE = 1e-5;

static double max_abs_diff(const float *a, const float *b, size_t n, double worst) {
    size_t i;
    for (i = 0; i < n; i++) worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    return worst;
}

/* worst[0..2]: the largest differences between a and b so far in weights, momentum, running statistics */
static void compare(const net *a, const net *b, double worst[3]) {
    int k;
    for (k = 0; k < NPARAM; k++) {
        worst[0] = max_abs_diff(a->p[k].w, b->p[k].w, param_size(&a->p[k]), worst[0]);
        worst[1] = max_abs_diff(a->p[k].momentum, b->p[k].momentum, param_size(&a->p[k]), worst[1]);
    }
    for (k = 0; k < NBN; k++) {
        worst[2] = max_abs_diff(a->running_mean[k], b->running_mean[k], (size_t)a->hidden, worst[2]);
        worst[2] = max_abs_diff(a->running_var[k], b->running_var[k], (size_t)a->hidden, worst[2]);
    }
}

static void copy_state(net *to, const net *from) {
    int k;
    for (k = 0; k < NPARAM; k++) {
        memcpy(to->p[k].w, from->p[k].w, sizeof(float) * param_size(&from->p[k]));
        memcpy(to->p[k].momentum, from->p[k].momentum, sizeof(float) * param_size(&from->p[k]));
    }
    for (k = 0; k < NBN; k++) {
        memcpy(to->running_mean[k], from->running_mean[k], sizeof(float) * (size_t)from->hidden);
        memcpy(to->running_var[k], from->running_var[k], sizeof(float) * (size_t)from->hidden);
        ddp_syncbn_set_num_batches_tracked(to->bn[k], ddp_syncbn_num_batches_tracked(from->bn[k]));
    }
}

static int fail_check(const char *what, const char *path) {
    fprintf(stderr, "demo_check: %s%s%s\n", what, path ? ": " : "", path ? path : "");
    return 1;
}

/* --compare A B: prints the largest differences between the final weights in A and in B. */
static int compare_final(const config *c, const char *a, const char *b) {
    net m[2];
    ddp_tensor t[2][NPARAM + 3 * NBN];
    char names[NPARAM][64];
    double worst[3] = {0, 0, 0};
    int i;
    for (i = 0; i < 2; i++) {
        int n;
        if (net_create(&m[i], c->hidden, 1, NULL) != DDP_SUCCESS) return fail_check("out of memory", NULL);
        n = state_tensors(&m[i], 0, t[i], names);
        if (ddp_checkpoint_load(NULL, i ? b : a, t[i], n, NULL) != DDP_SUCCESS) return fail_check(ddp_last_error(NULL), NULL);
    }
    compare(&m[0], &m[1], worst); /* worst[1] compares momentum buffers, which final weights do not hold */
    printf("compare: largest difference between %s and %s: weights %.3g, running statistics %.3g\n", a, b, worst[0],
           worst[2]);
    net_free(&m[0]), net_free(&m[1]);
    return 0;
}

int main(int argc, char **argv) {
    config c;
    net ref, ddp; /* ref: plain BatchNorm, batch of every rank; ddp: the states the DDP run saved */
    resume_point before, after;
    ddp_sampler *samplers;
    float *x, *bx;
    int *y, *by, r, world, epoch;
    int64_t *idx, step, newest = -1;
    uint64_t position, shard;
    double worst[3] = {0, 0, 0}, sums[2];
    char pattern[4096];
    size_t got, got_r;

    if (argc >= 4 && !strcmp(argv[1], "--compare")) {
        const char *a = argv[2], *b = argv[3];
        argv[3] = argv[0]; /* parse the demo's flags after A and B */
        return parse_args(argc - 3, argv + 3, &c) ? 2 : compare_final(&c, a, b);
    }
    if (parse_args(argc, argv, &c)) return 2;
    /* the run's last step, and its world size (from the first checkpoint) */
    memset(&after, 0, sizeof after);
    snprintf(pattern, sizeof pattern, "%s/ckpt_*.safetensors", c.dir);
    if (ddp_checkpoint_latest(pattern, after.path, sizeof after.path, &newest) != DDP_SUCCESS)
        return fail_check(ddp_last_error(NULL), NULL);
    snprintf(after.path, sizeof after.path, "%s/ckpt_%08d.safetensors", c.dir, 1);
    if (newest < 1 || access(after.path, R_OK) != 0)
        return fail_check("no checkpoint of step 1: run train_demo with --save-every 1 --keep 0 and this --dir",
                          after.path);
    if (net_create(&ddp, c.hidden, 1, NULL) != DDP_SUCCESS) return fail_check("out of memory", NULL);
    if (read_checkpoint(NULL, &ddp, &c, &after)) return 1;
    world = after.world;
    if (world < 1) return fail_check("a checkpoint without a world size", after.path);

    x = alloc_floats((size_t)c.samples * IN), y = (int *)malloc(sizeof(int) * (size_t)c.samples);
    bx = alloc_floats((size_t)c.batch * (size_t)world * IN), by = (int *)malloc(sizeof(int) * (size_t)c.batch * (size_t)world);
    idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)c.batch * (size_t)world);
    samplers = (ddp_sampler *)calloc((size_t)world, sizeof(ddp_sampler));
    if (!x || !y || !bx || !by || !idx || !samplers) return fail_check("out of memory", NULL);
    make_spirals(1234, c.samples, x, y); /* the demo's training set */
    for (r = 0; r < world; r++) {        /* the sampler each rank made: DistributedSampler(shuffle=True) */
        ddp_sampler_desc d;
        memset(&d, 0, sizeof d);
        d.dataset_size = (uint64_t)c.samples, d.num_replicas = world, d.rank = r;
        if (ddp_sampler_init(&samplers[r], &d) != DDP_SUCCESS) return fail_check(ddp_last_error(NULL), NULL);
    }
    shard = ddp_sampler_num_samples(&samplers[0]);
    /* the state before step 1: the model as created (every rank creates the same one) */
    if (net_create(&ref, c.hidden, c.batch * world, NULL) != DDP_SUCCESS) return fail_check("out of memory", NULL);
    memset(&before, 0, sizeof before);

    for (step = 1; step <= newest; step++) {
        snprintf(after.path, sizeof after.path, "%s/ckpt_%08lld.safetensors", c.dir, (long long)step);
        if (read_checkpoint(NULL, &ddp, &c, &after)) return 1; /* also a missing one: every step must be there */
        epoch = (int)before.epoch, position = before.position;
        if (position >= shard) epoch++, position = 0; /* saved at the end of an epoch: the next one starts */
        for (got = 0, r = 0; r < world; r++) {   /* the union: rank 0's batch, then rank 1's, ... */
            ddp_sampler_set_epoch(&samplers[r], (uint64_t)epoch);
            if (ddp_sampler_set_position(&samplers[r], position) != DDP_SUCCESS ||
                ddp_sampler_next_batch(&samplers[r], (size_t)c.batch, idx + got, &got_r) != DDP_SUCCESS || !got_r)
                return fail_check("the sampler has no batch where the previous checkpoint left it", after.path);
            got += got_r;
        }
        got_r = got / (size_t)world; /* each rank's batch */
        if (after.step != step || after.epoch != epoch || after.position != position + got_r)
            return fail_check("not the state one step after the previous checkpoint (step, epoch or sampler "
                              "position)", after.path);
        gather(x, y, idx, (int)got, bx, by);
        sums[0] = sums[1] = 0;
        if (train_step(&ref, NULL, bx, by, (int)got, epoch_lr(&c, epoch), &c, sums) != DDP_SUCCESS)
            return fail_check(ddp_last_error(NULL), NULL);
        compare(&ref, &ddp, worst);
        for (r = 0; r < NBN; r++)
            if (ddp_syncbn_num_batches_tracked(ref.bn[r]) != ddp_syncbn_num_batches_tracked(ddp.bn[r]))
                return fail_check("num_batches_tracked differs", after.path);
        copy_state(&ref, &ddp); /* the next step starts from the DDP run's state */
        before = after;
    }
    {
        int ok = worst[0] <= TOLERANCE && worst[1] <= TOLERANCE && worst[2] <= TOLERANCE;
        printf("check: each of the %lld DDP steps of %s against one process stepping on the union of the %d ranks' "
               "batches (plain BatchNorm):\n", (long long)(step - 1), c.dir, world);
        printf("check: largest difference: weights %.3g, momentum %.3g, running statistics %.3g: %s (tolerance %g)\n",
               worst[0], worst[1], worst[2], ok ? "OK" : "TOO LARGE", TOLERANCE);
        for (r = 0; r < world; r++) ddp_sampler_free(&samplers[r]);
        free(samplers), free(x), free(y), free(bx), free(by), free(idx);
        net_free(&ref), net_free(&ddp);
        return ok ? 0 : 1;
    }
}
