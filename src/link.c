/* [SECTION] link: connections between the ranks of a group, made on first use
   After the rendezvous every rank knows where every other rank listens (the table, g->mesh.dir) and keeps
   its own listening socket open for the group's life. No connection is made in advance: the first
   time an algorithm's step sends to a rank this one has no connection with, it dials that rank
   (ddp__link_want); a rank waiting in any step also accepts whatever connects to it. So a rank holds
   the connections its collectives use and no others: the dissemination barrier that ends ddp_init
   makes the ring neighbours and the ranks 2^k away (2 ceil(log2 N) connections), recursive doubling,
   the binomial tree and the ring add at most about as many again: O(log N) sockets a rank instead of
   the N - 1 of a full mesh.

   Who dials: the SENDER of a step, never the receiver, so that a frame a rank sends always reaches its
   receiver, whatever that rank is doing inside the same collective; tcp.c's argument that a mismatch is an
   error on every rank rests on this. Two ranks that send to each other at once both dial; each side
   decides alone, with the same answer: the connection dialed by the higher rank is kept.

   A handshake, dialing side (one ddp__shake, moved on as bytes arrive, inside the poll of the step):
       connect -> [DDP_AUTH_TOKEN: hello + nonce, answer, proof, verdict (auth.c)] -> group hello -> ack
   accepting side, the mirror: [auth] -> group hello -> ack 1 (kept: the connection is this peer's from
   now on) or ack 0 (a duplicate: a connection to that rank exists already, or this rank is the higher
   one and dials it too). The dialer sends nothing else before the ack, so a connection carries frames
   only once both sides have kept it. The group hello names the rank, the world size and a hash of the
   group's store prefix: a stray connection, another group's or another program's, is refused with a
   warning; at most DDP__PENDING_MAX unidentified connections wait at once, each for at most
   DDP__PENDING_SECONDS (the oldest goes first).

   A dial that is refused means nothing listens there any more: the rank exited or left the group. The
   dialer retries for DDP__REFUSED_GRACE s, watching its other connections meanwhile (the ABORT of a
   rank that failed with a reason arrives there, and is the better message), then fails the step naming
   the rank as lost. During ddp_init's own set-up the store is asked too (g->mesh.setup, the hooks that
   group.c lends the mesh meanwhile): a rank that failed there published why.

   A failure here returns its code with the message in g->error, and breaking the group is left to the
   caller (transport.c's steps), the layer above: link.c sends no ABORT and calls nothing above it. */
#include "internal.h"

#define DDP__HELLO_MAGIC 0x48444450u /* "PDDH": first words on a connection between ranks */
#define DDP__PENDING_SECONDS 10      /* an accepted connection has this long to say which rank it is */
#define DDP__REFUSED_GRACE 1.0       /* a port refusing this long: its rank is gone */

typedef struct ddp__hello {
    uint32_t magic;
    int32_t rank, world;
    uint32_t pad;
    uint64_t group; /* ddp__link_group_hash: a stray connection from another group is refused */
} ddp__hello;

/* Handshake steps. Accepting: the auth hello, its proof, the group hello. Dialing: the connect, the
   auth answer, the verdict, the ack. */
enum { DDP__SHAKE_AUTH_HELLO, DDP__SHAKE_AUTH_PROOF, DDP__SHAKE_HELLO, DDP__SHAKE_CONNECTING, DDP__SHAKE_ANSWER,
       DDP__SHAKE_VERDICT, DDP__SHAKE_ACK };

static uint64_t ddp__link_group_hash(const ddp_group *g) { return ddp__hash(g->member.prefix); }

static void ddp__link_hello(const ddp_group *g, ddp__hello *h) {
    memset(h, 0, sizeof *h);
    h->magic = DDP__HELLO_MAGIC;
    h->rank = g->rank;
    h->world = g->world_size;
    h->group = ddp__link_group_hash(g);
}

/* ---- the table ---- */

static const char *ddp__peer_name(const ddp_group *g, int i, char *buf, size_t cap) {
    if (g->mesh.dir && i >= 0 && i < g->world_size)
        snprintf(buf, cap, "host %.100s, pid %d", g->mesh.names + g->mesh.dir[i].host, g->mesh.dir[i].pid);
    else
        snprintf(buf, cap, "rank %d", i);
    return buf;
}

static void ddp__link_keep(ddp_group *g, int rank, int fd) {
    g->mesh.peers[rank].fd = fd;
    g->mesh.peers[rank].awaits_dial = 0;
    g->mesh.peers[rank].refused_since = 0;
    g->mesh.linked[g->mesh.nlinked++] = rank;
    ddp__log(g, DDP_LOG_DEBUG, "connected to rank %d (%d connections)", rank, g->mesh.nlinked);
}

static void ddp__shake_drop(ddp_group *g, int i) {
    if (g->mesh.shakes[i].fd >= 0) close(g->mesh.shakes[i].fd);
    memmove(g->mesh.shakes + i, g->mesh.shakes + i + 1, (size_t)(g->mesh.nshakes - i - 1) * sizeof *g->mesh.shakes);
    g->mesh.nshakes--;
}

static ddp__shake *ddp__shake_add(ddp_group *g, int fd, int rank, int dialing, int step, size_t need, double deadline) {
    ddp__shake *s = &g->mesh.shakes[g->mesh.nshakes++];
    memset(s, 0, sizeof *s);
    s->fd = fd, s->rank = rank, s->dialing = dialing, s->step = step, s->need = need, s->deadline = deadline;
    return s;
}

static int ddp__link_dialing(const ddp_group *g, int rank) {
    int i;
    for (i = 0; i < g->mesh.nshakes; i++)
        if (g->mesh.shakes[i].dialing && g->mesh.shakes[i].rank == rank) return 1;
    return 0;
}

/* ---- dialing ---- */

/* rank's port refused a dial (or closed it before the ack): dial again shortly; ddp__link_check_refused
   calls it gone once this has lasted DDP__REFUSED_GRACE s. */
static void ddp__link_refused(ddp_group *g, int rank) {
    ddp__peer *p = &g->mesh.peers[rank];
    if (!p->refused_since) p->refused_since = ddp__now();
    p->dial_after = ddp__now() + 0.02;
}

static ddp_result ddp__link_want(ddp_group *g, int peer) {
    ddp__peer *p = &g->mesh.peers[peer];
    const ddp__peer_info *d = &g->mesh.dir[peer];
    char err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX];
    int fd = -1, refused = 0;
    ddp_result r;
    if (p->fd >= 0 || p->awaits_dial || ddp__link_dialing(g, peer) || ddp__now() < p->dial_after) return DDP_SUCCESS;
    if (g->mesh.nshakes == DDP__SHAKES_MAX) ddp__shake_drop(g, 0); /* full of strays: the oldest goes */
    r = ddp__net_connect_start(g->mesh.names + d->addr, d->port, &fd, &refused, err);
    if (r == DDP_SUCCESS) {
        ddp__shake_add(g, fd, peer, 1, DDP__SHAKE_CONNECTING, 0, 0);
        return DDP_SUCCESS;
    }
    if (refused) {
        ddp__link_refused(g, peer);
        return DDP_SUCCESS;
    }
    return ddp__fail(g, r, "connecting to rank %d (%s) at %s:%d: %s", peer, ddp__peer_name(g, peer, name, sizeof name),
                     g->mesh.names + d->addr, d->port, err);
}

/* The dialer's next bytes after `s->step` completed: send what the protocol says and wait for the answer. */
static int ddp__shake_send_hello(ddp_group *g, ddp__shake *s) {
    ddp__hello h;
    char err[DDP__ERR_MAX];
    ddp__link_hello(g, &h);
    s->step = DDP__SHAKE_ACK, s->have = 0, s->need = 1;
    return ddp__net_send(s->fd, &h, sizeof h, ddp__now() + 1.0, err) == DDP_SUCCESS;
}

/* A dial's connect finished (POLLOUT): connected, or refused. 1: go on, 0: refused (dropped), -1: failed
   otherwise (err set). A reset counts as a refusal, and so does a connection that breaks under the first
   bytes: the rank's listener closed (it exited, or failed) with this dial still in its backlog. */
static int ddp__shake_connected(ddp_group *g, ddp__shake *s, char *err) {
    int e = 0;
    socklen_t len = sizeof e;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
    if (e == ECONNREFUSED || e == ECONNRESET) return 0;
    if (e != 0) {
        snprintf(err, DDP__ERR_MAX, "connect: %s", strerror(e));
        return -1;
    }
    if (ddp__auth_token()) {
        memcpy(s->buf, DDP__AUTH_MAGIC, 8);
        ddp__auth_nonce(s->cn);
        memcpy(s->buf + 8, s->cn, DDP__AUTH_NONCE);
        s->step = DDP__SHAKE_ANSWER, s->have = 0, s->need = DDP__AUTH_NONCE + DDP__AUTH_MAC;
        return ddp__net_send(s->fd, s->buf, 8 + DDP__AUTH_NONCE, ddp__now() + 1.0, err) == DDP_SUCCESS ? 1 : 0;
    }
    return ddp__shake_send_hello(g, s) ? 1 : 0;
}

/* Bytes arrived for a dial in s->step (all s->need of them). 1: go on (or kept/duplicate: s->fd is -1
   then), -1: failed (err). */
static int ddp__shake_dial_step(ddp_group *g, ddp__shake *s, char *err) {
    unsigned char want[DDP__AUTH_MAC];
    if (s->step == DDP__SHAKE_ANSWER) {
        ddp__auth_proof(ddp__auth_token(), "server", s->cn, s->buf, want);
        if (!ddp__auth_equal(want, s->buf + DDP__AUTH_NONCE, DDP__AUTH_MAC)) {
            snprintf(err, DDP__ERR_MAX, "it does not know this process's DDP_AUTH_TOKEN (its proof is wrong): every rank "
                     "needs the same token");
            return -1;
        }
        ddp__auth_proof(ddp__auth_token(), "client", s->cn, s->buf, want);
        s->step = DDP__SHAKE_VERDICT, s->have = 0, s->need = 1;
        if (ddp__net_send(s->fd, want, sizeof want, ddp__now() + 1.0, err) != DDP_SUCCESS) return -1;
        return 1;
    }
    if (s->step == DDP__SHAKE_VERDICT) {
        if (s->buf[0] != 1) {
            snprintf(err, DDP__ERR_MAX, "it refused this process's DDP_AUTH_TOKEN: every rank needs the same token");
            return -1;
        }
        if (!ddp__shake_send_hello(g, s)) {
            snprintf(err, DDP__ERR_MAX, "the connection closed during the hello");
            return -1;
        }
        return 1;
    }
    /* DDP__SHAKE_ACK */
    if (s->buf[0] == 1 && g->mesh.peers[s->rank].fd < 0) {
        ddp__link_keep(g, s->rank, s->fd);
    } else { /* a duplicate: the peer dials this rank as well, and its dial wins */
        close(s->fd);
        if (g->mesh.peers[s->rank].fd < 0) g->mesh.peers[s->rank].awaits_dial = 1;
    }
    s->fd = -1;
    return 1;
}

/* ---- accepting ---- */

/* The accepting side's next step after s->need bytes arrived. 1: go on (or kept: s->fd is -1 then),
   -1: refused (why in *refusal). */
static int ddp__shake_accept_step(ddp_group *g, ddp__shake *s, const char **refusal) {
    unsigned char reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], verdict, ack;
    char why[DDP__ERR_MAX];
    ddp__hello h;
    if (s->step == DDP__SHAKE_AUTH_HELLO) {
        if (ddp__auth_answer(ddp__auth_token(), s->buf, s->cn, s->sn, reply) != 0) {
            *refusal = "it did not authenticate (no DDP_AUTH_TOKEN on its side?)";
            return -1;
        }
        if (ddp__net_send(s->fd, reply, sizeof reply, ddp__now() + 1.0, why) != DDP_SUCCESS) {
            *refusal = "it broke off the authentication";
            return -1;
        }
        s->step = DDP__SHAKE_AUTH_PROOF, s->have = 0, s->need = DDP__AUTH_MAC;
        return 1;
    }
    if (s->step == DDP__SHAKE_AUTH_PROOF) {
        verdict = (unsigned char)ddp__auth_check(ddp__auth_token(), s->cn, s->sn, s->buf);
        ddp__net_send(s->fd, &verdict, 1, ddp__now() + 1.0, why);
        if (!verdict) {
            *refusal = "its DDP_AUTH_TOKEN is different";
            return -1;
        }
        s->step = DDP__SHAKE_HELLO, s->have = 0, s->need = sizeof(ddp__hello);
        return 1;
    }
    memcpy(&h, s->buf, sizeof h);
    if (h.magic != DDP__HELLO_MAGIC || h.world != g->world_size || h.group != ddp__link_group_hash(g) || h.rank < 0 ||
        h.rank >= g->world_size || h.rank == g->rank) {
        *refusal = "it is not a rank of this group";
        return -1;
    }
    /* Keep it unless this rank has a connection to h.rank already, or dials it too and is the higher rank. */
    ack = g->mesh.peers[h.rank].fd < 0 && !(g->rank > h.rank && ddp__link_dialing(g, h.rank));
    if (ddp__net_send(s->fd, &ack, 1, ddp__now() + 1.0, why) != DDP_SUCCESS) ack = 0;
    if (ack) ddp__link_keep(g, h.rank, s->fd);
    else close(s->fd);
    s->fd = -1;
    return 1;
}

/* Take what arrived on the listening socket: every connection waiting there, each as a handshake. */
static ddp_result ddp__link_accept(ddp_group *g) {
    for (;;) {
        int fd = accept(g->mesh.listen_fd, NULL, NULL);
        char err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX];
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return DDP_SUCCESS;
            if (ddp__out_of_descriptors(errno)) ddp__fail_descriptors(err, errno, "it cannot accept a connection from another rank");
            else snprintf(err, sizeof err, "accept: %s", strerror(errno));
            return ddp__fail(g, DDP_ERR_SYSTEM, "rank %d (%s): %s", g->rank, ddp__peer_name(g, g->rank, name, sizeof name), err);
        }
        ddp__net_configure(fd);
        if (g->mesh.nshakes == DDP__SHAKES_MAX) {
            ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: %d others were waiting to identify "
                     "themselves", DDP__PENDING_MAX);
            ddp__shake_drop(g, 0);
        }
        if (ddp__auth_token()) ddp__shake_add(g, fd, -1, 0, DDP__SHAKE_AUTH_HELLO, 8 + DDP__AUTH_NONCE, ddp__now() + DDP__PENDING_SECONDS);
        else ddp__shake_add(g, fd, -1, 0, DDP__SHAKE_HELLO, sizeof(ddp__hello), ddp__now() + DDP__PENDING_SECONDS);
    }
}

/* ---- inside a step's poll ---- */

static int ddp__link_poll_entries(ddp_group *g, struct pollfd *fds, int *owner, double *wake) {
    int i, n = 0;
    if (g->mesh.listen_fd >= 0) {
        fds[n].fd = g->mesh.listen_fd, fds[n].events = POLLIN, fds[n].revents = 0;
        owner[n++] = -2;
    }
    for (i = 0; i < g->mesh.nshakes; i++) {
        ddp__shake *s = &g->mesh.shakes[i];
        fds[n].fd = s->fd, fds[n].events = s->step == DDP__SHAKE_CONNECTING ? POLLOUT : POLLIN, fds[n].revents = 0;
        owner[n++] = -3 - i;
        if (!s->dialing && s->deadline < *wake) *wake = s->deadline;
    }
    return n;
}

/* Read what s waits for; 1 when all s->need bytes are there, 0 not yet, -1 closed or failed. */
static int ddp__shake_read(ddp__shake *s) {
    ssize_t k = recv(s->fd, s->buf + s->have, s->need - s->have, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (k <= 0) return -1;
    s->have += (size_t)k;
    return s->have == s->need;
}

/* One handshake had an event. Returns a failure of the step (a dial that cannot go on), else success. */
static ddp_result ddp__shake_event(ddp_group *g, int i, short re, int *progressed) {
    ddp__shake *s = &g->mesh.shakes[i];
    char err[DDP__ERR_MAX] = "", name[DDP__PEER_NAME_MAX];
    const char *refusal = NULL;
    int got = 0, rank = s->rank;
    if (s->step == DDP__SHAKE_CONNECTING) {
        if (!(re & (POLLOUT | POLLERR | POLLHUP))) return DDP_SUCCESS;
        got = ddp__shake_connected(g, s, err);
    } else {
        got = ddp__shake_read(s);
        if (got == 0) return DDP_SUCCESS;
        if (got < 0 && !s->dialing) {
            refusal = "it closed the connection before saying which rank it is";
        } else if (got > 0) {
            got = s->dialing ? ddp__shake_dial_step(g, s, err) : ddp__shake_accept_step(g, s, &refusal);
        }
    }
    if (got == 0 || (got < 0 && s->dialing && !err[0])) {
        /* refused, or closed before the ack (the rank went away, or its accept failed): try again shortly,
           watching the other connections for its ABORT, until DDP__REFUSED_GRACE says it is gone */
        ddp__link_refused(g, rank);
        ddp__shake_drop(g, i);
        return DDP_SUCCESS;
    }
    *progressed = 1;
    if (got > 0) {
        if (s->fd < 0) ddp__shake_drop(g, i); /* kept, or a duplicate closed */
        return DDP_SUCCESS;
    }
    if (!s->dialing) {
        ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: %s", refusal ? refusal : err);
        ddp__shake_drop(g, i);
        return DDP_SUCCESS;
    }
    ddp__shake_drop(g, i);
    return ddp__fail(g, DDP_ERR_INIT, "connecting to rank %d (%s): %s", rank, ddp__peer_name(g, rank, name, sizeof name),
                     err);
}

static ddp_result ddp__link_progress(ddp_group *g, const struct pollfd *fds, const int *owner, int n, int *progressed) {
    int i, done = 0;
    ddp_result r;
    double now = ddp__now();
    /* Handshakes first, from the last entry back, so that dropping one leaves the indices of the rest. */
    for (i = n - 1; i >= 0; i--) {
        int k = -3 - owner[i];
        if (owner[i] > -3 || !fds[i].revents) continue;
        if ((r = ddp__shake_event(g, k, fds[i].revents, progressed)) != DDP_SUCCESS) return r;
    }
    for (i = g->mesh.nshakes - 1; i >= 0; i--) /* accepted ones that never said who they are */
        if (!g->mesh.shakes[i].dialing && now >= g->mesh.shakes[i].deadline) {
            ddp__log(g, DDP_LOG_WARN, "refused a connection to this rank's port: it did not say which rank it is "
                     "within %d s", DDP__PENDING_SECONDS);
            ddp__shake_drop(g, i);
        }
    for (i = 0; i < n; i++)
        if (owner[i] == -2 && (fds[i].revents & POLLIN)) done = 1;
    if (done && (r = ddp__link_accept(g)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

/* Has the port of `peer`, needed by this step, refused connections for DDP__REFUSED_GRACE s? Then it is
   lost (during the set-up, the store is asked first: group.c). */
static ddp_result ddp__link_check_refused(ddp_group *g, const ddp__coll *c, int peer) {
    char desc[160], name[DDP__PEER_NAME_MAX], how[320];
    const ddp__peer_info *d = &g->mesh.dir[peer];
    if (peer < 0 || !g->mesh.peers[peer].refused_since || g->mesh.peers[peer].fd >= 0) return DDP_SUCCESS;
    if (ddp__now() - g->mesh.peers[peer].refused_since < DDP__REFUSED_GRACE) return DDP_SUCCESS;
    snprintf(how, sizeof how, "its port %.128s:%d refuses connections (nothing listens there any more)",
             g->mesh.names + d->addr, d->port);
    if (g->mesh.setup) return g->mesh.setup->lost(g, peer, how);
    ddp__coll_describe(g, c, desc, sizeof desc);
    return ddp__fail(g, DDP_ERR_PEER_LOST, "lost rank %d (%s): %s: its process exited or it left the group, while "
                     "this rank was in %s", peer, ddp__peer_name(g, peer, name, sizeof name), how, desc);
}

static void ddp__link_close_all(ddp_group *g) {
    int i;
    for (i = 0; g->mesh.peers && i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd >= 0) close(p->fd);
        p->fd = -1;
    }
    g->mesh.nlinked = 0;
    while (g->mesh.nshakes > 0) ddp__shake_drop(g, g->mesh.nshakes - 1);
    if (g->mesh.listen_fd >= 0) close(g->mesh.listen_fd);
    g->mesh.listen_fd = -1;
}
