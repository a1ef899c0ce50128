// Independent reference for the large-N regime of torch.randperm, written from PyTorch's current source
// (aten/src/ATen/native/TensorFactories.cpp, randperm_cpu; at::CPUGeneratorImpl::random64) with the C++
// standard library's std::mt19937, which is the engine torch.Generator runs (init_genrand of the seed's low
// 32 bits). It shares no code with ddp.h. Prints one rank's DistributedSampler indices (drop_last=False),
// one per line:
//     sampler_ref N R RANK SEED EPOCH current|legacy
// current: torch >= 2.7: the swap loop below N = 214748364 (UINT32_MAX / 20), inside-out with random64 above.
// legacy:  torch <= 2.6 (1.13): the swap loop at every N.
// The draws come first, a chunk at a time, so that the memory they will touch can be prefetched (without
// it this takes minutes at N = 2e8); the loops themselves are torch's, statement for statement.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

static const int64_t kChunk = 64;

int main(int argc, char **argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: sampler_ref N R RANK SEED EPOCH current|legacy\n");
        return 2;
    }
    const int64_t n = std::strtoll(argv[1], nullptr, 10), replicas = std::atoll(argv[2]), rank = std::atoll(argv[3]);
    const uint64_t seed = std::strtoull(argv[4], nullptr, 10) + std::strtoull(argv[5], nullptr, 10);
    const bool legacy = std::strcmp(argv[6], "legacy") == 0;
    std::mt19937 engine(static_cast<uint32_t>(seed));
    const size_t bytes = (static_cast<size_t>(n) * sizeof(uint32_t) + (2 << 20)) & ~size_t((2 << 20) - 1);
    uint32_t *r = static_cast<uint32_t *>(std::aligned_alloc(2 << 20, bytes));  // n < 2^32 here
    std::vector<int64_t> z(kChunk);
    if (!r) return 3;
    madvise(r, bytes, MADV_HUGEPAGE);  // fewer TLB misses in the random accesses; results do not depend on it
    if (legacy || n < static_cast<int64_t>(std::numeric_limits<uint32_t>::max() / 20)) {
        for (int64_t i = 0; i < n; i++) r[i] = static_cast<uint32_t>(i);
        for (int64_t base = 0; base < n - 1; base += kChunk) {
            const int64_t m = std::min(kChunk, n - 1 - base);
            for (int64_t k = 0; k < m; k++) {
                z[k] = engine() % (n - (base + k));
                __builtin_prefetch(&r[base + k + z[k]]);
            }
            for (int64_t k = 0; k < m; k++) {
                const int64_t i = base + k;
                std::swap(r[i], r[z[k] + i]);
            }
        }
    } else {
        for (int64_t base = 0; base < n; base += kChunk) {
            const int64_t m = std::min(kChunk, n - base);
            for (int64_t k = 0; k < m; k++) {
                uint64_t hi = engine(), lo = engine();  // random64(): the first draw is the high word
                z[k] = static_cast<int64_t>(((hi << 32) | lo) % static_cast<uint64_t>(base + k + 1));
                __builtin_prefetch(&r[z[k]]);
            }
            for (int64_t k = 0; k < m; k++) {
                const int64_t i = base + k;
                r[i] = static_cast<uint32_t>(i);
                r[i] = r[z[k]];
                r[z[k]] = static_cast<uint32_t>(i);
            }
        }
    }
    const int64_t num_samples = (n + replicas - 1) / replicas, total = num_samples * replicas;
    for (int64_t j = rank; j < total; j += replicas) std::printf("%u\n", r[j % n]);
    std::free(r);
    return 0;
}
