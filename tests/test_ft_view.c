/* test_ft_view: the view change of fault-tolerant training (src/ft_view.c, FT.md 2.3) in a deterministic
   simulator: no sockets, no threads. 2-7 members (and sometimes a joiner waiting to be admitted) run the
   protocol by passing messages through per-link FIFO queues that the test owns; the test decides what is
   delivered when, who crashes (after which of its sends, its unsent messages flushed or lost, at once or
   when the handler returns; the others are told by a "connection closed" notice that follows everything it
   sent), which links a partition cuts, and when timeouts fire. The step's statuses vary: any mix of RUNNING
   and COMPLETE (the commit vote not passed), or every member COMPLETE and some COMMITTED (it passed).
   What is explored:
   - exhaustively for N = 2..4: every start (a crash of each member; every two-sided partition: 1|1, 2|1
     with and without member 0 on the larger side, 3|1, 2|2; a false suspicion) x every status mix x with
     and without a joiner x a crash of any process after each of its sends (0: at once), four ways -- so
     coordinators crash after sending DECIDE or GO to only some, and successors take over with the partial
     DECIDE in some reports;
   - for N = 3 and 4, a false suspicion or an early view-change timeout before every event of a run, so that
     coordinators compete; for N = 3, every pair of crash points;
   - 30,000 random runs (N = 2..7; the seed is printed; argv[1] = seed, argv[2] = runs): random starts
     (3|3, 4|3 and other partitions, links cut alone), statuses, delivery order, false suspicions,
     timeouts, links failing and up to 3 crashes at random moments, then a fair phase. Half are stormy
     (many timeouts and suspicions).
   A failing run is run again printing every event, with what reproduces it.
   Checked on every run, against the test's own copy of the rules:
   (a) no step gets two verdicts and (b) no gen two member lists, across every decree any member acted on
       (GO), dead members included -- save the one case the protocol allows (ft_view.c, WHY point 4): every
       holder of the earlier decree had crashed before the later was chosen, and where the two part the
       later was chosen by the all-but-dead clause; those runs are counted;
   (c) every decree is chosen by ACKers that are a quorum against the truth (the dead really dead, joiners
       heard for the third clause), so a side without a majority (or half with the view's first member)
       never decides: 3|1, 1|3, 2|2 and 3|3 go on only on the side with a majority or member 0;
   (d) liveness: when a side's live members are a quorum, the fair phase ends with each of them in one agreed
       new view of live members of its side, or told it is out;
   (e) when a member was COMMITTED at the step, every decree on that step is COMMIT;
   and no member ever refuses a DECIDE or GO as impossible (DDP_ERR_STATE).
   Mutations of the module it catches, by (a)/(b) even with (c) off: FT.md's "majority of the view minus the
   known-dead"; half without the first member; the previous coordinator as the lowest live id; no sticky
   decrees; FT.md's sticky verdict alone (members afresh); acting at DECIDE (no quorum of ACKs); joiners not
   counted in the third clause; by a member's refusal: installing a DECIDE of any ballot (within ~6,000
   random runs), COMMIT when any reporter is COMPLETE; by (d): a majority of the whole view only, a fresh
   gen' that is not above the gens seen; in longer runs (argv[2] = 100000: 3 seeds of 5), re-proposing the
   lowest ballot's DECIDE. */
#include "testlib.h"

#define CAP 16      /* ids below this */
#define MAXP 8      /* processes: up to 7 members and a joiner */
#define POOL 16384  /* messages in one run */
#define MAX_EVENTS 12000
#define MAX_TIMEOUTS 6 /* ddp__ft_timeout calls per member in the fair phase */
#define MAXDEC 128
#define STEP0 7     /* the step the failure interrupts */

/* ---- the network: per-link FIFO queues of copied messages ---- */

typedef struct smsg {
    ddp__ft_msg m;
    uint32_t dead[CAP], members[CAP];
    int closed; /* "connection closed": the transport's notice, after everything the dead one sent */
    int next;   /* the next message on its link; -1 */
} smsg;

static smsg pool[POOL];

/* A decree someone installed or acted on, by content. */
typedef struct rdec {
    ddp__ft_decide d;
    uint32_t members[CAP];
    unsigned holders; /* processes that installed it or acted on it */
    unsigned acted;   /* processes that acted on it (GO) */
    long chosen_at;   /* the clock when chosen (its coordinator's first GO or act); -1: never */
    int clause;       /* the quorum clause its ACKers met, checked by the test; -1: not seen chosen */
    int base_n;       /* the view it replaced, as its coordinator had it */
    uint32_t base_members[CAP];
} rdec;

typedef struct world {
    int n, procs, joiner;
    ddp__ft_member mem[MAXP];
    int alive[MAXP];
    long crashed_at[MAXP];
    int side[MAXP];
    unsigned char cut[MAXP][MAXP]; /* the link between a and b drops everything: across the sides, or cut alone */
    int partial;                   /* some link was cut alone: no sides to check liveness on */
    int head[MAXP][MAXP], tail[MAXP][MAXP];
    int n_pool;
    unsigned char told[MAXP][MAXP]; /* a's transport reported b lost */
    int sends[MAXP], crash_after[MAXP], crash_lose[MAXP], crash_late[MAXP], crash_reached, crash_due;
    long inject_at; /* before event inject_at: inject_a times out on inject_b (falsely, or its view-change
                       timeout when inject_b < 0); -1: nothing */
    int inject_a, inject_b, injected;
    int timeouts[MAXP];
    long clock;
    int committed0; /* some member was COMMITTED at STEP0 at the start */
    /* what the checks watch */
    ddp__ft_ballot ack_ballot[MAXP];
    unsigned ack_mask[MAXP]; /* ACKs of ack_ballot delivered to the process */
    rdec decs[MAXDEC];
    int n_decs;
    int dead_only;
    char why[600]; /* the first violation */
} world;

static world W;
static int trace; /* FT_TRACE=1: print every event (to rerun a failing case) */

static const char *kind_name(int k) {
    static const char *names[] = {"?", "SUSPECT", "REPORT", "DECIDE", "ACK", "GO"};
    return k >= 1 && k <= 5 ? names[k] : "?";
}

static struct totals {
    long runs, choices, dead_only, live_checked, random_runs;
} T;

static void fail(const char *fmt, ...) DDP__PRINTF(1, 2);
static void fail(const char *fmt, ...) {
    va_list ap;
    if (W.why[0]) return;
    va_start(ap, fmt);
    vsnprintf(W.why, sizeof W.why, fmt, ap);
    va_end(ap);
}

static uint64_t rng_state;
static uint64_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}
static int rnd_below(int n) { return (int)(rnd() % (uint64_t)n); }

static void enqueue(int from, int to, int i) {
    pool[i].next = -1;
    if (W.tail[from][to] < 0) W.head[from][to] = i;
    else pool[W.tail[from][to]].next = i;
    W.tail[from][to] = i;
}

static int new_msg(void) {
    CHECK(W.n_pool < POOL, "more than %d messages in one run", POOL);
    memset(&pool[W.n_pool], 0, sizeof pool[0]);
    return W.n_pool++;
}

/* ---- the test's own copy of the rules (not the module's code) ---- */

static int quorum_ok(int n, const int *in, const int *gone) {
    int i, k = 0, others_gone = 1;
    for (i = 0; i < n; i++) {
        k += in[i] != 0;
        if (!in[i] && !gone[i]) others_gone = 0;
    }
    if (2 * k > n) return DDP__FT_MAJORITY;
    if (2 * k == n && k > 0 && in[0]) return DDP__FT_HALF_WITH_FIRST;
    return k > 0 && others_gone ? DDP__FT_ALL_BUT_DEAD : 0;
}

static int same_decree(const ddp__ft_decide *a, const ddp__ft_decide *b) {
    int i;
    if (a->base != b->base || a->view.gen != b->view.gen || a->view.n != b->view.n || a->step != b->step ||
        a->verdict != b->verdict || a->view.next_id != b->view.next_id)
        return 0;
    for (i = 0; i < a->view.n; i++)
        if (a->view.members[i] != b->view.members[i]) return 0;
    return 1;
}

static int record_of(const ddp__ft_decide *d) {
    int i;
    rdec *r;
    for (i = 0; i < W.n_decs; i++)
        if (same_decree(&W.decs[i].d, d)) return i;
    CHECK(W.n_decs < MAXDEC, "more than %d decrees in one run", MAXDEC);
    r = &W.decs[W.n_decs];
    memset(r, 0, sizeof *r);
    r->d = *d;
    r->d.view.members = r->members;
    if (d->view.n) memcpy(r->members, d->view.members, (size_t)d->view.n * sizeof(uint32_t));
    r->chosen_at = -1;
    r->clause = -1;
    return W.n_decs++;
}

/* p chose decree d (its own ballot; seen at its first GO, or when it acts with no one to tell): its ACKers,
   p included, must be a quorum of the view it leaves, the dead really dead -- (c). Joiners must be ACKers or
   dead for the third clause. */
static void note_choice(int p, const ddp__ft_decide *d) {
    const ddp__ft_member *m = &W.mem[p];
    rdec *r = &W.decs[record_of(d)];
    int in[CAP], gone[CAP], i, q, joiners_in = 1;
    uint32_t id;
    if (r->clause >= 0) return;
    for (i = 0; i < m->view.n; i++) {
        id = m->view.members[i];
        in[i] = (int)id == p || (ddp__ft_ballot_cmp(W.ack_ballot[p], d->ballot) == 0 && (W.ack_mask[p] >> id & 1u));
        gone[i] = !W.alive[id];
        r->base_members[i] = id;
    }
    r->base_n = m->view.n;
    for (id = m->view.next_id; (int)id < W.procs && id < m->view.next_id + (uint32_t)m->joiners; id++)
        if (W.alive[id] && !(ddp__ft_ballot_cmp(W.ack_ballot[p], d->ballot) == 0 && (W.ack_mask[p] >> id & 1u))) joiners_in = 0;
    q = quorum_ok(m->view.n, in, gone);
    if (q == DDP__FT_ALL_BUT_DEAD && !joiners_in) q = 0;
    if (!q) fail("(c) %d chose gen %llu with ACKers that are no quorum of its view", p, (unsigned long long)d->view.gen);
    else if ((int)m->chosen_by != q) fail("%d chose gen %llu by clause %d, the test finds clause %d", p,
                                          (unsigned long long)d->view.gen, (int)m->chosen_by, q);
    r->clause = q;
    if (r->chosen_at < 0) r->chosen_at = W.clock;
    T.choices++;
}

/* What process p has installed (a DECIDE) now. */
static void observe(int p) {
    ddp__ft_member *m = &W.mem[p];
    if (m->has_installed) W.decs[record_of(&m->installed)].holders |= 1u << p;
}

/* The member's act function: p acts on decree d (GO). */
static void sim_act(void *ctx, uint32_t self, const ddp__ft_decide *d, int in_view) {
    int p = (int)self, i = record_of(d), k;
    rdec *r = &W.decs[i];
    (void)ctx;
    (void)in_view;
    if (!W.alive[p]) return; /* after its crash point: never done */
    observe(p);
    r->holders |= 1u << p;
    r->acted |= 1u << p;
    if (d->ballot.coord == self && d->base == W.mem[p].view.gen) note_choice(p, d);
    if (r->chosen_at < 0) r->chosen_at = W.clock;
    if (trace) printf("    %d acts on gen %llu (base %llu)%s\n", p, (unsigned long long)d->view.gen,
                      (unsigned long long)d->base, in_view ? "" : ": left out");
    for (k = 1; k < d->view.n; k++)
        if (d->view.members[k] <= d->view.members[k - 1]) fail("gen %llu: members not ascending", (unsigned long long)d->view.gen);
    if (d->view.n && d->view.members[d->view.n - 1] >= d->view.next_id) fail("next_id not above every member");
    for (k = 0; k < d->view.n; k++)
        if ((int)d->view.members[k] >= W.n && (!W.joiner || (int)d->view.members[k] != W.n))
            fail("an admitted id %u is not the first view's next_id %d", d->view.members[k], W.n);
}

static void crash(int p, int lose) {
    int q;
    if (trace) printf("  crash %d%s\n", p, lose ? " (unsent lost)" : "");
    observe(p); /* what it held when it died; nothing it would have done after counts */
    W.alive[p] = 0;
    W.crashed_at[p] = W.clock;
    for (q = 0; q < W.procs; q++) {
        int i;
        if (q == p || !W.alive[q] || W.cut[p][q]) continue;
        if (lose) W.head[p][q] = W.tail[p][q] = -1;
        i = new_msg();
        pool[i].closed = 1;
        enqueue(p, q, i);
    }
}

static void sim_send(void *ctx, uint32_t to, const ddp__ft_msg *msg) {
    int from = (int)msg->from, i;
    smsg *s;
    (void)ctx;
    if (!W.alive[from]) return; /* the rest of a crashed member's handler: never sent */
    if (msg->kind == DDP__FT_GO && msg->decide.ballot.coord == msg->from && msg->decide.base == W.mem[from].view.gen)
        note_choice(from, &msg->decide);
    W.sends[from]++;
    if ((int)to < W.procs && !W.cut[from][to] && W.alive[to]) {
        i = new_msg();
        s = &pool[i];
        s->m = *msg;
        if (msg->n_dead) memcpy(s->dead, msg->dead, (size_t)msg->n_dead * sizeof(uint32_t));
        s->m.dead = s->dead;
        if (msg->has_decide && msg->decide.view.n) {
            memcpy(s->members, msg->decide.view.members, (size_t)msg->decide.view.n * sizeof(uint32_t));
            s->m.decide.view.members = s->members;
        }
        enqueue(from, (int)to, i);
    }
    if (W.crash_after[from] == W.sends[from]) {
        W.crash_reached++;
        if (W.crash_late[from]) W.crash_due |= 1 << from;
        else crash(from, W.crash_lose[from]);
    }
}

static void check_result(int p, ddp_result r, const char *what) {
    if (r == DDP_ERR_STATE) fail("member %d refused as impossible a %s", p, what);
    else if (r != DDP_SUCCESS) fail("member %d: %s returned %d", p, what, (int)r);
}

static void deliver(int from, int to) {
    int i = W.head[from][to];
    smsg *s = &pool[i];
    W.head[from][to] = s->next;
    if (W.head[from][to] < 0) W.tail[from][to] = -1;
    W.clock++;
    if (trace) {
        if (s->closed) printf("  %d <- %d: closed\n", to, from);
        else printf("  %d <- %d: %s gen %llu ballot (%llu,%d) promised (%llu,%d) step %llu st %d%s%s\n", to, from,
                    kind_name(s->m.kind), (unsigned long long)s->m.gen, (unsigned long long)s->m.ballot.round,
                    (int)s->m.ballot.coord, (unsigned long long)s->m.promised.round, (int)s->m.promised.coord,
                    (unsigned long long)s->m.step, (int)s->m.status, s->m.has_decide ? " +decree" : "",
                    s->m.n_dead ? " +dead" : "");
        if (s->m.has_decide) {
            int k;
            printf("      decree base %llu gen %llu step %llu %s members", (unsigned long long)s->m.decide.base,
                   (unsigned long long)s->m.decide.view.gen, (unsigned long long)s->m.decide.step,
                   s->m.decide.verdict == DDP__FT_COMMIT ? "COMMIT" : "REDO");
            for (k = 0; k < s->m.decide.view.n; k++) printf(" %u", s->m.decide.view.members[k]);
            printf("\n");
        }
    }
    if (s->closed) {
        W.told[to][from] = 1;
        check_result(to, ddp__ft_lost(&W.mem[to], (uint32_t)from, 1), "connection closed");
        return;
    }
    if (s->m.kind == DDP__FT_ACK && !W.mem[to].dead[from] && ddp__ft_ballot_cmp(s->m.ballot, W.ack_ballot[to]) >= 0) {
        if (ddp__ft_ballot_cmp(s->m.ballot, W.ack_ballot[to]) > 0) W.ack_mask[to] = 0; /* ACKs of its latest ballot */
        W.ack_ballot[to] = s->m.ballot;
        W.ack_mask[to] |= 1u << from;
    }
    check_result(to, ddp__ft_receive(&W.mem[to], &s->m), s->m.kind == DDP__FT_GO ? "GO" : "message");
}

/* ---- a run ---- */

typedef struct scenario {
    int n, joiner;
    int side[MAXP];   /* all 0: no partition */
    unsigned cuts[MAXP]; /* cuts[a] bit b: the link a-b is cut too (a partial partition) */
    int crash0;       /* crashed at the start; -1 */
    int sus_a, sus_b; /* sus_a's transport times out on sus_b at the start (falsely); -1 */
    unsigned char status[MAXP];
    int crash_after[MAXP], crash_lose[MAXP]; /* crash after that many sends; -1: never */
    int crash_late[MAXP]; /* ... not at once but when the handler that sent it returns (after acting) */
    long inject_at; /* a false suspicion or an early timeout before that event; -1: none */
    int inject_a, inject_b;
} scenario;

static void start(const scenario *sc) {
    int p, q;
    memset(&W, 0, sizeof W);
    W.n = sc->n;
    W.joiner = sc->joiner;
    W.procs = sc->n + sc->joiner;
    W.inject_at = sc->inject_at;
    W.inject_a = sc->inject_a;
    W.inject_b = sc->inject_b;
    for (p = 0; p < MAXP; p++)
        for (q = 0; q < MAXP; q++) W.head[p][q] = W.tail[p][q] = -1;
    for (p = 0; p < W.procs; p++) {
        ddp__ft_member *m = &W.mem[p];
        CHECK(ddp__ft_member_init(m, (uint32_t)p, p < sc->n ? sc->n : 0, CAP, sim_send, sim_act, NULL) == DDP_SUCCESS, "init");
        W.alive[p] = 1;
        W.crashed_at[p] = LONG_MAX;
        W.side[p] = p < sc->n ? sc->side[p] : 0;
        for (q = 0; q < p; q++) {
            W.cut[p][q] = W.cut[q][p] = W.side[p] != W.side[q] || (sc->cuts[p] >> q & 1u) || (sc->cuts[q] >> p & 1u);
            W.partial |= (sc->cuts[p] >> q & 1u) || (sc->cuts[q] >> p & 1u);
        }
        W.crash_after[p] = sc->crash_after[p];
        W.crash_lose[p] = sc->crash_lose[p];
        W.crash_late[p] = sc->crash_late[p];
        if (p < sc->n) {
            ddp__ft_set_step(m, STEP0, (ddp__ft_status)sc->status[p]);
            if (sc->status[p] == DDP__FT_COMMITTED) W.committed0 = 1;
            if (sc->joiner) ddp__ft_admit(m, 1);
        }
    }
    T.runs++;
    for (p = 0; p < W.procs; p++)
        if (W.crash_after[p] == 0) crash(p, W.crash_lose[p]);
    if (sc->crash0 >= 0 && W.alive[sc->crash0]) crash(sc->crash0, 0);
    if (sc->sus_a >= 0 && W.alive[sc->sus_a]) {
        W.told[sc->sus_a][sc->sus_b] = 1;
        check_result(sc->sus_a, ddp__ft_lost(&W.mem[sc->sus_a], (uint32_t)sc->sus_b, 0), "suspicion");
    }
    for (p = 0; p < W.procs; p++)
        if (W.alive[p]) observe(p);
}

static void finish(void) {
    int p;
    for (p = 0; p < W.procs; p++) ddp__ft_member_free(&W.mem[p]);
}

static int deliverable(int from, int to) { return W.head[from][to] >= 0 && W.alive[to]; }

/* a's transport can time out on b: b is cut off (or, adversarially, anyone not reported yet) */
static int detectable(int a, int b, int falsely) {
    if (a == b || a >= W.n || b >= W.n || !W.alive[a] || W.told[a][b]) return 0;
    return W.cut[a][b] || falsely;
}

static void detect(int a, int b) {
    if (trace) printf("  %d times out on %d\n", a, b);
    W.told[a][b] = 1;
    W.clock++;
    check_result(a, ddp__ft_lost(&W.mem[a], (uint32_t)b, 0), "suspicion");
}

static int wants_timeout(int p) {
    ddp__ft_member *m = &W.mem[p];
    return W.alive[p] && m->changing && !m->out && !m->joiner;
}

static void fire_timeout(int p) {
    if (trace) printf("  view-change timeout at %d\n", p);
    W.timeouts[p]++;
    W.clock++;
    check_result(p, ddp__ft_timeout(&W.mem[p]), "timeout");
}

/* After each event: what everyone holds; then the crashes due at the end of a handler. */
static void observe_all(void) {
    int p;
    for (p = 0; p < W.procs; p++)
        if (W.alive[p]) observe(p);
    for (p = 0; p < W.procs; p++)
        if (W.crash_due >> p & 1) crash(p, W.crash_lose[p]);
    W.crash_due = 0;
}

/* The fair phase: the oldest message first; at quiescence the transports' timeouts on members cut off,
   then view-change timeouts, coordinators first. Returns 0 when it ran out of events. */
static int run_fair(void) {
    memset(W.timeouts, 0, sizeof W.timeouts); /* the adversarial phase's do not count */
    while (W.clock < MAX_EVENTS) {
        int from, to, best = -1, bf = 0, bt = 0, a, b, p, pass, fired = 0;
        if (W.clock >= W.inject_at && W.inject_at >= 0 && !W.injected) {
            W.injected = 1;
            if (W.alive[W.inject_a] && W.inject_b < 0 && wants_timeout(W.inject_a)) fire_timeout(W.inject_a);
            else if (W.alive[W.inject_a] && W.inject_b >= 0 && detectable(W.inject_a, W.inject_b, 1)) detect(W.inject_a, W.inject_b);
            else W.injected = 2; /* nothing to inject there */
            observe_all();
            continue;
        }
        for (from = 0; from < W.procs; from++)
            for (to = 0; to < W.procs; to++)
                if (deliverable(from, to) && (best < 0 || W.head[from][to] < best)) {
                    best = W.head[from][to];
                    bf = from;
                    bt = to;
                }
        if (best >= 0) {
            deliver(bf, bt);
            observe_all();
            continue;
        }
        for (a = 0; a < W.n && !fired; a++)
            for (b = 0; b < W.n && !fired; b++)
                if (detectable(a, b, 0)) {
                    detect(a, b);
                    fired = 1;
                }
        for (pass = 0; pass < 2 && !fired; pass++)
            for (p = 0; p < W.procs && !fired; p++) {
                ddp__ft_member *m = &W.mem[p];
                int coordinator = wants_timeout(p) &&
                                  ddp__ft_coordinator(&m->view, m->dead, m->suspected) == (uint32_t)p;
                if (wants_timeout(p) && W.timeouts[p] < MAX_TIMEOUTS && coordinator == (pass == 0)) {
                    fire_timeout(p);
                    fired = 1;
                }
            }
        if (!fired) return 1;
        observe_all();
    }
    return 0;
}

/* The adversarial phase of a random run: any enabled event, in any order. Calm runs mostly deliver;
   stormy ones time out and suspect falsely often, so that coordinators compete. */
static void run_random(int events, int crashes, int stormy) {
    int links[MAXP * MAXP], e;
    int deliver_w = stormy ? 55 : 80, detect_w = stormy ? 20 : 8, timeout_w = stormy ? 20 : 8;
    for (e = 0; e < events; e++) {
        int nl = 0, from, to, kind = rnd_below(100);
        for (from = 0; from < W.procs; from++)
            for (to = 0; to < W.procs; to++)
                if (deliverable(from, to)) links[nl++] = from * MAXP + to;
        if (kind < deliver_w && nl) {
            int l = links[rnd_below(nl)];
            deliver(l / MAXP, l % MAXP);
        } else if (kind < deliver_w + detect_w) {
            int a = rnd_below(W.n), b = rnd_below(W.n);
            if (!detectable(a, b, rnd_below(stormy ? 2 : 4) == 0)) continue;
            detect(a, b);
        } else if (kind < deliver_w + detect_w + timeout_w) {
            int p = rnd_below(W.procs);
            if (!wants_timeout(p)) continue;
            fire_timeout(p);
        } else if (crashes > 0 && rnd_below(stormy ? 2 : 1) == 0) {
            int p = rnd_below(W.procs);
            if (!W.alive[p]) continue;
            W.clock++;
            crash(p, rnd_below(2));
            crashes--;
        } else if (stormy && rnd_below(8) == 0) { /* a link fails for good: what is on it is lost */
            int a = rnd_below(W.n), b = rnd_below(W.n);
            if (a == b || W.cut[a][b]) continue;
            if (trace) printf("  cut %d-%d\n", a, b);
            W.clock++;
            W.cut[a][b] = W.cut[b][a] = 1;
            W.partial = 1;
            W.head[a][b] = W.tail[a][b] = W.head[b][a] = W.tail[b][a] = -1;
        } else if (!nl) {
            break;
        }
        observe_all();
    }
}

/* ---- the checks at the end of a run ---- */

static int conflict(const rdec *a, const rdec *b) {
    return a->d.base == b->d.base || a->d.view.gen == b->d.view.gen ||
           (a->d.step == b->d.step && a->d.verdict != b->d.verdict);
}

/* The allowed conflict: every holder of the earlier decree had crashed before the later was chosen; and
   where the two part (decrees replacing the same view), the later was chosen by the all-but-dead clause. */
static int dead_only(const rdec *a, const rdec *b) {
    const rdec *first = a->chosen_at <= b->chosen_at ? a : b, *second = first == a ? b : a;
    int p, same_base = a->d.base == b->d.base && a->base_n == b->base_n &&
                       !memcmp(a->base_members, b->base_members, (size_t)a->base_n * sizeof(uint32_t));
    for (p = 0; p < W.procs; p++)
        if ((first->holders >> p & 1u) && W.crashed_at[p] >= second->chosen_at) return 0;
    return !same_base || second->clause == DDP__FT_ALL_BUT_DEAD;
}

static void check_decrees(void) {
    int i, j;
    for (i = 0; i < W.n_decs; i++) {
        const rdec *a = &W.decs[i];
        if (!a->acted) continue;
        if (W.committed0 && a->d.step == STEP0 && a->d.verdict != DDP__FT_COMMIT)
            fail("(e) a member was COMMITTED at step %d, yet gen %llu says REDO", STEP0, (unsigned long long)a->d.view.gen);
        for (j = i + 1; j < W.n_decs; j++) {
            const rdec *b = &W.decs[j];
            if (!b->acted || !conflict(a, b)) continue;
            if (dead_only(a, b)) {
                W.dead_only++;
                continue;
            }
            fail("(a)/(b) members acted on conflicting decrees: gen %llu (base %llu, step %llu %s, %d members, held by %#x) "
                 "and gen %llu (base %llu, step %llu %s, %d members, held by %#x)",
                 (unsigned long long)a->d.view.gen, (unsigned long long)a->d.base, (unsigned long long)a->d.step,
                 a->d.verdict == DDP__FT_COMMIT ? "COMMIT" : "REDO", a->d.view.n, a->holders,
                 (unsigned long long)b->d.view.gen, (unsigned long long)b->d.base, (unsigned long long)b->d.step,
                 b->d.verdict == DDP__FT_COMMIT ? "COMMIT" : "REDO", b->d.view.n, b->holders);
        }
    }
}

/* (d): each side whose live members are a quorum of the first view (its crashes seen, the other side's not)
   ends settled: every live member out, or in one agreed new view of live members of its side. */
static void check_live(int settled) {
    int s, p, k;
    if (W.partial) return; /* links cut alone: no sides to speak of */
    for (s = 0; s < 2; s++) {
        int in[CAP], gone[CAP], any = 0, agreed = -1;
        for (p = 0; p < W.n; p++) {
            in[p] = W.alive[p] && W.side[p] == s;
            gone[p] = !W.alive[p] && W.side[p] == s;
            any |= in[p];
        }
        if (!any || !quorum_ok(W.n, in, gone)) continue;
        T.live_checked++;
        if (!settled) {
            fail("(d) side %d is a quorum but the run did not settle in %d events", s, MAX_EVENTS);
            return;
        }
        for (p = 0; p < W.n; p++) {
            ddp__ft_member *m = &W.mem[p];
            if (!in[p] || m->out) continue;
            if (m->changing || m->view.gen == 0) {
                fail("(d) side %d is a quorum, yet member %d is still %s", s, p, m->changing ? "changing" : "in the first view");
                return;
            }
            for (k = 0; k < m->view.n; k++) {
                int id = (int)m->view.members[k];
                if (id < W.procs && (!W.alive[id] || W.side[id] != s)) {
                    fail("(d) member %d settled in gen %llu holding member %d, %s", p, (unsigned long long)m->view.gen,
                         id, W.alive[id] ? "cut off" : "dead");
                    return;
                }
            }
            if (agreed >= 0 && W.mem[agreed].view.gen != m->view.gen) {
                fail("(d) members %d and %d settled in different views", agreed, p);
                return;
            }
            agreed = p;
        }
    }
}

static const char *status_name(int s) { return s == DDP__FT_COMMITTED ? "COMMITTED" : s == DDP__FT_COMPLETE ? "COMPLETE" : "RUNNING"; }

static void report_failure(const scenario *sc, const char *how) {
    int p;
    fflush(stdout);
    fprintf(stderr, "FAILED (%s): %s\n  n=%d joiner=%d crash0=%d suspicion=%d->%d sides:", how, W.why, sc->n, sc->joiner,
            sc->crash0, sc->sus_a, sc->sus_b);
    for (p = 0; p < sc->n; p++) fprintf(stderr, " %d", sc->side[p]);
    fprintf(stderr, " cut links:");
    for (p = 0; p < sc->n; p++) {
        int q;
        for (q = 0; q < p; q++)
            if ((sc->cuts[p] >> q & 1u) || (sc->cuts[q] >> p & 1u)) fprintf(stderr, " %d-%d", q, p);
    }
    fprintf(stderr, "\n  statuses:");
    for (p = 0; p < sc->n; p++) fprintf(stderr, " %s", status_name(sc->status[p]));
    fprintf(stderr, "\n  crash plans (after sends, lost):");
    for (p = 0; p < sc->n + sc->joiner; p++)
        if (sc->crash_after[p] >= 0)
            fprintf(stderr, " %d@%d%s%s", p, sc->crash_after[p], sc->crash_lose[p] ? " lost" : "", sc->crash_late[p] ? " late" : "");

    fprintf(stderr, "\n");
    exit(1);
}

/* One fair run of scenario sc; *sends gets how many messages each member sent. Returns 0 when a crash
   plan was never reached (the run repeats one with fewer crashes). */
static int run_exhaustive(const scenario *sc, int *sends, int planned) {
    int settled, p, reached;
    start(sc);
    settled = run_fair();
    observe_all();
    check_decrees();
    check_live(settled);
    reached = W.crash_reached;
    for (p = 0; p < W.procs; p++) sends[p] = W.sends[p];
    T.dead_only += W.dead_only;
    finish();
    if (W.why[0]) {
        if (!trace) { /* again, printing every event */
            trace = 1;
            printf("the failing run, event by event:\n");
            run_exhaustive(sc, sends, planned);
        }
        report_failure(sc, "exhaustive");
    }
    return reached >= planned;
}

/* ---- the scenarios ---- */

static void scenario_init(scenario *sc, int n) {
    int p;
    memset(sc, 0, sizeof *sc);
    sc->n = n;
    sc->crash0 = sc->sus_a = sc->sus_b = -1;
    sc->inject_at = -1;
    for (p = 0; p < MAXP; p++) sc->crash_after[p] = -1;
}

/* The step statuses: index < 2^n: bit p = COMPLETE (else RUNNING), the vote not passed; then every member
   COMPLETE with bit p = COMMITTED, for the nonzero masks. */
static int status_mixes(int n) { return (1 << n) + (1 << n) - 1; }
static void set_status(scenario *sc, int mix) {
    int p, n = sc->n;
    for (p = 0; p < n; p++) {
        if (mix < (1 << n)) sc->status[p] = (mix >> p & 1) ? DDP__FT_COMPLETE : DDP__FT_RUNNING;
        else sc->status[p] = ((mix - (1 << n) + 1) >> p & 1) ? DDP__FT_COMMITTED : DDP__FT_COMPLETE;
    }
}

/* The starts: a crash of each member; each two-sided partition (side 1 = mask, member 0 always on side 0, so
   each split once, with the first member on either side by size); a false suspicion. */
static int starts(int n) { return n + (1 << (n - 1)) - 1 + 2; }
static void set_start(scenario *sc, int k) {
    int n = sc->n, p;
    if (k < n) {
        sc->crash0 = k;
        return;
    }
    k -= n;
    if (k < (1 << (n - 1)) - 1) {
        for (p = 1; p < n; p++) sc->side[p] = ((k + 1) >> (p - 1)) & 1;
        return;
    }
    k -= (1 << (n - 1)) - 1;
    sc->sus_a = k == 0 ? 1 : 0;
    sc->sus_b = k == 0 ? 0 : n - 1;
}

static int partitioned(const scenario *sc) {
    int p;
    for (p = 0; p < sc->n; p++)
        if (sc->side[p] || sc->cuts[p]) return 1;
    return 0;
}

/* Every start x status mix x joiner (without a partition) x one crash of any member after any of its
   sends, flushed or lost. */
static void explore_one_crash(int n, int stride, long *runs) {
    int st, mix, j, x, k, v, sends[MAXP], base[MAXP];
    scenario sc;
    for (st = 0; st < starts(n); st++)
        for (mix = 0; mix < status_mixes(n); mix += stride)
            for (j = 0; j < 2; j++) {
                scenario_init(&sc, n);
                set_start(&sc, st);
                set_status(&sc, mix);
                if (j && partitioned(&sc)) continue;
                sc.joiner = j;
                run_exhaustive(&sc, base, 0);
                (*runs)++;
                for (x = 0; x < n + j; x++)
                    for (k = 0; k <= base[x]; k++)
                        for (v = 0; v < 4; v++) { /* unsent flushed or lost; at the send or after the handler */
                            if (x == sc.crash0 || (k == 0 && v >= 2)) continue;
                            sc.crash_after[x] = k;
                            sc.crash_lose[x] = v & 1;
                            sc.crash_late[x] = v >> 1;
                            run_exhaustive(&sc, sends, 1);
                            (*runs)++;
                            sc.crash_after[x] = -1;
                            sc.crash_late[x] = 0;
                        }
            }
}

/* N = 3: every start x a few status mixes x every pair of crash points (flushed). */
static void explore_two_crashes(long *runs) {
    static const int mixes[] = {0, 3, 7, 8, 9}; /* all RUNNING; 0,1 COMPLETE; all COMPLETE; 0 COMMITTED; 1 */
    int n = 3, st, mi, x1, x2, k1, k2, sends[MAXP], bound[MAXP];
    scenario sc;
    for (st = 0; st < starts(n); st++)
        for (mi = 0; mi < (int)(sizeof mixes / sizeof mixes[0]); mi++) {
            int p, x;
            scenario_init(&sc, n);
            set_start(&sc, st);
            set_status(&sc, mixes[mi]);
            /* the most sends any member makes with one crash somewhere, bounds the second crash point */
            memset(bound, 0, sizeof bound);
            run_exhaustive(&sc, sends, 0);
            for (p = 0; p < n; p++) bound[p] = sends[p];
            for (x = 0; x < n; x++)
                for (k1 = 1; k1 <= bound[x]; k1++) {
                    sc.crash_after[x] = k1;
                    run_exhaustive(&sc, sends, 1);
                    for (p = 0; p < n; p++) bound[p] = DDP__MAX(bound[p], sends[p]);
                    sc.crash_after[x] = -1;
                }
            for (x1 = 0; x1 < n; x1++)
                for (x2 = x1 + 1; x2 < n; x2++) {
                    if (x1 == sc.crash0 || x2 == sc.crash0) continue;
                    for (k1 = 0; k1 <= bound[x1]; k1++)
                        for (k2 = 0; k2 <= bound[x2]; k2++) {
                            sc.crash_after[x1] = k1;
                            sc.crash_after[x2] = k2;
                            if (run_exhaustive(&sc, sends, 2)) (*runs)++;
                        }
                    sc.crash_after[x1] = sc.crash_after[x2] = -1;
                }
        }
}

/* N = 3 and 4: every start x 3 status mixes x a false suspicion or an early view-change timeout before
   every event of the run, so that coordinators compete (their ballots interleave), with and without a joiner. */
static void explore_early_timeouts(int n, long *runs) {
    static const int mixes[] = {1, 0, -1}; /* 0 COMPLETE; all RUNNING; all COMPLETE but the last COMMITTED */
    int st, mi, j, a, b, sends[MAXP];
    long i, events;
    scenario sc;
    for (st = 0; st < starts(n); st++)
        for (mi = 0; mi < 3; mi++)
            for (j = 0; j < 2; j++) {
                scenario_init(&sc, n);
                set_start(&sc, st);
                set_status(&sc, mixes[mi] >= 0 ? mixes[mi] : (1 << n) + (1 << (n - 1)) - 1);
                if (j && partitioned(&sc)) continue;
                sc.joiner = j;
                run_exhaustive(&sc, sends, 0);
                events = W.clock;
                for (i = 0; i < events; i++)
                    for (a = 0; a < n; a++)
                        for (b = -1; b < n; b++) {
                            if (a == b) continue;
                            sc.inject_at = i;
                            sc.inject_a = a;
                            sc.inject_b = b;
                            if (run_exhaustive(&sc, sends, 0) && W.injected == 1) (*runs)++;
                        }
            }
}

/* Random run r of seed: N 2..7, a random start, statuses, delivery order, false suspicions, timeouts and
   up to 3 crashes, then the fair phase. */
static void run_random_one(uint64_t seed, long r) {
    scenario sc;
    int n = 2 + (int)(r % 6), p, settled, kind, mix;
    rng_state = seed + 0x9E3779B97F4A7C15ull * (uint64_t)(r + 1);
    (void)rnd();
    scenario_init(&sc, n);
    kind = rnd_below(4);
    if (kind == 0) sc.crash0 = rnd_below(n);
    if (kind == 1 || kind == 3) {
        int ones = 0;
        for (p = 0; p < n; p++) ones += sc.side[p] = rnd_below(2);
        if (ones == n) memset(sc.side, 0, sizeof sc.side); /* one side: no partition */
    }
    if (kind == 2 || kind == 3) {
        sc.sus_a = rnd_below(n);
        sc.sus_b = (sc.sus_a + 1 + rnd_below(n - 1)) % n;
    }
    if (kind == 3 && rnd_below(2)) /* a partial partition: links cut alone */
        for (p = 0; p < n; p++) sc.cuts[p] = (unsigned)rnd() & ((1u << n) - 1) & (unsigned)rnd();
    if (!partitioned(&sc) && kind != 0 && kind != 2) sc.crash0 = rnd_below(n);
    mix = rnd_below(2) ? rnd_below(1 << n) : (1 << n) + rnd_below((1 << n) - 1);
    set_status(&sc, mix);
    sc.joiner = !partitioned(&sc) && rnd_below(3) == 0;
    start(&sc);
    run_random(rnd_below(400), rnd_below(4), (int)(r / 6 % 2));
    settled = run_fair();
    observe_all();
    check_decrees();
    check_live(settled);
    T.dead_only += W.dead_only;
    T.random_runs++;
    finish();
    if (W.why[0]) {
        if (!trace) {
            trace = 1;
            printf("the failing run, event by event:\n");
            run_random_one(seed, r);
        }
        fprintf(stderr, "random run %ld of seed %llu (rerun: test_ft_view %llu %ld)\n", r, (unsigned long long)seed,
                (unsigned long long)seed, r + 1);
        report_failure(&sc, "random");
    }
}

static void explore_random(uint64_t seed, long count) {
    long r;
    for (r = 0; r < count; r++) run_random_one(seed, r);
}

/* ---- the pure functions, on their own ---- */

static void test_rules(void) {
    static const uint32_t ids[4] = {0, 2, 5, 9};
    unsigned char dead[CAP], sus[CAP], in[8], gone[8], status[4];
    uint64_t step[4], s;
    ddp__ft_view v, next;
    uint32_t out[CAP];
    int n;
    memset(dead, 0, sizeof dead);
    memset(sus, 0, sizeof sus);
    v.gen = 3;
    v.n = 4;
    v.next_id = 10;
    v.members = (uint32_t *)ids;
    CHECK(ddp__ft_coordinator(&v, dead, sus) == 0, "the coordinator is the lowest id");
    dead[0] = 1;
    sus[2] = 1;
    CHECK(ddp__ft_coordinator(&v, dead, sus) == 5, "the lowest id neither dead nor suspected");
    CHECK(ddp__ft_coordinator(&v, dead, NULL) == 2, "suspicions may be left out");
    CHECK(ddp__ft_rank_of(&v, 5) == 2 && ddp__ft_rank_of(&v, 3) == -1, "rank_of");
    /* the quorum table of ft_view.c's top, against the test's own copy of the rule, n = 1..7, every set */
    for (n = 1; n <= 7; n++) {
        int in_mask, gone_mask, i;
        for (in_mask = 0; in_mask < (1 << n); in_mask++)
            for (gone_mask = 0; gone_mask < (1 << n); gone_mask++) {
                int a[8], g[8];
                if (in_mask & gone_mask) continue;
                for (i = 0; i < n; i++) {
                    in[i] = (unsigned char)(in_mask >> i & 1);
                    gone[i] = (unsigned char)(gone_mask >> i & 1);
                    a[i] = in[i];
                    g[i] = gone[i];
                }
                CHECK((int)ddp__ft_quorum(n, in, gone) == quorum_ok(n, a, g), "quorum n=%d in=%#x gone=%#x", n, in_mask, gone_mask);
            }
    }
    memset(in, 0, sizeof in);
    memset(gone, 0, sizeof gone);
    in[0] = 1;
    CHECK(ddp__ft_quorum(2, in, gone) == DDP__FT_HALF_WITH_FIRST, "1|1: rank 0 goes on");
    in[0] = 0;
    in[1] = 1;
    CHECK(ddp__ft_quorum(2, in, gone) == DDP__FT_NO_QUORUM, "1|1: rank 1 waits");
    gone[0] = 1;
    CHECK(ddp__ft_quorum(2, in, gone) == DDP__FT_ALL_BUT_DEAD, "rank 0 killed: rank 1 goes on");
    /* the verdict */
    memset(in, 1, sizeof in);
    step[0] = step[1] = step[2] = 4;
    status[0] = DDP__FT_COMPLETE, status[1] = DDP__FT_COMPLETE, status[2] = DDP__FT_RUNNING;
    CHECK(ddp__ft_verdict_of(3, in, step, status, &s) == DDP__FT_REDO && s == 4, "one RUNNING: REDO");
    in[2] = 0;
    CHECK(ddp__ft_verdict_of(3, in, step, status, &s) == DDP__FT_COMMIT, "every reporter COMPLETE: COMMIT");
    in[2] = 1;
    status[2] = DDP__FT_COMMITTED;
    CHECK(ddp__ft_verdict_of(3, in, step, status, &s) == DDP__FT_COMMIT, "a COMMITTED: COMMIT");
    step[2] = 5, status[2] = DDP__FT_RUNNING;
    CHECK(ddp__ft_verdict_of(3, in, step, status, &s) == DDP__FT_REDO && s == 5, "one ahead at 5: step 5, REDO");
    /* the next view: keep, append joiners above every id used */
    in[0] = 1, in[1] = 0, in[2] = 1, in[3] = 1;
    next.members = out;
    ddp__ft_next_view(&v, in, 2, 6, &next);
    CHECK(next.gen == 7 && next.n == 5 && out[0] == 0 && out[1] == 5 && out[2] == 9 && out[3] == 10 && out[4] == 11 &&
          next.next_id == 12, "next view");
    printf("rules: coordinator, quorum (every set, n = 1..7: the table), verdict, next view\n");
}

/* A member's answers on their own: it installs only the DECIDE of the ballot it promised, refuses what would
   undo an applied step, drops the dead's messages, refuses malformed ones. */
static void test_member(void) {
    scenario sc;
    ddp__ft_member *m;
    ddp__ft_msg msg;
    uint32_t members[3] = {0, 1, 2}, dead[1] = {0};
    scenario_init(&sc, 3);
    sc.status[1] = DDP__FT_COMMITTED;
    start(&sc);
    m = &W.mem[1];
    memset(&msg, 0, sizeof msg);
    msg.kind = DDP__FT_SUSPECT;
    msg.from = 0;
    msg.ballot.round = 1;
    msg.ballot.coord = 0;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && m->changing && m->promised.round == 1, "reports to ballot (1, 0)");
    msg.kind = DDP__FT_DECIDE;
    msg.has_decide = 1;
    msg.decide.base = 0;
    msg.decide.ballot = msg.ballot;
    msg.decide.view.gen = 1;
    msg.decide.view.next_id = 3;
    msg.decide.view.n = 3;
    msg.decide.view.members = members;
    msg.decide.step = STEP0;
    msg.decide.verdict = DDP__FT_REDO;
    CHECK(ddp__ft_receive(m, &msg) == DDP_ERR_STATE, "REDO of a step it applied: refused as impossible");
    msg.decide.verdict = DDP__FT_COMMIT;
    msg.ballot.round = 2;
    msg.decide.ballot = msg.ballot;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && !m->has_installed, "a ballot it did not promise: not installed");
    msg.ballot.round = 1;
    msg.decide.ballot = msg.ballot;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && m->has_installed, "its ballot: installed");
    members[1] = 7;
    CHECK(ddp__ft_receive(m, &msg) == DDP_ERR_FORMAT, "an id above next_id: malformed");
    members[1] = 1;
    msg.kind = DDP__FT_SUSPECT;
    msg.has_decide = 0;
    msg.from = 2;
    msg.n_dead = 1;
    msg.dead = dead;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && m->dead[0], "a member named dead");
    msg.kind = DDP__FT_GO;
    msg.from = 0;
    msg.has_decide = 1;
    msg.decide.view.members = members + 1; /* {1, 2}: 0 is dead */
    msg.decide.view.n = 2;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && m->view.gen == 0, "nothing from the dead");
    msg.from = 2;
    CHECK(ddp__ft_receive(m, &msg) == DDP_SUCCESS && m->view.gen == 1 && !m->changing && m->step == STEP0 + 1,
          "GO from the living: installed, the step kept");
    msg.decide.view.members = members;
    msg.decide.view.n = 3;
    CHECK(ddp__ft_receive(m, &msg) == DDP_ERR_STATE, "a second list for gen 1: refused as impossible");
    finish();
    printf("member: installs only its promised ballot's DECIDE, refuses undoing an applied step or a second gen, "
           "drops the dead's messages, refuses malformed ones\n");
}

int main(int argc, char **argv) {
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : (uint64_t)time(NULL);
    int n, quick = getenv("TEST_QUICK") != NULL; /* sanitizer runs: every third status mix at N = 4, fewer random runs */
    long count = argc > 2 ? atol(argv[2]) : quick ? 5000 : 30000, runs;
    double t0 = tl_now();
    trace = getenv("FT_TRACE") != NULL;
    test_rules();
    test_member();
    for (n = 2; n <= 4; n++) {
        runs = 0;
        explore_one_crash(n, quick && n == 4 ? 3 : 1, &runs);
        printf("N=%d: every start x %sstatus mix x joiner x one crash after each send (unsent flushed or lost, at once or "
               "after the handler): %ld runs\n", n, quick && n == 4 ? "third " : "", runs);
    }
    for (n = 3; n <= 4; n++) {
        runs = 0;
        explore_early_timeouts(n, &runs);
        printf("N=%d: every start x 3 status mixes x joiner x a false suspicion or an early timeout before each event: %ld runs\n", n, runs);
    }
    runs = 0;
    explore_two_crashes(&runs);
    printf("N=3: every start x 5 status mixes x every pair of crash points: %ld runs\n", runs);
    printf("random: seed %llu, %ld runs (N = 2..7)\n", (unsigned long long)seed, count);
    explore_random(seed, count);
    printf("%ld runs, %ld decrees chosen, %ld quorums checked for liveness, %ld conflicts only with dead members' "
           "decrees (allowed, WHY point 4): %.1f s\n",
           T.runs, T.choices, T.live_checked, T.dead_only, tl_now() - t0);
    printf("ok\n");
    return 0;
}
