/* [SECTION] checkpoint: safetensors save/load, resume state, per-rank shards (torch.save / load patterns)
   Mirrors the usual PyTorch DDP checkpoint recipe: `if rank == 0: torch.save(...)`, `dist.barrier()`,
   then `torch.load(..., map_location=...)` on every rank; the file format is safetensors, so Python tools
   (safetensors, or twenty lines of json + numpy) read our files and we read theirs: any valid
   safetensors file loads (safetensors.torch.save_file's included), its checksums verified when it has
   ddp.h's (below). ddp_checkpoint_list tells what a file holds, to size the buffers before loading.

   File layout (safetensors): an 8-byte little-endian header length N, N bytes of JSON, then the tensor
   data, raw and little-endian, with no gaps:
       {"__metadata__": {"ddp.step": "1200", "ddp.crc32c.w": "1c291ca3", ...},
        "w": {"dtype": "F32", "shape": [1024, 512], "data_offsets": [0, 2097152]}, ...}
   The header is padded with spaces so the data starts 8-byte aligned. Dtype names: F32 F64 F16 BF16 I8
   U8 I32 I64. Every tensor's CRC32C (Castagnoli, as iSCSI and ext4 use) is kept in the metadata as
   "ddp.crc32c.<name>" (8 lowercase hex digits) and verified on load. Metadata keys starting with
   "ddp.crc32c." or "ddp.shard." are the library's; the rest belong to the caller.
   Checksums on load, by every load path alike (load, load_ex, broadcast, load_shard, load_slices):
   a tensor with a checksum is verified (a mismatch or a malformed value is DDP_ERR_FORMAT); a tensor
   without one (a file from another writer: safetensors, torch, numpy) loads unverified, unless the
   load descriptor's require_checksums asks to refuse it. A truncated or inconsistent file (header
   length, offsets or sizes that do not add up to the file's size, bad JSON) is refused always.
   The tensor data is host memory in the host's byte order, and safetensors is little-endian: on a
   big-endian host every call here returns DDP_ERR_UNSUPPORTED.

   Durability: a save writes "<path>.tmp" in the same directory, fsyncs it, renames it over path and
   fsyncs the directory, so a crash at any moment leaves either the previous file or the new one at
   path, never a torn one. */

/* A named tensor: what to save, or where to load and what to expect. shape[0 .. ndim-1] are the
   dimensions (row-major, as PyTorch's contiguous tensors); ndim 0 is a scalar (one element); a zero
   dimension makes an empty tensor. data is host memory of prod(shape) * ddp_dtype_size(dtype) bytes
   (may be NULL when that is 0). */
typedef struct ddp_tensor {
    const char *name;
    ddp_dtype dtype;
    int ndim; /* 0 .. 8 */
    int64_t shape[8];
    void *data;
} ddp_tensor;

/* ---- Metadata: a string key/value map (safetensors' "__metadata__") -------------------------
   A plain struct the caller owns: `ddp_meta m = {0};` is an empty map; ddp_meta_free(&m) releases it.
   Keys are unique, non-empty UTF-8 strings; values are UTF-8 strings. Read the entries directly
   (entries[0 .. count-1]) or with ddp_meta_get; change them only through these functions.
   Thread safety: a map may be used by one thread at a time. */
typedef struct ddp_meta_entry {
    char *key;
    char *value;
} ddp_meta_entry;
typedef struct ddp_meta {
    ddp_meta_entry *entries;
    int count;
    int capacity;
} ddp_meta;

/* ddp_meta_set: set key to value (a copy of both), replacing an existing value.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for a NULL/empty key, a NULL value or text that is not
   UTF-8; DDP_ERR_OUT_OF_MEMORY. Message in ddp_last_error(NULL). */
DDP_API ddp_result ddp_meta_set(ddp_meta *m, const char *key, const char *value);
/* ddp_meta_get: the value of key, or NULL when the map has no such key. The pointer is valid until the
   map is next changed. */
DDP_API const char *ddp_meta_get(const ddp_meta *m, const char *key);
/* ddp_meta_remove: delete key. Returns 1 when it was there, 0 when not. */
DDP_API int ddp_meta_remove(ddp_meta *m, const char *key);
/* ddp_meta_free: release every entry; the map is then empty (and may be reused). NULL is a no-op. */
DDP_API void ddp_meta_free(ddp_meta *m);

/* Typed values, stored as text so that any safetensors reader sees them.
   ddp_meta_set_int: decimal. ddp_meta_set_bytes: lowercase hex, two digits a byte (e.g. an RNG state).
   ddp_meta_get_int / ddp_meta_get_bytes: DDP_ERR_FORMAT naming the key when it is missing or its value
   is not of that form. get_bytes copies at most capacity bytes and sets *size to the stored size; a
   capacity too small is DDP_ERR_INVALID_ARGUMENT (with *size telling how much is needed). */
DDP_API ddp_result ddp_meta_set_int(ddp_meta *m, const char *key, int64_t value);
DDP_API ddp_result ddp_meta_get_int(const ddp_meta *m, const char *key, int64_t *value);
DDP_API ddp_result ddp_meta_set_bytes(ddp_meta *m, const char *key, const void *data, size_t size);
DDP_API ddp_result ddp_meta_get_bytes(const ddp_meta *m, const char *key, void *data, size_t capacity,
                                      size_t *size);

/* ---- Resume state: what a training loop needs to continue where it stopped ---------------------- */
#define DDP_META_STEP "ddp.step"                         /* optimizer steps taken */
#define DDP_META_EPOCH "ddp.epoch"                       /* the epoch given to ddp_sampler_set_epoch */
#define DDP_META_SAMPLER_POSITION "ddp.sampler_position" /* samples of this epoch already consumed */
#define DDP_META_WORLD_SIZE "ddp.world_size"             /* ranks that trained up to this point */
#define DDP_META_RNG_STATE "ddp.rng_state"               /* the program's RNG state, as hex bytes */
#define DDP_META_SAMPLER_GLOBAL_POSITION "ddp.sampler_global_position" /* samples of the epoch consumed by all ranks */

typedef struct ddp_resume_state {
    int64_t step;
    int64_t epoch;
    /* how many of this epoch's ddp_sampler_indices() the rank has consumed (ddp_sampler_position): with
       the same world size, resume by skipping that many (ddp_sampler_set_position). */
    int64_t sampler_position;
    int world_size;
    /* set: the rng_state_size bytes at rng_state are stored (none when rng_state_size is 0).
       get: rng_state is a buffer of rng_state_size bytes; on return rng_state_size is the stored size
       (0 when the checkpoint has none). */
    void *rng_state;
    size_t rng_state_size;
    /* how many of the epoch's dealt-out indices all ranks together consumed (ddp_sampler_global_position
       on rank 0): resume on ANY world size with ddp_sampler_resume(s, epoch, sampler_global_position).
       set: 0 with a sampler_position > 0 (a program that does not fill it in) stores
       sampler_position * world_size, which is that number for a sampler that never resized. get: a
       checkpoint without the key (older ones) gives sampler_position * world_size the same way. */
    int64_t sampler_global_position;
} ddp_resume_state;

/* ddp_meta_set_resume: store every field of s under the DDP_META_* keys above.
   ddp_meta_get_resume: read them back; DDP_ERR_FORMAT names a missing or malformed key (the RNG state
   alone is optional); DDP_ERR_INVALID_ARGUMENT when the RNG buffer is too small. */
DDP_API ddp_result ddp_meta_set_resume(ddp_meta *m, const ddp_resume_state *s);
DDP_API ddp_result ddp_meta_get_resume(const ddp_meta *m, ddp_resume_state *s);

/* ---- Save and load -------------------------------------------------------------------------- */

/* Device tensors: in a build with -DDDP_CUDA linked with ddp_cuda.o, a tensor's data may be device
   memory (cudaMalloc'd or managed), mixed freely with host tensors, in ddp_checkpoint_save(_ex),
   _save_async(_ex), _save_shard, _save_slices, _load(_ex) and _load_shard (not yet _load_slices: it
   refuses device slices with DDP_ERR_UNSUPPORTED). The file is written from and read into
   pinned host memory (cudaMallocHost), so it is byte for byte the one host tensors with the same values
   give. The copies are cudaMemcpyAsync on the group's stream (ddp_set_stream; default the legacy default
   stream) followed by cudaStreamSynchronize of that stream, on the calling thread: they see what the
   program queued on that stream before the call, and a load's values are on the device when it returns.
     save        rank 0 (each rank for a shard) copies its device tensors to pinned memory made for the
                 call, then writes from there (cost: one device-to-host copy of the state and one
                 cudaMallocHost per save).
     save_async  the snapshot copies the device tensors into the save's staging buffer (pinned memory
                 then, kept for the next async save) and synchronises before the call returns, so the
                 program may overwrite its device tensors at once (torch's async_save stages to the CPU
                 first too). This staging is synchronous, not on a side stream: the call costs one
                 device-to-host copy of the state (about state bytes / PCIe bandwidth); the write is
                 in the background as for host tensors.
     load        each device tensor is read into pinned memory (its checksum verified there) and copied
                 to the device; with broadcast = 1 rank 0 does the same, the other ranks receive into
                 device memory through the group's collective and verify the checksum on a host copy.
   A CUDA error while copying (a tensor longer than its allocation, a bad pointer) is DDP_ERR_SYSTEM on
   every rank, naming the tensor and the copy; no file is written (path and "<path>.tmp" untouched). */

/* Save options; zero-initialised (or NULL) means the defaults. */
typedef struct ddp_checkpoint_save_desc {
    /* > 0: after a successful save, delete the older checkpoints of the same family, keeping the
       keep_last newest (this one included). The family of ".../ckpt_000300.safetensors" is every file
       of that directory whose name differs only in that last run of digits (ckpt_000100.safetensors,
       ckpt_200.safetensors, ...), ordered by the number; path must have such a run of 1 to 18 digits
       (a file whose run is longer, e.g. ckpt_12345678901234567890.safetensors, is not a member and is
       left alone). Leftover "<name>.tmp" files of older family members (from a crash) are deleted too.
       0 (default): delete nothing. */
    int keep_last;
} ddp_checkpoint_save_desc;

/* Load options; zero-initialised (or NULL) means the defaults. */
typedef struct ddp_checkpoint_load_desc {
    /* 0 (default): every rank reads path itself (a shared filesystem, or a copy on every host).
       1: only rank 0 reads it; the header and the tensors go to the other ranks by ddp_broadcast
       (no shared filesystem). The buffers are then handed to the group's collectives, so with the
       nccl backend use 0 (or a cpu subgroup). Shards: rank 0 reads the completion marker and
       broadcasts it; each rank still reads its own shard. */
    int broadcast;
    /* 1: tensors in the file that t[] does not list are skipped, as load_state_dict(strict=False).
       0 (default): they are DDP_ERR_MISMATCH, naming one. Tensors listed in t[] must always be there. */
    int allow_unexpected;
    /* Kept so that programs that set it still compile: accepting tensors without a checksum is the
       default now, so this changes nothing (setting it together with require_checksums is
       DDP_ERR_INVALID_ARGUMENT). */
    int allow_missing_checksums;
    /* 1: every tensor loaded must have its "ddp.crc32c.<name>" checksum (files ddp.h wrote); one
       without is DDP_ERR_FORMAT naming it. 0 (default): tensors without a checksum (files from other
       safetensors writers, e.g. torch's) load unverified; checksums that are present are always
       verified. */
    int require_checksums;
} ddp_checkpoint_load_desc;

/* ddp_checkpoint_save: write the n tensors t[] and the metadata meta (may be NULL) to path, durably and
   atomically (see above). Collective over g when g is not NULL: rank 0 writes, the others pass the same
   arguments (which only rank 0 reads) and wait; when it returns DDP_SUCCESS on any rank, the file is
   complete and durable. A failure on rank 0 is the same error on every rank, with rank 0's message.
   g may be NULL: a single process.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT (a bad tensor, a duplicate or reserved name, keep_last
   without a number in path); DDP_ERR_IO (could not write, sync or rename: path is then unchanged);
   DDP_ERR_UNSUPPORTED (big-endian host); the group's errors.
   Thread safety: as the group's collectives; without a group, one call per path at a time. */
DDP_API ddp_result ddp_checkpoint_save(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                       const ddp_meta *meta);
DDP_API ddp_result ddp_checkpoint_save_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                          const ddp_meta *meta, const ddp_checkpoint_save_desc *desc);

/* ddp_checkpoint_save_async: ddp_checkpoint_save in the background (torch.distributed.checkpoint's
   async_save): the call copies the tensors (and meta, path, desc) into one staging buffer on rank 0 and
   returns; a background thread then writes the same file as ddp_checkpoint_save would (same format,
   checksums, tmp + fsync + rename, keep_last) and completes *w. The tensors may change as soon as the
   call returns (device tensors too: see "Device tensors" above). Collective over g when g is not NULL, as ddp_checkpoint_save; the ranks agree on the
   outcome in the background on a private group of the same ranks (made at the first async save), so
   the program's own collectives go on meanwhile. ddp_wait(*w) returns DDP_SUCCESS on a rank once the
   file is complete and durable; a failure anywhere (rank 0 could not write: the message names the
   path and the system's reason; a bad argument rank 0 found while staging) is the error of every
   rank's ddp_wait. ddp_test(*w) polls. Call ddp_wait once per handle, as for async collectives.
   At most one save is in flight per group: a second async save, or any other ddp_checkpoint_* call on
   the group, first waits for the one in flight. The staging buffer is kept for the next async save
   (so its copy does not pay page faults again) and freed by ddp_destroy(g); ddp_destroy finishes a
   save in flight first (its handle, if not waited on, is then released). g NULL: one process; its
   staging buffer lives until the process ends.
   Return (of the call): DDP_SUCCESS with *w set; DDP_ERR_INVALID_ARGUMENT (w NULL); DDP_ERR_UNSUPPORTED
   (the mpi backend with more than one rank: use ddp_checkpoint_save); the errors of making the private
   group (first call); DDP_ERR_OUT_OF_MEMORY. Errors of the save itself come from ddp_wait.
   Thread safety: as ddp_checkpoint_save. */
DDP_API ddp_result ddp_checkpoint_save_async(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                             const ddp_meta *meta, ddp_work **w);
DDP_API ddp_result ddp_checkpoint_save_async_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                                const ddp_meta *meta, const ddp_checkpoint_save_desc *desc,
                                                ddp_work **w);

/* ddp_checkpoint_load: read path into the n tensors t[] and (when meta is not NULL) replace meta's
   contents with the file's metadata (the library's "ddp.crc32c.*"/"ddp.shard.*" keys left out).
   Each t[i] says what the caller expects: name, dtype and shape must match the file exactly, or the
   error names the tensor and both sides. Checksums are verified where the file has them (any valid
   safetensors file loads; desc->require_checksums refuses one without). Collective over g when g is
   not NULL (see desc->broadcast); a failure on any rank is an error on every rank, naming that rank.
   Return: DDP_SUCCESS; DDP_ERR_IO (cannot open or read); DDP_ERR_FORMAT (not a valid safetensors file,
   a checksum does not match, or is missing under require_checksums: the message says what is wrong);
   DDP_ERR_MISMATCH (names, dtypes or shapes differ from t[]); DDP_ERR_UNSUPPORTED (a dtype ddp.h lacks
   in a tensor you asked for, more than 8 dimensions, big-endian host); DDP_ERR_INVALID_ARGUMENT (also
   require_checksums together with allow_missing_checksums); the group's errors. On an error the
   contents of the tensors and of meta are unspecified.
   Thread safety: as ddp_checkpoint_save. */
DDP_API ddp_result ddp_checkpoint_load(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta);
DDP_API ddp_result ddp_checkpoint_load_ex(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                          const ddp_checkpoint_load_desc *desc);

/* ddp_checkpoint_list: what the file at path holds, to size buffers before ddp_checkpoint_load (a
   data set or a model of unknown size). Reads the header only, never the data, and validates it as
   strictly as a load does (the JSON, the dtypes, offsets consistent with each other and with the
   file's size), so a truncated or inconsistent file is an error here too; checksums are not verified
   (the load does that). Local: not collective, no group (every rank may call it, or rank 0 and
   broadcast the shapes).
   Parameters: *tensors receives a new array of *n tensors, in the order the file's header lists them
   (for a file ddp.h wrote: the order of t[] at the save; safetensors' own writer lists them in the
   order of their data), each with its name (a copy owned by the array), dtype, ndim and shape, and
   data NULL. A tensor of a safetensors dtype ddp.h cannot load (BOOL, I16, U16, U32, U64, F8_E5M2,
   F8_E4M3) has dtype DDP_DTYPE_DEFAULT: skip it with allow_unexpected. meta (may be NULL) receives the
   metadata as ddp_checkpoint_load gives it (its contents replaced; the library's keys left out).
   Free the array with ddp_checkpoint_list_free(*tensors, *n) (it is not NULL on success, even for a
   file without tensors).
   Return: DDP_SUCCESS; DDP_ERR_IO (cannot open or read); DDP_ERR_FORMAT (not a valid safetensors file:
   the message says what is wrong); DDP_ERR_UNSUPPORTED (a tensor with more than 8 dimensions, a
   big-endian host); DDP_ERR_INVALID_ARGUMENT (path, tensors or n NULL); DDP_ERR_OUT_OF_MEMORY. On an
   error *tensors is NULL, *n is 0 and meta is unchanged; the message is in ddp_last_error(NULL).
   Thread safety: any thread.
   Example: load a file of unknown shapes.
       ddp_tensor *t; int n, i;
       if (ddp_checkpoint_list("data.safetensors", &t, &n, NULL) != DDP_SUCCESS) die(ddp_last_error(NULL));
       for (i = 0; i < n; i++) {
           size_t count = 1; int d;
           for (d = 0; d < t[i].ndim; d++) count *= (size_t)t[i].shape[d];
           t[i].data = malloc(count * ddp_dtype_size(t[i].dtype)); (a DDP_DTYPE_DEFAULT tensor: leave it
       }                                                           out and set allow_unexpected)
       ddp_checkpoint_load(NULL, "data.safetensors", t, n, NULL);
       ... use t[i].data; free each, then ddp_checkpoint_list_free(t, n); */
DDP_API ddp_result ddp_checkpoint_list(const char *path, ddp_tensor **tensors, int *n, ddp_meta *meta);
/* ddp_checkpoint_list_free: free an array from ddp_checkpoint_list and its names (not the data
   pointers, which the program set). NULL is a no-op. */
DDP_API void ddp_checkpoint_list_free(ddp_tensor *t, int n);

/* ---- Per-rank shards (e.g. ZeRO-style optimizer state) ---------------------------------------
   ddp_checkpoint_save_shard: every rank saves its own t[] and meta to "<path>.rank<r>" (r in decimal),
   durably; once every shard is durable, rank 0 writes the completion marker at path itself: a
   safetensors file without tensors whose metadata holds "ddp.shard.world_size" and a random
   "ddp.shard.save_id" that every shard of this save carries too. Before any shard is written, rank 0
   removes an old marker at path, so a save cut short is never taken for a complete one (use distinct
   paths, e.g. a step number with keep_last, to always keep a complete previous checkpoint).
   keep_last: rank 0 deletes the old markers, then the old shards go, every "<old marker>.rank<r>" (and
   its ".tmp") whichever group wrote it: rank q deletes those with r % world_size == q, its own and
   those of ranks the group no longer has (a save resumed on fewer ranks), so each file has exactly one
   deleter and no two ranks race on a name. Collective over g.
   ddp_checkpoint_load_shard: check that the marker exists (else DDP_ERR_IO: the save did not finish,
   or the path is wrong), that it was written by a group of this size (else DDP_ERR_MISMATCH), then
   load this rank's shard as ddp_checkpoint_load does and check that it belongs to that save
   (DDP_ERR_FORMAT if not: a later save to the same path was cut short).
   Return and thread safety: as ddp_checkpoint_save / ddp_checkpoint_load. */
DDP_API ddp_result ddp_checkpoint_save_shard(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                             const ddp_meta *meta, const ddp_checkpoint_save_desc *desc);
DDP_API ddp_result ddp_checkpoint_load_shard(ddp_group *g, const char *path, ddp_tensor *t, int n,
                                             ddp_meta *meta, const ddp_checkpoint_load_desc *desc);

/* ---- Slices of global tensors: saved by N ranks, loaded by M (resharding) --------------------------
   A ddp_slice is elements [offset, offset + count) of the one-dimensional tensor `name` (flatten others)
   whose whole has global_count elements: ZeRO's optimizer state, a sharded embedding, anything the ranks
   hold in pieces. ddp_checkpoint_save_slices: every rank saves its slices as ddp_checkpoint_save_shard
   saves tensors ("<path>.rank<r>" per rank, then the completion marker at path; desc as there), each one
   the tensor "<name>@<offset>/<global_count>" (name + that suffix: at most 127 bytes); slices of 0
   elements are not stored. ddp_checkpoint_load_slices: every rank asks for any slices - the world size
   and the split may differ from the save's (resharding, as torch.distributed.checkpoint) - and gets them
   from whichever shards hold them: it reads the header of every shard and each saved piece that overlaps
   one of its requests (checksum verified), and copies the overlap. meta (may be NULL) receives the
   metadata of rank 0's shard. Both are collective over g (g NULL: one process); a failure on any rank
   is an error on every rank, naming the rank.
   Each element is saved by exactly one rank: before any file is written, the ranks exchange their
   slices (an all_gather of name, dtype, global_count, offset and count) and every rank checks the same
   list, so all refuse together, with the same DDP_ERR_INVALID_ARGUMENT, and none writes, when two
   slices of a tensor overlap ("rank 0 saves "w" [0, 6) and rank 1 saves "w" [0, 4)": a tensor every
   rank holds whole, replicated, belongs in ddp_checkpoint_save, saved once) or disagree on
   global_count or dtype. Ranges nobody saves are allowed at save time.
   Every requested element must be found exactly once: a hole (elements no rank saved: the message
   names the first missing range, "lacks elements [8, 10) of "w""), another dtype or another
   global_count is DDP_ERR_MISMATCH; elements two saved pieces hold (a save from before the overlap
   check) are DDP_ERR_FORMAT naming the range and both ranks, as which copy is right cannot be told.
   Return: as ddp_checkpoint_save_shard / ddp_checkpoint_load_shard; DDP_ERR_INVALID_ARGUMENT for a slice
   outside its tensor, without a name or data, or overlapping another (save); DDP_ERR_FORMAT for a
   shard that holds other tensors or pieces that overlap (load).
   Thread safety: as ddp_checkpoint_save. */
typedef struct ddp_slice {
    const char *name;
    ddp_dtype dtype;
    size_t global_count; /* elements of the whole tensor */
    size_t offset, count; /* this slice: elements [offset, offset + count) */
    void *data;           /* count elements of dtype */
} ddp_slice;
DDP_API ddp_result ddp_checkpoint_save_slices(ddp_group *g, const char *path, const ddp_slice *s, int n, const ddp_meta *meta,
                                              const ddp_checkpoint_save_desc *desc);
DDP_API ddp_result ddp_checkpoint_load_slices(ddp_group *g, const char *path, ddp_slice *s, int n, ddp_meta *meta);

/* ---- FSDP checkpoints (zero_stage 3; reducer.h "FSDP") -----------------------------------------------
   Sharded (torch's SHARDED_STATE_DICT): each rank saves its master shards (and optimizer state) as slices,
   one ddp_slice per ddp_reducer_shards entry and state: {"h3.qkvw", t, global_count = the parameter's
   count, offset = shard.offset, count = shard.count, data = shard.param_data (or the state's piece)};
   ddp_checkpoint_save_slices / ddp_checkpoint_load_slices with the loading reducer's shards reload on
   any world size, communication-free.
   Whole (torch's FULL_STATE_DICT, rank0_only): ddp_fsdp_save_full(r, path, root, meta) writes one
   ordinary safetensors file of the whole model on rank root, streaming it unit by unit: root lays out
   the file from the registered names, dtypes and shapes (ddp_reducer_param_shape; else 1-D tensors of
   the registered counts), then gathers each unit's master shards and writes its parameters, so root
   holds one unit (the largest gathered master: world * per elements) besides its own state, never the
   model. The values are the master shards' (the registered dtype, never param_dtype copies). torch reads
   the file with safetensors.torch.load_file; written atomically, checksummed per tensor, as
   ddp_checkpoint_save's. Collective over the reducer's group; between passes; an error on any rank is
   every rank's (DDP_ERR_STATE: not zero_stage 3, during a backward pass; DDP_ERR_INVALID_ARGUMENT: bad
   root; DDP_ERR_IO; a gather's error).
   Loading a whole file into stage 3: ddp_checkpoint_load_slices also takes an ordinary safetensors file
   (ddp_checkpoint_save's, torch's, ddp_fsdp_save_full's): each slice is read from the tensor of its name
   (flattened; global_count must be its element count), and a rank reads only its slices' bytes. A slice
   that is a whole tensor is checked against the tensor's checksum; a part of one cannot be. */
DDP_API ddp_result ddp_fsdp_save_full(ddp_reducer *r, const char *path, int root, const ddp_meta *meta);

/* ddp_checkpoint_latest: find the newest checkpoint of a family, to resume from. pattern is a path
   whose file name holds one '*' standing for a run of 1 to 18 digits ("ckpt/model_*.safetensors"); the
   file (or shard marker) with the largest number wins. A name with any other text in the place of the
   '*' (such as "<name>.tmp" leftovers), or a longer run of digits, never matches. Not collective; rank 0 may call it and broadcast.
   Parameters: out receives the path (capacity bytes, terminator included); number (may be NULL)
   receives its number.
   Return: DDP_SUCCESS with out = "" and *number = -1 when there is none yet; DDP_ERR_INVALID_ARGUMENT
   (no single '*' in the file name, or out too small); DDP_ERR_IO (the directory cannot be read).
   Thread safety: any thread. */
DDP_API ddp_result ddp_checkpoint_latest(const char *pattern, char *out, size_t capacity, int64_t *number);
