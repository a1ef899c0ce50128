/* [SECTION] store-server: the store's server: one thread, an epoll loop, parsing and answering requests
   (store.c's head comment describes the protocols, the server, its budget and shares, and refusals). */
#include "internal.h"
#include "store_state.h"
#include <sys/epoll.h>

/* ---- reading a request whose bytes are all there ---- */

typedef struct ddp__rd {
    const unsigned char *p;
    size_t n, at;
} ddp__rd;

static uint64_t ddp__rd_u64(ddp__rd *r) {
    uint64_t v;
    memcpy(&v, r->p + r->at, 8);
    r->at += 8;
    return v;
}

static const unsigned char *ddp__rd_str(ddp__rd *r, size_t *len) {
    *len = (size_t)ddp__rd_u64(r);
    r->at += *len;
    return r->p + r->at - *len;
}

/* ---- connections and the server ---- */

typedef struct ddp__store_wait_key {
    uint64_t hash;
    size_t off, len; /* in the connection's wait_blob */
} ddp__store_wait_key;

typedef struct ddp__store_conn {
    int fd, dead;
    int closed;            /* the client closed its side: handle what it sent, then drop it */
    int ready;             /* requests may be waiting in `in` while replies pile up in `out` */
    char peer[80];         /* address:port, for the log */
    unsigned char *in;     /* received bytes not yet handled */
    size_t in_len, in_cap, need;
    unsigned char *out;    /* replies not yet sent: out[out_off .. out_len) */
    size_t out_off, out_len, out_cap;
    int auth;              /* DDP_AUTH_TOKEN: 1 awaiting the hello, 2 awaiting the proof, 0 authenticated/off */
    int proto;             /* 0 until its first query, then 1 (torch 1.13's protocol) or 2 (torch 2.x's) */
    unsigned char auth_cn[16], auth_sn[16];
    ddp__store_wait_key *waits; /* the pending WAIT's missing keys */
    size_t nwaits, wait_bytes;
    unsigned char *wait_blob;
    size_t held;           /* bytes of the stored entries charged to it (see ddp__srv_room) */
    int announced;         /* it sent DDP__STORE_ANNOUNCE: its next request gets a status byte */
    int status_due;        /* the request being handled was announced and its status byte is not sent yet */
    int refused;           /* the request being handled was refused */
    size_t slot;           /* its index in the server's conns */
    int touched;           /* on the server's touched list this round */
    unsigned events;       /* what its epoll entry waits for now */
} ddp__store_conn;

struct ddp__store_server {
    int listen_fd, port;
    int pipe_rd, pipe_wr; /* wakes the thread: to stop (stopping) or to publish rank 0's failure (failure_due) */
    int stopping, failure_given, failure_due;
    char failure[DDP__ERR_MAX]; /* ddp__store_server_publish_failure's reason: written once, then failure_due */
    pthread_t thread;
    ddp_log_level log_level;
    char where[96];
    ddp__kv_table kv;
    ddp__store_conn **conns;
    size_t nconns, cap_conns;
    ddp__store_conn **touched; /* clients to flush and re-arm at the end of the round (capacity cap_conns) */
    size_t ntouched;
    int epfd;
    size_t buffers; /* bytes of connections, their buffers and pending waits */
    size_t max_held; /* the budget: kv.bytes + buffers stay under it (DDP_STORE_MAX_BYTES) */
    size_t share;    /* what one connection may be charged for: max_held / 8 */
    size_t reserve;  /* the budget's last part, for small entries only: max_held / 8 */
    double accept_paused_until;
    int out_of_fds; /* accept is failing with EMFILE/ENFILE: said once per episode */
    /* ddp_init's rendezvous keys (ddp__store_server_abort_key), while a rendezvous is on: where the
       server itself publishes "it cannot accept a rank", so that every rank fails with the reason */
    char abort_key[256], table_key[256], ready_key[256];
    int abort_key_set;
    char *token; /* DDP_AUTH_TOKEN when the server started; NULL = no authentication */
    uint64_t requests, connections; /* served and accepted so far: ddp__store_server_stats */
};

static void ddp__srv_log(const ddp__store_server *s, ddp_log_level level, const char *fmt, ...) DDP__PRINTF(3, 4);
static void ddp__srv_log(const ddp__store_server *s, ddp_log_level level, const char *fmt, ...) {
    char msg[DDP__ERR_MAX];
    va_list ap;
    if (level > s->log_level || s->log_level == DDP_LOG_NONE) return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ddp__log(NULL, level, "store server on %s: %s", s->where, msg);
}

/* c needs a look at the end of this round (flush, re-arm, or free): at most once on the list. */
static void ddp__srv_touch(ddp__store_server *s, ddp__store_conn *c) {
    if (c->touched) return;
    c->touched = 1;
    s->touched[s->ntouched++] = c;
}

/* Stop serving c (it is closed at the end of the loop round); level WARN for clients that broke a limit or
   the protocol, DEBUG for ordinary disconnects. */
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...)
    DDP__PRINTF(4, 5);
static void ddp__srv_drop(ddp__store_server *s, ddp__store_conn *c, ddp_log_level level, const char *fmt, ...) {
    char why[DDP__ERR_MAX / 2];
    va_list ap;
    if (c->dead) return;
    c->dead = 1;
    ddp__srv_touch(s, c); /* freed at the end of the round */
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    ddp__srv_log(s, level, "disconnecting the client at %s: %s", c->peer, why);
}

static int ddp__srv_over_budget(const ddp__store_server *s, size_t more) {
    return s->kv.bytes + s->buffers + more > s->max_held;
}

/* The budget and what follows from it (see "Budget and shares" in store.c). */
static void ddp__srv_set_budget(ddp__store_server *s, size_t max_held) {
    s->max_held = max_held;
    s->share = max_held / 8;
    s->reserve = max_held / 8;
}

/* DDP_STORE_MAX_BYTES, or the default budget. */
static ddp_result ddp__srv_budget_setting(size_t *max_held, char *err) {
    long v = 0;
    int got = ddp__env_int("DDP_STORE_MAX_BYTES", (long)DDP__STORE_MIN_HELD, LONG_MAX, &v, err);
    if (got < 0) return DDP_ERR_INIT;
    *max_held = got ? (size_t)v : DDP__STORE_MAX_HELD;
    return DDP_SUCCESS;
}

/* Bytes as "3.5 MiB", "12 KiB" or "100 bytes", for messages. */
static const char *ddp__srv_bytes_text(size_t n, char *buf, size_t cap) {
    if (n >= ((size_t)1 << 20)) snprintf(buf, cap, "%.1f MiB", (double)n / (1 << 20));
    else if (n >= 1024) snprintf(buf, cap, "%.1f KiB", (double)n / 1024);
    else snprintf(buf, cap, "%zu bytes", n);
    return buf;
}

/* Grow one of c's buffers to at least need bytes within the budget; on failure c is dropped and -1 returned. */
static int ddp__srv_grow(ddp__store_server *s, ddp__store_conn *c, unsigned char **buf, size_t *cap, size_t need) {
    size_t want = DDP__MAX(need, *cap + *cap / 2);
    void *p;
    if (need <= *cap) return 0;
    if (ddp__srv_over_budget(s, want - *cap)) want = need;
    if (ddp__srv_over_budget(s, want - *cap)) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "the store would hold more than its budget of %zu bytes of data and "
                                          "buffers (DDP_STORE_MAX_BYTES sets it)", s->max_held);
        return -1;
    }
    p = DDP_REALLOC(*buf, want);
    if (!p) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "out of memory for a %zu-byte buffer", want);
        return -1;
    }
    s->buffers += want - *cap;
    *buf = (unsigned char *)p;
    *cap = want;
    return 0;
}

/* Give back a large buffer once it is empty, so an idle client holds little. */
static void ddp__srv_trim(ddp__store_server *s, unsigned char **buf, size_t *cap) {
    if (*cap <= 65536) return;
    DDP_FREE(*buf);
    *buf = NULL;
    s->buffers -= *cap;
    *cap = 0;
}

/* Append a reply of two parts (b may be empty) to c's output. */
static void ddp__srv_queue(ddp__store_server *s, ddp__store_conn *c, const void *a, size_t an, const void *b,
                           size_t bn) {
    if (c->dead) return;
    ddp__srv_touch(s, c); /* its reply goes out at the end of the round */
    if (c->out_off > 0) {
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
    }
    if (ddp__srv_grow(s, c, &c->out, &c->out_cap, c->out_len + an + bn) != 0) return;
    memcpy(c->out + c->out_len, a, an);
    if (bn) memcpy(c->out + c->out_len + an, b, bn);
    c->out_len += an + bn;
}

/* The announced request being handled was done: say so, once. */
static void ddp__srv_status_done(ddp__store_server *s, ddp__store_conn *c) {
    static const unsigned char done = DDP__STATUS_DONE;
    if (!c->status_due) return;
    c->status_due = 0;
    ddp__srv_queue(s, c, &done, 1, NULL, 0);
}

/* Queue a reply of two parts (b may be empty), after the status byte when the request was announced. */
static void ddp__srv_reply(ddp__store_server *s, ddp__store_conn *c, const void *a, size_t an, const void *b,
                           size_t bn) {
    ddp__srv_status_done(s, c);
    ddp__srv_queue(s, c, a, an, b, bn);
}

/* Refuse the request being handled (it must change nothing). A client that announced it hears why: status
   DDP__STATUS_REFUSED, code (int32) and the message, and stays connected; any other is disconnected, with
   the message in the log. Also when the status byte went out already (a reply came first): the stream
   could not stay in step. */
static void ddp__srv_refuse(ddp__store_server *s, ddp__store_conn *c, ddp_result code, const char *fmt, ...)
    DDP__PRINTF(4, 5);
static void ddp__srv_refuse(ddp__store_server *s, ddp__store_conn *c, ddp_result code, const char *fmt, ...) {
    char why[512];
    unsigned char head[13];
    int32_t code32 = (int32_t)code;
    uint64_t len;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    c->refused = 1;
    if (!c->status_due) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "refused: %s (it did not announce that it can take a refusal)", why);
        return;
    }
    c->status_due = 0;
    ddp__srv_log(s, DDP_LOG_INFO, "refused a request of the client at %s: %s", c->peer, why);
    len = strlen(why);
    head[0] = DDP__STATUS_REFUSED;
    memcpy(head + 1, &code32, 4);
    memcpy(head + 5, &len, 8);
    ddp__srv_queue(s, c, head, sizeof head, why, (size_t)len);
}

static void ddp__srv_reply_u64(ddp__store_server *s, ddp__store_conn *c, uint64_t v) {
    ddp__srv_reply(s, c, &v, 8, NULL, 0);
}

static void ddp__srv_reply_byte(ddp__store_server *s, ddp__store_conn *c, unsigned char v) {
    ddp__srv_reply(s, c, &v, 1, NULL, 0);
}

static void ddp__srv_clear_wait(ddp__store_server *s, ddp__store_conn *c) {
    s->buffers -= c->wait_bytes;
    ddp__free(c->waits);
    ddp__free(c->wait_blob);
    c->waits = NULL;
    c->wait_blob = NULL;
    c->nwaits = c->wait_bytes = 0;
}

/* key was just created: take it off every pending WAIT, and answer those that have nothing left to wait for. */
static void ddp__srv_wake(ddp__store_server *s, const void *key, size_t n, uint64_t h) {
    size_t i, j;
    for (i = 0; i < s->nconns; i++) {
        ddp__store_conn *c = s->conns[i];
        if (c->dead || !c->nwaits) continue;
        for (j = 0; j < c->nwaits; j++) {
            ddp__store_wait_key *w = &c->waits[j];
            if (w->hash != h || w->len != n || memcmp(c->wait_blob + w->off, key, n) != 0) continue;
            c->waits[j--] = c->waits[--c->nwaits];
        }
        if (c->nwaits) continue;
        ddp__srv_clear_wait(s, c);
        ddp__srv_reply_byte(s, c, DDP__WAIT_STOP_WAITING);
    }
}

/* Take entry e's charge off the connection that holds it. */
static void ddp__srv_uncharge(ddp__kv *e) {
    if (e && e->owner) ((ddp__store_conn *)e->owner)->held -= DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
    if (e) e->owner = NULL;
}

/* Charge entry e to c (after ddp__srv_uncharge, or when new). */
static void ddp__srv_charge(ddp__kv *e, ddp__store_conn *c) {
    e->owner = c;
    c->held += DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
}

/* May c make key's entry `after` bytes (the entry `old` is there now, or NULL)? Refused, with the numbers,
   when it would take c over its share or the store over its budget (without the reserve unless the entry
   is small), and it would hold more than before. Returns 0 when there is room, -1 when refused. */
static int ddp__srv_room(ddp__store_server *s, ddp__store_conn *c, const ddp__kv *old, size_t after,
                         const unsigned char *key, size_t klen) {
    size_t before = old ? DDP__KV_ENTRY_BYTES(old->key_len, old->value_len) : 0;
    size_t mine = c->held - (old && old->owner == c ? before : 0) + after;
    size_t total = s->kv.bytes + s->buffers, total_after = total - before + after;
    size_t limit = after <= DDP__STORE_SMALL_ENTRY ? s->max_held : s->max_held - s->reserve;
    char name[64], a[32], b[32], d[32], e[32];
    ddp__store_key_text(key, klen, name, sizeof name);
    ddp__srv_bytes_text(after, a, sizeof a);
    if (mine > s->share && mine > c->held) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "this client holds %s of keys and values; storing key '%s' (%s) "
                                                     "would take it over its share, %s, an eighth of the store's "
                                                     "budget of %s",
                        ddp__srv_bytes_text(c->held, b, sizeof b), name, a,
                        ddp__srv_bytes_text(s->share, d, sizeof d), ddp__srv_bytes_text(s->max_held, e, sizeof e));
        return -1;
    }
    if (total_after > limit && total_after > total) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the store holds %s of its budget of %s; storing key '%s' (%s) "
                                                     "would take it over%s",
                        ddp__srv_bytes_text(total, b, sizeof b), ddp__srv_bytes_text(s->max_held, d, sizeof d), name,
                        a, limit < s->max_held ? " the part not kept for small keys" : "");
        return -1;
    }
    return 0;
}

/* Store value under key for client c, within its share and the budget. Returns 0, or -1 when refused. */
static int ddp__srv_store(ddp__store_server *s, ddp__store_conn *c, const unsigned char *key, size_t klen,
                          const unsigned char *value, size_t vlen) {
    uint64_t h = ddp__store_hash(key, klen);
    ddp__kv *old = ddp__kv_find(&s->kv, key, klen, h);
    unsigned char *copy;
    int created;
    if (ddp__srv_room(s, c, old, DDP__KV_ENTRY_BYTES(klen, vlen), key, klen) != 0) return -1;
    copy = ddp__store_dup(value, vlen);
    if (!copy) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory storing %zu bytes", vlen);
        return -1;
    }
    ddp__srv_uncharge(old); /* replacing cannot fail, and creating leaves no old entry behind */
    created = ddp__kv_put(&s->kv, key, klen, h, copy, vlen);
    if (created < 0) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory storing %zu bytes", vlen);
        return -1;
    }
    ddp__srv_charge(ddp__kv_find(&s->kv, key, klen, h), c);
    if (created) ddp__srv_wake(s, key, klen, h);
    return 0;
}

/* ---- parsing: is a whole request there, and does it keep to the limits? ---- */

#define DDP__REQ_BAD (-1)
#define DDP__REQ_MORE 0
#define DDP__REQ_DONE 1

/* Step over a length-prefixed field of at most limit bytes. */
static int ddp__srv_field(ddp__rd *r, size_t limit, const char *what, size_t *size, char *why, size_t why_cap) {
    uint64_t len;
    if (r->n - r->at < 8) {
        *size = r->at + 8;
        return DDP__REQ_MORE;
    }
    memcpy(&len, r->p + r->at, 8);
    if (len > limit) {
        snprintf(why, why_cap, "it sent a %s of %llu bytes (the limit is %zu)", what, (unsigned long long)len, limit);
        return DDP__REQ_BAD;
    }
    if (r->n - r->at - 8 < len) {
        *size = r->at + 8 + (size_t)len;
        return DDP__REQ_MORE;
    }
    r->at += 8 + (size_t)len;
    return DDP__REQ_DONE;
}

/* A count of keys (WAIT, CHECK) followed by the keys. */
static int ddp__srv_keys(ddp__rd *r, size_t *size, char *why, size_t why_cap) {
    uint64_t n, i;
    int st;
    if (r->n - r->at < 8) {
        *size = r->at + 8;
        return DDP__REQ_MORE;
    }
    memcpy(&n, r->p + r->at, 8);
    if (n > DDP__STORE_MAX_WAIT_KEYS) {
        snprintf(why, why_cap, "it asked about %llu keys at once (the limit is %llu)", (unsigned long long)n,
                 (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
        return DDP__REQ_BAD;
    }
    r->at += 8;
    for (i = 0; i < n; i++)
        if ((st = ddp__srv_field(r, DDP__STORE_MAX_KEY, "key", size, why, why_cap)) != DDP__REQ_DONE) return st;
    return DDP__REQ_DONE;
}

/* How many bytes the request at p[0 .. n) takes. DDP__REQ_DONE: *size bytes, complete. DDP__REQ_MORE:
   incomplete, and *size is how many bytes it takes at least. DDP__REQ_BAD: why says what is wrong. */
static int ddp__srv_parse(int proto, const unsigned char *p, size_t n, size_t *size, char *why, size_t why_cap) {
    ddp__rd r;
    int st = DDP__REQ_DONE;
    uint64_t count, i;
    if (n < 1) {
        *size = 1;
        return DDP__REQ_MORE;
    }
    r.p = p;
    r.n = n;
    r.at = 1;
    switch (ddp__store_query_of(proto, p[0])) {
    case DDP__Q_VALIDATE:
    case DDP__Q_PING:
        if (n < 5) {
            *size = 5;
            return DDP__REQ_MORE;
        }
        r.at = 5;
        break;
    case DDP__Q_SET:
    case DDP__Q_APPEND:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        break;
    case DDP__Q_COMPARE_SET:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        break;
    case DDP__Q_GET:
    case DDP__Q_DELETE_KEY:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        break;
    case DDP__Q_ADD:
        st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
        if (st == DDP__REQ_DONE && r.n - r.at < 8) {
            *size = r.at + 8;
            return DDP__REQ_MORE;
        }
        r.at += 8;
        break;
    case DDP__Q_CHECK:
    case DDP__Q_WAIT:
    case DDP__Q_MULTI_GET:
        st = ddp__srv_keys(&r, size, why, why_cap);
        break;
    case DDP__Q_MULTI_SET:
        if (n < 9) {
            *size = 9;
            return DDP__REQ_MORE;
        }
        count = ddp__rd_u64(&r);
        if (count > DDP__STORE_MAX_WAIT_KEYS) {
            snprintf(why, why_cap, "it set %llu keys at once (the limit is %llu)", (unsigned long long)count,
                     (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
            return DDP__REQ_BAD;
        }
        for (i = 0; i < count && st == DDP__REQ_DONE; i++) {
            st = ddp__srv_field(&r, DDP__STORE_MAX_KEY, "key", size, why, why_cap);
            if (st == DDP__REQ_DONE) st = ddp__srv_field(&r, DDP__STORE_MAX_VALUE, "value", size, why, why_cap);
        }
        break;
    case DDP__Q_GETNUMKEYS:
    case DDP__Q_CANCEL_WAIT:
        break;
    case DDP__Q_WATCH_KEY:
        snprintf(why, why_cap, "it asked for watch_key (torch's experimental key callbacks), which ddp.h's store "
                               "does not serve");
        return DDP__REQ_BAD;
    default:
        if (proto == 2)
            snprintf(why, why_cap, "it sent torch 2.x's query type %u, which ddp.h's store does not serve (it serves "
                                   "0 VALIDATE to 13 PING, not QUEUE_* or LIST_KEYS)", p[0]);
        else
            snprintf(why, why_cap, "it sent the unknown query type 0x%02x (ddp.h's store speaks torch 1.13's TCPStore "
                                   "protocol, and torch 2.x's, whose first query is VALIDATE)", p[0]);
        return DDP__REQ_BAD;
    }
    if (st == DDP__REQ_DONE) *size = r.at;
    return st;
}

/* ---- handling a complete request ---- */

static int ddp__srv_have_all(const ddp__store_server *s, ddp__rd *r, uint64_t n) {
    int all = 1;
    uint64_t i;
    for (i = 0; i < n; i++) {
        size_t klen;
        const unsigned char *k = ddp__rd_str(r, &klen);
        if (all && !ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen))) all = 0;
    }
    return all;
}

/* WAIT: answer at once when every key exists, else remember the missing ones (replacing any earlier WAIT of
   this client: a client has one request in flight). */
static void ddp__srv_wait(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    uint64_t n = ddp__rd_u64(r), i;
    size_t first = r->at, blob = 0, bytes;
    ddp__srv_clear_wait(s, c);
    if (ddp__srv_have_all(s, r, n)) {
        ddp__srv_reply_byte(s, c, DDP__WAIT_STOP_WAITING);
        return;
    }
    bytes = (size_t)n * sizeof(ddp__store_wait_key) + (r->at - first);
    if (ddp__srv_over_budget(s, bytes)) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the store is at its budget of %zu bytes: no room to record a "
                                                     "WAIT", s->max_held);
        return;
    }
    c->waits = (ddp__store_wait_key *)ddp__malloc((size_t)n * sizeof(ddp__store_wait_key));
    c->wait_blob = (unsigned char *)ddp__malloc(r->at - first);
    if (!c->waits || !c->wait_blob) {
        ddp__srv_clear_wait(s, c);
        ddp__srv_drop(s, c, DDP_LOG_WARN, "out of memory recording its WAIT");
        return;
    }
    c->wait_bytes = bytes;
    s->buffers += bytes;
    r->at = first;
    for (i = 0; i < n; i++) {
        size_t klen;
        const unsigned char *k = ddp__rd_str(r, &klen);
        uint64_t h = ddp__store_hash(k, klen);
        if (ddp__kv_find(&s->kv, k, klen, h)) continue;
        memcpy(c->wait_blob + blob, k, klen);
        c->waits[c->nwaits].hash = h;
        c->waits[c->nwaits].off = blob;
        c->waits[c->nwaits].len = klen;
        c->nwaits++;
        blob += klen;
    }
}

/* GET (and each key of MULTI_GET): the value's length and bytes. A missing key drops the client, as torch's
   server does: its get always waits for the key first. `asked` says who asked, for the log. */
static void ddp__srv_reply_value(ddp__store_server *s, ddp__store_conn *c, const unsigned char *k, size_t klen,
                                 const char *asked) {
    char name[96];
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    uint64_t vlen;
    if (!kv) {
        ddp__srv_drop(s, c, DDP_LOG_WARN, "%s key '%s', which does not exist (a get must WAIT first)", asked,
                      ddp__store_key_text(k, klen, name, sizeof name));
        return;
    }
    vlen = kv->value_len;
    ddp__srv_reply(s, c, &vlen, 8, kv->value, kv->value_len);
}

/* COMPARE_SET with torch's semantics, including its answer for a missing key with a non-empty expected. */
static void ddp__srv_compare_set(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen, elen, dlen;
    const unsigned char *k = ddp__rd_str(r, &klen), *e = ddp__rd_str(r, &elen), *d = ddp__rd_str(r, &dlen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    uint64_t len;
    if (!kv && elen != 0) {
        len = elen;
        ddp__srv_reply(s, c, &len, 8, e, elen);
        return;
    }
    if ((!kv || (kv->value_len == elen && memcmp(kv->value, e, elen) == 0)) && ddp__srv_store(s, c, k, klen, d, dlen) != 0)
        return;
    kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    if (c->dead || !kv) return;
    len = kv->value_len;
    ddp__srv_reply(s, c, &len, 8, kv->value, kv->value_len);
}

/* ADD: the value is kept as decimal text, as torch keeps it. Refused (see "Refusals"): a value that is no
   number, and a sum that does not fit in int64 (torch's wraps around). */
static void ddp__srv_add(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen;
    const unsigned char *k = ddp__rd_str(r, &klen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    int64_t delta, old = 0, now;
    char text[32], name[64];
    int n;
    memcpy(&delta, r->p + r->at, 8);
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0) {
        ddp__srv_refuse(s, c, DDP_ERR_STATE, "key '%s' holds a value that is not an integer, so nothing can be added "
                                             "to it", ddp__store_key_text(k, klen, name, sizeof name));
        return;
    }
    if (ddp__store_add_int(old, delta, &now) != 0) {
        ddp__srv_refuse(s, c, DDP_ERR_INVALID_ARGUMENT, "key '%s' holds %lld; adding %lld would overflow int64 (the "
                                                        "store does not wrap around)",
                        ddp__store_key_text(k, klen, name, sizeof name), (long long)old, (long long)delta);
        return;
    }
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    if (ddp__srv_store(s, c, k, klen, (const unsigned char *)text, (size_t)n) != 0) return;
    ddp__srv_reply(s, c, &now, 8, NULL, 0);
}

/* APPEND (torch 2.x): add bytes at the end of a key's value, creating it when missing. */
static void ddp__srv_append(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    size_t klen, vlen;
    const unsigned char *k = ddp__rd_str(r, &klen), *v = ddp__rd_str(r, &vlen);
    ddp__kv *kv = ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen));
    unsigned char *joined;
    if (!kv) {
        ddp__srv_store(s, c, k, klen, v, vlen);
        return;
    }
    if (kv->value_len + vlen > DDP__STORE_MAX_VALUE) {
        ddp__srv_refuse(s, c, DDP_ERR_INVALID_ARGUMENT, "its APPEND would make a value longer than %zu MiB",
                        DDP__STORE_MAX_VALUE >> 20);
        return;
    }
    if (ddp__srv_room(s, c, kv, DDP__KV_ENTRY_BYTES(klen, kv->value_len + vlen), k, klen) != 0) return;
    if (!(joined = (unsigned char *)ddp__malloc(kv->value_len + vlen))) {
        ddp__srv_refuse(s, c, DDP_ERR_OUT_OF_MEMORY, "the server is out of memory appending %zu bytes", vlen);
        return;
    }
    if (kv->value_len) memcpy(joined, kv->value, kv->value_len);
    if (vlen) memcpy(joined + kv->value_len, v, vlen);
    ddp__srv_uncharge(kv);
    ddp__kv_put(&s->kv, k, klen, kv->hash, joined, kv->value_len + vlen); /* replaces: cannot fail */
    ddp__srv_charge(kv, c);
}

/* CHECK: DDP__STORE_ANNOUNCE alone announces the next request (see "Refusals"); no answer of its own. */
static void ddp__srv_check(ddp__store_server *s, ddp__store_conn *c, ddp__rd *r) {
    uint64_t n = ddp__rd_u64(r);
    size_t at = r->at, klen = 0;
    const unsigned char *k = n == 1 ? ddp__rd_str(r, &klen) : NULL;
    if (k && klen == DDP__STORE_ANNOUNCE_LEN && memcmp(k, DDP__STORE_ANNOUNCE, klen) == 0) {
        c->announced = 1;
        return;
    }
    r->at = at;
    ddp__srv_reply_byte(s, c, ddp__srv_have_all(s, r, n) ? DDP__CHECK_READY : DDP__CHECK_NOT_READY);
}

static void ddp__srv_handle(ddp__store_server *s, ddp__store_conn *c, const unsigned char *req, size_t size) {
    ddp__rd r;
    size_t klen, vlen;
    const unsigned char *k, *v;
    uint32_t magic;
    uint64_t n, i;
    r.p = req;
    r.n = size;
    r.at = 1;
    __atomic_store_n(&s->requests, s->requests + 1, __ATOMIC_RELAXED); /* only this thread writes it */
    c->status_due = c->announced;
    c->announced = 0;
    c->refused = 0;
    switch (ddp__store_query_of(c->proto, req[0])) {
    case DDP__Q_VALIDATE: /* torch 2.x: no reply; a wrong magic ends the client, as torch's server does */
        memcpy(&magic, req + 1, 4);
        if (magic != DDP__V2_MAGIC)
            ddp__srv_drop(s, c, DDP_LOG_WARN, "its VALIDATE carried 0x%08x, not torch's 0x%08x", magic, DDP__V2_MAGIC);
        break;
    case DDP__Q_PING: ddp__srv_reply(s, c, req + 1, 4, NULL, 0); break;
    case DDP__Q_APPEND: ddp__srv_append(s, c, &r); break;
    case DDP__Q_MULTI_SET:
        n = ddp__rd_u64(&r);
        for (i = 0; i < n && !c->dead && !c->refused; i++) { /* a refusal keeps the keys before it */
            k = ddp__rd_str(&r, &klen);
            v = ddp__rd_str(&r, &vlen);
            ddp__srv_store(s, c, k, klen, v, vlen);
        }
        break;
    case DDP__Q_MULTI_GET: /* every key must exist (torch's server also drops the client otherwise) */
        n = ddp__rd_u64(&r);
        for (i = 0; i < n && !c->dead; i++) {
            k = ddp__rd_str(&r, &klen);
            ddp__srv_reply_value(s, c, k, klen, "its MULTI_GET asked for");
        }
        break;
    case DDP__Q_CANCEL_WAIT: /* torch 2.x's client after a WAIT timed out: forget it, say so */
        ddp__srv_clear_wait(s, c);
        ddp__srv_reply_byte(s, c, DDP__WAIT_CANCELED);
        break;
    case DDP__Q_SET:
        k = ddp__rd_str(&r, &klen);
        v = ddp__rd_str(&r, &vlen);
        ddp__srv_store(s, c, k, klen, v, vlen);
        break;
    case DDP__Q_COMPARE_SET: ddp__srv_compare_set(s, c, &r); break;
    case DDP__Q_ADD: ddp__srv_add(s, c, &r); break;
    case DDP__Q_GET:
        k = ddp__rd_str(&r, &klen);
        ddp__srv_reply_value(s, c, k, klen, "it asked for");
        break;
    case DDP__Q_CHECK: ddp__srv_check(s, c, &r); break;
    case DDP__Q_WAIT: ddp__srv_wait(s, c, &r); break;
    case DDP__Q_GETNUMKEYS: ddp__srv_reply_u64(s, c, (uint64_t)s->kv.count); break;
    case DDP__Q_DELETE_KEY:
        k = ddp__rd_str(&r, &klen);
        ddp__srv_uncharge(ddp__kv_find(&s->kv, k, klen, ddp__store_hash(k, klen)));
        ddp__srv_reply_u64(s, c, (uint64_t)ddp__kv_remove(&s->kv, k, klen, ddp__store_hash(k, klen)));
        break;
    }
    ddp__srv_status_done(s, c); /* an announced request without an answer (SET), or one that waits (WAIT) */
}

/* With DDP_AUTH_TOKEN: the handshake of src/auth.c, before any request. Returns the input bytes it
   used (0 while they are incomplete; c->need says how many it waits for); drops a client that fails. */
static size_t ddp__srv_authenticate(ddp__store_server *s, ddp__store_conn *c) {
    unsigned char reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], verdict;
    if (c->auth == 1) {
        if (memcmp(c->in, DDP__AUTH_MAGIC, DDP__MIN(c->in_len, (size_t)8)) != 0) {
            /* Not the handshake (a process without the token, which starts with a query): say so at once, so
               that the client can name the cause instead of waiting for an answer (best effort: non-blocking). */
            ssize_t said = send(c->fd, DDP__AUTH_REQUIRED, 8, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)said;
            ddp__srv_drop(s, c, DDP_LOG_WARN, "it did not authenticate: this store requires DDP_AUTH_TOKEN (set the same "
                                              "token on every rank)");
            return 0;
        }
        if (c->in_len < 8 + DDP__AUTH_NONCE) return c->need = 8 + DDP__AUTH_NONCE, 0;
        if (ddp__auth_answer(s->token, c->in, c->auth_cn, c->auth_sn, reply) != 0) {
            ddp__srv_drop(s, c, DDP_LOG_WARN, "it did not authenticate: this store requires DDP_AUTH_TOKEN (set the same "
                                              "token on every rank)");
            return 0;
        }
        ddp__srv_reply(s, c, reply, sizeof reply, NULL, 0);
        c->auth = 2;
        return 8 + DDP__AUTH_NONCE;
    }
    if (c->in_len < DDP__AUTH_MAC) return c->need = DDP__AUTH_MAC, 0;
    verdict = (unsigned char)ddp__auth_check(s->token, c->auth_cn, c->auth_sn, c->in);
    if (!verdict) { /* say so before hanging up (best effort: the socket is non-blocking) */
        if (send(c->fd, &verdict, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) verdict = 0;
        ddp__srv_drop(s, c, DDP_LOG_WARN, "its DDP_AUTH_TOKEN is different from this store's");
        return 0;
    }
    ddp__srv_reply(s, c, &verdict, 1, NULL, 0);
    c->auth = 0;
    return DDP__AUTH_MAC;
}

/* Handle every complete request in c's input, while its replies do not pile up. */
static void ddp__srv_process(ddp__store_server *s, ddp__store_conn *c) {
    size_t pos = 0, size = 0;
    char why[256];
    c->ready = 0;
    while (c->auth && !c->dead) {
        size_t used = ddp__srv_authenticate(s, c);
        if (!used) return;
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        c->need = 0;
    }
    while (!c->dead && pos < c->in_len) {
        int st;
        if (c->out_len - c->out_off >= DDP__STORE_OUT_HIGH) {
            c->ready = 1;
            break;
        }
        if (!c->proto) { /* its first query says which protocol it speaks */
            static const uint32_t magic = DDP__V2_MAGIC;
            if (c->in[pos] == DDP__V2_VALIDATE && c->in_len - pos < 5) {
                c->need = 5;
                break;
            }
            /* a 1.13 SET (also byte 0) cannot start so: its key would be longer than 1 GB */
            c->proto = c->in[pos] == DDP__V2_VALIDATE && memcmp(c->in + pos + 1, &magic, 4) == 0 ? 2 : 1;
            ddp__srv_log(s, DDP_LOG_DEBUG, "client %s speaks torch %s's protocol", c->peer, c->proto == 2 ? "2.x" : "1.13");
        }
        st = ddp__srv_parse(c->proto, c->in + pos, c->in_len - pos, &size, why, sizeof why);
        if (st == DDP__REQ_BAD) {
            ddp__srv_drop(s, c, DDP_LOG_WARN, "%s", why);
            return;
        }
        if (st == DDP__REQ_MORE) {
            c->need = size;
            break;
        }
        ddp__srv_handle(s, c, c->in + pos, size);
        pos += size;
        c->need = 0;
    }
    if (c->dead || pos == 0) return;
    memmove(c->in, c->in + pos, c->in_len - pos);
    c->in_len -= pos;
    if (c->in_len == 0) ddp__srv_trim(s, &c->in, &c->in_cap);
}

/* Read what c sent, at most a few MiB per round so that one busy client does not starve the others. The
   buffer grows with what actually arrives (at most doubling), not with the lengths a request announces:
   a client that only announces large values holds little. */
static void ddp__srv_read(ddp__store_server *s, ddp__store_conn *c) {
    size_t total = 0;
    while (!c->dead && total < ((size_t)4 << 20)) {
        size_t missing = c->need > c->in_len ? c->need - c->in_len : 0;
        size_t room = DDP__MAX(DDP__MIN(missing, DDP__MAX(c->in_len, (size_t)65536)), (size_t)4096);
        ssize_t k;
        if (c->in_cap - c->in_len < room && ddp__srv_grow(s, c, &c->in, &c->in_cap, c->in_len + room) != 0) return;
        k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
        if (k > 0) {
            c->in_len += (size_t)k;
            total += (size_t)k;
            continue;
        }
        if (k == 0) { /* requests that came before the close still count (a SET needs no answer) */
            c->closed = 1;
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            ddp__srv_drop(s, c, DDP_LOG_DEBUG, "the connection failed (%s)", strerror(errno));
        return;
    }
}

static void ddp__srv_flush(ddp__store_server *s, ddp__store_conn *c) {
    while (!c->dead && c->out_off < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (k > 0) {
            c->out_off += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        ddp__srv_drop(s, c, DDP_LOG_DEBUG, "the connection failed while sending a reply (%s)", strerror(errno));
        return;
    }
    c->out_off = c->out_len = 0;
    ddp__srv_trim(s, &c->out, &c->out_cap);
}

/* c is going: its entries stay (as torch keeps a client's keys), charged to no one. */
static void ddp__srv_orphan(ddp__store_server *s, ddp__store_conn *c) {
    size_t i;
    ddp__kv *e;
    for (i = 0; c->held && i < s->kv.nslots; i++)
        for (e = s->kv.slots[i]; e; e = e->next)
            if (e->owner == c) ddp__srv_uncharge(e);
}

static void ddp__srv_free_conn(ddp__store_server *s, ddp__store_conn *c) {
    ddp__srv_orphan(s, c);
    ddp__srv_clear_wait(s, c);
    s->buffers -= c->in_cap + c->out_cap + sizeof *c;
    DDP_FREE(c->in);
    DDP_FREE(c->out);
    close(c->fd);
    ddp__free(c);
}

/* Register fd in the server's epoll set, waiting for events, with ptr as its tag. */
static int ddp__srv_arm(ddp__store_server *s, int op, int fd, unsigned events, void *ptr) {
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = events;
    ev.data.ptr = ptr;
    return epoll_ctl(s->epfd, op, fd, &ev);
}

static int ddp__srv_piled(const ddp__store_conn *c) { return c->out_len - c->out_off >= DDP__STORE_OUT_HIGH; }

/* Wait for input unless replies piled up, for room to send while replies wait. */
static void ddp__srv_rearm(ddp__store_server *s, ddp__store_conn *c) {
    unsigned want = (ddp__srv_piled(c) ? 0u : (unsigned)EPOLLIN) | (c->out_off < c->out_len ? (unsigned)EPOLLOUT : 0u);
    if (want == c->events) return;
    if (ddp__srv_arm(s, EPOLL_CTL_MOD, c->fd, want, c) != 0)
        ddp__srv_drop(s, c, DDP_LOG_WARN, "epoll_ctl failed (%s)", strerror(errno));
    else
        c->events = want;
}

static void ddp__srv_remove(ddp__store_server *s, ddp__store_conn *c) {
    size_t slot = c->slot;
    s->conns[slot] = s->conns[--s->nconns];
    s->conns[slot]->slot = slot;
    ddp__srv_free_conn(s, c); /* closing the socket takes it out of the epoll set */
}

/* Make room for one more client in conns and touched. */
static int ddp__srv_room_for_client(ddp__store_server *s) {
    size_t cap = s->cap_conns ? s->cap_conns * 2 : 16;
    ddp__store_conn **p, **t;
    if (s->nconns < s->cap_conns) return 0;
    if (!(p = (ddp__store_conn **)DDP_REALLOC(s->conns, cap * sizeof *p))) return -1;
    s->conns = p;
    if (!(t = (ddp__store_conn **)DDP_REALLOC(s->touched, cap * sizeof *t))) return -1;
    s->touched = t;
    s->cap_conns = cap;
    return 0;
}

/* The server cannot accept a client for lack of descriptors. During a rendezvous that client is a rank,
   which would wait in the listen backlog until its timeout while the others wait for it: the server
   publishes the rendezvous abort itself, as ddp_init's ddp__rdzv_abort would (group.c): "code|message",
   naming rank 0, under the abort key (unless one is there), as the table's value behind
   DDP__RDZV_ABORTED (unless the table is there: a compare-set against an absent key), and then the
   ready key, which wakes every rank waiting for the table. The ranks it serves read it and leave, which
   frees descriptors for the rest. */
static void ddp__srv_put_absent(ddp__store_server *s, const char *key, const char *value) {
    size_t klen = strlen(key), vlen = strlen(value);
    uint64_t h = ddp__store_hash(key, klen);
    unsigned char *copy;
    if (ddp__kv_find(&s->kv, key, klen, h) || !(copy = ddp__store_dup(value, vlen))) return;
    if (ddp__kv_put(&s->kv, key, klen, h, copy, vlen) > 0) ddp__srv_wake(s, key, klen, h);
}

static void ddp__srv_publish_abort(ddp__store_server *s, const char *what, const char *why) {
    char host[128], value[DDP__ERR_MAX + 16], marker[DDP__ERR_MAX + 32];
    if (!__atomic_load_n(&s->abort_key_set, __ATOMIC_ACQUIRE)) return;
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(value, sizeof value, "%d|rank 0 (host %.64s, pid %d), serving the store on %.96s, %s: %.700s",
             (int)DDP_ERR_SYSTEM, host, (int)getpid(), s->where, what, why);
    snprintf(marker, sizeof marker, "%s%s", DDP__RDZV_ABORTED, value);
    ddp__srv_put_absent(s, s->abort_key, value);
    ddp__srv_put_absent(s, s->table_key, marker);
    ddp__srv_put_absent(s, s->ready_key, "1");
}

/* The rendezvous keys of the group that ddp_init is connecting; NULL once it is connected. */
static void ddp__store_server_abort_key(ddp__store_server *s, const char *abort_key, const char *table_key,
                                        const char *ready_key) {
    if (!s) return;
    __atomic_store_n(&s->abort_key_set, 0, __ATOMIC_RELEASE);
    if (!abort_key || !table_key || !ready_key) return;
    snprintf(s->abort_key, sizeof s->abort_key, "%s", abort_key);
    snprintf(s->table_key, sizeof s->table_key, "%s", table_key);
    snprintf(s->ready_key, sizeof s->ready_key, "%s", ready_key);
    __atomic_store_n(&s->abort_key_set, 1, __ATOMIC_RELEASE);
}

/* Accept one client. 0: accepted (or refused, logged), -1: nothing more to accept now. */
static int ddp__srv_accept(ddp__store_server *s) {
    char host[64] = "?", serv[16] = "?";
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    ddp__store_conn *c;
    int fd = accept(s->listen_fd, NULL, NULL); /* the listening socket does not block (net.c) */
    if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED))
        return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : 0; /* none waiting, or one that gave up */
    if (fd < 0) { /* out of file descriptors, most likely: let some close first */
        char err[DDP__ERR_MAX];
        int e = errno, no_fds = ddp__out_of_descriptors(e);
        if (no_fds) ddp__fail_descriptors(err, e, "cannot accept a connection");
        else snprintf(err, sizeof err, "accept: %s", strerror(e));
        if (!s->out_of_fds || !no_fds) /* said once per episode */
            ddp__srv_log(s, DDP_LOG_WARN, "cannot accept a client (%s); not accepting for 0.1 s", err);
        if (no_fds) {
            s->out_of_fds = 1;
            ddp__srv_publish_abort(s, "cannot accept every rank's connection", err);
        }
        s->accept_paused_until = ddp__now() + 0.1;
        epoll_ctl(s->epfd, EPOLL_CTL_DEL, s->listen_fd, NULL);
        return -1;
    }
    s->out_of_fds = 0;
    if (ddp__srv_room_for_client(s) != 0) {
        close(fd);
        return 0;
    }
    if (ddp__srv_over_budget(s, sizeof *c) || !(c = (ddp__store_conn *)ddp__calloc(1, sizeof *c))) {
        ddp__srv_log(s, DDP_LOG_WARN, "refusing a client: the store is at its memory budget");
        close(fd);
        return 0;
    }
    ddp__net_configure(fd);
    c->fd = fd;
    c->auth = s->token ? 1 : 0;
    c->events = EPOLLIN;
    if (ddp__srv_arm(s, EPOLL_CTL_ADD, fd, EPOLLIN, c) != 0) {
        ddp__srv_log(s, DDP_LOG_WARN, "refusing a client: epoll_ctl failed (%s)", strerror(errno));
        close(fd);
        ddp__free(c);
        return 0;
    }
    if (getpeername(fd, (struct sockaddr *)&ss, &len) == 0)
        getnameinfo((struct sockaddr *)&ss, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->peer, sizeof c->peer, "%s:%s", host, serv);
    s->buffers += sizeof *c;
    c->slot = s->nconns;
    s->conns[s->nconns++] = c;
    __atomic_store_n(&s->connections, s->connections + 1, __ATOMIC_RELAXED);
    ddp__srv_log(s, DDP_LOG_DEBUG, "client %s connected", c->peer);
    return 0;
}

/* What epoll said of client c (0: nothing, for a client with requests left over from an earlier round). */
static void ddp__srv_serve(ddp__store_server *s, ddp__store_conn *c, unsigned events) {
    ddp__srv_touch(s, c);
    if (events & EPOLLOUT) ddp__srv_flush(s, c);
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ddp__srv_read(s, c);
    if (!c->dead) ddp__srv_process(s, c);
    if (!c->dead && c->closed) {
        ddp__srv_flush(s, c); /* a half-closed client may still read its answers */
        ddp__srv_drop(s, c, DDP_LOG_DEBUG, "it closed the connection");
    }
}

/* The end of a round: flush, re-arm or free each client touched. Those that still have requests to handle
   (left while their replies piled up, and the replies have drained) stay on the list for the next round.
   Returns how many stayed. */
static size_t ddp__srv_round_end(ddp__store_server *s) {
    size_t i, keep = 0;
    for (i = 0; i < s->ntouched; i++) {
        ddp__store_conn *c = s->touched[i];
        if (!c->dead && c->out_off < c->out_len) ddp__srv_flush(s, c);
        if (!c->dead) ddp__srv_rearm(s, c);
        if (c->dead) {
            ddp__srv_remove(s, c);
        } else if (c->ready && !ddp__srv_piled(c)) {
            s->touched[keep++] = c;
        } else {
            c->touched = 0;
        }
    }
    s->ntouched = keep;
    return keep;
}

#define DDP__SRV_EVENTS 256  /* events taken per epoll_wait */
#define DDP__SRV_ACCEPTS 64  /* clients accepted per round at most */
static void *ddp__srv_main(void *arg) {
    ddp__store_server *s = (ddp__store_server *)arg;
    struct epoll_event ev[DDP__SRV_EVENTS];
    size_t i, left = 0;
    for (;;) {
        int timeout = left ? 0 : -1, n, k, stop = 0, accept_due = 0;
        if (s->accept_paused_until > 0 && ddp__now() >= s->accept_paused_until) {
            s->accept_paused_until = 0;
            ddp__srv_arm(s, EPOLL_CTL_ADD, s->listen_fd, EPOLLIN, &s->listen_fd);
        }
        if (s->accept_paused_until > 0 && !left) timeout = 100;
        n = epoll_wait(s->epfd, ev, DDP__SRV_EVENTS, timeout);
        if (n < 0 && errno != EINTR) {
            ddp__srv_log(s, DDP_LOG_ERROR, "epoll_wait failed (%s); the store stops", strerror(errno));
            break;
        }
        for (i = 0; i < left; i++) /* requests left over from the last round */
            if (!s->touched[i]->dead) ddp__srv_serve(s, s->touched[i], 0);
        for (k = 0; k < n; k++) {
            if (ev[k].data.ptr == (void *)&s->pipe_rd) { /* tagged by their fields' addresses */
                char drain[16];
                while (read(s->pipe_rd, drain, sizeof drain) > 0) {
                }
                stop = __atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE);
                if (__atomic_exchange_n(&s->failure_due, 0, __ATOMIC_ACQ_REL))
                    ddp__srv_publish_abort(s, "cannot connect to it", s->failure);
            } else if (ev[k].data.ptr == (void *)&s->listen_fd) {
                accept_due = 1;
            } else {
                ddp__srv_serve(s, (ddp__store_conn *)ev[k].data.ptr, ev[k].events);
            }
        }
        if (stop) break;
        for (k = 0; accept_due && k < DDP__SRV_ACCEPTS && ddp__srv_accept(s) == 0; k++) {
        }
        left = ddp__srv_round_end(s);
    }
    for (i = 0; i < s->nconns; i++) /* replies already due still go out, as far as the sockets take them */
        if (!s->conns[i]->dead) ddp__srv_flush(s, s->conns[i]);
    {
        struct timespec cpu = {0, 0};
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
        ddp__srv_log(s, DDP_LOG_DEBUG, "stopping: served %llu requests from %llu connections in %.3f s of CPU",
                     (unsigned long long)s->requests, (unsigned long long)s->connections,
                     (double)cpu.tv_sec + (double)cpu.tv_nsec * 1e-9);
    }
    return NULL;
}

static void ddp__store_server_close(ddp__store_server *s) {
    size_t i;
    /* The listener first: a client that sees its connection close below and dials again at once (a rank
       going from ddp_destroy to its next ddp_init) is refused, and retries until the next server listens,
       rather than reaching this one's listen queue and being reset when it closes. */
    if (s->listen_fd >= 0) close(s->listen_fd);
    s->listen_fd = -1;
    for (i = 0; i < s->nconns; i++) ddp__srv_free_conn(s, s->conns[i]);
    DDP_FREE(s->conns);
    DDP_FREE(s->touched);
    if (s->epfd >= 0) close(s->epfd);
    ddp__kv_clear(&s->kv);
    ddp__free(s->token);
    if (s->pipe_rd >= 0) close(s->pipe_rd);
    if (s->pipe_wr >= 0) close(s->pipe_wr);
    ddp__free(s);
}

static ddp_result ddp__store_server_start(const char *host, int port, ddp_log_level lvl, ddp__store_server **out,
                                          char *err) {
    ddp__store_server *s = (ddp__store_server *)ddp__calloc(1, sizeof *s);
    char why[DDP__ERR_MAX];
    int fds[2], rc;
    ddp_result r;
    *out = NULL;
    if (!s) return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory starting the store server");
    s->listen_fd = s->pipe_rd = s->pipe_wr = s->epfd = -1;
    s->log_level = lvl == DDP_LOG_DEFAULT ? ddp__env_log_level() : lvl;
    if ((r = ddp__srv_budget_setting(&s->max_held, err)) != DDP_SUCCESS) {
        ddp__store_server_close(s);
        return r;
    }
    ddp__srv_set_budget(s, s->max_held);
    if (ddp__auth_token() && !(s->token = ddp__strdup(ddp__auth_token()))) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory starting the store server");
    }
    r = ddp__net_listen(host, port, &s->listen_fd, &s->port, why);
    if (r != DDP_SUCCESS) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, r, "cannot start the rendezvous store server: %s", why);
    }
    snprintf(s->where, sizeof s->where, "%.80s:%d", host ? host : "*", s->port);
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server: pipe: %s", strerror(errno));
    }
    s->pipe_rd = fds[0];
    s->pipe_wr = fds[1];
    if ((s->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 || ddp__srv_arm(s, EPOLL_CTL_ADD, s->pipe_rd, EPOLLIN, &s->pipe_rd) != 0 ||
        ddp__srv_arm(s, EPOLL_CTL_ADD, s->listen_fd, EPOLLIN, &s->listen_fd) != 0) {
        snprintf(why, sizeof why, "%s", strerror(errno));
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server: epoll: %s", why);
    }
    rc = pthread_create(&s->thread, NULL, ddp__srv_main, s);
    if (rc != 0) {
        ddp__store_server_close(s);
        return ddp__fail_to(err, DDP_ERR_SYSTEM, "cannot start the store server thread: %s", strerror(rc));
    }
    ddp__srv_log(s, DDP_LOG_INFO, "serving");
    *out = s;
    return DDP_SUCCESS;
}

static int ddp__store_server_port(const ddp__store_server *s) { return s->port; }

/* What the server has done so far, read from another thread while it runs (bench/bench_scale.c): the
   requests it handled, the connections it accepted, and its thread's CPU time (-1 when unreadable). */
static void ddp__store_server_stats(const ddp__store_server *s, ddp__server_stats *out) {
    struct timespec cpu;
    clockid_t clock;
    out->requests = __atomic_load_n(&s->requests, __ATOMIC_RELAXED);
    out->connections = __atomic_load_n(&s->connections, __ATOMIC_RELAXED);
    out->cpu_seconds = -1;
    if (pthread_getcpuclockid(s->thread, &clock) == 0 && clock_gettime(clock, &cpu) == 0)
        out->cpu_seconds = (double)cpu.tv_sec + (double)cpu.tv_nsec * 1e-9;
}

static void ddp__srv_wake_thread(ddp__store_server *s) {
    char b = 1;
    while (write(s->pipe_wr, &b, 1) < 0 && errno == EINTR) {
    }
}

static void ddp__store_server_publish_failure(ddp__store_server *s, const char *why) {
    if (!s || __atomic_exchange_n(&s->failure_given, 1, __ATOMIC_ACQ_REL)) return; /* once: the thread reads it unlocked */
    snprintf(s->failure, sizeof s->failure, "%s", why);
    __atomic_store_n(&s->failure_due, 1, __ATOMIC_RELEASE);
    ddp__srv_wake_thread(s);
}

static void ddp__store_server_stop(ddp__store_server *s) {
    if (!s) return;
    __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
    ddp__srv_wake_thread(s);
    pthread_join(s->thread, NULL);
    ddp__store_server_close(s);
}
