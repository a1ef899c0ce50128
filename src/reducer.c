/* [SECTION] reducer: DistributedDataParallel's Reducer: model check, buckets, overlapped all-reduce
   (torch/csrc/distributed/c10d/reducer.cpp, torch/nn/parallel/distributed.py)

   Life of a reducer:
     add_param / add_buffer   the model, in registration (forward) order
     finalize                 1. all_gather a fingerprint {params, buffers, hash of names, counts, dtypes};
                                 if the ranks differ, all_gather fixed-size records of every entry and
                                 name the first that differs (the same message on every rank)
                              2. broadcast parameters and buffers from rank 0 (small ones coalesced)
                              3. buckets in reverse registration order
     begin_backward           (uneven_inputs) the join round, see "uneven inputs" at the end; every bucket
                              waits for all of its gradients
     grad_ready(i)            copy gradient i * (1/world) into its bucket slot; start every complete
                              bucket that is next in line (buckets start strictly in order)
     end_backward             (find_unused) zero the missing gradients' slots, start the rest, all-reduce
                              the "used" map; wait for each bucket and copy it back; start the timing
                              exchange (see "timing"); after the first synchronised pass, rebuild the
                              buckets in rank 0's ready order once
     join, join_step          (uneven_inputs) shadow the others' passes until every rank has joined
                              (join_step: one pass per call; under zero_stage the program steps its
                              shards and gathers between the calls)

   Where gradients live (g = the gradients' dtype, c = the communication dtype):
     plain                     program's grad --(x 1/world, g -> c)--> comm bucket --all-reduce--> grad
     gradient_as_bucket_view   storage bucket (g) IS the grad; comm bucket = storage when c == g (the
                              scaling is then in place), else a separate c-typed copy as above
     zero_stage = 1            grad or storage --(x 1/world)--> the reducer's own comm bucket, padded to
                              world slices --reduce-scatter--> this rank's slice --> the owned part of the
                              grad or storage only (see "ZeRO stage 1" below); gather_params all-gathers
                              the owned parameter values through a staging bucket (the comm bucket when
                              c == g)
     zero_stage = 2            grad --(x 1/world, g -> c)--> a pool buffer the bucket borrows (2 buffers of
                              the largest padded bucket, in rotation) --reduce-scatter--> this rank's
                              slice, kept by the reducer in g (c -> g when the reduce-scatter is waited
                              for); nothing goes back to the program's grad (see "ZeRO stage 2" below)

   Bucket assignment (PyTorch's compute_bucket_assignment_by_size): walk the parameters in a given order
   (reverse registration at first, then the observed ready order); each dtype has one open bucket; add the
   parameter to it; when the bucket's bytes reach its limit, close it; the first bucket of a dtype has
   limit first_bucket_bytes, later ones bucket_cap_bytes. Buckets are numbered by the walk position of
   their first parameter, which is the order they fill in, and so the order they are all-reduced in. */
#include "internal.h"

#define DDP__REDUCER_DEFAULT_CAP ((size_t)25 << 20)        /* DDP's bucket_cap_mb = 25 */
#define DDP__REDUCER_DEFAULT_FIRST ((size_t)1 << 20)       /* dist._DEFAULT_FIRST_BUCKET_BYTES */
#define DDP__REDUCER_BROADCAST_CHUNK ((size_t)250 << 20)   /* DDP's broadcast_bucket_size */
#define DDP__REDUCER_SMALL_TENSOR ((size_t)1 << 20)        /* smaller tensors are coalesced for broadcast */
#define DDP__REDUCER_NAME_RECORD 72                        /* name bytes in a mismatch record */
#define DDP__VERIFY_FIELDS 5                               /* a model record: see ddp__reducer_verify */
#define DDP__JOIN_FIELDS 3                                 /* a join record: kind, flags, steps */
enum { DDP__JOIN_JOINED = 0, DDP__JOIN_STEP = 1, DDP__JOIN_BUFFERS = 2 }; /* a join record's kind */
enum { DDP__JOIN_SYNC = 1, DDP__JOIN_FIRST = 2 };                         /* and its flags */

/* ---- the backend's memory: what the reducer asks of a backend (ddp__backend in internal.h) ----
   Buckets are in the backend's memory (host memory for cpu and mpi; device memory for nccl, where the
   copies run on the group's stream). Besides these, finalize and the rebuild pass small host arrays to
   ddp_all_gather and ddp_broadcast (the model check, the ready order) and broadcast parameters and
   buffers where they are: a backend whose collectives take device memory accepts host memory for
   those (nccl runs them on its host transport). The functions below are the host versions, which every
   backend but nccl uses. */

/* Bucket memory comes from ddp_alloc (zero-filled): on a group that shares one host it lives in this
   rank's arena of the shared segment, so the buckets' all-reduces read the peers' buckets directly (the
   single-copy design, (3p-1)N bytes of memory traffic instead of (5p+1)N); elsewhere it is heap memory. */
static void *ddp__host_alloc(ddp_group *g, size_t bytes) { return ddp_alloc(g, bytes); }
static void ddp__host_release(ddp_group *g, void *p) { ddp_free(g, p); }
static void ddp__host_zero(ddp_group *g, void *dst, size_t bytes) {
    ddp__devbuf_plan plan;
    const void *none = NULL;
    int staged = bytes ? ddp__devbuf_copy_begin(g, &dst, bytes, &none, 0, &plan) : 0; /* device memory: devbuf.c */
    if (staged < 0) return;
    if (bytes) memset(dst, 0, bytes);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

/* One element of a floating dtype, as f32 (f64 keeps its precision through ddp__load_f64). */
static float ddp__get_f32(const void *p, ddp_dtype t, size_t i) {
    switch (t) {
    case DDP_F32: return ((const float *)p)[i];
    case DDP_F64: return (float)((const double *)p)[i];
    case DDP_F16: return ddp_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ddp_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}
static void ddp__put_f32(void *p, ddp_dtype t, size_t i, float v) {
    switch (t) {
    case DDP_F32: ((float *)p)[i] = v; break;
    case DDP_F64: ((double *)p)[i] = (double)v; break;
    case DDP_F16: ((uint16_t *)p)[i] = ddp_f32_to_f16(v); break;
    default: ((uint16_t *)p)[i] = ddp_f32_to_bf16(v); break;
    }
}

static void ddp__host_convert_scaled(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count,
                                     double scale) {
    size_t i;
    if (dst_t == src_t && scale == 1.0) {
        if (dst != src && count) memcpy(dst, src, count * ddp_dtype_size(dst_t));
        return;
    }
    if (dst_t == DDP_F32 && src_t == DDP_F32) { /* the common case, kept simple enough to vectorise */
        float *d = (float *)dst, s = (float)scale;
        const float *x = (const float *)src;
        for (i = 0; i < count; i++) d[i] = x[i] * s;
        return;
    }
    if (dst_t == DDP_F64 || src_t == DDP_F64) {
        for (i = 0; i < count; i++) {
            double v = (src_t == DDP_F64 ? ((const double *)src)[i] : (double)ddp__get_f32(src, src_t, i)) * scale;
            if (dst_t == DDP_F64)
                ((double *)dst)[i] = v;
            else
                ddp__put_f32(dst, dst_t, i, (float)v);
        }
        return;
    }
    {
        float s = (float)scale;
        for (i = 0; i < count; i++) ddp__put_f32(dst, dst_t, i, ddp__get_f32(src, src_t, i) * s);
    }
}

static void ddp__host_convert(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    size_t i;
    if (dst_t == src_t) {
        if (dst != src && count) memcpy(dst, src, count * ddp_dtype_size(dst_t));
        return;
    }
    if (dst_t == DDP_F64) {
        for (i = 0; i < count; i++) ((double *)dst)[i] = (double)ddp__get_f32(src, src_t, i);
        return;
    }
    for (i = 0; i < count; i++) ddp__put_f32(dst, dst_t, i, ddp__get_f32(src, src_t, i));
}

/* The copies on host memory; a gradient or parameter in device memory (on the cpu and mpi backends, in a
   build with DDP_CUDA) is staged through the group's pinned memory around them (devbuf.c). */
static void ddp__host_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                    size_t count, double scale) {
    ddp__devbuf_plan plan;
    int staged = count ? ddp__devbuf_copy_begin(g, &dst, count * ddp_dtype_size(dst_t), &src,
                                                count * ddp_dtype_size(src_t), &plan) : 0;
    if (staged < 0) return;
    ddp__host_convert_scaled(dst, dst_t, src, src_t, count, scale);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

static void ddp__host_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    ddp__devbuf_plan plan;
    int staged = count ? ddp__devbuf_copy_begin(g, &dst, count * ddp_dtype_size(dst_t), &src,
                                                count * ddp_dtype_size(src_t), &plan) : 0;
    if (staged < 0) return;
    ddp__host_convert(dst, dst_t, src, src_t, count);
    if (staged) ddp__devbuf_copy_end(g, &plan);
}

/* ---- the reducer's state ---- */

typedef struct ddp__rtensor { /* a registered parameter or buffer */
    char *name;
    void *data;  /* the parameter's values, or the buffer */
    void *grad;  /* the program's gradient (plain mode); NULL for views and buffers */
    size_t count;
    ddp_dtype dtype;
} ddp__rtensor;

typedef struct ddp__bucket {
    ddp_dtype dtype;      /* the gradients' */
    ddp_dtype comm_dtype; /* what travels */
    int first, n;         /* its parameters are layout.params[first .. first + n) */
    size_t count;         /* elements */
    void *storage;        /* gradient_as_bucket_view, or flat: the gradients themselves; else NULL */
    int flat;             /* storage is the program's own gradient memory (its gradients lie side by side) */
    void *comm;           /* what is all-reduced; == storage for a view without compression; zero_stage: the
                             reducer's own, padded with zeros to world * per elements; zero_stage 2: a
                             pool buffer, borrowed from the first gradient until the reduce-scatter is
                             waited for (NULL otherwise) */
    size_t per;           /* zero_stage: elements of each rank's slice, ceil(count / world) */
    void *owned;          /* zero_stage: the reduce-scatter's result, this rank's slice (per, comm dtype);
                             zero_stage 2: the averaged gradient of the slice (per, the gradients' dtype) */
    void *gather;         /* zero_stage: gather_params' staging (world * per, the gradients' dtype; == comm
                             when that has the same dtype); zero_stage 2: a pool buffer during gather_params */
    int slot;             /* zero_stage 2: the pool buffer that comm is, while the bucket holds one */
    int pending;          /* gradients still to come in this backward pass */
    ddp_work *work;       /* its all-reduce, while in flight */
} ddp__bucket;

typedef struct ddp__layout {
    ddp__bucket *buckets;
    int nbuckets;
    int *params;          /* parameter indices, grouped by bucket, in walk order */
    int *param_bucket;    /* per parameter */
    size_t *param_offset; /* per parameter: element offset in its bucket */
    int flat_buckets;     /* buckets that are slices of the program's gradient memory */
} ddp__layout;

struct ddp_reducer {
    ddp_group *g;
    const ddp__backend *ops; /* its group's backend: bucket memory and copies */
    ddp_reducer_desc desc; /* defaults filled in */
    ddp__rtensor *params, *buffers;
    int nparams, nbuffers, cap_params, cap_buffers;
    int finalized;
    ddp_result failed; /* an error that stopped the reducer (the group is broken); 0 when healthy */

    ddp__layout L;
    int in_backward;   /* between begin_backward and end_backward */
    int sync;          /* set_sync: applies to the next backward pass */
    int pass_sync;     /* the current pass is synchronised */
    int next_bucket;   /* the next bucket to start */
    unsigned char *ready; /* per parameter: grad_ready in this backward pass */
    unsigned char *used;  /* per parameter: grad_ready since the last synchronised backward */
    unsigned char *used_comm; /* find_unused: the used map as all-reduced (MAX), backend memory */
    unsigned char *used_global; /* find_unused: its result, back in host memory */
    int *order;        /* ready order of the first synchronised pass, for the rebuild */
    int norder;
    int rebuild_pending;
    void *stash;       /* view without compression + find_unused: gradients of unused parameters */
    size_t stash_bytes;
    ddp_shard *shards; /* zero_stage: this rank's pieces of the model, in bucket order */
    int nshards;
    int *shard_bucket; /* per shard: its bucket */
    void **pool;       /* zero_stage 2: npool full-size comm buffers (room for nbuckets), see "ZeRO stage 2" */
    int *pool_holder;  /* per pool buffer: the bucket that holds it, -1 when free */
    int npool, pool_room;
    size_t pool_bytes, pool_land; /* bytes per buffer; where the reduce-scatter lands under compression */
    void *bstage;      /* staging for coalesced buffer broadcasts */
    size_t bstage_bytes;

    /* uneven_inputs (Join): see "uneven inputs" below */
    int32_t *join_table;  /* world records of DDP__JOIN_FIELDS: the last round's announcements */
    int join_steps;       /* backward passes this rank announced since the last join */
    int join_joined;      /* this rank is in a join: its first round was announced, not every rank joined yet */
    int gathering;        /* zero_stage: a gather_params_async whose buckets are not all waited for yet */
    int gather_next;      /* the next bucket to start, counted in the order forward reads them (last first) */
    int join_gather_due;  /* zero_stage: a shadowed pass gave this joined rank's shards averaged gradients; the
                             program's optimizer step and gather_params come before the next join_step */
    void *shadow;         /* joined rank: zeros for the buckets whose comm memory is the program's gradient */
    size_t shadow_bytes;

    /* timing: see "straggler or transfer" below */
    int64_t *ready_ns;    /* world + 1: every rank's ready time (wall clock, ns), then this rank's own */
    void *ready_comm;     /* the same in the backend's memory, for the all_gather */
    ddp_work *ready_work; /* that all_gather, in flight from end_backward until the pass's timing is done */
    int ready_discard;    /* the pass in flight was a joined rank's shadow: nothing to account */
    double t_ready;       /* this pass: the last bucket started (this rank's gradients all there) */
    double t_enter, t_done, wall_minus_mono; /* this pass: end_backward's entry and end; clock offset */

    ddp_reducer_statistics stats;
    double t_begin, t_first_start;
};

static size_t ddp__reducer_n(const ddp_reducer *r) { return (size_t)(unsigned)r->nparams; } /* never negative */
static int ddp__reducer_is_view(const ddp_reducer *r) { return r->desc.gradient_as_bucket_view; }
static int ddp__reducer_zero(const ddp_reducer *r) { return r->desc.zero_stage != 0; }
static int ddp__zero2(const ddp_reducer *r) { return r->desc.zero_stage == 2; }
/* Gradients scaled and reduced in place in the bucket (a view without compression). */
static int ddp__bucket_in_place(const ddp__bucket *b) { return b->storage != NULL && b->comm == b->storage; }
static size_t ddp__tensor_bytes(const ddp__rtensor *t) { return t->count * ddp_dtype_size(t->dtype); }

/* ---- creation and registration ---- */

/* zero_stage: what is implemented, and the combinations refused (see "ZeRO" in reducer.h). */
static ddp_result ddp__zero_check_desc(ddp_group *g, const ddp_reducer_desc *d) {
    if (d->zero_stage < 0 || d->zero_stage > 2)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: zero_stage %d is not 0 (DDP), 1 (ZeRO-1: "
                         "optimizer state sharded) or 2 (ZeRO-2)", d->zero_stage);
    if (d->zero_stage == 2 && d->gradient_as_bucket_view)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: zero_stage = 2 with gradient_as_bucket_view = 1 "
                         "is not supported: the buckets would have to hold every gradient, which is what ZeRO-2 frees; "
                         "register your own gradient buffers (gradient_as_bucket_view = 0) or use zero_stage = 1");
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_create(ddp_group *g, const ddp_reducer_desc *d, ddp_reducer **out) {
    ddp_reducer_desc desc;
    ddp_reducer *r;
    ddp_result res = ddp__group_check(g, "ddp_reducer_create");
    if (res) return res;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: out is NULL");
    *out = NULL;
    memset(&desc, 0, sizeof desc);
    if (d) desc = *d;
    if (!desc.bucket_cap_bytes) desc.bucket_cap_bytes = DDP__REDUCER_DEFAULT_CAP;
    if (!desc.first_bucket_bytes) desc.first_bucket_bytes = DDP__REDUCER_DEFAULT_FIRST;
    if (desc.join_fail_early && !desc.uneven_inputs)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: join_fail_early = 1 needs uneven_inputs = 1 "
                         "(it says what happens when a rank runs out of data, which only uneven_inputs detects)");
    if ((res = ddp__zero_check_desc(g, &desc)) != DDP_SUCCESS) return res;
    if (desc.comm_dtype != DDP_DTYPE_DEFAULT && !(ddp__dtype_valid(desc.comm_dtype) && ddp__dtype_is_float(desc.comm_dtype)))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: comm_dtype %d is not DDP_DTYPE_DEFAULT or a "
                         "floating dtype (DDP_F16 or DDP_BF16 to compress)", (int)desc.comm_dtype);
    r = (ddp_reducer *)ddp__calloc(1, sizeof *r);
    if (!r) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_create: out of memory");
    r->g = g;
    r->ops = g->backend;
    r->desc = desc;
    r->sync = 1;
    *out = r;
    return DDP_SUCCESS;
}

/* Append a tensor to a growable array (registration happens once, before training). */
static ddp_result ddp__reducer_append(ddp_reducer *r, ddp__rtensor **arr, int *n, int *cap, const char *name, void *data,
                                      void *grad, size_t count, ddp_dtype t) {
    ddp__rtensor *e;
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 16;
        ddp__rtensor *p = (ddp__rtensor *)DDP_REALLOC(*arr, (size_t)nc * sizeof *p);
        if (!p) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory registering \"%s\"", name);
        *arr = p;
        *cap = nc;
    }
    e = &(*arr)[*n];
    e->name = ddp__strdup(name);
    if (!e->name) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory registering \"%s\"", name);
    e->data = data;
    e->grad = grad;
    e->count = count;
    e->dtype = t;
    (*n)++;
    return DDP_SUCCESS;
}

/* The parameter or buffer already registered under name: what it is ("parameter"/"buffer") and its
   index, or NULL. A linear search: registration happens once, before training. */
static const char *ddp__reducer_find_name(const ddp_reducer *r, const char *name, int *index) {
    int i;
    for (i = 0; i < r->nparams; i++)
        if (strcmp(r->params[i].name, name) == 0) return *index = i, "parameter";
    for (i = 0; i < r->nbuffers; i++)
        if (strcmp(r->buffers[i].name, name) == 0) return *index = i, "buffer";
    return NULL;
}

static ddp_result ddp__reducer_check_add(ddp_reducer *r, const char *what, const char *name, const void *data, size_t count,
                                         ddp_dtype t) {
    const char *dup;
    int dup_index = 0;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s: the reducer is NULL", what);
    if (!name || !*name) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s: the name is NULL or empty", what);
    if (r->finalized)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_add_%s(\"%s\"): the reducer is already finalized; register "
                         "every %s before ddp_reducer_finalize", what, name, what);
    if ((dup = ddp__reducer_find_name(r, name, &dup_index)) != NULL)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s(\"%s\"): the name is already registered, as %s "
                         "%d; every parameter and buffer needs its own name (the ranks compare models, and checkpoints "
                         "store tensors, by name)", what, name, dup, dup_index);
    if (!ddp__dtype_valid(t))
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s(\"%s\"): dtype %d is not a ddp_dtype", what, name, (int)t);
    if (count == 0) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s(\"%s\"): count is 0", what, name);
    if (count > SIZE_MAX / 16)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s(\"%s\"): count %zu is too large", what, name, count);
    if (!data) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_%s(\"%s\"): the data pointer is NULL", what, name);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_add_param(ddp_reducer *r, const char *name, void *param, void *grad, size_t count,
                                         ddp_dtype t, int *index) {
    ddp_result res = ddp__reducer_check_add(r, "param", name, param, count, t);
    if (res) return res;
    if (!ddp__dtype_is_float(t))
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): dtype %s has no gradients; "
                         "parameters are f32, f64, f16 or bf16 (register integer state with ddp_reducer_add_buffer)",
                         name, ddp_dtype_name(t));
    if (ddp__reducer_is_view(r) && grad)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): with gradient_as_bucket_view the "
                         "gradient lives in the bucket: pass grad = NULL and write it where ddp_reducer_grad() points", name);
    if (!ddp__reducer_is_view(r) && !grad)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): the gradient pointer is NULL "
                         "(pass the gradient buffer, or set gradient_as_bucket_view)", name);
    if (r->nparams == INT_MAX / 2) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param: too many parameters");
    if ((res = ddp__reducer_append(r, &r->params, &r->nparams, &r->cap_params, name, param, grad, count, t)) != DDP_SUCCESS)
        return res;
    if (index) *index = r->nparams - 1;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_add_buffer(ddp_reducer *r, const char *name, void *buf, size_t count, ddp_dtype t) {
    ddp_result res = ddp__reducer_check_add(r, "buffer", name, buf, count, t);
    if (res) return res;
    if (r->nbuffers == INT_MAX / 2) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_buffer: too many buffers");
    return ddp__reducer_append(r, &r->buffers, &r->nbuffers, &r->cap_buffers, name, buf, NULL, count, t);
}

/* ---- finalize, step 1: the same model on every rank ---- */

static uint64_t ddp__rtensor_hash(uint64_t h, const ddp__rtensor *t) {
    uint64_t count = t->count, dtype = (uint64_t)t->dtype;
    h = ddp__hash_bytes(h, t->name, strlen(t->name) + 1);
    h = ddp__hash_bytes(h, &count, sizeof count);
    return ddp__hash_bytes(h, &dtype, sizeof dtype);
}

/* One entry of the model in fixed size, for naming the first difference. */
typedef struct ddp__model_record {
    uint64_t count;
    uint64_t name_hash;
    uint32_t dtype;
    uint32_t kind; /* 0: this rank has no entry here, 1: parameter, 2: buffer */
    char name[DDP__REDUCER_NAME_RECORD];
} ddp__model_record;

static void ddp__record_fill(ddp__model_record *rec, const ddp__rtensor *t, uint32_t kind) {
    memset(rec, 0, sizeof *rec);
    if (!t) return;
    rec->count = t->count;
    rec->name_hash = ddp__hash_bytes(14695981039346656037ull, t->name, strlen(t->name));
    rec->dtype = (uint32_t)t->dtype;
    rec->kind = kind;
    snprintf(rec->name, sizeof rec->name, "%s", t->name);
}

static int ddp__record_equal(const ddp__model_record *a, const ddp__model_record *b) {
    return a->count == b->count && a->name_hash == b->name_hash && a->dtype == b->dtype && a->kind == b->kind;
}

static void ddp__record_describe(const ddp__model_record *rec, char *out, size_t cap) {
    static const char *kinds[] = {"nothing", "parameter", "buffer"};
    if (rec->kind == 0) {
        snprintf(out, cap, "nothing (fewer entries)");
        return;
    }
    snprintf(out, cap, "%s \"%s\" (%llu x %s)", kinds[rec->kind <= 2 ? rec->kind : 0], rec->name,
             (unsigned long long)rec->count, ddp_dtype_name((ddp_dtype)rec->dtype));
}

/* The ranks disagree: every rank sends `n` records (n = the largest model) and each names the first entry
   that differs from rank 0's, so every rank reports the same thing. */
static ddp_result ddp__reducer_name_mismatch(ddp_reducer *r, const uint64_t *prints) {
    ddp_group *g = r->g;
    int world = ddp_world_size(g), k, j, n = 0;
    ddp__model_record *mine, *all;
    ddp_result res;
    char msg[DDP__ERR_MAX], a[160], b[160];
    for (k = 0; k < world; k++)
        n = DDP__MAX(n, (int)(prints[DDP__VERIFY_FIELDS * k + 1] + prints[DDP__VERIFY_FIELDS * k + 2]));
    mine = (ddp__model_record *)ddp__calloc((size_t)n + 1, sizeof *mine);
    all = (ddp__model_record *)ddp__calloc(((size_t)n + 1) * (size_t)world, sizeof *all);
    if (!mine || !all) {
        ddp__free(mine);
        ddp__free(all);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: the model differs between ranks, and there is "
                         "no memory to say where");
    }
    for (j = 0; j < n; j++) {
        if (j < r->nparams)
            ddp__record_fill(&mine[j], &r->params[j], 1);
        else if (j - r->nparams < r->nbuffers)
            ddp__record_fill(&mine[j], &r->buffers[j - r->nparams], 2);
        else
            ddp__record_fill(&mine[j], NULL, 0);
    }
    res = ddp_all_gather(g, mine, all, ((size_t)n + 1) * sizeof *mine, DDP_U8);
    if (res) {
        ddp__free(mine);
        ddp__free(all);
        return res;
    }
    snprintf(msg, sizeof msg, "ddp_reducer_finalize: the ranks registered different models (rank 0: %llu parameters and "
             "%llu buffers, this rank %d: %d and %d), and the order of entries differs nowhere that a record shows; "
             "register the same parameters and buffers (names, counts, dtypes) in the same order on every rank",
             (unsigned long long)prints[1], (unsigned long long)prints[2], ddp_rank(g), r->nparams, r->nbuffers);
    for (j = 0; j < n; j++) {
        const ddp__model_record *ref = &all[j];
        for (k = 1; k < world; k++) {
            const ddp__model_record *other = &all[(size_t)k * ((size_t)n + 1) + (size_t)j];
            if (ddp__record_equal(ref, other)) continue;
            ddp__record_describe(ref, a, sizeof a);
            ddp__record_describe(other, b, sizeof b);
            snprintf(msg, sizeof msg, "ddp_reducer_finalize: the ranks registered different models; the first difference "
                     "is entry #%d: rank 0 has %s, rank %d has %s%s. Every rank must register the same parameters and "
                     "buffers (names, counts, dtypes) in the same order", j, a, k, b,
                     strcmp(ref->name, other->name) == 0 && ref->name_hash != other->name_hash ? " (the names differ after "
                     "the characters shown)" : "");
            j = n;
            break;
        }
    }
    ddp__free(mine);
    ddp__free(all);
    return ddp__fail(g, DDP_ERR_MISMATCH, "%s", msg);
}

/* PyTorch's _verify_param_shape_across_processes, hang-free: a fixed-size all_gather first. Each record
   is {magic, params, buffers, hash of the model, zero_stage}; the ranks' zero_stage must agree, else they
   would issue different collectives for the same bucket (a reduce-scatter against an all-reduce). */
static ddp_result ddp__reducer_verify(ddp_reducer *r) {
    ddp_group *g = r->g;
    int world = ddp_world_size(g), i, k;
    uint64_t mine[DDP__VERIFY_FIELDS], *all;
    ddp_result res;
    mine[0] = 0x4444505245445543ull; /* "DDPREDUC": a reducer's record */
    mine[1] = (uint64_t)r->nparams;
    mine[2] = (uint64_t)r->nbuffers;
    mine[3] = 14695981039346656037ull;
    mine[4] = (uint64_t)r->desc.zero_stage;
    for (i = 0; i < r->nparams; i++) mine[3] = ddp__rtensor_hash(mine[3], &r->params[i]);
    for (i = 0; i < r->nbuffers; i++) mine[3] = ddp__rtensor_hash(mine[3] ^ 0x9e3779b97f4a7c15ull, &r->buffers[i]);
    all = (uint64_t *)ddp__calloc((size_t)world * DDP__VERIFY_FIELDS, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if ((res = ddp_all_gather(g, mine, all, DDP__VERIFY_FIELDS, DDP_I64)) != DDP_SUCCESS) {
        ddp__free(all);
        return res;
    }
    for (k = 0; k < world; k++) { /* another all_gather of 5 x i64 would pass the collective's fingerprint */
        const uint64_t *e = &all[DDP__VERIFY_FIELDS * k];
        if (e[0] != mine[0] || e[1] > INT_MAX / 4 || e[2] > INT_MAX / 4) {
            ddp__free(all);
            return ddp__fail(g, DDP_ERR_MISMATCH, "ddp_reducer_finalize: rank %d is not in ddp_reducer_finalize (its "
                             "all_gather carries something else); every rank must call it at the same point", k);
        }
    }
    for (k = 1; k < world; k++)
        if (all[DDP__VERIFY_FIELDS * k + 4] != all[4]) {
            int theirs = (int)all[DDP__VERIFY_FIELDS * k + 4], first = (int)all[4];
            ddp__free(all);
            return ddp__fail(g, DDP_ERR_MISMATCH, "ddp_reducer_finalize: the ranks created their reducers with different "
                             "zero_stage: rank 0 has %d, rank %d has %d; every rank must use the same zero_stage in its "
                             "ddp_reducer_desc", first, k, theirs);
        }
    for (k = 0; k < world; k++)
        if (memcmp(&all[DDP__VERIFY_FIELDS * k], &all[0], 4 * sizeof(uint64_t)) != 0) break;
    if (k == world) {
        ddp__free(all);
        return DDP_SUCCESS;
    }
    res = ddp__reducer_name_mismatch(r, all);
    ddp__free(all);
    return res;
}

/* ---- finalize, step 2: rank 0's values everywhere (DDP's _sync_module_states) ---- */

/* Broadcast tensors from root: a large tensor in place, runs of small ones packed into `stage`. */
static ddp_result ddp__reducer_broadcast(ddp_reducer *r, ddp__rtensor *ts, int n, void *stage, size_t stage_bytes, int root) {
    ddp_group *g = r->g;
    int i = 0, j, k;
    ddp_result res;
    if (ddp_world_size(g) == 1) return DDP_SUCCESS;
    while (i < n) {
        size_t bytes = ddp__tensor_bytes(&ts[i]), off = 0;
        if (bytes >= DDP__REDUCER_SMALL_TENSOR || bytes > stage_bytes || !stage) {
            if ((res = ddp_broadcast(g, ts[i].data, bytes, DDP_U8, root)) != DDP_SUCCESS) return res;
            i++;
            continue;
        }
        for (j = i; j < n; j++) {
            size_t b = ddp__tensor_bytes(&ts[j]);
            if (b >= DDP__REDUCER_SMALL_TENSOR || off + b > stage_bytes) break;
            if (ddp_rank(g) == root) r->ops->copy_out(g, (char *)stage + off, ts[j].dtype, ts[j].data, ts[j].dtype, ts[j].count);
            off += b;
        }
        if ((res = ddp_broadcast(g, stage, off, DDP_U8, root)) != DDP_SUCCESS) return res;
        for (off = 0, k = i; k < j; k++) {
            if (ddp_rank(g) != root) r->ops->copy_out(g, ts[k].data, ts[k].dtype, (char *)stage + off, ts[k].dtype, ts[k].count);
            off += ddp__tensor_bytes(&ts[k]);
        }
        i = j;
    }
    return DDP_SUCCESS;
}

/* Staging big enough for the small tensors of a list, at most one broadcast chunk. */
static size_t ddp__stage_bytes(const ddp__rtensor *ts, int n) {
    size_t total = 0;
    int i;
    for (i = 0; i < n; i++)
        if (ddp__tensor_bytes(&ts[i]) < DDP__REDUCER_SMALL_TENSOR) total += ddp__tensor_bytes(&ts[i]);
    return DDP__MIN(total, DDP__REDUCER_BROADCAST_CHUNK);
}

/* Parameters and buffers from root everywhere (finalize: rank 0; the end of a join: the last joiner). */
static ddp_result ddp__reducer_sync_states(ddp_reducer *r, int root, const char *fn) {
    size_t bytes = ddp__stage_bytes(r->params, r->nparams);
    void *stage = bytes ? r->ops->alloc(r->g, bytes) : NULL;
    ddp_result res;
    if (bytes && !stage) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes)", fn, bytes);
    res = ddp__reducer_broadcast(r, r->params, r->nparams, stage, bytes, root);
    if (stage) r->ops->release(r->g, stage);
    if (res) return res;
    return ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, root);
}

/* ---- finalize, step 3 (and the rebuild): bucket layout ---- */

static void ddp__layout_free(ddp_reducer *r, ddp__layout *L) {
    int b;
    for (b = 0; b < L->nbuckets && L->buckets; b++) {
        ddp__bucket *k = &L->buckets[b];
        if (k->gather && k->gather != k->comm && !ddp__zero2(r)) r->ops->release(r->g, k->gather);
        if (k->owned) r->ops->release(r->g, k->owned);
        if (k->comm && k->comm != k->storage && !ddp__zero2(r)) r->ops->release(r->g, k->comm); /* 2: the pool's */
        if (k->storage && !k->flat) r->ops->release(r->g, k->storage);
    }
    ddp__free(L->buckets);
    ddp__free(L->params);
    ddp__free(L->param_bucket);
    ddp__free(L->param_offset);
    memset(L, 0, sizeof *L);
}

/* Assign parameters to buckets walking them in `walk` order (see the top of this section). */
static ddp_result ddp__layout_assign(ddp_reducer *r, const int *walk, ddp__layout *L) {
    int open[DDP_DTYPE_COUNT], seen[DDP_DTYPE_COUNT], i, b, n = r->nparams;
    size_t filled[DDP_DTYPE_COUNT];
    int *next;
    memset(L, 0, sizeof *L);
    L->buckets = (ddp__bucket *)ddp__calloc((size_t)n, sizeof *L->buckets);
    L->params = (int *)ddp__calloc((size_t)n, sizeof *L->params);
    L->param_bucket = (int *)ddp__calloc((size_t)n, sizeof *L->param_bucket);
    L->param_offset = (size_t *)ddp__calloc((size_t)n, sizeof *L->param_offset);
    next = (int *)ddp__calloc((size_t)n, sizeof *next);
    if (!L->buckets || !L->params || !L->param_bucket || !L->param_offset || !next) {
        ddp__free(next);
        ddp__layout_free(r, L);
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory building the gradient buckets");
    }
    for (i = 0; i < DDP_DTYPE_COUNT; i++) open[i] = -1, seen[i] = 0, filled[i] = 0;
    for (i = 0; i < n; i++) {
        const ddp__rtensor *p = &r->params[walk[i]];
        int t = (int)p->dtype;
        size_t limit = seen[t] ? r->desc.bucket_cap_bytes : r->desc.first_bucket_bytes;
        ddp__bucket *k;
        if (open[t] < 0) {
            open[t] = L->nbuckets++;
            filled[t] = 0;
            k = &L->buckets[open[t]];
            k->dtype = p->dtype;
            k->comm_dtype = r->desc.comm_dtype == DDP_DTYPE_DEFAULT ? p->dtype : r->desc.comm_dtype;
        }
        k = &L->buckets[open[t]];
        L->param_bucket[walk[i]] = open[t];
        L->param_offset[walk[i]] = k->count;
        k->count += p->count;
        k->n++;
        filled[t] += ddp__tensor_bytes(p);
        if (filled[t] >= limit) { /* the parameter that crosses the limit stays in the bucket */
            open[t] = -1;
            seen[t] = 1;
        }
    }
    /* group the parameters by bucket, keeping the walk order inside each */
    for (b = 0, i = 0; b < L->nbuckets; b++) {
        L->buckets[b].first = i;
        next[b] = i;
        i += L->buckets[b].n;
    }
    for (i = 0; i < n; i++) L->params[next[L->param_bucket[walk[i]]]++] = walk[i];
    ddp__free(next);
    return DDP_SUCCESS;
}

static int ddp__layout_same(const ddp_reducer *r, const ddp__layout *a, const ddp__layout *b) {
    int i;
    if (a->nbuckets != b->nbuckets) return 0;
    for (i = 0; i < r->nparams; i++)
        if (a->param_bucket[i] != b->param_bucket[i] || a->param_offset[i] != b->param_offset[i]) return 0;
    return 1;
}

typedef struct ddp__span {
    uintptr_t at;
    size_t bytes;
    int param;
} ddp__span;

static int ddp__span_order(const void *a, const void *b) {
    uintptr_t x = ((const ddp__span *)a)->at, y = ((const ddp__span *)b)->at;
    return x < y ? -1 : x > y;
}

/* Flat buckets: do bucket b's gradients tile one range of the program's memory, in any order (llm.c's
   one grads_memory, registered in order, gives reversed runs)? Then that range is the bucket's storage
   and each parameter's offset is where its gradient lies in it: gradients are scaled and reduced where
   the program keeps them, nothing is copied in or out, and a range inside a ddp_alloc block is reduced
   single-copy over shared memory. Else (or out of memory for the check) the bucket copies, as before. */
static int ddp__bucket_flat(ddp_reducer *r, ddp__layout *L, int b) {
    ddp__bucket *k = &L->buckets[b];
    size_t es = ddp_dtype_size(k->dtype);
    ddp__span *s = (ddp__span *)ddp__calloc((size_t)k->n, sizeof *s);
    int j, flat = s != NULL;
    for (j = 0; flat && j < k->n; j++) {
        const ddp__rtensor *p = &r->params[L->params[k->first + j]];
        s[j].at = (uintptr_t)p->grad, s[j].bytes = ddp__tensor_bytes(p), s[j].param = L->params[k->first + j];
    }
    if (flat) qsort(s, (size_t)k->n, sizeof *s, ddp__span_order);
    for (j = 1; flat && j < k->n; j++) flat = s[j].at == s[j - 1].at + s[j - 1].bytes;
    for (j = 0; flat && j < k->n; j++) L->param_offset[s[j].param] = (size_t)(s[j].at - s[0].at) / es;
    if (flat) k->storage = (void *)s[0].at, k->flat = 1;
    ddp__free(s);
    return flat;
}

/* zero_stage: a bucket's own memory. The comm buffer is the reducer's (never the program's gradients,
   so the padding exists and only the owned part is written back), padded with zeros to world * per
   elements; ddp_alloc'd memory starts zeroed and the padding is never written. */
static ddp_result ddp__zero_bucket_alloc(ddp_reducer *r, ddp__bucket *k, int b) {
    size_t world = (size_t)ddp_world_size(r->g), cs = ddp_dtype_size(k->comm_dtype), gs = ddp_dtype_size(k->dtype);
    k->per = (k->count + world - 1) / world;
    if (ddp__zero2(r)) { /* only the owned slice, in the gradients' dtype; comm and gather come from the pool */
        if (!(k->owned = r->ops->alloc(r->g, k->per * gs)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d's slice (zero_stage 2: %zu "
                             "elements)", b, k->per);
        return DDP_SUCCESS;
    }
    k->comm = r->ops->alloc(r->g, k->per * world * cs);
    k->owned = k->comm ? r->ops->alloc(r->g, k->per * cs) : NULL;
    k->gather = k->comm_dtype == k->dtype ? k->comm : k->owned ? r->ops->alloc(r->g, k->per * world * gs) : NULL;
    if (!k->comm || !k->owned || !k->gather)
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (zero_stage: %zu elements "
                         "padded to %zu)", b, k->count, k->per * world);
    return DDP_SUCCESS;
}

/* ---- ZeRO stage 2: the pool of comm buffers ----
   Under zero_stage = 2 a bucket owns only its slice (per elements, the gradients' dtype). The padded
   full-size buffer that the gradients are scaled into and reduce-scattered from is borrowed from a pool
   of DDP__ZERO2_POOL buffers, each big enough for the largest bucket (world * per elements in the larger
   of the comm and gradient dtypes, as gather_params stages the parameters in them too) plus, under
   compression, a landing area of per comm-dtype elements for the reduce-scatter's result:
     grad_ready, first gradient of bucket b: take a free buffer; if none is free, wait for the oldest
       reduce-scatter in flight (buckets start in order, so the lowest-numbered started bucket), finish
       it and take its buffer; if every buffer is held by a bucket that has not started (gradients that
       arrive far out of bucket order) the pool grows by one (at most one buffer per bucket). The buffer's
       padding [count, world * per) is zeroed then (an earlier, larger bucket may have written it).
     finish (the wait in grad_ready or end_backward): under compression the slice is converted from the
       landing area into the owned slice; the buffer is free again.
   Between passes every buffer is free; gather_params uses them in rotation. */
#define DDP__ZERO2_POOL 2

static uint64_t ddp__layout_gradient_bytes(const ddp_reducer *r, const ddp__layout *L);

/* One more pool buffer (the arrays have room for one per bucket). */
static ddp_result ddp__zero2_pool_grow(ddp_reducer *r) {
    void *mem;
    if (r->npool >= r->pool_room || !(mem = r->ops->alloc(r->g, r->pool_bytes)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "zero_stage 2: out of memory for comm buffer %d of the pool (%zu bytes)",
                         r->npool, r->pool_bytes);
    r->pool[r->npool] = mem;
    r->pool_holder[r->npool++] = -1;
    r->stats.gradient_bytes = ddp__layout_gradient_bytes(r, &r->L);
    return DDP_SUCCESS;
}

static ddp_result ddp__zero2_pool_alloc(ddp_reducer *r, const ddp__layout *L) {
    size_t world = (size_t)ddp_world_size(r->g), land = 0, full = 0;
    ddp_result res;
    int b;
    if (r->pool) return DDP_SUCCESS; /* the layout is built once under ZeRO; a retried finalize keeps the pool */
    for (b = 0; b < L->nbuckets; b++) {
        const ddp__bucket *k = &L->buckets[b];
        size_t cs = ddp_dtype_size(k->comm_dtype), gs = ddp_dtype_size(k->dtype);
        full = DDP__MAX(full, k->per * world * DDP__MAX(cs, gs));
        if (cs != gs) land = DDP__MAX(land, k->per * cs);
    }
    r->pool_land = (full + 63) / 64 * 64;
    r->pool_bytes = r->pool_land + land;
    r->pool_room = L->nbuckets;
    r->pool = (void **)ddp__calloc((size_t)L->nbuckets, sizeof *r->pool);
    r->pool_holder = (int *)ddp__calloc((size_t)L->nbuckets, sizeof *r->pool_holder);
    if (!r->pool || !r->pool_holder) {
        ddp__free(r->pool), ddp__free(r->pool_holder);
        r->pool = NULL, r->pool_holder = NULL;
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    }
    while (r->npool < DDP__MIN(DDP__ZERO2_POOL, L->nbuckets))
        if ((res = ddp__zero2_pool_grow(r)) != DDP_SUCCESS) return res;
    return DDP_SUCCESS;
}

/* Where bucket k's reduce-scatter writes this rank's slice: the owned slice itself, or under
   compression the landing area of its pool buffer. */
static void *ddp__zero2_land(const ddp_reducer *r, const ddp__bucket *k) {
    if (k->comm_dtype == k->dtype) return k->owned;
    return (char *)r->pool[k->slot] + r->pool_land;
}

/* Bucket k's reduce-scatter was waited for (done: successfully): its slice into the owned slice, its
   buffer back to the pool. */
static void ddp__zero2_finish(ddp_reducer *r, ddp__bucket *k, int done) {
    if (done && k->comm_dtype != k->dtype)
        r->ops->copy_out(r->g, k->owned, k->dtype, ddp__zero2_land(r, k), k->comm_dtype, k->per);
    r->pool_holder[k->slot] = -1;
    k->comm = NULL;
}

/* Bucket b's first gradient arrives: give it a pool buffer (see above). */
static ddp_result ddp__zero2_acquire(ddp_reducer *r, int b) {
    ddp__bucket *k = &r->L.buckets[b];
    size_t world = (size_t)ddp_world_size(r->g), cs = ddp_dtype_size(k->comm_dtype);
    ddp_result res;
    for (;;) {
        int s, oldest = -1;
        for (s = 0; s < r->npool && r->pool_holder[s] >= 0; s++) {
            const ddp__bucket *h = &r->L.buckets[r->pool_holder[s]];
            if (h->work && (oldest < 0 || r->pool_holder[s] < r->pool_holder[oldest])) oldest = s;
        }
        if (s < r->npool) { /* free */
            r->pool_holder[s] = b;
            k->slot = s;
            k->comm = r->pool[s];
            r->ops->zero(r->g, (char *)k->comm + k->count * cs, (k->per * world - k->count) * cs);
            return DDP_SUCCESS;
        }
        if (oldest >= 0) {
            ddp__bucket *h = &r->L.buckets[r->pool_holder[oldest]];
            res = ddp_wait(h->work);
            h->work = NULL;
            ddp__zero2_finish(r, h, res == DDP_SUCCESS);
            if (res) return r->failed = res;
            continue;
        }
        ddp__log(r->g, DDP_LOG_DEBUG, "reducer: zero_stage 2: the gradients of %d buckets arrived before any could start; "
                 "the pool grows to %d comm buffers", r->npool + 1, r->npool + 1);
        if ((res = ddp__zero2_pool_grow(r)) != DDP_SUCCESS) return r->failed = res;
    }
}

/* Give a layout its memory: the comm buckets, and the gradient storage for views (flat buckets have the
   program's). */
static ddp_result ddp__layout_alloc(ddp_reducer *r, ddp__layout *L) {
    ddp_result res;
    int b;
    for (b = 0; b < L->nbuckets; b++) {
        ddp__bucket *k = &L->buckets[b];
        size_t gbytes = k->count * ddp_dtype_size(k->dtype), cbytes = k->count * ddp_dtype_size(k->comm_dtype);
        if (!ddp__reducer_is_view(r) && !ddp__zero2(r) && ddp__bucket_flat(r, L, b)) L->flat_buckets++;
        else if (ddp__reducer_is_view(r) && !(k->storage = r->ops->alloc(r->g, gbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, gbytes);
        if (ddp__reducer_zero(r)) {
            if ((res = ddp__zero_bucket_alloc(r, k, b)) != DDP_SUCCESS) return res;
        } else if (k->storage && k->comm_dtype == k->dtype)
            k->comm = k->storage;
        else if (!(k->comm = r->ops->alloc(r->g, cbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, cbytes);
    }
    return ddp__zero2(r) ? ddp__zero2_pool_alloc(r, L) : DDP_SUCCESS;
}

/* Bytes of gradient memory the reducer holds for a layout (statistics' gradient_bytes): storage it
   allocated (views; flat storage is the program's), comm buffers, owned slices, gather staging, the pool. */
static uint64_t ddp__layout_gradient_bytes(const ddp_reducer *r, const ddp__layout *L) {
    uint64_t total = (uint64_t)r->npool * r->pool_bytes, world = (uint64_t)ddp_world_size(r->g);
    int b;
    for (b = 0; b < L->nbuckets; b++) {
        const ddp__bucket *k = &L->buckets[b];
        uint64_t gs = ddp_dtype_size(k->dtype), cs = ddp_dtype_size(k->comm_dtype);
        if (k->storage && !k->flat) total += k->count * gs;
        if (ddp__zero2(r))
            total += k->per * gs;
        else if (ddp__reducer_zero(r))
            total += k->per * world * cs + k->per * cs + (k->gather != k->comm ? k->per * world * gs : 0);
        else if (k->comm != k->storage)
            total += k->count * cs;
    }
    return total;
}

/* Where parameter i's gradient is in a layout's storage (views only). */
static void *ddp__layout_view(const ddp_reducer *r, const ddp__layout *L, int i) {
    const ddp__bucket *k = &L->buckets[L->param_bucket[i]];
    return (char *)k->storage + L->param_offset[i] * ddp_dtype_size(r->params[i].dtype);
}

/* Build the layout for `walk` and switch to it; views carry their gradients over. *taken: the layout
   is now walk's (built, or the same already), 0 when the current one was kept: a
   layout with fewer flat buckets than the current one is not taken, as the ready order (weight then bias,
   layer by layer) cuts a flat grads_memory into runs that are not adjacent, and copying every gradient
   in and out costs more than starting the buckets in the observed order gains. */
static ddp_result ddp__reducer_relayout(ddp_reducer *r, const int *walk, int *taken) {
    ddp__layout L;
    ddp_result res = ddp__layout_assign(r, walk, &L);
    int i;
    *taken = 0;
    if (res) return res;
    if (r->L.buckets && ddp__layout_same(r, &r->L, &L)) {
        ddp__layout_free(r, &L);
        *taken = 1;
        return DDP_SUCCESS;
    }
    if ((res = ddp__layout_alloc(r, &L)) != DDP_SUCCESS) {
        ddp__layout_free(r, &L);
        return res;
    }
    if (r->L.buckets && L.flat_buckets < r->L.flat_buckets) {
        ddp__log(r->g, DDP_LOG_DEBUG, "reducer: the buckets stay in registration order: in the observed ready order %d of "
                 "%d buckets would be slices of the program's gradients, against %d of %d now", L.flat_buckets, L.nbuckets,
                 r->L.flat_buckets, r->L.nbuckets);
        ddp__layout_free(r, &L);
        return DDP_SUCCESS;
    }
    *taken = 1;
    if (r->L.buckets && ddp__reducer_is_view(r))
        for (i = 0; i < r->nparams; i++)
            r->ops->copy_out(r->g, ddp__layout_view(r, &L, i), r->params[i].dtype, ddp__layout_view(r, &r->L, i),
                             r->params[i].dtype, r->params[i].count);
    ddp__layout_free(r, &r->L);
    r->L = L;
    r->stats.buckets = L.nbuckets;
    r->stats.flat_buckets = L.flat_buckets;
    r->stats.gradient_bytes = ddp__layout_gradient_bytes(r, &r->L);
    return DDP_SUCCESS;
}

/* ---- ZeRO stage 1: slices of the buckets ----
   Bucket k (count elements) is cut in world slices of per = ceil(count / world); rank r owns bucket
   elements [r * per, min(count, (r + 1) * per)). The reduce-scatter of the padded comm buffer gives each
   rank exactly that slice of the sum of the 1/world-scaled gradients. A shard is the intersection of the
   owned range with one parameter's range [param_offset, param_offset + param count) in the bucket. */

static ddp_result ddp__reducer_usable(ddp_reducer *r, const char *fn);

/* This rank's range of bucket k, in bucket elements ([*lo, *hi), empty when *lo >= *hi). */
static void ddp__zero_owned(const ddp_reducer *r, const ddp__bucket *k, size_t *lo, size_t *hi) {
    *lo = (size_t)ddp_rank(r->g) * k->per;
    *hi = DDP__MIN(k->count, *lo + k->per);
}

/* This rank's piece of parameter i: bucket elements [*a, *e) of its bucket, whose owned range starts at
   *lo. Returns 0 when it owns none of the parameter. */
static int ddp__zero_piece(const ddp_reducer *r, int i, size_t *lo, size_t *a, size_t *e) {
    size_t hi, po = r->L.param_offset[i];
    ddp__zero_owned(r, &r->L.buckets[r->L.param_bucket[i]], lo, &hi);
    *a = DDP__MAX(*lo, po);
    *e = DDP__MIN(hi, po + r->params[i].count);
    return *a < *e;
}

/* Where parameter i's gradient element e is (the program's buffer, or the bucket's storage). */
static char *ddp__zero_grad_at(const ddp_reducer *r, int i, size_t e) {
    const ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t es = ddp_dtype_size(r->params[i].dtype);
    if (k->storage) return (char *)k->storage + (r->L.param_offset[i] + e) * es;
    return (char *)r->params[i].grad + e * es;
}

/* The shard list, once at finalize (the layout never changes under ZeRO). */
static ddp_result ddp__zero_shards(ddp_reducer *r) {
    int b, j, n = 0;
    for (b = 0; b < r->L.nbuckets; b++) n += r->L.buckets[b].n;
    ddp__free(r->shards);
    ddp__free(r->shard_bucket);
    r->nshards = 0;
    r->shards = (ddp_shard *)ddp__calloc((size_t)n + 1, sizeof *r->shards);
    r->shard_bucket = (int *)ddp__calloc((size_t)n + 1, sizeof *r->shard_bucket);
    if (!r->shards || !r->shard_bucket) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    for (b = 0; b < r->L.nbuckets; b++) {
        const ddp__bucket *k = &r->L.buckets[b];
        for (j = k->first; j < k->first + k->n; j++) {
            int i = r->L.params[j];
            size_t lo, a, e;
            ddp_shard *s = &r->shards[r->nshards];
            if (!ddp__zero_piece(r, i, &lo, &a, &e)) continue;
            s->param = i;
            s->offset = a - r->L.param_offset[i];
            s->count = e - a;
            s->param_data = (char *)r->params[i].data + s->offset * ddp_dtype_size(r->params[i].dtype);
            s->grad = ddp__zero2(r) ? (void *)((char *)k->owned + (a - lo) * ddp_dtype_size(k->dtype))
                                    : (void *)ddp__zero_grad_at(r, i, s->offset);
            r->shard_bucket[r->nshards++] = b;
        }
    }
    return DDP_SUCCESS;
}

/* The averaged gradient of this rank's part of parameter i goes back where the program reads it. */
static void ddp__zero_give_back(ddp_reducer *r, int i) {
    const ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t lo, a, e;
    if (!ddp__zero_piece(r, i, &lo, &a, &e)) return;
    r->ops->copy_out(r->g, ddp__zero_grad_at(r, i, a - r->L.param_offset[i]), r->params[i].dtype,
                     (char *)k->owned + (a - lo) * ddp_dtype_size(k->comm_dtype), k->comm_dtype, e - a);
}

DDP_API int ddp_reducer_shards(ddp_reducer *r, const ddp_shard **out) {
    if (!r || !out || !r->finalized) {
        if (out) *out = NULL;
        if (r) ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_shards: %s", !out ? "out is NULL" :
                         "call ddp_reducer_finalize first");
        return -1;
    }
    *out = r->nshards ? r->shards : NULL;
    return r->nshards;
}

/* Bucket b's staging buffer gets this rank's owned parameter values at its slice (shards from *j on,
   which are in bucket order): a plain copy, as the staging has the parameters' dtype. */
static void ddp__zero_gather_fill(ddp_reducer *r, int b, int *j) {
    const ddp__bucket *k = &r->L.buckets[b];
    for (; *j < r->nshards && r->shard_bucket[*j] == b; ++*j) {
        const ddp_shard *s = &r->shards[*j];
        size_t at = r->L.param_offset[s->param] + s->offset;
        r->ops->copy_out(r->g, (char *)k->gather + at * ddp_dtype_size(k->dtype), k->dtype, s->param_data, k->dtype, s->count);
    }
}

/* Wait for bucket k's all_gather (if in flight) and copy every parameter of the bucket back from it (the
   owned part comes back unchanged). Returns res, or the wait's error when res was a success. */
static ddp_result ddp__zero_gather_finish(ddp_reducer *r, ddp__bucket *k, ddp_result res) {
    ddp_result waited;
    int j;
    if (!k->work) return res;
    waited = ddp_wait(k->work);
    k->work = NULL;
    if (!res) res = waited;
    for (j = k->first; j < k->first + k->n && !res; j++) {
        int i = r->L.params[j];
        r->ops->copy_out(r->g, r->params[i].data, r->params[i].dtype,
                         (char *)k->gather + r->L.param_offset[i] * ddp_dtype_size(k->dtype), k->dtype, r->params[i].count);
    }
    if (ddp__zero2(r)) k->gather = NULL; /* the pool buffer is free again */
    return res;
}

/* gather_params, overlapped with the next forward (torch's ZeroRedundancyOptimizer with
   overlap_with_ddp, DeepSpeed's prefetching): each bucket's owned parameter values go into its staging
   buffer at this rank's slice, then an all_gather (send = this rank's slice of recv, in place); when it
   is waited for, every parameter of the bucket is copied back from it. Buckets start in the order forward
   reads their parameters: the LAST bucket first (buckets fill in reverse registration order, so it holds
   the first registered parameters). Stage 1: every bucket has its staging, all start at once. Stage 2:
   the pool's buffers in rotation, so the bucket at start position q first finishes the one at q - npool,
   which held that buffer; the first npool start at once and the rest start when a wait reaches them.
   ddp_reducer_wait_param waits for one parameter's bucket (starting the ones before it if needed);
   begin_backward, the next gather and join settle whatever is left, so nothing reads a stale value. */
static ddp_result ddp__zero_gather_start_next(ddp_reducer *r) {
    int q = r->gather_next++, b = r->L.nbuckets - 1 - q, j = 0;
    ddp__bucket *k = &r->L.buckets[b];
    ddp_result res = DDP_SUCCESS;
    if (ddp__zero2(r)) {
        if (q >= r->npool && (res = ddp__zero_gather_finish(r, &r->L.buckets[b + r->npool], res)) != DDP_SUCCESS) return res;
        k->gather = r->pool[q % r->npool];
    }
    while (j < r->nshards && r->shard_bucket[j] != b) j++; /* the bucket's first shard (shards are in bucket order) */
    ddp__zero_gather_fill(r, b, &j);
    return ddp_all_gather_async(r->g, (char *)k->gather + (size_t)ddp_rank(r->g) * k->per * ddp_dtype_size(k->dtype), k->gather,
                                k->per, k->dtype, &k->work);
}

/* Bucket b's parameters are current: its all_gather (and every one before it in start order) started
   and waited for. */
static ddp_result ddp__zero_gather_wait_bucket(ddp_reducer *r, int b) {
    ddp_result res = DDP_SUCCESS;
    while (!res && r->gather_next <= r->L.nbuckets - 1 - b) res = ddp__zero_gather_start_next(r);
    return ddp__zero_gather_finish(r, &r->L.buckets[b], res);
}

/* Wait for every bucket of an async gather (the first error is kept; every started one is waited for). */
static ddp_result ddp__zero_gather_settle(ddp_reducer *r) {
    ddp_result res = DDP_SUCCESS;
    int b;
    if (!r->gathering) return DDP_SUCCESS;
    for (b = r->L.nbuckets - 1; b >= 0; b--) {
        ddp_result one = res ? ddp__zero_gather_finish(r, &r->L.buckets[b], res) : ddp__zero_gather_wait_bucket(r, b);
        if (!res) res = one;
    }
    if (ddp__zero2(r))
        for (b = 0; b < r->L.nbuckets; b++) r->L.buckets[b].gather = NULL;
    r->gathering = 0;
    if (res) r->failed = res;
    return res;
}

DDP_API ddp_result ddp_reducer_gather_params_async(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_gather_params");
    int first;
    if (res) return res;
    if (!ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_gather_params: the reducer was created with zero_stage = 0; "
                         "every rank already has every parameter (set zero_stage = 1 to shard the optimizer)");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_gather_params: called during a backward pass; call it after "
                         "end_backward and the optimizer step on this rank's shards");
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res; /* the previous one, not waited for */
    r->gathering = 1;
    r->gather_next = 0;
    first = ddp__zero2(r) ? DDP__MIN(r->npool, r->L.nbuckets) : r->L.nbuckets;
    while (!res && r->gather_next < first) res = ddp__zero_gather_start_next(r);
    r->join_gather_due = 0;
    return res ? ddp__zero_gather_settle(r) : DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_wait_param(ddp_reducer *r, int index) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_wait_param");
    if (res) return res;
    if (index < -1 || index >= r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_wait_param: index %d is not a parameter (0..%d) or -1 "
                         "(all)", index, r->nparams - 1);
    if (!r->gathering) return DDP_SUCCESS;
    if (index < 0) return ddp__zero_gather_settle(r);
    if ((res = ddp__zero_gather_wait_bucket(r, r->L.param_bucket[index])) != DDP_SUCCESS) ddp__zero_gather_settle(r);
    return res;
}

DDP_API ddp_result ddp_reducer_gather_params(ddp_reducer *r) {
    ddp_result res = ddp_reducer_gather_params_async(r);
    return res ? res : ddp__zero_gather_settle(r);
}

/* ZeRO-2 keeps the averaged gradient slices in the reducer's own buckets (ddp_reducer_shards' grad),
   which are the backend's memory: host memory on the cpu and mpi backends. A model in device memory
   there (devbuf.c stages the rest of the reducer) would have an optimizer kernel read host memory, so
   that combination is refused; ZeRO-1's shards point into the program's own gradients and work. */
static ddp_result ddp__zero2_check_memory(ddp_reducer *r) {
#ifdef DDP_CUDA
    int i;
    if (!ddp__zero2(r) || !strcmp(r->ops->family, "nccl")) return DDP_SUCCESS;
    for (i = 0; i < r->nparams; i++)
        if (ddp__cuda_is_device_pointer(r->params[i].data) || ddp__cuda_is_device_pointer(r->params[i].grad))
            return ddp__fail(r->g, DDP_ERR_UNSUPPORTED, "ddp_reducer_finalize: zero_stage = 2 with parameter \"%s\" in device "
                             "memory on backend %s is not supported: ZeRO-2's gradient slices would be the reducer's host "
                             "memory, which an optimizer on the device cannot read; use zero_stage = 1 (its shards are "
                             "slices of your device gradients) or backend nccl", r->params[i].name, r->ops->family);
#else
    (void)r;
#endif
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_finalize(ddp_reducer *r) {
    ddp_result res;
    int i, n;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_finalize: the reducer is NULL");
    if (r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_finalize: already finalized");
    if ((res = ddp__zero2_check_memory(r)) != DDP_SUCCESS) return res; /* local: every rank's model is alike */
    /* the check comes first, so that a rank with a wrong model still takes part and every rank learns */
    if ((res = ddp__reducer_verify(r)) != DDP_SUCCESS) return res;
    if (r->nparams == 0)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_finalize: no parameters were registered "
                         "(ddp_reducer_add_param); DDP needs at least one");
    n = r->nparams;
    if (!r->ready) r->ready = (unsigned char *)ddp__calloc((size_t)n, 1); /* kept if an earlier finalize failed */
    if (!r->used) r->used = (unsigned char *)ddp__calloc((size_t)n, 1);
    if (!r->order) r->order = (int *)ddp__calloc((size_t)n, sizeof *r->order);
    r->bstage_bytes = ddp__stage_bytes(r->buffers, r->nbuffers);
    if (!r->bstage && r->bstage_bytes) r->bstage = r->ops->alloc(r->g, r->bstage_bytes);
    if (r->desc.find_unused_parameters && !r->used_comm) r->used_comm = (unsigned char *)r->ops->alloc(r->g, (size_t)n);
    if (r->desc.find_unused_parameters && !r->used_global) r->used_global = (unsigned char *)ddp__calloc((size_t)n, 1);
    if (!r->ready || !r->used || !r->order || (r->bstage_bytes && !r->bstage) ||
        (r->desc.find_unused_parameters && (!r->used_comm || !r->used_global)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if (r->desc.uneven_inputs && !r->join_table)
        r->join_table = (int32_t *)ddp__calloc((size_t)ddp_world_size(r->g) + 1, DDP__JOIN_FIELDS * sizeof(int32_t));
    if (r->desc.uneven_inputs && !r->join_table) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if (!r->ready_ns) r->ready_ns = (int64_t *)ddp__calloc((size_t)ddp_world_size(r->g) + 1, sizeof(int64_t));
    if (!r->ready_comm) r->ready_comm = r->ops->alloc(r->g, ((size_t)ddp_world_size(r->g) + 1) * sizeof(int64_t));
    if (!r->ready_ns || !r->ready_comm) return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    r->finalized = 1;
    if ((res = ddp__reducer_sync_states(r, 0, "ddp_reducer_finalize")) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    for (i = 0; i < n; i++) r->order[i] = n - 1 - i; /* reverse registration order */
    if ((res = ddp__reducer_relayout(r, r->order, &i)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    if (ddp__reducer_zero(r) && (res = ddp__zero_shards(r)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    r->rebuild_pending = !r->desc.find_unused_parameters && !ddp__reducer_zero(r); /* ZeRO: shards never move */
    return DDP_SUCCESS;
}

/* ---- timing: waiting for a slower rank, or moving data ----
   wait_seconds (the time inside end_backward) mixes two things: waiting for a rank whose backward is
   slower (no all-reduce can finish before every rank has started it) and moving the data that backward
   did not hide. To split them, every synchronised pass ends with an asynchronous all_gather of one int64
   per rank: the wall-clock time at which that rank started its last bucket ("ready": all of its
   gradients were there). From it, T_last = the latest ready time, and on this rank
       straggler_wait = clamp(min(T_last, t_done) - t_enter, 0, wait)     t_enter: end_backward's entry
       transfer       = wait - straggler_wait
   The exposed wait before the last rank was ready is waiting for that rank; the rest is communication.
   The last rank itself has straggler_wait 0. The all_gather runs on the progress thread while the
   program goes on (its optimizer step); the split is completed at the next begin_backward or
   ddp_reducer_get_statistics, which wait for it. Cost: 8 bytes per rank per synchronised pass, off the
   critical path. Hosts' wall clocks differ by their synchronisation error (NTP: typically well under a
   millisecond on a LAN), which bounds the split's error between hosts; within a host it is exact. A
   joined rank (uneven_inputs) takes part with 0 (never the last). */

static double ddp__wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The split of the pass that ended at r->t_done, given when the last rank was ready (monotonic). */
static void ddp__timing_account(ddp_reducer *r, double t_last, int last_rank) {
    double wait = r->t_done - r->t_enter, straggler = DDP__MIN(t_last, r->t_done) - r->t_enter;
    if (straggler < 0) straggler = 0;
    r->stats.straggler_wait_seconds = straggler;
    r->stats.transfer_seconds = wait - straggler;
    r->stats.last_ready_rank = last_rank;
    r->stats.total_straggler_wait_seconds += straggler;
    r->stats.total_transfer_seconds += wait - straggler;
}

/* end_backward (and a joined rank's shadow pass, `shadow`): start the all_gather of ready times. */
static ddp_result ddp__timing_start(ddp_reducer *r, int shadow) {
    int world = ddp_world_size(r->g);
    char *comm = (char *)r->ready_comm;
    ddp_result res;
    if (world == 1 || !strcmp(r->ops->family, "nccl")) { /* nccl: no host sync each step (reducer.h) */
        if (!shadow) ddp__timing_account(r, world == 1 ? r->t_ready : r->t_enter, world == 1 ? 0 : -1);
        return DDP_SUCCESS;
    }
    r->ready_ns[world] = shadow ? 0 : (int64_t)((r->t_ready + r->wall_minus_mono) * 1e9);
    r->ops->copy_out(r->g, comm + (size_t)world * 8, DDP_I64, &r->ready_ns[world], DDP_I64, 1);
    if ((res = ddp_all_gather_async(r->g, comm + (size_t)world * 8, comm, 1, DDP_I64, &r->ready_work)) != DDP_SUCCESS)
        return r->failed = res;
    r->ready_discard = shadow;
    return DDP_SUCCESS;
}

/* Wait for the last pass's all_gather and split its wait. A failure is the group's (its next collective
   says so); that pass's split is then left out. */
static void ddp__timing_finish(ddp_reducer *r) {
    int world = ddp_world_size(r->g), k, last = 0;
    ddp_result res;
    if (!r->ready_work) return;
    res = ddp_wait(r->ready_work);
    r->ready_work = NULL;
    if (res || r->ready_discard) return;
    r->ops->copy_out(r->g, r->ready_ns, DDP_I64, r->ready_comm, DDP_I64, (size_t)world);
    for (k = 1; k < world; k++)
        if (r->ready_ns[k] > r->ready_ns[last]) last = k;
    ddp__timing_account(r, (double)r->ready_ns[last] * 1e-9 - r->wall_minus_mono, last);
}

/* ---- backward ---- */

static ddp_result ddp__join_announce(ddp_reducer *r, int kind, const char *fn, int *root);

DDP_API void *ddp_reducer_grad(ddp_reducer *r, int index) {
    if (!r || index < 0 || index >= r->nparams) return NULL;
    if (!ddp__reducer_is_view(r)) return r->params[index].grad;
    return r->L.buckets ? ddp__layout_view(r, &r->L, index) : NULL;
}

static ddp_result ddp__reducer_usable(ddp_reducer *r, const char *fn) {
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the reducer is NULL", fn);
    if (!r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "%s: call ddp_reducer_finalize first", fn);
    if (r->failed)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer stopped after an earlier error (%s); destroy it and the "
                         "group", fn, ddp_result_string(r->failed));
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_begin_backward(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_begin_backward");
    int b;
    if (res) return res;
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_begin_backward: the previous backward pass has not ended; call "
                         "ddp_reducer_end_backward after each backward pass");
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res; /* forward has read the parameters */
    ddp__timing_finish(r);
    if (r->desc.uneven_inputs && (res = ddp__join_announce(r, DDP__JOIN_STEP, "ddp_reducer_begin_backward", NULL)) != DDP_SUCCESS)
        return res;
    r->in_backward = 1;
    r->pass_sync = r->sync;
    r->next_bucket = 0;
    r->norder = 0;
    memset(r->ready, 0, ddp__reducer_n(r));
    for (b = 0; b < r->L.nbuckets; b++) r->L.buckets[b].pending = r->L.buckets[b].n;
    r->t_begin = ddp__now();
    r->t_first_start = 0;
    return DDP_SUCCESS;
}

/* Start bucket k's collective on `data` (its comm memory; a joined rank's zeros): DDP's SUM all-reduce,
   or with zero_stage a SUM reduce-scatter of the padded buffer into this rank's slice (k->owned).
   The one place that chooses a bucket's collective, for the ranks with data and the joined ones alike. */
static ddp_result ddp__bucket_start(ddp_reducer *r, ddp__bucket *k, void *data) {
    if (ddp__zero2(r)) return ddp_reduce_scatter_async(r->g, data, ddp__zero2_land(r, k), k->per, k->comm_dtype, DDP_SUM, &k->work);
    if (ddp__reducer_zero(r)) return ddp_reduce_scatter_async(r->g, data, k->owned, k->per, k->comm_dtype, DDP_SUM, &k->work);
    return ddp_all_reduce_async(r->g, data, k->count, k->comm_dtype, DDP_SUM, &k->work);
}

/* Start every complete bucket that is next in line. */
static ddp_result ddp__reducer_start_ready(ddp_reducer *r) {
    while (r->next_bucket < r->L.nbuckets && r->L.buckets[r->next_bucket].pending == 0) {
        ddp__bucket *k = &r->L.buckets[r->next_bucket];
        ddp_result res = ddp__bucket_start(r, k, k->comm);
        if (res) return r->failed = res;
        if (!r->t_first_start) r->t_first_start = ddp__now();
        if (++r->next_bucket == r->L.nbuckets) r->t_ready = ddp__now();
    }
    return DDP_SUCCESS;
}

/* Copy parameter i's gradient into its bucket slot, times 1/world (in place for views). */
static void ddp__reducer_take(ddp_reducer *r, int i) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    const ddp__rtensor *p = &r->params[i];
    size_t off = r->L.param_offset[i];
    const void *src = k->storage ? (const void *)((char *)k->storage + off * ddp_dtype_size(k->dtype)) : p->grad;
    r->ops->copy_in_scaled(r->g, (char *)k->comm + off * ddp_dtype_size(k->comm_dtype), k->comm_dtype, src, p->dtype,
                           p->count, 1.0 / (double)ddp_world_size(r->g));
    k->pending--;
}

DDP_API ddp_result ddp_reducer_grad_ready(ddp_reducer *r, int index) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_grad_ready");
    if (res) return res;
    if (index < 0 || index >= r->nparams)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_grad_ready: index %d is not a parameter (0 .. %d)",
                         index, r->nparams - 1);
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_grad_ready(\"%s\"): not in a backward pass; call "
                         "ddp_reducer_begin_backward first", r->params[index].name);
    if (r->ready[index])
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_grad_ready(\"%s\"): called twice in one backward pass; a "
                         "gradient is reduced once per pass (PyTorch: \"Expected to mark a variable ready only once\"). "
                         "A parameter used twice in forward gets one gradient: add both parts, then call it once",
                         r->params[index].name);
    r->ready[index] = 1;
    r->used[index] = 1;
    if (!r->pass_sync) return DDP_SUCCESS;
    if (r->rebuild_pending) r->order[r->norder++] = index;
    if (ddp__zero2(r) && !r->L.buckets[r->L.param_bucket[index]].comm &&
        (res = ddp__zero2_acquire(r, r->L.param_bucket[index])) != DDP_SUCCESS)
        return res;
    ddp__reducer_take(r, index);
    return ddp__reducer_start_ready(r);
}

/* A gradient is missing without find_unused_parameters. The ranks may now have started different
   buckets, so they cannot agree on later collectives: finish what this rank started (every rank either
   completes those or fails), then break the group so every rank fails at once with this message. */
static ddp_result ddp__reducer_missing(ddp_reducer *r) {
    char msg[DDP__ERR_MAX];
    size_t len;
    int i, missing = 0, listed = 0, b;
    for (i = 0; i < r->nparams; i++) missing += !r->ready[i];
    len = (size_t)snprintf(msg, sizeof msg, "ddp_reducer_end_backward: rank %d: %d parameter%s got no gradient in this "
                           "backward pass:", ddp_rank(r->g), missing, missing == 1 ? "" : "s");
    for (i = 0; i < r->nparams && len < 600; i++)
        if (!r->ready[i]) {
            len += (size_t)snprintf(msg + len, sizeof msg - len, "%s \"%s\"", listed ? "," : "", r->params[i].name);
            listed++;
        }
    if (listed < missing && len < sizeof msg) len += (size_t)snprintf(msg + len, sizeof msg - len, " and %d more", missing - listed);
    if (len < sizeof msg)
        snprintf(msg + len, sizeof msg - len, ". Call ddp_reducer_grad_ready for every parameter in every synchronised "
                 "backward, or set find_unused_parameters = 1 (PyTorch: \"Expected to have finished reduction in the "
                 "prior iteration\"). %s", ddp_world_size(r->g) > 1 ? "The group is broken; destroy it and the reducer"
                 : "Destroy the reducer");
    for (b = 0; b < r->next_bucket; b++)
        if (r->L.buckets[b].work) {
            ddp_wait(r->L.buckets[b].work);
            r->L.buckets[b].work = NULL;
        }
    if (ddp_world_size(r->g) > 1) ddp__group_abort(r->g, DDP_ERR_STATE, msg);
    r->failed = DDP_ERR_STATE;
    r->in_backward = 0;
    return ddp__fail(r->g, DDP_ERR_STATE, "%s", msg);
}

/* find_unused_parameters: what of parameter i's gradient must survive the pass in case no rank uses it
   (ddp__reducer_finish_unused puts it back then), saved into / restored from the stash at `at`: a view's
   gradient without compression (its bucket is reduced in place), or under zero_stage 2 this rank's owned
   piece of it (the reduce-scatter lands there). Returns its bytes (0: nothing to keep); at NULL: only
   the size. */
static size_t ddp__unused_keep(ddp_reducer *r, int i, char *at, int restore) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    const ddp__rtensor *p = &r->params[i];
    size_t count = p->count, lo, a, e;
    char *grad;
    if (ddp__zero2(r)) {
        if (!ddp__zero_piece(r, i, &lo, &a, &e)) return 0;
        grad = (char *)k->owned + (a - lo) * ddp_dtype_size(k->dtype);
        count = e - a;
    } else if (ddp__bucket_in_place(k)) {
        grad = (char *)k->storage + r->L.param_offset[i] * ddp_dtype_size(k->dtype);
    } else {
        return 0;
    }
    if (at) r->ops->copy_out(r->g, restore ? grad : at, p->dtype, restore ? at : grad, p->dtype, count);
    return count * ddp_dtype_size(p->dtype);
}

/* The stash can hold what the parameters not used here (all: every parameter, as in a joined rank's
   shadow pass) keep across the pass; it grows only when more must be kept than ever before. */
static ddp_result ddp__stash_reserve(ddp_reducer *r, int all, const char *fn) {
    size_t need = 0;
    int i;
    for (i = 0; i < r->nparams; i++)
        if (all || !r->used[i]) need += ddp__unused_keep(r, i, NULL, 0);
    if (need <= r->stash_bytes) return DDP_SUCCESS;
    if (r->stash) r->ops->release(r->g, r->stash);
    r->stash_bytes = 0;
    if (!(r->stash = r->ops->alloc(r->g, need)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes)", fn, need);
    r->stash_bytes = need;
    return DDP_SUCCESS;
}

/* find_unused_parameters: fill the slots of the parameters not ready in this pass, bucket by bucket in
   bucket order, starting each as soon as it is complete (so under zero_stage 2 a bucket that needs a
   pool buffer finds the buckets before it started, and waits for the oldest instead of growing the
   pool). One that got a gradient in an earlier no_sync pass contributes what it accumulated; the others
   contribute zero, after what they must keep went into the stash (ddp__unused_keep). */
static ddp_result ddp__reducer_fill_unused(ddp_reducer *r) {
    size_t off = 0;
    ddp_result res;
    int b, j, i;
    r->stats.unused_parameters = 0;
    if ((res = ddp__stash_reserve(r, 0, "ddp_reducer_end_backward")) != DDP_SUCCESS) return res;
    for (b = 0; b < r->L.nbuckets; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        size_t cs = ddp_dtype_size(k->comm_dtype);
        if (!k->pending) continue;
        if (ddp__zero2(r) && !k->comm && (res = ddp__zero2_acquire(r, b)) != DDP_SUCCESS) return res;
        for (j = k->first; j < k->first + k->n; j++) {
            i = r->L.params[j];
            if (r->ready[i]) continue;
            if (r->used[i]) {
                ddp__reducer_take(r, i);
                continue;
            }
            r->stats.unused_parameters++;
            off += ddp__unused_keep(r, i, (char *)r->stash + off, 0);
            r->ops->zero(r->g, (char *)k->comm + r->L.param_offset[i] * cs, r->params[i].count * cs);
            k->pending--;
        }
        if ((res = ddp__reducer_start_ready(r)) != DDP_SUCCESS) return res;
    }
    return DDP_SUCCESS;
}

/* The reduced value of parameter i goes back to where the program reads its gradient. */
static void ddp__reducer_give_back(ddp_reducer *r, int i) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t off = r->L.param_offset[i];
    const void *src = (char *)k->comm + off * ddp_dtype_size(k->comm_dtype);
    if (ddp__reducer_zero(r)) {
        ddp__zero_give_back(r, i);
        return;
    }
    if (ddp__bucket_in_place(k)) return;
    r->ops->copy_out(r->g, k->storage ? (void *)((char *)k->storage + off * ddp_dtype_size(k->dtype)) : r->params[i].grad,
                     r->params[i].dtype, src, k->comm_dtype, r->params[i].count);
}

/* After the used map: gradients of parameters unused here (all: every parameter, a joined rank's shadow
   pass under zero_stage) but used elsewhere come back (zero_stage 2: they are in the owned slices
   already); those no rank used keep their old value (out of the stash, in the order it was filled). */
static void ddp__reducer_finish_unused(ddp_reducer *r, int all) {
    size_t off = 0;
    int b, j;
    for (b = 0; b < r->L.nbuckets; b++)
        for (j = r->L.buckets[b].first; j < r->L.buckets[b].first + r->L.buckets[b].n; j++) {
            int i = r->L.params[j];
            if (!all && r->used[i]) continue;
            if (r->used_global[i] && !ddp__zero2(r)) ddp__reducer_give_back(r, i);
            off += ddp__unused_keep(r, i, r->used_global[i] ? NULL : (char *)r->stash + off, 1);
        }
}

/* Wait for every bucket in order, giving each back as soon as it is done (the gradients of unused
   parameters wait for the used map). Returns the first error; every handle is released. */
static ddp_result ddp__reducer_collect(ddp_reducer *r, ddp_work *used_work) {
    ddp_result first = DDP_SUCCESS, res;
    char why[DDP__ERR_MAX];
    int b, j, find_unused = r->desc.find_unused_parameters;
    for (b = 0; b < r->L.nbuckets; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        if (!k->work) continue;
        res = ddp_wait(k->work);
        k->work = NULL;
        if (res && !first) {
            first = res;
            snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        }
        if (ddp__zero2(r)) ddp__zero2_finish(r, k, !first); /* the slice stays in the reducer */
        if (first || ddp__zero2(r)) continue;
        for (j = k->first; j < k->first + k->n; j++)
            if (!find_unused || r->used[r->L.params[j]]) ddp__reducer_give_back(r, r->L.params[j]);
    }
    if (used_work) {
        res = ddp_wait(used_work);
        if (res && !first) {
            first = res;
            snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        }
        if (!first) {
            r->ops->copy_out(r->g, r->used_global, DDP_U8, r->used_comm, DDP_U8, ddp__reducer_n(r));
            ddp__reducer_finish_unused(r, 0);
        }
    }
    /* the first failure says what happened; later ones only say that the group is broken */
    if (!first) return DDP_SUCCESS;
    return ddp__fail(r->g, first, "%s%s", strncmp(why, "ddp_reducer_", 12) ? "ddp_reducer_end_backward: " : "", why);
}

/* Once, after the first synchronised pass: buckets in the order rank 0 saw the gradients ready. */
static ddp_result ddp__reducer_rebuild(ddp_reducer *r) {
    ddp_result res;
    int taken;
    r->rebuild_pending = 0;
    if ((res = ddp_broadcast(r->g, r->order, ddp__reducer_n(r), DDP_I32, 0)) != DDP_SUCCESS) return r->failed = res;
    if ((res = ddp__reducer_relayout(r, r->order, &taken)) != DDP_SUCCESS) return r->failed = res;
    r->stats.rebuilt = taken;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_end_backward(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_end_backward");
    ddp_work *used_work = NULL;
    double t_enter = ddp__now(), t_done;
    int i;
    if (res) return res;
    if (!r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_end_backward: no backward pass to end; call "
                         "ddp_reducer_begin_backward before the backward pass");
    if (!r->pass_sync) {
        r->in_backward = 0;
        r->stats.local_iterations++;
        return DDP_SUCCESS;
    }
    if (r->desc.find_unused_parameters) {
        if ((res = ddp__reducer_fill_unused(r)) != DDP_SUCCESS) r->failed = res;
    } else {
        for (i = 0; i < r->nparams; i++)
            if (!r->ready[i]) return ddp__reducer_missing(r);
        r->stats.unused_parameters = 0;
    }
    if (!res) res = ddp__reducer_start_ready(r);
    if (!res && r->desc.find_unused_parameters) { /* PyTorch's local_used_map, reduced after the buckets */
        r->ops->copy_out(r->g, r->used_comm, DDP_U8, r->used, DDP_U8, ddp__reducer_n(r));
        if ((res = ddp_all_reduce_async(r->g, r->used_comm, ddp__reducer_n(r), DDP_U8, DDP_MAX, &used_work)) != DDP_SUCCESS)
            r->failed = res;
    }
    {
        ddp_result waited = ddp__reducer_collect(r, used_work);
        if (!res) res = waited;
    }
    r->in_backward = 0;
    memset(r->used, 0, ddp__reducer_n(r));
    if (res) return r->failed = res;
    t_done = ddp__now();
    r->stats.iterations++;
    r->stats.bytes_reduced = r->desc.find_unused_parameters ? (uint64_t)r->nparams : 0;
    for (i = 0; i < r->L.nbuckets; i++)
        r->stats.bytes_reduced += r->L.buckets[i].count * ddp_dtype_size(r->L.buckets[i].comm_dtype);
    r->stats.backward_seconds = t_enter - r->t_begin;
    r->stats.comm_seconds = r->t_first_start ? t_done - r->t_first_start : 0;
    r->stats.wait_seconds = t_done - t_enter;
    r->stats.total_comm_seconds += r->stats.comm_seconds;
    r->stats.total_wait_seconds += r->stats.wait_seconds;
    r->t_enter = t_enter;
    r->t_done = t_done;
    r->wall_minus_mono = ddp__wall_seconds() - ddp__now();
    if ((res = ddp__timing_start(r, 0)) != DDP_SUCCESS) return res;
    if (r->rebuild_pending) return ddp__reducer_rebuild(r);
    return DDP_SUCCESS;
}

/* ---- between backward passes ---- */

DDP_API ddp_result ddp_reducer_set_sync(ddp_reducer *r, int sync) {
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_set_sync: the reducer is NULL");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_set_sync(%d): called during a backward pass; set it before "
                         "ddp_reducer_begin_backward (as DDP's no_sync() wraps forward and backward)", sync);
    r->sync = sync != 0;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_zero_grad(ddp_reducer *r) {
    int i;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_zero_grad: the reducer is NULL");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_zero_grad: called during a backward pass; zero the "
                         "gradients after end_backward (after the optimizer step)");
    if (ddp__reducer_is_view(r)) {
        for (i = 0; i < r->L.nbuckets; i++)
            r->ops->zero(r->g, r->L.buckets[i].storage, r->L.buckets[i].count * ddp_dtype_size(r->L.buckets[i].dtype));
        return DDP_SUCCESS;
    }
    for (i = 0; ddp__zero2(r) && i < r->L.nbuckets; i++) /* the shards' gradients, which live here */
        r->ops->zero(r->g, r->L.buckets[i].owned, r->L.buckets[i].per * ddp_dtype_size(r->L.buckets[i].dtype));
    for (i = 0; i < r->nparams; i++) r->ops->zero(r->g, r->params[i].grad, ddp__tensor_bytes(&r->params[i]));
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_broadcast_buffers(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_broadcast_buffers");
    int root = 0;
    if (res) return res;
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_broadcast_buffers: called during a backward pass; call it "
                         "before the forward pass");
    if (r->desc.uneven_inputs && (res = ddp__join_announce(r, DDP__JOIN_BUFFERS, "ddp_reducer_broadcast_buffers", &root)) != DDP_SUCCESS)
        return res;
    return ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, root);
}

DDP_API ddp_result ddp_reducer_get_statistics(const ddp_reducer *r, ddp_reducer_statistics *out) {
    if (!r || !out)
        return ddp__fail(r ? r->g : NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_get_statistics: NULL argument");
    ddp__timing_finish((ddp_reducer *)r); /* the reducer is the caller's, not const memory: const only in the API */
    *out = r->stats;
    return DDP_SUCCESS;
}

/* The deprecated name (until 2026-11-24) of ddp_reducer_get_statistics. */
DDP_API ddp_result ddp_reducer_stats(const ddp_reducer *r, ddp_reducer_statistics *out) {
    return ddp_reducer_get_statistics(r, out);
}

DDP_API int ddp_reducer_param_bucket(const ddp_reducer *r, int index, size_t *offset) {
    if (!r || !r->L.buckets || index < 0 || index >= r->nparams) return -1;
    if (offset) *offset = r->L.param_offset[index];
    return r->L.param_bucket[index];
}

DDP_API int ddp_reducer_param_used(const ddp_reducer *r, int index) {
    if (!r || !r->finalized || index < 0 || index >= r->nparams) {
        if (!r) ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_used: the reducer is NULL");
        else if (!r->finalized) ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_param_used: call ddp_reducer_finalize first");
        else ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_param_used: index %d is not a parameter (0 .. %d)", index,
                       r->nparams - 1);
        return -1;
    }
    if (!r->stats.iterations && !r->stats.shadowed_iterations) return 0;
    return r->desc.find_unused_parameters ? r->used_global[index] != 0 : 1;
}

/* For zero_state.c: a reducer whose ZeRO shards can be read (finalized, healthy, zero_stage, not in a
   backward pass), its group, and its parameters' element counts. */
static ddp_result ddp__reducer_zero_model(ddp_reducer *r, const char *fn, ddp_group **g, int *nparams) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created with zero_stage = 0: every rank holds the "
                         "whole optimizer state; save it as it is (set zero_stage = 1 to shard it)", fn);
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: called during a backward pass; call it between steps", fn);
    *g = r->g;
    *nparams = r->nparams;
    return DDP_SUCCESS;
}
static size_t ddp__reducer_param_count(const ddp_reducer *r, int i) { return r->params[i].count; }

DDP_API void ddp_reducer_destroy(ddp_reducer *r) {
    int i;
    if (!r) return;
    ddp__zero_gather_settle(r);
    for (i = 0; r->L.buckets && i < r->L.nbuckets; i++)
        if (r->L.buckets[i].work) ddp_wait(r->L.buckets[i].work);
    if (r->ready_work) ddp_wait(r->ready_work);
    if (r->ready_comm) r->ops->release(r->g, r->ready_comm);
    ddp__free(r->ready_ns);
    ddp__layout_free(r, &r->L);
    for (i = 0; i < r->nparams; i++) ddp__free(r->params[i].name);
    for (i = 0; i < r->nbuffers; i++) ddp__free(r->buffers[i].name);
    ddp__free(r->params);
    ddp__free(r->buffers);
    ddp__free(r->ready);
    ddp__free(r->used);
    ddp__free(r->order);
    ddp__free(r->used_global);
    if (r->used_comm) r->ops->release(r->g, r->used_comm);
    if (r->stash) r->ops->release(r->g, r->stash);
    if (r->bstage) r->ops->release(r->g, r->bstage);
    if (r->shadow) r->ops->release(r->g, r->shadow);
    ddp__free(r->join_table);
    ddp__free(r->shards);
    ddp__free(r->shard_bucket);
    for (i = 0; i < r->npool; i++) r->ops->release(r->g, r->pool[i]);
    ddp__free(r->pool);
    ddp__free(r->pool_holder);
    ddp__free(r);
}

/* ---- uneven inputs: torch's Join context manager with DistributedDataParallel ----
   (torch/distributed/algorithms/join.py; _DDPJoinHook and the join parts of DistributedDataParallel in
   torch/nn/parallel/distributed.py)

   With uneven_inputs, each collective step of the reducer is announced first: every rank that still has
   data all_gathers a record {kind, flags, steps} at the start of every backward pass (begin_backward: kind
   STEP, flag SYNC unless under no_sync; torch's per-forward join all-reduce and its
   _check_global_requires_backward_grad_sync in one) and of every ddp_reducer_broadcast_buffers (kind
   BUFFERS). A rank without data calls ddp_reducer_join, which takes part in the same all_gathers with kind
   JOINED (flag FIRST in its first round) and answers each round as the active ranks' records say:
     no active rank left    the join is over: parameters and buffers are broadcast from the highest rank
                            among the last joiners (torch's _sync_final_model), and every rank returns
     STEP with SYNC         one SUM all-reduce of zeros per bucket, in bucket order and comm dtype (torch's
                            _match_all_reduce_for_bwd_pass), the used map with zeros (find_unused_parameters,
                            _match_unused_params_allreduce), then the bucket rebuild if it is still pending
     STEP without SYNC      nothing: the active ranks only accumulate locally
     BUFFERS                the buffer broadcast, from the highest active rank (torch's _find_common_rank)
   Active ranks scale their gradients by 1/(initial world size) as always, so the average includes the
   joined ranks' zeros (torch's divide_by_initial_world_size=True). ddp_reducer_join_step answers rounds
   until it has shadowed one synchronised pass (it returns, *all_joined = 0) or no active rank is left
   (*all_joined = 1); ddp_reducer_join is its loop. With zero_stage the shadow is the reduce-scatter of
   zeros, and its result, the active ranks' sum / initial world size, goes into this rank's owned gradient
   elements: the program runs its optimizer on ddp_reducer_shards and calls ddp_reducer_gather_params,
   which meets the active ranks' gather_params of the same step (torch's _ZeROJoinHook runs zero.step()).
   Every rank sees every record, so every rank checks the same things and reaches the same verdict: active
   ranks announcing different things (a no_sync pass against a synchronised one, a buffer broadcast against
   a backward pass) are DDP_ERR_MISMATCH on every rank; with join_fail_early, a round with both active and joined ranks is DDP_ERR_UNEVEN_INPUTS
   on every rank. Either way every rank took part in the same all_gathers: the group stays usable.
   Cost when the ranks are even: one all_gather of 12 bytes per rank per backward pass (torch: two 4-byte
   all-reduces per forward). */

typedef struct ddp__join_round { /* what one round's records say */
    int active, joined;  /* ranks with data / ranks in ddp_reducer_join */
    int first_active;    /* the lowest active rank, whose record the others must match (-1: none) */
    int last_active;     /* the highest active rank: buffers come from it */
    int last_joiner;     /* the highest rank in its first join round (-1: none) */
    int disagree;        /* the first active rank whose announcement differs from first_active's (-1: none) */
    int kind, sync;      /* first_active's announcement */
    int steps;           /* first_active's passes since the last join */
    int joined_steps;    /* the first joined rank's */
} ddp__join_round;

/* One round: every rank all_gathers {kind, flags, this rank's passes since the last join}. A failure
   (most often another collective of a rank with data, meeting this all_gather) breaks the group. */
static ddp_result ddp__join_exchange(ddp_reducer *r, const char *fn, int kind, int flags, ddp__join_round *v) {
    int world = ddp_world_size(r->g), k;
    int32_t *mine = r->join_table + (size_t)world * DDP__JOIN_FIELDS;
    ddp_result res;
    mine[0] = kind;
    mine[1] = flags;
    mine[2] = r->join_steps;
    if ((res = ddp_all_gather(r->g, mine, r->join_table, DDP__JOIN_FIELDS, DDP_I32)) != DDP_SUCCESS) {
        char why[DDP__ERR_MAX];
        snprintf(why, sizeof why, "%s", ddp_last_error(r->g));
        r->failed = res;
        return ddp__fail(r->g, res, "%s: the join round (uneven_inputs: an all_gather of 3 x i32 at every backward pass, "
                         "buffer broadcast and join) failed: %s. Until every rank has joined, the ranks with data may "
                         "issue only the reducer's collectives (ddp_reducer_join shadows nothing else)", fn, why);
    }
    memset(v, 0, sizeof *v);
    v->first_active = v->last_active = v->last_joiner = v->disagree = -1;
    for (k = 0; k < world; k++) {
        const int32_t *e = r->join_table + (size_t)k * DDP__JOIN_FIELDS;
        int sync = (e[1] & DDP__JOIN_SYNC) != 0;
        if (e[0] == DDP__JOIN_JOINED) {
            if (!v->joined++) v->joined_steps = e[2];
            if (e[1] & DDP__JOIN_FIRST) v->last_joiner = k;
            continue;
        }
        v->active++;
        v->last_active = k;
        if (v->first_active < 0) {
            v->first_active = k;
            v->kind = e[0];
            v->sync = sync;
            v->steps = e[2];
        } else if (v->disagree < 0 && (e[0] != v->kind || sync != v->sync)) {
            v->disagree = k;
        }
    }
    return DDP_SUCCESS;
}

static const char *ddp__join_kind_name(int kind, int sync) {
    if (kind == DDP__JOIN_BUFFERS) return "ddp_reducer_broadcast_buffers";
    return sync ? "a synchronised backward pass" : "a backward pass under no_sync (ddp_reducer_set_sync(r, 0))";
}

static ddp_result ddp__join_disagree(ddp_reducer *r, const char *fn, const ddp__join_round *v) {
    const int32_t *e = r->join_table + (size_t)v->disagree * DDP__JOIN_FIELDS;
    return ddp__fail(r->g, DDP_ERR_MISMATCH, "%s: uneven_inputs: the ranks that still have data disagree at step %d: "
                     "rank %d began %s, rank %d began %s. Every rank with data must make the same reducer calls in the "
                     "same order (the same set_sync, ddp_reducer_broadcast_buffers on all or none); the group is still "
                     "usable", fn, v->steps + 1, v->first_active, ddp__join_kind_name(v->kind, v->sync), v->disagree,
                     ddp__join_kind_name(e[0], (e[1] & DDP__JOIN_SYNC) != 0));
}

/* "0, 2, 5" for the ranks whose record is (or is not) JOINED; the first 24, then "and N more". */
static void ddp__join_list(const ddp_reducer *r, int joined, char *out, size_t cap) {
    int world = ddp_world_size(r->g), k, listed = 0, more = 0;
    size_t len = 0;
    out[0] = '\0';
    for (k = 0; k < world; k++) {
        if ((r->join_table[(size_t)k * DDP__JOIN_FIELDS] == DDP__JOIN_JOINED) != joined) continue;
        if (listed == 24) {
            more++;
            continue;
        }
        if (len < cap) len += (size_t)snprintf(out + len, cap - len, "%s%d", listed ? ", " : "", k);
        listed++;
    }
    if (more && len < cap) snprintf(out + len, cap - len, " and %d more", more);
}

/* join_fail_early: some ranks ran out while others have data. Every rank builds this same message. */
static ddp_result ddp__join_uneven(ddp_reducer *r, const char *fn, const ddp__join_round *v) {
    char joined[200], active[200];
    ddp__join_list(r, 1, joined, sizeof joined);
    ddp__join_list(r, 0, active, sizeof active);
    r->join_steps = 0; /* every rank stops this epoch here; a later one counts from 0 again */
    return ddp__fail(r->g, DDP_ERR_UNEVEN_INPUTS, "%s: uneven inputs at step %d: rank%s %s ran out of data after %d "
                     "step%s (called ddp_reducer_join) while rank%s %s still had data. join_fail_early = 1 stops every "
                     "rank here (torch's throw_on_early_termination); the group and the reducer are still usable. End "
                     "the epoch on every rank, or set join_fail_early = 0 to let the ranks without data shadow the others",
                     fn, v->steps + 1, v->joined == 1 ? "" : "s", joined, v->joined_steps, v->joined_steps == 1 ? "" : "s",
                     v->active == 1 ? "" : "s", active);
}

/* The active side of a round: announce a backward pass or a buffer broadcast; *root gets the rank whose
   buffers every rank takes (the highest active one, as torch's _find_common_rank). */
static ddp_result ddp__join_announce(ddp_reducer *r, int kind, const char *fn, int *root) {
    ddp__join_round v;
    ddp_result res = ddp__join_exchange(r, fn, kind, kind == DDP__JOIN_STEP && r->sync ? DDP__JOIN_SYNC : 0, &v);
    if (res) return res;
    if (v.disagree >= 0) return ddp__join_disagree(r, fn, &v);
    if (v.joined && r->desc.join_fail_early) return ddp__join_uneven(r, fn, &v);
    if (kind == DDP__JOIN_STEP) r->join_steps++;
    if (root) *root = v.last_active;
    return DDP_SUCCESS;
}

/* Zeros for the buckets whose comm memory is the program's gradient (views without compression); the
   other buckets' comm memory is the reducer's own and carries the zeros itself. */
static ddp_result ddp__join_shadow_memory(ddp_reducer *r) {
    size_t need = 0;
    int b;
    for (b = 0; b < r->L.nbuckets; b++)
        if (ddp__bucket_in_place(&r->L.buckets[b])) need += r->L.buckets[b].count * ddp_dtype_size(r->L.buckets[b].comm_dtype);
    if (need <= r->shadow_bytes) return DDP_SUCCESS;
    if (r->shadow) r->ops->release(r->g, r->shadow);
    r->shadow_bytes = 0;
    if (!(r->shadow = r->ops->alloc(r->g, need)))
        return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_join: out of memory (%zu bytes of zero buckets)", need);
    r->shadow_bytes = need;
    return DDP_SUCCESS;
}

/* A synchronised backward pass of the active ranks, shadowed: zeros into every bucket's all-reduce (all
   in flight at once, started in bucket order like the active ranks'), the used map, the rebuild. The
   program's gradients are not touched, except under zero_stage: the reduce-scatter's result (the active
   ranks' average) goes to this rank's owned elements, for its optimizer step (stage 2: the reducer's
   owned slices, which the shards point at; each bucket borrows a pool buffer for its zeros as in a pass
   with data, waiting for the oldest reduce-scatter when none is free). */
static ddp_result ddp__join_shadow_backward(ddp_reducer *r) {
    ddp_work *used_work = NULL;
    ddp_result res, waited;
    size_t off = 0, kept = 0;
    int b, j, keep = ddp__reducer_zero(r) && r->desc.find_unused_parameters, i;
    if ((res = ddp__join_shadow_memory(r)) != DDP_SUCCESS) return res;
    if (keep && (res = ddp__stash_reserve(r, 1, "ddp_reducer_join_step")) != DDP_SUCCESS) return r->failed = res;
    for (b = 0; b < r->L.nbuckets && !res; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        size_t bytes = k->count * ddp_dtype_size(k->comm_dtype);
        void *zeros;
        if (ddp__zero2(r) && (res = ddp__zero2_acquire(r, b)) != DDP_SUCCESS) break;
        for (j = k->first; keep && j < k->first + k->n; j++) /* no parameter is used here: any may be unused everywhere */
            kept += ddp__unused_keep(r, r->L.params[j], (char *)r->stash + kept, 0);
        zeros = ddp__bucket_in_place(k) ? (char *)r->shadow + off : k->comm;
        if (ddp__bucket_in_place(k)) off += bytes;
        r->ops->zero(r->g, zeros, bytes);
        res = ddp__bucket_start(r, k, zeros);
    }
    if (!res && r->desc.find_unused_parameters) {
        r->ops->zero(r->g, r->used_comm, ddp__reducer_n(r));
        res = ddp_all_reduce_async(r->g, r->used_comm, ddp__reducer_n(r), DDP_U8, DDP_MAX, &used_work);
    }
    for (b = 0; b < r->L.nbuckets; b++)
        if (r->L.buckets[b].work) {
            waited = ddp_wait(r->L.buckets[b].work);
            r->L.buckets[b].work = NULL;
            if (!res) res = waited;
            if (ddp__zero2(r)) ddp__zero2_finish(r, &r->L.buckets[b], !res); /* the slice stays in the reducer */
        }
    if (used_work && (waited = ddp_wait(used_work)) != DDP_SUCCESS && !res) res = waited;
    if (res) return r->failed = res;
    if (used_work) r->ops->copy_out(r->g, r->used_global, DDP_U8, r->used_comm, DDP_U8, ddp__reducer_n(r));
    if (keep) ddp__reducer_finish_unused(r, 1); /* a parameter no rank used keeps what it held */
    for (i = 0; !keep && ddp__reducer_zero(r) && !ddp__zero2(r) && i < r->nparams; i++) ddp__zero_give_back(r, i);
    r->stats.shadowed_iterations++;
    ddp__timing_finish(r);
    if ((res = ddp__timing_start(r, 1)) != DDP_SUCCESS) return res;
    if (r->rebuild_pending) return ddp__reducer_rebuild(r);
    return DDP_SUCCESS;
}

/* What join and join_step refuse before any round (nothing collective has happened then). */
static ddp_result ddp__join_check(ddp_reducer *r, const char *fn) {
    ddp_result res = ddp__reducer_usable(r, fn);
    if (res) return res;
    if (!r->desc.uneven_inputs)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer was created without uneven_inputs; set uneven_inputs = 1 "
                         "in its ddp_reducer_desc (on every rank) to let ranks run out of data", fn);
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: called during a backward pass; end it first (ddp_reducer_end_backward), "
                         "then join when there is no data left", fn);
    if ((res = ddp__zero_gather_settle(r)) != DDP_SUCCESS) return res;
    if (r->join_gather_due)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the last join step gave this rank's shards the averaged gradients; run "
                         "the optimizer on ddp_reducer_shards and call ddp_reducer_gather_params (the ranks with data are "
                         "in theirs) before the next ddp_reducer_join_step", fn);
    return DDP_SUCCESS;
}

/* Rounds until one synchronised pass of the active ranks is shadowed (*all_joined = 0) or none is left
   (*all_joined = 1: the final model and buffers from the last joiner). An error ends this rank's join:
   the next call announces a first round again. */
static ddp_result ddp__join_step(ddp_reducer *r, const char *fn, int *all_joined) {
    ddp__join_round v;
    ddp_result res;
    for (;;) {
        int flags = r->join_joined ? 0 : DDP__JOIN_FIRST;
        if ((res = ddp__join_exchange(r, fn, DDP__JOIN_JOINED, flags, &v)) != DDP_SUCCESS) return res;
        r->join_joined = 1;
        if (v.active == 0) break;
        if (v.disagree >= 0 || r->desc.join_fail_early) {
            r->join_joined = 0; /* this rank's join ends with the error */
            return v.disagree >= 0 ? ddp__join_disagree(r, fn, &v) : ddp__join_uneven(r, fn, &v);
        }
        if (v.kind == DDP__JOIN_BUFFERS)
            res = ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, v.last_active);
        else if (v.sync && (res = ddp__join_shadow_backward(r)) == DDP_SUCCESS) {
            r->join_gather_due = ddp__reducer_zero(r);
            return DDP_SUCCESS;
        }
        if (res) return r->failed = res;
    }
    r->join_joined = 0;
    r->join_steps = 0;
    if ((res = ddp__reducer_sync_states(r, v.last_joiner >= 0 ? v.last_joiner : 0, fn)) != DDP_SUCCESS)
        return r->failed = res;
    *all_joined = 1;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_join_step(ddp_reducer *r, int *all_joined) {
    ddp_result res;
    if (all_joined) *all_joined = 0;
    if ((res = ddp__join_check(r, "ddp_reducer_join_step")) != DDP_SUCCESS) return res;
    if (!all_joined) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_join_step: all_joined is NULL");
    return ddp__join_step(r, "ddp_reducer_join_step", all_joined);
}

/* join_step's loop, for stage 0: between shadowed passes this rank has nothing to do. */
DDP_API ddp_result ddp_reducer_join(ddp_reducer *r) {
    ddp_result res = ddp__join_check(r, "ddp_reducer_join");
    int all_joined = 0;
    if (res) return res;
    if (ddp__reducer_zero(r))
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_join: zero_stage = %d: a joined rank still owns slices of the "
                         "model, which its optimizer must update at every step of the others: call "
                         "ddp_reducer_join_step(r, &all_joined) in a loop, with the optimizer step on ddp_reducer_shards "
                         "and ddp_reducer_gather_params after each step that returns all_joined = 0", r->desc.zero_stage);
    while (!all_joined)
        if ((res = ddp__join_step(r, "ddp_reducer_join", &all_joined)) != DDP_SUCCESS) return res;
    return DDP_SUCCESS;
}

