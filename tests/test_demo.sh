#!/usr/bin/env bash
# The training demo (examples/train_demo.c), shortened, on ranks launched by build/ddprun --standalone:
#  1. with a checkpoint after every step (--save-every 1 --keep 0) on 4 ranks, then tests/demo_check.c:
#     every DDP step equals one process stepping on the union of the ranks' batches (plain BatchNorm)
#     within 1e-5, and the demo finds the weights identical on every rank; again on 3 ranks, where
#     DistributedSampler pads the shards and the gradients are averaged by 1/3. The checker must also
#     fail: given another learning rate (0.1% off) it finds the steps too far from its own;
#  2. --stop-at-step 64 (the end of epoch 2) stops the run there by itself (no kill, no timing), then
#     --resume: the final weights file is byte-identical (cmp) to the uninterrupted run's;
#  3. the same inside an epoch (--save-every 5 --stop-at-step 47): resume from a mid-epoch sampler position;
#  4. --resume with another world size is refused with a message that says what to do;
#  5. --ft under ddprun --ft (fault-tolerant training, src/ft.h): uninterrupted, the final weights file is
#     byte-identical to the plain run's (4 ranks split every step evenly); with rank 2 SIGKILLed in step 30
#     of 198 (DDP_FT_TEST_KILL, its first bucket in flight) under --max-restarts 1 the other 3 redo that
#     step and go on, ddprun starts rank 2 again as a joiner, which is admitted with the members' state and
#     trains to the end with them: ddprun exits 0 with one line for rank 2, the survivors say that 3 and
#     then 4 ranks go on, the 4 final weights are identical, and within 1e-5 of the uninterrupted run's
#     (float rounding of the steps on 3 ranks; kills at steps 20 to 190 end 6e-8 to 7e-7 from it); --ft
#     with --resume is refused;
#  6. when /usr/bin/python3 has torch: the final weights file loads into the same model written in torch
#     (load_state_dict(strict=True): torch's names and shapes), whose accuracy on the held-out points
#     (regenerated here in Python) is the demo's own last "eval acc".
set -u
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
DDPRUN=$BUILD/ddprun DEMO=$BUILD/train_demo CHECK=$BUILD/demo_check
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" "$DEMO" "$CHECK" || { echo "cannot build $DEMO and $CHECK"; exit 1; }
ARGS="--epochs 6 --samples 4000"   # 32 steps an epoch on 4 ranks of batch 32
tl_tmpdir test_demo

# demo NAME NPROC EXTRA...: run the demo on NPROC ranks with --dir $T/NAME, output in $T/NAME.log; must exit 0
demo() {
  local name=$1 n=$2; shift 2
  "$DDPRUN" --standalone --nproc-per-node "$n" "$DEMO" --dir "$T/$name" "$@" >"$T/$name.log" 2>&1
  rc=$?
  cat "$T/$name.log"
  [ $rc -eq 0 ] || fail "$name: the demo exited $rc"
}

# check NAME STEPS EXTRA...: demo_check on $T/NAME (EXTRA: the demo's flags) checks STEPS steps, each within 1e-5
check() {
  local name=$1 steps=$2 line; shift 2
  grep -q "^the weights are identical on every rank" "$T/$name.log" || fail "$name: weights differ between ranks"
  "$CHECK" --dir "$T/$name" "$@" >"$T/$name.check" 2>&1
  rc=$?
  cat "$T/$name.check"
  [ $rc -eq 0 ] || fail "$name: demo_check exited $rc"
  grep -q "^check: each of the $steps DDP steps " "$T/$name.check" || fail "$name: not $steps steps checked"
  line=$(grep "check: largest difference" "$T/$name.check") || fail "$name: no check result"
  echo "$line" | grep -oE "(weights|momentum|statistics) [0-9.e+-]+" | awk '$2 + 0 <= 1e-5 { n++ } END { exit n != 3 }' ||
    fail "$name: a difference is above 1e-5 (or missing)"
  echo "$line" | grep -q ": OK" || fail "$name: the checker did not say OK"
}

# 1. every step checked, 4 ranks: also the uninterrupted reference for the resume tests
demo full 4 $ARGS --save-every 1 --keep 0
[ -f "$T/full/final.safetensors" ] || fail "no final weights"
check full 192 $ARGS
ok "4 ranks: the 192 DDP steps equal the single-process steps"
demo three 3 --epochs 1 --samples 1000 --save-every 1 --keep 0
check three 11 --epochs 1 --samples 1000
ok "3 ranks (padded shards): DDP steps equal the single-process steps"
if "$CHECK" --dir "$T/full" $ARGS --lr 0.1001 >"$T/wrong.check" 2>&1; then
  cat "$T/wrong.check"; fail "demo_check passed steps taken with another learning rate"
fi
cat "$T/wrong.check"
grep -q ": TOO LARGE" "$T/wrong.check" || fail "demo_check failed, but not for the differences"
ok "demo_check fails when the steps differ (--lr 0.1001 instead of the run's 0.1)"

# stopped NAME STEP: the run stopped by itself after STEP (exit 0, said so), left no final weights, and
# its newest checkpoint is STEP's
stopped() {
  local name=$1 step; step=$(printf %08d "$2")
  grep -q "^stopped after step $2 (--stop-at-step)" "$T/$name.log" || fail "$name: no stop after step $2"
  [ ! -f "$T/$name/final.safetensors" ] || fail "$name: the run went on to the end"
  [ "$(cd "$T/$name" && ls ckpt_*.safetensors | tail -n 1)" = "ckpt_$step.safetensors" ] ||
    fail "$name: the newest checkpoint is not step $2's: $(cd "$T/$name" && echo ckpt_*)"
  echo "stopped after step $2; checkpoints: $(cd "$T/$name" && echo ckpt_*)"
}

# resume NAME EXTRA...: --resume, then the final weights must be byte-identical to the full run's
resume() {
  local name=$1; shift
  "$DDPRUN" --standalone --nproc-per-node 4 "$DEMO" $ARGS --dir "$T/$name" --resume "$@" >"$T/$name.resume.log" 2>&1
  rc=$?
  cat "$T/$name.resume.log"
  [ $rc -eq 0 ] || fail "$name: --resume exited $rc"
  cmp "$T/full/final.safetensors" "$T/$name/final.safetensors" || fail "$name: resumed weights differ from the uninterrupted run's"
}

# 2. stopped at the end of epoch 2 (step 64): the resume starts epoch 3
demo epoch 4 $ARGS --stop-at-step 64
stopped epoch 64
resume epoch
grep -q "resumed from .*ckpt_00000064.safetensors: epoch 3, step 64, 0 samples" "$T/epoch.resume.log" ||
  fail "epoch: did not resume at the start of epoch 3"
ok "stopped after epoch 2, --resume: final weights bit-identical"

# 3. checkpoints every 5 steps too; stopped after step 47, the 15th step of epoch 2 (15 x 32 = 480 samples
# of each rank's shard done), which is not a multiple of 5: the stop saves its own checkpoint
demo mid 4 $ARGS --save-every 5 --stop-at-step 47
stopped mid 47
resume mid --save-every 5
grep -q "resumed from .*ckpt_00000047.safetensors: epoch 2, step 47, 480 samples of the epoch" "$T/mid.resume.log" ||
  fail "mid: did not resume from inside epoch 2"
ok "stopped inside epoch 2, --resume from that sampler position: final weights bit-identical"

# 4. another world size cannot continue these per-rank sampler positions
if "$DDPRUN" --standalone --nproc-per-node 2 "$DEMO" $ARGS --dir "$T/mid" --resume >"$T/two.log" 2>&1; then
  cat "$T/two.log"; fail "--resume on 2 ranks of a 4-rank checkpoint succeeded"
fi
grep -q "on 4 ranks; resume with the same" "$T/two.log" || { cat "$T/two.log"; fail "no clear message for the world size"; }
ok "--resume with another world size is refused"

# 5. --ft, uninterrupted and with a rank lost
"$DDPRUN" --ft --standalone --nproc-per-node 4 "$DEMO" --ft $ARGS --dir "$T/ft" >"$T/ft.log" 2>&1 ||
  { cat "$T/ft.log"; fail "ft: the demo with --ft exited $?"; }
cmp "$T/full/final.safetensors" "$T/ft/final.safetensors" || fail "ft: --ft's weights differ from the plain run's"
ok "--ft with no rank lost: the final weights are the plain run's, byte for byte"
DDP_FT_TEST_KILL=2:30:bucket "$DDPRUN" --ft --max-restarts 1 --standalone --nproc-per-node 4 "$DEMO" --ft $ARGS \
  --dir "$T/ftkill" >"$T/ftkill.log" 2>&1; rc=$?
cat "$T/ftkill.log"
[ $rc -eq 0 ] || fail "ftkill: the run that lost rank 2 exited $rc"
grep -q "^ddprun: rank 2 (pid [0-9]*) was killed by signal 9 (SIGKILL) (--ft: a lost member); starting it again as a joiner" \
  "$T/ftkill.log" || fail "ftkill: ddprun did not report rank 2 as lost and restarted"
grep -q "^train_demo: view [0-9]*: 3 ranks go on, from step 30 of epoch 1" "$T/ftkill.log" ||
  fail "ftkill: the survivors did not say that 3 ranks go on"
grep -q "^train_demo: a replacement admitted as rank 3 of 4" "$T/ftkill.log" || fail "ftkill: the replacement was not admitted"
grep -q "^train_demo: view [0-9]*: 4 ranks go on" "$T/ftkill.log" || fail "ftkill: the members did not say that 4 ranks go on"
grep -q "^the weights are identical on every rank" "$T/ftkill.log" || fail "ftkill: weights differ between the survivors"
"$CHECK" --compare "$T/ft/final.safetensors" "$T/ftkill/final.safetensors" $ARGS >"$T/ftkill.check" 2>&1 ||
  { cat "$T/ftkill.check"; fail "ftkill: demo_check --compare failed"; }
cat "$T/ftkill.check"
grep -oE "(weights|statistics) [0-9.e+-]+" "$T/ftkill.check" | awk '$2 + 0 <= 1e-5 { n++ } END { exit n != 2 }' ||
  fail "ftkill: the final weights are more than 1e-5 from the uninterrupted run's (or the numbers are missing)"
if "$DEMO" --ft --resume --dir "$T/ft" >"$T/ftresume.log" 2>&1; then fail "--ft --resume was accepted"; fi
grep -q "do not go with it" "$T/ftresume.log" || { cat "$T/ftresume.log"; fail "--ft --resume: no clear message"; }
ok "--ft, rank 2 SIGKILLed in step 30 and replaced: the 4 finish within 1e-5 of the uninterrupted run; --ft --resume refused"

# 6. the weights in torch
if "$PY" -c "import torch, numpy" 2>/dev/null; then
  want=$(grep "^epoch   6/6" "$T/full.log" | sed 's/.*eval acc *\([0-9.]*\)%.*/\1/')
  "$PY" - "$T/full/final.safetensors" "$want" <<'PY' || fail "the weights in torch"
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
  echo "SKIP-PART torch part: torch and numpy not installed for $PY (the weights in torch not checked)"
fi
