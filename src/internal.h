/* [SECTION] internal: includes, allocator hooks, private helpers and types shared by the pieces
   Every private name starts with ddp__ and every private function is static: the implementation is
   one translation unit. It compiles as C99 and as C++17, so casts from void * are explicit.

   THE LAYERS, bottom up: the one list of them (docs/ARCHITECTURE.md and the header's preamble point
   here). It is the order of the pieces in amalgamate.py's manifest, and `amalgamate.py --check` keeps
   it true: a piece calls only the pieces before it. A lower layer reaches up only through a slot that
   the upper one fills (a ddp__backend table, the set-up's hooks in ddp__mesh.setup, ddp_group.end_upper),
   never by name. This file declares every cross-file function and type, grouped by the piece that defines it.

       util, registry           errors, logging, environment, time; which groups and work handles are live
       dtype, alloc             element types, reduction, conversions; ddp_alloc's arenas and heap blocks
       crc32c                   CRC-32C of a buffer (checkpoints, fault tolerance's state transfer)
       net, auth, store         sockets with deadlines; DDP_AUTH_TOKEN; the rendezvous key-value store
       trace                    the flight recorder, and the names of collectives in every message
       timeline                 Chrome trace events (DDP_TIMELINE): collectives, reducer passes, saves, ranges
       ft_view                  fault tolerance's view change (FT.md 2.3), pure decisions with no I/O: the
                                coordinator, the quorum, the verdict, the next view, a member's answers
                                (ft_view.h holds its data; ft.c, above, carries its messages)
       link                     connections between ranks, made on first use; failures go up as codes
       transport                framed messages over the links, failure detection, breaking the group
                                (the backends' abort slots); ddp_init's set-up lends it hooks to ask the store
       devbuf, hostmem          device buffers staged through pinned host memory; the host backends'
                                memory slots (the reducer's buckets)
       collectives              the public collectives: validate, fingerprint, dispatch, async work, and
                                ddp__agree_outcome for the multi-step calls above
       backends                 each fills a ddp__backend table, the only way calls reach it:
         tcp                      ring, recursive-doubling, tree algorithms between ranks (also set-up)
         shm                      shared memory among the ranks of one host
         hier                     hierarchical all_reduce for groups that span hosts (its stage groups
                                  are group.c's)
         mpi, nccl                the MPI and NCCL libraries
       group                    ddp_init, rendezvous, the table of ranks, which backend a group gets,
                                subgroups, ddp_destroy
       ft (ft.c)                fault tolerance at run time: control connections between the members,
                                ddp_ft_begin / ddp_ft_commit, the view change (ft_view's decisions) and
                                each new view's data plane (a fresh group the program's handle adopts)
       launcher                 ddp_spawn, ddprun
       amp                      GradScaler's update, the inf/NaN check, a pass's gradient statistics
       reducer, zero_state      DistributedDataParallel's Reducer, ZeRO 1-3 (reducer_fsdp: FSDP units),
                                grad_stats (reducer_amp); built on the collectives
       sampler, syncbn          DistributedSampler; SyncBatchNorm
       safetensors, checkpoint, reshard    the file format; saves and loads; slices across world sizes
       fsdp_checkpoint          a zero_stage 3 model saved whole, unit by unit

   A new collective is one ddp__coll_kind, one public function (collectives.c) and one case in each
   backend's run function. */
/* A piece compiled on its own (`cc -std=c99 -fsyntax-only -Isrc src/X.c`, as CI checks every piece) sees
   what it sees inside ddp.h: the whole public part, as the implementation. In ddp.h these lines are
   inert (DDP_IMPLEMENTATION is defined there, and amalgamate.py drops the local includes). */
#ifndef DDP_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif
#include "ddp_api.h"
#include "amp.h"
#include "reducer.h"
#include "ft.h"
#include "sampler.h"
#include "syncbn.h"
#include "checkpoint.h"
#include "cuda_api.h"

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
extern ssize_t pwrite(int fd, const void *buf, size_t n, off_t offset) DDP__OFF64(pwrite);
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8)
extern ssize_t getline(char **restrict lineptr, size_t *restrict n, FILE *restrict stream);
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
/* Ask for the cache line at p before it is needed: for writing (the sampler's shuffle targets), or for
   reading (peers' lines in shared memory, so that the misses of several overlap). */
#if defined(__GNUC__) || defined(__clang__)
#define DDP__PREFETCH(p) __builtin_prefetch((p), 1)
#define DDP__PREFETCH_READ(p) __builtin_prefetch((p), 0)
#else
#define DDP__PREFETCH(p) ((void)(p))
#define DDP__PREFETCH_READ(p) ((void)(p))
#endif

/* ---- util.c: errors, logging, environment, time, memory ---- */
/* Format a message into buf (DDP__ERR_MAX bytes) and return code: `return ddp__fail_to(...)`. */
static DDP__UNUSED ddp_result ddp__fail_to(char *buf, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
/* The same, into g's last-error message (this thread's when g is NULL). */
static DDP__UNUSED ddp_result ddp__fail(ddp_group *g, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
/* Fault-tolerant mode: the code a failure of g's answers (DDP_ERR_VIEW_CHANGED where a view change repairs it). */
static DDP__UNUSED ddp_result ddp__ft_code(const ddp_group *g, ddp_result code);
static DDP__UNUSED char *ddp__error_buffer(ddp_group *g); /* where ddp__fail(g, ...) writes */
static DDP__UNUSED void ddp__note_thread_error(const char *msg); /* copy msg to this thread's last error */
static DDP__UNUSED void ddp__log(const ddp_group *g, ddp_log_level level, const char *fmt, ...) DDP__PRINTF(3, 4);
static DDP__UNUSED ddp_log_level ddp__env_log_level(void);
/* Parse an environment variable as an integer in [lo, hi]. Returns 0 when unset (value untouched),
   1 when set and valid, -1 when set but malformed (message in err). */
static DDP__UNUSED int ddp__env_int(const char *name, long lo, long hi, long *value, char *err);
static DDP__UNUSED const char *ddp__env(const char *name); /* NULL when unset or empty */
static DDP__UNUSED double ddp__now(void);                  /* monotonic seconds */
static DDP__UNUSED double ddp__wall_seconds(void);         /* CLOCK_REALTIME seconds */
/* How long a collective waits on a peer that makes no progress (g->quiet when set and shorter, else the
   group's timeout), and what sets it, for messages ("DDP_TIMEOUT", or fault tolerance's suspect_seconds). */
static DDP__UNUSED double ddp__quiet_limit(const ddp_group *g);
static DDP__UNUSED const char *ddp__quiet_limit_name(const ddp_group *g);
static DDP__UNUSED void *ddp__malloc(size_t size);         /* NULL on failure; size 0 allowed */
static DDP__UNUSED void *ddp__calloc(size_t n, size_t size);
static DDP__UNUSED void ddp__free(void *p);
static DDP__UNUSED char *ddp__strdup(const char *s);
static DDP__UNUSED void ddp__sleep(double seconds);
#define DDP__FNV_OFFSET 1469598103934665603ull
static DDP__UNUSED uint64_t ddp__hash(const char *s); /* FNV-1a of a string */
static DDP__UNUSED uint64_t ddp__hash_bytes(uint64_t h, const void *data, size_t n);
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

/* ---- store.c, store_server.c, store_client.c, store_file.c, store_api.c: the rendezvous key-value store (c10d
   TCPStore protocols of torch 1.13 and 2.x; file store); store_state.h is their private header ---- */
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
/* Rank 0's own client cannot connect to this server (group.c, ddp__rank0_cannot_connect): the server
   thread publishes why under the rendezvous keys above, as when it cannot accept a rank. Once per server. */
static DDP__UNUSED void ddp__store_server_publish_failure(ddp__store_server *s, const char *why);
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
/* s is rank 0's own client of the server in this process: a lost connection is not "did rank 0 exit?". */
static DDP__UNUSED void ddp__store_mark_own(ddp_store *s);
/* Wait at most `seconds` for the server to close this idle TCP client's connection (ddp_destroy: rank 0's
   store has stopped). 1: closed, or no TCP connection to wait on; 0: still open. */
static DDP__UNUSED int ddp__store_await_close(ddp_store *s, double seconds);
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

/* ddp__coll.purpose: an FSDP unit's collective (reducer_fsdp.c), phase DDP__PHASE_*, unit >= 0; or the reducer's
   sample count (ddp_reducer_set_local_samples: DDP__PHASE_SAMPLES, unit -1). */
enum { DDP__PHASE_GATHER = 1, DDP__PHASE_REDUCE = 2, DDP__PHASE_SAMPLES = 3 };
#define DDP__PURPOSE(phase, unit) ((uint32_t)(phase) << 24 | (uint32_t)((unit) + 1))

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
    uint32_t purpose; /* what the library issued it for (DDP__PURPOSE: an FSDP unit's gather or reduce-scatter, the
                         reducer's sample count), 0 for the program's own calls: ranks that gather different units
                         fail, never mix data */
    double t_queued; /* when an async call was queued (ddp__now), for the timeline; 0: not queued, or it is off */
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
   reducer's used map between host memory and the backend's) and accumulate (dst += src, both the backend's
   memory, rounded once as ddp__reduce's sum); the host versions are hostmem.c's.
   Optional (NULL: nothing to do, or the mesh's own), so that the layers below call no backend by name:
     abort        the group breaks (transport.c ddp__group_break): wake every rank waiting inside the
                  backend at once (shm: the segment's abort word and futex)
     peer_seq     the newest collective number peer `peer` has entered, as the backend sees it (shm:
                  the segment's fingerprints), 0 when it cannot tell; a recv uses it to see that its
                  source went on to a collective without sending
     p2p_start    ddp_isend / ddp_irecv through the backend's own point-to-point calls (mpi): start w's
                  transfer, setting w->owner to a table whose wait and test finish it (and run takes
                  the blocking ddp_send / ddp_recv); NULL: the mesh's messages (transport.c)
     p2p_release  on a work owner: cancel a started transfer nobody waited for (the group ends) */
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
    void (*accumulate)(ddp_group *g, void *dst, const void *src, ddp_dtype t, size_t count);
    void (*abort)(ddp_group *g);
    uint64_t (*peer_seq)(const ddp_group *g, int peer);
    ddp_result (*p2p_start)(ddp_group *g, ddp_work *w);
    void (*p2p_release)(ddp_work *w);
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
/* What ddp_init's set-up (group.c) lends the mesh while it runs, so that a rank lost on the way is also
   looked for in the store: link.c and transport.c call up only through these.
     watch  every so often while a step waits on a rank it has no connection with: a failure another rank
            published in the store, or rank `peer`'s process gone from this node, fails g (error in g->error;
            published); else DDP_SUCCESS
     lost   rank `peer`'s port refuses connections (`how`): published, so every rank fails naming it; the
            message in g->error */
typedef struct ddp__setup_hooks {
    ddp_result (*watch)(ddp_group *g, int peer);
    ddp_result (*lost)(ddp_group *g, int peer, const char *how);
} ddp__setup_hooks;

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
    const struct ddp__setup_hooks *setup; /* while ddp_init's own set-up runs (group.c), else NULL */
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
    int rank0_serves;        /* the world group's store is rank 0's TCP server (not a file, not torchrun's agent) */
    char address[128];       /* this host's address that peers connect to */
    char prefix[96];         /* this group's store keys start with it */
    ddp_group *parent;       /* NULL for the world group (and hier.c's stage groups) */
    ddp_group *subgroups;    /* ddp_new_group's subgroups not yet destroyed, in the order made */
    ddp_group *next_sibling; /* the next of the parent's subgroups */
    uint64_t subgroups_made; /* names the next subgroup's key prefix */
    /* A fault-tolerant view's set-up (ft.c ddp__ft_rebuild): asked every DDP__WATCH_PERIOD while the
       rendezvous or the first connections wait, it answers the rank of a member known gone (its control
       connection closed), or -1, so that the set-up fails at once instead of at its timeout. NULL: none. */
    int (*gone)(void *arg);
    void *gone_arg;
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

/* hier.c: the stage groups of a group that spans hosts with several ranks on a host (group.c opens and
   ends them: ddp__hier_open, ddp__hier_stages_end). */
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
    double quiet;                     /* when > 0 and shorter: seconds a collective waits on a silent peer
                                         (suspect_seconds while fault tolerance runs: ddp__group_set_quiet) */
    ddp_log_level log_level;
    ddp_log_fn log_fn;
    void *log_user;
    char error[DDP__ERR_MAX]; /* ddp_last_error(g) */

    const ddp__backend *backend;      /* where every collective goes */
    const ddp__backend *host_backend; /* where calls on host memory go: backend itself, except under nccl */
    uint64_t seq;        /* collectives issued so far (set-up included); carried in every message */
    uint64_t seq_base;   /* seq when ddp_init (or ddp_new_group) returned: messages number calls from it */
    uint64_t running_seq; /* seq of the collective running now (0 between collectives) */
    uint32_t purpose;     /* the purpose the next collectives are fingerprinted with (ddp__coll.purpose); set
                             around its calls by the library layer that issues them, 0 otherwise */
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
    struct ddp__devbuf *devbuf; /* devbuf.c: the stream and pinned memory that stage device buffers (NULL: none yet) */
    struct ddp__trace *trace; /* trace.c's flight recorder (NULL: off) */
    struct ddp__ck_async *ck_async; /* checkpoint.c's background save (NULL: no async save yet) */
    /* The end of what an upper layer keeps with the group (checkpoint.c's background save, its private
       group: ddp__ck_async_end), called first by ddp_destroy and by ddp__group_free; idempotent; NULL:
       nothing. The layers below reach up only through such slots, never by name. */
    void (*end_upper)(ddp_group *g);
    /* Fault-tolerant mode (ft.c): ft_mode is set by ddp_init (desc.fault_tolerant, DDP_FT) on the world group
       and on each view's data plane; a peer lost then answers DDP_ERR_VIEW_CHANGED (util.c ddp__ft_code), and
       ddp_alloc stays out of the shared segment (a view change maps a new one). ft is the view change's state,
       made by the first ddp_ft_begin, and ft_end frees it (ddp_destroy; idempotent). Until ft_running, a
       failure is what it would be without fault tolerance. */
    int ft_mode, ft_min_world;
    int ft_running;     /* ft.c's control connections are up (the first ddp_ft_begin succeeded) */
    int ft_join;        /* a joiner (DDP_FT_JOIN=1): alone until the first ddp_ft_begin admits it */
    uint64_t ft_views;  /* data planes adopted so far (view changes): a reducer pass begun in an older one is void */
    double ft_suspect;
    struct ddp__ft *ft;
    void (*ft_end)(ddp_group *g);
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
    double times[3];           /* the progress thread's run: start, end (ddp__now) and its lane, for the timeline */
};

/* ---- group.c: a view's data plane (fault tolerance, ft.c) ---- */
/* A fresh group of n members, this one rank `rank`, connected through `store` under `prefix` (as ddp_init
   connects one); g carries the error. gone (may be NULL): ddp__membership.gone while it connects. */
static DDP__UNUSED ddp_result ddp__group_open_view(ddp_group *g, int rank, int n, ddp_store *store, const char *prefix,
                                                  double timeout, int (*gone)(void *arg), void *gone_arg,
                                                  ddp_group **out);
/* g (its progress thread idle) takes v's data plane; g's old one is freed with v. */
static DDP__UNUSED void ddp__group_adopt(ddp_group *g, ddp_group *v);
/* g's (and its stage groups') limit on a silent peer in collectives: seconds, 0 for the group's timeout. */
static DDP__UNUSED void ddp__group_set_quiet(ddp_group *g, double seconds);
/* ---- ft.c ---- */
static DDP__UNUSED void ddp__ft_test_kill(ddp_group *g, const char *point); /* DDP_FT_TEST_KILL's points in other layers */

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
/* all_to_all_v / all_gather_v: rank sender sends `sent` elements where rank receiver expects `expected`:
   DDP_ERR_MISMATCH naming both ranks and both sizes. */
static DDP__UNUSED ddp_result ddp__sizes_differ(ddp_group *g, const ddp__coll *c, int sender, int receiver, uint64_t sent,
                                               uint64_t expected);

/* ---- collectives.c: the public collectives' machinery ---- */
/* Every rank's outcome of a multi-step call (checkpoints, ZeRO state): the first failure (lowest rank) is
   every rank's error, with its message; mine when g is NULL or of one rank. Collective. */
static DDP__UNUSED ddp_result ddp__agree_outcome(ddp_group *g, ddp_result mine, const char *what);
/* ddp_wait, giving when the progress thread ran w (times[0] start, times[1] end, ddp__now; times[2] its
   timeline lane, 0 while the timeline is off; all 0 when the work was not the progress thread's) */
static DDP__UNUSED ddp_result ddp__wait_times(ddp_work *w, double *times);
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
static DDP__UNUSED void ddp__fingerprint(ddp_group *g, const ddp__call *k, ddp__coll *c, int now); /* takes the next seq; now: runs at once */
/* The message for a call on a group that an earlier error broke; written to out (DDP__ERR_MAX). */
static DDP__UNUSED const char *ddp__broken_message(const ddp_group *g, const ddp__call *k, char *out);
static DDP__UNUSED void ddp__drain(ddp_group *g);         /* wait until no async work is queued */
static DDP__UNUSED void ddp__progress_stop(ddp_group *g); /* finish queued work, stop the thread */
static DDP__UNUSED void ddp__work_release_all(ddp_group *g); /* the group ends: free the handles not waited on */
static DDP__UNUSED int ddp__work_issue(ddp_group *g, ddp_work *w); /* record w as issued on g and live; 0: out of memory */
/* The most bytes a collective's largest buffer may span (count x element size, x world size for
   all_gather / reduce_scatter): more than any process can map, so sizes computed from a valid count
   never overflow. */
#define DDP__MAX_BUFFER_BYTES ((uint64_t)1 << 47)
/* A failure outside any collective that leaves the ranks unable to agree (the reducer's missing
   gradient): finish queued work, then break the group so every rank fails with msg. */
static DDP__UNUSED ddp_result ddp__group_abort(ddp_group *g, ddp_result code, const char *msg);

/* ---- trace.c: the flight recorder, each group's last DDP_TRACE_SIZE collectives; collectives' names ---- */
static DDP__UNUSED const char *ddp__coll_name(int kind); /* "all_reduce", ... */
/* "all_reduce(count=1024, f32, sum) as collective #7", numbered from g's seq_base */
static DDP__UNUSED void ddp__coll_describe(const ddp_group *g, const ddp__coll *c, char *out, size_t cap);
static DDP__UNUSED void ddp__trace_open(ddp_group *g);  /* group.c: a new group's recorder (none if off) */
static DDP__UNUSED void ddp__trace_close(ddp_group *g); /* group.c: before g is freed */
static DDP__UNUSED void ddp__trace_queued(ddp_group *g, const ddp__coll *c, int started); /* c took its seq (fingerprint) */
static DDP__UNUSED void ddp__trace_started(ddp_group *g, const ddp__coll *c); /* a backend runs it now */
static DDP__UNUSED void ddp__trace_ended(ddp_group *g, const ddp__coll *c, ddp_result r); /* done or failed */
/* ddp__group_break: mark what was in progress failed and write the recorder out (DDP_TRACE_DIR, else the log). */
static DDP__UNUSED void ddp__trace_break(ddp_group *g, ddp_result code);

/* ---- timeline.c: Chrome trace events (DDP_TIMELINE); every function is a no-op while it is off ---- */
static DDP__UNUSED int ddp__timeline_on(void); /* callers skip their clock reads when it is off */
/* group.c: open this rank's file; mono0 (ddp__now) lies `base` seconds after rank 0's open on rank 0's clock */
static DDP__UNUSED ddp_result ddp__tl_open(ddp_group *g, const char *path, double mono0, double base);
static DDP__UNUSED void ddp__timeline_close_of(const ddp_group *g);
/* rank's file for a DDP_TIMELINE path (%r replaced, else .rank<R> before the extension); 0 if over cap */
static DDP__UNUSED int ddp__tl_file_name(const char *path, int rank, char *out, size_t cap); /* group.c: g ends (the world's closes the file) */
static DDP__UNUSED void ddp__timeline_flush(void); /* a group broke */
/* collectives.c: c ran from started to ended (ddp__now) with result r */
static DDP__UNUSED void ddp__timeline_coll(ddp_group *g, const ddp__coll *c, double started, double ended, ddp_result r);
/* a complete event with numeric args names[i] = values[i] and, when key, key = "value" (the reducer, checkpoints) */
static DDP__UNUSED void ddp__timeline_span(const char *name, double start, double end, const char *const *names,
                                           const double *values, int n, const char *key, const char *value);
/* the same on lane `lane` (0: this thread's): an event of another thread's run (the reducer's buckets) */
static DDP__UNUSED void ddp__timeline_span_on(int lane, const char *name, double start, double end, const char *const *names,
                                              const double *values, int n, const char *key, const char *value);
static DDP__UNUSED int ddp__timeline_lane(void); /* this thread's lane */
static DDP__UNUSED void ddp__timeline_lane_saver(void);                   /* this thread is the async saver */
static DDP__UNUSED void ddp__timeline_lane_progress(const ddp_group *g);  /* this thread is g's progress thread */

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

/* ---- hier.c: the hierarchical backend ---- */
typedef struct ddp__hier_map { /* ddp__hier_plan's answer */
    int *host, nhost, my_index;      /* the ranks of this rank's host; this rank is host[my_index] */
    int *leaders, nlead, lead_index; /* the first rank of every host; this rank is leaders[lead_index] if it leads */
} ddp__hier_map;
static DDP__UNUSED int ddp__hier_plan(const uint64_t *keys, int n, int rank, ddp__hier_map *m);
static DDP__UNUSED void ddp__hier_install(ddp_group *g, int nhosts); /* after group.c opened the stage groups */

/* ---- mpi.c: the mpi backend ---- */
static DDP__UNUSED ddp_result ddp__mpi_world(int *rank, int *world_size, struct ddp__mpi **out, char *err);
static DDP__UNUSED ddp_result ddp__mpi_split(ddp_group *parent, int me, struct ddp__mpi **out);
static DDP__UNUSED void ddp__mpi_attach(ddp_group *g, struct ddp__mpi *m); /* g's communicator and backend */
static DDP__UNUSED void ddp__mpi_free(struct ddp__mpi *m);

/* ---- nccl.c: the nccl backend ---- */
static DDP__UNUSED ddp_result ddp__nccl_built(char *err); /* can backend "nccl" be asked for? */
/* Give the connected group g an NCCL communicator (a subgroup: parent's device and stream) and install
   the nccl backend; host-memory calls keep going to the backend g had. Collective over g. */
static DDP__UNUSED ddp_result ddp__nccl_attach(ddp_group *g, const struct ddp__nccl *parent);
/* Fault tolerance: view v's communicator made from g's (shrunk, or anew; lost: g's ranks not in v, grown: v
   has members g had not), before g adopts v; then ddp__nccl_retire aborts g's old one (v holds it). */
static DDP__UNUSED ddp_result ddp__nccl_renew(ddp_group *g, ddp_group *v, const int *lost, int nlost, int grown);
static DDP__UNUSED void ddp__nccl_retire(ddp_group *v);
/* The stream g's device copies go on (NCCL's, or the device staging's; NULL: the legacy default stream). */
static DDP__UNUSED void *ddp__group_stream(ddp_group *g);

/* ---- devbuf.c: device buffers on the cpu and mpi backends, staged through pinned host memory ---- */
/* What one staged call copies: up to two regions of device memory (a call's send and recv buffers, or
   one when they overlap), each with its place in the group's pinned memory. */
typedef struct ddp__devbuf_region {
    char *device, *host;
    size_t bytes;
    int in, out; /* copied to host memory before the call / back to the device after it */
} ddp__devbuf_region;
typedef struct ddp__devbuf_plan {
    int n;
    ddp__devbuf_region region[2];
} ddp__devbuf_plan;
/* 1 when k (validated) has a buffer in device memory that g must stage (a build with DDP_CUDA, a group
   of any backend but nccl); else 0. Looks at the buffers this rank reads or writes only. */
static DDP__UNUSED int ddp__devbuf_wanted(ddp_group *g, const ddp__call *k);
/* Stage k: copy its device buffers that the call reads into pinned host memory (on g's stream, then
   wait for it) and make *host_call, k on the host copies. A failure breaks the group (c names the call). */
static DDP__UNUSED ddp_result ddp__devbuf_stage(ddp_group *g, const ddp__call *k, const ddp__coll *c, ddp__call *host_call,
                                                ddp__devbuf_plan *plan);
/* After the host call succeeded: queue the copies of what it wrote back to the device on g's stream. */
static DDP__UNUSED ddp_result ddp__devbuf_unstage(ddp_group *g, const ddp__coll *c, const ddp__devbuf_plan *plan);
/* reducer.c's copies (dst = src converted) when dst or src is device memory on a group that stages:
   begin returns 0 when neither is (nothing to do), 1 when *dst and *src now point into the group's
   pinned memory (src's bytes copied in; convert there, then end copies dst back to the device), -1
   when staging failed (the group is broken; skip the copy). */
static DDP__UNUSED int ddp__devbuf_copy_begin(ddp_group *g, void **dst, size_t dst_bytes, const void **src,
                                              size_t src_bytes, ddp__devbuf_plan *plan);
static DDP__UNUSED void ddp__devbuf_copy_end(ddp_group *g, const ddp__devbuf_plan *plan);
/* ddp_set_stream on a group that stages (every backend but nccl, with DDP_CUDA); the stream now set. */
static DDP__UNUSED ddp_result ddp__devbuf_set_stream(ddp_group *g, void *stream);
static DDP__UNUSED void *ddp__devbuf_stream(const ddp_group *g);
/* A new subgroup starts with its parent's stream. */
static DDP__UNUSED ddp_result ddp__devbuf_inherit(ddp_group *sub, const ddp_group *parent);
static DDP__UNUSED void ddp__devbuf_free(ddp_group *g); /* waits for queued copies; g->devbuf = NULL */

/* ---- launch_env.c: rank, world size and rank 0's address, from the descriptor or the launcher ---- */
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
static DDP__UNUSED ddp_result ddp__read_launch(const ddp_init_desc *d, ddp__launch *L, char *err);
static DDP__UNUSED double ddp__read_timeout(const ddp_init_desc *d, char *err, ddp_result *res);

/* ---- rendezvous.c: records, the table, the job's identity, a rank lost inside ddp_init ---- */
/* What each rank publishes about itself: "world=W port=P pid=PID addr=A host=H node=N". */
typedef struct ddp__record {
    int world, port, pid;
    char addr[128], host[128];
    unsigned long long node; /* ddp__node_key() of its process; 0 when not published */
} ddp__record;
static DDP__UNUSED void ddp__key(const ddp_group *g, char *out, size_t cap, const char *name, int index);
static DDP__UNUSED ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted);
static DDP__UNUSED void ddp__rdzv_publish(ddp_group *g, ddp_result code);
static DDP__UNUSED ddp_result ddp__rdzv_fail_all(ddp_group *g, ddp_result code);
static DDP__UNUSED uint64_t ddp__host_key(void);
static DDP__UNUSED void ddp__boot_id(char *out, size_t cap); /* "" when unreadable */
static DDP__UNUSED unsigned long long ddp__node_key(void);
static DDP__UNUSED int ddp__pid_gone(int pid, unsigned long long its_node, unsigned long long node);
static DDP__UNUSED ddp_result ddp__rdzv_lost(ddp_group *g, int i, const ddp__record *r, const char *how);
static DDP__UNUSED ddp_result ddp__rdzv_job(ddp_group *g, const char *where, int file_store, int *foreign);
static DDP__UNUSED ddp_result ddp__rank0_port_taken(ddp_group *g, const ddp__launch *L, ddp_result r, char *err);
static DDP__UNUSED ddp_result ddp__rendezvous(ddp_group *g, const char *addr, int port, const char *where);
static DDP__UNUSED void ddp__route_address(const char *master, int port, char *out, size_t cap);

/* ---- group.c ---- */
static DDP__UNUSED ddp_group *ddp__group_alloc(int rank, int world_size);
static DDP__UNUSED void ddp__group_free(ddp_group *g); /* connections closed without goodbye */
static DDP__UNUSED void ddp__subgroup_link(ddp_group *parent, ddp_group *sub);
static DDP__UNUSED void ddp__subgroup_unlink(ddp_group *parent, ddp_group *sub);
/* Make and connect the group of the parent's ranks `ranks` (see group.c); hier.c's stages use it too. */
static DDP__UNUSED ddp_result ddp__subgroup_open(ddp_group *g, const int *ranks, int n, int me, const char *name,
                                                 struct ddp__mpi *comm, const char *what, ddp_group **out);

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
    int order;        /* position among the header's tensor entries (0 = first listed; ddp_checkpoint_list's order) */
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
static DDP__UNUSED ddp_result ddp__crc32c_anywhere(const void *p, size_t bytes, void *stream, uint32_t *crc, char *err);
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
                                                   const ddp_meta *extra, const uint32_t *crcs, ddp__ck_buf *b, char *err);

/* ---- checkpoint.c: the pieces reshard.c reads shards with ---- */
/* What a shard must say about itself (load_shard); NULL for plain files. */
typedef struct ddp__ck_shard_expect {
    int rank, world;
    const char *save_id;
} ddp__ck_shard_expect;
/* Open path and parse its header (h, its raw bytes in *raw, the JSON length *hlen); the caller closes
   *fd and frees h and *raw. */
static DDP__UNUSED ddp_result ddp__ck_open(ddp_group *g, const char *path, int *fd, char **raw, uint64_t *hlen, ddp__ck_header *h);
/* Read n bytes at file offset off into data (crc, may be NULL: a running CRC32C register, updated). */
static DDP__UNUSED ddp_result ddp__ck_read_at(ddp_group *g, int fd, void *data, uint64_t n, uint64_t off, const char *path,
                                              uint32_t *crc);
/* Read entry e's data (the data section starts at data_start) into dst and verify its checksum. */
static DDP__UNUSED ddp_result ddp__ck_read_tensor(ddp_group *g, const char *path, int fd, uint64_t data_start,
                                                  const ddp__ck_header *h, const ddp__ck_entry *e, void *dst);
static DDP__UNUSED ddp_result ddp__ck_check_shard(ddp_group *g, const char *path, const ddp__ck_header *h,
                                                  const ddp__ck_shard_expect *x);
static DDP__UNUSED ddp_result ddp__ck_copy_meta(ddp_group *g, const ddp__ck_header *h, ddp_meta *meta); /* library keys left out */
/* The completion marker of a shard save at path: its world size and save id. */
static DDP__UNUSED ddp_result ddp__ck_read_marker(ddp_group *g, const char *path, int64_t *world, uint64_t *id);
static DDP__UNUSED char *ddp__ck_shard_path(const char *path, int rank); /* "<path>.rank<r>"; NULL out of memory */
static DDP__UNUSED void ddp__ck_async_settle(ddp_group *g); /* wait for an async save in flight */
/* A safetensors file written tensor by tensor, at the places its header gives (checkpoint.c). */
typedef struct ddp__ck_out {
    const char *path;
    char *tmp;
    int fd, n;
    const ddp_tensor *t;
    const ddp_meta *meta;
    uint32_t *crc;      /* per tensor, once written */
    uint64_t *at;       /* n + 1: where each tensor's data starts in the data section */
    uint64_t data_start;
} ddp__ck_out;
static DDP__UNUSED ddp_result ddp__ck_out_open(ddp_group *g, const char *path, const ddp_tensor *t, int n,
                                                  const ddp_meta *meta, ddp__ck_out *s);
static DDP__UNUSED ddp_result ddp__ck_out_write(ddp_group *g, ddp__ck_out *s, int i, const void *data);
static DDP__UNUSED ddp_result ddp__ck_out_close(ddp_group *g, ddp__ck_out *s, ddp_result ok);

/* ---- reducer.c: what zero_state.c reads of a reducer ---- */
static DDP__UNUSED ddp_result ddp__reducer_zero_model(ddp_reducer *r, const char *fn, ddp_group **g, int *nparams);
static DDP__UNUSED size_t ddp__reducer_param_count(const ddp_reducer *r, int i);
/* ---- reducer_fsdp.c: the FSDP model, for fsdp_checkpoint.c ---- */
static DDP__UNUSED ddp_result ddp__fsdp_model(ddp_reducer *r, const char *fn, ddp_group **g, int *nunits, int *nparams);
static DDP__UNUSED void ddp__fsdp_param_tensor(const ddp_reducer *r, int i, ddp_tensor *t, int *unit, size_t *at);
static DDP__UNUSED size_t ddp__fsdp_master_bytes(const ddp_reducer *r);
static DDP__UNUSED void *ddp__fsdp_master_stage(ddp_reducer *r, int *failed);
static DDP__UNUSED void ddp__fsdp_master_unstage(ddp_reducer *r, void *stage);
static DDP__UNUSED ddp_result ddp__fsdp_gather_master(ddp_reducer *r, int u, void *buf, void *stage, int root);

/* ---- dtype.c: conversions between the floating dtypes ---- */
static DDP__UNUSED void ddp__host_convert_scaled(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count,
                                                 double scale);
static DDP__UNUSED void ddp__host_convert(void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t, size_t count);
/* One element of a floating dtype as f32 (f64 rounded), and back (rounded to nearest even). */
static DDP__UNUSED float ddp__get_f32(const void *p, ddp_dtype t, size_t i);
static DDP__UNUSED void ddp__put_f32(void *p, ddp_dtype t, size_t i, float v);

/* ---- amp.c: a pass's gradient statistics (the reducer's grad_stats and loss_scale) ---- */
typedef struct ddp__amp_pass {
    int on;          /* grad_stats or loss_scale: unscale and count in this pass */
    float inv_scale; /* the pass's 1 / loss_scale->scale as torch computes it (1: none) */
    double sum[2];   /* sum of squares, non-finite count: this rank's pieces, then (ZeRO) all ranks' */
    int valid;       /* sum describes the last synchronised pass, complete */
} ddp__amp_pass;
static DDP__UNUSED void ddp__amp_begin(ddp__amp_pass *a, int on, const ddp_grad_scaler *s);
static DDP__UNUSED void ddp__amp_add(ddp__amp_pass *a, void *data, ddp_dtype t, size_t count);
static DDP__UNUSED ddp_result ddp__amp_finish(ddp_group *g, ddp__amp_pass *a, int reduce);
static DDP__UNUSED size_t ddp__amp_scan(void *data, size_t count, ddp_dtype t, float inv, double *sumsq);

/* ---- hostmem.c: host memory for the reducer's buckets (every backend but nccl uses these) ---- */
static DDP__UNUSED void *ddp__host_alloc(ddp_group *g, size_t bytes);
static DDP__UNUSED void ddp__host_release(ddp_group *g, void *p);
static DDP__UNUSED void ddp__host_zero(ddp_group *g, void *dst, size_t bytes);
static DDP__UNUSED void ddp__host_copy_in_scaled(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                                 size_t count, double scale);
static DDP__UNUSED void ddp__host_copy_out(ddp_group *g, void *dst, ddp_dtype dst_t, const void *src, ddp_dtype src_t,
                                           size_t count);
static DDP__UNUSED void ddp__host_accumulate(ddp_group *g, void *dst, const void *src, ddp_dtype t, size_t count);
