#!/usr/bin/env bash
# Valgrind memcheck on 2-rank runs launched by ddprun: the tour of the collectives over shared memory and
# over TCP (async work, progress thread, store server thread), and a tiny run of the training demo
# (sampler, SyncBN, reducer, checkpoints). Any memcheck error or definite/indirect leak fails the run
# (--error-exitcode), on any rank. Skips (77) without valgrind (apt-get install -y valgrind).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
command -v valgrind >/dev/null || { echo "skipped: valgrind not found (apt-get install -y valgrind)"; exit 77; }
make -s BUILD="$BUILD" "$BUILD/ddprun" "$BUILD/hello_collectives" "$BUILD/train_demo" || exit 1
vg="valgrind -q --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite,indirect"
T=$(mktemp -d /tmp/test_valgrind.XXXXXX)
trap 'rm -rf "$T"' EXIT
run() { # run NAME TRANSPORT PROGRAM ARGS...
  local name=$1 tr=$2; shift 2
  DDP_TRANSPORT=$tr timeout 600 "$BUILD/ddprun" --nproc-per-node 2 --cpu-bind none $vg "$@" >"$T/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { cat "$T/$name.log"; echo "FAIL: $name under valgrind exited $rc"; exit 1; }
  echo "ok: $name: 2 ranks, no memcheck errors or leaks"
}
run collectives_shm auto "$BUILD/hello_collectives"
run collectives_tcp tcp "$BUILD/hello_collectives"
run train_demo auto "$BUILD/train_demo" --epochs 1 --samples 512 --hidden 32 --dir "$T/ckpt"
echo "test_valgrind: all passed"
