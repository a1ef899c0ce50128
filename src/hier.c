/* [SECTION] hier: hierarchical all_reduce for a group that spans hosts with several ranks on a host
   (NCCL's and Gloo's two-level all-reduce; torch.distributed gets it from its backends)

   A group whose ranks are not all on one host runs its collectives over the TCP mesh, and a ring over
   all ranks crosses the loopback device once for every pair of neighbours on the same host. Large
   all_reduces (above the recursive-doubling size, collectives.c) in such a group run three stages:

       host:     all_reduce among the ranks of each host, over shared memory    (g->hier_host)
       leaders:  all_reduce among the first rank of every host, over TCP        (g->hier_leaders)
       host:     broadcast from that first rank to the rest of its host         (g->hier_host)

   Only the leaders' stage crosses hosts, with what a ring over the H hosts needs: 2(H-1)/H of the
   buffer each way per host; the host stages run at memory speed. Both groups are made when the group
   is set up (every rank computes the same host map from the host keys that shm.c gathers) and live as
   long as it. A host with one rank has no host group; a group with one rank per host has neither, and
   neither does a group under DDP_TRANSPORT=tcp (shm.c then gathers no host keys).

   Mismatches: each stage is a collective of its own group and can only check calls within it. So a
   hierarchical all_reduce first agrees on the call in the group itself: recursive doubling with no
   data (log2(n) exchanges of a frame header carrying the call's fingerprint), which fails every rank
   on any difference exactly as a small all_reduce does (collectives.c). Past it every rank runs the
   same stages. A failure in a stage (a lost rank, a timeout) breaks the other stage's group and the
   group itself with the same message, so every rank fails, whichever stage it waits in.
   Op AVG runs as SUM in the stages and divides once at the end, as the ring does. */
#include "internal.h"

/* Called by shm.c's set-up when the group's ranks are not all on one host; keys holds every rank's
   host key. Collective: every rank derives the same host map, so all decide alike. */
static ddp_result ddp__hier_setup(ddp_group *g, const uint64_t *keys) {
    int n = g->world_size, i, j, nhost = 0, nlead = 0, my_index = 0, lead_index = 0, shared = 0;
    int *host = (int *)ddp__calloc((size_t)n, sizeof *host), *leaders = (int *)ddp__calloc((size_t)n, sizeof *leaders);
    char name[32];
    ddp_result r = DDP_SUCCESS;
    if (!host || !leaders) {
        ddp__free(host);
        ddp__free(leaders);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory mapping the group's hosts");
    }
    for (i = 0; i < n; i++) { /* a host's leader is its lowest rank */
        for (j = 0; j < i && keys[j] != keys[i]; j++) continue;
        if (j == i) leaders[nlead++] = i;
        else shared = 1;
        if (i == g->rank) lead_index = nlead - 1; /* used only when this rank leads its host */
        if (keys[i] != keys[g->rank]) continue;
        if (i == g->rank) my_index = nhost;
        host[nhost++] = i;
    }
    if (shared) {
        snprintf(name, sizeof name, "host%d", host[0]);
        if (nhost > 1) r = ddp__subgroup_open(g, host, nhost, my_index, name, NULL, "setting up the hierarchical all_reduce", &g->hier_host);
        if (r == DDP_SUCCESS && host[0] == g->rank)
            r = ddp__subgroup_open(g, leaders, nlead, lead_index, "leaders", NULL, "setting up the hierarchical all_reduce",
                                   &g->hier_leaders);
        if (r == DDP_SUCCESS) {
            g->hier = 1;
            ddp__log(g, DDP_LOG_INFO, "%d ranks on %d hosts: large all_reduces run hierarchically (shared memory within a "
                     "host, TCP between hosts)", n, nlead);
        }
    }
    ddp__free(host);
    ddp__free(leaders);
    return r;
}

/* The end of a group: its stage groups go first (ddp_destroy after the group's own barrier: every rank
   is there, so their barriers meet), or are just freed when the group is failing. */
static void ddp__hier_close(ddp_group *g, int orderly) {
    ddp_group *stages[2];
    int i;
    stages[0] = g->hier_host;
    stages[1] = g->hier_leaders;
    g->hier_host = g->hier_leaders = NULL;
    g->hier = 0;
    for (i = 0; i < 2; i++) {
        if (!stages[i]) continue;
        if (orderly) ddp_destroy(stages[i]);
        else ddp__group_free(stages[i]);
    }
}

/* A stage failed and its group is broken: break the other stage's group and the group itself with the
   same message, so ranks waiting anywhere in this all_reduce fail too. */
static ddp_result ddp__hier_fail(ddp_group *g, ddp_group *stage, const char *stage_name, ddp_result r) {
    char msg[DDP__ERR_MAX];
    const char *why = stage->broken ? stage->broken_msg : stage->error;
    ddp_result code = stage->broken ? stage->broken : r;
    if (strncmp(why, "hierarchical all_reduce", 23) == 0) /* another rank's, already saying where */
        snprintf(msg, sizeof msg, "%s", why);
    else
        snprintf(msg, sizeof msg, "hierarchical all_reduce, %s stage (rank numbers there count within the stage): %.900s",
                 stage_name, why);
    if (g->hier_host && g->hier_host != stage) ddp__group_break(g->hier_host, code, msg);
    if (g->hier_leaders && g->hier_leaders != stage) ddp__group_break(g->hier_leaders, code, msg);
    return ddp__coll_fail(g, code, "%s", msg);
}

static ddp_result ddp__hier_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_op stage_op = op == DDP_AVG ? DDP_SUM : op;
    ddp_result r;
    if ((r = ddp__rd_all_reduce(g, c, NULL, 0, t, op)) != DDP_SUCCESS) return r; /* the agreement: fingerprints only */
    if (g->log_level >= DDP_LOG_DEBUG) {
        char desc[160];
        ddp__coll_describe(c, desc, sizeof desc);
        ddp__log(g, DDP_LOG_DEBUG, "%s: hierarchical (host, between hosts, host broadcast)", desc);
    }
    if (g->hier_host && (r = ddp_all_reduce(g->hier_host, buf, count, t, stage_op)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier_host, "host (shared memory)", r);
    if (g->hier_leaders && (r = ddp_all_reduce(g->hier_leaders, buf, count, t, stage_op)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier_leaders, "between hosts", r);
    if (g->hier_host && (r = ddp_broadcast(g->hier_host, buf, count, t, 0)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier_host, "host broadcast", r);
    if (op == DDP_AVG) ddp__divide(buf, count, t, g->world_size);
    return DDP_SUCCESS;
}
