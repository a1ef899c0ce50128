"""gloo_allreduce.py: the Gloo peer of bench/compare_allreduce.sh (its gloo column).

Measures torch.distributed.all_reduce (float32 sum, gloo backend, CPU tensors) at every size 4 B, 16 B,
64 B, ... (x4 each step) up to max_bytes, with n local processes (torch.multiprocessing.spawn, one torch
thread each), and prints on rank 0 the same nccl-tests columns as mpi_allreduce.c (a header line, then one
row per size whose first field is the byte count):

       bytes    time_us  algbw_GBs  busbw_GBs

time_us: mean time of one call; algbw = bytes / time; busbw = algbw * 2 (n - 1) / n. Each size runs one
warm-up call and a barrier, then 200 timed calls below 256 KiB, 20 below 16 MiB and 5 above.

Run (torch 1.13 from Debian's python3-torch is at /usr/bin/python3):
    /usr/bin/python3 bench/peers/gloo_allreduce.py [ranks=2] [max_bytes=67108864]
The rendezvous is on 127.0.0.1 at MASTER_PORT if set, else at a free port.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank, n, max_bytes, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)
    if rank == 0:
        print(f"{'bytes':>12} {'time_us':>10} {'algbw_GBs':>10} {'busbw_GBs':>10}", flush=True)
    count = 1
    while count * 4 <= max_bytes:
        t = torch.ones(count)  # float32
        iters = 200 if count < 65536 else (20 if count < (1 << 22) else 5)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t0) / iters
        algbw = count * 4 / dt / 1e9
        if rank == 0:
            print(f"{count * 4:>12} {dt * 1e6:>10.1f} {algbw:>10.3f} {algbw * 2 * (n - 1) / n:>10.3f}", flush=True)
        count *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20
    port = int(os.environ.get("MASTER_PORT") or free_port())
    mp.spawn(run, args=(n, max_bytes, port), nprocs=n)
