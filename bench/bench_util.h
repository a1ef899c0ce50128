/* bench_util.h: small helpers shared by the bench programs (bench/NAME.c), header-only.

   Every function is `static inline`, so a program that includes this file and uses only some of them
   compiles warning-free under the Makefile's -Wall -Wextra -Werror -pedantic (C99).

     free_port()   a TCP port that is free on 127.0.0.1 now: binds port 0 on the loopback address, reads
                   the port the kernel chose, closes the socket. 0 when that fails. Another process may
                   take the port before the caller binds it (as with torch's and ddprun's own choice);
                   good enough for a benchmark's rendezvous on one machine.
     bench_now()   seconds on CLOCK_MONOTONIC (for intervals; not wall-clock time). */
#ifndef DDP_BENCH_UTIL_H
#define DDP_BENCH_UTIL_H

#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static inline int free_port(void) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int port = 0, fd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static inline double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* qsort's comparison for doubles, ascending (for medians). */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
