/* Only one allocator hook: must stop the build with a clear #error. */
#ifndef _GNU_SOURCE /* a system header comes before ddp.h here, so say it first (g++ defines it already) */
#define _GNU_SOURCE
#endif
#include <stdlib.h>
#define DDP_MALLOC(n) malloc(n)
#define DDP_IMPLEMENTATION
#include "ddp.h"
int main(void) { return 0; }
