#!/usr/bin/env bash
# Fuzzes the checkpoint reader (tests/fuzz/fuzz_checkpoint.c) with libFuzzer + ASan + UBSan, starting
# from seeds written by the Python safetensors writer in tests/interop. Exit 0: no crash; 77: no
# libFuzzer here (says which package provides it).
# By default the run is reproducible: a fixed seed (FUZZ_SEED, default 1) and a fixed number of inputs
# (FUZZ_RUNS, default 500000), so the same code gives the same verdict on every machine. For a longer
# exploratory run set FUZZ_SECONDS (a time budget, random seed unless FUZZ_SEED is set) and keep the
# corpus directory between runs; add anything it finds to tests/test_checkpoint.c's malformed cases.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
if [ -n "${FUZZ_SECONDS:-}" ]; then
  budget="-max_total_time=$FUZZ_SECONDS${FUZZ_SEED:+ -seed=$FUZZ_SEED}"; what="${FUZZ_SECONDS}s"
else
  budget="-runs=${FUZZ_RUNS:-500000} -seed=${FUZZ_SEED:-1}"; what="${FUZZ_RUNS:-500000} inputs, seed ${FUZZ_SEED:-1}"
fi
CLANG=${CLANG:-clang}
out="$BUILD/fuzz_checkpoint"
# the reproducible run starts from the seeds alone; an exploratory run keeps what earlier ones found
if [ -z "${FUZZ_SECONDS:-}" ]; then rm -rf "$out/corpus"; fi
mkdir -p "$out/corpus"
if ! command -v "$CLANG" >/dev/null 2>&1; then
  echo "clang not found: apt-get install -y clang libclang-rt-14-dev"; exit 77
fi
probe="$out/probe.c"
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' > "$probe"
if ! "$CLANG" -fsanitize=fuzzer,address,undefined "$probe" -o "$out/probe" >/dev/null 2>&1; then
  echo "libFuzzer is not available to $CLANG: apt-get install -y libclang-rt-14-dev (it provides libclang_rt.fuzzer)"; exit 77
fi
python3 amalgamate.py >/dev/null || exit 1
"$CLANG" -std=c99 -Wall -Wextra -Werror -pedantic -gline-tables-only -O1 -pthread -I. \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  tests/fuzz/fuzz_checkpoint.c -o "$out/fuzz_checkpoint" -lm || exit 1
python3 - "$out/corpus" <<'PY' || exit 1
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
echo "fuzzing: $what"
"$out/fuzz_checkpoint" $budget -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict=tests/fuzz/safetensors.dict -artifact_prefix="$out/" -print_final_stats=1 "$out/corpus" 2>&1 | tail -n 25
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "fuzzer found a failure (exit $rc); the input is in $out/ (crash-*, leak-*, timeout-*)"; exit 1
fi
echo "fuzz_checkpoint: no failures in $what"
