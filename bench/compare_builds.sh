#!/usr/bin/env bash
# ddp.h against an earlier ddp.h, in one run: did a change make collectives slower?
#   bench/compare_builds.sh REV [ranks=2] [max_bytes=268435456] [rounds=5] [op=all_reduce]
# Builds build/bench_collectives from the working tree's ddp.h and a copy from REV's ddp.h (git show
# REV:ddp.h), then runs both, interleaved, R rounds on each transport (ddp_alloc buffers over shared
# memory, malloc buffers over shared memory, DDP_TRANSPORT=tcp). Prints, per transport and size, the
# median time per call of each build and the ratio before / after (above 1: the working tree is faster).
# Medians of interleaved rounds, because this machine is shared and noisy: read ratios within about
# +-10% as level. Example: bench/compare_builds.sh 05ce96a 2 268435456 5
# TRANSPORTS="tcp" runs only those of "shm_lib shm tcp" (the default: all three); op barrier gives one row.
# MIN_BYTES=b starts the sizes at b bytes (bench_collectives' min_bytes; default 4).
set -eu
cd "$(dirname "$0")/.."
rev=${1:?usage: bench/compare_builds.sh REV [ranks] [max_bytes] [rounds] [op]}
n=${2:-2} max=${3:-268435456} rounds=${4:-5} op=${5:-all_reduce}
BUILD=${BUILD:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
make -s "$BUILD/bench_collectives" "$BUILD/ddprun"
mkdir -p "$out/before"
git show "$rev:ddp.h" > "$out/before/ddp.h"
cc -std=c99 -O2 -pthread -I"$out/before" -o "$out/bench_before" bench/bench_collectives.c -lm
cp "$BUILD/bench_collectives" "$out/bench_after"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# one run: prints "size time_us" lines
run() { # build transport
  local lib="" env=""
  case $2 in shm_lib) lib=--lib ;; tcp) env="DDP_TRANSPORT=tcp" ;; esac
  env $env "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$out/bench_$1" $lib "$op" "$max" ${MIN_BYTES:-4} 2>/dev/null |
    awk '$1 ~ /^[0-9]+$/ {print $1, $5}'
}
for r in $(seq "$rounds"); do
  for t in ${TRANSPORTS:-shm_lib shm tcp}; do
    for b in before after; do run $b $t >> "$out/$b.$t"; done
  done
  echo "round $r of $rounds done" >&2
done
median() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }
echo "# $op, $n ranks, median time per call (us) of $rounds interleaved rounds: $rev's ddp.h (before) vs the working tree's (after)"
printf '%-8s %12s %12s %12s %8s\n' transport bytes before_us after_us before/after
for t in ${TRANSPORTS:-shm_lib shm tcp}; do
  for size in $(awk '{print $1}' "$out/after.$t" | sort -gu); do
    b=$(awk -v s="$size" '$1 == s {print $2}' "$out/before.$t" | median)
    a=$(awk -v s="$size" '$1 == s {print $2}' "$out/after.$t" | median)
    printf '%-8s %12s %12s %12s %8.2f\n' "$t" "$size" "$b" "$a" "$(awk -v b="$b" -v a="$a" 'BEGIN {print (a > 0 ? b / a : 0)}')"
  done
done
