/* bench_trace: what the flight recorder (src/trace.c) costs when nothing fails.

   Usage (under any launcher):  ddprun --nproc-per-node 2 build/bench_trace [rounds] [iters]
   One group (DDP_TRACE_SIZE unset: the default recorder of 64), timed with its recorder and without
   it: the recorder is detached (g->trace = NULL, which is what DDP_TRACE_SIZE=0 gives) for every other
   round, on every rank alike, so both settings run on the same group, the same shared-memory segment
   and the same machine load. Each round times `iters` 4-byte all_reduces (f32, sum); the order of the
   two settings alternates. Prints the median over the rounds of the mean time per call for each and
   their difference. Then,
   on rank 0 alone, the recorder's own cost: the three transitions of one collective (queued, started,
   done) called directly, in ns, and a timeline event's (src/timeline.c: what DDP_TIMELINE adds to a
   collective), into a file under $TMPDIR. Defaults: 41 rounds of 2000 calls. BENCH_TRACE_NULL=1 keeps the
   recorder on in both halves (an A/A run: the difference it shows is the measurement's own noise). */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Mean seconds per 4-byte all_reduce over iters calls on g (after a barrier). */
static double time_calls(ddp_group *g, int iters) {
    float x = 1;
    double t0;
    int i;
    if (ddp_barrier(g) != DDP_SUCCESS) return -1;
    t0 = bench_now();
    for (i = 0; i < iters; i++)
        if (ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM) != DDP_SUCCESS) return -1;
    return (bench_now() - t0) / iters;
}

/* ns for the recorder's three transitions of one collective, on a group's ring of 64. */
static double recorder_ns(ddp_group *g) {
    ddp__coll c;
    int i, n = 1000000;
    double t0;
    memset(&c, 0, sizeof c);
    c.kind = DDP__ALL_REDUCE, c.count = 1, c.dtype = DDP_F32, c.op = DDP_SUM, c.root = -1;
    c.seq = g->seq + 1000;
    t0 = bench_now();
    for (i = 0; i < n; i++, c.seq++) {
        ddp__trace_queued(g, &c, 0); /* as an async call: queued, then started */
        ddp__trace_started(g, &c);
        ddp__trace_ended(g, &c, DDP_SUCCESS);
    }
    return (bench_now() - t0) / n * 1e9;
}

/* ns for one timeline event of a collective (clock reads, formatting, the buffer's flag; the writes it
   causes every 192 KiB included), into a file under $TMPDIR; -1 when it cannot be opened. */
static double timeline_ns(ddp_group *g) {
    ddp__coll c;
    char path[512];
    const char *tmp = getenv("TMPDIR");
    int i, n = 1000000;
    double t0, ns;
    if (ddp__timeline_on()) return -1; /* DDP_TIMELINE is set: measure with it unset */
    snprintf(path, sizeof path, "%s/bench_trace_timeline.%d.json", tmp ? tmp : "/tmp", (int)getpid());
    if (ddp__tl_open(g, path, ddp__now(), 0) != DDP_SUCCESS) return -1;
    memset(&c, 0, sizeof c);
    c.kind = DDP__ALL_REDUCE, c.count = 1, c.dtype = DDP_F32, c.op = DDP_SUM, c.root = -1, c.seq = g->seq;
    t0 = bench_now();
    for (i = 0; i < n; i++, c.seq++) {
        double s = ddp__now();
        ddp__timeline_coll(g, &c, s, ddp__now(), DDP_SUCCESS);
    }
    ns = (bench_now() - t0) / n * 1e9;
    ddp__timeline_close_of(g);
    remove(path);
    return ns;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 41, iters = argc > 2 ? atoi(argv[2]) : 2000, r, n, i;
    double *on, *off, m_on, m_off;
    struct ddp__trace *recorder;
    ddp_group *g;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    n = ddp_world_size(g);
    on = (double *)malloc((size_t)rounds * sizeof *on);
    off = (double *)malloc((size_t)rounds * sizeof *off);
    if (!on || !off || rounds < 1 || iters < 1) return 2;
    if (!(recorder = g->trace)) {
        fprintf(stderr, "the group has no recorder: unset DDP_TRACE_SIZE\n");
        return 4;
    }
    time_calls(g, iters / 4 + 1); /* warm-up */
    for (r = 0; r < rounds; r++) {
        for (i = 0; i < 2; i++) {
            int with = (i + r) % 2;
            g->trace = with || getenv("BENCH_TRACE_NULL") ? recorder : NULL; /* NULL: the A/A check */
            *(with ? &on[r] : &off[r]) = time_calls(g, iters);
        }
        g->trace = recorder;
        if (on[r] < 0 || off[r] < 0) {
            fprintf(stderr, "rank %d: %s\n", ddp_rank(g), ddp_last_error(NULL));
            return 5;
        }
    }
    m_on = median(on, rounds);
    m_off = median(off, rounds);
    if (ddp_rank(g) == 0) {
        printf("# bench_trace: 4-byte all_reduce (f32, sum), %d ranks, transport %s (%s), %d rounds x %d calls\n", n,
               getenv("DDP_TRANSPORT") ? getenv("DDP_TRANSPORT") : "auto", g->backend->name, rounds, iters);
        printf("recorder on (DDP_TRACE_SIZE %d):  median %.3f us per call\n", (int)recorder->size, m_on * 1e6);
        printf("recorder off (as DDP_TRACE_SIZE=0): median %.3f us per call\n", m_off * 1e6);
        printf("difference: %+.3f us per call (%+.1f %%)\n", (m_on - m_off) * 1e6, (m_on - m_off) / m_off * 100);
        printf("the recorder alone: %.1f ns per collective (queued + started + done)\n", recorder_ns(g));
        printf("a timeline event (DDP_TIMELINE): %.1f ns per collective (2 clock reads, a formatted line, its share "
               "of the writes)\n", timeline_ns(g));
    }
    free(on), free(off);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
