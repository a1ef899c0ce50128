/* ddprun: launch N copies of a program with torchrun's environment. `ddprun --help` for the flags.
   The launcher itself lives in ddp.h ([SECTION] launcher); this file only gives it a main(). */
#define DDP_IMPLEMENTATION
#include "ddp.h"

int main(int argc, char **argv) { return ddp_launcher_main(argc, argv); }
