/* [SECTION] store-client: the store's client: a handle's errors, the TCP client of either protocol
   (store.c's head comment describes the protocols and the client; store_state.h the handle,
   store_file.c the other kind of handle, store_api.c the calls on either kind). */
#include "internal.h"
#include "store_state.h"

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
   answers it with a status byte (see "Refusals" at the top of store.c; ddp__tcp_recv_status reads it). */
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
    if (s->own_server) /* rank 0 did not exit: it is this process */
        return ddp__store_fail(s, r == DDP_ERR_PEER_LOST ? DDP_ERR_PEER_LOST : r,
                               "lost the connection to %s while %s (%s): this process (rank 0) serves that store, and "
                               "its server closed this process's own connection (DDP_LOG_LEVEL=debug logs why)",
                               s->where, doing, why);
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
    if (status != DDP__STATUS_REFUSED || len >= sizeof why || code >= 0 || code < (int32_t)DDP_ERR_VIEW_CHANGED) {
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

/* ---- both kinds ---- */

static void ddp__store_free(ddp_store *s) {
    if (!s) return;
    s->ops->close(s);
    ddp__free(s);
}

static void ddp__store_set_timeout(ddp_store *s, double timeout) { s->timeout = timeout > 0 ? timeout : 300.0; }

static void ddp__store_mark_own(ddp_store *s) {
    if (s) s->own_server = 1;
}

/* Wait until the server hangs up this client's idle connection (it stopped), at most `seconds`. Nothing
   is in flight, so any byte is unexpected: read and dropped. 1: closed (or no TCP connection to wait on),
   0: still open at the end. */
static int ddp__store_await_close(ddp_store *s, double seconds) {
    double deadline = ddp__now() + seconds;
    if (!s || s->ops != &ddp__tcp_ops || s->fd < 0) return 1;
    for (;;) {
        char sink[256], why[DDP__ERR_MAX];
        ssize_t n;
        if (ddp__net_poll(s->fd, POLLIN, deadline, why) != DDP_SUCCESS) return 0; /* the deadline, or poll failed */
        n = recv(s->fd, sink, sizeof sink, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            ddp__tcp_disconnect(s);
            return 1;
        }
    }
}
