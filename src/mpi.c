/* [SECTION] mpi: the mpi backend, collectives through the MPI library (built with -DDDP_MPI)
   (torch.distributed's "mpi" backend, ProcessGroupMPI)

   A program compiled with mpicc -DDDP_MPI and started by mpirun can ask for backend "mpi" (in
   ddp_init_desc.backend or DDP_BACKEND=mpi). Rank and world size then come from MPI_COMM_WORLD, no
   store or sockets are made, and every collective is the MPI call of the same name on a duplicate of
   MPI_COMM_WORLD (subgroups: MPI_Comm_split of their parent's communicator):

       all_reduce -> MPI_Allreduce (MPI_IN_PLACE)     reduce         -> MPI_Reduce
       broadcast  -> MPI_Bcast                        all_gather     -> MPI_Allgather
       barrier    -> MPI_Barrier                      reduce_scatter -> MPI_Reduce_scatter_block

   f16 and bf16 are reduced by user-defined MPI operations that add in f32 and round to nearest even
   (MPI has no 16-bit floats); AVG is SUM followed by a division, as on the cpu backend. Counts above
   INT_MAX are cut into pieces for all_reduce, broadcast and reduce.

   What MPI does not do, this file adds: before each collective every rank contributes its call's
   fingerprint (kind, count, dtype, op, root, sequence number) to one small MPI_Allreduce, so a rank
   that calls a different collective gets DDP_ERR_MISMATCH on every rank (naming the rank that differs)
   instead of a hang or corrupt data; it costs one 16-byte all-reduce per call. A lost rank or a hang is
   the MPI library's business: mpirun stops the job when a rank dies, and MPI calls have no timeout.

   Async work runs on the group's progress thread, so MPI must be initialised with MPI_THREAD_MULTIPLE
   (ddp_init does that when MPI is not initialised yet, and finalises MPI at exit; a program that
   initialised MPI itself with a lower thread level gets a clear error). */
#include "internal.h"

#ifdef DDP_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1 /* the deprecated C++ bindings do not compile warning-free; the C API is all we use */
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

struct ddp__mpi {
    MPI_Comm comm;
    int local_rank, local_world_size; /* among the communicator's ranks that share this node's memory */
};

static MPI_Datatype ddp__mpi_f16_type = MPI_DATATYPE_NULL, ddp__mpi_bf16_type = MPI_DATATYPE_NULL;
static MPI_Op ddp__mpi_half_ops[DDP_OP_COUNT];
static pthread_mutex_t ddp__mpi_once_mu = PTHREAD_MUTEX_INITIALIZER;
static int ddp__mpi_ready; /* the types and operations above exist */

static void ddp__mpi_finalize_at_exit(void) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
}

/* An MPI error code as text, for messages. */
static const char *ddp__mpi_error_string(int code, char *buf) {
    int len = 0;
    if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) snprintf(buf, MPI_MAX_ERROR_STRING, "MPI error %d", code);
    return buf;
}

/* The user-defined reduction for f16 and bf16: inout[i] = inout[i] (op) in[i], in f32, rounded once. */
#define DDP__MPI_HALF_OP(name, op)                                                                   \
    static void name(void *in, void *inout, int *len, MPI_Datatype *type) {                          \
        ddp__reduce(inout, in, (size_t)*len, *type == ddp__mpi_bf16_type ? DDP_BF16 : DDP_F16, op); \
    }
DDP__MPI_HALF_OP(ddp__mpi_half_sum, DDP_SUM)
DDP__MPI_HALF_OP(ddp__mpi_half_prod, DDP_PROD)
DDP__MPI_HALF_OP(ddp__mpi_half_min, DDP_MIN)
DDP__MPI_HALF_OP(ddp__mpi_half_max, DDP_MAX)

/* Initialise MPI if nobody has (MPI_THREAD_MULTIPLE), check the thread level, and make the 16-bit
   float types and their operations once per process. */
static ddp_result ddp__mpi_start(char *err) {
    int initialized = 0, finalized = 0, provided = 0, rc;
    char msg[MPI_MAX_ERROR_STRING];
    ddp_result r = DDP_SUCCESS;
    pthread_mutex_lock(&ddp__mpi_once_mu);
    MPI_Finalized(&finalized);
    MPI_Initialized(&initialized);
    if (finalized) {
        r = ddp__fail_to(err, DDP_ERR_STATE, "backend mpi: MPI is already finalised in this process and cannot start again; "
                         "call ddp_init before MPI_Finalize");
    } else if (!initialized) {
        rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS)
            r = ddp__fail_to(err, DDP_ERR_INIT, "backend mpi: MPI_Init_thread failed: %s (was the program started by mpirun?)",
                             ddp__mpi_error_string(rc, msg));
        else
            atexit(ddp__mpi_finalize_at_exit);
    } else {
        MPI_Query_thread(&provided);
    }
    if (r == DDP_SUCCESS && provided < MPI_THREAD_MULTIPLE)
        r = ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "backend mpi: MPI provides thread level %d, but ddp.h needs "
                         "MPI_THREAD_MULTIPLE (%d): async collectives run on a progress thread. Initialise MPI with "
                         "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let ddp_init do it",
                         provided, MPI_THREAD_MULTIPLE);
    if (r == DDP_SUCCESS && !ddp__mpi_ready) {
        MPI_Type_contiguous(2, MPI_BYTE, &ddp__mpi_f16_type);
        MPI_Type_commit(&ddp__mpi_f16_type);
        MPI_Type_contiguous(2, MPI_BYTE, &ddp__mpi_bf16_type);
        MPI_Type_commit(&ddp__mpi_bf16_type);
        MPI_Op_create(ddp__mpi_half_sum, 1, &ddp__mpi_half_ops[DDP_SUM]);
        ddp__mpi_half_ops[DDP_AVG] = ddp__mpi_half_ops[DDP_SUM];
        MPI_Op_create(ddp__mpi_half_prod, 1, &ddp__mpi_half_ops[DDP_PROD]);
        MPI_Op_create(ddp__mpi_half_min, 1, &ddp__mpi_half_ops[DDP_MIN]);
        MPI_Op_create(ddp__mpi_half_max, 1, &ddp__mpi_half_ops[DDP_MAX]);
        ddp__mpi_ready = 1;
    }
    pthread_mutex_unlock(&ddp__mpi_once_mu);
    return r;
}

/* A communicator of our own (errors returned, not fatal) wrapped for the group. */
static ddp_result ddp__mpi_wrap(MPI_Comm comm, struct ddp__mpi **out, char *err) {
    struct ddp__mpi *m = (struct ddp__mpi *)ddp__calloc(1, sizeof *m);
    if (!m) {
        MPI_Comm_free(&comm);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "backend mpi: out of memory");
    }
    MPI_Comm node;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    m->comm = comm;
    m->local_rank = m->local_world_size = -1;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_rank(node, &m->local_rank);
        MPI_Comm_size(node, &m->local_world_size);
        MPI_Comm_free(&node);
    }
    *out = m;
    return DDP_SUCCESS;
}

/* This rank's place in MPI_COMM_WORLD, and a communicator for the world group. */
static ddp_result ddp__mpi_world(int *rank, int *world_size, struct ddp__mpi **out, char *err) {
    MPI_Comm world;
    ddp_result r;
    int rc;
    char msg[MPI_MAX_ERROR_STRING];
    if ((r = ddp__mpi_start(err)) != DDP_SUCCESS) return r;
    if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &world)) != MPI_SUCCESS)
        return ddp__fail_to(err, DDP_ERR_INIT, "backend mpi: MPI_Comm_dup(MPI_COMM_WORLD) failed: %s",
                            ddp__mpi_error_string(rc, msg));
    MPI_Comm_rank(world, rank);
    MPI_Comm_size(world, world_size);
    return ddp__mpi_wrap(world, out, err);
}

/* Members (me >= 0) get a communicator of the parent's members in the order of the rank list; every
   rank of the parent must call this (MPI_Comm_split is collective), non-members with me = -1. */
static ddp_result ddp__mpi_split(ddp_group *parent, int me, struct ddp__mpi **out) {
    MPI_Comm comm = MPI_COMM_NULL;
    char msg[MPI_MAX_ERROR_STRING];
    int rc = MPI_Comm_split(parent->mpi->comm, me >= 0 ? 0 : MPI_UNDEFINED, me, &comm);
    *out = NULL;
    if (rc != MPI_SUCCESS)
        return ddp__fail(parent, DDP_ERR_SYSTEM, "ddp_new_group: MPI_Comm_split failed: %s", ddp__mpi_error_string(rc, msg));
    if (me < 0) return DDP_SUCCESS;
    if (ddp__mpi_wrap(comm, out, msg) != DDP_SUCCESS) return ddp__fail(parent, DDP_ERR_OUT_OF_MEMORY, "ddp_new_group: %s", msg);
    return DDP_SUCCESS;
}

static void ddp__mpi_free(struct ddp__mpi *m) {
    int finalized = 0;
    if (!m) return;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&m->comm);
    ddp__free(m);
}

static MPI_Datatype ddp__mpi_type(ddp_dtype t) {
    switch (t) {
    case DDP_F32: return MPI_FLOAT;
    case DDP_F64: return MPI_DOUBLE;
    case DDP_F16: return ddp__mpi_f16_type;
    case DDP_BF16: return ddp__mpi_bf16_type;
    case DDP_I8: return MPI_INT8_T;
    case DDP_U8: return MPI_UINT8_T;
    case DDP_I32: return MPI_INT32_T;
    case DDP_I64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
    }
}

static MPI_Op ddp__mpi_op(ddp_dtype t, ddp_op op) {
    if (t == DDP_F16 || t == DDP_BF16) return ddp__mpi_half_ops[op];
    switch (op) {
    case DDP_SUM:
    case DDP_AVG: return MPI_SUM;
    case DDP_PROD: return MPI_PROD;
    case DDP_MIN: return MPI_MIN;
    default: return MPI_MAX;
    }
}

/* Every rank's fingerprint, compared by one all-reduce of (h, -h) with MAX: max == min iff all agree.
   On a difference (seen by every rank alike) an all-gather of the fingerprints names the rank. */
static ddp_result ddp__mpi_check(ddp_group *g, const ddp__coll *c) {
    MPI_Comm comm = g->mpi->comm;
    int64_t pair[2], i;
    uint64_t h = 1469598103934665603ull;
    ddp__coll *all;
    char ours[200], theirs[200], msg[MPI_MAX_ERROR_STRING];
    int rc, bad = -1;
    const unsigned char *p;
    ddp__coll mine;
    memset(&mine, 0, sizeof mine); /* padding bytes are hashed and sent: make them equal */
    mine.seq = c->seq;
    mine.count = c->count;
    mine.kind = c->kind;
    mine.dtype = c->dtype;
    mine.op = c->op;
    mine.root = c->root;
    p = (const unsigned char *)&mine;
    for (i = 0; i < (int64_t)sizeof mine; i++) h = (h ^ p[i]) * 1099511628211ull;
    pair[0] = (int64_t)(h >> 1);
    pair[1] = -pair[0];
    if ((rc = MPI_Allreduce(MPI_IN_PLACE, pair, 2, MPI_INT64_T, MPI_MAX, comm)) != MPI_SUCCESS)
        return ddp__coll_fail(g, DDP_ERR_SYSTEM, "%s: MPI_Allreduce (the call check) failed: %s", ddp__coll_name(c->kind),
                              ddp__mpi_error_string(rc, msg));
    if (pair[0] == -pair[1]) return DDP_SUCCESS;
    all = (ddp__coll *)ddp__calloc((size_t)g->world_size, sizeof *all);
    if (!all) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory naming a mismatch", ddp__coll_name(c->kind));
    rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, comm);
    for (i = 0; rc == MPI_SUCCESS && i < g->world_size && bad < 0; i++)
        if (memcmp(&all[i], &all[0], sizeof mine) != 0) bad = (int)i;
    ddp__coll_describe(g, &all[0], ours, sizeof ours);
    if (bad >= 0) ddp__coll_describe(g, &all[bad], theirs, sizeof theirs);
    ddp__free(all);
    if (bad < 0) return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch between ranks (this rank called %s)", ours);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank 0 called %s while rank %d called %s; every "
                          "rank must call the same collectives in the same order with the same count, dtype, op and root",
                          ours, bad, theirs);
}

/* MPI takes int counts: all_reduce, broadcast and reduce go in pieces of at most 2^30 elements. */
#define DDP__MPI_PIECE ((size_t)1 << 30)

static ddp_result ddp__mpi_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    MPI_Comm comm = g->mpi->comm;
    MPI_Datatype type = ddp__mpi_type(k->dtype);
    size_t es = ddp_dtype_size(k->dtype), done = 0;
    char *buf = (char *)k->buf, msg[MPI_MAX_ERROR_STRING];
    int rc = MPI_SUCCESS, root = k->root;
    ddp_result r;
    if ((r = ddp__mpi_check(g, c)) != DDP_SUCCESS) return r;
    if ((k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) && k->count > (size_t)INT_MAX)
        return ddp__coll_fail(g, DDP_ERR_UNSUPPORTED, "%s: %zu elements per rank is more than MPI's int count allows "
                              "(%d); split the call", ddp__coll_name(k->kind), k->count, INT_MAX);
    switch (k->kind) {
    case DDP__BARRIER: rc = MPI_Barrier(comm); break;
    case DDP__ALL_GATHER:
        if (k->send == buf + (size_t)g->rank * k->count * es)
            rc = MPI_Allgather(MPI_IN_PLACE, 0, type, buf, (int)k->count, type, comm);
        else
            rc = MPI_Allgather(k->send, (int)k->count, type, buf, (int)k->count, type, comm);
        break;
    case DDP__REDUCE_SCATTER:
        if (k->send == buf)
            rc = MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, (int)k->count, type, ddp__mpi_op(k->dtype, k->op), comm);
        else
            rc = MPI_Reduce_scatter_block(k->send, buf, (int)k->count, type, ddp__mpi_op(k->dtype, k->op), comm);
        break;
    default:
        for (done = 0; rc == MPI_SUCCESS && done < k->count; done += DDP__MPI_PIECE) {
            int n = (int)DDP__MIN(k->count - done, DDP__MPI_PIECE);
            char *at = buf + done * es;
            if (k->kind == DDP__ALL_REDUCE)
                rc = MPI_Allreduce(MPI_IN_PLACE, at, n, type, ddp__mpi_op(k->dtype, k->op), comm);
            else if (k->kind == DDP__BROADCAST)
                rc = MPI_Bcast(at, n, type, root, comm);
            else
                rc = MPI_Reduce(g->rank == root ? MPI_IN_PLACE : at, g->rank == root ? at : NULL, n, type,
                                ddp__mpi_op(k->dtype, k->op), root, comm);
        }
    }
    if (rc != MPI_SUCCESS)
        return ddp__coll_fail(g, DDP_ERR_SYSTEM, "%s: the MPI call failed: %s", ddp__coll_name(k->kind),
                              ddp__mpi_error_string(rc, msg));
    if (k->op == DDP_AVG && (k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE_SCATTER ||
                             (k->kind == DDP__REDUCE && g->rank == root)))
        ddp__divide(buf, k->count, k->dtype, g->world_size);
    return DDP_SUCCESS;
}

#else /* !DDP_MPI: the backend is not in this build */

struct ddp__mpi {
    int local_rank, local_world_size;
};

static ddp_result ddp__mpi_world(int *rank, int *world_size, struct ddp__mpi **out, char *err) {
    (void)rank, (void)world_size;
    *out = NULL;
    return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "backend \"mpi\" is not in this build: compile the file that defines "
                        "DDP_IMPLEMENTATION with mpicc and -DDDP_MPI, or use backend \"cpu\"");
}

static ddp_result ddp__mpi_split(ddp_group *parent, int me, struct ddp__mpi **out) {
    (void)me;
    *out = NULL;
    return ddp__fail(parent, DDP_ERR_STATE, "internal error: an mpi group in a build without DDP_MPI");
}

static void ddp__mpi_free(struct ddp__mpi *m) { ddp__free(m); }

static ddp_result ddp__mpi_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    (void)k, (void)c;
    return ddp__coll_fail(g, DDP_ERR_STATE, "internal error: an mpi group in a build without DDP_MPI");
}

#endif /* DDP_MPI */

static void ddp__mpi_close(ddp_group *g, int orderly) {
    (void)orderly;
    ddp__mpi_free(g->mpi);
    g->mpi = NULL;
}

static const ddp__backend ddp__backend_mpi = {
    "mpi", "mpi", ddp__mpi_run, NULL, NULL, NULL, ddp__mpi_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out};

/* g runs on communicator m from now on; its local rank and size are MPI's (-1 when MPI could not tell). */
static void ddp__mpi_attach(ddp_group *g, struct ddp__mpi *m) {
    g->mpi = m;
    g->backend = g->host_backend = &ddp__backend_mpi;
    g->local_rank = m->local_rank;
    g->local_world_size = m->local_world_size;
}
