/* ddp.h — DistributedDataParallel for C and CUDA training programs. MIT license (end of file's LICENSE).

   GENERATED from src/ by amalgamate.py: edit src/, then run `python3 amalgamate.py`.

   Do this:
       #define DDP_IMPLEMENTATION
   before you include this file in *one* C or C++ file to create the implementation.

       // in every file that uses it
       #include "ddp.h"
       // in exactly one file
       #define DDP_IMPLEMENTATION
       #include "ddp.h"

   Link with -pthread. Run the program under any launcher:
       ddprun --nproc-per-node 4 ./train       (tools/ddprun.c, torchrun-compatible flags)
       torchrun --standalone --nproc_per_node 4 --no_python ./train
       mpirun -np 4 ./train
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

   ENVIRONMENT
       RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT   (torchrun, ddprun)
       OMPI_COMM_WORLD_*, PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS      (mpirun, Hydra, srun)
       DDP_TIMEOUT       seconds before a blocked operation fails (default 300)
       DDP_LOG_LEVEL     none | error | warn | info | debug   (default warn)
       DDP_TRANSPORT     cpu backend transport: auto | tcp
       DDP_RESTART_COUNT set by ddprun --max-restarts (also TORCHELASTIC_RESTART_COUNT)

   INDEX (search for the [SECTION] markers)
   [SECTION] api: version, results, dtypes, ops, logging, groups, collectives, store, launch src/ddp_api.h
   [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces src/internal.h
   [SECTION] util: errors, logging, environment parsing, time, memory   src/util.c
   [SECTION] dtype: sizes and names, f16/bf16 conversion, element-wise reduction src/dtype.c
   [SECTION] net: TCP sockets with deadlines                            src/net.c
   [SECTION] store: rendezvous key-value store (c10d TCPStore protocol of torch 1.13), file store src/store.c
   [SECTION] transport: framed messages between the ranks of a group, failure detection, abort src/transport.c
   [SECTION] collectives: ring algorithms, the public collectives, async work and the progress thread src/collectives.c
   [SECTION] group: ddp_init (torch.distributed.init_process_group), launcher environments, src/group.c
*/

#ifndef DDP_H_INCLUDED
#define DDP_H_INCLUDED

#ifdef __cplusplus
extern "C" {
#endif

/* ==================== begin src/ddp_api.h ==================== */
/* [SECTION] api: version, results, dtypes, ops, logging, groups, collectives, store, launch */
/* The implementation uses POSIX and Linux calls (sockets, poll, fork, futex, mmap). Feature macros work
   only before the first system header, so the file that defines DDP_IMPLEMENTATION must include ddp.h
   before any system header (or be compiled with -D_GNU_SOURCE). */
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
   ddp_last_error(group), or ddp_last_error(NULL) for calls made without a group. */
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
    DDP_ERR_WORKER_FAILED = -12    /* ddp_spawn / ddprun: a worker process failed; the message says how */
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
   The master (rank 0's store) is init_method "tcp://host:port", else the descriptor's
   master_addr/master_port, else MASTER_ADDR/MASTER_PORT, else (under mpirun/srun on one host)
   127.0.0.1 with a port derived from the job id. Under SLURM, MASTER_ADDR defaults to the first host of
   SLURM_NODELIST. init_method "file:///path" puts the store in a file on a shared filesystem instead. */
typedef struct ddp_init_desc {
    const char *backend;     /* NULL or "auto": the default backend (cpu); "cpu", "nccl", "mpi" */
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

/* ddp_destroy: finish outstanding async work, say goodbye to the peers, free the group.
   Collective on the group (all ranks call it). Subgroups made from g must be destroyed first.
   Returns the first error met while finishing, but always frees. NULL is a no-op. */
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

/* The message of the last failed call on g (on this thread when g is NULL). Never NULL. */
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
   count is in elements; count 0 is allowed and still synchronises. In-place: pass the same pointer
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
/* Block until w is complete; return its result and release w (its message is then in
   ddp_last_error(group)). Call exactly once per handle. */
DDP_API ddp_result ddp_wait(ddp_work *w);
/* Nonzero when w is complete (ddp_wait will not block). Does not release w. */
DDP_API int ddp_test(ddp_work *w);

/* ---- Store (torch.distributed.TCPStore) ------------------------------------------------------
   The key-value store every group rendezvouses through; programs may use it for their own keys
   (keys starting with "ddp/" are the library's). Keys are C strings shorter than 4 KiB; values are
   bytes (zeros allowed), at most 64 MiB each. Over TCP it speaks torch 1.13's TCPStore protocol, so
   torch processes can share it. Blocking calls wait at most the store's timeout (the group's).
   Every failure leaves a message in ddp_store_last_error(s) naming the store, the key and what to do;
   DDP_ERR_TIMEOUT when the store did not answer or a key did not appear in time, DDP_ERR_PEER_LOST when
   the connection to the store dropped (the next call reconnects), DDP_ERR_INVALID_ARGUMENT for bad
   arguments. Thread safety: one thread at a time per store. */
DDP_API ddp_store *ddp_group_store(ddp_group *g);
/* Sets key to the size bytes at value (replacing any value; size 0 is allowed, value may then be NULL). */
DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size);
/* Waits until key exists (DDP_ERR_TIMEOUT after the store's timeout); copies at most capacity bytes to
   value; *size (when size is not NULL) = the value's full size, which may exceed capacity. */
DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
/* Adds delta to the integer stored at key (created as 0) and returns the new value in *result (when
   result is not NULL). Atomic across all clients. The value is kept as decimal text, as torch keeps it,
   so ddp_store_get on the key returns e.g. "42"; adding to a value that is not a number fails. */
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
   ddp_spawn: fork nprocs processes on this host; each runs fn(rank, nprocs, arg) with RANK,
   WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT set, so ddp_init(NULL)
   inside fn joins them. fn's return value is the process's exit code. When one fails (non-zero exit
   or signal), the others get SIGTERM, then SIGKILL after a grace period.
   Return: DDP_SUCCESS when every process exits 0, else DDP_ERR_WORKER_FAILED and
   ddp_last_error(NULL) names the rank and how it failed. Call from a single-threaded parent. */
DDP_API ddp_result ddp_spawn(int nprocs, int (*fn)(int rank, int world_size, void *arg), void *arg);

/* ddp_launcher_main: the whole of ddprun (tools/ddprun.c is a main() around it). `ddprun --help`
   lists the flags (torchrun's: --nproc-per-node, --nnodes, --node-rank, --master-addr,
   --master-port, --standalone, --max-restarts). Returns the exit code for main. */
DDP_API int ddp_launcher_main(int argc, char **argv);
/* ==================== end src/ddp_api.h ==================== */

/* ==================== begin src/reducer.h ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/reducer.h ==================== */

/* ==================== begin src/sampler.h ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/sampler.h ==================== */

/* ==================== begin src/syncbn.h ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/syncbn.h ==================== */

/* ==================== begin src/checkpoint.h ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/checkpoint.h ==================== */

/* ==================== begin src/cuda_api.h ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/cuda_api.h ==================== */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DDP_H_INCLUDED */

#if defined(DDP_IMPLEMENTATION) && !defined(DDP__IMPLEMENTATION_DONE)
#define DDP__IMPLEMENTATION_DONE

/* ==================== begin src/internal.h ==================== */
/* [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces
   Every private name starts with ddp__ and every private function is static: the implementation is
   one translation unit. It compiles as C99 and as C++17, so casts from void * are explicit. */

#if defined(__GLIBC__) && !defined(__USE_GNU)
#error "ddp.h: include ddp.h (with DDP_IMPLEMENTATION) before any system header, or compile with -D_GNU_SOURCE"
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
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

/* ---- dtype.c ---- */
static DDP__UNUSED int ddp__dtype_valid(ddp_dtype t);
static DDP__UNUSED int ddp__op_valid(ddp_op op);
static DDP__UNUSED int ddp__dtype_is_float(ddp_dtype t);
/* dst[i] = dst[i] (op) src[i] for i < count; AVG reduces as SUM (the caller divides once at the end). */
static DDP__UNUSED void ddp__reduce(void *dst, const void *src, size_t count, ddp_dtype t, ddp_op op);
/* buf[i] /= n, the final step of AVG (truncating toward zero on integers). */
static DDP__UNUSED void ddp__divide(void *buf, size_t count, ddp_dtype t, int n);

/* ---- the group (group.c creates it, transport.c and collectives.c use it) ---- */

/* One TCP connection to another member of the group. */
typedef struct ddp__peer {
    int fd;   /* -1 for this rank itself */
    int gone; /* the connection was seen closed */
    uint64_t send_owed; /* bytes of a frame interrupted mid-send (padded before an ABORT) */
} ddp__peer;

struct ddp_group {
    int rank, world_size;             /* this process in this group */
    int local_rank, local_world_size; /* among this group's ranks on this host */
    int *world_ranks;                 /* world_ranks[i]: member i's rank in the world group */
    double timeout;                   /* seconds a blocked operation waits */
    ddp_log_level log_level;
    ddp_log_fn log_fn;
    void *log_user;
    const char *backend_name;
    char error[DDP__ERR_MAX]; /* ddp_last_error(g) */

    ddp_store *store;        /* shared with subgroups; the world group owns it (NULL when alone) */
    int owns_store;
    struct ddp__store_server *store_server; /* rank 0 of the world group serves the store */
    char address[128];       /* this host's address that peers connect to */
    char prefix[96];         /* this group's store keys start with it */
    int joined_rendezvous;   /* counted in the rendezvous' "joined" key */
    ddp_group *parent;       /* NULL for the world group */
    int live_subgroups;      /* subgroups not yet destroyed */
    uint64_t subgroups_made; /* names the next subgroup's key prefix */

    ddp__peer *peers;   /* world_size entries, indexed by rank in this group */
    char (*peer_names)[80]; /* "host 10.0.0.2, pid 1234" for each rank, for messages */
    struct pollfd *pollfds; /* world_size entries: what one exchange step waits on */
    int *poll_owner;        /* the rank of each pollfds entry */
    uint64_t seq;       /* collectives issued so far; carried in every message */
    ddp_result broken;  /* set once a collective failed: every later call fails with it */
    char broken_msg[DDP__ERR_MAX];
    void *scratch;      /* staging memory for the algorithms, grown on demand */
    size_t scratch_size;

    /* async work: a FIFO run by one progress thread (collectives.c) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ddp_work *queue_head, *queue_tail;
    int progress_running, progress_stop;
    pthread_t progress;
};

/* ---- net.c: TCP with deadlines (absolute ddp__now() seconds); messages go to err ---- */
static DDP__UNUSED ddp_result ddp__net_listen(const char *host, int port, int *fd, int *bound_port, char *err);
static DDP__UNUSED ddp_result ddp__net_connect(const char *host, int port, double deadline, int *fd, char *err);
static DDP__UNUSED ddp_result ddp__net_accept(int listen_fd, double deadline, int *fd, char *err);
static DDP__UNUSED ddp_result ddp__net_send(int fd, const void *buf, size_t n, double deadline, char *err);
static DDP__UNUSED ddp_result ddp__net_recv(int fd, void *buf, size_t n, double deadline, char *err);
static DDP__UNUSED ddp_result ddp__net_poll(int fd, short events, double deadline, char *err);
static DDP__UNUSED void ddp__net_local_address(int fd, char *host, size_t cap);

/* ---- store.c: the rendezvous key-value store (c10d TCPStore protocol of torch 1.13; file store) ---- */
typedef struct ddp__store_server ddp__store_server;
/* Start serving on host:port (host as MASTER_ADDR; NULL = all interfaces; port 0 = any free port) on a
   background thread. Errors (port in use, address not on this host) come from ddp__net_listen with clear
   messages. lvl DDP_LOG_DEFAULT means DDP_LOG_LEVEL from the environment. */
static DDP__UNUSED ddp_result ddp__store_server_start(const char *host, int port, ddp_log_level lvl,
                                                      ddp__store_server **out, char *err);
static DDP__UNUSED int ddp__store_server_port(const ddp__store_server *s); /* the port it listens on */
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

static ddp_result ddp__fail(ddp_group *g, ddp_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ddp__vfail_to(ddp__error_buffer(g), code, fmt, ap);
    va_end(ap);
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

DDP_API const char *ddp_last_error(const ddp_group *g) { return g ? g->error : ddp__thread_error; }

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
/* ==================== end src/util.c ==================== */

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
   One loop per (type, op), written so that the compiler vectorises it. */

#define DDP__REDUCE_LOOP(T, EXPR)                      \
    do {                                               \
        T *d_ = (T *)dst;                              \
        const T *s_ = (const T *)src;                  \
        size_t i_;                                     \
        for (i_ = 0; i_ < count; i_++) {               \
            T a = d_[i_], b = s_[i_];                  \
            d_[i_] = (EXPR);                           \
        }                                              \
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
static ddp_result ddp__net_listen(const char *host, int port, int *fd_out, int *bound_port, char *err) {
    struct addrinfo *res = NULL, *ai;
    int fd = -1, saved = 0, one = 1;
    ddp_result r = ddp__net_resolve(host, port, 1, &res, err);
    if (r) return r;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) { saved = errno; continue; }
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 1024) == 0) break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
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

/* Connect to host:port, retrying with exponential backoff (10 ms .. 1 s) until the deadline while
   the other side is not listening yet: ranks start in any order. */
static ddp_result ddp__net_connect(const char *host, int port, double deadline, int *fd_out, char *err) {
    double backoff = 0.01;
    char last[128] = "no attempt";
    for (;;) {
        struct addrinfo *res = NULL, *ai;
        ddp_result r = ddp__net_resolve(host, port, 0, &res, err);
        if (r) return r;
        for (ai = res; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), soerr = 0;
            socklen_t len = sizeof soerr;
            if (fd < 0) continue;
            ddp__net_configure(fd);
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
                snprintf(last, sizeof last, "%s", strerror(errno));
                close(fd);
                continue;
            }
            if (ddp__net_poll(fd, POLLOUT, DDP__MIN(deadline, ddp__now() + 5.0), err) != DDP_SUCCESS) {
                snprintf(last, sizeof last, "connection attempt timed out");
                close(fd);
                continue;
            }
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
            if (soerr == 0) {
                freeaddrinfo(res);
                *fd_out = fd;
                return DDP_SUCCESS;
            }
            snprintf(last, sizeof last, "%s", strerror(soerr));
            close(fd);
        }
        freeaddrinfo(res);
        if (ddp__now() + backoff > deadline)
            return ddp__fail_to(err, DDP_ERR_TIMEOUT, "could not connect to %s:%d before the timeout (last error: %s)", host,
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

/* ==================== begin src/store.c ==================== */
/* [SECTION] store: rendezvous key-value store (c10d TCPStore protocol of torch 1.13), file store
   Mirrors torch.distributed.TCPStore (torch/csrc/distributed/c10d/TCPStore.cpp, torch 1.13) and
   torch.distributed.FileStore. Every group rendezvouses through one store: rank 0 serves it on a background
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

   Server: one thread, poll() over the listening socket, a self-pipe (stop) and every client. Each client has
   an input buffer (requests are parsed once complete, so a slow or hostile client never blocks the others),
   an output buffer (sent as the socket drains) and at most one pending WAIT: the keys still missing. A SET,
   ADD or COMPARE_SET that creates a key removes it from every pending WAIT (torch's server forgets
   COMPARE_SET here), and a WAIT left with no missing key gets its STOP_WAITING byte. A new WAIT from a
   client replaces its pending one (torch's server would keep both and later send a stray byte). Everything a client can make the server allocate is bounded (key length,
   value length, keys per WAIT/CHECK, and one budget for stored data plus buffers); a client that breaks a
   limit or the protocol is disconnected and logged, and the server goes on serving the others.

   Client: blocking calls on one connection, each bounded by the store's timeout. A call that fails midway
   (timeout, lost connection) leaves the stream in an unknown state, so the connection is closed and the next
   call connects again.

   File store (init_method "file:///path"): an append-only log of SET/DELETE records in one file on a shared
   filesystem, read and written under flock(). Each handle replays the records it has not seen yet into a
   hash table; get and wait poll the file with backoff until the deadline; add reads and appends under the
   exclusive lock, so it is atomic. Each opener adds 1 to a reference key and takes 1 off when it closes:
   the one that brings it to 0 deletes the file, as FileStore does, so every user must open it before any
   closes it (a rendezvous guarantees that). A file left by a crashed run still holds that run's keys: use a
   fresh path for each run, as with FileStore. The format is ddp.h's own. */

#define DDP__STORE_MAX_KEY ((size_t)4096)           /* bytes in one key, prefix included */
#define DDP__STORE_MAX_VALUE ((size_t)64 << 20)     /* bytes in one value */
#define DDP__STORE_MAX_WAIT_KEYS ((uint64_t)16384)  /* keys in one WAIT or CHECK */
#define DDP__STORE_MAX_HELD ((size_t)1 << 30)       /* server: stored keys and values plus every buffer */
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

/* ---- a hash table of byte-string keys and values (the server's data, a file store's replayed state) ---- */

typedef struct ddp__kv {
    struct ddp__kv *next;
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
    int ready;             /* requests may be waiting in `in` while replies pile up in `out` */
    char peer[80];         /* address:port, for the log */
    unsigned char *in;     /* received bytes not yet handled */
    size_t in_len, in_cap, need;
    unsigned char *out;    /* replies not yet sent: out[out_off .. out_len) */
    size_t out_off, out_len, out_cap;
    ddp__store_wait_key *waits; /* the pending WAIT's missing keys */
    size_t nwaits, wait_bytes;
    unsigned char *wait_blob;
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
    size_t buffers; /* bytes of connections, their buffers and pending waits */
    double accept_paused_until;
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

/* Stop serving c (it is closed at the end of the loop round); level WARN for clients that broke a limit or
   the protocol, DEBUG for ordinary disconnects. */
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...)
    DDP__PRINTF(4, 5);
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...) {
    char why[DDP__ERR_MAX / 2];
    va_list ap;
    if (c->dead) return;
    c->dead = 1;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ddp__srv_log(s, level, "disconnecting the client at %s: %s", c->peer, why);
}

static int ddp__srv_over_budget(const ddp__store_server *s, size_t more) {
    return s->kv.bytes + s->buffers + more > DDP__STORE_MAX_HELD;
}

/* Grow one of c's buffers to at least need bytes within the budget; on failure c is dropped and -1 returned. */
static int ddp__srv_grow(ddp__store_server *s, ddp__store_conn *c, unsigned char **buf, size_t *cap, size_t need) {
    size_t want = DDP__MAX(need, *cap + *cap / 2);
    void *p;
    if (need <= *cap) return 0;
    if (ddp__srv_over_budget(s, want - *cap)) want = need;
    if (ddp__srv_over_budget(s, want - *cap)) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "the store would hold more than %zu MiB of data and buffers",
                      DDP__STORE_MAX_HELD >> 20);
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

/* Queue a reply of two parts (b may be empty). */
static void ddp__srv_reply(ddp__store_server *s, ddp__store_conn *c, const void *a, size_t an, const void *b,
                           size_t bn) {
    if (c->dead) return;
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

/* Store value under key for client c, within the budget. */
static void ddp__srv_store(ddp__store_server *s, ddp__store_conn *c, const unsigned char *key, size_t klen,
                           const unsigned char *value, size_t vlen) {
    uint64_t h = ddp__store_hash(key, klen);
    ddp__kv *old = ddp__kv_find(&s->kv, key, klen, h);
    size_t before = old ? old->value_len : 0, after = old ? vlen : DDP__KV_ENTRY_BYTES(klen, vlen);
    unsigned char *copy;
    int created;
    char text[64];
    if (s->kv.bytes - before + after + s->buffers > DDP__STORE_MAX_HELD) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "setting key '%s' (%zu bytes) would make the store hold more than %zu MiB",
                      ddp__store_key_text(key, klen, text, sizeof text), vlen, DDP__STORE_MAX_HELD >> 20);
        return;
    }
    copy = ddp__store_dup(value, vlen);
    created = copy ? ddp__kv_put(&s->kv, key, klen, h, copy, vlen) : -1;
    if (created < 0) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "out of memory storing %zu bytes", vlen);
        return;
    }
    if (created) ddp__srv_wake(s, key, klen, h);
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
static int ddp__srv_parse(const unsigned char *p, size_t n, size_t *size, char *why, size_t why_cap) {
    ddp__rd r;
    int st = DDP__REQ_DONE;
    if (n < 1) {
        *size = 1;
        return DDP__REQ_MORE;
    }
    r.p = p;
    r.n = n;
    r.at = 1;
    switch (p[0]) {
    case DDP__Q_SET:
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
        st = ddp__srv_keys(&r, size, why, why_cap);
        break;
    case DDP__Q_GETNUMKEYS:
        break;
    case DDP__Q_WATCH_KEY:
        snprintf(why, why_cap, "it asked for watch_key (torch's experimental key callbacks), which ddp.h's store "
                               "does not serve");
        return DDP__REQ_BAD;
    default:
        snprintf(why, why_cap, "it sent the unknown query type 0x%02x (a torch 1.13 TCPStore client speaks "
                               "this protocol; newer torch clients and other programs do not)", p[0]);
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
        ddp__srv_drop(s, c, DDP_LOG_WARN, "its WAIT would make the store hold more than %zu MiB",
                      DDP__STORE_MAX_HELD >> 20);
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
    if (!kv || (kv->value_len == elen && memcmp(kv->value, e, elen) == 0)) ddp__srv_store(s, c, k, klen, d, dlen);
    kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    if (c->dead || !kv) return;
    len = kv->value_len;
    ddp__srv_reply(s, c, &len, 8, kv->value, kv->value_len);
}

/* ADD: the value is kept as decimal text, as torch keeps it; a value that is no number ends the client. */
static void ddp__srv_add(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen;
    const unsigned char *k = ddp__rd_str(r, &klen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    int64_t delta, old = 0, now;
    char text[32], name[64];
    int n;
    memcpy(&delta, r->p + r->at, 8);
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "it added to key '%s', whose value is not an integer",
                      ddp__store_key_text(k, klen, name, sizeof name));
        return;
    }
    now = (int64_t)((uint64_t)old + (uint64_t)delta); /* wraps, like torch's int64 sum in practice */
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    ddp__srv_store(s, c, k, klen, (const unsigned char *)text, (size_t)n);
    ddp__srv_reply(s, c, &now, 8, NULL, 0);
}

static void ddp__srv_handle(ddp__store_server *s, ddp__store_conn *c, const unsigned char *req, size_t size) {
    ddp__rd r;
    size_t klen, vlen;
    const unsigned char *k, *v;
    ddp__kv *kv;
    char name[64];
    r.p = req;
    r.n = size;
    r.at = 1;
    switch (req[0]) {
    case DDP__Q_SET:
        k = ddp__rd_str(&r, &klen);
        v = ddp__rd_str(&r, &vlen);
        ddp__srv_store(s, c, k, klen, v, vlen);
        break;
    case DDP__Q_COMPARE_SET: ddp__srv_compare_set(s, c, &r); break;
    case DDP__Q_ADD: ddp__srv_add(s, c, &r); break;
    case DDP__Q_GET:
        k = ddp__rd_str(&r, &klen);
        kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
        if (!kv) { /* torch's server drops such a client too: its get always waits for the key first */
            ddp__srv_drop(s, c, DDP_LOG_WARN, "it asked for key '%s', which does not exist (a get must WAIT first)",
                          ddp__store_key_text(k, klen, name, sizeof name));
            break;
        }
        vlen = kv->value_len;
        ddp__srv_reply(s, c, &vlen, 8, kv->value, kv->value_len);
        break;
    case DDP__Q_CHECK:
        ddp__srv_reply_byte(s, c, ddp__srv_have_all(s, &r, ddp__rd_u64(&r)) ? DDP__CHECK_READY : DDP__CHECK_NOT_READY);
        break;
    case DDP__Q_WAIT: ddp__srv_wait(s, c, &r); break;
    case DDP__Q_GETNUMKEYS: ddp__srv_reply_u64(s, c, (uint64_t)s->kv.count); break;
    case DDP__Q_DELETE_KEY:
        k = ddp__rd_str(&r, &klen);
        ddp__srv_reply_u64(s, c, (uint64_t)ddp__kv_remove(&s->kv, k, klen, ddp__store_hash(k, klen)));
        break;
    }
}

/* Handle every complete request in c's input, while its replies do not pile up. */
static void ddp__srv_process(ddp__store_server *s, ddp__store_conn *c) {
    size_t pos = 0, size = 0;
    char why[256];
    c->ready = 0;
    while (!c->dead && pos < c->in_len) {
        int st;
        if (c->out_len - c->out_off >= DDP__STORE_OUT_HIGH) {
            c->ready = 1;
            break;
        }
        st = ddp__srv_parse(c->in + pos, c->in_len - pos, &size, why, sizeof why);
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
        if (k == 0) {
            ddp__srv_drop(s, c, DDP_LOG_DEBUG, "it closed the connection");
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

static void ddp__srv_free_conn(ddp__store_server *s, ddp__store_conn *c) {
    ddp__srv_clear_wait(s, c);
    s->buffers -= c->in_cap + c->out_cap + sizeof *c;
    DDP_FREE(c->in);
    DDP_FREE(c->out);
    close(c->fd);
    ddp__free(c);
}

static void ddp__srv_accept(ddp__store_server *s) {
    char err[DDP__ERR_MAX], host[64] = "?", serv[16] = "?";
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    ddp__store_conn *c;
    int fd = -1;
    ddp_result r = ddp__net_accept(s->listen_fd, ddp__now() + 0.01, &fd, err);
    if (r == DDP_ERR_TIMEOUT) return; /* the client gave up between poll and accept */
    if (r != DDP_SUCCESS) {           /* out of file descriptors, most likely: let some close first */
        ddp__srv_log(s, DDP_LOG_WARN, "cannot accept a client (%s); not accepting for 0.1 s", err);
        s->accept_paused_until = ddp__now() + 0.1;
        return;
    }
    if (s->nconns == s->cap_conns) {
        size_t cap = s->cap_conns ? s->cap_conns * 2 : 16;
        ddp__store_conn **p = (ddp__store_conn **)DDP_REALLOC(s->conns, cap * sizeof *p);
        if (!p) {
            close(fd);
            return;
        }
        s->conns = p;
        s->cap_conns = cap;
    }
    if (ddp__srv_over_budget(s, sizeof *c) || !(c = (ddp__store_conn *)ddp__calloc(1, sizeof *c))) {
        ddp__srv_log(s, DDP_LOG_WARN, "refusing a client: the store is at its memory budget");
        close(fd);
        return;
    }
    c->fd = fd;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) == 0)
        getnameinfo((struct sockaddr *)&ss, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->peer, sizeof c->peer, "%s:%s", host, serv);
    s->buffers += sizeof *c;
    s->conns[s->nconns++] = c;
    ddp__srv_log(s, DDP_LOG_DEBUG, "client %s connected", c->peer);
}

static void *ddp__srv_main(void *arg) {
    ddp__store_server *s = (ddp__store_server *)arg;
    struct pollfd *pf = NULL;
    size_t pf_cap = 0, i;
    for (;;) {
        size_t npolled = s->nconns;
        int timeout = -1, rc;
        double now = ddp__now();
        if (pf_cap < npolled + 2) {
            struct pollfd *p = (struct pollfd *)DDP_REALLOC(pf, (npolled + 2) * 2 * sizeof *pf);
            if (!p) {
                ddp__srv_log(s, DDP_LOG_ERROR, "out of memory for %zu clients; the store stops", npolled);
                break;
            }
            pf = p;
            pf_cap = (npolled + 2) * 2;
        }
        pf[0].fd = s->pipe_rd;
        pf[1].fd = now < s->accept_paused_until ? -1 : s->listen_fd;
        pf[0].events = pf[1].events = POLLIN;
        if (now < s->accept_paused_until) timeout = 100;
        for (i = 0; i < npolled; i++) {
            ddp__store_conn *c = s->conns[i];
            int piled = c->out_len - c->out_off >= DDP__STORE_OUT_HIGH;
            pf[i + 2].fd = c->fd;
            pf[i + 2].events = (short)((c->out_off < c->out_len ? POLLOUT : 0) | (piled ? 0 : POLLIN));
            if (c->ready && !piled) timeout = 0;
        }
        for (i = 0; i < npolled + 2; i++) pf[i].revents = 0;
        rc = poll(pf, (nfds_t)(npolled + 2), timeout);
        if (rc < 0 && errno != EINTR) {
            ddp__srv_log(s, DDP_LOG_ERROR, "poll failed (%s); the store stops", strerror(errno));
            break;
        }
        if (rc < 0) continue;
        if (pf[0].revents) break;
        for (i = 0; i < npolled; i++) {
            ddp__store_conn *c = s->conns[i];
            short re = pf[i + 2].revents;
            if (re & POLLOUT) ddp__srv_flush(s, c);
            if (re & (POLLIN | POLLHUP | POLLERR)) ddp__srv_read(s, c);
            if (!c->dead && (re || c->ready)) ddp__srv_process(s, c);
        }
        if (pf[1].revents & POLLIN) ddp__srv_accept(s);
        for (i = 0; i < s->nconns; i++)
            if (s->conns[i]->out_off < s->conns[i]->out_len) ddp__srv_flush(s, s->conns[i]);
        for (i = 0; i < s->nconns; i++) {
            if (!s->conns[i]->dead) continue;
            ddp__srv_free_conn(s, s->conns[i]);
            s->conns[i--] = s->conns[--s->nconns];
        }
    }
    for (i = 0; i < s->nconns; i++) /* replies already due still go out, as far as the sockets take them */
        if (!s->conns[i]->dead) ddp__srv_flush(s, s->conns[i]);
    DDP_FREE(pf);
    return NULL;
}

static void ddp__store_server_close(ddp__store_server *s) {
    size_t i;
    for (i = 0; i < s->nconns; i++) ddp__srv_free_conn(s, s->conns[i]);
    DDP_FREE(s->conns);
    ddp__kv_clear(&s->kv);
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
    s->listen_fd = s->pipe_rd = s->pipe_wr = -1;
    s->log_level = lvl == DDP_LOG_DEFAULT ? ddp__env_log_level() : lvl;
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
    size_t prefix_len;
    unsigned char *msg; /* the request being built */
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

static ddp_result ddp__tcp_connect(ddp_store *s, double deadline) {
    char why[DDP__ERR_MAX];
    ddp_result r;
    if (s->fd >= 0) return DDP_SUCCESS;
    r = ddp__net_connect(s->host, s->port, deadline, &s->fd, why);
    if (r == DDP_SUCCESS) return r;
    s->fd = -1;
    return ddp__store_fail(s, r, "cannot reach %s: %s; is rank 0 (which serves the store) running, and do "
                                 "MASTER_ADDR and MASTER_PORT name its host and a port it can listen on?",
                           s->where, why);
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

static void ddp__msg_begin(ddp_store *s, unsigned char type) {
    s->msg_len = 0;
    s->msg_oom = 0;
    ddp__msg_put(s, &type, 1);
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
                           "lost the connection to %s while %s (%s); did rank 0, which serves the store, exit?",
                           s->where, doing, why);
}

/* Connect if needed and send the request built in s->msg, then tail (a large value, sent without a copy).
   On failure the error is formatted (doing names the operation) and the connection dropped. */
static ddp_result ddp__tcp_send(ddp_store *s, const void *tail, size_t tail_n, double deadline, double seconds,
                                const char *doing) {
    char why[DDP__ERR_MAX];
    ddp_result r;
    if (s->msg_oom) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory %s in %s", doing, s->where);
    if ((r = ddp__tcp_connect(s, deadline)) != DDP_SUCCESS) return r;
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
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered %u to a WAIT (expected 0) while %s; is it a torch 1.13 "
                                                  "or ddp.h store?", s->where, reply, doing);
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
    snprintf(doing, sizeof doing, "setting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, size);
    return ddp__tcp_send(s, value, size, ddp__now() + s->timeout, s->timeout, doing);
}

static ddp_result ddp__tcp_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    int64_t v;
    ddp_result r;
    snprintf(doing, sizeof doing, "adding to key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_ADD);
    ddp__msg_key(s, key);
    ddp__msg_put(s, &delta, 8);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &v, 8, deadline, s->timeout, doing)) != DDP_SUCCESS) {
        if (r == DDP_ERR_PEER_LOST) /* the server drops a client that adds to a value that is no number */
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
    ddp__msg_begin(s, DDP__Q_COMPARE_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, expected_size);
    ddp__msg_put(s, expected, expected_size);
    ddp__msg_u64(s, desired_size);
    ddp__msg_put(s, desired, desired_size);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
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
    now = (int64_t)((uint64_t)old + (uint64_t)delta);
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

/* ==================== begin src/transport.c ==================== */
/* [SECTION] transport: framed messages between the ranks of a group, failure detection, abort
   Each pair of ranks shares one TCP connection (a full mesh, made by group.c). Everything sent is a
   frame: a fixed header, then `bytes` of payload.

       magic | kind | collective fingerprint (seq, coll, dtype, op, root, count) | sender | bytes | code

   The fingerprint is what makes cross-rank mistakes errors instead of hangs (PyTorch offers this only
   with TORCH_DISTRIBUTED_DEBUG=DETAIL): the receiver compares it with its own, and any difference is
   DDP_ERR_MISMATCH with both sides named.

   Failure handling. While a rank waits, it also watches every other connection of the group for a
   hang-up. When a rank fails a collective (mismatch, timeout, lost peer) it "breaks" the group: it sends
   an ABORT frame carrying the error to every peer and shuts its connections down. Every peer then sees
   the hang-up within milliseconds, reads the ABORT frame, and fails with the same code and message.
   A connection that closes without an ABORT frame means the process is gone: DDP_ERR_PEER_LOST.
   A graceful ddp_destroy sends BYE after a final barrier and waits for the peers' BYE before closing,
   so an orderly exit is never mistaken for a crash. */

#define DDP__FRAME_MAGIC 0x44445031u /* "DDP1" */
#define DDP__MAX_FRAME_BYTES ((uint64_t)1 << 40)

enum { DDP__FRAME_DATA = 1, DDP__FRAME_ABORT = 2, DDP__FRAME_BYE = 3 };

/* The fingerprint of one collective call; equal on every rank when the program is correct. */
typedef struct ddp__coll {
    uint64_t seq;   /* 1 for the group's first collective */
    uint64_t count; /* the call's count (per rank for all_gather / reduce_scatter) */
    uint8_t kind;   /* ddp__coll_kind */
    uint8_t dtype;
    uint8_t op;     /* DDP__NO_OP when the collective takes none */
    int32_t root;   /* -1 when the collective has none */
} ddp__coll;

typedef enum ddp__coll_kind {
    DDP__ALL_REDUCE = 1,
    DDP__BROADCAST,
    DDP__REDUCE,
    DDP__ALL_GATHER,
    DDP__REDUCE_SCATTER,
    DDP__BARRIER,
    DDP__COLL_KINDS
} ddp__coll_kind;
#define DDP__NO_OP 0xff

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
    static const char *names[] = {"?", "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier"};
    return (kind > 0 && kind < DDP__COLL_KINDS) ? names[kind] : "an unknown operation";
}

/* "all_reduce(count=1024, f32, sum) as collective #7" */
static void ddp__coll_describe(const ddp__coll *c, char *out, size_t cap) {
    char extra[48] = "";
    if (c->kind == DDP__BARRIER) {
        snprintf(out, cap, "barrier() as collective #%llu", (unsigned long long)c->seq);
        return;
    }
    if (c->op != DDP__NO_OP) snprintf(extra, sizeof extra, ", %s", ddp_op_name((ddp_op)c->op));
    if (c->root >= 0) snprintf(extra + strlen(extra), sizeof extra - strlen(extra), ", root=%d", (int)c->root);
    snprintf(out, cap, "%s(count=%llu, %s%s) as collective #%llu", ddp__coll_name(c->kind), (unsigned long long)c->count,
             ddp_dtype_name((ddp_dtype)c->dtype), extra, (unsigned long long)c->seq);
}

static int ddp__coll_equal(const ddp__coll *a, const ddp__frame *f) {
    return a->seq == f->seq && a->count == f->count && a->kind == f->coll && a->dtype == f->dtype && a->op == f->op &&
           a->root == f->root;
}

/* ---- breaking the group ---- */

/* Record the first error that breaks g, tell every peer (ABORT frame with the message) and shut the
   connections down so that peers waiting on anything notice at once. */
static ddp_result ddp__group_break(ddp_group *g, ddp_result code, const char *msg) {
    int i;
    if (g->broken) return g->broken;
    g->broken = code;
    snprintf(g->broken_msg, sizeof g->broken_msg, "%s", msg);
    ddp__log(g, DDP_LOG_ERROR, "%s", msg);
    for (i = 0; i < g->world_size; i++) {
        ddp__peer *p = &g->peers[i];
        ddp__frame f;
        char err[DDP__ERR_MAX];
        size_t len = strlen(msg) + 1;
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
            ddp__net_send(p->fd, msg, len, ddp__now() + 0.5, err);
        /* Half-close only: a full close with unread data would make the kernel send a reset, which
           throws away the ABORT frame queued at the peer before the peer reads it. */
        shutdown(p->fd, SHUT_WR);
    }
    return code;
}

/* Fail the current operation: break the group with this message and copy it to the caller's buffer. */
static ddp_result ddp__coll_fail(ddp_group *g, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
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
    ddp__peer *p = &g->peers[peer];
    char desc[160], err[DDP__ERR_MAX];
    double deadline = ddp__now() + 1.0;
    ddp__frame f;
    ddp__coll_describe(c, desc, sizeof desc);
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
            return ddp__coll_fail(g, (ddp_result)f.code, "%s (reported by rank %d; this rank was in %s)", reason, peer, desc);
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
                          peer, g->peer_names[peer], desc);
}

static ddp_result ddp__peer_failed(ddp_group *g, int peer, const ddp__coll *c) { return ddp__peer_failed_after(g, peer, c, NULL); }

/* ---- one step of an algorithm: send to one peer while receiving from another ---- */

/* Either side may be absent (peer -1). Sizes must agree with what the peer computes for the same
   step; the fingerprint makes sure both sides run the same collective. */
typedef struct ddp__step {
    int send_peer;
    const void *send_buf;
    size_t send_bytes;
    int recv_peer;
    void *recv_buf;
    size_t recv_bytes;
} ddp__step;

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

/* The header just received from `peer` is complete: is it the frame this step expects? */
static ddp_result ddp__check_frame(ddp_group *g, const ddp__coll *c, int peer, const ddp__frame *f, size_t expect) {
    char ours[160], theirs[160];
    if (f->magic != DDP__FRAME_MAGIC)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (bad magic 0x%08x): is something else "
                              "connected to this rank's port?", peer, (unsigned)f->magic);
    if (f->kind == DDP__FRAME_ABORT || f->kind == DDP__FRAME_BYE) return ddp__peer_failed_after(g, peer, c, f);
    if (f->kind != DDP__FRAME_DATA) return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (kind %d)", peer, f->kind);
    if (!ddp__coll_equal(c, f)) {
        ddp__coll t;
        t.seq = f->seq;
        t.count = f->count;
        t.kind = f->coll;
        t.dtype = f->dtype;
        t.op = f->op;
        t.root = f->root;
        ddp__coll_describe(c, ours, sizeof ours);
        ddp__coll_describe(&t, theirs, sizeof theirs);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                              "rank must call the same collectives in the same order with the same count, dtype, op and root",
                              peer, theirs, g->rank, ours);
    }
    if (f->bytes != expect)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "rank %d sent %llu bytes where %llu were expected in %s",
                              peer, (unsigned long long)f->bytes, (unsigned long long)expect, ddp__coll_name(c->kind));
    return DDP_SUCCESS;
}

static ddp_result ddp__exchange(ddp_group *g, const ddp__coll *c, const ddp__step *s) {
    ddp__frame out, in;
    size_t sent = 0, received = 0;          /* bytes of header + payload so far */
    size_t send_total = s->send_peer >= 0 ? sizeof out + s->send_bytes : 0;
    size_t recv_total = s->recv_peer >= 0 ? sizeof in + s->recv_bytes : 0;
    struct pollfd *fds = g->pollfds;
    int *owner = g->poll_owner;
    double deadline = ddp__now() + g->timeout;
    if (g->broken) return g->broken;
    if (s->send_peer >= 0) ddp__frame_init(&out, g, c, DDP__FRAME_DATA, s->send_bytes);
    while (sent < send_total || received < recv_total) {
        int n = 0, i, rc, progressed = 0;
        for (i = 0; i < g->world_size; i++) {
            short ev = POLLRDHUP;
            if (i == g->rank || g->peers[i].fd < 0) continue;
            if (i == s->send_peer && sent < send_total) ev |= POLLOUT;
            if (i == s->recv_peer && received < recv_total) ev |= POLLIN;
            fds[n].fd = g->peers[i].fd;
            fds[n].events = ev;
            fds[n].revents = 0;
            owner[n++] = i;
        }
        rc = poll(fds, (nfds_t)n, (int)DDP__MAX(1.0, DDP__MIN(1000.0, (deadline - ddp__now()) * 1000.0)));
        if (rc < 0 && errno != EINTR) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "poll failed: %s", strerror(errno));
        for (i = 0; i < n && rc > 0; i++) {
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
                        ddp_result r = ddp__check_frame(g, c, peer, &in, s->recv_bytes);
                        if (r) return r;
                    }
                }
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
                    g->peers[peer].send_owed = send_total - sent; /* header and payload still owed */
                }
                continue;
            }
            if (re & (POLLRDHUP | POLLHUP | POLLERR)) return ddp__peer_failed(g, peer, c);
        }
        if (progressed) {
            deadline = ddp__now() + g->timeout;
        } else if (ddp__now() > deadline) {
            char desc[160];
            int waiting_for = received < recv_total ? s->recv_peer : s->send_peer;
            ddp__coll_describe(c, desc, sizeof desc);
            return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s in %s waiting for rank %d (%s), which is alive "
                                  "but not taking part: is it stuck, stopped, or in a different collective? (DDP_TIMEOUT "
                                  "sets the limit)", g->timeout, desc, waiting_for, g->peer_names[waiting_for]);
        }
    }
    return DDP_SUCCESS;
}

/* ---- closing connections ---- */

/* Close every connection of a group that failed: half-close, then read until each peer closes too
   (at most `seconds` in all), so that the close never carries a reset that destroys the ABORT frame
   a slower peer has yet to read. */
static void ddp__close_after_failure(ddp_group *g, double seconds) {
    double deadline = ddp__now() + seconds;
    char sink[4096];
    int i;
    for (i = 0; i < g->world_size; i++)
        if (g->peers[i].fd >= 0) shutdown(g->peers[i].fd, SHUT_WR);
    for (i = 0; i < g->world_size; i++) {
        ddp__peer *p = &g->peers[i];
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
        close(p->fd);
        p->fd = -1;
    }
}

/* ---- graceful goodbye (ddp_destroy, after a final barrier) ---- */

/* Send BYE to every peer, then read each peer's BYE, so that no peer sees our close while it still
   waits on anything: it has already passed the same barrier. */
static void ddp__say_goodbye(ddp_group *g, double seconds) {
    ddp__coll none;
    ddp__frame f;
    char err[DDP__ERR_MAX];
    int i;
    double deadline = ddp__now() + seconds;
    memset(&none, 0, sizeof none);
    ddp__frame_init(&f, g, &none, DDP__FRAME_BYE, 0);
    for (i = 0; i < g->world_size; i++)
        if (g->peers[i].fd >= 0 && !g->peers[i].gone) ddp__net_send(g->peers[i].fd, &f, sizeof f, deadline, err);
    for (i = 0; i < g->world_size; i++) {
        ddp__frame in;
        if (g->peers[i].fd < 0 || g->peers[i].gone) continue;
        if (ddp__net_recv(g->peers[i].fd, &in, sizeof in, deadline, err) != DDP_SUCCESS || in.kind != DDP__FRAME_BYE)
            ddp__log(g, DDP_LOG_DEBUG, "rank %d did not say goodbye cleanly: %s", i, err);
    }
}
/* ==================== end src/transport.c ==================== */

/* ==================== begin src/collectives.c ==================== */
/* [SECTION] collectives: ring algorithms, the public collectives, async work and the progress thread
   (torch.distributed.all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier)

   Every algorithm is built from ring steps: in each step a rank sends to its right neighbour
   (rank + 1) and receives from its left (rank - 1) at the same time.

       rank 0 --> rank 1 --> rank 2 --> rank 3 --+
         ^                                       |
         +---------------------------------------+

   all_reduce = reduce-scatter then all-gather, with the buffer cut into n chunks. In the
   reduce-scatter, chunk c starts at rank c+1 and travels once around the ring, each rank adding its
   own part, and ends complete at rank c; the all-gather then passes each complete chunk around.
   Cost for N bytes on n ranks: 2(n-1) steps, each rank sending 2(n-1)/n * N bytes (bandwidth-optimal).

   Why a mismatch is an error on every rank: each rank checks the fingerprint of the first frame it
   gets from its left neighbour, and every algorithm here is shaped so that a rank cannot finish unless
   all but at most one neighbour pair have checked each other. If any rank differs, at least two
   neighbour pairs around the ring differ, so no rank finishes; the rank that saw the difference breaks
   the group and every rank fails with DDP_ERR_MISMATCH. Broadcast and reduce get the same guarantee
   from a final token pass (broadcast) and from the reduce-scatter that precedes the gather (reduce). */

static int ddp__mod(int a, int n) { return ((a % n) + n) % n; }

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

/* Ring reduce-scatter in place: afterwards chunk `rank` of buf is reduced over all ranks (op AVG is
   left as the sum). In step s, send chunk rank-s-1 and add the received chunk rank-s-2. */
static ddp_result ddp__ring_reduce_scatter(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t,
                                           ddp_op op) {
    int n = g->world_size, r = g->rank, s;
    size_t es = ddp_dtype_size(t), off, len, max_len = (count + (size_t)n - 1) / (size_t)n;
    char *tmp = (char *)ddp__scratch(g, max_len * es);
    if (!tmp && max_len) return ddp__no_memory(g, max_len * es);
    for (s = 0; s < n - 1; s++) {
        ddp__step st;
        size_t roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 2, n), &roff, &rlen);
        st.send_peer = ddp__mod(r + 1, n);
        st.send_buf = buf + off * es;
        st.send_bytes = len * es;
        st.recv_peer = ddp__mod(r - 1, n);
        st.recv_buf = tmp;
        st.recv_bytes = rlen * es;
        if ((res = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return res;
        ddp__reduce(buf + roff * es, tmp, rlen, t, op);
    }
    return DDP_SUCCESS;
}

/* Ring all-gather in place: chunk `rank` of buf is this rank's; afterwards every chunk is filled.
   In step s, send chunk rank-s and receive chunk rank-s-1 straight into place. */
static ddp_result ddp__ring_all_gather(ddp_group *g, const ddp__coll *c, char *buf, size_t count, size_t es) {
    int n = g->world_size, r = g->rank, s;
    for (s = 0; s < n - 1; s++) {
        ddp__step st;
        size_t off, len, roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &roff, &rlen);
        st.send_peer = ddp__mod(r + 1, n);
        st.send_buf = buf + off * es;
        st.send_bytes = len * es;
        st.recv_peer = ddp__mod(r - 1, n);
        st.recv_buf = buf + roff * es;
        st.recv_bytes = rlen * es;
        if ((res = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return res;
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

static ddp_result ddp__do_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_result r = ddp__ring_reduce_scatter(g, c, (char *)buf, count, t, op);
    if (r) return r;
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

/* Broadcast: a pipelined chain root -> root+1 -> ... -> root-1 in slices, so every link carries the
   data once and the slices overlap; then a token goes from the last rank through the root to the
   others, so that no rank finishes before every rank has checked its neighbour's fingerprint. */
#define DDP__BROADCAST_SLICE ((size_t)256 << 10)
static ddp_result ddp__do_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n);
    int left = ddp__mod(g->rank - 1, n), right = ddp__mod(g->rank + 1, n);
    size_t bytes = count * ddp_dtype_size(t), i;
    size_t slices = bytes ? (bytes + DDP__BROADCAST_SLICE - 1) / DDP__BROADCAST_SLICE : 1;
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

/* all_gather: place our part in recv, then ring all-gather with chunks of count_per_rank. */
static ddp_result ddp__do_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    size_t es = ddp_dtype_size(t);
    char *mine = (char *)recv + (size_t)g->rank * cpr * es;
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

/* barrier: a ring all-gather of nothing; each rank finishes only after hearing (through the ring)
   from every other rank. */
static ddp_result ddp__do_barrier(ddp_group *g, const ddp__coll *c) { return ddp__ring_all_gather(g, c, NULL, 0, 1); }

/* ---- one description of a call, for the synchronous path and the async queue alike ---- */

typedef struct ddp__call {
    ddp__coll_kind kind;
    const void *send;
    void *buf; /* in-place buffer, or recv */
    size_t count;
    ddp_dtype dtype;
    ddp_op op;
    int root;
} ddp__call;

struct ddp_work {
    ddp_group *g;
    ddp__call call;
    ddp__coll coll;
    ddp_result result;
    int done;
    char error[DDP__ERR_MAX];
    ddp_work *next;
};

/* A single rank has nobody to talk to: only the data movement of the collective remains. */
static void ddp__run_alone(const ddp__call *k) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    if ((k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) && bytes && k->send != k->buf)
        memmove(k->buf, k->send, bytes);
}

static ddp_result ddp__run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    if (g->broken) return DDP_ERR_STATE;
    if (g->world_size == 1) {
        ddp__run_alone(k);
        return DDP_SUCCESS;
    }
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__do_all_reduce(g, c, k->buf, k->count, k->dtype, k->op);
    case DDP__BROADCAST: return ddp__do_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__REDUCE: return ddp__do_reduce(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__ALL_GATHER: return ddp__do_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__do_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    case DDP__BARRIER: return ddp__do_barrier(g, c);
    default: return ddp__coll_fail(g, DDP_ERR_STATE, "internal error: unknown collective %d", (int)k->kind);
    }
}

/* Check a call's arguments on the caller's thread; a bad call never reaches the wire. */
static ddp_result ddp__validate(ddp_group *g, const ddp__call *k) {
    const char *name = ddp__coll_name(k->kind);
    size_t es, ranks;
    if (!g) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the group is NULL (did ddp_init succeed?)", name);
    if (k->kind == DDP__BARRIER) return DDP_SUCCESS;
    if (!ddp__dtype_valid(k->dtype))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype (DDP_F32 ... DDP_I64)", name, (int)k->dtype);
    if ((k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER) && !ddp__op_valid(k->op))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: op %d is not a ddp_op (DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX)",
                         name, (int)k->op);
    if ((k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE) && (k->root < 0 || k->root >= g->world_size))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of this group (world size %d)", name, k->root,
                         g->world_size);
    es = ddp_dtype_size(k->dtype);
    ranks = (k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) ? (size_t)g->world_size : 1;
    if (k->count > SIZE_MAX / es / ranks / 2)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: count %zu is too large", name, k->count);
    if (k->count && !k->buf)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the buffer is NULL with count %zu", name, k->count);
    if (k->count && (k->kind == DDP__ALL_GATHER || k->kind == DDP__REDUCE_SCATTER) && !k->send)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the send buffer is NULL with count %zu", name, k->count);
    return DDP_SUCCESS;
}

static void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c) {
    int takes_op = k->kind == DDP__ALL_REDUCE || k->kind == DDP__REDUCE || k->kind == DDP__REDUCE_SCATTER;
    c->seq = ++g->seq;
    c->kind = (uint8_t)k->kind;
    c->count = k->kind == DDP__BARRIER ? 0 : k->count;
    c->dtype = (uint8_t)(k->kind == DDP__BARRIER ? 0 : k->dtype);
    c->op = (uint8_t)(takes_op ? k->op : DDP__NO_OP);
    c->root = (k->kind == DDP__BROADCAST || k->kind == DDP__REDUCE) ? k->root : -1;
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
    pthread_mutex_lock(&g->mu);
    for (;;) {
        ddp_work *w;
        ddp_result r;
        while (!g->queue_head && !g->progress_stop) pthread_cond_wait(&g->cv, &g->mu);
        if (!g->queue_head) break;
        w = g->queue_head;
        pthread_mutex_unlock(&g->mu);
        if (g->broken) {
            r = DDP_ERR_STATE;
            ddp__broken_message(g, &w->call, w->error);
        } else if ((r = ddp__run(g, &w->call, &w->coll)) != DDP_SUCCESS) {
            snprintf(w->error, sizeof w->error, "%s", g->broken_msg);
        }
        pthread_mutex_lock(&g->mu);
        w->result = r;
        w->done = 1;
        g->queue_head = w->next; /* dequeued only when done: "queue empty" means "nothing in flight" */
        if (!g->queue_head) g->queue_tail = NULL;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* Wait until every queued async collective has finished (so a synchronous one runs after them). */
static void ddp__drain(ddp_group *g) {
    pthread_mutex_lock(&g->mu);
    while (g->queue_head) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

/* Stop the progress thread (group teardown); queued work is finished first. */
static void ddp__progress_stop(ddp_group *g) {
    if (!g->progress_running) return;
    pthread_mutex_lock(&g->mu);
    g->progress_stop = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->progress, NULL);
    g->progress_running = 0;
}

static ddp_result ddp__call_sync(ddp_group *g, const ddp__call *k) {
    char c_msg[DDP__ERR_MAX];
    ddp__coll c;
    ddp_result r = ddp__validate(g, k);
    if (r) return r;
    ddp__drain(g);
    if (g->broken) return ddp__fail_to(ddp__error_buffer(g), DDP_ERR_STATE, "%s", ddp__broken_message(g, k, c_msg));
    ddp__fingerprint(g, k, &c);
    r = ddp__run(g, k, &c);
    if (r) return ddp__fail(g, r, "%s", g->broken_msg);
    return DDP_SUCCESS;
}

static ddp_result ddp__call_async(ddp_group *g, const ddp__call *k, ddp_work **out) {
    ddp_work *w;
    ddp_result r;
    if (!out) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s_async: the ddp_work **out argument is NULL", ddp__coll_name(k->kind));
    *out = NULL;
    if ((r = ddp__validate(g, k)) != DDP_SUCCESS) return r;
    w = (ddp_work *)ddp__calloc(1, sizeof *w);
    if (!w) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory allocating a ddp_work");
    w->g = g;
    w->call = *k;
    pthread_mutex_lock(&g->mu);
    if (!g->progress_running) {
        if (pthread_create(&g->progress, NULL, ddp__progress_main, g) != 0) {
            pthread_mutex_unlock(&g->mu);
            ddp__free(w);
            return ddp__fail(g, DDP_ERR_SYSTEM, "could not start the progress thread: %s", strerror(errno));
        }
        g->progress_running = 1;
    }
    ddp__fingerprint(g, k, &w->coll); /* under the lock: seq order is issue order */
    if (g->queue_tail)
        g->queue_tail->next = w;
    else
        g->queue_head = w;
    g->queue_tail = w;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    *out = w;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_wait(ddp_work *w) {
    ddp_group *g;
    ddp_result r;
    if (!w) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_wait: the work handle is NULL");
    g = w->g;
    pthread_mutex_lock(&g->mu);
    while (!w->done) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    r = w->result;
    if (r) ddp__fail(g, r, "%s", w->error);
    ddp__free(w);
    return r;
}

DDP_API int ddp_test(ddp_work *w) {
    int done;
    if (!w) return 1;
    pthread_mutex_lock(&w->g->mu);
    done = w->done;
    pthread_mutex_unlock(&w->g->mu);
    return done;
}

/* ---- the public collectives: describe the call, then run it now or queue it ---- */

static ddp__call ddp__make_call(ddp__coll_kind kind, const void *send, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                int root) {
    ddp__call k;
    k.kind = kind;
    k.send = send;
    k.buf = buf;
    k.count = count;
    k.dtype = t;
    k.op = op;
    k.root = root;
    return k;
}

DDP_API ddp_result ddp_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__call_sync(g, &k);
}
DDP_API ddp_result ddp_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__call_sync(g, &k);
}
DDP_API ddp_result ddp_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__call_sync(g, &k);
}
DDP_API ddp_result ddp_all_gather(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__call_sync(g, &k);
}
DDP_API ddp_result ddp_reduce_scatter(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                      ddp_op op) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__call_sync(g, &k);
}
DDP_API ddp_result ddp_barrier(ddp_group *g) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__call_sync(g, &k);
}

DDP_API ddp_result ddp_all_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__call_async(g, &k, w);
}
DDP_API ddp_result ddp_broadcast_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__call_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_async(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op, int root, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE, NULL, buf, count, t, op, root);
    return ddp__call_async(g, &k, w);
}
DDP_API ddp_result ddp_all_gather_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                        ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count_per_rank, t, DDP_SUM, -1);
    return ddp__call_async(g, &k, w);
}
DDP_API ddp_result ddp_reduce_scatter_async(ddp_group *g, const void *send, void *recv, size_t count_per_rank, ddp_dtype t,
                                            ddp_op op, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__REDUCE_SCATTER, send, recv, count_per_rank, t, op, -1);
    return ddp__call_async(g, &k, w);
}
DDP_API ddp_result ddp_barrier_async(ddp_group *g, ddp_work **w) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__call_async(g, &k, w);
}
/* ==================== end src/collectives.c ==================== */

/* ==================== begin src/group.c ==================== */
/* [SECTION] group: ddp_init (torch.distributed.init_process_group), launcher environments,
   rendezvous, the mesh of connections, subgroups (new_group), ddp_destroy

   ddp_init in five steps:
     1. who am I: rank and world size from the descriptor or the launcher's environment
        (ddp__read_launch: torchrun/ddprun, Open MPI, MPICH/Hydra, SLURM, in that order);
     2. where is the master: init_method, descriptor, MASTER_ADDR/MASTER_PORT, launcher defaults;
     3. the store: rank 0 serves it (store.c) and every rank connects (or a file store);
     4. rendezvous (ddp__rendezvous): each rank claims its rank, publishes "world size, address, port,
        pid, host" and waits for all; any disagreement is written to an "abort" key that every waiting
        rank reads, so a bad rank fails everyone quickly instead of leaving them to time out;
     5. the mesh: one TCP connection per pair of ranks, then a barrier over it. */

#define DDP__HELLO_MAGIC 0x48444450u /* "PDDH": first words on a mesh connection */

typedef struct ddp__launch {
    int rank, world_size;
    int local_rank, local_world_size; /* -1 when the launcher did not say */
    const char *source;               /* where rank and world size came from, for messages */
    char master_addr[256];
    int master_port;                  /* 0: none given */
    const char *file_path;            /* init_method file:// */
    int restart_count;
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

static uint64_t ddp__hash(const char *s) { /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

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
        L->master_port = id[0] ? 20000 + (int)(ddp__hash(id) % 20000u) : 29500;
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
    if (index >= 0) snprintf(out, cap, "%s%s/%d", g->prefix, name, index);
    else snprintf(out, cap, "%s%s", g->prefix, name);
}

/* Fail this rank with code and message, and publish them so that every rank of the rendezvous fails too. */
static ddp_result ddp__rdzv_abort(ddp_group *g, ddp_result code, const char *msg) {
    char key[256], value[DDP__ERR_MAX + 16];
    int exists = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(value, sizeof value, "%d|%.1000s", (int)code, msg);
    ddp_store_set(g->store, key, value, strlen(value));
    ddp_store_check(g->store, key, &exists); /* a round trip: the set has reached the store before we go */
    return ddp__fail(g, code, "%s", msg);
}

/* A rendezvous failed on this rank: publish the error (unless another rank already published one),
   and if this rank serves the store, keep serving until the ranks that joined have read it (at most
   a few seconds), so that they fail with the reason instead of "lost the store". */
static void ddp__rdzv_fail_all(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0;
    int64_t joined = 0, seen = 0;
    double until = ddp__now() + DDP__MIN(g->timeout, 5.0);
    if (!g->store) return;
    snprintf(msg, sizeof msg, "%s", g->error);
    ddp__key(g, key, sizeof key, "abort", -1);
    if (ddp_store_check(g->store, key, &exists) != DDP_SUCCESS) return;
    if (!exists) ddp__rdzv_abort(g, code, msg);
    ddp__fail(g, code, "%s", msg);
    ddp__key(g, key, sizeof key, "abort_seen", -1);
    if (!g->store_server) { /* done with the store: the rank serving it may stop waiting for us */
        if (g->joined_rendezvous) ddp_store_add(g->store, key, 1, &seen);
        return;
    }
    ddp__key(g, key, sizeof key, "joined", -1);
    if (ddp_store_add(g->store, key, 0, &joined) != DDP_SUCCESS) return;
    ddp__key(g, key, sizeof key, "abort_seen", -1);
    while (ddp__now() < until && ddp_store_add(g->store, key, 0, &seen) == DDP_SUCCESS && seen < joined - 1) ddp__sleep(0.01);
    ddp__fail(g, code, "%s", msg);
}

/* Another rank published an abort: fail with its code and message. */
static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted) {
    char key[256], value[DDP__ERR_MAX + 16];
    size_t n = 0;
    int exists = 0, code = DDP_ERR_INIT;
    ddp_result r;
    *aborted = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    if ((r = ddp_store_check(g->store, key, &exists)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->store));
    if (!exists) return DDP_SUCCESS;
    *aborted = 1;
    if ((r = ddp_store_get(g->store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->store));
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    sscanf(value, "%d|", &code);
    return ddp__fail(g, (ddp_result)code, "%s", strchr(value, '|') ? strchr(value, '|') + 1 : value);
}

/* What each rank publishes about itself. */
typedef struct ddp__record {
    int world, port, pid;
    char addr[128], host[128];
} ddp__record;

/* Wait until `world_size` ranks have joined, watching for an abort; name the missing ranks on timeout. */
static ddp_result ddp__rdzv_wait_all(ddp_group *g, const char *where) {
    char key[256];
    double start = ddp__now(), nap = 0.001;
    int aborted;
    for (;;) {
        int64_t joined = 0;
        ddp_result r;
        if ((r = ddp__rdzv_check_abort(g, &aborted)) != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
        ddp__key(g, key, sizeof key, "joined", -1);
        if ((r = ddp_store_add(g->store, key, 0, &joined)) != DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->store));
        if (joined >= g->world_size) return DDP_SUCCESS;
        if (ddp__now() - start > g->timeout) {
            char missing[512] = "";
            int i, exists, shown = 0;
            for (i = 0; i < g->world_size && shown < 16; i++) {
                ddp__key(g, key, sizeof key, "rank", i);
                if (ddp_store_check(g->store, key, &exists) == DDP_SUCCESS && !exists) {
                    snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown ? ", " : "", i);
                    shown++;
                }
            }
            return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for every rank to join (%lld of %d "
                             "joined through %s; missing: %s). Are they all started, with the same world size and master?",
                             g->timeout, (long long)joined, g->world_size, where, missing[0] ? missing : "?");
        }
        ddp__sleep(nap);
        nap = DDP__MIN(nap * 2, 0.05);
    }
}

/* Mesh: rank j connects to every rank i < j and says hello; rank i accepts the higher ranks. */
typedef struct ddp__hello {
    uint32_t magic;
    int32_t rank, world;
    uint32_t pad;
    uint64_t group; /* hash of the group's store prefix: a stray connection from another group is refused */
} ddp__hello;

static ddp_result ddp__mesh_connect(ddp_group *g, const ddp__record *rec, int listen_fd) {
    char err[DDP__ERR_MAX];
    double deadline = ddp__now() + g->timeout;
    int i, accepted = 0;
    ddp__hello me;
    ddp_result r;
    memset(&me, 0, sizeof me);
    me.magic = DDP__HELLO_MAGIC;
    me.rank = g->rank;
    me.world = g->world_size;
    me.group = ddp__hash(g->prefix);
    for (i = 0; i < g->rank; i++) {
        if ((r = ddp__net_connect(rec[i].addr, rec[i].port, deadline, &g->peers[i].fd, err)) != DDP_SUCCESS ||
            (r = ddp__net_send(g->peers[i].fd, &me, sizeof me, deadline, err)) != DDP_SUCCESS)
            return ddp__fail(g, r, "connecting to rank %d at %s:%d: %s", i, rec[i].addr, rec[i].port, err);
    }
    while (accepted < g->world_size - 1 - g->rank) {
        ddp__hello h;
        int fd;
        if ((r = ddp__net_accept(listen_fd, deadline, &fd, err)) != DDP_SUCCESS)
            return ddp__fail(g, r, "waiting for ranks above %d to connect: %s", g->rank, err);
        if (ddp__net_recv(fd, &h, sizeof h, DDP__MIN(deadline, ddp__now() + 10.0), err) != DDP_SUCCESS ||
            h.magic != DDP__HELLO_MAGIC || h.world != g->world_size || h.group != me.group || h.rank <= g->rank ||
            h.rank >= g->world_size || g->peers[h.rank].fd >= 0) {
            ddp__log(g, DDP_LOG_WARN, "refused a connection that is not a rank of this group");
            close(fd);
            continue;
        }
        g->peers[h.rank].fd = fd;
        accepted++;
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__rendezvous(ddp_group *g, const char *addr, int listen_fd, int port, const char *where) {
    char key[256], value[512], msg[DDP__ERR_MAX], host[128];
    ddp__record *rec;
    int64_t claims = 0;
    int i, same_host = 0, local_index = 0;
    size_t n;
    ddp_result r;

    /* claim the rank: a second process with the same rank sees a count above 1 */
    ddp__key(g, key, sizeof key, "claim", g->rank);
    if ((r = ddp_store_add(g->store, key, 1, &claims)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->store));
    if (claims > 1) {
        snprintf(msg, sizeof msg, "two processes claim rank %d (the second is pid %d); every process needs its own rank "
                 "(check RANK or the launcher's settings)", g->rank, (int)getpid());
        return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    }
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(value, sizeof value, "world=%d port=%d pid=%d addr=%s host=%s", g->world_size, port, (int)getpid(), addr, host);
    ddp__key(g, key, sizeof key, "rank", g->rank);
    if ((r = ddp_store_set(g->store, key, value, strlen(value))) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->store));
    ddp__key(g, key, sizeof key, "joined", -1);
    if ((r = ddp_store_add(g->store, key, 1, &claims)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->store));
    g->joined_rendezvous = 1;
    if ((r = ddp__rdzv_wait_all(g, where)) != DDP_SUCCESS) return r;

    rec = (ddp__record *)ddp__calloc((size_t)g->world_size, sizeof *rec);
    if (!rec) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    for (i = 0; i < g->world_size; i++) {
        ddp__key(g, key, sizeof key, "rank", i);
        if ((r = ddp_store_get(g->store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS) {
            ddp__free(rec);
            return ddp__fail(g, r, "rendezvous: reading rank %d's address: %s", i, ddp_store_last_error(g->store));
        }
        value[DDP__MIN(n, sizeof value - 1)] = '\0';
        if (sscanf(value, "world=%d port=%d pid=%d addr=%127s host=%127s", &rec[i].world, &rec[i].port, &rec[i].pid,
                   rec[i].addr, rec[i].host) != 5) {
            ddp__free(rec);
            snprintf(msg, sizeof msg, "rank %d published a malformed rendezvous record \"%.200s\" (another program using the same store?)", i, value);
            return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
        }
        if (rec[i].world != g->world_size) {
            snprintf(msg, sizeof msg, "ranks disagree on the world size: rank %d (host %s, pid %d) was started with world "
                     "size %d, rank %d with %d; start every rank with the same WORLD_SIZE", i, rec[i].host, rec[i].pid,
                     rec[i].world, g->rank, g->world_size);
            ddp__free(rec);
            return ddp__rdzv_abort(g, DDP_ERR_MISMATCH, msg);
        }
        snprintf(g->peer_names[i], sizeof g->peer_names[i], "host %.40s, pid %d", rec[i].host, rec[i].pid);
        if (strcmp(rec[i].host, host) == 0) {
            if (i < g->rank) local_index++;
            same_host++;
        }
    }
    if (g->local_rank < 0 || g->local_world_size < 0) {
        g->local_rank = local_index;
        g->local_world_size = same_host;
    }
    r = ddp__mesh_connect(g, rec, listen_fd);
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
    g->rank = rank;
    g->world_size = world_size;
    g->local_rank = g->local_world_size = -1;
    g->backend_name = "cpu";
    g->timeout = 300.0;
    g->peers = (ddp__peer *)ddp__calloc((size_t)world_size, sizeof *g->peers);
    g->peer_names = (char(*)[80])ddp__calloc((size_t)world_size, sizeof *g->peer_names);
    g->pollfds = (struct pollfd *)ddp__calloc((size_t)world_size, sizeof *g->pollfds);
    g->poll_owner = (int *)ddp__calloc((size_t)world_size, sizeof *g->poll_owner);
    g->world_ranks = (int *)ddp__calloc((size_t)world_size, sizeof *g->world_ranks);
    if (!g->peers || !g->peer_names || !g->pollfds || !g->poll_owner || !g->world_ranks) {
        ddp__free(g->peers);
        ddp__free(g->peer_names);
        ddp__free(g->pollfds);
        ddp__free(g->poll_owner);
        ddp__free(g->world_ranks);
        ddp__free(g);
        return NULL;
    }
    for (i = 0; i < world_size; i++) {
        g->peers[i].fd = -1;
        g->world_ranks[i] = i;
        snprintf(g->peer_names[i], sizeof g->peer_names[i], "rank %d", i);
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    return g;
}

/* Free everything g holds (connections closed without goodbye: for failed inits and after goodbye). */
static void ddp__group_free(ddp_group *g) {
    int i;
    ddp__progress_stop(g);
    if (g->broken) ddp__close_after_failure(g, 1.0);
    for (i = 0; i < g->world_size; i++)
        if (g->peers[i].fd >= 0) close(g->peers[i].fd);
    if (g->owns_store && g->store) ddp__store_free(g->store);
    if (g->store_server) ddp__store_server_stop(g->store_server);
    if (g->parent) g->parent->live_subgroups--;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    ddp__free(g->scratch);
    ddp__free(g->peers);
    ddp__free(g->peer_names);
    ddp__free(g->pollfds);
    ddp__free(g->poll_owner);
    ddp__free(g->world_ranks);
    ddp__free(g);
}

/* Rendezvous and connect a freshly allocated group whose store and prefix are set. */
static ddp_result ddp__group_connect(ddp_group *g, const char *where) {
    char err[DDP__ERR_MAX];
    int listen_fd = -1, port = 0, aborted = 0;
    ddp_result r;
    if ((r = ddp__net_listen(g->address, 0, &listen_fd, &port, err)) != DDP_SUCCESS)
        return ddp__fail(g, r, "cannot listen for peer connections on %s: %s", g->address, err);
    r = ddp__rendezvous(g, g->address, listen_fd, port, where);
    close(listen_fd);
    if (r) return r;
    if ((r = ddp_barrier(g)) != DDP_SUCCESS) return r;
    g->seq = 0; /* the user's first collective is #1 in messages */
    if ((r = ddp__rdzv_check_abort(g, &aborted)) != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_init(const ddp_init_desc *desc, ddp_group **out) {
    ddp_init_desc zero;
    ddp__launch L;
    ddp_group *g;
    char err[DDP__ERR_MAX], where[320];
    const char *transport = ddp__env("DDP_TRANSPORT");
    double timeout;
    ddp_result r;
    if (!out) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_init: the out argument is NULL");
    *out = NULL;
    if (!desc) {
        memset(&zero, 0, sizeof zero);
        desc = &zero;
    }
    if (desc->backend && *desc->backend && strcmp(desc->backend, "auto") != 0 && strcmp(desc->backend, "cpu") != 0) {
        if (strcmp(desc->backend, "nccl") == 0 || strcmp(desc->backend, "mpi") == 0)
            return ddp__fail(NULL, DDP_ERR_UNSUPPORTED, "backend \"%s\" is not available in this build: this build has the "
                             "cpu backend only; use backend \"cpu\" (or NULL for the default)", desc->backend);
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "backend \"%s\" is not one of auto, cpu, nccl, mpi", desc->backend);
    }
    if (transport && strcmp(transport, "auto") != 0 && strcmp(transport, "tcp") != 0)
        return ddp__fail(NULL, DDP_ERR_INIT, "DDP_TRANSPORT=\"%s\" is not one of auto, tcp", transport);
    if ((r = ddp__read_launch(desc, &L, err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "ddp_init: %s", err);
    timeout = ddp__read_timeout(desc, err, &r);
    if (r) return ddp__fail(NULL, r, "ddp_init: %s", err);

    g = ddp__group_alloc(L.rank, L.world_size);
    if (!g) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    g->timeout = timeout;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    g->local_rank = L.local_rank;
    g->local_world_size = L.local_world_size;
    snprintf(g->prefix, sizeof g->prefix, "ddp/%d/", L.restart_count);
    if (L.world_size == 1 && !L.file_path && !L.master_port) { /* alone: nothing to connect */
        g->local_rank = 0;
        g->local_world_size = 1;
        *out = g;
        return DDP_SUCCESS;
    }

    if (L.file_path) {
        snprintf(where, sizeof where, "the file store %s", L.file_path);
        r = ddp__store_open_file(L.file_path, timeout, &g->store, err);
        ddp__route_address(NULL, 0, g->address, sizeof g->address);
    } else {
        snprintf(where, sizeof where, "the store at %s:%d", L.master_addr, L.master_port);
        r = DDP_SUCCESS;
        if (L.rank == 0) r = ddp__store_server_start(L.master_addr, L.master_port, g->log_level, &g->store_server, err);
        if (r == DDP_SUCCESS) r = ddp__store_connect(L.master_addr, L.master_port, NULL, timeout, &g->store, err);
        ddp__route_address(L.master_addr, L.master_port, g->address, sizeof g->address);
    }
    if (r) {
        ddp__group_free(g);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, err);
    }
    g->owns_store = 1;
    ddp__log(g, DDP_LOG_INFO, "joining: rank %d of %d from %s, through %s", L.rank, L.world_size, L.source, where);
    if ((r = ddp__group_connect(g, where)) != DDP_SUCCESS) {
        ddp__rdzv_fail_all(g, r);
        ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, g->error);
        ddp__group_free(g);
        return r;
    }
    ddp__log(g, DDP_LOG_INFO, "joined: rank %d of %d (local rank %d of %d)", g->rank, g->world_size, g->local_rank,
             g->local_world_size);
    *out = g;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_destroy(ddp_group *g) {
    ddp_result r = DDP_SUCCESS;
    if (!g) return DDP_SUCCESS;
    if (g->live_subgroups > 0)
        return ddp__fail(g, DDP_ERR_STATE, "ddp_destroy: %d subgroup(s) made from this group are still alive; destroy them first",
                         g->live_subgroups);
    ddp__drain(g);
    if (g->world_size > 1 && !g->broken) {
        r = ddp_barrier(g); /* nobody closes a connection that a peer may still be waiting on */
        if (r) ddp__fail(NULL, r, "ddp_destroy: %s", g->error);
        else ddp__say_goodbye(g, DDP__MIN(g->timeout, 10.0));
    }
    ddp__group_free(g);
    return r;
}

DDP_API ddp_result ddp_new_group(ddp_group *g, const int *ranks, int n, ddp_group **out) {
    uint64_t mine = 0x9e3779b97f4a7c15ull, *all;
    char where[160];
    int i, j, me = -1, valid = ranks && n >= 1 && out;
    ddp_group *sub;
    ddp_result r;
    if (!g) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_new_group: the parent group is NULL");
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
    g->subgroups_made++;
    if (me < 0) return DDP_SUCCESS;
    if (!(sub = ddp__group_alloc(me, n))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_new_group: out of memory");
    for (i = 0; i < n; i++) sub->world_ranks[i] = g->world_ranks[ranks[i]];
    sub->timeout = g->timeout;
    sub->log_level = g->log_level;
    sub->log_fn = g->log_fn;
    sub->log_user = g->log_user;
    sub->store = g->store;
    memcpy(sub->address, g->address, sizeof sub->address);
    snprintf(sub->prefix, sizeof sub->prefix, "%.60ssub%llu/", g->prefix, (unsigned long long)g->subgroups_made);
    snprintf(where, sizeof where, "the parent group's store (subgroup %llu)", (unsigned long long)g->subgroups_made);
    if (n > 1 && (r = ddp__group_connect(sub, where)) != DDP_SUCCESS) {
        ddp__fail(g, r, "ddp_new_group: %s", sub->error);
        ddp__group_free(sub);
        return r;
    }
    if (n == 1) sub->local_rank = 0, sub->local_world_size = 1;
    sub->parent = g;
    g->live_subgroups++;
    *out = sub;
    return DDP_SUCCESS;
}

DDP_API int ddp_rank(const ddp_group *g) { return g ? g->rank : 0; }
DDP_API int ddp_world_size(const ddp_group *g) { return g ? g->world_size : 1; }
DDP_API int ddp_local_rank(const ddp_group *g) { return g ? g->local_rank : 0; }
DDP_API int ddp_local_world_size(const ddp_group *g) { return g ? g->local_world_size : 1; }
DDP_API const char *ddp_backend_name(const ddp_group *g) { return g ? g->backend_name : "none"; }
DDP_API double ddp_timeout(const ddp_group *g) { return g ? g->timeout : 0.0; }
DDP_API ddp_store *ddp_group_store(ddp_group *g) { return g ? g->store : NULL; }
/* ==================== end src/group.c ==================== */

/* ==================== begin src/launcher.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/launcher.c ==================== */

/* ==================== begin src/reducer.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/reducer.c ==================== */

/* ==================== begin src/sampler.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/sampler.c ==================== */

/* ==================== begin src/syncbn.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/syncbn.c ==================== */

/* ==================== begin src/checkpoint.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/checkpoint.c ==================== */

#endif /* DDP_IMPLEMENTATION */
