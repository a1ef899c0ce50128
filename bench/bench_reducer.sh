#!/usr/bin/env bash
# DDP per-step overhead, ddp.h's reducer against torch DDP (gloo) on the same shapes, in one run:
# a 25M-parameter MLP (5 x Linear(2236, 2236) + Tanh), R ranks against 1 rank at the same per-rank batch,
# one thread per rank. Each round runs bench_reducer (ddp.h: single process, then R ranks in both modes)
# and then the peer bench/peers/torch_ddp_overhead.py (PEERS=dir takes it from another folder, relative to
# the repository root or absolute); the summary is the median over the rounds of each overhead, and the ratio to torch's
# (the target is <= 0.5). The machine's load is printed before each program: other work running on the
# machine inflates every R-rank number (the R ranks need R free cores), so compare runs at low load.
#     bench/bench_reducer.sh [ranks=2] [batch=32] [steps=10] [rounds=3]
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PEERS=${PEERS:-bench/peers}
R=${1:-2} BATCH=${2:-32} STEPS=${3:-10} ROUNDS=${4:-3}
make -s "$BUILD/bench_reducer" >/dev/null
load() { echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"; }
# the overhead column of the rows whose mode (a 30-character column) starts with $1
overhead() { awk -v m="$1" 'index($0, m) == 1 { split(substr($0, 31), f); print f[3] }'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
have_torch=0
if [ -f "$PEERS/torch_ddp_overhead.py" ] && /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then have_torch=1; fi
ours="" torch=""
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS"
  load
  out=$("$BUILD/bench_reducer" "$R" "$BATCH" "$STEPS")
  echo "$out"
  ours="$ours$out"$'\n'
  if [ $have_torch = 1 ]; then
    load
    t=$(/usr/bin/python3 "$PEERS/torch_ddp_overhead.py" "$R" "$BATCH")
    echo "torch DDP (gloo), $PEERS/torch_ddp_overhead.py $R $BATCH:"
    echo "$t" | sed 's/^/    /'
    torch="$torch$(echo "$t" | sed -n 's/.*overhead \(-\{0,1\}[0-9.]*\) ms.*/\1/p')"$'\n'
  fi
done
[ $have_torch = 1 ] || echo "torch peer not run: $PEERS/torch_ddp_overhead.py missing or /usr/bin/python3 has no torch"
t=$(printf '%s' "$torch" | median)
echo "== medians over $ROUNDS rounds ($R ranks, per-rank batch $BATCH, $STEPS steps each)"
for mode in "ddp.h (copy: DDP default)" "ddp.h gradient_as_bucket_view" "ddp.h uneven_inputs (Join)" "ddp.h flat grads_memory"; do
  runs=$(printf '%s' "$ours" | overhead "$mode")
  o=$(echo "$runs" | median)
  awk -v n="$mode" -v o="$o" -v runs="$(echo $runs)" -v t="$t" 'BEGIN {
    if (t != "" && t > 0) printf "%-30s overhead %7.1f ms (rounds: %s); torch DDP %7.1f ms; ratio %.2f (target <= 0.5)\n", n, o, runs, t, o / t
    else printf "%-30s overhead %7.1f ms (rounds: %s); no torch number\n", n, o, runs }'
done
[ $have_torch = 1 ] && echo "torch DDP (gloo) overheads by round: $(echo $torch)"
exit 0
