/* ddp.h — DistributedDataParallel for C and CUDA training programs. MIT license (at the end of this file).

   GENERATED from src/ by amalgamate.py: edit src/, then run `python3 amalgamate.py`.

   Do this:
       #define DDP_IMPLEMENTATION
   before you include this file in *one* C or C++ file to create the implementation.

       // in every file that uses it
       #include "ddp.h"
       // in exactly one file
       #define DDP_IMPLEMENTATION
       #include "ddp.h"

   Build (it needs only libc, pthreads and libm):
       cc -O2 -pthread train.c -o train -lm
   and the launcher, from this file alone (the same as tools/ddprun.c):
       printf '#define DDP_IMPLEMENTATION\n#include "ddp.h"\nint main(int c, char **v) { return ddp_launcher_main(c, v); }\n' \
           | cc -O2 -pthread -I. -x c - -o ddprun -lm
   Run the program under any launcher:
       ./ddprun --nproc-per-node 4 ./train     (torchrun-compatible flags; ddprun --help)
       torchrun --standalone --nproc_per_node 4 --no_python ./train    (torch 1.13 on Python 3.11: add
                                                                        --redirects 1 --tee 1)
       mpirun -np 4 ./train                    (as root or oversubscribed: --allow-run-as-root --oversubscribe)
       srun -n 4 ./train
   or with no launcher at all (a single process, world size 1).

   A first program:
       ddp_group *g;
       if (ddp_init(NULL, &g) != DDP_SUCCESS) { fprintf(stderr, "%s\n", ddp_last_error(NULL)); return 1; }
       float x[4] = {1, 2, 3, 4};
       ddp_all_reduce(g, x, 4, DDP_F32, DDP_SUM);      // x is now the sum over all ranks
       ddp_destroy(g);

   COMPILE-TIME OPTIONS (define before the include that has DDP_IMPLEMENTATION)
       DDP_STATIC              every function is static (private copy per translation unit)
       DDP_MALLOC(sz) DDP_REALLOC(p,sz) DDP_FREE(p)
                               allocator hooks; define all three or none
       DDP_ASSERT(x)           internal invariant checks (default: assert from <assert.h>)
       DDP_CUDA                declare the ddp_cuda.cu entry points (build ddp_cuda.cu with nvcc)
       DDP_MPI                 add the MPI backend (compile with mpicc)

   ENVIRONMENT (what the library reads; where ddp_init_desc has a field for one, the field wins)
       RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT   (torchrun, ddprun)
       OMPI_COMM_WORLD_*, PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS      (mpirun, Hydra, srun)
                         consulted in that order after torchrun's; local rank and size from
                         MPI_LOCALRANKID/MPI_LOCALNRANKS (Hydra), SLURM_LOCALID (srun)
       without MASTER_*  the master is 127.0.0.1, or under srun the first host of SLURM_STEP_NODELIST
                         (else SLURM_NODELIST); the port is derived from the first job id set among
                         OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE, SLURM_JOB_ID (+ SLURM_STEP_ID),
                         PMI_ID, HYDI_CONTROL_FD (none: 29500)
       TORCHELASTIC_USE_AGENT_STORE  True (plain torchrun): the agent serves the store, rank 0 joins it
       TORCHELASTIC_RUN_ID  the job's run id (torchrun --rdzv_id, ddprun): a rank that reaches the store of
                         a job with another run id fails at once saying that another job holds the port
       DDP_BACKEND       auto | cpu (default), mpi (built with -DDDP_MPI), nccl (built with -DDDP_CUDA)
       DDP_TIMEOUT       seconds before a blocked operation fails (default 300)
       DDP_LOG_LEVEL     none | error | warn | info | debug   (default warn)
       DDP_TRANSPORT     cpu backend transport: auto (shared memory within a host, TCP between) | tcp;
                         tcp on any rank keeps the whole group on TCP
       DDP_STORE_PROTOCOL  auto (default: found out on connecting) | 1.13 | 2: the TCPStore protocol the
                         store client speaks, torch 1.13's or torch 2.x's (the server serves both)
       DDP_STORE_MAX_BYTES  the budget of the store rank 0 serves: stored keys and values plus buffers
                         (default 1 GiB, at least 1 MiB); one client may hold an eighth of it, and the last
                         eighth is kept for small keys; a write past either is refused with "store ... is full"
       DDP_AUTH_TOKEN    a shared secret: the store and every rank-to-rank connection require proof of
                         it (HMAC-SHA256 challenge); unset: no authentication
       DDP_SHM_CMA       0 turns off cross-memory attach (process_vm_readv/writev) for shared-memory
                         all_reduce of plain buffers of 1 MiB and more (default 1)
       DDP_SHM_ARENA_BYTES  address space reserved per rank for ddp_alloc buffers in the shared segment
                         (default: what /dev/shm can hold, at most 64 GiB)
       DDP_TRACE_SIZE    collectives each group's flight recorder keeps (default 64; 0 turns it off)
       DDP_TRACE_DIR     when a group breaks (timeout, lost peer, abort, mismatch), each rank writes its
                         recorders to DIR/ddp_trace_rank<R>_pid<P>.txt (unset: its last 10 into the error
                         log); ddprun summarises the files, one line per rank, when a job fails (unset:
                         ddprun gives its workers $TMPDIR/ddprun_trace.XXXXXX, removed if the job succeeds)
       DDP_TRACE_SIGNAL  1: SIGUSR1 writes the recorders (to DDP_TRACE_DIR, else stderr), and so does
                         SIGTERM into DDP_TRACE_DIR before the process ends as it would have; each then
                         calls the handler installed before. 0: neither. Default: 1 when DDP_TRACE_DIR is
                         set (ddprun sets it to a directory of its own unless you do), else 0
       DDP_RESTART_COUNT set by ddprun --max-restarts (also TORCHELASTIC_RESTART_COUNT)
       OMP_NUM_THREADS   unset: ddprun sets it to 1 for its workers when nproc > 1 (as torchrun does)

   API CHANGES (programs written for an older ddp.h may need these edits)
       2026-11-24 (0.1.0): ddp_reducer_stats(r, &s) is now ddp_reducer_get_statistics(r, &s); the old name
                           stays as a deprecated alias.
       2026-11-24 (0.1.0): the nccl backend's glue (ddp_cuda_nccl_*, ddp_cuda_is_device_pointer, ddp_cuda_nccl,
                           ddp_cuda_coll, DDP_CUDA_ALL_REDUCE..., DDP_CUDA_NCCL_ID_BYTES) is private: renamed
                           ddp__cuda_* / DDP__CUDA_* and no longer declared for programs (use the group's
                           collectives). The private ddp__bn_* helpers left the public part too.

   HOW IT IS BUILT (the implementation's layers, bottom up; the [SECTION] internal block lists them too)
       util, dtype, net, auth, store    errors and logging; element types; sockets; the key-value store
       transport                        framed messages between ranks over a TCP mesh, abort propagation
       collectives                      the public collectives: validate, fingerprint, dispatch, async work
       backends: tcp, shm, hier, mpi, nccl   each fills one ddp__backend table (run, enqueue, wait, test,
                                        close, and the reducer's memory functions); collectives.c reaches
                                        a backend only through it, and backends set up through internal
                                        mesh calls, never through the public collectives
       group                            ddp_init: launcher environment, rendezvous, mesh, which backend
       launcher, reducer, sampler, syncbn, safetensors, checkpoint   built on the public API

   INDEX (search for the [SECTION] markers)
   [SECTION] api: version, results, dtypes, ops, logging, groups, collectives, store, launch src/ddp_api.h
   [SECTION] reducer: DistributedDataParallel's gradient Reducer (bucketed, overlapped all-reduce) src/reducer.h
   [SECTION] sampler: torch.utils.data.distributed.DistributedSampler, bit-exact; eval and streaming modes src/sampler.h
   [SECTION] syncbn: torch.nn.SyncBatchNorm (and plain BatchNorm1d/2d/3d) forward and backward src/syncbn.h
   [SECTION] checkpoint: safetensors save/load, resume state, per-rank shards (torch.save / load patterns) src/checkpoint.h
   [SECTION] cuda: entry points implemented in ddp_cuda.cu (declared with DDP_CUDA) src/cuda_api.h
   [SECTION] bn-math: SyncBatchNorm formulas shared by the CPU code (src/syncbn.c) and the CUDA kernels src/bn_math.h
   [SECTION] cuda-glue: the nccl backend's communicator, implemented in ddp_cuda.cu (with DDP_CUDA) src/cuda_glue.h
   [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces src/internal.h
   [SECTION] util: errors, logging, environment parsing, time, memory   src/util.c
   [SECTION] registry: which groups and work handles are alive, so that a call on a destroyed group or src/registry.c
   [SECTION] dtype: sizes and names, f16/bf16 conversion, element-wise reduction src/dtype.c
   [SECTION] net: TCP sockets with deadlines                            src/net.c
   [SECTION] auth: DDP_AUTH_TOKEN, a shared secret that every connection proves (HMAC-SHA256) src/auth.c
   [SECTION] store: rendezvous key-value store (c10d TCPStore protocols of torch 1.13 and 2.x), file store src/store.c
   [SECTION] link: connections between the ranks of a group, made on first use src/link.c
   [SECTION] transport: framed messages between the ranks of a group, failure detection, abort src/transport.c
   [SECTION] collectives: ddp_all_reduce ... ddp_gather, ddp_scatter, ddp_all_to_all(_v), ddp_all_gather_v, ddp_broadcast_bytes, ddp_monitored_barrier src/collectives.c
   [SECTION] trace: the flight recorder, each group's last collectives, written out when the group breaks src/trace.c
   [SECTION] tcp: the tcp backend, collective algorithms over the TCP mesh (Gloo's and MPI's ring, src/tcp.c
   [SECTION] alloc: ddp_alloc / ddp_free, library buffers that collectives use in place src/alloc.c
   [SECTION] shm: shared-memory transport for the ranks of a group that share one host src/shm.c
   [SECTION] hier: hierarchical all_reduce for a group that spans hosts with several ranks on a host src/hier.c
   [SECTION] mpi: the mpi backend, collectives through the MPI library (built with -DDDP_MPI) src/mpi.c
   [SECTION] nccl: the nccl backend, collectives on device memory through NCCL (built with -DDDP_CUDA) src/nccl.c
   [SECTION] group: ddp_init (torch.distributed.init_process_group), launcher environments, src/group.c
   [SECTION] launcher: ddp_spawn (torch.multiprocessing.spawn) and ddprun (torchrun) src/launcher.c
   [SECTION] reducer: DistributedDataParallel's Reducer: model check, buckets, overlapped all-reduce src/reducer.c
   [SECTION] sampler: DistributedSampler, MT19937 and torch.randperm, Feistel streaming permutation src/sampler.c
   [SECTION] syncbn (implementation): SyncBatchNorm on the CPU, f32 data, f64 statistics src/syncbn.c
   [SECTION] safetensors: the file format (Hugging Face safetensors), CRC32C, UTF-8, ddp_meta src/safetensors.c
   [SECTION] checkpoint: atomic save on rank 0, load everywhere or broadcast, shards, keep_last, latest src/checkpoint.c
*/

#ifndef DDP_H_INCLUDED
#define DDP_H_INCLUDED

#ifdef __cplusplus
extern "C" {
#endif

/* ==================== begin src/ddp_api.h ==================== */
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
    DDP_ERR_UNEVEN_INPUTS = -13    /* reducer with join_fail_early: a rank ran out of data (the message names
                                      it and the step); the group stays usable */
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
   root*count. */
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
   memory only so far. */
DDP_API ddp_result ddp_send(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag);
DDP_API ddp_result ddp_recv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag);
/* isend / irecv: return at once with a handle for ddp_wait / ddp_test. An isend is queued with the group's
   async collectives (in issue order); an irecv is posted at once, and any later call that reads the
   connections (a queued call, a collective over TCP, a send, ddp_wait, ddp_test) may finish it, so every
   rank may post its irecv before its isend. The buffer must stay valid and untouched until ddp_wait
   returns. On the mpi backend they are MPI_Isend / MPI_Irecv. */
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

/* ddp_set_stream: the CUDA stream (a cudaStream_t) that the nccl backend queues g's collectives on
   (torch orders NCCL work after the current stream). NULL = the legacy default stream, the initial
   setting. On the nccl backend, buffers in device memory go to NCCL: a collective is queued on the
   stream after the caller's earlier work there, and the synchronous call returns once it has completed
   (ddp_wait, for the async variants); buffers in host memory run on the cpu path. Subgroups made later
   start with g's stream. Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED on a group of another backend;
   DDP_ERR_INVALID_ARGUMENT for a NULL group. Thread safety: as the collectives. */
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
   --standalone, --max-restarts, --rdzv-id, --role, --no-python (ignored). Rendezvous is static (each
   node runs ddprun with its own --node-rank); elastic rendezvous is refused with a clear message.
   Each worker runs the program with torchrun's environment (TORCHELASTIC_USE_AGENT_STORE=False: rank 0
   serves the store) plus DDP_RESTART_COUNT. When a worker fails, ddprun names the rank and how,
   stops the others (SIGTERM, SIGKILL after 3 s) and, with --max-restarts, starts the group again.
   It forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to the workers. A worker that exits 0 while others
   run is waited for, as torchrun does, and mentioned once on stderr. No orphans, as for ddp_spawn:
   when the group ends, or when ddprun is killed (SIGKILL included), whatever the workers started
   that still runs is killed; ddprun names what it killed when it can.
   Return: the exit code for main: 0 when all workers exited 0; 2 for a bad command line; the failed
   worker's exit code (128 + signal number when it was killed) after the last attempt; 128 + the
   signal ddprun received when it was interrupted; 1 when it could not start the workers.
   Thread safety: call from main; it installs signal handlers for its duration. */
DDP_API int ddp_launcher_main(int argc, char **argv);
/* ==================== end src/ddp_api.h ==================== */

/* ==================== begin src/reducer.h ==================== */
/* [SECTION] reducer: DistributedDataParallel's gradient Reducer (bucketed, overlapped all-reduce) */
/* Mirrors torch.nn.parallel.DistributedDataParallel and its C++ Reducer (torch/csrc/distributed/c10d/
   reducer.cpp) as an explicit C API. PyTorch finds the parameters by walking the module and learns that a
   gradient is ready from an autograd hook; here the program registers each parameter and calls
   ddp_reducer_grad_ready(r, i) where the hook would fire: right after it has finished writing parameter
   i's gradient in its backward pass.

   A training step:
       ddp_reducer_desc d = {0};                        // 25 MiB buckets, 1 MiB first bucket, no extras
       ddp_reducer *red;
       ddp_reducer_create(g, &d, &red);
       ddp_reducer_add_param(red, "fc1.weight", w1, dw1, 64 * 32, DDP_F32, &i_w1);   // ... every parameter
       ddp_reducer_add_buffer(red, "bn.running_mean", mean, 64, DDP_F32);           // optional
       ddp_reducer_finalize(red);        // same model on every rank? then rank 0's weights everywhere
       for (step = 0; step < steps; step++) {
           forward(...);
           ddp_reducer_begin_backward(red);
           // backward, last layer first: write (or add to) each gradient, then say it is ready
           backward_layer3(...);  ddp_reducer_grad_ready(red, i_w3);  ddp_reducer_grad_ready(red, i_b3);
           ...
           ddp_reducer_end_backward(red);   // every gradient is now the average over the ranks
           sgd_step(...);  ddp_reducer_zero_grad(red);
       }
       ddp_reducer_destroy(red);

   What happens, as in PyTorch:
   - Buckets. Gradients are packed into flat buckets of one dtype each, in reverse registration order (the
     order backward usually produces them). A bucket closes when its size reaches the limit; the parameter
     that crosses the limit stays in it. The first bucket's limit is first_bucket_bytes (1 MiB), later ones
     bucket_cap_bytes (25 MiB), so communication starts early and then runs in large messages.
     After the first synchronised backward the buckets are rebuilt once, in the order the gradients were
     actually ready on rank 0 (broadcast, so every rank rebuilds alike); not with find_unused_parameters.
   - Overlap. grad_ready copies the gradient into its bucket, multiplied by 1/world_size (the average is
     taken before the sum, as PyTorch does); when a bucket's last gradient arrives its asynchronous SUM
     all-reduce starts, while backward continues. Buckets start strictly in order, so every rank issues
     the same collectives in the same order. end_backward waits for the rest and copies the results back.
   - no_sync: ddp_reducer_set_sync(r, 0) makes the following backward passes local: gradients accumulate
     in the program's buffers (the program adds to them), and the next synchronised backward averages the
     accumulated sum.
   - find_unused_parameters: a parameter that got no gradient since the last synchronised backward counts
     as zero on this rank; a "used" map is all-reduced after the buckets, and the gradient of a parameter
     that no rank used is left exactly as it was. Without the option, a missing gradient is an error that
     names the parameters (PyTorch's "Expected to have finished reduction in the prior iteration ...").
   - gradient_as_bucket_view: the gradient memory is the bucket itself (no copy in or out, half the memory).
     The program then writes gradients where ddp_reducer_grad(r, i) points.
   - Compression: comm_dtype DDP_F16 / DDP_BF16 sends the buckets in half precision, like PyTorch's
     fp16_compress_hook / bf16_compress_hook (cast, divide by the world size, all-reduce, cast back).

   - Uneven inputs (torch's `with model.join():`, the Join context manager): with uneven_inputs = 1 ranks
     may run out of data at different steps. Each rank with data announces every backward pass (and every
     ddp_reducer_broadcast_buffers) in one small all_gather; a rank without data calls ddp_reducer_join(r),
     which answers those rounds as the others' steps need: zeros into every bucket's all-reduce of a
     synchronised pass (nothing for a no_sync pass; the buffer broadcast for a buffer broadcast), until every
     rank has joined. Gradients are divided by the INITIAL world size (torch's divide_by_initial_world_size
     = True), so a step's average is the sum over the ranks that still had data / world size. When the last
     rank joins, every rank gets the parameters and buffers of the highest-ranked of the last joiners (torch's
     _sync_final_model), so the ranks that stopped early end with the trained model. With uneven_inputs,
     buffers come from the highest rank that still has data (torch's _find_common_rank), not rank 0.
     Every rank calls ddp_reducer_join when its data ends, the last ones too (they return at once):
         for (batch = 0; batch < my_batches; batch++) { forward; begin_backward; ...; end_backward; step; }
         ddp_reducer_join(red);          // DDP_SUCCESS once every rank has joined; models equal again
     join_fail_early = 1 (torch's throw_on_early_termination): instead, at the step where the first rank runs
     out, every rank gets DDP_ERR_UNEVEN_INPUTS (from begin_backward or broadcast_buffers on the ranks with
     data, from ddp_reducer_join on the others) naming the ranks that ran out and the step; the group and
     the reducer stay usable. Only the reducer's own collectives are shadowed: a rank with data that issues
     another collective (a loss all-reduce for logging) before every rank has joined meets a joined rank's
     join round, DDP_ERR_MISMATCH on both at once (torch hangs), and the group is broken. Cost when the ranks are even: one all_gather of 12 bytes
     per rank per backward pass (torch adds one or two 4-byte all-reduces per forward).

   - Timing (ddp_reducer_get_statistics): wait_seconds, the time inside end_backward, is split into
     straggler_wait_seconds (waiting for a slower rank) and transfer_seconds (moving data backward did not
     hide). Each synchronised pass ends with an asynchronous all_gather of 8 bytes per rank: the wall-clock
     time at which each rank's gradients were all there (its last bucket started). The part of this rank's
     wait before the last rank was ready is straggler wait, the rest transfer; last_ready_rank names that
     rank. The all_gather runs while the program goes on (its optimizer step) and is waited for at the
     next begin_backward or get_statistics, so the split costs no time on the step's path. Between hosts
     its accuracy is that of their clock synchronisation (NTP: well under a millisecond on a LAN).

   Differences from PyTorch 1.13, none of which changes the averaged gradients beyond rounding:
   - The first iteration uses the 1 MiB / 25 MiB buckets in reverse registration order (torch 1.13 puts
     everything in one bucket for that iteration unless find_unused_parameters is set, and with it cuts
     buckets in forward order before reversing the list).
   - Compression divides by the world size in f32 and then rounds once to f16/bf16 (the hooks round to
     f16 first and divide in f16).
   - With find_unused_parameters, the unused parameters are found when end_backward is called (torch walks
     the autograd graph at the start of backward); their buckets start then.
   - A gradient is "present" or not by whether grad_ready was called since the last synchronised backward
     (the C counterpart of param.grad being None or not).

   Errors: every call that can fail returns a ddp_result, and the message is in ddp_last_error(g) of the
   group given to ddp_reducer_create (ddp_last_error(NULL) for ddp_reducer_create itself).
   Thread safety: a reducer is used by one thread at a time (the thread that runs backward). Other
   collectives on the same group may be issued during backward only at the same point on every rank. */

typedef struct ddp_reducer ddp_reducer;

/* ddp_reducer_create's descriptor; zero-initialised means PyTorch's defaults. */
typedef struct ddp_reducer_desc {
    size_t bucket_cap_bytes;      /* 0 = 25 MiB (DDP's bucket_cap_mb = 25) */
    size_t first_bucket_bytes;    /* 0 = 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) */
    int find_unused_parameters;   /* 1: a parameter may get no gradient on some ranks (see above) */
    int gradient_as_bucket_view;  /* 1: gradients live in the buckets; ddp_reducer_grad() says where */
    ddp_dtype comm_dtype;         /* DDP_DTYPE_DEFAULT: the gradients' dtype; DDP_F16 / DDP_BF16: compress */
    int uneven_inputs;            /* 1: ranks may run out of data at different steps: ddp_reducer_join (Join) */
    int join_fail_early;          /* with uneven_inputs: DDP_ERR_UNEVEN_INPUTS on every rank when the first rank
                                     runs out, instead of shadowing (Join's throw_on_early_termination) */
} ddp_reducer_desc;

/* Per-iteration statistics, like DDP's logging data (DistributedDataParallel._get_ddp_logging_data()).
   The timing fields describe the last synchronised backward pass. */
typedef struct ddp_reducer_statistics {
    uint64_t iterations;       /* synchronised backward passes completed (DDP's num_iterations) */
    uint64_t local_iterations; /* backward passes run under no_sync */
    int buckets;               /* buckets in the current layout */
    int rebuilt;               /* 1 once the buckets were rebuilt in the observed ready order */
    int unused_parameters;     /* last iteration: parameters without a gradient on this rank */
    uint64_t bytes_reduced;    /* last iteration: bytes all-reduced (buckets in comm dtype + used map) */
    double backward_seconds;   /* begin_backward to the end_backward call: compute, overlapped with comm */
    double comm_seconds;       /* first bucket started to last bucket finished ("avg_backward_comm_time") */
    double wait_seconds;       /* time spent inside end_backward: the communication backward did not hide */
    double total_comm_seconds; /* sums over all synchronised iterations */
    double total_wait_seconds;
    uint64_t shadowed_iterations; /* uneven_inputs: synchronised passes of the others that this rank shadowed
                                     with zero gradients in ddp_reducer_join */
    /* wait_seconds split in two (last synchronised pass; see "Timing" above):
       straggler_wait_seconds + transfer_seconds == wait_seconds */
    double straggler_wait_seconds; /* waiting for a slower rank: until the last rank had all its gradients */
    double transfer_seconds;       /* the rest: moving the data that backward did not hide */
    int last_ready_rank;           /* the rank whose gradients were all there last (the straggler) */
    double total_straggler_wait_seconds; /* sums over all synchronised iterations */
    double total_transfer_seconds;
} ddp_reducer_statistics;

/* ddp_reducer_create: a reducer for the gradients of one model replica on group g (every rank of g takes
   part). Parameters: g, d (NULL = defaults), out. The reducer keeps g; destroy the reducer before g.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for a bad descriptor field; DDP_ERR_UNSUPPORTED for a
   backend the reducer does not know. Not collective. */
DDP_API ddp_result ddp_reducer_create(ddp_group *g, const ddp_reducer_desc *d, ddp_reducer **out);

/* ddp_reducer_add_param: register a parameter (before ddp_reducer_finalize), in the order the model
   defines them (forward order; the order must be the same on every rank).
   Parameters: name (copied; e.g. "fc1.weight"), param (count values of dtype t, overwritten with rank 0's
   at finalize), grad (the gradient buffer, count values of t; must be NULL with gradient_as_bucket_view,
   where the reducer provides it), t (DDP_F32, DDP_F64, DDP_F16 or DDP_BF16), index (receives the
   parameter's index: 0, 1, ... in registration order; may be NULL). Names are unique among the
   reducer's parameters and buffers: a name registered already is DDP_ERR_INVALID_ARGUMENT naming it.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT (names the problem); DDP_ERR_STATE after finalize. */
DDP_API ddp_result ddp_reducer_add_param(ddp_reducer *r, const char *name, void *param, void *grad, size_t count,
                                         ddp_dtype t, int *index);

/* ddp_reducer_add_buffer: register a buffer (running statistics and the like, any dtype): broadcast from
   rank 0 at finalize and by ddp_reducer_broadcast_buffers. Before finalize; name is copied. */
DDP_API ddp_result ddp_reducer_add_buffer(ddp_reducer *r, const char *name, void *buf, size_t count, ddp_dtype t);

/* ddp_reducer_finalize: collective. Checks that every rank registered the same parameters and buffers
   (count, sizes, dtypes, names); a difference is DDP_ERR_MISMATCH on every rank, naming the first
   parameter that differs and what each side has. Then broadcasts parameters and buffers from rank 0
   (coalesced in chunks of up to 250 MiB, as DDP does) and builds the buckets. */
DDP_API ddp_result ddp_reducer_finalize(ddp_reducer *r);

/* ddp_reducer_grad: where parameter index's gradient is (what the program writes in backward): the grad
   pointer it registered, or with gradient_as_bucket_view the parameter's slice of its bucket (zeroed at
   finalize). With gradient_as_bucket_view the slice MOVES when the buckets are rebuilt, at the end of the
   first synchronised end_backward (gradients are carried over): read it again after that call, as
   PyTorch's param.grad becomes a different view. NULL for a bad index (or a view before finalize). */
DDP_API void *ddp_reducer_grad(ddp_reducer *r, int index);

/* ddp_reducer_begin_backward: a backward pass starts (synchronised, or local under set_sync(r, 0)).
   DDP_ERR_STATE before finalize or when the previous backward has not ended. With uneven_inputs it is
   collective (the join round, see above): DDP_ERR_UNEVEN_INPUTS (join_fail_early) when a rank has run out
   of data, DDP_ERR_MISMATCH when the ranks with data disagree about no_sync; the pass has not begun then. */
DDP_API ddp_result ddp_reducer_begin_backward(ddp_reducer *r);

/* ddp_reducer_grad_ready: parameter index's gradient is complete for this backward pass (the autograd
   hook). In a synchronised pass its value is taken now (and its bucket's all-reduce may start): do not
   write to it again until end_backward returns (with gradient_as_bucket_view it is scaled by 1/world_size
   in place now, as PyTorch does, and holds the sum of the ranks' shares once end_backward returns). DDP_ERR_STATE (naming the parameter) when called twice
   in one backward or outside begin/end; DDP_ERR_INVALID_ARGUMENT for a bad index; an error of the
   all-reduce it starts. */
DDP_API ddp_result ddp_reducer_grad_ready(ddp_reducer *r, int index);

/* ddp_reducer_end_backward: collective in a synchronised pass. Starts what is left, waits for every
   bucket and writes the averaged gradients back: afterwards every rank holds the same gradients.
   Errors: DDP_ERR_STATE without begin_backward, or when a gradient is missing without
   find_unused_parameters: the message names the parameters, and the group is then broken, as the ranks
   no longer issue the same collectives; every other rank fails at once with the same message in the call
   it is in (usually its end_backward). Any error of the all-reduces. */
DDP_API ddp_result ddp_reducer_end_backward(ddp_reducer *r);

/* ddp_reducer_set_sync: 0 = DDP's no_sync(): the following backward passes only accumulate locally;
   1 (the default) = synchronise. Between backward passes only (else DDP_ERR_STATE). */
DDP_API ddp_result ddp_reducer_set_sync(ddp_reducer *r, int sync);

/* ddp_reducer_zero_grad: set every parameter's gradient to zero (optimizer.zero_grad()). Not during a
   backward pass (DDP_ERR_STATE). */
DDP_API ddp_result ddp_reducer_zero_grad(ddp_reducer *r);

/* ddp_reducer_broadcast_buffers: collective; copy rank 0's buffers to every rank (DDP's
   broadcast_buffers=True does it before each forward). Not during a backward pass. With uneven_inputs:
   the highest rank that still has data is the source (torch's _find_common_rank), and the errors of
   begin_backward's join round apply. */
DDP_API ddp_result ddp_reducer_broadcast_buffers(ddp_reducer *r);

/* ddp_reducer_join: this rank has no data left (uneven_inputs = 1; see "Uneven inputs" above). Collective:
   shadows the reducer's collectives of the ranks that still have data, with zero gradients, until every
   rank has called ddp_reducer_join; then every rank gets the parameters and buffers of the highest-ranked
   last joiner. The program's gradients are left as they were. Return: DDP_SUCCESS when every rank has
   joined; DDP_ERR_UNEVEN_INPUTS with join_fail_early while some rank still has data (every rank gets it,
   naming the ranks and the step); DDP_ERR_MISMATCH when the ranks with data make different reducer calls
   (a no_sync pass against a synchronised one: every rank gets it); DDP_ERR_STATE without uneven_inputs or
   during a backward pass; any error of the collectives. */
DDP_API ddp_result ddp_reducer_join(ddp_reducer *r);

/* ddp_reducer_get_statistics: fill *out (see ddp_reducer_statistics). Waits for the last synchronised
   pass's timing exchange (every rank started it in end_backward; a small-message latency at most).
   DDP_ERR_INVALID_ARGUMENT for NULL pointers. */
DDP_API ddp_result ddp_reducer_get_statistics(const ddp_reducer *r, ddp_reducer_statistics *out);

/* ddp_reducer_stats: DEPRECATED (2026-11-24), the old name of ddp_reducer_get_statistics; it does the
   same and will be removed in a later version. */
DDP_API ddp_result ddp_reducer_stats(const ddp_reducer *r, ddp_reducer_statistics *out);

/* ddp_reducer_param_bucket: the bucket that holds parameter index's gradient now (buckets are numbered in
   the order they are all-reduced), and, when offset is not NULL, its element offset in the bucket.
   -1 for a bad index or before finalize. For tests and for tuning bucket sizes. */
DDP_API int ddp_reducer_param_bucket(const ddp_reducer *r, int index, size_t *offset);

/* ddp_reducer_destroy: wait for any all-reduce in flight and free the reducer. Not collective. NULL is a
   no-op. */
DDP_API void ddp_reducer_destroy(ddp_reducer *r);
/* ==================== end src/reducer.h ==================== */

/* ==================== begin src/sampler.h ==================== */
/* [SECTION] sampler: torch.utils.data.distributed.DistributedSampler, bit-exact; eval and streaming modes */
/* Mirrors torch.utils.data.distributed.DistributedSampler: each rank gets its share of a dataset's indices
   for one epoch. No communication: every rank computes the same permutation from the same seed and takes
   its own slice. A zero-initialised descriptor (plus dataset_size, num_replicas, rank) is PyTorch's default
   DistributedSampler(shuffle=True, seed=0, drop_last=False), and the indices are identical to PyTorch's:

       N = dataset_size, R = num_replicas
       num_samples = drop_last ? floor(N / R) : ceil(N / R);    total_size = num_samples * R
       perm        = shuffle ? torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch))
                             : [0, 1, ..., N-1]
       padded      = drop_last ? perm[:total_size] : perm repeated until it is total_size long
       this rank   = padded[rank], padded[rank + R], padded[rank + 2R], ...      (strided, num_samples of them)

   The generator is MT19937 seeded with the low 32 bits of seed + epoch (as torch's manual_seed does; a
   negative Python seed is the same number as uint64_t: pass (uint64_t)(int64_t)seed). Only the low 32 bits
   matter, so seed + epoch wrapping around 2^64 changes nothing.

   Beyond PyTorch:
   - DDP_SAMPLER_EVAL: every index exactly once across the ranks (no padding, no duplicates, nothing dropped);
     shard sizes differ by at most one. Padding duplicates distort evaluation metrics; this mode does not.
     Rank r gets perm[r], perm[r + R], ... below N: the same order as the default mode, without the padding.
   - Resume mid-epoch: ddp_sampler_position / ddp_sampler_set_position (a checkpoint saves epoch + position).
   - DDP_PERMUTATION_STREAMING: a keyed Feistel permutation with O(1) memory and random access to any
     index, for datasets too large to shuffle in memory (>= 1e9 samples). NOT the same order as PyTorch's.
   - The default permutation holds 4 bytes per sample while it shuffles (8 when N > 2^32; torch holds 8 in
     its tensor plus a Python list), then keeps only this rank's share.

   A training loop:
       ddp_sampler_desc d = {0};
       ddp_sampler s;
       d.dataset_size = n; d.num_replicas = ddp_world_size(g); d.rank = ddp_rank(g);
       if (ddp_sampler_init(&s, &d) != DDP_SUCCESS) { fprintf(stderr, "%s\n", ddp_last_error(NULL)); ... }
       for (epoch = 0; epoch < epochs; epoch++) {
           int64_t batch[64];
           size_t got;
           ddp_sampler_set_epoch(&s, epoch);                  // a new shuffle each epoch, as in PyTorch
           while ((r = ddp_sampler_next_batch(&s, 64, batch, &got)) == DDP_SUCCESS && got > 0)
               train_on(batch, got);
           if (r != DDP_SUCCESS) ...                          // out of memory for the permutation
       }
       ddp_sampler_free(&s);

   Thread safety: a sampler is used by one thread at a time; different samplers are independent (there is
   no global state). Errors go to ddp_last_error(NULL), the calling thread's message. */

/* How the indices are divided between the ranks. */
typedef enum ddp_sampler_mode {
    DDP_SAMPLER_TORCH = 0, /* PyTorch's: equal shards, padded by repeating indices (or cut with drop_last) */
    DDP_SAMPLER_EVAL       /* evaluation: every index exactly once, shards differ by at most one; no drop_last */
} ddp_sampler_mode;

/* Which permutation shuffles the indices (when no_shuffle is 0). */
typedef enum ddp_sampler_permutation {
    /* torch.randperm of current PyTorch (2.7 and later): the 32-bit swap loop below N = 214748364
       (UINT32_MAX / 20), a 64-bit inside-out Fisher-Yates shuffle from there on. */
    DDP_PERMUTATION_TORCH = 0,
    /* torch.randperm of PyTorch 2.6 and earlier (1.13 included): the 32-bit swap loop at every N. Equal to
       DDP_PERMUTATION_TORCH below N = 214748364. */
    DDP_PERMUTATION_TORCH_LEGACY,
    /* A keyed Feistel bijection on [0, N) (8 rounds, cycle walking), keyed by all 64 bits of seed + epoch.
       No memory, any index computable on its own. Uniform-looking but NOT PyTorch's order. */
    DDP_PERMUTATION_STREAMING
} ddp_sampler_permutation;

/* ddp_sampler_init's descriptor. Zero-initialised fields mean PyTorch's defaults; dataset_size,
   num_replicas (> 0) and rank (0 <= rank < num_replicas) must be set. */
typedef struct ddp_sampler_desc {
    uint64_t dataset_size; /* N: indices are 0 .. N-1 (at most INT64_MAX). 0 is allowed (empty epochs, as torch) */
    int num_replicas;      /* R > 0: usually ddp_world_size(g) */
    int rank;              /* this rank, 0 <= rank < R: usually ddp_rank(g) */
    uint64_t seed;         /* 0 = torch's default seed */
    int drop_last;         /* nonzero: drop the tail instead of padding (DDP_SAMPLER_TORCH only) */
    int no_shuffle;        /* nonzero: indices in order (torch's shuffle=False); 0 = shuffle */
    ddp_sampler_mode mode;               /* 0 = DDP_SAMPLER_TORCH */
    ddp_sampler_permutation permutation; /* 0 = DDP_PERMUTATION_TORCH */
} ddp_sampler_desc;

/* A sampler: a plain struct the caller owns (on the stack, in a struct, ...). Every field is private: use
   the functions below. Do not copy an initialised sampler (the copy would share its memory); init another. */
typedef struct ddp_sampler {
    uint32_t magic;             /* set by ddp_sampler_init, cleared by ddp_sampler_free */
    ddp_sampler_desc desc;      /* the validated descriptor */
    uint64_t epoch;             /* set by ddp_sampler_set_epoch */
    uint64_t position;          /* indices handed out by ddp_sampler_next_batch this epoch */
    uint64_t num_samples;       /* this rank's count per epoch */
    uint64_t total_size;        /* positions dealt out: num_samples * R (eval: N) */
    void *shard;                /* this rank's shuffled indices (uint32 or uint64 each), or NULL */
    int shard_wide;             /* shard entries are uint64 (N > 2^32) */
    int shard_valid;            /* shard holds the indices of shard_epoch */
    uint64_t shard_epoch;
    int epoch_done;             /* the current epoch was handed out to its end */
    int feistel_bits;           /* streaming: the bijection's domain is [0, 2^feistel_bits) */
    uint64_t feistel_keys[8];   /* streaming: one key per round, from seed + epoch */
} ddp_sampler;

/* ddp_sampler_init: check the descriptor and set up a sampler at epoch 0, position 0. Allocates nothing
   (the permutation is made on first use in an epoch, see ddp_sampler_next_batch).
   Parameters: s (caller-owned, overwritten; free an initialised one first), d (the descriptor).
   Return: DDP_SUCCESS, or DDP_ERR_INVALID_ARGUMENT (num_replicas <= 0, rank outside [0, num_replicas),
           dataset_size > INT64_MAX, drop_last in DDP_SAMPLER_EVAL, an unknown mode or permutation, NULL
           pointers) with ddp_last_error(NULL) naming the field. s is then not initialised.
   Thread safety: touches only s and this thread's error message. */
DDP_API ddp_result ddp_sampler_init(ddp_sampler *s, const ddp_sampler_desc *d);

/* ddp_sampler_free: release the sampler's memory; s is then not initialised. NULL, a zeroed or an already
   freed sampler is a no-op. */
DDP_API void ddp_sampler_free(ddp_sampler *s);

/* ddp_sampler_set_epoch: start epoch `epoch` (torch's set_epoch): the shuffle uses seed + epoch, and the
   position goes back to 0. Call it before every epoch with a new number: without it the order would
   repeat, so next_batch hands out nothing once an epoch is done (and calling it again with the same epoch
   after a finished, shuffled epoch logs a warning). Cheap: the permutation is made on first use.
   Ignores a sampler that is not initialised. */
DDP_API void ddp_sampler_set_epoch(ddp_sampler *s, uint64_t epoch);

/* ddp_sampler_epoch: the epoch set last (0 after init). */
DDP_API uint64_t ddp_sampler_epoch(const ddp_sampler *s);

/* ddp_sampler_num_samples: how many indices this rank gets per epoch (torch's len(sampler)); the same
   every epoch. In DDP_SAMPLER_EVAL it differs between ranks by at most one. 0 when s is not initialised. */
DDP_API uint64_t ddp_sampler_num_samples(const ddp_sampler *s);

/* ddp_sampler_indices: all of this rank's indices for the current epoch, in order (list(iter(sampler)) in
   PyTorch). Does not move the position.
   Parameters: out (room for ddp_sampler_num_samples(s) indices; may be NULL when that is 0).
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY when the permutation does not fit; DDP_ERR_INVALID_ARGUMENT
           for a sampler that is not initialised or a NULL out. */
DDP_API ddp_result ddp_sampler_indices(ddp_sampler *s, int64_t *out);

/* ddp_sampler_next_batch: the next (up to) batch_size indices of this epoch, from the current position;
   the position moves past them. *got is batch_size, less for the last batch of the epoch, and 0 once the
   epoch is done (until ddp_sampler_set_epoch or ddp_sampler_set_position). Allocates nothing, except at
   the first call of a shuffled epoch with a torch permutation, which makes the permutation (the slow step:
   about 3 s and 4 bytes per sample at N = 1e8 on a 2-core VM, where torch takes 28 s and 4.8 GiB; later
   calls are copies).
   Parameters: batch_size (> 0), out (room for batch_size indices), got (receives the count).
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT (batch_size 0, NULL pointers, a
           sampler that is not initialised). On error *got is 0 and the position is unchanged. */
DDP_API ddp_result ddp_sampler_next_batch(ddp_sampler *s, size_t batch_size, int64_t *out, size_t *got);

/* ddp_sampler_position: how many of this epoch's indices next_batch has handed out (0 .. num_samples).
   Save it with the epoch in a checkpoint to resume mid-epoch (ddp_resume_state's sampler_position and
   epoch). 0 when s is not initialised. */
DDP_API uint64_t ddp_sampler_position(const ddp_sampler *s);

/* ddp_sampler_set_position: continue the current epoch from `position` (resume: set_epoch(saved epoch),
   then set_position(saved position); the next batch is the one that came next before). The position
   counts this rank's indices, so resume with the same num_replicas and rank.
   Return: DDP_SUCCESS, or DDP_ERR_INVALID_ARGUMENT when position > num_samples or s is not initialised. */
DDP_API ddp_result ddp_sampler_set_position(ddp_sampler *s, uint64_t position);

/* ddp_sampler_index_at: this rank's k-th index of the current epoch (the k-th element of
   ddp_sampler_indices), without moving the position. With DDP_PERMUTATION_STREAMING or no_shuffle it is
   computed on its own in O(1) time and memory; with a torch permutation the first call of an epoch makes
   the permutation, as next_batch does.
   Return: DDP_SUCCESS; DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT when k >= num_samples, out is NULL
           or s is not initialised. */
DDP_API ddp_result ddp_sampler_index_at(ddp_sampler *s, uint64_t k, int64_t *out);
/* ==================== end src/sampler.h ==================== */

/* ==================== begin src/syncbn.h ==================== */
/* [SECTION] syncbn: torch.nn.SyncBatchNorm (and plain BatchNorm1d/2d/3d) forward and backward
   Mirrors torch.nn.SyncBatchNorm (torch/nn/modules/_functions.py). Batch statistics are computed
   over the batches of every rank of the group, as if BatchNorm saw the concatenated batch:

     forward (training)   each rank: per channel count n_r, mean_r, M2_r = sum (x - mean_r)^2
                          all_gather [mean_r(C), M2_r(C), n_r] (f64) from every rank
                          Chan merge, rank by rank (ranks with n_r = 0 drop out):
                              delta = mean_b - mean_a, n = n_a + n_b,
                              mean = mean_a + delta * n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n
                          invstd = 1 / sqrt(M2 / n + eps)
                          running_mean += f * (mean - running_mean)
                          running_var  += f * (M2 / (n - 1) - running_var)   (unbiased, global n)
                          f = momentum, or 1 / num_batches_tracked when momentum is None (< 0 here)
                          y = (x - mean) * invstd * weight + bias
     backward             each rank: sum_dy = sum dy, sum_dy_xmu = sum dy (x - mean)
                          all_reduce (SUM) [sum_dy, sum_dy_xmu]
                          dx = (dy - sum_dy / n - (x - mean) invstd^2 sum_dy_xmu / n) invstd weight
                          grad_weight += local sum dy (x - mean) invstd, grad_bias += local sum dy
                          (local: the gradient reducer averages them like every other parameter)

   Layouts: channels-first (N, C, spatial...) or channels-last (N, spatial..., C); `spatial` is the
   product of the spatial sizes (1 for BatchNorm1d's (N, C) input). Data is f32; statistics are
   accumulated in f64. The CPU code makes one pass over x per stage. The per-element and per-channel
   formulas are the static inline DDP_HOST_DEVICE helpers at the end of this section, shared with
   the CUDA kernels of ddp_cuda.cu. */

typedef struct ddp_syncbn ddp_syncbn; /* a SyncBatchNorm layer's state (opaque) */

/* ddp_syncbn_create's descriptor. Zero-initialised fields take torch.nn.BatchNorm's defaults. */
typedef struct ddp_syncbn_desc {
    int num_features;   /* C, the number of channels (> 0) */
    double eps;         /* added to the variance; 0 = 1e-5 */
    double momentum;    /* running-stats factor in (0, 1]; 0 = 0.1; < 0 = None: cumulative average
                           with factor 1 / num_batches_tracked. torch's momentum=0 (batch statistics,
                           running stats frozen) has no spelling here: 0 means the default. */
    int channels_last;  /* nonzero: x is (N, spatial..., C) instead of (N, C, spatial...) */
    float *weight;      /* C floats, caller-owned and read at every call; NULL = 1 (no affine) */
    float *bias;        /* C floats, caller-owned; NULL = 0 (no affine) */
    float *running_mean; /* C floats, caller-owned, updated by training forwards; with running_var, */
    float *running_var;  /* both or neither; NULL = track_running_stats=False */
    ddp_group *group;   /* statistics are merged over this (sub)group; NULL = the group given to create */
} ddp_syncbn_desc;

/* ddp_syncbn_create: make a SyncBatchNorm layer.
   Parameters: g: the group whose ranks share batch statistics, or NULL for a plain single-process
               BatchNorm (no communication); errors of this layer are reported in ddp_last_error(g).
               d: the descriptor (copied; the arrays it points to are not). out: receives the layer.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for a bad descriptor (the message names the field);
           DDP_ERR_OUT_OF_MEMORY.
   Thread safety: any thread; no communication. */
DDP_API ddp_result ddp_syncbn_create(ddp_group *g, const ddp_syncbn_desc *d, ddp_syncbn **out);

/* ddp_syncbn_destroy: free the layer (not the caller's arrays). NULL is a no-op. */
DDP_API void ddp_syncbn_destroy(ddp_syncbn *bn);

/* ddp_syncbn_forward: y = BatchNorm(x), like SyncBatchNorm.forward.
   Parameters: x, y: batch * spatial * C floats in the layer's layout (y may be x: in place; both
               may be NULL when batch * spatial is 0). batch >= 0 (ranks may differ, 0 included),
               spatial >= 0 (the product of the spatial sizes; 1 for (N, C) input).
               training: nonzero = batch statistics merged over the group, running stats updated,
               num_batches_tracked += 1; 0 = eval: normalise with the running stats, no communication
               (a layer without running stats uses this rank's own batch statistics, as torch does).
   Collective in training when the layer has a group: every rank of the group calls it, also with an
   empty batch. Saves the mean and invstd used, for ddp_syncbn_backward.
   Counts: the batch statistics need n = the number of values per channel over all ranks of the group.
     n == 1: DDP_ERR_INVALID_ARGUMENT on every rank of the group together, nothing changed. torch's
             BatchNorm (and SyncBatchNorm on one rank) raise "Expected more than 1 value per channel when
             training"; SyncBatchNorm on 2+ ranks does not check (its running_var update then divides
             by n - 1 = 0).
     n == 0: success with nothing to normalise: running stats unchanged, num_batches_tracked += 1, as
             torch's BatchNorm does on an empty batch (torch's SyncBatchNorm has no defined result there).
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT for bad arguments or n == 1; errors of the collective
           (the group is then broken). Thread safety: one thread at a time per layer (and per group). */
DDP_API ddp_result ddp_syncbn_forward(ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                      int training);

/* ddp_syncbn_backward: the gradients of the last ddp_syncbn_forward, like SyncBatchNorm.backward.
   Parameters: x: that forward's input (batch and spatial must be the same); dy: the gradient of y;
               dx: receives the gradient of x (may be dy: in place; NULL = not wanted);
               grad_weight, grad_bias: C floats each that this rank's LOCAL gradients are ADDED to, as
               PyTorch accumulates into .grad (zero them first; the reducer then averages them over
               ranks like any parameter). NULL = not wanted; they are also computed for a layer
               without affine parameters (the gradient with respect to an implicit weight 1, bias 0).
   Collective after a training forward on a layer with a group: every rank calls it (one all_reduce
   of sum_dy and sum_dy_xmu), whatever it passes for dx, also with an empty batch. After an eval
   forward the statistics were constants: dx = dy * invstd * weight, with no communication.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT; DDP_ERR_STATE when no forward preceded it;
           errors of the collective. Thread safety: as ddp_syncbn_forward. */
DDP_API ddp_result ddp_syncbn_backward(ddp_syncbn *bn, const float *x, const float *dy, float *dx, float *grad_weight,
                                       float *grad_bias, int64_t batch, int64_t spatial);

/* The number of training forwards of a layer with running stats, empty batches included (torch's
   num_batches_tracked buffer); 0 for a layer without running stats, or NULL. */
DDP_API int64_t ddp_syncbn_num_batches_tracked(const ddp_syncbn *bn);

/* Restore num_batches_tracked, e.g. from a checkpoint (it sets the cumulative-average factor when
   momentum is None). Return: DDP_SUCCESS, or DDP_ERR_INVALID_ARGUMENT for a negative value. */
DDP_API ddp_result ddp_syncbn_set_num_batches_tracked(ddp_syncbn *bn, int64_t value);

/* The private formulas that the CPU code and the CUDA kernels share are in src/bn_math.h (in ddp.h,
   after the public part, for the implementation and ddp_cuda.cu only). */
/* ==================== end src/syncbn.h ==================== */

/* ==================== begin src/checkpoint.h ==================== */
/* [SECTION] checkpoint: safetensors save/load, resume state, per-rank shards (torch.save / load patterns)
   Mirrors the usual PyTorch DDP checkpoint recipe: `if rank == 0: torch.save(...)`, `dist.barrier()`,
   then `torch.load(..., map_location=...)` on every rank; the file format is safetensors, so Python tools
   (safetensors, or twenty lines of json + numpy) read our files and we read theirs.

   File layout (safetensors): an 8-byte little-endian header length N, N bytes of JSON, then the tensor
   data, raw and little-endian, with no gaps:
       {"__metadata__": {"ddp.step": "1200", "ddp.crc32c.w": "1c291ca3", ...},
        "w": {"dtype": "F32", "shape": [1024, 512], "data_offsets": [0, 2097152]}, ...}
   The header is padded with spaces so the data starts 8-byte aligned. Dtype names: F32 F64 F16 BF16 I8
   U8 I32 I64. Every tensor's CRC32C (Castagnoli, as iSCSI and ext4 use) is kept in the metadata as
   "ddp.crc32c.<name>" (8 lowercase hex digits) and verified on load. Metadata keys starting with
   "ddp.crc32c." or "ddp.shard." are the library's; the rest belong to the caller.
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

typedef struct ddp_resume_state {
    int64_t step;
    int64_t epoch;
    /* how many of this epoch's ddp_sampler_indices() the rank has consumed: resume by skipping that
       many. With another world size, sampler_position * world_size samples of the epoch were seen. */
    int64_t sampler_position;
    int world_size;
    /* set: the rng_state_size bytes at rng_state are stored (none when rng_state_size is 0).
       get: rng_state is a buffer of rng_state_size bytes; on return rng_state_size is the stored size
       (0 when the checkpoint has none). */
    void *rng_state;
    size_t rng_state_size;
} ddp_resume_state;

/* ddp_meta_set_resume: store every field of s under the DDP_META_* keys above.
   ddp_meta_get_resume: read them back; DDP_ERR_FORMAT names a missing or malformed key (the RNG state
   alone is optional); DDP_ERR_INVALID_ARGUMENT when the RNG buffer is too small. */
DDP_API ddp_result ddp_meta_set_resume(ddp_meta *m, const ddp_resume_state *s);
DDP_API ddp_result ddp_meta_get_resume(const ddp_meta *m, ddp_resume_state *s);

/* ---- Save and load -------------------------------------------------------------------------- */

/* Save options; zero-initialised (or NULL) means the defaults. */
typedef struct ddp_checkpoint_save_desc {
    /* > 0: after a successful save, delete the older checkpoints of the same family, keeping the
       keep_last newest (this one included). The family of ".../ckpt_000300.safetensors" is every file
       of that directory whose name differs only in that last run of digits (ckpt_000100.safetensors,
       ckpt_200.safetensors, ...), ordered by the number; path must have such a run of digits.
       Leftover "<name>.tmp" files of older family members (from a crash) are deleted too.
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
    /* 1: accept tensors without a "ddp.crc32c.<name>" checksum (files from other safetensors writers);
       checksums that are present are still verified. 0 (default): a missing checksum is DDP_ERR_FORMAT. */
    int allow_missing_checksums;
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

/* ddp_checkpoint_load: read path into the n tensors t[] and (when meta is not NULL) replace meta's
   contents with the file's metadata (the library's "ddp.crc32c.*"/"ddp.shard.*" keys left out).
   Each t[i] says what the caller expects: name, dtype and shape must match the file exactly, or the
   error names the tensor and both sides. Checksums are verified. Collective over g when g is not NULL
   (see desc->broadcast); a failure on any rank is an error on every rank, naming that rank.
   Return: DDP_SUCCESS; DDP_ERR_IO (cannot open or read); DDP_ERR_FORMAT (not a valid safetensors file,
   or a checksum does not match: the message says what is wrong); DDP_ERR_MISMATCH (names, dtypes or
   shapes differ from t[]); DDP_ERR_UNSUPPORTED (a dtype ddp.h lacks in a tensor you asked for, more
   than 8 dimensions, big-endian host); DDP_ERR_INVALID_ARGUMENT; the group's errors. On an error the
   contents of the tensors and of meta are unspecified.
   Thread safety: as ddp_checkpoint_save. */
DDP_API ddp_result ddp_checkpoint_load(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta);
DDP_API ddp_result ddp_checkpoint_load_ex(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta,
                                          const ddp_checkpoint_load_desc *desc);

/* ---- Per-rank shards (e.g. ZeRO-style optimizer state) ---------------------------------------
   ddp_checkpoint_save_shard: every rank saves its own t[] and meta to "<path>.rank<r>" (r in decimal),
   durably; once every shard is durable, rank 0 writes the completion marker at path itself: a
   safetensors file without tensors whose metadata holds "ddp.shard.world_size" and a random
   "ddp.shard.save_id" that every shard of this save carries too. Before any shard is written, rank 0
   removes an old marker at path, so a save cut short is never taken for a complete one (use distinct
   paths, e.g. a step number with keep_last, to always keep a complete previous checkpoint).
   keep_last: rank 0 deletes old markers, then each rank its own old shards. Collective over g.
   ddp_checkpoint_load_shard: check that the marker exists (else DDP_ERR_IO: the save did not finish,
   or the path is wrong), that it was written by a group of this size (else DDP_ERR_MISMATCH), then
   load this rank's shard as ddp_checkpoint_load does and check that it belongs to that save
   (DDP_ERR_FORMAT if not: a later save to the same path was cut short).
   Return and thread safety: as ddp_checkpoint_save / ddp_checkpoint_load. */
DDP_API ddp_result ddp_checkpoint_save_shard(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                             const ddp_meta *meta, const ddp_checkpoint_save_desc *desc);
DDP_API ddp_result ddp_checkpoint_load_shard(ddp_group *g, const char *path, ddp_tensor *t, int n,
                                             ddp_meta *meta, const ddp_checkpoint_load_desc *desc);

/* ddp_checkpoint_latest: find the newest checkpoint of a family, to resume from. pattern is a path
   whose file name holds one '*' standing for a run of digits ("ckpt/model_*.safetensors"); the file
   (or shard marker) with the largest number wins. A name with any other text in the place of the '*'
   (such as "<name>.tmp" leftovers) never matches. Not collective; rank 0 may call it and broadcast.
   Parameters: out receives the path (capacity bytes, terminator included); number (may be NULL)
   receives its number.
   Return: DDP_SUCCESS with out = "" and *number = -1 when there is none yet; DDP_ERR_INVALID_ARGUMENT
   (no single '*' in the file name, or out too small); DDP_ERR_IO (the directory cannot be read).
   Thread safety: any thread. */
DDP_API ddp_result ddp_checkpoint_latest(const char *pattern, char *out, size_t capacity, int64_t *number);
/* ==================== end src/checkpoint.h ==================== */

/* ==================== begin src/cuda_api.h ==================== */
/* [SECTION] cuda: entry points implemented in ddp_cuda.cu (declared with DDP_CUDA)
   ddp_cuda.cu is compiled by nvcc and linked beside the C program; these declarations need no CUDA
   header: a cudaStream_t travels as void *. Device pointers are marked "device" below. Every call only
   queues work on the stream (kernel launches): nothing waits for the device, so results are ready when
   the stream reaches them. Return: DDP_SUCCESS, DDP_ERR_INVALID_ARGUMENT for bad arguments, or
   DDP_ERR_SYSTEM when CUDA refuses a launch; the message goes to args->err when it is not NULL.
   Thread safety: any thread; calls on one stream run in the order issued. */
#ifdef DDP_CUDA

/* ---- SyncBatchNorm kernels (torch's batch_norm_stats, batch_norm_gather_stats_with_counts,
   batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt) --------------------------
   One training step on the device, around the group's collectives (all on the same stream):
     forward:  ddp_cuda_bn_stats -> all_gather(record, 2C+1 f64) -> ddp_cuda_bn_gather_stats -> ddp_cuda_bn_elemt
     backward: ddp_cuda_bn_backward_reduce -> all_reduce(sums, 2C f64, SUM) -> ddp_cuda_bn_backward_elemt
   Eval: ddp_cuda_bn_eval_stats -> ddp_cuda_bn_elemt; backward: ddp_cuda_bn_backward_reduce (for the
   parameters' gradients) and ddp_cuda_bn_backward_elemt with sums = NULL.
   Data (x, y, dy, dx) is f32, f16 or bf16; statistics, weight, bias and running stats are f32, the
   exchanged records and sums f64, laid out as ddp_syncbn's CPU code lays them out (src/syncbn.h). */

/* What every SyncBatchNorm entry point is told about the batch and the call. */
typedef struct ddp_cuda_bn_args {
    ddp_dtype dtype;          /* of x, y, dy, dx: DDP_F32 (or DDP_DTYPE_DEFAULT), DDP_F16 or DDP_BF16 */
    int64_t batch, spatial;   /* as ddp_syncbn_forward: N and the product of the spatial sizes */
    int channels;             /* C */
    int channels_last;        /* (N, spatial..., C) instead of (N, C, spatial...) */
    void *stream;             /* cudaStream_t; NULL = the legacy default stream */
    char *err;                /* receives a message on failure (NULL = none) */
    size_t err_size;          /* bytes at err */
} ddp_cuda_bn_args;

/* Floats of device scratch the stats and backward calls need for C channels. */
#define DDP_CUDA_BN_WORK_FLOATS(C) ((size_t)(C) * 96u)

/* This rank's statistics: record (device, 2C + 1 doubles) <- [mean(C), M2(C), count].
   x: device, batch * spatial * C values; work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_stats(const ddp_cuda_bn_args *a, const void *x, float *work, double *record);

/* Merge the records of nranks ranks (device, nranks * (2C + 1) doubles, as all_gather leaves them; ranks
   with count 0 drop out) into mean and invstd (device, C floats each) and the global count (device,
   1 double). When running_mean/running_var (device, C floats each; NULL = none) are given and the global
   count is at least 2, they move by `factor` (momentum, or 1 / num_batches_tracked for momentum=None)
   with the unbiased variance. A global count of 1 (an error in ddp_syncbn_forward) leaves them unchanged:
   the caller reads *count when it next synchronises. Uses a->channels, a->stream, a->err only. */
DDP_API ddp_result ddp_cuda_bn_gather_stats(const ddp_cuda_bn_args *a, const double *records, int nranks, double eps,
                                            double factor, float *running_mean, float *running_var, float *mean,
                                            float *invstd, double *count);

/* Eval statistics: mean = running_mean, invstd = 1 / sqrt(running_var + eps) (device, C floats each). */
DDP_API ddp_result ddp_cuda_bn_eval_stats(const ddp_cuda_bn_args *a, const float *running_mean,
                                          const float *running_var, double eps, float *mean, float *invstd);

/* y = (x - mean) * invstd * weight + bias; weight, bias may be NULL (1 and 0). y may be x. */
DDP_API ddp_result ddp_cuda_bn_elemt(const ddp_cuda_bn_args *a, const void *x, void *y, const float *weight,
                                     const float *bias, const float *mean, const float *invstd);

/* sums (device, 2C doubles) <- [sum dy, sum dy (x - mean)] over this rank's batch; grad_weight +=
   sum dy (x - mean) invstd and grad_bias += sum dy (device, C floats each; NULL = not wanted).
   work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_backward_reduce(const ddp_cuda_bn_args *a, const void *dy, const void *x,
                                               const float *mean, const float *invstd, float *work, double *sums,
                                               float *grad_weight, float *grad_bias);

/* dx = (dy - sum_dy / n - (x - mean) invstd^2 sum_dy_xmu / n) * invstd * weight, with sums all-reduced
   over the group and n = *count (device), both from the calls above; sums = NULL: eval, dx = dy * invstd
   * weight. weight may be NULL (1). dx may be dy. work: device, DDP_CUDA_BN_WORK_FLOATS(C) floats. */
DDP_API ddp_result ddp_cuda_bn_backward_elemt(const ddp_cuda_bn_args *a, const void *dy, const void *x, void *dx,
                                              const float *weight, const float *mean, const float *invstd,
                                              const double *sums, const double *count, float *work);

/* ---- Reducer kernels: gradient buckets (torch's Reducer copies and fp16/bf16 compression hooks) and the
   GradScaler's inf/nan check (torch._amp_foreach_non_finite_check_and_unscale_) -------------------------
   One training step of the GPU reducer, per bucket, on the stream that produced the gradients:
       ddp_cuda_bucket_copy_in(grads, bucket, scale = 1 / world_size) -> all_reduce(bucket, SUM)
       -> ddp_cuda_bucket_copy_out(grads, bucket, scale = 1)
   With compression the bucket is DDP_F16 or DDP_BF16 and the copies cast (fp16_compress_hook: cast,
   divide by the world size, all-reduce, cast back; here the division happens in f32 before the single
   rounding to f16, as the CPU reducer does). torch's gradient_predivide_factor p splits the scale:
   copy_in with 1 / p, copy_out with p / world_size. Mixed precision: before the optimizer step,
   ddp_cuda_non_finite_check_and_unscale over every gradient, then read found_inf.
   Multi-tensor: each call takes a list of tensors, described by host arrays that are read before the
   call returns (nothing to keep alive or copy to the device); kernels take up to 48 tensors per launch,
   in a table passed by value as the kernel argument, so a list of n tensors costs ceil(n / 48) launches.
   Arithmetic: f32 (f64 when a side is DDP_F64), rounded to nearest even into the destination dtype
   (through f32 for f16/bf16), exactly as the CPU reducer's copies. */

/* The tensors of a multi-tensor call and the call's settings. Zero-initialised: an empty f32 list. */
typedef struct ddp_cuda_grads_args {
    int count;               /* number of tensors (>= 0) */
    void *const *grads;      /* host array of count device pointers; NULL entries: see each call */
    const int64_t *numels;   /* host array of count element counts (>= 0; 0 = nothing to do) */
    ddp_dtype dtype;         /* of every tensor: DDP_F32 (or DDP_DTYPE_DEFAULT), DDP_F64, DDP_F16 or DDP_BF16 */
    void *stream;            /* cudaStream_t; NULL = the legacy default stream */
    char *err;               /* receives a message on failure (NULL = none) */
    size_t err_size;         /* bytes at err */
} ddp_cuda_grads_args;

/* ddp_cuda_bucket_copy_in: bucket[offsets[i] + j] = grads[i][j] * scale for every tensor i, converted to
   bucket_dtype: the reducer's copy of ready gradients into their bucket, scaled by 1 / world_size (or
   1 / gradient_predivide_factor), and the compression hooks' cast when bucket_dtype is DDP_F16/DDP_BF16.
   Parameters: a: the gradients (a->dtype); a NULL gradient fills its slot with zeros (a parameter
               that got no gradient, as torch's find_unused_parameters). bucket: device, bucket_numel
               elements of bucket_dtype (DDP_F32, DDP_F64, DDP_F16 or DDP_BF16; DDP_DTYPE_DEFAULT: the
               gradients' dtype). offsets: host array of
               count element offsets into the bucket, or NULL: the tensors packed in order from 0.
               Every slot must lie inside the bucket; slots must not overlap, except that a gradient
               may be its own slot (same dtype: gradient_as_bucket_view, scaled in place). scale: finite.
   Return: DDP_SUCCESS; DDP_ERR_INVALID_ARGUMENT (a count, offset or pointer that does not fit; the
           message names it); DDP_ERR_UNSUPPORTED for another dtype; DDP_ERR_SYSTEM when CUDA refuses a
           launch. Queued on a->stream only. */
DDP_API ddp_result ddp_cuda_bucket_copy_in(const ddp_cuda_grads_args *a, void *bucket, ddp_dtype bucket_dtype,
                                           int64_t bucket_numel, const int64_t *offsets, double scale);

/* ddp_cuda_bucket_copy_out: grads[i][j] = bucket[offsets[i] + j] * scale, converted to a->dtype: the
   averaged bucket back into the gradients after the all-reduce (scale 1, or p / world_size with a
   gradient_predivide_factor p), casting back from a compressed bucket. NULL gradients are skipped.
   Parameters and return as ddp_cuda_bucket_copy_in (the bucket is only read). */
DDP_API ddp_result ddp_cuda_bucket_copy_out(const ddp_cuda_grads_args *a, const void *bucket, ddp_dtype bucket_dtype,
                                            int64_t bucket_numel, const int64_t *offsets, double scale);

/* ddp_cuda_non_finite_check_and_unscale: torch._amp_foreach_non_finite_check_and_unscale_(grads,
   found_inf, inv_scale): every element of every gradient is multiplied in place by *inv_scale (left as
   it is when *inv_scale is 1; in f32, or f64 for DDP_F64 gradients), and *found_inf is set to 1.0 when
   some element was an infinity or a NaN. *found_inf is never cleared: zero it before the first call of
   a step, and read it (after synchronising) to decide whether the optimizer step runs.
   Parameters: a: the gradients (NULL entries skipped); found_inf, inv_scale: device, one float each.
   Return: DDP_SUCCESS, DDP_ERR_INVALID_ARGUMENT, DDP_ERR_UNSUPPORTED or DDP_ERR_SYSTEM, as above. */
DDP_API ddp_result ddp_cuda_non_finite_check_and_unscale(const ddp_cuda_grads_args *a, float *found_inf,
                                                         const float *inv_scale);

#endif /* DDP_CUDA */

/* The nccl backend's glue, also in ddp_cuda.cu, is private: src/cuda_glue.h. */
/* ==================== end src/cuda_api.h ==================== */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DDP_H_INCLUDED */

#ifdef __cplusplus
extern "C" {
#endif

/* ==================== begin src/bn_math.h ==================== */
/* [SECTION] bn-math: SyncBatchNorm formulas shared by the CPU code (src/syncbn.c) and the CUDA kernels
   Private (ddp__ names): the implementation (DDP_IMPLEMENTATION) and ddp_cuda.cu, which compiles them
   for the device (it defines DDP__CUDA_GLUE), see them; a user's program does not. Per channel,
   statistics travel as a record per rank of 2C + 1 doubles: [mean(C), M2(C), count], M2 being the sum
   of squared deviations from that rank's mean. */
#if (defined(DDP_IMPLEMENTATION) || defined(DDP__CUDA_GLUE)) && !defined(DDP__BN_MATH_INCLUDED)
#define DDP__BN_MATH_INCLUDED

#ifndef DDP_HOST_DEVICE
#if defined(__CUDACC__)
#define DDP_HOST_DEVICE __host__ __device__
#else
#define DDP_HOST_DEVICE
#endif
#endif

/* Chan et al.'s parallel merge: fold the statistics (nb, mean_b, m2_b) of one set into (n, mean, m2).
   An empty set on either side leaves the other exactly as it was. */
static inline DDP_HOST_DEVICE void ddp__bn_merge(double *n, double *mean, double *m2, double nb, double mean_b,
                                                 double m2_b) {
    double total, delta;
    if (nb <= 0) return;
    if (*n <= 0) {
        *n = nb;
        *mean = mean_b;
        *m2 = m2_b;
        return;
    }
    total = *n + nb;
    delta = mean_b - *mean;
    *mean += delta * (nb / total);
    *m2 += m2_b + delta * delta * (*n * (nb / total));
    *n = total;
}

/* The same in f32, for the CUDA kernels' reductions inside a block. */
static inline DDP_HOST_DEVICE void ddp__bn_merge_f32(float *n, float *mean, float *m2, float nb, float mean_b,
                                                     float m2_b) {
    float total, delta;
    if (nb <= 0) return;
    if (*n <= 0) {
        *n = nb;
        *mean = mean_b;
        *m2 = m2_b;
        return;
    }
    total = *n + nb;
    delta = mean_b - *mean;
    *mean += delta * (nb / total);
    *m2 += m2_b + delta * delta * (*n * (nb / total));
    *n = total;
}

/* Welford's update with one value (the CUDA kernels' per-thread accumulation, as torch's). */
static inline DDP_HOST_DEVICE void ddp__bn_welford_add(float *n, float *mean, float *m2, float x) {
    float delta = x - *mean;
    *n += 1.0f;
    *mean += delta / *n;
    *m2 += delta * (x - *mean);
}

/* Merge channel c of the gathered records of nranks ranks, in rank order, into (n, mean, m2). */
static inline DDP_HOST_DEVICE void ddp__bn_merge_ranks(const double *records, int nranks, int channels, int c,
                                                       double *n, double *mean, double *m2) {
    int r;
    const int64_t stride = 2 * (int64_t)channels + 1;
    *n = 0;
    *mean = 0;
    *m2 = 0;
    for (r = 0; r < nranks; r++) {
        const double *rec = records + r * stride;
        ddp__bn_merge(n, mean, m2, rec[2 * channels], rec[c], rec[channels + c]);
    }
}

/* The running-stats factor of a training forward: momentum, or 1 / num_batches_tracked (already
   incremented) for the cumulative average (momentum < 0, torch's momentum=None). */
static inline DDP_HOST_DEVICE double ddp__bn_factor(double momentum, int64_t num_batches_tracked) {
    return momentum < 0 ? 1.0 / (double)num_batches_tracked : momentum;
}

/* running <- (1 - f) running + f batch, with the unbiased variance M2 / (n - 1) over the global n (>= 2). */
static inline DDP_HOST_DEVICE void ddp__bn_update_running(float *running_mean, float *running_var, double mean,
                                                          double m2, double n, double f) {
    *running_mean = (float)((1.0 - f) * (double)*running_mean + f * mean);
    *running_var = (float)((1.0 - f) * (double)*running_var + f * (m2 / (n - 1.0)));
}

/* y = (x - mean) * scale + shift, with scale = invstd * weight and shift = bias. */
static inline DDP_HOST_DEVICE float ddp__bn_normalize(float x, float mean, float scale, float shift) {
    return (x - mean) * scale + shift;
}

/* Per-channel factors of the input gradient from the all-reduced sums and the global count n:
   mean_dy = sum_dy / n, proj = invstd^2 sum_dy_xmu / n, scale = invstd * weight. */
static inline DDP_HOST_DEVICE void ddp__bn_backward_coeffs(double sum_dy, double sum_dy_xmu, double n, float invstd,
                                                           float weight, float *mean_dy, float *proj,
                                                           float *scale) {
    *mean_dy = (float)(sum_dy / n);
    *proj = (float)((double)invstd * (double)invstd * sum_dy_xmu / n);
    *scale = invstd * weight;
}

/* dx = (dy - mean_dy - (x - mean) * proj) * scale */
static inline DDP_HOST_DEVICE float ddp__bn_grad_input(float dy, float x, float mean, float mean_dy, float proj,
                                                       float scale) {
    return (dy - mean_dy - (x - mean) * proj) * scale;
}

#endif /* DDP__BN_MATH_INCLUDED */
/* ==================== end src/bn_math.h ==================== */

/* ==================== begin src/cuda_glue.h ==================== */
/* [SECTION] cuda-glue: the nccl backend's communicator, implemented in ddp_cuda.cu (with DDP_CUDA)
   torch's ProcessGroupNCCL. Private: ddp.h's implementation (src/nccl.c) calls these when a program
   asks for backend "nccl" (ddp_init), and ddp_cuda.cu (which defines DDP__CUDA_GLUE before including
   ddp.h) defines them; a user's program sees none of it and uses the group's collectives. Unlike the
   other private functions they are not static: ddp_cuda.cu defines them and the linker joins the two.
   Link with -lcudart -lnccl (NCCL >= 2.10: ncclAvg, ncclBfloat16). Every call makes the communicator's
   device current for its duration and restores the caller's. Errors go to err (err_size bytes;
   NULL = none). Thread safety: one thread at a time per communicator. */
#if defined(DDP_CUDA) && (defined(DDP_IMPLEMENTATION) || defined(DDP__CUDA_GLUE)) && !defined(DDP__CUDA_GLUE_INCLUDED)
#define DDP__CUDA_GLUE_INCLUDED

#define DDP__CUDA_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */
typedef struct ddp__cuda_nccl ddp__cuda_nccl;

/* The collectives, numbered as ddp.h numbers them internally. */
typedef enum ddp__cuda_coll {
    DDP__CUDA_ALL_REDUCE = 1,
    DDP__CUDA_BROADCAST,
    DDP__CUDA_REDUCE,
    DDP__CUDA_ALL_GATHER,
    DDP__CUDA_REDUCE_SCATTER,
    DDP__CUDA_BARRIER, /* a 1-element all-reduce, as torch's barrier on NCCL */
    /* data movement, as torch's ProcessGroupNCCL: ncclSend/ncclRecv between ncclGroupStart and
       ncclGroupEnd, the rank's own block a device-to-device copy on the stream */
    DDP__CUDA_GATHER,
    DDP__CUDA_SCATTER,
    DDP__CUDA_ALL_TO_ALL,
    DDP__CUDA_ALL_TO_ALL_V,  /* ddp__cuda_nccl_enqueue_v only */
    DDP__CUDA_ALL_GATHER_V   /* ddp__cuda_nccl_enqueue_v only */
} ddp__cuda_coll;

/* ddp__cuda_nccl_device: choose this rank's GPU and make it the calling thread's current device
   (cudaSetDevice): local_rank when local_rank < the number of visible devices; device 0 when exactly
   one is visible (each rank given its own GPU, e.g. srun --gpus-per-task=1). *device receives it.
   Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED when no device is visible ("no CUDA device visible
   (cudaGetDeviceCount = 0): use the cpu backend") or when local_rank has no device of its own;
   DDP_ERR_SYSTEM when cudaSetDevice fails. */
DDP_API ddp_result ddp__cuda_nccl_device(int local_rank, int *device, char *err, size_t err_size);

/* ddp__cuda_nccl_unique_id: ncclGetUniqueId into id (DDP__CUDA_NCCL_ID_BYTES opaque bytes), made by one rank
   and handed to the others (ddp.h passes it through the store). DDP_ERR_SYSTEM when NCCL fails. */
DDP_API ddp_result ddp__cuda_nccl_unique_id(unsigned char *id, char *err, size_t err_size);

/* ddp__cuda_nccl_create: ncclCommInitRank(nranks, id, rank) on device; collective over the nranks ranks
   that share id (it returns once all have joined). The stream starts as NULL (the legacy default
   stream). Return: DDP_SUCCESS; DDP_ERR_SYSTEM (CUDA or NCCL failed: the message has their text);
   DDP_ERR_OUT_OF_MEMORY; DDP_ERR_INVALID_ARGUMENT. */
DDP_API ddp_result ddp__cuda_nccl_create(const unsigned char *id, int rank, int nranks, int device,
                                        ddp__cuda_nccl **out, char *err, size_t err_size);

/* ddp__cuda_nccl_destroy: ncclCommDestroy (which first completes the communicator's operations), or
   ncclCommAbort when abort is nonzero (after an error: nothing is waited for); frees c. NULL: no-op. */
DDP_API void ddp__cuda_nccl_destroy(ddp__cuda_nccl *c, int abort);

/* The stream (cudaStream_t; NULL = the legacy default stream) that collectives and copies are queued
   on, and the device of c. */
DDP_API void ddp__cuda_nccl_set_stream(ddp__cuda_nccl *c, void *stream);
DDP_API void *ddp__cuda_nccl_stream(const ddp__cuda_nccl *c);
DDP_API int ddp__cuda_nccl_device_of(const ddp__cuda_nccl *c);

/* ddp__cuda_is_device_pointer: 1 when p is memory a GPU kernel can use as device memory (cudaMalloc'd,
   or managed), 0 for host memory (pageable or pinned), NULL, or when CUDA cannot tell. */
DDP_API int ddp__cuda_is_device_pointer(const void *p);

/* ddp__cuda_nccl_enqueue: queue one collective on c's stream, then record a CUDA event after it.
   send/recv as ddp.h's collectives (all_reduce, broadcast, reduce: recv is the in-place buffer and send
   is ignored; all_gather / reduce_scatter: count per rank, send may be recv's own slice or recv
   itself; gather / scatter / all_to_all: count per rank, the root's big buffer NULL elsewhere, in place
   as ddp.h allows it). op AVG is ncclAvg. *event receives the event, for ddp__cuda_nccl_wait / _test (exactly one
   ddp__cuda_nccl_wait per event releases it). Return: DDP_SUCCESS; DDP_ERR_UNSUPPORTED (dtype or op);
   DDP_ERR_SYSTEM when NCCL or CUDA refuses (the communicator is then aborted); DDP_ERR_STATE when an
   earlier error aborted it. */
DDP_API ddp_result ddp__cuda_nccl_enqueue(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send, void *recv,
                                         size_t count, ddp_dtype dtype, ddp_op op, int root, void **event,
                                         char *err, size_t err_size);

/* ddp__cuda_nccl_enqueue_v: as ddp__cuda_nccl_enqueue for the calls with a size per rank (kind
   DDP__CUDA_ALL_TO_ALL_V or DDP__CUDA_ALL_GATHER_V), counts in elements, nranks entries each, blocks
   packed in rank order (the displacements are the sums of the counts before). all_to_all_v: send_counts[p]
   elements go to rank p, recv_counts[p] come from it (the ranks' counts were checked to match before:
   NCCL would hang or corrupt memory on a difference). all_gather_v: send_counts is ignored, recv_counts
   are every rank's counts (this rank sends recv_counts[rank] elements; send may be its own block of
   recv). Zero counts move nothing. Return: as ddp__cuda_nccl_enqueue; DDP_ERR_INVALID_ARGUMENT for
   another kind or a NULL count array. */
DDP_API ddp_result ddp__cuda_nccl_enqueue_v(ddp__cuda_nccl *c, ddp__cuda_coll kind, const void *send,
                                           const size_t *send_counts, void *recv, const size_t *recv_counts,
                                           ddp_dtype dtype, void **event, char *err, size_t err_size);

/* ddp__cuda_nccl_copy: bytes from src to dst (device or host memory, either side) queued on c's stream.
   When either side is host memory, *event receives an event to wait for before the host memory is
   used again (else *event = NULL). Return: DDP_SUCCESS or DDP_ERR_SYSTEM. */
DDP_API ddp_result ddp__cuda_nccl_copy(ddp__cuda_nccl *c, void *dst, const void *src, size_t bytes, void **event,
                                      char *err, size_t err_size);

/* Device memory on c's device: ddp__cuda_nccl_alloc gives bytes of zeroed memory (NULL for 0 bytes);
   ddp__cuda_nccl_zero queues a memset on c's stream; ddp__cuda_nccl_free releases (NULL: no-op; it waits
   for the device, as cudaFree does). */
DDP_API ddp_result ddp__cuda_nccl_alloc(ddp__cuda_nccl *c, size_t bytes, void **out, char *err, size_t err_size);
DDP_API ddp_result ddp__cuda_nccl_zero(ddp__cuda_nccl *c, void *dst, size_t bytes, char *err, size_t err_size);
DDP_API void ddp__cuda_nccl_free(ddp__cuda_nccl *c, void *p);

/* ddp__cuda_nccl_wait: the watchdog (torch's ProcessGroupNCCL watchdog, on the waiting thread). Polls the
   event (cudaEventQuery) until the work before it is complete; meanwhile checks ncclCommGetAsyncError,
   the deadline (timeout seconds after the event was recorded) and, when watch is not NULL,
   watch(user) (ddp.h looks at the other ranks' connections there). On an NCCL error, a CUDA error, the
   deadline or a failed watch, the communicator is aborted (ncclCommAbort), so that no rank hangs.
   what names the operation in messages ("all_reduce(count=4, f32, sum) as collective #7"). Releases
   the event in every case. Return: DDP_SUCCESS; DDP_ERR_TIMEOUT; DDP_ERR_SYSTEM (NCCL or CUDA error);
   watch's error; DDP_ERR_STATE when an earlier error had aborted the communicator. */
DDP_API ddp_result ddp__cuda_nccl_wait(ddp__cuda_nccl *c, void *event, double timeout, const char *what,
                                      ddp_result (*watch)(void *user), void *user, char *err, size_t err_size);

/* ddp__cuda_nccl_test: nonzero when the work before event is complete (or failed: then
   ddp__cuda_nccl_wait returns at once with the error). Does not release the event. */
DDP_API int ddp__cuda_nccl_test(ddp__cuda_nccl *c, void *event);

#endif /* DDP__CUDA_GLUE_INCLUDED */
/* ==================== end src/cuda_glue.h ==================== */

#ifdef __cplusplus
} /* extern "C" */
#endif

#if defined(DDP_IMPLEMENTATION) && !defined(DDP__IMPLEMENTATION_DONE)
#define DDP__IMPLEMENTATION_DONE

/* ==================== begin src/internal.h ==================== */
/* [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces
   Every private name starts with ddp__ and every private function is static: the implementation is
   one translation unit. It compiles as C99 and as C++17, so casts from void * are explicit.

   The layers, bottom up (each piece calls only pieces above it in this list, never a public
   collective below the collectives layer; this file declares every cross-file function and type,
   grouped by the piece that defines it):

       util, dtype              errors, logging, environment, time; element types and reduction
       net, auth, store         sockets with deadlines; DDP_AUTH_TOKEN; the rendezvous key-value store
       link, transport          one layer: connections between ranks made on first use (link), framed
                                messages over them, failure detection, abort (transport); during
                                ddp_init's set-up they ask group.c whether a missing rank is gone
       collectives              the public collectives: validate, fingerprint, dispatch, async work
       backends                 each fills a ddp__backend table, the only way calls reach it:
         tcp                      ring, recursive-doubling, tree algorithms between ranks (also set-up)
         alloc                    ddp_alloc: library buffers in the shared segment's arenas
         shm                      shared memory among the ranks of one host
         hier                     hierarchical all_reduce for groups that span hosts
         mpi, nccl                MPI and NCCL libraries
       group                    ddp_init, rendezvous, the table of ranks, which backend a group gets, subgroups
       launcher                 ddp_spawn, ddprun
       reducer, sampler, syncbn, safetensors, checkpoint    built on the public API

   A new collective is one ddp__coll_kind, one public function (collectives.c) and one case in each
   backend's run function. */
/* A piece compiled on its own (`cc -std=c99 -fsyntax-only -Isrc src/X.c`, as CI checks every piece) sees
   what it sees inside ddp.h: the whole public part, as the implementation. In ddp.h these lines are
   inert (DDP_IMPLEMENTATION is defined there, and amalgamate.py drops the local includes). */
#ifndef DDP_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif

#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ddp.h may come after system headers (as any stb-style header may), and glibc fixes its feature set at
   the first one it reads: then _GNU_SOURCE (ddp_api.h) comes too late, and under -std=c99 (no
   _DEFAULT_SOURCE; POSIX 1995 from -pthread) the headers hide the GNU, BSD and later POSIX names below.
   Each group mirrors the condition under which glibc declares it, so the declarations here are exactly
   glibc's (same prototypes; off_t calls bound to their 64-bit symbols under _FILE_OFFSET_BITS=64, as
   glibc's own __REDIRECT does), and none of it is seen when ddp.h comes first or in C++ (g++ and clang++
   always define _GNU_SOURCE). launcher.c (sched.h) and shm.c (sys/uio.h) add their own. */
#if defined(__GLIBC__) && !defined(__USE_POSIX199506) /* no sigaction, kill, clock_gettime: too much to stand in for */
#error "ddp.h: the system headers before ddp.h were read without POSIX (-std=c99 without -pthread): compile with -pthread (as ddp.h needs), or in a POSIX or GNU mode (-std=gnu99), or include ddp.h first"
#include <ddp.h: see the error above> /* a missing header stops the compiler: no cascade of errors after the one above */
#endif
#if defined(__GLIBC__) && defined(__USE_FILE_OFFSET64)
#define DDP__OFF64(name) __asm__(#name "64")
#else
#define DDP__OFF64(name)
#endif
#if defined(__GLIBC__) && !defined(__USE_GNU)
#include <linux/falloc.h> /* FALLOC_FL_*, which <fcntl.h> includes only with _GNU_SOURCE */
extern int pipe2(int pipedes[2], int flags);
extern int fallocate(int fd, int mode, off_t offset, off_t len) DDP__OFF64(fallocate);
#ifndef POLLRDHUP
#define POLLRDHUP 0x2000 /* Linux's value (asm-generic/poll.h) */
#endif
#endif
#if defined(__GLIBC__) && !defined(__USE_MISC)
extern long int syscall(long int sysno, ...);
extern int madvise(void *addr, size_t len, int advice);
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14 /* asm-generic/mman-common.h */
#endif
#ifndef MADV_DONTDUMP
#define MADV_DONTDUMP 16
#endif
#ifndef WCOREDUMP
#define WCOREDUMP(status) ((status) & 0x80)
#endif
#endif
#if defined(__GLIBC__) && !defined(__USE_MISC) && !defined(__USE_UNIX98)
extern int gethostname(char *name, size_t len);
#endif
#if defined(__GLIBC__) && !defined(__USE_UNIX98) && !defined(__USE_XOPEN2K8)
extern ssize_t pread(int fd, void *buf, size_t nbytes, off_t offset) DDP__OFF64(pread);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN_EXTENDED) && !defined(__USE_XOPEN2K)
extern ssize_t readlink(const char *restrict path, char *restrict buf, size_t len);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN_EXTENDED) && !defined(__USE_MISC)
#define SA_RESTART 0x10000000 /* Linux's value (bits/sigaction.h) */
#endif
#if defined(__GLIBC__) && !defined(__USE_MISC) && !defined(__USE_XOPEN2K8)
extern char *mkdtemp(char *template_);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8)
#ifndef O_CLOEXEC
#define O_CLOEXEC __O_CLOEXEC
#endif
#ifndef O_DIRECTORY
#define O_DIRECTORY __O_DIRECTORY
#endif
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K)
extern int setenv(const char *name, const char *value, int replace);
extern int pthread_getcpuclockid(pthread_t thread_id, clockid_t *clock_id);
extern int posix_fallocate(int fd, off_t offset, off_t len) DDP__OFF64(posix_fallocate);
struct addrinfo {
    int ai_flags;
    int ai_family;
    int ai_socktype;
    int ai_protocol;
    socklen_t ai_addrlen;
    struct sockaddr *ai_addr;
    char *ai_canonname;
    struct addrinfo *ai_next;
};
#define AI_PASSIVE 0x0001
#define AI_CANONNAME 0x0002
#define AI_NUMERICHOST 0x0004
#define AI_V4MAPPED 0x0008
#define AI_ALL 0x0010
#define AI_ADDRCONFIG 0x0020
#define AI_NUMERICSERV 0x0400
#define NI_NUMERICHOST 1
#define NI_NUMERICSERV 2
#define NI_NOFQDN 4
#define NI_NAMEREQD 8
#define NI_DGRAM 16
extern int getaddrinfo(const char *restrict name, const char *restrict service, const struct addrinfo *restrict req,
                       struct addrinfo **restrict pai);
extern void freeaddrinfo(struct addrinfo *ai);
extern const char *gai_strerror(int ecode);
extern int getnameinfo(const struct sockaddr *restrict sa, socklen_t salen, char *restrict host, socklen_t hostlen,
                       char *restrict serv, socklen_t servlen, int flags);
#endif

#if defined(DDP_MALLOC) && defined(DDP_REALLOC) && defined(DDP_FREE)
/* all three given */
#elif !defined(DDP_MALLOC) && !defined(DDP_REALLOC) && !defined(DDP_FREE)
#define DDP_MALLOC(sz) malloc(sz)
#define DDP_REALLOC(p, sz) realloc(p, sz)
#define DDP_FREE(p) free(p)
#else
#error "ddp.h: define all of DDP_MALLOC, DDP_REALLOC and DDP_FREE, or none of them"
#endif

#ifndef DDP_ASSERT
#define DDP_ASSERT(x) assert(x)
#endif

#ifdef __cplusplus
#define DDP__THREAD_LOCAL thread_local
#else
#define DDP__THREAD_LOCAL __thread
#endif

#if defined(__GNUC__) || defined(__clang__)
#define DDP__PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#define DDP__UNUSED __attribute__((unused))
#else
#define DDP__PRINTF(fmt_index, first_arg)
#define DDP__UNUSED
#endif

#define DDP__ERR_MAX 1024 /* bytes of an error message, terminator included */
#define DDP__MIN(a, b) ((a) < (b) ? (a) : (b))
#define DDP__MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- util.c: errors, logging, environment, time, memory ---- */
/* Format a message into buf (DDP__ERR_MAX bytes) and return code: `return ddp__fail_to(...)`. */
static DDP__UNUSED ddp_result ddp__fail_to(char *buf, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
/* The same, into g's last-error message (this thread's when g is NULL). */
static DDP__UNUSED ddp_result ddp__fail(ddp_group *g, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
static DDP__UNUSED char *ddp__error_buffer(ddp_group *g); /* where ddp__fail(g, ...) writes */
static DDP__UNUSED void ddp__note_thread_error(const char *msg); /* copy msg to this thread's last error */
static DDP__UNUSED void ddp__log(const ddp_group *g, ddp_log_level level, const char *fmt, ...) DDP__PRINTF(3, 4);
static DDP__UNUSED ddp_log_level ddp__env_log_level(void);
/* Parse an environment variable as an integer in [lo, hi]. Returns 0 when unset (value untouched),
   1 when set and valid, -1 when set but malformed (message in err). */
static DDP__UNUSED int ddp__env_int(const char *name, long lo, long hi, long *value, char *err);
static DDP__UNUSED const char *ddp__env(const char *name); /* NULL when unset or empty */
static DDP__UNUSED double ddp__now(void);                  /* monotonic seconds */
static DDP__UNUSED void *ddp__malloc(size_t size);         /* NULL on failure; size 0 allowed */
static DDP__UNUSED void *ddp__calloc(size_t n, size_t size);
static DDP__UNUSED void ddp__free(void *p);
static DDP__UNUSED char *ddp__strdup(const char *s);
static DDP__UNUSED void ddp__sleep(double seconds);
static DDP__UNUSED uint64_t ddp__hash(const char *s); /* FNV-1a of a string */
/* An error code that came from another process (an ABORT frame, the store): itself when it is one of
   ddp_result's errors, else fallback -- a corrupt or hostile 0 must never read as success. */
static DDP__UNUSED ddp_result ddp__peer_code(long code, ddp_result fallback);
/* Open files (RLIMIT_NOFILE): ddp_init calls ddp__fd_prepare before it connects (raises the soft limit to
   the hard one, notes the group's size); where a call fails with EMFILE or ENFILE
   (ddp__out_of_descriptors), ddp__fail_descriptors writes "<what>: too many open files: ..." naming the
   limit, the group's need (ddp__fd_need) and `ulimit -n`, and returns DDP_ERR_SYSTEM. */
static DDP__UNUSED long ddp__fd_need(int world, int rank);
static DDP__UNUSED int ddp__out_of_descriptors(int errnum);
/* The largest world size this process has started to join (0: none yet), for limits that grow with it. */
static DDP__UNUSED int ddp__largest_world(void);
static DDP__UNUSED ddp_result ddp__fail_descriptors(char *err, int errnum, const char *what);
static DDP__UNUSED void ddp__fd_prepare(ddp_group *g, int world, int rank);
/* More ranks on this host than CPUs online: waits should block rather than spin (shm.c, transport.c). */
static DDP__UNUSED int ddp__oversubscribed(int ranks_here);

/* ---- registry.c: the live groups and work handles (a call on a freed one is an error, not a crash) ---- */
#define DDP__LIVE_GROUP 1
#define DDP__LIVE_WORK 2
static DDP__UNUSED int ddp__live_add(const void *p, int kind); /* 0 when out of memory */
static DDP__UNUSED int ddp__live_has(const void *p, int kind);
static DDP__UNUSED int ddp__live_take(const void *p, int kind); /* remove; 1 when it was there */
static DDP__UNUSED void ddp__live_remove(const void *p, int kind);
/* DDP_SUCCESS when g is a live group; else fails (this thread's error) naming fn: a NULL group is
   DDP_ERR_INVALID_ARGUMENT, a destroyed (or never made) one DDP_ERR_STATE. */
static DDP__UNUSED ddp_result ddp__group_check(const ddp_group *g, const char *fn);

/* ---- dtype.c ---- */
static DDP__UNUSED int ddp__dtype_valid(ddp_dtype t);
static DDP__UNUSED int ddp__op_valid(ddp_op op);
static DDP__UNUSED int ddp__dtype_is_float(ddp_dtype t);
/* dst[i] = dst[i] (op) src[i] for i < count; AVG reduces as SUM (the caller divides once at the end). */
static DDP__UNUSED void ddp__reduce(void *dst, const void *src, size_t count, ddp_dtype t, ddp_op op);
/* buf[i] /= n, the final step of AVG (truncating toward zero on integers). */
static DDP__UNUSED void ddp__divide(void *buf, size_t count, ddp_dtype t, int n);

/* ---- net.c: TCP with deadlines (absolute ddp__now() seconds); messages go to err ---- */
static DDP__UNUSED ddp_result ddp__net_listen(const char *host, int port, int *fd, int *bound_port, char *err);
static DDP__UNUSED ddp_result ddp__net_connect(const char *host, int port, double deadline, int *fd, char *err);
/* Has fd sent bytes that the peer's kernel has not acknowledged (TIOCOUTQ)? */
static DDP__UNUSED int ddp__net_unacked(int fd);
/* Start a connect without waiting (poll the fd for POLLOUT, then SO_ERROR); *refused: refused at once. */
static DDP__UNUSED ddp_result ddp__net_connect_start(const char *host, int port, int *fd_out, int *refused, char *err);
static DDP__UNUSED ddp_result ddp__net_connect_once(const char *host, int port, double deadline, int *fd, int *refused, char *err);
static DDP__UNUSED ddp_result ddp__net_accept(int listen_fd, double deadline, int *fd, char *err);
static DDP__UNUSED ddp_result ddp__net_send(int fd, const void *buf, size_t n, double deadline, char *err);
static DDP__UNUSED ddp_result ddp__net_recv(int fd, void *buf, size_t n, double deadline, char *err);
static DDP__UNUSED ddp_result ddp__net_poll(int fd, short events, double deadline, char *err);
static DDP__UNUSED void ddp__net_local_address(int fd, char *host, size_t cap);
static DDP__UNUSED void ddp__net_configure(int fd); /* non-blocking, close-on-exec, TCP_NODELAY */

/* ---- store.c: the rendezvous key-value store (c10d TCPStore protocols of torch 1.13 and 2.x; file store) ---- */
typedef struct ddp__store_server ddp__store_server;
/* Start serving on host:port (host as MASTER_ADDR; NULL = all interfaces; port 0 = any free port) on a
   background thread. Errors (port in use, address not on this host) come from ddp__net_listen with clear
   messages. lvl DDP_LOG_DEFAULT means DDP_LOG_LEVEL from the environment. */
static DDP__UNUSED ddp_result ddp__store_server_start(const char *host, int port, ddp_log_level lvl,
                                                      ddp__store_server **out, char *err);
static DDP__UNUSED int ddp__store_server_port(const ddp__store_server *s); /* the port it listens on */
typedef struct ddp__server_stats {
    uint64_t requests, connections; /* requests handled and clients accepted since it started */
    double cpu_seconds;             /* CPU time of the server's thread; -1 when it cannot be read */
} ddp__server_stats;
/* A snapshot, safe from any thread while the server runs (for benchmarks and tests: bench/bench_scale.c,
   test_init's requests per rank). */
static DDP__UNUSED void ddp__store_server_stats(const ddp__store_server *s, ddp__server_stats *out);
/* While ddp_init connects a group through this server: that group's rendezvous keys, "abort", "table"
   and "ready" (group.c; all NULL when done). A server that cannot accept a client for lack of
   descriptors publishes the abort itself as ddp__rdzv_abort does: under the abort key, as the table's
   value behind DDP__RDZV_ABORTED (unless the table is there), then the ready key, which every rank
   waiting for the table watches. */
#define DDP__RDZV_ABORTED "abort:" /* a rendezvous table that holds "code|message" instead of records */
static DDP__UNUSED void ddp__store_server_abort_key(ddp__store_server *s, const char *abort_key, const char *table_key,
                                                    const char *ready_key);
/* Joins the thread and closes everything. A request still on its way is lost (its client sees
   DDP_ERR_PEER_LOST), so stop only once every client's last call has been answered: e.g. each rank's last
   call is an add that rank 0 counts (a barrier's final WAIT is not enough). NULL is a no-op. */
static DDP__UNUSED void ddp__store_server_stop(ddp__store_server *s);
/* Connect a client (prefix may be NULL or "" for none), retrying until timeout seconds pass. Every key goes
   on the wire as prefix + key. torch's TCPStore client puts "/" before each key, and PrefixStore(P) puts
   P + "/" before that: to share keys with torch processes pass the prefix ddp__store_torch_prefix makes. */
static DDP__UNUSED ddp_result ddp__store_connect(const char *host, int port, const char *prefix, double timeout,
                                                 ddp_store **out, char *err);
/* The key prefix that torch 1.13's TCPStore wrapped in PrefixStore(prefix_store) uses ("/" alone when
   prefix_store is NULL or ""); "/worker/attempt_0" gives "//worker/attempt_0/". 0, or -1 if cap is short. */
static DDP__UNUSED int ddp__store_torch_prefix(const char *prefix_store, char *buf, size_t cap);
/* Open (creating it if needed) the file store at path, like torch's FileStore: every opener counts itself in
   the file, and the last one to close it deletes the file. */
static DDP__UNUSED ddp_result ddp__store_open_file(const char *path, double timeout, ddp_store **out, char *err);
static DDP__UNUSED void ddp__store_free(ddp_store *s); /* closes the connection or the file; NULL is a no-op */
static DDP__UNUSED void ddp__store_set_timeout(ddp_store *s, double timeout);
/* torch's compare_set: when key holds expected (or is missing and expected_size is 0) it becomes desired.
   Copies at most capacity bytes of the value the key holds afterwards to current; *size = its full size.
   (When the key is missing and expected_size > 0, torch answers with expected: so does this.) */
static DDP__UNUSED ddp_result ddp__store_compare_set(ddp_store *s, const char *key, const void *expected,
                                                     size_t expected_size, const void *desired, size_t desired_size,
                                                     void *current, size_t capacity, size_t *size);
static DDP__UNUSED ddp_result ddp__store_num_keys(ddp_store *s, int64_t *n); /* keys in the whole store */

/* ---- auth.c: DDP_AUTH_TOKEN, an HMAC-SHA256 challenge in both directions on every connection ---- */
#define DDP__AUTH_MAGIC "DDPAUTH1" /* the client's first 8 bytes */
#define DDP__AUTH_REQUIRED "DDPAUTH?" /* a server's 8 bytes before it hangs up on a client that did not authenticate */
#define DDP__AUTH_NONCE 16
#define DDP__AUTH_MAC 32
static DDP__UNUSED const char *ddp__auth_token(void); /* NULL when unset */
/* Prove the token to the server at fd and check its proof (who names it in messages). */
static DDP__UNUSED ddp_result ddp__auth_client(int fd, const char *token, const char *who, double deadline, char *err);
/* The server's half: 0 when the client proved the token, else -1 with the reason in err. */
static DDP__UNUSED int ddp__auth_server(int fd, const char *token, double deadline, char *err);
/* The server's half in two non-blocking steps (the store's event loop): answer the client's hello
   (8 + NONCE bytes) with reply (NONCE + MAC bytes; -1 for a bad hello), then check its proof (1: right). */
static DDP__UNUSED int ddp__auth_answer(const char *token, const unsigned char *hello, unsigned char *cn, unsigned char *sn,
                                        unsigned char *reply);
static DDP__UNUSED int ddp__auth_check(const char *token, const unsigned char *cn, const unsigned char *sn,
                                       const unsigned char *proof);
/* The pieces of the client's half, for a handshake moved on by a poll loop (link.c): a fresh nonce, the
   proof one side gives (label "client" or "server"), and a comparison that takes the same time anywhere. */
static DDP__UNUSED void ddp__auth_nonce(unsigned char out[DDP__AUTH_NONCE]);
static DDP__UNUSED void ddp__auth_proof(const char *token, const char *label, const unsigned char *cn, const unsigned char *sn,
                                        unsigned char out[DDP__AUTH_MAC]);
static DDP__UNUSED int ddp__auth_equal(const unsigned char *a, const unsigned char *b, size_t n);

/* ==== the group: the types every layer above the store shares ==== */

/* The collectives. A fingerprint (ddp__coll) names one call: equal on every rank when the program is
   correct, and carried in every message, so a difference is an error (transport.c). */
typedef enum ddp__coll_kind {
    DDP__ALL_REDUCE = 1,
    DDP__BROADCAST,
    DDP__REDUCE,
    DDP__ALL_GATHER,
    DDP__REDUCE_SCATTER,
    DDP__BARRIER,
    DDP__GATHER,
    DDP__SCATTER,
    DDP__ALL_TO_ALL,
    DDP__ALL_TO_ALL_V,
    DDP__ALL_GATHER_V,
    DDP__BROADCAST_BYTES,
    DDP__MONITORED_BARRIER,
    DDP__SEND, /* point-to-point (collectives.c, transport.c): no collective number, two ranks */
    DDP__RECV,
    DDP__COLL_KINDS
} ddp__coll_kind;
#define DDP__NO_OP 0xff

typedef struct ddp__coll {
    uint64_t seq;   /* the group's collective number: 1 for its first (its own set-up included), never restarts */
    uint64_t count; /* the call's count (per rank for all_gather / reduce_scatter / gather / scatter / all_to_all;
                       the sum of the counts for all_gather_v; 0 for all_to_all_v, broadcast_bytes and
                       monitored_barrier, whose sizes are checked frame by frame) */
    uint8_t kind;   /* ddp__coll_kind */
    uint8_t dtype;
    uint8_t op;     /* DDP__NO_OP when the collective takes none */
    int32_t root;   /* -1 when the collective has none; send / recv: the peer */
    int32_t tag;    /* send / recv: the message's tag; -1 for the collectives */
} ddp__coll;

/* One call's arguments, for the synchronous path and the async queue alike. */
typedef struct ddp__call {
    ddp__coll_kind kind;
    const void *send;
    void *buf; /* in-place buffer, or recv */
    size_t count;
    ddp_dtype dtype;
    ddp_op op;
    int root;
    const size_t *send_counts; /* all_to_all_v: world entries */
    const size_t *recv_counts; /* all_to_all_v, all_gather_v: world entries */
    void **bytes;              /* broadcast_bytes: the root's data in, the receivers' new buffer out */
    size_t *bytes_size;        /* broadcast_bytes: its size */
    double seconds;            /* monitored_barrier: how long rank 0 waits for the others */
    int tag;                   /* send / recv (root is the peer) */
} ddp__call;

/* A backend: the only way a call reaches a transport. Each backend file fills one table (its set-up
   installs it in g->backend); collectives.c dispatches every call through it and knows no backend.
     run          run call k (fingerprint c, already validated) to completion on the calling thread;
                  a failure breaks the group (ddp__coll_fail) and returns its code
     enqueue      optional: take an async call now, on the calling thread (nccl queues device work on
                  its stream); returns 0 to leave it to the progress thread, which calls run
     wait, test   for the work that enqueue took (ddp_work.owner)
     close        release the backend's state (orderly: in ddp_destroy, every rank there); idempotent
   and what the reducer asks of a backend's memory (reducer.c), buffers in the backend's memory
   (host for cpu and mpi, device for nccl): alloc (zeroed; NULL when out of memory), release, zero,
   copy_in_scaled (dst = src * scale, converted from src_t to dst_t in f32 (f64 for f64), rounded
   once; dst may equal src when the dtypes do) and copy_out (dst = src converted; it also moves the
   reducer's used map between host memory and the backend's). */
typedef struct ddp__backend {
    const char *name;   /* the transport, for messages: "tcp", "shm", "hier", "mpi", "nccl", "alone" */
    const char *family; /* ddp_backend_name(): "cpu", "mpi" or "nccl" */
    ddp_result (*run)(ddp_group *g, const ddp__call *k, const ddp__coll *c);
    int (*enqueue)(ddp_group *g, const ddp__call *k, ddp_work **out, ddp_result *res);
    ddp_result (*wait)(ddp_work *w);
    int (*test)(ddp_work *w);
    void (*close)(ddp_group *g, int orderly);
    void *(*alloc)(ddp_group *g, size_t bytes);
    void (*release)(ddp_group *g, void *p);
    void (*zero)(ddp_group *g, void *dst, size_t bytes);
    void (*copy_in_scaled)(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count,
                           double scale);
    void (*copy_out)(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count);
} ddp__backend;

/* One TCP connection to another member of the group (made on first use: link.c). */
typedef struct ddp__peer {
    int fd;   /* -1: none yet (and for this rank itself) */
    int gone; /* the connection was seen closed */
    int awaits_dial;     /* link.c: both dialed at once and the peer's dial wins: wait for it, do not dial again */
    uint64_t send_owed;  /* bytes of a frame interrupted mid-send (padded before an ABORT) */
    uint64_t quiet_seq;  /* transport.c: in collective #quiet_seq, the peer's waiting frame was looked at and is fine */
    int peek_later;      /* transport.c: only part of a frame header was there; look again shortly */
    double refused_since; /* link.c: its port has refused connections since then (0: not refusing) */
    double dial_after;    /* link.c: after a refusal, the next dial waits until then */
} ddp__peer;

/* A receive waiting for its message (transport.c's matching): ddp_recv's on its stack, ddp_irecv's with
   its ddp_work. done and result are written under mesh.p2p_mu. */
typedef struct ddp__posted {
    struct ddp__posted *next;
    int src, tag;
    void *buf;
    size_t bytes;
    uint64_t count;
    uint8_t dtype;
    int done;
    ddp_result result;
} ddp__posted;

/* Where a rank listens and who it is, from the rendezvous table; strings live in the mesh's name pool. */
typedef struct ddp__peer_info {
    int port, pid;
    uint32_t addr, host;      /* offsets into ddp__mesh.names */
    unsigned long long node;  /* ddp__node_key() of its process (group.c) */
} ddp__peer_info;

/* A connection being made, by either side (link.c): the dialer's or the accepting side's handshake. */
typedef struct ddp__shake {
    int fd, step;
    int rank;     /* the peer: known from the start when dialing, from its hello when accepting (-1 before) */
    int dialing;  /* this rank dialed it */
    size_t have, need;
    double deadline;
    unsigned char buf[64];
    unsigned char cn[DDP__AUTH_NONCE], sn[DDP__AUTH_NONCE];
} ddp__shake;
#define DDP__WATCH_PERIOD 0.25 /* while waiting on a rank inside ddp_init, look for why it might be gone this often */
#define DDP__PENDING_MAX 64 /* accepted connections waiting to identify themselves at once; the oldest goes first */
#define DDP__SHAKES_MAX (DDP__PENDING_MAX + 8)

/* The links of a group: its listening socket, the table of where every rank listens, the connections
   made so far (group.c fills the table and opens the listener; link.c makes connections on first use;
   transport.c moves frames on them). */
typedef struct ddp__mesh {
    ddp__peer *peers;        /* world_size entries, indexed by rank in this group */
    ddp__peer_info *dir;     /* world_size entries: the rendezvous table (NULL before it) */
    char *names;             /* the table's addresses and host names, each once per run of equal ones */
    size_t names_len, names_cap;
    int *linked;             /* the ranks this one has a connection with, in the order they were made */
    int nlinked;
    int listen_fd;           /* peers dial this; open for the group's life (-1: none) */
    ddp__shake *shakes;      /* DDP__SHAKES_MAX: connections being made */
    int nshakes;
    int in_setup;            /* ddp_init's own set-up runs: a rank lost on the way is looked for in the store too */
    struct pollfd *pollfds;  /* world_size + DDP__SHAKES_MAX + 1 entries: what one exchange step waits on */
    int *poll_owner;         /* the rank of each pollfds entry (link.c's own entries: below -1) */
    int waiting_for;         /* the rank this one waits for in the current step, -1 if none (for messages) */
    struct ddp__p2p_msg *stash, *stash_tail; /* point-to-point messages that arrived before their recv */
    struct ddp__posted *posted; /* receives waiting for their message, in the order posted */
    pthread_mutex_t p2p_mu;     /* guards stash and posted: ddp_irecv posts while the progress thread reads */
    uint64_t p2p_calls;      /* sends and recvs so far: each runs under its own number, counted down from
                                UINT64_MAX (no collective's), so that peers seen quiet in one are looked at again */
} ddp__mesh;

/* Membership: the store, this group's keys in it, its place among groups (group.c). */
typedef struct ddp__membership {
    ddp_store *store;        /* shared with subgroups; the world group owns it (NULL when alone) */
    int owns_store;
    struct ddp__store_server *store_server; /* rank 0 of the world group serves the store */
    char address[128];       /* this host's address that peers connect to */
    char prefix[96];         /* this group's store keys start with it */
    ddp_group *parent;       /* NULL for the world group (and hier.c's stage groups) */
    ddp_group *subgroups;    /* ddp_new_group's subgroups not yet destroyed, in the order made */
    ddp_group *next_sibling; /* the next of the parent's subgroups */
    uint64_t subgroups_made; /* names the next subgroup's key prefix */
} ddp__membership;

/* Async work: a FIFO run by one progress thread (collectives.c). */
typedef struct ddp__async {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ddp_work *head, *tail;
    ddp_work *issued; /* every handle returned and not yet waited on (freed with the group) */
    int running, stop;
    pthread_t thread;
} ddp__async;

/* ddp_alloc's bookkeeping (alloc.c). Blocks in this rank's arena of the shared segment are listed in
   arena; the rest (no shared memory, arena full) are heap blocks listed here. lock guards both lists:
   a spin lock (0 = free), so a zero-filled group needs no set-up. */
typedef struct ddp__block { /* one extent of this rank's arena; the list is sorted and covers [0, top) */
    size_t off, size;
    int state; /* 0 free, 1 in use, 2 being freed */
} ddp__block;
typedef struct ddp__arena {
    char *base;      /* every rank's arena, world_size of them, each `bytes` long (mapped by every rank) */
    size_t bytes;
    int fd;          /* the segment, kept open: blocks' pages are reserved with fallocate */
    off_t file_off;  /* where the first arena starts in the segment */
    ddp__block *blocks; /* this rank's arena */
    size_t nblocks, cap, top;
} ddp__arena;
typedef struct ddp__heap_block { /* a ddp_alloc block on the heap */
    void *user, *raw;
} ddp__heap_block;
typedef struct ddp__lib {
    int lock;
    ddp__arena *arena; /* in the shared segment (shm.c sets it); NULL: plain memory only */
    ddp__heap_block *heap;
    size_t heap_n, heap_cap;
} ddp__lib;

/* hier.c: the stage groups of a group that spans hosts with several ranks on a host. */
typedef struct ddp__hier {
    ddp_group *host;    /* the ranks of this host (NULL if only this one) */
    ddp_group *leaders; /* the first rank of every host, on those ranks (else NULL) */
} ddp__hier;

typedef struct ddp__shm ddp__shm;
struct ddp__mpi;
struct ddp__nccl;

struct ddp_group {
    int rank, world_size;             /* this process in this group */
    int local_rank, local_world_size; /* among this group's ranks on this host */
    int *world_ranks;                 /* world_ranks[i]: member i's rank in the world group */
    double timeout;                   /* seconds a blocked operation waits */
    ddp_log_level log_level;
    ddp_log_fn log_fn;
    void *log_user;
    char error[DDP__ERR_MAX]; /* ddp_last_error(g) */

    const ddp__backend *backend;      /* where every collective goes */
    const ddp__backend *host_backend; /* where calls on host memory go: backend itself, except under nccl */
    uint64_t seq;        /* collectives issued so far (set-up included); carried in every message */
    uint64_t seq_base;   /* seq when ddp_init (or ddp_new_group) returned: messages number calls from it */
    uint64_t running_seq; /* seq of the collective running now (0 between collectives) */
    ddp_result broken;   /* set once a collective failed: every later call fails with it */
    char broken_msg[DDP__ERR_MAX];
    void *scratch;       /* staging memory for the algorithms, grown on demand (one call runs at a time) */
    size_t scratch_size;

    ddp__membership member;
    ddp__mesh mesh;
    ddp__async async;
    ddp__lib lib;
    ddp__hier hier;
    ddp__shm *shm;         /* shm.c's segment, when the group's ranks share one host */
    struct ddp__mpi *mpi;  /* mpi.c's communicator on the mpi backend */
    struct ddp__nccl *nccl; /* nccl.c's communicator on the nccl backend */
    struct ddp__trace *trace; /* trace.c's flight recorder (NULL: off) */
};

struct ddp_work {
    ddp_group *g;
    ddp__call call;
    ddp__coll coll;
    ddp_result result;
    int done;
    char error[DDP__ERR_MAX];
    ddp_work *next;
    ddp_work *issued_prev, *issued_next; /* on g->async.issued until ddp_wait takes it (collectives.c) */
    const ddp__backend *owner; /* the backend that took it (enqueue), which waits for it; NULL: the progress thread */
    void *handle;              /* the owner's: nccl's CUDA event */
};

/* ---- link.c: connections made on first use ---- */
/* A step needs a connection to `peer` to send: dial it unless a dial is under way (or the peer's wins). */
static DDP__UNUSED ddp_result ddp__link_want(ddp_group *g, int peer);
/* The listener and the handshakes under way, as poll entries (owners below -1); returns how many. */
static DDP__UNUSED int ddp__link_poll_entries(ddp_group *g, struct pollfd *fds, int *owner, double *wake);
/* Move the handshakes on after a poll (entries from ddp__link_poll_entries); *progressed when any did. */
static DDP__UNUSED ddp_result ddp__link_progress(ddp_group *g, const struct pollfd *fds, const int *owner, int n,
                                                 int *progressed);
static DDP__UNUSED void ddp__link_close_all(ddp_group *g); /* every connection, handshake and the listener */
/* The port of `peer`, which this step needs, has refused connections for DDP__REFUSED_GRACE s: it is lost. */
static DDP__UNUSED ddp_result ddp__link_check_refused(ddp_group *g, const ddp__coll *c, int peer);
/* The mesh's own hash of g's store prefix, said in every hello: a connection from another group is refused. */
static DDP__UNUSED uint64_t ddp__link_group_hash(const ddp_group *g);

/* ---- transport.c: framed messages on the mesh, failure detection, breaking the group ---- */
static DDP__UNUSED const char *ddp__coll_name(int kind); /* "all_reduce", ... */
/* "all_reduce(count=1024, f32, sum) as collective #7", numbered from g's seq_base */
static DDP__UNUSED void ddp__coll_describe(const ddp_group *g, const ddp__coll *c, char *out, size_t cap);
/* Record the first error that breaks g and tell every peer (ABORT frames, a half-close, the shared
   segment's abort word): every rank waiting on anything fails at once with the same message. */
static DDP__UNUSED ddp_result ddp__group_break(ddp_group *g, ddp_result code, const char *msg);
/* Fail the current operation: break the group with this message (the caller returns the code). */
static DDP__UNUSED ddp_result ddp__coll_fail(ddp_group *g, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
/* Peer `peer` hung up: fail with the reason it sent (ABORT) or as lost. */
static DDP__UNUSED ddp_result ddp__peer_failed(ddp_group *g, int peer, const ddp__coll *c);
/* Peer `peer` is alive but made no progress for the group's timeout. */
static DDP__UNUSED ddp_result ddp__peer_timed_out(ddp_group *g, int peer, const ddp__coll *c);
/* The first peer (only `only`, or any when -1) whose connection hung up, without waiting; -1: none. */
static DDP__UNUSED int ddp__hung_up_peer(ddp_group *g, int only);
/* A peer that hung up fails c (for transports that wait elsewhere: shared memory, NCCL). */
static DDP__UNUSED ddp_result ddp__check_peers(ddp_group *g, const ddp__coll *c);
/* One step of an algorithm: send to one peer while receiving from another (either may be -1). */
typedef struct ddp__step {
    int send_peer;
    const void *send_buf;
    size_t send_bytes;
    int recv_peer;
    void *recv_buf;
    size_t recv_bytes;
    double deadline; /* 0: fail after the group's timeout without progress; else wait until this time
                        (ddp__now()) for the frame to start (monitored_barrier), the timeout after that */
    int soft;        /* with deadline: when it passes before anything arrived, return DDP_ERR_TIMEOUT
                        without breaking the group (the caller decides) */
    int p2p;         /* 0: a collective's step; 1: a send of a point-to-point message with c->tag (receives
                        do not run as steps: transport.c's ddp__p2p_wait) */
} ddp__step;
static DDP__UNUSED ddp_result ddp__exchange(ddp_group *g, const ddp__coll *c, const ddp__step *s);
/* Point-to-point over the mesh, whatever the group's backend: send k's buffer to k->root with k->tag, or
   post a receive for the next message from k->root with k->tag and wait for it (size and dtype checked). */
static DDP__UNUSED ddp_result ddp__p2p_run(ddp_group *g, const ddp__call *k, const ddp__coll *c);
static DDP__UNUSED void ddp__p2p_stash_free(ddp_group *g); /* messages nobody received (the group ends) */
/* ddp_irecv: post p (a stashed message may finish it at once; a mismatch there is returned); then wait
   for it reading what arrives (once: look one time without waiting); done: has it finished. */
static DDP__UNUSED ddp_result ddp__p2p_post(ddp_group *g, ddp__posted *p);
static DDP__UNUSED ddp_result ddp__p2p_wait(ddp_group *g, const ddp__coll *c, ddp__posted *p, int once);
static DDP__UNUSED int ddp__posted_done(ddp_group *g, const ddp__posted *p);
static DDP__UNUSED void ddp__p2p_unpost(ddp_group *g, ddp__posted *p);
static DDP__UNUSED void ddp__close_after_failure(ddp_group *g, double seconds);
/* "host h, pid p" of rank i (its place in the rendezvous table), or "rank i" before the table: for messages. */
static DDP__UNUSED const char *ddp__peer_name(const ddp_group *g, int i, char *buf, size_t cap);
#define DDP__PEER_NAME_MAX 200
static DDP__UNUSED void ddp__say_goodbye(ddp_group *g, double seconds);

/* ---- collectives.c: the public collectives' machinery ---- */
/* Chunk i of `count` elements cut into n nearly equal parts (the first count % n get one more). */
static DDP__UNUSED void ddp__chunk(size_t count, int n, int i, size_t *off, size_t *len);
static DDP__UNUSED void *ddp__scratch(ddp_group *g, size_t bytes); /* g's staging memory; NULL when out of memory */
static DDP__UNUSED ddp_result ddp__no_memory(ddp_group *g, size_t bytes); /* fails the collective */
static DDP__UNUSED ddp__call ddp__make_call(ddp__coll_kind kind, const void *send, void *buf, size_t count, ddp_dtype t,
                                            ddp_op op, int root);
/* A synchronous collective on g, as the public calls make it (validated, after queued async work,
   through g's backend); for pieces that run collectives of their own groups (hier.c's stages). */
static DDP__UNUSED ddp_result ddp__collective(ddp_group *g, const ddp__call *k);
/* Run k now on backend b, fingerprinted as g's next collective, on the calling thread: set-up code
   uses the TCP mesh this way before (or beside) the group's own backend. */
static DDP__UNUSED ddp_result ddp__collective_on(ddp_group *g, const ddp__backend *b, const ddp__call *k);
static DDP__UNUSED void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c); /* takes the next seq */
/* The message for a call on a group that an earlier error broke; written to out (DDP__ERR_MAX). */
static DDP__UNUSED const char *ddp__broken_message(const ddp_group *g, const ddp__call *k, char *out);
static DDP__UNUSED void ddp__drain(ddp_group *g);         /* wait until no async work is queued */
static DDP__UNUSED void ddp__progress_stop(ddp_group *g); /* finish queued work, stop the thread */
static DDP__UNUSED void ddp__work_release_all(ddp_group *g); /* the group ends: free the handles not waited on */
/* The most bytes a collective's largest buffer may span (count x element size, x world size for
   all_gather / reduce_scatter): more than any process can map, so sizes computed from a valid count
   never overflow. */
#define DDP__MAX_BUFFER_BYTES ((uint64_t)1 << 47)
/* A failure outside any collective that leaves the ranks unable to agree (the reducer's missing
   gradient): finish queued work, then break the group so every rank fails with msg. */
static DDP__UNUSED ddp_result ddp__group_abort(ddp_group *g, ddp_result code, const char *msg);

/* ---- trace.c: the flight recorder, each group's last DDP_TRACE_SIZE collectives ---- */
static DDP__UNUSED void ddp__trace_open(ddp_group *g);  /* group.c: a new group's recorder (none if off) */
static DDP__UNUSED void ddp__trace_close(ddp_group *g); /* group.c: before g is freed */
static DDP__UNUSED void ddp__trace_queued(ddp_group *g, const ddp__coll *c); /* c took its seq (fingerprint) */
static DDP__UNUSED void ddp__trace_started(ddp_group *g, const ddp__coll *c); /* a backend runs it now */
static DDP__UNUSED void ddp__trace_ended(ddp_group *g, const ddp__coll *c, ddp_result r); /* done or failed */
/* ddp__group_break: mark what was in progress failed and write the recorder out (DDP_TRACE_DIR, else the log). */
static DDP__UNUSED void ddp__trace_break(ddp_group *g, ddp_result code);

/* ---- tcp.c: the algorithms over the mesh ---- */
static DDP__UNUSED ddp_result ddp__tcp_run(ddp_group *g, const ddp__call *k, const ddp__coll *c);
static DDP__UNUSED ddp_result ddp__ring_all_gather(ddp_group *g, const ddp__coll *c, char *buf, size_t count, size_t es);
/* The TCP all_gather as the tcp backend runs it (Bruck's for small sizes, else the ring); send may lie in recv. */
static DDP__UNUSED ddp_result ddp__do_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                                 ddp_dtype t);
/* Recursive doubling all_reduce (with count 0: an agreement on c alone, log2(n) header exchanges). */
static DDP__UNUSED ddp_result ddp__rd_all_reduce(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t,
                                                 ddp_op op);
#define DDP__RD_MAX_BYTES ((size_t)32 << 10) /* all_reduce up to this size runs recursive doubling (tcp.c) */
#define DDP__BROADCAST_TREE_MAX_BYTES ((size_t)256 << 10) /* broadcast up to this size runs the binomial tree (tcp.c) */
#define DDP__ALLGATHER_BRUCK_MAX_BYTES ((size_t)64 << 10) /* all_gather up to this size gathered runs Bruck's (tcp.c) */
/* The backend a new group starts with: its set-up runs on the mesh (alone: no mesh, nothing to run). */
static DDP__UNUSED const ddp__backend *ddp__initial_backend(int world_size);
/* Set-up collectives over the mesh, whatever g's backend (shm, hier, nccl set themselves up with them). */
static DDP__UNUSED ddp_result ddp__mesh_all_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t);
static DDP__UNUSED ddp_result ddp__mesh_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root);
static DDP__UNUSED ddp_result ddp__mesh_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op);
static DDP__UNUSED ddp_result ddp__mesh_barrier(ddp_group *g);

/* ---- alloc.c: ddp_alloc's arenas and heap blocks ---- */
#define DDP__ARENA_ALIGN ((size_t)2 << 20) /* arenas start on 2 MiB boundaries (huge pages, if enabled) */
#define DDP__LIB_PAGE ((size_t)4096)      /* arena blocks are whole pages: fallocate and hole punching work on pages */
#define DDP__SHM_NOT_LIB UINT64_MAX
/* The arena offset of [p, p + bytes) when it lies inside one live block of this rank's arena, else
   DDP__SHM_NOT_LIB. */
static DDP__UNUSED uint64_t ddp__lib_offset(ddp_group *g, const void *p, size_t bytes);
/* Each rank's arena size for a segment on fd (rank 0 decides): DDP_SHM_ARENA_BYTES, else what the file
   system can hold, capped. */
static DDP__UNUSED size_t ddp__arena_size(ddp_group *g, int fd);
static DDP__UNUSED void ddp__lib_free_all(ddp_group *g); /* the group is going away: every heap block */

/* ---- shm.c: the shared-memory backend ---- */
/* Map one segment for a group whose ranks all share this host and install the shm backend. Collective
   over the mesh; a failure to set up shared memory is not an error (the group stays on TCP). */
static DDP__UNUSED ddp_result ddp__shm_setup(ddp_group *g);
static DDP__UNUSED void ddp__shm_abort(ddp_group *g); /* ddp__group_break: wake every waiting rank */
/* The newest collective number rank j has entered over the segment (0: none or no segment). */
static DDP__UNUSED uint64_t ddp__shm_peer_seq(const ddp_group *g, int j);

/* ---- hier.c: the hierarchical backend ---- */
/* keys: every rank's host key. Makes the stage groups when some host has several ranks, and installs the
   hier backend. Collective over the mesh. */
static DDP__UNUSED ddp_result ddp__hier_setup(ddp_group *g, const uint64_t *keys);

/* ---- mpi.c: the mpi backend ---- */
static DDP__UNUSED ddp_result ddp__mpi_world(int *rank, int *world_size, struct ddp__mpi **out, char *err);
static DDP__UNUSED ddp_result ddp__mpi_split(ddp_group *parent, int me, struct ddp__mpi **out);
static DDP__UNUSED void ddp__mpi_attach(ddp_group *g, struct ddp__mpi *m); /* g's communicator and backend */
/* ddp_isend / ddp_irecv on the mpi backend: start w's call (w->call, w->coll filled) as MPI_Isend / MPI_Irecv;
   w's owner then waits for it (ddp__mpi_p2p_wait), and ddp__mpi_p2p_release cancels it when the group ends. */
static DDP__UNUSED ddp_result ddp__mpi_p2p_start(ddp_group *g, ddp_work *w);
static DDP__UNUSED ddp_result ddp__mpi_p2p_wait(ddp_work *w);
static DDP__UNUSED void ddp__mpi_p2p_release(ddp_work *w);
static DDP__UNUSED void ddp__mpi_free(struct ddp__mpi *m);

/* ---- nccl.c: the nccl backend ---- */
static DDP__UNUSED ddp_result ddp__nccl_built(char *err); /* can backend "nccl" be asked for? */
/* Give the connected group g an NCCL communicator (a subgroup: parent's device and stream) and install
   the nccl backend; host-memory calls keep going to the backend g had. Collective over g. */
static DDP__UNUSED ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent);

/* ---- group.c ---- */
static DDP__UNUSED ddp_group *ddp__group_alloc(int rank, int world_size);
static DDP__UNUSED void ddp__group_free(ddp_group *g); /* connections closed without goodbye */
static DDP__UNUSED void ddp__subgroup_link(ddp_group *parent, ddp_group *sub);
static DDP__UNUSED void ddp__subgroup_unlink(ddp_group *parent, ddp_group *sub);
/* Make and connect the group of the parent's ranks `ranks` (see group.c); hier.c's stages use it too. */
static DDP__UNUSED ddp_result ddp__subgroup_open(ddp_group *g, const int *ranks, int n, int me, const char *name,
                                                 struct ddp__mpi *comm, const char *what, ddp_group **out);
/* During ddp_init's set-up (g->mesh.in_setup), for link.c: a failure another rank published in the store,
   or rank `peer`'s process gone from this node, fails g (error in g->error; published); else DDP_SUCCESS. */
static DDP__UNUSED ddp_result ddp__setup_watch(ddp_group *g, int peer);
/* During the set-up: rank `peer` is gone (`how`); published so every rank fails naming it. */
static DDP__UNUSED ddp_result ddp__setup_lost(ddp_group *g, int peer, const char *how);

/* ---- safetensors.c: the format that checkpoint.c's policy reads and writes: its limits and reserved
   key prefixes, the dtype table, the parsed header, the writer's buffer ---- */

#define DDP__CK_MAX_HEADER 100000000ull         /* bytes of JSON header, as the safetensors crate allows */
#define DDP__CK_CRC_PREFIX "ddp.crc32c."        /* __metadata__ keys that are the library's */
#define DDP__CK_SHARD_PREFIX "ddp.shard."

/* safetensors dtypes of one byte or more; ddp.h loads the first eight, the rest are recognised so that
   such a tensor can be skipped (allow_unexpected) or named in a mismatch. */
static const struct {
    const char *name;
    ddp_dtype dtype;
    unsigned size;
} ddp__ck_dtypes[] = {
    {"F32", DDP_F32, 4},          {"F64", DDP_F64, 8},          {"F16", DDP_F16, 2},      {"BF16", DDP_BF16, 2},
    {"I8", DDP_I8, 1},            {"U8", DDP_U8, 1},            {"I32", DDP_I32, 4},      {"I64", DDP_I64, 8},
    {"BOOL", DDP_DTYPE_DEFAULT, 1}, {"I16", DDP_DTYPE_DEFAULT, 2}, {"U16", DDP_DTYPE_DEFAULT, 2},
    {"U32", DDP_DTYPE_DEFAULT, 4},  {"U64", DDP_DTYPE_DEFAULT, 8}, {"F8_E5M2", DDP_DTYPE_DEFAULT, 1},
    {"F8_E4M3", DDP_DTYPE_DEFAULT, 1},
};
#define DDP__CK_NDTYPES ((int)(sizeof ddp__ck_dtypes / sizeof ddp__ck_dtypes[0]))

/* A parsed header (ddp__ck_parse); the caller frees it with ddp__ck_header_free. */
typedef struct ddp__ck_entry {
    char *name;
    int st;           /* index into ddp__ck_dtypes */
    int ndim;         /* may exceed 8; then only the first 8 dimensions are kept */
    int64_t shape[8];
    uint64_t begin, end; /* byte offsets into the data section */
} ddp__ck_entry;

typedef struct ddp__ck_header {
    ddp__ck_entry *e; /* sorted by (begin, end, name): the order of the data */
    int n, cap;
    ddp_meta meta;    /* "__metadata__", in file order */
    ddp__ck_entry **by_name;
    ddp_meta_entry **meta_sorted;
} ddp__ck_header;

/* A growing string: the JSON header being written. oom is set once an allocation failed. */
typedef struct ddp__ck_buf {
    char *p;
    size_t len, cap;
    int oom;
} ddp__ck_buf;

/* ---- safetensors.c ---- */
static DDP__UNUSED int ddp__ck_little_endian(void);
/* Running CRC32C register (start with 0xFFFFFFFF, finish with ~) over n more bytes. use_hw: 1 to take
   the instruction when the CPU has it (0 is for the tests). */
static DDP__UNUSED uint32_t ddp__ck_crc_update(uint32_t reg, const void *data, size_t n, int use_hw);
static DDP__UNUSED uint32_t ddp__ck_crc32c(const void *data, size_t n, int use_hw);
static DDP__UNUSED int ddp__ck_utf8_valid(const char *s); /* strict RFC 3629 */
/* Append key and value (taken over) to m without looking for an existing key. */
static DDP__UNUSED ddp_result ddp__ck_meta_append(ddp_meta *m, char *key, char *value);
static DDP__UNUSED const char *ddp__ck_st_name(ddp_dtype t); /* "F32", ...; "?" for none */
static DDP__UNUSED void ddp__ck_header_free(ddp__ck_header *h);
/* Parse len bytes of header JSON for a file with data_len bytes after the header. On error h is freed
   and err (DDP__ERR_MAX bytes) says what is wrong. */
static DDP__UNUSED ddp_result ddp__ck_parse(const char *json, size_t len, uint64_t data_len, ddp__ck_header *h, char *err);
/* The 8-byte little-endian header length of a file of file_size bytes. */
static DDP__UNUSED ddp_result ddp__ck_prefix(const unsigned char *b, uint64_t file_size, uint64_t *hlen, char *err);
static DDP__UNUSED ddp__ck_entry *ddp__ck_lookup(const ddp__ck_header *h, const char *name); /* NULL if absent */
static DDP__UNUSED const char *ddp__ck_header_meta(const ddp__ck_header *h, const char *key); /* NULL if absent */
/* The stored checksum of tensor name: 1 found (in *crc), 0 absent, -1 malformed. */
static DDP__UNUSED int ddp__ck_stored_crc(const ddp__ck_header *h, const char *name, uint32_t *crc);
/* For the fuzz target and the tests: check a whole file image in memory. */
static DDP__UNUSED ddp_result ddp__ck_check_image(const unsigned char *buf, size_t size, char *err);
static DDP__UNUSED char *ddp__ck_cat(const char *a, const char *b); /* a new string a + b; NULL out of memory */
static DDP__UNUSED int ddp__ck_tensor_bytes(const ddp_tensor *t, uint64_t *bytes); /* 0: invalid or overflow */
static DDP__UNUSED int ddp__ck_reserved(const char *key); /* a key of the library's (ddp.crc32c.*, ddp.shard.*) */
/* The JSON header of t[0..n) with metadata user and extra, into b; on error err (DDP__ERR_MAX bytes). */
static DDP__UNUSED ddp_result ddp__ck_build_header(const char *path, const ddp_tensor *t, int n, const ddp_meta *user,
                                                   const ddp_meta *extra, ddp__ck_buf *b, char *err);

/* ---- reducer.c: host memory for the reducer's buckets (every backend but nccl uses these) ---- */
static DDP__UNUSED void *ddp__host_alloc(ddp_group *g, size_t bytes);
static DDP__UNUSED void ddp__host_release(ddp_group *g, void *p);
static DDP__UNUSED void ddp__host_zero(ddp_group *g, void *dst, size_t bytes);
static DDP__UNUSED void ddp__host_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                                 size_t count, double scale);
static DDP__UNUSED void ddp__host_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                           size_t count);
/* ==================== end src/internal.h ==================== */

/* ==================== begin src/util.c ==================== */
/* [SECTION] util: errors, logging, environment parsing, time, memory */

static DDP__THREAD_LOCAL char ddp__thread_error[DDP__ERR_MAX];

static ddp_result ddp__vfail_to(char *buf, ddp_result code, const char *fmt, va_list ap) {
    vsnprintf(buf, DDP__ERR_MAX, fmt, ap);
    return code;
}

static ddp_result ddp__fail_to(char *buf, ddp_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ddp__vfail_to(buf, code, fmt, ap);
    va_end(ap);
    return code;
}

/* Every failure lands in this thread's buffer too, so ddp_last_error(NULL) is always this thread's last
   failure, whatever the call (as stb_image's stbi_failure_reason). */
static void ddp__note_thread_error(const char *msg) {
    if (msg != ddp__thread_error) snprintf(ddp__thread_error, sizeof ddp__thread_error, "%s", msg);
}

static ddp_result ddp__fail(ddp_group *g, ddp_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ddp__vfail_to(ddp__error_buffer(g), code, fmt, ap);
    va_end(ap);
    ddp__note_thread_error(ddp__error_buffer(g));
    ddp__log(g, DDP_LOG_DEBUG, "%s: %s", ddp_result_string(code), ddp__error_buffer(g));
    return code;
}

DDP_API const char *ddp_result_string(ddp_result r) {
    switch (r) {
    case DDP_SUCCESS: return "DDP_SUCCESS";
    case DDP_ERR_INVALID_ARGUMENT: return "DDP_ERR_INVALID_ARGUMENT: a bad argument";
    case DDP_ERR_UNSUPPORTED: return "DDP_ERR_UNSUPPORTED: not supported by this build, backend or dtype";
    case DDP_ERR_OUT_OF_MEMORY: return "DDP_ERR_OUT_OF_MEMORY: out of memory";
    case DDP_ERR_SYSTEM: return "DDP_ERR_SYSTEM: an operating-system call failed";
    case DDP_ERR_TIMEOUT: return "DDP_ERR_TIMEOUT: timed out";
    case DDP_ERR_PEER_LOST: return "DDP_ERR_PEER_LOST: a peer process was lost";
    case DDP_ERR_MISMATCH: return "DDP_ERR_MISMATCH: ranks disagree";
    case DDP_ERR_STATE: return "DDP_ERR_STATE: called in the wrong state";
    case DDP_ERR_FORMAT: return "DDP_ERR_FORMAT: malformed data";
    case DDP_ERR_IO: return "DDP_ERR_IO: file input/output failed";
    case DDP_ERR_INIT: return "DDP_ERR_INIT: process-group initialisation failed";
    case DDP_ERR_WORKER_FAILED: return "DDP_ERR_WORKER_FAILED: a worker process failed";
    case DDP_ERR_UNEVEN_INPUTS: return "DDP_ERR_UNEVEN_INPUTS: a rank ran out of data (uneven inputs)";
    }
    return "unknown ddp_result";
}

DDP_API int ddp_version(void) { return DDP_VERSION_NUMBER; }

/* ---- logging ---- */

static ddp_log_level ddp__env_log_level(void) {
    static const char *names[] = {"default", "none", "error", "warn", "info", "debug"};
    const char *v = ddp__env("DDP_LOG_LEVEL");
    int i;
    if (!v) return DDP_LOG_WARN;
    for (i = 1; i < (int)(sizeof names / sizeof names[0]); i++)
        if (strcmp(v, names[i]) == 0) return (ddp_log_level)i;
    if (strcmp(v, "warning") == 0) return DDP_LOG_WARN;
    fprintf(stderr, "[ddp] DDP_LOG_LEVEL=%s is not one of none, error, warn, info, debug; using warn\n", v);
    return DDP_LOG_WARN;
}

/* The group's logger decides; without a group, DDP_LOG_LEVEL and stderr. */
static void ddp__log_emit(ddp_log_level threshold, ddp_log_fn fn, void *user, int rank, ddp_log_level level,
                          const char *fmt, va_list ap) {
    static const char *tags[] = {"", "", "error", "warning", "info", "debug"};
    char msg[2 * DDP__ERR_MAX];
    if (level > threshold || threshold == DDP_LOG_NONE) return;
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (fn) {
        fn(level, rank, msg, user);
    } else if (rank >= 0) {
        fprintf(stderr, "[ddp rank %d] %s: %s\n", rank, tags[level], msg);
    } else {
        fprintf(stderr, "[ddp] %s: %s\n", tags[level], msg);
    }
}

static void ddp__log(const ddp_group *g, ddp_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (g)
        ddp__log_emit(g->log_level, g->log_fn, g->log_user, g->rank, level, fmt, ap);
    else
        ddp__log_emit(ddp__env_log_level(), NULL, NULL, -1, level, fmt, ap);
    va_end(ap);
}

static char *ddp__error_buffer(ddp_group *g) { return g ? g->error : ddp__thread_error; }

/* A destroyed group's message went with it: this thread's last error then (registry.c knows which are live). */
DDP_API const char *ddp_last_error(const ddp_group *g) { return g && ddp__live_has(g, DDP__LIVE_GROUP) ? g->error : ddp__thread_error; }

/* ---- environment ---- */

static const char *ddp__env(const char *name) {
    const char *v = getenv(name);
    return (v && *v) ? v : NULL;
}

static int ddp__env_int(const char *name, long lo, long hi, long *value, char *err) {
    const char *v = ddp__env(name);
    char *end = NULL;
    long x;
    if (!v) return 0;
    errno = 0;
    x = strtol(v, &end, 10);
    while (end && (*end == ' ' || *end == '\n')) end++;
    if (errno || end == v || *end != '\0' || x < lo || x > hi) {
        ddp__fail_to(err, DDP_ERR_INIT, "environment variable %s=\"%s\" is not an integer in [%ld, %ld]; fix or unset it",
                     name, v, lo, hi);
        return -1;
    }
    *value = x;
    return 1;
}

/* ---- time ---- */

static double ddp__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void ddp__sleep(double seconds) {
    struct timespec ts;
    if (seconds <= 0) return;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- memory ---- */

static void *ddp__malloc(size_t size) { return DDP_MALLOC(size ? size : 1); }

static void *ddp__calloc(size_t n, size_t size) {
    void *p;
    if (size && n > SIZE_MAX / size) return NULL;
    p = ddp__malloc(n * size);
    if (p && n * size > 0) memset(p, 0, n * size);
    return p;
}

static void ddp__free(void *p) {
    if (p) DDP_FREE(p);
}

static char *ddp__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = (char *)ddp__malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

static uint64_t ddp__hash(const char *s) { /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

static ddp_result ddp__peer_code(long code, ddp_result fallback) {
    return code <= DDP_ERR_INVALID_ARGUMENT && code >= DDP_ERR_UNEVEN_INPUTS ? (ddp_result)code : fallback;
}

/* ---- open files ----
   A rank holds a descriptor per connection, so a large group meets RLIMIT_NOFILE (commonly a soft limit
   of 1024 under a far higher hard one). ddp_init raises the soft limit to the hard one, as NCCL does
   (ddp__fd_prepare), and notes the group's size, so that whoever meets EMFILE or ENFILE afterwards
   (a socket, an accept, shm_open; on any thread, the store server's included) can say how many
   descriptors the group needs and how to allow them (ddp__fail_descriptors). */
static int ddp__fd_world = 0, ddp__fd_rank = -1; /* the largest group this process joined: for messages */

static int ddp__largest_world(void) { return __atomic_load_n(&ddp__fd_world, __ATOMIC_ACQUIRE); }

/* Descriptors a rank needs, at most, for a group of W ranks: stdin/out/err, its store client, its
   listener, a few connections being made, and the connections its collectives use (link.c: made on
   first use; the barrier, recursive doubling, the binomial tree, Bruck and the ring each use up to
   2 ceil(log2 W) partners, and many of them coincide): 4 ceil(log2 W) + 8. Rank 0 also serves the
   store: its listener, a stop pipe and a connection per rank (W + 3). Keep this in step with the
   connection scheme: messages quote it (tests/test_init.c, "open-file limit", measures it). */
static long ddp__fd_need(int world, int rank) {
    long log2w = 0, links;
    while ((1L << log2w) < world) log2w++;
    links = 4 * log2w + 8;
    return rank == 0 ? links + world + 3 : links;
}

static int ddp__out_of_descriptors(int errnum) { return errnum == EMFILE || errnum == ENFILE; }

/* "too many open files: ..." into err (what: the call that failed), naming the limit, the need and the
   fix. EMFILE is this process's limit, ENFILE the whole system's. */
static const char *ddp__rlim_text(rlim_t v, char *buf, size_t cap) {
    if (v == RLIM_INFINITY) snprintf(buf, cap, "unlimited");
    else snprintf(buf, cap, "%llu", (unsigned long long)v);
    return buf;
}

static ddp_result ddp__fail_descriptors(char *err, int errnum, const char *what) {
    struct rlimit rl;
    char soft[32] = "?", hard[32] = "?", need[96] = "";
    int world = __atomic_load_n(&ddp__fd_world, __ATOMIC_ACQUIRE), rank = __atomic_load_n(&ddp__fd_rank, __ATOMIC_RELAXED);
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        ddp__rlim_text(rl.rlim_cur, soft, sizeof soft);
        ddp__rlim_text(rl.rlim_max, hard, sizeof hard);
    }
    if (world > 0)
        snprintf(need, sizeof need, "; a group of %d ranks needs about %ld here (rank %d)", world, ddp__fd_need(world, rank), rank);
    if (errnum == ENFILE)
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: too many open files in the whole system (ENFILE: the kernel's table, "
                            "fs.file-max, is full)%s; close other programs' files or raise fs.file-max with sysctl", what, need);
    return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: too many open files: this process (pid %d) may have %s (RLIMIT_NOFILE soft "
                        "limit, hard %s)%s; raise it with `ulimit -n N` before starting the job (`ulimit -Hn N` or "
                        "limits.conf for the hard limit)", what, (int)getpid(), soft, hard, need);
}

/* Before a group of `world` ranks connects: raise the soft open-file limit to the hard one (said at debug
   level; a warning when even the hard limit is below the group's need), and note the group's size for
   ddp__fail_descriptors. */
static void ddp__fd_prepare(ddp_group *g, int world, int rank) {
    struct rlimit rl;
    char a[32], b[32];
    long need = ddp__fd_need(world, rank);
    if (world > __atomic_load_n(&ddp__fd_world, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&ddp__fd_rank, rank, __ATOMIC_RELAXED);
        __atomic_store_n(&ddp__fd_world, world, __ATOMIC_RELEASE);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    if (rl.rlim_cur != rl.rlim_max) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
            ddp__log(g, DDP_LOG_DEBUG, "raised the soft limit on open files (RLIMIT_NOFILE) from %s to the hard limit, %s",
                     ddp__rlim_text(was, a, sizeof a), ddp__rlim_text(rl.rlim_max, b, sizeof b));
        else
            rl.rlim_cur = was;
    }
    if (rl.rlim_cur != RLIM_INFINITY && (long long)rl.rlim_cur < (long long)need)
        ddp__log(g, DDP_LOG_WARN, "this process may have %s open files (RLIMIT_NOFILE, hard limit %s), but a group of %d "
                 "ranks needs about %ld on rank %d: ddp_init may fail; raise it with `ulimit -n %ld`",
                 ddp__rlim_text(rl.rlim_cur, a, sizeof a), ddp__rlim_text(rl.rlim_max, b, sizeof b), world, need, rank, need);
}

/* ---- oversubscription ---- */

/* More ranks on this host than CPUs online: a rank that spins while waiting only delays the rank it
   waits for (which needs that core), so waits block at once. ranks_here < 1 (unknown): not oversubscribed. */
static int ddp__oversubscribed(int ranks_here) {
    static long cpus = 0; /* sysconf reads /sys: once per process */
    long n = __atomic_load_n(&cpus, __ATOMIC_RELAXED);
    if (n == 0) {
        n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n < 1) n = 1;
        __atomic_store_n(&cpus, n, __ATOMIC_RELAXED);
    }
    return ranks_here > n;
}
/* ==================== end src/util.c ==================== */

/* ==================== begin src/registry.c ==================== */
/* [SECTION] registry: which groups and work handles are alive, so that a call on a destroyed group or
   a spent ddp_work is an error instead of a use after free

   A freed object cannot be inspected (its memory may be reused, and AddressSanitizer rightly flags the
   read), so liveness is never asked of the object itself: one process-wide set holds the address of
   every live group (from ddp__group_alloc to ddp__group_free) and of every work handle not yet waited
   on (from its async call to ddp_wait, or to its group's end). A public entry point looks the pointer
   up before it dereferences it.

   The set is an open-addressing hash table (linear probing, deletion by backward shift, so no
   tombstones), resized to keep it at most half full, under one mutex. Each entry carries its kind, so a
   group's address never passes for a work handle. The table is freed when it empties, so a program that
   destroys everything leaves nothing behind. Limitation: once the allocator reuses a freed handle's
   address for a newer handle, the old pointer reads as that newer handle; a spent handle is recognized
   until then (always, in the common case of waiting twice in a row). */

typedef struct ddp__live_entry {
    const void *p; /* NULL: empty slot */
    int kind;
} ddp__live_entry;

static pthread_mutex_t ddp__live_mu = PTHREAD_MUTEX_INITIALIZER;
static ddp__live_entry *ddp__live_table;
static size_t ddp__live_cap, ddp__live_n; /* cap: a power of two, or 0 */

static size_t ddp__live_slot(const void *p, size_t cap) {
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (cap - 1);
}

/* The slot holding p, or the empty slot where it would go. Needs cap > n. */
static size_t ddp__live_find(const void *p) {
    size_t i = ddp__live_slot(p, ddp__live_cap);
    while (ddp__live_table[i].p && ddp__live_table[i].p != p) i = (i + 1) & (ddp__live_cap - 1);
    return i;
}

static int ddp__live_grow(void) {
    size_t cap = ddp__live_cap ? ddp__live_cap * 2 : 64, i;
    ddp__live_entry *old = ddp__live_table, *t = (ddp__live_entry *)ddp__calloc(cap, sizeof *t);
    size_t old_cap = ddp__live_cap;
    if (!t) return 0;
    ddp__live_table = t;
    ddp__live_cap = cap;
    for (i = 0; i < old_cap; i++)
        if (old[i].p) ddp__live_table[ddp__live_find(old[i].p)] = old[i];
    ddp__free(old);
    return 1;
}

static int ddp__live_add(const void *p, int kind) {
    int ok = 1;
    pthread_mutex_lock(&ddp__live_mu);
    if (2 * (ddp__live_n + 1) > ddp__live_cap) ok = ddp__live_grow();
    if (ok) {
        size_t i = ddp__live_find(p);
        if (!ddp__live_table[i].p) ddp__live_n++;
        ddp__live_table[i].p = p;
        ddp__live_table[i].kind = kind;
    }
    pthread_mutex_unlock(&ddp__live_mu);
    return ok;
}

/* Remove slot i, shifting later entries of its probe run back so every lookup still finds them. */
static void ddp__live_erase(size_t i) {
    size_t j = i, mask = ddp__live_cap - 1;
    ddp__live_table[i].p = NULL;
    for (;;) {
        size_t home;
        j = (j + 1) & mask;
        if (!ddp__live_table[j].p) break;
        home = ddp__live_slot(ddp__live_table[j].p, ddp__live_cap);
        /* move j back to i when i lies cyclically in [home, j) */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            ddp__live_table[i] = ddp__live_table[j];
            ddp__live_table[j].p = NULL;
            i = j;
        }
    }
    if (--ddp__live_n == 0) {
        ddp__free(ddp__live_table);
        ddp__live_table = NULL;
        ddp__live_cap = 0;
    }
}

/* 1 when p is live as kind; with take, it is removed as well (so two callers cannot both take it). */
static int ddp__live_check(const void *p, int kind, int take) {
    int found = 0;
    if (!p) return 0;
    pthread_mutex_lock(&ddp__live_mu);
    if (ddp__live_cap) {
        size_t i = ddp__live_find(p);
        found = ddp__live_table[i].p == p && ddp__live_table[i].kind == kind;
        if (found && take) ddp__live_erase(i);
    }
    pthread_mutex_unlock(&ddp__live_mu);
    return found;
}

static int ddp__live_has(const void *p, int kind) { return ddp__live_check(p, kind, 0); }
static int ddp__live_take(const void *p, int kind) { return ddp__live_check(p, kind, 1); }
static void ddp__live_remove(const void *p, int kind) { (void)ddp__live_check(p, kind, 1); }

/* The check at the top of every public entry point that takes a group. */
static ddp_result ddp__group_check(const ddp_group *g, const char *fn) {
    if (!g) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the group is NULL (did ddp_init succeed?)", fn);
    if (!ddp__live_has(g, DDP__LIVE_GROUP))
        return ddp__fail(NULL, DDP_ERR_STATE, "%s: group %p was destroyed (or was never returned by ddp_init or "
                         "ddp_new_group); a destroyed group cannot be used, and ddp_destroy of a group also destroys "
                         "its subgroups", fn, (const void *)g);
    return DDP_SUCCESS;
}
/* ==================== end src/registry.c ==================== */

/* ==================== begin src/dtype.c ==================== */
/* [SECTION] dtype: sizes and names, f16/bf16 conversion, element-wise reduction
   f16 and bf16 are reduced in f32 and rounded back to nearest even at every step, so a sum of
   values that f16 represents exactly is exact. Integer SUM and PROD wrap (computed unsigned, where
   wrapping is defined), matching two's complement hardware and NCCL. */

static const struct {
    const char *name;
    size_t size;
} ddp__dtypes[DDP_DTYPE_COUNT] = {
    {"default", 0}, {"f32", 4}, {"f64", 8}, {"f16", 2}, {"bf16", 2},
    {"i8", 1},      {"u8", 1},  {"i32", 4}, {"i64", 8},
};

static int ddp__dtype_valid(ddp_dtype t) { return (int)t > 0 && (int)t < DDP_DTYPE_COUNT; }
static int ddp__op_valid(ddp_op op) { return (int)op >= 0 && (int)op < DDP_OP_COUNT; }
static int ddp__dtype_is_float(ddp_dtype t) { return t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16; }

DDP_API const char *ddp_dtype_name(ddp_dtype t) { return ((int)t >= 0 && (int)t < DDP_DTYPE_COUNT) ? ddp__dtypes[t].name : "?"; }
DDP_API size_t ddp_dtype_size(ddp_dtype t) { return ddp__dtype_valid(t) ? ddp__dtypes[t].size : 0; }

DDP_API const char *ddp_op_name(ddp_op op) {
    static const char *names[DDP_OP_COUNT] = {"sum", "avg", "prod", "min", "max"};
    return ddp__op_valid(op) ? names[op] : "?";
}

/* ---- f16 / bf16 ---- */

static uint32_t ddp__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float ddp__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

DDP_API float ddp_bf16_to_f32(uint16_t b) { return ddp__bits_f32((uint32_t)b << 16); }

DDP_API uint16_t ddp_f32_to_bf16(float f) {
    uint32_t u = ddp__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

DDP_API float ddp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return ddp__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp == 0) {                                                          /* zero, subnormal */
        float v = (float)man * (1.0f / 16777216.0f);                         /* man * 2^-24, exact */
        return sign ? -v : v;
    }
    return ddp__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

DDP_API uint16_t ddp_f32_to_f16(float f) {
    uint32_t u = ddp__f32_bits(f), sign = (u >> 16) & 0x8000u, absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((absu >> 13) & 0x3ffu)); /* NaN */
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: infinity */
    if (absu < 0x38800000u) {                                   /* below 2^-14: subnormal f16 */
        /* Adding 0.5 (2^-1) in f32 puts the f16 subnormal grid (2^-24) at f32's last place, so the
           hardware's round-to-nearest-even rounds exactly as f16 would. */
        float v = ddp__bits_f32(absu) + 0.5f;
        return (uint16_t)(sign | (ddp__f32_bits(v) - 0x3f000000u));
    }
    {
        uint32_t mant_odd = (absu >> 13) & 1u;
        absu += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
        return (uint16_t)(sign | (absu >> 13));
    }
}

/* ---- element-wise reduction ----
   One loop per (type, op), written so that the compiler vectorises it: blocks of 16 elements are
   loaded into locals before any is stored, so the compiler needs no proof that dst and src do not
   overlap (gcc 12 -O2 does not vectorise the plain loop; this form it does, measured 2x at 1 MiB). */

#define DDP__REDUCE_LOOP(T, EXPR)                                                   \
    do {                                                                            \
        T *d_ = (T *)dst;                                                           \
        const T *s_ = (const T *)src;                                               \
        size_t i_ = 0, k_;                                                          \
        for (; i_ + 16 <= count; i_ += 16) {                                        \
            T x_[16], y_[16];                                                       \
            for (k_ = 0; k_ < 16; k_++) x_[k_] = d_[i_ + k_], y_[k_] = s_[i_ + k_]; \
            for (k_ = 0; k_ < 16; k_++) {                                           \
                T a = x_[k_], b = y_[k_];                                           \
                d_[i_ + k_] = (EXPR);                                               \
            }                                                                       \
        }                                                                           \
        for (; i_ < count; i_++) {                                                  \
            T a = d_[i_], b = s_[i_];                                               \
            d_[i_] = (EXPR);                                                        \
        }                                                                           \
    } while (0)

/* Wrapping integer arithmetic through the unsigned type of the same width. */
#define DDP__REDUCE_INT(T, U)                                                \
    switch (op) {                                                            \
    case DDP_SUM: case DDP_AVG: DDP__REDUCE_LOOP(T, (T)((U)a + (U)b)); break; \
    case DDP_PROD: DDP__REDUCE_LOOP(T, (T)((U)a * (U)b)); break;             \
    case DDP_MIN: DDP__REDUCE_LOOP(T, a < b ? a : b); break;                 \
    case DDP_MAX: DDP__REDUCE_LOOP(T, a > b ? a : b); break;                 \
    default: break;                                                          \
    }

/* MIN and MAX propagate NaN, as torch.minimum / torch.maximum do. */
#define DDP__REDUCE_FLOAT(T)                                                   \
    switch (op) {                                                              \
    case DDP_SUM: case DDP_AVG: DDP__REDUCE_LOOP(T, a + b); break;             \
    case DDP_PROD: DDP__REDUCE_LOOP(T, a * b); break;                          \
    case DDP_MIN: DDP__REDUCE_LOOP(T, (a < b || a != a) ? a : b); break;       \
    case DDP_MAX: DDP__REDUCE_LOOP(T, (a > b || a != a) ? a : b); break;       \
    default: break;                                                            \
    }

static float ddp__combine_f32(float a, float b, ddp_op op) {
    switch (op) {
    case DDP_PROD: return a * b;
    case DDP_MIN: return (a < b || a != a) ? a : b;
    case DDP_MAX: return (a > b || a != a) ? a : b;
    default: return a + b;
    }
}

static void ddp__reduce(void *dst, const void *src, size_t count, ddp_dtype t, ddp_op op) {
    size_t i;
    switch (t) {
    case DDP_F32: DDP__REDUCE_FLOAT(float); break;
    case DDP_F64: DDP__REDUCE_FLOAT(double); break;
    case DDP_I8: DDP__REDUCE_INT(int8_t, uint8_t); break;
    case DDP_U8: DDP__REDUCE_INT(uint8_t, uint8_t); break;
    case DDP_I32: DDP__REDUCE_INT(int32_t, uint32_t); break;
    case DDP_I64: DDP__REDUCE_INT(int64_t, uint64_t); break;
    case DDP_F16: {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < count; i++) d[i] = ddp_f32_to_f16(ddp__combine_f32(ddp_f16_to_f32(d[i]), ddp_f16_to_f32(s[i]), op));
        break;
    }
    case DDP_BF16: {
        uint16_t *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < count; i++)
            d[i] = ddp_f32_to_bf16(ddp__combine_f32(ddp_bf16_to_f32(d[i]), ddp_bf16_to_f32(s[i]), op));
        break;
    }
    default: break;
    }
}

#define DDP__DIVIDE_LOOP(T, EXPR)        \
    do {                                 \
        T *b_ = (T *)buf;                \
        size_t i_;                       \
        for (i_ = 0; i_ < count; i_++) { \
            T a = b_[i_];                \
            b_[i_] = (EXPR);             \
        }                                \
    } while (0)

static void ddp__divide(void *buf, size_t count, ddp_dtype t, int n) {
    size_t i;
    switch (t) {
    case DDP_F32: DDP__DIVIDE_LOOP(float, a / (float)n); break;
    case DDP_F64: DDP__DIVIDE_LOOP(double, a / (double)n); break;
    case DDP_I8: DDP__DIVIDE_LOOP(int8_t, (int8_t)(a / n)); break;
    case DDP_U8: DDP__DIVIDE_LOOP(uint8_t, (uint8_t)(a / n)); break;
    case DDP_I32: DDP__DIVIDE_LOOP(int32_t, (int32_t)(a / n)); break;
    case DDP_I64: DDP__DIVIDE_LOOP(int64_t, a / (int64_t)n); break;
    case DDP_F16: {
        uint16_t *b = (uint16_t *)buf;
        for (i = 0; i < count; i++) b[i] = ddp_f32_to_f16(ddp_f16_to_f32(b[i]) / (float)n);
        break;
    }
    case DDP_BF16: {
        uint16_t *b = (uint16_t *)buf;
        for (i = 0; i < count; i++) b[i] = ddp_f32_to_bf16(ddp_bf16_to_f32(b[i]) / (float)n);
        break;
    }
    default: break;
    }
}
/* ==================== end src/dtype.c ==================== */

/* ==================== begin src/net.c ==================== */
/* [SECTION] net: TCP sockets with deadlines
   Every socket is non-blocking and every wait is a poll() bounded by an absolute deadline
   (ddp__now() seconds), so no call can block forever. send() uses MSG_NOSIGNAL: a peer that died
   gives an error code, not SIGPIPE. Errors return a ddp_result and a short message in err
   (DDP__ERR_MAX bytes); callers add who the peer was. */

static void ddp__net_configure(int fd) {
    int one = 1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Resolve host:port; host NULL means "any address" (for listening). */
static ddp_result ddp__net_resolve(const char *host, int port, int passive, struct addrinfo **res, char *err) {
    struct addrinfo hints;
    char service[16];
    int rc;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    snprintf(service, sizeof service, "%d", port);
    rc = getaddrinfo(host, service, &hints, res);
    if (rc != 0)
        return ddp__fail_to(err, DDP_ERR_INIT, "cannot resolve host \"%s\": %s", host ? host : "*", gai_strerror(rc));
    return DDP_SUCCESS;
}

/* Listen on host:port (host NULL: every interface; port 0: any free port). *bound_port gets the port. */
/* The kernel caps a listen backlog at net.core.somaxconn (4096 since Linux 5.4); SOMAXCONN is that default
   in current headers, but 128 in older ones, below what a rendezvous of thousands of ranks needs. */
#define DDP__LISTEN_BACKLOG (SOMAXCONN > 4096 ? SOMAXCONN : 4096)
static ddp_result ddp__net_listen(const char *host, int port, int *fd_out, int *bound_port, char *err) {
    struct addrinfo *res = NULL, *ai;
    int fd = -1, saved = 0, one = 1;
    ddp_result r = ddp__net_resolve(host, port, 1, &res, err);
    if (r) return r;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) { saved = errno; continue; }
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, DDP__LISTEN_BACKLOG) == 0) break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (ddp__out_of_descriptors(saved)) return ddp__fail_descriptors(err, saved, "cannot open a listening socket");
        if (saved == EADDRINUSE)
            return ddp__fail_to(err, DDP_ERR_INIT, "port %d on %s is already in use (another job, or a previous run still "
                                "exiting); choose another MASTER_PORT or use ddprun --standalone", port, host ? host : "*");
        if (saved == EADDRNOTAVAIL)
            return ddp__fail_to(err, DDP_ERR_INIT, "cannot listen on %s:%d: that address is not on this host "
                                "(MASTER_ADDR must name the host of rank 0)", host ? host : "*", port);
        return ddp__fail_to(err, DDP_ERR_INIT, "cannot listen on %s:%d: %s", host ? host : "*", port, strerror(saved));
    }
    ddp__net_configure(fd);
    if (bound_port) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        getsockname(fd, (struct sockaddr *)&ss, &len);
        *bound_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                     : ((struct sockaddr_in *)&ss)->sin_port);
    }
    *fd_out = fd;
    return DDP_SUCCESS;
}

/* Wait for fd to be ready for `events`, until deadline. */
static ddp_result ddp__net_poll(int fd, short events, double deadline, char *err) {
    for (;;) {
        struct pollfd p;
        double left = deadline - ddp__now();
        int rc;
        if (left <= 0) return ddp__fail_to(err, DDP_ERR_TIMEOUT, "timed out");
        p.fd = fd;
        p.events = events;
        p.revents = 0;
        rc = poll(&p, 1, (int)DDP__MIN(left * 1000.0 + 1.0, 1000.0));
        if (rc > 0) return DDP_SUCCESS;
        if (rc < 0 && errno != EINTR) return ddp__fail_to(err, DDP_ERR_SYSTEM, "poll: %s", strerror(errno));
    }
}

/* One attempt to connect to host:port (each of its addresses in turn), each waiting at most 5 s and
   never past the deadline. *refused = 1 when every address answered "connection refused": nothing
   listens there now. On failure err says why (the last address's error). */
static ddp_result ddp__net_connect_once(const char *host, int port, double deadline, int *fd_out, int *refused, char *err) {
    struct addrinfo *res = NULL, *ai;
    int tried = 0, all_refused = 1;
    ddp_result r = ddp__net_resolve(host, port, 0, &res, err);
    *refused = 0;
    if (r) return r;
    snprintf(err, DDP__ERR_MAX, "no address");
    for (ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), soerr = 0;
        socklen_t len = sizeof soerr;
        char why[DDP__ERR_MAX];
        if (fd < 0 && ddp__out_of_descriptors(errno)) { /* waiting would not help: say so now */
            int e = errno;
            freeaddrinfo(res);
            return ddp__fail_descriptors(err, e, "cannot open a socket");
        }
        if (fd < 0) continue;
        tried++;
        ddp__net_configure(fd);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) soerr = errno;
        else if (ddp__net_poll(fd, POLLOUT, DDP__MIN(deadline, ddp__now() + 5.0), why) != DDP_SUCCESS) soerr = ETIMEDOUT;
        else getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        if (soerr == 0) {
            freeaddrinfo(res);
            *fd_out = fd;
            return DDP_SUCCESS;
        }
        all_refused &= soerr == ECONNREFUSED;
        snprintf(err, DDP__ERR_MAX, "%s", soerr == ETIMEDOUT ? "connection attempt timed out" : strerror(soerr));
        close(fd);
    }
    freeaddrinfo(res);
    *refused = tried > 0 && all_refused;
    return DDP_ERR_TIMEOUT;
}

/* Start connecting to host:port without waiting (its first address): the caller polls *fd_out for
   POLLOUT and reads SO_ERROR (link.c dials this way inside a step's poll). *refused = 1 when the
   refusal came at once (nothing listens there). */
static ddp_result ddp__net_connect_start(const char *host, int port, int *fd_out, int *refused, char *err) {
    struct addrinfo *res = NULL;
    int fd, e;
    ddp_result r = ddp__net_resolve(host, port, 0, &res, err);
    *refused = 0;
    if (r) return r;
    fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (fd < 0) {
        e = errno;
        freeaddrinfo(res);
        if (ddp__out_of_descriptors(e)) return ddp__fail_descriptors(err, e, "cannot open a socket");
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "socket: %s", strerror(e));
    }
    ddp__net_configure(fd);
    e = connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS ? errno : 0;
    freeaddrinfo(res);
    if (e) {
        close(fd);
        *refused = e == ECONNREFUSED;
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "connect: %s", strerror(e));
    }
    *fd_out = fd;
    return DDP_SUCCESS;
}

/* Bytes this side sent on fd that the peer's kernel has not acknowledged yet (0 when unknown): Linux's
   TIOCOUTQ (SIOCOUTQ) on a TCP socket counts the send queue not yet acknowledged. A connection still in
   the peer's full listen queue, or a peer that is unreachable, has them; a peer program that merely
   does not answer has none. */
static int ddp__net_unacked(int fd) {
    int queued = 0;
    if (ioctl(fd, TIOCOUTQ, &queued) != 0) return 0;
    return queued > 0;
}

/* Connect to host:port, retrying with exponential backoff (10 ms .. 1 s) until the deadline while
   the other side is not listening yet: ranks start in any order. */
static ddp_result ddp__net_connect(const char *host, int port, double deadline, int *fd_out, char *err) {
    double backoff = 0.01;
    char last[DDP__ERR_MAX] = "no attempt";
    int refused;
    for (;;) {
        ddp_result r = ddp__net_connect_once(host, port, deadline, fd_out, &refused, last);
        if (r == DDP_SUCCESS) return r;
        if (r != DDP_ERR_TIMEOUT) return ddp__fail_to(err, r, "%s", last); /* cannot resolve */
        if (ddp__now() + backoff > deadline)
            return ddp__fail_to(err, DDP_ERR_TIMEOUT, "could not connect to %s:%d before the timeout (last error: %.200s)", host,
                                port, last);
        ddp__sleep(backoff);
        backoff = DDP__MIN(backoff * 2, 1.0);
    }
}

static ddp_result ddp__net_accept(int listen_fd, double deadline, int *fd_out, char *err) {
    for (;;) {
        int fd;
        ddp_result r = ddp__net_poll(listen_fd, POLLIN, deadline, err);
        if (r) return r;
        fd = accept(listen_fd, NULL, NULL);
        if (fd >= 0) {
            ddp__net_configure(fd);
            *fd_out = fd;
            return DDP_SUCCESS;
        }
        if (ddp__out_of_descriptors(errno)) return ddp__fail_descriptors(err, errno, "cannot accept a connection");
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            return ddp__fail_to(err, DDP_ERR_SYSTEM, "accept: %s", strerror(errno));
    }
}

/* Send all n bytes before the deadline. */
static ddp_result ddp__net_send(int fd, const void *buf, size_t n, double deadline, char *err) {
    const char *p = (const char *)buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            ddp_result r = ddp__net_poll(fd, POLLOUT, deadline, err);
            if (r) return r;
            continue;
        }
        return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection lost while sending (%s)", strerror(errno));
    }
    return DDP_SUCCESS;
}

/* Receive exactly n bytes before the deadline. The peer closing is DDP_ERR_PEER_LOST. */
static ddp_result ddp__net_recv(int fd, void *buf, size_t n, double deadline, char *err) {
    char *p = (char *)buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection closed by the other side");
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            ddp_result r = ddp__net_poll(fd, POLLIN, deadline, err);
            if (r) return r;
            continue;
        }
        return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection lost while receiving (%s)", strerror(errno));
    }
    return DDP_SUCCESS;
}

/* The numeric address of this end of a connected socket: the interface that reaches the peer. */
static void ddp__net_local_address(int fd, char *host, size_t cap) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
        getnameinfo((struct sockaddr *)&ss, len, host, (socklen_t)cap, NULL, 0, NI_NUMERICHOST) != 0)
        snprintf(host, cap, "127.0.0.1");
}
/* ==================== end src/net.c ==================== */

/* ==================== begin src/auth.c ==================== */
/* [SECTION] auth: DDP_AUTH_TOKEN, a shared secret that every connection proves (HMAC-SHA256)

   ddp.h assumes a trusted cluster network, as NCCL and Gloo do (docs/RELIABILITY.md). Setting
   DDP_AUTH_TOKEN to the same secret on every rank makes the store and the rank-to-rank mesh refuse
   connections from processes that do not know it. Both ends prove knowledge of the token without
   sending it, with fresh random nonces so that a recorded exchange cannot be replayed:

       client -> server   "DDPAUTH1" | cn                         (cn: 16 random bytes)
       server -> client   sn | HMAC(token, "server" | cn | sn)     (sn: 16 random bytes)
       client -> server   HMAC(token, "client" | cn | sn)          (only if the server's proof is right)
       server -> client   1 byte: 1 accepted, 0 refused

   A client whose token differs fails at once saying so, and so does the server's side (the store
   logs the refusal and serves the others; a rank's mesh listener refuses the connection). The
   exchange authenticates; it does not encrypt: anyone on the path still sees the traffic. With a token
   set, torch processes cannot join ddp.h's store (torch has no such handshake).

   SHA-256 is FIPS 180-4, HMAC is RFC 2104; tests/test_auth.c checks them against the RFC 4231 vectors. */


/* ---- SHA-256 ---- */

typedef struct ddp__sha256 {
    uint32_t h[8];
    uint64_t bytes;
    unsigned char block[64];
} ddp__sha256;

static uint32_t ddp__rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void ddp__sha256_block(ddp__sha256 *c, const unsigned char *p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
        0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
        0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
        0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
        0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
        0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64], v[8], t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ddp__rotr(w[i - 15], 7) ^ ddp__rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ddp__rotr(w[i - 2], 17) ^ ddp__rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, c->h, sizeof v);
    for (i = 0; i < 64; i++) {
        t1 = v[7] + (ddp__rotr(v[4], 6) ^ ddp__rotr(v[4], 11) ^ ddp__rotr(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + k[i] + w[i];
        t2 = (ddp__rotr(v[0], 2) ^ ddp__rotr(v[0], 13) ^ ddp__rotr(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, 7 * sizeof v[0]);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (i = 0; i < 8; i++) c->h[i] += v[i];
}

static void ddp__sha256_init(ddp__sha256 *c) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, h0, sizeof h0);
    c->bytes = 0;
}

static void ddp__sha256_add(ddp__sha256 *c, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    while (n > 0) {
        size_t at = (size_t)(c->bytes % 64), k = DDP__MIN(n, 64 - at);
        memcpy(c->block + at, p, k);
        c->bytes += k;
        p += k;
        n -= k;
        if (at + k == 64) ddp__sha256_block(c, c->block);
    }
}

static void ddp__sha256_end(ddp__sha256 *c, unsigned char out[32]) {
    unsigned char pad[72];
    uint64_t bits = c->bytes * 8;
    size_t padlen = (size_t)((c->bytes % 64) < 56 ? 56 - c->bytes % 64 : 120 - c->bytes % 64), i;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (i = 0; i < 8; i++) pad[padlen + i] = (unsigned char)(bits >> (56 - 8 * i));
    ddp__sha256_add(c, pad, padlen + 8);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(c->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(c->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(c->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)c->h[i];
    }
}

/* HMAC-SHA256 (RFC 2104) of the concatenation of up to three parts (NULL parts are skipped). */
static void ddp__hmac_sha256(const void *key, size_t key_len, const void *a, size_t an, const void *b, size_t bn,
                             const void *c, size_t cn, unsigned char out[32]) {
    unsigned char k[64], pad[64], inner[32];
    ddp__sha256 h;
    int i;
    memset(k, 0, sizeof k);
    if (key_len > 64) {
        ddp__sha256_init(&h);
        ddp__sha256_add(&h, key, key_len);
        ddp__sha256_end(&h, k);
    } else if (key_len) {
        memcpy(k, key, key_len);
    }
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x36);
    ddp__sha256_init(&h);
    ddp__sha256_add(&h, pad, 64);
    if (a) ddp__sha256_add(&h, a, an);
    if (b) ddp__sha256_add(&h, b, bn);
    if (c) ddp__sha256_add(&h, c, cn);
    ddp__sha256_end(&h, inner);
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x5c);
    ddp__sha256_init(&h);
    ddp__sha256_add(&h, pad, 64);
    ddp__sha256_add(&h, inner, 32);
    ddp__sha256_end(&h, out);
}

/* ---- the handshake ---- */

/* DDP_AUTH_TOKEN, or NULL when authentication is off. */
static const char *ddp__auth_token(void) { return ddp__env("DDP_AUTH_TOKEN"); }

static void ddp__auth_nonce(unsigned char out[DDP__AUTH_NONCE]) {
    static unsigned counter;
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t k = read(fd, out, DDP__AUTH_NONCE);
        got = k > 0 ? (size_t)k : 0;
        close(fd);
    }
    if (got < DDP__AUTH_NONCE) { /* no urandom: time, pid and a counter, hashed (unique, if not secret) */
        unsigned char mac[32];
        double t = ddp__now();
        long pid = (long)getpid();
        counter++;
        ddp__hmac_sha256(&t, sizeof t, &pid, sizeof pid, &counter, sizeof counter, NULL, 0, mac);
        memcpy(out, mac, DDP__AUTH_NONCE);
    }
}

/* The proof one side gives: HMAC(token, label | cn | sn). */
static void ddp__auth_proof(const char *token, const char *label, const unsigned char *cn, const unsigned char *sn,
                            unsigned char out[DDP__AUTH_MAC]) {
    ddp__hmac_sha256(token, strlen(token), label, strlen(label), cn, DDP__AUTH_NONCE, sn, DDP__AUTH_NONCE, out);
}

/* Compare without an early exit, so the time taken says nothing about where the bytes differ. */
static int ddp__auth_equal(const unsigned char *a, const unsigned char *b, size_t n) {
    unsigned char d = 0;
    size_t i;
    for (i = 0; i < n; i++) d = (unsigned char)(d | (a[i] ^ b[i]));
    return d == 0;
}

/* Client side, blocking, on a fresh connection to `who` ("the store at h:p", "rank 3 at h:p"). */
static ddp_result ddp__auth_client(int fd, const char *token, const char *who, double deadline, char *err) {
    unsigned char hello[8 + DDP__AUTH_NONCE], reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], want[DDP__AUTH_MAC], verdict = 0;
    char why[DDP__ERR_MAX];
    memcpy(hello, DDP__AUTH_MAGIC, 8);
    ddp__auth_nonce(hello + 8);
    if (ddp__net_send(fd, hello, sizeof hello, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, reply, sizeof reply, deadline, why) != DDP_SUCCESS)
        return ddp__fail_to(err, DDP_ERR_INIT, "DDP_AUTH_TOKEN is set, but %s did not answer the authentication (%s): "
                            "does its process run without DDP_AUTH_TOKEN (every rank needs the same token), or is it another program "
                            "that does not speak ddp.h's protocols?", who, why);
    ddp__auth_proof(token, "server", hello + 8, reply, want);
    if (!ddp__auth_equal(want, reply + DDP__AUTH_NONCE, DDP__AUTH_MAC))
        return ddp__fail_to(err, DDP_ERR_INIT, "%s does not know this process's DDP_AUTH_TOKEN (its proof is wrong): every "
                            "rank needs the same token; refusing to talk to it", who);
    ddp__auth_proof(token, "client", hello + 8, reply, want);
    if (ddp__net_send(fd, want, sizeof want, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, &verdict, 1, deadline, why) != DDP_SUCCESS || verdict != 1)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s refused this process's DDP_AUTH_TOKEN: every rank needs the same token", who);
    return DDP_SUCCESS;
}

/* Server side, step 1: hello (8 + 16 bytes) -> reply (16 + 32 bytes); keeps cn and sn for step 2.
   0, or -1 when hello is not an authentication hello. */
static int ddp__auth_answer(const char *token, const unsigned char *hello, unsigned char *cn, unsigned char *sn,
                            unsigned char *reply) {
    if (memcmp(hello, DDP__AUTH_MAGIC, 8) != 0) return -1;
    memcpy(cn, hello + 8, DDP__AUTH_NONCE);
    ddp__auth_nonce(sn);
    memcpy(reply, sn, DDP__AUTH_NONCE);
    ddp__auth_proof(token, "server", cn, sn, reply + DDP__AUTH_NONCE);
    return 0;
}

/* Server side, step 2: is the client's proof right? */
static int ddp__auth_check(const char *token, const unsigned char *cn, const unsigned char *sn, const unsigned char *proof) {
    unsigned char want[DDP__AUTH_MAC];
    ddp__auth_proof(token, "client", cn, sn, want);
    return ddp__auth_equal(want, proof, DDP__AUTH_MAC);
}

/* Server side, blocking (a rank's mesh listener): 0 when the client proved the token, else -1 with
   the reason in err. */
static int ddp__auth_server(int fd, const char *token, double deadline, char *err) {
    unsigned char hello[8 + DDP__AUTH_NONCE], reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], proof[DDP__AUTH_MAC];
    unsigned char cn[DDP__AUTH_NONCE], sn[DDP__AUTH_NONCE], verdict;
    char why[DDP__ERR_MAX];
    if (ddp__net_recv(fd, hello, sizeof hello, deadline, why) != DDP_SUCCESS || ddp__auth_answer(token, hello, cn, sn, reply) != 0) {
        snprintf(err, DDP__ERR_MAX, "it did not authenticate (no DDP_AUTH_TOKEN on its side?)");
        return -1;
    }
    if (ddp__net_send(fd, reply, sizeof reply, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, proof, sizeof proof, deadline, why) != DDP_SUCCESS) {
        snprintf(err, DDP__ERR_MAX, "it broke off the authentication (%.900s)", why);
        return -1;
    }
    verdict = (unsigned char)ddp__auth_check(token, cn, sn, proof);
    ddp__net_send(fd, &verdict, 1, deadline, why);
    if (!verdict) snprintf(err, DDP__ERR_MAX, "its DDP_AUTH_TOKEN is different");
    return verdict ? 0 : -1;
}
/* ==================== end src/auth.c ==================== */

/* ==================== begin src/store.c ==================== */
/* [SECTION] store: rendezvous key-value store (c10d TCPStore protocols of torch 1.13 and 2.x), file store
   Mirrors torch.distributed.TCPStore (torch/csrc/distributed/c10d/TCPStore.cpp, torch 1.13; torch 2.x's
   TCPStoreBackend.cpp and TCPStoreLibUvBackend.cpp) and torch.distributed.FileStore. torch 2.x's protocol
   is the one below with VALIDATE (00 + uint32 0x3C85F7CE, no reply) first on every connection, the query
   numbers moved (see DDP__V2_* and ddp__store_wire_type) and APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT and
   PING added; its replies are the same. The server tells the two apart by each connection's first query;
   the client finds out which one the server speaks on connecting (ddp__tcp_detect). Every group rendezvouses through one store: rank 0 serves it on a background
   thread, every rank (rank 0 too) is a client of it.

   Wire protocol (torch 1.13; no handshake; integers native-endian; a "string" is a uint64 length + bytes):
       SET         00 | key | value                      -> (no reply)
       COMPARE_SET 01 | key | expected | desired         -> value the key holds afterwards (string)
       GET         02 | key                              -> value (string); the key must exist
       ADD         03 | key | int64 delta                -> int64 new value (stored as decimal text)
       CHECK       04 | uint64 n | n keys                -> 1 byte: 0 all exist, 1 not all
       WAIT        05 | uint64 n | n keys                -> 1 byte 0 (STOP_WAITING) once all exist
       GETNUMKEYS  06                                    -> int64
       DELETE_KEY  08 | key                              -> int64 keys deleted (0 or 1)
   (07 is WATCH_KEY, torch's experimental callbacks: not supported, the client is disconnected.)
   A client's get is WAIT then GET, as torch's is. torch's client puts "/" before every key, and the 1.13
   client sends ADD("init/", 1) right after connecting when given a world size; it also opens a second,
   idle connection for watch_key callbacks.

   Server: one thread, an epoll set (Linux, as the rest of ddp.h) of the listening socket (backlog SOMAXCONN,
   net.c), a self-pipe (stop) and every client, so a round costs what the ready clients cost, not the number
   connected (thousands of ranks at a rendezvous). Each round handles the clients with events, then flushes
   and re-arms (EPOLLIN unless replies piled up, EPOLLOUT while replies wait) only the clients it touched:
   those with events and those a reply was queued for (a WAIT woken by another client's SET). Each client has
   an input buffer (requests are parsed once complete, so a slow or hostile client never blocks the others),
   an output buffer (sent as the socket drains) and at most one pending WAIT: the keys still missing. A SET,
   ADD or COMPARE_SET that creates a key removes it from every pending WAIT (torch's server forgets
   COMPARE_SET here), and a WAIT left with no missing key gets its STOP_WAITING byte. A new WAIT from a
   client replaces its pending one (torch's server would keep both and later send a stray byte). Everything a client can make the server allocate is bounded (key length,
   value length, keys per WAIT/CHECK, and one budget for stored data plus buffers); a client that breaks a
   limit or the protocol is disconnected and logged, and the server goes on serving the others.

   Budget and shares (ddp__srv_room): the budget B (1 GiB; DDP_STORE_MAX_BYTES) bounds stored keys and values
   plus every buffer. Each stored entry (key, value and its bookkeeping) is charged to the connection that
   last wrote it (SET, ADD, COMPARE_SET, APPEND, MULTI_SET; an overwrite by another connection moves the
   charge, DELETE takes it off). A write is refused when it would take its connection over its share, B/8,
   or the store over B - B/8; the last eighth is kept for small entries (up to 64 KiB: rendezvous addresses,
   counters), so ranks can still meet when big values filled the rest. A write that does not make its
   connection or the store hold more is never refused. Keys outlive their writer, as in torch: when a
   connection closes, its entries stay and count against the budget, charged to no one. A client that
   reconnects gets a fresh share; the budget still bounds the total.

   Refusals (ddp.h's own extension; torch's protocol has no error answer): a client that can take a refusal
   says so before a request by sending CHECK of the single key DDP__STORE_ANNOUNCE ("\0ddp.h/status": no
   C-string key can equal it). ddp.h's server then answers that request with a status byte first, in place
   of the CHECK's answer: DDP__STATUS_DONE (0) and the request's usual answer, or DDP__STATUS_REFUSED (2), an
   int32 ddp_result, a string saying why, and nothing else (the refused write changed nothing, though a
   MULTI_SET keeps the keys before it; the connection stays in step). A torch server answers the CHECK itself (0 or 1) and then the request, so the client reads one
   byte either way. A client that did not announce (torch's) has no way to hear a refusal: it is
   disconnected instead, with the reason in the server's log, which it sees as a closed connection.
   Refused: a write over a share or the budget ("full", DDP_ERR_OUT_OF_MEMORY), an ADD to a value that is
   no integer (DDP_ERR_STATE) or whose sum does not fit in int64 (DDP_ERR_INVALID_ARGUMENT; torch's
   std::stoll + int64 addition overflows, in practice wrapping around: ddp.h never wraps).

   Client: blocking calls on one connection, each bounded by the store's timeout. SET, ADD and COMPARE_SET
   are announced (see "Refusals"), so a set waits for its status byte: one round trip (~30 us on one host;
   torch's set does not wait), and a refused write fails the call that made it. A call that fails midway
   (timeout, lost connection) leaves the stream in an unknown state, so the connection is closed and the next
   call connects again.

   File store (init_method "file:///path"): an append-only log of SET/DELETE records in one file on a shared
   filesystem, read and written under flock(). Each handle replays the records it has not seen yet into a
   hash table; get and wait poll the file with backoff until the deadline; add reads and appends under the
   exclusive lock, so it is atomic. Each opener adds 1 to a reference key and takes 1 off when it closes:
   the one that brings it to 0 deletes the file, as FileStore does, so every user must open it before any
   closes it (a rendezvous guarantees that). A file left by a crashed run still holds that run's keys: use a
   fresh path for each run, as with FileStore. The format is ddp.h's own. */
#include <sys/epoll.h>

#define DDP__STORE_MAX_KEY ((size_t)4096)           /* bytes in one key, prefix included */
#define DDP__STORE_MAX_VALUE ((size_t)64 << 20)     /* bytes in one value */
#define DDP__STORE_MAX_WAIT_KEYS ((uint64_t)16384)  /* keys in one WAIT or CHECK */
#define DDP__STORE_MAX_HELD ((size_t)1 << 30)       /* server: stored keys and values plus every buffer */
#define DDP__STORE_MIN_HELD ((size_t)1 << 20)       /* the least DDP_STORE_MAX_BYTES may set */
#define DDP__STORE_SMALL_ENTRY ((size_t)64 << 10)   /* entries that may use the budget's reserved last eighth */
#define DDP__STORE_ANNOUNCE "\0ddp.h/status"        /* CHECK of this key alone: answer my next request's status */
#define DDP__STORE_ANNOUNCE_LEN ((size_t)13)
#define DDP__STATUS_DONE 0
#define DDP__STATUS_REFUSED 2
#define DDP__STORE_OUT_HIGH ((size_t)1 << 20)       /* server: replies piled up for a client that does not read */
#define DDP__STORE_FILE_REFS "ddp/file_store_users" /* file store: how many handles have it open */
#define DDP__STORE_FILE_MAGIC "DDPFS001"            /* file store: the first 8 bytes of the file */

/* torch 1.13's c10d::QueryType, CheckResponseType and WaitResponseType. */
#define DDP__Q_SET 0
#define DDP__Q_COMPARE_SET 1
#define DDP__Q_GET 2
#define DDP__Q_ADD 3
#define DDP__Q_CHECK 4
#define DDP__Q_WAIT 5
#define DDP__Q_GETNUMKEYS 6
#define DDP__Q_WATCH_KEY 7
#define DDP__Q_DELETE_KEY 8
#define DDP__CHECK_READY 0
#define DDP__CHECK_NOT_READY 1
#define DDP__WAIT_STOP_WAITING 0
#define DDP__WAIT_CANCELED 1
/* Queries only torch 2.x's protocol has, by the numbers this file uses inside (never on the wire as these). */
#define DDP__Q_VALIDATE 0x40
#define DDP__Q_APPEND 0x41
#define DDP__Q_MULTI_GET 0x42
#define DDP__Q_MULTI_SET 0x43
#define DDP__Q_CANCEL_WAIT 0x44
#define DDP__Q_PING 0x45
#define DDP__Q_UNKNOWN 0xff
/* torch 2.x (c10d::detail::QueryType in TCPStoreBackend.hpp): VALIDATE 0, SET 1, COMPARE_SET 2, GET 3, ADD 4,
   CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13,
   then QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS (not served here). Every connection's first query is
   VALIDATE with this magic (a uint32); VALIDATE has no reply. */
#define DDP__V2_MAGIC 0x3C85F7CEu
#define DDP__V2_VALIDATE 0
#define DDP__V2_PING 13

/* The wire byte of query q (1.13 numbering above) in protocol proto (1: torch 1.13, 2: torch 2.x). */
static unsigned char ddp__store_wire_type(int proto, int q) {
    if (proto != 2) return (unsigned char)q;
    switch (q) {
    case DDP__Q_DELETE_KEY: return 8;
    case DDP__Q_APPEND: return 9;
    case DDP__Q_MULTI_GET: return 10;
    case DDP__Q_MULTI_SET: return 11;
    case DDP__Q_CANCEL_WAIT: return 12;
    case DDP__Q_PING: return DDP__V2_PING;
    case DDP__Q_VALIDATE: return DDP__V2_VALIDATE;
    default: return (unsigned char)(q + 1); /* SET .. GETNUMKEYS moved up by one */
    }
}

/* The query a wire byte stands for in protocol proto (DDP__Q_UNKNOWN when none). */
static int ddp__store_query_of(int proto, unsigned char b) {
    if (proto != 2) return b <= DDP__Q_DELETE_KEY ? b : DDP__Q_UNKNOWN;
    switch (b) {
    case DDP__V2_VALIDATE: return DDP__Q_VALIDATE;
    case 8: return DDP__Q_DELETE_KEY;
    case 9: return DDP__Q_APPEND;
    case 10: return DDP__Q_MULTI_GET;
    case 11: return DDP__Q_MULTI_SET;
    case 12: return DDP__Q_CANCEL_WAIT;
    case DDP__V2_PING: return DDP__Q_PING;
    default: return b >= 1 && b <= 7 ? b - 1 : DDP__Q_UNKNOWN;
    }
}

/* ---- pieces shared by the server, the client and the file store ---- */

/* A printable copy of a key for messages: other bytes as \xNN, long keys cut short with "...". */
static const char *ddp__store_key_text(const void *key, size_t n, char *buf, size_t cap) {
    const unsigned char *k = (const unsigned char *)key;
    size_t i, o = 0;
    for (i = 0; i < n; i++) {
        if (o + 8 >= cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        if (k[i] >= 0x20 && k[i] < 0x7f && k[i] != '\\')
            buf[o++] = (char)k[i];
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", k[i]);
    }
    buf[o] = '\0';
    return buf;
}

/* FNV-1a: keys are short, and the table only needs an even spread. */
static uint64_t ddp__store_hash(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* ADD's reading of the value it adds to, as torch's std::stoll: optional space and sign, decimal digits,
   anything after them ignored. Returns 0, or -1 when there is no number or it does not fit in int64. */
static int ddp__store_parse_int(const unsigned char *v, size_t n, int64_t *out) {
    size_t i = 0;
    int neg = 0, digits = 0;
    uint64_t x = 0, limit;
    while (i < n && (v[i] == ' ' || (v[i] >= '\t' && v[i] <= '\r'))) i++;
    if (i < n && (v[i] == '+' || v[i] == '-')) neg = v[i++] == '-';
    limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; i < n && v[i] >= '0' && v[i] <= '9'; i++, digits++) {
        uint64_t d = (uint64_t)(v[i] - '0');
        if (x > (limit - d) / 10) return -1;
        x = x * 10 + d;
    }
    if (!digits) return -1;
    *out = neg ? (int64_t)(0 - x) : (int64_t)x;
    return 0;
}

/* old + delta, unless it does not fit in int64 (returns -1 then). */
static int ddp__store_add_int(int64_t old, int64_t delta, int64_t *sum) {
    if ((delta > 0 && old > INT64_MAX - delta) || (delta < 0 && old < INT64_MIN - delta)) return -1;
    *sum = old + delta;
    return 0;
}

/* ---- a hash table of byte-string keys and values (the server's data, a file store's replayed state) ---- */

typedef struct ddp__kv {
    struct ddp__kv *next;
    void *owner; /* server: the ddp__store_conn charged for it (NULL: its writer left; always NULL in a file store) */
    uint64_t hash;
    size_t key_len, value_len;
    unsigned char *value;
    char *key; /* allocated with the entry, right after it */
} ddp__kv;

typedef struct ddp__kv_table {
    ddp__kv **slots;
    size_t nslots, count;
    size_t bytes; /* entries, keys and values: what the server counts against its budget */
} ddp__kv_table;

#define DDP__KV_ENTRY_BYTES(klen, vlen) (sizeof(ddp__kv) + (klen) + (vlen))

static ddp__kv *ddp__kv_find(const ddp__kv_table *t, const void *key, size_t n, uint64_t h) {
    ddp__kv *e;
    if (!t->nslots) return NULL;
    for (e = t->slots[h & (t->nslots - 1)]; e; e = e->next)
        if (e->hash == h && e->key_len == n && memcmp(e->key, key, n) == 0) return e;
    return NULL;
}

static int ddp__kv_grow(ddp__kv_table *t) {
    size_t n = t->nslots ? t->nslots * 2 : 64, i;
    ddp__kv **slots = (ddp__kv **)ddp__calloc(n, sizeof *slots);
    if (!slots) return -1;
    for (i = 0; i < t->nslots; i++) {
        ddp__kv *e = t->slots[i], *next;
        for (; e; e = next) {
            next = e->next;
            e->next = slots[e->hash & (n - 1)];
            slots[e->hash & (n - 1)] = e;
        }
    }
    ddp__free(t->slots);
    t->slots = slots;
    t->nslots = n;
    return 0;
}

/* Store value (malloc'd; the table takes it, and frees it on failure) under key.
   Returns 1 when the key was created, 0 when replaced, -1 when out of memory. */
static int ddp__kv_put(ddp__kv_table *t, const void *key, size_t n, uint64_t h, unsigned char *value, size_t vlen) {
    ddp__kv *e = ddp__kv_find(t, key, n, h);
    if (e) {
        t->bytes = t->bytes - e->value_len + vlen;
        ddp__free(e->value);
        e->value = value;
        e->value_len = vlen;
        return 0;
    }
    if ((t->count >= t->nslots && ddp__kv_grow(t) != 0) ||
        !(e = (ddp__kv *)ddp__malloc(sizeof *e + n))) {
        ddp__free(value);
        return -1;
    }
    e->hash = h;
    e->owner = NULL;
    e->key = (char *)(e + 1);
    memcpy(e->key, key, n);
    e->key_len = n;
    e->value = value;
    e->value_len = vlen;
    e->next = t->slots[h & (t->nslots - 1)];
    t->slots[h & (t->nslots - 1)] = e;
    t->count++;
    t->bytes += DDP__KV_ENTRY_BYTES(n, vlen);
    return 1;
}

/* Returns 1 when the key was there. */
static int ddp__kv_remove(ddp__kv_table *t, const void *key, size_t n, uint64_t h) {
    ddp__kv **link, *e;
    if (!t->nslots) return 0;
    for (link = &t->slots[h & (t->nslots - 1)]; (e = *link) != NULL; link = &e->next) {
        if (e->hash != h || e->key_len != n || memcmp(e->key, key, n) != 0) continue;
        *link = e->next;
        t->count--;
        t->bytes -= DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
        ddp__free(e->value);
        ddp__free(e);
        return 1;
    }
    return 0;
}

static void ddp__kv_clear(ddp__kv_table *t) {
    size_t i;
    for (i = 0; i < t->nslots; i++) {
        ddp__kv *e = t->slots[i], *next;
        for (; e; e = next) {
            next = e->next;
            ddp__free(e->value);
            ddp__free(e);
        }
    }
    ddp__free(t->slots);
    memset(t, 0, sizeof *t);
}

/* A copy of n bytes (NULL when out of memory). */
static unsigned char *ddp__store_dup(const void *p, size_t n) {
    unsigned char *d = (unsigned char *)ddp__malloc(n);
    if (d && n) memcpy(d, p, n);
    return d;
}

/* ---- reading a request whose bytes are all there ---- */

typedef struct ddp__rd {
    const unsigned char *p;
    size_t n, at;
} ddp__rd;

static uint64_t ddp__rd_u64(ddp__rd *r) {
    uint64_t v;
    memcpy(&v, r->p + r->at, 8);
    r->at += 8;
    return v;
}

static const unsigned char *ddp__rd_str(ddp__rd *r, size_t *len) {
    *len = (size_t)ddp__rd_u64(r);
    r->at += *len;
    return r->p + r->at - *len;
}

/* ======================================== server ======================================== */

typedef struct ddp__store_wait_key {
    uint64_t hash;
    size_t off, len; /* in the connection's wait_blob */
} ddp__store_wait_key;

typedef struct ddp__store_conn {
    int fd, dead;
    int closed;            /* the client closed its side: handle what it sent, then drop it */
    int ready;             /* requests may be waiting in `in` while replies pile up in `out` */
    char peer[80];         /* address:port, for the log */
    unsigned char *in;     /* received bytes not yet handled */
    size_t in_len, in_cap, need;
    unsigned char *out;    /* replies not yet sent: out[out_off .. out_len) */
    size_t out_off, out_len, out_cap;
    int auth;              /* DDP_AUTH_TOKEN: 1 awaiting the hello, 2 awaiting the proof, 0 authenticated/off */
    int proto;             /* 0 until its first query, then 1 (torch 1.13's protocol) or 2 (torch 2.x's) */
    unsigned char auth_cn[16], auth_sn[16];
    ddp__store_wait_key *waits; /* the pending WAIT's missing keys */
    size_t nwaits, wait_bytes;
    unsigned char *wait_blob;
    size_t held;           /* bytes of the stored entries charged to it (see ddp__srv_room) */
    int announced;         /* it sent DDP__STORE_ANNOUNCE: its next request gets a status byte */
    int status_due;        /* the request being handled was announced and its status byte is not sent yet */
    int refused;           /* the request being handled was refused */
    size_t slot;           /* its index in the server's conns */
    int touched;           /* on the server's touched list this round */
    unsigned events;       /* what its epoll entry waits for now */
} ddp__store_conn;

struct ddp__store_server {
    int listen_fd, port;
    int pipe_rd, pipe_wr; /* stop signal */
    pthread_t thread;
    ddp_log_level log_level;
    char where[96];
    ddp__kv_table kv;
    ddp__store_conn **conns;
    size_t nconns, cap_conns;
    ddp__store_conn **touched; /* clients to flush and re-arm at the end of the round (capacity cap_conns) */
    size_t ntouched;
    int epfd;
    size_t buffers; /* bytes of connections, their buffers and pending waits */
    size_t max_held; /* the budget: kv.bytes + buffers stay under it (DDP_STORE_MAX_BYTES) */
    size_t share;    /* what one connection may be charged for: max_held / 8 */
    size_t reserve;  /* the budget's last part, for small entries only: max_held / 8 */
    double accept_paused_until;
    int out_of_fds; /* accept is failing with EMFILE/ENFILE: said once per episode */
    /* ddp_init's rendezvous keys (ddp__store_server_abort_key), while a rendezvous is on: where the
       server itself publishes "it cannot accept a rank", so that every rank fails with the reason */
    char abort_key[256], table_key[256], ready_key[256];
    int abort_key_set;
    char *token; /* DDP_AUTH_TOKEN when the server started; NULL = no authentication */
    uint64_t requests, connections; /* served and accepted so far: ddp__store_server_stats */
};

static void ddp__srv_log(const ddp__store_server *s, ddp_log_level level, const char *fmt, ...) DDP__PRINTF(3, 4);
static void ddp__srv_log(const ddp__store_server *s, ddp_log_level level, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    if (level > s->log_level || s->log_level == DDP_LOG_NONE) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ddp__log(NULL, level, "store server on %s: %s", s->where, msg);
}

/* c needs a look at the end of this round (flush, re-arm, or free): at most once on the list. */
static void ddp__srv_touch(ddp__store_server *s, ddp__store_conn *c) {
    if (c->touched) return;
    c->touched = 1;
    s->touched[s->ntouched++] = c;
}

/* Stop serving c (it is closed at the end of the loop round); level WARN for clients that broke a limit or
   the protocol, DEBUG for ordinary disconnects. */
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...)
    DDP__PRINTF(4, 5);
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...) {
    char why[DDP__ERR_MAX / 2];
    va_list ap;
    if (c->dead) return;
    c->dead = 1;
    ddp__srv_touch(s, c); /* freed at the end of the round */
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ddp__srv_log(s, level, "disconnecting the client at %s: %s", c->peer, why);
}

static int ddp__srv_over_budget(const ddp__store_server *s, size_t more) {
    return s->kv.bytes + s->buffers + more > s->max_held;
}

/* The budget and what follows from it (see "Budget and shares" above). */
static void ddp__srv_set_budget(ddp__store_server *s, size_t max_held) {
    s->max_held = max_held;
    s->share = max_held / 8;
    s->reserve = max_held / 8;
}

/* DDP_STORE_MAX_BYTES, or the default budget. */
static ddp_result ddp__srv_budget_setting(size_t *max_held, char *err) {
    long v = 0;
    int got = ddp__env_int("DDP_STORE_MAX_BYTES", (long)DDP__STORE_MIN_HELD, LONG_MAX, &v, err);
    if (got < 0) return DDP_ERR_INIT;
    *max_held = got ? (size_t)v : DDP__STORE_MAX_HELD;
    return DDP_SUCCESS;
}

/* Bytes as "3.5 MiB", "12 KiB" or "100 bytes", for messages. */
static const char *ddp__srv_bytes_text(size_t n, char *buf, size_t cap) {
    if (n >= ((size_t)1 << 20)) snprintf(buf, cap, "%.1f MiB", (double)n / (1 << 20));
    else if (n >= 1024) snprintf(buf, cap, "%.1f KiB", (double)n / 1024);
    else snprintf(buf, cap, "%zu bytes", n);
    return buf;
}

/* Grow one of c's buffers to at least need bytes within the budget; on failure c is dropped and -1 returned. */
static int ddp__srv_grow(ddp__store_server *s, ddp__store_conn *c, unsigned char **buf, size_t *cap, size_t need) {
    size_t want = DDP__MAX(need, *cap + *cap / 2);
    void *p;
    if (need <= *cap) return 0;
    if (ddp__srv_over_budget(s, want - *cap)) want = need;
    if (ddp__srv_over_budget(s, want - *cap)) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "the store would hold more than its budget of %zu bytes of data and "
                                          "buffers (DDP_STORE_MAX_BYTES sets it)", s->max_held);
        return -1;
    }
    p = DDP_REALLOC(*buf, want);
    if (!p) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "out of memory for a %zu-byte buffer", want);
        return -1;
    }
    s->buffers += want - *cap;
    *buf = (unsigned char *)p;
    *cap = want;
    return 0;
}

/* Give back a large buffer once it is empty, so an idle client holds little. */
static void ddp__srv_trim(ddp__store_server *s, unsigned char **buf, size_t *cap) {
    if (*cap <= 65536) return;
    DDP_FREE(*buf);
    *buf = NULL;
    s->buffers -= *cap;
    *cap = 0;
}

/* Append a reply of two parts (b may be empty) to c's output. */
static void ddp__srv_queue(ddp__store_server *s, ddp__store_conn *c, const void *a, size_t an, const void *b,
                           size_t bn) {
    if (c->dead) return;
    ddp__srv_touch(s, c); /* its reply goes out at the end of the round */
    if (c->out_off > 0) {
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
    }
    if (ddp__srv_grow(s, c, &c->out, &c->out_cap, c->out_len + an + bn) != 0) return;
    memcpy(c->out + c->out_len, a, an);
    if (bn) memcpy(c->out + c->out_len + an, b, bn);
    c->out_len += an + bn;
}

/* The announced request being handled was done: say so, once. */
static void ddp__srv_status_done(ddp__store_server *s, ddp__store_conn *c) {
    static const unsigned char done = DDP__STATUS_DONE;
    if (!c->status_due) return;
    c->status_due = 0;
    ddp__srv_queue(s, c, &done, 1, NULL, 0);
}

/* Queue a reply of two parts (b may be empty), after the status byte when the request was announced. */
static void ddp__srv_reply(ddp__store_server *s, ddp__store_conn *c, const void *a, size_t an, const void *b,
                           size_t bn) {
    ddp__srv_status_done(s, c);
    ddp__srv_queue(s, c, a, an, b, bn);
}

/* Refuse the request being handled (it must change nothing). A client that announced it hears why: status
   DDP__STATUS_REFUSED, code (int32) and the message, and stays connected; any other is disconnected, with
   the message in the log. Also when the status byte went out already (a reply came first): the stream
   could not stay in step. */
static void ddp__srv_refuse(ddp__store_server *s, ddp__store_conn *c, ddp_result code, const char *fmt, ...)
    DDP__PRINTF(4, 5);
static void ddp__srv_refuse(ddp__store_server *s, ddp__store_conn *c, ddp_result code, const char *fmt, ...) {
    char why[512];
    unsigned char head[13];
    int32_t code32 = (int32_t)code;
    uint64_t len;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    c->refused = 1;
    if (!c->status_due) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "refused: %s (it did not announce that it can take a refusal)", why);
        return;
    }
    c->status_due = 0;
    ddp__srv_log(s, DDP_LOG_INFO, "refused a request of the client at %s: %s", c->peer, why);
    len = strlen(why);
    head[0] = DDP__STATUS_REFUSED;
    memcpy(head + 1, &code32, 4);
    memcpy(head + 5, &len, 8);
    ddp__srv_queue(s, c, head, sizeof head, why, (size_t)len);
}

static void ddp__srv_reply_u64(ddp__store_server *s, ddp__store_conn *c, uint64_t v) {
    ddp__srv_reply(s, c, &v, 8, NULL, 0);
}

static void ddp__srv_reply_byte(ddp__store_server *s, ddp__store_conn *c, unsigned char v) {
    ddp__srv_reply(s, c, &v, 1, NULL, 0);
}

static void ddp__srv_clear_wait(ddp__store_server *s, ddp__store_conn *c) {
    s->buffers -= c->wait_bytes;
    ddp__free(c->waits);
    ddp__free(c->wait_blob);
    c->waits = NULL;
    c->wait_blob = NULL;
    c->nwaits = c->wait_bytes = 0;
}

/* key was just created: take it off every pending WAIT, and answer those that have nothing left to wait for. */
static void ddp__srv_wake(ddp__store_server *s, const void *key, size_t n, uint64_t h) {
    size_t i, j;
    for (i = 0; i < s->nconns; i++) {
        ddp__store_conn *c = s->conns[i];
        if (c->dead || !c->nwaits) continue;
        for (j = 0; j < c->nwaits; j++) {
            ddp__store_wait_key *w = &c->waits[j];
            if (w->hash != h || w->len != n || memcmp(c->wait_blob + w->off, key, n) != 0) continue;
            c->waits[j--] = c->waits[--c->nwaits];
        }
        if (c->nwaits) continue;
        ddp__srv_clear_wait(s, c);
        ddp__srv_reply_byte(s, c, DDP__WAIT_STOP_WAITING);
    }
}

/* Take entry e's charge off the connection that holds it. */
static void ddp__srv_uncharge(ddp__kv *e) {
    if (e && e->owner) ((ddp__store_conn *)e->owner)->held -= DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
    if (e) e->owner = NULL;
}

/* Charge entry e to c (after ddp__srv_uncharge, or when new). */
static void ddp__srv_charge(ddp__kv *e, ddp__store_conn *c) {
    e->owner = c;
    c->held += DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
}

/* May c make key's entry `after` bytes (the entry `old` is there now, or NULL)? Refused, with the numbers,
   when it would take c over its share or the store over its budget (without the reserve unless the entry
   is small), and it would hold more than before. Returns 0 when there is room, -1 when refused. */
static int ddp__srv_room(ddp__store_server *s, ddp__store_conn *c, const ddp__kv *old, size_t after,
                         const unsigned char *key, size_t klen) {
    size_t before = old ? DDP__KV_ENTRY_BYTES(old->key_len, old->value_len) : 0;
    size_t mine = c->held - (old && old->owner == c ? before : 0) + after;
    size_t total = s->kv.bytes + s->buffers, total_after = total - before + after;
    size_t limit = after <= DDP__STORE_SMALL_ENTRY ? s->max_held : s->max_held - s->reserve;
    char name[64], a[32], b[32], d[32], e[32];
    ddp__store_key_text(key, klen, name, sizeof name);
    ddp__srv_bytes_text(after, a, sizeof a);
    if (mine > s->share && mine > c->held) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "this client holds %s of keys and values; storing key '%s' (%s) "
                                                     "would take it over its share, %s, an eighth of the store's "
                                                     "budget of %s",
                        ddp__srv_bytes_text(c->held, b, sizeof b), name, a,
                        ddp__srv_bytes_text(s->share, d, sizeof d), ddp__srv_bytes_text(s->max_held, e, sizeof e));
        return -1;
    }
    if (total_after > limit && total_after > total) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the store holds %s of its budget of %s; storing key '%s' (%s) "
                                                     "would take it over%s",
                        ddp__srv_bytes_text(total, b, sizeof b), ddp__srv_bytes_text(s->max_held, d, sizeof d), name,
                        a, limit < s->max_held ? " the part not kept for small keys" : "");
        return -1;
    }
    return 0;
}

/* Store value under key for client c, within its share and the budget. Returns 0, or -1 when refused. */
static int ddp__srv_store(ddp__store_server *s, ddp__store_conn *c, const unsigned char *key, size_t klen,
                          const unsigned char *value, size_t vlen) {
    uint64_t h = ddp__store_hash(key, klen);
    ddp__kv *old = ddp__kv_find(&s->kv, key, klen, h);
    unsigned char *copy;
    int created;
    if (ddp__srv_room(s, c, old, DDP__KV_ENTRY_BYTES(klen, vlen), key, klen) != 0) return -1;
    copy = ddp__store_dup(value, vlen);
    if (!copy) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory storing %zu bytes", vlen);
        return -1;
    }
    ddp__srv_uncharge(old); /* replacing cannot fail, and creating leaves no old entry behind */
    created = ddp__kv_put(&s->kv, key, klen, h, copy, vlen);
    if (created < 0) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory storing %zu bytes", vlen);
        return -1;
    }
    ddp__srv_charge(ddp__kv_find(&s->kv, key, klen, h), c);
    if (created) ddp__srv_wake(s, key, klen, h);
    return 0;
}

/* ---- parsing: is a whole request there, and does it keep to the limits? ---- */

#define DDP__REQ_BAD (-1)
#define DDP__REQ_MORE 0
#define DDP__REQ_DONE 1

/* Step over a length-prefixed field of at most limit bytes. */
static int ddp__srv_field(ddp__rd *r, size_t limit, const char *what, size_t *size, char *why, size_t why_cap) {
    uint64_t len;
    if (r->n - r->at < 8) {
        *size = r->at + 8;
        return DDP__REQ_MORE;
    }
    memcpy(&len, r->p + r->at, 8);
    if (len > limit) {
        snprintf(why, why_cap, "it sent a %s of %llu bytes (the limit is %zu)", what, (unsigned long long)len, limit);
        return DDP__REQ_BAD;
    }
    if (r->n - r->at - 8 < len) {
        *size = r->at + 8 + (size_t)len;
        return DDP__REQ_MORE;
    }
    r->at += 8 + (size_t)len;
    return DDP__REQ_DONE;
}

/* A count of keys (WAIT, CHECK) followed by the keys. */
static int ddp__srv_keys(ddp__rd *r, size_t *size, char *why, size_t why_cap) {
    uint64_t n, i;
    int st;
    if (r->n - r->at < 8) {
        *size = r->at + 8;
        return DDP__REQ_MORE;
    }
    memcpy(&n, r->p + r->at, 8);
    if (n > DDP__STORE_MAX_WAIT_KEYS) {
        snprintf(why, why_cap, "it asked about %llu keys at once (the limit is %llu)", (unsigned long long)n,
                 (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
        return DDP__REQ_BAD;
    }
    r->at += 8;
    for (i = 0; i < n; i++)
        if ((st = ddp__srv_field(r, DDP__STORE_MAX_KEY, "key", size, why, why_cap)) != DDP__REQ_DONE) return st;
    return DDP__REQ_DONE;
}

/* How many bytes the request at p[0 .. n) takes. DDP__REQ_DONE: *size bytes, complete. DDP__REQ_MORE:
   incomplete, and *size is how many bytes it takes at least. DDP__REQ_BAD: why says what is wrong. */
static int ddp__srv_parse(int proto, const unsigned char *p, size_t n, size_t *size, char *why, size_t why_cap) {
    ddp__rd r;
    int st = DDP__REQ_DONE;
    uint64_t count, i;
    if (n < 1) {
        *size = 1;
        return DDP__REQ_MORE;
    }
    r.p = p;
    r.n = n;
    r.at = 1;
    switch (ddp__store_query_of(proto, p[0])) {
    case DDP__Q_VALIDATE:
    case DDP__Q_PING:
        if (n < 5) {
            *size = 5;
            return DDP__REQ_MORE;
        }
        r.at = 5;
        break;
    case DDP__Q_SET:
    case DDP__Q_APPEND:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        break;
    case DDP__Q_COMPARE_SET:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        break;
    case DDP__Q_GET:
    case DDP__Q_DELETE_KEY:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        break;
    case DDP__Q_ADD:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE && r.n - r.at < 8) {
            *size = r.at + 8;
            return DDP__REQ_MORE;
        }
        r.at += 8;
        break;
    case DDP__Q_CHECK:
    case DDP__Q_WAIT:
    case DDP__Q_MULTI_GET:
        st = ddp__srv_keys(&r, size, why, why_cap);
        break;
    case DDP__Q_MULTI_SET:
        if (n < 9) {
            *size = 9;
            return DDP__REQ_MORE;
        }
        count = ddp__rd_u64(&r);
        if (count > DDP__STORE_MAX_WAIT_KEYS) {
            snprintf(why, why_cap, "it set %llu keys at once (the limit is %llu)", (unsigned long long)count,
                     (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
            return DDP__REQ_BAD;
        }
        for (i = 0; i < count && st == DDP__REQ_DONE; i++) {
            st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
            if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        }
        break;
    case DDP__Q_GETNUMKEYS:
    case DDP__Q_CANCEL_WAIT:
        break;
    case DDP__Q_WATCH_KEY:
        snprintf(why, why_cap, "it asked for watch_key (torch's experimental key callbacks), which ddp.h's store "
                               "does not serve");
        return DDP__REQ_BAD;
    default:
        if (proto == 2)
            snprintf(why, why_cap, "it sent torch 2.x's query type %u, which ddp.h's store does not serve (it serves "
                                   "0 VALIDATE to 13 PING, not QUEUE_* or LIST_KEYS)", p[0]);
        else
            snprintf(why, why_cap, "it sent the unknown query type 0x%02x (ddp.h's store speaks torch 1.13's TCPStore "
                                   "protocol, and torch 2.x's, whose first query is VALIDATE)", p[0]);
        return DDP__REQ_BAD;
    }
    if (st == DDP__REQ_DONE) *size = r.at;
    return st;
}

/* ---- handling a complete request ---- */

static int ddp__srv_have_all(const ddp__store_server *s, ddp__rd *r, uint64_t n) {
    int all = 1;
    uint64_t i;
    for (i = 0; i < n; i++) {
        size_t klen;
        const unsigned char *k = ddp__rd_str(r, &klen);
        if (all && !ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen))) all = 0;
    }
    return all;
}

/* WAIT: answer at once when every key exists, else remember the missing ones (replacing any earlier WAIT of
   this client: a client has one request in flight). */
static void ddp__srv_wait(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    uint64_t n = ddp__rd_u64(r), i;
    size_t first = r->at, blob = 0, bytes;
    ddp__srv_clear_wait(s, c);
    if (ddp__srv_have_all(s, r, n)) {
        ddp__srv_reply_byte(s, c, DDP__WAIT_STOP_WAITING);
        return;
    }
    bytes = (size_t)n * sizeof(ddp__store_wait_key) + (r->at - first);
    if (ddp__srv_over_budget(s, bytes)) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the store is at its budget of %zu bytes: no room to record a "
                                                     "WAIT", s->max_held);
        return;
    }
    c->waits = (ddp__store_wait_key *)ddp__malloc((size_t)n * sizeof(ddp__store_wait_key));
    c->wait_blob = (unsigned char *)ddp__malloc(r->at - first);
    if (!c->waits || !c->wait_blob) {
        ddp__srv_clear_wait(s, c);
        ddp__srv_drop(s, c, DDP_LOG_WARN, "out of memory recording its WAIT");
        return;
    }
    c->wait_bytes = bytes;
    s->buffers += bytes;
    r->at = first;
    for (i = 0; i < n; i++) {
        size_t klen;
        const unsigned char *k = ddp__rd_str(r, &klen);
        uint64_t h = ddp__store_hash(k, klen);
        if (ddp__kv_find(&s->kv, k, klen, h)) continue;
        memcpy(c->wait_blob + blob, k, klen);
        c->waits[c->nwaits].hash = h;
        c->waits[c->nwaits].off = blob;
        c->waits[c->nwaits].len = klen;
        c->nwaits++;
        blob += klen;
    }
}

/* GET (and each key of MULTI_GET): the value's length and bytes. A missing key drops the client, as torch's
   server does: its get always waits for the key first. `asked` says who asked, for the log. */
static void ddp__srv_reply_value(ddp__store_server *s, ddp__store_conn *c, const unsigned char *k, size_t klen,
                                 const char *asked) {
    char name[96];
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    uint64_t vlen;
    if (!kv) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "%s key '%s', which does not exist (a get must WAIT first)", asked,
                      ddp__store_key_text(k, klen, name, sizeof name));
        return;
    }
    vlen = kv->value_len;
    ddp__srv_reply(s, c, &vlen, 8, kv->value, kv->value_len);
}

/* COMPARE_SET with torch's semantics, including its answer for a missing key with a non-empty expected. */
static void ddp__srv_compare_set(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen, elen, dlen;
    const unsigned char *k = ddp__rd_str(r, &klen), *e = ddp__rd_str(r, &elen), *d = ddp__rd_str(r, &dlen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    uint64_t len;
    if (!kv && elen != 0) {
        len = elen;
        ddp__srv_reply(s, c, &len, 8, e, elen);
        return;
    }
    if ((!kv || (kv->value_len == elen && memcmp(kv->value, e, elen) == 0)) && ddp__srv_store(s, c, k, klen, d, dlen) != 0)
        return;
    kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    if (c->dead || !kv) return;
    len = kv->value_len;
    ddp__srv_reply(s, c, &len, 8, kv->value, kv->value_len);
}

/* ADD: the value is kept as decimal text, as torch keeps it. Refused (see "Refusals"): a value that is no
   number, and a sum that does not fit in int64 (torch's wraps around). */
static void ddp__srv_add(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen;
    const unsigned char *k = ddp__rd_str(r, &klen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    int64_t delta, old = 0, now;
    char text[32], name[64];
    int n;
    memcpy(&delta, r->p + r->at, 8);
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0) {
        ddp__srv_refuse(s, c, DDP_ERR_STATE, "key '%s' holds a value that is not an integer, so nothing can be added "
                                             "to it", ddp__store_key_text(k, klen, name, sizeof name));
        return;
    }
    if (ddp__store_add_int(old, delta, &now) != 0) {
        ddp__srv_refuse(s, c, DDP_ERR_INVALID_ARGUMENT, "key '%s' holds %lld; adding %lld would overflow int64 (the "
                                                        "store does not wrap around)",
                        ddp__store_key_text(k, klen, name, sizeof name), (long long)old, (long long)delta);
        return;
    }
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    if (ddp__srv_store(s, c, k, klen, (const unsigned char *)text, (size_t)n) != 0) return;
    ddp__srv_reply(s, c, &now, 8, NULL, 0);
}

/* APPEND (torch 2.x): add bytes at the end of a key's value, creating it when missing. */
static void ddp__srv_append(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen, vlen;
    const unsigned char *k = ddp__rd_str(r, &klen), *v = ddp__rd_str(r, &vlen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    unsigned char *joined;
    if (!kv) {
        ddp__srv_store(s, c, k, klen, v, vlen);
        return;
    }
    if (kv->value_len + vlen > DDP__STORE_MAX_VALUE) {
        ddp__srv_refuse(s, c, DDP_ERR_INVALID_ARGUMENT, "its APPEND would make a value longer than %zu MiB",
                        DDP__STORE_MAX_VALUE >> 20);
        return;
    }
    if (ddp__srv_room(s, c, kv, DDP__KV_ENTRY_BYTES(klen, kv->value_len + vlen), k, klen) != 0) return;
    if (!(joined = (unsigned char *)ddp__malloc(kv->value_len + vlen))) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory appending %zu bytes", vlen);
        return;
    }
    if (kv->value_len) memcpy(joined, kv->value, kv->value_len);
    if (vlen) memcpy(joined + kv->value_len, v, vlen);
    ddp__srv_uncharge(kv);
    ddp__kv_put(&s->kv, k, klen, kv->hash, joined, kv->value_len + vlen); /* replaces: cannot fail */
    ddp__srv_charge(kv, c);
}

/* CHECK: DDP__STORE_ANNOUNCE alone announces the next request (see "Refusals"); no answer of its own. */
static void ddp__srv_check(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    uint64_t n = ddp__rd_u64(r);
    size_t at = r->at, klen = 0;
    const unsigned char *k = n == 1 ? ddp__rd_str(r, &klen) : NULL;
    if (k && klen == DDP__STORE_ANNOUNCE_LEN && memcmp(k, DDP__STORE_ANNOUNCE, klen) == 0) {
        c->announced = 1;
        return;
    }
    r->at = at;
    ddp__srv_reply_byte(s, c, ddp__srv_have_all(s, r, n) ? DDP__CHECK_READY : DDP__CHECK_NOT_READY);
}

static void ddp__srv_handle(ddp__store_server *s, ddp__store_conn *c, const unsigned char *req, size_t size) {
    ddp__rd r;
    size_t klen, vlen;
    const unsigned char *k, *v;
    uint32_t magic;
    uint64_t n, i;
    r.p = req;
    r.n = size;
    r.at = 1;
    __atomic_store_n(&s->requests, s->requests + 1, __ATOMIC_RELAXED); /* only this thread writes it */
    c->status_due = c->announced;
    c->announced = 0;
    c->refused = 0;
    switch (ddp__store_query_of(c->proto, req[0])) {
    case DDP__Q_VALIDATE: /* torch 2.x: no reply; a wrong magic ends the client, as torch's server does */
        memcpy(&magic, req + 1, 4);
        if (magic != DDP__V2_MAGIC)
            ddp__srv_drop(s, c, DDP_LOG_WARN, "its VALIDATE carried 0x%08x, not torch's 0x%08x", magic, DDP__V2_MAGIC);
        break;
    case DDP__Q_PING: ddp__srv_reply(s, c, req + 1, 4, NULL, 0); break;
    case DDP__Q_APPEND: ddp__srv_append(s, c, &r); break;
    case DDP__Q_MULTI_SET:
        n = ddp__rd_u64(&r);
        for (i = 0; i < n && !c->dead && !c->refused; i++) { /* a refusal keeps the keys before it */
            k = ddp__rd_str(&r, &klen);
            v = ddp__rd_str(&r, &vlen);
            ddp__srv_store(s, c, k, klen, v, vlen);
        }
        break;
    case DDP__Q_MULTI_GET: /* every key must exist (torch's server also drops the client otherwise) */
        n = ddp__rd_u64(&r);
        for (i = 0; i < n && !c->dead; i++) {
            k = ddp__rd_str(&r, &klen);
            ddp__srv_reply_value(s, c, k, klen, "its MULTI_GET asked for");
        }
        break;
    case DDP__Q_CANCEL_WAIT: /* torch 2.x's client after a WAIT timed out: forget it, say so */
        ddp__srv_clear_wait(s, c);
        ddp__srv_reply_byte(s, c, DDP__WAIT_CANCELED);
        break;
    case DDP__Q_SET:
        k = ddp__rd_str(&r, &klen);
        v = ddp__rd_str(&r, &vlen);
        ddp__srv_store(s, c, k, klen, v, vlen);
        break;
    case DDP__Q_COMPARE_SET: ddp__srv_compare_set(s, c, &r); break;
    case DDP__Q_ADD: ddp__srv_add(s, c, &r); break;
    case DDP__Q_GET:
        k = ddp__rd_str(&r, &klen);
        ddp__srv_reply_value(s, c, k, klen, "it asked for");
        break;
    case DDP__Q_CHECK: ddp__srv_check(s, c, &r); break;
    case DDP__Q_WAIT: ddp__srv_wait(s, c, &r); break;
    case DDP__Q_GETNUMKEYS: ddp__srv_reply_u64(s, c, (uint64_t)s->kv.count); break;
    case DDP__Q_DELETE_KEY:
        k = ddp__rd_str(&r, &klen);
        ddp__srv_uncharge(ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen)));
        ddp__srv_reply_u64(s, c, (uint64_t)ddp__kv_remove(&s->kv, k, klen, ddp__store_hash(k, klen)));
        break;
    }
    ddp__srv_status_done(s, c); /* an announced request without an answer (SET), or one that waits (WAIT) */
}

/* With DDP_AUTH_TOKEN: the handshake of src/auth.c, before any request. Returns the input bytes it
   used (0 while they are incomplete; c->need says how many it waits for); drops a client that fails. */
static size_t ddp__srv_authenticate(ddp__store_server *s, ddp__store_conn *c) {
    unsigned char reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], verdict;
    if (c->auth == 1) {
        if (memcmp(c->in, DDP__AUTH_MAGIC, DDP__MIN(c->in_len, (size_t)8)) != 0) {
            /* Not the handshake (a process without the token, which starts with a query): say so at once, so
               that the client can name the cause instead of waiting for an answer (best effort: non-blocking). */
            ssize_t said = send(c->fd, DDP__AUTH_REQUIRED, 8, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)said;
            ddp__srv_drop(s, c, DDP_LOG_WARN, "it did not authenticate: this store requires DDP_AUTH_TOKEN (set the same "
                                              "token on every rank)");
            return 0;
        }
        if (c->in_len < 8 + DDP__AUTH_NONCE) return c->need = 8 + DDP__AUTH_NONCE, 0;
        if (ddp__auth_answer(s->token, c->in, c->auth_cn, c->auth_sn, reply) != 0) {
            ddp__srv_drop(s, c, DDP_LOG_WARN, "it did not authenticate: this store requires DDP_AUTH_TOKEN (set the same "
                                              "token on every rank)");
            return 0;
        }
        ddp__srv_reply(s, c, reply, sizeof reply, NULL, 0);
        c->auth = 2;
        return 8 + DDP__AUTH_NONCE;
    }
    if (c->in_len < DDP__AUTH_MAC) return c->need = DDP__AUTH_MAC, 0;
    verdict = (unsigned char)ddp__auth_check(s->token, c->auth_cn, c->auth_sn, c->in);
    if (!verdict) { /* say so before hanging up (best effort: the socket is non-blocking) */
        if (send(c->fd, &verdict, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) verdict = 0;
        ddp__srv_drop(s, c, DDP_LOG_WARN, "its DDP_AUTH_TOKEN is different from this store's");
        return 0;
    }
    ddp__srv_reply(s, c, &verdict, 1, NULL, 0);
    c->auth = 0;
    return DDP__AUTH_MAC;
}

/* Handle every complete request in c's input, while its replies do not pile up. */
static void ddp__srv_process(ddp__store_server *s, ddp__store_conn *c) {
    size_t pos = 0, size = 0;
    char why[256];
    c->ready = 0;
    while (c->auth && !c->dead) {
        size_t used = ddp__srv_authenticate(s, c);
        if (!used) return;
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        c->need = 0;
    }
    while (!c->dead && pos < c->in_len) {
        int st;
        if (c->out_len - c->out_off >= DDP__STORE_OUT_HIGH) {
            c->ready = 1;
            break;
        }
        if (!c->proto) { /* its first query says which protocol it speaks */
            static const uint32_t magic = DDP__V2_MAGIC;
            if (c->in[pos] == DDP__V2_VALIDATE && c->in_len - pos < 5) {
                c->need = 5;
                break;
            }
            /* a 1.13 SET (also byte 0) cannot start so: its key would be longer than 1 GB */
            c->proto = c->in[pos] == DDP__V2_VALIDATE && memcmp(c->in + pos + 1, &magic, 4) == 0 ? 2 : 1;
            ddp__srv_log(s, DDP_LOG_DEBUG, "client %s speaks torch %s's protocol", c->peer, c->proto == 2 ? "2.x" : "1.13");
        }
        st = ddp__srv_parse(c->proto, c->in + pos, c->in_len - pos, &size, why, sizeof why);
        if (st == DDP__REQ_BAD) {
            ddp__srv_drop(s, c, DDP_LOG_WARN, "%s", why);
            return;
        }
        if (st == DDP__REQ_MORE) {
            c->need = size;
            break;
        }
        ddp__srv_handle(s, c, c->in + pos, size);
        pos += size;
        c->need = 0;
    }
    if (c->dead || pos == 0) return;
    memmove(c->in, c->in + pos, c->in_len - pos);
    c->in_len -= pos;
    if (c->in_len == 0) ddp__srv_trim(s, &c->in, &c->in_cap);
}

/* Read what c sent, at most a few MiB per round so that one busy client does not starve the others. The
   buffer grows with what actually arrives (at most doubling), not with the lengths a request announces:
   a client that only announces large values holds little. */
static void ddp__srv_read(ddp__store_server *s, ddp__store_conn *c) {
    size_t total = 0;
    while (!c->dead && total < ((size_t)4 << 20)) {
        size_t missing = c->need > c->in_len ? c->need - c->in_len : 0;
        size_t room = DDP__MAX(DDP__MIN(missing, DDP__MAX(c->in_len, (size_t)65536)), (size_t)4096);
        ssize_t k;
        if (c->in_cap - c->in_len < room && ddp__srv_grow(s, c, &c->in, &c->in_cap, c->in_len + room) != 0) return;
        k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
        if (k > 0) {
            c->in_len += (size_t)k;
            total += (size_t)k;
            continue;
        }
        if (k == 0) { /* requests that came before the close still count (a SET needs no answer) */
            c->closed = 1;
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            ddp__srv_drop(s, c, DDP_LOG_DEBUG, "the connection failed (%s)", strerror(errno));
        return;
    }
}

static void ddp__srv_flush(ddp__store_server *s, ddp__store_conn *c) {
    while (!c->dead && c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (k > 0) {
            c->out_off += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        ddp__srv_drop(s, c, DDP_LOG_DEBUG, "the connection failed while sending a reply (%s)", strerror(errno));
        return;
    }
    c->out_off = c->out_len = 0;
    ddp__srv_trim(s, &c->out, &c->out_cap);
}

/* c is going: its entries stay (as torch keeps a client's keys), charged to no one. */
static void ddp__srv_orphan(ddp__store_server *s, ddp__store_conn *c) {
    size_t i;
    ddp__kv *e;
    for (i = 0; c->held && i < s->kv.nslots; i++)
        for (e = s->kv.slots[i]; e; e = e->next)
            if (e->owner == c) ddp__srv_uncharge(e);
}

static void ddp__srv_free_conn(ddp__store_server *s, ddp__store_conn *c) {
    ddp__srv_orphan(s, c);
    ddp__srv_clear_wait(s, c);
    s->buffers -= c->in_cap + c->out_cap + sizeof *c;
    DDP_FREE(c->in);
    DDP_FREE(c->out);
    close(c->fd);
    ddp__free(c);
}

/* Register fd in the server's epoll set, waiting for events, with ptr as its tag. */
static int ddp__srv_arm(ddp__store_server *s, int op, int fd, unsigned events, void *ptr) {
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = events;
    ev.data.ptr = ptr;
    return epoll_ctl(s->epfd, op, fd, &ev);
}

static int ddp__srv_piled(const ddp__store_conn *c) { return c->out_len - c->out_off >= DDP__STORE_OUT_HIGH; }

/* Wait for input unless replies piled up, for room to send while replies wait. */
static void ddp__srv_rearm(ddp__store_server *s, ddp__store_conn *c) {
    unsigned want = (ddp__srv_piled(c) ? 0u : (unsigned)EPOLLIN) | (c->out_off < c->out_len ? (unsigned)EPOLLOUT : 0u);
    if (want == c->events) return;
    if (ddp__srv_arm(s, EPOLL_CTL_MOD, c->fd, want, c) != 0)
        ddp__srv_drop(s, c, DDP_LOG_WARN, "epoll_ctl failed (%s)", strerror(errno));
    else
        c->events = want;
}

static void ddp__srv_remove(ddp__store_server *s, ddp__store_conn *c) {
    size_t slot = c->slot;
    s->conns[slot] = s->conns[--s->nconns];
    s->conns[slot]->slot = slot;
    ddp__srv_free_conn(s, c); /* closing the socket takes it out of the epoll set */
}

/* Make room for one more client in conns and touched. */
static int ddp__srv_room_for_client(ddp__store_server *s) {
    size_t cap = s->cap_conns ? s->cap_conns * 2 : 16;
    ddp__store_conn **p, **t;
    if (s->nconns < s->cap_conns) return 0;
    if (!(p = (ddp__store_conn **)DDP_REALLOC(s->conns, cap * sizeof *p))) return -1;
    s->conns = p;
    if (!(t = (ddp__store_conn **)DDP_REALLOC(s->touched, cap * sizeof *t))) return -1;
    s->touched = t;
    s->cap_conns = cap;
    return 0;
}

/* The server cannot accept a client for lack of descriptors. During a rendezvous that client is a rank,
   which would wait in the listen backlog until its timeout while the others wait for it: the server
   publishes the rendezvous abort itself, as ddp_init's ddp__rdzv_abort would (group.c): "code|message",
   naming rank 0, under the abort key (unless one is there), as the table's value behind
   DDP__RDZV_ABORTED (unless the table is there: a compare-set against an absent key), and then the
   ready key, which wakes every rank waiting for the table. The ranks it serves read it and leave, which
   frees descriptors for the rest. */
static void ddp__srv_put_absent(ddp__store_server *s, const char *key, const char *value) {
    size_t klen = strlen(key), vlen = strlen(value);
    uint64_t h = ddp__store_hash(key, klen);
    unsigned char *copy;
    if (ddp__kv_find(&s->kv, key, klen, h) || !(copy = ddp__store_dup(value, vlen))) return;
    if (ddp__kv_put(&s->kv, key, klen, h, copy, vlen) > 0) ddp__srv_wake(s, key, klen, h);
}

static void ddp__srv_publish_abort(ddp__store_server *s, const char *why) {
    char host[128], value[DDP__ERR_MAX + 16], marker[DDP__ERR_MAX + 32];
    if (!__atomic_load_n(&s->abort_key_set, __ATOMIC_ACQUIRE)) return;
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(value, sizeof value, "%d|rank 0 (host %.64s, pid %d), serving the store on %.96s, cannot accept every rank's "
             "connection: %.700s", (int)DDP_ERR_SYSTEM, host, (int)getpid(), s->where, why);
    snprintf(marker, sizeof marker, "%s%s", DDP__RDZV_ABORTED, value);
    ddp__srv_put_absent(s, s->abort_key, value);
    ddp__srv_put_absent(s, s->table_key, marker);
    ddp__srv_put_absent(s, s->ready_key, "1");
}

/* The rendezvous keys of the group that ddp_init is connecting; NULL once it is connected. */
static void ddp__store_server_abort_key(ddp__store_server *s, const char *abort_key, const char *table_key,
                                        const char *ready_key) {
    if (!s) return;
    __atomic_store_n(&s->abort_key_set, 0, __ATOMIC_RELEASE);
    if (!abort_key || !table_key || !ready_key) return;
    snprintf(s->abort_key, sizeof s->abort_key, "%s", abort_key);
    snprintf(s->table_key, sizeof s->table_key, "%s", table_key);
    snprintf(s->ready_key, sizeof s->ready_key, "%s", ready_key);
    __atomic_store_n(&s->abort_key_set, 1, __ATOMIC_RELEASE);
}

/* Accept one client. 0: accepted (or refused, logged), -1: nothing more to accept now. */
static int ddp__srv_accept(ddp__store_server *s) {
    char host[64] = "?", serv[16] = "?";
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    ddp__store_conn *c;
    int fd = accept(s->listen_fd, NULL, NULL); /* the listening socket does not block (net.c) */
    if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED))
        return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : 0; /* none waiting, or one that gave up */
    if (fd < 0) { /* out of file descriptors, most likely: let some close first */
        char err[DDP__ERR_MAX];
        int e = errno, no_fds = ddp__out_of_descriptors(e);
        if (no_fds) ddp__fail_descriptors(err, e, "cannot accept a connection");
        else snprintf(err, sizeof err, "accept: %s", strerror(e));
        if (!s->out_of_fds || !no_fds) /* said once per episode */
            ddp__srv_log(s, DDP_LOG_WARN, "cannot accept a client (%s); not accepting for 0.1 s", err);
        if (no_fds) {
            s->out_of_fds = 1;
            ddp__srv_publish_abort(s, err);
        }
        s->accept_paused_until = ddp__now() + 0.1;
        epoll_ctl(s->epfd, EPOLL_CTL_DEL, s->listen_fd, NULL);
        return -1;
    }
    s->out_of_fds = 0;
    if (ddp__srv_room_for_client(s) != 0) {
        close(fd);
        return 0;
    }
    if (ddp__srv_over_budget(s, sizeof *c) || !(c = (ddp__store_conn *)ddp__calloc(1, sizeof *c))) {
        ddp__srv_log(s, DDP_LOG_WARN, "refusing a client: the store is at its memory budget");
        close(fd);
        return 0;
    }
    ddp__net_configure(fd);
    c->fd = fd;
    c->auth = s->token ? 1 : 0;
    c->events = EPOLLIN;
    if (ddp__srv_arm(s, EPOLL_CTL_ADD, fd, EPOLLIN, c) != 0) {
        ddp__srv_log(s, DDP_LOG_WARN, "refusing a client: epoll_ctl failed (%s)", strerror(errno));
        close(fd);
        ddp__free(c);
        return 0;
    }
    if (getpeername(fd, (struct sockaddr *)&ss, &len) == 0)
        getnameinfo((struct sockaddr *)&ss, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->peer, sizeof c->peer, "%s:%s", host, serv);
    s->buffers += sizeof *c;
    c->slot = s->nconns;
    s->conns[s->nconns++] = c;
    __atomic_store_n(&s->connections, s->connections + 1, __ATOMIC_RELAXED);
    ddp__srv_log(s, DDP_LOG_DEBUG, "client %s connected", c->peer);
    return 0;
}

/* What epoll said of client c (0: nothing, for a client with requests left over from an earlier round). */
static void ddp__srv_serve(ddp__store_server *s, ddp__store_conn *c, unsigned events) {
    ddp__srv_touch(s, c);
    if (events & EPOLLOUT) ddp__srv_flush(s, c);
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ddp__srv_read(s, c);
    if (!c->dead) ddp__srv_process(s, c);
    if (!c->dead && c->closed) {
        ddp__srv_flush(s, c); /* a half-closed client may still read its answers */
        ddp__srv_drop(s, c, DDP_LOG_DEBUG, "it closed the connection");
    }
}

/* The end of a round: flush, re-arm or free each client touched. Those that still have requests to handle
   (left while their replies piled up, and the replies have drained) stay on the list for the next round.
   Returns how many stayed. */
static size_t ddp__srv_round_end(ddp__store_server *s) {
    size_t i, keep = 0;
    for (i = 0; i < s->ntouched; i++) {
        ddp__store_conn *c = s->touched[i];
        if (!c->dead && c->out_off < c->out_len) ddp__srv_flush(s, c);
        if (!c->dead) ddp__srv_rearm(s, c);
        if (c->dead) {
            ddp__srv_remove(s, c);
        } else if (c->ready && !ddp__srv_piled(c)) {
            s->touched[keep++] = c;
        } else {
            c->touched = 0;
        }
    }
    s->ntouched = keep;
    return keep;
}

#define DDP__SRV_EVENTS 256  /* events taken per epoll_wait */
#define DDP__SRV_ACCEPTS 64  /* clients accepted per round at most */
static void *ddp__srv_main(void *arg) {
    ddp__store_server *s = (ddp__store_server *)arg;
    struct epoll_event ev[DDP__SRV_EVENTS];
    size_t i, left = 0;
    for (;;) {
        int timeout = left ? 0 : -1, n, k, stop = 0, accept_due = 0;
        if (s->accept_paused_until > 0 && ddp__now() >= s->accept_paused_until) {
            s->accept_paused_until = 0;
            ddp__srv_arm(s, EPOLL_CTL_ADD, s->listen_fd, EPOLLIN, &s->listen_fd);
        }
        if (s->accept_paused_until > 0 && !left) timeout = 100;
        n = epoll_wait(s->epfd, ev, DDP__SRV_EVENTS, timeout);
        if (n < 0 && errno != EINTR) {
            ddp__srv_log(s, DDP_LOG_ERROR, "epoll_wait failed (%s); the store stops", strerror(errno));
            break;
        }
        for (i = 0; i < left; i++) /* requests left over from the last round */
            if (!s->touched[i]->dead) ddp__srv_serve(s, s->touched[i], 0);
        for (k = 0; k < n; k++) {
            if (ev[k].data.ptr == (void *)&s->pipe_rd) stop = 1; /* tagged by their fields' addresses */
            else if (ev[k].data.ptr == (void *)&s->listen_fd) accept_due = 1;
            else ddp__srv_serve(s, (ddp__store_conn *)ev[k].data.ptr, ev[k].events);
        }
        if (stop) break;
        for (k = 0; accept_due && k < DDP__SRV_ACCEPTS && ddp__srv_accept(s) == 0; k++) {
        }
        left = ddp__srv_round_end(s);
    }
    for (i = 0; i < s->nconns; i++) /* replies already due still go out, as far as the sockets take them */
        if (!s->conns[i]->dead) ddp__srv_flush(s, s->conns[i]);
    {
        struct timespec cpu = {0, 0};
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
        ddp__srv_log(s, DDP_LOG_DEBUG, "stopping: served %llu requests from %llu connections in %.3f s of CPU",
                     (unsigned long long)s->requests, (unsigned long long)s->connections,
                     (double)cpu.tv_sec + (double)cpu.tv_nsec * 1e-9);
    }
    return NULL;
}

static void ddp__store_server_close(ddp__store_server *s) {
    size_t i;
    for (i = 0; i < s->nconns; i++) ddp__srv_free_conn(s, s->conns[i]);
    DDP_FREE(s->conns);
    DDP_FREE(s->touched);
    if (s->epfd >= 0) close(s->epfd);
    ddp__kv_clear(&s->kv);
    ddp__free(s->token);
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->pipe_rd >= 0) close(s->pipe_rd);
    if (s->pipe_wr >= 0) close(s->pipe_wr);
    ddp__free(s);
}

static ddp_result ddp__store_server_start(const char *host, int port, ddp_log_level lvl, ddp__store_server **out,
                                          char *err) {
    ddp__store_server *s = (ddp__store_server *)ddp__calloc(1, sizeof *s);
    char why[DDP__ERR_MAX];
    int fds[2], rc;
    ddp_result r;
    *out = NULL;
    if (!s) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory starting the store server");
    s->listen_fd = s->pipe_rd = s->pipe_wr = s->epfd = -1;
    s->log_level = lvl == DDP_LOG_DEFAULT ? ddp__env_log_level() : lvl;
    if ((r = ddp__srv_budget_setting(&s->max_held, err)) != DDP_SUCCESS) {
        ddp__store_server_close(s);
        return r;
    }
    ddp__srv_set_budget(s, s->max_held);
    if (ddp__auth_token() && !(s->token = ddp__strdup(ddp__auth_token()))) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory starting the store server");
    }
    r = ddp__net_listen(host, port, &s->listen_fd, &s->port, why);
    if (r != DDP_SUCCESS) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, r, "cannot start the rendezvous store server: %s", why);
    }
    snprintf(s->where, sizeof s->where, "%.80s:%d", host ? host : "*", s->port);
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server: pipe: %s", strerror(errno));
    }
    s->pipe_rd = fds[0];
    s->pipe_wr = fds[1];
    if ((s->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 || ddp__srv_arm(s, EPOLL_CTL_ADD, s->pipe_rd, EPOLLIN, &s->pipe_rd) != 0 ||
        ddp__srv_arm(s, EPOLL_CTL_ADD, s->listen_fd, EPOLLIN, &s->listen_fd) != 0) {
        snprintf(why, sizeof why, "%s", strerror(errno));
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server: epoll: %s", why);
    }
    rc = pthread_create(&s->thread, NULL, ddp__srv_main, s);
    if (rc != 0) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server thread: %s", strerror(rc));
    }
    ddp__srv_log(s, DDP_LOG_INFO, "serving");
    *out = s;
    return DDP_SUCCESS;
}

static int ddp__store_server_port(const ddp__store_server *s) { return s->port; }

/* What the server has done so far, read from another thread while it runs (bench/bench_scale.c): the
   requests it handled, the connections it accepted, and its thread's CPU time (-1 when unreadable). */
static void ddp__store_server_stats(const ddp__store_server *s, ddp__server_stats *out) {
    struct timespec cpu;
    clockid_t clock;
    out->requests = __atomic_load_n(&s->requests, __ATOMIC_RELAXED);
    out->connections = __atomic_load_n(&s->connections, __ATOMIC_RELAXED);
    out->cpu_seconds = -1;
    if (pthread_getcpuclockid(s->thread, &clock) == 0 && clock_gettime(clock, &cpu) == 0)
        out->cpu_seconds = (double)cpu.tv_sec + (double)cpu.tv_nsec * 1e-9;
}

static void ddp__store_server_stop(ddp__store_server *s) {
    char b = 1;
    if (!s) return;
    while (write(s->pipe_wr, &b, 1) < 0 && errno == EINTR) {
    }
    pthread_join(s->thread, NULL);
    ddp__store_server_close(s);
}

/* ======================================== client ======================================== */

typedef struct ddp__store_ops {
    ddp_result (*set)(ddp_store *s, const char *key, const void *value, size_t size);
    ddp_result (*get)(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
    ddp_result (*add)(ddp_store *s, const char *key, int64_t delta, int64_t *result);
    ddp_result (*check)(ddp_store *s, const char *const *keys, int n, int *exists);
    ddp_result (*wait)(ddp_store *s, const char *const *keys, int n, double timeout);
    ddp_result (*del)(ddp_store *s, const char *key, int *deleted);
    ddp_result (*compare_set)(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                              const void *desired, size_t desired_size, void *current, size_t capacity, size_t *size);
    ddp_result (*num_keys)(ddp_store *s, int64_t *n);
    void (*close)(ddp_store *s);
} ddp__store_ops;

struct ddp_store {
    const ddp__store_ops *ops;
    double timeout;
    char where[320]; /* "the store at host:port", "the file store /path": for messages */
    char error[DDP__ERR_MAX];
    /* tcp */
    char *host, *prefix;
    int port, fd;
    int proto;          /* 1: torch 1.13's protocol, 2: torch 2.x's, 0: not known yet (found out on connecting) */
    const char *proto_why; /* how it was chosen, for messages */
    size_t prefix_len;
    unsigned char *msg; /* the request being built */
    unsigned char msg_type;
    size_t msg_type_at; /* where the request's type byte is: after the announcing CHECK, or 0 */
    size_t msg_len, msg_cap;
    int msg_oom;
    /* file */
    char *path;
    int file_fd;
    ddp__kv_table kv; /* the file's records replayed up to file_off */
    uint64_t file_off;
    dev_t file_dev;
    ino_t file_ino;
};

static ddp_result ddp__store_fail(ddp_store *s, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
static ddp_result ddp__store_fail(ddp_store *s, ddp_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->error, sizeof s->error, fmt, ap);
    va_end(ap);
    ddp__note_thread_error(s->error);
    ddp__log(NULL, DDP_LOG_DEBUG, "%s: %s", ddp_result_string(code), s->error);
    return code;
}

/* "key 'a'" or "keys 'a', 'b' and 3 more", for messages. */
static const char *ddp__store_keys_text(const char *const *keys, int n, char *buf, size_t cap) {
    char one[96];
    size_t o;
    int i;
    o = (size_t)snprintf(buf, cap, "%s", n == 1 ? "key " : "keys ");
    for (i = 0; i < n && i < 3 && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s'%s'", i ? ", " : "",
                              ddp__store_key_text(keys[i], strlen(keys[i]), one, sizeof one));
    if (n > 3 && o < cap) snprintf(buf + o, cap - o, " and %d more", n - 3);
    return buf;
}

/* ---- tcp client ---- */

static void ddp__tcp_disconnect(ddp_store *s) {
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* How long the probe waits for an answer: 5 s, and 1 s more per 128 ranks of the group being joined
   (thousands of ranks connecting at once keep a store busy for seconds: 4,096 on 2 cores left some
   unanswered for 5 s), never past the store's timeout. */
static double ddp__probe_seconds(const ddp_store *s) { return DDP__MIN(s->timeout, 5.0 + ddp__largest_world() / 128.0); }

/* Connect (and authenticate, with DDP_AUTH_TOKEN); no protocol bytes yet. */
static ddp_result ddp__tcp_open(ddp_store *s, double deadline) {
    char why[DDP__ERR_MAX];
    ddp_result r = ddp__net_connect(s->host, s->port, deadline, &s->fd, why);
    if (r == DDP_SUCCESS && ddp__auth_token()) {
        /* a store answers the handshake at once: a short deadline, so that a silent server is found out soon */
        r = ddp__auth_client(s->fd, ddp__auth_token(), s->where, DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s)), why);
        if (r != DDP_SUCCESS) {
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, r, "%s", why);
        }
    }
    if (r == DDP_SUCCESS) return r;
    s->fd = -1;
    if (r == DDP_ERR_SYSTEM) return ddp__store_fail(s, r, "cannot reach %s: %s", s->where, why); /* out of descriptors */
    return ddp__store_fail(s, r, "cannot reach %s: %s; is rank 0 (which serves the store) running, and do "
                                 "MASTER_ADDR and MASTER_PORT name its host and a port it can listen on?",
                           s->where, why);
}

/* Which protocol the server speaks, found out on a fresh connection without ever changing a torch 1.13 store
   (torch 2.x's VALIDATE byte 0 is a SET to a 1.13 server). DDP_STORE_PROTOCOL=1.13 or 2 skips this.
     1. Send, in one write, torch 2.x's VALIDATE (00 + magic CE F7 85 3C) and PING (0D + a nonce whose third
        byte is 0xFF). A 2.x server (classic or libuv) echoes the nonce: protocol 2, and the connection is
        validated. A 1.13 server reads a SET whose key length is the 8 bytes CE F7 85 3C 0D n0 n1 FF, over
        2^63: torch 1.13's recvString cannot allocate that (std::length_error) and its server closes the
        connection; ddp.h's server (any version) drops a key over 4 KiB. Nothing is stored: the SET never
        gets past its key length. A 2.x server older than PING (torch 2.1 .. 2.4) also closes.
     2. After a close: reconnect and send the single byte 06, GETNUMKEYS to a 1.13 server, which answers 8
        bytes: protocol 1. To a 2.x server 06 is a first query that is not VALIDATE: the classic server
        closes (protocol 2, without PING); a libuv one ignores it and waits, and it is a WAIT anyway, which
        reads a count it never gets, so nothing can change there either.
   No answer within min(timeout, 5 s + N/128 s) in step 1 (no bytes and no close), or bytes that are not the
   echo (an HTTP server's "HTTP/1.1 400"): the server does not speak the store protocol (another program
   on MASTER_PORT), and connecting fails saying so, within seconds rather than after the timeout. No
   answer in step 2: it cannot tell, and takes protocol 2 (what current torch speaks), saying so in the
   log; a wrong guess fails with a message that names both versions and DDP_STORE_PROTOCOL. */
static ddp_result ddp__tcp_detect(ddp_store *s, double deadline) {
    unsigned char probe[10], reply[8];
    uint32_t magic = DDP__V2_MAGIC, nonce = 0x5AFF0000u | ((uint32_t)getpid() & 0xFFFFu), echo;
    double until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
    char why[DDP__ERR_MAX];
    ddp_result r;
    probe[0] = DDP__V2_VALIDATE;
    memcpy(probe + 1, &magic, 4);
    probe[5] = DDP__V2_PING;
    memcpy(probe + 6, &nonce, 4);
    r = ddp__net_send(s->fd, probe, sizeof probe, until, why);
    if (r == DDP_SUCCESS) r = ddp__net_recv(s->fd, &echo, 4, until, why);
    while (r == DDP_ERR_TIMEOUT && ddp__now() < deadline && ddp__net_unacked(s->fd)) {
        /* The server's kernel has not even acknowledged the probe: the connection waits in a full listen
           queue (thousands of ranks connecting at once), which says nothing about the program there. */
        until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
        r = ddp__net_recv(s->fd, &echo, 4, until, why);
    }
    if (r == DDP_SUCCESS) {
        if (memcmp(&echo, DDP__AUTH_REQUIRED, 4) == 0) {
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, DDP_ERR_INIT, "%s requires DDP_AUTH_TOKEN (it was started with one) and this process "
                                                    "has none: every rank needs the same token", s->where);
        }
        if (echo != nonce) {
            char text[40];
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, DDP_ERR_INIT, "the server at %s:%d does not speak the store protocol (is another "
                                                    "program using MASTER_PORT?): it answered torch 2.x's PING with "
                                                    "\"%s\" (0x%08x) instead of 0x%08x, which no TCPStore (torch 1.13, "
                                                    "torch 2.x or ddp.h) does", s->host, s->port,
                                   ddp__store_key_text(&echo, 4, text, sizeof text), echo, nonce);
        }
        s->proto = 2;
        s->proto_why = "found out on connecting";
        return DDP_SUCCESS;
    }
    ddp__tcp_disconnect(s);
    if (r == DDP_ERR_TIMEOUT) /* every TCPStore answers the probe or hangs up on it at once */
        return ddp__store_fail(s, DDP_ERR_INIT, "the server at %s:%d does not speak the store protocol (is another program "
                                                "using MASTER_PORT?): it accepted the connection but neither answered nor "
                                                "closed it within %.3g s of torch 2.x's PING, as every TCPStore does (if "
                                                "it is a store too busy to answer, DDP_STORE_PROTOCOL=2 or 1.13 skips "
                                                "this probe)", s->host, s->port, ddp__probe_seconds(s));
    if (r == DDP_ERR_PEER_LOST) { /* step 2 */
        unsigned char q = DDP__Q_GETNUMKEYS;
        if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
        until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
        r = ddp__net_send(s->fd, &q, 1, until, why);
        if (r == DDP_SUCCESS) r = ddp__net_recv(s->fd, reply, 8, until, why);
        if (r == DDP_SUCCESS) {
            s->proto = 1;
            s->proto_why = "found out on connecting";
            return DDP_SUCCESS; /* the connection is in step: GETNUMKEYS got its answer */
        }
        ddp__tcp_disconnect(s);
        if (r == DDP_ERR_PEER_LOST) {
            s->proto = 2;
            s->proto_why = "found out on connecting: a torch 2.x server without PING";
        }
    }
    if (!s->proto) {
        s->proto = 2;
        s->proto_why = "a guess: the server did not answer the probes; DDP_STORE_PROTOCOL=1.13 or 2 says which";
        ddp__log(NULL, DDP_LOG_INFO, "%s answered neither torch 2.x's PING nor torch 1.13's GETNUMKEYS within %.3g s; "
                                     "speaking torch 2.x's protocol (DDP_STORE_PROTOCOL=1.13 or 2 sets it)",
                 s->where, ddp__probe_seconds(s));
    }
    if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
    r = ddp__net_send(s->fd, probe, 5, deadline, why); /* VALIDATE alone */
    if (r != DDP_SUCCESS) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, r, "lost the connection to %s while validating (%s)", s->where, why);
    }
    return DDP_SUCCESS;
}

/* Connect when not connected: in torch 2.x's protocol every connection starts with VALIDATE. */
static ddp_result ddp__tcp_connect(ddp_store *s, double deadline) {
    char why[DDP__ERR_MAX];
    unsigned char validate[5];
    uint32_t magic = DDP__V2_MAGIC;
    ddp_result r;
    if (s->fd >= 0) return DDP_SUCCESS;
    if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
    if (!s->proto) return ddp__tcp_detect(s, deadline);
    if (s->proto != 2) return DDP_SUCCESS;
    validate[0] = DDP__V2_VALIDATE;
    memcpy(validate + 1, &magic, 4);
    r = ddp__net_send(s->fd, validate, sizeof validate, deadline, why);
    if (r == DDP_SUCCESS) return r;
    ddp__tcp_disconnect(s);
    return ddp__store_fail(s, r, "lost the connection to %s while validating (%s)", s->where, why);
}

static void ddp__msg_put(ddp_store *s, const void *p, size_t n) {
    if (s->msg_len + n > s->msg_cap) {
        size_t cap = DDP__MAX(s->msg_len + n, s->msg_cap * 2);
        void *m = DDP_REALLOC(s->msg, cap);
        if (!m) {
            s->msg_oom = 1;
            return;
        }
        s->msg = (unsigned char *)m;
        s->msg_cap = cap;
    }
    if (n) memcpy(s->msg + s->msg_len, p, n);
    s->msg_len += n;
}

static void ddp__msg_u64(ddp_store *s, uint64_t v) { ddp__msg_put(s, &v, 8); }

/* Start a request of query type (1.13 numbering); its wire byte is set when it is sent (ddp__tcp_send), once
   the connection, and with it the protocol, is known. */
static void ddp__msg_begin(ddp_store *s, unsigned char type) {
    s->msg_len = 0;
    s->msg_oom = 0;
    ddp__msg_put(s, &type, 1);
    s->msg_type = type;
    s->msg_type_at = 0;
}

/* Start a request that the server may refuse: CHECK of DDP__STORE_ANNOUNCE first, so that a ddp.h server
   answers it with a status byte (see "Refusals" at the top; ddp__tcp_recv_status reads it). */
static void ddp__msg_begin_announced(ddp_store *s, unsigned char type) {
    unsigned char check = DDP__Q_CHECK;
    s->msg_len = 0;
    s->msg_oom = 0;
    ddp__msg_put(s, &check, 1);
    ddp__msg_u64(s, 1);
    ddp__msg_u64(s, DDP__STORE_ANNOUNCE_LEN);
    ddp__msg_put(s, DDP__STORE_ANNOUNCE, DDP__STORE_ANNOUNCE_LEN);
    s->msg_type_at = s->msg_len;
    ddp__msg_put(s, &type, 1);
    s->msg_type = type;
}

/* A key goes on the wire as prefix + key. */
static void ddp__msg_key(ddp_store *s, const char *key) {
    size_t n = strlen(key);
    ddp__msg_u64(s, s->prefix_len + n);
    ddp__msg_put(s, s->prefix, s->prefix_len);
    ddp__msg_put(s, key, n);
}

static void ddp__msg_keys(ddp_store *s, const char *const *keys, int n) {
    int i;
    ddp__msg_u64(s, (uint64_t)n);
    for (i = 0; i < n; i++) ddp__msg_key(s, keys[i]);
}

/* A call failed midway: the stream is in an unknown state, so drop the connection (the next call connects
   again) and say what happened. r and why come from net.c. */
static ddp_result ddp__tcp_broken(ddp_store *s, ddp_result r, const char *why, const char *doing, double seconds) {
    ddp__tcp_disconnect(s);
    if (r == DDP_ERR_TIMEOUT)
        return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s %s in %s; is every rank running and "
                                                   "doing the same steps? (DDP_TIMEOUT sets the timeout)",
                               seconds, doing, s->where);
    return ddp__store_fail(s, r == DDP_ERR_PEER_LOST ? DDP_ERR_PEER_LOST : r,
                           "lost the connection to %s while %s (%s); did rank 0, which serves the store, exit?%s "
                           "(this client spoke torch %s's TCPStore protocol, %s; a server of the other one, torch %s, "
                           "hangs up on it: DDP_STORE_PROTOCOL=%s sets that one)",
                           s->where, doing, why,
                           ddp__auth_token() ? "" : " (a store started with DDP_AUTH_TOKEN also hangs up on a process "
                                                    "without it: every rank needs the same token)",
                           s->proto == 2 ? "2.x" : "1.13", s->proto_why ? s->proto_why : "as set",
                           s->proto == 2 ? "1.13" : "2.x", s->proto == 2 ? "1.13" : "2");
}

/* Connect if needed and send the request built in s->msg, then tail (a large value, sent without a copy).
   On failure the error is formatted (doing names the operation) and the connection dropped. */
static ddp_result ddp__tcp_send(ddp_store *s, const void *tail, size_t tail_n, double deadline, double seconds,
                                const char *doing) {
    char why[DDP__ERR_MAX];
    ddp_result r;
    if (s->msg_oom) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory %s in %s", doing, s->where);
    if ((r = ddp__tcp_connect(s, deadline)) != DDP_SUCCESS) return r;
    if (s->msg_len > s->msg_type_at) {
        if (s->msg_type_at) s->msg[0] = ddp__store_wire_type(s->proto, DDP__Q_CHECK);
        s->msg[s->msg_type_at] = ddp__store_wire_type(s->proto, s->msg_type);
    }
    r = ddp__net_send(s->fd, s->msg, s->msg_len, deadline, why);
    if (r == DDP_SUCCESS && tail_n) r = ddp__net_send(s->fd, tail, tail_n, deadline, why);
    return r == DDP_SUCCESS ? r : ddp__tcp_broken(s, r, why, doing, seconds);
}

static ddp_result ddp__tcp_recv(ddp_store *s, void *buf, size_t n, double deadline, double seconds,
                                const char *doing) {
    char why[DDP__ERR_MAX];
    ddp_result r = ddp__net_recv(s->fd, buf, n, deadline, why);
    return r == DDP_SUCCESS ? r : ddp__tcp_broken(s, r, why, doing, seconds);
}

/* The first byte of the answer to an announced request (ddp__msg_begin_announced): from a ddp.h server its
   status, from a torch server the announcing CHECK's answer (0 or 1); either way the request's own answer
   follows, unless a ddp.h server refused it: then the refusal (code, why) is the error, and the connection
   stays in step. */
static ddp_result ddp__tcp_recv_status(ddp_store *s, double deadline, double seconds, const char *doing) {
    unsigned char status, head[12] = {0};
    char why[512];
    int32_t code = 0;
    uint64_t len = 0;
    ddp_result r = ddp__tcp_recv(s, &status, 1, deadline, seconds, doing);
    if (r) return r;
    if (status == DDP__STATUS_DONE || status == DDP__CHECK_NOT_READY) return DDP_SUCCESS;
    if (status == DDP__STATUS_REFUSED) {
        if ((r = ddp__tcp_recv(s, head, sizeof head, deadline, seconds, doing)) != DDP_SUCCESS) return r;
        memcpy(&code, head, 4);
        memcpy(&len, head + 4, 8);
    }
    if (status != DDP__STATUS_REFUSED || len >= sizeof why || code >= 0 || code < (int32_t)DDP_ERR_UNEVEN_INPUTS) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered status %u while %s (expected 0, 1 or a refusal); is it a "
                                                  "torch 1.13, torch 2.x or ddp.h store?", s->where, status, doing);
    }
    if ((r = ddp__tcp_recv(s, why, (size_t)len, deadline, seconds, doing)) != DDP_SUCCESS) return r;
    why[len] = '\0';
    if (code == DDP_ERR_OUT_OF_MEMORY)
        return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "%s is full (%s) while %s: delete keys that are no longer "
                                                         "needed, or send large data with collectives (rank 0's "
                                                         "DDP_STORE_MAX_BYTES sets the store's budget)",
                               s->where, why, doing);
    return ddp__store_fail(s, (ddp_result)code, "%s refused %s: %s", s->where, doing, why);
}

/* Receive a length-prefixed value: at most capacity bytes into value, the rest read and dropped. */
static ddp_result ddp__tcp_recv_value(ddp_store *s, void *value, size_t capacity, size_t *size, double deadline,
                                      double seconds, const char *doing) {
    uint64_t len;
    unsigned char sink[4096];
    size_t keep, left;
    ddp_result r = ddp__tcp_recv(s, &len, 8, deadline, seconds, doing);
    if (r) return r;
    keep = (size_t)DDP__MIN(len, (uint64_t)capacity);
    if (keep && (r = ddp__tcp_recv(s, value, keep, deadline, seconds, doing)) != DDP_SUCCESS) return r;
    for (left = (size_t)len - keep; left > 0; left -= DDP__MIN(left, sizeof sink))
        if ((r = ddp__tcp_recv(s, sink, DDP__MIN(left, sizeof sink), deadline, seconds, doing)) != DDP_SUCCESS)
            return r;
    if (size) *size = (size_t)len;
    return DDP_SUCCESS;
}

/* WAIT for keys: the server answers one byte once they all exist. */
static ddp_result ddp__tcp_wait(ddp_store *s, const char *const *keys, int n, double timeout) {
    char doing[400], names[300];
    unsigned char reply;
    double deadline = ddp__now() + timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "waiting for %s", ddp__store_keys_text(keys, n, names, sizeof names));
    ddp__msg_begin(s, DDP__Q_WAIT);
    ddp__msg_keys(s, keys, n);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &reply, 1, deadline, timeout, doing)) != DDP_SUCCESS) return r;
    if (reply != DDP__WAIT_STOP_WAITING) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered %u to a WAIT (expected 0) while %s; is it a torch 1.13, "
                                                  "torch 2.x or ddp.h store?", s->where, reply, doing);
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    char doing[200], name[96];
    ddp_result r = ddp__tcp_wait(s, &key, 1, s->timeout);
    double deadline = ddp__now() + s->timeout; /* a fresh timeout for the answer, as torch's client has */
    if (r) return r;
    snprintf(doing, sizeof doing, "getting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_GET);
    ddp__msg_key(s, key);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_value(s, value, capacity, size, deadline, s->timeout, doing);
}

static ddp_result ddp__tcp_set(ddp_store *s, const char *key, const void *value, size_t size) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "setting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, size);
    if ((r = ddp__tcp_send(s, value, size, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_status(s, deadline, s->timeout, doing); /* the set is done (or refused) */
}

static ddp_result ddp__tcp_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    int64_t v;
    ddp_result r;
    snprintf(doing, sizeof doing, "adding to key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_ADD);
    ddp__msg_key(s, key);
    ddp__msg_put(s, &delta, 8);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv_status(s, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &v, 8, deadline, s->timeout, doing)) != DDP_SUCCESS) {
        if (r == DDP_ERR_PEER_LOST) /* torch's server drops a client that adds to a value that is no number */
            snprintf(s->error + strlen(s->error), sizeof s->error - strlen(s->error),
                     " (or key '%s' holds a value that is not an integer)", name);
        return r;
    }
    if (result) *result = v;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_check(ddp_store *s, const char *const *keys, int n, int *exists) {
    char doing[400], names[300];
    double deadline = ddp__now() + s->timeout;
    unsigned char reply;
    ddp_result r;
    snprintf(doing, sizeof doing, "checking %s", ddp__store_keys_text(keys, n, names, sizeof names));
    ddp__msg_begin(s, DDP__Q_CHECK);
    ddp__msg_keys(s, keys, n);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &reply, 1, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if (reply != DDP__CHECK_READY && reply != DDP__CHECK_NOT_READY) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered %u to a CHECK (expected 0 or 1) while %s", s->where,
                               reply, doing);
    }
    *exists = reply == DDP__CHECK_READY;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_delete(ddp_store *s, const char *key, int *deleted) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    int64_t n;
    ddp_result r;
    snprintf(doing, sizeof doing, "deleting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_DELETE_KEY);
    ddp__msg_key(s, key);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &n, 8, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if (deleted) *deleted = n == 1;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                       const void *desired, size_t desired_size, void *current, size_t capacity,
                                       size_t *size) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "compare-setting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_COMPARE_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, expected_size);
    ddp__msg_put(s, expected, expected_size);
    ddp__msg_u64(s, desired_size);
    ddp__msg_put(s, desired, desired_size);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv_status(s, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_value(s, current, capacity, size, deadline, s->timeout, doing);
}

static ddp_result ddp__tcp_num_keys(ddp_store *s, int64_t *n) {
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    ddp__msg_begin(s, DDP__Q_GETNUMKEYS);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, "counting keys")) != DDP_SUCCESS) return r;
    return ddp__tcp_recv(s, n, 8, deadline, s->timeout, "counting keys");
}

static void ddp__tcp_close(ddp_store *s) {
    ddp__tcp_disconnect(s);
    ddp__free(s->host);
    ddp__free(s->prefix);
    DDP_FREE(s->msg);
}

static const ddp__store_ops ddp__tcp_ops = {ddp__tcp_set,    ddp__tcp_get,         ddp__tcp_add,
                                            ddp__tcp_check,  ddp__tcp_wait,        ddp__tcp_delete,
                                            ddp__tcp_compare_set, ddp__tcp_num_keys, ddp__tcp_close};

static ddp_store *ddp__store_alloc(const ddp__store_ops *ops, double timeout) {
    ddp_store *s = (ddp_store *)ddp__calloc(1, sizeof *s);
    if (!s) return NULL;
    s->ops = ops;
    s->fd = s->file_fd = -1;
    ddp__store_set_timeout(s, timeout);
    return s;
}

/* DDP_STORE_PROTOCOL: auto (unset) 0, "1.13" or "1" 1, "2" or "2.x" 2. */
static ddp_result ddp__store_protocol_setting(int *proto, char *err) {
    const char *v = ddp__env("DDP_STORE_PROTOCOL");
    *proto = 0;
    if (!v || strcmp(v, "auto") == 0) return DDP_SUCCESS;
    if (strcmp(v, "1.13") == 0 || strcmp(v, "1") == 0) *proto = 1;
    else if (strcmp(v, "2") == 0 || strcmp(v, "2.x") == 0) *proto = 2;
    else
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_PROTOCOL=%s: expected auto, 1.13 (torch 1.13's "
                                                           "TCPStore protocol) or 2 (torch 2.x's)", v);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_connect(const char *host, int port, const char *prefix, double timeout, ddp_store **out,
                                     char *err) {
    ddp_store *s;
    ddp_result r;
    *out = NULL;
    if (!host || !*host || port <= 0 || port > 65535)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the store address %s:%d is not a host and a port in "
                                                           "1..65535", host ? host : "(null)", port);
    if (prefix && strlen(prefix) >= DDP__STORE_MAX_KEY)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the store key prefix is %zu bytes long (the limit is %zu)",
                            strlen(prefix), DDP__STORE_MAX_KEY - 1);
    if (!(s = ddp__store_alloc(&ddp__tcp_ops, timeout)))
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory connecting to the store");
    s->host = ddp__strdup(host);
    s->prefix = ddp__strdup(prefix ? prefix : "");
    s->port = port;
    if (!s->host || !s->prefix) {
        ddp__store_free(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory connecting to the store");
    }
    s->prefix_len = strlen(s->prefix);
    snprintf(s->where, sizeof s->where, "the store at %s:%d", host, port);
    if ((r = ddp__store_protocol_setting(&s->proto, err)) != DDP_SUCCESS) {
        ddp__store_free(s);
        return r;
    }
    s->proto_why = s->proto ? "as DDP_STORE_PROTOCOL says" : NULL;
    r = ddp__tcp_connect(s, ddp__now() + s->timeout);
    if (r != DDP_SUCCESS) {
        ddp__fail_to(err, r, "%s", s->error);
        ddp__store_free(s);
        return r;
    }
    *out = s;
    return DDP_SUCCESS;
}

static int ddp__store_torch_prefix(const char *prefix_store, char *buf, size_t cap) {
    int n = prefix_store && *prefix_store ? snprintf(buf, cap, "/%s/", prefix_store) : snprintf(buf, cap, "/");
    return n >= 0 && (size_t)n < cap ? 0 : -1;
}

/* ---- file store ---- */

/* Take the file's lock (LOCK_SH or LOCK_EX) before the deadline: a holder only keeps it for one operation. */
static ddp_result ddp__file_lock(ddp_store *s, int how, double deadline, const char *doing) {
    double backoff = 0.001;
    for (;;) {
        if (flock(s->file_fd, how | LOCK_NB) == 0) return DDP_SUCCESS;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot lock %s while %s: %s", s->where, doing, strerror(errno));
        if (ddp__now() + backoff > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for the lock on %s while %s; "
                                                       "is a process holding it stuck?", s->timeout, s->where, doing);
        ddp__sleep(backoff);
        backoff = DDP__MIN(backoff * 2, 0.05);
    }
}

static void ddp__file_unlock(ddp_store *s) { flock(s->file_fd, LOCK_UN); }

/* Apply the records in buf[0 .. n) (whole records only: written under the exclusive lock). */
static ddp_result ddp__file_apply(ddp_store *s, const unsigned char *buf, size_t n) {
    size_t at = 0;
    while (at < n) {
        unsigned char op = buf[at];
        uint64_t klen, vlen = 0;
        const unsigned char *key, *value = NULL;
        if (n - at < 9 || (op != 'S' && op != 'D')) break;
        memcpy(&klen, buf + at + 1, 8);
        if (klen > DDP__STORE_MAX_KEY || n - at - 9 < klen) break;
        key = buf + at + 9;
        at += 9 + (size_t)klen;
        if (op == 'S') {
            unsigned char *copy;
            if (n - at < 8) break;
            memcpy(&vlen, buf + at, 8);
            if (vlen > DDP__STORE_MAX_VALUE || n - at - 8 < vlen) break;
            value = buf + at + 8;
            at += 8 + (size_t)vlen;
            copy = ddp__store_dup(value, (size_t)vlen);
            if (!copy || ddp__kv_put(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen), copy, (size_t)vlen) < 0)
                return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %s", s->where);
        } else {
            ddp__kv_remove(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen));
        }
    }
    if (at == n) return DDP_SUCCESS;
    return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is damaged: a bad or cut-off record %llu bytes into it (was a "
                                              "writer killed?); delete the file and start every rank again",
                           s->where, (unsigned long long)(s->file_off + at));
}

/* Under the lock: check that the file is still the one at the path, and replay what this handle has not
   seen yet. */
static ddp_result ddp__file_sync(ddp_store *s) {
    struct stat st, at_path;
    unsigned char *buf;
    size_t n, got = 0;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (stat(s->path, &at_path) != 0 || at_path.st_ino != st.st_ino || at_path.st_dev != st.st_dev)
        return ddp__store_fail(s, DDP_ERR_STATE, "%s was deleted or replaced (the last of its users closed it); "
                                                 "every rank must open the store before any closes it", s->where);
    if ((uint64_t)st.st_size == s->file_off) return DDP_SUCCESS;
    if ((uint64_t)st.st_size < s->file_off)
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s shrank from %llu to %llu bytes; something else writes to it",
                               s->where, (unsigned long long)s->file_off, (unsigned long long)st.st_size);
    n = (size_t)((uint64_t)st.st_size - s->file_off);
    if (!(buf = (unsigned char *)ddp__malloc(n)))
        return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %zu bytes of %s", n, s->where);
    while (got < n) {
        ssize_t k = pread(s->file_fd, buf + got, n - got, (off_t)(s->file_off + got));
        if (k > 0) {
            got += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        ddp__free(buf);
        return ddp__store_fail(s, DDP_ERR_IO, "cannot read %s: %s", s->where, k < 0 ? strerror(errno) : "short read");
    }
    if (s->file_off == 0) { /* a new handle: the file must start with the magic */
        if (n < 8 || memcmp(buf, DDP__STORE_FILE_MAGIC, 8) != 0) {
            ddp__free(buf);
            return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is not a ddp.h file store (another program's file, or one "
                                                      "left by another tool?); use a new path", s->where);
        }
        r = ddp__file_apply(s, buf + 8, n - 8);
    } else {
        r = ddp__file_apply(s, buf, n);
    }
    ddp__free(buf);
    if (r == DDP_SUCCESS) s->file_off = (uint64_t)st.st_size;
    return r;
}

static ddp_result ddp__file_write(ddp_store *s, const void *buf, size_t n) {
    const char *p = (const char *)buf;
    while (n > 0) {
        ssize_t k = write(s->file_fd, p, n);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        return ddp__store_fail(s, DDP_ERR_IO, "cannot write to %s: %s", s->where, k < 0 ? strerror(errno) : "no space");
    }
    return DDP_SUCCESS;
}

/* Under the exclusive lock, after ddp__file_sync: append a record ('S' with a value, 'D' without) and apply it. */
static ddp_result ddp__file_append(ddp_store *s, char op, const char *key, size_t klen, const void *value, size_t vlen) {
    size_t n = 9 + klen + (op == 'S' ? 8 + vlen : 0);
    unsigned char *rec = (unsigned char *)ddp__malloc(n);
    uint64_t k64 = klen, v64 = vlen;
    ddp_result r;
    if (!rec) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory writing %s", s->where);
    rec[0] = (unsigned char)op;
    memcpy(rec + 1, &k64, 8);
    memcpy(rec + 9, key, klen);
    if (op == 'S') {
        memcpy(rec + 9 + klen, &v64, 8);
        if (vlen) memcpy(rec + 17 + klen, value, vlen);
    }
    r = ddp__file_write(s, rec, n);
    if (r == DDP_SUCCESS) r = ddp__file_apply(s, rec, n);
    if (r == DDP_SUCCESS) s->file_off += n;
    ddp__free(rec);
    return r;
}

/* Run body (one of the ddp__file_*_locked functions) under the lock, after catching up with the file. */
#define DDP__FILE_LOCKED(s, how, doing, call)                                    \
    do {                                                                         \
        ddp_result r_ = ddp__file_lock(s, how, ddp__now() + (s)->timeout, doing); \
        if (r_ != DDP_SUCCESS) return r_;                                        \
        r_ = ddp__file_sync(s);                                                  \
        if (r_ == DDP_SUCCESS) r_ = (call);                                      \
        ddp__file_unlock(s);                                                     \
        return r_;                                                               \
    } while (0)

static ddp__kv *ddp__file_find(ddp_store *s, const char *key) {
    size_t n = strlen(key);
    return ddp__kv_find(&s->kv, key, n, ddp__store_hash(key, n));
}

static ddp_result ddp__file_set(ddp_store *s, const char *key, const void *value, size_t size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "setting a key", ddp__file_append(s, 'S', key, strlen(key), value, size));
}

static ddp_result ddp__file_add_locked(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp__kv *kv = ddp__file_find(s, key);
    int64_t old = 0, now;
    char text[32], name[96];
    int n;
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0)
        return ddp__store_fail(s, DDP_ERR_STATE, "cannot add to key '%s' in %s: its value is not an integer",
                               ddp__store_key_text(key, strlen(key), name, sizeof name), s->where);
    if (ddp__store_add_int(old, delta, &now) != 0)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "cannot add %lld to key '%s' in %s: it holds %lld, and the "
                                                            "sum would overflow int64 (the store does not wrap around)",
                               (long long)delta, ddp__store_key_text(key, strlen(key), name, sizeof name), s->where,
                               (long long)old);
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    if (result) *result = now;
    return ddp__file_append(s, 'S', key, strlen(key), text, (size_t)n);
}

static ddp_result ddp__file_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    DDP__FILE_LOCKED(s, LOCK_EX, "adding to a key", ddp__file_add_locked(s, key, delta, result));
}

static ddp_result ddp__file_check_locked(ddp_store *s, const char *const *keys, int n, int *exists) {
    int i;
    *exists = 1;
    for (i = 0; i < n; i++)
        if (!ddp__file_find(s, keys[i])) *exists = 0;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_check(ddp_store *s, const char *const *keys, int n, int *exists) {
    DDP__FILE_LOCKED(s, LOCK_SH, "checking keys", ddp__file_check_locked(s, keys, n, exists));
}

/* Poll until every key exists; with want_value, copy keys[0]'s value out while still holding the lock. */
static ddp_result ddp__file_poll(ddp_store *s, const char *const *keys, int n, double timeout, int want_value,
                                 void *value, size_t capacity, size_t *size) {
    double deadline = ddp__now() + timeout, backoff = 0.001;
    char names[300];
    int first = 1;
    for (;;) {
        struct stat st;
        /* nothing new in the file since the last look: no need to take the lock */
        if (first || fstat(s->file_fd, &st) != 0 || (uint64_t)st.st_size != s->file_off) {
            int all = 0;
            ddp_result r = ddp__file_lock(s, LOCK_SH, deadline, "waiting for keys");
            if (r) return r;
            r = ddp__file_sync(s);
            if (r == DDP_SUCCESS) ddp__file_check_locked(s, keys, n, &all);
            if (r == DDP_SUCCESS && all && want_value) {
                ddp__kv *kv = ddp__file_find(s, keys[0]);
                if (capacity) memcpy(value, kv->value, DDP__MIN(capacity, kv->value_len));
                if (size) *size = kv->value_len;
            }
            ddp__file_unlock(s);
            if (r) return r;
            if (all) return DDP_SUCCESS;
            first = 0;
        }
        if (ddp__now() >= deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for %s in %s; is every rank "
                                                       "running and doing the same steps? (DDP_TIMEOUT sets the timeout)",
                                   timeout, ddp__store_keys_text(keys, n, names, sizeof names), s->where);
        ddp__sleep(DDP__MIN(backoff, DDP__MAX(deadline - ddp__now(), 0.0)));
        backoff = DDP__MIN(backoff * 1.5, 0.05);
    }
}

static ddp_result ddp__file_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    return ddp__file_poll(s, &key, 1, s->timeout, 1, value, capacity, size);
}

static ddp_result ddp__file_wait(ddp_store *s, const char *const *keys, int n, double timeout) {
    return ddp__file_poll(s, keys, n, timeout, 0, NULL, 0, NULL);
}

static ddp_result ddp__file_delete_locked(ddp_store *s, const char *key, int *deleted) {
    int there = ddp__file_find(s, key) != NULL;
    if (deleted) *deleted = there;
    return there ? ddp__file_append(s, 'D', key, strlen(key), NULL, 0) : DDP_SUCCESS;
}

static ddp_result ddp__file_delete(ddp_store *s, const char *key, int *deleted) {
    DDP__FILE_LOCKED(s, LOCK_EX, "deleting a key", ddp__file_delete_locked(s, key, deleted));
}

static ddp_result ddp__file_compare_set_locked(ddp_store *s, const char *key, const void *expected, size_t elen,
                                               const void *desired, size_t dlen, void *current, size_t capacity,
                                               size_t *size) {
    ddp__kv *kv = ddp__file_find(s, key);
    ddp_result r;
    if (!kv && elen != 0) { /* torch answers with expected here */
        if (current) memcpy(current, expected, DDP__MIN(capacity, elen));
        if (size) *size = elen;
        return DDP_SUCCESS;
    }
    if (!kv || (kv->value_len == elen && memcmp(kv->value, expected, elen) == 0)) {
        if ((r = ddp__file_append(s, 'S', key, strlen(key), desired, dlen)) != DDP_SUCCESS) return r;
        kv = ddp__file_find(s, key);
    }
    if (current) memcpy(current, kv->value, DDP__MIN(capacity, kv->value_len));
    if (size) *size = kv->value_len;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                        const void *desired, size_t desired_size, void *current, size_t capacity,
                                        size_t *size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "compare-setting a key",
                     ddp__file_compare_set_locked(s, key, expected, expected_size, desired, desired_size, current,
                                                  capacity, size));
}

static ddp_result ddp__file_num_keys_locked(ddp_store *s, int64_t *n) {
    *n = (int64_t)s->kv.count - (ddp__file_find(s, DDP__STORE_FILE_REFS) ? 1 : 0);
    return DDP_SUCCESS;
}

static ddp_result ddp__file_num_keys(ddp_store *s, int64_t *n) {
    DDP__FILE_LOCKED(s, LOCK_SH, "counting keys", ddp__file_num_keys_locked(s, n));
}

/* The last user to leave deletes the file, as torch's FileStore does. */
static void ddp__file_close(ddp_store *s) {
    if (s->file_fd >= 0 && s->file_off > 0 &&
        ddp__file_lock(s, LOCK_EX, ddp__now() + s->timeout, "closing") == DDP_SUCCESS) {
        int64_t users = 1;
        if (ddp__file_sync(s) == DDP_SUCCESS && ddp__file_add_locked(s, DDP__STORE_FILE_REFS, -1, &users) == DDP_SUCCESS &&
            users <= 0)
            unlink(s->path);
        ddp__file_unlock(s);
    }
    if (s->file_fd >= 0) close(s->file_fd);
    s->file_fd = -1;
    ddp__kv_clear(&s->kv);
    ddp__free(s->path);
}

static const ddp__store_ops ddp__file_ops = {ddp__file_set,    ddp__file_get,         ddp__file_add,
                                             ddp__file_check,  ddp__file_wait,        ddp__file_delete,
                                             ddp__file_compare_set, ddp__file_num_keys, ddp__file_close};

/* Open the file and lock it, making sure the locked file is still the one at the path: the last user of an
   old store may have deleted it between our open and our lock. */
static ddp_result ddp__file_open_locked(ddp_store *s, double deadline) {
    for (;;) {
        struct stat st, at_path;
        ddp_result r;
        s->file_fd = open(s->path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (s->file_fd < 0)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot open %s: %s (its directory must exist and be writable by "
                                                  "every rank)", s->where, strerror(errno));
        if ((r = ddp__file_lock(s, LOCK_EX, deadline, "opening it")) != DDP_SUCCESS) return r;
        if (fstat(s->file_fd, &st) == 0 && stat(s->path, &at_path) == 0 && st.st_ino == at_path.st_ino &&
            st.st_dev == at_path.st_dev)
            return DDP_SUCCESS;
        close(s->file_fd); /* closing drops the lock */
        s->file_fd = -1;
        if (ddp__now() > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out opening %s: it keeps being replaced", s->where);
    }
}

static ddp_result ddp__file_open_body(ddp_store *s) {
    struct stat st;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (st.st_size == 0 && (r = ddp__file_write(s, DDP__STORE_FILE_MAGIC, 8)) != DDP_SUCCESS) return r;
    if ((r = ddp__file_sync(s)) != DDP_SUCCESS) return r;
    return ddp__file_add_locked(s, DDP__STORE_FILE_REFS, 1, NULL);
}

static ddp_result ddp__store_open_file(const char *path, double timeout, ddp_store **out, char *err) {
    ddp_store *s;
    ddp_result r;
    *out = NULL;
    if (!path || !*path) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the file store needs a path");
    if (!(s = ddp__store_alloc(&ddp__file_ops, timeout)) || !(s->path = ddp__strdup(path))) {
        ddp__free(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory opening the file store");
    }
    snprintf(s->where, sizeof s->where, "the file store %s", path);
    r = ddp__file_open_locked(s, ddp__now() + s->timeout);
    if (r == DDP_SUCCESS) {
        r = ddp__file_open_body(s);
        ddp__file_unlock(s);
    }
    if (r != DDP_SUCCESS) {
        ddp__fail_to(err, r, "%s", s->error);
        s->file_off = 0; /* not counted as a user: leave the count alone when closing */
        ddp__store_free(s);
        return r;
    }
    *out = s;
    return DDP_SUCCESS;
}

/* ---- both kinds ---- */

static void ddp__store_free(ddp_store *s) {
    if (!s) return;
    s->ops->close(s);
    ddp__free(s);
}

static void ddp__store_set_timeout(ddp_store *s, double timeout) { s->timeout = timeout > 0 ? timeout : 300.0; }

/* Checks shared by the public calls; messages go to the store (or this thread's buffer without one). */
static ddp_result ddp__store_check_key(ddp_store *s, const char *key, const char *call) {
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (!key) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is NULL", call);
    if (strlen(key) + s->prefix_len >= DDP__STORE_MAX_KEY)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is %zu bytes long; keys (with the store's "
                                                            "prefix) must stay under %zu bytes",
                               call, strlen(key), DDP__STORE_MAX_KEY);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_value(ddp_store *s, const void *value, size_t size, const char *call) {
    if (!value && size) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the value is NULL but its size is %zu", call, size);
    if (size > DDP__STORE_MAX_VALUE)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: a value of %zu bytes is over the store's limit of %zu "
                                                            "MiB; send large data with collectives instead",
                               call, size, DDP__STORE_MAX_VALUE >> 20);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_keys(ddp_store *s, const char *const *keys, int n, const char *call) {
    int i;
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (n < 0 || (uint64_t)n > DDP__STORE_MAX_WAIT_KEYS || (n > 0 && !keys))
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: %d keys%s (0 to %llu keys at once)", call, n,
                               n > 0 && !keys ? " in a NULL array" : "", (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
    for (i = 0; i < n; i++)
        if ((r = ddp__store_check_key(s, keys[i], call)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

static ddp_result ddp__store_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                         const void *desired, size_t desired_size, void *current, size_t capacity,
                                         size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, expected, expected_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, desired, desired_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS && !current && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp__store_compare_set: current is NULL but capacity is %zu",
                            capacity);
    if (r) return r;
    return s->ops->compare_set(s, key, expected, expected_size, desired, desired_size, current, capacity, size);
}

static ddp_result ddp__store_num_keys(ddp_store *s, int64_t *n) {
    if (!s || !n) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp__store_num_keys: NULL store or result");
    return s->ops->num_keys(s, n);
}

DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, value, size, "ddp_store_set");
    return r ? r : s->ops->set(s, key, value, size);
}

DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_get");
    if (r == DDP_SUCCESS && !value && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_get: value is NULL but capacity is %zu", capacity);
    return r ? r : s->ops->get(s, key, value, capacity, size);
}

DDP_API ddp_result ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_add");
    return r ? r : s->ops->add(s, key, delta, result);
}

DDP_API ddp_result ddp_store_check(ddp_store *s, const char *key, int *exists) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_check");
    if (r == DDP_SUCCESS && !exists) r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_check: exists is NULL");
    return r ? r : s->ops->check(s, &key, 1, exists);
}

DDP_API ddp_result ddp_store_wait(ddp_store *s, const char *const *keys, int n, double timeout_seconds) {
    ddp_result r = ddp__store_check_keys(s, keys, n, "ddp_store_wait");
    return r ? r : s->ops->wait(s, keys, n, timeout_seconds > 0 ? timeout_seconds : s->timeout);
}

DDP_API ddp_result ddp_store_delete(ddp_store *s, const char *key, int *deleted) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_delete");
    return r ? r : s->ops->del(s, key, deleted);
}

DDP_API const char *ddp_store_last_error(const ddp_store *s) { return s ? s->error : ddp_last_error(NULL); }
/* ==================== end src/store.c ==================== */

/* ==================== begin src/link.c ==================== */
/* [SECTION] link: connections between the ranks of a group, made on first use
   After the rendezvous every rank knows where every other rank listens (the table, g->mesh.dir) and keeps
   its own listening socket open for the group's life. No connection is made in advance: the first
   time an algorithm's step sends to a rank this one has no connection with, it dials that rank
   (ddp__link_want); a rank waiting in any step also accepts whatever connects to it. So a rank holds
   the connections its collectives use and no others: the dissemination barrier that ends ddp_init
   makes the ring neighbours and the ranks 2^k away (2 ceil(log2 N) connections), recursive doubling,
   the binomial tree and the ring add at most about as many again: O(log N) sockets a rank instead of
   the N - 1 of a full mesh.

   Who dials: the SENDER of a step, never the receiver, so that a frame a rank sends always reaches its
   receiver, whatever that rank is doing inside the same collective; tcp.c's argument that a mismatch is an
   error on every rank rests on this. Two ranks that send to each other at once both dial; each side
   decides alone, with the same answer: the connection dialed by the higher rank is kept.

   A handshake, dialing side (one ddp__shake, moved on as bytes arrive, inside the poll of the step):
       connect -> [DDP_AUTH_TOKEN: hello + nonce, answer, proof, verdict (auth.c)] -> group hello -> ack
   accepting side, the mirror: [auth] -> group hello -> ack 1 (kept: the connection is this peer's from
   now on) or ack 0 (a duplicate: a connection to that rank exists already, or this rank is the higher
   one and dials it too). The dialer sends nothing else before the ack, so a connection carries frames
   only once both sides have kept it. The group hello names the rank, the world size and a hash of the
   group's store prefix: a stray connection, another group's or another program's, is refused with a
   warning; at most DDP__PENDING_MAX unidentified connections wait at once, each for at most
   DDP__PENDING_SECONDS (the oldest goes first).

   A dial that is refused means nothing listens there any more: the rank exited or left the group. The
   dialer retries for DDP__REFUSED_GRACE s, watching its other connections meanwhile (the ABORT of a
   rank that failed with a reason arrives there, and is the better message), then fails the step naming
   the rank as lost. During ddp_init's own set-up the store is asked too (group.c ddp__setup_watch): a
   rank that failed there published why. */

#define DDP__HELLO_MAGIC 0x48444450u /* "PDDH": first words on a connection between ranks */
#define DDP__PENDING_SECONDS 10      /* an accepted connection has this long to say which rank it is */
#define DDP__REFUSED_GRACE 1.0       /* a port refusing this long: its rank is gone */

typedef struct ddp__hello {
    uint32_t magic;
    int32_t rank, world;
    uint32_t pad;
    uint64_t group; /* ddp__link_group_hash: a stray connection from another group is refused */
} ddp__hello;

/* Handshake steps. Accepting: the auth hello, its proof, the group hello. Dialing: the connect, the
   auth answer, the verdict, the ack. */
enum { DDP__SHAKE_AUTH_HELLO, DDP__SHAKE_AUTH_PROOF, DDP__SHAKE_HELLO, DDP__SHAKE_CONNECTING, DDP__SHAKE_ANSWER,
       DDP__SHAKE_VERDICT, DDP__SHAKE_ACK };

static uint64_t ddp__link_group_hash(const ddp_group *g) { return ddp__hash(g->member.prefix); }

static void ddp__link_hello(const ddp_group *g, ddp__hello *h) {
    memset(h, 0, sizeof *h);
    h->magic = DDP__HELLO_MAGIC;
    h->rank = g->rank;
    h->world = g->world_size;
    h->group = ddp__link_group_hash(g);
}

/* ---- the table ---- */

static const char *ddp__peer_name(const ddp_group *g, int i, char *buf, size_t cap) {
    if (g->mesh.dir && i >= 0 && i < g->world_size)
        snprintf(buf, cap, "host %.100s, pid %d", g->mesh.names + g->mesh.dir[i].host, g->mesh.dir[i].pid);
    else
        snprintf(buf, cap, "rank %d", i);
    return buf;
}

static void ddp__link_keep(ddp_group *g, int rank, int fd) {
    g->mesh.peers[rank].fd = fd;
    g->mesh.peers[rank].awaits_dial = 0;
    g->mesh.peers[rank].refused_since = 0;
    g->mesh.linked[g->mesh.nlinked++] = rank;
    ddp__log(g, DDP_LOG_DEBUG, "connected to rank %d (%d connections)", rank, g->mesh.nlinked);
}

static void ddp__shake_drop(ddp_group *g, int i) {
    if (g->mesh.shakes[i].fd >= 0) close(g->mesh.shakes[i].fd);
    memmove(g->mesh.shakes + i, g->mesh.shakes + i + 1, (size_t)(g->mesh.nshakes - i - 1) * sizeof *g->mesh.shakes);
    g->mesh.nshakes--;
}

static ddp__shake *ddp__shake_add(ddp_group *g, int fd, int rank, int dialing, int step, size_t need, double deadline) {
    ddp__shake *s = &g->mesh.shakes[g->mesh.nshakes++];
    memset(s, 0, sizeof *s);
    s->fd = fd, s->rank = rank, s->dialing = dialing, s->step = step, s->need = need, s->deadline = deadline;
    return s;
}

static int ddp__link_dialing(const ddp_group *g, int rank) {
    int i;
    for (i = 0; i < g->mesh.nshakes; i++)
        if (g->mesh.shakes[i].dialing && g->mesh.shakes[i].rank == rank) return 1;
    return 0;
}

/* ---- dialing ---- */

/* rank's port refused a dial (or closed it before the ack): dial again shortly; ddp__link_check_refused
   calls it gone once this has lasted DDP__REFUSED_GRACE s. */
static void ddp__link_refused(ddp_group *g, int rank) {
    ddp__peer *p = &g->mesh.peers[rank];
    if (!p->refused_since) p->refused_since = ddp__now();
    p->dial_after = ddp__now() + 0.02;
}

static ddp_result ddp__link_want(ddp_group *g, int peer) {
    ddp__peer *p = &g->mesh.peers[peer];
    const ddp__peer_info *d = &g->mesh.dir[peer];
    char err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX];
    int fd = -1, refused = 0;
    ddp_result r;
    if (p->fd >= 0 || p->awaits_dial || ddp__link_dialing(g, peer) || ddp__now() < p->dial_after) return DDP_SUCCESS;
    if (g->mesh.nshakes == DDP__SHAKES_MAX) ddp__shake_drop(g, 0); /* full of strays: the oldest goes */
    r = ddp__net_connect_start(g->mesh.names + d->addr, d->port, &fd, &refused, err);
    if (r == DDP_SUCCESS) {
        ddp__shake_add(g, fd, peer, 1, DDP__SHAKE_CONNECTING, 0, 0);
        return DDP_SUCCESS;
    }
    if (refused) {
        ddp__link_refused(g, peer);
        return DDP_SUCCESS;
    }
    return ddp__coll_fail(g, r, "connecting to rank %d (%s) at %s:%d: %s", peer, ddp__peer_name(g, peer, name, sizeof name),
                          g->mesh.names + d->addr, d->port, err);
}

/* The dialer's next bytes after `s->step` completed: send what the protocol says and wait for the answer. */
static int ddp__shake_send_hello(ddp_group *g, ddp__shake *s) {
    ddp__hello h;
    char err[DDP__ERR_MAX];
    ddp__link_hello(g, &h);
    s->step = DDP__SHAKE_ACK, s->have = 0, s->need = 1;
    return ddp__net_send(s->fd, &h, sizeof h, ddp__now() + 1.0, err) == DDP_SUCCESS;
}

/* A dial's connect finished (POLLOUT): connected, or refused. 1: go on, 0: refused (dropped), -1: failed
   otherwise (err set). */
static int ddp__shake_connected(ddp_group *g, ddp__shake *s, char *err) {
    int e = 0;
    socklen_t len = sizeof e;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
    if (e == ECONNREFUSED) return 0;
    if (e != 0) {
        snprintf(err, DDP__ERR_MAX, "connect: %s", strerror(e));
        return -1;
    }
    if (ddp__auth_token()) {
        memcpy(s->buf, DDP__AUTH_MAGIC, 8);
        ddp__auth_nonce(s->cn);
        memcpy(s->buf + 8, s->cn, DDP__AUTH_NONCE);
        s->step = DDP__SHAKE_ANSWER, s->have = 0, s->need = DDP__AUTH_NONCE + DDP__AUTH_MAC;
        if (ddp__net_send(s->fd, s->buf, 8 + DDP__AUTH_NONCE, ddp__now() + 1.0, err) != DDP_SUCCESS) return -1;
        return 1;
    }
    if (!ddp__shake_send_hello(g, s)) {
        snprintf(err, DDP__ERR_MAX, "the connection closed during the hello");
        return -1;
    }
    return 1;
}

/* Bytes arrived for a dial in s->step (all s->need of them). 1: go on (or kept/duplicate: s->fd is -1
   then), -1: failed (err). */
static int ddp__shake_dial_step(ddp_group *g, ddp__shake *s, char *err) {
    unsigned char want[DDP__AUTH_MAC];
    if (s->step == DDP__SHAKE_ANSWER) {
        ddp__auth_proof(ddp__auth_token(), "server", s->cn, s->buf, want);
        if (!ddp__auth_equal(want, s->buf + DDP__AUTH_NONCE, DDP__AUTH_MAC)) {
            snprintf(err, DDP__ERR_MAX, "it does not know this process's DDP_AUTH_TOKEN (its proof is wrong): every rank "
                     "needs the same token");
            return -1;
        }
        ddp__auth_proof(ddp__auth_token(), "client", s->cn, s->buf, want);
        s->step = DDP__SHAKE_VERDICT, s->have = 0, s->need = 1;
        if (ddp__net_send(s->fd, want, sizeof want, ddp__now() + 1.0, err) != DDP_SUCCESS) return -1;
        return 1;
    }
    if (s->step == DDP__SHAKE_VERDICT) {
        if (s->buf[0] != 1) {
            snprintf(err, DDP__ERR_MAX, "it refused this process's DDP_AUTH_TOKEN: every rank needs the same token");
            return -1;
        }
        if (!ddp__shake_send_hello(g, s)) {
            snprintf(err, DDP__ERR_MAX, "the connection closed during the hello");
            return -1;
        }
        return 1;
    }
    /* DDP__SHAKE_ACK */
    if (s->buf[0] == 1 && g->mesh.peers[s->rank].fd < 0) {
        ddp__link_keep(g, s->rank, s->fd);
    } else { /* a duplicate: the peer dials this rank as well, and its dial wins */
        close(s->fd);
        if (g->mesh.peers[s->rank].fd < 0) g->mesh.peers[s->rank].awaits_dial = 1;
    }
    s->fd = -1;
    return 1;
}

/* ---- accepting ---- */

/* The accepting side's next step after s->need bytes arrived. 1: go on (or kept: s->fd is -1 then),
   -1: refused (why in *refusal). */
static int ddp__shake_accept_step(ddp_group *g, ddp__shake *s, const char **refusal) {
    unsigned char reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], verdict, ack;
    char why[DDP__ERR_MAX];
    ddp__hello h;
    if (s->step == DDP__SHAKE_AUTH_HELLO) {
        if (ddp__auth_answer(ddp__auth_token(), s->buf, s->cn, s->sn, reply) != 0) {
            *refusal = "it did not authenticate (no DDP_AUTH_TOKEN on its side?)";
            return -1;
        }
        if (ddp__net_send(s->fd, reply, sizeof reply, ddp__now() + 1.0, why) != DDP_SUCCESS) {
            *refusal = "it broke off the authentication";
            return -1;
        }
        s->step = DDP__SHAKE_AUTH_PROOF, s->have = 0, s->need = DDP__AUTH_MAC;
        return 1;
    }
    if (s->step == DDP__SHAKE_AUTH_PROOF) {
        verdict = (unsigned char)ddp__auth_check(ddp__auth_token(), s->cn, s->sn, s->buf);
        ddp__net_send(s->fd, &verdict, 1, ddp__now() + 1.0, why);
        if (!verdict) {
            *refusal = "its DDP_AUTH_TOKEN is different";
            return -1;
        }
        s->step = DDP__SHAKE_HELLO, s->have = 0, s->need = sizeof(ddp__hello);
        return 1;
    }
    memcpy(&h, s->buf, sizeof h);
    if (h.magic != DDP__HELLO_MAGIC || h.world != g->world_size || h.group != ddp__link_group_hash(g) || h.rank < 0 ||
        h.rank >= g->world_size || h.rank == g->rank) {
        *refusal = "it is not a rank of this group";
        return -1;
    }
    /* Keep it unless this rank has a connection to h.rank already, or dials it too and is the higher rank. */
    ack = g->mesh.peers[h.rank].fd < 0 && !(g->rank > h.rank && ddp__link_dialing(g, h.rank));
    if (ddp__net_send(s->fd, &ack, 1, ddp__now() + 1.0, why) != DDP_SUCCESS) ack = 0;
    if (ack) ddp__link_keep(g, h.rank, s->fd);
    else close(s->fd);
    s->fd = -1;
    return 1;
}

/* Take what arrived on the listening socket: every connection waiting there, each as a handshake. */
static ddp_result ddp__link_accept(ddp_group *g) {
    for (;;) {
        int fd = accept(g->mesh.listen_fd, NULL, NULL);
        char err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX];
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return DDP_SUCCESS;
            if (ddp__out_of_descriptors(errno)) ddp__fail_descriptors(err, errno, "it cannot accept a connection from another rank");
            else snprintf(err, sizeof err, "accept: %s", strerror(errno));
            return ddp__coll_fail(g, DDP_ERR_SYSTEM, "rank %d (%s): %s", g->rank, ddp__peer_name(g, g->rank, name, sizeof name), err);
        }
        ddp__net_configure(fd);
        if (g->mesh.nshakes == DDP__SHAKES_MAX) {
            ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: %d others were waiting to identify "
                     "themselves", DDP__PENDING_MAX);
            ddp__shake_drop(g, 0);
        }
        if (ddp__auth_token()) ddp__shake_add(g, fd, -1, 0, DDP__SHAKE_AUTH_HELLO, 8 + DDP__AUTH_NONCE, ddp__now() + DDP__PENDING_SECONDS);
        else ddp__shake_add(g, fd, -1, 0, DDP__SHAKE_HELLO, sizeof(ddp__hello), ddp__now() + DDP__PENDING_SECONDS);
    }
}

/* ---- inside a step's poll ---- */

static int ddp__link_poll_entries(ddp_group *g, struct pollfd *fds, int *owner, double *wake) {
    int i, n = 0;
    if (g->mesh.listen_fd >= 0) {
        fds[n].fd = g->mesh.listen_fd, fds[n].events = POLLIN, fds[n].revents = 0;
        owner[n++] = -2;
    }
    for (i = 0; i < g->mesh.nshakes; i++) {
        ddp__shake *s = &g->mesh.shakes[i];
        fds[n].fd = s->fd, fds[n].events = s->step == DDP__SHAKE_CONNECTING ? POLLOUT : POLLIN, fds[n].revents = 0;
        owner[n++] = -3 - i;
        if (!s->dialing && s->deadline < *wake) *wake = s->deadline;
    }
    return n;
}

/* Read what s waits for; 1 when all s->need bytes are there, 0 not yet, -1 closed or failed. */
static int ddp__shake_read(ddp__shake *s) {
    ssize_t k = recv(s->fd, s->buf + s->have, s->need - s->have, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (k <= 0) return -1;
    s->have += (size_t)k;
    return s->have == s->need;
}

/* One handshake had an event. Returns a failure of the step (a dial that cannot go on), else success. */
static ddp_result ddp__shake_event(ddp_group *g, int i, short re, int *progressed) {
    ddp__shake *s = &g->mesh.shakes[i];
    char err[DDP__ERR_MAX] = "", name[DDP__PEER_NAME_MAX];
    const char *refusal = NULL;
    int got = 0, rank = s->rank;
    if (s->step == DDP__SHAKE_CONNECTING) {
        if (!(re & (POLLOUT | POLLERR | POLLHUP))) return DDP_SUCCESS;
        got = ddp__shake_connected(g, s, err);
    } else {
        got = ddp__shake_read(s);
        if (got == 0) return DDP_SUCCESS;
        if (got < 0 && !s->dialing) {
            refusal = "it closed the connection before saying which rank it is";
        } else if (got > 0) {
            got = s->dialing ? ddp__shake_dial_step(g, s, err) : ddp__shake_accept_step(g, s, &refusal);
        }
    }
    if (got == 0 || (got < 0 && s->dialing && !err[0])) {
        /* refused, or closed before the ack (the rank went away, or its accept failed): try again shortly,
           watching the other connections for its ABORT, until DDP__REFUSED_GRACE says it is gone */
        ddp__link_refused(g, rank);
        ddp__shake_drop(g, i);
        return DDP_SUCCESS;
    }
    *progressed = 1;
    if (got > 0) {
        if (s->fd < 0) ddp__shake_drop(g, i); /* kept, or a duplicate closed */
        return DDP_SUCCESS;
    }
    if (!s->dialing) {
        ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: %s", refusal ? refusal : err);
        ddp__shake_drop(g, i);
        return DDP_SUCCESS;
    }
    ddp__shake_drop(g, i);
    return ddp__coll_fail(g, DDP_ERR_INIT, "connecting to rank %d (%s): %s", rank, ddp__peer_name(g, rank, name, sizeof name),
                          err);
}

static ddp_result ddp__link_progress(ddp_group *g, const struct pollfd *fds, const int *owner, int n, int *progressed) {
    int i, done = 0;
    ddp_result r;
    double now = ddp__now();
    /* Handshakes first, from the last entry back, so that dropping one leaves the indices of the rest. */
    for (i = n - 1; i >= 0; i--) {
        int k = -3 - owner[i];
        if (owner[i] > -3 || !fds[i].revents) continue;
        if ((r = ddp__shake_event(g, k, fds[i].revents, progressed)) != DDP_SUCCESS) return r;
    }
    for (i = g->mesh.nshakes - 1; i >= 0; i--) /* accepted ones that never said who they are */
        if (!g->mesh.shakes[i].dialing && now >= g->mesh.shakes[i].deadline) {
            ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: it did not say which rank it is "
                     "within %d s", DDP__PENDING_SECONDS);
            ddp__shake_drop(g, i);
        }
    for (i = 0; i < n; i++)
        if (owner[i] == -2 && (fds[i].revents & POLLIN)) done = 1;
    if (done && (r = ddp__link_accept(g)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

/* Has the port of `peer`, needed by this step, refused connections for DDP__REFUSED_GRACE s? Then it is
   lost (during the set-up, the store is asked first: group.c). */
static ddp_result ddp__link_check_refused(ddp_group *g, const ddp__coll *c, int peer) {
    char desc[160], name[DDP__PEER_NAME_MAX], how[320], msg[DDP__ERR_MAX];
    const ddp__peer_info *d = &g->mesh.dir[peer];
    ddp_result r;
    if (peer < 0 || !g->mesh.peers[peer].refused_since || g->mesh.peers[peer].fd >= 0) return DDP_SUCCESS;
    if (ddp__now() - g->mesh.peers[peer].refused_since < DDP__REFUSED_GRACE) return DDP_SUCCESS;
    snprintf(how, sizeof how, "its port %.128s:%d refuses connections (nothing listens there any more)",
             g->mesh.names + d->addr, d->port);
    if (g->mesh.in_setup) {
        r = ddp__setup_lost(g, peer, how);
        snprintf(msg, sizeof msg, "%s", g->error);
        return ddp__group_break(g, r, msg);
    }
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__coll_fail(g, DDP_ERR_PEER_LOST, "lost rank %d (%s): %s: its process exited or it left the group, while "
                          "this rank was in %s", peer, ddp__peer_name(g, peer, name, sizeof name), how, desc);
}

static void ddp__link_close_all(ddp_group *g) {
    int i;
    for (i = 0; g->mesh.peers && i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd >= 0) close(p->fd);
        p->fd = -1;
    }
    g->mesh.nlinked = 0;
    while (g->mesh.nshakes > 0) ddp__shake_drop(g, g->mesh.nshakes - 1);
    if (g->mesh.listen_fd >= 0) close(g->mesh.listen_fd);
    g->mesh.listen_fd = -1;
}
/* ==================== end src/link.c ==================== */

/* ==================== begin src/transport.c ==================== */
/* [SECTION] transport: framed messages between the ranks of a group, failure detection, abort
   Two ranks share one TCP connection once a step has sent from one to the other (link.c makes them on
   first use). Everything sent is a frame: a fixed header, then `bytes` of payload.

       magic | kind | collective fingerprint (seq, coll, dtype, op, root, count) | sender | bytes | code

   The fingerprint is what makes cross-rank mistakes errors instead of hangs (PyTorch offers this only
   with TORCH_DISTRIBUTED_DEBUG=DETAIL): the receiver compares it with its own, and any difference is
   DDP_ERR_MISMATCH with both sides named.

   Every frame that reaches a waiting rank is checked, not only the one it waits for. Ranks that
   disagree about a call may run different algorithms (all_reduce picks one by size), and then a
   mismatched frame can sit in a connection its receiver is not reading while every rank waits on
   another: 4 ranks, 0 and 1 in the ring, 2 and 3 in recursive doubling, 0 waits on 3, 3 on 1, 1 on 0.
   So a step also polls the other connections for input, and looks at a frame header that arrives
   there with MSG_PEEK, without taking it (connections are at a frame boundary between steps: frames
   are read whole within one). An ABORT fails the step; a frame of the same collective number with a
   different fingerprint is DDP_ERR_MISMATCH. A frame of this collective, of another number (a peer
   already past this one) or a BYE is early data: the peer is marked quiet until the next collective (by its number), so poll does not wake for
   it again.
   Nothing extra happens when nothing unexpected arrives: the same poll call watches one more event
   per connection. tcp.c says why this makes every mismatch an error on every rank.

   Failure handling. While a rank waits, it also watches every other connection it has for a hang-up
   (O(log N) of them: link.c). When a rank fails a collective (mismatch, timeout, lost peer) it "breaks"
   the group: it sends an ABORT frame carrying the error to every rank it is connected with and shuts
   those connections down. Each of them sees the hang-up within milliseconds, reads the ABORT frame,
   fails with the same code and message, and breaks in turn: the ABORT floods the graph of connections,
   which holds the ring from ddp_init's barrier on (connected, diameter O(log N) once the barrier's
   2^k links are there), so it reaches every rank that waits in a collective, and every other rank when
   it next calls one. A connection that closes without an ABORT frame means the process is gone:
   DDP_ERR_PEER_LOST, and that message is what floods.
   A graceful ddp_destroy sends BYE after a final barrier and waits for the peers' BYE before closing,
   so an orderly exit is never mistaken for a crash. */

#define DDP__FRAME_MAGIC 0x44445031u /* "DDP1" */
#define DDP__MAX_FRAME_BYTES ((uint64_t)1 << 40)

/* P2P: a point-to-point message (ddp_send), its `root` field carrying the tag, `seq` 0 (no collective). */
enum { DDP__FRAME_DATA = 1, DDP__FRAME_ABORT = 2, DDP__FRAME_BYE = 3, DDP__FRAME_P2P = 4 };

typedef struct ddp__frame {
    uint32_t magic;
    uint8_t kind; /* DDP__FRAME_* */
    uint8_t coll, dtype, op;
    int32_t root;
    int32_t src; /* sender's rank in the group */
    uint64_t seq, count;
    uint64_t bytes; /* payload that follows */
    int32_t code;   /* ABORT: the ddp_result */
    uint32_t reserved;
} ddp__frame;

static const char *ddp__coll_name(int kind) {
    static const char *names[] = {"?",       "all_reduce", "broadcast",  "reduce",       "all_gather",
                                  "reduce_scatter", "barrier", "gather", "scatter", "all_to_all", "all_to_all_v",
                                  "all_gather_v", "broadcast_bytes", "monitored_barrier", "send", "recv"};
    return (kind > 0 && kind < DDP__COLL_KINDS) ? names[kind] : "an unknown operation";
}

/* "all_reduce(count=1024, f32, sum) as collective #7". Numbers count from the end of the group's own
   set-up (g->seq_base, the same on every rank), so the program's first call is #1; a call of the set-up
   itself, in a failing ddp_init, shows its number within the set-up. */
static void ddp__coll_describe(const ddp_group *g, const ddp__coll *c, char *out, size_t cap) {
    char extra[48] = "";
    unsigned long long number = (unsigned long long)(c->seq - g->seq_base);
    if (c->kind == DDP__BARRIER || c->kind == DDP__MONITORED_BARRIER) {
        snprintf(out, cap, "%s() as collective #%llu", ddp__coll_name(c->kind), number);
        return;
    }
    if (c->kind == DDP__SEND || c->kind == DDP__RECV) { /* no collective number (and g->seq may be changing:
                                                            an isend runs on the progress thread) */
        snprintf(out, cap, "%s(%s=%d, tag=%d, count=%llu, %s)", ddp__coll_name(c->kind), c->kind == DDP__SEND ? "dst" : "src",
                 (int)c->root, (int)c->tag, (unsigned long long)c->count, ddp_dtype_name((ddp_dtype)c->dtype));
        return;
    }
    if (c->kind == DDP__BROADCAST_BYTES) {
        snprintf(out, cap, "broadcast_bytes(root=%d) as collective #%llu", (int)c->root, number);
        return;
    }
    if (c->kind == DDP__ALL_TO_ALL_V) { /* the split sizes are per rank: frames check them */
        snprintf(out, cap, "all_to_all_v(%s) as collective #%llu", ddp_dtype_name((ddp_dtype)c->dtype), number);
        return;
    }
    if (c->op != DDP__NO_OP) snprintf(extra, sizeof extra, ", %s", ddp_op_name((ddp_op)c->op));
    if (c->root >= 0) snprintf(extra + strlen(extra), sizeof extra - strlen(extra), ", root=%d", (int)c->root);
    snprintf(out, cap, "%s(%s=%llu, %s%s) as collective #%llu", ddp__coll_name(c->kind),
             c->kind == DDP__ALL_GATHER_V ? "total count" : "count", (unsigned long long)c->count,
             ddp_dtype_name((ddp_dtype)c->dtype), extra, number);
}

static int ddp__coll_equal(const ddp__coll *a, const ddp__frame *f) {
    return a->seq == f->seq && a->count == f->count && a->kind == f->coll && a->dtype == f->dtype && a->op == f->op &&
           a->root == f->root;
}

/* ---- breaking the group ---- */

/* Record the first error that breaks g, tell every peer (ABORT frame with the message) and shut the
   connections down so that peers waiting on anything notice at once. */
static ddp_result ddp__group_break_relaying(ddp_group *g, ddp_result code, const char *msg, const char *wire);
static ddp_result ddp__group_break(ddp_group *g, ddp_result code, const char *msg) {
    return ddp__group_break_relaying(g, code, msg, msg);
}

/* ddp__group_break, with `wire` as the reason the ABORT frames carry: a rank that fails with another
   rank's reason says so in its own message ("reported by rank 3; this rank was in ...") but passes the
   reason on as it came, so that the message does not grow at each hop of the flood. */
static ddp_result ddp__group_break_relaying(ddp_group *g, ddp_result code, const char *msg, const char *wire) {
    int i;
    if (g->broken) return g->broken;
    g->broken = code;
    snprintf(g->broken_msg, sizeof g->broken_msg, "%s", msg);
    ddp__log(g, DDP_LOG_ERROR, "%s", msg);
    ddp__shm_abort(g);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        ddp__frame f;
        char err[DDP__ERR_MAX];
        size_t len = strlen(wire) + 1;
        if (p->fd < 0 || p->gone) continue;
        if (p->send_owed > 0 && p->send_owed <= ((uint64_t)256 << 20)) { /* finish the interrupted frame */
            static const char zeros[4096] = {0};
            while (p->send_owed > 0) {
                size_t k = (size_t)DDP__MIN(p->send_owed, (uint64_t)sizeof zeros);
                if (ddp__net_send(p->fd, zeros, k, ddp__now() + 0.5, err) != DDP_SUCCESS) break;
                p->send_owed -= k;
            }
        }
        if (p->send_owed > 0) { /* cannot resynchronise the stream: the peer will see a plain hang-up */
            shutdown(p->fd, SHUT_WR);
            continue;
        }
        memset(&f, 0, sizeof f);
        f.magic = DDP__FRAME_MAGIC;
        f.kind = DDP__FRAME_ABORT;
        f.src = g->rank;
        f.bytes = len;
        f.code = code;
        /* Best effort and brief: the peer may be the one that is stuck. */
        if (ddp__net_send(p->fd, &f, sizeof f, ddp__now() + 0.5, err) == DDP_SUCCESS)
            ddp__net_send(p->fd, wire, len, ddp__now() + 0.5, err);
        /* Half-close only: a full close with unread data would make the kernel send a reset, which
           throws away the ABORT frame queued at the peer before the peer reads it. */
        shutdown(p->fd, SHUT_WR);
    }
    ddp__trace_break(g, code); /* after the ABORTs: peers learn first, then this rank writes its recorder */
    return code;
}

/* Fail the current operation: break the group with this message and copy it to the caller's buffer. */
static ddp_result ddp__coll_fail(ddp_group *g, ddp_result code, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ddp__group_break(g, code, msg);
}

/* A peer's connection closed or errored: read what it sent last. An ABORT frame carries the reason
   (another rank's error, re-raised here); otherwise the process is gone. `first` is a frame header
   already read from the peer (or NULL). */
static ddp_result ddp__peer_failed_after(ddp_group *g, int peer, const ddp__coll *c, const ddp__frame *first) {
    ddp__peer *p = &g->mesh.peers[peer];
    char desc[160], err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX], msg[DDP__ERR_MAX];
    double deadline = ddp__now() + 1.0;
    ddp__frame f;
    ddp__coll_describe(g, c, desc, sizeof desc);
    p->gone = 1;
    for (;;) {
        if (first) {
            f = *first;
            first = NULL;
        } else if (ddp__net_recv(p->fd, &f, sizeof f, deadline, err) != DDP_SUCCESS) {
            break;
        }
        if (f.magic != DDP__FRAME_MAGIC) break;
        if (f.kind == DDP__FRAME_ABORT && f.bytes > 0 && f.bytes <= DDP__ERR_MAX) {
            char reason[DDP__ERR_MAX];
            if (ddp__net_recv(p->fd, reason, (size_t)f.bytes, deadline, err) != DDP_SUCCESS) break;
            reason[f.bytes - 1] = '\0';
            if (g->mesh.waiting_for >= 0 && g->mesh.waiting_for != peer) /* the reporter may have waited for us: say whom we waited for */
                snprintf(msg, sizeof msg, "%.600s (reported by rank %d; this rank was in %.150s, waiting for rank %d (%.120s))", reason,
                         peer, desc, g->mesh.waiting_for, ddp__peer_name(g, g->mesh.waiting_for, name, sizeof name));
            else
                snprintf(msg, sizeof msg, "%.600s (reported by rank %d; this rank was in %.150s)", reason, peer, desc);
            return ddp__group_break_relaying(g, ddp__peer_code(f.code, DDP_ERR_FORMAT), msg, reason);
        }
        if (f.kind == DDP__FRAME_BYE)
            return ddp__coll_fail(g, DDP_ERR_PEER_LOST,
                                  "rank %d left the group (called ddp_destroy) while this rank was in %s; every rank "
                                  "must make the same collective calls", peer, desc);
        { /* skip a data frame's payload */
            char sink[4096];
            uint64_t left = f.bytes;
            while (left > 0) {
                size_t k = (size_t)DDP__MIN(left, (uint64_t)sizeof sink);
                if (ddp__net_recv(p->fd, sink, k, deadline, err) != DDP_SUCCESS) break;
                left -= k;
            }
            if (left > 0) break;
        }
    }
    return ddp__coll_fail(g, DDP_ERR_PEER_LOST, "lost rank %d (%s): its process exited or its connection dropped, while this rank was in %s",
                          peer, ddp__peer_name(g, peer, name, sizeof name), desc);
}

static ddp_result ddp__peer_failed(ddp_group *g, int peer, const ddp__coll *c) { return ddp__peer_failed_after(g, peer, c, NULL); }

/* A peer that is alive (its connection is open) made no progress for the group's timeout. Across hosts
   a cut link looks just like this: TCP sees no error until its own, much longer, retransmission limit. */
static ddp_result ddp__peer_timed_out(ddp_group *g, int peer, const ddp__coll *c) {
    char desc[160], name[DDP__PEER_NAME_MAX];
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (g->mesh.peers[peer].fd < 0)
        return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s in %s waiting for rank %d (%s), which never "
                              "connected to this rank: is it stuck, stopped, in a different collective, or is the network "
                              "to it down? (DDP_TIMEOUT sets the limit)", g->timeout, desc, peer,
                              ddp__peer_name(g, peer, name, sizeof name));
    return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s in %s waiting for rank %d (%s), which is alive but "
                          "not taking part: is it stuck, stopped, in a different collective, or is the network to it "
                          "down? (DDP_TIMEOUT sets the limit)", g->timeout, desc, peer, ddp__peer_name(g, peer, name, sizeof name));
}

/* The first peer whose connection hung up (exited, or aborted the group), looking only at peer `only`
   (-1: at every peer), without waiting; -1 when none. Nothing else happens: the caller decides. */
static int ddp__hung_up_peer(ddp_group *g, int only) {
    int i, n = 0;
    for (i = 0; i < g->mesh.nlinked; i++) {
        int peer = g->mesh.linked[i];
        if (g->mesh.peers[peer].fd < 0 || (only >= 0 && peer != only)) continue;
        g->mesh.pollfds[n].fd = g->mesh.peers[peer].fd;
        g->mesh.pollfds[n].events = POLLRDHUP;
        g->mesh.pollfds[n].revents = 0;
        g->mesh.poll_owner[n++] = peer;
    }
    if (poll(g->mesh.pollfds, (nfds_t)n, 0) <= 0) return -1;
    for (i = 0; i < n; i++)
        if (g->mesh.pollfds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) return g->mesh.poll_owner[i];
    return -1;
}

/* A peer that hung up fails the current collective. For transports that wait elsewhere (shared memory). */
static ddp_result ddp__check_peers(ddp_group *g, const ddp__coll *c) {
    int peer = ddp__hung_up_peer(g, -1);
    return peer < 0 ? DDP_SUCCESS : ddp__peer_failed(g, peer, c);
}

/* ---- one step of an algorithm: send to one peer while receiving from another ---- */

static void ddp__frame_init(ddp__frame *f, const ddp_group *g, const ddp__coll *c, int kind, uint64_t bytes) {
    memset(f, 0, sizeof *f);
    f->magic = DDP__FRAME_MAGIC;
    f->kind = (uint8_t)kind;
    f->coll = c->kind;
    f->dtype = c->dtype;
    f->op = c->op;
    f->root = c->root;
    f->src = g->rank;
    f->seq = c->seq;
    f->count = c->count;
    f->bytes = bytes;
}

/* The call a collective's frame describes (for messages naming the sender's call). */
static ddp__coll ddp__frame_coll(const ddp__frame *f) {
    ddp__coll t;
    memset(&t, 0, sizeof t);
    t.seq = f->seq;
    t.count = f->count;
    t.kind = f->coll;
    t.dtype = f->dtype;
    t.op = f->op;
    t.root = f->root;
    t.tag = -1;
    return t;
}

/* The header just received from `peer` is complete: is it the frame this step expects? */
static ddp_result ddp__check_frame(ddp_group *g, const ddp__coll *c, int peer, const ddp__frame *f, size_t expect) {
    char ours[160], theirs[160];
    if (f->magic != DDP__FRAME_MAGIC)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (bad magic 0x%08x): is something else "
                              "connected to this rank's port?", peer, (unsigned)f->magic);
    if (f->kind == DDP__FRAME_ABORT || f->kind == DDP__FRAME_BYE) return ddp__peer_failed_after(g, peer, c, f);
    if (f->kind != DDP__FRAME_DATA) return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (kind %d)", peer, f->kind);
    if (!ddp__coll_equal(c, f)) {
        ddp__coll t = ddp__frame_coll(f);
        ddp__coll_describe(g, c, ours, sizeof ours);
        ddp__coll_describe(g, &t, theirs, sizeof theirs);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                              "rank must call the same collectives in the same order with the same count, dtype, op and root",
                              peer, theirs, g->rank, ours);
    }
    if (f->bytes != expect && (c->kind == DDP__ALL_TO_ALL_V || c->kind == DDP__ALL_GATHER_V)) { /* sizes per rank */
        size_t es = ddp_dtype_size((ddp_dtype)c->dtype);
        ddp__coll_describe(g, c, ours, sizeof ours);
        if (c->kind == DDP__ALL_TO_ALL_V)
            return ddp__coll_fail(g, DDP_ERR_MISMATCH, "split sizes differ in %s: rank %d sends %llu elements to rank %d "
                                  "(its send_counts[%d]) while rank %d expects %llu from rank %d (its recv_counts[%d]); "
                                  "rank i's send_counts[j] must equal rank j's recv_counts[i]", ours, peer,
                                  (unsigned long long)(f->bytes / es), g->rank, g->rank, g->rank,
                                  (unsigned long long)(expect / es), peer, peer);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank %d sent a block of %llu elements where "
                              "rank %d's counts say %llu; every rank must pass the same counts", ours, peer,
                              (unsigned long long)(f->bytes / es), g->rank, (unsigned long long)(expect / es));
    }
    if (f->bytes != expect)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "rank %d sent %llu bytes where %llu were expected in %s",
                              peer, (unsigned long long)f->bytes, (unsigned long long)expect, ddp__coll_name(c->kind));
    return DDP_SUCCESS;
}

/* Is a frame from a peer that this step does not read fine in collective c? Only a frame with c's
   number and another fingerprint shows a mismatch: when ranks disagree about #X, no rank gets past
   #X, so every frame in flight has number X. A frame of c, of another number (a peer already past c:
   numbers never restart, ddp_init's own collectives included) or a BYE (the peer passed ddp_destroy's
   barrier, which is then ours too) is early data. */
static int ddp__frame_is_early(const ddp__coll *c, const ddp__frame *f) {
    if (f->magic != DDP__FRAME_MAGIC) return 0;
    if (f->kind == DDP__FRAME_BYE) return 1;
    if (f->kind != DDP__FRAME_DATA) return 0;
    return f->seq != c->seq || ddp__coll_equal(c, f);
}

/* ---- point-to-point matching: posted receives and the stash ----
   A rank reads whatever reaches it in order, connection by connection. A message (a P2P frame) goes to
   the first posted receive with its source and tag (ddp_irecv's, and ddp_recv's own while it waits),
   else it is read whole into the group's stash, in arrival order; a receive, when it is posted, first
   takes the oldest stashed message with its source and tag. That is MPI's matching (by source and tag,
   in order), and it is done wherever a frame is met: in a collective's step, a peek, a send or a recv.
   So a send never waits for its receive to be posted, except that its bytes must fit the kernel's
   buffers or be read by the receiver's next call into the library. Both lists are guarded by
   mesh.p2p_mu: ddp_irecv posts from the program's thread while the progress thread may read frames. */
typedef struct ddp__p2p_msg {
    struct ddp__p2p_msg *next;
    int src, tag;
    uint8_t dtype;
    uint64_t count;
    size_t bytes;
    unsigned char data[1]; /* bytes of payload (allocated with the message) */
} ddp__p2p_msg;

/* "recv(src=1, tag=3, count=4, f32)" for a posted receive. */
static const char *ddp__posted_describe(const ddp__posted *p, char *out, size_t cap) {
    snprintf(out, cap, "recv(src=%d, tag=%d, count=%llu, %s)", p->src, p->tag, (unsigned long long)p->count,
             ddp_dtype_name((ddp_dtype)p->dtype));
    return out;
}

/* Does message f fit posted receive p? If not: DDP_ERR_MISMATCH naming both (the group breaks). */
static ddp_result ddp__posted_fits(ddp_group *g, const ddp__posted *p, const ddp__frame *f) {
    char ours[160];
    if (f->bytes == p->bytes && f->dtype == p->dtype) return DDP_SUCCESS;
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d sent %llu elements of %s with tag %d where this rank expects "
                          "%llu of %s; a send and its recv must agree on count and dtype",
                          ddp__posted_describe(p, ours, sizeof ours), p->src, (unsigned long long)f->count,
                          ddp_dtype_name((ddp_dtype)f->dtype), (int)f->root, (unsigned long long)p->count,
                          ddp_dtype_name((ddp_dtype)p->dtype));
}

/* Mark p finished with r (under p2p_mu by the caller). */
static void ddp__posted_finish(ddp__posted *p, ddp_result r) {
    p->result = r;
    p->done = 1;
}

/* The P2P frame f (header already taken) from `peer`: to the first posted receive that matches, else into
   the stash. The payload is read under p2p_mu, so a receive posted meanwhile cannot miss it. */
static ddp_result ddp__p2p_deliver(ddp_group *g, const ddp__coll *c, int peer, const ddp__frame *f) {
    char err[DDP__ERR_MAX];
    ddp__posted *p, *prev = NULL;
    ddp__p2p_msg *m;
    ddp_result r = DDP_SUCCESS;
    if (f->bytes > DDP__MAX_BUFFER_BYTES)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (a point-to-point message of %llu bytes)", peer,
                              (unsigned long long)f->bytes);
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (p = g->mesh.posted; p && !(p->src == peer && p->tag == f->root); prev = p, p = p->next)
        ;
    if (p) { /* unlinked whatever happens next: it is this message's receive */
        if (prev) prev->next = p->next;
        else g->mesh.posted = p->next;
        if ((r = ddp__posted_fits(g, p, f)) == DDP_SUCCESS && p->bytes &&
            ddp__net_recv(g->mesh.peers[peer].fd, p->buf, p->bytes, ddp__now() + g->timeout, err) != DDP_SUCCESS)
            r = DDP_ERR_PEER_LOST;
        ddp__posted_finish(p, r);
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        return r == DDP_ERR_PEER_LOST ? ddp__peer_failed(g, peer, c) : r;
    }
    m = (ddp__p2p_msg *)ddp__malloc(offsetof(ddp__p2p_msg, data) + (size_t)f->bytes + 1);
    if (!m) {
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping a message of %llu bytes that rank %d sent "
                              "(tag %d) before this rank's recv for it", (unsigned long long)f->bytes, peer, (int)f->root);
    }
    m->next = NULL;
    m->src = peer;
    m->tag = f->root;
    m->dtype = f->dtype;
    m->count = f->count;
    m->bytes = (size_t)f->bytes;
    if (m->bytes && ddp__net_recv(g->mesh.peers[peer].fd, m->data, m->bytes, ddp__now() + g->timeout, err) != DDP_SUCCESS) {
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        ddp__free(m);
        return ddp__peer_failed(g, peer, c);
    }
    if (g->mesh.stash_tail) g->mesh.stash_tail->next = m;
    else g->mesh.stash = m;
    g->mesh.stash_tail = m;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return DDP_SUCCESS;
}

/* Post receive p: the oldest stashed message from its source with its tag finishes it at once; else it
   waits at the end of the posted list. Returns p's result when it finished here (DDP_SUCCESS when it was
   posted). */
static ddp_result ddp__p2p_post(ddp_group *g, ddp__posted *p) {
    ddp__p2p_msg *m, *prev = NULL;
    ddp__posted **at;
    ddp_result r = DDP_SUCCESS;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (m = g->mesh.stash; m && !(m->src == p->src && m->tag == p->tag); prev = m, m = m->next)
        ;
    if (m) {
        ddp__frame f;
        if (prev) prev->next = m->next;
        else g->mesh.stash = m->next;
        if (g->mesh.stash_tail == m) g->mesh.stash_tail = prev;
        memset(&f, 0, sizeof f);
        f.dtype = m->dtype;
        f.count = m->count;
        f.root = m->tag;
        f.bytes = m->bytes;
        if ((r = ddp__posted_fits(g, p, &f)) == DDP_SUCCESS && p->bytes) memcpy(p->buf, m->data, p->bytes);
        ddp__free(m);
        ddp__posted_finish(p, r);
    } else {
        for (at = &g->mesh.posted; *at; at = &(*at)->next)
            ;
        p->next = NULL;
        *at = p;
    }
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return r;
}

/* Take p off the posted list if it is still there (its wait failed). */
static void ddp__p2p_unpost(ddp_group *g, ddp__posted *p) {
    ddp__posted **at;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (at = &g->mesh.posted; *at && *at != p; at = &(*at)->next)
        ;
    if (*at) *at = p->next;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
}

static int ddp__posted_done(ddp_group *g, const ddp__posted *p) {
    int done;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    done = p->done;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return done;
}

/* The group ends: messages nobody received are named; posted receives are dropped (their handles go with
   the group). */
static void ddp__p2p_stash_free(ddp_group *g) {
    while (g->mesh.stash) {
        ddp__p2p_msg *m = g->mesh.stash;
        g->mesh.stash = m->next;
        ddp__log(g, DDP_LOG_WARN, "rank %d sent this rank a message (tag %d, %zu bytes) that no ddp_recv took before the "
                 "group ended", m->src, m->tag, m->bytes);
        ddp__free(m);
    }
    g->mesh.stash_tail = NULL;
    g->mesh.posted = NULL;
}

/* A peer this step does not read from has something for us: look at its frame header without taking
   it (the connection is at a frame boundary: frames are read whole within a step). Early data marks
   the peer quiet for the rest of c, so poll does not wake for it again; an ABORT, a corrupt frame or a
   different collective fails c as ddp__check_frame does. Only part of a header: look again shortly. */
static ddp_result ddp__peek_peer(ddp_group *g, const ddp__coll *c, int peer) {
    ddp__peer *p = &g->mesh.peers[peer];
    ddp__frame f;
    ssize_t k = recv(p->fd, &f, sizeof f, MSG_PEEK | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return DDP_SUCCESS;
    if (k <= 0) return ddp__peer_failed(g, peer, c);
    if ((size_t)k < sizeof f) {
        p->peek_later = 1;
        return DDP_SUCCESS;
    }
    if (f.magic == DDP__FRAME_MAGIC && f.kind == DDP__FRAME_P2P) { /* a message: to its receive or the stash */
        if (recv(p->fd, &f, sizeof f, MSG_DONTWAIT) != (ssize_t)sizeof f) return ddp__peer_failed(g, peer, c);
        return ddp__p2p_deliver(g, c, peer, &f);
    }
    if (ddp__frame_is_early(c, &f)) {
        p->quiet_seq = c->seq;
        return DDP_SUCCESS;
    }
    if (f.magic == DDP__FRAME_MAGIC && f.kind == DDP__FRAME_ABORT) { /* take the header: the reason follows it */
        if (recv(p->fd, &f, sizeof f, MSG_DONTWAIT) != (ssize_t)sizeof f) return ddp__peer_failed(g, peer, c);
        return ddp__peer_failed_after(g, peer, c, &f);
    }
    return ddp__check_frame(g, c, peer, &f, (size_t)f.bytes);
}

/* What to wait for on peer i in this step: hang-ups always; POLLOUT while sending to it; POLLIN while
   receiving from it, and also from any other peer not yet seen quiet in this collective (a frame there
   may show a mismatch: see the top of the file). *soon: look again within a millisecond. */
static short ddp__poll_events(ddp_group *g, const ddp__coll *c, const ddp__step *s, int i, int sending, int receiving, int *soon) {
    ddp__peer *p = &g->mesh.peers[i];
    short ev = POLLRDHUP;
    if (i == s->send_peer && sending) ev |= POLLOUT;
    if (i == s->recv_peer && receiving) return ev | POLLIN;
    if (p->peek_later) {
        p->peek_later = 0;
        *soon = 1;
    } else if (p->quiet_seq != c->seq) {
        ev |= POLLIN;
    }
    return ev;
}

/* Before a small step (at most DDP__TCP_SPIN_MAX_BYTES each way) blocks in poll(), it polls without
   blocking for DDP__TCP_SPIN_SECONDS after its last progress, yielding the core between looks: on
   loopback (and fast networks) the answer often comes within a few microseconds, and waking a rank
   blocked in poll() costs more than that (Open MPI's TCP transport spins the same way). Large steps
   block at once: there a wake-up is small beside the transfer, and spinning would only burn a core. When
   this host has more ranks than CPUs (ddp__oversubscribed, as shm.c decides) a small step looks once,
   yields once (the core goes to a rank that can run, often the one being waited for) and then blocks:
   no spin. Measured on 2 cores, 8 ranks, 4-64 B all_reduce: as fast as the 50 us
   spin, while blocking without the one yield was 25-30 % slower. */
#define DDP__TCP_SPIN_SECONDS 50e-6
#define DDP__TCP_SPIN_MAX_BYTES ((size_t)64 << 10)

static ddp_result ddp__exchange(ddp_group *g, const ddp__coll *c, const ddp__step *s) {
    ddp__frame out, in;
    size_t sent = 0, received = 0;          /* bytes of header + payload so far */
    size_t send_total = s->send_peer >= 0 ? sizeof out + s->send_bytes : 0;
    size_t recv_total = s->recv_peer >= 0 ? sizeof in + s->recv_bytes : 0;
    struct pollfd *fds = g->mesh.pollfds;
    int *owner = g->mesh.poll_owner;
    int spin = s->send_bytes <= DDP__TCP_SPIN_MAX_BYTES && s->recv_bytes <= DDP__TCP_SPIN_MAX_BYTES;
    double spin_for = ddp__oversubscribed(g->local_world_size) ? 0 : DDP__TCP_SPIN_SECONDS;
    double deadline = s->deadline > 0 ? s->deadline : ddp__now() + g->timeout, spin_until = spin ? ddp__now() + spin_for : 0;
    double watch_every = DDP__WATCH_PERIOD, next_watch = ddp__now() + watch_every;
    if (g->broken) return g->broken;
    if (s->send_peer >= 0) ddp__frame_init(&out, g, c, s->p2p ? DDP__FRAME_P2P : DDP__FRAME_DATA, s->send_bytes);
    if (s->p2p) out.root = c->tag, out.seq = 0; /* the receiver matches by source and tag */
    while (sent < send_total || received < recv_total) {
        int n = 0, npeers, i, rc, progressed = 0, soon = 0;
        double wake = deadline;
        ddp_result r;
        g->mesh.waiting_for = received < recv_total ? s->recv_peer : s->send_peer;
        if (sent < send_total && g->mesh.peers[s->send_peer].fd < 0) { /* the sender dials (link.c) */
            if ((r = ddp__link_want(g, s->send_peer)) != DDP_SUCCESS ||
                (r = ddp__link_check_refused(g, c, s->send_peer)) != DDP_SUCCESS)
                return r;
            wake = DDP__MIN(wake, g->mesh.peers[s->send_peer].dial_after);
        }
        if (g->mesh.in_setup && g->mesh.peers[g->mesh.waiting_for].fd < 0) { /* a rank lost inside ddp_init */
            if (ddp__now() >= next_watch) {
                if ((r = ddp__setup_watch(g, g->mesh.waiting_for)) != DDP_SUCCESS) {
                    char msg[DDP__ERR_MAX];
                    snprintf(msg, sizeof msg, "%s", g->error);
                    return ddp__group_break(g, r, msg);
                }
                next_watch = ddp__now() + watch_every;
                watch_every = DDP__MIN(watch_every * 2, 2.0);
            }
            wake = DDP__MIN(wake, next_watch);
        }
        for (i = 0; i < g->mesh.nlinked; i++) {
            int peer = g->mesh.linked[i];
            if (g->mesh.peers[peer].fd < 0) continue;
            fds[n].fd = g->mesh.peers[peer].fd;
            fds[n].events = ddp__poll_events(g, c, s, peer, sent < send_total, received < recv_total, &soon);
            fds[n].revents = 0;
            owner[n++] = peer;
        }
        npeers = n;
        n += ddp__link_poll_entries(g, fds + n, owner + n, &wake);
        rc = 0;
        if (spin) {
            int yielded = 0;
            while ((rc = poll(fds, (nfds_t)n, 0)) == 0 && (ddp__now() < spin_until || !yielded++)) sched_yield();
        }
        if (rc == 0)
            rc = poll(fds, (nfds_t)n, soon ? 1 : (int)DDP__MAX(1.0, DDP__MIN(1000.0, (wake - ddp__now()) * 1000.0)));
        if (rc < 0 && errno != EINTR) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "poll failed: %s", strerror(errno));
        if (rc > 0 && n > npeers && (r = ddp__link_progress(g, fds + npeers, owner + npeers, n - npeers, &progressed)))
            return r;
        /* Progress first: a peer that broke the group after sending what this step needs (it moved
           on to a later collective and failed there) must not fail this step; that error comes with
           the next collective. */
        for (i = 0; i < npeers && rc > 0; i++) {
            int peer = owner[i], fd = fds[i].fd;
            short re = fds[i].revents;
            if (!re) continue;
            if (peer == s->recv_peer && received < recv_total && (re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) {
                ssize_t k;
                if (received < sizeof in) {
                    k = recv(fd, (char *)&in + received, sizeof in - received, 0);
                } else {
                    k = recv(fd, (char *)s->recv_buf + (received - sizeof in), recv_total - received, 0);
                }
                if (k == 0) return ddp__peer_failed(g, peer, c);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ddp__peer_failed(g, peer, c);
                if (k > 0) {
                    received += (size_t)k;
                    progressed = 1;
                    if (received == sizeof in) {
                        ddp_result r;
                        if (in.magic == DDP__FRAME_MAGIC && in.kind == DDP__FRAME_P2P) {
                            if ((r = ddp__p2p_deliver(g, c, peer, &in)) != DDP_SUCCESS) return r;
                            received = 0; /* a message, matched or stashed; the frame we wait for follows */
                        } else if ((r = ddp__check_frame(g, c, peer, &in, s->recv_bytes)) != DDP_SUCCESS) {
                            return r;
                        }
                    }
                }
                fds[i].revents = 0;
                continue;
            }
            /* A send-only peer that hung up: read its ABORT before sending (data sent to a closed
               socket draws a reset that would destroy the frame). */
            if (peer == s->send_peer && sent < send_total && (re & POLLOUT) && !(re & (POLLHUP | POLLERR | POLLRDHUP))) {
                struct iovec iov[2];
                struct msghdr mh;
                ssize_t k;
                int nv = 0;
                memset(&mh, 0, sizeof mh);
                if (sent < sizeof out) {
                    iov[nv].iov_base = (char *)&out + sent;
                    iov[nv++].iov_len = sizeof out - sent;
                    if (s->send_bytes) {
                        iov[nv].iov_base = (void *)s->send_buf;
                        iov[nv++].iov_len = s->send_bytes;
                    }
                } else {
                    iov[nv].iov_base = (char *)s->send_buf + (sent - sizeof out);
                    iov[nv++].iov_len = send_total - sent;
                }
                mh.msg_iov = iov;
                mh.msg_iovlen = (size_t)nv;
                k = sendmsg(fd, &mh, MSG_NOSIGNAL);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ddp__peer_failed(g, peer, c);
                if (k > 0) {
                    sent += (size_t)k;
                    progressed = 1;
                    g->mesh.peers[peer].send_owed = send_total - sent; /* header and payload still owed */
                }
                fds[i].revents = 0;
            }
        }
        if (sent == send_total && received == recv_total) break;
        for (i = 0; i < npeers && rc > 0; i++) /* then failures */
            if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) return ddp__peer_failed(g, owner[i], c);
        for (i = 0; i < npeers && rc > 0; i++) { /* then frames from peers this step does not read */
            ddp_result r;
            if ((fds[i].revents & POLLIN) && (r = ddp__peek_peer(g, c, owner[i])) != DDP_SUCCESS) return r;
        }
        if (progressed && (s->deadline <= 0 || sent > 0 || received > 0)) { /* a handshake's progress does not
                                                                               move a step's own deadline */
            deadline = ddp__now() + g->timeout;
            if (spin) spin_until = ddp__now() + spin_for;
        } else if (ddp__now() > deadline) {
            if (s->soft && sent == 0 && received == 0) return DDP_ERR_TIMEOUT;
            return ddp__peer_timed_out(g, g->mesh.waiting_for, c);
        }
    }
    return DDP_SUCCESS;
}

/* ---- point-to-point: ddp_send, ddp_recv and ddp_irecv's wait over the mesh, whatever the backend ----
   A send is one frame to the peer (the sender dials, as in a collective's step), written while this
   rank keeps reading what reaches it, so two ranks sending each other large messages at once both get
   through (each matches or stashes the other's). A receive is posted (the stash first) and then waits,
   reading whatever arrives, until a message finishes it. The source's stream showing a collective's
   frame where the message should be means the source went on without sending: DDP_ERR_MISMATCH (else
   both would wait for each other until the timeout). */
/* A recv over shared memory: has its source gone on to a collective without sending? Its collectives
   over the segment send this rank nothing, so the segment's fingerprints say it: the source entered a
   collective this rank has not, and no byte from it waits in the connection (it wrote any message
   before it entered; the sender dials, so no connection means no message). Seen twice 10 ms apart, to
   leave bytes in flight on the loopback time to land; *since holds the first sighting (0: none). */
static int ddp__p2p_peer_went_on(ddp_group *g, int src, double *since) {
    int fd = g->mesh.peers[src].fd, pending = 0;
    if (ddp__shm_peer_seq(g, src) <= g->seq || (fd >= 0 && (ioctl(fd, FIONREAD, &pending) != 0 || pending > 0))) {
        *since = 0;
        return 0;
    }
    if (*since == 0) *since = ddp__now();
    return ddp__now() - *since >= 0.01;
}

/* "rank 1 called barrier() as collective #2 before sending what this rank's recv(...) waits for". */
static ddp_result ddp__p2p_went_on(ddp_group *g, const ddp__posted *p, const char *theirs) {
    char ours[160];
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "rank %d called %s before sending what this rank's %s waits for; a send and "
                          "its recv must come in the same order relative to the collectives on both ranks", p->src, theirs,
                          ddp__posted_describe(p, ours, sizeof ours));
}

/* The head of `peer`'s stream while waiting for p: a message is delivered (ddp__peek_peer); from p's
   source, a collective's frame is the mismatch above. */
static ddp_result ddp__p2p_look(ddp_group *g, const ddp__coll *c, const ddp__posted *p, int peer) {
    ddp__frame f;
    if (peer == p->src && recv(g->mesh.peers[peer].fd, &f, sizeof f, MSG_PEEK | MSG_DONTWAIT) == (ssize_t)sizeof f &&
        f.magic == DDP__FRAME_MAGIC && (f.kind == DDP__FRAME_DATA || f.kind == DDP__FRAME_BYE)) {
        if (f.kind == DDP__FRAME_BYE) return ddp__peer_failed_after(g, peer, c, &f); /* "left the group" */
        char theirs[160];
        ddp__coll t = ddp__frame_coll(&f);
        ddp__coll_describe(g, &t, theirs, sizeof theirs);
        return ddp__p2p_went_on(g, p, theirs);
    }
    return ddp__peek_peer(g, c, peer);
}

/* Read what reaches this rank until posted receive p is finished (once: look one time, without waiting). */
static ddp_result ddp__p2p_wait(ddp_group *g, const ddp__coll *c, ddp__posted *p, int once) {
    struct pollfd *fds = g->mesh.pollfds;
    int *owner = g->mesh.poll_owner;
    double deadline = ddp__now() + g->timeout, ahead_since = 0;
    for (;;) {
        int n = 0, npeers, i, rc, progressed = 0, soon = 0;
        double wake = deadline;
        ddp_result r;
        if (ddp__posted_done(g, p)) return p->result;
        if (g->broken) return g->broken;
        g->mesh.waiting_for = p->src;
        for (i = 0; i < g->mesh.nlinked; i++) {
            int peer = g->mesh.linked[i];
            ddp__peer *q = &g->mesh.peers[peer];
            if (q->fd < 0) continue;
            fds[n].fd = q->fd;
            fds[n].events = POLLRDHUP;
            if (q->peek_later) q->peek_later = 0, soon = 1;
            else if (q->quiet_seq != c->seq || peer == p->src) fds[n].events |= POLLIN;
            fds[n].revents = 0;
            owner[n++] = peer;
        }
        npeers = n;
        n += ddp__link_poll_entries(g, fds + n, owner + n, &wake);
        rc = poll(fds, (nfds_t)n, once ? 0 : soon ? 1 : (int)DDP__MAX(1.0, DDP__MIN(g->shm ? 10.0 : 1000.0,
                                                                                    (wake - ddp__now()) * 1000.0)));
        if (rc < 0 && errno != EINTR) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "poll failed: %s", strerror(errno));
        if (rc > 0 && n > npeers && (r = ddp__link_progress(g, fds + npeers, owner + npeers, n - npeers, &progressed)))
            return r;
        for (i = 0; i < npeers && rc > 0; i++) {
            if (fds[i].revents & POLLIN) {
                if ((r = ddp__p2p_look(g, c, p, owner[i])) != DDP_SUCCESS) return r;
                progressed = 1;
            } else if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
                return ddp__peer_failed(g, owner[i], c);
            }
        }
        if (ddp__posted_done(g, p)) return p->result;
        if (ddp__p2p_peer_went_on(g, p->src, &ahead_since)) { /* over shared memory: see above */
            char theirs[64];
            snprintf(theirs, sizeof theirs, "collective #%llu", (unsigned long long)(ddp__shm_peer_seq(g, p->src) - g->seq_base));
            return ddp__p2p_went_on(g, p, theirs);
        }
        if (once) return DDP_SUCCESS;
        if (progressed) deadline = ddp__now() + g->timeout;
        else if (ddp__now() > deadline) return ddp__peer_timed_out(g, p->src, c);
    }
}

static ddp_result ddp__p2p_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    ddp__posted p;
    ddp_result r;
    if (k->kind == DDP__SEND) {
        ddp__step st;
        memset(&st, 0, sizeof st);
        st.recv_peer = -1;
        st.p2p = 1;
        st.send_peer = k->root;
        st.send_buf = k->send;
        st.send_bytes = bytes;
        return ddp__exchange(g, c, &st);
    }
    memset(&p, 0, sizeof p);
    p.src = k->root;
    p.tag = k->tag;
    p.buf = k->buf;
    p.bytes = bytes;
    p.count = k->count;
    p.dtype = (uint8_t)k->dtype;
    if ((r = ddp__p2p_post(g, &p)) != DDP_SUCCESS) return r;
    r = ddp__p2p_wait(g, c, &p, 0);
    ddp__p2p_unpost(g, &p); /* when it failed before a message came */
    return r;
}

/* ---- closing connections ---- */

/* Close every connection of a group that failed: half-close, then read until each peer closes too
   (at most `seconds` in all), so that the close never carries a reset that destroys the ABORT frame
   a slower peer has yet to read. */
static void ddp__close_after_failure(ddp_group *g, double seconds) {
    double deadline = ddp__now() + seconds;
    char sink[4096];
    int i;
    for (i = 0; i < g->mesh.nlinked; i++)
        if (g->mesh.peers[g->mesh.linked[i]].fd >= 0) shutdown(g->mesh.peers[g->mesh.linked[i]].fd, SHUT_WR);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd < 0) continue;
        while (ddp__now() < deadline) {
            ssize_t k = recv(p->fd, sink, sizeof sink, 0);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
            if (k < 0) {
                struct pollfd pf;
                pf.fd = p->fd;
                pf.events = POLLIN;
                poll(&pf, 1, (int)DDP__MAX(1.0, (deadline - ddp__now()) * 1000.0));
            }
        }
    }
    ddp__link_close_all(g);
}

/* ---- graceful goodbye (ddp_destroy, after a final barrier) ---- */

/* Send BYE to every connected peer, then read each one's BYE, so that no peer sees our close while it
   still waits on anything: it has already passed the same barrier. */
static void ddp__say_goodbye(ddp_group *g, double seconds) {
    ddp__coll none;
    ddp__frame f;
    char err[DDP__ERR_MAX];
    int i;
    double deadline = ddp__now() + seconds;
    memset(&none, 0, sizeof none);
    ddp__frame_init(&f, g, &none, DDP__FRAME_BYE, 0);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd >= 0 && !p->gone) ddp__net_send(p->fd, &f, sizeof f, deadline, err);
    }
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        ddp__frame in;
        ddp_result r;
        if (p->fd < 0 || p->gone) continue;
        while ((r = ddp__net_recv(p->fd, &in, sizeof in, deadline, err)) == DDP_SUCCESS && in.magic == DDP__FRAME_MAGIC &&
               in.kind == DDP__FRAME_P2P && in.bytes <= DDP__MAX_BUFFER_BYTES) { /* a message nobody received */
            ddp__log(g, DDP_LOG_WARN, "rank %d sent this rank a message (tag %d, %llu bytes) that no ddp_recv took before "
                     "ddp_destroy", g->mesh.linked[i], (int)in.root, (unsigned long long)in.bytes);
            while (in.bytes > 0) {
                char sink[4096];
                size_t n = (size_t)DDP__MIN(in.bytes, (uint64_t)sizeof sink);
                if ((r = ddp__net_recv(p->fd, sink, n, deadline, err)) != DDP_SUCCESS) break;
                in.bytes -= n;
            }
            if (r) break;
        }
        if (r != DDP_SUCCESS || in.kind != DDP__FRAME_BYE)
            ddp__log(g, DDP_LOG_DEBUG, "rank %d did not say goodbye cleanly: %s", g->mesh.linked[i], err);
    }
}
/* ==================== end src/transport.c ==================== */

/* ==================== begin src/collectives.c ==================== */
/* [SECTION] collectives: ddp_all_reduce ... ddp_gather, ddp_scatter, ddp_all_to_all(_v), ddp_all_gather_v, ddp_broadcast_bytes, ddp_monitored_barrier
   The public collectives, their fingerprints, dispatch to the backend, async work (torch.distributed's
   all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier, gather, scatter, all_to_all_single
   with and without split sizes, all_gather of uneven tensors, broadcast_object_list, monitored_barrier).

   A call goes through four steps, the same for every collective and every backend:
     1. validate the arguments on the caller's thread (a bad call never reaches the wire);
     2. take the group's next sequence number: the fingerprint (seq, collective, count, dtype, op,
        root) that every message of the call carries (transport.c, shm.c) and that ranks compare;
     3. synchronous: wait for queued async work, then run it on the calling thread through
        g->backend->run; asynchronous: queue it for the group's progress thread (or give it to the
        backend's enqueue, which nccl uses to queue device work on its stream at once);
     4. on failure the group is broken (every rank fails; later calls return DDP_ERR_STATE) and the
        message lands in ddp_last_error(g) and in this thread's ddp_last_error(NULL).
   The algorithms live in the backends (tcp.c, shm.c, hier.c, mpi.c, nccl.c); tcp.c explains why a
   mismatch is an error on every rank. */

/* Chunk i of `count` elements cut into n nearly equal parts (the first count % n get one more). */
static void ddp__chunk(size_t count, int n, int i, size_t *off, size_t *len) {
    size_t base = count / (size_t)n, rem = count % (size_t)n, ui = (size_t)i;
    *off = ui * base + DDP__MIN(ui, rem);
    *len = base + (ui < rem ? 1 : 0);
}

/* Staging memory owned by the group (one collective runs at a time on a group). */
static void *ddp__scratch(ddp_group *g, size_t bytes) {
    if (bytes > g->scratch_size) {
        void *p = ddp__malloc(bytes);
        if (!p) return NULL;
        ddp__free(g->scratch);
        g->scratch = p;
        g->scratch_size = bytes;
    }
    return g->scratch;
}

static ddp_result ddp__no_memory(ddp_group *g, size_t bytes) {
    return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory: could not allocate %zu bytes of staging memory", bytes);
}

static ddp__call ddp__make_call(ddp__coll_kind kind, const void *send, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                int root) {
    ddp__call k;
    memset(&k, 0, sizeof k);
    k.kind = kind;
    k.send = send;
    k.buf = buf;
    k.count = count;
    k.dtype = t;
    k.op = op;
    k.root = root;
    return k;
}

/* ---- running a call ---- */

/* broadcast_bytes (torch's broadcast_object_list): two broadcasts under the call's one fingerprint, the
   size and then the data, into a buffer that the receivers allocate in between. Every backend runs a
   broadcast with any fingerprint, and both runs carry the same one (shm's first step republishes it). */
static ddp_result ddp__broadcast_bytes_run(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c) {
    uint64_t size = g->rank == k->root ? (uint64_t)*k->bytes_size : 0; /* sent as its 8 bytes: ranks share a byte order */
    ddp__call part = ddp__make_call(DDP__BROADCAST, NULL, &size, 8, DDP_U8, DDP_SUM, k->root);
    char *data = g->rank == k->root ? (char *)*k->bytes : NULL;
    ddp_result r = b->run(g, &part, c);
    if (r) return r;
    if (size > DDP__MAX_BUFFER_BYTES) /* the root checked its own size: this is no size the root sent */
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "broadcast_bytes: rank %d received a size of %llu bytes from the root",
                              g->rank, (unsigned long long)size);
    if (g->rank != k->root && !(data = (char *)ddp__malloc(size ? (size_t)size : 1)))
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "broadcast_bytes: rank %d is out of memory for the root's %llu bytes",
                              g->rank, (unsigned long long)size);
    part = ddp__make_call(DDP__BROADCAST, NULL, data, (size_t)size, DDP_U8, DDP_SUM, k->root);
    if ((r = b->run(g, &part, c)) != DDP_SUCCESS) {
        if (g->rank != k->root) ddp__free(data);
        return r;
    }
    if (g->rank != k->root) {
        *k->bytes = data;
        *k->bytes_size = (size_t)size;
    }
    return DDP_SUCCESS;
}

/* send and recv: no collective number, so the flight recorder (which files calls by it) leaves them out. */
static int ddp__is_p2p(int kind) { return kind == DDP__SEND || kind == DDP__RECV; }

/* Run k on backend b (point-to-point over the mesh, or MPI's own on the mpi backend). */
static ddp_result ddp__run(ddp_group *g, const ddp__backend *b, const ddp__call *k, const ddp__coll *c) {
    int p2p = ddp__is_p2p(k->kind);
    ddp_result r;
    if (g->broken) {
        if (!p2p) ddp__trace_ended(g, c, DDP_ERR_STATE);
        return DDP_ERR_STATE;
    }
    g->mesh.waiting_for = -1;
    if (p2p) return g->mpi ? b->run(g, k, c) : ddp__p2p_run(g, k, c);
    ddp__trace_started(g, c);
    r = k->kind == DDP__BROADCAST_BYTES ? ddp__broadcast_bytes_run(g, b, k, c) : b->run(g, k, c);
    ddp__trace_ended(g, c, r);
    return r;
}

/* The sum of a split-size list (world entries), or UINT64_MAX when it passes 2^63 (too large anyway). */
static uint64_t ddp__counts_sum(const size_t *counts, int n) {
    uint64_t sum = 0;
    int i;
    for (i = 0; i < n; i++) {
        if ((uint64_t)counts[i] > ((uint64_t)1 << 63) - sum) return UINT64_MAX;
        sum += (uint64_t)counts[i];
    }
    return sum;
}

/* The elements of a call's largest buffer, for the size limit: count x world size for the calls whose
   count is per rank, the sums of the split sizes for the _v calls (the larger side), else count. */
static uint64_t ddp__call_elements(const ddp_group *g, const ddp__call *k) {
    switch (k->kind) {
    case DDP__ALL_GATHER:
    case DDP__REDUCE_SCATTER:
    case DDP__GATHER:
    case DDP__SCATTER:
    case DDP__ALL_TO_ALL: return (uint64_t)k->count * (uint64_t)g->world_size; /* count <= 2^47 here (checked first) */
    case DDP__ALL_TO_ALL_V: {
        uint64_t a = ddp__counts_sum(k->send_counts, g->world_size), b = ddp__counts_sum(k->recv_counts, g->world_size);
        return DDP__MAX(a, b);
    }
    case DDP__ALL_GATHER_V: return ddp__counts_sum(k->recv_counts, g->world_size);
    default: return k->count;
    }
}

static int ddp__takes_root(int kind) {
    return kind == DDP__BROADCAST || kind == DDP__REDUCE || kind == DDP__GATHER || kind == DDP__SCATTER ||
           kind == DDP__BROADCAST_BYTES;
}

/* Check a call's arguments on the caller's thread; a bad call never reaches the wire. Each buffer is
   checked only where the call reads or writes it: gather's recv and scatter's send on the root alone. */
static ddp_result ddp__validate(ddp_group *g, const ddp__call *k) {
    const char *name = ddp__coll_name(k->kind);
    size_t es;
    uint64_t elements, limit;
    int root, v = k->kind == DDP__ALL_TO_ALL_V || k->kind == DDP__ALL_GATHER_V;
    ddp_result r = ddp__group_check(g, name);
    if (r) return r;
    root = g->rank == k->root;
    if (k->kind == DDP__BARRIER) return DDP_SUCCESS;
    if (k->kind == DDP__MONITORED_BARRIER) {
        if (!(k->seconds == k->seconds) || k->seconds > 1e9) /* NaN, or beyond any job */
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: timeout_seconds %g is not a number of seconds (<= 0: the "
                             "group's timeout)", name, k->seconds);
        return DDP_SUCCESS;
    }
    if (!ddp__dtype_valid(k->dtype))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)k->dtype);
    if ((k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER) && !ddp__op_valid(k->op))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a ddp_op (DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX)",
                         name, (int)k->op);
    if (ddp__takes_root(k->kind) && (k->root < 0 || k->root >= g->world_size))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of this group (world size %d)", name, k->root,
                         g->world_size);
    if (k->kind == DDP__BROADCAST_BYTES) {
        if (!k->bytes || !k->bytes_size)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the %s argument is NULL (every rank passes both: the root "
                             "its data and size, the others where to put them)", name, !k->bytes ? "data" : "size");
        if (root && *k->bytes_size > DDP__MAX_BUFFER_BYTES)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: size %zu is above the limit of 2^47 bytes (128 TiB)", name,
                             *k->bytes_size);
        if (root && *k->bytes_size && !*k->bytes)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the root's data is NULL with size %zu", name, *k->bytes_size);
        return DDP_SUCCESS;
    }
    if (k->kind == DDP__ALL_TO_ALL_V && (!k->send_counts || !k->recv_counts))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL; pass world-size entries (0 for no elements)", name,
                         !k->send_counts ? "send_counts" : "recv_counts");
    if (k->kind == DDP__ALL_TO_ALL_V && k->send_counts[g->rank] != k->recv_counts[g->rank])
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: send_counts[%d] is %zu but recv_counts[%d] is %zu on rank %d: "
                         "the block a rank sends itself is the block it receives from itself", name, g->rank,
                         k->send_counts[g->rank], g->rank, k->recv_counts[g->rank], g->rank);
    if (k->kind == DDP__ALL_GATHER_V && !k->recv_counts)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: counts is NULL; pass world-size entries, one per rank", name);
    if (k->kind == DDP__ALL_GATHER_V && k->recv_counts[g->rank] != k->count)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count is %zu but counts[%d] (this rank's entry) is %zu; they "
                         "must be equal", name, k->count, g->rank, k->recv_counts[g->rank]);
    es = ddp_dtype_size(k->dtype);
    limit = DDP__MAX_BUFFER_BYTES / es;
    elements = k->count > limit ? UINT64_MAX : ddp__call_elements(g, k);
    if (elements > limit) {
        if (v)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the counts add up to more than %llu elements of %s, the limit "
                             "for one buffer (2^47 bytes, 128 TiB); are they computed right?", name,
                             (unsigned long long)limit, ddp_dtype_name(k->dtype));
        int per_rank = k->kind != DDP__ALL_REDUCE && k->kind != DDP__BROADCAST && k->kind != DDP__REDUCE;
        limit /= per_rank ? (uint64_t)g->world_size : 1;
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is above the limit of %llu elements of %s%s: the call's "
                         "largest buffer (count x %zu bytes%s) must stay under 2^47 bytes (128 TiB), more than any "
                         "process can map; is the count computed right?", name, k->count, (unsigned long long)limit,
                         ddp_dtype_name(k->dtype), per_rank ? " per rank" : "", es, per_rank ? " x the world size" : "");
    }
    { /* the buffers this rank touches, and how many elements each holds (in-place calls: buf alone) */
        uint64_t send_n = 0, recv_n = k->count;
        switch (k->kind) {
        case DDP__ALL_GATHER:
        case DDP__REDUCE_SCATTER:
        case DDP__ALL_TO_ALL: send_n = k->count; break;
        case DDP__GATHER: send_n = k->count, recv_n = root ? k->count : 0; break;
        case DDP__SCATTER: send_n = root ? k->count : 0; break;
        case DDP__ALL_TO_ALL_V:
            send_n = ddp__counts_sum(k->send_counts, g->world_size);
            recv_n = ddp__counts_sum(k->recv_counts, g->world_size);
            break;
        case DDP__ALL_GATHER_V: send_n = k->count, recv_n = elements; break;
        default: break;
        }
        if (recv_n && !k->buf)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the %sbuffer is NULL with %llu elements to %s", name,
                             k->kind == DDP__ALL_REDUCE || k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE ? "" : "recv ",
                             (unsigned long long)recv_n, k->kind == DDP__REDUCE || k->kind == DDP__ALL_REDUCE ? "reduce" : "receive");
        if (send_n && !k->send)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send buffer is NULL with %llu elements to send", name,
                             (unsigned long long)send_n);
        if (k->kind == DDP__ALL_TO_ALL_V && send_n && recv_n) { /* blocks move in an order of their own: no in place */
            uintptr_t s0 = (uintptr_t)k->send, r0 = (uintptr_t)k->buf;
            if (s0 < r0 + recv_n * es && r0 < s0 + send_n * es)
                return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send and recv buffers overlap; all_to_all_v does "
                                 "not run in place (ddp_all_to_all does): pass separate buffers", name);
        }
    }
    return DDP_SUCCESS;
}

/* The fingerprint: what every rank must agree on. The _v calls' split sizes differ from rank to rank by
   design; all_gather_v's total is in it, and each frame's size is checked against what its receiver
   expects (transport.c). */
static void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c) {
    int takes_op = k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER;
    int no_data = k->kind == DDP__BARRIER || k->kind == DDP__MONITORED_BARRIER || k->kind == DDP__BROADCAST_BYTES;
    c->seq = ++g->seq;
    c->kind = (uint8_t)k->kind;
    c->count = no_data || k->kind == DDP__ALL_TO_ALL_V ? 0
               : k->kind == DDP__ALL_GATHER_V         ? ddp__counts_sum(k->recv_counts, g->world_size)
                                                       : k->count;
    c->dtype = (uint8_t)(no_data ? 0 : k->dtype);
    c->op = (uint8_t)(takes_op ? k->op : DDP__NO_OP);
    c->root = ddp__takes_root(k->kind) ? k->root : -1;
    c->tag = -1;
    ddp__trace_queued(g, c);
}

/* The message for a call on a group that an earlier error broke; written to out (DDP__ERR_MAX). */
static const char *ddp__broken_message(const ddp_group *g, const ddp__call *k, char *out) {
    snprintf(out, DDP__ERR_MAX, "%s: the group is broken by an earlier error and cannot be used; destroy it. The "
             "error was: %.800s", ddp__coll_name(k->kind), g->broken_msg);
    return out;
}

/* ---- the progress thread: runs queued work in issue order ---- */

static void *ddp__progress_main(void *arg) {
    ddp_group *g = (ddp_group *)arg;
    pthread_mutex_lock(&g->async.mu);
    for (;;) {
        ddp_work *w;
        ddp_result r;
        while (!g->async.head && !g->async.stop) pthread_cond_wait(&g->async.cv, &g->async.mu);
        if (!g->async.head) break;
        w = g->async.head;
        pthread_mutex_unlock(&g->async.mu);
        if (g->broken) {
            r = DDP_ERR_STATE;
            if (!ddp__is_p2p(w->call.kind)) ddp__trace_ended(g, &w->coll, r);
            ddp__broken_message(g, &w->call, w->error);
        } else if ((r = ddp__run(g, g->backend, &w->call, &w->coll)) != DDP_SUCCESS) {
            snprintf(w->error, sizeof w->error, "%s", g->broken_msg);
        }
        pthread_mutex_lock(&g->async.mu);
        w->result = r;
        w->done = 1;
        g->async.head = w->next; /* dequeued only when done: "queue empty" means "nothing in flight" */
        if (!g->async.head) g->async.tail = NULL;
        pthread_cond_broadcast(&g->async.cv);
    }
    pthread_mutex_unlock(&g->async.mu);
    return NULL;
}

/* Wait until every queued async collective has finished (so a synchronous one runs after them). */
static void ddp__drain(ddp_group *g) {
    pthread_mutex_lock(&g->async.mu);
    while (g->async.head) pthread_cond_wait(&g->async.cv, &g->async.mu);
    pthread_mutex_unlock(&g->async.mu);
}

/* Stop the progress thread (group teardown); queued work is finished first. */
static void ddp__progress_stop(ddp_group *g) {
    if (!g->async.running) return;
    pthread_mutex_lock(&g->async.mu);
    g->async.stop = 1;
    pthread_cond_broadcast(&g->async.cv);
    pthread_mutex_unlock(&g->async.mu);
    pthread_join(g->async.thread, NULL);
    g->async.running = 0;
}

static ddp_result ddp__collective_on(ddp_group *g, const ddp__backend *b, const ddp__call *k) {
    char c_msg[DDP__ERR_MAX];
    ddp__coll c;
    ddp_result r = ddp__validate(g, k);
    if (r) return r;
    ddp__drain(g);
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, k, c_msg));
    ddp__fingerprint(g, k, &c);
    r = ddp__run(g, b, k, &c);
    if (r) return ddp__fail(g, r, "%s", g->broken_msg);
    return DDP_SUCCESS;
}

static ddp_result ddp__collective(ddp_group *g, const ddp__call *k) {
    ddp_result r = ddp__group_check(g, ddp__coll_name(k->kind)); /* before g->backend is read */
    if (r) return r;
    return ddp__collective_on(g, g->backend, k);
}

/* ---- work handles ----
   Every handle an async call returns is live (registry.c) and on its group's `issued` list until
   ddp_wait takes it, which happens once: a second ddp_wait (or ddp_test) on it finds it gone and fails
   without touching it. A group that ends frees the handles nobody waited on (ddp__work_release_all). */

/* Record w as issued on g and live; 0 when out of memory (w is then not returned). */
static int ddp__work_issue(ddp_group *g, ddp_work *w) {
    if (!ddp__live_add(w, DDP__LIVE_WORK)) return 0;
    pthread_mutex_lock(&g->async.mu);
    w->issued_prev = NULL;
    w->issued_next = g->async.issued;
    if (g->async.issued) g->async.issued->issued_prev = w;
    g->async.issued = w;
    pthread_mutex_unlock(&g->async.mu);
    return 1;
}

static void ddp__work_unlink(ddp_group *g, ddp_work *w) {
    pthread_mutex_lock(&g->async.mu);
    if (w->issued_prev) w->issued_prev->issued_next = w->issued_next;
    else g->async.issued = w->issued_next;
    if (w->issued_next) w->issued_next->issued_prev = w->issued_prev;
    w->issued_prev = w->issued_next = NULL;
    pthread_mutex_unlock(&g->async.mu);
}

/* The group is going away (its progress thread stopped): free the handles nobody waited on, so a later
   ddp_wait on one is an error instead of a use after free. */
static ddp_result ddp__irecv_wait(ddp_work *w);
static void ddp__work_release_all(ddp_group *g) {
    while (g->async.issued) {
        ddp_work *w = g->async.issued;
        g->async.issued = w->issued_next;
        ddp__live_remove(w, DDP__LIVE_WORK);
        if (w->owner && w->owner->wait == ddp__irecv_wait) ddp__free(w->handle); /* its posted receive */
        if (w->owner && w->owner->wait == ddp__mpi_p2p_wait) ddp__mpi_p2p_release(w);
        ddp__free(w);
    }
}

static ddp_result ddp__spent_work(const char *fn, const ddp_work *w) {
    return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: work handle %p is not live: it was already waited on (call "
                     "ddp_wait exactly once per handle), or its group was destroyed (which releases the handles not "
                     "waited on), or it never came from an async collective", fn, (const void *)w);
}

/* Queue k (validated) for the progress thread: fingerprinted as g's next collective, or, for an isend,
   under its own description `p2p`. */
static ddp_result ddp__enqueue(ddp_group *g, const ddp__call *k, const ddp__coll *p2p, ddp_work **out) {
    ddp_work *w = (ddp_work *)ddp__calloc(1, sizeof *w);
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    if (!ddp__work_issue(g, w)) {
        ddp__free(w);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work");
    }
    w->g = g;
    w->call = *k;
    pthread_mutex_lock(&g->async.mu);
    if (!g->async.running) {
        if (pthread_create(&g->async.thread, NULL, ddp__progress_main, g) != 0) {
            pthread_mutex_unlock(&g->async.mu);
            ddp__live_remove(w, DDP__LIVE_WORK);
            ddp__work_unlink(g, w);
            ddp__free(w);
            return ddp__fail(g, DDP_ERR_SYSTEM, "could not start the progress thread: %s", strerror(errno));
        }
        g->async.running = 1;
    }
    if (p2p) w->coll = *p2p;
    else ddp__fingerprint(g, k, &w->coll); /* under the lock: seq order is issue order */
    if (g->async.tail)
        g->async.tail->next = w;
    else
        g->async.head = w;
    g->async.tail = w;
    pthread_cond_broadcast(&g->async.cv);
    pthread_mutex_unlock(&g->async.mu);
    *out = w;
    return DDP_SUCCESS;
}

static ddp_result ddp__collective_async(ddp_group *g, const ddp__call *k, ddp_work **out) {
    ddp_result r;
    if ((r = ddp__group_check(g, ddp__coll_name(k->kind))) != DDP_SUCCESS) return r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s_async: the ddp_work **out argument is NULL", ddp__coll_name(k->kind));
    *out = NULL;
    if ((r = ddp__validate(g, k)) != DDP_SUCCESS) return r;
    if (g->backend->enqueue && g->backend->enqueue(g, k, out, &r)) { /* the backend took it (nccl: device work) */
        if (r == DDP_SUCCESS && !ddp__work_issue(g, *out)) {
            r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work; the collective was queued: "
                          "destroy the group");
            *out = NULL;
        }
        return r;
    }
    return ddp__enqueue(g, k, NULL, out);
}

static ddp_result ddp__group_abort(ddp_group *g, ddp_result code, const char *msg) {
    ddp__drain(g);
    return ddp__group_break(g, code, msg);
}

DDP_API ddp_result ddp_wait(ddp_work *w) {
    ddp_group *g;
    ddp_result r;
    if (!w) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_wait: the work handle is NULL");
    if (!ddp__live_take(w, DDP__LIVE_WORK)) return ddp__spent_work("ddp_wait", w);
    g = w->g;
    ddp__work_unlink(g, w);
    if (w->owner) { /* the backend's own work (nccl: device work; an irecv), freed by its wait */
        ddp__coll c = w->coll;
        r = w->owner->wait(w);
        if (!ddp__is_p2p(c.kind)) ddp__trace_ended(g, &c, r);
        return r;
    }
    pthread_mutex_lock(&g->async.mu);
    while (!w->done) pthread_cond_wait(&g->async.cv, &g->async.mu);
    pthread_mutex_unlock(&g->async.mu);
    r = w->result;
    if (r) ddp__fail(g, r, "%s", w->error);
    ddp__free(w);
    return r;
}

DDP_API int ddp_test(ddp_work *w) {
    int done;
    if (!w) return 1;
    if (!ddp__live_has(w, DDP__LIVE_WORK)) { /* ddp_wait would not block: it fails at once */
        ddp__spent_work("ddp_test", w);
        return 1;
    }
    if (w->owner) return w->owner->test(w);
    pthread_mutex_lock(&w->g->async.mu);
    done = w->done;
    pthread_mutex_unlock(&w->g->async.mu);
    return done;
}

/* ---- the public collectives: describe the call, then run it now or queue it ---- */

DDP_API ddp_result ddp_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_gather(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_reduce_scatter(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                      ddp_op op) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_barrier(ddp_group *g) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective(g, &k);
}

DDP_API ddp_result ddp_all_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_broadcast_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_gather_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                        ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_scatter_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                            ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_barrier_async(ddp_group *g, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}

/* ---- gather, scatter, all_to_all, the uneven calls, broadcast_bytes, monitored_barrier ---- */

static ddp__call ddp__v_call(ddp__coll_kind kind, const void *send, const size_t *send_counts, void *recv,
                             const size_t *recv_counts, size_t count, ddp_dtype t) {
    ddp__call k = ddp__make_call(kind, send, recv, count, t, DDP_SUM, -1);
    k.send_counts = send_counts;
    k.recv_counts = recv_counts;
    return k;
}

static ddp__call ddp__bytes_call(void **data, size_t *size, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST_BYTES, NULL, NULL, 0, DDP_U8, DDP_SUM, root);
    k.bytes = data;
    k.bytes_size = size;
    return k;
}

static ddp__call ddp__monitored_call(double seconds) {
    ddp__call k = ddp__make_call(DDP__MONITORED_BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    k.seconds = seconds;
    return k;
}

DDP_API ddp_result ddp_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__GATHER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_scatter(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__SCATTER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_to_all(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_TO_ALL, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_to_all_v(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                    const size_t *recv_counts, ddp_dtype t) {
    ddp__call k = ddp__v_call(DDP__ALL_TO_ALL_V, send, send_counts, recv, recv_counts, 0, t);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_all_gather_v(ddp_group *g, const void *send, size_t count, void *recv, const size_t *counts,
                                    ddp_dtype t) {
    ddp__call k = ddp__v_call(DDP__ALL_GATHER_V, send, NULL, recv, counts, count, t);
    return ddp__collective(g, &k);
}
DDP_API ddp_result ddp_broadcast_bytes(ddp_group *g, void **data, size_t *size, int root) {
    ddp__call k = ddp__bytes_call(data, size, root);
    return ddp__collective(g, &k);
}
DDP_API void ddp_free_bytes(void *data) { ddp__free(data); }
DDP_API ddp_result ddp_monitored_barrier(ddp_group *g, double timeout_seconds) {
    ddp__call k = ddp__monitored_call(timeout_seconds);
    return ddp__collective(g, &k);
}

DDP_API ddp_result ddp_gather_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                    ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__GATHER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_scatter_async(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t, int root,
                                     ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__SCATTER, send, recv, count, t, DDP_SUM, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_to_all_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                        ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_TO_ALL, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_to_all_v_async(ddp_group *g, const void *send, const size_t *send_counts, void *recv,
                                          const size_t *recv_counts, ddp_dtype t, ddp_work **w) {
    ddp__call k = ddp__v_call(DDP__ALL_TO_ALL_V, send, send_counts, recv, recv_counts, 0, t);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_all_gather_v_async(ddp_group *g, const void *send, size_t count, void *recv, const size_t *counts,
                                          ddp_dtype t, ddp_work **w) {
    ddp__call k = ddp__v_call(DDP__ALL_GATHER_V, send, NULL, recv, counts, count, t);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_broadcast_bytes_async(ddp_group *g, void **data, size_t *size, int root, ddp_work **w) {
    ddp__call k = ddp__bytes_call(data, size, root);
    return ddp__collective_async(g, &k, w);
}
DDP_API ddp_result ddp_monitored_barrier_async(ddp_group *g, double timeout_seconds, ddp_work **w) {
    ddp__call k = ddp__monitored_call(timeout_seconds);
    return ddp__collective_async(g, &k, w);
}

/* ---- point-to-point: ddp_send, ddp_recv, ddp_isend, ddp_irecv ----
   Not collectives: two ranks take part, so a call takes no collective number (the fingerprint that every
   rank compares); it is described by its peer and tag under a number of its own (see ddp__mesh). It goes
   over the TCP mesh whatever the backend (transport.c's matching; the mpi backend sends with MPI).
   ddp_send / ddp_recv run on the calling thread after the group's queued async work, as the synchronous
   collectives do. ddp_isend is queued for the progress thread like an async collective (a send never
   waits for its receive). ddp_irecv is not queued: it is posted at once (a message already stashed
   finishes it there), so a later queued call, or any call that reads frames, can finish it; ddp_wait
   first lets the queued work run, then reads until its message comes; ddp_test looks once when no
   queued work runs. So the exchange patterns work in any order: irecv then isend on every rank, or an
   irecv posted before collectives that its sender calls first. */

/* The arguments of a send or recv, checked on the caller's thread (a bad call breaks nothing). */
static ddp_result ddp__p2p_check(ddp_group *g, const char *name, ddp__coll_kind kind, const void *buf, size_t count,
                                 ddp_dtype t, int peer, int tag) {
    ddp_result r = ddp__group_check(g, name);
    if (r) return r;
    if (!ddp__dtype_valid(t))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)t);
    if (peer < 0 || peer >= g->world_size || peer == g->rank)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %s %d is not another rank of this group (rank %d of %d)", name,
                         kind == DDP__SEND ? "dst" : "src", peer, g->rank, g->world_size);
    if (tag < 0) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: tag %d is negative", name, tag);
    if (count > DDP__MAX_BUFFER_BYTES / ddp_dtype_size(t))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is above the limit of 2^47 bytes (128 TiB) of %s", name,
                         count, ddp_dtype_name(t));
    if (count && !buf) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the buffer is NULL with count %zu", name, count);
#if defined(DDP_CUDA)
    if (count && g->nccl && ddp__cuda_is_device_pointer(buf) == 1)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "%s: the nccl backend sends and receives host memory only so far "
                         "(ncclSend/ncclRecv for device memory are not built yet): copy the buffer to host memory", name);
#endif
    return DDP_SUCCESS;
}

/* The call and its description: the peer in root, its own number (no collective's). */
static void ddp__p2p_describe(ddp_group *g, ddp__call *k, ddp__coll *c, ddp__coll_kind kind, const void *send, void *recv,
                              size_t count, ddp_dtype t, int peer, int tag) {
    *k = ddp__make_call(kind, send, recv, count, t, DDP_SUM, peer);
    k->tag = tag;
    memset(c, 0, sizeof *c);
    c->seq = UINT64_MAX - ++g->mesh.p2p_calls; /* see ddp__mesh */
    c->kind = (uint8_t)kind;
    c->count = count;
    c->dtype = (uint8_t)t;
    c->op = DDP__NO_OP;
    c->root = peer;
    c->tag = tag;
}

static ddp_result ddp__p2p(ddp_group *g, ddp__coll_kind kind, const void *send, void *recv, size_t count, ddp_dtype t,
                           int peer, int tag) {
    const char *name = ddp__coll_name(kind);
    char msg[DDP__ERR_MAX];
    ddp__call k;
    ddp__coll c;
    ddp_result r = ddp__p2p_check(g, name, kind, kind == DDP__SEND ? send : recv, count, t, peer, tag);
    if (r) return r;
    ddp__drain(g);
    ddp__p2p_describe(g, &k, &c, kind, send, recv, count, t, peer, tag);
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, &k, msg));
    if ((r = ddp__run(g, g->backend, &k, &c)) != DDP_SUCCESS) return ddp__fail(g, r, "%s", g->broken_msg);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_send(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag) {
    return ddp__p2p(g, DDP__SEND, buf, NULL, count, t, dst, tag);
}
DDP_API ddp_result ddp_recv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag) {
    return ddp__p2p(g, DDP__RECV, NULL, buf, count, t, src, tag);
}

/* Checks shared by ddp_isend and ddp_irecv; *out = NULL. */
static ddp_result ddp__p2p_async_check(ddp_group *g, const char *name, ddp__coll_kind kind, const void *buf, size_t count,
                                       ddp_dtype t, int peer, int tag, ddp_work **out) {
    ddp_result r = ddp__p2p_check(g, name, kind, buf, count, t, peer, tag);
    if (r) return r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the ddp_work **out argument is NULL", name);
    *out = NULL;
    if (g->broken) return ddp__fail(g, DDP_ERR_STATE, "%s: the group is broken by an earlier error and cannot be used; "
                                    "destroy it. The error was: %.800s", name, g->broken_msg);
    return DDP_SUCCESS;
}

/* On the mpi backend: MPI's own nonblocking calls, started now (mpi.c). */
static ddp_result ddp__mpi_p2p_async(ddp_group *g, ddp__coll_kind kind, const void *send, void *recv, size_t count,
                                     ddp_dtype t, int peer, int tag, ddp_work **out) {
    ddp_work *w = (ddp_work *)ddp__calloc(1, sizeof *w);
    ddp_result r;
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    w->g = g;
    ddp__p2p_describe(g, &w->call, &w->coll, kind, send, recv, count, t, peer, tag);
    ddp__drain(g); /* in issue order with the queued collectives */
    if ((r = ddp__mpi_p2p_start(g, w)) != DDP_SUCCESS || !ddp__work_issue(g, w)) {
        if (r == DDP_SUCCESS) { /* started, and nobody can wait for it: the group cannot go on */
            ddp__mpi_p2p_release(w);
            r = ddp__group_abort(g, DDP_ERR_OUT_OF_MEMORY, "out of memory recording a ddp_work");
        }
        ddp__free(w);
        return r;
    }
    *out = w;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_isend(ddp_group *g, const void *buf, size_t count, ddp_dtype t, int dst, int tag, ddp_work **w) {
    ddp__call k;
    ddp__coll c;
    ddp_result r = ddp__p2p_async_check(g, "isend", DDP__SEND, buf, count, t, dst, tag, w);
    if (r) return r;
    if (g->mpi) return ddp__mpi_p2p_async(g, DDP__SEND, buf, NULL, count, t, dst, tag, w);
    ddp__p2p_describe(g, &k, &c, DDP__SEND, buf, NULL, count, t, dst, tag);
    return ddp__enqueue(g, &k, &c, w);
}

/* An irecv's handle: its wait and test (ddp_work.owner); w->handle is its posted receive. */
static ddp_result ddp__irecv_wait(ddp_work *w) {
    ddp_group *g = w->g;
    ddp__posted *p = (ddp__posted *)w->handle;
    ddp_result r;
    ddp__drain(g); /* queued work first: it may bring the message, and it reads the connections meanwhile */
    if (ddp__posted_done(g, p)) r = p->result;
    else if (g->broken) r = g->broken;
    else r = ddp__p2p_wait(g, &w->coll, p, 0);
    if (!ddp__posted_done(g, p)) ddp__p2p_unpost(g, p);
    if (r) ddp__fail(g, r, "%s", g->broken ? g->broken_msg : "irecv failed");
    ddp__free(p);
    ddp__free(w);
    return r;
}

static int ddp__irecv_test(ddp_work *w) {
    ddp_group *g = w->g;
    ddp__posted *p = (ddp__posted *)w->handle;
    int idle;
    if (ddp__posted_done(g, p) || g->broken) return 1;
    pthread_mutex_lock(&g->async.mu);
    idle = g->async.head == NULL; /* no queued work reads the connections now, and only this thread queues more */
    pthread_mutex_unlock(&g->async.mu);
    if (idle) ddp__p2p_wait(g, &w->coll, p, 1);
    return ddp__posted_done(g, p) || g->broken != DDP_SUCCESS;
}

static const ddp__backend ddp__irecv_owner = {"p2p", "cpu", NULL, NULL, ddp__irecv_wait, ddp__irecv_test, NULL,
                                              NULL, NULL, NULL, NULL, NULL};

DDP_API ddp_result ddp_irecv(ddp_group *g, void *buf, size_t count, ddp_dtype t, int src, int tag, ddp_work **out) {
    ddp__posted *p;
    ddp_work *w;
    ddp_result r = ddp__p2p_async_check(g, "irecv", DDP__RECV, buf, count, t, src, tag, out);
    if (r) return r;
    if (g->mpi) return ddp__mpi_p2p_async(g, DDP__RECV, NULL, buf, count, t, src, tag, out);
    w = (ddp_work *)ddp__calloc(1, sizeof *w);
    p = (ddp__posted *)ddp__calloc(1, sizeof *p);
    if (!w || !p || !ddp__work_issue(g, w)) {
        ddp__free(w);
        ddp__free(p);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "irecv: out of memory allocating a ddp_work");
    }
    w->g = g;
    w->owner = &ddp__irecv_owner;
    w->handle = p;
    ddp__p2p_describe(g, &w->call, &w->coll, DDP__RECV, NULL, buf, count, t, src, tag);
    p->src = src;
    p->tag = tag;
    p->buf = buf;
    p->bytes = count * ddp_dtype_size(t);
    p->count = count;
    p->dtype = (uint8_t)t;
    if ((r = ddp__p2p_post(g, p)) != DDP_SUCCESS) { /* a stashed message of another size: the group is broken */
        ddp__live_remove(w, DDP__LIVE_WORK);
        ddp__work_unlink(g, w);
        ddp__free(p);
        ddp__free(w);
        return ddp__fail(g, r, "%s", g->broken_msg);
    }
    *out = w;
    return DDP_SUCCESS;
}
/* ==================== end src/collectives.c ==================== */

/* ==================== begin src/trace.c ==================== */
/* [SECTION] trace: the flight recorder, each group's last collectives, written out when the group breaks
   (torch's NCCL flight recorder: TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT)

   Every group keeps a ring of its last DDP_TRACE_SIZE collectives (default 64; 0 turns the recorder
   off). Entry seq % size holds collective #seq: its fingerprint (collective, count, dtype, op, root),
   its state (queued, in progress, done, failed) and the monotonic times it was queued, started and
   ended (coarse clock: 1-4 ms resolution). A transition is one clock read and a few relaxed stores
   into the slot; nothing allocates, locks or makes a system call (bench/bench_trace.c measures it).

   Writers: the thread that issues a call writes the whole entry (queued; async calls under the
   async queue's mutex, so slots are written in seq order), the thread that runs it (the caller, or
   the progress thread) moves its state. Every field is an atomic (relaxed, the state word release/
   acquire): a reader on another thread or in a signal handler sees each field whole, and checks the
   state word before and after copying an entry, so it skips an entry being rewritten. The state word
   is seq << 3 | state, so a late update for a slot that a newer collective took is dropped (only
   possible with more than `size` async calls outstanding).

   Dump: "ddp trace rank R (host H, pid P), group G, world W, restart K: ..." then one line per entry,
   oldest first. When a group breaks (ddp__group_break: a timeout, a lost peer, an ABORT from a peer, a
   mismatch, any error that ends the group), once:
     DDP_TRACE_DIR set: every live group of this process into DDP_TRACE_DIR/ddp_trace_rank<R>_pid<P>.txt
                        (R the world rank; written to a temporary file, then renamed over it)
     else:              this group's last DDP__TRACE_LOG_LINES entries into its log at error level.
   On SIGUSR1, when DDP_TRACE_DIR is set or DDP_TRACE_SIGNAL=1 (and DDP_TRACE_SIGNAL is not 0): the
   same file, or stderr without DDP_TRACE_DIR; on SIGTERM the file too (with DDP_TRACE_DIR only), before
   the process ends as it would have: the rank that ddprun stops because the others failed is often the
   one that was behind, stuck outside the library where no error reaches it. The handler formats straight from the rings with
   async-signal-safe calls only (its own number formatting into a stack buffer, open, write, rename;
   no locks, no stdio), so it also reports a rank that is stuck outside the library; then it calls the
   handler that was installed before, if any. It is installed once per process and stays.
   ddprun reads the files when a job fails (launcher.c: ddp__launch_trace_summary). */

#define DDP__TRACE_DEFAULT 64
#define DDP__TRACE_MAX 1000000
#define DDP__TRACE_LOG_LINES 10 /* entries a dump into the log shows (the file has them all) */
#define DDP__TRACE_GROUPS 256   /* live recorders the signal handler can find */

enum { DDP__TRACE_EMPTY = 0, DDP__TRACE_QUEUED, DDP__TRACE_STARTED, DDP__TRACE_DONE, DDP__TRACE_FAILED };

typedef struct ddp__trace_entry {
    uint64_t seq_state;                 /* seq << 3 | state; 0: never used */
    uint64_t count;
    uint64_t what;                      /* kind | dtype << 8 | op << 16 | (root + 1) << 32 */
    int64_t t_queued, t_started, t_ended; /* CLOCK_MONOTONIC ns; 0: not yet */
} ddp__trace_entry;

struct ddp__trace {
    ddp_group *g;
    ddp__trace_entry *ring;
    uint64_t size;
    int dumped;          /* the dump at the break was written (by the thread that broke the group) */
    int waiting_for;     /* at the break: the rank this one waited for (-1: none known); atomic */
    int break_code;      /* at the break: the ddp_result; atomic (other threads' dumps read it) */
    long restart;        /* DDP_RESTART_COUNT */
    char host[64];
};

/* The recorders the signal handler walks; handlers_running lets ddp__trace_close wait one out. */
static struct ddp__trace *ddp__trace_all[DDP__TRACE_GROUPS];
static int ddp__trace_handlers_running;
static int ddp__trace_installed; /* 0 not yet, 1 installed, -1 decided against */
static struct sigaction ddp__trace_old_usr1, ddp__trace_old_term;
static char ddp__trace_signal_dir[512]; /* DDP_TRACE_DIR when the handler was installed ("": stderr) */

/* The ring's clock: the coarse monotonic clock, read in a few ns without a system call (the precise one
   costs ~30 ns here, three times per collective); its resolution (the kernel tick, 1-4 ms) is plenty to
   tell a hang of seconds. */
#if defined(__linux__) && !defined(CLOCK_MONOTONIC_COARSE)
#define CLOCK_MONOTONIC_COARSE 6 /* linux/time.h */
#endif
#ifdef CLOCK_MONOTONIC_COARSE
#define DDP__TRACE_CLOCK CLOCK_MONOTONIC_COARSE
#else
#define DDP__TRACE_CLOCK CLOCK_MONOTONIC
#endif

#define DDP__TLOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define DDP__TSTORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static int64_t ddp__trace_clock(int id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- recording ---- */

static ddp__trace_entry *ddp__trace_slot(ddp_group *g, uint64_t seq) {
    return g->trace ? &g->trace->ring[seq % g->trace->size] : NULL;
}

static void ddp__trace_queued(ddp_group *g, const ddp__coll *c) {
    ddp__trace_entry *e = ddp__trace_slot(g, c->seq);
    if (!e) return;
    __atomic_store_n(&e->seq_state, 0, __ATOMIC_RELEASE); /* readers skip it while it is rewritten */
    DDP__TSTORE(&e->count, c->count);
    DDP__TSTORE(&e->what, (uint64_t)c->kind | (uint64_t)c->dtype << 8 | (uint64_t)c->op << 16 |
                              (uint64_t)(uint32_t)(c->root + 1) << 32);
    DDP__TSTORE(&e->t_queued, ddp__trace_clock(DDP__TRACE_CLOCK));
    DDP__TSTORE(&e->t_started, (int64_t)0);
    DDP__TSTORE(&e->t_ended, (int64_t)0);
    __atomic_store_n(&e->seq_state, c->seq << 3 | DDP__TRACE_QUEUED, __ATOMIC_RELEASE);
}

/* Move collective seq's entry from state `from` (any state but `to` when from is 0) to `to`, stamping
   *stamp with the time; a slot that a newer collective took is left alone. */
static void ddp__trace_move(ddp_group *g, uint64_t seq, int from, int to, int which) {
    ddp__trace_entry *e = ddp__trace_slot(g, seq);
    uint64_t now_state;
    int state;
    if (!e) return;
    now_state = __atomic_load_n(&e->seq_state, __ATOMIC_ACQUIRE);
    state = (int)(now_state & 7);
    if (now_state >> 3 != seq || (from ? state != from : (state == DDP__TRACE_DONE || state == DDP__TRACE_FAILED))) return;
    DDP__TSTORE(which ? &e->t_ended : &e->t_started, ddp__trace_clock(DDP__TRACE_CLOCK));
    __atomic_store_n(&e->seq_state, seq << 3 | (uint64_t)to, __ATOMIC_RELEASE);
}

static void ddp__trace_started(ddp_group *g, const ddp__coll *c) {
    ddp__trace_move(g, c->seq, DDP__TRACE_QUEUED, DDP__TRACE_STARTED, 0);
}

static void ddp__trace_ended(ddp_group *g, const ddp__coll *c, ddp_result r) {
    ddp__trace_move(g, c->seq, 0, r == DDP_SUCCESS ? DDP__TRACE_DONE : DDP__TRACE_FAILED, 1);
}

/* ---- formatting, async-signal-safe: no stdio, no locale, no allocation ---- */

typedef struct ddp__tbuf {
    char *p;
    size_t len, cap;
} ddp__tbuf;

static void ddp__tput(ddp__tbuf *b, const char *s) {
    while (*s && b->len + 1 < b->cap) b->p[b->len++] = *s++;
    b->p[b->len] = '\0';
}

static void ddp__tput_uint(ddp__tbuf *b, uint64_t v, int min_digits) {
    char d[24];
    int n = 0;
    do {
        d[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v || n < min_digits);
    while (n > 0 && b->len + 1 < b->cap) b->p[b->len++] = d[--n];
    b->p[b->len] = '\0';
}

static void ddp__tput_int(ddp__tbuf *b, int64_t v) {
    if (v < 0) ddp__tput(b, "-");
    ddp__tput_uint(b, v < 0 ? (uint64_t)(-(v + 1)) + 1 : (uint64_t)v, 1);
}

/* Nanoseconds as seconds with `decimals` digits (truncated): "2.001". */
static void ddp__tput_secs(ddp__tbuf *b, int64_t ns, int decimals) {
    int64_t scale = 1;
    int i;
    if (ns < 0) ns = 0;
    for (i = decimals; i < 9; i++) scale *= 10;
    ddp__tput_uint(b, (uint64_t)(ns / 1000000000), 1);
    ddp__tput(b, ".");
    ddp__tput_uint(b, (uint64_t)(ns % 1000000000 / scale), decimals);
}

/* UTC wall-clock time of Unix-epoch ns as 2026-11-24T15:40:01.123Z (days to civil date: Howard
   Hinnant's algorithm; gmtime is not async-signal-safe). */
static void ddp__tput_utc(ddp__tbuf *b, int64_t ns) {
    int64_t s = ns / 1000000000, z = s / 86400 + 719468, era, doe, yoe, doy, mp, y, m, d, sod = s % 86400;
    era = z / 146097;
    doe = z - era * 146097;
    yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    mp = (5 * doy + 2) / 153;
    d = doy - (153 * mp + 2) / 5 + 1;
    m = mp < 10 ? mp + 3 : mp - 9;
    y = yoe + era * 400 + (m <= 2);
    ddp__tput_uint(b, (uint64_t)y, 4), ddp__tput(b, "-"), ddp__tput_uint(b, (uint64_t)m, 2), ddp__tput(b, "-");
    ddp__tput_uint(b, (uint64_t)d, 2), ddp__tput(b, "T"), ddp__tput_uint(b, (uint64_t)(sod / 3600), 2), ddp__tput(b, ":");
    ddp__tput_uint(b, (uint64_t)(sod / 60 % 60), 2), ddp__tput(b, ":"), ddp__tput_uint(b, (uint64_t)(sod % 60), 2);
    ddp__tput(b, "."), ddp__tput_uint(b, (uint64_t)(ns % 1000000000 / 1000000), 3), ddp__tput(b, "Z");
}

/* "#4 all_reduce(count=4, f32, sum)": as ddp__coll_describe numbers them (set-up calls: "set-up #k"). */
static void ddp__tput_call(ddp__tbuf *b, const ddp_group *g, uint64_t seq, uint64_t count, uint64_t what) {
    int kind = (int)(what & 0xff), dtype = (int)(what >> 8 & 0xff), op = (int)(what >> 16 & 0xff);
    int root = (int)(uint32_t)(what >> 32) - 1;
    uint64_t base = g->seq_base;
    ddp__tput(b, seq > base ? "#" : "set-up #");
    ddp__tput_uint(b, seq > base ? seq - base : seq, 1);
    ddp__tput(b, " ");
    ddp__tput(b, ddp__coll_name(kind));
    ddp__tput(b, "(");
    if (kind == DDP__BROADCAST_BYTES) { /* as ddp__coll_describe: no count or dtype where the fingerprint has none */
        ddp__tput(b, "root="), ddp__tput_int(b, root);
    } else if (kind != DDP__BARRIER && kind != DDP__MONITORED_BARRIER) {
        if (kind != DDP__ALL_TO_ALL_V) {
            ddp__tput(b, kind == DDP__ALL_GATHER_V ? "total count=" : "count=");
            ddp__tput_uint(b, count, 1);
            ddp__tput(b, ", ");
        }
        ddp__tput(b, ddp_dtype_name((ddp_dtype)dtype));
        if (op != DDP__NO_OP) ddp__tput(b, ", "), ddp__tput(b, ddp_op_name((ddp_op)op));
        if (root >= 0) ddp__tput(b, ", root="), ddp__tput_int(b, root);
    }
    ddp__tput(b, ")");
}

/* A consistent copy of slot i, or 0 when it is empty or being rewritten. */
static int ddp__trace_read(const struct ddp__trace *t, uint64_t i, ddp__trace_entry *out) {
    ddp__trace_entry *e = &t->ring[i];
    uint64_t before = __atomic_load_n(&e->seq_state, __ATOMIC_ACQUIRE);
    out->count = __atomic_load_n(&e->count, __ATOMIC_ACQUIRE); /* acquire: none moves past the check below */
    out->what = __atomic_load_n(&e->what, __ATOMIC_ACQUIRE);
    out->t_queued = __atomic_load_n(&e->t_queued, __ATOMIC_ACQUIRE);
    out->t_started = __atomic_load_n(&e->t_started, __ATOMIC_ACQUIRE);
    out->t_ended = __atomic_load_n(&e->t_ended, __ATOMIC_ACQUIRE);
    out->seq_state = __atomic_load_n(&e->seq_state, __ATOMIC_ACQUIRE);
    return before != 0 && before == out->seq_state;
}

/* One entry's line: "  #4 all_reduce(count=4, f32, sum) failed after 2.004 s (waiting for rank 2),
   queued 2026-11-24T15:40:01.123Z" (times at the ring clock's resolution). */
static void ddp__trace_line(ddp__tbuf *b, const struct ddp__trace *t, const ddp__trace_entry *e, int64_t mono, int64_t wall) {
    int state = (int)(e->seq_state & 7);
    ddp__tput(b, "  ");
    ddp__tput_call(b, t->g, e->seq_state >> 3, e->count, e->what);
    if (state == DDP__TRACE_QUEUED) {
        ddp__tput(b, " queued for "), ddp__tput_secs(b, mono - e->t_queued, 3), ddp__tput(b, " s");
    } else if (state == DDP__TRACE_STARTED) {
        ddp__tput(b, " in progress for "), ddp__tput_secs(b, mono - e->t_started, 3), ddp__tput(b, " s");
    } else {
        ddp__tput(b, state == DDP__TRACE_DONE ? " done in " : " failed after ");
        ddp__tput_secs(b, e->t_ended - (e->t_started ? e->t_started : e->t_queued), 3), ddp__tput(b, " s");
    }
    if (state == DDP__TRACE_FAILED && DDP__TLOAD(&t->waiting_for) >= 0 && e->t_started)
        ddp__tput(b, " (waiting for rank "), ddp__tput_int(b, DDP__TLOAD(&t->waiting_for)), ddp__tput(b, ")");
    ddp__tput(b, ", queued "), ddp__tput_utc(b, wall - (mono - e->t_queued)), ddp__tput(b, "\n");
}

static void ddp__trace_header(ddp__tbuf *b, const struct ddp__trace *t, int shown, int recorded) {
    const ddp_group *g = t->g;
    ddp__tput(b, "ddp trace rank "), ddp__tput_int(b, g->world_ranks[g->rank]);
    ddp__tput(b, " (host "), ddp__tput(b, t->host), ddp__tput(b, ", pid "), ddp__tput_int(b, (int64_t)getpid());
    ddp__tput(b, "), group "), ddp__tput(b, g->member.parent ? g->member.prefix : "world");
    if (g->member.parent) ddp__tput(b, " (rank "), ddp__tput_int(b, g->rank), ddp__tput(b, ")");
    ddp__tput(b, ", world "), ddp__tput_int(b, g->world_size), ddp__tput(b, ", restart "), ddp__tput_int(b, t->restart);
    if (DDP__TLOAD(&t->break_code))
        ddp__tput(b, ", broken ("), ddp__tput(b, ddp_result_string((ddp_result)DDP__TLOAD(&t->break_code))), ddp__tput(b, ")");
    ddp__tput(b, ": last "), ddp__tput_int(b, shown), ddp__tput(b, " of "), ddp__tput_int(b, recorded);
    ddp__tput(b, " collectives (DDP_TRACE_SIZE "), ddp__tput_uint(b, t->size, 1), ddp__tput(b, ")\n");
}

/* The seq of the newest entry (0: none); the ring holds seqs (newest - size, newest]. */
static uint64_t ddp__trace_newest(const struct ddp__trace *t) {
    uint64_t i, newest = 0;
    for (i = 0; i < t->size; i++) {
        uint64_t s = __atomic_load_n(&t->ring[i].seq_state, __ATOMIC_ACQUIRE) >> 3;
        if (s > newest) newest = s;
    }
    return newest;
}

/* Write t's header and its last `limit` entries, oldest first, one line at a time to emit(line, arg). */
static void ddp__trace_format(const struct ddp__trace *t, uint64_t limit, void (*emit)(const char *line, void *arg), void *arg) {
    char line[512];
    ddp__tbuf b;
    ddp__trace_entry e;
    int64_t mono = ddp__trace_clock(DDP__TRACE_CLOCK), wall = ddp__trace_clock(CLOCK_REALTIME);
    uint64_t newest = ddp__trace_newest(t), first, s, recorded;
    first = newest > t->size ? newest - t->size + 1 : 1;
    recorded = newest ? newest - first + 1 : 0;
    if (newest - first + 1 > limit && newest) first = newest - limit + 1;
    b.p = line, b.cap = sizeof line, b.len = 0;
    ddp__trace_header(&b, t, newest ? (int)(newest - first + 1) : 0, (int)recorded);
    emit(line, arg);
    for (s = first; newest && s <= newest; s++) {
        if (!ddp__trace_read(t, s % t->size, &e) || e.seq_state >> 3 != s) continue;
        b.len = 0;
        ddp__trace_line(&b, t, &e, mono, wall);
        emit(line, arg);
    }
}

/* ---- where a dump goes ---- */

static void ddp__trace_emit_fd(const char *line, void *arg) {
    int fd = *(int *)arg;
    size_t n = strlen(line), off = 0;
    while (off < n) {
        ssize_t k = write(fd, line + off, n - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return;
        off += (size_t)k;
    }
}

static void ddp__trace_emit_log(const char *line, void *arg) {
    size_t n = strlen(line);
    ddp__log((const ddp_group *)arg, DDP_LOG_ERROR, "%.*s", (int)(n && line[n - 1] == '\n' ? n - 1 : n), line);
}

/* dir + "/ddp_trace_rank<R>_pid<P>.txt" (+ suffix), without snprintf. */
static void ddp__trace_path(ddp__tbuf *b, const char *dir, int world_rank, const char *suffix) {
    ddp__tput(b, dir), ddp__tput(b, "/ddp_trace_rank"), ddp__tput_int(b, world_rank);
    ddp__tput(b, "_pid"), ddp__tput_int(b, (int64_t)getpid()), ddp__tput(b, ".txt"), ddp__tput(b, suffix);
}

/* Every live recorder of this process into DDP_TRACE_DIR's file for this process (temporary file, then
   rename), or to stderr when dir is NULL. Async-signal-safe (getenv is read by the caller). 0 when
   written; -1 when the file could not be (errno). */
static int ddp__trace_write_all(const char *dir, int world_rank, int from_signal) {
    char path[1024], tmp[1040];
    ddp__tbuf b;
    int fd = 2, i, err;
    if (dir) {
        b.p = path, b.cap = sizeof path, b.len = 0;
        ddp__trace_path(&b, dir, world_rank, "");
        b.p = tmp, b.cap = sizeof tmp, b.len = 0;
        ddp__trace_path(&b, dir, world_rank, from_signal ? ".tmp-signal" : ".tmp");
        mkdir(dir, 0777); /* one level; ddprun's or the user's; an error shows at open */
        if ((fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) return -1;
    }
    for (i = 0; i < DDP__TRACE_GROUPS; i++) {
        struct ddp__trace *t = __atomic_load_n(&ddp__trace_all[i], __ATOMIC_ACQUIRE);
        if (t) ddp__trace_format(t, t->size, ddp__trace_emit_fd, &fd);
    }
    if (!dir) return 0;
    err = close(fd) != 0 || rename(tmp, path) != 0 ? errno : 0;
    if (err) unlink(tmp);
    errno = err;
    return err ? -1 : 0;
}

/* The signal handler: dump, then what was installed before. SIGUSR1: a handler function (SIG_DFL would
   end the process: a dump request must not). SIGTERM (only with DDP_TRACE_DIR: the rank that ddprun
   stops because the others failed is often the one behind): the old handler, or for SIG_DFL the
   default action again, so the process still ends by SIGTERM. */
static void ddp__trace_on_signal(int sig, siginfo_t *info, void *ctx) {
    const struct sigaction *old = sig == SIGTERM ? &ddp__trace_old_term : &ddp__trace_old_usr1;
    int saved = errno, i, world_rank = 0;
    __atomic_add_fetch(&ddp__trace_handlers_running, 1, __ATOMIC_SEQ_CST);
    for (i = 0; i < DDP__TRACE_GROUPS; i++) { /* the file is named by the world group's rank */
        struct ddp__trace *t = __atomic_load_n(&ddp__trace_all[i], __ATOMIC_ACQUIRE);
        if (t && !t->g->member.parent) world_rank = t->g->rank;
    }
    if (sig != SIGTERM || ddp__trace_signal_dir[0])
        ddp__trace_write_all(ddp__trace_signal_dir[0] ? ddp__trace_signal_dir : NULL, world_rank, 1);
    __atomic_sub_fetch(&ddp__trace_handlers_running, 1, __ATOMIC_SEQ_CST);
    errno = saved;
    if (old->sa_flags & SA_SIGINFO) {
        if (old->sa_sigaction) old->sa_sigaction(sig, info, ctx);
    } else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
        old->sa_handler(sig);
    } else if (sig == SIGTERM && old->sa_handler == SIG_DFL) {
        sigaction(SIGTERM, old, NULL);
        raise(SIGTERM); /* blocked until this handler returns, then the default action */
    }
}

/* The handlers go in when DDP_TRACE_DIR is set or DDP_TRACE_SIGNAL=1, unless DDP_TRACE_SIGNAL=0: without
   either, a program's SIGUSR1 and SIGTERM keep their meaning untouched. Once per process (the first
   group that records); they stay (with no live group they only pass the signal on). */
static void ddp__trace_install(void) {
    const char *want = ddp__env("DDP_TRACE_SIGNAL");
    struct sigaction sa;
    if (ddp__trace_installed) return;
    ddp__trace_installed = -1;
    if (want ? strcmp(want, "1") != 0 : !ddp__env("DDP_TRACE_DIR")) return;
    snprintf(ddp__trace_signal_dir, sizeof ddp__trace_signal_dir, "%s", ddp__env("DDP_TRACE_DIR") ? ddp__env("DDP_TRACE_DIR") : "");
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = ddp__trace_on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, &ddp__trace_old_usr1) == 0) ddp__trace_installed = 1;
    if (ddp__trace_signal_dir[0] && sigaction(SIGTERM, &sa, &ddp__trace_old_term) != 0) {
        memset(&ddp__trace_old_term, 0, sizeof ddp__trace_old_term);
        ddp__trace_old_term.sa_handler = SIG_DFL;
    }
}

/* ---- life cycle ---- */

static void ddp__trace_open(ddp_group *g) {
    long size = DDP__TRACE_DEFAULT, restart = 0;
    char err[DDP__ERR_MAX];
    struct ddp__trace *t;
    int i;
    if (ddp__env_int("DDP_TRACE_SIZE", 0, DDP__TRACE_MAX, &size, err) < 0) {
        ddp__log(NULL, DDP_LOG_WARN, "%s; the flight recorder keeps the default %d", err, DDP__TRACE_DEFAULT);
        size = DDP__TRACE_DEFAULT;
    }
    if (size == 0) return;
    ddp__env_int("DDP_RESTART_COUNT", 0, INT_MAX, &restart, err);
    if (!(t = (struct ddp__trace *)ddp__calloc(1, sizeof *t)) ||
        !(t->ring = (ddp__trace_entry *)ddp__calloc((size_t)size, sizeof *t->ring))) {
        ddp__free(t);
        return; /* no recorder: the group works without one */
    }
    t->g = g;
    t->size = (uint64_t)size;
    t->waiting_for = -1;
    t->restart = restart;
    if (gethostname(t->host, sizeof t->host - 1) != 0) snprintf(t->host, sizeof t->host, "?");
    g->trace = t;
    ddp__trace_install();
    for (i = 0; i < DDP__TRACE_GROUPS; i++) {
        struct ddp__trace *none = NULL;
        if (__atomic_compare_exchange_n(&ddp__trace_all[i], &none, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
    }
}

static void ddp__trace_close(ddp_group *g) {
    struct ddp__trace *t = g->trace;
    int i;
    if (!t) return;
    for (i = 0; i < DDP__TRACE_GROUPS; i++) {
        struct ddp__trace *mine = t;
        if (__atomic_compare_exchange_n(&ddp__trace_all[i], &mine, (struct ddp__trace *)NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
    }
    while (__atomic_load_n(&ddp__trace_handlers_running, __ATOMIC_SEQ_CST)) sched_yield(); /* one on another thread may hold t */
    g->trace = NULL;
    ddp__free(t->ring);
    ddp__free(t);
}

/* The group breaks with `code`: the entry in progress failed (waiting for g->mesh.waiting_for), and the
   recorder is written out once (see the top). */
static void ddp__trace_break(ddp_group *g, ddp_result code) {
    struct ddp__trace *t = g->trace;
    const char *dir = ddp__env("DDP_TRACE_DIR");
    uint64_t i;
    if (!t || t->dumped) return;
    t->dumped = 1;
    DDP__TSTORE(&t->break_code, (int)code);
    DDP__TSTORE(&t->waiting_for, g->mesh.waiting_for);
    for (i = 0; i < t->size; i++) { /* what was in progress failed with the group */
        uint64_t st = __atomic_load_n(&t->ring[i].seq_state, __ATOMIC_ACQUIRE);
        if ((st & 7) == DDP__TRACE_STARTED) ddp__trace_move(g, st >> 3, DDP__TRACE_STARTED, DDP__TRACE_FAILED, 1);
    }
    if (dir && ddp__trace_write_all(dir, g->world_ranks[g->rank], 0) == 0) {
        ddp__log(g, DDP_LOG_ERROR, "flight recorder: wrote this rank's last collectives to %s/ddp_trace_rank%d_pid%d.txt",
                 dir, g->world_ranks[g->rank], (int)getpid());
        return;
    }
    if (dir)
        ddp__log(g, DDP_LOG_WARN, "flight recorder: could not write into DDP_TRACE_DIR=%s (%s); writing to the log instead",
                 dir, strerror(errno));
    ddp__trace_format(t, DDP__TRACE_LOG_LINES, ddp__trace_emit_log, g);
}
/* ==================== end src/trace.c ==================== */

/* ==================== begin src/tcp.c ==================== */
/* [SECTION] tcp: the tcp backend, collective algorithms over the TCP mesh (Gloo's and MPI's ring,
   recursive-doubling and Bruck algorithms)

   Every algorithm is built from ring steps: in each step a rank sends to its right neighbour
   (rank + 1) and receives from its left (rank - 1) at the same time.

       rank 0 --> rank 1 --> rank 2 --> rank 3 --+
         ^                                       |
         +---------------------------------------+

   all_reduce = reduce-scatter then all-gather, with the buffer cut into n chunks. In the
   reduce-scatter, chunk c starts at rank c+1 and travels once around the ring, each rank adding its
   own part, and ends complete at rank c; the all-gather then passes each complete chunk around.
   Cost for N bytes on n ranks: 2(n-1) steps, each rank sending 2(n-1)/n * N bytes (bandwidth-optimal).
   Up to DDP__RD_MAX_BYTES all_reduce uses recursive doubling instead (log2(n) steps; see below).
   barrier, and broadcast up to DDP__BROADCAST_TREE_MAX_BYTES, use dissemination: ceil(log2 n) steps,
   in step k each rank sending to rank + 2^k (a binomial tree carries the broadcast's data; see below).
   all_gather up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered runs Bruck's algorithm on the same peers
   (ceil(log2 n) steps, each rank's blocks doubling; see below), the ring above. ddp_init's set-up
   gathers (the host keys, shared memory's cross-memory-attach probe, NCCL's id) are this size.

   Why a mismatch is an error on every rank (the program is wrong at collective #X: two ranks call
   something different there; transport.c explains how each rank checks what it receives):
   1. No rank finishes #X. Every algorithm here makes each rank's finish depend, through a chain of
      received frames, on every other rank having sent in #X (the ring passes data from every rank to
      every rank; recursive doubling, dissemination and Bruck's all_gather too; the chain broadcast ends
      with a token pass and reduce starts with a reduce-scatter for this). Each frame on the chain was
      checked by its receiver, so a rank that finishes proves that every rank called the same #X.
   2. Some rank sees the difference. Group the ranks by the call they make at #X. A group in which some
      rank sends without receiving first is "active": every rank of a ring algorithm (all_reduce,
      all_gather, reduce_scatter, reduce), the root of a chain broadcast, every rank of dissemination
      (barrier, small broadcast), of Bruck's all_gather and of recursive doubling (the folded pair
      2i+1 -> 2i answers at once for this reason). An active group that is not every rank sends to a
      rank outside it before it can get stuck: the first step of the ring, of dissemination and of
      Bruck's all_gather goes to rank+1; a broadcast chain passes every rank; recursive doubling's
      partners cover ever larger blocks and so leave the group. That
      frame reaches a rank waiting in #X, which checks every frame that reaches it, whichever peer it
      waits on (transport.c), and fails with DDP_ERR_MISMATCH. Every rank sends or receives something
      at #X unless every group is a chain broadcast (above DDP__BROADCAST_TREE_MAX_BYTES) whose root is
      outside it (every rank calls a large broadcast and none names itself root): that case alone ends
      in DDP_ERR_TIMEOUT.
   3. The rank that saw it breaks the group (an ABORT frame to every peer), and every rank, all stuck
      in #X by (1), fails with that code and message. A rank still finishing #X-1 when a faster rank
      finds the mismatch at #X fails there (or in ddp_init, whose own barrier comes first): the group
      is broken at once, so its last call is the one that reports it. */

static int ddp__mod(int a, int n) { return ((a % n) + n) % n; }

/* One step of the algorithm: send `sbytes` of `sbuf` to `to` while receiving `rbytes` into `rbuf`
   from `from` (-1: no such side). */
static ddp_result ddp__send_recv(ddp_group *g, const ddp__coll *c, int to, const void *sbuf, size_t sbytes, int from,
                                 void *rbuf, size_t rbytes) {
    ddp__step st;
    memset(&st, 0, sizeof st);
    st.send_peer = to;
    st.send_buf = sbuf;
    st.send_bytes = sbytes;
    st.recv_peer = from;
    st.recv_buf = rbuf;
    st.recv_bytes = rbytes;
    return ddp__exchange(g, c, &st);
}

/* Ring reduce-scatter in place: afterwards chunk `rank` of buf is reduced over all ranks (op AVG is
   left as the sum). In step s, send chunk rank-s-1 and add the received chunk rank-s-2. */
static ddp_result ddp__ring_reduce_scatter(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t,
                                           ddp_op op) {
    int n = g->world_size, r = g->rank, s;
    size_t es = ddp_dtype_size(t), off, len, max_len = (count + (size_t)n - 1) / (size_t)n;
    char *tmp = (char *)ddp__scratch(g, max_len * es);
    if (!tmp && max_len) return ddp__no_memory(g, max_len * es);
    for (s = 0; s < n - 1; s++) {
        size_t roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 2, n), &roff, &rlen);
        if ((res = ddp__send_recv(g, c, ddp__mod(r + 1, n), buf + off * es, len * es, ddp__mod(r - 1, n), tmp, rlen * es)) !=
            DDP_SUCCESS)
            return res;
        ddp__reduce(buf + roff * es, tmp, rlen, t, op);
    }
    return DDP_SUCCESS;
}

/* Ring all-gather in place: chunk `rank` of buf is this rank's; afterwards every chunk is filled.
   In step s, send chunk rank-s and receive chunk rank-s-1 straight into place. */
static ddp_result ddp__ring_all_gather(ddp_group *g, const ddp__coll *c, char *buf, size_t count, size_t es) {
    int n = g->world_size, r = g->rank, s;
    for (s = 0; s < n - 1; s++) {
        size_t off, len, roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &roff, &rlen);
        if ((res = ddp__send_recv(g, c, ddp__mod(r + 1, n), buf + off * es, len * es, ddp__mod(r - 1, n), buf + roff * es,
                                  rlen * es)) != DDP_SUCCESS)
            return res;
    }
    return DDP_SUCCESS;
}

/* This rank's chunk of an AVG: divide once, after the sum is complete. */
static void ddp__finish_avg(ddp_group *g, char *buf, size_t count, ddp_dtype t, ddp_op op) {
    size_t off, len;
    if (op != DDP_AVG) return;
    ddp__chunk(count, g->world_size, g->rank, &off, &len);
    ddp__divide(buf + off * ddp_dtype_size(t), len, t, g->world_size);
}

/* ---- recursive doubling (MPICH's small-message allreduce), for all_reduce up to DDP__RD_MAX_BYTES ----
   (Gloo and NCCL's tree do the same job: few steps for latency-bound sizes.)

   p = the largest power of two <= n; the first 2(n - p) ranks pair up (2i, 2i+1) and fold:

       fold:    2i --data--> 2i+1   (2i+1 answers with an empty frame, so that every rank sends first)
       rounds:  the p ranks left (new rank i = 2i+1 for i < n - p, else rank - (n - p)) exchange the
                whole buffer with new rank ^ 1, ^ 2, ^ 4 ... and combine: log2(p) rounds
       unfold:  2i+1 --result--> 2i

   Cost for N bytes: log2(p) + 2 [fold] steps, each sending N bytes (the ring: 2(n-1) steps of N/n).
   Every combine computes (lower rank's block) op (higher rank's block), so partners compute the same
   bits and every rank ends with the same result, floats included (MIN/MAX of -0.0 and +0.0 and
   NaN payloads depend on the order). AVG divides once, at the end, as the ring does.
   The threshold is measured (bench/README.md, DDP_TRANSPORT=tcp on loopback): recursive doubling took
   0.5x the ring's time up to 8 KiB and 0.85x at 32 KiB on 2 ranks, 0.4-0.6x up to 32 KiB and 0.9x at
   256 KiB on 4; the ring won from 64 KiB on 2 ranks. It is no setting: ranks that disagreed on it would
   run different algorithms for the same call, which no fingerprint catches. */


/* Combine this rank's block (buf) with the block just received from `peer` (tmp) as (lower rank's
   block) op (higher rank's block), into buf; tmp is clobbered. Both partners compute the same bits. */
static void ddp__combine_ordered(ddp_group *g, int peer, char *buf, char *tmp, size_t count, ddp_dtype t, ddp_op op) {
    if (peer > g->rank) {
        ddp__reduce(buf, tmp, count, t, op);
        return;
    }
    ddp__reduce(tmp, buf, count, t, op);
    if (count) memcpy(buf, tmp, count * ddp_dtype_size(t));
}

static int ddp__rd_old_rank(int new_rank, int extra) { return new_rank < extra ? 2 * new_rank + 1 : new_rank + extra; }

static ddp_result ddp__rd_all_reduce(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t, ddp_op op) {
    int n = g->world_size, r = g->rank, p = 1, extra, me, mask;
    size_t bytes = count * ddp_dtype_size(t);
    char *tmp = (char *)ddp__scratch(g, bytes);
    ddp_result res;
    if (!tmp && bytes) return ddp__no_memory(g, bytes);
    while (p * 2 <= n) p *= 2;
    extra = n - p;
    if (r < 2 * extra && r % 2 == 0) { /* folded away: hand the data over, wait for the result */
        if ((res = ddp__send_recv(g, c, r + 1, buf, bytes, r + 1, NULL, 0)) != DDP_SUCCESS) return res;
        return ddp__send_recv(g, c, -1, NULL, 0, r + 1, buf, bytes);
    }
    if (r < 2 * extra) {
        if ((res = ddp__send_recv(g, c, r - 1, NULL, 0, r - 1, tmp, bytes)) != DDP_SUCCESS) return res;
        ddp__combine_ordered(g, r - 1, buf, tmp, count, t, op);
    }
    me = r < 2 * extra ? r / 2 : r - extra;
    for (mask = 1; mask < p; mask <<= 1) {
        int peer = ddp__rd_old_rank(me ^ mask, extra);
        if ((res = ddp__send_recv(g, c, peer, buf, bytes, peer, tmp, bytes)) != DDP_SUCCESS) return res;
        ddp__combine_ordered(g, peer, buf, tmp, count, t, op);
    }
    if (op == DDP_AVG) ddp__divide(buf, count, t, n);
    if (r < 2 * extra) return ddp__send_recv(g, c, r - 1, buf, bytes, -1, NULL, 0);
    return DDP_SUCCESS;
}

/* all_reduce over TCP: recursive doubling for small messages (latency-bound: log2(n) steps), the ring
   above for the rest (bandwidth-bound). The choice depends only on the fingerprint (count, dtype) and
   the world size, so ranks that agree on the call run the same algorithm; ranks that disagree are
   caught as the comment at the top explains. */
static ddp_result ddp__do_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_result r;
    if (count * ddp_dtype_size(t) <= DDP__RD_MAX_BYTES) return ddp__rd_all_reduce(g, c, (char *)buf, count, t, op);
    if ((r = ddp__ring_reduce_scatter(g, c, (char *)buf, count, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, (char *)buf, count, t, op);
    return ddp__ring_all_gather(g, c, (char *)buf, count, ddp_dtype_size(t));
}

/* Reduce to root: reduce-scatter, then every rank sends its complete chunk to the root. Non-roots
   work on a copy, since their buffer must stay unchanged. */
static ddp_result ddp__do_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                 int root) {
    int n = g->world_size, k;
    size_t es = ddp_dtype_size(t), off, len;
    char *work = (char *)buf;
    ddp_result r;
    if (g->rank != root) {
        size_t bytes = count * es, max_len = (count + (size_t)n - 1) / (size_t)n;
        char *mem = (char *)ddp__scratch(g, bytes + max_len * es);
        if (!mem && bytes) return ddp__no_memory(g, bytes + max_len * es);
        /* the reduce-scatter receives into the first max_len elements of the scratch; the copy follows */
        work = mem + max_len * es;
        if (bytes) memcpy(work, buf, bytes);
    }
    if ((r = ddp__ring_reduce_scatter(g, c, work, count, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, work, count, t, op);
    for (k = 0; k < n; k++) {
        ddp__step st;
        memset(&st, 0, sizeof st);
        st.send_peer = st.recv_peer = -1;
        if (k == root) continue;
        ddp__chunk(count, n, k, &off, &len);
        if (g->rank == root) {
            st.recv_peer = k;
            st.recv_buf = (char *)buf + off * es;
            st.recv_bytes = len * es;
        } else if (g->rank == k) {
            st.send_peer = root;
            st.send_buf = work + off * es;
            st.send_bytes = len * es;
        } else {
            continue;
        }
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    return DDP_SUCCESS;
}

/* ---- dissemination (Hensgen, Finkel and Manber's barrier), for barrier and small broadcasts ----

   In round k (k = 0, 1, ... while 2^k < n) every rank sends one frame to rank + 2^k and receives one
   from rank - 2^k (mod n), at the same time:

       round 0:  0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 0        (n = 6; every rank sends and receives)
       round 1:  0 -> 2, 1 -> 3, 2 -> 4, 3 -> 5, 4 -> 0, 5 -> 1
       round 2:  0 -> 4, 1 -> 5, 2 -> 0, 3 -> 1, 4 -> 2, 5 -> 3

   After round k a rank has heard, through a chain of frames, from the 2^(k+1) - 1 ranks before it, so
   after ceil(log2 n) rounds from every rank: no rank finishes before every rank has entered the call
   (the barrier's promise, and point 1 of the top comment), for any n, in ceil(log2 n) steps where the
   ring took n - 1.

   A small broadcast rides on the same frames: with pos = (rank - root) mod n, the ranks with
   pos < 2^k hold the data before round k, and in round k the frame from pos to pos + 2^k (when that is
   < n) carries the payload; every other frame is an empty token. The payload frames form the binomial
   tree of the root (pos 0 -> 1; 0 -> 2, 1 -> 3; 0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7 ...), each rank takes
   the data exactly once, from one sender, so it ends equal to the root's buffer, and the tokens make
   the broadcast complete only when every rank has entered it, as the chain's final token pass did.
   Every rank sends before it waits (round 0), so a broadcast meeting another call, or ranks that name
   different roots, is a mismatch that the first frames show. Cost: ceil(log2 n) steps, each rank
   sending at most ceil(log2 n) payloads; above DDP__BROADCAST_TREE_MAX_BYTES the pipelined chain below
   moves the data instead (each link carries it once). */
static ddp_result ddp__dissemination(ddp_group *g, const ddp__coll *c, char *buf, size_t bytes, int root) {
    int n = g->world_size, r = g->rank, pos = ddp__mod(r - root, n), dist;
    ddp_result res;
    for (dist = 1; dist < n; dist *= 2) {
        int gives = pos < dist && pos + dist < n, takes = pos >= dist && pos < 2 * dist;
        if ((res = ddp__send_recv(g, c, ddp__mod(r + dist, n), buf, gives ? bytes : 0, ddp__mod(r - dist, n), buf,
                                  takes ? bytes : 0)) != DDP_SUCCESS)
            return res;
    }
    return DDP_SUCCESS;
}

/* Broadcast of large messages: a pipelined chain root -> root+1 -> ... -> root-1 in slices, so every
   link carries the data once and the slices overlap; then a token goes from the last rank through the
   root to the others, so that no rank finishes before every rank has checked its neighbour's
   fingerprint. */
#define DDP__BROADCAST_SLICE ((size_t)256 << 10)
static ddp_result ddp__chain_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t bytes, int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n);
    int left = ddp__mod(g->rank - 1, n), right = ddp__mod(g->rank + 1, n);
    size_t i, slices = bytes ? (bytes + DDP__BROADCAST_SLICE - 1) / DDP__BROADCAST_SLICE : 1;
    char *p = (char *)buf;
    ddp__step st;
    ddp_result r;
    /* Step i: the root sends slice i; the others receive slice i and forward slice i-1. */
    for (i = 0; i <= slices; i++) {
        size_t send_slice = pos == 0 ? i : i - 1;
        int sends = pos < n - 1 && (pos == 0 ? i < slices : i >= 1);
        int receives = pos > 0 && i < slices;
        memset(&st, 0, sizeof st);
        st.send_peer = st.recv_peer = -1;
        if (sends) {
            size_t o = send_slice * DDP__BROADCAST_SLICE;
            st.send_peer = right;
            st.send_buf = p + o;
            st.send_bytes = DDP__MIN(DDP__BROADCAST_SLICE, bytes - o);
        }
        if (receives) {
            size_t o = i * DDP__BROADCAST_SLICE;
            st.recv_peer = left;
            st.recv_buf = p + o;
            st.recv_bytes = DDP__MIN(DDP__BROADCAST_SLICE, bytes - o);
        }
        if ((sends || receives) && (r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    /* The token: last -> root -> root+1 -> ... -> root-2; each rank passes it on after receiving it. */
    memset(&st, 0, sizeof st);
    st.send_peer = -1;
    if (pos != n - 1) {
        st.recv_peer = left;
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    st.recv_peer = -1;
    if (pos == n - 1 || pos < n - 2) {
        st.send_peer = right;
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    return DDP_SUCCESS;
}

/* Broadcast: the binomial tree on dissemination's frames up to DDP__BROADCAST_TREE_MAX_BYTES
   (latency-bound: ceil(log2 n) steps), the pipelined chain above (bandwidth-bound). Like all_reduce's
   threshold, the choice depends only on the fingerprint and the world size, and is no setting. */
static ddp_result ddp__do_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    size_t bytes = count * ddp_dtype_size(t);
    if (bytes <= DDP__BROADCAST_TREE_MAX_BYTES) return ddp__dissemination(g, c, (char *)buf, bytes, root);
    return ddp__chain_broadcast(g, c, buf, bytes, root);
}

/* ---- Bruck's all_gather (Bruck et al. 1997; MPICH's MPIR_Allgather_intra_brucks), for all_gather up
   to DDP__ALLGATHER_BRUCK_MAX_BYTES in all ----

   A rank gathers the blocks of the ranks before it, in a work buffer of n blocks filled from its end:
   its own block goes last (slot n-1), and after the round with distance d it holds the 2d blocks of
   ranks rank-2d+1 .. rank in slots n-2d .. n-1. In the round with distance d = 1, 2, 4 ... (d <= n/2)
   every rank sends its d blocks to rank + d and receives rank - d's d blocks (ranks rank-2d+1 ..
   rank-d) into the d slots before them; when n is no power of two a last round with d = p (the largest
   power of two <= n) moves the rem = n - p blocks still missing (the sender's last rem slots, received
   into slots 0 .. rem-1):

       n = 5, rank 3     slots 0 1 2 3 4      (r-k: rank 3-k's block)
       start                     . . . . 3
       d = 1, from 2             . . . 2 3
       d = 2, from 1             . 0 1 2 3
       d = 4 (rem 1), from 4     4 0 1 2 3    then rotate: slot s holds rank (rank + 1 + s) mod n

   ceil(log2 n) rounds, the peers those of dissemination (rank + 2^k, so a barrier's connections serve
   too), each rank sending n-1 blocks in all as in the ring (n-1 rounds of one block). Two copies of the
   result's bytes are the price (into the work buffer, and the rotation out of it), so the ring stays
   above the threshold. Every rank sends in round 0 before it waits, and its finish depends on every
   rank's block (each reaches it through a chain of frames), as the top comment needs.
   The threshold is measured (bench/README.md, DDP_TRANSPORT=tcp on loopback, Bruck's against the ring
   at one revision): Bruck's took 0.75-0.9x the ring's time up to 32 KiB gathered on 4 ranks, 0.55-0.7x
   up to 64 KiB on 8, 0.3-0.4x on 16; the ring won from 128 KiB on 4 ranks, 256 KiB on 8, 1 MiB on 16
   (MPICH's own line is 80 KiB). On 2 ranks both are one and the same exchange, and the ring saves
   the copies. Like the other thresholds it is no setting. */
static ddp_result ddp__bruck_all_gather(ddp_group *g, const ddp__coll *c, const void *send, char *recv, size_t cpr,
                                        size_t es) {
    int n = g->world_size, r = g->rank, d, head;
    size_t block = cpr * es, total = block * (size_t)n;
    char *work = (char *)ddp__scratch(g, total);
    ddp_result res;
    if (!work && total) return ddp__no_memory(g, total);
    if (block) memcpy(work + (size_t)(n - 1) * block, send, block);
    for (d = 1; d < n; d *= 2) {
        /* we and rank - d hold d blocks each; we miss n - d (fewer than d only in the last round) */
        int blocks = DDP__MIN(d, n - d);
        const char *out = work + (size_t)(n - blocks) * block; /* the sender's last `blocks` slots */
        char *in = work + (size_t)(n - d - blocks) * block;     /* just before the d we hold */
        if ((res = ddp__send_recv(g, c, ddp__mod(r + d, n), out, (size_t)blocks * block, ddp__mod(r - d, n), in,
                                  (size_t)blocks * block)) != DDP_SUCCESS)
            return res;
    }
    /* slot s holds rank (r + 1 + s) mod n: slots 0 .. n-r-2 are ranks r+1 .. n-1, the rest 0 .. r */
    head = n - r - 1;
    if (total) {
        memcpy(recv + (size_t)(r + 1) * block, work, (size_t)head * block);
        memcpy(recv, work + (size_t)head * block, (size_t)(r + 1) * block);
    }
    return DDP_SUCCESS;
}

/* all_gather: Bruck's in ceil(log2 n) steps up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered (latency-bound:
   ddp_init's set-up gathers are this size) on more than 2 ranks, else our part in place in recv and the
   ring with chunks of count_per_rank. The choice depends only on the fingerprint and the world size,
   like all_reduce's. */
static ddp_result ddp__do_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    size_t es = ddp_dtype_size(t);
    char *mine = (char *)recv + (size_t)g->rank * cpr * es;
    if (g->world_size > 2 && cpr * es * (size_t)g->world_size <= DDP__ALLGATHER_BRUCK_MAX_BYTES)
        return ddp__bruck_all_gather(g, c, send, (char *)recv, cpr, es);
    if (cpr && (const char *)send != mine) memmove(mine, send, cpr * es);
    return ddp__ring_all_gather(g, c, (char *)recv, cpr * (size_t)g->world_size, es);
}

/* reduce_scatter: reduce-scatter a copy of send (send is const and may alias recv), keep our chunk. */
static ddp_result ddp__do_reduce_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                         ddp_dtype t, ddp_op op) {
    size_t es = ddp_dtype_size(t), total = cpr * (size_t)g->world_size;
    char *mem = (char *)ddp__scratch(g, (cpr + total) * es), *work;
    ddp_result r;
    if (!mem && total) return ddp__no_memory(g, (cpr + total) * es);
    work = mem + cpr * es; /* the reduce-scatter receives into the first cpr elements of the scratch */
    if (total) memcpy(work, send, total * es);
    if ((r = ddp__ring_reduce_scatter(g, c, work, total, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, work, total, t, op);
    if (cpr) memcpy(recv, work + (size_t)g->rank * cpr * es, cpr * es);
    return DDP_SUCCESS;
}

/* barrier: dissemination with empty frames; each rank finishes only after hearing (through a chain
   of frames) from every other rank, in ceil(log2 n) steps. */
static ddp_result ddp__do_barrier(ddp_group *g, const ddp__coll *c) { return ddp__dissemination(g, c, NULL, 0, 0); }

/* ---- gather and scatter: binomial trees (MPICH's), after an agreement ----

   The data moves on the binomial tree of the root over the positions pos = (rank - root) mod n: a rank
   at pos holds the blocks of positions pos .. pos + m - 1, m being the lowest set bit of pos (all n at
   the root). gather: in the round with distance d = 1, 2, 4 ..., a rank whose pos has bit d sends what
   it holds to pos - d and is done; the others receive pos + d's blocks behind their own. scatter runs
   the same tree the other way, largest distance first. Cost: ceil(log2 n) rounds, the root's link
   carrying (n-1) blocks as in a linear algorithm; a rank forwards at most its subtree.

   The tree alone would break the top comment's two points: in a gather, a leaf finishes as soon as it
   has sent, and ranks that disagree about the root could all wait on a parent that never sends. So
   both first run an agreement on the call (dissemination with empty frames, as barrier: every rank
   sends before it waits, and none finishes before every rank has entered the same call, root and
   count included). Past it nothing can differ: the sizes follow from the fingerprint. */
static ddp_result ddp__agree(ddp_group *g, const ddp__coll *c) { return ddp__dissemination(g, c, NULL, 0, 0); }

/* Blocks held by the rank at position pos in a binomial tree over n positions (the root's subtree is all). */
static int ddp__tree_blocks(int pos, int n) { return pos == 0 ? n : DDP__MIN(pos & -pos, n - pos); }

/* Relative order (block i is rank (root + i) mod n) <-> rank order, between two buffers of n blocks. */
static void ddp__rotate_blocks(char *dst, const char *src, int root, int n, size_t block, int to_rank_order) {
    size_t head = (size_t)(n - root) * block, tail = (size_t)root * block; /* ranks root .. n-1, then 0 .. root-1 */
    if (to_rank_order) {
        memcpy(dst + tail, src, head);
        memcpy(dst, src + head, tail);
    } else {
        memcpy(dst, src + tail, head);
        memcpy(dst + head, src, tail);
    }
}

static ddp_result ddp__do_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count, ddp_dtype t,
                                 int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n), have = 1, d;
    size_t block = count * ddp_dtype_size(t), need = (size_t)ddp__tree_blocks(pos, n) * block;
    char *work = pos == 0 && root == 0 ? (char *)recv : (char *)ddp__scratch(g, need);
    ddp_result r;
    if (!work && need) return ddp__no_memory(g, need);
    if ((r = ddp__agree(g, c)) != DDP_SUCCESS) return r;
    if (block && work != (const char *)send) memmove(work, send, block); /* in place on root 0: already there */
    for (d = 1; d < n; d *= 2) {
        if (pos & d) return ddp__send_recv(g, c, ddp__mod(pos - d + root, n), work, (size_t)have * block, -1, NULL, 0);
        if (pos + d < n) {
            int blocks = DDP__MIN(d, n - pos - d);
            if ((r = ddp__send_recv(g, c, -1, NULL, 0, ddp__mod(pos + d + root, n), work + (size_t)have * block,
                                    (size_t)blocks * block)) != DDP_SUCCESS)
                return r;
            have += blocks;
        }
    }
    if (work != (char *)recv && block) ddp__rotate_blocks((char *)recv, work, root, n, block, 1);
    return DDP_SUCCESS;
}

static ddp_result ddp__do_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count, ddp_dtype t,
                                  int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n), blocks = ddp__tree_blocks(pos, n), d;
    size_t block = count * ddp_dtype_size(t), need = (size_t)blocks * block;
    const char *work = (const char *)send;
    ddp_result r;
    if (pos != 0 || root != 0) { /* the root other than 0 reorders; the others receive their subtree's blocks */
        char *tmp = blocks == 1 ? (char *)recv : (char *)ddp__scratch(g, need);
        if (!tmp && need) return ddp__no_memory(g, need);
        if (pos == 0 && block) ddp__rotate_blocks(tmp, (const char *)send, root, n, block, 0);
        work = tmp;
    }
    if ((r = ddp__agree(g, c)) != DDP_SUCCESS) return r;
    if (pos != 0) {
        int up = pos & -pos;
        if ((r = ddp__send_recv(g, c, -1, NULL, 0, ddp__mod(pos - up + root, n), (void *)work, need)) != DDP_SUCCESS) return r;
    }
    for (d = 1; d < blocks; d *= 2) /* the largest distance below the subtree's size first */
        ;
    for (d /= 2; d >= 1; d /= 2) { /* the child at pos + d (< n: d < blocks <= n - pos) */
        if ((r = ddp__send_recv(g, c, ddp__mod(pos + d + root, n), work + (size_t)d * block,
                                (size_t)DDP__MIN(d, n - pos - d) * block, -1, NULL, 0)) != DDP_SUCCESS)
            return r;
    }
    if (block && work != (const char *)recv) memmove(recv, work, block); /* in place on root 0: already there */
    return DDP_SUCCESS;
}

/* ---- all_to_all, all_to_all_v, all_gather_v ----

   all_to_all: pairwise exchange (MPICH's and Gloo's for large messages): in step k = 1 .. n-1 rank r
   sends its block for r + k and receives the block of r - k. Every rank sends before it waits and hears
   from every other rank directly, so the top comment's points hold without more. Only the peers of a
   rank's own steps are dialed: all n - 1 of them, as all_to_all needs.
   all_to_all_v runs the same steps with each pair's own sizes. The sizes are the one thing the
   fingerprint cannot carry (they differ by rank), so each frame's size is checked by its receiver
   against its recv_counts (transport.c: DDP_ERR_MISMATCH naming both), and an agreement ends the
   call: a rank that found a wrong size broke the group before it, so nobody finishes. all_gather_v
   moves rank r's counts[r] elements around the ring (n - 1 steps, each block passing every link once),
   then agrees the same way (the fingerprint carries the sum of the counts, not each one). */

/* Where each of n blocks of the given sizes starts, as elements (n + 1 entries; NULL when out of memory). */
static size_t *ddp__displacements(const size_t *counts, int n) {
    size_t *at = (size_t *)ddp__malloc(((size_t)n + 1) * sizeof *at);
    int i;
    if (!at) return NULL;
    at[0] = 0;
    for (i = 0; i < n; i++) at[i + 1] = at[i] + counts[i]; /* validated: the sums fit */
    return at;
}

/* The pairwise steps; send_at / recv_at NULL: blocks of `count` elements. */
static ddp_result ddp__pairwise(ddp_group *g, const ddp__coll *c, const char *send, const size_t *send_at, char *recv,
                                const size_t *recv_at, size_t count, size_t es) {
    int n = g->world_size, r = g->rank, k;
    for (k = 1; k < n; k++) {
        int to = ddp__mod(r + k, n), from = ddp__mod(r - k, n);
        size_t so = send_at ? send_at[to] : (size_t)to * count, sn = send_at ? send_at[to + 1] - send_at[to] : count;
        size_t ro = recv_at ? recv_at[from] : (size_t)from * count, rn = recv_at ? recv_at[from + 1] - recv_at[from] : count;
        ddp_result res = ddp__send_recv(g, c, to, send + so * es, sn * es, from, recv + ro * es, rn * es);
        if (res) return res;
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__do_all_to_all(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count,
                                     ddp_dtype t) {
    size_t es = ddp_dtype_size(t), block = count * es, all = block * (size_t)g->world_size;
    const char *from = (const char *)send;
    if (from < (const char *)recv + all && (const char *)recv < from + all && all) { /* in place: send a copy */
        char *copy = (char *)ddp__scratch(g, all);
        if (!copy) return ddp__no_memory(g, all);
        memcpy(copy, send, all);
        from = copy;
    }
    if (block && from + (size_t)g->rank * block != (const char *)recv + (size_t)g->rank * block)
        memcpy((char *)recv + (size_t)g->rank * block, from + (size_t)g->rank * block, block);
    return ddp__pairwise(g, c, from, NULL, (char *)recv, NULL, count, es);
}

static ddp_result ddp__do_all_to_all_v(ddp_group *g, const ddp__coll *c, const void *send, const size_t *send_counts,
                                       void *recv, const size_t *recv_counts, ddp_dtype t) {
    size_t es = ddp_dtype_size(t), *send_at = ddp__displacements(send_counts, g->world_size);
    size_t *recv_at = ddp__displacements(recv_counts, g->world_size);
    int r = g->rank;
    ddp_result res = DDP_SUCCESS;
    if (!send_at || !recv_at) {
        res = ddp__no_memory(g, 2 * ((size_t)g->world_size + 1) * sizeof(size_t));
    } else {
        if (send_counts[r]) memmove((char *)recv + recv_at[r] * es, (const char *)send + send_at[r] * es, send_counts[r] * es);
        if ((res = ddp__pairwise(g, c, (const char *)send, send_at, (char *)recv, recv_at, 0, es)) == DDP_SUCCESS)
            res = ddp__agree(g, c);
    }
    ddp__free(send_at);
    ddp__free(recv_at);
    return res;
}

static ddp_result ddp__do_all_gather_v(ddp_group *g, const ddp__coll *c, const void *send, void *recv, const size_t *counts,
                                       ddp_dtype t) {
    int n = g->world_size, r = g->rank, s;
    size_t es = ddp_dtype_size(t), *at = ddp__displacements(counts, n);
    char *out = (char *)recv;
    ddp_result res = DDP_SUCCESS;
    if (!at) return ddp__no_memory(g, ((size_t)n + 1) * sizeof *at);
    if (counts[r] && (const char *)send != out + at[r] * es) memmove(out + at[r] * es, send, counts[r] * es);
    for (s = 0; s < n - 1 && res == DDP_SUCCESS; s++) {
        int give = ddp__mod(r - s, n), take = ddp__mod(r - s - 1, n);
        res = ddp__send_recv(g, c, ddp__mod(r + 1, n), out + at[give] * es, counts[give] * es, ddp__mod(r - 1, n),
                             out + at[take] * es, counts[take] * es);
    }
    ddp__free(at);
    return res == DDP_SUCCESS ? ddp__agree(g, c) : res;
}

/* ---- monitored_barrier (torch's, over Gloo: rank 0 hears from every rank, then answers each) ----
   Every other rank sends rank 0 an empty frame and waits for its answer. Rank 0 takes the frames rank
   by rank until timeout_seconds have passed; after that a rank whose frame is not already there
   counts as missing. None missing: rank 0 answers every rank (they return). Some missing: rank 0 fails
   naming them all, and breaking the group sends its message to every rank connected to it: all that
   arrived (they dialed it to report). The others wait the timeout and the group's timeout beyond it. */
static ddp_result ddp__do_monitored_barrier(ddp_group *g, const ddp__coll *c, double seconds) {
    int n = g->world_size, j, missing = 0, unlisted = 0;
    double wait = seconds > 0 ? seconds : g->timeout, until = ddp__now() + wait;
    char list[DDP__ERR_MAX / 2] = "", name[DDP__PEER_NAME_MAX], more[48] = "";
    ddp__step st;
    ddp_result r;
    memset(&st, 0, sizeof st);
    st.send_peer = st.recv_peer = -1;
    if (g->rank != 0) {
        if ((r = ddp__send_recv(g, c, 0, NULL, 0, -1, NULL, 0)) != DDP_SUCCESS) return r;
        st.recv_peer = 0;
        st.deadline = ddp__now() + wait + g->timeout;
        return ddp__exchange(g, c, &st);
    }
    for (j = 1; j < n; j++) {
        st.recv_peer = j;
        st.deadline = DDP__MAX(until, ddp__now() + (g->mesh.peers[j].fd >= 0 ? 0.01 : 0));
        st.soft = 1;
        r = ddp__exchange(g, c, &st);
        if (r == DDP_ERR_TIMEOUT && !g->broken) { /* name as many as fit, then count the rest */
            size_t len = strlen(list);
            if (len + 100 < sizeof list)
                snprintf(list + len, sizeof list - len, "%s%d (%.80s)", missing ? ", " : "", j,
                         ddp__peer_name(g, j, name, sizeof name));
            else
                unlisted++;
            missing++;
        } else if (r) {
            return r;
        }
    }
    if (unlisted) snprintf(more, sizeof more, " and %d more", unlisted);
    if (missing)
        return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "monitored_barrier: %d of %d ranks did not arrive within %.3g s: rank%s "
                              "%s%s. Every rank must call it; look at what those ranks were doing (DDP_TRACE_DIR, "
                              "ddprun's summary)", missing, n, wait, missing > 1 ? "s" : "", list, more);
    for (j = 1; j < n; j++)
        if ((r = ddp__send_recv(g, c, j, NULL, 0, -1, NULL, 0)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

/* ---- the backend ---- */

static ddp_result ddp__tcp_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__do_all_reduce(g, c, k->buf, k->count, k->dtype, k->op);
    case DDP__BROADCAST: return ddp__do_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__REDUCE: return ddp__do_reduce(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__ALL_GATHER: return ddp__do_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__do_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    case DDP__BARRIER: return ddp__do_barrier(g, c);
    case DDP__GATHER: return ddp__do_gather(g, c, k->send, k->buf, k->count, k->dtype, k->root);
    case DDP__SCATTER: return ddp__do_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->root);
    case DDP__ALL_TO_ALL: return ddp__do_all_to_all(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__ALL_TO_ALL_V: return ddp__do_all_to_all_v(g, c, k->send, k->send_counts, k->buf, k->recv_counts, k->dtype);
    case DDP__ALL_GATHER_V: return ddp__do_all_gather_v(g, c, k->send, k->buf, k->recv_counts, k->dtype);
    case DDP__MONITORED_BARRIER: return ddp__do_monitored_barrier(g, c, k->seconds);
    default: return ddp__coll_fail(g, DDP_ERR_STATE, "internal error: unknown collective %d", (int)k->kind);
    }
}

static void ddp__tcp_backend_close(ddp_group *g, int orderly) { (void)g, (void)orderly; } /* the mesh is group.c's */

/* Every group starts on it (set-up runs over the mesh) and keeps it when its ranks share no host. */
static const ddp__backend ddp__backend_tcp = {
    "tcp", "cpu", ddp__tcp_run, NULL, NULL, NULL, ddp__tcp_backend_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out};

/* A single rank has nobody to talk to: only the data movement of the collective remains. */
static ddp_result ddp__alone_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    (void)g, (void)c;
    if (k->kind == DDP__ALL_TO_ALL_V) bytes = k->send_counts[0] * ddp_dtype_size(k->dtype); /* = recv_counts[0] */
    switch (k->kind) {
    case DDP__ALL_GATHER:
    case DDP__REDUCE_SCATTER:
    case DDP__GATHER:
    case DDP__SCATTER:
    case DDP__ALL_TO_ALL:
    case DDP__ALL_TO_ALL_V:
    case DDP__ALL_GATHER_V:
        if (bytes && k->send != k->buf) memmove(k->buf, k->send, bytes);
        break;
    default: break;
    }
    return DDP_SUCCESS;
}

static void ddp__alone_close(ddp_group *g, int orderly) { (void)g, (void)orderly; }

/* A group of one rank: no mesh. */
static const ddp__backend ddp__backend_alone = {
    "alone", "cpu", ddp__alone_run, NULL, NULL, NULL, ddp__alone_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out};

static const ddp__backend *ddp__initial_backend(int world_size) {
    return world_size > 1 ? &ddp__backend_tcp : &ddp__backend_alone;
}

/* ---- set-up collectives over the mesh (ddp__collective_on with this backend) ---- */

static ddp_result ddp__mesh_all_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count, t, DDP_SUM, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_barrier(ddp_group *g) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
/* ==================== end src/tcp.c ==================== */

/* ==================== begin src/alloc.c ==================== */
/* [SECTION] alloc: ddp_alloc / ddp_free, library buffers that collectives use in place
   On a group whose ranks share one host, every rank maps one shared segment (shm.c), which ends with
   an arena per rank: address space reserved for ddp_alloc, taking memory only where blocks are handed
   out. A buffer in an arena can be read and written by every rank of the group, so collectives on it
   need no staging copies (shm.c's single-copy algorithms ask ddp__lib_offset whether a buffer is one).
   Elsewhere, or when the arena is full, ddp_alloc gives plain aligned heap memory.

   This rank's arena is carved into page-multiple blocks, listed in offset order: first fit, else the
   top grows. A block's pages are reserved with fallocate when it is handed out (a full /dev/shm then
   means plain memory instead of SIGBUS later) and punched out when it is freed, so a block always
   starts zero-filled and freed memory goes back to the system. One spin lock (g->lib.lock) guards the
   block list and the heap list: ddp_alloc and ddp_free may be called from any thread. */

#include <sys/statvfs.h>

static void ddp__lib_lock(ddp_group *g) {
    while (__atomic_exchange_n(&g->lib.lock, 1, __ATOMIC_ACQUIRE)) sched_yield();
}
static void ddp__lib_unlock(ddp_group *g) { __atomic_store_n(&g->lib.lock, 0, __ATOMIC_RELEASE); }

/* The index of the arena block holding offset off (the blocks cover [0, top)); -1 when off >= top. */
static long ddp__block_find(const ddp__arena *a, size_t off) {
    size_t lo = 0, hi = a->nblocks;
    if (off >= a->top) return -1;
    while (hi - lo > 1) { /* the last block whose start is <= off */
        size_t mid = lo + (hi - lo) / 2;
        if (a->blocks[mid].off <= off)
            lo = mid;
        else
            hi = mid;
    }
    return (long)lo;
}

/* The arena offset of [p, p + bytes) when it lies inside one live block of this rank's arena. */
static uint64_t ddp__lib_offset(ddp_group *g, const void *p, size_t bytes) {
    ddp__arena *a = g->lib.arena;
    uint64_t off = DDP__SHM_NOT_LIB;
    long i;
    size_t at;
    if (!a || !a->base) return off;
    at = (size_t)((uintptr_t)p - (uintptr_t)(a->base + (size_t)g->rank * a->bytes));
    if ((uintptr_t)p < (uintptr_t)a->base || at >= a->bytes) return off;
    ddp__lib_lock(g);
    i = ddp__block_find(a, at);
    if (i >= 0 && a->blocks[i].state == 1 && bytes <= a->blocks[i].off + a->blocks[i].size - at) off = at;
    ddp__lib_unlock(g);
    return off;
}

/* Each rank's arena (rank 0 decides): DDP_SHM_ARENA_BYTES, else what /dev/shm can hold (the machine's
   memory when /dev/shm is unlimited), at most 64 GiB, and at most 8 TiB of address space over all ranks
   (every rank maps every arena). Only address space: pages are taken as blocks are allocated. */
static size_t ddp__arena_size(ddp_group *g, int fd) {
    char err[DDP__ERR_MAX];
    long v = 0;
    struct statvfs st;
    uint64_t want = 0, cap = DDP__MIN((uint64_t)64 << 30, ((uint64_t)8 << 40) / (uint64_t)g->world_size);
    int k = ddp__env_int("DDP_SHM_ARENA_BYTES", 0, (long)((uint64_t)1 << 46), &v, err);
    if (k < 0) ddp__log(g, DDP_LOG_WARN, "%s; using the default arena size", err);
    if (k > 0) return (size_t)((uint64_t)v & ~(uint64_t)(DDP__LIB_PAGE - 1));
    if (fstatvfs(fd, &st) == 0) want = (uint64_t)st.f_blocks * (uint64_t)st.f_frsize;
    if (want == 0) want = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    want = DDP__MIN(want, cap);
    if (want > (uint64_t)(SIZE_MAX / 4)) want = (uint64_t)(SIZE_MAX / 4);
    return (size_t)(want & ~(uint64_t)(DDP__ARENA_ALIGN - 1));
}


/* ---- the arena's block list ---- */

/* Insert a block before index i of this rank's list. 0 when out of memory. */
static int ddp__block_insert(ddp__arena *a, size_t i, size_t off, size_t size, int state) {
    if (a->nblocks == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 16;
        ddp__block *b = (ddp__block *)ddp__malloc(cap * sizeof *b);
        if (!b) return 0;
        if (a->nblocks) memcpy(b, a->blocks, a->nblocks * sizeof *b);
        ddp__free(a->blocks);
        a->blocks = b;
        a->cap = cap;
    }
    memmove(a->blocks + i + 1, a->blocks + i, (a->nblocks - i) * sizeof *a->blocks);
    a->blocks[i].off = off;
    a->blocks[i].size = size;
    a->blocks[i].state = state;
    a->nblocks++;
    return 1;
}

static void ddp__block_remove(ddp__arena *a, size_t i) {
    memmove(a->blocks + i, a->blocks + i + 1, (a->nblocks - i - 1) * sizeof *a->blocks);
    a->nblocks--;
}

/* Mark block i free and merge it with free neighbours; a free block at the end goes back above top. */
static void ddp__block_release(ddp__arena *a, size_t i) {
    a->blocks[i].state = 0;
    if (i + 1 < a->nblocks && a->blocks[i + 1].state == 0) {
        a->blocks[i].size += a->blocks[i + 1].size;
        ddp__block_remove(a, i + 1);
    }
    if (i > 0 && a->blocks[i - 1].state == 0) {
        a->blocks[i - 1].size += a->blocks[i].size;
        ddp__block_remove(a, i--);
    }
    if (i + 1 == a->nblocks) {
        a->top = a->blocks[i].off;
        ddp__block_remove(a, i);
    }
}

/* Take need bytes (whole pages) of this rank's arena: the block's offset, or -1 when there is no room. */
static long ddp__block_take(ddp__arena *a, size_t need) {
    size_t i, off;
    for (i = 0; i < a->nblocks; i++) {
        if (a->blocks[i].state != 0 || a->blocks[i].size < need) continue;
        if (a->blocks[i].size > need && !ddp__block_insert(a, i + 1, a->blocks[i].off + need, a->blocks[i].size - need, 0))
            return -1;
        a->blocks[i].size = need;
        a->blocks[i].state = 1;
        return (long)a->blocks[i].off;
    }
    if (need > a->bytes - a->top || !ddp__block_insert(a, a->nblocks, a->top, need, 1)) return -1;
    off = a->top;
    a->top += need;
    return (long)off;
}

static void *ddp__arena_alloc(ddp_group *g, size_t bytes) {
    ddp__arena *a = g->lib.arena;
    size_t need = (DDP__MAX(bytes, (size_t)1) + DDP__LIB_PAGE - 1) & ~(DDP__LIB_PAGE - 1);
    char *mine;
    long off;
    int err;
    if (!a || !a->base) return NULL;
    mine = a->base + (size_t)g->rank * a->bytes;
    ddp__lib_lock(g);
    off = ddp__block_take(a, need);
    ddp__lib_unlock(g);
    if (off < 0) return NULL;
    err = posix_fallocate(a->fd, a->file_off + (off_t)((size_t)g->rank * a->bytes + (size_t)off), (off_t)need);
    if (err != 0) {
        ddp__log(g, DDP_LOG_INFO, "ddp_alloc: cannot reserve %zu bytes of shared memory (%s): plain memory instead, "
                 "which collectives stage through the segment", need, strerror(err));
        ddp__lib_lock(g);
        ddp__block_release(a, (size_t)ddp__block_find(a, (size_t)off));
        ddp__lib_unlock(g);
        return NULL;
    }
    return mine + off;
}

/* 1 when p was a live block of this rank's arena (now freed), 0 when it is not one. */
static int ddp__arena_free(ddp_group *g, void *p) {
    ddp__arena *a = g->lib.arena;
    size_t at, size;
    off_t file_at;
    long i;
    if (!a || !a->base || (uintptr_t)p < (uintptr_t)(a->base + (size_t)g->rank * a->bytes)) return 0;
    at = (size_t)((uintptr_t)p - (uintptr_t)(a->base + (size_t)g->rank * a->bytes));
    if (at >= a->bytes) return 0;
    ddp__lib_lock(g);
    i = ddp__block_find(a, at);
    if (i < 0 || a->blocks[i].off != at || a->blocks[i].state != 1) {
        ddp__lib_unlock(g);
        return 0;
    }
    a->blocks[i].state = 2; /* being freed: neither handed out again nor freed twice meanwhile */
    size = a->blocks[i].size;
    ddp__lib_unlock(g);
    /* give the pages back; should the file system refuse, zero them so the next block starts zero-filled */
    file_at = a->file_off + (off_t)((size_t)g->rank * a->bytes + at);
    if (fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, file_at, (off_t)size) != 0) memset(p, 0, size);
    ddp__lib_lock(g);
    ddp__block_release(a, (size_t)ddp__block_find(a, at));
    ddp__lib_unlock(g);
    return 1;
}

static void *ddp__heap_alloc(ddp_group *g, size_t bytes) {
    char *raw = (char *)ddp__malloc(bytes + 63), *user;
    int ok = 1;
    if (!raw) return NULL;
    user = (char *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
    if (bytes) memset(user, 0, bytes);
    ddp__lib_lock(g);
    if (g->lib.heap_n == g->lib.heap_cap) {
        size_t cap = g->lib.heap_cap ? 2 * g->lib.heap_cap : 16;
        ddp__heap_block *b = (ddp__heap_block *)ddp__malloc(cap * sizeof *b);
        if (b) {
            if (g->lib.heap_n) memcpy(b, g->lib.heap, g->lib.heap_n * sizeof *b);
            ddp__free(g->lib.heap);
            g->lib.heap = b;
            g->lib.heap_cap = cap;
        } else {
            ok = 0;
        }
    }
    if (ok) {
        g->lib.heap[g->lib.heap_n].user = user;
        g->lib.heap[g->lib.heap_n++].raw = raw;
    }
    ddp__lib_unlock(g);
    if (!ok) ddp__free(raw);
    return ok ? user : NULL;
}

/* 1 when p was a live heap block (now freed), 0 when it is not one. */
static int ddp__heap_free(ddp_group *g, void *p) {
    void *raw = NULL;
    size_t i;
    ddp__lib_lock(g);
    for (i = 0; i < g->lib.heap_n && !raw; i++)
        if (g->lib.heap[i].user == p) {
            raw = g->lib.heap[i].raw;
            g->lib.heap[i] = g->lib.heap[--g->lib.heap_n];
        }
    ddp__lib_unlock(g);
    ddp__free(raw);
    return raw != NULL;
}

DDP_API void *ddp_alloc(ddp_group *g, size_t bytes) {
    void *p;
    if (ddp__group_check(g, "ddp_alloc") != DDP_SUCCESS) return NULL;
    if (bytes > SIZE_MAX / 4) {
        ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_alloc: %zu bytes is more than any machine can hold", bytes);
        return NULL;
    }
    if ((p = ddp__arena_alloc(g, bytes)) == NULL && (p = ddp__heap_alloc(g, bytes)) == NULL)
        ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_alloc: out of memory for %zu bytes", bytes);
    return p;
}

DDP_API void ddp_free(ddp_group *g, void *p) {
    char msg[DDP__ERR_MAX];
    if (!p) return;
    if (!g) {
        ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_free: the group is NULL; pass the group the memory came from");
        return;
    }
    if (ddp__group_check(g, "ddp_free") != DDP_SUCCESS) return; /* its blocks went with it */
    if (ddp__arena_free(g, p) || ddp__heap_free(g, p)) return;
    snprintf(msg, sizeof msg, "ddp_free: %p is not a live block from ddp_alloc on this group (rank %d): freed already, "
             "allocated on another group, or not from ddp_alloc; it was left alone", p, g->rank);
    ddp__log(g, DDP_LOG_ERROR, "%s", msg);
    ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s", msg);
}

static void ddp__lib_free_all(ddp_group *g) {
    size_t i;
    for (i = 0; i < g->lib.heap_n; i++) ddp__free(g->lib.heap[i].raw);
    ddp__free(g->lib.heap);
    g->lib.heap = NULL;
    g->lib.heap_n = g->lib.heap_cap = 0;
}
/* ==================== end src/alloc.c ==================== */

/* ==================== begin src/shm.c ==================== */
/* [SECTION] shm: shared-memory transport for the ranks of a group that share one host
   When every rank of a group runs on one host (same hostname, boot and network namespace), the ranks
   map one shared segment and the collectives move data through it instead of TCP. The TCP mesh stays
   up beside it: it carries the ABORT frames and shows a dead peer (its sockets close).

   Segment: a header, one control block per rank, per rank a staging area in two halves, then per
   rank an arena for ddp_alloc (sparse: it takes memory only where blocks are allocated).

       | header | ctl 0 | ... | rank 0: half 0 | half 1 | ... | arena 0 | arena 1 | ... | arena n-1 |

   Every algorithm is a sequence of steps numbered by the group (g->shm_step), the same on every rank.
   A step: write my part into my half (step % 2), publish `posted = step`, wait until every rank has
   posted step, read what I need. Two halves are enough: a rank starts writing half h for step t only
   after all ranks posted t-1, and each rank posted t-1 only after it had finished reading step t-2,
   the last user of half h. The first step of each collective also compares every rank's fingerprint
   (seq, collective, dtype, op, root, count), so a mismatch fails every rank inside the same call.

   all_reduce, small messages (one-shot): copy in, one step, every rank reduces all n inputs itself.
   all_reduce, large (two-shot, in rounds small enough to stay in cache from copy-in to copy-out):
   copy in every segment but my own; reduce my own 1/n segment over all inputs in my own buffer and
   copy it to my half; publish `reduced = step`; wait; copy the other segments out. Memory traffic
   for N bytes on p ranks: (5p-1)N, against 2pN for the floor. reduce (to a root) does the same in
   the halves, since the other ranks' buffers must stay as they were.

   Single-copy (library buffers, above the one-shot size): every rank's first step publishes, with
   its fingerprint, where its buffer is in its arena (or that it is not in one). When all are, no data
   is staged. all_reduce: rank i owns slice i of the buffer; it reduces slice i out of every rank's
   buffer into its own, one L1-sized chunk at a time, and copies each finished chunk straight into
   slice i of every other rank's buffer; a last step keeps every rank in the call until all have
   finished. Every input is read once and every output written once: 2pN traffic, the floor.
   No hazard: slice i of every buffer is read and written by rank i alone, and the program gets its
   buffer back only after the last step. When some ranks' buffers are library buffers and some not,
   the first step carried no data from the former: every rank stages from the next step on (same
   decision everywhere, read from the same published offsets). broadcast needs only the root's buffer
   in its arena; all_gather needs every rank's send buffer there.

   Single-copy on plain memory (all_reduce from DDP__SHM_CMA_MIN_BYTES up): Linux Cross-Memory Attach
   (process_vm_readv/writev, as Open MPI's shared-memory BTL uses) reaches a peer's own address space.
   The first step then publishes every rank's buffer address too, and the same slice-ownership
   algorithm runs: rank i reads slice i of a peer's buffer in L2-sized chunks into a scratch chunk
   (one system call moves a chunk), reduces it into its own buffer and writes the finished chunk into
   every peer's buffer; peers whose buffer is a library buffer are reached through the arena as above.
   Traffic: 2pN plus the scratch chunk, which stays in cache. Availability is probed once at set-up
   (each rank reads a word from every peer and checks its value); seccomp filters (Docker's default
   profile) or Yama ptrace_scope >= 1 refuse it, and then the group stages as before. This library does
   not call prctl(PR_SET_PTRACER) to get around Yama: that would let any process of the same user
   ptrace the program. DDP_SHM_CMA=0 on any rank turns it off for the group. A transfer that fails in
   the middle of a collective (the peer died: ESRCH) fails the collective with DDP_ERR_PEER_LOST.

   Waiting: spin a little (the peer is usually a few hundred nanoseconds away; 256 pauses, or only 16
   when the host has more of the group's ranks than CPUs, where the peer being waited for is likely
   queued behind this very rank), then yield for up to a millisecond (a peer on the same core runs at
   once), then sleep on a futex in the header; posters
   wake sleepers only when someone sleeps, so the fast path makes no system call. While sleeping a
   rank wakes every millisecond to check the TCP mesh for a lost or aborting peer and its deadline. */

#include <linux/futex.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#if defined(__GLIBC__) && !defined(__USE_GNU) /* <sys/uio.h> read without _GNU_SOURCE (see internal.h) */
extern ssize_t process_vm_readv(pid_t pid, const struct iovec *lvec, unsigned long int liovcnt,
                                const struct iovec *rvec, unsigned long int riovcnt, unsigned long int flags);
extern ssize_t process_vm_writev(pid_t pid, const struct iovec *lvec, unsigned long int liovcnt,
                                 const struct iovec *rvec, unsigned long int riovcnt, unsigned long int flags);
#endif

#define DDP__SHM_MAGIC 0x53504444u /* "DDPS" */

typedef struct ddp__shm_header {
    uint32_t magic;
    int32_t world;
    uint64_t half_bytes;
    uint32_t wake;     /* futex word: bumped by every post */
    uint32_t sleepers; /* ranks sleeping on wake */
    uint32_t pad0;
    uint64_t aborted;  /* seq of the collective in which a rank broke the group (0: none); its ABORT frame follows over TCP */
    char pad[24];
} ddp__shm_header;

typedef struct ddp__shm_ctl {
    uint64_t posted;  /* last step whose data this rank has placed */
    uint64_t reduced; /* last step whose reduced segment this rank has placed (two-shot) */
    struct {          /* the fingerprint of this rank's collective, by seq parity */
        uint64_t seq, count;
        uint64_t lib;  /* arena offset of this rank's buffer, or DDP__SHM_NOT_LIB */
        uint64_t addr; /* its address in this rank's own address space, for CMA (0: not published) */
        int32_t root;
        uint8_t kind, dtype, op, pad;
    } fp[2];
    char pad[32];
} ddp__shm_ctl;


struct ddp__shm {
    void *base;
    size_t bytes;
    ddp__shm_header *hdr;
    ddp__shm_ctl *ctl; /* world entries */
    char *data;        /* world * 2 halves */
    size_t half;       /* bytes of one half */
    uint64_t step;     /* steps taken by this group */
    ddp__arena arena;  /* ddp_alloc's arenas (alloc.c): base NULL when there are none */
    int cma;     /* every rank can reach every other with process_vm_readv/writev (probed at set-up) */
    unsigned spins; /* pauses before a waiting rank starts to yield its core */
    pid_t *pids; /* world entries: each rank's process id, for CMA (NULL when cma is 0) */
};

#define DDP__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define DDP__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static char *ddp__shm_half(const ddp__shm *s, int rank, uint64_t step) {
    return s->data + ((size_t)rank * 2 + (size_t)(step & 1)) * s->half;
}

static void ddp__shm_publish(ddp__shm *s, uint64_t *counter, uint64_t step) {
    DDP__STORE(counter, step);
    __atomic_add_fetch(&s->hdr->wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->hdr->sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &s->hdr->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void ddp__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Compare rank j's fingerprint with ours. A rank already past this collective (newer seq) has
   itself checked ours before finishing, so it is skipped. */
static ddp_result ddp__shm_check_fp(ddp_group *g, const ddp__coll *c, int j) {
    const ddp__shm_ctl *k = &g->shm->ctl[j];
    int par = (int)(c->seq & 1);
    ddp__coll t;
    char ours[160], theirs[160];
    t.seq = DDP__LOAD(&k->fp[par].seq);
    if (t.seq > c->seq) return DDP_SUCCESS;
    t.count = k->fp[par].count;
    t.root = k->fp[par].root;
    t.kind = k->fp[par].kind;
    t.dtype = k->fp[par].dtype;
    t.op = k->fp[par].op;
    if (t.seq == c->seq && t.count == c->count && t.root == c->root && t.kind == c->kind && t.dtype == c->dtype && t.op == c->op)
        return DDP_SUCCESS;
    ddp__coll_describe(g, c, ours, sizeof ours);
    ddp__coll_describe(g, &t, theirs, sizeof theirs);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                          "rank must call the same collectives in the same order with the same count, dtype, op and root",
                          j, theirs, g->rank, ours);
}

/* The number of the newest collective that rank j has entered over shared memory (0: none, or no
   segment): a recv waiting for j's message sees from it that j went on to a collective instead. */
static uint64_t ddp__shm_peer_seq(const ddp_group *g, int j) {
    uint64_t a, b;
    if (!g->shm) return 0;
    a = DDP__LOAD(&g->shm->ctl[j].fp[0].seq);
    b = DDP__LOAD(&g->shm->ctl[j].fp[1].seq);
    return DDP__MAX(a, b);
}

/* Called by ddp__group_break (transport.c): make every rank's next wait notice at once. */
static void ddp__shm_abort(ddp_group *g) {
    uint64_t seq = g->running_seq ? g->running_seq : 1, zero = 0; /* outside a collective: fail every one */
    if (!g->shm) return;
    __atomic_compare_exchange_n(&g->shm->hdr->aborted, &zero, seq, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&g->shm->hdr->wake, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &g->shm->hdr->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Another rank broke the group in this collective or an earlier one: fail with its reason, which
   arrives as an ABORT frame over TCP. A break in a later collective (the others finished this one and
   moved on) does not fail this one; the next collective sees it. */
static ddp_result ddp__shm_check_abort(ddp_group *g, const ddp__coll *c) {
    double deadline;
    uint64_t at = __atomic_load_n(&g->shm->hdr->aborted, __ATOMIC_ACQUIRE);
    if (!at || at > c->seq) return DDP_SUCCESS;
    for (deadline = ddp__now() + 2.0; ddp__now() < deadline; ddp__sleep(0.001)) {
        ddp_result r = ddp__check_peers(g, c);
        if (r) return r;
    }
    return ddp__coll_fail(g, DDP_ERR_PEER_LOST, "another rank broke the group (its reason did not arrive); see the other ranks' errors");
}

/* Wait until every rank's counter (posted or reduced: `which`) reaches step; on a collective's first
   step also check the fingerprints. */
static ddp_result ddp__shm_wait_all(ddp_group *g, const ddp__coll *c, int which, uint64_t step, int check) {
    ddp__shm *s = g->shm;
    double deadline = 0;
    int j;
    for (j = 0; j < g->world_size; j++) {
        uint64_t *counter = which ? &s->ctl[j].reduced : &s->ctl[j].posted;
        unsigned spins = 0;
        double yield_until = 0;
        int lost;
        while (DDP__LOAD(counter) < step) {
            ddp_result r;
            if ((spins & 255) == 255 && (r = ddp__shm_check_abort(g, c)) != DDP_SUCCESS) return r;
            if (++spins < s->spins) { /* the peer is usually running on another core: a few hundred ns */
                ddp__cpu_relax();
                continue;
            }
            /* Then yield for up to a millisecond: if the peer shares this core (oversubscribed, or
               the scheduler put both here) it runs at once, which a spinning rank would prevent. */
            if (yield_until == 0) yield_until = ddp__now() + 1e-3;
            if ((spins & 63) != 0 || ddp__now() < yield_until) {
                sched_yield();
                continue;
            }
            { /* sleep until the next post, or 1 ms, then look at the peers and the clock */
                uint32_t w = __atomic_load_n(&s->hdr->wake, __ATOMIC_SEQ_CST);
                struct timespec ts = {0, 1000000};
                __atomic_add_fetch(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
                if (DDP__LOAD(counter) < step) syscall(SYS_futex, &s->hdr->wake, FUTEX_WAIT, w, &ts, NULL, 0);
                __atomic_sub_fetch(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
            }
            /* Only the rank waited for, and only if it has still not posted: a rank that posted this
               step and then left (it went on, found an error in a later collective and closed the
               group, or exited) has done its part here. A rank that broke the group in this collective
               says so in the header (ddp__shm_check_abort). It posts before it closes, so reading the
               counter after seeing the hang-up is enough. */
            g->mesh.waiting_for = j;
            if ((lost = ddp__hung_up_peer(g, j)) >= 0 && DDP__LOAD(counter) < step) return ddp__peer_failed(g, lost, c);
            if (deadline == 0) deadline = ddp__now() + g->timeout;
            if (ddp__now() > deadline) return ddp__peer_timed_out(g, j, c);
        }
        if (check) {
            ddp_result r = ddp__shm_check_fp(g, c, j);
            if (r) return r;
        }
    }
    return ddp__shm_check_abort(g, c); /* a post made before its rank gave up does not count */
}

/* One step: (the caller has written its half) publish, wait for all, check fingerprints if first.
   The first step also publishes lib, where this rank's buffer is in its arena (DDP__SHM_NOT_LIB: not).
   A first step for CMA also publishes addr, where the buffer is in this process (0: not published). */
static ddp_result ddp__shm_step_at(ddp_group *g, const ddp__coll *c, uint64_t step, int first, uint64_t lib, uint64_t addr) {
    ddp__shm *s = g->shm;
    if (first) {
        ddp__shm_ctl *me = &s->ctl[g->rank];
        int par = (int)(c->seq & 1);
        me->fp[par].count = c->count;
        me->fp[par].lib = lib;
        me->fp[par].addr = addr;
        me->fp[par].root = c->root;
        me->fp[par].kind = c->kind;
        me->fp[par].dtype = c->dtype;
        me->fp[par].op = c->op;
        DDP__STORE(&me->fp[par].seq, c->seq);
    }
    ddp__shm_publish(s, &s->ctl[g->rank].posted, step);
    return ddp__shm_wait_all(g, c, 0, step, first);
}

static ddp_result ddp__shm_step(ddp_group *g, const ddp__coll *c, uint64_t step, int first, uint64_t lib) {
    return ddp__shm_step_at(g, c, step, first, lib, 0);
}

/* The end of a single-copy collective: nobody returns (giving its program the buffer back) while a
   peer may still be reading from or writing into that buffer. */
static ddp_result ddp__shm_finish(ddp_group *g, const ddp__coll *c) { return ddp__shm_step(g, c, ++g->shm->step, 0, 0); }

/* ---- library buffers: where they are ---- */

/* Rank j's buffer as published in this collective's first step (it stays put until the collective ends). */
static char *ddp__lib_peer(ddp_group *g, const ddp__coll *c, int j) {
    ddp__shm *s = g->shm;
    return s->arena.base + (size_t)j * s->arena.bytes + (size_t)s->ctl[j].fp[c->seq & 1].lib;
}

/* How many ranks published a library buffer in this collective's first step (read after that step,
   when every rank has published; the same answer on every rank). */
static int ddp__lib_count(ddp_group *g, const ddp__coll *c) {
    int j, k = 0;
    for (j = 0; j < g->world_size; j++) k += g->shm->ctl[j].fp[c->seq & 1].lib != DDP__SHM_NOT_LIB;
    return k;
}

/* Say at debug level that a collective runs single-copy (for tests, and for users who wonder). */
static void ddp__lib_note(ddp_group *g, const ddp__coll *c) {
    char desc[160];
    if (g->log_level < DDP_LOG_DEBUG) return;
    ddp__coll_describe(g, c, desc, sizeof desc);
    ddp__log(g, DDP_LOG_DEBUG, "%s: single-copy, straight from the ranks' library buffers", desc);
}

/* ---- the algorithms ---- */

#define DDP__SHM_ONE_SHOT_BYTES ((size_t)64 << 10) /* below this, every rank reduces all inputs itself */
/* Staged two-shot rounds (at most one half): small enough that a round's input, halves and output stay in
   the cores' caches between its copy-in, reduction and copy-out; measured best at 128-256 KiB here. */
#define DDP__SHM_STAGE_ROUND ((size_t)256 << 10)
#define DDP__SHM_DIRECT_CHUNK ((size_t)16 << 10) /* single-copy: reduce then copy out a chunk while it is in L1 */

#define DDP__SHM_CMA_CHUNK ((size_t)64 << 10)  /* CMA: one system call per chunk, the chunk still in L2 */
#define DDP__SHM_CMA_MIN_BYTES ((size_t)1 << 20) /* CMA all_reduce on plain memory from this size up: below it staging was faster (bench/README.md) */
/* all_to_all, gather, scatter: single-copy (arena or CMA) above this many bytes in the whole buffer (n
   blocks); from 64 KiB per rank on 2 ranks it beat staging (bench/README.md) */
#define DDP__SHM_MOVE_DIRECT_BYTES ((size_t)64 << 10)

/* Move bytes between local memory and rank j's address space at remote (write: to it). A failure
   means the peer is gone or unreachable: give its reason (over TCP) a moment to arrive, else fail. */
static ddp_result ddp__cma_move(ddp_group *g, const ddp__coll *c, int j, char *local, uint64_t remote, size_t bytes,
                                int write) {
    pid_t pid = g->shm->pids[j];
    char name[DDP__PEER_NAME_MAX];
    while (bytes) {
        struct iovec l, rm;
        ssize_t k;
        double deadline;
        int e;
        l.iov_base = local;
        l.iov_len = bytes;
        rm.iov_base = (void *)(uintptr_t)remote;
        rm.iov_len = bytes;
        k = write ? process_vm_writev(pid, &l, 1, &rm, 1, 0) : process_vm_readv(pid, &l, 1, &rm, 1, 0);
        if (k > 0) {
            local += k;
            remote += (uint64_t)k;
            bytes -= (size_t)k;
            continue;
        }
        e = k < 0 ? errno : EIO;
        if (e == EINTR) continue;
        for (deadline = ddp__now() + 1.0; ddp__now() < deadline; ddp__sleep(0.001)) { /* a dying peer's sockets close last */
            ddp_result r = ddp__check_peers(g, c);
            if (r) return r;
        }
        return ddp__coll_fail(g, e == ESRCH ? DDP_ERR_PEER_LOST : DDP_ERR_SYSTEM, "process_vm_%s on rank %d (%s) failed: %s%s",
                              write ? "writev" : "readv", j, ddp__peer_name(g, j, name, sizeof name), strerror(e),
                              e == ESRCH ? ": the process is gone" : " (DDP_SHM_CMA=0 stages through shared memory instead)");
    }
    return DDP_SUCCESS;
}

/* Single-copy all_reduce (the first step is done; every rank's buffer is a library buffer, or, with
   cma, any rank's may be plain memory reached by CMA): my slice, reduced chunk by chunk out of every
   buffer into mine, then copied into every peer's buffer. How a peer's slice is reached: through its
   arena when it published a library buffer, else with process_vm_readv/writev through scratch. */
static ddp_result ddp__shm_all_reduce_direct(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t,
                                             ddp_op op, int cma) {
    int n = g->world_size, r = g->rank, par = (int)(c->seq & 1), j;
    size_t es = ddp_dtype_size(t), per = (cma ? DDP__SHM_CMA_CHUNK : DDP__SHM_DIRECT_CHUNK) / es, off, len, k, m;
    char *mine, *tmp = NULL;
    ddp_result res;
    if (cma) {
        char desc[160];
        if (!(tmp = (char *)ddp__scratch(g, per * es))) return ddp__no_memory(g, per * es);
        if (g->log_level >= DDP_LOG_DEBUG) {
            ddp__coll_describe(g, c, desc, sizeof desc);
            ddp__log(g, DDP_LOG_DEBUG, "%s: cross-memory attach (process_vm_readv/writev) on the ranks' own buffers", desc);
        }
    } else {
        ddp__lib_note(g, c);
    }
    ddp__chunk(count, n, r, &off, &len);
    for (k = 0; k < len; k += m) {
        size_t at = (off + k) * es;
        m = DDP__MIN(len - k, per);
        mine = (char *)buf + at;
        for (j = 0; j < n; j++) {
            if (j == r) continue;
            if (g->shm->ctl[j].fp[par].lib != DDP__SHM_NOT_LIB) {
                ddp__reduce(mine, ddp__lib_peer(g, c, j) + at, m, t, op);
                continue;
            }
            if ((res = ddp__cma_move(g, c, j, tmp, g->shm->ctl[j].fp[par].addr + at, m * es, 0)) != DDP_SUCCESS) return res;
            ddp__reduce(mine, tmp, m, t, op);
        }
        if (op == DDP_AVG) ddp__divide(mine, m, t, n);
        for (j = 0; j < n; j++) {
            if (j == r) continue;
            if (g->shm->ctl[j].fp[par].lib != DDP__SHM_NOT_LIB)
                memcpy(ddp__lib_peer(g, c, j) + at, mine, m * es);
            else if ((res = ddp__cma_move(g, c, j, mine, g->shm->ctl[j].fp[par].addr + at, m * es, 1)) != DDP_SUCCESS)
                return res;
        }
    }
    return ddp__shm_finish(g, c);
}

/* all_reduce (root < 0) and reduce (only root copies the result out; the others' buffers stay as
   they were, since only copies of them are reduced). */
static ddp_result ddp__shm_reduce_impl(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                       int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = DDP__MIN(s->half, DDP__SHM_STAGE_ROUND) / es, done = 0;
    int n = g->world_size, r = g->rank, first = 1, j, gets = root < 0 || root == r;
    int may_lib = root < 0 && count * es > DDP__SHM_ONE_SHOT_BYTES; /* every rank computes the same */
    int may_cma = may_lib && s->cma && count * es >= DDP__SHM_CMA_MIN_BYTES; /* the same too (cma: agreed at set-up) */
    uint64_t lib = may_lib ? ddp__lib_offset(g, buf, count * es) : DDP__SHM_NOT_LIB;
    char *out = (char *)buf;
    ddp_result res;
    if (lib != DDP__SHM_NOT_LIB || may_cma) { /* a first step without data: where my buffer is */
        if ((res = ddp__shm_step_at(g, c, ++s->step, 1, lib, may_cma ? (uint64_t)(uintptr_t)buf : 0)) != DDP_SUCCESS) return res;
        if (ddp__lib_count(g, c) == n) return ddp__shm_all_reduce_direct(g, c, buf, count, t, op, 0);
        if (may_cma) return ddp__shm_all_reduce_direct(g, c, buf, count, t, op, 1);
        first = 0; /* some rank's buffer is not a library buffer: stage, from the next step */
    }
    for (;;) {
        size_t m = DDP__MIN(count - done, per), bytes = m * es, off, len;
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step), *dst = out + done * es;
        int two_shot = bytes > DDP__SHM_ONE_SHOT_BYTES;
        ddp__chunk(m, n, r, &off, &len);
        if (two_shot && root < 0) { /* nobody reads my own segment's input from my half */
            memcpy(mine, dst, off * es);
            memcpy(mine + (off + len) * es, dst + (off + len) * es, (m - off - len) * es);
        } else if (bytes) {
            memcpy(mine, dst, bytes);
        }
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        if (first && may_lib && ddp__lib_count(g, c) > 0) {
            first = 0; /* the ranks with library buffers posted no data in that step: every rank repeats it */
            continue;
        }
        first = 0;
        if (!two_shot) { /* one-shot: inputs in rank order, the same on every rank */
            if (gets && bytes) {
                memcpy(dst, ddp__shm_half(s, 0, step), bytes);
                for (j = 1; j < n; j++) ddp__reduce(dst, ddp__shm_half(s, j, step), m, t, op);
                if (op == DDP_AVG) ddp__divide(dst, m, t, n);
            }
        } else if (root < 0) { /* two-shot all_reduce: my segment in my buffer, a copy in my half for the others */
            for (j = 0; j < n; j++)
                if (j != r) ddp__reduce(dst + off * es, ddp__shm_half(s, j, step) + off * es, len, t, op);
            if (op == DDP_AVG) ddp__divide(dst + off * es, len, t, n);
            memcpy(mine + off * es, dst + off * es, len * es);
            ddp__shm_publish(s, &s->ctl[r].reduced, step);
            if ((res = ddp__shm_wait_all(g, c, 1, step, 0)) != DDP_SUCCESS) return res;
            for (j = 0; j < n; j++) {
                if (j == r) continue;
                ddp__chunk(m, n, j, &off, &len);
                memcpy(dst + off * es, ddp__shm_half(s, j, step) + off * es, len * es);
            }
        } else { /* two-shot reduce: reduce my segment in place in my half, then the root gathers */
            for (j = 0; j < n; j++)
                if (j != r) ddp__reduce(mine + off * es, ddp__shm_half(s, j, step) + off * es, len, t, op);
            if (op == DDP_AVG) ddp__divide(mine + off * es, len, t, n);
            ddp__shm_publish(s, &s->ctl[r].reduced, step);
            if ((res = ddp__shm_wait_all(g, c, 1, step, 0)) != DDP_SUCCESS) return res;
            for (j = 0; j < n && gets; j++) {
                ddp__chunk(m, n, j, &off, &len);
                memcpy(dst + off * es, ddp__shm_half(s, j, step) + off * es, len * es);
            }
        }
        done += m;
        if (done >= count) return DDP_SUCCESS;
    }
}

/* broadcast: staged in rounds of one half, or, when the root's buffer is a library buffer (above the
   one-shot size), copied by every other rank straight out of it. */
static ddp_result ddp__shm_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0;
    int first = 1, may_lib = count * es > DDP__SHM_ONE_SHOT_BYTES;
    uint64_t lib = may_lib && g->rank == root ? ddp__lib_offset(g, buf, count * es) : DDP__SHM_NOT_LIB;
    ddp_result res;
    do {
        size_t m = DDP__MIN(count - done, per);
        uint64_t step = ++s->step;
        char *p = (char *)buf + done * es;
        if (g->rank == root && m && lib == DDP__SHM_NOT_LIB) memcpy(ddp__shm_half(s, root, step), p, m * es);
        if ((res = ddp__shm_step(g, c, step, first, lib)) != DDP_SUCCESS) return res;
        if (first && may_lib && s->ctl[root].fp[c->seq & 1].lib != DDP__SHM_NOT_LIB) {
            ddp__lib_note(g, c);
            if (g->rank != root) memcpy(buf, ddp__lib_peer(g, c, root), count * es);
            return ddp__shm_finish(g, c);
        }
        first = 0;
        if (g->rank != root && m) memcpy(p, ddp__shm_half(s, root, step), m * es);
        done += m;
    } while (done < count);
    return DDP_SUCCESS;
}

/* Single-copy all_gather (every rank's send buffer in its arena; the first step is done). */
static ddp_result ddp__shm_all_gather_direct(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                             ddp_dtype t) {
    size_t bytes = cpr * ddp_dtype_size(t);
    int k;
    ddp__lib_note(g, c);
    for (k = 0; k < g->world_size; k++) {
        char *dst = (char *)recv + (size_t)k * bytes;
        if (k != g->rank) memcpy(dst, ddp__lib_peer(g, c, k), bytes);
        else if (dst != (const char *)send) memcpy(dst, send, bytes); /* they do not overlap (checked) */
    }
    return ddp__shm_finish(g, c);
}

static ddp_result ddp__shm_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    ddp__shm *s = g->shm;
    size_t es = ddp_dtype_size(t), per = s->half / es, done = 0, bytes = cpr * es;
    int first = 1, k, may_lib = bytes > DDP__SHM_ONE_SHOT_BYTES;
    uint64_t lib = may_lib ? ddp__lib_offset(g, send, bytes) : DDP__SHM_NOT_LIB;
    const char *sp = (const char *)send, *rp = (const char *)recv, *mine = rp + (size_t)g->rank * bytes;
    ddp_result res;
    /* peers read send while this rank writes recv: single-copy only if they overlap nowhere but in place */
    if (lib != DDP__SHM_NOT_LIB && sp != mine && sp < rp + (size_t)g->world_size * bytes && rp < sp + bytes)
        lib = DDP__SHM_NOT_LIB;
    if (lib != DDP__SHM_NOT_LIB) {
        if ((res = ddp__shm_step(g, c, ++s->step, 1, lib)) != DDP_SUCCESS) return res;
        if (ddp__lib_count(g, c) == g->world_size) return ddp__shm_all_gather_direct(g, c, send, recv, cpr, t);
        first = 0;
    }
    for (;;) {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        if (m) memcpy(ddp__shm_half(s, g->rank, step), sp + done * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        if (first && may_lib && ddp__lib_count(g, c) > 0) {
            first = 0; /* as in all_reduce: some ranks posted no data; every rank repeats the step */
            continue;
        }
        first = 0;
        for (k = 0; k < g->world_size && m; k++) /* memmove: in place, send is this rank's part of recv */
            memmove((char *)recv + ((size_t)k * cpr + done) * es, ddp__shm_half(s, k, step), m * es);
        done += m;
        if (done >= cpr) return DDP_SUCCESS;
    }
}

static ddp_result ddp__shm_reduce_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                          ddp_dtype t, ddp_op op) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j, k;
    size_t es = ddp_dtype_size(t), per = s->half / (es * (size_t)n), done = 0;
    ddp_result res;
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step), *dst = (char *)recv + done * es;
        for (k = 0; k < n && m; k++) memcpy(mine + (size_t)k * m * es, (const char *)send + ((size_t)k * cpr + done) * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        first = 0;
        if (m) {
            memcpy(dst, ddp__shm_half(s, 0, step) + (size_t)r * m * es, m * es);
            for (j = 1; j < n; j++) ddp__reduce(dst, ddp__shm_half(s, j, step) + (size_t)r * m * es, m, t, op);
            if (op == DDP_AVG) ddp__divide(dst, m, t, n);
        }
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

/* ---- all_to_all, gather, scatter ----
   Staged (small messages, or a rank's buffers that cannot be reached): in rounds of one step. all_to_all:
   every rank writes the next m elements of its block for each rank k at k*m in its half (the layout of
   reduce_scatter), one step, then copies slot `rank` out of every rank's half. gather: every rank but
   the root writes its next m elements into its half; the root copies them out. scatter: the root writes
   the next m elements of every rank's block at k*m in its half; each rank copies its slot. A rank's own
   block never goes through the segment.
   Single-copy (above DDP__SHM_MOVE_DIRECT_BYTES, the whole buffer): the first step carries no data but,
   with the fingerprint, where the buffers are: a library buffer's arena offset, or, with cross-memory
   attach, its address. all_to_all: every rank publishes its recv buffer (when it overlaps its send
   buffer nowhere: in place, it publishes nothing) and, when every rank did, writes its block for each
   peer j straight into slot `rank` of j's recv buffer (memcpy into the arena, or one process_vm_writev;
   pushing measured 2-3x faster than pulling with process_vm_readv at 1 MiB per rank on 2 ranks here).
   gather / scatter: the root publishes its recv / send buffer, and every other rank writes / reads its
   own block there, all at once. A last step keeps every rank in the call until all copies are done.
   When a buffer that was needed was not published, every rank stages from the next step on (the same
   decision everywhere, read from the same published fingerprints). */

/* Where rank j published its buffer in this collective's first step is reachable: an arena or CMA. */
static int ddp__shm_reachable(ddp_group *g, const ddp__coll *c, int j) {
    const ddp__shm_ctl *k = &g->shm->ctl[j];
    return k->fp[c->seq & 1].lib != DDP__SHM_NOT_LIB || (g->shm->cma && k->fp[c->seq & 1].addr != 0);
}

/* Copy bytes between local memory and rank j's published buffer at offset `at` (write: into it). */
static ddp_result ddp__shm_peer_move(ddp_group *g, const ddp__coll *c, int j, char *local, size_t at, size_t bytes, int write) {
    const ddp__shm_ctl *k = &g->shm->ctl[j];
    if (!bytes) return DDP_SUCCESS;
    if (k->fp[c->seq & 1].lib != DDP__SHM_NOT_LIB) {
        char *peer = ddp__lib_peer(g, c, j) + at;
        memcpy(write ? peer : local, write ? local : peer, bytes);
        return DDP_SUCCESS;
    }
    return ddp__cma_move(g, c, j, local, k->fp[c->seq & 1].addr + at, bytes, write);
}

/* The first step of a single-copy all_to_all/gather/scatter: publish buf (or nothing, when publish is 0). */
static ddp_result ddp__shm_publish_buffer(ddp_group *g, const ddp__coll *c, const void *buf, size_t bytes, int publish) {
    uint64_t lib = publish ? ddp__lib_offset(g, buf, bytes) : DDP__SHM_NOT_LIB;
    uint64_t addr = publish && g->shm->cma && lib == DDP__SHM_NOT_LIB ? (uint64_t)(uintptr_t)buf : 0;
    return ddp__shm_step_at(g, c, ++g->shm->step, 1, lib, addr);
}

/* Say at debug level that an all_to_all/gather/scatter runs single-copy (tests watch for it). */
static void ddp__shm_move_note(ddp_group *g, const ddp__coll *c) {
    char desc[160];
    if (g->log_level < DDP_LOG_DEBUG) return;
    ddp__coll_describe(g, c, desc, sizeof desc);
    ddp__log(g, DDP_LOG_DEBUG, "%s: single-copy, straight between the ranks' buffers (library buffers or cross-memory attach)", desc);
}

/* Do two byte ranges overlap? */
static int ddp__overlap(const void *a, size_t an, const void *b, size_t bn) {
    const char *x = (const char *)a, *y = (const char *)b;
    return an && bn && x < y + bn && y < x + an;
}

static ddp_result ddp__shm_all_to_all(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j, k;
    size_t es = ddp_dtype_size(t), block = cpr * es, per = s->half / (es * (size_t)n), done = 0;
    const char *sp = (const char *)send;
    char *rp = (char *)recv;
    ddp_result res;
    if (block * (size_t)n > DDP__SHM_MOVE_DIRECT_BYTES && (s->cma || s->arena.base)) { /* the same on every rank */
        int apart = !ddp__overlap(send, block * (size_t)n, recv, block * (size_t)n), all = 1;
        if ((res = ddp__shm_publish_buffer(g, c, recv, block * (size_t)n, apart)) != DDP_SUCCESS) return res;
        for (j = 0; j < n; j++) all &= ddp__shm_reachable(g, c, j);
        if (all) {
            ddp__shm_move_note(g, c);
            memcpy(rp + (size_t)r * block, sp + (size_t)r * block, block);
            for (k = 1; k < n; k++) { /* rank r+k first: the ranks do not all write into one peer at once */
                char *mine = (char *)(uintptr_t)sp + (size_t)((r + k) % n) * block; /* only read (a write moves it out) */
                if ((res = ddp__shm_peer_move(g, c, (r + k) % n, mine, (size_t)r * block, block, 1)) != DDP_SUCCESS) return res;
            }
            return ddp__shm_finish(g, c);
        }
        first = 0;
    }
    if (sp != rp) memcpy(rp + (size_t)r * block, sp + (size_t)r * block, block); /* in place: it is there */
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step);
        for (k = 0; k < n && m; k++)
            if (k != r) memcpy(mine + (size_t)k * m * es, sp + ((size_t)k * cpr + done) * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        first = 0;
        for (j = 0; j < n && m; j++) /* in place: block j's rows done..done+m were copied into my half above */
            if (j != r) memcpy(rp + ((size_t)j * cpr + done) * es, ddp__shm_half(s, j, step) + (size_t)r * m * es, m * es);
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

/* gather (scatter = 0: the root's recv <- every rank's send) and scatter (the root's send -> every rank's recv). */
static ddp_result ddp__shm_rooted(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t,
                                  int root, int scatter) {
    ddp__shm *s = g->shm;
    int n = g->world_size, r = g->rank, first = 1, j;
    size_t es = ddp_dtype_size(t), block = cpr * es, per = s->half / (es * (size_t)(scatter ? n : 1)), done = 0;
    char *big = r == root ? (char *)(scatter ? (void *)(uintptr_t)send : recv) : NULL; /* the root's n blocks */
    char *own = (char *)(scatter ? recv : (void *)(uintptr_t)send);                    /* this rank's block */
    ddp_result res;
    if (block * (size_t)n > DDP__SHM_MOVE_DIRECT_BYTES && (s->cma || s->arena.base)) { /* the same on every rank */
        if ((res = ddp__shm_publish_buffer(g, c, big, block * (size_t)n, r == root)) != DDP_SUCCESS) return res;
        if (ddp__shm_reachable(g, c, root)) {
            ddp__shm_move_note(g, c);
            if (r != root && (res = ddp__shm_peer_move(g, c, root, own, (size_t)r * block, block, !scatter)) != DDP_SUCCESS)
                return res;
            if (r == root && own != big + (size_t)r * block) memcpy(scatter ? own : big + (size_t)r * block,
                                                                    scatter ? big + (size_t)r * block : own, block);
            return ddp__shm_finish(g, c);
        }
        first = 0;
    }
    if (r == root && own != big + (size_t)r * block) /* in place: it is there */
        memcpy(scatter ? own : big + (size_t)r * block, scatter ? big + (size_t)r * block : own, block);
    do {
        size_t m = DDP__MIN(cpr - done, per);
        uint64_t step = ++s->step;
        char *mine = ddp__shm_half(s, r, step);
        if (scatter && r == root)
            for (j = 0; j < n && m; j++)
                if (j != r) memcpy(mine + (size_t)j * m * es, big + ((size_t)j * cpr + done) * es, m * es);
        if (!scatter && r != root && m) memcpy(mine, own + done * es, m * es);
        if ((res = ddp__shm_step(g, c, step, first, DDP__SHM_NOT_LIB)) != DDP_SUCCESS) return res;
        first = 0;
        if (scatter && r != root && m) memcpy(own + done * es, ddp__shm_half(s, root, step) + (size_t)r * m * es, m * es);
        if (!scatter && r == root)
            for (j = 0; j < n && m; j++)
                if (j != r) memcpy(big + ((size_t)j * cpr + done) * es, ddp__shm_half(s, j, step), m * es);
        done += m;
    } while (done < cpr);
    return DDP_SUCCESS;
}

static ddp_result ddp__shm_call(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, -1);
    case DDP__REDUCE: return ddp__shm_reduce_impl(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__BROADCAST: return ddp__shm_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__ALL_GATHER: return ddp__shm_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__shm_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    case DDP__BARRIER: return ddp__shm_step(g, c, ++g->shm->step, 1, DDP__SHM_NOT_LIB);
    case DDP__ALL_TO_ALL: return ddp__shm_all_to_all(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__GATHER: return ddp__shm_rooted(g, c, k->send, k->buf, k->count, k->dtype, k->root, 0);
    case DDP__SCATTER: return ddp__shm_rooted(g, c, k->send, k->buf, k->count, k->dtype, k->root, 1);
    case DDP__MONITORED_BARRIER: return ddp__tcp_run(g, k, c); /* rank 0 must see who is missing: TCP's deadlines */
    default: { /* all_to_all_v, all_gather_v run over the mesh after one step here: a rank in a shared-memory
                  collective at this number meets the fingerprints in that step (DDP_ERR_MISMATCH), not TCP
                  frames it never reads */
        ddp_result r = ddp__shm_step(g, c, ++g->shm->step, 1, DDP__SHM_NOT_LIB);
        return r ? r : ddp__tcp_run(g, k, c);
    }
    }
}

/* ---- setting up and tearing down ---- */

/* The running collective's number is what ddp__shm_abort publishes when this rank breaks the group. */
static ddp_result ddp__shm_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    ddp_result r;
    g->running_seq = c->seq;
    r = ddp__shm_call(g, k, c);
    g->running_seq = 0;
    return r;
}

/* Unmap the segment (its arenas' blocks go with it). */
static void ddp__shm_close(ddp_group *g, int orderly) {
    (void)orderly;
    if (!g->shm) return;
    g->lib.arena = NULL;
    munmap(g->shm->base, g->shm->bytes);
    if (g->shm->arena.fd >= 0) close(g->shm->arena.fd);
    ddp__free(g->shm->arena.blocks);
    ddp__free(g->shm->pids);
    ddp__free(g->shm);
    g->shm = NULL;
}

/* Every rank of the group on this host. Library buffers (ddp_alloc) live in the segment's arenas. */
static const ddp__backend ddp__backend_shm = {
    "shm", "cpu", ddp__shm_run, NULL, NULL, NULL, ddp__shm_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out};

/* Can this rank read every peer's memory with process_vm_readv? pub holds, per rank, its pid, the
   address of a word in its process and the word's value; each peer's word must read back as published
   (a pid from another pid namespace names another process, or none). */
static int ddp__cma_probe(ddp_group *g, const uint64_t *pub) {
    int j;
    for (j = 0; j < g->world_size; j++) {
        uint64_t got = 0;
        struct iovec l, rm;
        if (j == g->rank) continue;
        l.iov_base = &got;
        l.iov_len = sizeof got;
        rm.iov_base = (void *)(uintptr_t)pub[3 * j + 1];
        rm.iov_len = sizeof got;
        if (process_vm_readv((pid_t)pub[3 * j], &l, 1, &rm, 1, 0) != (ssize_t)sizeof got || got != pub[3 * j + 2]) {
            ddp__log(g, DDP_LOG_DEBUG, "cross-memory attach to rank %d unavailable (%s): all_reduce stages plain memory through "
                     "the segment", j, strerror(errno));
            return 0;
        }
    }
    return 1;
}

/* Rank 0 could not make the segment (errnum from shm_open, or from posix_fallocate on fd): the group
   stays on TCP, which is slower, so say so at the default level, with the numbers and the fixes. */
static void ddp__shm_unavailable(ddp_group *g, int errnum, size_t need, int fd) {
    struct statvfs st;
    char why[DDP__ERR_MAX];
    const char *fix = "or set DDP_TRANSPORT=tcp to use TCP without this warning";
    if (fd >= 0 && fstatvfs(fd, &st) == 0 && (errnum == ENOSPC || errnum == EFBIG)) {
        ddp__log(g, DDP_LOG_WARN, "shared memory unavailable: /dev/shm has %.1f MiB free (of %.1f MiB), and a group of %d "
                 "ranks needs a segment of %.1f MiB; using TCP, which is slower. Make /dev/shm larger (Docker: "
                 "docker run --shm-size=%zum; Kubernetes: an emptyDir with medium Memory on /dev/shm), %s",
                 (double)st.f_bavail * (double)st.f_frsize / 1048576.0, (double)st.f_blocks * (double)st.f_frsize / 1048576.0,
                 g->world_size, (double)need / 1048576.0, (need >> 20) + 64, fix);
        return;
    }
    if (ddp__out_of_descriptors(errnum)) ddp__fail_descriptors(why, errnum, "cannot open the shared-memory segment");
    else snprintf(why, sizeof why, "%s the segment of %.1f MiB in /dev/shm: %s", fd >= 0 ? "cannot reserve" : "cannot create",
                  (double)need / 1048576.0, strerror(errnum));
    ddp__log(g, DDP_LOG_WARN, "shared memory unavailable (%s); using TCP, which is slower; %s", why, fix);
}

/* Map one segment for a group whose ranks all share this host (group.c decides that). Collective over
   the group's TCP mesh; every rank reaches the same decision. Any failure to set up shared memory (a
   full /dev/shm, say) is not an error: the group keeps using TCP; a failure to map the arenas only
   turns library buffers into plain memory. The name is unlinked as soon as every rank has the segment
   mapped, so no exit (a crash included) leaves it behind in /dev/shm. */
static ddp_result ddp__shm_setup(ddp_group *g) {
    int i, ok[3] = {1, 1, 1}, fd = -1; /* ok: the segment, the arenas, cross-memory attach */
    uint64_t word, mine[3], *pub = NULL; /* the CMA probe: my pid, &word, word; every rank's */
    long cma_env = 1;
    char err[DDP__ERR_MAX];
    struct {
        char name[64];
        uint64_t arena_bytes;
    } info;
    size_t half, head, arenas_at, bytes;
    ddp__shm *s;
    ddp_result r;
    half = DDP__MIN(DDP__MAX(((size_t)8 << 20) / (size_t)g->world_size, (size_t)256 << 10), (size_t)4 << 20);
    half &= ~(size_t)63; /* every half starts on a cache line, so every dtype is aligned */
    head = sizeof(ddp__shm_header) + (size_t)g->world_size * (sizeof(ddp__shm_ctl) + 2 * half);
    arenas_at = (head + DDP__ARENA_ALIGN - 1) & ~(DDP__ARENA_ALIGN - 1);
    memset(&info, 0, sizeof info);
    if (g->rank == 0) {
        snprintf(info.name, sizeof info.name, "/ddp.%d.%llx", (int)getpid(), (unsigned long long)(ddp__hash(g->member.prefix) ^ (uint64_t)ddp__now()));
        fd = shm_open(info.name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0) info.arena_bytes = ddp__arena_size(g, fd);
        /* the arenas are a sparse tail; a file system that refuses the size gets none */
        if (fd >= 0 && info.arena_bytes && ftruncate(fd, (off_t)(arenas_at + (size_t)g->world_size * info.arena_bytes)) != 0)
            info.arena_bytes = 0;
        if (fd < 0) {
            ddp__shm_unavailable(g, errno, head, 0);
            ok[0] = 0;
        } else if ((i = posix_fallocate(fd, 0, (off_t)head)) != 0) { /* a full /dev/shm fails here, not with SIGBUS later */
            ddp__shm_unavailable(g, i, head, fd);
            ok[0] = 0;
        }
    }
    if ((r = ddp__mesh_broadcast(g, &info, sizeof info, DDP_U8, 0)) != DDP_SUCCESS) goto done;
    if (g->rank != 0 && info.name[0]) fd = shm_open(info.name, O_RDWR, 0600);
    s = (ddp__shm *)ddp__calloc(1, sizeof *s);
    bytes = info.arena_bytes ? arenas_at + (size_t)g->world_size * (size_t)info.arena_bytes : head;
    if (fd >= 0 && ok[0] && s) {
        s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (s->base == MAP_FAILED && bytes > head) { /* no address space for the arenas (ulimit -v): without them */
            bytes = head;
            s->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        }
        if (s->base == MAP_FAILED) s->base = NULL;
    }
    if (!s || !s->base) ok[0] = 0;
    if (!info.arena_bytes || bytes == head) ok[1] = 0;
    /* Cross-memory attach: publish a word, read every peer's (the all_reduce below keeps every word
       alive until all have read). Every rank takes part even when it will not use it. */
    word = ddp__hash(g->member.prefix) ^ ((uint64_t)getpid() << 20) ^ (uint64_t)(ddp__now() * 1e9);
    mine[0] = (uint64_t)getpid();
    mine[1] = (uint64_t)(uintptr_t)&word;
    mine[2] = word;
    if (ddp__env_int("DDP_SHM_CMA", 0, 1, &cma_env, err) < 0) ddp__log(g, DDP_LOG_WARN, "%s; cross-memory attach stays on", err);
    if (!(pub = (uint64_t *)ddp__calloc((size_t)g->world_size * 3, sizeof *pub))) {
        r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory setting up shared memory");
    } else if ((r = ddp__mesh_all_gather(g, mine, pub, 3, DDP_I64)) == DDP_SUCCESS) {
        if (s && cma_env && (s->pids = (pid_t *)ddp__calloc((size_t)g->world_size, sizeof *s->pids)) != NULL)
            for (i = 0; i < g->world_size; i++) s->pids[i] = (pid_t)pub[3 * i];
        ok[2] = s && s->pids && ddp__cma_probe(g, pub);
        r = ddp__mesh_all_reduce(g, ok, 3, DDP_I32, DDP_MIN);
    }
    if (s && (r || !ok[2])) {
        ddp__free(s->pids);
        s->pids = NULL;
    }
    if (r || !ok[0]) {
        if (s && s->base) munmap(s->base, bytes);
        if (s) ddp__free(s->pids); /* no segment (a full /dev/shm): the CMA probe may still have filled them */
        ddp__free(s);
        goto done;
    }
    s->cma = ok[2]; /* the same on every rank */
    /* Oversubscribed (more ranks here than CPUs): spinning only delays the rank being waited for. Measured
       on 2 cores (bench/README.md): 4 B all_reduce on 4 ranks 2.0-3.8 us against 3.7-6.0 with 256 pauses;
       2 ranks unchanged. A local policy only: ranks need not agree on it. */
    s->spins = ddp__oversubscribed(g->world_size) ? 16 : 256;
    s->bytes = bytes;
    s->half = half;
    s->hdr = (ddp__shm_header *)s->base;
    s->ctl = (ddp__shm_ctl *)((char *)s->base + sizeof(ddp__shm_header));
    s->data = (char *)(s->ctl + g->world_size);
    s->arena.fd = -1;
    if (ok[1]) { /* every rank mapped every arena */
        s->arena.base = (char *)s->base + arenas_at;
        s->arena.bytes = (size_t)info.arena_bytes;
        s->arena.file_off = (off_t)arenas_at;
        s->arena.fd = fd;
        fd = -1;
#ifdef MADV_DONTDUMP
        /* a core dump would read the arenas' holes, and reading a hole of shared memory allocates it */
        madvise(s->arena.base, (size_t)g->world_size * s->arena.bytes, MADV_DONTDUMP);
#endif
    }
    /* Still over TCP: every rank has the segment mapped (so the name can go), and no collective has
       run over it yet. The segment is zero-filled: steps and fingerprints start at 0, below any seq. */
    if ((r = ddp__mesh_barrier(g)) != DDP_SUCCESS) {
        munmap(s->base, bytes);
        if (s->arena.fd >= 0) close(s->arena.fd);
        ddp__free(s->pids);
        ddp__free(s);
        goto done;
    }
    g->shm = s;
    if (s->arena.base) g->lib.arena = &s->arena;
    g->backend = g->host_backend = &ddp__backend_shm;
    ddp__log(g, DDP_LOG_INFO, "shared memory: %zu-byte halves, %zu-byte arenas for ddp_alloc, cross-memory attach %s", half,
             s->arena.bytes, s->cma ? "on" : "off");
done:
    ddp__free(pub);
    if (fd >= 0) close(fd);
    if (g->rank == 0 && info.name[0]) shm_unlink(info.name);
    return r;
}
/* ==================== end src/shm.c ==================== */

/* ==================== begin src/hier.c ==================== */
/* [SECTION] hier: hierarchical all_reduce for a group that spans hosts with several ranks on a host
   (NCCL's and Gloo's two-level all-reduce; torch.distributed gets it from its backends)

   A group whose ranks are not all on one host runs its collectives over the TCP mesh, and a ring over
   all ranks crosses the loopback device once for every pair of neighbours on the same host. Large
   all_reduces (above the recursive-doubling size, tcp.c) in such a group run three stages:

       host:     all_reduce among the ranks of each host, over shared memory    (g->hier.host)
       leaders:  all_reduce among the first rank of every host, over TCP        (g->hier.leaders)
       host:     broadcast from that first rank to the rest of its host         (g->hier.host)

   Only the leaders' stage crosses hosts, with what a ring over the H hosts needs: 2(H-1)/H of the
   buffer each way per host; the host stages run at memory speed. Both groups are made when the group
   is set up (every rank computes the same host map from the host keys that group.c gathers) and live
   as long as it. A host with one rank has no host group; a group with one rank per host has neither
   and stays on the tcp backend, and so does a group under DDP_TRANSPORT=tcp (no host keys then).
   Everything else (small all_reduces, the other collectives) runs on the tcp backend's algorithms.

   Mismatches: each stage is a collective of its own group and can only check calls within it. So a
   hierarchical all_reduce first agrees on the call in the group itself: recursive doubling with no
   data (log2(n) exchanges of a frame header carrying the call's fingerprint), which fails every rank
   on any difference exactly as a small all_reduce does (tcp.c). Past it every rank runs the
   same stages. A failure in a stage (a lost rank, a timeout) breaks the other stage's group and the
   group itself with the same message, so every rank fails, whichever stage it waits in.
   Op AVG runs as SUM in the stages and divides once at the end, as the ring does. */

/* The end of a group: its stage groups go first (ddp_destroy after the group's own barrier: every rank
   is there, so their barriers meet), or are just freed when the group is failing. */
static void ddp__hier_close(ddp_group *g, int orderly) {
    ddp_group *stages[2];
    int i;
    stages[0] = g->hier.host;
    stages[1] = g->hier.leaders;
    g->hier.host = g->hier.leaders = NULL;
    for (i = 0; i < 2; i++) {
        if (!stages[i]) continue;
        if (orderly) ddp_destroy(stages[i]);
        else ddp__group_free(stages[i]);
    }
}

/* A stage failed and its group is broken: break the other stage's group and the group itself with the
   same message, so ranks waiting anywhere in this all_reduce fail too. */
static ddp_result ddp__hier_fail(ddp_group *g, ddp_group *stage, const char *stage_name, ddp_result r) {
    char msg[DDP__ERR_MAX];
    const char *why = stage->broken ? stage->broken_msg : stage->error;
    ddp_result code = stage->broken ? stage->broken : r;
    if (strncmp(why, "hierarchical all_reduce", 23) == 0) /* another rank's, already saying where */
        snprintf(msg, sizeof msg, "%s", why);
    else
        snprintf(msg, sizeof msg, "hierarchical all_reduce, %s stage (rank numbers there count within the stage): %.900s",
                 stage_name, why);
    if (g->hier.host && g->hier.host != stage) ddp__group_break(g->hier.host, code, msg);
    if (g->hier.leaders && g->hier.leaders != stage) ddp__group_break(g->hier.leaders, code, msg);
    return ddp__coll_fail(g, code, "%s", msg);
}

static ddp_result ddp__hier_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_op stage_op = op == DDP_AVG ? DDP_SUM : op;
    ddp__call reduce, bcast;
    ddp_result r;
    if ((r = ddp__rd_all_reduce(g, c, NULL, 0, t, op)) != DDP_SUCCESS) return r; /* the agreement: fingerprints only */
    if (g->log_level >= DDP_LOG_DEBUG) {
        char desc[160];
        ddp__coll_describe(g, c, desc, sizeof desc);
        ddp__log(g, DDP_LOG_DEBUG, "%s: hierarchical (host, between hosts, host broadcast)", desc);
    }
    reduce = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, stage_op, -1);
    bcast = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, 0);
    if (g->hier.host && (r = ddp__collective(g->hier.host, &reduce)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.host, "host (shared memory)", r);
    if (g->hier.leaders && (r = ddp__collective(g->hier.leaders, &reduce)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.leaders, "between hosts", r);
    if (g->hier.host && (r = ddp__collective(g->hier.host, &bcast)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.host, "host broadcast", r);
    if (op == DDP_AVG) ddp__divide(buf, count, t, g->world_size);
    return DDP_SUCCESS;
}

/* Large all_reduces in three stages; everything else on the tcp backend. The choice depends only on the
   call (count, dtype), so every rank that agrees on the call makes the same one. */
static ddp_result ddp__hier_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    if (k->kind == DDP__ALL_REDUCE && k->count * ddp_dtype_size(k->dtype) > DDP__RD_MAX_BYTES)
        return ddp__hier_all_reduce(g, c, k->buf, k->count, k->dtype, k->op);
    return ddp__tcp_run(g, k, c);
}

static const ddp__backend ddp__backend_hier = {
    "hier", "cpu", ddp__hier_run, NULL, NULL, NULL, ddp__hier_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out};

/* Called by group.c's set-up when the group's ranks are not all on one host; keys holds every rank's
   host key. Collective: every rank derives the same host map, so all decide alike. */
static ddp_result ddp__hier_setup(ddp_group *g, const uint64_t *keys) {
    int n = g->world_size, i, j, nhost = 0, nlead = 0, my_index = 0, lead_index = 0, shared = 0;
    int *host = (int *)ddp__calloc((size_t)n, sizeof *host), *leaders = (int *)ddp__calloc((size_t)n, sizeof *leaders);
    char name[32];
    ddp_result r = DDP_SUCCESS;
    if (!host || !leaders) {
        ddp__free(host);
        ddp__free(leaders);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory mapping the group's hosts");
    }
    for (i = 0; i < n; i++) { /* a host's leader is its lowest rank */
        for (j = 0; j < i && keys[j] != keys[i]; j++) continue;
        if (j == i) leaders[nlead++] = i;
        else shared = 1;
        if (i == g->rank) lead_index = nlead - 1; /* used only when this rank leads its host */
        if (keys[i] != keys[g->rank]) continue;
        if (i == g->rank) my_index = nhost;
        host[nhost++] = i;
    }
    if (shared) {
        snprintf(name, sizeof name, "host%d", host[0]);
        if (nhost > 1) r = ddp__subgroup_open(g, host, nhost, my_index, name, NULL, "setting up the hierarchical all_reduce", &g->hier.host);
        if (r == DDP_SUCCESS && host[0] == g->rank)
            r = ddp__subgroup_open(g, leaders, nlead, lead_index, "leaders", NULL, "setting up the hierarchical all_reduce",
                                   &g->hier.leaders);
        if (r == DDP_SUCCESS) {
            g->backend = g->host_backend = &ddp__backend_hier;
            ddp__log(g, DDP_LOG_INFO, "%d ranks on %d hosts: large all_reduces run hierarchically (shared memory within a "
                     "host, TCP between hosts)", n, nlead);
        }
    }
    ddp__free(host);
    ddp__free(leaders);
    return r;
}
/* ==================== end src/hier.c ==================== */

/* ==================== begin src/mpi.c ==================== */
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

/* FNV-1a over n bytes, continuing from h. */
static uint64_t ddp__mpi_hash(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
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
    uint64_t h = 1469598103934665603ull;
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
    h = ddp__mpi_hash(h, &mine, sizeof mine);
    for (i = 0; k->kind == DDP__ALL_GATHER_V && i < g->world_size; i++) {
        uint64_t v = (uint64_t)k->recv_counts[i];
        h = ddp__mpi_hash(h, &v, sizeof v);
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

static const ddp__backend ddp__mpi_p2p_owner = {"mpi", "mpi", NULL, NULL, ddp__mpi_p2p_wait, ddp__mpi_p2p_test, NULL,
                                                NULL, NULL, NULL, NULL, NULL};

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

static ddp_result ddp__mpi_p2p_wait(ddp_work *w) {
    (void)w;
    return DDP_ERR_STATE;
}

static void ddp__mpi_p2p_release(ddp_work *w) { (void)w; }

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
/* ==================== end src/mpi.c ==================== */

/* ==================== begin src/nccl.c ==================== */
/* [SECTION] nccl: the nccl backend, collectives on device memory through NCCL (built with -DDDP_CUDA)
   (torch.distributed's "nccl" backend, ProcessGroupNCCL)

   A program compiled with -DDDP_CUDA and linked with ddp_cuda.o (nvcc -c ddp_cuda.cu), -lcudart and
   -lnccl can ask for backend "nccl" (ddp_init_desc.backend or DDP_BACKEND=nccl). ddp_init first does
   what the cpu backend does (store, rendezvous, the TCP mesh), then ddp__nccl_attach:
     1. every rank picks its GPU (cudaSetDevice(local_rank)); the ranks agree over the mesh that all
        have one, so a rank without a GPU fails every rank with its reason instead of a hang;
     2. rank 0 makes an ncclUniqueId and puts it in the store under the group's prefix; all get it;
     3. ncclCommInitRank on every rank (subgroups: their own id and communicator, on the same device).

   Dispatch by memory: a collective whose buffers are device memory runs on NCCL, queued on the group's
   stream (ddp_set_stream; NULL = the legacy default stream); one whose buffers are host memory (the
   library's own small agreements: the reducer's model check, ddp_new_group, ...) runs on the cpu path.
   A barrier is a 1-element NCCL all-reduce (torch's barrier on NCCL), so it also waits for the GPUs.
   gather, scatter, all_to_all, all_to_all_v and all_gather_v on device memory move their blocks as
   torch's ProcessGroupNCCL does: grouped ncclSend/ncclRecv (ddp_cuda.cu); monitored_barrier runs over TCP.

   The call check. NCCL trusts its callers: ranks that call different collectives hang or corrupt
   memory. So before each collective the ranks all-gather a small vote (host or device memory) over TCP
   with the call's fingerprint in every frame, as the cpu backend's algorithms do: a rank that
   calls something else (kind, count, dtype, op, root, sequence number) or passes the other kind of
   memory gets DDP_ERR_MISMATCH on every rank. all_to_all_v and all_gather_v first compare their sizes
   per rank over TCP too (ddp__nccl_vote_counts: one more small step), so split sizes or counts that
   differ are DDP_ERR_MISMATCH on every rank, never NCCL work that cannot match. Cost: ceil(log2 world_size) small TCP steps per
   collective (Bruck's all_gather, tcp.c), on the calling thread (tens of microseconds per step within a
   host), paid before the GPU work is queued.

   Completion. A synchronous collective queues its NCCL call, records a CUDA event and waits for it; an
   async one returns a ddp_work holding the event, and ddp_wait waits for it. Waiting is the watchdog
   (ddp__cuda_nccl_wait): it polls the event, ncclCommGetAsyncError, the group's timeout (counted from
   the queueing) and the other ranks' TCP connections; on any failure the communicator is aborted, the
   group breaks (the other ranks hear of it over TCP and abort theirs) and the error names the
   operation and its sequence number. Waiting happens on the calling thread: ddp_wait for nccl work
   must come from the thread that issues the group's collectives. */

#ifdef DDP_CUDA

struct ddp__nccl {
    ddp__cuda_nccl *comm;
    int device;
};

/* Where a rank's buffers of a call are: NONE when it has none to move (gather's non-root without data,
   all_to_all_v's rank whose counts are all 0), which agrees with either side. */
enum { DDP__NCCL_HOST = 0, DDP__NCCL_DEVICE = 1, DDP__NCCL_MIXED = 2, DDP__NCCL_NONE = 3 };

/* Backend "nccl" can be asked for (the message when not: the !DDP_CUDA branch below). */
static ddp_result ddp__nccl_built(char *err) {
    (void)err;
    return DDP_SUCCESS;
}

/* One rank's outcome of an init step, for ddp__nccl_agree. */
typedef struct ddp__nccl_status {
    int32_t code;
    char msg[508];
} ddp__nccl_status;

/* Every rank learns every rank's outcome of a step (over the TCP mesh: g->nccl is not set yet), so
   all fail together with the first failing rank's reason. */
static ddp_result ddp__nccl_agree(ddp_group *g, ddp_result mine, const char *msg, const char *step) {
    ddp__nccl_status me, *all;
    ddp_result r;
    int i;
    memset(&me, 0, sizeof me);
    me.code = (int32_t)mine;
    snprintf(me.msg, sizeof me.msg, "%s", mine ? msg : "");
    if (g->world_size == 1) return mine ? ddp__fail(g, mine, "backend nccl: %s", msg) : DDP_SUCCESS;
    all = (ddp__nccl_status *)ddp__calloc((size_t)g->world_size, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "backend nccl: out of memory");
    if ((r = ddp__mesh_all_gather(g, &me, all, sizeof me, DDP_U8)) != DDP_SUCCESS) {
        ddp__free(all);
        return r;
    }
    for (i = 0; i < g->world_size && r == DDP_SUCCESS; i++) {
        if (all[i].code == DDP_SUCCESS) continue;
        all[i].msg[sizeof all[i].msg - 1] = '\0';
        if (i == g->rank) r = ddp__fail(g, mine, "backend nccl: %s", msg);
        else r = ddp__fail(g, ddp__peer_code(all[i].code, DDP_ERR_INIT), "backend nccl: rank %d could not %s: %s", i, step,
                           all[i].msg);
    }
    ddp__free(all);
    return r;
}

/* Step 2: rank 0's unique id, through the store (a group of one needs no store). */
static ddp_result ddp__nccl_share_id(ddp_group *g, unsigned char *id) {
    char err[DDP__ERR_MAX] = "", key[160];
    size_t size = 0;
    ddp_result r = DDP_SUCCESS;
    if (g->rank == 0) r = ddp__cuda_nccl_unique_id(id, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "make the NCCL unique id")) != DDP_SUCCESS || g->world_size == 1) return r;
    snprintf(key, sizeof key, "%snccl_id", g->member.prefix);
    if (g->rank == 0) r = ddp_store_set(g->member.store, key, id, DDP__CUDA_NCCL_ID_BYTES);
    else r = ddp_store_get(g->member.store, key, id, DDP__CUDA_NCCL_ID_BYTES, &size);
    if (r) snprintf(err, sizeof err, "the NCCL unique id through the store: %.900s", ddp_store_last_error(g->member.store));
    else if (g->rank != 0 && size != DDP__CUDA_NCCL_ID_BYTES)
        r = ddp__fail_to(err, DDP_ERR_FORMAT, "the store's %s holds %zu bytes, not an NCCL unique id (%d bytes)", key, size,
                         DDP__CUDA_NCCL_ID_BYTES);
    return ddp__nccl_agree(g, r, err, "receive the NCCL unique id");
}

static void ddp__nccl_close(ddp_group *g, int orderly) {
    (void)orderly;
    if (!g->nccl) return;
    ddp__cuda_nccl_destroy(g->nccl->comm, g->broken != DDP_SUCCESS);
    ddp__free(g->nccl);
    g->nccl = NULL;
    if (g->host_backend->close) g->host_backend->close(g, orderly); /* the transport under it */
}

/* Where one buffer is (NONE when it holds no elements), and two buffers of one rank together. */
static int ddp__nccl_where_buf(const void *p, uint64_t elements) {
    if (!elements) return DDP__NCCL_NONE;
    return ddp__cuda_is_device_pointer(p) ? DDP__NCCL_DEVICE : DDP__NCCL_HOST;
}

static int ddp__nccl_both(int a, int b) {
    if (a == DDP__NCCL_NONE) return b;
    if (b == DDP__NCCL_NONE) return a;
    return a == b ? a : DDP__NCCL_MIXED;
}

static uint64_t ddp__nccl_sum(const size_t *counts, int n) {
    uint64_t sum = 0;
    int i;
    for (i = 0; i < n; i++) sum += (uint64_t)counts[i]; /* validated: the sums fit */
    return sum;
}

/* Where a call's buffers are, on this rank. A barrier is always NCCL's; a call of 0 elements of the
   first six kinds always the cpu path's (no memory to look at, and the same choice on every rank);
   monitored_barrier runs over TCP. The other calls count only the buffers this rank moves data in or
   out of (gather's recv and scatter's send on the root alone): NONE when it has none. */
static int ddp__nccl_where(const ddp_group *g, const ddp__call *k) {
    int n = g->world_size, root = g->rank == k->root;
    switch (k->kind) {
    case DDP__BARRIER: return DDP__NCCL_DEVICE;
    case DDP__MONITORED_BARRIER:
    case DDP__BROADCAST_BYTES: return DDP__NCCL_HOST; /* (broadcast_bytes never reaches a backend) */
    case DDP__GATHER:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count), ddp__nccl_where_buf(k->buf, root ? k->count : 0));
    case DDP__SCATTER:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, root ? k->count : 0), ddp__nccl_where_buf(k->buf, k->count));
    case DDP__ALL_TO_ALL:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count), ddp__nccl_where_buf(k->buf, k->count));
    case DDP__ALL_TO_ALL_V:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, ddp__nccl_sum(k->send_counts, n)),
                              ddp__nccl_where_buf(k->buf, ddp__nccl_sum(k->recv_counts, n)));
    case DDP__ALL_GATHER_V:
        return ddp__nccl_both(ddp__nccl_where_buf(k->send, k->count),
                              ddp__nccl_where_buf(k->buf, ddp__nccl_sum(k->recv_counts, n)));
    default: break;
    }
    if (k->count == 0) return DDP__NCCL_HOST;
    if (k->kind != DDP__ALL_GATHER && k->kind != DDP__REDUCE_SCATTER) return ddp__nccl_where_buf(k->buf, 1);
    return ddp__nccl_both(ddp__nccl_where_buf(k->buf, 1), ddp__nccl_where_buf(k->send, 1));
}

/* One rank's part of the call check: where its buffers are and, for the _v calls, the first split size
   or count of its own that disagrees with another rank's (at = -1: none). */
typedef struct ddp__nccl_vote {
    uint8_t where;
    uint8_t pad[3];
    int32_t at;     /* all_to_all_v: the sender whose size differs; all_gather_v: the index in counts */
    uint64_t other; /* all_to_all_v: what rank `at` sends this rank; all_gather_v: rank 0's counts[at] */
    uint64_t mine;  /* this rank's recv_counts[at] / counts[at] */
} ddp__nccl_vote;

/* The sizes per rank of the _v calls, which the fingerprint cannot carry (they differ by rank), as the
   TCP backend checks them frame by frame (transport.c) but before any NCCL work is queued: all_to_all_v
   exchanges the send counts (one 8-byte block per pair, pairwise over TCP) and each rank compares what
   every rank will send it with its recv_counts; all_gather_v broadcasts rank 0's counts (a binomial
   tree) and each rank compares its own. Both under the call's fingerprint, so a rank that called
   something else fails there. The finding goes into the vote, which every rank then sees. */
static ddp_result ddp__nccl_vote_counts(ddp_group *g, const ddp__call *k, const ddp__coll *c, ddp__nccl_vote *v) {
    int n = g->world_size, p;
    uint64_t *out, *in;
    ddp__call x;
    ddp_result r;
    v->at = -1;
    if (n == 1 || (k->kind != DDP__ALL_TO_ALL_V && k->kind != DDP__ALL_GATHER_V)) return DDP_SUCCESS;
    if (!(out = (uint64_t *)ddp__calloc(2 * (size_t)n, sizeof *out)))
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory (%d counts)", ddp__coll_name(k->kind), 2 * n);
    in = out + n;
    memset(&x, 0, sizeof x);
    x.dtype = DDP_I64; /* moved, never reduced: the bits of the uint64_t counts */
    x.op = DDP_SUM;
    if (k->kind == DDP__ALL_TO_ALL_V) {
        for (p = 0; p < n; p++) out[p] = (uint64_t)k->send_counts[p];
        x.kind = DDP__ALL_TO_ALL, x.send = out, x.buf = in, x.count = 1, x.root = -1;
    } else {
        for (p = 0; g->rank == 0 && p < n; p++) in[p] = (uint64_t)k->recv_counts[p];
        x.kind = DDP__BROADCAST, x.buf = in, x.count = (size_t)n, x.root = 0;
    }
    if ((r = ddp__tcp_run(g, &x, c)) == DDP_SUCCESS) {
        for (p = 0; p < n && in[p] == (uint64_t)k->recv_counts[p]; p++) {
        }
        if (p < n) v->at = p, v->other = in[p], v->mine = (uint64_t)k->recv_counts[p];
    }
    ddp__free(out);
    return r;
}

/* A _v call's sizes differ: the same message on every rank (the smallest (sender, receiver) pair for
   all_to_all_v, as the mpi backend picks it; the first rank and index for all_gather_v). */
static ddp_result ddp__nccl_counts_differ(ddp_group *g, const ddp__coll *c, const ddp__nccl_vote *all, const char *desc) {
    int n = g->world_size, i, best = -1;
    int64_t key, best_key = INT64_MAX;
    for (i = 0; i < n; i++) {
        if (all[i].at < 0) continue;
        key = c->kind == DDP__ALL_TO_ALL_V ? (int64_t)all[i].at * n + i : (int64_t)i * n + all[i].at;
        if (key < best_key) best_key = key, best = i;
    }
    if (best < 0) return DDP_SUCCESS;
    if (c->kind == DDP__ALL_TO_ALL_V)
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "split sizes differ in %s: rank %d sends %llu elements to rank %d "
                              "(its send_counts[%d]) while rank %d expects %llu from rank %d (its recv_counts[%d]); "
                              "rank i's send_counts[j] must equal rank j's recv_counts[i]", desc, (int)all[best].at,
                              (unsigned long long)all[best].other, best, best, best, (unsigned long long)all[best].mine,
                              (int)all[best].at, (int)all[best].at);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank 0 passes counts[%d] = %llu while rank %d passes "
                          "counts[%d] = %llu; every rank must pass the same counts (rank r's count is counts[r])", desc,
                          (int)all[best].at, (unsigned long long)all[best].other, best, (int)all[best].at,
                          (unsigned long long)all[best].mine);
}

/* The call check (see the top): each rank's vote (where its buffers are; for the _v calls, after
   ddp__nccl_vote_counts, whether its sizes agree) gathered over TCP (Bruck's: ceil(log2 N) steps)
   under the call's fingerprint. Every rank sees every vote, so all decide alike: one rank's buffers
   in both kinds of memory, sizes that differ, or device memory on one rank and host memory on
   another fail every rank; else *where becomes the call's side (NONE votes agree with either; all
   NONE: the host side, which moves nothing and only agrees). */
static ddp_result ddp__nccl_check(ddp_group *g, const ddp__call *k, const ddp__coll *c, int *where) {
    static const char *names[] = {"host", "device", "host and device", "no"};
    char desc[160];
    ddp__nccl_vote me, *all = &me;
    int i, n = g->world_size, ref = -1, bad = -1;
    ddp_result r;
    memset(&me, 0, sizeof me);
    me.where = (uint8_t)*where;
    if ((r = ddp__nccl_vote_counts(g, k, c, &me)) != DDP_SUCCESS) return r;
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (n > 1) {
        if (!(all = (ddp__nccl_vote *)ddp__calloc((size_t)n, sizeof *all)))
            return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", desc);
        all[g->rank] = me;
        if ((r = ddp__do_all_gather(g, c, all + g->rank, all, sizeof me, DDP_U8)) != DDP_SUCCESS) {
            ddp__free(all);
            return r;
        }
    }
    for (i = 0; i < n && bad < 0; i++)
        if (all[i].where > DDP__NCCL_NONE || all[i].where == DDP__NCCL_MIXED) bad = i;
    if (bad >= 0) {
        r = ddp__coll_fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: rank %d passed one buffer in device memory and one in host "
                           "memory; on the nccl backend both are device memory (NCCL) or both host memory", desc, bad);
    } else if ((r = ddp__nccl_counts_differ(g, c, all, desc)) == DDP_SUCCESS) {
        for (i = 0; i < n && bad < 0; i++) {
            if (all[i].where == DDP__NCCL_NONE) continue;
            if (ref < 0) ref = i;
            else if (all[i].where != all[ref].where) bad = i;
        }
        if (bad >= 0)
            r = ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d passed %s memory while rank %d passed %s memory; on the "
                               "nccl backend every rank passes device memory (NCCL) or every rank host memory", desc, bad,
                               names[all[bad].where], ref, names[all[ref].where]);
        *where = ref < 0 ? (int)DDP__NCCL_HOST : (int)all[ref].where;
    }
    if (all != &me) ddp__free(all);
    return r;
}

static ddp__cuda_coll ddp__nccl_kind(int kind) {
    switch (kind) {
    case DDP__ALL_REDUCE: return DDP__CUDA_ALL_REDUCE;
    case DDP__BROADCAST: return DDP__CUDA_BROADCAST;
    case DDP__REDUCE: return DDP__CUDA_REDUCE;
    case DDP__ALL_GATHER: return DDP__CUDA_ALL_GATHER;
    case DDP__REDUCE_SCATTER: return DDP__CUDA_REDUCE_SCATTER;
    case DDP__GATHER: return DDP__CUDA_GATHER;
    case DDP__SCATTER: return DDP__CUDA_SCATTER;
    case DDP__ALL_TO_ALL: return DDP__CUDA_ALL_TO_ALL;
    case DDP__ALL_TO_ALL_V: return DDP__CUDA_ALL_TO_ALL_V;
    case DDP__ALL_GATHER_V: return DDP__CUDA_ALL_GATHER_V;
    default: return DDP__CUDA_BARRIER;
    }
}

/* Queue the NCCL call and its event (after the call check). */
static ddp_result ddp__nccl_enqueue(ddp_group *g, const ddp__call *k, const ddp__coll *c, void **event) {
    char err[DDP__ERR_MAX] = "", desc[160];
    ddp_result r;
    if (k->kind == DDP__ALL_TO_ALL_V || k->kind == DDP__ALL_GATHER_V)
        r = ddp__cuda_nccl_enqueue_v(g->nccl->comm, ddp__nccl_kind(k->kind), k->send, k->send_counts, k->buf, k->recv_counts,
                                     k->dtype, event, err, sizeof err);
    else
        r = ddp__cuda_nccl_enqueue(g->nccl->comm, ddp__nccl_kind(k->kind), k->send, k->buf, k->count, k->dtype, k->op,
                                   k->root, event, err, sizeof err);
    if (r == DDP_SUCCESS) return r;
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__coll_fail(g, r, "%s on rank %d: %s", desc, g->rank, err);
}

/* What the watchdog looks at besides NCCL: the other ranks' connections (a failed rank says why). */
typedef struct ddp__nccl_watching {
    ddp_group *g;
    const ddp__coll *c;
} ddp__nccl_watching;

static ddp_result ddp__nccl_watch(void *user) {
    ddp__nccl_watching *w = (ddp__nccl_watching *)user;
    return ddp__check_peers(w->g, w->c);
}

/* Wait for an event under the watchdog; on failure the group is broken with the message. */
/* Wait for event under the watchdog; desc names the work in messages, c is what the watch checks
   the peers against. */
static ddp_result ddp__nccl_wait_described(ddp_group *g, const ddp__coll *c, const char *desc, void *event) {
    char err[DDP__ERR_MAX] = "";
    ddp__nccl_watching w;
    ddp_result r;
    w.g = g;
    w.c = c;
    r = ddp__cuda_nccl_wait(g->nccl->comm, event, g->timeout, desc, ddp__nccl_watch, &w, err, sizeof err);
    if (r == DDP_SUCCESS) return r;
    if (g->broken) return g->broken; /* the watch broke the group with the other rank's reason */
    return ddp__coll_fail(g, r, "rank %d: %s", g->rank, err);
}

static ddp_result ddp__nccl_wait_event(ddp_group *g, const ddp__coll *c, void *event) {
    char desc[160];
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__nccl_wait_described(g, c, desc, event);
}

/* Device calls run on NCCL; host calls, once checked, on the transport the group had before NCCL. A
   rank with nothing to move in a device call (all_to_all_v with all its counts 0) queues nothing: the
   others' ncclSend/ncclRecv pairs do not involve it. */
static ddp_result ddp__nccl_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    int mine = ddp__nccl_where(g, k), where = mine;
    void *event = NULL;
    ddp_result r;
    if ((r = ddp__nccl_check(g, k, c, &where)) != DDP_SUCCESS) return r;
    if (where == DDP__NCCL_HOST) return g->host_backend->run(g, k, c);
    if (mine == DDP__NCCL_NONE) return DDP_SUCCESS;
    if ((r = ddp__nccl_enqueue(g, k, c, &event)) != DDP_SUCCESS) return r;
    return ddp__nccl_wait_event(g, c, event);
}

/* The backend's enqueue: a device call is checked and queued on the stream now, on the calling thread
   (so it is ordered after the caller's kernels), and its ddp_work holds the event. Returns 0 for a host
   call, which the progress thread runs as on the cpu backend, and for a rank with nothing to move (its
   check runs there too; the call's side is known only after it). */
static int ddp__nccl_enqueue_async(ddp_group *g, const ddp__call *k, ddp_work **out, ddp_result *res) {
    char msg[DDP__ERR_MAX];
    ddp_work *w;
    ddp_result r;
    int where = ddp__nccl_where(g, k);
    if (where == DDP__NCCL_HOST || where == DDP__NCCL_NONE) return 0; /* the progress thread runs it */
    ddp__drain(g); /* queued host work uses the mesh: let it finish first */
    if (g->broken) {
        *res = ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, k, msg));
        return 1;
    }
    if (!(w = (ddp_work *)ddp__calloc(1, sizeof *w))) {
        *res = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
        return 1;
    }
    w->g = g;
    w->call = *k;
    w->owner = g->backend;
    pthread_mutex_lock(&g->async.mu);
    ddp__fingerprint(g, k, &w->coll);
    pthread_mutex_unlock(&g->async.mu);
    r = ddp__nccl_check(g, k, &w->coll, &where); /* DEVICE (or MIXED) here: an error unless every rank agrees */
    if (r == DDP_SUCCESS) r = ddp__nccl_enqueue(g, k, &w->coll, &w->handle);
    if (r != DDP_SUCCESS) {
        ddp__free(w);
        *res = ddp__fail(g, r, "%s", g->broken_msg);
        return 1;
    }
    *out = w;
    *res = DDP_SUCCESS;
    return 1;
}

/* The backend's wait for the work enqueue took: wait for its event under the watchdog, release w. */
static ddp_result ddp__nccl_wait_work(ddp_work *w) {
    ddp_group *g = w->g;
    ddp_result r;
    if (g->broken) { /* release the event; the communicator is aborted if its work is not done */
        char msg[DDP__ERR_MAX];
        ddp__cuda_nccl_wait(g->nccl->comm, w->handle, 0, "", NULL, NULL, NULL, 0);
        r = ddp__fail(g, DDP_ERR_STATE, "%s", ddp__broken_message(g, &w->call, msg));
    } else if ((r = ddp__nccl_wait_event(g, &w->coll, w->handle)) != DDP_SUCCESS) {
        ddp__fail(g, r, "%s", g->broken_msg);
    }
    ddp__free(w);
    return r;
}

static int ddp__nccl_test_work(ddp_work *w) { return ddp__cuda_nccl_test(w->g->nccl->comm, w->handle); }

DDP_API ddp_result ddp_set_stream(ddp_group *g, void *cuda_stream) {
    ddp_result r = ddp__group_check(g, "ddp_set_stream"); /* NULL: DDP_ERR_INVALID_ARGUMENT; destroyed: DDP_ERR_STATE */
    if (r) return r;
    if (!g->nccl)
        return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_set_stream: the group's backend is \"%s\"; CUDA streams belong to "
                         "the nccl backend", g->backend->family);
    ddp__cuda_nccl_set_stream(g->nccl->comm, cuda_stream);
    return DDP_SUCCESS;
}

/* ---- what the reducer asks of the nccl backend (ddp__backend's memory functions): buckets in
   device memory; the copies are ddp_cuda.cu's bucket kernels on the group's stream. The reducer calls
   them on the thread that issues the group's collectives, whose current device ddp_init set. ---- */

static void ddp__nccl_report(ddp_group *g, ddp_result r, const char *err) {
    if (r) ddp__coll_fail(g, r, "reducer (nccl): %s", err); /* breaks the group: the next collective fails */
}

static void *ddp__nccl_alloc(ddp_group *g, size_t bytes) {
    char err[DDP__ERR_MAX] = "";
    void *p = NULL;
    if (ddp__cuda_nccl_alloc(g->nccl->comm, bytes ? bytes : 1, &p, err, sizeof err) != DDP_SUCCESS)
        ddp__log(g, DDP_LOG_ERROR, "reducer (nccl): %s", err);
    return p;
}

static void ddp__nccl_release(ddp_group *g, void *p) { ddp__cuda_nccl_free(g->nccl->comm, p); }

static void ddp__nccl_zero(ddp_group *g, void *dst, size_t bytes) {
    char err[DDP__ERR_MAX] = "";
    ddp__nccl_report(g, ddp__cuda_nccl_zero(g->nccl->comm, dst, bytes, err, sizeof err), err);
}

/* The bucket kernels' table for one tensor of *numel elements of t at *slot, on g's stream. */
static void ddp__nccl_one_tensor(ddp_group *g, ddp_cuda_grads_args *a, void **slot, const int64_t *numel, ddp_dtype t,
                                 char *err) {
    memset(a, 0, sizeof *a);
    a->count = 1;
    a->grads = slot;
    a->numels = numel;
    a->dtype = t;
    a->stream = ddp__cuda_nccl_stream(g->nccl->comm);
    a->err = err;
    a->err_size = DDP__ERR_MAX;
}

/* dst = src * scale converted, by the bucket kernel: one tensor, dst as a bucket of count elements. */
static void ddp__nccl_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                     size_t count, double scale) {
    char err[DDP__ERR_MAX] = "";
    void *slot = (void *)src;
    int64_t numel = (int64_t)count;
    ddp_cuda_grads_args a;
    ddp__nccl_one_tensor(g, &a, &slot, &numel, src_t, err);
    ddp__nccl_report(g, ddp_cuda_bucket_copy_in(&a, dst, dst_t, numel, NULL, scale), err);
}

/* dst = src converted. Equal dtypes are a plain copy, which also moves the used map between host and
   device memory: then it waits for the copy under the watchdog before the host memory is touched. */
static void ddp__nccl_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    char err[DDP__ERR_MAX] = "";
    ddp_result r;
    if (dst_t == src_t) {
        void *event = NULL;
        ddp__coll c;
        char desc[160];
        size_t bytes = count * ddp_dtype_size(dst_t);
        r = ddp__cuda_nccl_copy(g->nccl->comm, dst, src, bytes, &event, err, sizeof err);
        if (r || !event) {
            ddp__nccl_report(g, r, err);
            return;
        }
        memset(&c, 0, sizeof c); /* the watch only needs the peers' state; no collective is running */
        c.seq = g->seq;
        c.kind = DDP__BARRIER;
        snprintf(desc, sizeof desc, "the reducer's copy of %zu bytes (after collective #%llu)", bytes,
                 (unsigned long long)(g->seq - g->seq_base));
        ddp__nccl_wait_described(g, &c, desc, event);
        return;
    }
    {
        void *slot = dst;
        int64_t numel = (int64_t)count;
        ddp_cuda_grads_args a;
        ddp__nccl_one_tensor(g, &a, &slot, &numel, dst_t, err);
        ddp__nccl_report(g, ddp_cuda_bucket_copy_out(&a, src, src_t, numel, NULL, 1.0), err);
    }
}

/* Collectives on device memory through NCCL, on host memory through the group's transport. */
static const ddp__backend ddp__backend_nccl = {
    "nccl", "nccl", ddp__nccl_run, ddp__nccl_enqueue_async, ddp__nccl_wait_work, ddp__nccl_test_work, ddp__nccl_close,
    ddp__nccl_alloc, ddp__nccl_release, ddp__nccl_zero, ddp__nccl_copy_in_scaled, ddp__nccl_copy_out};

/* Give g an NCCL communicator: on the device chosen by local rank for the world group (parent NULL),
   on the parent's device and stream for a subgroup. Collective over g, which must be connected (mesh
   and store) and not have one yet. Then the nccl backend takes g's calls. */
static ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent) {
    char err[DDP__ERR_MAX] = "", key[160];
    unsigned char id[DDP__CUDA_NCCL_ID_BYTES];
    ddp__cuda_nccl *comm = NULL;
    struct ddp__nccl *n;
    ddp_result r = DDP_SUCCESS;
    int device = parent ? parent->device : -1;
    if (!parent) r = ddp__cuda_nccl_device(g->local_rank, &device, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "use a GPU")) != DDP_SUCCESS) return r;
    if ((r = ddp__nccl_share_id(g, id)) != DDP_SUCCESS) return r;
    r = ddp__cuda_nccl_create(id, g->rank, g->world_size, device, &comm, err, sizeof err);
    if ((r = ddp__nccl_agree(g, r, err, "create its NCCL communicator")) != DDP_SUCCESS) {
        ddp__cuda_nccl_destroy(comm, 1);
        return r;
    }
    if (g->rank == 0 && g->world_size > 1) { /* everyone has read it */
        snprintf(key, sizeof key, "%snccl_id", g->member.prefix);
        ddp_store_delete(g->member.store, key, NULL);
    }
    if (!(n = (struct ddp__nccl *)ddp__calloc(1, sizeof *n))) {
        ddp__cuda_nccl_destroy(comm, 1);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "backend nccl: out of memory");
    }
    n->comm = comm;
    n->device = device;
    if (parent) ddp__cuda_nccl_set_stream(comm, ddp__cuda_nccl_stream(parent->comm));
    g->nccl = n;
    g->backend = &ddp__backend_nccl; /* host_backend stays: host-memory calls keep their transport */
    ddp__log(g, DDP_LOG_INFO, "nccl: rank %d of %d on CUDA device %d", g->rank, g->world_size, device);
    return DDP_SUCCESS;
}

#else /* !DDP_CUDA: the backend is not in this build */

struct ddp__nccl {
    int unused;
};

static ddp_result ddp__nccl_built(char *err) {
    return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "backend \"nccl\" is not available in this build: compile the file that "
                        "defines DDP_IMPLEMENTATION with -DDDP_CUDA and link it with ddp_cuda.o (nvcc -c ddp_cuda.cu), "
                        "-lcudart and -lnccl; or use backend \"cpu\" (or NULL for the default)");
}

static ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent) {
    (void)parent;
    return ddp__fail(g, DDP_ERR_STATE, "internal error: an nccl group in a build without DDP_CUDA");
}

DDP_API ddp_result ddp_set_stream(ddp_group *g, void *cuda_stream) {
    ddp_result r = ddp__group_check(g, "ddp_set_stream");
    (void)cuda_stream;
    if (r) return r;
    return ddp__fail(g, DDP_ERR_UNSUPPORTED, "ddp_set_stream: the group's backend is \"%s\"; CUDA streams belong to the "
                     "nccl backend (a build with -DDDP_CUDA)", g->backend->family);
}

#endif /* DDP_CUDA */
/* ==================== end src/nccl.c ==================== */

/* ==================== begin src/group.c ==================== */
/* [SECTION] group: ddp_init (torch.distributed.init_process_group), launcher environments,
   rendezvous, the mesh of connections, subgroups (new_group), ddp_destroy

   ddp_init in five steps:
     1. who am I: rank and world size from the descriptor or the launcher's environment
        (ddp__read_launch: torchrun/ddprun, Open MPI, MPICH/Hydra, SLURM, in that order);
     2. where is the master: init_method, descriptor, MASTER_ADDR/MASTER_PORT, launcher defaults;
     3. the store: rank 0 serves it (store.c) and every rank connects (or a file store);
     4. rendezvous (ddp__rendezvous): each rank claims its rank by publishing "world size, address,
        port, pid, host", rank 0 gathers the records and publishes them as one table,
        every other rank waits for that table once: O(1) store requests per rank (see "the table of
        records" below); any disagreement is published (an "abort" key, and as the table's value) and
        wakes every waiting rank, so a bad rank fails everyone quickly instead of leaving them to time out;
     5. the mesh: one TCP connection per pair of ranks, then a barrier over it. */


typedef struct ddp__launch {
    int rank, world_size;
    int local_rank, local_world_size; /* -1 when the launcher did not say */
    const char *source;               /* where rank and world size came from, for messages */
    char master_addr[256];
    int master_port;                  /* 0: none given */
    const char *file_path;            /* init_method file:// */
    int restart_count;
    int agent_store;                  /* TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves the store */
} ddp__launch;

/* Launchers, in the order they are consulted (the first whose rank variable is set wins). */
static const struct {
    const char *rank, *size, *local_rank, *local_size, *name;
} ddp__launchers[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun/ddprun (RANK, WORLD_SIZE)"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
     "Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)"},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH/Hydra (PMI_RANK, PMI_SIZE)"},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL, "SLURM (SLURM_PROCID, SLURM_NTASKS)"},
};

/* "node[01-04,07],gpu5" -> "node01": the first host of a SLURM node list. */
static void ddp__slurm_first_host(const char *list, char *out, size_t cap) {
    size_t i = 0, o = 0;
    while (list[i] && list[i] != ',' && list[i] != '[' && o + 1 < cap) out[o++] = list[i++];
    if (list[i] == '[')
        for (i++; list[i] && list[i] != ',' && list[i] != '-' && list[i] != ']' && o + 1 < cap;) out[o++] = list[i++];
    out[o] = '\0';
}

static ddp_result ddp__parse_tcp_url(const char *url, ddp__launch *L, char *err) {
    const char *hp = url + strlen("tcp://"), *colon;
    char *end;
    long port;
    size_t hl;
    if (*hp == '[') { /* [ipv6]:port */
        const char *close = strchr(hp, ']');
        if (!close || close[1] != ':') goto bad;
        hl = (size_t)(close - hp - 1);
        hp++;
        colon = close + 1;
    } else {
        colon = strrchr(hp, ':');
        if (!colon) goto bad;
        hl = (size_t)(colon - hp);
    }
    if (hl == 0 || hl >= sizeof L->master_addr) goto bad;
    memcpy(L->master_addr, hp, hl);
    L->master_addr[hl] = '\0';
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    if (errno || *end || port < 1 || port > 65535) goto bad;
    L->master_port = (int)port;
    return DDP_SUCCESS;
bad:
    return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" is not tcp://host:port with a port in 1..65535", url);
}

/* The local rank and size that launcher i gave: 0 <= local rank < local size <= world size. torchrun
   sets LOCAL_RANK and LOCAL_WORLD_SIZE together, so one without the other is a broken environment;
   the other launchers may give the local rank alone (the rendezvous then counts the ranks per host). */
static ddp_result ddp__check_local(const ddp__launch *L, int i, char *err) {
    const char *lr = ddp__launchers[i].local_rank, *ls = ddp__launchers[i].local_size;
    if (i == 0 && (L->local_rank >= 0) != (L->local_world_size >= 0))
        return ddp__fail_to(err, DDP_ERR_INIT, "%s is set but %s is not; set both (as torchrun and ddprun do) or neither",
                            L->local_rank >= 0 ? lr : ls, L->local_rank >= 0 ? ls : lr);
    if (L->local_world_size > L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is larger than %s=%d: a host cannot have more ranks than the world; "
                            "check the launcher's settings", ls, L->local_world_size, ddp__launchers[i].size, L->world_size);
    if (L->local_world_size >= 0 && L->local_rank >= L->local_world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is out of range for %s=%d; local ranks are 0..%d: check the "
                            "launcher's settings", lr, L->local_rank, ls, L->local_world_size, L->local_world_size - 1);
    if (L->local_rank >= L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is out of range for %s=%d; check the launcher's settings", lr,
                            L->local_rank, ddp__launchers[i].size, L->world_size);
    return DDP_SUCCESS;
}

/* Step 1 and 2: rank, world size, local rank, master, from the descriptor and the environment. */
static ddp_result ddp__read_launch(const ddp_init_desc *d, ddp__launch *L, char *err) {
    long v = 0;
    int i, found = 0;
    memset(L, 0, sizeof *L);
    L->local_rank = L->local_world_size = -1;
    L->world_size = 1;
    L->source = "no launcher (a single process)";
    if (d->world_size > 0) {
        L->rank = d->rank;
        L->world_size = d->world_size;
        L->source = "the descriptor (ddp_init_desc.rank, .world_size)";
        found = 1;
    } else if (d->world_size < 0) {
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.world_size is %d; use 0 (from the environment) or a positive number",
                            d->world_size);
    }
    for (i = 0; !found && i < (int)(sizeof ddp__launchers / sizeof ddp__launchers[0]); i++) {
        int has_rank = ddp__env(ddp__launchers[i].rank) != NULL, has_size = ddp__env(ddp__launchers[i].size) != NULL;
        if (!has_rank && !has_size) continue;
        if (has_rank != has_size)
            return ddp__fail_to(err, DDP_ERR_INIT, "%s is set but %s is not; the launcher (%s) must set both",
                                has_rank ? ddp__launchers[i].rank : ddp__launchers[i].size,
                                has_rank ? ddp__launchers[i].size : ddp__launchers[i].rank, ddp__launchers[i].name);
        if (ddp__env_int(ddp__launchers[i].size, 1, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
        L->world_size = (int)v;
        if (ddp__env_int(ddp__launchers[i].rank, 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
        L->rank = (int)v;
        if (ddp__env_int(ddp__launchers[i].local_rank, 0, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
        if (ddp__env(ddp__launchers[i].local_rank)) L->local_rank = (int)v;
        if (ddp__launchers[i].local_size) {
            if (ddp__env_int(ddp__launchers[i].local_size, 1, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
            if (ddp__env(ddp__launchers[i].local_size)) L->local_world_size = (int)v;
        }
        L->source = ddp__launchers[i].name;
        found = 1;
        if (ddp__check_local(L, i, err) != DDP_SUCCESS) return DDP_ERR_INIT;
    }
    if (L->rank < 0 || L->rank >= L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "rank %d is out of range for world size %d (from %s); ranks are 0..%d",
                            L->rank, L->world_size, L->source, L->world_size - 1);
    if (ddp__env_int("DDP_RESTART_COUNT", 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
    if (ddp__env("DDP_RESTART_COUNT")) L->restart_count = (int)v;
    else if (ddp__env("TORCHELASTIC_RESTART_COUNT")) {
        if (ddp__env_int("TORCHELASTIC_RESTART_COUNT", 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
        L->restart_count = (int)v;
    }
    /* Plain torchrun (static rendezvous, no --standalone) serves a TCPStore from its agent on
       MASTER_ADDR:MASTER_PORT and says so; then every rank, rank 0 too, is a client (as torch's
       _create_c10d_store does, for tcp:// and env:// alike). */
    L->agent_store = ddp__env("TORCHELASTIC_USE_AGENT_STORE") && strcmp(ddp__env("TORCHELASTIC_USE_AGENT_STORE"), "True") == 0;

    /* the master */
    if (d->init_method && strncmp(d->init_method, "tcp://", 6) == 0) return ddp__parse_tcp_url(d->init_method, L, err);
    if (d->init_method && strncmp(d->init_method, "file://", 7) == 0) {
        L->file_path = d->init_method + 7;
        if (!*L->file_path)
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" names no file; use file:///path/to/file", d->init_method);
        return DDP_SUCCESS;
    }
    if (d->init_method && strcmp(d->init_method, "env://") != 0)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" is not env://, tcp://host:port or file:///path",
                            d->init_method);
    if (d->master_addr && *d->master_addr) snprintf(L->master_addr, sizeof L->master_addr, "%s", d->master_addr);
    else if (ddp__env("MASTER_ADDR")) snprintf(L->master_addr, sizeof L->master_addr, "%s", ddp__env("MASTER_ADDR"));
    if (d->master_port < 0 || d->master_port > 65535)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.master_port %d is not in 1..65535", d->master_port);
    if (d->master_port) L->master_port = d->master_port;
    else if (ddp__env_int("MASTER_PORT", 1, 65535, &v, err) < 0) return DDP_ERR_INIT;
    else if (ddp__env("MASTER_PORT")) L->master_port = (int)v;
    if (L->world_size == 1 && !L->master_addr[0] && !L->master_port) return DDP_SUCCESS; /* alone: no store */

    /* Under mpirun / srun nobody sets MASTER_*: rank 0's host and a port derived from the job id. */
    if (!L->master_addr[0] && strncmp(L->source, "torchrun", 8) != 0 && strncmp(L->source, "the desc", 8) != 0) {
        if (ddp__env("SLURM_STEP_NODELIST") || ddp__env("SLURM_NODELIST"))
            ddp__slurm_first_host(ddp__env("SLURM_STEP_NODELIST") ? ddp__env("SLURM_STEP_NODELIST") : ddp__env("SLURM_NODELIST"),
                                  L->master_addr, sizeof L->master_addr);
        else
            snprintf(L->master_addr, sizeof L->master_addr, "127.0.0.1");
    }
    if (!L->master_port && strncmp(L->source, "torchrun", 8) != 0 && strncmp(L->source, "the desc", 8) != 0) {
        static const char *job_ids[] = {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "SLURM_JOB_ID", "PMI_ID", "HYDI_CONTROL_FD"};
        char id[256] = "";
        for (i = 0; i < (int)(sizeof job_ids / sizeof job_ids[0]); i++)
            if (ddp__env(job_ids[i])) {
                snprintf(id, sizeof id, "%s%s", ddp__env(job_ids[i]), ddp__env("SLURM_STEP_ID") ? ddp__env("SLURM_STEP_ID") : "");
                break;
            }
        /* 20000-31999: below Linux's ephemeral range (32768-60999), so no outgoing connection holds it */
        L->master_port = id[0] ? 20000 + (int)(ddp__hash(id) % 12000u) : 29500;
    }
    if (!L->master_addr[0])
        return ddp__fail_to(err, DDP_ERR_INIT, "MASTER_ADDR is not set: %s gave rank %d of %d, but not where rank 0 is. "
                            "Set MASTER_ADDR (and MASTER_PORT), ddp_init_desc.master_addr, or init_method tcp://host:port",
                            L->source, L->rank, L->world_size);
    if (!L->master_port)
        return ddp__fail_to(err, DDP_ERR_INIT, "MASTER_PORT is not set (MASTER_ADDR is %s); set MASTER_PORT, "
                            "ddp_init_desc.master_port, or init_method tcp://host:port", L->master_addr);
    return DDP_SUCCESS;
}

static double ddp__read_timeout(const ddp_init_desc *d, char *err, ddp_result *res) {
    const char *v;
    char *end;
    double t;
    *res = DDP_SUCCESS;
    if (d->timeout_seconds > 0) return d->timeout_seconds;
    if (d->timeout_seconds < 0) {
        *res = ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.timeout_seconds is %g; use 0 (default) or a positive number",
                            d->timeout_seconds);
        return 0;
    }
    if (!(v = ddp__env("DDP_TIMEOUT"))) return 300.0;
    t = strtod(v, &end);
    if (end == v || *end || !(t > 0) || t > 1e9) {
        *res = ddp__fail_to(err, DDP_ERR_INIT, "DDP_TIMEOUT=\"%s\" is not a positive number of seconds", v);
        return 0;
    }
    return t;
}

/* ---- rendezvous through the store ---- */

static void ddp__key(const ddp_group *g, char *out, size_t cap, const char *name, int index) {
    if (index >= 0) snprintf(out, cap, "%s%s/%d", g->member.prefix, name, index);
    else snprintf(out, cap, "%s%s", g->member.prefix, name);
}

/* Fail this rank with code and message, and publish them so that every rank of the rendezvous fails too:
   under "abort" (read by the ranks that look for it: the set-up's collectives, ranks arriving late) and, unless rank 0
   published the table already, as the table's value (DDP__RDZV_ABORTED + "code|message"); then "ready",
   which wakes every rank waiting for the table at once (see ddp__rendezvous). The set is announced, a
   round trip: every write has reached the store before this rank goes. */
static ddp_result ddp__rdzv_abort(ddp_group *g, ddp_result code, const char *msg) {
    char key[256], value[DDP__ERR_MAX + 16], marker[DDP__ERR_MAX + 32], now[8];
    size_t n = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(value, sizeof value, "%d|%.1000s", (int)code, msg);
    ddp_store_set(g->member.store, key, value, strlen(value));
    ddp__key(g, key, sizeof key, "table", -1);
    snprintf(marker, sizeof marker, "%s%s", DDP__RDZV_ABORTED, value);
    ddp__store_compare_set(g->member.store, key, "", 0, marker, strlen(marker), now, sizeof now, &n);
    ddp__key(g, key, sizeof key, "ready", -1); /* a SET: torch's server wakes no WAIT on a compare-set */
    ddp_store_set(g->member.store, key, "1", 1);
    return ddp__fail(g, code, "%s", msg);
}

static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted);

/* Publish this rank's error (g->error) as the abort, unless one is there already. */
static void ddp__rdzv_publish(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(msg, sizeof msg, "%s", g->error);
    if (g->member.store && ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
        ddp__rdzv_abort(g, code, msg);
}

/* A rendezvous failed on this rank: publish the error (unless another rank already published one:
   then a rank that only lost a peer fails with the published reason, which is the cause, rather than
   "lost rank i"), hang up its connections and listener, and if this rank serves the store, keep serving until
   every other process has read it (at most a few seconds, for ranks that never started), so that they
   fail with the reason instead of "lost the store". Every other process counts itself in abort_seen,
   whether or not it had joined: one that was still claiming its rank when the error came (a slow start,
   the second of two processes with one rank) must find the store still there. Returns the code this
   rank fails with. */
static ddp_result ddp__rdzv_fail_all(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0, aborted = 0;
    int64_t seen = 0;
    double until = ddp__now() + DDP__MIN(g->timeout, 5.0);
    if (!g->member.store) return code;
    snprintf(msg, sizeof msg, "%s", g->error);
    ddp__key(g, key, sizeof key, "abort", -1);
    if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS) return code;
    if (!exists) ddp__rdzv_abort(g, code, msg);
    if (exists && code == DDP_ERR_PEER_LOST) {
        ddp_result published = ddp__rdzv_check_abort(g, &aborted);
        if (aborted) code = published;
        snprintf(msg, sizeof msg, "%s", g->error);
    }
    ddp__fail(g, code, "%s", msg);
    ddp__link_close_all(g); /* at once, not at ddp__group_free: a rank waiting on one fails now and reads why */
    ddp__key(g, key, sizeof key, "abort_seen", -1);
    if (!g->member.store_server) { /* done with the store: the rank serving it may stop waiting for us */
        ddp_store_add(g->member.store, key, 1, &seen);
        return code;
    }
    while (ddp__now() < until && ddp_store_add(g->member.store, key, 0, &seen) == DDP_SUCCESS && seen < g->world_size - 1)
        ddp__sleep(0.01);
    ddp__fail(g, code, "%s", msg);
    return code;
}

/* Fail with the abort another rank published: value is "code|message". */
static ddp_result ddp__rdzv_fail_published(ddp_group *g, const char *value) {
    int code = DDP_ERR_INIT;
    sscanf(value, "%d|", &code);
    return ddp__fail(g, ddp__peer_code(code, DDP_ERR_INIT), "%s", strchr(value, '|') ? strchr(value, '|') + 1 : value);
}

/* Another rank published an abort: fail with its code and message. */
static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted) {
    char key[256], value[DDP__ERR_MAX + 16];
    size_t n = 0;
    int exists = 0;
    ddp_result r;
    *aborted = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    if (!exists) return DDP_SUCCESS;
    *aborted = 1;
    if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    return ddp__rdzv_fail_published(g, value);
}

/* What each rank publishes about itself: "world=W port=P pid=PID addr=A host=H node=N". */
typedef struct ddp__record {
    int world, port, pid;
    char addr[128], host[128];
    unsigned long long node; /* ddp__node_key() of its process; 0 when not published */
} ddp__record;

static int ddp__record_parse(const char *value, ddp__record *r) {
    memset(r, 0, sizeof *r);
    return sscanf(value, "world=%d port=%d pid=%d addr=%127s host=%127s node=%llx", &r->world, &r->port, &r->pid, r->addr,
                  r->host, &r->node) >= 5;
}

#define DDP__RECORD_MAX 400 /* bytes of one record's text, with room to spare */
static void ddp__record_format(const ddp__record *r, char *out, size_t cap) {
    snprintf(out, cap, "world=%d port=%d pid=%d addr=%s host=%s node=%llx", r->world, r->port, r->pid, r->addr, r->host,
             r->node);
}

/* One rank's line of the table that rank 0 publishes: "port pid node addr host", with "-" for an address
   or host name equal to the rank before's (ranks of one host are neighbours), so that the table every
   rank reads is about 25 bytes a rank rather than a record's 100: at 10,000 ranks the store sends it
   10,000 times. The world size is not repeated: rank 0 checked every record's. */
static void ddp__table_line(const ddp__record *rec, int i, char *out, size_t cap) {
    int same_addr = i > 0 && strcmp(rec[i].addr, rec[i - 1].addr) == 0, same_host = i > 0 && strcmp(rec[i].host, rec[i - 1].host) == 0;
    snprintf(out, cap, "%d %d %llx %s %s", rec[i].port, rec[i].pid, rec[i].node, same_addr ? "-" : rec[i].addr,
             same_host ? "-" : rec[i].host);
}

static int ddp__table_parse(const char *line, ddp__record *rec, int i, int world) {
    ddp__record *r = &rec[i];
    memset(r, 0, sizeof *r);
    r->world = world;
    if (sscanf(line, "%d %d %llx %127s %127s", &r->port, &r->pid, &r->node, r->addr, r->host) != 5) return 0;
    if (strcmp(r->addr, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->addr, rec[i - 1].addr, sizeof r->addr);
    }
    if (strcmp(r->host, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->host, rec[i - 1].host, sizeof r->host);
    }
    return 1;
}

/* ---- noticing a rank that died inside ddp_init ----
   Once a rank has published its record it listens on its port (for the group's life) and its pid is
   known. So a "connection refused" from that port means the rank is gone, and so does a pid that no
   longer exists on this node (same host, boot, network and pid namespace: the record's `node`;
   kill(pid, 0) means nothing across pid namespaces). Ranks that wait (for the others to join, for a
   rank to connect in the set-up's collectives: ddp__setup_watch) look every DDP__WATCH_PERIOD s (the
   set-up's waits back off to 2 s); the rank that notices publishes an abort naming the lost rank
   (ddp__rdzv_lost), which every waiting rank reads within that period. Ranks on other nodes are
   noticed by the refused connection of the rank that dials them (link.c). */
static uint64_t ddp__host_key(void);

static unsigned long long ddp__node_key(void) {
    char ns[128] = "", buf[200];
    ssize_t k = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    snprintf(buf, sizeof buf, "%016llx|%s", (unsigned long long)ddp__host_key(), ns);
    return (unsigned long long)ddp__hash(buf) | 1u;
}

/* Is the process pid of a rank on this node gone (no such process, or a zombie its parent has not reaped)? */
static int ddp__pid_gone(int pid, unsigned long long its_node, unsigned long long node) {
    char path[64], stat[512];
    const char *end;
    size_t n;
    FILE *f;
    if (!its_node || its_node != node || pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (!(f = fopen(path, "r"))) return 0;
    n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    end = strrchr(stat, ')'); /* "pid (comm) S ...": the state follows the command name */
    return end && end[1] == ' ' && end[2] == 'Z';
}

static int ddp__rank_process_gone(const ddp__record *r, unsigned long long node) { return ddp__pid_gone(r->pid, r->node, node); }

/* Rank i, which had registered, is gone: unless another rank has published an abort already (then fail
   with that one), publish one naming it, so that every rank fails now with this message. */
static ddp_result ddp__rdzv_lost(ddp_group *g, int i, const ddp__record *r, const char *how) {
    char msg[DDP__ERR_MAX], key[256];
    int aborted = 0;
    int64_t seen = 0;
    ddp_result res = ddp__rdzv_check_abort(g, &aborted);
    if (res != DDP_SUCCESS || aborted) return res ? res : DDP_ERR_INIT;
    snprintf(msg, sizeof msg, "rank %d (host %s, pid %d) was lost during ddp_init: %s. It had registered in the "
             "rendezvous and then exited; its own output (or exit status) says why", i, r->host, r->pid, how);
    res = ddp__rdzv_abort(g, DDP_ERR_PEER_LOST, msg);
    ddp__key(g, key, sizeof key, "lost", i); /* the lost rank never reads the abort: count it as read, once */
    if (ddp_store_add(g->member.store, key, 1, &seen) == DDP_SUCCESS && seen == 1) {
        ddp__key(g, key, sizeof key, "abort_seen", -1);
        ddp_store_add(g->member.store, key, 1, &seen);
    }
    return res;
}

/* ---- the table of records: rank 0 gathers it, every other rank waits for it ----
   Each rank claims its rank ("claim/R", an ADD), publishes its record under "rank/R" (a SET: it wakes a
   WAIT, in torch's server too, which a compare-set does not) and adds 1 to "joined". Rank 0 reads the
   records in rank order as they appear, each once (a WAIT for the next one, then a GET), and when it has
   them all publishes them as one value, "table" (one short line per rank, ddp__table_line; a
   compare-set, so that it never hides a failure published first), then sets "ready". Every other rank makes one blocking WAIT on
   "ready" and one GET of "table": about 20 requests per rank in all, rank 0's reading included, instead
   of every rank polling a counter and reading every record (2N^2). A rank that fails publishes its
   error as the table's value and sets "ready" (ddp__rdzv_abort), so the same WAIT wakes every rank on a
   failure too.
   While it gathers, rank 0 looks every DDP__WATCH_PERIOD s for a published abort, reads up to 8 records
   out of order (so that a rank that died beyond a missing one is seen too), and checks the pids of the
   ranks of its node that registered (ddp__rank_process_gone; 256 processes a look, round robin); a
   lost rank is published and named. On its timeout it publishes which ranks never joined; the others
   wait DDP__RDZV_GRACE s longer, so that they read that message rather than time out on their own.
   Ranks on other nodes that die after registering are named when a rank first dials them (a refused
   connection, link.c) or by the ranks waiting for them to dial (ddp__setup_watch). */
#define DDP__RDZV_GRACE 5.0
#define DDP__RDZV_SCAN 8 /* records rank 0 reads out of order per look */

/* Read rank i's record into rec[i] if it is there. 1: read, 0: not there yet, else a failure (published). */
static int ddp__rdzv_read_record(ddp_group *g, int i, ddp__record *rec, ddp_result *res) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX];
    int exists = 0;
    size_t n = 0;
    ddp__key(g, key, sizeof key, "rank", i);
    if ((*res = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS || !exists ||
        (*res = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS) {
        if (*res) *res = ddp__fail(g, *res, "rendezvous: reading rank %d's record: %s", i, ddp_store_last_error(g->member.store));
        return 0;
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (!ddp__record_parse(value, &rec[i])) {
        snprintf(msg, sizeof msg, "rank %d published a malformed rendezvous record \"%.200s\" (another program using the "
                 "same store?)", i, value);
        *res = ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
        return 0;
    }
    if (rec[i].world != g->world_size) {
        snprintf(msg, sizeof msg, "ranks disagree on the world size: rank %d (host %s, pid %d) was started with world "
                 "size %d, rank %d with %d; start every rank with the same WORLD_SIZE", i, rec[i].host, rec[i].pid,
                 rec[i].world, g->rank, g->world_size);
        *res = ddp__rdzv_abort(g, DDP_ERR_MISMATCH, msg);
        return 0;
    }
    return 1;
}

/* Every DDP__WATCH_PERIOD s while rank 0 gathers: an abort, a few records out of order, lost ranks. */
#define DDP__RDZV_PID_CHECKS 256 /* processes rank 0 looks for per look */
static ddp_result ddp__rdzv_gather_watch(ddp_group *g, ddp__record *rec, unsigned char *known, int *have, int *scan,
                                         int *pid_scan, unsigned long long node) {
    int i, k, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    for (k = 0; k < DDP__RDZV_SCAN && *have < g->world_size; k++) {
        for (i = 0; i < g->world_size && known[*scan]; i++) *scan = (*scan + 1) % g->world_size;
        if (ddp__rdzv_read_record(g, *scan, rec, &r)) known[*scan] = 1, ++*have;
        if (r) return r;
        *scan = (*scan + 1) % g->world_size;
    }
    /* The pids, DDP__RDZV_PID_CHECKS at most per look, taking up where the last look stopped (a look at
       thousands of ranks' /proc entries every 0.25 s would be rank 0's main work: measured at 4,096 ranks,
       1 s a look); a rank with the pid and node of the rank before it (threads of one process) is one look. */
    for (i = 0, k = 0; i < g->world_size && k < DDP__RDZV_PID_CHECKS; i++) {
        int at = (*pid_scan + i) % g->world_size, prev = (at + g->world_size - 1) % g->world_size;
        if (!known[at] || at == g->rank) continue;
        if (known[prev] && rec[prev].pid == rec[at].pid && rec[prev].node == rec[at].node) continue;
        k++;
        if (ddp__rank_process_gone(&rec[at], node)) return ddp__rdzv_lost(g, at, &rec[at], "its process no longer exists");
    }
    *pid_scan = (*pid_scan + i) % g->world_size;
    return DDP_SUCCESS;
}

/* Rank 0 gave up waiting: publish who never joined (as "3, 5, 9 (and 4 more)"), so every rank fails with it. */
static ddp_result ddp__rdzv_gather_timeout(ddp_group *g, const unsigned char *known, int have, const char *where) {
    char missing[512] = "", msg[DDP__ERR_MAX];
    int i, shown = 0;
    for (i = 0; i < g->world_size; i++)
        if (!known[i] && shown++ < 16)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown > 1 ? ", " : "", i);
    if (shown > 16) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " and %d more", shown - 16);
    snprintf(msg, sizeof msg, "timed out after %.0f s waiting for every rank to join (%d of %d joined through %s; "
             "missing: %s). Are they all started, with the same world size and master?", g->timeout, have,
             g->world_size, where, missing);
    return ddp__rdzv_abort(g, DDP_ERR_TIMEOUT, msg);
}

/* Rank 0: wait at most `seconds` for rank i's record. A WAIT that times out drops the store connection
   (the client cannot tell a late answer from the next one) and the next request connects again: at most
   one reconnection per DDP__WATCH_PERIOD, and only while ranks are late. */
static ddp_result ddp__rdzv_gather_wait(ddp_group *g, int i, double seconds) {
    char key[256];
    const char *keys[1];
    ddp_result r;
    ddp__key(g, key, sizeof key, "rank", i);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, DDP__MAX(seconds, 0.01));
    if (r == DDP_SUCCESS || r == DDP_ERR_TIMEOUT) return DDP_SUCCESS;
    return ddp__fail(g, r, "rendezvous: waiting for rank %d's record: %s", i, ddp_store_last_error(g->member.store));
}

/* Rank 0: read every record (rec[0] is its own), then publish the table. */
static ddp_result ddp__rdzv_gather(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], marker[DDP__ERR_MAX + 32], *table;
    double start = ddp__now(), next_watch = start + DDP__WATCH_PERIOD;
    unsigned long long node = ddp__node_key();
    unsigned char *known = (unsigned char *)ddp__calloc((size_t)g->world_size, 1);
    int have = 1, cursor = 1, scan = 1, pid_scan = 0, i;
    size_t len = 0, n = 0;
    ddp_result r = DDP_SUCCESS;
    if (!known) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    known[0] = 1;
    while (have < g->world_size && r == DDP_SUCCESS) {
        for (; cursor < g->world_size; cursor++) { /* in rank order, while they are there */
            if (known[cursor]) continue;
            if (!ddp__rdzv_read_record(g, cursor, rec, &r)) break;
            known[cursor] = 1, have++;
        }
        if (have == g->world_size || r) break;
        if (ddp__now() >= next_watch) {
            if ((r = ddp__rdzv_gather_watch(g, rec, known, &have, &scan, &pid_scan, node)) != DDP_SUCCESS) break;
            next_watch = ddp__now() + DDP__WATCH_PERIOD;
        }
        if (ddp__now() - start > g->timeout) r = ddp__rdzv_gather_timeout(g, known, have, where);
        else r = ddp__rdzv_gather_wait(g, cursor, DDP__MIN(next_watch, start + g->timeout) - ddp__now());
    }
    ddp__free(known);
    if (r) return r;
    if (!(table = (char *)ddp__malloc((size_t)g->world_size * DDP__RECORD_MAX))) {
        ddp__rdzv_abort(g, DDP_ERR_OUT_OF_MEMORY, "rank 0 ran out of memory assembling the rendezvous table");
        return DDP_ERR_OUT_OF_MEMORY;
    }
    for (i = 0; i < g->world_size; i++) {
        ddp__table_line(rec, i, table + len, DDP__RECORD_MAX - 1);
        len += strlen(table + len);
        table[len++] = '\n';
    }
    ddp__key(g, key, sizeof key, "table", -1);
    r = ddp__store_compare_set(g->member.store, key, "", 0, table, len, marker, sizeof marker - 1, &n);
    ddp__free(table);
    if (r) return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    marker[DDP__MIN(n, sizeof marker - 1)] = '\0';
    if (strncmp(marker, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) /* a rank failed just before */
        return ddp__rdzv_fail_published(g, marker + strlen(DDP__RDZV_ABORTED));
    ddp__key(g, key, sizeof key, "ready", -1);
    if ((r = ddp_store_set(g->member.store, key, "1", 1)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Rank 0 has not published the table in time, nor why: name the ranks whose records are missing (at most
   16 looked up: this is the rare path where rank 0 itself is stuck or absent). */
static ddp_result ddp__rdzv_await_timeout(ddp_group *g, const char *where) {
    char key[256], missing[512] = "";
    int i, exists, shown = 0, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    for (i = 0; i < g->world_size && shown < 16; i++) {
        ddp__key(g, key, sizeof key, "rank", i);
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown++ ? ", " : "", i);
    }
    return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for every rank to join through %s (missing: %s; "
                     "rank 0 publishes the table of addresses once all have joined). Are they all started, with the "
                     "same world size and master?", g->timeout, where, missing[0] ? missing : "none: is rank 0 stuck?");
}

/* Every rank but 0: one WAIT for the table, one GET of it, then its lines into rec. */
static ddp_result ddp__rdzv_await(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], *table, *line, msg[DDP__ERR_MAX];
    const char *keys[1];
    size_t cap = (size_t)g->world_size * DDP__RECORD_MAX, n = 0;
    int i;
    ddp_result r;
    ddp__key(g, key, sizeof key, "ready", -1);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, g->timeout + DDP__RDZV_GRACE);
    if (r == DDP_ERR_TIMEOUT) return ddp__rdzv_await_timeout(g, where);
    if (r) return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "table", -1); /* set before "ready": the records, or a published failure */
    if (!(table = (char *)ddp__malloc(cap + 1))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    if ((r = ddp_store_get(g->member.store, key, table, cap, &n)) != DDP_SUCCESS) {
        ddp__free(table);
        return ddp__fail(g, r, "rendezvous: reading the table: %s", ddp_store_last_error(g->member.store));
    }
    table[DDP__MIN(n, cap)] = '\0';
    if (strncmp(table, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) {
        r = ddp__rdzv_fail_published(g, table + strlen(DDP__RDZV_ABORTED));
        ddp__free(table);
        return r;
    }
    for (i = 0, line = table; i < g->world_size && line && ddp__table_parse(line, rec, i, g->world_size); i++)
        if ((line = strchr(line, '\n')) != NULL) line++;
    ddp__free(table);
    if (i == g->world_size && n <= cap) return DDP_SUCCESS;
    snprintf(msg, sizeof msg, "the rendezvous table in %s is malformed at rank %d's line (%zu bytes; another program "
             "using the same store?)", where, i, n);
    return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
}

/* ---- the job's identity in the store ----
   Two jobs can meet in one store: a job whose rank 0 could not bind MASTER_PORT (another job holds it)
   still has ranks that connect there, to the other job's store. Before any rank claims its rank, the
   world group's rank 0 records the job in "<prefix>job" ("world=W pid=P host=H run=ID", ID being
   TORCHELASTIC_RUN_ID, which torchrun and ddprun set; empty when unknown) and every rank reads that
   record first: a different run id, or a job whose ranks have all joined already, is another job,
   and this rank fails at once saying so, without writing anything into the other job's store.
   Rank 0 writes it with compare_set, so that under torchrun's agent store (where every rank is a
   client) a record already there is compared like any other. */
typedef struct ddp__job {
    int world, pid;
    char host[128];
    char run[128]; /* "" when the launcher named no run */
} ddp__job;

static int ddp__job_parse(const char *value, ddp__job *j) {
    const char *run = strstr(value, " run=");
    memset(j, 0, sizeof *j);
    if (!run || sscanf(value, "world=%d pid=%d host=%127s", &j->world, &j->pid, j->host) != 3) return 0;
    snprintf(j->run, sizeof j->run, "%s", run + 5);
    return 1;
}

/* *foreign = 1 when this rank must write nothing into the store: it belongs to another job (g->error
   says so), or rank 0 never recorded the job there. */
static ddp_result ddp__rdzv_job(ddp_group *g, const char *where, int file_store, int *foreign) {
    char key[256], mine[512], value[512], host[128], advice[256];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID");
    double start = ddp__now(), nap = 0.001;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    ddp_result r;
    *foreign = 0;
    if (!run) run = "";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(mine, sizeof mine, "world=%d pid=%d host=%s run=%.127s", g->world_size, (int)getpid(), host, run);
    ddp__key(g, key, sizeof key, "job", -1);
    if (g->rank == 0) {
        if ((r = ddp__store_compare_set(g->member.store, key, "", 0, mine, strlen(mine), value, sizeof value - 1, &n)) !=
            DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    } else {
        for (;;) { /* rank 0 records the job first thing; wait for it as for the store */
            int exists = 0, aborted = 0;
            if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
                return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
            if (exists) break;
            if ((r = ddp__rdzv_check_abort(g, &aborted)) != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
            if (ddp__now() - start > g->timeout) {
                *foreign = 1; /* whose store this is is not known: write nothing into it */
                return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for rank 0 to register this job in %s: "
                                 "is rank 0 running? (If another program holds that port, rank 0 could not start the "
                                 "store: pick another MASTER_PORT or use ddprun --standalone)", g->timeout, where);
            }
            ddp__sleep(nap);
            nap = DDP__MIN(nap * 2, 0.05);
        }
        if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (g->rank == 0 && strcmp(value, mine) == 0) return DDP_SUCCESS; /* recorded it: the usual case */
    if (file_store)
        snprintf(advice, sizeof advice, "is the file used by another job, or left behind by one that did not finish? "
                 "give this job a new file");
    else
        snprintf(advice, sizeof advice, "is MASTER_PORT already used by another job? pick another port or use "
                 "ddprun --standalone");
    *foreign = 1;
    if (!ddp__job_parse(value, &them))
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: its record \"%.100s\" was not written by ddp.h's "
                         "rendezvous; %s", where, value, advice);
    if (run[0] && them.run[0] && strcmp(run, them.run) != 0)
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job (run id %s, rank 0 is pid %d on host %s, started with "
                         "world size %d); this job's run id is %s: %s", where, them.run, them.pid, them.host, them.world,
                         run, advice);
    /* Same or unknown run id. A job whose ranks have all joined has no place for this one: every rank
       of this job joins only after reading the record, so a full count means another job, or a second
       process with this rank arriving late. */
    ddp__key(g, key, sizeof key, "joined", -1);
    if ((r = ddp_store_add(g->member.store, key, 0, &joined)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    if (joined >= them.world) {
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: all %d ranks of the job there have joined already (run id "
                 "%s, rank 0 is pid %d on host %s, started with world size %d); this job's run id is %s, its world size "
                 "%d: %s (if this process belongs to that job, it is a second process with rank %d: check RANK)", where,
                 them.world, them.run[0] ? them.run : "unknown", them.pid, them.host, them.world, run[0] ? run : "unknown",
                 g->world_size, advice, g->rank);
    }
    *foreign = 0;
    if (them.world != g->world_size) { /* said here, before joining: rank 0 gathers only a world of its size */
        snprintf(mine, sizeof mine, "ranks disagree on the world size: rank 0 (host %s, pid %d) was started with world "
                 "size %d, rank %d (host %s, pid %d) with %d; start every rank with the same WORLD_SIZE", them.host,
                 them.pid, them.world, g->rank, host, (int)getpid(), g->world_size);
        return ddp__rdzv_abort(g, DDP_ERR_MISMATCH, mine);
    }
    return DDP_SUCCESS;
}

/* Rank 0 could not start the store: MASTER_PORT is taken. Whose is it? Connect as a client for a few
   seconds. If it is this job's store (a job record of the same run id, or of none; the same world size;
   not every rank joined; a rank-0 claim made; its rank 0 alive where this host can tell), this process
   is a second one with rank 0: publish that, so that every rank fails at once rather than at the
   timeout, and fail with it. If the server there does not speak the store protocol, err (port in use)
   says so too. Returns r, or DDP_ERR_INIT for a second rank 0 (err then says so). */
static ddp_result ddp__rank0_port_taken(ddp_group *g, const ddp__launch *L, ddp_result r, char *err) {
    char key[256], claim[256], value[512], why[DDP__ERR_MAX], host[128], msg[DDP__ERR_MAX];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID") ? ddp__env("TORCHELASTIC_RUN_ID") : "";
    double window = DDP__MIN(g->timeout, 3.0), until = ddp__now() + window;
    int exists = 0, claimed = 0, ours;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    if (ddp__store_connect(L->master_addr, L->master_port, NULL, window, &g->member.store, why) != DDP_SUCCESS) {
        if (strstr(why, "does not speak the store protocol") && strlen(err) + 4 < DDP__ERR_MAX)
            snprintf(err + strlen(err), DDP__ERR_MAX - strlen(err), " (%.600s)", why);
        return r;
    }
    ddp__key(g, key, sizeof key, "job", -1);
    ddp__key(g, claim, sizeof claim, "claim", 0);
    while (!(exists && claimed) && ddp__now() < until) { /* the other rank 0 records the job, then claims */
        if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS ||
            ddp_store_check(g->member.store, claim, &claimed) != DDP_SUCCESS)
            break;
        if (!(exists && claimed)) ddp__sleep(0.02);
    }
    ours = exists && claimed && ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS;
    value[ours ? DDP__MIN(n, sizeof value - 1) : 0] = '\0';
    ddp__key(g, key, sizeof key, "joined", -1);
    ours = ours && ddp__job_parse(value, &them) && !(run[0] && them.run[0] && strcmp(run, them.run) != 0) &&
           them.world == g->world_size && ddp_store_add(g->member.store, key, 0, &joined) == DDP_SUCCESS &&
           joined < them.world;
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    if (ours && strcmp(them.host, host) == 0 && kill((pid_t)them.pid, 0) != 0 && errno == ESRCH) ours = 0;
    if (!ours) {
        ddp__store_free(g->member.store);
        g->member.store = NULL;
        return r;
    }
    g->member.owns_store = 1;
    snprintf(msg, sizeof msg, "two processes claim rank 0: pid %d on host %s serves the store on %s:%d, and pid %d on "
             "host %s, also rank 0, could not; every process needs its own rank (check RANK or the launcher's settings)",
             them.pid, them.host, L->master_addr, L->master_port, (int)getpid(), host);
    ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    ddp__key(g, key, sizeof key, "abort_seen", -1); /* as any process that read it: rank 0 need not wait for this one */
    ddp_store_add(g->member.store, key, 1, &joined);
    return ddp__fail_to(err, DDP_ERR_INIT, "%s", msg);
}

/* Claim this rank (a second process with the same rank sees a count above 1: it fails, naming the first
   when its record is there) and publish its record. */
static ddp_result ddp__rdzv_claim(ddp_group *g, const ddp__record *me, const char *where) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX], first[200] = "";
    int64_t claims = 0;
    int exists = 0;
    size_t n = 0;
    ddp__record them;
    ddp_result r;
    ddp__key(g, key, sizeof key, "claim", g->rank);
    if ((r = ddp_store_add(g->member.store, key, 1, &claims)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "rank", g->rank);
    if (claims > 1) {
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && exists &&
            ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS &&
            (value[DDP__MIN(n, sizeof value - 1)] = '\0', ddp__record_parse(value, &them)))
            snprintf(first, sizeof first, " (the first is pid %d on host %.100s)", them.pid, them.host);
        snprintf(msg, sizeof msg, "two processes claim rank %d%s; the second is pid %d on host %s. Every process needs "
                 "its own rank (check RANK or the launcher's settings)", g->rank, first, me->pid, me->host);
        return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    }
    ddp__record_format(me, value, sizeof value);
    if ((r = ddp_store_set(g->member.store, key, value, strlen(value))) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Keep the table as the group's directory (link.c dials from it): the numbers, and each address and
   host name once per run of ranks that share it (ranks of one host are usually neighbours). */
static uint32_t ddp__dir_string(ddp_group *g, const char *text, int prev) {
    size_t n = strlen(text) + 1;
    if (prev >= 0 && strcmp(g->mesh.names + prev, text) == 0) return (uint32_t)prev;
    if (g->mesh.names_len + n > g->mesh.names_cap) {
        size_t cap = DDP__MAX(g->mesh.names_cap * 2, g->mesh.names_len + n + 256);
        char *grown = (char *)ddp__malloc(cap);
        if (!grown) return UINT32_MAX;
        if (g->mesh.names_len) memcpy(grown, g->mesh.names, g->mesh.names_len);
        ddp__free(g->mesh.names);
        g->mesh.names = grown, g->mesh.names_cap = cap;
    }
    memcpy(g->mesh.names + g->mesh.names_len, text, n);
    g->mesh.names_len += n;
    return (uint32_t)(g->mesh.names_len - n);
}

static ddp_result ddp__dir_fill(ddp_group *g, const ddp__record *rec) {
    int i;
    if (!(g->mesh.dir = (ddp__peer_info *)ddp__calloc((size_t)g->world_size, sizeof *g->mesh.dir)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
    for (i = 0; i < g->world_size; i++) {
        ddp__peer_info *d = &g->mesh.dir[i];
        d->port = rec[i].port, d->pid = rec[i].pid, d->node = rec[i].node;
        d->addr = ddp__dir_string(g, rec[i].addr, i > 0 ? (int)g->mesh.dir[i - 1].addr : -1);
        d->host = ddp__dir_string(g, rec[i].host, i > 0 ? (int)g->mesh.dir[i - 1].host : -1);
        if (d->addr == UINT32_MAX || d->host == UINT32_MAX) {
            ddp__free(g->mesh.dir);
            g->mesh.dir = NULL;
            return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
        }
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__rendezvous(ddp_group *g, const char *addr, int port, const char *where) {
    char key[256];
    ddp__record *rec;
    int64_t joined = 0;
    int i, same_host = 0, local_index = 0;
    ddp_result r;

    rec = (ddp__record *)ddp__calloc((size_t)g->world_size, sizeof *rec);
    if (!rec) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    rec[g->rank].world = g->world_size;
    rec[g->rank].port = port;
    rec[g->rank].pid = (int)getpid();
    snprintf(rec[g->rank].addr, sizeof rec[g->rank].addr, "%s", addr);
    if (gethostname(rec[g->rank].host, sizeof rec[g->rank].host) != 0) snprintf(rec[g->rank].host, sizeof rec[g->rank].host, "?");
    rec[g->rank].host[sizeof rec[g->rank].host - 1] = '\0';
    rec[g->rank].node = ddp__node_key();
    if ((r = ddp__rdzv_claim(g, &rec[g->rank], where)) != DDP_SUCCESS) goto done;
    ddp__key(g, key, sizeof key, "joined", -1); /* read by ddp__rdzv_job: a full count means another job */
    if ((r = ddp_store_add(g->member.store, key, 1, &joined)) != DDP_SUCCESS) {
        r = ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
        goto done;
    }
    r = g->rank == 0 ? ddp__rdzv_gather(g, rec, where) : ddp__rdzv_await(g, rec, where);
    if (r) goto done;
    for (i = 0; i < g->world_size; i++)
        if (strcmp(rec[i].host, rec[g->rank].host) == 0) {
            if (i < g->rank) local_index++;
            same_host++;
        }
    if (g->local_rank < 0 || g->local_world_size < 0) {
        g->local_rank = local_index;
        g->local_world_size = same_host;
    }
    r = ddp__dir_fill(g, rec);
done:
    ddp__free(rec);
    return r;
}

/* The address of this host's interface that routes to the master (a UDP "connect" sends nothing). */
static void ddp__route_address(const char *master, int port, char *out, size_t cap) {
    struct addrinfo hints, *res = NULL;
    char service[16];
    int fd;
    snprintf(out, cap, "127.0.0.1");
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_DGRAM;
    snprintf(service, sizeof service, "%d", port);
    if (!master || getaddrinfo(master, service, &hints, &res) != 0) return;
    fd = socket(res->ai_family, SOCK_DGRAM, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) ddp__net_local_address(fd, out, cap);
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
}

/* ---- group life cycle ---- */

static ddp_group *ddp__group_alloc(int rank, int world_size) {
    ddp_group *g = (ddp_group *)ddp__calloc(1, sizeof *g);
    int i;
    if (!g) return NULL;
    pthread_mutex_init(&g->async.mu, NULL);
    pthread_mutex_init(&g->mesh.p2p_mu, NULL);
    pthread_cond_init(&g->async.cv, NULL);
    g->rank = rank;
    g->mesh.waiting_for = -1;
    g->world_size = world_size;
    g->local_rank = g->local_world_size = -1;
    g->backend = g->host_backend = ddp__initial_backend(world_size);
    g->timeout = 300.0;
    g->mesh.peers = (ddp__peer *)ddp__calloc((size_t)world_size, sizeof *g->mesh.peers);
    g->mesh.linked = (int *)ddp__calloc((size_t)world_size, sizeof *g->mesh.linked);
    g->mesh.shakes = (ddp__shake *)ddp__calloc(DDP__SHAKES_MAX, sizeof *g->mesh.shakes);
    g->mesh.listen_fd = -1;
    g->mesh.pollfds = (struct pollfd *)ddp__calloc((size_t)world_size + DDP__SHAKES_MAX + 1, sizeof *g->mesh.pollfds);
    g->mesh.poll_owner = (int *)ddp__calloc((size_t)world_size + DDP__SHAKES_MAX + 1, sizeof *g->mesh.poll_owner);
    g->world_ranks = (int *)ddp__calloc((size_t)world_size, sizeof *g->world_ranks);
    if (!g->mesh.peers || !g->mesh.linked || !g->mesh.shakes || !g->mesh.pollfds || !g->mesh.poll_owner || !g->world_ranks ||
        !ddp__live_add(g, DDP__LIVE_GROUP)) {
        ddp__group_free(g);
        return NULL;
    }
    for (i = 0; i < world_size; i++) {
        g->mesh.peers[i].fd = -1;
        g->world_ranks[i] = i;
    }
    ddp__trace_open(g);
    return g;
}

/* Free everything g holds (connections closed without goodbye: for failed inits and after goodbye).
   Also frees a group whose allocation stopped half way (its arrays may be NULL). */
static void ddp__group_free(ddp_group *g) {
    ddp__live_remove(g, DDP__LIVE_GROUP); /* from here on, calls on g fail instead of reading freed memory */
    ddp__progress_stop(g);
    ddp__work_release_all(g);
    if (g->backend) g->backend->close(g, 0);
    if (g->broken) ddp__close_after_failure(g, 1.0);
    ddp__lib_free_all(g);
    if (g->mesh.shakes) ddp__link_close_all(g);
    if (g->member.owns_store && g->member.store) ddp__store_free(g->member.store);
    if (g->member.store_server) ddp__store_server_stop(g->member.store_server);
    if (g->member.parent) ddp__subgroup_unlink(g->member.parent, g);
    ddp__trace_close(g);
    pthread_mutex_destroy(&g->async.mu);
    pthread_mutex_destroy(&g->mesh.p2p_mu);
    pthread_cond_destroy(&g->async.cv);
    ddp__free(g->scratch);
    ddp__p2p_stash_free(g);
    ddp__free(g->mesh.peers);
    ddp__free(g->mesh.linked);
    ddp__free(g->mesh.shakes);
    ddp__free(g->mesh.dir);
    ddp__free(g->mesh.names);
    ddp__free(g->mesh.pollfds);
    ddp__free(g->mesh.poll_owner);
    ddp__free(g->world_ranks);
    ddp__free(g);
}

/* Ranks share memory only within one host and one network namespace (tests put "hosts" in
   namespaces on one machine; each namespace counts as a host). */
static uint64_t ddp__host_key(void) {
    char buf[512] = "", ns[128] = "";
    FILE *f;
    ssize_t k = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    gethostname(buf, 200);
    buf[200] = '\0';
    snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "|%s|", ns);
    if ((f = fopen("/proc/sys/kernel/random/boot_id", "r")) != NULL) {
        size_t len = strlen(buf);
        if (fgets(buf + len, (int)(sizeof buf - len), f) == NULL) buf[len] = '\0';
        fclose(f);
    }
    return ddp__hash(buf);
}

/* Which transport carries the group's collectives, decided alike on every rank from what every rank
   sends in one all_gather over the mesh: its host key and whether DDP_TRANSPORT=tcp is set on it. Any
   rank asking for tcp keeps the whole group on the mesh (as DDP_SHM_CMA=0 on one rank turns
   cross-memory attach off for all): a rank that skipped the exchange would meet the others' next
   collective instead, and every rank would fail without naming the cause. Otherwise: all ranks on one
   host -> shared memory (shm.c); several hosts with several ranks on some -> the hierarchical
   all_reduce (hier.c); else the mesh itself (tcp.c). */
#define DDP__WISH_BAD 2 /* DDP_TRANSPORT set to something else than auto or tcp */
static int ddp__transport_wish(void) {
    const char *transport = ddp__env("DDP_TRANSPORT");
    if (!transport || strcmp(transport, "auto") == 0) return 0;
    return strcmp(transport, "tcp") == 0 ? 1 : DDP__WISH_BAD;
}

/* The message names the rank (g NULL: a single process): it may be the one every rank reports, when
   this rank's error reaches the store first (ddp__rdzv_fail_all). */
static ddp_result ddp__bad_transport(ddp_group *g) {
    char name[DDP__PEER_NAME_MAX];
    if (!g) return ddp__fail(NULL, DDP_ERR_INIT, "DDP_TRANSPORT=\"%s\" is not one of auto, tcp; fix or unset it",
                             ddp__env("DDP_TRANSPORT"));
    return ddp__fail(g, DDP_ERR_INIT, "DDP_TRANSPORT=\"%s\" on rank %d (%s) is not one of auto, tcp; fix or unset it there",
                     ddp__env("DDP_TRANSPORT"), g->rank, ddp__peer_name(g, g->rank, name, sizeof name));
}

static ddp_result ddp__choose_transport(ddp_group *g) {
    uint64_t mine[2], *all, *keys;
    char name[DDP__PEER_NAME_MAX];
    int i, same = 1, tcp_rank = -1, tcp_ranks = 0, bad_rank = -1;
    ddp_result r;
    if (g->world_size < 2) return DDP_SUCCESS;
    mine[0] = ddp__host_key();
    mine[1] = (uint64_t)ddp__transport_wish();
    all = (uint64_t *)ddp__calloc((size_t)g->world_size, 3 * sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory mapping the group's hosts");
    keys = all + 2 * (size_t)g->world_size;
    r = ddp__mesh_all_gather(g, mine, all, 2, DDP_I64);
    for (i = 0; i < g->world_size && r == DDP_SUCCESS; i++) {
        keys[i] = all[2 * i];
        same &= keys[i] == mine[0];
        if (all[2 * i + 1] == DDP__WISH_BAD && bad_rank < 0) bad_rank = i;
        if (all[2 * i + 1] == 1) {
            if (tcp_rank < 0) tcp_rank = i;
            tcp_ranks++;
        }
    }
    /* The rank that set it names the value even when the gather failed: a rank that finished the gather
       first (Bruck's all_gather finishes ranks in any order) may already have failed with the message
       below, which names this rank, and hung up while this one still waited for another rank's frame. */
    if (mine[1] == DDP__WISH_BAD && r != DDP_SUCCESS) r = ddp__bad_transport(g);
    if (r == DDP_SUCCESS && bad_rank >= 0) { /* every rank fails, naming the rank that set it */
        if (mine[1] == DDP__WISH_BAD) ddp__bad_transport(g);
        else ddp__fail(g, DDP_ERR_INIT, "DDP_TRANSPORT on rank %d (%s) is not one of auto, tcp (that rank's message "
                       "names the value); fix or unset it there", bad_rank, ddp__peer_name(g, bad_rank, name, sizeof name));
        r = DDP_ERR_INIT;
    } else if (r == DDP_SUCCESS && tcp_rank >= 0) {
        if (!mine[1])
            ddp__log(g, DDP_LOG_INFO, "DDP_TRANSPORT=tcp is set on rank %d (%s)%s: the whole group stays on TCP", tcp_rank,
                     ddp__peer_name(g, tcp_rank, name, sizeof name), tcp_ranks > 1 ? " and others" : "");
    } else if (r == DDP_SUCCESS) {
        r = same ? ddp__shm_setup(g) : ddp__hier_setup(g, keys);
    }
    ddp__free(all);
    return r;
}

/* Rendezvous and connect a freshly allocated group whose store and prefix are set: after the table,
   the group's own barrier makes the first connections (link.c: the ring and the ranks 2^k away), and
   the set-up's collectives run with in_setup on, so that a rank lost on the way is also looked for in
   the store (ddp__setup_watch). The listening socket stays open for the group's life. */
static ddp_result ddp__group_connect(ddp_group *g, const char *where) {
    char err[DDP__ERR_MAX];
    int port = 0, aborted = 0;
    ddp_result r;
    if ((r = ddp__net_listen(g->member.address, 0, &g->mesh.listen_fd, &port, err)) != DDP_SUCCESS)
        return ddp__fail(g, r, "cannot listen for peer connections on %s: %s", g->member.address, err);
    r = ddp__rendezvous(g, g->member.address, port, where);
    if (r) {
        ddp__rdzv_publish(g, r); /* before its listener closes: a rank that then loses this one finds why */
        return r;
    }
    g->mesh.in_setup = 1;
    if ((r = ddp__mesh_barrier(g)) == DDP_SUCCESS && (r = ddp__choose_transport(g)) == DDP_SUCCESS &&
        (r = ddp__rdzv_check_abort(g, &aborted)) == DDP_SUCCESS && aborted)
        r = DDP_ERR_INIT;
    g->mesh.in_setup = 0;
    return r;
}

/* link.c's look at the store during the set-up (see internal.h). */
static ddp_result ddp__setup_watch(ddp_group *g, int peer) {
    char how[64];
    int aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    if (peer >= 0 && g->mesh.dir && ddp__pid_gone(g->mesh.dir[peer].pid, g->mesh.dir[peer].node, ddp__node_key())) {
        snprintf(how, sizeof how, "its process no longer exists");
        return ddp__setup_lost(g, peer, how);
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__setup_lost(ddp_group *g, int peer, const char *how) {
    ddp__record r;
    memset(&r, 0, sizeof r);
    r.pid = g->mesh.dir[peer].pid;
    snprintf(r.host, sizeof r.host, "%s", g->mesh.names + g->mesh.dir[peer].host);
    return ddp__rdzv_lost(g, peer, &r, how);
}

/* ddp_init for backend "mpi": everything comes from MPI_COMM_WORLD (mpi.c); no store, no sockets. */
static ddp_result ddp__init_mpi(const ddp_init_desc *desc, ddp_group **out) {
    char err[DDP__ERR_MAX];
    int rank = 0, world = 1;
    struct ddp__mpi *m = NULL;
    ddp_group *g;
    ddp_result r;
    double timeout = ddp__read_timeout(desc, err, &r);
    if (r) return ddp__fail(NULL, r, "ddp_init: %s", err);
    if ((r = ddp__mpi_world(&rank, &world, &m, err)) != DDP_SUCCESS)
        return ddp__fail(NULL, r, "ddp_init: %s", err);
    if (!(g = ddp__group_alloc(rank, world))) {
        ddp__mpi_free(m);
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    }
    ddp__mpi_attach(g, m);
    g->timeout = timeout;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    ddp__log(g, DDP_LOG_INFO, "joined: rank %d of %d on the mpi backend (local rank %d of %d)", rank, world, g->local_rank,
             g->local_world_size);
    *out = g;
    return DDP_SUCCESS;
}

/* Join the store that torchrun's agent serves (TORCHELASTIC_USE_AGENT_STORE=True). Keys go under the
   prefix torch's workers use in it, PrefixStore("/worker/attempt_<restart>"), so the agent's own keys
   and an earlier attempt's are never seen. */
static ddp_result ddp__connect_agent_store(const ddp__launch *L, double timeout, ddp_store **out, char *where,
                                           size_t where_size, char *err) {
    char attempt[64], prefix[96];
    ddp_result r;
    snprintf(attempt, sizeof attempt, "/worker/attempt_%d", L->restart_count);
    ddp__store_torch_prefix(attempt, prefix, sizeof prefix);
    snprintf(where, where_size, "torchrun's agent store at %s:%d", L->master_addr, L->master_port);
    r = ddp__store_connect(L->master_addr, L->master_port, prefix, timeout, out, err);
    if (r != DDP_SUCCESS && strlen(err) < DDP__ERR_MAX - 1)
        snprintf(err + strlen(err), DDP__ERR_MAX - strlen(err),
                 " (TORCHELASTIC_USE_AGENT_STORE=True says torchrun's agent serves it: is torchrun still running, "
                 "and are MASTER_ADDR/MASTER_PORT the ones it was given?)");
    return r;
}

/* The last step of ddp_init. Backend "nccl": the connected group gets its communicator (nccl.c); when
   that fails (on every rank alike: the ranks agree on each step), the group is taken down in order. */
static ddp_result ddp__init_done(ddp_group *g, int nccl, ddp_group **out) {
    char msg[DDP__ERR_MAX];
    int rank = g->rank, world = g->world_size;
    ddp_result r;
    if (nccl && (r = ddp__nccl_attach(g, NULL)) != DDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", g->error);
        ddp_destroy(g);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d): %s", rank, world, msg);
    }
    g->seq_base = g->seq; /* the program's first collective is #1 in messages */
    *out = g;
    return DDP_SUCCESS;
}

/* This rank failed locally (a bad setting such as DDP_TIMEOUT) after it knew where the store is. Rather
   than leave the other ranks to wait the whole timeout for it, ddp_init still joins the store (waiting
   at most DDP__EARLY_PUBLISH_SECONDS, and only into this job's store: ddp__rdzv_job) and fails here, so
   that the error is published (ddp__rdzv_fail_all) with this rank named, and every rank fails with it. */
#define DDP__EARLY_PUBLISH_SECONDS 10.0
static ddp_result ddp__init_failed_locally(ddp_group *g, ddp_result code, const char *msg) {
    char host[128];
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    return ddp__fail(g, code, "rank %d (host %s, pid %d) cannot take part: %s", g->rank, host, (int)getpid(), msg);
}

DDP_API ddp_result ddp_init(const ddp_init_desc *desc, ddp_group **out) {
    ddp_init_desc zero;
    ddp__launch L;
    ddp_group *g;
    char err[DDP__ERR_MAX], where[320];
    const char *backend;
    char early_msg[DDP__ERR_MAX];
    double timeout;
    int nccl, foreign = 0, told = 0;
    ddp_result r, early = DDP_SUCCESS;
    if (!out) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_init: the out argument is NULL");
    *out = NULL;
    if (!desc) {
        memset(&zero, 0, sizeof zero);
        desc = &zero;
    }
    backend = desc->backend && *desc->backend ? desc->backend : ddp__env("DDP_BACKEND") ? ddp__env("DDP_BACKEND") : "auto";
    nccl = strcmp(backend, "nccl") == 0;
    if (nccl && (r = ddp__nccl_built(err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "%s", err);
    if (strcmp(backend, "auto") != 0 && strcmp(backend, "cpu") != 0 && strcmp(backend, "mpi") != 0 && !nccl) {
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "backend \"%s\"%s is not one of auto, cpu, nccl, mpi", backend,
                         desc->backend && *desc->backend ? "" : " (from DDP_BACKEND)");
    }
    if (strcmp(backend, "mpi") == 0) return ddp__init_mpi(desc, out);
    if ((r = ddp__read_launch(desc, &L, err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "ddp_init: %s", err);
    /* alone, nobody else needs to hear of it; otherwise the ranks check DDP_TRANSPORT together (ddp__choose_transport) */
    if (L.world_size == 1 && ddp__transport_wish() == DDP__WISH_BAD) return ddp__bad_transport(NULL);
    timeout = ddp__read_timeout(desc, err, &r);
    if (r && L.world_size == 1 && !L.file_path && !L.master_port) return ddp__fail(NULL, r, "ddp_init: %s", err);
    if (r) { /* a local failure with the master known: join only to tell the others (ddp__init_failed_locally) */
        early = r;
        snprintf(early_msg, sizeof early_msg, "%s", err);
        timeout = DDP__EARLY_PUBLISH_SECONDS;
    }

    g = ddp__group_alloc(L.rank, L.world_size);
    if (!g) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    g->timeout = timeout;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    g->local_rank = L.local_rank;
    g->local_world_size = L.local_world_size;
    snprintf(g->member.prefix, sizeof g->member.prefix, "ddp/%d/", L.restart_count);
    if (L.world_size == 1 && !L.file_path && !L.master_port) { /* alone: nothing to connect */
        g->local_rank = 0;
        g->local_world_size = 1;
        return ddp__init_done(g, nccl, out);
    }
    ddp__fd_prepare(g, L.world_size, L.rank); /* the soft limit on open files up to the hard one */

    if (L.file_path) {
        snprintf(where, sizeof where, "the file store %s", L.file_path);
        r = ddp__store_open_file(L.file_path, timeout, &g->member.store, err);
        ddp__route_address(NULL, 0, g->member.address, sizeof g->member.address);
    } else if (L.agent_store) {
        r = ddp__connect_agent_store(&L, timeout, &g->member.store, where, sizeof where, err);
        ddp__route_address(L.master_addr, L.master_port, g->member.address, sizeof g->member.address);
    } else {
        snprintf(where, sizeof where, "the store at %s:%d", L.master_addr, L.master_port);
        r = DDP_SUCCESS;
        /* Rank 0 holds a descriptor back for its own client while its server starts: the other ranks'
           clients, connecting at once, could otherwise take the last ones under a low RLIMIT_NOFILE, and
           rank 0 would fail without a connection to publish why (the server, short of descriptors, then
           pauses accepting for 0.1 s, in which the client takes the one given back). */
        int spare = L.rank == 0 ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
        if (L.rank == 0) r = ddp__store_server_start(L.master_addr, L.master_port, g->log_level, &g->member.store_server, err);
        if (L.rank == 0 && r != DDP_SUCCESS) r = ddp__rank0_port_taken(g, &L, r, err);
        if (L.rank == 0 && r == DDP_SUCCESS) { /* where its server says that it cannot accept a rank: */
            char abort_key[256], table_key[256], ready_key[256]; /* as ddp__rdzv_abort publishes it */
            ddp__key(g, abort_key, sizeof abort_key, "abort", -1);
            ddp__key(g, table_key, sizeof table_key, "table", -1);
            ddp__key(g, ready_key, sizeof ready_key, "ready", -1);
            ddp__store_server_abort_key(g->member.store_server, abort_key, table_key, ready_key);
        }
        if (spare >= 0) close(spare);
        if (r == DDP_SUCCESS) r = ddp__store_connect(L.master_addr, L.master_port, NULL, timeout, &g->member.store, err);
        ddp__route_address(L.master_addr, L.master_port, g->member.address, sizeof g->member.address);
    }
    if (r) {
        ddp__group_free(g);
        if (early) return ddp__fail(NULL, early, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, early_msg);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, err);
    }
    g->member.owns_store = 1;
    ddp__log(g, DDP_LOG_INFO, "joining: rank %d of %d from %s, through %s", L.rank, L.world_size, L.source, where);
    if ((r = ddp__rdzv_job(g, where, L.file_path != NULL, &foreign)) != DDP_SUCCESS ||
        (early && (told = 1, r = ddp__init_failed_locally(g, early, early_msg)) != DDP_SUCCESS) ||
        (r = ddp__group_connect(g, where)) != DDP_SUCCESS) {
        if (!foreign) r = ddp__rdzv_fail_all(g, r); /* never into another job's store */
        if (early && !told) r = ddp__fail(g, early, "%s", early_msg); /* the job was not reachable: the local reason */
        ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, g->error);
        ddp__group_free(g);
        return r;
    }
    ddp__store_server_abort_key(g->member.store_server, NULL, NULL, NULL);
    ddp__log(g, DDP_LOG_INFO, "joined: rank %d of %d (local rank %d of %d)", g->rank, g->world_size, g->local_rank,
             g->local_world_size);
    return ddp__init_done(g, nccl, out);
}

/* Subgroups are listed on their parent in the order they were made, which is the same on every rank
   (ddp_new_group is collective on the parent). */
static void ddp__subgroup_link(ddp_group *parent, ddp_group *sub) {
    ddp_group **at = &parent->member.subgroups;
    while (*at) at = &(*at)->member.next_sibling;
    *at = sub;
    sub->member.parent = parent;
    sub->member.next_sibling = NULL;
}

static void ddp__subgroup_unlink(ddp_group *parent, ddp_group *sub) {
    ddp_group **at = &parent->member.subgroups;
    while (*at && *at != sub) at = &(*at)->member.next_sibling;
    if (*at) *at = sub->member.next_sibling;
    sub->member.parent = NULL;
}

/* ddp_destroy of a group destroys its live subgroups first, as torch's destroy_process_group() destroys
   every group: each rank destroys those it belongs to, in the order they were made, so the members of
   each meet in its closing barrier (a rank outside one goes on to the next). The first error is kept. */
static ddp_result ddp__destroy_subgroups(ddp_group *g) {
    ddp_result first = DDP_SUCCESS;
    while (g->member.subgroups) {
        ddp_result r = ddp_destroy(g->member.subgroups); /* unlinks it */
        if (r && !first) first = r;
    }
    return first;
}

DDP_API ddp_result ddp_destroy(ddp_group *g) {
    ddp_result r = DDP_SUCCESS, subs;
    if (!g) return DDP_SUCCESS;
    if ((r = ddp__group_check(g, "ddp_destroy")) != DDP_SUCCESS) return r;
    subs = ddp__destroy_subgroups(g);
    ddp__drain(g);
    if (g->world_size > 1 && !g->broken) {
        r = ddp_barrier(g); /* nobody closes a connection that a peer may still be waiting on */
        if (r) {
            ddp__fail(NULL, r, "ddp_destroy: %s", g->error);
        } else {
            g->backend->close(g, 1); /* hier.c's stage groups say goodbye among themselves first */
            ddp__say_goodbye(g, DDP__MIN(g->timeout, 10.0));
        }
    }
    ddp__group_free(g);
    return r ? r : subs;
}

/* Make and connect the group of the parent's ranks `ranks` (n of them; this rank is ranks[me]) through
   the parent's store, under the key prefix <parent's prefix><name>/. comm: the subgroup's MPI
   communicator (mpi backend: no sockets), else NULL. On failure the parent carries the error, prefixed
   by `what`. Used by ddp_new_group and by the hierarchical all_reduce's host and leader groups (hier.c). */
static ddp_result ddp__subgroup_open(ddp_group *g, const int *ranks, int n, int me, const char *name, struct ddp__mpi *comm,
                                     const char *what, ddp_group **out) {
    char where[160];
    ddp_group *sub;
    ddp_result r;
    int i;
    *out = NULL;
    if (!(sub = ddp__group_alloc(me, n))) {
        ddp__mpi_free(comm);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    }
    if (comm) ddp__mpi_attach(sub, comm);
    for (i = 0; i < n; i++) sub->world_ranks[i] = g->world_ranks[ranks[i]];
    sub->timeout = g->timeout;
    sub->log_level = g->log_level;
    sub->log_fn = g->log_fn;
    sub->log_user = g->log_user;
    sub->member.store = g->member.store;
    memcpy(sub->member.address, g->member.address, sizeof sub->member.address);
    snprintf(sub->member.prefix, sizeof sub->member.prefix, "%.60s%.30s/", g->member.prefix, name);
    snprintf(where, sizeof where, "the parent group's store (%s)", name);
    if (n > 1 && !sub->mpi && (r = ddp__group_connect(sub, where)) != DDP_SUCCESS) {
        ddp__fail(g, r, "%s: %s", what, sub->error);
        ddp__group_free(sub);
        return r;
    }
    if (n == 1) sub->local_rank = 0, sub->local_world_size = 1;
    sub->seq_base = sub->seq;
    *out = sub;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_new_group(ddp_group *g, const int *ranks, int n, ddp_group **out) {
    uint64_t mine = 0x9e3779b97f4a7c15ull, *all;
    char name[32];
    int i, j, me = -1, valid = ranks && n >= 1 && out;
    struct ddp__mpi *comm = NULL;
    ddp_group *sub;
    ddp_result r;
    if ((r = ddp__group_check(g, "ddp_new_group")) != DDP_SUCCESS) return r;
    if (out) *out = NULL;
    for (i = 0; valid && i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= g->world_size) valid = 0;
        for (j = 0; valid && j < i; j++)
            if (ranks[j] == ranks[i]) valid = 0;
        if (ranks[i] == g->rank) me = i;
        mine = (mine ^ (uint64_t)(ranks[valid ? i : 0] + 1)) * 1099511628211ull;
    }
    if (!valid) mine = 0; /* still take part, so the other ranks fail too instead of waiting */
    /* Every rank must pass the same list: compare the hashes of all ranks. */
    all = (uint64_t *)ddp__calloc((size_t)g->world_size, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_new_group: out of memory");
    if ((r = ddp_all_gather(g, &mine, all, 1, DDP_I64)) != DDP_SUCCESS) {
        ddp__free(all);
        return r;
    }
    for (i = 0; i < g->world_size; i++)
        if (all[i] != all[0] || all[i] == 0) {
            int invalid = all[i] == 0 || all[0] == 0, bad = all[0] == 0 ? 0 : i;
            ddp__free(all);
            if (!valid) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_new_group: the rank list is invalid (need 1..%d distinct ranks in 0..%d)",
                                         g->world_size, g->world_size - 1);
            return ddp__fail(g, invalid ? DDP_ERR_INVALID_ARGUMENT : DDP_ERR_MISMATCH,
                             "ddp_new_group: rank %d passed %s rank list %s; every rank must call ddp_new_group with the same list",
                             bad, invalid ? "an invalid" : "a different", invalid ? "" : "than rank 0");
        }
    ddp__free(all);
    g->member.subgroups_made++;
    if (g->mpi && (r = ddp__mpi_split(g, me, &comm)) != DDP_SUCCESS) return r;
    if (me < 0) return DDP_SUCCESS;
    snprintf(name, sizeof name, "sub%llu", (unsigned long long)g->member.subgroups_made);
    if ((r = ddp__subgroup_open(g, ranks, n, me, name, comm, "ddp_new_group", &sub)) != DDP_SUCCESS) return r;
    if (g->nccl && (r = ddp__nccl_attach(sub, g->nccl)) != DDP_SUCCESS) { /* its own communicator */
        ddp__fail(g, r, "ddp_new_group: %s", sub->error);
        ddp_destroy(sub);
        return r;
    }
    sub->seq_base = sub->seq;
    ddp__subgroup_link(g, sub);
    *out = sub;
    return DDP_SUCCESS;
}

/* The getters answer as for NULL (a single process) on a destroyed group; the reason is in
   ddp_last_error(NULL). */
static int ddp__group_live(const ddp_group *g, const char *fn) { return g && ddp__group_check(g, fn) == DDP_SUCCESS; }
DDP_API int ddp_rank(const ddp_group *g) { return ddp__group_live(g, "ddp_rank") ? g->rank : 0; }
DDP_API int ddp_world_size(const ddp_group *g) { return ddp__group_live(g, "ddp_world_size") ? g->world_size : 1; }
DDP_API int ddp_local_rank(const ddp_group *g) { return ddp__group_live(g, "ddp_local_rank") ? g->local_rank : 0; }
DDP_API int ddp_local_world_size(const ddp_group *g) { return ddp__group_live(g, "ddp_local_world_size") ? g->local_world_size : 1; }
DDP_API const char *ddp_backend_name(const ddp_group *g) { return ddp__group_live(g, "ddp_backend_name") ? g->backend->family : "none"; }
DDP_API double ddp_timeout(const ddp_group *g) { return ddp__group_live(g, "ddp_timeout") ? g->timeout : 0.0; }

/* A group of one process made without a master has no store; the first ddp_group_store() call gives it
   a private one (a store server on a free loopback port, and a client), so that code written for many
   ranks runs unchanged on one. */
static ddp_result ddp__private_store(ddp_group *g) {
    char err[DDP__ERR_MAX];
    ddp_result r = ddp__store_server_start("127.0.0.1", 0, g->log_level, &g->member.store_server, err);
    if (r == DDP_SUCCESS)
        r = ddp__store_connect("127.0.0.1", ddp__store_server_port(g->member.store_server), NULL, g->timeout, &g->member.store, err);
    if (r == DDP_SUCCESS) {
        g->member.owns_store = 1;
        return DDP_SUCCESS;
    }
    ddp__store_server_stop(g->member.store_server);
    g->member.store_server = NULL;
    return ddp__fail(g, r, "ddp_group_store: could not start the store of this single-process group: %s", err);
}

DDP_API ddp_store *ddp_group_store(ddp_group *g) {
    ddp_store *s;
    if (ddp__group_check(g, "ddp_group_store") != DDP_SUCCESS) return NULL;
    pthread_mutex_lock(&g->async.mu);
    if (!g->member.store && g->world_size == 1 && !g->mpi && !g->member.parent) ddp__private_store(g);
    s = g->member.store;
    pthread_mutex_unlock(&g->async.mu);
    return s;
}
/* ==================== end src/group.c ==================== */

/* ==================== begin src/launcher.c ==================== */
/* [SECTION] launcher: ddp_spawn (torch.multiprocessing.spawn) and ddprun (torchrun)
   Both start a group of worker processes on this host with torchrun's environment and watch them:

       fork a guardian, which forks N workers (each in its own process group, each told RANK,
         WORLD_SIZE, MASTER_ADDR, ...) and reports each worker's pid and, later, its exit status
       loop: sleep until the guardian reports (a pipe) or 5 ms pass; read its reports
         all exited 0         -> success
         one failed           -> collect the failures of the next 0.25 s, name the likely cause
                                 (which rank, exit code or signal), then stop the others:
                                 SIGTERM to every worker's process group, SIGKILL after a grace period
         ddprun got a signal  -> forward it to every worker, then stop them as above

   The fail-fast loop is what torchrun's agent does (torch/distributed/elastic/agent/server/api.py):
   without it a dead rank leaves the others blocked in a collective until the 30-minute timeout.
   ddprun adds torchrun's --max-restarts: stop everybody, start the whole group again with
   TORCHELASTIC_RESTART_COUNT (and DDP_RESTART_COUNT) incremented, so the program resumes from its
   checkpoint. Rendezvous is static: every node runs ddprun with the same --nproc-per-node,
   --nnodes, --master-addr and --master-port and its own --node-rank; torchrun's elastic rendezvous
   (--rdzv-backend, a range in --nnodes) is not supported. The workers' rank 0 serves the store
   (TORCHELASTIC_USE_AGENT_STORE=False), as under torchrun --standalone.

   No orphans. The launcher (ddprun, or the program calling ddp_spawn) may itself be killed with
   SIGKILL, and then it can clean up nothing. So the workers are not its children but the children of
   the guardian, a process forked for the purpose (ddp__launch_guard):

       launcher --(pipe: "stop")--> guardian (child subreaper) --> workers --> their children ...
                <--(pipe: pids, exit statuses)--

   The guardian is a child subreaper (Linux PR_SET_CHILD_SUBREAPER): a process that a worker's
   descendant leaves behind, even one that made itself a daemon (setsid, double fork), becomes the
   guardian's child instead of init's. When the launcher closes its end of the pipe, because it is done
   or because it died (the kernel closes it then), the guardian kills every worker's process group and
   every child it has with SIGKILL, again as killed processes' children come to it, until it has no
   child left; then it exits. Workers die with the guardian (PR_SET_PDEATHSIG), should it be killed. */
#include <dirent.h>
#include <sched.h>
#include <dirent.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__GLIBC__) && !defined(__USE_GNU) /* <sched.h> read without _GNU_SOURCE (see internal.h) */
#define CPU_SETSIZE __CPU_SETSIZE
#define CPU_SET(cpu, set) __CPU_SET_S(cpu, sizeof(cpu_set_t), set)
#define CPU_ISSET(cpu, set) __CPU_ISSET_S(cpu, sizeof(cpu_set_t), set)
#define CPU_ZERO(set) __CPU_ZERO_S(sizeof(cpu_set_t), set)
extern int sched_setaffinity(pid_t pid, size_t cpusetsize, const cpu_set_t *cpuset);
extern int sched_getaffinity(pid_t pid, size_t cpusetsize, cpu_set_t *cpuset);
#endif

#define DDP__LAUNCH_GRACE 3.0      /* seconds between SIGTERM and SIGKILL when stopping workers */
#define DDP__LAUNCH_POLL 0.005     /* seconds between two looks at the workers */
#define DDP__LAUNCH_SETTLE 0.25    /* seconds to collect other failures after the first one */
#define DDP__LAUNCH_MAX_PROCS 65536 /* per node; also the largest --nnodes */
#define DDP__LAUNCH_EARLY 2.0      /* seconds after a worker exited 0 while others run before ddprun says so
                                      (ranks that finish together end within milliseconds of each other) */

/* What every worker of one launch is told: torchrun's launch environment (torch 1.13's
   torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers). */
typedef struct ddp__launch_env {
    int nproc, nnodes, node_rank;
    char master_addr[256];
    int master_port;
    int restart_count, max_restarts;
    char run_id[64];
    char role[64];
    int set_omp; /* OMP_NUM_THREADS=1, as torchrun does when it is unset and nproc > 1 */
    int cpu_bind; /* 1: give each worker its own slice of the launcher's CPUs (ddp__launch_bind) */
} ddp__launch_env;

/* One worker process; rank is the global rank. */
typedef struct ddp__launch_worker {
    pid_t pid;
    int rank, local_rank;
    int status; /* waitpid status, valid once reaped */
    int reaped;
    int lost;   /* the guardian ended before reporting it: its status is unknown, counted as a failure */
    int pidfd;  /* in the guardian: readable once the process has ended (Linux 5.3+); -1 when unavailable */
    int pass;   /* the look (ddp__launch_reap) that found it failed; 0 = not failed */
    double ended; /* ddp__now() when it was seen to have ended */
} ddp__launch_worker;

/* The workers of one attempt and how to report on them. */
typedef struct ddp__launch_group {
    const char *who; /* "ddprun" or "ddp_spawn": starts every line it prints */
    int to_stderr;   /* 1: print to stderr (ddprun); 0: ddp__log at error level (ddp_spawn) */
    int signals;     /* 1: react to the signals ddprun caught (ddp__launch_signal_got) */
    int n;
    int pass;        /* looks at the workers so far */
    ddp__launch_worker *w;
    pid_t guard;     /* the guardian, the workers' parent (ddp__launch_guard); 0 when none runs */
    int from_guard;  /* the launcher reads the guardian's reports here; -1 = closed */
    int to_guard;    /* only the launcher holds this write end; closing it tells the guardian to finish */
    int early_noted; /* ddprun has said that a worker exited 0 while others still ran */
} ddp__launch_group;

/* What the guardian tells the launcher, one whole write() each (atomic: smaller than PIPE_BUF). */
enum {
    DDP__GUARD_STARTED = 1, /* worker `index` runs as `pid` */
    DDP__GUARD_FORK_FAILED, /* fork() for worker `index` failed with errno `value`; no more are started */
    DDP__GUARD_ENDED,       /* worker `index` (`pid`) ended with wait status `value` */
    DDP__GUARD_LEFTOVER     /* at the end, process `pid` (not a worker) was still running: it was killed */
};
typedef struct ddp__launch_report {
    int kind, index, pid, value;
} ddp__launch_report;

/* ddprun's signal handlers write here. A handler can reach nothing but globals, so this is the one
   mutable global of the library; ddp_spawn never touches it. */
static volatile sig_atomic_t ddp__launch_signal_got;   /* the last signal received, 0 = none */
static volatile sig_atomic_t ddp__launch_signal_count; /* how many were received */

static void ddp__launch_say(const ddp__launch_group *lg, const char *fmt, ...) DDP__PRINTF(2, 3);

static void ddp__launch_say(const ddp__launch_group *lg, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (lg->to_stderr) {
        fprintf(stderr, "%s: %s\n", lg->who, msg);
        fflush(stderr);
    } else {
        ddp__log(NULL, DDP_LOG_ERROR, "%s: %s", lg->who, msg);
    }
}

static const char *ddp__launch_signame(int sig) {
    switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    }
    return "a signal without a short name";
}

/* "exited with code 3", "was killed by signal 9 (SIGKILL)" */
static void ddp__launch_describe(const ddp__launch_worker *w, char *buf, size_t size) {
    int status = w->status;
    if (w->lost) {
        snprintf(buf, size, "ended, but its exit status is unknown: the guardian process that watched it was killed");
    } else if (WIFEXITED(status)) {
        snprintf(buf, size, "exited with code %d", WEXITSTATUS(status));
    } else if (WIFSIGNALED(status)) {
        snprintf(buf, size, "was killed by signal %d (%s)%s", WTERMSIG(status), ddp__launch_signame(WTERMSIG(status)),
                 WCOREDUMP(status) ? ", core dumped" : "");
    } else {
        snprintf(buf, size, "ended with wait status 0x%x", (unsigned)status);
    }
}

/* The shell's convention: the exit code, or 128 + the signal number. Never 0 for a failure. */
static int ddp__launch_exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status) ? WEXITSTATUS(status) : 1;
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 1;
}

static int ddp__launch_failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

/* "rank 2 (pid 1234)", with the local rank when this node does not start at rank 0. */
static void ddp__launch_name(const ddp__launch_worker *w, char *buf, size_t size) {
    if (w->rank == w->local_rank)
        snprintf(buf, size, "rank %d (pid %ld)", w->rank, (long)w->pid);
    else
        snprintf(buf, size, "rank %d (local rank %d, pid %ld)", w->rank, w->local_rank, (long)w->pid);
}

static int ddp__launch_running(const ddp__launch_group *lg) {
    int i, n = 0;
    for (i = 0; i < lg->n; i++) n += !lg->w[i].reaped;
    return n;
}

static void ddp__launch_mark_reaped(ddp__launch_worker *w, int status) {
    w->status = status;
    w->reaped = 1;
    w->ended = ddp__now();
    if (w->pidfd >= 0) close(w->pidfd);
    w->pidfd = -1;
}

/* Wait up to timeout_ms for the guardian's next report. Returns 1 with *r filled, 0 when none came
   (or a signal interrupted the wait), -1 when the guardian is gone (end of file: it exited or was
   killed; a report is written whole, so a part of one means the same). */
static int ddp__launch_next_report(const ddp__launch_group *lg, ddp__launch_report *r, int timeout_ms) {
    struct pollfd pfd;
    size_t got = 0;
    if (lg->from_guard < 0) return -1;
    pfd.fd = lg->from_guard;
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (poll(&pfd, 1, timeout_ms) <= 0) return 0;
    while (got < sizeof *r) {
        ssize_t k = read(lg->from_guard, (char *)r + got, sizeof *r - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 1;
}

/* The guardian is gone without reporting them: the running workers died with it (PR_SET_PDEATHSIG)
   or will be stopped by nobody else; each counts as a failure of this look. Returns how many. */
static int ddp__launch_guard_lost(ddp__launch_group *lg) {
    int i, failed = 0;
    for (i = 0; i < lg->n; i++) {
        ddp__launch_worker *w = &lg->w[i];
        if (w->reaped) continue;
        w->lost = 1;
        ddp__launch_mark_reaped(w, 1 << 8); /* as "exited with code 1" for the exit code */
        w->pass = lg->pass;
        failed++;
    }
    return failed;
}

/* One non-blocking look at the workers: read every report the guardian has sent. Returns how many
   workers were found to have failed in this look (marked with its pass number). */
static int ddp__launch_reap(ddp__launch_group *lg) {
    ddp__launch_report r;
    int failed = 0, got;
    lg->pass++;
    while ((got = ddp__launch_next_report(lg, &r, 0)) == 1) {
        ddp__launch_worker *w;
        if (r.kind != DDP__GUARD_ENDED || r.index < 0 || r.index >= lg->n || lg->w[r.index].reaped) continue;
        w = &lg->w[r.index];
        ddp__launch_mark_reaped(w, r.value);
        if (ddp__launch_failed(r.value)) {
            w->pass = lg->pass;
            failed++;
        }
    }
    if (got < 0) failed += ddp__launch_guard_lost(lg);
    return failed;
}

/* Sleep until something may have happened: poll() on fd (the launcher: the guardian's reports; the
   guardian: the launcher's pipe) and on the pidfds of (the first 63) running workers (the guardian's
   only) wakes at once, and a signal to ddprun interrupts it; the DDP__LAUNCH_POLL timeout covers the
   rest (workers without pidfds, kernels before 5.3). */
static void ddp__launch_nap(const ddp__launch_group *lg, int fd) {
    struct pollfd fds[64];
    int i, n = 0;
    if (fd >= 0) {
        fds[n].fd = fd;
        fds[n].events = POLLIN;
        fds[n].revents = 0;
        n++;
    }
    for (i = 0; i < lg->n && n < (int)(sizeof fds / sizeof fds[0]); i++) {
        if (lg->w[i].reaped || lg->w[i].pidfd < 0) continue;
        fds[n].fd = lg->w[i].pidfd;
        fds[n].events = POLLIN;
        fds[n].revents = 0;
        n++;
    }
    if (n == 0) {
        ddp__sleep(DDP__LAUNCH_POLL);
        return;
    }
    poll(fds, (nfds_t)n, (int)(DDP__LAUNCH_POLL * 1000));
}

/* Of the workers that failed since look `since`, the one that most likely made the others fail.
   When a rank dies, the others lose a peer and fail too, all in the same way (the same exit code),
   and on a busy machine they may end before the dead rank can even be reaped. So: a failure unlike
   every other one is the cause; among several such, or none, the earliest seen, then the lowest rank. */
static int ddp__launch_culprit(const ddp__launch_group *lg, int since) {
    int i, j, best = -1, best_unique = 0;
    for (i = 0; i < lg->n; i++) {
        const ddp__launch_worker *a = &lg->w[i];
        int unique = 1;
        if (a->pass < since) continue;
        for (j = 0; j < lg->n; j++)
            if (j != i && lg->w[j].pass >= since && lg->w[j].status == a->status && lg->w[j].lost == a->lost) unique = 0;
        if (best < 0 || unique > best_unique || (unique == best_unique && a->pass < lg->w[best].pass)) {
            best = i;
            best_unique = unique;
        }
    }
    return best;
}

/* "; at about the same time rank 0 (pid 11) exited with code 1, rank 3 (pid 14) exited with code 1":
   the other failures since look `since`, so that nothing is hidden when the guess is wrong. */
static void ddp__launch_also(const ddp__launch_group *lg, int culprit, int since, char *buf, size_t size) {
    size_t len = 0;
    int i, listed = 0, more = 0;
    buf[0] = '\0';
    for (i = 0; i < lg->n; i++) {
        char name[96], how[128];
        if (i == culprit || lg->w[i].pass < since) continue;
        if (listed == 4) {
            more++;
            continue;
        }
        ddp__launch_name(&lg->w[i], name, sizeof name);
        ddp__launch_describe(&lg->w[i], how, sizeof how);
        snprintf(buf + len, size - len, "%s%s %s", listed ? ", " : "; at about the same time ", name, how);
        len = strlen(buf);
        listed++;
    }
    if (more) snprintf(buf + len, size - len, " and %d more", more);
}

static void ddp__launch_signal_all(const ddp__launch_group *lg, int sig) {
    int i;
    for (i = 0; i < lg->n; i++) {
        /* the worker's whole process group (its own children too); the pid alone when the group
           is already gone. Reaped workers' groups are signalled as well: their children may linger. */
        if (lg->w[i].pid <= 0) continue; /* never kill(0) or kill(-1) */
        if (kill(-lg->w[i].pid, sig) != 0 && !lg->w[i].reaped) kill(lg->w[i].pid, sig);
    }
}

/* Stop every worker still running: sig (SIGTERM, or what ddprun received) to each process group,
   then SIGKILL to those still there after the grace period (or at once on a second signal to
   ddprun). Returns when every worker has been reaped. */
static void ddp__launch_stop(ddp__launch_group *lg, int sig) {
    double deadline = ddp__now() + DDP__LAUNCH_GRACE;
    sig_atomic_t signals_before = ddp__launch_signal_count;
    int i;
    ddp__launch_signal_all(lg, sig);
    while (ddp__launch_running(lg) > 0 && ddp__now() < deadline &&
           !(lg->signals && ddp__launch_signal_count != signals_before)) {
        ddp__launch_nap(lg, lg->from_guard);
        ddp__launch_reap(lg);
    }
    for (i = 0; i < lg->n; i++) {
        char name[96];
        if (lg->w[i].reaped) continue;
        ddp__launch_name(&lg->w[i], name, sizeof name);
        ddp__launch_say(lg, "%s did not stop within %.0f s of %s; sending SIGKILL", name, DDP__LAUNCH_GRACE,
                        ddp__launch_signame(sig));
    }
    /* also catches children of workers that ignored the first signal and exited without them */
    ddp__launch_signal_all(lg, SIGKILL);
    while (ddp__launch_running(lg) > 0) { /* the guardian reports each, or its end marks them lost */
        ddp__launch_nap(lg, lg->from_guard);
        ddp__launch_reap(lg);
    }
}

/* ddprun, once per attempt: a worker that exited 0 at least DDP__LAUNCH_EARLY s ago while others still
   run. torchrun waits for the others (a worker that succeeds is not a failure), and so does ddprun,
   but it says so: the others will likely fail or hang waiting for that rank in a collective. */
static void ddp__launch_note_early_exit(ddp__launch_group *lg) {
    int i, first = -1, running = ddp__launch_running(lg);
    char name[96];
    if (!lg->signals || lg->early_noted || running == 0) return;
    for (i = 0; i < lg->n; i++) {
        const ddp__launch_worker *w = &lg->w[i];
        if (w->reaped && !w->lost && w->status == 0 && (first < 0 || w->ended < lg->w[first].ended)) first = i;
    }
    if (first < 0 || ddp__now() - lg->w[first].ended < DDP__LAUNCH_EARLY) return;
    lg->early_noted = 1;
    ddp__launch_name(&lg->w[first], name, sizeof name);
    if (running == 1)
        ddp__launch_say(lg, "%s exited with code 0 while 1 other worker is still running; waiting for it, as torchrun "
                        "does (if it waits for rank %d in a collective, it will fail at its timeout)", name,
                        lg->w[first].rank);
    else
        ddp__launch_say(lg, "%s exited with code 0 while %d other workers are still running; waiting for them, as "
                        "torchrun does (if they wait for rank %d in a collective, they will fail at their timeout)",
                        name, running, lg->w[first].rank);
}

/* Watch the workers until all exited 0 (returns 0), one failed, or ddprun received a signal; in the
   last two cases stop the others, write what happened to msg (DDP__ERR_MAX bytes) and return the
   exit code for ddprun: the failed worker's (128 + signal when it was killed), or 128 + the signal
   ddprun received. */
static int ddp__launch_monitor(ddp__launch_group *lg, char *msg) {
    for (;;) {
        int failed = ddp__launch_reap(lg), running, sig;
        if (failed > 0) {
            char name[96], how[128], also[512];
            const ddp__launch_worker *w;
            int since = lg->pass;
            double settle = ddp__now() + DDP__LAUNCH_SETTLE;
            while (ddp__launch_running(lg) > 0 && ddp__now() < settle) {
                ddp__launch_nap(lg, lg->from_guard);
                ddp__launch_reap(lg);
            }
            w = &lg->w[ddp__launch_culprit(lg, since)];
            running = ddp__launch_running(lg);
            ddp__launch_name(w, name, sizeof name);
            ddp__launch_describe(w, how, sizeof how);
            ddp__launch_also(lg, (int)(w - lg->w), since, also, sizeof also);
            if (running > 0)
                ddp__launch_say(lg, "%s %s%s; stopping the other %d worker%s", name, how, also, running,
                                running == 1 ? "" : "s");
            else
                ddp__launch_say(lg, "%s %s%s", name, how, also);
            ddp__launch_stop(lg, SIGTERM);
            snprintf(msg, DDP__ERR_MAX, "%s of %d %s%s; %d other running worker%s stopped", name, lg->n, how, also,
                     running, running == 1 ? " was" : "s were");
            return ddp__launch_exit_code(w->status);
        }
        running = ddp__launch_running(lg);
        if (running == 0) return 0;
        sig = lg->signals ? (int)ddp__launch_signal_got : 0;
        if (sig) {
            ddp__launch_say(lg, "received %s; forwarding it to the %d running worker%s", ddp__launch_signame(sig),
                            running, running == 1 ? "" : "s");
            ddp__launch_stop(lg, sig);
            snprintf(msg, DDP__ERR_MAX, "%s received %s and stopped its %d running worker%s", lg->who,
                     ddp__launch_signame(sig), running, running == 1 ? "" : "s");
            return 128 + sig;
        }
        ddp__launch_note_early_exit(lg);
        ddp__launch_nap(lg, lg->from_guard);
    }
}

/* Exit statuses are only kept while SIGCHLD is not ignored: with SIG_IGN (or SA_NOCLDWAIT) the
   kernel reaps children at once. Restore the default for as long as workers run; old receives
   the caller's action for ddp__launch_sigchld_restore. */
static void ddp__launch_sigchld_default(struct sigaction *old) {
    struct sigaction sa;
    sigaction(SIGCHLD, NULL, old);
    if (old->sa_handler != SIG_IGN && !(old->sa_flags & SA_NOCLDWAIT)) return;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
}

static void ddp__launch_sigchld_restore(const struct sigaction *old) { sigaction(SIGCHLD, old, NULL); }

/* ---- starting workers ---- */

static void ddp__launch_setenv_int(const char *name, long value) {
    char v[32];
    snprintf(v, sizeof v, "%ld", value);
    setenv(name, v, 1);
}

/* In the forked worker: the variables torchrun sets (see ddp_launcher_main's help for the list). */
static void ddp__launch_export(const ddp__launch_env *e, int local_rank) {
    long world = (long)e->nproc * e->nnodes, rank = (long)e->node_rank * e->nproc + local_rank;
    ddp__launch_setenv_int("RANK", rank);
    ddp__launch_setenv_int("LOCAL_RANK", local_rank);
    ddp__launch_setenv_int("WORLD_SIZE", world);
    ddp__launch_setenv_int("LOCAL_WORLD_SIZE", e->nproc);
    ddp__launch_setenv_int("GROUP_RANK", e->node_rank);
    ddp__launch_setenv_int("GROUP_WORLD_SIZE", e->nnodes);
    ddp__launch_setenv_int("ROLE_RANK", rank);
    ddp__launch_setenv_int("ROLE_WORLD_SIZE", world);
    setenv("ROLE_NAME", e->role, 1);
    setenv("MASTER_ADDR", e->master_addr, 1);
    ddp__launch_setenv_int("MASTER_PORT", e->master_port);
    ddp__launch_setenv_int("TORCHELASTIC_RESTART_COUNT", e->restart_count);
    ddp__launch_setenv_int("TORCHELASTIC_MAX_RESTARTS", e->max_restarts);
    setenv("TORCHELASTIC_RUN_ID", e->run_id, 1);
    setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
    ddp__launch_setenv_int("DDP_RESTART_COUNT", e->restart_count);
    if (e->set_omp) setenv("OMP_NUM_THREADS", "1", 0);
}

/* In the forked worker: bind local_rank to its slice of the CPUs the launcher may use (inherited
   through fork). The allowed CPUs, in increasing order, are cut into nproc contiguous slices of
   equal size (the first `extra` slices get one more); neighbouring ids are usually distinct physical
   cores, and a slice of them keeps a worker's memory traffic and cache on its own core(s). Why: an
   unbound worker that waits by spinning is migrated across cores by the scheduler, and every
   migration costs microseconds (measured: 2-rank 4-byte all_reduce 3.8 us unbound, 0.4 us bound).
   With more workers than CPUs nothing is bound: oversubscribed workers must be free to move (Open
   MPI does the same). Failure to bind is not an error: the worker runs unbound. */
static void ddp__launch_bind(const ddp__launch_env *e, int local_rank) {
#ifdef __linux__
    cpu_set_t allowed, mine;
    int cpus[CPU_SETSIZE], n = 0, c, per, extra, first, count, k;
    if (!e->cpu_bind || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
    for (c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
    if (e->nproc > n) return;
    per = n / e->nproc;
    extra = n % e->nproc;
    first = local_rank * per + (local_rank < extra ? local_rank : extra);
    count = per + (local_rank < extra);
    CPU_ZERO(&mine);
    for (k = 0; k < count; k++) CPU_SET(cpus[first + k], &mine);
    sched_setaffinity(0, sizeof mine, &mine);
#else
    (void)e;
    (void)local_rank;
#endif
}

/* In the forked worker: its own process group (so stopping it stops its children too), and death
   with its parent, the guardian (should the guardian be killed). */
static void ddp__launch_child_setup(pid_t guardian) {
    setpgid(0, 0);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
    if (getppid() != guardian) _exit(1); /* the guardian died before prctl took effect */
}

/* A file descriptor that becomes readable when pid ends (pidfd_open, Linux 5.3+; close-on-exec), or -1. */
static int ddp__launch_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

/* ---- the guardian (see the top of this section) ---- */

/* The signals whose actions the guardian changes, and the workers get back. */
static const int ddp__guard_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD};
#define DDP__GUARD_NSIGNALS ((int)(sizeof ddp__guard_signals / sizeof ddp__guard_signals[0]))

/* The guardian's one write() of a report. The launcher may be gone (EPIPE, SIGPIPE is ignored). */
static void ddp__guard_report(int fd, int kind, int index, pid_t pid, int value) {
    ddp__launch_report r;
    memset(&r, 0, sizeof r);
    r.kind = kind;
    r.index = index;
    r.pid = (int)pid;
    r.value = value;
    while (write(fd, &r, sizeof r) < 0 && errno == EINTR) {
    }
}

/* The guardian ignores the signals that reach the launcher's process group (Ctrl-C, a job system's
   kill of the group: ddprun forwards them to the workers itself, and a killed ddp_spawn caller is
   what the guardian is for) and SIGPIPE; its SIGCHLD is the default (a caller's handler that calls
   wait would steal the statuses). It becomes a child subreaper, named ddp_guardian (the command
   line stays the launcher's). saved[] receives the old actions. */
static void ddp__guard_setup(struct sigaction *saved) {
    struct sigaction sa;
    int i;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    for (i = 0; i < DDP__GUARD_NSIGNALS; i++) {
        sa.sa_handler = ddp__guard_signals[i] == SIGCHLD ? SIG_DFL : SIG_IGN;
        sigaction(ddp__guard_signals[i], &sa, &saved[i]);
    }
#ifdef __linux__
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    prctl(PR_SET_NAME, "ddp_guardian"); /* in ps and top; `pkill ddprun` does not reach it */
#endif
}

/* In a worker forked by the guardian: the launcher's signal actions back, the guardian's pipes and
   the other workers' pidfds closed. */
static void ddp__guard_child(const ddp__launch_group *lg, int upto, const struct sigaction *saved, int fd1, int fd2) {
    int k;
    for (k = 0; k < upto; k++)
        if (lg->w[k].pidfd >= 0) close(lg->w[k].pidfd);
    close(fd1);
    close(fd2);
    for (k = 0; k < DDP__GUARD_NSIGNALS; k++) sigaction(ddp__guard_signals[k], &saved[k], NULL);
}

/* In the guardian: fork the workers: exec argv (ddprun) or run fn (ddp_spawn) in each; report each
   pid, or the first fork() that failed (then lg->n becomes the number started). */
static void ddp__guard_fork_workers(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                                    int (*fn)(int, int, void *), void *arg, const struct sigaction *saved,
                                    int from_launcher, int to_launcher) {
    pid_t self = getpid();
    int i;
    for (i = 0; i < lg->n; i++) {
        ddp__launch_worker *w = &lg->w[i];
        pid_t pid = fork();
        if (pid < 0) {
            ddp__guard_report(to_launcher, DDP__GUARD_FORK_FAILED, i, 0, errno);
            lg->n = i;
            return;
        }
        if (pid == 0) {
            ddp__guard_child(lg, i, saved, from_launcher, to_launcher);
            ddp__launch_child_setup(self);
            ddp__launch_export(e, i);
            ddp__launch_bind(e, i);
            if (argv) {
                execvp(argv[0], argv);
                fprintf(stderr, "%s: cannot run %s: %s\n", lg->who, argv[0], strerror(errno));
                _exit(127);
            } else {
                int rc = fn(w->rank, lg->n, arg);
                fflush(NULL);
                /* exit codes are 8 bits: keep a failure a failure (256 would read as 0) */
                _exit(rc == 0 ? 0 : ((rc & 0xff) ? (rc & 0xff) : 1));
            }
        }
        setpgid(pid, pid); /* also here: the group must exist before anyone signals it */
        w->pid = pid;
        w->pidfd = ddp__launch_pidfd(pid);
        ddp__guard_report(to_launcher, DDP__GUARD_STARTED, i, pid, 0);
    }
}

static int ddp__guard_worker_index(const ddp__launch_group *lg, pid_t pid) {
    int i;
    for (i = 0; i < lg->n; i++)
        if (lg->w[i].pid == pid) return i;
    return -1;
}

/* In the guardian: reap every child that ended (workers, and orphans that came to the subreaper);
   report the workers' ends. */
static void ddp__guard_reap(ddp__launch_group *lg, int to_launcher) {
    int st = 0;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        int i = ddp__guard_worker_index(lg, p);
        if (i < 0 || lg->w[i].reaped) continue;
        ddp__launch_mark_reaped(&lg->w[i], st);
        ddp__guard_report(to_launcher, DDP__GUARD_ENDED, i, p, st);
    }
}

/* 1 once the launcher has closed its end of the pipe (it never writes: readable means end of file). */
static int ddp__guard_launcher_done(int from_launcher) {
    struct pollfd pfd;
    pfd.fd = from_launcher;
    pfd.events = POLLIN;
    pfd.revents = 0;
    return poll(&pfd, 1, 0) > 0;
}

/* SIGKILL each running child of this process (from /proc: the parent is the 4th field of
   /proc/PID/stat, after the parenthesised name, which may itself hold spaces and parentheses).
   When report_to >= 0, each one that is not a worker is reported as left over. */
static void ddp__guard_kill_children(const ddp__launch_group *lg, int report_to) {
    DIR *d = opendir("/proc");
    struct dirent *de;
    long self = (long)getpid();
    if (!d) return;
    while ((de = readdir(d)) != NULL) {
        char path[64], buf[512], state = 0, *end = NULL, *paren;
        long pid = strtol(de->d_name, &end, 10), ppid = 0;
        ssize_t len;
        int fd;
        if (pid <= 0 || *end != '\0') continue;
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        if ((fd = open(path, O_RDONLY)) < 0) continue;
        len = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) continue;
        buf[len] = '\0';
        paren = strrchr(buf, ')');
        if (!paren || sscanf(paren + 1, " %c %ld", &state, &ppid) != 2 || ppid != self || state == 'Z') continue;
        kill((pid_t)pid, SIGKILL);
        if (report_to >= 0 && ddp__guard_worker_index(lg, (pid_t)pid) < 0)
            ddp__guard_report(report_to, DDP__GUARD_LEFTOVER, -1, (pid_t)pid, 0);
    }
    closedir(d);
}

/* In the guardian, once the launcher is done or dead: SIGKILL every child (reporting the ones that
   were left running) and every worker's process group, then again for the children that the killed
   processes leave to the guardian, until it has no child left. */
static void ddp__guard_sweep(const ddp__launch_group *lg, int to_launcher) {
    int round;
    for (round = 0;; round++) {
        int i;
        ddp__guard_kill_children(lg, round == 0 ? to_launcher : -1);
        for (i = 0; i < lg->n; i++)
            if (lg->w[i].pid > 0) kill(-lg->w[i].pid, SIGKILL);
        if (waitpid(-1, NULL, 0) < 0 && errno == ECHILD) return;
    }
}

/* The guardian: start the workers, report on them, and when the launcher closes its pipe (done, or
   killed) leave nothing behind. Never returns. */
static void ddp__launch_guard(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                              int (*fn)(int, int, void *), void *arg, int from_launcher, int to_launcher) {
    struct sigaction saved[DDP__GUARD_NSIGNALS];
    ddp__guard_setup(saved);
    ddp__guard_fork_workers(lg, e, argv, fn, arg, saved, from_launcher, to_launcher);
    while (!ddp__guard_launcher_done(from_launcher)) {
        ddp__guard_reap(lg, to_launcher);
        ddp__launch_nap(lg, from_launcher);
    }
    ddp__guard_sweep(lg, to_launcher);
    _exit(0);
}

/* ---- the launcher's side ---- */

static void ddp__launch_cloexec(int fd) { fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC); }

/* Close the pipe to the guardian (it then stops whatever the workers left running), read what it
   stopped, and wait for it to exit. The group's workers must all have been reaped. */
static void ddp__launch_finish(ddp__launch_group *lg) {
    ddp__launch_report r;
    long pids[4];
    int got, left = 0;
    if (lg->to_guard >= 0) close(lg->to_guard);
    lg->to_guard = -1;
    while ((got = ddp__launch_next_report(lg, &r, 1000)) >= 0) {
        if (got == 1 && r.kind == DDP__GUARD_LEFTOVER && left < 4) pids[left] = r.pid;
        left += got == 1 && r.kind == DDP__GUARD_LEFTOVER;
    }
    if (lg->from_guard >= 0) close(lg->from_guard);
    lg->from_guard = -1;
    while (lg->guard > 0 && waitpid(lg->guard, NULL, 0) < 0 && errno == EINTR) {
    }
    lg->guard = 0;
    if (left > 0) {
        char list[96];
        size_t len = 0;
        int i;
        list[0] = '\0';
        for (i = 0; i < left && i < 4; i++) {
            snprintf(list + len, sizeof list - len, "%s%ld", i ? ", " : "", pids[i]);
            len = strlen(list);
        }
        ddp__launch_say(lg, "the workers left %d process%s running when the group ended (pid%s %s%s); killed %s and "
                        "%s children (SIGKILL)", left, left == 1 ? "" : "es", left == 1 ? "" : "s", list,
                        left > 4 ? ", ..." : "", left == 1 ? "it" : "them", left == 1 ? "its" : "their");
    }
}
/* Read the guardian's STARTED reports, one per worker in order. When a fork() failed or the guardian
   is gone, stop the workers started so far and fail with the reason in err. */
static ddp_result ddp__launch_await_start(ddp__launch_group *lg, char *err) {
    int i = 0;
    while (i < lg->n) {
        ddp__launch_report r;
        int got = ddp__launch_next_report(lg, &r, 1000);
        if (got == 0) continue;
        if (got == 1 && r.kind == DDP__GUARD_STARTED && r.index == i) {
            lg->w[i++].pid = (pid_t)r.pid;
            continue;
        }
        lg->n = i;
        ddp__launch_stop(lg, SIGTERM);
        ddp__launch_finish(lg);
        if (got == 1 && r.kind == DDP__GUARD_FORK_FAILED)
            return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: fork() for local rank %d failed: %s (process limit? see "
                                "ulimit -u)", lg->who, i, strerror(r.value));
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: its guardian process ended (killed?) before it started local "
                            "rank %d; nothing was left running", lg->who, i);
    }
    return DDP_SUCCESS;
}

/* Start the guardian, which starts the workers: exec argv (ddprun) or run fn (ddp_spawn) in each.
   On failure nothing is left running and the error is in err; on success end the group with
   ddp__launch_finish once every worker has been reaped. */
static ddp_result ddp__launch_start(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                                    int (*fn)(int, int, void *), void *arg, char *err) {
    int down[2], up[2], saved; /* down: launcher -> guardian (only closed), up: guardian -> launcher (reports) */
    pid_t pid;
    if (pipe(down) != 0) return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: pipe(): %s", lg->who, strerror(errno));
    if (pipe(up) != 0) {
        saved = errno;
        close(down[0]);
        close(down[1]);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: pipe(): %s", lg->who, strerror(saved));
    }
    ddp__launch_cloexec(down[0]);
    ddp__launch_cloexec(down[1]);
    ddp__launch_cloexec(up[0]);
    ddp__launch_cloexec(up[1]);
    fflush(NULL); /* or buffered output would be written again by every worker */
    pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        ddp__launch_guard(lg, e, argv, fn, arg, down[0], up[1]);
    }
    saved = errno;
    close(down[0]);
    close(up[1]);
    if (pid < 0) {
        close(down[1]);
        close(up[0]);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: fork() for the guardian of the workers failed: %s (process "
                            "limit? see ulimit -u)", lg->who, strerror(saved));
    }
    lg->guard = pid;
    lg->to_guard = down[1];
    lg->from_guard = up[0];
    return ddp__launch_await_start(lg, err);
}

/* ddprun (is_ddprun = 1) prints to stderr and reacts to the signals it caught; ddp_spawn logs. */
static ddp__launch_group ddp__launch_group_make(int is_ddprun, int n, int first_rank, ddp__launch_worker *w) {
    ddp__launch_group lg;
    int i;
    lg.who = is_ddprun ? "ddprun" : "ddp_spawn";
    lg.to_stderr = is_ddprun;
    lg.signals = is_ddprun;
    lg.n = n;
    lg.pass = 0;
    lg.w = w;
    lg.guard = 0;
    lg.from_guard = -1;
    lg.to_guard = -1;
    lg.early_noted = 0;
    for (i = 0; i < n; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].rank = first_rank + i;
        w[i].local_rank = i;
        w[i].pidfd = -1;
    }
    return lg;
}

/* A TCP port that was free a moment ago: bind port 0 and read what the kernel chose (what torchrun
   --standalone does; another process may still take it before rank 0 binds it). */
static int ddp__launch_free_port(char *err) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot find a free port: socket(): %s", strerror(errno));
        return -1;
    }
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot find a free port: bind(port 0): %s", strerror(errno));
        close(fd);
        return -1;
    }
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static void ddp__launch_env_defaults(ddp__launch_env *e) {
    memset(e, 0, sizeof *e);
    e->nproc = 1;
    e->nnodes = 1;
    snprintf(e->master_addr, sizeof e->master_addr, "127.0.0.1");
    e->master_port = 29500;
    snprintf(e->run_id, sizeof e->run_id, "none");
    snprintf(e->role, sizeof e->role, "default");
}

/* ---- ddp_spawn ---- */

DDP_API ddp_result ddp_spawn(int nprocs, int (*fn)(int rank, int world_size, void *arg), void *arg) {
    ddp__launch_env e;
    ddp__launch_group lg;
    ddp__launch_worker *w;
    ddp_result r;
    struct sigaction old_chld;
    char *err = ddp__error_buffer(NULL);
    char msg[DDP__ERR_MAX];
    if (nprocs < 1 || nprocs > DDP__LAUNCH_MAX_PROCS)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_spawn: nprocs=%d must be in [1, %d]", nprocs,
                         DDP__LAUNCH_MAX_PROCS);
    if (!fn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_spawn: fn is NULL; pass the function each process runs");
    ddp__launch_env_defaults(&e);
    e.nproc = nprocs;
    e.set_omp = nprocs > 1;
    e.master_port = ddp__launch_free_port(err);
    if (e.master_port < 0) return DDP_ERR_SYSTEM;
    w = (ddp__launch_worker *)ddp__calloc((size_t)nprocs, sizeof *w);
    if (!w) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_spawn: cannot allocate %d worker records", nprocs);
    lg = ddp__launch_group_make(0, nprocs, 0, w);
    ddp__launch_sigchld_default(&old_chld);
    r = ddp__launch_start(&lg, &e, NULL, fn, arg, err);
    if (r == DDP_SUCCESS) {
        int code = ddp__launch_monitor(&lg, msg);
        ddp__launch_finish(&lg);
        if (code != 0) r = ddp__fail(NULL, DDP_ERR_WORKER_FAILED, "ddp_spawn: %s", msg);
    }
    ddp__launch_sigchld_restore(&old_chld);
    ddp__free(w);
    return r;
}

/* ---- ddprun ---- */

/* The parsed command line. */
typedef struct ddp__launch_args {
    ddp__launch_env env;
    int standalone, port_given, help, nnodes_given, node_rank_given, run_id_given;
    char **program; /* NULL-terminated argv of the program */
} ddp__launch_args;

static const char ddp__launch_usage[] =
    "usage: ddprun [flags] [--] PROGRAM [ARGS...]\n"
    "Start PROGRAM once per worker with torchrun's environment, so that ddp_init(NULL) (or torch's\n"
    "init_process_group(\"env://\")) in it joins the group. Flags take `--flag value` or `--flag=value`,\n"
    "with dashes or underscores (--nproc-per-node or --nproc_per_node).\n"
    "\n"
    "  --nproc-per-node N    workers on this node (default 1); \"cpu\" = the number of online CPUs.\n"
    "                        \"gpu\" and \"auto\" are not accepted: ddprun does not link CUDA; give the\n"
    "                        number of GPUs (for example $(nvidia-smi -L | wc -l)).\n"
    "  --nnodes M            nodes taking part (default 1); every node runs ddprun with the same\n"
    "                        --nproc-per-node, --nnodes, --master-addr and --master-port\n"
    "  --node-rank K         this node's index in [0, M) (default 0); it starts global ranks\n"
    "                        K*N .. K*N+N-1\n"
    "  --master-addr HOST    where rank 0 serves the rendezvous store (default 127.0.0.1)\n"
    "  --master-port PORT    its TCP port (default 29500)\n"
    "  --standalone          single node on a free port (found by binding port 0); a new one is picked\n"
    "                        for each restart. Excludes --master-port and --nnodes/--node-rank other than 1/0\n"
    "  --max-restarts R      when a worker fails, stop all and start the whole group again, at most R\n"
    "                        times (default 0); TORCHELASTIC_RESTART_COUNT and DDP_RESTART_COUNT tell\n"
    "                        the program which attempt it is, so it can resume from its checkpoint\n"
    "  --rdzv-id ID          TORCHELASTIC_RUN_ID, the job's name in the store: give every node the same\n"
    "                        one (default: a random UUID per launch on one node, \"none\" across nodes;\n"
    "                        a rank that reaches the store of a job with another run id says so)\n"
    "  --role NAME           ROLE_NAME (default \"default\")\n"
    "  --cpu-bind MODE       \"auto\" (default): when there are at least N CPUs that ddprun may run on,\n"
    "                        each worker is bound to its own contiguous slice of them (as mpirun binds);\n"
    "                        with more workers than CPUs nothing is bound. \"none\": never bind (use\n"
    "                        this when the program sets its own affinity or several jobs share the CPUs)\n"
    "  --no-python           accepted and ignored: ddprun always runs PROGRAM itself\n"
    "  -h, --help            this text\n"
    "\n"
    "Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (= node rank),\n"
    "GROUP_WORLD_SIZE (= nnodes), ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,\n"
    "TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,\n"
    "TORCHELASTIC_USE_AGENT_STORE=False (rank 0 serves the store), DDP_RESTART_COUNT, and\n"
    "OMP_NUM_THREADS=1 when it is unset and N > 1. Each worker runs in its own process group.\n"
    "No orphans: when the group ends, or when ddprun is killed (even with SIGKILL), every process\n"
    "the workers started that still runs (children, daemons) is killed with SIGKILL.\n"
    "\n"
    "When a worker exits non-zero or is killed by a signal, ddprun says which rank and how, sends\n"
    "SIGTERM to the other workers (SIGKILL after 3 s) and exits with the worker's code (128 + signal\n"
    "number when it was killed). SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to ddprun are forwarded to\n"
    "the workers, which are then stopped the same way; ddprun then exits with 128 + that signal.\n"
    "A worker that exits 0 while others still run is waited for, as torchrun does; ddprun says so.\n"
    "Rendezvous is static: torchrun's elastic rendezvous (--rdzv-backend, --rdzv-endpoint, a range\n"
    "in --nnodes) is not supported.\n";

/* Flags torchrun has that ddprun refuses, with the reason. */
static const char *ddp__launch_refused(const char *name) {
    static const char *elastic = "elastic rendezvous is not supported; use static rendezvous: the same --nnodes, "
                                 "--master-addr and --master-port on every node, and each node's own --node-rank";
    static const char *python = "ddprun runs a program, not a Python module or script path; give the interpreter "
                                "as the program: ddprun ... python3 -m MODULE";
    static const char *output = "ddprun does not redirect worker output: every worker writes to ddprun's own "
                                "stdout and stderr";
    if (!strcmp(name, "rdzv-backend") || !strcmp(name, "rdzv-endpoint") || !strcmp(name, "rdzv-conf") ||
        !strcmp(name, "max-nodes") || !strcmp(name, "min-nodes"))
        return elastic;
    if (!strcmp(name, "module") || !strcmp(name, "run-path")) return python;
    if (!strcmp(name, "redirects") || !strcmp(name, "tee") || !strcmp(name, "log-dir")) return output;
    return NULL;
}

static ddp_result ddp__launch_parse_long(const char *flag, const char *v, long lo, long hi, long *out, char *err) {
    char *end = NULL;
    long x = 0;
    errno = 0;
    x = strtol(v, &end, 10);
    if (errno || end == v || *end != '\0' || x < lo || x > hi)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s \"%s\": expected an integer in [%ld, %ld]", flag, v, lo,
                            hi);
    *out = x;
    return DDP_SUCCESS;
}

static ddp_result ddp__launch_parse_nproc(const char *v, int *out, char *err) {
    long x = 0;
    if (!strcmp(v, "cpu")) {
        x = sysconf(_SC_NPROCESSORS_ONLN);
        *out = x > 0 ? (int)DDP__MIN(x, (long)DDP__LAUNCH_MAX_PROCS) : 1;
        return DDP_SUCCESS;
    }
    if (!strcmp(v, "gpu") || !strcmp(v, "auto"))
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--nproc-per-node %s: ddprun does not link CUDA and cannot "
                            "count GPUs; give the number of workers, e.g. --nproc-per-node $(nvidia-smi -L | wc -l)", v);
    if (ddp__launch_parse_long("nproc-per-node", v, 1, DDP__LAUNCH_MAX_PROCS, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
    *out = (int)x;
    return DDP_SUCCESS;
}

/* torchrun writes a range "MIN:MAX" for elastic jobs; only MIN == MAX is a static job. */
static ddp_result ddp__launch_parse_nnodes(const char *v, int *out, char *err) {
    const char *colon = strchr(v, ':');
    long lo = 0, hi = 0;
    char first[32];
    if (!colon) {
        if (ddp__launch_parse_long("nnodes", v, 1, DDP__LAUNCH_MAX_PROCS, &lo, err)) return DDP_ERR_INVALID_ARGUMENT;
        *out = (int)lo;
        return DDP_SUCCESS;
    }
    if ((size_t)(colon - v) >= sizeof first) return ddp__launch_parse_long("nnodes", v, 1, 1, &lo, err);
    memcpy(first, v, (size_t)(colon - v));
    first[colon - v] = '\0';
    if (ddp__launch_parse_long("nnodes", first, 1, DDP__LAUNCH_MAX_PROCS, &lo, err) ||
        ddp__launch_parse_long("nnodes", colon + 1, 1, DDP__LAUNCH_MAX_PROCS, &hi, err))
        return DDP_ERR_INVALID_ARGUMENT;
    if (lo != hi)
        return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "--nnodes %s: a range of nodes needs elastic rendezvous, which "
                            "ddprun does not support; give one number", v);
    *out = (int)lo;
    return DDP_SUCCESS;
}

static ddp_result ddp__launch_copy(const char *flag, const char *v, char *dst, size_t size, char *err) {
    if (!*v || strlen(v) >= size)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s \"%s\": expected a non-empty value shorter than %d "
                            "characters", flag, v, (int)size);
    memcpy(dst, v, strlen(v) + 1);
    return DDP_SUCCESS;
}

/* Apply one flag that takes a value; name is normalised (dashes). The parsing functions below
   return DDP_SUCCESS or an error with the message in err. */
static ddp_result ddp__launch_apply(ddp__launch_args *a, const char *name, const char *v, char *err) {
    long x = 0;
    if (!strcmp(name, "nproc-per-node")) return ddp__launch_parse_nproc(v, &a->env.nproc, err);
    if (!strcmp(name, "nnodes")) {
        a->nnodes_given = 1;
        return ddp__launch_parse_nnodes(v, &a->env.nnodes, err);
    }
    if (!strcmp(name, "node-rank")) {
        a->node_rank_given = 1;
        if (ddp__launch_parse_long(name, v, 0, DDP__LAUNCH_MAX_PROCS - 1, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
        a->env.node_rank = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "master-addr")) return ddp__launch_copy(name, v, a->env.master_addr, sizeof a->env.master_addr, err);
    if (!strcmp(name, "master-port")) {
        a->port_given = 1;
        if (ddp__launch_parse_long(name, v, 1, 65535, &x, err)) {
            if (!strcmp(v, "0")) strncat(err, " (for a free port use --standalone)", DDP__ERR_MAX - strlen(err) - 1);
            return DDP_ERR_INVALID_ARGUMENT;
        }
        a->env.master_port = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "max-restarts")) {
        if (ddp__launch_parse_long(name, v, 0, 1000000, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
        a->env.max_restarts = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "rdzv-id")) {
        a->run_id_given = 1;
        return ddp__launch_copy(name, v, a->env.run_id, sizeof a->env.run_id, err);
    }
    if (!strcmp(name, "role")) return ddp__launch_copy(name, v, a->env.role, sizeof a->env.role, err);
    if (!strcmp(name, "cpu-bind")) {
        if (strcmp(v, "auto") && strcmp(v, "none"))
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--cpu-bind \"%s\": expected auto or none", v);
        a->env.cpu_bind = !strcmp(v, "auto");
        return DDP_SUCCESS;
    }
    return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag --%s", name);
}

static int ddp__launch_is_switch(const char *name) {
    return !strcmp(name, "standalone") || !strcmp(name, "no-python") || !strcmp(name, "help");
}

static int ddp__launch_takes_value(const char *name) {
    static const char *names[] = {"nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port",
                                  "max-restarts", "rdzv-id", "role", "cpu-bind"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i])) return 1;
    return 0;
}

/* One "--flag[=value]" at argv[*i]; may consume the next argument as its value. */
static ddp_result ddp__launch_parse_flag(ddp__launch_args *a, int argc, char **argv, int *i, char *err) {
    const char *arg = argv[*i] + 2, *eq = strchr(arg, '='), *value = eq ? eq + 1 : NULL;
    const char *refused;
    char name[64];
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg), k;
    if (len == 0 || len >= sizeof name) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag %s", argv[*i]);
    for (k = 0; k < len; k++) name[k] = arg[k] == '_' ? '-' : arg[k];
    name[len] = '\0';
    if (ddp__launch_is_switch(name)) {
        if (value) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s takes no value (got \"%s\")", name, value);
        if (!strcmp(name, "standalone")) a->standalone = 1;
        if (!strcmp(name, "help")) a->help = 1;
        return DDP_SUCCESS; /* --no-python: we always run the program itself */
    }
    refused = ddp__launch_refused(name);
    if (refused) return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "--%s: %s", name, refused);
    if (!ddp__launch_takes_value(name)) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag --%s", name);
    if (!value) {
        if (*i + 1 >= argc) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s needs a value", name);
        value = argv[++*i];
    }
    return ddp__launch_apply(a, name, value, err);
}

/* The flags before the program; the first argument that is not a flag (or the one after "--")
   is the program, and everything after it belongs to the program. */
static ddp_result ddp__launch_parse(ddp__launch_args *a, int argc, char **argv, char *err) {
    int i;
    memset(a, 0, sizeof *a);
    ddp__launch_env_defaults(&a->env);
    a->env.cpu_bind = 1; /* ddprun binds unless told not to; ddp_spawn never does (the caller's process) */
    for (i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--")) {
            i++;
            break;
        }
        if (!strcmp(arg, "-h")) {
            a->help = 1;
            continue;
        }
        if (arg[0] != '-' || arg[1] == '\0') break;
        if (arg[1] != '-') return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag %s", arg);
        if (ddp__launch_parse_flag(a, argc, argv, &i, err)) return DDP_ERR_INVALID_ARGUMENT;
    }
    a->program = i < argc ? argv + i : NULL;
    return DDP_SUCCESS;
}

/* Checks that need all the flags at once. */
static ddp_result ddp__launch_validate(ddp__launch_args *a, char *err) {
    ddp__launch_env *e = &a->env;
    if (!a->program)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "missing the program to run: ddprun [flags] [--] PROGRAM [ARGS...]");
    if (a->standalone && (e->nnodes != 1 || e->node_rank != 0))
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--standalone is for one node, but --nnodes %d --node-rank %d "
                            "were given; drop --standalone or those flags", e->nnodes, e->node_rank);
    if (a->standalone && a->port_given)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--standalone picks a free port itself; drop --master-port "
                            "or --standalone");
    if (e->node_rank >= e->nnodes)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--node-rank %d must be smaller than --nnodes %d (node ranks "
                            "are 0 .. nnodes-1)", e->node_rank, e->nnodes);
    if ((long long)e->nproc * e->nnodes > INT_MAX)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--nproc-per-node %d times --nnodes %d is too many ranks",
                            e->nproc, e->nnodes);
    return DDP_SUCCESS;
}

/* 1 when execvp would find prog: a path to an executable file, or one in PATH. */
static int ddp__launch_executable(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

static int ddp__launch_findable(const char *prog) {
    const char *path = getenv("PATH"), *p;
    char buf[4096];
    if (strchr(prog, '/')) return ddp__launch_executable(prog);
    if (!path) path = "/usr/local/bin:/usr/bin:/bin";
    for (p = path;; p++) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        int n = len ? snprintf(buf, sizeof buf, "%.*s/%s", (int)len, p, prog) : snprintf(buf, sizeof buf, "%s", prog);
        if (n > 0 && (size_t)n < sizeof buf && ddp__launch_executable(buf)) return 1;
        if (!end) return 0;
        p = end;
    }
}

/* torchrun --standalone names its run with a random UUID (version 4). */
static void ddp__launch_uuid(char *out, size_t size) {
    unsigned char b[16];
    size_t i, got = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        got = fread(b, 1, sizeof b, f);
        fclose(f);
    }
    if (got != sizeof b) {
        uint64_t s = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull ^ (uint64_t)(ddp__now() * 1e9);
        for (i = 0; i < sizeof b; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            b[i] = (unsigned char)(s >> 56);
        }
    }
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    snprintf(out, size, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void ddp__launch_on_signal(int sig) {
    ddp__launch_signal_got = sig;
    ddp__launch_signal_count = ddp__launch_signal_count + 1;
}

static const int ddp__launch_forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
#define DDP__LAUNCH_NFORWARDED ((int)(sizeof ddp__launch_forwarded / sizeof ddp__launch_forwarded[0]))

/* Catch the signals ddprun forwards; one that was ignored when ddprun started (nohup, `&` in a
   script) stays ignored, as shells expect. old[] receives the previous actions. */
static void ddp__launch_catch(struct sigaction *old) {
    struct sigaction sa;
    int i;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ddp__launch_on_signal;
    sigemptyset(&sa.sa_mask);
    ddp__launch_signal_got = 0;
    ddp__launch_signal_count = 0;
    for (i = 0; i < DDP__LAUNCH_NFORWARDED; i++) {
        sigaction(ddp__launch_forwarded[i], NULL, &old[i]);
        if (old[i].sa_handler != SIG_IGN) sigaction(ddp__launch_forwarded[i], &sa, NULL);
    }
}

static void ddp__launch_uncatch(const struct sigaction *old) {
    int i;
    for (i = 0; i < DDP__LAUNCH_NFORWARDED; i++) sigaction(ddp__launch_forwarded[i], &old[i], NULL);
}

/* ---- the flight recorder's files (trace.c) when a job fails ----
   ddprun gives its workers DDP_TRACE_DIR (a directory of its own, $TMPDIR/ddprun_trace.XXXXXX, unless
   the user set one), so each rank writes its recorder there when its group breaks (or when ddprun stops it
   with SIGTERM). After a failed attempt ddprun reads the world group's section of every file of that
   attempt (", restart K" in the header) and prints one line per local rank: the last collective it
   finished and the first one it had not, and flags the ranks that are behind: those whose newest
   collective is the lowest, when the ranks differ. Its own directory is removed after a success and
   kept (and named) after a failure. */
typedef struct ddp__launch_trace {
    int found;
    long newest;          /* the newest collective number (#N) recorded */
    char last_done[160];  /* "#5 barrier()" */
    char pending[320];    /* the first entry after it not done: "#6 all_reduce(...) failed after 2.0 s (...)" */
} ddp__launch_trace;

/* Read the world group's section of one trace file for restart `attempt` into *t; its rank, or -1. */
static int ddp__launch_trace_read(const char *path, int attempt, ddp__launch_trace *t) {
    char line[1024];
    int rank = -1, in_world = 0;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    memset(t, 0, sizeof *t);
    while (fgets(line, sizeof line, f)) {
        char *end;
        if (strncmp(line, "ddp trace rank ", 15) == 0) {
            const char *restart = strstr(line, ", restart ");
            in_world = strstr(line, "), group world,") && restart && strtol(restart + 10, NULL, 10) == attempt;
            if (in_world) rank = atoi(line + 15), t->found = 1;
        } else if (in_world && strncmp(line, "  #", 3) == 0) {
            if ((end = strstr(line, ", queued "))) *end = '\0';
            t->newest = strtol(line + 3, NULL, 10);
            if ((end = strstr(line, " done in "))) {
                *end = '\0';
                snprintf(t->last_done, sizeof t->last_done, "%.150s", line + 2);
                t->pending[0] = '\0';
            } else if (!t->pending[0]) {
                snprintf(t->pending, sizeof t->pending, "%.300s", line + 2);
            }
        }
    }
    fclose(f);
    return t->found ? rank : -1;
}

/* One line per local rank from the files of this attempt in DDP_TRACE_DIR (nothing when none wrote one). */
static void ddp__launch_trace_summary(const ddp__launch_group *lg, int attempt) {
    const char *dir = ddp__env("DDP_TRACE_DIR");
    ddp__launch_trace *t;
    struct dirent *de;
    DIR *d;
    long lo = LONG_MAX, hi = 0;
    int i, any = 0, first = lg->n ? lg->w[0].rank : 0;
    if (!dir || !(d = opendir(dir))) return;
    if (!(t = (ddp__launch_trace *)ddp__calloc((size_t)lg->n + 1, sizeof *t))) {
        closedir(d);
        return;
    }
    while ((de = readdir(d))) { /* a rank with several files (a forked child dumped too): the furthest */
        char path[1024];
        int r;
        if (strncmp(de->d_name, "ddp_trace_rank", 14) != 0 || !strstr(de->d_name, ".txt") || strstr(de->d_name, ".tmp")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if ((r = ddp__launch_trace_read(path, attempt, &t[lg->n])) < first || r >= first + lg->n) continue;
        if (!t[r - first].found || t[lg->n].newest > t[r - first].newest) t[r - first] = t[lg->n];
    }
    closedir(d);
    for (i = 0; i < lg->n; i++)
        if (t[i].found) any = 1, lo = DDP__MIN(lo, t[i].newest), hi = DDP__MAX(hi, t[i].newest);
    if (any) fprintf(stderr, "ddprun: flight recorder: each rank's last collectives (full traces in %s):\n", dir);
    for (i = 0; any && i < lg->n; i++) {
        if (!t[i].found) {
            fprintf(stderr, "ddprun:   rank %d: no trace (it wrote none: recorder off, DDP_TRACE_SIGNAL=0, or killed "
                            "with SIGKILL)\n", first + i);
            continue;
        }
        fprintf(stderr, "ddprun:   rank %d: last done %s; %s%s\n", first + i, t[i].last_done[0] ? t[i].last_done : "none",
                t[i].pending[0] ? t[i].pending : "nothing in progress",
                t[i].newest == lo && lo < hi ? "  <- behind: the other ranks got further" : "");
    }
    if (any && lo < hi)
        fprintf(stderr, "ddprun: the ranks behind stopped at #%ld while others reached #%ld: look at what they do "
                        "between those collectives\n", lo, hi);
    ddp__free(t);
}

/* Give the workers a DDP_TRACE_DIR of ddprun's own when the user set none: 1 when it made one (in dir). */
static int ddp__launch_trace_begin(char *dir, size_t cap) {
    dir[0] = '\0';
    const char *tmp = ddp__env("TMPDIR");
    if (ddp__env("DDP_TRACE_DIR")) return 0;
    if ((size_t)snprintf(dir, cap, "%s/ddprun_trace.XXXXXX", tmp ? tmp : "/tmp") >= cap) snprintf(dir, cap, "/tmp/ddprun_trace.XXXXXX");
    if (!mkdtemp(dir)) {
        dir[0] = '\0';
        return 0;
    }
    setenv("DDP_TRACE_DIR", dir, 1);
    return 1;
}

/* ddprun's own directory: removed after a success, or when empty; kept after a failure that left
   traces (the summary named it). */
static void ddp__launch_trace_end(const char *dir, int own, int code) {
    struct dirent *de;
    DIR *d;
    if (!own) return;
    if (code != 0 || !(d = opendir(dir))) {
        rmdir(dir); /* only when empty */
        return;
    }
    while ((de = readdir(d))) {
        char path[1024];
        if (strncmp(de->d_name, "ddp_trace_rank", 14) != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* Start the group, restart it after failures while restarts are left; returns ddprun's exit code. */
static int ddp__launch_run(ddp__launch_args *a, ddp__launch_group *lg) {
    char err[DDP__ERR_MAX], msg[DDP__ERR_MAX];
    int attempt, code = 1;
    for (attempt = 0; attempt <= a->env.max_restarts; attempt++) {
        a->env.restart_count = attempt;
        if (a->standalone && (a->env.master_port = ddp__launch_free_port(err)) < 0) {
            fprintf(stderr, "ddprun: %s\n", err);
            return 1;
        }
        *lg = ddp__launch_group_make(1, a->env.nproc, a->env.node_rank * a->env.nproc, lg->w);
        if (ddp__launch_start(lg, &a->env, a->program, NULL, NULL, err) != DDP_SUCCESS) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        code = ddp__launch_monitor(lg, msg);
        ddp__launch_finish(lg);
        if (code == 0) return 0;
        ddp__launch_trace_summary(lg, attempt);
        if (ddp__launch_signal_got) return code; /* the user asked to stop: no restart */
        if (attempt < a->env.max_restarts)
            fprintf(stderr, "ddprun: restarting the worker group (restart %d of at most %d)\n", attempt + 1,
                    a->env.max_restarts);
    }
    fprintf(stderr, "ddprun: failed: %s%s\n", msg, a->env.max_restarts ? " (no restarts left)" : "");
    return code;
}

DDP_API int ddp_launcher_main(int argc, char **argv) {
    ddp__launch_args a;
    ddp__launch_group lg;
    struct sigaction old[DDP__LAUNCH_NFORWARDED], old_chld;
    char err[DDP__ERR_MAX], trace_dir[512];
    int code, trace_own;
    if (ddp__launch_parse(&a, argc, argv, err) != 0 || (!a.help && ddp__launch_validate(&a, err) != 0)) {
        fprintf(stderr, "ddprun: %s\nTry 'ddprun --help'.\n", err);
        return 2;
    }
    if (a.help) {
        fputs(ddp__launch_usage, stdout);
        return 0;
    }
    if (!ddp__launch_findable(a.program[0])) {
        fprintf(stderr, "ddprun: cannot run %s: no executable file %s%s\n", a.program[0],
                strchr(a.program[0], '/') ? "at that path" : "of that name in PATH",
                strchr(a.program[0], '/') ? "" : " (for a program in this directory write ./NAME)");
        return 2;
    }
    /* Name the job (torchrun names only --standalone's): a worker whose rank 0 could not bind the port
       and that reaches another job's store there then fails saying so (group.c: ddp__rdzv_job).
       Across nodes every ddprun must name the same run, which only --rdzv-id can do. */
    if ((a.standalone || a.env.nnodes == 1) && !a.run_id_given) ddp__launch_uuid(a.env.run_id, sizeof a.env.run_id);
    a.env.set_omp = a.env.nproc > 1 && !ddp__env("OMP_NUM_THREADS");
    if (a.env.set_omp)
        fprintf(stderr, "ddprun: setting OMP_NUM_THREADS=1 for each worker (it is unset) so that %d workers do not "
                        "overload the machine; set it yourself to tune\n", a.env.nproc);
    lg.w = (ddp__launch_worker *)ddp__calloc((size_t)a.env.nproc, sizeof *lg.w);
    if (!lg.w) {
        fprintf(stderr, "ddprun: out of memory for %d worker records\n", a.env.nproc);
        return 1;
    }
    trace_own = ddp__launch_trace_begin(trace_dir, sizeof trace_dir);
    ddp__launch_catch(old);
    ddp__launch_sigchld_default(&old_chld);
    code = ddp__launch_run(&a, &lg);
    ddp__launch_trace_end(trace_dir, trace_own, code);
    ddp__launch_sigchld_restore(&old_chld);
    ddp__launch_uncatch(old);
    ddp__free(lg.w);
    return code;
}
/* ==================== end src/launcher.c ==================== */

/* ==================== begin src/reducer.c ==================== */
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
     join                     (uneven_inputs) shadow the others' passes until every rank has joined

   Where gradients live (g = the gradients' dtype, c = the communication dtype):
     plain                     program's grad --(x 1/world, g -> c)--> comm bucket --all-reduce--> grad
     gradient_as_bucket_view   storage bucket (g) IS the grad; comm bucket = storage when c == g (the
                              scaling is then in place), else a separate c-typed copy as above

   Bucket assignment (PyTorch's compute_bucket_assignment_by_size): walk the parameters in a given order
   (reverse registration at first, then the observed ready order); each dtype has one open bucket; add the
   parameter to it; when the bucket's bytes reach its limit, close it; the first bucket of a dtype has
   limit first_bucket_bytes, later ones bucket_cap_bytes. Buckets are numbered by the walk position of
   their first parameter, which is the order they fill in, and so the order they are all-reduced in. */

#define DDP__REDUCER_DEFAULT_CAP ((size_t)25 << 20)        /* DDP's bucket_cap_mb = 25 */
#define DDP__REDUCER_DEFAULT_FIRST ((size_t)1 << 20)       /* dist._DEFAULT_FIRST_BUCKET_BYTES */
#define DDP__REDUCER_BROADCAST_CHUNK ((size_t)250 << 20)   /* DDP's broadcast_bucket_size */
#define DDP__REDUCER_SMALL_TENSOR ((size_t)1 << 20)        /* smaller tensors are coalesced for broadcast */
#define DDP__REDUCER_NAME_RECORD 72                        /* name bytes in a mismatch record */
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
    (void)g;
    if (bytes) memset(dst, 0, bytes);
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

static void ddp__host_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                    size_t count, double scale) {
    size_t i;
    (void)g;
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

static void ddp__host_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count) {
    size_t i;
    (void)g;
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
    void *storage;        /* gradient_as_bucket_view: the gradients themselves; else NULL */
    void *comm;           /* what is all-reduced; == storage for a view without compression */
    int pending;          /* gradients still to come in this backward pass */
    ddp_work *work;       /* its all-reduce, while in flight */
} ddp__bucket;

typedef struct ddp__layout {
    ddp__bucket *buckets;
    int nbuckets;
    int *params;          /* parameter indices, grouped by bucket, in walk order */
    int *param_bucket;    /* per parameter */
    size_t *param_offset; /* per parameter: element offset in its bucket */
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
    void *bstage;      /* staging for coalesced buffer broadcasts */
    size_t bstage_bytes;

    /* uneven_inputs (Join): see "uneven inputs" below */
    int32_t *join_table;  /* world records of DDP__JOIN_FIELDS: the last round's announcements */
    int join_steps;       /* backward passes this rank announced since the last join */
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
/* Gradients scaled and reduced in place in the bucket (a view without compression). */
static int ddp__bucket_in_place(const ddp__bucket *b) { return b->storage != NULL && b->comm == b->storage; }
static size_t ddp__tensor_bytes(const ddp__rtensor *t) { return t->count * ddp_dtype_size(t->dtype); }

/* ---- creation and registration ---- */

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

static uint64_t ddp__fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t ddp__rtensor_hash(uint64_t h, const ddp__rtensor *t) {
    uint64_t count = t->count, dtype = (uint64_t)t->dtype;
    h = ddp__fnv1a(h, t->name, strlen(t->name) + 1);
    h = ddp__fnv1a(h, &count, sizeof count);
    return ddp__fnv1a(h, &dtype, sizeof dtype);
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
    rec->name_hash = ddp__fnv1a(14695981039346656037ull, t->name, strlen(t->name));
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
    for (k = 0; k < world; k++) n = DDP__MAX(n, (int)(prints[4 * k + 1] + prints[4 * k + 2]));
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

/* PyTorch's _verify_param_shape_across_processes, hang-free: a fixed-size all_gather first. */
static ddp_result ddp__reducer_verify(ddp_reducer *r) {
    ddp_group *g = r->g;
    int world = ddp_world_size(g), i, k;
    uint64_t mine[4], *all;
    ddp_result res;
    mine[0] = 0x4444505245445543ull; /* "DDPREDUC": a reducer's record */
    mine[1] = (uint64_t)r->nparams;
    mine[2] = (uint64_t)r->nbuffers;
    mine[3] = 14695981039346656037ull;
    for (i = 0; i < r->nparams; i++) mine[3] = ddp__rtensor_hash(mine[3], &r->params[i]);
    for (i = 0; i < r->nbuffers; i++) mine[3] = ddp__rtensor_hash(mine[3] ^ 0x9e3779b97f4a7c15ull, &r->buffers[i]);
    all = (uint64_t *)ddp__calloc((size_t)world * 4, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_finalize: out of memory");
    if ((res = ddp_all_gather(g, mine, all, 4, DDP_I64)) != DDP_SUCCESS) {
        ddp__free(all);
        return res;
    }
    for (k = 0; k < world; k++) /* another all_gather of 4 x i64 would pass the collective's fingerprint */
        if (all[4 * k] != mine[0] || all[4 * k + 1] > INT_MAX / 4 || all[4 * k + 2] > INT_MAX / 4) {
            ddp__free(all);
            return ddp__fail(g, DDP_ERR_MISMATCH, "ddp_reducer_finalize: rank %d is not in ddp_reducer_finalize (its "
                             "all_gather carries something else); every rank must call it at the same point", k);
        }
    for (k = 0; k < world; k++)
        if (memcmp(&all[4 * k], &all[0], sizeof mine) != 0) break;
    res = k == world ? DDP_SUCCESS : ddp__reducer_name_mismatch(r, all);
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
        if (k->comm && k->comm != k->storage) r->ops->release(r->g, k->comm);
        if (k->storage) r->ops->release(r->g, k->storage);
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

/* Give a layout its memory: the comm buckets, and the gradient storage for views. */
static ddp_result ddp__layout_alloc(ddp_reducer *r, ddp__layout *L) {
    int b;
    for (b = 0; b < L->nbuckets; b++) {
        ddp__bucket *k = &L->buckets[b];
        size_t gbytes = k->count * ddp_dtype_size(k->dtype), cbytes = k->count * ddp_dtype_size(k->comm_dtype);
        if (ddp__reducer_is_view(r) && !(k->storage = r->ops->alloc(r->g, gbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, gbytes);
        if (k->storage && k->comm_dtype == k->dtype)
            k->comm = k->storage;
        else if (!(k->comm = r->ops->alloc(r->g, cbytes)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "out of memory for gradient bucket %d (%zu bytes)", b, cbytes);
    }
    return DDP_SUCCESS;
}

/* Where parameter i's gradient is in a layout's storage (views only). */
static void *ddp__layout_view(const ddp_reducer *r, const ddp__layout *L, int i) {
    const ddp__bucket *k = &L->buckets[L->param_bucket[i]];
    return (char *)k->storage + L->param_offset[i] * ddp_dtype_size(r->params[i].dtype);
}

/* Build the layout for `walk` and switch to it; views carry their gradients over. */
static ddp_result ddp__reducer_relayout(ddp_reducer *r, const int *walk) {
    ddp__layout L;
    ddp_result res = ddp__layout_assign(r, walk, &L);
    int i;
    if (res) return res;
    if (r->L.buckets && ddp__layout_same(r, &r->L, &L)) {
        ddp__layout_free(r, &L);
        return DDP_SUCCESS;
    }
    if ((res = ddp__layout_alloc(r, &L)) != DDP_SUCCESS) {
        ddp__layout_free(r, &L);
        return res;
    }
    if (r->L.buckets && ddp__reducer_is_view(r))
        for (i = 0; i < r->nparams; i++)
            r->ops->copy_out(r->g, ddp__layout_view(r, &L, i), r->params[i].dtype, ddp__layout_view(r, &r->L, i),
                             r->params[i].dtype, r->params[i].count);
    ddp__layout_free(r, &r->L);
    r->L = L;
    r->stats.buckets = L.nbuckets;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_finalize(ddp_reducer *r) {
    ddp_result res;
    int i, n;
    if (!r) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_reducer_finalize: the reducer is NULL");
    if (r->finalized) return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_finalize: already finalized");
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
    if ((res = ddp__reducer_relayout(r, r->order)) != DDP_SUCCESS) {
        r->finalized = 0;
        return res;
    }
    r->rebuild_pending = !r->desc.find_unused_parameters;
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
    if (world == 1) {
        if (!shadow) ddp__timing_account(r, r->t_ready, 0);
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

/* Start bucket k's collective on `data` (its comm memory; a joined rank's zeros): DDP's SUM all-reduce.
   The one place that chooses a bucket's collective, for the ranks with data and the joined ones alike. */
static ddp_result ddp__bucket_start(ddp_reducer *r, ddp__bucket *k, void *data) {
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

/* find_unused_parameters: fill the slots of the parameters not ready in this pass. One that got a gradient
   in an earlier no_sync pass contributes what it accumulated; the others contribute zero (views without
   compression first save their gradient, which is restored if no rank used the parameter). */
static ddp_result ddp__reducer_fill_unused(ddp_reducer *r) {
    size_t need = 0, off = 0;
    int i;
    r->stats.unused_parameters = 0;
    for (i = 0; i < r->nparams; i++)
        if (!r->used[i] && ddp__bucket_in_place(&r->L.buckets[r->L.param_bucket[i]])) need += ddp__tensor_bytes(&r->params[i]);
    if (need > r->stash_bytes) { /* grows only when more parameters go unused than ever before */
        if (r->stash) r->ops->release(r->g, r->stash);
        r->stash_bytes = 0;
        if (!(r->stash = r->ops->alloc(r->g, need)))
            return ddp__fail(r->g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_end_backward: out of memory (%zu bytes)", need);
        r->stash_bytes = need;
    }
    for (i = 0; i < r->nparams; i++) {
        ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
        size_t cs = ddp_dtype_size(k->comm_dtype);
        char *slot = (char *)k->comm + r->L.param_offset[i] * cs;
        if (r->ready[i]) continue;
        if (r->used[i]) {
            ddp__reducer_take(r, i);
            continue;
        }
        r->stats.unused_parameters++;
        if (ddp__bucket_in_place(k)) {
            r->ops->copy_out(r->g, (char *)r->stash + off, r->params[i].dtype, slot, k->comm_dtype, r->params[i].count);
            off += ddp__tensor_bytes(&r->params[i]);
        }
        r->ops->zero(r->g, slot, r->params[i].count * cs);
        k->pending--;
    }
    return DDP_SUCCESS;
}

/* The reduced value of parameter i goes back to where the program reads its gradient. */
static void ddp__reducer_give_back(ddp_reducer *r, int i) {
    ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
    size_t off = r->L.param_offset[i];
    const void *src = (char *)k->comm + off * ddp_dtype_size(k->comm_dtype);
    if (ddp__bucket_in_place(k)) return;
    r->ops->copy_out(r->g, k->storage ? (void *)((char *)k->storage + off * ddp_dtype_size(k->dtype)) : r->params[i].grad,
                     r->params[i].dtype, src, k->comm_dtype, r->params[i].count);
}

/* After the used map: gradients of parameters unused here but used elsewhere come back; those no rank
   used keep their old value. */
static void ddp__reducer_finish_unused(ddp_reducer *r) {
    size_t off = 0;
    int i;
    for (i = 0; i < r->nparams; i++) {
        ddp__bucket *k = &r->L.buckets[r->L.param_bucket[i]];
        if (r->used[i]) continue;
        if (r->used_global[i]) {
            ddp__reducer_give_back(r, i);
        } else if (ddp__bucket_in_place(k)) {
            r->ops->copy_out(r->g, (char *)k->storage + r->L.param_offset[i] * ddp_dtype_size(k->dtype), r->params[i].dtype,
                             (char *)r->stash + off, r->params[i].dtype, r->params[i].count);
        }
        if (ddp__bucket_in_place(k)) off += ddp__tensor_bytes(&r->params[i]);
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
        if (first) continue;
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
            ddp__reducer_finish_unused(r);
        }
    }
    /* the first failure says what happened; later ones only say that the group is broken */
    if (!first) return DDP_SUCCESS;
    return ddp__fail(r->g, first, "%s%s", strncmp(why, "ddp_reducer_", 12) ? "ddp_reducer_end_backward: " : "", why);
}

/* Once, after the first synchronised pass: buckets in the order rank 0 saw the gradients ready. */
static ddp_result ddp__reducer_rebuild(ddp_reducer *r) {
    ddp_result res;
    r->rebuild_pending = 0;
    if ((res = ddp_broadcast(r->g, r->order, ddp__reducer_n(r), DDP_I32, 0)) != DDP_SUCCESS) return r->failed = res;
    if ((res = ddp__reducer_relayout(r, r->order)) != DDP_SUCCESS) return r->failed = res;
    r->stats.rebuilt = 1;
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

DDP_API void ddp_reducer_destroy(ddp_reducer *r) {
    int i;
    if (!r) return;
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
   joined ranks' zeros (torch's divide_by_initial_world_size=True). Every rank sees every record, so every
   rank checks the same things and reaches the same verdict: active ranks announcing different things (a
   no_sync pass against a synchronised one, a buffer broadcast against a backward pass) are DDP_ERR_MISMATCH
   on every rank; with join_fail_early, a round with both active and joined ranks is DDP_ERR_UNEVEN_INPUTS
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
   program's gradients are not touched. */
static ddp_result ddp__join_shadow_backward(ddp_reducer *r) {
    ddp_work *used_work = NULL;
    ddp_result res, waited;
    size_t off = 0;
    int b;
    if ((res = ddp__join_shadow_memory(r)) != DDP_SUCCESS) return res;
    for (b = 0; b < r->L.nbuckets && !res; b++) {
        ddp__bucket *k = &r->L.buckets[b];
        size_t bytes = k->count * ddp_dtype_size(k->comm_dtype);
        void *zeros = ddp__bucket_in_place(k) ? (char *)r->shadow + off : k->comm;
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
        }
    if (used_work && (waited = ddp_wait(used_work)) != DDP_SUCCESS && !res) res = waited;
    if (res) return r->failed = res;
    r->stats.shadowed_iterations++;
    ddp__timing_finish(r);
    if ((res = ddp__timing_start(r, 1)) != DDP_SUCCESS) return res;
    if (r->rebuild_pending) return ddp__reducer_rebuild(r);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_reducer_join(ddp_reducer *r) {
    ddp_result res = ddp__reducer_usable(r, "ddp_reducer_join");
    ddp__join_round v;
    int flags = DDP__JOIN_FIRST;
    if (res) return res;
    if (!r->desc.uneven_inputs)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_join: the reducer was created without uneven_inputs; set "
                         "uneven_inputs = 1 in its ddp_reducer_desc (on every rank) to let ranks run out of data");
    if (r->in_backward)
        return ddp__fail(r->g, DDP_ERR_STATE, "ddp_reducer_join: called during a backward pass; end it first "
                         "(ddp_reducer_end_backward), then join when there is no data left");
    for (;;) {
        if ((res = ddp__join_exchange(r, "ddp_reducer_join", DDP__JOIN_JOINED, flags, &v)) != DDP_SUCCESS) return res;
        flags = 0;
        if (v.disagree >= 0) return ddp__join_disagree(r, "ddp_reducer_join", &v);
        if (v.active == 0) break;
        if (r->desc.join_fail_early) return ddp__join_uneven(r, "ddp_reducer_join", &v);
        if (v.kind == DDP__JOIN_BUFFERS)
            res = ddp__reducer_broadcast(r, r->buffers, r->nbuffers, r->bstage, r->bstage_bytes, v.last_active);
        else if (v.sync)
            res = ddp__join_shadow_backward(r);
        if (res) return r->failed = res;
    }
    r->join_steps = 0;
    if ((res = ddp__reducer_sync_states(r, v.last_joiner >= 0 ? v.last_joiner : 0, "ddp_reducer_join")) != DDP_SUCCESS)
        return r->failed = res;
    return DDP_SUCCESS;
}
/* ==================== end src/reducer.c ==================== */

/* ==================== begin src/sampler.c ==================== */
/* [SECTION] sampler: DistributedSampler, MT19937 and torch.randperm, Feistel streaming permutation */
/* Mirrors torch.utils.data.distributed.DistributedSampler (torch/utils/data/distributed.py) and, for its
   shuffle, torch.Generator (at::mt19937) and torch.randperm on the CPU (aten/src/ATen/native/
   TensorFactories.cpp, randperm_cpu). The formulas are in the sampler section of the header (src/sampler.h).

   A rank's k-th index is the element at position j = rank + k*R of the dealt-out list; positions past
   N wrap around (torch pads by repeating the list, so padded[j] = perm[j mod N]).
   - no shuffle, or the streaming permutation: computed directly from j, no memory.
   - torch's randperm: the whole permutation is made once per epoch, in place, in a buffer of N entries
     (uint32 when N <= 2^32), then compacted to this rank's num_samples entries and shrunk: steady-state
     memory is 4 * N / R bytes, the peak 4 * N. */

#define DDP__SAMPLER_MAGIC 0x53414d50u /* "SAMP" */
/* current torch uses the 64-bit inside-out shuffle from this N on (UINT32_MAX / 20) */
#define DDP__RANDPERM_SPLIT 214748364ull
/* how many steps ahead the shuffles draw (and prefetch) their targets; a power of two */
#define DDP__RANDPERM_AHEAD 64
#define DDP__FEISTEL_MIN_BITS 8 /* the streaming bijection's smallest domain: 2^8 */
#define DDP__FEISTEL_ROUNDS ((int)(sizeof(((ddp_sampler *)0)->feistel_keys) / sizeof(uint64_t)))

#if defined(__GNUC__) || defined(__clang__)
#define DDP__PREFETCH(p) __builtin_prefetch((p), 1)
#else
#define DDP__PREFETCH(p) ((void)(p))
#endif

/* ---- MT19937: the generator behind torch.Generator on the CPU ----
   manual_seed(s) runs Matsumoto and Nishimura's init_genrand on the low 32 bits of s (torch's at::mt19937,
   the same stream as C++ std::mt19937(s32)). random() is one tempered 32-bit output; random64() is
   (first << 32) | second. The 624-word state is regenerated ("twisted") 624 outputs at a time. */
#define DDP__MT_N 624
#define DDP__MT_M 397

typedef struct ddp__mt19937 {
    uint32_t state[DDP__MT_N];
    int next; /* the next state word to temper; DDP__MT_N = twist first */
} ddp__mt19937;

static void ddp__mt_seed(ddp__mt19937 *g, uint64_t seed) {
    int i;
    g->state[0] = (uint32_t)seed;
    for (i = 1; i < DDP__MT_N; i++)
        g->state[i] = 1812433253u * (g->state[i - 1] ^ (g->state[i - 1] >> 30)) + (uint32_t)i;
    g->next = DDP__MT_N;
}

static uint32_t ddp__mt_mix(uint32_t upper, uint32_t lower, uint32_t far) {
    uint32_t y = (upper & 0x80000000u) | (lower & 0x7fffffffu);
    return far ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
}

static void ddp__mt_twist(ddp__mt19937 *g) {
    uint32_t *mt = g->state;
    int i;
    for (i = 0; i < DDP__MT_N - DDP__MT_M; i++) mt[i] = ddp__mt_mix(mt[i], mt[i + 1], mt[i + DDP__MT_M]);
    for (; i < DDP__MT_N - 1; i++) mt[i] = ddp__mt_mix(mt[i], mt[i + 1], mt[i + DDP__MT_M - DDP__MT_N]);
    mt[DDP__MT_N - 1] = ddp__mt_mix(mt[DDP__MT_N - 1], mt[0], mt[DDP__MT_M - 1]);
    g->next = 0;
}

static uint32_t ddp__mt_random(ddp__mt19937 *g) {
    uint32_t y;
    if (g->next >= DDP__MT_N) ddp__mt_twist(g);
    y = g->state[g->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

static uint64_t ddp__mt_random64(ddp__mt19937 *g) {
    uint64_t hi = ddp__mt_random(g);
    return (hi << 32) | ddp__mt_random(g);
}

/* ---- torch.randperm on the CPU ----
   The permutation lives in a buffer of uint32 (N <= 2^32) or uint64 entries; these accessors hide which. */
static uint64_t ddp__perm_get(const void *p, int wide, uint64_t i) {
    return wide ? ((const uint64_t *)p)[i] : ((const uint32_t *)p)[i];
}

static void ddp__perm_put(void *p, int wide, uint64_t i, uint64_t v) {
    if (wide)
        ((uint64_t *)p)[i] = v;
    else
        ((uint32_t *)p)[i] = (uint32_t)v;
}

static void ddp__perm_prefetch(void *p, int wide, uint64_t i) {
    if (wide)
        DDP__PREFETCH((uint64_t *)p + i);
    else
        DDP__PREFETCH((uint32_t *)p + i);
}

/* Both shuffles below draw their targets DDP__RANDPERM_AHEAD steps early: a target depends only on the
   random stream, not on r, so its cache line can be prefetched while earlier steps run. At large N every
   step is a cache miss, and this overlaps them (about 1.6x faster at N = 1e8). */
static void ddp__perm_identity(void *r, int wide, uint64_t n) {
    uint64_t i;
    if (wide)
        for (i = 0; i < n; i++) ((uint64_t *)r)[i] = i;
    else
        for (i = 0; i < n; i++) ((uint32_t *)r)[i] = (uint32_t)i;
}

/* The swap loop's target for step i: i + random() % (N - i) */
static uint64_t ddp__swap_target(ddp__mt19937 *g, uint64_t n, uint64_t i) {
    uint64_t left = n - i;
    uint32_t x = ddp__mt_random(g);
    return i + (left <= UINT32_MAX ? x % (uint32_t)left : x); /* x < 2^32 <= left: x % left is x */
}

/* The swap loop: torch 2.6 and earlier at every N, current torch below 214748364.
       r[i] = i;  for i in 0 .. N-2: z = random() % (N - i); swap(r[i], r[i + z]) */
static void ddp__randperm_swap(void *r, int wide, uint64_t n, ddp__mt19937 *g) {
    uint64_t ahead[DDP__RANDPERM_AHEAD], i, drawn;
    ddp__perm_identity(r, wide, n);
    for (drawn = 0; drawn + 1 < n && drawn < DDP__RANDPERM_AHEAD; drawn++) {
        ahead[drawn] = ddp__swap_target(g, n, drawn);
        ddp__perm_prefetch(r, wide, ahead[drawn]);
    }
    for (i = 0; i + 1 < n; i++) {
        uint64_t t = ahead[i % DDP__RANDPERM_AHEAD], a = ddp__perm_get(r, wide, i);
        if (drawn + 1 < n) { /* step drawn's target takes the slot step i's just freed */
            ahead[drawn % DDP__RANDPERM_AHEAD] = ddp__swap_target(g, n, drawn);
            ddp__perm_prefetch(r, wide, ahead[drawn % DDP__RANDPERM_AHEAD]);
            drawn++;
        }
        ddp__perm_put(r, wide, i, ddp__perm_get(r, wide, t));
        ddp__perm_put(r, wide, t, a);
    }
}

/* Current torch from N = 214748364 on: the "inside-out" Fisher-Yates shuffle with 64-bit draws
   (pytorch/pytorch#143682, relanded as #144735 in January 2025; torch 2.7 is the first release with it).
       for i in 0 .. N-1: z = random64() % (i + 1); r[i] = r[z]; r[z] = i        (r[i] = i when z = i) */
static void ddp__randperm_inside_out(void *r, int wide, uint64_t n, ddp__mt19937 *g) {
    uint64_t ahead[DDP__RANDPERM_AHEAD], i, drawn;
    for (drawn = 0; drawn < n && drawn < DDP__RANDPERM_AHEAD; drawn++) {
        ahead[drawn] = ddp__mt_random64(g) % (drawn + 1);
        ddp__perm_prefetch(r, wide, ahead[drawn]);
    }
    for (i = 0; i < n; i++) {
        uint64_t z = ahead[i % DDP__RANDPERM_AHEAD];
        if (drawn < n) {
            ahead[drawn % DDP__RANDPERM_AHEAD] = ddp__mt_random64(g) % (drawn + 1);
            ddp__perm_prefetch(r, wide, ahead[drawn % DDP__RANDPERM_AHEAD]);
            drawn++;
        }
        ddp__perm_put(r, wide, i, z == i ? i : ddp__perm_get(r, wide, z)); /* r[i] is not yet written */
        ddp__perm_put(r, wide, z, i);
    }
}

/* Which of the two shuffles torch.randperm(n) runs: current torch switches at 214748364, legacy never. */
static int ddp__randperm_is_inside_out(uint64_t n, int legacy) { return !legacy && n >= DDP__RANDPERM_SPLIT; }

/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) into r. */
static void ddp__randperm(void *r, int wide, uint64_t n, uint64_t seed, int legacy) {
    ddp__mt19937 g;
    ddp__mt_seed(&g, seed);
    if (ddp__randperm_is_inside_out(n, legacy))
        ddp__randperm_inside_out(r, wide, n, &g);
    else
        ddp__randperm_swap(r, wide, n, &g);
}

/* ---- the streaming permutation: a keyed Feistel bijection with cycle walking ----
   The domain is [0, 2^b) with b = max(8, bits of N-1): less than 2N once N > 128. A value is split into a
   high half L (b/2 bits) and a low half R (the other bits); each round maps (L, R) -> (R, L xor F_k(R)),
   where F_k is a 64-bit mixer of R xor the round key, cut to L's width. The halves trade places (and
   widths) every round; every round is invertible, so the whole is a bijection of the domain.
   Cycle walking: apply it again until the value lands below N. That is a bijection of [0, N) (the cycle
   through a start below N comes back to it, so it ends), at fewer than 2 steps on average for N > 128.
   b is at least 8 because Feistel networks on very few bits reach only some permutations (even ones):
   with 2- or 3-bit domains, where small N would land, the positions came out measurably uneven. */
static uint64_t ddp__mix64(uint64_t z) { /* splitmix64's finaliser: a bijection with full avalanche */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void ddp__feistel_setup(ddp_sampler *s) {
    uint64_t n = s->desc.dataset_size, top = n > 1 ? n - 1 : 0, state = s->desc.seed + s->epoch;
    int bits = 0, r;
    while (bits < 64 && (top >> bits) != 0) bits++; /* top <= INT64_MAX: at most 63 */
    s->feistel_bits = DDP__MAX(DDP__FEISTEL_MIN_BITS, bits);
    for (r = 0; r < DDP__FEISTEL_ROUNDS; r++) { /* splitmix64's stream from seed + epoch */
        state += 0x9e3779b97f4a7c15ull;
        s->feistel_keys[r] = ddp__mix64(state);
    }
}

static uint64_t ddp__feistel(const ddp_sampler *s, uint64_t x) {
    int lbits = s->feistel_bits / 2, rbits = s->feistel_bits - lbits, r;
    uint64_t left = x >> rbits, right = x & ((1ull << rbits) - 1);
    for (r = 0; r < DDP__FEISTEL_ROUNDS; r++) {
        uint64_t f = ddp__mix64(right ^ s->feistel_keys[r]) & ((1ull << lbits) - 1);
        uint64_t new_left = right;
        int w = lbits;
        right = left ^ f;
        left = new_left;
        lbits = rbits; /* the halves trade places, and widths */
        rbits = w;
    }
    return (left << rbits) | right;
}

static uint64_t ddp__streaming_index(const ddp_sampler *s, uint64_t j) {
    uint64_t x = j;
    do x = ddp__feistel(s, x);
    while (x >= s->desc.dataset_size);
    return x;
}

/* ---- the sampler ---- */

static int ddp__sampler_ok(const ddp_sampler *s) { return s && s->magic == DDP__SAMPLER_MAGIC; }

static ddp_result ddp__sampler_not_initialised(const char *fn) {
    return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                     "%s: the sampler is NULL or not initialised (call ddp_sampler_init first; after "
                     "ddp_sampler_free it must be initialised again)",
                     fn);
}

static ddp_result ddp__sampler_check_desc(const ddp_sampler_desc *d) {
    if (d->num_replicas <= 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: num_replicas is %d; it must be > 0 (usually ddp_world_size(g))",
                         d->num_replicas);
    if (d->rank < 0 || d->rank >= d->num_replicas)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: rank is %d; it must be in [0, %d] for num_replicas %d "
                         "(usually ddp_rank(g))",
                         d->rank, d->num_replicas - 1, d->num_replicas);
    if (d->dataset_size > (uint64_t)INT64_MAX)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: dataset_size %llu does not fit the int64 indices (at most %lld)",
                         (unsigned long long)d->dataset_size, (long long)INT64_MAX);
    if (d->mode != DDP_SAMPLER_TORCH && d->mode != DDP_SAMPLER_EVAL)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: mode %d is not DDP_SAMPLER_TORCH (0) or DDP_SAMPLER_EVAL (1)",
                         (int)d->mode);
    if (d->permutation != DDP_PERMUTATION_TORCH && d->permutation != DDP_PERMUTATION_TORCH_LEGACY &&
        d->permutation != DDP_PERMUTATION_STREAMING)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: permutation %d is not DDP_PERMUTATION_TORCH (0), "
                         "DDP_PERMUTATION_TORCH_LEGACY (1) or DDP_PERMUTATION_STREAMING (2)",
                         (int)d->permutation);
    if (d->mode == DDP_SAMPLER_EVAL && d->drop_last)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_init: drop_last is set in DDP_SAMPLER_EVAL mode, which hands out every "
                         "index exactly once; clear drop_last, or use DDP_SAMPLER_TORCH to drop the tail");
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_init(ddp_sampler *s, const ddp_sampler_desc *d) {
    uint64_t n, r;
    ddp_result res;
    if (!s || !d)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_init: %s is NULL", s ? "desc" : "sampler");
    memset(s, 0, sizeof *s);
    res = ddp__sampler_check_desc(d);
    if (res != DDP_SUCCESS) return res;
    s->desc = *d;
    n = d->dataset_size;
    r = (uint64_t)d->num_replicas;
    if (d->mode == DDP_SAMPLER_EVAL) {
        s->num_samples = n > (uint64_t)d->rank ? (n - 1 - (uint64_t)d->rank) / r + 1 : 0;
        s->total_size = n;
    } else {
        s->num_samples = d->drop_last ? n / r : n / r + (n % r != 0);
        s->total_size = s->num_samples * r;
    }
    s->shard_wide = n > (uint64_t)UINT32_MAX + 1; /* the values 0 .. N-1 need 64 bits */
    ddp__feistel_setup(s);
    s->magic = DDP__SAMPLER_MAGIC;
    return DDP_SUCCESS;
}

DDP_API void ddp_sampler_free(ddp_sampler *s) {
    if (!ddp__sampler_ok(s)) return;
    ddp__free(s->shard);
    memset(s, 0, sizeof *s);
}

static int ddp__sampler_shuffles(const ddp_sampler *s) { return !s->desc.no_shuffle && s->desc.dataset_size > 1; }

DDP_API void ddp_sampler_set_epoch(ddp_sampler *s, uint64_t epoch) {
    if (!ddp__sampler_ok(s)) return;
    if (epoch == s->epoch && s->epoch_done && ddp__sampler_shuffles(s))
        ddp__log(NULL, DDP_LOG_WARN,
                 "ddp_sampler_set_epoch(%llu) again after that epoch was handed out: the next epoch repeats "
                 "the same order; pass the new epoch's number",
                 (unsigned long long)epoch);
    s->epoch = epoch;
    s->position = 0;
    s->epoch_done = 0;
    ddp__feistel_setup(s);
}

DDP_API uint64_t ddp_sampler_epoch(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->epoch : 0; }

DDP_API uint64_t ddp_sampler_num_samples(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->num_samples : 0; }

DDP_API uint64_t ddp_sampler_position(const ddp_sampler *s) { return ddp__sampler_ok(s) ? s->position : 0; }

/* The torch permutation must be made (and kept) only when it shuffles and there is something to hand out. */
static int ddp__sampler_materialises(const ddp_sampler *s) {
    return ddp__sampler_shuffles(s) && s->desc.permutation != DDP_PERMUTATION_STREAMING && s->num_samples > 0;
}

/* Hint the kernel to back a large buffer with huge pages: the shuffle touches it at random, and 4 KiB pages
   would make nearly every access a TLB miss as well as a cache miss. */
static void ddp__advise_huge_pages(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (bytes >= 16 * huge && end > begin) madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Keep only this rank's positions rank, rank + R, ... of the permutation, in order, at its start. A position
   past N (padding) reads perm[j mod N], which the compaction may already have overwritten: there is at most
   one such position per rank (total_size - N < R), the last, so its value is read first. */
static void ddp__sampler_compact(const ddp_sampler *s, void *p) {
    uint64_t n = s->desc.dataset_size, r = (uint64_t)s->desc.num_replicas, rank = (uint64_t)s->desc.rank;
    uint64_t last = s->num_samples - 1, k, tail = 0;
    int padded = rank + last * r >= n;
    if (r == 1) return; /* every position is this rank's, none padded */
    if (padded) tail = ddp__perm_get(p, s->shard_wide, (rank + last * r) % n);
    for (k = 0; k < s->num_samples - (uint64_t)padded; k++) /* reads position rank + k*R >= k: still intact */
        ddp__perm_put(p, s->shard_wide, k, ddp__perm_get(p, s->shard_wide, rank + k * r));
    if (padded) ddp__perm_put(p, s->shard_wide, last, tail);
}

/* Make this epoch's shard if it is needed and not there yet. */
static ddp_result ddp__sampler_prepare(ddp_sampler *s, const char *fn) {
    uint64_t n = s->desc.dataset_size;
    size_t elem = s->shard_wide ? sizeof(uint64_t) : sizeof(uint32_t);
    double t0;
    void *p, *small;
    if (!ddp__sampler_materialises(s) || (s->shard_valid && s->shard_epoch == s->epoch)) return DDP_SUCCESS;
    ddp__free(s->shard); /* before the big allocation, so the old shard does not add to the peak */
    s->shard = NULL;
    s->shard_valid = 0;
    p = n <= SIZE_MAX / elem ? ddp__malloc((size_t)n * elem) : NULL;
    if (!p)
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY,
                         "%s: out of memory for the permutation of %llu samples (%.2f GiB; torch's randperm needs "
                         "all of it). DDP_PERMUTATION_STREAMING shuffles without memory (not torch's order)",
                         fn, (unsigned long long)n, (double)n * (double)elem / 1073741824.0);
    ddp__advise_huge_pages(p, (size_t)n * elem);
    t0 = ddp__now();
    ddp__randperm(p, s->shard_wide, n, s->desc.seed + s->epoch, s->desc.permutation == DDP_PERMUTATION_TORCH_LEGACY);
    ddp__sampler_compact(s, p);
    small = DDP_REALLOC(p, (size_t)s->num_samples * elem); /* give the rest back; keep p if that fails */
    s->shard = small ? small : p;
    s->shard_valid = 1;
    s->shard_epoch = s->epoch;
    ddp__log(NULL, DDP_LOG_DEBUG, "sampler: epoch %llu shuffled %llu indices in %.3f s",
             (unsigned long long)s->epoch, (unsigned long long)n, ddp__now() - t0);
    return DDP_SUCCESS;
}

/* This rank's k-th index (k < num_samples), the shard made if it is needed. */
static uint64_t ddp__sampler_index(const ddp_sampler *s, uint64_t k) {
    uint64_t n = s->desc.dataset_size;
    uint64_t j = (uint64_t)s->desc.rank + k * (uint64_t)s->desc.num_replicas;
    if (ddp__sampler_materialises(s)) return ddp__perm_get(s->shard, s->shard_wide, k);
    if (j >= n) j %= n; /* torch's padding repeats the list */
    if (!ddp__sampler_shuffles(s)) return j;
    return ddp__streaming_index(s, j);
}

static void ddp__sampler_fill(const ddp_sampler *s, uint64_t first, uint64_t count, int64_t *out) {
    uint64_t k;
    if (ddp__sampler_materialises(s) && !s->shard_wide) { /* the common case, as a plain widening copy */
        const uint32_t *shard = (const uint32_t *)s->shard + first;
        for (k = 0; k < count; k++) out[k] = (int64_t)shard[k];
        return;
    }
    for (k = 0; k < count; k++) out[k] = (int64_t)ddp__sampler_index(s, first + k);
}

DDP_API ddp_result ddp_sampler_indices(ddp_sampler *s, int64_t *out) {
    ddp_result res;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_indices");
    if (!out && s->num_samples > 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_indices: out is NULL (it needs room for %llu "
                         "indices, ddp_sampler_num_samples)", (unsigned long long)s->num_samples);
    res = ddp__sampler_prepare(s, "ddp_sampler_indices");
    if (res != DDP_SUCCESS) return res;
    ddp__sampler_fill(s, 0, s->num_samples, out);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_next_batch(ddp_sampler *s, size_t batch_size, int64_t *out, size_t *got) {
    uint64_t count;
    ddp_result res;
    if (got) *got = 0;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_next_batch");
    if (batch_size == 0 || !out || !got)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_next_batch: %s",
                         batch_size == 0 ? "batch_size is 0; it must be > 0" : !out ? "out is NULL" : "got is NULL");
    count = DDP__MIN((uint64_t)batch_size, s->num_samples - s->position);
    if (count == 0) {
        s->epoch_done = 1;
        return DDP_SUCCESS;
    }
    res = ddp__sampler_prepare(s, "ddp_sampler_next_batch");
    if (res != DDP_SUCCESS) return res;
    ddp__sampler_fill(s, s->position, count, out);
    s->position += count;
    if (s->position == s->num_samples) s->epoch_done = 1;
    *got = (size_t)count;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_set_position(ddp_sampler *s, uint64_t position) {
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_set_position");
    if (position > s->num_samples)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_set_position: position %llu is past the end of the epoch (this rank has "
                         "%llu indices per epoch); was the checkpoint saved with another num_replicas or "
                         "dataset_size?",
                         (unsigned long long)position, (unsigned long long)s->num_samples);
    s->position = position;
    s->epoch_done = position == s->num_samples;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_sampler_index_at(ddp_sampler *s, uint64_t k, int64_t *out) {
    ddp_result res;
    if (!ddp__sampler_ok(s)) return ddp__sampler_not_initialised("ddp_sampler_index_at");
    if (!out) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_sampler_index_at: out is NULL");
    if (k >= s->num_samples)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_sampler_index_at: k = %llu, but this rank has %llu indices per epoch",
                         (unsigned long long)k, (unsigned long long)s->num_samples);
    res = ddp__sampler_prepare(s, "ddp_sampler_index_at");
    if (res != DDP_SUCCESS) return res;
    *out = (int64_t)ddp__sampler_index(s, k);
    return DDP_SUCCESS;
}
/* ==================== end src/sampler.c ==================== */

/* ==================== begin src/syncbn.c ==================== */
/* [SECTION] syncbn (implementation): SyncBatchNorm on the CPU, f32 data, f64 statistics
   The algorithm is described with the declarations (src/syncbn.h). Here: how the passes are laid out.

   Every stage is one pass over its inputs: statistics (x), normalisation (x -> y), backward sums
   (x, dy), input gradient (x, dy -> dx). The unit of work is 8 "columns" by some rows. In the
   channels-first layout a (sample, channel) plane is one run of `spatial` floats, cut into rows of 8
   lanes that belong to the same channel (summed at the end). In the channels-last layout (and
   channels-first with spatial 1: the same memory) x is read row by row in memory order, a row's C
   channels 8 at a time, their per-channel accumulators staying in cache (walking a tile of rows one
   group of channels at a time was slower: strided reads that the prefetchers do not follow).
   Fixed-width lanes with their own accumulators let compilers vectorise the loops at -O2 without
   -ffast-math (no sum is reassociated). Statistics are sums of (x - shift) and (x - shift)^2 in f64,
   shift being the channel's first value, so the one-pass variance does not cancel catastrophically. */

#define DDP__BN_LANES 8

/* Compiler hints, neither needed for correctness: inline the column kernels into the passes (so the
   width 8 is a constant there), and unroll the lanes (so their accumulators stay in registers: without
   it GCC -O2 keeps them in memory and runs at half speed). */
#if defined(__GNUC__) || defined(__clang__)
#define DDP__BN_INLINE static inline __attribute__((always_inline))
#else
#define DDP__BN_INLINE static inline
#endif
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) /* nvcc warns on the GCC pragma (#1675) */
#define DDP__BN_UNROLL _Pragma("GCC unroll 8")
#else
#define DDP__BN_UNROLL
#endif

/* What the last forward saved for backward. */
enum { DDP__BN_SAVED_NONE = 0, DDP__BN_SAVED_SYNCED, DDP__BN_SAVED_LOCAL, DDP__BN_SAVED_EVAL };

struct ddp_syncbn {
    ddp_group *errors; /* the group given to create: errors are reported there (NULL: thread-local) */
    ddp_group *group;  /* statistics are merged over it; NULL = no communication */
    int nranks, rank;  /* in group (1 and 0 without one) */
    int channels, channels_last;
    double eps, momentum; /* momentum < 0: cumulative average */
    float *weight, *bias, *running_mean, *running_var;
    int64_t num_batches_tracked;

    int saved; /* DDP__BN_SAVED_*: what mean/invstd hold */
    int64_t saved_batch, saved_spatial;
    double saved_count; /* n of the saved statistics (over the group when synced) */
    float *mean, *invstd; /* C each: what the last forward normalised with */

    double *records; /* nranks * (2C + 1): the all-gathered [mean, M2, count] of every rank */
    double *sums;    /* 2C: per-channel accumulators of the current pass */
    double *shift;   /* C: per-channel shift of the statistics pass; then mean in f64 for backward */
    float *coef;     /* 3C: per-channel factors of the element-wise passes */
};

/* ---- the column kernels: w columns of `rows` rows, row r at x + r * stride ----
   w is always a constant at the call, DDP__BN_LANES or 1 (tails), so that after inlining every lane
   loop has a fixed trip count: vectorised, and no false maybe-uninitialized warnings from GCC. */

DDP__BN_INLINE void ddp__bn_cols_stats(const float *x, int64_t stride, int64_t rows, int w, const double *shift,
                                       double *s1, double *s2) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], k[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = s1[j];
        a2[j] = s2[j];
        k[j] = shift[j];
    }
    for (r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        DDP__BN_UNROLL for (j = 0; j < w; j++) {
            double d = (double)row[j] - k[j];
            a1[j] += d;
            a2[j] += d * d;
        }
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        s1[j] = a1[j];
        s2[j] = a2[j];
    }
}

DDP__BN_INLINE void ddp__bn_cols_normalize(const float *x, float *y, int64_t stride, int64_t rows, int w,
                                           const float *mean, const float *scale, const float *shift) {
    float m[DDP__BN_LANES], a[DDP__BN_LANES], b[DDP__BN_LANES], t[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        m[j] = mean[j];
        a[j] = scale[j];
        b[j] = shift[j];
    }
    for (r = 0; r < rows; r++) {
        DDP__BN_UNROLL for (j = 0; j < w; j++) t[j] = x[r * stride + j]; /* loaded first: y may be x */
        DDP__BN_UNROLL for (j = 0; j < w; j++) y[r * stride + j] = ddp__bn_normalize(t[j], m[j], a[j], b[j]);
    }
}

DDP__BN_INLINE void ddp__bn_cols_backward_sums(const float *dy, const float *x, int64_t stride, int64_t rows, int w,
                                               const double *mean, double *sum_dy, double *sum_dy_xmu) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], m[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = sum_dy[j];
        a2[j] = sum_dy_xmu[j];
        m[j] = mean[j];
    }
    for (r = 0; r < rows; r++) {
        const float *g = dy + r * stride, *v = x + r * stride;
        DDP__BN_UNROLL for (j = 0; j < w; j++) {
            double d = (double)g[j];
            a1[j] += d;
            a2[j] += d * ((double)v[j] - m[j]);
        }
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        sum_dy[j] = a1[j];
        sum_dy_xmu[j] = a2[j];
    }
}

DDP__BN_INLINE void ddp__bn_cols_grad_input(const float *dy, const float *x, float *dx, int64_t stride, int64_t rows,
                                            int w, const float *mean, const float *mean_dy, const float *proj,
                                            const float *scale) {
    float m[DDP__BN_LANES], md[DDP__BN_LANES], p[DDP__BN_LANES], a[DDP__BN_LANES];
    float g[DDP__BN_LANES], v[DDP__BN_LANES];
    int64_t r;
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        m[j] = mean[j];
        md[j] = mean_dy[j];
        p[j] = proj[j];
        a[j] = scale[j];
    }
    for (r = 0; r < rows; r++) {
        DDP__BN_UNROLL for (j = 0; j < w; j++) { /* loaded first: dx may be dy */
            g[j] = dy[r * stride + j];
            v[j] = x[r * stride + j];
        }
        DDP__BN_UNROLL for (j = 0; j < w; j++)
            dx[r * stride + j] = ddp__bn_grad_input(g[j], v[j], m[j], md[j], p[j], a[j]);
    }
}

/* One row of w (DDP__BN_LANES or 1) channels into per-channel accumulators in memory (channels-last):
   everything loaded before anything is stored, so the lanes vectorise. */
DDP__BN_INLINE void ddp__bn_row_stats(const float *x, int w, const double *shift, double *s1, double *s2) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], d[DDP__BN_LANES];
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = s1[j];
        a2[j] = s2[j];
        d[j] = (double)x[j] - shift[j];
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) s1[j] = a1[j] + d[j]; /* one array after the other: */
    DDP__BN_UNROLL for (j = 0; j < w; j++) s2[j] = a2[j] + d[j] * d[j]; /* no store reordering needed */
}

DDP__BN_INLINE void ddp__bn_row_backward_sums(const float *dy, const float *x, int w, const double *mean,
                                              double *sum_dy, double *sum_dy_xmu) {
    double a1[DDP__BN_LANES], a2[DDP__BN_LANES], g[DDP__BN_LANES], v[DDP__BN_LANES];
    int j;
    DDP__BN_UNROLL for (j = 0; j < w; j++) {
        a1[j] = sum_dy[j];
        a2[j] = sum_dy_xmu[j];
        g[j] = (double)dy[j];
        v[j] = (double)x[j] - mean[j];
    }
    DDP__BN_UNROLL for (j = 0; j < w; j++) sum_dy[j] = a1[j] + g[j];
    DDP__BN_UNROLL for (j = 0; j < w; j++) sum_dy_xmu[j] = a2[j] + g[j] * v[j];
}

/* ---- the passes over a whole batch, in either layout ---- */

/* Channels-first with spatial > 1 is the only layout whose channel is not the fastest index. */
static int ddp__bn_planar(const ddp_syncbn *bn, int64_t spatial) { return !bn->channels_last && spatial > 1; }

static void ddp__bn_fill_f64(double *v, int n, double value) {
    int j;
    for (j = 0; j < n; j++) v[j] = value;
}

static void ddp__bn_fill_f32(float *v, int n, float value) {
    int j;
    for (j = 0; j < n; j++) v[j] = value;
}

/* Sum the first n lanes. */
static double ddp__bn_lanes_sum(const double *lanes, int n) {
    double s = 0;
    int j;
    for (j = 0; j < n; j++) s += lanes[j];
    return s;
}

/* Per channel c: s1[c] = sum (x - shift[c]), s2[c] = sum (x - shift[c])^2 over the batch. */
static void ddp__bn_pass_stats(const ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, double *s1,
                               double *s2) {
    const int C = bn->channels;
    const double *shift = bn->shift;
    int64_t n, r0, r;
    int c;
    memset(s1, 0, sizeof(double) * (size_t)C);
    memset(s2, 0, sizeof(double) * (size_t)C);
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const float *run = x + (n * C + c) * spatial;
                double k[DDP__BN_LANES], a1[DDP__BN_LANES] = {0}, a2[DDP__BN_LANES] = {0};
                ddp__bn_fill_f64(k, DDP__BN_LANES, shift[c]);
                ddp__bn_cols_stats(run, DDP__BN_LANES, full, DDP__BN_LANES, k, a1, a2);
                ddp__bn_cols_stats(run + full * DDP__BN_LANES, 1, tail, 1, k, a1, a2); /* the tail: lane 0 */
                s1[c] += ddp__bn_lanes_sum(a1, DDP__BN_LANES);
                s2[c] += ddp__bn_lanes_sum(a2, DDP__BN_LANES);
            }
        return;
    }
    r = batch * spatial; /* row by row in memory order, the accumulators of a row's channels in cache */
    for (r0 = 0; r0 < r; r0++) {
        const float *row = x + r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_row_stats(row + c, DDP__BN_LANES, shift + c, s1 + c, s2 + c);
        for (; c < C; c++) ddp__bn_row_stats(row + c, 1, shift + c, s1 + c, s2 + c);
    }
}

/* y = (x - mean[c]) * scale[c] + shift[c] */
static void ddp__bn_pass_normalize(const ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                   const float *mean, const float *scale, const float *shift) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                float m[DDP__BN_LANES], a[DDP__BN_LANES], b[DDP__BN_LANES];
                ddp__bn_fill_f32(m, DDP__BN_LANES, mean[c]);
                ddp__bn_fill_f32(a, DDP__BN_LANES, scale[c]);
                ddp__bn_fill_f32(b, DDP__BN_LANES, shift[c]);
                ddp__bn_cols_normalize(x + off, y + off, DDP__BN_LANES, full, DDP__BN_LANES, m, a, b);
                ddp__bn_cols_normalize(x + off + t, y + off + t, 1, tail, 1, m, a, b);
            }
        return;
    }
    r = batch * spatial; /* element-wise: row by row, in memory order */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_cols_normalize(x + off + c, y + off + c, 0, 1, DDP__BN_LANES, mean + c, scale + c, shift + c);
        for (; c < C; c++) ddp__bn_cols_normalize(x + off + c, y + off + c, 0, 1, 1, mean + c, scale + c, shift + c);
    }
}

/* sum_dy[c] = sum dy, sum_dy_xmu[c] = sum dy * (x - mean[c]) (mean in f64) */
static void ddp__bn_pass_backward_sums(const ddp_syncbn *bn, const float *dy, const float *x, int64_t batch,
                                       int64_t spatial, const double *mean, double *sum_dy, double *sum_dy_xmu) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    memset(sum_dy, 0, sizeof(double) * (size_t)C);
    memset(sum_dy_xmu, 0, sizeof(double) * (size_t)C);
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                double m[DDP__BN_LANES], a1[DDP__BN_LANES] = {0}, a2[DDP__BN_LANES] = {0};
                ddp__bn_fill_f64(m, DDP__BN_LANES, mean[c]);
                ddp__bn_cols_backward_sums(dy + off, x + off, DDP__BN_LANES, full, DDP__BN_LANES, m, a1, a2);
                ddp__bn_cols_backward_sums(dy + off + t, x + off + t, 1, tail, 1, m, a1, a2);
                sum_dy[c] += ddp__bn_lanes_sum(a1, DDP__BN_LANES);
                sum_dy_xmu[c] += ddp__bn_lanes_sum(a2, DDP__BN_LANES);
            }
        return;
    }
    r = batch * spatial; /* row by row in memory order, the accumulators of a row's channels in cache */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_row_backward_sums(dy + off + c, x + off + c, DDP__BN_LANES, mean + c, sum_dy + c, sum_dy_xmu + c);
        for (; c < C; c++) ddp__bn_row_backward_sums(dy + off + c, x + off + c, 1, mean + c, sum_dy + c, sum_dy_xmu + c);
    }
}

/* dx = (dy - mean_dy[c] - (x - mean[c]) * proj[c]) * scale[c] */
static void ddp__bn_pass_grad_input(const ddp_syncbn *bn, const float *dy, const float *x, float *dx, int64_t batch,
                                    int64_t spatial, const float *mean, const float *mean_dy, const float *proj,
                                    const float *scale) {
    const int C = bn->channels;
    int64_t n, r0, r;
    int c;
    if (ddp__bn_planar(bn, spatial)) {
        const int64_t full = spatial / DDP__BN_LANES, tail = spatial % DDP__BN_LANES;
        for (n = 0; n < batch; n++)
            for (c = 0; c < C; c++) {
                const int64_t off = (n * C + c) * spatial, t = full * DDP__BN_LANES;
                float m[DDP__BN_LANES], md[DDP__BN_LANES], p[DDP__BN_LANES], a[DDP__BN_LANES];
                ddp__bn_fill_f32(m, DDP__BN_LANES, mean[c]);
                ddp__bn_fill_f32(md, DDP__BN_LANES, mean_dy[c]);
                ddp__bn_fill_f32(p, DDP__BN_LANES, proj[c]);
                ddp__bn_fill_f32(a, DDP__BN_LANES, scale[c]);
                ddp__bn_cols_grad_input(dy + off, x + off, dx + off, DDP__BN_LANES, full, DDP__BN_LANES, m, md, p, a);
                ddp__bn_cols_grad_input(dy + off + t, x + off + t, dx + off + t, 1, tail, 1, m, md, p, a);
            }
        return;
    }
    r = batch * spatial; /* element-wise: row by row, in memory order */
    for (r0 = 0; r0 < r; r0++) {
        const int64_t off = r0 * C;
        for (c = 0; c + DDP__BN_LANES <= C; c += DDP__BN_LANES)
            ddp__bn_cols_grad_input(dy + off + c, x + off + c, dx + off + c, 0, 1, DDP__BN_LANES, mean + c,
                                    mean_dy + c, proj + c, scale + c);
        for (; c < C; c++)
            ddp__bn_cols_grad_input(dy + off + c, x + off + c, dx + off + c, 0, 1, 1, mean + c, mean_dy + c, proj + c,
                                    scale + c);
    }
}

/* ---- the layer ---- */

DDP_API ddp_result ddp_syncbn_create(ddp_group *g, const ddp_syncbn_desc *d, ddp_syncbn **out) {
    ddp_syncbn *bn;
    size_t C;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_syncbn_create");
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_create: out is NULL");
    *out = NULL;
    if (!d) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_create: the descriptor d is NULL");
    if (d->num_features <= 0 || d->num_features > (INT_MAX - 1) / 2)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: num_features is %d; give the number of channels C (1 .. %d)",
                         d->num_features, (INT_MAX - 1) / 2);
    if (!(d->eps >= 0) || d->eps > 1e30)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: eps is %g; give a small positive number (0 = the default 1e-5)", d->eps);
    if (d->momentum != d->momentum || d->momentum > 1)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: momentum is %g; give a factor in (0, 1], 0 for the default 0.1, or a "
                         "negative number for the cumulative average (momentum=None)",
                         d->momentum);
    if ((d->running_mean == NULL) != (d->running_var == NULL))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_create: running_mean is %s but running_var is %s; give both (track running "
                         "stats) or neither",
                         d->running_mean ? "set" : "NULL", d->running_var ? "set" : "NULL");
    bn = (ddp_syncbn *)ddp__calloc(1, sizeof *bn);
    if (!bn) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_syncbn_create: out of memory");
    bn->errors = g;
    bn->group = d->group ? d->group : g;
    bn->nranks = bn->group ? ddp_world_size(bn->group) : 1;
    bn->rank = bn->group ? ddp_rank(bn->group) : 0;
    bn->channels = d->num_features;
    bn->channels_last = d->channels_last != 0;
    bn->eps = d->eps > 0 ? d->eps : 1e-5;
    bn->momentum = d->momentum == 0 ? 0.1 : d->momentum;
    bn->weight = d->weight;
    bn->bias = d->bias;
    bn->running_mean = d->running_mean;
    bn->running_var = d->running_var;
    C = (size_t)bn->channels;
    bn->mean = (float *)ddp__calloc(C, sizeof(float));
    bn->invstd = (float *)ddp__calloc(C, sizeof(float));
    bn->coef = (float *)ddp__calloc(3 * C, sizeof(float));
    bn->sums = (double *)ddp__calloc(2 * C, sizeof(double));
    bn->shift = (double *)ddp__calloc(C, sizeof(double));
    if (bn->nranks >= 1 && (size_t)bn->nranks <= SIZE_MAX / sizeof(double) / (2 * C + 1))
        bn->records = (double *)ddp__calloc((size_t)bn->nranks * (2 * C + 1), sizeof(double));
    if (!bn->mean || !bn->invstd || !bn->coef || !bn->sums || !bn->shift || !bn->records) {
        const int nranks = bn->nranks;
        ddp_syncbn_destroy(bn);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_syncbn_create: out of memory for %d channels on %d ranks",
                         d->num_features, nranks);
    }
    *out = bn;
    return DDP_SUCCESS;
}

DDP_API void ddp_syncbn_destroy(ddp_syncbn *bn) {
    if (!bn) return;
    ddp__free(bn->mean);
    ddp__free(bn->invstd);
    ddp__free(bn->coef);
    ddp__free(bn->sums);
    ddp__free(bn->shift);
    ddp__free(bn->records);
    ddp__free(bn);
}

DDP_API int64_t ddp_syncbn_num_batches_tracked(const ddp_syncbn *bn) { return bn ? bn->num_batches_tracked : 0; }

DDP_API ddp_result ddp_syncbn_set_num_batches_tracked(ddp_syncbn *bn, int64_t value) {
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_set_num_batches_tracked: bn is NULL");
    if (value < 0)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_set_num_batches_tracked: value is %lld; it counts batches, so it is >= 0",
                         (long long)value);
    bn->num_batches_tracked = value;
    return DDP_SUCCESS;
}

/* Shape and pointer checks shared by forward and backward; *count receives batch * spatial. */
static ddp_result ddp__bn_check(const ddp_syncbn *bn, const char *fn, int64_t batch, int64_t spatial, const void *a,
                                const char *a_name, const void *b, const char *b_name, int64_t *count) {
    if (batch < 0 || spatial < 0)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld, spatial=%lld; both must be >= 0 (spatial is the product of the spatial "
                         "sizes, 1 for (N, C) input)",
                         fn, (long long)batch, (long long)spatial);
    if (spatial > 0 && batch > INT64_MAX / spatial / bn->channels) {
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld x spatial=%lld x C=%d elements overflow 64 bits", fn, (long long)batch,
                         (long long)spatial, bn->channels);
    }
    *count = batch * spatial;
    if (*count > 0 && (uint64_t)(*count * bn->channels) > SIZE_MAX / sizeof(float))
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT, "%s: %lld x %d floats do not fit in memory", fn,
                         (long long)*count, bn->channels);
    if (*count > 0 && (!a || !b))
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT, "%s: %s is NULL with batch=%lld, spatial=%lld", fn,
                         !a ? a_name : b_name, (long long)batch, (long long)spatial);
    return DDP_SUCCESS;
}

/* A collective on bn->group failed: report it in bn->errors' message, naming the step. */
static ddp_result ddp__bn_comm_failed(ddp_syncbn *bn, ddp_result r, const char *what) {
    char msg[DDP__ERR_MAX];
    snprintf(msg, sizeof msg, "%s", ddp_last_error(bn->group)); /* copied first: it may be the same buffer */
    return ddp__fail(bn->errors, r, "%s failed: %s", what, msg);
}

/* This rank's record [mean(C), M2(C), count] from one pass over x. */
static void ddp__bn_local_stats(ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, double *record) {
    const int C = bn->channels;
    const double n = (double)(batch * spatial);
    double *s1 = bn->sums, *s2 = bn->sums + C;
    int c;
    for (c = 0; c < C; c++) /* the channel's first value: a shift close to the mean, so no cancellation */
        bn->shift[c] = n > 0 ? (double)x[bn->channels_last || spatial <= 1 ? c : (int64_t)c * spatial] : 0.0;
    if (n > 0) ddp__bn_pass_stats(bn, x, batch, spatial, s1, s2);
    for (c = 0; c < C; c++) {
        double m2 = n > 0 ? s2[c] - s1[c] * (s1[c] / n) : 0.0;
        record[c] = n > 0 ? bn->shift[c] + s1[c] / n : 0.0;
        record[C + c] = m2 > 0 ? m2 : 0.0;
    }
    record[2 * C] = n;
}

/* Training (or no running stats): batch statistics, merged over the group when synced. Sets bn->mean,
   bn->invstd and what was saved; updates the running stats in training. */
static ddp_result ddp__bn_batch_stats(ddp_syncbn *bn, const float *x, int64_t batch, int64_t spatial, int training) {
    const int C = bn->channels, synced = training && bn->nranks > 1;
    double *records = bn->records, *mine = bn->records + (int64_t)bn->rank * (2 * C + 1);
    double n = 0, mean, m2, factor = 0;
    int c;
    ddp__bn_local_stats(bn, x, batch, spatial, mine);
    if (synced) {
        ddp_result r = ddp_all_gather(bn->group, mine, records, (size_t)(2 * C + 1), DDP_F64);
        if (r != DDP_SUCCESS) return ddp__bn_comm_failed(bn, r, "ddp_syncbn_forward: all_gather of the batch statistics");
    } else {
        records = mine;
    }
    ddp__bn_merge_ranks(records, synced ? bn->nranks : 1, C, 0, &n, &mean, &m2); /* n: the same for every c */
    if (n == 1) /* torch: "Expected more than 1 value per channel when training"; every rank sees the same n */
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "ddp_syncbn_forward: expected more than 1 value per channel when training, got 1 %s "
                         "(batch=%lld, spatial=%lld on this rank); running stats left unchanged",
                         synced ? "over all ranks of the group" : "in the batch", (long long)batch, (long long)spatial);
    if (training && bn->running_mean) { /* counted even for an empty batch, as torch's module does */
        bn->num_batches_tracked++;
        factor = ddp__bn_factor(bn->momentum, bn->num_batches_tracked);
    }
    for (c = 0; c < C; c++) {
        ddp__bn_merge_ranks(records, synced ? bn->nranks : 1, C, c, &n, &mean, &m2);
        bn->mean[c] = (float)mean;
        bn->invstd[c] = n > 0 ? (float)(1.0 / sqrt(m2 / n + bn->eps)) : 0.0f;
        if (training && bn->running_mean && n > 0) /* an empty batch leaves them, as torch's CPU kernel */
            ddp__bn_update_running(&bn->running_mean[c], &bn->running_var[c], mean, m2, n, factor);
    }
    bn->saved = synced ? DDP__BN_SAVED_SYNCED : DDP__BN_SAVED_LOCAL;
    bn->saved_count = n;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_syncbn_forward(ddp_syncbn *bn, const float *x, float *y, int64_t batch, int64_t spatial,
                                      int training) {
    const char *fn = "ddp_syncbn_forward";
    float *scale, *shift;
    int64_t count = 0;
    int c;
    ddp_result r;
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_forward: bn is NULL");
    r = ddp__bn_check(bn, fn, batch, spatial, x, "x", y, "y", &count);
    if (r != DDP_SUCCESS) return r;
    bn->saved = DDP__BN_SAVED_NONE;
    if (training || !bn->running_mean) {
        r = ddp__bn_batch_stats(bn, x, batch, spatial, training);
        if (r != DDP_SUCCESS) return r;
    } else {
        for (c = 0; c < bn->channels; c++) {
            bn->mean[c] = bn->running_mean[c];
            bn->invstd[c] = (float)(1.0 / sqrt((double)bn->running_var[c] + bn->eps));
        }
        bn->saved = DDP__BN_SAVED_EVAL;
    }
    bn->saved_batch = batch;
    bn->saved_spatial = spatial;
    scale = bn->coef;
    shift = bn->coef + bn->channels;
    for (c = 0; c < bn->channels; c++) {
        scale[c] = bn->invstd[c] * (bn->weight ? bn->weight[c] : 1.0f);
        shift[c] = bn->bias ? bn->bias[c] : 0.0f;
    }
    if (count > 0) ddp__bn_pass_normalize(bn, x, y, batch, spatial, bn->mean, scale, shift);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_syncbn_backward(ddp_syncbn *bn, const float *x, const float *dy, float *dx, float *grad_weight,
                                       float *grad_bias, int64_t batch, int64_t spatial) {
    const char *fn = "ddp_syncbn_backward";
    double *sum_dy, *sum_dy_xmu, *mean64;
    int64_t count = 0;
    int C, c, eval;
    ddp_result r;
    if (!bn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_syncbn_backward: bn is NULL");
    r = ddp__bn_check(bn, fn, batch, spatial, x, "x", dy, "dy", &count);
    if (r != DDP_SUCCESS) return r;
    if (bn->saved == DDP__BN_SAVED_NONE)
        return ddp__fail(bn->errors, DDP_ERR_STATE,
                         "%s: no statistics to differentiate: call ddp_syncbn_forward first (a failed forward saves none)",
                         fn);
    if (batch != bn->saved_batch || spatial != bn->saved_spatial)
        return ddp__fail(bn->errors, DDP_ERR_INVALID_ARGUMENT,
                         "%s: batch=%lld, spatial=%lld, but the last forward had batch=%lld, spatial=%lld; pass that "
                         "forward's input",
                         fn, (long long)batch, (long long)spatial, (long long)bn->saved_batch,
                         (long long)bn->saved_spatial);
    C = bn->channels;
    eval = bn->saved == DDP__BN_SAVED_EVAL;
    sum_dy = bn->sums;
    sum_dy_xmu = bn->sums + C;
    mean64 = bn->shift;
    for (c = 0; c < C; c++) mean64[c] = (double)bn->mean[c];
    if (count > 0 && (!eval || grad_weight || grad_bias))
        ddp__bn_pass_backward_sums(bn, dy, x, batch, spatial, mean64, sum_dy, sum_dy_xmu);
    else
        memset(bn->sums, 0, sizeof(double) * 2 * (size_t)C);
    for (c = 0; c < C; c++) { /* local: the reducer averages parameters' gradients over ranks */
        if (grad_weight) grad_weight[c] += (float)(sum_dy_xmu[c] * (double)bn->invstd[c]);
        if (grad_bias) grad_bias[c] += (float)sum_dy[c];
    }
    if (bn->saved == DDP__BN_SAVED_SYNCED) { /* every rank, whether it wants dx or not */
        r = ddp_all_reduce(bn->group, bn->sums, 2 * (size_t)C, DDP_F64, DDP_SUM);
        if (r != DDP_SUCCESS) return ddp__bn_comm_failed(bn, r, "ddp_syncbn_backward: all_reduce of sum_dy and sum_dy_xmu");
    }
    if (!dx || count == 0) return DDP_SUCCESS;
    for (c = 0; c < C; c++) {
        float *mean_dy = bn->coef, *proj = bn->coef + C, *scale = bn->coef + 2 * C;
        const float w = bn->weight ? bn->weight[c] : 1.0f;
        if (eval) { /* the statistics were constants */
            mean_dy[c] = 0;
            proj[c] = 0;
            scale[c] = bn->invstd[c] * w;
        } else {
            ddp__bn_backward_coeffs(sum_dy[c], sum_dy_xmu[c], bn->saved_count, bn->invstd[c], w, &mean_dy[c],
                                    &proj[c], &scale[c]);
        }
    }
    ddp__bn_pass_grad_input(bn, dy, x, dx, batch, spatial, bn->mean, bn->coef, bn->coef + C, bn->coef + 2 * C);
    return DDP_SUCCESS;
}
/* ==================== end src/syncbn.c ==================== */

/* ==================== begin src/safetensors.c ==================== */
/* [SECTION] safetensors: the file format (Hugging Face safetensors), CRC32C, UTF-8, ddp_meta
   The format of the safetensors crate, which torch users read with safetensors.torch.load_file:
       | N: uint64 little-endian | N bytes of JSON header | data: the tensors' bytes, back to back |
       {"__metadata__": {"key": "value", ...},
        "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
   Offsets count from the start of the data section. ddp.h's writer adds a CRC32C of every tensor's
   bytes to __metadata__ ("ddp.crc32c.<name>": 8 hex digits) and pads the header with spaces so that the
   data starts at a multiple of 8; "ddp.crc32c." and "ddp.shard." keys are the library's. This file is
   the format only, with no group: errors go to a char buffer of DDP__ERR_MAX bytes (the public
   ddp_meta_* functions to this thread's last error); saving and loading it across ranks is
   checkpoint.c's. Layout of this file:
     crc32c        Castagnoli CRC, SSE4.2 instruction when the CPU has it, else slicing-by-8 tables
     UTF-8         strict RFC 3629 validation (names, keys and values must be UTF-8)
     meta          the caller's key/value map and its typed helpers
     parser        a strict, bounded parser for the safetensors JSON header (the only JSON we accept:
                   one object of tensor entries and "__metadata__"; strings, non-negative integers,
                   arrays of them); every offset is checked with overflow-safe arithmetic
     writer        the JSON header (checkpoint.c writes it and the data to disk) */

#define DDP__CK_MAX_INT ((uint64_t)INT64_MAX)   /* largest integer a header may hold */

static int ddp__ck_little_endian(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* ---- crc32c ----
   CRC-32C, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF; "123456789" gives
   0xE3069283. Portable path: slicing-by-8 (eight 256-entry tables, eight bytes per step). */

static uint32_t ddp__ck_crc_table[8][256];
static pthread_once_t ddp__ck_crc_once = PTHREAD_ONCE_INIT;

static void ddp__ck_crc_init(void) {
    uint32_t i, k;
    for (i = 0; i < 256; i++) {
        uint32_t c = i;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        ddp__ck_crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++)
        for (k = 1; k < 8; k++)
            ddp__ck_crc_table[k][i] = (ddp__ck_crc_table[k - 1][i] >> 8) ^ ddp__ck_crc_table[0][ddp__ck_crc_table[k - 1][i] & 0xffu];
}

/* crc is the running value without the final xor (start with 0xFFFFFFFF). */
static uint32_t ddp__ck_crc_soft(uint32_t crc, const unsigned char *p, size_t n) {
    pthread_once(&ddp__ck_crc_once, ddp__ck_crc_init);
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = ddp__ck_crc_table[7][lo & 0xffu] ^ ddp__ck_crc_table[6][(lo >> 8) & 0xffu] ^
              ddp__ck_crc_table[5][(lo >> 16) & 0xffu] ^ ddp__ck_crc_table[4][lo >> 24] ^
              ddp__ck_crc_table[3][hi & 0xffu] ^ ddp__ck_crc_table[2][(hi >> 8) & 0xffu] ^
              ddp__ck_crc_table[1][(hi >> 16) & 0xffu] ^ ddp__ck_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ ddp__ck_crc_table[0][(crc ^ *p++) & 0xffu];
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DDP__CK_HAVE_HW_CRC 1
/* The SSE4.2 crc32 instruction computes exactly this CRC, eight bytes at a time. It takes 3 cycles but
   can start every cycle, so three independent streams run over three adjacent lanes of
   DDP__CK_LANE bytes and are then joined: crc(A B) = shift(crc(A)) ^ crc0(B), where crc0 starts from
   0 and shift appends DDP__CK_LANE zero bytes. shift is linear over GF(2): it is four table lookups,
   built once from its values on the 32 unit vectors. */
#define DDP__CK_LANE 4096
static uint32_t ddp__ck_shift_table[4][256];
static pthread_once_t ddp__ck_shift_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2"))) static void ddp__ck_shift_init(void) {
    uint32_t basis[32];
    int b, k, i;
    for (b = 0; b < 32; b++) {
        unsigned long long c = 1ull << b;
        for (i = 0; i < DDP__CK_LANE / 8; i++) c = __builtin_ia32_crc32di(c, 0);
        basis[b] = (uint32_t)c;
    }
    for (k = 0; k < 4; k++)
        for (i = 0; i < 256; i++) {
            uint32_t v = 0;
            for (b = 0; b < 8; b++)
                if ((i >> b) & 1) v ^= basis[8 * k + b];
            ddp__ck_shift_table[k][i] = v;
        }
}

static uint32_t ddp__ck_shift(uint32_t c) {
    return ddp__ck_shift_table[0][c & 0xffu] ^ ddp__ck_shift_table[1][(c >> 8) & 0xffu] ^ ddp__ck_shift_table[2][(c >> 16) & 0xffu] ^
           ddp__ck_shift_table[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t ddp__ck_crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    unsigned long long c = crc;
    if (n >= 3 * DDP__CK_LANE) pthread_once(&ddp__ck_shift_once, ddp__ck_shift_init);
    while (n >= 3 * DDP__CK_LANE) {
        unsigned long long c1 = 0, c2 = 0, v0, v1, v2;
        size_t j;
        for (j = 0; j < DDP__CK_LANE; j += 8) {
            memcpy(&v0, p + j, 8);
            memcpy(&v1, p + DDP__CK_LANE + j, 8);
            memcpy(&v2, p + 2 * DDP__CK_LANE + j, 8);
            c = __builtin_ia32_crc32di(c, v0);
            c1 = __builtin_ia32_crc32di(c1, v1);
            c2 = __builtin_ia32_crc32di(c2, v2);
        }
        c = ddp__ck_shift(ddp__ck_shift((uint32_t)c) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * DDP__CK_LANE;
        n -= 3 * DDP__CK_LANE;
    }
    while (n >= 8) {
        unsigned long long v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
    return crc;
}
#endif

/* Running CRC32C register (start with 0xFFFFFFFF, finish with ~) over n more bytes. use_hw: 1 to take
   the instruction when the CPU has it (0 is for the tests). */
static uint32_t ddp__ck_crc_update(uint32_t reg, const void *data, size_t n, int use_hw) {
    const unsigned char *p = (const unsigned char *)data;
#ifdef DDP__CK_HAVE_HW_CRC
    if (use_hw && __builtin_cpu_supports("sse4.2")) return ddp__ck_crc_hw(reg, p, n);
#else
    (void)use_hw;
#endif
    return ddp__ck_crc_soft(reg, p, n);
}

static uint32_t ddp__ck_crc32c(const void *data, size_t n, int use_hw) { return ~ddp__ck_crc_update(0xFFFFFFFFu, data, n, use_hw); }

/* ---- UTF-8 ----
   Strict RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF. Returns the length of the
   sequence at p (1..4), or 0 when it is not valid. */
static int ddp__ck_utf8_seq(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    int len, i;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1Fu;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0Fu;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07u;
    else return 0;
    if (end - p < len) return 0;
    for (i = 1; i < len; i++) {
        if ((p[i] & 0xC0u) != 0x80u) return 0;
        cp = (cp << 6) | (p[i] & 0x3Fu);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    return len;
}

static int ddp__ck_utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s, *end = p + strlen(s);
    while (p < end) {
        int k = ddp__ck_utf8_seq(p, end);
        if (!k) return 0;
        p += k;
    }
    return 1;
}

/* ---- meta ---- */

static int ddp__ck_meta_find(const ddp_meta *m, const char *key) {
    int i;
    for (i = 0; m && i < m->count; i++)
        if (strcmp(m->entries[i].key, key) == 0) return i;
    return -1;
}

/* Append without looking for an existing key (the parser checks duplicates once, by sorting). */
static ddp_result ddp__ck_meta_append(ddp_meta *m, char *key, char *value) {
    if (m->count == m->capacity) {
        int cap = m->capacity ? 2 * m->capacity : 8;
        ddp_meta_entry *e;
        if (cap > INT_MAX / 2) return DDP_ERR_OUT_OF_MEMORY;
        e = (ddp_meta_entry *)DDP_REALLOC(m->entries, (size_t)cap * sizeof *e);
        if (!e) return DDP_ERR_OUT_OF_MEMORY;
        m->entries = e;
        m->capacity = cap;
    }
    m->entries[m->count].key = key;
    m->entries[m->count].value = value;
    m->count++;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_meta_set(ddp_meta *m, const char *key, const char *value) {
    char *k, *v;
    int i;
    if (!m || !key || !*key || !value)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set: map, key and value must not be NULL and key not empty");
    if (!ddp__ck_utf8_valid(key) || !ddp__ck_utf8_valid(value))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set: key \"%.64s\" or its value is not valid UTF-8", key);
    v = ddp__strdup(value);
    if (!v) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set: out of memory copying the value of \"%.64s\"", key);
    i = ddp__ck_meta_find(m, key);
    if (i >= 0) {
        ddp__free(m->entries[i].value);
        m->entries[i].value = v;
        return DDP_SUCCESS;
    }
    k = ddp__strdup(key);
    if (!k || ddp__ck_meta_append(m, k, v) != DDP_SUCCESS) {
        ddp__free(k);
        ddp__free(v);
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set: out of memory adding \"%.64s\"", key);
    }
    return DDP_SUCCESS;
}

DDP_API const char *ddp_meta_get(const ddp_meta *m, const char *key) {
    int i = key ? ddp__ck_meta_find(m, key) : -1;
    return i >= 0 ? m->entries[i].value : NULL;
}

DDP_API int ddp_meta_remove(ddp_meta *m, const char *key) {
    int i = key ? ddp__ck_meta_find(m, key) : -1;
    if (i < 0) return 0;
    ddp__free(m->entries[i].key);
    ddp__free(m->entries[i].value);
    memmove(m->entries + i, m->entries + i + 1, (size_t)(m->count - i - 1) * sizeof *m->entries);
    m->count--;
    return 1;
}

DDP_API void ddp_meta_free(ddp_meta *m) {
    int i;
    if (!m) return;
    for (i = 0; i < m->count; i++) {
        ddp__free(m->entries[i].key);
        ddp__free(m->entries[i].value);
    }
    ddp__free(m->entries);
    m->entries = NULL;
    m->count = m->capacity = 0;
}

DDP_API ddp_result ddp_meta_set_int(ddp_meta *m, const char *key, int64_t value) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)value);
    return ddp_meta_set(m, key, buf);
}

DDP_API ddp_result ddp_meta_get_int(const ddp_meta *m, const char *key, int64_t *value) {
    const char *s = ddp_meta_get(m, key), *p;
    uint64_t mag = 0, limit;
    int neg;
    if (!s) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata has no key \"%.64s\"", key ? key : "(null)");
    p = s;
    neg = (*p == '-');
    if (neg) p++;
    limit = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
    if (!*p) goto bad;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || mag > (limit - (uint64_t)(*p - '0')) / 10) goto bad;
        mag = mag * 10 + (uint64_t)(*p - '0');
    }
    if (!value) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_get_int: value must not be NULL");
    *value = neg ? (int64_t)(0u - mag) : (int64_t)mag;
    return DDP_SUCCESS;
bad:
    return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" = \"%.64s\" is not a 64-bit decimal integer", key, s);
}

DDP_API ddp_result ddp_meta_set_bytes(ddp_meta *m, const char *key, const void *data, size_t size) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *b = (const unsigned char *)data;
    char *s;
    size_t i;
    ddp_result r;
    if ((!data && size) || size > (SIZE_MAX - 1) / 2)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set_bytes(\"%.64s\"): data is NULL or size too large", key ? key : "(null)");
    s = (char *)ddp__malloc(2 * size + 1);
    if (!s) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_meta_set_bytes: out of memory for %zu bytes", size);
    for (i = 0; i < size; i++) {
        s[2 * i] = hex[b[i] >> 4];
        s[2 * i + 1] = hex[b[i] & 15];
    }
    s[2 * size] = '\0';
    r = ddp_meta_set(m, key, s);
    ddp__free(s);
    return r;
}

static int ddp__ck_hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

DDP_API ddp_result ddp_meta_get_bytes(const ddp_meta *m, const char *key, void *data, size_t capacity, size_t *size) {
    const char *s = ddp_meta_get(m, key);
    size_t len, i;
    if (!s) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata has no key \"%.64s\"", key ? key : "(null)");
    len = strlen(s);
    if (len % 2) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" has an odd number of hex digits", key);
    for (i = 0; i < len; i++)
        if (ddp__ck_hexval(s[i]) < 0)
            return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata \"%.64s\" is not hex (character %zu is '%c')", key, i, s[i]);
    if (size) *size = len / 2;
    if (len / 2 > capacity || (!data && len))
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "checkpoint metadata \"%.64s\" holds %zu bytes; the buffer has room for %zu",
                         key, len / 2, data ? capacity : 0);
    for (i = 0; i < len / 2; i++)
        ((unsigned char *)data)[i] = (unsigned char)(ddp__ck_hexval(s[2 * i]) * 16 + ddp__ck_hexval(s[2 * i + 1]));
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_meta_set_resume(ddp_meta *m, const ddp_resume_state *s) {
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_set_resume: state must not be NULL");
    if ((r = ddp_meta_set_int(m, DDP_META_STEP, s->step)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_EPOCH, s->epoch)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_SAMPLER_POSITION, s->sampler_position)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_set_int(m, DDP_META_WORLD_SIZE, s->world_size)) != DDP_SUCCESS) return r;
    if (s->rng_state_size == 0) {
        ddp_meta_remove(m, DDP_META_RNG_STATE);
        return DDP_SUCCESS;
    }
    return ddp_meta_set_bytes(m, DDP_META_RNG_STATE, s->rng_state, s->rng_state_size);
}

DDP_API ddp_result ddp_meta_get_resume(const ddp_meta *m, ddp_resume_state *s) {
    int64_t ws;
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_meta_get_resume: state must not be NULL");
    if ((r = ddp_meta_get_int(m, DDP_META_STEP, &s->step)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_EPOCH, &s->epoch)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_SAMPLER_POSITION, &s->sampler_position)) != DDP_SUCCESS) return r;
    if ((r = ddp_meta_get_int(m, DDP_META_WORLD_SIZE, &ws)) != DDP_SUCCESS) return r;
    if (ws < 0 || ws > INT_MAX) return ddp__fail(NULL, DDP_ERR_FORMAT, "checkpoint metadata " DDP_META_WORLD_SIZE " = %lld is out of range", (long long)ws);
    s->world_size = (int)ws;
    if (!ddp_meta_get(m, DDP_META_RNG_STATE)) {
        s->rng_state_size = 0;
        return DDP_SUCCESS;
    }
    return ddp_meta_get_bytes(m, DDP_META_RNG_STATE, s->rng_state, s->rng_state_size, &s->rng_state_size);
}

/* ---- parser ----
   Grammar (JSON, restricted to what a safetensors header holds; whitespace allowed between tokens and
   at the end, which is how writers pad the header):
     header   = '{' [ member *( ',' member ) ] '}'
     member   = string ':' ( tensor | metadata )      ; metadata when the key is "__metadata__"
     tensor   = '{' "dtype": string, "shape": [uint...], "data_offsets": [uint, uint] '}' (any order)
     metadata = '{' [ string ':' string *( ',' string ':' string ) ] '}'
   Integers are plain decimal (no sign, fraction, exponent or leading zero), at most 2^63-1. Strings
   are UTF-8 with JSON escapes; \u0000 is refused (C strings). Duplicate names and keys are errors. */

/* The dtype table (ddp__ck_dtypes) and the parsed header's types are in internal.h:
   checkpoint.c uses them too. */

static const char *ddp__ck_st_name(ddp_dtype t) {
    int i;
    for (i = 0; i < DDP__CK_NDTYPES; i++)
        if (ddp__ck_dtypes[i].dtype == t && t != DDP_DTYPE_DEFAULT) return ddp__ck_dtypes[i].name;
    return "?";
}

typedef struct ddp__ck_json {
    const unsigned char *start, *p, *end;
    char *err; /* DDP__ERR_MAX bytes */
} ddp__ck_json;

static void ddp__ck_header_free(ddp__ck_header *h) {
    int i;
    for (i = 0; i < h->n; i++) ddp__free(h->e[i].name);
    ddp__free(h->e);
    ddp__free(h->by_name);
    ddp__free(h->meta_sorted);
    ddp_meta_free(&h->meta);
    memset(h, 0, sizeof *h);
}

static ddp_result ddp__ck_bad(ddp__ck_json *j, const char *what) {
    return ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: %s", (size_t)(j->p - j->start), what);
}

static void ddp__ck_ws(ddp__ck_json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* Skip whitespace, then consume c or fail saying what was expected. */
static ddp_result ddp__ck_expect(ddp__ck_json *j, char c, const char *what) {
    ddp__ck_ws(j);
    if (j->p >= j->end || *j->p != (unsigned char)c) return ddp__ck_bad(j, what);
    j->p++;
    return DDP_SUCCESS;
}

/* After a member or element: 1 when the container continues (','), 0 when it closed, -1 on error. */
static int ddp__ck_next(ddp__ck_json *j, char close, const char *what) {
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == ',') return j->p++, 1;
    if (j->p < j->end && *j->p == (unsigned char)close) return j->p++, 0;
    ddp__ck_bad(j, what);
    return -1;
}

static int ddp__ck_hex4(const unsigned char *p, const unsigned char *end, uint32_t *v) {
    int i;
    *v = 0;
    if (end - p < 4) return 0;
    for (i = 0; i < 4; i++) {
        int d = ddp__ck_hexval((char)p[i]);
        if (d < 0) return 0;
        *v = *v * 16 + (uint32_t)d;
    }
    return 1;
}

static size_t ddp__ck_put_utf8(unsigned char *o, uint32_t cp) {
    if (cp < 0x80) return o[0] = (unsigned char)cp, 1;
    if (cp < 0x800) return o[0] = (unsigned char)(0xC0 | (cp >> 6)), o[1] = (unsigned char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A \uXXXX escape (p after the 'u'), a surrogate pair included. Returns the code point, 0 on error. */
static uint32_t ddp__ck_unicode_escape(ddp__ck_json *j) {
    uint32_t hi, lo;
    if (!ddp__ck_hex4(j->p, j->end, &hi)) return 0;
    j->p += 4;
    if (hi >= 0xDC00 && hi <= 0xDFFF) return 0;
    if (hi < 0xD800 || hi > 0xDBFF) return hi;
    if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || !ddp__ck_hex4(j->p + 2, j->end, &lo) || lo < 0xDC00 ||
        lo > 0xDFFF)
        return 0;
    j->p += 6;
    return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
}

/* A string token; *out is a new NUL-terminated UTF-8 copy (escapes only shrink, so the raw length
   bounds the decoded one). */
static ddp_result ddp__ck_string(ddp__ck_json *j, char **out) {
    const unsigned char *q;
    unsigned char *o, *buf;
    ddp_result r = ddp__ck_expect(j, '"', "expected a string");
    *out = NULL;
    if (r != DDP_SUCCESS) return r;
    for (q = j->p; q < j->end && *q != '"'; q++)
        if (*q == '\\' && q + 1 < j->end) q++;
    if (q >= j->end) return ddp__ck_bad(j, "unterminated string");
    buf = o = (unsigned char *)ddp__malloc((size_t)(q - j->p) + 1);
    if (!buf) return ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
    while (*j->p != '"') {
        unsigned char c = *j->p;
        if (c < 0x20) goto bad_control;
        if (c >= 0x80) {
            int k = ddp__ck_utf8_seq(j->p, j->end);
            if (!k) goto bad_utf8;
            memcpy(o, j->p, (size_t)k);
            o += k;
            j->p += k;
            continue;
        }
        j->p++;
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        c = *j->p++;
        switch (c) {
        case '"': case '\\': case '/': *o++ = c; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            uint32_t cp = ddp__ck_unicode_escape(j);
            if (!cp) goto bad_escape;
            o += ddp__ck_put_utf8(o, cp);
            break;
        }
        default: j->p--; goto bad_escape;
        }
    }
    j->p++;
    *o = '\0';
    *out = (char *)buf;
    return DDP_SUCCESS;
bad_control:
    ddp__free(buf);
    return ddp__ck_bad(j, "control character inside a string (must be escaped)");
bad_utf8:
    ddp__free(buf);
    return ddp__ck_bad(j, "string is not valid UTF-8");
bad_escape:
    ddp__free(buf);
    return ddp__ck_bad(j, "bad escape in a string (\\u0000 and lone surrogates are refused)");
}

static ddp_result ddp__ck_uint(ddp__ck_json *j, uint64_t *v) {
    uint64_t x = 0;
    const unsigned char *s;
    ddp__ck_ws(j);
    s = j->p;
    if (j->p < j->end && *j->p == '-') return ddp__ck_bad(j, "negative number (shapes and offsets are >= 0)");
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        unsigned d = (unsigned)(*j->p - '0');
        if (x > (DDP__CK_MAX_INT - d) / 10) return ddp__ck_bad(j, "integer larger than 2^63-1");
        x = x * 10 + d;
        j->p++;
    }
    if (j->p == s) return ddp__ck_bad(j, "expected a non-negative integer");
    if (*s == '0' && j->p - s > 1) return ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: integer with a leading zero", (size_t)(s - j->start));
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E')) return ddp__ck_bad(j, "number is not an integer");
    *v = x;
    return DDP_SUCCESS;
}

/* '[' uint, ... ']': the first keep values go to vals; *count is the number of elements. */
static ddp_result ddp__ck_uint_array(ddp__ck_json *j, uint64_t *vals, int keep, int *count) {
    ddp_result r;
    int more;
    *count = 0;
    if ((r = ddp__ck_expect(j, '[', "expected '['")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == ']') return j->p++, DDP_SUCCESS;
    do {
        uint64_t v = 0;
        if ((r = ddp__ck_uint(j, &v)) != DDP_SUCCESS) return r;
        if (*count < keep) vals[*count] = v;
        if (*count == INT_MAX) return ddp__ck_bad(j, "array too long");
        (*count)++;
        more = ddp__ck_next(j, ']', "expected ',' or ']' in an array");
    } while (more == 1);
    return more < 0 ? DDP_ERR_FORMAT : DDP_SUCCESS;
}

static ddp_result ddp__ck_dtype(ddp__ck_json *j, ddp__ck_entry *e) {
    char *s;
    int i;
    ddp_result r = ddp__ck_string(j, &s);
    if (r != DDP_SUCCESS) return r;
    for (i = 0; i < DDP__CK_NDTYPES; i++)
        if (strcmp(s, ddp__ck_dtypes[i].name) == 0) break;
    if (i == DDP__CK_NDTYPES) {
        r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: tensor \"%.64s\" has unknown dtype \"%.32s\"",
                         (size_t)(j->p - j->start), e->name, s);
        ddp__free(s);
        return r;
    }
    ddp__free(s);
    e->st = i;
    return DDP_SUCCESS;
}

/* Element count times element size, refusing overflow; a zero dimension makes 0 whatever the others. */
static int ddp__ck_shape_bytes(const uint64_t *dims, int ndim, uint64_t elem, uint64_t *bytes) {
    uint64_t n = 1;
    int i, overflow = 0;
    for (i = 0; i < ndim; i++) {
        if (dims[i] == 0) return *bytes = 0, 1;
        if (!overflow && n > DDP__CK_MAX_INT / dims[i]) overflow = 1;
        if (!overflow) n *= dims[i];
    }
    if (overflow || n > DDP__CK_MAX_INT / elem) return 0;
    *bytes = n * elem;
    return 1;
}

static ddp_result ddp__ck_tensor(ddp__ck_json *j, ddp__ck_entry *e) {
    uint64_t dims[8], offs[2], bytes;
    int seen_dtype = 0, seen_shape = 0, seen_offsets = 0, more, count, i;
    ddp_result r;
    uint64_t *all_dims = NULL;
    if ((r = ddp__ck_expect(j, '{', "a tensor entry must be an object")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == '}') return ddp__ck_bad(j, "tensor entry without dtype, shape and data_offsets");
    do {
        char *key;
        if ((r = ddp__ck_string(j, &key)) != DDP_SUCCESS) break; /* break, not return: all_dims may be held */
        if ((r = ddp__ck_expect(j, ':', "expected ':'")) != DDP_SUCCESS) {
            ddp__free(key);
            break;
        }
        if (strcmp(key, "dtype") == 0 && !seen_dtype++) {
            r = ddp__ck_dtype(j, e);
        } else if (strcmp(key, "shape") == 0 && !seen_shape++) {
            const unsigned char *at = j->p;
            r = ddp__ck_uint_array(j, dims, 8, &count);
            if (r == DDP_SUCCESS && count > 8) {
                /* more than 8 dimensions: parse again keeping them all, for the byte count */
                all_dims = (uint64_t *)ddp__calloc((size_t)count, sizeof *all_dims);
                j->p = at;
                r = all_dims ? ddp__ck_uint_array(j, all_dims, count, &count)
                             : ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing a shape");
            }
            e->ndim = count;
        } else if (strcmp(key, "data_offsets") == 0 && !seen_offsets++) {
            r = ddp__ck_uint_array(j, offs, 2, &count);
            if (r == DDP_SUCCESS && count != 2) r = ddp__ck_bad(j, "data_offsets must be [begin, end]");
        } else {
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: tensor \"%.64s\" has %s key \"%.32s\"",
                             (size_t)(j->p - j->start), e->name,
                             (!strcmp(key, "dtype") || !strcmp(key, "shape") || !strcmp(key, "data_offsets")) ? "a repeated" : "an unknown",
                             key);
        }
        ddp__free(key);
        if (r != DDP_SUCCESS) break;
        more = ddp__ck_next(j, '}', "expected ',' or '}' in a tensor entry");
        if (more < 0) r = DDP_ERR_FORMAT;
    } while (r == DDP_SUCCESS && more == 1);
    if (r == DDP_SUCCESS && !(seen_dtype && seen_shape && seen_offsets))
        r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" lacks %s", e->name,
                         !seen_dtype ? "dtype" : !seen_shape ? "shape" : "data_offsets");
    if (r == DDP_SUCCESS) {
        for (i = 0; i < e->ndim && i < 8; i++) e->shape[i] = (int64_t)dims[i];
        e->begin = offs[0];
        e->end = offs[1];
        if (!ddp__ck_shape_bytes(all_dims ? all_dims : dims, e->ndim, ddp__ck_dtypes[e->st].size, &bytes))
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" has a shape too large to address", e->name);
        else if (e->begin > e->end)
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" has data_offsets [%llu, %llu] with begin > end",
                             e->name, (unsigned long long)e->begin, (unsigned long long)e->end);
        else if (e->end - e->begin != bytes)
            r = ddp__fail_to(j->err, DDP_ERR_FORMAT,
                             "safetensors header: tensor \"%.64s\" (%s, %d dims) needs %llu bytes but data_offsets [%llu, %llu] span %llu",
                             e->name, ddp__ck_dtypes[e->st].name, e->ndim, (unsigned long long)bytes,
                             (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    }
    ddp__free(all_dims);
    return r;
}

static ddp_result ddp__ck_metadata(ddp__ck_json *j, ddp__ck_header *h) {
    ddp_result r;
    int more;
    if ((r = ddp__ck_expect(j, '{', "__metadata__ must be an object of strings")) != DDP_SUCCESS) return r;
    ddp__ck_ws(j);
    if (j->p < j->end && *j->p == '}') return j->p++, DDP_SUCCESS;
    do {
        char *key, *value = NULL;
        if ((r = ddp__ck_string(j, &key)) != DDP_SUCCESS) return r;
        if ((r = ddp__ck_expect(j, ':', "expected ':'")) == DDP_SUCCESS) {
            ddp__ck_ws(j);
            if (j->p < j->end && *j->p != '"')
                r = ddp__fail_to(j->err, DDP_ERR_FORMAT, "safetensors header, byte %zu: __metadata__ value of \"%.64s\" is not a string",
                                 (size_t)(j->p - j->start), key);
            else
                r = ddp__ck_string(j, &value);
        }
        if (r == DDP_SUCCESS && !*key) r = ddp__ck_bad(j, "empty __metadata__ key");
        if (r == DDP_SUCCESS && ddp__ck_meta_append(&h->meta, key, value) != DDP_SUCCESS)
            r = ddp__fail_to(j->err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
        if (r != DDP_SUCCESS) {
            ddp__free(key);
            ddp__free(value);
            return r;
        }
        more = ddp__ck_next(j, '}', "expected ',' or '}' in __metadata__");
    } while (more == 1);
    return more < 0 ? DDP_ERR_FORMAT : DDP_SUCCESS;
}

static int ddp__ck_cmp_offsets(const void *a, const void *b) {
    const ddp__ck_entry *x = (const ddp__ck_entry *)a, *y = (const ddp__ck_entry *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int ddp__ck_cmp_names(const void *a, const void *b) {
    return strcmp((*(ddp__ck_entry *const *)a)->name, (*(ddp__ck_entry *const *)b)->name);
}

static int ddp__ck_cmp_keys(const void *a, const void *b) {
    return strcmp((*(ddp_meta_entry *const *)a)->key, (*(ddp_meta_entry *const *)b)->key);
}

/* Sort, then check what needs the whole header: unique names and keys, data laid out back to back
   from offset 0 to the end of the file. */
static ddp_result ddp__ck_layout(ddp__ck_header *h, uint64_t data_len, char *err) {
    uint64_t at = 0;
    int i;
    h->by_name = (ddp__ck_entry **)ddp__calloc((size_t)h->n, sizeof *h->by_name);
    h->meta_sorted = (ddp_meta_entry **)ddp__calloc((size_t)h->meta.count, sizeof *h->meta_sorted);
    if (!h->by_name || !h->meta_sorted) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory indexing the safetensors header");
    if (h->n) qsort(h->e, (size_t)h->n, sizeof *h->e, ddp__ck_cmp_offsets);
    for (i = 0; i < h->n; i++) h->by_name[i] = &h->e[i];
    for (i = 0; i < h->meta.count; i++) h->meta_sorted[i] = &h->meta.entries[i];
    if (h->n) qsort(h->by_name, (size_t)h->n, sizeof *h->by_name, ddp__ck_cmp_names);
    if (h->meta.count) qsort(h->meta_sorted, (size_t)h->meta.count, sizeof *h->meta_sorted, ddp__ck_cmp_keys);
    for (i = 1; i < h->n; i++)
        if (strcmp(h->by_name[i - 1]->name, h->by_name[i]->name) == 0)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" appears twice", h->by_name[i]->name);
    for (i = 1; i < h->meta.count; i++)
        if (strcmp(h->meta_sorted[i - 1]->key, h->meta_sorted[i]->key) == 0)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: __metadata__ key \"%.64s\" appears twice", h->meta_sorted[i]->key);
    for (i = 0; i < h->n; i++) {
        const ddp__ck_entry *e = &h->e[i];
        if (e->begin != at)
            return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header: tensor \"%.64s\" starts at data byte %llu, but the previous data ends at %llu (%s)",
                                e->name, (unsigned long long)e->begin, (unsigned long long)at, e->begin > at ? "a gap" : "an overlap");
        at = e->end;
    }
    if (at != data_len)
        return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors file: the tensors cover %llu data bytes but the file holds %llu after the header (%s)",
                            (unsigned long long)at, (unsigned long long)data_len, at > data_len ? "truncated" : "trailing bytes");
    return DDP_SUCCESS;
}

/* Parse len bytes of header JSON for a file with data_len bytes after the header. On error h is freed
   and err (DDP__ERR_MAX bytes) says what is wrong. */
static ddp_result ddp__ck_parse(const char *json, size_t len, uint64_t data_len, ddp__ck_header *h, char *err) {
    ddp__ck_json j;
    ddp_result r;
    int more, seen_meta = 0;
    memset(h, 0, sizeof *h);
    j.start = j.p = (const unsigned char *)json;
    j.end = j.p + len;
    j.err = err;
    if (len == 0 || *j.p != '{') return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header does not start with '{' (not a safetensors file?)");
    j.p++;
    ddp__ck_ws(&j);
    if (j.p < j.end && *j.p == '}') {
        j.p++;
        more = 0;
    } else {
        do {
            char *name;
            if ((r = ddp__ck_string(&j, &name)) != DDP_SUCCESS) goto fail;
            if ((r = ddp__ck_expect(&j, ':', "expected ':'")) != DDP_SUCCESS) {
                ddp__free(name);
                goto fail;
            }
            if (strcmp(name, "__metadata__") == 0) {
                ddp__free(name);
                r = seen_meta++ ? ddp__ck_bad(&j, "__metadata__ appears twice") : ddp__ck_metadata(&j, h);
                if (r != DDP_SUCCESS) goto fail;
            } else {
                ddp__ck_entry *e;
                if (h->n == h->cap) {
                    int cap = h->cap ? 2 * h->cap : 16;
                    ddp__ck_entry *ne = cap > INT_MAX / 2 ? NULL : (ddp__ck_entry *)DDP_REALLOC(h->e, (size_t)cap * sizeof *ne);
                    if (!ne) {
                        ddp__free(name);
                        r = ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory parsing the safetensors header");
                        goto fail;
                    }
                    h->e = ne;
                    h->cap = cap;
                }
                e = &h->e[h->n++];
                memset(e, 0, sizeof *e);
                e->name = name;
                if ((r = ddp__ck_tensor(&j, e)) != DDP_SUCCESS) goto fail;
            }
            more = ddp__ck_next(&j, '}', "expected ',' or '}' after a header member");
            if (more < 0) {
                r = DDP_ERR_FORMAT;
                goto fail;
            }
        } while (more == 1);
    }
    ddp__ck_ws(&j);
    if (j.p != j.end) {
        r = ddp__ck_bad(&j, "bytes after the header object");
        goto fail;
    }
    if ((r = ddp__ck_layout(h, data_len, err)) != DDP_SUCCESS) goto fail;
    return DDP_SUCCESS;
fail:
    ddp__ck_header_free(h);
    return r;
}

/* The 8-byte little-endian header length of a file of file_size bytes. */
static ddp_result ddp__ck_prefix(const unsigned char *b, uint64_t file_size, uint64_t *hlen, char *err) {
    uint64_t n = 0;
    int i;
    if (file_size < 8) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors file of %llu bytes is shorter than its 8-byte header length (truncated?)", (unsigned long long)file_size);
    for (i = 7; i >= 0; i--) n = (n << 8) | b[i];
    if (n > DDP__CK_MAX_HEADER) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header length %llu exceeds the limit of %llu bytes (corrupt or not a safetensors file)",
                                                    (unsigned long long)n, DDP__CK_MAX_HEADER);
    if (n > file_size - 8) return ddp__fail_to(err, DDP_ERR_FORMAT, "safetensors header length %llu runs past the end of the %llu-byte file (truncated?)",
                                               (unsigned long long)n, (unsigned long long)file_size);
    *hlen = n;
    return DDP_SUCCESS;
}

static ddp__ck_entry *ddp__ck_lookup(const ddp__ck_header *h, const char *name) {
    int lo = 0, hi = h->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(name, h->by_name[mid]->name);
        if (c == 0) return h->by_name[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

static const char *ddp__ck_header_meta(const ddp__ck_header *h, const char *key) {
    int lo = 0, hi = h->meta.count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(key, h->meta_sorted[mid]->key);
        if (c == 0) return h->meta_sorted[mid]->value;
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return NULL;
}

/* The stored checksum of tensor name: 1 found (in *crc), 0 absent, -1 malformed. */
static int ddp__ck_stored_crc(const ddp__ck_header *h, const char *name, uint32_t *crc) {
    size_t plen = strlen(DDP__CK_CRC_PREFIX), nlen = strlen(name);
    char small[256], *key = nlen + plen < sizeof small ? small : (char *)ddp__malloc(plen + nlen + 1);
    const char *v;
    int i, found = -1;
    if (!key) return -1;
    memcpy(key, DDP__CK_CRC_PREFIX, plen);
    memcpy(key + plen, name, nlen + 1);
    v = ddp__ck_header_meta(h, key);
    if (key != small) ddp__free(key);
    if (!v) return 0;
    *crc = 0;
    for (i = 0; v[i]; i++) {
        int d = ddp__ck_hexval(v[i]);
        if (d < 0 || i >= 8) return -1;
        *crc = *crc * 16 + (uint32_t)d;
    }
    if (i == 8) found = 1;
    return found;
}

/* For the fuzz target and the tests: check a whole file image in memory (prefix, header, layout, and
   every checksum that is present). */
static DDP__UNUSED ddp_result ddp__ck_check_image(const unsigned char *buf, size_t size, char *err) {
    ddp__ck_header h;
    uint64_t hlen;
    ddp_result r = ddp__ck_prefix(buf, size, &hlen, err);
    int i;
    if (r != DDP_SUCCESS) return r;
    r = ddp__ck_parse((const char *)buf + 8, (size_t)hlen, size - 8 - hlen, &h, err);
    if (r != DDP_SUCCESS) return r;
    for (i = 0; i < h.n && r == DDP_SUCCESS; i++) {
        uint32_t want = 0;
        int s = ddp__ck_stored_crc(&h, h.e[i].name, &want);
        const unsigned char *d = buf + 8 + hlen + h.e[i].begin;
        if (s < 0) r = ddp__fail_to(err, DDP_ERR_FORMAT, "checksum of tensor \"%.64s\" is not 8 hex digits", h.e[i].name);
        else if (s > 0 && ddp__ck_crc32c(d, (size_t)(h.e[i].end - h.e[i].begin), 1) != want)
            r = ddp__fail_to(err, DDP_ERR_FORMAT, "tensor \"%.64s\": checksum mismatch", h.e[i].name);
    }
    ddp__ck_header_free(&h);
    return r;
}

/* ---- writer ---- */

/* Concatenate a and b into a new string. */
static char *ddp__ck_cat(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = (char *)ddp__malloc(na + nb + 1);
    if (!s) return NULL;
    memcpy(s, a, na);
    memcpy(s + na, b, nb + 1);
    return s;
}

static void ddp__ck_put(ddp__ck_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        char *p;
        while (cap < b->len + n + 1) cap *= 2;
        p = (char *)DDP_REALLOC(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void ddp__ck_puts(ddp__ck_buf *b, const char *s) { ddp__ck_put(b, s, strlen(s)); }

/* A JSON string; s is valid UTF-8 (checked by the caller), so only quotes, backslashes and control
   characters need escapes. */
static void ddp__ck_put_json(ddp__ck_buf *b, const char *s) {
    const char *run = s;
    ddp__ck_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        ddp__ck_put(b, run, (size_t)(s - run));
        if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
        else snprintf(esc, sizeof esc, "\\u%04x", c);
        ddp__ck_puts(b, esc);
        run = s + 1;
    }
    ddp__ck_put(b, run, (size_t)(s - run));
    ddp__ck_put(b, "\"", 1);
}

static void ddp__ck_put_kv(ddp__ck_buf *b, int *first, const char *key, const char *value) {
    if (!*first) ddp__ck_put(b, ",", 1);
    *first = 0;
    ddp__ck_put_json(b, key);
    ddp__ck_put(b, ":", 1);
    ddp__ck_put_json(b, value);
}

/* Bytes of tensor t, refusing overflow. */
static int ddp__ck_tensor_bytes(const ddp_tensor *t, uint64_t *bytes) {
    uint64_t dims[8];
    int i;
    if (t->ndim < 0 || t->ndim > 8 || !ddp__dtype_valid(t->dtype)) return 0;
    for (i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) return 0;
        dims[i] = (uint64_t)t->shape[i];
    }
    return ddp__ck_shape_bytes(dims, t->ndim, ddp_dtype_size(t->dtype), bytes) && *bytes <= (uint64_t)SIZE_MAX;
}

static int ddp__ck_reserved(const char *key) {
    return strncmp(key, DDP__CK_CRC_PREFIX, strlen(DDP__CK_CRC_PREFIX)) == 0 ||
           strncmp(key, DDP__CK_SHARD_PREFIX, strlen(DDP__CK_SHARD_PREFIX)) == 0;
}

/* The JSON header: user metadata, the library's keys (extra), a checksum per tensor, then the tensor
   entries in t[] order with their data back to back; padded with spaces to a multiple of 8. path is for
   messages; on error err (DDP__ERR_MAX bytes) says what is wrong. */
static ddp_result ddp__ck_build_header(const char *path, const ddp_tensor *t, int n, const ddp_meta *user, const ddp_meta *extra,
                                       ddp__ck_buf *b, char *err) {
    uint64_t at = 0;
    int i, first = 1;
    char num[64];
    for (i = 0; user && i < user->count; i++)
        if (ddp__ck_reserved(user->entries[i].key))
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "checkpoint save of %s: metadata key \"%.64s\" is reserved (ddp.crc32c.* and ddp.shard.* are the library's)",
                             path, user->entries[i].key);
    ddp__ck_puts(b, "{\"__metadata__\":{");
    for (i = 0; user && i < user->count; i++) ddp__ck_put_kv(b, &first, user->entries[i].key, user->entries[i].value);
    for (i = 0; extra && i < extra->count; i++) ddp__ck_put_kv(b, &first, extra->entries[i].key, extra->entries[i].value);
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        char *key = ddp__ck_cat(DDP__CK_CRC_PREFIX, t[i].name);
        if (!key) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
        ddp__ck_tensor_bytes(&t[i], &bytes);
        snprintf(num, sizeof num, "%08x", (unsigned)ddp__ck_crc32c(t[i].data, (size_t)bytes, 1));
        ddp__ck_put_kv(b, &first, key, num);
        ddp__free(key);
    }
    ddp__ck_puts(b, "}");
    for (i = 0; i < n; i++) {
        uint64_t bytes;
        int d;
        ddp__ck_tensor_bytes(&t[i], &bytes);
        ddp__ck_put(b, ",", 1);
        ddp__ck_put_json(b, t[i].name);
        ddp__ck_puts(b, ":{\"dtype\":\"");
        ddp__ck_puts(b, ddp__ck_st_name(t[i].dtype));
        ddp__ck_puts(b, "\",\"shape\":[");
        for (d = 0; d < t[i].ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)t[i].shape[d]);
            ddp__ck_puts(b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at, (unsigned long long)(at + bytes));
        ddp__ck_puts(b, num);
        at += bytes;
    }
    ddp__ck_puts(b, "}");
    while (!b->oom && (8 + b->len) % 8) ddp__ck_put(b, " ", 1);
    if (b->oom) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "checkpoint save of %s: out of memory building the header", path);
    return DDP_SUCCESS;
}
/* ==================== end src/safetensors.c ==================== */

/* ==================== begin src/checkpoint.c ==================== */
/* [SECTION] checkpoint: atomic save on rank 0, load everywhere or broadcast, shards, keep_last, latest
   Mirrors the PyTorch DDP checkpoint recipe (rank 0 torch.save + barrier; torch.load on every rank) with
   safetensors as the format (safetensors.c: CRC32C, the header parser and writer, ddp_meta). Layout of
   this file:
     files         argument checks, then tmp file -> fsync -> rename -> fsync(directory); reads at an
                   offset with the checksum computed on the way
     collectives   agreement on the outcome (every rank fails together), chunked broadcasts
     rotation      keep_last and ddp_checkpoint_latest: files that differ in one run of digits
     save, load    rank 0 writes; every rank reads, or rank 0 reads and broadcasts
     shards        one file per rank, then a completion marker written last */

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

/* One process writes one file: checks, header, atomic write. */
static ddp_result ddp__ck_write_file(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                     const ddp_meta *extra) {
    ddp__ck_buf hdr;
    char err[DDP__ERR_MAX];
    ddp_result r;
    memset(&hdr, 0, sizeof hdr);
    if (!ddp__ck_little_endian()) return ddp__fail(g, DDP_ERR_UNSUPPORTED, "checkpoint: safetensors is little-endian and this host is not");
    if (!path || !*path) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: path is NULL or empty");
    if ((r = ddp__ck_check_tensors(g, "checkpoint save", t, n)) != DDP_SUCCESS) return r;
    if ((r = ddp__ck_check_meta(g, path, meta)) != DDP_SUCCESS) return r;
    r = ddp__ck_build_header(path, t, n, meta, extra, &hdr, err);
    if (r != DDP_SUCCESS) ddp__fail(g, r, "%s", err);
    if (r == DDP_SUCCESS) r = ddp__ck_atomic_write(g, path, &hdr, t, n);
    ddp__free(hdr.p);
    return r;
}

/* ---- collectives ----
   Every collective entry point ends with ddp__ck_agree: the ranks exchange their outcome, so an error
   anywhere (rank 0 could not write, rank 3 could not read) is an error everywhere, carrying the
   failing rank's message; nobody is left waiting in a later collective. */

/* This rank's own failure, worded as the other ranks word it ("checkpoint save failed on rank 0: ..."),
   so that every rank's message names the operation and the rank that failed. */
static ddp_result ddp__ck_failed_here(ddp_group *g, ddp_result mine, const char *what, const char *own) {
    return ddp__fail(g, mine, "%s failed on rank %d: %.900s", what, ddp_rank(g), own);
}

static ddp_result ddp__ck_agree(ddp_group *g, ddp_result mine, const char *what) {
    int32_t code = (int32_t)mine, *codes;
    char *msgs, own[DDP__ERR_MAX];
    int w, i, bad = -1;
    ddp_result r;
    if (ddp_world_size(g) <= 1) return mine;
    w = ddp_world_size(g);
    memset(own, 0, sizeof own);
    if (mine != DDP_SUCCESS) snprintf(own, sizeof own, "%s", ddp_last_error(g));
    codes = (int32_t *)ddp__calloc((size_t)w, sizeof *codes);
    if (!codes) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory agreeing on the outcome", what);
    r = ddp_all_gather(g, &code, codes, 1, DDP_I32);
    for (i = 0; r == DDP_SUCCESS && i < w && bad < 0; i++)
        if (codes[i] != 0) bad = i;
    if (r != DDP_SUCCESS || bad < 0) {
        ddp__free(codes);
        /* this rank's own failure says more than a collective that broke after it */
        return (r != DDP_SUCCESS && mine != DDP_SUCCESS) ? ddp__ck_failed_here(g, mine, what, own) : r;
    }
    msgs = (char *)ddp__calloc((size_t)w, DDP__ERR_MAX);
    r = msgs ? ddp_all_gather(g, own, msgs, DDP__ERR_MAX, DDP_U8) : DDP_ERR_OUT_OF_MEMORY;
    if (mine != DDP_SUCCESS) r = ddp__ck_failed_here(g, mine, what, own);
    else if (r == DDP_SUCCESS) {
        msgs[(size_t)bad * DDP__ERR_MAX + DDP__ERR_MAX - 1] = '\0';
        r = ddp__fail(g, (ddp_result)codes[bad], "%s failed on rank %d: %s", what, bad, msgs + (size_t)bad * DDP__ERR_MAX);
    } else if (!msgs) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s failed on rank %d (out of memory fetching its message)", what, bad);
    ddp__free(msgs);
    ddp__free(codes);
    return r;
}

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
   A family is <dir>/<prefix><digits><suffix>; a member's number is its digits. keep_last keeps the K
   largest numbers; files with smaller numbers go, together with their ".tmp" leftovers (and, for
   shards, each rank's "<member>.rank<r>" files). */

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

/* Does name belong to the family, followed by exactly tail? Sets *number (at most 18 digits). */
static int ddp__ck_family_match(const ddp__ck_family *f, const char *name, const char *tail, int64_t *number) {
    size_t np = strlen(f->prefix), ns = strlen(f->suffix), nt = strlen(tail), len = strlen(name), k = 0;
    int64_t v = 0;
    if (strncmp(name, f->prefix, np) != 0) return 0;
    while (np + k < len && name[np + k] >= '0' && name[np + k] <= '9') {
        v = v * 10 + (name[np + k] - '0');
        if (++k > 18) return 0;
    }
    if (k == 0 || len != np + k + ns + nt) return 0;
    if (strncmp(name + np + k, f->suffix, ns) != 0 || strcmp(name + np + k + ns, tail) != 0) return 0;
    *number = v;
    return 1;
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

/* Delete the family's files whose number is below cutoff and whose name ends (after the suffix) in
   one of tails. Failures are logged, not returned: the new checkpoint is already safe. */
static void ddp__ck_delete_below(ddp_group *g, const ddp__ck_family *f, int64_t cutoff, const char *const *tails, int ntails) {
    DIR *d = opendir(f->dir);
    struct dirent *de;
    int deleted = 0;
    if (!d) {
        ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot list %s: %s", f->dir, strerror(errno));
        return;
    }
    while ((de = readdir(d)) != NULL) {
        int64_t num;
        int i;
        for (i = 0; i < ntails; i++) {
            char *full;
            if (!ddp__ck_family_match(f, de->d_name, tails[i], &num) || num >= cutoff) continue;
            full = ddp__ck_join(f->dir, de->d_name);
            if (full && unlink(full) == 0) deleted++;
            else ddp__log(g, DDP_LOG_WARN, "checkpoint keep_last: cannot delete %s: %s", full ? full : de->d_name, strerror(errno));
            ddp__free(full);
            break;
        }
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
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "checkpoint save: keep_last needs a number in the file name of %s (e.g. ckpt_000100.safetensors)", path);
    return DDP_SUCCESS;
}

/* ---- save ---- */

DDP_API ddp_result ddp_checkpoint_save_ex(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta,
                                          const ddp_checkpoint_save_desc *desc) {
    ddp_result r = DDP_SUCCESS;
    if (g && !ddp__live_has(g, DDP__LIVE_GROUP)) return ddp__group_check(g, "ddp_checkpoint_save_ex");
    if (ddp__ck_rank(g) == 0) {
        ddp__ck_family fam;
        int64_t number = 0;
        r = ddp__ck_check_rotation(g, path ? path : "", desc, &fam, &number);
        if (r == DDP_SUCCESS) r = ddp__ck_write_file(g, path, t, n, meta, NULL);
        if (r == DDP_SUCCESS && fam.dir) {
            static const char *const tails[] = {"", ".tmp"};
            int64_t cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
            if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
        }
        ddp__ck_family_free(&fam);
    }
    return ddp__ck_agree(g, r, "checkpoint save");
}

DDP_API ddp_result ddp_checkpoint_save(ddp_group *g, const char *path, const ddp_tensor *t, int n, const ddp_meta *meta) {
    return ddp_checkpoint_save_ex(g, path, t, n, meta, NULL);
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
    if (*fd < 0) return ddp__fail(g, DDP_ERR_IO, "checkpoint load: cannot open %s: %s", path, strerror(errno));
    if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        r = ddp__fail(g, DDP_ERR_IO, "checkpoint load: %s is not a regular file", path);
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
        if (k == 0 && !(d && d->allow_missing_checksums))
            return ddp__fail(g, DDP_ERR_FORMAT, "checkpoint %s: tensor \"%.64s\" has no " DDP__CK_CRC_PREFIX " checksum (a file from another writer? "
                             "set allow_missing_checksums to load it)", path, e->name);
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

/* Read t[i]'s data from the file and verify its checksum. */
static ddp_result ddp__ck_read_tensor(ddp_group *g, const char *path, int fd, uint64_t data_start, const ddp__ck_header *h,
                                      const ddp__ck_entry *e, void *dst) {
    uint64_t bytes = e->end - e->begin;
    uint32_t want, got = 0xFFFFFFFFu;
    ddp_result r = ddp__ck_read_at(g, fd, dst, bytes, data_start + e->begin, path, &got);
    if (r != DDP_SUCCESS) return r;
    got = ~got;
    if (ddp__ck_stored_crc(h, e->name, &want) <= 0) return DDP_SUCCESS;
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

/* What a shard must say about itself (load_shard); NULL for plain files. */
typedef struct ddp__ck_shard_expect {
    int rank, world;
    const char *save_id;
} ddp__ck_shard_expect;

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
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
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
        if (ddp__ck_stored_crc(&k.h, k.h.e[sel[2 * j]].name, &want) > 0 && ddp__ck_crc32c(to, (size_t)sel[2 * j + 1], 1) != want)
            mine = ddp__fail(g, DDP_ERR_FORMAT, "checkpoint load of %s: tensor \"%.64s\" arrived from rank 0 with a wrong checksum", path,
                             k.h.e[sel[2 * j]].name);
    }
    if (!root && mine == DDP_SUCCESS) mine = ddp__ck_copy_meta(g, &k.h, meta);
    r = ddp__ck_agree(g, mine, what);
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
    if (desc && desc->broadcast && ddp_world_size(g) > 1) return ddp__ck_load_bcast(g, path, t, n, meta, desc);
    return ddp__ck_agree(g, ddp__ck_load_local(g, path, t, n, meta, desc, NULL, NULL), "checkpoint load");
}

DDP_API ddp_result ddp_checkpoint_load(ddp_group *g, const char *path, ddp_tensor *t, int n, ddp_meta *meta) {
    return ddp_checkpoint_load_ex(g, path, t, n, meta, NULL);
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
     4. with keep_last, rank 0 broadcasts the cutoff and every rank deletes its own old shards */
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
    memset(&fam, 0, sizeof fam);
    memset(&extra, 0, sizeof extra);
    if (!path || !*path) r = ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: path is NULL or empty", what);
    else r = ddp__ck_check_rotation(g, path, desc, &fam, &number);
    if (r == DDP_SUCCESS && rank == 0) {
        id = ddp__ck_new_save_id();
        if (unlink(path) != 0 && errno != ENOENT) r = ddp__fail(g, DDP_ERR_IO, "%s: cannot remove the old completion marker %s: %s", what, path, strerror(errno));
        else r = ddp__ck_sync_dir(g, path);
    }
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &id, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    shard = ddp__ck_shard_path(path, rank);
    if (!shard || ddp__ck_shard_keys(&extra, rank, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    else r = ddp__ck_write_file(g, shard, t, n, meta, &extra);
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) goto done;
    if (rank == 0) {
        ddp_meta_free(&extra);
        if (ddp__ck_shard_keys(&extra, -1, world, id) != DDP_SUCCESS) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
        else r = ddp__ck_write_file(g, path, NULL, 0, NULL, &extra);
        if (r == DDP_SUCCESS && fam.dir) {
            static const char *const tails[] = {"", ".tmp"};
            cutoff = ddp__ck_cutoff(g, &fam, desc->keep_last, number);
            if (cutoff != INT64_MIN) ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
        }
    }
    if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS || !fam.dir) goto done;
    if (world > 1 && (r = ddp_broadcast(g, &cutoff, 1, DDP_I64, 0)) != DDP_SUCCESS) goto done;
    if (cutoff != INT64_MIN) {
        char own[32], own_tmp[40];
        const char *tails[2];
        snprintf(own, sizeof own, ".rank%d", rank);
        snprintf(own_tmp, sizeof own_tmp, ".rank%d.tmp", rank);
        tails[0] = own;
        tails[1] = own_tmp;
        ddp__ck_delete_below(g, &fam, cutoff, tails, 2);
    }
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
    if (!bcast || rank == 0) r = ddp__ck_read_marker(g, path, &info[0], &id);
    if (bcast) {
        info[1] = (int64_t)id;
        if ((r = ddp__ck_agree(g, r, what)) != DDP_SUCCESS) return r;
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
    return ddp__ck_agree(g, r, what);
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
/* ==================== end src/checkpoint.c ==================== */

#endif /* DDP_IMPLEMENTATION */

/*
------------------------------------------------------------------------------
ddp.h is available under the MIT License (the file LICENSE):

MIT License

Copyright (c) 2026 the ddp.h authors

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
------------------------------------------------------------------------------
*/
