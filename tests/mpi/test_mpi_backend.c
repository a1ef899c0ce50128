/* The mpi backend (built with mpicc -DDDP_MPI, run by tests/test_mpi.sh under mpirun -np 1..4).
   Every collective, dtype and op on backend "mpi", each result compared with serial math done here:
   every rank computes every rank's input (a formula of rank and index), so the expected result is
   known without communication. Then async work, a subgroup, the reducer, and a collective mismatch
   that must be DDP_ERR_MISMATCH on every rank naming the rank that differs. */
#define DDP_MPI
#include "testlib.h"

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
    check_mismatch(g);
    ddp_destroy(g);
    if (g_rank == 0) printf("test_mpi_backend: all passed on %d ranks\n", g_n);
    return 0;
}
