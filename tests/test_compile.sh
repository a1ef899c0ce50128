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
# Each compiler runs in its own directory at the same time as the other (the machine's cores), its output
# kept apart and printed in order afterwards.
check_compiler() {  # check_compiler CC DIR
  local cc=$1 dir=$2 cxx opt mode
  cxx=$([ $cc = gcc ] && echo g++ || echo clang++)
  for opt in -O0 -O2 -O3; do
    $cc -std=c99 $opt $flags -c tests/compile/user.c -o "$dir/user.o"
    $cc -std=c99 $opt $flags -c tests/compile/impl.c -o "$dir/impl.o"
    $cc -pthread "$dir/user.o" "$dir/impl.o" -lm -o "$dir/prog_c"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/prog_c"
    $cxx -std=c++17 $opt $flags -x c++ -c tests/compile/user.c -o "$dir/user_cpp.o"
    $cxx -std=c++17 $opt $flags -x c++ -c tests/compile/impl.c -o "$dir/impl_cpp.o"
    $cxx -pthread "$dir/user_cpp.o" "$dir/impl_cpp.o" -lm -o "$dir/prog_cpp"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/prog_cpp"
    # mixed: the C++ user file with the C implementation (extern "C" linkage)
    $cxx -pthread "$dir/user_cpp.o" "$dir/impl.o" -lm -o "$dir/prog_mixed"
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/prog_mixed"
  done
  # the implementation after system headers (late_include.c): strict C99 (headers read without
  # _GNU_SOURCE or _DEFAULT_SOURCE; also with a 64-bit off_t), gnu99 and C++17, each run as a smoke test
  for mode in "-std=c99" "-std=c99 -D_FILE_OFFSET_BITS=64" "-std=gnu99"; do
    $cc $mode -O2 $flags tests/compile/late_include.c -o "$dir/late" -lm
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/late"
  done
  $cxx -std=c++17 -O2 $flags -x c++ tests/compile/late_include.c -o "$dir/late_cpp" -lm
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/late_cpp"
  # strict C99 without -pthread: the headers before ddp.h have no POSIX at all; one clear error, no cascade
  if $cc -std=c99 -Wall -Wextra -Werror -pedantic -I. -fsyntax-only tests/compile/late_include.c 2>"$dir/err.txt"; then
    echo "FAIL: late_include.c compiled as plain ISO C"; exit 1
  fi
  grep -q "headers before ddp.h were read without POSIX" "$dir/err.txt" || { cat "$dir/err.txt"; exit 1; }
  [ "$(grep -c "error:" "$dir/err.txt")" -le 2 ] || { cat "$dir/err.txt"; exit 1; }
  $cc -std=c99 $flags tests/compile/hooks.c -o "$dir/hooks" -lm
  env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "$dir/hooks"
  $cxx -std=c++17 $flags -x c++ tests/compile/hooks.c -o "$dir/hooks_cpp" -lm
  if $cc -std=c99 $flags tests/compile/partial_hooks.c -o "$dir/partial" 2>"$dir/err.txt"; then
    echo "FAIL: defining only DDP_MALLOC compiled"; exit 1
  fi
  grep -q "define all of DDP_MALLOC, DDP_REALLOC and DDP_FREE" "$dir/err.txt" || { cat "$dir/err.txt"; exit 1; }
  echo "$cc: C99 and C++17, -O0, -O2 and -O3, two translation units, ddp.h after system headers, hooks (allocator, DDP_ASSERT), DDP_STATIC: ok"
}
pids=() ccs=()
for cc in gcc clang; do
  command -v $cc >/dev/null || { echo "SKIP-PART $cc part: $cc is not installed"; continue; }
  mkdir -p "$out/$cc"
  (set -e; check_compiler $cc "$out/$cc") >"$out/$cc.log" 2>&1 &
  pids+=($!) ccs+=("$cc")
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then status=1; echo "FAIL: ${ccs[$i]}:"; fi
  cat "$out/${ccs[$i]}.log"
done
[ $status = 0 ] || exit 1
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$nvcc" ]; then
  printf '#include "ddp.h"\nint f(ddp_group *g) { return ddp_rank(g); }\n' > "$out/api.cu"
  "$nvcc" -std=c++17 -I. -Xcompiler -Wall,-Wextra,-Werror -c "$out/api.cu" -o "$out/api_cu.o"
  echo "nvcc: the header compiles as CUDA C++: ok"
else
  echo "SKIP-PART nvcc part: nvcc is not installed (the header's CUDA C++ compile was not checked)"
fi
