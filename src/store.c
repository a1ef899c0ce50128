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
   fresh path for each run, as with FileStore. The format is ddp.h's own.

   The pieces: store_state.h (the constants, the handle, the calls between the pieces), this file (the
   query numbers on the wire, key text, the hash table), store_server.c (the server), store_client.c (the
   handle's errors and the TCP client), store_file.c (the file store), store_api.c (the calls on either
   kind: ddp_store_* and the checks of their arguments). */
#include "internal.h"
#include "store_state.h"

/* The wire byte of query q (1.13 numbering, store_state.h) in protocol proto (1: torch 1.13, 2: torch 2.x). */
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

/* ---- a hash table of byte-string keys and values (the server's data, a file store's replayed state) ----
   (its entries' types are in store_state.h) */

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
