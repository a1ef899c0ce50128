/* [SECTION] amp-impl: GradScaler's update, the inf/NaN check and unscale, the gradient statistics of a pass
   (amp.h has the API and torch's arithmetic; the reducer's passes use ddp__amp_begin/add/finish). */
#include "internal.h"

/* GradScaler.unscale_'s inverse scale: 1 / scale in f64, then f32 (torch's scale tensor is f32 too). */
static float ddp__amp_inv_scale(double scale) { return (float)(1.0 / (double)(float)scale); }

/* The one element loop of _amp_foreach_non_finite_check_and_unscale_ (and of clip_grad_norm_'s multiply):
   data[i] *= inv (f32; f64 data in f64; f16/bf16 in f32, rounded back; inv == 1 leaves data as it is).
   Returns how many elements were inf or NaN before the multiply (f32 with a multiply: how many are after
   it, which is nonzero exactly when some element was before); adds the squares of the values after it
   (in f64) to *sumsq when sumsq is not NULL. */
static size_t ddp__amp_count_bad_f32(const float *p, size_t count) {
    size_t i, bad = 0;
    for (i = 0; i < count; i++) bad += !(fabsf(p[i]) <= FLT_MAX); /* NaN compares false */
    return bad;
}

/* f32, the reducer's common case, in one pass at memory speed: four independent f64 sums of squares (no
   chain of dependent adds), and v - v summed alongside, which stays 0 unless some v is inf or NaN; only
   then are they counted, in a second pass (a step that the scaler skips). The count is of the values
   before the multiply, as torch's (a finite value times an inverse scale above 1 may overflow). */
static size_t ddp__amp_scan_f32(float *p, size_t count, float inv, double *sumsq) {
    double s[4] = {0, 0, 0, 0};
    float poison[4] = {0, 0, 0, 0};
    size_t i = 0, k;
    if (inv == 1.0f) {
        for (; i + 4 <= count; i += 4)
            for (k = 0; k < 4; k++) s[k] += (double)p[i + k] * (double)p[i + k], poison[k] += p[i + k] - p[i + k];
    } else {
        for (; i + 4 <= count; i += 4)
            for (k = 0; k < 4; k++) {
                float v = p[i + k];
                poison[k] += v - v;
                p[i + k] = v = v * inv;
                s[k] += (double)v * (double)v;
            }
    }
    for (k = 0; i < count; i++, k++) {
        float v = p[i];
        poison[k] += v - v;
        if (inv != 1.0f) p[i] = v = v * inv;
        s[k] += (double)v * (double)v;
    }
    if (sumsq) *sumsq += (s[0] + s[1]) + (s[2] + s[3]);
    if (poison[0] + poison[1] + poison[2] + poison[3] == 0.0f) return 0;
    return ddp__amp_count_bad_f32(p, count); /* >= 1: inf and NaN stay so through the multiply */
}

static size_t ddp__amp_scan(void *data, size_t count, ddp_dtype t, float inv, double *sumsq) {
    size_t i, bad = 0;
    double s = 0;
    if (t == DDP_F32) {
        return ddp__amp_scan_f32((float *)data, count, inv, sumsq);
    } else if (t == DDP_F64) {
        double *p = (double *)data, m = (double)inv;
        for (i = 0; i < count; i++) {
            double v = p[i];
            bad += !(fabs(v) <= DBL_MAX);
            if (inv != 1.0f) p[i] = v = v * m;
            s += v * v;
        }
    } else {
        for (i = 0; i < count; i++) {
            float v = ddp__get_f32(data, t, i);
            bad += !(fabsf(v) <= FLT_MAX);
            if (inv != 1.0f) {
                ddp__put_f32(data, t, i, v * inv);
                v = ddp__get_f32(data, t, i); /* the value the optimizer reads: rounded to t */
            }
            s += (double)v * (double)v;
        }
    }
    if (sumsq) *sumsq += s;
    return bad;
}

/* ---- the public helpers ---- */

DDP_API void ddp_grad_scaler_init(ddp_grad_scaler *s) {
    if (!s) return;
    s->scale = 65536.0;
    s->growth_factor = 2.0;
    s->backoff_factor = 0.5;
    s->growth_interval = 2000;
    s->growth_tracker = 0;
}

/* torch's _amp_update_scale_cpu_kernel: the products are f64 (f32 scale times a double factor) stored
   into the f32 scale tensor; a grown scale that overflows f32 is not taken. */
DDP_API int ddp_grad_scaler_update(ddp_grad_scaler *s, int found_inf) {
    float scale;
    if (!s || found_inf < 0) {
        ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_grad_scaler_update: %s", !s ? "the scaler is NULL" :
                  "found_inf is negative (an error of ddp_reducer_found_inf?); the scaler is left as it was");
        return -1;
    }
    scale = (float)s->scale; /* torch's scale tensor holds an f32 from the start */
    if (found_inf) {
        scale = (float)(scale * s->backoff_factor);
        s->growth_tracker = 0;
    } else if (s->growth_tracker + 1 == s->growth_interval) {
        float grown = (float)(scale * s->growth_factor);
        if (fabsf(grown) <= FLT_MAX) scale = grown;
        s->growth_tracker = 0;
    } else {
        s->growth_tracker++;
    }
    s->scale = scale;
    return !found_inf;
}

DDP_API ddp_result ddp_non_finite_check_and_unscale(void *data, size_t count, ddp_dtype t, double inv_scale, int *found_inf) {
    const char *fn = "ddp_non_finite_check_and_unscale";
    if (!found_inf || (!data && count))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, found_inf ? "data" : "found_inf");
    if (!ddp__dtype_is_float(t))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %s is not a floating dtype (DDP_F32, DDP_F64, DDP_F16 "
                         "or DDP_BF16)", fn, ddp_dtype_name(t));
    if (!((float)inv_scale > 0 && (float)inv_scale <= FLT_MAX))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: inv_scale %g is not a finite positive f32; pass 1.0 / "
                         "scaler.scale", fn, inv_scale);
    if (ddp__amp_scan(data, count, t, (float)inv_scale, NULL)) *found_inf = 1;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_any_nonfinite(ddp_group *g, int local, int *global) {
    int32_t flag = local != 0;
    ddp_result res;
    if (!global) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_any_nonfinite: global is NULL");
    if ((res = ddp_all_reduce(g, &flag, 1, DDP_I32, DDP_MAX)) != DDP_SUCCESS) return res;
    *global = flag;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sum_sq(ddp_group *g, double local, double *total) {
    ddp_result res;
    if (!total) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_sum_sq: total is NULL");
    if ((res = ddp_all_reduce(g, &local, 1, DDP_F64, DDP_SUM)) != DDP_SUCCESS) return res;
    *total = local;
    return DDP_SUCCESS;
}

/* ---- a pass's gradient statistics (the reducer's grad_stats and loss_scale) ----
   The reducer calls ddp__amp_begin when a synchronised pass begins, ddp__amp_add on each piece of
   averaged gradient this rank owns, in the pass that already writes or reads it (unscaling it in place
   with the scale read at begin), and ddp__amp_finish once the pass is complete: with reduce (the ranks own
   different pieces, ZeRO) one all_reduce SUM of 16 bytes, {sum of squares, non-finite count} in f64, so
   every rank ends with the same bits (counts are exact in f64 up to 2^53). */

static void ddp__amp_begin(ddp__amp_pass *a, int on, const ddp_grad_scaler *s) {
    a->on = on;
    a->inv_scale = s ? ddp__amp_inv_scale(s->scale) : 1.0f;
    a->sum[0] = a->sum[1] = 0;
    a->valid = 0;
}

static void ddp__amp_add(ddp__amp_pass *a, void *data, ddp_dtype t, size_t count) {
    if (a->on) a->sum[1] += (double)ddp__amp_scan(data, count, t, a->inv_scale, &a->sum[0]);
}

static ddp_result ddp__amp_finish(ddp_group *g, ddp__amp_pass *a, int reduce) {
    ddp_result res;
    if (!a->on) return DDP_SUCCESS;
    if (reduce && (res = ddp_all_reduce(g, a->sum, 2, DDP_F64, DDP_SUM)) != DDP_SUCCESS) return res;
    a->valid = 1;
    return DDP_SUCCESS;
}
