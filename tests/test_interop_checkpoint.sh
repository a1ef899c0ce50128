#!/usr/bin/env bash
# Checkpoint interop with Python: a file written by ddp.h is read by a safetensors reader written from
# the format description (tests/interop/safetensors_io.py, json + numpy) with equal values, checksums
# and metadata; files written by that Python code (with and without checksums) load in ddp.h with
# plain ddp_checkpoint_load (require_checksums refuses the one without) and ddp_checkpoint_list gives
# their tensors in the header's order; a corrupted Python file is refused. Skips (77) when
# /usr/bin/python3 has no numpy.
set -eu
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
tl_need_python numpy python3-numpy
tl_tmpdir ckpt_interop
work=$T
helper="$BUILD/safetensors_helper"
tl_cc "$helper" tests/interop/safetensors_helper.c -O1
check="$PY tests/interop/safetensors_check.py"

"$helper" write "$work/from_c.safetensors"
$check read "$work/from_c.safetensors"

$check write "$work/from_py.safetensors"
"$helper" read "$work/from_py.safetensors"
"$helper" list-ordered "$work/from_py.safetensors"

$check write "$work/from_py_nocrc.safetensors" --no-checksums
"$helper" read-nocrc "$work/from_py_nocrc.safetensors"

$check corrupt "$work/from_py.safetensors" "$work/corrupt.safetensors"
"$helper" expect-corrupt "$work/corrupt.safetensors"
echo "checkpoint interop: ok"
