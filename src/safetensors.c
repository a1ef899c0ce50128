/* [SECTION] safetensors: the file format (Hugging Face safetensors), UTF-8, ddp_meta
   The format of the safetensors crate, which torch users read with safetensors.torch.load_file:
       | N: uint64 little-endian | N bytes of JSON header | data: the tensors' bytes, back to back |
       {"__metadata__": {"key": "value", ...},
        "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
   Offsets count from the start of the data section. ddp.h's writer adds a CRC32C of every tensor's
   bytes to __metadata__ ("ddp.crc32c.<name>": 8 hex digits, crc32c.c) and pads the header with spaces so that the
   data starts at a multiple of 8; "ddp.crc32c." and "ddp.shard." keys are the library's. This file is
   the format only, with no group: errors go to a char buffer of DDP__ERR_MAX bytes (the public
   ddp_meta_* functions to this thread's last error); saving and loading it across ranks is
   checkpoint.c's. Layout of this file:
     UTF-8         strict RFC 3629 validation (names, keys and values must be UTF-8)
     meta          the caller's key/value map and its typed helpers
     parser        a strict, bounded parser for the safetensors JSON header (the only JSON we accept:
                   one object of tensor entries and "__metadata__"; strings, non-negative integers,
                   arrays of them); every offset is checked with overflow-safe arithmetic
     writer        the JSON header (checkpoint.c writes it and the data to disk) */
#include "internal.h"

#define DDP__CK_MAX_INT ((uint64_t)INT64_MAX)   /* largest integer a header may hold */

static int ddp__ck_little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

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
    if ((r = ddp_meta_set_int(m, DDP_META_SAMPLER_GLOBAL_POSITION,
                              s->sampler_global_position == 0 && s->sampler_position > 0 ? s->sampler_position * s->world_size
                                                                                           : s->sampler_global_position)) != DDP_SUCCESS)
        return r;
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
    if (!ddp_meta_get(m, DDP_META_SAMPLER_GLOBAL_POSITION)) s->sampler_global_position = s->sampler_position * s->world_size;
    else if ((r = ddp_meta_get_int(m, DDP_META_SAMPLER_GLOBAL_POSITION, &s->sampler_global_position)) != DDP_SUCCESS) return r;
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

/* The dtype table (ddp__ck_dtypes) and the parsed header's types are in internal.h:
   checkpoint.c uses them too. */

static const char *ddp__ck_st_name(ddp_dtype t) {
    int i;
    for (i = 0; i < DDP__CK_NDTYPES; i++)
        if (ddp__ck_dtypes[i].dtype == t && t != DDP_DTYPE_DEFAULT) return ddp__ck_dtypes[i].name;
    return "?";
}

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
                e = &h->e[h->n];
                memset(e, 0, sizeof *e);
                e->name = name;
                e->order = h->n++;
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

/* Concatenate a and b into a new string. */
static char *ddp__ck_cat(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = (char *)ddp__malloc(na + nb + 1);
    if (!s) return NULL;
    memcpy(s, a, na);
    memcpy(s + na, b, nb + 1);
    return s;
}

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

static int ddp__ck_reserved(const char *key) {
    return strncmp(key, DDP__CK_CRC_PREFIX, strlen(DDP__CK_CRC_PREFIX)) == 0 ||
           strncmp(key, DDP__CK_SHARD_PREFIX, strlen(DDP__CK_SHARD_PREFIX)) == 0;
}

/* The JSON header: user metadata, the library's keys (extra), a checksum per tensor (crcs[i], or
   computed from t[i].data when crcs is NULL; its length is the same whatever the value), then the tensor
   entries in t[] order with their data back to back; padded with spaces to a multiple of 8. path is for
   messages; on error err (DDP__ERR_MAX bytes) says what is wrong. */
static ddp_result ddp__ck_build_header(const char *path, const ddp_tensor *t, int n, const ddp_meta *user, const ddp_meta *extra,
                                       const uint32_t *crcs, ddp__ck_buf *b, char *err) {
    uint64_t at = 0;
    int i, first = 1;
    char num[64];
    for (i = 0; user && i < user->count; i++)
        if (ddp__ck_reserved(user->entries[i].key))
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "checkpoint save of %s: metadata key \"%.64s\" is reserved (ddp.crc32c.* and ddp.shard.* are the library's)",
                             path, user->entries[i].key);
    ddp__ck_puts(b, "{\"__metadata__\":{");
    for (i = 0; user && i < user->count; i++) ddp__ck_put_kv(b, &first, user->entries[i].key, user->entries[i].value);
    for (i = 0; extra && i < extra->count; i++) ddp__ck_put_kv(b, &first, extra->entries[i].key, extra->entries[i].value);
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        char *key = ddp__ck_cat(DDP__CK_CRC_PREFIX, t[i].name);
        if (!key) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
        ddp__ck_tensor_bytes(&t[i], &bytes);
        snprintf(num, sizeof num, "%08x", (unsigned)(crcs ? crcs[i] : ddp__ck_crc32c(t[i].data, (size_t)bytes, 1)));
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
    if (b->oom) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
    return DDP_SUCCESS;
}
