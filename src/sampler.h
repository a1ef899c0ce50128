/* [SECTION] sampler: torch.utils.data.distributed.DistributedSampler, bit-exact; eval and streaming modes */
/* Mirrors torch.utils.data.distributed.DistributedSampler: each rank gets its share of a dataset's indices
   for one epoch. No communication: every rank computes the same permutation from the same seed and takes
   its own slice. A zero-initialised descriptor (plus dataset_size, num_replicas, rank) is PyTorch's default
   DistributedSampler(shuffle=True, seed=0, drop_last=False), and the indices are identical to PyTorch's:

       N = dataset_size, R = num_replicas
       num_samples = drop_last ? floor(N / R) : ceil(N / R);    total_size = num_samples * R
       perm        = shuffle ? torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch))
                             : [0, 1, ..., N-1]
       padded      = drop_last ? perm[:total_size] : perm repeated until it is total_size long
       this rank   = padded[rank], padded[rank + R], padded[rank + 2R], ...      (strided, num_samples of them)

   The generator is MT19937 seeded with the low 32 bits of seed + epoch (as torch's manual_seed does; a
   negative Python seed is the same number as uint64_t: pass (uint64_t)(int64_t)seed). Only the low 32 bits
   matter, so seed + epoch wrapping around 2^64 changes nothing.

   Beyond PyTorch:
   - DDP_SAMPLER_EVAL: every index exactly once across the ranks (no padding, no duplicates, nothing dropped);
     shard sizes differ by at most one. Padding duplicates distort evaluation metrics; this mode does not.
     Rank r gets perm[r], perm[r + R], ... below N: the same order as the default mode, without the padding.
   - Resume mid-epoch: ddp_sampler_position / ddp_sampler_set_position (a checkpoint saves epoch + position).
   - Resume on another number of ranks (torch restarts the epoch): ddp_sampler_global_position saves how
     much of the epoch every rank together consumed; ddp_sampler_resume continues the same epoch on any
     num_replicas, every index of the epoch handed out once across the change (see below).
   - DDP_PERMUTATION_STREAMING: a keyed Feistel permutation with O(1) memory and random access to any
     index, for datasets too large to shuffle in memory (>= 1e9 samples). NOT the same order as PyTorch's.
   - Batches indexed by step (ddp_sampler_step_batch, below), for fault-tolerant training (src/ft.h): a
     step's global batch split over any number of ranks; on num_replicas ranks it is torch's order.
   - The default permutation holds 4 bytes per sample while it shuffles (8 when N > 2^32; torch holds 8 in
     its tensor plus a Python list), then keeps only this rank's share.

   A training loop:
       ddp_sampler_desc d = {0};
       ddp_sampler s;
       d.dataset_size = n; d.num_replicas = ddp_world_size(g); d.rank = ddp_rank(g);
       if (ddp_sampler_init(&s, &d) != DDP_SUCCESS) { fprintf(stderr, "%s\n", ddp_last_error(NULL)); ... }
       for (epoch = 0; epoch < epochs; epoch++) {
           int64_t batch[64];
           size_t got;
           ddp_sampler_set_epoch(&s, epoch);                  // a new shuffle each epoch, as in PyTorch;
                                                              // forgotten: the same order again (warned)
           while ((r = ddp_sampler_next_batch(&s, 64, batch, &got)) == DDP_SUCCESS && got > 0)
               train_on(batch, got);
           if (r != DDP_SUCCESS) ...                          // out of memory for the permutation
       }
       ddp_sampler_free(&s);

   Thread safety: a sampler is used by one thread at a time; different samplers are independent (there is
   no global state). Errors go to ddp_last_error(NULL), the calling thread's message. */

/* How the indices are divided between the ranks. */
typedef enum ddp_sampler_mode {
    DDP_SAMPLER_TORCH = 0, /* PyTorch's: equal shards, padded by repeating indices (or cut with drop_last) */
    DDP_SAMPLER_EVAL       /* evaluation: every index exactly once, shards differ by at most one; no drop_last */
} ddp_sampler_mode;

/* Which permutation shuffles the indices (when no_shuffle is 0). */
typedef enum ddp_sampler_permutation {
    /* torch.randperm of current PyTorch (2.7 and later): the 32-bit swap loop below N = 214748364
       (UINT32_MAX / 20), a 64-bit inside-out Fisher-Yates shuffle from there on. */
    DDP_PERMUTATION_TORCH = 0,
    /* torch.randperm of PyTorch 2.6 and earlier (1.13 included): the 32-bit swap loop at every N. Equal to
       DDP_PERMUTATION_TORCH below N = 214748364. */
    DDP_PERMUTATION_TORCH_LEGACY,
    /* A keyed Feistel bijection on [0, N) (8 rounds, cycle walking), keyed by all 64 bits of seed + epoch.
       No memory, any index computable on its own. Uniform-looking but NOT PyTorch's order. */
    DDP_PERMUTATION_STREAMING
} ddp_sampler_permutation;

/* ddp_sampler_init's descriptor. Zero-initialised fields mean PyTorch's defaults; dataset_size,
   num_replicas (> 0) and rank (0 <= rank < num_replicas) must be set. */
typedef struct ddp_sampler_desc {
    uint64_t dataset_size; /* N: indices are 0 .. N-1 (at most INT64_MAX). 0 is allowed (empty epochs, as torch) */
    int num_replicas;      /* R > 0: usually ddp_world_size(g) */
    int rank;              /* this rank, 0 <= rank < R: usually ddp_rank(g) */
    uint64_t seed;         /* 0 = torch's default seed */
    int drop_last;         /* nonzero: drop the tail instead of padding (DDP_SAMPLER_TORCH only) */
    int no_shuffle;        /* nonzero: indices in order (torch's shuffle=False); 0 = shuffle */
    ddp_sampler_mode mode;               /* 0 = DDP_SAMPLER_TORCH */
    ddp_sampler_permutation permutation; /* 0 = DDP_PERMUTATION_TORCH */
} ddp_sampler_desc;

/* A sampler: a plain struct the caller owns (on the stack, in a struct, ...). Every field is private: use
   the functions below. Do not copy an initialised sampler (the copy would share its memory); init another. */
typedef struct ddp_sampler {
    uint32_t magic;             /* set by ddp_sampler_init, cleared by ddp_sampler_free */
    ddp_sampler_desc desc;      /* the validated descriptor */
    uint64_t epoch;             /* set by ddp_sampler_set_epoch */
    uint64_t position;          /* indices handed out by ddp_sampler_next_batch this epoch (since base) */
    uint64_t base;              /* the global position this rank's share starts from (0: the epoch's start) */
    uint64_t num_samples;       /* this rank's count per epoch */
    uint64_t total_size;        /* positions dealt out: num_samples * R (eval: N) */
    void *shard;                /* this rank's shuffled indices (uint32 or uint64 each), or NULL */
    int shard_wide;             /* shard entries are uint64 (N > 2^32) */
    int shard_valid;            /* shard holds the indices of shard_epoch */
    int shard_whole;            /* ... all N of them, the whole permutation (ddp_sampler_step_batch's) */
    uint64_t shard_epoch;
    uint64_t shard_base;
    int epoch_done;             /* the current epoch was handed out to its end */
    int pass_ended;             /* next_batch returned the 0 that ends a pass: its next call starts a new one */
    int repeat_warned;          /* the warning for a new pass without set_epoch was logged (once per sampler) */
    int feistel_bits;           /* streaming: the bijection's domain is [0, 2^feistel_bits) */
    uint64_t feistel_keys[8];   /* streaming: one key per round, from seed + epoch */
} ddp_sampler;

/* ddp_sampler_init: check the descriptor and set up a sampler at epoch 0, position 0. Allocates nothing
   (the permutation is made on first use in an epoch, see ddp_sampler_next_batch).
   Parameters: s (caller-owned, overwritten; free an initialised one first), d (the descriptor).
   Return: DDP_SUCCESS, or DDP_ERR_INVALID_ARGUMENT (num_replicas <= 0, rank outside [0, num_replicas),
           dataset_size > INT64_MAX, drop_last in DDP_SAMPLER_EVAL, an unknown mode or permutation, NULL
           pointers) with ddp_last_error(NULL) naming the field. s is then not initialised.
   Thread safety: touches only s and this thread's error message. */
DDP_API ddp_result ddp_sampler_init(ddp_sampler *s, const ddp_sampler_desc *d);

/* ddp_sampler_free: release the sampler's memory; s is then not initialised. NULL, a zeroed or an already
   freed sampler is a no-op. */
DDP_API void ddp_sampler_free(ddp_sampler *s);

/* ddp_sampler_set_epoch: start epoch `epoch` (torch's set_epoch): the shuffle uses seed + epoch, and the
   position goes back to 0. Call it before every epoch with a new number: without it every epoch repeats
   the same order, as in torch (next_batch then starts a new pass over the same epoch and warns once, see
   below; calling set_epoch again with the same epoch after a finished, shuffled epoch also warns). Cheap:
   the permutation is made on first use. Ignores a sampler that is not initialised. */
DDP_API void ddp_sampler_set_epoch(ddp_sampler *s, uint64_t epoch);

/* ddp_sampler_epoch: the epoch set last (0 after init). */
DDP_API uint64_t ddp_sampler_epoch(const ddp_sampler *s);

/* ddp_sampler_num_samples: how many indices this rank gets per epoch (torch's len(sampler)); the same
   every epoch. In DDP_SAMPLER_EVAL it differs between ranks by at most one. 0 when s is not initialised. */
DDP_API uint64_t ddp_sampler_num_samples(const ddp_sampler *s);

/* ddp_sampler_indices: all of this rank's indices for the current epoch, in order (list(iter(sampler)) in
   PyTorch). Does not move the position.
   Parameters: out (room for ddp_sampler_num_samples(s) indices; may be NULL when that is 0).
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY when the permutation does not fit; DDP_ERR_INVALID_ARGUMENT
           for a sampler that is not initialised or a NULL out. */
DDP_API ddp_result ddp_sampler_indices(ddp_sampler *s, int64_t *out);

/* ddp_sampler_next_batch: the next (up to) batch_size indices of this epoch, from the current position;
   the position moves past them. *got is batch_size, less for the last batch of the epoch, and 0 once at
   the end of the pass: that 0 is the end of a `for` loop over torch's sampler (StopIteration), so
   `while (next_batch(...) == DDP_SUCCESS && got)` runs one epoch. Allocates nothing, except at the first
   call of a shuffled epoch with a torch permutation, which makes the permutation (the slow step: about
   3 s and 4 bytes per sample at N = 1e8 on a 2-core VM, where torch takes 28 s and 4.8 GiB; later calls
   are copies).
   After that 0, without ddp_sampler_set_epoch (or set_position, set_global_position, resume) in between,
   the next call starts a NEW PASS over the same epoch, as iterating a torch DistributedSampler again
   without set_epoch does: position 0, the same indices in the same order, padding and drop_last alike
   (after a resume point, ddp_sampler_set_global_position, the new pass is the whole epoch, as torch's
   would be: the resume point continues one pass only). Forgetting set_epoch is thus torch's bug, an
   order repeated every epoch, not an empty epoch. When the order depends on the epoch (shuffled and
   N > 1) such a new pass logs a warning naming ddp_sampler_set_epoch, once per sampler (the first time;
   a sampler of no_shuffle, whose order set_epoch would not change, does not warn). It is logged without a
   group: DDP_LOG_LEVEL's level, warn by default, on stderr. To go over the same epoch again on purpose,
   without the warning: ddp_sampler_set_position(s, 0).
   Parameters: batch_size (> 0), out (room for batch_size indices), got (receives the count).
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT (batch_size 0, NULL pointers, a
           sampler that is not initialised). On error *got is 0 and the position is unchanged. */
DDP_API ddp_result ddp_sampler_next_batch(ddp_sampler *s, size_t batch_size, int64_t *out, size_t *got);

/* ddp_sampler_position: how many of this epoch's indices next_batch has handed out (0 .. num_samples).
   Save it with the epoch in a checkpoint to resume mid-epoch (ddp_resume_state's sampler_position and
   epoch). 0 when s is not initialised. */
DDP_API uint64_t ddp_sampler_position(const ddp_sampler *s);

/* ddp_sampler_set_position: continue the current epoch from `position` (resume: set_epoch(saved epoch),
   then set_position(saved position); the next batch is the one that came next before). The position
   counts this rank's indices (from the resume point after ddp_sampler_set_global_position), so resume
   with the same num_replicas and rank; on another num_replicas use ddp_sampler_resume (below).
   set_position(num_samples) resumes at the epoch's very end: next_batch returns the 0 that ends the pass.
   set_position(0) goes over the current epoch again (a new pass, without next_batch's warning).
   Return: DDP_SUCCESS, or DDP_ERR_INVALID_ARGUMENT when position > num_samples or s is not initialised. */
DDP_API ddp_result ddp_sampler_set_position(ddp_sampler *s, uint64_t position);

/* ---- Resume on another number of ranks ----
   The epoch's dealt-out list is perm padded to total_size (or cut, with drop_last); rank r takes
   positions r, r + R, r + 2R, ... After every rank took k indices (DDP's ranks move in lockstep), the
   first G = k * R positions of the list are consumed: G is the GLOBAL position. A sampler for any number
   of replicas M continues from G: the rest of the epoch, perm[G .. N), is dealt to its M ranks as torch
   deals a whole epoch of N - G indices (drop_last included): new rank r' takes perm[G + r'], perm[G + r' + M], ...
   (num_samples = ceil((N - G) / M), or floor with drop_last), and the padding, as in torch, comes only
   at the end, repeating the epoch's first indices (perm[(G + j) mod N]). So across the resize:
     - without drop_last, every index of the epoch is handed out exactly once, plus fewer than M padding
       repeats at the very end (none when M divides N - G), as torch's own padding;
     - with drop_last, no index twice; the last (N - G) mod M indices are dropped, as torch drops a tail;
     - DDP_SAMPLER_EVAL: every index exactly once.
   With M = R the continuation is the very list the old ranks would have gone on with (the same indices
   as ddp_sampler_set_position(G / R)), so the rule extends torch's order rather than changing it.

   ddp_sampler_global_position: G for this sampler now: base + position * num_replicas (base: the global
   position it resumed from, 0 at the start of an epoch); dataset_size once this rank's share of the epoch
   is done (nothing of the epoch is left). Save rank 0's value (ddp_resume_state.sampler_global_position);
   it is the same on every rank while they move in lockstep. 0 when s is not initialised.
   ddp_sampler_set_global_position: continue the current epoch from global position G (any num_replicas
   saved it); this rank's num_samples becomes its share of the rest, position 0, and ddp_sampler_indices /
   next_batch / index_at hand out that share. ddp_sampler_set_epoch goes back to the whole epoch.
   ddp_sampler_resume(s, epoch, G): ddp_sampler_set_epoch(s, epoch), then set_global_position(s, G).
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT when G > dataset_size or s is not initialised. */
DDP_API uint64_t ddp_sampler_global_position(const ddp_sampler *s);
DDP_API ddp_result ddp_sampler_set_global_position(ddp_sampler *s, uint64_t global_position);
DDP_API ddp_result ddp_sampler_resume(ddp_sampler *s, uint64_t epoch, uint64_t global_position);

/* ddp_sampler_index_at: this rank's k-th index of the current epoch (the k-th element of
   ddp_sampler_indices), without moving the position. With DDP_PERMUTATION_STREAMING or no_shuffle it is
   computed on its own in O(1) time and memory; with a torch permutation the first call of an epoch makes
   the permutation, as next_batch does.
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT when k >= num_samples, out is NULL
           or s is not initialised. */
DDP_API ddp_result ddp_sampler_index_at(ddp_sampler *s, uint64_t k, int64_t *out);

/* ---- Batches indexed by step, for any number of ranks (fault tolerance, src/ft.h) ----
   The epoch's dealt-out list is the one above for the descriptor's num_replicas R0: perm padded by
   repeating it (or cut, with drop_last) to L = total_size positions; eval mode: perm itself, L = N. With a
   global batch of G indices, step s covers the positions [s*G, (s+1)*G) of that list, and rank r of a
   view of W members takes
       s*G + r, s*G + r + W, s*G + r + 2W, ...        (those below (s+1)*G and below L)
   So:
   - with W = R0 and G = B*R0 (B: the per-rank batch size), rank r's share of step s is torch's per-rank
     batch s: indices [s*B, (s+1)*B) of its list, since rank r's k-th index sits at position r + k*R0;
   - any W splits the same positions: step s's global batch is the same whatever the view's size, the
     shares of a step differ by at most one, and over an epoch every position is taken exactly once
     however the view changes between steps (a REDO runs step s again in the new view, on the same batch);
   - an epoch has ceil(L / G) steps; from step ceil(L / G) on the share is empty.
   R0 fixes the epoch's padding: in fault-tolerant mode it is the world size of the first view, on every
   member (joiners too, whose rank in the view may be R0 or more: the descriptor's rank is not used here,
   st->rank is).

   ddp_sampler_step_batch: this rank's share of step st->step's global batch in epoch st->epoch, in
   position order. It reads st's step, epoch, rank and world_size, and follows st->epoch: the shuffle is
   that of seed + st->epoch, as after ddp_sampler_set_epoch(st->epoch) (fault-tolerant mode has no
   set_epoch). It neither reads nor moves the sampler's own epoch and position (set_epoch, next_batch).
   *n is 0 past the epoch's last step: then start the next epoch (st->epoch++, st->step = 0).
   Memory: with a torch permutation the first call of an epoch makes the whole permutation and keeps it,
   4 bytes per sample (8 when N > 2^32), as much as the shuffle's peak and R0 times what next_batch keeps:
   a view of any size reads any position. The streaming permutation and no_shuffle need no memory. Calls
   of indices, next_batch or index_at on the same sampler in between make the permutation again (the
   slow step): give each use its own sampler.
   Parameters: s (initialised), st (the step; st->world_size >= 1, 0 <= st->rank < st->world_size),
               global_batch (G > 0: the step's indices over all ranks; B * R0 for torch's per-rank batch B),
               idx (room for ceil(G / st->world_size) indices: the most a share holds), n (receives the count).
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY (the permutation does not fit); DDP_ERR_INVALID_ARGUMENT
           (NULL pointers, a sampler that is not initialised, G = 0, world_size < 1, rank outside
           [0, world_size)), with ddp_last_error(NULL) naming it. On error *n is 0. */
DDP_API ddp_result ddp_sampler_step_batch(ddp_sampler *s, const ddp_ft_step *st, uint64_t global_batch, int64_t *idx,
                                          size_t *n);
