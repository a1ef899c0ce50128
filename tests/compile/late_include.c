/* ddp.h with DDP_IMPLEMENTATION after the system headers, as stb-style headers allow (llm.c includes
   <stdio.h> first). Under -std=c99 those headers were read without _GNU_SOURCE (nor _DEFAULT_SOURCE),
   so the implementation must not rely on what only feature macros declare; running the world-size-1
   smoke checks that what it declares for itself is right. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/types.h>
#include <signal.h>
#include <poll.h>
#include <sys/socket.h>
#define DDP_IMPLEMENTATION
#include "ddp.h"

int main(void) {
    ddp_group *g = NULL;
    float x[3] = {1, 2, 3};
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "late_include: ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    if (ddp_world_size(g) != 1 || ddp_all_reduce(g, x, 3, DDP_F32, DDP_SUM) != DDP_SUCCESS || x[0] != 1 ||
        x[1] != 2 || x[2] != 3 || fabs(sqrt(4.0) - 2.0) > 0) {
        fprintf(stderr, "late_include: all_reduce: %s\n", ddp_last_error(g));
        return 2;
    }
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 3;
}
