#!/usr/bin/env bash
# all_to_all and gather (and scatter) of ddp.h beside Open MPI, one host, in one run: medians of R rounds.
#   bench/compare_collectives.sh [rounds=5] [max_bytes_per_rank=4194304] [min_bytes_per_rank=16]
#   OPS="all_to_all gather" (any of all_to_all gather scatter all_to_all_v all_gather_v), RANKS="2 4", TRANSPORT=shm (or tcp: DDP_TRANSPORT=tcp
#   for ddp.h and --mca btl tcp,self for Open MPI), LIB=1: ddp.h on ddp_alloc buffers, TIMING=loop: both time as
#   nccl-tests does (every rank's whole loop of back-to-back calls, averaged over the ranks; default: rank 0
#   times each call on its own, which for gather and scatter is the root's time alone), NOISE=1: Open MPI runs
#   twice per round and a column mpi/mpi gives the ratio of its two medians (an A/A comparison: how far two
#   runs of the same program differ on this machine, so ddp/mpi within that distance of 1 is a tie).
# Each round runs, for every op and rank count, build/bench_collectives under ddprun and
# bench/peers/mpi_alltoall.c under mpirun, one after the other (interleaved, so load changes hit both alike);
# the table gives per size (bytes per rank) the median time per call of each (us), ddp.h's algbw
# (size x n / time, GB/s, as nccl-tests' alltoall) and the ratio ddp/MPI of the times (below 1: ddp.h faster).
set -eu
cd "$(dirname "$0")/.."
rounds=${1:-5} max=${2:-4194304} min=${3:-16}
OPS=${OPS:-all_to_all gather} RANKS=${RANKS:-2 4} TRANSPORT=${TRANSPORT:-shm}
BUILD=${BUILD:-build}
peers=${PEERS:-bench/peers}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
make -s "$BUILD/bench_collectives" "$BUILD/ddprun"
have_mpi=0
if command -v mpicc >/dev/null && [ -f "$peers/mpi_alltoall.c" ]; then mpicc -O2 -o "$out/mpi_alltoall" "$peers/mpi_alltoall.c" && have_mpi=1; fi
[ $have_mpi = 1 ] || echo "Open MPI left out: needs mpicc (apt-get install openmpi-bin libopenmpi-dev) and $peers/mpi_alltoall.c" >&2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ddp_env=() mpi_opt=() lib=()
[ "$TRANSPORT" = tcp ] && ddp_env=(DDP_TRANSPORT=tcp) && mpi_opt=(--mca btl tcp,self)
[ "${LIB:-0}" = 1 ] && lib=(--lib)
loop=() mpi_loop=()
[ "${TIMING:-call}" = loop ] && loop=(--loop) mpi_loop=(loop)
for r in $(seq 1 "$rounds"); do
  for op in $OPS; do
    for n in $RANKS; do
      env "${ddp_env[@]}" "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" "${lib[@]}" "${loop[@]}" "$op" "$max" "$min" > "$out/ddp.$op.$n.$r"
      [ $have_mpi = 1 ] && mpirun --allow-run-as-root --oversubscribe -np "$n" "${mpi_opt[@]}" "$out/mpi_alltoall" "$op" "$max" "$min" "${mpi_loop[@]}" > "$out/mpi.$op.$n.$r"
      [ $have_mpi = 1 ] && [ "${NOISE:-0}" = 1 ] && mpirun --allow-run-as-root --oversubscribe -np "$n" "${mpi_opt[@]}" "$out/mpi_alltoall" "$op" "$max" "$min" "${mpi_loop[@]}" > "$out/mpi2.$op.$n.$r"
    done
  done
done
python3 - "$out" "$rounds" "$OPS" "$RANKS" "$TRANSPORT${LIB:+ lib=$LIB}${TIMING:+ timing=$TIMING}" <<'PY'
import sys, statistics, os
out, rounds, ops, ranks, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
def table(name):  # {bytes per rank: median time_us}; both programs print ... time_us algbw busbw
    t = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"{name}.{r}")
        if not os.path.exists(path): return {}
        for line in open(path):
            f = line.split()
            if f and f[0].isdigit(): t.setdefault(int(f[0]), []).append(float(f[-3]))
    return {b: statistics.median(v) for b, v in t.items()}
def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 and b % (1 << 20) == 0 else f"{b >> 10} KiB" if b >= 1024 and b % 1024 == 0 else f"{b} B"
for op in ops:
    for n in ranks:
        d, m, m2 = table(f"ddp.{op}.{n}"), table(f"mpi.{op}.{n}"), table(f"mpi2.{op}.{n}")
        print(f"\n{op}, {n} ranks, ddp.h {transport} vs Open MPI, median of {rounds} rounds (size = bytes per rank)")
        print(f"{'size':>8} {'ddp_us':>10} {'ddp_algbw':>10} {'mpi_us':>10} {'mpi_algbw':>10} {'ddp/mpi':>8}" +
              (f" {'mpi/mpi':>8}" if m2 else ""))
        for b in sorted(d):
            mt = m.get(b)
            print(f"{size(b):>8} {d[b]:>10.2f} {b * int(n) / d[b] / 1e3:>10.3f} " +
                  (f"{mt:>10.2f} {b * int(n) / mt / 1e3:>10.3f} {d[b] / mt:>8.2f}" if mt else f"{'-':>10} {'-':>10} {'-':>8}") +
                  (f" {mt / m2[b]:>8.2f}" if mt and m2.get(b) else ""))
PY
