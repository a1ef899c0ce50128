/* Private names shared by safetensors.c (the format) and checkpoint.c (the policy), after internal.h:
   the limits and reserved key prefixes of the format, the dtype table, the parsed header, the writer's
   buffer, and what checkpoint.c calls in safetensors.c. (To be folded into internal.h.) */

#define DDP__CK_MAX_HEADER 100000000ull         /* bytes of JSON header, as the safetensors crate allows */
#define DDP__CK_CRC_PREFIX "ddp.crc32c."        /* __metadata__ keys that are the library's */
#define DDP__CK_SHARD_PREFIX "ddp.shard."

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

/* A parsed header (ddp__ck_parse); the caller frees it with ddp__ck_header_free. */
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

/* A growing string: the JSON header being written. oom is set once an allocation failed. */
typedef struct ddp__ck_buf {
    char *p;
    size_t len, cap;
    int oom;
} ddp__ck_buf;

/* ---- safetensors.c ---- */
static DDP__UNUSED int ddp__ck_little_endian(void);
/* Running CRC32C register (start with 0xFFFFFFFF, finish with ~) over n more bytes. use_hw: 1 to take
   the instruction when the CPU has it (0 is for the tests). */
static DDP__UNUSED uint32_t ddp__ck_crc_update(uint32_t reg, const void *data, size_t n, int use_hw);
static DDP__UNUSED uint32_t ddp__ck_crc32c(const void *data, size_t n, int use_hw);
static DDP__UNUSED int ddp__ck_utf8_valid(const char *s); /* strict RFC 3629 */
/* Append key and value (taken over) to m without looking for an existing key. */
static DDP__UNUSED ddp_result ddp__ck_meta_append(ddp_meta *m, char *key, char *value);
static DDP__UNUSED const char *ddp__ck_st_name(ddp_dtype t); /* "F32", ...; "?" for none */
static DDP__UNUSED void ddp__ck_header_free(ddp__ck_header *h);
/* Parse len bytes of header JSON for a file with data_len bytes after the header. On error h is freed
   and err (DDP__ERR_MAX bytes) says what is wrong. */
static DDP__UNUSED ddp_result ddp__ck_parse(const char *json, size_t len, uint64_t data_len, ddp__ck_header *h, char *err);
/* The 8-byte little-endian header length of a file of file_size bytes. */
static DDP__UNUSED ddp_result ddp__ck_prefix(const unsigned char *b, uint64_t file_size, uint64_t *hlen, char *err);
static DDP__UNUSED ddp__ck_entry *ddp__ck_lookup(const ddp__ck_header *h, const char *name); /* NULL if absent */
static DDP__UNUSED const char *ddp__ck_header_meta(const ddp__ck_header *h, const char *key); /* NULL if absent */
/* The stored checksum of tensor name: 1 found (in *crc), 0 absent, -1 malformed. */
static DDP__UNUSED int ddp__ck_stored_crc(const ddp__ck_header *h, const char *name, uint32_t *crc);
/* For the fuzz target and the tests: check a whole file image in memory. */
static DDP__UNUSED ddp_result ddp__ck_check_image(const unsigned char *buf, size_t size, char *err);
static DDP__UNUSED char *ddp__ck_cat(const char *a, const char *b); /* a new string a + b; NULL out of memory */
static DDP__UNUSED int ddp__ck_tensor_bytes(const ddp_tensor *t, uint64_t *bytes); /* 0: invalid or overflow */
static DDP__UNUSED int ddp__ck_reserved(const char *key); /* a key of the library's (ddp.crc32c.*, ddp.shard.*) */
/* The JSON header of t[0..n) with metadata user and extra, into b; on error err (DDP__ERR_MAX bytes). */
static DDP__UNUSED ddp_result ddp__ck_build_header(const char *path, const ddp_tensor *t, int n, const ddp_meta *user,
                                                   const ddp_meta *extra, ddp__ck_buf *b, char *err);
