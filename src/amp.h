/* [SECTION] amp: torch.amp.GradScaler, the inf/NaN check and the gradient norm's parts (mixed precision) */
/* Mirrors torch.amp.GradScaler (dynamic loss scaling) and the two reductions torch.nn.utils.clip_grad_norm_
   and a sharded GradScaler need across ranks. With the reducer (reducer.h "Mixed precision") set
   ddp_reducer_desc.grad_stats and loss_scale and these come for free in end_backward; the calls below are
   for programs that keep their own gradients:
       ddp_grad_scaler s;
       ddp_grad_scaler_init(&s);                          // scale 65536, x2 after 2000 clean steps, x0.5 on inf
       for (step = 0; ...) {
           forward; loss *= s.scale; backward;            // scaler.scale(loss).backward()
           all_reduce the gradients (average);
           found = 0;                                     // scaler.unscale_(optimizer):
           ddp_non_finite_check_and_unscale(grad, n, DDP_F32, 1.0 / s.scale, &found);   // each gradient
           ddp_any_nonfinite(g, found, &found);           // only when the ranks hold different gradients
           if (ddp_grad_scaler_update(&s, found)) sgd_step(...);   // scaler.step(opt); scaler.update()
       }
   torch's arithmetic, exactly: the scale is an f32 tensor in torch, so ddp_grad_scaler_update rounds
   every new scale to f32 (s.scale always holds an f32 value); the reciprocal is taken in f64 and rounded
   to f32 (GradScaler.unscale_: self._scale.double().reciprocal().float()), and gradients are multiplied
   by that f32 in f32 (f64 gradients: in f64; f16/bf16: in f32, rounded back), as
   _amp_foreach_non_finite_check_and_unscale_ does (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp).
   With a scale that is a power of two (torch's defaults keep it one) unscaling is exact, barring
   underflow. */

/* torch.amp.GradScaler's state: scale (init_scale), growth_factor, backoff_factor, growth_interval and
   the _growth_tracker (consecutive steps without inf/NaN since the last change of scale). */
typedef struct ddp_grad_scaler {
    double scale, growth_factor, backoff_factor;
    int growth_interval, growth_tracker;
} ddp_grad_scaler;

/* ddp_grad_scaler_init: torch.amp.GradScaler's defaults: scale 65536.0 (2^16), growth_factor 2.0,
   backoff_factor 0.5, growth_interval 2000, growth_tracker 0. A program may change the fields after
   (torch's constructor arguments). NULL: nothing happens. */
DDP_API void ddp_grad_scaler_init(ddp_grad_scaler *s);

/* ddp_grad_scaler_update: GradScaler.step's decision and GradScaler.update (torch's _amp_update_scale_)
   for a step whose gradients had found_inf (nonzero: some inf or NaN; every rank must pass the same,
   e.g. ddp_reducer_found_inf or ddp_any_nonfinite):
       found_inf:  scale = f32(scale * backoff_factor), growth_tracker = 0        -> 0: skip the step
       otherwise:  growth_tracker + 1; when that reaches growth_interval:
                   scale = f32(scale * growth_factor) unless that is inf (kept then), growth_tracker = 0
                                                                                   -> 1: take the step
   Return: 1 (run the optimizer), 0 (skip it), -1 for a NULL s or a negative found_inf (an error of
   ddp_reducer_found_inf; s is not changed; ddp_last_error(NULL) says which). */
DDP_API int ddp_grad_scaler_update(ddp_grad_scaler *s, int found_inf);

/* ddp_non_finite_check_and_unscale: the host twin of ddp_cuda_non_finite_check_and_unscale
   (torch._amp_foreach_non_finite_check_and_unscale_ on one tensor): every element of data (count of t:
   DDP_F32, DDP_F64, DDP_F16 or DDP_BF16, host memory) is multiplied in place by inv_scale rounded to f32
   (left as it is when that is 1; arithmetic as above), and *found_inf is set to 1 when some element was
   an infinity or a NaN (checked before the multiply). *found_inf is never cleared: zero it before the
   first tensor of a step. Pass inv_scale = 1.0 / s.scale for torch's reciprocal.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for NULL pointers (data may be NULL when count is 0), a
   dtype that is not floating or an inv_scale that is not finite and positive (ddp_last_error(NULL)). */
DDP_API ddp_result ddp_non_finite_check_and_unscale(void *data, size_t count, ddp_dtype t, double inv_scale, int *found_inf);

/* ddp_any_nonfinite: collective; *global = 1 on every rank when any rank passed a nonzero local (its
   gradients had an inf or NaN), else 0: one all_reduce MAX of an i32 (ShardedGradScaler's all-reduce of
   found_inf; needed when the ranks hold different gradients, as under ZeRO; after a DDP all-reduce every
   rank sees the same infs already). Return: DDP_SUCCESS or the all_reduce's error. */
DDP_API ddp_result ddp_any_nonfinite(ddp_group *g, int local, int *global);

/* ddp_sum_sq: collective; *total = the sum over the ranks of local (each rank's sum of squares of the
   gradient elements it owns, in f64): one all_reduce SUM of an f64, the same bits on every rank.
   sqrt(*total) is clip_grad_norm_'s total norm (FSDP's all-reduce of local_norm ** 2). Return:
   DDP_SUCCESS or the all_reduce's error. */
DDP_API ddp_result ddp_sum_sq(ddp_group *g, double local, double *total);
