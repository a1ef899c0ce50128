#!/usr/bin/env bash
# ddp.h beside Open MPI and Gloo: all_reduce (f32 sum) bus bandwidth, in one run, medians of R rounds.
#   bench/compare_allreduce.sh [ranks=2] [max_bytes=268435456] [rounds=3]
#   METRIC=time: the table shows median time per call (us) instead, ratios as peer time / ddp.h time
#   (above 1 = ddp.h faster): the column for latency, where busbw rounds to 0.000.
#   ONLY="ddp_tcp mpi_tcp": run only the contenders named (ddp_shm_lib ddp_shm ddp_shm_staged ddp_tcp mpi
#   mpi_tcp gloo).
# Each round runs every contender once (interleaved, so load changes hit all of them alike); the
# table shows each one's median busbw (GB/s) per size and the ratios ddp.h / peer.
# Contenders: ddp.h over shared memory on ddp_alloc buffers (ddp_shm_lib: single-copy) and on malloc
# buffers (ddp_shm: cross-memory attach from 1 MiB, staged through the segment below; ddp_shm_staged:
# DDP_SHM_CMA=0, always staged), ddp.h with DDP_TRANSPORT=tcp, Open MPI (default = its
# shared memory), Open MPI with --mca btl tcp,self, and torch.distributed gloo. Needs openmpi-bin,
# libopenmpi-dev and python3-torch (tools/install-test-deps.sh); missing peers are left out. The peers
# are bench/peers/mpi_allreduce.c (built here with mpicc) and bench/peers/gloo_allreduce.py; PEERS=dir
# takes them from another folder.
set -eu
cd "$(dirname "$0")/.."
n=${1:-2} max=${2:-268435456} rounds=${3:-3}
METRIC=${METRIC:-busbw}
ONLY=${ONLY:-ddp_shm_lib ddp_shm ddp_shm_staged ddp_tcp mpi mpi_tcp gloo}
want() { case " $ONLY " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
BUILD=${BUILD:-build}
# the peers (mpi_allreduce.c, gloo_allreduce.py): bench/peers/, or the folder PEERS names
peers=${PEERS:-bench/peers}
[ -d "$peers" ] && peers=$(cd "$peers" && pwd) # absolute: Gloo's peer runs from the temporary folder
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
make -s "$BUILD/bench_collectives" "$BUILD/ddprun"
have_mpi=0; have_gloo=0
if command -v mpicc >/dev/null && [ -f "$peers/mpi_allreduce.c" ]; then mpicc -O2 -o "$out/mpi_allreduce" "$peers/mpi_allreduce.c" && have_mpi=1; fi
/usr/bin/python3 -c "import torch" 2>/dev/null && [ -f "$peers/gloo_allreduce.py" ] && have_gloo=1
[ $have_mpi = 1 ] || echo "Open MPI left out: needs mpicc and $peers/mpi_allreduce.c" >&2
[ $have_gloo = 1 ] || echo "Gloo left out: needs torch at /usr/bin/python3 and $peers/gloo_allreduce.py" >&2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} # what ddprun would set for its workers anyway
mpirun="mpirun --allow-run-as-root --oversubscribe -np $n"
# The memory floor: whatever the algorithm, an all_reduce of N bytes on p ranks of one host must at least
# read every rank's input and write every rank's output through the host's memory, 2pN bytes, so no
# run can beat 2pN bytes / the host's memory bandwidth. This machine's rate for such traffic: p processes at once, each
# running a[i] += b[i] over 256 MiB (reads and writes counted), best of 5 passes, once per round.
cat > "$out/membw.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int p, k, np = atoi(argv[1]), fd[2];
    size_t n = ((size_t)256 << 20) / 4, i;
    double sum = 0, r;
    if (pipe(fd)) return 1;
    for (p = 0; p < np; p++)
        if (fork() == 0) {
            float *a = malloc(n * 4), *b = malloc(n * 4);
            double best = 1e9;
            for (i = 0; i < n; i++) a[i] = 1, b[i] = 2;
            for (k = 0; k < 5; k++) {
                double t0 = now(), t;
                for (i = 0; i < n; i++) a[i] += b[i];
                t = now() - t0;
                best = t < best ? t : best;
            }
            r = 3.0 * n * 4 / best / 1e9 + (a[7] == 0);
            _exit(write(fd[1], &r, sizeof r) != sizeof r);
        }
    for (p = 0; p < np; p++) sum += read(fd[0], &r, sizeof r) == sizeof r ? r : 0;
    while (wait(NULL) > 0) {}
    printf("%.3f\n", sum);
    return 0;
}
C
cc -O3 -march=native -o "$out/membw" "$out/membw.c"
for r in $(seq 1 "$rounds"); do
  want ddp_shm_lib && "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" --lib all_reduce "$max" > "$out/ddp_shm_lib.$r"
  want ddp_shm && "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" all_reduce "$max" > "$out/ddp_shm.$r"
  want ddp_shm_staged && DDP_SHM_CMA=0 "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" all_reduce "$max" > "$out/ddp_shm_staged.$r"
  want ddp_tcp && DDP_TRANSPORT=tcp "$BUILD/ddprun" --nproc-per-node "$n" --standalone "$BUILD/bench_collectives" all_reduce "$max" > "$out/ddp_tcp.$r"
  if [ $have_mpi = 1 ]; then
    want mpi && $mpirun "$out/mpi_allreduce" "$max" > "$out/mpi.$r"
    want mpi_tcp && $mpirun --mca btl tcp,self "$out/mpi_allreduce" "$max" > "$out/mpi_tcp.$r"
  fi
  want gloo && [ $have_gloo = 1 ] && (cd "$out" && /usr/bin/python3 "$peers/gloo_allreduce.py" "$n" "$max" > "$out/gloo.$r" 2>/dev/null)
  [ "$METRIC" = busbw ] && "$out/membw" "$n" > "$out/membw.$r"
done
python3 - "$out" "$rounds" "$n" "$METRIC" <<'PY'
import sys, statistics, glob, os
out, rounds, n, metric = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
col = -3 if metric == "time" else -1  # every contender prints ... time_us algbw busbw
def table(name):  # {bytes: [busbw per round]}
    t = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"{name}.{r}")
        if not os.path.exists(path): return None
        for line in open(path):
            f = line.split()
            if not f or not f[0].isdigit(): continue
            t.setdefault(int(f[0]), []).append(float(f[col]))
    return {b: statistics.median(v) for b, v in t.items()}
cols = [(k, table(k)) for k in ("ddp_shm_lib", "ddp_shm", "ddp_shm_staged", "ddp_tcp", "mpi", "mpi_tcp", "gloo")]
cols = [(k, t) for k, t in cols if t]
print(f"all_reduce f32 sum, {n} ranks, " + ("time per call in us, ratios peer time / ddp.h time" if metric == "time" else "busbw GB/s")
      + f" (median of {rounds} rounds)")
hdr = f"{'bytes':>11} " + " ".join(f"{k:>11}" for k, _ in cols)
pairs = (("ddp_shm_lib", "mpi"), ("ddp_shm", "mpi"), ("ddp_shm_staged", "mpi"), ("ddp_shm_lib", "gloo"), ("ddp_shm", "gloo"), ("ddp_tcp", "mpi_tcp"))
ratios = [(a, b) for a, b in pairs if a in dict(cols) and b in dict(cols)]
hdr += "".join(f" {a.replace('ddp_','')+'/'+b:>12}" for a, b in ratios)
print(hdr)
d = dict(cols)
for b in sorted(cols[0][1]):
    row = f"{b:>11} " + " ".join(f"{t.get(b, float('nan')):>11.3f}" for _, t in cols)
    for x, y in ratios:
        num, den = (d[y].get(b), d[x].get(b)) if metric == "time" else (d[x].get(b), d[y].get(b))
        row += f" {num / den:>12.2f}" if num and den else f" {'-':>12}"
    print(row)
if metric == "time" or "ddp_shm" not in d: sys.exit(0)
bw = statistics.median(float(open(os.path.join(out, f"membw.{r}")).read()) for r in range(1, rounds + 1))
top = max(d["ddp_shm"])
print(f"memory: {n} processes of a[i] += b[i] move {bw:.1f} GB/s (median of {rounds}); at {top} bytes the floor "
      f"(2pN bytes of traffic) is busbw {bw / (2 * int(n)) * 2 * (int(n) - 1) / int(n):.2f} GB/s", end="")
for k in ("ddp_shm_lib", "ddp_shm", "mpi"):
    if k in d and top in d[k]:
        print(f"; {k} {100 * d[k][top] / (bw / (2 * int(n)) * 2 * (int(n) - 1) / int(n)):.0f}%", end="")
print(" of it")
PY
