/* [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces
   Every private name starts with ddp__ and every private function is static: the implementation is
   one translation unit. It compiles as C99 and as C++17, so casts from void * are explicit. */
/* A piece compiled on its own (`cc -std=c99 -fsyntax-only -Isrc src/X.c`, as CI checks every piece) sees
   what it sees inside ddp.h: the whole public part, as the implementation. In ddp.h these lines are
   inert (DDP_IMPLEMENTATION is defined there, and amalgamate.py drops the local includes). */
#ifndef DDP_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif
#include "ddp_api.h"
#include "reducer.h"
#include "sampler.h"
#include "syncbn.h"
#include "checkpoint.h"
#include "cuda_api.h"

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
static DDP__UNUSED uint64_t ddp__hash(const char *s); /* FNV-1a of a string */
/* An error code that came from another process (an ABORT frame, the store): itself when it is one of
   ddp_result's errors, else fallback -- a corrupt or hostile 0 must never read as success. */
static DDP__UNUSED ddp_result ddp__peer_code(long code, ddp_result fallback);

/* ---- dtype.c ---- */
static DDP__UNUSED int ddp__dtype_valid(ddp_dtype t);
static DDP__UNUSED int ddp__op_valid(ddp_op op);
static DDP__UNUSED int ddp__dtype_is_float(ddp_dtype t);
/* dst[i] = dst[i] (op) src[i] for i < count; AVG reduces as SUM (the caller divides once at the end). */
static DDP__UNUSED void ddp__reduce(void *dst, const void *src, size_t count, ddp_dtype t, ddp_op op);
/* buf[i] /= n, the final step of AVG (truncating toward zero on integers). */
static DDP__UNUSED void ddp__divide(void *buf, size_t count, ddp_dtype t, int n);

typedef struct ddp__shm ddp__shm;

/* ---- the group (group.c creates it, transport.c and collectives.c use it) ---- */

/* One TCP connection to another member of the group. */
typedef struct ddp__peer {
    int fd;   /* -1 for this rank itself */
    int gone; /* the connection was seen closed */
    uint64_t send_owed; /* bytes of a frame interrupted mid-send (padded before an ABORT) */
    uint64_t quiet_run; /* transport.c: in run #quiet_run, the peer's waiting frame was looked at and is fine */
    int peek_later;     /* transport.c: only part of a frame header was there; look again shortly */
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
    ddp_group *parent;       /* NULL for the world group */
    int live_subgroups;      /* subgroups not yet destroyed */
    uint64_t subgroups_made; /* names the next subgroup's key prefix */

    ddp__peer *peers;   /* world_size entries, indexed by rank in this group */
    char (*peer_names)[80]; /* "host 10.0.0.2, pid 1234" for each rank, for messages */
    struct pollfd *pollfds; /* world_size entries: what one exchange step waits on */
    int *poll_owner;        /* the rank of each pollfds entry */
    uint64_t seq;       /* collectives issued so far; carried in every message */
    uint64_t running_seq; /* seq of the collective running now (0 between collectives) */
    int waiting_for;      /* the rank this one waits for in the current step, -1 if none (for messages) */
    uint64_t tcp_runs;    /* collectives run over TCP so far; unlike seq, never restarts (transport.c) */
    ddp_result broken;  /* set once a collective failed: every later call fails with it */
    char broken_msg[DDP__ERR_MAX];
    ddp_group *hier_host;    /* hier.c, a group spanning hosts: the ranks of this host (NULL if only this one) */
    ddp_group *hier_leaders; /* hier.c: the first rank of every host, on those ranks (else NULL) */
    int hier;                /* hier.c: large all_reduces run hierarchically (same on every rank) */
    struct ddp__shm *shm; /* shared-memory transport when every rank is on this host (shm.c), else NULL */
    struct ddp__mpi *mpi; /* the mpi backend's communicator (mpi.c); NULL on the cpu backend */
    struct ddp__nccl *nccl; /* the nccl backend's communicator (nccl.c); NULL on the other backends */
    void *scratch;      /* staging memory for the algorithms, grown on demand */
    size_t scratch_size;

    /* ddp_alloc / ddp_free (shm.c). Blocks in this rank's shared-memory arena are listed in g->shm;
       the rest (no shared memory, arena full) are heap blocks listed here. lib_lock guards both lists:
       a spin lock (0 = free), so a zero-filled group needs no set-up. */
    int lib_lock;
    struct ddp__heap_block *lib_heap;
    size_t lib_heap_n, lib_heap_cap;

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
