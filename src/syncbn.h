/* [SECTION] syncbn: torch.nn.SyncBatchNorm (and plain BatchNorm1d/2d/3d) forward and backward
   Mirrors torch.nn.SyncBatchNorm (torch/nn/modules/_functions.py). Batch statistics are computed
   over the batches of every rank of the group, as if BatchNorm saw the concatenated batch:

     forward (training)   each rank: per channel count n_r, mean_r, M2_r = sum (x - mean_r)^2
                          all_gather [mean_r(C), M2_r(C), n_r] (f64) from every rank
                          Chan merge, rank by rank (ranks with n_r = 0 drop out):
                              delta = mean_b - mean_a, n = n_a + n_b,
                              mean = mean_a + delta * n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n
                          invstd = 1 / sqrt(M2 / n + eps)
                          running_mean += f * (mean - running_mean)
                          running_var  += f * (M2 / (n - 1) - running_var)   (unbiased, global n)
                          f = momentum, or 1 / num_batches_tracked when momentum is None (< 0 here)
                          y = (x - mean) * invstd * weight + bias
     backward             each rank: sum_dy = sum dy, sum_dy_xmu = sum dy (x - mean)
                          all_reduce (SUM) [sum_dy, sum_dy_xmu]
                          dx = (dy - sum_dy / n - (x - mean) invstd^2 sum_dy_xmu / n) invstd weight
                          grad_weight += local sum dy (x - mean) invstd, grad_bias += local sum dy
                          (local: the gradient reducer averages them like every other parameter)

   Layouts: channels-first (N, C, spatial...) or channels-last (N, spatial..., C); `spatial` is the
   product of the spatial sizes (1 for BatchNorm1d's (N, C) input). Data is f32; statistics are
   accumulated in f64. The CPU code makes one pass over x per stage. The per-element and per-channel
   formulas are the static inline DDP_HOST_DEVICE helpers at the end of this section, shared with
   the CUDA kernels of ddp_cuda.cu.

   Device memory (a build with DDP_CUDA, linked with ddp_cuda.o): when x is device memory (cudaMalloc'd
   or managed; detected through CUDA at each call), forward and backward run ddp_cuda.cu's kernels as
   torch's SyncBatchNorm does on CUDA (batch_norm_stats -> all_gather -> gather_stats_with_counts ->
   elemt; backward_reduce -> all_reduce -> backward_elemt), queued on the group's stream (ddp_set_stream;
   the legacy default stream without the nccl backend) with no host synchronisation. y, dy, dx,
   grad_weight, grad_bias and the descriptor's weight, bias and running stats are then device memory
   too (a host array is DDP_ERR_INVALID_ARGUMENT naming it), except num_batches_tracked: the host
   counts, so that counter stays host memory (pageable, pinned or managed; never cudaMalloc'd). On the
   nccl backend the collectives are async and waited one step later (this layer's next forward /
   backward, or ddp_syncbn_destroy, which must come before ddp_destroy of the group): a failed
   collective is reported by the next call. A
   rank with an empty batch takes the device path when the layer ran on the device before or its
   weight or running_mean is device memory. Global n == 1 over 2+ ranks is not detected on the device
   (as torch's SyncBatchNorm: the running stats are left unchanged); on one rank it is an error. */

typedef struct ddp_syncbn ddp_syncbn; /* a SyncBatchNorm layer's state (opaque) */

/* ddp_syncbn_create's descriptor. Zero-initialised fields take torch.nn.BatchNorm's defaults. */
typedef struct ddp_syncbn_desc {
    int num_features;   /* C, the number of channels (> 0) */
    double eps;         /* added to the variance; 0 = 1e-5 */
    double momentum;    /* running-stats factor in (0, 1]; 0 = 0.1; < 0 = None: cumulative average
                           with factor 1 / num_batches_tracked. torch's momentum=0 (batch statistics,
                           running stats frozen) has no spelling here: 0 means the default. */
    int channels_last;  /* nonzero: x is (N, spatial..., C) instead of (N, C, spatial...) */
    float *weight;      /* C floats, caller-owned and read at every call; NULL = 1 (no affine) */
    float *bias;        /* C floats, caller-owned; NULL = 0 (no affine) */
    float *running_mean; /* C floats, caller-owned, updated by training forwards; with running_var, */
    float *running_var;  /* both or neither; NULL = track_running_stats=False */
    ddp_group *group;   /* statistics are merged over this (sub)group; NULL = the group given to create */
    int64_t *num_batches_tracked; /* 1 int64, caller-owned host memory: the layer's counter of training
                           forwards (torch's num_batches_tracked buffer), read and advanced there by every
                           training forward; its value at create is the count so far (0 for a new layer,
                           >= 0). Only with running stats. NULL = the layer keeps the counter itself. Either
                           way ddp_syncbn_num_batches_tracked / _set_num_batches_tracked read and write it. */
} ddp_syncbn_desc;

/* num_batches_tracked as a buffer, like torch's BatchNorm (a 0-d int64 tensor in its state_dict, which
   DDP broadcasts with the running stats under broadcast_buffers=True): point the descriptor at the
   program's counter, then register and save it like running_mean and running_var:

       float mean[64] = {0}, var[64];             // var: 64 ones, as torch initialises it
       int64_t nbt = 0;
       ddp_syncbn_desc d = {0};
       d.num_features = 64, d.running_mean = mean, d.running_var = var, d.num_batches_tracked = &nbt;
       ddp_syncbn_create(g, &d, &bn);
       ddp_reducer_add_buffer(red, "bn.running_mean", mean, 64, DDP_F32);
       ddp_reducer_add_buffer(red, "bn.running_var", var, 64, DDP_F32);
       ddp_reducer_add_buffer(red, "bn.num_batches_tracked", &nbt, 1, DDP_I64);  // rank 0's count everywhere
       ddp_tensor t[3] = {{"bn.running_mean", DDP_F32, 1, {64}, mean},
                          {"bn.running_var", DDP_F32, 1, {64}, var},
                          {"bn.num_batches_tracked", DDP_I64, 0, {0}, &nbt}};   // ndim 0: torch's shape []
       ddp_checkpoint_save(g, "ckpt.safetensors", t, 3, NULL);   // ... later, into a fresh layer:
       ddp_checkpoint_load(g, "ckpt.safetensors", t, 3, NULL);   // nbt restored: momentum None goes on
                                                                 // with factor 1 / (nbt + 1)
   A training forward that finds the counter negative is DDP_ERR_INVALID_ARGUMENT on that rank, before
   any communication (as any bad argument), nothing changed. With a device model (running stats in
   device memory) the counter is still host memory: a host tensor beside the device ones in the same
   checkpoint, and a host buffer of the reducer beside device buffers on the cpu backends. */

/* ddp_syncbn_create: make a SyncBatchNorm layer.
   Parameters: g: the group whose ranks share batch statistics, or NULL for a plain single-process
               BatchNorm (no communication); errors of this layer are reported in ddp_last_error(g).
               d: the descriptor (copied; the arrays it points to are not). out: receives the layer.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for a bad descriptor (the message names the field);
           DDP_ERR_OUT_OF_MEMORY.
   Thread safety: any thread; no communication. */
DDP_API ddp_result ddp_syncbn_create(ddp_group *g, const ddp_syncbn_desc *d, ddp_syncbn **out);

/* ddp_syncbn_destroy: free the layer (not the caller's arrays). NULL is a no-op. */
DDP_API void ddp_syncbn_destroy(ddp_syncbn *bn);

/* ddp_syncbn_forward: y = BatchNorm(x), like SyncBatchNorm.forward.
   Parameters: x, y: batch * spatial * C floats in the layer's layout (y may be x: in place; both
               may be NULL when batch * spatial is 0). batch >= 0 (ranks may differ, 0 included),
               spatial >= 0 (the product of the spatial sizes; 1 for (N, C) input).
               training: nonzero = batch statistics merged over the group, running stats updated,
               num_batches_tracked += 1; 0 = eval: normalise with the running stats, no communication
               (a layer without running stats uses this rank's own batch statistics, as torch does).
   Collective in training when the layer has a group: every rank of the group calls it, also with an
   empty batch. Saves the mean and invstd used, for ddp_syncbn_backward.
   Counts: the batch statistics need n = the number of values per channel over all ranks of the group.
     n == 1: DDP_ERR_INVALID_ARGUMENT on every rank of the group together, nothing changed. torch's
             BatchNorm (and SyncBatchNorm on one rank) raise "Expected more than 1 value per channel when
             training"; SyncBatchNorm on 2+ ranks does not check (its running_var update then divides
             by n - 1 = 0).
     n == 0: success with nothing to normalise: running stats unchanged, num_batches_tracked += 1, as
             torch's BatchNorm does on an empty batch (torch's SyncBatchNorm has no defined result there).
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for bad arguments or n == 1; errors of the collective
           (the group is then broken). Thread safety: one thread at a time per layer (and per group). */
DDP_API ddp_result ddp_syncbn_forward(ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                      int training);

/* ddp_syncbn_backward: the gradients of the last ddp_syncbn_forward, like SyncBatchNorm.backward.
   Parameters: x: that forward's input (batch and spatial must be the same); dy: the gradient of y;
               dx: receives the gradient of x (may be dy: in place; NULL = not wanted);
               grad_weight, grad_bias: C floats each that this rank's LOCAL gradients are ADDED to, as
               PyTorch accumulates into .grad (zero them first; the reducer then averages them over
               ranks like any parameter). NULL = not wanted; they are also computed for a layer
               without affine parameters (the gradient with respect to an implicit weight 1, bias 0).
   Collective after a training forward on a layer with a group: every rank calls it (one all_reduce
   of sum_dy and sum_dy_xmu), whatever it passes for dx, also with an empty batch. After an eval
   forward the statistics were constants: dx = dy * invstd * weight, with no communication.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT; DDP_ERR_STATE when no forward preceded it;
           errors of the collective. Thread safety: as ddp_syncbn_forward. */
DDP_API ddp_result ddp_syncbn_backward(ddp_syncbn *bn, const float *x, const float *dy, float *dx, float *grad_weight,
                                       float *grad_bias, int64_t batch, int64_t spatial);

/* The number of training forwards of a layer with running stats, empty batches included (torch's
   num_batches_tracked buffer; *desc.num_batches_tracked when the program gave that counter); 0 for a
   layer without running stats, or NULL. */
DDP_API int64_t ddp_syncbn_num_batches_tracked(const ddp_syncbn *bn);

/* Restore num_batches_tracked, e.g. from a checkpoint (it sets the cumulative-average factor when
   momentum is None); writes the program's counter when it gave one. Return: DDP_SUCCESS, or
   DDP_ERR_INVALID_ARGUMENT for a negative value. */
DDP_API ddp_result ddp_syncbn_set_num_batches_tracked(ddp_syncbn *bn, int64_t value);

/* The private formulas that the CPU code and the CUDA kernels share are in src/bn_math.h (in ddp.h,
   after the public part, for the implementation and ddp_cuda.cu only). */
#include "bn_math.h"
