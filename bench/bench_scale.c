/* bench_scale: ddp_init at many ranks on one machine, by simulation (issue #25, item 8).

   Usage:  build/bench_scale [--procs P] [--timeout S] [--limit S] [--transport tcp|auto] N [N ...]

   For each world size N this runs the library's own ddp_init (rendezvous through rank 0's store
   server, the connections it makes, the transport choice) for N ranks: rank 0 alone in one process
   (so that process holds what rank 0 holds: the store server and rank 0's own connections), ranks
   1..N-1 as threads spread evenly over P more processes (default: 16, or one per 64 ranks above
   1,024; never more than N-1), each thread with its own group from ddp_init_desc (rank, world size,
   master address and port in the descriptor; nothing per rank in the environment). Every thread and
   process is created first and waits at a gate; the clock starts when the gate opens. Then each rank:
   ddp_init, a process-local rendezvous of its threads, a count of the process's sockets, ddp_barrier,
   the count again, ddp_destroy. Rank 0 reads its store server's counters (ddp__store_server_stats: the
   requests it handled and its thread's CPU time) once its barrier returns, that is once every rank has
   finished ddp_init, so they cover the whole rendezvous.

   Prints one row per N:
     init s       from the gate to the last rank out of ddp_init (wall clock)
     barrier, destroy s  from there to the last rank out of ddp_barrier, and then out of ddp_destroy
     requests     requests rank 0's store server handled (all ranks' ddp_init), and per rank
     store CPU    CPU seconds of the store server's thread, and per request
     sockets/rank sockets held by ranks 1..N-1 after ddp_init (the process's count over its ranks; the
                  store client's socket included): mean and the largest process mean; then the same
                  after one ddp_barrier (connections opened on first use show there)
     rank-0 fds   every descriptor of rank 0's process after init (its store server's clients included)
     MiB/rank     resident memory ranks 1..N-1 added in ddp_init, per rank (process RSS after - before)
   A failure prints the first rank's message. --timeout: the group timeout (default 300 s);
   --limit: the whole size's wall-clock limit, after which every process is killed (default
   timeout + 60 s). --transport tcp (default) sets DDP_TRANSPORT=tcp: with every rank on this host the
   library would otherwise build a shared-memory segment of N/2 MiB; auto leaves it unset.
   The soft RLIMIT_NOFILE is raised to the hard one, and both to fs.nr_open where that is allowed
   (root): a process of T threads holds T ranks' sockets, which a real job spreads over T processes.

   Only public API, plus the debug counters of the store server (reached through the rank-0 group's
   member.store_server): it measures whatever rendezvous and connection scheme the library has. */
#define DDP_IMPLEMENTATION
#include "ddp.h"
#include "bench_util.h" /* free_port, bench_now */

#include <dirent.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 1024

/* What one process sends its parent, twice: when each of its ranks has left ddp_init (phase 1), and
   at the end (phase 2; the same struct, completed). */
typedef struct report {
    int ranks, ok_init, ok;    /* ranks it hosted; whose ddp_init succeeded; whose init, barrier, destroy did */
    double init_done;          /* CLOCK_MONOTONIC when its last rank left ddp_init */
    double barrier_done, destroy_done; /* ... left ddp_barrier, ddp_destroy */
    int sockets_init, sockets_barrier, fds_init;
    double rss_added_mib;      /* resident memory added during ddp_init */
    uint64_t requests, connections;
    double store_cpu;          /* rank 0's process only; -1 elsewhere */
    int error_rank;            /* -1: no error */
    char error[700];
} report;

/* Settings and shared state of one worker process. */
static struct {
    int world, first, count; /* ranks first .. first+count-1 */
    int port, gate_fd, go_fd, report_fd;
    double timeout;
    pthread_barrier_t arrived, counted;
    pthread_mutex_t mu;
    report rep;
    int logged;
} W;

static void quiet_log(ddp_log_level level, int rank, const char *message, void *user) {
    int n;
    (void)user;
    pthread_mutex_lock(&W.mu);
    n = W.logged++;
    pthread_mutex_unlock(&W.mu);
    if (n < 3) fprintf(stderr, "[bench_scale rank %d, level %d] %s\n", rank, (int)level, message);
    else if (n == 3) fprintf(stderr, "[bench_scale pid %d] (more messages from this process not shown)\n", (int)getpid());
}

/* Descriptors of this process that are sockets, and all of them. */
static void count_fds(int *sockets, int *fds) {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    char path[300], target[64];
    *sockets = *fds = 0;
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        ssize_t k;
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        k = readlink(path, target, sizeof target - 1);
        if (k <= 0) continue;
        target[k] = '\0';
        (*fds)++;
        if (strncmp(target, "socket:", 7) == 0) (*sockets)++;
    }
    closedir(d);
    (*fds)--; /* the directory's own descriptor */
}

static double rss_mib(void) {
    char line[256];
    double kb = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kb = atof(line + 6);
    fclose(f);
    return kb / 1024.0;
}

static void note_time(double *latest) {
    double t = bench_now();
    pthread_mutex_lock(&W.mu);
    if (t > *latest) *latest = t;
    pthread_mutex_unlock(&W.mu);
}

static void record_error(int rank, const char *what, const char *msg) {
    pthread_mutex_lock(&W.mu);
    if (W.rep.error_rank < 0 || rank < W.rep.error_rank) {
        W.rep.error_rank = rank;
        snprintf(W.rep.error, sizeof W.rep.error, "%s: %.600s", what, msg);
    }
    pthread_mutex_unlock(&W.mu);
}

/* Phase 1 in one process, by its last rank out of ddp_init: count the sockets, and report. Rank 0's
   process (rank 0 alone) first waits for the parent's go, sent once every other process has reported
   phase 1: then every rank has left ddp_init, and the store server's counters cover the whole
   rendezvous and nothing after it. */
static void phase1(ddp_group *g0) {
    char b;
    if (W.first == 0) {
        ddp__server_stats st;
        while (read(W.go_fd, &b, 1) < 0) {
        }
        if (g0 && g0->member.store_server) {
            ddp__store_server_stats(g0->member.store_server, &st);
            W.rep.requests = st.requests;
            W.rep.connections = st.connections;
            W.rep.store_cpu = st.cpu_seconds;
        }
    }
    count_fds(&W.rep.sockets_init, &W.rep.fds_init);
    W.rep.rss_added_mib = rss_mib() - W.rep.rss_added_mib;
    if (write(W.report_fd, &W.rep, sizeof W.rep) != (ssize_t)sizeof W.rep) _exit(4);
}

static void *rank_main(void *arg) {
    int rank = (int)(intptr_t)arg, ok;
    ddp_init_desc d;
    ddp_group *g = NULL;
    ddp_result r;
    struct pollfd gate;
    gate.fd = W.gate_fd, gate.events = POLLIN, gate.revents = 0;
    while (poll(&gate, 1, -1) < 0) { /* EOF when the parent opens the gate */
    }
    memset(&d, 0, sizeof d);
    d.backend = "cpu";
    d.world_size = W.world;
    d.rank = rank;
    d.master_addr = "127.0.0.1";
    d.master_port = W.port;
    d.timeout_seconds = W.timeout;
    d.log_fn = quiet_log;
    r = ddp_init(&d, &g);
    ok = r == DDP_SUCCESS;
    if (!ok) record_error(rank, "ddp_init", ddp_last_error(NULL));
    if (ok) note_time(&W.rep.init_done);
    pthread_mutex_lock(&W.mu);
    W.rep.ok_init += ok;
    pthread_mutex_unlock(&W.mu);
    if (pthread_barrier_wait(&W.arrived) == PTHREAD_BARRIER_SERIAL_THREAD) phase1(rank == 0 ? g : NULL);
    pthread_barrier_wait(&W.counted);
    if (ok && (r = ddp_barrier(g)) != DDP_SUCCESS) {
        record_error(rank, "ddp_barrier", ddp_last_error(g));
        ok = 0;
    }
    if (ok) note_time(&W.rep.barrier_done);
    if (pthread_barrier_wait(&W.arrived) == PTHREAD_BARRIER_SERIAL_THREAD) {
        int fds;
        count_fds(&W.rep.sockets_barrier, &fds);
    }
    pthread_barrier_wait(&W.counted);
    if (g && (r = ddp_destroy(g)) != DDP_SUCCESS && ok) {
        record_error(rank, "ddp_destroy", ddp_last_error(NULL));
        ok = 0;
    }
    if (ok) note_time(&W.rep.destroy_done);
    pthread_mutex_lock(&W.mu);
    W.rep.ok += ok;
    pthread_mutex_unlock(&W.mu);
    return NULL;
}

/* A worker process: count threads for ranks first.., all waiting at the gate; tells the parent through
   ready_fd when they all exist, then reports through W.report_fd (phase1, then when they are done). */
static int worker(int ready_fd) {
    pthread_t *t = (pthread_t *)calloc((size_t)W.count, sizeof *t);
    pthread_attr_t attr;
    int i, started = 0;
    char b = 1;
    pthread_mutex_init(&W.mu, NULL);
    pthread_barrier_init(&W.arrived, NULL, (unsigned)W.count);
    pthread_barrier_init(&W.counted, NULL, (unsigned)W.count);
    W.rep.ranks = W.count;
    W.rep.error_rank = -1;
    W.rep.store_cpu = -1;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, (size_t)512 << 10);
    for (i = 0; t && i < W.count; i++) {
        if (pthread_create(&t[i], &attr, rank_main, (void *)(intptr_t)(W.first + i)) != 0) break;
        started++;
    }
    if (started < W.count) { /* cannot run: the parent sees a short read of "ready" */
        fprintf(stderr, "bench_scale: could only start %d of %d threads in pid %d\n", started, W.count, (int)getpid());
        _exit(3);
    }
    W.rep.rss_added_mib = rss_mib(); /* before init, the threads made: the serial thread subtracts it after */
    if (write(ready_fd, &b, 1) != 1) _exit(3);
    close(ready_fd);
    for (i = 0; i < W.count; i++) pthread_join(t[i], NULL);
    if (write(W.report_fd, &W.rep, sizeof W.rep) != (ssize_t)sizeof W.rep) return 1;
    return 0;
}

static rlim_t raise_nofile(void) {
    struct rlimit rl;
    FILE *f = fopen("/proc/sys/fs/nr_open", "r");
    unsigned long long nr_open = 0;
    if (f) {
        if (fscanf(f, "%llu", &nr_open) != 1) nr_open = 0;
        fclose(f);
    }
    getrlimit(RLIMIT_NOFILE, &rl);
    if (nr_open > rl.rlim_max) {
        struct rlimit up;
        up.rlim_cur = up.rlim_max = (rlim_t)nr_open;
        if (setrlimit(RLIMIT_NOFILE, &up) == 0) return up.rlim_cur;
    }
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
    return rl.rlim_cur;
}

/* Read one report from fd by the deadline: 1 read, 0 the process exited without it, -1 time is up. */
static int read_report(int fd, report *r, double deadline) {
    size_t got = 0;
    while (got < sizeof *r) {
        struct pollfd pf;
        ssize_t k;
        pf.fd = fd, pf.events = POLLIN, pf.revents = 0;
        if (poll(&pf, 1, (int)((deadline - bench_now()) * 1000) + 1) == 0) return -1;
        k = read(fd, (char *)r + got, sizeof *r - got);
        if (k <= 0) return 0;
        got += (size_t)k;
    }
    return 1;
}

/* The first error among the reports (lowest process first), or NULL. */
static const report *first_error(const report *rep, int nproc) {
    int p;
    for (p = 0; p < nproc; p++)
        if (rep[p].error[0]) return &rep[p];
    return NULL;
}

/* Start the processes for world size n (rank 0 alone, then blocks of threads), every thread waiting at
   the gate. Fills pid[], rep_fd[] and *go_fd (rank 0's process waits on it before phase 1). */
static int start_processes(int n, int procs, int *gate, pid_t *pid, int *rep_fd, int *go_fd, report *expect) {
    int ready[2], go[2], p, q, next = 1, per = (n - 1) / procs, extra = (n - 1) % procs;
    char b;
    if (pipe(gate) != 0 || pipe(ready) != 0 || pipe(go) != 0) return -1;
    for (p = 0; p <= procs; p++) {
        int fds[2];
        if (pipe(fds) != 0) return -1;
        W.first = p == 0 ? 0 : next;
        W.count = p == 0 ? 1 : per + (p - 1 < extra);
        if (p > 0) next += W.count;
        pid[p] = fork();
        if (pid[p] == 0) {
            close(gate[1]), close(ready[0]), close(fds[0]), close(go[1]);
            for (q = 0; q < p; q++) close(rep_fd[q]);
            W.gate_fd = gate[0];
            W.go_fd = go[0];
            W.report_fd = fds[1];
            _exit(worker(ready[1]));
        }
        close(fds[1]);
        rep_fd[p] = fds[0];
        expect[p].ranks = W.count;
    }
    close(gate[0]), close(ready[1]), close(go[0]);
    *go_fd = go[1];
    for (p = 0; p <= procs; p++) /* every thread of every process exists */
        if (read(ready[0], &b, 1) != 1) {
            close(ready[0]);
            return -1;
        }
    close(ready[0]);
    return 0;
}

/* One world size: start, open the gate, collect; prints its row. Returns 0 when every rank succeeded. */
static int run_size(int n, int procs, double timeout, double limit) {
    static pid_t pid[MAX_PROCS];
    static int rep_fd[MAX_PROCS];
    static report p1[MAX_PROCS], p2[MAX_PROCS];
    int gate[2], go_fd = -1, p, nproc, ok_init = 0, ok = 0, killed = 0, others = 0, biggest;
    double t0 = 0, deadline, last = 0, barrier = 0, destroy = 0, mean_init = 0, mean_barrier = 0;
    double max_init = 0, max_barrier = 0, rss = 0;
    const report *err;
    char b = 1;
    if (procs <= 0) procs = (n - 1 + 63) / 64 > 16 ? (n - 1 + 63) / 64 : 16; /* at most 64 ranks a process */
    if (procs > n - 1) procs = n - 1;
    if (procs < 1 || procs + 1 > MAX_PROCS) {
        fprintf(stderr, "bench_scale: %d worker processes for %d ranks: use 1..%d\n", procs, n, MAX_PROCS - 1);
        return 1;
    }
    nproc = procs + 1;
    biggest = (n - 1 + procs - 1) / procs;
    memset(p1, 0, sizeof p1);
    memset(p2, 0, sizeof p2);
    W.world = n;
    W.port = free_port();
    W.timeout = timeout;
    if (start_processes(n, procs, gate, pid, rep_fd, &go_fd, p1) != 0) {
        fprintf(stderr, "bench_scale: could not start %d processes of up to %d threads for N=%d\n", nproc, biggest, n);
        close(gate[1]);
        for (p = 0; p < nproc; p++)
            if (pid[p] > 0) kill(pid[p], SIGKILL), waitpid(pid[p], NULL, 0);
        return 1;
    }
    t0 = bench_now();
    deadline = t0 + limit;
    close(gate[1]); /* open the gate */
    /* phase 1: every other process, then rank 0's (after the go) */
    for (p = 1; p < nproc && !killed; p++) killed = read_report(rep_fd[p], &p1[p], deadline) < 0;
    if (!killed && write(go_fd, &b, 1) == 1) killed = read_report(rep_fd[0], &p1[0], deadline) < 0;
    close(go_fd);
    for (p = 0; p < nproc && !killed; p++) killed = read_report(rep_fd[p], &p2[p], deadline) < 0;
    for (p = 0; p < nproc; p++) {
        if (killed) kill(pid[p], SIGKILL);
        waitpid(pid[p], NULL, 0);
        close(rep_fd[p]);
    }
    for (p = 0; p < nproc; p++) {
        ok_init += p1[p].ok_init;
        ok += p2[p].ok;
        if (p1[p].init_done > last) last = p1[p].init_done;
        if (p2[p].barrier_done > barrier) barrier = p2[p].barrier_done;
        if (p2[p].destroy_done > destroy) destroy = p2[p].destroy_done;
        if (p == 0 || p1[p].ok_init != p1[p].ranks || !p1[p].ranks) continue;
        mean_init += p1[p].sockets_init;
        mean_barrier += p2[p].sockets_barrier;
        rss += p1[p].rss_added_mib;
        others += p1[p].ranks;
        max_init = DDP__MAX(max_init, (double)p1[p].sockets_init / p1[p].ranks);
        max_barrier = DDP__MAX(max_barrier, (double)p2[p].sockets_barrier / p2[p].ranks);
    }
    printf("| %d | %d x %d | ", n, procs, biggest);
    if (ok_init < n) {
        printf("%s: %d of %d ranks through ddp_init | | | | | | | |\n", killed ? "killed at --limit" : "failed", ok_init, n);
    } else {
        printf("%.2f | ", last - t0);
        if (ok == n) printf("%.2f, %.2f | ", barrier - last, destroy - barrier);
        else printf("%s: %d of %d ranks through | ", killed ? "killed at --limit" : "failed", ok, n);
        printf("%llu (%.1f) | %.3f (%.1f us) | %.1f, %.1f | ", (unsigned long long)p1[0].requests,
               (double)p1[0].requests / n, p1[0].store_cpu,
               p1[0].requests ? p1[0].store_cpu / (double)p1[0].requests * 1e6 : 0.0, others ? mean_init / others : 0.0,
               max_init);
        if (ok == n) printf("%.1f, %.1f | ", others ? mean_barrier / others : 0.0, max_barrier);
        else printf("- | ");
        printf("%d | %.2f |\n", p1[0].fds_init, others ? rss / others : 0.0);
    }
    if ((err = first_error(p2, nproc)) != NULL || (err = first_error(p1, nproc)) != NULL)
        printf("    first error (rank %d): %s\n", err->error_rank, err->error);
    fflush(stdout);
    return !(ok == n && !killed);
}

static void usage(void) {
    fprintf(stderr, "usage: bench_scale [--procs P] [--timeout S] [--limit S] [--transport tcp|auto] N [N ...]\n"
                    "  N: world sizes (>= 2); rank 0 alone in one process, ranks 1..N-1 as threads over P processes\n"
                    "  (default: 16, or one per 64 ranks above 1024); see the comment at the top of bench/bench_scale.c\n");
    exit(2);
}

int main(int argc, char **argv) {
    int i, procs = 0, failures = 0;
    double timeout = 300, limit = -1;
    const char *transport = "tcp";
    rlim_t nofile;
    signal(SIGPIPE, SIG_IGN);
    for (i = 1; i < argc && argv[i][0] == '-'; i++) {
        if (i + 1 >= argc) usage();
        if (strcmp(argv[i], "--procs") == 0) procs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--timeout") == 0) timeout = atof(argv[++i]);
        else if (strcmp(argv[i], "--limit") == 0) limit = atof(argv[++i]);
        else if (strcmp(argv[i], "--transport") == 0) transport = argv[++i];
        else usage();
    }
    if (i >= argc || timeout <= 0) usage();
    if (limit <= 0) limit = timeout + 60;
    if (strcmp(transport, "tcp") == 0) setenv("DDP_TRANSPORT", "tcp", 1);
    else if (strcmp(transport, "auto") == 0) unsetenv("DDP_TRANSPORT");
    else usage();
    nofile = raise_nofile();
    printf("bench_scale: open-file limit %llu per process, DDP_TRANSPORT=%s, group timeout %.0f s\n\n",
           (unsigned long long)nofile, transport, timeout);
    printf("| ranks | procs x threads | init s | barrier, destroy s | rank-0 store requests (per rank) | store CPU s (per request) | "
           "sockets/rank after init (mean, max) | after a barrier | rank-0 fds | MiB/rank |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    fflush(stdout);
    for (; i < argc; i++) {
        int n = atoi(argv[i]);
        if (n < 2) usage();
        failures += run_size(n, procs, timeout, limit) != 0;
    }
    return failures ? 1 : 0;
}
