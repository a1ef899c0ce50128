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
#include "internal.h"

/* ---- naming a collective (in the recorder, and in every error message that names a call) ---- */

static const char *ddp__coll_name(int kind) {
    static const char *names[] = {"?",       "all_reduce", "broadcast",  "reduce",       "all_gather",
                                  "reduce_scatter", "barrier", "gather", "scatter", "all_to_all", "all_to_all_v",
                                  "all_gather_v", "broadcast_bytes", "monitored_barrier", "send", "recv"};
    return (kind > 0 && kind < DDP__COLL_KINDS) ? names[kind] : "an unknown operation";
}

/* "all_reduce(count=1024, f32, sum) as collective #7". Numbers count from the end of the group's own
   set-up (g->seq_base, the same on every rank), so the program's first call is #1; a call of the set-up
   itself, in a failing ddp_init, shows its number within the set-up. */
/* " for FSDP unit 5's all-gather" (see DDP__PURPOSE), or "" for a call the program made itself. */
static const char *ddp__purpose_describe(uint32_t purpose, char *out, size_t cap) {
    static const char *const phases[] = {"", "all-gather", "reduce-scatter"};
    unsigned phase = purpose >> 24;
    if (!purpose) return "";
    if (phase == DDP__PHASE_SAMPLES) return " for ddp_reducer_set_local_samples' sample count";
    snprintf(out, cap, " for FSDP unit %u's %s", (purpose & 0xffffffu) - 1, phase < 3 ? phases[phase] : "collective");
    return out;
}

static void ddp__coll_describe(const ddp_group *g, const ddp__coll *c, char *out, size_t cap) {
    char extra[48] = "", purpose[48];
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
    snprintf(out, cap, "%s(%s=%llu, %s%s) as collective #%llu%s", ddp__coll_name(c->kind),
             c->kind == DDP__ALL_GATHER_V ? "total count" : "count", (unsigned long long)c->count,
             ddp_dtype_name((ddp_dtype)c->dtype), extra, number, ddp__purpose_describe(c->purpose, purpose, sizeof purpose));
}

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
    uint64_t mask;       /* size - 1 when size is a power of two (the default), else 0: no 64-bit division per state change */
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
    const struct ddp__trace *t = g->trace;
    return t ? &t->ring[t->mask ? seq & t->mask : seq % t->size] : NULL;
}

/* Record collective c as queued, or (started: it runs on the calling thread now) as started at the same
   time, which saves ddp__trace_started a clock read. */
static void ddp__trace_queued(ddp_group *g, const ddp__coll *c, int started) {
    ddp__trace_entry *e = ddp__trace_slot(g, c->seq);
    int64_t now;
    if (!e) return;
    now = ddp__trace_clock(DDP__TRACE_CLOCK);
    __atomic_store_n(&e->seq_state, 0, __ATOMIC_RELEASE); /* readers skip it while it is rewritten */
    DDP__TSTORE(&e->count, c->count);
    DDP__TSTORE(&e->what, (uint64_t)c->kind | (uint64_t)c->dtype << 8 | (uint64_t)c->op << 16 |
                              (uint64_t)(uint32_t)(c->root + 1) << 32);
    DDP__TSTORE(&e->t_queued, now);
    DDP__TSTORE(&e->t_started, started ? now : (int64_t)0);
    DDP__TSTORE(&e->t_ended, (int64_t)0);
    __atomic_store_n(&e->seq_state, c->seq << 3 | (uint64_t)(started ? DDP__TRACE_STARTED : DDP__TRACE_QUEUED), __ATOMIC_RELEASE);
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
    t->mask = (t->size & (t->size - 1)) == 0 ? t->size - 1 : 0;
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
