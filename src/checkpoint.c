/* [SECTION] checkpoint: safetensors files, CRC32C, atomic save, load everywhere or broadcast, shards
   Mirrors the PyTorch DDP checkpoint recipe (rank 0 torch.save + barrier; torch.load on every rank) with
   safetensors as the format. Layout of this file:
     crc32c        Castagnoli CRC, SSE4.2 instruction when the CPU has it, else slicing-by-8 tables
     meta          the caller's key/value map and its typed helpers
     parser        a strict, bounded parser for the safetensors JSON header (the only JSON we accept:
                   one object of tensor entries and "__metadata__"; strings, non-negative integers,
                   arrays of them); every offset is checked with overflow-safe arithmetic
     writer        the JSON header, then tmp file -> fsync -> rename -> fsync(directory)
     collectives   agreement on the outcome (every rank fails together), chunked broadcasts
     rotation      keep_last and ddp_checkpoint_latest: files that differ in one run of digits */
#include "internal.h"

#include <dirent.h>

#define DDP__CK_MAX_HEADER 100000000ull         /* bytes of JSON header, as the safetensors crate allows */
#define DDP__CK_CHUNK ((size_t)4 << 20)         /* bytes per broadcast; the same on every rank */
#define DDP__CK_MAX_INT ((uint64_t)INT64_MAX)   /* largest integer a header may hold */
#define DDP__CK_CRC_PREFIX "ddp.crc32c."
#define DDP__CK_SHARD_PREFIX "ddp.shard."
#define DDP__CK_SHARD_WORLD "ddp.shard.world_size"
#define DDP__CK_SHARD_RANK "ddp.shard.rank"
#define DDP__CK_SHARD_ID "ddp.shard.save_id"

static int ddp__ck_little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* ---- crc32c ----
   CRC-32C, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; "123456789" gives
   0xE3069283. Portable path: slicing-by-8 (eight 256-entry tables, eight bytes per step). */

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

/* ---- UTF-8 ----
   Strict RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF. Returns the length of the
   sequence at p (1..4), or 0 when it is not valid. */
static int ddp__ck_utf8_seq(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    int len, i;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1Fu;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0Fu;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07u;
    else return 0;
    if (end - p < len) return 0;
    for (i = 1; i < len; i++) {
        if ((p[i] & 0xC0u) != 0x80u) return 0;
        cp = (cp << 6) | (p[i] & 0x3Fu);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    return len;
}

static int ddp__ck_utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s, *end = p + strlen(s);
    while (p < end) {
        int k = ddp__ck_utf8_seq(p, end);
        if (!k) return 0;
        p += k;
    }
    return 1;
}

/* ---- meta ---- */

static int ddp__ck_meta_find(const ddp_meta *m, const char *key) {
    int i;
    for (i = 0; m && i < m->count; i++)
        if (strcmp(m->entries[i].key, key) == 0) return i;
    return -1;
}

/* Append without looking for an existing key (the parser checks duplicates once, by sorting). */
static ddp_result ddp__ck_meta_append(ddp_meta *m, char *key, char *value) {
    if (m->count == m->capacity) {
        int cap = m->capacity ? 2 * m->capacity : 8;
        ddp_meta_entry *e;
        if (cap > INT_MAX / 2) return DDP_ERR_OUT_OF_MEMORY;
        e = (ddp_meta_entry *)DDP_REALLOC(m->entries, (size_t)cap * sizeof *e);
        if (!e) return DDP_ERR_OUT_OF_MEMORY;
        m->entries = e;
        m->capacity = cap;
    }
    m->entries[m->count].key = key;
    m->entries[m->count].value = value;
    m->count++;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_meta_set(ddp_meta *m, const char *key, const char *value) {
    char *k, *v;
    int i;
    if (!m || !key || !*key || !value)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set: map, key and value must not be NULL and key not empty");
    if (!ddp__ck_utf8_valid(key) || !ddp__ck_utf8_valid(value))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set: key \"%.64s\" or its value is not valid UTF-8", key);
    v = ddp__strdup(value);
    if (!v) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set: out of memory copying the value of \"%.64s\"", key);
    i = ddp__ck_meta_find(m, key);
    if (i >= 0) {
        ddp__free(m->entries[i].value);
        m->entries[i].value = v;
        return DDP_SUCCESS;
    }
    k = ddp__strdup(key);
    if (!k || ddp__ck_meta_append(m, k, v) != DDP_SUCCESS) {
        ddp__free(k);
        ddp__free(v);
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set: out of memory adding \"%.64s\"", key);
    }
    return DDP_SUCCESS;
}

DDP_API const char *ddp_meta_get(const ddp_meta *m, const char *key) {
    int i = key ? ddp__ck_meta_find(m, key) : -1;
    return i >= 0 ? m->entries[i].value : NULL;
}

DDP_API int ddp_meta_remove(ddp_meta *m, const char *key) {
    int i = key ? ddp__ck_meta_find(m, key) : -1;
    if (i < 0) return 0;
    ddp__free(m->entries[i].key);
    ddp__free(m->entries[i].value);
    memmove(m->entries + i, m->entries + i + 1, (size_t)(m->count - i - 1) * sizeof *m->entries);
    m->count--;
    return 1;
}

DDP_API void ddp_meta_free(ddp_meta *m) {
    int i;
    if (!m) return;
    for (i = 0; i < m->count; i++) {
        ddp__free(m->entries[i].key);
        ddp__free(m->entries[i].value);
    }
    ddp__free(m->entries);
    m->entries = NULL;
    m->count = m->capacity = 0;
}

DDP_API ddp_result ddp_meta_set_int(ddp_meta *m, const char *key, int64_t value) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)value);
    return ddp_meta_set(m, key, buf);
}

DDP_API ddp_result ddp_meta_get_int(const ddp_meta *m, const char *key, int64_t *value) {
    const char *s = ddp_meta_get(m, key), *p;
    uint64_t mag = 0, limit;
    int neg;
    if (!s) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata has no key \"%.64s\"", key ? key : "(null)");
    p = s;
    neg = (*p == '-');
    if (neg) p++;
    limit = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
    if (!*p) goto bad;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || mag > (limit - (uint64_t)(*p - '0')) / 10) goto bad;
        mag = mag * 10 + (uint64_t)(*p - '0');
    }
    if (!value) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_get_int: value must not be NULL");
    *value = neg ? (int64_t)(0u - mag) : (int64_t)mag;
    return DDP_SUCCESS;
bad:
    return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" = \"%.64s\" is not a 64-bit decimal integer", key, s);
}

DDP_API ddp_result ddp_meta_set_bytes(ddp_meta *m, const char *key, const void *data, size_t size) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *b = (const unsigned char *)data;
    char *s;
    size_t i;
    ddp_result r;
    if ((!data && size) || size > (SIZE_MAX - 1) / 2)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set_bytes(\"%.64s\"): data is NULL or size too large", key ? key : "(null)");
    s = (char *)ddp__malloc(2 * size + 1);
    if (!s) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set_bytes: out of memory for %zu bytes", size);
    for (i = 0; i < size; i++) {
        s[2 * i] = hex[b[i] >> 4];
        s[2 * i + 1] = hex[b[i] & 15];
    }
    s[2 * size] = '\0';
    r = ddp_meta_set(m, key, s);
    ddp__free(s);
    return r;
}

static int ddp__ck_hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

DDP_API ddp_result ddp_meta_get_bytes(const ddp_meta *m, const char *key, void *data, size_t capacity, size_t *size) {
    const char *s = ddp_meta_get(m, key);
    size_t len, i;
    if (!s) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata has no key \"%.64s\"", key ? key : "(null)");
    len = strlen(s);
    if (len % 2) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" has an odd number of hex digits", key);
    for (i = 0; i < len; i++)
        if (ddp__ck_hexval(s[i]) < 0)
            return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" is not hex (character %zu is '%c')", key, i, s[i]);
    if (size) *size = len / 2;
    if (len / 2 > capacity || (!data && len))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "checkpoint metadata \"%.64s\" holds %zu bytes; the buffer has room for %zu",
                         key, len / 2, data ? capacity : 0);
    for (i = 0; i < len / 2; i++)
        ((unsigned char *)data)[i] = (unsigned char)(ddp__ck_hexval(s[2 * i]) * 16 + ddp__ck_hexval(s[2 * i + 1]));
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_meta_set_resume(ddp_meta *m, const ddp_resume_state *s) {
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set_resume: state must not be NULL");
    if ((r = ddp_meta_set_int(m, DDP_META_STEP, s->step)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_EPOCH, s->epoch)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_SAMPLER_POSITION, s->sampler_position)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_WORLD_SIZE, s->world_size)) != DDP_SUCCESS) return r;
    if (s->rng_state_size == 0) {
        ddp_meta_remove(m, DDP_META_RNG_STATE);
        return DDP_SUCCESS;
    }
    return ddp_meta_set_bytes(m, DDP_META_RNG_STATE, s->rng_state, s->rng_state_size);
}

DDP_API ddp_result ddp_meta_get_resume(const ddp_meta *m, ddp_resume_state *s) {
    int64_t ws;
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_get_resume: state must not be NULL");
    if ((r = ddp_meta_get_int(m, DDP_META_STEP, &s->step)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_EPOCH, &s->epoch)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_SAMPLER_POSITION, &s->sampler_position)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_WORLD_SIZE, &ws)) != DDP_SUCCESS) return r;
    if (ws < 0 || ws > INT_MAX) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata " DDP_META_WORLD_SIZE " = %lld is out of range", (long long)ws);
    s->world_size = (int)ws;
    if (!ddp_meta_get(m, DDP_META_RNG_STATE)) {
        s->rng_state_size = 0;
        return DDP_SUCCESS;
    }
    return ddp_meta_get_bytes(m, DDP_META_RNG_STATE, s->rng_state, s->rng_state_size, &s->rng_state_size);
}

/* ---- parser ----
   Grammar (JSON, restricted to what a safetensors header holds; whitespace allowed between tokens and
   at the end, which is how writers pad the header):
     header   = '{' [ member *( ',' member ) ] '}'
     member   = string ':' ( tensor | metadata )      ; metadata when the key is "__metadata__"
     tensor   = '{' "dtype": string, "shape": [uint...], "data_offsets": [uint, uint] '}' (any order)
     metadata = '{' [ string ':' string *( ',' string ':' string ) ] '}'
   Integers are plain decimal (no sign, fraction, exponent or leading zero), at most 2^63-1. Strings
   are UTF-8 with JSON escapes; \u0000 is refused (C strings). Duplicate names and keys are errors. */

/* safetensors dtypes of one byte or more; ddp.h loads the first eight, the rest are recognised so that
   such a tensor can be skipped (allow_unexpected) or named in a mismatch. */
static const struct {
    const char *name;
    ddp_dtype dtype;
    unsigned size;
} ddp__ck_dtypes[] = {
    {"F32", DDP_F32, 4},          {"F64", DDP_F64, 8},          {"F16", DDP_F16, 2},      {"BF16", DDP_BF16, 2},
    {"I8", DDP_I8, 1},            {"U8", DDP_U8, 1},            {"I32", DDP_I32, 4},      {"I64", DDP_I64, 8},
    {"BOOL", DDP_DTYPE_DEFAULT, 1}, {"I16", DDP_DTYPE_DEFAULT, 2}, {"U16", DDP_DTYPE_DEFAULT, 2},
    {"U32", DDP_DTYPE_DEFAULT, 4},  {"U64", DDP_DTYPE_DEFAULT, 8}, {"F8_E5M2", DDP_DTYPE_DEFAULT, 1},
    {"F8_E4M3", DDP_DTYPE_DEFAULT, 1},
};
#define DDP__CK_NDTYPES ((int)(sizeof ddp__ck_dtypes / sizeof ddp__ck_dtypes[0]))

static const char *ddp__ck_st_name(ddp_dtype t) {
    int i;
    for (i = 0; i < DDP__CK_NDTYPES; i++)
        if (ddp__ck_dtypes[i].dtype == t && t != DDP_DTYPE_DEFAULT) return ddp__ck_dtypes[i].name;
    return "?";
}

typedef struct ddp__ck_entry {
    char *name;
    int st;           /* index into ddp__ck_dtypes */
    int ndim;         /* may exceed 8; then only the first 8 dimensions are kept */
    int64_t shape[8];
    uint64_t begin, end; /* byte offsets into the data section */
} ddp__ck_entry;

typedef struct ddp__ck_header {
    ddp__ck_entry *e; /* sorted by (begin, end, name): the order of the data */
    int n, cap;
    ddp_meta meta;    /* "__metadata__", in file order */
    ddp__ck_entry **by_name;
    ddp_meta_entry **meta_sorted;
} ddp__ck_header;

typedef struct ddp__ck_json {
    const unsigned char *start, *p, *end;
    char *err; /* DDP__ERR_MAX bytes */
} ddp__ck_json;

static void ddp__ck_header_free(ddp__ck_header *h) {
    int i;
    for (i = 0; i < h->n; i++) ddp__free(h->e[i].name);
    ddp__free(h->e);
    ddp__free(h->by_name);
    ddp__free(h->meta_sorted);
    ddp_meta_free(&h->meta);
    memset(h, 0, sizeof *h);
}

static ddp_result ddp__ck_bad(ddp__ck_json *j, const char *what) {
    return ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: %s", (size_t)(j->p - j->start), what);
}

static void ddp__ck_ws(ddp__ck_json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* Skip whitespace, then consume c or fail saying what was expected. */
static ddp_result ddp__ck_expect(ddp__ck_json *j, char c, const char *what) {
    ddp__ck_ws(j);
    if (j->p >= j->end || *j->p != (unsigned char)c) return ddp__ck_bad(j, what);
    j->p++;
    return DDP_SUCCESS;
}

/* After a member or element: 1 when the container continues (','), 0 when it closed, -1 on error. */
static int ddp__ck_next(ddp__ck_json *j, char close, const char *what) {
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == ',') return j->p++, 1;
    if (j->p < j->end && *j->p == (unsigned char)close) return j->p++, 0;
    ddp__ck_bad(j, what);
    return -1;
}

static int ddp__ck_hex4(const unsigned char *p, const unsigned char *end, uint32_t *v) {
    int i;
    *v = 0;
    if (end - p < 4) return 0;
    for (i = 0; i < 4; i++) {
        int d = ddp__ck_hexval((char)p[i]);
        if (d < 0) return 0;
        *v = *v * 16 + (uint32_t)d;
    }
    return 1;
}

static size_t ddp__ck_put_utf8(unsigned char *o, uint32_t cp) {
    if (cp < 0x80) return o[0] = (unsigned char)cp, 1;
    if (cp < 0x800) return o[0] = (unsigned char)(0xC0 | (cp >> 6)), o[1] = (unsigned char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A \uXXXX escape (p after the 'u'), a surrogate pair included. Returns the code point, 0 on error. */
static uint32_t ddp__ck_unicode_escape(ddp__ck_json *j) {
    uint32_t hi, lo;
    if (!ddp__ck_hex4(j->p, j->end, &hi)) return 0;
    j->p += 4;
    if (hi >= 0xDC00 && hi <= 0xDFFF) return 0;
    if (hi < 0xD800 || hi > 0xDBFF) return hi;
    if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || !ddp__ck_hex4(j->p + 2, j->end, &lo) || lo < 0xDC00 ||
        lo > 0xDFFF)
        return 0;
    j->p += 6;
    return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
}

/* A string token; *out is a new NUL-terminated UTF-8 copy (escapes only shrink, so the raw length
   bounds the decoded one). */
static ddp_result ddp__ck_string(ddp__ck_json *j, char **out) {
    const unsigned char *q;
    unsigned char *o, *buf;
    ddp_result r = ddp__ck_expect(j, '"', "expected a string");
    *out = NULL;
    if (r != DDP_SUCCESS) return r;
    for (q = j->p; q < j->end && *q != '"'; q++)
        if (*q == '\\' && q + 1 < j->end) q++;
    if (q >= j->end) return ddp__ck_bad(j, "unterminated string");
    buf = o = (unsigned char *)ddp__malloc((size_t)(q - j->p) + 1);
    if (!buf) return ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
    while (*j->p != '"') {
        unsigned char c = *j->p;
        if (c < 0x20) goto bad_control;
        if (c >= 0x80) {
            int k = ddp__ck_utf8_seq(j->p, j->end);
            if (!k) goto bad_utf8;
            memcpy(o, j->p, (size_t)k);
            o += k;
            j->p += k;
            continue;
        }
        j->p++;
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        c = *j->p++;
        switch (c) {
        case '"': case '\\': case '/': *o++ = c; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            uint32_t cp = ddp__ck_unicode_escape(j);
            if (!cp) goto bad_escape;
            o += ddp__ck_put_utf8(o, cp);
            break;
        }
        default: j->p--; goto bad_escape;
        }
    }
    j->p++;
    *o = '\0';
    *out = (char *)buf;
    return DDP_SUCCESS;
bad_control:
    ddp__free(buf);
    return ddp__ck_bad(j, "control character inside a string (must be escaped)");
bad_utf8:
    ddp__free(buf);
    return ddp__ck_bad(j, "string is not valid UTF-8");
bad_escape:
    ddp__free(buf);
    return ddp__ck_bad(j, "bad escape in a string (\\u0000 and lone surrogates are refused)");
}

static ddp_result ddp__ck_uint(ddp__ck_json *j, uint64_t *v) {
    uint64_t x = 0;
    const unsigned char *s;
    ddp__ck_ws(j);
    s = j->p;
    if (j->p < j->end && *j->p == '-') return ddp__ck_bad(j, "negative number (shapes and offsets are >= 0)");
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        unsigned d = (unsigned)(*j->p - '0');
        if (x > (DDP__CK_MAX_INT - d) / 10) return ddp__ck_bad(j, "integer larger than 2^63-1");
        x = x * 10 + d;
        j->p++;
    }
    if (j->p == s) return ddp__ck_bad(j, "expected a non-negative integer");
    if (*s == '0' && j->p - s > 1) return ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: integer with a leading zero", (size_t)(s - j->start));
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E')) return ddp__ck_bad(j, "number is not an integer");
    *v = x;
    return DDP_SUCCESS;
}

/* '[' uint, ... ']': the first keep values go to vals; *count is the number of elements. */
static ddp_result ddp__ck_uint_array(ddp__ck_json *j, uint64_t *vals, int keep, int *count) {
    ddp_result r;
    int more;
    *count = 0;
    if ((r = ddp__ck_expect(j, '[', "expected '['")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == ']') return j->p++, DDP_SUCCESS;
    do {
        uint64_t v = 0;
        if ((r = ddp__ck_uint(j, &v)) != DDP_SUCCESS) return r;
        if (*count < keep) vals[*count] = v;
        if (*count == INT_MAX) return ddp__ck_bad(j, "array too long");
        (*count)++;
        more = ddp__ck_next(j, ']', "expected ',' or ']' in an array");
    } while (more == 1);
    return more < 0 ? DDP_ERR_FORMAT : DDP_SUCCESS;
}

static ddp_result ddp__ck_dtype(ddp__ck_json *j, ddp__ck_entry *e) {
    char *s;
    int i;
    ddp_result r = ddp__ck_string(j, &s);
    if (r != DDP_SUCCESS) return r;
    for (i = 0; i < DDP__CK_NDTYPES; i++)
        if (strcmp(s, ddp__ck_dtypes[i].name) == 0) break;
    if (i == DDP__CK_NDTYPES) {
        r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: tensor \"%.64s\" has unknown dtype \"%.32s\"",
                         (size_t)(j->p - j->start), e->name, s);
        ddp__free(s);
        return r;
    }
    ddp__free(s);
    e->st = i;
    return DDP_SUCCESS;
}

/* Element count times element size, refusing overflow; a zero dimension makes 0 whatever the others. */
static int ddp__ck_shape_bytes(const uint64_t *dims, int ndim, uint64_t elem, uint64_t *bytes) {
    uint64_t n = 1;
    int i, overflow = 0;
    for (i = 0; i < ndim; i++) {
        if (dims[i] == 0) return *bytes = 0, 1;
        if (!overflow && n > DDP__CK_MAX_INT / dims[i]) overflow = 1;
        if (!overflow) n *= dims[i];
    }
    if (overflow || n > DDP__CK_MAX_INT / elem) return 0;
    *bytes = n * elem;
    return 1;
}

static ddp_result ddp__ck_tensor(ddp__ck_json *j, ddp__ck_entry *e) {
    uint64_t dims[8], offs[2], bytes;
    int seen_dtype = 0, seen_shape = 0, seen_offsets = 0, more, count, i;
    ddp_result r;
    uint64_t *all_dims = NULL;
    if ((r = ddp__ck_expect(j, '{', "a tensor entry must be an object")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == '}') return ddp__ck_bad(j, "tensor entry without dtype, shape and data_offsets");
    do {
        char *key;
        if ((r = ddp__ck_string(j, &key)) != DDP_SUCCESS) break; /* break, not return: all_dims may be held */
        if ((r = ddp__ck_expect(j, ':', "expected ':'")) != DDP_SUCCESS) {
            ddp__free(key);
            break;
        }
        if (strcmp(key, "dtype") == 0 && !seen_dtype++) {
            r = ddp__ck_dtype(j, e);
        } else if (strcmp(key, "shape") == 0 && !seen_shape++) {
            const unsigned char *at = j->p;
            r = ddp__ck_uint_array(j, dims, 8, &count);
            if (r == DDP_SUCCESS && count > 8) {
                /* more than 8 dimensions: parse again keeping them all, for the byte count */
                all_dims = (uint64_t *)ddp__calloc((size_t)count, sizeof *all_dims);
                j->p = at;
                r = all_dims ? ddp__ck_uint_array(j, all_dims, count, &count)
                             : ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing a shape");
            }
            e->ndim = count;
        } else if (strcmp(key, "data_offsets") == 0 && !seen_offsets++) {
            r = ddp__ck_uint_array(j, offs, 2, &count);
            if (r == DDP_SUCCESS && count != 2) r = ddp__ck_bad(j, "data_offsets must be [begin, end]");
        } else {
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: tensor \"%.64s\" has %s key \"%.32s\"",
                             (size_t)(j->p - j->start), e->name,
                             (!strcmp(key, "dtype") || !strcmp(key, "shape") || !strcmp(key, "data_offsets")) ? "a repeated" : "an unknown",
                             key);
        }
        ddp__free(key);
        if (r != DDP_SUCCESS) break;
        more = ddp__ck_next(j, '}', "expected ',' or '}' in a tensor entry");
        if (more < 0) r = DDP_ERR_FORMAT;
    } while (r == DDP_SUCCESS && more == 1);
    if (r == DDP_SUCCESS && !(seen_dtype && seen_shape && seen_offsets))
        r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" lacks %s", e->name,
                         !seen_dtype ? "dtype" : !seen_shape ? "shape" : "data_offsets");
    if (r == DDP_SUCCESS) {
        for (i = 0; i < e->ndim && i < 8; i++) e->shape[i] = (int64_t)dims[i];
        e->begin = offs[0];
        e->end = offs[1];
        if (!ddp__ck_shape_bytes(all_dims ? all_dims : dims, e->ndim, ddp__ck_dtypes[e->st].size, &bytes))
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" has a shape too large to address", e->name);
        else if (e->begin > e->end)
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" has data_offsets [%llu, %llu] with begin > end",
                             e->name, (unsigned long long)e->begin, (unsigned long long)e->end);
        else if (e->end - e->begin != bytes)
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT,
                             "safetensors header: tensor \"%.64s\" (%s, %d dims) needs %llu bytes but data_offsets [%llu, %llu] span %llu",
                             e->name, ddp__ck_dtypes[e->st].name, e->ndim, (unsigned long long)bytes,
                             (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    }
    ddp__free(all_dims);
    return r;
}

static ddp_result ddp__ck_metadata(ddp__ck_json *j, ddp__ck_header *h) {
    ddp_result r;
    int more;
    if ((r = ddp__ck_expect(j, '{', "__metadata__ must be an object of strings")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == '}') return j->p++, DDP_SUCCESS;
    do {
        char *key, *value = NULL;
        if ((r = ddp__ck_string(j, &key)) != DDP_SUCCESS) return r;
        if ((r = ddp__ck_expect(j, ':', "expected ':'")) == DDP_SUCCESS) {
            ddp__ck_ws(j);
            if (j->p < j->end && *j->p != '"')
                r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: __metadata__ value of \"%.64s\" is not a string",
                                 (size_t)(j->p - j->start), key);
            else
                r = ddp__ck_string(j, &value);
        }
        if (r == DDP_SUCCESS && !*key) r = ddp__ck_bad(j, "empty __metadata__ key");
        if (r == DDP_SUCCESS && ddp__ck_meta_append(&h->meta, key, value) != DDP_SUCCESS)
            r = ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
        if (r != DDP_SUCCESS) {
            ddp__free(key);
            ddp__free(value);
            return r;
        }
        more = ddp__ck_next(j, '}', "expected ',' or '}' in __metadata__");
    } while (more == 1);
    return more < 0 ? DDP_ERR_FORMAT : DDP_SUCCESS;
}

static int ddp__ck_cmp_offsets(const void *a, const void *b) {
    const ddp__ck_entry *x = (const ddp__ck_entry *)a, *y = (const ddp__ck_entry *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int ddp__ck_cmp_names(const void *a, const void *b) {
    return strcmp((*(ddp__ck_entry *const *)a)->name, (*(ddp__ck_entry *const *)b)->name);
}

static int ddp__ck_cmp_keys(const void *a, const void *b) {
    return strcmp((*(ddp_meta_entry *const *)a)->key, (*(ddp_meta_entry *const *)b)->key);
}

/* Sort, then check what needs the whole header: unique names and keys, data laid out back to back
   from offset 0 to the end of the file. */
static ddp_result ddp__ck_layout(ddp__ck_header *h, uint64_t data_len, char *err) {
    uint64_t at = 0;
    int i;
    h->by_name = (ddp__ck_entry **)ddp__calloc((size_t)h->n, sizeof *h->by_name);
    h->meta_sorted = (ddp_meta_entry **)ddp__calloc((size_t)h->meta.count, sizeof *h->meta_sorted);
    if (!h->by_name || !h->meta_sorted) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory indexing the safetensors header");
    if (h->n) qsort(h->e, (size_t)h->n, sizeof *h->e, ddp__ck_cmp_offsets);
    for (i = 0; i < h->n; i++) h->by_name[i] = &h->e[i];
    for (i = 0; i < h->meta.count; i++) h->meta_sorted[i] = &h->meta.entries[i];
    if (h->n) qsort(h->by_name, (size_t)h->n, sizeof *h->by_name, ddp__ck_cmp_names);
    if (h->meta.count) qsort(h->meta_sorted, (size_t)h->meta.count, sizeof *h->meta_sorted, ddp__ck_cmp_keys);
    for (i = 1; i < h->n; i++)
        if (strcmp(h->by_name[i - 1]->name, h->by_name[i]->name) == 0)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" appears twice", h->by_name[i]->name);
    for (i = 1; i < h->meta.count; i++)
        if (strcmp(h->meta_sorted[i - 1]->key, h->meta_sorted[i]->key) == 0)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: __metadata__ key \"%.64s\" appears twice", h->meta_sorted[i]->key);
    for (i = 0; i < h->n; i++) {
        const ddp__ck_entry *e = &h->e[i];
        if (e->begin != at)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" starts at data byte %llu, but the previous data ends at %llu (%s)",
                                e->name, (unsigned long long)e->begin, (unsigned long long)at, e->begin > at ? "a gap" : "an overlap");
        at = e->end;
    }
    if (at != data_len)
        return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors file: the tensors cover %llu data bytes but the file holds %llu after the header (%s)",
                            (unsigned long long)at, (unsigned long long)data_len, at > data_len ? "truncated" : "trailing bytes");
    return DDP_SUCCESS;
}

/* Parse len bytes of header JSON for a file with data_len bytes after the header. On error h is freed
   and err (DDP__ERR_MAX bytes) says what is wrong. */
static ddp_result ddp__ck_parse(const char *json, size_t len, uint64_t data_len, ddp__ck_header *h, char *err) {
    ddp__ck_json j;
    ddp_result r;
    int more, seen_meta = 0;
    memset(h, 0, sizeof *h);
    j.start = j.p = (const unsigned char *)json;
    j.end = j.p + len;
    j.err = err;
    if (len == 0 || *j.p != '{') return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header does not start with '{' (not a safetensors file?)");
    j.p++;
    ddp__ck_ws(&j);
    if (j.p < j.end && *j.p == '}') {
        j.p++;
        more = 0;
    } else {
        do {
            char *name;
            if ((r = ddp__ck_string(&j, &name)) != DDP_SUCCESS) goto fail;
            if ((r = ddp__ck_expect(&j, ':', "expected ':'")) != DDP_SUCCESS) {
                ddp__free(name);
                goto fail;
            }
            if (strcmp(name, "__metadata__") == 0) {
                ddp__free(name);
                r = seen_meta++ ? ddp__ck_bad(&j, "__metadata__ appears twice") : ddp__ck_metadata(&j, h);
                if (r != DDP_SUCCESS) goto fail;
            } else {
                ddp__ck_entry *e;
                if (h->n == h->cap) {
                    int cap = h->cap ? 2 * h->cap : 16;
                    ddp__ck_entry *ne = cap > INT_MAX / 2 ? NULL : (ddp__ck_entry *)DDP_REALLOC(h->e, (size_t)cap * sizeof *ne);
                    if (!ne) {
                        ddp__free(name);
                        r = ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
                        goto fail;
                    }
                    h->e = ne;
                    h->cap = cap;
                }
                e = &h->e[h->n++];
                memset(e, 0, sizeof *e);
                e->name = name;
                if ((r = ddp__ck_tensor(&j, e)) != DDP_SUCCESS) goto fail;
            }
            more = ddp__ck_next(&j, '}', "expected ',' or '}' after a header member");
            if (more < 0) {
                r = DDP_ERR_FORMAT;
                goto fail;
            }
        } while (more == 1);
    }
    ddp__ck_ws(&j);
    if (j.p != j.end) {
        r = ddp__ck_bad(&j, "bytes after the header object");
        goto fail;
    }
    if ((r = ddp__ck_layout(h, data_len, err)) != DDP_SUCCESS) goto fail;
    return DDP_SUCCESS;
fail:
    ddp__ck_header_free(h);
    return r;
}

/* The 8-byte little-endian header length of a file of file_size bytes. */
static ddp_result ddp__ck_prefix(const unsigned char *b, uint64_t file_size, uint64_t *hlen, char *err) {
    uint64_t n = 0;
    int i;
    if (file_size < 8) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors file of %llu bytes is shorter than its 8-byte header length (truncated?)", (unsigned long long)file_size);
    for (i = 7; i >= 0; i--) n = (n << 8) | b[i];
    if (n > DDP__CK_MAX_HEADER) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header length %llu exceeds the limit of %llu bytes (corrupt or not a safetensors file)",
                                                    (unsigned long long)n, DDP__CK_MAX_HEADER);
    if (n > file_size - 8) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header length %llu runs past the end of the %llu-byte file (truncated?)",
                                               (unsigned long long)n, (unsigned long long)file_size);
    *hlen = n;
    return DDP_SUCCESS;
}

static ddp__ck_entry *ddp__ck_lookup(const ddp__ck_header *h, const char *name) {
    int lo = 0, hi = h->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(name, h->by_name[mid]->name);
        if (c == 0) return h->by_name[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

static const char *ddp__ck_header_meta(const ddp__ck_header *h, const char *key) {
    int lo = 0, hi = h->meta.count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(key, h->meta_sorted[mid]->key);
        if (c == 0) return h->meta_sorted[mid]->value;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

/* The stored checksum of tensor name: 1 found (in *crc), 0 absent, -1 malformed. */
static int ddp__ck_stored_crc(const ddp__ck_header *h, const char *name, uint32_t *crc) {
    size_t plen = strlen(DDP__CK_CRC_PREFIX), nlen = strlen(name);
    char small[256], *key = nlen + plen < sizeof small ? small : (char *)ddp__malloc(plen + nlen + 1);
    const char *v;
    int i, found = -1;
    if (!key) return -1;
    memcpy(key, DDP__CK_CRC_PREFIX, plen);
    memcpy(key + plen, name, nlen + 1);
    v = ddp__ck_header_meta(h, key);
    if (key != small) ddp__free(key);
    if (!v) return 0;
    *crc = 0;
    for (i = 0; v[i]; i++) {
        int d = ddp__ck_hexval(v[i]);
        if (d < 0 || i >= 8) return -1;
        *crc = *crc * 16 + (uint32_t)d;
    }
    if (i == 8) found = 1;
    return found;
}

/* For the fuzz target and the tests: check a whole file image in memory (prefix, header, layout, and
   every checksum that is present). */
static DDP__UNUSED ddp_result ddp__ck_check_image(const unsigned char *buf, size_t size, char *err) {
    ddp__ck_header h;
    uint64_t hlen;
    ddp_result r = ddp__ck_prefix(buf, size, &hlen, err);
    int i;
    if (r != DDP_SUCCESS) return r;
    r = ddp__ck_parse((const char *)buf + 8, (size_t)hlen, size - 8 - hlen, &h, err);
    if (r != DDP_SUCCESS) return r;
    for (i = 0; i < h.n && r == DDP_SUCCESS; i++) {
        uint32_t want = 0;
        int s = ddp__ck_stored_crc(&h, h.e[i].name, &want);
        const unsigned char *d = buf + 8 + hlen + h.e[i].begin;
        if (s < 0) r = ddp__fail_to(err, DDP_ERR_FORMAT, "checksum of tensor \"%.64s\" is not 8 hex digits", h.e[i].name);
        else if (s > 0 && ddp__ck_crc32c(d, (size_t)(h.e[i].end - h.e[i].begin), 1) != want)
            r = ddp__fail_to(err, DDP_ERR_FORMAT, "tensor \"%.64s\": checksum mismatch", h.e[i].name);
    }
    ddp__ck_header_free(&h);
    return r;
}

/* ---- writer ---- */

static char *ddp__ck_cat(const char *a, const char *b);

typedef struct ddp__ck_buf {
    char *p;
    size_t len, cap;
    int oom;
} ddp__ck_buf;

static void ddp__ck_put(ddp__ck_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        char *p;
        while (cap < b->len + n + 1) cap *= 2;
        p = (char *)DDP_REALLOC(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void ddp__ck_puts(ddp__ck_buf *b, const char *s) { ddp__ck_put(b, s, strlen(s)); }

/* A JSON string; s is valid UTF-8 (checked by the caller), so only quotes, backslashes and control
   characters need escapes. */
static void ddp__ck_put_json(ddp__ck_buf *b, const char *s) {
    const char *run = s;
    ddp__ck_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        ddp__ck_put(b, run, (size_t)(s - run));
        if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
        else snprintf(esc, sizeof esc, "\\u%04x", c);
        ddp__ck_puts(b, esc);
        run = s + 1;
    }
    ddp__ck_put(b, run, (size_t)(s - run));
    ddp__ck_put(b, "\"", 1);
}

static void ddp__ck_put_kv(ddp__ck_buf *b, int *first, const char *key, const char *value) {
    if (!*first) ddp__ck_put(b, ",", 1);
    *first = 0;
    ddp__ck_put_json(b, key);
    ddp__ck_put(b, ":", 1);
    ddp__ck_put_json(b, value);
}

/* Bytes of tensor t, refusing overflow. */
static int ddp__ck_tensor_bytes(const ddp_tensor *t, uint64_t *bytes) {
    uint64_t dims[8];
    int i;
    if (t->ndim < 0 || t->ndim > 8 || !ddp__dtype_valid(t->dtype)) return 0;
    for (i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) return 0;
        dims[i] = (uint64_t)t->shape[i];
    }
    return ddp__ck_shape_bytes(dims, t->ndim, ddp_dtype_size(t->dtype), bytes) && *bytes <= (uint64_t)SIZE_MAX;
}

static int ddp__ck_cmp_tensor_names(const void *a, const void *b) {
    return strcmp((*(const ddp_tensor *const *)a)->name, (*(const ddp_tensor *const *)b)->name);
}

/* What save and load both require of the caller's tensors. */
static ddp_result ddp__ck_check_tensors(ddp_group *g, const char *op, const ddp_tensor *t, int n) {
    const ddp_tensor **sorted;
    int i;
    if (n < 0 || (n > 0 && !t)) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: n = %d with t = %p", op, n, (const void *)t);
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        if (!t[i].name || !*t[i].name || !ddp__ck_utf8_valid(t[i].name) || strcmp(t[i].name, "__metadata__") == 0)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tensor %d has a NULL, empty, non-UTF-8 or reserved (\"__metadata__\") name", op, i);
        if (!ddp__dtype_valid(t[i].dtype))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tensor \"%.64s\" has invalid dtype %d", op, t[i].name, (int)t[i].dtype);
        if (!ddp__ck_tensor_bytes(&t[i], &bytes))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tensor \"%.64s\" has ndim %d (0..8 allowed), a negative dimension or a size too large",
                             op, t[i].name, t[i].ndim);
        if (bytes && !t[i].data) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tensor \"%.64s\" has %llu bytes but data is NULL", op, t[i].name, (unsigned long long)bytes);
    }
    sorted = (const ddp_tensor **)ddp__calloc((size_t)n, sizeof *sorted);
    if (!sorted) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", op);
    for (i = 0; i < n; i++) sorted[i] = &t[i];
    if (n) qsort((void *)sorted, (size_t)n, sizeof *sorted, ddp__ck_cmp_tensor_names);
    for (i = 1; i < n; i++)
        if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0) {
            ddp_result r = ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tensor name \"%.64s\" is used twice", op, sorted[i]->name);
            ddp__free((void *)sorted);
            return r;
        }
    ddp__free((void *)sorted);
    return DDP_SUCCESS;
}

static int ddp__ck_reserved(const char *key) {
    return strncmp(key, DDP__CK_CRC_PREFIX, strlen(DDP__CK_CRC_PREFIX)) == 0 ||
           strncmp(key, DDP__CK_SHARD_PREFIX, strlen(DDP__CK_SHARD_PREFIX)) == 0;
}

/* The JSON header: user metadata, the library's keys (extra), a checksum per tensor, then the tensor
   entries in t[] order with their data back to back; padded with spaces to a multiple of 8. */
static ddp_result ddp__ck_build_header(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *user,
                                       const ddp_meta *extra, ddp__ck_buf *b) {
    uint64_t at = 0;
    int i, first = 1;
    char num[64];
    for (i = 0; user && i < user->count; i++)
        if (ddp__ck_reserved(user->entries[i].key))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save of %s: metadata key \"%.64s\" is reserved (ddp.crc32c.* and ddp.shard.* are the library's)",
                             path, user->entries[i].key);
    ddp__ck_puts(b, "{\"__metadata__\":{");
    for (i = 0; user && i < user->count; i++) ddp__ck_put_kv(b, &first, user->entries[i].key, user->entries[i].value);
    for (i = 0; extra && i < extra->count; i++) ddp__ck_put_kv(b, &first, extra->entries[i].key, extra->entries[i].value);
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        char *key = ddp__ck_cat(DDP__CK_CRC_PREFIX, t[i].name);
        if (!key) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
        ddp__ck_tensor_bytes(&t[i], &bytes);
        snprintf(num, sizeof num, "%08x", (unsigned)ddp__ck_crc32c(t[i].data, (size_t)bytes, 1));
        ddp__ck_put_kv(b, &first, key, num);
        ddp__free(key);
    }
    ddp__ck_puts(b, "}");
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        int d;
        ddp__ck_tensor_bytes(&t[i], &bytes);
        ddp__ck_put(b, ",", 1);
        ddp__ck_put_json(b, t[i].name);
        ddp__ck_puts(b, ":{\"dtype\":\"");
        ddp__ck_puts(b, ddp__ck_st_name(t[i].dtype));
        ddp__ck_puts(b, "\",\"shape\":[");
        for (d = 0; d < t[i].ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)t[i].shape[d]);
            ddp__ck_puts(b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at, (unsigned long long)(at + bytes));
        ddp__ck_puts(b, num);
        at += bytes;
    }
    ddp__ck_puts(b, "}");
    while (!b->oom && (8 + b->len) % 8) ddp__ck_put(b, " ", 1);
    if (b->oom) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
    return DDP_SUCCESS;
}

static ddp_result ddp__ck_check_meta(ddp_group *g, const char *path, const ddp_meta *m) {
    int i;
    for (i = 0; m && i < m->count; i++)
        if (!m->entries[i].key || !*m->entries[i].key || !m->entries[i].value || !ddp__ck_utf8_valid(m->entries[i].key) ||
            !ddp__ck_utf8_valid(m->entries[i].value))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save of %s: metadata entry %d is NULL, empty or not UTF-8", path, i);
    return DDP_SUCCESS;
}

static ddp_result ddp__ck_write_all(ddp_group *g, int fd, const void *data, uint64_t n, const char *path) {
    const char *p = (const char *)data;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : (size_t)n;
        ssize_t w = write(fd, p, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint: writing %s failed: %s", path, w < 0 ? strerror(errno) : "no progress");
        p += w;
        n -= (uint64_t)w;
    }
    return DDP_SUCCESS;
}

/* Read n bytes at off into data. crc (may be NULL) is a running CRC32C register updated piece by piece,
   each piece while it is still in the cache (one pass over memory instead of two). */
static ddp_result ddp__ck_read_at(ddp_group *g, int fd, void *data, uint64_t n, uint64_t off, const char *path, uint32_t *crc) {
    char *p = (char *)data;
    while (n > 0) {
        size_t chunk = n > ((size_t)256 << 10) ? ((size_t)256 << 10) : (size_t)n;
        ssize_t r = pread(fd, p, chunk, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint: reading %s failed: %s", path, strerror(errno));
        if (r == 0) return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: file ended early (truncated while being read?)", path);
        if (crc) *crc = ddp__ck_crc_update(*crc, p, (size_t)r, 1);
        p += r;
        n -= (uint64_t)r;
        off += (uint64_t)r;
    }
    return DDP_SUCCESS;
}

/* Concatenate a and b into a new string. */
static char *ddp__ck_cat(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = (char *)ddp__malloc(na + nb + 1);
    if (!s) return NULL;
    memcpy(s, a, na);
    memcpy(s + na, b, nb + 1);
    return s;
}

/* The directory part of path ("." when there is none), as a new string. */
static char *ddp__ck_dirname(const char *path) {
    const char *slash = strrchr(path, '/');
    char *d;
    size_t n;
    if (!slash) return ddp__strdup(".");
    n = slash == path ? 1 : (size_t)(slash - path);
    d = (char *)ddp__malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, path, n);
    d[n] = '\0';
    return d;
}

/* fsync the directory holding path, so that a rename or unlink in it is durable. */
static ddp_result ddp__ck_sync_dir(ddp_group *g, const char *path) {
    char *dir = ddp__ck_dirname(path);
    int fd;
    ddp_result r = DDP_SUCCESS;
    if (!dir) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint: cannot sync directory %s: %s", dir, strerror(errno));
    if (fd >= 0) close(fd);
    ddp__free(dir);
    return r;
}

/* Write header + tensor data to "<path>.tmp", fsync, rename over path, fsync the directory. On any
   failure the temporary file is removed and path is untouched. */
static ddp_result ddp__ck_atomic_write(ddp_group *g, const char *path, const ddp__ck_buf *hdr, const ddp_tensor *t, int n) {
    unsigned char prefix[8];
    uint64_t hlen = hdr->len;
    char *tmp = ddp__ck_cat(path, ".tmp");
    int fd, i;
    ddp_result r;
    if (!tmp) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: cannot create %s: %s (does the directory exist and is it writable?)", tmp, strerror(errno));
        ddp__free(tmp);
        return r;
    }
    for (i = 0; i < 8; i++) prefix[i] = (unsigned char)(hlen >> (8 * i));
    r = ddp__ck_write_all(g, fd, prefix, 8, tmp);
    if (r == DDP_SUCCESS) r = ddp__ck_write_all(g, fd, hdr->p, hlen, tmp);
    for (i = 0; i < n && r == DDP_SUCCESS; i++) {
        uint64_t bytes;
        ddp__ck_tensor_bytes(&t[i], &bytes);
        r = ddp__ck_write_all(g, fd, t[i].data, bytes, tmp);
    }
    if (r == DDP_SUCCESS && fsync(fd) != 0) r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: fsync of %s failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && r == DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: closing %s failed: %s", tmp, strerror(errno));
    if (r == DDP_SUCCESS && rename(tmp, path) != 0)
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: renaming %s to %s failed: %s", tmp, path, strerror(errno));
    if (r != DDP_SUCCESS) unlink(tmp);
    else r = ddp__ck_sync_dir(g, path);
    ddp__free(tmp);
    return r;
}

/* One process writes one file: checks, header, atomic write. */
static ddp_result ddp__ck_write_file(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                     const ddp_meta *extra) {
    ddp__ck_buf hdr;
    ddp_result r;
    memset(&hdr, 0, sizeof hdr);
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: path is NULL or empty");
    if ((r = ddp__ck_check_tensors(g, "checkpoint save", t, n)) != DDP_SUCCESS) return r;
    if ((r = ddp__ck_check_meta(g, path, meta)) != DDP_SUCCESS) return r;
    r = ddp__ck_build_header(g, path, t, n, meta, extra, &hdr);
    if (r == DDP_SUCCESS) r = ddp__ck_atomic_write(g, path, &hdr, t, n);
    ddp__free(hdr.p);
    return r;
}

/* ---- collectives ----
   Every collective entry point ends with ddp__ck_agree: the ranks exchange their outcome, so an error
   anywhere (rank 0 could not write, rank 3 could not read) is an error everywhere, carrying the
   failing rank's message; nobody is left waiting in a later collective. */

static ddp_result ddp__ck_agree(ddp_group *g, ddp_result mine, const char *what) {
    int32_t code = (int32_t)mine, *codes;
    char *msgs, own[DDP__ERR_MAX];
    int w, i, bad = -1;
    ddp_result r;
    if (!g || g->world_size <= 1) return mine;
    w = g->world_size;
    memset(own, 0, sizeof own);
    if (mine != DDP_SUCCESS) snprintf(own, sizeof own, "%s", ddp_last_error(g));
    codes = (int32_t *)ddp__calloc((size_t)w, sizeof *codes);
    if (!codes) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory agreeing on the outcome", what);
    r = ddp_all_gather(g, &code, codes, 1, DDP_I32);
    for (i = 0; r == DDP_SUCCESS && i < w && bad < 0; i++)
        if (codes[i] != 0) bad = i;
    if (r != DDP_SUCCESS || bad < 0) {
        ddp__free(codes);
        /* this rank's own failure says more than a collective that broke after it */
        return (r != DDP_SUCCESS && mine != DDP_SUCCESS) ? ddp__fail(g, mine, "%s", own) : r;
    }
    msgs = (char *)ddp__calloc((size_t)w, DDP__ERR_MAX);
    r = msgs ? ddp_all_gather(g, own, msgs, DDP__ERR_MAX, DDP_U8) : DDP_ERR_OUT_OF_MEMORY;
    if (mine != DDP_SUCCESS) r = ddp__fail(g, mine, "%s", own);
    else if (r == DDP_SUCCESS) {
        msgs[(size_t)bad * DDP__ERR_MAX + DDP__ERR_MAX - 1] = '\0';
        r = ddp__fail(g, (ddp_result)codes[bad], "%s failed on rank %d: %s", what, bad, msgs + (size_t)bad * DDP__ERR_MAX);
    } else if (!msgs) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s failed on rank %d (out of memory fetching its message)", what, bad);
    ddp__free(msgs);
    ddp__free(codes);
    return r;
}

/* Broadcast bytes from rank 0 in DDP__CK_CHUNK pieces (the same split on every rank). dst NULL: receive
   and discard, through scratch (DDP__CK_CHUNK bytes). */
static ddp_result ddp__ck_bcast(ddp_group *g, void *dst, uint64_t bytes, void *scratch) {
    uint64_t off = 0;
    while (off < bytes) {
        size_t n = (size_t)DDP__MIN((uint64_t)DDP__CK_CHUNK, bytes - off);
        ddp_result r = ddp_broadcast(g, dst ? (char *)dst + off : scratch, n, DDP_U8, 0);
        if (r != DDP_SUCCESS) return r;
        off += n;
    }
    return DDP_SUCCESS;
}

static int ddp__ck_rank(const ddp_group *g) { return g ? g->rank : 0; }
static int ddp__ck_world(const ddp_group *g) { return g ? g->world_size : 1; }

/* ---- rotation ----
   A family is <dir>/<prefix><digits><suffix>; a member's number is its digits. keep_last keeps the K
   largest numbers; files with smaller numbers go, together with their ".tmp" leftovers (and, for
   shards, each rank's "<member>.rank<r>" files). */

typedef struct ddp__ck_family {
    char *dir, *prefix, *suffix;
} ddp__ck_family;

static void ddp__ck_family_free(ddp__ck_family *f) {
    ddp__free(f->dir);
    ddp__free(f->prefix);
    ddp__free(f->suffix);
    memset(f, 0, sizeof *f);
}

/* Split path's file name at [a, b) (offsets into the file name) into prefix and suffix. */
static int ddp__ck_family_split(ddp__ck_family *f, const char *path, size_t a, size_t b) {
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    f->dir = ddp__ck_dirname(path);
    f->prefix = (char *)ddp__malloc(a + 1);
    f->suffix = ddp__strdup(name + b);
    if (!f->dir || !f->prefix || !f->suffix) return ddp__ck_family_free(f), 0;
    memcpy(f->prefix, name, a);
    f->prefix[a] = '\0';
    return 1;
}

/* The family of a concrete path: its file name's last run of digits is the number. 0 when there is
   no digit in the file name, -1 out of memory. */
static int ddp__ck_family_of_path(ddp__ck_family *f, const char *path, int64_t *number) {
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    size_t end = strlen(name), a, b;
    memset(f, 0, sizeof *f);
    while (end > 0 && !(name[end - 1] >= '0' && name[end - 1] <= '9')) end--;
    if (end == 0) return 0;
    b = end;
    a = b;
    while (a > 0 && name[a - 1] >= '0' && name[a - 1] <= '9') a--;
    if (b - a > 18) return 0;
    *number = 0;
    for (end = a; end < b; end++) *number = *number * 10 + (name[end] - '0');
    return ddp__ck_family_split(f, path, a, b) ? 1 : -1;
}

/* Does name belong to the family, followed by exactly tail? Sets *number (at most 18 digits). */
static int ddp__ck_family_match(const ddp__ck_family *f, const char *name, const char *tail, int64_t *number) {
    size_t np = strlen(f->prefix), ns = strlen(f->suffix), nt = strlen(tail), len = strlen(name), k = 0;
    int64_t v = 0;
    if (strncmp(name, f->prefix, np) != 0) return 0;
    while (np + k < len && name[np + k] >= '0' && name[np + k] <= '9') {
        v = v * 10 + (name[np + k] - '0');
        if (++k > 18) return 0;
    }
    if (k == 0 || len != np + k + ns + nt) return 0;
    if (strncmp(name + np + k, f->suffix, ns) != 0 || strcmp(name + np + k + ns, tail) != 0) return 0;
    *number = v;
    return 1;
}

static char *ddp__ck_join(const char *dir, const char *name) {
    size_t nd = strlen(dir), nn = strlen(name);
    char *s = (char *)ddp__malloc(nd + nn + 2);
    if (!s) return NULL;
    memcpy(s, dir, nd);
    s[nd] = '/';
    memcpy(s + nd + 1, name, nn + 1);
    return s;
}

static int ddp__ck_cmp_i64_desc(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x > y ? -1 : x < y ? 1 : 0;
}

/* Delete the family's files whose number is below cutoff and whose name ends (after the suffix) in
   one of tails. Failures are logged, not returned: the new checkpoint is already safe. */
static void ddp__ck_delete_below(ddp_group *g, const ddp__ck_family *f, int64_t cutoff, const char *const *tails, int ntails) {
    DIR *d = opendir(f->dir);
    struct dirent *de;
    int deleted = 0;
    if (!d) {
        ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot list %s: %s", f->dir, strerror(errno));
        return;
    }
    while ((de = readdir(d)) != NULL) {
        int64_t num;
        int i;
        for (i = 0; i < ntails; i++) {
            char *full;
            if (!ddp__ck_family_match(f, de->d_name, tails[i], &num) || num >= cutoff) continue;
            full = ddp__ck_join(f->dir, de->d_name);
            if (full && unlink(full) == 0) deleted++;
            else ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot delete %s: %s", full ? full : de->d_name, strerror(errno));
            ddp__free(full);
            break;
        }
    }
    closedir(d);
    if (deleted) {
        char *any = ddp__ck_join(f->dir, "x");
        if (any) ddp__ck_sync_dir(g, any);
        ddp__free(any);
    }
}

/* The number below which family members are deleted so that keep members remain (those with
   exactly tail ""); INT64_MIN when nothing is to go. */
static int64_t ddp__ck_cutoff(ddp_group *g, const ddp__ck_family *f, int keep, int64_t current) {
    DIR *d = opendir(f->dir);
    struct dirent *de;
    int64_t *nums = NULL, cutoff = INT64_MIN;
    size_t n = 0, cap = 0;
    if (!d) {
        ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot list %s: %s", f->dir, strerror(errno));
        return INT64_MIN;
    }
    while ((de = readdir(d)) != NULL) {
        int64_t num;
        if (!ddp__ck_family_match(f, de->d_name, "", &num)) continue;
        if (n == cap) {
            int64_t *p = (int64_t *)DDP_REALLOC(nums, (cap ? 2 * cap : 64) * sizeof *nums);
            if (!p) break;
            nums = p;
            cap = cap ? 2 * cap : 64;
        }
        nums[n++] = num;
    }
    closedir(d);
    if (n > (size_t)keep) {
        qsort(nums, n, sizeof *nums, ddp__ck_cmp_i64_desc);
        cutoff = nums[keep - 1];
    }
    ddp__free(nums);
    return DDP__MIN(cutoff, current); /* never the checkpoint just written */
}

/* Check keep_last against path before anything is written. */
static ddp_result ddp__ck_check_rotation(ddp_group *g, const char *path, const ddp_checkpoint_save_desc *d, ddp__ck_family *f,
                                         int64_t *number) {
    int k;
    memset(f, 0, sizeof *f);
    if (!d || d->keep_last == 0) return DDP_SUCCESS;
    if (d->keep_last < 0) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: keep_last = %d must be >= 0", d->keep_last);
    k = ddp__ck_family_of_path(f, path, number);
    if (k < 0) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save: out of memory");
    if (k == 0)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: keep_last needs a number in the file name of %s (e.g. ckpt_000100.safetensors)", path);
    return DDP_SUCCESS;
}

/* ---- save ---- */

DDP_API ddp_result ddp_checkpoint_save_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                          const ddp_checkpoint_save_desc *desc) {
    ddp_result r = DDP_SUCCESS;
    if (ddp__ck_rank(g) == 0) {
        ddp__ck_family fam;
        int64_t number = 0;
        r = ddp__ck_check_rotation(g, path ? path : "", desc, &fam, &number);
        if (r == DDP_SUCCESS) r = ddp__ck_write_file(g, path, t, n, meta, NULL);
        if (r == DDP_SUCCESS && fam.dir) {
            static const char *const tails[] = {"", ".tmp"};
            int64_t cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
            if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
        }
        ddp__ck_family_free(&fam);
    }
    return ddp__ck_agree(g, r, "checkpoint save");
}

DDP_API ddp_result ddp_checkpoint_save(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta) {
    return ddp_checkpoint_save_ex(g, path, t, n, meta, NULL);
}

/* ---- load ---- */

/* Open path and parse its header. On success the caller owns *fd, *raw (the header bytes) and h. */
static ddp_result ddp__ck_open(ddp_group *g, const char *path, int *fd, char **raw, uint64_t *hlen, ddp__ck_header *h) {
    unsigned char prefix[8];
    char err[DDP__ERR_MAX];
    struct stat st;
    ddp_result r;
    *raw = NULL;
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint load: cannot open %s: %s", path, strerror(errno));
    if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint load: %s is not a regular file", path);
        goto fail;
    }
    r = ddp__ck_read_at(g, *fd, prefix, DDP__MIN((uint64_t)8, (uint64_t)st.st_size), 0, path, NULL);
    if (r == DDP_SUCCESS && (r = ddp__ck_prefix(prefix, (uint64_t)st.st_size, hlen, err)) != DDP_SUCCESS)
        ddp__fail(g, r, "checkpoint %s: %s", path, err);
    if (r != DDP_SUCCESS) goto fail;
    *raw = (char *)ddp__malloc((size_t)*hlen + 1);
    if (!*raw) {
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint %s: out of memory for a %llu-byte header", path, (unsigned long long)*hlen);
        goto fail;
    }
    if ((r = ddp__ck_read_at(g, *fd, *raw, *hlen, 8, path, NULL)) != DDP_SUCCESS) goto fail;
    if ((r = ddp__ck_parse(*raw, (size_t)*hlen, (uint64_t)st.st_size - 8 - *hlen, h, err)) != DDP_SUCCESS) {
        ddp__fail(g, r, "checkpoint %s: %s", path, err);
        goto fail;
    }
    return DDP_SUCCESS;
fail:
    ddp__free(*raw);
    *raw = NULL;
    close(*fd);
    *fd = -1;
    return r;
}

static void ddp__ck_describe(char *out, size_t cap, const char *dtype, int ndim, const int64_t *shape) {
    size_t len;
    int i;
    snprintf(out, cap, "%s [", dtype);
    for (i = 0; i < ndim && i < 8; i++) {
        len = strlen(out);
        snprintf(out + len, cap - len, i ? ", %lld" : "%lld", (long long)shape[i]);
    }
    len = strlen(out);
    snprintf(out + len, cap - len, ndim > 8 ? ", ...]" : "]");
}

/* Match the caller's tensors with the file's: matched[i] is t[i]'s entry. */
static ddp_result ddp__ck_match(ddp_group *g, const char *path, const ddp__ck_header *h, const ddp_tensor *t, int n,
                                const ddp_checkpoint_load_desc *d, ddp__ck_entry **matched) {
    int i, used = 0;
    for (i = 0; i < n; i++) {
        ddp__ck_entry *e = ddp__ck_lookup(h, t[i].name);
        uint32_t crc;
        int k, same;
        if (!e)
            return ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint %s has no tensor \"%.64s\" (it has %d tensors%s%.64s%s)", path, t[i].name, h->n,
                             h->n ? ", e.g. \"" : "", h->n ? h->e[0].name : "", h->n ? "\"" : "");
        same = ddp__ck_dtypes[e->st].dtype == t[i].dtype && e->ndim == t[i].ndim;
        for (k = 0; same && k < t[i].ndim; k++) same = e->shape[k] == t[i].shape[k];
        if (!same) {
            char want[160], have[160];
            ddp__ck_describe(want, sizeof want, ddp__ck_st_name(t[i].dtype), t[i].ndim, t[i].shape);
            ddp__ck_describe(have, sizeof have, ddp__ck_dtypes[e->st].name, e->ndim, e->shape);
            return ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint %s: tensor \"%.64s\" is %s in the file but %s in the caller's list", path, t[i].name, have, want);
        }
        k = ddp__ck_stored_crc(h, e->name, &crc);
        if (k < 0) return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: the checksum of tensor \"%.64s\" is not 8 hex digits", path, e->name);
        if (k == 0 && !(d && d->allow_missing_checksums))
            return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: tensor \"%.64s\" has no " DDP__CK_CRC_PREFIX " checksum (a file from another writer? "
                             "set allow_missing_checksums to load it)", path, e->name);
        matched[i] = e;
        used++;
    }
    if (used < h->n && !(d && d->allow_unexpected)) {
        char *seen = (char *)ddp__calloc((size_t)h->n, 1);
        int j;
        if (!seen) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint %s: out of memory", path);
        for (i = 0; i < n; i++) seen[matched[i] - h->e] = 1;
        for (j = 0; j < h->n && seen[j]; j++) {
        }
        ddp__free(seen);
        return ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint %s has %d tensors the caller did not list, e.g. \"%.64s\" (set allow_unexpected to skip them)",
                         path, h->n - used, h->e[j].name);
    }
    return DDP_SUCCESS;
}

/* Read t[i]'s data from the file and verify its checksum. */
static ddp_result ddp__ck_read_tensor(ddp_group *g, const char *path, int fd, uint64_t data_start, const ddp__ck_header *h,
                                      const ddp__ck_entry *e, void *dst) {
    uint64_t bytes = e->end - e->begin;
    uint32_t want, got = 0xFFFFFFFFu;
    ddp_result r = ddp__ck_read_at(g, fd, dst, bytes, data_start + e->begin, path, &got);
    if (r != DDP_SUCCESS) return r;
    got = ~got;
    if (ddp__ck_stored_crc(h, e->name, &want) <= 0) return DDP_SUCCESS;
    if (got != want)
        return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: tensor \"%.64s\" is corrupt: its data has CRC32C %08x but the header records %08x",
                         path, e->name, (unsigned)got, (unsigned)want);
    return DDP_SUCCESS;
}

/* Replace meta with the header's metadata, the library's keys left out. */
static ddp_result ddp__ck_copy_meta(ddp_group *g, const ddp__ck_header *h, ddp_meta *meta) {
    int i;
    if (!meta) return DDP_SUCCESS;
    ddp_meta_free(meta);
    for (i = 0; i < h->meta.count; i++) {
        char *k, *v;
        if (ddp__ck_reserved(h->meta.entries[i].key)) continue;
        k = ddp__strdup(h->meta.entries[i].key);
        v = ddp__strdup(h->meta.entries[i].value);
        if (!k || !v || ddp__ck_meta_append(meta, k, v) != DDP_SUCCESS) {
            ddp__free(k);
            ddp__free(v);
            return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory copying the metadata");
        }
    }
    return DDP_SUCCESS;
}

/* What a shard must say about itself (load_shard); NULL for plain files. */
typedef struct ddp__ck_shard_expect {
    int rank, world;
    const char *save_id;
} ddp__ck_shard_expect;

static ddp_result ddp__ck_check_shard(ddp_group *g, const char *path, const ddp__ck_header *h, const ddp__ck_shard_expect *x) {
    const char *id = ddp__ck_header_meta(h, DDP__CK_SHARD_ID), *rk = ddp__ck_header_meta(h, DDP__CK_SHARD_RANK),
               *ws = ddp__ck_header_meta(h, DDP__CK_SHARD_WORLD);
    char want_rank[16], want_world[16];
    snprintf(want_rank, sizeof want_rank, "%d", x->rank);
    snprintf(want_world, sizeof want_world, "%d", x->world);
    if (!id || !rk || !ws || strcmp(rk, want_rank) != 0 || strcmp(ws, want_world) != 0)
        return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint shard %s is not rank %d of %d's shard (it says rank %s of %s)", path, x->rank, x->world,
                         rk ? rk : "?", ws ? ws : "?");
    if (strcmp(id, x->save_id) != 0)
        return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint shard %s belongs to save %.32s, but the completion marker is for save %.32s "
                         "(a later save was cut short): this shard set is incomplete", path, id, x->save_id);
    return DDP_SUCCESS;
}

/* This rank reads path into t[] itself. With keep != NULL the parsed header, its raw bytes and the
   matches stay with the caller (the broadcast path sends them on). */
typedef struct ddp__ck_kept {
    ddp__ck_header h;
    char *raw;
    uint64_t hlen;
    ddp__ck_entry **matched;
} ddp__ck_kept;

static void ddp__ck_kept_free(ddp__ck_kept *k) {
    ddp__ck_header_free(&k->h);
    ddp__free(k->raw);
    ddp__free(k->matched);
    memset(k, 0, sizeof *k);
}

static ddp_result ddp__ck_load_local(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                     const ddp_checkpoint_load_desc *d, const ddp__ck_shard_expect *x, ddp__ck_kept *keep) {
    ddp__ck_kept k;
    int fd = -1, i;
    ddp_result r;
    memset(&k, 0, sizeof k);
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint load: path is NULL or empty");
    if ((r = ddp__ck_check_tensors(g, "checkpoint load", t, n)) != DDP_SUCCESS) return r;
    if ((r = ddp__ck_open(g, path, &fd, &k.raw, &k.hlen, &k.h)) != DDP_SUCCESS) return r;
    if (x) r = ddp__ck_check_shard(g, path, &k.h, x);
    k.matched = (ddp__ck_entry **)ddp__calloc((size_t)n, sizeof *k.matched);
    if (r == DDP_SUCCESS && !k.matched) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory");
    if (r == DDP_SUCCESS) r = ddp__ck_match(g, path, &k.h, t, n, d, k.matched);
    for (i = 0; i < n && r == DDP_SUCCESS; i++) r = ddp__ck_read_tensor(g, path, fd, 8 + k.hlen, &k.h, k.matched[i], t[i].data);
    if (r == DDP_SUCCESS) r = ddp__ck_copy_meta(g, &k.h, meta);
    close(fd);
    if (r == DDP_SUCCESS && keep) *keep = k;
    else ddp__ck_kept_free(&k);
    return r;
}

/* A non-root rank of the broadcast path: parse rank 0's header, match its own list, and find where
   each of rank 0's tensors (sel: entry index, bytes) goes in its memory (dest[j], NULL = discard). */
static ddp_result ddp__ck_bcast_plan(ddp_group *g, const char *path, ddp_tensor *t, int n, const ddp_checkpoint_load_desc *d,
                                     ddp__ck_kept *k, uint64_t data_len, const uint64_t *sel, uint64_t nsel, void **dest) {
    char err[DDP__ERR_MAX];
    int *pos, i;
    uint64_t j;
    ddp_result r = ddp__ck_parse(k->raw, (size_t)k->hlen, data_len, &k->h, err);
    if (r != DDP_SUCCESS) return ddp__fail(g, r, "checkpoint %s (header from rank 0): %s", path, err);
    if ((r = ddp__ck_check_tensors(g, "checkpoint load", t, n)) != DDP_SUCCESS) return r;
    k->matched = (ddp__ck_entry **)ddp__calloc((size_t)n, sizeof *k->matched);
    pos = (int *)ddp__malloc((size_t)k->h.n * sizeof *pos + 1);
    if (!k->matched || !pos) {
        ddp__free(pos);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory");
    }
    for (i = 0; i < k->h.n; i++) pos[i] = -1;
    for (j = 0; j < nsel; j++)
        if (sel[2 * j] < (uint64_t)k->h.n) pos[sel[2 * j]] = (int)j;
    r = ddp__ck_match(g, path, &k->h, t, n, d, k->matched);
    for (i = 0; i < n && r == DDP_SUCCESS; i++) {
        int at = pos[k->matched[i] - k->h.e];
        if (at < 0)
            r = ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint load of %s: this rank asks for tensor \"%.64s\", which rank 0 did not load "
                          "(with broadcast, every rank must list the same tensors)", path, t[i].name);
        else dest[at] = t[i].data;
    }
    ddp__free(pos);
    return r;
}

/* Rank 0 reads; the header, the list of what it loaded and the data are broadcast:
     1. rank 0 loads as usual (checksums verified); the others allocate their scratch; agree
     2. bcast {header length, tensors loaded, data length}; bcast the header bytes and, per loaded
        tensor, {entry index in data order, bytes} (every rank parses the same bytes, so indices agree)
     3. the others parse and match their own lists; then each tensor's data is broadcast in pieces of
        DDP__CK_CHUNK, straight into the destination tensor, and its checksum verified on arrival
     4. agree
   A rank whose own check failed still takes part in every broadcast (receiving into scratch), so a
   failure anywhere never leaves a rank waiting. */
static ddp_result ddp__ck_load_bcast(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                     const ddp_checkpoint_load_desc *d) {
    static const char *what = "checkpoint load (rank 0 reads and broadcasts)";
    ddp__ck_kept k;
    char *scratch = NULL;
    void **dest = NULL;
    uint64_t info[3] = {0, 0, 0}, *sel = NULL, j;
    int root = g->rank == 0;
    ddp_result r, mine = DDP_SUCCESS;
    memset(&k, 0, sizeof k);
    if (root) r = ddp__ck_load_local(g, path, t, n, meta, d, NULL, &k);
    else {
        scratch = (char *)ddp__malloc(DDP__CK_CHUNK);
        r = scratch ? DDP_SUCCESS : ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory for a broadcast buffer");
    }
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
    if (root) {
        info[0] = k.hlen;
        info[1] = (uint64_t)n;
        info[2] = k.h.n ? k.h.e[k.h.n - 1].end : 0;
    }
    if ((r = ddp_broadcast(g, info, 3, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    /* info[1] is rank 0's n, an int; an allocation failure here cannot be agreed on (the others are
       already in the next broadcast) and ends as their timeout */
    sel = (uint64_t *)ddp__calloc((size_t)(2 * info[1] + 1), sizeof *sel);
    dest = (void **)ddp__calloc((size_t)(info[1] + 1), sizeof *dest);
    if (!sel || !dest) {
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory");
        goto done;
    }
    if (!root) {
        k.hlen = info[0];
        k.raw = info[0] <= DDP__CK_MAX_HEADER ? (char *)ddp__malloc((size_t)info[0] + 1) : NULL;
        if (!k.raw) mine = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory for a %llu-byte header", (unsigned long long)info[0]);
    }
    if ((r = ddp__ck_bcast(g, k.raw, info[0], scratch)) != DDP_SUCCESS) goto done;
    for (j = 0; root && j < info[1]; j++) {
        sel[2 * j] = (uint64_t)(k.matched[j] - k.h.e);
        sel[2 * j + 1] = k.matched[j]->end - k.matched[j]->begin;
        dest[j] = t[j].data;
    }
    if ((r = ddp_broadcast(g, sel, (size_t)(2 * info[1]), DDP_I64, 0)) != DDP_SUCCESS) goto done;
    if (!root && mine == DDP_SUCCESS) mine = ddp__ck_bcast_plan(g, path, t, n, d, &k, info[2], sel, info[1], dest);
    for (j = 0; j < info[1]; j++) {
        void *to = (root || mine == DDP_SUCCESS) ? dest[j] : NULL;
        uint32_t want;
        if ((r = ddp__ck_bcast(g, to, sel[2 * j + 1], scratch)) != DDP_SUCCESS) goto done;
        if (root || !to || sel[2 * j] >= (uint64_t)k.h.n) continue;
        if (ddp__ck_stored_crc(&k.h, k.h.e[sel[2 * j]].name, &want) > 0 && ddp__ck_crc32c(to, (size_t)sel[2 * j + 1], 1) != want)
            mine = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint load of %s: tensor \"%.64s\" arrived from rank 0 with a wrong checksum", path,
                             k.h.e[sel[2 * j]].name);
    }
    if (!root && mine == DDP_SUCCESS) mine = ddp__ck_copy_meta(g, &k.h, meta);
    r = ddp__ck_agree(g, mine, what);
done:
    ddp__ck_kept_free(&k);
    ddp__free(sel);
    ddp__free((void *)dest);
    ddp__free(scratch);
    return r;
}

DDP_API ddp_result ddp_checkpoint_load_ex(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                          const ddp_checkpoint_load_desc *desc) {
    if (desc && desc->broadcast && g && g->world_size > 1) return ddp__ck_load_bcast(g, path, t, n, meta, desc);
    return ddp__ck_agree(g, ddp__ck_load_local(g, path, t, n, meta, desc, NULL, NULL), "checkpoint load");
}

DDP_API ddp_result ddp_checkpoint_load(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta) {
    return ddp_checkpoint_load_ex(g, path, t, n, meta, NULL);
}

/* ---- shards ---- */

static uint64_t ddp__ck_new_save_id(void) {
    struct timespec ts;
    uint64_t z;
    clock_gettime(CLOCK_REALTIME, &ts);
    z = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)&ts;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64 finaliser: spread the bits */
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* "<path>.rank<r>" */
static char *ddp__ck_shard_path(const char *path, int rank) {
    char tail[32];
    snprintf(tail, sizeof tail, ".rank%d", rank);
    return ddp__ck_cat(path, tail);
}

/* The library's keys of a shard (rank >= 0) or of the completion marker (rank < 0). */
static ddp_result ddp__ck_shard_keys(ddp_meta *m, int rank, int world, uint64_t id) {
    char v[32];
    ddp_result r;
    snprintf(v, sizeof v, "%016llx", (unsigned long long)id);
    if ((r = ddp_meta_set(m, DDP__CK_SHARD_ID, v)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP__CK_SHARD_WORLD, world)) != DDP_SUCCESS) return r;
    return rank < 0 ? DDP_SUCCESS : ddp_meta_set_int(m, DDP__CK_SHARD_RANK, rank);
}

/* Steps, each ended by an agreement (the barrier that tells everyone the step is done everywhere):
     1. rank 0 deletes the old marker at path, durably, and draws a save id (broadcast)
     2. every rank writes "<path>.rank<r>" durably, stamped with rank, world size and save id
     3. rank 0 writes the marker durably (only now is the set complete), deletes old markers (keep_last)
     4. with keep_last, rank 0 broadcasts the cutoff and every rank deletes its own old shards */
DDP_API ddp_result ddp_checkpoint_save_shard(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                             const ddp_checkpoint_save_desc *desc) {
    static const char *what = "checkpoint shard save";
    int rank = ddp__ck_rank(g), world = ddp__ck_world(g);
    ddp__ck_family fam;
    ddp_meta extra;
    int64_t number = 0, cutoff = INT64_MIN;
    uint64_t id = 0;
    char *shard = NULL;
    ddp_result r = DDP_SUCCESS;
    memset(&fam, 0, sizeof fam);
    memset(&extra, 0, sizeof extra);
    if (!path || !*path) r = ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: path is NULL or empty", what);
    else r = ddp__ck_check_rotation(g, path, desc, &fam, &number);
    if (r == DDP_SUCCESS && rank == 0) {
        id = ddp__ck_new_save_id();
        if (unlink(path) != 0 && errno != ENOENT) r = ddp__fail(g, DDP_ERR_IO, "%s: cannot remove the old completion marker %s: %s", what, path, strerror(errno));
        else r = ddp__ck_sync_dir(g, path);
    }
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &id, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    shard = ddp__ck_shard_path(path, rank);
    if (!shard || ddp__ck_shard_keys(&extra, rank, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    else r = ddp__ck_write_file(g, shard, t, n, meta, &extra);
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
    if (rank == 0) {
        ddp_meta_free(&extra);
        if (ddp__ck_shard_keys(&extra, -1, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
        else r = ddp__ck_write_file(g, path, NULL, 0, NULL, &extra);
        if (r == DDP_SUCCESS && fam.dir) {
            static const char *const tails[] = {"", ".tmp"};
            cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
            if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
        }
    }
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS || !fam.dir) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &cutoff, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    if (cutoff != INT64_MIN) {
        char own[32], own_tmp[40];
        const char *tails[2];
        snprintf(own, sizeof own, ".rank%d", rank);
        snprintf(own_tmp, sizeof own_tmp, ".rank%d.tmp", rank);
        tails[0] = own;
        tails[1] = own_tmp;
        ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
    }
done:
    ddp__free(shard);
    ddp_meta_free(&extra);
    ddp__ck_family_free(&fam);
    return r;
}

/* Read the completion marker: the world size and save id of a finished shard save. */
static ddp_result ddp__ck_read_marker(ddp_group *g, const char *path, int64_t *world, uint64_t *id) {
    ddp__ck_header h;
    const char *ws, *sid;
    char *raw = NULL, *end = NULL;
    uint64_t hlen;
    int fd;
    ddp_result r;
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint shard load: path is NULL or empty");
    if (access(path, F_OK) != 0 && errno == ENOENT)
        return ddp__fail(g, DDP_ERR_IO, "checkpoint shard load: no completion marker %s: that shard save did not finish (or the path is wrong)", path);
    if ((r = ddp__ck_open(g, path, &fd, &raw, &hlen, &h)) != DDP_SUCCESS) return r;
    close(fd);
    ws = ddp__ck_header_meta(&h, DDP__CK_SHARD_WORLD);
    sid = ddp__ck_header_meta(&h, DDP__CK_SHARD_ID);
    r = DDP_SUCCESS;
    if (!ws || !sid || h.n != 0 || strlen(sid) != 16) {
        r = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s is not a shard completion marker (no %s / %s keys)", path, DDP__CK_SHARD_WORLD, DDP__CK_SHARD_ID);
    } else {
        errno = 0;
        *world = (int64_t)strtoll(ws, &end, 10);
        *id = (uint64_t)strtoull(sid, NULL, 16);
        if (errno || *end || *world < 1 || *world > INT_MAX)
            r = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint marker %s: %s = \"%.32s\" is not a world size", path, DDP__CK_SHARD_WORLD, ws);
    }
    ddp__ck_header_free(&h);
    ddp__free(raw);
    return r;
}

DDP_API ddp_result ddp_checkpoint_load_shard(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                             const ddp_checkpoint_load_desc *desc) {
    static const char *what = "checkpoint shard load";
    int rank = ddp__ck_rank(g), world = ddp__ck_world(g), bcast = desc && desc->broadcast && world > 1;
    int64_t info[2] = {0, 0};
    uint64_t id = 0;
    char id_text[32], *shard = NULL;
    ddp__ck_shard_expect x;
    ddp_result r = DDP_SUCCESS;
    if (!bcast || rank == 0) r = ddp__ck_read_marker(g, path, &info[0], &id);
    if (bcast) {
        info[1] = (int64_t)id;
        if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) return r;
        if ((r = ddp_broadcast(g, info, 2, DDP_I64, 0)) != DDP_SUCCESS) return r;
        id = (uint64_t)info[1];
    }
    if (r == DDP_SUCCESS && info[0] != world)
        r = ddp__fail(g, DDP_ERR_MISMATCH, "%s: %s was saved by %lld ranks but this group has %d (shards are per rank: load with the same world size)",
                      what, path, (long long)info[0], world);
    if (r == DDP_SUCCESS && !(shard = ddp__ck_shard_path(path, rank))) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    if (r == DDP_SUCCESS) {
        snprintf(id_text, sizeof id_text, "%016llx", (unsigned long long)id);
        x.rank = rank;
        x.world = world;
        x.save_id = id_text;
        r = ddp__ck_load_local(g, shard, t, n, meta, desc, &x, NULL);
    }
    ddp__free(shard);
    return ddp__ck_agree(g, r, what);
}

/* ---- latest ---- */

DDP_API ddp_result ddp_checkpoint_latest(const char *pattern, char *out, size_t capacity, int64_t *number) {
    const char *slash, *name, *star;
    ddp__ck_family fam;
    DIR *d;
    struct dirent *de;
    char best[1024];
    int64_t best_num = -1;
    size_t dirlen;
    if (number) *number = -1;
    if (!out || capacity == 0) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_latest: out is NULL or capacity 0");
    out[0] = '\0';
    if (!pattern) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_latest: pattern is NULL");
    slash = strrchr(pattern, '/');
    name = slash ? slash + 1 : pattern;
    star = strchr(name, '*');
    if (!star || strchr(star + 1, '*'))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_latest: the file name in \"%.200s\" must hold exactly one '*' (e.g. ckpt/model_*.safetensors)", pattern);
    memset(&fam, 0, sizeof fam);
    if (!ddp__ck_family_split(&fam, pattern, (size_t)(star - name), (size_t)(star - name) + 1))
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_latest: out of memory");
    d = opendir(fam.dir);
    if (!d) {
        ddp_result r = errno == ENOENT ? DDP_SUCCESS : ddp__fail(NULL, DDP_ERR_IO, "ddp_checkpoint_latest: cannot list %s: %s", fam.dir, strerror(errno));
        ddp__ck_family_free(&fam);
        return r;
    }
    best[0] = '\0';
    while ((de = readdir(d)) != NULL) {
        int64_t num;
        if (ddp__ck_family_match(&fam, de->d_name, "", &num) && num > best_num && strlen(de->d_name) < sizeof best) {
            best_num = num;
            snprintf(best, sizeof best, "%s", de->d_name);
        }
    }
    closedir(d);
    ddp__ck_family_free(&fam);
    if (best_num < 0) return DDP_SUCCESS;
    dirlen = slash ? (size_t)(slash - pattern) + 1 : 0;
    if (dirlen + strlen(best) + 1 > capacity)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_latest: %zu bytes are too few for the path of %s", capacity, best);
    memcpy(out, pattern, dirlen);
    memcpy(out + dirlen, best, strlen(best) + 1);
    if (number) *number = best_num;
    return DDP_SUCCESS;
}
