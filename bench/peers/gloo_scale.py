"""gloo_scale.py: the Gloo peer of bench/scale_probe.c (issue #25's table; bench/scale_table.sh runs both).

The same job, with torch.distributed's gloo backend: init_process_group (env://: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT from the launcher, as torchrun or build/ddprun set them), one barrier, two
all_reduces (sum) of a small float64 tensor, destroy_process_group. Each rank prints one line on stdout:

    scale_probe backend=gloo rank=R world=N init_s=X run_s=Y t_start=T0 t_init=T1 import_s=Z

init_s: seconds in init_process_group; run_s: from just before it to just after destroy_process_group
(time.perf_counter), the same span as scale_probe.c's; t_start, t_init: when this rank entered and left
init_process_group, seconds since the epoch (time.time(), comparable between processes): the latest
t_init less the latest t_start is the rendezvous's own time, without the spread of the ranks' imports
that the slowest rank's init_s also contains; import_s: seconds importing torch, before that span (it
is in the launcher's wall time, not in run_s).

The all_reduces are checked against serial math as in scale_probe.c: rank r contributes (r+1)*(i+1) at
element i of 8, so the first sum is S*(i+1) with S = N(N+1)/2 and the second N*S*(i+1); a wrong element
prints where on stderr and exits 1. The group's timeout is 300 s (ddp.h's default; torch's is 30 min).

Run (torch 1.13 from Debian's python3-torch is at /usr/bin/python3):
    build/ddprun --standalone --nproc-per-node 4 /usr/bin/python3 bench/peers/gloo_scale.py
    torchrun --standalone --nproc_per_node 4 bench/peers/gloo_scale.py
"""
import os
import sys
import time

import_start = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import_s = time.perf_counter() - import_start

COUNT = 8


def check_sum(rank, which, t, factor):
    expected = [factor * (i + 1) for i in range(COUNT)]
    got = t.tolist()
    for i in range(COUNT):
        if got[i] != expected[i]:
            print(f"gloo_scale rank {rank}: all_reduce #{which} element {i} is {got[i]!r}, "
                  f"expected {expected[i]!r} (serial sum)", file=sys.stderr, flush=True)
            sys.exit(1)


def main():
    import datetime
    torch.set_num_threads(1)
    t_start = time.time()
    start = time.perf_counter()
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    init_s = time.perf_counter() - start
    t_init = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    sum_of_ranks = world * (world + 1) // 2
    t = torch.tensor([float((rank + 1) * (i + 1)) for i in range(COUNT)], dtype=torch.float64)
    dist.barrier()
    dist.all_reduce(t)
    check_sum(rank, 1, t, sum_of_ranks)
    dist.all_reduce(t)
    check_sum(rank, 2, t, world * sum_of_ranks)
    dist.destroy_process_group()
    run_s = time.perf_counter() - start
    # one write(2) for the whole line: the ranks share the launcher's stdout, and print() under an
    # unbuffered stdout (PYTHONUNBUFFERED) writes the text and its newline apart, which interleaves lines
    line = (f"scale_probe backend=gloo rank={rank} world={world} init_s={init_s:.4f} run_s={run_s:.4f} "
            f"t_start={t_start:.6f} t_init={t_init:.6f} import_s={import_s:.4f}\n")
    os.write(1, line.encode())


if __name__ == "__main__":
    main()
