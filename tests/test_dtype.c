/* f16 / bf16 conversions against the test's own reference (decoding with ldexp, rounding with
   nearbyint on a scaled grid): every one of the 65536 f16 and bf16 bit patterns decodes exactly,
   and f32 -> f16 / bf16 round to nearest even on a dense sample of f32 bit patterns (every
   65th pattern, plus every pattern near the rounding boundaries and the special values). */
#include "testlib.h"

static int same_float(float a, float b) { return (a != a && b != b) || (a == b && signbit(a) == signbit(b)); }

static void check_f32(uint32_t u) {
    float x, want16, want_bf, got16, got_bf;
    memcpy(&x, &u, 4);
    want16 = tl_ref_f16(x);
    want_bf = tl_ref_bf16(x);
    got16 = tl_decode_f16(ddp_f32_to_f16(x));
    got_bf = tl_decode_bf16(ddp_f32_to_bf16(x));
    CHECK(same_float(got16, want16), "f32 0x%08x (%.9g) -> f16 gives %.9g, expected %.9g", (unsigned)u, x, got16, want16);
    CHECK(same_float(got_bf, want_bf), "f32 0x%08x (%.9g) -> bf16 gives %.9g, expected %.9g", (unsigned)u, x, got_bf, want_bf);
}

int main(void) {
    uint32_t u, h;
    size_t checked = 0;
    for (h = 0; h < 65536; h++) {
        CHECK(same_float(ddp_f16_to_f32((uint16_t)h), tl_decode_f16((uint16_t)h)), "f16 0x%04x decodes to %g, expected %g",
              (unsigned)h, ddp_f16_to_f32((uint16_t)h), tl_decode_f16((uint16_t)h));
        CHECK(same_float(ddp_bf16_to_f32((uint16_t)h), tl_decode_bf16((uint16_t)h)), "bf16 0x%04x", (unsigned)h);
        /* round trip: every non-NaN f16 survives f16 -> f32 -> f16 unchanged */
        if (!((h & 0x7c00) == 0x7c00 && (h & 0x3ff)))
            CHECK(ddp_f32_to_f16(ddp_f16_to_f32((uint16_t)h)) == h, "f16 0x%04x does not round-trip", (unsigned)h);
    }
    for (u = 0; u < 0xffffffc0u; u += 65) check_f32(u), checked++;
    /* every f32 whose bits sit at or next to an f16 / bf16 rounding boundary, for all exponents */
    for (h = 0; h < 65536; h++) {
        uint32_t base = h << 16, d;
        for (d = 0; d < 4; d++) {
            check_f32(base + 0x8000u - 2 + d); /* bf16 halfway point and neighbours */
            check_f32(base + d);
        }
        checked += 8;
    }
    for (u = 0x33000000u; u < 0x47800000u; u += 0x1000u) { /* f16 halfway points over its whole range */
        check_f32(u - 1), check_f32(u), check_f32(u + 1);
        checked += 3;
    }
    CHECK(ddp_f32_to_f16(65504.0f) == 0x7bff && ddp_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow boundary");
    CHECK(ddp_f32_to_f16(NAN) != 0x7c00 && (ddp_f32_to_f16(NAN) & 0x7c00) == 0x7c00, "NaN must stay NaN");
    CHECK(ddp_bf16_to_f32(ddp_f32_to_bf16(NAN)) != ddp_bf16_to_f32(ddp_f32_to_bf16(NAN)), "bf16 NaN must stay NaN");
    CHECK(ddp_dtype_size(DDP_BF16) == 2 && ddp_dtype_size(DDP_I64) == 8 && ddp_dtype_size(DDP_DTYPE_DEFAULT) == 0, "dtype sizes");
    CHECK(strcmp(ddp_dtype_name(DDP_BF16), "bf16") == 0 && strcmp(ddp_op_name(DDP_AVG), "avg") == 0, "names");
    CHECK(strcmp(ddp_dtype_name((ddp_dtype)42), "?") == 0 && strcmp(ddp_op_name((ddp_op)-1), "?") == 0, "out-of-range names");
    CHECK(ddp_version() == DDP_VERSION_NUMBER, "version");
    printf("f16/bf16: 65536 patterns decode exactly; %zu f32 patterns round to nearest even\n", checked);
    return 0;
}
