#!/usr/bin/env bash
# The time of one small collective called back to back (bench/bench_latency.c) beside Open MPI
# (bench/peers/mpi_latency.c, the same loop) and, with BASE=<git revision>, beside ddp.h as it was at
# that revision (its ddp.h, this bench program): what a change did, measured in the same run.
#   bench/compare_latency.sh [rounds=5] [count=16 f32 per rank] [calls=300000]
#   OPS="all_reduce barrier all_to_all gather scatter all_to_all_v all_gather_v", RANKS="2", BASE=HEAD~1
# Each round runs every program once per op and rank count, interleaved, so load that comes and goes
# hits all alike; each run prints the median of 3 repetitions, the table the median over the rounds.
# Ranks are pinned one to a core (taskset for ddp.h, --bind-to core for Open MPI, which binds so by
# default) when there are no more ranks than cores, and left to the scheduler otherwise.
set -eu
cd "$(dirname "$0")/.."
rounds=${1:-5} count=${2:-16} calls=${3:-300000}
OPS=${OPS:-all_reduce barrier all_to_all gather scatter all_to_all_v all_gather_v} RANKS=${RANKS:-2}
BUILD=${BUILD:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
make -s "$BUILD/bench_latency" "$BUILD/ddprun"
progs=(ddp)
cp "$BUILD/bench_latency" "$out/ddp"
if [ -n "${BASE:-}" ]; then
  mkdir "$out/base_src"
  git show "$BASE:ddp.h" > "$out/base_src/ddp.h"
  ${CC:-cc} -std=c99 -O2 -pthread -I"$out/base_src" -o "$out/base" bench/bench_latency.c -lm
  progs=(base ddp)
fi
have_mpi=0
if command -v mpicc >/dev/null; then mpicc -O2 -o "$out/mpi" bench/peers/mpi_latency.c && have_mpi=1; fi
[ $have_mpi = 1 ] || echo "Open MPI left out: needs mpicc (apt-get install openmpi-bin libopenmpi-dev)" >&2
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for r in $(seq 1 "$rounds"); do
  for op in $OPS; do
    for n in $RANKS; do
      pin=() bind=(--oversubscribe --bind-to none)
      if [ "$n" -le "$cores" ]; then
        pin=(/bin/bash -c 'exec taskset -c $((RANK % '"$cores"')) "$0" "$@"') bind=(--bind-to core)
      fi
      for p in "${progs[@]}"; do
        "$BUILD/ddprun" --nproc-per-node "$n" --standalone "${pin[@]}" "$out/$p" "$op" "$count" "$calls" 2>/dev/null |
          sed -n "s/^median_us /$p $op $n /p" >> "$out/times"
      done
      [ $have_mpi = 1 ] && mpirun --allow-run-as-root -np "$n" "${bind[@]}" "$out/mpi" "$op" "$count" "$calls" 2>/dev/null |
        sed -n "s/^median_us /mpi $op $n /p" >> "$out/times"
    done
  done
done
python3 - "$out/times" "$rounds" "$count" "${BASE:-}" <<'PY'
import sys, statistics
path, rounds, count, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t = {}
for line in open(path):
    p, op, n, us = line.split()
    t.setdefault((op, int(n)), {}).setdefault(p, []).append(float(us))
print(f"\none small collective called back to back, {count} f32 ({count * 4} bytes) per rank, us per call "
      f"(median of {rounds} rounds)" + (f"; base = ddp.h at {base}" if base else ""))
cols = (["base"] if base else []) + ["ddp", "mpi"]
print(f"{'op':>14} {'ranks':>5} " + " ".join(f"{c + '_us':>9}" for c in cols) +
      (f" {'ddp/base':>9}" if base else "") + f" {'ddp/mpi':>8}")
for (op, n), v in t.items():
    m = {c: statistics.median(v[c]) for c in cols if c in v}
    cells = " ".join(f"{m[c]:>9.3f}" if c in m else f"{'-':>9}" for c in cols)
    ratio = lambda a, b: f"{m[a] / m[b]:>8.2f}" if a in m and b in m else f"{'-':>8}"
    print(f"{op:>14} {n:>5} {cells}" + (f" {ratio('ddp', 'base'):>9}" if base else "") + f" {ratio('ddp', 'mpi')}")
PY
