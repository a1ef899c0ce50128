/* [SECTION] ft: per-step fault tolerance: the step a view runs (ddp_ft_step)
   Fault-tolerant training (issue #39) runs each optimizer step in a VIEW: the members of the job that are
   alive, ordered by a stable id (the initial ranks keep theirs, joiners come after them); a member's rank
   is its index in the view. A step ends in one verdict that every member shares: COMMIT (apply the
   optimizer, go on to the next step) or REDO (a member was lost or admitted: run the same step again in
   the new view, on the same global batch). The data follows the step, not the rank:
   ddp_sampler_step_batch gives a rank its share of a step's global batch for any number of members.

   Turn it on with ddp_init_desc.fault_tolerant = 1 (or DDP_FT=1) on the cpu or nccl backend; then a lost member
   no longer breaks the group: every call that meets the loss answers DDP_ERR_VIEW_CHANGED, and the next
   ddp_ft_begin / ddp_ft_commit runs a view change among the survivors (src/ft.c, src/ft_view.c: a
   majority of the view decides, so a network partition never lets both sides go on) and rebuilds the
   data plane for the new view. The loop:

       ddp_ft_step st = {0};
       for (;;) {
           if (ddp_ft_begin(g, &st)) fail;                       view of this step: st.rank, st.world_size
           if (st.step == steps_per_epoch) { st.epoch++; st.step = 0; if (done) break; continue; }
           ddp_sampler_step_batch(sampler, &st, G, idx, &n);     this rank's share of the global batch
           forward; ddp_reducer_begin_backward(r); ddp_reducer_set_local_samples(r, n);
           backward with ddp_reducer_grad_ready ...; res = ddp_reducer_end_backward(r);
           if (res == DDP_ERR_VIEW_CHANGED) continue;            the pass is void: redo the step
           res = ddp_ft_commit(g, &st);                          the vote
           if (res == DDP_SUCCESS) optimizer_step();             st.step moved on
           else if (res != DDP_ERR_VIEW_CHANGED) fail;           DDP_ERR_VIEW_CHANGED: redo st.step
       }

   Every collective of the step (the program's own, SyncBatchNorm's) may answer DDP_ERR_VIEW_CHANGED: redo
   the step then, never exit. A redone step must start from the state the step started from: what forward
   changes before the commit (BatchNorm's running statistics) the program puts back. Uneven shares: with
   ddp_reducer_set_local_samples each rank's gradient is the mean over its own n samples; that is right
   when the ranks meet only in the reducer. When a layer couples them in backward (SyncBatchNorm all-reduces
   sums of the output gradients), scale each rank's loss by world_size / N instead (N = the step's samples
   over the view: the sum of the shares, min(G, padded length - step G)) and leave the reducer unweighted:
   every rank's output gradients then carry the same 1 / N, and the average is over the step's samples.

   A replacement joins at a step boundary: a process started with DDP_FT_JOIN=1 (ddprun --ft restarts a
   lost worker so) makes its reducer as the members did (ddp_reducer_finalize is local on it), registers
   the same state with ddp_ft_register, and its first ddp_ft_begin asks the view's first member for an
   id (found through the job's store: rank 0's, or ddprun's under --ft); the next vote counts it, the view
   change after it admits it, and the new view's rank 0 sends it every registered buffer (CRC-32C
   checked) with the epoch and step: its ddp_ft_begin returns with st->joined = 1 and the step the members
   run next. Its sampler takes num_replicas = the first view's size (WORLD_SIZE from the launcher). A view
   change admits one joiner (several wait their turn, one change each).

   A member that the others left out of a view (it was stopped, or on the far side of a partition), or that
   finds no quorum (cut off from the majority), does not stop: it drops to a group of one and its next
   ddp_ft_begin (the same call, when the change ran there) rejoins as a joiner would: a new id, admitted
   by the members, their state sent to it (st->joined = 1). It tries for 10 x suspect_seconds (5 s when
   the view's first member refuses it: the job has ended), then fails with DDP_ERR_PEER_LOST naming why it
   left and why it could not come back.

   Built: the calls below on the cpu backend (shm, tcp, hier) and on nccl (src/nccl.c, "fault tolerance":
   non-blocking communicators; a new view's is shrunk from the old one with ncclCommShrink where NCCL has
   it (2.27+; on a failure the communicator is revoked, 2.28+, not aborted) and the view only lost members,
   else made anew after an abort; registered state in device memory goes to joiners through NCCL, checked
   on a host copy. Tested on the CPU harness's fake NCCL playing 2.18 and 2.28; not yet run on GPUs). The
   mpi backend answers DDP_ERR_UNSUPPORTED at ddp_init; zero_stage > 0 is refused in this mode. A joiner
   needs the job's store (rank 0's, or ddprun's under --ft) and a view with a member from before it (the
   state's donor).
   Limits: every pair of members holds a control connection (n - 1 sockets per member); ddp_alloc gives
   heap memory (each view maps its own shared segment); subgroups made before a view change are broken by
   it; the reducer keeps its registration order (no bucket rebuild) so every view has the same layout; a
   silent (not dead) member is suspected after suspect_seconds without progress in a collective (while
   fault tolerance runs, collectives wait that long on a silent peer, not DDP_TIMEOUT: suspect_seconds must
   exceed the longest wait of one rank for another in a step -- compute skew, a checkpoint's write), then
   suspect_seconds more in the view change; a job admits at most twice its first size + 62 members in its life. */

/* One step of fault-tolerant training: which view runs it, which step of which epoch, and this process's
   place in the view. The program owns it (zero it before the first ddp_ft_begin); ddp_ft_begin fills the
   view's part (gen, rank, world_size, joined); the program counts epochs and steps as said below. */
typedef struct ddp_ft_step {
    /* The view's generation: every view change installs a view with a higher gen than any before it, so
       two views of one job never share a gen. Nothing in the sampler reads it. */
    uint64_t gen;
    /* The step of epoch `epoch` that is being run: the number of steps of the epoch committed so far.
       A successful commit advances it by one; a REDO leaves it, so the same step (the same global batch)
       runs again in the new view. After the epoch's last commit (from there on ddp_sampler_step_batch hands
       out 0 indices) the program starts the next epoch itself: epoch++, step = 0. */
    uint64_t step;
    /* The epoch: the sampler's shuffle is that of seed + epoch, as torch's set_epoch(epoch) gives (in
       fault-tolerant mode there is no ddp_sampler_set_epoch: the sampler follows this field). */
    uint64_t epoch;
    /* This process's index in the view, 0 <= rank < world_size: its place among the members ordered by
       stable id. It can change at a view change (when members before it are lost), unlike the stable id. */
    int rank;
    /* W: the number of members of the view, >= 1. Fewer than the first view's after a loss (survivors),
       more after joins. */
    int world_size;
    /* Nonzero in the ddp_ft_begin that admitted this process into a running job as a joiner (gen, step,
       epoch, rank and world_size then come from the view, the registered state from a live donor); 0 for
       a process that was a member of the view before. */
    int joined;
} ddp_ft_step;

/* Name state a joiner must receive (the parameters, the optimizer's moments, counters): `bytes` bytes at
   `data`, sent as they are when a joiner is admitted (after the step's optimizer update). Every process
   registers the same names and sizes in the same order, before its first ddp_ft_begin. */
DDP_API ddp_result ddp_ft_register(ddp_group *g, const char *name, void *data, size_t bytes);
/* Begin a step: returns the view it runs in (st->gen, rank, world_size, joined), keeping st->epoch and
   st->step. The first call on a group is collective (it connects the members' control connections).
   After a pass or a vote that met DDP_ERR_VIEW_CHANGED it runs the view change first (it waits until the
   survivors agree, at least suspect_seconds when a member is silent rather than gone). Errors: DDP_ERR_STATE
   (fault tolerance off), DDP_ERR_PEER_LOST (this member is cut off from the majority, was left out of the
   view, or fewer than min_world_size members are left). */
DDP_API ddp_result ddp_ft_begin(ddp_group *g, ddp_ft_step *st);
/* End a step whose reduction finished (ddp_reducer_end_backward returned DDP_SUCCESS): one 8-byte MIN
   all-reduce decides whether every member finished it. DDP_SUCCESS: apply the optimizer step; st->step
   has moved on (it may also come after a member was lost, when every member had finished the reduction:
   the step then holds the lost member's share, counted once). DDP_ERR_VIEW_CHANGED: the step is void in
   every member; the new view is in st; run st->step again. */
DDP_API ddp_result ddp_ft_commit(ddp_group *g, ddp_ft_step *st);

