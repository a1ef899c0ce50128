#!/usr/bin/env bash
# llm.c's train_gpt2.c (CPU, fp32) as an FSDP client: tests/llmc/train_gpt2_fsdp.c, the port to zero_stage 3
# (tests/llmc/README.md), built against the committed ddp.h and run under build/ddprun with llm.c's own main loop
# on offline stand-ins the port writes (a random-init checkpoint, a synthetic token stream):
#   1. 40 steps at 1, 2 and 3 ranks (zero_stage 3, prefetch 1) of the same global batch (6 rows; rank r takes
#      rows [r*B, (r+1)*B)): every step's loss (the mean over ranks) at 2 and 3 ranks is within 1e-5 (relative)
#      of the 1-process run, and so is every validation loss (llm.c's, every 10 steps: forward-only passes,
#      as is the sampling at step 20); the loss falls (the last step's < 80% of the first's)
#   2. zero_stage 2 with the same units as buckets at 2 ranks: every loss equals zero_stage 3's bit for bit
#   3. parameter memory per rank: zero_stage 3's param_bytes_peak equals the formula of reducer.h at 1-3 ranks
#      (printed beside zero_stage 2's whole model), and the GPT-2 124M table computed by the program from its
#      config: 498 MB (stage 2) -> 463 / 339 / 277 MB at N = 2 / 4 / 8 (FSDP.md G7)
set -u
. "$(dirname "$0")/testlib.sh"
DDPRUN=$BUILD/ddprun
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" "$BUILD/ddp_impl.o" || fail "cannot build $DDPRUN and $BUILD/ddp_impl.o"
tl_tmpdir test_llmc_fsdp
PROG=$T/train_gpt2_fsdp
tl_cc "$PROG" tests/llmc/train_gpt2_fsdp.c "$BUILD/ddp_impl.o" || fail "cannot build the port"

# run NAME NPROC ARGS...: the port on NPROC ranks; its output in $T/NAME.out, the training losses in $T/NAME.loss
# (step, loss) and the validation losses in $T/NAME.val (step, loss)
run() {
  local name=$1 n=$2; shift 2
  timeout 120 "$DDPRUN" --standalone --nproc-per-node "$n" "$PROG" -e "$T/model.bin" -i "$T/tokens.bin" "$@" >"$T/$name.out" 2>&1 ||
    { cat "$T/$name.out"; fail "$name ($n ranks $*) exited $?"; }
  sed -n 's/^step \([0-9]*\): train loss \([0-9.]*\) .*/\1 \2/p' "$T/$name.out" >"$T/$name.loss"
  [ "$(wc -l <"$T/$name.loss")" -eq 40 ] || { cat "$T/$name.out"; fail "$name: not 40 steps"; }
  sed -n 's/^val loss \([0-9.]*\)$/\1/p' "$T/$name.out" | awk '{ print 10 * (NR - 1), $1 }' >"$T/$name.val"
  [ "$(wc -l <"$T/$name.val")" -eq 4 ] || { cat "$T/$name.out"; fail "$name: not 4 validation losses"; }
}
run one 1
run two 2
run three 3
run two_z2 2 -z 2

echo "== 1. losses at 2 and 3 ranks vs 1 process (relative)"
for name in two.loss three.loss two.val three.val; do  # training losses, validation losses
  base=one.${name#*.}
  worst=$(paste "$T/$base" "$T/$name" | awk '{ d = ($2 - $4) / $2; if (d < 0) d = -d; if (d > w) w = d }
                                            END { printf "%.3g\n", w }')
  echo "$name: largest relative difference $worst"
  awk -v w="$worst" 'BEGIN { exit !(w <= 1e-5) }' || { paste "$T/$base" "$T/$name"; fail "$name: $worst > 1e-5"; }
done
first=$(head -n 1 "$T/one.loss" | cut -d' ' -f2) last=$(tail -n 1 "$T/one.loss" | cut -d' ' -f2)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < 0.8 * f) }' || fail "the loss does not fall: $first -> $last"
ok "40 steps and 4 validations at 2 and 3 ranks = 1 process within 1e-5; the loss falls $first -> $last"

echo "== 2. zero_stage 2 (same units as buckets) vs zero_stage 3 at 2 ranks"
cmp -s "$T/two.loss" "$T/two_z2.loss" || { paste "$T/two.loss" "$T/two_z2.loss"; fail "stage 2 and 3 losses differ"; }
cmp -s "$T/two.val" "$T/two_z2.val" || { paste "$T/two.val" "$T/two_z2.val"; fail "stage 2 and 3 validation losses differ"; }
ok "every loss bit for bit (and every validation loss as printed)"

echo "== 3. parameter memory per rank"
for name in one two three; do
  line=$(grep '^parameter memory per rank: zero_stage 3' "$T/$name.out") || fail "$name: no memory line"
  echo "$line"
  echo "$line" | grep -q ': \([0-9]*\) bytes (param_bytes_peak; formula \1)' || fail "$name: param_bytes_peak is not the formula's"
done
grep '^parameter memory per rank: zero_stage 2' "$T/two_z2.out" || fail "no memory line at stage 2"
grep -A3 '^GPT-2 124M' "$T/one.out"
grep -qxF '| GPT-2 124M, root kept, prefetch 1 | 498 MB | 463 MB | 339 MB | 277 MB |' "$T/one.out" ||
  fail "GPT-2 124M's memory table is not FSDP.md's"
ok "param_bytes_peak = formula at 1-3 ranks; GPT-2 124M: 498 MB -> 463 / 339 / 277 MB"
