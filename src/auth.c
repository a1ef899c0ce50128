/* [SECTION] auth: DDP_AUTH_TOKEN, a shared secret that every connection proves (HMAC-SHA256)

   ddp.h assumes a trusted cluster network, as NCCL and Gloo do (docs/RELIABILITY.md). Setting
   DDP_AUTH_TOKEN to the same secret on every rank makes the store and the rank-to-rank mesh refuse
   connections from processes that do not know it. Both ends prove knowledge of the token without
   sending it, with fresh random nonces so that a recorded exchange cannot be replayed:

       client -> server   "DDPAUTH1" | cn                         (cn: 16 random bytes)
       server -> client   sn | HMAC(token, "server" | cn | sn)     (sn: 16 random bytes)
       client -> server   HMAC(token, "client" | cn | sn)          (only if the server's proof is right)
       server -> client   1 byte: 1 accepted, 0 refused

   A client whose token differs fails at once saying so, and so does the server's side (the store
   logs the refusal and serves the others; a rank's mesh listener refuses the connection). The
   exchange authenticates; it does not encrypt: anyone on the path still sees the traffic. With a token
   set, torch processes cannot join ddp.h's store (torch has no such handshake).

   SHA-256 is FIPS 180-4, HMAC is RFC 2104; tests/test_auth.c checks them against the RFC 4231 vectors. */
#include "internal.h"


/* ---- SHA-256 ---- */

typedef struct ddp__sha256 {
    uint32_t h[8];
    uint64_t bytes;
    unsigned char block[64];
} ddp__sha256;

static uint32_t ddp__rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void ddp__sha256_block(ddp__sha256 *c, const unsigned char *p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
        0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
        0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
        0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
        0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
        0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64], v[8], t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ddp__rotr(w[i - 15], 7) ^ ddp__rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ddp__rotr(w[i - 2], 17) ^ ddp__rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, c->h, sizeof v);
    for (i = 0; i < 64; i++) {
        t1 = v[7] + (ddp__rotr(v[4], 6) ^ ddp__rotr(v[4], 11) ^ ddp__rotr(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + k[i] + w[i];
        t2 = (ddp__rotr(v[0], 2) ^ ddp__rotr(v[0], 13) ^ ddp__rotr(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, 7 * sizeof v[0]);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (i = 0; i < 8; i++) c->h[i] += v[i];
}

static void ddp__sha256_init(ddp__sha256 *c) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, h0, sizeof h0);
    c->bytes = 0;
}

static void ddp__sha256_add(ddp__sha256 *c, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    while (n > 0) {
        size_t at = (size_t)(c->bytes % 64), k = DDP__MIN(n, 64 - at);
        memcpy(c->block + at, p, k);
        c->bytes += k;
        p += k;
        n -= k;
        if (at + k == 64) ddp__sha256_block(c, c->block);
    }
}

static void ddp__sha256_end(ddp__sha256 *c, unsigned char out[32]) {
    unsigned char pad[72];
    uint64_t bits = c->bytes * 8;
    size_t padlen = (size_t)((c->bytes % 64) < 56 ? 56 - c->bytes % 64 : 120 - c->bytes % 64), i;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (i = 0; i < 8; i++) pad[padlen + i] = (unsigned char)(bits >> (56 - 8 * i));
    ddp__sha256_add(c, pad, padlen + 8);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(c->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(c->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(c->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)c->h[i];
    }
}

/* HMAC-SHA256 (RFC 2104) of the concatenation of up to three parts (NULL parts are skipped). */
static void ddp__hmac_sha256(const void *key, size_t key_len, const void *a, size_t an, const void *b, size_t bn,
                             const void *c, size_t cn, unsigned char out[32]) {
    unsigned char k[64], pad[64], inner[32];
    ddp__sha256 h;
    int i;
    memset(k, 0, sizeof k);
    if (key_len > 64) {
        ddp__sha256_init(&h);
        ddp__sha256_add(&h, key, key_len);
        ddp__sha256_end(&h, k);
    } else if (key_len) {
        memcpy(k, key, key_len);
    }
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x36);
    ddp__sha256_init(&h);
    ddp__sha256_add(&h, pad, 64);
    if (a) ddp__sha256_add(&h, a, an);
    if (b) ddp__sha256_add(&h, b, bn);
    if (c) ddp__sha256_add(&h, c, cn);
    ddp__sha256_end(&h, inner);
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k[i] ^ 0x5c);
    ddp__sha256_init(&h);
    ddp__sha256_add(&h, pad, 64);
    ddp__sha256_add(&h, inner, 32);
    ddp__sha256_end(&h, out);
}

/* ---- the handshake ---- */

/* DDP_AUTH_TOKEN, or NULL when authentication is off. */
static const char *ddp__auth_token(void) { return ddp__env("DDP_AUTH_TOKEN"); }

static void ddp__auth_nonce(unsigned char out[DDP__AUTH_NONCE]) {
    static unsigned counter;
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t k = read(fd, out, DDP__AUTH_NONCE);
        got = k > 0 ? (size_t)k : 0;
        close(fd);
    }
    if (got < DDP__AUTH_NONCE) { /* no urandom: time, pid and a counter, hashed (unique, if not secret) */
        unsigned char mac[32];
        double t = ddp__now();
        long pid = (long)getpid();
        counter++;
        ddp__hmac_sha256(&t, sizeof t, &pid, sizeof pid, &counter, sizeof counter, NULL, 0, mac);
        memcpy(out, mac, DDP__AUTH_NONCE);
    }
}

/* The proof one side gives: HMAC(token, label | cn | sn). */
static void ddp__auth_proof(const char *token, const char *label, const unsigned char *cn, const unsigned char *sn,
                            unsigned char out[DDP__AUTH_MAC]) {
    ddp__hmac_sha256(token, strlen(token), label, strlen(label), cn, DDP__AUTH_NONCE, sn, DDP__AUTH_NONCE, out);
}

/* Compare without an early exit, so the time taken says nothing about where the bytes differ. */
static int ddp__auth_equal(const unsigned char *a, const unsigned char *b, size_t n) {
    unsigned char d = 0;
    size_t i;
    for (i = 0; i < n; i++) d = (unsigned char)(d | (a[i] ^ b[i]));
    return d == 0;
}

/* Client side, blocking, on a fresh connection to `who` ("the store at h:p", "rank 3 at h:p"). */
static ddp_result ddp__auth_client(int fd, const char *token, const char *who, double deadline, char *err) {
    unsigned char hello[8 + DDP__AUTH_NONCE], reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], want[DDP__AUTH_MAC], verdict = 0;
    char why[DDP__ERR_MAX];
    memcpy(hello, DDP__AUTH_MAGIC, 8);
    ddp__auth_nonce(hello + 8);
    if (ddp__net_send(fd, hello, sizeof hello, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, reply, sizeof reply, deadline, why) != DDP_SUCCESS)
        return ddp__fail_to(err, DDP_ERR_INIT, "DDP_AUTH_TOKEN is set, but %s did not answer the authentication (%s): "
                            "does its process run without DDP_AUTH_TOKEN (every rank needs the same token), or is it another program "
                            "that does not speak ddp.h's protocols?", who, why);
    ddp__auth_proof(token, "server", hello + 8, reply, want);
    if (!ddp__auth_equal(want, reply + DDP__AUTH_NONCE, DDP__AUTH_MAC))
        return ddp__fail_to(err, DDP_ERR_INIT, "%s does not know this process's DDP_AUTH_TOKEN (its proof is wrong): every "
                            "rank needs the same token; refusing to talk to it", who);
    ddp__auth_proof(token, "client", hello + 8, reply, want);
    if (ddp__net_send(fd, want, sizeof want, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, &verdict, 1, deadline, why) != DDP_SUCCESS || verdict != 1)
        return ddp__fail_to(err, DDP_ERR_INIT, "%s refused this process's DDP_AUTH_TOKEN: every rank needs the same token", who);
    return DDP_SUCCESS;
}

/* Server side, step 1: hello (8 + 16 bytes) -> reply (16 + 32 bytes); keeps cn and sn for step 2.
   0, or -1 when hello is not an authentication hello. */
static int ddp__auth_answer(const char *token, const unsigned char *hello, unsigned char *cn, unsigned char *sn,
                            unsigned char *reply) {
    if (memcmp(hello, DDP__AUTH_MAGIC, 8) != 0) return -1;
    memcpy(cn, hello + 8, DDP__AUTH_NONCE);
    ddp__auth_nonce(sn);
    memcpy(reply, sn, DDP__AUTH_NONCE);
    ddp__auth_proof(token, "server", cn, sn, reply + DDP__AUTH_NONCE);
    return 0;
}

/* Server side, step 2: is the client's proof right? */
static int ddp__auth_check(const char *token, const unsigned char *cn, const unsigned char *sn, const unsigned char *proof) {
    unsigned char want[DDP__AUTH_MAC];
    ddp__auth_proof(token, "client", cn, sn, want);
    return ddp__auth_equal(want, proof, DDP__AUTH_MAC);
}

/* Server side, blocking (a rank's mesh listener): 0 when the client proved the token, else -1 with
   the reason in err. */
static int ddp__auth_server(int fd, const char *token, double deadline, char *err) {
    unsigned char hello[8 + DDP__AUTH_NONCE], reply[DDP__AUTH_NONCE + DDP__AUTH_MAC], proof[DDP__AUTH_MAC];
    unsigned char cn[DDP__AUTH_NONCE], sn[DDP__AUTH_NONCE], verdict;
    char why[DDP__ERR_MAX];
    if (ddp__net_recv(fd, hello, sizeof hello, deadline, why) != DDP_SUCCESS || ddp__auth_answer(token, hello, cn, sn, reply) != 0) {
        snprintf(err, DDP__ERR_MAX, "it did not authenticate (no DDP_AUTH_TOKEN on its side?)");
        return -1;
    }
    if (ddp__net_send(fd, reply, sizeof reply, deadline, why) != DDP_SUCCESS ||
        ddp__net_recv(fd, proof, sizeof proof, deadline, why) != DDP_SUCCESS) {
        snprintf(err, DDP__ERR_MAX, "it broke off the authentication (%.900s)", why);
        return -1;
    }
    verdict = (unsigned char)ddp__auth_check(token, cn, sn, proof);
    ddp__net_send(fd, &verdict, 1, deadline, why);
    if (!verdict) snprintf(err, DDP__ERR_MAX, "its DDP_AUTH_TOKEN is different");
    return verdict ? 0 : -1;
}
