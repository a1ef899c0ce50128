"""torch_fsdp2.py: the torch peer of bench/bench_fsdp.sh (torch >= 2.6: FSDP2's fully_shard).

The MLP of bench/bench_fsdp.c: 8 x (Linear(1024, 1024) + ReLU) = 8.4M parameters, per-rank batch 64,
MSE loss, SGD lr 1e-2, 2 ranks x 1 thread on CPU/gloo. Two models in the same processes, taking turns in
blocks of BLOCK steps (the first of each block untimed) after one untimed round: DDP, and FSDP2 with
fully_shard on each Linear and then on the root (reshard_after_forward left at its default). Prints
rank 0's median step time of each (zero_grad, forward, backward, optimizer step) and their ratio.

Run in the chroot of tools/torch-current.sh (Debian's torch 2.x has no libuv: USE_LIBUV=0, a tcp://
rendezvous; torchrun does not start there, so mp.start_processes spawns the ranks):
    tools/torch-current.sh run env USE_LIBUV=0 GLOO_SOCKET_IFNAME=lo python3 bench/peers/torch_fsdp2.py [steps=20] [block=5]
Output (bench_fsdp.sh reads the "torch DDP" and "torch FSDP2" lines):
    torch 2.14.1, 2 ranks x 1 thread, gloo, 8.4M params, batch 64, 20 timed steps per model
    torch DDP   step 471.0 ms
    torch FSDP2 step 613.0 ms  (1.301x DDP)
"""
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

L, D, B, LR, RANKS = 8, 1024, 64, 1e-2, 2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(L) for m in (torch.nn.Linear(D, D), torch.nn.ReLU())])


def worker(rank, port, steps, block, queue):
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    ddp = DDP(model())
    fsdp = model()
    for m in fsdp:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(fsdp)
    nets = {"DDP": ddp, "FSDP2": fsdp}
    opts = {k: torch.optim.SGD(v.parameters(), lr=LR) for k, v in nets.items()}
    g = torch.Generator().manual_seed(1000 + rank)
    x, target = torch.rand(B, D, generator=g) * 2 - 1, torch.rand(B, D, generator=g) - 0.5
    times = {k: [] for k in nets}
    rounds = (steps + block - 1) // block
    for rnd in range(-1, rounds):
        for k, net in nets.items():
            for i in range(block + 1):
                t0 = time.perf_counter()
                opts[k].zero_grad()
                ((net(x) - target) ** 2).mean().backward()
                opts[k].step()
                if rnd >= 0 and i > 0:
                    times[k].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    block = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(port, steps, block, queue), nprocs=RANKS, start_method="spawn")
    t = queue.get()
    print(f"torch {torch.__version__}, {RANKS} ranks x 1 thread, gloo, {L * (D * D + D) / 1e6:.1f}M params, batch {B}, "
          f"{(steps + block - 1) // block * block} timed steps per model")
    print(f"torch DDP   step {t['DDP'] * 1e3:.1f} ms")
    print(f"torch FSDP2 step {t['FSDP2'] * 1e3:.1f} ms  ({t['FSDP2'] / t['DDP']:.3f}x DDP)")


if __name__ == "__main__":
    os.environ.setdefault("USE_LIBUV", "0")
    main()
