#!/usr/bin/env bash
# ddp.h beside Open MPI and Gloo: all_reduce (f32 sum) bus bandwidth, in one run, medians of R rounds.
#   bench/compare_allreduce.sh [ranks=2] [max_bytes=268435456] [rounds=3]
# Each round runs every contender once (interleaved, so load changes hit all of them alike); the
# table shows each one's median busbw (GB/s) per size and the ratios ddp.h / peer.
# Contenders: ddp.h over shared memory on ddp_alloc buffers (ddp_shm_lib: single-copy) and on malloc
# buffers (ddp_shm: staged through the segment), ddp.h with DDP_TRANSPORT=tcp, Open MPI (default = its
# shared memory), Open MPI with --mca btl tcp,self, and torch.distributed gloo. Needs openmpi-bin,
# libopenmpi-dev and python3-torch (tools/install-test-deps.sh); missing peers are left out.
set -eu
cd "$(dirname "$0")/.."
n=${1:-2} max=${2:-268435456} rounds=${3:-3}
BUILD=${BUILD:-build}
peers=../shared/peers
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
make -s "$BUILD/bench_collectives" "$BUILD/ddprun"
have_mpi=0; have_gloo=0
if command -v mpicc >/dev/null && [ -f $peers/mpi_allreduce.c ]; then mpicc -O2 -o "$out/mpi_allreduce" $peers/mpi_allreduce.c && have_mpi=1; fi
/usr/bin/python3 -c "import torch" 2>/dev/null && [ -f $peers/gloo_allreduce.py ] && have_gloo=1
mpirun="mpirun --allow-run-as-root --oversubscribe -np $n"
for r in $(seq 1 "$rounds"); do
  "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" --lib all_reduce "$max" > "$out/ddp_shm_lib.$r"
  "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" all_reduce "$max" > "$out/ddp_shm.$r"
  DDP_TRANSPORT=tcp "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" all_reduce "$max" > "$out/ddp_tcp.$r"
  if [ $have_mpi = 1 ]; then
    $mpirun "$out/mpi_allreduce" "$max" > "$out/mpi.$r"
    $mpirun --mca btl tcp,self "$out/mpi_allreduce" "$max" > "$out/mpi_tcp.$r"
  fi
  [ $have_gloo = 1 ] && (cd "$out" && /usr/bin/python3 "$OLDPWD/$peers/gloo_allreduce.py" "$n" "$max" > "$out/gloo.$r" 2>/dev/null)
done
python3 - "$out" "$rounds" "$n" <<'PY'
import sys, statistics, glob, os
out, rounds, n = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def table(name):  # {bytes: [busbw per round]}
    t = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"{name}.{r}")
        if not os.path.exists(path): return None
        for line in open(path):
            f = line.split()
            if not f or not f[0].isdigit(): continue
            t.setdefault(int(f[0]), []).append(float(f[-1]))
    return {b: statistics.median(v) for b, v in t.items()}
cols = [(k, table(k)) for k in ("ddp_shm_lib", "ddp_shm", "ddp_tcp", "mpi", "mpi_tcp", "gloo")]
cols = [(k, t) for k, t in cols if t]
print(f"all_reduce f32 sum, {n} ranks, busbw GB/s (median of {rounds} rounds)")
hdr = f"{'bytes':>11} " + " ".join(f"{k:>11}" for k, _ in cols)
pairs = (("ddp_shm_lib", "mpi"), ("ddp_shm", "mpi"), ("ddp_shm_lib", "gloo"), ("ddp_shm", "gloo"), ("ddp_tcp", "mpi_tcp"))
ratios = [(a, b) for a, b in pairs if a in dict(cols) and b in dict(cols)]
hdr += "".join(f" {a.replace('ddp_','')+'/'+b:>12}" for a, b in ratios)
print(hdr)
d = dict(cols)
for b in sorted(d["ddp_shm"]):
    row = f"{b:>11} " + " ".join(f"{t.get(b, float('nan')):>11.3f}" for _, t in cols)
    for x, y in ratios:
        row += f" {d[x].get(b, float('nan')) / d[y].get(b, float('nan')):>12.2f}" if d[y].get(b) else f" {'-':>12}"
    print(row)
PY
