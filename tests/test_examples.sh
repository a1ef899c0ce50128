#!/usr/bin/env bash
# Every teaching example under examples/ runs briefly on 2-4 ranks under build/ddprun and prints what it
# must; each example also verifies its own results and exits non-zero when one is wrong. checkpoint_resume
# crashes on purpose and is restarted (ddprun --max-restarts, and by hand with --resume) to end with the
# uninterrupted run's weights, and a job saved on 4 ranks is resumed on 3 in the middle of an epoch.
# The sampler's shards are compared with torch 1.13's DistributedSampler (values below, produced by
#   /usr/bin/python3 -c "from torch.utils.data.distributed import DistributedSampler as S; ..."
# for 10 samples on 3 replicas). launchers runs under ddprun, alone, under a hand-made SLURM environment
# and, when installed, Open MPI's mpirun. Every example also compiles as C++17.
# (train_demo has its own test, tests/test_demo.sh.)
set -u
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
DDPRUN=$BUILD/ddprun
EXAMPLES="hello_allreduce hello_collectives sampler grad_accumulation join_uneven zero_adamw fsdp checkpoint_resume launchers"
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" $(for e in $EXAMPLES; do echo "$BUILD/$e"; done) ||
  { echo "cannot build the examples"; exit 1; }
tl_tmpdir test_examples

# run NAME NPROC ARGS...: ddprun NPROC ranks of build/NAME; its output in $OUT; fails on a non-zero exit
run() {
  local name=$1 n=$2; shift 2
  OUT=$(timeout 120 "$DDPRUN" --nproc-per-node "$n" "$BUILD/$name" "$@" 2>&1)
  local rc=$?
  echo "--- $name on $n ranks $*"
  echo "$OUT"
  [ $rc -eq 0 ] || fail "$name on $n ranks exited $rc"
}
# has TEXT...: every TEXT is a line of $OUT (fixed strings)
has() {
  local s
  for s in "$@"; do echo "$OUT" | grep -qxF -- "$s" || fail "missing the line: $s"; done
}

run hello_allreduce 2
has "rank 0 of 2: 1 + ... + 2 = 3 (right)" "rank 1 of 2: 1 + ... + 2 = 3 (right)"
OUT=$(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$BUILD/hello_allreduce" 2>&1) || fail "hello_allreduce alone: $OUT"
has "rank 0 of 1: 1 + ... + 1 = 1 (right)"
ok hello_allreduce

run hello_collectives 2
has "ddp.h $(sed -n 's/^#define DDP_VERSION_MAJOR \([0-9]*\).*/\1/p' ddp.h).$(sed -n 's/^#define DDP_VERSION_MINOR \([0-9]*\).*/\1/p' ddp.h).$(sed -n 's/^#define DDP_VERSION_PATCH \([0-9]*\).*/\1/p' ddp.h): 2 ranks on the cpu backend" \
  "all collectives verified"
ok hello_collectives

run sampler 3
has "epoch 0 (4 each, 2 padded):" "  rank 0: 4 5 0 2" "  rank 1: 1 3 8 4" "  rank 2: 7 9 6 1" \
  "epoch 1 (4 each, 2 padded):" "  rank 0: 5 2 9 4" "  rank 1: 6 0 3 5" "  rank 2: 1 8 7 6" \
  "drop_last, epoch 0 (the same shuffle, the tail cut):" "  rank 0: 4 5 0" "  rank 1: 1 3 8" "  rank 2: 7 9 6" \
  "sampler: every check passed"
run sampler 2
has "sampler: every check passed"
ok "sampler (3 ranks: torch 1.13's shards)"

for n in 2 3; do
  run grad_accumulation $n
  has "$n ranks: 150 optimizer steps, 150 backward passes under no_sync, 1 bucket(s) of 1416 bytes all-reduced once per step"
  echo "$OUT" | grep -q "^largest difference from one process on the whole batch: .* (rounding only)$" ||
    fail "grad_accumulation: no agreement with one process"
done
ok grad_accumulation

# uneven data (Join): rank r has 10 - 4r batches, rank 3 none; every rank ends with the serial run's weights
run join_uneven 4
has "rank 0: 10 batches, then shadowed 0 steps of the others; final weights vs the serial run: equal (rounding only)" \
  "rank 1: 6 batches, then shadowed 4 steps of the others; final weights vs the serial run: equal (rounding only)" \
  "rank 2: 2 batches, then shadowed 8 steps of the others; final weights vs the serial run: equal (rounding only)" \
  "rank 3: 0 batches, then shadowed 10 steps of the others; final weights vs the serial run: equal (rounding only)"
run join_uneven 3 --fail-early
has "rank 0: stopped at step 3: DDP_ERR_UNEVEN_INPUTS" "rank 1: stopped at step 3: DDP_ERR_UNEVEN_INPUTS" \
  "rank 2: stopped at step 3: DDP_ERR_UNEVEN_INPUTS"
echo "$OUT" | grep -q "uneven inputs at step 3: rank 2 ran out of data after 2 steps" || fail "join_uneven: the message"
ok "join_uneven (shadowing with zero gradients; join_fail_early)"

# ZeRO-1 with AdamW: each rank keeps AdamW state for its slice of the 178 parameters (60, 60, 58 on 3 ranks)
run zero_adamw 3
has "rank 0: AdamW state for 60 of 178 parameters in 4 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 1: AdamW state for 60 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 2: AdamW state for 58 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)"
run zero_adamw 3 --stage 2
has "rank 0: AdamW state for 60 of 178 parameters in 4 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 1: AdamW state for 60 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 2: AdamW state for 58 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)"
ok "zero_adamw (ZeRO stage 1 and 2: AdamW on each rank's slices, equal to the serial run)"
# its AdamW state consolidated on rank 0 halfway (3 ranks), resumed on 2 ranks: still the serial run's weights
run zero_adamw 3 --save "$T/zero.safetensors"
has "saved weights and AdamW state at step 5 to $T/zero.safetensors"
run zero_adamw 2 --resume "$T/zero.safetensors"
has "resumed from $T/zero.safetensors at step 5 (saved by 3 ranks) on 2 ranks" \
  "rank 0: AdamW state for 89 of 178 parameters in 4 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 1: AdamW state for 89 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)"
run zero_adamw 2 --stage 2 --resume "$T/zero.safetensors"
has "rank 0: AdamW state for 89 of 178 parameters in 4 slice(s); final weights vs the serial run: equal (rounding only)"
ok "zero_adamw --save on 3 ranks, --resume on 2 with stage 1 and with stage 2 (consolidated AdamW state)"
# the same with uneven data: rank r has 10 - 4r batches, rank 3 none; the joined ranks keep stepping their slices
run zero_adamw 4 --uneven
has "rank 0: 10 batches, then 0 steps as a joined rank; AdamW state for 45 of 178 parameters in 3 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 1: 6 batches, then 4 steps as a joined rank; AdamW state for 45 of 178 parameters in 2 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 2: 2 batches, then 8 steps as a joined rank; AdamW state for 45 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)" \
  "rank 3: 0 batches, then 10 steps as a joined rank; AdamW state for 43 of 178 parameters in 1 slice(s); final weights vs the serial run: equal (rounding only)"
ok "zero_adamw --uneven (ZeRO stage 1 with Join: the join_step loop)"

# FSDP / ZeRO-3: each rank keeps 1/3 of each layer; the layers are gathered as they run; the whole model saved
run fsdp 3 --save "$T/fsdp.safetensors"
echo "$OUT" | grep -q "^3 ranks: every slice equals the serial run's weights" || fail "fsdp: the weights"
has "3 ranks: parameter memory per rank 8000 bytes of the model's 9600 (its shards + 2 gather buffers)" \
  "saved the whole model to $T/fsdp.safetensors"
ok "fsdp (ZeRO-3: units gathered layer by layer, AdamW on the slices, equal to the serial run; saved whole)"

# a crash at step 23, restarted by ddprun: resumes from step 20 and ends as a run that never crashed
run checkpoint_resume 2 "$T/ck" --crash-at 0
has "attempt 0 (DDP_RESTART_COUNT=0)"
final=$(echo "$OUT" | grep "^final weights after 72 steps:") || fail "checkpoint_resume: no final weights"
OUT=$(timeout 120 "$DDPRUN" --nproc-per-node 2 --max-restarts 1 "$BUILD/checkpoint_resume" "$T/ck" 2>&1) ||
  { echo "$OUT"; fail "checkpoint_resume with a restart exited $?"; }
echo "$OUT"
has "rank 1: crashing on purpose at step 23" "attempt 1 (DDP_RESTART_COUNT=1)" \
  "resuming from $T/ck/ckpt_000020.safetensors (epoch 1, step 20, 64 of the epoch's 96 samples seen by 2 ranks) on 2 ranks" "$final"
# without --max-restarts the launch fails; a new launch with --resume continues by hand
if OUT=$(timeout 120 "$DDPRUN" --nproc-per-node 2 "$BUILD/checkpoint_resume" "$T/ck" 2>&1); then
  echo "$OUT"; fail "checkpoint_resume: the crash did not fail the launch"
fi
run checkpoint_resume 2 "$T/ck" --resume
has "resuming from $T/ck/ckpt_000020.safetensors (epoch 1, step 20, 64 of the epoch's 96 samples seen by 2 ranks) on 2 ranks" "$final"
ok "checkpoint_resume: restarted and resumed runs end with the uninterrupted run's weights"
# issue #21: a job stopped on 4 ranks continues on 3, in the middle of epoch 3 (4 ranks x 4 a step: 6 steps
# an epoch; step 20 is 2 steps into epoch 3, 32 of its 96 samples). The rest, 64, over 3 ranks: 22 each,
# 6 steps; then 2 epochs of 96 / 3 / 4 = 8 steps: 42 in all
run checkpoint_resume 4 "$T/ck" --crash-at 0 --stop-at 20
has "stopping after step 20, as asked (--stop-at)"
run checkpoint_resume 3 "$T/ck" --resume
has "resuming from $T/ck/ckpt_000020.safetensors (epoch 3, step 20, 32 of the epoch's 96 samples seen by 4 ranks) on 3 ranks"
echo "$OUT" | grep -q "^final weights after 42 steps:" || fail "checkpoint_resume on 3 ranks after 4: not 42 steps"
ok "checkpoint_resume: saved on 4 ranks, resumed on 3 in the middle of an epoch"

run launchers 2
echo "$OUT" | grep -q "^rank 0 of 2, local rank 0 of 2, host .*, started by ddprun$" || fail "launchers: rank 0 under ddprun"
echo "$OUT" | grep -q "^rank 1 of 2, local rank 1 of 2, host .*, started by ddprun$" || fail "launchers: rank 1 under ddprun"
OUT=$(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$BUILD/launchers" 2>&1) || fail "launchers alone: $OUT"
echo "$OUT" | grep -q "^rank 0 of 1, local rank 0 of 1, .*, started by no launcher$" || fail "launchers alone: $OUT"
# srun's variables, set by hand (two processes of one job step on this host)
for r in 0 1; do
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=$r \
    SLURM_JOB_ID=$$ SLURM_STEP_ID=0 SLURM_NODELIST=localhost timeout 60 "$BUILD/launchers" >"$T/slurm.$r" 2>&1 &
done
wait
OUT=$(cat "$T/slurm.0" "$T/slurm.1")
echo "$OUT"
echo "$OUT" | grep -q "^rank 1 of 2, local rank 1 of 2, .*, started by SLURM's srun$" || fail "launchers under SLURM's variables"
if command -v mpirun >/dev/null; then
  OUT=$(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$BUILD/launchers" 2>&1) || { echo "$OUT"; fail "mpirun"; }
  echo "$OUT"
  echo "$OUT" | grep -q "^rank 1 of 2, local rank 1 of 2, .*, started by Open MPI's mpirun$" || fail "launchers under mpirun"
  ok "launchers: ddprun, alone, SLURM variables, mpirun"
else
  ok "launchers: ddprun, alone, SLURM variables"
  echo "SKIP-PART mpirun part: mpirun not installed (examples/launchers.c under Open MPI not run)"
fi

# the examples are C99 (the Makefile builds them with -Werror); users may compile them as C++ too
for e in $EXAMPLES train_demo; do
  ${CXX:-c++} -std=c++17 -Wall -Wextra -Werror -pedantic -pthread -I. -x c++ -fsyntax-only "examples/$e.c" ||
    fail "examples/$e.c does not compile as C++17"
done
ok "every example compiles as C++17"
