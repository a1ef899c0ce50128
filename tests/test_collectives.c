/* Every collective x dtype x op x count, in place and not, synchronous and async, on world sizes
   1, 2, 3, 4 and 8 (real processes over real sockets), against a serial reference computed here.
   Each rank's data are small integers, so every reduction order gives an exact result and the
   reference must match bit for bit; AVG's one rounding is reproduced with the test's own f16/bf16
   rounding. Every world size runs over shared memory (the default on one host) and over TCP
   (DDP_TRANSPORT=tcp). Usage: test_collectives [world sizes...] (default 1 2 3 4 8);
   TEST_QUICK=1 skips the large count (for sanitizer builds). */
#include "testlib.h"

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
static const ddp_op ops[] = {DDP_SUM, DDP_AVG, DDP_PROD, DDP_MIN, DDP_MAX};
static const size_t counts[] = {0, 1, 7, 1000003};
#define NDT (sizeof dtypes / sizeof dtypes[0])
#define NOPS (sizeof ops / sizeof ops[0])
#define NCOUNTS (sizeof counts / sizeof counts[0])

/* The value rank r contributes at element i (an integer every dtype holds exactly). */
static int64_t value(int r, size_t i, ddp_dtype t, ddp_op op, int salt) {
    uint64_t h = (uint64_t)i * 2654435761u + (uint64_t)r * 40503u + (uint64_t)salt * 977u;
    if (op == DDP_PROD) { /* products of 8 ranks stay small: factors 1, 2, -1 */
        int k = (int)(h % 3);
        if (t == DDP_U8) return k == 2 ? 1 : k + 1;
        return k == 0 ? 1 : k == 1 ? 2 : -1;
    }
    if (t == DDP_U8) return (int64_t)(h % 4);
    return (int64_t)(h % 7) - 3;
}


static int worker(int rank, int n, void *arg) {
    ddp_group *g;
    size_t di, oi, ci, i;
    int salt = 0, root;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK(ddp_rank(g) == rank && ddp_world_size(g) == n, "rank %d/%d from ddp_init, launched as %d/%d", ddp_rank(g),
          ddp_world_size(g), rank, n);
    for (di = 0; di < NDT; di++) {
        ddp_dtype t = dtypes[di];
        size_t es = ddp_dtype_size(t);
        for (ci = 0; ci < NCOUNTS; ci++) {
            size_t count = counts[ci];
            unsigned char *a, *b;
            char what[128];
            int big = count > 1000;
            if (big && getenv("TEST_QUICK")) continue; /* sanitizer runs: small counts exercise the same code */
            a = tl_xalloc(count * es * (size_t)n);
            b = tl_xalloc(count * es * (size_t)n);
            for (oi = 0; oi < NOPS; oi++) {
                ddp_op op = ops[oi];
                if (big && op != DDP_SUM && op != DDP_AVG && (t != DDP_F32 || op != DDP_MAX) && t != DDP_I8) continue;
                salt++;
                /* all_reduce (always in place) */
                tl_fill(value, a, count, rank, t, op, salt);
                snprintf(what, sizeof what, "all_reduce(%s, %s, count %zu)", ddp_dtype_name(t), ddp_op_name(op), count);
                CHECK_OK(ddp_all_reduce(g, a, count, t, op), g);
                for (i = 0; i < count; i++) tl_check_equal(a, i, t, tl_expected(value, n, i, t, op, salt), what, rank);
                /* reduce to each root in turn (a few roots for the big count) */
                for (root = 0; root < n; root += big ? (n > 1 ? n - 1 : 1) : 1) {
                    tl_fill(value, a, count, rank, t, op, salt);
                    snprintf(what, sizeof what, "reduce(%s, %s, count %zu, root %d)", ddp_dtype_name(t), ddp_op_name(op), count, root);
                    CHECK_OK(ddp_reduce(g, a, count, t, op, root), g);
                    for (i = 0; i < count; i++)
                        tl_check_equal(a, i, t, rank == root ? tl_expected(value, n, i, t, op, salt) : (double)value(rank, i, t, op, salt),
                                       what, rank);
                }
                /* reduce_scatter: out of place, then in place (send + rank * count == recv) */
                {
                    size_t k, total = count * (size_t)n;
                    for (k = 0; k < 2; k++) {
                        unsigned char *recv = k == 0 ? b : a + (size_t)rank * count * es;
                        tl_fill(value, a, total, rank, t, op, salt);
                        snprintf(what, sizeof what, "reduce_scatter(%s, %s, count %zu, %s)", ddp_dtype_name(t), ddp_op_name(op),
                                 count, k ? "in place" : "out of place");
                        CHECK_OK(ddp_reduce_scatter(g, a, recv, count, t, op), g);
                        for (i = 0; i < count; i++)
                            tl_check_equal(recv, i, t, tl_expected(value, n, (size_t)rank * count + i, t, op, salt), what,
                                           rank);
                    }
                }
            }
            /* broadcast from every root; all_gather out of place and in place */
            salt++;
            for (root = 0; root < n; root += big ? (n > 1 ? n - 1 : 1) : 1) {
                tl_fill(value, a, count, rank, t, DDP_SUM, salt);
                snprintf(what, sizeof what, "broadcast(%s, count %zu, root %d)", ddp_dtype_name(t), count, root);
                CHECK_OK(ddp_broadcast(g, a, count, t, root), g);
                for (i = 0; i < count; i++) tl_check_equal(a, i, t, (double)value(root, i, t, DDP_SUM, salt), what, rank);
            }
            for (i = 0; i < 2; i++) {
                size_t k, r;
                unsigned char *send = i == 0 ? b : a + (size_t)rank * count * es;
                memset(a, 0xee, count * es * (size_t)n);
                tl_fill(value, send, count, rank, t, DDP_SUM, salt);
                snprintf(what, sizeof what, "all_gather(%s, count %zu, %s)", ddp_dtype_name(t), count, i ? "in place" : "out of place");
                CHECK_OK(ddp_all_gather(g, send, a, count, t), g);
                for (r = 0; r < (size_t)n; r++)
                    for (k = 0; k < count; k++) tl_check_equal(a, r * count + k, t, (double)value((int)r, k, t, DDP_SUM, salt), what, rank);
            }
            free(a);
            free(b);
        }
    }
    /* async: several in flight at once, completed in issue order, mixed with synchronous calls */
    {
        enum { Q = 6, C = 4099 };
        static float bufs[Q][C];
        ddp_work *w[Q + 2];
        float gathered[8 * 3], mine[3] = {(float)rank, (float)rank * 2, (float)rank * 3};
        int k;
        for (k = 0; k < Q; k++) {
            for (i = 0; i < C; i++) bufs[k][i] = (float)(rank + k + (int)i % 5);
            CHECK_OK(ddp_all_reduce_async(g, bufs[k], C, DDP_F32, k % 2 ? DDP_MAX : DDP_SUM, &w[k]), g);
        }
        CHECK_OK(ddp_barrier_async(g, &w[Q]), g);
        CHECK_OK(ddp_all_gather_async(g, mine, gathered, 3, DDP_F32, &w[Q + 1]), g);
        for (k = Q + 1; k >= 0; k--) CHECK_OK(ddp_wait(w[k]), g); /* waited in reverse: order must not matter */
        for (k = 0; k < Q; k++)
            for (i = 0; i < C; i++) {
                float want = 0;
                int r;
                for (r = 0; r < n; r++) {
                    float v = (float)(r + k + (int)i % 5);
                    want = k % 2 ? (r == 0 || v > want ? v : want) : want + v;
                }
                CHECK(bufs[k][i] == want, "rank %d: async all_reduce #%d element %zu: %g != %g", rank, k, i, bufs[k][i], want);
            }
        for (k = 0; k < n; k++) CHECK(gathered[k * 3 + 2] == (float)k * 3, "rank %d: async all_gather wrong at rank %d", rank, k);
        for (k = 0; k < Q; k++) CHECK_OK(ddp_broadcast_async(g, bufs[k], C, DDP_F32, k % n, &w[k]), g);
        CHECK_OK(ddp_all_reduce(g, mine, 3, DDP_F32, DDP_SUM), g); /* a synchronous call runs after the queued ones */
        for (k = 0; k < Q; k++) {
            CHECK(ddp_test(w[k]), "rank %d: async broadcast %d not complete after a later synchronous collective", rank, k);
            CHECK_OK(ddp_wait(w[k]), g);
        }
        CHECK(mine[0] == (float)(n * (n - 1) / 2), "rank %d: all_reduce after async work: %g", rank, mine[0]);
        {
            double x = rank;
            ddp_work *rw, *sw;
            float rs_in[8], rs_out = -1;
            for (k = 0; k < n; k++) rs_in[k] = (float)(k + rank);
            CHECK_OK(ddp_reduce_async(g, &x, 1, DDP_F64, DDP_SUM, 0, &rw), g);
            CHECK_OK(ddp_reduce_scatter_async(g, rs_in, &rs_out, 1, DDP_F32, DDP_SUM, &sw), g);
            CHECK_OK(ddp_wait(rw), g);
            CHECK_OK(ddp_wait(sw), g);
            CHECK(rank != 0 || x == n * (n - 1) / 2.0, "async reduce: %g", x);
            CHECK(rs_out == (float)(rank * n + n * (n - 1) / 2), "rank %d: async reduce_scatter: %g", rank, rs_out);
        }
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

int main(int argc, char **argv) {
    setenv("DDP_TIMEOUT", "120", 0);
    tl_sweep(argc, argv, worker, 900, "every collective x dtype x op x count matches the serial reference", NULL);
    return 0;
}
