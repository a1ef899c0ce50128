/* [SECTION] reducer-state: the Reducer's state and the calls between its pieces
   reducer.c (the model, finalize, bucket layout, timing), reducer_zero.c (ZeRO's slices and pool),
   reducer_pass.c (backward, between passes, Join) and reducer_amp.c (grad_stats' results) share these;
   nothing else in the library does. */
#ifndef DDP__REDUCER_STATE_H
#define DDP__REDUCER_STATE_H
/* (each piece includes internal.h first) */

#define DDP__REDUCER_DEFAULT_CAP ((size_t)25 << 20)        /* DDP's bucket_cap_mb = 25 */
#define DDP__REDUCER_DEFAULT_FIRST ((size_t)1 << 20)       /* dist._DEFAULT_FIRST_BUCKET_BYTES */
#define DDP__REDUCER_BROADCAST_CHUNK ((size_t)250 << 20)   /* DDP's broadcast_bucket_size */
#define DDP__REDUCER_SMALL_TENSOR ((size_t)1 << 20)        /* smaller tensors are coalesced for broadcast */
#define DDP__REDUCER_NAME_RECORD 72                        /* name bytes in a mismatch record */
#define DDP__VERIFY_FIELDS 5                               /* a model record: see ddp__reducer_verify */
#define DDP__JOIN_FIELDS 3                                 /* a join record: kind, flags, steps */
enum { DDP__JOIN_JOINED = 0, DDP__JOIN_STEP = 1, DDP__JOIN_BUFFERS = 2 }; /* a join record's kind */
enum { DDP__JOIN_SYNC = 1, DDP__JOIN_FIRST = 2, DDP__JOIN_SAMPLES = 4 }; /* and its flags (SAMPLES: a pass that
                                                                           ddp_reducer_set_local_samples weights) */
#define DDP__SAMPLES_MAX ((int64_t)1 << 40) /* ddp_reducer_set_local_samples' n: the sum over any world fits in i64 */

/* ---- the reducer's state ---- */

typedef struct ddp__rtensor { /* a registered parameter or buffer */
    char *name;
    void *data;  /* the parameter's values, or the buffer */
    void *grad;  /* the program's gradient (plain mode); NULL for views and buffers */
    size_t count;
    ddp_dtype dtype;
    int unit;    /* parameters: the FSDP unit it belongs to (ddp_fsdp_unit), -1 for none */
    int ndim;    /* parameters: the shape ddp_reducer_param_shape gave (0: none; saved as 1-D) */
    int64_t shape[8];
} ddp__rtensor;

/* An FSDP unit (reducer_fsdp.c): parameters registered together, one bucket, gathered as one. */
enum { DDP__UNIT_SHARDED = 0, DDP__UNIT_GATHERING, DDP__UNIT_GATHERED }; /* its parameters' state */
typedef struct ddp__unit {
    char *name;
    int flags;        /* DDP_FSDP_KEEP */
    int first, n;     /* its parameters: params[first .. first + n) */
    int bucket;       /* its bucket (set at finalize) */
    int state;        /* DDP__UNIT_* */
    void *gathered;   /* the gathered unit (param_dtype, world * per elements) while not SHARDED */
    int slot;         /* the gather pool buffer it holds, -1 for none (a KEEP unit's buffer is its own) */
    void *own;        /* zero_stage 3, KEEP: its own gather buffer; its own gradient buffer follows (grad_own) */
    void *grad_own;   /* KEEP units', and every unit's with accumulate_unsharded */
    int grad_held;    /* accumulate_unsharded: grad_own holds gradients of no_sync passes (not zeroed when taken) */
    void *grad;       /* its gradient buffer in the current pass (NULL until ddp_fsdp_grad takes one) */
    int grad_slot;    /* the gradient pool buffer that grad is, -1 for none or a KEEP unit's own */
    int grads_done;   /* ddp_fsdp_grads_ready was called in this pass */
    ddp_work *work;   /* its all-gather while in flight */
    double t_issued;  /* when that was issued (statistics' gather_seconds) */
} ddp__unit;

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
    void *master;         /* zero_stage 3: this rank's slice of the parameters (per, the registered dtype): the
                             master shard the optimizer steps (ddp_shard.param_data points into it) */
    int unit;             /* the FSDP unit this bucket is, -1 for none */
    size_t stash_at;      /* zero_stage 3 with find_unused: where the stash mirrors its owned slice */
    ddp_work *work;       /* its all-reduce, while in flight */
    double t_started;     /* when this pass started it (ddp__now; the timeline's reducer.bucket), 0 when off */
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
    uint64_t pass_view;  /* the group's ft_views when this pass began (fault-tolerant mode) */
    void *stash;       /* view without compression + find_unused: gradients of unused parameters */
    size_t stash_bytes;
    ddp_shard *shards; /* zero_stage: this rank's pieces of the model, in bucket order */
    int nshards;
    int *shard_bucket; /* per shard: its bucket */
    void **pool;       /* zero_stage 2: npool full-size comm buffers (room for nbuckets), see "ZeRO stage 2" */
    int *pool_holder;  /* per pool buffer: the bucket that holds it, -1 when free */
    int npool, pool_room;
    size_t pool_bytes, pool_land; /* bytes per buffer; where the reduce-scatter lands under compression */
    ddp__unit *units;  /* FSDP units (ddp_fsdp_unit), in registration order */
    int nunits, cap_units;
    void **gpool;      /* zero_stage 3: 1 + prefetch gather buffers of gpool_bytes, see reducer_fsdp.c */
    int *gpool_holder; /* per gather buffer: the unit that holds it, -1 when free */
    int ngpool;
    size_t gpool_bytes;
    void **gradpool;   /* zero_stage 3: gradient buffers of gradpool_bytes (room for one per unit) */
    int *gradpool_holder;
    int ngradpool;
    size_t gradpool_bytes;
    int accumulate;    /* zero_stage 3: this pass adds its averaged gradients to the slices (no_sync before) */
    int offload;       /* zero_stage 3: the parameters are device memory on a host backend (reducer_fsdp.c) */
    int pass_user_sync; /* zero_stage 3: the pass was begun under set_sync(1) (every pass reduce-scatters) */
    /* local samples (ddp_reducer_set_local_samples): see "local samples" in reducer_pass.c */
    double grad_scale;  /* this pass: each gradient times this into its bucket: 1/world, or n / (sum of n) */
    int pass_handed;    /* a gradient was handed over in this pass (grad_ready, ddp_fsdp_grads_ready) */
    int samples_done;   /* set_local_samples was called in this pass */
    int samples_sticky; /* set_local_samples was called once: uneven_inputs announces every later synchronised pass
                           as weighted, so that joined ranks take part in its sample count */
    int samples_due;    /* uneven_inputs: this pass was announced weighted: set_local_samples must come */
    int pass_joined;    /* uneven_inputs: ranks that were in a join at this pass's round (they shadow it) */
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
    int ready_world;      /* the world size they are sized for (fault tolerance's joiners make it grow) */
    int ready_gathered;   /* the world size of the all_gather in flight (ready_work) */
    ddp_work *ready_work; /* that all_gather, in flight from end_backward until the pass's timing is done */
    int ready_discard;    /* the pass in flight was a joined rank's shadow: nothing to account */
    double t_ready;       /* this pass: the last bucket started (this rank's gradients all there) */
    double timed_pass;    /* the number of the pass that t_enter / t_done time (the timeline's reducer.wait) */
    double t_enter, t_done, wall_minus_mono; /* this pass: end_backward's entry and end; clock offset */

    ddp_reducer_statistics stats;
    double t_begin, t_first_start;

    ddp__amp_pass amp;    /* grad_stats / loss_scale: the last synchronised pass's norm and inf count (amp.c) */
};

static size_t ddp__reducer_n(const ddp_reducer *r) { return (size_t)(unsigned)r->nparams; } /* never negative */
static int ddp__reducer_is_view(const ddp_reducer *r) { return r->desc.gradient_as_bucket_view; }
static int ddp__reducer_zero(const ddp_reducer *r) { return r->desc.zero_stage != 0; }
static int ddp__zero2(const ddp_reducer *r) { return r->desc.zero_stage >= 2; } /* gradients sharded: 2 and 3 */
static int ddp__fsdp(const ddp_reducer *r) { return r->desc.zero_stage == 3; }  /* parameters sharded too */
static int ddp__grad_stats_on(const ddp_reducer *r) { return r->desc.grad_stats || r->desc.loss_scale; }
/* Gradients scaled and reduced in place in the bucket (a view without compression). */
static int ddp__bucket_in_place(const ddp__bucket *b) { return b->storage != NULL && b->comm == b->storage; }
static size_t ddp__tensor_bytes(const ddp__rtensor *t) { return t->count * ddp_dtype_size(t->dtype); }

/* ---- reducer.c: the model, finalize, the bucket layout, timing (for reducer_zero.c, reducer_pass.c) ---- */
static DDP__UNUSED ddp_result ddp__reducer_verify(ddp_reducer *r);
static DDP__UNUSED ddp_result ddp__reducer_broadcast(ddp_reducer *r, ddp__rtensor *ts, int n, void *stage, size_t stage_bytes,
                                                     int root);
static DDP__UNUSED size_t ddp__stage_bytes(const ddp__rtensor *ts, int n);
static DDP__UNUSED ddp_result ddp__reducer_sync_states(ddp_reducer *r, int root, const char *fn);
static DDP__UNUSED void ddp__layout_free(ddp_reducer *r, ddp__layout *L);
static DDP__UNUSED ddp_result ddp__layout_assign(ddp_reducer *r, const int *walk, ddp__layout *L);
static DDP__UNUSED int ddp__layout_same(const ddp_reducer *r, const ddp__layout *a, const ddp__layout *b);
static DDP__UNUSED int ddp__bucket_flat(ddp_reducer *r, ddp__layout *L, int b);
static DDP__UNUSED ddp_result ddp__zero_bucket_alloc(ddp_reducer *r, ddp__bucket *k, int b);
static DDP__UNUSED ddp_result ddp__reducer_usable(ddp_reducer *r, const char *fn);
/* A call failed with res: the reducer stops, except on DDP_ERR_VIEW_CHANGED, which abandons the pass. Returns res. */
static DDP__UNUSED ddp_result ddp__reducer_stop(ddp_reducer *r, ddp_result res);
static DDP__UNUSED double ddp__wall_seconds(void);
static DDP__UNUSED ddp_result ddp__timing_start(ddp_reducer *r, int shadow);
static DDP__UNUSED void ddp__timing_finish(ddp_reducer *r);

/* ---- reducer_zero.c: ZeRO stage 1 and 2 (for reducer_pass.c) ---- */
static DDP__UNUSED void *ddp__zero2_land(const ddp_reducer *r, const ddp__bucket *k);
static DDP__UNUSED void ddp__zero2_finish(ddp_reducer *r, ddp__bucket *k, int done);
static DDP__UNUSED ddp_result ddp__zero2_acquire(ddp_reducer *r, int b);
static DDP__UNUSED void *ddp__layout_view(const ddp_reducer *r, const ddp__layout *L, int i);
static DDP__UNUSED ddp_result ddp__reducer_relayout(ddp_reducer *r, const int *walk, int *taken);
static DDP__UNUSED int ddp__zero_piece(const ddp_reducer *r, int i, size_t *lo, size_t *a, size_t *e);
static DDP__UNUSED void ddp__zero_give_back(ddp_reducer *r, int i);
static DDP__UNUSED ddp_result ddp__zero_gather_settle(ddp_reducer *r);

/* ---- reducer_fsdp.c: FSDP units (for reducer_pass.c) ---- */
static DDP__UNUSED ddp_dtype ddp__fsdp_dtype(const ddp_reducer *r, const ddp__bucket *k); /* gathered / unit grads */
static DDP__UNUSED ddp_result ddp__fsdp_finalize(ddp_reducer *r);
static DDP__UNUSED ddp_result ddp__fsdp_check(ddp_reducer *r, int unit, const char *fn);
static DDP__UNUSED int ddp__fsdp_in_comm(const ddp_reducer *r, const ddp__unit *u);
static DDP__UNUSED void *ddp__fsdp_alloc(ddp_reducer *r, size_t bytes);
static DDP__UNUSED ddp_result ddp__fsdp_reshard_all(ddp_reducer *r);
static DDP__UNUSED void ddp__fsdp_grad_put_back(ddp_reducer *r, ddp__unit *u);
static DDP__UNUSED void ddp__fsdp_free(ddp_reducer *r);

#endif /* DDP__REDUCER_STATE_H */
