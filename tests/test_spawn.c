/* ddp_spawn: every worker runs once with torchrun's environment; a worker that fails (exit code or
   signal) makes ddp_spawn stop the others within the 5 s deadline and name that rank;
   workers' own children are stopped too; when the launcher is killed (SIGKILL), its workers and
   everything they started (children, daemons in a session of their own) die with it; what workers
   leave running when they end is stopped when ddp_spawn returns; stdio is flushed.
   The workers write what they saw into shared memory, which the parent checks. */
#include "testlib.h"

#include <sys/mman.h>
#include <sys/prctl.h>

#define MAXR 8
#define NVARS 17

static const char *vars[NVARS] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                                  "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "DDP_RESTART_COUNT"};

/* What each worker saw; lives in memory shared with the parent. */
typedef struct rank_rec {
    int ran, world, ready, got_term;
    pid_t pid, child, daemon; /* daemon: a grandchild in a session of its own (setsid), orphaned at once */
    char env[NVARS][80]; /* "" when unset */
} rank_rec;

typedef struct shared {
    rank_rec r[MAXR];
    int mode;        /* which scenario the workers play */
    int victim_gone; /* M_REACT: the victim is about to exit */
    int victim;      /* the rank that fails */
    char path[256];  /* scenario "flush": where each worker writes */
} shared;

enum { M_ENV, M_FAIL_CODE, M_SIGKILL, M_IGNORE_TERM, M_EXIT_256, M_GRANDCHILD, M_FLUSH, M_SLEEP, M_REACT, M_LEAVE };

static shared *S;
static int my_rank; /* in a worker: its rank, for the signal handler */

static void on_term(int sig) {
    (void)sig;
    S->r[my_rank].got_term = 1;
    _exit(143);
}

static void sleep_s(double s) { usleep((useconds_t)(s * 1e6)); }

/* In a worker: a child that runs until killed (in the worker's process group), and a daemon: a child
   that calls setsid() and forks the grandchild that stays, then exits, as daemons do. */
static void start_descendants(rank_rec *me) {
    pid_t c = fork(), mid;
    if (c == 0) {
        signal(SIGTERM, SIG_DFL);
        for (;;) pause();
    }
    me->child = c;
    mid = fork();
    if (mid == 0) {
        pid_t d;
        signal(SIGTERM, SIG_DFL);
        setsid();
        d = fork();
        if (d == 0)
            for (;;) pause();
        me->daemon = d;
        _exit(0);
    }
    waitpid(mid, NULL, 0);
}
/* Wait (at most 10 s) until every other rank has said it is ready, so that they are sure to be
   in their "stopped by the launcher" state when the victim fails. */
static void wait_others_ready(int rank, int n) {
    double end = tl_now() + 10;
    int i, all;
    do {
        all = 1;
        for (i = 0; i < n; i++)
            if (i != rank && !S->r[i].ready) all = 0;
        if (!all) sleep_s(0.005);
    } while (!all && tl_now() < end);
}

static int worker(int rank, int n, void *arg) {
    rank_rec *me = &S->r[rank];
    int i;
    CHECK(arg == (void *)S, "arg not passed through");
    my_rank = rank;
    me->ran++;
    me->world = n;
    me->pid = getpid();
    for (i = 0; i < NVARS; i++) {
        const char *v = getenv(vars[i]);
        snprintf(me->env[i], sizeof me->env[i], "%s", v ? v : "");
    }
    if (S->mode == M_ENV) return 0;
    if (S->mode == M_FLUSH) {
        char p[300];
        FILE *f;
        snprintf(p, sizeof p, "%s.%d", S->path, rank);
        f = fopen(p, "w");
        CHECK(f != NULL, "fopen %s", p);
        fprintf(f, "rank %d was here\n", rank); /* no fclose: ddp_spawn must flush before _exit */
        return 0;
    }
    if (S->mode == M_LEAVE) { /* succeed, leaving a child running */
        pid_t c = fork();
        if (c == 0)
            for (;;) pause();
        me->child = c;
        return 0;
    }
    if (rank == S->victim && S->mode != M_SLEEP && S->mode != M_GRANDCHILD) {
        wait_others_ready(rank, n);
        if (S->mode == M_FAIL_CODE) return 3;
        if (S->mode == M_EXIT_256) return 256;
        if (S->mode == M_SIGKILL) raise(SIGKILL);
        if (S->mode == M_REACT) {
            S->victim_gone = 1;
            return 3;
        }
        return 9;
    }
    if (S->mode == M_IGNORE_TERM) {
        signal(SIGTERM, SIG_IGN);
    } else {
        signal(SIGTERM, on_term);
    }
    if (S->mode == M_GRANDCHILD) {
        pid_t c = fork();
        if (c == 0) {
            signal(SIGTERM, SIG_DFL);
            for (;;) pause(); /* default SIGTERM action ends it */
        }
        me->child = c;
        if (rank == S->victim) {
            wait_others_ready(rank, n);
            return 5;
        }
    }
    if (S->mode == M_SLEEP) start_descendants(me);
    me->ready = 1;
    for (i = 0; i < 60000; i++) {
        /* M_REACT: like ranks that lose a peer in a collective, fail at once, all the same way */
        if (S->mode == M_REACT && S->victim_gone) return 1;
        sleep_s(0.001); /* 60 s in all: only the launcher ends this early */
    }
    return 0;
}

static void reset(int mode, int victim) {
    memset(S, 0, sizeof *S);
    S->mode = mode;
    S->victim = victim;
}

static void check_env(int n, const char *omp) {
    int r, i;
    for (r = 0; r < n; r++) {
        char want[NVARS][80];
        const rank_rec *x = &S->r[r];
        CHECK(x->ran == 1, "rank %d ran %d times", r, x->ran);
        CHECK(x->world == n, "rank %d got world_size %d, want %d", r, x->world, n);
        snprintf(want[0], 80, "%d", r);
        snprintf(want[1], 80, "%d", r);
        snprintf(want[2], 80, "%d", n);
        snprintf(want[3], 80, "%d", n);
        snprintf(want[4], 80, "0");
        snprintf(want[5], 80, "1");
        snprintf(want[6], 80, "%d", r);
        snprintf(want[7], 80, "%d", n);
        snprintf(want[8], 80, "default");
        snprintf(want[9], 80, "127.0.0.1");
        snprintf(want[10], 80, "%s", S->r[0].env[10]); /* MASTER_PORT: checked below */
        snprintf(want[11], 80, "0");
        snprintf(want[12], 80, "0");
        snprintf(want[13], 80, "none");
        snprintf(want[14], 80, "False");
        snprintf(want[15], 80, "%s", omp);
        snprintf(want[16], 80, "0");
        for (i = 0; i < NVARS; i++)
            CHECK(strcmp(x->env[i], want[i]) == 0, "rank %d saw %s=\"%s\", want \"%s\"", r, vars[i], x->env[i], want[i]);
    }
    r = atoi(S->r[0].env[10]);
    CHECK(r >= 1 && r <= 65535, "MASTER_PORT=\"%s\" is not a port", S->r[0].env[10]);
}

static void test_env(void) {
    ddp_result res;
    unsetenv("OMP_NUM_THREADS");
    reset(M_ENV, -1);
    CHECK_OK(ddp_spawn(4, worker, S), NULL);
    check_env(4, "1");
    CHECK(getenv("RANK") == NULL && getenv("MASTER_PORT") == NULL, "ddp_spawn changed the parent's environment");

    reset(M_ENV, -1);
    CHECK_OK(ddp_spawn(1, worker, S), NULL);
    check_env(1, ""); /* torchrun sets OMP_NUM_THREADS only for more than one worker */

    setenv("OMP_NUM_THREADS", "7", 1);
    reset(M_ENV, -1);
    CHECK_OK(ddp_spawn(3, worker, S), NULL);
    check_env(3, "7"); /* the user's setting wins */
    unsetenv("OMP_NUM_THREADS");

    res = ddp_spawn(0, worker, S);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(NULL), "nprocs=0"), "nprocs 0: %d %s", (int)res,
          ddp_last_error(NULL));
    res = ddp_spawn(2, NULL, S);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(NULL), "fn is NULL"), "fn NULL: %d %s", (int)res,
          ddp_last_error(NULL));
    printf("env: ok\n");
}

/* Run n workers in a failure scenario; the victim must be named with `how`, every other worker
   stopped by SIGTERM (when they_see_term), and ddp_spawn must return within the 5 s. */
static void expect_failure(int mode, int n, int victim, const char *how, int they_see_term) {
    char rank_str[32];
    double t0 = tl_now(), dt;
    ddp_result res;
    int r;
    reset(mode, victim);
    res = ddp_spawn(n, worker, S);
    dt = tl_now() - t0;
    CHECK(res == DDP_ERR_WORKER_FAILED, "mode %d: ddp_spawn returned %d (%s)", mode, (int)res, ddp_last_error(NULL));
    snprintf(rank_str, sizeof rank_str, "rank %d (pid %ld)", victim, (long)S->r[victim].pid);
    CHECK(strstr(ddp_last_error(NULL), rank_str) != NULL, "message does not name %s: %s", rank_str, ddp_last_error(NULL));
    CHECK(strstr(ddp_last_error(NULL), how) != NULL, "message does not say \"%s\": %s", how, ddp_last_error(NULL));
    CHECK(dt < 5.0, "mode %d: ddp_spawn took %.2f s to stop the workers (the issue's deadline is 5 s)", mode, dt);
    for (r = 0; r < n; r++) {
        if (r == victim) continue;
        CHECK(S->r[r].ready, "rank %d never got ready", r);
        if (they_see_term) CHECK(S->r[r].got_term, "rank %d was not sent SIGTERM", r);
        CHECK(kill(S->r[r].pid, 0) != 0 && errno == ESRCH, "rank %d (pid %ld) still exists", r, (long)S->r[r].pid);
    }
    printf("mode %d (%s): stopped in %.2f s: %s\n", mode, how, dt, ddp_last_error(NULL));
}


/* 1 when pid exists and is not a zombie. */
static int proc_alive(pid_t pid) {
    char path[64], buf[512], *paren;
    FILE *f;
    size_t len;
    snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
    f = fopen(path, "r");
    if (!f) return 0;
    len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    paren = strrchr(buf, ')');
    return !(paren && paren[1] == ' ' && paren[2] == 'Z');
}

/* Wait (5 s at most) until pid has ended, reaping whatever comes to this process (a subreaper).
   A process still running is killed, so that a failed test leaves nothing behind, and the test fails. */
static void expect_ended(pid_t pid, const char *what, int rank) {
    double end = tl_now() + 5;
    int r;
    CHECK(pid > 0, "rank %d's %s has no pid", rank, what);
    while (tl_now() < end) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        if (!proc_alive(pid)) return;
        sleep_s(0.01);
    }
    for (r = 0; r < MAXR; r++) { /* a failed test leaves nothing behind (not even holding its stdout) */
        if (S->r[r].child > 0) kill(S->r[r].child, SIGKILL);
        if (S->r[r].daemon > 0) kill(S->r[r].daemon, SIGKILL);
    }
    kill(pid, SIGKILL);
    CHECK(0, "rank %d's %s (pid %ld) still runs 5 s after the group ended", rank, what, (long)pid);
}

static void test_grandchildren(void) {
    int r, n = 3;
    expect_failure(M_GRANDCHILD, n, 1, "exited with code 5", 1);
    for (r = 0; r < n; r++) expect_ended(S->r[r].child, "child", r);
    printf("grandchildren: stopped\n");
}

/* Workers that succeed but leave a child running: the child is stopped when ddp_spawn returns. */
static void test_leftover(void) {
    int r, n = 2;
    reset(M_LEAVE, -1);
    CHECK_OK(ddp_spawn(n, worker, S), NULL);
    for (r = 0; r < n; r++) expect_ended(S->r[r].child, "leftover child", r);
    printf("children left by workers that succeeded: stopped\n");
}

/* The parent of ddp_spawn is killed with SIGKILL: its workers, their children and their daemons
   (setsid) must not live on. */
static void test_launcher_dies(void) {
    pid_t mid;
    int r, n = 2, st;
    double end, t0;
    reset(M_SLEEP, -1);
    fflush(NULL);
    mid = fork();
    if (mid == 0) _exit(ddp_spawn(n, worker, S) == DDP_SUCCESS ? 0 : 1);
    end = tl_now() + 10;
    while ((!S->r[0].ready || !S->r[1].ready) && tl_now() < end) sleep_s(0.005);
    CHECK(S->r[0].ready && S->r[1].ready, "workers did not start");
    CHECK(S->r[0].daemon > 0 && S->r[1].daemon > 0, "workers did not start their daemons");
    t0 = tl_now();
    kill(mid, SIGKILL);
    CHECK(waitpid(mid, &st, 0) == mid, "waitpid launcher");
    for (r = 0; r < n; r++) {
        expect_ended(S->r[r].pid, "worker", r);
        expect_ended(S->r[r].child, "child", r);
        expect_ended(S->r[r].daemon, "daemon (setsid)", r);
    }
    printf("launcher killed: workers, their children and daemons gone %.3f s later\n", tl_now() - t0);
}

/* What ddp_spawn is for: ddp_init(NULL) in fn joins the group; all_reduce checked exactly. */
static int collective_worker(int rank, int n, void *arg) {
    double x[64];
    ddp_group *g;
    int i;
    (void)arg;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: ddp_init: %s\n", rank, ddp_last_error(NULL));
        return 1;
    }
    if (ddp_rank(g) != rank || ddp_world_size(g) != n || ddp_local_rank(g) != rank) return 2;
    for (i = 0; i < 64; i++) x[i] = rank * 64 + i;
    if (ddp_all_reduce(g, x, 64, DDP_F64, DDP_SUM) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: all_reduce: %s\n", rank, ddp_last_error(g));
        return 3;
    }
    for (i = 0; i < 64; i++)
        if (x[i] != 64.0 * n * (n - 1) / 2 + (double)n * i) return 4;
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 5;
}

static void test_collectives(void) {
    CHECK_OK(ddp_spawn(4, collective_worker, NULL), NULL);
    CHECK_OK(ddp_spawn(3, collective_worker, NULL), NULL);
    printf("ddp_init + all_reduce inside ddp_spawn: ok\n");
}

/* A parent that ignores SIGCHLD (the kernel then reaps children itself) still gets exit statuses. */
static void test_sigchld_ignored(void) {
    struct sigaction now;
    signal(SIGCHLD, SIG_IGN);
    reset(M_ENV, -1);
    CHECK_OK(ddp_spawn(2, worker, S), NULL);
    expect_failure(M_FAIL_CODE, 3, 1, "exited with code 3", 1);
    sigaction(SIGCHLD, NULL, &now);
    CHECK(now.sa_handler == SIG_IGN, "ddp_spawn did not restore the caller's SIGCHLD action");
    signal(SIGCHLD, SIG_DFL);
    printf("SIGCHLD ignored: ok\n");
}

static void test_flush(void) {
    char p[300], line[128];
    FILE *pending, *f;
    int r, n = 3;
    snprintf(S->path, sizeof S->path, "/tmp/test_spawn.%ld", (long)getpid());
    snprintf(p, sizeof p, "%s.parent", S->path);
    pending = fopen(p, "w");
    CHECK(pending != NULL, "fopen %s", p);
    fprintf(pending, "parent\n"); /* still in the buffer: must not be written by the workers too */
    S->mode = M_FLUSH;
    CHECK_OK(ddp_spawn(n, worker, S), NULL);
    fclose(pending);
    f = fopen(p, "r");
    CHECK(f && fgets(line, sizeof line, f) && !strcmp(line, "parent\n") && !fgets(line, sizeof line, f),
          "the parent's buffered output was duplicated or lost");
    fclose(f);
    remove(p);
    for (r = 0; r < n; r++) {
        char want[64];
        snprintf(p, sizeof p, "%s.%d", S->path, r);
        snprintf(want, sizeof want, "rank %d was here\n", r);
        f = fopen(p, "r");
        CHECK(f && fgets(line, sizeof line, f) && !strcmp(line, want), "rank %d's buffered output was lost", r);
        fclose(f);
        remove(p);
    }
    printf("flush: ok\n");
}

int main(void) {
    S = (shared *)mmap(NULL, sizeof(shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(S != MAP_FAILED, "mmap");
    CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
    alarm(120); /* a launcher that never stops its workers fails the test instead of hanging it */
    unsetenv("RANK");
    unsetenv("MASTER_PORT");
    test_env();
    test_flush();
    test_collectives();
    expect_failure(M_FAIL_CODE, 4, 2, "exited with code 3", 1);
    expect_failure(M_SIGKILL, 3, 1, "was killed by signal 9 (SIGKILL)", 1);
    expect_failure(M_EXIT_256, 2, 0, "exited with code 1", 1);
    expect_failure(M_IGNORE_TERM, 3, 2, "exited with code 9", 0); /* the others need SIGKILL */
    /* the others fail (exit 1) as soon as rank 1 does, often before it can be reaped: rank 1, the
       one failure unlike the rest, must still be named as the cause */
    expect_failure(M_REACT, 4, 1, "of 4 exited with code 3", 0);
    test_sigchld_ignored();
    test_grandchildren();
    test_leftover();
    test_launcher_dies();
    printf("test_spawn: all passed\n");
    return 0;
}
