/* [SECTION] api: version, results, dtypes, ops, logging, groups, collectives, store, launch */
/* The implementation uses POSIX and Linux calls (sockets, poll, fork, futex, mmap). ddp.h may be included
   before or after system headers: when it comes first, _GNU_SOURCE here makes them declare those calls;
   when it comes after (too late for feature macros), internal.h declares what they left out. */
#if defined(DDP_IMPLEMENTATION) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include <stddef.h>
#include <stdint.h>

#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0
/* One number for compile-time checks: ddp_cuda.cu refuses to build against a header with another. */
#define DDP_VERSION_NUMBER (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

#ifndef DDP_API
#if defined(DDP_STATIC) && (defined(__GNUC__) || defined(__clang__))
#define DDP_API static __attribute__((unused))
#elif defined(DDP_STATIC)
#define DDP_API static
#else
#define DDP_API extern
#endif
#endif

/* Every fallible call returns a ddp_result. DDP_SUCCESS is 0; errors are negative. The detailed,
   human-readable message (which rank, which operation, which sizes, what to do) is in
   ddp_last_error(NULL): this thread's last failure, whatever the call (group, store, reducer, sampler,
   checkpoint, ...). A failure on a group is also kept in ddp_last_error(group). */
typedef enum ddp_result {
    DDP_SUCCESS = 0,
    DDP_ERR_INVALID_ARGUMENT = -1, /* a bad argument or descriptor field; the message names it */
    DDP_ERR_UNSUPPORTED = -2,      /* a valid request that this build, backend or dtype cannot do */
    DDP_ERR_OUT_OF_MEMORY = -3,
    DDP_ERR_SYSTEM = -4,           /* an operating-system call failed; the message has errno's text */
    DDP_ERR_TIMEOUT = -5,          /* a peer (or the store) did not answer within the group's timeout */
    DDP_ERR_PEER_LOST = -6,        /* a peer process exited or its connection dropped; the message names it */
    DDP_ERR_MISMATCH = -7,         /* ranks disagree: different collective, count, dtype, root, model, ... */
    DDP_ERR_STATE = -8,            /* a call in the wrong state: broken group, reducer misuse, ... */
    DDP_ERR_FORMAT = -9,           /* malformed file or message */
    DDP_ERR_IO = -10,              /* a file could not be read, written or synced */
    DDP_ERR_INIT = -11,            /* rendezvous failed: bad environment, unreachable master, port in use, ... */
    DDP_ERR_WORKER_FAILED = -12,   /* ddp_spawn / ddprun: a worker process failed; the message says how */
    DDP_ERR_UNEVEN_INPUTS = -13,   /* reducer with join_fail_early: a rank ran out of data (the message names
                                      it and the step); the group stays usable */
    DDP_ERR_VIEW_CHANGED = -14     /* fault-tolerant mode (ddp_init_desc.fault_tolerant): a member was lost and
                                      the survivors formed a new view; redo the step (ddp_ft_begin) */
} ddp_result;

/* Element types. DDP_DTYPE_DEFAULT (0) exists so that zero-initialised descriptors mean "the natural
   type" (for example, the reducer's comm_dtype); collectives reject it. */
typedef enum ddp_dtype {
    DDP_DTYPE_DEFAULT = 0,
    DDP_F32,
    DDP_F64,
    DDP_F16,  /* IEEE binary16; reduced in f32, rounded to nearest even */
    DDP_BF16, /* bfloat16; reduced in f32, rounded to nearest even */
    DDP_I8,
    DDP_U8,
    DDP_I32,
    DDP_I64,
    DDP_DTYPE_COUNT
} ddp_dtype;

/* Reduction operators. On integer types SUM and PROD wrap around (two's complement), and AVG is the
   wrapped SUM divided by the number of ranks, truncated toward zero (as NCCL's ncclAvg). */
typedef enum ddp_op { DDP_SUM = 0, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX, DDP_OP_COUNT } ddp_op;

typedef enum ddp_log_level {
    DDP_LOG_DEFAULT = 0, /* in descriptors: DDP_LOG_LEVEL from the environment, else DDP_LOG_WARN */
    DDP_LOG_NONE,
    DDP_LOG_ERROR,
    DDP_LOG_WARN,
    DDP_LOG_INFO,
    DDP_LOG_DEBUG
} ddp_log_level;

/* A log callback receives each message that passes the level, without the "[ddp rank N]" prefix. */
typedef void (*ddp_log_fn)(ddp_log_level level, int rank, const char *message, void *user);

typedef struct ddp_group ddp_group; /* a set of ranks that run collectives together */
typedef struct ddp_work ddp_work;   /* a handle on an asynchronous collective */
typedef struct ddp_store ddp_store; /* the rendezvous key-value store (PyTorch's TCPStore) */

/* ddp_init's descriptor. Zero-initialised (or a NULL pointer) means: everything from the launcher's
   environment. Fields left 0 or NULL keep their default.

   Where rank and world size come from, first match wins:
     1. the descriptor, when world_size > 0
     2. torchrun / ddprun:  RANK, WORLD_SIZE (LOCAL_RANK, LOCAL_WORLD_SIZE)
     3. Open MPI:           OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE (..._LOCAL_RANK, ..._LOCAL_SIZE)
     4. MPICH / Hydra:      PMI_RANK, PMI_SIZE (MPI_LOCALRANKID)
     5. SLURM (srun):       SLURM_PROCID, SLURM_NTASKS (SLURM_LOCALID)
     6. nothing set:        a single process, rank 0 of world size 1
   The local rank and size (in parentheses) must satisfy 0 <= local rank < local size <= world size;
   torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE come both or neither. Otherwise DDP_ERR_INIT names them.
   The master (rank 0's store) is init_method "tcp://host:port", else the descriptor's
   master_addr/master_port, else MASTER_ADDR/MASTER_PORT, else (under mpirun/srun on one host)
   127.0.0.1 with a port derived from the job id. Under SLURM, MASTER_ADDR defaults to the first host of
   SLURM_NODELIST. init_method "file:///path" puts the store in a file on a shared filesystem instead. */
typedef struct ddp_init_desc {
    const char *backend;     /* NULL: DDP_BACKEND, else "auto" = cpu; "cpu"; "mpi" (a build with -DDDP_MPI, under mpirun);
                                "nccl" (a build with -DDDP_CUDA linked with ddp_cuda.o, -lcudart, -lnccl) */
    const char *init_method; /* NULL or "env://"; "tcp://host:port"; "file:///path/to/store" */
    int world_size;          /* > 0: use rank and world_size from here instead of the environment */
    int rank;
    const char *master_addr; /* NULL: MASTER_ADDR */
    int master_port;         /* 0: MASTER_PORT */
    double timeout_seconds;  /* 0: DDP_TIMEOUT from the environment, else 300 */
    ddp_log_level log_level; /* DDP_LOG_DEFAULT: DDP_LOG_LEVEL from the environment, else warn */
    ddp_log_fn log_fn;       /* NULL: stderr with a "[ddp rank N]" prefix */
    void *log_user;
    const char *timeline;    /* NULL: DDP_TIMELINE; a path: each rank writes a Chrome trace there (ddp_timeline_begin) */
    /* Fault-tolerant mode (ft.h: ddp_ft_begin / ddp_ft_commit): a lost rank does not break the group; the
       survivors agree on a new view and redo the step. 0: DDP_FT from the environment (1 = on), else off.
       The cpu backend only (shm, tcp, hier); mpi and nccl answer DDP_ERR_UNSUPPORTED. */
    int fault_tolerant;
    int min_world_size;      /* FT: fewer live members than this fail with DDP_ERR_PEER_LOST (0: DDP_FT_MIN_WORLD_SIZE, else 1) */
    double suspect_seconds;  /* FT: a member silent this long (in a collective, in a view change) is suspected (0: DDP_FT_SUSPECT_SECONDS, else 10) */
} ddp_init_desc;

/* ddp_init: join the process group. Collective: every rank of the world calls it.
   Parameters: desc (NULL = all defaults), out (receives the group).
   Return: DDP_SUCCESS, or DDP_ERR_INIT / DDP_ERR_TIMEOUT / DDP_ERR_MISMATCH /
           DDP_ERR_INVALID_ARGUMENT with ddp_last_error(NULL) saying why.
   Thread safety: call from one thread. */
DDP_API ddp_result ddp_init(const ddp_init_desc *desc, ddp_group **out);

/* The flight recorder (torch's NCCL flight recorder): every group keeps its last DDP_TRACE_SIZE (64)
   collectives, each with its number (#N, as error messages count them), collective, count, dtype, op,
   root, state (queued / in progress / done / failed) and times. When the group breaks (a timeout, a
   lost peer, an abort from another rank, a mismatch) every rank writes them, once: into
   DDP_TRACE_DIR/ddp_trace_rank<R>_pid<P>.txt when set, else its last 10 into its log at error level.
   With DDP_TRACE_DIR (or DDP_TRACE_SIGNAL=1) SIGUSR1 writes them too, at any moment (a rank stuck in
   its own code included; without DDP_TRACE_DIR to stderr), and so does SIGTERM into DDP_TRACE_DIR;
   both then call the handler installed before. ddprun gives its workers a DDP_TRACE_DIR and, when a
   job fails, prints one line per rank: the last collective it finished and the one it was in, with the
   ranks behind flagged. The cost: a coarse clock read and a few stores per state change, ~15 ns on a
   0.22 us shared-memory all_reduce (bench/bench_trace.c). */
/* The timeline (Horovod's HOROVOD_TIMELINE, torch's profiler): with DDP_TIMELINE=PATH (or desc.timeline)
   each rank writes Chrome trace events (ui.perfetto.dev, chrome://tracing) into PATH with "%r" replaced by
   its rank (without "%r": trace.json -> trace.rank0.json): every collective (named after its call, args
   seq, count, dtype, bytes), the reducer's passes (reducer.backward), its buckets (reducer.bucket) and
   the wait in end_backward with the straggler named (reducer.wait), checkpoint saves (checkpoint.save,
   checkpoint.save_async) and the program's own ranges. pid = world rank, ts in us on rank 0's clock.
   The file is valid JSON after every flush (at ddp_destroy of the world group, when a group breaks, on
   SIGUSR1, and every 192 KiB). ddprun --timeline FILE merges a job's files into FILE.
   ddp_timeline_begin / ddp_timeline_end: a range of the program's own on the calling thread's lane (they
   nest, as NVTX's push / pop); no-ops returning DDP_SUCCESS when the timeline is off. end without a begin
   on the same thread: DDP_ERR_STATE.
   ddp_timeline_merge: the events of n timeline files (a rank's file; one cut short by a killed process
   loses its unfinished line only; a missing one is left out with a warning) into one file at out,
   written whole or not at all. Not collective. */
DDP_API ddp_result ddp_timeline_begin(ddp_group *g, const char *name);
DDP_API ddp_result ddp_timeline_end(ddp_group *g);
DDP_API ddp_result ddp_timeline_merge(const char *out, const char *const *inputs, int n);

/* ddp_destroy: finish outstanding async work, say goodbye to the peers, free the group.
   Collective on the group (all ranks call it). Subgroups made from g that are still alive are
   destroyed first (as torch's destroy_process_group()), in the order they were made; their pointers
   are dead afterwards. Work handles of g not yet waited on are released (ddp_wait on one then fails).
   Returns the first error met while finishing, but always frees. NULL is a no-op.
   Any call on a destroyed group (ddp_destroy again included) returns DDP_ERR_STATE saying so and
   touches no freed memory; the getters below answer as for NULL, and ddp_last_error(g) gives this
   thread's last error. */
DDP_API ddp_result ddp_destroy(ddp_group *g);

/* ddp_new_group: a subgroup of g with the listed ranks of g (like torch.distributed.new_group).
   Collective on g: every rank of g calls it with the same list. A rank not in the list gets
   *out = NULL and DDP_SUCCESS. The subgroup's ranks are numbered in the order of `ranks`. */
DDP_API ddp_result ddp_new_group(ddp_group *g, const int *ranks, int n, ddp_group **out);

DDP_API int ddp_rank(const ddp_group *g);             /* this process's rank in g */
DDP_API int ddp_world_size(const ddp_group *g);       /* number of ranks in g */
DDP_API int ddp_local_rank(const ddp_group *g);       /* rank among g's ranks on this host */
DDP_API int ddp_local_world_size(const ddp_group *g); /* number of g's ranks on this host */
DDP_API const char *ddp_backend_name(const ddp_group *g);
DDP_API double ddp_timeout(const ddp_group *g);       /* seconds a blocked operation waits */

/* ddp_last_error(NULL): the message of this thread's last failed call, whatever it was (every failure
   lands there, as stb_image's stbi_failure_reason). ddp_last_error(g): the last failure of a call on g,
   whichever thread made it. Never NULL. */
DDP_API const char *ddp_last_error(const ddp_group *g);
DDP_API const char *ddp_result_string(ddp_result r); /* "DDP_ERR_TIMEOUT: ..." */
DDP_API const char *ddp_dtype_name(ddp_dtype t);     /* "f32", ...; "?" when out of range */
DDP_API size_t ddp_dtype_size(ddp_dtype t);          /* bytes per element; 0 when out of range */
DDP_API const char *ddp_op_name(ddp_op op);          /* "sum", ...; "?" when out of range */
DDP_API int ddp_version(void);                       /* DDP_VERSION_NUMBER of the implementation */

/* f16 and bf16 conversions, rounding to nearest even (NaN stays NaN, overflow gives infinity). */
DDP_API float ddp_f16_to_f32(uint16_t h);
DDP_API uint16_t ddp_f32_to_f16(float f);
DDP_API float ddp_bf16_to_f32(uint16_t b);
DDP_API uint16_t ddp_f32_to_bf16(float f);

/* ---- Collectives (torch.distributed.*) -------------------------------------------------------
   Every rank of the group calls the same collective, in the same order, with the same count, dtype,
   op and root. A difference is DDP_ERR_MISMATCH on every rank, naming both sides. A peer that dies is
   DDP_ERR_PEER_LOST (naming it) on every rank; a peer that stops answering is DDP_ERR_TIMEOUT.
   After such an error the group is broken: later calls return DDP_ERR_STATE; destroy it.
   count is in elements; count 0 is allowed and still synchronises. A count whose largest buffer (count
   x element size, x world size for all_gather / reduce_scatter) would reach 2^47 bytes (128 TiB) is
   DDP_ERR_INVALID_ARGUMENT, naming the count and the limit. In-place: pass the same pointer
   (all_gather / reduce_scatter: send may alias this rank's slice of recv, or recv itself).
   Buffers are host memory; in a build with -DDDP_CUDA also device memory: NCCL's on the nccl backend,
   staged through pinned host memory on the cpu and mpi backends (ddp_set_stream says how).
   Thread safety: a group's collectives must be issued from one thread at a time, in one order. */

/* buf <- op over all ranks' buf */
DDP_API ddp_result ddp_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op);
/* buf <- root's buf */
DDP_API ddp_result ddp_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root);
/* root's buf <- op over all ranks' buf; other ranks' buf is left unchanged */
DDP_API ddp_result ddp_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root);
/* recv[r*count_per_rank ...] <- rank r's send, for every r */
DDP_API ddp_result ddp_all_gather(ddp_group *g, const void *send, void *recv, size_t count_per_rank,
                                  ddp_dtype t);
/* recv <- op over all ranks of send[rank*count_per_rank ...] */
DDP_API ddp_result ddp_reduce_scatter(ddp_group *g, const void *send, void *recv, size_t count_per_rank,
                                      ddp_dtype t, ddp_op op);
/* returns when every rank has entered the barrier */
DDP_API ddp_result ddp_barrier(ddp_group *g);

/* The rest of torch.distributed's collectives. Rooted calls read (scatter) or write (gather) the big
   buffer on the root alone; other ranks may pass NULL there. Buffers of one call must not overlap,
   except where "in place" says. */
/* gather: root's recv[r*count ...] <- rank r's send (count elements), for every r. In place on the root:
   send = recv + root*count. */
DDP_API ddp_result ddp_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root);
/* scatter: recv (count elements) <- root's send[rank*count ...]. In place on the root: recv = send +
   root*count.
   Small gathers and scatters over shared memory (up to 2 KiB of data per writer) run ahead, as MPI's
   eager sends: a scatter's root and a gather's other ranks return as soon as their data is copied
   (their buffers are theirs again), and a scatter's other ranks wait for the root alone, up to 30 calls
   ahead of the slowest rank. A mismatch found late (another root, count or collective on some rank) is
   still an error on every rank, but a rank that ran ahead gets it from a later call on the group (at
   the latest its next call of another kind, or ddp_destroy). No rank gets wrong data meanwhile: each
   block of a receive buffer is either left as it was or exactly what the rank's own call delivers. */
DDP_API ddp_result ddp_scatter(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root);
/* all_to_all (torch's all_to_all_single with equal splits): recv[r*count_per_rank ...] <- rank r's
   send[rank*count_per_rank ...], for every r. send may equal recv (in place). */
DDP_API ddp_result ddp_all_to_all(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t);
/* all_to_all_v (all_to_all_single with split sizes): send holds world blocks packed in rank order, block
   j of send_counts[j] elements going to rank j; recv receives block r (recv_counts[r] elements) from
   rank r, packed in rank order. Rank i's send_counts[j] must equal rank j's recv_counts[i]: a
   difference is DDP_ERR_MISMATCH on every rank, naming both ranks and both sizes. Zeros are fine. */
DDP_API ddp_result ddp_all_to_all_v(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                    const size_t *recv_counts, ddp_dtype t);
/* all_gather_v (all_gather of tensors of uneven size): recv <- every rank's send, rank r's counts[r]
   elements packed in rank order; count is this rank's (= counts[rank]). Every rank passes the same
   counts (a difference is DDP_ERR_MISMATCH on every rank). In place: send = recv + the sum of
   counts[0 .. rank-1]. */
DDP_API ddp_result ddp_all_gather_v(ddp_group *g, const void *send, size_t count, void *recv, const size_t *counts,
                                    ddp_dtype t);
/* broadcast_bytes (broadcast_object_list for a serialized object): the root passes *data and *size
   (bytes); every other rank gets a new buffer in *data holding a copy, and its size in *size (set on
   success only), and releases it with ddp_free_bytes(). A size of 0 gives a valid buffer too. */
DDP_API ddp_result ddp_broadcast_bytes(ddp_group *g, void **data, size_t *size, int root);
DDP_API void ddp_free_bytes(void *data); /* NULL is a no-op */
/* monitored_barrier (torch's, with wait_all_ranks=True): every rank reports to rank 0, which waits up
   to timeout_seconds (<= 0: the group's timeout) and then fails with DDP_ERR_TIMEOUT naming every rank
   that did not arrive (host and pid); the group is then broken on every rank that did arrive, with the
   same message. When all arrive it returns DDP_SUCCESS on every rank, as ddp_barrier. */
DDP_API ddp_result ddp_monitored_barrier(ddp_group *g, double timeout_seconds);

/* ---- Point-to-point (torch.distributed.send / recv) -------------------------------------------
   ddp_send: count elements of buf to rank dst with tag (>= 0). ddp_recv: the next message from rank src
   with that tag, into buf. Messages match by (source, tag) in the order sent, as MPI's do; a recv whose
   count or dtype differs from its send's is DDP_ERR_MISMATCH naming both. Not collectives: the other
   ranks take no part, and the calls run after the group's queued async work. A send returns once its
   bytes are with the transport (it does not wait for the recv to be posted; a message larger than the
   kernel's socket buffers waits until the receiver's next call into the library reads it); a message
   that arrives before its recv is kept by the receiver until the recv. So a rank may send and then
   receive while its peer does the same, in either order. A send and its recv must come in the same
   order relative to the collectives on both ranks: a recv that meets the peer's next collective instead
   of the message is DDP_ERR_MISMATCH. dst / src must be another rank of g. On the nccl backend: host
   memory only so far; on the cpu and mpi backends device memory is staged (ddp_set_stream). */
DDP_API ddp_result ddp_send(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag);
DDP_API ddp_result ddp_recv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag);
/* isend / irecv: return at once with a handle for ddp_wait / ddp_test. An isend is queued with the group's
   async collectives (in issue order); an irecv is posted at once, and any later call that reads the
   connections (a queued call, a collective over TCP, a send, ddp_wait, ddp_test) may finish it, so every
   rank may post its irecv before its isend. The buffer must stay valid and untouched until ddp_wait
   returns. On the mpi backend they are MPI_Isend / MPI_Irecv. Host memory only (device memory is
   DDP_ERR_UNSUPPORTED: use ddp_send / ddp_recv, which stage it). */
DDP_API ddp_result ddp_isend(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag, ddp_work **w);
DDP_API ddp_result ddp_irecv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag, ddp_work **w);

/* Asynchronous variants: queue the collective and return at once. A progress thread runs queued
   work in issue order. The buffers must stay valid and untouched until ddp_wait returns.
   A synchronous collective issued after async ones runs after them. */
DDP_API ddp_result ddp_all_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                        ddp_work **w);
DDP_API ddp_result ddp_broadcast_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root,
                                       ddp_work **w);
DDP_API ddp_result ddp_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root,
                                    ddp_work **w);
DDP_API ddp_result ddp_all_gather_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank,
                                        ddp_dtype t, ddp_work **w);
DDP_API ddp_result ddp_reduce_scatter_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank,
                                            ddp_dtype t, ddp_op op, ddp_work **w);
DDP_API ddp_result ddp_barrier_async(ddp_group *g, ddp_work **w);
DDP_API ddp_result ddp_gather_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                    ddp_work **w);
DDP_API ddp_result ddp_scatter_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                     ddp_work **w);
DDP_API ddp_result ddp_all_to_all_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank,
                                        ddp_dtype t, ddp_work **w);
/* the count arrays, like the buffers, must stay valid until ddp_wait returns */
DDP_API ddp_result ddp_all_to_all_v_async(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                          const size_t *recv_counts, ddp_dtype t, ddp_work **w);
DDP_API ddp_result ddp_all_gather_v_async(ddp_group *g, const void *send, size_t count, void *recv,
                                          const size_t *counts, ddp_dtype t, ddp_work **w);
/* data and size must stay valid until ddp_wait returns; they are written then */
DDP_API ddp_result ddp_broadcast_bytes_async(ddp_group *g, void **data, size_t *size, int root, ddp_work **w);
DDP_API ddp_result ddp_monitored_barrier_async(ddp_group *g, double timeout_seconds, ddp_work **w);
/* Block until w is complete; return its result and release w (its message is then in
   ddp_last_error(group)). Call exactly once per handle: a handle already waited on, or released by
   ddp_destroy of its group, is DDP_ERR_INVALID_ARGUMENT without being touched (recognised as long as
   the allocator has not given its address to a newer handle). */
DDP_API ddp_result ddp_wait(ddp_work *w);
/* Nonzero when w is complete (ddp_wait will not block); also nonzero for a spent handle, which
   ddp_wait fails at once (the reason is in ddp_last_error(NULL)). Does not release w. */
DDP_API int ddp_test(ddp_work *w);

/* ddp_set_stream: the CUDA stream (a cudaStream_t) that g's work on device memory is ordered on (torch
   uses the current stream). NULL = the legacy default stream, the initial setting. Needs a build with
   -DDDP_CUDA (the implementation file) linked with ddp_cuda.o.
   On the nccl backend, buffers in device memory go to NCCL: a collective is queued on the stream after
   the caller's earlier work there, and the synchronous call returns once it has completed (ddp_wait,
   for the async variants); buffers in host memory run on the cpu path.
   On the cpu and mpi backends (torch's Gloo with CUDA tensors), every collective and ddp_send /
   ddp_recv also takes device buffers (cudaMalloc'd or managed; either buffer of a call, on any rank):
   they are staged through pinned host memory (cudaMallocHost, kept by the group and grown as needed,
   freed with it): copied to it on the stream after the caller's earlier work there (then the call
   waits for the stream), the host collective runs, and the result is copied back to device memory
   queued on the stream. The call returns once the host collective is done: the result is ready for
   work queued on the stream after the call (and for the host after a cudaStreamSynchronize of it).
   The async variants stage inside the call and return completed work; ddp_isend / ddp_irecv refuse
   device memory (DDP_ERR_UNSUPPORTED). So several ranks can share one GPU (NCCL refuses that) and one
   GPU runs a multi-rank job. Subgroups made later start with g's stream. Return: DDP_SUCCESS;
   DDP_ERR_UNSUPPORTED in a build without DDP_CUDA; DDP_ERR_INVALID_ARGUMENT for a NULL group.
   Thread safety: as the collectives. */
DDP_API ddp_result ddp_set_stream(ddp_group *g, void *cuda_stream);

/* ---- Library buffers (single-copy collectives) ----------------------------------------------
   ddp_alloc: bytes of memory from the library, 64-byte aligned and zero-filled, usable as any buffer.
   On a group whose ranks share one host (the shared-memory transport) the memory lives in this rank's
   arena inside the group's shared segment, which every rank of the group has mapped: when every rank
   passes such memory (all_reduce: buf; broadcast: the root's buf; all_gather: send) and the message
   is larger than 64 KiB, the collective works on the peers' buffers directly instead of staging
   copies through the segment (all_reduce: each rank reduces its 1/n slice out of every rank's buffer
   and writes the result into every rank's buffer: each input read once, each output written once,
   2pN bytes of memory traffic for N bytes on p ranks instead of (5p-1)N). Any subrange of one block
   counts. If any rank passes other memory, every rank stages: results are the same either way.
   The arenas are left out of core dumps.
   Elsewhere (TCP groups, DDP_TRANSPORT=tcp, a single rank, a full /dev/shm, or an arena that is
   exhausted) the memory is plain aligned host memory. Memory from g is single-copy for collectives on
   g only (not on its subgroups or parent). DDP_SHM_ARENA_BYTES (read by rank 0 when the group is made)
   sets each rank's arena size; the default reserves as much address space as /dev/shm can hold, capped
   at 64 GiB, and takes memory only as blocks are allocated.
   Parameters: g, the group the memory is for; bytes (0 gives a valid, unique block).
   Return: the memory, or NULL with ddp_last_error(g) saying why (out of memory; g NULL).
   Thread safety: ddp_alloc and ddp_free may be called from any thread, also while collectives run
   (on other buffers). */
DDP_API void *ddp_alloc(ddp_group *g, size_t bytes);
/* ddp_free: give back memory from ddp_alloc(g, ...) (its block is released to the system). NULL is a
   no-op. A pointer that is not a live block of g (freed twice, from another group, from malloc) is
   left alone: the call logs an error and leaves the message in ddp_last_error(g). Free every block
   before ddp_destroy(g), or let ddp_destroy release them; no collective may be using the block. */
DDP_API void ddp_free(ddp_group *g, void *p);

/* ---- Store (torch.distributed.TCPStore) ------------------------------------------------------
   The key-value store every group rendezvouses through; programs may use it for their own keys
   (keys starting with "ddp/" are the library's). Keys are C strings shorter than 4 KiB; values are
   bytes (zeros allowed), at most 64 MiB each. Over TCP it speaks torch 1.13's TCPStore protocol, so
   torch processes can share it. Blocking calls wait at most the store's timeout (the group's).
   Every failure leaves a message in ddp_store_last_error(s) naming the store, the key and what to do;
   DDP_ERR_TIMEOUT when the store did not answer or a key did not appear in time, DDP_ERR_PEER_LOST when
   the connection to the store dropped (the next call reconnects), DDP_ERR_INVALID_ARGUMENT for bad
   arguments, DDP_ERR_OUT_OF_MEMORY "the store at H:P is full (...)" when ddp.h's store server refuses a
   write past this client's share or its budget (DDP_STORE_MAX_BYTES; the connection stays usable).
   Thread safety: one thread at a time per store. */
/* ddp_group_store: g's store (subgroups share their parent's). A single process started without a
   master (no store to rendezvous through) gets a private store on 127.0.0.1 at the first call, so code
   written for many ranks runs on one. NULL when g is NULL or destroyed, or that store cannot start
   (ddp_last_error says why). */
DDP_API ddp_store *ddp_group_store(ddp_group *g);
/* Sets key to the size bytes at value (replacing any value; size 0 is allowed, value may then be NULL). */
DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size);
/* Waits until key exists (DDP_ERR_TIMEOUT after the store's timeout); copies at most capacity bytes to
   value; *size (when size is not NULL) = the value's full size, which may exceed capacity. */
DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
/* Adds delta to the integer stored at key (created as 0) and returns the new value in *result (when
   result is not NULL). Atomic across all clients. The value is kept as decimal text, as torch keeps it,
   so ddp_store_get on the key returns e.g. "42"; adding to a value that is not a number fails
   (DDP_ERR_STATE), and so does a sum that would overflow int64 (DDP_ERR_INVALID_ARGUMENT: the value stays
   as it was; torch's store wraps around). */
DDP_API ddp_result ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result);
/* *exists = 1 when key exists now, else 0. Does not wait. */
DDP_API ddp_result ddp_store_check(ddp_store *s, const char *key, int *exists);
/* Waits until all n keys exist; timeout_seconds <= 0 means the store's timeout. DDP_ERR_TIMEOUT names
   the keys when they do not all appear in time. */
DDP_API ddp_result ddp_store_wait(ddp_store *s, const char *const *keys, int n, double timeout_seconds);
/* Deletes key; *deleted (when not NULL) = 1 when it existed, else 0. */
DDP_API ddp_result ddp_store_delete(ddp_store *s, const char *key, int *deleted);
/* The message of the last failed call on s (on this thread, as ddp_last_error(NULL), when s is NULL).
   Never NULL. */
DDP_API const char *ddp_store_last_error(const ddp_store *s);

/* ---- Launching (torchrun, torch.multiprocessing.spawn) ---------------------------------------
   ddp_spawn: fork nprocs processes on this host; each runs fn(rank, nprocs, arg) with the variables
   ddprun sets (RANK = LOCAL_RANK = rank, WORLD_SIZE = LOCAL_WORLD_SIZE = nprocs, MASTER_ADDR=127.0.0.1,
   a free MASTER_PORT, GROUP_RANK=0, ..., OMP_NUM_THREADS=1 when unset and nprocs > 1), so ddp_init(NULL)
   inside fn joins them. The parent's environment is not changed.
   Each process exits with fn's return value after flushing stdio: 0 is success; any other value is a
   failure (a value whose low 8 bits are 0, such as 256, exits 1). When one fails (non-zero exit or a
   signal), the others get SIGTERM, then SIGKILL 3 s later; every worker runs in its own process group,
   which is signalled, so a worker's own children are stopped too. No orphans: the workers are the
   children of a guardian process that ddp_spawn forks (a Linux child subreaper, to which every orphan
   of the workers' tree comes, daemons included); when ddp_spawn returns, or when the calling process
   dies, even by SIGKILL, the guardian kills (SIGKILL) whatever the workers left running, and the
   leftovers are logged at error level. SIGCHLD is set to its default while workers run (an ignored
   SIGCHLD would discard the guardian's exit status) and restored afterwards.
   Parameters: nprocs in [1, 65536]; fn (not NULL); arg passed to fn unchanged.
   Return: DDP_SUCCESS when every process exits 0; DDP_ERR_WORKER_FAILED with ddp_last_error(NULL)
   naming the rank that failed and how ("rank 2 (pid 1234) of 4 exited with code 3; ..."), also
   logged at error level. Ranks that lose a peer fail at once themselves, so the failures of the
   0.25 s after the first are collected: the one unlike the rest is named as the cause, the others
   are listed. DDP_ERR_INVALID_ARGUMENT; DDP_ERR_SYSTEM (fork or socket failed).
   Thread safety: call from a single-threaded parent (after fork, only the calling thread exists in
   the children, and fn may call anything). The workers are not the caller's children, so a
   waitpid(-1) elsewhere cannot take their exit statuses. */
DDP_API ddp_result ddp_spawn(int nprocs, int (*fn)(int rank, int world_size, void *arg), void *arg);

/* ddp_launcher_main: the whole of ddprun (tools/ddprun.c is a main() around it); `ddprun --help`
   lists the flags. torchrun's flags, with dashes or underscores, `--flag value` or `--flag=value`:
   --nproc-per-node (a number, or "cpu"), --nnodes, --node-rank, --master-addr, --master-port,
   --standalone, --max-restarts, --rdzv-id, --role, --no-python (ignored); and its own --ft, --cpu-bind,
   --timeline. Rendezvous is static (each node runs ddprun with its own --node-rank); elastic
   rendezvous is refused with a clear message.
   Each worker runs the program with torchrun's environment (TORCHELASTIC_USE_AGENT_STORE=False: rank 0
   serves the store) plus DDP_RESTART_COUNT. When a worker fails, ddprun names the rank and how,
   stops the others (SIGTERM, SIGKILL after 3 s) and, with --max-restarts, starts the group again.
   --ft (fault-tolerant training, ddp_ft_begin): every worker gets DDP_FT=1, and a worker killed by a
   signal is a lost member: ddprun prints one line (its rank, the signal, "the others went on without
   it") and keeps waiting for the others; a worker that exits non-zero still fails the job. A lost
   worker is not restarted (joiners are not built yet): --ft with --max-restarts > 0 is refused.
   It forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to the workers. A worker that exits 0 while others
   run is waited for, as torchrun does, and mentioned once on stderr. No orphans, as for ddp_spawn:
   when the group ends, or when ddprun is killed (SIGKILL included), whatever the workers started
   that still runs is killed; ddprun names what it killed when it can.
   Return: the exit code for main: 0 when all workers exited 0 (--ft: all but the lost ones, and at
   least one); 2 for a bad command line; the failed worker's exit code (128 + signal number when it
   was killed) after the last attempt; 128 + the signal ddprun received when it was interrupted; 1
   when it could not start the workers.
   Thread safety: call from main; it installs signal handlers for its duration. */
DDP_API int ddp_launcher_main(int argc, char **argv);
