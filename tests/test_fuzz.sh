#!/usr/bin/env bash
# Fuzzes what a hostile or broken outsider can hand ddp.h, with libFuzzer + ASan + UBSan:
#   checkpoint  the safetensors reader (tests/fuzz/fuzz_checkpoint.c; seeds from the Python writer)
#   store       the store server's request handling (tests/fuzz/fuzz_store.c; seeds: each request type)
#   frames      a peer's frames on the mesh (tests/fuzz/fuzz_frames.c; seeds: data, abort, bye frames)
# Exit 0: no failure; 77: no libFuzzer here (says which package provides it).
# By default each run is reproducible: a fixed seed (FUZZ_SEED, default 1) and a fixed number of inputs
# (FUZZ_RUNS, default 500000 per target), so the same code gives the same verdict on every machine.
# For a long exploratory run set FUZZ_SECONDS (a time budget per target; random seed unless FUZZ_SEED
# is set; the corpus in $BUILD/fuzz_<target>/corpus is kept between such runs), and FUZZ_TARGETS to
# pick targets. Add what a run finds to the unit tests (tests/test_checkpoint.c, tests/test_store.c).
set -u
cd "$(dirname "$0")/.." || exit 1
BUILD=${BUILD:-build}
CLANG=${CLANG:-clang}
TARGETS=${FUZZ_TARGETS:-checkpoint store frames}
if ! command -v "$CLANG" >/dev/null 2>&1; then
  echo "clang not found: apt-get install -y clang libclang-rt-14-dev"; exit 77
fi
mkdir -p "$BUILD"
probe="$BUILD/fuzz_probe.c"
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' > "$probe"
if ! "$CLANG" -fsanitize=fuzzer,address,undefined "$probe" -o "$BUILD/fuzz_probe" >/dev/null 2>&1; then
  echo "libFuzzer is not available to $CLANG: apt-get install -y libclang-rt-14-dev (it provides libclang_rt.fuzzer)"; exit 77
fi
[ -f ddp.h ] || { echo "no ddp.h (make header writes it)"; exit 1; }
if [ -n "${FUZZ_SECONDS:-}" ]; then
  budget="-max_total_time=$FUZZ_SECONDS${FUZZ_SEED:+ -seed=$FUZZ_SEED}"; what="${FUZZ_SECONDS}s"
else
  budget="-runs=${FUZZ_RUNS:-500000} -seed=${FUZZ_SEED:-1}"; what="${FUZZ_RUNS:-500000} inputs, seed ${FUZZ_SEED:-1}"
fi

# seeds_<target> DIR: write the starting corpus
seeds_checkpoint() {
  python3 - "$1" <<'PY'
import sys, os
sys.path.insert(0, "tests/interop")
import safetensors_io as st
d = sys.argv[1]
st.write_file(os.path.join(d, "seed_all_dtypes"), st.sample_tensors(), {"ddp.step": "7", "note": "caf\u00e9 \"q\"\n"})
st.write_file(os.path.join(d, "seed_empty"), [], {})
st.write_file(os.path.join(d, "seed_nocrc"), st.sample_tensors()[:2], {"k": "v"}, checksums=False)
with open(os.path.join(d, "seed_json"), "w") as f:
    f.write('{"__metadata__":{"a":"b"},"x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}')
PY
}
seeds_store() { # one piece per request, on connection 0 (control byte: length-1 << 1 | connection)
  python3 - "$1" <<'PY'
import sys, os, struct
d = sys.argv[1]
s = lambda b: struct.pack("<Q", len(b)) + b
announce = b"\x04" + struct.pack("<Q", 1) + s(b"\0ddp.h/status")
reqs = {
  "set_get": [b"\x00" + s(b"/k") + s(b"v1"), b"\x05" + struct.pack("<Q", 1) + s(b"/k"), b"\x02" + s(b"/k")],
  "add_check": [b"\x03" + s(b"/n") + struct.pack("<q", 5), b"\x04" + struct.pack("<Q", 2) + s(b"/n") + s(b"/m"), b"\x06"],
  "compare_set_delete": [b"\x01" + s(b"/c") + s(b"") + s(b"x"), b"\x08" + s(b"/c"), b"\x07" + s(b"/w")],
  # a request announced by CHECK of "\0ddp.h/status" (answered with a status byte), and a refused ADD
  "announced": [announce + b"\x00" + s(b"/n") + s(b"9223372036854775807"), announce + b"\x03" + s(b"/n") + struct.pack("<q", 1),
                announce + b"\x00" + s(b"/big") + s(b"x" * 1500), announce + b"\x00" + s(b"/big2") + s(b"y" * 1500)],
}
for name, pieces in reqs.items():
    out = b""
    for i, p in enumerate(pieces):
        conn = i % 2  # alternate connections so a WAIT on one sees a SET on the other
        while p:
            chunk, p = p[:128], p[128:]
            out += bytes([((len(chunk) - 1) << 1) | conn]) + chunk
    open(os.path.join(d, name), "wb").write(out)
PY
}
seeds_frames() {
  python3 - "$1" <<'PY'
import sys, os, struct
d = sys.argv[1]
def frame(kind, coll=1, dtype=1, op=0, root=-1, src=1, seq=5, count=100, nbytes=400, code=0):
    return struct.pack("<IBBBBiiQQQiI", 0x44445031, kind, coll, dtype, op, root, src, seq, count, nbytes, code, 0)
msg = b"rank 1 failed: out of memory\0"
open(os.path.join(d, "data"), "wb").write(frame(1))
open(os.path.join(d, "abort"), "wb").write(frame(2, nbytes=len(msg), code=-7) + msg)
open(os.path.join(d, "abort_code_0"), "wb").write(frame(2, nbytes=len(msg), code=0) + msg)  # must not read as success
open(os.path.join(d, "bye"), "wb").write(frame(3, nbytes=0))
open(os.path.join(d, "mismatch"), "wb").write(frame(1, coll=2, root=0))
PY
}

failed=""
# Each target builds and runs in the background beside the others (the machine's cores; libFuzzer is
# single-threaded), its output kept apart and printed in order afterwards.
fuzz_target() {  # fuzz_target T: build, seed and fuzz one target; exit 0 when nothing was found
  local t=$1 out="$BUILD/fuzz_$1" dict="" rc
  if [ -z "${FUZZ_SECONDS:-}" ]; then rm -rf "$out/corpus"; fi # the reproducible run starts from the seeds alone
  mkdir -p "$out/corpus"
  "$CLANG" -std=c99 -Wall -Wextra -Werror -pedantic -gline-tables-only -O1 -pthread -I. \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    "tests/fuzz/fuzz_$t.c" -o "$out/fuzz_$t" -lm || return 1
  "seeds_$t" "$out/corpus" || return 1
  [ -f "tests/fuzz/$t.dict" ] && dict="-dict=tests/fuzz/$t.dict"
  echo "== fuzz_$t: $what"
  # shellcheck disable=SC2086 # $budget and $dict are lists of options
  "$out/fuzz_$t" $budget -max_len=4096 -timeout=10 -rss_limit_mb=2048 $dict -artifact_prefix="$out/" \
    -print_final_stats=1 "$out/corpus" 2>&1 | tail -n 12
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "fuzz_$t found a failure (exit $rc); the input is in $out/ (crash-*, leak-*, timeout-*)"; return 1
  fi
}
pids=()
for t in $TARGETS; do
  mkdir -p "$BUILD/fuzz_$t"
  fuzz_target "$t" >"$BUILD/fuzz_$t/run.log" 2>&1 &
  pids+=($!)
done
i=0
for t in $TARGETS; do
  wait "${pids[$i]}" || failed="$failed $t"
  cat "$BUILD/fuzz_$t/run.log"
  i=$((i + 1))
done
[ -z "$failed" ] || { echo "FAIL:$failed"; exit 1; }
echo "fuzz: no failures in $TARGETS ($what each)"
