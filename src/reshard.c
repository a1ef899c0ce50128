/* [SECTION] reshard: slices of global tensors, saved by N ranks and loaded by M (checkpoint.h) */
/* A slice is elements [offset, offset + count) of a one-dimensional global tensor of global_count
   elements. Saving is a shard save (ddp_checkpoint_save_shard: one file a rank, then the completion
   marker) in which each slice is the tensor "<name>@<offset>/<global_count>". Before anything is
   written the ranks exchange what they are about to save (all_gather_v of (name, dtype, global_count,
   offset, count) records) and each checks the same gathered list: the slices of one tensor must agree
   on dtype and global_count and must not overlap (each element saved by one rank), else every rank
   returns the same refusal and none writes a file. Loading needs no agreement on who held what: every
   rank reads the header of every shard of the save (the marker says how many), and for each saved
   piece that overlaps one of its requests reads the piece (its checksum verified) and copies the
   overlap, noting the interval it filled. Sorted, those intervals must tile each request: a hole is an
   element no rank saved, and an element filled twice comes from a save that overlapped (written before
   the save refused that), whose right copy cannot be told. Cost: the save's check holds every rank's
   list on every rank (28 bytes and the name per slice); a load opens N headers on every rank and reads
   the pieces it needs, about 2/M of the data when the two partitions are even. As
   torch.distributed.checkpoint's resharding, without a planner: the ranges are the plan. */
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

/* The shard-save tensors of the slices: "<name>@<offset>/<global_count>", empty slices left out.
   *t and *names are the caller's to free; *k is how many tensors there are. */
static ddp_result ddp__slices_as_tensors(ddp_group *g, const char *what, const ddp_slice *s, int n, ddp_tensor **t, char **names,
                                         int *k) {
    int i;
    *k = 0;
    if (n == 0) return DDP_SUCCESS;
    *t = (ddp_tensor *)ddp__calloc((size_t)n, sizeof **t);
    *names = (char *)ddp__calloc((size_t)n, 128);
    if (!*t || !*names) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    for (i = 0; i < n; i++) {
        char *name = *names + (size_t)i * 128;
        ddp_tensor *e = &(*t)[*k];
        if (!s[i].count) continue; /* nothing to store */
        if (snprintf(name, 128, "%s%c%zu/%zu", s[i].name, DDP__SLICE_SEP, s[i].offset, s[i].global_count) >= 128)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: slice name \"%.64s...\" is too long (at most 80 bytes)", what, s[i].name);
        e->name = name;
        e->dtype = s[i].dtype;
        e->ndim = 1;
        e->shape[0] = (int64_t)s[i].count;
        e->data = s[i].data;
        (*k)++;
    }
    return DDP_SUCCESS;
}

/* ---- the save's overlap check ----
   Each rank packs a record per stored slice: offset, count, global_count (u64 each), dtype (i32), then
   the name and its terminator; the records of all ranks are gathered (all_gather of the byte counts,
   then all_gather_v), unpacked, sorted by (name, offset, rank) and scanned. */
#define DDP__SLICE_REC_FIXED 28

typedef struct ddp__slice_rec {
    const char *name; /* into the gathered bytes */
    uint64_t offset, count, global;
    int32_t dtype;
    int rank;
} ddp__slice_rec;

static size_t ddp__slices_packed_size(const ddp_slice *s, int n) {
    size_t bytes = 0;
    int i;
    for (i = 0; i < n; i++)
        if (s[i].count) bytes += DDP__SLICE_REC_FIXED + strlen(s[i].name) + 1;
    return bytes;
}

static void ddp__slices_pack(const ddp_slice *s, int n, char *out) {
    int i;
    for (i = 0; i < n; i++) {
        uint64_t v[3];
        int32_t dt = (int32_t)s[i].dtype;
        size_t len = strlen(s[i].name) + 1;
        if (!s[i].count) continue;
        v[0] = s[i].offset, v[1] = s[i].count, v[2] = s[i].global_count;
        memcpy(out, v, sizeof v);
        memcpy(out + 24, &dt, 4);
        memcpy(out + DDP__SLICE_REC_FIXED, s[i].name, len);
        out += DDP__SLICE_REC_FIXED + len;
    }
}

/* Unpack rank r's bytes [p, end) into rec[*m ...]; 0 when they are not whole records. */
static int ddp__slices_unpack(const char *p, const char *end, int r, ddp__slice_rec *rec, size_t *m) {
    while (p < end) {
        uint64_t v[3];
        const char *nul;
        if ((size_t)(end - p) <= DDP__SLICE_REC_FIXED || !(nul = (const char *)memchr(p + DDP__SLICE_REC_FIXED, 0,
                                                                                          (size_t)(end - p) - DDP__SLICE_REC_FIXED)))
            return 0;
        memcpy(v, p, sizeof v);
        memcpy(&rec[*m].dtype, p + 24, 4);
        rec[*m].offset = v[0], rec[*m].count = v[1], rec[*m].global = v[2];
        rec[*m].name = p + DDP__SLICE_REC_FIXED;
        rec[*m].rank = r;
        (*m)++;
        p = nul + 1;
    }
    return 1;
}

static int ddp__slice_rec_cmp(const void *a, const void *b) {
    const ddp__slice_rec *x = (const ddp__slice_rec *)a, *y = (const ddp__slice_rec *)b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
    return x->count < y->count ? -1 : x->count > y->count;
}

/* The verdict on the gathered records (the same list, so the same verdict, on every rank): within a
   name, sorted by offset, every record must have the first one's dtype and global_count and start at
   or after the end of the one reaching furthest so far. */
static ddp_result ddp__slices_verdict(ddp_group *g, const char *path, ddp__slice_rec *rec, size_t m) {
    size_t i, first = 0, far = 0;
    qsort(rec, m, sizeof *rec, ddp__slice_rec_cmp);
    for (i = 0; i < m; i++) {
        const ddp__slice_rec *a, *b = &rec[i];
        if (i == 0 || strcmp(rec[i - 1].name, b->name) != 0) {
            first = far = i;
            continue;
        }
        a = &rec[first];
        if (b->global != a->global || b->dtype != a->dtype)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint slice save of %s: rank %d saves \"%.64s\" as %llu elements of %s "
                             "but rank %d as %llu elements of %s (global_count, dtype): the slices of one tensor must agree on both",
                             path, a->rank, a->name, (unsigned long long)a->global, ddp__ck_st_name((ddp_dtype)a->dtype), b->rank,
                             (unsigned long long)b->global, ddp__ck_st_name((ddp_dtype)b->dtype));
        a = &rec[far];
        if (b->offset < a->offset + a->count)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint slice save of %s: rank %d saves \"%.64s\" [%llu, %llu) and rank %d "
                             "saves \"%.64s\" [%llu, %llu): the slices of a tensor must not overlap (each element saved by one "
                             "rank); a tensor every rank holds whole (replicated) is saved once, with ddp_checkpoint_save",
                             path, a->rank, a->name, (unsigned long long)a->offset, (unsigned long long)(a->offset + a->count), b->rank,
                             b->name, (unsigned long long)b->offset, (unsigned long long)(b->offset + b->count));
        if (b->offset + b->count > a->offset + a->count) far = i;
    }
    return DDP_SUCCESS;
}

/* The save's check that the ranks' slices fit together, before any file is written. Collective over g.
   res is this rank's outcome so far (its arguments), agreed on first; mine (mine_len bytes) are its
   packed records. Every allocation comes before an agreement, so all ranks take the same path through
   the collectives, and the verdict, computed from the same gathered bytes, is the same everywhere. */
static ddp_result ddp__slices_disjoint(ddp_group *g, const char *what, const char *path, ddp_result res, const char *mine,
                                       size_t mine_len) {
    int w = ddp_world_size(g), r;
    int64_t len = (int64_t)mine_len, *lens = (int64_t *)ddp__calloc((size_t)w, sizeof *lens);
    size_t *counts = (size_t *)ddp__calloc((size_t)w, sizeof *counts), total = 0, m = 0;
    char *all = NULL;
    ddp__slice_rec *rec = NULL;
    if (res == DDP_SUCCESS && (!lens || !counts)) res = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    if ((res = ddp__agree_outcome(g, res, what)) != DDP_SUCCESS) goto done;
    if (w > 1 && (res = ddp_all_gather(g, &len, lens, 1, DDP_I64)) != DDP_SUCCESS) goto done;
    if (w == 1) lens[0] = len;
    for (r = 0; r < w; r++) counts[r] = (size_t)lens[r], total += counts[r];
    all = (char *)ddp__malloc(total + 1);
    rec = (ddp__slice_rec *)ddp__calloc(total / (DDP__SLICE_REC_FIXED + 2) + 1, sizeof *rec);
    res = all && rec ? DDP_SUCCESS : ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory for the %zu bytes of every rank's slices", what, total);
    if ((res = ddp__agree_outcome(g, res, what)) != DDP_SUCCESS) goto done;
    if (w > 1 && total) res = ddp_all_gather_v(g, mine, mine_len, all, counts, DDP_U8); /* total: the same everywhere */
    else if (mine_len) memcpy(all, mine, mine_len);
    for (r = 0, total = 0; res == DDP_SUCCESS && r < w; total += counts[r], r++)
        if (!ddp__slices_unpack(all + total, all + total + counts[r], r, rec, &m))
            res = ddp__fail(g, DDP_ERR_FORMAT, "%s: rank %d's list of slices arrived malformed", what, r);
    if (res == DDP_SUCCESS) res = ddp__slices_verdict(g, path, rec, m);
done:
    ddp__free(lens);
    ddp__free(counts);
    ddp__free(all);
    ddp__free(rec);
    return res;
}

/* Steps: check the arguments and build the tensors; agree; check with every rank's slices that they
   fit together (ddp__slices_disjoint: the same verdict everywhere); then the shard save. */
DDP_API ddp_result ddp_checkpoint_save_slices(ddp_group *g, const char *path, const ddp_slice *s, int n, const ddp_meta *meta,
                                              const ddp_checkpoint_save_desc *desc) {
    static const char *what = "checkpoint slice save";
    ddp_tensor *t = NULL;
    char *names = NULL, *mine = NULL;
    size_t mine_len = 0;
    int k = 0;
    ddp_result r;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_slices");
    ddp__ck_async_settle(g);
    r = ddp__slices_check(g, what, s, n);
    if (r == DDP_SUCCESS) r = ddp__slices_as_tensors(g, what, s, n, &t, &names, &k);
    if (r == DDP_SUCCESS && !(mine = (char *)ddp__malloc((mine_len = ddp__slices_packed_size(s, n)) + 1)))
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    if (r == DDP_SUCCESS) ddp__slices_pack(s, n, mine);
    r = ddp__slices_disjoint(g, what, path ? path : "(null)", r, mine, mine_len);
    if (r == DDP_SUCCESS) r = ddp_checkpoint_save_shard(g, path, t, k, meta, desc);
    ddp__free(t);
    ddp__free(names);
    ddp__free(mine);
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

/* The intervals copied into the requests: [lo, hi) of request req, from the shard of rank `shard`. */
typedef struct ddp__slice_got {
    int req, shard;
    uint64_t lo, hi;
} ddp__slice_got;
typedef struct ddp__slice_gots {
    ddp__slice_got *v;
    size_t n, cap;
} ddp__slice_gots;

static int ddp__slice_note(ddp__slice_gots *got, int req, int shard, uint64_t lo, uint64_t hi) {
    if (got->n == got->cap) {
        size_t cap = got->cap ? 2 * got->cap : 64;
        ddp__slice_got *p = (ddp__slice_got *)DDP_REALLOC(got->v, cap * sizeof *p);
        if (!p) return 0;
        got->v = p, got->cap = cap;
    }
    got->v[got->n].req = req, got->v[got->n].shard = shard, got->v[got->n].lo = lo, got->v[got->n].hi = hi;
    got->n++;
    return 1;
}

/* Copy what saved piece e of shard k (file) holds of the requests, noting each interval copied. */
static ddp_result ddp__slice_take(ddp_group *g, const char *file, int k, int fd, uint64_t data_start, const ddp__ck_header *h,
                                  const ddp__ck_entry *e, ddp_slice *s, int n, ddp__slice_gots *got) {
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
        if (r == DDP_SUCCESS && !ddp__slice_note(got, i, k, lo, hi)) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint %s: out of memory", file);
        if (r == DDP_SUCCESS)
            memcpy((char *)s[i].data + (size_t)(lo - s[i].offset) * es, piece + (size_t)(lo - off) * es, (size_t)(hi - lo) * es);
    }
    ddp__free(piece);
    return r;
}

static int ddp__slice_got_cmp(const void *a, const void *b) {
    const ddp__slice_got *x = (const ddp__slice_got *)a, *y = (const ddp__slice_got *)b;
    if (x->req != y->req) return x->req < y->req ? -1 : 1;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    if (x->hi != y->hi) return x->hi < y->hi ? -1 : 1;
    return x->shard < y->shard ? -1 : x->shard > y->shard;
}

/* Did the copied intervals fill every request exactly once? Sorted by (request, start), each request's
   intervals must start where the filled part ends: later is a hole (elements no rank saved), earlier
   an element filled twice (the save overlapped: which copy is right cannot be told). The first such
   range of the first request with one is the error. */
static ddp_result ddp__slices_covered(ddp_group *g, const char *what, const char *path, int64_t world, const ddp_slice *s, int n,
                                      ddp__slice_gots *got) {
    size_t j = 0;
    int i;
    if (got->n) qsort(got->v, got->n, sizeof *got->v, ddp__slice_got_cmp);
    for (i = 0; i < n; i++) {
        uint64_t pos = s[i].offset, end = (uint64_t)(s[i].offset + s[i].count);
        int by = -1; /* the shard whose piece reaches pos */
        for (; j < got->n && got->v[j].req == i && got->v[j].lo <= pos; j++) {
            const ddp__slice_got *x = &got->v[j];
            if (x->lo < pos) {
                char where[64];
                if (by == x->shard) snprintf(where, sizeof where, "in the shard of rank %d", by);
                else snprintf(where, sizeof where, "in the shards of rank %d and rank %d", by, x->shard);
                return ddp__fail(g, DDP_ERR_FORMAT, "%s: %s holds elements [%llu, %llu) of \"%.64s\" twice, %s: the save's slices "
                                 "overlap (a save from before ddp_checkpoint_save_slices refused that), and which copy is right "
                                 "cannot be told: save the tensor again, in slices that do not overlap, or whole with "
                                 "ddp_checkpoint_save", what, path, (unsigned long long)x->lo, (unsigned long long)DDP__MIN(x->hi, pos),
                                 s[i].name, where);
            }
            pos = x->hi, by = x->shard;
        }
        if (j < got->n && got->v[j].req == i) end = got->v[j].lo; /* a hole before the next piece */
        if (pos < end)
            return ddp__fail(g, DDP_ERR_MISMATCH, "%s: %s lacks elements [%llu, %llu) of \"%.64s\", which this rank asked for "
                             "([%zu, %zu) of %zu): the save, by %lld ranks, did not cover them", what, path, (unsigned long long)pos,
                             (unsigned long long)end, s[i].name, s[i].offset, s[i].offset + s[i].count, s[i].global_count,
                             (long long)world);
    }
    return DDP_SUCCESS;
}

/* Everything shard k of the save holds of the requests (and, for k = 0, its metadata into meta). */
static ddp_result ddp__slices_from_shard(ddp_group *g, const char *path, int k, int64_t world, uint64_t id, ddp_slice *s,
                                         int n, ddp__slice_gots *got, ddp_meta *meta) {
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
        for (e = 0; r == DDP_SUCCESS && e < h.n; e++) r = ddp__slice_take(g, file, k, fd, 8 + hlen, &h, &h.e[e], s, n, got);
        ddp__ck_header_free(&h);
        ddp__free(raw);
        close(fd);
    }
    ddp__free(file);
    return r;
}

/* Is path an ordinary safetensors file (tensors, no shard keys: ddp_checkpoint_save's, torch's, or
   ddp_fsdp_save_full's) rather than a shard save's completion marker? 0 when it cannot be read: the
   marker's reader then says why. */
static int ddp__slices_whole_file(const char *path) {
    ddp__ck_header h;
    char *raw = NULL;
    uint64_t hlen;
    int fd, whole;
    if (!path || access(path, F_OK) != 0 || ddp__ck_open(NULL, path, &fd, &raw, &hlen, &h) != DDP_SUCCESS) return 0;
    close(fd);
    whole = h.n > 0 && !ddp__ck_header_meta(&h, DDP__CK_SHARD_PREFIX "world_size");
    ddp__ck_header_free(&h);
    ddp__free(raw);
    return whole;
}

/* The requests from an ordinary file: each is a range of the tensor of its name (flattened), read alone,
   so a rank reads only its slices' bytes. A request that covers its whole tensor is checked against the
   tensor's checksum; a part of one cannot be (the checksum covers the whole). */
static ddp_result ddp__slices_from_whole(ddp_group *g, const char *path, ddp_slice *s, int n, ddp__slice_gots *got,
                                         ddp_meta *meta) {
    ddp__ck_header h;
    char *raw = NULL;
    uint64_t hlen = 0;
    int fd = -1, i, d;
    ddp_result r = ddp__ck_open(g, path, &fd, &raw, &hlen, &h);
    if (r) return r;
    if (meta) r = ddp__ck_copy_meta(g, &h, meta);
    for (i = 0; r == DDP_SUCCESS && i < n; i++) {
        const ddp__ck_entry *e = ddp__ck_lookup(&h, s[i].name);
        size_t es = ddp_dtype_size(s[i].dtype);
        uint64_t numel = 1;
        if (!s[i].count) continue;
        if (!e) {
            r = ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint slice load: %s has no tensor \"%.64s\"", path, s[i].name);
            break;
        }
        for (d = 0; d < e->ndim; d++) numel *= (uint64_t)e->shape[d];
        if (ddp__ck_dtypes[e->st].dtype != s[i].dtype || numel != s[i].global_count) {
            r = ddp__fail(g, DDP_ERR_MISMATCH, "checkpoint slice load: \"%.64s\" is %llu x %s in %s but %zu x %s in the request "
                          "(global_count, dtype)", s[i].name, (unsigned long long)numel, ddp__ck_dtypes[e->st].name, path,
                          s[i].global_count, ddp__ck_st_name(s[i].dtype));
            break;
        }
        if (s[i].offset == 0 && s[i].count == numel) r = ddp__ck_read_tensor(g, path, fd, 8 + hlen, &h, e, s[i].data);
        else r = ddp__ck_read_at(g, fd, s[i].data, (uint64_t)s[i].count * es, 8 + hlen + e->begin + s[i].offset * es, path, NULL);
        if (r == DDP_SUCCESS && !ddp__slice_note(got, i, 0, s[i].offset, (uint64_t)(s[i].offset + s[i].count)))
            r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint %s: out of memory", path);
    }
    ddp__ck_header_free(&h);
    ddp__free(raw);
    close(fd);
    return r;
}

DDP_API ddp_result ddp_checkpoint_load_slices(ddp_group *g, const char *path, ddp_slice *s, int n, ddp_meta *meta) {
    static const char *what = "checkpoint slice load";
    ddp__slice_gots got;
    uint64_t id = 0;
    int64_t world = 0;
    int k, whole = 0;
    ddp_result r;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_load_slices");
    ddp__ck_async_settle(g);
    memset(&got, 0, sizeof got);
    r = ddp__slices_check(g, what, s, n);
#ifdef DDP_CUDA
    for (k = 0; r == DDP_SUCCESS && k < n; k++) /* the pieces are copied with memcpy below */
        if (s[k].count && ddp__cuda_is_device_pointer(s[k].data) == 1)
            r = ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: slice \"%.64s\" is in device memory, which ddp_checkpoint_load_slices does not "
                          "take yet: load it into host memory and copy it to the device", what, s[k].name);
#endif
    if (r == DDP_SUCCESS && (whole = ddp__slices_whole_file(path)) != 0) {
        world = 1;
        r = ddp__slices_from_whole(g, path, s, n, &got, meta);
    } else if (r == DDP_SUCCESS) {
        r = ddp__ck_read_marker(g, path, &world, &id);
    }
    for (k = 0; r == DDP_SUCCESS && !whole && k < world; k++) r = ddp__slices_from_shard(g, path, k, world, id, s, n, &got, k ? NULL : meta);
    if (r == DDP_SUCCESS) r = ddp__slices_covered(g, what, path, world, s, n, &got);
    ddp__free(got.v);
    return ddp__agree_outcome(g, r, what);
}
