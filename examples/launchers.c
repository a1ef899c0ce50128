/* launchers: one binary, started by any launcher; every rank says who it is and who started it.

   ddp_init(NULL, &g) reads rank and world size from whichever launcher ran the program (first match):
     ddprun / torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
     Open MPI mpirun     OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
     MPICH mpiexec       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
     SLURM srun          SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
     nothing             a single process: rank 0 of 1
   Under mpirun and srun nobody sets MASTER_ADDR/MASTER_PORT: rank 0's store is then on 127.0.0.1
   (under SLURM, the first host of the node list) at a port derived from the job id.

   One host, 4 ranks:
       build/ddprun --nproc-per-node 4 build/launchers
       torchrun --standalone --nproc_per_node 4 --no_python build/launchers
           (Debian's torch 1.13: the underscore spellings, and add --redirects 1 --tee 1)
       mpirun -np 4 build/launchers           (as root: --allow-run-as-root; few cores: --oversubscribe)
       mpiexec -n 4 build/launchers           (MPICH)
       srun -n 4 build/launchers              (inside a SLURM allocation)
       build/launchers                        (alone)
   Two hosts a and b, 4 ranks each:
       on a: build/ddprun --nnodes 2 --node-rank 0 --master-addr a --master-port 29500 --nproc-per-node 4 build/launchers
       on b: build/ddprun --nnodes 2 --node-rank 1 --master-addr a --master-port 29500 --nproc-per-node 4 build/launchers
       mpirun -np 8 -H a:4,b:4 -x MASTER_ADDR=a -x MASTER_PORT=29500 build/launchers
       srun -N 2 --ntasks-per-node 4 build/launchers
   From inside a program, without a launcher: ddp_spawn(4, fn, arg) forks 4 ranks that run fn.

   What it prints: rank 0 gathers one line from every rank (ddp_all_gather of fixed-size text) and prints
   them in rank order, so the output is tidy whatever the launcher does with each rank's stdout. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { LINE = 160 };

/* Which launcher's variables are set (the order ddp_init consults them). */
static const char *launcher(void) {
    if (getenv("RANK") && getenv("DDP_RESTART_COUNT")) return "ddprun";
    if (getenv("RANK") && getenv("TORCHELASTIC_RUN_ID")) return "torchrun";
    if (getenv("RANK")) return "RANK/WORLD_SIZE set by hand";
    if (getenv("OMPI_COMM_WORLD_RANK")) return "Open MPI's mpirun";
    if (getenv("PMI_RANK")) return "MPICH's mpiexec";
    if (getenv("SLURM_PROCID")) return "SLURM's srun";
    return "no launcher";
}

int main(void) {
    ddp_group *g;
    char mine[LINE], host[64] = "?", *all;
    int r, world;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init failed: %s\n", ddp_last_error(NULL));
        return 1;
    }
    world = ddp_world_size(g);
    gethostname(host, sizeof host - 1);
    memset(mine, 0, sizeof mine);
    snprintf(mine, sizeof mine, "rank %d of %d, local rank %d of %d, host %s, pid %ld, started by %s", ddp_rank(g),
             world, ddp_local_rank(g), ddp_local_world_size(g), host, (long)getpid(), launcher());
    all = (char *)malloc((size_t)LINE * (size_t)world);
    if (!all || ddp_all_gather(g, mine, all, LINE, DDP_U8) != DDP_SUCCESS) {
        fprintf(stderr, "rank %d: all_gather failed: %s\n", ddp_rank(g), all ? ddp_last_error(g) : "out of memory");
        return 1;
    }
    if (ddp_rank(g) == 0)
        for (r = 0; r < world; r++) printf("%s\n", all + (size_t)r * LINE);
    free(all);
    return ddp_destroy(g) == DDP_SUCCESS ? 0 : 1;
}
