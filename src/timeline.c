/* [SECTION] timeline: every rank's collectives, the reducer's passes and buckets, checkpoint saves and the
   program's own ranges as Chrome trace events (Horovod's HOROVOD_TIMELINE, torch's profiler, NVTX ranges)

   DDP_TIMELINE=PATH (or ddp_init_desc.timeline) turns it on at ddp_init of the world group: each rank
   writes its own file, PATH with "%r" replaced by its rank (without "%r": ".rank<R>" before PATH's
   extension, trace.json -> trace.rank0.json). ddprun --timeline FILE sets that up for its workers and
   merges their files into FILE when the job ends, failed or not (ddp_timeline_merge, also a tool for the
   files of other launchers). ui.perfetto.dev and chrome://tracing open both.

   The file: {"traceEvents":[ one event a line ],"displayTimeUnit":"ms"}, always whole: each flush writes
   the buffered events where the previous flush ended and the closing "]...}" after them (pwrite), so a
   file is valid JSON after every flush, including a killed rank's last one. Events (the names are part
   of the interface; DESIGN.md and docs/TIMELINE.md list them):
     - a collective: "X" (complete) named after its call (all_reduce, broadcast, ..., barrier, send,
       recv) from the start of its run to its end, args {seq, count, dtype, bytes, ranks, queued_us:
       how long it waited in the async queue before it ran, ok};
     - reducer.backward (begin_backward to the end of end_backward; args {iteration, sync}),
       reducer.wait (the wait inside end_backward; args {iteration, straggler: the rank whose gradients
       were all there last, straggler_wait_us, transfer_us}, written once the split is known, at the
       next pass), reducer.bucket (a bucket's collective from its start to its end, on the lane that ran
       it; args {index, bytes, ready_us: the time from the bucket's last gradient to its start});
     - checkpoint.save / checkpoint.save_async (args {path}); the latter on the saver's lane;
     - the program's ranges: ddp_timeline_begin(g, name) / ddp_timeline_end(g), "B"/"E" on the calling
       thread's lane (they nest, as NVTX's push/pop).
   pid is the world rank, tid a lane: 1 the program's threads, 2 the async checkpoint saver, 3 the world
   group's progress thread (the async collectives, the reducer's buckets), 4 and up other groups' progress
   threads; metadata events name them and sort the ranks.

   Clock: CLOCK_MONOTONIC, mapped at open onto CLOCK_REALTIME and counted in us from rank 0's open, in rank
   0's clock. Ranks on rank 0's machine (the same boot id: network namespaces included) share its clock;
   every other rank measures its offset at init, as NCCL's and Horovod's timelines do: 8 round trips with
   rank 0 (send/recv of two doubles), the offset of the one with the shortest round trip
   (offset = t_local_mid - t_rank0; error at most half that round trip). DDP_TIMELINE_SYNC=all measures
   every rank (tests; machines whose ranks do not share a clock).

   Cost: an event is a clock read and a snprintf into a process-wide buffer under a spin flag (no system
   call); a write (pwrite) once 192 KiB are buffered, so memory stays bounded. Flushed at the world
   group's ddp_destroy, when a group breaks (beside the flight recorder's dump) and on SIGUSR1 (the
   handler writes the buffer unless a thread is appending to it at that moment, which then writes it
   when it is done; async-signal-safe: pwrite only). Off, a call costs one load of a NULL pointer. */
#include "internal.h"

enum { DDP__TL_PROGRAM = 1, DDP__TL_SAVER = 2, DDP__TL_PROGRESS = 3 };

#define DDP__TL_BUF_BYTES ((size_t)256 << 10)
#define DDP__TL_FLUSH_AT ((size_t)192 << 10) /* an event takes well under the 64 KiB left (names are cut) */
#define DDP__TL_NAME_MAX 200                 /* bytes of a user's range name kept */
#define DDP__TL_TAIL "\n],\"displayTimeUnit\":\"ms\"}\n"

struct ddp__timeline {
    int fd;
    int rank;
    int lock;         /* atomic: 1 while a thread appends or flushes */
    int flush_wanted; /* atomic: SIGUSR1 came while the lock was held */
    int next_lane;    /* atomic: the next progress lane of a group other than the world */
    const ddp_group *world;
    off_t events_end; /* where the next flush writes; the tail follows what it writes */
    double mono0;     /* CLOCK_MONOTONIC at open ... */
    double base;      /* ... is this many seconds after rank 0's open, in rank 0's clock */
    size_t len;
    unsigned long long lost; /* events a failed write lost */
    char path[1024];
    char buf[DDP__TL_BUF_BYTES];
};

static struct ddp__timeline *ddp__tl;          /* the process's timeline (atomic pointer); NULL: off */
static int ddp__tl_handlers_running;           /* SIGUSR1 handlers inside the timeline now */
static int ddp__tl_signal_installed;           /* the handler stays installed once installed */
static struct sigaction ddp__tl_old_usr1;
static DDP__THREAD_LOCAL int ddp__tl_lane;     /* this thread's lane; 0: the program's */
static DDP__THREAD_LOCAL int ddp__tl_depth;    /* this thread's open ranges (ddp_timeline_begin) */

static struct ddp__timeline *ddp__tl_get(void) { return __atomic_load_n(&ddp__tl, __ATOMIC_ACQUIRE); }

/* Is the timeline on? (one load; the callers skip their clock reads when it is not) */
static int ddp__timeline_on(void) { return ddp__tl_get() != NULL; }

/* ---- writing ---- */

/* Write the buffer where the events end, then the tail after it; on a failure the buffered events are
   lost (counted) and the file stays as it was. Async-signal-safe. */
static void ddp__tl_write(struct ddp__timeline *t) {
    size_t done = 0;
    while (done < t->len) {
        ssize_t w = pwrite(t->fd, t->buf + done, t->len - done, t->events_end + (off_t)done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            t->lost++;
            t->len = 0;
            return;
        }
        done += (size_t)w;
    }
    t->events_end += (off_t)t->len;
    t->len = 0;
    while (pwrite(t->fd, DDP__TL_TAIL, sizeof DDP__TL_TAIL - 1, t->events_end) < 0 && errno == EINTR) {
    }
}

static void ddp__tl_lock(struct ddp__timeline *t) {
    while (__atomic_exchange_n(&t->lock, 1, __ATOMIC_ACQUIRE)) sched_yield();
}

static void ddp__tl_unlock(struct ddp__timeline *t) {
    if (t->len >= DDP__TL_FLUSH_AT || __atomic_exchange_n(&t->flush_wanted, 0, __ATOMIC_RELAXED)) ddp__tl_write(t);
    __atomic_store_n(&t->lock, 0, __ATOMIC_RELEASE);
}

/* Append text to the buffer (the lock held); cut at the buffer's end (never reached: see FLUSH_AT). */
static void ddp__tl_put(struct ddp__timeline *t, const char *fmt, ...) {
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(t->buf + t->len, DDP__TL_BUF_BYTES - t->len, fmt, ap);
    va_end(ap);
    if (n > 0) t->len += DDP__MIN((size_t)n, DDP__TL_BUF_BYTES - t->len - 1);
}

/* A JSON string's body from s (at most max bytes of it): quotes, backslashes and control characters
   escaped, bytes that are not UTF-8 replaced by '?' (a JSON parser rejects them). */
static void ddp__tl_put_string(struct ddp__timeline *t, const char *s, size_t max) {
    size_t i, n = strlen(s);
    if (n > max) n = max;
    for (i = 0; i < n && t->len + 8 < DDP__TL_BUF_BYTES; i++) {
        unsigned char c = (unsigned char)s[i];
        size_t k, extra = c >= 0xF0 && c < 0xF5 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 ? 1 : 0;
        if (c == '"' || c == '\\') {
            t->buf[t->len++] = '\\';
            t->buf[t->len++] = (char)c;
        } else if (c < 0x20) {
            ddp__tl_put(t, "\\u%04x", c);
        } else if (c < 0x80) {
            t->buf[t->len++] = (char)c;
        } else {
            int ok = extra > 0 && i + extra < n;
            for (k = 1; ok && k <= extra; k++) ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
            if (!ok) {
                t->buf[t->len++] = '?';
                continue;
            }
            for (k = 0; k <= extra; k++) t->buf[t->len++] = s[i + k];
            i += extra;
        }
    }
}

/* us on the job's clock of a monotonic time (seconds, ddp__now) */
static double ddp__tl_us(const struct ddp__timeline *t, double mono) { return (mono - t->mono0 + t->base) * 1e6; }

/* The hot path formats by hand: a snprintf call costs ~150 ns here (~400 with a %.3f), an event has ten
   fields, and the buffer always has room for one event (see FLUSH_AT). */
static void ddp__tl_raw(struct ddp__timeline *t, const char *s) {
    size_t n = strlen(s);
    memcpy(t->buf + t->len, s, n);
    t->len += n;
}

static void ddp__tl_u64(struct ddp__timeline *t, unsigned long long v) {
    char digits[24];
    int n = 0;
    do digits[n++] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    while (n) t->buf[t->len++] = digits[--n];
}

static void ddp__tl_int(struct ddp__timeline *t, long long v) {
    if (v < 0) t->buf[t->len++] = '-';
    ddp__tl_u64(t, v < 0 ? (unsigned long long)-v : (unsigned long long)v);
}

/* ,"key":N.NNN (microseconds, 3 decimals) */
static void ddp__tl_put_us(struct ddp__timeline *t, const char *key, double us) {
    long long ns = (long long)(us * 1000.0 + (us < 0 ? -0.5 : 0.5));
    unsigned long long a = (unsigned long long)(ns < 0 ? -ns : ns);
    ddp__tl_raw(t, ",\"");
    ddp__tl_raw(t, key);
    ddp__tl_raw(t, ns < 0 ? "\":-" : "\":");
    ddp__tl_u64(t, a / 1000);
    t->buf[t->len++] = '.';
    t->buf[t->len++] = (char)('0' + a % 1000 / 100);
    t->buf[t->len++] = (char)('0' + a % 100 / 10);
    t->buf[t->len++] = (char)('0' + a % 10);
}

/* This thread's lane (the tid of its events). */
static int ddp__timeline_lane(void) { return ddp__tl_lane ? ddp__tl_lane : DDP__TL_PROGRAM; }

/* Start an event line: ",\n{"name":"...","ph":"X","pid":R,"tid":T,"ts":...,"dur":..." (dur when end >= 0);
   lane 0: this thread's. */
static void ddp__tl_head(struct ddp__timeline *t, int lane, const char *name, char ph, double start, double end) {
    ddp__tl_raw(t, ",\n{\"name\":\"");
    ddp__tl_put_string(t, name, DDP__TL_NAME_MAX);
    ddp__tl_raw(t, ph == 'X' ? "\",\"ph\":\"X\",\"pid\":" : ph == 'B' ? "\",\"ph\":\"B\",\"pid\":" : "\",\"ph\":\"E\",\"pid\":");
    ddp__tl_int(t, t->rank);
    ddp__tl_raw(t, ",\"tid\":");
    ddp__tl_int(t, lane ? lane : ddp__timeline_lane());
    ddp__tl_put_us(t, "ts", ddp__tl_us(t, start));
    if (end >= 0) ddp__tl_put_us(t, "dur", end > start ? (end - start) * 1e6 : 0.0);
}

/* ---- the events ---- */

/* A collective of g (its fingerprint c) that ran from `started` to `ended` after waiting in the async
   queue since c->t_queued (0: it ran on the calling thread), with result r. */
static void ddp__timeline_coll(ddp_group *g, const ddp__coll *c, double started, double ended, ddp_result r) {
    struct ddp__timeline *t = ddp__tl_get();
    size_t es;
    if (!t) return;
    es = c->dtype ? ddp_dtype_size((ddp_dtype)c->dtype) : 0;
    ddp__tl_lock(t);
    ddp__tl_head(t, 0, ddp__coll_name(c->kind), 'X', started, ended);
    if (c->kind == DDP__SEND || c->kind == DDP__RECV) { /* no collective number: the peer and the tag */
        ddp__tl_raw(t, ",\"args\":{\"peer\":");
        ddp__tl_int(t, c->root);
        ddp__tl_raw(t, ",\"tag\":");
        ddp__tl_int(t, c->tag);
    } else {
        ddp__tl_raw(t, ",\"args\":{\"seq\":");
        ddp__tl_u64(t, (unsigned long long)(c->seq - g->seq_base));
    }
    ddp__tl_raw(t, ",\"count\":");
    ddp__tl_u64(t, (unsigned long long)c->count);
    ddp__tl_raw(t, ",\"dtype\":\"");
    ddp__tl_raw(t, c->dtype ? ddp_dtype_name((ddp_dtype)c->dtype) : "none");
    ddp__tl_raw(t, "\",\"bytes\":");
    ddp__tl_u64(t, (unsigned long long)(c->count * es));
    ddp__tl_raw(t, ",\"ranks\":");
    ddp__tl_int(t, g->world_size);
    ddp__tl_put_us(t, "queued_us", c->t_queued > 0 && started > c->t_queued ? (started - c->t_queued) * 1e6 : 0.0);
    ddp__tl_raw(t, r == DDP_SUCCESS ? ",\"ok\":true}}" : ",\"ok\":false}}");
    ddp__tl_unlock(t);
}

/* A complete event on `lane` (0: this thread's) with numeric arguments names[i] = values[i] (n of them)
   and, when key, key = "value". */
static void ddp__timeline_span_on(int lane, const char *name, double start, double end, const char *const *names,
                                  const double *values, int n, const char *key, const char *value) {
    struct ddp__timeline *t = ddp__tl_get();
    int i;
    if (!t) return;
    ddp__tl_lock(t);
    ddp__tl_head(t, lane, name, 'X', start, end);
    ddp__tl_put(t, ",\"args\":{");
    for (i = 0; i < n; i++) ddp__tl_put(t, "%s\"%s\":%.17g", i ? "," : "", names[i], values[i]);
    if (key) {
        ddp__tl_put(t, "%s\"%s\":\"", n ? "," : "", key);
        ddp__tl_put_string(t, value, 1000);
        ddp__tl_put(t, "\"");
    }
    ddp__tl_put(t, "}}");
    ddp__tl_unlock(t);
}

static void ddp__timeline_span(const char *name, double start, double end, const char *const *names, const double *values,
                               int n, const char *key, const char *value) {
    ddp__timeline_span_on(0, name, start, end, names, values, n, key, value);
}

/* This thread's lane: the async checkpoint saver, or the progress thread of g (the world group's: 3). */
static void ddp__timeline_lane_saver(void) { ddp__tl_lane = DDP__TL_SAVER; }
static void ddp__timeline_lane_progress(const ddp_group *g) {
    struct ddp__timeline *t = ddp__tl_get();
    if (!t || g == t->world) {
        ddp__tl_lane = DDP__TL_PROGRESS;
        return;
    }
    ddp__tl_lane = DDP__TL_PROGRESS + __atomic_add_fetch(&t->next_lane, 1, __ATOMIC_RELAXED);
    ddp__tl_lock(t);
    ddp__tl_put(t, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"progress (a group "
                   "of %d ranks)\"}}", t->rank, ddp__tl_lane, g->world_size);
    ddp__tl_unlock(t);
}

/* Write what is buffered (a group broke; the world group ends). */
static void ddp__timeline_flush(void) {
    struct ddp__timeline *t = ddp__tl_get();
    if (!t) return;
    ddp__tl_lock(t);
    ddp__tl_write(t);
    __atomic_store_n(&t->lock, 0, __ATOMIC_RELEASE);
}

static void ddp__tl_on_signal(int sig, siginfo_t *info, void *ctx) {
    int saved = errno;
    struct ddp__timeline *t;
    __atomic_add_fetch(&ddp__tl_handlers_running, 1, __ATOMIC_ACQ_REL);
    t = ddp__tl_get();
    if (t) {
        if (!__atomic_exchange_n(&t->lock, 1, __ATOMIC_ACQUIRE)) {
            ddp__tl_write(t);
            __atomic_store_n(&t->lock, 0, __ATOMIC_RELEASE);
        } else {
            __atomic_store_n(&t->flush_wanted, 1, __ATOMIC_RELAXED); /* its holder writes when it lets go */
        }
    }
    __atomic_sub_fetch(&ddp__tl_handlers_running, 1, __ATOMIC_ACQ_REL);
    errno = saved;
    if (ddp__tl_old_usr1.sa_flags & SA_SIGINFO) {
        if (ddp__tl_old_usr1.sa_sigaction) ddp__tl_old_usr1.sa_sigaction(sig, info, ctx);
    } else if (ddp__tl_old_usr1.sa_handler != SIG_DFL && ddp__tl_old_usr1.sa_handler != SIG_IGN) {
        ddp__tl_old_usr1.sa_handler(sig);
    }
}

/* ---- open and close ---- */

/* The file name of `rank` for PATH (see the top): out has cap bytes; 0 when it does not fit. */
static int ddp__tl_file_name(const char *path, int rank, char *out, size_t cap) {
    const char *mark = strstr(path, "%r"), *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
    int n;
    if (mark) n = snprintf(out, cap, "%.*s%d%s", (int)(mark - path), path, rank, mark + 2);
    else if (dot && (!slash || dot > slash + 1)) n = snprintf(out, cap, "%.*s.rank%d%s", (int)(dot - path), path, rank, dot);
    else n = snprintf(out, cap, "%s.rank%d", path, rank);
    return n > 0 && (size_t)n < cap;
}

/* Open this rank's file and write its header (metadata: the rank's name and order, the lanes' names).
   base: where this process's CLOCK_MONOTONIC now (mono0) lies on the job's clock. */
static ddp_result ddp__tl_open(ddp_group *g, const char *path, double mono0, double base) {
    struct ddp__timeline *t;
    struct sigaction sa;
    char header[1024];
    int n;
    if (!(t = (struct ddp__timeline *)ddp__calloc(1, sizeof *t))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "timeline: out of memory");
    if (!ddp__tl_file_name(path, g->rank, t->path, sizeof t->path)) {
        ddp__free(t);
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "timeline: the path \"%.300s\" is too long", path);
    }
    t->fd = open(t->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (t->fd < 0) {
        ddp_result r = ddp__fail(g, DDP_ERR_SYSTEM, "timeline: cannot create %s: %s (DDP_TIMELINE or ddp_init_desc.timeline "
                                 "names each rank's file; its directory must exist and be writable)", t->path, strerror(errno));
        ddp__free(t);
        return r;
    }
    t->rank = g->rank;
    t->world = g;
    t->mono0 = mono0;
    t->base = base;
    n = snprintf(header, sizeof header,
                 "{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}}"
                 ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}"
                 ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"program\"}}"
                 ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"checkpoint saver\"}}"
                 ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"progress (world)\"}}",
                 g->rank, g->rank, g->rank, g->rank, g->rank, DDP__TL_PROGRAM, g->rank, DDP__TL_SAVER, g->rank, DDP__TL_PROGRESS);
    memcpy(t->buf, header, (size_t)n);
    t->len = (size_t)n;
    ddp__tl_write(t);
    if (!ddp__tl_signal_installed) {
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = ddp__tl_on_signal;
        sa.sa_flags = SA_SIGINFO | SA_RESTART;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGUSR1, &sa, &ddp__tl_old_usr1) == 0) ddp__tl_signal_installed = 1;
    }
    __atomic_store_n(&ddp__tl, t, __ATOMIC_RELEASE);
    ddp__log(g, DDP_LOG_INFO, "timeline: writing %s", t->path);
    return DDP_SUCCESS;
}

/* Group g ends: when it is the timeline's world group, write the rest and close the file. */
static void ddp__timeline_close_of(const ddp_group *g) {
    struct ddp__timeline *t = ddp__tl_get();
    if (!t || t->world != g) return;
    ddp__tl_lock(t);
    __atomic_store_n(&ddp__tl, (struct ddp__timeline *)NULL, __ATOMIC_RELEASE);
    ddp__tl_write(t);
    __atomic_store_n(&t->lock, 0, __ATOMIC_RELEASE);
    while (__atomic_load_n(&ddp__tl_handlers_running, __ATOMIC_ACQUIRE)) sched_yield();
    close(t->fd);
    ddp__free(t);
}

/* ---- the program's ranges ---- */

DDP_API ddp_result ddp_timeline_begin(ddp_group *g, const char *name) {
    struct ddp__timeline *t;
    ddp_result r = ddp__group_check(g, "ddp_timeline_begin");
    if (r) return r;
    if (!name) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_timeline_begin: the name is NULL");
    if (!(t = ddp__tl_get())) return DDP_SUCCESS;
    ddp__tl_lock(t);
    ddp__tl_head(t, 0, name, 'B', ddp__now(), -1);
    ddp__tl_put(t, "}");
    ddp__tl_unlock(t);
    ddp__tl_depth++;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_timeline_end(ddp_group *g) {
    struct ddp__timeline *t;
    ddp_result r = ddp__group_check(g, "ddp_timeline_end");
    if (r) return r;
    if (!(t = ddp__tl_get())) return DDP_SUCCESS;
    if (ddp__tl_depth == 0)
        return ddp__fail(g, DDP_ERR_STATE, "ddp_timeline_end: no range is open on this thread; each ddp_timeline_end "
                         "closes the last ddp_timeline_begin of the same thread");
    ddp__tl_depth--;
    ddp__tl_lock(t);
    ddp__tl_head(t, 0, "", 'E', ddp__now(), -1);
    ddp__tl_put(t, "}");
    ddp__tl_unlock(t);
    return DDP_SUCCESS;
}

/* ---- merging the ranks' files ----
   Each input is a timeline file as written above: one event a line (each but the last ending in a comma)
   between the first line and the tail.
   A line is taken when it is one whole JSON object (its braces balance outside strings): a file cut
   short by a killed process loses its unfinished line only. Missing inputs are skipped with a warning
   (a rank that never started); an input that is not a timeline file is an error. */

/* Is line (n bytes) one whole object "{...}"? */
static int ddp__tl_whole(const char *line, size_t n) {
    size_t i;
    int depth = 0, in_string = 0;
    if (n < 2 || line[0] != '{' || line[n - 1] != '}') return 0;
    for (i = 0; i < n; i++) {
        char c = line[i];
        if (in_string) {
            if (c == '\\') i++;
            else if (c == '"') in_string = 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if ((c == '}' || c == ']') && --depth == 0 && i != n - 1) {
            return 0;
        }
    }
    return depth == 0 && !in_string;
}

/* Copy the events of file `path` to out (each preceded by ",\n" except the very first: *first). */
static ddp_result ddp__tl_merge_one(const char *path, FILE *out, int *first, size_t *events) {
    FILE *in = fopen(path, "rb");
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t n;
    if (!in) {
        ddp__log(NULL, DDP_LOG_WARN, "ddp_timeline_merge: %s: %s (left out)", path, strerror(errno));
        return DDP_SUCCESS;
    }
    while ((n = getline(&line, &cap, in)) >= 0) {
        size_t len = (size_t)n;
        const char *ev = line;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
        if (lineno++ == 0) {
            if (strncmp(line, "{\"traceEvents\":[", 16) != 0) {
                free(line);
                fclose(in);
                return ddp__fail(NULL, DDP_ERR_FORMAT, "ddp_timeline_merge: %s is not a ddp.h timeline file (its first line "
                                 "is not {\"traceEvents\":[)", path);
            }
            continue;
        }
        if (len && ev[len - 1] == ',') len--; /* the writer ends each event line but the last with a comma */
        if (!ddp__tl_whole(ev, len)) continue; /* the tail, or a line cut short */
        fputs(*first ? "\n" : ",\n", out);
        fwrite(ev, 1, len, out);
        *first = 0;
        ++*events;
    }
    free(line); /* getline's buffer: the C library's malloc */
    fclose(in);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_timeline_merge(const char *out_path, const char *const *inputs, int n) {
    char tmp[1100];
    FILE *out;
    int i, first = 1;
    size_t events = 0;
    ddp_result r = DDP_SUCCESS;
    if (!out_path || (!inputs && n > 0) || n < 0)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_timeline_merge: %s", !out_path ? "the output path is NULL"
                         : n < 0 ? "n is negative" : "inputs is NULL");
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", out_path, (int)getpid()) >= (int)sizeof tmp)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_timeline_merge: the output path is too long");
    if (!(out = fopen(tmp, "wb")))
        return ddp__fail(NULL, DDP_ERR_SYSTEM, "ddp_timeline_merge: cannot create %s: %s", tmp, strerror(errno));
    fputs("{\"traceEvents\":[", out);
    for (i = 0; i < n && r == DDP_SUCCESS; i++) {
        if (!inputs[i]) r = ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_timeline_merge: inputs[%d] is NULL", i);
        else r = ddp__tl_merge_one(inputs[i], out, &first, &events);
    }
    fputs(DDP__TL_TAIL, out);
    if (fclose(out) != 0 && r == DDP_SUCCESS)
        r = ddp__fail(NULL, DDP_ERR_SYSTEM, "ddp_timeline_merge: writing %s failed: %s", tmp, strerror(errno));
    if (r == DDP_SUCCESS && rename(tmp, out_path) != 0)
        r = ddp__fail(NULL, DDP_ERR_SYSTEM, "ddp_timeline_merge: cannot rename %s to %s: %s", tmp, out_path, strerror(errno));
    if (r != DDP_SUCCESS) unlink(tmp);
    return r;
}
