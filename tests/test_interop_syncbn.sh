#!/usr/bin/env bash
# SyncBatchNorm against PyTorch: tests/interop/syncbn_dump.c runs ddp.h's SyncBatchNorm on 1 (no group),
# 2, 3, 4 and 8 ranks with uneven per-rank batches (empty ones included, rotating over the steps) and
# on two subgroups; tests/interop/syncbn_check.py runs torch.nn.BatchNorm1d/2d/3d in training mode on
# the concatenated batch and compares y, grad_input, running stats, num_batches_tracked and the sum
# over ranks of grad_weight/grad_bias (1e-5 relative). Skips (77) when /usr/bin/python3 lacks torch.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PY=/usr/bin/python3
if ! "$PY" -c "import torch, numpy" 2>/dev/null; then
  echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
  exit 77
fi
case "${SAN:-}" in
  address) SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" ;;
  thread) SANFLAGS="-fsanitize=thread" ;;
  *) SANFLAGS="" ;;
esac
mkdir -p "$BUILD"
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests -o "$BUILD/syncbn_dump" \
  tests/interop/syncbn_dump.c -lm $SANFLAGS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dirs=()
for ranks in 1 2 3 4 8; do
  mkdir -p "$work/r$ranks"
  "$BUILD/syncbn_dump" "$work/r$ranks" "$ranks"
  dirs+=("$work/r$ranks")
done
"$PY" tests/interop/syncbn_check.py "${dirs[@]}"
