/* [SECTION] store: rendezvous key-value store (c10d TCPStore protocols of torch 1.13 and 2.x), file store
   Mirrors torch.distributed.TCPStore (torch/csrc/distributed/c10d/TCPStore.cpp, torch 1.13; torch 2.x's
   TCPStoreBackend.cpp and TCPStoreLibUvBackend.cpp) and torch.distributed.FileStore. torch 2.x's protocol
   is the one below with VALIDATE (00 + uint32 0x3C85F7CE, no reply) first on every connection, the query
   numbers moved (see DDP__V2_* and ddp__store_wire_type) and APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT and
   PING added; its replies are the same. The server tells the two apart by each connection's first query;
   the client finds out which one the server speaks on connecting (ddp__tcp_detect). Every group rendezvouses through one store: rank 0 serves it on a background
   thread, every rank (rank 0 too) is a client of it.

   Wire protocol (torch 1.13; no handshake; integers native-endian; a "string" is a uint64 length + bytes):
       SET         00 | key | value                      -> (no reply)
       COMPARE_SET 01 | key | expected | desired         -> value the key holds afterwards (string)
       GET         02 | key                              -> value (string); the key must exist
       ADD         03 | key | int64 delta                -> int64 new value (stored as decimal text)
       CHECK       04 | uint64 n | n keys                -> 1 byte: 0 all exist, 1 not all
       WAIT        05 | uint64 n | n keys                -> 1 byte 0 (STOP_WAITING) once all exist
       GETNUMKEYS  06                                    -> int64
       DELETE_KEY  08 | key                              -> int64 keys deleted (0 or 1)
   (07 is WATCH_KEY, torch's experimental callbacks: not supported, the client is disconnected.)
   A client's get is WAIT then GET, as torch's is. torch's client puts "/" before every key, and the 1.13
   client sends ADD("init/", 1) right after connecting when given a world size; it also opens a second,
   idle connection for watch_key callbacks.

   Server: one thread, an epoll set (Linux, as the rest of ddp.h) of the listening socket (backlog SOMAXCONN,
   net.c), a self-pipe (stop) and every client, so a round costs what the ready clients cost, not the number
   connected (thousands of ranks at a rendezvous). Each round handles the clients with events, then flushes
   and re-arms (EPOLLIN unless replies piled up, EPOLLOUT while replies wait) only the clients it touched:
   those with events and those a reply was queued for (a WAIT woken by another client's SET). Each client has
   an input buffer (requests are parsed once complete, so a slow or hostile client never blocks the others),
   an output buffer (sent as the socket drains) and at most one pending WAIT: the keys still missing. A SET,
   ADD or COMPARE_SET that creates a key removes it from every pending WAIT (torch's server forgets
   COMPARE_SET here), and a WAIT left with no missing key gets its STOP_WAITING byte. A new WAIT from a
   client replaces its pending one (torch's server would keep both and later send a stray byte). Everything a client can make the server allocate is bounded (key length,
   value length, keys per WAIT/CHECK, and one budget for stored data plus buffers); a client that breaks a
   limit or the protocol is disconnected and logged, and the server goes on serving the others.

   Budget and shares (ddp__srv_room): the budget B (1 GiB; DDP_STORE_MAX_BYTES) bounds stored keys and values
   plus every buffer. Each stored entry (key, value and its bookkeeping) is charged to the connection that
   last wrote it (SET, ADD, COMPARE_SET, APPEND, MULTI_SET; an overwrite by another connection moves the
   charge, DELETE takes it off). A write is refused when it would take its connection over its share, B/8,
   or the store over B - B/8; the last eighth is kept for small entries (up to 64 KiB: rendezvous addresses,
   counters), so ranks can still meet when big values filled the rest. A write that does not make its
   connection or the store hold more is never refused. Keys outlive their writer, as in torch: when a
   connection closes, its entries stay and count against the budget, charged to no one. A client that
   reconnects gets a fresh share; the budget still bounds the total.

   Refusals (ddp.h's own extension; torch's protocol has no error answer): a client that can take a refusal
   says so before a request by sending CHECK of the single key DDP__STORE_ANNOUNCE ("\0ddp.h/status": no
   C-string key can equal it). ddp.h's server then answers that request with a status byte first, in place
   of the CHECK's answer: DDP__STATUS_DONE (0) and the request's usual answer, or DDP__STATUS_REFUSED (2), an
   int32 ddp_result, a string saying why, and nothing else (the refused write changed nothing, though a
   MULTI_SET keeps the keys before it; the connection stays in step). A torch server answers the CHECK itself (0 or 1) and then the request, so the client reads one
   byte either way. A client that did not announce (torch's) has no way to hear a refusal: it is
   disconnected instead, with the reason in the server's log, which it sees as a closed connection.
   Refused: a write over a share or the budget ("full", DDP_ERR_OUT_OF_MEMORY), an ADD to a value that is
   no integer (DDP_ERR_STATE) or whose sum does not fit in int64 (DDP_ERR_INVALID_ARGUMENT; torch's
   std::stoll + int64 addition overflows, in practice wrapping around: ddp.h never wraps).

   Client: blocking calls on one connection, each bounded by the store's timeout. SET, ADD and COMPARE_SET
   are announced (see "Refusals"), so a set waits for its status byte: one round trip (~30 us on one host;
   torch's set does not wait), and a refused write fails the call that made it. A call that fails midway
   (timeout, lost connection) leaves the stream in an unknown state, so the connection is closed and the next
   call connects again.

   File store (init_method "file:///path"): an append-only log of SET/DELETE records in one file on a shared
   filesystem, read and written under flock(). Each handle replays the records it has not seen yet into a
   hash table; get and wait poll the file with backoff until the deadline; add reads and appends under the
   exclusive lock, so it is atomic. Each opener adds 1 to a reference key and takes 1 off when it closes:
   the one that brings it to 0 deletes the file, as FileStore does, so every user must open it before any
   closes it (a rendezvous guarantees that). A file left by a crashed run still holds that run's keys: use a
   fresh path for each run, as with FileStore. The format is ddp.h's own. */
#include "internal.h"
#include <sys/epoll.h>

#define DDP__STORE_MAX_KEY ((size_t)4096)           /* bytes in one key, prefix included */
#define DDP__STORE_MAX_VALUE ((size_t)64 << 20)     /* bytes in one value */
#define DDP__STORE_MAX_WAIT_KEYS ((uint64_t)16384)  /* keys in one WAIT or CHECK */
#define DDP__STORE_MAX_HELD ((size_t)1 << 30)       /* server: stored keys and values plus every buffer */
#define DDP__STORE_MIN_HELD ((size_t)1 << 20)       /* the least DDP_STORE_MAX_BYTES may set */
#define DDP__STORE_SMALL_ENTRY ((size_t)64 << 10)   /* entries that may use the budget's reserved last eighth */
#define DDP__STORE_ANNOUNCE "\0ddp.h/status"        /* CHECK of this key alone: answer my next request's status */
#define DDP__STORE_ANNOUNCE_LEN ((size_t)13)
#define DDP__STATUS_DONE 0
#define DDP__STATUS_REFUSED 2
#define DDP__STORE_OUT_HIGH ((size_t)1 << 20)       /* server: replies piled up for a client that does not read */
#define DDP__STORE_FILE_REFS "ddp/file_store_users" /* file store: how many handles have it open */
#define DDP__STORE_FILE_MAGIC "DDPFS001"            /* file store: the first 8 bytes of the file */

/* torch 1.13's c10d::QueryType, CheckResponseType and WaitResponseType. */
#define DDP__Q_SET 0
#define DDP__Q_COMPARE_SET 1
#define DDP__Q_GET 2
#define DDP__Q_ADD 3
#define DDP__Q_CHECK 4
#define DDP__Q_WAIT 5
#define DDP__Q_GETNUMKEYS 6
#define DDP__Q_WATCH_KEY 7
#define DDP__Q_DELETE_KEY 8
#define DDP__CHECK_READY 0
#define DDP__CHECK_NOT_READY 1
#define DDP__WAIT_STOP_WAITING 0
#define DDP__WAIT_CANCELED 1
/* Queries only torch 2.x's protocol has, by the numbers this file uses inside (never on the wire as these). */
#define DDP__Q_VALIDATE 0x40
#define DDP__Q_APPEND 0x41
#define DDP__Q_MULTI_GET 0x42
#define DDP__Q_MULTI_SET 0x43
#define DDP__Q_CANCEL_WAIT 0x44
#define DDP__Q_PING 0x45
#define DDP__Q_UNKNOWN 0xff
/* torch 2.x (c10d::detail::QueryType in TCPStoreBackend.hpp): VALIDATE 0, SET 1, COMPARE_SET 2, GET 3, ADD 4,
   CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13,
   then QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS (not served here). Every connection's first query is
   VALIDATE with this magic (a uint32); VALIDATE has no reply. */
#define DDP__V2_MAGIC 0x3C85F7CEu
#define DDP__V2_VALIDATE 0
#define DDP__V2_PING 13

/* The wire byte of query q (1.13 numbering above) in protocol proto (1: torch 1.13, 2: torch 2.x). */
static unsigned char ddp__store_wire_type(int proto, int q) {
    if (proto != 2) return (unsigned char)q;
    switch (q) {
    case DDP__Q_DELETE_KEY: return 8;
    case DDP__Q_APPEND: return 9;
    case DDP__Q_MULTI_GET: return 10;
    case DDP__Q_MULTI_SET: return 11;
    case DDP__Q_CANCEL_WAIT: return 12;
    case DDP__Q_PING: return DDP__V2_PING;
    case DDP__Q_VALIDATE: return DDP__V2_VALIDATE;
    default: return (unsigned char)(q + 1); /* SET .. GETNUMKEYS moved up by one */
    }
}

/* The query a wire byte stands for in protocol proto (DDP__Q_UNKNOWN when none). */
static int ddp__store_query_of(int proto, unsigned char b) {
    if (proto != 2) return b <= DDP__Q_DELETE_KEY ? b : DDP__Q_UNKNOWN;
    switch (b) {
    case DDP__V2_VALIDATE: return DDP__Q_VALIDATE;
    case 8: return DDP__Q_DELETE_KEY;
    case 9: return DDP__Q_APPEND;
    case 10: return DDP__Q_MULTI_GET;
    case 11: return DDP__Q_MULTI_SET;
    case 12: return DDP__Q_CANCEL_WAIT;
    case DDP__V2_PING: return DDP__Q_PING;
    default: return b >= 1 && b <= 7 ? b - 1 : DDP__Q_UNKNOWN;
    }
}

/* ---- pieces shared by the server, the client and the file store ---- */

/* A printable copy of a key for messages: other bytes as \xNN, long keys cut short with "...". */
static const char *ddp__store_key_text(const void *key, size_t n, char *buf, size_t cap) {
    const unsigned char *k = (const unsigned char *)key;
    size_t i, o = 0;
    for (i = 0; i < n; i++) {
        if (o + 8 >= cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
            break;
        }
        if (k[i] >= 0x20 && k[i] < 0x7f && k[i] != '\\')
            buf[o++] = (char)k[i];
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", k[i]);
    }
    buf[o] = '\0';
    return buf;
}

/* FNV-1a: keys are short, and the table only needs an even spread. */
static uint64_t ddp__store_hash(const void *p, size_t n) { return ddp__hash_bytes(DDP__FNV_OFFSET, p, n); }

/* ADD's reading of the value it adds to, as torch's std::stoll: optional space and sign, decimal digits,
   anything after them ignored. Returns 0, or -1 when there is no number or it does not fit in int64. */
static int ddp__store_parse_int(const unsigned char *v, size_t n, int64_t *out) {
    size_t i = 0;
    int neg = 0, digits = 0;
    uint64_t x = 0, limit;
    while (i < n && (v[i] == ' ' || (v[i] >= '\t' && v[i] <= '\r'))) i++;
    if (i < n && (v[i] == '+' || v[i] == '-')) neg = v[i++] == '-';
    limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; i < n && v[i] >= '0' && v[i] <= '9'; i++, digits++) {
        uint64_t d = (uint64_t)(v[i] - '0');
        if (x > (limit - d) / 10) return -1;
        x = x * 10 + d;
    }
    if (!digits) return -1;
    *out = neg ? (int64_t)(0 - x) : (int64_t)x;
    return 0;
}

/* old + delta, unless it does not fit in int64 (returns -1 then). */
static int ddp__store_add_int(int64_t old, int64_t delta, int64_t *sum) {
    if ((delta > 0 && old > INT64_MAX - delta) || (delta < 0 && old < INT64_MIN - delta)) return -1;
    *sum = old + delta;
    return 0;
}

/* ---- a hash table of byte-string keys and values (the server's data, a file store's replayed state) ---- */

typedef struct ddp__kv {
    struct ddp__kv *next;
    void *owner; /* server: the ddp__store_conn charged for it (NULL: its writer left; always NULL in a file store) */
    uint64_t hash;
    size_t key_len, value_len;
    unsigned char *value;
    char *key; /* allocated with the entry, right after it */
} ddp__kv;

typedef struct ddp__kv_table {
    ddp__kv **slots;
    size_t nslots, count;
    size_t bytes; /* entries, keys and values: what the server counts against its budget */
} ddp__kv_table;

#define DDP__KV_ENTRY_BYTES(klen, vlen) (sizeof(ddp__kv) + (klen) + (vlen))

static ddp__kv *ddp__kv_find(const ddp__kv_table *t, const void *key, size_t n, uint64_t h) {
    ddp__kv *e;
    if (!t->nslots) return NULL;
    for (e = t->slots[h & (t->nslots - 1)]; e; e = e->next)
        if (e->hash == h && e->key_len == n && memcmp(e->key, key, n) == 0) return e;
    return NULL;
}

static int ddp__kv_grow(ddp__kv_table *t) {
    size_t n = t->nslots ? t->nslots * 2 : 64, i;
    ddp__kv **slots = (ddp__kv **)ddp__calloc(n, sizeof *slots);
    if (!slots) return -1;
    for (i = 0; i < t->nslots; i++) {
        ddp__kv *e = t->slots[i], *next;
        for (; e; e = next) {
            next = e->next;
            e->next = slots[e->hash & (n - 1)];
            slots[e->hash & (n - 1)] = e;
        }
    }
    ddp__free(t->slots);
    t->slots = slots;
    t->nslots = n;
    return 0;
}

/* Store value (malloc'd; the table takes it, and frees it on failure) under key.
   Returns 1 when the key was created, 0 when replaced, -1 when out of memory. */
static int ddp__kv_put(ddp__kv_table *t, const void *key, size_t n, uint64_t h, unsigned char *value, size_t vlen) {
    ddp__kv *e = ddp__kv_find(t, key, n, h);
    if (e) {
        t->bytes = t->bytes - e->value_len + vlen;
        ddp__free(e->value);
        e->value = value;
        e->value_len = vlen;
        return 0;
    }
    if ((t->count >= t->nslots && ddp__kv_grow(t) != 0) ||
        !(e = (ddp__kv *)ddp__malloc(sizeof *e + n))) {
        ddp__free(value);
        return -1;
    }
    e->hash = h;
    e->owner = NULL;
    e->key = (char *)(e + 1);
    memcpy(e->key, key, n);
    e->key_len = n;
    e->value = value;
    e->value_len = vlen;
    e->next = t->slots[h & (t->nslots - 1)];
    t->slots[h & (t->nslots - 1)] = e;
    t->count++;
    t->bytes += DDP__KV_ENTRY_BYTES(n, vlen);
    return 1;
}

/* Returns 1 when the key was there. */
static int ddp__kv_remove(ddp__kv_table *t, const void *key, size_t n, uint64_t h) {
    ddp__kv **link, *e;
    if (!t->nslots) return 0;
    for (link = &t->slots[h & (t->nslots - 1)]; (e = *link) != NULL; link = &e->next) {
        if (e->hash != h || e->key_len != n || memcmp(e->key, key, n) != 0) continue;
        *link = e->next;
        t->count--;
        t->bytes -= DDP__KV_ENTRY_BYTES(e->key_len, e->value_len);
        ddp__free(e->value);
        ddp__free(e);
        return 1;
    }
    return 0;
}

static void ddp__kv_clear(ddp__kv_table *t) {
    size_t i;
    for (i = 0; i < t->nslots; i++) {
        ddp__kv *e = t->slots[i], *next;
        for (; e; e = next) {
            next = e->next;
            ddp__free(e->value);
            ddp__free(e);
        }
    }
    ddp__free(t->slots);
    memset(t, 0, sizeof *t);
}

/* A copy of n bytes (NULL when out of memory). */
static unsigned char *ddp__store_dup(const void *p, size_t n) {
    unsigned char *d = (unsigned char *)ddp__malloc(n);
    if (d && n) memcpy(d, p, n);
    return d;
}

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

/* ======================================== server ======================================== */

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

/* The budget and what follows from it (see "Budget and shares" above). */
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
    for (i = 0; i < s->nconns; i++) ddp__srv_free_conn(s, s->conns[i]);
    DDP_FREE(s->conns);
    DDP_FREE(s->touched);
    if (s->epfd >= 0) close(s->epfd);
    ddp__kv_clear(&s->kv);
    ddp__free(s->token);
    if (s->listen_fd >= 0) close(s->listen_fd);
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

/* ======================================== client ======================================== */

typedef struct ddp__store_ops {
    ddp_result (*set)(ddp_store *s, const char *key, const void *value, size_t size);
    ddp_result (*get)(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
    ddp_result (*add)(ddp_store *s, const char *key, int64_t delta, int64_t *result);
    ddp_result (*check)(ddp_store *s, const char *const *keys, int n, int *exists);
    ddp_result (*wait)(ddp_store *s, const char *const *keys, int n, double timeout);
    ddp_result (*del)(ddp_store *s, const char *key, int *deleted);
    ddp_result (*compare_set)(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                              const void *desired, size_t desired_size, void *current, size_t capacity, size_t *size);
    ddp_result (*num_keys)(ddp_store *s, int64_t *n);
    void (*close)(ddp_store *s);
} ddp__store_ops;

struct ddp_store {
    const ddp__store_ops *ops;
    double timeout;
    char where[320]; /* "the store at host:port", "the file store /path": for messages */
    char error[DDP__ERR_MAX];
    /* tcp */
    char *host, *prefix;
    int port, fd;
    int proto;          /* 1: torch 1.13's protocol, 2: torch 2.x's, 0: not known yet (found out on connecting) */
    const char *proto_why; /* how it was chosen, for messages */
    size_t prefix_len;
    unsigned char *msg; /* the request being built */
    unsigned char msg_type;
    size_t msg_type_at; /* where the request's type byte is: after the announcing CHECK, or 0 */
    size_t msg_len, msg_cap;
    int msg_oom;
    /* file */
    char *path;
    int file_fd;
    ddp__kv_table kv; /* the file's records replayed up to file_off */
    uint64_t file_off;
    dev_t file_dev;
    ino_t file_ino;
};

static ddp_result ddp__store_fail(ddp_store *s, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
static ddp_result ddp__store_fail(ddp_store *s, ddp_result code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->error, sizeof s->error, fmt, ap);
    va_end(ap);
    ddp__note_thread_error(s->error);
    ddp__log(NULL, DDP_LOG_DEBUG, "%s: %s", ddp_result_string(code), s->error);
    return code;
}

/* "key 'a'" or "keys 'a', 'b' and 3 more", for messages. */
static const char *ddp__store_keys_text(const char *const *keys, int n, char *buf, size_t cap) {
    char one[96];
    size_t o;
    int i;
    o = (size_t)snprintf(buf, cap, "%s", n == 1 ? "key " : "keys ");
    for (i = 0; i < n && i < 3 && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s'%s'", i ? ", " : "",
                              ddp__store_key_text(keys[i], strlen(keys[i]), one, sizeof one));
    if (n > 3 && o < cap) snprintf(buf + o, cap - o, " and %d more", n - 3);
    return buf;
}

/* ---- tcp client ---- */

static void ddp__tcp_disconnect(ddp_store *s) {
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* How long the probe waits for an answer: 5 s, and 1 s more per 128 ranks of the group being joined
   (thousands of ranks connecting at once keep a store busy for seconds: 4,096 on 2 cores left some
   unanswered for 5 s), never past the store's timeout. */
static double ddp__probe_seconds(const ddp_store *s) { return DDP__MIN(s->timeout, 5.0 + ddp__largest_world() / 128.0); }

/* Connect (and authenticate, with DDP_AUTH_TOKEN); no protocol bytes yet. */
static ddp_result ddp__tcp_open(ddp_store *s, double deadline) {
    char why[DDP__ERR_MAX];
    ddp_result r = ddp__net_connect(s->host, s->port, deadline, &s->fd, why);
    if (r == DDP_SUCCESS && ddp__auth_token()) {
        /* a store answers the handshake at once: a short deadline, so that a silent server is found out soon */
        r = ddp__auth_client(s->fd, ddp__auth_token(), s->where, DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s)), why);
        if (r != DDP_SUCCESS) {
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, r, "%s", why);
        }
    }
    if (r == DDP_SUCCESS) return r;
    s->fd = -1;
    if (r == DDP_ERR_SYSTEM) return ddp__store_fail(s, r, "cannot reach %s: %s", s->where, why); /* out of descriptors */
    return ddp__store_fail(s, r, "cannot reach %s: %s; is rank 0 (which serves the store) running, and do "
                                 "MASTER_ADDR and MASTER_PORT name its host and a port it can listen on?",
                           s->where, why);
}

/* Which protocol the server speaks, found out on a fresh connection without ever changing a torch 1.13 store
   (torch 2.x's VALIDATE byte 0 is a SET to a 1.13 server). DDP_STORE_PROTOCOL=1.13 or 2 skips this.
     1. Send, in one write, torch 2.x's VALIDATE (00 + magic CE F7 85 3C) and PING (0D + a nonce whose third
        byte is 0xFF). A 2.x server (classic or libuv) echoes the nonce: protocol 2, and the connection is
        validated. A 1.13 server reads a SET whose key length is the 8 bytes CE F7 85 3C 0D n0 n1 FF, over
        2^63: torch 1.13's recvString cannot allocate that (std::length_error) and its server closes the
        connection; ddp.h's server (any version) drops a key over 4 KiB. Nothing is stored: the SET never
        gets past its key length. A 2.x server older than PING (torch 2.1 .. 2.4) also closes.
     2. After a close: reconnect and send the single byte 06, GETNUMKEYS to a 1.13 server, which answers 8
        bytes: protocol 1. To a 2.x server 06 is a first query that is not VALIDATE: the classic server
        closes (protocol 2, without PING); a libuv one ignores it and waits, and it is a WAIT anyway, which
        reads a count it never gets, so nothing can change there either.
   No answer within min(timeout, 5 s + N/128 s) in step 1 (no bytes and no close), or bytes that are not the
   echo (an HTTP server's "HTTP/1.1 400"): the server does not speak the store protocol (another program
   on MASTER_PORT), and connecting fails saying so, within seconds rather than after the timeout. No
   answer in step 2: it cannot tell, and takes protocol 2 (what current torch speaks), saying so in the
   log; a wrong guess fails with a message that names both versions and DDP_STORE_PROTOCOL. */
static ddp_result ddp__tcp_detect(ddp_store *s, double deadline) {
    unsigned char probe[10], reply[8];
    uint32_t magic = DDP__V2_MAGIC, nonce = 0x5AFF0000u | ((uint32_t)getpid() & 0xFFFFu), echo;
    double until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
    char why[DDP__ERR_MAX];
    ddp_result r;
    probe[0] = DDP__V2_VALIDATE;
    memcpy(probe + 1, &magic, 4);
    probe[5] = DDP__V2_PING;
    memcpy(probe + 6, &nonce, 4);
    r = ddp__net_send(s->fd, probe, sizeof probe, until, why);
    if (r == DDP_SUCCESS) r = ddp__net_recv(s->fd, &echo, 4, until, why);
    while (r == DDP_ERR_TIMEOUT && ddp__now() < deadline && ddp__net_unacked(s->fd)) {
        /* The server's kernel has not even acknowledged the probe: the connection waits in a full listen
           queue (thousands of ranks connecting at once), which says nothing about the program there. */
        until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
        r = ddp__net_recv(s->fd, &echo, 4, until, why);
    }
    if (r == DDP_SUCCESS) {
        if (memcmp(&echo, DDP__AUTH_REQUIRED, 4) == 0) {
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, DDP_ERR_INIT, "%s requires DDP_AUTH_TOKEN (it was started with one) and this process "
                                                    "has none: every rank needs the same token", s->where);
        }
        if (echo != nonce) {
            char text[40];
            ddp__tcp_disconnect(s);
            return ddp__store_fail(s, DDP_ERR_INIT, "the server at %s:%d does not speak the store protocol (is another "
                                                    "program using MASTER_PORT?): it answered torch 2.x's PING with "
                                                    "\"%s\" (0x%08x) instead of 0x%08x, which no TCPStore (torch 1.13, "
                                                    "torch 2.x or ddp.h) does", s->host, s->port,
                                   ddp__store_key_text(&echo, 4, text, sizeof text), echo, nonce);
        }
        s->proto = 2;
        s->proto_why = "found out on connecting";
        return DDP_SUCCESS;
    }
    ddp__tcp_disconnect(s);
    if (r == DDP_ERR_TIMEOUT) /* every TCPStore answers the probe or hangs up on it at once */
        return ddp__store_fail(s, DDP_ERR_INIT, "the server at %s:%d does not speak the store protocol (is another program "
                                                "using MASTER_PORT?): it accepted the connection but neither answered nor "
                                                "closed it within %.3g s of torch 2.x's PING, as every TCPStore does (if "
                                                "it is a store too busy to answer, DDP_STORE_PROTOCOL=2 or 1.13 skips "
                                                "this probe)", s->host, s->port, ddp__probe_seconds(s));
    if (r == DDP_ERR_PEER_LOST) { /* step 2 */
        unsigned char q = DDP__Q_GETNUMKEYS;
        if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
        until = DDP__MIN(deadline, ddp__now() + ddp__probe_seconds(s));
        r = ddp__net_send(s->fd, &q, 1, until, why);
        if (r == DDP_SUCCESS) r = ddp__net_recv(s->fd, reply, 8, until, why);
        if (r == DDP_SUCCESS) {
            s->proto = 1;
            s->proto_why = "found out on connecting";
            return DDP_SUCCESS; /* the connection is in step: GETNUMKEYS got its answer */
        }
        ddp__tcp_disconnect(s);
        if (r == DDP_ERR_PEER_LOST) {
            s->proto = 2;
            s->proto_why = "found out on connecting: a torch 2.x server without PING";
        }
    }
    if (!s->proto) {
        s->proto = 2;
        s->proto_why = "a guess: the server did not answer the probes; DDP_STORE_PROTOCOL=1.13 or 2 says which";
        ddp__log(NULL, DDP_LOG_INFO, "%s answered neither torch 2.x's PING nor torch 1.13's GETNUMKEYS within %.3g s; "
                                     "speaking torch 2.x's protocol (DDP_STORE_PROTOCOL=1.13 or 2 sets it)",
                 s->where, ddp__probe_seconds(s));
    }
    if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
    r = ddp__net_send(s->fd, probe, 5, deadline, why); /* VALIDATE alone */
    if (r != DDP_SUCCESS) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, r, "lost the connection to %s while validating (%s)", s->where, why);
    }
    return DDP_SUCCESS;
}

/* Connect when not connected: in torch 2.x's protocol every connection starts with VALIDATE. */
static ddp_result ddp__tcp_connect(ddp_store *s, double deadline) {
    char why[DDP__ERR_MAX];
    unsigned char validate[5];
    uint32_t magic = DDP__V2_MAGIC;
    ddp_result r;
    if (s->fd >= 0) return DDP_SUCCESS;
    if ((r = ddp__tcp_open(s, deadline)) != DDP_SUCCESS) return r;
    if (!s->proto) return ddp__tcp_detect(s, deadline);
    if (s->proto != 2) return DDP_SUCCESS;
    validate[0] = DDP__V2_VALIDATE;
    memcpy(validate + 1, &magic, 4);
    r = ddp__net_send(s->fd, validate, sizeof validate, deadline, why);
    if (r == DDP_SUCCESS) return r;
    ddp__tcp_disconnect(s);
    return ddp__store_fail(s, r, "lost the connection to %s while validating (%s)", s->where, why);
}

static void ddp__msg_put(ddp_store *s, const void *p, size_t n) {
    if (s->msg_len + n > s->msg_cap) {
        size_t cap = DDP__MAX(s->msg_len + n, s->msg_cap * 2);
        void *m = DDP_REALLOC(s->msg, cap);
        if (!m) {
            s->msg_oom = 1;
            return;
        }
        s->msg = (unsigned char *)m;
        s->msg_cap = cap;
    }
    if (n) memcpy(s->msg + s->msg_len, p, n);
    s->msg_len += n;
}

static void ddp__msg_u64(ddp_store *s, uint64_t v) { ddp__msg_put(s, &v, 8); }

/* Start a request of query type (1.13 numbering); its wire byte is set when it is sent (ddp__tcp_send), once
   the connection, and with it the protocol, is known. */
static void ddp__msg_begin(ddp_store *s, unsigned char type) {
    s->msg_len = 0;
    s->msg_oom = 0;
    ddp__msg_put(s, &type, 1);
    s->msg_type = type;
    s->msg_type_at = 0;
}

/* Start a request that the server may refuse: CHECK of DDP__STORE_ANNOUNCE first, so that a ddp.h server
   answers it with a status byte (see "Refusals" at the top; ddp__tcp_recv_status reads it). */
static void ddp__msg_begin_announced(ddp_store *s, unsigned char type) {
    unsigned char check = DDP__Q_CHECK;
    s->msg_len = 0;
    s->msg_oom = 0;
    ddp__msg_put(s, &check, 1);
    ddp__msg_u64(s, 1);
    ddp__msg_u64(s, DDP__STORE_ANNOUNCE_LEN);
    ddp__msg_put(s, DDP__STORE_ANNOUNCE, DDP__STORE_ANNOUNCE_LEN);
    s->msg_type_at = s->msg_len;
    ddp__msg_put(s, &type, 1);
    s->msg_type = type;
}

/* A key goes on the wire as prefix + key. */
static void ddp__msg_key(ddp_store *s, const char *key) {
    size_t n = strlen(key);
    ddp__msg_u64(s, s->prefix_len + n);
    ddp__msg_put(s, s->prefix, s->prefix_len);
    ddp__msg_put(s, key, n);
}

static void ddp__msg_keys(ddp_store *s, const char *const *keys, int n) {
    int i;
    ddp__msg_u64(s, (uint64_t)n);
    for (i = 0; i < n; i++) ddp__msg_key(s, keys[i]);
}

/* A call failed midway: the stream is in an unknown state, so drop the connection (the next call connects
   again) and say what happened. r and why come from net.c. */
static ddp_result ddp__tcp_broken(ddp_store *s, ddp_result r, const char *why, const char *doing, double seconds) {
    ddp__tcp_disconnect(s);
    if (r == DDP_ERR_TIMEOUT)
        return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s %s in %s; is every rank running and "
                                                   "doing the same steps? (DDP_TIMEOUT sets the timeout)",
                               seconds, doing, s->where);
    return ddp__store_fail(s, r == DDP_ERR_PEER_LOST ? DDP_ERR_PEER_LOST : r,
                           "lost the connection to %s while %s (%s); did rank 0, which serves the store, exit?%s "
                           "(this client spoke torch %s's TCPStore protocol, %s; a server of the other one, torch %s, "
                           "hangs up on it: DDP_STORE_PROTOCOL=%s sets that one)",
                           s->where, doing, why,
                           ddp__auth_token() ? "" : " (a store started with DDP_AUTH_TOKEN also hangs up on a process "
                                                    "without it: every rank needs the same token)",
                           s->proto == 2 ? "2.x" : "1.13", s->proto_why ? s->proto_why : "as set",
                           s->proto == 2 ? "1.13" : "2.x", s->proto == 2 ? "1.13" : "2");
}

/* Connect if needed and send the request built in s->msg, then tail (a large value, sent without a copy).
   On failure the error is formatted (doing names the operation) and the connection dropped. */
static ddp_result ddp__tcp_send(ddp_store *s, const void *tail, size_t tail_n, double deadline, double seconds,
                                const char *doing) {
    char why[DDP__ERR_MAX];
    ddp_result r;
    if (s->msg_oom) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory %s in %s", doing, s->where);
    if ((r = ddp__tcp_connect(s, deadline)) != DDP_SUCCESS) return r;
    if (s->msg_len > s->msg_type_at) {
        if (s->msg_type_at) s->msg[0] = ddp__store_wire_type(s->proto, DDP__Q_CHECK);
        s->msg[s->msg_type_at] = ddp__store_wire_type(s->proto, s->msg_type);
    }
    r = ddp__net_send(s->fd, s->msg, s->msg_len, deadline, why);
    if (r == DDP_SUCCESS && tail_n) r = ddp__net_send(s->fd, tail, tail_n, deadline, why);
    return r == DDP_SUCCESS ? r : ddp__tcp_broken(s, r, why, doing, seconds);
}

static ddp_result ddp__tcp_recv(ddp_store *s, void *buf, size_t n, double deadline, double seconds,
                                const char *doing) {
    char why[DDP__ERR_MAX];
    ddp_result r = ddp__net_recv(s->fd, buf, n, deadline, why);
    return r == DDP_SUCCESS ? r : ddp__tcp_broken(s, r, why, doing, seconds);
}

/* The first byte of the answer to an announced request (ddp__msg_begin_announced): from a ddp.h server its
   status, from a torch server the announcing CHECK's answer (0 or 1); either way the request's own answer
   follows, unless a ddp.h server refused it: then the refusal (code, why) is the error, and the connection
   stays in step. */
static ddp_result ddp__tcp_recv_status(ddp_store *s, double deadline, double seconds, const char *doing) {
    unsigned char status, head[12] = {0};
    char why[512];
    int32_t code = 0;
    uint64_t len = 0;
    ddp_result r = ddp__tcp_recv(s, &status, 1, deadline, seconds, doing);
    if (r) return r;
    if (status == DDP__STATUS_DONE || status == DDP__CHECK_NOT_READY) return DDP_SUCCESS;
    if (status == DDP__STATUS_REFUSED) {
        if ((r = ddp__tcp_recv(s, head, sizeof head, deadline, seconds, doing)) != DDP_SUCCESS) return r;
        memcpy(&code, head, 4);
        memcpy(&len, head + 4, 8);
    }
    if (status != DDP__STATUS_REFUSED || len >= sizeof why || code >= 0 || code < (int32_t)DDP_ERR_UNEVEN_INPUTS) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered status %u while %s (expected 0, 1 or a refusal); is it a "
                                                  "torch 1.13, torch 2.x or ddp.h store?", s->where, status, doing);
    }
    if ((r = ddp__tcp_recv(s, why, (size_t)len, deadline, seconds, doing)) != DDP_SUCCESS) return r;
    why[len] = '\0';
    if (code == DDP_ERR_OUT_OF_MEMORY)
        return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "%s is full (%s) while %s: delete keys that are no longer "
                                                         "needed, or send large data with collectives (rank 0's "
                                                         "DDP_STORE_MAX_BYTES sets the store's budget)",
                               s->where, why, doing);
    return ddp__store_fail(s, (ddp_result)code, "%s refused %s: %s", s->where, doing, why);
}

/* Receive a length-prefixed value: at most capacity bytes into value, the rest read and dropped. */
static ddp_result ddp__tcp_recv_value(ddp_store *s, void *value, size_t capacity, size_t *size, double deadline,
                                      double seconds, const char *doing) {
    uint64_t len;
    unsigned char sink[4096];
    size_t keep, left;
    ddp_result r = ddp__tcp_recv(s, &len, 8, deadline, seconds, doing);
    if (r) return r;
    keep = (size_t)DDP__MIN(len, (uint64_t)capacity);
    if (keep && (r = ddp__tcp_recv(s, value, keep, deadline, seconds, doing)) != DDP_SUCCESS) return r;
    for (left = (size_t)len - keep; left > 0; left -= DDP__MIN(left, sizeof sink))
        if ((r = ddp__tcp_recv(s, sink, DDP__MIN(left, sizeof sink), deadline, seconds, doing)) != DDP_SUCCESS)
            return r;
    if (size) *size = (size_t)len;
    return DDP_SUCCESS;
}

/* WAIT for keys: the server answers one byte once they all exist. */
static ddp_result ddp__tcp_wait(ddp_store *s, const char *const *keys, int n, double timeout) {
    char doing[400], names[300];
    unsigned char reply;
    double deadline = ddp__now() + timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "waiting for %s", ddp__store_keys_text(keys, n, names, sizeof names));
    ddp__msg_begin(s, DDP__Q_WAIT);
    ddp__msg_keys(s, keys, n);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &reply, 1, deadline, timeout, doing)) != DDP_SUCCESS) return r;
    if (reply != DDP__WAIT_STOP_WAITING) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered %u to a WAIT (expected 0) while %s; is it a torch 1.13, "
                                                  "torch 2.x or ddp.h store?", s->where, reply, doing);
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    char doing[200], name[96];
    ddp_result r = ddp__tcp_wait(s, &key, 1, s->timeout);
    double deadline = ddp__now() + s->timeout; /* a fresh timeout for the answer, as torch's client has */
    if (r) return r;
    snprintf(doing, sizeof doing, "getting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_GET);
    ddp__msg_key(s, key);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_value(s, value, capacity, size, deadline, s->timeout, doing);
}

static ddp_result ddp__tcp_set(ddp_store *s, const char *key, const void *value, size_t size) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "setting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, size);
    if ((r = ddp__tcp_send(s, value, size, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_status(s, deadline, s->timeout, doing); /* the set is done (or refused) */
}

static ddp_result ddp__tcp_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    int64_t v;
    ddp_result r;
    snprintf(doing, sizeof doing, "adding to key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_ADD);
    ddp__msg_key(s, key);
    ddp__msg_put(s, &delta, 8);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv_status(s, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &v, 8, deadline, s->timeout, doing)) != DDP_SUCCESS) {
        if (r == DDP_ERR_PEER_LOST) /* torch's server drops a client that adds to a value that is no number */
            snprintf(s->error + strlen(s->error), sizeof s->error - strlen(s->error),
                     " (or key '%s' holds a value that is not an integer)", name);
        return r;
    }
    if (result) *result = v;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_check(ddp_store *s, const char *const *keys, int n, int *exists) {
    char doing[400], names[300];
    double deadline = ddp__now() + s->timeout;
    unsigned char reply;
    ddp_result r;
    snprintf(doing, sizeof doing, "checking %s", ddp__store_keys_text(keys, n, names, sizeof names));
    ddp__msg_begin(s, DDP__Q_CHECK);
    ddp__msg_keys(s, keys, n);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &reply, 1, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if (reply != DDP__CHECK_READY && reply != DDP__CHECK_NOT_READY) {
        ddp__tcp_disconnect(s);
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s answered %u to a CHECK (expected 0 or 1) while %s", s->where,
                               reply, doing);
    }
    *exists = reply == DDP__CHECK_READY;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_delete(ddp_store *s, const char *key, int *deleted) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    int64_t n;
    ddp_result r;
    snprintf(doing, sizeof doing, "deleting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin(s, DDP__Q_DELETE_KEY);
    ddp__msg_key(s, key);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv(s, &n, 8, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if (deleted) *deleted = n == 1;
    return DDP_SUCCESS;
}

static ddp_result ddp__tcp_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                       const void *desired, size_t desired_size, void *current, size_t capacity,
                                       size_t *size) {
    char doing[200], name[96];
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    snprintf(doing, sizeof doing, "compare-setting key '%s'", ddp__store_key_text(key, strlen(key), name, sizeof name));
    ddp__msg_begin_announced(s, DDP__Q_COMPARE_SET);
    ddp__msg_key(s, key);
    ddp__msg_u64(s, expected_size);
    ddp__msg_put(s, expected, expected_size);
    ddp__msg_u64(s, desired_size);
    ddp__msg_put(s, desired, desired_size);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    if ((r = ddp__tcp_recv_status(s, deadline, s->timeout, doing)) != DDP_SUCCESS) return r;
    return ddp__tcp_recv_value(s, current, capacity, size, deadline, s->timeout, doing);
}

static ddp_result ddp__tcp_num_keys(ddp_store *s, int64_t *n) {
    double deadline = ddp__now() + s->timeout;
    ddp_result r;
    ddp__msg_begin(s, DDP__Q_GETNUMKEYS);
    if ((r = ddp__tcp_send(s, NULL, 0, deadline, s->timeout, "counting keys")) != DDP_SUCCESS) return r;
    return ddp__tcp_recv(s, n, 8, deadline, s->timeout, "counting keys");
}

static void ddp__tcp_close(ddp_store *s) {
    ddp__tcp_disconnect(s);
    ddp__free(s->host);
    ddp__free(s->prefix);
    DDP_FREE(s->msg);
}

static const ddp__store_ops ddp__tcp_ops = {ddp__tcp_set,    ddp__tcp_get,         ddp__tcp_add,
                                            ddp__tcp_check,  ddp__tcp_wait,        ddp__tcp_delete,
                                            ddp__tcp_compare_set, ddp__tcp_num_keys, ddp__tcp_close};

static ddp_store *ddp__store_alloc(const ddp__store_ops *ops, double timeout) {
    ddp_store *s = (ddp_store *)ddp__calloc(1, sizeof *s);
    if (!s) return NULL;
    s->ops = ops;
    s->fd = s->file_fd = -1;
    ddp__store_set_timeout(s, timeout);
    return s;
}

/* DDP_STORE_PROTOCOL: auto (unset) 0, "1.13" or "1" 1, "2" or "2.x" 2. */
static ddp_result ddp__store_protocol_setting(int *proto, char *err) {
    const char *v = ddp__env("DDP_STORE_PROTOCOL");
    *proto = 0;
    if (!v || strcmp(v, "auto") == 0) return DDP_SUCCESS;
    if (strcmp(v, "1.13") == 0 || strcmp(v, "1") == 0) *proto = 1;
    else if (strcmp(v, "2") == 0 || strcmp(v, "2.x") == 0) *proto = 2;
    else
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "DDP_STORE_PROTOCOL=%s: expected auto, 1.13 (torch 1.13's "
                                                           "TCPStore protocol) or 2 (torch 2.x's)", v);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_connect(const char *host, int port, const char *prefix, double timeout, ddp_store **out,
                                     char *err) {
    ddp_store *s;
    ddp_result r;
    *out = NULL;
    if (!host || !*host || port <= 0 || port > 65535)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the store address %s:%d is not a host and a port in "
                                                           "1..65535", host ? host : "(null)", port);
    if (prefix && strlen(prefix) >= DDP__STORE_MAX_KEY)
        return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the store key prefix is %zu bytes long (the limit is %zu)",
                            strlen(prefix), DDP__STORE_MAX_KEY - 1);
    if (!(s = ddp__store_alloc(&ddp__tcp_ops, timeout)))
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory connecting to the store");
    s->host = ddp__strdup(host);
    s->prefix = ddp__strdup(prefix ? prefix : "");
    s->port = port;
    if (!s->host || !s->prefix) {
        ddp__store_free(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory connecting to the store");
    }
    s->prefix_len = strlen(s->prefix);
    snprintf(s->where, sizeof s->where, "the store at %s:%d", host, port);
    if ((r = ddp__store_protocol_setting(&s->proto, err)) != DDP_SUCCESS) {
        ddp__store_free(s);
        return r;
    }
    s->proto_why = s->proto ? "as DDP_STORE_PROTOCOL says" : NULL;
    r = ddp__tcp_connect(s, ddp__now() + s->timeout);
    if (r != DDP_SUCCESS) {
        ddp__fail_to(err, r, "%s", s->error);
        ddp__store_free(s);
        return r;
    }
    *out = s;
    return DDP_SUCCESS;
}

static int ddp__store_torch_prefix(const char *prefix_store, char *buf, size_t cap) {
    int n = prefix_store && *prefix_store ? snprintf(buf, cap, "/%s/", prefix_store) : snprintf(buf, cap, "/");
    return n >= 0 && (size_t)n < cap ? 0 : -1;
}

/* ---- file store ---- */

/* Take the file's lock (LOCK_SH or LOCK_EX) before the deadline: a holder only keeps it for one operation. */
static ddp_result ddp__file_lock(ddp_store *s, int how, double deadline, const char *doing) {
    double backoff = 0.001;
    for (;;) {
        if (flock(s->file_fd, how | LOCK_NB) == 0) return DDP_SUCCESS;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot lock %s while %s: %s", s->where, doing, strerror(errno));
        if (ddp__now() + backoff > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for the lock on %s while %s; "
                                                       "is a process holding it stuck?", s->timeout, s->where, doing);
        ddp__sleep(backoff);
        backoff = DDP__MIN(backoff * 2, 0.05);
    }
}

static void ddp__file_unlock(ddp_store *s) { flock(s->file_fd, LOCK_UN); }

/* Apply the records in buf[0 .. n) (whole records only: written under the exclusive lock). */
static ddp_result ddp__file_apply(ddp_store *s, const unsigned char *buf, size_t n) {
    size_t at = 0;
    while (at < n) {
        unsigned char op = buf[at];
        uint64_t klen, vlen = 0;
        const unsigned char *key, *value = NULL;
        if (n - at < 9 || (op != 'S' && op != 'D')) break;
        memcpy(&klen, buf + at + 1, 8);
        if (klen > DDP__STORE_MAX_KEY || n - at - 9 < klen) break;
        key = buf + at + 9;
        at += 9 + (size_t)klen;
        if (op == 'S') {
            unsigned char *copy;
            if (n - at < 8) break;
            memcpy(&vlen, buf + at, 8);
            if (vlen > DDP__STORE_MAX_VALUE || n - at - 8 < vlen) break;
            value = buf + at + 8;
            at += 8 + (size_t)vlen;
            copy = ddp__store_dup(value, (size_t)vlen);
            if (!copy || ddp__kv_put(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen), copy, (size_t)vlen) < 0)
                return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %s", s->where);
        } else {
            ddp__kv_remove(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen));
        }
    }
    if (at == n) return DDP_SUCCESS;
    return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is damaged: a bad or cut-off record %llu bytes into it (was a "
                                              "writer killed?); delete the file and start every rank again",
                           s->where, (unsigned long long)(s->file_off + at));
}

/* Under the lock: check that the file is still the one at the path, and replay what this handle has not
   seen yet. */
static ddp_result ddp__file_sync(ddp_store *s) {
    struct stat st, at_path;
    unsigned char *buf;
    size_t n, got = 0;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (stat(s->path, &at_path) != 0 || at_path.st_ino != st.st_ino || at_path.st_dev != st.st_dev)
        return ddp__store_fail(s, DDP_ERR_STATE, "%s was deleted or replaced (the last of its users closed it); "
                                                 "every rank must open the store before any closes it", s->where);
    if ((uint64_t)st.st_size == s->file_off) return DDP_SUCCESS;
    if ((uint64_t)st.st_size < s->file_off)
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s shrank from %llu to %llu bytes; something else writes to it",
                               s->where, (unsigned long long)s->file_off, (unsigned long long)st.st_size);
    n = (size_t)((uint64_t)st.st_size - s->file_off);
    if (!(buf = (unsigned char *)ddp__malloc(n)))
        return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %zu bytes of %s", n, s->where);
    while (got < n) {
        ssize_t k = pread(s->file_fd, buf + got, n - got, (off_t)(s->file_off + got));
        if (k > 0) {
            got += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        ddp__free(buf);
        return ddp__store_fail(s, DDP_ERR_IO, "cannot read %s: %s", s->where, k < 0 ? strerror(errno) : "short read");
    }
    if (s->file_off == 0) { /* a new handle: the file must start with the magic */
        if (n < 8 || memcmp(buf, DDP__STORE_FILE_MAGIC, 8) != 0) {
            ddp__free(buf);
            return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is not a ddp.h file store (another program's file, or one "
                                                      "left by another tool?); use a new path", s->where);
        }
        r = ddp__file_apply(s, buf + 8, n - 8);
    } else {
        r = ddp__file_apply(s, buf, n);
    }
    ddp__free(buf);
    if (r == DDP_SUCCESS) s->file_off = (uint64_t)st.st_size;
    return r;
}

static ddp_result ddp__file_write(ddp_store *s, const void *buf, size_t n) {
    const char *p = (const char *)buf;
    while (n > 0) {
        ssize_t k = write(s->file_fd, p, n);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        return ddp__store_fail(s, DDP_ERR_IO, "cannot write to %s: %s", s->where, k < 0 ? strerror(errno) : "no space");
    }
    return DDP_SUCCESS;
}

/* Under the exclusive lock, after ddp__file_sync: append a record ('S' with a value, 'D' without) and apply it. */
static ddp_result ddp__file_append(ddp_store *s, char op, const char *key, size_t klen, const void *value, size_t vlen) {
    size_t n = 9 + klen + (op == 'S' ? 8 + vlen : 0);
    unsigned char *rec = (unsigned char *)ddp__malloc(n);
    uint64_t k64 = klen, v64 = vlen;
    ddp_result r;
    if (!rec) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory writing %s", s->where);
    rec[0] = (unsigned char)op;
    memcpy(rec + 1, &k64, 8);
    memcpy(rec + 9, key, klen);
    if (op == 'S') {
        memcpy(rec + 9 + klen, &v64, 8);
        if (vlen) memcpy(rec + 17 + klen, value, vlen);
    }
    r = ddp__file_write(s, rec, n);
    if (r == DDP_SUCCESS) r = ddp__file_apply(s, rec, n);
    if (r == DDP_SUCCESS) s->file_off += n;
    ddp__free(rec);
    return r;
}

/* Run body (one of the ddp__file_*_locked functions) under the lock, after catching up with the file. */
#define DDP__FILE_LOCKED(s, how, doing, call)                                    \
    do {                                                                         \
        ddp_result r_ = ddp__file_lock(s, how, ddp__now() + (s)->timeout, doing); \
        if (r_ != DDP_SUCCESS) return r_;                                        \
        r_ = ddp__file_sync(s);                                                  \
        if (r_ == DDP_SUCCESS) r_ = (call);                                      \
        ddp__file_unlock(s);                                                     \
        return r_;                                                               \
    } while (0)

static ddp__kv *ddp__file_find(ddp_store *s, const char *key) {
    size_t n = strlen(key);
    return ddp__kv_find(&s->kv, key, n, ddp__store_hash(key, n));
}

static ddp_result ddp__file_set(ddp_store *s, const char *key, const void *value, size_t size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "setting a key", ddp__file_append(s, 'S', key, strlen(key), value, size));
}

static ddp_result ddp__file_add_locked(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp__kv *kv = ddp__file_find(s, key);
    int64_t old = 0, now;
    char text[32], name[96];
    int n;
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0)
        return ddp__store_fail(s, DDP_ERR_STATE, "cannot add to key '%s' in %s: its value is not an integer",
                               ddp__store_key_text(key, strlen(key), name, sizeof name), s->where);
    if (ddp__store_add_int(old, delta, &now) != 0)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "cannot add %lld to key '%s' in %s: it holds %lld, and the "
                                                            "sum would overflow int64 (the store does not wrap around)",
                               (long long)delta, ddp__store_key_text(key, strlen(key), name, sizeof name), s->where,
                               (long long)old);
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    if (result) *result = now;
    return ddp__file_append(s, 'S', key, strlen(key), text, (size_t)n);
}

static ddp_result ddp__file_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    DDP__FILE_LOCKED(s, LOCK_EX, "adding to a key", ddp__file_add_locked(s, key, delta, result));
}

static ddp_result ddp__file_check_locked(ddp_store *s, const char *const *keys, int n, int *exists) {
    int i;
    *exists = 1;
    for (i = 0; i < n; i++)
        if (!ddp__file_find(s, keys[i])) *exists = 0;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_check(ddp_store *s, const char *const *keys, int n, int *exists) {
    DDP__FILE_LOCKED(s, LOCK_SH, "checking keys", ddp__file_check_locked(s, keys, n, exists));
}

/* Poll until every key exists; with want_value, copy keys[0]'s value out while still holding the lock. */
static ddp_result ddp__file_poll(ddp_store *s, const char *const *keys, int n, double timeout, int want_value,
                                 void *value, size_t capacity, size_t *size) {
    double deadline = ddp__now() + timeout, backoff = 0.001;
    char names[300];
    int first = 1;
    for (;;) {
        struct stat st;
        /* nothing new in the file since the last look: no need to take the lock */
        if (first || fstat(s->file_fd, &st) != 0 || (uint64_t)st.st_size != s->file_off) {
            int all = 0;
            ddp_result r = ddp__file_lock(s, LOCK_SH, deadline, "waiting for keys");
            if (r) return r;
            r = ddp__file_sync(s);
            if (r == DDP_SUCCESS) ddp__file_check_locked(s, keys, n, &all);
            if (r == DDP_SUCCESS && all && want_value) {
                ddp__kv *kv = ddp__file_find(s, keys[0]);
                if (capacity) memcpy(value, kv->value, DDP__MIN(capacity, kv->value_len));
                if (size) *size = kv->value_len;
            }
            ddp__file_unlock(s);
            if (r) return r;
            if (all) return DDP_SUCCESS;
            first = 0;
        }
        if (ddp__now() >= deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for %s in %s; is every rank "
                                                       "running and doing the same steps? (DDP_TIMEOUT sets the timeout)",
                                   timeout, ddp__store_keys_text(keys, n, names, sizeof names), s->where);
        ddp__sleep(DDP__MIN(backoff, DDP__MAX(deadline - ddp__now(), 0.0)));
        backoff = DDP__MIN(backoff * 1.5, 0.05);
    }
}

static ddp_result ddp__file_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    return ddp__file_poll(s, &key, 1, s->timeout, 1, value, capacity, size);
}

static ddp_result ddp__file_wait(ddp_store *s, const char *const *keys, int n, double timeout) {
    return ddp__file_poll(s, keys, n, timeout, 0, NULL, 0, NULL);
}

static ddp_result ddp__file_delete_locked(ddp_store *s, const char *key, int *deleted) {
    int there = ddp__file_find(s, key) != NULL;
    if (deleted) *deleted = there;
    return there ? ddp__file_append(s, 'D', key, strlen(key), NULL, 0) : DDP_SUCCESS;
}

static ddp_result ddp__file_delete(ddp_store *s, const char *key, int *deleted) {
    DDP__FILE_LOCKED(s, LOCK_EX, "deleting a key", ddp__file_delete_locked(s, key, deleted));
}

static ddp_result ddp__file_compare_set_locked(ddp_store *s, const char *key, const void *expected, size_t elen,
                                               const void *desired, size_t dlen, void *current, size_t capacity,
                                               size_t *size) {
    ddp__kv *kv = ddp__file_find(s, key);
    ddp_result r;
    if (!kv && elen != 0) { /* torch answers with expected here */
        if (current) memcpy(current, expected, DDP__MIN(capacity, elen));
        if (size) *size = elen;
        return DDP_SUCCESS;
    }
    if (!kv || (kv->value_len == elen && memcmp(kv->value, expected, elen) == 0)) {
        if ((r = ddp__file_append(s, 'S', key, strlen(key), desired, dlen)) != DDP_SUCCESS) return r;
        kv = ddp__file_find(s, key);
    }
    if (current) memcpy(current, kv->value, DDP__MIN(capacity, kv->value_len));
    if (size) *size = kv->value_len;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                        const void *desired, size_t desired_size, void *current, size_t capacity,
                                        size_t *size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "compare-setting a key",
                     ddp__file_compare_set_locked(s, key, expected, expected_size, desired, desired_size, current,
                                                  capacity, size));
}

static ddp_result ddp__file_num_keys_locked(ddp_store *s, int64_t *n) {
    *n = (int64_t)s->kv.count - (ddp__file_find(s, DDP__STORE_FILE_REFS) ? 1 : 0);
    return DDP_SUCCESS;
}

static ddp_result ddp__file_num_keys(ddp_store *s, int64_t *n) {
    DDP__FILE_LOCKED(s, LOCK_SH, "counting keys", ddp__file_num_keys_locked(s, n));
}

/* The last user to leave deletes the file, as torch's FileStore does. */
static void ddp__file_close(ddp_store *s) {
    if (s->file_fd >= 0 && s->file_off > 0 &&
        ddp__file_lock(s, LOCK_EX, ddp__now() + s->timeout, "closing") == DDP_SUCCESS) {
        int64_t users = 1;
        if (ddp__file_sync(s) == DDP_SUCCESS && ddp__file_add_locked(s, DDP__STORE_FILE_REFS, -1, &users) == DDP_SUCCESS &&
            users <= 0)
            unlink(s->path);
        ddp__file_unlock(s);
    }
    if (s->file_fd >= 0) close(s->file_fd);
    s->file_fd = -1;
    ddp__kv_clear(&s->kv);
    ddp__free(s->path);
}

static const ddp__store_ops ddp__file_ops = {ddp__file_set,    ddp__file_get,         ddp__file_add,
                                             ddp__file_check,  ddp__file_wait,        ddp__file_delete,
                                             ddp__file_compare_set, ddp__file_num_keys, ddp__file_close};

/* Open the file and lock it, making sure the locked file is still the one at the path: the last user of an
   old store may have deleted it between our open and our lock. */
static ddp_result ddp__file_open_locked(ddp_store *s, double deadline) {
    for (;;) {
        struct stat st, at_path;
        ddp_result r;
        s->file_fd = open(s->path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (s->file_fd < 0)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot open %s: %s (its directory must exist and be writable by "
                                                  "every rank)", s->where, strerror(errno));
        if ((r = ddp__file_lock(s, LOCK_EX, deadline, "opening it")) != DDP_SUCCESS) return r;
        if (fstat(s->file_fd, &st) == 0 && stat(s->path, &at_path) == 0 && st.st_ino == at_path.st_ino &&
            st.st_dev == at_path.st_dev)
            return DDP_SUCCESS;
        close(s->file_fd); /* closing drops the lock */
        s->file_fd = -1;
        if (ddp__now() > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out opening %s: it keeps being replaced", s->where);
    }
}

static ddp_result ddp__file_open_body(ddp_store *s) {
    struct stat st;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (st.st_size == 0 && (r = ddp__file_write(s, DDP__STORE_FILE_MAGIC, 8)) != DDP_SUCCESS) return r;
    if ((r = ddp__file_sync(s)) != DDP_SUCCESS) return r;
    return ddp__file_add_locked(s, DDP__STORE_FILE_REFS, 1, NULL);
}

static ddp_result ddp__store_open_file(const char *path, double timeout, ddp_store **out, char *err) {
    ddp_store *s;
    ddp_result r;
    *out = NULL;
    if (!path || !*path) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the file store needs a path");
    if (!(s = ddp__store_alloc(&ddp__file_ops, timeout)) || !(s->path = ddp__strdup(path))) {
        ddp__free(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory opening the file store");
    }
    snprintf(s->where, sizeof s->where, "the file store %s", path);
    r = ddp__file_open_locked(s, ddp__now() + s->timeout);
    if (r == DDP_SUCCESS) {
        r = ddp__file_open_body(s);
        ddp__file_unlock(s);
    }
    if (r != DDP_SUCCESS) {
        ddp__fail_to(err, r, "%s", s->error);
        s->file_off = 0; /* not counted as a user: leave the count alone when closing */
        ddp__store_free(s);
        return r;
    }
    *out = s;
    return DDP_SUCCESS;
}

/* ---- both kinds ---- */

static void ddp__store_free(ddp_store *s) {
    if (!s) return;
    s->ops->close(s);
    ddp__free(s);
}

static void ddp__store_set_timeout(ddp_store *s, double timeout) { s->timeout = timeout > 0 ? timeout : 300.0; }

/* Checks shared by the public calls; messages go to the store (or this thread's buffer without one). */
static ddp_result ddp__store_check_key(ddp_store *s, const char *key, const char *call) {
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (!key) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is NULL", call);
    if (strlen(key) + s->prefix_len >= DDP__STORE_MAX_KEY)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is %zu bytes long; keys (with the store's "
                                                            "prefix) must stay under %zu bytes",
                               call, strlen(key), DDP__STORE_MAX_KEY);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_value(ddp_store *s, const void *value, size_t size, const char *call) {
    if (!value && size) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the value is NULL but its size is %zu", call, size);
    if (size > DDP__STORE_MAX_VALUE)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: a value of %zu bytes is over the store's limit of %zu "
                                                            "MiB; send large data with collectives instead",
                               call, size, DDP__STORE_MAX_VALUE >> 20);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_keys(ddp_store *s, const char *const *keys, int n, const char *call) {
    int i;
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (n < 0 || (uint64_t)n > DDP__STORE_MAX_WAIT_KEYS || (n > 0 && !keys))
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: %d keys%s (0 to %llu keys at once)", call, n,
                               n > 0 && !keys ? " in a NULL array" : "", (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
    for (i = 0; i < n; i++)
        if ((r = ddp__store_check_key(s, keys[i], call)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

static ddp_result ddp__store_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                         const void *desired, size_t desired_size, void *current, size_t capacity,
                                         size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, expected, expected_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, desired, desired_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS && !current && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp__store_compare_set: current is NULL but capacity is %zu",
                            capacity);
    if (r) return r;
    return s->ops->compare_set(s, key, expected, expected_size, desired, desired_size, current, capacity, size);
}

static ddp_result ddp__store_num_keys(ddp_store *s, int64_t *n) {
    if (!s || !n) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp__store_num_keys: NULL store or result");
    return s->ops->num_keys(s, n);
}

DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, value, size, "ddp_store_set");
    return r ? r : s->ops->set(s, key, value, size);
}

DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_get");
    if (r == DDP_SUCCESS && !value && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_get: value is NULL but capacity is %zu", capacity);
    return r ? r : s->ops->get(s, key, value, capacity, size);
}

DDP_API ddp_result ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_add");
    return r ? r : s->ops->add(s, key, delta, result);
}

DDP_API ddp_result ddp_store_check(ddp_store *s, const char *key, int *exists) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_check");
    if (r == DDP_SUCCESS && !exists) r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_check: exists is NULL");
    return r ? r : s->ops->check(s, &key, 1, exists);
}

DDP_API ddp_result ddp_store_wait(ddp_store *s, const char *const *keys, int n, double timeout_seconds) {
    ddp_result r = ddp__store_check_keys(s, keys, n, "ddp_store_wait");
    return r ? r : s->ops->wait(s, keys, n, timeout_seconds > 0 ? timeout_seconds : s->timeout);
}

DDP_API ddp_result ddp_store_delete(ddp_store *s, const char *key, int *deleted) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_delete");
    return r ? r : s->ops->del(s, key, deleted);
}

DDP_API const char *ddp_store_last_error(const ddp_store *s) { return s ? s->error : ddp_last_error(NULL); }
