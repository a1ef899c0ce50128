/* [SECTION] group: ddp_init (torch.distributed.init_process_group), launcher environments,
   rendezvous, the mesh of connections, subgroups (new_group), ddp_destroy

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
     5. the mesh: one TCP connection per pair of ranks, then a barrier over it. */
#include "internal.h"


typedef struct ddp__launch {
    int rank, world_size;
    int local_rank, local_world_size; /* -1 when the launcher did not say */
    const char *source;               /* where rank and world size came from, for messages */
    char master_addr[256];
    int master_port;                  /* 0: none given */
    const char *file_path;            /* init_method file:// */
    int restart_count;
    int agent_store;                  /* TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves the store */
} ddp__launch;

/* Launchers, in the order they are consulted (the first whose rank variable is set wins). */
static const struct {
    const char *rank, *size, *local_rank, *local_size, *name;
} ddp__launchers[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun/ddprun (RANK, WORLD_SIZE)"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
     "Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)"},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH/Hydra (PMI_RANK, PMI_SIZE)"},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL, "SLURM (SLURM_PROCID, SLURM_NTASKS)"},
};

/* "node[01-04,07],gpu5" -> "node01": the first host of a SLURM node list. */
static void ddp__slurm_first_host(const char *list, char *out, size_t cap) {
    size_t i = 0, o = 0;
    while (list[i] && list[i] != ',' && list[i] != '[' && o + 1 < cap) out[o++] = list[i++];
    if (list[i] == '[')
        for (i++; list[i] && list[i] != ',' && list[i] != '-' && list[i] != ']' && o + 1 < cap;) out[o++] = list[i++];
    out[o] = '\0';
}

static ddp_result ddp__parse_tcp_url(const char *url, ddp__launch *L, char *err) {
    const char *hp = url + strlen("tcp://"), *colon;
    char *end;
    long port;
    size_t hl;
    if (*hp == '[') { /* [ipv6]:port */
        const char *close = strchr(hp, ']');
        if (!close || close[1] != ':') goto bad;
        hl = (size_t)(close - hp - 1);
        hp++;
        colon = close + 1;
    } else {
        colon = strrchr(hp, ':');
        if (!colon) goto bad;
        hl = (size_t)(colon - hp);
    }
    if (hl == 0 || hl >= sizeof L->master_addr) goto bad;
    memcpy(L->master_addr, hp, hl);
    L->master_addr[hl] = '\0';
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    if (errno || *end || port < 1 || port > 65535) goto bad;
    L->master_port = (int)port;
    return DDP_SUCCESS;
bad:
    return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" is not tcp://host:port with a port in 1..65535", url);
}

/* The local rank and size that launcher i gave: 0 <= local rank < local size <= world size. torchrun
   sets LOCAL_RANK and LOCAL_WORLD_SIZE together, so one without the other is a broken environment;
   the other launchers may give the local rank alone (the rendezvous then counts the ranks per host). */
static ddp_result ddp__check_local(const ddp__launch *L, int i, char *err) {
    const char *lr = ddp__launchers[i].local_rank, *ls = ddp__launchers[i].local_size;
    if (i == 0 && (L->local_rank >= 0) != (L->local_world_size >= 0))
        return ddp__fail_to(err, DDP_ERR_INIT, "%s is set but %s is not; set both (as torchrun and ddprun do) or neither",
                            L->local_rank >= 0 ? lr : ls, L->local_rank >= 0 ? ls : lr);
    if (L->local_world_size > L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is larger than %s=%d: a host cannot have more ranks than the world; "
                            "check the launcher's settings", ls, L->local_world_size, ddp__launchers[i].size, L->world_size);
    if (L->local_world_size >= 0 && L->local_rank >= L->local_world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is out of range for %s=%d; local ranks are 0..%d: check the "
                            "launcher's settings", lr, L->local_rank, ls, L->local_world_size, L->local_world_size - 1);
    if (L->local_rank >= L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s=%d is out of range for %s=%d; check the launcher's settings", lr,
                            L->local_rank, ddp__launchers[i].size, L->world_size);
    return DDP_SUCCESS;
}

/* Step 1 and 2: rank, world size, local rank, master, from the descriptor and the environment. */
static ddp_result ddp__read_launch(const ddp_init_desc *d, ddp__launch *L, char *err) {
    long v = 0;
    int i, found = 0;
    memset(L, 0, sizeof *L);
    L->local_rank = L->local_world_size = -1;
    L->world_size = 1;
    L->source = "no launcher (a single process)";
    if (d->world_size > 0) {
        L->rank = d->rank;
        L->world_size = d->world_size;
        L->source = "the descriptor (ddp_init_desc.rank, .world_size)";
        found = 1;
    } else if (d->world_size < 0) {
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.world_size is %d; use 0 (from the environment) or a positive number",
                            d->world_size);
    }
    for (i = 0; !found && i < (int)(sizeof ddp__launchers / sizeof ddp__launchers[0]); i++) {
        int has_rank = ddp__env(ddp__launchers[i].rank) != NULL, has_size = ddp__env(ddp__launchers[i].size) != NULL;
        if (!has_rank && !has_size) continue;
        if (has_rank != has_size)
            return ddp__fail_to(err, DDP_ERR_INIT, "%s is set but %s is not; the launcher (%s) must set both",
                                has_rank ? ddp__launchers[i].rank : ddp__launchers[i].size,
                                has_rank ? ddp__launchers[i].size : ddp__launchers[i].rank, ddp__launchers[i].name);
        if (ddp__env_int(ddp__launchers[i].size, 1, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
        L->world_size = (int)v;
        if (ddp__env_int(ddp__launchers[i].rank, 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
        L->rank = (int)v;
        if (ddp__env_int(ddp__launchers[i].local_rank, 0, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
        if (ddp__env(ddp__launchers[i].local_rank)) L->local_rank = (int)v;
        if (ddp__launchers[i].local_size) {
            if (ddp__env_int(ddp__launchers[i].local_size, 1, 1 << 20, &v, err) < 0) return DDP_ERR_INIT;
            if (ddp__env(ddp__launchers[i].local_size)) L->local_world_size = (int)v;
        }
        L->source = ddp__launchers[i].name;
        found = 1;
        if (ddp__check_local(L, i, err) != DDP_SUCCESS) return DDP_ERR_INIT;
    }
    if (L->rank < 0 || L->rank >= L->world_size)
        return ddp__fail_to(err, DDP_ERR_INIT, "rank %d is out of range for world size %d (from %s); ranks are 0..%d",
                            L->rank, L->world_size, L->source, L->world_size - 1);
    if (ddp__env_int("DDP_RESTART_COUNT", 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
    if (ddp__env("DDP_RESTART_COUNT")) L->restart_count = (int)v;
    else if (ddp__env("TORCHELASTIC_RESTART_COUNT")) {
        if (ddp__env_int("TORCHELASTIC_RESTART_COUNT", 0, INT_MAX, &v, err) < 0) return DDP_ERR_INIT;
        L->restart_count = (int)v;
    }
    /* Plain torchrun (static rendezvous, no --standalone) serves a TCPStore from its agent on
       MASTER_ADDR:MASTER_PORT and says so; then every rank, rank 0 too, is a client (as torch's
       _create_c10d_store does, for tcp:// and env:// alike). */
    L->agent_store = ddp__env("TORCHELASTIC_USE_AGENT_STORE") && strcmp(ddp__env("TORCHELASTIC_USE_AGENT_STORE"), "True") == 0;

    /* the master */
    if (d->init_method && strncmp(d->init_method, "tcp://", 6) == 0) return ddp__parse_tcp_url(d->init_method, L, err);
    if (d->init_method && strncmp(d->init_method, "file://", 7) == 0) {
        L->file_path = d->init_method + 7;
        if (!*L->file_path)
            return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" names no file; use file:///path/to/file", d->init_method);
        return DDP_SUCCESS;
    }
    if (d->init_method && strcmp(d->init_method, "env://") != 0)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "init_method \"%s\" is not env://, tcp://host:port or file:///path",
                            d->init_method);
    if (d->master_addr && *d->master_addr) snprintf(L->master_addr, sizeof L->master_addr, "%s", d->master_addr);
    else if (ddp__env("MASTER_ADDR")) snprintf(L->master_addr, sizeof L->master_addr, "%s", ddp__env("MASTER_ADDR"));
    if (d->master_port < 0 || d->master_port > 65535)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.master_port %d is not in 1..65535", d->master_port);
    if (d->master_port) L->master_port = d->master_port;
    else if (ddp__env_int("MASTER_PORT", 1, 65535, &v, err) < 0) return DDP_ERR_INIT;
    else if (ddp__env("MASTER_PORT")) L->master_port = (int)v;
    if (L->world_size == 1 && !L->master_addr[0] && !L->master_port) return DDP_SUCCESS; /* alone: no store */

    /* Under mpirun / srun nobody sets MASTER_*: rank 0's host and a port derived from the job id. */
    if (!L->master_addr[0] && strncmp(L->source, "torchrun", 8) != 0 && strncmp(L->source, "the desc", 8) != 0) {
        if (ddp__env("SLURM_STEP_NODELIST") || ddp__env("SLURM_NODELIST"))
            ddp__slurm_first_host(ddp__env("SLURM_STEP_NODELIST") ? ddp__env("SLURM_STEP_NODELIST") : ddp__env("SLURM_NODELIST"),
                                  L->master_addr, sizeof L->master_addr);
        else
            snprintf(L->master_addr, sizeof L->master_addr, "127.0.0.1");
    }
    if (!L->master_port && strncmp(L->source, "torchrun", 8) != 0 && strncmp(L->source, "the desc", 8) != 0) {
        static const char *job_ids[] = {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "SLURM_JOB_ID", "PMI_ID", "HYDI_CONTROL_FD"};
        char id[256] = "";
        for (i = 0; i < (int)(sizeof job_ids / sizeof job_ids[0]); i++)
            if (ddp__env(job_ids[i])) {
                snprintf(id, sizeof id, "%s%s", ddp__env(job_ids[i]), ddp__env("SLURM_STEP_ID") ? ddp__env("SLURM_STEP_ID") : "");
                break;
            }
        /* 20000-31999: below Linux's ephemeral range (32768-60999), so no outgoing connection holds it */
        L->master_port = id[0] ? 20000 + (int)(ddp__hash(id) % 12000u) : 29500;
    }
    if (!L->master_addr[0])
        return ddp__fail_to(err, DDP_ERR_INIT, "MASTER_ADDR is not set: %s gave rank %d of %d, but not where rank 0 is. "
                            "Set MASTER_ADDR (and MASTER_PORT), ddp_init_desc.master_addr, or init_method tcp://host:port",
                            L->source, L->rank, L->world_size);
    if (!L->master_port)
        return ddp__fail_to(err, DDP_ERR_INIT, "MASTER_PORT is not set (MASTER_ADDR is %s); set MASTER_PORT, "
                            "ddp_init_desc.master_port, or init_method tcp://host:port", L->master_addr);
    return DDP_SUCCESS;
}

static double ddp__read_timeout(const ddp_init_desc *d, char *err, ddp_result *res) {
    const char *v;
    char *end;
    double t;
    *res = DDP_SUCCESS;
    if (d->timeout_seconds > 0) return d->timeout_seconds;
    if (d->timeout_seconds < 0) {
        *res = ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "ddp_init_desc.timeout_seconds is %g; use 0 (default) or a positive number",
                            d->timeout_seconds);
        return 0;
    }
    if (!(v = ddp__env("DDP_TIMEOUT"))) return 300.0;
    t = strtod(v, &end);
    if (end == v || *end || !(t > 0) || t > 1e9) {
        *res = ddp__fail_to(err, DDP_ERR_INIT, "DDP_TIMEOUT=\"%s\" is not a positive number of seconds", v);
        return 0;
    }
    return t;
}

/* ---- rendezvous through the store ---- */

static void ddp__key(const ddp_group *g, char *out, size_t cap, const char *name, int index) {
    if (index >= 0) snprintf(out, cap, "%s%s/%d", g->member.prefix, name, index);
    else snprintf(out, cap, "%s%s", g->member.prefix, name);
}

/* Fail this rank with code and message, and publish them so that every rank of the rendezvous fails too:
   under "abort" (read by the ranks that look for it: the set-up's collectives, ranks arriving late) and, unless rank 0
   published the table already, as the table's value (DDP__RDZV_ABORTED + "code|message"); then "ready",
   which wakes every rank waiting for the table at once (see ddp__rendezvous). The set is announced, a
   round trip: every write has reached the store before this rank goes. */
static ddp_result ddp__rdzv_abort(ddp_group *g, ddp_result code, const char *msg) {
    char key[256], value[DDP__ERR_MAX + 16], marker[DDP__ERR_MAX + 32], now[8];
    size_t n = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(value, sizeof value, "%d|%.1000s", (int)code, msg);
    ddp_store_set(g->member.store, key, value, strlen(value));
    ddp__key(g, key, sizeof key, "table", -1);
    snprintf(marker, sizeof marker, "%s%s", DDP__RDZV_ABORTED, value);
    ddp__store_compare_set(g->member.store, key, "", 0, marker, strlen(marker), now, sizeof now, &n);
    ddp__key(g, key, sizeof key, "ready", -1); /* a SET: torch's server wakes no WAIT on a compare-set */
    ddp_store_set(g->member.store, key, "1", 1);
    return ddp__fail(g, code, "%s", msg);
}

static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted);

/* Publish this rank's error (g->error) as the abort, unless one is there already. */
static void ddp__rdzv_publish(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(msg, sizeof msg, "%s", g->error);
    if (g->member.store && ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
        ddp__rdzv_abort(g, code, msg);
}

/* A rendezvous failed on this rank: publish the error (unless another rank already published one:
   then a rank that only lost a peer fails with the published reason, which is the cause, rather than
   "lost rank i"), hang up its connections and listener, and if this rank serves the store, keep serving until
   every other process has read it (at most a few seconds, for ranks that never started), so that they
   fail with the reason instead of "lost the store". Every other process counts itself in abort_seen,
   whether or not it had joined: one that was still claiming its rank when the error came (a slow start,
   the second of two processes with one rank) must find the store still there. Returns the code this
   rank fails with. */
static ddp_result ddp__rdzv_fail_all(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0, aborted = 0;
    int64_t seen = 0;
    double until = ddp__now() + DDP__MIN(g->timeout, 5.0);
    if (!g->member.store) return code;
    /* the group fails here: a store that is gone (rank 0 exited) costs each call seconds, not the timeout */
    ddp__store_set_timeout(g->member.store, DDP__MIN(g->timeout, 5.0));
    snprintf(msg, sizeof msg, "%s", g->error);
    ddp__key(g, key, sizeof key, "abort", -1);
    if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS) return code;
    if (!exists) ddp__rdzv_abort(g, code, msg);
    if (exists && code == DDP_ERR_PEER_LOST) {
        ddp_result published = ddp__rdzv_check_abort(g, &aborted);
        if (aborted) code = published;
        snprintf(msg, sizeof msg, "%s", g->error);
    }
    ddp__fail(g, code, "%s", msg);
    ddp__link_close_all(g); /* at once, not at ddp__group_free: a rank waiting on one fails now and reads why */
    ddp__key(g, key, sizeof key, "abort_seen", -1);
    if (!g->member.store_server) { /* done with the store: the rank serving it may stop waiting for us */
        ddp_store_add(g->member.store, key, 1, &seen);
        return code;
    }
    while (ddp__now() < until && ddp_store_add(g->member.store, key, 0, &seen) == DDP_SUCCESS && seen < g->world_size - 1)
        ddp__sleep(0.01);
    ddp__fail(g, code, "%s", msg);
    return code;
}

/* Fail with the abort another rank published: value is "code|message". */
static ddp_result ddp__rdzv_fail_published(ddp_group *g, const char *value) {
    int code = DDP_ERR_INIT;
    sscanf(value, "%d|", &code);
    return ddp__fail(g, ddp__peer_code(code, DDP_ERR_INIT), "%s", strchr(value, '|') ? strchr(value, '|') + 1 : value);
}

/* Another rank published an abort: fail with its code and message. */
static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted) {
    char key[256], value[DDP__ERR_MAX + 16];
    size_t n = 0;
    int exists = 0;
    ddp_result r;
    *aborted = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    if (!exists) return DDP_SUCCESS;
    *aborted = 1;
    if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    return ddp__rdzv_fail_published(g, value);
}

/* What each rank publishes about itself: "world=W port=P pid=PID addr=A host=H node=N". */
typedef struct ddp__record {
    int world, port, pid;
    char addr[128], host[128];
    unsigned long long node; /* ddp__node_key() of its process; 0 when not published */
} ddp__record;

static int ddp__record_parse(const char *value, ddp__record *r) {
    memset(r, 0, sizeof *r);
    return sscanf(value, "world=%d port=%d pid=%d addr=%127s host=%127s node=%llx", &r->world, &r->port, &r->pid, r->addr,
                  r->host, &r->node) >= 5;
}

#define DDP__RECORD_MAX 400 /* bytes of one record's text, with room to spare */
static void ddp__record_format(const ddp__record *r, char *out, size_t cap) {
    snprintf(out, cap, "world=%d port=%d pid=%d addr=%s host=%s node=%llx", r->world, r->port, r->pid, r->addr, r->host,
             r->node);
}

/* One rank's line of the table that rank 0 publishes: "port pid node addr host", with "-" for an address
   or host name equal to the rank before's (ranks of one host are neighbours), so that the table every
   rank reads is about 25 bytes a rank rather than a record's 100: at 10,000 ranks the store sends it
   10,000 times. The world size is not repeated: rank 0 checked every record's. */
static void ddp__table_line(const ddp__record *rec, int i, char *out, size_t cap) {
    int same_addr = i > 0 && strcmp(rec[i].addr, rec[i - 1].addr) == 0, same_host = i > 0 && strcmp(rec[i].host, rec[i - 1].host) == 0;
    snprintf(out, cap, "%d %d %llx %s %s", rec[i].port, rec[i].pid, rec[i].node, same_addr ? "-" : rec[i].addr,
             same_host ? "-" : rec[i].host);
}

static int ddp__table_parse(const char *line, ddp__record *rec, int i, int world) {
    ddp__record *r = &rec[i];
    memset(r, 0, sizeof *r);
    r->world = world;
    if (sscanf(line, "%d %d %llx %127s %127s", &r->port, &r->pid, &r->node, r->addr, r->host) != 5) return 0;
    if (strcmp(r->addr, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->addr, rec[i - 1].addr, sizeof r->addr);
    }
    if (strcmp(r->host, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->host, rec[i - 1].host, sizeof r->host);
    }
    return 1;
}

/* ---- noticing a rank that died inside ddp_init ----
   Once a rank has published its record it listens on its port (for the group's life) and its pid is
   known. So a "connection refused" from that port means the rank is gone, and so does a pid that no
   longer exists on this node (same host, boot, network and pid namespace: the record's `node`;
   kill(pid, 0) means nothing across pid namespaces). Ranks that wait (for the others to join, for a
   rank to connect in the set-up's collectives: ddp__setup_watch) look every DDP__WATCH_PERIOD s (the
   set-up's waits back off to 2 s); the rank that notices publishes an abort naming the lost rank
   (ddp__rdzv_lost), which every waiting rank reads within that period. Ranks on other nodes are
   noticed by the refused connection of the rank that dials them (link.c). */
static uint64_t ddp__host_key(void);

static unsigned long long ddp__node_key(void) {
    char ns[128] = "", buf[200];
    ssize_t k = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    snprintf(buf, sizeof buf, "%016llx|%s", (unsigned long long)ddp__host_key(), ns);
    return (unsigned long long)ddp__hash(buf) | 1u;
}

/* Is the process pid of a rank on this node gone (no such process, or a zombie its parent has not reaped)? */
static int ddp__pid_gone(int pid, unsigned long long its_node, unsigned long long node) {
    char path[64], stat[512];
    const char *end;
    size_t n;
    FILE *f;
    if (!its_node || its_node != node || pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (!(f = fopen(path, "r"))) return 0;
    n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    end = strrchr(stat, ')'); /* "pid (comm) S ...": the state follows the command name */
    return end && end[1] == ' ' && end[2] == 'Z';
}

static int ddp__rank_process_gone(const ddp__record *r, unsigned long long node) { return ddp__pid_gone(r->pid, r->node, node); }

/* Rank i, which had registered, is gone: unless another rank has published an abort already (then fail
   with that one), publish one naming it, so that every rank fails now with this message. */
static ddp_result ddp__rdzv_lost(ddp_group *g, int i, const ddp__record *r, const char *how) {
    char msg[DDP__ERR_MAX], key[256];
    int aborted = 0;
    int64_t seen = 0;
    ddp_result res = ddp__rdzv_check_abort(g, &aborted);
    if (res != DDP_SUCCESS || aborted) return res ? res : DDP_ERR_INIT;
    snprintf(msg, sizeof msg, "rank %d (host %s, pid %d) was lost during ddp_init: %s. It had registered in the "
             "rendezvous and then exited; its own output (or exit status) says why", i, r->host, r->pid, how);
    res = ddp__rdzv_abort(g, DDP_ERR_PEER_LOST, msg);
    ddp__key(g, key, sizeof key, "lost", i); /* the lost rank never reads the abort: count it as read, once */
    if (ddp_store_add(g->member.store, key, 1, &seen) == DDP_SUCCESS && seen == 1) {
        ddp__key(g, key, sizeof key, "abort_seen", -1);
        ddp_store_add(g->member.store, key, 1, &seen);
    }
    return res;
}

/* ---- the table of records: rank 0 gathers it, every other rank waits for it ----
   Each rank claims its rank ("claim/R", an ADD), publishes its record under "rank/R" (a SET: it wakes a
   WAIT, in torch's server too, which a compare-set does not) and adds 1 to "joined". Rank 0 reads the
   records in rank order as they appear, each once (a WAIT for the next one, then a GET), and when it has
   them all publishes them as one value, "table" (one short line per rank, ddp__table_line; a
   compare-set, so that it never hides a failure published first), then sets "ready". Every other rank makes one blocking WAIT on
   "ready" and one GET of "table": about 20 requests per rank in all, rank 0's reading included, instead
   of every rank polling a counter and reading every record (2N^2). A rank that fails publishes its
   error as the table's value and sets "ready" (ddp__rdzv_abort), so the same WAIT wakes every rank on a
   failure too.
   While it gathers, rank 0 looks every DDP__WATCH_PERIOD s for a published abort, reads up to 8 records
   out of order (so that a rank that died beyond a missing one is seen too), and checks the pids of the
   ranks of its node that registered (ddp__rank_process_gone; 256 processes a look, round robin); a
   lost rank is published and named. On its timeout it publishes which ranks never joined; the others
   wait DDP__RDZV_GRACE s longer, so that they read that message rather than time out on their own.
   Ranks on other nodes that die after registering are named when a rank first dials them (a refused
   connection, link.c) or by the ranks waiting for them to dial (ddp__setup_watch). */
#define DDP__RDZV_GRACE 5.0
#define DDP__RDZV_SCAN 8 /* records rank 0 reads out of order per look */

/* Read rank i's record into rec[i] if it is there. 1: read, 0: not there yet, else a failure (published). */
static int ddp__rdzv_read_record(ddp_group *g, int i, ddp__record *rec, ddp_result *res) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX];
    int exists = 0;
    size_t n = 0;
    ddp__key(g, key, sizeof key, "rank", i);
    if ((*res = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS || !exists ||
        (*res = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS) {
        if (*res) *res = ddp__fail(g, *res, "rendezvous: reading rank %d's record: %s", i, ddp_store_last_error(g->member.store));
        return 0;
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (!ddp__record_parse(value, &rec[i])) {
        snprintf(msg, sizeof msg, "rank %d published a malformed rendezvous record \"%.200s\" (another program using the "
                 "same store?)", i, value);
        *res = ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
        return 0;
    }
    if (rec[i].world != g->world_size) {
        snprintf(msg, sizeof msg, "ranks disagree on the world size: rank %d (host %s, pid %d) was started with world "
                 "size %d, rank %d with %d; start every rank with the same WORLD_SIZE", i, rec[i].host, rec[i].pid,
                 rec[i].world, g->rank, g->world_size);
        *res = ddp__rdzv_abort(g, DDP_ERR_MISMATCH, msg);
        return 0;
    }
    return 1;
}

/* Every DDP__WATCH_PERIOD s while rank 0 gathers: an abort, a few records out of order, lost ranks. */
#define DDP__RDZV_PID_CHECKS 256 /* processes rank 0 looks for per look */
static ddp_result ddp__rdzv_gather_watch(ddp_group *g, ddp__record *rec, unsigned char *known, int *have, int *scan,
                                         int *pid_scan, unsigned long long node) {
    int i, k, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    for (k = 0; k < DDP__RDZV_SCAN && *have < g->world_size; k++) {
        for (i = 0; i < g->world_size && known[*scan]; i++) *scan = (*scan + 1) % g->world_size;
        if (ddp__rdzv_read_record(g, *scan, rec, &r)) known[*scan] = 1, ++*have;
        if (r) return r;
        *scan = (*scan + 1) % g->world_size;
    }
    /* The pids, DDP__RDZV_PID_CHECKS at most per look, taking up where the last look stopped (a look at
       thousands of ranks' /proc entries every 0.25 s would be rank 0's main work: measured at 4,096 ranks,
       1 s a look); a rank with the pid and node of the rank before it (threads of one process) is one look. */
    for (i = 0, k = 0; i < g->world_size && k < DDP__RDZV_PID_CHECKS; i++) {
        int at = (*pid_scan + i) % g->world_size, prev = (at + g->world_size - 1) % g->world_size;
        if (!known[at] || at == g->rank) continue;
        if (known[prev] && rec[prev].pid == rec[at].pid && rec[prev].node == rec[at].node) continue;
        k++;
        if (ddp__rank_process_gone(&rec[at], node)) return ddp__rdzv_lost(g, at, &rec[at], "its process no longer exists");
    }
    *pid_scan = (*pid_scan + i) % g->world_size;
    return DDP_SUCCESS;
}

/* Rank 0 gave up waiting: publish who never joined (as "3, 5, 9 (and 4 more)"), so every rank fails with it. */
static ddp_result ddp__rdzv_gather_timeout(ddp_group *g, const unsigned char *known, int have, const char *where) {
    char missing[512] = "", msg[DDP__ERR_MAX];
    int i, shown = 0;
    for (i = 0; i < g->world_size; i++)
        if (!known[i] && shown++ < 16)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown > 1 ? ", " : "", i);
    if (shown > 16) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " and %d more", shown - 16);
    snprintf(msg, sizeof msg, "timed out after %.0f s waiting for every rank to join (%d of %d joined through %s; "
             "missing: %s). Are they all started, with the same world size and master?", g->timeout, have,
             g->world_size, where, missing);
    return ddp__rdzv_abort(g, DDP_ERR_TIMEOUT, msg);
}

/* Rank 0: wait at most `seconds` for rank i's record. A WAIT that times out drops the store connection
   (the client cannot tell a late answer from the next one) and the next request connects again: at most
   one reconnection per DDP__WATCH_PERIOD, and only while ranks are late. */
static ddp_result ddp__rdzv_gather_wait(ddp_group *g, int i, double seconds) {
    char key[256];
    const char *keys[1];
    ddp_result r;
    ddp__key(g, key, sizeof key, "rank", i);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, DDP__MAX(seconds, 0.01));
    if (r == DDP_SUCCESS || r == DDP_ERR_TIMEOUT) return DDP_SUCCESS;
    return ddp__fail(g, r, "rendezvous: waiting for rank %d's record: %s", i, ddp_store_last_error(g->member.store));
}

/* Rank 0: read every record (rec[0] is its own), then publish the table. */
static ddp_result ddp__rdzv_gather(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], marker[DDP__ERR_MAX + 32], *table;
    double start = ddp__now(), next_watch = start + DDP__WATCH_PERIOD;
    unsigned long long node = ddp__node_key();
    unsigned char *known = (unsigned char *)ddp__calloc((size_t)g->world_size, 1);
    int have = 1, cursor = 1, scan = 1, pid_scan = 0, i;
    size_t len = 0, n = 0;
    ddp_result r = DDP_SUCCESS;
    if (!known) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    known[0] = 1;
    while (have < g->world_size && r == DDP_SUCCESS) {
        for (; cursor < g->world_size; cursor++) { /* in rank order, while they are there */
            if (known[cursor]) continue;
            if (!ddp__rdzv_read_record(g, cursor, rec, &r)) break;
            known[cursor] = 1, have++;
        }
        if (have == g->world_size || r) break;
        if (ddp__now() >= next_watch) {
            if ((r = ddp__rdzv_gather_watch(g, rec, known, &have, &scan, &pid_scan, node)) != DDP_SUCCESS) break;
            next_watch = ddp__now() + DDP__WATCH_PERIOD;
        }
        if (ddp__now() - start > g->timeout) r = ddp__rdzv_gather_timeout(g, known, have, where);
        else r = ddp__rdzv_gather_wait(g, cursor, DDP__MIN(next_watch, start + g->timeout) - ddp__now());
    }
    ddp__free(known);
    if (r) return r;
    if (!(table = (char *)ddp__malloc((size_t)g->world_size * DDP__RECORD_MAX))) {
        ddp__rdzv_abort(g, DDP_ERR_OUT_OF_MEMORY, "rank 0 ran out of memory assembling the rendezvous table");
        return DDP_ERR_OUT_OF_MEMORY;
    }
    for (i = 0; i < g->world_size; i++) {
        ddp__table_line(rec, i, table + len, DDP__RECORD_MAX - 1);
        len += strlen(table + len);
        table[len++] = '\n';
    }
    ddp__key(g, key, sizeof key, "table", -1);
    r = ddp__store_compare_set(g->member.store, key, "", 0, table, len, marker, sizeof marker - 1, &n);
    ddp__free(table);
    if (r) return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    marker[DDP__MIN(n, sizeof marker - 1)] = '\0';
    if (strncmp(marker, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) /* a rank failed just before */
        return ddp__rdzv_fail_published(g, marker + strlen(DDP__RDZV_ABORTED));
    ddp__key(g, key, sizeof key, "ready", -1);
    if ((r = ddp_store_set(g->member.store, key, "1", 1)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Rank 0 has not published the table in time, nor why: name the ranks whose records are missing (at most
   16 looked up: this is the rare path where rank 0 itself is stuck or absent). */
static ddp_result ddp__rdzv_await_timeout(ddp_group *g, const char *where) {
    char key[256], missing[512] = "";
    int i, exists, shown = 0, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    for (i = 0; i < g->world_size && shown < 16; i++) {
        ddp__key(g, key, sizeof key, "rank", i);
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown++ ? ", " : "", i);
    }
    return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for every rank to join through %s (missing: %s; "
                     "rank 0 publishes the table of addresses once all have joined). Are they all started, with the "
                     "same world size and master?", g->timeout, where, missing[0] ? missing : "none: is rank 0 stuck?");
}

/* Every rank but 0: one WAIT for the table, one GET of it, then its lines into rec. */
static ddp_result ddp__rdzv_await(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], *table, *line, msg[DDP__ERR_MAX];
    const char *keys[1];
    size_t cap = (size_t)g->world_size * DDP__RECORD_MAX, n = 0;
    int i;
    ddp_result r;
    ddp__key(g, key, sizeof key, "ready", -1);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, g->timeout + DDP__RDZV_GRACE);
    if (r == DDP_ERR_TIMEOUT) return ddp__rdzv_await_timeout(g, where);
    if (r) return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "table", -1); /* set before "ready": the records, or a published failure */
    if (!(table = (char *)ddp__malloc(cap + 1))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    if ((r = ddp_store_get(g->member.store, key, table, cap, &n)) != DDP_SUCCESS) {
        ddp__free(table);
        return ddp__fail(g, r, "rendezvous: reading the table: %s", ddp_store_last_error(g->member.store));
    }
    table[DDP__MIN(n, cap)] = '\0';
    if (strncmp(table, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) {
        r = ddp__rdzv_fail_published(g, table + strlen(DDP__RDZV_ABORTED));
        ddp__free(table);
        return r;
    }
    for (i = 0, line = table; i < g->world_size && line && ddp__table_parse(line, rec, i, g->world_size); i++)
        if ((line = strchr(line, '\n')) != NULL) line++;
    ddp__free(table);
    if (i == g->world_size && n <= cap) return DDP_SUCCESS;
    snprintf(msg, sizeof msg, "the rendezvous table in %s is malformed at rank %d's line (%zu bytes; another program "
             "using the same store?)", where, i, n);
    return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
}

/* ---- the job's identity in the store ----
   Two jobs can meet in one store: a job whose rank 0 could not bind MASTER_PORT (another job holds it)
   still has ranks that connect there, to the other job's store. Before any rank claims its rank, the
   world group's rank 0 records the job in "<prefix>job" ("world=W pid=P host=H run=ID", ID being
   TORCHELASTIC_RUN_ID, which torchrun and ddprun set; empty when unknown) and every rank reads that
   record first: a different run id, or a job whose ranks have all joined already, is another job,
   and this rank fails at once saying so, without writing anything into the other job's store.
   Rank 0 writes it with compare_set, so that under torchrun's agent store (where every rank is a
   client) a record already there is compared like any other. */
typedef struct ddp__job {
    int world, pid;
    char host[128];
    char run[128]; /* "" when the launcher named no run */
} ddp__job;

static int ddp__job_parse(const char *value, ddp__job *j) {
    const char *run = strstr(value, " run=");
    memset(j, 0, sizeof *j);
    if (!run || sscanf(value, "world=%d pid=%d host=%127s", &j->world, &j->pid, j->host) != 3) return 0;
    snprintf(j->run, sizeof j->run, "%s", run + 5);
    return 1;
}

/* *foreign = 1 when this rank must write nothing into the store: it belongs to another job (g->error
   says so), or rank 0 never recorded the job there. */
static ddp_result ddp__rdzv_job(ddp_group *g, const char *where, int file_store, int *foreign) {
    char key[256], mine[512], value[512], host[128], advice[256];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID");
    double start = ddp__now(), nap = 0.001;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    ddp_result r;
    *foreign = 0;
    if (!run) run = "";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(mine, sizeof mine, "world=%d pid=%d host=%s run=%.127s", g->world_size, (int)getpid(), host, run);
    ddp__key(g, key, sizeof key, "job", -1);
    if (g->rank == 0) {
        if ((r = ddp__store_compare_set(g->member.store, key, "", 0, mine, strlen(mine), value, sizeof value - 1, &n)) !=
            DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    } else {
        for (;;) { /* rank 0 records the job first thing; wait for it as for the store */
            int exists = 0, aborted = 0;
            if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
                return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
            if (exists) break;
            if ((r = ddp__rdzv_check_abort(g, &aborted)) != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
            if (ddp__now() - start > g->timeout) {
                *foreign = 1; /* whose store this is is not known: write nothing into it */
                return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for rank 0 to register this job in %s: "
                                 "is rank 0 running? (If another program holds that port, rank 0 could not start the "
                                 "store: pick another MASTER_PORT or use ddprun --standalone)", g->timeout, where);
            }
            ddp__sleep(nap);
            nap = DDP__MIN(nap * 2, 0.05);
        }
        if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (g->rank == 0 && strcmp(value, mine) == 0) return DDP_SUCCESS; /* recorded it: the usual case */
    if (file_store)
        snprintf(advice, sizeof advice, "is the file used by another job, or left behind by one that did not finish? "
                 "give this job a new file");
    else
        snprintf(advice, sizeof advice, "is MASTER_PORT already used by another job? pick another port or use "
                 "ddprun --standalone");
    *foreign = 1;
    if (!ddp__job_parse(value, &them))
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: its record \"%.100s\" was not written by ddp.h's "
                         "rendezvous; %s", where, value, advice);
    if (run[0] && them.run[0] && strcmp(run, them.run) != 0)
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job (run id %s, rank 0 is pid %d on host %s, started with "
                         "world size %d); this job's run id is %s: %s", where, them.run, them.pid, them.host, them.world,
                         run, advice);
    /* Same or unknown run id. A job whose ranks have all joined has no place for this one: every rank
       of this job joins only after reading the record, so a full count means another job, or a second
       process with this rank arriving late. */
    ddp__key(g, key, sizeof key, "joined", -1);
    if ((r = ddp_store_add(g->member.store, key, 0, &joined)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    if (joined >= them.world) {
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: all %d ranks of the job there have joined already (run id "
                 "%s, rank 0 is pid %d on host %s, started with world size %d); this job's run id is %s, its world size "
                 "%d: %s (if this process belongs to that job, it is a second process with rank %d: check RANK)", where,
                 them.world, them.run[0] ? them.run : "unknown", them.pid, them.host, them.world, run[0] ? run : "unknown",
                 g->world_size, advice, g->rank);
    }
    *foreign = 0;
    if (them.world != g->world_size) { /* said here, before joining: rank 0 gathers only a world of its size */
        snprintf(mine, sizeof mine, "ranks disagree on the world size: rank 0 (host %s, pid %d) was started with world "
                 "size %d, rank %d (host %s, pid %d) with %d; start every rank with the same WORLD_SIZE", them.host,
                 them.pid, them.world, g->rank, host, (int)getpid(), g->world_size);
        return ddp__rdzv_abort(g, DDP_ERR_MISMATCH, mine);
    }
    return DDP_SUCCESS;
}

/* Rank 0 could not start the store: MASTER_PORT is taken. Whose is it? Connect as a client for a few
   seconds. If it is this job's store (a job record of the same run id, or of none; the same world size;
   not every rank joined; a rank-0 claim made; its rank 0 alive where this host can tell), this process
   is a second one with rank 0: publish that, so that every rank fails at once rather than at the
   timeout, and fail with it. If the server there does not speak the store protocol, err (port in use)
   says so too. Returns r, or DDP_ERR_INIT for a second rank 0 (err then says so). */
static ddp_result ddp__rank0_port_taken(ddp_group *g, const ddp__launch *L, ddp_result r, char *err) {
    char key[256], claim[256], value[512], why[DDP__ERR_MAX], host[128], msg[DDP__ERR_MAX];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID") ? ddp__env("TORCHELASTIC_RUN_ID") : "";
    double window = DDP__MIN(g->timeout, 3.0), until = ddp__now() + window;
    int exists = 0, claimed = 0, ours;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    if (ddp__store_connect(L->master_addr, L->master_port, NULL, window, &g->member.store, why) != DDP_SUCCESS) {
        if (strstr(why, "does not speak the store protocol") && strlen(err) + 4 < DDP__ERR_MAX)
            snprintf(err + strlen(err), DDP__ERR_MAX - strlen(err), " (%.600s)", why);
        return r;
    }
    ddp__key(g, key, sizeof key, "job", -1);
    ddp__key(g, claim, sizeof claim, "claim", 0);
    while (!(exists && claimed) && ddp__now() < until) { /* the other rank 0 records the job, then claims */
        if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS ||
            ddp_store_check(g->member.store, claim, &claimed) != DDP_SUCCESS)
            break;
        if (!(exists && claimed)) ddp__sleep(0.02);
    }
    ours = exists && claimed && ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS;
    value[ours ? DDP__MIN(n, sizeof value - 1) : 0] = '\0';
    ddp__key(g, key, sizeof key, "joined", -1);
    ours = ours && ddp__job_parse(value, &them) && !(run[0] && them.run[0] && strcmp(run, them.run) != 0) &&
           them.world == g->world_size && ddp_store_add(g->member.store, key, 0, &joined) == DDP_SUCCESS &&
           joined < them.world;
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    if (ours && strcmp(them.host, host) == 0 && kill((pid_t)them.pid, 0) != 0 && errno == ESRCH) ours = 0;
    if (!ours) {
        ddp__store_free(g->member.store);
        g->member.store = NULL;
        return r;
    }
    g->member.owns_store = 1;
    snprintf(msg, sizeof msg, "two processes claim rank 0: pid %d on host %s serves the store on %s:%d, and pid %d on "
             "host %s, also rank 0, could not; every process needs its own rank (check RANK or the launcher's settings)",
             them.pid, them.host, L->master_addr, L->master_port, (int)getpid(), host);
    ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    ddp__key(g, key, sizeof key, "abort_seen", -1); /* as any process that read it: rank 0 need not wait for this one */
    ddp_store_add(g->member.store, key, 1, &joined);
    return ddp__fail_to(err, DDP_ERR_INIT, "%s", msg);
}

/* Claim this rank (a second process with the same rank sees a count above 1: it fails, naming the first
   when its record is there) and publish its record. */
static ddp_result ddp__rdzv_claim(ddp_group *g, const ddp__record *me, const char *where) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX], first[200] = "";
    int64_t claims = 0;
    int exists = 0;
    size_t n = 0;
    ddp__record them;
    ddp_result r;
    ddp__key(g, key, sizeof key, "claim", g->rank);
    if ((r = ddp_store_add(g->member.store, key, 1, &claims)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "rank", g->rank);
    if (claims > 1) {
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && exists &&
            ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS &&
            (value[DDP__MIN(n, sizeof value - 1)] = '\0', ddp__record_parse(value, &them)))
            snprintf(first, sizeof first, " (the first is pid %d on host %.100s)", them.pid, them.host);
        snprintf(msg, sizeof msg, "two processes claim rank %d%s; the second is pid %d on host %s. Every process needs "
                 "its own rank (check RANK or the launcher's settings)", g->rank, first, me->pid, me->host);
        return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    }
    ddp__record_format(me, value, sizeof value);
    if ((r = ddp_store_set(g->member.store, key, value, strlen(value))) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Keep the table as the group's directory (link.c dials from it): the numbers, and each address and
   host name once per run of ranks that share it (ranks of one host are usually neighbours). */
static uint32_t ddp__dir_string(ddp_group *g, const char *text, int prev) {
    size_t n = strlen(text) + 1;
    if (prev >= 0 && strcmp(g->mesh.names + prev, text) == 0) return (uint32_t)prev;
    if (g->mesh.names_len + n > g->mesh.names_cap) {
        size_t cap = DDP__MAX(g->mesh.names_cap * 2, g->mesh.names_len + n + 256);
        char *grown = (char *)ddp__malloc(cap);
        if (!grown) return UINT32_MAX;
        if (g->mesh.names_len) memcpy(grown, g->mesh.names, g->mesh.names_len);
        ddp__free(g->mesh.names);
        g->mesh.names = grown, g->mesh.names_cap = cap;
    }
    memcpy(g->mesh.names + g->mesh.names_len, text, n);
    g->mesh.names_len += n;
    return (uint32_t)(g->mesh.names_len - n);
}

static ddp_result ddp__dir_fill(ddp_group *g, const ddp__record *rec) {
    int i;
    if (!(g->mesh.dir = (ddp__peer_info *)ddp__calloc((size_t)g->world_size, sizeof *g->mesh.dir)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
    for (i = 0; i < g->world_size; i++) {
        ddp__peer_info *d = &g->mesh.dir[i];
        d->port = rec[i].port, d->pid = rec[i].pid, d->node = rec[i].node;
        d->addr = ddp__dir_string(g, rec[i].addr, i > 0 ? (int)g->mesh.dir[i - 1].addr : -1);
        d->host = ddp__dir_string(g, rec[i].host, i > 0 ? (int)g->mesh.dir[i - 1].host : -1);
        if (d->addr == UINT32_MAX || d->host == UINT32_MAX) {
            ddp__free(g->mesh.dir);
            g->mesh.dir = NULL;
            return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
        }
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__rendezvous(ddp_group *g, const char *addr, int port, const char *where) {
    char key[256];
    ddp__record *rec;
    int64_t joined = 0;
    int i, same_host = 0, local_index = 0;
    ddp_result r;

    rec = (ddp__record *)ddp__calloc((size_t)g->world_size, sizeof *rec);
    if (!rec) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    rec[g->rank].world = g->world_size;
    rec[g->rank].port = port;
    rec[g->rank].pid = (int)getpid();
    snprintf(rec[g->rank].addr, sizeof rec[g->rank].addr, "%s", addr);
    if (gethostname(rec[g->rank].host, sizeof rec[g->rank].host) != 0) snprintf(rec[g->rank].host, sizeof rec[g->rank].host, "?");
    rec[g->rank].host[sizeof rec[g->rank].host - 1] = '\0';
    rec[g->rank].node = ddp__node_key();
    if ((r = ddp__rdzv_claim(g, &rec[g->rank], where)) != DDP_SUCCESS) goto done;
    ddp__key(g, key, sizeof key, "joined", -1); /* read by ddp__rdzv_job: a full count means another job */
    if ((r = ddp_store_add(g->member.store, key, 1, &joined)) != DDP_SUCCESS) {
        r = ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
        goto done;
    }
    r = g->rank == 0 ? ddp__rdzv_gather(g, rec, where) : ddp__rdzv_await(g, rec, where);
    if (r) goto done;
    for (i = 0; i < g->world_size; i++)
        if (strcmp(rec[i].host, rec[g->rank].host) == 0) {
            if (i < g->rank) local_index++;
            same_host++;
        }
    if (g->local_rank < 0 || g->local_world_size < 0) {
        g->local_rank = local_index;
        g->local_world_size = same_host;
    }
    r = ddp__dir_fill(g, rec);
done:
    ddp__free(rec);
    return r;
}

/* The address of this host's interface that routes to the master (a UDP "connect" sends nothing). */
static void ddp__route_address(const char *master, int port, char *out, size_t cap) {
    struct addrinfo hints, *res = NULL;
    char service[16];
    int fd;
    snprintf(out, cap, "127.0.0.1");
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_DGRAM;
    snprintf(service, sizeof service, "%d", port);
    if (!master || getaddrinfo(master, service, &hints, &res) != 0) return;
    fd = socket(res->ai_family, SOCK_DGRAM, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) ddp__net_local_address(fd, out, cap);
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
}

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

/* Free everything g holds (connections closed without goodbye: for failed inits and after goodbye).
   Also frees a group whose allocation stopped half way (its arrays may be NULL). */
static void ddp__group_free(ddp_group *g) {
    ddp__live_remove(g, DDP__LIVE_GROUP); /* from here on, calls on g fail instead of reading freed memory */
    ddp__progress_stop(g);
    ddp__ck_async_end(g); /* before its work handle is released */
    ddp__work_release_all(g);
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

/* Ranks share memory only within one host and one network namespace (tests put "hosts" in
   namespaces on one machine; each namespace counts as a host). */
static uint64_t ddp__host_key(void) {
    char buf[512] = "", ns[128] = "";
    FILE *f;
    ssize_t k = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    gethostname(buf, 200);
    buf[200] = '\0';
    snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "|%s|", ns);
    if ((f = fopen("/proc/sys/kernel/random/boot_id", "r")) != NULL) {
        size_t len = strlen(buf);
        if (fgets(buf + len, (int)(sizeof buf - len), f) == NULL) buf[len] = '\0';
        fclose(f);
    }
    return ddp__hash(buf);
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
        r = same ? ddp__shm_setup(g) : ddp__hier_setup(g, keys);
    }
    ddp__free(all);
    return r;
}

/* Rendezvous and connect a freshly allocated group whose store and prefix are set: after the table,
   the group's own barrier makes the first connections (link.c: the ring and the ranks 2^k away), and
   the set-up's collectives run with in_setup on, so that a rank lost on the way is also looked for in
   the store (ddp__setup_watch). The listening socket stays open for the group's life. */
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
    g->mesh.in_setup = 1;
    if ((r = ddp__mesh_barrier(g)) == DDP_SUCCESS && (r = ddp__choose_transport(g)) == DDP_SUCCESS &&
        (r = ddp__rdzv_check_abort(g, &aborted)) == DDP_SUCCESS && aborted)
        r = DDP_ERR_INIT;
    g->mesh.in_setup = 0;
    return r;
}

/* link.c's look at the store during the set-up (see internal.h). */
static ddp_result ddp__setup_watch(ddp_group *g, int peer) {
    char how[64];
    int aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    if (peer >= 0 && g->mesh.dir && ddp__pid_gone(g->mesh.dir[peer].pid, g->mesh.dir[peer].node, ddp__node_key())) {
        snprintf(how, sizeof how, "its process no longer exists");
        return ddp__setup_lost(g, peer, how);
    }
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
    *out = g;
    return DDP_SUCCESS;
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

/* The last step of ddp_init. Backend "nccl": the connected group gets its communicator (nccl.c); when
   that fails (on every rank alike: the ranks agree on each step), the group is taken down in order. */
static ddp_result ddp__init_done(ddp_group *g, int nccl, ddp_group **out) {
    char msg[DDP__ERR_MAX];
    int rank = g->rank, world = g->world_size;
    ddp_result r;
    if (nccl && (r = ddp__nccl_attach(g, NULL)) != DDP_SUCCESS) {
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

DDP_API ddp_result ddp_init(const ddp_init_desc *desc, ddp_group **out) {
    ddp_init_desc zero;
    ddp__launch L;
    ddp_group *g;
    char err[DDP__ERR_MAX], where[320];
    const char *backend;
    char early_msg[DDP__ERR_MAX];
    double timeout;
    int nccl, foreign = 0, told = 0;
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

    g = ddp__group_alloc(L.rank, L.world_size);
    if (!g) return ddp__fail(NULL, DDP_ERR_OUT_OF_MEMORY, "ddp_init: out of memory");
    g->timeout = timeout;
    g->log_level = desc->log_level != DDP_LOG_DEFAULT ? desc->log_level : ddp__env_log_level();
    g->log_fn = desc->log_fn;
    g->log_user = desc->log_user;
    g->local_rank = L.local_rank;
    g->local_world_size = L.local_world_size;
    snprintf(g->member.prefix, sizeof g->member.prefix, "ddp/%d/", L.restart_count);
    if (L.world_size == 1 && !L.file_path && !L.master_port) { /* alone: nothing to connect */
        g->local_rank = 0;
        g->local_world_size = 1;
        return ddp__init_done(g, nccl, out);
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
        int spare = L.rank == 0 ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
        if (L.rank == 0) r = ddp__store_server_start(L.master_addr, L.master_port, g->log_level, &g->member.store_server, err);
        if (L.rank == 0 && r != DDP_SUCCESS) r = ddp__rank0_port_taken(g, &L, r, err);
        if (L.rank == 0 && r == DDP_SUCCESS) { /* where its server says that it cannot accept a rank: */
            char abort_key[256], table_key[256], ready_key[256]; /* as ddp__rdzv_abort publishes it */
            ddp__key(g, abort_key, sizeof abort_key, "abort", -1);
            ddp__key(g, table_key, sizeof table_key, "table", -1);
            ddp__key(g, ready_key, sizeof ready_key, "ready", -1);
            ddp__store_server_abort_key(g->member.store_server, abort_key, table_key, ready_key);
        }
        if (spare >= 0) close(spare);
        if (r == DDP_SUCCESS) r = ddp__store_connect(L.master_addr, L.master_port, NULL, timeout, &g->member.store, err);
        if (r != DDP_SUCCESS && g->member.store_server) ddp__rank0_cannot_connect(g, &L, r, err);
        ddp__route_address(L.master_addr, L.master_port, g->member.address, sizeof g->member.address);
    }
    if (r) {
        ddp__group_free(g);
        if (early) return ddp__fail(NULL, early, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, early_msg);
        return ddp__fail(NULL, r, "ddp_init (rank %d of %d, from %s): %s", L.rank, L.world_size, L.source, err);
    }
    g->member.owns_store = 1;
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
    return ddp__init_done(g, nccl, out);
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

DDP_API ddp_result ddp_destroy(ddp_group *g) {
    ddp_result r = DDP_SUCCESS, subs;
    if (!g) return DDP_SUCCESS;
    if ((r = ddp__group_check(g, "ddp_destroy")) != DDP_SUCCESS) return r;
    ddp__ck_async_end(g); /* a checkpoint save in flight finishes first (its own group meets here on every rank) */
    subs = ddp__destroy_subgroups(g);
    ddp__drain(g);
    if (g->world_size > 1 && !g->broken) {
        r = ddp_barrier(g); /* nobody closes a connection that a peer may still be waiting on */
        if (r) {
            ddp__fail(NULL, r, "ddp_destroy: %s", g->error);
        } else {
            g->backend->close(g, 1); /* hier.c's stage groups say goodbye among themselves first */
            ddp__say_goodbye(g, DDP__MIN(g->timeout, 10.0));
        }
    }
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
