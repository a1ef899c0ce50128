/* [SECTION] dtype: sizes and names, f16/bf16 conversion, element-wise reduction
   f16 and bf16 are reduced in f32 and rounded back to nearest even at every step, so a sum of
   values that f16 represents exactly is exact. Integer SUM and PROD wrap (computed unsigned, where
   wrapping is defined), matching two's complement hardware and NCCL. */
#include "internal.h"

static const struct {
    const char *name;
    size_t size;
} ddp__dtypes[DDP_DTYPE_COUNT] = {
    {"default", 0}, {"f32", 4}, {"f64", 8}, {"f16", 2}, {"bf16", 2},
    {"i8", 1},      {"u8", 1},  {"i32", 4}, {"i64", 8},
};

static int ddp__dtype_valid(ddp_dtype t) { return (int)t > 0 && (int)t < DDP_DTYPE_COUNT; }
static int ddp__op_valid(ddp_op op) { return (int)op >= 0 && (int)op < DDP_OP_COUNT; }
static int ddp__dtype_is_float(ddp_dtype t) { return t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16; }

DDP_API const char *ddp_dtype_name(ddp_dtype t) { return ((int)t >= 0 && (int)t < DDP_DTYPE_COUNT) ? ddp__dtypes[t].name : "?"; }
DDP_API size_t ddp_dtype_size(ddp_dtype t) { return ddp__dtype_valid(t) ? ddp__dtypes[t].size : 0; }

DDP_API const char *ddp_op_name(ddp_op op) {
    static const char *names[DDP_OP_COUNT] = {"sum", "avg", "prod", "min", "max"};
    return ddp__op_valid(op) ? names[op] : "?";
}

/* ---- f16 / bf16 ---- */

static uint32_t ddp__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float ddp__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

DDP_API float ddp_bf16_to_f32(uint16_t b) { return ddp__bits_f32((uint32_t)b << 16); }

DDP_API uint16_t ddp_f32_to_bf16(float f) {
    uint32_t u = ddp__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

DDP_API float ddp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return ddp__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp == 0) {                                                          /* zero, subnormal */
        float v = (float)man * (1.0f / 16777216.0f);                         /* man * 2^-24, exact */
        return sign ? -v : v;
    }
    return ddp__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

DDP_API uint16_t ddp_f32_to_f16(float f) {
    uint32_t u = ddp__f32_bits(f), sign = (u >> 16) & 0x8000u, absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((absu >> 13) & 0x3ffu)); /* NaN */
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: infinity */
    if (absu < 0x38800000u) {                                   /* below 2^-14: subnormal f16 */
        /* Adding 0.5 (2^-1) in f32 puts the f16 subnormal grid (2^-24) at f32's last place, so the
           hardware's round-to-nearest-even rounds exactly as f16 would. */
        float v = ddp__bits_f32(absu) + 0.5f;
        return (uint16_t)(sign | (ddp__f32_bits(v) - 0x3f000000u));
    }
    {
        uint32_t mant_odd = (absu >> 13) & 1u;
        absu += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
        return (uint16_t)(sign | (absu >> 13));
    }
}

/* ---- element-wise reduction ----
   One loop per (type, op), written so that the compiler vectorises it: blocks of 16 elements are
   loaded into locals before any is stored, so the compiler needs no proof that dst and src do not
   overlap (gcc 12 -O2 does not vectorise the plain loop; this form it does, measured 2x at 1 MiB). */

#define DDP__REDUCE_LOOP(T, EXPR)                                                   \
    do {                                                                            \
        T *d_ = (T *)dst;                                                           \
        const T *s_ = (const T *)src;                                               \
        size_t i_ = 0, k_;                                                          \
        for (; i_ + 16 <= count; i_ += 16) {                                        \
            T x_[16], y_[16];                                                       \
            for (k_ = 0; k_ < 16; k_++) x_[k_] = d_[i_ + k_], y_[k_] = s_[i_ + k_]; \
            for (k_ = 0; k_ < 16; k_++) {                                           \
                T a = x_[k_], b = y_[k_];                                           \
                d_[i_ + k_] = (EXPR);                                               \
            }                                                                       \
        }                                                                           \
        for (; i_ < count; i_++) {                                                  \
            T a = d_[i_], b = s_[i_];                                               \
            d_[i_] = (EXPR);                                                        \
        }                                                                           \
    } while (0)

/* Wrapping integer arithmetic through the unsigned type of the same width. */
#define DDP__REDUCE_INT(T, U)                                                \
    switch (op) {                                                            \
    case DDP_SUM: case DDP_AVG: DDP__REDUCE_LOOP(T, (T)((U)a + (U)b)); break; \
    case DDP_PROD: DDP__REDUCE_LOOP(T, (T)((U)a * (U)b)); break;             \
    case DDP_MIN: DDP__REDUCE_LOOP(T, a < b ? a : b); break;                 \
    case DDP_MAX: DDP__REDUCE_LOOP(T, a > b ? a : b); break;                 \
    default: break;                                                          \
    }

/* MIN and MAX propagate NaN, as torch.minimum / torch.maximum do. */
#define DDP__REDUCE_FLOAT(T)                                                   \
    switch (op) {                                                              \
    case DDP_SUM: case DDP_AVG: DDP__REDUCE_LOOP(T, a + b); break;             \
    case DDP_PROD: DDP__REDUCE_LOOP(T, a * b); break;                          \
    case DDP_MIN: DDP__REDUCE_LOOP(T, (a < b || a != a) ? a : b); break;       \
    case DDP_MAX: DDP__REDUCE_LOOP(T, (a > b || a != a) ? a : b); break;       \
    default: break;                                                            \
    }

static float ddp__combine_f32(float a, float b, ddp_op op) {
    switch (op) {
    case DDP_PROD: return a * b;
    case DDP_MIN: return (a < b || a != a) ? a : b;
    case DDP_MAX: return (a > b || a != a) ? a : b;
    default: return a + b;
    }
}

static void ddp__reduce(void *dst, const void *src, size_t count, ddp_dtype t, ddp_op op) {
    size_t i;
    DDP_ASSERT(ddp__dtype_valid(t) && ddp__op_valid(op)); /* the public calls checked both */
    switch (t) {
    case DDP_F32: DDP__REDUCE_FLOAT(float); break;
    case DDP_F64: DDP__REDUCE_FLOAT(double); break;
    case DDP_I8: DDP__REDUCE_INT(int8_t, uint8_t); break;
    case DDP_U8: DDP__REDUCE_INT(uint8_t, uint8_t); break;
    case DDP_I32: DDP__REDUCE_INT(int32_t, uint32_t); break;
    case DDP_I64: DDP__REDUCE_INT(int64_t, uint64_t); break;
    case DDP_F16: {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < count; i++) d[i] = ddp_f32_to_f16(ddp__combine_f32(ddp_f16_to_f32(d[i]), ddp_f16_to_f32(s[i]), op));
        break;
    }
    case DDP_BF16: {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < count; i++)
            d[i] = ddp_f32_to_bf16(ddp__combine_f32(ddp_bf16_to_f32(d[i]), ddp_bf16_to_f32(s[i]), op));
        break;
    }
    default: break;
    }
}

#define DDP__DIVIDE_LOOP(T, EXPR)        \
    do {                                 \
        T *b_ = (T *)buf;                \
        size_t i_;                       \
        for (i_ = 0; i_ < count; i_++) { \
            T a = b_[i_];                \
            b_[i_] = (EXPR);             \
        }                                \
    } while (0)

static void ddp__divide(void *buf, size_t count, ddp_dtype t, int n) {
    size_t i;
    DDP_ASSERT(ddp__dtype_valid(t) && n > 0); /* AVG divides by a group's size */
    switch (t) {
    case DDP_F32: DDP__DIVIDE_LOOP(float, a / (float)n); break;
    case DDP_F64: DDP__DIVIDE_LOOP(double, a / (double)n); break;
    case DDP_I8: DDP__DIVIDE_LOOP(int8_t, (int8_t)(a / n)); break;
    case DDP_U8: DDP__DIVIDE_LOOP(uint8_t, (uint8_t)(a / n)); break;
    case DDP_I32: DDP__DIVIDE_LOOP(int32_t, (int32_t)(a / n)); break;
    case DDP_I64: DDP__DIVIDE_LOOP(int64_t, a / (int64_t)n); break;
    case DDP_F16: {
        uint16_t *b = (uint16_t *)buf;
        for (i = 0; i < count; i++) b[i] = ddp_f32_to_f16(ddp_f16_to_f32(b[i]) / (float)n);
        break;
    }
    case DDP_BF16: {
        uint16_t *b = (uint16_t *)buf;
        for (i = 0; i < count; i++) b[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(b[i]) / (float)n);
        break;
    }
    default: break;
    }
}

/* ---- conversions between the floating dtypes (the reducer's compression, its scaled copies) ---- */

/* One element of a floating dtype, as f32 (f64 keeps its precision through ddp__load_f64). */
static float ddp__get_f32(const void *p, ddp_dtype t, size_t i) {
    switch (t) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return (float)((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}
static void ddp__put_f32(void *p, ddp_dtype t, size_t i, float v) {
    switch (t) {
    case DDP_F32: ((float *)p)[i] = v; break;
    case DDP_F64: ((double *)p)[i] = (double)v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16(v); break;
    default: ((uint16_t *)p)[i] = ddp_f32_to_bf16(v); break;
    }
}

static void ddp__host_convert_scaled(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count,
                                     double scale) {
    size_t i;
    if (dst_t == src_t && scale == 1.0) {
        if (dst != src && count) memcpy(dst, src, count * ddp_dtype_size(dst_t));
        return;
    }
    if (dst_t == DDP_F32 && src_t == DDP_F32) { /* the common case, kept simple enough to vectorise */
        float *d = (float *)dst, s = (float)scale;
        const float *x = (const float *)src;
        for (i = 0; i < count; i++) d[i] = x[i] * s;
        return;
    }
    if (dst_t == DDP_F64 || src_t == DDP_F64) {
        for (i = 0; i < count; i++) {
            double v = (src_t == DDP_F64 ? ((const double *)src)[i] : (double)ddp__get_f32(src, src_t, i)) * scale;
            if (dst_t == DDP_F64)
                ((double *)dst)[i] = v;
            else
                ddp__put_f32(dst, dst_t, i, (float)v);
        }
        return;
    }
    {
        float s = (float)scale;
        for (i = 0; i < count; i++) ddp__put_f32(dst, dst_t, i, ddp__get_f32(src, src_t, i) * s);
    }
}

static void ddp__host_convert(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    size_t i;
    if (dst_t == src_t) {
        if (dst != src && count) memcpy(dst, src, count * ddp_dtype_size(dst_t));
        return;
    }
    if (dst_t == DDP_F64) {
        for (i = 0; i < count; i++) ((double *)dst)[i] = (double)ddp__get_f32(src, src_t, i);
        return;
    }
    for (i = 0; i < count; i++) ddp__put_f32(dst, dst_t, i, ddp__get_f32(src, src_t, i));
}
