/* Test helper for tests/test_ddprun.sh: what a worker is told by its launcher.
   usage: print_env DIR [--bind]
   Writes its whole environment, one KEY=VALUE a line, to DIR/env.<RANK>.<restart count> and prints
   "rank R of W" to stdout. With --bind, rank 0 also binds MASTER_PORT on all addresses (as the
   store it would serve) and writes DIR/bind.<RANK> with "ok" or the error. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

extern char **environ;

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v ? v : fallback;
}

static void try_bind(const char *dir, const char *rank) {
    char path[4096];
    struct sockaddr_in a;
    FILE *f;
    int fd = socket(AF_INET, SOCK_STREAM, 0), ok;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons((unsigned short)atoi(env_or("MASTER_PORT", "0")));
    ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 1) == 0;
    snprintf(path, sizeof path, "%s/bind.%s", dir, rank);
    f = fopen(path, "w");
    if (!f) exit(1);
    fprintf(f, "%s\n", ok ? "ok" : strerror(errno));
    fclose(f);
    if (fd >= 0) close(fd);
}

int main(int argc, char **argv) {
    char path[4096], tmp[4200];
    const char *rank = env_or("RANK", "none");
    const char *restart = env_or("DDP_RESTART_COUNT", env_or("TORCHELASTIC_RESTART_COUNT", "none"));
    FILE *f;
    char **e;
    if (argc < 2) {
        fprintf(stderr, "usage: print_env DIR [--bind]\n");
        return 2;
    }
    snprintf(path, sizeof path, "%s/env.%s.%s", argv[1], rank, restart);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    f = fopen(tmp, "w");
    if (!f) {
        perror(tmp);
        return 1;
    }
    for (e = environ; *e; e++) fprintf(f, "%s\n", *e);
    if (fclose(f) != 0 || rename(tmp, path) != 0) return 1;
    if (argc > 2 && !strcmp(argv[2], "--bind") && !strcmp(rank, "0")) try_bind(argv[1], rank);
    printf("rank %s of %s\n", rank, env_or("WORLD_SIZE", "?"));
    return 0;
}
