/* Fault-tolerant training (src/ft.h, src/ft.c): a member is SIGKILLed at a chosen point of a chosen step
   (DDP_FT_TEST_KILL, the library's own kill points) and the survivors must go on without a restart.
   The program trains a model whose per-sample loss is 0.5 |w - t(i)|^2 (t: a fixed function of the sample
   index i, in three tensors of 301, 41 and 7 floats, so the reducer runs three buckets) with SGD, for two
   epochs of a shuffled dataset through ddp_sampler_step_batch and ddp_reducer_set_local_samples, looping
   as src/ft.h says. Each rank writes a log line per pass it finished (the indices it used) and per step it
   committed (the view that ran it, and a hash of its weights after the step's update), and its final
   weights. The parent checks, independently of the library's code:
   - every survivor exits 0 and the victims die by SIGKILL;
   - per epoch, the committed steps are 0 .. S-1, each once, and each step's samples (every rank's share
     in the view that committed it, from the sampler's position rule) are the epoch's padded list
     (G2: every sample once); each logged pass used exactly its rank's share;
   - G3: the weights after each committed step are the same bits on every member that committed it, and
     the same bits as a serial f32 replay of the membership log (membership_replay: per committed step
     the view's size, each view rank's share, the reducer's n / N weights and the transport's order of
     f32 adds: rank order over shared memory, recursive doubling over TCP; bit for bit on both, since
     neither order depends on timing); the survivors' final weights are equal bit for bit, equal the
     replay's, and equal a serial f64 replay of the failure-free run (the mean gradient of each step's
     global batch) within 1e-5. (The per-step hashes matter: SGD here contracts, so a difference early in
     a run would be gone from the final weights.)
   - from a kill to the survivors' next committed step (printed; not a pass/fail threshold: machines are
     noisy; the closing numbers are measured by bench, not asserted here).
   Cases: no kill; a member killed at begin, mid-bucket, in the vote (its vote lost: every survivor has
   COMPLETE, the step commits); the coordinator (id 0) killed; two members killed in one step, the second
   while reporting in the view change; the coordinator killed while sending its DECIDE. On 3 and 4 ranks,
   over shared memory and over TCP. */
#include "testlib.h"

#define NT 3
static const size_t COUNT[NT] = {301, 41, 7};
#define COUNT_MAX 301
#define DATASET 203
#define BATCH 4    /* per rank of the first view: G = BATCH * R0 */
#define MAX_EPOCHS 64
#define LR 0.25

static double target(int64_t i, int t, size_t e) { return sin(0.013 * (double)i * (double)(t + 1) + 0.7 * (double)e); }

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The model's f32 arithmetic, shared by the workers and membership_replay: tensor t's gradient on a rank,
   the mean over its samples of w - t(i) (summed in f64, rounded once; 0 without samples) ... */
static void local_grad(const float *w, int t, const int64_t *idx, size_t got, float *gr) {
    size_t e, k;
    for (e = 0; e < COUNT[t]; e++) {
        double sum = 0;
        for (k = 0; k < got; k++) sum += (double)w[e] - target(idx[k], t, e);
        gr[e] = got ? (float)(sum / (double)got) : 0.0f;
    }
}

/* ... and SGD with the averaged gradient. */
static void sgd(float *w, const float *gr, size_t count) {
    size_t e;
    for (e = 0; e < count; e++) w[e] -= (float)LR * gr[e];
}

/* The weights' bytes, hashed (FNV-1a 64): each K line carries them after its step's update. */
static uint64_t weights_hash(float *const *w) {
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i;
    int t;
    for (t = 0; t < NT; t++)
        for (i = 0; i < COUNT[t] * sizeof(float); i++) h = (h ^ ((const unsigned char *)w[t])[i]) * 0x100000001b3ull;
    return h;
}

static const char *g_dir;
static int g_epochs = 2;          /* random rounds train longer ... */
static unsigned g_compute_us = 0; /* ... with some compute in each step, so that a kill lands mid-run */

static void log_line(int fd, const char *fmt, ...) {
    char buf[8192];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0 && write(fd, buf, (size_t)n) != n) abort();
}

static ddp_sampler_desc sampler_desc(int r0) {
    ddp_sampler_desc d;
    memset(&d, 0, sizeof d);
    d.dataset_size = DATASET;
    d.num_replicas = r0;
    d.seed = 7;
    return d;
}

/* The end a case may expect of a member, with its exit code: too few members left (4). */
static void expected_end(int fd, ddp_group *g, ddp_result res) {
    if (res != DDP_ERR_PEER_LOST) return;
    if (strstr(ddp_last_error(g), "fewer than min_world_size")) {
        log_line(fd, "M %s\n", ddp_last_error(g));
        exit(4);
    }
}

static size_t g_big = 0; /* bytes of extra registered state (the G5 case: 64 MiB) */

static int worker(int rank, int n, void *arg) {
    double started = wall();
    unsigned char *big = NULL;
    ddp_init_desc desc;
    ddp_group *g;
    ddp_reducer_desc rd;
    ddp_reducer *r;
    ddp_sampler s;
    ddp_sampler_desc sd = sampler_desc(n);
    ddp_ft_step st;
    float *w[NT], *gr[NT];
    int64_t idx[64];
    size_t got, e, k;
    uint64_t G = (uint64_t)BATCH * (uint64_t)n, steps = 0;
    int t, fd;
    char path[512];
    ddp_result res;
    (void)arg;
    if (getenv("FT_TEST_LOG")) rank = atoi(getenv("FT_TEST_LOG")); /* a joiner's own log */
    snprintf(path, sizeof path, "%s/log.%d", g_dir, rank);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    CHECK(fd >= 0, "open %s", path);
    memset(&desc, 0, sizeof desc);
    desc.fault_tolerant = 1;
    desc.suspect_seconds = 1; /* (a silent member costs 2 x this) */
    desc.timeout_seconds = 30; /* a silent member must be caught by suspect_seconds, long before this */
    CHECK_OK(ddp_init(&desc, &g), NULL);
    memset(&rd, 0, sizeof rd);
    rd.bucket_cap_bytes = 16; /* one bucket per tensor */
    rd.first_bucket_bytes = 16;
    CHECK_OK(ddp_reducer_create(g, &rd, &r), g);
    for (t = 0; t < NT; t++) {
        char name[16];
        w[t] = (float *)calloc(COUNT[t], sizeof(float));
        gr[t] = (float *)calloc(COUNT[t], sizeof(float));
        CHECK(w[t] && gr[t], "calloc");
        for (e = 0; e < COUNT[t]; e++) w[t][e] = (float)(0.1 * (double)e / (double)COUNT[t]);
        snprintf(name, sizeof name, "w%d", t);
        CHECK_OK(ddp_reducer_add_param(r, name, w[t], gr[t], COUNT[t], DDP_F32, NULL), g);
    }
    CHECK_OK(ddp_reducer_finalize(r), g); /* (local on a joiner: its state comes with its admission) */
    for (t = 0; t < NT; t++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", t);
        CHECK_OK(ddp_ft_register(g, name, w[t], COUNT[t] * sizeof(float)), g);
    }
    if (g_big) { /* the members' pattern; a joiner starts from zeros and must receive it */
        size_t i;
        CHECK((big = (unsigned char *)calloc(g_big, 1)) != NULL, "calloc");
        if (!getenv("DDP_FT_JOIN"))
            for (i = 0; i < g_big; i++) big[i] = (unsigned char)(i * 2654435761u >> 13);
        CHECK_OK(ddp_ft_register(g, "big", big, g_big), g);
    }
    CHECK_OK(ddp_sampler_init(&s, &sd), NULL);
    memset(&st, 0, sizeof st);
    for (;;) {
        uint64_t pass_gen;
        int pass_world, pass_rank;
        res = ddp_ft_begin(g, &st);
        expected_end(fd, g, res);
        CHECK(res == DDP_SUCCESS, "rank %d: ddp_ft_begin: %s", rank, ddp_last_error(g));
        if (st.joined) { /* (before the epoch check: it may be admitted at an epoch's end) */
            size_t i;
            log_line(fd, "J %llu %llu %llu %d %d %.6f\n", (unsigned long long)st.epoch, (unsigned long long)st.step,
                     (unsigned long long)st.gen, st.world_size, st.rank, wall() - started);
            for (i = 0; i < g_big; i++)
                CHECK(big[i] == (unsigned char)(i * 2654435761u >> 13), "the joiner's state differs at byte %zu", i);
        }
        CHECK_OK(ddp_sampler_step_batch(&s, &st, G, idx, &got), NULL);
        if (got == 0 && st.step > 0) { /* past the epoch's end */
            if (++st.epoch == (uint64_t)g_epochs) break;
            st.step = 0;
            continue;
        }
        pass_gen = st.gen, pass_world = st.world_size, pass_rank = st.rank;
        if (g_compute_us) usleep(g_compute_us);
        /* the summation order of the reduction (membership_replay) follows the data plane's ranks */
        CHECK(pass_rank == ddp_rank(g) && pass_world == ddp_world_size(g), "rank %d: the step's view (rank %d of %d) is "
              "not the group's (rank %d of %d)", rank, pass_rank, pass_world, ddp_rank(g), ddp_world_size(g));
        for (t = 0; t < NT; t++) local_grad(w[t], t, idx, got, gr[t]); /* forward and backward */
        CHECK_OK(ddp_reducer_begin_backward(r), g);
        res = ddp_reducer_set_local_samples(r, got);
        for (t = NT - 1; t >= 0 && res == DDP_SUCCESS; t--) res = ddp_reducer_grad_ready(r, t);
        if (res == DDP_SUCCESS) res = ddp_reducer_end_backward(r);
        if (res == DDP_ERR_VIEW_CHANGED) continue; /* the pass is void */
        CHECK(res == DDP_SUCCESS, "rank %d: the pass failed: %s", rank, ddp_last_error(g));
        {
            char line[4096];
            size_t len = (size_t)snprintf(line, sizeof line, "P %llu %llu %llu %d %d %zu", (unsigned long long)st.epoch,
                                          (unsigned long long)st.step, (unsigned long long)pass_gen, pass_world, pass_rank, got);
            for (k = 0; k < got; k++) len += (size_t)snprintf(line + len, sizeof line - len, " %lld", (long long)idx[k]);
            log_line(fd, "%s\n", line);
        }
        res = ddp_ft_commit(g, &st);
        if (res == DDP_ERR_VIEW_CHANGED) continue;
        expected_end(fd, g, res);
        CHECK(res == DDP_SUCCESS, "rank %d: ddp_ft_commit: %s", rank, ddp_last_error(g));
        {
            double when = wall();
            for (t = 0; t < NT; t++) sgd(w[t], gr[t], COUNT[t]); /* with the averaged gradient */
            log_line(fd, "K %llu %llu %llu %d %.6f %016llx\n", (unsigned long long)st.epoch, (unsigned long long)(st.step - 1),
                     (unsigned long long)pass_gen, pass_world, when, (unsigned long long)weights_hash(w));
        }
        steps++;
    }
    snprintf(path, sizeof path, "%s/weights.%d", g_dir, rank);
    {
        FILE *f = fopen(path, "wb");
        CHECK(f, "open %s", path);
        for (t = 0; t < NT; t++) CHECK(fwrite(w[t], sizeof(float), COUNT[t], f) == COUNT[t], "write");
        fclose(f);
    }
    log_line(fd, "E %llu %d\n", (unsigned long long)steps, ddp_world_size(g));
    close(fd);
    ddp_sampler_free(&s);
    ddp_reducer_destroy(r);
    CHECK_OK(ddp_destroy(g), NULL);
    for (t = 0; t < NT; t++) free(w[t]), free(gr[t]);
    free(big);
    return 0;
}

/* ---- the parent's checks ---- */

typedef struct commit {
    int seen;
    uint64_t gen;
    int world;
    double when;
    uint64_t hash; /* of the weights after the step's update */
} commit;

/* The serial failure-free run in f64: each step's update is the mean of w - t(i) over its global batch. */
static void serial_replay(int r0, double *ref[NT]) {
    ddp_sampler s;
    ddp_sampler_desc sd = sampler_desc(r0);
    ddp_ft_step st;
    int64_t idx[256];
    size_t got, e, k;
    uint64_t G = (uint64_t)BATCH * (uint64_t)r0;
    int t;
    CHECK_OK(ddp_sampler_init(&s, &sd), NULL);
    for (t = 0; t < NT; t++)
        for (e = 0; e < COUNT[t]; e++) ref[t][e] = (double)(float)(0.1 * (double)e / (double)COUNT[t]);
    memset(&st, 0, sizeof st);
    st.world_size = 1;
    for (st.epoch = 0; st.epoch < (uint64_t)g_epochs; st.epoch++)
        for (st.step = 0;; st.step++) {
            CHECK_OK(ddp_sampler_step_batch(&s, &st, G, idx, &got), NULL);
            if (!got) break;
            for (t = 0; t < NT; t++)
                for (e = 0; e < COUNT[t]; e++) {
                    double sum = 0;
                    for (k = 0; k < got; k++) sum += ref[t][e] - target(idx[k], t, e);
                    ref[t][e] -= LR * (sum / (double)got);
                }
        }
    ddp_sampler_free(&s);
}

/* rank's share of a step in a view of `world` members (the sampler's position rule, through a 1-rank
   step call for each position: positions s*G + rank + j*world). */
static size_t share_of(ddp_sampler *s, uint64_t epoch, uint64_t step, int rank, int world, uint64_t G, int64_t *out) {
    ddp_ft_step st;
    size_t got;
    memset(&st, 0, sizeof st);
    st.epoch = epoch, st.step = step, st.rank = rank, st.world_size = world;
    CHECK_OK(ddp_sampler_step_batch(s, &st, G, out, &got), NULL);
    return got;
}

/* ---- G3 bit for bit: a serial f32 replay of the membership log ----
   The run's arithmetic is the same on every member, so one serial program can redo it operation for
   operation. Per committed step (the K lines: epoch, step, the view's gen and member count W; ranks are
   the members' indices in the view, checked against the data plane's in the worker):
   1. each view rank r's gradient, local_grad over its share (the sampler's position rule, which every
      logged P line is checked to equal; a member killed after its reduction but before its P line, whose
      step commits on the survivors' COMPLETE, has none) from the same f32 weights;
   2. the reducer's weight: set_local_samples all-reduces n_r exactly (i64) and sets
      grad_scale = (double)n_r / (double)N (src/reducer_pass.c:119); take_from copies the gradient into
      the bucket through copy_in_scaled (src/reducer_pass.c:153-157): zeros when the scale is 0.0, else
      (f32 -> f32) d = x * (float)scale in f32, a plain copy when the scale is 1.0 (src/dtype.c:211-222);
   3. the SUM all-reduce of each bucket (one per tensor: 1204, 164 and 28 bytes), whose order of f32 adds
      depends only on the transport and W, not on timing:
      - shared memory (DDP_TRANSPORT=auto: every view of this test is on one host; were /dev/shm
        unusable, ddp_init would warn and use TCP, and a view of 4 would fail here): at most 64 KiB
        (shm.c's one-shot size) the one-shot path, where every rank adds the ranks' inputs in rank
        order, ((c0 + c1) + c2) + c3 (src/shm.c:584-587);
      - TCP: at most 32 KiB (internal.h's RD_MAX_BYTES) recursive doubling (src/tcp.c:143-168): the first 2(W-p)
        ranks fold in pairs (p the largest power of two <= W), then log2(p) rounds combine (lower rank's
        block) + (higher rank's block): W = 4 gives (c0 + c1) + (c2 + c3), W = 3 (c0 + c1) + c2;
      the result is copied back unchanged (f32, no scaling after the sum: reducer_pass.c's give_back);
   4. sgd.
   The victims' weights are not needed: a joiner receives the members' bytes, and a member that dies
   contributed from the same weights as the others. The bucket sizes stay under both thresholds (a
   larger model would take shm's two-shot / single-copy paths, which start each slice at its owner, or
   TCP's ring, whose order is per chunk: also deterministic, but not replayed here). */
typedef char ft_buckets_are_small[COUNT_MAX * sizeof(float) <= ((size_t)32 << 10) ? 1 : -1];

/* TCP's recursive doubling on one element of W ranks' inputs, as src/tcp.c:143-168 runs it. */
static float rd_sum(const float *in, int W) {
    float buf[8], next[8];
    int p = 1, extra, r, me, mask;
    while (p * 2 <= W) p *= 2;
    extra = W - p;
    for (r = 0; r < W; r++) buf[r] = in[r];
    for (r = 1; r < 2 * extra; r += 2) buf[r] = buf[r - 1] + buf[r]; /* the fold: 2i -> 2i+1 */
    for (mask = 1; mask < p; mask <<= 1) {
        for (me = 0; me < p; me++) {
            int a = me < extra ? 2 * me + 1 : me + extra, b = (me ^ mask) < extra ? 2 * (me ^ mask) + 1 : (me ^ mask) + extra;
            next[a] = a < b ? buf[a] + buf[b] : buf[b] + buf[a];
        }
        for (me = 0; me < p; me++) {
            r = me < extra ? 2 * me + 1 : me + extra;
            buf[r] = next[r];
        }
    }
    return buf[extra ? 1 : 0]; /* (new rank 0's, which every rank ends with) */
}

/* The replay of check_run's committed steps c (every one of them seen: G2 checked it) into out (the
   tensors one after the other, as the weights files hold them); after each step its weights must hash as
   every member's did after that step (their K lines). tcp: the run's transport. */
static void membership_replay(commit (*c)[128], int n, int tcp, float *out, const char *what) {
    static float contrib[8][COUNT_MAX];
    ddp_sampler s;
    ddp_sampler_desc sd = sampler_desc(n);
    int64_t idx[8][64];
    size_t got[8], e, off;
    uint64_t G = (uint64_t)BATCH * (uint64_t)n, ep, stp;
    int t, r;
    float *w[NT];
    CHECK_OK(ddp_sampler_init(&s, &sd), NULL);
    for (t = 0, off = 0; t < NT; off += COUNT[t], t++) {
        w[t] = out + off;
        for (e = 0; e < COUNT[t]; e++) w[t][e] = (float)(0.1 * (double)e / (double)COUNT[t]);
    }
    for (ep = 0; ep < (uint64_t)g_epochs; ep++)
        for (stp = 0; stp < 128 && c[ep][stp].seen; stp++) {
            int W = c[ep][stp].world;
            int64_t N = 0;
            CHECK(W >= 1 && W <= 8, "a view of %d members", W);
            for (r = 0; r < W; r++) N += (int64_t)(got[r] = share_of(&s, ep, stp, r, W, G, idx[r]));
            for (t = 0; t < NT; t++) {
                float gsum[COUNT_MAX];
                for (r = 0; r < W; r++) { /* 1 and 2: the rank's gradient, weighted into its bucket */
                    double scale = (double)got[r] / (double)N;
                    local_grad(w[t], t, idx[r], got[r], contrib[r]);
                    for (e = 0; e < COUNT[t]; e++) contrib[r][e] = scale == 0.0 ? 0.0f : contrib[r][e] * (float)scale;
                }
                for (e = 0; e < COUNT[t]; e++) { /* 3: the all-reduce's order */
                    float in[8];
                    for (r = 0; r < W; r++) in[r] = contrib[r][e];
                    if (tcp) {
                        gsum[e] = rd_sum(in, W);
                    } else {
                        gsum[e] = in[0];
                        for (r = 1; r < W; r++) gsum[e] += in[r];
                    }
                }
                sgd(w[t], gsum, COUNT[t]); /* 4 */
            }
            CHECK(weights_hash(w) == c[ep][stp].hash, "%s: the weights after epoch %llu step %llu (view %llu, %d members) "
                  "differ from the membership log's f32 replay (%s order)", what, (unsigned long long)ep,
                  (unsigned long long)stp, (unsigned long long)c[ep][stp].gen, W, tcp ? "recursive doubling" : "shared "
                  "memory's rank");
        }
    ddp_sampler_free(&s);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Check one run's logs; returns the worst kill-to-commit latency in seconds (-1: no kill). */
static double check_run(const char *dir, int n, int nlogs, const int *codes, const char *what, double killed_at) {
    static commit c[MAX_EPOCHS][128];
    double *ref[NT], worst = -1;
    float *final0 = NULL;
    size_t total = 0, e;
    int i, t, survivors = 0;
    uint64_t G = (uint64_t)BATCH * (uint64_t)n, ep, stp;
    ddp_sampler s;
    ddp_sampler_desc sd = sampler_desc(n);
    memset(c, 0, sizeof c);
    for (t = 0; t < NT; t++) total += COUNT[t];
    CHECK_OK(ddp_sampler_init(&s, &sd), NULL);
    for (i = 0; i < nlogs; i++) {
        char path[600], line[8192];
        FILE *f;
        snprintf(path, sizeof path, "%s/log.%d", dir, i);
        f = fopen(path, "r");
        CHECK(f, "%s: no log from rank %d", what, i);
        while (fgets(line, sizeof line, f)) {
            unsigned long long a, b, gen, hash;
            int world, r, off = 0;
            size_t got, k;
            double when;
            if (sscanf(line, "K %llu %llu %llu %d %lf %llx", &a, &b, &gen, &world, &when, &hash) == 6) {
                commit *x;
                CHECK(a < (unsigned long long)g_epochs && b < 128, "%s: rank %d committed epoch %llu step %llu", what, i, a, b);
                x = &c[a][b];
                CHECK(!x->seen || (x->gen == gen && x->world == world), "%s: epoch %llu step %llu committed in view %llu "
                      "(%d members) and in view %llu (%d members)", what, a, b, (unsigned long long)x->gen, x->world, gen, world);
                CHECK(!x->seen || x->hash == hash, "%s: rank %d's weights after epoch %llu step %llu differ from another "
                      "member's", what, i, a, b);
                x->seen = 1, x->gen = gen, x->world = world, x->hash = hash;
                if (!x->when || when < x->when) x->when = when;
            } else if (sscanf(line, "P %llu %llu %llu %d %d %zu%n", &a, &b, &gen, &world, &r, &got, &off) == 6) {
                int64_t want[64], used[64];
                char *p = line + off;
                CHECK(got <= 64, "%s: a pass of %zu samples", what, got);
                for (k = 0; k < got; k++) used[k] = strtoll(p, &p, 10);
                CHECK(share_of(&s, a, b, r, world, G, want) == got, "%s: rank %d's pass of epoch %llu step %llu (view %llu, "
                      "rank %d of %d) used %zu samples", what, i, a, b, gen, r, world, got);
                for (k = 0; k < got; k++)
                    CHECK(want[k] == used[k], "%s: rank %d's pass of epoch %llu step %llu used sample %lld at %zu, its share "
                          "has %lld", what, i, a, b, (long long)used[k], k, (long long)want[k]);
            }
        }
        fclose(f);
        if (codes[i] == -SIGKILL) continue; /* lost */
        CHECK(codes[i] == 0, "%s: rank %d exited with %d", what, i, codes[i]);
        survivors++;
        {
            float *wts = (float *)malloc(total * sizeof(float));
            FILE *wf;
            snprintf(path, sizeof path, "%s/weights.%d", dir, i);
            CHECK(wts && (wf = fopen(path, "rb")) != NULL, "%s: rank %d wrote no weights", what, i);
            CHECK(fread(wts, sizeof(float), total, wf) == total, "%s: rank %d's weights are short", what, i);
            fclose(wf);
            if (!final0) final0 = wts;
            else {
                CHECK(memcmp(final0, wts, total * sizeof(float)) == 0, "%s: rank %d's final weights differ from another "
                      "survivor's", what, i);
                free(wts);
            }
        }
    }
    CHECK(survivors > 0 && final0, "%s: no survivor", what);
    /* G2: every epoch's committed steps cover its padded list once */
    for (ep = 0; ep < (uint64_t)g_epochs; ep++) {
        int64_t all[DATASET + 64], padded[DATASET + 64], one[64];
        size_t have = 0, plen = 0, k;
        ddp_ft_step st;
        memset(&st, 0, sizeof st);
        st.epoch = ep, st.world_size = 1;
        for (stp = 0;; stp++) {
            size_t got;
            st.step = stp;
            CHECK_OK(ddp_sampler_step_batch(&s, &st, G, padded + plen, &got), NULL);
            if (!got) break;
            plen += got;
            CHECK(c[ep][stp].seen, "%s: epoch %llu step %llu was never committed", what, (unsigned long long)ep,
                  (unsigned long long)stp);
            for (i = 0; i < c[ep][stp].world; i++) {
                size_t got2 = share_of(&s, ep, stp, i, c[ep][stp].world, G, one);
                for (k = 0; k < got2; k++) all[have++] = one[k];
            }
        }
        CHECK(!c[ep][stp].seen, "%s: epoch %llu has a committed step past its end", what, (unsigned long long)ep);
        qsort(all, have, sizeof *all, cmp_i64);
        qsort(padded, plen, sizeof *padded, cmp_i64);
        CHECK(have == plen && memcmp(all, padded, have * sizeof *all) == 0, "%s: epoch %llu: the committed samples "
              "(%zu) are not the epoch's padded list (%zu) once each", what, (unsigned long long)ep, have, plen);
        for (stp = 0; stp < 128; stp++)
            if (c[ep][stp].seen && killed_at > 0 && c[ep][stp].when > killed_at &&
                (worst < 0 || c[ep][stp].when - killed_at < worst))
                worst = c[ep][stp].when - killed_at;
    }
    /* G3: the serial replay */
    {
        size_t off = 0;
        double maxd = 0;
        for (t = 0; t < NT; t++) CHECK((ref[t] = (double *)malloc(COUNT[t] * sizeof(double))) != NULL, "malloc");
        serial_replay(n, ref);
        for (t = 0; t < NT; t++)
            for (e = 0; e < COUNT[t]; e++, off++) {
                double d = fabs((double)final0[off] - ref[t][e]);
                if (d > maxd) maxd = d;
            }
        CHECK(maxd <= 1e-5, "%s: the final weights differ from the serial replay by %.3g", what, maxd);
        for (t = 0; t < NT; t++) free(ref[t]);
    }
    /* G3 bit for bit: the membership log's replay (DDP_TRANSPORT, as the parent set it for the run: tcp,
       or auto, which puts these ranks of one host on shared memory) */
    {
        const char *tr = getenv("DDP_TRANSPORT");
        int tcp = tr && strcmp(tr, "tcp") == 0;
        float *rep = (float *)malloc(total * sizeof(float));
        size_t diff = 0, first = 0;
        CHECK(rep != NULL, "malloc");
        membership_replay(c, n, tcp, rep, what);
        for (e = 0; e < total; e++)
            if (memcmp(&rep[e], &final0[e], sizeof(float)) != 0 && !diff++) first = e;
        CHECK(diff == 0, "%s: the final weights differ from the membership log's f32 replay (%s order) in %zu of %zu "
              "elements, first at %zu: %.9g, the replay %.9g", what, tcp ? "recursive doubling" : "shared memory's rank",
              diff, total, first, (double)final0[first], (double)rep[first]);
        free(rep);
    }
    free(final0);
    ddp_sampler_free(&s);
    return worst;
}

/* Fork n ranks as tl_run_ranks does; once `victim` has logged `after` lines, wait `delay` s and send it
   `sig` (the time in *killed_at; 0 when it had finished already); SIGSTOP is followed by SIGCONT after
   cont_after s. codes as tl_run_ranks_status's. */
static void run_with_signal(int n, int victim, int after, double delay, int sig, double cont_after, int *codes,
                            double *killed_at) {
    pid_t pids[8];
    int status[8], i;
    char port[16], path[600];
    double deadline = tl_now() + 120;
    snprintf(port, sizeof port, "%d", tl_free_port());
    for (i = 0; i < n; i++) { /* the last round's logs */
        snprintf(path, sizeof path, "%s/log.%d", g_dir, i);
        unlink(path);
    }
    for (i = 0; i < n; i++) {
        pids[i] = tl_fork_rank(i, n, port, worker, NULL);
        status[i] = -1;
    }
    *killed_at = 0;
    snprintf(path, sizeof path, "%s/log.%d", g_dir, victim);
    for (;;) { /* the victim is training: it has logged `after` lines */
        FILE *f = fopen(path, "r");
        int lines = 0, ch;
        if (f) {
            while ((ch = fgetc(f)) != EOF) lines += ch == '\n';
            fclose(f);
        }
        if (lines >= after || tl_now() > deadline) break;
        usleep(1000);
    }
    usleep((useconds_t)(delay * 1e6));
    if (waitpid(pids[victim], &status[victim], WNOHANG) == 0) {
        status[victim] = -1;
        *killed_at = wall();
        kill(pids[victim], sig);
        if (sig == SIGSTOP) { /* resumed once the others went on without it */
            usleep((useconds_t)(cont_after * 1e6));
            kill(pids[victim], SIGCONT);
        }
    }
    tl_wait_ranks(pids, n, deadline, status, NULL);
    for (i = 0; i < n; i++) codes[i] = tl_exit_code(status[i]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* `rounds` rounds: 4 ranks (3 every third round), shared memory and TCP in turn, a random rank SIGKILLed
   from outside at a random moment of a longer run (40 epochs, 1 ms of compute a step). Prints the time
   from the kill to the survivors' next committed step: median and worst. */
static void random_rounds(int rounds, unsigned seed) {
    double lat[1000];
    int nlat = 0, round;
    srand(seed);
    g_epochs = 40;
    g_compute_us = 1000;
    unsetenv("DDP_FT_TEST_KILL");
    for (round = 0; round < rounds && round < 1000; round++) {
        int n = round % 3 == 2 ? 3 : 4, t = round % 2, victim = rand() % n, codes[8], i, killed = 0;
        double killed_at, worst, t0 = tl_now(), delay = (double)(rand() % 300) * 1e-3;
        char what[200];
        snprintf(what, sizeof what, "random round %d: %d ranks over %s, rank %d killed %.0f ms into training", round, n,
                 tl_transport_name(t), victim, delay * 1e3);
        setenv("DDP_TRANSPORT", tl_transport(t), 1);
        run_with_signal(n, victim, 3, delay, SIGKILL, 0, codes, &killed_at);
        for (i = 0; i < n; i++) killed += codes[i] == -SIGKILL;
        CHECK(killed == (killed_at > 0), "%s: %d rank(s) died by SIGKILL", what, killed);
        worst = check_run(g_dir, n, n, codes, what, killed_at);
        if (worst >= 0) lat[nlat++] = worst;
        printf("ok: %s; next commit %.1f ms after the kill (%.1f s)\n", what, worst * 1e3, tl_now() - t0);
        fflush(stdout);
    }
    if (nlat) {
        qsort(lat, (size_t)nlat, sizeof *lat, cmp_double);
        printf("kill to the survivors' next committed step over %d rounds: median %.1f ms, worst %.1f ms "
               "(each step computes 1 ms)\n", nlat, lat[nlat / 2] * 1e3, lat[nlat - 1] * 1e3);
    }
}

/* A member stopped (SIGSTOP), not killed: nothing closes. The others' collective gives up on it after
   suspect_seconds (1 s; the group's timeout is 30 s), the coordinator suspects it after suspect_seconds
   more and the rest go on without it; resumed (after 4 s, the others still training), it learns that it
   was left out and rejoins as a new member: admitted with the members' state (its log's J line), it
   finishes with their weights. */
static void stopped_member(void) {
    int codes[8], t;
    double when;
    for (t = getenv("TEST_QUICK") ? 1 : 0; t < 2; t++) { /* (the sanitizer runs: over TCP only) */
        char what[160], path[600], line[512];
        double t0 = tl_now();
        int rejoined = 0;
        FILE *f;
        snprintf(what, sizeof what, "4 ranks over %s, member 2 stopped for 4 s", tl_transport_name(t));
        setenv("DDP_TRANSPORT", tl_transport(t), 1);
        unsetenv("DDP_FT_TEST_KILL");
        g_epochs = 60, g_compute_us = 3000;
        run_with_signal(4, 2, 3, 0.05, SIGSTOP, 4.0, codes, &when);
        CHECK(codes[2] == 0, "%s: the stopped member exited with %d, not 0 (rejoined)", what, codes[2]);
        snprintf(path, sizeof path, "%s/log.2", g_dir);
        CHECK((f = fopen(path, "r")) != NULL, "%s: the stopped member's log", what);
        while (fgets(line, sizeof line, f)) rejoined += line[0] == 'J';
        fclose(f);
        CHECK(rejoined == 1, "%s: the stopped member said %d times that it rejoined", what, rejoined);
        check_run(g_dir, 4, 4, codes, what, when);
        printf("ok: %s: the others went on without it; resumed, it rejoined and finished with their weights (%.1f s)\n",
               what, tl_now() - t0);
        fflush(stdout);
    }
    g_epochs = 2, g_compute_us = 0;
}

/* A replacement: member 1 is killed at step 3; once it is gone a new process starts with DDP_FT_JOIN=1
   (as ddprun --ft restarts one) and must be admitted with the members' state, bit for bit: the checks of
   check_run then hold over 3 logs of members and the joiner's, whose final weights equal theirs. */
static void join_case(int t, size_t big, const char *also_kill, int joiner_killed) {
    pid_t pids[4];
    int status[4], codes[4], i, n = 3;
    char port[16], what[160], path[600];
    double t0 = tl_now(), deadline = tl_now() + 120;
    double admitted_after = -1;
    char spec[128];
    snprintf(what, sizeof what, "3 ranks over %s, member 1 killed at step 3 and replaced by a joiner%s%s%s", tl_transport_name(t),
             big ? " (64 MiB of state)" : "", also_kill ? ", then killed: " : "", also_kill ? also_kill : "");
    snprintf(spec, sizeof spec, "1:3:begin%s%s", also_kill ? "," : "", also_kill ? also_kill : "");
    g_big = big;
    snprintf(port, sizeof port, "%d", tl_free_port());
    setenv("DDP_TRANSPORT", tl_transport(t), 1);
    setenv("DDP_FT_TEST_KILL", spec, 1);
    g_epochs = 20, g_compute_us = 1000;
    for (i = 0; i <= n; i++) {
        snprintf(path, sizeof path, "%s/log.%d", g_dir, i);
        unlink(path);
    }
    for (i = 0; i <= n; i++) {
        status[i] = -1;
        if (i < n) {
            pids[i] = tl_fork_rank(i, n, port, worker, NULL);
            continue;
        }
        CHECK(waitpid(pids[1], &status[1], 0) == pids[1], "waitpid"); /* the replacement, once the victim is gone */
        setenv("DDP_FT_JOIN", "1", 1); /* (its stable id will be 3: the spec may name it) */
        setenv("FT_TEST_LOG", "3", 1);
        if (!joiner_killed) unsetenv("DDP_FT_TEST_KILL");
        pids[n] = tl_fork_rank(1, n, port, worker, NULL);
        unsetenv("DDP_FT_JOIN");
        unsetenv("FT_TEST_LOG");
    }
    tl_wait_ranks(pids, n + 1, deadline, status, NULL);
    for (i = 0; i <= n; i++) codes[i] = tl_exit_code(status[i]);
    CHECK(codes[1] == -SIGKILL && codes[n] == (joiner_killed ? -SIGKILL : 0), "%s: the victim ended with %d, the joiner "
          "with %d", what, codes[1], codes[n]);
    for (i = 0; i < n; i++)
        CHECK(codes[i] == 0 || i == 1 || (also_kill && codes[i] == -SIGKILL && also_kill[0] == '0' + i), "%s: rank %d ended "
              "with %d", what, i, codes[i]);
    check_run(g_dir, n, n + 1, codes, what, -1);
    if (!joiner_killed) {
        FILE *f;
        char line[512];
        int joined = 0;
        snprintf(path, sizeof path, "%s/log.%d", g_dir, n);
        CHECK((f = fopen(path, "r")) != NULL, "the joiner's log");
        while (fgets(line, sizeof line, f))
            if (line[0] == 'J') {
                const char *last = strrchr(line, ' ');
                joined++;
                admitted_after = last ? atof(last + 1) : -1;
            }
        fclose(f);
        CHECK(joined == 1, "%s: the joiner said %d times that it joined", what, joined);
    }
    unsetenv("DDP_FT_TEST_KILL");
    g_epochs = 2, g_compute_us = 0, g_big = 0;
    if (joiner_killed) printf("ok: %s (%.1f s)\n", what, tl_now() - t0);
    else printf("ok: %s; admitted %.0f ms after the joiner's start (%.1f s)\n", what, admitted_after * 1e3, tl_now() - t0);
    fflush(stdout);
}

/* Misuse: the calls without fault tolerance; backends and stages it refuses. */
static int errors_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_init_desc desc;
    ddp_ft_step st;
    ddp_reducer *r = NULL;
    ddp_reducer_desc rd;
    (void)n, (void)arg;
    memset(&st, 0, sizeof st);
    memset(&desc, 0, sizeof desc);
    CHECK_OK(ddp_init(&desc, &g), NULL);
    CHECK(ddp_ft_begin(g, &st) == DDP_ERR_STATE && strstr(ddp_last_error(g), "fault tolerance is off"),
          "ddp_ft_begin without fault tolerance: %s", ddp_last_error(g));
    CHECK(ddp_ft_commit(g, &st) == DDP_ERR_STATE, "ddp_ft_commit without fault tolerance");
    CHECK(ddp_ft_register(g, "w", &st, sizeof st) == DDP_ERR_STATE, "ddp_ft_register without fault tolerance");
    CHECK_OK(ddp_destroy(g), NULL);
    desc.fault_tolerant = 1;
    desc.backend = "mpi";
    CHECK(ddp_init(&desc, &g) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(NULL), "cpu and nccl backends"),
          "fault tolerance on mpi: %s", ddp_last_error(NULL));
    desc.backend = NULL;
    desc.min_world_size = -1;
    CHECK(ddp_init(&desc, &g) == DDP_ERR_INVALID_ARGUMENT, "min_world_size -1");
    desc.min_world_size = 0;
    CHECK_OK(ddp_init(&desc, &g), NULL);
    CHECK(ddp_ft_commit(g, &st) == DDP_ERR_STATE && strstr(ddp_last_error(g), "ddp_ft_begin first"), "commit first");
    CHECK(ddp_ft_begin(g, NULL) == DDP_ERR_INVALID_ARGUMENT, "NULL step");
    memset(&rd, 0, sizeof rd);
    rd.zero_stage = 1;
    CHECK(ddp_reducer_create(g, &rd, &r) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(g), "fault-tolerant"),
          "zero_stage 1 in fault-tolerant mode: %s", ddp_last_error(g));
    CHECK(ddp_ft_register(g, "", &st, sizeof st) == DDP_ERR_INVALID_ARGUMENT, "an empty name");
    CHECK(ddp_ft_register(g, "w", NULL, 8) == DDP_ERR_INVALID_ARGUMENT, "NULL data");
    CHECK_OK(ddp_ft_register(g, "w", &st, sizeof st), g);
    CHECK(ddp_ft_register(g, "w", &st, sizeof st) == DDP_ERR_INVALID_ARGUMENT, "a name twice");
    CHECK_OK(ddp_ft_begin(g, &st), g);
    CHECK(ddp_ft_register(g, "late", &st, sizeof st) == DDP_ERR_STATE && strstr(ddp_last_error(g), "before the first"),
          "registration after the first ddp_ft_begin: %s", ddp_last_error(g));
    CHECK(st.rank == rank && st.world_size == 2 && st.gen == 0 && !st.joined, "the first view");
    CHECK_OK(ddp_ft_commit(g, &st), g);
    CHECK(st.step == 1, "the step moved on");
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* min_world_size 3 on 3 ranks: a loss leaves too few, and the survivors fail saying so (exit 4 here). */
static void min_world_case(void) {
    int codes[8];
    setenv("DDP_TRANSPORT", "auto", 1);
    setenv("DDP_FT_TEST_KILL", "1:2:bucket", 1);
    setenv("DDP_FT_MIN_WORLD_SIZE", "3", 1);
    tl_run_ranks_status(3, worker, NULL, 60, codes);
    CHECK(codes[0] == 4 && codes[1] == -SIGKILL && codes[2] == 4, "min_world_size 3: the ranks ended with %d, %d, %d",
          codes[0], codes[1], codes[2]);
    unsetenv("DDP_FT_MIN_WORLD_SIZE");
    unsetenv("DDP_FT_TEST_KILL");
    printf("ok: min_world_size 3 on 3 ranks, one killed: the survivors fail with DDP_ERR_PEER_LOST saying so\n");
}

static void errors(void) {
    setenv("DDP_TRANSPORT", "auto", 1);
    unsetenv("DDP_FT_TEST_KILL");
    CHECK(tl_run_ranks(2, errors_main, NULL, 60) == 0, "errors failed");
    printf("ok: errors\n");
}

typedef struct ft_case {
    const char *name;
    const char *kill; /* DDP_FT_TEST_KILL, NULL: none */
    int victims;
} ft_case;

int main(int argc, char **argv) {
    static const ft_case CASES[] = {
        {"no failure", NULL, 0},
        {"member 1 killed at begin of step 3", "1:3:begin", 1},
        {"member 2 killed mid-bucket in step 5", "2:5:bucket", 1},
        {"member 1 killed before its vote in step 4", "1:4:vote", 1},
        {"the coordinator (0) killed mid-bucket in step 2", "0:2:bucket", 1},
        {"member 2 killed mid-bucket, then member 1 while reporting, step 6", "2:6:bucket,1:6:report", 2},
        {"member 2 killed mid-bucket, then the coordinator while deciding, step 7", "2:7:bucket,0:7:decide", 2},
    };
    int sizes[2] = {3, 4}, k, t, ci;
    char dir[] = "/tmp/test_ft.XXXXXX";
    signal(SIGPIPE, SIG_IGN);
    CHECK(mkdtemp(dir), "mkdtemp");
    g_dir = dir;
    if (argc >= 2 && strcmp(argv[1], "--join") == 0) { /* only the replacement cases */
        join_case(0, 0, NULL, 0);
        join_case(1, 0, NULL, 0);
        join_case(0, 0, "0:*:transfer", 0);
        join_case(1, 0, "3:*:transfer", 1);
        join_case(0, (size_t)64 << 20, NULL, 0);
        join_case(1, (size_t)64 << 20, NULL, 0);
        tl_rm_dir(dir);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "--random") == 0) { /* FT_ROUNDS: tests/README.md */
        random_rounds(atoi(argv[2]), argc >= 4 ? (unsigned)atoi(argv[3]) : (unsigned)time(NULL));
        tl_rm_dir(dir);
        return 0;
    }
    for (t = 0; t < 2; t++)
        for (k = getenv("TEST_QUICK") ? 1 : 0; k < 2; k++) /* (the sanitizer runs: 4 ranks only) */
            for (ci = 0; ci < (int)(sizeof CASES / sizeof CASES[0]); ci++) {
                const ft_case *fc = &CASES[ci];
                int codes[8], n = sizes[k], i, killed = 0;
                char what[256];
                double t0 = tl_now(), worst;
                if (fc->victims >= n - 1) continue;
                snprintf(what, sizeof what, "%d ranks over %s, %s", n, tl_transport_name(t), fc->name);
                setenv("DDP_TRANSPORT", tl_transport(t), 1);
                if (fc->kill) setenv("DDP_FT_TEST_KILL", fc->kill, 1);
                else unsetenv("DDP_FT_TEST_KILL");
                tl_run_ranks_status(n, worker, NULL, 120, codes);
                for (i = 0; i < n; i++) killed += codes[i] == -SIGKILL;
                CHECK(killed == fc->victims, "%s: %d rank(s) died by SIGKILL, expected %d", what, killed, fc->victims);
                worst = check_run(dir, n, n, codes, what, -1);
                (void)worst;
                printf("ok: %s (%.1f s)\n", what, tl_now() - t0);
                fflush(stdout);
            }
    join_case(0, 0, NULL, 0);
    join_case(1, 0, NULL, 0);
    join_case(1, 0, "0:*:transfer", 0);
    join_case(0, 0, "3:*:transfer", 1);
    join_case(0, getenv("TEST_QUICK") ? 0 : (size_t)64 << 20, NULL, 0);
    stopped_member();
    min_world_case();
    errors();
    random_rounds(getenv("FT_ROUNDS") ? atoi(getenv("FT_ROUNDS")) : getenv("TEST_QUICK") ? 2 : 6, (unsigned)time(NULL));
    tl_rm_dir(dir);
    return 0;
}
