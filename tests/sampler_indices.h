/* What the sampler tests (test_sampler, test_sampler_step) share. Include after testlib.h. */
#ifndef DDP_TEST_SAMPLER_INDICES_H
#define DDP_TEST_SAMPLER_INDICES_H

/* A training sampler's descriptor: n samples, `replicas` ranks, this rank, the seed; the rest torch's defaults. */
static ddp_sampler_desc desc_of(uint64_t n, int replicas, int rank, uint64_t seed) {
    ddp_sampler_desc d;
    memset(&d, 0, sizeof d);
    d.dataset_size = n;
    d.num_replicas = replicas;
    d.rank = rank;
    d.seed = seed;
    return d;
}

/* All of one sampler's indices for `epoch` (caller frees); *count receives how many. */
static int64_t *indices_of(const ddp_sampler_desc *d, uint64_t epoch, uint64_t *count) {
    ddp_sampler s;
    int64_t *out;
    CHECK_OK(ddp_sampler_init(&s, d), NULL);
    ddp_sampler_set_epoch(&s, epoch);
    *count = ddp_sampler_num_samples(&s);
    out = (int64_t *)malloc((size_t)(*count ? *count : 1) * sizeof *out);
    CHECK(out, "malloc");
    CHECK_OK(ddp_sampler_indices(&s, out), NULL);
    ddp_sampler_free(&s);
    return out;
}

#endif
