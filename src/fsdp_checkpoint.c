/* [SECTION] fsdp-checkpoint: the full model of a zero_stage 3 reducer in one safetensors file, unit by unit
   (checkpoint.h "FSDP checkpoints" has the API).
   ddp_fsdp_save_full (torch FSDP's FULL_STATE_DICT with rank0_only and offload_to_cpu, without ever holding
   the model): root lays the file out from the registered names, dtypes and shapes (ddp__ck_out_open), then
   for each unit in registration order every rank sends its master shard to root (one gather, the unit's
   purpose in its fingerprint) and root writes the unit's parameters at their places; last the header
   with the checksums, fsync and rename. Root holds one unit's master (the largest unit's world * per
   elements) besides its own state (on the nccl backend, whose shards are device memory, it gathers into
   a device buffer of that size and copies each unit to the host). The outcome is agreed: an error on any rank is every rank's. The
   file is an ordinary safetensors file: torch's safetensors.torch.load_file reads it, and
   ddp_checkpoint_load_slices reads each rank's slices back out of it (a model saved whole loads into
   stage 3 without any rank reading it whole). */
#include "internal.h"

DDP_API ddp_result ddp_fsdp_save_full(ddp_reducer *r, const char *path, int root, const ddp_meta *meta) {
    static const char *what = "ddp_fsdp_save_full";
    ddp_group *g = NULL;
    ddp_tensor *t = NULL;
    ddp__ck_out out;
    int nunits = 0, nparams = 0, i, u, *unit_of = NULL;
    size_t *at = NULL;
    char *buf = NULL;
    void *stage = NULL;
    int no_stage = 0;
    ddp_result res = ddp__fsdp_model(r, what, &g, &nunits, &nparams), mine = DDP_SUCCESS;
    if (res) return res;
    if (root < 0 || root >= ddp_world_size(g))
        return ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank (0 .. %d)", what, root, ddp_world_size(g) - 1);
    ddp__ck_async_settle(g);
    memset(&out, 0, sizeof out);
    out.fd = -1;
    t = (ddp_tensor *)ddp__calloc((size_t)nparams, sizeof *t);
    unit_of = (int *)ddp__calloc((size_t)nparams, sizeof *unit_of);
    at = (size_t *)ddp__calloc((size_t)nparams, sizeof *at);
    if (!t || !unit_of || !at) mine = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    for (i = 0; !mine && i < nparams; i++) ddp__fsdp_param_tensor(r, i, &t[i], &unit_of[i], &at[i]);
    if (!mine && ddp_rank(g) == root) {
        stage = ddp__fsdp_master_stage(r, &no_stage);
        if (no_stage || !(buf = (char *)ddp__malloc(ddp__fsdp_master_bytes(r))))
            mine = ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "%s: out of memory for a unit (%zu bytes)", what, ddp__fsdp_master_bytes(r));
        else
            mine = ddp__ck_out_open(g, path, t, nparams, meta, &out);
    }
    res = ddp__agree_outcome(g, mine, what); /* every rank knows whether root can write before any unit moves */
    for (u = 0; !res && u < nunits; u++) {
        res = ddp__fsdp_gather_master(r, u, buf, stage, root);
        for (i = 0; !res && !mine && ddp_rank(g) == root && i < nparams; i++)
            if (unit_of[i] == u) mine = ddp__ck_out_write(g, &out, i, buf + at[i] * ddp_dtype_size(t[i].dtype));
    }
    if (ddp_rank(g) == root) mine = ddp__ck_out_close(g, &out, res ? res : mine);
    ddp__free(buf);
    ddp__fsdp_master_unstage(r, stage);
    ddp__free(t);
    ddp__free(unit_of);
    ddp__free(at);
    return ddp__agree_outcome(g, res ? res : mine, what);
}
