/* [SECTION] group: ddp_init (torch.distributed.init_process_group), the mesh of connections, which
   backend a group gets, subgroups (new_group), ddp_destroy

   ddp_init in five steps:
     1. who am I: rank and world size from the descriptor or the launcher's environment
        (ddp__read_launch: torchrun/ddprun, Open MPI, MPICH/Hydra, SLURM, in that order);
     2. where is the master: init_method, descriptor, MASTER_ADDR/MASTER_PORT, launcher defaults;
     3. the store: rank 0 serves it (store.c) and every rank connects (or a file store);
     4. rendezvous (ddp__rendezvous): each rank claims its rank by publishing "world size, address,
        port, pid, host", rank 0 gathers the records and publishes them as one table,
        every other rank waits for that table once: O(1) store requests per rank (see "the table of
        records" below); any disagreement is published (an "abort" key, and as the table's value) and
        wakes every waiting rank, so a bad rank fails everyone quickly instead of leaving them to time out;
     5. the mesh: one TCP connection per pair of ranks, then a barrier over it.
   Steps 1 and 2 are launch_env.c's, step 4 is rendezvous.c's; this file strings them together. */
#include "internal.h"


/* ---- group life cycle ---- */

static ddp_group *ddp__group_alloc(int rank, int world_size) {
    ddp_group *g = (ddp_group *)ddp__calloc(1, sizeof *g);
    int i;
    if (!g) return NULL;
    pthread_mutex_init(&g->async.mu, NULL);
    pthread_mutex_init(&g->mesh.p2p_mu, NULL);
    pthread_cond_init(&g->async.cv, NULL);
    g->rank = rank;
    g->mesh.waiting_for = -1;
    g->world_size = world_size;
    g->local_rank = g->local_world_size = -1;
    g->backend = g->host_backend = ddp__initial_backend(world_size);
    g->timeout = 300.0;
    g->mesh.peers = (ddp__peer *)ddp__calloc((size_t)world_size, sizeof *g->mesh.peers);
    g->mesh.linked = (int *)ddp__calloc((size_t)world_size, sizeof *g->mesh.linked);
    g->mesh.shakes = (ddp__shake *)ddp__calloc(DDP__SHAKES_MAX, sizeof *g->mesh.shakes);
    g->mesh.listen_fd = -1;
    g->mesh.pollfds = (struct pollfd *)ddp__calloc((size_t)world_size + DDP__SHAKES_MAX + 1, sizeof *g->mesh.pollfds);
    g->mesh.poll_owner = (int *)ddp__calloc((size_t)world_size + DDP__SHAKES_MAX + 1, sizeof *g->mesh.poll_owner);
    g->world_ranks = (int *)ddp__calloc((size_t)world_size, sizeof *g->world_ranks);
    if (!g->mesh.peers || !g->mesh.linked || !g->mesh.shakes || !g->mesh.pollfds || !g->mesh.poll_owner || !g->world_ranks ||
        !ddp__live_add(g, DDP__LIVE_GROUP)) {
        ddp__group_free(g);
        return NULL;
    }
    for (i = 0; i < world_size; i++) {
        g->mesh.peers[i].fd = -1;
        g->world_ranks[i] = i;
    }
    ddp__trace_open(g);
    return g;
}

/* The hierarchical all_reduce's stage groups (hier.c), for a group whose ranks are not all on one host
   (keys: every rank's host key): opened when some host has several ranks, and the hier backend installed.
   Collective over the mesh: every rank derives the same host map. */
static ddp_result ddp__hier_open(ddp_group *g, const uint64_t *keys) {
    const char *what = "setting up the hierarchical all_reduce";
    char name[32];
    ddp__hier_map m;
    ddp_result r = DDP_SUCCESS;
    int shared = ddp__hier_plan(keys, g->world_size, g->rank, &m);
    if (shared < 0) r = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory mapping the group's hosts");
    if (shared > 0) {
        snprintf(name, sizeof name, "host%d", m.host[0]);
        if (m.nhost > 1) r = ddp__subgroup_open(g, m.host, m.nhost, m.my_index, name, NULL, what, &g->hier.host);
        if (r == DDP_SUCCESS && m.host[0] == g->rank)
            r = ddp__subgroup_open(g, m.leaders, m.nlead, m.lead_index, "leaders", NULL, what, &g->hier.leaders);
        if (r == DDP_SUCCESS) ddp__hier_install(g, m.nlead);
    }
    ddp__free(m.host);
    ddp__free(m.leaders);
    return r;
}

/* The end of a group: its stage groups go first (ddp_destroy after the group's own barrier: every rank
   is there, so their barriers meet), or are just freed when the group is failing. */
static void ddp__hier_stages_end(ddp_group *g, int orderly) {
    ddp_group *stages[2];
    int i;
    stages[0] = g->hier.host;
    stages[1] = g->hier.leaders;
    g->hier.host = g->hier.leaders = NULL;
    for (i = 0; i < 2; i++) {
        if (!stages[i]) continue;
        if (orderly) ddp_destroy(stages[i]);
        else ddp__group_free(stages[i]);
    }
}

/* Free everything g holds (connections closed without goodbye: for failed inits and after goodbye).
   Also frees a group whose allocation stopped half way (its arrays may be NULL). */
static void ddp__group_free(ddp_group *g) {
    ddp__live_remove(g, DDP__LIVE_GROUP); /* from here on, calls on g fail instead of reading freed memory */
    ddp__progress_stop(g);
    if (g->ft_end) g->ft_end(g); /* fault tolerance's control connections and store (ft.c) */
    if (g->end_upper) g->end_upper(g); /* an async checkpoint save: before its work handle is released */
    ddp__work_release_all(g);
    ddp__hier_stages_end(g, 0);
    if (g->backend) g->backend->close(g, 0);
    if (g->broken) ddp__close_after_failure(g, 1.0);
    ddp__lib_free_all(g);
    if (g->mesh.shakes) ddp__link_close_all(g);
    if (g->member.owns_store && g->member.store) ddp__store_free(g->member.store);
    if (g->member.store_server) ddp__store_server_stop(g->member.store_server);
    if (g->member.parent) ddp__subgroup_unlink(g->member.parent, g);
    ddp__trace_close(g);
    pthread_mutex_destroy(&g->async.mu);
    pthread_mutex_destroy(&g->mesh.p2p_mu);
    pthread_cond_destroy(&g->async.cv);
    ddp__free(g->scratch);
    ddp__devbuf_free(g);
    ddp__p2p_stash_free(g);
    ddp__free(g->mesh.peers);
    ddp__free(g->mesh.linked);
    ddp__free(g->mesh.shakes);
    ddp__free(g->mesh.dir);
    ddp__free(g->mesh.names);
    ddp__free(g->mesh.pollfds);
    ddp__free(g->mesh.poll_owner);
    ddp__free(g->world_ranks);
    ddp__free(g);
}

/* Which transport carries the group's collectives, decided alike on every rank from what every rank
   sends in one all_gather over the mesh: its host key and whether DDP_TRANSPORT=tcp is set on it. Any
   rank asking for tcp keeps the whole group on the mesh (as DDP_SHM_CMA=0 on one rank turns
   cross-memory attach off for all): a rank that skipped the exchange would meet the others' next
   collective instead, and every rank would fail without naming the cause. Otherwise: all ranks on one
   host -> shared memory (shm.c); several hosts with several ranks on some -> the hierarchical
   all_reduce (hier.c); else the mesh itself (tcp.c). */
#define DDP__WISH_BAD 2 /* DDP_TRANSPORT set to something else than auto or tcp */
static int ddp__transport_wish(void) {
    const char *transport = ddp__env("DDP_TRANSPORT");
    if (!transport || strcmp(transport, "auto") == 0) return 0;
    return strcmp(transport, "tcp") == 0 ? 1 : DDP__WISH_BAD;
}

/* The message names the rank (g NULL: a single process): it may be the one every rank reports, when
   this rank's error reaches the store first (ddp__rdzv_fail_all). */
static ddp_result ddp__bad_transport(ddp_group *g) {
    char name[DDP__PEER_NAME_MAX];
    if (!g) return ddp__fail(NULL, DDP_ERR_INIT, "DDP_TRANSPORT=\"%s\" is not one of auto, tcp; fix or unset it",
                             ddp__env("DDP_TRANSPORT"));
    return ddp__fail(g, DDP_ERR_INIT, "DDP_TRANSPORT=\"%s\" on rank %d (%s) is not one of auto, tcp; fix or unset it there",
                     ddp__env("DDP_TRANSPORT"), g->rank, ddp__peer_name(g, g->rank, name, sizeof name));
}

static ddp_result ddp__choose_transport(ddp_group *g) {
    uint64_t mine[2], *all, *keys;
    char name[DDP__PEER_NAME_MAX];
    int i, same = 1, tcp_rank = -1, tcp_ranks = 0, bad_rank = -1;
    ddp_result r;
    if (g->world_size < 2) return DDP_SUCCESS;
    mine[0] = ddp__host_key();
    mine[1] = (uint64_t)ddp__transport_wish();
    all = (uint64_t *)ddp__calloc((size_t)g->world_size, 3 * sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory mapping the group's hosts");
    keys = all + 2 * (size_t)g->world_size;
    r = ddp__mesh_all_gather(g, mine, all, 2, DDP_I64);
    for (i = 0; i < g->world_size && r == DDP_SUCCESS; i++) {
        keys[i] = all[2 * i];
        same &= keys[i] == mine[0];
        if (all[2 * i + 1] == DDP__WISH_BAD && bad_rank < 0) bad_rank = i;
        if (all[2 * i + 1] == 1) {
            if (tcp_rank < 0) tcp_rank = i;
            tcp_ranks++;
        }
    }
    /* The rank that set it names the value even when the gather failed: a rank that finished the gather
       first (Bruck's all_gather finishes ranks in any order) may already have failed with the message
       below, which names this rank, and hung up while this one still waited for another rank's frame. */
    if (mine[1] == DDP__WISH_BAD && r != DDP_SUCCESS) r = ddp__bad_transport(g);
    if (r == DDP_SUCCESS && bad_rank >= 0) { /* every rank fails, naming the rank that set it */
        if (mine[1] == DDP__WISH_BAD) ddp__bad_transport(g);
        else ddp__fail(g, DDP_ERR_INIT, "DDP_TRANSPORT on rank %d (%s) is not one of auto, tcp (that rank's message "
                       "names the value); fix or unset it there", bad_rank, ddp__peer_name(g, bad_rank, name, sizeof name));
        r = DDP_ERR_INIT;
    } else if (r == DDP_SUCCESS && tcp_rank >= 0) {
        if (!mine[1])
            ddp__log(g, DDP_LOG_INFO, "DDP_TRANSPORT=tcp is set on rank %d (%s)%s: the whole group stays on TCP", tcp_rank,
                     ddp__peer_name(g, tcp_rank, name, sizeof name), tcp_ranks > 1 ? " and others" : "");
    } else if (r == DDP_SUCCESS) {
        r = same ? ddp__shm_setup(g) : ddp__hier_open(g, keys);
    }
    ddp__free(all);
    return r;
}

/* The set-up's hooks (ddp__setup_hooks in internal.h): defined below, lent to the mesh by ddp__group_connect. */
static ddp_result ddp__setup_watch(ddp_group *g, int peer);
static ddp_result ddp__setup_lost(ddp_group *g, int peer, const char *how);
static const ddp__setup_hooks ddp__setup_hooks_of_init = {ddp__setup_watch, ddp__setup_lost};

/* Rendezvous and connect a freshly allocated group whose store and prefix are set: after the table,
   the group's own barrier makes the first connections (link.c: the ring and the ranks 2^k away), and
   the set-up's collectives run with the set-up's hooks lent to the mesh, so that a rank lost on the way
   is also looked for in the store (ddp__setup_watch). The listening socket stays open for the group's
   life. */
static ddp_result ddp__group_connect(ddp_group *g, const char *where) {
    char err[DDP__ERR_MAX];
    int port = 0, aborted = 0;
    ddp_result r;
    if ((r = ddp__net_listen(g->member.address, 0, &g->mesh.listen_fd, &port, err)) != DDP_SUCCESS)
        return ddp__fail(g, r, "cannot listen for peer connections on %s: %s", g->member.address, err);
    r = ddp__rendezvous(g, g->member.address, port, where);
    if (r) {
        ddp__rdzv_publish(g, r); /* before its listener closes: a rank that then loses this one finds why */
        return r;
    }
    g->mesh.setup = &ddp__setup_hooks_of_init;
    if ((r = ddp__mesh_barrier(g)) == DDP_SUCCESS && (r = ddp__choose_transport(g)) == DDP_SUCCESS &&
        (r = ddp__rdzv_check_abort(g, &aborted)) == DDP_SUCCESS && aborted)
        r = DDP_ERR_INIT;
    g->mesh.setup = NULL;
    return r;
}

/* ---- fault tolerance's views (ft.c): a view's data plane is a fresh group, then the program's ----
   After a view change the members build the new view's data plane as a group of their own (rank = index
   in the view), through the store of the view's first member under the prefix "ft/<gen>/", exactly as
   ddp_init connects one: listener, rendezvous, mesh, backend (shm, tcp, hier). Then the program's handle
   takes it over (ddp__group_adopt): the old data plane (connections, segment, stage groups) goes, and
   the handle keeps what the program holds: its store, its ddp_alloc blocks (heap memory in FT mode), the
   progress thread and its work handles, the flight recorder, the device staging, the view change's state. */
static ddp_result ddp__group_open_view(ddp_group *g, int rank, int n, ddp_store *store, const char *prefix,
                                       double timeout, int (*gone)(void *arg), void *gone_arg, ddp_group **out) {
    char where[160];
    ddp_group *v;
    ddp_result r;
    *out = NULL;
    if (!(v = ddp__group_alloc(rank, n))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory opening the new view");
    v->timeout = timeout;
    v->log_level = g->log_level;
    v->log_fn = g->log_fn;
    v->log_user = g->log_user;
    v->ft_mode = 1;
    v->member.store = store;
    v->member.gone = gone, v->member.gone_arg = gone_arg;
    memcpy(v->member.address, g->member.address, sizeof v->member.address);
    snprintf(v->member.prefix, sizeof v->member.prefix, "%s", prefix);
    snprintf(where, sizeof where, "the view's store (%s)", prefix);
    r = n > 1 ? ddp__group_connect(v, where) : DDP_SUCCESS;
    v->member.gone = NULL, v->member.gone_arg = NULL; /* (its control connections are ft.c's, busy from here) */
    if (r != DDP_SUCCESS) {
        ddp__fail(g, r, "%s", v->error);
        ddp__group_free(v);
        return r;
    }
    if (n == 1) v->local_rank = 0, v->local_world_size = 1;
    *out = v;
    return DDP_SUCCESS;
}

/* g's limit on a silent peer in collectives (ddp__quiet_limit), on its hierarchical stage groups too:
   fault tolerance sets suspect_seconds while it runs, 0 (the group's timeout) otherwise. */
static void ddp__group_set_quiet(ddp_group *g, double seconds) {
    g->quiet = seconds;
    if (g->hier.host) g->hier.host->quiet = seconds;
    if (g->hier.leaders) g->hier.leaders->quiet = seconds;
}

#define DDP__SWAP(T, a, b) do { T swap_ = (a); (a) = (b); (b) = swap_; } while (0)
/* g (the program's handle, its progress thread idle) takes view v's data plane; v, holding g's old one, is
   freed. Subgroups made before stop working: they are broken with a message that says why. */
static void ddp__group_adopt(ddp_group *g, ddp_group *v) {
    ddp_group *sub;
    ddp__mesh m;
    for (sub = g->member.subgroups; sub; sub = sub->member.next_sibling)
        ddp__group_break(sub, DDP_ERR_STATE, "the world group changed its view (fault tolerance): a subgroup made "
                         "before the change cannot be used; destroy it and make it again");
    DDP__SWAP(int, g->rank, v->rank);
    DDP__SWAP(int, g->world_size, v->world_size);
    DDP__SWAP(int, g->local_rank, v->local_rank);
    DDP__SWAP(int, g->local_world_size, v->local_world_size);
    DDP__SWAP(int *, g->world_ranks, v->world_ranks);
    DDP__SWAP(const ddp__backend *, g->backend, v->backend);
    DDP__SWAP(const ddp__backend *, g->host_backend, v->host_backend);
    DDP__SWAP(struct ddp__nccl *, g->nccl, v->nccl);
    g->ft_views++;
    g->seq = g->seq_base = v->seq;
    g->running_seq = 0;
    g->purpose = 0;
    v->broken = g->broken = DDP_SUCCESS; /* v: no lingering goodbye for the old connections, whose peers moved on */
    g->broken_msg[0] = 0;
    DDP__SWAP(ddp__hier, g->hier, v->hier);
    DDP__SWAP(ddp__shm *, g->shm, v->shm);
    m = g->mesh; /* all but the mutex, which stays with its group */
    g->mesh.peers = v->mesh.peers, v->mesh.peers = m.peers;
    g->mesh.dir = v->mesh.dir, v->mesh.dir = m.dir;
    g->mesh.names = v->mesh.names, v->mesh.names = m.names;
    g->mesh.names_len = v->mesh.names_len, v->mesh.names_len = m.names_len;
    g->mesh.names_cap = v->mesh.names_cap, v->mesh.names_cap = m.names_cap;
    g->mesh.linked = v->mesh.linked, v->mesh.linked = m.linked;
    g->mesh.nlinked = v->mesh.nlinked, v->mesh.nlinked = m.nlinked;
    g->mesh.listen_fd = v->mesh.listen_fd, v->mesh.listen_fd = m.listen_fd;
    g->mesh.shakes = v->mesh.shakes, v->mesh.shakes = m.shakes;
    g->mesh.nshakes = v->mesh.nshakes, v->mesh.nshakes = m.nshakes;
    g->mesh.pollfds = v->mesh.pollfds, v->mesh.pollfds = m.pollfds;
    g->mesh.poll_owner = v->mesh.poll_owner, v->mesh.poll_owner = m.poll_owner;
    g->mesh.waiting_for = -1;
    g->mesh.stash = v->mesh.stash, v->mesh.stash = m.stash;
    g->mesh.stash_tail = v->mesh.stash_tail, v->mesh.stash_tail = m.stash_tail;
    g->mesh.posted = v->mesh.posted, v->mesh.posted = m.posted;
    g->mesh.p2p_calls = v->mesh.p2p_calls;
    memcpy(g->member.prefix, v->member.prefix, sizeof g->member.prefix); /* connections made later hash it */
    ddp__group_set_quiet(g, g->quiet); /* the new view's stage groups */
    ddp__nccl_retire(v); /* the old communicator: aborted (its lost members would never answer) */
    ddp__group_free(v);
}

/* The mesh's look at the store during the set-up (ddp__setup_hooks in internal.h). */
static ddp_result ddp__setup_watch(ddp_group *g, int peer) {
    char how[64];
    int aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    if (peer >= 0 && g->mesh.dir && ddp__pid_gone(g->mesh.dir[peer].pid, g->mesh.dir[peer].node, ddp__node_key())) {
        snprintf(how, sizeof how, "its process no longer exists");
        return ddp__setup_lost(g, peer, how);
    }
    if (g->member.gone && g->mesh.dir && (peer = g->member.gone(g->member.gone_arg)) >= 0)
        return ddp__setup_lost(g, peer, "its fault-tolerance control connection closed");
    return DDP_SUCCESS;
}

static ddp_result ddp__setup_lost(ddp_group *g, int peer, const char *how) {
    ddp__record r;
    memset(&r, 0, sizeof r);
    r.pid = g->mesh.dir[peer].pid;
    snprintf(r.host, sizeof r.host, "%s", g->mesh.names + g->mesh.dir[peer].host);
    return ddp__rdzv_lost(g, peer, &r, how);
}

/* ddp_init for backend "mpi": everything comes from MPI_COMM_WORLD (mpi.c); no store, no sockets. */
static ddp_result ddp__init_done(ddp_group *g, int nccl, const char *timeline, ddp_group **out);

static ddp_result ddp__init_mpi(const ddp_init_desc *desc, ddp_group **out) {
    char err[DDP__ERR_MAX];
    int rank = 0, world = 1;
    struct ddp__mpi *m = NULL;
    ddp_group *g;
    ddp_result r;
    double timeout = ddp__read_timeout(desc, err, &r);
    if (r) return ddp__fail(NULL, r, "ddp_init: %s", err);
    if ((r = ddp__mpi_world(&rank, &world, &m, err)) != DDP_SUCCESS)
        return ddp__fail(NULL, r, "ddp_init: %s", err);
    if (!(g = ddp__group_alloc(rank, world))) {
        ddp__mpi_free(m);
        return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    }
    ddp__mpi_attach(g, m);
    g->timeout = timeout;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    ddp__log(g, DDP_LOG_INFO, "joined: rank %d of %d on the mpi backend (local rank %d of %d)", rank, world, g->local_rank,
             g->local_world_size);
    return ddp__init_done(g, 0, desc->timeline, out);
}

/* Join the store that torchrun's agent serves (TORCHELASTIC_USE_AGENT_STORE=True). Keys go under the
   prefix torch's workers use in it, PrefixStore("/worker/attempt_<restart>"), so the agent's own keys
   and an earlier attempt's are never seen. */
static ddp_result ddp__connect_agent_store(const ddp__launch *L, double timeout, ddp_store **out, char *where,
                                           size_t where_size, char *err) {
    char attempt[64], prefix[96];
    ddp_result r;
    snprintf(attempt, sizeof attempt, "/worker/attempt_%d", L->restart_count);
    ddp__store_torch_prefix(attempt, prefix, sizeof prefix);
    snprintf(where, where_size, "torchrun's agent store at %s:%d", L->master_addr, L->master_port);
    r = ddp__store_connect(L->master_addr, L->master_port, prefix, timeout, out, err);
    if (r != DDP_SUCCESS && strlen(err) < DDP__ERR_MAX - 1)
        snprintf(err + strlen(err), DDP__ERR_MAX - strlen(err),
                 " (TORCHELASTIC_USE_AGENT_STORE=True says torchrun's agent serves it: is torchrun still running, "
                 "and are MASTER_ADDR/MASTER_PORT the ones it was given?)");
    return r;
}

/* ---- the timeline's clock (timeline.c writes the events; see its top) ----
   A rank on rank 0's machine shares its CLOCK_REALTIME: the key is the boot id (network namespaces share
   it). Any other rank (every rank with DDP_TIMELINE_SYNC=all) measures its clock against rank 0's, which
   answers each such rank in turn, DDP__TL_SYNC_ROUNDS round trips each (a send of 0 and a reply of rank
   0's clock): offset = rank 0's reply - the midpoint of the round trip, from the shortest round trip.
   Collective; every rank agrees on the outcome (a rank that cannot create its file fails ddp_init
   everywhere). */

#define DDP__TL_SYNC_ROUNDS 8

/* This machine's clock: a hash of its boot id (0 when unreadable: then it is measured) */
static uint64_t ddp__clock_key(void) {
    char id[128];
    ddp__boot_id(id, sizeof id);
    return id[0] ? ddp__hash(id) | 1 : 0;
}

/* This rank's clock minus rank 0's, in seconds (0 on rank 0 and wherever it is not measured). */
static ddp_result ddp__timeline_offset(ddp_group *g, int sync_all, double *offset) {
    uint64_t mine = ddp__clock_key(), *keys = (uint64_t *)ddp__calloc((size_t)g->world_size, sizeof *keys);
    ddp_result r;
    int j, round;
    *offset = 0;
    if (!keys) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "timeline: out of memory");
    if ((r = ddp_all_gather(g, &mine, keys, 1, DDP_I64)) != DDP_SUCCESS) goto done;
    for (j = 1; j < g->world_size && r == DDP_SUCCESS; j++) {
        double best = -1;
        if (!sync_all && keys[j] && keys[j] == keys[0]) continue; /* the same clock as rank 0 */
        if (g->rank != 0 && g->rank != j) continue;
        for (round = 0; round < DDP__TL_SYNC_ROUNDS && r == DDP_SUCCESS; round++) {
            double t[2] = {0, 0}, sent, back;
            if (g->rank == 0) {
                if ((r = ddp_recv(g, t, 1, DDP_F64, j, 0)) == DDP_SUCCESS) {
                    t[0] = ddp__wall_seconds();
                    r = ddp_send(g, t, 1, DDP_F64, j, 0);
                }
                continue;
            }
            sent = ddp__wall_seconds();
            if ((r = ddp_send(g, t, 1, DDP_F64, 0, 0)) == DDP_SUCCESS && (r = ddp_recv(g, t, 1, DDP_F64, 0, 0)) == DDP_SUCCESS) {
                back = ddp__wall_seconds();
                if (best < 0 || back - sent < best) {
                    best = back - sent;
                    *offset = (sent + back) / 2 - t[0];
                }
            }
        }
    }
done:
    ddp__free(keys);
    return r;
}

/* Open this rank's timeline when DDP_TIMELINE or desc->timeline asks (the world group, after set-up). */
static ddp_result ddp__timeline_start(ddp_group *g, const char *wanted) {
    const char *path = wanted ? wanted : ddp__env("DDP_TIMELINE"), *sync = ddp__env("DDP_TIMELINE_SYNC");
    double mono0, wall0, offset = 0, origin;
    ddp_result r = DDP_SUCCESS;
    if (!path || !*path) return DDP_SUCCESS;
    if (sync && strcmp(sync, "all") != 0 && strcmp(sync, "auto") != 0)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "DDP_TIMELINE_SYNC is \"%s\"; it is auto (measure the clocks of "
                         "other machines only) or all", sync);
    if (ddp__timeline_on()) { /* a second world group at the same time: its events go to the first's file */
        ddp__log(g, DDP_LOG_WARN, "timeline: a timeline is already open in this process; this group's events go there");
        return DDP_SUCCESS;
    }
    if (g->world_size > 1) r = ddp__timeline_offset(g, sync && !strcmp(sync, "all"), &offset);
    wall0 = ddp__wall_seconds();
    mono0 = ddp__now();
    origin = wall0 - offset; /* rank 0's: every rank's clock counts from the moment rank 0 got here */
    if (r == DDP_SUCCESS && g->world_size > 1) r = ddp_broadcast(g, &origin, 1, DDP_F64, 0);
    if (r == DDP_SUCCESS) r = ddp__tl_open(g, path, mono0, wall0 - offset - origin);
    return ddp__agree_outcome(g, r, "opening the timeline (DDP_TIMELINE)");
}

/* The last step of ddp_init. Backend "nccl": the connected group gets its communicator (nccl.c); when
   that fails (on every rank alike: the ranks agree on each step), the group is taken down in order. */
static ddp_result ddp__init_done(ddp_group *g, int nccl, const char *timeline, ddp_group **out) {
    char msg[DDP__ERR_MAX];
    int rank = g->rank, world = g->world_size;
    ddp_result r;
    if ((nccl && (r = ddp__nccl_attach(g, NULL)) != DDP_SUCCESS) || (r = ddp__timeline_start(g, timeline)) != DDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", g->error);
        ddp_destroy(g);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d): %s", rank, world, msg);
    }
    g->seq_base = g->seq; /* the program's first collective is #1 in messages */
    *out = g;
    return DDP_SUCCESS;
}

/* This rank failed locally (a bad setting such as DDP_TIMEOUT) after it knew where the store is. Rather
   than leave the other ranks to wait the whole timeout for it, ddp_init still joins the store (waiting
   at most DDP__EARLY_PUBLISH_SECONDS, and only into this job's store: ddp__rdzv_job) and fails here, so
   that the error is published (ddp__rdzv_fail_all) with this rank named, and every rank fails with it. */
#define DDP__EARLY_PUBLISH_SECONDS 10.0
static ddp_result ddp__init_failed_locally(ddp_group *g, ddp_result code, const char *msg) {
    char host[128];
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    return ddp__fail(g, code, "rank %d (host %s, pid %d) cannot take part: %s", g->rank, host, (int)getpid(), msg);
}

/* Rank 0 started the store server but cannot connect to it: the other ranks' connections took the last
   descriptors (a low RLIMIT_NOFILE). They would wait the whole timeout for a job record that rank 0 never
   writes, so its server publishes why under the rendezvous keys, and they fail with that (ddp__rdzv_job
   reads the abort key while it waits). Their leaving frees descriptors: rank 0 connects then, within a
   few seconds, and waits as any failing rank 0 does until they have read it (ddp__rdzv_fail_all). err
   keeps this rank's own reason. */
static void ddp__rank0_cannot_connect(ddp_group *g, const ddp__launch *L, ddp_result r, const char *err) {
    char why[DDP__ERR_MAX];
    double until = ddp__now() + DDP__MIN(g->timeout, 5.0);
    ddp__store_server_publish_failure(g->member.store_server, err);
    while (!g->member.store && ddp__now() < until) {
        double left = DDP__MAX(until - ddp__now(), 0.01); /* never 0, which a store takes as its default 300 s */
        if (ddp__store_connect(L->master_addr, L->master_port, NULL, left, &g->member.store, why) != DDP_SUCCESS)
            ddp__sleep(0.05);
    }
    if (!g->member.store) return;
    g->member.owns_store = 1;
    ddp__fail(g, r, "%s", err);
    ddp__rdzv_fail_all(g, r);
}

/* Fault-tolerant mode's settings (ft.c runs it): the descriptor's fields, else DDP_FT, DDP_FT_MIN_WORLD_SIZE,
   DDP_FT_SUSPECT_SECONDS; out->fault_tolerant stays 0 when it is off. */
static ddp_result ddp__read_ft(const ddp_init_desc *d, const char *backend, ddp_init_desc *out, char *err) {
    const char *v;
    long n = 0;
    int k;
    memset(out, 0, sizeof *out);
    if (d->fault_tolerant < 0 || d->min_world_size < 0 || d->suspect_seconds < 0)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc: fault_tolerant (%d), min_world_size (%d) and "
                            "suspect_seconds (%g) must not be negative", d->fault_tolerant, d->min_world_size, d->suspect_seconds);
    out->fault_tolerant = d->fault_tolerant;
    if (!out->fault_tolerant && (k = ddp__env_int("DDP_FT", 0, 1, &n, err)) != 0) {
        if (k < 0) return DDP_ERR_INIT;
        out->fault_tolerant = (int)n;
    }
    if (!out->fault_tolerant) return DDP_SUCCESS;
    if (strcmp(backend, "mpi") == 0)
        return ddp__fail_to(err, DDP_ERR_UNSUPPORTED, "fault-tolerant mode (%s) runs on the cpu and nccl backends, not on "
                            "\"%s\" (MPI cannot drop a member and go on); use backend cpu or nccl, or turn fault tolerance off",
                            d->fault_tolerant ? "ddp_init_desc.fault_tolerant" : "DDP_FT=1", backend);
    out->min_world_size = d->min_world_size ? d->min_world_size : 1;
    if (!d->min_world_size && (k = ddp__env_int("DDP_FT_MIN_WORLD_SIZE", 1, 1 << 30, &n, err)) != 0) {
        if (k < 0) return DDP_ERR_INIT;
        out->min_world_size = (int)n;
    }
    out->suspect_seconds = d->suspect_seconds > 0 ? d->suspect_seconds : 10.0;
    if (d->suspect_seconds <= 0 && (v = ddp__env("DDP_FT_SUSPECT_SECONDS")) != NULL) {
        char *end;
        double t = strtod(v, &end);
        if (end == v || *end || !(t > 0) || t > 1e6)
            return ddp__fail_to(err, DDP_ERR_INIT, "DDP_FT_SUSPECT_SECONDS=\"%s\" is not a positive number of seconds", v);
        out->suspect_seconds = t;
    }
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_init(const ddp_init_desc *desc, ddp_group **out) {
    ddp_init_desc zero, ft;
    ddp__launch L;
    ddp_group *g;
    char err[DDP__ERR_MAX], where[320];
    const char *backend;
    char early_msg[DDP__ERR_MAX];
    double timeout;
    int nccl, foreign = 0, told = 0, joining;
    ddp_result r, early = DDP_SUCCESS;
    if (!out) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_init: the out argument is NULL");
    *out = NULL;
    if (!desc) {
        memset(&zero, 0, sizeof zero);
        desc = &zero;
    }
    backend = desc->backend && *desc->backend ? desc->backend : ddp__env("DDP_BACKEND") ? ddp__env("DDP_BACKEND") : "auto";
    nccl = strcmp(backend, "nccl") == 0;
    if (nccl && (r = ddp__nccl_built(err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "%s", err);
    if (strcmp(backend, "auto") != 0 && strcmp(backend, "cpu") != 0 && strcmp(backend, "mpi") != 0 && !nccl) {
        return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "backend \"%s\"%s is not one of auto, cpu, nccl, mpi", backend,
                         desc->backend && *desc->backend ? "" : " (from DDP_BACKEND)");
    }
    if ((r = ddp__read_ft(desc, backend, &ft, err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "ddp_init: %s", err);
    if (strcmp(backend, "mpi") == 0) return ddp__init_mpi(desc, out);
    if ((r = ddp__read_launch(desc, &L, err)) != DDP_SUCCESS) return ddp__fail(NULL, r, "ddp_init: %s", err);
    /* alone, nobody else needs to hear of it; otherwise the ranks check DDP_TRANSPORT together (ddp__choose_transport) */
    if (L.world_size == 1 && ddp__transport_wish() == DDP__WISH_BAD) return ddp__bad_transport(NULL);
    timeout = ddp__read_timeout(desc, err, &r);
    if (r && L.world_size == 1 && !L.file_path && !L.master_port) return ddp__fail(NULL, r, "ddp_init: %s", err);
    if (r) { /* a local failure with the master known: join only to tell the others (ddp__init_failed_locally) */
        early = r;
        snprintf(early_msg, sizeof early_msg, "%s", err);
        timeout = DDP__EARLY_PUBLISH_SECONDS;
    }

    joining = ft.fault_tolerant && ddp__env("DDP_FT_JOIN") && strcmp(ddp__env("DDP_FT_JOIN"), "1") == 0;
    /* a joiner (ddprun --ft restarting a lost worker) is a group of its own until ddp_ft_begin admits it */
    g = joining ? ddp__group_alloc(0, 1) : ddp__group_alloc(L.rank, L.world_size);
    if (!g) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    g->timeout = timeout;
    g->ft_mode = ft.fault_tolerant;
    g->ft_join = joining;
    g->ft_min_world = ft.min_world_size;
    g->ft_suspect = ft.suspect_seconds;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    g->local_rank = L.local_rank;
    g->local_world_size = L.local_world_size;
    snprintf(g->member.prefix, sizeof g->member.prefix, "ddp/%d/", L.restart_count);
    if (L.world_size == 1 && !L.file_path && !L.master_port) { /* alone: nothing to connect */
        g->local_rank = 0;
        g->local_world_size = 1;
        return ddp__init_done(g, nccl, desc->timeline, out);
    }
    ddp__fd_prepare(g, L.world_size, L.rank); /* the soft limit on open files up to the hard one */

    if (L.file_path) {
        snprintf(where, sizeof where, "the file store %s", L.file_path);
        r = ddp__store_open_file(L.file_path, timeout, &g->member.store, err);
        ddp__route_address(NULL, 0, g->member.address, sizeof g->member.address);
    } else if (L.agent_store) {
        r = ddp__connect_agent_store(&L, timeout, &g->member.store, where, sizeof where, err);
        ddp__route_address(L.master_addr, L.master_port, g->member.address, sizeof g->member.address);
    } else {
        snprintf(where, sizeof where, "the store at %s:%d", L.master_addr, L.master_port);
        r = DDP_SUCCESS;
        /* Rank 0 holds a descriptor back for its own client while its server starts: the other ranks'
           clients, connecting at once, could otherwise take the last ones under a low RLIMIT_NOFILE, and
           rank 0 would fail without a connection to publish why (the server, short of descriptors, then
           pauses accepting for 0.1 s, in which the client takes the one given back). That narrows the
           window without closing it (the server may take the descriptor back first): what then follows
           is ddp__rank0_cannot_connect. */
        int serve = L.rank == 0 && !joining; /* a joiner finds the job's store, whatever its RANK */
        int spare = serve ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
        if (serve) r = ddp__store_server_start(L.master_addr, L.master_port, g->log_level, &g->member.store_server, err);
        if (serve && r != DDP_SUCCESS) r = ddp__rank0_port_taken(g, &L, r, err);
        if (serve && r == DDP_SUCCESS) { /* where its server says that it cannot accept a rank: */
            char abort_key[256], table_key[256], ready_key[256]; /* as ddp__rdzv_abort publishes it */
            ddp__key(g, abort_key, sizeof abort_key, "abort", -1);
            ddp__key(g, table_key, sizeof table_key, "table", -1);
            ddp__key(g, ready_key, sizeof ready_key, "ready", -1);
            ddp__store_server_abort_key(g->member.store_server, abort_key, table_key, ready_key);
        }
        if (spare >= 0) close(spare);
        if (r == DDP_SUCCESS) r = ddp__store_connect(L.master_addr, L.master_port, NULL, timeout, &g->member.store, err);
        if (r != DDP_SUCCESS && g->member.store_server) ddp__rank0_cannot_connect(g, &L, r, err);
        if (g->member.store_server) ddp__store_mark_own(g->member.store);
        g->member.rank0_serves = 1;
        ddp__route_address(L.master_addr, L.master_port, g->member.address, sizeof g->member.address);
    }
    if (r) {
        ddp__group_free(g);
        if (early) return ddp__fail(NULL, early, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, early_msg);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, err);
    }
    g->member.owns_store = 1;
    if (joining) { /* no rendezvous: the job runs; ddp_ft_begin asks to be admitted (ft.c) */
        g->local_rank = 0;
        g->local_world_size = 1;
        ddp__log(g, DDP_LOG_INFO, "fault tolerance: a joiner (DDP_FT_JOIN=1), through %s", where);
        return ddp__init_done(g, nccl, desc->timeline, out);
    }
    ddp__log(g, DDP_LOG_INFO, "joining: rank %d of %d from %s, through %s", L.rank, L.world_size, L.source, where);
    if ((r = ddp__rdzv_job(g, where, L.file_path != NULL, &foreign)) != DDP_SUCCESS ||
        (early && (told = 1, r = ddp__init_failed_locally(g, early, early_msg)) != DDP_SUCCESS) ||
        (r = ddp__group_connect(g, where)) != DDP_SUCCESS) {
        if (!foreign) r = ddp__rdzv_fail_all(g, r); /* never into another job's store */
        if (early && !told) r = ddp__fail(g, early, "%s", early_msg); /* the job was not reachable: the local reason */
        ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, g->error);
        ddp__group_free(g);
        return r;
    }
    ddp__store_server_abort_key(g->member.store_server, NULL, NULL, NULL);
    ddp__log(g, DDP_LOG_INFO, "joined: rank %d of %d (local rank %d of %d)", g->rank, g->world_size, g->local_rank,
             g->local_world_size);
    return ddp__init_done(g, nccl, desc->timeline, out);
}

/* Subgroups are listed on their parent in the order they were made, which is the same on every rank
   (ddp_new_group is collective on the parent). */
static void ddp__subgroup_link(ddp_group *parent, ddp_group *sub) {
    ddp_group **at = &parent->member.subgroups;
    while (*at) at = &(*at)->member.next_sibling;
    *at = sub;
    sub->member.parent = parent;
    sub->member.next_sibling = NULL;
}

static void ddp__subgroup_unlink(ddp_group *parent, ddp_group *sub) {
    ddp_group **at = &parent->member.subgroups;
    while (*at && *at != sub) at = &(*at)->member.next_sibling;
    if (*at) *at = sub->member.next_sibling;
    sub->member.parent = NULL;
}

/* ddp_destroy of a group destroys its live subgroups first, as torch's destroy_process_group() destroys
   every group: each rank destroys those it belongs to, in the order they were made, so the members of
   each meet in its closing barrier (a rank outside one goes on to the next). The first error is kept. */
static ddp_result ddp__destroy_subgroups(ddp_group *g) {
    ddp_result first = DDP_SUCCESS;
    while (g->member.subgroups) {
        ddp_result r = ddp_destroy(g->member.subgroups); /* unlinks it */
        if (r && !first) first = r;
    }
    return first;
}

/* The world group's store ends with ddp_destroy on every rank, not later: a process may call ddp_init again
   at once, on the same MASTER_PORT, and must meet the next group's store there, never this one's (whose
   keys say that every rank has joined: "another job"), nor this one while it closes (a connection reset
   mid-request: "lost the store"). So after the closing barrier (no rank uses the store any more) rank 0
   stops its server, listener first (ddp__store_server_close), and every other rank, before it returns,
   waits for its own connection to that server to close (ddp__destroy_await_store): a redial then meets a
   refusal, retried until rank 0's next server listens, as at a first ddp_init. */
static void ddp__destroy_store(ddp_group *g) {
    if (!g->member.store_server) return;
    ddp__store_server_stop(g->member.store_server);
    g->member.store_server = NULL;
}

static void ddp__destroy_await_store(ddp_group *g) {
    double seconds = DDP__MIN(g->timeout, 10.0);
    if (g->rank == 0 || !g->member.rank0_serves || !g->member.owns_store || !g->member.store) return;
    if (!ddp__store_await_close(g->member.store, seconds))
        ddp__log(g, DDP_LOG_WARN, "ddp_destroy: rank 0's store was still open %.3g s after the closing barrier (is "
                 "rank 0 stuck in ddp_destroy?); a ddp_init on the same MASTER_PORT now may meet that store and fail",
                 seconds);
}

DDP_API ddp_result ddp_destroy(ddp_group *g) {
    ddp_result r = DDP_SUCCESS, subs;
    if (!g) return DDP_SUCCESS;
    if ((r = ddp__group_check(g, "ddp_destroy")) != DDP_SUCCESS) return r;
    if (g->end_upper) g->end_upper(g); /* a checkpoint save in flight finishes first (its own group meets here on every rank) */
    subs = ddp__destroy_subgroups(g);
    ddp__drain(g);
    if (g->world_size > 1 && !g->broken) {
        r = ddp_barrier(g); /* nobody closes a connection that a peer may still be waiting on */
        if (r) {
            ddp__fail(NULL, r, "ddp_destroy: %s", g->error);
        } else {
            ddp__hier_stages_end(g, 1); /* the stage groups say goodbye among themselves first */
            g->backend->close(g, 1);
            ddp__destroy_store(g);
            ddp__say_goodbye(g, DDP__MIN(g->timeout, 10.0));
            ddp__destroy_await_store(g);
        }
    }
    ddp__timeline_close_of(g);
    ddp__group_free(g);
    return r ? r : subs;
}

/* Make and connect the group of the parent's ranks `ranks` (n of them; this rank is ranks[me]) through
   the parent's store, under the key prefix <parent's prefix><name>/. comm: the subgroup's MPI
   communicator (mpi backend: no sockets), else NULL. On failure the parent carries the error, prefixed
   by `what`. Used by ddp_new_group and by the hierarchical all_reduce's host and leader groups (hier.c). */
static ddp_result ddp__subgroup_open(ddp_group *g, const int *ranks, int n, int me, const char *name, struct ddp__mpi *comm,
                                     const char *what, ddp_group **out) {
    char where[160];
    ddp_group *sub;
    ddp_result r;
    int i;
    *out = NULL;
    if (!(sub = ddp__group_alloc(me, n))) {
        ddp__mpi_free(comm);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    }
    if (comm) ddp__mpi_attach(sub, comm);
    for (i = 0; i < n; i++) sub->world_ranks[i] = g->world_ranks[ranks[i]];
    sub->timeout = g->timeout;
    sub->log_level = g->log_level;
    sub->log_fn = g->log_fn;
    sub->log_user = g->log_user;
    sub->member.store = g->member.store;
    memcpy(sub->member.address, g->member.address, sizeof sub->member.address);
    snprintf(sub->member.prefix, sizeof sub->member.prefix, "%.60s%.30s/", g->member.prefix, name);
    snprintf(where, sizeof where, "the parent group's store (%s)", name);
    if (n > 1 && !sub->mpi && (r = ddp__group_connect(sub, where)) != DDP_SUCCESS) {
        ddp__fail(g, r, "%s: %s", what, sub->error);
        ddp__group_free(sub);
        return r;
    }
    if (n == 1) sub->local_rank = 0, sub->local_world_size = 1;
    sub->seq_base = sub->seq;
    *out = sub;
    return DDP_SUCCESS;
}

DDP_API ddp_result ddp_new_group(ddp_group *g, const int *ranks, int n, ddp_group **out) {
    uint64_t mine = 0x9e3779b97f4a7c15ull, *all;
    char name[32];
    int i, j, me = -1, valid = ranks && n >= 1 && out;
    struct ddp__mpi *comm = NULL;
    ddp_group *sub;
    ddp_result r;
    if ((r = ddp__group_check(g, "ddp_new_group")) != DDP_SUCCESS) return r;
    if (out) *out = NULL;
    for (i = 0; valid && i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= g->world_size) valid = 0;
        for (j = 0; valid && j < i; j++)
            if (ranks[j] == ranks[i]) valid = 0;
        if (ranks[i] == g->rank) me = i;
        mine = (mine ^ (uint64_t)(ranks[valid ? i : 0] + 1)) * 1099511628211ull;
    }
    if (!valid) mine = 0; /* still take part, so the other ranks fail too instead of waiting */
    /* Every rank must pass the same list: compare the hashes of all ranks. */
    all = (uint64_t *)ddp__calloc((size_t)g->world_size, sizeof *all);
    if (!all) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_new_group: out of memory");
    if ((r = ddp_all_gather(g, &mine, all, 1, DDP_I64)) != DDP_SUCCESS) {
        ddp__free(all);
        return r;
    }
    for (i = 0; i < g->world_size; i++)
        if (all[i] != all[0] || all[i] == 0) {
            int invalid = all[i] == 0 || all[0] == 0, bad = all[0] == 0 ? 0 : i;
            ddp__free(all);
            if (!valid) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_new_group: the rank list is invalid (need 1..%d distinct ranks in 0..%d)",
                                         g->world_size, g->world_size - 1);
            return ddp__fail(g, invalid ? DDP_ERR_INVALID_ARGUMENT : DDP_ERR_MISMATCH,
                             "ddp_new_group: rank %d passed %s rank list %s; every rank must call ddp_new_group with the same list",
                             bad, invalid ? "an invalid" : "a different", invalid ? "" : "than rank 0");
        }
    ddp__free(all);
    g->member.subgroups_made++;
    if (g->mpi && (r = ddp__mpi_split(g, me, &comm)) != DDP_SUCCESS) return r;
    if (me < 0) return DDP_SUCCESS;
    snprintf(name, sizeof name, "sub%llu", (unsigned long long)g->member.subgroups_made);
    if ((r = ddp__subgroup_open(g, ranks, n, me, name, comm, "ddp_new_group", &sub)) != DDP_SUCCESS) return r;
    if (g->nccl && (r = ddp__nccl_attach(sub, g->nccl)) != DDP_SUCCESS) { /* its own communicator */
        ddp__fail(g, r, "ddp_new_group: %s", sub->error);
        ddp_destroy(sub);
        return r;
    }
    if (!g->nccl && (r = ddp__devbuf_inherit(sub, g)) != DDP_SUCCESS) { /* the stream that stages device buffers */
        ddp__fail(g, r, "ddp_new_group: %s", sub->error);
        ddp_destroy(sub);
        return r;
    }
    sub->seq_base = sub->seq;
    ddp__subgroup_link(g, sub);
    *out = sub;
    return DDP_SUCCESS;
}

/* The getters answer as for NULL (a single process) on a destroyed group; the reason is in
   ddp_last_error(NULL). */
static int ddp__group_live(const ddp_group *g, const char *fn) { return g && ddp__group_check(g, fn) == DDP_SUCCESS; }
DDP_API int ddp_rank(const ddp_group *g) { return ddp__group_live(g, "ddp_rank") ? g->rank : 0; }
DDP_API int ddp_world_size(const ddp_group *g) { return ddp__group_live(g, "ddp_world_size") ? g->world_size : 1; }
DDP_API int ddp_local_rank(const ddp_group *g) { return ddp__group_live(g, "ddp_local_rank") ? g->local_rank : 0; }
DDP_API int ddp_local_world_size(const ddp_group *g) { return ddp__group_live(g, "ddp_local_world_size") ? g->local_world_size : 1; }
DDP_API const char *ddp_backend_name(const ddp_group *g) { return ddp__group_live(g, "ddp_backend_name") ? g->backend->family : "none"; }
DDP_API double ddp_timeout(const ddp_group *g) { return ddp__group_live(g, "ddp_timeout") ? g->timeout : 0.0; }

/* A group of one process made without a master has no store; the first ddp_group_store() call gives it
   a private one (a store server on a free loopback port, and a client), so that code written for many
   ranks runs unchanged on one. */
static ddp_result ddp__private_store(ddp_group *g) {
    char err[DDP__ERR_MAX];
    ddp_result r = ddp__store_server_start("127.0.0.1", 0, g->log_level, &g->member.store_server, err);
    if (r == DDP_SUCCESS)
        r = ddp__store_connect("127.0.0.1", ddp__store_server_port(g->member.store_server), NULL, g->timeout, &g->member.store, err);
    if (r == DDP_SUCCESS) {
        g->member.owns_store = 1;
        ddp__store_mark_own(g->member.store);
        return DDP_SUCCESS;
    }
    ddp__store_server_stop(g->member.store_server);
    g->member.store_server = NULL;
    return ddp__fail(g, r, "ddp_group_store: could not start the store of this single-process group: %s", err);
}

DDP_API ddp_store *ddp_group_store(ddp_group *g) {
    ddp_store *s;
    if (ddp__group_check(g, "ddp_group_store") != DDP_SUCCESS) return NULL;
    pthread_mutex_lock(&g->async.mu);
    if (!g->member.store && g->world_size == 1 && !g->mpi && !g->member.parent) ddp__private_store(g);
    s = g->member.store;
    pthread_mutex_unlock(&g->async.mu);
    return s;
}
