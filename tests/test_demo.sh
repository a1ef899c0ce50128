#!/usr/bin/env bash
# The training demo (examples/train_demo.c), shortened, on ranks launched by build/ddprun:
#  1. --check on 4 ranks: every DDP step equals one process stepping on the union of the ranks' batches
#     (plain BatchNorm) within 1e-5, and the weights are identical on every rank; again on 3 ranks,
#     where DistributedSampler pads the shards and the gradients are averaged by 1/3;
#  2. SIGKILL a rank mid-epoch once the 2nd epoch checkpoint exists, then --resume: the final weights
#     file is byte-identical (cmp) to the uninterrupted run's;
#  3. the same with checkpoints inside the epoch (--save-every): resume from a mid-epoch sampler position;
#  4. --resume with another world size is refused with a message that says what to do;
#  5. when /usr/bin/python3 has torch: the final weights file loads into the same model written in torch
#     (load_state_dict(strict=True): torch's names and shapes), whose accuracy on the held-out points
#     (regenerated here in Python) is the demo's own last "eval acc".
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
DDPRUN=$BUILD/ddprun DEMO=$BUILD/train_demo
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" "$DEMO" || { echo "cannot build $DEMO"; exit 1; }
ARGS="--epochs 6 --samples 4000"   # 32 steps an epoch on 4 ranks of batch 32
T=$(mktemp -d /tmp/test_demo.XXXXXX)
BG=""
cleanup() {
  local p
  for p in $BG; do
    for c in $(pgrep -P "$p" 2>/dev/null); do kill -9 "$c" 2>/dev/null; done
    kill -9 "$p" 2>/dev/null
  done
  rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; }

# check_ok LOG: the --check lines say OK, and each printed difference is <= 1e-5
check_ok() {
  grep -q "check: the weights are identical on every rank" "$1" || fail "$1: weights differ between ranks"
  local line
  line=$(grep "check: largest difference" "$1") || fail "$1: no check result"
  echo "$line"
  echo "$line" | grep -oE "(weights|momentum|statistics) [0-9.e+-]+" | awk '$2 + 0 <= 1e-5 { n++ } END { exit n != 3 }' ||
    fail "$1: a difference is above 1e-5 (or missing)"
  echo "$line" | grep -q ": OK" || fail "$1: the program did not say OK"
}

# 1. --check, 4 ranks: also the uninterrupted reference for the resume tests
"$DDPRUN" --nproc-per-node 4 "$DEMO" $ARGS --check --dir "$T/full" >"$T/full.log" 2>&1
rc=$?
[ $rc -eq 0 ] || { cat "$T/full.log"; fail "demo --check exited $rc"; }
cat "$T/full.log"
check_ok "$T/full.log"
[ -f "$T/full/final.safetensors" ] || fail "no final weights"
ok "4 ranks: DDP steps equal the single-process steps"
"$DDPRUN" --nproc-per-node 3 "$DEMO" --epochs 1 --samples 1000 --check --dir "$T/three" >"$T/three.log" 2>&1
rc=$?
[ $rc -eq 0 ] || { cat "$T/three.log"; fail "3 ranks: demo --check exited $rc"; }
check_ok "$T/three.log"
ok "3 ranks (padded shards): DDP steps equal the single-process steps"

# run_and_kill NAME WAIT_FOR EXTRA...: start the demo in the background, SIGKILL one rank as soon as
# the file WAIT_FOR (a shell glob under $T/NAME) exists, and check that the run did not finish.
run_and_kill() {
  local name=$1 want=$2 pid victim i; shift 2
  "$DDPRUN" --nproc-per-node 4 "$DEMO" $ARGS --dir "$T/$name" "$@" >"$T/$name.log" 2>&1 &
  pid=$!
  BG="$BG $pid"
  for i in $(seq 6000); do
    compgen -G "$T/$name/$want" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.01
  done
  compgen -G "$T/$name/$want" >/dev/null || { cat "$T/$name.log"; fail "$name: $want never appeared"; }
  victim=$(pgrep -P "$pid" | tail -n 1)
  [ -n "$victim" ] || fail "$name: no worker to kill (the run ended too soon)"
  kill -KILL "$victim"
  wait "$pid"
  rc=$?
  cat "$T/$name.log"
  [ $rc -ne 0 ] || fail "$name: ddprun exited 0 after a rank was killed"
  [ ! -f "$T/$name/final.safetensors" ] || fail "$name: the run finished before the kill; nothing was tested"
  echo "killed rank pid $victim; ddprun exited $rc; checkpoints: $(cd "$T/$name" && echo ckpt_*)"
}

# resume NAME EXTRA...: --resume, then the final weights must be byte-identical to the full run's
resume() {
  local name=$1; shift
  "$DDPRUN" --nproc-per-node 4 "$DEMO" $ARGS --dir "$T/$name" --resume "$@" >"$T/$name.resume.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { cat "$T/$name.resume.log"; fail "$name: --resume exited $rc"; }
  cat "$T/$name.resume.log"
  cmp "$T/full/final.safetensors" "$T/$name/final.safetensors" || fail "$name: resumed weights differ from the uninterrupted run's"
}

# 2. killed after the 2nd epoch's checkpoint (steps 32 and 64 exist: epoch 3 is under way)
run_and_kill epoch "ckpt_00000064.safetensors"
resume epoch
grep -q "resumed from .*ckpt_00000064.safetensors: epoch 3, step 64, 0 samples" "$T/epoch.resume.log" ||
  fail "epoch: did not resume at the start of epoch 3"
ok "SIGKILL mid-epoch 3, --resume: final weights bit-identical"

# 3. checkpoints every 5 steps too; killed once step 40 (inside epoch 2) is saved: the newest is one of
# 40..60, all inside epoch 2 (its end, step 64, is 24 steps away)
run_and_kill mid "ckpt_00000040.safetensors" --save-every 5
resume mid --save-every 5
grep -Eq "resumed from .*: epoch 2, step (40|45|50|55|60), (256|416|576|736|896) samples of the epoch" "$T/mid.resume.log" ||
  fail "mid: did not resume from inside epoch 2"
ok "SIGKILL after a mid-epoch checkpoint, --resume from that sampler position: final weights bit-identical"

# 4. another world size cannot continue these per-rank sampler positions
if "$DDPRUN" --nproc-per-node 2 "$DEMO" $ARGS --dir "$T/mid" --resume >"$T/two.log" 2>&1; then
  cat "$T/two.log"; fail "--resume on 2 ranks of a 4-rank checkpoint succeeded"
fi
grep -q "on 4 ranks; resume with the same" "$T/two.log" || { cat "$T/two.log"; fail "no clear message for the world size"; }
ok "--resume with another world size is refused"

# 5. the weights in torch
if /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  want=$(grep "^epoch   6/6" "$T/full.log" | sed 's/.*eval acc *\([0-9.]*\)%.*/\1/')
  /usr/bin/python3 - "$T/full/final.safetensors" "$want" <<'PY' || fail "the weights in torch"
import json, math, struct, sys
import numpy as np, torch, torch.nn as nn
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
dtypes = {"F32": np.float32, "I64": np.int64}
state = {k: torch.from_numpy(np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]],
                                           dtype=dtypes[v["dtype"]]).reshape(v["shape"]).copy())
         for k, v in header.items() if k != "__metadata__"}
class Net(nn.Module):  # examples/train_demo.c's model, as a PyTorch user would write it
    def __init__(self, h=128):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(2, h, bias=False), nn.BatchNorm1d(h)
        self.fc2, self.bn2 = nn.Linear(h, h, bias=False), nn.BatchNorm1d(h)
        self.fc3 = nn.Linear(h, 4)
    def forward(self, x):
        return self.fc3(torch.relu(self.bn2(self.fc2(torch.relu(self.bn1(self.fc1(x)))))))
model = Net()
model.load_state_dict(state, strict=True)
model.eval()
# the held-out set of make_spirals(5678, 1000): splitmix64, Box-Muller, four arms
M, s = (1 << 64) - 1, [5678]
def nxt():
    s[0] = (s[0] + 0x9E3779B97F4A7C15) & M
    z = s[0]
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
uni = lambda: (nxt() >> 11) / 9007199254740992.0
def normal():
    u, v = uni(), uni()
    return math.sqrt(-2.0 * math.log(1.0 - u)) * math.cos(6.283185307179586 * v)
xs, ys = [], []
for i in range(1000):
    t, c = uni(), i % 4
    r = 0.1 + 0.9 * t
    a = 6.283185307179586 * c / 4 + 1.75 * 3.141592653589793 * t + 0.3 * normal()
    xs.append([r * math.cos(a) + 0.02 * normal(), r * math.sin(a) + 0.02 * normal()])
    ys.append(c)
with torch.no_grad():
    acc = 100.0 * (model(torch.tensor(xs, dtype=torch.float32)).argmax(1) == torch.tensor(ys)).float().mean().item()
print("torch: strict load_state_dict ok; held-out accuracy %.1f%%, the demo printed %s%%" % (acc, sys.argv[2]))
sys.exit(0 if abs(acc - float(sys.argv[2])) <= 0.25 else 1)
PY
  ok "the final weights load into the torch model and score the same accuracy"
else
  echo "SKIP-PART torch part: torch and numpy not installed for /usr/bin/python3 (the weights in torch not checked)"
fi
