"""torch_bn.py: the torch peer of bench/bench_syncbn.sh.

Measures torch.nn.BatchNorm2d forward (training mode) + backward on the CPU, one process, one thread, at
N=32 C=64 H=W=56 (float32, 24.5 MiB of input), in both memory layouts: channels_first (NCHW, contiguous)
and channels_last (NHWC). Each layout runs 8 iterations; the printed time is the median of the last 6.
The shape is that of bench/bench_syncbn.c, whose 1-rank row is compared with these times and whose
2-rank row (the batch split over 2 processes) with the same times (torch 1.13's SyncBatchNorm is CUDA-only).

Run (torch 1.13 at /usr/bin/python3):
    /usr/bin/python3 bench/peers/torch_bn.py
Output, one line per layout (bench_syncbn.sh takes the third field, the milliseconds):
    channels_first: fwd+bwd 32.7 ms for 24 MiB input (0.77 GB/s of x)
    channels_last: fwd+bwd 13.5 ms for 24 MiB input (1.86 GB/s of x)
"""
import time

import torch

torch.set_num_threads(1)
N, C, H, W = 32, 64, 56, 56
ITERS, WARMUP = 8, 2
x = torch.randn(N, C, H, W)
dy = torch.randn(N, C, H, W)
bn = torch.nn.BatchNorm2d(C)
for layout in ("channels_first", "channels_last"):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    xx = x.detach().contiguous(memory_format=fmt).requires_grad_(True)  # a leaf of its own
    d = dy.contiguous(memory_format=fmt)
    times = []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        bn(xx).backward(d)
        times.append(time.perf_counter() - t0)
        xx.grad = None
    times = sorted(times[WARMUP:])
    t = times[len(times) // 2]
    print(f"{layout}: fwd+bwd {t * 1e3:.1f} ms for {x.numel() * 4 / 2**20:.0f} MiB input "
          f"({x.numel() * 4 / t / 1e9:.2f} GB/s of x)")
