#!/usr/bin/env bash
# Several hosts on one machine: two network namespaces, two ranks in each. Ranks in different namespaces
# count as different hosts, so the group talks TCP across the link between them. Three runs (and a timeline
# across the hosts after the first):
#  1. a plain veth link: the full collectives test (every collective x dtype x op x count) passes, and so
#     does tests/test_more_collectives.c (gather, scatter, all_to_all(_v), all_gather_v, ...);
#  2. an impaired link, 5 ms delay each way + 1% loss + 10% of packets reordered (held 1-2 ms longer):
#     the collectives test (small counts) still matches the serial reference;
#  3. a cut link: 4 ranks run all_reduce + barrier in a loop (tests/netem/collective_loop.c, DDP_TIMEOUT
#     10 s); the link is cut mid-run and every rank must exit non-zero within DDP_TIMEOUT + 20 s with a
#     timeout or lost-peer message naming a rank. The times to detect are printed;
#  4. fault-tolerant mode across a cut link, 3|1 and 2|2 (tests/netem/ft_loop.c): the side with a majority
#     (or half with rank 0) goes on, the other commits nothing alone; the link healed, it rejoins and all
#     four finish.
# Runs 2 and 3 use `tc netem` (and `ip link set down` for the cut) where the kernel has sch_netem; else
# each namespace gets a TUN device instead of the veth end, and tests/netem/netem_relay.py forwards the
# packets between the two with the same impairments (seeded) and cuts the link on SIGUSR1.
# Needs root, iproute2 and /dev/net/tun (or netem); skips (77) otherwise. Traffic stays inside the
# namespaces made here, which are deleted on exit together with the relay and any rank still running.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
prog=$BUILD/test_collectives more=$BUILD/test_more_collectives loop=$BUILD/netem_collective_loop
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
[ "$(id -u)" -eq 0 ] || { echo "needs root for ip netns"; exit 77; }
command -v ip >/dev/null || { echo "needs iproute2 (ip)"; exit 77; }
SANFLAGS=""; [ "${SAN:-}" = address ] && SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
make -s BUILD="$BUILD" SAN="${SAN:-}" "$prog" "$more" || { echo "FAIL: cannot build $prog and $more"; exit 1; }
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread $SANFLAGS -I. -o "$loop" tests/netem/collective_loop.c -lm ||
  { echo "FAIL: cannot build tests/netem/collective_loop.c"; exit 1; }
tag=ddp$$
a=${tag}a b=${tag}b
T=$(mktemp -d /tmp/test_netns.XXXXXX)
RELAY="" PIDS=""
cleanup() {
  local p
  for p in $PIDS; do kill -KILL "$p" 2>/dev/null; done
  [ -n "$RELAY" ] && kill -KILL "$RELAY" 2>/dev/null
  wait 2>/dev/null
  ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# tcp_counters: "retransmitted probes reordered": TCP segments retransmitted so far besides tail-loss probes
# (TLPs fire every few round trips on a delayed link even without loss), TLPs, and reorderings the kernel
# detected, summed over both namespaces: the kernel's own counters, independent of the relay, that show
# the impairments really reached TCP
tcp_counters() {
  local ns
  for ns in "$a" "$b"; do ip netns exec "$ns" cat /proc/net/snmp /proc/net/netstat; done | awk '
    $1 == "Tcp:" || $1 == "TcpExt:" { if (!($1 in hdr)) { for (i = 2; i <= NF; i++) name[$1, i] = $i; hdr[$1] = 1; next }
                                      for (i = 2; i <= NF; i++) v[name[$1, i]] += $i; delete hdr[$1] }
    END { print v["RetransSegs"] - v["TCPLossProbes"], v["TCPLossProbes"] + 0,
                v["TCPSACKReorder"] + v["TCPTSReorder"] + v["TCPRenoReorder"] }'
}
ip netns add "$a" && ip netns add "$b" || { echo "cannot create network namespaces here"; exit 77; }
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip link add "v$tag" type veth peer name "w$tag" || { echo "cannot create a veth pair here"; exit 77; }
ip link set "v$tag" netns "$a" && ip link set "w$tag" netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev "v$tag" && ip -n "$b" addr add 10.77.0.2/24 dev "w$tag"
ip -n "$a" link set "v$tag" up && ip -n "$b" link set "w$tag" up

# start_hosts OUT PROGRAM ARGS...: 4 ranks, 0,1 on host a (the master), 2,3 on host b, in the background;
# rank r's output goes to OUT.r and its pid to PIDS. Extra variables for the ranks come from $RANK_ENV.
# (ON_A=3: ranks 0-2 on host a, rank 3 on host b)
start_hosts() {
  local out=$1 port=$((20000 + RANDOM % 20000)) r ns on_a=${ON_A:-2} lr lw
  shift
  PIDS=""
  for r in 0 1 2 3; do
    ns=$a lr=$r lw=$on_a; [ $r -ge $on_a ] && ns=$b lr=$((r - on_a)) lw=$((4 - on_a))
    ip netns exec "$ns" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$lr LOCAL_WORLD_SIZE=$lw MASTER_ADDR=10.77.0.1 \
      MASTER_PORT=$port TEST_EXTERNAL_LAUNCH=1 ${RANK_ENV:-} "$@" >"$out.$r" 2>&1 &
    PIDS="$PIDS $!"
  done
}
# run_hosts NAME [PROGRAM]: a collectives test (default $prog) on 4 ranks; fails with the ranks' output if one fails
run_hosts() {
  local p rc=0 start program=${2:-$prog}
  start=$(date +%s)
  RANK_ENV="DDP_TIMEOUT=120 ${TEST_QUICK:+TEST_QUICK=1}" start_hosts "$T/coll" "$program"
  for p in $PIDS; do wait "$p" || rc=1; done
  PIDS=""
  [ $rc = 0 ] || { tail -n 5 "$T"/coll.*; fail "$(basename "$program") across two namespace hosts, $1"; }
  ok "$(basename "$program")${TEST_QUICK:+ (small counts)} across 2 hosts x 2 ranks over TCP, $1 ($(( $(date +%s) - start )) s)"
}

run_hosts "plain veth link"
run_hosts "plain veth link" "$more"

# the timeline across the two hosts: every rank measures its clock against rank 0's over the link
# (DDP_TIMELINE_SYNC=all; the namespaces share one clock, so the offsets must come out near 0), each host's
# two files are merged, then the hosts' (ddprun --merge-timeline), and rank 0's broadcast (after 50 ms) must
# start before it ends on the other three
tl_job=$BUILD/timeline_job
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread $SANFLAGS -I. -o "$tl_job" tests/progs/timeline_job.c -lm ||
  fail "cannot build tests/progs/timeline_job.c"
make -s BUILD="$BUILD" SAN="${SAN:-}" "$BUILD/ddprun" || fail "cannot build ddprun"
RANK_ENV="DDP_TIMEOUT=60 DDP_TIMELINE=$T/tl_%r.json DDP_TIMELINE_SYNC=all" start_hosts "$T/tl" "$tl_job" bcast
rc=0; for p in $PIDS; do wait "$p" || rc=1; done; PIDS=""
[ $rc = 0 ] || { tail -n 5 "$T"/tl.*; fail "timeline_job bcast across two namespace hosts"; }
"$BUILD/ddprun" --merge-timeline "$T/tl_a.json" "$T/tl_0.json" "$T/tl_1.json" &&
  "$BUILD/ddprun" --merge-timeline "$T/tl_b.json" "$T/tl_2.json" "$T/tl_3.json" &&
  "$BUILD/ddprun" --merge-timeline "$T/tl_all.json" "$T/tl_a.json" "$T/tl_b.json" || fail "merging the hosts' timelines"
python3 tests/timeline_check.py "$T/tl_all.json" --ranks 4 --bcast-ordered || fail "the two hosts' timeline"
ok "timeline across 2 hosts: clocks measured over the link, hosts merged, the broadcast in order"

# ---- the impaired link: real netem, or the relay over TUN ----
# NETEM_DELAY (ms), NETEM_LOSS and NETEM_REORDER (%) and NETEM_SEED change the impairments, for experiments
D=${NETEM_DELAY:-5} L=${NETEM_LOSS:-1} R=${NETEM_REORDER:-10}
IMPAIR="delay $D ms each way, $L% loss, $R% reordered by 1-2 ms"
if ip netns exec "$a" tc qdisc add dev "v$tag" root netem delay ${D}ms loss $L% reorder $R% 2>/dev/null &&
   ip netns exec "$b" tc qdisc add dev "w$tag" root netem delay ${D}ms loss $L% reorder $R% 2>/dev/null; then
  how="tc netem"
  IMPAIR="delay $D ms each way, $L% loss, $R% reordered (sent at once)"
  cut_link() { ip -n "$a" link set "v$tag" down; ip -n "$b" link set "w$tag" down; }
else
  how="userspace netem relay over TUN (the kernel has no sch_netem)"
  [ -c /dev/net/tun ] || { echo "no sch_netem and no /dev/net/tun: the impaired and cut-link runs cannot run here (plain link ok)"; exit 77; }
  ip -n "$a" link del "v$tag"
  ip -n "$a" tuntap add dev "t$tag" mode tun && ip -n "$b" tuntap add dev "u$tag" mode tun ||
    { echo "cannot create TUN devices here (ip tuntap): the impaired and cut-link runs cannot run (plain link ok)"; exit 77; }
  ip -n "$a" addr add 10.77.0.1/24 dev "t$tag" && ip -n "$b" addr add 10.77.0.2/24 dev "u$tag"
  ip -n "$a" link set "t$tag" up && ip -n "$b" link set "u$tag" up
  "$PY" tests/netem/netem_relay.py --delay "$D" --loss "$L" --reorder "$R" --extra 1,2 --seed "${NETEM_SEED:-1}" \
    "$a" "t$tag" "$b" "u$tag" >"$T/relay.out" 2>"$T/relay.err" &
  RELAY=$!
  for i in $(seq 500); do grep -q ready "$T/relay.out" 2>/dev/null && break; kill -0 $RELAY 2>/dev/null || break; sleep 0.01; done
  grep -q ready "$T/relay.out" || fail "the relay did not start: $(cat "$T/relay.err")"
  cut_link() { kill -USR1 "$RELAY"; }
fi
echo "impaired link: $how; $IMPAIR"
read -r re0 lp0 ro0 < <(tcp_counters)
TEST_QUICK=1 run_hosts "$IMPAIR"
read -r re1 lp1 ro1 < <(tcp_counters)
echo "  TCP in the namespaces during that run: $((re1 - re0)) segments retransmitted (besides $((lp1 - lp0)) tail-loss" \
  "probes), $((ro1 - ro0)) reorderings detected"
[ $((re1 - re0)) -gt 0 ] || [ "$L" = 0 ] || fail "TCP retransmitted nothing over a link that loses $L% of its packets"
[ $((ro1 - ro0)) -gt 0 ] || [ "$R" = 0 ] || fail "TCP saw no reordering over a link that reorders $R% of its packets"
[ -z "$RELAY" ] || kill -0 "$RELAY" 2>/dev/null || fail "the relay died during the run: $(cat "$T/relay.err")"

# ---- the cut link ----
TIMEOUT=10 MARGIN=20
RANK_ENV="DDP_TIMEOUT=$TIMEOUT" start_hosts "$T/loop" "$loop" 120
for i in $(seq 6000); do
  [ "$(cat "$T"/loop.* 2>/dev/null | grep -c looping)" = 4 ] && break
  for p in $PIDS; do kill -0 "$p" 2>/dev/null || { cat "$T"/loop.*; fail "a rank ended before the link was cut"; }; done
  sleep 0.01
done
[ "$(cat "$T"/loop.* | grep -c looping)" = 4 ] || { cat "$T"/loop.*; fail "the ranks never all started looping"; }
sleep 1 # well inside the loop
cut_link
t0=$(now_ms)
r=0 worst=0
for p in $PIDS; do
  while kill -0 "$p" 2>/dev/null && [ $(( $(now_ms) - t0 )) -le $(( (TIMEOUT + MARGIN) * 1000 )) ]; do sleep 0.05; done
  kill -0 "$p" 2>/dev/null && { cat "$T"/loop.*; fail "rank $r still running $((TIMEOUT + MARGIN)) s after the link was cut"; }
  wait "$p"; rc=$?
  dt=$(( $(now_ms) - t0 ))
  [ $dt -gt $worst ] && worst=$dt
  [ $rc != 0 ] || { cat "$T"/loop.*; fail "rank $r exited 0 although the link was cut"; }
  grep -Eq "FAILED.*(DDP_ERR_TIMEOUT|DDP_ERR_PEER_LOST|timed out|lost).*rank [0-9]" "$T/loop.$r" ||
    { cat "$T/loop.$r"; fail "rank $r's message does not name a peer it lost or timed out on"; }
  echo "  rank $r (exited $rc after $dt ms): $(grep FAILED "$T/loop.$r")"
  r=$((r + 1))
done
PIDS=""
ok "cut link ($how): every rank exited non-zero naming a peer; slowest $worst ms after the cut (DDP_TIMEOUT=$TIMEOUT)"
if [ -n "$RELAY" ]; then
  kill -TERM "$RELAY"; wait "$RELAY" 2>/dev/null; RELAY=""
  sed 's/^/  /' "$T/relay.err"
fi

# ---- fault-tolerant mode (DDP_FT=1) across a partition that heals (FT.md G6) ----
# 4 ranks of tests/netem/ft_loop.c commit steps; once all loop the link is cut. The side holding a
# majority, or exactly half with rank 0 (the view's first member), must go on: its next commit after the
# cut in a view of its own members only. The other side must commit nothing until it is back in the job.
# Once the majority has committed alone the link is healed: the cut-off side learns that it was left out
# (or, cut off for longer, finds no quorum within max(DDP_TIMEOUT, 10 x suspect_seconds)), rejoins as new
# members, is admitted with the members' state, and every rank finishes its steps in a view of 4 (the
# library's side: src/ft.c, "a member left out ... comes back as a joiner"). 3|1 and 2|2, each on a fresh,
# unimpaired link.
ftl=$BUILD/netem_ft_loop
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread $SANFLAGS -I. -o "$ftl" tests/netem/ft_loop.c -lm ||
  fail "cannot build tests/netem/ft_loop.c"
fresh_link() {
  if [ "$how" = "tc netem" ]; then
    ip -n "$a" link set "v$tag" up && ip -n "$b" link set "w$tag" up
    ip netns exec "$a" tc qdisc del dev "v$tag" root 2>/dev/null; ip netns exec "$b" tc qdisc del dev "w$tag" root 2>/dev/null
  else
    "$PY" tests/netem/netem_relay.py --delay 0 --loss 0 --reorder 0 --seed 1 "$a" "t$tag" "$b" "u$tag" \
      >"$T/relay.out" 2>"$T/relay.err" &
    RELAY=$!
    for i in $(seq 500); do grep -q ready "$T/relay.out" 2>/dev/null && break; sleep 0.01; done
    grep -q ready "$T/relay.out" || fail "the relay did not start again: $(cat "$T/relay.err")"
  fi
}
heal_link() {
  if [ "$how" = "tc netem" ]; then ip -n "$a" link set "v$tag" up && ip -n "$b" link set "w$tag" up
  else kill -USR2 "$RELAY"; fi
}
# majority_alone ON_A CUT: has a rank of the majority committed, after CUT, in a view of ON_A members?
majority_alone() {
  awk -v cut="$2" -v on_a="$1" '/: commit / { split(FILENAME, f, "."); if (f[length(f)] + 0 < on_a && $NF > cut && $8 == on_a) ok = 1 }
    END { exit !ok }' "$T"/ft.*
}
FT_STEPS=4000 FT_TIMEOUT=30 FT_SUSPECT=0.5 # the timeout far above: a silent peer must be caught by suspect_seconds
for on_a in 3 2; do
  fresh_link
  ON_A=$on_a RANK_ENV="DDP_FT=1 DDP_TIMEOUT=$FT_TIMEOUT DDP_FT_SUSPECT_SECONDS=$FT_SUSPECT" start_hosts "$T/ft" "$ftl" $FT_STEPS
  for i in $(seq 6000); do
    [ "$(cat "$T"/ft.* 2>/dev/null | grep -c looping)" = 4 ] && break
    sleep 0.01
  done
  [ "$(cat "$T"/ft.* | grep -c looping)" = 4 ] || { tail -n 3 "$T"/ft.*; fail "the FT ranks never all started looping"; }
  sleep 1
  cut_link
  cut_at=$(date +%s.%N)
  for i in $(seq 2000); do majority_alone $on_a "$cut_at" && break; sleep 0.01; done
  majority_alone $on_a "$cut_at" || { tail -n 5 "$T"/ft.*; fail "FT $on_a|$((4 - on_a)): the majority never committed alone"; }
  heal_link
  healed_at=$(date +%s.%N)
  r=0
  for p in $PIDS; do
    wait "$p"; rc=$?
    [ $rc = 0 ] && grep -q "done after $FT_STEPS steps in a view of 4 members" "$T/ft.$r" ||
      { tail -n 8 "$T/ft.$r"; fail "FT $on_a|$((4 - on_a)): rank $r did not finish in a view of 4 members (exit $rc)"; }
    if [ $r -ge $on_a ]; then
      grep -q "rejoined at step" "$T/ft.$r" ||
        { tail -n 8 "$T/ft.$r"; fail "FT $on_a|$((4 - on_a)): rank $r (cut off) did not rejoin"; }
    fi
    r=$((r + 1))
  done
  PIDS=""
  # the cut-off side's commits between the cut and its rejoin (none may be in a view without the others),
  # the majority's first commit alone, the cut-off side's first commit after the heal
  read -r late first back < <(awk -v cut="$cut_at" -v healed="$healed_at" -v on_a=$on_a '
    /: commit / { split(FILENAME, f, "."); rank = f[length(f)] + 0; t = $NF
                  if (rank >= on_a && t > cut + 0.5 && $8 <= 4 - on_a) late = late " " rank
                  if (rank >= on_a && t > healed && $8 == 4 && (back == "" || t < back)) back = t
                  if (rank < on_a && t > cut && $8 == on_a && (first == "" || t < first)) first = t }
    END { print (late == "" ? "none" : late), (first == "" ? -1 : first - cut), (back == "" ? -1 : back - healed) }' "$T"/ft.*)
  [ "$late" = none ] || fail "FT $on_a|$((4 - on_a)): the cut-off side committed in a view of its own (ranks$late)"
  [ "$first" != -1 ] || fail "FT $on_a|$((4 - on_a)): the majority never committed in a view of its own"
  ok "FT partition $on_a|$((4 - on_a)) ($how): ranks 0-$((on_a - 1)) committed again $(printf '%.2f' "$first") s after the cut (DDP_TIMEOUT=$FT_TIMEOUT, suspect_seconds=$FT_SUSPECT), the other side never alone; healed, it committed again in a view of 4 after $(printf '%.2f' "$back") s (it rejoined) and all 4 finished"
  if [ -n "$RELAY" ]; then kill -TERM "$RELAY"; wait "$RELAY" 2>/dev/null; RELAY=""; fi
done
exit 0
