/* [SECTION] crc32c: CRC-32C of a buffer (checkpoints' per-tensor checksums, fault tolerance's state transfer)
   CRC-32C, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; "123456789" gives
   0xE3069283. Portable path: slicing-by-8 (eight 256-entry tables, eight bytes per step); with
   SSE4.2, the instruction. */
#include "internal.h"

static uint32_t ddp__ck_crc_table[8][256];
static pthread_once_t ddp__ck_crc_once = PTHREAD_ONCE_INIT;

static void ddp__ck_crc_init(void) {
    uint32_t i, k;
    for (i = 0; i < 256; i++) {
        uint32_t c = i;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        ddp__ck_crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++)
        for (k = 1; k < 8; k++)
            ddp__ck_crc_table[k][i] = (ddp__ck_crc_table[k - 1][i] >> 8) ^ ddp__ck_crc_table[0][ddp__ck_crc_table[k - 1][i] & 0xffu];
}

/* crc is the running value without the final xor (start with 0xFFFFFFFF). */
static uint32_t ddp__ck_crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    pthread_once(&ddp__ck_crc_once, ddp__ck_crc_init);
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = ddp__ck_crc_table[7][lo & 0xffu] ^ ddp__ck_crc_table[6][(lo >> 8) & 0xffu] ^
              ddp__ck_crc_table[5][(lo >> 16) & 0xffu] ^ ddp__ck_crc_table[4][lo >> 24] ^
              ddp__ck_crc_table[3][hi & 0xffu] ^ ddp__ck_crc_table[2][(hi >> 8) & 0xffu] ^
              ddp__ck_crc_table[1][(hi >> 16) & 0xffu] ^ ddp__ck_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ ddp__ck_crc_table[0][(crc ^ *p++) & 0xffu];
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DDP__CK_HAVE_HW_CRC 1
/* The SSE4.2 crc32 instruction computes exactly this CRC, eight bytes at a time. It takes 3 cycles but
   can start every cycle, so three independent streams run over three adjacent lanes of
   DDP__CK_LANE bytes and are then joined: crc(A B) = shift(crc(A)) ^ crc0(B), where crc0 starts from
   0 and shift appends DDP__CK_LANE zero bytes. shift is linear over GF(2): it is four table lookups,
   built once from its values on the 32 unit vectors. */
#define DDP__CK_LANE 4096
static uint32_t ddp__ck_shift_table[4][256];
static pthread_once_t ddp__ck_shift_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2"))) static void ddp__ck_shift_init(void) {
    uint32_t basis[32];
    int b, k, i;
    for (b = 0; b < 32; b++) {
        unsigned long long c = 1ull << b;
        for (i = 0; i < DDP__CK_LANE / 8; i++) c = __builtin_ia32_crc32di(c, 0);
        basis[b] = (uint32_t)c;
    }
    for (k = 0; k < 4; k++)
        for (i = 0; i < 256; i++) {
            uint32_t v = 0;
            for (b = 0; b < 8; b++)
                if ((i >> b) & 1) v ^= basis[8 * k + b];
            ddp__ck_shift_table[k][i] = v;
        }
}

static uint32_t ddp__ck_shift(uint32_t c) {
    return ddp__ck_shift_table[0][c & 0xffu] ^ ddp__ck_shift_table[1][(c >> 8) & 0xffu] ^ ddp__ck_shift_table[2][(c >> 16) & 0xffu] ^
           ddp__ck_shift_table[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t ddp__ck_crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    unsigned long long c = crc;
    if (n >= 3 * DDP__CK_LANE) pthread_once(&ddp__ck_shift_once, ddp__ck_shift_init);
    while (n >= 3 * DDP__CK_LANE) {
        unsigned long long c1 = 0, c2 = 0, v0, v1, v2;
        size_t j;
        for (j = 0; j < DDP__CK_LANE; j += 8) {
            memcpy(&v0, p + j, 8);
            memcpy(&v1, p + DDP__CK_LANE + j, 8);
            memcpy(&v2, p + 2 * DDP__CK_LANE + j, 8);
            c = __builtin_ia32_crc32di(c, v0);
            c1 = __builtin_ia32_crc32di(c1, v1);
            c2 = __builtin_ia32_crc32di(c2, v2);
        }
        c = ddp__ck_shift(ddp__ck_shift((uint32_t)c) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * DDP__CK_LANE;
        n -= 3 * DDP__CK_LANE;
    }
    while (n >= 8) {
        unsigned long long v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
    return crc;
}
#endif

/* Running CRC32C register (start with 0xFFFFFFFF, finish with ~) over n more bytes. use_hw: 1 to take
   the instruction when the CPU has it (0 is for the tests). */
static uint32_t ddp__ck_crc_update(uint32_t reg, const void *data, size_t n, int use_hw) {
    const unsigned char *p = (const unsigned char *)data;
#ifdef DDP__CK_HAVE_HW_CRC
    if (use_hw && __builtin_cpu_supports("sse4.2")) return ddp__ck_crc_hw(reg, p, n);
#else
    (void)use_hw;
#endif
    return ddp__ck_crc_soft(reg, p, n);
}

static uint32_t ddp__ck_crc32c(const void *data, size_t n, int use_hw) { return ~ddp__ck_crc_update(0xFFFFFFFFu, data, n, use_hw); }

/* The CRC-32C of bytes at p, host memory or (DDP_CUDA) device memory: a device buffer is copied to pinned
   host memory on stream (NULL: the legacy default stream) and checked there. err: why it failed. */
static ddp_result ddp__crc32c_anywhere(const void *p, size_t bytes, void *stream, uint32_t *crc, char *err) {
#ifdef DDP_CUDA
    if (bytes && p && ddp__cuda_is_device_pointer(p) == 1) {
        ddp__cuda_stage *stage = NULL;
        void *host = NULL;
        ddp_result r = ddp__cuda_stage_host(&stage, bytes, &host, err, DDP__ERR_MAX);
        if (r == DDP_SUCCESS) r = ddp__cuda_stage_copy(host, p, bytes, stream, err, DDP__ERR_MAX);
        if (r == DDP_SUCCESS) r = ddp__cuda_stage_sync(stream, err, DDP__ERR_MAX);
        if (r == DDP_SUCCESS) *crc = ddp__ck_crc32c(host, bytes, 1);
        ddp__cuda_stage_free(stage);
        return r;
    }
#else
    (void)stream, (void)err;
#endif
    *crc = ddp__ck_crc32c(p, bytes, 1);
    return DDP_SUCCESS;
}
