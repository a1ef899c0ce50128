/* [SECTION] mpi: the mpi backend, collectives through the MPI library (built with -DDDP_MPI)
   (torch.distributed's "mpi" backend, ProcessGroupMPI)

   A program compiled with mpicc -DDDP_MPI and started by mpirun can ask for backend "mpi" (in
   ddp_init_desc.backend or DDP_BACKEND=mpi). Rank and world size then come from MPI_COMM_WORLD, no
   store or sockets are made, and every collective is the MPI call of the same name on a duplicate of
   MPI_COMM_WORLD (subgroups: MPI_Comm_split of their parent's communicator):

       all_reduce -> MPI_Allreduce (MPI_IN_PLACE)     reduce         -> MPI_Reduce
       broadcast  -> MPI_Bcast                        all_gather     -> MPI_Allgather
       barrier    -> MPI_Barrier                      reduce_scatter -> MPI_Reduce_scatter_block
       gather     -> MPI_Gather                       scatter        -> MPI_Scatter
       all_to_all -> MPI_Alltoall                     all_to_all_v   -> MPI_Alltoallv
       all_gather_v -> MPI_Allgatherv                 monitored_barrier: point-to-point, polled (below)

   In-place calls use MPI_IN_PLACE (gather and scatter on the root, all_to_all when send == recv,
   all_gather_v when send is this rank's block of recv).

   f16 and bf16 are reduced by user-defined MPI operations that add in f32 and round to nearest even
   (MPI has no 16-bit floats); AVG is SUM followed by a division, as on the cpu backend. Counts above
   INT_MAX are cut into pieces for all_reduce, broadcast and reduce; for the other calls a count or
   displacement above INT_MAX is DDP_ERR_UNSUPPORTED on every rank.

   What MPI does not do, this file adds: before each collective every rank contributes its call's
   fingerprint (kind, count, dtype, op, root, sequence number) to one small MPI_Allreduce, so a rank
   that calls a different collective gets DDP_ERR_MISMATCH on every rank (naming the rank that differs)
   instead of a hang or corrupt data; it costs one 16-byte all-reduce per call. The _v calls' sizes
   are checked too: all_gather_v's counts are in that hash; all_to_all_v exchanges its split sizes
   (one MPI_Alltoall of a word per rank, one all-reduce) before any data moves. A lost rank or a hang is
   the MPI library's business: mpirun stops the job when a rank dies, and MPI calls have no timeout
   (monitored_barrier, built of polled point-to-point messages, is the one call that has one).

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

struct ddp__mpi_name {
    char text[112]; /* "host NAME, pid N" of one rank, for messages */
};

struct ddp__mpi {
    MPI_Comm comm;
    MPI_Comm monitor;                 /* monitored_barrier's point-to-point messages, apart from everything else */
    struct ddp__mpi_name *names;      /* every rank's host and pid (NULL when they could not be gathered) */
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
    struct ddp__mpi_name mine;
    char host[81] = "?";
    int n = 0, have;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    m->comm = comm;
    m->local_rank = m->local_world_size = -1;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_rank(node, &m->local_rank);
        MPI_Comm_size(node, &m->local_world_size);
        MPI_Comm_free(&node);
    }
    if (MPI_Comm_dup(comm, &m->monitor) != MPI_SUCCESS) {
        MPI_Comm_free(&m->comm);
        ddp__free(m);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "backend mpi: MPI_Comm_dup failed (a communicator for monitored_barrier)");
    }
    MPI_Comm_set_errhandler(m->monitor, MPI_ERRORS_RETURN);
    /* every rank's host and pid, so that monitored_barrier can name a rank that did not come */
    memset(&mine, 0, sizeof mine);
    gethostname(host, sizeof host - 1);
    snprintf(mine.text, sizeof mine.text, "host %.80s, pid %d", host, (int)getpid());
    MPI_Comm_size(comm, &n);
    m->names = (struct ddp__mpi_name *)ddp__calloc((size_t)n, sizeof *m->names);
    have = m->names != NULL; /* all ranks take part in the all-gather or none */
    if (MPI_Allreduce(MPI_IN_PLACE, &have, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS || !have ||
        MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, m->names, (int)sizeof mine, MPI_BYTE, comm) != MPI_SUCCESS) {
        ddp__free(m->names);
        m->names = NULL;
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
    if (!finalized) MPI_Comm_free(&m->monitor), MPI_Comm_free(&m->comm);
    ddp__free(m->names);
    ddp__free(m);
}

/* "host H, pid P" of rank r, for messages ("rank r" when the names could not be gathered). */
static const char *ddp__mpi_who(const ddp_group *g, int r) {
    return g->mpi->names ? g->mpi->names[r].text : "its host and pid unknown";
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

/* all_gather_v's counts differ between ranks (every rank is here, having seen the difference): rank 0's
   counts go to every rank, each finds its first entry that differs, and the smallest (rank, index) is
   named alike on every rank. */
static ddp_result ddp__mpi_counts_differ(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    MPI_Comm comm = g->mpi->comm;
    int n = g->world_size, j, rc;
    uint64_t *ref = (uint64_t *)ddp__calloc((size_t)n, sizeof *ref);
    int64_t key, theirs, nn = n;
    char desc[160], msg[MPI_MAX_ERROR_STRING];
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (!ref) return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ between ranks in %s (out of memory naming them)", desc);
    for (j = 0; g->rank == 0 && j < n; j++) ref[j] = (uint64_t)k->recv_counts[j];
    rc = MPI_Bcast(ref, n, MPI_UINT64_T, 0, comm);
    for (j = 0; j < n && (uint64_t)k->recv_counts[j] == ref[j]; j++) {
    }
    key = j < n ? (int64_t)g->rank * nn + j : INT64_MAX;
    if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, &key, 1, MPI_INT64_T, MPI_MIN, comm);
    theirs = rc == MPI_SUCCESS && key / nn == g->rank ? (int64_t)k->recv_counts[key % nn] : -1;
    if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, &theirs, 1, MPI_INT64_T, MPI_MAX, comm);
    if (rc != MPI_SUCCESS || key == INT64_MAX) {
        ddp__free(ref);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ between ranks in %s (naming them failed: %s); every rank "
                              "must pass the same counts", desc, rc != MPI_SUCCESS ? ddp__mpi_error_string(rc, msg) : "none found");
    }
    j = (int)(key % nn);
    rc = (int)(key / nn);
    {
        unsigned long long want = (unsigned long long)ref[j];
        ddp__free(ref);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank 0 passes counts[%d] = %llu while rank %d passes "
                              "counts[%d] = %lld; every rank must pass the same counts (rank r's count is counts[r])", desc, j,
                              want, rc, j, (long long)theirs);
    }
}

/* Every rank's fingerprint, compared by one all-reduce of (h, -h) with MAX: max == min iff all agree.
   On a difference (seen by every rank alike) an all-gather of the fingerprints names the rank. For
   all_gather_v the hash covers the counts as well (every rank must pass the same), so a difference
   there costs nothing extra when there is none. */
static ddp_result ddp__mpi_check(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    MPI_Comm comm = g->mpi->comm;
    int64_t pair[2], i;
    uint64_t h = DDP__FNV_OFFSET;
    ddp__coll *all;
    char ours[200], theirs[200], msg[MPI_MAX_ERROR_STRING];
    int rc, bad = -1;
    ddp__coll mine;
    memset(&mine, 0, sizeof mine); /* padding bytes are hashed and sent: make them equal */
    mine.seq = c->seq;
    mine.count = c->count;
    mine.kind = c->kind;
    mine.dtype = c->dtype;
    mine.op = c->op;
    mine.root = c->root;
    mine.purpose = c->purpose;
    h = ddp__hash_bytes(h, &mine, sizeof mine);
    for (i = 0; k->kind == DDP__ALL_GATHER_V && i < g->world_size; i++) {
        uint64_t v = (uint64_t)k->recv_counts[i];
        h = ddp__hash_bytes(h, &v, sizeof v);
    }
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
    if (bad < 0 && rc == MPI_SUCCESS && k->kind == DDP__ALL_GATHER_V) return ddp__mpi_counts_differ(g, k, c);
    if (bad < 0) return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch between ranks (this rank called %s)", ours);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank 0 called %s while rank %d called %s; every "
                          "rank must call the same collectives in the same order with the same count, dtype, op and root",
                          ours, bad, theirs);
}

static ddp_result ddp__mpi_failed(ddp_group *g, const ddp__call *k, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    return ddp__coll_fail(g, DDP_ERR_SYSTEM, "%s: the MPI call failed: %s", ddp__coll_name(k->kind), ddp__mpi_error_string(rc, msg));
}

/* MPI takes int counts: all_reduce, broadcast and reduce go in pieces of at most 2^30 elements. */
#define DDP__MPI_PIECE ((size_t)1 << 30)

/* all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier. */
static ddp_result ddp__mpi_classic(ddp_group *g, const ddp__call *k) {
    MPI_Comm comm = g->mpi->comm;
    MPI_Datatype type = ddp__mpi_type(k->dtype);
    size_t es = ddp_dtype_size(k->dtype), done = 0;
    char *buf = (char *)k->buf;
    int rc = MPI_SUCCESS, root = k->root;
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
    if (rc != MPI_SUCCESS) return ddp__mpi_failed(g, k, rc);
    if (k->op == DDP_AVG && (k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE_SCATTER ||
                             (k->kind == DDP__REDUCE && g->rank == root)))
        ddp__divide(buf, k->count, k->dtype, g->world_size);
    return DDP_SUCCESS;
}

/* gather, scatter, all_to_all: blocks of count elements, in place where the API says (MPI_IN_PLACE). */
static ddp_result ddp__mpi_blocks(ddp_group *g, const ddp__call *k) {
    MPI_Comm comm = g->mpi->comm;
    MPI_Datatype type = ddp__mpi_type(k->dtype);
    size_t block = k->count * ddp_dtype_size(k->dtype);
    const char *send = (const char *)k->send;
    char *buf = (char *)k->buf;
    int n = (int)k->count, root = k->root, is_root = g->rank == k->root, rc;
    if (k->kind == DDP__GATHER)
        rc = is_root && send == buf + (size_t)root * block ? MPI_Gather(MPI_IN_PLACE, 0, type, buf, n, type, root, comm)
                                                           : MPI_Gather(send, n, type, buf, n, type, root, comm);
    else if (k->kind == DDP__SCATTER)
        rc = is_root && buf == send + (size_t)root * block ? MPI_Scatter(send, n, type, MPI_IN_PLACE, 0, type, root, comm)
                                                           : MPI_Scatter(send, n, type, buf, n, type, root, comm);
    else
        rc = send == buf ? MPI_Alltoall(MPI_IN_PLACE, 0, type, buf, n, type, comm)
                         : MPI_Alltoall(send, n, type, buf, n, type, comm);
    return rc == MPI_SUCCESS ? DDP_SUCCESS : ddp__mpi_failed(g, k, rc);
}

/* Split sizes as MPI's int counts and displacements (blocks packed in rank order); 0 when a count or
   a displacement passes INT_MAX. */
static int ddp__mpi_int_layout(const size_t *counts, int n, int *cnt, int *displ) {
    size_t at = 0;
    int i;
    for (i = 0; i < n; i++) {
        if (counts[i] > (size_t)INT_MAX || at > (size_t)INT_MAX) return 0;
        cnt[i] = (int)counts[i];
        displ[i] = (int)at;
        at += counts[i];
    }
    return 1;
}

/* all_gather_v: MPI_Allgatherv (the counts were compared with the fingerprint, so they are the same
   on every rank and the int-limit check fails on all alike). */
static ddp_result ddp__mpi_all_gather_v(ddp_group *g, const ddp__call *k) {
    int n = g->world_size, rc, *cnt = (int *)ddp__calloc(2 * (size_t)n, sizeof(int));
    MPI_Datatype type = ddp__mpi_type(k->dtype);
    char *buf = (char *)k->buf;
    if (!cnt) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "all_gather_v: out of memory (%d counts)", 2 * n);
    if (!ddp__mpi_int_layout(k->recv_counts, n, cnt, cnt + n)) {
        ddp__free(cnt);
        return ddp__coll_fail(g, DDP_ERR_UNSUPPORTED, "all_gather_v: the counts (a count, or the sum of the counts before "
                              "one) pass MPI's int limit (%d); split the call", INT_MAX);
    }
    if ((const char *)k->send == buf + (size_t)cnt[n + g->rank] * ddp_dtype_size(k->dtype))
        rc = MPI_Allgatherv(MPI_IN_PLACE, 0, type, buf, cnt, cnt + n, type, g->mpi->comm);
    else
        rc = MPI_Allgatherv(k->send, (int)k->count, type, buf, cnt, cnt + n, type, g->mpi->comm);
    ddp__free(cnt);
    return rc == MPI_SUCCESS ? DDP_SUCCESS : ddp__mpi_failed(g, k, rc);
}

/* all_to_all_v's split sizes, checked before any data moves (the TCP backend checks each frame): one
   MPI_Alltoall of the send_counts tells each rank what every rank will send it; it compares that with
   its recv_counts, and one MPI_Allreduce (MIN) of (first bad pair as sender*n + receiver, first rank
   whose sizes pass MPI's int limit) makes every rank fail alike, naming the same pair. */
static ddp_result ddp__mpi_split_check(ddp_group *g, const ddp__call *k, const ddp__coll *c, int fits) {
    MPI_Comm comm = g->mpi->comm;
    int n = g->world_size, p, rc;
    int64_t agree[2], sizes[2] = {-1, -1}, nn = n;
    uint64_t *out = (uint64_t *)ddp__calloc(2 * (size_t)n, sizeof *out), *in = out + n;
    char desc[160], msg[MPI_MAX_ERROR_STRING];
    if (!out) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "all_to_all_v: out of memory (%d split sizes)", 2 * n);
    for (p = 0; p < n; p++) out[p] = (uint64_t)k->send_counts[p];
    rc = MPI_Alltoall(out, 1, MPI_UINT64_T, in, 1, MPI_UINT64_T, comm);
    for (p = 0; p < n && in[p] == (uint64_t)k->recv_counts[p]; p++) {
    }
    agree[0] = p < n ? (int64_t)p * nn + g->rank : INT64_MAX;
    agree[1] = fits ? INT64_MAX : g->rank;
    if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, agree, 2, MPI_INT64_T, MPI_MIN, comm);
    if (rc == MPI_SUCCESS && agree[0] != INT64_MAX) { /* the pair's owner tells every rank both sizes */
        p = (int)(agree[0] / nn);
        if (agree[0] % nn == g->rank) sizes[0] = (int64_t)in[p], sizes[1] = (int64_t)k->recv_counts[p];
        rc = MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT64_T, MPI_MAX, comm);
    }
    ddp__free(out);
    if (rc != MPI_SUCCESS)
        return ddp__coll_fail(g, DDP_ERR_SYSTEM, "all_to_all_v: exchanging the split sizes failed: %s", ddp__mpi_error_string(rc, msg));
    if (agree[0] != INT64_MAX) {
        int from = (int)(agree[0] / nn), to = (int)(agree[0] % nn);
        ddp__coll_describe(g, c, desc, sizeof desc);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "split sizes differ in %s: rank %d sends %lld elements to rank %d "
                              "(its send_counts[%d]) while rank %d expects %lld from rank %d (its recv_counts[%d]); "
                              "rank i's send_counts[j] must equal rank j's recv_counts[i]", desc, from,
                              (long long)sizes[0], to, to, to, (long long)sizes[1], from, from);
    }
    if (agree[1] != INT64_MAX)
        return ddp__coll_fail(g, DDP_ERR_UNSUPPORTED, "all_to_all_v: rank %lld's split sizes (a count, or the sum of "
                              "the counts before one) pass MPI's int limit (%d); split the call", (long long)agree[1], INT_MAX);
    return DDP_SUCCESS;
}

/* all_to_all_v: the split-size check above, then MPI_Alltoallv. */
static ddp_result ddp__mpi_all_to_all_v(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    int n = g->world_size, rc, *lay = (int *)ddp__calloc(4 * (size_t)n, sizeof(int)), fits;
    MPI_Datatype type = ddp__mpi_type(k->dtype);
    ddp_result r;
    if (!lay) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "all_to_all_v: out of memory (%d counts)", 4 * n);
    fits = ddp__mpi_int_layout(k->send_counts, n, lay, lay + n) && ddp__mpi_int_layout(k->recv_counts, n, lay + 2 * n, lay + 3 * n);
    if ((r = ddp__mpi_split_check(g, k, c, fits)) != DDP_SUCCESS) {
        ddp__free(lay);
        return r;
    }
    rc = MPI_Alltoallv(k->send, lay, lay + n, type, k->buf, lay + 2 * n, lay + 3 * n, type, g->mpi->comm);
    ddp__free(lay);
    return rc == MPI_SUCCESS ? DDP_SUCCESS : ddp__mpi_failed(g, k, rc);
}

/* ---- monitored_barrier ----
   MPI calls have no timeout, so this one is built of point-to-point messages on a communicator of its
   own (m->monitor: no user or collective traffic can match them) and polled. It skips the blocking
   call check: rank 0 must be able to give up on a rank that never comes. Every other rank posts a
   receive for rank 0's answer, then sends rank 0 its sequence number. Rank 0 posts a receive from
   every rank and polls them until all arrived or timeout_seconds (<= 0: the group's timeout) passed;
   it cancels the receives of the ranks missing, and answers every rank that arrived with one fixed-size
   message, the result and its text, so all that arrived return the same: DDP_SUCCESS, DDP_ERR_TIMEOUT
   naming the missing ranks (host and pid), or DDP_ERR_MISMATCH when a rank is at another collective
   number. A rank that gets no answer within the timeout and the group's timeout beyond it fails with
   DDP_ERR_TIMEOUT naming rank 0. */
#define DDP__MPI_MONITOR_TAG 1

typedef struct ddp__mpi_answer {
    int32_t code;
    char msg[DDP__ERR_MAX];
} ddp__mpi_answer;

/* Poll reqs[0..n) until all complete or the deadline passes; done[i] says which did. */
static int ddp__mpi_poll(int n, MPI_Request *reqs, int *done, double deadline) {
    double pause = 5e-5;
    int i, left = n, flag, rc;
    for (i = 0; i < n; i++)
        if ((done[i] = reqs[i] == MPI_REQUEST_NULL) != 0) left--;
    for (;;) {
        for (i = 0; i < n; i++) {
            if (done[i]) continue;
            if ((rc = MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE)) != MPI_SUCCESS) return rc;
            if (flag) done[i] = 1, left--;
        }
        if (!left || ddp__now() >= deadline) return MPI_SUCCESS;
        ddp__sleep(pause);
        pause = DDP__MIN(pause * 2, 1e-3);
    }
}

/* Cancel a receive that did not complete; 1 when it was cancelled, 0 when it completed after all. */
static int ddp__mpi_cancel_recv(MPI_Request *req) {
    MPI_Status st;
    int cancelled = 0;
    MPI_Cancel(req);
    MPI_Wait(req, &st);
    MPI_Test_cancelled(&st, &cancelled);
    return cancelled;
}

/* Rank 0's side: the verdict for the ranks that arrived, into a (arrived[j] set for each). */
static void ddp__mpi_monitor_collect(ddp_group *g, const ddp__coll *c, double wait, int *arrived, ddp__mpi_answer *a) {
    int n = g->world_size, j, unposted, missing = 0, unlisted = 0, late = -1, rc = MPI_SUCCESS;
    uint64_t *seqs = (uint64_t *)ddp__calloc((size_t)n, sizeof *seqs);
    MPI_Request *reqs = (MPI_Request *)ddp__calloc((size_t)n, sizeof *reqs);
    char list[DDP__ERR_MAX / 2] = "", more[48] = "", msg[MPI_MAX_ERROR_STRING];
    a->code = DDP_SUCCESS;
    if (!seqs || !reqs) {
        a->code = DDP_ERR_OUT_OF_MEMORY;
        snprintf(a->msg, sizeof a->msg, "monitored_barrier: rank 0 is out of memory (%d ranks)", n);
        ddp__free(seqs);
        ddp__free(reqs);
        return;
    }
    for (j = 0; j < n; j++) reqs[j] = MPI_REQUEST_NULL;
    for (j = 1; j < n && rc == MPI_SUCCESS; j++)
        rc = MPI_Irecv(&seqs[j], 1, MPI_UINT64_T, j, DDP__MPI_MONITOR_TAG, g->mpi->monitor, &reqs[j]);
    unposted = rc == MPI_SUCCESS ? n : j - 1; /* the receives from here on were never posted */
    if (rc == MPI_SUCCESS) rc = ddp__mpi_poll(n, reqs, arrived, ddp__now() + wait);
    for (j = 1; j < n; j++) {
        if (j >= unposted) arrived[j] = 0;
        if (!arrived[j] && reqs[j] != MPI_REQUEST_NULL) arrived[j] = !ddp__mpi_cancel_recv(&reqs[j]);
        if (arrived[j] && seqs[j] != c->seq && late < 0) late = j;
        if (arrived[j]) continue;
        if (strlen(list) + 120 < sizeof list) {
            size_t len = strlen(list);
            snprintf(list + len, sizeof list - len, "%s%d (%.100s)", missing ? ", " : "", j, ddp__mpi_who(g, j));
        } else {
            unlisted++;
        }
        missing++;
    }
    if (unlisted) snprintf(more, sizeof more, " and %d more", unlisted);
    if (rc != MPI_SUCCESS) {
        a->code = DDP_ERR_SYSTEM;
        snprintf(a->msg, sizeof a->msg, "monitored_barrier: rank 0's receive failed: %s", ddp__mpi_error_string(rc, msg));
    } else if (missing) {
        a->code = DDP_ERR_TIMEOUT;
        snprintf(a->msg, sizeof a->msg, "monitored_barrier: %d of %d ranks did not arrive within %.3g s: rank%s %s%s. Every "
                 "rank must call it; look at what those ranks were doing (DDP_TRACE_DIR)", missing, n, wait,
                 missing > 1 ? "s" : "", list, more);
    } else if (late >= 0) {
        a->code = DDP_ERR_MISMATCH;
        snprintf(a->msg, sizeof a->msg, "monitored_barrier: rank %d called it as its collective #%llu while rank 0 is at "
                 "#%llu; every rank must call the same collectives in the same order", late,
                 (unsigned long long)seqs[late], (unsigned long long)c->seq);
    }
    ddp__free(seqs);
    ddp__free(reqs);
}

static ddp_result ddp__mpi_monitored_root(ddp_group *g, const ddp__coll *c, double wait) {
    int n = g->world_size, j, pending = 0, rc = MPI_SUCCESS;
    int *arrived = (int *)ddp__calloc(2 * (size_t)n, sizeof(int)), *sent = arrived + n;
    MPI_Request *reqs = (MPI_Request *)ddp__calloc((size_t)n, sizeof *reqs);
    ddp__mpi_answer *a = (ddp__mpi_answer *)ddp__calloc(1, sizeof *a);
    ddp_result code;
    char msg[DDP__ERR_MAX], why[MPI_MAX_ERROR_STRING];
    if (!arrived || !reqs || !a) {
        ddp__free(arrived), ddp__free(reqs), ddp__free(a);
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "monitored_barrier: rank 0 is out of memory (%d ranks)", n);
    }
    ddp__mpi_monitor_collect(g, c, wait, arrived, a);
    for (j = 0; j < n; j++) reqs[j] = MPI_REQUEST_NULL;
    for (j = 1; j < n && rc == MPI_SUCCESS; j++)
        if (arrived[j]) rc = MPI_Isend(a, (int)sizeof *a, MPI_BYTE, j, DDP__MPI_MONITOR_TAG, g->mpi->monitor, &reqs[j]);
    ddp__mpi_poll(n, reqs, sent, ddp__now() + g->timeout);
    for (j = 1; j < n; j++)
        if (!sent[j]) MPI_Request_free(&reqs[j]), pending++;
    code = (ddp_result)a->code;
    snprintf(msg, sizeof msg, "%s", a->msg);
    if (rc != MPI_SUCCESS && code == DDP_SUCCESS)
        code = DDP_ERR_SYSTEM, snprintf(msg, sizeof msg, "monitored_barrier: rank 0 could not answer the others: %s",
                                        ddp__mpi_error_string(rc, why));
    ddp__free(arrived);
    ddp__free(reqs);
    if (!pending) ddp__free(a); /* else an answer is still in flight (to a rank that gave up waiting): it keeps its buffer */
    return code == DDP_SUCCESS ? DDP_SUCCESS : ddp__coll_fail(g, code, "%s", msg);
}

static ddp_result ddp__mpi_monitored_member(ddp_group *g, const ddp__coll *c, double wait) {
    ddp__mpi_answer *a = (ddp__mpi_answer *)ddp__calloc(1, sizeof *a);
    MPI_Request req = MPI_REQUEST_NULL;
    uint64_t seq = c->seq;
    int rc, done = 0;
    ddp_result code;
    char msg[DDP__ERR_MAX], why[MPI_MAX_ERROR_STRING];
    if (!a) return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "monitored_barrier: out of memory");
    rc = MPI_Irecv(a, (int)sizeof *a, MPI_BYTE, 0, DDP__MPI_MONITOR_TAG, g->mpi->monitor, &req);
    if (rc == MPI_SUCCESS) rc = MPI_Send(&seq, 1, MPI_UINT64_T, 0, DDP__MPI_MONITOR_TAG, g->mpi->monitor);
    if (rc == MPI_SUCCESS) rc = ddp__mpi_poll(1, &req, &done, ddp__now() + wait + g->timeout);
    if (!done && req != MPI_REQUEST_NULL) done = !ddp__mpi_cancel_recv(&req);
    if (rc != MPI_SUCCESS) {
        if (!done) a = NULL; /* the receive may still be posted: its buffer stays */
        ddp__free(a);
        return ddp__coll_fail(g, DDP_ERR_SYSTEM, "monitored_barrier: reporting to rank 0 failed: %s", ddp__mpi_error_string(rc, why));
    }
    if (!done) {
        ddp__free(a);
        return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "monitored_barrier: rank 0 (%s) did not answer within %.3g s (the "
                              "barrier's %.3g s and the group's timeout of %.3g s): is rank 0 stuck or in another "
                              "collective, or did it give up on this rank before it came?", ddp__mpi_who(g, 0),
                              wait + g->timeout, wait, g->timeout);
    }
    code = (ddp_result)a->code;
    a->msg[sizeof a->msg - 1] = '\0';
    snprintf(msg, sizeof msg, "%s", a->msg);
    ddp__free(a);
    return code == DDP_SUCCESS ? DDP_SUCCESS : ddp__coll_fail(g, code, "%s", msg);
}

/* ---- the backend's entry ---- */

/* ddp_send / ddp_recv with MPI's own point-to-point on the group's communicator (the collectives run in
   MPI's separate collective context, so user tags never meet them). The receiver probes first, polling
   so that it gives up after the group's timeout, and compares the message's size with its count. */
static ddp_result ddp__mpi_p2p(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    MPI_Comm comm = g->mpi->comm;
    char desc[200], msg[MPI_MAX_ERROR_STRING];
    double deadline = ddp__now() + g->timeout;
    int rc, flag = 0, got = 0;
    MPI_Status st;
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (bytes > (size_t)INT_MAX || k->tag > 32767)
        return ddp__coll_fail(g, DDP_ERR_UNSUPPORTED, "%s: on the mpi backend a message holds at most %d bytes and a tag "
                              "is at most 32767 (what every MPI allows)", desc, INT_MAX);
    if (k->kind == DDP__SEND) {
        rc = MPI_Send(k->send, (int)bytes, MPI_BYTE, k->root, k->tag, comm);
    } else {
        while ((rc = MPI_Iprobe(k->root, k->tag, comm, &flag, &st)) == MPI_SUCCESS && !flag) {
            if (ddp__now() > deadline)
                return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "%s: timed out after %.0f s waiting for rank %d's message with "
                                      "tag %d (DDP_TIMEOUT sets the limit)", desc, g->timeout, k->root, k->tag);
            ddp__sleep(50e-6);
        }
        if (rc == MPI_SUCCESS && (rc = MPI_Get_count(&st, MPI_BYTE, &got)) == MPI_SUCCESS && (size_t)got != bytes)
            return ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d sent %d bytes with tag %d where this rank expects %zu "
                                  "(%zu elements of %s); a send and its recv must agree on count and dtype", desc, k->root,
                                  got, k->tag, bytes, k->count, ddp_dtype_name(k->dtype));
        if (rc == MPI_SUCCESS) rc = MPI_Recv(k->buf, (int)bytes, MPI_BYTE, k->root, k->tag, comm, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "%s: the MPI call failed: %s", desc, ddp__mpi_error_string(rc, msg));
    return DDP_SUCCESS;
}

/* ddp_isend / ddp_irecv: MPI_Isend / MPI_Irecv of bytes on the group's communicator; the handle's wait polls
   MPI_Test (so it gives up after the group's timeout) and checks a received message's size as ddp_recv does. */
typedef struct ddp__mpi_request {
    MPI_Request req;
    int done, got; /* finished (MPI_Test freed the request); bytes received */
    int rc;        /* MPI's result */
} ddp__mpi_request;

static void ddp__mpi_p2p_poll(ddp__mpi_request *q) {
    MPI_Status st;
    int flag = 0;
    if (q->done) return;
    q->rc = MPI_Test(&q->req, &flag, &st);
    if (q->rc != MPI_SUCCESS || !flag) {
        q->done = q->rc != MPI_SUCCESS;
        return;
    }
    q->done = 1;
    MPI_Get_count(&st, MPI_BYTE, &q->got); /* (a truncated message is MPI_Test's own error: q->rc) */
}

static ddp_result ddp__mpi_p2p_wait(ddp_work *w) {
    ddp_group *g = w->g;
    ddp__mpi_request *q = (ddp__mpi_request *)w->handle;
    size_t bytes = w->call.count * ddp_dtype_size(w->call.dtype);
    double deadline = ddp__now() + g->timeout;
    char desc[200], msg[MPI_MAX_ERROR_STRING];
    ddp_result r = DDP_SUCCESS;
    ddp__coll_describe(g, &w->coll, desc, sizeof desc);
    while (ddp__mpi_p2p_poll(q), !q->done && ddp__now() < deadline) ddp__sleep(50e-6);
    if (!q->done)
        r = ddp__coll_fail(g, DDP_ERR_TIMEOUT, "%s: timed out after %.0f s waiting for rank %d (DDP_TIMEOUT sets the limit)",
                           desc, g->timeout, w->call.root);
    else if (q->rc == MPI_ERR_TRUNCATE || (q->rc == MPI_SUCCESS && w->call.kind == DDP__RECV && (size_t)q->got != bytes))
        r = ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d sent %s bytes with tag %d where this rank expects %zu (%zu "
                           "elements of %s); a send and its recv must agree on count and dtype", desc, w->call.root,
                           q->rc == MPI_ERR_TRUNCATE ? "more" : "fewer", w->call.tag, bytes, w->call.count,
                           ddp_dtype_name(w->call.dtype));
    else if (q->rc != MPI_SUCCESS)
        r = ddp__coll_fail(g, DDP_ERR_SYSTEM, "%s: the MPI call failed: %s", desc, ddp__mpi_error_string(q->rc, msg));
    if (!q->done) { /* nobody may write into the buffer after this returns */
        MPI_Cancel(&q->req);
        MPI_Request_free(&q->req);
    }
    ddp__free(q);
    ddp__free(w);
    return r;
}

static int ddp__mpi_p2p_test(ddp_work *w) {
    ddp__mpi_request *q = (ddp__mpi_request *)w->handle;
    ddp__mpi_p2p_poll(q);
    return q->done;
}

static void ddp__mpi_p2p_release(ddp_work *w);
static const ddp__backend ddp__mpi_p2p_owner = {"mpi", "mpi", NULL, NULL, ddp__mpi_p2p_wait, ddp__mpi_p2p_test, NULL,
                                                NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, ddp__mpi_p2p_release};

static ddp_result ddp__mpi_p2p_start(ddp_group *g, ddp_work *w) {
    const ddp__call *k = &w->call;
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    ddp__mpi_request *q;
    char msg[MPI_MAX_ERROR_STRING];
    int rc;
    if (bytes > (size_t)INT_MAX || k->tag > 32767)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: on the mpi backend a message holds at most %d bytes and a tag is at "
                         "most 32767 (what every MPI allows)", k->kind == DDP__SEND ? "isend" : "irecv", INT_MAX);
    if (!(q = (ddp__mpi_request *)ddp__calloc(1, sizeof *q)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    if (k->kind == DDP__SEND) rc = MPI_Isend(k->send, (int)bytes, MPI_BYTE, k->root, k->tag, g->mpi->comm, &q->req);
    else rc = MPI_Irecv(k->buf, (int)bytes, MPI_BYTE, k->root, k->tag, g->mpi->comm, &q->req);
    if (rc != MPI_SUCCESS) {
        ddp__free(q);
        return ddp__fail(g, DDP_ERR_SYSTEM, "%s: the MPI call failed: %s", k->kind == DDP__SEND ? "isend" : "irecv",
                         ddp__mpi_error_string(rc, msg));
    }
    w->owner = &ddp__mpi_p2p_owner;
    w->handle = q;
    return DDP_SUCCESS;
}

/* The group ends with w never waited on: cancel its request. */
static void ddp__mpi_p2p_release(ddp_work *w) {
    ddp__mpi_request *q = (ddp__mpi_request *)w->handle;
    if (!q->done) {
        MPI_Cancel(&q->req);
        MPI_Request_free(&q->req);
    }
    ddp__free(q);
}

static ddp_result ddp__mpi_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp_result r;
    if (k->kind == DDP__SEND || k->kind == DDP__RECV) return ddp__mpi_p2p(g, k, c);
    if (k->kind == DDP__MONITORED_BARRIER) {
        double wait = k->seconds > 0 ? k->seconds : g->timeout;
        return g->rank == 0 ? ddp__mpi_monitored_root(g, c, wait) : ddp__mpi_monitored_member(g, c, wait);
    }
    if ((r = ddp__mpi_check(g, k, c)) != DDP_SUCCESS) return r;
    switch (k->kind) {
    case DDP__ALL_GATHER:
    case DDP__REDUCE_SCATTER:
    case DDP__GATHER:
    case DDP__SCATTER:
    case DDP__ALL_TO_ALL: /* the count is in the fingerprint: every rank fails alike */
        if (k->count > (size_t)INT_MAX)
            return ddp__coll_fail(g, DDP_ERR_UNSUPPORTED, "%s: %zu elements per rank is more than MPI's int count allows "
                                  "(%d); split the call", ddp__coll_name(k->kind), k->count, INT_MAX);
        if (k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) return ddp__mpi_classic(g, k);
        return ddp__mpi_blocks(g, k);
    case DDP__ALL_TO_ALL_V: return ddp__mpi_all_to_all_v(g, k, c);
    case DDP__ALL_GATHER_V: return ddp__mpi_all_gather_v(g, k);
    default: return ddp__mpi_classic(g, k);
    }
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

static ddp_result ddp__mpi_p2p_start(ddp_group *g, ddp_work *w) {
    (void)w;
    return ddp__fail(g, DDP_ERR_STATE, "internal error: an mpi group in a build without DDP_MPI");
}

#endif /* DDP_MPI */

static void ddp__mpi_close(ddp_group *g, int orderly) {
    (void)orderly;
    ddp__mpi_free(g->mpi);
    g->mpi = NULL;
}

static const ddp__backend ddp__backend_mpi = {
    "mpi", "mpi", ddp__mpi_run, NULL, NULL, NULL, ddp__mpi_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out,
    ddp__host_accumulate,
    NULL, NULL, ddp__mpi_p2p_start, NULL};

/* g runs on communicator m from now on; its local rank and size are MPI's (-1 when MPI could not tell). */
static void ddp__mpi_attach(ddp_group *g, struct ddp__mpi *m) {
    g->mpi = m;
    g->backend = g->host_backend = &ddp__backend_mpi;
    g->local_rank = m->local_rank;
    g->local_world_size = m->local_world_size;
}
