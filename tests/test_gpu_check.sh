#!/usr/bin/env bash
# tools/gpu-check.sh without a GPU. (1) bash -n and shellcheck (when installed) on the script; no OUTDIR
# is a usage error (exit 2), and so are --sm without a number or with another word, and a
# GPU_CHECK_STEP_MAX that is not a number. (2) A failing toolkit (a fake nvcc that exits 1): every build step is a
# FAIL row, the device steps still get their "no device" rows, the report has a Failures section with the
# logs, exit 1. (3) The budget: a fake nvcc that hangs is cut off by the step timeout (GPU_CHECK_BUDGET=12)
# and the steps after it are "not run" instead of waited for (the whole run ends within 60 s). (4) With
# the real nvcc (SKIP-PART without it): --dry-run builds ddp_cuda.o, tools/gpu_check.cu, ddprun and
# train_gpu for sm_80 (every warning an error) and writes the report with "no device" rows (among them the
# 2- and 4-ranks-on-one-GPU rows: gpu_check devbuf under ddprun, DDP_BACKEND=cpu), exit 0; (5) then
# --prebuilt reuses that build ("prebuilt" rows, nothing rebuilt). (1b) tools/nccl-env.sh finds a fake
# torch wheel's NCCL (include, lib, the search paths, the libnccl.so link for -lnccl). (6) With a fake
# nvidia-smi and GPU_CHECK_ONLY: an id that names no step is a FAIL row; the torch rows are "not run" without torch, and with the machine's torch
# (1.13 here) plain torchrun drives ddp.h ranks on 1 and 2 nodes and the sampler matches its own at
# N = 214748364.
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; [ -f "$tmp/report.md" ] && cat "$tmp/report.md"; exit 1; }

echo "== (1) syntax, shellcheck, usage"
bash -n tools/gpu-check.sh || fail "bash -n"
if command -v shellcheck >/dev/null 2>&1; then shellcheck tools/gpu-check.sh || fail "shellcheck"; else
  echo "SKIP-PART shellcheck: not installed"; fi
tools/gpu-check.sh >/dev/null 2>&1
[ $? = 2 ] || fail "no OUTDIR should be exit 2"
tools/gpu-check.sh --build-only "$tmp/o" --sm >/dev/null 2>&1
[ $? = 2 ] || fail "--sm without a number should be exit 2"
tools/gpu-check.sh --build-only --sm 9.0 "$tmp/o" 2>"$tmp/usage" >/dev/null
rc=$?
if ! { [ $rc = 2 ] && grep -q "not '9.0'" "$tmp/usage"; }; then fail "--sm 9.0 should be exit 2 naming it"; fi
GPU_CHECK_STEP_MAX=1m tools/gpu-check.sh --dry-run "$tmp/o" 2>"$tmp/usage" >/dev/null
rc=$?
if ! { [ $rc = 2 ] && grep -q "GPU_CHECK_STEP_MAX is '1m'" "$tmp/usage"; }; then fail "GPU_CHECK_STEP_MAX=1m should be exit 2 naming it"; fi

echo "== (1b) tools/nccl-env.sh finds the NCCL of pip's torch wheel"
if [ -f /usr/include/nccl.h ] || [ -n "${NCCL_HOME:-}" ]; then
  echo "SKIP-PART nccl-env wheel: this machine has a system NCCL (found first)"
else
  mkdir -p "$tmp/site/nvidia/nccl/lib" "$tmp/site/nvidia/nccl/include"
  : >"$tmp/site/nvidia/nccl/lib/libnccl.so.2"
  : >"$tmp/site/nvidia/nccl/include/nccl.h"
  printf '#!/bin/sh\necho %s\n' "$tmp/site" >"$tmp/fakepy" && chmod +x "$tmp/fakepy"
  # shellcheck disable=SC2016 # expanded by the inner shell
  got=$(env -u CPATH -u LIBRARY_PATH -u LD_LIBRARY_PATH CUDA_HOME=/nonexistent PYTHON="$tmp/fakepy" TMPDIR="$tmp" \
    bash -c '. tools/nccl-env.sh; echo "$NCCL_INCLUDE|$NCCL_LIB|$CPATH|$LD_LIBRARY_PATH|$LIBRARY_PATH"')
  want="$tmp/site/nvidia/nccl/include|$tmp/site/nvidia/nccl/lib|$tmp/site/nvidia/nccl/include|$tmp/site/nvidia/nccl/lib|$tmp/ddp-nccl-link.$(id -u)"
  [ "$got" = "$want" ] || fail "nccl-env.sh with a wheel: got '$got', want '$want'"
  [ "$(readlink "$tmp/ddp-nccl-link.$(id -u)/libnccl.so")" = "$tmp/site/nvidia/nccl/lib/libnccl.so.2" ] ||
    fail "nccl-env.sh made no libnccl.so link for -lnccl"
  echo "a wheel's NCCL: include, lib, the search paths and the libnccl.so link"
fi

device_rows=(
  "test: SyncBN on device vs the CPU code" "test: reducer + FSDP on device" "test: tests/test_nccl.sh"
  "test: train_gpu under ddprun" "bench: SyncBN forward+backward vs copy bandwidth" "bench: torch BatchNorm"
  "bench: reducer step overhead" "bench: all_reduce busbw" "test: SyncBN + reducer, 2 ranks (nccl, 2 GPUs)"
  "test: collectives + SyncBN + reducer + ZeRO-1 on device buffers, 2 ranks on one GPU (cpu backend)"
  "test: collectives + SyncBN + reducer + ZeRO-1 on device buffers, 4 ranks on one GPU (cpu backend)"
  "bench: all_reduce busbw (cpu backend, device buffers, 2 ranks)")
check_no_device_rows() { # $1: report
  local r
  for r in "${device_rows[@]}"; do
    grep -F "| $r" "$1" | grep -q "| no device |" || fail "no 'no device' row for '$r'"
  done
  ! grep -q "tests/test_cuda_devbuf" "$1" || fail "a device row runs the CPU harness's test_cuda_devbuf (no GPU in it)"
}

echo "== (2) a toolkit that fails: every step recorded, none aborts the rest"
printf '#!/bin/sh\necho "fake nvcc: refusing $*" >&2\nexit 1\n' >"$tmp/nvcc" && chmod +x "$tmp/nvcc"
# (the host compiler fails too: the host programs' build is a step like the others, and compiling them takes
# a minute that (4) spends anyway)
CC="$tmp/nvcc" NVCC="$tmp/nvcc" BUILD="$tmp/build" tools/gpu-check.sh --dry-run "$tmp/out2" >"$tmp/log2" 2>&1
rc=$?
cp "$tmp/out2/report.md" "$tmp/report.md" 2>/dev/null
[ $rc = 1 ] || fail "exit $rc with a failing nvcc, want 1"
for r in "build: ddp_cuda.o for sm_80" "build: tools/gpu_check.cu" "build: ddprun and examples/gpu/train_gpu.cu" \
  "build: the torch interop programs"; do
  grep -F "| $r" "$tmp/report.md" | grep -q '\*\*FAIL\*\* (exit' || fail "'$r' is not a FAIL row"
done
check_no_device_rows "$tmp/report.md"
grep -q '^## Failures' "$tmp/report.md" || fail "the report has no Failures section"
grep -q 'fake nvcc: refusing' "$tmp/report.md" || fail "the report does not quote the failing logs"
echo "failing builds: 4 FAIL rows, 12 'no device' rows, the logs quoted, exit 1"

echo "== (3) a step that hangs: its timeout, then the budget"
printf '#!/bin/sh\nsleep 300\n' >"$tmp/nvcc" && chmod +x "$tmp/nvcc"
t0=$(date +%s)
GPU_CHECK_BUDGET=12 CC=false NVCC="$tmp/nvcc" BUILD="$tmp/build" tools/gpu-check.sh --dry-run "$tmp/out3" >"$tmp/log3" 2>&1
rc=$?
t=$(($(date +%s) - t0))
cp "$tmp/out3/report.md" "$tmp/report.md" 2>/dev/null
[ $rc = 1 ] || fail "exit $rc with a hanging nvcc, want 1"
[ $t -lt 60 ] || fail "took $t s with a 12 s budget"
grep -F "| build: toolkit" "$tmp/report.md" | grep -q 'timed out after' || fail "the hanging step is not 'timed out'"
grep -F "| build: ddp_cuda.o" "$tmp/report.md" | grep -q '| not run |' || fail "the steps after the budget are not 'not run'"
check_no_device_rows "$tmp/report.md"
echo "hanging nvcc: timed out, later steps 'not run', whole run $t s (budget 12 s)"

echo "== (4) --dry-run with the real toolkit"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$NVCC" ]; then
  echo "SKIP-PART real build: nvcc not found"
  echo "ok (the real build did not run)"
  exit 0
fi
# dry_run N STATUS [FLAG...]: a dry run with the real nvcc into $BUILD/gpu-check (report $tmp/outN), exit 0,
# each of the 3 builds with STATUS ("ok": built; "prebuilt": taken from the build there)
dry_run() {
  local n=$1 status=$2 rc r
  shift 2
  NVCC="$NVCC" BUILD="$BUILD/gpu-check" GPU_CHECK_NO_DEVICE=1 tools/gpu-check.sh "$@" "$tmp/out$n" >"$tmp/log$n" 2>&1
  rc=$?
  cp "$tmp/out$n/report.md" "$tmp/report.md" 2>/dev/null
  [ $rc = 0 ] || { cat "$tmp/log$n"; fail "exit $rc in a dry run with nvcc $*"; }
  for r in "build: ddp_cuda.o for sm_80 (-Werror)" "build: tools/gpu_check.cu (-Werror)" "build: ddprun and examples/gpu/train_gpu.cu"; do
    grep -F "| $r | $status |" "$tmp/report.md" >/dev/null || fail "'$r' is not '$status' ($*)"
  done
}
dry_run 4 ok
for f in ddp_cuda.o gpu_check ddprun train_gpu; do [ -x "$BUILD/gpu-check/$f" ] || [ -f "$BUILD/gpu-check/$f" ] || fail "no $f built"; done
check_no_device_rows "$tmp/report.md"
grep -q '^- device: \*\*no device\*\*' "$tmp/report.md" || fail "the report's header does not say 'no device'"
echo "dry run: 3 builds ok for sm_80, every device step 'no device', exit 0"

echo "== (5) --prebuilt over that build: nothing rebuilt"
before=$(stat -c %Y "$BUILD/gpu-check/ddp_cuda.o" "$BUILD/gpu-check/gpu_check")
dry_run 5 prebuilt --prebuilt
[ "$(stat -c %Y "$BUILD/gpu-check/ddp_cuda.o" "$BUILD/gpu-check/gpu_check")" = "$before" ] || fail "--prebuilt rebuilt"
echo "prebuilt: 3 'prebuilt' rows, nothing rebuilt"

echo "== (6) the torch rows, on a stand-in GPU machine (a fake nvidia-smi; only the torch steps selected)"
mkdir -p "$tmp/smi"
printf '#!/bin/sh\ncase "$*" in -L) echo "GPU 0: stand-in (UUID: none)" ;; *compute_cap*) echo 8.0 ;; *) echo "stand-in, 0 MiB, 0" ;; esac\n' \
  >"$tmp/smi/nvidia-smi" && chmod +x "$tmp/smi/nvidia-smi"
torch_rows() { # N PYTHON: the torch steps of a --prebuilt run over (4)'s build, report $tmp/outN
  PATH="$tmp/smi:$PATH" PYTHON=$2 NVCC="$NVCC" BUILD="$BUILD/gpu-check" GPU_CHECK_BUDGET=300 \
    GPU_CHECK_ONLY="torchrun1 torchrun2 sampler" tools/gpu-check.sh --prebuilt "$tmp/out$1" >"$tmp/log$1" 2>&1
}
torch_rows 6 "$tmp/no-such-python"
rc=$?
cp "$tmp/out6/report.md" "$tmp/report.md" 2>/dev/null
[ $rc = 0 ] || { cat "$tmp/log6"; fail "exit $rc without torch"; }
[ "$(grep -c '^| torch: .* | not run | 0 | .* has no torch |$' "$tmp/report.md")" = 3 ] ||
  fail "without torch, the 3 selected torch rows are not 'not run'"
grep -F '| torch: tests/interop/store_interop.py' "$tmp/report.md" | grep -q '| not selected |' ||
  fail "without torch, the torch row GPU_CHECK_ONLY left out is not 'not selected'"
grep -F '| test: SyncBN on device vs the CPU code' "$tmp/report.md" | grep -q '| not selected |' ||
  fail "GPU_CHECK_ONLY did not leave the device steps out"
PATH="$tmp/smi:$PATH" NVCC="$NVCC" BUILD="$BUILD/gpu-check" GPU_CHECK_ONLY="torchrun1 sampelr" tools/gpu-check.sh --prebuilt \
  "$tmp/out8" >"$tmp/log8" 2>&1
rc=$?
cp "$tmp/out8/report.md" "$tmp/report.md" 2>/dev/null
if ! { [ $rc = 1 ] && grep -q "no step has the id 'sampelr'" "$tmp/report.md"; }; then fail "GPU_CHECK_ONLY with a typo: exit $rc, want 1 naming it"; fi
avail_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
if [ "$avail_kib" -lt $((4 * 1024 * 1024)) ]; then
  echo "SKIP-PART torch rows with torch: the sampler's N = 214748364 needs 4 GiB free, $((avail_kib / 1024)) MiB available"
elif PY=$(command -v /usr/bin/python3 python3 | head -n 1) && "$PY" -c 'import torch' 2>/dev/null; then
  torch_rows 7 "$PY"
  rc=$?
  cp "$tmp/out7/report.md" "$tmp/report.md" 2>/dev/null
  [ $rc = 0 ] || { cat "$tmp/out7/report.md"; fail "exit $rc in the torch rows with $PY"; }
  for r in "torch: plain torchrun, 1 node of 3" "torch: plain torchrun, 2 nodes of 2" "torch: DistributedSampler"; do
    grep -F "| $r" "$tmp/report.md" | grep -q '| ok |' || fail "'$r' is not ok"
  done
  echo "torch rows: 'not run' without torch; torchrun (1 and 2 nodes) and the sampler ok with $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "SKIP-PART torch rows with torch: no python3 with torch (the 'not run' rows were checked)"
fi
echo "ok"
