#!/usr/bin/env bash
# Several hosts on one machine: two network namespaces joined by a veth pair, two ranks in each.
# Ranks in different namespaces count as different hosts, so the group talks TCP across the veth
# link. The full collectives test (every collective x dtype x op x count) must pass, first on a
# plain link, then with `tc netem` adding 5 ms of delay (skipped where netem is unavailable).
# Needs root and iproute2; skips (77) otherwise. Traffic stays inside the namespaces made here.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
prog=$BUILD/test_collectives
[ "$(id -u)" -eq 0 ] || { echo "needs root for ip netns"; exit 77; }
command -v ip >/dev/null || { echo "needs iproute2 (ip)"; exit 77; }
tag=ddp$$
a=${tag}a b=${tag}b
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
trap cleanup EXIT
ip netns add "$a" && ip netns add "$b" || { echo "cannot create network namespaces here"; exit 77; }
ip link add "v$tag" type veth peer name "w$tag" || { echo "cannot create a veth pair here"; exit 77; }
ip link set "v$tag" netns "$a" && ip link set "w$tag" netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev "v$tag" && ip -n "$b" addr add 10.77.0.2/24 dev "w$tag"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "v$tag" up && ip -n "$b" link set "w$tag" up

run_hosts() { # run 4 ranks: 0,1 on host a (the master), 2,3 on host b
  local port=$((20000 + RANDOM % 20000)) pids=() rc=0 r ns
  for r in 0 1 2 3; do
    ns=$a; [ $r -ge 2 ] && ns=$b
    ip netns exec "$ns" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 \
      MASTER_PORT=$port TEST_EXTERNAL_LAUNCH=1 DDP_TIMEOUT=120 ${TEST_QUICK:+TEST_QUICK=1} "$prog" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

start=$(date +%s)
run_hosts || { echo "FAIL: collectives across two namespace hosts"; exit 1; }
echo "ok: every collective across 2 hosts x 2 ranks over TCP ($(( $(date +%s) - start )) s)"
if ip netns exec "$a" tc qdisc add dev "v$tag" root netem delay 5ms 2>/dev/null; then
  start=$(date +%s)
  TEST_QUICK=1 run_hosts || { echo "FAIL: collectives across hosts with 5 ms netem delay"; exit 1; }
  echo "ok: every collective (small counts) with 5 ms netem delay ($(( $(date +%s) - start )) s)"
else
  echo "note: tc netem is unavailable here (sch_netem); the delayed-link run was skipped"
fi
