/* [SECTION] transport: framed messages between the ranks of a group, failure detection, abort
   Two ranks share one TCP connection once a step has sent from one to the other (link.c makes them on
   first use). Everything sent is a frame: a fixed header, then `bytes` of payload.

       magic | kind | collective fingerprint (seq, coll, dtype, op, root, count) | sender | bytes | code

   The fingerprint is what makes cross-rank mistakes errors instead of hangs (PyTorch offers this only
   with TORCH_DISTRIBUTED_DEBUG=DETAIL): the receiver compares it with its own, and any difference is
   DDP_ERR_MISMATCH with both sides named.

   Every frame that reaches a waiting rank is checked, not only the one it waits for. Ranks that
   disagree about a call may run different algorithms (all_reduce picks one by size), and then a
   mismatched frame can sit in a connection its receiver is not reading while every rank waits on
   another: 4 ranks, 0 and 1 in the ring, 2 and 3 in recursive doubling, 0 waits on 3, 3 on 1, 1 on 0.
   So a step also polls the other connections for input, and looks at a frame header that arrives
   there with MSG_PEEK, without taking it (connections are at a frame boundary between steps: frames
   are read whole within one). An ABORT fails the step; a frame of the same collective number with a
   different fingerprint is DDP_ERR_MISMATCH. A frame of this collective, of another number (a peer
   already past this one) or a BYE is early data: the peer is marked quiet until the next collective (by its number), so poll does not wake for
   it again.
   Nothing extra happens when nothing unexpected arrives: the same poll call watches one more event
   per connection. tcp.c says why this makes every mismatch an error on every rank.

   Failure handling. While a rank waits, it also watches every other connection it has for a hang-up
   (O(log N) of them: link.c). When a rank fails a collective (mismatch, timeout, lost peer) it "breaks"
   the group: it sends an ABORT frame carrying the error to every rank it is connected with and shuts
   those connections down. Each of them sees the hang-up within milliseconds, reads the ABORT frame,
   fails with the same code and message, and breaks in turn: the ABORT floods the graph of connections,
   which holds the ring from ddp_init's barrier on (connected, diameter O(log N) once the barrier's
   2^k links are there), so it reaches every rank that waits in a collective, and every other rank when
   it next calls one. A connection that closes without an ABORT frame means the process is gone:
   DDP_ERR_PEER_LOST, and that message is what floods.
   A graceful ddp_destroy sends BYE after a final barrier and waits for the peers' BYE before closing,
   so an orderly exit is never mistaken for a crash. */
#include "internal.h"

#define DDP__FRAME_MAGIC 0x44445031u /* "DDP1" */
#define DDP__MAX_FRAME_BYTES ((uint64_t)1 << 40)

/* P2P: a point-to-point message (ddp_send), its `root` field carrying the tag, `seq` 0 (no collective). */
enum { DDP__FRAME_DATA = 1, DDP__FRAME_ABORT = 2, DDP__FRAME_BYE = 3, DDP__FRAME_P2P = 4 };

typedef struct ddp__frame {
    uint32_t magic;
    uint8_t kind; /* DDP__FRAME_* */
    uint8_t coll, dtype, op;
    int32_t root;
    int32_t src; /* sender's rank in the group */
    uint64_t seq, count;
    uint64_t bytes; /* payload that follows */
    int32_t code;   /* ABORT: the ddp_result */
    uint32_t purpose; /* DATA: the call's ddp__coll.purpose */
} ddp__frame;

static int ddp__coll_equal(const ddp__coll *a, const ddp__frame *f) {
    return a->seq == f->seq && a->count == f->count && a->kind == f->coll && a->dtype == f->dtype && a->op == f->op &&
           a->root == f->root && a->purpose == f->purpose;
}

/* ---- breaking the group ---- */

/* Wake every rank waiting inside the group's backends (the backend's abort slot, and the host
   transport's under nccl). */
static void ddp__backends_abort(ddp_group *g) {
    if (g->backend->abort) g->backend->abort(g);
    if (g->host_backend != g->backend && g->host_backend->abort) g->host_backend->abort(g);
}

/* Record the first error that breaks g, tell every peer (ABORT frame with the message) and shut the
   connections down so that peers waiting on anything notice at once. */
static ddp_result ddp__group_break_relaying(ddp_group *g, ddp_result code, const char *msg, const char *wire);
static ddp_result ddp__group_break(ddp_group *g, ddp_result code, const char *msg) {
    return ddp__group_break_relaying(g, code, msg, msg);
}

/* ddp__group_break, with `wire` as the reason the ABORT frames carry: a rank that fails with another
   rank's reason says so in its own message ("reported by rank 3; this rank was in ...") but passes the
   reason on as it came, so that the message does not grow at each hop of the flood. */
static ddp_result ddp__group_break_relaying(ddp_group *g, ddp_result code, const char *msg, const char *wire) {
    int i, repaired;
    if (g->broken) return g->broken;
    g->broken = code;
    snprintf(g->broken_msg, sizeof g->broken_msg, "%s", msg);
    /* fault-tolerant mode repairs such a break (a view change): a warning, and no flight-recorder dump */
    repaired = g->ft_running && ddp__ft_code(g, code) == DDP_ERR_VIEW_CHANGED;
    ddp__log(g, repaired ? DDP_LOG_WARN : DDP_LOG_ERROR, "%s", msg);
    ddp__backends_abort(g);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        ddp__frame f;
        char err[DDP__ERR_MAX];
        size_t len = strlen(wire) + 1;
        if (p->fd < 0 || p->gone) continue;
        if (p->send_owed > 0 && p->send_owed <= ((uint64_t)256 << 20)) { /* finish the interrupted frame */
            static const char zeros[4096] = {0};
            while (p->send_owed > 0) {
                size_t k = (size_t)DDP__MIN(p->send_owed, (uint64_t)sizeof zeros);
                if (ddp__net_send(p->fd, zeros, k, ddp__now() + 0.5, err) != DDP_SUCCESS) break;
                p->send_owed -= k;
            }
        }
        if (p->send_owed > 0) { /* cannot resynchronise the stream: the peer will see a plain hang-up */
            shutdown(p->fd, SHUT_WR);
            continue;
        }
        memset(&f, 0, sizeof f);
        f.magic = DDP__FRAME_MAGIC;
        f.kind = DDP__FRAME_ABORT;
        f.src = g->rank;
        f.bytes = len;
        f.code = code;
        /* Best effort and brief: the peer may be the one that is stuck. */
        if (ddp__net_send(p->fd, &f, sizeof f, ddp__now() + 0.5, err) == DDP_SUCCESS)
            ddp__net_send(p->fd, wire, len, ddp__now() + 0.5, err);
        /* Half-close only: a full close with unread data would make the kernel send a reset, which
           throws away the ABORT frame queued at the peer before the peer reads it. */
        shutdown(p->fd, SHUT_WR);
    }
    if (!repaired) ddp__trace_break(g, code); /* after the ABORTs: peers learn first, then this rank writes its recorder */
    ddp__timeline_flush();  /* and its timeline: the events up to the break are on disk */
    return code;
}

/* Break the group with the message that a call below (link.c) or lent from above (the set-up's hooks)
   left in g->error with its code r. */
static ddp_result ddp__break_with_error(ddp_group *g, ddp_result r) {
    char msg[DDP__ERR_MAX];
    snprintf(msg, sizeof msg, "%s", g->error);
    return ddp__group_break(g, r, msg);
}

/* Fail the current operation: break the group with this message and copy it to the caller's buffer. */
static ddp_result ddp__coll_fail(ddp_group *g, ddp_result code, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ddp__group_break(g, code, msg);
}

/* A peer's connection closed or errored: read what it sent last. An ABORT frame carries the reason
   (another rank's error, re-raised here); otherwise the process is gone. `first` is a frame header
   already read from the peer (or NULL). */
static ddp_result ddp__peer_failed_after(ddp_group *g, int peer, const ddp__coll *c, const ddp__frame *first) {
    ddp__peer *p = &g->mesh.peers[peer];
    char desc[160], err[DDP__ERR_MAX], name[DDP__PEER_NAME_MAX], msg[DDP__ERR_MAX];
    double deadline = ddp__now() + 1.0;
    ddp__frame f;
    ddp__coll_describe(g, c, desc, sizeof desc);
    p->gone = 1;
    for (;;) {
        if (first) {
            f = *first;
            first = NULL;
        } else if (ddp__net_recv(p->fd, &f, sizeof f, deadline, err) != DDP_SUCCESS) {
            break;
        }
        if (f.magic != DDP__FRAME_MAGIC) break;
        if (f.kind == DDP__FRAME_ABORT && f.bytes > 0 && f.bytes <= DDP__ERR_MAX) {
            char reason[DDP__ERR_MAX];
            if (ddp__net_recv(p->fd, reason, (size_t)f.bytes, deadline, err) != DDP_SUCCESS) break;
            reason[f.bytes - 1] = '\0';
            if (g->mesh.waiting_for >= 0 && g->mesh.waiting_for != peer) /* the reporter may have waited for us: say whom we waited for */
                snprintf(msg, sizeof msg, "%.600s (reported by rank %d; this rank was in %.150s, waiting for rank %d (%.120s))", reason,
                         peer, desc, g->mesh.waiting_for, ddp__peer_name(g, g->mesh.waiting_for, name, sizeof name));
            else
                snprintf(msg, sizeof msg, "%.600s (reported by rank %d; this rank was in %.150s)", reason, peer, desc);
            return ddp__group_break_relaying(g, ddp__peer_code(f.code, DDP_ERR_FORMAT), msg, reason);
        }
        if (f.kind == DDP__FRAME_BYE)
            return ddp__coll_fail(g, DDP_ERR_PEER_LOST,
                                  "rank %d left the group (called ddp_destroy) while this rank was in %s; every rank "
                                  "must make the same collective calls", peer, desc);
        { /* skip a data frame's payload */
            char sink[4096];
            uint64_t left = f.bytes;
            while (left > 0) {
                size_t k = (size_t)DDP__MIN(left, (uint64_t)sizeof sink);
                if (ddp__net_recv(p->fd, sink, k, deadline, err) != DDP_SUCCESS) break;
                left -= k;
            }
            if (left > 0) break;
        }
    }
    return ddp__coll_fail(g, DDP_ERR_PEER_LOST, "lost rank %d (%s): its process exited or its connection dropped, while this rank was in %s",
                          peer, ddp__peer_name(g, peer, name, sizeof name), desc);
}

static ddp_result ddp__peer_failed(ddp_group *g, int peer, const ddp__coll *c) { return ddp__peer_failed_after(g, peer, c, NULL); }

/* A peer that is alive (its connection is open) made no progress for the group's timeout. Across hosts
   a cut link looks just like this: TCP sees no error until its own, much longer, retransmission limit. */
static ddp_result ddp__peer_timed_out(ddp_group *g, int peer, const ddp__coll *c) {
    char desc[160], name[DDP__PEER_NAME_MAX];
    ddp__coll_describe(g, c, desc, sizeof desc);
    if (g->mesh.peers[peer].fd < 0)
        return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %g s in %s waiting for rank %d (%s), which never "
                              "connected to this rank: is it stuck, stopped, in a different collective, or is the network "
                              "to it down? (%s)", ddp__quiet_limit(g), desc, peer,
                              ddp__peer_name(g, peer, name, sizeof name), ddp__quiet_limit_name(g));
    return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "timed out after %g s in %s waiting for rank %d (%s), which is alive but "
                          "not taking part: is it stuck, stopped, in a different collective, or is the network to it "
                          "down? (%s)", ddp__quiet_limit(g), desc, peer, ddp__peer_name(g, peer, name, sizeof name),
                          ddp__quiet_limit_name(g));
}

/* The first peer whose connection hung up (exited, or aborted the group), looking only at peer `only`
   (-1: at every peer), without waiting; -1 when none. Nothing else happens: the caller decides. */
static int ddp__hung_up_peer(ddp_group *g, int only) {
    int i, n = 0;
    for (i = 0; i < g->mesh.nlinked; i++) {
        int peer = g->mesh.linked[i];
        if (g->mesh.peers[peer].fd < 0 || (only >= 0 && peer != only)) continue;
        g->mesh.pollfds[n].fd = g->mesh.peers[peer].fd;
        g->mesh.pollfds[n].events = POLLRDHUP;
        g->mesh.pollfds[n].revents = 0;
        g->mesh.poll_owner[n++] = peer;
    }
    if (poll(g->mesh.pollfds, (nfds_t)n, 0) <= 0) return -1;
    for (i = 0; i < n; i++)
        if (g->mesh.pollfds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) return g->mesh.poll_owner[i];
    return -1;
}

/* A peer that hung up fails the current collective. For transports that wait elsewhere (shared memory). */
static ddp_result ddp__check_peers(ddp_group *g, const ddp__coll *c) {
    int peer = ddp__hung_up_peer(g, -1);
    return peer < 0 ? DDP_SUCCESS : ddp__peer_failed(g, peer, c);
}

/* ---- one step of an algorithm: send to one peer while receiving from another ---- */

static void ddp__frame_init(ddp__frame *f, const ddp_group *g, const ddp__coll *c, int kind, uint64_t bytes) {
    memset(f, 0, sizeof *f);
    f->magic = DDP__FRAME_MAGIC;
    f->kind = (uint8_t)kind;
    f->coll = c->kind;
    f->dtype = c->dtype;
    f->op = c->op;
    f->root = c->root;
    f->src = g->rank;
    f->seq = c->seq;
    f->count = c->count;
    f->purpose = c->purpose;
    f->bytes = bytes;
}

/* The call a collective's frame describes (for messages naming the sender's call). */
static ddp__coll ddp__frame_coll(const ddp__frame *f) {
    ddp__coll t;
    memset(&t, 0, sizeof t);
    t.seq = f->seq;
    t.count = f->count;
    t.kind = f->coll;
    t.dtype = f->dtype;
    t.op = f->op;
    t.root = f->root;
    t.tag = -1;
    t.purpose = f->purpose;
    return t;
}

/* all_to_all_v / all_gather_v: rank `sender` sends `sent` elements to rank `receiver`, whose sizes say
   `expected` (found by either of the two: TCP frames here, shared memory's first step in shm.c). */
static ddp_result ddp__sizes_differ(ddp_group *g, const ddp__coll *c, int sender, int receiver, uint64_t sent,
                                    uint64_t expected) {
    char ours[160];
    ddp__coll_describe(g, c, ours, sizeof ours);
    if (c->kind == DDP__ALL_TO_ALL_V)
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "split sizes differ in %s: rank %d sends %llu elements to rank %d "
                              "(its send_counts[%d]) while rank %d expects %llu from rank %d (its recv_counts[%d]); "
                              "rank i's send_counts[j] must equal rank j's recv_counts[i]", ours, sender,
                              (unsigned long long)sent, receiver, receiver, receiver, (unsigned long long)expected, sender,
                              sender);
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "counts differ in %s: rank %d sent a block of %llu elements where "
                          "rank %d's counts say %llu; every rank must pass the same counts", ours, sender,
                          (unsigned long long)sent, receiver, (unsigned long long)expected);
}

/* The header just received from `peer` is complete: is it the frame this step expects? */
static ddp_result ddp__check_frame(ddp_group *g, const ddp__coll *c, int peer, const ddp__frame *f, size_t expect) {
    char ours[160], theirs[160];
    if (f->magic != DDP__FRAME_MAGIC)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (bad magic 0x%08x): is something else "
                              "connected to this rank's port?", peer, (unsigned)f->magic);
    if (f->kind == DDP__FRAME_ABORT || f->kind == DDP__FRAME_BYE) return ddp__peer_failed_after(g, peer, c, f);
    if (f->kind != DDP__FRAME_DATA) return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (kind %d)", peer, f->kind);
    if (!ddp__coll_equal(c, f)) {
        ddp__coll t = ddp__frame_coll(f);
        ddp__coll_describe(g, c, ours, sizeof ours);
        ddp__coll_describe(g, &t, theirs, sizeof theirs);
        return ddp__coll_fail(g, DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s while rank %d called %s; every "
                              "rank must call the same collectives in the same order with the same count, dtype, op and root",
                              peer, theirs, g->rank, ours);
    }
    if (f->bytes != expect && (c->kind == DDP__ALL_TO_ALL_V || c->kind == DDP__ALL_GATHER_V)) { /* sizes per rank */
        size_t es = ddp_dtype_size((ddp_dtype)c->dtype);
        return ddp__sizes_differ(g, c, peer, g->rank, f->bytes / es, expect / es);
    }
    if (f->bytes != expect)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "rank %d sent %llu bytes where %llu were expected in %s",
                              peer, (unsigned long long)f->bytes, (unsigned long long)expect, ddp__coll_name(c->kind));
    return DDP_SUCCESS;
}

/* Is a frame from a peer that this step does not read fine in collective c? Only a frame with c's
   number and another fingerprint shows a mismatch: when ranks disagree about #X, no rank gets past
   #X, so every frame in flight has number X. A frame of c, of another number (a peer already past c:
   numbers never restart, ddp_init's own collectives included) or a BYE (the peer passed ddp_destroy's
   barrier, which is then ours too) is early data. */
static int ddp__frame_is_early(const ddp__coll *c, const ddp__frame *f) {
    if (f->magic != DDP__FRAME_MAGIC) return 0;
    if (f->kind == DDP__FRAME_BYE) return 1;
    if (f->kind != DDP__FRAME_DATA) return 0;
    return f->seq != c->seq || ddp__coll_equal(c, f);
}

/* ---- point-to-point matching: posted receives and the stash ----
   A rank reads whatever reaches it in order, connection by connection. A message (a P2P frame) goes to
   the first posted receive with its source and tag (ddp_irecv's, and ddp_recv's own while it waits),
   else it is read whole into the group's stash, in arrival order; a receive, when it is posted, first
   takes the oldest stashed message with its source and tag. That is MPI's matching (by source and tag,
   in order), and it is done wherever a frame is met: in a collective's step, a peek, a send or a recv.
   So a send never waits for its receive to be posted, except that its bytes must fit the kernel's
   buffers or be read by the receiver's next call into the library. Both lists are guarded by
   mesh.p2p_mu: ddp_irecv posts from the program's thread while the progress thread may read frames. */
typedef struct ddp__p2p_msg {
    struct ddp__p2p_msg *next;
    int src, tag;
    uint8_t dtype;
    uint64_t count;
    size_t bytes;
    unsigned char data[1]; /* bytes of payload (allocated with the message) */
} ddp__p2p_msg;

/* "recv(src=1, tag=3, count=4, f32)" for a posted receive. */
static const char *ddp__posted_describe(const ddp__posted *p, char *out, size_t cap) {
    snprintf(out, cap, "recv(src=%d, tag=%d, count=%llu, %s)", p->src, p->tag, (unsigned long long)p->count,
             ddp_dtype_name((ddp_dtype)p->dtype));
    return out;
}

/* Does message f fit posted receive p? If not: DDP_ERR_MISMATCH naming both (the group breaks). */
static ddp_result ddp__posted_fits(ddp_group *g, const ddp__posted *p, const ddp__frame *f) {
    char ours[160];
    if (f->bytes == p->bytes && f->dtype == p->dtype) return DDP_SUCCESS;
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "%s: rank %d sent %llu elements of %s with tag %d where this rank expects "
                          "%llu of %s; a send and its recv must agree on count and dtype",
                          ddp__posted_describe(p, ours, sizeof ours), p->src, (unsigned long long)f->count,
                          ddp_dtype_name((ddp_dtype)f->dtype), (int)f->root, (unsigned long long)p->count,
                          ddp_dtype_name((ddp_dtype)p->dtype));
}

/* Mark p finished with r (under p2p_mu by the caller). */
static void ddp__posted_finish(ddp__posted *p, ddp_result r) {
    p->result = r;
    p->done = 1;
}

/* The P2P frame f (header already taken) from `peer`: to the first posted receive that matches, else into
   the stash. The payload is read under p2p_mu, so a receive posted meanwhile cannot miss it. */
static ddp_result ddp__p2p_deliver(ddp_group *g, const ddp__coll *c, int peer, const ddp__frame *f) {
    char err[DDP__ERR_MAX];
    ddp__posted *p, *prev = NULL;
    ddp__p2p_msg *m;
    ddp_result r = DDP_SUCCESS;
    if (f->bytes > DDP__MAX_BUFFER_BYTES)
        return ddp__coll_fail(g, DDP_ERR_FORMAT, "corrupt message from rank %d (a point-to-point message of %llu bytes)", peer,
                              (unsigned long long)f->bytes);
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (p = g->mesh.posted; p && !(p->src == peer && p->tag == f->root); prev = p, p = p->next)
        ;
    if (p) { /* unlinked whatever happens next: it is this message's receive */
        if (prev) prev->next = p->next;
        else g->mesh.posted = p->next;
        if ((r = ddp__posted_fits(g, p, f)) == DDP_SUCCESS && p->bytes &&
            ddp__net_recv(g->mesh.peers[peer].fd, p->buf, p->bytes, ddp__now() + g->timeout, err) != DDP_SUCCESS)
            r = DDP_ERR_PEER_LOST;
        ddp__posted_finish(p, r);
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        return r == DDP_ERR_PEER_LOST ? ddp__peer_failed(g, peer, c) : r;
    }
    m = (ddp__p2p_msg *)ddp__malloc(offsetof(ddp__p2p_msg, data) + (size_t)f->bytes + 1);
    if (!m) {
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        return ddp__coll_fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping a message of %llu bytes that rank %d sent "
                              "(tag %d) before this rank's recv for it", (unsigned long long)f->bytes, peer, (int)f->root);
    }
    m->next = NULL;
    m->src = peer;
    m->tag = f->root;
    m->dtype = f->dtype;
    m->count = f->count;
    m->bytes = (size_t)f->bytes;
    if (m->bytes && ddp__net_recv(g->mesh.peers[peer].fd, m->data, m->bytes, ddp__now() + g->timeout, err) != DDP_SUCCESS) {
        pthread_mutex_unlock(&g->mesh.p2p_mu);
        ddp__free(m);
        return ddp__peer_failed(g, peer, c);
    }
    if (g->mesh.stash_tail) g->mesh.stash_tail->next = m;
    else g->mesh.stash = m;
    g->mesh.stash_tail = m;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return DDP_SUCCESS;
}

/* Post receive p: the oldest stashed message from its source with its tag finishes it at once; else it
   waits at the end of the posted list. Returns p's result when it finished here (DDP_SUCCESS when it was
   posted). */
static ddp_result ddp__p2p_post(ddp_group *g, ddp__posted *p) {
    ddp__p2p_msg *m, *prev = NULL;
    ddp__posted **at;
    ddp_result r = DDP_SUCCESS;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (m = g->mesh.stash; m && !(m->src == p->src && m->tag == p->tag); prev = m, m = m->next)
        ;
    if (m) {
        ddp__frame f;
        if (prev) prev->next = m->next;
        else g->mesh.stash = m->next;
        if (g->mesh.stash_tail == m) g->mesh.stash_tail = prev;
        memset(&f, 0, sizeof f);
        f.dtype = m->dtype;
        f.count = m->count;
        f.root = m->tag;
        f.bytes = m->bytes;
        if ((r = ddp__posted_fits(g, p, &f)) == DDP_SUCCESS && p->bytes) memcpy(p->buf, m->data, p->bytes);
        ddp__free(m);
        ddp__posted_finish(p, r);
    } else {
        for (at = &g->mesh.posted; *at; at = &(*at)->next)
            ;
        p->next = NULL;
        *at = p;
    }
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return r;
}

/* Take p off the posted list if it is still there (its wait failed). */
static void ddp__p2p_unpost(ddp_group *g, ddp__posted *p) {
    ddp__posted **at;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    for (at = &g->mesh.posted; *at && *at != p; at = &(*at)->next)
        ;
    if (*at) *at = p->next;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
}

static int ddp__posted_done(ddp_group *g, const ddp__posted *p) {
    int done;
    pthread_mutex_lock(&g->mesh.p2p_mu);
    done = p->done;
    pthread_mutex_unlock(&g->mesh.p2p_mu);
    return done;
}

/* The group ends: messages nobody received are named; posted receives are dropped (their handles go with
   the group). */
static void ddp__p2p_stash_free(ddp_group *g) {
    while (g->mesh.stash) {
        ddp__p2p_msg *m = g->mesh.stash;
        g->mesh.stash = m->next;
        ddp__log(g, DDP_LOG_WARN, "rank %d sent this rank a message (tag %d, %zu bytes) that no ddp_recv took before the "
                 "group ended", m->src, m->tag, m->bytes);
        ddp__free(m);
    }
    g->mesh.stash_tail = NULL;
    g->mesh.posted = NULL;
}

/* A peer this step does not read from has something for us: look at its frame header without taking
   it (the connection is at a frame boundary: frames are read whole within a step). Early data marks
   the peer quiet for the rest of c, so poll does not wake for it again; an ABORT, a corrupt frame or a
   different collective fails c as ddp__check_frame does. Only part of a header: look again shortly. */
static ddp_result ddp__peek_peer(ddp_group *g, const ddp__coll *c, int peer) {
    ddp__peer *p = &g->mesh.peers[peer];
    ddp__frame f;
    ssize_t k = recv(p->fd, &f, sizeof f, MSG_PEEK | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return DDP_SUCCESS;
    if (k <= 0) return ddp__peer_failed(g, peer, c);
    if ((size_t)k < sizeof f) {
        p->peek_later = 1;
        return DDP_SUCCESS;
    }
    if (f.magic == DDP__FRAME_MAGIC && f.kind == DDP__FRAME_P2P) { /* a message: to its receive or the stash */
        if (recv(p->fd, &f, sizeof f, MSG_DONTWAIT) != (ssize_t)sizeof f) return ddp__peer_failed(g, peer, c);
        return ddp__p2p_deliver(g, c, peer, &f);
    }
    if (ddp__frame_is_early(c, &f)) {
        p->quiet_seq = c->seq;
        return DDP_SUCCESS;
    }
    if (f.magic == DDP__FRAME_MAGIC && f.kind == DDP__FRAME_ABORT) { /* take the header: the reason follows it */
        if (recv(p->fd, &f, sizeof f, MSG_DONTWAIT) != (ssize_t)sizeof f) return ddp__peer_failed(g, peer, c);
        return ddp__peer_failed_after(g, peer, c, &f);
    }
    return ddp__check_frame(g, c, peer, &f, (size_t)f.bytes);
}

/* What to wait for on peer i in this step: hang-ups always; POLLOUT while sending to it; POLLIN while
   receiving from it, and also from any other peer not yet seen quiet in this collective (a frame there
   may show a mismatch: see the top of the file). *soon: look again within a millisecond. */
static short ddp__poll_events(ddp_group *g, const ddp__coll *c, const ddp__step *s, int i, int sending, int receiving, int *soon) {
    ddp__peer *p = &g->mesh.peers[i];
    short ev = POLLRDHUP;
    if (i == s->send_peer && sending) ev |= POLLOUT;
    if (i == s->recv_peer && receiving) return ev | POLLIN;
    if (p->peek_later) {
        p->peek_later = 0;
        *soon = 1;
    } else if (p->quiet_seq != c->seq) {
        ev |= POLLIN;
    }
    return ev;
}

/* Before a small step (at most DDP__TCP_SPIN_MAX_BYTES each way) blocks in poll(), it polls without
   blocking for DDP__TCP_SPIN_SECONDS after its last progress, yielding the core between looks: on
   loopback (and fast networks) the answer often comes within a few microseconds, and waking a rank
   blocked in poll() costs more than that (Open MPI's TCP transport spins the same way). Large steps
   block at once: there a wake-up is small beside the transfer, and spinning would only burn a core. When
   this host has more ranks than CPUs (ddp__oversubscribed, as shm.c decides) a small step looks once,
   yields once (the core goes to a rank that can run, often the one being waited for) and then blocks:
   no spin. Measured on 2 cores, 8 ranks, 4-64 B all_reduce: as fast as the 50 us
   spin, while blocking without the one yield was 25-30 % slower. */
#define DDP__TCP_SPIN_SECONDS 50e-6
#define DDP__TCP_SPIN_MAX_BYTES ((size_t)64 << 10)

static ddp_result ddp__exchange(ddp_group *g, const ddp__coll *c, const ddp__step *s) {
    ddp__frame out, in;
    size_t sent = 0, received = 0;          /* bytes of header + payload so far */
    size_t send_total = s->send_peer >= 0 ? sizeof out + s->send_bytes : 0;
    size_t recv_total = s->recv_peer >= 0 ? sizeof in + s->recv_bytes : 0;
    struct pollfd *fds = g->mesh.pollfds;
    int *owner = g->mesh.poll_owner;
    int spin = s->send_bytes <= DDP__TCP_SPIN_MAX_BYTES && s->recv_bytes <= DDP__TCP_SPIN_MAX_BYTES;
    double spin_for = ddp__oversubscribed(g->local_world_size) ? 0 : DDP__TCP_SPIN_SECONDS;
    double deadline = s->deadline > 0 ? s->deadline : ddp__now() + ddp__quiet_limit(g), spin_until = spin ? ddp__now() + spin_for : 0;
    double watch_every = DDP__WATCH_PERIOD, next_watch = ddp__now() + watch_every;
    if (g->broken) return g->broken;
    if (s->send_peer >= 0) ddp__frame_init(&out, g, c, s->p2p ? DDP__FRAME_P2P : DDP__FRAME_DATA, s->send_bytes);
    if (s->p2p) out.root = c->tag, out.seq = 0; /* the receiver matches by source and tag */
    while (sent < send_total || received < recv_total) {
        int n = 0, npeers, i, rc, progressed = 0, soon = 0;
        double wake = deadline;
        ddp_result r;
        g->mesh.waiting_for = received < recv_total ? s->recv_peer : s->send_peer;
        if (sent < send_total && g->mesh.peers[s->send_peer].fd < 0) { /* the sender dials (link.c) */
            if ((r = ddp__link_want(g, s->send_peer)) != DDP_SUCCESS ||
                (r = ddp__link_check_refused(g, c, s->send_peer)) != DDP_SUCCESS)
                return ddp__break_with_error(g, r);
            wake = DDP__MIN(wake, g->mesh.peers[s->send_peer].dial_after);
        }
        if (g->mesh.setup && g->mesh.peers[g->mesh.waiting_for].fd < 0) { /* a rank lost inside ddp_init */
            if (ddp__now() >= next_watch) {
                if ((r = g->mesh.setup->watch(g, g->mesh.waiting_for)) != DDP_SUCCESS) return ddp__break_with_error(g, r);
                next_watch = ddp__now() + watch_every;
                watch_every = DDP__MIN(watch_every * 2, 2.0);
            }
            wake = DDP__MIN(wake, next_watch);
        }
        for (i = 0; i < g->mesh.nlinked; i++) {
            int peer = g->mesh.linked[i];
            if (g->mesh.peers[peer].fd < 0) continue;
            fds[n].fd = g->mesh.peers[peer].fd;
            fds[n].events = ddp__poll_events(g, c, s, peer, sent < send_total, received < recv_total, &soon);
            fds[n].revents = 0;
            owner[n++] = peer;
        }
        npeers = n;
        n += ddp__link_poll_entries(g, fds + n, owner + n, &wake);
        rc = 0;
        if (spin) {
            int yielded = 0;
            while ((rc = poll(fds, (nfds_t)n, 0)) == 0 && (ddp__now() < spin_until || !yielded++)) sched_yield();
        }
        if (rc == 0)
            rc = poll(fds, (nfds_t)n, soon ? 1 : (int)DDP__MAX(1.0, DDP__MIN(1000.0, (wake - ddp__now()) * 1000.0)));
        if (rc < 0 && errno != EINTR) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "poll failed: %s", strerror(errno));
        if (rc > 0 && n > npeers && (r = ddp__link_progress(g, fds + npeers, owner + npeers, n - npeers, &progressed)))
            return ddp__break_with_error(g, r);
        /* Progress first: a peer that broke the group after sending what this step needs (it moved
           on to a later collective and failed there) must not fail this step; that error comes with
           the next collective. */
        for (i = 0; i < npeers && rc > 0; i++) {
            int peer = owner[i], fd = fds[i].fd;
            short re = fds[i].revents;
            if (!re) continue;
            if (peer == s->recv_peer && received < recv_total && (re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) {
                ssize_t k;
                if (received < sizeof in) {
                    k = recv(fd, (char *)&in + received, sizeof in - received, 0);
                } else {
                    k = recv(fd, (char *)s->recv_buf + (received - sizeof in), recv_total - received, 0);
                }
                if (k == 0) return ddp__peer_failed(g, peer, c);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ddp__peer_failed(g, peer, c);
                if (k > 0) {
                    received += (size_t)k;
                    progressed = 1;
                    if (received == sizeof in) {
                        ddp_result r;
                        if (in.magic == DDP__FRAME_MAGIC && in.kind == DDP__FRAME_P2P) {
                            if ((r = ddp__p2p_deliver(g, c, peer, &in)) != DDP_SUCCESS) return r;
                            received = 0; /* a message, matched or stashed; the frame we wait for follows */
                        } else if ((r = ddp__check_frame(g, c, peer, &in, s->recv_bytes)) != DDP_SUCCESS) {
                            return r;
                        }
                    }
                }
                fds[i].revents = 0;
                continue;
            }
            /* A send-only peer that hung up: read its ABORT before sending (data sent to a closed
               socket draws a reset that would destroy the frame). */
            if (peer == s->send_peer && sent < send_total && (re & POLLOUT) && !(re & (POLLHUP | POLLERR | POLLRDHUP))) {
                struct iovec iov[2];
                struct msghdr mh;
                ssize_t k;
                int nv = 0;
                memset(&mh, 0, sizeof mh);
                if (sent < sizeof out) {
                    iov[nv].iov_base = (char *)&out + sent;
                    iov[nv++].iov_len = sizeof out - sent;
                    if (s->send_bytes) {
                        iov[nv].iov_base = (void *)s->send_buf;
                        iov[nv++].iov_len = s->send_bytes;
                    }
                } else {
                    iov[nv].iov_base = (char *)s->send_buf + (sent - sizeof out);
                    iov[nv++].iov_len = send_total - sent;
                }
                mh.msg_iov = iov;
                mh.msg_iovlen = (size_t)nv;
                k = sendmsg(fd, &mh, MSG_NOSIGNAL);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ddp__peer_failed(g, peer, c);
                if (k > 0) {
                    sent += (size_t)k;
                    progressed = 1;
                    g->mesh.peers[peer].send_owed = send_total - sent; /* header and payload still owed */
                }
                fds[i].revents = 0;
            }
        }
        if (sent == send_total && received == recv_total) break;
        for (i = 0; i < npeers && rc > 0; i++) /* then failures */
            if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) return ddp__peer_failed(g, owner[i], c);
        for (i = 0; i < npeers && rc > 0; i++) { /* then frames from peers this step does not read */
            ddp_result r;
            if ((fds[i].revents & POLLIN) && (r = ddp__peek_peer(g, c, owner[i])) != DDP_SUCCESS) return r;
        }
        if (progressed && (s->deadline <= 0 || sent > 0 || received > 0)) { /* a handshake's progress does not
                                                                               move a step's own deadline */
            deadline = ddp__now() + ddp__quiet_limit(g);
            if (spin) spin_until = ddp__now() + spin_for;
        } else if (ddp__now() > deadline) {
            if (s->soft && sent == 0 && received == 0) return DDP_ERR_TIMEOUT;
            return ddp__peer_timed_out(g, g->mesh.waiting_for, c);
        }
    }
    return DDP_SUCCESS;
}

/* ---- point-to-point: ddp_send, ddp_recv and ddp_irecv's wait over the mesh, whatever the backend ----
   A send is one frame to the peer (the sender dials, as in a collective's step), written while this
   rank keeps reading what reaches it, so two ranks sending each other large messages at once both get
   through (each matches or stashes the other's). A receive is posted (the stash first) and then waits,
   reading whatever arrives, until a message finishes it. The source's stream showing a collective's
   frame where the message should be means the source went on without sending: DDP_ERR_MISMATCH (else
   both would wait for each other until the timeout). */
/* A recv over shared memory: has its source gone on to a collective without sending? Its collectives
   over the segment send this rank nothing, so the segment's fingerprints say it: the source entered a
   collective this rank has not, and no byte from it waits in the connection (it wrote any message
   before it entered; the sender dials, so no connection means no message). Seen twice 10 ms apart, to
   leave bytes in flight on the loopback time to land; *since holds the first sighting (0: none). */
static uint64_t ddp__host_peer_seq(const ddp_group *g, int peer) {
    return g->host_backend->peer_seq ? g->host_backend->peer_seq(g, peer) : 0;
}
static int ddp__p2p_peer_went_on(ddp_group *g, int src, double *since) {
    int fd = g->mesh.peers[src].fd, pending = 0;
    if (ddp__host_peer_seq(g, src) <= g->seq || (fd >= 0 && (ioctl(fd, FIONREAD, &pending) != 0 || pending > 0))) {
        *since = 0;
        return 0;
    }
    if (*since == 0) *since = ddp__now();
    return ddp__now() - *since >= 0.01;
}

/* "rank 1 called barrier() as collective #2 before sending what this rank's recv(...) waits for". */
static ddp_result ddp__p2p_went_on(ddp_group *g, const ddp__posted *p, const char *theirs) {
    char ours[160];
    return ddp__coll_fail(g, DDP_ERR_MISMATCH, "rank %d called %s before sending what this rank's %s waits for; a send and "
                          "its recv must come in the same order relative to the collectives on both ranks", p->src, theirs,
                          ddp__posted_describe(p, ours, sizeof ours));
}

/* The head of `peer`'s stream while waiting for p: a message is delivered (ddp__peek_peer); from p's
   source, a collective's frame is the mismatch above. */
static ddp_result ddp__p2p_look(ddp_group *g, const ddp__coll *c, const ddp__posted *p, int peer) {
    ddp__frame f;
    if (peer == p->src && recv(g->mesh.peers[peer].fd, &f, sizeof f, MSG_PEEK | MSG_DONTWAIT) == (ssize_t)sizeof f &&
        f.magic == DDP__FRAME_MAGIC && (f.kind == DDP__FRAME_DATA || f.kind == DDP__FRAME_BYE)) {
        if (f.kind == DDP__FRAME_BYE) return ddp__peer_failed_after(g, peer, c, &f); /* "left the group" */
        char theirs[160];
        ddp__coll t = ddp__frame_coll(&f);
        ddp__coll_describe(g, &t, theirs, sizeof theirs);
        return ddp__p2p_went_on(g, p, theirs);
    }
    return ddp__peek_peer(g, c, peer);
}

/* Read what reaches this rank until posted receive p is finished (once: look one time, without waiting). */
static ddp_result ddp__p2p_wait(ddp_group *g, const ddp__coll *c, ddp__posted *p, int once) {
    struct pollfd *fds = g->mesh.pollfds;
    int *owner = g->mesh.poll_owner;
    double deadline = ddp__now() + ddp__quiet_limit(g), ahead_since = 0;
    for (;;) {
        int n = 0, npeers, i, rc, progressed = 0, soon = 0;
        double wake = deadline;
        ddp_result r;
        if (ddp__posted_done(g, p)) return p->result;
        if (g->broken) return g->broken;
        g->mesh.waiting_for = p->src;
        for (i = 0; i < g->mesh.nlinked; i++) {
            int peer = g->mesh.linked[i];
            ddp__peer *q = &g->mesh.peers[peer];
            if (q->fd < 0) continue;
            fds[n].fd = q->fd;
            fds[n].events = POLLRDHUP;
            if (q->peek_later) q->peek_later = 0, soon = 1;
            else if (q->quiet_seq != c->seq || peer == p->src) fds[n].events |= POLLIN;
            fds[n].revents = 0;
            owner[n++] = peer;
        }
        npeers = n;
        n += ddp__link_poll_entries(g, fds + n, owner + n, &wake);
        rc = poll(fds, (nfds_t)n, once ? 0 : soon ? 1 : (int)DDP__MAX(1.0, DDP__MIN(g->shm ? 10.0 : 1000.0,
                                                                                    (wake - ddp__now()) * 1000.0)));
        if (rc < 0 && errno != EINTR) return ddp__coll_fail(g, DDP_ERR_SYSTEM, "poll failed: %s", strerror(errno));
        if (rc > 0 && n > npeers && (r = ddp__link_progress(g, fds + npeers, owner + npeers, n - npeers, &progressed)))
            return ddp__break_with_error(g, r);
        for (i = 0; i < npeers && rc > 0; i++) {
            if (fds[i].revents & POLLIN) {
                if ((r = ddp__p2p_look(g, c, p, owner[i])) != DDP_SUCCESS) return r;
                progressed = 1;
            } else if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
                return ddp__peer_failed(g, owner[i], c);
            }
        }
        if (ddp__posted_done(g, p)) return p->result;
        if (ddp__p2p_peer_went_on(g, p->src, &ahead_since)) { /* over shared memory: see above */
            char theirs[64];
            snprintf(theirs, sizeof theirs, "collective #%llu", (unsigned long long)(ddp__host_peer_seq(g, p->src) - g->seq_base));
            return ddp__p2p_went_on(g, p, theirs);
        }
        if (once) return DDP_SUCCESS;
        if (progressed) deadline = ddp__now() + ddp__quiet_limit(g);
        else if (ddp__now() > deadline) return ddp__peer_timed_out(g, p->src, c);
    }
}

static ddp_result ddp__p2p_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    ddp__posted p;
    ddp_result r;
    if (k->kind == DDP__SEND) {
        ddp__step st;
        memset(&st, 0, sizeof st);
        st.recv_peer = -1;
        st.p2p = 1;
        st.send_peer = k->root;
        st.send_buf = k->send;
        st.send_bytes = bytes;
        return ddp__exchange(g, c, &st);
    }
    memset(&p, 0, sizeof p);
    p.src = k->root;
    p.tag = k->tag;
    p.buf = k->buf;
    p.bytes = bytes;
    p.count = k->count;
    p.dtype = (uint8_t)k->dtype;
    if ((r = ddp__p2p_post(g, &p)) != DDP_SUCCESS) return r;
    r = ddp__p2p_wait(g, c, &p, 0);
    ddp__p2p_unpost(g, &p); /* when it failed before a message came */
    return r;
}

/* ---- closing connections ---- */

/* Close every connection of a group that failed: half-close, then read until each peer closes too
   (at most `seconds` in all), so that the close never carries a reset that destroys the ABORT frame
   a slower peer has yet to read. */
static void ddp__close_after_failure(ddp_group *g, double seconds) {
    double deadline = ddp__now() + seconds;
    char sink[4096];
    int i;
    for (i = 0; i < g->mesh.nlinked; i++)
        if (g->mesh.peers[g->mesh.linked[i]].fd >= 0) shutdown(g->mesh.peers[g->mesh.linked[i]].fd, SHUT_WR);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd < 0) continue;
        while (ddp__now() < deadline) {
            ssize_t k = recv(p->fd, sink, sizeof sink, 0);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
            if (k < 0) {
                struct pollfd pf;
                pf.fd = p->fd;
                pf.events = POLLIN;
                poll(&pf, 1, (int)DDP__MAX(1.0, (deadline - ddp__now()) * 1000.0));
            }
        }
    }
    ddp__link_close_all(g);
}

/* ---- graceful goodbye (ddp_destroy, after a final barrier) ---- */

/* Send BYE to every connected peer, then read each one's BYE, so that no peer sees our close while it
   still waits on anything: it has already passed the same barrier. */
static void ddp__say_goodbye(ddp_group *g, double seconds) {
    ddp__coll none;
    ddp__frame f;
    char err[DDP__ERR_MAX];
    int i;
    double deadline = ddp__now() + seconds;
    memset(&none, 0, sizeof none);
    ddp__frame_init(&f, g, &none, DDP__FRAME_BYE, 0);
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        if (p->fd >= 0 && !p->gone) ddp__net_send(p->fd, &f, sizeof f, deadline, err);
    }
    for (i = 0; i < g->mesh.nlinked; i++) {
        ddp__peer *p = &g->mesh.peers[g->mesh.linked[i]];
        ddp__frame in;
        ddp_result r;
        if (p->fd < 0 || p->gone) continue;
        while ((r = ddp__net_recv(p->fd, &in, sizeof in, deadline, err)) == DDP_SUCCESS && in.magic == DDP__FRAME_MAGIC &&
               in.kind == DDP__FRAME_P2P && in.bytes <= DDP__MAX_BUFFER_BYTES) { /* a message nobody received */
            ddp__log(g, DDP_LOG_WARN, "rank %d sent this rank a message (tag %d, %llu bytes) that no ddp_recv took before "
                     "ddp_destroy", g->mesh.linked[i], (int)in.root, (unsigned long long)in.bytes);
            while (in.bytes > 0) {
                char sink[4096];
                size_t n = (size_t)DDP__MIN(in.bytes, (uint64_t)sizeof sink);
                if ((r = ddp__net_recv(p->fd, sink, n, deadline, err)) != DDP_SUCCESS) break;
                in.bytes -= n;
            }
            if (r) break;
        }
        if (r != DDP_SUCCESS || in.kind != DDP__FRAME_BYE)
            ddp__log(g, DDP_LOG_DEBUG, "rank %d did not say goodbye cleanly: %s", g->mesh.linked[i], err);
    }
}
