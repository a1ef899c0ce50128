/* The ddp.h side of tests/test_interop_checkpoint.sh: writes and reads the sample that
   tests/interop/safetensors_io.py describes (same names, dtypes, shapes, value formula, metadata).
     safetensors_helper write FILE          save the sample with ddp_checkpoint_save
     safetensors_helper read FILE           load FILE (from Python) and compare every byte and key;
                                            ddp_checkpoint_list gives the sample's names, dtypes and
                                            shapes (in any order) and its metadata
     safetensors_helper read-nocrc FILE     the same for a file without checksums: plain
                                            ddp_checkpoint_load reads it, require_checksums refuses it
     safetensors_helper list-ordered FILE   ddp_checkpoint_list gives the sample in its own order (the
                                            order safetensors_io.py's header lists it; its data is in
                                            reverse order)
     safetensors_helper expect-corrupt FILE loading must fail with DDP_ERR_FORMAT (bad checksum) */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAIL(...) (fprintf(stderr, "safetensors_helper: " __VA_ARGS__), fprintf(stderr, "\n"), exit(1))

typedef struct sample {
    const char *name;
    ddp_dtype dtype;
    int ndim;
    int64_t shape[8];
} sample;

static const sample SAMPLE[] = {
    {"f32", DDP_F32, 2, {3, 4}},
    {"f64", DDP_F64, 1, {5}},
    {"f16", DDP_F16, 2, {2, 3}},
    {"bf16", DDP_BF16, 1, {7}},
    {"i8", DDP_I8, 1, {300}},
    {"u8", DDP_U8, 3, {2, 2, 2}},
    {"i32", DDP_I32, 1, {6}},
    {"i64", DDP_I64, 1, {4}},
    {"scalar", DDP_F32, 0, {0}},
    {"empty", DDP_F16, 2, {0, 3}},
    {"unicode \xc3\xa9 \xe2\x9c\x93 \"q\"", DDP_I32, 1, {2}},
    {"eight_d", DDP_U8, 8, {1, 2, 1, 2, 1, 2, 1, 2}},
};
#define NS ((int)(sizeof SAMPLE / sizeof SAMPLE[0]))
static const char *NOTE = "caf\xc3\xa9 \"quoted\" back\\slash\n\ttab \xe2\x9c\x93 \xf0\x9f\x98\x80";
static const unsigned char RNG[6] = {0x00, 0xff, 0x10, 0xab, 0x7f, 0x80};

static size_t numel(const sample *s) {
    size_t n = 1;
    int i;
    for (i = 0; i < s->ndim; i++) n *= (size_t)s->shape[i];
    return n;
}

/* Element i of sample tensor k, encoded (the formula of safetensors_io.sample_value). */
static void encode(int k, ddp_dtype t, size_t i, unsigned char *out) {
    uint64_t u;
    if (t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16) {
        double v = i == 1 ? HUGE_VAL : i == 2 ? -0.0 : (double)((long)((i * 7 + (size_t)k * 3) % 23) - 11) * 0.25;
        float f = (float)v;
        uint32_t bits;
        uint16_t h;
        memcpy(&bits, &f, 4);
        if (t == DDP_F32) memcpy(out, &f, 4);
        if (t == DDP_F64) memcpy(out, &v, 8);
        if (t == DDP_F16) h = ddp_f32_to_f16(f), memcpy(out, &h, 2);
        if (t == DDP_BF16) h = (uint16_t)(bits >> 16), memcpy(out, &h, 2);
        return;
    }
    if (t == DDP_I8) out[0] = (unsigned char)((int)((i * 37 + (size_t)k) % 256) - 128);
    if (t == DDP_U8) out[0] = (unsigned char)((i * 37 + (size_t)k) % 256);
    if (t == DDP_I32) {
        uint32_t v = (uint32_t)((uint64_t)i * 2654435761u + (uint64_t)k);
        memcpy(out, &v, 4);
    }
    if (t == DDP_I64) {
        u = (uint64_t)i * 0x9E3779B97F4A7C15ull + (uint64_t)k;
        memcpy(out, &u, 8);
    }
}

static void make(ddp_tensor *t, int fill) {
    int k, d;
    for (k = 0; k < NS; k++) {
        size_t es = ddp_dtype_size(SAMPLE[k].dtype), n = numel(&SAMPLE[k]), i;
        memset(&t[k], 0, sizeof t[k]);
        t[k].name = SAMPLE[k].name;
        t[k].dtype = SAMPLE[k].dtype;
        t[k].ndim = SAMPLE[k].ndim;
        for (d = 0; d < t[k].ndim; d++) t[k].shape[d] = SAMPLE[k].shape[d];
        t[k].data = calloc(n ? n : 1, es);
        for (i = 0; fill && i < n; i++) encode(k, t[k].dtype, i, (unsigned char *)t[k].data + i * es);
    }
}

static void expected_meta(ddp_meta *m) {
    ddp_resume_state rs;
    memset(&rs, 0, sizeof rs);
    rs.step = 1234;
    rs.epoch = 3;
    rs.sampler_position = 96;
    rs.world_size = 4;
    rs.rng_state = (void *)RNG;
    rs.rng_state_size = sizeof RNG;
    if (ddp_meta_set_resume(m, &rs) || ddp_meta_set(m, "note", NOTE) || ddp_meta_set(m, "empty value", ""))
        FAIL("meta: %s", ddp_last_error(NULL));
}

static void compare(ddp_tensor *got, const ddp_meta *meta) {
    ddp_tensor want[NS];
    ddp_meta m = {0, 0, 0};
    ddp_resume_state rs;
    unsigned char rng[16];
    int k, i;
    make(want, 1);
    for (k = 0; k < NS; k++) {
        size_t bytes = numel(&SAMPLE[k]) * ddp_dtype_size(SAMPLE[k].dtype);
        if (memcmp(got[k].data, want[k].data, bytes) != 0) FAIL("tensor \"%s\" differs from the formula", SAMPLE[k].name);
        free(want[k].data);
    }
    expected_meta(&m);
    if (meta->count != m.count) FAIL("metadata has %d keys, expected %d", meta->count, m.count);
    for (i = 0; i < m.count; i++) {
        const char *v = ddp_meta_get(meta, m.entries[i].key);
        if (!v || strcmp(v, m.entries[i].value) != 0) FAIL("metadata \"%s\" = \"%s\", expected \"%s\"", m.entries[i].key, v ? v : "(none)", m.entries[i].value);
    }
    memset(&rs, 0, sizeof rs);
    rs.rng_state = rng;
    rs.rng_state_size = sizeof rng;
    if (ddp_meta_get_resume(meta, &rs) || rs.step != 1234 || rs.epoch != 3 || rs.sampler_position != 96 || rs.world_size != 4 ||
        rs.rng_state_size != sizeof RNG || memcmp(rng, RNG, sizeof RNG) != 0)
        FAIL("resume state: %s", ddp_last_error(NULL));
    ddp_meta_free(&m);
}

/* ddp_checkpoint_list of FILE: the sample's tensors, each once (in the sample's order when ordered),
   data NULL, and the sample's metadata. */
static void check_list(const char *path, int ordered) {
    ddp_tensor *lt = NULL;
    ddp_meta m = {0, 0, 0};
    int n = 0, k, j, d;
    if (ddp_checkpoint_list(path, &lt, &n, &m) != DDP_SUCCESS) FAIL("list: %s", ddp_last_error(NULL));
    if (n != NS) FAIL("list: %d tensors, the sample has %d", n, NS);
    for (k = 0; k < NS; k++) {
        for (j = 0; j < n && strcmp(lt[j].name, SAMPLE[k].name) != 0; j++) {
        }
        if (j == n) FAIL("list: no tensor \"%s\"", SAMPLE[k].name);
        if (ordered && j != k) FAIL("list: \"%s\" is entry %d, the header lists it as %d", SAMPLE[k].name, j, k);
        if (lt[j].dtype != SAMPLE[k].dtype || lt[j].ndim != SAMPLE[k].ndim || lt[j].data)
            FAIL("list: \"%s\" has dtype %s, %d dims", SAMPLE[k].name, ddp_dtype_name(lt[j].dtype), lt[j].ndim);
        for (d = 0; d < SAMPLE[k].ndim; d++)
            if (lt[j].shape[d] != SAMPLE[k].shape[d]) FAIL("list: \"%s\" dimension %d is %lld", SAMPLE[k].name, d, (long long)lt[j].shape[d]);
    }
    if (!ddp_meta_get(&m, "note") || strcmp(ddp_meta_get(&m, "note"), NOTE) != 0) FAIL("list: the metadata lacks the note");
    ddp_checkpoint_list_free(lt, n);
    ddp_meta_free(&m);
}

static void free_all(ddp_tensor *t) {
    int k;
    for (k = 0; k < NS; k++) free(t[k].data);
}

int main(int argc, char **argv) {
    ddp_tensor t[NS];
    ddp_meta m = {0, 0, 0};
    ddp_checkpoint_load_desc d;
    ddp_result r;
    if (argc != 3) FAIL("usage: %s write|read|read-nocrc|list-ordered|expect-corrupt FILE", argv[0]);
    memset(&d, 0, sizeof d);
    if (strcmp(argv[1], "write") == 0) {
        make(t, 1);
        expected_meta(&m);
        if (ddp_checkpoint_save(NULL, argv[2], t, NS, &m) != DDP_SUCCESS) FAIL("save: %s", ddp_last_error(NULL));
        printf("ddp.h wrote %s\n", argv[2]);
    } else if (strcmp(argv[1], "read") == 0 || strcmp(argv[1], "read-nocrc") == 0) {
        make(t, 0);
        if (strcmp(argv[1], "read-nocrc") == 0) {
            d.require_checksums = 1;
            r = ddp_checkpoint_load_ex(NULL, argv[2], t, NS, &m, &d);
            if (r != DDP_ERR_FORMAT || !strstr(ddp_last_error(NULL), "require_checksums"))
                FAIL("a file without checksums was not refused with require_checksums: %s", ddp_last_error(NULL));
        }
        if (ddp_checkpoint_load(NULL, argv[2], t, NS, &m) != DDP_SUCCESS) FAIL("load: %s", ddp_last_error(NULL));
        compare(t, &m);
        check_list(argv[2], 0);
        printf("ddp.h read %s: %d tensors and %d metadata keys equal; listed alike\n", argv[2], NS, m.count);
    } else if (strcmp(argv[1], "list-ordered") == 0) {
        make(t, 0);
        check_list(argv[2], 1);
        printf("ddp.h listed %s: %d tensors in the header's order\n", argv[2], NS);
    } else if (strcmp(argv[1], "expect-corrupt") == 0) {
        make(t, 0);
        r = ddp_checkpoint_load(NULL, argv[2], t, NS, &m);
        if (r != DDP_ERR_FORMAT || !strstr(ddp_last_error(NULL), "corrupt")) FAIL("corrupt file: got %s: %s", ddp_result_string(r), ddp_last_error(NULL));
        printf("ddp.h refused %s: %s\n", argv[2], ddp_last_error(NULL));
    } else {
        FAIL("unknown command %s", argv[1]);
    }
    free_all(t);
    ddp_meta_free(&m);
    return 0;
}
