/* [SECTION] launcher: ddp_spawn (torch.multiprocessing.spawn) and ddprun (torchrun)
   Both start a group of worker processes on this host with torchrun's environment and watch them:

       fork a guardian, which forks N workers (each in its own process group, each told RANK,
         WORLD_SIZE, MASTER_ADDR, ...) and reports each worker's pid and, later, its exit status
       loop: sleep until the guardian reports (a pipe) or 5 ms pass; read its reports
         all exited 0         -> success
         one failed           -> collect the failures of the next 0.25 s, name the likely cause
                                 (which rank, exit code or signal), then stop the others:
                                 SIGTERM to every worker's process group, SIGKILL after a grace period
         ddprun got a signal  -> forward it to every worker, then stop them as above

   The fail-fast loop is what torchrun's agent does (torch/distributed/elastic/agent/server/api.py):
   without it a dead rank leaves the others blocked in a collective until the 30-minute timeout.
   ddprun adds torchrun's --max-restarts: stop everybody, start the whole group again with
   TORCHELASTIC_RESTART_COUNT (and DDP_RESTART_COUNT) incremented, so the program resumes from its
   checkpoint. Rendezvous is static: every node runs ddprun with the same --nproc-per-node,
   --nnodes, --master-addr and --master-port and its own --node-rank; torchrun's elastic rendezvous
   (--rdzv-backend, a range in --nnodes) is not supported. The workers' rank 0 serves the store
   (TORCHELASTIC_USE_AGENT_STORE=False), as under torchrun --standalone.

   ddprun --ft (fault-tolerant training, src/ft.h): every worker gets DDP_FT=1, and a worker killed by a
   signal is a lost member, not a failure: ddprun says so (one line: its rank, the signal, "the others
   went on without it") and keeps watching the others, whose next ddp_ft_begin / ddp_ft_commit goes on
   without it. The job succeeds (exit 0) when every worker that exited did so with 0 and at least one
   did; a worker that exits non-zero fails the job as without --ft. With --max-restarts R a lost worker
   is started again alone, at most R times per rank, with DDP_FT_JOIN=1: its ddp_ft_begin joins the
   running job with the members' state (the whole group is never restarted under --ft). On node 0 ddprun
   serves the store itself (TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's agent), so that losing the
   workers' rank 0 loses no store and a joiner finds the job there.

   No orphans. The launcher (ddprun, or the program calling ddp_spawn) may itself be killed with
   SIGKILL, and then it can clean up nothing. So the workers are not its children but the children of
   the guardian, a process forked for the purpose (ddp__launch_guard):

       launcher --(pipe: "stop")--> guardian (child subreaper) --> workers --> their children ...
                <--(pipe: pids, exit statuses)--

   The guardian is a child subreaper (Linux PR_SET_CHILD_SUBREAPER): a process that a worker's
   descendant leaves behind, even one that made itself a daemon (setsid, double fork), becomes the
   guardian's child instead of init's. When the launcher closes its end of the pipe, because it is done
   or because it died (the kernel closes it then), the guardian kills every worker's process group and
   every child it has with SIGKILL, again as killed processes' children come to it, until it has no
   child left; then it exits. Workers die with the guardian (PR_SET_PDEATHSIG), should it be killed. */
#include "internal.h"
#include <dirent.h>
#include <sched.h>
#include <dirent.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__GLIBC__) && !defined(__USE_GNU) /* <sched.h> read without _GNU_SOURCE (see internal.h) */
#define CPU_SETSIZE __CPU_SETSIZE
#define CPU_SET(cpu, set) __CPU_SET_S(cpu, sizeof(cpu_set_t), set)
#define CPU_ISSET(cpu, set) __CPU_ISSET_S(cpu, sizeof(cpu_set_t), set)
#define CPU_ZERO(set) __CPU_ZERO_S(sizeof(cpu_set_t), set)
extern int sched_setaffinity(pid_t pid, size_t cpusetsize, const cpu_set_t *cpuset);
extern int sched_getaffinity(pid_t pid, size_t cpusetsize, cpu_set_t *cpuset);
#endif

#define DDP__LAUNCH_GRACE 3.0      /* seconds between SIGTERM and SIGKILL when stopping workers */
#define DDP__LAUNCH_POLL 0.005     /* seconds between two looks at the workers */
#define DDP__LAUNCH_SETTLE 0.25    /* seconds to collect other failures after the first one */
#define DDP__LAUNCH_MAX_PROCS 65536 /* per node; also the largest --nnodes */
#define DDP__LAUNCH_EARLY 2.0      /* seconds after a worker exited 0 while others run before ddprun says so
                                      (ranks that finish together end within milliseconds of each other) */

/* What every worker of one launch is told: torchrun's launch environment (torch 1.13's
   torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers). */
typedef struct ddp__launch_env {
    int nproc, nnodes, node_rank;
    char master_addr[256];
    int master_port;
    int restart_count, max_restarts;
    char run_id[64];
    char role[64];
    int set_omp; /* OMP_NUM_THREADS=1, as torchrun does when it is unset and nproc > 1 */
    int cpu_bind; /* 1: give each worker its own slice of the launcher's CPUs (ddp__launch_bind) */
    int ft;       /* --ft: DDP_FT=1 for every worker; a worker killed by a signal is a lost member */
} ddp__launch_env;

/* One worker process; rank is the global rank. */
typedef struct ddp__launch_worker {
    pid_t pid;
    int rank, local_rank;
    int status; /* waitpid status, valid once reaped */
    int reaped;
    int lost;   /* the guardian ended before reporting it: its status is unknown, counted as a failure */
    int pidfd;  /* in the guardian: readable once the process has ended (Linux 5.3+); -1 when unavailable */
    int pass;   /* the look (ddp__launch_reap) that found it failed; 0 = not failed */
    int ft_lost; /* --ft: killed by a signal while the others went on (a lost member, not a failure) */
    int restarts; /* --ft: started again as a joiner so many times */
    double ended; /* ddp__now() when it was seen to have ended */
} ddp__launch_worker;

/* The workers of one attempt and how to report on them. */
typedef struct ddp__launch_group {
    const char *who; /* "ddprun" or "ddp_spawn": starts every line it prints */
    int to_stderr;   /* 1: print to stderr (ddprun); 0: ddp__log at error level (ddp_spawn) */
    int signals;     /* 1: react to the signals ddprun caught (ddp__launch_signal_got) */
    int n;
    int pass;        /* looks at the workers so far */
    ddp__launch_worker *w;
    pid_t guard;     /* the guardian, the workers' parent (ddp__launch_guard); 0 when none runs */
    int from_guard;  /* the launcher reads the guardian's reports here; -1 = closed */
    int to_guard;    /* only the launcher holds this write end; closing it tells the guardian to finish */
    int early_noted; /* ddprun has said that a worker exited 0 while others still ran */
    int ft;          /* ddprun --ft: a worker killed by a signal is a lost member (ddp__launch_ft_lost) */
    int ft_restarts; /* ddprun --ft --max-restarts: how often each worker may be started again as a joiner */
} ddp__launch_group;

/* What the guardian tells the launcher, one whole write() each (atomic: smaller than PIPE_BUF). */
enum {
    DDP__GUARD_STARTED = 1, /* worker `index` runs as `pid` */
    DDP__GUARD_FORK_FAILED, /* fork() for worker `index` failed with errno `value`; no more are started */
    DDP__GUARD_ENDED,       /* worker `index` (`pid`) ended with wait status `value` */
    DDP__GUARD_LEFTOVER     /* at the end, process `pid` (not a worker) was still running: it was killed */
};
typedef struct ddp__launch_report {
    int kind, index, pid, value;
} ddp__launch_report;

/* ddprun's signal handlers write here. A handler can reach nothing but globals, so this is the one
   mutable global of the library; ddp_spawn never touches it. */
static volatile sig_atomic_t ddp__launch_signal_got;   /* the last signal received, 0 = none */
static volatile sig_atomic_t ddp__launch_signal_count; /* how many were received */

static void ddp__launch_say(const ddp__launch_group *lg, const char *fmt, ...) DDP__PRINTF(2, 3);

static void ddp__launch_say(const ddp__launch_group *lg, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (lg->to_stderr) {
        fprintf(stderr, "%s: %s\n", lg->who, msg);
        fflush(stderr);
    } else {
        ddp__log(NULL, DDP_LOG_ERROR, "%s: %s", lg->who, msg);
    }
}

static const char *ddp__launch_signame(int sig) {
    switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    }
    return "a signal without a short name";
}

/* "exited with code 3", "was killed by signal 9 (SIGKILL)" */
static void ddp__launch_describe(const ddp__launch_worker *w, char *buf, size_t size) {
    int status = w->status;
    if (w->lost) {
        snprintf(buf, size, "ended, but its exit status is unknown: the guardian process that watched it was killed");
    } else if (WIFEXITED(status)) {
        snprintf(buf, size, "exited with code %d", WEXITSTATUS(status));
    } else if (WIFSIGNALED(status)) {
        snprintf(buf, size, "was killed by signal %d (%s)%s", WTERMSIG(status), ddp__launch_signame(WTERMSIG(status)),
                 WCOREDUMP(status) ? ", core dumped" : "");
    } else {
        snprintf(buf, size, "ended with wait status 0x%x", (unsigned)status);
    }
}

/* The shell's convention: the exit code, or 128 + the signal number. Never 0 for a failure. */
static int ddp__launch_exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status) ? WEXITSTATUS(status) : 1;
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 1;
}

static int ddp__launch_failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

/* "rank 2 (pid 1234)", with the local rank when this node does not start at rank 0. */
static void ddp__launch_name(const ddp__launch_worker *w, char *buf, size_t size) {
    if (w->rank == w->local_rank)
        snprintf(buf, size, "rank %d (pid %ld)", w->rank, (long)w->pid);
    else
        snprintf(buf, size, "rank %d (local rank %d, pid %ld)", w->rank, w->local_rank, (long)w->pid);
}

static int ddp__launch_running(const ddp__launch_group *lg) {
    int i, n = 0;
    for (i = 0; i < lg->n; i++) n += !lg->w[i].reaped;
    return n;
}

static void ddp__launch_mark_reaped(ddp__launch_worker *w, int status) {
    w->status = status;
    w->reaped = 1;
    w->ended = ddp__now();
    if (w->pidfd >= 0) close(w->pidfd);
    w->pidfd = -1;
}

/* Wait up to timeout_ms for the guardian's next report. Returns 1 with *r filled, 0 when none came
   (or a signal interrupted the wait), -1 when the guardian is gone (end of file: it exited or was
   killed; a report is written whole, so a part of one means the same). */
static int ddp__launch_next_report(const ddp__launch_group *lg, ddp__launch_report *r, int timeout_ms) {
    struct pollfd pfd;
    size_t got = 0;
    if (lg->from_guard < 0) return -1;
    pfd.fd = lg->from_guard;
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (poll(&pfd, 1, timeout_ms) <= 0) return 0;
    while (got < sizeof *r) {
        ssize_t k = read(lg->from_guard, (char *)r + got, sizeof *r - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 1;
}

/* The guardian is gone without reporting them: the running workers died with it (PR_SET_PDEATHSIG)
   or will be stopped by nobody else; each counts as a failure of this look. Returns how many. */
static int ddp__launch_guard_lost(ddp__launch_group *lg) {
    int i, failed = 0;
    for (i = 0; i < lg->n; i++) {
        ddp__launch_worker *w = &lg->w[i];
        if (w->reaped) continue;
        w->lost = 1;
        ddp__launch_mark_reaped(w, 1 << 8); /* as "exited with code 1" for the exit code */
        w->pass = lg->pass;
        failed++;
    }
    return failed;
}

/* One non-blocking look at the workers: read every report the guardian has sent. Returns how many
   workers were found to have failed in this look (marked with its pass number). */
static int ddp__launch_reap(ddp__launch_group *lg) {
    ddp__launch_report r;
    int failed = 0, got;
    lg->pass++;
    while ((got = ddp__launch_next_report(lg, &r, 0)) == 1) {
        ddp__launch_worker *w;
        if (r.kind == DDP__GUARD_STARTED && r.index >= 0 && r.index < lg->n) { /* a replacement (ddprun --ft) */
            w = &lg->w[r.index];
            w->pid = (pid_t)r.pid, w->reaped = 0, w->pass = 0, w->ft_lost = 0, w->status = 0;
            continue;
        }
        if (r.kind != DDP__GUARD_ENDED || r.index < 0 || r.index >= lg->n || lg->w[r.index].reaped) continue;
        w = &lg->w[r.index];
        ddp__launch_mark_reaped(w, r.value);
        if (ddp__launch_failed(r.value)) {
            w->pass = lg->pass;
            failed++;
        }
    }
    if (got < 0) failed += ddp__launch_guard_lost(lg);
    return failed;
}

/* Sleep until something may have happened: poll() on fd (the launcher: the guardian's reports; the
   guardian: the launcher's pipe) and on the pidfds of (the first 63) running workers (the guardian's
   only) wakes at once, and a signal to ddprun interrupts it; the DDP__LAUNCH_POLL timeout covers the
   rest (workers without pidfds, kernels before 5.3). */
static void ddp__launch_nap(const ddp__launch_group *lg, int fd) {
    struct pollfd fds[64];
    int i, n = 0;
    if (fd >= 0) {
        fds[n].fd = fd;
        fds[n].events = POLLIN;
        fds[n].revents = 0;
        n++;
    }
    for (i = 0; i < lg->n && n < (int)(sizeof fds / sizeof fds[0]); i++) {
        if (lg->w[i].reaped || lg->w[i].pidfd < 0) continue;
        fds[n].fd = lg->w[i].pidfd;
        fds[n].events = POLLIN;
        fds[n].revents = 0;
        n++;
    }
    if (n == 0) {
        ddp__sleep(DDP__LAUNCH_POLL);
        return;
    }
    poll(fds, (nfds_t)n, (int)(DDP__LAUNCH_POLL * 1000));
}

/* Of the workers that failed since look `since`, the one that most likely made the others fail.
   When a rank dies, the others lose a peer and fail too, all in the same way (the same exit code),
   and on a busy machine they may end before the dead rank can even be reaped. So: a failure unlike
   every other one is the cause; among several such, or none, the earliest seen, then the lowest rank. */
static int ddp__launch_culprit(const ddp__launch_group *lg, int since) {
    int i, j, best = -1, best_unique = 0;
    for (i = 0; i < lg->n; i++) {
        const ddp__launch_worker *a = &lg->w[i];
        int unique = 1;
        if (a->pass < since) continue;
        for (j = 0; j < lg->n; j++)
            if (j != i && lg->w[j].pass >= since && lg->w[j].status == a->status && lg->w[j].lost == a->lost) unique = 0;
        if (best < 0 || unique > best_unique || (unique == best_unique && a->pass < lg->w[best].pass)) {
            best = i;
            best_unique = unique;
        }
    }
    return best;
}

/* "; at about the same time rank 0 (pid 11) exited with code 1, rank 3 (pid 14) exited with code 1":
   the other failures since look `since`, so that nothing is hidden when the guess is wrong. */
static void ddp__launch_also(const ddp__launch_group *lg, int culprit, int since, char *buf, size_t size) {
    size_t len = 0;
    int i, listed = 0, more = 0;
    buf[0] = '\0';
    for (i = 0; i < lg->n; i++) {
        char name[96], how[128];
        if (i == culprit || lg->w[i].pass < since) continue;
        if (listed == 4) {
            more++;
            continue;
        }
        ddp__launch_name(&lg->w[i], name, sizeof name);
        ddp__launch_describe(&lg->w[i], how, sizeof how);
        snprintf(buf + len, size - len, "%s%s %s", listed ? ", " : "; at about the same time ", name, how);
        len = strlen(buf);
        listed++;
    }
    if (more) snprintf(buf + len, size - len, " and %d more", more);
}

static void ddp__launch_signal_all(const ddp__launch_group *lg, int sig) {
    int i;
    for (i = 0; i < lg->n; i++) {
        /* the worker's whole process group (its own children too); the pid alone when the group
           is already gone. Reaped workers' groups are signalled as well: their children may linger. */
        if (lg->w[i].pid <= 0) continue; /* never kill(0) or kill(-1) */
        if (kill(-lg->w[i].pid, sig) != 0 && !lg->w[i].reaped) kill(lg->w[i].pid, sig);
    }
}

/* Stop every worker still running: sig (SIGTERM, or what ddprun received) to each process group,
   then SIGKILL to those still there after the grace period (or at once on a second signal to
   ddprun). Returns when every worker has been reaped. */
static void ddp__launch_stop(ddp__launch_group *lg, int sig) {
    double deadline = ddp__now() + DDP__LAUNCH_GRACE;
    sig_atomic_t signals_before = ddp__launch_signal_count;
    int i;
    ddp__launch_signal_all(lg, sig);
    while (ddp__launch_running(lg) > 0 && ddp__now() < deadline &&
           !(lg->signals && ddp__launch_signal_count != signals_before)) {
        ddp__launch_nap(lg, lg->from_guard);
        ddp__launch_reap(lg);
    }
    for (i = 0; i < lg->n; i++) {
        char name[96];
        if (lg->w[i].reaped) continue;
        ddp__launch_name(&lg->w[i], name, sizeof name);
        ddp__launch_say(lg, "%s did not stop within %.0f s of %s; sending SIGKILL", name, DDP__LAUNCH_GRACE,
                        ddp__launch_signame(sig));
    }
    /* also catches children of workers that ignored the first signal and exited without them */
    ddp__launch_signal_all(lg, SIGKILL);
    while (ddp__launch_running(lg) > 0) { /* the guardian reports each, or its end marks them lost */
        ddp__launch_nap(lg, lg->from_guard);
        ddp__launch_reap(lg);
    }
}

/* ddprun, once per attempt: a worker that exited 0 at least DDP__LAUNCH_EARLY s ago while others still
   run. torchrun waits for the others (a worker that succeeds is not a failure), and so does ddprun,
   but it says so: the others will likely fail or hang waiting for that rank in a collective. */
static void ddp__launch_note_early_exit(ddp__launch_group *lg) {
    int i, first = -1, running = ddp__launch_running(lg);
    char name[96];
    if (!lg->signals || lg->early_noted || running == 0) return;
    for (i = 0; i < lg->n; i++) {
        const ddp__launch_worker *w = &lg->w[i];
        if (w->reaped && !w->lost && w->status == 0 && (first < 0 || w->ended < lg->w[first].ended)) first = i;
    }
    if (first < 0 || ddp__now() - lg->w[first].ended < DDP__LAUNCH_EARLY) return;
    lg->early_noted = 1;
    ddp__launch_name(&lg->w[first], name, sizeof name);
    if (running == 1)
        ddp__launch_say(lg, "%s exited with code 0 while 1 other worker is still running; waiting for it, as torchrun "
                        "does (if it waits for rank %d in a collective, it will fail at its timeout)", name,
                        lg->w[first].rank);
    else
        ddp__launch_say(lg, "%s exited with code 0 while %d other workers are still running; waiting for them, as "
                        "torchrun does (if they wait for rank %d in a collective, they will fail at their timeout)",
                        name, running, lg->w[first].rank);
}

/* ddprun --ft: of the workers found failed in this look, those killed by a signal are lost members: say so,
   one line each, and take them off the failures (the others go on without them). Returns how many. */
static int ddp__launch_ft_lost(ddp__launch_group *lg) {
    int i, n = 0;
    for (i = 0; i < lg->n; i++) {
        ddp__launch_worker *w = &lg->w[i];
        char name[96], how[128];
        if (w->pass != lg->pass || w->lost || !WIFSIGNALED(w->status)) continue;
        w->pass = 0;
        w->ft_lost = 1;
        n++;
        ddp__launch_name(w, name, sizeof name);
        ddp__launch_describe(w, how, sizeof how);
        if (w->restarts < lg->ft_restarts && ddp__launch_running(lg) > 0) { /* a replacement joins the others */
            int32_t index = i;
            if (write(lg->to_guard, &index, sizeof index) == (ssize_t)sizeof index) {
                w->restarts++;
                w->reaped = 0, w->ft_lost = 0; /* running again once the guardian reports it */
                ddp__launch_say(lg, "%s %s (--ft: a lost member); starting it again as a joiner (DDP_FT_JOIN=1, "
                                "restart %d of at most %d)", name, how, w->restarts, lg->ft_restarts);
                continue;
            }
        }
        ddp__launch_say(lg, "%s %s%s (--ft: a lost member)", name, how,
                        ddp__launch_running(lg) > 0 ? "; the others went on without it" : "");
    }
    return n;
}

/* ddprun --ft, once every worker has ended without a failure: 0 when at least one exited 0; else every
   worker was lost, which fails the job with the first lost worker's code (msg says so). */
static int ddp__launch_ft_end(const ddp__launch_group *lg, char *msg) {
    int i, first = -1;
    for (i = 0; i < lg->n; i++) {
        if (!lg->w[i].ft_lost) return 0;
        if (first < 0 || lg->w[i].ended < lg->w[first].ended) first = i;
    }
    snprintf(msg, DDP__ERR_MAX, "every one of the %d workers was lost (killed by a signal); none finished", lg->n);
    return ddp__launch_exit_code(lg->w[first].status);
}

/* Watch the workers until all exited 0 (returns 0), one failed, or ddprun received a signal; in the
   last two cases stop the others, write what happened to msg (DDP__ERR_MAX bytes) and return the
   exit code for ddprun: the failed worker's (128 + signal when it was killed), or 128 + the signal
   ddprun received. With --ft a worker killed by a signal is not a failure (ddp__launch_ft_lost). */
static int ddp__launch_monitor(ddp__launch_group *lg, char *msg) {
    for (;;) {
        int failed = ddp__launch_reap(lg), running, sig;
        if (failed > 0 && lg->ft) failed -= ddp__launch_ft_lost(lg);
        if (failed > 0) {
            char name[96], how[128], also[512];
            const ddp__launch_worker *w;
            int since = lg->pass;
            double settle = ddp__now() + DDP__LAUNCH_SETTLE;
            while (ddp__launch_running(lg) > 0 && ddp__now() < settle) {
                ddp__launch_nap(lg, lg->from_guard);
                ddp__launch_reap(lg);
            }
            w = &lg->w[ddp__launch_culprit(lg, since)];
            running = ddp__launch_running(lg);
            ddp__launch_name(w, name, sizeof name);
            ddp__launch_describe(w, how, sizeof how);
            ddp__launch_also(lg, (int)(w - lg->w), since, also, sizeof also);
            if (running > 0)
                ddp__launch_say(lg, "%s %s%s; stopping the other %d worker%s", name, how, also, running,
                                running == 1 ? "" : "s");
            else
                ddp__launch_say(lg, "%s %s%s", name, how, also);
            ddp__launch_stop(lg, SIGTERM);
            snprintf(msg, DDP__ERR_MAX, "%s of %d %s%s; %d other running worker%s stopped", name, lg->n, how, also,
                     running, running == 1 ? " was" : "s were");
            return ddp__launch_exit_code(w->status);
        }
        running = ddp__launch_running(lg);
        if (running == 0) return lg->ft ? ddp__launch_ft_end(lg, msg) : 0;
        sig = lg->signals ? (int)ddp__launch_signal_got : 0;
        if (sig) {
            ddp__launch_say(lg, "received %s; forwarding it to the %d running worker%s", ddp__launch_signame(sig),
                            running, running == 1 ? "" : "s");
            ddp__launch_stop(lg, sig);
            snprintf(msg, DDP__ERR_MAX, "%s received %s and stopped its %d running worker%s", lg->who,
                     ddp__launch_signame(sig), running, running == 1 ? "" : "s");
            return 128 + sig;
        }
        ddp__launch_note_early_exit(lg);
        ddp__launch_nap(lg, lg->from_guard);
    }
}

/* Exit statuses are only kept while SIGCHLD is not ignored: with SIG_IGN (or SA_NOCLDWAIT) the
   kernel reaps children at once. Restore the default for as long as workers run; old receives
   the caller's action for ddp__launch_sigchld_restore. */
static void ddp__launch_sigchld_default(struct sigaction *old) {
    struct sigaction sa;
    sigaction(SIGCHLD, NULL, old);
    if (old->sa_handler != SIG_IGN && !(old->sa_flags & SA_NOCLDWAIT)) return;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
}

static void ddp__launch_sigchld_restore(const struct sigaction *old) { sigaction(SIGCHLD, old, NULL); }

/* ---- starting workers ---- */

static void ddp__launch_setenv_int(const char *name, long value) {
    char v[32];
    snprintf(v, sizeof v, "%ld", value);
    setenv(name, v, 1);
}

/* In the forked worker: the variables torchrun sets (see ddp_launcher_main's help for the list). */
static void ddp__launch_export(const ddp__launch_env *e, int local_rank) {
    long world = (long)e->nproc * e->nnodes, rank = (long)e->node_rank * e->nproc + local_rank;
    ddp__launch_setenv_int("RANK", rank);
    ddp__launch_setenv_int("LOCAL_RANK", local_rank);
    ddp__launch_setenv_int("WORLD_SIZE", world);
    ddp__launch_setenv_int("LOCAL_WORLD_SIZE", e->nproc);
    ddp__launch_setenv_int("GROUP_RANK", e->node_rank);
    ddp__launch_setenv_int("GROUP_WORLD_SIZE", e->nnodes);
    ddp__launch_setenv_int("ROLE_RANK", rank);
    ddp__launch_setenv_int("ROLE_WORLD_SIZE", world);
    setenv("ROLE_NAME", e->role, 1);
    setenv("MASTER_ADDR", e->master_addr, 1);
    ddp__launch_setenv_int("MASTER_PORT", e->master_port);
    ddp__launch_setenv_int("TORCHELASTIC_RESTART_COUNT", e->restart_count);
    ddp__launch_setenv_int("TORCHELASTIC_MAX_RESTARTS", e->max_restarts);
    setenv("TORCHELASTIC_RUN_ID", e->run_id, 1);
    setenv("TORCHELASTIC_USE_AGENT_STORE", e->ft ? "True" : "False", 1); /* --ft: ddprun serves it */
    ddp__launch_setenv_int("DDP_RESTART_COUNT", e->restart_count);
    if (e->ft) setenv("DDP_FT", "1", 1);
    if (e->set_omp) setenv("OMP_NUM_THREADS", "1", 0);
}

/* In the forked worker: bind local_rank to its slice of the CPUs the launcher may use (inherited
   through fork). The allowed CPUs, in increasing order, are cut into nproc contiguous slices of
   equal size (the first `extra` slices get one more); neighbouring ids are usually distinct physical
   cores, and a slice of them keeps a worker's memory traffic and cache on its own core(s). Why: an
   unbound worker that waits by spinning is migrated across cores by the scheduler, and every
   migration costs microseconds (measured: 2-rank 4-byte all_reduce 3.8 us unbound, 0.4 us bound).
   With more workers than CPUs nothing is bound: oversubscribed workers must be free to move (Open
   MPI does the same). Failure to bind is not an error: the worker runs unbound. */
static void ddp__launch_bind(const ddp__launch_env *e, int local_rank) {
#ifdef __linux__
    cpu_set_t allowed, mine;
    int cpus[CPU_SETSIZE], n = 0, c, per, extra, first, count, k;
    if (!e->cpu_bind || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
    for (c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
    if (e->nproc > n) return;
    per = n / e->nproc;
    extra = n % e->nproc;
    first = local_rank * per + (local_rank < extra ? local_rank : extra);
    count = per + (local_rank < extra);
    CPU_ZERO(&mine);
    for (k = 0; k < count; k++) CPU_SET(cpus[first + k], &mine);
    sched_setaffinity(0, sizeof mine, &mine);
#else
    (void)e;
    (void)local_rank;
#endif
}

/* In the forked worker: its own process group (so stopping it stops its children too), and death
   with its parent, the guardian (should the guardian be killed). */
static void ddp__launch_child_setup(pid_t guardian) {
    setpgid(0, 0);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
    if (getppid() != guardian) _exit(1); /* the guardian died before prctl took effect */
}

/* A file descriptor that becomes readable when pid ends (pidfd_open, Linux 5.3+; close-on-exec), or -1. */
static int ddp__launch_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

/* ---- the guardian (see the top of this section) ---- */

/* The signals whose actions the guardian changes, and the workers get back. */
static const int ddp__guard_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD};
#define DDP__GUARD_NSIGNALS ((int)(sizeof ddp__guard_signals / sizeof ddp__guard_signals[0]))

/* The guardian's one write() of a report. The launcher may be gone (EPIPE, SIGPIPE is ignored). */
static void ddp__guard_report(int fd, int kind, int index, pid_t pid, int value) {
    ddp__launch_report r;
    memset(&r, 0, sizeof r);
    r.kind = kind;
    r.index = index;
    r.pid = (int)pid;
    r.value = value;
    while (write(fd, &r, sizeof r) < 0 && errno == EINTR) {
    }
}

/* The guardian ignores the signals that reach the launcher's process group (Ctrl-C, a job system's
   kill of the group: ddprun forwards them to the workers itself, and a killed ddp_spawn caller is
   what the guardian is for) and SIGPIPE; its SIGCHLD is the default (a caller's handler that calls
   wait would steal the statuses). It becomes a child subreaper, named ddp_guardian (the command
   line stays the launcher's). saved[] receives the old actions. */
static void ddp__guard_setup(struct sigaction *saved) {
    struct sigaction sa;
    int i;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    for (i = 0; i < DDP__GUARD_NSIGNALS; i++) {
        sa.sa_handler = ddp__guard_signals[i] == SIGCHLD ? SIG_DFL : SIG_IGN;
        sigaction(ddp__guard_signals[i], &sa, &saved[i]);
    }
#ifdef __linux__
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    prctl(PR_SET_NAME, "ddp_guardian"); /* in ps and top; `pkill ddprun` does not reach it */
#endif
}

/* In a worker forked by the guardian: the launcher's signal actions back, the guardian's pipes and
   the other workers' pidfds closed. */
static void ddp__guard_child(const ddp__launch_group *lg, int upto, const struct sigaction *saved, int fd1, int fd2) {
    int k;
    for (k = 0; k < upto; k++)
        if (lg->w[k].pidfd >= 0) close(lg->w[k].pidfd);
    close(fd1);
    close(fd2);
    for (k = 0; k < DDP__GUARD_NSIGNALS; k++) sigaction(ddp__guard_signals[k], &saved[k], NULL);
}

/* In the guardian: fork worker i: exec argv (ddprun) or run fn (ddp_spawn); join: a replacement of a lost
   member (ddprun --ft), told so by DDP_FT_JOIN=1. Reports its pid, or the fork() that failed (returns -1). */
static int ddp__guard_fork_one(ddp__launch_group *lg, const ddp__launch_env *e, char **argv, int (*fn)(int, int, void *),
                               void *arg, const struct sigaction *saved, int from_launcher, int to_launcher, int i, int join) {
    ddp__launch_worker *w = &lg->w[i];
    pid_t self = getpid(), pid = fork();
    if (pid < 0) {
        ddp__guard_report(to_launcher, DDP__GUARD_FORK_FAILED, i, 0, errno);
        return -1;
    }
    if (pid == 0) {
        ddp__guard_child(lg, lg->n, saved, from_launcher, to_launcher);
        ddp__launch_child_setup(self);
        ddp__launch_export(e, i);
        if (join) setenv("DDP_FT_JOIN", "1", 1);
        ddp__launch_bind(e, i);
        if (argv) {
            execvp(argv[0], argv);
            fprintf(stderr, "%s: cannot run %s: %s\n", lg->who, argv[0], strerror(errno));
            _exit(127);
        } else {
            int rc = fn(w->rank, lg->n, arg);
            fflush(NULL);
            /* exit codes are 8 bits: keep a failure a failure (256 would read as 0) */
            _exit(rc == 0 ? 0 : ((rc & 0xff) ? (rc & 0xff) : 1));
        }
    }
    setpgid(pid, pid); /* also here: the group must exist before anyone signals it */
    if (w->pidfd >= 0) close(w->pidfd);
    w->pid = pid;
    w->pidfd = ddp__launch_pidfd(pid);
    w->reaped = 0;
    ddp__guard_report(to_launcher, DDP__GUARD_STARTED, i, pid, 0);
    return 0;
}

/* In the guardian: fork every worker; at the first fork() that failed lg->n becomes the number started. */
static void ddp__guard_fork_workers(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                                    int (*fn)(int, int, void *), void *arg, const struct sigaction *saved,
                                    int from_launcher, int to_launcher) {
    int i;
    for (i = 0; i < lg->n; i++)
        if (ddp__guard_fork_one(lg, e, argv, fn, arg, saved, from_launcher, to_launcher, i, 0) < 0) {
            lg->n = i;
            return;
        }
}

static int ddp__guard_worker_index(const ddp__launch_group *lg, pid_t pid) {
    int i;
    for (i = 0; i < lg->n; i++)
        if (lg->w[i].pid == pid) return i;
    return -1;
}

/* In the guardian: reap every child that ended (workers, and orphans that came to the subreaper);
   report the workers' ends. */
static void ddp__guard_reap(ddp__launch_group *lg, int to_launcher) {
    int st = 0;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        int i = ddp__guard_worker_index(lg, p);
        if (i < 0 || lg->w[i].reaped) continue;
        ddp__launch_mark_reaped(&lg->w[i], st);
        ddp__guard_report(to_launcher, DDP__GUARD_ENDED, i, p, st);
    }
}

/* What the launcher said on its pipe: -2 once it closed it (done), the index of a worker to start again
   (ddprun --ft), or -1 when it said nothing. */
static int ddp__guard_launcher_says(int from_launcher) {
    struct pollfd pfd;
    int32_t index;
    ssize_t k;
    pfd.fd = from_launcher;
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (poll(&pfd, 1, 0) <= 0) return -1;
    k = read(from_launcher, &index, sizeof index);
    return k == (ssize_t)sizeof index && index >= 0 ? (int)index : k < 0 && errno == EINTR ? -1 : -2;
}

/* SIGKILL each running child of this process (from /proc: the parent is the 4th field of
   /proc/PID/stat, after the parenthesised name, which may itself hold spaces and parentheses).
   When report_to >= 0, each one that is not a worker is reported as left over. */
static void ddp__guard_kill_children(const ddp__launch_group *lg, int report_to) {
    DIR *d = opendir("/proc");
    struct dirent *de;
    long self = (long)getpid();
    if (!d) return;
    while ((de = readdir(d)) != NULL) {
        char path[64], buf[512], state = 0, *end = NULL, *paren;
        long pid = strtol(de->d_name, &end, 10), ppid = 0;
        ssize_t len;
        int fd;
        if (pid <= 0 || *end != '\0') continue;
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        if ((fd = open(path, O_RDONLY)) < 0) continue;
        len = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) continue;
        buf[len] = '\0';
        paren = strrchr(buf, ')');
        if (!paren || sscanf(paren + 1, " %c %ld", &state, &ppid) != 2 || ppid != self || state == 'Z') continue;
        kill((pid_t)pid, SIGKILL);
        if (report_to >= 0 && ddp__guard_worker_index(lg, (pid_t)pid) < 0)
            ddp__guard_report(report_to, DDP__GUARD_LEFTOVER, -1, (pid_t)pid, 0);
    }
    closedir(d);
}

/* In the guardian, once the launcher is done or dead: SIGKILL every child (reporting the ones that
   were left running) and every worker's process group, then again for the children that the killed
   processes leave to the guardian, until it has no child left. */
static void ddp__guard_sweep(const ddp__launch_group *lg, int to_launcher) {
    int round;
    for (round = 0;; round++) {
        int i;
        ddp__guard_kill_children(lg, round == 0 ? to_launcher : -1);
        for (i = 0; i < lg->n; i++)
            if (lg->w[i].pid > 0) kill(-lg->w[i].pid, SIGKILL);
        if (waitpid(-1, NULL, 0) < 0 && errno == ECHILD) return;
    }
}

/* The guardian: start the workers, report on them, and when the launcher closes its pipe (done, or
   killed) leave nothing behind. Never returns. */
static void ddp__launch_guard(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                              int (*fn)(int, int, void *), void *arg, int from_launcher, int to_launcher) {
    struct sigaction saved[DDP__GUARD_NSIGNALS];
    int restart;
    ddp__guard_setup(saved);
    ddp__guard_fork_workers(lg, e, argv, fn, arg, saved, from_launcher, to_launcher);
    while ((restart = ddp__guard_launcher_says(from_launcher)) != -2) {
        if (restart >= 0 && restart < lg->n) /* ddprun --ft: worker `restart` again, as a joiner */
            ddp__guard_fork_one(lg, e, argv, fn, arg, saved, from_launcher, to_launcher, restart, 1);
        ddp__guard_reap(lg, to_launcher);
        ddp__launch_nap(lg, from_launcher);
    }
    ddp__guard_sweep(lg, to_launcher);
    _exit(0);
}

/* ---- the launcher's side ---- */

static void ddp__launch_cloexec(int fd) { fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC); }

/* Close the pipe to the guardian (it then stops whatever the workers left running), read what it
   stopped, and wait for it to exit. The group's workers must all have been reaped. */
static void ddp__launch_finish(ddp__launch_group *lg) {
    ddp__launch_report r;
    long pids[4];
    int got, left = 0;
    if (lg->to_guard >= 0) close(lg->to_guard);
    lg->to_guard = -1;
    while ((got = ddp__launch_next_report(lg, &r, 1000)) >= 0) {
        if (got == 1 && r.kind == DDP__GUARD_LEFTOVER && left < 4) pids[left] = r.pid;
        left += got == 1 && r.kind == DDP__GUARD_LEFTOVER;
    }
    if (lg->from_guard >= 0) close(lg->from_guard);
    lg->from_guard = -1;
    while (lg->guard > 0 && waitpid(lg->guard, NULL, 0) < 0 && errno == EINTR) {
    }
    lg->guard = 0;
    if (left > 0) {
        char list[96];
        size_t len = 0;
        int i;
        list[0] = '\0';
        for (i = 0; i < left && i < 4; i++) {
            snprintf(list + len, sizeof list - len, "%s%ld", i ? ", " : "", pids[i]);
            len = strlen(list);
        }
        ddp__launch_say(lg, "the workers left %d process%s running when the group ended (pid%s %s%s); killed %s and "
                        "%s children (SIGKILL)", left, left == 1 ? "" : "es", left == 1 ? "" : "s", list,
                        left > 4 ? ", ..." : "", left == 1 ? "it" : "them", left == 1 ? "its" : "their");
    }
}
/* Read the guardian's STARTED reports, one per worker in order. When a fork() failed or the guardian
   is gone, stop the workers started so far and fail with the reason in err. */
static ddp_result ddp__launch_await_start(ddp__launch_group *lg, char *err) {
    int i = 0;
    while (i < lg->n) {
        ddp__launch_report r;
        int got = ddp__launch_next_report(lg, &r, 1000);
        if (got == 0) continue;
        if (got == 1 && r.kind == DDP__GUARD_STARTED && r.index == i) {
            lg->w[i++].pid = (pid_t)r.pid;
            continue;
        }
        lg->n = i;
        ddp__launch_stop(lg, SIGTERM);
        ddp__launch_finish(lg);
        if (got == 1 && r.kind == DDP__GUARD_FORK_FAILED)
            return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: fork() for local rank %d failed: %s (process limit? see "
                                "ulimit -u)", lg->who, i, strerror(r.value));
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: its guardian process ended (killed?) before it started local "
                            "rank %d; nothing was left running", lg->who, i);
    }
    return DDP_SUCCESS;
}

/* Start the guardian, which starts the workers: exec argv (ddprun) or run fn (ddp_spawn) in each.
   On failure nothing is left running and the error is in err; on success end the group with
   ddp__launch_finish once every worker has been reaped. */
static ddp_result ddp__launch_start(ddp__launch_group *lg, const ddp__launch_env *e, char **argv,
                                    int (*fn)(int, int, void *), void *arg, char *err) {
    int down[2], up[2], saved; /* down: launcher -> guardian (only closed), up: guardian -> launcher (reports) */
    pid_t pid;
    if (pipe(down) != 0) return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: pipe(): %s", lg->who, strerror(errno));
    if (pipe(up) != 0) {
        saved = errno;
        close(down[0]);
        close(down[1]);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: pipe(): %s", lg->who, strerror(saved));
    }
    ddp__launch_cloexec(down[0]);
    ddp__launch_cloexec(down[1]);
    ddp__launch_cloexec(up[0]);
    ddp__launch_cloexec(up[1]);
    fflush(NULL); /* or buffered output would be written again by every worker */
    pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        ddp__launch_guard(lg, e, argv, fn, arg, down[0], up[1]);
    }
    saved = errno;
    close(down[0]);
    close(up[1]);
    if (pid < 0) {
        close(down[1]);
        close(up[0]);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "%s: fork() for the guardian of the workers failed: %s (process "
                            "limit? see ulimit -u)", lg->who, strerror(saved));
    }
    lg->guard = pid;
    lg->to_guard = down[1];
    lg->from_guard = up[0];
    return ddp__launch_await_start(lg, err);
}

/* ddprun (is_ddprun = 1) prints to stderr and reacts to the signals it caught; ddp_spawn logs. */
static ddp__launch_group ddp__launch_group_make(int is_ddprun, int n, int first_rank, ddp__launch_worker *w) {
    ddp__launch_group lg;
    int i;
    lg.who = is_ddprun ? "ddprun" : "ddp_spawn";
    lg.to_stderr = is_ddprun;
    lg.signals = is_ddprun;
    lg.n = n;
    lg.pass = 0;
    lg.w = w;
    lg.guard = 0;
    lg.from_guard = -1;
    lg.to_guard = -1;
    lg.early_noted = 0;
    lg.ft = 0;
    lg.ft_restarts = 0;
    for (i = 0; i < n; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].rank = first_rank + i;
        w[i].local_rank = i;
        w[i].pidfd = -1;
    }
    return lg;
}

/* A TCP port that was free a moment ago: bind port 0 and read what the kernel chose (what torchrun
   --standalone does; another process may still take it before rank 0 binds it). */
static int ddp__launch_free_port(char *err) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot find a free port: socket(): %s", strerror(errno));
        return -1;
    }
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot find a free port: bind(port 0): %s", strerror(errno));
        close(fd);
        return -1;
    }
    port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static void ddp__launch_env_defaults(ddp__launch_env *e) {
    memset(e, 0, sizeof *e);
    e->nproc = 1;
    e->nnodes = 1;
    snprintf(e->master_addr, sizeof e->master_addr, "127.0.0.1");
    e->master_port = 29500;
    snprintf(e->run_id, sizeof e->run_id, "none");
    snprintf(e->role, sizeof e->role, "default");
}

/* ---- ddp_spawn ---- */

DDP_API ddp_result ddp_spawn(int nprocs, int (*fn)(int rank, int world_size, void *arg), void *arg) {
    ddp__launch_env e;
    ddp__launch_group lg;
    ddp__launch_worker *w;
    ddp_result r;
    struct sigaction old_chld;
    char *err = ddp__error_buffer(NULL);
    char msg[DDP__ERR_MAX];
    if (nprocs < 1 || nprocs > DDP__LAUNCH_MAX_PROCS)
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_spawn: nprocs=%d must be in [1, %d]", nprocs,
                         DDP__LAUNCH_MAX_PROCS);
    if (!fn) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_spawn: fn is NULL; pass the function each process runs");
    ddp__launch_env_defaults(&e);
    e.nproc = nprocs;
    e.set_omp = nprocs > 1;
    e.master_port = ddp__launch_free_port(err);
    if (e.master_port < 0) return DDP_ERR_SYSTEM;
    w = (ddp__launch_worker *)ddp__calloc((size_t)nprocs, sizeof *w);
    if (!w) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_spawn: cannot allocate %d worker records", nprocs);
    lg = ddp__launch_group_make(0, nprocs, 0, w);
    ddp__launch_sigchld_default(&old_chld);
    r = ddp__launch_start(&lg, &e, NULL, fn, arg, err);
    if (r == DDP_SUCCESS) {
        int code = ddp__launch_monitor(&lg, msg);
        ddp__launch_finish(&lg);
        if (code != 0) r = ddp__fail(NULL, DDP_ERR_WORKER_FAILED, "ddp_spawn: %s", msg);
    }
    ddp__launch_sigchld_restore(&old_chld);
    ddp__free(w);
    return r;
}

/* ---- ddprun ---- */

/* The parsed command line. */
typedef struct ddp__launch_args {
    ddp__launch_env env;
    int standalone, port_given, help, nnodes_given, node_rank_given, run_id_given;
    char timeline[900]; /* --timeline FILE ("" none) */
    char **program;     /* NULL-terminated argv of the program */
} ddp__launch_args;

static const char ddp__launch_usage[] =
    "usage: ddprun [flags] [--] PROGRAM [ARGS...]\n"
    "Start PROGRAM once per worker with torchrun's environment, so that ddp_init(NULL) (or torch's\n"
    "init_process_group(\"env://\")) in it joins the group. Flags take `--flag value` or `--flag=value`,\n"
    "with dashes or underscores (--nproc-per-node or --nproc_per_node).\n"
    "\n"
    "  --nproc-per-node N    workers on this node (default 1); \"cpu\" = the number of online CPUs.\n"
    "                        \"gpu\" and \"auto\" are not accepted: ddprun does not link CUDA; give the\n"
    "                        number of GPUs (for example $(nvidia-smi -L | wc -l)).\n"
    "  --nnodes M            nodes taking part (default 1); every node runs ddprun with the same\n"
    "                        --nproc-per-node, --nnodes, --master-addr and --master-port\n"
    "  --node-rank K         this node's index in [0, M) (default 0); it starts global ranks\n"
    "                        K*N .. K*N+N-1\n"
    "  --master-addr HOST    where rank 0 serves the rendezvous store (default 127.0.0.1)\n"
    "  --master-port PORT    its TCP port (default 29500)\n"
    "  --standalone          single node on a free port (found by binding port 0); a new one is picked\n"
    "                        for each restart. Excludes --master-port and --nnodes/--node-rank other than 1/0\n"
    "  --max-restarts R      when a worker fails, stop all and start the whole group again, at most R\n"
    "                        times (default 0); TORCHELASTIC_RESTART_COUNT and DDP_RESTART_COUNT tell\n"
    "                        the program which attempt it is, so it can resume from its checkpoint\n"
    "  --ft                  fault-tolerant training (ddp.h's ddp_ft_begin / ddp_ft_commit): DDP_FT=1 for\n"
    "                        every worker, and a worker killed by a signal is a lost member: ddprun\n"
    "                        says so and the others go on without it (see below); with\n"
    "                        --max-restarts R it starts it again alone (DDP_FT_JOIN=1), at most R\n"
    "                        times per rank, and it serves the store itself\n"
    "  --rdzv-id ID          TORCHELASTIC_RUN_ID, the job's name in the store: give every node the same\n"
    "                        one (default: a random UUID per launch on one node, \"none\" across nodes;\n"
    "                        a rank that reaches the store of a job with another run id says so)\n"
    "  --role NAME           ROLE_NAME (default \"default\")\n"
    "  --cpu-bind MODE       \"auto\" (default): when there are at least N CPUs that ddprun may run on,\n"
    "                        each worker is bound to its own contiguous slice of them (as mpirun binds);\n"
    "                        with more workers than CPUs nothing is bound. \"none\": never bind (use\n"
    "                        this when the program sets its own affinity or several jobs share the CPUs)\n"
    "  --no-python           accepted and ignored: ddprun always runs PROGRAM itself\n"
    "  --timeline FILE       the workers write Chrome traces (DDP_TIMELINE) that ddprun merges into\n"
    "                        FILE when the job ends, failed or not: open it in ui.perfetto.dev or\n"
    "                        chrome://tracing (with --nnodes > 1 each node writes its ranks into its\n"
    "                        own FILE; ddprun --merge-timeline joins the nodes' files)\n"
    "  -h, --help            this text\n"
    "\n"
    "ddprun --merge-timeline OUT IN...   merge timeline files (each rank's, or each node's) into OUT.\n"
    "\n";
/* the rest of --help (C99 promises string literals of 4095 bytes only) */
static const char ddp__launch_usage_more[] =
    "Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (= node rank),\n"
    "GROUP_WORLD_SIZE (= nnodes), ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,\n"
    "TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,\n"
    "TORCHELASTIC_USE_AGENT_STORE=False (rank 0 serves the store), DDP_RESTART_COUNT, DDP_FT=1\n"
    "with --ft, and OMP_NUM_THREADS=1 when it is unset and N > 1. Each worker runs in its own\n"
    "process group.\n"
    "No orphans: when the group ends, or when ddprun is killed (even with SIGKILL), every process\n"
    "the workers started that still runs (children, daemons) is killed with SIGKILL.\n"
    "\n"
    "When a worker exits non-zero or is killed by a signal, ddprun says which rank and how, sends\n"
    "SIGTERM to the other workers (SIGKILL after 3 s) and exits with the worker's code (128 + signal\n"
    "number when it was killed). SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to ddprun are forwarded to\n"
    "the workers, which are then stopped the same way; ddprun then exits with 128 + that signal.\n"
    "A worker that exits 0 while others still run is waited for, as torchrun does; ddprun says so.\n"
    "With --ft a worker killed by a signal does not stop the others: ddprun prints one line for it\n"
    "(rank, signal, \"the others went on without it\") and waits for the rest; it exits 0 when every\n"
    "other worker exited 0 (and one at least did). A non-zero exit code fails the job as without --ft.\n"
    "With --ft --max-restarts R the lost worker is started again as a joiner of the running job.\n"
    "Rendezvous is static: torchrun's elastic rendezvous (--rdzv-backend, --rdzv-endpoint, a range\n"
    "in --nnodes) is not supported.\n";

/* Flags torchrun has that ddprun refuses, with the reason. */
static const char *ddp__launch_refused(const char *name) {
    static const char *elastic = "elastic rendezvous is not supported; use static rendezvous: the same --nnodes, "
                                 "--master-addr and --master-port on every node, and each node's own --node-rank";
    static const char *python = "ddprun runs a program, not a Python module or script path; give the interpreter "
                                "as the program: ddprun ... python3 -m MODULE";
    static const char *output = "ddprun does not redirect worker output: every worker writes to ddprun's own "
                                "stdout and stderr";
    if (!strcmp(name, "rdzv-backend") || !strcmp(name, "rdzv-endpoint") || !strcmp(name, "rdzv-conf") ||
        !strcmp(name, "max-nodes") || !strcmp(name, "min-nodes"))
        return elastic;
    if (!strcmp(name, "module") || !strcmp(name, "run-path")) return python;
    if (!strcmp(name, "redirects") || !strcmp(name, "tee") || !strcmp(name, "log-dir")) return output;
    return NULL;
}

static ddp_result ddp__launch_parse_long(const char *flag, const char *v, long lo, long hi, long *out, char *err) {
    char *end = NULL;
    long x = 0;
    errno = 0;
    x = strtol(v, &end, 10);
    if (errno || end == v || *end != '\0' || x < lo || x > hi)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s \"%s\": expected an integer in [%ld, %ld]", flag, v, lo,
                            hi);
    *out = x;
    return DDP_SUCCESS;
}

static ddp_result ddp__launch_parse_nproc(const char *v, int *out, char *err) {
    long x = 0;
    if (!strcmp(v, "cpu")) {
        x = sysconf(_SC_NPROCESSORS_ONLN);
        *out = x > 0 ? (int)DDP__MIN(x, (long)DDP__LAUNCH_MAX_PROCS) : 1;
        return DDP_SUCCESS;
    }
    if (!strcmp(v, "gpu") || !strcmp(v, "auto"))
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--nproc-per-node %s: ddprun does not link CUDA and cannot "
                            "count GPUs; give the number of workers, e.g. --nproc-per-node $(nvidia-smi -L | wc -l)", v);
    if (ddp__launch_parse_long("nproc-per-node", v, 1, DDP__LAUNCH_MAX_PROCS, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
    *out = (int)x;
    return DDP_SUCCESS;
}

/* torchrun writes a range "MIN:MAX" for elastic jobs; only MIN == MAX is a static job. */
static ddp_result ddp__launch_parse_nnodes(const char *v, int *out, char *err) {
    const char *colon = strchr(v, ':');
    long lo = 0, hi = 0;
    char first[32];
    if (!colon) {
        if (ddp__launch_parse_long("nnodes", v, 1, DDP__LAUNCH_MAX_PROCS, &lo, err)) return DDP_ERR_INVALID_ARGUMENT;
        *out = (int)lo;
        return DDP_SUCCESS;
    }
    if ((size_t)(colon - v) >= sizeof first) return ddp__launch_parse_long("nnodes", v, 1, 1, &lo, err);
    memcpy(first, v, (size_t)(colon - v));
    first[colon - v] = '\0';
    if (ddp__launch_parse_long("nnodes", first, 1, DDP__LAUNCH_MAX_PROCS, &lo, err) ||
        ddp__launch_parse_long("nnodes", colon + 1, 1, DDP__LAUNCH_MAX_PROCS, &hi, err))
        return DDP_ERR_INVALID_ARGUMENT;
    if (lo != hi)
        return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "--nnodes %s: a range of nodes needs elastic rendezvous, which "
                            "ddprun does not support; give one number", v);
    *out = (int)lo;
    return DDP_SUCCESS;
}

static ddp_result ddp__launch_copy(const char *flag, const char *v, char *dst, size_t size, char *err) {
    if (!*v || strlen(v) >= size)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s \"%s\": expected a non-empty value shorter than %d "
                            "characters", flag, v, (int)size);
    memcpy(dst, v, strlen(v) + 1);
    return DDP_SUCCESS;
}

/* Apply one flag that takes a value; name is normalised (dashes). The parsing functions below
   return DDP_SUCCESS or an error with the message in err. */
static ddp_result ddp__launch_apply(ddp__launch_args *a, const char *name, const char *v, char *err) {
    long x = 0;
    if (!strcmp(name, "nproc-per-node")) return ddp__launch_parse_nproc(v, &a->env.nproc, err);
    if (!strcmp(name, "nnodes")) {
        a->nnodes_given = 1;
        return ddp__launch_parse_nnodes(v, &a->env.nnodes, err);
    }
    if (!strcmp(name, "node-rank")) {
        a->node_rank_given = 1;
        if (ddp__launch_parse_long(name, v, 0, DDP__LAUNCH_MAX_PROCS - 1, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
        a->env.node_rank = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "master-addr")) return ddp__launch_copy(name, v, a->env.master_addr, sizeof a->env.master_addr, err);
    if (!strcmp(name, "master-port")) {
        a->port_given = 1;
        if (ddp__launch_parse_long(name, v, 1, 65535, &x, err)) {
            if (!strcmp(v, "0")) strncat(err, " (for a free port use --standalone)", DDP__ERR_MAX - strlen(err) - 1);
            return DDP_ERR_INVALID_ARGUMENT;
        }
        a->env.master_port = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "max-restarts")) {
        if (ddp__launch_parse_long(name, v, 0, 1000000, &x, err)) return DDP_ERR_INVALID_ARGUMENT;
        a->env.max_restarts = (int)x;
        return DDP_SUCCESS;
    }
    if (!strcmp(name, "rdzv-id")) {
        a->run_id_given = 1;
        return ddp__launch_copy(name, v, a->env.run_id, sizeof a->env.run_id, err);
    }
    if (!strcmp(name, "role")) return ddp__launch_copy(name, v, a->env.role, sizeof a->env.role, err);
    if (!strcmp(name, "timeline")) return ddp__launch_copy(name, v, a->timeline, sizeof a->timeline, err);
    if (!strcmp(name, "cpu-bind")) {
        if (strcmp(v, "auto") && strcmp(v, "none"))
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--cpu-bind \"%s\": expected auto or none", v);
        a->env.cpu_bind = !strcmp(v, "auto");
        return DDP_SUCCESS;
    }
    return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag --%s", name);
}

static int ddp__launch_is_switch(const char *name) {
    return !strcmp(name, "standalone") || !strcmp(name, "no-python") || !strcmp(name, "help") || !strcmp(name, "ft");
}

static int ddp__launch_takes_value(const char *name) {
    static const char *names[] = {"nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port",
                                  "max-restarts", "rdzv-id", "role", "cpu-bind", "timeline"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i])) return 1;
    return 0;
}

/* One "--flag[=value]" at argv[*i]; may consume the next argument as its value. */
static ddp_result ddp__launch_parse_flag(ddp__launch_args *a, int argc, char **argv, int *i, char *err) {
    const char *arg = argv[*i] + 2, *eq = strchr(arg, '='), *value = eq ? eq + 1 : NULL;
    const char *refused;
    char name[64];
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg), k;
    if (len == 0 || len >= sizeof name) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag %s", argv[*i]);
    for (k = 0; k < len; k++) name[k] = arg[k] == '_' ? '-' : arg[k];
    name[len] = '\0';
    if (ddp__launch_is_switch(name)) {
        if (value) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s takes no value (got \"%s\")", name, value);
        if (!strcmp(name, "standalone")) a->standalone = 1;
        if (!strcmp(name, "help")) a->help = 1;
        if (!strcmp(name, "ft")) a->env.ft = 1;
        return DDP_SUCCESS; /* --no-python: we always run the program itself */
    }
    refused = ddp__launch_refused(name);
    if (refused) return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "--%s: %s", name, refused);
    if (!ddp__launch_takes_value(name)) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag --%s", name);
    if (!value) {
        if (*i + 1 >= argc) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--%s needs a value", name);
        value = argv[++*i];
    }
    return ddp__launch_apply(a, name, value, err);
}

/* The flags before the program; the first argument that is not a flag (or the one after "--")
   is the program, and everything after it belongs to the program. */
static ddp_result ddp__launch_parse(ddp__launch_args *a, int argc, char **argv, char *err) {
    int i;
    memset(a, 0, sizeof *a);
    ddp__launch_env_defaults(&a->env);
    a->env.cpu_bind = 1; /* ddprun binds unless told not to; ddp_spawn never does (the caller's process) */
    for (i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--")) {
            i++;
            break;
        }
        if (!strcmp(arg, "-h")) {
            a->help = 1;
            continue;
        }
        if (arg[0] != '-' || arg[1] == '\0') break;
        if (arg[1] != '-') return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "unknown flag %s", arg);
        if (ddp__launch_parse_flag(a, argc, argv, &i, err)) return DDP_ERR_INVALID_ARGUMENT;
    }
    a->program = i < argc ? argv + i : NULL;
    return DDP_SUCCESS;
}

/* Checks that need all the flags at once. */
static ddp_result ddp__launch_validate(ddp__launch_args *a, char *err) {
    ddp__launch_env *e = &a->env;
    if (!a->program)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "missing the program to run: ddprun [flags] [--] PROGRAM [ARGS...]");
    if (a->standalone && (e->nnodes != 1 || e->node_rank != 0))
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--standalone is for one node, but --nnodes %d --node-rank %d "
                            "were given; drop --standalone or those flags", e->nnodes, e->node_rank);
    if (a->standalone && a->port_given)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--standalone picks a free port itself; drop --master-port "
                            "or --standalone");
    if (e->node_rank >= e->nnodes)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--node-rank %d must be smaller than --nnodes %d (node ranks "
                            "are 0 .. nnodes-1)", e->node_rank, e->nnodes);
    if ((long long)e->nproc * e->nnodes > INT_MAX)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "--nproc-per-node %d times --nnodes %d is too many ranks",
                            e->nproc, e->nnodes);
    return DDP_SUCCESS;
}

/* 1 when execvp would find prog: a path to an executable file, or one in PATH. */
static int ddp__launch_executable(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

static int ddp__launch_findable(const char *prog) {
    const char *path = getenv("PATH"), *p;
    char buf[4096];
    if (strchr(prog, '/')) return ddp__launch_executable(prog);
    if (!path) path = "/usr/local/bin:/usr/bin:/bin";
    for (p = path;; p++) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        int n = len ? snprintf(buf, sizeof buf, "%.*s/%s", (int)len, p, prog) : snprintf(buf, sizeof buf, "%s", prog);
        if (n > 0 && (size_t)n < sizeof buf && ddp__launch_executable(buf)) return 1;
        if (!end) return 0;
        p = end;
    }
}

/* torchrun --standalone names its run with a random UUID (version 4). */
static void ddp__launch_uuid(char *out, size_t size) {
    unsigned char b[16];
    size_t i, got = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        got = fread(b, 1, sizeof b, f);
        fclose(f);
    }
    if (got != sizeof b) {
        uint64_t s = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull ^ (uint64_t)(ddp__now() * 1e9);
        for (i = 0; i < sizeof b; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            b[i] = (unsigned char)(s >> 56);
        }
    }
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    snprintf(out, size, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void ddp__launch_on_signal(int sig) {
    ddp__launch_signal_got = sig;
    ddp__launch_signal_count = ddp__launch_signal_count + 1;
}

static const int ddp__launch_forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
#define DDP__LAUNCH_NFORWARDED ((int)(sizeof ddp__launch_forwarded / sizeof ddp__launch_forwarded[0]))

/* Catch the signals ddprun forwards; one that was ignored when ddprun started (nohup, `&` in a
   script) stays ignored, as shells expect. old[] receives the previous actions. */
static void ddp__launch_catch(struct sigaction *old) {
    struct sigaction sa;
    int i;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ddp__launch_on_signal;
    sigemptyset(&sa.sa_mask);
    ddp__launch_signal_got = 0;
    ddp__launch_signal_count = 0;
    for (i = 0; i < DDP__LAUNCH_NFORWARDED; i++) {
        sigaction(ddp__launch_forwarded[i], NULL, &old[i]);
        if (old[i].sa_handler != SIG_IGN) sigaction(ddp__launch_forwarded[i], &sa, NULL);
    }
}

static void ddp__launch_uncatch(const struct sigaction *old) {
    int i;
    for (i = 0; i < DDP__LAUNCH_NFORWARDED; i++) sigaction(ddp__launch_forwarded[i], &old[i], NULL);
}

/* ---- the flight recorder's files (trace.c) when a job fails ----
   ddprun gives its workers DDP_TRACE_DIR (a directory of its own, $TMPDIR/ddprun_trace.XXXXXX, unless
   the user set one), so each rank writes its recorder there when its group breaks (or when ddprun stops it
   with SIGTERM). After a failed attempt ddprun reads the world group's section of every file of that
   attempt (", restart K" in the header) and prints one line per local rank: the last collective it
   finished and the first one it had not, and flags the ranks that are behind: those whose newest
   collective is the lowest, when the ranks differ. Its own directory is removed after a success and
   kept (and named) after a failure. */
typedef struct ddp__launch_trace {
    int found;
    long newest;          /* the newest collective number (#N) recorded */
    char last_done[160];  /* "#5 barrier()" */
    char pending[320];    /* the first entry after it not done: "#6 all_reduce(...) failed after 2.0 s (...)" */
} ddp__launch_trace;

/* Read the world group's section of one trace file for restart `attempt` into *t; its rank, or -1. */
static int ddp__launch_trace_read(const char *path, int attempt, ddp__launch_trace *t) {
    char line[1024];
    int rank = -1, in_world = 0;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    memset(t, 0, sizeof *t);
    while (fgets(line, sizeof line, f)) {
        char *end;
        if (strncmp(line, "ddp trace rank ", 15) == 0) {
            const char *restart = strstr(line, ", restart ");
            in_world = strstr(line, "), group world,") && restart && strtol(restart + 10, NULL, 10) == attempt;
            if (in_world) rank = atoi(line + 15), t->found = 1;
        } else if (in_world && strncmp(line, "  #", 3) == 0) {
            if ((end = strstr(line, ", queued "))) *end = '\0';
            t->newest = strtol(line + 3, NULL, 10);
            if ((end = strstr(line, " done in "))) {
                *end = '\0';
                snprintf(t->last_done, sizeof t->last_done, "%.150s", line + 2);
                t->pending[0] = '\0';
            } else if (!t->pending[0]) {
                snprintf(t->pending, sizeof t->pending, "%.300s", line + 2);
            }
        }
    }
    fclose(f);
    return t->found ? rank : -1;
}

/* One line per local rank from the files of this attempt in DDP_TRACE_DIR (nothing when none wrote one). */
static void ddp__launch_trace_summary(const ddp__launch_group *lg, int attempt) {
    const char *dir = ddp__env("DDP_TRACE_DIR");
    ddp__launch_trace *t;
    struct dirent *de;
    DIR *d;
    long lo = LONG_MAX, hi = 0;
    int i, any = 0, first = lg->n ? lg->w[0].rank : 0;
    if (!dir || !(d = opendir(dir))) return;
    if (!(t = (ddp__launch_trace *)ddp__calloc((size_t)lg->n + 1, sizeof *t))) {
        closedir(d);
        return;
    }
    while ((de = readdir(d))) { /* a rank with several files (a forked child dumped too): the furthest */
        char path[1024];
        int r;
        if (strncmp(de->d_name, "ddp_trace_rank", 14) != 0 || !strstr(de->d_name, ".txt") || strstr(de->d_name, ".tmp")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if ((r = ddp__launch_trace_read(path, attempt, &t[lg->n])) < first || r >= first + lg->n) continue;
        if (!t[r - first].found || t[lg->n].newest > t[r - first].newest) t[r - first] = t[lg->n];
    }
    closedir(d);
    for (i = 0; i < lg->n; i++)
        if (t[i].found) any = 1, lo = DDP__MIN(lo, t[i].newest), hi = DDP__MAX(hi, t[i].newest);
    if (any) fprintf(stderr, "ddprun: flight recorder: each rank's last collectives (full traces in %s):\n", dir);
    for (i = 0; any && i < lg->n; i++) {
        if (!t[i].found) {
            fprintf(stderr, "ddprun:   rank %d: no trace (it wrote none: recorder off, DDP_TRACE_SIGNAL=0, or killed "
                            "with SIGKILL)\n", first + i);
            continue;
        }
        fprintf(stderr, "ddprun:   rank %d: last done %s; %s%s\n", first + i, t[i].last_done[0] ? t[i].last_done : "none",
                t[i].pending[0] ? t[i].pending : "nothing in progress",
                t[i].newest == lo && lo < hi ? "  <- behind: the other ranks got further" : "");
    }
    if (any && lo < hi)
        fprintf(stderr, "ddprun: the ranks behind stopped at #%ld while others reached #%ld: look at what they do "
                        "between those collectives\n", lo, hi);
    ddp__free(t);
}

/* Give the workers a DDP_TRACE_DIR of ddprun's own when the user set none: 1 when it made one (in dir). */
static int ddp__launch_trace_begin(char *dir, size_t cap) {
    dir[0] = '\0';
    const char *tmp = ddp__env("TMPDIR");
    if (ddp__env("DDP_TRACE_DIR")) return 0;
    if ((size_t)snprintf(dir, cap, "%s/ddprun_trace.XXXXXX", tmp ? tmp : "/tmp") >= cap) snprintf(dir, cap, "/tmp/ddprun_trace.XXXXXX");
    if (!mkdtemp(dir)) {
        dir[0] = '\0';
        return 0;
    }
    setenv("DDP_TRACE_DIR", dir, 1);
    return 1;
}

/* ddprun's own directory: removed after a success, or when empty; kept after a failure that left
   traces (the summary named it). */
static void ddp__launch_trace_end(const char *dir, int own, int code) {
    struct dirent *de;
    DIR *d;
    if (!own) return;
    if (code != 0 || !(d = opendir(dir))) {
        rmdir(dir); /* only when empty */
        return;
    }
    while ((de = readdir(d))) {
        char path[1024];
        if (strncmp(de->d_name, "ddp_trace_rank", 14) != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

#define DDP__LAUNCH_TIMELINE_FILE "rank%r.json" /* each worker's file in ddprun's directory (DDP_TIMELINE) */

/* --timeline FILE: the workers' files go to a directory of ddprun's own beside FILE (DDP_TIMELINE=
   DIR/rank%r.json); 1 when it made it (in dir). */
static int ddp__launch_timeline_begin(const char *file, char *dir, size_t cap) {
    const char *slash = strrchr(file, '/');
    int n = slash ? snprintf(dir, cap, "%.*s/.ddprun_timeline.XXXXXX", (int)(slash - file), file)
                  : snprintf(dir, cap, ".ddprun_timeline.XXXXXX");
    char pattern[1100];
    if (n <= 0 || (size_t)n >= cap || !mkdtemp(dir)) {
        fprintf(stderr, "ddprun: --timeline %s: cannot make a directory beside it for the workers' files: %s\n", file,
                strerror(errno));
        dir[0] = '\0';
        return 0;
    }
    snprintf(pattern, sizeof pattern, "%s/%s", dir, DDP__LAUNCH_TIMELINE_FILE);
    setenv("DDP_TIMELINE", pattern, 1);
    return 1;
}

/* Merge this node's ranks' files (rank order) into FILE, then remove them and the directory. */
static void ddp__launch_timeline_end(const ddp__launch_args *a, const char *file, const char *dir) {
    int i, n = a->env.nproc, first = a->env.node_rank * a->env.nproc;
    char **paths = (char **)ddp__calloc((size_t)n, sizeof *paths), pattern[1100];
    int ok = paths != NULL;
    snprintf(pattern, sizeof pattern, "%s/%s", dir, DDP__LAUNCH_TIMELINE_FILE); /* what the workers were given */
    for (i = 0; ok && i < n; i++)
        ok = (paths[i] = (char *)ddp__malloc(sizeof pattern + 16)) != NULL &&
             ddp__tl_file_name(pattern, first + i, paths[i], sizeof pattern + 16);
    if (!ok) fprintf(stderr, "ddprun: --timeline: out of memory or a path too long in %s\n", dir);
    else if (ddp_timeline_merge(file, (const char *const *)paths, n) != DDP_SUCCESS)
        fprintf(stderr, "ddprun: --timeline: %s\n", ddp_last_error(NULL));
    else
        fprintf(stderr, "ddprun: timeline of ranks %d..%d in %s (ui.perfetto.dev, chrome://tracing)\n", first, first + n - 1,
                file);
    for (i = 0; paths && i < n; i++) {
        if (paths[i]) unlink(paths[i]);
        ddp__free(paths[i]);
    }
    ddp__free(paths);
    rmdir(dir);
}

/* ddprun --merge-timeline OUT IN...: exit 0 when OUT was written. */
static int ddp__launch_merge_main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "ddprun: usage: ddprun --merge-timeline OUT IN...\n");
        return 2;
    }
    if (ddp_timeline_merge(argv[2], (const char *const *)(argv + 3), argc - 3) != DDP_SUCCESS) {
        fprintf(stderr, "ddprun: %s\n", ddp_last_error(NULL));
        return 1;
    }
    return 0;
}

/* Start the group, restart it after failures while restarts are left; returns ddprun's exit code. */
static int ddp__launch_run(ddp__launch_args *a, ddp__launch_group *lg) {
    char err[DDP__ERR_MAX], msg[DDP__ERR_MAX];
    int attempt, code = 1;
    int group_restarts = a->env.ft ? 0 : a->env.max_restarts; /* --ft restarts lost workers alone, as joiners */
    for (attempt = 0; attempt <= group_restarts; attempt++) {
        ddp__store_server *store = NULL;
        a->env.restart_count = attempt;
        if (a->standalone && (a->env.master_port = ddp__launch_free_port(err)) < 0) {
            fprintf(stderr, "ddprun: %s\n", err);
            return 1;
        }
        /* --ft on node 0: ddprun serves the store (as torchrun's agent does), so that losing rank 0 loses no
           store and a joiner finds the job there */
        if (a->env.ft && a->env.node_rank == 0 &&
            ddp__store_server_start(a->env.master_addr, a->env.master_port, DDP_LOG_DEFAULT, &store, err) != DDP_SUCCESS) {
            fprintf(stderr, "ddprun: --ft: cannot serve the store on %s:%d: %s\n", a->env.master_addr, a->env.master_port, err);
            return 1;
        }
        *lg = ddp__launch_group_make(1, a->env.nproc, a->env.node_rank * a->env.nproc, lg->w);
        lg->ft = a->env.ft;
        lg->ft_restarts = a->env.ft ? a->env.max_restarts : 0;
        if (ddp__launch_start(lg, &a->env, a->program, NULL, NULL, err) != DDP_SUCCESS) {
            fprintf(stderr, "%s\n", err);
            ddp__store_server_stop(store);
            return 1;
        }
        code = ddp__launch_monitor(lg, msg);
        ddp__launch_finish(lg);
        ddp__store_server_stop(store);
        if (code == 0) return 0;
        ddp__launch_trace_summary(lg, attempt);
        if (ddp__launch_signal_got) return code; /* the user asked to stop: no restart */
        if (attempt < group_restarts)
            fprintf(stderr, "ddprun: restarting the worker group (restart %d of at most %d)\n", attempt + 1,
                    group_restarts);
    }
    fprintf(stderr, "ddprun: failed: %s%s\n", msg, group_restarts ? " (no restarts left)" : "");
    return code;
}

DDP_API int ddp_launcher_main(int argc, char **argv) {
    ddp__launch_args a;
    ddp__launch_group lg;
    struct sigaction old[DDP__LAUNCH_NFORWARDED], old_chld;
    char err[DDP__ERR_MAX], trace_dir[512], timeline_dir[1000];
    int code, trace_own, timeline_own = 0;
    if (argc > 1 && !strcmp(argv[1], "--merge-timeline")) return ddp__launch_merge_main(argc, argv);
    if (ddp__launch_parse(&a, argc, argv, err) != 0 || (!a.help && ddp__launch_validate(&a, err) != 0)) {
        fprintf(stderr, "ddprun: %s\nTry 'ddprun --help'.\n", err);
        return 2;
    }
    if (a.help) {
        fputs(ddp__launch_usage, stdout);
        fputs(ddp__launch_usage_more, stdout);
        return 0;
    }
    if (!ddp__launch_findable(a.program[0])) {
        fprintf(stderr, "ddprun: cannot run %s: no executable file %s%s\n", a.program[0],
                strchr(a.program[0], '/') ? "at that path" : "of that name in PATH",
                strchr(a.program[0], '/') ? "" : " (for a program in this directory write ./NAME)");
        return 2;
    }
    /* Name the job (torchrun names only --standalone's): a worker whose rank 0 could not bind the port
       and that reaches another job's store there then fails saying so (group.c: ddp__rdzv_job).
       Across nodes every ddprun must name the same run, which only --rdzv-id can do. */
    if ((a.standalone || a.env.nnodes == 1) && !a.run_id_given) ddp__launch_uuid(a.env.run_id, sizeof a.env.run_id);
    a.env.set_omp = a.env.nproc > 1 && !ddp__env("OMP_NUM_THREADS");
    if (a.env.set_omp)
        fprintf(stderr, "ddprun: setting OMP_NUM_THREADS=1 for each worker (it is unset) so that %d workers do not "
                        "overload the machine; set it yourself to tune\n", a.env.nproc);
    lg.w = (ddp__launch_worker *)ddp__calloc((size_t)a.env.nproc, sizeof *lg.w);
    if (!lg.w) {
        fprintf(stderr, "ddprun: out of memory for %d worker records\n", a.env.nproc);
        return 1;
    }
    if (a.timeline[0] && !(timeline_own = ddp__launch_timeline_begin(a.timeline, timeline_dir, sizeof timeline_dir))) {
        ddp__free(lg.w);
        return 1;
    }
    trace_own = ddp__launch_trace_begin(trace_dir, sizeof trace_dir);
    ddp__launch_catch(old);
    ddp__launch_sigchld_default(&old_chld);
    code = ddp__launch_run(&a, &lg);
    if (timeline_own) ddp__launch_timeline_end(&a, a.timeline, timeline_dir);
    ddp__launch_trace_end(trace_dir, trace_own, code);
    ddp__launch_sigchld_restore(&old_chld);
    ddp__launch_uncatch(old);
    ddp__free(lg.w);
    return code;
}
