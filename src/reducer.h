/* [SECTION] reducer: DistributedDataParallel's gradient Reducer (bucketed, overlapped all-reduce) */
/* Mirrors torch.nn.parallel.DistributedDataParallel and its C++ Reducer (torch/csrc/distributed/c10d/
   reducer.cpp) as an explicit C API. PyTorch finds the parameters by walking the module and learns that a
   gradient is ready from an autograd hook; here the program registers each parameter and calls
   ddp_reducer_grad_ready(r, i) where the hook would fire: right after it has finished writing parameter
   i's gradient in its backward pass.

   A training step:
       ddp_reducer_desc d = {0};                        // 25 MiB buckets, 1 MiB first bucket, no extras
       ddp_reducer *red;
       ddp_reducer_create(g, &d, &red);
       ddp_reducer_add_param(red, "fc1.weight", w1, dw1, 64 * 32, DDP_F32, &i_w1);   // ... every parameter
       ddp_reducer_add_buffer(red, "bn.running_mean", mean, 64, DDP_F32);           // optional
       ddp_reducer_finalize(red);        // same model on every rank? then rank 0's weights everywhere
       for (step = 0; step < steps; step++) {
           forward(...);
           ddp_reducer_begin_backward(red);
           // backward, last layer first: write (or add to) each gradient, then say it is ready
           backward_layer3(...);  ddp_reducer_grad_ready(red, i_w3);  ddp_reducer_grad_ready(red, i_b3);
           ...
           ddp_reducer_end_backward(red);   // every gradient is now the average over the ranks
           sgd_step(...);  ddp_reducer_zero_grad(red);
       }
       ddp_reducer_destroy(red);

   What happens, as in PyTorch:
   - Buckets. Gradients are packed into flat buckets of one dtype each, in reverse registration order (the
     order backward usually produces them). A bucket closes when its size reaches the limit; the parameter
     that crosses the limit stays in it. The first bucket's limit is first_bucket_bytes (1 MiB), later ones
     bucket_cap_bytes (25 MiB), so communication starts early and then runs in large messages.
     After the first synchronised backward the buckets are rebuilt once, in the order the gradients were
     actually ready on rank 0 (broadcast, so every rank rebuilds alike); not with find_unused_parameters.
   - Overlap. grad_ready copies the gradient into its bucket, multiplied by 1/world_size (the average is
     taken before the sum, as PyTorch does; by this rank's share of the samples in a pass weighted by
     ddp_reducer_set_local_samples, see "Local samples"); when a bucket's last gradient arrives its
     asynchronous SUM all-reduce starts, while backward continues. Buckets start strictly in order, so
     every rank issues the same collectives in the same order. end_backward waits for the rest and copies
     the results back.
   - no_sync: ddp_reducer_set_sync(r, 0) makes the following backward passes local: gradients accumulate
     in the program's buffers (the program adds to them), and the next synchronised backward averages the
     accumulated sum.
   - find_unused_parameters: a parameter that got no gradient since the last synchronised backward counts
     as zero on this rank; a "used" map is all-reduced after the buckets, and the gradient of a parameter
     that no rank used is left exactly as it was. ddp_reducer_param_used(r, i) says afterwards whether any
     rank used parameter i (torch: its .grad is not None; an optimizer that skips such parameters asks it).
     Without the option, a missing gradient is an error that names the parameters (PyTorch's "Expected to
     have finished reduction in the prior iteration ...").
   - gradient_as_bucket_view: the gradient memory is the bucket itself (no copy in or out, half the memory).
     The program then writes gradients where ddp_reducer_grad(r, i) points.
   - Flat gradient memory (llm.c keeps every gradient in one grads_memory): when the gradients of a bucket
     lie side by side in the program's memory (in any order; registering them in memory order gives that),
     that range IS the bucket: gradients are scaled by 1/world_size and reduced where they are, with no copy
     in or out and the program's layout kept, and a range inside one ddp_alloc block is reduced single-copy
     over shared memory. Automatic; statistics.flat_buckets counts such buckets. A bucket whose gradients
     have gaps or overlaps copies, as before. (After the rebuild a bucket stays flat when the ready order
     keeps its gradients adjacent, as reverse registration order does.)
   - Compression: comm_dtype DDP_F16 / DDP_BF16 sends the buckets in half precision, like PyTorch's
     fp16_compress_hook / bf16_compress_hook (cast, divide by the world size, all-reduce, cast back).
   - Device memory on the cpu and mpi backends (a build with -DDDP_CUDA; torch's DDP over Gloo with CUDA
     tensors): parameters and gradients may be device memory. Buckets stay in host memory; each copy
     between a gradient and its bucket is staged through the group's pinned memory on its stream
     (ddp_set_stream): grad_ready copies the gradient to the host after the work queued on that stream
     (waiting for it), end_backward queues the averaged values back on the stream; flat device gradients
     are a bucket in device memory that each all-reduce stages. Exact (the same host arithmetic), and
     slow: a stream synchronisation per gradient. For several ranks on one GPU and for tests; the nccl
     backend keeps buckets on the device.

   - Uneven inputs (torch's `with model.join():`, the Join context manager): with uneven_inputs = 1 ranks
     may run out of data at different steps. Each rank with data announces every backward pass (and every
     ddp_reducer_broadcast_buffers) in one small all_gather; a rank without data calls ddp_reducer_join(r),
     which answers those rounds as the others' steps need: zeros into every bucket's all-reduce of a
     synchronised pass (nothing for a no_sync pass; the buffer broadcast for a buffer broadcast), until every
     rank has joined. Gradients are divided by the INITIAL world size (torch's divide_by_initial_world_size
     = True), so a step's average is the sum over the ranks that still had data / world size. When the last
     rank joins, every rank gets the parameters and buffers of the highest-ranked of the last joiners (torch's
     _sync_final_model), so the ranks that stopped early end with the trained model. With uneven_inputs,
     buffers come from the highest rank that still has data (torch's _find_common_rank), not rank 0.
     Every rank calls ddp_reducer_join when its data ends, the last ones too (they return at once):
         for (batch = 0; batch < my_batches; batch++) { forward; begin_backward; ...; end_backward; step; }
         ddp_reducer_join(red);          // DDP_SUCCESS once every rank has joined; models equal again
     ddp_reducer_join is the loop of ddp_reducer_join_step(r, &all_joined), which shadows ONE synchronised
     pass of the others and returns (all_joined = 0), or returns all_joined = 1 once every rank has joined;
     the program writes that loop itself under zero_stage (see "ZeRO" below), where the joined rank must
     run its optimizer on its shards between the steps.
     join_fail_early = 1 (torch's throw_on_early_termination): instead, at the step where the first rank runs
     out, every rank gets DDP_ERR_UNEVEN_INPUTS (from begin_backward or broadcast_buffers on the ranks with
     data, from ddp_reducer_join on the others) naming the ranks that ran out and the step; the group and
     the reducer stay usable. Only the reducer's own collectives are shadowed: a rank with data that issues
     another collective (a loss all-reduce for logging) before every rank has joined meets a joined rank's
     join round, DDP_ERR_MISMATCH on both at once (torch hangs), and the group is broken. Cost when the ranks are even: one all_gather of 12 bytes
     per rank per backward pass (torch adds one or two 4-byte all-reduces per forward).

   - Local samples (a batch split unevenly over the ranks: the gradient of the mean loss over ALL samples;
     torchft divides by the participants): ddp_reducer_set_local_samples(r, n), after begin_backward and
     before the pass's first gradient hand-over, says that this rank's gradients of the pass are the mean
     over its n samples. The call all-reduces n, and each gradient is then scaled by n / N instead of
     1/world_size (N = the sum of n over the ranks, the same on every rank), so end_backward leaves the mean
     over every rank's samples, sum_r n_r g_r / N, where an unweighted pass leaves sum_r g_r / world_size.
         ddp_reducer_begin_backward(red);
         ddp_reducer_set_local_samples(red, my_batch);     // 0 for a rank without samples in this step
         backward + grad_ready ...;  ddp_reducer_end_backward(red);
     The rules:
       * The weight is this pass's: the next begin_backward goes back to 1/world_size. With the same n on
         every rank the pass is bit for bit an unweighted one (n / (world n) rounds as 1/world_size does).
       * n = 0: this rank contributes zeros, whatever its gradients hold (NaN too); it still hands every
         gradient over, as in any synchronised pass. N = 0 (no rank has samples): DDP_ERR_INVALID_ARGUMENT
         on every rank, and the pass goes on unweighted (finish it; skip the optimizer step).
       * no_sync: passes under set_sync(r, 0) reduce nothing, so the call is refused there (DDP_ERR_STATE).
         The synchronised pass that ends the accumulation is weighted by n = the samples of every micro-batch
         accumulated since the last synchronised pass, and the accumulated gradient must be their mean (the
         program scales each micro-batch's loss by its samples / n, or by 1 / micro-batches when they are of
         equal size). zero_stage 3 without accumulate_unsharded reduce-scatters every pass: there each pass,
         no_sync ones included, may be weighted by its own n, and the slices add up each pass's
         sum_r n_r g_r / N (equal to stages 0-2 within rounding when a rank's micro-batches are of equal
         size); with accumulate_unsharded the rule of stages 0-2 holds.
       * It applies wherever 1/world_size applied: every zero_stage (stage 1 and 2's slices, stage 3's
         ddp_fsdp_grads_ready), compression (the cast into comm_dtype multiplies by n / N in f32, then
         rounds once), views and flat buckets (scaled in place), find_unused_parameters (a parameter unused
         on a rank contributes zero as before; one used in a no_sync pass only contributes its accumulated
         gradient, weighted), grad_stats and loss_scale (they see the weighted average). The reducer has no
         gradient_predivide_factor.
       * uneven_inputs: a joined rank has no samples (it counts n = 0 in the sum; a step's average is over
         the samples of the ranks with data). So that it takes part in the count, a rank announces every
         synchronised pass after its first call as weighted in the join round: from then on every
         synchronised pass must call ddp_reducer_set_local_samples (else DDP_ERR_STATE at the first
         grad_ready or end_backward), and the first call must come before any rank joins (else DDP_ERR_STATE
         on every rank with data, before any collective).

   - Timing (ddp_reducer_get_statistics): wait_seconds, the time inside end_backward, is split into
     straggler_wait_seconds (waiting for a slower rank) and transfer_seconds (moving data backward did not
     hide). Each synchronised pass ends with an asynchronous all_gather of 8 bytes per rank: the wall-clock
     time at which each rank's gradients were all there (its last bucket started). The part of this rank's
     wait before the last rank was ready is straggler wait, the rest transfer; last_ready_rank names that
     rank. The all_gather runs while the program goes on (its optimizer step) and is waited for at the
     next begin_backward or get_statistics, so the split costs no time on the step's path. Between hosts
     its accuracy is that of their clock synchronisation (NTP: well under a millisecond on a LAN). Not on
     the nccl backend (waiting for a device all_gather and copying it back would synchronise the host with
     the stream every step, and host-side ready times say little about device work): there the whole wait
     counts as transfer_seconds and last_ready_rank is -1.

   - ZeRO stage 1 (torch's ZeroRedundancyOptimizer with DDP, DeepSpeed stage 1, llm.c's -z 1): with
     zero_stage = 1 each bucket is reduce-scattered (SUM of the 1/world-scaled gradients, the average)
     instead of all-reduced, so a rank receives the averaged gradient of its own slice of each bucket only.
     Slice rule: a bucket of `count` elements (in bucket order: ddp_reducer_param_bucket's offsets) is cut
     in world slices of per = ceil(count / world) elements; rank r owns bucket elements
     [r * per, min(count, (r + 1) * per)) (the last ranks may own fewer, or none of a tiny bucket). The
     comm buffer is padded with zeros to world * per; the padding never reaches a gradient. A slice may
     cover parts of several parameters: ddp_reducer_shards lists this rank's pieces (any parameter size
     works). Every element of every parameter is owned by exactly one rank. Each step, the program:
         ddp_reducer_end_backward(red);                  // owned gradient elements are now averaged
         n = ddp_reducer_shards(red, &sh);               // the same list every step
         for (j = 0; j < n; j++)                         // optimizer state sized to the shards only:
             adamw(sh[j].param_data, sh[j].grad, sh[j].count, &state[j]);   // 1/world of the model
         ddp_reducer_gather_params(red);                 // all-gather: every rank has every updated value
         ddp_reducer_zero_grad(red);
     After end_backward the gradient elements this rank does not own hold what this rank's backward wrote
     (its own, unaveraged gradient): do not use them. Parameters this rank does not own are stale until
     gather_params. Composes with no_sync (the accumulated gradient is reduce-scattered at the sync pass),
     compression (the reduce-scatter runs in comm_dtype), flat gradient memory and gradient_as_bucket_view
     (the gradients then go through the reducer's padded comm buffer: one copy in and out of the owned
     part). The buckets keep their first layout (no rebuild in ready order), so the shards never move.
     With find_unused_parameters (experts, branches a rank skips): as under stage 0, a parameter without a
     gradient on this rank contributes zeros, a parameter some rank used gets the average over all ranks
     in this rank's owned elements, and the owned gradient elements of a parameter that NO rank used keep
     exactly what they held before the pass (stage 2: the reducer's slice, saved before the reduce-scatter
     and put back). torch's optimizers skip a parameter whose .grad is None: skip the shards of parameters
     for which ddp_reducer_param_used returns 0 to do the same (AdamW would otherwise decay the weight and
     its moments on a zero gradient).
     With uneven_inputs (torch's ZeroRedundancyOptimizer + DDP under Join): a joined rank still owns its
     slices, so it keeps stepping them. Instead of ddp_reducer_join (refused under zero_stage, DDP_ERR_STATE)
     the rank that has no data left writes the loop:
         for (;;) {
             ddp_reducer_join_step(red, &all_joined);    // shadows one pass of the ranks with data
             if (all_joined) break;                      // every rank joined: models and buffers equal
             for (j = 0; j < n; j++) adamw(sh[j].param_data, sh[j].grad, sh[j].count, &state[j]);
             ddp_reducer_gather_params(red);             // meets the others' gather_params of that step
         }
     The ranks with data step as always (end_backward, optimizer on their shards, gather_params). Each
     join_step that returns all_joined = 0 writes into this rank's owned gradient elements (sh[j].grad) the
     average of that pass: the sum over the ranks with data / INITIAL world size (this rank contributes
     zero, as DDP's divide_by_initial_world_size), so every shard follows the same optimizer run as the
     serial model whose gradient is that average; the step counter (AdamW's t) advances on the joined rank
     too. The gradient elements it does not own are not touched. Calling join_step again before
     gather_params is DDP_ERR_STATE (the ranks with data are in their gather_params). join_fail_early
     works as for stage 0. (torch's _ZeROJoinHook runs zero.step() on the joined rank with whatever its
     param.grad holds, as DDP's join hook throws away the all-reduced zeros: its stale last gradient; here
     the joined rank's shards get the step's true average.) zero_stage = 2 works the same way (the
     averages land in the reducer's slices that sh[j].grad points at).
     With find_unused_parameters, the parameters no rank with data used keep their shards' gradients
     (ddp_reducer_param_used is 0 for them on the joined rank too).

   - ZeRO stage 2 (DeepSpeed stage 2: gradient memory 1/world): zero_stage = 2 is stage 1 (the same slice
     rule, shards, gather_params and program loop) with the gradients sharded too. The reducer keeps, per
     bucket, only this rank's slice of the averaged gradient (per elements, in the gradients' dtype), plus
     a pool of 2 comm buffers of the largest padded bucket (world * per elements) that the buckets borrow
     in turn: a bucket takes one at its first grad_ready (a free one; else it waits for the oldest
     reduce-scatter in flight and takes that buffer), the gradients are scaled into it, and its
     reduce-scatter leaves this rank's slice in the reducer's memory. So:
       * ddp_shard.grad points into the reducer (not into the program's gradient buffer); nothing is
         written back to the program's gradients, which keep what the program wrote.
         On the cpu and mpi backends that is host memory, so a model in device memory there (staged
         by the backend, a build with DDP_CUDA) is refused by ddp_reducer_finalize (DDP_ERR_UNSUPPORTED):
         use zero_stage = 1 (its shards are slices of the program's device gradients) or backend nccl.
       * The program's gradient buffers are only READ, at grad_ready of a synchronised pass. A program
         may therefore compute every gradient into ONE scratch buffer (register it for every parameter:
         write parameter i's gradient, call grad_ready(i), reuse the buffer for the next), or into
         buffers it frees or reuses after grad_ready. Under no_sync the gradients accumulate in the
         program's buffers as usual and are read at the sync pass's grad_ready: no_sync needs a full
         gradient buffer per parameter in the program (what DeepSpeed also keeps for accumulation).
       * ddp_reducer_zero_grad zeroes the program's gradient buffers and the reducer's slices.
       * Gradient memory per rank (statistics' gradient_bytes): the slices (model / world, rounded up
         per bucket) + 2 x the largest padded bucket, against the buckets' model-sized memory under
         stage 0. A bucket holds whole parameters, so the pool is at least twice the largest parameter:
         keep bucket_cap_bytes small (a few MiB) and stage 2 pays when no parameter is a large part of the
         model. Gradients that arrive far out of bucket order (all buffers held by buckets still filling)
         grow the pool by one buffer at a time (at most one per bucket; gradient_bytes shows it).
       * Compression (comm_dtype): gradients are scaled into the pool buffer in comm_dtype, reduce-
         scattered in comm_dtype into a landing area of the pool buffer, and converted into the slice in
         the gradients' dtype when the reduce-scatter is waited for (the optimizer reads the gradients'
         dtype as under stage 1).
       * Flat gradient memory (llm.c's grads_memory) is read as separate gradients (copied into the pool
         buffer; flat_buckets = 0). gradient_as_bucket_view = 1 is refused (DDP_ERR_INVALID_ARGUMENT: the
         buckets would hold every gradient, which is what stage 2 frees). find_unused_parameters works
         as for stage 1 (a bucket whose gradients never came borrows its pool buffer at end_backward,
         and may grow the pool as gradients far out of order do). uneven_inputs works as for stage 1 (the ddp_reducer_join_step loop).

   - Mixed precision (torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_; FSDP's ShardedGradScaler):
     with grad_stats = 1 each synchronised end_backward also sums, in f64, the squares of the averaged
     gradient elements this rank owns and counts those that are inf or NaN, in the pass that already
     writes or reads them (stage 0: the copy back, or one read of an in-place / flat bucket: every rank
     owns every element and holds the same average, so nothing is communicated; stage 1: the copy of the
     owned slices back; stage 2: the owned slices as they land), then, under zero_stage, all-reduces the
     16 bytes once (SUM in f64: the same bits on every rank). ddp_reducer_grad_norm,
     ddp_reducer_found_inf and ddp_reducer_clip_coef read the result; ddp_reducer_clip_grad_norm scales
     the owned gradients as torch's clip_grad_norm_ does. With loss_scale = &scaler (ddp_grad_scaler, amp.h)
     the same pass multiplies the averaged gradients by 1 / scaler.scale (torch's reciprocal: f64, rounded
     to f32; the multiply in f32), AFTER the reduction, so an f16 comm_dtype carries scaled values as
     torch's order requires; scaler.scale is read at begin_backward of the pass, so call
     ddp_grad_scaler_update after end_backward (it then sets the next pass's scale). A step:
         ddp_grad_scaler s;  ddp_grad_scaler_init(&s);  d.loss_scale = &s;    // implies grad_stats = 1
         forward; loss *= s.scale; begin_backward; backward + grad_ready ...; end_backward;
         coef = ddp_reducer_clip_coef(red, 1.0);                              // optional: fold into the step
         if (ddp_grad_scaler_update(&s, ddp_reducer_found_inf(red)))         // same answer on every rank
             adamw_step(...);                                                 // else skipped, scale halved
     The numbers describe the gradients the optimizer reads: averaged, unscaled, in the gradients' dtype.
     With find_unused_parameters the parameters no rank used are neither counted nor unscaled (their
     gradient was left as it was; torch skips a .grad that is None). Gradients in device memory (backend
     nccl, or a device model on the cpu and mpi backends) are refused at finalize (DDP_ERR_UNSUPPORTED):
     the pass would need device kernels; use ddp_cuda_non_finite_check_and_unscale there.

   Differences from PyTorch 1.13, none of which changes the averaged gradients beyond rounding:
   - The first iteration uses the 1 MiB / 25 MiB buckets in reverse registration order (torch 1.13 puts
     everything in one bucket for that iteration unless find_unused_parameters is set, and with it cuts
     buckets in forward order before reversing the list).
   - Compression divides by the world size in f32 and then rounds once to f16/bf16 (the hooks round to
     f16 first and divide in f16).
   - With find_unused_parameters, the unused parameters are found when end_backward is called (torch walks
     the autograd graph at the start of backward); their buckets start then.
   - A gradient is "present" or not by whether grad_ready was called since the last synchronised backward
     (the C counterpart of param.grad being None or not).

   Errors: every call that can fail returns a ddp_result, and the message is in ddp_last_error(g) of the
   group given to ddp_reducer_create (ddp_last_error(NULL) for ddp_reducer_create itself).
   Thread safety: a reducer is used by one thread at a time (the thread that runs backward). Other
   collectives on the same group may be issued during backward only at the same point on every rank. */

typedef struct ddp_reducer ddp_reducer;

/* ddp_reducer_create's descriptor; zero-initialised means PyTorch's defaults. */
typedef struct ddp_reducer_desc {
    size_t bucket_cap_bytes;      /* 0 = 25 MiB (DDP's bucket_cap_mb = 25) */
    size_t first_bucket_bytes;    /* 0 = 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) */
    int find_unused_parameters;   /* 1: a parameter may get no gradient on some ranks (see above) */
    int gradient_as_bucket_view;  /* 1: gradients live in the buckets; ddp_reducer_grad() says where */
    ddp_dtype comm_dtype;         /* DDP_DTYPE_DEFAULT: the gradients' dtype; DDP_F16 / DDP_BF16: compress */
    int uneven_inputs;            /* 1: ranks may run out of data at different steps: ddp_reducer_join (Join) */
    int join_fail_early;          /* with uneven_inputs: DDP_ERR_UNEVEN_INPUTS on every rank when the first rank
                                     runs out, instead of shadowing (Join's throw_on_early_termination) */
    int zero_stage;               /* 0 = DDP (all-reduce); 1 = ZeRO-1: each rank gets the averaged gradients of
                                     its slices only and keeps optimizer state for them (see "ZeRO" above);
                                     2 = ZeRO-2: the same, and the reducer keeps only those slices of the
                                     gradients (see "ZeRO stage 2" above); 3 = ZeRO-3 / FSDP FULL_SHARD: the
                                     parameters too, gathered unit by unit (see "FSDP" below) */
    ddp_dtype param_dtype;        /* zero_stage 3: the dtype of the gathered parameters and of the gradients the
                                     program writes (FSDP2's MixedPrecisionPolicy.param_dtype: DDP_BF16 or DDP_F16);
                                     DDP_DTYPE_DEFAULT: the parameters' own. The shards keep the registered dtype */
    int prefetch;                 /* zero_stage 3: gathers in flight besides the unit in use; the pool holds
                                     1 + prefetch units (FSDP2's implicit prefetch is 1, DeepSpeed's 2) */
    int grad_stats;               /* 1: each synchronised end_backward also computes the gradients' L2 norm and
                                     whether any is inf/NaN (see "Mixed precision" above) */
    ddp_grad_scaler *loss_scale;  /* not NULL: the averaged gradients are unscaled by 1 / loss_scale->scale in
                                     end_backward (torch's GradScaler.unscale_); implies grad_stats */
    int accumulate_unsharded;     /* zero_stage 3: 1 = under no_sync every unit keeps a whole gradient buffer and
                                     the passes add into it, reduced once in the synchronised pass (FSDP2's
                                     no_sync: bit for bit stages 0-2's, + the model's gradients in memory);
                                     0 = every pass reduce-scatters and the slices accumulate (see "FSDP") */
} ddp_reducer_desc;

/* One piece of this rank's slice under zero_stage = 1 or 2 (see "ZeRO" above): elements
   [offset, offset + count) of parameter `param`. param_data and grad point at element `offset` of the
   parameter's values and of its averaged gradient (stage 1: the program's grad buffer, or the bucket with
   gradient_as_bucket_view; stage 2: the reducer's slice memory; in the backend's memory). */
typedef struct ddp_shard {
    int param;
    size_t offset, count;
    void *param_data;
    void *grad;
} ddp_shard;

/* Per-iteration statistics, like DDP's logging data (DistributedDataParallel._get_ddp_logging_data()).
   The timing fields describe the last synchronised backward pass. */
typedef struct ddp_reducer_statistics {
    uint64_t iterations;       /* synchronised backward passes completed (DDP's num_iterations) */
    uint64_t local_iterations; /* backward passes run under no_sync */
    int buckets;               /* buckets in the current layout */
    int flat_buckets;          /* of them, slices of the program's own gradient memory: no copy in or out */
    int rebuilt;               /* 1 once the buckets were rebuilt in the observed ready order (0 when that
                                  would have cut flat buckets, which stay as they are: see above) */
    int unused_parameters;     /* last iteration: parameters without a gradient on this rank */
    uint64_t bytes_reduced;    /* last iteration: bytes all-reduced (buckets in comm dtype + used map) */
    double backward_seconds;   /* begin_backward to the end_backward call: compute, overlapped with comm */
    double comm_seconds;       /* first bucket started to last bucket finished ("avg_backward_comm_time") */
    double wait_seconds;       /* time spent inside end_backward: the communication backward did not hide */
    double total_comm_seconds; /* sums over all synchronised iterations */
    double total_wait_seconds;
    uint64_t shadowed_iterations; /* uneven_inputs: synchronised passes of the others that this rank shadowed
                                     with zero gradients in ddp_reducer_join(_step) */
    /* wait_seconds split in two (last synchronised pass; see "Timing" above):
       straggler_wait_seconds + transfer_seconds == wait_seconds */
    double straggler_wait_seconds; /* waiting for a slower rank: until the last rank had all its gradients */
    double transfer_seconds;       /* the rest: moving the data that backward did not hide */
    int last_ready_rank;           /* the rank whose gradients were all there last (the straggler) */
    double total_straggler_wait_seconds; /* sums over all synchronised iterations */
    double total_transfer_seconds;
    uint64_t gradient_bytes;       /* gradient memory the reducer holds on this rank now: its buckets and comm
                                      buffers, zero_stage's owned slices and staging, zero_stage 2's pool (not
                                      the program's own gradient buffers, nor flat buckets, which are those);
                                      zero_stage 3: also the units' gradient buffers (ddp_fsdp_grad) */
    /* zero_stage 3 (see "FSDP" below) */
    uint64_t param_bytes_peak;     /* parameter memory the reducer held at most: the master shards and the
                                      gathered unit buffers (the pool and the KEEP units'), not staging */
    double gather_seconds;         /* sum over the units' all-gathers: from issue to their end */
    double gather_wait_seconds;    /* sum of the time spent inside ddp_fsdp_wait: the gathering not hidden */
    uint64_t unprefetched_waits;   /* ddp_fsdp_wait calls on a unit no ddp_fsdp_gather had started */
    uint64_t gathers;              /* all-gathers of units issued */
} ddp_reducer_statistics;

/* ddp_reducer_create: a reducer for the gradients of one model replica on group g (every rank of g takes
   part). Parameters: g, d (NULL = defaults), out. The reducer keeps g; destroy the reducer before g.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for a bad descriptor field; DDP_ERR_UNSUPPORTED for a
   backend the reducer does not know. Not collective. */
DDP_API ddp_result ddp_reducer_create(ddp_group *g, const ddp_reducer_desc *d, ddp_reducer **out);

/* ddp_reducer_add_param: register a parameter (before ddp_reducer_finalize), in the order the model
   defines them (forward order; the order must be the same on every rank).
   Parameters: name (copied; e.g. "fc1.weight"), param (count values of dtype t, overwritten with rank 0's
   at finalize), grad (the gradient buffer, count values of t; must be NULL with gradient_as_bucket_view,
   where the reducer provides it), t (DDP_F32, DDP_F64, DDP_F16 or DDP_BF16), index (receives the
   parameter's index: 0, 1, ... in registration order; may be NULL). Names are unique among the
   reducer's parameters and buffers: a name registered already is DDP_ERR_INVALID_ARGUMENT naming it.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT (names the problem); DDP_ERR_STATE after finalize. */
DDP_API ddp_result ddp_reducer_add_param(ddp_reducer *r, const char *name, void *param, void *grad, size_t count,
                                         ddp_dtype t, int *index);

/* ddp_reducer_add_buffer: register a buffer (running statistics and the like, any dtype): broadcast from
   rank 0 at finalize and by ddp_reducer_broadcast_buffers. Before finalize; name is copied. */
DDP_API ddp_result ddp_reducer_add_buffer(ddp_reducer *r, const char *name, void *buf, size_t count, ddp_dtype t);

/* ddp_reducer_finalize: collective. Checks that every rank registered the same parameters and buffers
   (count, sizes, dtypes, names) and use the same zero_stage; a difference is DDP_ERR_MISMATCH on every
   rank, naming the first parameter that differs and what each side has (or each side's zero_stage). Then broadcasts parameters and buffers from rank 0
   (coalesced in chunks of up to 250 MiB, as DDP does) and builds the buckets. */
DDP_API ddp_result ddp_reducer_finalize(ddp_reducer *r);

/* ddp_reducer_grad: where parameter index's gradient is (what the program writes in backward): the grad
   pointer it registered, or with gradient_as_bucket_view the parameter's slice of its bucket (zeroed at
   finalize). With gradient_as_bucket_view the slice MOVES when the buckets are rebuilt, at the end of the
   first synchronised end_backward (gradients are carried over): read it again after that call, as
   PyTorch's param.grad becomes a different view. NULL for a bad index (or a view before finalize). */
DDP_API void *ddp_reducer_grad(ddp_reducer *r, int index);

/* ddp_reducer_begin_backward: a backward pass starts (synchronised, or local under set_sync(r, 0)).
   DDP_ERR_STATE before finalize or when the previous backward has not ended. With uneven_inputs it is
   collective (the join round, see above): DDP_ERR_UNEVEN_INPUTS (join_fail_early) when a rank has run out
   of data, DDP_ERR_MISMATCH when the ranks with data disagree about no_sync; the pass has not begun then. */
DDP_API ddp_result ddp_reducer_begin_backward(ddp_reducer *r);

/* ddp_reducer_grad_ready: parameter index's gradient is complete for this backward pass (the autograd
   hook). In a synchronised pass its value is taken now (and its bucket's all-reduce may start): do not
   write to it again until end_backward returns (with gradient_as_bucket_view, or in a flat bucket, it is
   scaled by 1/world_size, or by set_local_samples' weight, in place now, as PyTorch does, and holds the
   sum of the ranks' shares once end_backward returns). Under zero_stage = 2 it is only read, here: the
   program may reuse the buffer as soon as this returns. DDP_ERR_STATE (naming the parameter) when called
   twice in one backward or outside begin/end (with uneven_inputs also before a set_local_samples that
   the pass needs, see "Local samples"); DDP_ERR_INVALID_ARGUMENT for a bad index; an error of the
   all-reduce it starts (zero_stage 2: or of the reduce-scatter it waits for to free a comm buffer). */
DDP_API ddp_result ddp_reducer_grad_ready(ddp_reducer *r, int index);

/* ddp_reducer_end_backward: collective in a synchronised pass. Starts what is left, waits for every
   bucket and writes the averaged gradients back: afterwards every rank holds the same gradients.
   Errors: DDP_ERR_STATE without begin_backward, or when a gradient is missing without
   find_unused_parameters: the message names the parameters, and the group is then broken, as the ranks
   no longer issue the same collectives; every other rank fails at once with the same message in the call
   it is in (usually its end_backward). Any error of the all-reduces. */
DDP_API ddp_result ddp_reducer_end_backward(ddp_reducer *r);

/* ddp_reducer_set_sync: 0 = DDP's no_sync(): the following backward passes only accumulate locally;
   1 (the default) = synchronise. Between backward passes only (else DDP_ERR_STATE). */
DDP_API ddp_result ddp_reducer_set_sync(ddp_reducer *r, int sync);

/* ddp_reducer_set_local_samples: this backward pass's gradients on this rank are the mean over n local
   samples (0 included): the reducer weights them by n / N, N = the sum of n over the ranks, instead of
   1/world_size, so that end_backward leaves the mean over every rank's samples (see "Local samples"
   above). Collective: one all-reduce of 2 x i64; every rank calls it in the same passes. After
   ddp_reducer_begin_backward and before the pass's first ddp_reducer_grad_ready (zero_stage 3:
   ddp_fsdp_grads_ready), once per pass; the next begin_backward goes back to 1/world_size.
   Return: DDP_SUCCESS; DDP_ERR_STATE, before any collective, outside a backward pass, in a no_sync pass
   that reduces nothing, after a gradient of the pass was handed over, when called twice in a pass, or
   against the uneven_inputs rules above; DDP_ERR_INVALID_ARGUMENT on every rank when N = 0 or some rank's
   n is above 2^40 (the pass then goes on unweighted); an error of the all-reduce (the group is broken). */
DDP_API ddp_result ddp_reducer_set_local_samples(ddp_reducer *r, size_t n);

/* ddp_reducer_zero_grad: set every parameter's gradient to zero (optimizer.zero_grad()). Not during a
   backward pass (DDP_ERR_STATE). */
DDP_API ddp_result ddp_reducer_zero_grad(ddp_reducer *r);

/* ddp_reducer_broadcast_buffers: collective; copy rank 0's buffers to every rank (DDP's
   broadcast_buffers=True does it before each forward). Not during a backward pass. With uneven_inputs:
   the highest rank that still has data is the source (torch's _find_common_rank), and the errors of
   begin_backward's join round apply. */
DDP_API ddp_result ddp_reducer_broadcast_buffers(ddp_reducer *r);

/* ddp_reducer_join: this rank has no data left (uneven_inputs = 1; see "Uneven inputs" above). Collective:
   shadows the reducer's collectives of the ranks that still have data, with zero gradients, until every
   rank has called ddp_reducer_join; then every rank gets the parameters and buffers of the highest-ranked
   last joiner (the loop of ddp_reducer_join_step). The program's gradients are left as they were. Under
   zero_stage DDP_ERR_STATE: the optimizer must run between the steps, use ddp_reducer_join_step.
   Return: DDP_SUCCESS when every rank has joined; DDP_ERR_UNEVEN_INPUTS with join_fail_early while some rank still has data (every rank gets it,
   naming the ranks and the step); DDP_ERR_MISMATCH when the ranks with data make different reducer calls
   (a no_sync pass against a synchronised one: every rank gets it); DDP_ERR_STATE without uneven_inputs or
   during a backward pass; any error of the collectives. */
DDP_API ddp_result ddp_reducer_join(ddp_reducer *r);

/* ddp_reducer_join_step: one step of ddp_reducer_join (uneven_inputs = 1). Collective with the ranks that
   still have data: answers their buffer broadcasts and no_sync passes, shadows ONE synchronised backward
   pass (zeros into its all-reduces, or with zero_stage its reduce-scatters) and returns with
   *all_joined = 0; or, once every rank has joined, syncs the final model and buffers as ddp_reducer_join
   does and returns *all_joined = 1. Under zero_stage = 1, after a return with *all_joined = 0 this rank's
   owned gradient elements (ddp_reducer_shards' grad) hold that pass's average (the ranks with data's sum /
   initial world size): run the optimizer on the shards, then ddp_reducer_gather_params, then call
   join_step again (see "ZeRO" above). At stage 0 the loop may do nothing between the calls (that is
   ddp_reducer_join). Errors: those of ddp_reducer_join (an error ends this rank's join; calling again
   starts it anew); DDP_ERR_STATE when under zero_stage the last step's gather_params has not been called;
   DDP_ERR_INVALID_ARGUMENT for a NULL all_joined. */
DDP_API ddp_result ddp_reducer_join_step(ddp_reducer *r, int *all_joined);

/* ddp_reducer_get_statistics: fill *out (see ddp_reducer_statistics). Waits for the last synchronised
   pass's timing exchange (every rank started it in end_backward; a small-message latency at most).
   DDP_ERR_INVALID_ARGUMENT for NULL pointers. */
DDP_API ddp_result ddp_reducer_get_statistics(const ddp_reducer *r, ddp_reducer_statistics *out);

/* ddp_reducer_stats: DEPRECATED (2026-11-24), the old name of ddp_reducer_get_statistics; it does the
   same and will be removed in a later version. */
DDP_API ddp_result ddp_reducer_stats(const ddp_reducer *r, ddp_reducer_statistics *out);

/* ddp_reducer_param_bucket: the bucket that holds parameter index's gradient now (buckets are numbered in
   the order they are all-reduced), and, when offset is not NULL, its element offset in the bucket.
   -1 for a bad index or before finalize. For tests and for tuning bucket sizes. */
DDP_API int ddp_reducer_param_bucket(const ddp_reducer *r, int index, size_t *offset);

/* ddp_reducer_param_used: did parameter index get a gradient on any rank in the last synchronised
   backward pass (on a joined rank: the last pass it shadowed)? 1: yes; 0: no rank called grad_ready for
   it (possible only with find_unused_parameters; its gradient was left as it was), or no synchronised
   pass has ended yet; -1: a NULL reducer, a bad index, or before finalize (ddp_last_error says which). torch's counterpart: param.grad is not None
   after backward, given zero_grad(set_to_none=True); an optimizer that skips parameters without a
   gradient skips those for which this returns 0 (under zero_stage: the shards of such parameters). */
DDP_API int ddp_reducer_param_used(const ddp_reducer *r, int index);

/* ddp_reducer_shards: zero_stage = 1 or 2: this rank's pieces of the model (see "ZeRO" above), in bucket
   order; *out points into the reducer (valid until it is destroyed). The list is fixed at finalize and
   the same every step; their gradients are averaged after each synchronised end_backward. Returns how
   many (0 when this rank owns nothing, or without zero_stage: *out = NULL then); -1 for a NULL argument or
   before finalize. */
DDP_API int ddp_reducer_shards(ddp_reducer *r, const ddp_shard **out);

/* ddp_reducer_gather_params: zero_stage = 1 or 2, collective: every rank contributes the current values of
   the parameter elements it owns (after its optimizer step on its shards) and receives everyone else's, so
   every rank has the whole updated model. One all_gather per bucket, in the parameters' dtype: stage 1 all
   in flight at once through a staging buffer per bucket (the comm buffer when it has the parameters'
   dtype); stage 2 through the pool's buffers in rotation (2 in flight). Not during a backward pass
   (DDP_ERR_STATE); DDP_ERR_STATE without zero_stage; any error of the all_gathers. It is
   ddp_reducer_gather_params_async followed by ddp_reducer_wait_param(r, -1). */
DDP_API ddp_result ddp_reducer_gather_params(ddp_reducer *r);

/* ddp_reducer_gather_params_async / ddp_reducer_wait_param: the same all-gather overlapped with the next
   forward pass (torch's ZeroRedundancyOptimizer(overlap_with_ddp=True), DeepSpeed's parameter prefetch).
   gather_params_async starts the buckets' all_gathers in the order forward reads their parameters (the
   bucket of the first registered parameters first; stage 2: as many as the pool has buffers, the rest
   when a wait reaches them) and returns. Before forward reads parameter i, the program calls
   wait_param(r, i): it waits for i's bucket (and starts those before it), after which i holds the
   updated values on every rank; the other parameters of that bucket are then current too. A parameter
   read before its wait_param may be stale (it holds its old value, or this rank's update for its owned
   part). wait_param(r, -1) waits for all; so do the next begin_backward, gather_params(_async) and join
   step, and destroy, so a program that forgets a wait reads stale values but never leaves a collective
   unfinished. Per step:
       ddp_reducer_gather_params_async(red);            // after the optimizer step on the shards
       for (i = 0; i < nlayers; i++) {                  // forward
           ddp_reducer_wait_param(red, weight_index[i]); // (and the layer's other parameters)
           layer_forward(i);
       }
       ddp_reducer_begin_backward(red); ...
   wait_param without a gather in flight returns DDP_SUCCESS at once. Errors: as gather_params;
   DDP_ERR_INVALID_ARGUMENT for an index that is not a parameter or -1; a failed all_gather stops the
   reducer (the next call says so). Not collective by itself: every rank's waits may differ. */
DDP_API ddp_result ddp_reducer_gather_params_async(ddp_reducer *r);
DDP_API ddp_result ddp_reducer_wait_param(ddp_reducer *r, int index);

/* ZeRO checkpoints (torch's ZeroRedundancyOptimizer.consolidate_state_dict and per-rank shards).
   Optimizer state under zero_stage = 1 lives in the program, per state (AdamW: m and v) one array of
   this rank's shards' elements concatenated in ddp_reducer_shards order: its "shard state", of
   shard_count = the sum of the shards' counts elements. A "full" array holds the whole model's elements,
   the parameters concatenated in registration order (parameter i from the sum of the counts of
   parameters 0 .. i-1): full_count = the model's elements. Both of dtype t (any ddp_dtype: the state's,
   usually DDP_F32 whatever the parameters' dtype). Host memory. Two ways to save:
   - Consolidated (one file, loads on any world size): ddp_reducer_consolidate_state gathers every rank's
     shard state into full arrays on root, which saves them as ordinary tensors (one per parameter and
     state, e.g. "fc1.weight.exp_avg", pointing into the full array) with ddp_checkpoint_save. To load,
     every rank reads the file (ddp_checkpoint_load; desc.broadcast = 1 without a shared filesystem) into
     full arrays and ddp_reducer_shard_state takes its shards' pieces out of them.
   - Per rank (each rank writes 1/world of the state, loads on any world size): ddp_checkpoint_save_slices
     with one ddp_slice per shard and state: {"fc1.weight.exp_avg", t, global_count = the parameter's
     count, offset = shard.offset, count = shard.count, data = the shard's piece of the state};
     ddp_checkpoint_load_slices with the same slices of the loading reducer's shards (another world size
     is fine: the slices are read from whichever files hold them). No function of its own is needed. */

/* ddp_reducer_consolidate_state: zero_stage >= 1 (the shards of any stage), collective. nstates states (shard_state[0 .. nstates-1],
   shard_count elements each on every rank) are gathered into full[0 .. nstates-1] (full_count elements
   each) on rank root; full and full_count are read on root only (others may pass NULL, 0). The ranks
   first exchange their arguments: a rank whose shard_count is not its shards' total, root's full_count
   not the model's, NULL arrays, or ranks that differ in nstates, t or root are DDP_ERR_INVALID_ARGUMENT
   on every rank (naming the rank), before any state moves. Cost: an all_gather of the arguments and of
   the shard lists (24 bytes a shard), then per state one gather to root of every rank's array padded to
   the largest rank's (root stages world x that, about one full array). Errors: DDP_ERR_STATE (not
   finalized, zero_stage = 0, during a backward pass); DDP_ERR_INVALID_ARGUMENT; DDP_ERR_OUT_OF_MEMORY;
   the gathers' errors. */
DDP_API ddp_result ddp_reducer_consolidate_state(ddp_reducer *r, ddp_dtype t, int nstates, const void *const *shard_state,
                                                 size_t shard_count, void *const *full, size_t full_count, int root);

/* ddp_reducer_shard_state: the inverse, local (not collective): this rank's shards' elements of the full
   arrays full[0 .. nstates-1] (full_count elements each, e.g. read from a consolidated checkpoint, saved
   on any world size) into shard_state[0 .. nstates-1] (shard_count elements each). A full_count that is
   not the model's or a shard_count that is not this rank's shards' total: DDP_ERR_INVALID_ARGUMENT
   naming both numbers; DDP_ERR_STATE as above. */
DDP_API ddp_result ddp_reducer_shard_state(ddp_reducer *r, ddp_dtype t, int nstates, const void *const *full,
                                           size_t full_count, void *const *shard_state, size_t shard_count);

/* FSDP: ZeRO stage 3 (torch's FullyShardedDataParallel / fully_shard, DeepSpeed stage 3). zero_stage = 3
   shards the parameters as stage 2 shards the gradients. The program groups its parameters into UNITS,
   usually one per layer: ddp_fsdp_unit(r, name, flags) opens a unit, and the parameters registered after
   it (ddp_reducer_add_param, grad = NULL) belong to it until the next ddp_fsdp_unit. Each unit is one
   bucket (no cap-based cutting), so the slice rule is stage 1's: per = ceil(unit count / world), rank r
   owns unit elements [r * per, min(count, (r + 1) * per)), in the unit's bucket order. At finalize rank
   0's values are broadcast (as at every stage), each rank copies its slices into its MASTER SHARDS (the
   registered dtype; ddp_shard.param_data points there) and the program may free its parameter memory.
   Per rank, the reducer then holds: the master shards (~1/world of the model), the averaged gradient
   slices (stage 2's), a pool of 1 + prefetch gather buffers of the largest unit, in param_dtype, and a
   buffer of its own for each DDP_FSDP_KEEP unit (a root that stays gathered: tied embeddings). A step:
       ddp_fsdp_wait(red, u[0]);                            // (gathers it: nothing was prefetched)
       for (l = 0; l < L; l++) {                            // forward
           if (l + 1 < L) ddp_fsdp_gather(red, u[l + 1]);   // prefetch: overlaps layer l's compute
           layer_forward(l, ddp_fsdp_param(red, i_w[l]), ...);
           if (l + 1 < L) ddp_fsdp_release(red, u[l]);      // the last stays for backward
           if (l + 1 < L) ddp_fsdp_wait(red, u[l + 1]);
       }
       ddp_reducer_begin_backward(red);
       for (l = L - 1; l >= 0; l--) {                       // backward, last unit first
           ddp_fsdp_wait(red, u[l]);  if (l) ddp_fsdp_gather(red, u[l - 1]);
           layer_backward(l, ddp_fsdp_param(red, i_w[l]), ddp_fsdp_grad(red, i_w[l]), ...);  // += into it
           ddp_fsdp_grads_ready(red, u[l]);                 // x 1/world, reduce-scatter into the slice
           ddp_fsdp_release(red, u[l]);
       }
       ddp_reducer_end_backward(red);                       // the slices hold the averaged gradients
       n = ddp_reducer_shards(red, &sh);                    // optimizer on the master shards, as at stage 2
   Rules:
   - Gather and wait are collective: every rank gathers the same units in the same order. The unit is part
     of the collective's fingerprint, so ranks that gather different units fail with DDP_ERR_MISMATCH
     naming both (the same holds for the reduce-scatters): never a hang, never mixed data.
   - ddp_fsdp_gather starts the unit's all-gather into a free pool buffer (the master slice cast to
     param_dtype). With no free buffer it is DDP_ERR_STATE naming the units holding them, before any
     collective starts: release a unit first, or raise prefetch. Gathering a unit that is gathered or in
     flight does nothing. ddp_fsdp_wait waits for it (gathering it first if no gather was started: correct
     without prefetch, only slower; statistics' unprefetched_waits counts these). ddp_fsdp_param(i) is
     valid from the wait of i's unit to its release (NULL otherwise); ddp_fsdp_release gives the buffer
     back (waiting for a gather still in flight). A DDP_FSDP_KEEP unit has its own buffer: release does
     nothing, and it stays gathered until end_backward.
   - ddp_fsdp_grad(i) (in a backward pass): where parameter i's gradient goes, in param_dtype (or the
     registered dtype), zeroed at the unit's first ddp_fsdp_grad in the pass, so the program adds into it.
     When that dtype is comm_dtype (the default) the buffer is the unit's comm buffer from stage 2's pool
     of 2 (the gradients then cost no memory of their own: a third unit waits for the oldest reduce-
     scatter, as stage 2's buckets do); with param_dtype or compression it comes from a gradient pool
     that grows by one buffer of the largest unit when every buffer is taken; a KEEP unit's is its own.
     ddp_fsdp_grads_ready(u) scales it by 1/world (cast to comm_dtype) and its reduce-scatter starts when
     it is next in order: do not write to it again.
     A unit without ddp_fsdp_grads_ready in a pass is an error at end_backward naming its parameters, as
     a missing gradient, unless find_unused_parameters (zeros from this rank; untouched if no rank used it).
   - end_backward waits for the reduce-scatters and reshards EVERY unit (the pool is free again; the
     optimizer step that follows changes the shards, so nothing gathered before it stays readable).
   - no_sync (set_sync(r, 0)): every pass still reduce-scatters, and the averaged gradients of the passes
     since the last synchronised one ACCUMULATE in the slices (memory 1/world, communication every
     micro-step); the synchronised pass adds its own, then the optimizer runs. Not bit-identical to
     stages 0-2's no_sync, which sum before averaging (within float rounding of it). With
     accumulate_unsharded = 1 (FSDP2's no_sync) every unit has a whole gradient buffer of its own (the
     model's gradients in param_dtype: gradient_bytes counts them): ddp_fsdp_grad hands it out zeroed at
     the first pass after a synchronised one and as it is in the others, so the program's += sums the
     micro-steps there; a no_sync pass reduces nothing and the synchronised pass reduce-scatters the sum
     once: bit for bit stages 0-2's result. ddp_reducer_zero_grad drops what was accumulated.
   - param_dtype DDP_BF16/DDP_F16: gathered parameters and ddp_fsdp_grad's buffers have that dtype; the
     reduce-scatter runs in comm_dtype (default: the registered dtype, FSDP2's reduce_dtype = f32), the
     master shards and ddp_reducer_shards' gradients keep the registered dtype.
   - Backends cpu (shm, tcp, hier) and mpi. Parameters registered in device memory there (a build with
     DDP_CUDA) are torch's CPUOffloadPolicy: the gathered units and ddp_fsdp_grad's buffers are device
     memory, the master shards, gradient slices and so the optimizer (ddp_reducer_shards) host memory,
     every copy between them staged through the group's pinned memory on its stream (exact; slow: a
     stream synchronisation per copy). Every parameter must then be device memory. On the nccl backend
     everything the reducer holds is device memory (master shards, gradient slices, the pools: the
     optimizer steps ddp_reducer_shards on the device), every copy and the no_sync accumulation are
     kernels on the group's stream, the gathers and reduce-scatters NCCL's; ddp_fsdp_save_full's root
     gathers each unit into a device buffer of the largest unit and copies it to the host. grad_stats and
     loss_scale are refused there, as at stages 0-2 (device gradients). Refused (DDP_ERR_UNSUPPORTED):
     uneven_inputs (a joined rank would have to shadow the gathers); DDP_ERR_STATE /
     DDP_ERR_INVALID_ARGUMENT: gradient_as_bucket_view, and
     ddp_reducer_gather_params (the units are gathered as they are used).
   - Units at stages 0-2: ddp_fsdp_unit cuts the buckets there too (one bucket per unit, params registered
     with their gradients as usual; no rebuild), so stage 3 can be compared with stage 2 bucket for bucket;
     gather/wait/param/release/grad/grads_ready are stage 3's only.
   - Memory (statistics): param_bytes_peak = the master shards (per elements of each unit, registered
     dtype) + (1 + prefetch) gather buffers (world * per of the largest unit, param_dtype) + each KEEP
     unit's (world * per, param_dtype); gradient_bytes = stage 2's (slices + its pool of 2) + each KEEP
     unit's gradient buffer (its count; every unit's with accumulate_unsharded) + with param_dtype or
     compression the gradient pool's buffers (the
     largest unit's count in param_dtype each; one when units are handed over one at a time). */
#define DDP_FSDP_KEEP 1 /* ddp_fsdp_unit flag: the unit stays gathered from its first wait to end_backward */

/* ddp_fsdp_unit: open a unit (before finalize; any zero_stage, see above): the parameters registered next
   belong to it. name is copied (messages name units by it). flags: 0 or DDP_FSDP_KEEP. Returns the unit's id
   (0, 1, ... in order) or a negative ddp_result: DDP_ERR_INVALID_ARGUMENT (NULL or empty name, unknown
   flags, the previous unit has no parameters), DDP_ERR_STATE after finalize. */
DDP_API int ddp_fsdp_unit(ddp_reducer *r, const char *name, int flags);
/* ddp_fsdp_gather: start unit's all-gather (collective; see the rules above). */
DDP_API ddp_result ddp_fsdp_gather(ddp_reducer *r, int unit);
/* ddp_fsdp_wait: unit's parameters are readable when it returns (gathers first if needed; collective then). */
DDP_API ddp_result ddp_fsdp_wait(ddp_reducer *r, int unit);
/* ddp_fsdp_param: where parameter index is while its unit is gathered (param_dtype); NULL otherwise. */
DDP_API void *ddp_fsdp_param(ddp_reducer *r, int index);
/* ddp_fsdp_release: unit's gather buffer goes back to the pool (a KEEP unit: nothing happens). */
DDP_API ddp_result ddp_fsdp_release(ddp_reducer *r, int unit);
/* ddp_fsdp_grad: where parameter index's gradient goes in this backward pass (zeroed at its unit's first
   call in the pass); NULL outside a pass, for a bad index, or when out of memory (ddp_last_error says). */
DDP_API void *ddp_fsdp_grad(ddp_reducer *r, int index);
/* ddp_reducer_param_shape: parameter param's shape (ndim 1 .. 8 dimensions whose product is its count; 0:
   none), for ddp_fsdp_save_full, which otherwise writes 1-D tensors. Before finalize; any zero_stage. */
DDP_API ddp_result ddp_reducer_param_shape(ddp_reducer *r, int param, int ndim, const int64_t *shape);
/* ddp_fsdp_grads_ready: every gradient of unit is written: scaled, reduce-scattered (asynchronously, in
   bucket order) into this rank's slices. Once per unit and pass; DDP_ERR_STATE outside a pass or twice. */
DDP_API ddp_result ddp_fsdp_grads_ready(ddp_reducer *r, int unit);

/* ddp_reducer_grad_norm: grad_stats (or loss_scale): the L2 norm, sqrt of the f64 sum of squares, of the
   gradients after the last synchronised end_backward (see "Mixed precision" above), the same bits on
   every rank (under zero_stage: over every rank's owned elements). inf or NaN when some gradient is
   (found_inf). Errors: DDP_ERR_STATE when the reducer was created without grad_stats or no synchronised
   pass has ended (or the last one failed); DDP_ERR_INVALID_ARGUMENT for NULL pointers. */
DDP_API ddp_result ddp_reducer_grad_norm(ddp_reducer *r, double *norm);

/* ddp_reducer_found_inf: grad_stats: 1 when some averaged gradient element of the last synchronised pass
   was inf or NaN on any rank (before unscaling; under zero_stage all-reduced, so every rank agrees), else
   0. -1 on the errors of ddp_reducer_grad_norm (ddp_last_error says which). */
DDP_API int ddp_reducer_found_inf(const ddp_reducer *r);

/* ddp_reducer_clip_coef: grad_stats: torch.nn.utils.clip_grad_norm_'s coefficient for the last pass:
   max_norm / (norm + 1e-6), clamped to at most 1.0 (in f64; NaN when the norm is NaN, 0 when it is inf).
   A program folds it into its optimizer (multiplies the gradient by it as it reads it, as llm.c does),
   which costs no pass over the gradients. Return: the coefficient, or -1.0 on the errors of
   ddp_reducer_grad_norm and for a max_norm that is not positive. */
DDP_API double ddp_reducer_clip_coef(ddp_reducer *r, double max_norm);

/* ddp_reducer_clip_grad_norm: torch.nn.utils.clip_grad_norm_(params, max_norm) for torch-shaped code:
   *total_norm (may be NULL) gets ddp_reducer_grad_norm's norm, and every gradient element this rank owns
   (stage 0: every parameter's gradient where ddp_reducer_grad says; zero_stage: ddp_reducer_shards'
   grad) is multiplied in place by ddp_reducer_clip_coef's coefficient (in f32; f64 for f64 gradients),
   except those of parameters no rank used (find_unused_parameters). Not collective. Not during a backward
   pass (DDP_ERR_STATE); otherwise the errors of ddp_reducer_clip_coef, as ddp_result. */
DDP_API ddp_result ddp_reducer_clip_grad_norm(ddp_reducer *r, double max_norm, double *total_norm);

/* ddp_reducer_destroy: wait for any all-reduce in flight and free the reducer. Not collective. NULL is a
   no-op. */
DDP_API void ddp_reducer_destroy(ddp_reducer *r);
