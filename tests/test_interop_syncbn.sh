#!/usr/bin/env bash
# SyncBatchNorm against PyTorch: tests/interop/syncbn_dump.c runs ddp.h's SyncBatchNorm on 1 (no group),
# 2, 3, 4 and 8 ranks with uneven per-rank batches (empty ones included, rotating over the steps) and
# on two subgroups; tests/interop/syncbn_check.py runs torch.nn.BatchNorm1d/2d/3d in training mode on
# the concatenated batch and compares y, grad_input, running stats, num_batches_tracked and the sum
# over ranks of grad_weight/grad_bias (1e-5 relative). Skips (77) when /usr/bin/python3 lacks torch.
set -eu
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
tl_need_python "torch, numpy" "python3-torch python3-numpy"
tl_cc "$BUILD/syncbn_dump" tests/interop/syncbn_dump.c
tl_tmpdir test_interop_syncbn
dirs=()
for ranks in 1 2 3 4 8; do
  mkdir -p "$T/r$ranks"
  "$BUILD/syncbn_dump" "$T/r$ranks" "$ranks"
  dirs+=("$T/r$ranks")
done
"$PY" tests/interop/syncbn_check.py "${dirs[@]}"
