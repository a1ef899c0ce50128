"""torch_sampler.py: the torch peer of bench/bench_sampler.sh.

Measures torch.utils.data.distributed.DistributedSampler for one rank at n samples: the time to the first
index (torch builds the whole permutation of n first), the time for the whole epoch, and the process's peak
resident memory. Setting (the same as bench/bench_sampler.c): num_replicas 8, rank 3, shuffle, seed 0,
epoch 1. The dataset is only a length, so the figures are the sampler's own.

Run (torch 1.13 at /usr/bin/python3; n may be written 1e8):
    /usr/bin/python3 bench/peers/torch_sampler.py [n=1e8]
Output, one line of key=value fields (bench_sampler.sh parses them by name):
    n=100000000 num_samples=12500000 first_index=... time_to_first=20.60s full_iteration=23.10s peak_rss=4816MiB
"""
import resource
import sys
import time

from torch.utils.data.distributed import DistributedSampler

n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10**8


class LengthOnly:
    """A dataset that is only a length: the sampler never touches items."""

    def __len__(self):
        return n


sampler = DistributedSampler(LengthOnly(), num_replicas=8, rank=3, shuffle=True, seed=0)
sampler.set_epoch(1)
t0 = time.perf_counter()
it = iter(sampler)
first = next(it)
t1 = time.perf_counter()
count = 1 + sum(1 for _ in it)
t2 = time.perf_counter()
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux
print(f"n={n} num_samples={count} first_index={first} time_to_first={t1 - t0:.2f}s "
      f"full_iteration={t2 - t0:.2f}s peak_rss={peak_mib:.0f}MiB")
