/* [SECTION] hier: hierarchical all_reduce for a group that spans hosts with several ranks on a host
   (NCCL's and Gloo's two-level all-reduce; torch.distributed gets it from its backends)

   A group whose ranks are not all on one host runs its collectives over the TCP mesh, and a ring over
   all ranks crosses the loopback device once for every pair of neighbours on the same host. Large
   all_reduces (above the recursive-doubling size, tcp.c) in such a group run three stages:

       host:     all_reduce among the ranks of each host, over shared memory    (g->hier.host)
       leaders:  all_reduce among the first rank of every host, over TCP        (g->hier.leaders)
       host:     broadcast from that first rank to the rest of its host         (g->hier.host)

   Only the leaders' stage crosses hosts, with what a ring over the H hosts needs: 2(H-1)/H of the
   buffer each way per host; the host stages run at memory speed. Both groups are made when the group
   is set up (every rank computes the same host map, ddp__hier_plan, from the host keys that group.c
   gathers; group.c opens them as subgroups, ddp__hier_open) and live as long as it. A host with one rank has no host group; a group with one rank per host has neither
   and stays on the tcp backend, and so does a group under DDP_TRANSPORT=tcp (no host keys then).
   Everything else (small all_reduces, the other collectives) runs on the tcp backend's algorithms.

   Mismatches: each stage is a collective of its own group and can only check calls within it. So a
   hierarchical all_reduce first agrees on the call in the group itself: recursive doubling with no
   data (log2(n) exchanges of a frame header carrying the call's fingerprint), which fails every rank
   on any difference exactly as a small all_reduce does (tcp.c). Past it every rank runs the
   same stages. A failure in a stage (a lost rank, a timeout) breaks the other stage's group and the
   group itself with the same message, so every rank fails, whichever stage it waits in.
   Op AVG runs as SUM in the stages and divides once at the end, as the ring does. */
#include "internal.h"

/* The stage groups are group.c's, which made them (ddp__hier_open) and ends them with the group
   (ddp__hier_stages_end): the backend itself holds nothing else. */
static void ddp__hier_close(ddp_group *g, int orderly) { (void)g, (void)orderly; }

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
    if (g->hier.host && g->hier.host != stage) ddp__group_break(g->hier.host, code, msg);
    if (g->hier.leaders && g->hier.leaders != stage) ddp__group_break(g->hier.leaders, code, msg);
    return ddp__coll_fail(g, code, "%s", msg);
}

static ddp_result ddp__hier_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_op stage_op = op == DDP_AVG ? DDP_SUM : op;
    ddp__call reduce, bcast;
    ddp_result r;
    if ((r = ddp__rd_all_reduce(g, c, NULL, 0, t, op)) != DDP_SUCCESS) return r; /* the agreement: fingerprints only */
    if (g->log_level >= DDP_LOG_DEBUG) {
        char desc[160];
        ddp__coll_describe(g, c, desc, sizeof desc);
        ddp__log(g, DDP_LOG_DEBUG, "%s: hierarchical (host, between hosts, host broadcast)", desc);
    }
    reduce = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, stage_op, -1);
    bcast = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, 0);
    if (g->hier.host && (r = ddp__collective(g->hier.host, &reduce)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.host, "host (shared memory)", r);
    if (g->hier.leaders && (r = ddp__collective(g->hier.leaders, &reduce)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.leaders, "between hosts", r);
    if (g->hier.host && (r = ddp__collective(g->hier.host, &bcast)) != DDP_SUCCESS)
        return ddp__hier_fail(g, g->hier.host, "host broadcast", r);
    if (op == DDP_AVG) ddp__divide(buf, count, t, g->world_size);
    return DDP_SUCCESS;
}

/* Large all_reduces in three stages; everything else on the tcp backend. The choice depends only on the
   call (count, dtype), so every rank that agrees on the call makes the same one. */
static ddp_result ddp__hier_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    if (k->kind == DDP__ALL_REDUCE && k->count * ddp_dtype_size(k->dtype) > DDP__RD_MAX_BYTES)
        return ddp__hier_all_reduce(g, c, k->buf, k->count, k->dtype, k->op);
    return ddp__tcp_run(g, k, c);
}

static const ddp__backend ddp__backend_hier = {
    "hier", "cpu", ddp__hier_run, NULL, NULL, NULL, ddp__hier_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out,
    ddp__host_accumulate,
    NULL, NULL, NULL, NULL};

/* The host map of a group whose ranks are not all on one host (keys: every rank's host key), as group.c's
   set-up needs it to open the stage groups: host[] the ranks of this rank's host (nhost, this rank at
   host[my_index]), leaders[] the first rank of every host (nlead, this rank at leaders[lead_index] when it
   leads its host). Every rank derives the same map, so all decide alike. Returns 1 when some host has
   several ranks (the hierarchical all_reduce is worth it), 0 when not, -1 when out of memory; the caller
   frees host and leaders. */
static int ddp__hier_plan(const uint64_t *keys, int n, int rank, ddp__hier_map *m) {
    int i, j, shared = 0;
    memset(m, 0, sizeof *m);
    m->host = (int *)ddp__calloc((size_t)n, sizeof *m->host);
    m->leaders = (int *)ddp__calloc((size_t)n, sizeof *m->leaders);
    if (!m->host || !m->leaders) return -1;
    for (i = 0; i < n; i++) { /* a host's leader is its lowest rank */
        for (j = 0; j < i && keys[j] != keys[i]; j++) continue;
        if (j == i) m->leaders[m->nlead++] = i;
        else shared = 1;
        if (i == rank) m->lead_index = m->nlead - 1; /* used only when this rank leads its host */
        if (keys[i] != keys[rank]) continue;
        if (i == rank) m->my_index = m->nhost;
        m->host[m->nhost++] = i;
    }
    return shared;
}

/* The stage groups are open (g->hier.host, g->hier.leaders, either may be NULL): large all_reduces go
   through them from now on. */
static void ddp__hier_install(ddp_group *g, int nhosts) {
    g->backend = g->host_backend = &ddp__backend_hier;
    ddp__log(g, DDP_LOG_INFO, "%d ranks on %d hosts: large all_reduces run hierarchically (shared memory within a "
             "host, TCP between hosts)", g->world_size, nhosts);
}
