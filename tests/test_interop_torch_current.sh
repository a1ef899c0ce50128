#!/usr/bin/env bash
# ddp.h against CURRENT torch (2.x: Debian sid's python3-torch, in the chroot tools/torch-current.sh makes),
# beside the torch 1.13 suites (test_interop_store.sh, test_interop_sampler.sh, ...):
#  1. the store both ways in torch 2.x's TCPStore protocol (tests/interop/store_interop.py): torch 2.x's
#     client against ddp.h's server step by step beside torch's own server, ddp.h's client against torch's
#     server, a torch worker and ddp.h workers sharing the agent store, and whole ddp.h programs (ddp_init,
#     all_reduce) as torchrun's workers on one node and on two. Debian's torch 2.x is built without libuv,
#     and its torchrun then fails before any worker starts ("use_libuv was requested but PyTorch was built
#     without libuv support", even with USE_LIBUV=0): the script plays torchrun's agent with torch's own
#     TCPStore(is_master=True, use_libuv=False) and torchrun's worker environment.
#  2. the sampler: the 560 recorded cases of tests/interop/sampler_torch.py made by current torch, and
#     current torch's own DistributedSampler at N = 214748364 (the inside-out randperm regime; ~1 min and
#     ~3 GiB); SAMPLER_TORCH_LARGE=1 adds N = 300000007.
# Skips (exit 77) when the chroot is absent (make it: tools/torch-current.sh create, about 2 GB and a few
# minutes) or when not root (chroot needs it).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
TC=tools/torch-current.sh
if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
  echo "skipped: the current-torch chroot needs root (chroot, bind mounts)"
  exit 77
fi
if ! ver=$($TC status 2>/dev/null | tail -1); then
  echo "skipped: no current-torch chroot at $($TC root) (make it: $TC create; about 2 GB, a few minutes)"
  exit 77
fi
echo "current torch: $ver (chroot $($TC root))"
case "${SAN:-}" in
  address) SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" ;;
  thread) SANFLAGS="-fsanitize=thread" ;;
  *) SANFLAGS="" ;;
esac
W="$BUILD/interop-current"
mkdir -p "$W"
# shellcheck disable=SC2086
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests tests/interop/store_peer.c \
  -o "$W/store_peer" -lm $SANFLAGS
# shellcheck disable=SC2086
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. tests/progs/allreduce.c \
  -o "$W/allreduce" -lm $SANFLAGS
# shellcheck disable=SC2086
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests -o "$W/sampler_check" \
  tests/interop/sampler_check.c -lm $SANFLAGS

echo "== store (torch 2.x's TCPStore protocol)"
$TC run python3 tests/interop/store_interop.py "$W/store_peer" "$W/allreduce"

echo "== sampler: recorded cases from current torch"
$TC run python3 tests/interop/sampler_torch.py > "$W/sampler_cases.txt"
"$W/sampler_check" < "$W/sampler_cases.txt"
if [ -n "${SAN:-}" ]; then
  echo "SKIP-PART large-N sampler part: not run under sanitizers (SAN=$SAN)"
  exit 0
fi
avail_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
if [ "$avail_kib" -lt $((4 * 1024 * 1024)) ]; then
  echo "SKIP-PART large-N sampler part: needs 4 GiB of free memory, $((avail_kib / 1024)) MiB available"
  exit 0
fi
NS="214748364"
[ "${SAMPLER_TORCH_LARGE:-0}" = 1 ] && NS="$NS 300000007"
R=1000 RANK=7 SEED=5 EPOCH=2
for N in $NS; do
  $TC run python3 tests/interop/sampler_torch_large.py $N $R $RANK $SEED $EPOCH > "$W/sampler_torch_$N.txt"
  "$W/sampler_check" slice $N $R $RANK $SEED $EPOCH 0 > "$W/sampler_ddp_$N.txt"
  cmp "$W/sampler_ddp_$N.txt" "$W/sampler_torch_$N.txt"
  echo "N=$N: $(wc -l < "$W/sampler_ddp_$N.txt") indices of rank $RANK/$R equal current torch's own"
done
