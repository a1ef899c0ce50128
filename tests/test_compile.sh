#!/usr/bin/env bash
# The header compiles warning-free as C99 and C++17 (gcc and clang, -Wall -Wextra -Werror -pedantic, at
# -O0, -O2 and -O3), the implementation in one translation unit links with a second that only includes
# the API, the implementation may come after system headers (strict C99, gnu99, C++17; each program is
# run), DDP_STATIC, the allocator hooks and DDP_ASSERT work, giving only some hooks is a clear #error, and the header
# compiles under nvcc as C++ when nvcc is installed.
set -eu
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags="-Wall -Wextra -Werror -pedantic -pthread -I."
for cc in gcc clang; do
  command -v $cc >/dev/null || { echo "SKIP-PART $cc part: $cc is not installed"; continue; }
  cxx=$([ $cc = gcc ] && echo g++ || echo clang++)
  for opt in -O0 -O2 -O3; do
    $cc -std=c99 $opt $flags -c tests/compile/user.c -o "$out/user.o"
    $cc -std=c99 $opt $flags -c tests/compile/impl.c -o "$out/impl.o"
    $cc -pthread "$out/user.o" "$out/impl.o" -lm -o "$out/prog_c"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/prog_c"
    $cxx -std=c++17 $opt $flags -x c++ -c tests/compile/user.c -o "$out/user_cpp.o"
    $cxx -std=c++17 $opt $flags -x c++ -c tests/compile/impl.c -o "$out/impl_cpp.o"
    $cxx -pthread "$out/user_cpp.o" "$out/impl_cpp.o" -lm -o "$out/prog_cpp"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/prog_cpp"
    # mixed: the C++ user file with the C implementation (extern "C" linkage)
    $cxx -pthread "$out/user_cpp.o" "$out/impl.o" -lm -o "$out/prog_mixed"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/prog_mixed"
  done
  # the implementation after system headers (late_include.c): strict C99 (headers read without
  # _GNU_SOURCE or _DEFAULT_SOURCE; also with a 64-bit off_t), gnu99 and C++17, each run as a smoke test
  for mode in "-std=c99" "-std=c99 -D_FILE_OFFSET_BITS=64" "-std=gnu99"; do
    $cc $mode -O2 $flags tests/compile/late_include.c -o "$out/late" -lm
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/late"
  done
  $cxx -std=c++17 -O2 $flags -x c++ tests/compile/late_include.c -o "$out/late_cpp" -lm
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/late_cpp"
  # strict C99 without -pthread: the headers before ddp.h have no POSIX at all; one clear error, no cascade
  if $cc -std=c99 -Wall -Wextra -Werror -pedantic -I. -fsyntax-only tests/compile/late_include.c 2>"$out/err.txt"; then
    echo "FAIL: late_include.c compiled as plain ISO C"; exit 1
  fi
  grep -q "headers before ddp.h were read without POSIX" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
  [ "$(grep -c "error:" "$out/err.txt")" -le 2 ] || { cat "$out/err.txt"; exit 1; }
  $cc -std=c99 $flags tests/compile/hooks.c -o "$out/hooks" -lm
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$out/hooks"
  $cxx -std=c++17 $flags -x c++ tests/compile/hooks.c -o "$out/hooks_cpp" -lm
  if $cc -std=c99 $flags tests/compile/partial_hooks.c -o "$out/partial" 2>"$out/err.txt"; then
    echo "FAIL: defining only DDP_MALLOC compiled"; exit 1
  fi
  grep -q "define all of DDP_MALLOC, DDP_REALLOC and DDP_FREE" "$out/err.txt" || { cat "$out/err.txt"; exit 1; }
  echo "$cc: C99 and C++17, -O0, -O2 and -O3, two translation units, ddp.h after system headers, hooks (allocator, DDP_ASSERT), DDP_STATIC: ok"
done
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$nvcc" ]; then
  printf '#include "ddp.h"\nint f(ddp_group *g) { return ddp_rank(g); }\n' > "$out/api.cu"
  "$nvcc" -std=c++17 -I. -Xcompiler -Wall,-Wextra,-Werror -c "$out/api.cu" -o "$out/api_cu.o"
  echo "nvcc: the header compiles as CUDA C++: ok"
else
  echo "SKIP-PART nvcc part: nvcc is not installed (the header's CUDA C++ compile was not checked)"
fi
