"""torch 1.13's own DistributedSampler indices at a large N (slow: about a minute and 2 GiB at N = 2e8).

    sampler_torch_large.py N R RANK SEED EPOCH    prints that rank's indices (shuffle=True, drop_last=False)

Used by tests/test_interop_sampler.sh when SAMPLER_TORCH_LARGE=1, to compare ddp.h's legacy randperm with
torch 1.13 at N >= 214748364. It computes exactly what DistributedSampler.__iter__ does, without building the
Python list of N ints (which would take ~10 GiB): randperm, pad by repeating, take rank::R.
"""
import sys

import torch

n, replicas, rank, seed, epoch = (int(a) for a in sys.argv[1:6])
g = torch.Generator()
g.manual_seed(seed + epoch)
perm = torch.randperm(n, generator=g)
num_samples = -(-n // replicas)
total = num_samples * replicas
idx = torch.arange(rank, total, replicas) % n
sys.stdout.write("\n".join(map(str, perm[idx].tolist())) + "\n")
