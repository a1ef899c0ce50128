/* The one translation unit with the implementation; links with user.c. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#ifdef __cplusplus
extern "C"
#endif
int user_world_size(ddp_group *g);

int main(void) {
    ddp_group *g = NULL;
    float x = 2;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return 1;
    if (ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM) != DDP_SUCCESS || x != 2) return 2;
    if (user_world_size(g) != 1) return 3;
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 4;
}
