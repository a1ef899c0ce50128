#!/usr/bin/env bash
# The same unmodified binary (examples/hello_collectives.c, every result verified in the program)
# runs under Open MPI's mpirun and under torchrun --standalone --no_python; ddp_init reads each
# launcher's environment. Skips (77) only when neither launcher is installed.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
prog=$BUILD/hello_collectives
[ -x "$prog" ] || { echo "missing $prog: run make first"; exit 1; }
ran=0
if command -v mpirun >/dev/null; then
  out=$(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 3 "$prog" 2>&1)
  echo "$out"
  echo "$out" | grep -q "3 ranks on the cpu backend" || { echo "FAIL: mpirun -np 3 did not form 3 ranks"; exit 1; }
  echo "$out" | grep -q "all collectives verified" || { echo "FAIL: mpirun run not verified"; exit 1; }
  ran=$((ran + 1))
fi
torchrun=$(command -v torchrun || true)
if [ -n "$torchrun" ] && /usr/bin/python3 -c "import torch" 2>/dev/null; then
  # Debian's torch 1.13 torchrun: underscore flags, and --redirects/--tee avoid its Python 3.11 enum bug.
  out=$(cd /tmp && timeout 180 "$torchrun" --standalone --nproc_per_node 2 --redirects 1 --tee 1 --no_python "$OLDPWD/$prog" 2>&1)
  echo "$out"
  echo "$out" | grep -q "2 ranks on the cpu backend" || { echo "FAIL: torchrun did not form 2 ranks"; exit 1; }
  echo "$out" | grep -q "all collectives verified" || { echo "FAIL: torchrun run not verified"; exit 1; }
  ran=$((ran + 1))
fi
[ $ran -gt 0 ] || { echo "neither mpirun (openmpi-bin) nor torchrun (python3-torch) is installed"; exit 77; }
echo "ok: $ran launcher(s)"
