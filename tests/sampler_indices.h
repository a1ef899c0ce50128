/* What the sampler tests (test_sampler, test_sampler_step) share. Include after testlib.h. */
#ifndef DDP_TEST_SAMPLER_INDICES_H
#define DDP_TEST_SAMPLER_INDICES_H

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
