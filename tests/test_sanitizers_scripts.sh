#!/usr/bin/env bash
# The script tests test_ddprun and test_examples with their programs (ddprun, the examples) built with
# AddressSanitizer + UndefinedBehaviorSanitizer: tests/test_sanitizers.sh's last part, run on its own so
# that the suite runs it beside the ThreadSanitizer run (tests/run_tests.sh's TOGETHER), not after ASan's.
set -eu
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 TEST_QUICK=1
SANITIZER_SCRIPTS_ONLY=1 exec bash tests/test_sanitizers.sh
