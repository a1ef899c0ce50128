#!/usr/bin/env bash
# FSDP (zero_stage 3) against stage 2, plain DDP, and torch's DDP and FSDP2 on the same MLP (FSDP.md G1, G3):
# 8 x (Linear(1024, 1024) + ReLU), batch 64 per rank, SGD, 2 ranks x 1 BLAS thread (bench/bench_fsdp.c).
#   1. ROUNDS runs of build/bench_fsdp under ddprun (every mode in each run, in turns); per mode the median
#      over the runs of each run's median step, and the medians of the ratios taken within each run;
#   2. one process per mode for VmHWM (bench_fsdp mem MODE), rank 0's line and rank 1's;
#   3. the torch peer bench/peers/torch_fsdp2.py in the sid chroot of tools/torch-current.sh (DDP and FSDP2
#      in turns), skipped with a message when the chroot is absent or this is not root.
# Needs Debian's libopenblas0 (apt-get install libopenblas0; bench_fsdp loads it with dlopen).
#     bench/bench_fsdp.sh [steps=20] [rounds=3] [torch_steps=10]
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-20} ROUNDS=${2:-3} TSTEPS=${3:-10}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
make -s "$BUILD/bench_fsdp" "$BUILD/ddprun" >/dev/null
run() { "$BUILD/ddprun" --standalone --nproc-per-node 2 "$BUILD/bench_fsdp" "$@" 2>&1 | grep -v '^ddprun: setting'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
all=""
for round in $(seq 1 "$ROUNDS"); do
  echo "== ddp.h round $round of $ROUNDS (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  out=$(run "$STEPS" 5)
  echo "$out"
  all="$all$out"$'\n'
done
echo "== VmHWM, one process per mode"
for m in s0 s2 s3p0 s3p1 s3p1e; do run mem $m 3 | grep '^mem' | sort; done
tddp="" tfsdp=""
if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
  echo "torch peer not run: the chroot of tools/torch-current.sh needs root"
elif ! tools/torch-current.sh status >/dev/null 2>&1; then
  echo "torch peer not run: no chroot (tools/torch-current.sh create: about 2 GB, 8-15 minutes)"
else
  echo "== torch peer (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  t=$(tools/torch-current.sh run env USE_LIBUV=0 GLOO_SOCKET_IFNAME=lo python3 bench/peers/torch_fsdp2.py "$TSTEPS" 5 2>&1 |
      grep '^torch')
  echo "$t"
  tddp=$(echo "$t" | sed -n 's/^torch DDP *step \([0-9.]*\) ms.*/\1/p')
  tfsdp=$(echo "$t" | sed -n 's/^torch FSDP2 *step \([0-9.]*\) ms.*/\1/p')
fi
# the table: a mode's label is the first 30 characters of its row
col() { printf '%s' "$all" | awk -v m="$1" -v c="$2" 'index($0, m) == 1 && length($0) > 31 { split(substr($0, 31), f); print f[c] }'; }
echo "== summary: medians over $ROUNDS runs of $STEPS steps (ratios taken within each run)"
printf '%-30s %9s %7s %7s %8s %10s\n' mode "step ms" /s2 /s0 exposed unprefetch
for mode in "stage 0 (DDP)" "stage 2" "stage 3 prefetch 0" "stage 3 prefetch 1" "stage 3 prefetch 1, early u0"; do
  label=$(printf '%-30s' "$mode")
  printf '%-30s %9s %7s %7s %8s %10s\n' "$mode" "$(col "$label" 1 | median)" "$(col "$label" 2 | median)" \
    "$(col "$label" 3 | median)" "$(col "$label" 4 | median)" "$(col "$label" 5 | median)"
done
if [ -n "$tddp" ] && [ -n "$tfsdp" ]; then
  awk -v d="$tddp" -v f="$tfsdp" 'BEGIN { printf "%-30s %9.1f\n%-30s %9.1f %7s %7.3f (FSDP2 / torch DDP)\n", "torch DDP", d, "torch FSDP2", f, "", f / d }'
fi
printf '%s' "$all" | grep '^checksum' | sort | uniq -c | sed 's/^ */checksums (runs x): /'
