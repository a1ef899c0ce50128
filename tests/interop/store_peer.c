/* The ddp.h side of tests/test_interop_store.sh (store_interop.py drives it).
     store_peer serve PORT    serve the store on 127.0.0.1:PORT until a torch client sets "stop"
     store_peer client PORT   as a client of torch's TCPStore server on PORT: set, get, add, check, wait,
                              delete, compare_set and a timeout, with torch's key layout ("/" + key, and
                              PrefixStore("/worker/attempt_0")); the Python side then checks what it sees.
     store_peer torchrun      a torchrun worker (rank > 0) beside store_torchrun_worker.py (rank 0): joins
                              torchrun's agent store as torch's workers do and exchanges keys with rank 0.
   Exit 0 when every check here passed; a failed check prints what differed. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond, ...)                                                    \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "store_peer: %s:%d: ", __FILE__, __LINE__);      \
            fprintf(stderr, __VA_ARGS__);                                    \
            fprintf(stderr, "\n");                                           \
            failures++;                                                      \
        }                                                                    \
    } while (0)

#define EXPECT_OK(call, s)                                                                                 \
    do {                                                                                                   \
        ddp_result r_ = (call);                                                                            \
        EXPECT(r_ == DDP_SUCCESS, "%s returned %s: %s", #call, ddp_result_string(r_), ddp_store_last_error(s)); \
    } while (0)

/* The patterns store_interop.py also builds (zeros included). */
static void c_pattern(unsigned char *b, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = (unsigned char)(i % 3 == 0 ? 0 : (i * 7) % 256);
}
static void py_pattern(unsigned char *b, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) b[i] = (unsigned char)(i % 4 == 0 ? 0 : (i * 13) % 256);
}

static int serve(int port) {
    ddp__store_server *srv;
    ddp_store *s;
    char err[DDP__ERR_MAX], buf[16];
    size_t size = 0;
    if (ddp__store_server_start("127.0.0.1", port, DDP_LOG_DEFAULT, &srv, err) != DDP_SUCCESS) {
        fprintf(stderr, "store_peer: %s\n", err);
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    /* in torch's layout, so that the Python side's store.set("stop", ...) ends it */
    if (ddp__store_connect("127.0.0.1", port, "/", 300, &s, err) != DDP_SUCCESS) {
        fprintf(stderr, "store_peer: %s\n", err);
        ddp__store_server_stop(srv);
        return 1;
    }
    EXPECT_OK(ddp_store_get(s, "stop", buf, sizeof buf, &size), s);
    ddp__store_free(s);
    ddp__store_server_stop(srv);
    return failures != 0;
}

static int client(int port) {
    ddp_store *s, *w;
    char err[DDP__ERR_MAX], prefix[64], buf[64];
    unsigned char want[300], got[300];
    const char *both[2] = {"py_bin", "c_bin"};
    size_t size = 0;
    int64_t v = 0, nk = 0;
    int exists = -1, deleted = -1;
    ddp_result r;

    if (ddp__store_connect("127.0.0.1", port, "/", 30, &s, err) != DDP_SUCCESS) {
        fprintf(stderr, "store_peer: %s\n", err);
        return 1;
    }
    c_pattern(want, sizeof want);
    EXPECT_OK(ddp_store_set(s, "c_bin", want, sizeof want), s);
    py_pattern(want, 257);
    EXPECT_OK(ddp_store_get(s, "py_bin", got, sizeof got, &size), s);
    EXPECT(size == 257 && memcmp(got, want, 257) == 0, "py_bin: %zu bytes, or different bytes", size);
    EXPECT_OK(ddp_store_add(s, "c_counter", 5, &v), s);
    EXPECT(v == 15, "c_counter (python set it to 10) + 5 = %lld", (long long)v);
    EXPECT_OK(ddp_store_add(s, "c_counter", -2, &v), s);
    EXPECT(v == 13, "c_counter - 2 = %lld", (long long)v);
    EXPECT_OK(ddp_store_check(s, "py_bin", &exists), s);
    EXPECT(exists == 1, "check py_bin");
    EXPECT_OK(ddp_store_check(s, "nope", &exists), s);
    EXPECT(exists == 0, "check nope");
    EXPECT_OK(ddp_store_wait(s, both, 2, 0), s);
    EXPECT_OK(ddp_store_delete(s, "py_del", &deleted), s);
    EXPECT(deleted == 1, "delete py_del");
    EXPECT_OK(ddp_store_delete(s, "py_del", &deleted), s);
    EXPECT(deleted == 0, "second delete py_del");
    EXPECT_OK(ddp__store_compare_set(s, "c_cas", "", 0, "first", 5, buf, sizeof buf, &size), s);
    EXPECT(size == 5 && memcmp(buf, "first", 5) == 0, "compare_set on a new key");
    EXPECT_OK(ddp__store_compare_set(s, "c_cas", "first", 5, "second", 6, buf, sizeof buf, &size), s);
    EXPECT(size == 6 && memcmp(buf, "second", 6) == 0, "compare_set on first");
    /* a get that blocks until the Python side sets the key */
    EXPECT_OK(ddp_store_set(s, "c_waiting", "1", 1), s);
    EXPECT_OK(ddp_store_get(s, "py_late", buf, sizeof buf, &size), s);
    EXPECT(size == 4 && memcmp(buf, "late", 4) == 0, "py_late");
    /* a timeout against torch's server, then the next call reconnects */
    ddp__store_set_timeout(s, 0.3);
    r = ddp_store_get(s, "never", buf, sizeof buf, &size);
    EXPECT(r == DDP_ERR_TIMEOUT && strstr(ddp_store_last_error(s), "'never'"), "get never: %s %s",
           ddp_result_string(r), ddp_store_last_error(s));
    ddp__store_set_timeout(s, 30);
    EXPECT_OK(ddp_store_set(s, "c_after_timeout", "ok", 2), s);
    /* a torchrun worker's view: PrefixStore("/worker/attempt_0", TCPStore(...)) */
    EXPECT(ddp__store_torch_prefix("/worker/attempt_0", prefix, sizeof prefix) == 0, "prefix");
    if (ddp__store_connect("127.0.0.1", port, prefix, 30, &w, err) != DDP_SUCCESS) {
        fprintf(stderr, "store_peer: %s\n", err);
        return 1;
    }
    EXPECT_OK(ddp_store_set(w, "wk", "worker-key", 10), w);
    EXPECT_OK(ddp_store_add(w, "wk_count", 2, &v), w);
    EXPECT_OK(ddp_store_get(w, "py_wk", buf, sizeof buf, &size), w);
    EXPECT(size == 5 && memcmp(buf, "py-wk", 5) == 0, "py_wk through the worker prefix");
    ddp__store_free(w);
    EXPECT_OK(ddp__store_num_keys(s, &nk), s);
    printf("num_keys %lld\n", (long long)nk);
    fflush(stdout);
    EXPECT_OK(ddp_store_set(s, "c_done", failures ? "0" : "1", 1), s);
    ddp__store_free(s);
    return failures != 0;
}

/* Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True): the agent serves the store on MASTER_PORT, and torch's
   workers use it through PrefixStore("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>"). */
static int torchrun_worker(void) {
    const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT"), *attempt = getenv("TORCHELASTIC_RESTART_COUNT");
    const char *rank_s = getenv("RANK"), *world_s = getenv("WORLD_SIZE");
    char err[DDP__ERR_MAX], prefix[128], ps[64], key[32], val[32], buf[64];
    const char *keys[64];
    char names[64][16];
    size_t size = 0;
    int64_t v = 0;
    int rank, world, r;
    ddp_store *s;
    if (!addr || !port || !attempt || !rank_s || !world_s) {
        fprintf(stderr, "store_peer torchrun: MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, RANK and WORLD_SIZE "
                        "must be set (run it under torchrun)\n");
        return 1;
    }
    rank = atoi(rank_s);
    world = atoi(world_s);
    if (world < 1 || world > 64) return 1;
    snprintf(ps, sizeof ps, "/worker/attempt_%s", attempt);
    if (ddp__store_torch_prefix(ps, prefix, sizeof prefix) != 0 ||
        ddp__store_connect(addr, atoi(port), prefix, 60, &s, err) != DDP_SUCCESS) {
        fprintf(stderr, "store_peer torchrun: %s\n", err);
        return 1;
    }
    snprintf(key, sizeof key, "probe/%d", rank);
    r = snprintf(val, sizeof val, "rank %d%cddp.h", rank, 0);
    EXPECT_OK(ddp_store_set(s, key, val, (size_t)r), s);
    EXPECT_OK(ddp_store_get(s, "probe/0", buf, sizeof buf, &size), s);
    EXPECT(size == 13 && memcmp(buf, "rank 0\0python", 13) == 0, "probe/0 from the python worker: %zu bytes", size);
    EXPECT_OK(ddp_store_add(s, "probe_count", 1, &v), s);
    snprintf(key, sizeof key, "done/%d", rank);
    EXPECT_OK(ddp_store_set(s, key, "1", 1), s);
    for (r = 0; r < world; r++) {
        snprintf(names[r], sizeof names[r], "done/%d", r);
        keys[r] = names[r];
    }
    EXPECT_OK(ddp_store_wait(s, keys, world, 0), s);
    EXPECT_OK(ddp_store_add(s, "probe_count", 0, &v), s);
    EXPECT(v == world, "probe_count %lld, expected %d", (long long)v, world);
    ddp__store_free(s);
    if (!failures) printf("rank %d (ddp.h): exchanged keys with the python worker through torchrun's agent store\n", rank);
    return failures != 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "serve") == 0) return serve(atoi(argv[2]));
    if (argc == 3 && strcmp(argv[1], "client") == 0) return client(atoi(argv[2]));
    if (argc == 2 && strcmp(argv[1], "torchrun") == 0) return torchrun_worker();
    fprintf(stderr, "usage: store_peer serve PORT | client PORT | torchrun\n");
    return 2;
}
