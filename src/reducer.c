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
     set_local_samples(n)     (optional) all-reduce n: this pass scales by n / (sum of n), not 1/world
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
   their first parameter, which is the order they fill in, and so the order they are all-reduced in.

   The pieces: reducer_state.h (the state), this file (creation, finalize, bucket layout, timing),
   reducer_zero.c (ZeRO's slices and comm pool), reducer_pass.c (backward, between passes, Join). */
#include "internal.h"
#include "reducer_state.h"

/* ---- creation and registration ---- */

/* zero_stage: what is implemented, and the combinations refused (see "ZeRO" in reducer.h). */
static ddp_result ddp__zero_check_desc(ddp_group *g, const ddp_reducer_desc *d) {
    if (d->zero_stage < 0 || d->zero_stage > 3)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: zero_stage %d is not 0 (DDP), 1 (ZeRO-1: "
                         "optimizer state sharded), 2 (ZeRO-2: gradients too) or 3 (ZeRO-3 / FSDP: parameters too)",
                         d->zero_stage);
    if (d->zero_stage >= 2 && d->gradient_as_bucket_view)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: zero_stage = %d with gradient_as_bucket_view = 1 "
                         "is not supported: the buckets would have to hold every gradient, which is what ZeRO-2 frees; "
                         "register your own gradient buffers (gradient_as_bucket_view = 0) or use zero_stage = 1",
                         d->zero_stage);
    if (g && g->ft_mode && d->zero_stage)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_reducer_create: zero_stage %d in fault-tolerant mode is not supported "
                         "(a view change would have to re-shard the optimizer state); use zero_stage 0", d->zero_stage);
    if (d->zero_stage != 3 && (d->param_dtype != DDP_DTYPE_DEFAULT || d->prefetch || d->accumulate_unsharded))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: param_dtype, prefetch and accumulate_unsharded are zero_stage 3's (the "
                         "gathered parameters); at zero_stage %d leave them 0", d->zero_stage);
    if (d->zero_stage != 3) return DDP_SUCCESS;
    if (d->param_dtype != DDP_DTYPE_DEFAULT && !(ddp__dtype_valid(d->param_dtype) && ddp__dtype_is_float(d->param_dtype)))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: param_dtype %d is not DDP_DTYPE_DEFAULT or a "
                         "floating dtype (DDP_BF16 or DDP_F16 for mixed precision)", (int)d->param_dtype);
    if (d->prefetch < 0 || d->prefetch > 64)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_create: prefetch %d is not 0 .. 64 (gathers in flight "
                         "besides the unit in use)", d->prefetch);
    if (d->uneven_inputs)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_reducer_create: zero_stage 3 with uneven_inputs is not supported: a "
                         "rank without data would have to shadow every unit's gathers; end the epoch on every rank at "
                         "the same step (ddp_sampler's drop_last, or a step count agreed with ddp_all_reduce)");
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
    e->unit = -1;
    e->ndim = 0;
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
    if (ddp__fsdp(r) && grad)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): at zero_stage 3 gradients live in "
                         "the units' buffers: pass grad = NULL and write them where ddp_fsdp_grad() points", name);
    if (ddp__fsdp(r) && !r->nunits)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): at zero_stage 3 every parameter "
                         "belongs to a unit: call ddp_fsdp_unit first", name);
    if (ddp__reducer_is_view(r) && grad)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): with gradient_as_bucket_view the "
                         "gradient lives in the bucket: pass grad = NULL and write it where ddp_reducer_grad() points", name);
    if (!ddp__reducer_is_view(r) && !ddp__fsdp(r) && !grad)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): the gradient pointer is NULL "
                         "(pass the gradient buffer, or set gradient_as_bucket_view)", name);
    if (r->nparams == INT_MAX / 2) return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param: too many parameters");
    if (r->nunits && r->units[r->nunits - 1].n && t != r->params[r->units[r->nunits - 1].first].dtype)
        return ddp__fail(r->g, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_add_param(\"%s\"): dtype %s in unit \"%s\", whose "
                         "parameters are %s: a unit is one bucket of one dtype; open another unit for it", name,
                         ddp_dtype_name(t), r->units[r->nunits - 1].name,
                         ddp_dtype_name(r->params[r->units[r->nunits - 1].first].dtype));
    if ((res = ddp__reducer_append(r, &r->params, &r->nparams, &r->cap_params, name, param, grad, count, t)) != DDP_SUCCESS)
        return res;
    r->params[r->nparams - 1].unit = r->nunits - 1;
    if (r->nunits) r->units[r->nunits - 1].n++;
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
             "%llu buffers, this rank %d: %d and %d), and the order of entries differs nowhere that a record shows: "
             "the FSDP units (ddp_fsdp_unit: where each starts, its flags) may differ; register the same units, "
             "parameters and buffers (names, counts, dtypes) in the same order on every rank",
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
   is {magic, params, buffers, hash of the model and its units, zero_stage | prefetch << 8 | param_dtype <<
   16 | accumulate_unsharded << 24}; the ranks' zero_stage must agree, else they would issue different
   collectives for the same bucket (a reduce-scatter against an all-reduce), and at stage 3 their pools,
   gather dtypes and no_sync modes too (a pool overrun on one rank alone would leave the others waiting in
   a gather; a no_sync pass reduce-scatters on one rank and not on another). */
static ddp_result ddp__reducer_verify(ddp_reducer *r) {
    ddp_group *g = r->g;
    int world = ddp_world_size(g), i, k;
    uint64_t mine[DDP__VERIFY_FIELDS], *all;
    ddp_result res;
    mine[0] = 0x4444505245445543ull; /* "DDPREDUC": a reducer's record */
    mine[1] = (uint64_t)r->nparams;
    mine[2] = (uint64_t)r->nbuffers;
    mine[3] = 14695981039346656037ull;
    /* what makes the ranks issue different collectives: zero_stage; at 3 the pool's size and the gathers' dtype */
    mine[4] = (uint64_t)r->desc.zero_stage | (uint64_t)r->desc.prefetch << 8 | (uint64_t)r->desc.param_dtype << 16 |
              (uint64_t)(r->desc.accumulate_unsharded != 0) << 24;
    for (i = 0; i < r->nparams; i++) mine[3] = ddp__rtensor_hash(mine[3], &r->params[i]);
    for (i = 0; i < r->nbuffers; i++) mine[3] = ddp__rtensor_hash(mine[3] ^ 0x9e3779b97f4a7c15ull, &r->buffers[i]);
    for (i = 0; i < r->nunits; i++) { /* the units: where each starts, and its flags */
        uint64_t unit[2];
        unit[0] = (uint64_t)r->units[i].first, unit[1] = (uint64_t)r->units[i].flags;
        mine[3] = ddp__hash_bytes(mine[3] ^ 0x51ed270b27d3a5c1ull, unit, sizeof unit);
    }
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
            uint64_t theirs = all[DDP__VERIFY_FIELDS * k + 4], first = all[4];
            ddp__free(all);
            if ((theirs & 0xff) != (first & 0xff))
                return ddp__fail(g, DDP_ERR_MISMATCH, "ddp_reducer_finalize: the ranks created their reducers with different "
                                 "zero_stage: rank 0 has %d, rank %d has %d; every rank must use the same zero_stage in its "
                                 "ddp_reducer_desc", (int)(first & 0xff), k, (int)(theirs & 0xff));
            return ddp__fail(g, DDP_ERR_MISMATCH, "ddp_reducer_finalize: the ranks created their zero_stage 3 reducers with "
                             "different prefetch / param_dtype / accumulate_unsharded: rank 0 has %d / %s / %d, rank %d has "
                             "%d / %s / %d; every rank must use the same in its ddp_reducer_desc (the pool's size, the "
                             "gathers' dtype, what a no_sync pass reduces)", (int)(first >> 8 & 0xff),
                             ddp_dtype_name((ddp_dtype)(first >> 16 & 0xff)), (int)(first >> 24 & 1), k, (int)(theirs >> 8 & 0xff),
                             ddp_dtype_name((ddp_dtype)(theirs >> 16 & 0xff)), (int)(theirs >> 24 & 1));
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
        if (k->master) r->ops->release(r->g, k->master);
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
        if (p->unit >= 0 && open[t] >= 0 && L->buckets[open[t]].unit != p->unit) open[t] = -1; /* a unit: a bucket */
        if (open[t] < 0) {
            open[t] = L->nbuckets++;
            filled[t] = 0;
            k = &L->buckets[open[t]];
            k->dtype = p->dtype;
            k->comm_dtype = r->desc.comm_dtype == DDP_DTYPE_DEFAULT ? p->dtype : r->desc.comm_dtype;
            k->unit = p->unit;
        }
        k = &L->buckets[open[t]];
        L->param_bucket[walk[i]] = open[t];
        L->param_offset[walk[i]] = k->count;
        k->count += p->count;
        k->n++;
        filled[t] += ddp__tensor_bytes(p);
        if (filled[t] >= limit && p->unit < 0) { /* the parameter that crosses the limit stays in the bucket */
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
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d's slice (zero_stage %d: %zu "
                             "elements)", b, r->desc.zero_stage, k->per);
        if (ddp__fsdp(r) && !(k->master = r->ops->alloc(r->g, k->per * gs))) /* padded with zeros: ddp_alloc's */
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for unit %d's master shard (zero_stage 3: %zu "
                             "elements)", k->unit, k->per);
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

/* The reducer can run a pass or an optimizer-side call: finalized and not failed. */
/* A reducer call failed with res: the reducer stops (every later call says so) -- except on
   DDP_ERR_VIEW_CHANGED (fault-tolerant mode: ft.c repairs the group), which only abandons the pass: the
   buckets' collectives are waited for (they fail at once on the broken group) and the next
   begin_backward starts afresh in the new view. Returns res. */
static ddp_result ddp__reducer_stop(ddp_reducer *r, ddp_result res) {
    int b;
    if (res != DDP_ERR_VIEW_CHANGED) return r->failed = res;
    for (b = 0; b < r->L.nbuckets; b++)
        if (r->L.buckets[b].work) {
            ddp_wait(r->L.buckets[b].work);
            r->L.buckets[b].work = NULL;
        }
    if (r->ready_work) {
        ddp_wait(r->ready_work);
        r->ready_work = NULL;
    }
    r->in_backward = 0;
    return res;
}

static ddp_result ddp__reducer_usable(ddp_reducer *r, const char *fn) {
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the reducer is NULL", fn);
    if (!r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "%s: call ddp_reducer_finalize first", fn);
    if (r->failed)
        return ddp__fail(r->g, DDP_ERR_STATE, "%s: the reducer stopped after an earlier error (%s); destroy it and the "
                         "group", fn, ddp_result_string(r->failed));
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

/* The split of the pass that ended at r->t_done, given when the last rank was ready (monotonic). */
static void ddp__timing_account(ddp_reducer *r, double t_last, int last_rank) {
    double wait = r->t_done - r->t_enter, straggler = DDP__MIN(t_last, r->t_done) - r->t_enter;
    if (straggler < 0) straggler = 0;
    r->stats.straggler_wait_seconds = straggler;
    r->stats.transfer_seconds = wait - straggler;
    r->stats.last_ready_rank = last_rank;
    r->stats.total_straggler_wait_seconds += straggler;
    r->stats.total_transfer_seconds += wait - straggler;
    if (ddp__timeline_on()) { /* reducer.wait: the wait inside that pass's end_backward, split */
        static const char *const names[4] = {"iteration", "straggler", "straggler_wait_us", "transfer_us"};
        double values[4];
        values[0] = r->timed_pass, values[1] = last_rank;
        values[2] = straggler * 1e6, values[3] = (wait - straggler) * 1e6;
        ddp__timeline_span("reducer.wait", r->t_enter, r->t_done, names, values, 4, NULL, NULL);
    }
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
    if (world > r->ready_world) { /* a view that admitted joiners (fault tolerance) */
        int64_t *ns = (int64_t *)ddp__calloc((size_t)world + 1, sizeof *ns);
        void *c = r->ops->alloc(r->g, ((size_t)world + 1) * sizeof(int64_t));
        if (!ns || !c) {
            ddp__free(ns);
            if (c) r->ops->release(r->g, c);
            return ddp__reducer_stop(r, ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_end_backward: out of memory"));
        }
        ddp__free(r->ready_ns);
        r->ops->release(r->g, r->ready_comm);
        r->ready_ns = ns, r->ready_comm = c, r->ready_world = world;
        comm = (char *)c;
    }
    r->ready_ns[world] = shadow ? 0 : (int64_t)((r->t_ready + r->wall_minus_mono) * 1e9);
    r->ops->copy_out(r->g, comm + (size_t)world * 8, DDP_I64, &r->ready_ns[world], DDP_I64, 1);
    if ((res = ddp_all_gather_async(r->g, comm + (size_t)world * 8, comm, 1, DDP_I64, &r->ready_work)) != DDP_SUCCESS)
        return ddp__reducer_stop(r, res);
    r->ready_discard = shadow;
    r->ready_gathered = world;
    return DDP_SUCCESS;
}

/* Wait for the last pass's all_gather and split its wait. A failure is the group's (its next collective
   says so); that pass's split is then left out. */
static void ddp__timing_finish(ddp_reducer *r) {
    int world = r->ready_gathered, k, last = 0; /* (the world of the pass it timed: a view change may follow) */
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

