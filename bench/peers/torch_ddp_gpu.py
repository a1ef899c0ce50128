"""torch_ddp_gpu.py: the torch DDP peer of `gpu_check bench-reducer` (tools/gpu-check.sh runs both).

The same gradients as gpu_check's reducer benchmark: P = 64 parameters of 256 Ki floats (64 MiB), on one
GPU, one rank, backend nccl. A step is forward + backward of loss = sum_i (p_i * c_i).sum(), whose
backward writes every gradient (one elementwise kernel each, as a layer's would), then a device
synchronize. DDP's overhead is the median step under DistributedDataParallel (bucket_cap_mb 25, as
ddp.h's) minus the median step of the same module without DDP; with gradient_as_bucket_view=True too
(gradients that are views of the buckets: ddp.h's "in place" row). The three modules are timed in turn,
ROUNDS times (20 timed steps after 5 warm-up steps each time), and each figure is the median of its
rounds' medians: the step is mostly Python autograd (~5.5 ms on an H200), whose drift between one
block of steps and the next was as large as DDP's overhead when the three ran once each.

Run (on a GPU machine with torch):
    python3 bench/peers/torch_ddp_gpu.py
Output (key=value lines, for gpu-check.sh's report):
    torch_ddp_step_ms=...  torch_plain_step_ms=...  torch_ddp_overhead_ms=...  torch_ddp_view_overhead_ms=...
"""
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

P, NUMEL, STEPS, WARMUP, ROUNDS = 64, 256 * 1024, 20, 5, 7


class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(P)])

    def forward(self, cs):
        return sum((p * c).sum() for p, c in zip(self.ps, cs))


def median_step(net, cs):
    times = []
    for _ in range(STEPS + WARMUP):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        net(cs).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[WARMUP:])
    return times[len(times) // 2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cs = [torch.randn(NUMEL, device=dev) for _ in range(P)]
    nets = [Params().to(dev), DDP(Params().to(dev), device_ids=[0], bucket_cap_mb=25),
            DDP(Params().to(dev), device_ids=[0], bucket_cap_mb=25, gradient_as_bucket_view=True)]
    rounds = [[median_step(net, cs) for net in nets] for _ in range(ROUNDS)]
    plain, ddp, view = (sorted(r[k] for r in rounds)[ROUNDS // 2] for k in range(3))
    dist.destroy_process_group()
    print(f"torch_ddp_version={torch.__version__}")
    print(f"torch_plain_step_ms={plain * 1e3:.3f}")
    print(f"torch_ddp_step_ms={ddp * 1e3:.3f}")
    print(f"torch_ddp_view_step_ms={view * 1e3:.3f}")
    print(f"torch_ddp_overhead_ms={(ddp - plain) * 1e3:.3f}")
    print(f"torch_ddp_view_overhead_ms={(view - plain) * 1e3:.3f}")
    print("rounds (plain, ddp, view ms): " + "; ".join(", ".join(f"{t * 1e3:.2f}" for t in r) for r in rounds))
