#!/usr/bin/env bash
# CMake: the INTERFACE target ddp::ddp works for a consumer project, built in a temporary folder as
# C99 with -Wall -Wextra -Werror -pedantic (unoptimised: what is tested is the build, and it is quick),
# reached four ways: add_subdirectory, FetchContent with SOURCE_DIR, FetchContent with URL file:// (a
# tarball of the repository's files), and find_package after cmake --install. Each consumer runs alone
# (rank 0 of 1) and, where ddprun was built, on 2 ranks under it. Also checked: the repository's own
# CMake build has the examples as targets (one is built and run), a consumer does not build them,
# DDP_BUILD_TOOLS=OFF builds no ddprun, and (when nvcc is installed) DDP_WITH_CUDA=ON builds
# ddp_cuda.cu as ddp::cuda, which a C program links and calls. Skips (77) when cmake is absent.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
command -v cmake >/dev/null || { echo "cmake is not installed"; exit 77; }
T=$(mktemp -d /tmp/test_cmake.XXXXXX)
trap 'rm -rf "$T"' EXIT
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; }
cmake --version | head -n 1

mkdir -p "$T/src"
cat >"$T/src/main.c" <<'C'
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <math.h>
#include <stdio.h>

int main(void) {
    ddp_group *g;
    float x;
    int n;
    if (ddp_init(NULL, &g) != DDP_SUCCESS) {
        fprintf(stderr, "ddp_init: %s\n", ddp_last_error(NULL));
        return 1;
    }
    x = (float)(ddp_rank(g) + 1);
    n = ddp_world_size(g);
    if (ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM) != DDP_SUCCESS) return 1;
    printf("consumer: rank %d of %d, sum %g, erf %.3f, ddp.h %d.%d.%d\n", ddp_rank(g), n, (double)x, erf((double)x),
           DDP_VERSION_MAJOR, DDP_VERSION_MINOR, DDP_VERSION_PATCH);
    ddp_destroy(g);
    return x == (float)(n * (n + 1) / 2) ? 0 : 1;
}
C
cat >"$T/src/cuda_main.c" <<'C'
#include "ddp.h" /* ddp::cuda defines DDP_CUDA: the entry points of ddp_cuda.cu are declared */
#include <stdio.h>
#include <string.h>

int main(void) {
    char err[256] = "";
    ddp_cuda_bn_args a;
    float work[96];
    double record[3];
    memset(&a, 0, sizeof a);
    a.dtype = DDP_F32, a.err = err, a.err_size = sizeof err;
    if (ddp_cuda_bn_stats(&a, NULL, work, record) != DDP_ERR_INVALID_ARGUMENT) return 1;
    printf("cuda consumer: %s\n", err);
    return 0;
}
C

# project DIR HOW: a consumer project in DIR; HOW is the CMake text that makes ddp::ddp available
project() {
  mkdir -p "$1"
  cat >"$1/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.14)
if(POLICY CMP0135)
  cmake_policy(SET CMP0135 NEW)
endif()
project(consumer C)
set(CMAKE_C_STANDARD 99)
set(CMAKE_C_STANDARD_REQUIRED ON)
set(CMAKE_C_EXTENSIONS OFF)
add_compile_options("$<$<COMPILE_LANGUAGE:C>:-Wall;-Wextra;-Werror;-pedantic>")
$2
add_executable(consumer "$T/src/main.c")
target_link_libraries(consumer PRIVATE ddp::ddp)
CM
}

# build DIR [ARGS...]: configure and build the project in DIR into DIR/b
build() {
  local dir=$1; shift
  cmake -S "$dir" -B "$dir/b" "${GEN[@]}" -DCMAKE_BUILD_TYPE= "$@" >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; fail "configuring $dir"; }
  cmake --build "$dir/b" -j 2 >"$dir/build.log" 2>&1 || { cat "$dir/build.log"; fail "building $dir"; }
}

# check_run DIR [DDPRUN]: the consumer runs alone and, given ddprun, on 2 ranks
check_run() {
  local out
  out=$(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$1/b/consumer" 2>&1) || { echo "$out"; fail "$1: consumer alone"; }
  echo "$out"
  echo "$out" | grep -q "^consumer: rank 0 of 1, sum 1, erf 0.843, ddp.h " || fail "$1: unexpected output"
  [ -n "${2:-}" ] || return 0
  [ -x "$2" ] || fail "$1: no ddprun at $2"
  out=$("$2" --nproc-per-node 2 "$1/b/consumer" 2>&1) || { echo "$out"; fail "$1: consumer under ddprun"; }
  echo "$out"
  echo "$out" | grep -q "^consumer: rank 1 of 2, sum 3, erf 1.000, ddp.h " || fail "$1: unexpected output on 2 ranks"
}

project "$T/subdir" "add_subdirectory(\"$REPO\" ddp)"
build "$T/subdir"
check_run "$T/subdir" "$T/subdir/b/ddp/ddprun"
[ ! -e "$T/subdir/b/ddp/train_demo" ] || fail "add_subdirectory built the examples"
ok "add_subdirectory: ddp::ddp and ddprun; no examples"

project "$T/fetch_dir" "include(FetchContent)
set(DDP_BUILD_TOOLS OFF CACHE BOOL \"\" FORCE)
FetchContent_Declare(ddp SOURCE_DIR \"$REPO\")
FetchContent_MakeAvailable(ddp)"
build "$T/fetch_dir"
check_run "$T/fetch_dir" "$T/subdir/b/ddp/ddprun"
ok "FetchContent SOURCE_DIR"

tar -czf "$T/ddp.tar.gz" -C "$REPO" CMakeLists.txt cmake ddp.h ddp_cuda.cu tools/ddprun.c LICENSE
project "$T/fetch_url" "include(FetchContent)
set(DDP_BUILD_TOOLS OFF CACHE BOOL \"\" FORCE)
FetchContent_Declare(ddp URL \"file://$T/ddp.tar.gz\")
FetchContent_MakeAvailable(ddp)"
build "$T/fetch_url"
check_run "$T/fetch_url"
[ ! -e "$T/fetch_url/b/_deps/ddp-build/ddprun" ] || fail "DDP_BUILD_TOOLS=OFF still built ddprun"
ok "FetchContent URL file:// (DDP_BUILD_TOOLS=OFF: no ddprun)"

# the repository as the top-level project: its examples are targets; then cmake --install
cmake -S "$REPO" -B "$T/ib" "${GEN[@]}" -DCMAKE_BUILD_TYPE= -DCMAKE_INSTALL_PREFIX="$T/prefix" >"$T/ib.log" 2>&1 &&
  cmake --build "$T/ib" -j 2 --target ddprun hello_allreduce >>"$T/ib.log" 2>&1 ||
  { cat "$T/ib.log"; fail "building the repository with CMake"; }
out=$("$T/ib/ddprun" --nproc-per-node 2 "$T/ib/hello_allreduce" 2>&1) || { echo "$out"; fail "examples built by CMake"; }
echo "$out" | grep -q "^rank 1 of 2: 1 + ... + 2 = 3 (right)$" || { echo "$out"; fail "hello_allreduce built by CMake"; }
cmake --install "$T/ib" >>"$T/ib.log" 2>&1 || { cat "$T/ib.log"; fail "cmake --install"; }
[ -f "$T/prefix/include/ddp.h" ] || fail "cmake --install: no include/ddp.h"
project "$T/find" "find_package(ddp 0.1 REQUIRED)"
build "$T/find" -DCMAKE_PREFIX_PATH="$T/prefix"
check_run "$T/find" "$T/prefix/bin/ddprun"
ok "find_package after cmake --install"

NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$NVCC" ]; then
  project "$T/cuda" "set(DDP_WITH_CUDA ON CACHE BOOL \"\" FORCE)
set(DDP_BUILD_TOOLS OFF CACHE BOOL \"\" FORCE)
add_subdirectory(\"$REPO\" ddp)
if(NOT TARGET ddp::cuda)
  message(FATAL_ERROR \"no ddp::cuda\")
endif()
add_executable(cuda_consumer \"$T/src/cuda_main.c\")
target_link_libraries(cuda_consumer PRIVATE ddp::cuda)"
  build "$T/cuda" -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=80
  out=$("$T/cuda/b/cuda_consumer" 2>&1) || { echo "$out"; fail "the C program linked with ddp::cuda"; }
  echo "$out"
  echo "$out" | grep -q "^cuda consumer: .*channels is 0" || fail "ddp::cuda: unexpected output"
  ok "DDP_WITH_CUDA: ddp::cuda built with $("$NVCC" --version | tail -n 1 | sed 's/^Build //'), linked into a C program"
else
  echo "SKIP-PART DDP_WITH_CUDA part: nvcc not found"
fi
