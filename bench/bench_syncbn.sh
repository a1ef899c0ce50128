#!/usr/bin/env bash
# SyncBatchNorm forward(train)+backward on the CPU against torch's BatchNorm2d, same shape, same run.
# Runs $BUILD/bench_syncbn (1 rank = plain BatchNorm, 2 ranks = the global batch split over 2 processes
# with the statistics all_gather and gradient all_reduce) and the peer bench/peers/torch_bn.py
# (torch.nn.BatchNorm2d, one process, one thread, N=32 C=64 56x56), alternately RUNS times (default 3),
# and prints the median of each with the ratio torch / ddp.h (> 1: ddp.h is faster).
# torch 1.13's SyncBatchNorm runs on CUDA only, so the 2-rank row is compared with torch's 1-process time.
# Env: BUILD (default build), RUNS, PEERS (the peers' folder, default bench/peers), TORCH_BN (path of
# torch_bn.py, default $PEERS/torch_bn.py), PYTHON (default /usr/bin/python3); paths relative to the
# repository root or absolute.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
RUNS=${RUNS:-3}
PYTHON=${PYTHON:-/usr/bin/python3}
PEERS=${PEERS:-bench/peers}
PEER=${TORCH_BN:-$PEERS/torch_bn.py}
make -s BUILD="$BUILD" "$BUILD/bench_syncbn" >/dev/null
have_torch=0
if [ -f "$PEER" ] && "$PYTHON" -c "import torch" 2>/dev/null; then have_torch=1; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in $(seq "$RUNS"); do
  "$BUILD/bench_syncbn" 1 2 >"$out/ddp.$i"
  if [ $have_torch = 1 ]; then "$PYTHON" "$PEER" >"$out/torch.$i"; fi
done
head -n 1 "$out/ddp.1"
echo "# $RUNS alternating runs, medians; torch: $([ $have_torch = 1 ] && echo "$PEER (BatchNorm2d, 1 process, 1 thread)" || echo "not available")"
median() { sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "nan"; else print v[int((NR + 1) / 2)]}'; }
printf "%-15s %5s %12s %12s %14s\n" layout ranks ddp_ms torch_ms torch/ddp
for layout in channels_first channels_last; do
  t=nan
  if [ $have_torch = 1 ]; then
    t=$(cat "$out"/torch.* | awk -v l="$layout:" '$1 == l {print $3}' | median)
  fi
  for ranks in 1 2; do
    d=$(cat "$out"/ddp.* | awk -v l="$layout" -v r="$ranks" '$1 == l && $2 == r {print $3}' | median)
    ratio=$(awk -v t="$t" -v d="$d" 'BEGIN {if (t == "nan" || d == 0) print "-"; else printf "%.2f", t / d}')
    printf "%-15s %5s %12s %12s %14s\n" "$layout" "$ranks" "$d" "$t" "$ratio"
  done
done
