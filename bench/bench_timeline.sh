#!/usr/bin/env bash
# The timeline's cost on the demo (examples/train_demo.c --quick under ddprun on R ranks): runs without and
# with --timeline, alternating, ROUNDS of each in one invocation; each run's throughput (the demo's own
# "done: N samples/s") and the medians, with on / off. The timeline costs a clock read and a formatted line
# per event (every collective, bucket and pass): the ratio says what that is against a real step.
#     bench/bench_timeline.sh [ranks=4] [rounds=5] [epochs=4]
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
R=${1:-4} ROUNDS=${2:-5} EPOCHS=${3:-4}
make -s "$BUILD/ddprun" "$BUILD/train_demo" >/dev/null
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
run() { # run off|on: samples/s of one demo run
  local extra=""
  [ "$1" = on ] && extra="--timeline $dir/t.json"
  # shellcheck disable=SC2086 # $extra is empty or two words
  "$BUILD/ddprun" --standalone --nproc-per-node "$R" $extra "$BUILD/train_demo" --quick --epochs "$EPOCHS" \
    --dir "$dir/ck" 2>/dev/null | sed -n 's/^done: \([0-9.]*\) samples\/s.*/\1/p'
}
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); $R ranks, train_demo --quick --epochs $EPOCHS, $ROUNDS rounds"
printf '| round | off (samples/s) | on (samples/s) |\n|---|---|---|\n'
offs="" ons=""
for round in $(seq 1 "$ROUNDS"); do
  off=$(run off) on=$(run on)
  printf '| %d | %s | %s |\n' "$round" "$off" "$on"
  offs="$offs$off"$'\n' ons="$ons$on"$'\n'
done
events=$(grep -c '"ph":"X"' "$dir/t.json" || true)
moff=$(printf '%s' "$offs" | median) mon=$(printf '%s' "$ons" | median)
printf '| median | %s | %s |\n' "$moff" "$mon"
awk -v a="$moff" -v b="$mon" -v e="$events" 'BEGIN { printf "on / off: %.3f (the last run with the timeline wrote %d complete events)\n", b / a, e }'
