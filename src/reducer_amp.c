/* [SECTION] reducer-amp: the Reducer's gradient statistics: grad_norm, found_inf, clip_grad_norm_
   (reducer.h "Mixed precision" has the API; the passes fill r->amp through amp.c's ddp__amp_begin / add /
   finish). torch.nn.utils.clip_grad_norm_:
       total_norm = ||(||g_1||, ..., ||g_n||)||_2          (here: sqrt of one f64 sum of squares)
       clip_coef  = max_norm / (total_norm + 1e-6),  clamped to <= 1
       g_i       *= clip_coef                             (always; a no-op when the coefficient is 1) */
#include "internal.h"
#include "reducer_state.h"

/* The statistics of the last synchronised pass can be read (fn names the caller in the message). */
static ddp_result ddp__grad_stats_ready(const ddp_reducer *r, const char *fn) {
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the reducer is NULL", fn);
    if (!ddp__grad_stats_on(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created without grad_stats; set ddp_reducer_desc."
                         "grad_stats = 1 (or loss_scale) on every rank to have end_backward compute the norm and found_inf",
                         fn);
    if (!r->amp.valid)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: %s; call it after ddp_reducer_end_backward of a synchronised pass", fn,
                         r->in_backward ? "a synchronised backward pass is in progress"
                         : r->stats.iterations ? "the last synchronised backward pass failed"
                         : "no synchronised backward pass has ended yet");
    return DDP_SUCCESS;
}

/* clip_grad_norm_'s total norm and coefficient for the last pass. */
static ddp_result ddp__reducer_clip(ddp_reducer *r, double max_norm, const char *fn, double *norm, double *coef) {
    ddp_result res = ddp__grad_stats_ready(r, fn);
    if (res) return res;
    if (!(max_norm > 0)) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "%s: max_norm %g is not positive", fn, max_norm);
    *norm = sqrt(r->amp.sum[0]);
    *coef = max_norm / (*norm + 1e-6);
    if (*coef > 1.0) *coef = 1.0; /* a NaN norm gives NaN, as torch.clamp does */
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_grad_norm(ddp_reducer *r, double *norm) {
    ddp_result res = ddp__grad_stats_ready(r, "ddp_reducer_grad_norm");
    if (res) return res;
    if (!norm) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_grad_norm: norm is NULL");
    *norm = sqrt(r->amp.sum[0]);
    return DDP_SUCCESS;
}

DDP_API int ddp_reducer_found_inf(const ddp_reducer *r) {
    if (ddp__grad_stats_ready(r, "ddp_reducer_found_inf")) return -1;
    return r->amp.sum[1] > 0;
}

DDP_API double ddp_reducer_clip_coef(ddp_reducer *r, double max_norm) {
    double norm = 0, coef = 0;
    return ddp__reducer_clip(r, max_norm, "ddp_reducer_clip_coef", &norm, &coef) ? -1.0 : coef;
}

/* The multiply runs over what the optimizer reads: the shards under ZeRO, every gradient at stage 0; a
   parameter that no rank used keeps its gradient, as torch skips a .grad that is None. */
DDP_API ddp_result ddp_reducer_clip_grad_norm(ddp_reducer *r, double max_norm, double *total_norm) {
    const ddp_shard *sh;
    double norm = 0, coef = 0;
    ddp_result res = ddp__reducer_clip(r, max_norm, "ddp_reducer_clip_grad_norm", &norm, &coef);
    int i, n;
    if (res) return res;
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_clip_grad_norm: called during a backward pass; call it after "
                         "ddp_reducer_end_backward");
    if (total_norm) *total_norm = norm;
    if (coef == 1.0) return DDP_SUCCESS;
    if (ddp__reducer_zero(r)) {
        n = ddp_reducer_shards(r, &sh);
        for (i = 0; i < n; i++)
            if (ddp_reducer_param_used(r, sh[i].param))
                ddp__amp_scan(sh[i].grad, sh[i].count, r->params[sh[i].param].dtype, (float)coef, NULL);
        return DDP_SUCCESS;
    }
    for (i = 0; i < r->nparams; i++)
        if (ddp_reducer_param_used(r, i))
            ddp__amp_scan(ddp_reducer_grad(r, i), r->params[i].count, r->params[i].dtype, (float)coef, NULL);
    return DDP_SUCCESS;
}
