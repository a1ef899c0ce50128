#!/usr/bin/env bash
# The timeline (DDP_TIMELINE, ddprun --timeline; src/timeline.c), checked by tests/timeline_check.py (JSON, the
# fields every event needs, B/E balanced and monotonic per lane, X events nested per lane, pid = rank):
#   1. 3 ranks of tests/progs/timeline_job.c full under ddprun --timeline: collectives (sync, async, p2p),
#      nested ranges, a reducer whose statistics give the bucket all-reduces and passes the merged file must
#      show (each bucket inside its pass, a reducer.wait naming the straggler in each), checkpoint.save and
#      checkpoint.save_async; the workers' own files are gone after the merge
#   2. one process with DDP_TIMELINE=DIR/t.json (no %r): DIR/t.rank0.json; DDP_TIMELINE_SYNC=bad fails
#   3. a killed rank: 3 ranks, the last SIGKILLs itself; ddprun exits non-zero and still merges a valid file
#      with the survivors' events up to their failed all_reduce
#   4. the clock: 4 ranks with DDP_TIMELINE_SYNC=all (every rank measures its offset to rank 0): rank 0's
#      broadcast starts before the others' end (test_netns.sh does this across two network namespaces)
#   5. SIGUSR1 writes a stuck rank's buffered events (the file is valid and has them before it exits)
#   6. ddprun --merge-timeline: a file cut short mid-line loses that line only; a file that is no
#      timeline is refused naming it
#   7. tools/timeline.html draws the merged file in headless Chromium (its title counts what it drew) and
#      tools/timeline-png.sh takes a picture (SKIP-PART without Chromium)
set -u
. "$(dirname "$0")/testlib.sh"
DDPRUN=$BUILD/ddprun
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" || fail "cannot build $DDPRUN"
tl_tmpdir test_timeline; [ -n "${KEEP:-}" ] && trap - EXIT
JOB=$T/timeline_job
tl_cc "$JOB" tests/progs/timeline_job.c
CHECK="python3 tests/timeline_check.py"

echo "== 1. 3 ranks under ddprun --timeline"
TIMELINE_JOB_DIR=$T timeout 120 "$DDPRUN" --standalone --nproc-per-node 3 --timeline "$T/full.json" "$JOB" full \
  >"$T/full.out" 2>"$T/full.err" || { cat "$T/full.err"; fail "the full job failed"; }
grep -q "timeline of ranks 0..2 in $T/full.json" "$T/full.err" || { cat "$T/full.err"; fail "ddprun did not say where the timeline is"; }
$CHECK "$T/full.json" --ranks 3 --reducer "$T/full.out" \
  --names "all_reduce,broadcast,barrier,setup \"collectives\",step,checkpoint.save,checkpoint.save_async" ||
  fail "the merged timeline"
python3 - "$T/full.json" <<'PY' || fail "event details"
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
send = [e for e in ev if e["name"] == "send" and e["pid"] == 0]
recv = [e for e in ev if e["name"] == "recv" and e["pid"] == 1]
assert send and send[0]["args"]["peer"] == 1 and send[0]["args"]["tag"] == 7, send
assert recv and recv[0]["args"]["peer"] == 0, recv
ar = [e for e in ev if e["name"] == "all_reduce" and e["pid"] == 2 and e["args"]["count"] == 64]
assert len(ar) == 2 and ar[0]["args"]["bytes"] == 256 and ar[0]["args"]["dtype"] == "f32", ar
assert ar[0]["tid"] == 1 and ar[1]["tid"] == 3, "sync on the program's lane, async on the progress thread's"
assert ar[1]["args"]["queued_us"] >= 0
saves = [e for e in ev if e["name"] == "checkpoint.save_async"]
assert len(saves) == 3 and all(e["tid"] == 2 and e["args"]["path"].endswith("ck_async.safetensors") for e in saves), saves
print("send/recv peers and tags, all_reduce args and lanes, async saves on the saver's lane: ok")
PY
ls -a "$T" | grep -q '^\.ddprun_timeline' && fail "ddprun left its workers' files"
ok "3 ranks: collectives, ranges, reducer passes and buckets, saves"

echo "== 2. one process, DDP_TIMELINE without %r"
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT DDP_TIMELINE="$T/one/t.json" TIMELINE_JOB_DIR=$T "$JOB" full \
  >"$T/one.out" 2>&1 && fail "a missing directory should fail ddp_init"
grep -q "timeline: cannot create $T/one/t.rank0.json" "$T/one.out" || { cat "$T/one.out"; fail "the message names the file"; }
mkdir -p "$T/one"
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT DDP_TIMELINE="$T/one/t.json" TIMELINE_JOB_DIR=$T "$JOB" full \
  >"$T/one.out" 2>&1 || { cat "$T/one.out"; fail "one process"; }
$CHECK "$T/one/t.rank0.json" --ranks 1 --reducer "$T/one.out" || fail "one process's file"
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT DDP_TIMELINE="$T/one/t.json" DDP_TIMELINE_SYNC=sometimes "$JOB" full \
  >"$T/bad.out" 2>&1 && fail "DDP_TIMELINE_SYNC=sometimes should fail"
grep -q 'DDP_TIMELINE_SYNC is "sometimes"' "$T/bad.out" || { cat "$T/bad.out"; fail "the message names DDP_TIMELINE_SYNC"; }
ok "t.json -> t.rank0.json; a missing directory and a bad DDP_TIMELINE_SYNC fail naming them"

echo "== 3. a killed rank"
timeout 120 "$DDPRUN" --standalone --nproc-per-node 3 --timeline "$T/kill.json" "$JOB" kill >"$T/kill.out" 2>&1 &&
  fail "the job with a killed rank exited 0"
$CHECK "$T/kill.json" --pids 0,1 --names all_reduce || { cat "$T/kill.out"; fail "the killed job's timeline"; }
python3 - "$T/kill.json" <<'PY' || fail "the survivors' failed all_reduce"
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
for pid in (0, 1):
    ar = [e for e in ev if e["name"] == "all_reduce" and e["pid"] == pid]
    assert len(ar) == 3 and ar[2]["args"]["ok"] is False, (pid, ar)
assert any(e["pid"] == 2 and e["name"] == "process_name" for e in ev), "rank 2's file (its header) was not merged"
print("ranks 0 and 1: 2 all_reduces, then the failed one; rank 2 (killed before a flush): its header")
PY
ok "a killed rank: the merged file is valid, the survivors' events are there"

echo "== 4. DDP_TIMELINE_SYNC=all, 4 ranks"
DDP_TIMELINE_SYNC=all timeout 120 "$DDPRUN" --standalone --nproc-per-node 4 --timeline "$T/bcast.json" "$JOB" bcast \
  >"$T/bcast.out" 2>&1 || { cat "$T/bcast.out"; fail "the bcast job"; }
$CHECK "$T/bcast.json" --ranks 4 --bcast-ordered || fail "the broadcast's order"
ok "measured clocks: the broadcast's start on rank 0 before its ends"

echo "== 5. SIGUSR1"
cat >"$T/stuck.c" <<'EOF'
#define DDP_IMPLEMENTATION
#include "ddp.h"
#include <stdio.h>
#include <unistd.h>
int main(void) {
    ddp_group *g;
    float x = 1;
    int i;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) return 1;
    for (i = 0; i < 10; i++) ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM);
    ddp_timeline_begin(g, "stuck");
    printf("ready\n");
    fflush(stdout);
    pause(); /* stuck outside the library: SIGUSR1 writes the buffer, the default SIGTERM ends it */
    return 0;
}
EOF
tl_cc "$T/stuck" "$T/stuck.c"
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT DDP_TIMELINE="$T/stuck.json" "$T/stuck" >"$T/stuck.out" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q ready "$T/stuck.out" && break; sleep 0.1; done
python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['traceEvents']; sys.exit(any(x['name']=='all_reduce' for x in e))" \
  "$T/stuck.rank0.json" || fail "the events were written before SIGUSR1 (expected them buffered)"
kill -USR1 $pid
sleep 0.5
kill $pid 2>/dev/null
wait $pid 2>/dev/null
python3 - "$T/stuck.rank0.json" <<'PY' || fail "SIGUSR1 did not write the buffered events"
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
n = sum(e["name"] == "all_reduce" for e in ev)
assert n == 10 and any(e["name"] == "stuck" and e["ph"] == "B" for e in ev), n
print("SIGUSR1: 10 all_reduces and the open range written; the file is valid JSON")
PY
ok "SIGUSR1 writes a stuck rank's events"

echo "== 6. ddprun --merge-timeline"
head -c -40 "$T/full.json" >"$T/cut.json"
"$DDPRUN" --merge-timeline "$T/merged.json" "$T/cut.json" "$T/none.json" >"$T/merge.out" 2>&1 || { cat "$T/merge.out"; fail "merge"; }
grep -q "none.json" "$T/merge.out" || fail "a missing input is not named"
python3 - "$T/full.json" "$T/merged.json" <<'PY' || fail "the cut file's events"
import json, sys
full = json.load(open(sys.argv[1]))["traceEvents"]
merged = json.load(open(sys.argv[2]))["traceEvents"]
assert len(merged) == len(full) - 1, (len(merged), len(full))
print(f"a file cut mid-line: {len(merged)} of {len(full)} events kept")
PY
echo "not a timeline" >"$T/junk.json"
"$DDPRUN" --merge-timeline "$T/merged2.json" "$T/junk.json" >"$T/merge2.out" 2>&1 && fail "junk merged"
grep -q "junk.json is not a ddp.h timeline file" "$T/merge2.out" || { cat "$T/merge2.out"; fail "junk not named"; }
[ -e "$T/merged2.json" ] && fail "a failed merge left its output"
ok "merge: a cut line dropped, a missing input skipped, junk refused"

echo "== 7. tools/timeline.html in headless Chromium"
if ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
  echo "SKIP-PART viewer: no headless Chromium (apt-get install -y chromium-headless-shell)"
else
  want=$(python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['traceEvents']; \
print(sum(x['ph'] in 'XB' for x in e))" "$T/full.json")
  tools/timeline-png.sh "$T/full.json" --dom "" >"$T/dom.html" || fail "the page did not load"
  grep -q "<title>timeline: $want events, 3 ranks</title>" "$T/dom.html" ||
    { grep -o '<title>[^<]*</title>' "$T/dom.html"; fail "the page did not draw $want events of 3 ranks"; }
  tools/timeline-png.sh "$T/full.json" "$T/full.png" "pass=2" 1400 500 >/dev/null || fail "no picture"
  [ "$(stat -c %s "$T/full.png")" -gt 10000 ] || fail "the picture is almost empty"
  ok "the viewer drew $want events of 3 ranks; a picture of a pass"
fi
echo "timeline: ok"
