#!/usr/bin/env bash
# ddp.h's DistributedSampler beside torch's (the peer bench/peers/torch_sampler.py, torch 1.13 at
# /usr/bin/python3), in the same run and interleaved; medians of REPS runs, ratios torch / ddp.h.
#   bench/bench_sampler.sh [N [REPS]]        default N = 1e8, REPS = 3
# Setting of both: num_replicas 8, rank 3, seed 0, epoch 1; one process per run, so peak RSS is the run's own.
# SAMPLER_PEER overrides the peer's path (default $PEERS/torch_sampler.py, PEERS defaulting to bench/peers;
# paths relative to the repository root or absolute).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
N=${1:-1e8}
REPS=${2:-3}
PEERS=${PEERS:-bench/peers}
PEER=${SAMPLER_PEER:-$PEERS/torch_sampler.py}
make -s "$BUILD/bench_sampler" >/dev/null
out=$(mktemp)
trap 'rm -f "$out"' EXIT
have_peer=0
if [ -f "$PEER" ] && /usr/bin/python3 -c "import torch" 2>/dev/null; then have_peer=1; fi
for ((rep = 0; rep < REPS; rep++)); do
  for config in torch torch-array eval streaming; do
    "$BUILD/bench_sampler" --one "$config" "$N" >> "$out"
  done
  if [ $have_peer = 1 ]; then
    /usr/bin/python3 "$PEER" "$N" | sed 's/^/config=torch-1.13 /' >> "$out"
  fi
done
[ $have_peer = 1 ] || echo "note: peer $PEER (or torch at /usr/bin/python3) not found: ddp.h only"
python3 - "$out" "$N" "$REPS" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = dict(re.findall(r"(\w+)=(\S+)", line))
    rows.setdefault(f["config"], []).append(f)
def med(config, key, strip=""):
    return statistics.median(float(r[key].rstrip(strip)) for r in rows[config])
print(f"DistributedSampler, one rank's indices: N={sys.argv[2]}, num_replicas=8, rank=3, seed=0, epoch=1; "
      f"median of {sys.argv[3]} runs")
print(f"{'config':<13}{'num_samples':>12}{'first_index':>12}{'to_first_s':>12}{'full_s':>10}{'peak_MiB':>10}"
      f"{'torch/ddp time':>16}{'torch/ddp mem':>15}")
peer = rows.get("torch-1.13")
for config, r in rows.items():
    first = med(config, "time_to_first", "s")
    full = med(config, "full" if config != "torch-1.13" else "full_iteration", "s")
    rss = med(config, "peak_rss_mib" if config != "torch-1.13" else "peak_rss", "MiB")
    ratio_t = ratio_m = ""
    if peer and config != "torch-1.13":
        ratio_t = f"{med('torch-1.13', 'full_iteration', 's') / full:.1f}x"
        ratio_m = f"{med('torch-1.13', 'peak_rss', 'MiB') / rss:.1f}x"
    print(f"{config:<13}{r[0]['num_samples']:>12}{r[0]['first_index']:>12}{first:>12.3f}{full:>10.3f}{rss:>10.0f}"
          f"{ratio_t:>16}{ratio_m:>15}")
if peer:
    same = all(r["first_index"] == peer[0]["first_index"] for r in rows["torch"] + rows["torch-array"])
    print("first index equals torch's:", "yes" if same else "NO (bit-exactness broken!)")
    if not same:
        sys.exit(1)
PY
