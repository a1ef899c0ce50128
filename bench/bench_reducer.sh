#!/usr/bin/env bash
# DDP per-step overhead, ddp.h's reducer against torch DDP (gloo) on the same shapes, in one run:
# a 25M-parameter MLP (5 x Linear(2236, 2236) + Tanh), R ranks against 1 rank at the same per-rank batch,
# one thread per rank. Runs bench_reducer, then the peer ../shared/peers/torch_ddp_overhead.py (relative to
# the repository root; PEERS=dir overrides), then bench_reducer again (the machine's load drifts), and
# prints the ratio of the overheads (the target is <= 0.5).
#     bench/bench_reducer.sh [ranks=2] [batch=32] [steps=10]
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PEERS=${PEERS:-../shared/peers}
R=${1:-2} BATCH=${2:-32} STEPS=${3:-10}
make -s "$BUILD/bench_reducer" >/dev/null
load() { echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"; }
# the overhead column of the row whose mode (a 30-character column) starts with $1
overhead() { awk -v m="$1" 'index($0, m) == 1 { split(substr($0, 31), f); print f[3] }'; }
load
first=$("$BUILD/bench_reducer" "$R" "$BATCH" "$STEPS")
echo "$first"
if [ -f "$PEERS/torch_ddp_overhead.py" ] && /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then
  load
  torch=$(/usr/bin/python3 "$PEERS/torch_ddp_overhead.py" "$R" "$BATCH")
  echo "torch DDP (gloo), $PEERS/torch_ddp_overhead.py $R $BATCH:"
  echo "$torch" | sed 's/^/    /'
else
  echo "torch peer not run: $PEERS/torch_ddp_overhead.py missing or /usr/bin/python3 has no torch"
  torch=""
fi
load
second=$("$BUILD/bench_reducer" "$R" "$BATCH" "$STEPS")
echo "$second" | tail -n 2
t=$(echo "$torch" | sed -n 's/.*overhead \(-\{0,1\}[0-9.]*\) ms.*/\1/p')
for mode in "ddp.h (copy: DDP default)" "ddp.h gradient_as_bucket_view"; do
  a=$(echo "$first" | overhead "$mode"); b=$(echo "$second" | overhead "$mode")
  awk -v n="$mode" -v a="$a" -v b="$b" -v t="$t" 'BEGIN {
    o = (a + b) / 2
    if (t != "" && t > 0) printf "%-30s overhead %7.1f ms (runs: %.1f, %.1f); torch DDP %7.1f ms; ratio %.2f (target <= 0.5)\n", n, o, a, b, t, o / t
    else printf "%-30s overhead %7.1f ms (runs: %.1f, %.1f); no torch number\n", n, o, a, b }'
done
