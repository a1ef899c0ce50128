/* [SECTION] util: errors, logging, environment parsing, time, memory */
#include "internal.h"

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

/* Fault-tolerant mode (ft.c), once ddp_ft_begin has set it up: a group broken by a lost or silent peer is
   repaired by a view change, so a call that fails for that reason answers DDP_ERR_VIEW_CHANGED (redo the
   step), with the cause in the message; a mismatch or a misuse stays what it is, and so does a failure
   before (ddp_init's, the first ddp_ft_begin's). */
static ddp_result ddp__ft_code(const ddp_group *g, ddp_result code) {
    ddp_result why = g ? g->broken : DDP_SUCCESS;
    if (!g || !g->ft_running || (why != DDP_ERR_PEER_LOST && why != DDP_ERR_TIMEOUT && why != DDP_ERR_VIEW_CHANGED))
        return code;
    return code == DDP_ERR_PEER_LOST || code == DDP_ERR_TIMEOUT || code == DDP_ERR_STATE ? DDP_ERR_VIEW_CHANGED : code;
}

static ddp_result ddp__fail(ddp_group *g, ddp_result code, const char *fmt, ...) {
    va_list ap;
    code = ddp__ft_code(g, code);
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
    case DDP_ERR_VIEW_CHANGED: return "DDP_ERR_VIEW_CHANGED: the group lost a member and changed its view; redo the step";
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

/* A collective gives up on a peer that made no progress for this long. Fault tolerance sets g->quiet to
   suspect_seconds while it runs (FT.md 2.3: "no progress for suspect_seconds = suspected"), so that a silent
   member -- stopped, or behind a cut link -- starts the view change then, not at the group's timeout. */
static double ddp__quiet_limit(const ddp_group *g) { return g->quiet > 0 && g->quiet < g->timeout ? g->quiet : g->timeout; }

static const char *ddp__quiet_limit_name(const ddp_group *g) {
    return ddp__quiet_limit(g) < g->timeout ? "fault tolerance's suspect_seconds sets the limit" : "DDP_TIMEOUT sets the limit";
}

/* CLOCK_REALTIME in seconds: comparable between processes (between machines as far as NTP keeps them) */
static double ddp__wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
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

/* FNV-1a over n bytes, continuing from h (DDP__FNV_OFFSET to start). */
static uint64_t ddp__hash_bytes(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t ddp__hash(const char *s) { /* FNV-1a */
    uint64_t h = DDP__FNV_OFFSET;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

static ddp_result ddp__peer_code(long code, ddp_result fallback) {
    return code <= DDP_ERR_INVALID_ARGUMENT && code >= DDP_ERR_VIEW_CHANGED ? (ddp_result)code : fallback; /* the last code */
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
