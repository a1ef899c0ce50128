/* Checkpoints without a group (a single process): round trip of every dtype (f16/bf16, 0-d, empty,
   8-d), the file layout read back by hand, metadata and resume state, strict header parsing (a table
   of malformed headers, every truncation, every corrupted byte), mismatches named, keep_last
   rotation, ddp_checkpoint_latest, per-rank shards and their completion marker, async save. */
#include "testlib.h"

#include <dirent.h>
#include <sys/stat.h>

static char dir[256];

/* dir/name, in one of 64 rotating buffers (long-lived paths are copied by their users) */
static const char *at(const char *name) {
    static char buf[64][512];
    static int k;
    k = (k + 1) % 64;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static void rm_rf(const char *d) {
    DIR *dd = opendir(d);
    struct dirent *e;
    char p[1024];
    if (!dd) return;
    while ((e = readdir(dd)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", d, e->d_name);
        unlink(p);
    }
    closedir(dd);
    rmdir(d);
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static unsigned char *read_file(const char *p, size_t *n) {
    FILE *f = fopen(p, "rb");
    unsigned char *b;
    long len;
    CHECK(f, "cannot open %s", p);
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = (unsigned char *)malloc((size_t)len + 1);
    CHECK(fread(b, 1, (size_t)len, f) == (size_t)len, "short read");
    fclose(f);
    *n = (size_t)len;
    return b;
}

static void write_file(const char *p, const void *b, size_t n) {
    FILE *f;
    unlink(p); /* a new file: ext4 flushes a file truncated and rewritten in place at close (slow) */
    f = fopen(p, "wb");
    CHECK(f && fwrite(b, 1, n, f) == n, "cannot write %s", p);
    fclose(f);
}

/* A file with the given header JSON (written as is) and data bytes. */
static void write_raw(const char *p, const char *json, const void *data, size_t n) {
    size_t h = strlen(json), i;
    unsigned char *b = (unsigned char *)malloc(8 + h + n + 1);
    for (i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, json, h);
    if (n) memcpy(b + 8 + h, data, n);
    write_file(p, b, 8 + h + n);
    free(b);
}

/* Independent bitwise CRC-32C. */
static uint32_t ref_crc32c(const void *d, size_t n) {
    const unsigned char *p = (const unsigned char *)d;
    uint32_t c = 0xFFFFFFFFu;
    size_t i;
    int k;
    for (i = 0; i < n; i++) {
        c ^= p[i];
        for (k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

static void test_crc(void) {
    unsigned char buf[1000];
    uint64_t s = 1;
    size_t i, n;
    CHECK(ddp__ck_crc32c("123456789", 9, 1) == 0xE3069283u, "hw crc32c check value %08x", ddp__ck_crc32c("123456789", 9, 1));
    CHECK(ddp__ck_crc32c("123456789", 9, 0) == 0xE3069283u, "soft crc32c check value");
    for (i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)tl_rand(&s);
    for (n = 0; n < 200; n += 7)
        for (i = 0; i < 9; i++) {
            uint32_t want = ref_crc32c(buf + i, n);
            CHECK(ddp__ck_crc32c(buf + i, n, 1) == want && ddp__ck_crc32c(buf + i, n, 0) == want, "crc32c n=%zu off=%zu", n, i);
        }
    { /* long inputs take the three-lane instruction path (lanes of 4 KiB) */
        static const size_t lens[] = {12287, 12288, 12289, 12288 * 2 + 8, 100003};
        size_t k;
        unsigned char *big = (unsigned char *)malloc(100003 + 8);
        for (i = 0; i < 100003 + 8; i++) big[i] = (unsigned char)tl_rand(&s);
        for (k = 0; k < sizeof lens / sizeof lens[0]; k++)
            for (i = 0; i < 3; i++) {
                uint32_t want = ref_crc32c(big + i, lens[k]);
                CHECK(ddp__ck_crc32c(big + i, lens[k], 1) == want && ddp__ck_crc32c(big + i, lens[k], 0) == want, "crc32c n=%zu", lens[k]);
            }
        free(big);
    }
    printf("crc32c: ok\n");
}

static void test_meta(void) {
    ddp_meta m = {0, 0, 0};
    int64_t v;
    unsigned char bytes[5] = {0, 1, 0xab, 0xff, 0x10}, back[8];
    size_t size;
    ddp_resume_state rs, rs2;
    unsigned char rng[40], rng2[40];
    int i;
    CHECK_OK(ddp_meta_set(&m, "a", "1"), NULL);
    CHECK_OK(ddp_meta_set(&m, "b", "two"), NULL);
    CHECK_OK(ddp_meta_set(&m, "a", "one"), NULL);
    CHECK(m.count == 2 && strcmp(ddp_meta_get(&m, "a"), "one") == 0, "overwrite");
    CHECK(ddp_meta_get(&m, "zz") == NULL, "missing key");
    CHECK(ddp_meta_set(&m, "", "x") == DDP_ERR_INVALID_ARGUMENT, "empty key");
    CHECK(ddp_meta_set(&m, "bad\xff", "x") == DDP_ERR_INVALID_ARGUMENT, "non-UTF-8 key");
    CHECK_OK(ddp_meta_set_int(&m, "neg", INT64_MIN), NULL);
    CHECK_OK(ddp_meta_get_int(&m, "neg", &v), NULL);
    CHECK(v == INT64_MIN, "int64 min round trip");
    CHECK_OK(ddp_meta_set_int(&m, "max", INT64_MAX), NULL);
    CHECK_OK(ddp_meta_get_int(&m, "max", &v), NULL);
    CHECK(v == INT64_MAX, "int64 max");
    CHECK(ddp_meta_get_int(&m, "b", &v) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), "\"b\""), "not an int: %s", ddp_last_error(NULL));
    CHECK_OK(ddp_meta_set(&m, "big", "9223372036854775808"), NULL);
    CHECK(ddp_meta_get_int(&m, "big", &v) == DDP_ERR_FORMAT, "int overflow");
    CHECK(ddp_meta_get_int(&m, "nokey", &v) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), "nokey"), "missing int");
    CHECK_OK(ddp_meta_set_bytes(&m, "raw", bytes, 5), NULL);
    CHECK(strcmp(ddp_meta_get(&m, "raw"), "0001abff10") == 0, "hex text %s", ddp_meta_get(&m, "raw"));
    CHECK_OK(ddp_meta_get_bytes(&m, "raw", back, sizeof back, &size), NULL);
    CHECK(size == 5 && memcmp(back, bytes, 5) == 0, "bytes round trip");
    CHECK(ddp_meta_get_bytes(&m, "raw", back, 4, &size) == DDP_ERR_INVALID_ARGUMENT && size == 5, "small buffer");
    CHECK(ddp_meta_get_bytes(&m, "b", back, 8, &size) == DDP_ERR_FORMAT, "not hex");
    CHECK(ddp_meta_remove(&m, "raw") == 1 && ddp_meta_remove(&m, "raw") == 0 && !ddp_meta_get(&m, "raw"), "remove");
    for (i = 0; i < 40; i++) rng[i] = (unsigned char)(i * 37 + 1);
    memset(&rs, 0, sizeof rs);
    rs.step = 1234567890123ll;
    rs.epoch = 7;
    rs.sampler_position = 4096;
    rs.world_size = 8;
    rs.rng_state = rng;
    rs.rng_state_size = sizeof rng;
    CHECK_OK(ddp_meta_set_resume(&m, &rs), NULL);
    memset(&rs2, 0, sizeof rs2);
    rs2.rng_state = rng2;
    rs2.rng_state_size = sizeof rng2;
    CHECK_OK(ddp_meta_get_resume(&m, &rs2), NULL);
    CHECK(rs2.step == rs.step && rs2.epoch == 7 && rs2.sampler_position == 4096 && rs2.world_size == 8 && rs2.rng_state_size == 40 &&
              memcmp(rng, rng2, 40) == 0,
          "resume round trip");
    /* the global sample position (issue #21): derived from a program that does not fill it in, and from a
       checkpoint without the key; stored as given otherwise */
    CHECK(rs2.sampler_global_position == 4096 * 8 && strcmp(ddp_meta_get(&m, DDP_META_SAMPLER_GLOBAL_POSITION), "32768") == 0,
          "global position derived: %lld", (long long)rs2.sampler_global_position);
    CHECK(ddp_meta_remove(&m, DDP_META_SAMPLER_GLOBAL_POSITION) == 1, "remove");
    CHECK_OK(ddp_meta_get_resume(&m, &rs2), NULL);
    CHECK(rs2.sampler_global_position == 4096 * 8, "global position of an older checkpoint: %lld", (long long)rs2.sampler_global_position);
    rs.sampler_position = 5;
    rs.sampler_global_position = 93; /* resumed on another world size: not position * world size */
    CHECK_OK(ddp_meta_set_resume(&m, &rs), NULL);
    CHECK_OK(ddp_meta_get_resume(&m, &rs2), NULL);
    CHECK(rs2.sampler_global_position == 93 && rs2.sampler_position == 5, "global position round trip");
    ddp_meta_free(&m);
    CHECK(m.count == 0 && m.entries == NULL, "free empties");
    CHECK(ddp_meta_get_resume(&m, &rs2) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), DDP_META_STEP), "missing resume key");
    printf("meta: ok\n");
}

/* ---- the tensors of the round trip ---- */

#define NT 12
typedef struct set {
    ddp_tensor t[NT];
    void *mem[NT];
    int n;
} set;

static size_t numel(const ddp_tensor *t) {
    size_t n = 1;
    int i;
    for (i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

static void add(set *s, const char *name, ddp_dtype dt, int ndim, const int64_t *shape, uint64_t seed) {
    ddp_tensor *t = &s->t[s->n];
    size_t bytes, i;
    memset(t, 0, sizeof *t);
    t->name = name;
    t->dtype = dt;
    t->ndim = ndim;
    for (i = 0; i < (size_t)ndim; i++) t->shape[i] = shape[i];
    bytes = numel(t) * ddp_dtype_size(dt);
    s->mem[s->n] = t->data = bytes ? malloc(bytes) : NULL;
    for (i = 0; i < bytes; i++) ((unsigned char *)t->data)[i] = (unsigned char)tl_rand(&seed);
    if (dt == DDP_F16 && bytes >= 8) { /* some special values: inf, -0, a subnormal, NaN */
        uint16_t sp[4] = {0x7c00, 0x8000, 0x0001, 0x7e00};
        memcpy(t->data, sp, 8);
    }
    if (dt == DDP_BF16 && bytes >= 8) {
        uint16_t sp[4] = {0xff80, 0x8000, 0x0001, 0x7fc0};
        memcpy(t->data, sp, 8);
    }
    s->n++;
}

static void make_set(set *s, uint64_t seed) {
    static const int64_t s23[] = {2, 3}, s5[] = {5}, s0[] = {3, 0, 4}, s8[] = {2, 1, 2, 1, 1, 2, 1, 3}, s17[] = {17}, sbig[] = {1000, 33};
    memset(s, 0, sizeof *s);
    add(s, "f32", DDP_F32, 2, s23, seed + 1);
    add(s, "f64", DDP_F64, 1, s5, seed + 2);
    add(s, "f16", DDP_F16, 1, s17, seed + 3);
    add(s, "bf16", DDP_BF16, 2, s23, seed + 4);
    add(s, "i8", DDP_I8, 1, s17, seed + 5);
    add(s, "u8", DDP_U8, 1, s5, seed + 6);
    add(s, "i32", DDP_I32, 2, s23, seed + 7);
    add(s, "i64", DDP_I64, 1, s5, seed + 8);
    add(s, "scalar (0-d)", DDP_F32, 0, NULL, seed + 9);
    add(s, "empty", DDP_BF16, 3, s0, seed + 10);
    add(s, "eight-d \"quoted\" \\ \xc3\xa9\xe2\x82\xac", DDP_I64, 8, s8, seed + 11);
    add(s, "big", DDP_F32, 2, sbig, seed + 12);
}

static void free_set(set *s) {
    int i;
    for (i = 0; i < s->n; i++) free(s->mem[i]);
}

/* An empty set with the same names, dtypes and shapes, for loading into. */
static void blank_like(set *dst, const set *src) {
    int i;
    *dst = *src;
    for (i = 0; i < src->n; i++) {
        size_t bytes = numel(&src->t[i]) * ddp_dtype_size(src->t[i].dtype);
        dst->mem[i] = dst->t[i].data = bytes ? calloc(1, bytes) : NULL;
    }
}

/* The first n tensors of a and b hold the same bytes. */
static void same_data(const set *a, const set *b, int n) {
    int i;
    for (i = 0; i < n; i++) {
        size_t bytes = numel(&a->t[i]) * ddp_dtype_size(a->t[i].dtype);
        CHECK(bytes == 0 || memcmp(a->t[i].data, b->t[i].data, bytes) == 0, "tensor %s differs after the round trip", a->t[i].name);
    }
}

static ddp_result load_opts(const char *p, ddp_tensor *t, int n, ddp_meta *m, int unexpected, int missing_crc) {
    ddp_checkpoint_load_desc d;
    memset(&d, 0, sizeof d);
    d.allow_unexpected = unexpected;
    d.allow_missing_checksums = missing_crc;
    return ddp_checkpoint_load_ex(NULL, p, t, n, m, &d);
}

static uint64_t le64(const unsigned char *b) {
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static void test_round_trip(void) {
    set s, back;
    ddp_meta m = {0, 0, 0}, got = {0, 0, 0};
    char p[512];
    snprintf(p, sizeof p, "%s", at("rt.safetensors"));
    unsigned char *file;
    size_t size, off;
    uint64_t hlen;
    int i;
    make_set(&s, 100);
    CHECK_OK(ddp_meta_set(&m, "note", "line1\nline2\t\"q\" \\ \x01 \xf0\x9f\x98\x80"), NULL);
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_STEP, 42), NULL);
    CHECK_OK(ddp_checkpoint_save(NULL, p, s.t, s.n, &m), NULL);
    CHECK(!exists(at("rt.safetensors.tmp")), "temporary file left behind");

    /* the layout, read by hand: length prefix, JSON starting with '{', 8-byte aligned data that is the
       tensors' bytes back to back in the order given */
    file = read_file(p, &size);
    hlen = le64(file);
    CHECK(8 + hlen <= size && file[8] == '{' && (8 + hlen) % 8 == 0, "prefix %llu, size %zu", (unsigned long long)hlen, size);
    off = 8 + (size_t)hlen;
    for (i = 0; i < s.n; i++) {
        size_t bytes = numel(&s.t[i]) * ddp_dtype_size(s.t[i].dtype);
        CHECK(bytes == 0 || memcmp(file + off, s.t[i].data, bytes) == 0, "data of %s not where expected", s.t[i].name);
        off += bytes;
    }
    CHECK(off == size, "file has %zu bytes, tensors end at %zu", size, off);
    CHECK(strstr((char *)file + 8, "\"dtype\":\"BF16\"") && strstr((char *)file + 8, "\"shape\":[]") &&
              strstr((char *)file + 8, "\"shape\":[3,0,4]"),
          "header text");
    {
        char err[DDP__ERR_MAX];
        CHECK_OK(ddp__ck_check_image(file, size, err), NULL);
    }
    free(file);

    blank_like(&back, &s);
    CHECK_OK(ddp_checkpoint_load(NULL, p, back.t, back.n, &got), NULL);
    same_data(&s, &back, s.n);
    CHECK(got.count == 2 && strcmp(ddp_meta_get(&got, "note"), ddp_meta_get(&m, "note")) == 0 &&
              strcmp(ddp_meta_get(&got, DDP_META_STEP), "42") == 0,
          "metadata round trip (count %d)", got.count);
    /* a subset, in another order */
    {
        ddp_tensor two[2];
        two[0] = back.t[7];
        two[1] = back.t[2];
        memset(back.t[7].data, 0, 40);
        CHECK(load_opts(p, two, 2, NULL, 0, 0) == DDP_ERR_MISMATCH && strstr(ddp_last_error(NULL), "did not list"), "strict load of a subset");
        CHECK_OK(load_opts(p, two, 2, NULL, 1, 0), NULL);
        CHECK(memcmp(back.t[7].data, s.t[7].data, 40) == 0, "subset load");
    }
    /* metadata only */
    CHECK_OK(load_opts(p, NULL, 0, &got, 1, 0), NULL);
    CHECK(got.count == 2, "metadata-only load");
    ddp_meta_free(&got);
    ddp_meta_free(&m);
    free_set(&back);
    free_set(&s);
    printf("round trip: ok\n");
}

static void expect_err(ddp_result r, ddp_result want, const char *needle, const char *what) {
    CHECK(r == want, "%s: got %s, want %s (%s)", what, ddp_result_string(r), ddp_result_string(want), ddp_last_error(NULL));
    CHECK(!needle || strstr(ddp_last_error(NULL), needle), "%s: message \"%s\" lacks \"%s\"", what, ddp_last_error(NULL), needle);
}

static void test_mismatch(void) {
    set s, back;
    char p[512];
    snprintf(p, sizeof p, "%s", at("mm.safetensors"));
    ddp_tensor t;
    make_set(&s, 7);
    CHECK_OK(ddp_checkpoint_save(NULL, p, s.t, 8, NULL), NULL);
    blank_like(&back, &s);
    t = back.t[0];
    t.name = "nope";
    expect_err(ddp_checkpoint_load(NULL, p, &t, 1, NULL), DDP_ERR_MISMATCH, "\"nope\"", "missing tensor");
    t = back.t[0];
    t.dtype = DDP_F64;
    t.data = back.t[1].data;
    t.shape[0] = 1;
    t.shape[1] = 3;
    expect_err(load_opts(p, &t, 1, NULL, 1, 0), DDP_ERR_MISMATCH, "\"f32\" is F32 [2, 3] in the file but F64 [1, 3]", "dtype and shape");
    t = back.t[6];
    t.shape[0] = 3;
    t.shape[1] = 2;
    expect_err(load_opts(p, &t, 1, NULL, 1, 0), DDP_ERR_MISMATCH, "\"i32\"", "transposed shape");
    t = back.t[6];
    t.ndim = 1;
    t.shape[0] = 6;
    expect_err(load_opts(p, &t, 1, NULL, 1, 0), DDP_ERR_MISMATCH, "\"i32\"", "flattened shape");
    expect_err(ddp_checkpoint_load(NULL, p, back.t, 9, NULL), DDP_ERR_MISMATCH, "scalar", "tensor absent from the file");
    {
        ddp_tensor dup[2];
        dup[0] = back.t[0];
        dup[1] = back.t[0];
        expect_err(ddp_checkpoint_load(NULL, p, dup, 2, NULL), DDP_ERR_INVALID_ARGUMENT, "twice", "duplicate request");
        expect_err(ddp_checkpoint_save(NULL, at("dup.safetensors"), dup, 2, NULL), DDP_ERR_INVALID_ARGUMENT, "twice", "duplicate save");
        CHECK(!exists(at("dup.safetensors")) && !exists(at("dup.safetensors.tmp")), "failed save left a file");
    }
    {
        ddp_meta m = {0, 0, 0};
        CHECK_OK(ddp_meta_set(&m, "ddp.crc32c.f32", "00000000"), NULL);
        expect_err(ddp_checkpoint_save(NULL, at("res.safetensors"), s.t, 1, &m), DDP_ERR_INVALID_ARGUMENT, "reserved", "reserved key");
        ddp_meta_free(&m);
    }
    t = s.t[0];
    t.ndim = 9;
    expect_err(ddp_checkpoint_save(NULL, at("x.safetensors"), &t, 1, NULL), DDP_ERR_INVALID_ARGUMENT, "ndim", "ndim 9");
    t = s.t[0];
    t.shape[0] = -1;
    expect_err(ddp_checkpoint_save(NULL, at("x.safetensors"), &t, 1, NULL), DDP_ERR_INVALID_ARGUMENT, NULL, "negative dim");
    t = s.t[0];
    t.data = NULL;
    expect_err(ddp_checkpoint_save(NULL, at("x.safetensors"), &t, 1, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL", "NULL data");
    expect_err(ddp_checkpoint_save(NULL, at("no/such/dir/x.safetensors"), s.t, 1, NULL), DDP_ERR_IO, "no/such/dir", "missing directory");
    expect_err(ddp_checkpoint_load(NULL, at("absent.safetensors"), back.t, 1, NULL), DDP_ERR_IO, "absent.safetensors", "missing file");
    /* a failed save leaves the previous file untouched */
    {
        size_t n1, n2;
        unsigned char *a = read_file(p, &n1), *b;
        t = s.t[0];
        t.dtype = (ddp_dtype)99;
        CHECK(ddp_checkpoint_save(NULL, p, &t, 1, NULL) == DDP_ERR_INVALID_ARGUMENT, "bad dtype");
        b = read_file(p, &n2);
        CHECK(n1 == n2 && memcmp(a, b, n1) == 0, "failed save changed the file");
        free(a);
        free(b);
    }
    free_set(&back);
    free_set(&s);
    printf("mismatch: ok\n");
}

/* Every strict rule of the parser, each with the message it must give. */
static void test_malformed(void) {
    static const struct {
        const char *json;
        size_t data;
        const char *needle; /* NULL: must load */
    } cases[] = {
        {"{}", 0, NULL},
        {"{\"__metadata__\":{}}", 0, NULL},
        {"  ", 0, "does not start with '{'"},
        {"[]", 0, "does not start with '{'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, NULL},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8],\"dtype\":\"F32\"}}  \n\t ", 8, NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "trailing bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "truncated"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} x", 8, "bytes after the header"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", 8, "expected a string"},
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype \"F33\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "begin > end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "a gap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "an overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, "appears twice"},
        {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "\"k\" appears twice"},
        {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "__metadata__ appears twice"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "not a string"},
        {"{\"__metadata__\":{\"k\":{\"n\":\"x\"}}}", 0, "not a string"},
        {"{\"__metadata__\":\"x\"}", 0, "must be an object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, "leading zero"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]}}", 8, "not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,8]}}", 8, "larger than 2^63-1"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, "too large"},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[1152921504606846976],\"data_offsets\":[0,8]}}", 8, "too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}", 0, NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,18446744073709551615]}}", 8, "larger than 2^63-1"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "[begin, end]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4,8]}}", 8, "[begin, end]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "lacks data_offsets"},
        {"{\"a\":{}}", 0, "without dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, "unknown key \"x\""},
        {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "repeated key"},
        {"{\"a\":[1,2]}", 0, "must be an object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "expected ',' or '}'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,],\"data_offsets\":[0,8]}}", 8, "non-negative integer"},
        {"{\"a", 0, "unterminated string"},
        {"{\"a\\", 0, "unterminated string"},
        {"{\"a\\q\":{}}", 0, "bad escape"},
        {"{\"a\\u0000\":{}}", 0, "bad escape"},
        {"{\"a\\ud800\":{}}", 0, "bad escape"},
        {"{\"a\\udc00\\ud800\":{}}", 0, "bad escape"},
        {"{\"a\\u12\":{}}", 0, "bad escape"},
        {"{\"a\tb\":{}}", 0, "control character"},
        {"{\"a\xff\":{}}", 0, "not valid UTF-8"},
        {"{\"a\xc0\xaf\":{}}", 0, "not valid UTF-8"},
        {"{\"a\xed\xa0\x80\":{}}", 0, "not valid UTF-8"},
        {"{\"a\xe2\x82\":{}}", 0, "not valid UTF-8"},
        {"{\"\\ud83d\\ude00 \\u00e9\\n\\\"\\\\\\/\\b\\f\\r\\t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, NULL},
        {"{\"b\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[0,3]}}", 3, NULL},
        {"{\"b\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, NULL},
        {"{\"b\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1,3],\"data_offsets\":[0,8]}}", 8, "needs 12 bytes"},
        {"{\"z\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]},\"y\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]},"
         "\"x\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, NULL},
        {"{\"__metadata__\":{\"\":\"x\"}}", 0, "empty __metadata__ key"},
        /* a long shape then a broken key: the fuzzer found the >8-dims buffer leaked on this path */
        {"{\"b\":{\"shape\":[1,1,1,1,1,1,1,1,1,2],\"dtype", 8, "unterminated string"},
        {"{\"b\":{\"shape\":[1,1,1,1,1,1,1,1,1,2],\"dtype\" \"F32\"}}", 8, "expected ':'"},
    };
    char data[64];
    size_t i;
    char p[512];
    snprintf(p, sizeof p, "%s", at("bad.safetensors"));
    memset(data, 0, sizeof data);
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ddp_result r;
        write_raw(p, cases[i].json, data, cases[i].data);
        r = load_opts(p, NULL, 0, NULL, 1, 1);
        if (!cases[i].needle) CHECK(r == DDP_SUCCESS, "case %zu %s: %s", i, cases[i].json, ddp_last_error(NULL));
        else expect_err(r, DDP_ERR_FORMAT, cases[i].needle, cases[i].json);
    }
    /* length prefix: beyond the file, beyond the 100 MB limit, shorter than 8 bytes */
    {
        unsigned char b[16] = {0x10, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
        write_file(p, b, 16);
        CHECK(load_opts(p, NULL, 0, NULL, 1, 1) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), "past the end"), "%s", ddp_last_error(NULL));
        b[0] = 0;
        b[3] = 0x10; /* 256 MiB */
        write_file(p, b, 16);
        CHECK(load_opts(p, NULL, 0, NULL, 1, 1) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), "exceeds the limit"), "%s", ddp_last_error(NULL));
        write_file(p, b, 5);
        CHECK(load_opts(p, NULL, 0, NULL, 1, 1) == DDP_ERR_FORMAT && strstr(ddp_last_error(NULL), "shorter than"), "%s", ddp_last_error(NULL));
    }
    /* a dtype ddp.h lacks: skipped when unexpected, named when asked for */
    {
        ddp_tensor t;
        unsigned char buf[3];
        write_raw(p, "{\"b\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[0,3]}}", data, 3);
        memset(&t, 0, sizeof t);
        t.name = "b";
        t.dtype = DDP_U8;
        t.ndim = 1;
        t.shape[0] = 3;
        t.data = buf;
        expect_err(load_opts(p, &t, 1, NULL, 0, 1), DDP_ERR_MISMATCH, "BOOL [3] in the file but U8 [3]", "BOOL tensor");
    }
    /* checksums: missing ones are refused unless allowed; a malformed one is refused always */
    {
        ddp_tensor t;
        float v[2];
        memset(&t, 0, sizeof t);
        t.name = "a";
        t.dtype = DDP_F32;
        t.ndim = 1;
        t.shape[0] = 2;
        t.data = v;
        write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
        expect_err(load_opts(p, &t, 1, NULL, 0, 0), DDP_ERR_FORMAT, "no ddp.crc32c. checksum", "missing checksum");
        CHECK_OK(load_opts(p, &t, 1, NULL, 0, 1), NULL);
        write_raw(p, "{\"__metadata__\":{\"ddp.crc32c.a\":\"xyz\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
        expect_err(load_opts(p, &t, 1, NULL, 0, 1), DDP_ERR_FORMAT, "not 8 hex digits", "malformed checksum");
        write_raw(p, "{\"__metadata__\":{\"ddp.crc32c.a\":\"00000001\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
        expect_err(load_opts(p, &t, 1, NULL, 0, 1), DDP_ERR_FORMAT, "is corrupt", "wrong checksum");
    }
    printf("malformed headers: %zu cases ok\n", sizeof cases / sizeof cases[0]);
}

/* Every truncation and every single corrupted byte of a real file must be refused, never loaded. */
static void test_corruption(void) {
    set s, back;
    char p[512], q[512];
    snprintf(p, sizeof p, "%s", at("good.safetensors"));
    snprintf(q, sizeof q, "%s", at("corrupt.safetensors"));
    unsigned char *file, *copy;
    size_t size, i;
    ddp_meta m = {0, 0, 0};
    int flips = 0;
    make_set(&s, 3);
    s.n = 11; /* without the big one: every byte is tried */
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_EPOCH, 12), NULL);
    CHECK_OK(ddp_checkpoint_save(NULL, p, s.t, s.n, &m), NULL);
    file = read_file(p, &size);
    copy = (unsigned char *)malloc(size);
    blank_like(&back, &s);
    for (i = 0; i < size; i++) {
        write_file(q, file, i);
        expect_err(ddp_checkpoint_load(NULL, q, back.t, back.n, NULL), DDP_ERR_FORMAT, NULL, "truncated file");
    }
    for (i = 0; i < size; i++) {
        ddp_result r;
        memcpy(copy, file, size);
        copy[i] ^= 0xFF;
        write_file(q, copy, size);
        r = ddp_checkpoint_load(NULL, q, back.t, back.n, NULL);
        CHECK(r == DDP_ERR_FORMAT, "byte %zu of %zu inverted: %s (%s)", i, size, ddp_result_string(r), ddp_last_error(NULL));
        /* single bit flips in the data: CRC32C catches every one */
        if (i >= 8 + le64(file) && (i % 3) == 0) {
            copy[i] ^= 0xFF ^ (unsigned char)(1u << (i % 8));
            write_file(q, copy, size);
            CHECK(ddp_checkpoint_load(NULL, q, back.t, back.n, NULL) == DDP_ERR_FORMAT, "bit flip at %zu loaded", i);
            flips++;
        }
    }
    CHECK(flips > 10, "too few bit flips tried");
    CHECK_OK(ddp_checkpoint_load(NULL, p, back.t, back.n, NULL), NULL);
    same_data(&s, &back, s.n);
    free(file);
    free(copy);
    ddp_meta_free(&m);
    free_set(&back);
    s.n = NT;
    free_set(&s);
    printf("corruption: every truncation and inverted byte refused\n");
}

static int count_files(const char *prefix) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) n++;
    closedir(d);
    return n;
}

static void test_rotation(void) {
    set s;
    ddp_checkpoint_save_desc sd;
    char latest[512], name[64];
    int64_t num;
    int step;
    make_set(&s, 1);
    memset(&sd, 0, sizeof sd);
    sd.keep_last = 2;
    CHECK_OK(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, sizeof latest, &num), NULL);
    CHECK(num == -1 && latest[0] == '\0', "latest with nothing saved");
    write_file(at("rot_000001.safetensors.tmp"), "junk", 4); /* a crash leftover */
    write_file(at("rot_other.safetensors"), "x", 1);          /* not a member */
    write_file(at("rot_5.safetensors.bak"), "x", 1);          /* not a member */
    for (step = 100; step <= 500; step += 100) {
        snprintf(name, sizeof name, "rot_%06d.safetensors", step);
        CHECK_OK(ddp_checkpoint_save_ex(NULL, at(name), s.t, 2, NULL, &sd), NULL);
    }
    CHECK(!exists(at("rot_000100.safetensors")) && !exists(at("rot_000300.safetensors")) && exists(at("rot_000400.safetensors")) &&
              exists(at("rot_000500.safetensors")) && !exists(at("rot_000001.safetensors.tmp")) && exists(at("rot_other.safetensors")) &&
              exists(at("rot_5.safetensors.bak")),
          "keep_last 2 kept the wrong files");
    CHECK(count_files("rot_") == 4, "files left: %d", count_files("rot_"));
    CHECK_OK(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, sizeof latest, &num), NULL);
    CHECK(num == 500 && strcmp(latest, at("rot_000500.safetensors")) == 0, "latest %s %lld", latest, (long long)num);
    /* numbers compare as numbers, not text */
    CHECK_OK(ddp_checkpoint_save_ex(NULL, at("rot_9999.safetensors"), s.t, 2, NULL, &sd), NULL);
    CHECK(!exists(at("rot_000400.safetensors")) && exists(at("rot_000500.safetensors")), "numeric order");
    CHECK_OK(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, sizeof latest, &num), NULL);
    CHECK(num == 9999, "latest %lld", (long long)num);
    expect_err(ddp_checkpoint_save_ex(NULL, at("nodigits.safetensors"), s.t, 2, NULL, &sd), DDP_ERR_INVALID_ARGUMENT, "number in the file name", "keep_last without a number");
    expect_err(ddp_checkpoint_latest(at("rot.safetensors"), latest, sizeof latest, &num), DDP_ERR_INVALID_ARGUMENT, "one '*'", "pattern without *");
    expect_err(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, 8, &num), DDP_ERR_INVALID_ARGUMENT, "too few", "small buffer");
    free_set(&s);
    printf("rotation and latest: ok\n");
}

static void test_shards(void) {
    set s, back;
    ddp_meta m = {0, 0, 0}, got = {0, 0, 0};
    char p[512];
    snprintf(p, sizeof p, "%s", at("opt_000010.safetensors"));
    char shard[600];
    ddp_checkpoint_save_desc sd;
    unsigned char *old;
    size_t n_old;
    make_set(&s, 9);
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_STEP, 10), NULL);
    CHECK_OK(ddp_checkpoint_save_shard(NULL, p, s.t, 4, &m, NULL), NULL);
    snprintf(shard, sizeof shard, "%s.rank0", p);
    CHECK(exists(p) && exists(shard), "marker and shard exist");
    blank_like(&back, &s);
    CHECK_OK(ddp_checkpoint_load_shard(NULL, p, back.t, 4, &got, NULL), NULL);
    same_data(&s, &back, 4);
    CHECK(got.count == 1 && strcmp(ddp_meta_get(&got, DDP_META_STEP), "10") == 0, "shard metadata (count %d)", got.count);
    /* the shard is a safetensors file of its own: plain load works; the marker has no tensors */
    CHECK_OK(ddp_checkpoint_load(NULL, shard, back.t, 4, NULL), NULL);
    CHECK_OK(ddp_checkpoint_load(NULL, p, NULL, 0, NULL), NULL);
    /* a shard from another save (as after a save cut short) is refused */
    old = read_file(shard, &n_old);
    CHECK_OK(ddp_checkpoint_save_shard(NULL, p, s.t, 4, &m, NULL), NULL);
    write_file(shard, old, n_old);
    expect_err(ddp_checkpoint_load_shard(NULL, p, back.t, 4, NULL, NULL), DDP_ERR_FORMAT, "incomplete", "stale shard");
    /* no marker: the save did not finish */
    unlink(p);
    expect_err(ddp_checkpoint_load_shard(NULL, p, back.t, 4, NULL, NULL), DDP_ERR_IO, "did not finish", "no marker");
    /* a marker that is not one */
    CHECK_OK(ddp_checkpoint_save(NULL, p, s.t, 1, NULL), NULL);
    expect_err(ddp_checkpoint_load_shard(NULL, p, back.t, 4, NULL, NULL), DDP_ERR_FORMAT, "not a shard completion marker", "plain file as marker");
    /* keep_last deletes old markers and shards together */
    memset(&sd, 0, sizeof sd);
    sd.keep_last = 1;
    CHECK_OK(ddp_checkpoint_save_shard(NULL, at("opt_000020.safetensors"), s.t, 4, &m, &sd), NULL);
    CHECK(!exists(p) && !exists(shard) && exists(at("opt_000020.safetensors")) && exists(at("opt_000020.safetensors.rank0")), "shard rotation");
    {
        char latest[512];
        int64_t num;
        CHECK_OK(ddp_checkpoint_latest(at("opt_*.safetensors"), latest, sizeof latest, &num), NULL);
        CHECK(num == 20, "latest shard marker %lld", (long long)num);
    }
    free(old);
    ddp_meta_free(&m);
    ddp_meta_free(&got);
    free_set(&back);
    free_set(&s);
    printf("shards: ok\n");
}

/* Async save (issue #21), without a group: the file is byte for byte the synchronous save's even when
   the tensors are overwritten right after the call; keep_last; back-to-back saves; errors of the
   background (a missing directory, a directory in the way, a bad tensor) come back from ddp_wait with
   the path and the system's reason; a handle is waited on once. */
static void scribble(set *s) {
    int i;
    for (i = 0; i < s->n; i++) {
        size_t bytes = numel(&s->t[i]) * ddp_dtype_size(s->t[i].dtype);
        if (bytes) memset(s->t[i].data, 0xA5, bytes);
    }
}

static void same_file(const char *a, const char *b) {
    size_t na, nb;
    unsigned char *fa = read_file(a, &na), *fb = read_file(b, &nb);
    CHECK(na == nb && memcmp(fa, fb, na) == 0, "%s (%zu bytes) and %s (%zu bytes) differ", a, na, b, nb);
    free(fa);
    free(fb);
}

static void test_async(void) {
    set s, back;
    ddp_meta m = {0, 0, 0};
    ddp_work *w, *w2;
    ddp_checkpoint_save_desc sd;
    char name[64], blocker[600];
    int k, polls = 0;
    make_set(&s, 300);
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_STEP, 7), NULL);
    CHECK_OK(ddp_checkpoint_save(NULL, at("sync.safetensors"), s.t, s.n, &m), NULL);
    CHECK_OK(ddp_checkpoint_save_async(NULL, at("async.safetensors"), s.t, s.n, &m, &w), NULL);
    CHECK(w != NULL, "no work handle");
    scribble(&s); /* the training step goes on: the save must not see it */
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_STEP, 8), NULL);
    while (!ddp_test(w)) {
        polls++;
        usleep(100);
    }
    CHECK_OK(ddp_wait(w), NULL);
    same_file(at("sync.safetensors"), at("async.safetensors"));
    CHECK(!exists(at("async.safetensors.tmp")), "temporary file left behind");
    expect_err(ddp_wait(w), DDP_ERR_INVALID_ARGUMENT, "not live", "second ddp_wait on the handle");

    /* back to back: the second call waits for the first; each file holds its own call's data */
    free_set(&s);
    make_set(&s, 400);
    CHECK_OK(ddp_checkpoint_save_async(NULL, at("b1.safetensors"), s.t, s.n, NULL, &w), NULL);
    scribble(&s);
    CHECK_OK(ddp_checkpoint_save_async(NULL, at("b2.safetensors"), s.t, s.n, NULL, &w2), NULL);
    CHECK_OK(ddp_wait(w2), NULL);
    CHECK_OK(ddp_wait(w), NULL);
    blank_like(&back, &s);
    CHECK_OK(ddp_checkpoint_load(NULL, at("b2.safetensors"), back.t, back.n, NULL), NULL);
    same_data(&s, &back, s.n);
    free_set(&s);
    make_set(&s, 400);
    CHECK_OK(ddp_checkpoint_load(NULL, at("b1.safetensors"), back.t, back.n, NULL), NULL);
    same_data(&s, &back, s.n);
    free_set(&back);

    /* keep_last through the _ex form */
    memset(&sd, 0, sizeof sd);
    sd.keep_last = 2;
    for (k = 1; k <= 4; k++) {
        snprintf(name, sizeof name, "arot_%06d.safetensors", k);
        CHECK_OK(ddp_checkpoint_save_async_ex(NULL, at(name), s.t, 2, NULL, &sd, &w), NULL);
        CHECK_OK(ddp_wait(w), NULL);
    }
    CHECK(count_files("arot_") == 2 && exists(at("arot_000003.safetensors")) && exists(at("arot_000004.safetensors")),
          "async keep_last 2 left %d files", count_files("arot_"));

    /* errors of the background come back from ddp_wait */
    CHECK_OK(ddp_checkpoint_save_async(NULL, "/nonexistent-dir-ddp/c.safetensors", s.t, s.n, NULL, &w), NULL);
    expect_err(ddp_wait(w), DDP_ERR_IO, "/nonexistent-dir-ddp/c.safetensors.tmp", "async save into a missing directory");
    CHECK(strstr(ddp_last_error(NULL), "No such file or directory"), "no errno text: %s", ddp_last_error(NULL));
    snprintf(blocker, sizeof blocker, "%s.tmp", at("blocked.safetensors"));
    CHECK(mkdir(blocker, 0700) == 0, "mkdir %s", blocker);
    CHECK_OK(ddp_checkpoint_save_async(NULL, at("blocked.safetensors"), s.t, s.n, NULL, &w), NULL);
    expect_err(ddp_wait(w), DDP_ERR_IO, "Is a directory", "async save with a directory in the way");
    CHECK(!exists(at("blocked.safetensors")), "a failed save left a file");
    rmdir(blocker);
    {
        ddp_tensor bad = s.t[0];
        bad.dtype = (ddp_dtype)42;
        CHECK_OK(ddp_checkpoint_save_async(NULL, at("bad.safetensors"), &bad, 1, NULL, &w), NULL);
        expect_err(ddp_wait(w), DDP_ERR_INVALID_ARGUMENT, "invalid dtype", "async save of a bad tensor");
    }
    expect_err(ddp_checkpoint_save_async(NULL, at("x.safetensors"), s.t, s.n, NULL, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL", "w NULL");
    /* a sync call while an async save is in flight waits for it: the load sees the whole file */
    CHECK_OK(ddp_checkpoint_save_async(NULL, at("inflight.safetensors"), s.t, s.n, NULL, &w), NULL);
    blank_like(&back, &s);
    CHECK_OK(ddp_checkpoint_load(NULL, at("inflight.safetensors"), back.t, back.n, NULL), NULL);
    same_data(&s, &back, s.n);
    CHECK(ddp_test(w), "the load returned but the save is not done");
    CHECK_OK(ddp_wait(w), NULL);
    free_set(&back);
    ddp_meta_free(&m);
    free_set(&s);
    printf("async save: ok (%d polls of ddp_test)\n", polls);
}

int main(void) {
    snprintf(dir, sizeof dir, "%s/ckpt_test_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir), "mkdtemp");
    test_crc();
    test_meta();
    test_round_trip();
    test_mismatch();
    test_malformed();
    test_corruption();
    test_rotation();
    test_shards();
    test_async();
    rm_rf(dir);
    printf("all checkpoint tests passed\n");
    return 0;
}
