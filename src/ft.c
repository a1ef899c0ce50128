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
   backward; ddp_ft_commit votes: a MIN all-reduce of {this rank finished the step's reduction, -joiners
   waiting} (16 bytes). When it passes, every member finished, so every member applies the step. When anything fails -- a
   collective of the step, the reducer, the vote -- the group breaks as it always does (an ABORT flood,
   the shared segment's abort word: every member blocked anywhere wakes), but in fault-tolerant mode the
   calls answer DDP_ERR_VIEW_CHANGED (util.c's ddp__ft_code) and the next ddp_ft_begin or ddp_ft_commit
   runs the view change. A silent peer (stopped, or behind a cut link: nothing closes) fails a collective
   after suspect_seconds without progress, not the group's timeout (ddp__ft_quiet).

   THE VIEW CHANGE (ddp__ft_change). The member tells ft_view.c that its data plane failed and its step's
   status (RUNNING, or COMPLETE in the vote); then it polls its control connections, feeding every message
   to ddp__ft_receive and every hang-up to ddp__ft_lost, and ddp__ft_timeout after suspect_seconds (twice
   that when it is not the coordinator, so that the coordinator times out on the missing first), until a
   GO makes it act: the decree's step is applied (COMMIT) or dropped (REDO), and its view is the new one.
   Then the members build the new view's data plane: a fresh group of the view's members (rank = index in
   the view) through the store of the view's first member, under the key prefix "ft/<gen>/"
   (group.c ddp__group_open_view: listener, rendezvous, mesh, shm / tcp / hier as ddp_init chooses), which
   the program's handle adopts (ddp__group_adopt). A member lost while that runs makes the build fail --
   at once when its control connection closed (the set-up asks ddp__ft_view_member_gone every 0.25 s while
   it waits), else at the set-up's timeout (2 x suspect_seconds) --: another view change follows, from the
   new gen. The program's ddp_group pointer, its reducer and its
   work handles stay valid; ddp_alloc hands out heap memory in fault-tolerant mode, since every view maps
   its own shared segment.

   JOINERS (FT.md 2.6). A process started with DDP_FT_JOIN=1 reads the view's record from the program's
   store ("ddp_ft/view": every member's address, written by the view's first member after each change),
   dials that member's control listener and is given an id (next_id, next_id + 1, ...: ddp__ft_intake,
   before each vote); the vote tells every member how many wait, the next ddp_ft_begin runs a view change
   that admits them (ft_view.c's parties), the joiners dial every member, all build the data plane, and in
   ddp_ft_begin -- where every member has applied every committed step -- rank 0 broadcasts the registered
   state (ddp__ft_transfer). A joiner passed over, or whose member was lost, asks again.

   TESTS' KILL POINTS: DDP_FT_TEST_KILL=id:step:point SIGKILLs the member of stable id `id` when it
   reaches `point` at committed step `step` (steps counted over all epochs; * for any): begin (in ddp_ft_begin),
   bucket (the reducer, after its first bucket's all-reduce started), vote (before the vote), report
   (after sending a REPORT), decide (after the first DECIDE of a proposal), go (after the first GO),
   transfer (donor or joiner, once the state's header went out). */
#include "internal.h"
#include "ft_view.h"

#define DDP__FT_FRAME_MAGIC 0x31544644u /* "DFT1": a control frame: magic, payload bytes, payload */
#define DDP__FT_HELLO_MAGIC 0x48544644u /* "DFTH": a dialer's hello: magic, id, group hash */

#define DDP__FT_JOIN_MAGIC 0x4a544644u  /* "DFTJ": a joiner's hello, and the id it is given back */
#define DDP__FT_VIEW_MAGIC 0x56544644u  /* "DFTV": the view's record in the program's store */

/* Where a member listens: control connections and its store server. */
typedef struct ddp__ft_addr {
    char addr[128];
    int32_t ctl_port, store_port;
    uint32_t id;
    uint32_t pad;
} ddp__ft_addr;

/* What a dialer says first. */
typedef struct ddp__ft_hello {
    uint32_t magic; /* DDP__FT_HELLO_MAGIC (a member), DDP__FT_JOIN_MAGIC (a joiner asking for an id) */
    uint32_t id;
    uint64_t hash;  /* the job's (the world group's mesh hash): another job's connection is refused */
    ddp__ft_addr where;
} ddp__ft_hello;

/* The view's record (ddp__ft_publish), followed by n ddp__ft_addr. */
typedef struct ddp__ft_record {
    uint32_t magic, cap;
    uint64_t gen, hash;
    uint32_t n, pad;
} ddp__ft_record;

/* A buffer ddp_ft_register named: sent to joiners. */
typedef struct ddp__ft_reg {
    char name[64];
    void *data;
    size_t bytes;
} ddp__ft_reg;

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
    uint32_t cap;              /* ids are below it: the first view's members, then the joiners it may admit */
    ddp__ft_peer *peers;       /* by id */
    int listen_fd;
    ddp__store_server *server; /* this member's: it serves the rendezvous of views whose first member it is */
    ddp_store *store;          /* a client of the current view's first member's store */
    uint32_t store_of;         /* whose (DDP__FT_NONE: none) */
    uint64_t gstep;            /* steps committed since the start, over every epoch */
    size_t msg_max;            /* the largest payload a message of this job can have */
    unsigned char *out;        /* an outgoing frame */
    uint32_t *dec_dead, *dec_members; /* a decoded message's arrays */
    struct pollfd *pfds;       /* cap entries: what ddp__ft_pump polls */
    uint32_t *pids;            /* the id of each */
    int acted;                 /* a GO was acted on (ft_view.c's act) */
    uint64_t changes;          /* view changes this member went through */
    double change_seconds;     /* the last one's, from entering to the new data plane */
    const char *kill;          /* DDP_FT_TEST_KILL (NULL: none) */
    uint64_t hash;             /* the job's, said in every hello */
    ddp__ft_addr me;           /* where this member listens */
    int pending;               /* the view's first member: joiners accepted and given ids, not yet admitted */
    int admit;                 /* joiners the last vote announced: the next ddp_ft_begin admits them */
    uint32_t transfer_from;    /* joiners from this id on wait for the state (ddp_ft_begin sends it); NONE: none */
    uint32_t join_via;         /* a joiner: the member it asked (its connection closing means: ask again) */
    uint64_t join_gen;         /* a joiner: the view its last try found, and how often in a row its first member */
    int join_refused;          /* refused (the job has ended when that goes on) */
    ddp__ft_reg *regs;         /* ddp_ft_register's buffers, in the order registered */
    int nregs, regs_cap;
    uint32_t *plane;           /* the ids of the adopted data plane's members, by rank (nccl: its communicator's) */
    int plane_n;               /* how many (0 for a joiner until admitted) */
    int *lost;                 /* ddp__ft_rebuild's scratch: the plane's ranks a new view lost */
    char rejoin_why[160];      /* a member rejoining (left out, cut off): why; "" for a joiner ddprun started */
} ddp__ft;

/* ---- test kill points ---- */

/* DDP_FT_TEST_KILL: a comma-separated list of id:step:point. */
static void ddp__ft_kill_at(ddp__ft *ft, const char *point) {
    const char *v = ft->kill, *at;
    for (at = v; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL) {
        unsigned long long step = 0;
        char name[16];
        int id, used = 0;
        int any = sscanf(at, "%d:*:%15[a-z]%n", &id, name, &used) == 2; /* step *: whatever the step */
        if (!any && (sscanf(at, "%d:%llu:%15[a-z]%n", &id, &step, name, &used) != 3 || (at[used] && at[used] != ','))) {
            ddp__log(ft->g, DDP_LOG_WARN, "DDP_FT_TEST_KILL=\"%s\" is not a list of id:step:point; ignored", v);
            ft->kill = NULL;
            return;
        }
        if (any && at[used] && at[used] != ',') continue;
        if ((uint32_t)id != ft->m.id || (!any && step != ft->gstep) || strcmp(point, name) != 0) continue;
        fprintf(stderr, "[ddp] DDP_FT_TEST_KILL: member %d kills itself at step %llu, point %s\n", id,
                (unsigned long long)ft->gstep, point);
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
    ddp__free(ft->pfds);
    ddp__free(ft->pids);
    ddp__free(ft->regs);
    ddp__free(ft->plane);
    ddp__free(ft->lost);
    ddp__free(ft);
}

/* The state made before the control connections: what ddp_ft_register records goes here. */
static ddp__ft *ddp__ft_state(ddp_group *g) {
    if (!g->ft && (g->ft = (ddp__ft *)ddp__calloc(1, sizeof *g->ft)) != NULL) {
        g->ft->g = g;
        g->ft->listen_fd = -1;
        g->ft->store_of = DDP__FT_NONE;
        g->ft->transfer_from = g->ft->join_via = DDP__FT_NONE;
        g->ft->kill = ddp__env("DDP_FT_TEST_KILL");
        g->ft_end = ddp__ft_free;
    }
    return g->ft;
}

/* The arrays sized by cap (ids below it: the first view's members and the joiners the job may admit). */
static ddp_result ddp__ft_arrays(ddp__ft *ft, uint32_t cap) {
    uint32_t i;
    ft->cap = cap;
    ft->msg_max = 160 + 8 * (size_t)cap;
    ft->peers = (ddp__ft_peer *)ddp__calloc(cap, sizeof *ft->peers);
    ft->out = (unsigned char *)ddp__malloc(ft->msg_max + 8);
    ft->dec_dead = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    ft->dec_members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    ft->pfds = (struct pollfd *)ddp__calloc(cap, sizeof *ft->pfds);
    ft->pids = (uint32_t *)ddp__calloc(cap, sizeof *ft->pids);
    ft->plane = (uint32_t *)ddp__calloc(cap, sizeof *ft->plane);
    ft->lost = (int *)ddp__calloc(cap, sizeof *ft->lost);
    if (!ft->peers || !ft->out || !ft->dec_dead || !ft->dec_members || !ft->pfds || !ft->pids || !ft->plane || !ft->lost)
        return DDP_ERR_OUT_OF_MEMORY;
    for (i = 0; i < cap; i++) ft->peers[i].fd = -1;
    for (i = 0; i < cap; i++)
        if (!(ft->peers[i].in = (unsigned char *)ddp__malloc(ft->msg_max + 8))) return DDP_ERR_OUT_OF_MEMORY;
    return DDP_SUCCESS;
}

/* This member's listener and store server (their ports in *me). */
static ddp_result ddp__ft_listen(ddp__ft *ft, ddp__ft_addr *me, char *err) {
    ddp_group *g = ft->g;
    int port = 0;
    ddp_result r;
    memset(me, 0, sizeof *me);
    snprintf(me->addr, sizeof me->addr, "%s", g->member.address[0] ? g->member.address : "127.0.0.1");
    r = ddp__net_listen(me->addr, 0, &ft->listen_fd, &port, err);
    me->ctl_port = port;
    if (r == DDP_SUCCESS) r = ddp__store_server_start(me->addr, 0, g->log_level, &ft->server, err);
    if (r == DDP_SUCCESS) me->store_port = ddp__store_server_port(ft->server);
    return r;
}

/* Dial member `to` and say hello (magic, id, the job's hash, where this member listens). */
static ddp_result ddp__ft_dial(ddp__ft *ft, uint32_t to, uint32_t magic, double deadline, char *err) {
    ddp__ft_peer *p = &ft->peers[to];
    const char *token = ddp__auth_token();
    ddp__ft_hello h;
    ddp_result r = ddp__net_connect(p->addr, p->ctl_port, deadline, &p->fd, err);
    if (r == DDP_SUCCESS && token) r = ddp__auth_client(p->fd, token, "a fault-tolerance peer", deadline, err);
    memset(&h, 0, sizeof h);
    h.magic = magic;
    h.id = ft->m.id;
    h.hash = ft->hash;
    h.where = ft->me;
    if (r == DDP_SUCCESS) r = ddp__net_send(p->fd, &h, sizeof h, deadline, err);
    if (r != DDP_SUCCESS && p->fd >= 0) {
        close(p->fd);
        p->fd = -1;
    }
    return r;
}

/* Accept one connection and read its hello (a member's, or a joiner's asking to be admitted). */
static ddp_result ddp__ft_accept_hello(ddp__ft *ft, double deadline, int *fd, ddp__ft_hello *h, char *err) {
    const char *token = ddp__auth_token();
    ddp_result r = ddp__net_accept(ft->listen_fd, deadline, fd, err);
    if (r == DDP_SUCCESS && token && ddp__auth_server(*fd, token, deadline, err) != 0) r = DDP_ERR_INIT;
    if (r == DDP_SUCCESS) r = ddp__net_recv(*fd, h, sizeof *h, deadline, err);
    if (r == DDP_SUCCESS && ((h->magic != DDP__FT_HELLO_MAGIC && h->magic != DDP__FT_JOIN_MAGIC) || h->hash != ft->hash)) {
        snprintf(err, DDP__ERR_MAX, "a control connection said hello as a member of another job");
        r = DDP_ERR_INIT;
    }
    if (r != DDP_SUCCESS && *fd >= 0) {
        close(*fd);
        *fd = -1;
    }
    h->where.addr[sizeof h->where.addr - 1] = 0;
    return r;
}

/* Accept a member's connection (id above this member's at the start; a joiner admitted since). A stray
   one (a joiner's request that a stale record sent here, a member saying hello twice) is closed, and the
   next one accepted, until the deadline. */
static ddp_result ddp__ft_accept(ddp__ft *ft, double deadline, char *err) {
    for (;;) {
        ddp__ft_hello h;
        int fd = -1;
        ddp_result r = ddp__ft_accept_hello(ft, deadline, &fd, &h, err);
        if (r != DDP_SUCCESS) return r;
        if (h.magic != DDP__FT_HELLO_MAGIC || h.id == ft->m.id || h.id >= ft->cap || ft->peers[h.id].fd >= 0) {
            ddp__log(ft->g, DDP_LOG_INFO, "fault tolerance: a control connection said hello as %s %u out of turn; "
                     "closed", h.magic == DDP__FT_JOIN_MAGIC ? "a joiner asking" : "member", h.id);
            close(fd);
            continue;
        }
        ft->peers[h.id].fd = fd;
        ft->peers[h.id].hung_up = 0;
        ft->peers[h.id].have = 0;
        memcpy(ft->peers[h.id].addr, h.where.addr, sizeof h.where.addr);
        ft->peers[h.id].ctl_port = h.where.ctl_port;
        ft->peers[h.id].store_port = h.where.store_port;
        return DDP_SUCCESS;
    }
}

/* The job's record of its view in the program's store ("ddp_ft/view"), where a joiner finds the members:
   written by the view's first member at the start and after every view change. Best effort: a store
   that is gone (rank 0 served it and was lost) only keeps joiners out. */
static void ddp__ft_publish(ddp__ft *ft) {
    ddp_group *g = ft->g;
    ddp__ft_record *rec;
    size_t bytes = sizeof *rec + (size_t)ft->m.view.n * sizeof(ddp__ft_addr);
    int i;
    if (!g->member.store || g->rank != 0 || !(rec = (ddp__ft_record *)ddp__calloc(1, bytes))) return;
    rec->magic = DDP__FT_VIEW_MAGIC;
    rec->cap = ft->cap;
    rec->gen = ft->m.view.gen;
    rec->hash = ft->hash;
    rec->n = (uint32_t)ft->m.view.n;
    for (i = 0; i < ft->m.view.n; i++) {
        ddp__ft_addr *a = (ddp__ft_addr *)(rec + 1) + i;
        const ddp__ft_peer *p = &ft->peers[ft->m.view.members[i]];
        a->id = ft->m.view.members[i];
        if (a->id == ft->m.id) {
            *a = ft->me;
            a->id = ft->m.id;
        } else {
            memcpy(a->addr, p->addr, sizeof a->addr);
            a->ctl_port = p->ctl_port, a->store_port = p->store_port;
        }
    }
    if (ddp_store_set(g->member.store, "ddp_ft/view", rec, bytes) != DDP_SUCCESS)
        ddp__log(g, DDP_LOG_DEBUG, "fault tolerance: the view's record is not in the store (%s): joiners cannot find "
                 "the job", ddp_store_last_error(g->member.store));
    ddp__free(rec);
}

/* The first ddp_ft_begin: every member's listener and store, all-gathered; a connection between every pair. */
static ddp_result ddp__ft_start(ddp_group *g) {
    ddp__ft_addr *all = NULL;
    char err[DDP__ERR_MAX];
    double deadline;
    int i;
    ddp__ft *ft = ddp__ft_state(g);
    ddp_result r = ft ? DDP_SUCCESS : DDP_ERR_OUT_OF_MEMORY;
    /* ids of joiners come after the first view's; the cap bounds how many the job admits in its life */
    if (r == DDP_SUCCESS) r = ddp__ft_arrays(ft, (uint32_t)g->world_size * 2 + 62);
    if (r == DDP_SUCCESS && !(all = (ddp__ft_addr *)ddp__calloc((size_t)g->world_size, sizeof *all))) r = DDP_ERR_OUT_OF_MEMORY;
    if (r == DDP_SUCCESS)
        r = ddp__ft_member_init(&ft->m, (uint32_t)g->rank, g->world_size, ft->cap, ddp__ft_send, ddp__ft_act, ft);
    if (r != DDP_SUCCESS) {
        ddp__free(all);
        return ddp__fail(g, r, "ddp_ft_begin: out of memory setting up fault tolerance");
    }
    ft->hash = ddp__link_group_hash(g);
    for (i = 0; i < g->world_size; i++) ft->plane[i] = (uint32_t)i; /* the first view: id = rank */
    ft->plane_n = g->world_size;
    if (g->world_size > 1 && (r = ddp__ft_listen(ft, &ft->me, err)) != DDP_SUCCESS) ft->me.ctl_port = 0; /* "failed" */
    ft->me.id = (uint32_t)g->rank;
    /* every member takes part, so that one failure fails all */
    if (g->world_size > 1) {
        ddp_result mine_r = r;
        r = ddp_all_gather(g, &ft->me, all, sizeof ft->me, DDP_U8);
        if (mine_r != DDP_SUCCESS) r = ddp__fail(g, mine_r, "ddp_ft_begin: cannot listen for fault tolerance on %s: %s", ft->me.addr, err);
        for (i = 0; r == DDP_SUCCESS && i < g->world_size; i++)
            if (all[i].ctl_port == 0)
                r = ddp__fail(g, DDP_ERR_INIT, "ddp_ft_begin: rank %d could not listen for fault tolerance (its message says why)", i);
    }
    for (i = 0; r == DDP_SUCCESS && i < g->world_size && g->world_size > 1; i++) {
        memcpy(ft->peers[i].addr, all[i].addr, sizeof ft->peers[i].addr);
        ft->peers[i].addr[sizeof ft->peers[i].addr - 1] = 0;
        ft->peers[i].ctl_port = all[i].ctl_port;
        ft->peers[i].store_port = all[i].store_port;
    }
    ddp__free(all);
    /* dial the lower ids, accept the higher ones: dependencies point down, so nobody waits in a circle */
    deadline = ddp__now() + g->timeout;
    for (i = 0; r == DDP_SUCCESS && i < g->rank; i++)
        if ((r = ddp__ft_dial(ft, (uint32_t)i, DDP__FT_HELLO_MAGIC, deadline, err)) != DDP_SUCCESS)
            r = ddp__fail(g, r, "ddp_ft_begin: the control connection to rank %d (%s:%d): %s", i, ft->peers[i].addr,
                          ft->peers[i].ctl_port, err);
    for (i = g->rank + 1; r == DDP_SUCCESS && i < g->world_size; i++)
        if ((r = ddp__ft_accept(ft, deadline, err)) != DDP_SUCCESS)
            r = ddp__fail(g, r, "ddp_ft_begin: accepting the control connections of higher ranks: %s", err);
    if (g->world_size > 1) r = ddp__agree_outcome(g, r, "ddp_ft_begin (fault tolerance's control connections)");
    g->ft_running = r == DDP_SUCCESS;
    if (r == DDP_SUCCESS) {
        ddp__ft_publish(ft);
        ddp__log(g, DDP_LOG_INFO, "fault tolerance: %d members connected; suspect_seconds %g, min_world_size %d",
                 g->world_size, g->ft_suspect, g->ft_min_world);
    }
    return r;
}

/* The view's first member, before each vote: joiners waiting on its listener are accepted, given the
   ids the next view change will admit them with (next_id, next_id + 1, ...), and counted in the vote. */
static void ddp__ft_intake(ddp__ft *ft) {
    struct pollfd pfd;
    /* one joiner a view change: a joiner learns the members' addresses from the view's record, which the
       change that admits another would not have published yet */
    if (ft->listen_fd < 0 || ft->g->rank != 0 || ft->pending > 0) return;
    pfd.fd = ft->listen_fd, pfd.events = POLLIN, pfd.revents = 0;
    while (ft->pending == 0 && poll(&pfd, 1, 0) > 0 && (pfd.revents & POLLIN)) {
        char err[DDP__ERR_MAX];
        ddp__ft_hello h;
        uint32_t welcome[4], id = ft->m.view.next_id + (uint32_t)ft->pending;
        int fd = -1;
        if (ddp__ft_accept_hello(ft, ddp__now() + 1.0, &fd, &h, err) != DDP_SUCCESS) {
            ddp__log(ft->g, DDP_LOG_WARN, "fault tolerance: a connection to the control listener was refused: %s", err);
            continue;
        }
        if (h.magic != DDP__FT_JOIN_MAGIC || id >= ft->cap || ft->peers[id].fd >= 0) {
            ddp__log(ft->g, DDP_LOG_WARN, "fault tolerance: %s; its connection is closed", id >= ft->cap ?
                     "a joiner asked to be admitted, but the job has used every id it can (twice its first size + 62)" :
                     "a member's hello came outside a view change");
            close(fd);
            continue;
        }
        welcome[0] = DDP__FT_JOIN_MAGIC, welcome[1] = id, welcome[2] = (uint32_t)ft->m.view.gen, welcome[3] = 0;
        if (ddp__net_send(fd, welcome, sizeof welcome, ddp__now() + 1.0, err) != DDP_SUCCESS) {
            close(fd);
            continue;
        }
        ft->peers[id].fd = fd;
        ft->peers[id].hung_up = 0;
        ft->peers[id].have = 0;
        memcpy(ft->peers[id].addr, h.where.addr, sizeof h.where.addr);
        ft->peers[id].ctl_port = h.where.ctl_port;
        ft->peers[id].store_port = h.where.store_port;
        ft->pending++;
        ddp__log(ft->g, DDP_LOG_INFO, "fault tolerance: a joiner from %s asks to be admitted; it will be member %u",
                 h.where.addr, id);
    }
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
            p->have = 0;
            if (!ddp__ft_decode(p->in + 8, want - 8, ft->cap, ft->dec_dead, ft->dec_members, &msg) || msg.from != id) {
                ddp__log(ft->g, DDP_LOG_ERROR, "fault tolerance: member %u sent a malformed message; its connection is "
                         "closed", id);
                p->hung_up = 1;
                return DDP_SUCCESS;
            }
            if (ddp__ft_receive(&ft->m, &msg) == DDP_ERR_STATE)
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
    ddp_result r = DDP_SUCCESS;
    uint32_t i;
    int n = 0, k;
    for (i = 0; i < ft->cap; i++)
        if (ft->peers[i].fd >= 0 && !ft->peers[i].hung_up) {
            ft->pfds[n].fd = ft->peers[i].fd, ft->pfds[n].events = POLLIN, ft->pfds[n].revents = 0;
            ft->pids[n++] = i;
        }
    if (n == 0 && wait_ms > 0) ddp__sleep(wait_ms * 1e-3);
    if (n > 0 && poll(ft->pfds, (nfds_t)n, wait_ms) > 0)
        for (k = 0; k < n && r == DDP_SUCCESS && !ft->acted; k++)
            if (ft->pfds[k].revents) r = ddp__ft_read(ft, ft->pids[k]);
    if (r == DDP_SUCCESS && !ft->acted) r = ddp__ft_reap(ft);
    return r;
}

/* While a new view's data plane forms (ddp__ft_rebuild): the rank in that view of a member whose control
   connection closed (the process is gone: the set-up fails at once, not after its timeout), else -1. Only
   a look: nothing is read, so the view change that follows still gets every message. */
static int ddp__ft_view_member_gone(void *arg) {
    ddp__ft *ft = (ddp__ft *)arg;
    const ddp__ft_view *view = &ft->m.view;
    struct pollfd p;
    int i;
    for (i = 0; i < view->n; i++) {
        uint32_t id = view->members[i];
        if (id == ft->m.id || ft->peers[id].fd < 0) continue;
        p.fd = ft->peers[id].fd, p.events = POLLRDHUP, p.revents = 0;
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) return i;
    }
    return -1;
}

/* The data plane of the view ft_view.c just installed: a fresh group through its first member's store. */
static ddp_result ddp__ft_rebuild(ddp__ft *ft) {
    ddp_group *g = ft->g, *v = NULL;
    const ddp__ft_view *view = &ft->m.view;
    uint32_t first = view->members[0];
    int rank = ddp__ft_rank_of(view, ft->m.id);
    char err[DDP__ERR_MAX], prefix[48];
    double timeout = DDP__MAX(2 * g->ft_suspect, 1.0);
    int i, nlost, grown;
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
    if ((r = ddp__group_open_view(g, rank, view->n, ft->store, prefix, timeout, ddp__ft_view_member_gone, ft, &v)) != DDP_SUCCESS)
        return r;
    /* nccl: the view's communicator, from the adopted plane's (the ranks it lost; members it gained) */
    for (nlost = 0, i = 0; i < ft->plane_n; i++)
        if (ddp__ft_rank_of(view, ft->plane[i]) < 0) ft->lost[nlost++] = i;
    grown = view->n > ft->plane_n - nlost;
    if ((r = ddp__nccl_renew(g, v, ft->lost, nlost, grown)) != DDP_SUCCESS) {
        ddp__group_free(v);
        return r;
    }
    ddp__drain(g);
    ddp__group_adopt(g, v);
    memcpy(ft->plane, view->members, (size_t)view->n * sizeof *ft->plane);
    ft->plane_n = view->n;
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

/* After a GO that admitted joiners (ids from `first_new` on): the members accept the control connection of
   each joiner they have none with (the joiner dials them all; the view's first member took its hello). */
static ddp_result ddp__ft_meet_joiners(ddp__ft *ft, uint32_t first_new) {
    char err[DDP__ERR_MAX];
    double deadline = ddp__now() + DDP__MAX(2 * ft->g->ft_suspect, 1.0);
    int i, missing = 0;
    ddp_result r = DDP_SUCCESS;
    if (ft->m.id >= first_new) return DDP_SUCCESS; /* a joiner itself dials (ddp__ft_join) */
    for (i = 0; i < ft->m.view.n; i++)
        if (ft->m.view.members[i] >= first_new && ft->peers[ft->m.view.members[i]].fd < 0) missing++;
    while (missing-- > 0 && r == DDP_SUCCESS)
        if ((r = ddp__ft_accept(ft, deadline, err)) != DDP_SUCCESS)
            r = ddp__fail(ft->g, r, "fault tolerance: a joiner's control connection: %s", err);
    return r;
}

/* A joiner's state, from the view's rank 0 (a member before the change: joiners have the highest ids):
   the step counters, then every ddp_ft_register'ed buffer, then their CRC-32Cs, which the joiners check.
   Collective over the view, in ddp_ft_begin: there every member has applied every committed step (a
   change inside ddp_ft_commit may commit a step the program applies after it), so the members' own
   buffers, which the broadcast rewrites, already hold what rank 0 sends. */
static ddp_result ddp__ft_transfer(ddp__ft *ft, ddp_ft_step *st, uint32_t first_new) {
    ddp_group *g = ft->g;
    uint64_t head[6], names = 1469598103934665603ull;
    uint32_t *crc = NULL;
    int i, joiner = ft->m.id >= first_new;
    ddp_result r = DDP_SUCCESS;
    double t0 = ddp__now();
    size_t total = 0;
    for (i = 0; i < ft->m.view.n && ft->m.view.members[i] < first_new; i++) {
    }
    if (i == ft->m.view.n) return DDP_SUCCESS; /* the joiners were lost again */
    if (ft->m.view.members[0] >= first_new)
        return ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: every member that held the state was lost; the "
                         "joiners have nothing to start from");
    for (i = 0; i < ft->nregs; i++) {
        const char *c;
        for (c = ft->regs[i].name; *c; c++) names = (names ^ (unsigned char)*c) * 1099511628211ull;
        names = (names ^ (uint64_t)ft->regs[i].bytes) * 1099511628211ull;
        total += ft->regs[i].bytes;
    }
    head[0] = DDP__FT_VIEW_MAGIC, head[1] = ft->gstep, head[2] = st->epoch, head[3] = st->step;
    head[4] = (uint64_t)ft->nregs, head[5] = names;
    if ((r = ddp_broadcast(g, head, 6, DDP_I64, 0)) != DDP_SUCCESS) return r;
    ddp__ft_kill_at(ft, "transfer"); /* DDP_FT_TEST_KILL: donor or joiner mid-transfer */
    if (joiner && (head[4] != (uint64_t)ft->nregs || head[5] != names))
        return ddp__fail(g, DDP_ERR_MISMATCH, "fault tolerance: this joiner registered other state than the members "
                         "(%llu buffers there, %d here, or other names or sizes): call ddp_ft_register with the same "
                         "names and sizes, in the same order, on every process", (unsigned long long)head[4], ft->nregs);
    if (!(crc = (uint32_t *)ddp__calloc((size_t)ft->nregs + 1, sizeof *crc)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "fault tolerance: out of memory");
    for (i = 0; i < ft->nregs && r == DDP_SUCCESS; i++) { /* (device memory: NCCL's, or staged; checked on a host copy) */
        char err[DDP__ERR_MAX];
        if ((r = ddp_broadcast(g, ft->regs[i].data, ft->regs[i].bytes, DDP_U8, 0)) == DDP_SUCCESS &&
            (r = ddp__crc32c_anywhere(ft->regs[i].data, ft->regs[i].bytes, ddp__group_stream(g), &crc[i], err)) != DDP_SUCCESS)
            r = ddp__fail(g, r, "fault tolerance: copying the state \"%s\" from device memory to check it: %s", ft->regs[i].name, err);
    }
    if (r == DDP_SUCCESS) {
        uint32_t *mine = (uint32_t *)ddp__calloc((size_t)ft->nregs + 1, sizeof *mine);
        if (!mine) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "fault tolerance: out of memory");
        if (mine) memcpy(mine, crc, (size_t)ft->nregs * sizeof *mine);
        if (r == DDP_SUCCESS) r = ddp_broadcast(g, crc, (size_t)ft->nregs, DDP_I32, 0); /* rank 0's */
        for (i = 0; r == DDP_SUCCESS && i < ft->nregs; i++)
            if (mine[i] != crc[i])
                r = ddp__fail(g, DDP_ERR_FORMAT, "fault tolerance: the state \"%s\" arrived with CRC-32C %08x, sent with "
                              "%08x", ft->regs[i].name, (unsigned)mine[i], (unsigned)crc[i]);
        ddp__free(mine);
    }
    ddp__free(crc);
    if (r != DDP_SUCCESS) return r;
    if (joiner) {
        st->epoch = head[2], st->step = head[3];
        ddp__log(g, DDP_LOG_WARN, "fault tolerance: admitted as member %u: %zu bytes of state in %d buffers, CRC-32C "
                 "checked, in %.1f ms; epoch %llu, step %llu", ft->m.id, total, ft->nregs, (ddp__now() - t0) * 1e3,
                 (unsigned long long)st->epoch, (unsigned long long)st->step);
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__ft_join_dial(ddp__ft *ft);
static ddp_result ddp__ft_read_record(ddp_group *g, ddp__ft_record **out, double deadline);
static void ddp__ft_learn(ddp__ft *ft, const ddp__ft_record *rec);

/* ---- a member left out of the view, or cut off from the majority, comes back as a joiner ----
   (FT.md G6: a partition healed, the minority rejoins; a member that was stopped and resumed does too.) It
   drops what it held of the job: the control connections, the view change's state, the view's store, and
   the data plane (a group of one from here on; nccl: a communicator of one). Its next ddp_ft_begin asks to
   be admitted as a new member, as a joiner that ddprun started would (new id, the members' state sent to
   it: its own is behind), for at most 10 x suspect_seconds (sooner when the view's first member refuses
   its connections for 5 s: the job has ended); if nobody admits it by then (the partition lasts, the job
   ended) that ddp_ft_begin fails with both reasons. Returns
   DDP_ERR_VIEW_CHANGED: the step is void here (ddp_ft_begin goes on to the rejoin itself). */
static ddp_result ddp__ft_rejoin(ddp__ft *ft, const char *why) {
    ddp_group *g = ft->g, *v = NULL;
    uint32_t i;
    ddp_result r;
    for (i = 0; i < ft->cap; i++) {
        if (ft->peers[i].fd >= 0) close(ft->peers[i].fd);
        ft->peers[i].fd = -1, ft->peers[i].hung_up = 0, ft->peers[i].have = 0;
    }
    ddp__store_free(ft->store);
    ft->store = NULL;
    ft->store_of = DDP__FT_NONE;
    ft->pending = ft->admit = 0;
    ft->transfer_from = ft->join_via = DDP__FT_NONE;
    ft->join_gen = 0, ft->join_refused = 0;
    ft->plane_n = 0; /* nothing in common with the view that admits it: nccl makes its communicator anew */
    g->ft_running = 0;
    ddp__drain(g);
    if ((r = ddp__group_open_view(g, 0, 1, NULL, "ft/alone/", g->timeout, NULL, NULL, &v)) == DDP_SUCCESS &&
        (r = ddp__nccl_renew(g, v, NULL, 0, 1)) != DDP_SUCCESS)
        ddp__group_free(v);
    if (r != DDP_SUCCESS)
        return ddp__fail(g, r, "fault tolerance: %s; this member could not drop to a group of one to rejoin: %s", why, g->error);
    ddp__group_adopt(g, v);
    g->ft_join = 1;
    snprintf(ft->rejoin_why, sizeof ft->rejoin_why, "%s", why);
    ddp__log(g, DDP_LOG_WARN, "fault tolerance: %s; this process asks to be admitted again as a new member", why);
    return ddp__fail(g, DDP_ERR_VIEW_CHANGED, "fault tolerance: %s; this process rejoins the job as a new member at its "
                     "next ddp_ft_begin (redo the step there)", why);
}

/* Run a view change to its end: the decree acted on and the new view's data plane adopted (joiners met
   and given the state). st->step moves on when it committed the step here (*applied: 0 or 1). Fails only
   when this member cannot go on: left out of the view, too few members left (min_world_size), or no
   quorum within max(the group's timeout, 10 x suspect_seconds). */
static ddp_result ddp__ft_change(ddp__ft *ft, ddp_ft_step *st, int *applied) {
    ddp_group *g = ft->g;
    uint64_t step0 = ft->gstep;
    uint32_t first_new = ft->m.joiner ? ft->m.id : ft->m.view.next_id; /* ids from here on: joiners it admits */
    double t0 = ddp__now(), next_timeout, limit = DDP__MAX(g->timeout, 10 * g->ft_suspect);
    char members[256];
    int i, admitted;
    ddp_result r;
    *applied = 0;
    if (g->rank == 0 && ft->pending && !ft->m.joiner) ddp__ft_admit(&ft->m, ft->pending); /* it gave them ids */
    ddp__drain(g);
    if (!g->broken && g->world_size > 1)
        ddp__group_break(g, DDP_ERR_VIEW_CHANGED, "fault tolerance: this member entered a view change");
    for (;;) {
        ft->acted = 0;
        r = ddp__ft_data_failed(&ft->m);
        next_timeout = ddp__now() + g->ft_suspect * (ddp__ft_coordinator(&ft->m.view, ft->m.dead, ft->m.suspected) == ft->m.id ? 1 : 2);
        while (r == DDP_SUCCESS && !ft->acted) {
            double now;
            if ((r = ddp__ft_pump(ft, 20)) != DDP_SUCCESS || ft->acted) break;
            if (ft->m.joiner && ft->join_via < ft->cap && ft->peers[ft->join_via].fd < 0)
                return ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: member %u, which this joiner asked to be "
                                 "admitted, closed the connection (lost, or it passed the joiner over)", ft->join_via);
            now = ddp__now();
            if (now >= next_timeout) {
                r = ddp__ft_timeout(&ft->m);
                next_timeout = now + g->ft_suspect *
                                         (ddp__ft_coordinator(&ft->m.view, ft->m.dead, ft->m.suspected) == ft->m.id ? 1 : 2);
            }
            if (r == DDP_SUCCESS && now - t0 > limit) {
                char why[160];
                snprintf(why, sizeof why, "no view with a quorum of the members formed within %g s: this member is cut "
                         "off from the majority, or too many were lost", limit);
                if (!ft->m.joiner) return ddp__ft_rejoin(ft, why); /* (a joiner's own loop asks again) */
                g->ft_running = 0;
                r = ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: %s", why);
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
            char why[160];
            snprintf(why, sizeof why, "the other members formed view %llu without this one (they lost it)",
                     (unsigned long long)ft->m.view.gen);
            return ddp__ft_rejoin(ft, why);
        }
        if (ft->m.view.n < g->ft_min_world) {
            g->ft_running = 0; /* the end here: plain errors from now on */
            return ddp__fail(g, DDP_ERR_PEER_LOST, "fault tolerance: %d member%s left (%s), fewer than min_world_size %d",
                             ft->m.view.n, ft->m.view.n == 1 ? "" : "s", ddp__ft_members_text(&ft->m.view, members, sizeof members),
                             g->ft_min_world);
        }
        if (ft->m.changing) continue;
        for (admitted = 0, i = 0; i < ft->m.view.n; i++) admitted += ft->m.view.members[i] >= first_new;
        if (admitted && ft->m.id >= first_new && (r = ddp__ft_join_dial(ft)) != DDP_SUCCESS) return r;
        if ((!admitted || (r = ddp__ft_meet_joiners(ft, first_new)) == DDP_SUCCESS) && (r = ddp__ft_rebuild(ft)) == DDP_SUCCESS)
            break;
        if (ft->m.id >= first_new) return r; /* a joiner that failed to come in: its caller may try again */
        ddp__log(g, DDP_LOG_WARN, "fault tolerance: view %llu's data plane failed to form (%s); changing the view again",
                 (unsigned long long)ft->m.view.gen, g->error);
        ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_RUNNING);
    }
    if (ft->m.id < first_new) st->step += (uint64_t)*applied;
    for (i = 0; i < ft->pending; i++) { /* joiners it gave ids to and the decree passed over: they ask again */
        uint32_t id = first_new + (uint32_t)i;
        if (id < ft->cap && ddp__ft_rank_of(&ft->m.view, id) < 0 && ft->peers[id].fd >= 0) {
            close(ft->peers[id].fd);
            ft->peers[id].fd = -1;
        }
    }
    ft->pending = 0;
    for (admitted = 0, i = 0; i < ft->m.view.n; i++) admitted += ft->m.view.members[i] >= first_new;
    if (admitted && (ft->transfer_from == DDP__FT_NONE || first_new < ft->transfer_from)) ft->transfer_from = first_new;
    ft->changes++;
    ft->change_seconds = ddp__now() - t0;
    ddp__ft_publish(ft);
    ddp__log(g, DDP_LOG_WARN, "fault tolerance: view %llu: members %s (this one rank %d of %d); step %llu %s; %.1f ms",
             (unsigned long long)ft->m.view.gen, ddp__ft_members_text(&ft->m.view, members, sizeof members), g->rank,
             g->world_size, (unsigned long long)ft->m.made.step, ft->m.made.verdict == DDP__FT_COMMIT ? "committed" : "redone",
             ft->change_seconds * 1e3);
    return DDP_SUCCESS;
}

/* ---- a joiner ---- */

/* After the GO that admitted it: a control connection to every other member of the view. */
static ddp_result ddp__ft_join_dial(ddp__ft *ft) {
    char err[DDP__ERR_MAX];
    double deadline = ddp__now() + DDP__MAX(2 * ft->g->ft_suspect, 1.0);
    int i, unknown = 0;
    for (i = 0; i < ft->m.view.n; i++) unknown += ft->m.view.members[i] != ft->m.id && !ft->peers[ft->m.view.members[i]].ctl_port;
    if (unknown) { /* admitted after the record it read (a joiner admitted meanwhile): the record is newer now */
        ddp__ft_record *rec = NULL;
        if (ddp__ft_read_record(ft->g, &rec, deadline) == DDP_SUCCESS) ddp__ft_learn(ft, rec);
        ddp__free(rec);
    }
    for (i = 0; i < ft->m.view.n; i++) {
        uint32_t id = ft->m.view.members[i];
        if (id == ft->m.id || ft->peers[id].fd >= 0) continue;
        if (ddp__ft_dial(ft, id, DDP__FT_HELLO_MAGIC, deadline, err) != DDP_SUCCESS)
            return ddp__fail(ft->g, DDP_ERR_PEER_LOST, "fault tolerance: this joiner could not reach member %u (%s:%d): %s",
                             id, ft->peers[id].addr, ft->peers[id].ctl_port, err);
    }
    return DDP_SUCCESS;
}

/* Where the members of a view record listen. */
static void ddp__ft_learn(ddp__ft *ft, const ddp__ft_record *rec) {
    const ddp__ft_addr *list = (const ddp__ft_addr *)(rec + 1);
    uint32_t i;
    for (i = 0; i < rec->n; i++)
        if (list[i].id < ft->cap) {
            memcpy(ft->peers[list[i].id].addr, list[i].addr, sizeof list[i].addr);
            ft->peers[list[i].id].addr[sizeof list[i].addr - 1] = 0;
            ft->peers[list[i].id].ctl_port = list[i].ctl_port;
            ft->peers[list[i].id].store_port = list[i].store_port;
        }
}

/* The job's view record from the program's store (a joiner's first step). */
static ddp_result ddp__ft_read_record(ddp_group *g, ddp__ft_record **out, double deadline) {
    const char *key = "ddp_ft/view";
    size_t cap = 1 << 20, size = 0;
    ddp__ft_record *rec = (ddp__ft_record *)ddp__malloc(cap);
    ddp_result r;
    *out = NULL;
    if (!rec) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_ft_begin: out of memory");
    r = ddp_store_wait(g->member.store, &key, 1, DDP__MAX(deadline - ddp__now(), 0.1));
    if (r == DDP_SUCCESS) r = ddp_store_get(g->member.store, key, rec, cap, &size);
    if (r == DDP_SUCCESS && (size < sizeof *rec || rec->magic != DDP__FT_VIEW_MAGIC ||
                             size != sizeof *rec + (size_t)rec->n * sizeof(ddp__ft_addr) || rec->n == 0 || rec->cap == 0))
        r = ddp__fail(g, DDP_ERR_FORMAT, "ddp_ft_begin: the job's view record in the store is malformed");
    else if (r != DDP_SUCCESS)
        r = ddp__fail(g, r, "ddp_ft_begin: this joiner found no fault-tolerant job's view in the store: %s (is the job "
                      "running in fault-tolerant mode, and is its store still up?)", ddp_store_last_error(g->member.store));
    if (r != DDP_SUCCESS) {
        ddp__free(rec);
        return r;
    }
    *out = rec;
    return DDP_SUCCESS;
}

/* One attempt of a joiner: find the view's first member through the store, ask it for an id, wait in the
   view change that admits it (the members start it after the vote that counts it), meet the other
   members, build the data plane, receive the state. *again: the attempt failed in a way worth another. */
static ddp_result ddp__ft_join_once(ddp__ft *ft, ddp_ft_step *st, double deadline, int *again) {
    ddp_group *g = ft->g;
    ddp__ft_record *rec = NULL;
    ddp__ft_addr *list;
    char err[DDP__ERR_MAX];
    uint32_t welcome[4], i, first;
    uint64_t gen;
    int applied;
    ddp_result r;
    *again = 0;
    if ((r = ddp__ft_read_record(g, &rec, deadline)) != DDP_SUCCESS) {
        *again = ft->rejoin_why[0] != 0; /* a member rejoining: the store may be across a partition that heals */
        return r;
    }
    if (!ft->cap && (r = ddp__ft_arrays(ft, rec->cap)) != DDP_SUCCESS) {
        ddp__free(rec);
        return ddp__fail(g, r, "ddp_ft_begin: out of memory");
    }
    if (ft->listen_fd < 0 && (r = ddp__ft_listen(ft, &ft->me, err)) != DDP_SUCCESS) {
        ddp__free(rec);
        return ddp__fail(g, r, "ddp_ft_begin: this joiner cannot listen: %s", err);
    }
    ft->hash = rec->hash;
    list = (ddp__ft_addr *)(rec + 1);
    ddp__ft_learn(ft, rec);
    first = list[0].id;
    gen = rec->gen;
    ddp__free(rec);
    for (i = 0; i < ft->cap; i++) /* a connection left from an attempt before */
        if (ft->peers[i].fd >= 0) close(ft->peers[i].fd), ft->peers[i].fd = -1;
    /* ask the view's first member for an id (the hello carries this joiner's listener) */
    ddp__ft_member_free(&ft->m);
    ft->m.id = DDP__FT_NONE;
    /* briefly: a record written before a view change may name a member lost since (the next one will not) */
    r = first < ft->cap ? ddp__ft_dial(ft, first, DDP__FT_JOIN_MAGIC, DDP__MIN(deadline, ddp__now() + 0.2), err)
                        : DDP_ERR_FORMAT;
    if (r != DDP_SUCCESS && r != DDP_ERR_FORMAT && gen == ft->join_gen && ++ft->join_refused >= 25) {
        *again = 0; /* 25 tries over 5 s, the same view's first member away: the job has ended */
        return ddp__fail(g, DDP_ERR_PEER_LOST, "ddp_ft_begin: this joiner found no member of the job answering (member "
                         "%u of view %llu refused for 5 s): the job has ended, or its members are unreachable from here",
                         first, (unsigned long long)gen);
    }
    if (gen != ft->join_gen) ft->join_gen = gen, ft->join_refused = 0;
    if (r == DDP_SUCCESS) r = ddp__net_recv(ft->peers[first].fd, welcome, sizeof welcome, deadline, err);
    if (r == DDP_SUCCESS && (welcome[0] != DDP__FT_JOIN_MAGIC || welcome[1] >= ft->cap)) r = DDP_ERR_FORMAT;
    if (r != DDP_SUCCESS) {
        *again = 1; /* the record named a member lost since: the next record names another */
        return ddp__fail(g, DDP_ERR_PEER_LOST, "ddp_ft_begin: this joiner could not ask member %u to be admitted: %s",
                         first, r == DDP_ERR_FORMAT ? "a malformed answer" : err);
    }
    if ((r = ddp__ft_member_init(&ft->m, welcome[1], 0, ft->cap, ddp__ft_send, ddp__ft_act, ft)) != DDP_SUCCESS)
        return ddp__fail(g, r, "ddp_ft_begin: out of memory");
    ft->join_via = first;
    ddp__log(g, DDP_LOG_INFO, "fault tolerance: member %u gave this joiner id %u; waiting to be admitted", first, welcome[1]);
    g->ft_running = 1; /* its view change is the members' next */
    r = ddp__ft_change(ft, st, &applied);
    while (r == DDP_SUCCESS) { /* admitted; a member lost during the transfer: the next view sends it again */
        r = ddp__ft_transfer(ft, st, ft->m.id);
        if (r != DDP_ERR_VIEW_CHANGED) break;
        r = ddp__ft_change(ft, st, &applied);
    }
    if (r == DDP_SUCCESS) ft->transfer_from = DDP__FT_NONE;
    if (r != DDP_SUCCESS) {
        g->ft_running = 0;
        *again = ft->m.joiner; /* not admitted yet: ask again */
    }
    return r;
}

/* A joiner's first ddp_ft_begin (or a member's that rejoins): attempts until one admits it, or the group's
   timeout passes (a member rejoining: 10 x suspect_seconds, as long as the view change waits for a quorum). */
static ddp_result ddp__ft_join(ddp_group *g, ddp_ft_step *st) {
    ddp__ft *ft = ddp__ft_state(g);
    double patience, deadline;
    int again = 1;
    ddp_result r = DDP_ERR_TIMEOUT;
    if (!ft) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_ft_begin: out of memory");
    patience = ft->rejoin_why[0] ? 10 * g->ft_suspect : g->timeout;
    deadline = ddp__now() + patience;
    while (again && ddp__now() < deadline) {
        if ((r = ddp__ft_join_once(ft, st, deadline, &again)) == DDP_SUCCESS) {
            if (ft->rejoin_why[0])
                ddp__log(g, DDP_LOG_WARN, "fault tolerance: rejoined as member %u (rank %d of %d) after: %s", ft->m.id, g->rank,
                         g->world_size, ft->rejoin_why);
            ft->rejoin_why[0] = 0;
            g->ft_join = 0;
            return DDP_SUCCESS;
        }
        if (again) {
            ddp__log(g, DDP_LOG_INFO, "fault tolerance: %s; asking again", g->error);
            ddp__sleep(ft->rejoin_why[0] ? 0.2 : 0.05);
        }
    }
    if (ft->rejoin_why[0]) {
        char cause[DDP__ERR_MAX];
        snprintf(cause, sizeof cause, "%s", g->error);
        r = ddp__fail(g, r == DDP_ERR_VIEW_CHANGED ? DDP_ERR_PEER_LOST : r, "fault tolerance: %s; rejoining the job "
                      "failed within %g s: %.700s", ft->rejoin_why, patience, cause);
    }
    return r;
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

static void ddp__ft_fill(ddp__ft *ft, ddp_ft_step *st, int joined) {
    st->gen = ft->m.view.gen;
    st->rank = ft->g->rank;
    st->world_size = ft->g->world_size;
    st->joined = joined;
}

DDP_API ddp_result ddp_ft_register(ddp_group *g, const char *name, void *data, size_t bytes) {
    ddp_result r = ddp__group_check(g, "ddp_ft_register");
    ddp__ft *ft;
    int i;
    if (r) return r;
    if (!g->ft_mode)
        return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_register: fault tolerance is off; set ddp_init_desc.fault_tolerant = 1 or DDP_FT=1");
    if (!name || !*name || strlen(name) >= sizeof ft->regs->name || (!data && bytes))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_ft_register: give a name of 1-63 bytes and the buffer (NULL only "
                         "with 0 bytes)");
    if (g->ft_running || (g->ft && g->ft->cap))
        return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_register(\"%s\"): register the state before the first ddp_ft_begin", name);
    if (!(ft = ddp__ft_state(g))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_ft_register: out of memory");
    for (i = 0; i < ft->nregs; i++)
        if (strcmp(ft->regs[i].name, name) == 0)
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_ft_register: \"%s\" is registered already", name);
    if (ft->nregs == ft->regs_cap) {
        int cap = ft->regs_cap ? 2 * ft->regs_cap : 16;
        ddp__ft_reg *more = (ddp__ft_reg *)DDP_REALLOC(ft->regs, (size_t)cap * sizeof *more);
        if (!more) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_ft_register: out of memory");
        ft->regs = more, ft->regs_cap = cap;
    }
    snprintf(ft->regs[ft->nregs].name, sizeof ft->regs[ft->nregs].name, "%s", name);
    ft->regs[ft->nregs].data = data;
    ft->regs[ft->nregs].bytes = bytes;
    ft->nregs++;
    return DDP_SUCCESS;
}

/* ddp_ft_begin of a member: the view change when one is due, joiners' state, the step begins. */
static ddp_result ddp__ft_begin_member(ddp_group *g, ddp_ft_step *st) {
    int applied = 0;
    ddp__ft *ft;
    ddp_result r;
    if (!g->ft_running && g->ft && g->ft->cap)
        return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_begin: fault tolerance failed on this group (an earlier call said why); "
                         "destroy the group");
    if (!g->ft_running && (r = ddp__ft_start(g)) != DDP_SUCCESS) return r;
    ft = g->ft;
    ddp__ft_kill_at(ft, "begin");
    ddp__drain(g); /* the progress thread's last work (the reducer's timing) may still break the group */
    if (ft->admit > 0 && !g->broken) ddp__ft_admit(&ft->m, ft->admit); /* the vote counted joiners: admit them now */
    for (;;) {
        if ((g->broken || ft->admit > 0) && (r = ddp__ft_change(ft, st, &applied)) != DDP_SUCCESS) return r;
        ft->admit = 0;
        if (ft->transfer_from == DDP__FT_NONE) break;
        r = ddp__ft_transfer(ft, st, ft->transfer_from); /* every committed step applied here: joiners' state */
        if (r == DDP_SUCCESS) ft->transfer_from = DDP__FT_NONE;
        else if (r != DDP_ERR_VIEW_CHANGED) return r;
    }
    ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_RUNNING);
    ddp__ft_fill(ft, st, 0);
    return DDP_SUCCESS;
}

/* While fault tolerance runs, a collective gives up on a peer silent for suspect_seconds (FT.md 2.3, "no
   progress for suspect_seconds = suspected"), not the group's timeout: a stopped member or a cut link then
   starts the view change after suspect_seconds, and the coordinator waits at most as long again for the
   reports (ddp__ft_change). Once it stops (the job's end, a failure), the timeout again. */
static ddp_result ddp__ft_quiet(ddp_group *g, ddp_result r) {
    ddp__group_set_quiet(g, g->ft_running ? g->ft_suspect : 0);
    return r;
}

static ddp_result ddp__ft_begin_checked(ddp_group *g, ddp_ft_step *st) {
    ddp_result r;
    if (!g->ft_join) { /* a member; left out or cut off in a view change here, it rejoins at once (below) */
        r = ddp__ft_begin_member(g, st);
        if (r != DDP_ERR_VIEW_CHANGED || !g->ft_join) return r;
    }
    if ((r = ddp__ft_join(g, st)) != DDP_SUCCESS) return r;
    ddp__ft_fill(g->ft, st, 1);
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_ft_begin(ddp_group *g, ddp_ft_step *st) {
    ddp_result r = ddp__ft_check(g, st, "ddp_ft_begin");
    return r ? r : ddp__ft_quiet(g, ddp__ft_begin_checked(g, st));
}

static ddp_result ddp__ft_commit_checked(ddp_group *g, ddp_ft_step *st) {
    int64_t vote[2];
    int applied = 0;
    ddp__ft *ft;
    ddp_result r;
    if (!(ft = g->ft) || !g->ft_running) return ddp__fail(g, DDP_ERR_STATE, "ddp_ft_commit: call ddp_ft_begin first");
    ddp__ft_kill_at(ft, "vote");
    ddp__drain(g); /* (g->broken is the progress thread's to write while it runs) */
    if (!g->broken) { /* the step's reduction finished here: COMPLETE, then the vote {finished, -joiners waiting} */
        ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_COMPLETE);
        ddp__ft_intake(ft);
        vote[0] = 1, vote[1] = -(int64_t)ft->pending;
        r = ddp_all_reduce(g, vote, 2, DDP_I64, DDP_MIN);
        if (r == DDP_SUCCESS) {
            ft->gstep++;
            ft->admit = (int)-vote[1];
            ddp__ft_set_step(&ft->m, ft->gstep, DDP__FT_RUNNING);
            st->step++;
            return DDP_SUCCESS;
        }
        if (r != DDP_ERR_VIEW_CHANGED) return r;
    }
    if ((r = ddp__ft_change(ft, st, &applied)) != DDP_SUCCESS) return r;
    ddp__ft_fill(ft, st, 0);
    if (applied) return DDP_SUCCESS;
    return ddp__fail(g, DDP_ERR_VIEW_CHANGED, "ddp_ft_commit: the view changed (view %llu, %d member%s) before every member "
                     "finished the step; redo it: call ddp_ft_begin and run step %llu again", (unsigned long long)st->gen,
                     st->world_size, st->world_size == 1 ? "" : "s", (unsigned long long)st->step);
}

DDP_API ddp_result ddp_ft_commit(ddp_group *g, ddp_ft_step *st) {
    ddp_result r = ddp__ft_check(g, st, "ddp_ft_commit");
    return r ? r : ddp__ft_quiet(g, ddp__ft_commit_checked(g, st));
}

/* A kill point inside another layer (the reducer's "bucket"), for DDP_FT_TEST_KILL. */
static void ddp__ft_test_kill(ddp_group *g, const char *point) {
    if (g && g->ft) ddp__ft_kill_at(g->ft, point);
}
