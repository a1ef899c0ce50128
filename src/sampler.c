/* [SECTION] sampler: DistributedSampler, MT19937 and torch.randperm, Feistel streaming permutation */
/* Mirrors torch.utils.data.distributed.DistributedSampler (torch/utils/data/distributed.py) and, for its
   shuffle, torch.Generator (at::mt19937) and torch.randperm on the CPU (aten/src/ATen/native/
   TensorFactories.cpp, randperm_cpu). The formulas are in the sampler section of the header (src/sampler.h).

   A rank's k-th index is the element at position j = base + rank + k*R of the dealt-out list; positions
   past N wrap around (torch pads by repeating the list, so padded[j] = perm[j mod N]). base is 0 except
   after a resume at a global position (ddp_sampler_set_global_position): then the rest of the epoch,
   perm[base .. N), is dealt to this sampler's R ranks exactly as torch deals a whole epoch (the same
   padding at the end, or drop_last's cut), so a job saved on one number of ranks continues the same
   epoch on another with every index handed out once. With the same R, base = k*R gives the very
   indices that set_position(k) gives (rank + (k+i)*R = base + rank + i*R), so the rule extends torch's.
   - no shuffle, or the streaming permutation: computed directly from j, no memory.
   - torch's randperm: the whole permutation is made once per epoch, in place, in a buffer of N entries
     (uint32 when N <= 2^32), then compacted to this rank's num_samples entries and shrunk: steady-state
     memory is 4 * N / R bytes, the peak 4 * N. */
#include "internal.h"

#define DDP__SAMPLER_MAGIC 0x53414d50u /* "SAMP" */
/* current torch uses the 64-bit inside-out shuffle from this N on (UINT32_MAX / 20) */
#define DDP__RANDPERM_SPLIT 214748364ull
/* how many steps ahead the shuffles draw (and prefetch) their targets; a power of two */
#define DDP__RANDPERM_AHEAD 64
#define DDP__FEISTEL_MIN_BITS 8 /* the streaming bijection's smallest domain: 2^8 */
#define DDP__FEISTEL_ROUNDS ((int)(sizeof(((ddp_sampler *)0)->feistel_keys) / sizeof(uint64_t)))

/* ---- MT19937: the generator behind torch.Generator on the CPU ----
   manual_seed(s) runs Matsumoto and Nishimura's init_genrand on the low 32 bits of s (torch's at::mt19937,
   the same stream as C++ std::mt19937(s32)). random() is one tempered 32-bit output; random64() is
   (first << 32) | second. The 624-word state is regenerated ("twisted") 624 outputs at a time. */
#define DDP__MT_N 624
#define DDP__MT_M 397

typedef struct ddp__mt19937 {
    uint32_t state[DDP__MT_N];
    int next; /* the next state word to temper; DDP__MT_N = twist first */
} ddp__mt19937;

static void ddp__mt_seed(ddp__mt19937 *g, uint64_t seed) {
    int i;
    g->state[0] = (uint32_t)seed;
    for (i = 1; i < DDP__MT_N; i++)
        g->state[i] = 1812433253u * (g->state[i - 1] ^ (g->state[i - 1] >> 30)) + (uint32_t)i;
    g->next = DDP__MT_N;
}

static uint32_t ddp__mt_mix(uint32_t upper, uint32_t lower, uint32_t far) {
    uint32_t y = (upper & 0x80000000u) | (lower & 0x7fffffffu);
    return far ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
}

static void ddp__mt_twist(ddp__mt19937 *g) {
    uint32_t *mt = g->state;
    int i;
    for (i = 0; i < DDP__MT_N - DDP__MT_M; i++) mt[i] = ddp__mt_mix(mt[i], mt[i + 1], mt[i + DDP__MT_M]);
    for (; i < DDP__MT_N - 1; i++) mt[i] = ddp__mt_mix(mt[i], mt[i + 1], mt[i + DDP__MT_M - DDP__MT_N]);
    mt[DDP__MT_N - 1] = ddp__mt_mix(mt[DDP__MT_N - 1], mt[0], mt[DDP__MT_M - 1]);
    g->next = 0;
}

static uint32_t ddp__mt_random(ddp__mt19937 *g) {
    uint32_t y;
    if (g->next >= DDP__MT_N) ddp__mt_twist(g);
    y = g->state[g->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

static uint64_t ddp__mt_random64(ddp__mt19937 *g) {
    uint64_t hi = ddp__mt_random(g);
    return (hi << 32) | ddp__mt_random(g);
}

/* ---- torch.randperm on the CPU ----
   The permutation lives in a buffer of uint32 (N <= 2^32) or uint64 entries; these accessors hide which. */
static uint64_t ddp__perm_get(const void *p, int wide, uint64_t i) {
    return wide ? ((const uint64_t *)p)[i] : ((const uint32_t *)p)[i];
}

static void ddp__perm_put(void *p, int wide, uint64_t i, uint64_t v) {
    if (wide)
        ((uint64_t *)p)[i] = v;
    else
        ((uint32_t *)p)[i] = (uint32_t)v;
}

static void ddp__perm_prefetch(void *p, int wide, uint64_t i) {
    if (wide)
        DDP__PREFETCH((uint64_t *)p + i);
    else
        DDP__PREFETCH((uint32_t *)p + i);
}

/* Both shuffles below draw their targets DDP__RANDPERM_AHEAD steps early: a target depends only on the
   random stream, not on r, so its cache line can be prefetched while earlier steps run. At large N every
   step is a cache miss, and this overlaps them (about 1.6x faster at N = 1e8). */
static void ddp__perm_identity(void *r, int wide, uint64_t n) {
    uint64_t i;
    if (wide)
        for (i = 0; i < n; i++) ((uint64_t *)r)[i] = i;
    else
        for (i = 0; i < n; i++) ((uint32_t *)r)[i] = (uint32_t)i;
}

/* The swap loop's target for step i: i + random() % (N - i) */
static uint64_t ddp__swap_target(ddp__mt19937 *g, uint64_t n, uint64_t i) {
    uint64_t left = n - i;
    uint32_t x = ddp__mt_random(g);
    return i + (left <= UINT32_MAX ? x % (uint32_t)left : x); /* x < 2^32 <= left: x % left is x */
}

/* The swap loop: torch 2.6 and earlier at every N, current torch below 214748364.
       r[i] = i;  for i in 0 .. N-2: z = random() % (N - i); swap(r[i], r[i + z]) */
static void ddp__randperm_swap(void *r, int wide, uint64_t n, ddp__mt19937 *g) {
    uint64_t ahead[DDP__RANDPERM_AHEAD], i, drawn;
    ddp__perm_identity(r, wide, n);
    for (drawn = 0; drawn + 1 < n && drawn < DDP__RANDPERM_AHEAD; drawn++) {
        ahead[drawn] = ddp__swap_target(g, n, drawn);
        ddp__perm_prefetch(r, wide, ahead[drawn]);
    }
    for (i = 0; i + 1 < n; i++) {
        uint64_t t = ahead[i % DDP__RANDPERM_AHEAD], a = ddp__perm_get(r, wide, i);
        if (drawn + 1 < n) { /* step drawn's target takes the slot step i's just freed */
            ahead[drawn % DDP__RANDPERM_AHEAD] = ddp__swap_target(g, n, drawn);
            ddp__perm_prefetch(r, wide, ahead[drawn % DDP__RANDPERM_AHEAD]);
            drawn++;
        }
        ddp__perm_put(r, wide, i, ddp__perm_get(r, wide, t));
        ddp__perm_put(r, wide, t, a);
    }
}

/* Current torch from N = 214748364 on: the "inside-out" Fisher-Yates shuffle with 64-bit draws
   (pytorch/pytorch#143682, relanded as #144735 in January 2025; torch 2.7 is the first release with it).
       for i in 0 .. N-1: z = random64() % (i + 1); r[i] = r[z]; r[z] = i        (r[i] = i when z = i) */
static void ddp__randperm_inside_out(void *r, int wide, uint64_t n, ddp__mt19937 *g) {
    uint64_t ahead[DDP__RANDPERM_AHEAD], i, drawn;
    for (drawn = 0; drawn < n && drawn < DDP__RANDPERM_AHEAD; drawn++) {
        ahead[drawn] = ddp__mt_random64(g) % (drawn + 1);
        ddp__perm_prefetch(r, wide, ahead[drawn]);
    }
    for (i = 0; i < n; i++) {
        uint64_t z = ahead[i % DDP__RANDPERM_AHEAD];
        if (drawn < n) {
            ahead[drawn % DDP__RANDPERM_AHEAD] = ddp__mt_random64(g) % (drawn + 1);
            ddp__perm_prefetch(r, wide, ahead[drawn % DDP__RANDPERM_AHEAD]);
            drawn++;
        }
        ddp__perm_put(r, wide, i, z == i ? i : ddp__perm_get(r, wide, z)); /* r[i] is not yet written */
        ddp__perm_put(r, wide, z, i);
    }
}

/* Which of the two shuffles torch.randperm(n) runs: current torch switches at 214748364, legacy never. */
static int ddp__randperm_is_inside_out(uint64_t n, int legacy) { return !legacy && n >= DDP__RANDPERM_SPLIT; }

/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) into r. */
static void ddp__randperm(void *r, int wide, uint64_t n, uint64_t seed, int legacy) {
    ddp__mt19937 g;
    ddp__mt_seed(&g, seed);
    if (ddp__randperm_is_inside_out(n, legacy))
        ddp__randperm_inside_out(r, wide, n, &g);
    else
        ddp__randperm_swap(r, wide, n, &g);
}

/* ---- the streaming permutation: a keyed Feistel bijection with cycle walking ----
   The domain is [0, 2^b) with b = max(8, bits of N-1): less than 2N once N > 128. A value is split into a
   high half L (b/2 bits) and a low half R (the other bits); each round maps (L, R) -> (R, L xor F_k(R)),
   where F_k is a 64-bit mixer of R xor the round key, cut to L's width. The halves trade places (and
   widths) every round; every round is invertible, so the whole is a bijection of the domain.
   Cycle walking: apply it again until the value lands below N. That is a bijection of [0, N) (the cycle
   through a start below N comes back to it, so it ends), at fewer than 2 steps on average for N > 128.
   b is at least 8 because Feistel networks on very few bits reach only some permutations (even ones):
   with 2- or 3-bit domains, where small N would land, the positions came out measurably uneven. */
static uint64_t ddp__mix64(uint64_t z) { /* splitmix64's finaliser: a bijection with full avalanche */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The round keys of epoch `epoch`: splitmix64's stream from seed + epoch. */
static void ddp__feistel_keys(const ddp_sampler *s, uint64_t epoch, uint64_t *keys) {
    uint64_t state = s->desc.seed + epoch;
    int r;
    for (r = 0; r < DDP__FEISTEL_ROUNDS; r++) {
        state += 0x9e3779b97f4a7c15ull;
        keys[r] = ddp__mix64(state);
    }
}

static void ddp__feistel_setup(ddp_sampler *s) {
    uint64_t n = s->desc.dataset_size, top = n > 1 ? n - 1 : 0;
    int bits = 0;
    while (bits < 64 && (top >> bits) != 0) bits++; /* top <= INT64_MAX: at most 63 */
    s->feistel_bits = DDP__MAX(DDP__FEISTEL_MIN_BITS, bits);
    ddp__feistel_keys(s, s->epoch, s->feistel_keys);
}

static uint64_t ddp__feistel(const ddp_sampler *s, const uint64_t *keys, uint64_t x) {
    int lbits = s->feistel_bits / 2, rbits = s->feistel_bits - lbits, r;
    uint64_t left = x >> rbits, right = x & ((1ull << rbits) - 1);
    for (r = 0; r < DDP__FEISTEL_ROUNDS; r++) {
        uint64_t f = ddp__mix64(right ^ keys[r]) & ((1ull << lbits) - 1);
        uint64_t new_left = right;
        int w = lbits;
        right = left ^ f;
        left = new_left;
        lbits = rbits; /* the halves trade places, and widths */
        rbits = w;
    }
    return (left << rbits) | right;
}

/* perm[j] of the streaming permutation with round keys `keys` (those of the epoch wanted). */
static uint64_t ddp__streaming_index(const ddp_sampler *s, const uint64_t *keys, uint64_t j) {
    uint64_t x = j;
    do x = ddp__feistel(s, keys, x);
    while (x >= s->desc.dataset_size);
    return x;
}

/* ---- the sampler ---- */

static int ddp__sampler_ok(const ddp_sampler *s) { return s && s->magic == DDP__SAMPLER_MAGIC; }

static ddp_result ddp__sampler_not_initialised(const char *fn) {
    return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                     "%s: the sampler is NULL or not initialised (call ddp_sampler_init first; after "
                     "ddp_sampler_free it must be initialised again)",
                     fn);
}

static ddp_result ddp__sampler_check_desc(const ddp_sampler_desc *d) {
    if (d->num_replicas <= 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: num_replicas is %d; it must be > 0 (usually ddp_world_size(g))",
                         d->num_replicas);
    if (d->rank < 0 || d->rank >= d->num_replicas)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: rank is %d; it must be in [0, %d] for num_replicas %d "
                         "(usually ddp_rank(g))",
                         d->rank, d->num_replicas - 1, d->num_replicas);
    if (d->dataset_size > (uint64_t)INT64_MAX)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: dataset_size %llu does not fit the int64 indices (at most %lld)",
                         (unsigned long long)d->dataset_size, (long long)INT64_MAX);
    if (d->mode != DDP_SAMPLER_TORCH && d->mode != DDP_SAMPLER_EVAL)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: mode %d is not DDP_SAMPLER_TORCH (0) or DDP_SAMPLER_EVAL (1)",
                         (int)d->mode);
    if (d->permutation != DDP_PERMUTATION_TORCH && d->permutation != DDP_PERMUTATION_TORCH_LEGACY &&
        d->permutation != DDP_PERMUTATION_STREAMING)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: permutation %d is not DDP_PERMUTATION_TORCH (0), "
                         "DDP_PERMUTATION_TORCH_LEGACY (1) or DDP_PERMUTATION_STREAMING (2)",
                         (int)d->permutation);
    if (d->mode == DDP_SAMPLER_EVAL && d->drop_last)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: drop_last is set in DDP_SAMPLER_EVAL mode, which hands out every "
                         "index exactly once; clear drop_last, or use DDP_SAMPLER_TORCH to drop the tail");
    return DDP_SUCCESS;
}

/* How many positions torch deals out for an epoch of c indices on the descriptor's R replicas: c padded
   up to a multiple of R, or cut down to one with drop_last; eval mode deals c, no more, no less. At most
   c + R - 1 < 2^64, since c <= INT64_MAX. */
static uint64_t ddp__sampler_dealt(const ddp_sampler_desc *d, uint64_t c) {
    uint64_t r = (uint64_t)d->num_replicas;
    if (d->mode == DDP_SAMPLER_EVAL) return c;
    return (d->drop_last ? c / r : c / r + (c % r != 0)) * r;
}

/* This rank's count (num_samples) and the positions dealt out (total_size) for the part of the epoch from
   global position base on: c = N - base positions are left, dealt as torch deals an epoch of c. */
static void ddp__sampler_count(ddp_sampler *s) {
    uint64_t c = s->desc.dataset_size - s->base, r = (uint64_t)s->desc.num_replicas, rank = (uint64_t)s->desc.rank;
    s->total_size = ddp__sampler_dealt(&s->desc, c);
    if (s->desc.mode == DDP_SAMPLER_EVAL)
        s->num_samples = c > rank ? (c - 1 - rank) / r + 1 : 0;
    else
        s->num_samples = s->total_size / r;
}

DDP_API ddp_result ddp_sampler_init(ddp_sampler *s, const ddp_sampler_desc *d) {
    uint64_t n;
    ddp_result res;
    if (!s || !d)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_init: %s is NULL", s ? "desc" : "sampler");
    memset(s, 0, sizeof *s);
    res = ddp__sampler_check_desc(d);
    if (res != DDP_SUCCESS) return res;
    s->desc = *d;
    n = d->dataset_size;
    ddp__sampler_count(s);
    s->shard_wide = n > (uint64_t)UINT32_MAX + 1; /* the values 0 .. N-1 need 64 bits */
    ddp__feistel_setup(s);
    s->magic = DDP__SAMPLER_MAGIC;
    return DDP_SUCCESS;
}

DDP_API void ddp_sampler_free(ddp_sampler *s) {
    if (!ddp__sampler_ok(s)) return;
    ddp__free(s->shard);
    memset(s, 0, sizeof *s);
}

static int ddp__sampler_shuffles(const ddp_sampler *s) { return !s->desc.no_shuffle && s->desc.dataset_size > 1; }

DDP_API void ddp_sampler_set_epoch(ddp_sampler *s, uint64_t epoch) {
    if (!ddp__sampler_ok(s)) return;
    if (epoch == s->epoch && s->epoch_done && ddp__sampler_shuffles(s))
        ddp__log(NULL, DDP_LOG_WARN,
                 "ddp_sampler_set_epoch(%llu) again after that epoch was handed out: the next epoch repeats "
                 "the same order; pass the new epoch's number",
                 (unsigned long long)epoch);
    s->epoch = epoch;
    s->position = 0;
    s->epoch_done = 0;
    s->pass_ended = 0;
    if (s->base != 0) { /* a resume point of the previous epoch does not carry over */
        s->base = 0;
        ddp__sampler_count(s);
    }
    ddp__feistel_setup(s);
}

DDP_API uint64_t ddp_sampler_epoch(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->epoch : 0; }

DDP_API uint64_t ddp_sampler_num_samples(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->num_samples : 0; }

DDP_API uint64_t ddp_sampler_position(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->position : 0; }

/* The torch permutation must be made (and kept) only when it shuffles and there is something to hand out. */
static int ddp__sampler_materialises(const ddp_sampler *s) {
    return ddp__sampler_shuffles(s) && s->desc.permutation != DDP_PERMUTATION_STREAMING && s->num_samples > 0;
}

/* Hint the kernel to back a large buffer with huge pages: the shuffle touches it at random, and 4 KiB pages
   would make nearly every access a TLB miss as well as a cache miss. */
static void ddp__advise_huge_pages(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (bytes >= 16 * huge && end > begin) madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Keep only this rank's positions base + rank, base + rank + R, ... of the permutation, in order, at its
   start. A position past N (padding) reads perm[j mod N], which the compaction may already have
   overwritten: there is at most one such position per rank (total_size - (N - base) < R), the last, so
   its value is read first. */
static void ddp__sampler_compact(const ddp_sampler *s, void *p) {
    uint64_t n = s->desc.dataset_size, r = (uint64_t)s->desc.num_replicas, first = s->base + (uint64_t)s->desc.rank;
    uint64_t last = s->num_samples - 1, k, tail = 0;
    int padded = first + last * r >= n;
    if (r == 1 && first == 0) return; /* every position is this rank's, none padded */
    if (padded) tail = ddp__perm_get(p, s->shard_wide, (first + last * r) % n);
    for (k = 0; k < s->num_samples - (uint64_t)padded; k++) /* reads position first + k*R >= k: still intact */
        ddp__perm_put(p, s->shard_wide, k, ddp__perm_get(p, s->shard_wide, first + k * r));
    if (padded) ddp__perm_put(p, s->shard_wide, last, tail);
}

/* torch's permutation of epoch `epoch`, whole (N entries), into a new buffer *out that the caller keeps.
   The old shard is freed first, so that it does not add to the peak. */
static ddp_result ddp__sampler_shuffle(ddp_sampler *s, uint64_t epoch, const char *fn, void **out) {
    uint64_t n = s->desc.dataset_size;
    size_t elem = s->shard_wide ? sizeof(uint64_t) : sizeof(uint32_t);
    double t0;
    void *p;
    ddp__free(s->shard);
    s->shard = NULL;
    s->shard_valid = 0;
    p = n <= SIZE_MAX / elem ? ddp__malloc((size_t)n * elem) : NULL;
    if (!p)
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY,
                         "%s: out of memory for the permutation of %llu samples (%.2f GiB; torch's randperm needs "
                         "all of it). DDP_PERMUTATION_STREAMING shuffles without memory (not torch's order)",
                         fn, (unsigned long long)n, (double)n * (double)elem / 1073741824.0);
    ddp__advise_huge_pages(p, (size_t)n * elem);
    t0 = ddp__now();
    ddp__randperm(p, s->shard_wide, n, s->desc.seed + epoch, s->desc.permutation == DDP_PERMUTATION_TORCH_LEGACY);
    ddp__log(NULL, DDP_LOG_DEBUG, "sampler: epoch %llu shuffled %llu indices in %.3f s", (unsigned long long)epoch,
             (unsigned long long)n, ddp__now() - t0);
    *out = p;
    return DDP_SUCCESS;
}

/* Make this epoch's shard (this rank's share, compacted) if it is needed and not there yet. */
static ddp_result ddp__sampler_prepare(ddp_sampler *s, const char *fn) {
    size_t elem = s->shard_wide ? sizeof(uint64_t) : sizeof(uint32_t);
    void *p, *small;
    ddp_result res;
    if (!ddp__sampler_materialises(s) ||
        (s->shard_valid && !s->shard_whole && s->shard_epoch == s->epoch && s->shard_base == s->base))
        return DDP_SUCCESS;
    res = ddp__sampler_shuffle(s, s->epoch, fn, &p);
    if (res != DDP_SUCCESS) return res;
    ddp__sampler_compact(s, p);
    small = DDP_REALLOC(p, (size_t)s->num_samples * elem); /* give the rest back; keep p if that fails */
    s->shard = small ? small : p;
    s->shard_valid = 1;
    s->shard_whole = 0;
    s->shard_epoch = s->epoch;
    s->shard_base = s->base;
    return DDP_SUCCESS;
}

/* padded[j] = perm[j mod N]: position j (below total_size) of the list torch deals out for an epoch, read
   from that epoch's permutation: the shard when it holds the whole of it (torch's randperm), the streaming
   bijection with the epoch's round keys, or none at all (no shuffle). */
static uint64_t ddp__sampler_dealt_at(const ddp_sampler *s, const uint64_t *keys, uint64_t j) {
    uint64_t n = s->desc.dataset_size;
    if (j >= n) j %= n;
    if (!ddp__sampler_shuffles(s)) return j;
    if (s->desc.permutation == DDP_PERMUTATION_STREAMING) return ddp__streaming_index(s, keys, j);
    return ddp__perm_get(s->shard, s->shard_wide, j);
}

/* This rank's k-th index (k < num_samples), the shard made if it is needed: its k-th entry, or computed
   from its position in the dealt-out list. */
static uint64_t ddp__sampler_index(const ddp_sampler *s, uint64_t k) {
    uint64_t j = s->base + (uint64_t)s->desc.rank + k * (uint64_t)s->desc.num_replicas;
    if (ddp__sampler_materialises(s)) return ddp__perm_get(s->shard, s->shard_wide, k);
    return ddp__sampler_dealt_at(s, s->feistel_keys, j);
}

static void ddp__sampler_fill(const ddp_sampler *s, uint64_t first, uint64_t count, int64_t *out) {
    uint64_t k;
    if (ddp__sampler_materialises(s) && !s->shard_wide) { /* the common case, as a plain widening copy */
        const uint32_t *shard = (const uint32_t *)s->shard + first;
        for (k = 0; k < count; k++) out[k] = (int64_t)shard[k];
        return;
    }
    for (k = 0; k < count; k++) out[k] = (int64_t)ddp__sampler_index(s, first + k);
}

DDP_API ddp_result ddp_sampler_indices(ddp_sampler *s, int64_t *out) {
    ddp_result res;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_indices");
    if (!out && s->num_samples > 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_indices: out is NULL (it needs room for %llu "
                         "indices, ddp_sampler_num_samples)", (unsigned long long)s->num_samples);
    res = ddp__sampler_prepare(s, "ddp_sampler_indices");
    if (res != DDP_SUCCESS) return res;
    ddp__sampler_fill(s, 0, s->num_samples, out);
    return DDP_SUCCESS;
}

/* A call of next_batch after the 0 that ended a pass, with no set_epoch (or set_position, ...) since: a new
   pass over the same epoch, from its start, as iterating a torch DistributedSampler again without
   set_epoch recomputes the same list (torch/utils/data/distributed.py, __iter__: seed + epoch). The whole
   epoch, also after a resume point (base): that continued one pass. Warns once per sampler, when the
   order depends on the epoch: forgetting set_epoch is torch's most common sampler bug. */
static void ddp__sampler_new_pass(ddp_sampler *s) {
    if (!s->repeat_warned && ddp__sampler_shuffles(s)) {
        s->repeat_warned = 1;
        ddp__log(NULL, DDP_LOG_WARN,
                 "ddp_sampler_next_batch: a new pass over epoch %llu without ddp_sampler_set_epoch: it repeats "
                 "the previous pass's order, as torch's DistributedSampler does. Call ddp_sampler_set_epoch(s, "
                 "epoch) before every epoch for a new shuffle (ddp_sampler_set_position(s, 0) repeats an epoch "
                 "on purpose). Logged once per sampler",
                 (unsigned long long)s->epoch);
    }
    s->pass_ended = 0;
    s->epoch_done = 0;
    s->position = 0;
    if (s->base != 0) {
        s->base = 0;
        ddp__sampler_count(s);
    }
}

DDP_API ddp_result ddp_sampler_next_batch(ddp_sampler *s, size_t batch_size, int64_t *out, size_t *got) {
    uint64_t count, old_position = 0, old_base = 0;
    ddp_result res;
    int new_pass;
    if (got) *got = 0;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_next_batch");
    if (batch_size == 0 || !out || !got)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_next_batch: %s",
                         batch_size == 0 ? "batch_size is 0; it must be > 0" : !out ? "out is NULL" : "got is NULL");
    new_pass = s->pass_ended;
    if (new_pass) {
        old_position = s->position;
        old_base = s->base;
        ddp__sampler_new_pass(s);
    }
    count = DDP__MIN((uint64_t)batch_size, s->num_samples - s->position);
    if (count == 0) { /* the end of the pass: the 0 that ends a loop over the epoch, once */
        s->epoch_done = 1;
        s->pass_ended = 1;
        return DDP_SUCCESS;
    }
    res = ddp__sampler_prepare(s, "ddp_sampler_next_batch");
    if (res != DDP_SUCCESS) {
        if (new_pass) { /* as it was: the pass stays ended, the position unchanged */
            s->position = old_position;
            s->pass_ended = 1;
            s->epoch_done = 1;
            if (s->base != old_base) {
                s->base = old_base;
                ddp__sampler_count(s);
            }
        }
        return res;
    }
    ddp__sampler_fill(s, s->position, count, out);
    s->position += count;
    if (s->position == s->num_samples) s->epoch_done = 1;
    *got = (size_t)count;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_set_position(ddp_sampler *s, uint64_t position) {
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_set_position");
    if (position > s->num_samples)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_set_position: position %llu is past the end of the epoch (this rank has "
                         "%llu indices per epoch); was the checkpoint saved with another num_replicas or "
                         "dataset_size?",
                         (unsigned long long)position, (unsigned long long)s->num_samples);
    s->position = position;
    s->epoch_done = position == s->num_samples;
    s->pass_ended = 0; /* this pass goes on from position (at num_samples: next_batch ends it) */
    return DDP_SUCCESS;
}

DDP_API uint64_t ddp_sampler_global_position(const ddp_sampler *s) {
    uint64_t g;
    if (!ddp__sampler_ok(s)) return 0;
    if (s->position >= s->num_samples) return s->desc.dataset_size; /* done: nothing of the epoch is left */
    g = s->base + s->position * (uint64_t)s->desc.num_replicas;
    return DDP__MIN(g, s->desc.dataset_size);
}

DDP_API ddp_result ddp_sampler_set_global_position(ddp_sampler *s, uint64_t global_position) {
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_set_global_position");
    if (global_position > s->desc.dataset_size)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_set_global_position: global position %llu is past the end of the epoch "
                         "(dataset_size %llu); was the checkpoint saved with another dataset_size?",
                         (unsigned long long)global_position, (unsigned long long)s->desc.dataset_size);
    s->base = global_position;
    ddp__sampler_count(s);
    s->position = 0;
    s->epoch_done = s->num_samples == 0;
    s->pass_ended = 0;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_resume(ddp_sampler *s, uint64_t epoch, uint64_t global_position) {
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_resume");
    ddp_sampler_set_epoch(s, epoch);
    return ddp_sampler_set_global_position(s, global_position);
}

DDP_API ddp_result ddp_sampler_index_at(ddp_sampler *s, uint64_t k, int64_t *out) {
    ddp_result res;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_index_at");
    if (!out) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_index_at: out is NULL");
    if (k >= s->num_samples)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_index_at: k = %llu, but this rank has %llu indices per epoch",
                         (unsigned long long)k, (unsigned long long)s->num_samples);
    res = ddp__sampler_prepare(s, "ddp_sampler_index_at");
    if (res != DDP_SUCCESS) return res;
    *out = (int64_t)ddp__sampler_index(s, k);
    return DDP_SUCCESS;
}

/* ---- the step-indexed batch (src/ft.h; the rule is in src/sampler.h) ----
   Step s of a view of W takes positions s*G + r + j*W of the epoch's dealt-out list, which is not this
   rank's strided share for any W but R0: the torch permutation is kept whole (shard_whole), and the
   streaming one computed with the round keys of st->epoch, not of the sampler's own epoch. */

static ddp_result ddp__sampler_step_check(const ddp_sampler *s, const ddp_ft_step *st, uint64_t global_batch,
                                          const int64_t *idx, const size_t *n) {
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_step_batch");
    if (!st || !idx || !n)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_step_batch: %s is NULL%s",
                         !st ? "st" : !idx ? "idx" : "n",
                         !st ? " (the step: its step, epoch, rank and world_size)"
                             : !idx ? " (it needs room for ceil(global_batch / st->world_size) indices)" : "");
    if (global_batch == 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_step_batch: global_batch is 0; it must be > 0: the step's indices over "
                         "all ranks, B * %d (num_replicas) for torch's per-rank batch size B",
                         s->desc.num_replicas);
    if (st->world_size < 1)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_step_batch: st->world_size is %d; it must be >= 1 (the number of members "
                         "of the view)",
                         st->world_size);
    if (st->rank < 0 || st->rank >= st->world_size)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_step_batch: st->rank is %d; it must be in [0, %d] for st->world_size %d "
                         "(this member's index in the view)",
                         st->rank, st->world_size - 1, st->world_size);
    return DDP_SUCCESS;
}

/* This rank's share of step st->step: its first position (*first) and how many positions it takes, every
   W-th one from there, below the step's end and the list's length L. 0 from step ceil(L / G) on (which
   also keeps step * G from overflowing). */
static uint64_t ddp__sampler_step_share(const ddp_sampler *s, const ddp_ft_step *st, uint64_t g, uint64_t *first) {
    uint64_t len = ddp__sampler_dealt(&s->desc, s->desc.dataset_size), start, span, r = (uint64_t)st->rank;
    if (st->step >= len / g + (len % g != 0)) return 0;
    start = st->step * g; /* < len */
    span = DDP__MIN(g, len - start);
    *first = start + r;
    return span > r ? (span - 1 - r) / (uint64_t)st->world_size + 1 : 0;
}

/* Make epoch's whole torch permutation if it is needed and not there yet. */
static ddp_result ddp__sampler_prepare_whole(ddp_sampler *s, uint64_t epoch, const char *fn) {
    void *p;
    ddp_result res;
    if (!ddp__sampler_shuffles(s) || s->desc.permutation == DDP_PERMUTATION_STREAMING ||
        (s->shard_valid && s->shard_whole && s->shard_epoch == epoch))
        return DDP_SUCCESS;
    res = ddp__sampler_shuffle(s, epoch, fn, &p);
    if (res != DDP_SUCCESS) return res;
    s->shard = p;
    s->shard_valid = 1;
    s->shard_whole = 1;
    s->shard_epoch = epoch;
    s->shard_base = 0;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_step_batch(ddp_sampler *s, const ddp_ft_step *st, uint64_t global_batch, int64_t *idx,
                                          size_t *n) {
    uint64_t first = 0, count, w, j, keys[DDP__FEISTEL_ROUNDS];
    ddp_result res;
    if (n) *n = 0;
    res = ddp__sampler_step_check(s, st, global_batch, idx, n);
    if (res != DDP_SUCCESS) return res;
    count = ddp__sampler_step_share(s, st, global_batch, &first);
    if (count == 0) return DDP_SUCCESS;
    res = ddp__sampler_prepare_whole(s, st->epoch, "ddp_sampler_step_batch");
    if (res != DDP_SUCCESS) return res;
    ddp__feistel_keys(s, st->epoch, keys);
    w = (uint64_t)st->world_size;
    for (j = 0; j < count; j++) idx[j] = (int64_t)ddp__sampler_dealt_at(s, keys, first + j * w);
    *n = (size_t)count;
    return DDP_SUCCESS;
}
