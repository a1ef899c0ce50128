/* [SECTION] zero-state: ZeRO-1 optimizer state consolidated on one rank, split back (reducer.h) */
/* Under zero_stage = 1 each rank keeps optimizer state for its shards only (ddp_reducer_shards). A shard
   state array is this rank's shards' elements concatenated in shard order; a full array is the model's
   elements, parameters concatenated in registration order, so shard j of a rank sits in a full array at
   (start of parameter sh[j].param) + sh[j].offset.
   Consolidation (torch's ZeroRedundancyOptimizer.consolidate_state_dict(to=root)):
   1. the ranks agree on the outcome of their own checks (a bad argument anywhere is an error on every
      rank, with that rank's message), then all-gather a record of their arguments and shard totals and
      check them alike, so nothing moves unless every rank goes on (no rank waits in a gather that
      another skipped); allocations are agreed on the same way;
   2. the shard lists {param, offset, count} go to every rank by all_gather_v (only root uses them);
   3. per state, one gather to root of every rank's array padded to the largest rank's total; root
      copies each rank's pieces to their places in the full array.
   The shards of all ranks cover every element of the model exactly once (the reducer's slice rule), so
   root checks that the pieces add up to full_count and then every element of full is written. */
#include "internal.h"

/* The record each rank contributes in step 1. */
enum { DDP__ZS_NSTATES, DDP__ZS_DTYPE, DDP__ZS_ROOT, DDP__ZS_ELEMENTS, DDP__ZS_NSHARDS, DDP__ZS_FIELDS };

/* Where each parameter starts in a full array; the model's elements in *total. NULL: out of memory. */
static size_t *ddp__zs_starts(ddp_reducer *r, int nparams, size_t *total) {
    size_t *start = (size_t *)ddp__calloc((size_t)nparams + 1, sizeof *start);
    int i;
    *total = 0;
    if (!start) return NULL;
    for (i = 0; i < nparams; i++) start[i] = *total, *total += ddp__reducer_param_count(r, i);
    return start;
}

/* This rank's shard elements. */
static size_t ddp__zs_shard_total(const ddp_shard *sh, int n) {
    size_t total = 0;
    int j;
    for (j = 0; j < n; j++) total += sh[j].count;
    return total;
}

/* The checks one rank can make alone. */
static ddp_result ddp__zs_check(ddp_group *g, const char *fn, ddp_dtype t, int nstates, const void *const *shard_state,
                                size_t shard_count, size_t mine, const void *const *full, size_t full_count, size_t model,
                                int check_full) {
    int k;
    if (!ddp__dtype_valid(t)) return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a ddp_dtype", fn, (int)t);
    if (nstates < 0 || (nstates > 0 && (!shard_state || (check_full && !full))))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: %d states with shard_state %p and full %p", fn, nstates,
                         (const void *)shard_state, (const void *)full);
    if (shard_count != mine)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: rank %d: shard_count is %zu, but this rank's shards hold %zu "
                         "elements (the sum of ddp_reducer_shards' counts): each shard state array must have that many",
                         fn, ddp_rank(g), shard_count, mine);
    if (check_full && full_count != model)
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: rank %d: full_count is %zu, but the model has %zu elements (every "
                         "registered parameter's count, added): each full array must have that many", fn, ddp_rank(g),
                         full_count, model);
    for (k = 0; k < nstates; k++)
        if ((mine && !shard_state[k]) || (check_full && model && !full[k]))
            return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: rank %d: state %d's %s array is NULL", fn, ddp_rank(g), k,
                             mine && !shard_state[k] ? "shard" : "full");
    return DDP_SUCCESS;
}

/* Step 1: the first rank with a bad argument fails every rank with its message (ddp__agree_outcome); then
   every rank's record, and ranks that differ from rank 0 fail every rank. */
static ddp_result ddp__zs_agree(ddp_group *g, const char *fn, ddp_result local, const int64_t *mine, int64_t *all) {
    int world = ddp_world_size(g), k, f;
    static const char *const field[] = {"nstates", "dtype", "root"};
    ddp_result res = ddp__agree_outcome(g, local, fn);
    if (!res) res = ddp_all_gather(g, mine, all, DDP__ZS_FIELDS, DDP_I64);
    for (k = 0; !res && k < world; k++)
        for (f = DDP__ZS_NSTATES; f <= DDP__ZS_ROOT; f++)
            if (all[(size_t)k * DDP__ZS_FIELDS + f] != all[f])
                return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: the ranks disagree: rank 0 passed %s %lld, rank %d "
                                 "passed %lld; every rank must pass the same", fn, field[f], (long long)all[f], k,
                                 (long long)all[(size_t)k * DDP__ZS_FIELDS + f]);
    if (!res && (all[DDP__ZS_ROOT] < 0 || all[DDP__ZS_ROOT] >= world))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %lld is not a rank of this group of %d", fn,
                         (long long)all[DDP__ZS_ROOT], world);
    return res;
}

/* Step 2: every rank's shard list, as {param, offset, count} triples packed in rank order. */
static ddp_result ddp__zs_shard_lists(ddp_group *g, const ddp_shard *sh, int n, const int64_t *all, uint64_t **lists) {
    int world = ddp_world_size(g), k, j;
    size_t *counts = (size_t *)ddp__calloc((size_t)world, sizeof *counts), total = 0;
    uint64_t *mine = (uint64_t *)ddp__calloc(3 * (size_t)n + 1, sizeof *mine);
    ddp_result res = DDP_SUCCESS;
    for (k = 0; counts && k < world; k++) total += counts[k] = 3 * (size_t)all[k * DDP__ZS_FIELDS + DDP__ZS_NSHARDS];
    *lists = (uint64_t *)ddp__calloc(total + 1, sizeof **lists);
    if (!counts || !mine || !*lists) res = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_consolidate_state: out of memory");
    res = ddp__agree_outcome(g, res, "ddp_reducer_consolidate_state"); /* no rank waits for one that cannot take part */
    for (j = 0; !res && j < n; j++) {
        mine[3 * j] = (uint64_t)sh[j].param;
        mine[3 * j + 1] = sh[j].offset;
        mine[3 * j + 2] = sh[j].count;
    }
    if (!res) res = ddp_all_gather_v(g, mine, 3 * (size_t)n, *lists, counts, DDP_I64);
    ddp__free(counts);
    ddp__free(mine);
    return res;
}

/* Step 3, root: rank k's padded array (its pieces in its shard order) into their places in full. */
static void ddp__zs_unpack(const uint64_t *list, int64_t nshards, const char *src, char *full, const size_t *start,
                           size_t es) {
    int64_t j;
    for (j = 0; j < nshards; j++, list += 3) {
        memcpy(full + (start[list[0]] + list[1]) * es, src, list[2] * es);
        src += list[2] * es;
    }
}

/* Step 3: per state, gather the padded arrays to root and unpack them there. */
static ddp_result ddp__zs_gather(ddp_group *g, ddp_dtype t, int nstates, const void *const *shard_state, size_t mine,
                                 void *const *full, const int64_t *all, const uint64_t *lists, const size_t *start,
                                 int root) {
    int world = ddp_world_size(g), rank = ddp_rank(g), s, k;
    size_t es = ddp_dtype_size(t), most = 0;
    char *pad = NULL, *stage = NULL;
    const uint64_t *at;
    ddp_result res = DDP_SUCCESS;
    for (k = 0; k < world; k++) most = DDP__MAX(most, (size_t)all[k * DDP__ZS_FIELDS + DDP__ZS_ELEMENTS]);
    if (most == 0) return DDP_SUCCESS; /* an empty model: nothing to move (every rank sees the same) */
    if (mine < most) pad = (char *)ddp__calloc(most, es);
    if (rank == root) stage = (char *)ddp__calloc((size_t)world * most, es);
    if ((mine < most && !pad) || (rank == root && !stage))
        res = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_reducer_consolidate_state: rank %d: out of memory for %zu elements",
                        rank, rank == root ? (size_t)world * most : most);
    res = ddp__agree_outcome(g, res, "ddp_reducer_consolidate_state");
    for (s = 0; !res && s < nstates; s++) {
        const void *send = shard_state[s];
        if (pad) {
            if (mine) memcpy(pad, shard_state[s], mine * es);
            send = pad;
        }
        res = ddp_gather(g, send, stage, most, t, root);
        if (res || rank != root) continue;
        for (k = 0, at = lists; k < world; k++) {
            int64_t nk = all[k * DDP__ZS_FIELDS + DDP__ZS_NSHARDS];
            ddp__zs_unpack(at, nk, stage + (size_t)k * most * es, (char *)full[s], start, es);
            at += 3 * nk;
        }
    }
    ddp__free(pad);
    ddp__free(stage);
    return res;
}

DDP_API ddp_result ddp_reducer_consolidate_state(ddp_reducer *r, ddp_dtype t, int nstates, const void *const *shard_state,
                                                 size_t shard_count, void *const *full, size_t full_count, int root) {
    static const char *fn = "ddp_reducer_consolidate_state";
    ddp_group *g = NULL;
    const ddp_shard *sh;
    int nparams = 0, n, world, k;
    size_t model = 0, mine, *start = NULL, covered = 0;
    int64_t rec[DDP__ZS_FIELDS], *all = NULL;
    uint64_t *lists = NULL;
    ddp_result res = ddp__reducer_zero_model(r, fn, &g, &nparams), local;
    if (res) return res;
    world = ddp_world_size(g);
    n = ddp_reducer_shards(r, &sh);
    mine = ddp__zs_shard_total(sh, n);
    start = ddp__zs_starts(r, nparams, &model);
    all = (int64_t *)ddp__calloc((size_t)world * DDP__ZS_FIELDS, sizeof *all);
    if (!start || !all) {
        ddp__free(start);
        ddp__free(all);
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    local = ddp__zs_check(g, fn, t, nstates, shard_state, shard_count, mine, (const void *const *)full, full_count, model,
                          ddp_rank(g) == root);
    rec[DDP__ZS_NSTATES] = nstates, rec[DDP__ZS_DTYPE] = (int64_t)t, rec[DDP__ZS_ROOT] = root;
    rec[DDP__ZS_ELEMENTS] = (int64_t)mine, rec[DDP__ZS_NSHARDS] = n;
    res = ddp__zs_agree(g, fn, local, rec, all);
    if (!res) res = ddp__zs_shard_lists(g, sh, n, all, &lists);
    for (k = 0; !res && k < world; k++) covered += (size_t)all[k * DDP__ZS_FIELDS + DDP__ZS_ELEMENTS];
    if (!res && covered != model) /* the slice rule says it cannot happen; never write half a full array */
        res = ddp__fail(g, DDP_ERR_STATE, "%s: the ranks' shards hold %zu elements, the model %zu", fn, covered, model);
    if (!res) res = ddp__zs_gather(g, t, nstates, shard_state, mine, full, all, lists, start, root);
    ddp__free(lists);
    ddp__free(start);
    ddp__free(all);
    return res;
}

DDP_API ddp_result ddp_reducer_shard_state(ddp_reducer *r, ddp_dtype t, int nstates, const void *const *full,
                                           size_t full_count, void *const *shard_state, size_t shard_count) {
    static const char *fn = "ddp_reducer_shard_state";
    ddp_group *g = NULL;
    const ddp_shard *sh;
    int nparams = 0, n, s, j;
    size_t model = 0, mine, *start, es, at;
    ddp_result res = ddp__reducer_zero_model(r, fn, &g, &nparams);
    if (res) return res;
    n = ddp_reducer_shards(r, &sh);
    mine = ddp__zs_shard_total(sh, n);
    if (!(start = ddp__zs_starts(r, nparams, &model))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    res = ddp__zs_check(g, fn, t, nstates, (const void *const *)shard_state, shard_count, mine, full, full_count, model, 1);
    es = ddp_dtype_size(t);
    for (s = 0; !res && s < nstates; s++)
        for (j = 0, at = 0; j < n; at += sh[j].count, j++)
            memcpy((char *)shard_state[s] + at * es, (const char *)full[s] + (start[sh[j].param] + sh[j].offset) * es,
                   sh[j].count * es);
    ddp__free(start);
    return res;
}
