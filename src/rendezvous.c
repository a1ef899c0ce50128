/* [SECTION] rendezvous: each rank's record, rank 0's table of them, the job's identity in the store, a
   rank lost inside ddp_init
   ddp_init's step 4 (group.c lists the five), through the store (store.c). */
#include "internal.h"

/* ---- rendezvous through the store ---- */

static void ddp__key(const ddp_group *g, char *out, size_t cap, const char *name, int index) {
    if (index >= 0) snprintf(out, cap, "%s%s/%d", g->member.prefix, name, index);
    else snprintf(out, cap, "%s%s", g->member.prefix, name);
}

/* Fail this rank with code and message, and publish them so that every rank of the rendezvous fails too:
   under "abort" (read by the ranks that look for it: the set-up's collectives, ranks arriving late) and, unless rank 0
   published the table already, as the table's value (DDP__RDZV_ABORTED + "code|message"); then "ready",
   which wakes every rank waiting for the table at once (see ddp__rendezvous). The set is announced, a
   round trip: every write has reached the store before this rank goes. */
static ddp_result ddp__rdzv_abort(ddp_group *g, ddp_result code, const char *msg) {
    char key[256], value[DDP__ERR_MAX + 16], marker[DDP__ERR_MAX + 32], now[8];
    size_t n = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(value, sizeof value, "%d|%.1000s", (int)code, msg);
    ddp_store_set(g->member.store, key, value, strlen(value));
    ddp__key(g, key, sizeof key, "table", -1);
    snprintf(marker, sizeof marker, "%s%s", DDP__RDZV_ABORTED, value);
    ddp__store_compare_set(g->member.store, key, "", 0, marker, strlen(marker), now, sizeof now, &n);
    ddp__key(g, key, sizeof key, "ready", -1); /* a SET: torch's server wakes no WAIT on a compare-set */
    ddp_store_set(g->member.store, key, "1", 1);
    return ddp__fail(g, code, "%s", msg);
}

static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted);

/* Publish this rank's error (g->error) as the abort, unless one is there already. */
static void ddp__rdzv_publish(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    snprintf(msg, sizeof msg, "%s", g->error);
    if (g->member.store && ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
        ddp__rdzv_abort(g, code, msg);
}

/* A rendezvous failed on this rank: publish the error (unless another rank already published one:
   then a rank that only lost a peer fails with the published reason, which is the cause, rather than
   "lost rank i"), hang up its connections and listener, and if this rank serves the store, keep serving until
   every other process has read it (at most a few seconds, for ranks that never started), so that they
   fail with the reason instead of "lost the store". Every other process counts itself in abort_seen,
   whether or not it had joined: one that was still claiming its rank when the error came (a slow start,
   the second of two processes with one rank) must find the store still there. Returns the code this
   rank fails with. */
static ddp_result ddp__rdzv_fail_all(ddp_group *g, ddp_result code) {
    char key[256], msg[DDP__ERR_MAX];
    int exists = 0, aborted = 0;
    int64_t seen = 0;
    double until = ddp__now() + DDP__MIN(g->timeout, 5.0);
    if (!g->member.store) return code;
    /* the group fails here: a store that is gone (rank 0 exited) costs each call seconds, not the timeout */
    ddp__store_set_timeout(g->member.store, DDP__MIN(g->timeout, 5.0));
    snprintf(msg, sizeof msg, "%s", g->error);
    ddp__key(g, key, sizeof key, "abort", -1);
    if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS) return code;
    if (!exists) ddp__rdzv_abort(g, code, msg);
    if (exists && code == DDP_ERR_PEER_LOST) {
        ddp_result published = ddp__rdzv_check_abort(g, &aborted);
        if (aborted) code = published;
        snprintf(msg, sizeof msg, "%s", g->error);
    }
    ddp__fail(g, code, "%s", msg);
    ddp__link_close_all(g); /* at once, not at ddp__group_free: a rank waiting on one fails now and reads why */
    ddp__key(g, key, sizeof key, "abort_seen", -1);
    if (!g->member.store_server) { /* done with the store: the rank serving it may stop waiting for us */
        ddp_store_add(g->member.store, key, 1, &seen);
        return code;
    }
    while (ddp__now() < until && ddp_store_add(g->member.store, key, 0, &seen) == DDP_SUCCESS && seen < g->world_size - 1)
        ddp__sleep(0.01);
    ddp__fail(g, code, "%s", msg);
    return code;
}

/* Fail with the abort another rank published: value is "code|message". */
static ddp_result ddp__rdzv_fail_published(ddp_group *g, const char *value) {
    int code = DDP_ERR_INIT;
    sscanf(value, "%d|", &code);
    return ddp__fail(g, ddp__peer_code(code, DDP_ERR_INIT), "%s", strchr(value, '|') ? strchr(value, '|') + 1 : value);
}

/* Another rank published an abort: fail with its code and message. */
static ddp_result ddp__rdzv_check_abort(ddp_group *g, int *aborted) {
    char key[256], value[DDP__ERR_MAX + 16];
    size_t n = 0;
    int exists = 0;
    ddp_result r;
    *aborted = 0;
    ddp__key(g, key, sizeof key, "abort", -1);
    if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    if (!exists) return DDP_SUCCESS;
    *aborted = 1;
    if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: %s", ddp_store_last_error(g->member.store));
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    return ddp__rdzv_fail_published(g, value);
}

static int ddp__record_parse(const char *value, ddp__record *r) {
    memset(r, 0, sizeof *r);
    return sscanf(value, "world=%d port=%d pid=%d addr=%127s host=%127s node=%llx", &r->world, &r->port, &r->pid, r->addr,
                  r->host, &r->node) >= 5;
}

#define DDP__RECORD_MAX 400 /* bytes of one record's text, with room to spare */
static void ddp__record_format(const ddp__record *r, char *out, size_t cap) {
    snprintf(out, cap, "world=%d port=%d pid=%d addr=%s host=%s node=%llx", r->world, r->port, r->pid, r->addr, r->host,
             r->node);
}

/* One rank's line of the table that rank 0 publishes: "port pid node addr host", with "-" for an address
   or host name equal to the rank before's (ranks of one host are neighbours), so that the table every
   rank reads is about 25 bytes a rank rather than a record's 100: at 10,000 ranks the store sends it
   10,000 times. The world size is not repeated: rank 0 checked every record's. */
static void ddp__table_line(const ddp__record *rec, int i, char *out, size_t cap) {
    int same_addr = i > 0 && strcmp(rec[i].addr, rec[i - 1].addr) == 0, same_host = i > 0 && strcmp(rec[i].host, rec[i - 1].host) == 0;
    snprintf(out, cap, "%d %d %llx %s %s", rec[i].port, rec[i].pid, rec[i].node, same_addr ? "-" : rec[i].addr,
             same_host ? "-" : rec[i].host);
}

static int ddp__table_parse(const char *line, ddp__record *rec, int i, int world) {
    ddp__record *r = &rec[i];
    memset(r, 0, sizeof *r);
    r->world = world;
    if (sscanf(line, "%d %d %llx %127s %127s", &r->port, &r->pid, &r->node, r->addr, r->host) != 5) return 0;
    if (strcmp(r->addr, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->addr, rec[i - 1].addr, sizeof r->addr);
    }
    if (strcmp(r->host, "-") == 0) {
        if (i == 0) return 0;
        memcpy(r->host, rec[i - 1].host, sizeof r->host);
    }
    return 1;
}

/* ---- noticing a rank that died inside ddp_init ----
   Once a rank has published its record it listens on its port (for the group's life) and its pid is
   known. So a "connection refused" from that port means the rank is gone, and so does a pid that no
   longer exists on this node (same host, boot, network and pid namespace: the record's `node`;
   kill(pid, 0) means nothing across pid namespaces). Ranks that wait (for the others to join, for a
   rank to connect in the set-up's collectives: ddp__setup_watch) look every DDP__WATCH_PERIOD s (the
   set-up's waits back off to 2 s); the rank that notices publishes an abort naming the lost rank
   (ddp__rdzv_lost), which every waiting rank reads within that period. Ranks on other nodes are
   noticed by the refused connection of the rank that dials them (link.c). */
/* Ranks share memory only within one host and one network namespace (tests put "hosts" in
   namespaces on one machine; each namespace counts as a host). */
/* This boot's id (/proc/sys/kernel/random/boot_id; "" when unreadable) into out: one machine, one clock. */
static void ddp__boot_id(char *out, size_t cap) {
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    out[0] = '\0';
    if (!f) return;
    if (fgets(out, (int)cap, f) == NULL) out[0] = '\0';
    fclose(f);
}

static uint64_t ddp__host_key(void) {
    char buf[512] = "", ns[128] = "";
    ssize_t k = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    gethostname(buf, 200);
    buf[200] = '\0';
    snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "|%s|", ns);
    ddp__boot_id(buf + strlen(buf), sizeof buf - strlen(buf));
    return ddp__hash(buf);
}


static unsigned long long ddp__node_key(void) {
    char ns[128] = "", buf[200];
    ssize_t k = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (k > 0) ns[k] = '\0';
    snprintf(buf, sizeof buf, "%016llx|%s", (unsigned long long)ddp__host_key(), ns);
    return (unsigned long long)ddp__hash(buf) | 1u;
}

/* Is the process pid of a rank on this node gone (no such process, or a zombie its parent has not reaped)? */
static int ddp__pid_gone(int pid, unsigned long long its_node, unsigned long long node) {
    char path[64], stat[512];
    const char *end;
    size_t n;
    FILE *f;
    if (!its_node || its_node != node || pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (!(f = fopen(path, "r"))) return 0;
    n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    end = strrchr(stat, ')'); /* "pid (comm) S ...": the state follows the command name */
    return end && end[1] == ' ' && end[2] == 'Z';
}

static int ddp__rank_process_gone(const ddp__record *r, unsigned long long node) { return ddp__pid_gone(r->pid, r->node, node); }

/* Rank i, which had registered, is gone: unless another rank has published an abort already (then fail
   with that one), publish one naming it, so that every rank fails now with this message. */
static ddp_result ddp__rdzv_lost(ddp_group *g, int i, const ddp__record *r, const char *how) {
    char msg[DDP__ERR_MAX], key[256];
    int aborted = 0;
    int64_t seen = 0;
    ddp_result res = ddp__rdzv_check_abort(g, &aborted);
    if (res != DDP_SUCCESS || aborted) return res ? res : DDP_ERR_INIT;
    snprintf(msg, sizeof msg, "rank %d (host %s, pid %d) was lost during ddp_init: %s. It had registered in the "
             "rendezvous and then exited; its own output (or exit status) says why", i, r->host, r->pid, how);
    res = ddp__rdzv_abort(g, DDP_ERR_PEER_LOST, msg);
    ddp__key(g, key, sizeof key, "lost", i); /* the lost rank never reads the abort: count it as read, once */
    if (ddp_store_add(g->member.store, key, 1, &seen) == DDP_SUCCESS && seen == 1) {
        ddp__key(g, key, sizeof key, "abort_seen", -1);
        ddp_store_add(g->member.store, key, 1, &seen);
    }
    return res;
}

/* ---- the table of records: rank 0 gathers it, every other rank waits for it ----
   Each rank claims its rank ("claim/R", an ADD), publishes its record under "rank/R" (a SET: it wakes a
   WAIT, in torch's server too, which a compare-set does not) and adds 1 to "joined". Rank 0 reads the
   records in rank order as they appear, each once (a WAIT for the next one, then a GET), and when it has
   them all publishes them as one value, "table" (one short line per rank, ddp__table_line; a
   compare-set, so that it never hides a failure published first), then sets "ready". Every other rank makes one blocking WAIT on
   "ready" and one GET of "table": about 20 requests per rank in all, rank 0's reading included, instead
   of every rank polling a counter and reading every record (2N^2). A rank that fails publishes its
   error as the table's value and sets "ready" (ddp__rdzv_abort), so the same WAIT wakes every rank on a
   failure too.
   While it gathers, rank 0 looks every DDP__WATCH_PERIOD s for a published abort, reads up to 8 records
   out of order (so that a rank that died beyond a missing one is seen too), and checks the pids of the
   ranks of its node that registered (ddp__rank_process_gone; 256 processes a look, round robin); a
   lost rank is published and named. On its timeout it publishes which ranks never joined; the others
   wait DDP__RDZV_GRACE s longer, so that they read that message rather than time out on their own.
   Ranks on other nodes that die after registering are named when a rank first dials them (a refused
   connection, link.c) or by the ranks waiting for them to dial (ddp__setup_watch). */
#define DDP__RDZV_GRACE 5.0
#define DDP__RDZV_SCAN 8 /* records rank 0 reads out of order per look */

/* Read rank i's record into rec[i] if it is there. 1: read, 0: not there yet, else a failure (published). */
static int ddp__rdzv_read_record(ddp_group *g, int i, ddp__record *rec, ddp_result *res) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX];
    int exists = 0;
    size_t n = 0;
    ddp__key(g, key, sizeof key, "rank", i);
    if ((*res = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS || !exists ||
        (*res = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS) {
        if (*res) *res = ddp__fail(g, *res, "rendezvous: reading rank %d's record: %s", i, ddp_store_last_error(g->member.store));
        return 0;
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (!ddp__record_parse(value, &rec[i])) {
        snprintf(msg, sizeof msg, "rank %d published a malformed rendezvous record \"%.200s\" (another program using the "
                 "same store?)", i, value);
        *res = ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
        return 0;
    }
    if (rec[i].world != g->world_size) {
        snprintf(msg, sizeof msg, "ranks disagree on the world size: rank %d (host %s, pid %d) was started with world "
                 "size %d, rank %d with %d; start every rank with the same WORLD_SIZE", i, rec[i].host, rec[i].pid,
                 rec[i].world, g->rank, g->world_size);
        *res = ddp__rdzv_abort(g, DDP_ERR_MISMATCH, msg);
        return 0;
    }
    return 1;
}

/* Every DDP__WATCH_PERIOD s while rank 0 gathers: an abort, a few records out of order, lost ranks. */
#define DDP__RDZV_PID_CHECKS 256 /* processes rank 0 looks for per look */
static ddp_result ddp__rdzv_gather_watch(ddp_group *g, ddp__record *rec, unsigned char *known, int *have, int *scan,
                                         int *pid_scan, unsigned long long node) {
    int i, k, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    if (g->member.gone && (k = g->member.gone(g->member.gone_arg)) >= 0) /* a fault-tolerant view's member */
        return ddp__fail(g, DDP_ERR_PEER_LOST, "rank %d of the view is gone (its fault-tolerance control connection "
                         "closed) before it joined the view's rendezvous", k);
    for (k = 0; k < DDP__RDZV_SCAN && *have < g->world_size; k++) {
        for (i = 0; i < g->world_size && known[*scan]; i++) *scan = (*scan + 1) % g->world_size;
        if (ddp__rdzv_read_record(g, *scan, rec, &r)) known[*scan] = 1, ++*have;
        if (r) return r;
        *scan = (*scan + 1) % g->world_size;
    }
    /* The pids, DDP__RDZV_PID_CHECKS at most per look, taking up where the last look stopped (a look at
       thousands of ranks' /proc entries every 0.25 s would be rank 0's main work: measured at 4,096 ranks,
       1 s a look); a rank with the pid and node of the rank before it (threads of one process) is one look. */
    for (i = 0, k = 0; i < g->world_size && k < DDP__RDZV_PID_CHECKS; i++) {
        int at = (*pid_scan + i) % g->world_size, prev = (at + g->world_size - 1) % g->world_size;
        if (!known[at] || at == g->rank) continue;
        if (known[prev] && rec[prev].pid == rec[at].pid && rec[prev].node == rec[at].node) continue;
        k++;
        if (ddp__rank_process_gone(&rec[at], node)) return ddp__rdzv_lost(g, at, &rec[at], "its process no longer exists");
    }
    *pid_scan = (*pid_scan + i) % g->world_size;
    return DDP_SUCCESS;
}

/* Rank 0 gave up waiting: publish who never joined (as "3, 5, 9 (and 4 more)"), so every rank fails with it. */
static ddp_result ddp__rdzv_gather_timeout(ddp_group *g, const unsigned char *known, int have, const char *where) {
    char missing[512] = "", msg[DDP__ERR_MAX];
    int i, shown = 0;
    for (i = 0; i < g->world_size; i++)
        if (!known[i] && shown++ < 16)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown > 1 ? ", " : "", i);
    if (shown > 16) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " and %d more", shown - 16);
    snprintf(msg, sizeof msg, "timed out after %.0f s waiting for every rank to join (%d of %d joined through %s; "
             "missing: %s). Are they all started, with the same world size and master?", g->timeout, have,
             g->world_size, where, missing);
    return ddp__rdzv_abort(g, DDP_ERR_TIMEOUT, msg);
}

/* Rank 0: wait at most `seconds` for rank i's record. A WAIT that times out drops the store connection
   (the client cannot tell a late answer from the next one) and the next request connects again: at most
   one reconnection per DDP__WATCH_PERIOD, and only while ranks are late. */
static ddp_result ddp__rdzv_gather_wait(ddp_group *g, int i, double seconds) {
    char key[256];
    const char *keys[1];
    ddp_result r;
    ddp__key(g, key, sizeof key, "rank", i);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, DDP__MAX(seconds, 0.01));
    if (r == DDP_SUCCESS || r == DDP_ERR_TIMEOUT) return DDP_SUCCESS;
    return ddp__fail(g, r, "rendezvous: waiting for rank %d's record: %s", i, ddp_store_last_error(g->member.store));
}

/* Rank 0: read every record (rec[0] is its own), then publish the table. */
static ddp_result ddp__rdzv_gather(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], marker[DDP__ERR_MAX + 32], *table;
    double start = ddp__now(), next_watch = start + DDP__WATCH_PERIOD;
    unsigned long long node = ddp__node_key();
    unsigned char *known = (unsigned char *)ddp__calloc((size_t)g->world_size, 1);
    int have = 1, cursor = 1, scan = 1, pid_scan = 0, i;
    size_t len = 0, n = 0;
    ddp_result r = DDP_SUCCESS;
    if (!known) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    known[0] = 1;
    while (have < g->world_size && r == DDP_SUCCESS) {
        for (; cursor < g->world_size; cursor++) { /* in rank order, while they are there */
            if (known[cursor]) continue;
            if (!ddp__rdzv_read_record(g, cursor, rec, &r)) break;
            known[cursor] = 1, have++;
        }
        if (have == g->world_size || r) break;
        if (ddp__now() >= next_watch) {
            if ((r = ddp__rdzv_gather_watch(g, rec, known, &have, &scan, &pid_scan, node)) != DDP_SUCCESS) break;
            next_watch = ddp__now() + DDP__WATCH_PERIOD;
        }
        if (ddp__now() - start > g->timeout) r = ddp__rdzv_gather_timeout(g, known, have, where);
        else r = ddp__rdzv_gather_wait(g, cursor, DDP__MIN(next_watch, start + g->timeout) - ddp__now());
    }
    ddp__free(known);
    if (r) return r;
    if (!(table = (char *)ddp__malloc((size_t)g->world_size * DDP__RECORD_MAX))) {
        ddp__rdzv_abort(g, DDP_ERR_OUT_OF_MEMORY, "rank 0 ran out of memory assembling the rendezvous table");
        return DDP_ERR_OUT_OF_MEMORY;
    }
    for (i = 0; i < g->world_size; i++) {
        ddp__table_line(rec, i, table + len, DDP__RECORD_MAX - 1);
        len += strlen(table + len);
        table[len++] = '\n';
    }
    ddp__key(g, key, sizeof key, "table", -1);
    r = ddp__store_compare_set(g->member.store, key, "", 0, table, len, marker, sizeof marker - 1, &n);
    ddp__free(table);
    if (r) return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    marker[DDP__MIN(n, sizeof marker - 1)] = '\0';
    if (strncmp(marker, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) /* a rank failed just before */
        return ddp__rdzv_fail_published(g, marker + strlen(DDP__RDZV_ABORTED));
    ddp__key(g, key, sizeof key, "ready", -1);
    if ((r = ddp_store_set(g->member.store, key, "1", 1)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous: publishing the table: %s", ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Rank 0 has not published the table in time, nor why: name the ranks whose records are missing (at most
   16 looked up: this is the rare path where rank 0 itself is stuck or absent). */
static ddp_result ddp__rdzv_await_timeout(ddp_group *g, const char *where) {
    char key[256], missing[512] = "";
    int i, exists, shown = 0, aborted = 0;
    ddp_result r = ddp__rdzv_check_abort(g, &aborted);
    if (r != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
    for (i = 0; i < g->world_size && shown < 16; i++) {
        ddp__key(g, key, sizeof key, "rank", i);
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && !exists)
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", shown++ ? ", " : "", i);
    }
    return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for every rank to join through %s (missing: %s; "
                     "rank 0 publishes the table of addresses once all have joined). Are they all started, with the "
                     "same world size and master?", g->timeout, where, missing[0] ? missing : "none: is rank 0 stuck?");
}

/* Every rank but 0: one WAIT for the table, one GET of it, then its lines into rec. */
static ddp_result ddp__rdzv_await(ddp_group *g, ddp__record *rec, const char *where) {
    char key[256], *table, *line, msg[DDP__ERR_MAX];
    const char *keys[1];
    size_t cap = (size_t)g->world_size * DDP__RECORD_MAX, n = 0;
    int i;
    ddp_result r;
    ddp__key(g, key, sizeof key, "ready", -1);
    keys[0] = key;
    r = ddp_store_wait(g->member.store, keys, 1, g->timeout + DDP__RDZV_GRACE);
    if (r == DDP_ERR_TIMEOUT) return ddp__rdzv_await_timeout(g, where);
    if (r) return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "table", -1); /* set before "ready": the records, or a published failure */
    if (!(table = (char *)ddp__malloc(cap + 1))) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    if ((r = ddp_store_get(g->member.store, key, table, cap, &n)) != DDP_SUCCESS) {
        ddp__free(table);
        return ddp__fail(g, r, "rendezvous: reading the table: %s", ddp_store_last_error(g->member.store));
    }
    table[DDP__MIN(n, cap)] = '\0';
    if (strncmp(table, DDP__RDZV_ABORTED, strlen(DDP__RDZV_ABORTED)) == 0) {
        r = ddp__rdzv_fail_published(g, table + strlen(DDP__RDZV_ABORTED));
        ddp__free(table);
        return r;
    }
    for (i = 0, line = table; i < g->world_size && line && ddp__table_parse(line, rec, i, g->world_size); i++)
        if ((line = strchr(line, '\n')) != NULL) line++;
    ddp__free(table);
    if (i == g->world_size && n <= cap) return DDP_SUCCESS;
    snprintf(msg, sizeof msg, "the rendezvous table in %s is malformed at rank %d's line (%zu bytes; another program "
             "using the same store?)", where, i, n);
    return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
}

/* ---- the job's identity in the store ----
   Two jobs can meet in one store: a job whose rank 0 could not bind MASTER_PORT (another job holds it)
   still has ranks that connect there, to the other job's store. Before any rank claims its rank, the
   world group's rank 0 records the job in "<prefix>job" ("world=W pid=P host=H run=ID", ID being
   TORCHELASTIC_RUN_ID, which torchrun and ddprun set; empty when unknown) and every rank reads that
   record first: a different run id, or a job whose ranks have all joined already, is another job,
   and this rank fails at once saying so, without writing anything into the other job's store.
   Rank 0 writes it with compare_set, so that under torchrun's agent store (where every rank is a
   client) a record already there is compared like any other. */
typedef struct ddp__job {
    int world, pid;
    char host[128];
    char run[128]; /* "" when the launcher named no run */
} ddp__job;

static int ddp__job_parse(const char *value, ddp__job *j) {
    const char *run = strstr(value, " run=");
    memset(j, 0, sizeof *j);
    if (!run || sscanf(value, "world=%d pid=%d host=%127s", &j->world, &j->pid, j->host) != 3) return 0;
    snprintf(j->run, sizeof j->run, "%s", run + 5);
    return 1;
}

/* *foreign = 1 when this rank must write nothing into the store: it belongs to another job (g->error
   says so), or rank 0 never recorded the job there. */
static ddp_result ddp__rdzv_job(ddp_group *g, const char *where, int file_store, int *foreign) {
    char key[256], mine[512], value[512], host[128], advice[256];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID");
    double start = ddp__now(), nap = 0.001;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    ddp_result r;
    *foreign = 0;
    if (!run) run = "";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(mine, sizeof mine, "world=%d pid=%d host=%s run=%.127s", g->world_size, (int)getpid(), host, run);
    ddp__key(g, key, sizeof key, "job", -1);
    if (g->rank == 0) {
        if ((r = ddp__store_compare_set(g->member.store, key, "", 0, mine, strlen(mine), value, sizeof value - 1, &n)) !=
            DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    } else {
        for (;;) { /* rank 0 records the job first thing; wait for it as for the store */
            int exists = 0, aborted = 0;
            if ((r = ddp_store_check(g->member.store, key, &exists)) != DDP_SUCCESS)
                return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
            if (exists) break;
            if ((r = ddp__rdzv_check_abort(g, &aborted)) != DDP_SUCCESS || aborted) return r ? r : DDP_ERR_INIT;
            if (ddp__now() - start > g->timeout) {
                *foreign = 1; /* whose store this is is not known: write nothing into it */
                return ddp__fail(g, DDP_ERR_TIMEOUT, "timed out after %.0f s waiting for rank 0 to register this job in %s: "
                                 "is rank 0 running? (If another program holds that port, rank 0 could not start the "
                                 "store: pick another MASTER_PORT or use ddprun --standalone)", g->timeout, where);
            }
            ddp__sleep(nap);
            nap = DDP__MIN(nap * 2, 0.05);
        }
        if ((r = ddp_store_get(g->member.store, key, value, sizeof value - 1, &n)) != DDP_SUCCESS)
            return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    }
    value[DDP__MIN(n, sizeof value - 1)] = '\0';
    if (g->rank == 0 && strcmp(value, mine) == 0) return DDP_SUCCESS; /* recorded it: the usual case */
    if (file_store)
        snprintf(advice, sizeof advice, "is the file used by another job, or left behind by one that did not finish? "
                 "give this job a new file");
    else
        snprintf(advice, sizeof advice, "is MASTER_PORT already used by another job? pick another port or use "
                 "ddprun --standalone");
    *foreign = 1;
    if (!ddp__job_parse(value, &them))
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: its record \"%.100s\" was not written by ddp.h's "
                         "rendezvous; %s", where, value, advice);
    if (run[0] && them.run[0] && strcmp(run, them.run) != 0)
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job (run id %s, rank 0 is pid %d on host %s, started with "
                         "world size %d); this job's run id is %s: %s", where, them.run, them.pid, them.host, them.world,
                         run, advice);
    /* Same or unknown run id. A job whose ranks have all joined has no place for this one: every rank
       of this job joins only after reading the record, so a full count means another job, or a second
       process with this rank arriving late. */
    ddp__key(g, key, sizeof key, "joined", -1);
    if ((r = ddp_store_add(g->member.store, key, 0, &joined)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    if (joined >= them.world) {
        return ddp__fail(g, DDP_ERR_INIT, "%s belongs to another job: all %d ranks of the job there have joined already (run id "
                 "%s, rank 0 is pid %d on host %s, started with world size %d); this job's run id is %s, its world size "
                 "%d: %s (if this process belongs to that job, it is a second process with rank %d: check RANK)", where,
                 them.world, them.run[0] ? them.run : "unknown", them.pid, them.host, them.world, run[0] ? run : "unknown",
                 g->world_size, advice, g->rank);
    }
    *foreign = 0;
    if (them.world != g->world_size) { /* said here, before joining: rank 0 gathers only a world of its size */
        snprintf(mine, sizeof mine, "ranks disagree on the world size: rank 0 (host %s, pid %d) was started with world "
                 "size %d, rank %d (host %s, pid %d) with %d; start every rank with the same WORLD_SIZE", them.host,
                 them.pid, them.world, g->rank, host, (int)getpid(), g->world_size);
        return ddp__rdzv_abort(g, DDP_ERR_MISMATCH, mine);
    }
    return DDP_SUCCESS;
}

/* Rank 0 could not start the store: MASTER_PORT is taken. Whose is it? Connect as a client for a few
   seconds. If it is this job's store (a job record of the same run id, or of none; the same world size;
   not every rank joined; a rank-0 claim made; its rank 0 alive where this host can tell), this process
   is a second one with rank 0: publish that, so that every rank fails at once rather than at the
   timeout, and fail with it. If the server there does not speak the store protocol, err (port in use)
   says so too. Returns r, or DDP_ERR_INIT for a second rank 0 (err then says so). */
static ddp_result ddp__rank0_port_taken(ddp_group *g, const ddp__launch *L, ddp_result r, char *err) {
    char key[256], claim[256], value[512], why[DDP__ERR_MAX], host[128], msg[DDP__ERR_MAX];
    const char *run = ddp__env("TORCHELASTIC_RUN_ID") ? ddp__env("TORCHELASTIC_RUN_ID") : "";
    double window = DDP__MIN(g->timeout, 3.0), until = ddp__now() + window;
    int exists = 0, claimed = 0, ours;
    int64_t joined = 0;
    size_t n = 0;
    ddp__job them;
    if (ddp__store_connect(L->master_addr, L->master_port, NULL, window, &g->member.store, why) != DDP_SUCCESS) {
        if (strstr(why, "does not speak the store protocol") && strlen(err) + 4 < DDP__ERR_MAX)
            snprintf(err + strlen(err), DDP__ERR_MAX - strlen(err), " (%.600s)", why);
        return r;
    }
    ddp__key(g, key, sizeof key, "job", -1);
    ddp__key(g, claim, sizeof claim, "claim", 0);
    while (!(exists && claimed) && ddp__now() < until) { /* the other rank 0 records the job, then claims */
        if (ddp_store_check(g->member.store, key, &exists) != DDP_SUCCESS ||
            ddp_store_check(g->member.store, claim, &claimed) != DDP_SUCCESS)
            break;
        if (!(exists && claimed)) ddp__sleep(0.02);
    }
    ours = exists && claimed && ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS;
    value[ours ? DDP__MIN(n, sizeof value - 1) : 0] = '\0';
    ddp__key(g, key, sizeof key, "joined", -1);
    ours = ours && ddp__job_parse(value, &them) && !(run[0] && them.run[0] && strcmp(run, them.run) != 0) &&
           them.world == g->world_size && ddp_store_add(g->member.store, key, 0, &joined) == DDP_SUCCESS &&
           joined < them.world;
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    if (ours && strcmp(them.host, host) == 0 && kill((pid_t)them.pid, 0) != 0 && errno == ESRCH) ours = 0;
    if (!ours) {
        ddp__store_free(g->member.store);
        g->member.store = NULL;
        return r;
    }
    g->member.owns_store = 1;
    snprintf(msg, sizeof msg, "two processes claim rank 0: pid %d on host %s serves the store on %s:%d, and pid %d on "
             "host %s, also rank 0, could not; every process needs its own rank (check RANK or the launcher's settings)",
             them.pid, them.host, L->master_addr, L->master_port, (int)getpid(), host);
    ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    ddp__key(g, key, sizeof key, "abort_seen", -1); /* as any process that read it: rank 0 need not wait for this one */
    ddp_store_add(g->member.store, key, 1, &joined);
    return ddp__fail_to(err, DDP_ERR_INIT, "%s", msg);
}

/* Claim this rank (a second process with the same rank sees a count above 1: it fails, naming the first
   when its record is there) and publish its record. */
static ddp_result ddp__rdzv_claim(ddp_group *g, const ddp__record *me, const char *where) {
    char key[256], value[DDP__RECORD_MAX + 112], msg[DDP__ERR_MAX], first[200] = "";
    int64_t claims = 0;
    int exists = 0;
    size_t n = 0;
    ddp__record them;
    ddp_result r;
    ddp__key(g, key, sizeof key, "claim", g->rank);
    if ((r = ddp_store_add(g->member.store, key, 1, &claims)) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    ddp__key(g, key, sizeof key, "rank", g->rank);
    if (claims > 1) {
        if (ddp_store_check(g->member.store, key, &exists) == DDP_SUCCESS && exists &&
            ddp_store_get(g->member.store, key, value, sizeof value - 1, &n) == DDP_SUCCESS &&
            (value[DDP__MIN(n, sizeof value - 1)] = '\0', ddp__record_parse(value, &them)))
            snprintf(first, sizeof first, " (the first is pid %d on host %.100s)", them.pid, them.host);
        snprintf(msg, sizeof msg, "two processes claim rank %d%s; the second is pid %d on host %s. Every process needs "
                 "its own rank (check RANK or the launcher's settings)", g->rank, first, me->pid, me->host);
        return ddp__rdzv_abort(g, DDP_ERR_INIT, msg);
    }
    ddp__record_format(me, value, sizeof value);
    if ((r = ddp_store_set(g->member.store, key, value, strlen(value))) != DDP_SUCCESS)
        return ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
    return DDP_SUCCESS;
}

/* Keep the table as the group's directory (link.c dials from it): the numbers, and each address and
   host name once per run of ranks that share it (ranks of one host are usually neighbours). */
static uint32_t ddp__dir_string(ddp_group *g, const char *text, int prev) {
    size_t n = strlen(text) + 1;
    if (prev >= 0 && strcmp(g->mesh.names + prev, text) == 0) return (uint32_t)prev;
    if (g->mesh.names_len + n > g->mesh.names_cap) {
        size_t cap = DDP__MAX(g->mesh.names_cap * 2, g->mesh.names_len + n + 256);
        char *grown = (char *)ddp__malloc(cap);
        if (!grown) return UINT32_MAX;
        if (g->mesh.names_len) memcpy(grown, g->mesh.names, g->mesh.names_len);
        ddp__free(g->mesh.names);
        g->mesh.names = grown, g->mesh.names_cap = cap;
    }
    memcpy(g->mesh.names + g->mesh.names_len, text, n);
    g->mesh.names_len += n;
    return (uint32_t)(g->mesh.names_len - n);
}

static ddp_result ddp__dir_fill(ddp_group *g, const ddp__record *rec) {
    int i;
    if (!(g->mesh.dir = (ddp__peer_info *)ddp__calloc((size_t)g->world_size, sizeof *g->mesh.dir)))
        return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
    for (i = 0; i < g->world_size; i++) {
        ddp__peer_info *d = &g->mesh.dir[i];
        d->port = rec[i].port, d->pid = rec[i].pid, d->node = rec[i].node;
        d->addr = ddp__dir_string(g, rec[i].addr, i > 0 ? (int)g->mesh.dir[i - 1].addr : -1);
        d->host = ddp__dir_string(g, rec[i].host, i > 0 ? (int)g->mesh.dir[i - 1].host : -1);
        if (d->addr == UINT32_MAX || d->host == UINT32_MAX) {
            ddp__free(g->mesh.dir);
            g->mesh.dir = NULL;
            return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory keeping the rendezvous table");
        }
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__rendezvous(ddp_group *g, const char *addr, int port, const char *where) {
    char key[256];
    ddp__record *rec;
    int64_t joined = 0;
    int i, same_host = 0, local_index = 0;
    ddp_result r;

    rec = (ddp__record *)ddp__calloc((size_t)g->world_size, sizeof *rec);
    if (!rec) return ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "out of memory in the rendezvous");
    rec[g->rank].world = g->world_size;
    rec[g->rank].port = port;
    rec[g->rank].pid = (int)getpid();
    snprintf(rec[g->rank].addr, sizeof rec[g->rank].addr, "%s", addr);
    if (gethostname(rec[g->rank].host, sizeof rec[g->rank].host) != 0) snprintf(rec[g->rank].host, sizeof rec[g->rank].host, "?");
    rec[g->rank].host[sizeof rec[g->rank].host - 1] = '\0';
    rec[g->rank].node = ddp__node_key();
    if ((r = ddp__rdzv_claim(g, &rec[g->rank], where)) != DDP_SUCCESS) goto done;
    ddp__key(g, key, sizeof key, "joined", -1); /* read by ddp__rdzv_job: a full count means another job */
    if ((r = ddp_store_add(g->member.store, key, 1, &joined)) != DDP_SUCCESS) {
        r = ddp__fail(g, r, "rendezvous through %s: %s", where, ddp_store_last_error(g->member.store));
        goto done;
    }
    r = g->rank == 0 ? ddp__rdzv_gather(g, rec, where) : ddp__rdzv_await(g, rec, where);
    if (r) goto done;
    for (i = 0; i < g->world_size; i++)
        if (strcmp(rec[i].host, rec[g->rank].host) == 0) {
            if (i < g->rank) local_index++;
            same_host++;
        }
    if (g->local_rank < 0 || g->local_world_size < 0) {
        g->local_rank = local_index;
        g->local_world_size = same_host;
    }
    r = ddp__dir_fill(g, rec);
done:
    ddp__free(rec);
    return r;
}

/* The address of this host's interface that routes to the master (a UDP "connect" sends nothing). */
static void ddp__route_address(const char *master, int port, char *out, size_t cap) {
    struct addrinfo hints, *res = NULL;
    char service[16];
    int fd;
    snprintf(out, cap, "127.0.0.1");
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_DGRAM;
    snprintf(service, sizeof service, "%d", port);
    if (!master || getaddrinfo(master, service, &hints, &res) != 0) return;
    fd = socket(res->ai_family, SOCK_DGRAM, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) ddp__net_local_address(fd, out, cap);
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
}
