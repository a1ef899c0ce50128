/* A worker for tests/test_timeline.sh, run under ddprun --timeline (or with DDP_TIMELINE set):
     timeline_job full      collectives (sync, async, p2p), nested ranges of the program's own, a reducer
                            (4 parameters, small buckets: several buckets a pass, one pass under no_sync),
                            a checkpoint save and an async save (into $TIMELINE_JOB_DIR); prints
                            "rank R buckets B passes P": the bucket all-reduces and synchronised passes the
                            reducer's statistics count, which the timeline must show
     timeline_job kill      3+ ranks: two all_reduces, then the last rank SIGKILLs itself and the others'
                            next all_reduce fails (they exit 1 after ddp_destroy)
     timeline_job bcast     rank 0 sleeps 50 ms, then broadcasts: the others wait in the broadcast, so on
                            a shared clock its start on rank 0 comes before their ends */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TRY(call)                                                                                           \
    do {                                                                                                    \
        ddp_result r_ = (call);                                                                             \
        if (r_ != DDP_SUCCESS) {                                                                            \
            fprintf(stderr, "timeline_job: %s failed: %s\n", #call, ddp_last_error(NULL));                 \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

static void pause_ms(int ms) {
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

static int full(ddp_group *g) {
    enum { NP = 4 };
    static const size_t sizes[NP] = {300, 20, 500, 40};
    float *w[NP], *gr[NP], x[64], y = 1;
    int idx[NP], p, pass, rank = ddp_rank(g), n = ddp_world_size(g), buckets = 0, passes = 0;
    ddp_reducer_desc d;
    ddp_reducer *red;
    ddp_reducer_statistics st;
    ddp_work *work;
    ddp_tensor t;
    char path[512];
    const char *dir = getenv("TIMELINE_JOB_DIR");
    size_t i;
    for (i = 0; i < 64; i++) x[i] = (float)(rank + 1);
    TRY(ddp_timeline_begin(g, "setup \"collectives\""));
    TRY(ddp_all_reduce(g, x, 64, DDP_F32, DDP_SUM));
    TRY(ddp_broadcast(g, x, 8, DDP_F32, 0));
    TRY(ddp_all_reduce_async(g, x, 64, DDP_F32, DDP_SUM, &work));
    TRY(ddp_wait(work));
    if (n > 1 && rank == 0) TRY(ddp_send(g, &y, 1, DDP_F32, 1, 7));
    if (n > 1 && rank == 1) TRY(ddp_recv(g, &y, 1, DDP_F32, 0, 7));
    TRY(ddp_barrier(g));
    TRY(ddp_timeline_end(g));

    memset(&d, 0, sizeof d);
    d.first_bucket_bytes = 1000;
    d.bucket_cap_bytes = 1000;
    TRY(ddp_reducer_create(g, &d, &red));
    for (p = 0; p < NP; p++) {
        char name[16];
        w[p] = (float *)calloc(sizes[p], sizeof(float));
        gr[p] = (float *)calloc(sizes[p], sizeof(float));
        if (!w[p] || !gr[p]) return 1;
        snprintf(name, sizeof name, "p%d", p);
        TRY(ddp_reducer_add_param(red, name, w[p], gr[p], sizes[p], DDP_F32, &idx[p]));
    }
    TRY(ddp_reducer_finalize(red));
    for (pass = 0; pass < 5; pass++) {
        int sync = pass != 2; /* pass 2 runs under no_sync */
        TRY(ddp_reducer_get_statistics(red, &st));
        if (sync) buckets += st.buckets, passes++;
        TRY(ddp_timeline_begin(g, "step"));
        TRY(ddp_reducer_set_sync(red, sync));
        TRY(ddp_reducer_begin_backward(red));
        for (p = NP - 1; p >= 0; p--) {
            for (i = 0; i < sizes[p]; i++) gr[p][i] = (float)(rank + pass + p);
            if (rank == n - 1) pause_ms(2); /* the last rank is the straggler */
            TRY(ddp_reducer_grad_ready(red, idx[p]));
        }
        TRY(ddp_reducer_end_backward(red));
        TRY(ddp_timeline_end(g));
    }
    TRY(ddp_reducer_get_statistics(red, &st));
    printf("rank %d buckets %d passes %d\n", rank, buckets, passes);
    fflush(stdout);
    ddp_reducer_destroy(red);

    memset(&t, 0, sizeof t);
    t.name = "w0";
    t.data = w[0];
    t.dtype = DDP_F32;
    t.ndim = 1;
    t.shape[0] = (int64_t)sizes[0];
    snprintf(path, sizeof path, "%s/ck.safetensors", dir ? dir : ".");
    TRY(ddp_checkpoint_save(g, path, &t, 1, NULL));
    snprintf(path, sizeof path, "%s/ck_async.safetensors", dir ? dir : ".");
    TRY(ddp_checkpoint_save_async(g, path, &t, 1, NULL, &work));
    TRY(ddp_wait(work));
    for (p = 0; p < NP; p++) free(w[p]), free(gr[p]);
    return 0;
}

static int killed(ddp_group *g) {
    float x[16] = {0};
    int rank = ddp_rank(g), n = ddp_world_size(g), k;
    for (k = 0; k < 2; k++) TRY(ddp_all_reduce(g, x, 16, DDP_F32, DDP_SUM));
    if (rank == n - 1) raise(SIGKILL);
    if (ddp_all_reduce(g, x, 16, DDP_F32, DDP_SUM) == DDP_SUCCESS) {
        fprintf(stderr, "timeline_job: rank %d: the all_reduce without rank %d succeeded\n", rank, n - 1);
        return 2;
    }
    fprintf(stderr, "timeline_job: rank %d: failed as expected: %s\n", rank, ddp_last_error(g));
    return 1;
}

static int bcast(ddp_group *g) {
    double v = 0;
    TRY(ddp_barrier(g));
    if (ddp_rank(g) == 0) {
        pause_ms(50);
        v = 42;
    }
    TRY(ddp_broadcast(g, &v, 1, DDP_F64, 0));
    return v == 42 ? 0 : 1;
}

int main(int argc, char **argv) {
    ddp_group *g;
    int rc;
    const char *mode = argc > 1 ? argv[1] : "full";
    TRY(ddp_init(NULL, &g));
    if (!strcmp(mode, "kill")) rc = killed(g);
    else if (!strcmp(mode, "bcast")) rc = bcast(g);
    else rc = full(g);
    if (ddp_destroy(g) != DDP_SUCCESS && rc == 0) rc = 1;
    return rc;
}
