/* [SECTION] net: TCP sockets with deadlines
   Every socket is non-blocking and every wait is a poll() bounded by an absolute deadline
   (ddp__now() seconds), so no call can block forever. send() uses MSG_NOSIGNAL: a peer that died
   gives an error code, not SIGPIPE. Errors return a ddp_result and a short message in err
   (DDP__ERR_MAX bytes); callers add who the peer was. */
#include "internal.h"

static void ddp__net_configure(int fd) {
    int one = 1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Resolve host:port; host NULL means "any address" (for listening). */
static ddp_result ddp__net_resolve(const char *host, int port, int passive, struct addrinfo **res, char *err) {
    struct addrinfo hints;
    char service[16];
    int rc;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    snprintf(service, sizeof service, "%d", port);
    rc = getaddrinfo(host, service, &hints, res);
    if (rc != 0)
        return ddp__fail_to(err, DDP_ERR_INIT, "cannot resolve host \"%s\": %s", host ? host : "*", gai_strerror(rc));
    return DDP_SUCCESS;
}

/* Listen on host:port (host NULL: every interface; port 0: any free port). *bound_port gets the port. */
/* The kernel caps a listen backlog at net.core.somaxconn (4096 since Linux 5.4); SOMAXCONN is that default
   in current headers, but 128 in older ones, below what a rendezvous of thousands of ranks needs. */
#define DDP__LISTEN_BACKLOG (SOMAXCONN > 4096 ? SOMAXCONN : 4096)
static ddp_result ddp__net_listen(const char *host, int port, int *fd_out, int *bound_port, char *err) {
    struct addrinfo *res = NULL, *ai;
    int fd = -1, saved = 0, one = 1;
    ddp_result r = ddp__net_resolve(host, port, 1, &res, err);
    if (r) return r;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) { saved = errno; continue; }
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, DDP__LISTEN_BACKLOG) == 0) break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (ddp__out_of_descriptors(saved)) return ddp__fail_descriptors(err, saved, "cannot open a listening socket");
        if (saved == EADDRINUSE)
            return ddp__fail_to(err, DDP_ERR_INIT, "port %d on %s is already in use (another job, or a previous run still "
                                "exiting); choose another MASTER_PORT or use ddprun --standalone", port, host ? host : "*");
        if (saved == EADDRNOTAVAIL)
            return ddp__fail_to(err, DDP_ERR_INIT, "cannot listen on %s:%d: that address is not on this host "
                                "(MASTER_ADDR must name the host of rank 0)", host ? host : "*", port);
        return ddp__fail_to(err, DDP_ERR_INIT, "cannot listen on %s:%d: %s", host ? host : "*", port, strerror(saved));
    }
    ddp__net_configure(fd);
    if (bound_port) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        getsockname(fd, (struct sockaddr *)&ss, &len);
        *bound_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                     : ((struct sockaddr_in *)&ss)->sin_port);
    }
    *fd_out = fd;
    return DDP_SUCCESS;
}

/* Wait for fd to be ready for `events`, until deadline. */
static ddp_result ddp__net_poll(int fd, short events, double deadline, char *err) {
    for (;;) {
        struct pollfd p;
        double left = deadline - ddp__now();
        int rc;
        if (left <= 0) return ddp__fail_to(err, DDP_ERR_TIMEOUT, "timed out");
        p.fd = fd;
        p.events = events;
        p.revents = 0;
        rc = poll(&p, 1, (int)DDP__MIN(left * 1000.0 + 1.0, 1000.0));
        if (rc > 0) return DDP_SUCCESS;
        if (rc < 0 && errno != EINTR) return ddp__fail_to(err, DDP_ERR_SYSTEM, "poll: %s", strerror(errno));
    }
}

/* One attempt to connect to host:port (each of its addresses in turn), each waiting at most 5 s and
   never past the deadline. *refused = 1 when every address answered "connection refused": nothing
   listens there now. On failure err says why (the last address's error). */
static ddp_result ddp__net_connect_once(const char *host, int port, double deadline, int *fd_out, int *refused, char *err) {
    struct addrinfo *res = NULL, *ai;
    int tried = 0, all_refused = 1;
    ddp_result r = ddp__net_resolve(host, port, 0, &res, err);
    *refused = 0;
    if (r) return r;
    snprintf(err, DDP__ERR_MAX, "no address");
    for (ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), soerr = 0;
        socklen_t len = sizeof soerr;
        char why[DDP__ERR_MAX];
        if (fd < 0 && ddp__out_of_descriptors(errno)) { /* waiting would not help: say so now */
            int e = errno;
            freeaddrinfo(res);
            return ddp__fail_descriptors(err, e, "cannot open a socket");
        }
        if (fd < 0) continue;
        tried++;
        ddp__net_configure(fd);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) soerr = errno;
        else if (ddp__net_poll(fd, POLLOUT, DDP__MIN(deadline, ddp__now() + 5.0), why) != DDP_SUCCESS) soerr = ETIMEDOUT;
        else getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        if (soerr == 0) {
            freeaddrinfo(res);
            *fd_out = fd;
            return DDP_SUCCESS;
        }
        all_refused &= soerr == ECONNREFUSED;
        snprintf(err, DDP__ERR_MAX, "%s", soerr == ETIMEDOUT ? "connection attempt timed out" : strerror(soerr));
        close(fd);
    }
    freeaddrinfo(res);
    *refused = tried > 0 && all_refused;
    return DDP_ERR_TIMEOUT;
}

/* Start connecting to host:port without waiting (its first address): the caller polls *fd_out for
   POLLOUT and reads SO_ERROR (link.c dials this way inside a step's poll). *refused = 1 when the
   refusal (or a reset) came at once (nothing listens there, or the listener closed). */
static ddp_result ddp__net_connect_start(const char *host, int port, int *fd_out, int *refused, char *err) {
    struct addrinfo *res = NULL;
    int fd, e;
    ddp_result r = ddp__net_resolve(host, port, 0, &res, err);
    *refused = 0;
    if (r) return r;
    fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (fd < 0) {
        e = errno;
        freeaddrinfo(res);
        if (ddp__out_of_descriptors(e)) return ddp__fail_descriptors(err, e, "cannot open a socket");
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "socket: %s", strerror(e));
    }
    ddp__net_configure(fd);
    e = connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS ? errno : 0;
    freeaddrinfo(res);
    if (e) {
        close(fd);
        *refused = e == ECONNREFUSED || e == ECONNRESET;
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "connect: %s", strerror(e));
    }
    *fd_out = fd;
    return DDP_SUCCESS;
}

/* Bytes this side sent on fd that the peer's kernel has not acknowledged yet (0 when unknown): Linux's
   TIOCOUTQ (SIOCOUTQ) on a TCP socket counts the send queue not yet acknowledged. A connection still in
   the peer's full listen queue, or a peer that is unreachable, has them; a peer program that merely
   does not answer has none. */
static int ddp__net_unacked(int fd) {
    int queued = 0;
    if (ioctl(fd, TIOCOUTQ, &queued) != 0) return 0;
    return queued > 0;
}

/* Connect to host:port, retrying with exponential backoff (10 ms .. 1 s) until the deadline while
   the other side is not listening yet: ranks start in any order. */
static ddp_result ddp__net_connect(const char *host, int port, double deadline, int *fd_out, char *err) {
    double backoff = 0.01;
    char last[DDP__ERR_MAX] = "no attempt";
    int refused;
    for (;;) {
        ddp_result r = ddp__net_connect_once(host, port, deadline, fd_out, &refused, last);
        if (r == DDP_SUCCESS) return r;
        if (r != DDP_ERR_TIMEOUT) return ddp__fail_to(err, r, "%s", last); /* cannot resolve */
        if (ddp__now() + backoff > deadline)
            return ddp__fail_to(err, DDP_ERR_TIMEOUT, "could not connect to %s:%d before the timeout (last error: %.200s)", host,
                                port, last);
        ddp__sleep(backoff);
        backoff = DDP__MIN(backoff * 2, 1.0);
    }
}

static ddp_result ddp__net_accept(int listen_fd, double deadline, int *fd_out, char *err) {
    for (;;) {
        int fd;
        ddp_result r = ddp__net_poll(listen_fd, POLLIN, deadline, err);
        if (r) return r;
        fd = accept(listen_fd, NULL, NULL);
        if (fd >= 0) {
            ddp__net_configure(fd);
            *fd_out = fd;
            return DDP_SUCCESS;
        }
        if (ddp__out_of_descriptors(errno)) return ddp__fail_descriptors(err, errno, "cannot accept a connection");
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            return ddp__fail_to(err, DDP_ERR_SYSTEM, "accept: %s", strerror(errno));
    }
}

/* Send all n bytes before the deadline. */
static ddp_result ddp__net_send(int fd, const void *buf, size_t n, double deadline, char *err) {
    const char *p = (const char *)buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            ddp_result r = ddp__net_poll(fd, POLLOUT, deadline, err);
            if (r) return r;
            continue;
        }
        return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection lost while sending (%s)", strerror(errno));
    }
    return DDP_SUCCESS;
}

/* Receive exactly n bytes before the deadline. The peer closing is DDP_ERR_PEER_LOST. */
static ddp_result ddp__net_recv(int fd, void *buf, size_t n, double deadline, char *err) {
    char *p = (char *)buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection closed by the other side");
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            ddp_result r = ddp__net_poll(fd, POLLIN, deadline, err);
            if (r) return r;
            continue;
        }
        return ddp__fail_to(err, DDP_ERR_PEER_LOST, "connection lost while receiving (%s)", strerror(errno));
    }
    return DDP_SUCCESS;
}

/* The numeric address of this end of a connected socket: the interface that reaches the peer. */
static void ddp__net_local_address(int fd, char *host, size_t cap) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
        getnameinfo((struct sockaddr *)&ss, len, host, (socklen_t)cap, NULL, 0, NI_NUMERICHOST) != 0)
        snprintf(host, cap, "127.0.0.1");
}
