/* Test helper for tests/test_ddprun.sh: a worker that runs until its launcher stops it.
   usage: sleeper DIR [--ignore-term] [--fork-child] [--fail-rank R (--code C | --signal S)]
   Writes its pid to DIR/pid.<RANK> (and its child's to DIR/child.<RANK> with --fork-child), then
   sleeps 60 s. A signal that ends it is recorded in DIR/sig.<RANK> (the number) first; with
   --ignore-term it ignores SIGTERM, so only SIGKILL ends it. Rank R, once every rank of its node
   has written its pid file, exits with code C or raises signal S. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static char sig_path[4096];

static void on_signal(int sig) {
    char buf[16];
    int n = 0, fd, s = sig;
    char digits[16];
    do digits[n++] = (char)('0' + s % 10); while ((s /= 10) > 0);
    for (fd = 0; fd < n; fd++) buf[fd] = digits[n - 1 - fd];
    buf[n] = '\n';
    fd = open(sig_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        if (write(fd, buf, (size_t)n + 1) < 0) _exit(1);
        close(fd);
    }
    _exit(128 + sig);
}

static void write_pid(const char *dir, const char *what, const char *rank, long pid) {
    char path[4096], tmp[4200];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s.%s", dir, what, rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    f = fopen(tmp, "w");
    if (!f) exit(1);
    fprintf(f, "%ld\n", pid);
    if (fclose(f) != 0 || rename(tmp, path) != 0) exit(1);
}

static void nap(double s) {
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}

/* Wait (at most 10 s) for the pid files of every rank on this node. */
static void wait_for_node(const char *dir) {
    int first = atoi(getenv("RANK")) - atoi(getenv("LOCAL_RANK")), n = atoi(getenv("LOCAL_WORLD_SIZE")), i, t;
    for (t = 0; t < 1000; t++) {
        for (i = 0; i < n; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/pid.%d", dir, first + i);
            if (access(path, F_OK) != 0) break;
        }
        if (i == n) return;
        nap(0.01);
    }
}

int main(int argc, char **argv) {
    const char *dir, *rank = getenv("RANK");
    int ignore_term = 0, fork_child = 0, fail_rank = -1, code = 0, sig = 0, i;
    struct sigaction sa;
    if (argc < 2 || !rank) {
        fprintf(stderr, "usage (under a launcher): sleeper DIR [--ignore-term] [--fork-child] [--fail-rank R --code C|--signal S]\n");
        return 2;
    }
    dir = argv[1];
    for (i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--ignore-term")) ignore_term = 1;
        else if (!strcmp(argv[i], "--fork-child")) fork_child = 1;
        else if (!strcmp(argv[i], "--fail-rank") && i + 1 < argc) fail_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--code") && i + 1 < argc) code = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--signal") && i + 1 < argc) sig = atoi(argv[++i]);
        else {
            fprintf(stderr, "sleeper: bad argument %s\n", argv[i]);
            return 2;
        }
    }
    snprintf(sig_path, sizeof sig_path, "%s/sig.%s", dir, rank);
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    if (ignore_term) signal(SIGTERM, SIG_IGN);
    else sigaction(SIGTERM, &sa, NULL);
    if (fork_child) {
        pid_t c = fork();
        if (c == 0) {
            signal(SIGTERM, SIG_DFL);
            signal(SIGINT, SIG_DFL);
            for (;;) pause();
        }
        write_pid(dir, "child", rank, (long)c);
    }
    write_pid(dir, "pid", rank, (long)getpid());
    if (atoi(rank) == fail_rank) {
        wait_for_node(dir);
        if (sig) raise(sig);
        return code;
    }
    for (i = 0; i < 6000; i++) nap(0.01);
    return 0;
}
