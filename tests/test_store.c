/* The rendezvous store: the TCP server and client (torch 1.13's TCPStore protocol) and the file store.
   Values are checked against data each process regenerates independently; the raw-socket parts speak the
   protocol by hand, so the server is not only checked through our own client. The server runs on a thread
   of the test process or of one forked rank; no process forks while a server thread runs. Also: the
   server's budget, per-client shares and refusals ("store full", ADD overflow); 300 clients waiting at
   once on the epoll server, a quarter of them hanging up; a stopping server closes its listener before its
   clients' connections (a redial right after the close is refused); rank 0's own client does not ask
   whether rank 0 exited. */
#include "testlib.h"

#include <fcntl.h>
#include <sys/stat.h>

/* CHECK_STORE(call, store): CHECK_OK for store calls (prints ddp_store_last_error(store)). */
#define CHECK_STORE(call, s) TL_CHECK_SUCCESS(call, #call, ddp_store_last_error(s))

/* A value of size bytes for (seed, size) with plenty of zero bytes in it. */
static void fill(unsigned char *buf, size_t size, uint64_t seed) {
    size_t i;
    for (i = 0; i < size; i++) buf[i] = (i % 3 == 0) ? 0 : (unsigned char)tl_rand(&seed);
}

static size_t value_size(int rank) { return 1000 + (size_t)rank * 37; }

static void check_value(const unsigned char *got, size_t size, uint64_t seed, const char *what) {
    unsigned char *want = (unsigned char *)malloc(size ? size : 1);
    CHECK(want != NULL, "out of memory");
    fill(want, size, seed);
    CHECK(memcmp(got, want, size) == 0, "%s: the bytes differ from what was set", what);
    free(want);
}

static int contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

/* All n processes arrive before any leaves: an add, and a key the last one sets. */
static void store_barrier(ddp_store *s, const char *name, int n) {
    char done[128];
    const char *k = done;
    int64_t v = 0;
    snprintf(done, sizeof done, "%s/done", name);
    CHECK_STORE(ddp_store_add(s, name, 1, &v), s);
    if (v == n) CHECK_STORE(ddp_store_set(s, done, "1", 1), s);
    CHECK_STORE(ddp_store_wait(s, &k, 1, 0), s);
}

/* ---- raw protocol, by hand ---- */

static int raw_connect(int port) {
    struct sockaddr_in a;
    struct timeval tv;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "raw connect: %s", strerror(errno));
    tv.tv_sec = 10;
    tv.tv_usec = 0;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void raw_send(int fd, const void *p, size_t n) {
    const char *c = (const char *)p;
    while (n > 0) {
        ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        CHECK(k > 0, "raw send: %s", strerror(errno));
        c += k;
        n -= (size_t)k;
    }
}

static void raw_recv(int fd, void *p, size_t n) {
    char *c = (char *)p;
    while (n > 0) {
        ssize_t k = recv(fd, c, n, 0);
        CHECK(k > 0, "raw recv: %s", k == 0 ? "closed" : strerror(errno));
        c += k;
        n -= (size_t)k;
    }
}

/* The server closed the connection (EOF or reset), as it must for a bad client. */
static int raw_closed(int fd) {
    char b[256];
    for (;;) {
        ssize_t k = recv(fd, b, sizeof b, 0);
        if (k == 0 || (k < 0 && errno == ECONNRESET)) return 1;
        if (k < 0) return 0; /* timed out: still open */
    }
}

typedef struct msg {
    unsigned char b[1024];
    size_t n;
} msg;

static void m_byte(msg *m, unsigned char v) { m->b[m->n++] = v; }
static void m_u64(msg *m, uint64_t v) {
    memcpy(m->b + m->n, &v, 8);
    m->n += 8;
}
static void m_str(msg *m, const char *s) {
    m_u64(m, strlen(s));
    memcpy(m->b + m->n, s, strlen(s));
    m->n += strlen(s);
}

/* ---- the server's request parser, on every prefix of every kind of request ---- */

static void test_parse(void) {
    msg reqs[8];
    size_t i, cut, size;
    char why[256];
    for (i = 0; i < 8; i++) reqs[i].n = 0;
    m_byte(&reqs[0], 0), m_str(&reqs[0], "key"), m_str(&reqs[0], "value");           /* SET */
    m_byte(&reqs[1], 1), m_str(&reqs[1], "k"), m_str(&reqs[1], ""), m_str(&reqs[1], "d"); /* COMPARE_SET */
    m_byte(&reqs[2], 2), m_str(&reqs[2], "key");                                        /* GET */
    m_byte(&reqs[3], 3), m_str(&reqs[3], "key"), m_u64(&reqs[3], 5);                    /* ADD */
    m_byte(&reqs[4], 4), m_u64(&reqs[4], 2), m_str(&reqs[4], "a"), m_str(&reqs[4], "bc"); /* CHECK */
    m_byte(&reqs[5], 5), m_u64(&reqs[5], 0);                                            /* WAIT, no keys */
    m_byte(&reqs[6], 6);                                                                /* GETNUMKEYS */
    m_byte(&reqs[7], 8), m_str(&reqs[7], "");                                           /* DELETE_KEY */
    for (i = 0; i < 8; i++) {
        for (cut = 0; cut < reqs[i].n; cut++) {
            int st = ddp__srv_parse(1, reqs[i].b, cut, &size, why, sizeof why);
            CHECK(st == DDP__REQ_MORE && size > cut && size <= reqs[i].n,
                  "request %zu cut at %zu: status %d, size %zu of %zu", i, cut, st, size, reqs[i].n);
        }
        /* complete, with the next request's first byte after it */
        reqs[i].b[reqs[i].n] = 6;
        CHECK(ddp__srv_parse(1, reqs[i].b, reqs[i].n + 1, &size, why, sizeof why) == DDP__REQ_DONE && size == reqs[i].n,
              "request %zu: size %zu of %zu", i, size, reqs[i].n);
    }
}

/* The same for torch 2.x's queries (VALIDATE 0, SET 1, ..., PING 13). */
static void test_parse_v2(void) {
    msg reqs[8];
    size_t i, cut, size;
    char why[256];
    for (i = 0; i < 8; i++) reqs[i].n = 0;
    m_byte(&reqs[0], 0), m_u64(&reqs[0], 0x3C85F7CEu), reqs[0].n -= 4;                 /* VALIDATE */
    m_byte(&reqs[1], 13), m_u64(&reqs[1], 77), reqs[1].n -= 4;                         /* PING */
    m_byte(&reqs[2], 1), m_str(&reqs[2], "key"), m_str(&reqs[2], "value");            /* SET */
    m_byte(&reqs[3], 9), m_str(&reqs[3], "key"), m_str(&reqs[3], "more");             /* APPEND */
    m_byte(&reqs[4], 10), m_u64(&reqs[4], 2), m_str(&reqs[4], "a"), m_str(&reqs[4], "bc"); /* MULTI_GET */
    m_byte(&reqs[5], 11), m_u64(&reqs[5], 2), m_str(&reqs[5], "a"), m_str(&reqs[5], "1"), m_str(&reqs[5], "b"),
        m_str(&reqs[5], "");                                                            /* MULTI_SET */
    m_byte(&reqs[6], 12);                                                               /* CANCEL_WAIT */
    m_byte(&reqs[7], 4), m_str(&reqs[7], "key"), m_u64(&reqs[7], 5);                   /* ADD */
    for (i = 0; i < 8; i++) {
        for (cut = 0; cut < reqs[i].n; cut++) {
            int st = ddp__srv_parse(2, reqs[i].b, cut, &size, why, sizeof why);
            CHECK(st == DDP__REQ_MORE && size > cut && size <= reqs[i].n,
                  "v2 request %zu cut at %zu: status %d, size %zu of %zu", i, cut, st, size, reqs[i].n);
        }
        reqs[i].b[reqs[i].n] = 7;
        CHECK(ddp__srv_parse(2, reqs[i].b, reqs[i].n + 1, &size, why, sizeof why) == DDP__REQ_DONE && size == reqs[i].n,
              "v2 request %zu: size %zu of %zu", i, size, reqs[i].n);
    }
    reqs[0].b[0] = 14; /* QUEUE_PUSH: not served */
    CHECK(ddp__srv_parse(2, reqs[0].b, reqs[0].n, &size, why, sizeof why) == DDP__REQ_BAD, "QUEUE_PUSH accepted");
}

/* ---- in one process: the server on a thread, clients beside it ---- */

static void test_single_process(void) {
    ddp__store_server *srv;
    ddp_store *s, *a, *b;
    char err[DDP__ERR_MAX], buf[64], where[64];
    unsigned char big_small[16];
    unsigned char *big, *back;
    size_t size = 0, big_n = (size_t)8 << 20;
    int64_t v = 0, nk = 0;
    int exists = -1, deleted = -1, port;
    double t0;
    ddp_result r;
    const char *two[2] = {"w/1", "w/2"};

    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_DEFAULT, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    CHECK(port > 0, "bound port %d", port);
    snprintf(where, sizeof where, "127.0.0.1:%d", port);
    r = ddp__store_connect("127.0.0.1", port, NULL, 30, &s, err);
    CHECK(r == DDP_SUCCESS, "connect: %s", err);

    /* binary values with zeros; a short buffer gets the start and the full size */
    {
        unsigned char val[300], got[300];
        fill(val, sizeof val, 7);
        CHECK_STORE(ddp_store_set(s, "bin", val, sizeof val), s);
        CHECK_STORE(ddp_store_get(s, "bin", got, sizeof got, &size), s);
        CHECK(size == sizeof val, "size %zu", size);
        check_value(got, size, 7, "bin");
        memset(got, 0xAA, sizeof got);
        CHECK_STORE(ddp_store_get(s, "bin", got, 10, &size), s);
        CHECK(size == sizeof val && memcmp(got, val, 10) == 0 && got[10] == 0xAA, "partial get");
        CHECK_STORE(ddp_store_set(s, "empty", NULL, 0), s);
        CHECK_STORE(ddp_store_get(s, "empty", NULL, 0, &size), s);
        CHECK(size == 0, "empty value has size %zu", size);
    }

    /* a missing key times out, names the key and the store; the next call works again */
    ddp__store_set_timeout(s, 0.5);
    t0 = tl_now();
    r = ddp_store_get(s, "missing/key", buf, sizeof buf, &size);
    CHECK(r == DDP_ERR_TIMEOUT, "get of a missing key returned %d: %s", (int)r, ddp_store_last_error(s));
    CHECK(tl_now() - t0 >= 0.45, "the get gave up after %.3f s, before its 0.5 s timeout", tl_now() - t0);
    CHECK(contains(ddp_store_last_error(s), "'missing/key'") && contains(ddp_store_last_error(s), where),
          "message does not name the key and %s: %s", where, ddp_store_last_error(s));
    ddp__store_set_timeout(s, 30);
    CHECK_STORE(ddp_store_set(s, "after", "ok", 2), s);
    CHECK_STORE(ddp_store_get(s, "after", buf, sizeof buf, &size), s);
    CHECK(size == 2 && memcmp(buf, "ok", 2) == 0, "get after a timeout");
    r = ddp_store_wait(s, two, 2, 0.2);
    CHECK(r == DDP_ERR_TIMEOUT && contains(ddp_store_last_error(s), "'w/1', 'w/2'"), "wait: %d %s", (int)r,
          ddp_store_last_error(s));

    /* add keeps decimal text, as torch does */
    CHECK_STORE(ddp_store_add(s, "cnt", 5, &v), s);
    CHECK(v == 5, "add gave %lld", (long long)v);
    CHECK_STORE(ddp_store_add(s, "cnt", -12, &v), s);
    CHECK(v == -7, "add gave %lld", (long long)v);
    CHECK_STORE(ddp_store_get(s, "cnt", buf, sizeof buf, &size), s);
    CHECK(size == 2 && memcmp(buf, "-7", 2) == 0, "counter text '%.*s'", (int)size, buf);
    CHECK_STORE(ddp_store_set(s, "text", "12abc", 5), s);
    CHECK_STORE(ddp_store_add(s, "text", 1, &v), s); /* std::stoll reads the leading number */
    CHECK(v == 13, "add to '12abc' gave %lld", (long long)v);
    CHECK_STORE(ddp_store_set(s, "nan", "abc", 3), s);
    r = ddp_store_add(s, "nan", 1, &v);
    CHECK(r == DDP_ERR_STATE && contains(ddp_store_last_error(s), "not an integer"), "add to 'abc': %d %s", (int)r,
          ddp_store_last_error(s)); /* refused, not disconnected (torch's server drops the client) */
    CHECK_STORE(ddp_store_add(s, "cnt", 7, &v), s);
    CHECK(v == 0, "add after a refused add gave %lld", (long long)v);

    /* check, delete */
    CHECK_STORE(ddp_store_check(s, "cnt", &exists), s);
    CHECK(exists == 1, "check of an existing key");
    CHECK_STORE(ddp_store_check(s, "nope", &exists), s);
    CHECK(exists == 0, "check of a missing key");
    CHECK_STORE(ddp__store_num_keys(s, &nk), s);
    CHECK(nk == 6, "num_keys %lld, expected 6", (long long)nk); /* bin empty after cnt text nan */
    CHECK_STORE(ddp_store_delete(s, "cnt", &deleted), s);
    CHECK(deleted == 1, "first delete");
    CHECK_STORE(ddp_store_delete(s, "cnt", &deleted), s);
    CHECK(deleted == 0, "second delete");
    CHECK_STORE(ddp_store_check(s, "cnt", &exists), s);
    CHECK(exists == 0, "check after delete");

    /* compare_set, torch's semantics */
    CHECK_STORE(ddp__store_compare_set(s, "cas", "", 0, "one", 3, buf, sizeof buf, &size), s);
    CHECK(size == 3 && memcmp(buf, "one", 3) == 0, "compare_set on a missing key with empty expected");
    CHECK_STORE(ddp__store_compare_set(s, "cas", "xxx", 3, "two", 3, buf, sizeof buf, &size), s);
    CHECK(size == 3 && memcmp(buf, "one", 3) == 0, "compare_set with a wrong expected must not change it");
    CHECK_STORE(ddp__store_compare_set(s, "cas", "one", 3, "three", 5, buf, sizeof buf, &size), s);
    CHECK(size == 5 && memcmp(buf, "three", 5) == 0, "compare_set with the right expected");
    CHECK_STORE(ddp__store_compare_set(s, "cas2", "exp", 3, "des", 3, buf, sizeof buf, &size), s);
    CHECK(size == 3 && memcmp(buf, "exp", 3) == 0, "compare_set on a missing key answers expected");
    CHECK_STORE(ddp_store_check(s, "cas2", &exists), s);
    CHECK(exists == 0, "compare_set with a non-empty expected must not create the key");

    /* a large value, and limits checked before anything is sent */
    big = (unsigned char *)malloc(big_n);
    back = (unsigned char *)malloc(big_n);
    CHECK(big && back, "out of memory");
    fill(big, big_n, 99);
    CHECK_STORE(ddp_store_set(s, "big", big, big_n), s);
    CHECK_STORE(ddp_store_get(s, "big", back, big_n, &size), s);
    CHECK(size == big_n && memcmp(big, back, big_n) == 0, "8 MiB value round trip");
    CHECK_STORE(ddp_store_get(s, "big", big_small, sizeof big_small, &size), s);
    CHECK(size == big_n && memcmp(big_small, big, sizeof big_small) == 0, "8 MiB value into 16 bytes");
    r = ddp_store_set(s, "huge", big, (size_t)65 << 20);
    CHECK(r == DDP_ERR_INVALID_ARGUMENT && contains(ddp_store_last_error(s), "64 MiB"), "65 MiB value: %d %s", (int)r,
          ddp_store_last_error(s));
    free(big);
    free(back);
    r = ddp_store_set(NULL, "k", "v", 1);
    CHECK(r == DDP_ERR_INVALID_ARGUMENT && contains(ddp_store_last_error(NULL), "NULL"), "NULL store");

    /* many keys (the server's table grows several times), and a key shown escaped in a message */
    {
        char key[32];
        int i;
        int64_t before = 0, after = 0;
        CHECK_STORE(ddp__store_num_keys(s, &before), s);
        for (i = 0; i < 1000; i++) {
            snprintf(key, sizeof key, "many/%d", i);
            CHECK_STORE(ddp_store_set(s, key, &i, sizeof i), s);
        }
        for (i = 0; i < 1000; i++) {
            int back = -1;
            snprintf(key, sizeof key, "many/%d", (i * 7919) % 1000);
            CHECK_STORE(ddp_store_get(s, key, &back, sizeof back, &size), s);
            CHECK(size == sizeof back && back == (i * 7919) % 1000, "%s holds %d", key, back);
        }
        CHECK_STORE(ddp__store_num_keys(s, &after), s);
        CHECK(after == before + 1000, "num_keys %lld after adding 1000 to %lld", (long long)after, (long long)before);
        ddp__store_set_timeout(s, 0.1);
        r = ddp_store_get(s, "odd\x01key", buf, sizeof buf, &size);
        CHECK(r == DDP_ERR_TIMEOUT && contains(ddp_store_last_error(s), "'odd\\x01key'"), "escaped key: %s",
              ddp_store_last_error(s));
        ddp__store_set_timeout(s, 30);
    }

    /* prefixes keep handles apart; the torch prefix is "/" + PrefixStore's prefix + "/" */
    CHECK(ddp__store_connect("127.0.0.1", port, "a/", 5, &a, err) == DDP_SUCCESS, "%s", err);
    CHECK(ddp__store_connect("127.0.0.1", port, "b/", 5, &b, err) == DDP_SUCCESS, "%s", err);
    CHECK_STORE(ddp_store_set(a, "k", "A", 1), a);
    CHECK_STORE(ddp_store_set(b, "k", "B", 1), b);
    CHECK_STORE(ddp_store_get(s, "a/k", buf, sizeof buf, &size), s);
    CHECK(size == 1 && buf[0] == 'A', "prefix a/");
    CHECK_STORE(ddp_store_get(b, "k", buf, sizeof buf, &size), b);
    CHECK(size == 1 && buf[0] == 'B', "prefix b/");
    ddp__store_free(a);
    ddp__store_free(b);
    CHECK(ddp__store_torch_prefix("/worker/attempt_0", buf, sizeof buf) == 0 && strcmp(buf, "//worker/attempt_0/") == 0,
          "torch prefix '%s'", buf);
    CHECK(ddp__store_torch_prefix(NULL, buf, sizeof buf) == 0 && strcmp(buf, "/") == 0, "torch prefix '%s'", buf);
    CHECK(ddp__store_torch_prefix("/worker/attempt_0", buf, 8) == -1, "short buffer");

    /* WAIT is answered when SET, ADD or COMPARE_SET creates the keys, and not before */
    {
        int fd = raw_connect(port);
        unsigned char reply = 9;
        msg m;
        m.n = 0;
        m_byte(&m, 5);
        m_u64(&m, 3);
        m_str(&m, "wk/set");
        m_str(&m, "wk/add");
        m_str(&m, "wk/cas");
        raw_send(fd, m.b, m.n);
        CHECK_STORE(ddp_store_set(s, "wk/set", "x", 1), s);
        CHECK_STORE(ddp_store_add(s, "wk/add", 1, &v), s);
        CHECK_STORE(ddp_store_check(s, "wk/set", &exists), s); /* a round trip: the server has seen both */
        {
            struct timeval tv = {0, 200000};
            char tmp;
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            CHECK(recv(fd, &tmp, 1, 0) < 0, "WAIT answered before its last key existed");
            tv.tv_sec = 10;
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        }
        CHECK_STORE(ddp__store_compare_set(s, "wk/cas", "", 0, "y", 1, buf, sizeof buf, &size), s);
        raw_recv(fd, &reply, 1);
        CHECK(reply == 0, "WAIT answered %u", reply);
        close(fd);
    }

    ddp__store_free(s);
    ddp__store_server_stop(srv);
}

/* ---- hostile and odd clients: disconnected, while the others go on ---- */

static void good_client_works(ddp_store *s, const char *tag) {
    char buf[128];
    size_t size = 0;
    CHECK_STORE(ddp_store_set(s, tag, tag, strlen(tag)), s);
    CHECK_STORE(ddp_store_get(s, tag, buf, sizeof buf, &size), s);
    CHECK(size == strlen(tag) && memcmp(buf, tag, size) == 0, "good client after %s", tag);
}

static void expect_dropped(int port, ddp_store *good, const msg *m, const char *what) {
    int fd = raw_connect(port);
    raw_send(fd, m->b, m->n);
    CHECK(raw_closed(fd), "the server kept a client that %s", what);
    close(fd);
    good_client_works(good, what);
}

static void test_hostile(void) {
    ddp__store_server *srv;
    ddp_store *good;
    char err[DDP__ERR_MAX];
    int port, fd, i;
    msg m;

    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_DEFAULT, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    CHECK(ddp__store_connect("127.0.0.1", port, NULL, 10, &good, err) == DDP_SUCCESS, "%s", err);
    fprintf(stderr, "(the warnings below about disconnected clients are expected)\n");

    m.n = 0; /* SET with a 1 TiB key */
    m_byte(&m, 0);
    m_u64(&m, (uint64_t)1 << 40);
    expect_dropped(port, good, &m, "sent a 1 TiB key length");
    m.n = 0; /* SET with a 65 MiB value */
    m_byte(&m, 0);
    m_str(&m, "k");
    m_u64(&m, (uint64_t)65 << 20);
    expect_dropped(port, good, &m, "sent a 65 MiB value length");
    m.n = 0; /* WAIT on a billion keys */
    m_byte(&m, 5);
    m_u64(&m, (uint64_t)1 << 30);
    expect_dropped(port, good, &m, "waited on 2^30 keys");
    m.n = 0;
    m_byte(&m, 0xFF);
    expect_dropped(port, good, &m, "sent query type 0xff");
    m.n = 0;
    m_byte(&m, 7);
    m_str(&m, "k");
    expect_dropped(port, good, &m, "asked for watch_key");
    m.n = 0;
    m_byte(&m, 2);
    m_str(&m, "never/set");
    expect_dropped(port, good, &m, "got a missing key without waiting");

    /* clients that announce large values and send little of them hold no large buffers: 31 x 33 MiB announced
       is all but the last MiB of the server's 1 GiB budget, yet a real 1 MiB value still goes through */
    {
        int fds[31];
        size_t mb = (size_t)1 << 20;
        unsigned char *val = (unsigned char *)malloc(mb), *got = (unsigned char *)malloc(mb);
        size_t size = 0;
        CHECK(val && got, "out of memory");
        m.n = 0;
        m_byte(&m, 0);
        m_str(&m, "announced");
        m_u64(&m, (uint64_t)33 << 20);
        for (i = 0; i < 31; i++) {
            fds[i] = raw_connect(port);
            raw_send(fds[i], m.b, m.n);
        }
        good_client_works(good, "after 31 clients announced 33 MiB values"); /* a round trip: headers seen */
        for (i = 0; i < 31; i++) raw_send(fds[i], "v", 1);                    /* and the first value bytes */
        good_client_works(good, "after 31 clients sent a byte of 33 MiB values");
        fill(val, mb, 5);
        CHECK_STORE(ddp_store_set(good, "one_mib", val, mb), good);
        CHECK_STORE(ddp_store_get(good, "one_mib", got, mb, &size), good);
        CHECK(size == mb && memcmp(got, val, mb) == 0, "1 MiB value beside announced ones");
        for (i = 0; i < 31; i++) close(fds[i]);
        free(val);
        free(got);
    }

    /* a client holding half a request does not hold up the others */
    fd = raw_connect(port);
    m.n = 0;
    m_byte(&m, 0);
    m_str(&m, "half");
    m_u64(&m, 100);
    raw_send(fd, m.b, m.n);
    good_client_works(good, "while another client sends half a request");

    /* one byte at a time, then a pipelined burst: SET, ADD, WAIT, GET, CHECK, DELETE in one send */
    {
        unsigned char sent_val[100], got[100], b1;
        int64_t v;
        uint64_t len;
        fill(sent_val, sizeof sent_val, 3);
        for (i = 0; i < (int)sizeof sent_val; i++) raw_send(fd, &sent_val[i], 1);
        m.n = 0;
        m_byte(&m, 3);
        m_str(&m, "n");
        m_u64(&m, 41);
        m_byte(&m, 5);
        m_u64(&m, 1);
        m_str(&m, "half");
        m_byte(&m, 2);
        m_str(&m, "half");
        m_byte(&m, 4);
        m_u64(&m, 2);
        m_str(&m, "half");
        m_str(&m, "absent");
        m_byte(&m, 8);
        m_str(&m, "n");
        m_byte(&m, 6);
        for (i = 0; i < (int)m.n; i++) raw_send(fd, &m.b[i], 1);
        raw_recv(fd, &v, 8);
        CHECK(v == 41, "ADD answered %lld", (long long)v);
        raw_recv(fd, &b1, 1);
        CHECK(b1 == 0, "WAIT answered %u", b1);
        raw_recv(fd, &len, 8);
        CHECK(len == sizeof sent_val, "GET length %llu", (unsigned long long)len);
        raw_recv(fd, got, sizeof got);
        check_value(got, sizeof got, 3, "value sent a byte at a time");
        raw_recv(fd, &b1, 1);
        CHECK(b1 == 1, "CHECK with a missing key answered %u", b1);
        raw_recv(fd, &v, 8);
        CHECK(v == 1, "DELETE answered %lld", (long long)v);
        raw_recv(fd, &v, 8);
        CHECK(v >= 2, "GETNUMKEYS answered %lld", (long long)v);
    }
    close(fd);

    /* a client that asks for 40 MiB of replies before reading any: the server stops reading its requests
       while the replies pile up, keeps serving the others, and sends everything once it reads */
    {
        size_t mb = (size_t)1 << 20;
        unsigned char *val = (unsigned char *)malloc(mb), *got = (unsigned char *)malloc(mb);
        CHECK(val && got, "out of memory");
        fill(val, mb, 77);
        CHECK_STORE(ddp_store_set(good, "mb", val, mb), good);
        fd = raw_connect(port);
        m.n = 0;
        m_byte(&m, 2);
        m_str(&m, "mb");
        for (i = 0; i < 40; i++) raw_send(fd, m.b, m.n);
        good_client_works(good, "while replies pile up for another client");
        for (i = 0; i < 40; i++) {
            uint64_t len = 0;
            raw_recv(fd, &len, 8);
            CHECK(len == mb, "reply %d: length %llu", i, (unsigned long long)len);
            raw_recv(fd, got, mb);
            CHECK(memcmp(got, val, mb) == 0, "reply %d differs", i);
        }
        close(fd);
        free(val);
        free(got);
    }

    /* a waiting client that goes away, and many that come and go */
    fd = raw_connect(port);
    m.n = 0;
    m_byte(&m, 5);
    m_u64(&m, 1);
    m_str(&m, "gone/key");
    raw_send(fd, m.b, m.n);
    close(fd);
    for (i = 0; i < 50; i++) close(raw_connect(port));
    good_client_works(good, "gone/key");

    ddp__store_free(good);
    ddp__store_server_stop(srv);
}

/* ---- the budget: shares, the reserve for small keys, refusals that leave the connection up ---- */

#define BUDGET ((size_t)8 << 20) /* DDP_STORE_MAX_BYTES for this test: a share and the reserve are 1 MiB each */
#define BIG ((size_t)200 << 10)  /* a value too large for the reserve (entries up to 64 KiB may use it) */

static ddp_store *budget_client(int port) {
    ddp_store *s = NULL;
    char err[DDP__ERR_MAX];
    CHECK(ddp__store_connect("127.0.0.1", port, NULL, 10, &s, err) == DDP_SUCCESS, "connect: %s", err);
    return s;
}

/* Set BIG-byte values "tag/0", "tag/1", ... until the store refuses one; returns how many it took. The refusal
   must be "store full" (not a lost connection), and the connection must still work after it. */
static int fill_until_full(ddp_store *s, const char *tag, const unsigned char *val, const char *why) {
    char key[64];
    ddp_result r = DDP_SUCCESS;
    int i, exists = 1;
    for (i = 0; i < 64; i++) {
        snprintf(key, sizeof key, "%s/%d", tag, i);
        if ((r = ddp_store_set(s, key, val, BIG)) != DDP_SUCCESS) break;
    }
    CHECK(r == DDP_ERR_OUT_OF_MEMORY && contains(ddp_store_last_error(s), "is full") &&
              contains(ddp_store_last_error(s), why) && contains(ddp_store_last_error(s), key),
          "%s: set %d returned %d (%s): %s", tag, i, (int)r, ddp_result_string(r), ddp_store_last_error(s));
    CHECK_STORE(ddp_store_check(s, key, &exists), s); /* the same connection, still in step */
    CHECK(exists == 0, "%s: the refused key %s was stored", tag, key);
    return i;
}

static void test_budget(void) {
    ddp__store_server *srv;
    ddp_store *a, *b, *c[12], *rank;
    char err[DDP__ERR_MAX], budget[32], buf[64];
    unsigned char *val = (unsigned char *)malloc(BIG), *got = (unsigned char *)malloc(BIG);
    size_t size = 0, share = BUDGET / 8, entry_max = BIG + 64 + 128; /* value, key, at most 128 bytes of bookkeeping */
    int port, i, n, stored = 0, by_budget = 0;
    int64_t v = 0;
    ddp_result r;
    int exists = 1;

    CHECK(val && got, "out of memory");
    fill(val, BIG, 11);
    snprintf(budget, sizeof budget, "%zu", BUDGET);
    setenv("DDP_STORE_MAX_BYTES", budget, 1);
    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_ERROR, &srv, err), NULL);
    unsetenv("DDP_STORE_MAX_BYTES");
    port = ddp__store_server_port(srv);

    /* one client fills its share (1 MiB: 5 values of 200 KiB and their keys): the 6th set is refused as
       "store full", and the same connection still reads its keys and sets small ones */
    a = budget_client(port);
    n = fill_until_full(a, "a", val, "share");
    fprintf(stderr, "a refusal as the client reports it: %s\n", ddp_store_last_error(a));
    CHECK(contains(ddp_store_last_error(a), "share, 1.0 MiB") && contains(ddp_store_last_error(a), "budget of 8.0 MiB"),
          "the refusal does not give the share and the budget: %s", ddp_store_last_error(a));
    CHECK(n == (int)(share / (BIG + 64 + 128)) || n == (int)(share / BIG), "client a stored %d values of %zu bytes in "
          "a share of %zu bytes", n, BIG, share);
    CHECK_STORE(ddp_store_get(a, "a/0", got, BIG, &size), a);
    CHECK(size == BIG && memcmp(got, val, BIG) == 0, "a/0 after the refusal");
    CHECK_STORE(ddp_store_set(a, "a/small", "s", 1), a);
    /* a second client is served as if nothing happened */
    b = budget_client(port);
    CHECK_STORE(ddp_store_set(b, "b/0", val, BIG), b);
    CHECK_STORE(ddp_store_get(b, "b/0", got, BIG, &size), b);
    CHECK(size == BIG && memcmp(got, val, BIG) == 0, "b/0");
    /* deleting gives the share back, and so does another client overwriting one of a's keys */
    CHECK_STORE(ddp_store_delete(a, "a/0", NULL), a);
    CHECK_STORE(ddp_store_set(a, "a/again", val, BIG), a);
    r = ddp_store_set(a, "a/over", val, BIG);
    CHECK(r == DDP_ERR_OUT_OF_MEMORY, "a over its share again: %d %s", (int)r, ddp_store_last_error(a));
    CHECK_STORE(ddp_store_set(b, "a/1", "b", 1), b);
    CHECK_STORE(ddp_store_set(a, "a/over", val, BIG), a);

    /* many clients of big values fill the store up to its budget less the reserve (7 MiB), never more */
    for (i = 0; i < 12; i++) {
        char tag[16];
        snprintf(tag, sizeof tag, "c%d", i);
        c[i] = budget_client(port);
        CHECK_STORE(ddp_store_set(c[i], "small", "x", 1), c[i]); /* small keys fit all along */
        n = fill_until_full(c[i], tag, val, "");
        stored += n;
        if (!contains(ddp_store_last_error(c[i]), "share")) by_budget++;
        CHECK(n <= (int)(share / BIG), "client %s stored %d values", tag, n);
    }
    stored += (int)(share / BIG) + 1; /* a's five, less a/0 and a/1 (b made it 1 byte), plus a/again, a/over, b/0 */
    CHECK(by_budget > 0, "no client was refused for the store's budget");
    /* less than a value's room may be left, and the refused request's own input buffer counts too */
    CHECK((size_t)stored * BIG <= BUDGET - BUDGET / 8 && (size_t)stored * entry_max > BUDGET - BUDGET / 8 - 3 * BIG,
          "%d values of %zu bytes stored in a budget of %zu less its reserve", stored, BIG, BUDGET);
    /* a rank (a fresh client) still meets the others: small keys and counters go into the reserve */
    rank = budget_client(port);
    r = ddp_store_set(rank, "rank/big", val, BIG);
    CHECK(r == DDP_ERR_OUT_OF_MEMORY && contains(ddp_store_last_error(rank), "is full"), "big set into a full store: "
          "%d %s", (int)r, ddp_store_last_error(rank));
    CHECK_STORE(ddp_store_set(rank, "rank/addr", "127.0.0.1:29500", 15), rank);
    CHECK_STORE(ddp_store_get(rank, "rank/addr", buf, sizeof buf, &size), rank);
    CHECK(size == 15 && memcmp(buf, "127.0.0.1:29500", 15) == 0, "rank/addr");
    CHECK_STORE(ddp_store_add(rank, "rank/count", 3, &v), rank);
    CHECK(v == 3, "add in a full store gave %lld", (long long)v);

    /* clients that leave keep their keys (as torch's store does), and those keys still count */
    for (i = 0; i < 12; i++) ddp__store_free(c[i]);
    CHECK_STORE(ddp_store_get(rank, "c0/0", got, BIG, &size), rank);
    CHECK(size == BIG && memcmp(got, val, BIG) == 0, "c0/0 after its writer left");
    r = ddp_store_set(rank, "rank/big", val, BIG);
    CHECK(r == DDP_ERR_OUT_OF_MEMORY, "big set after the fillers left: %d %s", (int)r, ddp_store_last_error(rank));
    for (i = 0; i < 12; i++) { /* deleting a leaver's keys makes room again */
        char key[32];
        snprintf(key, sizeof key, "c%d/0", i);
        CHECK_STORE(ddp_store_delete(rank, key, NULL), rank);
    }
    CHECK_STORE(ddp_store_set(rank, "rank/big", val, BIG), rank);
    CHECK_STORE(ddp_store_check(rank, "rank/big", &exists), rank);
    CHECK(exists == 1, "rank/big");

    /* a client that cannot hear a refusal (torch's, or an older ddp.h's) is disconnected instead, with the
       writes before the refused one kept */
    {
        int fd = raw_connect(port);
        char key[16];
        msg m;
        for (i = 0; i <= (int)(share / BIG); i++) {
            snprintf(key, sizeof key, "raw/%d", i);
            m.n = 0;
            m_byte(&m, 0);
            m_str(&m, key);
            m_u64(&m, BIG);
            raw_send(fd, m.b, m.n);
            raw_send(fd, val, BIG);
            if (i < (int)(share / BIG)) { /* one at a time: GETNUMKEYS answers once the SET is done */
                int64_t keys = 0;
                m.n = 0;
                m_byte(&m, 6);
                raw_send(fd, m.b, m.n);
                raw_recv(fd, &keys, 8);
            }
        }
        CHECK(raw_closed(fd), "the server kept a client that cannot hear a refusal, after refusing it");
        close(fd);
        CHECK_STORE(ddp_store_check(rank, "raw/0", &exists), rank);
        CHECK(exists == 1, "raw/0 was not stored");
        CHECK_STORE(ddp_store_check(rank, key, &exists), rank);
        CHECK(exists == 0, "%s (over the raw client's share) was stored", key);
    }
    ddp__store_free(a);
    ddp__store_free(b);
    ddp__store_free(rank);
    ddp__store_server_stop(srv);
    free(val);
    free(got);
}

/* ---- ADD refuses to overflow int64 (torch's wraps around) ---- */

static void test_add_overflow(ddp_store *s, const char *kind) {
    char buf[32];
    size_t size = 0;
    int64_t v = 0;
    ddp_result r;
    CHECK_STORE(ddp_store_add(s, "ovf/up", INT64_MAX - 1, &v), s);
    CHECK_STORE(ddp_store_add(s, "ovf/up", 1, &v), s);
    CHECK(v == INT64_MAX, "%s: add up to INT64_MAX gave %lld", kind, (long long)v);
    r = ddp_store_add(s, "ovf/up", 1, &v);
    CHECK(r == DDP_ERR_INVALID_ARGUMENT && contains(ddp_store_last_error(s), "overflow") &&
              contains(ddp_store_last_error(s), "9223372036854775807"),
          "%s: add past INT64_MAX returned %d: %s", kind, (int)r, ddp_store_last_error(s));
    CHECK_STORE(ddp_store_get(s, "ovf/up", buf, sizeof buf, &size), s);
    CHECK(size == 19 && memcmp(buf, "9223372036854775807", 19) == 0, "%s: after a refused add the value is '%.*s'",
          kind, (int)size, buf);
    CHECK_STORE(ddp_store_add(s, "ovf/down", INT64_MIN, &v), s);
    r = ddp_store_add(s, "ovf/down", -1, &v);
    CHECK(r == DDP_ERR_INVALID_ARGUMENT && contains(ddp_store_last_error(s), "overflow"), "%s: add below INT64_MIN "
          "returned %d: %s", kind, (int)r, ddp_store_last_error(s));
    CHECK_STORE(ddp_store_add(s, "ovf/down", 5, &v), s); /* the same connection goes on */
    CHECK(v == INT64_MIN + 5, "%s: add after a refused one gave %lld", kind, (long long)v);
}

/* The status byte on the wire, spoken by hand: CHECK of the announcing key, then the request. */
static void test_status_wire(void) {
    ddp__store_server *srv;
    char err[DDP__ERR_MAX], why[512];
    ddp_store *s;
    unsigned char b = 0xEE;
    int32_t code = 0;
    uint64_t len = 0;
    int64_t v = 0;
    int fd, port;
    msg m;
    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_ERROR, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    fd = raw_connect(port);
    m.n = 0;
    m_byte(&m, 4); /* CHECK, 1 key: "\0ddp.h/status" */
    m_u64(&m, 1);
    m_u64(&m, 13);
    memcpy(m.b + m.n, "\0ddp.h/status", 13);
    m.n += 13;
    m_byte(&m, 0); /* SET n = 9223372036854775807 */
    m_str(&m, "n");
    m_str(&m, "9223372036854775807");
    raw_send(fd, m.b, m.n);
    raw_recv(fd, &b, 1);
    CHECK(b == 0, "announced SET: status %u", b);
    m.n -= 1 + 8 + 1 + 8 + 19; /* keep the CHECK: now an ADD of 1 */
    m_byte(&m, 3);
    m_str(&m, "n");
    m_u64(&m, 1);
    raw_send(fd, m.b, m.n);
    raw_recv(fd, &b, 1);
    raw_recv(fd, &code, 4);
    raw_recv(fd, &len, 8);
    CHECK(b == 2 && code == DDP_ERR_INVALID_ARGUMENT && len > 0 && len < sizeof why, "refused ADD: status %u code %d "
          "length %llu", b, (int)code, (unsigned long long)len);
    raw_recv(fd, why, (size_t)len);
    why[len] = '\0';
    CHECK(contains(why, "overflow int64"), "refusal text: %s", why);
    m.n = 0; /* the connection is in step: an unannounced ADD gets its plain answer */
    m_byte(&m, 3);
    m_str(&m, "m");
    m_u64(&m, 4);
    raw_send(fd, m.b, m.n);
    raw_recv(fd, &v, 8);
    CHECK(v == 4, "ADD after a refusal answered %lld", (long long)v);
    m.n = 0; /* an unannounced ADD that overflows: disconnected, as torch's client cannot hear a refusal */
    m_byte(&m, 3);
    m_str(&m, "n");
    m_u64(&m, 1);
    raw_send(fd, m.b, m.n);
    CHECK(raw_closed(fd), "the server kept a client whose unannounced ADD overflowed");
    close(fd);
    s = budget_client(port);
    test_add_overflow(s, "tcp store");
    ddp__store_free(s);
    ddp__store_server_stop(srv);
}

/* ---- connecting and serving errors ---- */

/* Issue #35 item 2: a stopping server closes its listener before its clients' connections, so a client
   that sees its connection close and dials again at once (a rank going from ddp_destroy to its next
   ddp_init) is refused, and retries, instead of reaching the dying server's listen queue and being reset
   mid-request. Its keys (10,000 of them here, freed only after that) hold the old order's window open. ddp__store_await_close sees the
   close; rank 0's own client (ddp__store_mark_own) then does not ask whether rank 0 exited. */
static void *stop_server(void *srv) { /* as rank 0 would, in another process */
    ddp__store_server_stop((ddp__store_server *)srv);
    return NULL;
}

static void test_stop_order(void) {
    ddp__store_server *srv;
    ddp_store *own = NULL, *other = NULL;
    char err[DDP__ERR_MAX], key[32];
    struct sockaddr_in a;
    int port, i, fd, rc, e;
    double t0;
    pthread_t stopper;
    ddp_result r;
    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_DEFAULT, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    CHECK(ddp__store_connect("127.0.0.1", port, NULL, 5, &own, err) == DDP_SUCCESS, "%s", err);
    CHECK(ddp__store_connect("127.0.0.1", port, NULL, 5, &other, err) == DDP_SUCCESS, "%s", err);
    ddp__store_mark_own(own);
    for (i = 0; i < 10000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        CHECK_STORE(ddp_store_set(own, key, "v", 1), own);
    }
    CHECK_STORE(ddp_store_set(other, "x", "1", 1), other);
    CHECK(ddp__store_await_close(other, 0.05) == 0, "ddp__store_await_close: a running server's connection closed");
    CHECK(pthread_create(&stopper, NULL, stop_server, srv) == 0, "pthread_create failed");
    t0 = tl_now();
    CHECK(ddp__store_await_close(other, 5) == 1, "ddp__store_await_close: the stopped server's connection still open");
    CHECK(tl_now() - t0 < 1.0, "ddp__store_await_close took %.2f s", tl_now() - t0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM, 0);
    rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    e = errno;
    close(fd);
    pthread_join(stopper, NULL);
    CHECK(rc != 0 && e == ECONNREFUSED, "dialing a stopped server's port right after its connection closed: %s "
          "(expected a refusal: the listener closes first)", rc == 0 ? "connected" : strerror(e));
    r = ddp_store_set(own, "y", "1", 1);
    CHECK(r == DDP_ERR_PEER_LOST, "set on a stopped own server: %d %s", (int)r, ddp_store_last_error(own));
    CHECK(contains(ddp_store_last_error(own), "this process (rank 0) serves that store") &&
          !contains(ddp_store_last_error(own), "did rank 0"), "own client's message: %s", ddp_store_last_error(own));
    ddp__store_free(own);
    ddp__store_free(other);
}

static void test_errors(void) {
    ddp__store_server *srv, *second = NULL;
    ddp_store *s = NULL;
    char err[DDP__ERR_MAX];
    double t0;
    int port;
    ddp_result r;

    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_DEFAULT, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    r = ddp__store_server_start("127.0.0.1", port, DDP_LOG_DEFAULT, &second, err);
    CHECK(r == DDP_ERR_INIT && second == NULL && contains(err, "already in use"), "second server on port %d: %d %s",
          port, (int)r, err);
    ddp__store_server_stop(srv);

    r = ddp__store_server_start("192.0.2.1", 0, DDP_LOG_DEFAULT, &second, err); /* TEST-NET: not on this host */
    CHECK(r == DDP_ERR_INIT && contains(err, "not on this host"), "listening on 192.0.2.1: %d %s", (int)r, err);

    port = tl_free_port();
    t0 = tl_now();
    r = ddp__store_connect("127.0.0.1", port, NULL, 0.5, &s, err);
    CHECK(r == DDP_ERR_TIMEOUT && s == NULL, "connecting where nothing listens returned %d: %s", (int)r, err);
    CHECK(tl_now() - t0 < 10.0, "connect gave up only after %.1f s (timeout 0.5 s)", tl_now() - t0);
    CHECK(contains(err, "127.0.0.1") && contains(err, "rank 0"), "message: %s", err);
    r = ddp__store_connect("127.0.0.1", 0, NULL, 0.5, &s, err);
    CHECK(r == DDP_ERR_INVALID_ARGUMENT, "port 0: %d", (int)r);
    test_stop_order();
}

/* ---- several processes: rank 0 serves, after the others have started connecting ---- */

static ddp_store *open_store(int rank, int kind, const char *path) {
    ddp_store *s = NULL;
    char err[DDP__ERR_MAX];
    ddp_result r;
    (void)rank;
    if (kind == 0)
        r = ddp__store_connect("127.0.0.1", atoi(getenv("MASTER_PORT")), "/", 30, &s, err);
    else
        r = ddp__store_open_file(path, 30, &s, err);
    CHECK(r == DDP_SUCCESS, "rank %d: opening the store: %s", rank, err);
    return s;
}

/* The same steps against either kind of store. */
static void exercise(ddp_store *s, int rank, int n) {
    char key[64], buf[64];
    const char *keys[16];
    unsigned char *got;
    size_t size;
    int64_t v = 0;
    int i, exists = -1, deleted = -1;
    ddp_result r;

    got = (unsigned char *)malloc(value_size(n) + 1);
    CHECK(got != NULL, "out of memory");
    {
        unsigned char *val = (unsigned char *)malloc(value_size(rank));
        CHECK(val != NULL, "out of memory");
        fill(val, value_size(rank), 1000 + (uint64_t)rank);
        snprintf(key, sizeof key, "val/%d", rank);
        CHECK_STORE(ddp_store_set(s, key, val, value_size(rank)), s);
        free(val);
    }
    /* every other rank's value, each get blocking until that rank has set it */
    for (i = 0; i < n; i++) {
        snprintf(key, sizeof key, "val/%d", (rank + i) % n);
        CHECK_STORE(ddp_store_get(s, key, got, value_size(n), &size), s);
        CHECK(size == value_size((rank + i) % n), "rank %d: %s has %zu bytes", rank, key, size);
        check_value(got, size, 1000 + (uint64_t)((rank + i) % n), key);
    }
    /* concurrent adds: the final value is the sum */
    for (i = 0; i < 50; i++) CHECK_STORE(ddp_store_add(s, "counter", rank + 1, &v), s);
    store_barrier(s, "b1", n);
    CHECK_STORE(ddp_store_add(s, "counter", 0, &v), s);
    CHECK(v == 50LL * n * (n + 1) / 2, "rank %d: counter %lld, expected %lld", rank, (long long)v,
          50LL * n * (n + 1) / 2);
    CHECK_STORE(ddp_store_get(s, "counter", buf, sizeof buf - 1, &size), s);
    buf[size] = '\0';
    CHECK(atoll(buf) == v, "counter text '%s'", buf);
    /* wait on every rank's key, check */
    for (i = 0; i < n && i < 16; i++) {
        char *k = (char *)malloc(32);
        snprintf(k, 32, "val/%d", i);
        keys[i] = k;
    }
    CHECK_STORE(ddp_store_wait(s, keys, n, 0), s);
    for (i = 0; i < n && i < 16; i++) free((void *)keys[i]);
    CHECK_STORE(ddp_store_check(s, "val/0", &exists), s);
    CHECK(exists == 1, "check val/0");
    /* a key another process sets later */
    if (rank == n - 1) {
        ddp__sleep(0.2);
        CHECK_STORE(ddp_store_set(s, "late", "L8", 2), s);
    }
    if (rank == 1 % n) {
        CHECK_STORE(ddp_store_get(s, "late", buf, sizeof buf, &size), s);
        CHECK(size == 2 && memcmp(buf, "L8", 2) == 0, "late key");
    }
    /* a get that times out */
    if (rank == 0) {
        ddp__store_set_timeout(s, 0.3);
        r = ddp_store_get(s, "never", buf, sizeof buf, &size);
        CHECK(r == DDP_ERR_TIMEOUT && contains(ddp_store_last_error(s), "'never'"), "rank %d: %d %s", rank, (int)r,
              ddp_store_last_error(s));
        ddp__store_set_timeout(s, 30);
    }
    /* compare_set: exactly one rank wins the empty slot */
    {
        char mine[8];
        snprintf(mine, sizeof mine, "r%d", rank);
        CHECK_STORE(ddp__store_compare_set(s, "leader", "", 0, mine, strlen(mine), buf, sizeof buf, &size), s);
        buf[size] = '\0';
        CHECK_STORE(ddp_store_add(s, strcmp(buf, mine) == 0 ? "winners" : "losers", 1, &v), s);
    }
    store_barrier(s, "b2", n);
    CHECK_STORE(ddp_store_add(s, "winners", 0, &v), s);
    CHECK(v == 1, "%lld ranks won compare_set", (long long)v);
    /* delete */
    if (rank == 0) {
        CHECK_STORE(ddp_store_delete(s, "val/0", &deleted), s);
        CHECK(deleted == 1, "delete val/0");
        CHECK_STORE(ddp_store_delete(s, "val/0", &deleted), s);
        CHECK(deleted == 0, "second delete val/0");
    }
    store_barrier(s, "b3", n);
    CHECK_STORE(ddp_store_check(s, "val/0", &exists), s);
    CHECK(exists == 0, "rank %d still sees val/0 after its delete", rank);
    free(got);
}

static int tcp_rank(int rank, int n, void *arg) {
    ddp__store_server *srv = NULL;
    ddp_store *s;
    char err[DDP__ERR_MAX];
    (void)arg;
    if (rank == 0) { /* start late: the others are already trying to connect */
        ddp__sleep(0.3);
        CHECK(ddp__store_server_start("127.0.0.1", atoi(getenv("MASTER_PORT")), DDP_LOG_DEFAULT, &srv, err) ==
                  DDP_SUCCESS, "%s", err);
    }
    s = open_store(rank, 0, NULL);
    exercise(s, rank, n);
    /* Rank 0 serves until everyone is done: each other rank's last call is an add whose answer it has
       received, and rank 0 stops only once it counts them all. (Stopping while a rank still has a request
       on the way would lose it: a barrier's final WAIT is not enough.) */
    if (rank == 0) {
        int64_t left = 0;
        while (left < n - 1) {
            CHECK_STORE(ddp_store_add(s, "left", 0, &left), s);
            if (left < n - 1) ddp__sleep(0.01);
        }
    } else {
        CHECK_STORE(ddp_store_add(s, "left", 1, NULL), s);
    }
    ddp__store_free(s);
    ddp__store_server_stop(srv);
    return 0;
}

static int file_rank(int rank, int n, void *arg) {
    ddp_store *s = open_store(rank, 1, (const char *)arg);
    exercise(s, rank, n);
    store_barrier(s, "end", n);
    ddp__store_free(s);
    return 0;
}

static void test_file_store_errors(const char *dir) {
    char path[512], err[DDP__ERR_MAX];
    ddp_store *s = NULL;
    ddp_result r;
    int fd;
    snprintf(path, sizeof path, "%s/no/such/dir/store", dir);
    r = ddp__store_open_file(path, 1, &s, err);
    CHECK(r == DDP_ERR_IO && contains(err, path), "missing directory: %d %s", (int)r, err);
    snprintf(path, sizeof path, "%s/foreign", dir);
    fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    CHECK(fd >= 0 && write(fd, "hello world", 11) == 11, "writing %s", path);
    close(fd);
    r = ddp__store_open_file(path, 1, &s, err);
    CHECK(r == DDP_ERR_FORMAT && contains(err, "not a ddp.h file store"), "foreign file: %d %s", (int)r, err);
    unlink(path);
    /* a store whose file someone else deleted says so */
    snprintf(path, sizeof path, "%s/deleted", dir);
    CHECK(ddp__store_open_file(path, 1, &s, err) == DDP_SUCCESS, "%s", err);
    unlink(path);
    r = ddp_store_set(s, "k", "v", 1);
    CHECK(r == DDP_ERR_STATE && contains(ddp_store_last_error(s), "deleted"), "deleted file: %d %s", (int)r,
          ddp_store_last_error(s));
    ddp__store_free(s);
    CHECK(access(path, F_OK) != 0, "closing recreated %s", path);
    /* one user: the file goes when it closes */
    snprintf(path, sizeof path, "%s/single", dir);
    CHECK(ddp__store_open_file(path, 1, &s, err) == DDP_SUCCESS, "%s", err);
    CHECK_STORE(ddp_store_set(s, "k", "v", 1), s);
    test_add_overflow(s, "file store");
    ddp__store_free(s);
    CHECK(access(path, F_OK) != 0, "%s still exists after its only user closed it", path);
}

/* Many clients at once (the server runs on epoll, issue #25): 300 clients each WAIT for one key, a quarter
   of them hang up meanwhile (the server takes them out of its set and its list while the others stay),
   one SET wakes every other one, and each then GETs the value in step; the server counted every request. */
#define MANY_CLIENTS 300
static void test_many_waiters(void) {
    ddp__store_server *srv = NULL;
    ddp_store *s = NULL;
    char err[DDP__ERR_MAX];
    static int fds[MANY_CLIENTS];
    int port, i, woken = 0;
    ddp__server_stats before, after;
    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_ERROR, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    for (i = 0; i < MANY_CLIENTS; i++) {
        msg m;
        m.n = 0;
        m_byte(&m, 5), m_u64(&m, 1), m_str(&m, "wake"); /* torch 1.13's WAIT */
        fds[i] = raw_connect(port);
        raw_send(fds[i], m.b, m.n);
        if (i % 4 == 3) close(fds[i]), fds[i] = -1;
    }
    CHECK_OK(ddp__store_connect("127.0.0.1", port, NULL, 10.0, &s, err), NULL);
    ddp__store_server_stats(srv, &before);
    CHECK_OK(ddp_store_set(s, "wake", "up", 2), NULL);
    for (i = 0; i < MANY_CLIENTS; i++) {
        unsigned char b = 9, value[2];
        uint64_t len = 0;
        msg m;
        if (fds[i] < 0) continue;
        raw_recv(fds[i], &b, 1);
        CHECK(b == 0, "client %d: WAIT answered %u, expected 0 (STOP_WAITING)", i, b);
        m.n = 0;
        m_byte(&m, 2), m_str(&m, "wake"); /* GET */
        raw_send(fds[i], m.b, m.n);
        raw_recv(fds[i], &len, 8);
        CHECK(len == 2, "client %d: GET answered a %llu-byte value", i, (unsigned long long)len);
        raw_recv(fds[i], value, 2);
        CHECK(memcmp(value, "up", 2) == 0, "client %d: GET answered another value", i);
        close(fds[i]);
        woken++;
    }
    CHECK(woken == MANY_CLIENTS - MANY_CLIENTS / 4, "%d clients woken", woken);
    ddp__store_server_stats(srv, &after);
    CHECK(after.requests >= before.requests + 1 + (uint64_t)woken, "the server counted %llu requests",
          (unsigned long long)(after.requests - before.requests));
    CHECK(after.connections >= (uint64_t)woken + 1, "the server counted %llu connections; %d clients were woken",
          (unsigned long long)after.connections, woken);
    ddp__store_free(s);
    ddp__store_server_stop(srv);
}

/* The server's own count of what it served (ddp__store_server_stats, which bench/bench_scale.c reads):
   every request sent by hand on two raw connections, one by one and pipelined, is counted once; its
   thread's CPU time is positive and not more than the whole process used. */
static void test_server_stats(void) {
    ddp__store_server *srv;
    ddp__server_stats st;
    char err[DDP__ERR_MAX];
    struct timespec proc;
    int64_t got = 0;
    int fd[2], port, i, k;
    msg m;
    CHECK_OK(ddp__store_server_start("127.0.0.1", 0, DDP_LOG_ERROR, &srv, err), NULL);
    port = ddp__store_server_port(srv);
    ddp__store_server_stats(srv, &st);
    CHECK(st.requests == 0 && st.connections == 0, "a fresh server counts %llu requests, %llu connections",
          (unsigned long long)st.requests, (unsigned long long)st.connections);
    fd[0] = raw_connect(port);
    fd[1] = raw_connect(port);
    for (i = 0; i < 300; i++) { /* 300 ADDs of 1 to "n", alternating connections: the sum is the count */
        m.n = 0;
        m_byte(&m, 3);
        m_str(&m, "n");
        m_u64(&m, 1);
        raw_send(fd[i % 2], m.b, m.n);
        raw_recv(fd[i % 2], &got, 8);
        CHECK(got == i + 1, "ADD %d answered %lld", i + 1, (long long)got);
    }
    m.n = 0;
    for (k = 0; k < 20; k++) m_byte(&m, 3), m_str(&m, "p"), m_u64(&m, 2); /* 20 pipelined in one send */
    raw_send(fd[0], m.b, m.n);
    for (k = 0; k < 20; k++) raw_recv(fd[0], &got, 8);
    CHECK(got == 40, "the last pipelined ADD answered %lld", (long long)got);
    ddp__store_server_stats(srv, &st);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &proc);
    CHECK(st.requests == 320, "the server counted %llu requests; 320 were sent", (unsigned long long)st.requests);
    CHECK(st.connections == 2, "the server counted %llu connections; 2 were made", (unsigned long long)st.connections);
    CHECK(st.cpu_seconds > 0 && st.cpu_seconds <= (double)proc.tv_sec + (double)proc.tv_nsec * 1e-9 + 1e-3,
          "the server thread's CPU time %.6f s is not in (0, the process's %.6f s]", st.cpu_seconds,
          (double)proc.tv_sec + (double)proc.tv_nsec * 1e-9);
    close(fd[0]);
    close(fd[1]);
    ddp__store_server_stop(srv);
}

int main(void) {
    char dir[] = "/tmp/ddp_test_store_XXXXXX", path[512];
    int n;
    signal(SIGPIPE, SIG_IGN);
    test_parse();
    test_parse_v2();
    test_single_process();
    fprintf(stderr, "single process: ok\n");
    test_hostile();
    fprintf(stderr, "hostile clients: ok\n");
    test_errors();
    fprintf(stderr, "errors: ok\n");
    test_budget();
    fprintf(stderr, "budget and shares: ok\n");
    test_status_wire();
    fprintf(stderr, "refusals on the wire, ADD overflow: ok\n");
    test_many_waiters();
    fprintf(stderr, "%d clients waiting at once: ok\n", MANY_CLIENTS);
    test_server_stats();
    fprintf(stderr, "server statistics: ok\n");
    for (n = 1; n <= 4; n += 3) {
        CHECK(tl_run_ranks(n, tcp_rank, NULL, 60) == 0, "tcp store with %d processes failed", n);
        fprintf(stderr, "tcp store, %d processes: ok\n", n);
    }
    CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
    test_file_store_errors(dir);
    snprintf(path, sizeof path, "%s/store", dir);
    CHECK(tl_run_ranks(3, file_rank, path, 60) == 0, "file store with 3 processes failed");
    CHECK(access(path, F_OK) != 0, "the file store %s still exists after every user closed it", path);
    fprintf(stderr, "file store, 3 processes: ok\n");
    rmdir(dir);
    printf("test_store: all passed\n");
    return 0;
}
