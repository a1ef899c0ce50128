/* DistributedSampler tests that need no PyTorch (tests/test_interop_sampler.sh compares with torch 1.13).
   References: MT19937's published outputs; torch 1.13 outputs recorded here; DistributedSampler's padding
   and striding rewritten serially below; exhaustive and chi-square checks of the streaming permutation.
   Also: resume on another number of replicas (406 cases against the permutation); passes without
   set_epoch (torch's recorded order again, and the once-per-sampler warning captured from stderr); the
   memory the sampler holds (testlib.h's allocation hooks) and failing allocations. */
/* The library's allocations go through testlib.h's hooks, so the tests can see what the sampler holds
   (tl_live_bytes, tl_peak_bytes) and make its allocations fail (tl_fail_allocs). */
#define TL_ALLOC_HOOKS
#include "testlib.h"

#include "sampler_indices.h"


static void expect_indices(const ddp_sampler_desc *d, uint64_t epoch, const int64_t *want, uint64_t count) {
    uint64_t got_count, i;
    int64_t *got = indices_of(d, epoch, &got_count);
    CHECK(got_count == count, "n=%llu R=%d rank=%d: %llu indices, torch has %llu", (unsigned long long)d->dataset_size,
          d->num_replicas, d->rank, (unsigned long long)got_count, (unsigned long long)count);
    for (i = 0; i < count; i++)
        CHECK(got[i] == want[i], "n=%llu R=%d rank=%d seed=%llu epoch=%llu: index %llu is %lld, torch has %lld",
              (unsigned long long)d->dataset_size, d->num_replicas, d->rank, (unsigned long long)d->seed,
              (unsigned long long)epoch, (unsigned long long)i, (long long)got[i], (long long)want[i]);
    free(got);
}

/* stderr (fd 2, where the library logs) into a temporary file between capture_begin and capture_end. A
   CHECK that fails in between exits: capture_restore (atexit) then shows what was captured. */
static FILE *cap_tmp;
static int cap_saved = -1;

static void capture_restore(void) {
    char buf[4096];
    size_t n;
    if (cap_saved < 0) return;
    fflush(stderr);
    dup2(cap_saved, 2);
    close(cap_saved);
    cap_saved = -1;
    rewind(cap_tmp);
    while ((n = fread(buf, 1, sizeof buf, cap_tmp)) > 0) fwrite(buf, 1, n, stderr);
    fclose(cap_tmp);
}

static void capture_begin(void) {
    static int registered;
    if (!registered) atexit(capture_restore);
    registered = 1;
    fflush(stderr);
    cap_tmp = tmpfile();
    cap_saved = dup(2);
    CHECK(cap_tmp && cap_saved >= 0, "tmpfile / dup");
    CHECK(dup2(fileno(cap_tmp), 2) == 2, "dup2");
}

/* Ends the capture: how many times needle was written (needle NULL: how many bytes); text (cap bytes, may
   be NULL) receives the output. */
static int capture_end(char *text, size_t cap, const char *needle) {
    static char all[1 << 16];
    size_t n;
    int count = 0;
    const char *p;
    fflush(stderr);
    dup2(cap_saved, 2);
    close(cap_saved);
    cap_saved = -1;
    rewind(cap_tmp);
    n = fread(all, 1, sizeof all - 1, cap_tmp);
    all[n] = 0;
    fclose(cap_tmp);
    if (!needle) count = (int)n;
    else
        for (p = all; (p = strstr(p, needle)) != NULL; p += strlen(needle)) count++;
    if (text && cap) {
        n = DDP__MIN(n, cap - 1);
        memcpy(text, all, n);
        text[n] = 0;
    }
    return count;
}

/* MT19937 against its published outputs (init_genrand(5489): the C++ standard's std::mt19937 check value),
   and random64's word order against torch 1.13 (Tensor.random_(0, 2**62) draws random64()). */
static void test_mt19937(void) {
    static const uint32_t first[5] = {3499211612u, 581869302u, 3890346734u, 3586334585u, 545404204u};
    ddp__mt19937 g;
    uint32_t x = 0;
    int i;
    ddp__mt_seed(&g, 5489);
    for (i = 0; i < 5; i++) CHECK(ddp__mt_random(&g) == first[i], "MT19937(5489) output %d", i);
    ddp__mt_seed(&g, 5489);
    for (i = 0; i < 10000; i++) x = ddp__mt_random(&g);
    CHECK(x == 4123659995u, "MT19937(5489)'s 10000th output is %u, not 4123659995", x);
    ddp__mt_seed(&g, 0);
    CHECK((ddp__mt_random64(&g) & ((1ull << 62) - 1)) == 900450186894289455ull, "random64 word order");
    ddp__mt_seed(&g, (1ull << 32) + 5489); /* only the low 32 bits of the seed count */
    CHECK(ddp__mt_random(&g) == first[0], "seed's high bits must be ignored");
}

/* Outputs of torch 1.13 recorded with:
     g = torch.Generator(); g.manual_seed(s); torch.randperm(10, generator=g).tolist()
     list(DistributedSampler(ds, num_replicas, rank, seed=..., drop_last=...)) after set_epoch */
static void test_torch_recorded(void) {
    static const int64_t perm0[10] = {4, 1, 7, 5, 3, 9, 0, 8, 6, 2};
    static const int64_t perm7[10] = {5, 0, 3, 4, 1, 7, 9, 6, 8, 2};
    static const int64_t perm_m1[10] = {1, 4, 6, 2, 0, 5, 8, 7, 9, 3};
    static const int64_t r1[3] = {5, 6, 9}, r3_drop[2] = {1, 7}, tiny[1] = {1}, zero[1] = {0};
    ddp_sampler_desc d = desc_of(10, 1, 0, 0);
    expect_indices(&d, 0, perm0, 10);
    d.seed = 7;
    expect_indices(&d, 0, perm7, 10);
    d.seed = (1ull << 32) + 7; /* torch keeps the low 32 bits */
    expect_indices(&d, 0, perm7, 10);
    d.seed = 0;
    expect_indices(&d, 7, perm7, 10); /* seed + epoch */
    d.seed = (uint64_t)(int64_t)-1;  /* manual_seed(-1) wraps to 2^64 - 1 */
    expect_indices(&d, 0, perm_m1, 10);
    d.seed = UINT32_MAX;
    expect_indices(&d, 0, perm_m1, 10);
    d = desc_of(10, 4, 1, 5);
    expect_indices(&d, 3, r1, 3);
    d = desc_of(10, 4, 3, 5);
    d.drop_last = 1;
    expect_indices(&d, 3, r3_drop, 2);
    d = desc_of(3, 8, 7, 5); /* n < R: padding repeats the list */
    expect_indices(&d, 0, tiny, 1);
    d = desc_of(0, 3, 2, 0); /* torch: an empty dataset gives empty epochs */
    expect_indices(&d, 0, NULL, 0);
    d.drop_last = 1;
    expect_indices(&d, 0, NULL, 0);
    d = desc_of(1, 3, 2, 0);
    expect_indices(&d, 0, zero, 1);
    d.drop_last = 1;
    expect_indices(&d, 0, NULL, 0);
}

/* DistributedSampler's dealing, written from torch/utils/data/distributed.py over the R = 1 permutation
   (padding by repeating, drop_last cutting, striding), compared for many shapes and all ranks. */
static void test_dealing_matches_torch_rules(void) {
    uint64_t rng = 11, trial;
    for (trial = 0; trial < 300; trial++) {
        uint64_t n = tl_rand(&rng) % (trial < 100 ? 12 : 3000), seed = tl_rand(&rng), epoch = tl_rand(&rng) % 5;
        int replicas = 1 + (int)(tl_rand(&rng) % (trial % 3 == 0 ? 40 : 9)), drop_last = (int)(tl_rand(&rng) % 2);
        int no_shuffle = tl_rand(&rng) % 4 == 0, legacy = (int)(tl_rand(&rng) % 2), rank;
        ddp_sampler_desc d = desc_of(n, 1, 0, seed);
        uint64_t perm_count, num_samples, total, k;
        int64_t *perm;
        d.no_shuffle = no_shuffle;
        d.permutation = legacy ? DDP_PERMUTATION_TORCH_LEGACY : DDP_PERMUTATION_TORCH;
        perm = indices_of(&d, epoch, &perm_count);
        CHECK(perm_count == n, "R = 1 hands out all %llu indices", (unsigned long long)n);
        for (k = 0; no_shuffle && k < n; k++) CHECK(perm[k] == (int64_t)k, "no_shuffle is the identity");
        if (drop_last && n % (uint64_t)replicas != 0)
            num_samples = (n - (uint64_t)replicas + (uint64_t)replicas - 1) / (uint64_t)replicas; /* ceil((n-R)/R) */
        else
            num_samples = (n + (uint64_t)replicas - 1) / (uint64_t)replicas;
        if (drop_last && n < (uint64_t)replicas) num_samples = 0; /* ceil of a negative fraction above -1 */
        total = num_samples * (uint64_t)replicas;
        for (rank = 0; rank < replicas; rank++) {
            uint64_t count;
            int64_t *got;
            d.num_replicas = replicas;
            d.rank = rank;
            d.drop_last = drop_last;
            got = indices_of(&d, epoch, &count);
            CHECK(count == num_samples, "n=%llu R=%d drop_last=%d: num_samples %llu, torch's rule gives %llu",
                  (unsigned long long)n, replicas, drop_last, (unsigned long long)count, (unsigned long long)num_samples);
            for (k = 0; k < count; k++) {
                uint64_t j = (uint64_t)rank + k * (uint64_t)replicas;
                CHECK(j < total, "position inside total_size");
                CHECK(got[k] == perm[j % n], "n=%llu R=%d rank=%d drop_last=%d: index %llu", (unsigned long long)n,
                      replicas, rank, drop_last, (unsigned long long)k);
            }
            free(got);
        }
        d.num_replicas = 1;
        d.rank = 0;
        d.drop_last = 0;
        free(perm);
    }
}

/* Evaluation mode: across the ranks every index exactly once, shard sizes within one of each other, and
   each rank's order is the torch permutation's positions rank, rank + R, ... below n. */
static void test_eval_mode(void) {
    uint64_t rng = 23, trial;
    for (trial = 0; trial < 200; trial++) {
        uint64_t n = tl_rand(&rng) % (trial < 60 ? 10 : 5000), seed = tl_rand(&rng), k, total = 0;
        uint64_t min_count = UINT64_MAX, max_count = 0, perm_count;
        int replicas = 1 + (int)(tl_rand(&rng) % 17), rank;
        int permutation = (int)(tl_rand(&rng) % 3), no_shuffle = tl_rand(&rng) % 5 == 0;
        unsigned char *seen = (unsigned char *)calloc((size_t)n + 1, 1);
        ddp_sampler_desc d = desc_of(n, 1, 0, seed);
        int64_t *perm;
        d.permutation = (ddp_sampler_permutation)permutation;
        d.no_shuffle = no_shuffle;
        perm = indices_of(&d, 2, &perm_count);
        d.mode = DDP_SAMPLER_EVAL;
        d.num_replicas = replicas;
        for (rank = 0; rank < replicas; rank++) {
            uint64_t count;
            int64_t *got;
            d.rank = rank;
            got = indices_of(&d, 2, &count);
            for (k = 0; k < count; k++) {
                CHECK(got[k] >= 0 && (uint64_t)got[k] < n, "eval index in range");
                CHECK(!seen[got[k]], "n=%llu R=%d: index %lld handed out twice", (unsigned long long)n, replicas,
                      (long long)got[k]);
                seen[got[k]] = 1;
                CHECK(got[k] == perm[(uint64_t)rank + k * (uint64_t)replicas], "eval order follows the permutation");
            }
            total += count;
            min_count = DDP__MIN(min_count, count);
            max_count = DDP__MAX(max_count, count);
            free(got);
        }
        CHECK(total == n, "n=%llu R=%d: eval mode handed out %llu indices", (unsigned long long)n, replicas,
              (unsigned long long)total);
        CHECK(max_count - min_count <= 1, "eval shard sizes %llu .. %llu", (unsigned long long)min_count,
              (unsigned long long)max_count);
        free(seen);
        free(perm);
    }
}

/* Streaming permutation: a bijection of [0, n), exhaustively for small n, over several keys. */
static void test_streaming_is_permutation(void) {
    uint64_t n, e;
    for (n = 0; n <= 300; n++) {
        for (e = 0; e < 4; e++) {
            ddp_sampler_desc d = desc_of(n, 1, 0, n * 1000003u + e);
            unsigned char *seen = (unsigned char *)calloc((size_t)n + 1, 1);
            uint64_t count, k;
            int64_t *got;
            d.permutation = DDP_PERMUTATION_STREAMING;
            got = indices_of(&d, e, &count);
            CHECK(count == n, "streaming count");
            for (k = 0; k < n; k++) {
                CHECK(got[k] >= 0 && (uint64_t)got[k] < n && !seen[got[k]], "n=%llu: streaming is not a permutation",
                      (unsigned long long)n);
                seen[got[k]] = 1;
            }
            free(got);
            free(seen);
        }
    }
    { /* a larger, odd size: 2^20 + 3 (a domain of 2^21, so cycle walking is exercised) */
        ddp_sampler_desc d = desc_of((1u << 20) + 3, 1, 0, 99);
        uint64_t count, k, moved = 0;
        unsigned char *seen = (unsigned char *)calloc((size_t)d.dataset_size, 1);
        int64_t *got;
        d.permutation = DDP_PERMUTATION_STREAMING;
        got = indices_of(&d, 0, &count);
        for (k = 0; k < count; k++) {
            CHECK(!seen[got[k]], "2^20+3: duplicate");
            seen[got[k]] = 1;
            moved += got[k] != (int64_t)k;
        }
        CHECK(moved > count - count / 100, "the streaming permutation leaves %llu of %llu in place",
              (unsigned long long)(count - moved), (unsigned long long)count);
        free(got);
        free(seen);
    }
}

/* Upper critical value of chi-square with k degrees of freedom at p = 0.001 (Wilson-Hilferty). */
static double chi2_critical(double k) {
    double z = 3.090, a = 2.0 / (9.0 * k);
    return k * pow(1.0 - a + z * sqrt(a), 3.0);
}

/* Streaming permutation: where each element lands is spread evenly over the positions (chi-square on
   element x position counts over many keys; fixed keys, so the result is deterministic). */
static void test_streaming_chi_square(void) {
    static const uint64_t sizes[] = {2, 3, 5, 7, 8, 13, 64, 100, 1000};
    size_t si;
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        uint64_t n = sizes[si], keys = n <= 13 ? 4000 * n : n <= 100 ? 400 * n : 4000000 / n, key, k, bins = DDP__MIN(n, 10);
        double *count = (double *)calloc((size_t)(bins * bins), sizeof(double)), chi2 = 0, expected;
        for (key = 0; key < keys; key++) {
            ddp_sampler s;
            ddp_sampler_desc d = desc_of(n, 1, 0, key * 7919u);
            d.permutation = DDP_PERMUTATION_STREAMING;
            CHECK_OK(ddp_sampler_init(&s, &d), NULL);
            for (k = 0; k < n; k++) {
                int64_t x;
                CHECK_OK(ddp_sampler_index_at(&s, k, &x), NULL);
                count[(uint64_t)x * bins / n * bins + k * bins / n] += 1;
            }
            ddp_sampler_free(&s);
        }
        for (k = 0; k < bins * bins; k++) {
            /* cells are equal-sized only when bins divides n; use each cell's own expectation */
            uint64_t ex = k / bins, pos = k % bins;
            double rows = (double)((ex + 1) * n / bins + ((ex + 1) * n % bins != 0) - (ex * n / bins + (ex * n % bins != 0)));
            double cols = (double)((pos + 1) * n / bins + ((pos + 1) * n % bins != 0) - (pos * n / bins + (pos * n % bins != 0)));
            expected = (double)keys * rows * cols / (double)n;
            chi2 += (count[k] - expected) * (count[k] - expected) / expected;
        }
        CHECK(chi2 < chi2_critical((double)((bins - 1) * (bins - 1))),
              "n=%llu: positions are not spread evenly: chi-square %.1f over %llu cells (critical %.1f)",
              (unsigned long long)n, chi2, (unsigned long long)(bins * bins), chi2_critical((double)((bins - 1) * (bins - 1))));
        printf("streaming n=%llu: chi-square %.1f, %llu dof, critical (p=0.001) %.1f\n", (unsigned long long)n, chi2,
               (unsigned long long)((bins - 1) * (bins - 1)), chi2_critical((double)((bins - 1) * (bins - 1))));
        free(count);
    }
}

/* At a size far beyond any exhaustive check, the index at a fixed position is uniform over [0, n) across
   keys (100 equal bins), and the ranks' shards together still cover each position once per key. */
static void test_streaming_chi_square_huge(void) {
    const uint64_t n = 1000000007ull, keys = 2000, positions = 50;
    double count[100] = {0}, chi2 = 0, expected = (double)(keys * positions) / 100.0;
    uint64_t key, k;
    for (key = 0; key < keys; key++) {
        ddp_sampler s;
        ddp_sampler_desc d = desc_of(n, 1, 0, key);
        d.permutation = DDP_PERMUTATION_STREAMING;
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        for (k = 0; k < positions; k++) {
            int64_t x = -1;
            CHECK_OK(ddp_sampler_index_at(&s, k * 19999999u, &x), NULL);
            count[(uint64_t)x / (n / 100 + 1)] += 1;
        }
        ddp_sampler_free(&s);
    }
    for (k = 0; k < 100; k++) chi2 += (count[k] - expected) * (count[k] - expected) / expected;
    printf("streaming n=%llu: chi-square of values at fixed positions %.1f, 99 dof, critical %.1f\n",
           (unsigned long long)n, chi2, chi2_critical(99));
    CHECK(chi2 < chi2_critical(99), "n=%llu: values at fixed positions are uneven: chi-square %.1f",
          (unsigned long long)n, chi2);
}

/* Streaming at sizes no shuffle in memory could take: O(1) memory and random access. */
static void test_streaming_huge(void) {
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(1000000007ull, 8, 5, 42);
    int64_t x, batch[100];
    size_t got;
    uint64_t k;
    d.permutation = DDP_PERMUTATION_STREAMING;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK(ddp_sampler_num_samples(&s) == 125000001ull, "ceil(1000000007 / 8)");
    CHECK_OK(ddp_sampler_set_position(&s, 100000000), NULL);
    CHECK_OK(ddp_sampler_next_batch(&s, 100, batch, &got), NULL);
    CHECK(got == 100, "a full batch");
    for (k = 0; k < 100; k++) {
        CHECK_OK(ddp_sampler_index_at(&s, 100000000 + k, &x), NULL);
        CHECK(x == batch[k] && x >= 0 && x < 1000000007ll, "random access agrees with the iterator");
    }
    CHECK(s.shard == NULL, "the streaming permutation holds no memory");
    ddp_sampler_free(&s);
    d = desc_of((uint64_t)INT64_MAX, 1, 0, 1); /* the largest size there is */
    d.permutation = DDP_PERMUTATION_STREAMING;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK_OK(ddp_sampler_index_at(&s, (uint64_t)INT64_MAX - 1, &x), NULL);
    CHECK(x >= 0, "index in range");
    ddp_sampler_free(&s);
}

/* The batch iterator and resume agree with ddp_sampler_indices. */
static void test_batches_and_resume(void) {
    uint64_t rng = 5, trial;
    unsetenv("DDP_LOG_LEVEL"); /* the default level: the new pass below warns */
    for (trial = 0; trial < 60; trial++) {
        ddp_sampler_desc d = desc_of(tl_rand(&rng) % 2000, 1 + (int)(tl_rand(&rng) % 5), 0, tl_rand(&rng));
        ddp_sampler s;
        uint64_t count, pos = 0, k, stop;
        size_t batch = 1 + (size_t)(tl_rand(&rng) % 70), got;
        int64_t *all, *buf = (int64_t *)malloc(batch * sizeof(int64_t)), x;
        d.rank = (int)(tl_rand(&rng) % (uint64_t)d.num_replicas);
        d.permutation = (ddp_sampler_permutation)(tl_rand(&rng) % 3);
        d.mode = (ddp_sampler_mode)(tl_rand(&rng) % 2);
        all = indices_of(&d, 9, &count);
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        ddp_sampler_set_epoch(&s, 9);
        stop = count ? tl_rand(&rng) % (count + 1) : 0; /* "checkpoint" here */
        while (pos < stop) {
            CHECK_OK(ddp_sampler_next_batch(&s, DDP__MIN(batch, (size_t)(stop - pos)), buf, &got), NULL);
            for (k = 0; k < got; k++) CHECK(buf[k] == all[pos + k], "batch index");
            pos += got;
        }
        CHECK(ddp_sampler_position(&s) == stop, "position after %llu indices", (unsigned long long)stop);
        ddp_sampler_free(&s);
        /* a new process resumes: init, set_epoch, set_position */
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        ddp_sampler_set_epoch(&s, 9);
        CHECK_OK(ddp_sampler_set_position(&s, stop), NULL);
        for (;;) {
            CHECK_OK(ddp_sampler_next_batch(&s, batch, buf, &got), NULL);
            if (got == 0) break;
            CHECK(got == batch || pos + got == count, "only the last batch is short");
            for (k = 0; k < got; k++) CHECK(buf[k] == all[pos + k], "resumed batch index");
            pos += got;
        }
        CHECK(pos == count && ddp_sampler_position(&s) == count, "the epoch ends at num_samples");
        capture_begin(); /* without set_epoch: a new pass, the same order (torch's), one warning */
        CHECK_OK(ddp_sampler_next_batch(&s, batch, buf, &got), NULL);
        k = (uint64_t)capture_end(NULL, 0, "[ddp] warning");
        CHECK(k == (uint64_t)(d.dataset_size > 1), "n=%llu: %llu warnings about set_epoch", (unsigned long long)d.dataset_size,
              (unsigned long long)k);
        CHECK(got == DDP__MIN(batch, (size_t)count) && ddp_sampler_position(&s) == got, "a new pass from the start");
        for (k = 0; k < got; k++) CHECK(buf[k] == all[k], "the new pass repeats the order");
        for (k = 0; k < count; k += 1 + count / 7) {
            CHECK_OK(ddp_sampler_index_at(&s, k, &x), NULL);
            CHECK(x == all[k], "index_at");
        }
        ddp_sampler_set_epoch(&s, 10);
        CHECK(ddp_sampler_position(&s) == 0 && ddp_sampler_epoch(&s) == 10, "set_epoch restarts the epoch");
        if (count > 0) {
            CHECK_OK(ddp_sampler_next_batch(&s, batch, buf, &got), NULL);
            CHECK(got == DDP__MIN(batch, (size_t)count), "a new epoch hands out again");
        }
        ddp_sampler_free(&s);
        free(all);
        free(buf);
    }
}

/* Resume on another number of ranks (issue #21). R samplers consume k indices each in lockstep, rank 0's
   global position is saved, M fresh samplers resume the same epoch from it and finish it. Checked against
   the epoch's permutation (a 1-replica sampler, independent of the dealing): without drop_last every
   index at least once, and the repeats are exactly the padding torch would add (the first run's, if it
   reached its padding, plus fewer than M at the very end, repeating the epoch's first indices); with
   drop_last none twice and only the tail of the rest dropped; eval mode every index exactly once. With
   M = R the continuation is exactly the old samplers' remaining indices (torch's order). */
static void resize_case(uint64_t n, int from, int to, int drop_last, int mode, int perm_kind, int no_shuffle, uint64_t seed,
                        uint64_t epoch, uint64_t k, int verbose) {
    ddp_sampler_desc d = desc_of(n, 1, 0, seed);
    ddp_sampler *old = (ddp_sampler *)calloc((size_t)from, sizeof *old), s;
    uint64_t perm_count, *count = (uint64_t *)calloc((size_t)(n ? n : 1), sizeof *count), min_num = UINT64_MAX, g, c, i, kk;
    uint64_t extra = 0, want_extra, consumed, unseen = 0, r;
    int64_t *perm, *buf = (int64_t *)malloc((size_t)(n + 1) * sizeof *buf);
    size_t got;
    d.no_shuffle = no_shuffle;
    d.permutation = (ddp_sampler_permutation)perm_kind;
    perm = indices_of(&d, epoch, &perm_count); /* the epoch's permutation: one replica, no padding */
    CHECK(perm_count == n && old && count && buf, "setup");
    d.drop_last = drop_last;
    d.mode = (ddp_sampler_mode)mode;
    d.num_replicas = from;
    for (r = 0; r < (uint64_t)from; r++) {
        d.rank = (int)r;
        CHECK_OK(ddp_sampler_init(&old[r], &d), NULL);
        ddp_sampler_set_epoch(&old[r], epoch);
        min_num = DDP__MIN(min_num, ddp_sampler_num_samples(&old[r]));
    }
    if (k > min_num) k = min_num; /* lockstep: every rank takes k */
    for (r = 0; r < (uint64_t)from; r++) {
        consumed = 0;
        while (consumed < k) {
            CHECK_OK(ddp_sampler_next_batch(&old[r], (size_t)(k - consumed), buf, &got), NULL);
            for (i = 0; i < got; i++) count[buf[i]]++;
            consumed += got;
        }
    }
    g = ddp_sampler_global_position(&old[0]); /* what rank 0 saves */
    CHECK(g == (k == ddp_sampler_num_samples(&old[0]) ? n : k * (uint64_t)from), "n=%llu R=%d k=%llu: global position %llu",
          (unsigned long long)n, from, (unsigned long long)k, (unsigned long long)g);
    if (to == from) { /* the rest of the epoch, as the old samplers would have gone on: kept aside */
        for (r = 0; r < (uint64_t)from; r++) CHECK(ddp_sampler_position(&old[r]) == k, "old position");
    }
    d.num_replicas = to;
    for (r = 0; r < (uint64_t)to; r++) {
        uint64_t taken = 0;
        d.rank = (int)r;
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        CHECK_OK(ddp_sampler_resume(&s, epoch, g), NULL);
        for (;;) {
            CHECK_OK(ddp_sampler_next_batch(&s, 7, buf, &got), NULL);
            if (!got) break;
            for (i = 0; i < got; i++) {
                int64_t want;
                count[buf[i]]++;
                if (to == from) { /* the same world: the very indices torch's sampler gives from position k on */
                    size_t one;
                    CHECK_OK(ddp_sampler_next_batch(&old[r], 1, &want, &one), NULL);
                    CHECK(one == 1 && want == buf[i], "n=%llu R=M=%d rank %llu: resumed index %llu is %lld, the old sampler's %lld",
                          (unsigned long long)n, to, (unsigned long long)r, (unsigned long long)taken, (long long)buf[i], (long long)want);
                }
                taken++;
            }
            if (got < 7) break;
        }
        if (to == from) {
            int64_t x;
            CHECK_OK(ddp_sampler_next_batch(&old[r], 1, &x, &got), NULL);
            CHECK(got == 0, "the resumed sampler stopped before the old one");
        }
        CHECK(ddp_sampler_global_position(&s) == n, "a finished resumed sampler is at the epoch's end");
        ddp_sampler_set_epoch(&s, epoch + 1);
        d.num_replicas = to;
        ddp_sampler_free(&s);
    }
    /* the independent expectation, from the permutation alone */
    c = n - g;
    want_extra = k * (uint64_t)from > n ? k * (uint64_t)from - n : 0; /* the first run reached torch's padding */
    if (!drop_last && mode == 0 && c > 0) want_extra += (c + (uint64_t)to - 1) / (uint64_t)to * (uint64_t)to - c;
    for (i = 0; i < n; i++) {
        if (count[perm[i]] == 0) unseen++;
        else extra += count[perm[i]] - 1;
    }
    if (mode == 1) CHECK(unseen == 0 && extra == 0, "eval n=%llu %d->%d: %llu unseen, %llu repeats", (unsigned long long)n, from, to,
                         (unsigned long long)unseen, (unsigned long long)extra);
    else if (!drop_last) {
        CHECK(unseen == 0, "n=%llu %d->%d k=%llu: %llu indices of the epoch never handed out", (unsigned long long)n, from, to,
              (unsigned long long)k, (unsigned long long)unseen);
        CHECK(extra == want_extra, "n=%llu %d->%d k=%llu: %llu repeats, torch's padding is %llu", (unsigned long long)n, from, to,
              (unsigned long long)k, (unsigned long long)extra, (unsigned long long)want_extra);
        CHECK(want_extra < (uint64_t)to + (uint64_t)from, "padding bound");
        for (i = 0; i < n && want_extra <= n; i++) /* the repeats are the epoch's first indices */
            CHECK(count[perm[i]] == 1 + (i < want_extra ? 1u : 0u) || n < (uint64_t)(to + from),
                  "n=%llu %d->%d: perm[%llu] handed out %llu times", (unsigned long long)n, from, to, (unsigned long long)i,
                  (unsigned long long)count[perm[i]]);
    } else {
        uint64_t want_unseen = g == n ? n - k * (uint64_t)from : c % (uint64_t)to;
        CHECK(extra == 0, "drop_last n=%llu %d->%d: %llu repeats", (unsigned long long)n, from, to, (unsigned long long)extra);
        CHECK(unseen == want_unseen, "drop_last n=%llu %d->%d k=%llu: %llu unseen, want %llu", (unsigned long long)n, from, to,
              (unsigned long long)k, (unsigned long long)unseen, (unsigned long long)want_unseen);
        for (i = 0; i < n; i++) { /* seen: the first run's prefix and the rest up to the dropped tail */
            kk = (i < k * (uint64_t)from) || (g < n && i >= g && i < n - want_unseen);
            CHECK(count[perm[i]] == kk, "drop_last n=%llu %d->%d: perm[%llu] handed out %llu times, want %llu", (unsigned long long)n, from,
                  to, (unsigned long long)i, (unsigned long long)count[perm[i]], (unsigned long long)kk);
        }
    }
    if (verbose)
        printf("  n=%llu %d -> %d ranks%s%s, %llu each before the save: global position %llu, every index once%s\n", (unsigned long long)n, from,
               to, drop_last ? ", drop_last" : "", mode ? ", eval" : "", (unsigned long long)k, (unsigned long long)g,
               drop_last ? " or dropped at the tail" : (want_extra ? " plus torch's padding" : ""));
    for (r = 0; r < (uint64_t)from; r++) ddp_sampler_free(&old[r]);
    free(old);
    free(count);
    free(perm);
    free(buf);
}

static void test_resize_resume(void) {
    uint64_t rng = 21, trial;
    /* the cases */
    resize_case(1000, 4, 3, 0, 0, 0, 0, 0, 3, 100, 1);
    resize_case(1001, 3, 5, 0, 0, 0, 0, 7, 1, 120, 1);
    resize_case(1003, 4, 3, 1, 0, 0, 0, 5, 2, 77, 1);
    resize_case(1003, 3, 5, 1, 0, 0, 0, 5, 2, 77, 1);
    resize_case(1003, 4, 3, 0, 1, 0, 0, 5, 2, 50, 1);
    resize_case(10, 4, 3, 0, 0, 0, 0, 1, 0, 3, 1); /* the first run reached its padding: the epoch is over */
    for (trial = 0; trial < 400; trial++) {
        uint64_t n = tl_rand(&rng) % (trial < 150 ? 20 : 700);
        int from = 1 + (int)(tl_rand(&rng) % 9), to = trial % 5 == 0 ? from : 1 + (int)(tl_rand(&rng) % 9);
        int mode = tl_rand(&rng) % 4 == 0, drop_last = !mode && tl_rand(&rng) % 3 == 0;
        resize_case(n, from, to, drop_last, mode, (int)(tl_rand(&rng) % 3), tl_rand(&rng) % 5 == 0, tl_rand(&rng), tl_rand(&rng) % 4,
                    tl_rand(&rng) % (n / (uint64_t)from + 2), 0);
    }
    printf("resize resume: 406 cases (1..9 -> 1..9 ranks, drop_last, eval, every permutation): every index once\n");
}

/* The regime switch sits exactly where current torch has it: n < UINT32_MAX / 20 keeps the swap loop.
   (Both regimes are compared with references at n = 214748364 in tests/test_interop_sampler.sh.) */
static void test_randperm_split(void) {
    CHECK(4294967295u / 20 == 214748364u, "the split");
    CHECK(!ddp__randperm_is_inside_out(214748363u, 0), "214748363: the swap loop");
    CHECK(ddp__randperm_is_inside_out(214748364u, 0), "214748364: inside-out");
    CHECK(ddp__randperm_is_inside_out(5000000000ull, 0), "5e9: inside-out");
    CHECK(!ddp__randperm_is_inside_out(214748364u, 1) && !ddp__randperm_is_inside_out(5000000000ull, 1),
          "legacy: the swap loop at every n");
}

/* Above N = 2^32 the permutation is held in uint64 entries. No test machine has the 32 GiB that takes, so
   the wide storage is forced (a private field) at small N: the indices must not change. */
static void test_wide_entries(void) {
    uint64_t rng = 77, trial;
    for (trial = 0; trial < 40; trial++) {
        ddp_sampler_desc d = desc_of(tl_rand(&rng) % 3000, 1 + (int)(tl_rand(&rng) % 9), 0, tl_rand(&rng));
        ddp_sampler narrow, wide;
        uint64_t count, k;
        int64_t *a, *b;
        d.rank = (int)(tl_rand(&rng) % (uint64_t)d.num_replicas);
        d.drop_last = (int)(tl_rand(&rng) % 2);
        d.permutation = (ddp_sampler_permutation)(tl_rand(&rng) % 2);
        CHECK_OK(ddp_sampler_init(&narrow, &d), NULL);
        CHECK_OK(ddp_sampler_init(&wide, &d), NULL);
        CHECK(!narrow.shard_wide, "uint32 entries below 2^32");
        wide.shard_wide = 1;
        count = ddp_sampler_num_samples(&narrow);
        a = (int64_t *)malloc((size_t)(count + 1) * sizeof *a);
        b = (int64_t *)malloc((size_t)(count + 1) * sizeof *b);
        CHECK_OK(ddp_sampler_indices(&narrow, a), NULL);
        CHECK_OK(ddp_sampler_indices(&wide, b), NULL);
        for (k = 0; k < count; k++) CHECK(a[k] == b[k], "wide entries change index %llu", (unsigned long long)k);
        { /* and the inside-out shuffle, which the sampler only runs above 214748364, in both widths */
            void *p32 = malloc((size_t)d.dataset_size * 4 + 4), *p64 = malloc((size_t)d.dataset_size * 8 + 8);
            ddp__mt19937 g32, g64;
            ddp__mt_seed(&g32, trial);
            ddp__mt_seed(&g64, trial);
            ddp__randperm_inside_out(p32, 0, d.dataset_size, &g32);
            ddp__randperm_inside_out(p64, 1, d.dataset_size, &g64);
            for (k = 0; k < d.dataset_size; k++)
                CHECK(((uint32_t *)p32)[k] == ((uint64_t *)p64)[k], "inside-out in uint32 and uint64 entries");
            free(p32);
            free(p64);
        }
        ddp_sampler_free(&narrow);
        ddp_sampler_free(&wide);
        free(a);
        free(b);
    }
}

/* The inside-out shuffle (current torch above 214748364) written out plainly, at small N, against the
   library's prefetching version: a permutation, and the same one. */
static void test_inside_out_small(void) {
    uint64_t n;
    for (n = 0; n < 2000; n += 1 + n / 3) {
        uint32_t *lib = (uint32_t *)malloc((size_t)n * 4 + 4), *plain = (uint32_t *)malloc((size_t)n * 4 + 4);
        ddp__mt19937 g;
        uint64_t i;
        ddp__mt_seed(&g, n);
        ddp__randperm_inside_out(lib, 0, n, &g);
        ddp__mt_seed(&g, n);
        for (i = 0; i < n; i++) { /* torch: r[i] = i; r[i] = r[z]; r[z] = i */
            uint64_t hi = ddp__mt_random(&g), lo = ddp__mt_random(&g), z = ((hi << 32) | lo) % (i + 1);
            plain[i] = (uint32_t)i;
            plain[i] = plain[z];
            plain[z] = (uint32_t)i;
        }
        for (i = 0; i < n; i++) CHECK(lib[i] == plain[i], "inside-out n=%llu position %llu", (unsigned long long)n,
                                      (unsigned long long)i);
        free(lib);
        free(plain);
    }
}

static void test_epochs_differ_and_legacy_equal_below_split(void) {
    ddp_sampler_desc d = desc_of(1000, 3, 1, 17);
    uint64_t c1, c2, c3, k, same = 0;
    int64_t *a = indices_of(&d, 0, &c1), *b = indices_of(&d, 1, &c2), *c;
    for (k = 0; k < c1; k++) same += a[k] == b[k];
    CHECK(same < c1 / 10, "epochs 0 and 1 share %llu of %llu positions", (unsigned long long)same, (unsigned long long)c1);
    d.permutation = DDP_PERMUTATION_TORCH_LEGACY;
    c = indices_of(&d, 0, &c3);
    CHECK(c3 == c1 && memcmp(a, c, (size_t)c1 * sizeof *a) == 0, "legacy and current randperm agree below 214748364");
    free(a);
    free(b);
    free(c);
}

/* The torch permutation is made in 4 bytes per sample (N <= 2^32), then only this rank's share is kept;
   the streaming permutation allocates nothing. */
static void test_memory(void) {
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(1000000, 8, 3, 1);
    int64_t x;
    size_t live0 = tl_live_bytes;
    tl_peak_bytes = tl_live_bytes;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK(tl_live_bytes == live0, "init allocates nothing");
    CHECK_OK(ddp_sampler_index_at(&s, 0, &x), NULL);
    CHECK(tl_peak_bytes - live0 == 4000000, "the shuffle needs 4 bytes per sample, took %zu", tl_peak_bytes - live0);
    CHECK(tl_live_bytes - live0 == 125000 * 4, "afterwards only this rank's share is kept, not %zu bytes", tl_live_bytes - live0);
    ddp_sampler_set_epoch(&s, 1);
    CHECK_OK(ddp_sampler_index_at(&s, 0, &x), NULL);
    CHECK(tl_peak_bytes - live0 == 4000000, "the old share is freed before the next shuffle");
    ddp_sampler_set_epoch(&s, 1); /* the same epoch again, not finished: no warning, nothing redone */
    ddp_sampler_free(&s);
    CHECK(tl_live_bytes == live0, "free releases everything");
    d.permutation = DDP_PERMUTATION_STREAMING;
    tl_peak_bytes = tl_live_bytes;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    CHECK_OK(ddp_sampler_index_at(&s, 124999, &x), NULL);
    CHECK(tl_peak_bytes == live0, "streaming allocates nothing");
    ddp_sampler_free(&s);
}

/* Forgetting set_epoch: a finished epoch hands out nothing more, and setting the same epoch again after a
   finished shuffled epoch warns (on stderr, captured here). */
static void test_same_epoch_warning(void) {
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(10, 2, 0, 0);
    int64_t batch[8];
    size_t got;
    char text[512] = {0};
    FILE *tmp = tmpfile();
    int saved = dup(2);
    CHECK(tmp && saved >= 0, "tmpfile");
    setenv("DDP_LOG_LEVEL", "warn", 1); /* whatever the caller's environment says */
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    ddp_sampler_set_epoch(&s, 4);
    CHECK_OK(ddp_sampler_next_batch(&s, 8, batch, &got), NULL);
    CHECK(got == 5, "5 of 10 for rank 0 of 2");
    CHECK_OK(ddp_sampler_next_batch(&s, 8, batch, &got), NULL);
    CHECK(got == 0, "the epoch is done");
    fflush(stderr);
    dup2(fileno(tmp), 2);
    ddp_sampler_set_epoch(&s, 4);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(tmp);
    CHECK(fread(text, 1, sizeof text - 1, tmp) > 0 && strstr(text, "repeats the same order"),
          "set_epoch(4) after epoch 4 should warn, stderr had \"%s\"", text);
    fclose(tmp);
    ddp_sampler_free(&s);
}

/* ---- a new pass without set_epoch (issue #35): torch's order again, and one warning ---- */

/* One pass of next_batch, as a torch `for` loop: batches until the 0 that ends it (once); returns the count. */
static uint64_t one_pass(ddp_sampler *s, size_t batch, int64_t *out, uint64_t room) {
    uint64_t pos = 0;
    size_t got;
    int64_t *buf = (int64_t *)malloc(batch * sizeof *buf);
    CHECK(buf, "malloc");
    for (;;) {
        CHECK_OK(ddp_sampler_next_batch(s, batch, buf, &got), NULL);
        if (got == 0) break;
        CHECK(pos + got <= room, "a pass longer than %llu", (unsigned long long)room);
        memcpy(out + pos, buf, got * sizeof *buf);
        pos += got;
    }
    free(buf);
    return pos;
}

/* torch 1.13, recorded with (L(n) a dataset of length n):
     s = DistributedSampler(L(n), num_replicas=R, rank=rank, shuffle=..., seed=seed, drop_last=...)
     if epoch is not None: s.set_epoch(epoch)
     passes = [list(s) for _ in range(3)]      # all three equal: __iter__ recomputes from seed + epoch
     s.set_epoch((epoch or 0) + 1); nxt = list(s)
   Eval mode (ddp.h's own) from torch's permutation: randperm(n, seed + epoch)[rank::R], no padding.
   Padding: n = 10 on 4 ranks (rank 3's last index repeats the list's start), n = 23 on 5 (rank 4's). */
typedef struct pass_case {
    uint64_t n;
    int replicas, rank;
    uint64_t seed;
    int epoch; /* the set_epoch before the passes; -1: never called (epoch 0) */
    int no_shuffle, drop_last, mode;
    uint64_t count;
    int64_t want[5], next[5]; /* every pass; the pass after set_epoch(epoch + 1) */
} pass_case;

static const pass_case pass_cases[] = {
    {10, 4, 3, 5, -1, 0, 0, 0, 3, {6, 2, 4}, {1, 2, 7}},
    {10, 4, 3, 5, -1, 0, 1, 0, 2, {6, 2}, {1, 2}},
    {10, 4, 3, 5, -1, 1, 0, 0, 3, {3, 7, 1}, {3, 7, 1}},
    {10, 4, 3, 5, -1, 1, 1, 0, 2, {3, 7}, {3, 7}},
    {10, 4, 3, 5, -1, 0, 0, 1, 2, {6, 2}, {1, 2}},
    {10, 4, 3, 5, -1, 1, 0, 1, 2, {3, 7}, {3, 7}},
    {23, 5, 4, 11, 3, 0, 0, 0, 5, {13, 2, 19, 4, 7}, {6, 7, 11, 21, 4}},
    {23, 5, 4, 11, 3, 0, 1, 0, 4, {13, 2, 19, 4}, {6, 7, 11, 21}},
    {23, 5, 4, 11, 3, 1, 0, 0, 5, {4, 9, 14, 19, 1}, {4, 9, 14, 19, 1}},
    {23, 5, 4, 11, 3, 1, 1, 0, 4, {4, 9, 14, 19}, {4, 9, 14, 19}},
    {23, 5, 4, 11, 3, 0, 0, 1, 4, {13, 2, 19, 4}, {6, 7, 11, 21}},
    {23, 5, 4, 11, 3, 1, 0, 1, 4, {4, 9, 14, 19}, {4, 9, 14, 19}},
    {23, 5, 2, 11, 3, 0, 0, 0, 5, {9, 3, 22, 1, 15}, {5, 18, 10, 9, 12}},
    {23, 5, 2, 11, 3, 0, 1, 0, 4, {9, 3, 22, 1}, {5, 18, 10, 9}},
    {23, 5, 2, 11, 3, 1, 0, 0, 5, {2, 7, 12, 17, 22}, {2, 7, 12, 17, 22}},
    {23, 5, 2, 11, 3, 1, 1, 0, 4, {2, 7, 12, 17}, {2, 7, 12, 17}},
    {23, 5, 2, 11, 3, 0, 0, 1, 5, {9, 3, 22, 1, 15}, {5, 18, 10, 9, 12}},
    {23, 5, 2, 11, 3, 1, 0, 1, 5, {2, 7, 12, 17, 22}, {2, 7, 12, 17, 22}},
};

/* Two and three passes without set_epoch hand out torch's order again (the old code handed out nothing
   after the first); the 0 that ends a pass comes once; one warning per sampler when it shuffles; none
   with set_epoch every epoch. Torch's permutation and the legacy one (equal at these n) against torch's
   recorded output; the streaming permutation against ddp_sampler_indices. */
static void test_passes_without_set_epoch(void) {
    static const size_t batches[] = {1, 2, 4, 64};
    size_t c, b;
    int perm, pass;
    unsetenv("DDP_LOG_LEVEL"); /* the default configuration: warnings on */
    for (c = 0; c < sizeof pass_cases / sizeof pass_cases[0]; c++)
        for (perm = 0; perm < 3; perm++)
            for (b = 0; b < sizeof batches / sizeof batches[0]; b++) {
                const pass_case *pc = &pass_cases[c];
                ddp_sampler_desc d = desc_of(pc->n, pc->replicas, pc->rank, pc->seed);
                ddp_sampler s;
                uint64_t epoch = pc->epoch < 0 ? 0 : (uint64_t)pc->epoch, k, got, count;
                int64_t out[8], want[5], next[5], *ref;
                char text[2048];
                int warnings;
                d.no_shuffle = pc->no_shuffle, d.drop_last = pc->drop_last, d.mode = (ddp_sampler_mode)pc->mode;
                d.permutation = (ddp_sampler_permutation)perm;
                memcpy(want, pc->want, sizeof want);
                memcpy(next, pc->next, sizeof next);
                if (perm == DDP_PERMUTATION_STREAMING) { /* not torch's order: its own, from indices() */
                    ref = indices_of(&d, epoch, &count);
                    CHECK(count == pc->count, "streaming: %llu indices", (unsigned long long)count);
                    memcpy(want, ref, (size_t)count * sizeof *ref);
                    free(ref);
                    ref = indices_of(&d, epoch + 1, &count);
                    memcpy(next, ref, (size_t)count * sizeof *ref);
                    free(ref);
                }
                CHECK_OK(ddp_sampler_init(&s, &d), NULL);
                if (pc->epoch >= 0) ddp_sampler_set_epoch(&s, epoch);
                CHECK(ddp_sampler_num_samples(&s) == pc->count, "case %zu: num_samples", c);
                capture_begin();
                for (pass = 0; pass < 3; pass++) {
                    memset(out, 0xff, sizeof out);
                    got = one_pass(&s, batches[b], out, 8);
                    CHECK(got == pc->count, "case %zu perm %d batch %zu pass %d: %llu indices, torch %llu", c, perm,
                          batches[b], pass, (unsigned long long)got, (unsigned long long)pc->count);
                    for (k = 0; k < got; k++)
                        CHECK(out[k] == want[k], "case %zu perm %d batch %zu pass %d: index %llu is %lld, torch has %lld",
                              c, perm, batches[b], pass, (unsigned long long)k, (long long)out[k], (long long)want[k]);
                    CHECK(ddp_sampler_position(&s) == pc->count && ddp_sampler_epoch(&s) == epoch, "position");
                }
                warnings = capture_end(text, sizeof text, "[ddp] warning");
                CHECK(warnings == !pc->no_shuffle, "case %zu: %d warnings in 3 passes "
                      "(want %d): \"%s\"", c, warnings, !pc->no_shuffle, text);
                if (warnings) CHECK(strstr(text, "ddp_sampler_set_epoch") && strstr(text, "repeats"), "the warning: \"%s\"", text);
                capture_begin(); /* set_epoch before each pass: the next epochs' orders, no warning */
                ddp_sampler_set_epoch(&s, epoch + 1);
                got = one_pass(&s, batches[b], out, 8);
                CHECK(got == pc->count, "after set_epoch: %llu indices", (unsigned long long)got);
                for (k = 0; k < got; k++)
                    CHECK(out[k] == next[k], "case %zu perm %d: after set_epoch(%llu) index %llu is %lld, torch has %lld",
                          c, perm, (unsigned long long)epoch + 1, (unsigned long long)k, (long long)out[k],
                          (long long)next[k]);
                ddp_sampler_set_epoch(&s, epoch + 2);
                got = one_pass(&s, batches[b], out, 8);
                CHECK(got == pc->count, "after set_epoch: %llu indices", (unsigned long long)got);
                CHECK(capture_end(text, sizeof text, NULL) == 0, "set_epoch every epoch logged \"%s\"", text);
                ddp_sampler_free(&s);
            }
}

/* The warning: in the default configuration (no DDP_LOG_LEVEL), once per sampler, naming
   ddp_sampler_set_epoch; none with set_epoch every epoch, none for an order set_epoch would not change
   (no_shuffle), none for set_position(0) (a pass repeated on purpose); DDP_LOG_LEVEL=error silences it. */
static void test_repeat_warning(void) {
    ddp_sampler s, t;
    ddp_sampler_desc d = desc_of(10, 2, 0, 0);
    int64_t first[5], out[5];
    char text[2048];
    int epoch, n;
    unsetenv("DDP_LOG_LEVEL");
    CHECK_OK(ddp_sampler_init(&s, &d), NULL); /* a torch loop that forgets set_epoch, over 3 epochs */
    capture_begin();
    for (epoch = 0; epoch < 3; epoch++) {
        CHECK(one_pass(&s, 2, epoch ? out : first, 5) == 5, "epoch %d: 5 indices", epoch);
        if (epoch) CHECK(memcmp(out, first, sizeof out) == 0, "epoch %d repeats epoch 0's order, as torch", epoch);
    }
    n = capture_end(text, sizeof text, "[ddp] warning");
    CHECK(n == 1 && strstr(text, "ddp_sampler_set_epoch") && strstr(text, "epoch 0"),
          "one warning naming ddp_sampler_set_epoch in 3 epochs, got %d: \"%s\"", n, text);
    printf("without set_epoch, once per sampler: %s", text);
    CHECK_OK(ddp_sampler_init(&t, &d), NULL); /* another sampler warns once too */
    capture_begin();
    for (epoch = 0; epoch < 3; epoch++) one_pass(&t, 3, out, 5);
    CHECK(capture_end(NULL, 0, "[ddp] warning") == 1, "once per sampler");
    ddp_sampler_free(&t);
    capture_begin(); /* set_position(0): the same epoch again on purpose, no warning */
    CHECK_OK(ddp_sampler_set_position(&s, 0), NULL);
    CHECK(one_pass(&s, 4, out, 5) == 5 && memcmp(out, first, sizeof out) == 0, "set_position(0) repeats the epoch");
    CHECK(capture_end(text, sizeof text, NULL) == 0, "set_position(0) logged \"%s\"", text);
    ddp_sampler_free(&s);
    capture_begin(); /* set_epoch every epoch: silent */
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    for (epoch = 0; epoch < 3; epoch++) {
        ddp_sampler_set_epoch(&s, (uint64_t)epoch);
        CHECK(one_pass(&s, 2, out, 5) == 5, "5 indices");
    }
    ddp_sampler_free(&s);
    d.no_shuffle = 1; /* no shuffle: set_epoch would change nothing, so nothing to warn about */
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    for (epoch = 0; epoch < 3; epoch++) CHECK(one_pass(&s, 2, out, 5) == 5, "5 indices");
    ddp_sampler_free(&s);
    setenv("DDP_LOG_LEVEL", "error", 1); /* the level is the user's to lower */
    d.no_shuffle = 0;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    for (epoch = 0; epoch < 3; epoch++) CHECK(one_pass(&s, 2, out, 5) == 5, "5 indices");
    ddp_sampler_free(&s);
    unsetenv("DDP_LOG_LEVEL");
    CHECK(capture_end(text, sizeof text, NULL) == 0, "nothing to warn about, but stderr had \"%s\"", text);
}

/* The end of a pass with the resume calls: set_position(num_samples) resumes at the very end (one 0,
   then a new pass); set_position after a finished pass continues that pass; a pass resumed at a global
   position is followed by a whole epoch; an allocation failure at a new pass leaves the state as it was. */
static void test_pass_end_and_resume(void) {
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(103, 4, 1, 9);
    int64_t all[26], out[32], batch[8];
    uint64_t count, k;
    size_t got;
    int64_t *ref = indices_of(&d, 2, &count);
    CHECK(count == 26, "ceil(103 / 4)");
    memcpy(all, ref, sizeof all);
    free(ref);
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    ddp_sampler_set_epoch(&s, 2);
    CHECK_OK(ddp_sampler_set_position(&s, 26), NULL); /* a checkpoint taken at the epoch's end */
    CHECK_OK(ddp_sampler_next_batch(&s, 8, batch, &got), NULL);
    CHECK(got == 0 && ddp_sampler_position(&s) == 26, "resumed at the end: the pass ends at once");
    capture_begin();
    CHECK(one_pass(&s, 8, out, 32) == 26 && memcmp(out, all, sizeof all) == 0, "then a new pass, the same order");
    CHECK(capture_end(NULL, 0, "[ddp] warning") == 1, "and the warning");
    CHECK_OK(ddp_sampler_set_position(&s, 20), NULL); /* after the pass's 0: set_position continues from 20 */
    CHECK(one_pass(&s, 4, out, 32) == 6 && memcmp(out, all + 20, 6 * sizeof *out) == 0, "set_position(20)");
    ddp_sampler_free(&s);

    CHECK_OK(ddp_sampler_init(&s, &d), NULL); /* resumed at global position 40 (on any number of ranks) */
    CHECK_OK(ddp_sampler_resume(&s, 2, 40), NULL);
    CHECK(ddp_sampler_num_samples(&s) == 16, "ceil(63 / 4) of the rest");
    for (k = 0; k < 16; k++) CHECK_OK(ddp_sampler_index_at(&s, k, &out[k]), NULL);
    CHECK(one_pass(&s, 5, out + 16, 16) == 16 && memcmp(out, out + 16, 16 * sizeof *out) == 0, "the rest");
    tl_fail_allocs = 1; /* the new pass needs the whole epoch's permutation again: make that fail */
    capture_begin();
    CHECK(ddp_sampler_next_batch(&s, 8, batch, &got) == DDP_ERR_OUT_OF_MEMORY && got == 0, "out of memory");
    capture_end(NULL, 0, NULL);
    tl_fail_allocs = 0;
    CHECK(ddp_sampler_position(&s) == 16 && ddp_sampler_num_samples(&s) == 16 &&
          ddp_sampler_global_position(&s) == 103, "a failed new pass changes nothing");
    CHECK(one_pass(&s, 8, out, 32) == 26 && memcmp(out, all, sizeof all) == 0,
          "the pass after a resumed one is the whole epoch, as torch's next iteration");
    CHECK(ddp_sampler_num_samples(&s) == 26 && ddp_sampler_global_position(&s) == 103, "the whole epoch");
    ddp_sampler_free(&s);
}

static void expect_error(ddp_result got, ddp_result want, const char *what, const char *needle) {
    CHECK(got == want, "%s: returned %d, expected %d", what, (int)got, (int)want);
    CHECK(strstr(ddp_last_error(NULL), needle) != NULL, "%s: message \"%s\" should mention \"%s\"", what,
          ddp_last_error(NULL), needle);
}

static void test_errors(void) {
    ddp_sampler s, zeroed;
    ddp_sampler_desc d = desc_of(10, 0, 0, 0);
    int64_t out[8], x;
    size_t got = 99;
    memset(&zeroed, 0, sizeof zeroed);
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "num_replicas 0", "num_replicas");
    d.num_replicas = -2;
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "num_replicas -2", "num_replicas");
    d = desc_of(10, 4, 4, 0);
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "rank 4 of 4", "rank is 4");
    d.rank = -1;
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "rank -1", "rank is -1");
    d = desc_of((uint64_t)INT64_MAX + 1, 1, 0, 0);
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "dataset_size 2^63", "dataset_size");
    d = desc_of(10, 2, 0, 0);
    d.mode = DDP_SAMPLER_EVAL;
    d.drop_last = 1;
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "eval + drop_last", "drop_last");
    d.drop_last = 0;
    d.mode = (ddp_sampler_mode)7;
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "mode 7", "mode 7");
    d.mode = DDP_SAMPLER_TORCH;
    d.permutation = (ddp_sampler_permutation)-1;
    expect_error(ddp_sampler_init(&s, &d), DDP_ERR_INVALID_ARGUMENT, "permutation -1", "permutation -1");
    expect_error(ddp_sampler_init(NULL, &d), DDP_ERR_INVALID_ARGUMENT, "NULL sampler", "sampler is NULL");
    expect_error(ddp_sampler_init(&s, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL desc", "desc is NULL");

    /* calls on a sampler that is not initialised */
    expect_error(ddp_sampler_indices(&zeroed, out), DDP_ERR_INVALID_ARGUMENT, "zeroed sampler", "not initialised");
    expect_error(ddp_sampler_next_batch(NULL, 4, out, &got), DDP_ERR_INVALID_ARGUMENT, "NULL sampler", "not initialised");
    CHECK(got == 0, "*got is 0 on error");
    CHECK(ddp_sampler_num_samples(&zeroed) == 0 && ddp_sampler_position(NULL) == 0, "getters on no sampler");
    ddp_sampler_set_epoch(&zeroed, 3); /* ignored */
    ddp_sampler_free(&zeroed);
    ddp_sampler_free(NULL);

    d = desc_of(10, 2, 1, 0);
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    expect_error(ddp_sampler_next_batch(&s, 0, out, &got), DDP_ERR_INVALID_ARGUMENT, "batch_size 0", "batch_size");
    expect_error(ddp_sampler_next_batch(&s, 4, NULL, &got), DDP_ERR_INVALID_ARGUMENT, "NULL out", "out is NULL");
    expect_error(ddp_sampler_next_batch(&s, 4, out, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL got", "got is NULL");
    expect_error(ddp_sampler_indices(&s, NULL), DDP_ERR_INVALID_ARGUMENT, "indices NULL out", "out is NULL");
    expect_error(ddp_sampler_set_position(&s, 6), DDP_ERR_INVALID_ARGUMENT, "position 6 of 5", "position 6");
    expect_error(ddp_sampler_index_at(&s, 5, &x), DDP_ERR_INVALID_ARGUMENT, "index_at 5 of 5", "k = 5");
    expect_error(ddp_sampler_index_at(&s, 0, NULL), DDP_ERR_INVALID_ARGUMENT, "index_at NULL", "out is NULL");
    CHECK(ddp_sampler_position(&s) == 0, "errors leave the position alone");
    ddp_sampler_free(&s);
    ddp_sampler_free(&s); /* a second free is a no-op */
    expect_error(ddp_sampler_indices(&s, out), DDP_ERR_INVALID_ARGUMENT, "freed sampler", "not initialised");
}

/* Real ranks (processes joined by ddp_init, all_gather between them), each with its own sampler and no
   shared state. Evaluation mode: the gathered shards are every index once, and their sum is exactly
   n(n-1)/2 (a metric summed over the shards counts every sample once). Torch mode: the shards, interleaved
   by rank, are the padded list of the R = 1 permutation -- duplicates included. */
#define RANKS_N 1003

static int rank_main(int rank, int world, void *arg) {
    ddp_group *g;
    ddp_sampler s;
    ddp_sampler_desc d = desc_of(RANKS_N, world, rank, 1234);
    int64_t mine[RANKS_N], all[RANKS_N + 8], sum = 0, perm[RANKS_N];
    uint64_t count, k, cap = (RANKS_N + (uint64_t)world - 1) / (uint64_t)world, perm_count;
    unsigned char seen[RANKS_N] = {0};
    int mode;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK(ddp_world_size(g) == world && ddp_rank(g) == rank, "group shape");
    d.num_replicas = ddp_world_size(g);
    d.rank = ddp_rank(g);
    for (mode = 0; mode < 2; mode++) {
        d.mode = mode ? DDP_SAMPLER_EVAL : DDP_SAMPLER_TORCH;
        CHECK_OK(ddp_sampler_init(&s, &d), NULL);
        ddp_sampler_set_epoch(&s, 4);
        count = ddp_sampler_num_samples(&s);
        for (k = 0; k < cap; k++) mine[k] = -1; /* eval shards may be one short: pad for the gather */
        CHECK_OK(ddp_sampler_indices(&s, mine), NULL);
        ddp_sampler_free(&s);
        CHECK_OK(ddp_all_gather(g, mine, all, cap, DDP_I64), g);
        CHECK(count == cap || (mode && count + 1 == cap), "rank %d: %llu indices of at most %llu", rank,
              (unsigned long long)count, (unsigned long long)cap);
        for (k = 0, sum = 0; k < cap * (uint64_t)world; k++) sum += all[k] < 0 ? 0 : all[k];
        if (mode) {
            memset(seen, 0, sizeof seen);
            for (k = 0; k < cap * (uint64_t)world; k++) {
                if (all[k] < 0) continue;
                CHECK(all[k] < RANKS_N && !seen[all[k]], "eval: %lld twice or out of range", (long long)all[k]);
                seen[all[k]] = 1;
            }
            for (k = 0; k < RANKS_N; k++) CHECK(seen[k], "eval: index %llu missing", (unsigned long long)k);
            CHECK(sum == (int64_t)RANKS_N * (RANKS_N - 1) / 2, "eval: sum of indices %lld", (long long)sum);
        } else {
            ddp_sampler_desc one = desc_of(RANKS_N, 1, 0, 1234);
            int64_t *p = indices_of(&one, 4, &perm_count);
            memcpy(perm, p, sizeof perm);
            free(p);
            for (k = 0; k < cap * (uint64_t)world; k++) { /* rank r's k-th index is position r + k*R */
                uint64_t r = k / cap, i = k % cap;
                CHECK(all[k] == perm[(r + i * (uint64_t)world) % RANKS_N], "torch mode: rank %llu index %llu",
                      (unsigned long long)r, (unsigned long long)i);
            }
        }
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

static void test_ranks_with_collectives(void) {
    int worlds[] = {3, 4}, i;
    for (i = 0; i < 2; i++) CHECK(tl_run_ranks(worlds[i], rank_main, NULL, 120) == 0, "%d ranks failed", worlds[i]);
}

int main(void) {
    test_mt19937();
    test_torch_recorded();
    test_dealing_matches_torch_rules();
    test_eval_mode();
    test_streaming_is_permutation();
    test_streaming_chi_square();
    test_streaming_chi_square_huge();
    test_streaming_huge();
    test_batches_and_resume();
    test_resize_resume();
    test_randperm_split();
    test_wide_entries();
    test_inside_out_small();
    test_epochs_differ_and_legacy_equal_below_split();
    test_memory();
    test_same_epoch_warning();
    test_passes_without_set_epoch();
    test_repeat_warning();
    test_pass_end_and_resume();
    test_errors();
    test_ranks_with_collectives();
    printf("test_sampler: all passed\n");
    return 0;
}
