/* [SECTION] checkpoint: atomic save on rank 0, load everywhere or broadcast, shards, keep_last, latest
   Mirrors the PyTorch DDP checkpoint recipe (rank 0 torch.save + barrier; torch.load on every rank) with
   safetensors as the format (safetensors.c: CRC32C, the header parser and writer, ddp_meta). Layout of
   this file:
     files         argument checks, then tmp file -> fsync -> rename -> fsync(directory); reads at an
                   offset with the checksum computed on the way
     device tensors  (DDP_CUDA) copies to and from pinned host memory on the group's stream
     collectives   agreement on the outcome (every rank fails together), chunked broadcasts
     rotation      keep_last and ddp_checkpoint_latest: files that differ in one run of digits
     save, load    rank 0 writes; every rank reads, or rank 0 reads and broadcasts
     list          what a file holds, from its header alone
     async save    staged copy on the caller's thread, written and agreed on in the background
     shards        one file per rank, then a completion marker written last */
#include "internal.h"

#include <dirent.h>

#define DDP__CK_CHUNK ((size_t)4 << 20)         /* bytes per broadcast; the same on every rank */
#define DDP__CK_SHARD_WORLD "ddp.shard.world_size"
#define DDP__CK_SHARD_RANK "ddp.shard.rank"
#define DDP__CK_SHARD_ID "ddp.shard.save_id"

/* ---- files ---- */

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

/* ---- device tensors ----
   In a build with -DDDP_CUDA linked with ddp_cuda.o, a tensor's data may be device memory (cudaMalloc'd
   or managed; ddp__cuda_is_device_pointer). The file is always written from and read into host memory:
     save        (ddp__ck_write_file: save, save_ex, save_shard) the device tensors are copied into pinned
                 host memory (ddp__cuda_stage_host, made for the call and freed after it) with
                 cudaMemcpyAsync on the group's stream (ddp_set_stream; NULL = the legacy default stream),
                 then the stream is synchronised: the copies see what the program queued on that stream
                 before the call. The checksums and the write read the pinned copy.
     async save  the snapshot (step 1 below) copies the device tensors into the save's staging buffer,
                 which is pinned memory then, on the group's stream, and synchronises before returning:
                 the program may overwrite its device tensors right after the call (torch's async_save
                 stages to the CPU first too). The staging is synchronous on the caller's thread, not on
                 a side stream: the caller waits for one device-to-host copy of the state.
     load        each device tensor is read into pinned host memory (its checksum verified there), then
                 copied to the device on the group's stream and synchronised before the call returns.
                 The broadcast load stages rank 0's reads the same way; the other ranks receive into
                 device memory through the collective (devbuf.c or NCCL) and check the checksum on a
                 host copy.
   A CUDA failure while staging is the save's (load's) error on every rank (the agreement); no file is
   written. Without DDP_CUDA every pointer is host memory and none of this runs. */
#ifdef DDP_CUDA
static int ddp__ck_on_device(const void *p, uint64_t bytes) { return bytes && p && ddp__cuda_is_device_pointer(p) == 1; }
#else
static int ddp__ck_on_device(const void *p, uint64_t bytes) {
    (void)p, (void)bytes;
    return 0;
}
#endif

static void *ddp__ck_stream(ddp_group *g) { return g ? ddp__devbuf_stream(g) : NULL; }

static int ddp__ck_any_on_device(const ddp_tensor *t, int n) {
    int i;
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        ddp__ck_tensor_bytes(&t[i], &bytes);
        if (ddp__ck_on_device(t[i].data, bytes)) return 1;
    }
    return 0;
}

/* The bytes that ddp__ck_snapshot needs at base: 64-byte aligned pieces of every tensor (all) or of the
   device tensors only; *too_large (and 0) past SIZE_MAX / 4 bytes. */
static size_t ddp__ck_snapshot_bytes(const ddp_tensor *t, int n, int all, int *too_large) {
    size_t total = 0;
    int i;
    *too_large = 0;
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        ddp__ck_tensor_bytes(&t[i], &bytes);
        if (!all && !ddp__ck_on_device(t[i].data, bytes)) continue;
        if (bytes > (uint64_t)(SIZE_MAX / 4) - total) {
            *too_large = 1;
            return 0;
        }
        total += ((size_t)bytes + 63) & ~(size_t)63;
    }
    return total;
}

/* out[i] = t[i], with the data of every tensor (all) or of the device tensors copied to base (laid out as
   ddp__ck_snapshot_bytes counts): host tensors with memcpy, device tensors with cudaMemcpyAsync on
   stream, which is then synchronised. Errors are reported on g (NULL: the thread's last error). */
static ddp_result ddp__ck_snapshot(ddp_group *g, void *stream, const char *path, const ddp_tensor *t, int n, int all, char *base,
                                   ddp_tensor *out) {
    size_t at = 0;
    int i, queued = 0;
    ddp_result r = DDP_SUCCESS;
    (void)g, (void)stream, (void)path;
    for (i = 0; i < n && r == DDP_SUCCESS; i++) {
        uint64_t bytes;
        int dev;
        out[i] = t[i];
        ddp__ck_tensor_bytes(&t[i], &bytes);
        dev = ddp__ck_on_device(t[i].data, bytes);
        if (!all && !dev) continue;
        out[i].data = base + at;
        at += ((size_t)bytes + 63) & ~(size_t)63;
        if (!dev) {
            if (bytes) memcpy(out[i].data, t[i].data, (size_t)bytes);
            continue;
        }
#ifdef DDP_CUDA
        {
            char err[DDP__ERR_MAX];
            if (ddp__cuda_stage_copy(out[i].data, t[i].data, (size_t)bytes, stream, err, sizeof err) != DDP_SUCCESS)
                r = ddp__fail(g, DDP_ERR_SYSTEM, "checkpoint save of %s: copying tensor \"%.64s\" (%llu bytes) from device memory to "
                              "pinned host memory failed: %s", path, t[i].name, (unsigned long long)bytes, err);
            queued = 1;
        }
#endif
    }
#ifdef DDP_CUDA
    if (queued) { /* wait even after a failed copy: none may still write to base once we return */
        char err[DDP__ERR_MAX];
        if (ddp__cuda_stage_sync(stream, err, sizeof err) != DDP_SUCCESS && r == DDP_SUCCESS)
            r = ddp__fail(g, DDP_ERR_SYSTEM, "checkpoint save of %s: waiting for the copies of device tensors to pinned host memory "
                          "failed: %s", path, err);
    }
#endif
    (void)queued;
    return r;
}

#ifdef DDP_CUDA
static void ddp__ck_stage_free(void *stage) { ddp__cuda_stage_free((ddp__cuda_stage *)stage); }

/* A sync save's host view of t: *out = t when no tensor is on the device; else a new array (the caller
   frees it and *stage) whose device tensors point into pinned memory holding their bytes. */
static ddp_result ddp__ck_host_view(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_tensor **out,
                                    ddp_tensor **made, void **stage) {
    char err[DDP__ERR_MAX];
    void *host = NULL;
    int too_large;
    size_t total;
    ddp_result r;
    *out = t, *made = NULL, *stage = NULL;
    if (!ddp__ck_any_on_device(t, n)) return DDP_SUCCESS;
    total = ddp__ck_snapshot_bytes(t, n, 0, &too_large);
    if (too_large) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: the device tensors are too large to stage", path);
    if ((r = ddp__cuda_stage_host((ddp__cuda_stage **)stage, total, &host, err, sizeof err)) != DDP_SUCCESS)
        return ddp__fail(g, r, "checkpoint save of %s: pinned host memory for %zu bytes of device tensors: %s", path, total, err);
    if (!(*made = (ddp_tensor *)ddp__calloc((size_t)n + 1, sizeof **made)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory", path);
    if ((r = ddp__ck_snapshot(g, ddp__ck_stream(g), path, t, n, 0, (char *)host, *made)) != DDP_SUCCESS) return r;
    *out = *made;
    return DDP_SUCCESS;
}

/* Load: bytes of the file into device memory dst, through pinned host memory; the checksum register is
   updated on the host copy. */
static ddp_result ddp__ck_read_to_device(ddp_group *g, int fd, void *dst, uint64_t bytes, uint64_t off, const char *path,
                                         const char *name, uint32_t *crc) {
    ddp__cuda_stage *stage = NULL;
    char err[DDP__ERR_MAX];
    void *host = NULL, *stream = ddp__ck_stream(g);
    ddp_result r = ddp__cuda_stage_host(&stage, (size_t)bytes, &host, err, sizeof err);
    if (r != DDP_SUCCESS) r = ddp__fail(g, r, "checkpoint load of %s: pinned host memory for tensor \"%.64s\": %s", path, name, err);
    if (r == DDP_SUCCESS) r = ddp__ck_read_at(g, fd, host, bytes, off, path, crc);
    if (r == DDP_SUCCESS && (r = ddp__cuda_stage_copy(dst, host, (size_t)bytes, stream, err, sizeof err)) != DDP_SUCCESS)
        r = ddp__fail(g, r, "checkpoint load of %s: copying tensor \"%.64s\" to device memory failed: %s", path, name, err);
    if (r == DDP_SUCCESS && (r = ddp__cuda_stage_sync(stream, err, sizeof err)) != DDP_SUCCESS)
        r = ddp__fail(g, r, "checkpoint load of %s: waiting for the copy of tensor \"%.64s\" to device memory failed: %s", path, name, err);
    ddp__cuda_stage_free(stage);
    return r;
}

/* The CRC32C of bytes of device memory (a broadcast load's arrival check), on a pinned host copy. */
static ddp_result ddp__ck_device_crc(ddp_group *g, const void *src, uint64_t bytes, const char *path, uint32_t *crc) {
    char err[DDP__ERR_MAX];
    ddp_result r = ddp__crc32c_anywhere(src, (size_t)bytes, ddp__ck_stream(g), crc, err);
    if (r != DDP_SUCCESS)
        ddp__fail(g, r, "checkpoint load of %s: copying a tensor from device memory to check its checksum failed: %s", path, err);
    return r;
}
#else
static void ddp__ck_stage_free(void *stage) { (void)stage; }
static ddp_result ddp__ck_host_view(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_tensor **out,
                                    ddp_tensor **made, void **stage) {
    (void)g, (void)path, (void)n;
    *out = t, *made = NULL, *stage = NULL;
    return DDP_SUCCESS;
}
#endif

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

/* One process writes one file: checks, device tensors to pinned memory, header, atomic write. staged: t
   is an async save's staging copy, host memory (the background thread then makes no CUDA call). */
static ddp_result ddp__ck_write_file(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                     const ddp_meta *extra, int staged) {
    ddp__ck_buf hdr;
    char err[DDP__ERR_MAX];
    ddp_tensor *made = NULL;
    void *stage = NULL;
    ddp_result r;
    memset(&hdr, 0, sizeof hdr);
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: path is NULL or empty");
    if ((r = ddp__ck_check_tensors(g, "checkpoint save", t, n)) != DDP_SUCCESS) return r;
    if ((r = ddp__ck_check_meta(g, path, meta)) != DDP_SUCCESS) return r;
    r = staged ? DDP_SUCCESS : ddp__ck_host_view(g, path, t, n, &t, &made, &stage); /* device tensors: a pinned host copy */
    if (r == DDP_SUCCESS && (r = ddp__ck_build_header(path, t, n, meta, extra, NULL, &hdr, err)) != DDP_SUCCESS) ddp__fail(g, r, "%s", err);
    if (r == DDP_SUCCESS) r = ddp__ck_atomic_write(g, path, &hdr, t, n);
    ddp__free(made);
    ddp__ck_stage_free(stage);
    ddp__free(hdr.p);
    return r;
}

/* ---- a file written tensor by tensor (ddp_fsdp_save_full: root never holds the model) ----
   The header is laid out first from the tensors' names, dtypes and shapes, with placeholder checksums of
   the same length, so every tensor's place is known; each tensor is written at its place when it comes
   (its checksum taken as it goes); then the header is written again with the checksums, the file synced
   and renamed over path. The file appears whole or not at all, as ddp_checkpoint_save's. */
static ddp_result ddp__ck_out_header(ddp_group *g, ddp__ck_out *s, int final) {
    ddp__ck_buf hdr;
    unsigned char prefix[8];
    char err[DDP__ERR_MAX];
    ddp_result r;
    int i;
    memset(&hdr, 0, sizeof hdr);
    if ((r = ddp__ck_build_header(s->path, s->t, s->n, s->meta, NULL, s->crc, &hdr, err)) != DDP_SUCCESS) {
        ddp__free(hdr.p);
        return ddp__fail(g, r, "%s", err);
    }
    if (final && 8 + hdr.len != s->data_start) /* the same lengths: cannot differ */
        r = ddp__fail(g, DDP_ERR_STATE, "checkpoint save of %s: the header changed length", s->path);
    s->data_start = 8 + hdr.len;
    for (i = 0; i < 8; i++) prefix[i] = (unsigned char)((uint64_t)hdr.len >> (8 * i));
    if (r == DDP_SUCCESS && pwrite(s->fd, prefix, 8, 0) != 8) r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: writing %s failed: %s", s->tmp, strerror(errno));
    if (r == DDP_SUCCESS && pwrite(s->fd, hdr.p, hdr.len, 8) != (ssize_t)hdr.len)
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: writing %s failed: %s", s->tmp, strerror(errno));
    ddp__free(hdr.p);
    return r;
}

/* Start writing path (through path.tmp): t[i] name the tensors, in file order (their data is not read). */
static ddp_result ddp__ck_out_open(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                      ddp__ck_out *s) {
    ddp_result r;
    int i;
    memset(s, 0, sizeof *s);
    s->fd = -1;
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: path is NULL or empty");
    if ((r = ddp__ck_check_meta(g, path, meta)) != DDP_SUCCESS) return r;
    s->path = path, s->t = t, s->n = n, s->meta = meta;
    s->crc = (uint32_t *)ddp__calloc((size_t)n + 1, sizeof *s->crc);
    s->at = (uint64_t *)ddp__calloc((size_t)n + 1, sizeof *s->at);
    s->tmp = ddp__ck_cat(path, ".tmp");
    if (!s->crc || !s->at || !s->tmp) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory", path);
    for (i = 1; i <= n; i++) {
        uint64_t bytes;
        ddp__ck_tensor_bytes(&t[i - 1], &bytes);
        s->at[i] = s->at[i - 1] + bytes;
    }
    if ((s->fd = open(s->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666)) < 0)
        return ddp__fail(g, DDP_ERR_IO, "checkpoint save: cannot create %s: %s (does the directory exist and is it writable?)",
                         s->tmp, strerror(errno));
    return ddp__ck_out_header(g, s, 0);
}

/* Tensor i's data (all of it). */
static ddp_result ddp__ck_out_write(ddp_group *g, ddp__ck_out *s, int i, const void *data) {
    uint64_t bytes = s->at[i + 1] - s->at[i], off = s->data_start + s->at[i];
    const char *p = (const char *)data;
    s->crc[i] = ddp__ck_crc32c(data, (size_t)bytes, 1);
    while (bytes > 0) {
        ssize_t w = pwrite(s->fd, p, (size_t)DDP__MIN(bytes, (uint64_t)1 << 30), (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint save: writing %s failed: %s", s->tmp, strerror(errno));
        p += w, off += (uint64_t)w, bytes -= (uint64_t)w;
    }
    return DDP_SUCCESS;
}

/* Finish (ok: every tensor was written): the header with the checksums, fsync, rename; else the
   temporary file goes. Frees s. Returns ok's result, or the first error. */
static ddp_result ddp__ck_out_close(ddp_group *g, ddp__ck_out *s, ddp_result ok) {
    ddp_result r = ok;
    if (s->fd >= 0) {
        if (r == DDP_SUCCESS) r = ddp__ck_out_header(g, s, 1);
        if (r == DDP_SUCCESS && fsync(s->fd) != 0) r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: fsync of %s failed: %s", s->tmp, strerror(errno));
        if (close(s->fd) != 0 && r == DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: closing %s failed: %s", s->tmp, strerror(errno));
        if (r == DDP_SUCCESS && rename(s->tmp, s->path) != 0)
            r = ddp__fail(g, DDP_ERR_IO, "checkpoint save: renaming %s to %s failed: %s", s->tmp, s->path, strerror(errno));
        if (r != DDP_SUCCESS) unlink(s->tmp);
        else r = ddp__ck_sync_dir(g, s->path);
    }
    ddp__free(s->tmp);
    ddp__free(s->crc);
    ddp__free(s->at);
    memset(s, 0, sizeof *s);
    s->fd = -1;
    return r;
}

/* ---- collectives ----
   Every collective entry point ends with ddp__agree_outcome (collectives.c): the ranks exchange their
   outcome, so an error anywhere (rank 0 could not write, rank 3 could not read) is an error everywhere,
   carrying the failing rank's message; nobody is left waiting in a later collective. */


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

static int ddp__ck_rank(const ddp_group *g) { return ddp_rank(g); }
static int ddp__ck_world(const ddp_group *g) { return ddp_world_size(g); }

/* ---- rotation ----
   A family is <dir>/<prefix><digits><suffix>; a member's number is its digits (1 to 18 of them).
   keep_last keeps the K largest numbers; files with smaller numbers go, together with their ".tmp"
   leftovers (and, for shards, every "<member>.rank<r>" file, whichever group size wrote it). */

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

/* Does name belong to the family? Sets *number and *tail (what follows the suffix). The number has
   1 to 18 digits: a longer run is not a member (it might not fit an int64_t, so the digit count is
   checked before each multiplication). */
static int ddp__ck_family_member(const ddp__ck_family *f, const char *name, int64_t *number, const char **tail) {
    size_t np = strlen(f->prefix), ns = strlen(f->suffix), k;
    int64_t v = 0;
    if (strncmp(name, f->prefix, np) != 0) return 0;
    for (k = 0; name[np + k] >= '0' && name[np + k] <= '9'; k++) {
        if (k == 18) return 0;
        v = v * 10 + (name[np + k] - '0');
    }
    if (k == 0 || strncmp(name + np + k, f->suffix, ns) != 0) return 0;
    *number = v;
    *tail = name + np + k + ns;
    return 1;
}

/* Does name belong to the family, followed by exactly tail? Sets *number. */
static int ddp__ck_family_match(const ddp__ck_family *f, const char *name, const char *tail, int64_t *number) {
    const char *rest;
    int64_t v;
    if (!ddp__ck_family_member(f, name, &v, &rest) || strcmp(rest, tail) != 0) return 0;
    *number = v;
    return 1;
}

/* Which files of an old member a caller deletes, by what follows the member's name:
     rank < 0   the member itself and its ".tmp" leftover (rank 0, for a plain save or a shard marker)
     rank >= 0  the shards "<member>.rank<r>" and their ".tmp" leftovers with r % world == rank: each
                rank its own and those of ranks the group no longer has (a save on fewer ranks than the
                old one), so every shard file has exactly one deleter and no two ranks race on a name */
static int ddp__ck_tail_doomed(const char *tail, int rank, int world) {
    int64_t r = 0;
    int k;
    if (rank < 0) return strcmp(tail, "") == 0 || strcmp(tail, ".tmp") == 0;
    if (strncmp(tail, ".rank", 5) != 0) return 0;
    tail += 5;
    for (k = 0; tail[k] >= '0' && tail[k] <= '9'; k++) {
        if (k == 10) return 0; /* more digits than an int has */
        r = r * 10 + (tail[k] - '0');
    }
    if (k == 0 || (k > 1 && tail[0] == '0') || r > INT_MAX) return 0; /* "%d" writes no leading zero */
    if (tail[k] != '\0' && strcmp(tail + k, ".tmp") != 0) return 0;
    return r % world == rank;
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

/* Delete the family's files whose number is below cutoff and that ddp__ck_tail_doomed gives to
   rank (of world). Failures are logged, not returned: the new checkpoint is already safe. */
static void ddp__ck_delete_below(ddp_group *g, const ddp__ck_family *f, int64_t cutoff, int rank, int world) {
    DIR *d = opendir(f->dir);
    struct dirent *de;
    int deleted = 0;
    if (!d) {
        ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot list %s: %s", f->dir, strerror(errno));
        return;
    }
    while ((de = readdir(d)) != NULL) {
        int64_t num;
        const char *tail;
        char *full;
        if (!ddp__ck_family_member(f, de->d_name, &num, &tail) || num >= cutoff || !ddp__ck_tail_doomed(tail, rank, world)) continue;
        full = ddp__ck_join(f->dir, de->d_name);
        if (full && unlink(full) == 0) deleted++;
        else ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot delete %s: %s", full ? full : de->d_name, strerror(errno));
        ddp__free(full);
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
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: keep_last needs a number in the file name of %s (a run of 1 to 18 digits, e.g. ckpt_000100.safetensors)", path);
    return DDP_SUCCESS;
}

/* ---- save ---- */

/* Rank 0's part of a save: write the file, then rotate (keep_last). Errors go to g (may be NULL). */
static ddp_result ddp__ck_save_on_root(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                       const ddp_checkpoint_save_desc *desc, int staged) {
    ddp__ck_family fam;
    int64_t number = 0;
    ddp_result r = ddp__ck_check_rotation(g, path ? path : "", desc, &fam, &number);
    if (r == DDP_SUCCESS) r = ddp__ck_write_file(g, path, t, n, meta, NULL, staged);
    if (r == DDP_SUCCESS && fam.dir) {
        int64_t cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
        if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, -1, 1);
    }
    ddp__ck_family_free(&fam);
    return r;
}

static void ddp__ck_async_settle(ddp_group *g);

DDP_API ddp_result ddp_checkpoint_save_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                          const ddp_checkpoint_save_desc *desc) {
    ddp_result r = DDP_SUCCESS;
    double t0 = ddp__timeline_on() ? ddp__now() : 0;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_ex");
    ddp__ck_async_settle(g); /* a background save in flight finishes first */
    if (ddp__ck_rank(g) == 0) r = ddp__ck_save_on_root(g, path, t, n, meta, desc, 0);
    r = ddp__agree_outcome(g, r, "checkpoint save");
    if (t0 > 0) ddp__timeline_span("checkpoint.save", t0, ddp__now(), NULL, NULL, 0, "path", path ? path : "");
    return r;
}

DDP_API ddp_result ddp_checkpoint_save(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta) {
    return ddp_checkpoint_save_ex(g, path, t, n, meta, NULL);
}

/* ---- async save ----
   ddp_checkpoint_save_async = torch.distributed.checkpoint.async_save: snapshot now, write behind.
     1. on the calling (training) thread: wait for the previous async save of this group to finish
        (at most one staged copy alive), then rank 0 copies every tensor's bytes into ONE staging
        buffer (kept for the next save when it is big enough: no page faults the second time) and
        copies the names, metadata, path and options; the other ranks stage nothing. This copy is
        all the caller waits for.
     2. a background thread per save: rank 0 writes the staged tensors exactly as ddp_checkpoint_save
        does (same function: tmp file, fsync, rename, directory fsync, CRCs, keep_last), then every
        rank's thread agrees on the outcome (ddp__agree_outcome) and completes the ddp_work.
   Ordering with the program's later collectives: the agreement of step 2 runs on a private group of
   the same ranks (made once, at the first async save, through the group's store: every rank makes it
   at the same call, since the save is collective), never on the program's group, so it cannot
   interleave with the collectives the training thread issues meanwhile; on the private group one
   save's agreement runs at a time, in the same order on every rank (saves are collective and
   serialised by step 1). This is torch's recipe too (async_save on its own gloo group). With one rank
   (or g NULL) there is nothing to agree on and no private group. The mpi backend has no store to make
   that group from: DDP_ERR_UNSUPPORTED.
   Completion: the work is done when the agreement is, so ddp_wait returns DDP_SUCCESS on a rank only
   once the file is durable; a failure anywhere (rank 0 could not write: path and errno text) is the
   error of every rank's ddp_wait. Argument errors found on rank 0 while staging travel the same way
   (the other ranks cannot see them at the call). The thread is joined by ddp_wait, by the next save
   (or any sync checkpoint call on the group), or by ddp_destroy, which finishes a save in flight
   before its own barrier and then closes the private group (every rank is there). */

struct ddp__ck_async {
    pthread_mutex_t mu; /* guards the current work's result fields and done */
    pthread_cond_t cv;
    pthread_t thread;
    int thread_live;    /* started and not joined */
    int rank;           /* in the program's group (0 without one) */
    ddp_group *sub;     /* the private group of every rank, for the agreement (NULL: one rank) */
    ddp_work *work;     /* the save in flight (NULL: none) */
    /* the staged save: what the thread writes (rank 0) */
    char *path;
    ddp_tensor *t;
    int n;
    char *names;        /* every tensor's name, each terminated */
    ddp_meta meta;
    int has_meta, has_desc;
    ddp_checkpoint_save_desc desc;
    char *stage;        /* the tensor bytes; kept between saves */
    size_t stage_cap;
    void *pinned;       /* ddp__cuda_stage: the staging memory instead when a tensor is on the device (DDP_CUDA) */
    ddp_result pre;     /* an error found while staging (rank 0), delivered through the agreement */
    char pre_msg[DDP__ERR_MAX];
};

/* The save of a process without a group (g NULL) has no group to hang off: one per process. */
static struct ddp__ck_async *ddp__ck_async_alone;
#define DDP__CK_ASYNC_WHAT "checkpoint save (async)"

static struct ddp__ck_async **ddp__ck_async_slot(ddp_group *g) { return g ? &g->ck_async : &ddp__ck_async_alone; }

/* Forget the staged save (the staging buffer itself is kept). */
static void ddp__ck_async_unstage(struct ddp__ck_async *a) {
    ddp__free(a->path);
    ddp__free(a->t);
    ddp__free(a->names);
    ddp_meta_free(&a->meta);
    a->path = NULL;
    a->t = NULL;
    a->names = NULL;
    a->n = 0;
    a->pre = DDP_SUCCESS;
    a->pre_msg[0] = '\0';
}

/* Wait for the save in flight (if any) to finish and join its thread. */
static void ddp__ck_async_join(struct ddp__ck_async *a) {
    if (!a || !a->thread_live) return;
    pthread_join(a->thread, NULL);
    a->thread_live = 0;
    a->work = NULL;
    ddp__ck_async_unstage(a);
}

static void ddp__ck_async_settle(ddp_group *g) { ddp__ck_async_join(*ddp__ck_async_slot(g)); }

/* The background: rank 0 writes; every rank agrees on the private group; the work completes. */
static void *ddp__ck_async_main(void *arg) {
    struct ddp__ck_async *a = (struct ddp__ck_async *)arg;
    ddp_result r = a->pre;
    ddp_work *w = a->work;
    double t0 = ddp__timeline_on() ? ddp__now() : 0;
    ddp__timeline_lane_saver();
    if (r != DDP_SUCCESS) ddp__fail(a->sub, r, "%s", a->pre_msg);
    else if (a->rank == 0) r = ddp__ck_save_on_root(a->sub, a->path, a->t, a->n, a->has_meta ? &a->meta : NULL, a->has_desc ? &a->desc : NULL, 1);
    r = ddp__agree_outcome(a->sub, r, DDP__CK_ASYNC_WHAT);
    if (t0 > 0) ddp__timeline_span("checkpoint.save_async", t0, ddp__now(), NULL, NULL, 0, "path", a->path ? a->path : "");
    pthread_mutex_lock(&a->mu);
    w->result = r;
    if (r != DDP_SUCCESS) {
        const char *why = a->sub ? ddp_last_error(a->sub) : ddp_last_error(NULL);
        if (strstr(why, "checkpoint")) snprintf(w->error, sizeof w->error, "%s", why);
        else /* the agreement itself failed (a rank was lost): say which save */
            snprintf(w->error, sizeof w->error, DDP__CK_ASYNC_WHAT " of %.240s: agreeing on the outcome failed: %.700s", a->path ? a->path : "?", why);
    }
    w->done = 1;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/* ddp_wait / ddp_test on an async save's work (its owner table below). */
static ddp_result ddp__ck_async_wait(ddp_work *w) {
    struct ddp__ck_async *a = (struct ddp__ck_async *)w->handle;
    ddp_result r;
    pthread_mutex_lock(&a->mu);
    while (!w->done) pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
    if (a->work == w) ddp__ck_async_join(a);
    r = w->result;
    if (r != DDP_SUCCESS) ddp__fail(w->g, r, "%s", w->error);
    ddp__free(w);
    return r;
}

static int ddp__ck_async_test(ddp_work *w) {
    struct ddp__ck_async *a = (struct ddp__ck_async *)w->handle;
    int done;
    pthread_mutex_lock(&a->mu);
    done = w->done;
    pthread_mutex_unlock(&a->mu);
    return done;
}

static const ddp__backend ddp__ck_async_owner = {"checkpoint", "checkpoint", NULL, NULL, ddp__ck_async_wait, ddp__ck_async_test,
                                                 NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};

/* The group ends (g->end_upper, from ddp_destroy before its barrier, or from the group's end): finish a
   background save in flight (its work keeps the outcome), close the save's private group, free the
   staging buffer. Idempotent. */
static void ddp__ck_async_end(ddp_group *g) {
    struct ddp__ck_async *a = g->ck_async;
    if (!a) return;
    ddp__ck_async_join(a);
    if (a->sub) {
        if (ddp__live_has(g, DDP__LIVE_GROUP) && !g->broken) ddp_destroy(a->sub); /* ddp_destroy: every rank is here */
        else ddp__group_free(a->sub);
    }
    ddp__free(a->stage);
    ddp__ck_stage_free(a->pinned);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    ddp__free(a);
    g->ck_async = NULL;
}

/* The state of g's async saves, made at the first one (with the private group when g has ranks). */
static ddp_result ddp__ck_async_state(ddp_group *g, struct ddp__ck_async **out) {
    struct ddp__ck_async **slot = ddp__ck_async_slot(g), *a = *slot;
    *out = NULL;
    if (!a) {
        if (!(a = (struct ddp__ck_async *)ddp__calloc(1, sizeof *a)))
            return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_save_async: out of memory");
        pthread_mutex_init(&a->mu, NULL);
        pthread_cond_init(&a->cv, NULL);
        a->rank = ddp_rank(g);
        if (g && g->world_size > 1) {
            int *ranks = (int *)ddp__calloc((size_t)g->world_size, sizeof *ranks), i;
            ddp_result r;
            if (!ranks) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_save_async: out of memory");
            else {
                for (i = 0; i < g->world_size; i++) ranks[i] = i;
                r = ddp__subgroup_open(g, ranks, g->world_size, g->rank, "ckpt", NULL,
                                       "ddp_checkpoint_save_async (making the group its background agreement runs on)", &a->sub);
            }
            ddp__free(ranks);
            /* not on g's list of subgroups (ddp_destroy(g) ends it here, first), but its parent is g, so the
               flight recorder names it by its key prefix rather than as the world group */
            if (r == DDP_SUCCESS) a->sub->member.parent = g;
            if (r != DDP_SUCCESS) {
                pthread_mutex_destroy(&a->mu);
                pthread_cond_destroy(&a->cv);
                ddp__free(a);
                return r;
            }
        }
        *slot = a;
        if (g) g->end_upper = ddp__ck_async_end; /* ddp_destroy and the group's end finish it first */
    }
    *out = a;
    return DDP_SUCCESS;
}

/* Rank 0: copy the tensors into the staging buffer (64-byte aligned pieces; pinned memory when a tensor
   is on the device, copied on g's stream and synchronised), their names, the metadata and options
   (a->path is set already). An error is kept in a->pre, delivered through the agreement. */
static void ddp__ck_async_stage(ddp_group *g, struct ddp__ck_async *a, const char *path, const ddp_tensor *t, int n,
                                const ddp_meta *meta, const ddp_checkpoint_save_desc *desc) {
    size_t total = 0, names = 0, nat = 0;
    char *base = NULL;
    int too_large = 0, on_device = 0;
    ddp_result r;
    int i;
    if (!path || !*path) r = ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: path is NULL or empty");
    else r = ddp__ck_check_tensors(NULL, "checkpoint save", t, n);
    if (r == DDP_SUCCESS) {
        total = ddp__ck_snapshot_bytes(t, n, 1, &too_large);
        on_device = ddp__ck_any_on_device(t, n);
        for (i = 0; i < n; i++) names += strlen(t[i].name) + 1;
        if (too_large) r = ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: the tensors are too large to stage", path);
    }
#ifdef DDP_CUDA
    if (r == DDP_SUCCESS && on_device) {
        char err[DDP__ERR_MAX];
        void *host = NULL;
        if ((r = ddp__cuda_stage_host((ddp__cuda_stage **)&a->pinned, total, &host, err, sizeof err)) != DDP_SUCCESS)
            ddp__fail(NULL, r, "checkpoint save of %s: pinned host memory for the %zu-byte staging copy: %s", path, total, err);
        base = (char *)host;
    }
#endif
    if (r == DDP_SUCCESS && !on_device && total > a->stage_cap) {
        ddp__free(a->stage);
        a->stage_cap = 0;
        if (!(a->stage = (char *)ddp__malloc(total)))
            r = ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory for the %zu-byte staging copy", path, total);
        else a->stage_cap = total;
    }
    if (r == DDP_SUCCESS && !on_device) base = a->stage;
    if (r == DDP_SUCCESS) {
        a->t = (ddp_tensor *)ddp__calloc((size_t)n + 1, sizeof *a->t);
        a->names = (char *)ddp__malloc(names + 1);
        if (!a->path || !a->t || !a->names) r = ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory", path);
    }
    if (r == DDP_SUCCESS) r = ddp__ck_snapshot(NULL, ddp__ck_stream(g), path, t, n, 1, base, a->t);
    for (i = 0; r == DDP_SUCCESS && i < n; i++) {
        size_t len = strlen(t[i].name) + 1;
        a->t[i].name = (const char *)memcpy(a->names + nat, t[i].name, len);
        nat += len;
    }
    a->n = n;
    a->has_meta = meta != NULL;
    for (i = 0; r == DDP_SUCCESS && meta && i < meta->count; i++) r = ddp_meta_set(&a->meta, meta->entries[i].key, meta->entries[i].value);
    a->has_desc = desc != NULL;
    if (desc) a->desc = *desc;
    if (r != DDP_SUCCESS) {
        char *keep = a->path;
        a->path = NULL;
        ddp__ck_async_unstage(a);
        a->path = keep; /* for messages */
        a->pre = r;
        snprintf(a->pre_msg, sizeof a->pre_msg, "%s", ddp_last_error(NULL));
    }
}

DDP_API ddp_result ddp_checkpoint_save_async_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                                const ddp_checkpoint_save_desc *desc, ddp_work **out) {
    struct ddp__ck_async *a = NULL;
    ddp_work *w;
    ddp_result r;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_async");
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_save_async: the ddp_work **w argument is NULL");
    *out = NULL;
    if (g && g->mpi && g->world_size > 1)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_checkpoint_save_async: the mpi backend has no store to make the background "
                         "save's own group from: use ddp_checkpoint_save, or the cpu backend");
    if ((r = ddp__ck_async_state(g, &a)) != DDP_SUCCESS || !a) return r;
    ddp__ck_async_join(a); /* the previous save finishes first: one staged copy at a time */
    if (!(w = (ddp_work *)ddp__calloc(1, sizeof *w))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_save_async: out of memory");
    w->g = g;
    w->owner = &ddp__ck_async_owner;
    w->handle = a;
    if (g ? !ddp__work_issue(g, w) : !ddp__live_add(w, DDP__LIVE_WORK)) {
        ddp__free(w);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_save_async: out of memory recording a ddp_work");
    }
    a->path = ddp__ck_cat(path ? path : "", ""); /* every rank: its messages name the file (NULL: out of memory, staged as such) */
    if (a->rank == 0) ddp__ck_async_stage(g, a, path, t, n, meta, desc);
    a->work = w;
    if (pthread_create(&a->thread, NULL, ddp__ck_async_main, a) == 0) a->thread_live = 1;
    else {
        ddp__ck_async_main(a); /* no thread: save here and now rather than leave the other ranks waiting */
        ddp__ck_async_unstage(a);
        a->work = NULL;
    }
    *out = w;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_checkpoint_save_async(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                             ddp_work **w) {
    return ddp_checkpoint_save_async_ex(g, path, t, n, meta, NULL, w);
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
    if (*fd < 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint: cannot open %s: %s", path, strerror(errno));
    if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint: %s is not a regular file", path);
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
    if (d && d->require_checksums && d->allow_missing_checksums)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint load of %s: require_checksums and allow_missing_checksums are both set "
                         "(allow_missing_checksums is the default now and changes nothing: clear it)", path);
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
        if (k == 0 && d && d->require_checksums)
            return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: tensor \"%.64s\" has no " DDP__CK_CRC_PREFIX " checksum and require_checksums is set "
                             "(a file from another safetensors writer, such as torch's: clear require_checksums to load it unverified)",
                             path, e->name);
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

/* Read t[i]'s data from the file and verify its checksum when the file has one (ddp.h always writes
   them; other writers' files have none); a malformed checksum is refused. */
static ddp_result ddp__ck_read_tensor(ddp_group *g, const char *path, int fd, uint64_t data_start, const ddp__ck_header *h,
                                      const ddp__ck_entry *e, void *dst) {
    uint64_t bytes = e->end - e->begin;
    uint32_t want, got = 0xFFFFFFFFu;
    int k;
    ddp_result r;
#ifdef DDP_CUDA
    if (ddp__ck_on_device(dst, bytes)) r = ddp__ck_read_to_device(g, fd, dst, bytes, data_start + e->begin, path, e->name, &got);
    else
#endif
        r = ddp__ck_read_at(g, fd, dst, bytes, data_start + e->begin, path, &got);
    if (r != DDP_SUCCESS) return r;
    got = ~got;
    k = ddp__ck_stored_crc(h, e->name, &want);
    if (k < 0) return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: the checksum of tensor \"%.64s\" is not 8 hex digits", path, e->name);
    if (k == 0) return DDP_SUCCESS; /* another writer's file: nothing to verify against */
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
    int root = ddp_rank(g) == 0;
    ddp_result r, mine = DDP_SUCCESS;
    memset(&k, 0, sizeof k);
    if (root) r = ddp__ck_load_local(g, path, t, n, meta, d, NULL, &k);
    else {
        scratch = (char *)ddp__malloc(DDP__CK_CHUNK);
        r = scratch ? DDP_SUCCESS : ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "checkpoint load: out of memory for a broadcast buffer");
    }
    if ((r = ddp__agree_outcome(g, r, what)) != DDP_SUCCESS) goto done;
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
        if (ddp__ck_stored_crc(&k.h, k.h.e[sel[2 * j]].name, &want) <= 0) continue;
#ifdef DDP_CUDA
        if (ddp__ck_on_device(to, sel[2 * j + 1])) {
            uint32_t got = 0;
            if ((mine = ddp__ck_device_crc(g, to, sel[2 * j + 1], path, &got)) != DDP_SUCCESS) continue;
            if (got != want)
                mine = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint load of %s: tensor \"%.64s\" arrived from rank 0 with a wrong checksum", path,
                                 k.h.e[sel[2 * j]].name);
            continue;
        }
#endif
        if (ddp__ck_crc32c(to, (size_t)sel[2 * j + 1], 1) != want)
            mine = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint load of %s: tensor \"%.64s\" arrived from rank 0 with a wrong checksum", path,
                             k.h.e[sel[2 * j]].name);
    }
    if (!root && mine == DDP_SUCCESS) mine = ddp__ck_copy_meta(g, &k.h, meta);
    r = ddp__agree_outcome(g, mine, what);
done:
    ddp__ck_kept_free(&k);
    ddp__free(sel);
    ddp__free((void *)dest);
    ddp__free(scratch);
    return r;
}

DDP_API ddp_result ddp_checkpoint_load_ex(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                          const ddp_checkpoint_load_desc *desc) {
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_load_ex");
    ddp__ck_async_settle(g); /* a background save in flight finishes first (it may be this very file) */
    if (desc && desc->broadcast && ddp_world_size(g) > 1) return ddp__ck_load_bcast(g, path, t, n, meta, desc);
    return ddp__agree_outcome(g, ddp__ck_load_local(g, path, t, n, meta, desc, NULL, NULL), "checkpoint load");
}

DDP_API ddp_result ddp_checkpoint_load(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta) {
    return ddp_checkpoint_load_ex(g, path, t, n, meta, NULL);
}

/* ---- list ----
   ddp_checkpoint_list: what a file holds, from its header alone. ddp__ck_open reads the 8-byte length
   and the JSON and parses it exactly as a load does (the layout checked against the file's size: no
   gap, overlap or truncation), so a file that lists is one whose header a load accepts; the data is
   never read, so a wrong checksum is the load's to find (a malformed one is refused here too). The
   entries come back in the order the header lists them (ddp__ck_entry.order, kept by the parser,
   which sorts its entries by data offset): for a file ddp.h wrote that is the order of t[] at save.
   Names are copies owned by the array (ddp_checkpoint_list_free). */
static int ddp__ck_cmp_order(const void *a, const void *b) {
    int x = (*(const ddp__ck_entry *const *)a)->order, y = (*(const ddp__ck_entry *const *)b)->order;
    return (x > y) - (x < y);
}

DDP_API void ddp_checkpoint_list_free(ddp_tensor *t, int n) {
    int i;
    if (!t) return;
    for (i = 0; i < n; i++) ddp__free((void *)t[i].name);
    ddp__free(t);
}

DDP_API ddp_result ddp_checkpoint_list(const char *path, ddp_tensor **tensors, int *n, ddp_meta *meta) {
    ddp__ck_header h;
    ddp__ck_entry **by_order = NULL;
    ddp_tensor *out = NULL;
    ddp_meta got;
    char *raw = NULL;
    uint64_t hlen = 0;
    int fd = -1, i;
    ddp_result r;
    if (tensors) *tensors = NULL;
    if (n) *n = 0;
    if (!tensors || !n) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_list: the tensors or n argument is NULL");
    if (!ddp__ck_little_endian()) return ddp__fail(NULL, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_checkpoint_list: path is NULL or empty");
    if ((r = ddp__ck_open(NULL, path, &fd, &raw, &hlen, &h)) != DDP_SUCCESS) return r;
    close(fd);
    ddp__free(raw);
    memset(&got, 0, sizeof got);
    by_order = (ddp__ck_entry **)ddp__calloc((size_t)h.n + 1, sizeof *by_order);
    out = (ddp_tensor *)ddp__calloc((size_t)h.n + 1, sizeof *out); /* + 1: never NULL on success, even for no tensors */
    if (!by_order || !out) r = ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_list of %s: out of memory", path);
    for (i = 0; r == DDP_SUCCESS && i < h.n; i++) by_order[i] = &h.e[i];
    if (r == DDP_SUCCESS && h.n) qsort((void *)by_order, (size_t)h.n, sizeof *by_order, ddp__ck_cmp_order);
    for (i = 0; r == DDP_SUCCESS && i < h.n; i++) {
        const ddp__ck_entry *e = by_order[i];
        uint32_t crc;
        if (e->ndim > 8)
            r = ddp__fail(NULL, DDP_ERR_UNSUPPORTED, "checkpoint %s: tensor \"%.64s\" has %d dimensions, more than the 8 a ddp_tensor holds",
                          path, e->name, e->ndim);
        else if (ddp__ck_stored_crc(&h, e->name, &crc) < 0)
            r = ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint %s: the checksum of tensor \"%.64s\" is not 8 hex digits", path, e->name);
        else if (!(out[i].name = ddp__strdup(e->name)))
            r = ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_checkpoint_list of %s: out of memory", path);
        else {
            out[i].dtype = ddp__ck_dtypes[e->st].dtype; /* DDP_DTYPE_DEFAULT for BOOL, U16, F8_E4M3, ... */
            out[i].ndim = e->ndim;
            memcpy(out[i].shape, e->shape, sizeof out[i].shape);
            out[i].data = NULL;
        }
    }
    if (r == DDP_SUCCESS && meta) r = ddp__ck_copy_meta(NULL, &h, &got);
    if (r == DDP_SUCCESS) {
        *tensors = out;
        *n = h.n;
        if (meta) {
            ddp_meta_free(meta);
            *meta = got;
        }
    } else {
        ddp_checkpoint_list_free(out, out ? h.n : 0); /* names not yet copied are NULL (calloc) */
        ddp_meta_free(&got);
    }
    ddp__free((void *)by_order);
    ddp__ck_header_free(&h);
    return r;
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
     4. with keep_last, rank 0 broadcasts the cutoff and every rank deletes the old shards of the ranks r
        with r % world == rank: its own, and those of ranks an older, larger group had */
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
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_shard");
    ddp__ck_async_settle(g);
    memset(&fam, 0, sizeof fam);
    memset(&extra, 0, sizeof extra);
    if (!path || !*path) r = ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: path is NULL or empty", what);
    else r = ddp__ck_check_rotation(g, path, desc, &fam, &number);
    if (r == DDP_SUCCESS && rank == 0) {
        id = ddp__ck_new_save_id();
        if (unlink(path) != 0 && errno != ENOENT) r = ddp__fail(g, DDP_ERR_IO, "%s: cannot remove the old completion marker %s: %s", what, path, strerror(errno));
        else r = ddp__ck_sync_dir(g, path);
    }
    if ((r = ddp__agree_outcome(g, r, what)) != DDP_SUCCESS) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &id, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    shard = ddp__ck_shard_path(path, rank);
    if (!shard || ddp__ck_shard_keys(&extra, rank, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    else r = ddp__ck_write_file(g, shard, t, n, meta, &extra, 0);
    if ((r = ddp__agree_outcome(g, r, what)) != DDP_SUCCESS) goto done;
    if (rank == 0) {
        ddp_meta_free(&extra);
        if (ddp__ck_shard_keys(&extra, -1, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
        else r = ddp__ck_write_file(g, path, NULL, 0, NULL, &extra, 0);
        if (r == DDP_SUCCESS && fam.dir) {
            cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
            if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, -1, 1);
        }
    }
    if ((r = ddp__agree_outcome(g, r, what)) != DDP_SUCCESS || !fam.dir) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &cutoff, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, rank, world);
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
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_load_shard");
    ddp__ck_async_settle(g);
    if (!bcast || rank == 0) r = ddp__ck_read_marker(g, path, &info[0], &id);
    if (bcast) {
        info[1] = (int64_t)id;
        if ((r = ddp__agree_outcome(g, r, what)) != DDP_SUCCESS) return r;
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
    return ddp__agree_outcome(g, r, what);
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
