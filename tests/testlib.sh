# Shell helpers of the test scripts (the twin of tests/testlib.h), sourced first thing:
#   . "$(dirname "$0")/testlib.sh"
# It leaves the shell in the repository root with
#   BUILD     the build directory (default build; tests/run_tests.sh exports it)
#   PY        /usr/bin/python3, the Debian python that has torch 1.13 (the interop tests' reference)
#   SANFLAGS  the Makefile's sanitizer flags for SAN=address or SAN=thread, unless the caller gave its own
# and defines the functions below. Not a test itself (run_tests.sh runs tests/test_*.sh only).
# shellcheck shell=bash
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
BUILD=${BUILD:-build}
PY=/usr/bin/python3
if [ -z "${SANFLAGS:-}" ]; then
  case "${SAN:-}" in
    address) SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" ;;
    thread) SANFLAGS="-fsanitize=thread" ;;
  esac
fi
SANFLAGS=${SANFLAGS:-}

fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; }

# tl_tmpdir NAME: a fresh directory ${TMPDIR:-/tmp}/NAME.XXXXXX in $T, removed when the script exits.
tl_tmpdir() {
  T=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX") || fail "mktemp"
  trap 'rm -rf "$T"' EXIT
}

# tl_need_python MODULES PACKAGES: skip the test (exit 77) unless $PY can `import MODULES` (e.g. "torch, numpy");
# PACKAGES: the Debian packages that bring them, for the message.
tl_need_python() {
  "$PY" -c "import $1" >/dev/null 2>&1 && return 0
  echo "skipped: $PY cannot import $1 (apt-get install $2)"
  exit 77
}

# tl_cc OUT SOURCE [FLAGS...]: build a test's C helper program against ddp.h (-I. -Itests) with the tests'
# warnings as errors, -O2 -g (a FLAGS -O.. after them wins) and $SANFLAGS (`SANFLAGS= tl_cc ...`: none).
tl_cc() {
  local out=$1 src=$2
  shift 2
  [ -f ddp.h ] || { echo "no ddp.h (make header writes it)"; return 1; }
  mkdir -p "$(dirname "$out")"
  # shellcheck disable=SC2086
  ${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests "$@" -o "$out" "$src" -lm $SANFLAGS
}
