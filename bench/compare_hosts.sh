#!/usr/bin/env bash
# all_reduce across two hosts played by network namespaces joined by a veth pair, P ranks on each:
# ddp.h's default (hierarchical from 32 KiB: shared memory within each host, a ring between the
# hosts, a shared-memory broadcast; src/hier.c) against the flat TCP ring over all ranks
# (DDP_TRANSPORT=tcp, which is also what ddp.h did for such groups before the hierarchy, and what a
# ring over TCP, Gloo's, does). The peers of compare_allreduce.sh cannot span namespaces (Gloo's
# script and mpirun start every rank on this host), so the comparison is within ddp.h.
# Each round runs both, interleaved; the table shows median busbw (GB/s) and their ratio.
# Usage: bench/compare_hosts.sh [ranks_per_host] [max_bytes] [rounds]   (needs root and iproute2)
set -eu
cd "$(dirname "$0")/.."
per=${1:-2} max=${2:-67108864} rounds=${3:-3}
BUILD=${BUILD:-build}
[ "$(id -u)" -eq 0 ] || { echo "needs root (ip netns)"; exit 1; }
make -s BUILD="$BUILD" "$BUILD/bench_collectives"
tag=bh$$ out=$(mktemp -d /tmp/compare_hosts.XXXXXX)
a=${tag}a b=${tag}b
trap 'ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null; rm -rf "$out"' EXIT
ip netns add "$a" && ip netns add "$b"
ip link add "v$tag" type veth peer name "w$tag"
ip link set "v$tag" netns "$a" && ip link set "w$tag" netns "$b"
ip -n "$a" addr add 10.78.0.1/24 dev "v$tag" && ip -n "$b" addr add 10.78.0.2/24 dev "w$tag"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "v$tag" up && ip -n "$b" link set "w$tag" up

run() { # run NAME [env...]: 2*per ranks, the first per on host a (the master); rank 0's table to out/NAME
  local name=$1 port=$((20000 + RANDOM % 20000)) n=$((2 * per)) r ns pids=()
  shift
  for ((r = 0; r < n; r++)); do
    ns=$a; [ $r -ge "$per" ] && ns=$b
    ip netns exec "$ns" env "$@" RANK=$r WORLD_SIZE=$n LOCAL_RANK=$((r % per)) LOCAL_WORLD_SIZE="$per" \
      MASTER_ADDR=10.78.0.1 MASTER_PORT=$port "$BUILD/bench_collectives" all_reduce "$max" 65536 \
      > "$out/$name.rank$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  mv "$out/$name.rank0" "$out/$name"
}
for ((i = 1; i <= rounds; i++)); do
  run "hier.$i" DDP_TRANSPORT=auto
  run "flat.$i" DDP_TRANSPORT=tcp
done
python3 - "$out" "$rounds" "$per" <<'PY'
import sys, statistics, os
out, rounds, per = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def table(name):
    t = {}
    for r in range(1, rounds + 1):
        for line in open(os.path.join(out, f"{name}.{r}")):
            f = line.split()
            if f and f[0].isdigit(): t.setdefault(int(f[0]), []).append(float(f[-1]))
    return {k: statistics.median(v) for k, v in t.items()}
h, f = table("hier"), table("flat")
print(f"all_reduce f32 sum, 2 hosts (network namespaces, veth) x {per} ranks, busbw GB/s, medians of {rounds} rounds")
print(f"| bytes | ddp.h hierarchical | ddp.h flat TCP ring | hierarchical / flat |\n|---:|---:|---:|---:|")
for k in sorted(h):
    if k in f: print(f"| {k} | {h[k]:.3f} | {f[k]:.3f} | {h[k] / f[k]:.2f} |" if f[k] else f"| {k} | {h[k]:.3f} | {f[k]:.3f} | - |")
PY
