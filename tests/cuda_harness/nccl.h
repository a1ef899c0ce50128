/* tests/cuda_harness/nccl.h — a fake NCCL for the CPU harness: with -Itests/cuda_harness and
   -DDDP_HARNESS_NCCL (in every translation unit), ddp_cuda.cu's [SECTION] cuda-nccl compiles against
   this file, and a program's ranks run the nccl backend of ddp.h on the CPU (tests/test_nccl_harness.sh;
   tests/cuda_harness/run_test.sh builds any test that way with NCCL=1). It declares what ddp_cuda.cu
   uses of <nccl.h> (types, constants, NCCL_VERSION_CODE 2.18.5 or 2.28.0) and a few neighbours; an NCCL call that
   is not here is a compile error, not a silent mistake.

   Execution model:
   - Ranks are processes (forked by tests/testlib.h's tl_run_ranks, or started by ddprun). The
     ncclUniqueId names a POSIX shared memory segment (/dev/shm/ddp-fake-nccl-PID-N-RANDOM; the id
     also carries the chunk size). ncclCommInitRank maps it (whichever rank comes first creates it:
     all ranks open it with O_CREAT and size it alike, zeroed memory is its initial state), records
     its pid under its rank, waits until all nranks have joined, and unlinks the name: nothing is left
     in /dev/shm once a communicator is up, whatever happens to the processes later.
   - A collective runs to completion inside the call, before it returns (streams are ignored, as the
     rest of the harness does: every order a stream allows holds); so does a group of ncclSend/ncclRecv,
     inside ncclGroupEnd (or a lone ncclSend/ncclRecv inside its call). Queued harness copies run first
     (ddp_harness::flush_copies), so a cudaMemcpyAsync queued before the call is seen by it.
   - Collectives move data through the segment in rounds: each rank copies a chunk of its input
     (DDP_FAKE_NCCL_CHUNK bytes per rank, default 512 KiB; reduce_scatter takes chunk / nranks of each
     rank's block) into its slot, all meet at a barrier (a generation counter: a short spin, then a
     futex with a 10 ms timeout), then each rank reads every slot it needs and writes its own output.
     The slots alternate between two halves (2 chunks per rank), so one barrier per round suffices: a
     rank that passed round r's barrier knows every rank has read round r-1's half. The first round also
     compares the ranks' calls (collective, sequence number, count, type, op, root): ranks that disagree
     fail with ncclInvalidUsage and a message naming both calls, instead of NCCL's hang or corruption.
   - ncclSend/ncclRecv: per (source, destination) pair, a byte ring in the segment (a chunk's size) with
     a 16-byte header per message (count and type; a receive that does not match the send is
     ncclInvalidUsage). ncclGroupEnd advances every pending send and receive of the group as far as the
     rings allow, over and over, waiting on a per-rank futex "doorbell" that a peer rings after it
     writes or reads, until all are done: no order of the pairs can deadlock. Several messages to one
     peer in a group go in call order. A count of 0 moves nothing (no message). A receive whose buffer
     overlaps another buffer of the same group is ncclInvalidUsage (a race on a GPU).
   - Reductions, in rank order 0..nranks-1 on every rank (so every rank's result is the same bits):
     f32 in float, f64 in double; f16 and bf16 in float rounded back to the type (nearest even, the
     harness's conversions) after every step, as NCCL's half arithmetic and ddp.h's cpu backend do;
     integers wrap (unsigned arithmetic), MIN/MAX as the comparison, with NaN propagated for floats (as
     ddp.h's cpu backend and torch; NCCL's may differ). ncclAvg is the sum divided by nranks at the end
     (integers truncate toward zero, as NCCL's; floats rounded once, where NCCL multiplies each input by
     1/nranks first: the two agree when the data is exact, e.g. small integers over 1, 2 or 4 ranks).
     NCCL's order follows its ring or tree: compare against it bit for bit only data whose partial
     results are exact.
   - Buffers must lie inside a cudaMalloc'd (or cudaMallocHost'd) allocation of the harness: anything
     else, a range past the allocation's end, or an overlap of send and receive buffers other than
     NCCL's in-place forms (send == recv; all_gather's send = recv + rank * count; reduce_scatter's recv
     = send + rank * count) is ncclInvalidArgument with a message (ncclGetLastError). Device memory is
     opened (ddp_harness::protect) for the call and closed again after it.
   - Every wait has an exit: a peer whose process is gone (kill(pid, 0)), that destroyed its
     communicator, or that aborted it (ncclCommAbort marks the segment: waits and later calls of the
     other ranks fail at once) is ncclRemoteError; DDP_FAKE_NCCL_TIMEOUT seconds (default 120) without
     the wait ending is ncclSystemError. A peer that delivered what is waited for and then went is no
     error (after seeing the trouble a waiter looks once more). The message says who, where and why.
     After a failure the communicator keeps the error (ncclCommGetAsyncError; later calls fail with it);
     ncclCommAbort and ncclCommDestroy free it. Argument errors (ncclInvalidArgument) leave it usable.
   Not emulated: streams and asynchrony (a real NCCL call returns at once and a rank waits on an event;
   here a rank whose peers never make the matching call waits inside the call until the timeout, and the
   caller's watchdog never sees a queued-but-incomplete collective: with ddp.h, whose ranks agree over TCP
   before each NCCL call, a lost or stuck rank is mostly caught there; one lost between that agreement
   and the NCCL call is DDP_ERR_SYSTEM "queueing the NCCL collective failed: remote process exited ..."
   here where a GPU run would report DDP_ERR_PEER_LOST from the watchdog), collectives inside ncclGroupStart/End
   (ncclInvalidUsage), non-blocking communicators (ncclCommInitRankConfig takes blocking = 0 but its calls
   still complete inside; ncclCommShrink and ncclCommRevoke, with -DDDP_FAKE_NCCL_2_28, below), ncclCommSplit,
   user-defined reduction ops (ncclRedOpCreatePreMulSum), ncclMemAlloc / buffer registration, NCCL_*
   environment variables, multiple threads (one thread at a time per process, as the harness).
   ddp_harness::nccl_stats counts the calls and remembers the last stream. */
#ifndef DDP_CUDA_HARNESS_NCCL_H
#define DDP_CUDA_HARNESS_NCCL_H
#include "cuda_runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#ifndef DDP_HARNESS_NCCL
#error "the fake NCCL (tests/cuda_harness/nccl.h) needs -DDDP_HARNESS_NCCL in every translation unit of the program"
#endif

/* The NCCL line the fake plays: 2.18.5 (no shrink, no revoke) unless -DDDP_FAKE_NCCL_2_28 asks for 2.28.0,
   which adds ncclCommShrink and ncclCommRevoke (fault tolerance's two paths, tests/test_nccl_harness.sh). */
#define NCCL_MAJOR 2
#ifdef DDP_FAKE_NCCL_2_28
#define NCCL_MINOR 28
#define NCCL_PATCH 0
#else
#define NCCL_MINOR 18
#define NCCL_PATCH 5
#endif
#define NCCL_SUFFIX ""
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)
#define NCCL_UNIQUE_ID_BYTES 128

typedef struct ncclComm *ncclComm_t;
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclHalf = 6,
    ncclFloat32 = 7,
    ncclFloat = 7,
    ncclFloat64 = 8,
    ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

namespace ddp_fake_nccl {

constexpr uint64_t id_magic = 0x4c4343454b414644ull; /* "DFAKECCL" */
constexpr size_t default_chunk = 512 * 1024;

/* What the unique id carries. */
struct unique_t {
    uint64_t magic;
    uint64_t chunk; /* bytes of a rank's slot (per half) and of a ring */
    char name[96];  /* the segment's shm name */
};
static_assert(sizeof(unique_t) <= NCCL_UNIQUE_ID_BYTES, "the fake's id fits in an ncclUniqueId");

/* ---- the segment: a header, one control block per rank, one per ring, the slots, the rings ---- */
struct header_t {
    uint32_t nranks, pad0;
    uint64_t chunk;
    uint32_t joined, pad1[15];
    uint32_t arrive, pad2[15]; /* ranks at the barrier */
    uint32_t gen, pad3[15];    /* the barrier's generation (a futex word) */
    uint32_t aborted, pad4[15]; /* 1 + the rank that called ncclCommAbort first, 0 while none did */
    char abort_msg[512];
};
struct desc_t { /* a rank's call, compared in a collective's first round */
    uint64_t seq, count;
    int32_t kind, type, op, root;
};
struct rank_t {
    int32_t pid;
    uint32_t left; /* ncclCommDestroy'ed */
    uint32_t pad0[14];
    uint32_t doorbell; /* a futex word: bumped after a peer wrote into or read out of this rank's rings */
    uint32_t pad1[15];
    desc_t desc[2]; /* per half of the slots */
};
struct ring_t {
    uint64_t head; /* bytes read (the receiver writes it) */
    uint64_t pad0[7];
    uint64_t tail; /* bytes written (the sender writes it) */
    uint64_t pad1[7];
};
static_assert(sizeof(header_t) <= 4096 && sizeof(rank_t) <= 256 && sizeof(ring_t) == 128, "segment layout");

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct layout_t {
    size_t slot, ring, ranks, rings, slots, data, total;
};
inline layout_t layout(int n, uint64_t chunk) {
    layout_t l;
    const size_t nn = (size_t)n * (size_t)n;
    l.slot = align_up((size_t)chunk > (size_t)n * 8 ? (size_t)chunk : (size_t)n * 8, 64); /* reduce_scatter: n elements */
    l.ring = align_up((size_t)chunk > 64 ? (size_t)chunk : 64, 64);
    l.ranks = 4096;
    l.rings = align_up(l.ranks + (size_t)n * 256, 4096);
    l.slots = align_up(l.rings + nn * sizeof(ring_t), 4096);
    l.data = align_up(l.slots + (size_t)n * 2 * l.slot, 4096);
    l.total = align_up(l.data + nn * l.ring, 4096);
    return l;
}

/* The calls, as desc_t.kind and in messages. */
enum kind_t { K_ALL_REDUCE = 1, K_BROADCAST, K_REDUCE, K_ALL_GATHER, K_REDUCE_SCATTER };
inline const char *kind_name(int k) {
    switch (k) {
    case K_ALL_REDUCE: return "ncclAllReduce";
    case K_BROADCAST: return "ncclBroadcast";
    case K_REDUCE: return "ncclReduce";
    case K_ALL_GATHER: return "ncclAllGather";
    case K_REDUCE_SCATTER: return "ncclReduceScatter";
    default: return "?";
    }
}
inline const char *type_name(int t) {
    static const char *names[ncclNumTypes] = {"ncclInt8",  "ncclUint8",   "ncclInt32",   "ncclUint32",  "ncclInt64",
                                              "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
    return t >= 0 && t < ncclNumTypes ? names[t] : "?";
}
inline const char *op_name(int op) {
    static const char *names[ncclNumOps] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};
    return op >= 0 && op < ncclNumOps ? names[op] : "-";
}
inline size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    default: return 8;
    }
}

/* The process's last error text (ncclGetLastError) and the group in progress. */
inline char last_error[1024];

struct p2p_t {
    ncclComm_t comm;
    int peer;
    bool send;
    char *buf;
    size_t count, bytes, done;
    ncclDataType_t type;
    bool header_done, complete;
};
inline std::vector<p2p_t> pending;
inline int group_depth;
inline ncclResult_t group_error; /* a call inside the group failed: ncclGroupEnd drops the group */

struct stats_t {
    uint64_t inits, collectives, sends, recvs, groups, shrinks; /* (inits: also the shrinks' children) */
    cudaStream_t last_stream; /* of the last collective, send or receive */
};

} // namespace ddp_fake_nccl

namespace ddp_harness {
inline ddp_fake_nccl::stats_t nccl_stats; /* for tests: the fake NCCL's calls */
}

struct ncclComm {
    char *seg;
    size_t seg_bytes;
    ddp_fake_nccl::layout_t l;
    int rank, nranks, device;
    uint64_t seq;   /* collectives called */
    uint64_t round; /* rounds done: the half of the slots is round % 2 */
    ncclResult_t async; /* the first failure, kept */
    char error[1024];
    char name[96];    /* the segment's name when made: ncclCommShrink names its child's after it */
    unsigned shrinks; /* children made by ncclCommShrink */
    bool revoked;     /* ncclCommRevoke: collectives fail, shrink and destroy still work */
};

namespace ddp_fake_nccl {

inline header_t *hdr(ncclComm_t c) { return (header_t *)(void *)c->seg; }
inline rank_t *rank_at(ncclComm_t c, int r) { return (rank_t *)(void *)(c->seg + c->l.ranks + (size_t)r * 256); }
inline ring_t *ring_at(ncclComm_t c, int src, int dst) {
    return (ring_t *)(void *)(c->seg + c->l.rings + ((size_t)src * (size_t)c->nranks + (size_t)dst) * sizeof(ring_t));
}
inline char *ring_data(ncclComm_t c, int src, int dst) {
    return c->seg + c->l.data + ((size_t)src * (size_t)c->nranks + (size_t)dst) * c->l.ring;
}
inline char *slot_at(ncclComm_t c, int r, uint64_t half) { return c->seg + c->l.slots + ((size_t)r * 2 + half) * c->l.slot; }

inline uint32_t load32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline uint64_t load64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

inline double now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
inline double timeout_s() {
    const char *v = getenv("DDP_FAKE_NCCL_TIMEOUT");
    double t = v && *v ? strtod(v, nullptr) : 0;
    return t > 0 ? t : 120;
}
/* futex calls on words of the shared segment (not FUTEX_PRIVATE: other processes wait on them) */
inline void futex_wait(uint32_t *word, uint32_t expected, double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}
inline void wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }
inline void bump(uint32_t *word) { /* after a change that waiters on word look at */
    __atomic_fetch_add(word, 1u, __ATOMIC_RELEASE);
    wake(word);
}
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Record an error: the process's and the communicator's text (kept for ncclGetLastError), the
   communicator's async error when `keep` (it cannot be used any more). Returns code. */
__attribute__((format(printf, 4, 5))) inline ncclResult_t fail(ncclComm_t c, ncclResult_t code, bool keep, const char *fmt, ...) {
    va_list ap;
    int n = snprintf(last_error, sizeof last_error, "fake NCCL: ");
    if (c) n += snprintf(last_error + n, sizeof last_error - (size_t)n, "rank %d of %d: ", c->rank, c->nranks);
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    if (c) {
        snprintf(c->error, sizeof c->error, "%s", last_error);
        if (keep && c->async == ncclSuccess) c->async = code;
    }
    return code;
}

/* What keeps a wait on rank r of c from ending: the communicator aborted, r's process gone, r's
   communicator destroyed (NONE: nothing). Looked at without side effects: a peer may have delivered
   what is waited for just before it went, so the waiter looks once more at what it waits for after
   seeing trouble (the peer's writes come before its exit or its flags), and only then reports it. */
enum trouble_t { NONE, ABORTED, GONE, LEFT };
inline trouble_t trouble(ncclComm_t c, int r) {
    const rank_t *p = rank_at(c, r);
    const int pid = __atomic_load_n(&p->pid, __ATOMIC_ACQUIRE);
    if (load32(&hdr(c)->aborted)) return ABORTED;
    if (r == c->rank) return NONE;
    if (load32(&p->left)) return LEFT;
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) return GONE;
    return NONE;
}
/* The error for trouble t with rank r (the communicator keeps it). */
inline ncclResult_t report(ncclComm_t c, trouble_t t, int r, const char *what) {
    if (t == ABORTED) return fail(c, ncclRemoteError, true, "%s: the communicator was aborted: %.400s", what, hdr(c)->abort_msg);
    if (t == GONE)
        return fail(c, ncclRemoteError, true, "%s: rank %d (pid %d) is gone (its process exited)", what, r, rank_at(c, r)->pid);
    return fail(c, ncclRemoteError, true, "%s: rank %d destroyed its communicator (ncclCommDestroy) while this rank waits "
                "for it", what, r);
}
inline ncclResult_t check_aborted(ncclComm_t c, const char *what) {
    return load32(&hdr(c)->aborted) ? report(c, ABORTED, c->rank, what) : ncclSuccess;
}

/* Wait until done() holds. word is a futex word that is bumped after every change done() looks at;
   every rank is checked while waiting (all take part in what is waited for). */
template <typename Done>
inline ncclResult_t wait_for(ncclComm_t c, uint32_t *word, Done done, const char *what, double started) {
    const double limit = timeout_s();
    for (int i = 0;; i++) {
        const uint32_t seen = load32(word);
        if (done()) return ncclSuccess;
        if (i < 50) { /* a short spin: the peer may be about to arrive (2 cores, up to 4 ranks: not longer) */
            relax();
            continue;
        }
        for (int r = 0; r < c->nranks; r++) {
            const trouble_t t = trouble(c, r);
            if (t == NONE) continue;
            if (done()) return ncclSuccess; /* it came before the trouble */
            return report(c, t, r, what);
        }
        if (now() - started > limit)
            return fail(c, ncclSystemError, true, "%s: timed out after %g s (DDP_FAKE_NCCL_TIMEOUT): a rank did not make "
                        "the matching call, or is stuck", what, limit);
        if (i < 60) sched_yield();
        else futex_wait(word, seen, 0.01);
    }
}

/* ---- the barrier of a round: a counter and a generation ---- */
inline ncclResult_t barrier(ncclComm_t c, const char *what, double started) {
    header_t *h = hdr(c);
    const uint32_t gen = load32(&h->gen);
    if (__atomic_fetch_add(&h->arrive, 1u, __ATOMIC_ACQ_REL) == (uint32_t)c->nranks - 1) {
        __atomic_store_n(&h->arrive, 0u, __ATOMIC_RELAXED);
        bump(&h->gen);
        return ncclSuccess;
    }
    return wait_for(c, &h->gen, [&] { return load32(&h->gen) != gen; }, what, started);
}

/* ---- buffers: inside a harness allocation; opened for the call, closed after it ---- */
struct opened_t {
    std::vector<const void *> bases;
    void open(const void *p) {
        const ddp_harness::allocation *a = ddp_harness::find_allocation(p);
        if (!a) return;
        for (const void *b : bases)
            if (b == a->p) return;
        bases.push_back(a->p);
        ddp_harness::protect(a, true);
    }
    ~opened_t() {
        for (const void *b : bases) ddp_harness::protect(ddp_harness::find_allocation(b), false);
    }
};

inline ncclResult_t check_buffer(ncclComm_t c, const char *call, const char *what, const void *p, size_t bytes) {
    const ddp_harness::allocation *a;
    if (!bytes) return ncclSuccess;
    a = ddp_harness::find_allocation(p);
    if (!a)
        return fail(c, ncclInvalidArgument, false, "%s: %s %p (%zu bytes) is not memory of cudaMalloc or cudaMallocHost "
                    "(NCCL needs device memory)", call, what, p, bytes);
    if ((size_t)(a->p + a->bytes - (const char *)p) < bytes)
        return fail(c, ncclInvalidArgument, false, "%s: %s %p (%zu bytes) runs %zu bytes past the end of its allocation "
                    "(%zu bytes at %p)", call, what, p, bytes, bytes - (size_t)(a->p + a->bytes - (const char *)p), a->bytes,
                    (const void *)a->p);
    return ncclSuccess;
}
inline bool overlap(const void *a, size_t an, const void *b, size_t bn) {
    return an && bn && (const char *)a < (const char *)b + bn && (const char *)b < (const char *)a + an;
}

/* A call on c: c exists and has not failed (then the call fails with that error and keeps its text). */
inline ncclResult_t check_comm(ncclComm_t c, const char *call) {
    if (!c) return fail(nullptr, ncclInvalidArgument, false, "%s: comm is NULL", call);
    if (c->async != ncclSuccess) {
        snprintf(last_error, sizeof last_error, "%s: the communicator failed earlier: %.900s", call, c->error);
        return c->async;
    }
    if (c->revoked) return fail(nullptr, ncclInvalidUsage, false, "%s: the communicator was revoked (ncclCommRevoke)", call);
    return check_aborted(c, call);
}

/* ---- reductions: out[i] = src[0][i] op src[1][i] op ... (rank order), m elements ---- */
template <typename T>
inline T ld(const char *p) {
    T v;
    memcpy(&v, p, sizeof v);
    return v;
}
template <typename T>
inline void st(char *p, T v) {
    memcpy(p, &v, sizeof v);
}
template <typename F>
inline F combine_float(F a, F b, ncclRedOp_t op) {
    switch (op) {
    case ncclProd: return a * b;
    case ncclMin: return (a < b || a != a) ? a : b;
    case ncclMax: return (a > b || a != a) ? a : b;
    default: return a + b;
    }
}
template <typename T>
inline void reduce_float(char *out, char *const *src, int n, size_t m, ncclRedOp_t op) {
    for (size_t i = 0; i < m; i++) {
        T acc = ld<T>(src[0] + i * sizeof(T));
        for (int r = 1; r < n; r++) acc = combine_float(acc, ld<T>(src[r] + i * sizeof(T)), op);
        if (op == ncclAvg) acc = acc / (T)n;
        st<T>(out + i * sizeof(T), acc);
    }
}
/* f16 / bf16: the bits through float, rounded back after every step */
template <typename H>
inline float half_to_float(uint16_t bits) {
    H h;
    h.__x = bits;
    if constexpr (std::is_same<H, __half>::value) return __half2float(h);
    else return __bfloat162float(h);
}
template <typename H>
inline uint16_t float_to_half(float f) {
    if constexpr (std::is_same<H, __half>::value) return __float2half_rn(f).__x;
    else return __float2bfloat16_rn(f).__x;
}
template <typename H>
inline void reduce_half(char *out, char *const *src, int n, size_t m, ncclRedOp_t op) {
    for (size_t i = 0; i < m; i++) {
        uint16_t acc = ld<uint16_t>(src[0] + i * 2);
        for (int r = 1; r < n; r++)
            acc = float_to_half<H>(combine_float(half_to_float<H>(acc), half_to_float<H>(ld<uint16_t>(src[r] + i * 2)), op));
        if (op == ncclAvg) acc = float_to_half<H>(half_to_float<H>(acc) / (float)n);
        st<uint16_t>(out + i * 2, acc);
    }
}
template <typename T>
inline void reduce_int(char *out, char *const *src, int n, size_t m, ncclRedOp_t op) {
    typedef typename std::make_unsigned<T>::type U;
    for (size_t i = 0; i < m; i++) {
        T acc = ld<T>(src[0] + i * sizeof(T));
        for (int r = 1; r < n; r++) {
            const T x = ld<T>(src[r] + i * sizeof(T));
            switch (op) {
            case ncclProd: acc = (T)((U)acc * (U)x); break;
            case ncclMin: acc = x < acc ? x : acc; break;
            case ncclMax: acc = x > acc ? x : acc; break;
            default: acc = (T)((U)acc + (U)x); break;
            }
        }
        if (op == ncclAvg) {
            if (std::is_signed<T>::value) acc = (T)((long long)acc / (long long)n);
            else acc = (T)((unsigned long long)acc / (unsigned long long)n);
        }
        st<T>(out + i * sizeof(T), acc);
    }
}
inline void reduce(char *out, char *const *src, int n, size_t m, ncclDataType_t t, ncclRedOp_t op) {
    switch (t) {
    case ncclInt8: reduce_int<int8_t>(out, src, n, m, op); break;
    case ncclUint8: reduce_int<uint8_t>(out, src, n, m, op); break;
    case ncclInt32: reduce_int<int32_t>(out, src, n, m, op); break;
    case ncclUint32: reduce_int<uint32_t>(out, src, n, m, op); break;
    case ncclInt64: reduce_int<int64_t>(out, src, n, m, op); break;
    case ncclUint64: reduce_int<uint64_t>(out, src, n, m, op); break;
    case ncclFloat16: reduce_half<__half>(out, src, n, m, op); break;
    case ncclBfloat16: reduce_half<__nv_bfloat16>(out, src, n, m, op); break;
    case ncclFloat32: reduce_float<float>(out, src, n, m, op); break;
    default: reduce_float<double>(out, src, n, m, op); break;
    }
}

/* ---- collectives ---- */
inline ncclResult_t collective(int kind, const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, int root, ncclComm_t c, cudaStream_t stream) {
    const char *call = kind_name(kind);
    const bool reduces = kind == K_ALL_REDUCE || kind == K_REDUCE || kind == K_REDUCE_SCATTER;
    const bool rooted = kind == K_BROADCAST || kind == K_REDUCE;
    ncclResult_t rc;
    if ((rc = check_comm(c, call)) != ncclSuccess) return rc;
    const int n = c->nranks, me = c->rank;
    if (group_depth > 0) {
        group_error = ncclInvalidUsage;
        return fail(c, ncclInvalidUsage, false, "%s inside ncclGroupStart/ncclGroupEnd: grouped collectives are not "
                    "emulated by the fake NCCL (only ncclSend/ncclRecv)", call);
    }
    if ((int)type < 0 || (int)type >= ncclNumTypes) return fail(c, ncclInvalidArgument, false, "%s: datatype %d", call, (int)type);
    if (reduces && ((int)op < 0 || (int)op >= ncclNumOps)) return fail(c, ncclInvalidArgument, false, "%s: op %d", call, (int)op);
    if (rooted && (root < 0 || root >= n)) return fail(c, ncclInvalidArgument, false, "%s: root %d of %d ranks", call, root, n);
    const size_t es = type_size(type), bytes = count * es, big = bytes * (size_t)n;
    /* what this rank reads and writes */
    const size_t send_bytes = kind == K_REDUCE_SCATTER ? big : kind == K_BROADCAST && me != root ? 0 : bytes;
    const size_t recv_bytes = kind == K_ALL_GATHER ? big : kind == K_REDUCE && me != root ? 0 : bytes;
    if ((rc = check_buffer(c, call, "sendbuff", sendbuff, send_bytes)) != ncclSuccess ||
        (rc = check_buffer(c, call, "recvbuff", recvbuff, recv_bytes)) != ncclSuccess)
        return rc;
    {
        const char *in_place = kind == K_ALL_GATHER ? (const char *)recvbuff + (size_t)me * bytes
                               : kind == K_REDUCE_SCATTER ? (const char *)sendbuff + (size_t)me * bytes
                                                          : (const char *)recvbuff;
        const bool same = kind == K_REDUCE_SCATTER ? (const char *)recvbuff == in_place : (const char *)sendbuff == in_place;
        if (!same && overlap(sendbuff, send_bytes, recvbuff, recv_bytes))
            return fail(c, ncclInvalidArgument, false, "%s: sendbuff %p (%zu bytes) and recvbuff %p (%zu bytes) overlap, "
                        "and not in NCCL's in-place form (%s)", call, sendbuff, send_bytes, recvbuff, recv_bytes,
                        kind == K_ALL_GATHER ? "sendbuff = recvbuff + rank * sendcount"
                        : kind == K_REDUCE_SCATTER ? "recvbuff = sendbuff + rank * recvcount"
                                                   : "sendbuff = recvbuff");
    }
    ddp_harness::nccl_stats.collectives++;
    ddp_harness::nccl_stats.last_stream = stream;
    ddp_harness::flush_copies(); /* copies queued before the call, on any stream */
    opened_t opened;
    if (send_bytes) opened.open(sendbuff);
    if (recv_bytes) opened.open(recvbuff);
    const char *send = (const char *)sendbuff;
    char *recv = (char *)recvbuff;
    const size_t per_round = kind == K_REDUCE_SCATTER ? c->l.slot / (es * (size_t)n) : c->l.slot / es;
    const uint64_t seq = c->seq++;
    const double started = now();
    std::vector<char *> src((size_t)n);
    char what[160];
    snprintf(what, sizeof what, "%s (collective #%llu, count %zu, %s)", call, (unsigned long long)seq, count, type_name(type));
    size_t a = 0;
    do { /* one round at least: the calls are compared in the first */
        const size_t m = count - a < per_round ? count - a : per_round;
        const uint64_t half = c->round++ & 1;
        char *mine = slot_at(c, me, half);
        desc_t *d = &rank_at(c, me)->desc[half];
        d->seq = seq;
        d->count = count;
        d->kind = kind;
        d->type = (int32_t)type;
        d->op = reduces ? (int32_t)op : -1;
        d->root = rooted ? root : -1;
        if (kind == K_REDUCE_SCATTER) {
            for (int b = 0; b < n; b++) memcpy(mine + (size_t)b * m * es, send + ((size_t)b * count + a) * es, m * es);
        } else if (m && (kind != K_BROADCAST || me == root)) {
            memcpy(mine, send + a * es, m * es);
        }
        if ((rc = barrier(c, what, started)) != ncclSuccess) return rc;
        if (a == 0) { /* every rank compares every rank's call with rank 0's: all report the same difference */
            const desc_t *d0 = &rank_at(c, 0)->desc[half];
            for (int r = 1; r < n; r++) {
                const desc_t *dr = &rank_at(c, r)->desc[half];
                if (dr->seq == d0->seq && dr->count == d0->count && dr->kind == d0->kind && dr->type == d0->type &&
                    dr->op == d0->op && dr->root == d0->root)
                    continue;
                return fail(c, ncclInvalidUsage, true, "the ranks' calls differ: rank 0's collective #%llu is %s(count %llu, "
                            "%s, op %s, root %d) while rank %d's collective #%llu is %s(count %llu, %s, op %s, root %d) (NCCL "
                            "would hang or corrupt memory)",
                            (unsigned long long)d0->seq, kind_name(d0->kind), (unsigned long long)d0->count,
                            type_name(d0->type), op_name(d0->op), d0->root, r, (unsigned long long)dr->seq,
                            kind_name(dr->kind), (unsigned long long)dr->count, type_name(dr->type), op_name(dr->op), dr->root);
            }
        }
        for (int r = 0; r < n; r++) src[(size_t)r] = slot_at(c, r, half) + (kind == K_REDUCE_SCATTER ? (size_t)me * m * es : 0);
        switch (kind) {
        case K_ALL_REDUCE:
        case K_REDUCE_SCATTER: reduce(recv + a * es, src.data(), n, m, type, op); break;
        case K_REDUCE:
            if (me == root) reduce(recv + a * es, src.data(), n, m, type, op);
            break;
        case K_BROADCAST:
            if (m && recv + a * es != src[(size_t)root]) memcpy(recv + a * es, src[(size_t)root], m * es);
            break;
        default: /* all_gather */
            for (int r = 0; r < n; r++)
                if (m) memcpy(recv + ((size_t)r * count + a) * es, src[(size_t)r], m * es);
            break;
        }
        a += m;
    } while (a < count);
    return ncclSuccess;
}

/* ---- send / receive ---- */
struct msg_header_t {
    uint64_t count;
    uint32_t type, magic;
};
static_assert(sizeof(msg_header_t) == 16, "message header");
constexpr uint32_t msg_magic = 0x5032504eu;

inline void ring_put(ncclComm_t c, int dst, uint64_t at, const char *from, size_t bytes) {
    char *data = ring_data(c, c->rank, dst);
    const size_t R = c->l.ring, off = (size_t)(at % R), first = bytes < R - off ? bytes : R - off;
    memcpy(data + off, from, first);
    memcpy(data, from + first, bytes - first);
}
inline void ring_get(ncclComm_t c, int src, uint64_t at, char *to, size_t bytes) {
    const char *data = ring_data(c, src, c->rank);
    const size_t R = c->l.ring, off = (size_t)(at % R), first = bytes < R - off ? bytes : R - off;
    memcpy(to, data + off, first);
    memcpy(to + first, data, bytes - first);
}

/* Advance op as far as its ring allows: whether it moved anything (or failed: *rc). */
inline bool advance(p2p_t &op, ncclResult_t *rc) {
    ncclComm_t c = op.comm;
    const size_t R = c->l.ring;
    bool moved = false;
    if (op.send) {
        ring_t *ring = ring_at(c, c->rank, op.peer);
        uint64_t tail = ring->tail; /* only this rank writes it */
        const uint64_t head = load64(&ring->head);
        if (!op.header_done) {
            if (R - (size_t)(tail - head) < sizeof(msg_header_t)) return false;
            const msg_header_t h = {op.count, (uint32_t)op.type, msg_magic};
            ring_put(c, op.peer, tail, (const char *)&h, sizeof h);
            tail += sizeof h;
            op.header_done = moved = true;
        }
        size_t k = R - (size_t)(tail - head);
        if (k > op.bytes - op.done) k = op.bytes - op.done;
        if (k) {
            ring_put(c, op.peer, tail, op.buf + op.done, k);
            tail += k;
            op.done += k;
            moved = true;
        }
        if (moved) {
            store64(&ring->tail, tail);
            bump(&rank_at(c, op.peer)->doorbell);
        }
    } else {
        ring_t *ring = ring_at(c, op.peer, c->rank);
        uint64_t head = ring->head; /* only this rank writes it */
        const uint64_t tail = load64(&ring->tail);
        if (!op.header_done) {
            msg_header_t h;
            if ((size_t)(tail - head) < sizeof h) return false;
            ring_get(c, op.peer, head, (char *)&h, sizeof h);
            if (h.magic != msg_magic || h.count != op.count || h.type != (uint32_t)op.type) {
                *rc = fail(c, ncclInvalidUsage, true, "ncclRecv of %zu elements of %s from rank %d met %s of %llu elements of "
                           "%s: the counts and types of a send and its receive must be the same", op.count,
                           type_name(op.type), op.peer, h.magic == msg_magic ? "an ncclSend" : "garbage (not a message)",
                           (unsigned long long)h.count, type_name((int)h.type));
                return false;
            }
            head += sizeof h;
            op.header_done = moved = true;
        }
        size_t k = (size_t)(tail - head);
        if (k > op.bytes - op.done) k = op.bytes - op.done;
        if (k) {
            ring_get(c, op.peer, head, op.buf + op.done, k);
            head += k;
            op.done += k;
            moved = true;
        }
        if (moved) {
            store64(&ring->head, head);
            bump(&rank_at(c, op.peer)->doorbell);
        }
    }
    if (op.header_done && op.done == op.bytes) op.complete = true;
    return moved;
}

/* Run the pending sends and receives together until all are done. */
inline ncclResult_t run_group(std::vector<p2p_t> &ops) {
    ncclResult_t rc = ncclSuccess;
    if (ops.empty()) return ncclSuccess;
    ddp_harness::nccl_stats.groups++;
    for (size_t i = 0; i < ops.size(); i++) /* a receive overlapping another buffer of the group: a race on a GPU */
        for (size_t j = 0; j < ops.size(); j++)
            if (i != j && !ops[i].send && overlap(ops[i].buf, ops[i].bytes, ops[j].buf, ops[j].bytes))
                return fail(ops[i].comm, ncclInvalidUsage, false, "ncclRecv into %p (%zu bytes, from rank %d) overlaps the "
                            "buffer of an %s of the same group (%p, %zu bytes, %s rank %d)", (void *)ops[i].buf,
                            ops[i].bytes, ops[i].peer, ops[j].send ? "ncclSend" : "ncclRecv", (void *)ops[j].buf,
                            ops[j].bytes, ops[j].send ? "to" : "from", ops[j].peer);
    ddp_harness::flush_copies();
    opened_t opened;
    for (const p2p_t &op : ops) opened.open(op.buf);
    const double started = now();
    ncclComm_t c = ops[0].comm; /* the doorbell waited on; the others are polled (a 1 ms futex timeout) */
    bool several = false;
    size_t troubled = ops.size(); /* an op whose peer was in trouble before the last pass (none: ops.size()) */
    trouble_t seen_trouble = NONE;
    for (const p2p_t &op : ops) several = several || op.comm != c;
    for (;;) {
        uint32_t *bell = &rank_at(c, c->rank)->doorbell;
        const uint32_t seen = load32(bell);
        bool all = true, moved = false;
        for (size_t i = 0; i < ops.size(); i++) {
            bool blocked = false;
            if (ops[i].complete) continue;
            all = false;
            for (size_t j = 0; j < i && !blocked; j++) /* messages to (from) one peer go in call order */
                blocked = !ops[j].complete && ops[j].comm == ops[i].comm && ops[j].peer == ops[i].peer &&
                          ops[j].send == ops[i].send;
            if (blocked) continue;
            moved = advance(ops[i], &rc) || moved;
            if (rc != ncclSuccess) return rc;
        }
        if (all) return ncclSuccess;
        if (moved) {
            troubled = ops.size();
            continue;
        }
        /* nothing moved: trouble seen before this pass is final; look for trouble (then pass once more),
           check the clock, sleep on the doorbell */
        for (size_t i = 0; i < ops.size(); i++) {
            const p2p_t &op = ops[i];
            char what[160];
            if (op.complete) continue;
            snprintf(what, sizeof what, "%s of %zu elements of %s %s rank %d in a group of %zu", op.send ? "ncclSend" : "ncclRecv",
                     op.count, type_name(op.type), op.send ? "to" : "from", op.peer, ops.size());
            if (troubled == i) return report(op.comm, seen_trouble, op.peer, what);
            if (troubled == ops.size() && (seen_trouble = trouble(op.comm, op.peer)) != NONE) troubled = i;
            if (now() - started > timeout_s())
                return fail(op.comm, ncclSystemError, true, "%s: timed out after %g s (DDP_FAKE_NCCL_TIMEOUT): the peer did "
                            "not make the matching call, or is stuck", what, timeout_s());
        }
        if (troubled == ops.size()) futex_wait(bell, seen, several ? 0.001 : 0.01);
    }
}

inline ncclResult_t p2p(bool send, void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t c, cudaStream_t stream) {
    const char *call = send ? "ncclSend" : "ncclRecv";
    ncclResult_t rc = check_comm(c, call);
    if (rc == ncclSuccess && ((int)type < 0 || (int)type >= ncclNumTypes))
        rc = fail(c, ncclInvalidArgument, false, "%s: datatype %d", call, (int)type);
    if (rc == ncclSuccess && (peer < 0 || peer >= c->nranks))
        rc = fail(c, ncclInvalidArgument, false, "%s: peer %d of %d ranks", call, peer, c->nranks);
    if (rc == ncclSuccess) rc = check_buffer(c, call, send ? "sendbuff" : "recvbuff", buf, count * type_size(type));
    if (rc != ncclSuccess) {
        if (group_depth > 0) group_error = rc;
        return rc;
    }
    if (send) ddp_harness::nccl_stats.sends++;
    else ddp_harness::nccl_stats.recvs++;
    ddp_harness::nccl_stats.last_stream = stream;
    if (!count) return ncclSuccess; /* nothing to move: no message */
    p2p_t op = {c, peer, send, (char *)buf, count, count * type_size(type), 0, type, false, false};
    if (group_depth > 0) {
        pending.push_back(op);
        return ncclSuccess;
    }
    std::vector<p2p_t> one(1, op);
    return run_group(one);
}

inline uint64_t chunk_from_env() {
    const char *v = getenv("DDP_FAKE_NCCL_CHUNK");
    char *end = nullptr;
    unsigned long long b;
    if (!v || !*v) return default_chunk;
    b = strtoull(v, &end, 10);
    if (*end || b < 64 || b > (1ull << 30)) {
        fprintf(stderr, "fake NCCL: DDP_FAKE_NCCL_CHUNK=%s is not a number of bytes in [64, 2^30]\n", v);
        abort();
    }
    return b;
}

} // namespace ddp_fake_nccl

/* ---- the API ---- */

inline ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

inline const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* The last error's text: the communicator's when it has one, else the process's last. */
inline const char *ncclGetLastError(ncclComm_t comm) {
    if (comm && comm->error[0]) return comm->error;
    return ddp_fake_nccl::last_error;
}

inline ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    using namespace ddp_fake_nccl;
    static unsigned counter;
    struct timespec ts;
    unique_t id;
    if (!uniqueId) return fail(nullptr, ncclInvalidArgument, false, "ncclGetUniqueId: uniqueId is NULL");
    clock_gettime(CLOCK_REALTIME, &ts);
    const uint64_t r = ddp_harness::mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 40) ^ counter);
    memset(&id, 0, sizeof id);
    id.magic = id_magic;
    id.chunk = chunk_from_env();
    snprintf(id.name, sizeof id.name, "/ddp-fake-nccl-%d-%u-%016llx", (int)getpid(), counter++, (unsigned long long)r);
    memset(uniqueId, 0, sizeof *uniqueId);
    memcpy(uniqueId->internal, &id, sizeof id);
    return ncclSuccess;
}

inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    using namespace ddp_fake_nccl;
    unique_t id;
    struct stat st;
    int fd;
    if (!comm) return fail(nullptr, ncclInvalidArgument, false, "ncclCommInitRank: comm is NULL");
    *comm = nullptr;
    memcpy(&id, commId.internal, sizeof id);
    id.name[sizeof id.name - 1] = '\0';
    if (id.magic != id_magic)
        return fail(nullptr, ncclInvalidArgument, false, "ncclCommInitRank: the unique id is not one of the fake NCCL's "
                    "ncclGetUniqueId");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return fail(nullptr, ncclInvalidArgument, false, "ncclCommInitRank: rank %d of %d", rank, nranks);
    const layout_t l = layout(nranks, id.chunk);
    fd = shm_open(id.name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) return fail(nullptr, ncclSystemError, false, "ncclCommInitRank: shm_open(%s): %s", id.name, strerror(errno));
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < l.total && ftruncate(fd, (off_t)l.total) != 0)) {
        const int e = errno;
        close(fd);
        shm_unlink(id.name);
        return fail(nullptr, ncclSystemError, false, "ncclCommInitRank: sizing %s to %zu bytes: %s", id.name, l.total,
                    strerror(e));
    }
    void *m = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(id.name);
        return fail(nullptr, ncclSystemError, false, "ncclCommInitRank: mmap of %s: %s", id.name, strerror(errno));
    }
    ncclComm_t c = new ncclComm();
    c->seg = (char *)m;
    c->seg_bytes = l.total;
    c->l = l;
    c->rank = rank;
    c->nranks = nranks;
    snprintf(c->name, sizeof c->name, "%s", id.name);
    cudaGetDevice(&c->device);
    header_t *h = hdr(c);
    uint32_t expected = 0;
    uint64_t expected_chunk = 0;
    int32_t no_pid = 0;
    ncclResult_t rc = ncclSuccess;
    if (!__atomic_compare_exchange_n(&h->nranks, &expected, (uint32_t)nranks, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
        expected != (uint32_t)nranks)
        rc = fail(c, ncclInvalidUsage, false, "ncclCommInitRank: this rank says %d ranks, another said %u", nranks, expected);
    else if (!__atomic_compare_exchange_n(&h->chunk, &expected_chunk, id.chunk, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
             expected_chunk != id.chunk)
        rc = fail(c, ncclInvalidUsage, false, "ncclCommInitRank: the ranks' unique ids differ");
    else if (!__atomic_compare_exchange_n(&rank_at(c, rank)->pid, &no_pid, (int32_t)getpid(), false, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE))
        rc = fail(c, ncclInvalidUsage, false, "ncclCommInitRank: rank %d joined twice (pids %d and %d)", rank, no_pid,
                  (int)getpid());
    if (rc == ncclSuccess) {
        bump(&h->joined);
        rc = wait_for(c, &h->joined, [&] { return load32(&h->joined) >= (uint32_t)nranks; },
                      "ncclCommInitRank (waiting for every rank to join)", now());
        if (rc != ncclSuccess) {
            char why[sizeof c->error];
            snprintf(why, sizeof why, "%s", c->error);
            fail(c, rc, false, "%u of %d ranks joined %s; %.700s", load32(&h->joined), nranks, id.name, why);
        }
    }
    shm_unlink(id.name); /* all have it mapped (or it failed): the name goes, the memory stays while mapped */
    if (rc != ncclSuccess) {
        munmap(c->seg, c->seg_bytes);
        delete c;
        return rc;
    }
    c->error[0] = '\0';
    ddp_harness::nccl_stats.inits++;
    *comm = c;
    return ncclSuccess;
}

inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    using namespace ddp_fake_nccl;
    if (!comm) return ncclInvalidArgument;
    if (ddp_fake_nccl::group_depth > 0)
        for (size_t i = pending.size(); i-- > 0;)
            if (pending[i].comm == comm) pending.erase(pending.begin() + (std::ptrdiff_t)i);
    __atomic_store_n(&rank_at(comm, comm->rank)->left, 1u, __ATOMIC_RELEASE);
    wake(&hdr(comm)->gen); /* waiters look again, and see this rank gone */
    wake(&hdr(comm)->joined);
    for (int r = 0; r < comm->nranks; r++) wake(&rank_at(comm, r)->doorbell);
    munmap(comm->seg, comm->seg_bytes);
    delete comm;
    return ncclSuccess;
}

/* Marks the segment aborted (the other ranks' waits and later calls fail at once), then frees comm. */
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
    using namespace ddp_fake_nccl;
    header_t *h;
    uint32_t none = 0;
    if (!comm) return ncclSuccess;
    h = hdr(comm);
    if (__atomic_compare_exchange_n(&h->aborted, &none, (uint32_t)comm->rank + 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        snprintf(h->abort_msg, sizeof h->abort_msg, "rank %d called ncclCommAbort%s%.400s", comm->rank,
                 comm->error[0] ? " after: " : "", comm->error);
    return ncclCommDestroy(comm); /* which wakes every waiter */
}

inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!comm || !asyncError) return ncclInvalidArgument;
    *asyncError = comm->async;
    return ncclSuccess;
}

/* ncclConfig_t: the fields ddp_cuda.cu sets. A non-blocking communicator (blocking = 0) is accepted, but
   every call still runs to completion inside it and returns its result, never ncclInProgress (which a
   caller of a real non-blocking communicator must be ready for). */
typedef struct ncclConfig_v21400 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), NCCL_CONFIG_UNDEF_INT}

inline ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config) {
    if (config && (config->size != sizeof(ncclConfig_t) || config->magic != 0xcafebeef))
        return ddp_fake_nccl::fail(nullptr, ncclInvalidArgument, false, "ncclCommInitRankConfig: the config was not made "
                                   "with NCCL_CONFIG_INITIALIZER");
    return ncclCommInitRank(comm, nranks, commId, rank);
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define NCCL_SHRINK_DEFAULT 0x00
#define NCCL_SHRINK_ABORT 0x01
/* The ranks not excluded make a child communicator without a unique id: its segment is named after the
   parent's (each rank counts its parent's shrinks alike) and ranks keep their order. The excluded ranks do
   not call it (they may be gone). NCCL_SHRINK_ABORT first revokes the parent (its collectives fail). */
inline ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm,
                                   ncclConfig_t *config, int shrinkFlags) {
    using namespace ddp_fake_nccl;
    unique_t id;
    ncclUniqueId u;
    int below = 0;
    (void)config;
    if (!comm || !newcomm || excludeRanksCount < 0 || (excludeRanksCount && !excludeRanksList))
        return fail(nullptr, ncclInvalidArgument, false, "ncclCommShrink: bad arguments");
    *newcomm = nullptr;
    for (int i = 0; i < excludeRanksCount; i++) {
        if (excludeRanksList[i] < 0 || excludeRanksList[i] >= comm->nranks || excludeRanksList[i] == comm->rank)
            return fail(nullptr, ncclInvalidArgument, false, "ncclCommShrink: rank %d of %d excludes rank %d", comm->rank,
                        comm->nranks, excludeRanksList[i]);
        for (int j = 0; j < i; j++)
            if (excludeRanksList[j] == excludeRanksList[i])
                return fail(nullptr, ncclInvalidArgument, false, "ncclCommShrink: rank %d excluded twice", excludeRanksList[i]);
        below += excludeRanksList[i] < comm->rank;
    }
    if (shrinkFlags & NCCL_SHRINK_ABORT) comm->revoked = true;
    memset(&id, 0, sizeof id);
    id.magic = id_magic;
    id.chunk = __atomic_load_n(&hdr(comm)->chunk, __ATOMIC_ACQUIRE);
    snprintf(id.name, sizeof id.name, "%.80s-s%u", comm->name, comm->shrinks++);
    memset(&u, 0, sizeof u);
    memcpy(u.internal, &id, sizeof id);
    ddp_harness::nccl_stats.shrinks++;
    return ncclCommInitRank(newcomm, comm->nranks - excludeRanksCount, u, comm->rank - below);
}
#endif

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define NCCL_REVOKE_DEFAULT 0x00
/* Stops the communicator's work: later collectives fail; shrink and destroy still work. Local. */
inline ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) {
    if (!comm || revokeFlags != NCCL_REVOKE_DEFAULT) return ncclInvalidArgument;
    comm->revoked = true;
    return ncclSuccess;
}
#endif
inline ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm || !count) return ncclInvalidArgument;
    *count = comm->nranks;
    return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm || !rank) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!comm || !device) return ncclInvalidArgument;
    *device = comm->device;
    return ncclSuccess;
}

inline ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                                  ncclComm_t comm, cudaStream_t stream) {
    return ddp_fake_nccl::collective(ddp_fake_nccl::K_ALL_REDUCE, sendbuff, recvbuff, count, datatype, op, -1, comm, stream);
}
inline ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                                  ncclComm_t comm, cudaStream_t stream) {
    return ddp_fake_nccl::collective(ddp_fake_nccl::K_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm,
                                     stream);
}
inline ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                               int root, ncclComm_t comm, cudaStream_t stream) {
    return ddp_fake_nccl::collective(ddp_fake_nccl::K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}
inline ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
    return ddp_fake_nccl::collective(ddp_fake_nccl::K_ALL_GATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, -1, comm,
                                     stream);
}
inline ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return ddp_fake_nccl::collective(ddp_fake_nccl::K_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, datatype, op, -1, comm,
                                     stream);
}
inline ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
    return ddp_fake_nccl::p2p(true, (void *)sendbuff, count, datatype, peer, comm, stream);
}
inline ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
    return ddp_fake_nccl::p2p(false, recvbuff, count, datatype, peer, comm, stream);
}

inline ncclResult_t ncclGroupStart() {
    if (ddp_fake_nccl::group_depth++ == 0) ddp_fake_nccl::group_error = ncclSuccess;
    return ncclSuccess;
}
/* The outermost ncclGroupEnd runs the group's sends and receives; after a failed call inside the group
   it drops them all and returns that failure. */
inline ncclResult_t ncclGroupEnd() {
    using namespace ddp_fake_nccl;
    if (group_depth <= 0) return fail(nullptr, ncclInvalidUsage, false, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth > 0) return ncclSuccess;
    std::vector<p2p_t> ops;
    ops.swap(pending);
    if (group_error != ncclSuccess) return group_error;
    return run_group(ops);
}

#endif /* DDP_CUDA_HARNESS_NCCL_H */
