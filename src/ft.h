/* [SECTION] ft: per-step fault tolerance: the step a view runs (ddp_ft_step)
   Fault-tolerant training (issue #39) runs each optimizer step in a VIEW: the members of the job that are
   alive, ordered by a stable id (the initial ranks keep theirs, joiners come after them); a member's rank
   is its index in the view. A step ends in one verdict that every member shares: COMMIT (apply the
   optimizer, go on to the next step) or REDO (a member was lost or admitted: run the same step again in
   the new view, on the same global batch). The data follows the step, not the rank:
   ddp_sampler_step_batch gives a rank its share of a step's global batch for any number of members.

   Built so far: the type below, ddp_sampler_step_batch, and the view change's decisions (which view,
   which verdict; src/ft_view.c, private and without I/O). The calls that fill a ddp_ft_step
   (ddp_ft_begin, ddp_ft_commit, ddp_ft_register: the view change over the ranks' connections, the commit
   vote, joiners with live state) are not built yet; until they are, a program fills the struct itself
   (gen 0, its ddp_rank and ddp_world_size, joined 0) and counts steps and epochs as the fields below say. */

/* One step of fault-tolerant training: which view runs it, which step of which epoch, and this process's
   place in the view. The program owns it; ddp_ft_begin (not built yet) is to fill the view's part. */
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
