/* [SECTION] ft-run: fault-tolerant training at run time: the control connections that carry the view
   change, ddp_ft_begin / ddp_ft_commit, and each new view's data plane
   ft_view.c decides (which view, which verdict); this file carries its messages and acts on them.

   THE CONTROL CONNECTIONS. The first ddp_ft_begin (collective) gives every member a listening socket and a
   store server of its own, all-gathers their ports over the group, and connects every pair of members
   (the higher id dials the lower, says hello with its id and the group's hash, DDP_AUTH_TOKEN's proof
   when set). They stay quiet while training runs: nothing is read from them until the data plane fails,
   so the normal path costs nothing but ddp_ft_commit's vote. A closed control connection proves that its
   process is gone (the kernel closes a killed process's sockets): ddp__ft_lost(id, dead).

   ONE STEP. ddp_ft_begin fills the step's view (gen, rank, world_size); the program runs forward and
   backward; ddp_ft_commit votes: an 8-byte MIN all-reduce of "this rank finished the step's reduction".
   When it passes, every member finished, so every member applies the step. When anything fails -- a
   collective of the step, the reducer, the vote -- the group breaks as it always does (an ABORT flood,
   the shared segment's abort word: every member blocked anywhere wakes), but in fault-tolerant mode the
   calls answer DDP_ERR_VIEW_CHANGED (util.c's ddp__ft_code) and the next ddp_ft_begin or ddp_ft_commit
   runs the view change.

   THE VIEW CHANGE (ddp__ft_change). The member tells ft_view.c that its data plane failed and its step's
   status (RUNNING, or COMPLETE in the vote); then it polls its control connections, feeding every message
   to ddp__ft_receive and every hang-up to ddp__ft_lost, and ddp__ft_timeout after suspect_seconds (twice
   that when it is not the coordinator, so that the coordinator times out on the missing first), until a
   GO makes it act: the decree's step is applied (COMMIT) or dropped (REDO), and its view is the new one.
   Then the members build the new view's data plane: a fresh group of the view's members (rank = index in
   the view) through the store of the view's first member, under the key prefix "ft/<gen>/"
   (group.c ddp__group_open_view: listener, rendezvous, mesh, shm / tcp / hier as ddp_init chooses), which
   the program's handle adopts (ddp__group_adopt). A member lost while that runs makes the build fail:
   another view change follows, from the new gen. The program's ddp_group pointer, its reducer and its
   work handles stay valid; ddp_alloc hands out heap memory in fault-tolerant mode, since every view maps
   its own shared segment.

   TESTS' KILL POINTS: DDP_FT_TEST_KILL=id:step:point SIGKILLs the member of stable id `id` when it
   reaches `point` at committed step `step` (steps counted over all epochs): begin (in ddp_ft_begin),
   bucket (the reducer, after its first bucket's all-reduce started), vote (before the vote), report
   (after sending a REPORT), decide (after the first DECIDE of a proposal), go (after the first GO). */
#include "internal.h"
#include "ft_view.h"

#define DDP__FT_FRAME_MAGIC 0x31544644u /* "DFT1": a control frame: magic, payload bytes, payload */
#define DDP__FT_HELLO_MAGIC 0x48544644u /* "DFTH": a dialer's hello: magic, id, group hash */

/* Where a member listens (all-gathered at the start), and its control connection. */
typedef struct ddp__ft_peer {
    char addr[128];
    int32_t ctl_port, store_port;
    int fd;             /* -1: none (never made, or closed) */
    int hung_up;        /* a send or read found it closed: ddp__ft_lost is due */
    unsigned char *in;  /* a frame being read */
    size_t have;
} ddp__ft_peer;

typedef struct ddp__ft {
    ddp_group *g;
    ddp__ft_member m;
    uint32_t cap;              /* ids are below it: the first view's size (no joiners yet) */
    ddp__ft_peer *peers;       /* by id */
    int listen_fd;
    ddp__store_server *server; /* this member's: it serves the rendezvous of views whose first member it is */
    ddp_store *store;          /* a client of the current view's first member's store */
    uint32_t store_of;         /* whose (DDP__FT_NONE: none) */
    uint64_t gstep;            /* steps committed since the start, over every epoch */
    size_t msg_max;            /* the largest payload a message of this job can have */
    unsigned char *out;        /* an outgoing frame */
    uint32_t *dec_dead, *dec_members; /* a decoded message's arrays */
    int acted;                 /* a GO was acted on (ft_view.c's act) */
    uint64_t changes;          /* view changes this member went through */
    double change_seconds;     /* the last one's, from entering to the new data plane */
    const char *kill;          /* DDP_FT_TEST_KILL (NULL: none) */
} ddp__ft;

/* ---- test kill points ---- */

/* DDP_FT_TEST_KILL: a comma-separated list of id:step:point. */
static void ddp__ft_kill_at(ddp__ft *ft, const char *point) {
    const char *v = ft->kill, *at;
    for (at = v; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL) {
        unsigned long long step;
        char name[16];
        int id, used = 0;
        if (sscanf(at, "%d:%llu:%15[a-z]%n", &id, &step, name, &used) != 3 || (at[used] && at[used] != ',')) {
            ddp__log(ft->g, DDP_LOG_WARN, "DDP_FT_TEST_KILL=\"%s\" is not a list of id:step:point; ignored", v);
            ft->kill = NULL;
            return;
        }
        if ((uint32_t)id != ft->m.id || step != ft->gstep || strcmp(point, name) != 0) continue;
        fprintf(stderr, "[ddp] DDP_FT_TEST_KILL: member %d kills itself at step %llu, point %s\n", id, step, point);
        fflush(stderr);
        kill(getpid(), SIGKILL);
    }
}

/* ---- the wire: a message as bytes (host byte order: the ranks of one job share an architecture) ---- */

typedef struct ddp__ft_wire {
    unsigned char *p;
    size_t n, cap;
    int bad; /* a read past the end */
} ddp__ft_wire;

static void ddp__ft_put(ddp__ft_wire *w, const void *v, size_t n) {
    if (w->n + n > w->cap) {
        w->bad = 1;
        return;
    }
    memcpy(w->p + w->n, v, n);
    w->n += n;
}
static void ddp__ft_get(ddp__ft_wire *w, void *v, size_t n) {
    if (w->n + n > w->cap) {
        w->bad = 1;
        memset(v, 0, n);
        return;
    }
    memcpy(v, w->p + w->n, n);
    w->n += n;
}
#define DDP__FT_PUT(w, x) ddp__ft_put(w, &(x), sizeof(x))
#define DDP__FT_GET(w, x) ddp__ft_get(w, &(x), sizeof(x))

static void ddp__ft_put_ballot(ddp__ft_wire *w, ddp__ft_ballot b) {
    DDP__FT_PUT(w, b.round);
    DDP__FT_PUT(w, b.coord);
}
static void ddp__ft_get_ballot(ddp__ft_wire *w, ddp__ft_ballot *b) {
    DDP__FT_GET(w, b->round);
    DDP__FT_GET(w, b->coord);
}

static size_t ddp__ft_encode(const ddp__ft_msg *msg, unsigned char *buf, size_t cap) {
    ddp__ft_wire w;
    int32_t kind = (int32_t)msg->kind, status = (int32_t)msg->status, n_dead = msg->n_dead;
    int32_t has = msg->has_decide, joining = msg->joining, n = msg->decide.view.n;
    int32_t verdict = (int32_t)msg->decide.verdict;
    w.p = buf, w.n = 0, w.cap = cap, w.bad = 0;
    DDP__FT_PUT(&w, kind);
    DDP__FT_PUT(&w, msg->from);
    DDP__FT_PUT(&w, msg->gen);
    ddp__ft_put_ballot(&w, msg->ballot);
    ddp__ft_put_ballot(&w, msg->promised);
    DDP__FT_PUT(&w, n_dead);
    if (n_dead > 0) ddp__ft_put(&w, msg->dead, (size_t)n_dead * sizeof *msg->dead);
    DDP__FT_PUT(&w, msg->step);
    DDP__FT_PUT(&w, status);
    DDP__FT_PUT(&w, joining);
    DDP__FT_PUT(&w, has);
    if (has) {
        DDP__FT_PUT(&w, msg->decide.base);
        ddp__ft_put_ballot(&w, msg->decide.ballot);
        DDP__FT_PUT(&w, msg->decide.view.gen);
        DDP__FT_PUT(&w, msg->decide.view.next_id);
        DDP__FT_PUT(&w, n);
        if (n > 0) ddp__ft_put(&w, msg->decide.view.members, (size_t)n * sizeof(uint32_t));
        DDP__FT_PUT(&w, msg->decide.step);
        DDP__FT_PUT(&w, verdict);
    }
    return w.bad ? 0 : w.n;
}

/* Decode into msg; its arrays point at dead / members (cap entries each). 0: malformed. */
static int ddp__ft_decode(const unsigned char *buf, size_t len, uint32_t cap, uint32_t *dead, uint32_t *members,
                          ddp__ft_msg *msg) {
    ddp__ft_wire w;
    int32_t kind, status, n_dead, has, joining, n = 0, verdict = 0;
    memset(msg, 0, sizeof *msg);
    w.p = (unsigned char *)buf, w.n = 0, w.cap = len, w.bad = 0;
    DDP__FT_GET(&w, kind);
    DDP__FT_GET(&w, msg->from);
    DDP__FT_GET(&w, msg->gen);
    ddp__ft_get_ballot(&w, &msg->ballot);
    ddp__ft_get_ballot(&w, &msg->promised);
    DDP__FT_GET(&w, n_dead);
    if (w.bad || n_dead < 0 || (uint32_t)n_dead > cap) return 0;
    ddp__ft_get(&w, dead, (size_t)n_dead * sizeof *dead);
    DDP__FT_GET(&w, msg->step);
    DDP__FT_GET(&w, status);
    DDP__FT_GET(&w, joining);
    DDP__FT_GET(&w, has);
    if (has) {
        DDP__FT_GET(&w, msg->decide.base);
        ddp__ft_get_ballot(&w, &msg->decide.ballot);
        DDP__FT_GET(&w, msg->decide.view.gen);
        DDP__FT_GET(&w, msg->decide.view.next_id);
        DDP__FT_GET(&w, n);
        if (w.bad || n < 0 || (uint32_t)n > cap) return 0;
        ddp__ft_get(&w, members, (size_t)n * sizeof *members);
        DDP__FT_GET(&w, msg->decide.step);
        DDP__FT_GET(&w, verdict);
    }
    if (w.bad || w.n != len || kind < DDP__FT_SUSPECT || kind > DDP__FT_GO || status < DDP__FT_RUNNING ||
        status > DDP__FT_COMMITTED || (has && verdict != DDP__FT_COMMIT && verdict != DDP__FT_REDO))
        return 0;
    msg->kind = (ddp__ft_kind)kind;
    msg->n_dead = n_dead;
    msg->dead = dead;
    msg->status = (ddp__ft_status)status;
    msg->joining = joining;
    msg->has_decide = has;
    msg->decide.view.n = n;
    msg->decide.view.members = members;
    msg->decide.verdict = (ddp__ft_verdict)verdict;
    return 1;
}

/* ---- sending and acting: ft_view.c's callbacks ---- */

static void ddp__ft_send(void *ctx, uint32_t to, const ddp__ft_msg *msg) {
    ddp__ft *ft = (ddp__ft *)ctx;
    ddp__ft_peer *p = to < ft->cap ? &ft->peers[to] : NULL;
    char err[DDP__ERR_MAX];
    uint32_t head[2];
    size_t len;
    if (!p || p->fd < 0 || p->hung_up) return; /* lost already: ddp__ft_lost says so */
    len = ddp__ft_encode(msg, ft->out + sizeof head, ft->msg_max);
    if (!len) {
        ddp__log(ft->g, DDP_LOG_ERROR, "fault tolerance: a message to member %u does not fit %zu bytes; not sent", to,
                 ft->msg_max);
        return;
    }
    head[0] = DDP__FT_FRAME_MAGIC;
    head[1] = (uint32_t)len;
    memcpy(ft->out, head, sizeof head);
    /* A live peer reads its control connection whenever it is in a view change; a full socket buffer
       for this long means it is stuck, which its own timeouts handle. */
    if (ddp__net_send(p->fd, ft->out, sizeof head + len, ddp__now() + DDP__MAX(ft->g->ft_suspect, 1.0), err) != DDP_SUCCESS)
        p->hung_up = 1;
    if (msg->kind == DDP__FT_REPORT) ddp__ft_kill_at(ft, "report");
    if (msg->kind == DDP__FT_DECIDE) ddp__ft_kill_at(ft, "decide");
    if (msg->kind == DDP__FT_GO) ddp__ft_kill_at(ft, "go");
}

static void ddp__ft_act(void *ctx, uint32_t self, const ddp__ft_decide *d, int in_view) {
    ddp__ft *ft = (ddp__ft *)ctx;
    (void)self;
    (void)d;
    (void)in_view; /* (ft_view.c marks a member left out: m.out) */
    ft->acted = 1;
}

/* ---- the control connections ---- */

static void ddp__ft_free(ddp_group *g) {
    ddp__ft *ft = g->ft;
    uint32_t i;
    if (!ft) return;
    g->ft = NULL;
    for (i = 0; i < ft->cap && ft->peers; i++) {
        if (ft->peers[i].fd >= 0) close(ft->peers[i].fd);
        ddp__free(ft->peers[i].in);
    }
    if (ft->listen_fd >= 0) close(ft->listen_fd);
    ddp__store_free(ft->store);
    ddp__store_server_stop(ft->server);
    ddp__ft_member_free(&ft->m);
    ddp__free(ft->peers);
    ddp__free(ft->out);
    ddp__free(ft->dec_dead);
    ddp__free(ft->dec_members);
    ddp__free(ft);
}

/* The hello a dialer sends: magic, its id, the group's hash (a connection from another job is refused). */
static ddp_result ddp__ft_dial(ddp__ft *ft, uint32_t to, double deadline, char *err) {
    ddp__ft_peer *p = &ft->peers[to];
    const char *token = ddp__auth_token();
    uint32_t hello[4];
    uint64_t hash = ddp__link_group_hash(ft->g);
    ddp_result r = ddp__net_connect(p->addr, p->ctl_port, deadline, &p->fd, err);
    if (r == DDP_SUCCESS && token) r = ddp__auth_client(p->fd, token, "a fault-tolerance peer", deadline, err);
    hello[0] = DDP__FT_HELLO_MAGIC;
    hello[1] = ft->m.id;
    memcpy(hello + 2, &hash, sizeof hash);
    if (r == DDP_SUCCESS) r = ddp__net_send(p->fd, hello, sizeof hello, deadline, err);
    return r;
}

static ddp_result ddp__ft_accept(ddp__ft *ft, double deadline, char *err) {
    const char *token = ddp__auth_token();
    uint32_t hello[4];
    uint64_t hash;
    int fd = -1;
    ddp_result r = ddp__net_accept(ft->listen_fd, deadline, &fd, err);
    if (r == DDP_SUCCESS && token && ddp__auth_server(fd, token, deadline, err) != 0) r = DDP_ERR_INIT;
    if (r == DDP_SUCCESS) r = ddp__net_recv(fd, hello, sizeof hello, deadline, err);
    memcpy(&hash, hello + 2, sizeof hash);
    if (r == DDP_SUCCESS && (hello[0] != DDP__FT_HELLO_MAGIC || hash != ddp__link_group_hash(ft->g) ||
                             hello[1] <= ft->m.id || hello[1] >= ft->cap || ft->peers[hello[1]].fd >= 0)) {
        snprintf(err, DDP__ERR_MAX, "a control connection said hello as member %u of another job, or twice", hello[1]);
        r = DDP_ERR_INIT;
    }
    if (r != DDP_SUCCESS) {
        if (fd >= 0) close(fd);
        return r;
    }
    ft->peers[hello[1]].fd = fd;
    return DDP_SUCCESS;
}

/* The first ddp_ft_begin: every member's listener and store, all-gathered; a connection between every pair. */
typedef struct ddp__ft_addr { /* where a member listens, as all-gathered */
    char addr[128];
    int32_t ctl_port, store_port;
} ddp__ft_addr;

static ddp_result ddp__ft_start(ddp_group *g) {
    ddp__ft_addr mine, *all = NULL;
    char err[DDP__ERR_MAX];
    double deadline;
    int port = 0, i;
    uint32_t cap = (uint32_t)g->world_size;
    ddp__ft *ft = (ddp__ft *)ddp__calloc(1, sizeof *ft);
    ddp_result r = DDP_SUCCESS;
    if (!ft) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_ft_begin: out of memory");
    ft->g = g;
    ft->listen_fd = -1;
    ft->cap = cap;
    ft->store_of = DDP__FT_NONE;
    ft->msg_max = 160 + 8 * (size_t)cap;
    g->ft = ft;
    g->ft_end = ddp__ft_free;
    ft->kill = ddp__env("DDP_FT_TEST_KILL");
    ft->peers = (ddp__ft_peer *)ddp__calloc(cap, sizeof *ft->peers);
    ft->out = (unsigned char *)ddp__malloc(ft->msg_max + 8);
    ft->dec_dead = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    ft->dec_members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    all = (ddp__ft_addr *)ddp__calloc(cap, sizeof mine);
    if (!ft->peers || !ft->out || !ft->dec_dead || !ft->dec_members || !all) r = DDP_ERR_OUT_OF_MEMORY;
    for (i = 0; r == DDP_SUCCESS && i < (int)cap; i++) {
        ft->peers[i].fd = -1;
        if (!(ft->peers[i].in = (unsigned char *)ddp__malloc(ft->msg_max + 8))) r = DDP_ERR_OUT_OF_MEMORY;
    }
    if (r == DDP_SUCCESS)
        r = ddp__ft_member_init(&ft->m, (uint32_t)g->rank, g->world_size, cap, ddp__ft_send, ddp__ft_act, ft);
    if (r != DDP_SUCCESS) {
        ddp__free(all);
        return ddp__fail(g, r, "ddp_ft_begin: out of memory setting up fault tolerance");
    }
    memset(&mine, 0, sizeof mine);
    snprintf(mine.addr, sizeof mine.addr, "%s", g->member.address[0] ? g->member.address : "127.0.0.1");
    if (g->world_size > 1) {
        r = ddp__net_listen(mine.addr, 0, &ft->listen_fd, &port, err);
        mine.ctl_port = port;
        if (r == DDP_SUCCESS) r = ddp__store_server_start(mine.addr, 0, g->log_level, &ft->server, err);
        if (r == DDP_SUCCESS) mine.store_port = ddp__store_server_port(ft->server);
        else mine.ctl_port = 0; /* says "failed" to the others */
    }
    /* every member takes part, so that one failure fails all */
    if (g->world_size > 1) {
        ddp_result mine_r = r;
        r = ddp_all_gather(g, &mine, all, sizeof mine, DDP_U8);
        if (mine_r != DDP_SUCCESS) r = ddp__fail(g, mine_r, "ddp_ft_begin: cannot listen for fault tolerance on %s: %s", mine.addr, err);
        for (i = 0; r == DDP_SUCCESS && i < (int)cap; i++)
            if (all[i].ctl_port == 0)
                r = ddp__fail(g, DDP_ERR_INIT, "ddp_ft_begin: rank %d could not listen for fault tolerance (its message says why)", i);
    }
    for (i = 0; r == DDP_SUCCESS && i < (int)cap && g->world_size > 1; i++) {
        memcpy(ft->peers[i].addr, all[i].addr, sizeof ft->peers[i].addr);
        ft->peers[i].addr[sizeof ft->peers[i].addr - 1] = 0;
        ft->peers[i].ctl_port = all[i].ctl_port;
        ft->peers[i].store_port = all[i].store_port;
    }
    ddp__free(all);
    /* dial the lower ids, accept the higher ones: dependencies point down, so nobody waits in a circle */
    deadline = ddp__now() + g->timeout;
    for (i = 0; r == DDP_SUCCESS && i < g->rank; i++)
        if ((r = ddp__ft_dial(ft, (uint32_t)i, deadline, err)) != DDP_SUCCESS)
            r = ddp__fail(g, r, "ddp_ft_begin: the control connection to rank %d (%s:%d): %s", i, ft->peers[i].addr,
                          ft->peers[i].ctl_port, err);
    for (i = g->rank + 1; r == DDP_SUCCESS && i < g->world_size; i++)
        if ((r = ddp__ft_accept(ft, deadline, err)) != DDP_SUCCESS)
            r = ddp__fail(g, r, "ddp_ft_begin: accepting the control connections of higher ranks: %s", err);
    if (g->world_size > 1) r = ddp__agree_outcome(g, r, "ddp_ft_begin (fault tolerance's control connections)");
    g->ft_running = r == DDP_SUCCESS;
    if (r == DDP_SUCCESS)
        ddp__log(g, DDP_LOG_INFO, "fault tolerance: %d members connected; suspect_seconds %g, min_world_size %d",
                 g->world_size, g->ft_suspect, g->ft_min_world);
    return r;
}

/* ---- the view change ---- */

/* Read what arrived on member id's connection; each whole frame goes to ft_view.c. */
static ddp_result ddp__ft_read(ddp__ft *ft, uint32_t id) {
    ddp__ft_peer *p = &ft->peers[id];
    for (;;) {
        uint32_t head[2] = {0, 0};
        size_t want = p->have < 8 ? 8 : 8 + (memcpy(head, p->in, 8), (size_t)head[1]);
        ssize_t k;
        if (p->have >= 8) {
            memcpy(head, p->in, 8);
            if (head[0] != DDP__FT_FRAME_MAGIC || head[1] > ft->msg_max) {
                ddp__log(ft->g, DDP_LOG_ERROR, "fault tolerance: member %u sent a malformed control frame; its connection "
                         "is closed", id);
                p->hung_up = 1;
                return DDP_SUCCESS;
            }
        }
        if (p->have == want && want > 8) {
            ddp__ft_msg msg;
            ddp_result r;
            p->have = 0;
            if (!ddp__ft_decode(p->in + 8, want - 8, ft->cap, ft->dec_dead, ft->dec_members, &msg) || msg.from != id) {
                ddp__log(ft->g, DDP_LOG_ERROR, "fault tolerance: member %u sent a malformed message; its connection is "
                         "closed", id);
                p->hung_up = 1;
                return DDP_SUCCESS;
            }
            if ((r = ddp__ft_receive(&ft->m, &msg)) == DDP_ERR_STATE)
                return ddp__fail(ft->g, DDP_ERR_STATE, "fault tolerance: member %u sent a decision this member cannot "
                                 "act on (it would undo a step applied here); stopping", id);
            continue;
        }
        k = recv(p->fd, p->in + p->have, want - p->have, 0);
        if (k > 0) {
            p->have += (size_t)k;
            continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return DDP_SUCCESS;
        p->hung_up = 1; /* closed (or reset): the process is gone */
        return DDP_SUCCESS;
    }
}

/* Connections found closed: the members are dead (a closed connection proves it). */
static ddp_result ddp__ft_reap(ddp__ft *ft) {
    uint32_t i;
    ddp_result r = DDP_SUCCESS;
    for (i = 0; i < ft->cap && r == DDP_SUCCESS; i++) {
        ddp__ft_peer *p = &ft->peers[i];
        if (!p->hung_up || p->fd < 0) continue;
        close(p->fd);
        p->fd = -1;
        r = ddp__ft_lost(&ft->m, i, 1);
    }
    return r;
}

/* Read every control connection once (waiting up to wait_ms for the first message), then report the
   connections found closed. Stops early once a GO was acted on: what follows belongs to the new view. */
static ddp_result ddp__ft_pump(ddp__ft *ft, int wait_ms) {
    struct pollfd fds[64];
    uint32_t ids[64], i, start = 0;
    ddp_result r = DDP_SUCCESS;
    int n, k;
    while (start < ft->cap && r == DDP_SUCCESS && !ft->acted) { /* 64 at a time: a larger job polls in turns */
        for (n = 0, i = start; i < ft->cap && n < 64; i++)
            if (ft->peers[i].fd >= 0 && !ft->peers[i].hung_up) {
                fds[n].fd = ft->peers[i].fd, fds[n].events = POLLIN, fds[n].revents = 0;
                ids[n++] = i;
            }
        start = i;
        if (n > 0 && poll(fds, (nfds_t)n, ft->cap > 64 ? 0 : wait_ms) > 0)
            for (k = 0; k < n && r == DDP_SUCCESS && !ft->acted; k++)
                if (fds[k].revents) r = ddp__ft_read(ft, ids[k]);
        if (n == 0 && wait_ms > 0) ddp__sleep(wait_ms * 1e-3);
    }
    if (r == DDP_SUCCESS && !ft->acted) r = ddp__ft_reap(ft);
    return r;
}

/* The data plane of the view ft_view.c just installed: a fresh group through its first member's store. */
static ddp_result ddp__ft_rebuild(ddp__ft *ft) {
    ddp_group *g = ft->g, *v = NULL;
    const ddp__ft_view *view = &ft->m.view;
    uint32_t first = view->members[0];
    int rank = ddp__ft_rank_of(view, ft->m.id);
    char err[DDP__ERR_MAX], prefix[48];
    double timeout = DDP__MAX(2 * g->ft_suspect, 1.0);
    ddp_result r;
    if (view->n > 1 && ft->store_of != first) {
        ddp__store_free(ft->store);
        ft->store = NULL;
        ft->store_of = DDP__FT_NONE;
        if ((r = ddp__store_connect(ft->peers[first].addr, ft->peers[first].store_port, NULL, timeout, &ft->store, err)) != DDP_SUCCESS)
            return ddp__fail(g, r, "fault tolerance: the store of member %u, the new view's first: %s", first, err);
        ft->store_of = first;
    }
    snprintf(prefix, sizeof prefix, "ft/%llu/", (unsigned long long)view->gen);
    if ((r = ddp__group_open_view(g, rank, view->n, ft->store, prefix, timeout, &v)) != DDP_SUCCESS) return r;
    ddp__drain(g);
    ddp__group_adopt(g, v);
    return DDP_SUCCESS;
}

/* Names of the view's members, for messages: "0, 2, 3". */
static const char *ddp__ft_members_text(const ddp__ft_view *v, char *buf, size_t cap) {
    size_t len = 0;
    int i;
    buf[0] = 0;
    for (i = 0; i < v->n && len + 16 < cap; i++) len += (size_t)snprintf(buf + len, cap - len, "%s%u", i ? ", " : "", v->members[i]);
    if (i < v->n) snprintf(buf + len, cap - len, ", ...");
    return buf;
}

/* Run a view change to its end: the decree acted on and the new view's data plane adopted. *applied: the
   steps it committed here (0 or 1). Fails only when this member cannot go on: left out of the view, too
   few members left (min_world_size), or no quorum within the group's timeout. */
static ddp_result ddp__ft_change(ddp__ft *ft, int *applied) {
    ddp_group *g = ft->g;
    uint64_t step0 = ft->gstep;
    double t0 = ddp__now(), next_timeout, limit = DDP__MAX(g->timeout, 10 * g->ft_suspect);
    char members[256];
    ddp_result r;
    *applied = 0;
    ddp__drain(g);
    if (!g->broken) ddp__group_break(g, DDP_ERR_VIEW_CHANGED, "fault tolerance: this member entered a view change");
    for (;;) {
        ft->acted = 0;
        r = ddp__ft_data_failed(&ft->m);
        next_timeout = ddp__now() + g->ft_suspect * (ddp__ft_coordinator(&ft->m.view, ft->m.dead, ft->m.suspected) == ft->m.id ? 1 : 2);
        while (r == DDP_SUCCESS && !ft->acted) {
            double now;
            if ((r = ddp__ft_pump(ft, 20)) != DDP_SUCCESS || ft->acted) break;
            now = ddp__now();
            if (now >= next_timeout) {
                r = ddp__ft_timeout(&ft->m);
                next_timeout = now + g->ft_suspect *
                                         (ddp__ft_coordinator(&ft->m.view, ft->m.dead, ft->m.suspected) == ft->m.id ? 1 : 2);
            }
            if (r == DDP_SUCCESS && now - t0 > limit) {
                g->ft_running = 0; /* the end here: plain errors from now on */
                r = ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: no view with a quorum of the members formed within "
                              "%g s: this member is cut off from the majority, or too many were lost", limit);
            }
        }
        /* what arrived meanwhile: a later GO (others moved on), or a member of the new view found dead
           (ft_view.c then starts the next change at once) */
        while (r == DDP_SUCCESS && ft->acted) {
            ft->acted = 0;
            r = ddp__ft_pump(ft, 0);
        }
        if (r != DDP_SUCCESS) return r == DDP_ERR_FORMAT ? DDP_ERR_STATE : r;
        *applied = (int)(ft->m.step - step0);
        ft->gstep = ft->m.step;
        if (ft->m.out) {
            g->ft_running = 0; /* the end here: plain errors from now on */
            return ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: the other members formed view %llu without this one "
                             "(they lost it); it stops here", (unsigned long long)ft->m.view.gen);
        }
        if (ft->m.view.n < g->ft_min_world) {
            g->ft_running = 0; /* the end here: plain errors from now on */
            return ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: %d member%s left (%s), fewer than min_world_size %d",
                             ft->m.view.n, ft->m.view.n == 1 ? "" : "s", ddp__ft_members_text(&ft->m.view, members, sizeof members),
                             g->ft_min_world);
        }
        if (ft->m.changing) continue;
        if ((r = ddp__ft_rebuild(ft)) == DDP_SUCCESS) break;
        ddp__log(g, DDP_LOG_WARN, "fault tolerance: view %llu's data plane failed to form (%s); changing the view again",
                 (unsigned long long)ft->m.view.gen, g->error);
        ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_RUNNING);
    }
    ft->changes++;
    ft->change_seconds = ddp__now() - t0;
    ddp__log(g, DDP_LOG_WARN, "fault tolerance: view %llu: members %s (this one rank %d of %d); step %llu %s; %.1f ms",
             (unsigned long long)ft->m.view.gen, ddp__ft_members_text(&ft->m.view, members, sizeof members), g->rank,
             g->world_size, (unsigned long long)ft->m.made.step, ft->m.made.verdict == DDP__FT_COMMIT ? "committed" : "redone",
             ft->change_seconds * 1e3);
    return DDP_SUCCESS;
}

/* ---- the public calls ---- */

static ddp_result ddp__ft_check(ddp_group *g, ddp_ft_step *st, const char *fn) {
    ddp_result r = ddp__group_check(g, fn);
    if (r) return r;
    if (!st) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the ddp_ft_step argument is NULL", fn);
    if (!g->ft_mode)
        return ddp__fail(g, DDP_ERR_STATE, "%s: fault tolerance is off; set ddp_init_desc.fault_tolerant = 1 or DDP_FT=1", fn);
    if (g->member.parent)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: call it on the world group (ddp_init's), not a subgroup", fn);
    return DDP_SUCCESS;
}

static void ddp__ft_fill(ddp__ft *ft, ddp_ft_step *st) {
    st->gen = ft->m.view.gen;
    st->rank = ft->g->rank;
    st->world_size = ft->g->world_size;
    st->joined = 0;
}

DDP_API ddp_result ddp_ft_begin(ddp_group *g, ddp_ft_step *st) {
    ddp_result r = ddp__ft_check(g, st, "ddp_ft_begin");
    int applied = 0;
    if (r) return r;
    if (!g->ft_running && g->ft)
        return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_begin: fault tolerance failed to start on this group (the first "
                         "ddp_ft_begin said why); destroy the group");
    if (!g->ft && (r = ddp__ft_start(g)) != DDP_SUCCESS) return r;
    ddp__ft_kill_at(g->ft, "begin");
    if (g->broken && (r = ddp__ft_change(g->ft, &applied)) != DDP_SUCCESS) return r;
    if (applied) st->step++; /* cannot come from a RUNNING member (ft_view.c leaves it out), but say it as it is */
    ddp__ft_set_step(&g->ft->m, g->ft->gstep, DDP__FT_RUNNING);
    ddp__ft_fill(g->ft, st);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_ft_commit(ddp_group *g, ddp_ft_step *st) {
    ddp_result r = ddp__ft_check(g, st, "ddp_ft_commit");
    int64_t ok = 1;
    int applied = 0;
    ddp__ft *ft;
    if (r) return r;
    if (!(ft = g->ft) || !g->ft_running) return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_commit: call ddp_ft_begin first");
    ddp__ft_kill_at(ft, "vote");
    if (!g->broken) { /* the step's reduction finished here: COMPLETE, then the vote */
        ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_COMPLETE);
        r = ddp_all_reduce(g, &ok, 1, DDP_I64, DDP_MIN);
        if (r == DDP_SUCCESS) {
            ft->gstep++;
            ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_RUNNING);
            st->step++;
            return DDP_SUCCESS;
        }
        if (r != DDP_ERR_VIEW_CHANGED) return r;
    }
    if ((r = ddp__ft_change(ft, &applied)) != DDP_SUCCESS) return r;
    ddp__ft_fill(ft, st);
    if (applied) {
        st->step++;
        return DDP_SUCCESS;
    }
    return ddp__fail(g, DDP_ERR_VIEW_CHANGED, "ddp_ft_commit: the view changed (view %llu, %d member%s) before every member "
                     "finished the step; redo it: call ddp_ft_begin and run step %llu again", (unsigned long long)st->gen,
                     st->world_size, st->world_size == 1 ? "" : "s", (unsigned long long)st->step);
}

/* A kill point inside another layer (the reducer's "bucket"), for DDP_FT_TEST_KILL. */
static void ddp__ft_test_kill(ddp_group *g, const char *point) {
    if (g && g->ft) ddp__ft_kill_at(g->ft, point);
}
