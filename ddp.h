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
   (keys starting with "ddp/" are the library's). Values are bytes. Blocking calls wait at most the
   group's timeout. Thread safety: one thread at a time per store. */
DDP_API ddp_store *ddp_group_store(ddp_group *g);
DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size);
/* Waits until key exists; copies at most capacity bytes to value; *size = the value's full size. */
DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
/* Adds delta to the integer stored at key (created as 0) and returns the new value in *result. */
DDP_API ddp_result ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result);
DDP_API ddp_result ddp_store_check(ddp_store *s, const char *key, int *exists);
DDP_API ddp_result ddp_store_wait(ddp_store *s, const char *const *keys, int n, double timeout_seconds);
DDP_API ddp_result ddp_store_delete(ddp_store *s, const char *key, int *deleted);
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

    ddp_store *store;        /* shared with subgroups; the world group owns it */
    int owns_store;
    char prefix[96];         /* this group's store keys start with it */
    ddp_group *parent;       /* NULL for the world group */
    int live_subgroups;      /* subgroups not yet destroyed */
    uint64_t subgroups_made; /* names the next subgroup's key prefix */

    ddp__peer *peers;   /* world_size entries, indexed by rank in this group */
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
/* placeholder: filled by its issue */
/* ==================== end src/store.c ==================== */

/* ==================== begin src/transport.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/transport.c ==================== */

/* ==================== begin src/collectives.c ==================== */
/* placeholder: filled by its issue */
/* ==================== end src/collectives.c ==================== */

/* ==================== begin src/group.c ==================== */
/* placeholder: filled by its issue */
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
