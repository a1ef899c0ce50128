#!/usr/bin/env bash
# Checkpoint interop with Python: a file written by ddp.h is read by a safetensors reader written from
# the format description (tests/interop/safetensors_io.py, json + numpy) with equal values, checksums
# and metadata; files written by that Python code (with and without checksums) load in ddp.h; a
# corrupted Python file is refused. Skips (77) when /usr/bin/python3 has no numpy.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PY=/usr/bin/python3
if ! "$PY" -c "import numpy" 2>/dev/null; then
  echo "skipped: $PY has no numpy (apt-get install -y python3-numpy)"; exit 77
fi
mkdir -p "$BUILD"
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_interop_XXXXXX")
trap 'rm -rf "$work"' EXIT
helper="$BUILD/safetensors_helper"
if [ "${SAN:-}" = address ] && [ -z "${SANFLAGS:-}" ]; then
  SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
fi
[ -f ddp.h ] || { echo "no ddp.h (make header writes it)"; exit 1; }
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O1 -g -pthread -I. -Itests tests/interop/safetensors_helper.c \
  -o "$helper" -lm ${SANFLAGS:-}
check="$PY tests/interop/safetensors_check.py"

"$helper" write "$work/from_c.safetensors"
$check read "$work/from_c.safetensors"

$check write "$work/from_py.safetensors"
"$helper" read "$work/from_py.safetensors"

$check write "$work/from_py_nocrc.safetensors" --no-checksums
"$helper" read-nocrc "$work/from_py_nocrc.safetensors"

$check corrupt "$work/from_py.safetensors" "$work/corrupt.safetensors"
"$helper" expect-corrupt "$work/corrupt.safetensors"
echo "checkpoint interop: ok"
