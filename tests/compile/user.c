/* A translation unit that only uses the API (no implementation): as most of a program's files are. */
#include "ddp.h"

#ifdef __cplusplus
extern "C"
#endif
int user_world_size(ddp_group *g) { return ddp_world_size(g) + (int)ddp_dtype_size(DDP_F32) - 4; }
