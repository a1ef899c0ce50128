"""Cases for tests/test_interop_sampler.sh: what torch 1.13's DistributedSampler hands out.

Writes to stdout, one record per case (tests/interop/sampler_check.c reads them):
  G seed count v...                       torch's random64() low 62 bits (Tensor.random_(0, 2**62)) for seed
  C n R rank seed epoch shuffle drop_last mode count
  v...                                    the indices ("-" when there are none)
seed is written as the uint64 a C program passes (a negative Python seed wraps, as manual_seed does).
  P n R rank seed epoch shuffle drop_last mode each passes count
  v... (one line per pass)                several passes over one sampler (issue #35):
                                            each 0: set_epoch(epoch) once (epoch -1: never), then `passes`
                                                    passes without set_epoch: torch repeats the same order
                                            each 1: set_epoch(epoch + i) before pass i
mode 0: list(DistributedSampler(...)) after set_epoch(epoch).
mode 1: ddp.h's evaluation mode, derived from torch's own permutation: perm[rank::R] (no padding).
"""
import random
import sys

import torch
from torch.utils.data.distributed import DistributedSampler

U64 = 1 << 64


class Length:  # a dataset that is only a length
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def torch_case(n, replicas, rank, seed, epoch, shuffle, drop_last):
    s = DistributedSampler(Length(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    out = list(s)
    assert len(out) == len(s)
    return out


def eval_case(n, replicas, rank, seed, epoch, shuffle):
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = torch.randperm(n, generator=g).tolist()
    else:
        perm = list(range(n))
    return perm[rank::replicas]


def passes_case(n, replicas, rank, seed, epoch, shuffle, drop_last, mode, each, passes):
    """Every pass of one sampler iterated `passes` times (list(s) is one `for` loop over it)."""
    s = DistributedSampler(Length(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    if epoch >= 0 and not each:
        s.set_epoch(epoch)
    out = []
    for i in range(passes):
        if each:
            s.set_epoch(max(epoch, 0) + i)
        if mode == 0:
            out.append(list(s))
        else:
            out.append(eval_case(n, replicas, rank, seed, s.epoch, shuffle))
    if not each:  # torch's __iter__ recomputes the list from seed + epoch: every pass the same
        assert all(p == out[0] for p in out)
    return out


def emit(out, n, replicas, rank, seed, epoch, shuffle, drop_last, mode, indices):
    out.write(f"C {n} {replicas} {rank} {seed % U64} {epoch} {int(shuffle)} {int(drop_last)} {mode} {len(indices)}\n")
    out.write((" ".join(map(str, indices)) if indices else "-") + "\n")


def random_seed(rng):
    kind = rng.randrange(7)
    if kind == 0:
        return 0
    if kind == 1:
        return rng.randrange(1 << 32)
    if kind == 2:
        return rng.randrange(1 << 32, U64 - (1 << 21))      # >= 2^32: only the low 32 bits count
    if kind == 3:
        return -rng.randrange(1, (1 << 63) - (1 << 21))    # negative: wraps to uint64
    return rng.choice([1 << 32, (1 << 32) - 1, -1, -(1 << 32), U64 - (1 << 21) - 1])


def random_n(rng):
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randrange(0, 4)          # 0 and 1 included
    if kind == 1:
        return rng.randrange(0, 20)
    if kind == 2:
        return rng.randrange(0, 300)
    if kind == 3:
        return rng.randrange(300, 5000)
    if kind == 4:
        return rng.randrange(5000, 60000)
    return rng.randrange(60000, 250000)


def main():
    rng = random.Random(1729)
    out = sys.stdout
    torch_cases = eval_cases = 0

    for seed in (0, 1, 5489, (1 << 32) + 3, -7, U64 - 1):
        g = torch.Generator()
        g.manual_seed(seed)
        vals = torch.empty(8, dtype=torch.int64).random_(0, 1 << 62, generator=g).tolist()
        out.write(f"G {seed % U64} {len(vals)} {' '.join(map(str, vals))}\n")

    # edge cases first: n = 0 and 1, n < R, every rank, both drop_last settings
    for n in (0, 1, 2, 3, 5):
        for replicas in (1, 2, 3, 4, 8):
            for rank in sorted({0, replicas // 2, replicas - 1}):
                for drop_last in (False, True):
                    for shuffle in (True, False):
                        emit(out, n, replicas, rank, 3, 1, shuffle, drop_last, 0,
                             torch_case(n, replicas, rank, 3, 1, shuffle, drop_last))
                        torch_cases += 1

    # random combinations
    for _ in range(260):
        n = random_n(rng)
        replicas = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 64, rng.randrange(1, 400)])
        if rng.random() < 0.15:
            replicas = max(1, n + rng.randrange(1, 9))   # n < R
        rank = rng.randrange(replicas)
        seed = random_seed(rng)
        epoch = rng.choice([0, 1, rng.randrange(100), rng.randrange(1 << 20)])
        shuffle = rng.random() < 0.8
        drop_last = rng.random() < 0.4
        emit(out, n, replicas, rank, seed, epoch, shuffle, drop_last, 0,
             torch_case(n, replicas, rank, seed, epoch, shuffle, drop_last))
        torch_cases += 1

    # evaluation mode, against torch's permutation
    for _ in range(60):
        n = random_n(rng) % 20000
        replicas = rng.choice([1, 2, 3, 4, 7, 8, rng.randrange(1, 50)])
        rank = rng.randrange(replicas)
        seed = random_seed(rng)
        epoch = rng.randrange(50)
        shuffle = rng.random() < 0.8
        emit(out, n, replicas, rank, seed, epoch, shuffle, False, 1, eval_case(n, replicas, rank, seed, epoch, shuffle))
        eval_cases += 1

    # several passes over one sampler, without set_epoch (the same order again) and with it (issue #35)
    pass_cases = 0
    for i in range(80):
        n = rng.choice([0, 1, 2, 10, 23, random_n(rng) % 3000])
        replicas = rng.choice([1, 2, 3, 4, 5, 8, rng.randrange(1, 40)])
        if rng.random() < 0.1:
            replicas = max(1, n + rng.randrange(1, 5))   # n < R
        rank = rng.randrange(replicas)
        seed = random_seed(rng)
        epoch = rng.choice([-1, 0, rng.randrange(100)])
        shuffle = rng.random() < 0.75
        mode = 1 if i % 5 == 4 else 0
        drop_last = mode == 0 and rng.random() < 0.4
        each = i % 3 == 2
        passes = rng.choice([2, 3])
        lists = passes_case(n, replicas, rank, seed, epoch, shuffle, drop_last, mode, each, passes)
        out.write(f"P {n} {replicas} {rank} {seed % U64} {epoch} {int(shuffle)} {int(drop_last)} {mode} {int(each)} "
                  f"{passes} {len(lists[0])}\n")
        for p in lists:
            out.write((" ".join(map(str, p)) if p else "-") + "\n")
        pass_cases += 1

    print(f"torch {torch.__version__}: {torch_cases} DistributedSampler cases, {eval_cases} evaluation-mode cases, "
          f"{pass_cases} multi-pass cases", file=sys.stderr)


if __name__ == "__main__":
    main()
