#!/usr/bin/env bash
# ddp.h against CURRENT torch (2.x: Debian sid's python3-torch, 2.14.1 when last run, in the chroot
# tools/torch-current.sh makes),
# beside the torch 1.13 suites (test_interop_store.sh, test_interop_sampler.sh, ...):
#  1. the store both ways in torch 2.x's TCPStore protocol (tests/interop/store_interop.py): torch 2.x's
#     client against ddp.h's server step by step beside torch's own server, ddp.h's client against torch's
#     server, a torch worker and ddp.h workers sharing the agent store, and whole ddp.h programs (ddp_init,
#     all_reduce) as torchrun's workers on one node and on two. Debian's torch 2.x is built without libuv,
#     and its torchrun then fails before any worker starts ("use_libuv was requested but PyTorch was built
#     without libuv support", even with USE_LIBUV=0): the script plays torchrun's agent with torch's own
#     TCPStore(is_master=True, use_libuv=False) and torchrun's worker environment.
#  2. the sampler: the 560 recorded cases of tests/interop/sampler_torch.py made by current torch, and
#     current torch's own DistributedSampler at N = 214748364 and 300000007 (the inside-out randperm regime;
#     ~30 s each and ~3-4 GiB); SAMPLER_TORCH_LARGE=0 leaves out N = 300000007.
#  3. syncbn: tests/interop/syncbn_dump.c's SyncBatchNorm runs (1, 2, 3, 4, 8 ranks) checked by
#     tests/interop/syncbn_check.py with current torch's BatchNorm1d/2d/3d (1e-5 relative, as for 1.13).
#  4. reducer: tests/interop/reducer_torch.py with current torch's DistributedDataParallel (gloo, 2 ranks,
#     tcp:// rendezvous with USE_LIBUV=0, GLOO_SOCKET_IFNAME=lo): final weights within 1e-5 (plain, accum)
#     and 1e-3 (fp16_compress_hook; this gloo has no float16 all_reduce, so it is compared with an equivalent
#     hook and a SKIP-PART line says so), uneven inputs on 3 ranks (ddp.join(), with and without
#     throw_on_early_termination, against ddp_reducer_join) within 1e-5, ZeroRedundancyOptimizer(AdamW) and
#     its consolidate_state_dict against zero_stage = 1 and ddp_reducer_consolidate_state within 1e-4, ZeRO-1 +
#     uneven inputs (ZeroRedundancyOptimizer(AdamW) + Join against the ddp_reducer_join_step loop; 1.02e-05
#     measured on torch 2.14) within 1e-4, and the bucket layouts of _compute_bucket_assignment_by_size.
#  5. amp (tests/interop/amp_torch.py, ~6 s): ddp_grad_scaler_update against torch.amp.GradScaler("cpu")
#     driven with scale/step/update over 2 x 2000 steps of a fixed found_inf pattern (torch's defaults but
#     growth_interval 7, down into f32 subnormals; 1.5 / 0.7 / 3 from 1000.1, up to FLT_MAX): the same scale
#     bits and skip decisions; ddp_reducer_clip_coef within one f32 ulp of clip_grad_norm_'s coefficient.
#  6. checkpoint: ddp.h's file read by the safetensors package into torch tensors
#     (tests/interop/safetensors_torch.py: names, dtypes, shapes, values, bytes, checksums, metadata) and by
#     the json+numpy reader (safetensors_check.py) under current numpy; files written by
#     safetensors.torch.save_file (with and without checksums) loaded by ddp.h, one of them corrupted and
#     refused (python3-safetensors 0.8.0 when last run). Without python3-safetensors in the chroot the
#     package half prints a SKIP-PART line.
# The ddp.h programs are built here and run on the host or (the store and reducer peers, started by the
# Python scripts) inside the chroot; everything they exchange lies under $BUILD/interop-current, inside the
# clone, which the chroot sees at the same path. Each step of parts 3-5 runs under `timeout`.
# Skips (exit 77) when the chroot is absent (make it: tools/torch-current.sh create, about 2 GB and a few
# minutes) or when not root (chroot needs it).
set -euo pipefail
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
TC=tools/torch-current.sh
if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
  echo "skipped: the current-torch chroot needs root (chroot, bind mounts)"
  exit 77
fi
if ! ver=$($TC status 2>/dev/null | tail -1); then
  echo "skipped: no current-torch chroot at $($TC root) (make it: $TC create; about 2 GB, a few minutes)"
  exit 77
fi
echo "current torch: $ver (chroot $($TC root))"
W="$BUILD/interop-current"
tl_cc "$W/store_peer" tests/interop/store_peer.c
tl_cc "$W/allreduce" tests/progs/allreduce.c
tl_cc "$W/sampler_check" tests/interop/sampler_check.c

echo "== store (torch 2.x's TCPStore protocol)"
$TC run python3 tests/interop/store_interop.py "$W/store_peer" "$W/allreduce"

echo "== sampler: recorded cases from current torch"
$TC run python3 tests/interop/sampler_torch.py > "$W/sampler_cases.txt"
"$W/sampler_check" < "$W/sampler_cases.txt"
if [ -n "${SAN:-}" ]; then
  echo "SKIP-PART large-N sampler part: not run under sanitizers (SAN=$SAN)"
elif avail_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo) && [ "$avail_kib" -lt $((4 * 1024 * 1024)) ]; then
  echo "SKIP-PART large-N sampler part: needs 4 GiB of free memory, $((avail_kib / 1024)) MiB available"
else
  NS="214748364"
  [ "${SAMPLER_TORCH_LARGE:-1}" = 1 ] && NS="$NS 300000007"
  R=1000 RANK=7 SEED=5 EPOCH=2
  for N in $NS; do
    $TC run python3 tests/interop/sampler_torch_large.py "$N" $R $RANK $SEED $EPOCH > "$W/sampler_torch_$N.txt"
    "$W/sampler_check" slice "$N" $R $RANK $SEED $EPOCH 0 > "$W/sampler_ddp_$N.txt"
    cmp "$W/sampler_ddp_$N.txt" "$W/sampler_torch_$N.txt"
    echo "N=$N: $(wc -l < "$W/sampler_ddp_$N.txt") indices of rank $RANK/$R equal current torch's own"
  done
fi

# Parts 3-5: each step under a time limit, so a hung torch or peer fails here with a message instead of
# using up the runner's limit for the whole script. `timeout` runs inside the chroot for the torch steps
# (it signals python and the processes python started; the chroot's mounts are undone when it returns).
step() {  # step SECONDS WHAT CMD ARG...: run CMD; on failure or timeout say which step, then fail
  local limit=$1 what=$2 rc=0
  shift 2
  "$@" || rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "FAILED: $what: no result within $limit s (timed out)"; exit 1
  elif [ $rc -ne 0 ]; then
    echo "FAILED: $what (exit $rc)"; exit 1
  fi
}
in_chroot() {  # in_chroot SECONDS CMD ARG...: CMD in the chroot, killed after SECONDS (10 more for SIGKILL)
  local limit=$1
  shift
  $TC run env USE_LIBUV=0 GLOO_SOCKET_IFNAME=lo timeout -k 10 "$limit" "$@"
}

echo "== syncbn: SyncBatchNorm vs current torch's BatchNorm1d/2d/3d (tolerance 1e-5 relative)"
tl_cc "$W/syncbn_dump" tests/interop/syncbn_dump.c
rm -rf "$W/syncbn"
dirs=()
for ranks in 1 2 3 4 8; do
  mkdir -p "$W/syncbn/r$ranks"
  step 180 "syncbn_dump on $ranks rank(s)" timeout -k 10 180 "$W/syncbn_dump" "$W/syncbn/r$ranks" "$ranks"
  dirs+=("$W/syncbn/r$ranks")
done
step 300 "syncbn_check.py with current torch" in_chroot 300 python3 tests/interop/syncbn_check.py "${dirs[@]}"

echo "== reducer: ddp.h's reducer vs current torch's DistributedDataParallel (gloo; 1e-5, fp16 1e-3)"
tl_cc "$W/reducer_peer" tests/interop/reducer_peer.c
rm -rf "$W/reducer"
mkdir -p "$W/reducer"
step 420 "reducer_torch.py with current torch" \
  in_chroot 420 python3 tests/interop/reducer_torch.py "$W/reducer_peer" "$W/reducer"

echo "== amp: ddp_grad_scaler and ddp_reducer_clip_coef vs torch.amp.GradScaler(\"cpu\") and clip_grad_norm_"
tl_cc "$W/amp_peer" tests/interop/amp_peer.c
step 60 "amp_torch.py with current torch" in_chroot 60 python3 tests/interop/amp_torch.py "$W/amp_peer"

echo "== checkpoint: safetensors files between ddp.h and current torch"
tl_cc "$W/safetensors_helper" tests/interop/safetensors_helper.c -O1
C="$W/checkpoint"
rm -rf "$C"
mkdir -p "$C"
step 60 "safetensors_helper write" timeout -k 10 60 "$W/safetensors_helper" write "$C/from_ddp.safetensors"
step 120 "json+numpy reader (current numpy) reads ddp.h's file" \
  in_chroot 120 python3 tests/interop/safetensors_check.py read "$C/from_ddp.safetensors"
if ! st_ver=$($TC run python3 -c 'import safetensors, safetensors.torch; print(safetensors.__version__)' 2>&1 | tail -1) ||
   [ -z "$st_ver" ]; then
  echo "SKIP-PART checkpoint (safetensors package): the chroot has no usable python3-safetensors ($st_ver); \
only the json+numpy reader ran"
  exit 0
fi
echo "safetensors package $st_ver"
step 120 "safetensors.torch.load_file reads ddp.h's file" \
  in_chroot 120 python3 tests/interop/safetensors_torch.py read "$C/from_ddp.safetensors"
step 120 "safetensors.torch.save_file writes" \
  in_chroot 120 python3 tests/interop/safetensors_torch.py write "$C/from_torch.safetensors"
step 60 "ddp.h reads safetensors.torch's file" timeout -k 10 60 "$W/safetensors_helper" read "$C/from_torch.safetensors"
step 120 "safetensors.torch.save_file writes (no checksums)" \
  in_chroot 120 python3 tests/interop/safetensors_torch.py write "$C/from_torch_nocrc.safetensors" --no-checksums
step 60 "ddp.h reads safetensors.torch's file without checksums" \
  timeout -k 10 60 "$W/safetensors_helper" read-nocrc "$C/from_torch_nocrc.safetensors"
step 60 "flip a bit of safetensors.torch's file" \
  in_chroot 60 python3 tests/interop/safetensors_check.py corrupt "$C/from_torch.safetensors" "$C/corrupt.safetensors"
step 60 "ddp.h refuses a corrupted safetensors.torch file" \
  timeout -k 10 60 "$W/safetensors_helper" expect-corrupt "$C/corrupt.safetensors"

echo "== fsdp: ddp_fsdp_save_full's whole model (examples/fsdp on 2 ranks) into current torch's nn.Linear layers"
tl_cc "$W/fsdp" examples/fsdp.c
make -s build/ddprun >/dev/null
step 60 "examples/fsdp on 2 ranks --save" \
  timeout -k 10 60 build/ddprun --nproc-per-node 2 "$W/fsdp" --save "$C/fsdp.safetensors"
step 120 "safetensors.torch.load_file + load_state_dict of ddp_fsdp_save_full's file" in_chroot 120 python3 -c '
import sys, torch, safetensors.torch as st
sd = st.load_file(sys.argv[1])
model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(4)])
model.load_state_dict({k.replace("layers.", ""): v for k, v in sd.items()}, strict=True)
assert all(torch.isfinite(p).all() for p in model.parameters())
print("torch loaded %d tensors: %s" % (len(sd), sorted((k, tuple(v.shape)) for k, v in sd.items())[:2]))
' "$C/fsdp.safetensors"
echo "current torch interop: ok"
