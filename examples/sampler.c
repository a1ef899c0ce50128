/* sampler: DistributedSampler in C. Each rank gets its own share of a data set's indices, reshuffled
   every epoch, and rank 0 prints every rank's share side by side.

   Shows, on a data set of 10 samples:
     - the default (torch's DistributedSampler(shuffle=True, seed=0, drop_last=False)): strided shards of
       ceil(10 / R) indices, padded by repeating the first ones so every rank has as many;
     - ddp_sampler_set_epoch: a new shuffle each epoch (forget it and every epoch repeats the same order);
     - drop_last: the tail is cut instead of padded;
     - DDP_SAMPLER_EVAL: for evaluation, every index exactly once over the ranks (shards differ by one);
     - resuming mid-epoch: ddp_sampler_set_position continues where a checkpoint left off.
   Nothing here communicates except the printing: every rank computes the same permutation from the seed.
   The indices are those of torch 1.13 (tests/test_interop_sampler.sh compares them).

   Run:  make build/sampler build/ddprun
         build/ddprun --nproc-per-node 3 build/sampler */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 10 };

/* Rank 0 prints every rank's indices (a row each); -1 marks an unused slot. Collective. */
static ddp_result print_shards(ddp_group *g, const char *title, const int64_t *mine, uint64_t n) {
    int64_t row[N], *all;
    int r, world = ddp_world_size(g);
    uint64_t i;
    ddp_result res;
    for (i = 0; i < N; i++) row[i] = i < n ? mine[i] : -1;
    all = (int64_t *)malloc(sizeof(int64_t) * N * (size_t)world);
    if (!all) return DDP_ERR_OUT_OF_MEMORY;
    res = ddp_all_gather(g, row, all, N, DDP_I64);
    if (res == DDP_SUCCESS && ddp_rank(g) == 0) {
        printf("%s\n", title);
        for (r = 0; r < world; r++) {
            printf("  rank %d:", r);
            for (i = 0; i < N && all[r * N + i] >= 0; i++) printf(" %lld", (long long)all[r * N + i]);
            printf("\n");
        }
    }
    free(all);
    return res;
}

/* How often each index appears over all ranks' shards (collective): counts[i] for i < N. */
static ddp_result count_indices(ddp_group *g, const int64_t *mine, uint64_t n, int32_t counts[N]) {
    uint64_t i;
    memset(counts, 0, sizeof(int32_t) * N);
    for (i = 0; i < n; i++) counts[mine[i]]++;
    return ddp_all_reduce(g, counts, N, DDP_I32, DDP_SUM);
}

/* A sampler of this rank over N samples: mode, drop_last. */
static ddp_result make(ddp_group *g, ddp_sampler *s, ddp_sampler_mode mode, int drop_last) {
    ddp_sampler_desc d;
    memset(&d, 0, sizeof d); /* zero = torch's defaults: shuffle, seed 0 */
    d.dataset_size = N, d.num_replicas = ddp_world_size(g), d.rank = ddp_rank(g);
    d.mode = mode, d.drop_last = drop_last;
    return ddp_sampler_init(s, &d);
}

#define TRY(call)                                                                              \
    do {                                                                                       \
        if ((call) != DDP_SUCCESS) {                                                           \
            fprintf(stderr, "rank %d: %s failed: %s\n", ddp_rank(g), #call, ddp_last_error(NULL)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)
#define EXPECT(cond)                                                                 \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "rank %d: expected %s\n", ddp_rank(g), #cond);           \
            return 1;                                                                \
        }                                                                            \
    } while (0)

int main(void) {
    ddp_group *g;
    ddp_sampler s;
    int64_t idx[N], epoch0[N], batch[2];
    int32_t counts[N];
    size_t got;
    uint64_t n, i;
    int world, k, twice = 0, same_order = 1;
    char title[128];
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    world = ddp_world_size(g);
    if (world > N) {
        fprintf(stderr, "run it on 1 to %d ranks\n", N);
        return 1;
    }

    TRY(make(g, &s, DDP_SAMPLER_TORCH, 0));
    n = ddp_sampler_num_samples(&s); /* ceil(10 / world), the same on every rank */
    for (k = 0; k < 2; k++) {
        ddp_sampler_set_epoch(&s, (uint64_t)k); /* call it before every epoch */
        TRY(ddp_sampler_indices(&s, idx));
        snprintf(title, sizeof title, "epoch %d (%llu each, %d padded):", k, (unsigned long long)n,
                 (int)(n * (uint64_t)world - N));
        TRY(print_shards(g, title, idx, n));
        TRY(count_indices(g, idx, n, counts)); /* every index at least once, padding at most once more */
        for (i = 0; i < N; i++) {
            EXPECT(counts[i] == 1 || counts[i] == 2);
            twice += counts[i] == 2;
        }
        if (k == 0) memcpy(epoch0, idx, sizeof idx);
    }
    EXPECT(twice == 2 * (int)(n * (uint64_t)world - N)); /* both epochs padded n * world - N indices */
    for (i = 0; i < n; i++) same_order &= idx[i] == epoch0[i];
    TRY(ddp_all_reduce(g, &same_order, 1, DDP_I32, DDP_MIN));
    EXPECT(!same_order); /* set_epoch(1) shuffled differently from epoch 0 */

    /* resume: as if a checkpoint said "epoch 1, 2 samples done": the next batch is idx[2], idx[3] */
    ddp_sampler_set_epoch(&s, 1);
    TRY(ddp_sampler_set_position(&s, n >= 2 ? 2 : n));
    TRY(ddp_sampler_next_batch(&s, 2, batch, &got));
    for (i = 0; i < got; i++) EXPECT(batch[i] == idx[2 + i]);
    if (ddp_rank(g) == 0) printf("resumed at epoch 1, position 2: rank 0 continues with its indices 2 and 3\n");
    ddp_sampler_free(&s);

    TRY(make(g, &s, DDP_SAMPLER_TORCH, 1)); /* drop_last: floor(10 / world) each, the tail cut */
    ddp_sampler_set_epoch(&s, 0);
    n = ddp_sampler_num_samples(&s);
    TRY(ddp_sampler_indices(&s, idx));
    TRY(print_shards(g, "drop_last, epoch 0 (the same shuffle, the tail cut):", idx, n));
    TRY(count_indices(g, idx, n, counts));
    for (i = 0, k = 0; i < N; i++) {
        EXPECT(counts[i] <= 1);
        k += counts[i];
    }
    EXPECT(k == (int)(N / world) * world);
    ddp_sampler_free(&s);

    TRY(make(g, &s, DDP_SAMPLER_EVAL, 0)); /* evaluation: no padding, no duplicates */
    n = ddp_sampler_num_samples(&s);
    TRY(ddp_sampler_indices(&s, idx));
    TRY(print_shards(g, "DDP_SAMPLER_EVAL (every index once):", idx, n));
    TRY(count_indices(g, idx, n, counts));
    for (i = 0; i < N; i++) EXPECT(counts[i] == 1);
    ddp_sampler_free(&s);

    if (ddp_rank(g) == 0) printf("sampler: every check passed\n");
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
