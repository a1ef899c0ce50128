"""torch_ddp_overhead.py: the torch DDP peer of bench/bench_reducer.sh.

Measures the per-step overhead of torch.nn.parallel.DistributedDataParallel (gloo backend, CPU) on a
~25M-parameter MLP: 5 x (Linear(2236, 2236), Tanh), MSE loss, SGD. The overhead is the median step time
(zero_grad, forward, backward, optimizer step) of R ranks under DDP minus that of one process without DDP,
at the same per-rank batch; one torch thread per process; 10 timed steps after 2 warm-up steps. The model
and the shapes are those of bench/bench_reducer.c, so the two overheads are comparable.

Run (torch 1.13 at /usr/bin/python3):
    /usr/bin/python3 bench/peers/torch_ddp_overhead.py [ranks=2] [per_rank_batch=32]
Output (bench_reducer.sh takes the number after "overhead"):
    params 25.0M  per-rank batch 32  ranks 2
    single-process step 1237.0 ms  DDP step 1393.0 ms  overhead 156.0 ms (1.13x)
The rendezvous is on 127.0.0.1 at MASTER_PORT if set, else at a free port.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, LAYERS, STEPS, WARMUP = 2236, 5, 10, 2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])


def median_step(net, batch):
    """Median wall time of one training step over STEPS steps (after WARMUP)."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, target = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    times = []
    for _ in range(STEPS + WARMUP):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = ((net(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[WARMUP:])
    return times[len(times) // 2]


def worker(rank, ranks, batch, port, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    t = median_step(DDP(model()), batch)
    if rank == 0:
        queue.put(t)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    torch.set_num_threads(1)
    single = median_step(model(), batch)  # one process, no DDP
    queue = mp.get_context("spawn").SimpleQueue()
    port = int(os.environ.get("MASTER_PORT") or free_port())
    mp.start_processes(worker, args=(ranks, batch, port, queue), nprocs=ranks, start_method="spawn")
    ddp = queue.get()
    params = sum(p.numel() for p in model().parameters())
    print(f"params {params / 1e6:.1f}M  per-rank batch {batch}  ranks {ranks}")
    print(f"single-process step {single * 1e3:.1f} ms  DDP step {ddp * 1e3:.1f} ms  "
          f"overhead {1e3 * (ddp - single):.1f} ms ({ddp / single:.2f}x)")
