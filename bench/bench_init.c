/* Rendezvous probe (issue #25): ddp_init + one barrier under a launcher, e.g.
       build/ddprun --standalone --nproc-per-node 128 build/bench_init
   Rank 0 prints how long its ddp_init took and, with its store's debug log (this probe turns DDP_LOG_LEVEL
   to debug on rank 0 only), how many requests its store server handled ("stopped after N requests"). */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet_but_store(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)level, (void)rank, (void)user;
    if (strstr(msg, "stopped after")) fprintf(stderr, "%s\n", msg);
}

int main(void) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    double t0, t1;
    int rank0 = getenv("RANK") && atoi(getenv("RANK")) == 0;
    memset(&d, 0, sizeof d);
    if (rank0) setenv("DDP_LOG_LEVEL", "debug", 1), d.log_fn = quiet_but_store; /* the server logs to stderr */
    t0 = ddp__now();
    if (ddp_init(&d, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    t1 = ddp__now();
    if (ddp_barrier(g) != DDP_SUCCESS) {
        fprintf(stderr, "barrier: %s\n", ddp_last_error(g));
        return 1;
    }
    if (rank0) printf("ranks %d: ddp_init on rank 0 took %.3f s\n", ddp_world_size(g), t1 - t0);
    ddp_destroy(g);
    return 0;
}
