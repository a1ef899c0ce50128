#!/usr/bin/env bash
# Fault-tolerant mode's cost when nothing fails (FT.md's G7), two ways, same session:
#  1. build/bench_ft: ddp_ft_commit (and begin + commit) against a plain 8-byte all_reduce, 2 ranks on
#     one host (shared memory): medians of 7 rounds of 100000 calls (bench/bench_ft.c);
#  2. the training demo on NPROC ranks (default 4; examples/train_demo.c, DEMO_FLAGS, default "--epochs 4":
#     500 steps of 128 samples on 4 ranks), RUNS times (default 5) each way, alternating: ddprun +
#     train_demo, and ddprun --ft + train_demo --ft; the time of a step is the global batch / the
#     samples per second that the demo prints at its end (its whole training loop, epoch ends included:
#     the plain run also writes a checkpoint per epoch, the --ft run none). Prints each run's, the medians
#     and their ratio, and the median of the ratios of each --ft run to the plain run just before it (less
#     moved by slow drifts of the machine's load).
# No threshold: a report to read. Env: BUILD (default build), RUNS, NPROC, DEMO_FLAGS.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
RUNS=${RUNS:-5}
NPROC=${NPROC:-4}
DEMO_FLAGS=${DEMO_FLAGS:---epochs 4}
make -s BUILD="$BUILD" "$BUILD/bench_ft" "$BUILD/ddprun" "$BUILD/train_demo" >/dev/null
"$BUILD/bench_ft" 2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# step_ms LOG: the demo's time per step in ms, from its "done: N samples/s" line and its global batch
step_ms() {
  awk '/global batch|batch [0-9]+ x/ { for (i = 1; i <= NF; i++) if ($i == "=") g = $(i + 1) + 0 }
       /^done:/ { s = $2 } END { if (!g || !s) print "nan"; else printf "%.4f\n", 1000 * g / s }' "$1"
}
median() { sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "nan"; else print v[int((NR + 1) / 2)]}'; }
echo "# train_demo $DEMO_FLAGS on $NPROC ranks, $RUNS alternating runs each way: ms per step"
for i in $(seq "$RUNS"); do
  "$BUILD/ddprun" --standalone --nproc-per-node "$NPROC" "$BUILD/train_demo" $DEMO_FLAGS --dir "$out/dir_plain" >"$out/plain.log" 2>&1
  step_ms "$out/plain.log" >>"$out/plain"
  "$BUILD/ddprun" --ft --standalone --nproc-per-node "$NPROC" "$BUILD/train_demo" --ft $DEMO_FLAGS --dir "$out/dir_ft" \
    >"$out/ft.log" 2>&1
  step_ms "$out/ft.log" >>"$out/ft"
done
echo "plain: $(tr '\n' ' ' <"$out/plain")"
echo "--ft:  $(tr '\n' ' ' <"$out/ft")"
p=$(median <"$out/plain") f=$(median <"$out/ft")
r=$(paste "$out/ft" "$out/plain" | awk '{ printf "%.3f\n", $1 / $2 }' | median) # each --ft run against the plain run before it
awk -v p="$p" -v f="$f" -v r="$r" 'BEGIN { printf "median ms per step: plain %s, --ft %s (%.3f); median of the runs'"'"' ratios --ft / plain %s\n", p, f, f / p, r }'
