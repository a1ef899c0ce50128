/* [SECTION] ft-view-state: the data of fault tolerance's view change: views, ballots, messages, a member
   ft_view.c decides with these (the protocol and its safety argument are at its top); ft.c carries them
   between the members on their control connections. Ids are stable ids (FT.md 2.3): the
   first view's ranks keep theirs, joiners get new ones, none is ever used twice. */
#ifndef DDP__FT_VIEW_H
#define DDP__FT_VIEW_H
/* (each piece includes internal.h first) */

#define DDP__FT_NONE UINT32_MAX /* no id */

/* Where a member is in its step: RUNNING (some bucket not reduced yet), COMPLETE (every bucket reduced:
   it voted ok in the commit vote), COMMITTED (it saw the vote pass and applied the step). */
typedef enum ddp__ft_status { DDP__FT_RUNNING = 0, DDP__FT_COMPLETE = 1, DDP__FT_COMMITTED = 2 } ddp__ft_status;
typedef enum ddp__ft_verdict { DDP__FT_COMMIT = 1, DDP__FT_REDO = 2 } ddp__ft_verdict;
typedef enum ddp__ft_kind {
    DDP__FT_SUSPECT = 1, /* "a view change is under way"; with a ballot: the coordinator asks for REPORTs */
    DDP__FT_REPORT,      /* a member's state, to the ballot it promised (or its promise, refusing one) */
    DDP__FT_DECIDE,      /* the coordinator's proposal for the next view, to the members that reported */
    DDP__FT_ACK,         /* a member installed that DECIDE */
    DDP__FT_GO           /* the DECIDE is chosen: act on it (also what a member behind is sent) */
} ddp__ft_kind;
/* The clause of the quorum rule that a set of members meets (ddp__ft_quorum); 0: none. */
typedef enum ddp__ft_clause {
    DDP__FT_NO_QUORUM = 0,
    DDP__FT_MAJORITY,        /* more than half of the view */
    DDP__FT_HALF_WITH_FIRST, /* exactly half, the view's first member among them */
    DDP__FT_ALL_BUT_DEAD     /* every party (the members, the joiners) that is not known dead */
} ddp__ft_clause;
enum { DDP__FT_IDLE = 0, DDP__FT_COLLECT, DDP__FT_PROPOSED }; /* a coordinator's phase */

/* A Paxos ballot: round first, then the coordinator's id; round 0 is no ballot. */
typedef struct ddp__ft_ballot {
    uint64_t round;
    uint32_t coord;
} ddp__ft_ballot;

/* A view: its generation, its members (ascending ids: a member's rank is its index, the first member is
   rank 0) and the id the next joiner gets (above every id the job has used, dead ones included). The
   members array belongs to whoever holds the view. */
typedef struct ddp__ft_view {
    uint64_t gen;
    uint32_t next_id;
    int n;
    uint32_t *members;
} ddp__ft_view;

/* A DECIDE: the view change from view `base` settles on `view` (gen', members', next_id'), and on step
   `step`: every step before it is committed, and it is committed too when the verdict is COMMIT. */
typedef struct ddp__ft_decide {
    uint64_t base;
    ddp__ft_ballot ballot; /* the ballot that proposed it */
    ddp__ft_view view;
    uint64_t step;
    ddp__ft_verdict verdict;
} ddp__ft_decide;

/* A message of the view change. Every kind carries its sender and the gen of the view the sender runs;
   the other fields are those of its kind. Arrays point into the sender's memory for the call's duration. */
typedef struct ddp__ft_msg {
    ddp__ft_kind kind;
    uint32_t from;
    uint64_t gen;
    ddp__ft_ballot ballot;   /* SUSPECT: the ballot opened (round 0: none); REPORT: the ballot answered;
                                DECIDE, ACK: theirs */
    ddp__ft_ballot promised; /* REPORT: the sender's promise; above `ballot`, the report refuses it */
    int n_dead;              /* SUSPECT, REPORT, DECIDE, ACK: the members the sender knows dead */
    const uint32_t *dead;
    uint64_t step;           /* REPORT: the sender's step and status */
    ddp__ft_status status;
    int has_decide;          /* REPORT: the DECIDE it installed in this view change; DECIDE, GO: the decree */
    ddp__ft_decide decide;
    int joining;             /* REPORT, ACK: the sender is a joiner not admitted yet (no step to report) */
} ddp__ft_msg;

/* How a member sends: the transport copies or frames the message before returning. */
typedef void (*ddp__ft_send_fn)(void *ctx, uint32_t to, const ddp__ft_msg *msg);
/* How a member acts, at GO (before it moves on, so the member's fields still show the view it leaves):
   decree d is chosen; the transport applies step d->step (COMMIT) or drops it (REDO), then runs in d->view,
   or stops when `in_view` is 0 (left out). Called once per view installed. */
typedef void (*ddp__ft_act_fn)(void *ctx, uint32_t self, const ddp__ft_decide *d, int in_view);

/* One member's side of the protocol. Every array holds `cap` entries: ids are below cap, and so is the
   number of members of any view. */
typedef struct ddp__ft_member {
    uint32_t id, cap;
    ddp__ft_send_fn send;
    ddp__ft_act_fn act;
    void *ctx;
    /* the view it runs in, installed at GO; `made` is the decree that made it (none for the first view),
       which a member still in an older view is sent */
    ddp__ft_view view;
    int has_made;
    ddp__ft_decide made;
    int joiner;     /* waits to be admitted: it answers ballots of the view change that may admit it */
    uint64_t jbase; /* a joiner: the gen of that view change's view (the first ballot it answered) */
    int out;    /* a GO left it out of the view: it stops (and may come back as a joiner) */
    uint64_t step;
    ddp__ft_status status;
    /* the view change under way */
    int changing;
    unsigned char *dead;          /* by id: its connection closed, or a member said so; never undone */
    unsigned char *suspected;     /* by id: timed out; undone by any message from it */
    ddp__ft_ballot promised;      /* the ballot it reported to (round 0: none yet) */
    ddp__ft_ballot *offer;        /* by rank: the highest ballot that member opened */
    int has_installed;
    ddp__ft_decide installed;     /* the last DECIDE it installed in this view change */
    uint64_t round_seen;          /* the highest ballot round it has heard of */
    /* as the coordinator of `ballot` */
    ddp__ft_ballot ballot;
    int phase;                    /* DDP__FT_IDLE, _COLLECT (reports), _PROPOSED (ACKs) */
    unsigned char *heard;         /* by rank: reported to `ballot` */
    uint64_t *heard_step;         /* by rank: the step and status reported */
    unsigned char *heard_status;
    unsigned char *acked;         /* by rank: installed the proposal */
    int n_acks;                   /* ACKs from other members */
    int *ack_dead;                /* by id: how many of those ACKs named it dead */
    int has_best;
    ddp__ft_decide best;          /* the installed DECIDE with the highest ballot among the reports */
    uint64_t gen_seen;            /* the highest gen in the reports */
    ddp__ft_decide proposal;
    ddp__ft_clause chosen_by;     /* the clause the last chosen proposal's ACKs met (tests, logs) */
    int joiners;                  /* joins to admit in the next fresh proposal (ddp__ft_admit) */
    uint32_t *scratch;            /* the dead ids of an outgoing message */
    unsigned char *in, *gone;     /* by rank: the sets ddp__ft_quorum is asked about */
    /* (the arrays "by rank" cover the view change's parties: the view's members, then the joiners) */
} ddp__ft_member;

static DDP__UNUSED int ddp__ft_ballot_cmp(ddp__ft_ballot a, ddp__ft_ballot b);
static DDP__UNUSED int ddp__ft_rank_of(const ddp__ft_view *v, uint32_t id);
static DDP__UNUSED uint32_t ddp__ft_coordinator(const ddp__ft_view *v, const unsigned char *dead,
                                                const unsigned char *suspected);
static DDP__UNUSED ddp__ft_clause ddp__ft_quorum(int n, const unsigned char *in, const unsigned char *gone);
static DDP__UNUSED ddp__ft_verdict ddp__ft_verdict_of(int n, const unsigned char *in, const uint64_t *step,
                                                      const unsigned char *status, uint64_t *decided_step);
static DDP__UNUSED void ddp__ft_next_view(const ddp__ft_view *base, const unsigned char *keep, int joiners,
                                          uint64_t gen_seen, ddp__ft_view *out);
static DDP__UNUSED ddp_result ddp__ft_member_init(ddp__ft_member *m, uint32_t id, int n0, uint32_t cap,
                                                  ddp__ft_send_fn send, ddp__ft_act_fn act, void *ctx);
static DDP__UNUSED void ddp__ft_member_free(ddp__ft_member *m);
static DDP__UNUSED void ddp__ft_set_step(ddp__ft_member *m, uint64_t step, ddp__ft_status status);
static DDP__UNUSED void ddp__ft_admit(ddp__ft_member *m, int joiners);
static DDP__UNUSED ddp_result ddp__ft_lost(ddp__ft_member *m, uint32_t id, int dead);
static DDP__UNUSED ddp_result ddp__ft_timeout(ddp__ft_member *m);
static DDP__UNUSED ddp_result ddp__ft_data_failed(ddp__ft_member *m);
static DDP__UNUSED ddp_result ddp__ft_receive(ddp__ft_member *m, const ddp__ft_msg *msg);

#endif /* DDP__FT_VIEW_H */
