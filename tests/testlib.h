/* Test helpers. Include this first: it compiles the implementation of ddp.h into the test, unless the
   Makefile builds the implementation once for every test that uses only the public API
   (DDP_TEST_SHARED_IMPLEMENTATION: linked from $(BUILD)/ddp_impl.o; same code, compiled once per build).
   The multi-process runner here is the test's own (plain fork + environment), independent of the
   library's launcher, so the library is never used to check itself. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* the tests themselves use POSIX and Linux calls (setenv, unshare, ...) under -std=c99 */
#endif
#ifndef DDP_TEST_SHARED_IMPLEMENTATION
#define DDP_IMPLEMENTATION
#endif
/* A test that defines TL_ALLOC_HOOKS before including testlib.h gets the library's allocations (DDP_MALLOC,
   DDP_REALLOC, DDP_FREE) through the counting hooks below (tl_allocs ...); the Makefile compiles the
   implementation into such a test. */
#ifdef TL_ALLOC_HOOKS
#ifdef DDP_TEST_SHARED_IMPLEMENTATION
#error "TL_ALLOC_HOOKS needs the implementation compiled into the test, not the shared one (the Makefile: SHARED_IMPL_TESTS)"
#endif
#include <stddef.h>
static void *tl_hook_malloc(size_t size);
static void *tl_hook_realloc(void *p, size_t size);
static void tl_hook_free(void *p);
#define DDP_MALLOC(size) tl_hook_malloc(size)
#define DDP_REALLOC(p, size) tl_hook_realloc(p, size)
#define DDP_FREE(p) tl_hook_free(p)
#endif
#include "ddp.h"

/* The system headers the implementation includes, which the tests rely on too (with the shared
   implementation they do not come with ddp.h). */
#include <arpa/inet.h>
#include <assert.h>
#include <dirent.h>
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

#include <sched.h>
#include <stdint.h>

/* Every helper is static and may go unused by a given test. */
#if defined(__GNUC__)
#define TL_FN static __attribute__((unused))
#else
#define TL_FN static
#endif

#include "check.h" /* CHECK(cond, "format", ...): on failure print where and why, and exit 1 */

/* TL_CHECK_SUCCESS(call, text, message): the call must return DDP_SUCCESS; prints its text (#call), the
   code and message (a string: the object's last error) if not. */
#define TL_CHECK_SUCCESS(call, text, message)                                                 \
    do {                                                                                      \
        ddp_result r_ = (call);                                                               \
        CHECK(r_ == DDP_SUCCESS, "%s returned %d (%s): %s", text, (int)r_, ddp_result_string(r_), (message)); \
    } while (0)

/* CHECK_OK(call, group): the call must return DDP_SUCCESS; prints ddp_last_error(group) if not. */
#define CHECK_OK(call, g) TL_CHECK_SUCCESS(call, #call, ddp_last_error(g))

#ifdef TL_ALLOC_HOOKS
/* What the allocation hooks saw: allocations (malloc, and realloc of NULL) and frees (of non-NULL) made; the
   bytes the library holds now and the most it held (a test may reset tl_peak_bytes). tl_fail_allocs nonzero
   makes new allocations fail (out of memory; reallocations still work). The group's threads allocate too:
   the counts are atomic and the bytes under a lock. */
static long tl_allocs, tl_frees;
static size_t tl_live_bytes, tl_peak_bytes;
static int tl_fail_allocs;
static pthread_mutex_t tl_hook_mu = PTHREAD_MUTEX_INITIALIZER;

static void *tl_hook_realloc(void *p, size_t size) {
    size_t *block = p ? (size_t *)p - 2 : NULL, old = block ? block[0] : 0; /* a header of 2 words keeps 16-byte alignment */
    if (tl_fail_allocs && !p) return NULL;
    if (!p) __atomic_fetch_add(&tl_allocs, 1, __ATOMIC_RELAXED);
    block = (size_t *)realloc(block, size + 2 * sizeof(size_t));
    if (!block) return NULL;
    block[0] = size;
    pthread_mutex_lock(&tl_hook_mu);
    tl_live_bytes = tl_live_bytes - old + size;
    if (tl_peak_bytes < tl_live_bytes) tl_peak_bytes = tl_live_bytes;
    pthread_mutex_unlock(&tl_hook_mu);
    return block + 2;
}

static void *tl_hook_malloc(size_t size) { return tl_hook_realloc(NULL, size); }

static void tl_hook_free(void *p) {
    if (!p) return;
    __atomic_fetch_add(&tl_frees, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&tl_hook_mu);
    tl_live_bytes -= ((size_t *)p - 2)[0];
    pthread_mutex_unlock(&tl_hook_mu);
    free((size_t *)p - 2);
}
#endif

/* A TCP port that was free a moment ago (bind to port 0 and read what the kernel gave). */
TL_FN int tl_free_port(void) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port, fd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        perror("tl_free_port");
        exit(1);
    }
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

TL_FN double tl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define TL_MAX_RANKS 512
/* Run fn(rank, n, arg) in n forked processes with torchrun's environment (RANK, WORLD_SIZE,
   LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT). Waits at most
   timeout_s, then kills them all. Returns 0 when every process exited 0; otherwise prints which
   did not and returns 1. fn's return value is the process's exit code. */
TL_FN int tl_run_ranks_status(int n, int (*fn)(int rank, int n, void *arg), void *arg, double timeout_s, int *codes);
TL_FN int tl_run_ranks(int n, int (*fn)(int rank, int n, void *arg), void *arg, double timeout_s) {
    return tl_run_ranks_status(n, fn, arg, timeout_s, NULL);
}

/* Fork rank i of n running fn(i, n, arg) with torchrun's variables (MASTER_PORT port); the child exits with
   fn's code. Returns the child's pid. */
TL_FN pid_t tl_fork_rank(int i, int n, const char *port, int (*fn)(int rank, int n, void *arg), void *arg) {
    pid_t pid;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid == 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", i);
        setenv("RANK", v, 1);
        setenv("LOCAL_RANK", v, 1);
        snprintf(v, sizeof v, "%d", n);
        setenv("WORLD_SIZE", v, 1);
        setenv("LOCAL_WORLD_SIZE", v, 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", port, 1);
        exit(fn(i, n, arg)); /* not _exit: LeakSanitizer checks at exit (stdio was flushed before fork) */
    }
    return pid;
}

/* Wait for the n children in pids (status[i] -1 for one already reaped: it is not waited for again);
   at the deadline (tl_now() seconds) the ones still running are SIGKILLed and named (late[i] = 1 when late
   is not NULL). Fills status with waitpid's; returns 1 when the deadline passed. */
TL_FN int tl_wait_ranks(const pid_t *pids, int n, double deadline, int *status, int *late_rank) {
    int done = 0, late = 0, i;
    for (i = 0; i < n; i++) done += status[i] != -1;
    while (done < n) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            for (i = 0; i < n; i++)
                if (pids[i] == p && status[i] == -1) status[i] = st, done++;
            continue;
        }
        if (tl_now() > deadline) {
            fprintf(stderr, "tl_wait_ranks: timed out; killing the ranks still running:");
            for (i = 0; i < n; i++)
                if (status[i] == -1) {
                    fprintf(stderr, " %d", i);
                    kill(pids[i], SIGKILL);
                    if (late_rank) late_rank[i] = 1;
                }
            fprintf(stderr, "\n");
            deadline = tl_now() + 1e9;
            late = 1;
            continue;
        }
        usleep(2000);
    }
    return late;
}

/* A child's end as one number: its exit code, or -signal when killed. */
TL_FN int tl_exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -1000; }

/* The same, and codes[i] (when codes is not NULL) gets rank i's exit code, or -signal when killed,
   or -1000 when it was still running at the timeout. */
TL_FN int tl_run_ranks_status(int n, int (*fn)(int rank, int n, void *arg), void *arg, double timeout_s, int *codes) {
    pid_t pids[TL_MAX_RANKS] = {0};
    int status[TL_MAX_RANKS], late_rank[TL_MAX_RANKS], failed = 0, late, i;
    char port[16];
    double deadline = tl_now() + timeout_s;
    if (n > TL_MAX_RANKS) return 1;
    snprintf(port, sizeof port, "%d", tl_free_port());
    for (i = 0; i < n; i++) {
        pids[i] = tl_fork_rank(i, n, port, fn, arg);
        status[i] = -1;
        late_rank[i] = 0;
    }
    late = tl_wait_ranks(pids, n, deadline, status, late_rank);
    for (i = 0; i < n && codes; i++) codes[i] = late_rank[i] ? -1000 : tl_exit_code(status[i]);
    for (i = 0; i < n; i++) {
        if ((WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0) || late_rank[i]) continue;
        failed = 1;
        if (WIFEXITED(status[i]))
            fprintf(stderr, "tl_run_ranks: rank %d exited with code %d\n", i, WEXITSTATUS(status[i]));
        else if (WIFSIGNALED(status[i]))
            fprintf(stderr, "tl_run_ranks: rank %d killed by signal %d\n", i, WTERMSIG(status[i]));
    }
    return failed || late;
}

/* The two transports a multi-process test runs over: DDP_TRANSPORT's value (t = 0: "auto", shared memory
   between the ranks of one host; t = 1: "tcp") and what to call it in a message. */
TL_FN const char *tl_transport(int t) { return t ? "tcp" : "auto"; }
TL_FN const char *tl_transport_name(int t) { return t ? "tcp" : "shared memory"; }

/* The world-size x transport sweep of the collective tests' main (test_collectives, test_more_collectives).
   Started by a launcher (TEST_EXTERNAL_LAUNCH set: tests/test_netns.sh) the process is one rank: it runs
   worker(RANK, WORLD_SIZE) and exits with its code. Otherwise worker runs on each world size of the command
   line (argv[1..], at most 8; default 1 2 3 4 8), over shared memory and then over TCP (one rank uses no
   transport: only once), within timeout_s each; a failure ends the test. After each run it prints "world
   size N over TRANSPORT: <what> (S s)", then calls after(n, t) when given (more runs on that world size). */
TL_FN void tl_sweep(int argc, char **argv, int (*worker)(int rank, int n, void *arg), double timeout_s, const char *what,
                    void (*after)(int n, int t)) {
    int sizes[8] = {1, 2, 3, 4, 8}, nsizes = 5, i, t;
    if (getenv("TEST_EXTERNAL_LAUNCH")) exit(worker(atoi(getenv("RANK")), atoi(getenv("WORLD_SIZE")), NULL));
    if (argc > 1) {
        nsizes = 0;
        for (i = 1; i < argc && nsizes < 8; i++) sizes[nsizes++] = atoi(argv[i]);
    }
    for (t = 0; t < 2; t++) {
        setenv("DDP_TRANSPORT", tl_transport(t), 1);
        for (i = 0; i < nsizes; i++) {
            double t0 = tl_now();
            if (sizes[i] == 1 && t == 1) continue; /* one rank uses no transport */
            CHECK(tl_run_ranks(sizes[i], worker, NULL, timeout_s) == 0, "world size %d over %s failed", sizes[i], tl_transport(t));
            printf("world size %d over %s: %s (%.1f s)\n", sizes[i], tl_transport_name(t), what, tl_now() - t0);
            fflush(stdout);
            if (after) after(sizes[i], t);
        }
    }
}

/* Deterministic pseudo-random numbers for test data (splitmix64). */
TL_FN uint64_t tl_rand(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---- reference f16 / bf16 rounding, written independently of the library's bit tricks ----
   A finite float is rounded to the nearest value on the target format's grid by scaling it so
   the grid becomes the integers and calling nearbyint (round half to even). */
TL_FN double tl_round_to_format(double x, int mantissa_bits, int min_exp, double max_finite) {
    int e;
    double q, ulp;
    if (x != x || x == 0.0) return x;
    frexp(fabs(x), &e);             /* |x| = m * 2^e, m in [0.5, 1) */
    if (e - 1 < min_exp) e = min_exp + 1; /* subnormal range: a fixed grid */
    ulp = ldexp(1.0, e - 1 - mantissa_bits);
    q = nearbyint(x / ulp) * ulp;
    if (fabs(q) > max_finite) return x > 0 ? INFINITY : -INFINITY;
    return q;
}
TL_FN float tl_ref_f16(float x) { return (float)tl_round_to_format(x, 10, -14, 65504.0); }
TL_FN float tl_ref_bf16(float x) { return (float)tl_round_to_format(x, 7, -126, 3.3895313892515355e38); }
/* decode binary16 bits with ldexp (independent of the library's decoder) */
TL_FN float tl_decode_f16(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (float)((h & 0x8000) ? -v : v);
}
TL_FN float tl_decode_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i of a buffer of dtype t, as a double / written from a double (integers truncate; f16 and
   bf16 round to nearest even: exact for the small integers the tests use). */
TL_FN void tl_store_value(void *buf, size_t i, ddp_dtype t, double v) {
    switch (t) {
    case DDP_F32: ((float *)buf)[i] = (float)v; break;
    case DDP_F64: ((double *)buf)[i] = v; break;
    case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)v); break; /* exact for these small integers */
    case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I8: ((int8_t *)buf)[i] = (int8_t)(int64_t)v; break;
    case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)(int64_t)v; break;
    case DDP_I32: ((int32_t *)buf)[i] = (int32_t)(int64_t)v; break;
    case DDP_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    default: break;
    }
}

TL_FN double tl_load_value(const void *buf, size_t i, ddp_dtype t) {
    switch (t) {
    case DDP_F32: return ((const float *)buf)[i];
    case DDP_F64: return ((const double *)buf)[i];
    case DDP_F16: return tl_decode_f16(((const uint16_t *)buf)[i]);
    case DDP_BF16: return tl_decode_bf16(((const uint16_t *)buf)[i]);
    case DDP_I8: return ((const int8_t *)buf)[i];
    case DDP_U8: return ((const uint8_t *)buf)[i];
    case DDP_I32: return ((const int32_t *)buf)[i];
    case DDP_I64: return (double)((const int64_t *)buf)[i];
    default: return 0;
    }
}

/* v wrapped to dtype t's range as two's complement does (i8, u8, i32; other dtypes unchanged). */
TL_FN int64_t tl_wrap(int64_t v, ddp_dtype t) {
    if (t == DDP_I8) return (int8_t)(uint8_t)(uint64_t)v;
    if (t == DDP_U8) return (uint8_t)(uint64_t)v;
    if (t == DDP_I32) return (int32_t)(uint32_t)(uint64_t)v;
    return v;
}

/* The serial reference for reducing small integers, one per rank (vals[0..n-1]), with op, as dtype t
   holds the result: integer sums and products wrap; AVG divides once at the end, the wrapped sum
   truncated toward zero for integers (as ncclAvg), in the format for floats. The values must be small
   enough for every float format to hold every partial result exactly. */
TL_FN double tl_reduce_small(const int64_t *vals, int n, ddp_dtype t, ddp_op op) {
    int64_t acc = vals[0];
    int r;
    for (r = 1; r < n; r++) {
        int64_t v = vals[r];
        if (op == DDP_SUM || op == DDP_AVG) acc += v;
        else if (op == DDP_PROD) acc *= v;
        else if (op == DDP_MIN) acc = v < acc ? v : acc;
        else acc = v > acc ? v : acc;
    }
    if (op != DDP_AVG) return (double)tl_wrap(acc, t);
    switch (t) {
    case DDP_F64: return (double)acc / n;
    case DDP_F32: return (float)acc / (float)n;
    case DDP_F16: return tl_ref_f16((float)acc / (float)n);
    case DDP_BF16: return tl_ref_bf16((float)acc / (float)n);
    default: return (double)(tl_wrap(acc, t) / n);
    }
}

TL_FN int tl_is_float(ddp_dtype t) { return t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16; }

/* Remove directory dir and the files in it (not recursive: the tests' directories hold plain files). */
TL_FN void tl_rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[1024];
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* How many entries of directory dir have a name that starts with prefix and (suffix not NULL) ends with suffix. */
TL_FN int tl_count_files(const char *dir, const char *prefix, const char *suffix) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    CHECK(d != NULL, "cannot open %s: %s", dir, strerror(errno));
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
        n += !suffix || (len >= strlen(suffix) && strcmp(e->d_name + len - strlen(suffix), suffix) == 0);
    }
    closedir(d);
    return n;
}

/* malloc that never returns NULL (a test fails instead); 0 bytes gives a valid pointer. */
TL_FN unsigned char *tl_xalloc(size_t n) {
    unsigned char *p = (unsigned char *)malloc(n ? n : 1);
    CHECK(p != NULL, "out of memory for %zu bytes", n);
    return p;
}

/* ---- the collective tests' serial reference: every rank contributes small integers ----
   A test defines its data by a tl_value_fn: the small integer rank r puts at element i (every dtype
   must hold it, and every partial result of the reduction, exactly). */
typedef int64_t (*tl_value_fn)(int r, size_t i, ddp_dtype t, ddp_op op, int salt);

/* What element i must be after reducing ranks 0..n-1's values with op, as dtype t holds it. */
TL_FN double tl_expected(tl_value_fn value, int n, size_t i, ddp_dtype t, ddp_op op, int salt) {
    int64_t vals[256];
    int r;
    CHECK(n >= 1 && n <= 256, "tl_expected: %d ranks", n);
    for (r = 0; r < n; r++) vals[r] = value(r, i, t, op, salt);
    return tl_reduce_small(vals, n, t, op);
}

/* Rank r's contribution: buf[0..count-1] = value(r, i, ...). */
TL_FN void tl_fill(tl_value_fn value, void *buf, size_t count, int r, ddp_dtype t, ddp_op op, int salt) {
    size_t i;
    for (i = 0; i < count; i++) tl_store_value(buf, i, t, (double)value(r, i, t, op, salt));
}

/* Element i of buf must be want, exactly ("rank R: WHAT: element I is X, expected Y" otherwise). */
TL_FN void tl_check_equal(const void *buf, size_t i, ddp_dtype t, double want, const char *what, int rank) {
    double got = tl_load_value(buf, i, t);
    CHECK(got == want, "rank %d: %s: element %zu is %g, expected %g", rank, what, i, got, want);
}

/* Every element of buf must be the reduction of n ranks' values with op. */
TL_FN void tl_check_reduced(tl_value_fn value, const void *buf, size_t count, ddp_dtype t, int n, ddp_op op, int salt,
                            const char *what, int rank) {
    size_t i;
    for (i = 0; i < count; i++) tl_check_equal(buf, i, t, tl_expected(value, n, i, t, op, salt), what, rank);
}

/* ddp_init from the environment with a descriptor that sets only these (0 / DDP_LOG_DEFAULT / NULL: the
   library's defaults); a failure ends the test. */
TL_FN ddp_group *tl_init(double timeout_s, ddp_log_level log_level, ddp_log_fn log_fn) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    memset(&d, 0, sizeof d);
    d.timeout_seconds = timeout_s;
    d.log_level = log_level;
    d.log_fn = log_fn;
    CHECK_OK(ddp_init(&d, &g), NULL);
    return g;
}

/* ddp_init from the environment with the debug log going to log_fn (which the test uses to watch
   what path a collective took). */
TL_FN ddp_group *tl_init_logged(ddp_log_fn log_fn) { return tl_init(0, DDP_LOG_DEBUG, log_fn); }

/* Can this process play another host (a UTS namespace of its own: root or CAP_SYS_ADMIN)? Tried in a
   child. Tests that need several hosts on one machine put ranks in such namespaces with another name. */
TL_FN int tl_can_play_hosts(void) {
    int st;
    pid_t p = fork();
    if (p == 0) _exit(unshare(CLONE_NEWUTS) == 0 ? 0 : 1);
    return p > 0 && waitpid(p, &st, 0) == p && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}
