/* [SECTION] ft-view: the view change of fault-tolerant training: coordinator, quorum, verdict, next view,
   and what a member does with each message (FT.md 2.3, 2.6)
   Pure: no sockets, no clock, no threads, so that every interleaving can be tried. The transport (ft.c)
   calls in when a message arrives (ddp__ft_receive), a connection closes or times out (ddp__ft_lost), the
   data plane fails (ddp__ft_data_failed), suspect_seconds pass with no progress (ddp__ft_timeout), the
   step moves (ddp__ft_set_step) or joiners wait (ddp__ft_admit); a member answers through its send
   function and acts through its act function.
   tests/test_ft_view.c runs 2-7 members through a simulated network, with crashes at every send and
   partitions, and checks every run.

   THE PROTOCOL. A view is (gen, members ascending by stable id, next_id); a member's rank is its index.
   Each view change settles the successor of one view g as one decree of Paxos, whose acceptors are g's
   members and the joiners waiting to be admitted (the "parties"). FT.md's five messages; its ballots,
   promises and the quorum of ACKs are this file's, and are what make it safe:
     SUSPECT  A member that sees a connection close (dead) or time out (suspected) tells every party it does
              not know dead; each leaves the data plane. The member that believes itself coordinator -- the
              lowest id of g it neither knows dead nor suspects -- opens a ballot (round, its id), the round
              above every round it has heard of, with SUSPECT(ballot) to every party.
     REPORT   A party answers the ballot of the member it believes coordinator (a joiner: the first ballot it
              gets), promising it: from then on it installs no DECIDE of any other ballot. It reports its step
              and status, the ids it knows dead, and the DECIDE it installed in this view change, if any. To a
              ballot below its promise it sends the promise instead, and the coordinator opens a higher one.
     DECIDE   The coordinator waits for a REPORT from every party it neither knows dead nor suspects
              (ddp__ft_timeout suspects those still missing) and goes on only when the reporters are a
              quorum (below). When a report holds an installed DECIDE it proposes again the one of highest
              ballot, all of it (members, gen, step, verdict: FT.md's sticky verdicts, extended to the whole
              decree); otherwise it proposes afresh: step S = the highest step reported, the verdict below,
              members' = the reporting members not known dead, then the joiners not known dead (ids next_id,
              next_id + 1, ...), gen' = the highest gen seen + 1. It sends DECIDE to every reporter.
     ACK      A party installs a DECIDE only of the ballot it promised, and ACKs with the ids it knows dead.
     GO       When the ACKs are a quorum the decree is chosen: the coordinator sends GO to every party it does
              not know dead. Only at GO does a member act (the act function): it applies the step (COMMIT) or
              drops it (REDO) and runs in the new view; one the decree leaves out stops (it may come back as a
              joiner), answering for as long as it lingers any member behind with the GO. A member still in
              an older view is answered with GO whenever it sends SUSPECT or REPORT, so one that missed the GO
              catches up; a new view that holds a member known dead (a decree proposed again after a crash) is
              followed at once by the next change.
   A member drops every message from an id it knows dead, whoever told it: after that nothing of the dead
   one's can reach it (TCP delivers a closed connection's data before its end, or never). A member should
   time out on its coordinator later than the coordinator times out on the missing (2 x suspect_seconds).

   THE QUORUM of view g, for REPORTs and for ACKs alike (ddp__ft_quorum, ddp__ft_quorum_of), n = g's members:
     (1) more than n/2 of g's members;
     (2) exactly n/2, g's first member among them: g's "previous coordinator" -- its rank 0, the coordinator
         that made g (id 0 in the first view), alive or not, so that every member names the same one;
     (3) every party that is not known dead (at least one member): the members and the joiners. For ACKs,
         "known dead" means named dead by every ACK and by the coordinator, so that no ACKer can still get a
         message from them. Joiners count here only, never in (1) and (2).
          n   (1) majority    (2) half with the first member    (3) e.g. after kill -9 of the others
          2   2               1: {0}                            {1} when 0 closed its connection
          3   2               -                                 {2} when 0 and 1 closed theirs
          4   3               2 holding rank 0: {0,x}           {1,2} when 0 and 3 are dead
          5   3               -                                 any live set when every other is dead
   FT.md 2.3 has "a majority of the view minus the known-dead" instead; that is unsafe (WHY, point 5).

   THE VERDICT for step S (ddp__ft_verdict_of): COMMIT if a reporter is COMMITTED at S (one passes the commit
   vote only after every member voted COMPLETE); else COMMIT if every reporting member is COMPLETE at S (the
   reduced gradient holds the whole old view's data and every member of the new view holds it); else REDO
   (nobody can have passed the vote). A member behind at S - 1 (COMPLETE there: someone passed S - 1's vote)
   counts as not COMPLETE at S, and applies S - 1 at GO. A member left out of a COMMIT for lack of the
   gradient (a RUNNING reporter, when an earlier ballot's COMMIT is proposed again) comes back as a joiner.

   WHY IT IS SAFE (FT.md 2.1: one agreed verdict per step; no step applied on some ranks and not others).
   1. One decree per view change is chosen, and every later ballot proposes it again. Two quorums of g share
      a member: two majorities do, a majority and a half do, two halves both hold g's first member; (3) is
      point 4. A chosen decree was installed by a quorum of ACKers; a coordinator with a later ballot has a
      quorum of REPORTs; the member they share promised the later ballot only after installing the decree
      (having promised it first, it would have refused the DECIDE), so its REPORT carries the decree or a
      later one, and by induction on ballots the highest-ballot DECIDE among the reports is the chosen one.
   2. So at most one member list per gen and one verdict per step: members act only at GO, on a chosen
      decree; chosen decrees form one chain g -> g' -> g'' with rising gens (a member in a newer view answers
      an older one with GO, so no coordinator decides twice from one view); within the chain a step's
      verdict is the one first chosen for it, since a decree fixes every step before its own.
   3. A minority never decides: a side that is not a quorum gets neither the REPORTs nor the ACKs it needs.
      In a partition nothing closes, so (3) never counts the other side: 3|1 and 2|2 continue on the side
      with a majority or with the previous coordinator, 3|3 likewise, 1|1 on rank 0.
   4. The dead only count in (3), and only so: if a quorum met (3) and some other decree was chosen by ACKers
      it does not share, those ACKers are all known dead, and no live party holds that decree -- a live
      holder is not known dead, so it reported (bringing the decree) or refuses to ACK; a joiner is a party
      for this reason. Both decrees exist only when the first one's holders are all dead. That cannot be
      avoided while a killed rank never blocks a 2-rank job and a partition lets one side go on (FT.md 2.3):
      cut {0}|{1}, rank 0 goes on alone by (2), commits the step, and is killed; rank 1 sees the close and
      goes on alone by (3), redoing the step. Rank 1 cannot tell this from rank 0 killed at once. No
      survivor ever holds the lost decree (the test checks this, and counts such runs).
   5. Why not "a majority of the view minus the known-dead": in a view {0,1,2}, 1 suspects 0 and decides
      {1,2} with 2's REPORT and ACK (2 of 3); 2 dies; 0 has its own DECIDE {0,1,2} with only its own ACK, and
      with 2 known dead that is half of {0,1} holding the first member: 0 acts on it too. 0 and 1, both
      alive, run two different gen-1 views (the test finds this). Likewise a 5-member view that chose
      {0,1,2}, whose 0 and 1 die while 2 is cut off, would let {3,4} (2 of the 3 not known dead) decide
      again. The half rule's "previous coordinator" has the same trap if it means the lowest live id.
   6. COMMITTED(s) leads to COMMIT for s: the vote passed, so every member of the view was COMPLETE, so every
      fresh proposal is COMMIT and every re-proposal is one of them; a member refuses (DDP_ERR_STATE) a
      DECIDE or GO that would undo a step it applied. What a member installs before GO may still be replaced
      by a later ballot's DECIDE (a DECIDE half sent when its coordinator died is never chosen if the
      members that lack it decide without it); only what it acts on is final. */
#include "internal.h"
#include "ft_view.h"

static int ddp__ft_ballot_cmp(ddp__ft_ballot a, ddp__ft_ballot b) {
    if (a.round != b.round) return a.round < b.round ? -1 : 1;
    if (a.coord != b.coord) return a.coord < b.coord ? -1 : 1;
    return 0;
}

/* The rank of id in v (binary search: members are ascending), or -1. */
static int ddp__ft_rank_of(const ddp__ft_view *v, uint32_t id) {
    int lo = 0, hi = v->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (v->members[mid] == id) return mid;
        if (v->members[mid] < id) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* The coordinator a member believes in: the lowest id of v it neither knows dead nor suspects
   (suspected may be NULL); DDP__FT_NONE when there is none. */
static uint32_t ddp__ft_coordinator(const ddp__ft_view *v, const unsigned char *dead,
                                    const unsigned char *suspected) {
    int i;
    for (i = 0; i < v->n; i++) {
        uint32_t id = v->members[i];
        if (!dead[id] && !(suspected && suspected[id])) return id;
    }
    return DDP__FT_NONE;
}

/* Which clause of the quorum rule (the file's top) the members in[rank] of an n-member view meet, with
   gone[rank] the members known dead; DDP__FT_NO_QUORUM when none does. */
static ddp__ft_clause ddp__ft_quorum(int n, const unsigned char *in, const unsigned char *gone) {
    int i, k = 0, rest_dead = 1;
    for (i = 0; i < n; i++) {
        if (in[i]) k++;
        else if (!gone[i]) rest_dead = 0;
    }
    if (2 * k > n) return DDP__FT_MAJORITY;
    if (k > 0 && 2 * k == n && in[0]) return DDP__FT_HALF_WITH_FIRST;
    if (k > 0 && rest_dead) return DDP__FT_ALL_BUT_DEAD;
    return DDP__FT_NO_QUORUM;
}

/* The verdict (the file's top) from the reports of the members in[rank], their step[] and status[];
   *decided_step receives S, the highest step reported. */
static ddp__ft_verdict ddp__ft_verdict_of(int n, const unsigned char *in, const uint64_t *step,
                                          const unsigned char *status, uint64_t *decided_step) {
    uint64_t s = 0;
    int i, committed = 0, all_complete = 1;
    for (i = 0; i < n; i++)
        if (in[i] && step[i] > s) s = step[i];
    for (i = 0; i < n; i++) {
        if (!in[i]) continue;
        if (step[i] == s && status[i] == DDP__FT_COMMITTED) committed = 1;
        if (step[i] != s || status[i] == DDP__FT_RUNNING) all_complete = 0;
    }
    *decided_step = s;
    return committed || all_complete ? DDP__FT_COMMIT : DDP__FT_REDO;
}

/* A fresh proposal's view: base's members with keep[rank], in order, then of the `joiners` ids from
   base->next_id on those with keep[base->n + i] (above every id used, so the order stays ascending; one
   passed over is never used); gen = gen_seen + 1. out->members must hold base->n + joiners ids. */
static void ddp__ft_next_view(const ddp__ft_view *base, const unsigned char *keep, int joiners,
                              uint64_t gen_seen, ddp__ft_view *out) {
    int i;
    out->gen = gen_seen + 1;
    out->n = 0;
    for (i = 0; i < base->n; i++)
        if (keep[i]) out->members[out->n++] = base->members[i];
    for (i = 0; i < joiners; i++)
        if (keep[base->n + i]) out->members[out->n++] = base->next_id + (uint32_t)i;
    out->next_id = base->next_id + (uint32_t)joiners;
}

/* ---- decrees: copying and comparing (members live in the holder's arrays) ---- */

static void ddp__ft_view_copy(ddp__ft_view *dst, const ddp__ft_view *src) {
    dst->gen = src->gen;
    dst->next_id = src->next_id;
    dst->n = src->n;
    if (src->n) memcpy(dst->members, src->members, (size_t)src->n * sizeof *dst->members);
}

static void ddp__ft_decide_copy(ddp__ft_decide *dst, const ddp__ft_decide *src) {
    dst->base = src->base;
    dst->ballot = src->ballot;
    dst->step = src->step;
    dst->verdict = src->verdict;
    ddp__ft_view_copy(&dst->view, &src->view);
}

/* The same decree: the same view change, settled the same way (the ballot may differ). */
static int ddp__ft_decide_same(const ddp__ft_decide *a, const ddp__ft_decide *b) {
    return a->base == b->base && a->view.gen == b->view.gen && a->view.next_id == b->view.next_id &&
           a->view.n == b->view.n && a->step == b->step && a->verdict == b->verdict &&
           (a->view.n == 0 || !memcmp(a->view.members, b->view.members, (size_t)a->view.n * sizeof(uint32_t)));
}

/* Could this member act on decree d? Steps are applied in order and never undone: after d, steps
   0 .. d->step - 1 are applied, and d->step too on COMMIT. A member that applied more than that, or that
   would have to apply a step whose reduced gradient it lacks, would diverge: that is DDP_ERR_STATE, which
   the safety argument (the file's top) says cannot happen. A joiner gets its state from a donor. */
static int ddp__ft_can_act(const ddp__ft_member *m, const ddp__ft_decide *d) {
    uint64_t applied = m->step + (m->status == DDP__FT_COMMITTED);
    uint64_t wanted = d->step + (d->verdict == DDP__FT_COMMIT);
    if (m->joiner) return 1;
    if (applied > wanted) return 0;
    return applied == wanted || (applied + 1 == wanted && m->status == DDP__FT_COMPLETE);
}

/* ---- the parties of a view change: the view's members (ranks 0 .. n-1), then the joiners it may admit
   (ranks n .. n+j-1: ids next_id .. next_id+j-1, every member told the same by the commit vote, FT.md 2.6).
   Joiners count in the quorum's third clause only (below), never in the verdict. ---- */

static int ddp__ft_pending(const ddp__ft_member *m) {
    uint64_t room = m->cap - m->view.next_id;
    return (uint64_t)m->joiners < room ? m->joiners : (int)room;
}

static int ddp__ft_parties(const ddp__ft_member *m) { return m->view.n + ddp__ft_pending(m); }

static uint32_t ddp__ft_party(const ddp__ft_member *m, int r) {
    return r < m->view.n ? m->view.members[r] : m->view.next_id + (uint32_t)(r - m->view.n);
}

static int ddp__ft_party_rank(const ddp__ft_member *m, uint32_t id) {
    uint32_t past = id - m->view.next_id;
    if (id >= m->view.next_id) return past < (uint32_t)ddp__ft_pending(m) ? m->view.n + (int)past : -1;
    return ddp__ft_rank_of(&m->view, id);
}

/* The clause the parties in[r] meet, gone[r] those known dead: the first two clauses count the view's
   members only; the third needs the joiners too, each heard or known dead. */
static ddp__ft_clause ddp__ft_quorum_of(const ddp__ft_member *m, const unsigned char *in,
                                        const unsigned char *gone) {
    ddp__ft_clause q = ddp__ft_quorum(m->view.n, in, gone);
    int r;
    for (r = m->view.n; q == DDP__FT_ALL_BUT_DEAD && r < ddp__ft_parties(m); r++)
        if (!in[r] && !gone[r]) q = DDP__FT_NO_QUORUM;
    return q;
}

/* ---- sending ---- */

static void ddp__ft_msg_init(const ddp__ft_member *m, ddp__ft_kind kind, ddp__ft_msg *msg) {
    memset(msg, 0, sizeof *msg);
    msg->kind = kind;
    msg->from = m->id;
    msg->gen = m->joiner ? m->jbase : m->view.gen;
    msg->joining = m->joiner;
}

/* msg carries the parties this member knows dead (a joiner: every id it was told of). */
static void ddp__ft_msg_dead(ddp__ft_member *m, ddp__ft_msg *msg) {
    uint32_t id;
    int r, k = 0;
    if (m->joiner) {
        for (id = 0; id < m->cap; id++)
            if (m->dead[id]) m->scratch[k++] = id;
    } else {
        for (r = 0; r < ddp__ft_parties(m); r++)
            if (m->dead[ddp__ft_party(m, r)]) m->scratch[k++] = ddp__ft_party(m, r);
    }
    msg->n_dead = k;
    msg->dead = m->scratch;
}

/* SUSPECT (with ballot b, or none when b.round is 0) to every party not known dead. */
static void ddp__ft_broadcast_suspect(ddp__ft_member *m, ddp__ft_ballot b) {
    ddp__ft_msg msg;
    int r;
    ddp__ft_msg_init(m, DDP__FT_SUSPECT, &msg);
    msg.ballot = b;
    ddp__ft_msg_dead(m, &msg);
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t to = ddp__ft_party(m, r);
        if (to != m->id && !m->dead[to]) m->send(m->ctx, to, &msg);
    }
}

static void ddp__ft_send_go(ddp__ft_member *m, uint32_t to, const ddp__ft_decide *d) {
    ddp__ft_msg msg;
    ddp__ft_msg_init(m, DDP__FT_GO, &msg);
    msg.has_decide = 1;
    msg.decide = *d;
    m->send(m->ctx, to, &msg);
}

/* ---- a member's side ---- */

/* Enter the view change (leave the data plane) and say so to everyone; a first-hand death is told again,
   so that the others stop waiting for the dead. */
static void ddp__ft_enter(ddp__ft_member *m, int news) {
    ddp__ft_ballot none;
    if (m->changing && !news) return;
    m->changing = 1;
    none.round = 0;
    none.coord = DDP__FT_NONE;
    ddp__ft_broadcast_suspect(m, none);
}

/* REPORT to ballot b of coordinator c: promised and answered with the state when b is above the promise,
   else refused with the promise (the coordinator opens a higher one). Returns 1 when promised. */
static int ddp__ft_report(ddp__ft_member *m, uint32_t c, ddp__ft_ballot b) {
    int cmp = ddp__ft_ballot_cmp(b, m->promised);
    ddp__ft_msg msg;
    if (cmp == 0) return 0;
    ddp__ft_msg_init(m, DDP__FT_REPORT, &msg);
    msg.ballot = b;
    if (cmp > 0) {
        m->promised = b;
        msg.step = m->step;
        msg.status = m->status;
        msg.has_decide = m->has_installed;
        if (m->has_installed) msg.decide = m->installed;
    }
    msg.promised = m->promised;
    ddp__ft_msg_dead(m, &msg);
    m->send(m->ctx, c, &msg);
    return cmp > 0;
}

/* Report to the coordinator this member believes in, once it has opened a ballot; a ballot refused is
   forgotten, so that it is refused once. */
static void ddp__ft_report_to(ddp__ft_member *m, uint32_t c) {
    int r = ddp__ft_rank_of(&m->view, c);
    if (r < 0 || m->offer[r].round == 0) return;
    if (!ddp__ft_report(m, c, m->offer[r]) && ddp__ft_ballot_cmp(m->offer[r], m->promised) < 0) m->offer[r].round = 0;
}

/* DECIDE from `from` with ballot b: installed only if it is of the ballot this member promised (to that
   coordinator) and of the view change it takes part in; then ACKed. DDP_ERR_STATE for one that keeps this
   member but that it could not act on (one that leaves it out is installed and ACKed like any other). */
static ddp_result ddp__ft_on_decide(ddp__ft_member *m, uint32_t from, ddp__ft_ballot b, const ddp__ft_decide *d) {
    ddp__ft_msg msg;
    uint64_t base = m->joiner ? m->jbase : m->view.gen;
    if (d->base != base || from != m->promised.coord || ddp__ft_ballot_cmp(b, m->promised) != 0) return DDP_SUCCESS;
    if (ddp__ft_rank_of(&d->view, m->id) >= 0 && !ddp__ft_can_act(m, d)) return DDP_ERR_STATE;
    ddp__ft_decide_copy(&m->installed, d);
    m->installed.ballot = b;
    m->has_installed = 1;
    ddp__ft_msg_init(m, DDP__FT_ACK, &msg);
    msg.ballot = b;
    ddp__ft_msg_dead(m, &msg);
    m->send(m->ctx, from, &msg);
    return DDP_SUCCESS;
}

static void ddp__ft_forget_change(ddp__ft_member *m) {
    m->changing = 0;
    memset(m->suspected, 0, m->cap);
    memset(m->offer, 0, (size_t)m->cap * sizeof *m->offer);
    m->promised.round = 0;
    m->promised.coord = DDP__FT_NONE;
    m->has_installed = 0;
    m->phase = DDP__FT_IDLE;
    m->ballot.round = 0;
}

static ddp_result ddp__ft_progress(ddp__ft_member *m);

/* GO: decree d is chosen. A newer view is installed (the step applied or dropped); the view this member
   already runs is no news; an older one is stale. DDP_ERR_STATE for a GO that contradicts what this member
   installed at the same gen, or that it could not act on. */
static ddp_result ddp__ft_on_go(ddp__ft_member *m, const ddp__ft_decide *d) {
    int i, member = ddp__ft_rank_of(&d->view, m->id) >= 0;
    uint32_t used = d->view.next_id > m->view.next_id ? d->view.next_id - m->view.next_id : 0;
    if (d->view.gen < m->view.gen || (m->joiner && !member)) return DDP_SUCCESS;
    if (d->view.gen == m->view.gen)
        return m->has_made && !ddp__ft_decide_same(d, &m->made) ? DDP_ERR_STATE : DDP_SUCCESS;
    if (member && !ddp__ft_can_act(m, d)) return DDP_ERR_STATE;
    m->act(m->ctx, m->id, d, member);
    ddp__ft_view_copy(&m->view, &d->view);
    ddp__ft_decide_copy(&m->made, d);
    m->has_made = 1;
    m->step = d->step + (d->verdict == DDP__FT_COMMIT);
    m->status = DDP__FT_RUNNING;
    m->joiners = (uint32_t)m->joiners > used ? m->joiners - (int)used : 0; /* admitted, or passed over */
    m->joiner = 0;
    ddp__ft_forget_change(m);
    if (!member) {
        m->out = 1;
        return DDP_SUCCESS;
    }
    for (i = 0; i < m->view.n; i++)
        if (m->dead[m->view.members[i]]) {
            ddp__ft_enter(m, 0);
            return ddp__ft_progress(m);
        }
    return DDP_SUCCESS;
}

/* ---- the coordinator's side ---- */

/* Open a ballot above every round heard of; this member promises it and reports to itself. */
static void ddp__ft_open_ballot(ddp__ft_member *m) {
    uint64_t round = DDP__MAX(m->round_seen, m->promised.round) + 1;
    int me = ddp__ft_rank_of(&m->view, m->id);
    m->ballot.round = round;
    m->ballot.coord = m->id;
    m->round_seen = round;
    m->promised = m->ballot;
    m->phase = DDP__FT_COLLECT;
    memset(m->heard, 0, m->cap);
    memset(m->acked, 0, m->cap);
    memset(m->ack_dead, 0, (size_t)m->cap * sizeof *m->ack_dead);
    m->n_acks = 0;
    m->gen_seen = m->view.gen;
    m->heard[me] = 1;
    m->heard_step[me] = m->step;
    m->heard_status[me] = (unsigned char)m->status;
    m->has_best = m->has_installed;
    if (m->has_installed) ddp__ft_decide_copy(&m->best, &m->installed);
    ddp__ft_broadcast_suspect(m, m->ballot);
}

/* The fresh proposal, from the reports: the verdict over every reporting member (one that died since still
   tells what it saw), the members among them not known dead, then the joiners not known dead. */
static void ddp__ft_fresh_proposal(ddp__ft_member *m) {
    int r, joiners = ddp__ft_pending(m);
    ddp__ft_decide *p = &m->proposal;
    p->verdict = ddp__ft_verdict_of(m->view.n, m->heard, m->heard_step, m->heard_status, &p->step);
    for (r = 0; r < m->view.n + joiners; r++)
        m->in[r] = (r >= m->view.n || m->heard[r]) && !m->dead[ddp__ft_party(m, r)];
    ddp__ft_next_view(&m->view, m->in, joiners, m->gen_seen, &p->view);
    p->base = m->view.gen;
}

/* Phase 2 once every party this coordinator waits for has reported and the reporters are a quorum:
   propose (again, the highest installed DECIDE; or afresh), install it, DECIDE to the reporters. */
static void ddp__ft_try_propose(ddp__ft_member *m) {
    ddp__ft_msg msg;
    int r;
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t id = ddp__ft_party(m, r);
        if (!m->heard[r] && !m->dead[id] && !m->suspected[id]) return;
        m->gone[r] = m->dead[id];
    }
    if (ddp__ft_quorum_of(m, m->heard, m->gone) == DDP__FT_NO_QUORUM) return;
    if (m->has_best) ddp__ft_decide_copy(&m->proposal, &m->best);
    else ddp__ft_fresh_proposal(m);
    m->proposal.ballot = m->ballot;
    m->phase = DDP__FT_PROPOSED;
    ddp__ft_decide_copy(&m->installed, &m->proposal);
    m->has_installed = 1;
    m->acked[ddp__ft_rank_of(&m->view, m->id)] = 1;
    ddp__ft_msg_init(m, DDP__FT_DECIDE, &msg);
    msg.ballot = m->ballot;
    msg.has_decide = 1;
    msg.decide = m->proposal;
    ddp__ft_msg_dead(m, &msg);
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t to = ddp__ft_party(m, r);
        if (m->heard[r] && to != m->id && !m->dead[to]) m->send(m->ctx, to, &msg);
    }
}

/* The proposal is chosen once its ACKers are a quorum, "known dead" meaning named dead by every ACK and by
   this coordinator now; then GO to every party not known dead (those left out learn it too), and this
   member acts on it itself. */
static ddp_result ddp__ft_try_choose(ddp__ft_member *m) {
    int r;
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t id = ddp__ft_party(m, r);
        m->gone[r] = m->dead[id] && m->ack_dead[id] == m->n_acks;
    }
    m->chosen_by = ddp__ft_quorum_of(m, m->acked, m->gone);
    if (m->chosen_by == DDP__FT_NO_QUORUM) return DDP_SUCCESS;
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t to = ddp__ft_party(m, r);
        if (to != m->id && !m->dead[to]) ddp__ft_send_go(m, to, &m->proposal);
    }
    return ddp__ft_on_go(m, &m->proposal);
}

/* After any change of what this member knows: follow the coordinator it believes in (open its own ballot
   when that is itself), and move its own ballot on. */
static ddp_result ddp__ft_progress(ddp__ft_member *m) {
    uint32_t c;
    if (!m->changing || m->out || m->joiner) return DDP_SUCCESS;
    c = ddp__ft_coordinator(&m->view, m->dead, m->suspected);
    if (c == DDP__FT_NONE) return DDP_SUCCESS;
    if (c != m->id) {
        m->phase = DDP__FT_IDLE; /* a lower member is alive after all: its ballot, not this one */
        ddp__ft_report_to(m, c);
        return DDP_SUCCESS;
    }
    if (m->phase == DDP__FT_IDLE) ddp__ft_open_ballot(m);
    if (m->phase == DDP__FT_COLLECT) ddp__ft_try_propose(m);
    if (m->phase == DDP__FT_PROPOSED) return ddp__ft_try_choose(m);
    return DDP_SUCCESS;
}

static void ddp__ft_on_report(ddp__ft_member *m, const ddp__ft_msg *msg, int r) {
    if (m->phase == DDP__FT_IDLE || ddp__ft_ballot_cmp(msg->ballot, m->ballot) != 0) return;
    if (ddp__ft_ballot_cmp(msg->promised, m->ballot) > 0) { /* refused: it promised a higher ballot */
        m->round_seen = DDP__MAX(m->round_seen, msg->promised.round);
        ddp__ft_open_ballot(m);
        return;
    }
    if (m->phase != DDP__FT_COLLECT) return;
    m->heard[r] = 1;
    m->heard_step[r] = msg->step;
    m->heard_status[r] = (unsigned char)msg->status;
    if (!msg->has_decide || msg->decide.base != m->view.gen) return;
    m->gen_seen = DDP__MAX(m->gen_seen, msg->decide.view.gen);
    if (!m->has_best || ddp__ft_ballot_cmp(msg->decide.ballot, m->best.ballot) > 0) {
        ddp__ft_decide_copy(&m->best, &msg->decide);
        m->has_best = 1;
    }
}

static void ddp__ft_on_ack(ddp__ft_member *m, const ddp__ft_msg *msg, int r) {
    int i;
    if (m->phase != DDP__FT_PROPOSED || ddp__ft_ballot_cmp(msg->ballot, m->ballot) != 0 || m->acked[r]) return;
    m->acked[r] = 1;
    m->n_acks++;
    for (i = 0; i < msg->n_dead; i++) m->ack_dead[msg->dead[i]]++;
}

/* ---- a joiner's side: until a GO admits it, it answers ballots (it is a party of the view change that
   may admit it) and nothing else ---- */

static ddp_result ddp__ft_joiner_receive(ddp__ft_member *m, const ddp__ft_msg *msg) {
    int i;
    for (i = 0; i < msg->n_dead; i++) m->dead[msg->dead[i]] = 1; /* its ACKs name them, it drops their messages */
    if (msg->kind == DDP__FT_DECIDE && msg->gen == m->jbase)
        return ddp__ft_on_decide(m, msg->from, msg->ballot, &msg->decide);
    if (msg->kind != DDP__FT_SUSPECT || msg->ballot.round == 0 || msg->ballot.coord != msg->from) return DDP_SUCCESS;
    if (m->promised.round && msg->gen != m->jbase) {
        /* a member of another view: one that went on without this joiner's GO, or an older one. Asking it
           (a REPORT of this joiner's view change) brings the GO of a newer view; an older one ignores it. */
        ddp__ft_msg ask;
        if (msg->gen < m->jbase) return DDP_SUCCESS;
        ddp__ft_msg_init(m, DDP__FT_REPORT, &ask);
        ask.ballot = ask.promised = m->promised;
        m->send(m->ctx, msg->from, &ask);
        return DDP_SUCCESS;
    }
    m->jbase = msg->gen;
    ddp__ft_report(m, msg->from, msg->ballot);
    return DDP_SUCCESS;
}

/* ---- entry points: the transport calls these ---- */

/* A member of a first view of n0 members (ids 0 .. n0-1); n0 = 0: a joiner, admitted with this id (the
   transport learns it in the admission). Ids must stay below cap. */
static ddp_result ddp__ft_member_init(ddp__ft_member *m, uint32_t id, int n0, uint32_t cap,
                                      ddp__ft_send_fn send, ddp__ft_act_fn act, void *ctx) {
    uint32_t i;
    memset(m, 0, sizeof *m);
    if (cap == 0 || (uint32_t)n0 > cap || id >= cap) return DDP_ERR_INVALID_ARGUMENT;
    m->id = id;
    m->cap = cap;
    m->send = send;
    m->act = act;
    m->ctx = ctx;
    m->view.members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->made.view.members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->installed.view.members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->best.view.members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->proposal.view.members = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->scratch = (uint32_t *)ddp__calloc(cap, sizeof(uint32_t));
    m->dead = (unsigned char *)ddp__calloc(cap, 1);
    m->suspected = (unsigned char *)ddp__calloc(cap, 1);
    m->heard = (unsigned char *)ddp__calloc(cap, 1);
    m->heard_status = (unsigned char *)ddp__calloc(cap, 1);
    m->acked = (unsigned char *)ddp__calloc(cap, 1);
    m->in = (unsigned char *)ddp__calloc(cap, 1);
    m->gone = (unsigned char *)ddp__calloc(cap, 1);
    m->heard_step = (uint64_t *)ddp__calloc(cap, sizeof(uint64_t));
    m->offer = (ddp__ft_ballot *)ddp__calloc(cap, sizeof(ddp__ft_ballot));
    m->ack_dead = (int *)ddp__calloc(cap, sizeof(int));
    if (!m->view.members || !m->made.view.members || !m->installed.view.members || !m->best.view.members ||
        !m->proposal.view.members || !m->scratch || !m->dead || !m->suspected || !m->heard || !m->heard_status ||
        !m->acked || !m->in || !m->gone || !m->heard_step || !m->offer || !m->ack_dead) {
        ddp__ft_member_free(m);
        return DDP_ERR_OUT_OF_MEMORY;
    }
    for (i = 0; i < (uint32_t)n0; i++) m->view.members[i] = i;
    m->view.n = n0;
    m->view.next_id = n0 ? (uint32_t)n0 : id;
    m->joiner = n0 == 0;
    ddp__ft_forget_change(m);
    return DDP_SUCCESS;
}

static void ddp__ft_member_free(ddp__ft_member *m) {
    ddp__free(m->view.members);
    ddp__free(m->made.view.members);
    ddp__free(m->installed.view.members);
    ddp__free(m->best.view.members);
    ddp__free(m->proposal.view.members);
    ddp__free(m->scratch);
    ddp__free(m->dead);
    ddp__free(m->suspected);
    ddp__free(m->heard);
    ddp__free(m->heard_status);
    ddp__free(m->acked);
    ddp__free(m->in);
    ddp__free(m->gone);
    ddp__free(m->heard_step);
    ddp__free(m->offer);
    ddp__free(m->ack_dead);
    memset(m, 0, sizeof *m);
}

/* The step moved: the reducer finished the reduction (COMPLETE), the commit vote passed (COMMITTED), the
   next step began (step + 1, RUNNING). */
static void ddp__ft_set_step(ddp__ft_member *m, uint64_t step, ddp__ft_status status) {
    m->step = step;
    m->status = status;
}

/* Joiners wait (FT.md 2.6): the commit vote tells every member how many; the next fresh proposal admits
   them with ids next_id, next_id + 1, ..., and until then they are parties of every view change. */
static void ddp__ft_admit(ddp__ft_member *m, int joiners) { m->joiners = joiners > 0 ? joiners : 0; }

/* The transport lost party id: its connection closed (dead: the process is gone) or it made no progress
   for suspect_seconds (suspected). A joiner lost outside a view change only cancels its admission. */
static ddp_result ddp__ft_lost(ddp__ft_member *m, uint32_t id, int dead) {
    int r;
    if (m->out || m->joiner || id >= m->cap || id == m->id || (r = ddp__ft_party_rank(m, id)) < 0) return DDP_SUCCESS;
    if (m->dead[id] || (!dead && m->suspected[id])) return DDP_SUCCESS;
    if (dead) m->dead[id] = 1;
    else m->suspected[id] = 1;
    if (r >= m->view.n && !m->changing) return DDP_SUCCESS;
    ddp__ft_enter(m, dead);
    return ddp__ft_progress(m);
}

/* suspect_seconds passed in a view change with no GO: the coordinator suspects the parties it still waits
   for and, short of a quorum, opens a higher ballot; any other member suspects its coordinator (a member
   should wait longer than the coordinator does, so that the coordinator times out on the missing first). */
static ddp_result ddp__ft_timeout(ddp__ft_member *m) {
    uint32_t c;
    int r;
    if (!m->changing || m->out || m->joiner) return DDP_SUCCESS;
    c = ddp__ft_coordinator(&m->view, m->dead, m->suspected);
    if (c == DDP__FT_NONE) return DDP_SUCCESS;
    if (c != m->id) {
        m->suspected[c] = 1;
        return ddp__ft_progress(m);
    }
    for (r = 0; r < ddp__ft_parties(m); r++) {
        uint32_t id = ddp__ft_party(m, r);
        int waiting = m->phase == DDP__FT_PROPOSED ? m->heard[r] && !m->acked[r] : !m->heard[r];
        if (waiting && !m->dead[id] && id != m->id) m->suspected[id] = 1;
    }
    if (m->phase == DDP__FT_COLLECT) {
        ddp__ft_try_propose(m);
        if (m->phase == DDP__FT_PROPOSED) return ddp__ft_try_choose(m); /* now wait for the ACKs */
    }
    m->phase = DDP__FT_IDLE; /* no quorum of REPORTs or ACKs in time: a higher ballot */
    return ddp__ft_progress(m);
}

/* The data plane failed (a collective met a lost peer, a peer's abort, a timeout) and the transport
   cannot tell who is lost: enter the view change naming nobody; the control connections and the
   reports say the rest (a view change that finds everyone alive makes a new view of the same members). */
static ddp_result ddp__ft_data_failed(ddp__ft_member *m) {
    if (m->out || m->joiner) return DDP_SUCCESS;
    ddp__ft_enter(m, 0);
    return ddp__ft_progress(m);
}

/* A message's ids must be below cap, a decree's members ascending. */
static int ddp__ft_msg_valid(const ddp__ft_member *m, const ddp__ft_msg *msg) {
    int i;
    if (msg->from >= m->cap || msg->n_dead < 0 || (uint32_t)msg->n_dead > m->cap || (msg->n_dead && !msg->dead))
        return 0;
    for (i = 0; i < msg->n_dead; i++)
        if (msg->dead[i] >= m->cap) return 0;
    if (!msg->has_decide) return msg->kind != DDP__FT_DECIDE && msg->kind != DDP__FT_GO;
    if (msg->decide.view.n < 0 || (uint32_t)msg->decide.view.n > m->cap || msg->decide.view.next_id > m->cap ||
        (msg->decide.view.n && !msg->decide.view.members))
        return 0;
    for (i = 0; i < msg->decide.view.n; i++)
        if (msg->decide.view.members[i] >= msg->decide.view.next_id ||
            (i && msg->decide.view.members[i] <= msg->decide.view.members[i - 1]))
            return 0;
    return 1;
}

/* A message arrived. DDP_ERR_FORMAT for a malformed one; DDP_ERR_STATE for a DECIDE or GO this member
   could not act on (the safety argument says it cannot come). */
static ddp_result ddp__ft_receive(ddp__ft_member *m, const ddp__ft_msg *msg) {
    int i, r;
    if (!ddp__ft_msg_valid(m, msg)) return DDP_ERR_FORMAT;
    if (m->dead[msg->from]) return DDP_SUCCESS; /* nothing from the dead: the file's top */
    if (m->out) { /* while the process lingers, it tells a member behind the decree that left it out */
        if ((msg->kind == DDP__FT_SUSPECT || msg->kind == DDP__FT_REPORT) && msg->gen < m->view.gen)
            ddp__ft_send_go(m, msg->from, &m->made);
        return DDP_SUCCESS;
    }
    if (msg->kind == DDP__FT_GO) return ddp__ft_on_go(m, &msg->decide);
    if (m->joiner) return ddp__ft_joiner_receive(m, msg);
    r = ddp__ft_party_rank(m, msg->from);
    if (msg->kind == DDP__FT_ACK || msg->kind == DDP__FT_DECIDE) {
        if (msg->gen != m->view.gen) return DDP_SUCCESS;
    } else if (msg->gen < m->view.gen || (msg->joining && r >= 0 && r < m->view.n)) {
        /* a member behind (a joiner that missed the GO admitting it, too): the decree that moved on */
        if (m->has_made) ddp__ft_send_go(m, msg->from, &m->made);
        return DDP_SUCCESS;
    } else if (msg->gen > m->view.gen) { /* this member is behind: ask (the answer is a GO) */
        ddp__ft_msg ask;
        ddp__ft_msg_init(m, DDP__FT_SUSPECT, &ask);
        m->send(m->ctx, msg->from, &ask);
        return DDP_SUCCESS;
    }
    if (r < 0 || (r >= m->view.n) != (msg->joining != 0)) return DDP_SUCCESS;
    for (i = 0; i < msg->n_dead; i++)
        if (ddp__ft_party_rank(m, msg->dead[i]) >= 0) m->dead[msg->dead[i]] = 1;
    m->suspected[msg->from] = 0; /* it is alive */
    m->round_seen = DDP__MAX(m->round_seen, msg->ballot.round);
    switch (msg->kind) {
    case DDP__FT_SUSPECT:
        if (r >= m->view.n) return DDP_SUCCESS;
        if (msg->ballot.round && msg->ballot.coord == msg->from && ddp__ft_ballot_cmp(msg->ballot, m->offer[r]) > 0)
            m->offer[r] = msg->ballot;
        ddp__ft_enter(m, 0);
        break;
    case DDP__FT_REPORT: ddp__ft_on_report(m, msg, r); break;
    case DDP__FT_DECIDE: {
        ddp_result res = r < m->view.n ? ddp__ft_on_decide(m, msg->from, msg->ballot, &msg->decide) : DDP_SUCCESS;
        if (res != DDP_SUCCESS) return res;
        break;
    }
    case DDP__FT_ACK: ddp__ft_on_ack(m, msg, r); break;
    default: return DDP_ERR_FORMAT;
    }
    return ddp__ft_progress(m);
}
