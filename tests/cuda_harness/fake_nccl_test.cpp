/* tests/cuda_harness/fake_nccl_test.cpp: the harness's fake NCCL (tests/cuda_harness/nccl.h) by itself, through
   NCCL's API alone (no ddp.h), so that what tests on the nccl backend rest on is checked on its own. Built and
   run by tests/test_nccl_harness.sh (-DDDP_HARNESS_NCCL). Ranks are forked processes sharing a unique id made
   before the fork; chunks and rings of 256 bytes (DDP_FAKE_NCCL_CHUNK) make every call take many rounds and
   wrap the rings.

   1, 2, 3 and 4 ranks: every collective, type and op on device memory, counts 0 to 1000 (not multiples of a
   round), in place and not, data that differs per element and rank (a block or element out of place shows),
   against references computed here (exact small integers; ncclAvg: the sum divided by nranks, rounded to
   the type once); the root's buffer alone written by ncclReduce; grouped ncclSend/ncclRecv between every
   pair and to itself, several messages to one peer in call order, sizes from 0 to 3 KB through 256-byte
   rings; a lone send and receive. After each call the device memory is closed again (PROT_NONE in
   /proc/self/maps) and ddp_harness::nccl_stats saw the call on its stream; the segment's name is gone
   from /dev/shm once ncclCommInitRank returns.

   Failures, each an error and never a hang: ranks whose calls differ (ncclInvalidUsage on every rank, kept:
   later calls fail at once); a receive whose type differs from the send's; host memory, a range past its
   allocation, an overlap that is not NCCL's in-place form, a collective inside a group; a peer whose process
   exited, that aborted (ncclCommAbort), that destroyed its communicator, or that is late beyond
   DDP_FAKE_NCCL_TIMEOUT (0.5 s here: ncclSystemError); a rank that never joins ncclCommInitRank (and no segment left
   behind). */
#include "check.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <sys/wait.h>
#include <vector>

static ncclUniqueId uid; /* made by the parent before each fork */
static const double soon = 5; /* seconds within which a failure must be reported */

/* ---- ranks: fork n, each exits with fn's code; failures counted (a rank still running at the limit is killed) ---- */
static int run_ranks(int n, int (*fn)(int rank, int n), double limit) {
    std::vector<pid_t> pids((size_t)n);
    int failed = 0, left = n;
    const double start = ddp_fake_nccl::now();
    CHECK(ncclGetUniqueId(&uid) == ncclSuccess, "ncclGetUniqueId");
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < n; r++) {
        pids[(size_t)r] = fork();
        CHECK(pids[(size_t)r] >= 0, "fork");
        if (pids[(size_t)r] == 0) exit(fn(r, n));
    }
    while (left > 0) {
        int st;
        const pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            left--;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                fprintf(stderr, "rank pid %d: %s %d\n", (int)p, WIFEXITED(st) ? "exit code" : "signal",
                        WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
                failed++;
            }
            continue;
        }
        if (ddp_fake_nccl::now() - start > limit) {
            fprintf(stderr, "ranks still running after %.0f s: killed\n", limit);
            for (pid_t q : pids) kill(q, SIGKILL);
            while (waitpid(-1, &st, 0) > 0) {}
            return failed + left;
        }
        usleep(1000); /* reaped promptly: a rank that exited is gone for kill(pid, 0) */
    }
    return failed;
}

static ncclComm_t join(int rank, int n) {
    ncclComm_t c = nullptr;
    ddp_fake_nccl::unique_t id;
    CHECK(cudaSetDevice(rank) == cudaSuccess, "cudaSetDevice(%d)", rank);
    CHECK(ncclCommInitRank(&c, n, uid, rank) == ncclSuccess, "ncclCommInitRank: %s", ncclGetLastError(nullptr));
    memcpy(&id, uid.internal, sizeof id);
    CHECK(shm_open(id.name, O_RDONLY, 0) < 0 && errno == ENOENT, "rank %d: %s is still in /dev/shm after ncclCommInitRank",
          rank, id.name);
    return c;
}

/* ---- device memory ---- */
static char *dev(size_t bytes) {
    void *p = nullptr;
    CHECK(cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess, "cudaMalloc");
    return (char *)p;
}
static void up(char *d, const std::vector<char> &h) {
    if (!h.empty()) CHECK(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy up");
}
static std::vector<char> down(const char *d, size_t bytes) {
    std::vector<char> h(bytes);
    if (bytes) CHECK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess, "cudaMemcpy down");
    return h;
}
/* Is the page holding p closed to the host (PROT_NONE)? */
static bool closed(const void *p) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    bool found = false, none = false;
    CHECK(f, "/proc/self/maps");
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && (uintptr_t)p >= lo && (uintptr_t)p < hi) {
            found = true;
            none = strncmp(perms, "---", 3) == 0;
        }
    }
    fclose(f);
    return found && none;
}

/* ---- values: small integers, exact in every type; they differ per element and rank ---- */
static const ncclDataType_t types[] = {ncclInt8,   ncclUint8,   ncclInt32,   ncclUint32,  ncclInt64,
                                       ncclUint64, ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16};
static const ncclRedOp_t ops[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
static bool is_unsigned(ncclDataType_t t) { return t == ncclUint8 || t == ncclUint32 || t == ncclUint64; }
static bool is_float(ncclDataType_t t) { return t == ncclFloat16 || t == ncclFloat32 || t == ncclFloat64 || t == ncclBfloat16; }

static double value(int rank, size_t i, ncclDataType_t t, ncclRedOp_t op) {
    if (op == ncclProd) {
        static const double s[3] = {1, -1, 2}, u[3] = {1, 3, 2};
        const size_t k = (i + (size_t)rank) % 3;
        return is_unsigned(t) ? u[k] : s[k];
    }
    const double v = (double)((i * 5 + (size_t)rank * 3 + 1) % 7) - 3; /* -3 .. 3 */
    return is_unsigned(t) ? v + 3 : v;
}
static void put(char *p, ncclDataType_t t, size_t i, double v) {
    const size_t es = ddp_fake_nccl::type_size(t);
    char *at = p + i * es;
    switch (t) {
    case ncclInt8: { int8_t x = (int8_t)v; memcpy(at, &x, es); break; }
    case ncclUint8: { uint8_t x = (uint8_t)v; memcpy(at, &x, es); break; }
    case ncclInt32: { int32_t x = (int32_t)v; memcpy(at, &x, es); break; }
    case ncclUint32: { uint32_t x = (uint32_t)v; memcpy(at, &x, es); break; }
    case ncclInt64: { int64_t x = (int64_t)v; memcpy(at, &x, es); break; }
    case ncclUint64: { uint64_t x = (uint64_t)v; memcpy(at, &x, es); break; }
    case ncclFloat16: { __half x = __float2half_rn((float)v); memcpy(at, &x, es); break; }
    case ncclBfloat16: { __nv_bfloat16 x = __float2bfloat16_rn((float)v); memcpy(at, &x, es); break; }
    case ncclFloat32: { float x = (float)v; memcpy(at, &x, es); break; }
    default: memcpy(at, &v, es); break;
    }
}
static double get(const char *p, ncclDataType_t t, size_t i) {
    const size_t es = ddp_fake_nccl::type_size(t);
    const char *at = p + i * es;
    switch (t) {
    case ncclInt8: { int8_t x; memcpy(&x, at, es); return x; }
    case ncclUint8: { uint8_t x; memcpy(&x, at, es); return x; }
    case ncclInt32: { int32_t x; memcpy(&x, at, es); return x; }
    case ncclUint32: { uint32_t x; memcpy(&x, at, es); return x; }
    case ncclInt64: { int64_t x; memcpy(&x, at, es); return (double)x; }
    case ncclUint64: { uint64_t x; memcpy(&x, at, es); return (double)x; }
    case ncclFloat16: { __half x; memcpy(&x, at, es); return __half2float(x); }
    case ncclBfloat16: { __nv_bfloat16 x; memcpy(&x, at, es); return __bfloat162float(x); }
    case ncclFloat32: { float x; memcpy(&x, at, es); return x; }
    default: { double x; memcpy(&x, at, es); return x; }
    }
}
/* op over ranks 0..n-1 of value(r, i); ncclAvg: the sum divided once, rounded to the type */
static double expect(int n, size_t i, ncclDataType_t t, ncclRedOp_t op) {
    double acc = value(0, i, t, op);
    for (int r = 1; r < n; r++) {
        const double v = value(r, i, t, op);
        acc = op == ncclProd ? acc * v : op == ncclMax ? (v > acc ? v : acc) : op == ncclMin ? (v < acc ? v : acc) : acc + v;
    }
    if (op != ncclAvg) return acc;
    if (!is_float(t)) return (double)((long long)acc / n);
    const float q = (float)acc / (float)n;
    if (t == ncclFloat16) return __half2float(__float2half_rn(q));
    if (t == ncclBfloat16) return __bfloat162float(__float2bfloat16_rn(q));
    return t == ncclFloat32 ? (double)q : acc / n;
}
static std::vector<char> filled(int rank, size_t count, ncclDataType_t t, ncclRedOp_t op, size_t first = 0) {
    std::vector<char> h(count * ddp_fake_nccl::type_size(t));
    for (size_t i = 0; i < count; i++) put(h.data(), t, i, value(rank, first + i, t, op));
    return h;
}

/* After a call: it went through, the memory is closed again, the stats saw it on this stream. */
static void done(ncclResult_t rc, const char *what, const char *d, cudaStream_t s, int rank) {
    CHECK(rc == ncclSuccess, "rank %d: %s: %s: %s", rank, what, ncclGetErrorString(rc), ncclGetLastError(nullptr));
    CHECK(closed(d), "rank %d: %s left device memory open to the host", rank, what);
    CHECK(ddp_harness::nccl_stats.last_stream == s, "rank %d: %s: stream", rank, what);
}

/* ---- 1. collectives ---- */
static int rank_collectives(int rank, int n) {
    static const size_t counts[] = {0, 1, 5, 33, 1000};
    ncclComm_t c = join(rank, n);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess, "cudaStreamCreate");
    for (ncclDataType_t t : types) {
        const size_t es = ddp_fake_nccl::type_size(t);
        const char *tn = ddp_fake_nccl::type_name(t);
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            const size_t count = counts[k];
            const bool in_place = k % 2 == 1;
            for (ncclRedOp_t op : ops) { /* all_reduce */
                char *send = dev(count * es), *recv = in_place ? send : dev(count * es);
                up(send, filled(rank, count, t, op));
                done(ncclAllReduce(send, recv, count, t, op, c, s), "ncclAllReduce", send, s, rank);
                std::vector<char> h = down(recv, count * es);
                for (size_t i = 0; i < count; i++)
                    CHECK(get(h.data(), t, i) == expect(n, i, t, op), "rank %d: ncclAllReduce %s %s count %zu%s [%zu] = %g, "
                          "expected %g", rank, tn, ddp_fake_nccl::op_name(op), count, in_place ? " in place" : "", i,
                          get(h.data(), t, i), expect(n, i, t, op));
                cudaFree(send);
                if (!in_place) cudaFree(recv);
            }
            { /* reduce (max) to root count % n: elsewhere recv keeps what it held */
                const int root = (int)(count % (size_t)n);
                char *send = dev(count * es), *recv = in_place ? send : dev(count * es);
                up(send, filled(rank, count, t, ncclMax));
                if (!in_place) up(recv, filled(rank + 10, count, t, ncclSum));
                done(ncclReduce(send, recv, count, t, ncclMax, root, c, s), "ncclReduce", send, s, rank);
                std::vector<char> h = down(recv, count * es);
                for (size_t i = 0; i < count; i++) {
                    const double want = rank == root ? expect(n, i, t, ncclMax)
                                                     : value(in_place ? rank : rank + 10, i, t, in_place ? ncclMax : ncclSum);
                    CHECK(get(h.data(), t, i) == want, "rank %d: ncclReduce %s root %d [%zu] = %g, expected %g", rank, tn, root,
                          i, get(h.data(), t, i), want);
                }
                cudaFree(send);
                if (!in_place) cudaFree(recv);
            }
            { /* broadcast from the last rank */
                const int root = n - 1;
                char *send = dev(count * es), *recv = in_place ? send : dev(count * es);
                up(send, filled(rank, count, t, ncclSum));
                done(ncclBroadcast(send, recv, count, t, root, c, s), "ncclBroadcast", send, s, rank);
                std::vector<char> h = down(recv, count * es);
                for (size_t i = 0; i < count; i++)
                    CHECK(get(h.data(), t, i) == value(root, i, t, ncclSum), "rank %d: ncclBroadcast %s [%zu]", rank, tn, i);
                cudaFree(send);
                if (!in_place) cudaFree(recv);
            }
            { /* all_gather: block r = rank r's values */
                char *recv = dev((size_t)n * count * es), *send = in_place ? recv + (size_t)rank * count * es : dev(count * es);
                up(send, filled(rank, count, t, ncclSum));
                done(ncclAllGather(send, recv, count, t, c, s), "ncclAllGather", recv, s, rank);
                std::vector<char> h = down(recv, (size_t)n * count * es);
                for (int r = 0; r < n; r++)
                    for (size_t i = 0; i < count; i++)
                        CHECK(get(h.data(), t, (size_t)r * count + i) == value(r, i, t, ncclSum), "rank %d: ncclAllGather %s "
                              "count %zu block %d [%zu]", rank, tn, count, r, i);
                cudaFree(recv);
                if (!in_place) cudaFree(send);
            }
            for (ncclRedOp_t op : {ncclSum, ncclAvg, ncclMin}) { /* reduce_scatter: this rank's block of the reduction */
                char *send = dev((size_t)n * count * es), *recv = in_place ? send + (size_t)rank * count * es : dev(count * es);
                up(send, filled(rank, (size_t)n * count, t, op));
                done(ncclReduceScatter(send, recv, count, t, op, c, s), "ncclReduceScatter", send, s, rank);
                std::vector<char> h = down(recv, count * es);
                for (size_t i = 0; i < count; i++) {
                    const double want = expect(n, (size_t)rank * count + i, t, op);
                    CHECK(get(h.data(), t, i) == want, "rank %d: ncclReduceScatter %s %s count %zu%s [%zu] = %g, expected %g",
                          rank, tn, ddp_fake_nccl::op_name(op), count, in_place ? " in place" : "", i, get(h.data(), t, i), want);
                }
                cudaFree(send);
                if (!in_place) cudaFree(recv);
            }
        }
    }
    CHECK(ncclCommDestroy(c) == ncclSuccess, "ncclCommDestroy");
    cudaStreamDestroy(s);
    return 0;
}

/* ---- 2. send / receive ---- */
static unsigned char byte_of(int from, int to, int k, size_t j) { return (unsigned char)(from * 31 + to * 7 + k * 13 + (int)j); }
static size_t msg_bytes(int from, int to, int k) { return (size_t)((from * 7 + to * 3 + k * 5) % 6) * 600; } /* 0 .. 3000 */

static int rank_p2p(int rank, int n) {
    ncclComm_t c = join(rank, n);
    std::vector<char *> out, in;
    /* a group: two messages to every rank (itself too), two from each */
    CHECK(ncclGroupStart() == ncclSuccess, "ncclGroupStart");
    for (int p = 0; p < n; p++)
        for (int k = 0; k < 2; k++) {
            std::vector<char> h(msg_bytes(rank, p, k));
            for (size_t j = 0; j < h.size(); j++) h[j] = (char)byte_of(rank, p, k, j);
            char *d = dev(h.size());
            up(d, h);
            out.push_back(d);
            in.push_back(dev(msg_bytes(p, rank, k)));
            CHECK(ncclSend(d, h.size(), ncclUint8, p, c, nullptr) == ncclSuccess, "ncclSend");
            CHECK(ncclRecv(in.back(), msg_bytes(p, rank, k), ncclUint8, p, c, nullptr) == ncclSuccess, "ncclRecv");
        }
    CHECK(ncclGroupEnd() == ncclSuccess, "rank %d: ncclGroupEnd: %s", rank, ncclGetLastError(nullptr));
    for (int p = 0, at = 0; p < n; p++)
        for (int k = 0; k < 2; k++, at++) {
            std::vector<char> h = down(in[(size_t)at], msg_bytes(p, rank, k));
            for (size_t j = 0; j < h.size(); j++)
                CHECK((unsigned char)h[j] == byte_of(p, rank, k, j), "rank %d: message %d from rank %d, byte %zu", rank, k, p, j);
            CHECK(closed(in[(size_t)at]), "rank %d: a receive left device memory open", rank);
            cudaFree(in[(size_t)at]);
            cudaFree(out[(size_t)at]);
        }
    if (n >= 2 && rank < 2) { /* lone calls, typed: rank 0 sends 700 floats to rank 1 (more than a ring holds) */
        std::vector<char> h = filled(0, 700, ncclFloat32, ncclSum);
        char *d = dev(h.size());
        if (rank == 0) up(d, h);
        CHECK((rank == 0 ? ncclSend(d, 700, ncclFloat32, 1, c, nullptr) : ncclRecv(d, 700, ncclFloat32, 0, c, nullptr)) ==
                  ncclSuccess, "rank %d: a lone send/receive: %s", rank, ncclGetLastError(nullptr));
        CHECK(down(d, h.size()) == h, "rank %d: the lone message", rank);
        cudaFree(d);
    }
    CHECK(ncclCommDestroy(c) == ncclSuccess, "ncclCommDestroy");
    return 0;
}

/* ---- 3. failures ---- */
static bool says(const char *fragment) { return strstr(ncclGetLastError(nullptr), fragment) != nullptr; }

static int rank_mismatch(int rank, int n) { /* rank 1 reduces 5 elements, the others 4 */
    ncclComm_t c = join(rank, n);
    char *d = dev(64);
    ncclResult_t rc = ncclAllReduce(d, d, rank == 1 ? 5 : 4, ncclFloat32, ncclSum, c, nullptr), async = ncclSuccess;
    CHECK(rc == ncclInvalidUsage && says("calls differ") && says("count 5") && says("count 4"), "rank %d: %d: %s", rank, (int)rc,
          ncclGetLastError(nullptr));
    CHECK(ncclCommGetAsyncError(c, &async) == ncclSuccess && async == ncclInvalidUsage, "rank %d: async error %d", rank, (int)async);
    rc = ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, c, nullptr);
    CHECK(rc == ncclInvalidUsage && says("failed earlier"), "rank %d: a call after the failure: %d: %s", rank, (int)rc,
          ncclGetLastError(nullptr));
    ncclCommAbort(c);
    cudaFree(d);
    return 0;
}

static int rank_recv_type(int rank, int n) { /* rank 0 sends 4 floats, rank 1 receives 4 ints */
    ncclComm_t c = join(rank, n);
    char *d = dev(16);
    ncclResult_t rc = rank == 0 ? ncclSend(d, 4, ncclFloat32, 1, c, nullptr) : ncclRecv(d, 4, ncclInt32, 0, c, nullptr);
    if (rank == 0) CHECK(rc == ncclSuccess, "the send: %s", ncclGetLastError(nullptr)); /* it fits in the ring */
    else CHECK(rc == ncclInvalidUsage && says("ncclFloat32") && says("ncclInt32"), "%d: %s", (int)rc, ncclGetLastError(nullptr));
    ncclCommDestroy(c);
    cudaFree(d);
    return 0;
}

static int rank_bad_calls(int rank, int n) {
    ncclComm_t c = join(rank, n);
    char *d = dev(4096), host[64];
    CHECK(ncclAllReduce(host, host, 4, ncclFloat32, ncclSum, c, nullptr) == ncclInvalidArgument && says("not memory of cudaMalloc"),
          "host memory: %s", ncclGetLastError(nullptr));
    CHECK(ncclAllReduce(d, d, 1025, ncclFloat32, ncclSum, c, nullptr) == ncclInvalidArgument && says("past the end"),
          "past the end: %s", ncclGetLastError(nullptr));
    CHECK(ncclAllReduce(d, d + 4, 8, ncclFloat32, ncclSum, c, nullptr) == ncclInvalidArgument && says("overlap"),
          "overlap: %s", ncclGetLastError(nullptr));
    CHECK(ncclGroupStart() == ncclSuccess, "ncclGroupStart");
    CHECK(ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, c, nullptr) == ncclInvalidUsage && says("not emulated"), "grouped: %s",
          ncclGetLastError(nullptr));
    CHECK(ncclGroupEnd() == ncclInvalidUsage, "ncclGroupEnd after a failed call inside the group");
    CHECK(ncclAllReduce(d, d, 4, ncclFloat32, ncclSum, c, nullptr) == ncclSuccess, "the communicator still works: %s",
          ncclGetLastError(nullptr));
    ncclCommDestroy(c);
    cudaFree(d);
    return 0;
}

/* a peer that goes (how: arg of the scenario), while rank 0 (and rank 2) wait in an all_reduce */
static const char *how;
static int rank_peer_fails(int rank, int n) {
    ncclComm_t c = join(rank, n);
    char *d = dev(64);
    const double t0 = ddp_fake_nccl::now();
    if (rank == 1) {
        if (strcmp(how, "exit") == 0) _exit(0);
        if (strcmp(how, "abort") == 0) ncclCommAbort(c);
        if (strcmp(how, "destroy") == 0) {
            ncclCommDestroy(c);
            usleep(1000 * 1000); /* alive while rank 0 waits */
        }
        if (strcmp(how, "late") == 0) { /* alive, beyond the time limit, then it leaves */
            usleep(1500 * 1000);
            ncclCommDestroy(c);
        }
        cudaFree(d);
        return 0;
    }
    ncclResult_t rc = ncclAllReduce(d, d, 16, ncclFloat32, ncclSum, c, nullptr);
    const double took = ddp_fake_nccl::now() - t0;
    const char *want = strcmp(how, "exit") == 0 ? "is gone" : strcmp(how, "abort") == 0 ? "aborted" : strcmp(how, "destroy") == 0
                                                                                                          ? "destroyed its communicator"
                                                                                                          : "timed out";
    /* late (3 ranks): ranks 0 and 2 both wait; the first to time out aborts, the other may see that first
       (ncclRemoteError, with the other's "timed out" in the abort's message) */
    const bool late = strcmp(how, "late") == 0;
    CHECK(rc == (late ? ncclSystemError : ncclRemoteError) || (late && rc == ncclRemoteError && says("aborted")),
          "rank %d, peer %s: %d: %s", rank, how, (int)rc, ncclGetLastError(nullptr));
    CHECK(says(want), "rank %d, peer %s: %s", rank, how, ncclGetLastError(nullptr));
    CHECK(took < soon, "rank %d, peer %s: reported after %.1f s", rank, how, took);
    ncclCommAbort(c);
    cudaFree(d);
    return 0;
}

static int rank_never_joins(int rank, int n) { /* rank 1 never calls ncclCommInitRank */
    ncclComm_t c = nullptr;
    ddp_fake_nccl::unique_t id;
    (void)n;
    if (rank == 1) return 0;
    CHECK(ncclCommInitRank(&c, 2, uid, rank) == ncclSystemError && c == nullptr && says("1 of 2 ranks joined") &&
              says("timed out"), "%s", ncclGetLastError(nullptr));
    memcpy(&id, uid.internal, sizeof id);
    CHECK(shm_open(id.name, O_RDONLY, 0) < 0 && errno == ENOENT, "%s left in /dev/shm", id.name);
    return 0;
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    setenv("DDP_FAKE_NCCL_CHUNK", "256", 1);
    for (int n = 1; n <= 4; n++) {
        const double t0 = ddp_fake_nccl::now();
        CHECK(run_ranks(n, rank_collectives, 120) == 0, "collectives on %d rank(s)", n);
        CHECK(run_ranks(n, rank_p2p, 60) == 0, "send/receive on %d rank(s)", n);
        printf("%d rank(s): every collective, type and op, and grouped send/receive, matched (%.1f s)\n", n,
               ddp_fake_nccl::now() - t0);
        fflush(stdout);
    }
    CHECK(run_ranks(3, rank_mismatch, 60) == 0, "calls that differ");
    CHECK(run_ranks(2, rank_recv_type, 60) == 0, "a receive of another type");
    CHECK(run_ranks(1, rank_bad_calls, 60) == 0, "bad calls");
    setenv("DDP_FAKE_NCCL_TIMEOUT", "0.5", 1);
    for (const char *h : {"exit", "abort", "destroy", "late"}) {
        how = h;
        CHECK(run_ranks(h[0] == 'l' ? 3 : 2, rank_peer_fails, 60) == 0, "a peer that fails (%s)", h);
    }
    CHECK(run_ranks(2, rank_never_joins, 60) == 0, "a rank that never joins");
    printf("failures: calls that differ, a receive of another type, bad buffers and calls, a peer that exited, aborted, "
           "destroyed its communicator or was late, a rank that never joined: errors, no hang\n");
    return 0;
}
