/* Checkpoints without a group (a single process): round trip of every dtype (f16/bf16, 0-d, empty,
   8-d), the file layout read back by hand, metadata and resume state (the global sample position too),
   strict header parsing (a table of malformed headers, every truncation, every corrupted byte),
   mismatches named, keep_last rotation (19- and 20-digit names beside it are passed over, with no UBSan
   report), ddp_checkpoint_latest, per-rank shards and their completion marker (rotation removes a larger
   group's shards too), slices (two overlapping ones refused at save, a hole and an old file's overlap
   named at load). Files laid out as safetensors.torch.save_file writes them (no checksums) load by
   default and require_checksums refuses them; truncated or inconsistent ones and wrong checksums are
   refused. ddp_checkpoint_list: the header's order, every dtype and shape, metadata, and the load's
   verdict on every malformed header. Async save: the file is byte-identical to the synchronous save
   although the tensors are overwritten right after the call; keep_last; errors come from ddp_wait. */
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

/* crc: 0 the default (checksums verified where present), 1 allow_missing_checksums (the old flag, now
   the default: changes nothing), 2 require_checksums, 3 both (a contradiction) */
static ddp_result load_opts(const char *p, ddp_tensor *t, int n, ddp_meta *m, int unexpected, int crc) {
    ddp_checkpoint_load_desc d;
    memset(&d, 0, sizeof d);
    d.allow_unexpected = unexpected;
    d.allow_missing_checksums = crc & 1;
    d.require_checksums = (crc & 2) != 0;
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
        { /* the header-only listing is as strict: the same verdict, the same message */
            static ddp_tensor sentinel;
            ddp_tensor *lt = &sentinel; /* a failed list must set it to NULL */
            int ln = -1;
            r = ddp_checkpoint_list(p, &lt, &ln, NULL);
            if (!cases[i].needle && strstr(cases[i].json, "[1,1,1,1,1,1,1,1,1,2]")) /* 10 dims: loadable only when skipped */
                expect_err(r, DDP_ERR_UNSUPPORTED, "10 dimensions", cases[i].json);
            else if (!cases[i].needle) CHECK(r == DDP_SUCCESS && lt, "list case %zu %s: %s", i, cases[i].json, ddp_last_error(NULL));
            else expect_err(r, DDP_ERR_FORMAT, cases[i].needle, cases[i].json);
            if (r != DDP_SUCCESS) CHECK(!lt && ln == 0, "a failed list left %p, %d", (void *)lt, ln);
            ddp_checkpoint_list_free(lt, ln);
        }
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
    /* checksums: a missing one loads (another writer's file) unless required; a malformed or wrong one is
       refused always */
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
        CHECK_OK(load_opts(p, &t, 1, NULL, 0, 0), NULL);
        CHECK_OK(load_opts(p, &t, 1, NULL, 0, 1), NULL);
        expect_err(load_opts(p, &t, 1, NULL, 0, 2), DDP_ERR_FORMAT, "no ddp.crc32c. checksum and require_checksums", "missing checksum required");
        expect_err(load_opts(p, &t, 1, NULL, 0, 3), DDP_ERR_INVALID_ARGUMENT, "both set", "require and allow_missing");
        write_raw(p, "{\"__metadata__\":{\"ddp.crc32c.a\":\"xyz\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
        expect_err(load_opts(p, &t, 1, NULL, 0, 0), DDP_ERR_FORMAT, "not 8 hex digits", "malformed checksum");
        expect_err(load_opts(p, &t, 1, NULL, 0, 1), DDP_ERR_FORMAT, "not 8 hex digits", "malformed checksum (allow_missing)");
        write_raw(p, "{\"__metadata__\":{\"ddp.crc32c.a\":\"00000001\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
        expect_err(load_opts(p, &t, 1, NULL, 0, 0), DDP_ERR_FORMAT, "is corrupt", "wrong checksum");
        expect_err(load_opts(p, &t, 1, NULL, 0, 1), DDP_ERR_FORMAT, "is corrupt", "wrong checksum (allow_missing)");
    }
    printf("malformed headers: %zu cases ok\n", sizeof cases / sizeof cases[0]);
}

/* ---- files from other writers, and ddp_checkpoint_list (issue #35) ----
   An independent safetensors writer laying a file out as the Rust safetensors crate behind
   safetensors.torch.save_file does (safetensors/src/tensor.rs, prepare() and Metadata's Serialize):
   the tensors sorted by its Dtype enum (declared in increasing alignment: BOOL U8 I8 F8_E5M2 F8_E4M3
   I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64), last first, then by name; the header lists them in that
   order, "__metadata__" first and only when there is metadata; the data back to back; compact JSON
   padded with spaces to a multiple of 8 bytes; no ddp.crc32c keys (unless asked for, to test files
   that carry some). The data byte at offset k of the data section is (k * 37 + 11) & 0xFF. */
typedef struct foreign {
    const char *name, *st; /* safetensors dtype name */
    size_t size;           /* bytes per element */
    ddp_dtype dt;
    int ndim;
    int64_t shape[8];
} foreign;

#define NF 8
static const foreign FOREIGN[NF] = {
    {"w", "F32", 4, DDP_F32, 2, {2, 3}},  {"b", "F64", 8, DDP_F64, 1, {3}},        {"step", "I64", 8, DDP_I64, 0, {0}},
    {"e", "F16", 2, DDP_F16, 2, {0, 4}},  {"m", "U8", 1, DDP_U8, 1, {5}},          {"h", "BF16", 2, DDP_BF16, 1, {2}},
    {"i", "I32", 4, DDP_I32, 2, {1, 1}},  {"z", "I8", 1, DDP_I8, 3, {2, 0, 1}},
};
/* the writer's order, worked out by hand from the rule above */
static const char *const FOREIGN_ORDER[NF] = {"step", "b", "w", "i", "h", "e", "z", "m"};

static size_t foreign_bytes(const foreign *f) {
    size_t n = f->size;
    int d;
    for (d = 0; d < f->ndim; d++) n *= (size_t)f->shape[d];
    return n;
}

static int crate_dtype_rank(const char *st) {
    static const char *const order[] = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"};
    int i;
    for (i = 0; i < (int)(sizeof order / sizeof order[0]); i++)
        if (!strcmp(order[i], st)) return i;
    return -1;
}

static int cmp_foreign(const void *a, const void *b) {
    const foreign *x = *(const foreign *const *)a, *y = *(const foreign *const *)b;
    int rx = crate_dtype_rank(x->st), ry = crate_dtype_rank(y->st);
    if (rx != ry) return rx > ry ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The file image (malloc'd, *size bytes); offs[i] receives FOREIGN[i]'s data offset. meta_json: the
   members of "__metadata__" (NULL: none). crc: 0 no checksums (as torch writes), 1 one per tensor,
   2 one per tensor with w's wrong, 3 for every other tensor in the file's order only. grow: bytes the
   header claims for m beyond what the file holds (its shape and the later offsets grow with it). */
static unsigned char *foreign_image(const char *meta_json, int crc, int grow, size_t *offs, size_t *size) {
    const foreign *order[NF];
    char json[4096];
    size_t len = 0, at = 0, data_len = 0, hpad, i, k;
    unsigned char *img, data[256];
    int d, first = 1;
    for (i = 0; i < NF; i++) order[i] = &FOREIGN[i];
    qsort((void *)order, NF, sizeof order[0], cmp_foreign);
    for (i = 0; i < NF; i++) data_len += foreign_bytes(order[i]);
    CHECK(data_len <= sizeof data, "foreign data too large");
    for (k = 0; k < data_len; k++) data[k] = (unsigned char)(k * 37 + 11);
    len += (size_t)snprintf(json + len, sizeof json - len, "{");
    if (meta_json || crc) {
        len += (size_t)snprintf(json + len, sizeof json - len, "\"__metadata__\":{%s", meta_json ? meta_json : "");
        first = !meta_json || !*meta_json;
        for (i = 0, at = 0; crc && i < NF; at += foreign_bytes(order[i]), i++) {
            uint32_t c = ref_crc32c(data + at, foreign_bytes(order[i]));
            if (crc == 3 && i % 2) continue;
            if (crc == 2 && !strcmp(order[i]->name, "w")) c ^= 1;
            len += (size_t)snprintf(json + len, sizeof json - len, "%s\"ddp.crc32c.%s\":\"%08x\"", first ? "" : ",", order[i]->name, (unsigned)c);
            first = 0;
        }
        len += (size_t)snprintf(json + len, sizeof json - len, "},");
    }
    for (i = 0, at = 0; i < NF; i++) {
        const foreign *f = order[i];
        int64_t d0 = f->shape[0] + (!strcmp(f->name, "m") ? grow : 0);
        size_t bytes = foreign_bytes(f) + (!strcmp(f->name, "m") ? (size_t)grow : 0);
        offs[f - FOREIGN] = at;
        len += (size_t)snprintf(json + len, sizeof json - len, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", f->name, f->st);
        for (d = 0; d < f->ndim; d++) len += (size_t)snprintf(json + len, sizeof json - len, d ? ",%lld" : "%lld", (long long)(d ? f->shape[d] : d0));
        len += (size_t)snprintf(json + len, sizeof json - len, "],\"data_offsets\":[%zu,%zu]}", at, at + bytes);
        at += bytes;
    }
    len += (size_t)snprintf(json + len, sizeof json - len, "}");
    hpad = (8 - (8 + len) % 8) % 8;
    CHECK(len + hpad < sizeof json, "foreign header too long");
    memset(json + len, ' ', hpad);
    len += hpad;
    *size = 8 + len + data_len;
    img = (unsigned char *)malloc(*size);
    for (i = 0; i < 8; i++) img[i] = (unsigned char)((uint64_t)len >> (8 * i));
    memcpy(img + 8, json, len);
    memcpy(img + 8 + len, data, data_len);
    return img;
}

/* Buffers for FOREIGN, in the table's order (not the file's): what a program expecting them lists. */
static void foreign_tensors(ddp_tensor *t) {
    int i;
    for (i = 0; i < NF; i++) {
        memset(&t[i], 0, sizeof t[i]);
        t[i].name = FOREIGN[i].name;
        t[i].dtype = FOREIGN[i].dt;
        t[i].ndim = FOREIGN[i].ndim;
        memcpy(t[i].shape, FOREIGN[i].shape, sizeof t[i].shape);
        t[i].data = calloc(1, foreign_bytes(&FOREIGN[i]) + 1);
    }
}

/* t[i] (FOREIGN[i]'s buffer) holds the bytes the writer put at offs[i] */
static void foreign_check_data(const ddp_tensor *t, const size_t *offs) {
    int i;
    size_t k;
    for (i = 0; i < NF; i++)
        for (k = 0; k < foreign_bytes(&FOREIGN[i]); k++)
            CHECK(((const unsigned char *)t[i].data)[k] == (unsigned char)((offs[i] + k) * 37 + 11), "tensor %s byte %zu", FOREIGN[i].name, k);
}

static void foreign_free(ddp_tensor *t) {
    int i;
    for (i = 0; i < NF; i++) free(t[i].data);
}

static void test_foreign(void) {
    char p[512], q[512];
    unsigned char *img;
    size_t size, i, offs[NF];
    ddp_tensor t[NF];
    ddp_meta got = {0, 0, 0};
    snprintf(p, sizeof p, "%s", at("foreign.safetensors"));
    snprintf(q, sizeof q, "%s", at("foreign_cut.safetensors"));
    foreign_tensors(t);

    /* as torch writes it (no checksums): plain load reads it; require_checksums refuses it */
    img = foreign_image("\"format\":\"pt\"", 0, 0, offs, &size);
    write_file(p, img, size);
    CHECK_OK(ddp_checkpoint_load(NULL, p, t, NF, &got), NULL);
    foreign_check_data(t, offs);
    CHECK(got.count == 1 && strcmp(ddp_meta_get(&got, "format"), "pt") == 0, "metadata of a torch file (count %d)", got.count);
    CHECK_OK(load_opts(p, t, NF, NULL, 0, 1), NULL); /* the old flag: still compiles, changes nothing */
    expect_err(load_opts(p, t, NF, NULL, 0, 2), DDP_ERR_FORMAT, "require_checksums", "require_checksums on a torch file");
    {
        ddp_checkpoint_load_desc d;
        memset(&d, 0, sizeof d);
        d.broadcast = 1; /* without a group this is the local path: the same verdicts */
        CHECK_OK(ddp_checkpoint_load_ex(NULL, p, t, NF, NULL, &d), NULL);
        d.require_checksums = 1;
        expect_err(ddp_checkpoint_load_ex(NULL, p, t, NF, NULL, &d), DDP_ERR_FORMAT, "require_checksums", "require_checksums (broadcast desc)");
    }
    /* truncated anywhere, or one byte too many: refused, by the load and by the listing */
    for (i = 0; i < size; i++) {
        ddp_tensor *lt = NULL;
        int ln = 0;
        write_file(q, img, i);
        expect_err(ddp_checkpoint_load(NULL, q, t, NF, NULL), DDP_ERR_FORMAT, NULL, "truncated torch file");
        expect_err(ddp_checkpoint_list(q, &lt, &ln, NULL), DDP_ERR_FORMAT, NULL, "list of a truncated torch file");
    }
    {
        unsigned char *longer = (unsigned char *)malloc(size + 1);
        memcpy(longer, img, size);
        longer[size] = 0;
        write_file(q, longer, size + 1);
        expect_err(ddp_checkpoint_load(NULL, q, t, NF, NULL), DDP_ERR_FORMAT, "trailing bytes", "torch file with a trailing byte");
        free(longer);
    }
    free(img);
    /* a header that claims one byte more for m than the file holds */
    img = foreign_image(NULL, 0, 1, offs, &size);
    write_file(q, img, size);
    expect_err(ddp_checkpoint_load(NULL, q, t, NF, NULL), DDP_ERR_FORMAT, "truncated", "offsets past the end of the file");
    expect_err(load_opts(q, NULL, 0, NULL, 1, 0), DDP_ERR_FORMAT, "truncated", "offsets past the end (nothing asked for)");
    free(img);

    /* checksums where present are verified: all right, one wrong, some missing */
    img = foreign_image(NULL, 1, 0, offs, &size);
    write_file(q, img, size);
    CHECK_OK(ddp_checkpoint_load(NULL, q, t, NF, NULL), NULL);
    CHECK_OK(load_opts(q, t, NF, NULL, 0, 2), NULL);
    foreign_check_data(t, offs);
    {
        size_t data_len = 0;
        for (i = 0; i < NF; i++) data_len += foreign_bytes(&FOREIGN[i]);
        img[size - data_len + offs[0] + 2] ^= 0x10; /* a bit of w's data (FOREIGN[0]) */
    }
    write_file(q, img, size);
    expect_err(ddp_checkpoint_load(NULL, q, t, NF, NULL), DDP_ERR_FORMAT, "\"w\" is corrupt", "flipped bit under a checksum");
    free(img);
    img = foreign_image(NULL, 2, 0, offs, &size);
    write_file(q, img, size);
    expect_err(ddp_checkpoint_load(NULL, q, t, NF, NULL), DDP_ERR_FORMAT, "\"w\" is corrupt", "wrong checksum");
    expect_err(load_opts(q, t, NF, NULL, 0, 1), DDP_ERR_FORMAT, "\"w\" is corrupt", "wrong checksum (allow_missing_checksums)");
    free(img);
    img = foreign_image(NULL, 3, 0, offs, &size);
    write_file(q, img, size);
    CHECK_OK(ddp_checkpoint_load(NULL, q, t, NF, NULL), NULL);
    foreign_check_data(t, offs);
    expect_err(load_opts(q, t, NF, NULL, 0, 2), DDP_ERR_FORMAT, "\"b\" has no ddp.crc32c. checksum", "some checksums, required");
    free(img);

    ddp_meta_free(&got);
    foreign_free(t);
    printf("files from other writers: ok (torch's layout loads without checksums; truncations and bad checksums refused)\n");
}

static void expect_listed(const ddp_tensor *lt, int ln, const ddp_tensor *want, int n, const char *what) {
    int i, d;
    CHECK(ln == n && lt, "%s: %d tensors listed, want %d", what, ln, n);
    for (i = 0; i < n; i++) {
        CHECK(strcmp(lt[i].name, want[i].name) == 0, "%s: tensor %d is \"%s\", want \"%s\"", what, i, lt[i].name, want[i].name);
        CHECK(lt[i].dtype == want[i].dtype && lt[i].ndim == want[i].ndim && lt[i].data == NULL, "%s: \"%s\" dtype %d ndim %d", what,
              lt[i].name, (int)lt[i].dtype, lt[i].ndim);
        for (d = 0; d < want[i].ndim; d++) CHECK(lt[i].shape[d] == want[i].shape[d], "%s: \"%s\" dim %d", what, lt[i].name, d);
    }
}

static void test_list(void) {
    char p[512];
    unsigned char *img;
    size_t size, offs[NF];
    ddp_tensor *lt = NULL, want[NF], t[NF];
    ddp_meta got = {0, 0, 0}, m = {0, 0, 0};
    int ln = 0, i, k;
    set s;
    snprintf(p, sizeof p, "%s", at("list.safetensors"));

    /* another writer's file: in the header's order, every dtype and shape (0-d, zero-length dims), the
       metadata without the library's keys */
    img = foreign_image("\"format\":\"pt\",\"note\":\"x\"", 1, 0, offs, &size);
    write_file(p, img, size);
    free(img);
    for (i = 0; i < NF; i++)
        for (k = 0; k < NF; k++)
            if (!strcmp(FOREIGN[k].name, FOREIGN_ORDER[i])) {
                memset(&want[i], 0, sizeof want[i]);
                want[i].name = FOREIGN[k].name;
                want[i].dtype = FOREIGN[k].dt;
                want[i].ndim = FOREIGN[k].ndim;
                memcpy(want[i].shape, FOREIGN[k].shape, sizeof want[i].shape);
            }
    CHECK_OK(ddp_meta_set(&got, "stale", "1"), NULL);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, &got), NULL);
    expect_listed(lt, ln, want, NF, "torch-layout file");
    CHECK(got.count == 2 && !strcmp(ddp_meta_get(&got, "format"), "pt") && !strcmp(ddp_meta_get(&got, "note"), "x"),
          "listed metadata (count %d)", got.count);
    /* the usage of checkpoint.h: size the buffers from the listing, then load */
    for (i = 0; i < ln; i++) {
        size_t count = 1;
        for (k = 0; k < lt[i].ndim; k++) count *= (size_t)lt[i].shape[k];
        lt[i].data = malloc(count * ddp_dtype_size(lt[i].dtype) + 1);
    }
    CHECK_OK(ddp_checkpoint_load(NULL, p, lt, ln, NULL), NULL);
    memset(t, 0, sizeof t);
    for (i = 0; i < NF; i++) /* in FOREIGN's order, to compare */
        for (k = 0; k < ln; k++)
            if (!strcmp(lt[k].name, FOREIGN[i].name)) t[i] = lt[k];
    foreign_check_data(t, offs);
    for (i = 0; i < ln; i++) free(lt[i].data);
    ddp_checkpoint_list_free(lt, ln);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, NULL), NULL); /* meta NULL */
    expect_listed(lt, ln, want, NF, "torch-layout file, meta NULL");
    ddp_checkpoint_list_free(lt, ln);

    /* a file ddp.h saved: the order of t[] at the save, every dtype, 0-d, an empty tensor, 8 dims */
    make_set(&s, 21);
    CHECK_OK(ddp_meta_set_int(&m, DDP_META_STEP, 7), NULL);
    CHECK_OK(ddp_checkpoint_save(NULL, p, s.t, s.n, &m), NULL);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, &got), NULL);
    expect_listed(lt, ln, s.t, s.n, "ddp.h file");
    CHECK(got.count == 1 && !strcmp(ddp_meta_get(&got, DDP_META_STEP), "7"), "listed metadata of a ddp.h file (count %d)", got.count);
    ddp_checkpoint_list_free(lt, ln);
    free_set(&s);

    /* the header's order, not the data's: three tensors at data offset 0, listed z, y, x */
    write_raw(p, "{\"z\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]},\"y\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]},"
                 "\"x\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", "ab", 2);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, NULL), NULL);
    CHECK(ln == 3 && !strcmp(lt[0].name, "z") && !strcmp(lt[1].name, "y") && !strcmp(lt[2].name, "x"), "header order");
    ddp_checkpoint_list_free(lt, ln);
    /* a dtype ddp.h cannot load: listed as DDP_DTYPE_DEFAULT with its shape */
    write_raw(p, "{\"b\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[0,3]},\"u\":{\"dtype\":\"U16\",\"shape\":[],\"data_offsets\":[3,5]}}",
              "abcde", 5);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, NULL), NULL);
    CHECK(ln == 2 && lt[0].dtype == DDP_DTYPE_DEFAULT && lt[0].ndim == 1 && lt[0].shape[0] == 3 && lt[1].dtype == DDP_DTYPE_DEFAULT &&
              lt[1].ndim == 0,
          "dtypes ddp.h lacks");
    ddp_checkpoint_list_free(lt, ln);
    /* no tensors: an empty, non-NULL array */
    write_raw(p, "{\"__metadata__\":{\"k\":\"v\"}}", NULL, 0);
    CHECK_OK(ddp_checkpoint_list(p, &lt, &ln, &got), NULL);
    CHECK(ln == 0 && lt && got.count == 1, "empty file: n %d", ln);
    ddp_checkpoint_list_free(lt, ln);

    /* bad files and arguments: the error, nothing returned, meta unchanged */
    write_raw(p, "{\"__metadata__\":{\"ddp.crc32c.a\":\"xyz\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", "01234567", 8);
    lt = want;
    expect_err(ddp_checkpoint_list(p, &lt, &ln, &got), DDP_ERR_FORMAT, "not 8 hex digits", "list: malformed checksum");
    CHECK(!lt && ln == 0 && got.count == 1 && !strcmp(ddp_meta_get(&got, "k"), "v"), "a failed list changed its outputs");
    write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", "0123456", 7);
    expect_err(ddp_checkpoint_list(p, &lt, &ln, &got), DDP_ERR_FORMAT, "truncated", "list: data shorter than the offsets");
    expect_err(ddp_checkpoint_list(at("absent.safetensors"), &lt, &ln, NULL), DDP_ERR_IO, "absent.safetensors", "list: missing file");
    expect_err(ddp_checkpoint_list(dir, &lt, &ln, NULL), DDP_ERR_IO, "not a regular file", "list: a directory");
    expect_err(ddp_checkpoint_list(NULL, &lt, &ln, NULL), DDP_ERR_INVALID_ARGUMENT, "path", "list: NULL path");
    expect_err(ddp_checkpoint_list(p, NULL, &ln, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL", "list: NULL tensors");
    expect_err(ddp_checkpoint_list(p, &lt, NULL, NULL), DDP_ERR_INVALID_ARGUMENT, "NULL", "list: NULL n");
    CHECK(got.count == 1, "a failed list changed meta");
    ddp_checkpoint_list_free(NULL, 3);
    ddp_meta_free(&got);
    ddp_meta_free(&m);
    printf("ddp_checkpoint_list: ok (header order, every dtype and shape, metadata, errors)\n");
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

static int count_files(const char *prefix) { return tl_count_files(dir, prefix, NULL); }

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
    /* runs of 19 and 20 digits are not members (issue #35: the digit count was checked after v * 10 + d,
       a signed overflow that UBSan reports in latest and in rotation): both pass them over */
    write_file(at("rot_9999999999999999999.safetensors"), "x", 1);
    write_file(at("rot_99999999999999999999.safetensors"), "x", 1);
    write_file(at("rot_9999999999999999999.safetensors.tmp"), "x", 1);
    CHECK_OK(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, sizeof latest, &num), NULL);
    CHECK(num == 9999, "latest beside 19- and 20-digit names: %lld", (long long)num);
    CHECK_OK(ddp_checkpoint_save_ex(NULL, at("rot_10000.safetensors"), s.t, 2, NULL, &sd), NULL);
    CHECK(!exists(at("rot_000500.safetensors")) && exists(at("rot_9999.safetensors")) && exists(at("rot_10000.safetensors")) &&
              exists(at("rot_9999999999999999999.safetensors")) && exists(at("rot_99999999999999999999.safetensors")) &&
              exists(at("rot_9999999999999999999.safetensors.tmp")),
          "keep_last 2 beside 19- and 20-digit names kept the wrong files");
    CHECK(count_files("rot_") == 7, "files left: %d", count_files("rot_"));
    CHECK_OK(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, sizeof latest, &num), NULL);
    CHECK(num == 10000, "latest %lld", (long long)num);
    expect_err(ddp_checkpoint_save_ex(NULL, at("rot_9999999999999999999.safetensors"), s.t, 2, NULL, &sd), DDP_ERR_INVALID_ARGUMENT,
               "1 to 18 digits", "keep_last with a 19-digit number");
    expect_err(ddp_checkpoint_save_ex(NULL, at("nodigits.safetensors"), s.t, 2, NULL, &sd), DDP_ERR_INVALID_ARGUMENT, "number in the file name", "keep_last without a number");
    expect_err(ddp_checkpoint_latest(at("rot.safetensors"), latest, sizeof latest, &num), DDP_ERR_INVALID_ARGUMENT, "one '*'", "pattern without *");
    expect_err(ddp_checkpoint_latest(at("rot_*.safetensors"), latest, 8, &num), DDP_ERR_INVALID_ARGUMENT, "too few", "small buffer");
    free_set(&s);
    printf("rotation and latest: ok\n");
}

/* Slices in one process (issue #35): two slices of one tensor that overlap are refused before anything
   is written, naming both ranges; a hole is named at load; a file of the old kind whose one shard holds
   two overlapping pieces (written here with ddp_checkpoint_save_shard and the slice names, as the old
   save_slices wrote it) names the range held twice. */
static void test_slices_single(void) {
    float w[10], back[10];
    ddp_slice s[2];
    ddp_tensor t[2];
    int i;
    for (i = 0; i < 10; i++) w[i] = (float)i * 1.5f;
    memset(s, 0, sizeof s);
    for (i = 0; i < 2; i++) s[i].name = "w", s[i].dtype = DDP_F32, s[i].global_count = 10;
    s[0].offset = 0, s[0].count = 6, s[0].data = w;
    s[1].offset = 4, s[1].count = 6, s[1].data = w + 4;
    expect_err(ddp_checkpoint_save_slices(NULL, at("sl_overlap.safetensors"), s, 2, NULL, NULL), DDP_ERR_INVALID_ARGUMENT,
               "rank 0 saves \"w\" [0, 6) and rank 0 saves \"w\" [4, 10)", "overlapping slices in one process");
    CHECK(!exists(at("sl_overlap.safetensors")) && !exists(at("sl_overlap.safetensors.rank0")), "a refused slice save wrote a file");
    s[1].offset = 6, s[1].count = 2, s[1].data = w + 6;
    CHECK_OK(ddp_checkpoint_save_slices(NULL, at("sl_holed.safetensors"), s, 2, NULL, NULL), NULL);
    memset(back, 0, sizeof back);
    s[0].count = 10, s[0].data = back;
    expect_err(ddp_checkpoint_load_slices(NULL, at("sl_holed.safetensors"), s, 1, NULL), DDP_ERR_MISMATCH,
               "lacks elements [8, 10) of \"w\"", "a hole at the end");
    s[0].count = 8;
    CHECK_OK(ddp_checkpoint_load_slices(NULL, at("sl_holed.safetensors"), s, 1, NULL), NULL);
    CHECK(memcmp(back, w, 8 * sizeof w[0]) == 0, "[0, 8) of the holed save");
    memset(t, 0, sizeof t);
    for (i = 0; i < 2; i++) t[i].dtype = DDP_F32, t[i].ndim = 1, t[i].shape[0] = 6;
    t[0].name = "w@0/10", t[0].data = w;
    t[1].name = "w@4/10", t[1].data = w + 4;
    CHECK_OK(ddp_checkpoint_save_shard(NULL, at("sl_old.safetensors"), t, 2, NULL, NULL), NULL);
    s[0].count = 10;
    expect_err(ddp_checkpoint_load_slices(NULL, at("sl_old.safetensors"), s, 1, NULL), DDP_ERR_FORMAT,
               "holds elements [4, 6) of \"w\" twice, in the shard of rank 0", "an old file with overlapping pieces");
    printf("slices in one process: overlap refused at save, a hole and an old overlap named at load\n");
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
    { /* ddp.h's shards carry every checksum: require_checksums loads them */
        ddp_checkpoint_load_desc d;
        memset(&d, 0, sizeof d);
        d.require_checksums = 1;
        CHECK_OK(ddp_checkpoint_load_shard(NULL, p, back.t, 4, NULL, &d), NULL);
    }
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
    /* keep_last deletes old markers and shards together, the shards of a larger group's ranks too (a
       resume on fewer ranks, issue #35); a ".rank" with more digits than an int is no shard name */
    memset(&sd, 0, sizeof sd);
    sd.keep_last = 1;
    write_file(at("opt_000010.safetensors.rank7"), "x", 1);
    write_file(at("opt_000010.safetensors.rank3.tmp"), "x", 1);
    write_file(at("opt_000010.safetensors.rank99999999999"), "x", 1);
    CHECK_OK(ddp_checkpoint_save_shard(NULL, at("opt_000020.safetensors"), s.t, 4, &m, &sd), NULL);
    CHECK(!exists(p) && !exists(shard) && exists(at("opt_000020.safetensors")) && exists(at("opt_000020.safetensors.rank0")), "shard rotation");
    CHECK(!exists(at("opt_000010.safetensors.rank7")) && !exists(at("opt_000010.safetensors.rank3.tmp")) &&
              exists(at("opt_000010.safetensors.rank99999999999")),
          "shard rotation of a larger group's shards");
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
    test_foreign();
    test_list();
    test_corruption();
    test_rotation();
    test_shards();
    test_slices_single();
    test_async();
    tl_rm_dir(dir);
    printf("all checkpoint tests passed\n");
    return 0;
}
