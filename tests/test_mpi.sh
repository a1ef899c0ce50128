#!/usr/bin/env bash
# The mpi backend: tests/mpi/test_mpi_backend.c built with mpicc -DDDP_MPI (warning-free, C99 and
# C++17) and run under Open MPI's mpirun on 1, 2, 3 and 4 ranks; every result is checked in the
# program against serial math (the reducer with uneven inputs and ZeRO stage 1 included). Also: without -DDDP_MPI, asking for backend "mpi" is a clear error.
# Skips (77) when mpicc/mpirun are absent (apt-get install -y openmpi-bin libopenmpi-dev).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "skipped: mpicc/mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev)"; exit 77
fi
mkdir -p "$BUILD"
[ -f ddp.h ] || { echo "no ddp.h (make header writes it)"; exit 1; }
flags="-Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests"
OMPI_CC=${CC:-cc} mpicc -std=c99 $flags ${SANFLAGS:-} -o "$BUILD/test_mpi_backend" tests/mpi/test_mpi_backend.c -lm ||
  { echo "FAIL: the mpi backend does not build as C99"; exit 1; }
OMPI_CC=${CXX:-c++} mpicc -x c++ -std=c++17 $flags -c -o "$BUILD/test_mpi_backend_cxx.o" tests/mpi/test_mpi_backend.c ||
  { echo "FAIL: the mpi backend does not build as C++17"; exit 1; }
for n in 1 2 3 4; do
  echo "== mpirun -np $n"
  timeout 120 mpirun --allow-run-as-root --oversubscribe -np $n "$BUILD/test_mpi_backend" ||
    { echo "FAIL: test_mpi_backend on $n ranks"; exit 1; }
done

# A build without DDP_MPI refuses backend "mpi" (desc and DDP_BACKEND alike) with a message saying how to get it.
cat >"$BUILD/mpi_absent.c" <<'C'
#include "testlib.h"
int main(void) {
    ddp_init_desc d;
    ddp_group *g = NULL;
    memset(&d, 0, sizeof d);
    d.backend = "mpi";
    CHECK(ddp_init(&d, &g) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(NULL), "-DDDP_MPI"), "desc: %s", ddp_last_error(NULL));
    setenv("DDP_BACKEND", "mpi", 1);
    CHECK(ddp_init(NULL, &g) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(NULL), "mpicc"), "env: %s", ddp_last_error(NULL));
    setenv("DDP_BACKEND", "gloo", 1);
    CHECK(ddp_init(NULL, &g) == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(NULL), "DDP_BACKEND"), "env: %s", ddp_last_error(NULL));
    printf("ok: without DDP_MPI: %s\n", "backend mpi refused with a clear message");
    return 0;
}
C
${CC:-cc} -std=c99 $flags ${SANFLAGS:-} -o "$BUILD/mpi_absent" "$BUILD/mpi_absent.c" -lm && "$BUILD/mpi_absent" ||
  { echo "FAIL: backend mpi without DDP_MPI"; exit 1; }
echo "test_mpi: all passed"
