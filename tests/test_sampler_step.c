/* ddp_sampler_step_batch: the step-indexed batch of fault-tolerant training (src/ft.h, src/sampler.h).
   References, each independent of the step code:
   - torch's order: with the first view's W = R0 ranks and G = B*R0, rank r's share of step s must be its
     per-rank batch s, indices [s*B, (s+1)*B) of ddp_sampler_indices (compared with torch 1.13 itself in
     tests/test_interop_sampler.sh, which also runs this path on the recorded cases);
   - the epoch's dealt-out list written out here from the 1-replica permutation and torch's padding rule
     (REFERENCE.md): survivors (W < R0) and joiners (W > R0) must take exactly positions s*G + r + j*W,
     a step's global batch must be the failure-free run's, and over an epoch, with the view changing
     between steps and steps redone, the committed indices must be the list itself (as a multiset);
   - the memory held (testlib.h's allocation hooks), failing allocations, wide entries, argument errors. */
#define TL_ALLOC_HOOKS
#include "testlib.h"

#include "sampler_indices.h"

/* A case: the sampler's descriptor (num_replicas is R0) and the epoch. */
typedef struct step_case {
    ddp_sampler_desc d;
    uint64_t epoch;
} step_case;

static ddp_ft_step step_of(uint64_t epoch, uint64_t step, int rank, int world) {
    ddp_ft_step st;
    memset(&st, 0, sizeof st);
    st.epoch = epoch;
    st.step = step;
    st.rank = rank;
    st.world_size = world;
    return st;
}

static char *case_text(const step_case *c, uint64_t g) {
    static char text[256];
    snprintf(text, sizeof text, "N=%llu R0=%d G=%llu seed=%llu epoch=%llu%s%s%s perm=%d",
             (unsigned long long)c->d.dataset_size, c->d.num_replicas, (unsigned long long)g,
             (unsigned long long)c->d.seed, (unsigned long long)c->epoch, c->d.drop_last ? " drop_last" : "",
             c->d.no_shuffle ? " no_shuffle" : "", c->d.mode == DDP_SAMPLER_EVAL ? " eval" : "", (int)c->d.permutation);
    return text;
}


/* The epoch's dealt-out list, written out from torch's rules (caller frees): the permutation (the list of
   a 1-replica sampler without drop_last, which is perm itself), repeated to total_size = num_samples * R0
   with num_samples = ceil(N / R0), or floor with drop_last; eval mode: perm alone. */
static int64_t *padded_of(const step_case *c, uint64_t *len) {
    ddp_sampler_desc one = c->d;
    uint64_t n = c->d.dataset_size, r = (uint64_t)c->d.num_replicas, count, j;
    int64_t *perm, *padded;
    one.num_replicas = 1;
    one.rank = 0;
    one.drop_last = 0;
    one.mode = DDP_SAMPLER_TORCH;
    perm = indices_of(&one, c->epoch, &count);
    CHECK(count == n, "the permutation has N entries");
    if (c->d.mode == DDP_SAMPLER_EVAL) *len = n;
    else *len = (c->d.drop_last ? n / r : (n + r - 1) / r) * r;
    padded = (int64_t *)malloc((size_t)(*len ? *len : 1) * sizeof *padded);
    CHECK(padded, "malloc");
    for (j = 0; j < *len; j++) padded[j] = perm[j % n];
    free(perm);
    return padded;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

/* ---- torch's order on the first view ---- */

/* Every rank r of R0, every step: the share equals the per-rank list's batch [s*B, (s+1)*B). Each rank's
   list comes from a sampler of its own (ddp_sampler_indices), or, in `mixed` cases, from the very sampler
   that step_batch uses, read in between (the whole permutation and the rank's share take turns in it). */
static uint64_t torch_order_case(const step_case *c, uint64_t b, int mixed) {
    uint64_t r0 = (uint64_t)c->d.num_replicas, g = b * r0, checked = 0, r;
    int64_t *share = (int64_t *)malloc((size_t)b * sizeof *share);
    CHECK(share, "malloc");
    for (r = 0; r < r0; r++) {
        ddp_sampler_desc d = c->d;
        ddp_sampler s;
        uint64_t count, step, steps, k;
        int64_t *list;
        size_t n;
        d.rank = (int)r;
        list = indices_of(&d, c->epoch, &count);
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        /* ceil(L / G): L = num_samples * R0, or N in eval mode */
        steps = ceil_div(c->d.mode == DDP_SAMPLER_EVAL ? c->d.dataset_size : ddp_sampler_num_samples(&s) * r0, g);
        for (step = 0;; step++) {
            ddp_ft_step st = step_of(c->epoch, step, (int)r, (int)r0);
            uint64_t want = step * b < count ? DDP__MIN(b, count - step * b) : 0;
            if (mixed && step % 2 == 1) { /* this rank's share of the same epoch, or of another, in the shard */
                int64_t x;
                ddp_sampler_set_epoch(&s, step % 4 == 1 ? c->epoch : c->epoch + step);
                if (ddp_sampler_num_samples(&s) > 0) {
                    CHECK_OK(ddp_sampler_index_at(&s, count - 1, &x), NULL);
                    CHECK(step % 4 != 1 || x == list[count - 1], "%s: index_at between steps", case_text(c, g));
                }
            }
            CHECK_OK(ddp_sampler_step_batch(&s, &st, g, share, &n), NULL);
            CHECK(n == want, "%s B=%llu rank %llu step %llu: %zu indices, torch's batch has %llu", case_text(c, g),
                  (unsigned long long)b, (unsigned long long)r, (unsigned long long)step, n, (unsigned long long)want);
            for (k = 0; k < n; k++)
                CHECK(share[k] == list[step * b + k], "%s B=%llu rank %llu step %llu: index %llu is %lld, torch's %lld",
                      case_text(c, g), (unsigned long long)b, (unsigned long long)r, (unsigned long long)step,
                      (unsigned long long)k, (long long)share[k], (long long)list[step * b + k]);
            checked += n;
            if (step >= steps) break;
        }
        CHECK(n == 0, "%s: the share is empty from step ceil(L / G) = %llu on", case_text(c, g), (unsigned long long)steps);
        ddp_sampler_free(&s);
        free(list);
    }
    free(share);
    return checked;
}

static step_case random_case(uint64_t *rng, uint64_t max_n) {
    step_case c;
    uint64_t kind = tl_rand(rng) % 10;
    c.d = desc_of(tl_rand(rng) % max_n, 1 + (int)(tl_rand(rng) % 9), 0, tl_rand(rng));
    if (kind == 0) c.d.dataset_size = tl_rand(rng) % 4;  /* 0 and 1 included */
    if (kind == 1) { /* N < R0 */
        c.d.dataset_size = tl_rand(rng) % 20;
        c.d.num_replicas = (int)(c.d.dataset_size + 1 + tl_rand(rng) % 4);
    }
    c.d.mode = tl_rand(rng) % 5 == 0 ? DDP_SAMPLER_EVAL : DDP_SAMPLER_TORCH;
    c.d.drop_last = c.d.mode == DDP_SAMPLER_TORCH && tl_rand(rng) % 3 == 0;
    c.d.no_shuffle = tl_rand(rng) % 6 == 0;
    c.d.permutation = (ddp_sampler_permutation)(tl_rand(rng) % 3);
    c.epoch = tl_rand(rng) % 3 == 0 ? tl_rand(rng) : tl_rand(rng) % 5;
    return c;
}

static void test_torch_order(void) {
    uint64_t rng = 39, trial, indices = 0;
    double t0 = tl_now();
    for (trial = 0; trial < 1000; trial++) {
        step_case c = random_case(&rng, trial < 300 ? 30 : 2000);
        uint64_t b = 1 + tl_rand(&rng) % (trial % 4 == 0 ? 3 : 40);
        indices += torch_order_case(&c, b, trial % 5 == 3);
    }
    printf("torch's order: 1000 cases (N < 2000, R0 1..9, B 1..40, every mode and permutation), every rank's share "
           "of every step is its per-rank batch (%llu indices, %.2f s)\n", (unsigned long long)indices, tl_now() - t0);
}

/* ---- any view size: survivors and joiners ---- */

/* One step on a view of W: every rank's share, checked against the positions s*G + r + j*W of the list;
   the shares' sizes add up to the step's and differ by at most one. Adds what was handed out to `taken`
   (per position, when `commit`) and returns the step's size (0 past the epoch's end). */
static uint64_t view_step(ddp_sampler *s, const step_case *c, const int64_t *padded, uint64_t len, uint64_t g, uint64_t step,
                          int w, int64_t *share, unsigned *taken, int commit) {
    uint64_t want_total = step < ceil_div(len, g) ? DDP__MIN(g, len - step * g) : 0, total = 0, k;
    size_t n, least = SIZE_MAX, most = 0;
    int r;
    for (r = 0; r < w; r++) {
        ddp_ft_step st = step_of(c->epoch, step, r, w);
        CHECK_OK(ddp_sampler_step_batch(s, &st, g, share, &n), NULL);
        CHECK(n <= ceil_div(g, (uint64_t)w), "%s W=%d: %zu indices, more than ceil(G / W)", case_text(c, g), w, n);
        for (k = 0; k < n; k++) {
            uint64_t pos = step * g + (uint64_t)r + k * (uint64_t)w;
            CHECK(pos < len && share[k] == padded[pos], "%s W=%d step %llu rank %d: index %llu is %lld, position %llu "
                  "holds %lld", case_text(c, g), w, (unsigned long long)step, r, (unsigned long long)k, (long long)share[k],
                  (unsigned long long)pos, pos < len ? (long long)padded[pos] : -1LL);
            if (commit) taken[pos]++;
        }
        total += n;
        least = DDP__MIN(least, n);
        most = DDP__MAX(most, n);
    }
    CHECK(total == want_total, "%s W=%d step %llu: %llu indices over the ranks, the step has %llu", case_text(c, g), w,
          (unsigned long long)step, (unsigned long long)total, (unsigned long long)want_total);
    CHECK(most - least <= 1, "%s W=%d step %llu: shares of %zu and %zu", case_text(c, g), w, (unsigned long long)step,
          least, most);
    return total;
}

/* A whole epoch with the view changing between steps: each step runs on a view size drawn from `sizes`
   (R0 itself, survivors below it, joiners above), sometimes first on another view whose step is abandoned
   (a REDO: nothing of it committed). Every position must be committed exactly once: the committed indices
   are the dealt-out list, as a multiset, and each step's global batch is the failure-free run's. */
static void epoch_case(const step_case *c, uint64_t g, const int *sizes, int nsizes, uint64_t *rng) {
    ddp_sampler s;
    uint64_t len, step, steps, j;
    int64_t *padded = padded_of(c, &len), *share = (int64_t *)malloc((size_t)g * sizeof *share);
    unsigned *taken = (unsigned *)calloc((size_t)(len ? len : 1), sizeof *taken);
    CHECK(share && taken, "malloc");
    CHECK_OK(ddp_sampler_init(&s, &c->d), NULL);
    steps = ceil_div(len, g);
    for (step = 0; step <= steps; step++) {
        int w = sizes[tl_rand(rng) % (uint64_t)nsizes], abandoned = sizes[tl_rand(rng) % (uint64_t)nsizes];
        if (tl_rand(rng) % 4 == 0) view_step(&s, c, padded, len, g, step, abandoned, share, taken, 0);
        view_step(&s, c, padded, len, g, step, w, share, taken, 1);
    }
    for (j = 0; j < len; j++)
        CHECK(taken[j] == 1, "%s: position %llu committed %u times", case_text(c, g), (unsigned long long)j, taken[j]);
    ddp_sampler_free(&s);
    free(padded);
    free(share);
    free(taken);
}

static void test_views(void) {
    uint64_t rng = 3939, trial;
    double t0 = tl_now();
    for (trial = 0; trial < 1000; trial++) {
        step_case c = random_case(&rng, trial < 300 ? 40 : 3000);
        int r0 = c.d.num_replicas, sizes[4];
        uint64_t g = 1 + tl_rand(&rng) % (trial % 3 == 0 ? 7 : 200);
        if (trial % 2 == 0) g = (uint64_t)r0 * (1 + tl_rand(&rng) % 30); /* B * R0, the usual choice */
        sizes[0] = r0;
        sizes[1] = r0 > 1 ? 1 + (int)(tl_rand(&rng) % (uint64_t)(r0 - 1)) : 1; /* survivors */
        sizes[2] = r0 + 1 + (int)(tl_rand(&rng) % 6);                            /* joiners */
        sizes[3] = 1;
        if (trial % 3 == 0) epoch_case(&c, g, &sizes[1], 1, &rng); /* one size for the whole epoch */
        else if (trial % 3 == 1) epoch_case(&c, g, &sizes[2], 1, &rng);
        else epoch_case(&c, g, sizes, 4, &rng);
    }
    printf("views: 1000 epochs (N < 3000, R0 1..9; whole epochs on survivors W < R0, on joiners W > R0, and views "
           "changing between steps with redone steps): every step's positions s*G + r + j*W, shares within one, "
           "every position committed once (%.2f s)\n", tl_now() - t0);
}

/* The scenario, spelled out: 4 ranks, per-rank batch 8 (G = 32), N = 1000; rank 2 dies during
   step 10, which the 3 survivors redo on the same 32 indices; a joiner makes 4 again from step 20. */
static void test_scenario(void) {
    step_case c;
    ddp_sampler s;
    uint64_t len, step, j, per_step[3] = {0, 0, 0};
    int64_t *padded, share[32];
    unsigned taken[1000] = {0};
    c.d = desc_of(1000, 4, 0, 7);
    c.epoch = 2;
    padded = padded_of(&c, &len);
    CHECK(len == 1000, "1000 divides by 4: no padding");
    CHECK_OK(ddp_sampler_init(&s, &c.d), NULL);
    for (step = 0; step < 32; step++) {
        int w = step < 10 ? 4 : step < 20 ? 3 : 4;
        if (step == 10) view_step(&s, &c, padded, len, 32, step, 4, share, taken, 0); /* abandoned */
        per_step[step < 10 ? 0 : step < 20 ? 1 : 2] += view_step(&s, &c, padded, len, 32, step, w, share, taken, 1);
    }
    CHECK(view_step(&s, &c, padded, len, 32, 32, 4, share, taken, 1) == 0, "ceil(1000 / 32) = 32 steps");
    for (j = 0; j < len; j++) CHECK(taken[j] == 1, "position %llu committed %u times", (unsigned long long)j, taken[j]);
    printf("scenario: 1000 samples, G = 32: steps 0-9 on 4 ranks (%llu), step 10 abandoned and redone on 3, steps "
           "10-19 on 3 (%llu), 20-31 on 4 with a joiner (%llu): every sample once\n", (unsigned long long)per_step[0],
           (unsigned long long)per_step[1], (unsigned long long)per_step[2]);
    ddp_sampler_free(&s);
    free(padded);
}

/* ---- the epoch, the sampler's own state, the ends of the range ---- */

/* step_batch follows st->epoch, whatever the sampler's epoch, and leaves the sampler's epoch and position
   alone; going back to an earlier epoch gives its order again. */
static void test_follows_step_epoch(void) {
    int perm;
    for (perm = 0; perm < 3; perm++) {
        step_case c;
        ddp_sampler s;
        uint64_t epochs[] = {5, 0, 5, 1u << 20, 1}, len, i, k;
        int64_t batch[4], share[12];
        size_t got, n;
        c.d = desc_of(500, 3, 0, 11);
        c.d.permutation = (ddp_sampler_permutation)perm;
        c.d.rank = 1;
        CHECK_OK(ddp_sampler_init(&s, &c.d), NULL);
        ddp_sampler_set_epoch(&s, 3);
        CHECK_OK(ddp_sampler_next_batch(&s, 4, batch, &got), NULL);
        for (i = 0; i < sizeof epochs / sizeof epochs[0]; i++) {
            ddp_ft_step st = step_of(epochs[i], 7, 2, 5);
            int64_t *padded;
            c.epoch = epochs[i];
            padded = padded_of(&c, &len);
            CHECK_OK(ddp_sampler_step_batch(&s, &st, 60, share, &n), NULL);
            CHECK(n == 12, "60 positions over 5 ranks");
            for (k = 0; k < n; k++)
                CHECK(share[k] == padded[7 * 60 + 2 + k * 5], "perm %d epoch %llu: index %llu", perm,
                      (unsigned long long)epochs[i], (unsigned long long)k);
            free(padded);
        }
        CHECK(ddp_sampler_epoch(&s) == 3 && ddp_sampler_position(&s) == 4, "the sampler's epoch and position unchanged");
        {
            int64_t x, *list;
            uint64_t count;
            list = indices_of(&c.d, 3, &count);
            CHECK_OK(ddp_sampler_next_batch(&s, 4, batch, &got), NULL);
            CHECK(got == 4 && memcmp(batch, list + 4, sizeof batch) == 0, "next_batch goes on with epoch 3's order");
            CHECK_OK(ddp_sampler_index_at(&s, 0, &x), NULL);
            CHECK(x == list[0], "index_at after step_batch");
            free(list);
        }
        ddp_sampler_free(&s);
    }
    printf("follows st->epoch (torch, legacy and streaming permutations; epochs 5, 0, 5, 2^20, 1 on a sampler set to "
           "epoch 3): the sampler's own epoch, position and order unchanged\n");
}

/* n = 0 from step ceil(L / G) on, up to step 2^64 - 1 (no overflow in step * G); G larger than the epoch:
   one step holds it all; N = 0: no step at all. */
static void test_range_ends(void) {
    step_case c;
    ddp_sampler s;
    uint64_t len, k, big[] = {33, 34, 1000, UINT64_MAX / 2, UINT64_MAX};
    int64_t *padded, share[103];
    size_t n, i;
    c.d = desc_of(101, 3, 0, 1); /* L = 102: one padding position */
    c.epoch = 0;
    padded = padded_of(&c, &len);
    CHECK(len == 102, "L");
    CHECK_OK(ddp_sampler_init(&s, &c.d), NULL);
    for (i = 0; i < sizeof big / sizeof big[0]; i++) {
        ddp_ft_step st = step_of(0, big[i], 0, 2);
        n = 7;
        CHECK_OK(ddp_sampler_step_batch(&s, &st, 3, share, &n), NULL);
        CHECK(n == (big[i] == 33 ? 2u : 0u), "step %llu of G = 3: %zu indices", (unsigned long long)big[i], n);
        if (big[i] < len) continue;
        st.step = 1;
        CHECK_OK(ddp_sampler_step_batch(&s, &st, big[i], share, &n), NULL);
        CHECK(n == 0, "step 1 of G = %llu >= L: empty", (unsigned long long)big[i]);
        st.step = 0;
        st.world_size = 1;
        CHECK_OK(ddp_sampler_step_batch(&s, &st, big[i], share, &n), NULL);
        CHECK(n == 102, "G >= L: step 0 holds the epoch, %zu", n);
        for (k = 0; k < n; k++) CHECK(share[k] == padded[k], "G >= L: position %llu", (unsigned long long)k);
    }
    ddp_sampler_free(&s);
    free(padded);
    c.d = desc_of(0, 2, 0, 0);
    CHECK_OK(ddp_sampler_init(&s, &c.d), NULL);
    {
        ddp_ft_step st = step_of(0, 0, 1, 3);
        n = 9;
        CHECK_OK(ddp_sampler_step_batch(&s, &st, 6, share, &n), NULL);
        CHECK(n == 0, "N = 0: no steps");
    }
    ddp_sampler_free(&s);
    printf("range: empty from step ceil(L / G) on, up to step 2^64 - 1 and G = 2^64 - 1; G >= L: one step\n");
}

/* ---- memory, failing allocations, wide entries ---- */

/* The torch permutation is kept whole (4 bytes per sample), made once per epoch (the old one freed before
   the next shuffle); streaming and no_shuffle allocate nothing; free releases it. A failing allocation is
   DDP_ERR_OUT_OF_MEMORY with *n = 0, and the next call works. */
static void test_memory(void) {
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(1000000, 8, 0, 1);
    ddp_ft_step st = step_of(0, 3, 5, 6);
    int64_t share[100];
    size_t live0 = tl_live_bytes, n;
    long allocs;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    tl_peak_bytes = tl_live_bytes;
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    CHECK(tl_live_bytes - live0 == 4000000 && tl_peak_bytes - live0 == 4000000, "the whole permutation, 4 bytes per "
          "sample, is kept: %zu bytes held, %zu at the peak", tl_live_bytes - live0, tl_peak_bytes - live0);
    allocs = tl_allocs;
    st.step = 4;
    st.rank = 0;
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    CHECK(tl_allocs == allocs, "the next step of the epoch shuffles nothing");
    st.epoch = 1;
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    CHECK(tl_peak_bytes - live0 == 4000000, "the next epoch's permutation replaces the old one");
    st.epoch = 2;
    tl_fail_allocs = 1;
    n = 5;
    CHECK(ddp_sampler_step_batch(&s, &st, 512, share, &n) == DDP_ERR_OUT_OF_MEMORY && n == 0,
          "a failing allocation: DDP_ERR_OUT_OF_MEMORY, *n = 0");
    CHECK(strstr(ddp_last_error(NULL), "ddp_sampler_step_batch: out of memory") != NULL, "the message: %s",
          ddp_last_error(NULL));
    tl_fail_allocs = 0;
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    CHECK(n == 86, "the next call works: %zu", n);
    ddp_sampler_free(&s);
    CHECK(tl_live_bytes == live0, "free releases the permutation");
    d.permutation = DDP_PERMUTATION_STREAMING;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    ddp_sampler_free(&s);
    d.permutation = DDP_PERMUTATION_TORCH;
    d.no_shuffle = 1;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 512, share, &n), NULL);
    ddp_sampler_free(&s);
    CHECK(tl_peak_bytes - live0 == 4000000 && tl_live_bytes == live0, "streaming and no_shuffle allocate nothing");
    printf("memory: the whole permutation (4 bytes per sample) kept per epoch; out of memory reported, then works\n");
}

/* Above N = 2^32 the permutation is held in uint64 entries: forced here at small N (a private field), the
   shares must not change. */
static void test_wide_entries(void) {
    uint64_t rng = 4242, trial;
    for (trial = 0; trial < 30; trial++) {
        step_case c = random_case(&rng, 3000);
        ddp_sampler narrow, wide;
        uint64_t g = 1 + tl_rand(&rng) % 100, step, k;
        int64_t *a = (int64_t *)malloc((size_t)g * sizeof *a), *b = (int64_t *)malloc((size_t)g * sizeof *b);
        int w = 1 + (int)(tl_rand(&rng) % 12);
        size_t na, nb;
        CHECK_OK(ddp_sampler_init(&narrow, &c.d), NULL);
        CHECK_OK(ddp_sampler_init(&wide, &c.d), NULL);
        wide.shard_wide = 1;
        for (step = 0; step < 5; step++) {
            ddp_ft_step st = step_of(c.epoch, step, (int)(step % (uint64_t)w), w);
            CHECK_OK(ddp_sampler_step_batch(&narrow, &st, g, a, &na), NULL);
            CHECK_OK(ddp_sampler_step_batch(&wide, &st, g, b, &nb), NULL);
            CHECK(na == nb, "the same count");
            for (k = 0; k < na; k++) CHECK(a[k] == b[k], "%s: wide entries change index %llu", case_text(&c, g),
                                           (unsigned long long)k);
        }
        ddp_sampler_free(&narrow);
        ddp_sampler_free(&wide);
        free(a);
        free(b);
    }
}

/* ---- bad arguments ---- */

static void expect_error(ddp_result got, const char *what, const char *needle, const size_t *n) {
    CHECK(got == DDP_ERR_INVALID_ARGUMENT, "%s: returned %d, expected DDP_ERR_INVALID_ARGUMENT", what, (int)got);
    CHECK(strstr(ddp_last_error(NULL), needle) != NULL, "%s: message \"%s\" should mention \"%s\"", what,
          ddp_last_error(NULL), needle);
    CHECK(!n || *n == 0, "%s: *n is 0 on error", what);
}

static void test_errors(void) {
    ddp_sampler s, zeroed;
    ddp_sampler_desc d = desc_of(100, 4, 0, 0);
    ddp_ft_step st = step_of(0, 0, 0, 4);
    int64_t share[64];
    size_t n = 9;
    memset(&zeroed, 0, sizeof zeroed);
    expect_error(ddp_sampler_step_batch(NULL, &st, 8, share, &n), "NULL sampler", "not initialised", &n);
    n = 9;
    expect_error(ddp_sampler_step_batch(&zeroed, &st, 8, share, &n), "zeroed sampler", "call ddp_sampler_init", &n);
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    n = 9;
    expect_error(ddp_sampler_step_batch(&s, NULL, 8, share, &n), "NULL st", "st is NULL", &n);
    n = 9;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, NULL, &n), "NULL idx", "idx is NULL (it needs room for", &n);
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, NULL), "NULL n", "n is NULL", NULL);
    n = 9;
    expect_error(ddp_sampler_step_batch(&s, &st, 0, share, &n), "G = 0", "global_batch is 0; it must be > 0", &n);
    CHECK(strstr(ddp_last_error(NULL), "B * 4 (num_replicas)") != NULL, "G = 0 says what to pass: %s", ddp_last_error(NULL));
    st.world_size = 0;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, &n), "world_size 0", "st->world_size is 0; it must be >= 1", &n);
    st.world_size = -3;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, &n), "world_size -3", "st->world_size is -3", &n);
    st.world_size = 4;
    st.rank = 4;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, &n), "rank 4 of 4", "st->rank is 4; it must be in [0, 3]", &n);
    st.rank = -1;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, &n), "rank -1", "st->rank is -1", &n);
    st.rank = 6;
    st.world_size = 7; /* a joiner's rank past R0 = 4 is fine */
    CHECK_OK(ddp_sampler_step_batch(&s, &st, 8, share, &n), NULL);
    CHECK(n == 1, "rank 6 of 7 takes position 6 of step 0's 8");
    ddp_sampler_free(&s);
    n = 9;
    expect_error(ddp_sampler_step_batch(&s, &st, 8, share, &n), "freed sampler", "not initialised", &n);
    printf("errors: NULL sampler, st, idx, n; zeroed and freed samplers; G = 0; world_size < 1; rank outside [0, W)\n");
}

int main(void) {
    double t0 = tl_now();
    test_torch_order();
    test_views();
    test_scenario();
    test_follows_step_epoch();
    test_range_ends();
    test_memory();
    test_wide_entries();
    test_errors();
    printf("test_sampler_step: all passed (%.2f s)\n", tl_now() - t0);
    return 0;
}
