/* The flight recorder (issue #18 item 9): 3 ranks make five collectives (one of them async), then rank 2
   stops before the sixth while ranks 0 and 1 call it and time out (2 s). Checked, over TCP and over
   shared memory:
     - ranks 0 and 1 each write DDP_TRACE_DIR/ddp_trace_rank<R>_pid<P>.txt when the group breaks: the
       header names rank, pid, group and the error; the entries are the six calls as the test made them
       (#1 ... #6: collective, count, dtype, op, root), #1-#5 done and #6 failed;
     - SIGUSR1 makes rank 2, healthy but stuck outside the library, write its file: #1-#5 done, no #6,
       no error; so the files show rank 2 behind (newest #5 against #6);
     - DDP_TRACE_SIZE=3 keeps the last three; DDP_TRACE_SIZE=0 writes nothing;
     - without DDP_TRACE_DIR the dump goes into the error log (the group's log function).
   Rank 1 makes the sixth call async, so its group breaks (and its dump is written) on the progress
   thread. Before the recorder none of these files or log lines existed. Also run under ASan and TSan by
   the sanitizer tests. */
#include "testlib.h"
#include <dirent.h>

static char dir[256];
static int tcp_only;
static int log_lines, log_entries; /* the dump's lines seen in the log (the no-DDP_TRACE_DIR scenario) */

static void capture(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)rank, (void)user;
    if (level == DDP_LOG_ERROR && strncmp(msg, "ddp trace rank ", 15) == 0) log_lines++;
    if (level == DDP_LOG_ERROR && strstr(msg, "#6 all_reduce(count=7, f32, max) failed after")) log_entries++;
}

static ddp_group *join(void) { return tl_init(2, DDP_LOG_ERROR, capture); }

static char *slurp(const char *path) {
    static char buf[1 << 16];
    FILE *f = fopen(path, "r");
    size_t n;
    if (!f) return NULL;
    n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void trace_path(char *out, size_t cap, int rank, int pid) {
    snprintf(out, cap, "%s/ddp_trace_rank%d_pid%d.txt", dir, rank, pid);
}

static int read_pid(int rank) {
    char p[300];
    int pid = 0, i;
    for (i = 0; i < 1000 && !pid; i++) { /* 10 s at most */
        FILE *f;
        snprintf(p, sizeof p, "%s/pid.%d", dir, rank);
        if ((f = fopen(p, "r"))) {
            if (fscanf(f, "%d", &pid) != 1) pid = 0;
            fclose(f);
        }
        if (!pid) usleep(10000);
    }
    return pid;
}

/* Wait (10 s at most) for rank's trace file; its text. */
static const char *wait_trace(int rank) {
    char p[300];
    const char *text = NULL;
    int i, pid = read_pid(rank);
    CHECK(pid > 0, "rank %d never wrote its pid", rank);
    trace_path(p, sizeof p, rank, pid);
    for (i = 0; i < 1000 && !(text = slurp(p)); i++) usleep(10000);
    CHECK(text != NULL, "no trace file %s after 10 s", p);
    if (getenv("TEST_TRACE_SHOW")) printf("---- %s\n%s", p, text); /* to see what a dump looks like */
    return text;
}

/* The calls the test makes, as the dump must name them. */
static const char *calls[] = {
    "#1 all_reduce(count=4, f32, sum) ", "#2 broadcast(count=3, i32, root=1) ", "#3 all_gather(count=2, f64) ",
    "#4 all_reduce(count=5, f32, avg) ", "#5 barrier() ",                     "#6 all_reduce(count=7, f32, max) ",
};

static void expect_entry(const char *text, int rank, int i, const char *state) {
    char want[128];
    snprintf(want, sizeof want, "  %s%s", calls[i], state);
    CHECK(strstr(text, want) != NULL, "rank %d's trace lacks \"%s\":\n%s", rank, want, text);
}

/* The newest collective number in a dump (its last entry line's #N). */
static int newest(const char *text) {
    const char *p = text, *hit = NULL;
    int n = 0;
    while ((p = strstr(p, "\n  #"))) hit = p++;
    if (hit) sscanf(hit + 4, "%d", &n);
    return n;
}

static void check_broken(int rank, int size) {
    const char *text = wait_trace(rank);
    char head[96];
    int i;
    snprintf(head, sizeof head, "ddp trace rank %d (host ", rank);
    CHECK(strncmp(text, head, strlen(head)) == 0, "rank %d's trace starts wrong:\n%s", rank, text);
    CHECK(strstr(text, "group world, world 3, restart 0, broken (DDP_ERR_"), "rank %d's header lacks the error:\n%s", rank, text);
    for (i = size >= 6 ? 0 : 6 - size; i < 5; i++) expect_entry(text, rank, i, "done in ");
    expect_entry(text, rank, 5, "failed after ");
    if (size < 6) {
        CHECK(!strstr(text, calls[5 - size]), "rank %d's trace of size %d still holds %s:\n%s", rank, size, calls[5 - size], text);
        CHECK(strstr(text, ": last 3 of 3 collectives (DDP_TRACE_SIZE 3)"), "rank %d's header:\n%s", rank, text);
    }
    CHECK(newest(text) == 6, "rank %d's newest collective is #%d, not #6:\n%s", rank, newest(text), text);
}

static void check_signalled(int size) {
    const char *text = wait_trace(2);
    int i;
    CHECK(strncmp(text, "ddp trace rank 2 (host ", 23) == 0, "rank 2's trace starts wrong:\n%s", text);
    CHECK(!strstr(text, "broken"), "rank 2 is healthy, yet its trace says broken:\n%s", text);
    for (i = size >= 6 ? 0 : 5 - size; i < 5; i++) expect_entry(text, 2, i, "done in ");
    CHECK(!strstr(text, calls[5]), "rank 2 never called #6, yet its trace has it:\n%s", text);
    CHECK(newest(text) == 5, "rank 2's newest collective is #%d, not #5 (it is the rank behind)", newest(text));
}

static void release(void) {
    char p[300];
    FILE *f;
    snprintf(p, sizeof p, "%s/release", dir);
    if ((f = fopen(p, "w"))) fclose(f);
}

static int released(void) {
    char p[300];
    snprintf(p, sizeof p, "%s/release", dir);
    return access(p, F_OK) == 0;
}

/* The scenario on every rank; arg: the DDP_TRACE_SIZE in force (0: off; -1: no DDP_TRACE_DIR). */
static int stuck_rank(int rank, int n, void *arg) {
    int size = *(int *)arg, i;
    float a[7] = {1, 2, 3, 4, 5, 6, 7};
    int32_t b[3] = {rank, rank, rank};
    double send[2] = {0, 0}, recv[6];
    char p[300];
    FILE *f;
    ddp_work *w;
    ddp_group *g;
    ddp_result r;
    double t_sixth;
    (void)n;
    if (tcp_only) setenv("DDP_TRANSPORT", "tcp", 1);
    g = join();
    snprintf(p, sizeof p, "%s/pid.%d", dir, rank);
    if ((f = fopen(p, "w"))) fprintf(f, "%d\n", (int)getpid()), fclose(f);
    CHECK_OK(ddp_all_reduce(g, a, 4, DDP_F32, DDP_SUM), g);
    CHECK_OK(ddp_broadcast(g, b, 3, DDP_I32, 1), g);
    CHECK_OK(ddp_all_gather(g, send, recv, 2, DDP_F64), g);
    CHECK_OK(ddp_all_reduce_async(g, a, 5, DDP_F32, DDP_AVG, &w), g);
    CHECK_OK(ddp_wait(w), g);
    CHECK_OK(ddp_barrier(g), g);
    if (rank == 2) { /* stuck outside the library until rank 0 has checked every file */
        for (i = 0; i < 3000 && !released(); i++) usleep(10000);
    }
    t_sixth = tl_now();
    if (rank == 1) { /* on the progress thread: the break, and the dump, happen there */
        CHECK_OK(ddp_all_reduce_async(g, a, 7, DDP_F32, DDP_MAX, &w), g);
        r = ddp_wait(w);
    } else {
        r = ddp_all_reduce(g, a, 7, DDP_F32, DDP_MAX);
    }
    CHECK(r != DDP_SUCCESS, "rank %d: the sixth all_reduce succeeded though rank 2 stopped before it", rank);
    if (rank == 0) {
        if (size > 0) {
            check_broken(0, size);
            check_broken(1, size);
            double t0 = tl_now();
            CHECK(kill(read_pid(2), SIGUSR1) == 0, "kill(SIGUSR1): %s", strerror(errno));
            check_signalled(size);
            printf("  rank 0 failed %.2f s into the sixth call; rank 2's SIGUSR1 dump appeared %.0f ms after the signal\n",
                   t0 - t_sixth, (tl_now() - t0) * 1e3);
        } else if (size == 0) {
            DIR *d = opendir(dir);
            struct dirent *e;
            usleep(300000); /* rank 1 failed at the same time as rank 0: its file would be there by now */
            while (d && (e = readdir(d)))
                CHECK(strncmp(e->d_name, "ddp_trace", 9) != 0, "DDP_TRACE_SIZE=0, yet %s was written", e->d_name);
            if (d) closedir(d);
        }
        release();
    }
    if (size == -1) CHECK(log_lines == 1 && log_entries == 1, "rank %d: the log had %d trace headers and %d lines for #6, "
                          "expected 1 and 1", rank, log_lines, log_entries);
    if (size == 0) CHECK(log_lines == 0, "rank %d: DDP_TRACE_SIZE=0, yet the log had a trace", rank);
    ddp_destroy(g);
    return 0;
}

static int run(const char *name, int size, int tcp) {
    char v[16];
    double t0 = tl_now();
    int rc;
    snprintf(dir, sizeof dir, "/tmp/test_trace.XXXXXX");
    CHECK(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
    tcp_only = tcp;
    if (size >= 0) {
        setenv("DDP_TRACE_DIR", dir, 1);
        snprintf(v, sizeof v, "%d", size);
        setenv("DDP_TRACE_SIZE", v, 1);
    } else {
        unsetenv("DDP_TRACE_DIR");
        unsetenv("DDP_TRACE_SIZE");
    }
    rc = tl_run_ranks(3, stuck_rank, &size, 60);
    printf("%-58s %s (%.1f s)\n", name, rc == 0 ? "ok" : "FAILED", tl_now() - t0);
    fflush(stdout);
    {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    }
    return rc;
}

int main(void) {
    int failed = 0;
    failed |= run("tcp: every rank's trace; SIGUSR1 on the stuck rank", 64, 1);
    failed |= run("shared memory: every rank's trace; SIGUSR1 on the stuck rank", 64, 0);
    failed |= run("DDP_TRACE_SIZE=3 keeps the last 3", 3, 1);
    failed |= run("DDP_TRACE_SIZE=0 writes nothing", 0, 1);
    failed |= run("no DDP_TRACE_DIR: the dump goes into the error log", -1, 1);
    return failed;
}
