/* A rank's set-up and final staging checks, shared by the harness tests of the cpu backend's device paths
   (test_cuda_devbuf, test_cuda_checkpoint). Include after testlib.h and cuda_runtime.h. */
#ifndef DDP_TEST_DEVICE_RANKS_H
#define DDP_TEST_DEVICE_RANKS_H

/* A fresh stream in *stream, ddp_init from the environment and ddp_set_stream(stream) on the group; *before
   gets the harness's copy counters. */
static ddp_group *device_rank_begin(cudaStream_t *stream, ddp_harness::memory_stats_t *before) {
    ddp_group *g = NULL;
    *before = ddp_harness::memory_stats;
    CHECK(cudaStreamCreate(stream) == cudaSuccess, "cudaStreamCreate");
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK_OK(ddp_set_stream(g, *stream), g);
    return g;
}

/* After the rank's tests: staging copies were queued both ways (device to host and back), none from pageable
   host memory (pinned only), the last one on the group's stream; then the group and the stream go. */
static void device_rank_end(ddp_group *g, cudaStream_t stream, const ddp_harness::memory_stats_t &before) {
    const ddp_harness::memory_stats_t &now = ddp_harness::memory_stats;
    CHECK(now.async_d2h > before.async_d2h && now.async_h2d > before.async_h2d, "no staging copies were queued");
    CHECK(now.pageable_async == before.pageable_async, "%llu async copies used pageable host memory, not pinned",
          (unsigned long long)(now.pageable_async - before.pageable_async));
    CHECK(now.last_stream == stream, "the last staging copy was not on the group's stream");
    CHECK_OK(ddp_destroy(g), NULL);
    cudaStreamDestroy(stream);
}

#endif
