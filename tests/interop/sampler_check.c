/* Checks ddp.h's sampler against the cases tests/interop/sampler_torch.py recorded from torch 1.13 (stdin).
   Every case is read back through five paths: ddp_sampler_indices, ddp_sampler_next_batch over a whole
   epoch, a resume from the middle (set_position), ddp_sampler_index_at, and ddp_sampler_step_batch on
   num_replicas ranks with global batch batch * num_replicas (the step-indexed batch of fault-tolerant
   training is torch's per-rank batch there, step after step). Multi-pass cases (P): one
   sampler iterated two or three times, without set_epoch in between (torch repeats the order, and so
   must next_batch after the 0 that ends a pass) or with set_epoch(epoch + i) before each pass.
   Also, for the large-N regime (tests/test_interop_sampler.sh):
     sampler_check slice N R RANK SEED EPOCH PERMUTATION   prints that rank's indices, one per line */
#include "testlib.h"

static int failures;

static void fail(const char *what, const char *line, uint64_t k, int64_t got, int64_t want) {
    if (++failures <= 10)
        fprintf(stderr, "MISMATCH (%s) case \"%s\": index %llu is %lld, torch has %lld\n", what, line,
                (unsigned long long)k, (long long)got, (long long)want);
}

/* The step-indexed path: steps of batch * R indices on a view of the R ranks, this rank's shares one after
   another, until the empty share that ends the epoch; got has room for count + batch indices. */
static void check_steps(ddp_sampler *s, const ddp_sampler_desc *d, uint64_t epoch, const int64_t *want, uint64_t count,
                        const char *line, size_t batch, int64_t *got) {
    ddp_ft_step st;
    uint64_t pos = 0, k;
    size_t n;
    memset(&st, 0, sizeof st);
    st.epoch = epoch;
    st.rank = d->rank;
    st.world_size = d->num_replicas;
    for (;; st.step++) {
        CHECK_OK(ddp_sampler_step_batch(s, &st, (uint64_t)batch * (uint64_t)d->num_replicas, got + pos, &n), NULL);
        if (n == 0 || pos + n > count) break;
        pos += n;
    }
    if (pos != count || n != 0) {
        if (++failures <= 10)
            fprintf(stderr, "MISMATCH (step_batch) case \"%s\": %llu indices before the empty step, torch has %llu\n", line,
                    (unsigned long long)pos, (unsigned long long)count);
        return;
    }
    for (k = 0; k < count; k++)
        if (got[k] != want[k]) { fail("step_batch", line, k, got[k], want[k]); break; }
}

static void check_case(const ddp_sampler_desc *d, uint64_t epoch, const int64_t *want, uint64_t count,
                       const char *line, size_t batch) {
    ddp_sampler s;
    int64_t *got = (int64_t *)malloc((size_t)(count + batch) * sizeof(int64_t)), x;
    uint64_t k, pos = 0;
    size_t n;
    CHECK(got, "malloc");
    CHECK_OK(ddp_sampler_init(&s, d), NULL);
    ddp_sampler_set_epoch(&s, epoch);
    if (ddp_sampler_num_samples(&s) != count) {
        failures++;
        fprintf(stderr, "MISMATCH case \"%s\": num_samples %llu, torch has %llu\n", line,
                (unsigned long long)ddp_sampler_num_samples(&s), (unsigned long long)count);
        ddp_sampler_free(&s);
        free(got);
        return;
    }
    CHECK_OK(ddp_sampler_indices(&s, got), NULL);
    for (k = 0; k < count; k++)
        if (got[k] != want[k]) { fail("indices", line, k, got[k], want[k]); break; }
    do { /* the iterator, in batches */
        CHECK_OK(ddp_sampler_next_batch(&s, batch, got + pos, &n), NULL);
        pos += n;
    } while (n > 0);
    CHECK(pos == count, "next_batch handed out %llu of %llu", (unsigned long long)pos, (unsigned long long)count);
    for (k = 0; k < count; k++)
        if (got[k] != want[k]) { fail("next_batch", line, k, got[k], want[k]); break; }
    ddp_sampler_free(&s);
    CHECK_OK(ddp_sampler_init(&s, d), NULL); /* a resumed run: fresh sampler, same epoch, saved position */
    ddp_sampler_set_epoch(&s, epoch);
    CHECK_OK(ddp_sampler_set_position(&s, count / 2), NULL);
    CHECK_OK(ddp_sampler_next_batch(&s, batch, got, &n), NULL);
    for (k = 0; k < n; k++)
        if (got[k] != want[count / 2 + k]) { fail("resume", line, count / 2 + k, got[k], want[count / 2 + k]); break; }
    for (k = 0; k < count; k += 1 + count / 5) {
        CHECK_OK(ddp_sampler_index_at(&s, k, &x), NULL);
        if (x != want[k]) { fail("index_at", line, k, x, want[k]); break; }
    }
    check_steps(&s, d, epoch, want, count, line, batch, got);
    ddp_sampler_free(&s);
    free(got);
}

/* One indices line of a case: count values, or "-" when there are none. */
static void read_indices(int64_t *want, unsigned long long count, const char *head) {
    unsigned long long k;
    for (k = 0; k < count; k++) {
        long long v;
        CHECK(scanf("%lld", &v) == 1, "short index list in case %s", head);
        want[k] = v;
    }
    if (count == 0) {
        char dash[2];
        CHECK(scanf(" %1s", dash) == 1 && dash[0] == '-', "expected '-' after %s", head);
    }
}

/* P n R rank seed epoch shuffle drop_last mode each passes count, then one line per pass. The warning a
   new pass without set_epoch logs is test_sampler's to check; it is silenced here (DDP_LOG_LEVEL). */
static void check_passes(const char *head, size_t batch) {
    unsigned long long n, seed, count, k;
    long long epoch;
    int replicas, rank, shuffle, drop_last, mode, each, passes, i;
    ddp_sampler_desc d;
    ddp_sampler s;
    int64_t *want, *got, *buf;
    CHECK(sscanf(head, "P %llu %d %d %llu %lld %d %d %d %d %d %llu", &n, &replicas, &rank, &seed, &epoch, &shuffle,
                 &drop_last, &mode, &each, &passes, &count) == 11 && passes > 0, "bad line %s", head);
    want = (int64_t *)malloc((size_t)(count + 1) * sizeof(int64_t));
    got = (int64_t *)malloc((size_t)(count + 1) * sizeof(int64_t));
    buf = (int64_t *)malloc(batch * sizeof(int64_t));
    CHECK(want && got && buf, "malloc");
    setenv("DDP_LOG_LEVEL", "error", 1);
    memset(&d, 0, sizeof d);
    d.dataset_size = n, d.num_replicas = replicas, d.rank = rank, d.seed = seed;
    d.no_shuffle = !shuffle, d.drop_last = drop_last, d.mode = (ddp_sampler_mode)mode;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    if (epoch >= 0 && !each) ddp_sampler_set_epoch(&s, (uint64_t)epoch);
    for (i = 0; i < passes; i++) {
        uint64_t pos = 0;
        size_t m;
        read_indices(want, count, head);
        if (each) ddp_sampler_set_epoch(&s, (uint64_t)(epoch < 0 ? 0 : epoch) + (uint64_t)i);
        for (;;) { /* one `for` loop over the sampler: batches until the 0 that ends the pass */
            CHECK_OK(ddp_sampler_next_batch(&s, batch, buf, &m), NULL);
            if (m == 0) break;
            if (pos + m > count) break;
            memcpy(got + pos, buf, m * sizeof *buf);
            pos += m;
        }
        if (pos != count) {
            if (++failures <= 10)
                fprintf(stderr, "MISMATCH (pass %d) case \"%s\": next_batch handed out %llu indices, torch %llu\n", i,
                        head, (unsigned long long)pos, count);
            continue;
        }
        for (k = 0; k < count; k++)
            if (got[k] != want[k]) {
                char what[32];
                snprintf(what, sizeof what, "pass %d", i);
                fail(what, head, k, got[k], want[k]);
                break;
            }
    }
    ddp_sampler_free(&s);
    free(want);
    free(got);
    free(buf);
}

static int check_cases(void) {
    char head[256];
    int cases = 0, gens = 0, pass_cases = 0;
    while (fscanf(stdin, " %255[^\n]", head) == 1) {
        if (head[0] == 'P') { /* several passes over one sampler */
            check_passes(head, 1 + (size_t)(pass_cases % 9));
            pass_cases++;
        } else if (head[0] == 'G') { /* torch's random64 */
            unsigned long long seed, count, v, i;
            int off = 0;
            ddp__mt19937 g;
            CHECK(sscanf(head, "G %llu %llu%n", &seed, &count, &off) == 2, "bad line %s", head);
            ddp__mt_seed(&g, seed);
            for (i = 0; i < count; i++) {
                int used = 0;
                uint64_t mine = ddp__mt_random64(&g) & ((1ull << 62) - 1);
                CHECK(sscanf(head + off, "%llu%n", &v, &used) == 1, "bad G line");
                off += used;
                if (mine != v) {
                    failures++;
                    fprintf(stderr, "MISMATCH random64 seed %llu draw %llu: %llu, torch has %llu\n", seed, i,
                            (unsigned long long)mine, v);
                }
            }
            gens++;
        } else {
            unsigned long long n, seed, epoch, count;
            int replicas, rank, shuffle, drop_last, mode;
            ddp_sampler_desc d;
            int64_t *want;
            CHECK(sscanf(head, "C %llu %d %d %llu %llu %d %d %d %llu", &n, &replicas, &rank, &seed, &epoch, &shuffle,
                         &drop_last, &mode, &count) == 9, "bad line %s", head);
            want = (int64_t *)malloc((size_t)(count + 1) * sizeof(int64_t));
            CHECK(want, "malloc");
            read_indices(want, count, head);
            memset(&d, 0, sizeof d);
            d.dataset_size = n;
            d.num_replicas = replicas;
            d.rank = rank;
            d.seed = seed;
            d.no_shuffle = !shuffle;
            d.drop_last = drop_last;
            d.mode = (ddp_sampler_mode)mode;
            check_case(&d, epoch, want, count, head, 1 + (size_t)(cases % 37));
            free(want);
            cases++;
        }
    }
    printf("%d cases, %d multi-pass cases and %d generator streams checked against torch: %d mismatches\n", cases,
           pass_cases, gens, failures);
    return failures ? 1 : 0;
}

/* One rank's indices for a large N, one per line (compared by the script with the C++ reference). */
static int print_slice(char **argv) {
    ddp_sampler s;
    ddp_sampler_desc d;
    int64_t batch[4096];
    size_t n, i;
    double t0 = tl_now();
    memset(&d, 0, sizeof d);
    d.dataset_size = strtoull(argv[0], NULL, 10);
    d.num_replicas = atoi(argv[1]);
    d.rank = atoi(argv[2]);
    d.seed = strtoull(argv[3], NULL, 10);
    d.permutation = (ddp_sampler_permutation)atoi(argv[5]);
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    ddp_sampler_set_epoch(&s, strtoull(argv[4], NULL, 10));
    for (;;) {
        CHECK_OK(ddp_sampler_next_batch(&s, 4096, batch, &n), NULL);
        if (n == 0) break;
        for (i = 0; i < n; i++) printf("%lld\n", (long long)batch[i]);
    }
    fprintf(stderr, "ddp.h: N=%s permutation %s: %.1f s\n", argv[0], argv[5], tl_now() - t0);
    ddp_sampler_free(&s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 8 && strcmp(argv[1], "slice") == 0) return print_slice(argv + 2);
    if (argc != 1) {
        fprintf(stderr, "usage: sampler_check < cases   |   sampler_check slice N R RANK SEED EPOCH PERMUTATION\n");
        return 2;
    }
    (void)tl_run_ranks;
    (void)tl_rand;
    return check_cases();
}
