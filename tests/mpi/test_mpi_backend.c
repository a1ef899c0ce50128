/* The mpi backend (built with mpicc -DDDP_MPI, run by tests/test_mpi.sh under mpirun -np 1..4).
   Every collective, dtype and op on backend "mpi", each result compared with serial math done here:
   every rank computes every rank's input (a formula of rank and index), so the expected result is
   known without communication. Then async work, a subgroup, the reducer (Join, ZeRO-1, FSDP), gather / scatter / all_to_all
   / all_to_all_v / all_gather_v / monitored_barrier against serial expectations, split sizes or counts
   that differ (DDP_ERR_MISMATCH on every rank), monitored_barrier with a rank missing, and a
   collective mismatch that must be DDP_ERR_MISMATCH on every rank naming the rank that differs. */
#define DDP_MPI
#include "testlib.h"
#include "ref_optim.h"
#include "fsdp_model.h"

#include <mpi.h>

static int g_rank, g_n;

/* Input of `rank` at index i: small integers, so every dtype holds them and sums/products are exact. */
static double input(int rank, size_t i, ddp_op op) {
    if (op == DDP_PROD) return (double)(1 + (rank + (int)i) % 2);
    return (double)(1 + (rank * 7 + (int)(i * 3)) % 5);
}

/* The reduction of every rank's input at index i, by serial math. */
static double expected(ddp_dtype t, ddp_op op, size_t i) {
    double acc = input(0, i, op);
    int r;
    for (r = 1; r < g_n; r++) {
        double v = input(r, i, op);
        if (op == DDP_SUM || op == DDP_AVG) acc += v;
        else if (op == DDP_PROD) acc *= v;
        else if (op == DDP_MIN) acc = v < acc ? v : acc;
        else acc = v > acc ? v : acc;
    }
    if (op == DDP_AVG) acc = (t == DDP_F32 || t == DDP_F64 || t == DDP_F16 || t == DDP_BF16) ? acc / g_n : (double)(long)(acc / g_n);
    return acc;
}

static int close_enough(double got, double want, ddp_dtype t) {
    double tol = t == DDP_BF16 ? 8e-3 : t == DDP_F16 ? 1e-3 : t == DDP_F32 ? 1e-6 : 1e-12;
    return fabs(got - want) <= tol * fabs(want) + 1e-12;
}

static void *filled(ddp_dtype t, size_t count, int rank, ddp_op op) {
    void *b = malloc(count * ddp_dtype_size(t) + 1);
    size_t i;
    CHECK(b, "malloc");
    for (i = 0; i < count; i++) tl_store_value(b, i, t, input(rank, i, op));
    return b;
}

static void check_reductions(ddp_group *g) {
    static const size_t counts[] = {1, 7, 1000, 65537};
    int t, op, k;
    for (t = DDP_F32; t < DDP_DTYPE_COUNT; t++)
        for (op = 0; op < DDP_OP_COUNT; op++)
            for (k = 0; k < 4; k++) {
                size_t count = counts[k], i, es = ddp_dtype_size((ddp_dtype)t);
                ddp_dtype dt = (ddp_dtype)t;
                void *a = filled(dt, count, g_rank, (ddp_op)op), *red = filled(dt, count, g_rank, (ddp_op)op);
                void *send = filled(dt, count * (size_t)g_n, g_rank, (ddp_op)op), *recv = malloc(count * es);
                int root = g_n - 1;
                CHECK_OK(ddp_all_reduce(g, a, count, dt, (ddp_op)op), g);
                for (i = 0; i < count; i++)
                    CHECK(close_enough(tl_load_value(a, i, dt), expected(dt, (ddp_op)op, i), dt),
                          "all_reduce %s %s count %zu [%zu]: got %g want %g", ddp_dtype_name(dt), ddp_op_name((ddp_op)op), count,
                          i, tl_load_value(a, i, dt), expected(dt, (ddp_op)op, i));
                CHECK_OK(ddp_reduce(g, red, count, dt, (ddp_op)op, root), g);
                for (i = 0; g_rank == root && i < count; i++)
                    CHECK(close_enough(tl_load_value(red, i, dt), expected(dt, (ddp_op)op, i), dt), "reduce %s %s [%zu]: got %g want %g",
                          ddp_dtype_name(dt), ddp_op_name((ddp_op)op), i, tl_load_value(red, i, dt), expected(dt, (ddp_op)op, i));
                /* reduce_scatter: rank r gets chunk r of the reduction of every rank's count*n inputs */
                CHECK_OK(ddp_reduce_scatter(g, send, recv, count, dt, (ddp_op)op), g);
                for (i = 0; i < count; i++) {
                    double want = expected(dt, (ddp_op)op, (size_t)g_rank * count + i);
                    CHECK(close_enough(tl_load_value(recv, i, dt), want, dt), "reduce_scatter %s %s [%zu]: got %g want %g",
                          ddp_dtype_name(dt), ddp_op_name((ddp_op)op), i, tl_load_value(recv, i, dt), want);
                }
                /* in place: the input is the whole buffer, the result its first count elements */
                free(send);
                send = filled(dt, count * (size_t)g_n, g_rank, (ddp_op)op);
                CHECK_OK(ddp_reduce_scatter(g, send, send, count, dt, (ddp_op)op), g);
                for (i = 0; i < count; i++)
                    CHECK(close_enough(tl_load_value(send, i, dt), expected(dt, (ddp_op)op, (size_t)g_rank * count + i), dt),
                          "reduce_scatter in place %s [%zu]", ddp_dtype_name(dt), i);
                free(a);
                free(red);
                free(send);
                free(recv);
            }
    if (g_rank == 0) printf("ok: all_reduce, reduce, reduce_scatter: %d dtypes x %d ops x 4 counts\n", DDP_DTYPE_COUNT - 1, DDP_OP_COUNT);
}

static void check_movement(ddp_group *g) {
    int t;
    for (t = DDP_F32; t < DDP_DTYPE_COUNT; t++) {
        ddp_dtype dt = (ddp_dtype)t;
        size_t count = 1001, i, es = ddp_dtype_size(dt);
        int root = 1 % g_n, r;
        void *b = filled(dt, count, g_rank, DDP_SUM), *mine = filled(dt, count, g_rank, DDP_SUM);
        char *all = (char *)malloc(count * es * (size_t)g_n);
        CHECK(all, "malloc");
        CHECK_OK(ddp_broadcast(g, b, count, dt, root), g);
        for (i = 0; i < count; i++) CHECK(tl_load_value(b, i, dt) == input(root, i, DDP_SUM), "broadcast %s [%zu]", ddp_dtype_name(dt), i);
        CHECK_OK(ddp_all_gather(g, mine, all, count, dt), g);
        for (r = 0; r < g_n; r++)
            for (i = 0; i < count; i++)
                CHECK(tl_load_value(all + (size_t)r * count * es, i, dt) == input(r, i, DDP_SUM), "all_gather %s rank %d [%zu]",
                      ddp_dtype_name(dt), r, i);
        memset(all, 0, count * es * (size_t)g_n); /* in place: this rank's part already where it goes */
        for (i = 0; i < count; i++) tl_store_value(all + (size_t)g_rank * count * es, i, dt, input(g_rank, i, DDP_SUM));
        CHECK_OK(ddp_all_gather(g, all + (size_t)g_rank * count * es, all, count, dt), g);
        for (r = 0; r < g_n; r++)
            for (i = 0; i < count; i++)
                CHECK(tl_load_value(all + (size_t)r * count * es, i, dt) == input(r, i, DDP_SUM), "all_gather in place %s", ddp_dtype_name(dt));
        free(b);
        free(mine);
        free(all);
    }
    CHECK_OK(ddp_barrier(g), g);
    if (g_rank == 0) printf("ok: broadcast, all_gather (and in place), barrier: every dtype\n");
}

static void check_async_and_subgroup(ddp_group *g) {
    enum { K = 4, COUNT = 4096 };
    float *b[K];
    ddp_work *w[K];
    int k, i, members[8], nm = 0;
    ddp_group *sub = NULL;
    for (k = 0; k < K; k++) {
        b[k] = (float *)filled(DDP_F32, COUNT, g_rank + k, DDP_SUM);
        CHECK_OK(ddp_all_reduce_async(g, b[k], COUNT, DDP_F32, DDP_SUM, &w[k]), g);
    }
    for (k = K - 1; k >= 0; k--) CHECK_OK(ddp_wait(w[k]), g);
    for (k = 0; k < K; k++) {
        for (i = 0; i < COUNT; i++) {
            double want = 0;
            int r;
            for (r = 0; r < g_n; r++) want += input(r + k, (size_t)i, DDP_SUM);
            CHECK(b[k][i] == (float)want, "async all_reduce %d [%d]: %g want %g", k, i, b[k][i], want);
        }
        free(b[k]);
    }
    /* subgroup of the even ranks, listed in reverse: rank order in the subgroup follows the list */
    for (i = g_n - 1; i >= 0; i--)
        if (i % 2 == 0) members[nm++] = i;
    CHECK_OK(ddp_new_group(g, members, nm, &sub), g);
    CHECK((sub != NULL) == (g_rank % 2 == 0), "subgroup membership of rank %d", g_rank);
    if (sub) {
        double v = (double)g_rank, sum = 0;
        CHECK(strcmp(ddp_backend_name(sub), "mpi") == 0, "subgroup backend %s", ddp_backend_name(sub));
        for (i = 0; i < nm; i++)
            if (members[i] == g_rank) CHECK(ddp_rank(sub) == i, "subgroup rank %d, want %d", ddp_rank(sub), i);
        CHECK_OK(ddp_all_reduce(sub, &v, 1, DDP_F64, DDP_SUM), sub);
        for (i = 0; i < nm; i++) sum += members[i];
        CHECK(v == sum, "subgroup sum %g want %g", v, sum);
        CHECK_OK(ddp_destroy(sub), sub);
    }
    if (g_rank == 0) printf("ok: %d async all_reduces waited out of order; subgroup of %d even ranks\n", K, nm);
}

/* The reducer on the mpi backend: one parameter, gradient = rank + 1, averaged. */
static void check_reducer(ddp_group *g) {
    float w[300], grad[300];
    ddp_reducer *r;
    ddp_reducer_desc d;
    int i;
    memset(&d, 0, sizeof d);
    for (i = 0; i < 300; i++) w[i] = 0.5f;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, grad, 300, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    for (i = 0; i < 300; i++) grad[i] = (float)(g_rank + 1) * (float)(i % 3);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    for (i = 0; i < 300; i++) {
        float want = (float)(g_n + 1) / 2.0f * (float)(i % 3);
        CHECK(fabsf(grad[i] - want) <= 1e-6f * want, "reducer grad[%d] = %g, want %g", i, grad[i], want);
    }
    ddp_reducer_destroy(r);
    if (g_rank == 0) printf("ok: the reducer averages gradients on the mpi backend\n");
}

/* Uneven inputs (Join) on the mpi backend: rank r has r steps (rank 0 none); each step's average is
   (ranks with data) / world; after ddp_reducer_join every rank holds the last joiner's parameters. */
static void check_join(ddp_group *g) {
    float w[300], grad[300];
    ddp_reducer *r;
    ddp_reducer_desc d;
    int i, step;
    memset(&d, 0, sizeof d);
    d.uneven_inputs = 1;
    for (i = 0; i < 300; i++) w[i] = 0.5f;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, grad, 300, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    for (step = 0; step < g_rank; step++) {
        float want = (float)(g_n - 1 - step) / (float)g_n; /* ranks step+1 .. n-1 still have data */
        CHECK_OK(ddp_reducer_begin_backward(r), g);
        for (i = 0; i < 300; i++) grad[i] = 1.0f;
        CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
        CHECK_OK(ddp_reducer_end_backward(r), g);
        CHECK(fabsf(grad[7] - want) <= 1e-6f, "join step %d: grad %g, want %g", step, grad[7], want);
        for (i = 0; i < 300; i++) w[i] -= grad[i];
    }
    CHECK_OK(ddp_reducer_join(r), g);
    {
        float want = 0.5f;
        for (step = 0; step < g_n - 1; step++) want -= (float)(g_n - 1 - step) / (float)g_n;
        CHECK(fabsf(w[0] - want) <= 1e-5f, "after the join: w %g, want %g (the last joiner's)", w[0], want);
    }
    ddp_reducer_destroy(r);
    if (g_rank == 0) printf("ok: uneven inputs (ddp_reducer_join) on the mpi backend\n");
}

/* ZeRO stage 1 on the mpi backend: 301 elements (no world size divides them); each rank's shards hold
   the average (rank + 1 over the ranks) x (i % 3); SGD on the shards, then gather_params: every rank
   holds every updated element. */
static void check_zero(ddp_group *g) {
    float w[301], grad[301];
    ddp_reducer *r;
    ddp_reducer_desc d;
    const ddp_shard *sh;
    int i, j, n;
    size_t k, owned = 0;
    memset(&d, 0, sizeof d);
    d.zero_stage = 1;
    for (i = 0; i < 301; i++) w[i] = 0.5f;
    CHECK_OK(ddp_reducer_create(g, &d, &r), g);
    CHECK_OK(ddp_reducer_add_param(r, "w", w, grad, 301, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(r), g);
    CHECK_OK(ddp_reducer_begin_backward(r), g);
    for (i = 0; i < 301; i++) grad[i] = (float)(g_rank + 1) * (float)(i % 3);
    CHECK_OK(ddp_reducer_grad_ready(r, 0), g);
    CHECK_OK(ddp_reducer_end_backward(r), g);
    n = ddp_reducer_shards(r, &sh);
    for (j = 0; j < n; j++)
        for (k = 0; k < sh[j].count; k++) {
            float *gk = (float *)sh[j].grad + k, want = (float)(g_n + 1) / 2.0f * (float)((sh[j].offset + k) % 3);
            CHECK(fabsf(*gk - want) <= 1e-6f * want, "zero grad[%zu] = %g, want %g", sh[j].offset + k, *gk, want);
            ((float *)sh[j].param_data)[k] -= *gk;
            owned++;
        }
    CHECK(owned == (301 + (size_t)g_n - 1) / (size_t)g_n || (g_rank == g_n - 1 && owned <= 301 / (size_t)g_n + 1),
          "rank %d owns %zu of 301 elements", g_rank, owned);
    CHECK_OK(ddp_reducer_gather_params(r), g);
    for (i = 0; i < 301; i++) {
        float want = 0.5f - (float)(g_n + 1) / 2.0f * (float)(i % 3);
        CHECK(fabsf(w[i] - want) <= 1e-6f, "after gather_params: w[%d] = %g, want %g", i, w[i], want);
    }
    ddp_reducer_destroy(r);
    if (g_rank == 0) printf("ok: ZeRO stage 1 (reduce-scatter, shards, gather_params) on the mpi backend\n");
}

/* ---- gather, scatter, all_to_all, all_to_all_v, all_gather_v, monitored_barrier ---- */

/* Element i of the block that rank `from` sends rank `to`: small integers that u8 holds. */
static double block_value(int from, int to, size_t i) { return (double)((from * 31 + to * 7 + (int)i * 3) % 101); }

/* A call's result, waited for when it was async. */
static ddp_result waited(ddp_result r, ddp_work **w) { return r != DDP_SUCCESS ? r : ddp_wait(*w); }
#define CALL(async, fn, g, ...) ((async) ? waited(fn##_async(g, __VA_ARGS__, &w_), &w_) : fn(g, __VA_ARGS__))

static const ddp_dtype block_types[] = {DDP_F32, DDP_I64, DDP_U8};

static void *zeroed(size_t n, size_t es) { /* never NULL, even for n = 0 */
    void *b = calloc(n ? n : 1, es);
    CHECK(b, "calloc");
    return b;
}

/* gather (root 0 and the last rank, in place on the root and not) */
static void check_gather(ddp_group *g, ddp_dtype dt, size_t count, int root, int in_place, int async) {
    size_t es = ddp_dtype_size(dt), i;
    char *recv = (char *)zeroed(count * (size_t)g_n, es), *send = (char *)zeroed(count, es);
    ddp_work *w_ = NULL;
    int r;
    char *from = in_place && g_rank == root ? recv + (size_t)root * count * es : send;
    for (i = 0; i < count; i++) tl_store_value(from, i, dt, block_value(g_rank, 0, i));
    CHECK_OK(CALL(async, ddp_gather, g, from, g_rank == root ? recv : NULL, count, dt, root), g);
    for (r = 0; g_rank == root && r < g_n; r++)
        for (i = 0; i < count; i++)
            CHECK(tl_load_value(recv + (size_t)r * count * es, i, dt) == block_value(r, 0, i), "gather %s count %zu root %d%s%s: "
                  "rank %d [%zu] = %g", ddp_dtype_name(dt), count, root, in_place ? " in place" : "", async ? " async" : "", r, i,
                  tl_load_value(recv + (size_t)r * count * es, i, dt));
    free(recv);
    free(send);
}

static void check_scatter(ddp_group *g, ddp_dtype dt, size_t count, int root, int in_place, int async) {
    size_t es = ddp_dtype_size(dt), i;
    char *send = (char *)zeroed(count * (size_t)g_n, es), *recv = (char *)zeroed(count, es), *into = recv;
    ddp_work *w_ = NULL;
    int r;
    for (r = 0; g_rank == root && r < g_n; r++)
        for (i = 0; i < count; i++) tl_store_value(send + (size_t)r * count * es, i, dt, block_value(root, r, i));
    if (in_place && g_rank == root) into = send + (size_t)root * count * es;
    CHECK_OK(CALL(async, ddp_scatter, g, g_rank == root ? send : NULL, into, count, dt, root), g);
    for (i = 0; i < count; i++)
        CHECK(tl_load_value(into, i, dt) == block_value(root, g_rank, i), "scatter %s count %zu root %d%s%s [%zu] = %g",
              ddp_dtype_name(dt), count, root, in_place ? " in place" : "", async ? " async" : "", i, tl_load_value(into, i, dt));
    free(send);
    free(recv);
}

static void check_all_to_all(ddp_group *g, ddp_dtype dt, size_t count, int in_place, int async) {
    size_t es = ddp_dtype_size(dt), i;
    char *send = (char *)zeroed(count * (size_t)g_n, es), *recv = (char *)zeroed(count * (size_t)g_n, es);
    char *out = in_place ? send : recv;
    ddp_work *w_ = NULL;
    int r;
    for (r = 0; r < g_n; r++)
        for (i = 0; i < count; i++) tl_store_value(send + (size_t)r * count * es, i, dt, block_value(g_rank, r, i));
    CHECK_OK(CALL(async, ddp_all_to_all, g, send, out, count, dt), g);
    for (r = 0; r < g_n; r++)
        for (i = 0; i < count; i++)
            CHECK(tl_load_value(out + (size_t)r * count * es, i, dt) == block_value(r, g_rank, i), "all_to_all %s count %zu%s%s: "
                  "from rank %d [%zu] = %g", ddp_dtype_name(dt), count, in_place ? " in place" : "", async ? " async" : "", r, i,
                  tl_load_value(out + (size_t)r * count * es, i, dt));
    free(send);
    free(recv);
}

/* all_to_all_v: rank s sends rank d split(s, d) elements (zeros among them); salt varies the sizes. */
static size_t split(int s, int d, int salt) { return (size_t)((s + 2 * d + salt) % 4) * (size_t)(1 + salt % 3); }

static void check_all_to_all_v(ddp_group *g, ddp_dtype dt, int salt, int async) {
    size_t es = ddp_dtype_size(dt), sc[8], rc[8], at = 0, i, ns = 0, nr = 0;
    ddp_work *w_ = NULL;
    char *send, *recv;
    int r;
    for (r = 0; r < g_n; r++) ns += sc[r] = split(g_rank, r, salt), nr += rc[r] = split(r, g_rank, salt);
    send = (char *)zeroed(ns, es), recv = (char *)zeroed(nr, es);
    for (r = 0; r < g_n; r++)
        for (i = 0; i < sc[r]; i++, at++) tl_store_value(send, at, dt, block_value(g_rank, r, i));
    CHECK_OK(CALL(async, ddp_all_to_all_v, g, send, sc, recv, rc, dt), g);
    for (at = 0, r = 0; r < g_n; r++)
        for (i = 0; i < rc[r]; i++, at++)
            CHECK(tl_load_value(recv, at, dt) == block_value(r, g_rank, i), "all_to_all_v %s salt %d%s: from rank %d [%zu] = %g",
                  ddp_dtype_name(dt), salt, async ? " async" : "", r, i, tl_load_value(recv, at, dt));
    free(send);
    free(recv);
}

/* all_gather_v: rank r contributes uneven(r, salt) elements (zeros among them). */
static size_t uneven(int r, int salt) { return (size_t)((r * 5 + 1 + salt) % 4) * (size_t)(1 + salt); }

static void check_all_gather_v(ddp_group *g, ddp_dtype dt, int salt, int in_place, int async) {
    size_t es = ddp_dtype_size(dt), counts[8], total = 0, mine_at = 0, i, at;
    ddp_work *w_ = NULL;
    char *recv, *send, *from;
    int r;
    for (r = 0; r < g_n; r++) {
        if (r == g_rank) mine_at = total;
        total += counts[r] = uneven(r, salt);
    }
    recv = (char *)zeroed(total, es), send = (char *)zeroed(counts[g_rank], es);
    from = in_place ? recv + mine_at * es : send;
    for (i = 0; i < counts[g_rank]; i++) tl_store_value(from, i, dt, block_value(g_rank, 0, i));
    CHECK_OK(CALL(async, ddp_all_gather_v, g, from, counts[g_rank], recv, counts, dt), g);
    for (at = 0, r = 0; r < g_n; r++)
        for (i = 0; i < counts[r]; i++, at++)
            CHECK(tl_load_value(recv, at, dt) == block_value(r, 0, i), "all_gather_v %s salt %d%s%s: rank %d [%zu] = %g",
                  ddp_dtype_name(dt), salt, in_place ? " in place" : "", async ? " async" : "", r, i, tl_load_value(recv, at, dt));
    free(recv);
    free(send);
}

static void check_more_collectives(ddp_group *g) {
    static const size_t counts[] = {0, 1, 7, 1000};
    int t, k, async, in_place, salt, calls = 0;
    ddp_result r;
    for (t = 0; t < 3; t++)
        for (async = 0; async < 2; async++) {
            ddp_dtype dt = block_types[t];
            for (k = 0; k < 4; k++)
                for (in_place = 0; in_place < 2; in_place++) {
                    check_gather(g, dt, counts[k], 0, in_place, async);
                    check_gather(g, dt, counts[k], g_n - 1, in_place, async);
                    check_scatter(g, dt, counts[k], 0, in_place, async);
                    check_scatter(g, dt, counts[k], g_n - 1, in_place, async);
                    check_all_to_all(g, dt, counts[k], in_place, async);
                    calls += 5;
                }
            for (salt = 0; salt < 4; salt++) {
                check_all_to_all_v(g, dt, salt, async);
                check_all_gather_v(g, dt, salt, 0, async);
                check_all_gather_v(g, dt, salt, 1, async);
                calls += 3;
            }
        }
    CHECK_OK(ddp_monitored_barrier(g, 60), g);
    CHECK_OK(ddp_monitored_barrier(g, 0), g); /* <= 0: the group's timeout */
    {
        ddp_work *w;
        CHECK_OK(ddp_monitored_barrier_async(g, 60, &w), g);
        CHECK_OK(ddp_wait(w), g);
    }
    r = ddp_barrier(g);
    CHECK(r == DDP_SUCCESS, "barrier after the monitored ones: %s", ddp_last_error(g));
    if (g_rank == 0)
        printf("ok: gather, scatter, all_to_all (counts 0 1 7 1000, in place and not), all_to_all_v, all_gather_v (uneven, "
               "zeros): f32 i64 u8, sync and async, %d calls; monitored_barrier\n", calls);
}

/* ddp_send / ddp_recv on MPI: around the ring (send first on every rank: MPI sends a message this small
   eagerly), tags taken out of order, a send to itself refused; irecv posted before isend. */
static void check_point_to_point(ddp_group *g) {
    int right = (g_rank + 1) % g_n, left = (g_rank + g_n - 1) % g_n, i;
    double out[64], in[64];
    if (g_n < 2) return;
    for (i = 0; i < 64; i++) out[i] = block_value(g_rank, right, (size_t)i);
    CHECK_OK(ddp_send(g, out, 64, DDP_F64, right, 5), g);
    CHECK_OK(ddp_recv(g, in, 64, DDP_F64, left, 5), g);
    for (i = 0; i < 64; i++)
        CHECK(in[i] == block_value(left, g_rank, (size_t)i), "recv from %d: element %d is %g", left, i, in[i]);
    if (g_rank == 0) {
        int64_t a = 1, b = 2;
        CHECK_OK(ddp_send(g, &a, 1, DDP_I64, 1, 1), g);
        CHECK_OK(ddp_send(g, &b, 1, DDP_I64, 1, 2), g);
    } else if (g_rank == 1) {
        int64_t a = 0, b = 0;
        CHECK_OK(ddp_recv(g, &b, 1, DDP_I64, 0, 2), g);
        CHECK_OK(ddp_recv(g, &a, 1, DDP_I64, 0, 1), g);
        CHECK(a == 1 && b == 2, "tags out of order: %lld %lld", (long long)a, (long long)b);
    }
    CHECK(ddp_send(g, out, 1, DDP_F64, g_rank, 0) == DDP_ERR_INVALID_ARGUMENT, "send to itself: %s", ddp_last_error(g));
    { /* irecv before isend on every rank, waited in either order; ddp_test until done */
        ddp_work *wr, *ws;
        int polls = 0;
        memset(in, 0, sizeof in);
        CHECK_OK(ddp_irecv(g, in, 64, DDP_F64, left, 6, &wr), g);
        CHECK_OK(ddp_isend(g, out, 64, DDP_F64, right, 6, &ws), g);
        while (!ddp_test(wr)) polls++;
        CHECK_OK(ddp_wait(wr), g);
        CHECK_OK(ddp_wait(ws), g);
        for (i = 0; i < 64; i++)
            CHECK(in[i] == block_value(left, g_rank, (size_t)i), "irecv from %d: element %d is %g", left, i, in[i]);
    }
    CHECK_OK(ddp_barrier(g), g);
    if (g_rank == 0) printf("ok: send / recv around the ring, tags out of order; irecv before isend\n");
}

/* A fresh group of every rank, for a scenario that breaks it. */
static ddp_group *all_ranks(ddp_group *g) {
    int members[8], i;
    ddp_group *sub = NULL;
    for (i = 0; i < g_n; i++) members[i] = i;
    CHECK_OK(ddp_new_group(g, members, g_n, &sub), g);
    CHECK(sub, "no subgroup");
    return sub;
}

/* The last rank expects one element more from rank 0 than rank 0 sends it: DDP_ERR_MISMATCH on every
   rank, naming both sizes. Then all_gather_v where the last rank passes other counts of the same sum. */
static void check_size_mismatches(ddp_group *g) {
    size_t sc[8], rc[8], counts[8], i;
    float send[64] = {0}, recv[64];
    ddp_group *sub;
    ddp_result r;
    char want[200];
    int last = g_n - 1;
    if (g_n < 2) return;
    sub = all_ranks(g);
    for (i = 0; i < (size_t)g_n; i++) sc[i] = rc[i] = 2;
    if (g_rank == last) rc[0] = 3;
    r = ddp_all_to_all_v(sub, send, sc, recv, rc, DDP_F32);
    snprintf(want, sizeof want, "rank 0 sends 2 elements to rank %d (its send_counts[%d]) while rank %d expects 3 from rank 0 "
             "(its recv_counts[0])", last, last, last);
    CHECK(r == DDP_ERR_MISMATCH && strstr(ddp_last_error(sub), "split sizes differ in all_to_all_v") &&
          strstr(ddp_last_error(sub), want), "split-size mismatch gave %s: %s", ddp_result_string(r), ddp_last_error(sub));
    if (g_rank == 0) printf("ok: a split-size mismatch is DDP_ERR_MISMATCH on every rank: %s\n", ddp_last_error(sub));
    CHECK_OK(ddp_destroy(sub), sub);

    sub = all_ranks(g);
    for (i = 0; i < (size_t)g_n; i++) counts[i] = 1 + i;
    if (g_rank == last) counts[0] = 2, counts[1] = 1; /* same sum: the fingerprint alone cannot tell */
    r = ddp_all_gather_v(sub, send, counts[g_rank], recv, counts, DDP_F32);
    snprintf(want, sizeof want, "rank 0 passes counts[0] = 1 while rank %d passes counts[0] = 2", last);
    CHECK(r == DDP_ERR_MISMATCH && strstr(ddp_last_error(sub), "counts differ in all_gather_v") &&
          strstr(ddp_last_error(sub), want), "counts mismatch gave %s: %s", ddp_result_string(r), ddp_last_error(sub));
    if (g_rank == 0) printf("ok: all_gather_v counts that differ are DDP_ERR_MISMATCH on every rank: %s\n", ddp_last_error(sub));
    CHECK_OK(ddp_destroy(sub), sub);
}

/* monitored_barrier with the last rank missing (3+ ranks): rank 0 gives up after 0.5 s and every rank
   that came fails with DDP_ERR_TIMEOUT naming the last one (host and pid); the last rank, coming after
   that, gets no answer and fails naming rank 0 after 0.5 s + its group timeout (2 s, see main). */
static void check_monitored_missing(ddp_group *g) {
    ddp_group *sub;
    ddp_result r;
    double t0;
    char want[120];
    int last = g_n - 1;
    if (g_n < 3) return;
    sub = all_ranks(g);
    t0 = tl_now();
    if (g_rank != last) {
        r = ddp_monitored_barrier(sub, 0.5);
        snprintf(want, sizeof want, "1 of %d ranks did not arrive within 0.5 s: rank %d (host ", g_n, last);
        CHECK(r == DDP_ERR_TIMEOUT && strstr(ddp_last_error(sub), want), "monitored_barrier without rank %d gave %s: %s", last,
              ddp_result_string(r), ddp_last_error(sub));
        CHECK(tl_now() - t0 < 10, "rank %d took %.1f s to see the missing rank", g_rank, tl_now() - t0);
        if (g_rank == 0) printf("ok: monitored_barrier names the missing rank in %.2f s: %s\n", tl_now() - t0, ddp_last_error(sub));
        MPI_Barrier(MPI_COMM_WORLD);
    } else {
        MPI_Barrier(MPI_COMM_WORLD); /* come late: after rank 0 gave up */
        t0 = tl_now();
        r = ddp_monitored_barrier(sub, 0.5);
        CHECK(r == DDP_ERR_TIMEOUT && strstr(ddp_last_error(sub), "rank 0 (host "), "late rank gave %s: %s",
              ddp_result_string(r), ddp_last_error(sub));
        CHECK(tl_now() - t0 < 20, "late rank took %.1f s", tl_now() - t0);
        printf("ok: the late rank fails in %.2f s: %s\n", tl_now() - t0, ddp_last_error(sub));
    }
    CHECK(ddp_barrier(sub) != DDP_SUCCESS, "a broken group must refuse later calls");
    CHECK_OK(ddp_destroy(sub), sub);
}

/* The last rank calls all_reduce with another count: every rank must fail with DDP_ERR_MISMATCH. */
static void check_mismatch(ddp_group *g) {
    float v[8] = {0};
    ddp_result r;
    if (g_n < 2) return;
    r = ddp_all_reduce(g, v, g_rank == g_n - 1 ? 8 : 4, DDP_F32, DDP_SUM);
    CHECK(r == DDP_ERR_MISMATCH, "mismatched count gave %s", ddp_result_string(r));
    CHECK(strstr(ddp_last_error(g), "mismatch") && strstr(ddp_last_error(g), "count=8"), "message: %s", ddp_last_error(g));
    if (g_rank == 0) printf("ok: a different count on rank %d is DDP_ERR_MISMATCH on every rank: %s\n", g_n - 1, ddp_last_error(g));
    r = ddp_barrier(g);
    CHECK(r != DDP_SUCCESS && strstr(ddp_last_error(g), "broken"), "a broken group must refuse later calls: %s", ddp_last_error(g));
}

int main(void) {
    ddp_init_desc d;
    ddp_group *g;
    int world_rank = -1;
    memset(&d, 0, sizeof d);
    d.backend = "mpi";
    { /* only monitored_barrier has a timeout on MPI; the last rank's short one bounds its wait as the late
         rank of check_monitored_missing (ddp_init initialises MPI: Open MPI's variables tell who we are) */
        const char *r = getenv("OMPI_COMM_WORLD_RANK"), *n = getenv("OMPI_COMM_WORLD_SIZE");
        d.timeout_seconds = r && n && atoi(n) >= 3 && atoi(r) == atoi(n) - 1 ? 2 : 60;
    }
    CHECK(ddp_init(&d, &g) == DDP_SUCCESS, "ddp_init(backend mpi): %s", ddp_last_error(NULL));
    g_rank = ddp_rank(g);
    g_n = ddp_world_size(g);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    CHECK(world_rank == g_rank, "rank %d, MPI says %d", g_rank, world_rank);
    CHECK(strcmp(ddp_backend_name(g), "mpi") == 0, "backend %s", ddp_backend_name(g));
    CHECK(ddp_local_rank(g) >= 0 && ddp_local_world_size(g) == g_n, "local rank %d of %d (all ranks on this host)",
          ddp_local_rank(g), ddp_local_world_size(g));
    check_reductions(g);
    check_movement(g);
    check_async_and_subgroup(g);
    check_reducer(g);
    check_join(g);
    check_zero(g);
    fsdp_two_units(g); /* tests/fsdp_model.h */
    if (g_rank == 0) printf("ok: FSDP / ZeRO-3 (units gathered, gradients reduce-scattered, master shards) on the mpi backend\n");
    check_more_collectives(g);
    check_point_to_point(g);
    check_size_mismatches(g);
    check_monitored_missing(g);
    check_mismatch(g);
    ddp_destroy(g);
    if (g_rank == 0) printf("test_mpi_backend: all passed on %d ranks\n", g_n);
    return 0;
}
