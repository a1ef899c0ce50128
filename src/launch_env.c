/* [SECTION] launch-env: who am I and where is rank 0: the launchers' environments (torchrun/ddprun,
   Open MPI, MPICH/Hydra, SLURM), init_method, the timeout
   ddp_init's steps 1 and 2 (group.c lists the five): the descriptor first, then the environment. */
#include "internal.h"

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
