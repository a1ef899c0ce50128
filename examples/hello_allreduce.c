/* hello_allreduce: the smallest ddp.h program. Every rank contributes rank + 1; all_reduce sums them.

   Shows: ddp_init (rank and world size come from the launcher's environment), ddp_all_reduce,
   ddp_destroy, and where the message is when a call fails (ddp_last_error).
   PyTorch: dist.init_process_group("gloo"); t = torch.tensor([rank + 1.0]); dist.all_reduce(t).

   Run:  make build/hello_allreduce build/ddprun
         build/ddprun --nproc-per-node 4 build/hello_allreduce
         build/hello_allreduce                      (no launcher: rank 0 of 1)
   Build your own the same way: cc -O2 -pthread -I. hello.c -lm */
#define DDP_IMPLEMENTATION /* in exactly one .c file of a program */
#include "ddp.h"

#include <stdio.h>

int main(void) {
    ddp_group *g;
    float x;
    int rank, world, expected;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) { /* no group yet: the message is this thread's */
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    rank = ddp_rank(g), world = ddp_world_size(g);
    x = (float)(rank + 1);
    if (ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: all_reduce failed: %s\n", rank, ddp_last_error(g));
        ddp_destroy(g);
        return 1;
    }
    expected = world * (world + 1) / 2; /* 1 + 2 + ... + world */
    printf("rank %d of %d: 1 + ... + %d = %g (%s)\n", rank, world, world, (double)x,
           x == (float)expected ? "right" : "WRONG");
    ddp_destroy(g); /* collective: every rank says goodbye */
    return x == (float)expected ? 0 : 1;
}
