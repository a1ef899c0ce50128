/* [SECTION] reshard: slices of global tensors, saved by N ranks and loaded by M (checkpoint.h) */
/* A slice is elements [offset, offset + count) of a one-dimensional global tensor of global_count
   elements. Saving is a shard save (ddp_checkpoint_save_shard: one file a rank, then the completion
   marker) in which each slice is the tensor "<name>@<offset>/<global_count>". Loading needs no
   agreement on who held what: every rank reads the header of every shard of the save (the marker says
   how many), and for each saved piece that overlaps one of its requests reads the piece (its checksum
   verified) and copies the overlap. Counting the elements copied into each request finds gaps; the
   pieces of one save do not overlap (each element was saved by one rank), so the count is exact. Cost:
   every rank opens N headers and reads the pieces it needs, about 2/M of the data when the two
   partitions are even. As torch.distributed.checkpoint's resharding, without a planner: the ranges are
   the plan. */
#include "internal.h"

#define DDP__SLICE_SEP '@'

static ddp_result ddp__slices_check(ddp_group *g, const char *what, const ddp_slice *s, int n) {
    int i;
    if (n < 0 || (n > 0 && !s)) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %d slices at %p", what, n, (const void *)s);
    for (i = 0; i < n; i++) {
        if (!s[i].name || !*s[i].name)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice %d has no name", what, i);
        if (!ddp__dtype_valid(s[i].dtype))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice \"%.64s\" has dtype %d, not a ddp_dtype", what, s[i].name,
                             (int)s[i].dtype);
        if (s[i].offset > s[i].global_count || s[i].count > s[i].global_count - s[i].offset)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice \"%.64s\" [%zu, %zu + %zu) lies outside its tensor of %zu "
                             "elements (global_count)", what, s[i].name, s[i].offset, s[i].offset, s[i].count, s[i].global_count);
        if (s[i].count && !s[i].data)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice \"%.64s\" has %zu elements and no data", what, s[i].name,
                             s[i].count);
    }
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_checkpoint_save_slices(ddp_group *g, const char *path, const ddp_slice *s, int n, const ddp_meta *meta,
                                              const ddp_checkpoint_save_desc *desc) {
    static const char *what = "checkpoint slice save";
    ddp_tensor *t = NULL;
    char *names = NULL;
    int i, k = 0;
    ddp_result r;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_slices");
    r = ddp__slices_check(g, what, s, n);
    if (r == DDP_SUCCESS && n > 0) {
        t = (ddp_tensor *)ddp__calloc((size_t)n, sizeof *t);
        names = (char *)ddp__calloc((size_t)n, 128);
        if (!t || !names) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    }
    for (i = 0; r == DDP_SUCCESS && i < n; i++) {
        char *name = names + (size_t)i * 128;
        if (!s[i].count) continue; /* nothing to store */
        if (snprintf(name, 128, "%s%c%zu/%zu", s[i].name, DDP__SLICE_SEP, s[i].offset, s[i].global_count) >= 128)
            r = ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice name \"%.64s...\" is too long (at most 80 bytes)", what, s[i].name);
        t[k].name = name;
        t[k].dtype = s[i].dtype;
        t[k].ndim = 1;
        t[k].shape[0] = (int64_t)s[i].count;
        t[k].data = s[i].data;
        k++;
    }
    /* a bad argument here still meets the other ranks' first agreement inside the shard save */
    r = r == DDP_SUCCESS ? ddp_checkpoint_save_shard(g, path, t, k, meta, desc) : ddp__ck_agree(g, r, what);
    ddp__free(t);
    ddp__free(names);
    return r;
}

/* A saved piece "<name>@<offset>/<global_count>": split its name. 0 when it is not one. */
static int ddp__slice_parse(const char *piece, size_t *name_len, uint64_t *offset, uint64_t *global) {
    const char *sep = strrchr(piece, DDP__SLICE_SEP);
    char *end = NULL;
    if (!sep || sep == piece || sep[1] < '0' || sep[1] > '9') return 0;
    *name_len = (size_t)(sep - piece);
    *offset = strtoull(sep + 1, &end, 10);
    if (*end != '/' || end[1] < '0' || end[1] > '9') return 0;
    *global = strtoull(end + 1, &end, 10);
    return *end == '\0';
}

/* Copy what saved piece e of shard `file` holds of the requests; found[i] counts request i's elements. */
static ddp_result ddp__slice_take(ddp_group *g, const char *file, int fd, uint64_t data_start, const ddp__ck_header *h,
                                  const ddp__ck_entry *e, ddp_slice *s, int n, uint64_t *found) {
    size_t name_len;
    uint64_t off, global, count = e->ndim == 1 ? (uint64_t)e->shape[0] : 0;
    char *piece = NULL;
    ddp_result r = DDP_SUCCESS;
    int i;
    if (e->ndim != 1 || !ddp__slice_parse(e->name, &name_len, &off, &global))
        return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: tensor \"%.64s\" is not a slice (name@offset/global_count, one "
                         "dimension): was this saved by ddp_checkpoint_save_slices?", file, e->name);
    for (i = 0; r == DDP_SUCCESS && i < n; i++) {
        size_t es = ddp_dtype_size(s[i].dtype);
        uint64_t lo, hi;
        if (strlen(s[i].name) != name_len || memcmp(s[i].name, e->name, name_len) != 0) continue;
        if (ddp__ck_dtypes[e->st].dtype != s[i].dtype)
            return ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint %s: \"%.64s\" is %s in the checkpoint but %s in the request", file,
                             s[i].name, ddp__ck_dtypes[e->st].name, ddp__ck_st_name(s[i].dtype));
        if (global != s[i].global_count)
            return ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint %s: \"%.64s\" has %llu elements in the checkpoint but %zu in the "
                             "request (global_count)", file, s[i].name, (unsigned long long)global, s[i].global_count);
        lo = DDP__MAX(off, (uint64_t)s[i].offset);
        hi = DDP__MIN(off + count, (uint64_t)(s[i].offset + s[i].count));
        if (lo >= hi) continue;
        if (!piece) { /* read the piece once, checksum and all, for every request it serves */
            if (!(piece = (char *)ddp__malloc((size_t)(e->end - e->begin))))
                return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint %s: out of memory for %llu bytes", file,
                                 (unsigned long long)(e->end - e->begin));
            r = ddp__ck_read_tensor(g, file, fd, data_start, h, e, piece);
        }
        if (r == DDP_SUCCESS) {
            memcpy((char *)s[i].data + (size_t)(lo - s[i].offset) * es, piece + (size_t)(lo - off) * es, (size_t)(hi - lo) * es);
            found[i] += hi - lo;
        }
    }
    ddp__free(piece);
    return r;
}

/* Everything shard k of the save holds of the requests (and, for k = 0, its metadata into meta). */
static ddp_result ddp__slices_from_shard(ddp_group *g, const char *path, int k, int64_t world, uint64_t id, ddp_slice *s,
                                         int n, uint64_t *found, ddp_meta *meta) {
    char *file = ddp__ck_shard_path(path, k), *raw = NULL, id_text[32];
    ddp__ck_header h;
    ddp__ck_shard_expect x;
    uint64_t hlen = 0;
    int fd = -1, e;
    ddp_result r;
    if (!file) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint slice load: out of memory");
    snprintf(id_text, sizeof id_text, "%016llx", (unsigned long long)id);
    x.rank = k, x.world = (int)world, x.save_id = id_text;
    if ((r = ddp__ck_open(g, file, &fd, &raw, &hlen, &h)) == DDP_SUCCESS) {
        r = ddp__ck_check_shard(g, file, &h, &x);
        if (r == DDP_SUCCESS && meta) r = ddp__ck_copy_meta(g, &h, meta);
        for (e = 0; r == DDP_SUCCESS && e < h.n; e++) r = ddp__slice_take(g, file, fd, 8 + hlen, &h, &h.e[e], s, n, found);
        ddp__ck_header_free(&h);
        ddp__free(raw);
        close(fd);
    }
    ddp__free(file);
    return r;
}

DDP_API ddp_result ddp_checkpoint_load_slices(ddp_group *g, const char *path, ddp_slice *s, int n, ddp_meta *meta) {
    static const char *what = "checkpoint slice load";
    uint64_t *found = NULL, id = 0;
    int64_t world = 0;
    int i, k;
    ddp_result r;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_load_slices");
    ddp__ck_async_settle(g);
    r = ddp__slices_check(g, what, s, n);
#ifdef DDP_CUDA
    for (i = 0; r == DDP_SUCCESS && i < n; i++) /* the pieces are copied with memcpy below */
        if (s[i].count && ddp__cuda_is_device_pointer(s[i].data) == 1)
            r = ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: slice \"%.64s\" is in device memory, which ddp_checkpoint_load_slices does not "
                          "take yet: load it into host memory and copy it to the device", what, s[i].name);
#endif
    if (r == DDP_SUCCESS && n > 0 && !(found = (uint64_t *)ddp__calloc((size_t)n, sizeof *found)))
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    if (r == DDP_SUCCESS) r = ddp__ck_read_marker(g, path, &world, &id);
    for (k = 0; r == DDP_SUCCESS && k < world; k++) r = ddp__slices_from_shard(g, path, k, world, id, s, n, found, k ? NULL : meta);
    for (i = 0; r == DDP_SUCCESS && i < n; i++)
        if (found[i] != s[i].count)
            r = ddp__fail(g, DDP_ERR_MISMATCH, "%s: %s holds %llu of the %zu elements [%zu, %zu) of \"%.64s\" that this rank asked "
                          "for (saved by %lld ranks): the save did not cover them", what, path, (unsigned long long)found[i],
                          s[i].count, s[i].offset, s[i].offset + s[i].count, s[i].name, (long long)world);
    ddp__free(found);
    return ddp__ck_agree(g, r, what);
}
