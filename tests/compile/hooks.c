/* The hooks: the allocator's three given (counted), DDP_ASSERT given (counted), and DDP_STATIC. */
#ifndef _GNU_SOURCE /* a system header comes before ddp.h here, so say it first (g++ defines it already) */
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <stdlib.h>
static int allocations, assertions;
static void *counting_malloc(size_t n) { allocations++; return malloc(n); }
static void counting_assert(int ok, const char *what) {
    assertions++;
    if (!ok) { fprintf(stderr, "DDP_ASSERT failed: %s\n", what); abort(); }
}
#define DDP_MALLOC(n) counting_malloc(n)
#define DDP_REALLOC(p, n) realloc(p, n)
#define DDP_FREE(p) free(p)
#define DDP_ASSERT(x) counting_assert((x) != 0, #x)
#define DDP_STATIC
#define DDP_IMPLEMENTATION
#include "ddp.h"

int main(void) {
    ddp_group *g = NULL;
    float x[3] = {1, 2, 3};
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return 1;
    if (ddp_all_reduce(g, x, 3, DDP_F32, DDP_AVG) != DDP_SUCCESS || x[2] != 3) return 2; /* AVG divides */
    ddp_destroy(g);
    if (allocations == 0) return 5;
    return assertions > 0 ? 0 : 6; /* the library's invariants go through the program's DDP_ASSERT */
}
