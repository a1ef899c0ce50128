/* libFuzzer target for the checkpoint reader: every input is tried (1) as a whole safetensors file
   image (length prefix, header, layout, checksums) and (2) as bare header JSON. Nothing may crash, leak
   or trip the sanitizers, and every refusal must be DDP_ERR_FORMAT (or DDP_ERR_OUT_OF_MEMORY).
   Build and bounded run: tests/test_fuzz_checkpoint.sh. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_code(ddp_result r, const char *err) {
    if (r != DDP_SUCCESS && r != DDP_ERR_FORMAT && r != DDP_ERR_OUT_OF_MEMORY) {
        fprintf(stderr, "unexpected result %d: %s\n", (int)r, err);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[DDP__ERR_MAX];
    ddp__ck_header h;
    ddp_result r;
    int i;
    err[0] = '\0';
    check_code(ddp__ck_check_image(data, size, err), err);
    /* bare JSON: the data section is taken to be exactly what the entries claim */
    r = ddp__ck_parse((const char *)data, size, 0, &h, err);
    check_code(r, err);
    if (r == DDP_SUCCESS) {
        for (i = 0; i < h.n; i++) {
            uint32_t crc;
            if (ddp__ck_lookup(&h, h.e[i].name) != &h.e[i] || h.e[i].end != h.e[i].begin) abort();
            (void)ddp__ck_stored_crc(&h, h.e[i].name, &crc);
        }
        for (i = 0; i < h.meta.count; i++) {
            int64_t v;
            unsigned char buf[16];
            size_t n;
            if (!ddp__ck_header_meta(&h, h.meta.entries[i].key)) abort();
            (void)ddp_meta_get_int(&h.meta, h.meta.entries[i].key, &v);
            (void)ddp_meta_get_bytes(&h.meta, h.meta.entries[i].key, buf, sizeof buf, &n);
        }
        ddp__ck_header_free(&h);
    }
    return 0;
}
