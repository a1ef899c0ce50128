/* Allocator hooks: all three given (counted), and DDP_STATIC. */
#ifndef _GNU_SOURCE /* a system header comes before ddp.h here, so say it first (g++ defines it already) */
#define _GNU_SOURCE
#endif
#include <stdlib.h>
static int allocations;
static void *counting_malloc(size_t n) { allocations++; return malloc(n); }
#define DDP_MALLOC(n) counting_malloc(n)
#define DDP_REALLOC(p, n) realloc(p, n)
#define DDP_FREE(p) free(p)
#define DDP_STATIC
#define DDP_IMPLEMENTATION
#include "ddp.h"

int main(void) {
    ddp_group *g = NULL;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return 1;
    ddp_destroy(g);
    return allocations > 0 ? 0 : 5;
}
