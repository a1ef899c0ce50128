#!/usr/bin/env bash
# tools/gpu-check.sh: check a GPU machine in one command, and write what happened to a markdown report.
#
#   tools/gpu-check.sh [--dry-run] OUTDIR        (run from anywhere; OUTDIR/report.md, OUTDIR/logs/*.log)
#   tools/gpu-check.sh --build-only --sm 90 OUTDIR   build for sm_90 on a machine without the GPU, then stop
#   tools/gpu-check.sh --prebuilt OUTDIR          on the GPU machine: use that build (BUILD) where it loads
#
# 1. builds everything for the device's architecture (nvidia-smi --query-gpu=compute_cap, else nvcc's
#    -arch=native; sm_80 in a dry run): ddp_cuda.o with every warning an error, tools/gpu_check.cu,
#    ddprun and examples/gpu/train_gpu.cu, and the torch rows' C programs;
# 2. runs every GPU test: the SyncBN kernels through ddp_syncbn_* on device memory against the CPU code
#    and the reducer on device gradients and zero_stage 3 (tools/gpu_check.cu, nccl backend, 1 rank), NCCL on one rank
#    (tests/test_nccl.sh), 2 and 4 ranks on one GPU through the cpu backend with device buffers
#    (gpu_check devbuf under ddprun with DDP_BACKEND=cpu: collectives on cudaMalloc'd buffers against
#    host references, SyncBN's device path against its host path, the reducer, ZeRO-1), train_gpu under
#    ddprun (and its resume from the checkpoint); and against the machine's own PyTorch (2.x, whose
#    torchrun keeps its store in libuv's server): plain torchrun driving ddp.h ranks through its agent
#    store (one node of 3 ranks; two nodes of 2 through the c10d rendezvous), and the sampler against its
#    DistributedSampler (tests/interop/sampler_torch.py's 560 cases and one large N);
# 3. benchmarks: SyncBN forward+backward GB/s against the device's copy bandwidth and against torch's
#    BatchNorm on the same device and shape, the reducer's step overhead, all_reduce busbw.
# Every step has its own timeout and the whole run a 20-minute budget (GPU_CHECK_BUDGET seconds); a
# failing or timed-out step is recorded in the report and the next one runs. Needs the CUDA toolkit
# (nvcc, NCCL), python3 with torch for the torch rows (else they are "not run"), and the repository.
#
# --build-only [--sm N]: build everything for sm_N (default: as above) and stop, writing no report;
# --prebuilt: skip each build whose output is already in BUILD and loads (ldd finds its libraries), as
# one made by --build-only on another machine and carried over: the device's minutes go to the tests.
# --dry-run, or GPU_CHECK_NO_DEVICE=1: build what builds without a GPU (sm_80) and write the report with
# "no device" for every step that needs one (tests/test_gpu_check.sh runs this). A machine where
# nvidia-smi sees no GPU is treated the same way, and the report says so.
# Environment: BUILD (default build/gpu-check), NVCC, GPU_CHECK_BUDGET (default 1200), GPU_CHECK_STEP_MAX
# (no step gets a longer timeout than this; default: the budget), GPU_CHECK_ONLY (the ids of the steps to
# run, as their logs are named, e.g. "devbuf2 bench-reducer": a rerun of some; builds always run),
# PYTHON (python3). NCCL is found by tools/nccl-env.sh (the CUDA toolkit, the system, NCCL_HOME, or the
# wheel that pip's torch brings).
# Exit status: 0 when no step failed, 1 when one did, 2 for bad usage.
set -u
dry=${GPU_CHECK_NO_DEVICE:-0}
out="" build_only=0 prebuilt=0 want_sm=""
for a in "$@"; do
  case $a in
    --dry-run) dry=1 ;;
    --build-only) build_only=1 ;;
    --prebuilt) prebuilt=1 ;;
    --sm) want_sm=next ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    -*) echo "gpu-check.sh: unknown flag $a (see --help)" >&2; exit 2 ;;
    *) if [ "$want_sm" = next ]; then want_sm=$a; else out=$a; fi ;;
  esac
done
usage="usage: tools/gpu-check.sh [--dry-run | --build-only [--sm N] | --prebuilt] OUTDIR"
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
case $want_sm in next|*[!0-9]*) echo "$usage (--sm takes a number: 90 for sm_90, not '$want_sm')" >&2; exit 2 ;; esac
for v in GPU_CHECK_BUDGET GPU_CHECK_STEP_MAX; do
  case ${!v:-1} in ''|*[!0-9]*|0) echo "gpu-check.sh: $v is '${!v}': give a number of seconds above 0" >&2; exit 2 ;; esac
done
[ "$build_only" = 1 ] && dry=1
mkdir -p "$out/logs" || { echo "gpu-check.sh: cannot create $out/logs" >&2; exit 2; }
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd)
B=${BUILD:-build/gpu-check}
mkdir -p "$B"
B=$(cd "$B" && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
PYTHON=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET:-1200}
step_max=${GPU_CHECK_STEP_MAX:-$budget}
t_start=$(date +%s)
rows="$out/logs/.rows"
known=" " # the ids of the steps, as selected() saw them
benches="$out/logs/.benches"
: >"$rows"
: >"$benches"
failed=0

# ---- the step runner: every step is a row | step | result | seconds | detail | ----
row() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >>"$rows"; }
left() { echo $((budget - ($(date +%s) - t_start))); }

# selected ID "TITLE": whether GPU_CHECK_ONLY lets step ID run (builds always do); a "not selected" row
# when it does not. Every ID asked about is remembered, so that an ID in GPU_CHECK_ONLY that names no
# step can be reported.
selected() {
  known="$known$1 "
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [ "${1#build}" = "$1" ] && [ "$1" != nvcc-version ] &&
     [[ " $GPU_CHECK_ONLY " != *" $1 "* ]]; then
    row "$2" "not selected" 0 "GPU_CHECK_ONLY=$GPU_CHECK_ONLY"
    return 1
  fi
}

# step ID "TITLE" TIMEOUT COMMAND...: run with its own timeout (cut to what is left of the budget),
# output in logs/ID.log; the row's detail is the log's last non-empty line (or its SKIP-PART lines).
step() {
  local id=$1 title=$2 limit=$3 rc t0 t1 detail status remaining
  shift 3
  selected "$id" "$title" || return 1
  remaining=$(left)
  if [ "$remaining" -le 5 ]; then
    row "$title" "not run" 0 "the ${budget}-second budget was spent"
    return 1
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  [ "$limit" -gt "$step_max" ] && limit=$step_max
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/logs/$id.log" 2>&1
  rc=$?
  t1=$(date +%s)
  detail=$(grep -v '^[[:space:]]*$' "$out/logs/$id.log" | tail -n 1 | cut -c1-200 | tr '|' '/')
  case $rc in
    0) status=ok
       if grep -q '^SKIP-PART' "$out/logs/$id.log"; then
         status="ok (parts skipped)"
         detail=$(grep '^SKIP-PART' "$out/logs/$id.log" | cut -c1-160 | tr '|' '/' | paste -sd ';' -)
       fi ;;
    77) status="skipped" ;;
    124|137) status="**FAIL** (timed out after ${limit} s)"; failed=1 ;;
    *) status="**FAIL** (exit $rc)"; failed=1 ;;
  esac
  row "$title" "$status" $((t1 - t0)) "${detail:-} (log: logs/$id.log)"
  return $rc
}

# A step that needs a device, in a run without one.
no_device() { row "$1" "no device" 0 "${2:-needs a GPU}"; }

# ---- the machine ----
gpu_name="" cc="" sm=""
if [ "$dry" != 1 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$out/logs/nvidia-smi.log" 2>&1 ||
     ! grep -q '^GPU ' "$out/logs/nvidia-smi.log"; then
    dry=1
    no_gpu_reason="nvidia-smi sees no GPU (logs/nvidia-smi.log)"
  else
    gpu_name=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
    sm=$cc
  fi
fi
[ "$dry" = 1 ] && sm=80
[ -n "$want_sm" ] && sm=$want_sm
if [ -z "$sm" ]; then # an older nvidia-smi without compute_cap: ask nvcc
  sm=$("$(dirname "$NVCC")/__nvcc_device_query" 2>/dev/null | tr -d ' \n' | cut -d, -f1)
  [ -n "$sm" ] || sm=80
fi
gencode=(-gencode "arch=compute_$sm,code=[sm_$sm,compute_$sm]")
# shellcheck disable=SC2054 # the commas are nvcc's: -Xcompiler takes one comma-separated list
strict=(-std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -Xptxas -Werror -I.)

CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
# shellcheck disable=SC1091 # tools/nccl-env.sh, read at run time
. tools/nccl-env.sh # NCCL_INCLUDE, NCCL_LIB, the search paths when NCCL lies outside the toolkit; nccl_env_loads

# ---- 1. builds ----
# build ID TITLE FILE COMMAND...: a build step, or a "prebuilt" row when --prebuilt finds FILE ready
build() {
  local id=$1 title=$2 file=$3
  shift 3
  if [ "$prebuilt" = 1 ] && nccl_env_loads "$file"; then
    row "$title" "prebuilt" 0 "$(cat "$B/.prebuilt" 2>/dev/null || echo "found in $B")"
  else
    step "$id" "$title" 600 "$@"
  fi
}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  row "build: nvcc" "**FAIL**" 0 "nvcc not found (set NVCC or install the CUDA toolkit)"
  failed=1
else
  step nvcc-version "build: toolkit" 30 "$NVCC" --version
  [ -n "$NCCL_INCLUDE" ] || row "build: NCCL" "**FAIL**" 0 "nccl.h not found (tools/nccl-env.sh; set NCCL_HOME)"
  build build-ddp_cuda "build: ddp_cuda.o for sm_$sm (-Werror)" "$B/ddp_cuda.o" \
    "$NVCC" "${strict[@]}" "${gencode[@]}" -c ddp_cuda.cu -o "$B/ddp_cuda.o"
  build build-gpu_check "build: tools/gpu_check.cu (-Werror)" "$B/gpu_check" \
    "$NVCC" "${strict[@]}" "${gencode[@]}" -Xcompiler -pthread -o "$B/gpu_check" tools/gpu_check.cu "$B/ddp_cuda.o" -lnccl -lm
  build build-train_gpu "build: ddprun and examples/gpu/train_gpu.cu" "$B/train_gpu" \
    make -s GPU=1 NVCC="$NVCC" NVARCH="${gencode[*]}" BUILD="$B" "$B/ddprun" "$B/train_gpu"
fi
# the torch interop programs: plain C, no CUDA (a ddp.h program for torchrun, and the sampler's checker), the
# three compiled at once
cflags=(-std=c99 -O2 -pthread -I. -Itests)
# shellcheck disable=SC2016 # expanded by the inner shell
build build-interop "build: the torch interop programs (allreduce, store_peer, sampler_check)" "$B/sampler_check" \
  bash -c '"$0" "${@:2}" -o "$1/allreduce" tests/progs/allreduce.c -lm & a=$!
    "$0" "${@:2}" -o "$1/store_peer" tests/interop/store_peer.c -lm & b=$!
    "$0" "${@:2}" -o "$1/sampler_check" tests/interop/sampler_check.c -lm; c=$?
    wait $a && wait $b && [ $c = 0 ]' "${CC:-cc}" "$B" "${cflags[@]}"
if [ "$build_only" = 1 ]; then
  # test_nccl.sh's own build (its part 1) into BUILD/tests, for --prebuilt's run of it
  build build-test_nccl "build: tests/test_nccl.sh's programs" "$B/tests/nccl/test_nccl" \
    env BUILD="$B/tests" NVCC="$NVCC" BUILD_ONLY=1 bash tests/test_nccl.sh
  echo "built on $(hostname), commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown), for sm_$sm" >"$B/.prebuilt"
  cat "$rows"
  rm -f "$rows" "$benches"
  echo "gpu-check: built in $B for sm_$sm$([ "$failed" = 1 ] && echo ' (some builds FAILED)')"
  exit "$failed"
fi

# ---- 2. tests ----
nccl=(env DDP_BACKEND=nccl "$B/ddprun" --nproc-per-node) # the environment of this step only
torch_titles=("torch: plain torchrun, 1 node of 3 ddp.h ranks (its agent store)"
              "torch: plain torchrun, 2 nodes of 2 ddp.h ranks (c10d rendezvous)"
              "torch: tests/interop/store_interop.py (its TCPStore both ways, mixed workers)"
              "torch: DistributedSampler, 560 cases and N = 214748364, against ddp.h's")
devbuf_title() { echo "test: collectives + SyncBN + reducer + ZeRO-1 on device buffers, $1 ranks on one GPU (cpu backend)"; }
version_title="info: the NCCL ddp.h loaded (ncclGetVersion) and torch's"
multi_title="test: SyncBN + reducer, 2 ranks on one GPU (nccl, NCCL_MULTI_RANK_GPU_ENABLE=1)"
# version_at_least A B: version A (x.y.z) is B or later
version_at_least() { [ -n "$1" ] && printf '%s\n%s\n' "$2" "$1" | sort -V -C; }
if [ "$dry" = 1 ]; then
  reason=${no_gpu_reason:-"dry run (--dry-run or GPU_CHECK_NO_DEVICE=1)"}
  for t in "test: SyncBN on device vs the CPU code (nccl, 1 rank)" "test: reducer + FSDP on device (nccl, 1 rank)" \
           "test: tests/test_nccl.sh (NCCL, 1 rank)" "test: train_gpu under ddprun (and resume)"; do
    no_device "$t" "$reason"
  done
  no_device "test: SyncBN + reducer, 2 ranks (nccl, 2 GPUs)" "$reason"
  no_device "$version_title" "$reason"
  no_device "$multi_title" "$reason"
  for n in 2 4; do no_device "$(devbuf_title $n)" "$reason"; done
  for t in "${torch_titles[@]}"; do no_device "$t" "run on the GPU machine, against its own torch"; done
  for t in "bench: SyncBN forward+backward vs copy bandwidth" "bench: torch BatchNorm, same shape" \
           "bench: reducer step overhead" "bench: torch DDP step overhead, the same gradients (1 rank, nccl)" \
           "bench: all_reduce busbw (nccl, 1 rank)" \
           "bench: all_reduce busbw (cpu backend, device buffers, 2 ranks)"; do
    no_device "$t" "$reason"
  done
else
  step syncbn "test: SyncBN on device vs the CPU code (nccl, 1 rank)" 180 "${nccl[@]}" 1 "$B/gpu_check" syncbn
  step reducer "test: reducer + FSDP on device (nccl, 1 rank)" 180 "${nccl[@]}" 1 "$B/gpu_check" reducer
  step test_nccl "test: tests/test_nccl.sh (NCCL, 1 rank)" 420 env BUILD="$B/tests" NVCC="$NVCC" PREBUILT="$prebuilt" \
    bash tests/test_nccl.sh
  # twice in a fresh folder: the second run resumes from the first one's checkpoint
  # shellcheck disable=SC2016 # expanded by the inner shell
  step train_gpu "test: train_gpu under ddprun (and resume)" 240 bash -c 'set -o pipefail; cd "$(mktemp -d)" &&
    DDP_BACKEND=nccl "$0" --nproc-per-node 1 "$1" && DDP_BACKEND=nccl "$0" --nproc-per-node 1 "$1" | tee resume.log &&
    grep -q resuming resume.log' "$B/ddprun" "$B/train_gpu"
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [ "$gpus" -ge 2 ]; then # SyncBN's exchange through NCCL needs a GPU per rank
    # shellcheck disable=SC2016 # expanded by the inner shell
    step nccl2 "test: SyncBN + reducer, 2 ranks (nccl, 2 GPUs)" 240 \
      bash -c 'DDP_BACKEND=nccl "$0" --nproc-per-node 2 "$1" syncbn && DDP_BACKEND=nccl "$0" --nproc-per-node 2 "$1" reducer' \
      "$B/ddprun" "$B/gpu_check"
  else
    row "test: SyncBN + reducer, 2 ranks (nccl, 2 GPUs)" "not run" 0 "one GPU: NCCL needs a GPU per rank (the cpu backend rows below share one)"
  fi
  # The NCCL that ddp.h's programs load and torch's own. From NCCL 2.30.3 on, ranks may share a GPU
  # (NCCL_MULTI_RANK_GPU_ENABLE=1): then the nccl backend runs with 2 ranks on this one GPU.
  torch_nccl=$("$PYTHON" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null) ||
    torch_nccl="none (no torch with CUDA)"
  # shellcheck disable=SC2016 # expanded by the inner shell
  step nccl-version "$version_title" 30 bash -c '"$0" nccl-version && echo "torch_nccl_version=$1"' "$B/gpu_check" \
    "$torch_nccl"
  nccl_version=$(sed -n 's/^nccl_version=//p' "$out/logs/nccl-version.log" 2>/dev/null | tail -n 1)
  if version_at_least "$nccl_version" 2.30.3; then
    # shellcheck disable=SC2016 # expanded by the inner shell
    step nccl-multi "$multi_title" 240 bash -c 'export NCCL_MULTI_RANK_GPU_ENABLE=1 DDP_BACKEND=nccl;
      "$0" --nproc-per-node 2 "$1" syncbn && "$0" --nproc-per-node 2 "$1" reducer' "$B/ddprun" "$B/gpu_check"
  else
    selected nccl-multi "$multi_title" &&
      row "$multi_title" "not run" 0 "NCCL ${nccl_version:-of unknown version} is older than 2.30.3: two ranks cannot share a GPU"
  fi
  # several ranks share the one GPU: the cpu backend stages the device buffers (src/devbuf.c)
  for n in 2 4; do
    step "devbuf$n" "$(devbuf_title $n)" 240 env DDP_BACKEND=cpu "$B/ddprun" --nproc-per-node "$n" "$B/gpu_check" devbuf
  done

  # against the machine's own torch: torchrun (torch 2.x keeps its store in libuv's server) and the sampler
  scratch=$(mktemp -d)
  torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) || torch_version=""
  # torch_step ID TITLE LIMIT COMMAND...: a step that needs torch ("not run" without it)
  torch_step() {
    if [ -n "$torch_version" ]; then step "$@"; else selected "$1" "$2" && row "$2" "not run" 0 "$PYTHON has no torch"; return 1; fi
  }
  # torchrun_ranks NODES PER_NODE: NODES torchrun agents on this host run tests/progs/allreduce (ddp_init
  # from torchrun's environment, two all_reduces checked in the program); every rank must say "ok"
  # shellcheck disable=SC2317 # called by the steps' inner shells (export -f)
  torchrun_ranks() {
    local nodes=$1 per=$2 port=$((29700 + RANDOM % 2000)) n rc=0 ok old=()
    # torch 1.x's torchrun on Python 3.11 stops with "'NoneType' object has no attribute 'get'" without these
    [ "${torch_version%%.*}" = 1 ] && old=(--redirects 1 --tee 1)
    if [ "$nodes" = 1 ]; then
      "$PYTHON" -m torch.distributed.run "${old[@]}" --standalone --nproc_per_node "$per" --no_python "$B/allreduce" \
        >"$scratch/torchrun.0" 2>&1 || rc=$?
    else
      for ((n = 0; n < nodes; n++)); do
        "$PYTHON" -m torch.distributed.run "${old[@]}" --nnodes "$nodes" --nproc_per_node "$per" --rdzv_backend c10d \
          --rdzv_endpoint "127.0.0.1:$port" --rdzv_id gpu-check --no_python "$B/allreduce" >"$scratch/torchrun.$n" 2>&1 &
      done
      for ((n = 0; n < nodes; n++)); do wait -n || rc=$?; done
    fi
    cat "$scratch"/torchrun.*
    ok=$(cat "$scratch"/torchrun.* | grep -c "of $((nodes * per)): all_reduce ok")
    rm -f "$scratch"/torchrun.*
    echo "torchrun: $nodes node(s) x $per: exit $rc, $ok of $((nodes * per)) ddp.h ranks ok"
    [ "$rc" = 0 ] && [ "$ok" = $((nodes * per)) ]
  }
  export -f torchrun_ranks
  export PYTHON B scratch torch_version
  torch_step torchrun1 "${torch_titles[0]}" 120 bash -c 'torchrun_ranks 1 3'
  torch_step torchrun2 "${torch_titles[1]}" 120 bash -c 'torchrun_ranks 2 2'
  torch_step store-interop "${torch_titles[2]}" 180 "$PYTHON" tests/interop/store_interop.py "$B/store_peer" "$B/allreduce"
  # the large N: torch 2.x's randperm is ddp.h's permutation 0 (DDP_PERMUTATION_TORCH), torch 1.x's is 1
  # shellcheck disable=SC2016 # expanded by the inner shell
  torch_step sampler "${torch_titles[3]}" 240 bash -c 'set -e; n=214748364 perm=0
    [ "${torch_version%%.*}" = 1 ] && perm=1
    echo "against torch $torch_version (ddp.h permutation $perm)"
    "$PYTHON" tests/interop/sampler_torch.py >"$scratch/cases"; "$B/sampler_check" <"$scratch/cases"
    "$PYTHON" tests/interop/sampler_torch_large.py $n 1000 7 5 2 >"$scratch/torch_large"
    "$B/sampler_check" slice $n 1000 7 5 2 $perm >"$scratch/ddp_large"
    cmp "$scratch/ddp_large" "$scratch/torch_large"
    echo "N=$n: the $(wc -l <"$scratch/ddp_large") indices of rank 7 of 1000 are torch'"'"'s"'
  rm -rf "$scratch"

  # ---- 3. benchmarks ----
  shape=(32 128 3136) # N C S: a ResNet-50 stage-1 activation (N=32, C=128, 56 x 56), f32
  step bench-syncbn "bench: SyncBN forward+backward vs copy bandwidth" 180 "${nccl[@]}" 1 "$B/gpu_check" bench-syncbn "${shape[@]}" &&
    grep -E '^(syncbn|copy)_' "$out/logs/bench-syncbn.log" >>"$benches"
  torch_step bench-torch "bench: torch BatchNorm, same shape" 180 "$PYTHON" - "${shape[@]}" <<'EOF' && grep -E '^torch_' "$out/logs/bench-torch.log" >>"$benches"
import sys, time
import torch
N, C, S = (int(v) for v in sys.argv[1:4])
assert torch.cuda.is_available(), "torch sees no CUDA device"
x = torch.randn(N, C, S, device="cuda", requires_grad=True)
dy = torch.randn(N, C, S, device="cuda")
bn = torch.nn.BatchNorm1d(C).cuda()
def step():
    x.grad = None
    bn(x).backward(dy)
for _ in range(3): step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20): step()
torch.cuda.synchronize()
t = (time.perf_counter() - t0) / 20
print(f"torch_version={torch.__version__}")
print(f"torch_bn_ms={t * 1e3:.4f}")
print(f"torch_bn_GBps={8 * 4 * N * C * S / t / 1e9:.1f}")
EOF
  step bench-reducer "bench: reducer step overhead" 180 "${nccl[@]}" 1 "$B/gpu_check" bench-reducer &&
    grep -E '^(reducer|flat)_' "$out/logs/bench-reducer.log" >>"$benches"
  torch_step bench-torch-ddp "bench: torch DDP step overhead, the same gradients (1 rank, nccl)" 120 \
    "$PYTHON" bench/peers/torch_ddp_gpu.py && grep -E '^torch_(ddp|plain)_' "$out/logs/bench-torch-ddp.log" >>"$benches"
  step bench-allreduce "bench: all_reduce busbw (nccl, 1 rank)" 180 "${nccl[@]}" 1 "$B/gpu_check" bench-allreduce
  step bench-allreduce-cpu2 "bench: all_reduce busbw (cpu backend, device buffers, 2 ranks)" 180 \
    env DDP_BACKEND=cpu "$B/ddprun" --nproc-per-node 2 "$B/gpu_check" bench-allreduce
fi

# GPU_CHECK_ONLY naming a step that does not exist (a typo) would otherwise run nothing and say nothing
if [ "$dry" != 1 ]; then
  for id in ${GPU_CHECK_ONLY:-}; do
    [[ "$known" == *" $id "* ]] && continue
    row "GPU_CHECK_ONLY: $id" "**FAIL**" 0 "no step has the id '$id' (the ids are the logs' names: syncbn, devbuf2, bench-reducer, ...)"
    failed=1
  done
fi

# ---- the report ----
val() { sed -n "s/^$1=//p" "$benches" | tail -n 1; }
{
  echo "# GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(hostname); commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if [ "$dry" = 1 ]; then
    echo "- device: **no device** (${no_gpu_reason:-dry run}); built for sm_$sm only to check that it builds"
  else
    echo "- device: $gpu_name; compute capability ${cc:-unknown}; built for sm_$sm"
  fi
  echo "- nvcc: $NVCC, $(tail -n 1 "$out/logs/nvcc-version.log" 2>/dev/null)"
  echo "- NCCL: ${NCCL_LIB:-not found} (header: ${NCCL_INCLUDE:-not found}; tools/nccl-env.sh); loaded: ${nccl_version:-not seen} (ncclGetVersion); torch's: ${torch_nccl:-not seen}"
  echo "- total time: $(($(date +%s) - t_start)) s (budget $budget s)"
  echo
  echo "| step | result | seconds | detail |"
  echo "|---|---|---|---|"
  cat "$rows"
  echo
  echo "## Benchmarks"
  echo
  if [ -s "$benches" ]; then
    sb=$(val syncbn_GBps) cp=$(val copy_GBps) tb=$(val torch_bn_GBps)
    echo "SyncBN (training forward + backward, f32, shape $(val syncbn_shape); bytes counted as 8 passes over the activation):"
    echo
    echo "| measure | value |"
    echo "|---|---|"
    echo "| ddp_syncbn_forward + backward (device path) | $(val syncbn_ms) ms, ${sb:-?} GB/s |"
    echo "| device copy bandwidth (cudaMemcpy D2D, read + write) | ${cp:-?} GB/s |"
    echo "| SyncBN / copy bandwidth | $(val syncbn_vs_copy) |"
    echo "| torch $(val torch_version) BatchNorm1d forward + backward | $(val torch_bn_ms) ms, ${tb:-?} GB/s |"
    if [ -n "$sb" ] && [ -n "$tb" ]; then
      echo "| ddp / torch | $(awk -v a="$sb" -v b="$tb" 'BEGIN { printf "%.2f", a / b }') |"
    fi
    echo "| reducer step ($(val reducer_params) params, $(val reducer_MiB) MiB, $(val reducer_ranks) rank(s), $(val reducer_backend)), gradients in separate allocations | $(val reducer_step_ms) ms |"
    echo "| the same, gradients side by side in one allocation (reduced in place) | $(val reducer_inplace_step_ms) ms |"
    echo "| one all_reduce of the same bytes | $(val flat_allreduce_ms) ms |"
    echo "| reducer overhead per step (separate / in place) | $(val reducer_overhead_ms) / $(val reducer_inplace_overhead_ms) ms |"
    echo "| torch $(val torch_ddp_version) DDP overhead per step, the same gradients (bucket copies / gradient_as_bucket_view; bench/peers/torch_ddp_gpu.py) | $(val torch_ddp_overhead_ms) / $(val torch_ddp_view_overhead_ms) ms |"
  else
    echo "(none ran)"
  fi
  for f in "$out/logs/bench-allreduce.log" "$out/logs/bench-allreduce-cpu2.log"; do
    if [ -f "$f" ] && grep -q '^| bytes' "$f"; then
      echo
      echo "all_reduce ($(grep '^allreduce ' "$f" | head -n 1 | cut -d' ' -f2-)):"
      echo
      grep '^|' "$f"
    fi
  done
  if grep -q 'FAIL' "$rows"; then
    echo
    echo "## Failures (last 30 lines of each log)"
    for f in "$out"/logs/*.log; do
      id=$(basename "$f" .log)
      grep -q "FAIL.*logs/$id.log" "$rows" || continue
      echo
      echo "### $id"
      echo
      echo '```'
      tail -n 30 "$f"
      echo '```'
    done
  fi
} >"$out/report.md"
rm -f "$rows" "$benches"
echo "gpu-check: report in $out/report.md$([ "$failed" = 1 ] && echo ' (some steps FAILED)')"
exit "$failed"
