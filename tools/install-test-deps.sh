#!/usr/bin/env bash
# Installs what `make test` needs on Debian/Ubuntu: compilers, Open MPI (the mpirun tests and the peer
# benchmarks), PyTorch 1.13 + NumPy (the interop tests compare ddp.h with torch itself), clang's
# sanitizer/fuzzer runtimes, iproute2 (network-namespace tests), cmake (the CMake target's test), valgrind and
# a headless Chromium (tools/timeline.html draws a timeline in test_timeline.sh).
# The CUDA toolkit and NCCL are not Debian packages: the GPU build tests use them where they are
# installed (/usr/local/cuda) and skip otherwise. Uses sudo when not root.
set -eu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
  build-essential clang libclang-rt-14-dev make python3 \
  openmpi-bin libopenmpi-dev python3-torch python3-numpy iproute2 procps cmake valgrind chromium-headless-shell
# Current torch (2.x) for tests/test_interop_torch_current.sh: a Debian sid chroot with python3-torch,
# cached outside the clone (/var/cache/ddp-torch-current, ~2 GB; 1-8 minutes the first time depending on
# the mirror, seconds when it is already there). Not fatal: without it that test skips (exit 77).
if [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; then
  "$(dirname "$0")/torch-current.sh" create ||
    echo "warning: could not make the current-torch chroot; tests/test_interop_torch_current.sh will skip"
fi
