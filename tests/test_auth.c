/* DDP_AUTH_TOKEN (src/auth.c): SHA-256 and HMAC-SHA256 against the published vectors (FIPS 180-4
   examples, RFC 4231), then real ranks: the same token on every rank forms the group (store and mesh,
   both transports); a rank with another token, or with none, is refused with a message that says so,
   and the ranks that wait for it fail at their timeout instead of hanging. */
#include "testlib.h"

static void hex(const unsigned char *p, size_t n, char *out) {
    size_t i;
    for (i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", p[i]);
}

static void check_sha256(const char *msg, size_t n, const char *want) {
    ddp__sha256 c;
    unsigned char d[32];
    char got[65];
    ddp__sha256_init(&c);
    ddp__sha256_add(&c, msg, n);
    ddp__sha256_end(&c, d);
    hex(d, 32, got);
    CHECK(strcmp(got, want) == 0, "sha256 of %zu bytes: %s, want %s", n, got, want);
}

static void check_hmac(const unsigned char *key, size_t kn, const char *data, size_t dn, const char *want) {
    unsigned char d[32];
    char got[65];
    ddp__hmac_sha256(key, kn, data, dn, NULL, 0, NULL, 0, d);
    hex(d, 32, got);
    CHECK(strncmp(got, want, strlen(want)) == 0, "hmac (key %zu bytes, data %zu bytes): %s, want %s", kn, dn, got, want);
}

static void test_vectors(void) {
    unsigned char k20[20], k131[131], kaa[20];
    char million[1000];
    ddp__sha256 c;
    unsigned char d[32];
    char got[65];
    int i;
    check_sha256("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    check_sha256("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    check_sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 56,
                 "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    memset(million, 'a', sizeof million); /* one million 'a', fed in pieces of 1000 */
    ddp__sha256_init(&c);
    for (i = 0; i < 1000; i++) ddp__sha256_add(&c, million, sizeof million);
    ddp__sha256_end(&c, d);
    hex(d, 32, got);
    CHECK(strcmp(got, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0, "sha256 of 1M 'a': %s", got);
    /* RFC 4231 test cases 1, 2, 3, 5 (truncated to 128 bits), 6 and 7 */
    memset(k20, 0x0b, sizeof k20);
    check_hmac(k20, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    check_hmac((const unsigned char *)"Jefe", 4, "what do ya want for nothing?", 28,
               "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    memset(kaa, 0xaa, sizeof kaa);
    {
        char dd[50];
        memset(dd, 0xdd, sizeof dd);
        check_hmac(kaa, 20, dd, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
    }
    memset(k20, 0x0c, sizeof k20);
    check_hmac(k20, 20, "Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b");
    memset(k131, 0xaa, sizeof k131);
    check_hmac(k131, 131, "Test Using Larger Than Block-Size Key - Hash Key First", 54,
               "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    check_hmac(k131, 131,
               "This is a test using a larger than block-size key and a larger than block-size data. The key needs to be "
               "hashed before being used by the HMAC algorithm.", 152,
               "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
    printf("sha256 (FIPS 180-4 examples) and HMAC-SHA256 (RFC 4231 cases 1-3, 5-7): ok\n");
}

typedef struct plan {
    const char *token[4]; /* per rank; NULL = unset */
    const char *transport;
} plan;

static int join_and_reduce(int rank, int n, void *arg) {
    const plan *p = (const plan *)arg;
    ddp_init_desc d;
    ddp_group *g;
    double v = rank + 1;
    memset(&d, 0, sizeof d);
    d.timeout_seconds = 3;
    d.log_level = DDP_LOG_NONE;
    if (p->token[rank]) setenv("DDP_AUTH_TOKEN", p->token[rank], 1);
    else unsetenv("DDP_AUTH_TOKEN");
    if (p->transport) setenv("DDP_TRANSPORT", p->transport, 1);
    if (ddp_init(&d, &g) != DDP_SUCCESS) {
        printf("rank %d: ddp_init: %s\n", rank, ddp_last_error(NULL));
        fflush(stdout);
        return strstr(ddp_last_error(NULL), "DDP_AUTH_TOKEN") ? 10 : 11; /* 10: an error that names the token */
    }
    CHECK_OK(ddp_all_reduce(g, &v, 1, DDP_F64, DDP_SUM), g);
    CHECK(v == n * (n + 1) / 2.0, "rank %d: sum %g", rank, v);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(void) {
    plan same = {{"s3cret", "s3cret", "s3cret", NULL}, NULL}, same_tcp = {{"s3cret", "s3cret", "s3cret", NULL}, "tcp"};
    plan other = {{"s3cret", "s3cret", "wrong", NULL}, NULL}, none = {{"s3cret", NULL, "s3cret", NULL}, NULL};
    plan store_without = {{NULL, "s3cret", "s3cret", NULL}, NULL};
    int codes[3];
    test_vectors();
    CHECK(tl_run_ranks(3, join_and_reduce, &same, 60) == 0, "3 ranks with the same token (shared memory)");
    CHECK(tl_run_ranks(3, join_and_reduce, &same_tcp, 60) == 0, "3 ranks with the same token (tcp)");
    printf("the same token on every rank: group formed, all_reduce right (shm and tcp)\n");
    tl_run_ranks_status(3, join_and_reduce, &other, 60, codes);
    CHECK(codes[2] == 10, "rank 2 with another token: exit %d, want an error naming DDP_AUTH_TOKEN", codes[2]);
    CHECK(codes[0] != 0 && codes[1] != 0, "ranks 0, 1 must fail (timeout) when rank 2 is refused: %d %d", codes[0], codes[1]);
    printf("a rank with another token: refused, saying so; the others fail at their timeout\n");
    tl_run_ranks_status(3, join_and_reduce, &none, 60, codes);
    CHECK(codes[1] == 10, "rank 1 without a token: exit %d, want an error naming DDP_AUTH_TOKEN", codes[1]);
    CHECK(codes[0] != 0 && codes[2] != 0, "ranks 0, 2 must fail: %d %d", codes[0], codes[2]);
    printf("a rank without the token: refused, saying so\n");
    tl_run_ranks_status(3, join_and_reduce, &store_without, 60, codes);
    CHECK(codes[1] == 10 && codes[2] == 10, "ranks with a token facing a store without one: exits %d %d", codes[1], codes[2]);
    printf("ranks with a token facing a store that has none: refuse it, saying so\n");
    printf("test_auth: all passed\n");
    return 0;
}
