/* Test helper for tests/test_ddprun.sh: a program that fails until a given restart.
   usage: exit_with LOG FAIL_RANK CODE UNTIL
   Appends "rank=R restart=K torchelastic_restart=K2 max_restarts=M" to LOG. Then rank FAIL_RANK
   exits with CODE while DDP_RESTART_COUNT < UNTIL (as a program that crashes before its checkpoint
   lets it through), once every rank of its node has logged this attempt (so that no line is lost
   to the stop that follows); everything else exits 0 after 0.2 s. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v ? v : fallback;
}

/* Lines in the log for this attempt ("restart=K "). */
static int count_lines(const char *log, const char *tag) {
    char buf[256];
    int n = 0;
    FILE *f = fopen(log, "r");
    if (!f) return 0;
    while (fgets(buf, sizeof buf, f))
        if (strstr(buf, tag)) n++;
    fclose(f);
    return n;
}

int main(int argc, char **argv) {
    char line[256];
    int fd, n, restart;
    if (argc != 5) {
        fprintf(stderr, "usage: exit_with LOG FAIL_RANK CODE UNTIL\n");
        return 2;
    }
    n = snprintf(line, sizeof line, "rank=%s restart=%s torchelastic_restart=%s max_restarts=%s\n", env_or("RANK", "?"),
                 env_or("DDP_RESTART_COUNT", "?"), env_or("TORCHELASTIC_RESTART_COUNT", "?"),
                 env_or("TORCHELASTIC_MAX_RESTARTS", "?"));
    fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0 || write(fd, line, (size_t)n) != n) return 1; /* one write: lines from ranks never mix */
    close(fd);
    restart = atoi(env_or("DDP_RESTART_COUNT", "0"));
    if (atoi(env_or("RANK", "-1")) == atoi(argv[2]) && restart < atoi(argv[4])) {
        char tag[64];
        int t;
        snprintf(tag, sizeof tag, " restart=%d ", restart);
        for (t = 0; t < 1000 && count_lines(argv[1], tag) < atoi(env_or("LOCAL_WORLD_SIZE", "1")); t++) usleep(10000);
        return atoi(argv[3]);
    }
    usleep(200000);
    return 0;
}
