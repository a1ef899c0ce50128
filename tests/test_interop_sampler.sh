#!/usr/bin/env bash
# ddp.h's DistributedSampler against torch 1.13's (Debian python3-torch at /usr/bin/python3).
#  1. 560 recorded cases (tests/interop/sampler_torch.py): 500 random and edge (n, R, rank, seed, epoch,
#     shuffle, drop_last) combinations -- n = 0 and 1, n < R, seeds >= 2^32 and negative -- plus evaluation
#     mode against torch's permutation, and torch's random64 word order. Each is read back through
#     indices(), the batch iterator, a mid-epoch resume, index_at and step_batch on the R ranks (the
#     step-indexed batch of fault tolerance, steps of batch * R) (tests/interop/sampler_check.c).
#     Plus 80 multi-pass cases: one sampler iterated 2 or 3 times without set_epoch in between (torch
#     repeats the order; so must next_batch after the 0 that ends a pass) or with set_epoch before each.
#  2. The large-N regime of current torch's randperm (N >= 214748364, the inside-out shuffle that torch 2.7
#     introduced) is not in torch 1.13: it is checked against an independent C++ reference written from
#     current torch's source (tests/interop/sampler_ref.cpp, std::mt19937), at N = 214748364 (where the
#     switch happens is checked in test_sampler.c). Needs ~2 GiB of free memory and ~15 s on an idle
#     2-core machine; not run under sanitizers or with less than 3 GiB free, and then reported as a
#     skipped part ("SKIP-PART large-N part: ...", counted by tests/run_tests.sh). SAMPLER_TORCH_LARGE=1
#     also compares the legacy regime at N = 214748364 with torch 1.13 itself (a minute or two more).
set -euo pipefail
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
tl_need_python torch python3-torch
W="$BUILD/interop"
tl_cc "$W/sampler_check" tests/interop/sampler_check.c

"$PY" tests/interop/sampler_torch.py > "$W/sampler_cases.txt"
"$W/sampler_check" < "$W/sampler_cases.txt"

if [ -n "${SAN:-}" ]; then
  echo "SKIP-PART large-N part: not run under sanitizers (SAN=$SAN); run without SAN for it"
  exit 0
fi
avail_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
if [ "$avail_kib" -lt $((3 * 1024 * 1024)) ]; then
  echo "SKIP-PART large-N part: needs 3 GiB of free memory, $((avail_kib / 1024)) MiB available"
  exit 0
fi
${CXX:-c++} -std=c++17 -O2 -Wall -Wextra -Werror -pedantic -o "$W/sampler_ref" tests/interop/sampler_ref.cpp
N=214748364 R=1000 RANK=7 SEED=5 EPOCH=2
"$W/sampler_ref" $N $R $RANK $SEED $EPOCH current > "$W/sampler_ref_current.txt" &
ref_pid=$!
"$W/sampler_check" slice $N $R $RANK $SEED $EPOCH 0 > "$W/sampler_ddp_current.txt"
wait $ref_pid
cmp "$W/sampler_ddp_current.txt" "$W/sampler_ref_current.txt"
echo "N=$N current randperm (inside-out, random64): $(wc -l < "$W/sampler_ddp_current.txt") indices of rank $RANK/$R equal the reference"

if [ "${SAMPLER_TORCH_LARGE:-0}" = 1 ]; then
  "$PY" tests/interop/sampler_torch_large.py $N $R $RANK $SEED $EPOCH > "$W/sampler_torch_legacy.txt"
  "$W/sampler_check" slice $N $R $RANK $SEED $EPOCH 1 > "$W/sampler_ddp_legacy.txt"
  cmp "$W/sampler_ddp_legacy.txt" "$W/sampler_torch_legacy.txt"
  echo "N=$N legacy randperm equals torch 1.13's own"
fi
