/* Test helper for tests/test_netns.sh (the partition runs): one rank of a fault-tolerant job (DDP_FT=1 is
   set by the script) that commits steps in a loop, so that the link between its hosts can be cut while
   the group trains.
   usage (with torchrun's variables set): ft_loop STEPS
   Each step: ddp_ft_begin, 2 ms of "compute", an all_reduce (SUM) of 1024 floats whose values depend on
   the step and the view (checked against the sum worked out here), ddp_ft_commit; STEPS of them (the
   members stop together: a step count, not a clock). It prints "rank R: looping" after its
   first commit, "rank R: commit S view G members W at T" (T: wall-clock seconds) for each commit,
   "rank R: view change ..." when the view changed, "rank R: rejoined at step S ..." when it came back as a
   new member (cut off, then the partition healed), and at the
   end "rank R: done after S steps in a view of W members" (exit 0) or "rank R: FAILED
   after S steps: MESSAGE" (exit 1). Exit 2 on a wrong sum. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 1024

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    uint64_t steps = argc > 1 ? (uint64_t)atoll(argv[1]) : 1000;
    static float x[N];
    ddp_group *g;
    ddp_ft_step st;
    ddp_result r = DDP_SUCCESS;
    uint64_t last_gen = 0;
    int i, rank = atoi(getenv("RANK") ? getenv("RANK") : "0"), announced = 0;
    struct timespec compute = {0, 2000000};
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        printf("rank %d: FAILED after 0 steps: %s\n", rank, ddp_last_error(NULL));
        return 1;
    }
    memset(&st, 0, sizeof st);
    while (st.step < steps) {
        if ((r = ddp_ft_begin(g, &st)) != DDP_SUCCESS) break;
        if (st.joined) printf("rank %d: rejoined at step %llu in view %llu of %d members\n", rank,
                              (unsigned long long)st.step, (unsigned long long)st.gen, st.world_size);
        else if (st.gen != last_gen) printf("rank %d: view change to view %llu: %d members, rank %d\n", rank,
                                            (unsigned long long)st.gen, st.world_size, st.rank);
        nanosleep(&compute, NULL);
        for (i = 0; i < N; i++) x[i] = (float)((st.step + (uint64_t)i) % 7) + (float)st.rank;
        r = ddp_all_reduce(g, x, N, DDP_F32, DDP_SUM);
        if (r == DDP_ERR_VIEW_CHANGED) continue;
        if (r != DDP_SUCCESS) break;
        for (i = 0; i < N; i++) {
            float want = (float)((st.step + (uint64_t)i) % 7) * (float)st.world_size +
                         (float)(st.world_size * (st.world_size - 1) / 2);
            if (x[i] != want) {
                printf("rank %d: FAILED: wrong sum at %d: %g, want %g\n", rank, i, x[i], want);
                return 2;
            }
        }
        r = ddp_ft_commit(g, &st);
        if (r == DDP_ERR_VIEW_CHANGED) continue;
        if (r != DDP_SUCCESS) break;
        if (!announced++) printf("rank %d: looping\n", rank);
        printf("rank %d: commit %llu view %llu members %d at %.3f\n", rank, (unsigned long long)st.step,
                   (unsigned long long)st.gen, st.world_size, wall());
        last_gen = st.gen;
    }
    if (r != DDP_SUCCESS) {
        printf("rank %d: FAILED after %llu steps: %s\n", rank, (unsigned long long)st.step, ddp_last_error(g));
        return 1;
    }
    printf("rank %d: done after %llu steps in a view of %d members\n", rank, (unsigned long long)st.step, st.world_size);
    ddp_destroy(g);
    return 0;
}
