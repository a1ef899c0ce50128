# ddp.h build. `make` builds the tools, examples, tests and benchmarks against the generated ddp.h;
# `make test` runs every test and ends with "N passed, N failed, N skipped"; `make test-quick` runs the quick tier.
#   make test SAN=address    AddressSanitizer + UndefinedBehaviorSanitizer (build-address/)
#   make test SAN=thread     ThreadSanitizer (build-thread/)
#   make GPU=1               also build ddp_cuda.cu and the GPU programs with nvcc (needs CUDA and NCCL)
# Builds run one job per core unless the command line says otherwise (make -j1 for a serial build).
ifeq ($(filter -j%,$(MAKEFLAGS)),)
  MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif
CC      ?= cc
CXX     ?= c++
SAN     ?=
BUILD   ?= build$(if $(SAN),-$(SAN))
WARN    := -Wall -Wextra -Werror -pedantic
# sanitizer builds at -O1 (AddressSanitizer's advice; the compiles take half as long as at -O2)
OPT     ?= $(if $(SAN),-O1 -g,-O2 -g)
CFLAGS  := -std=c99 $(WARN) $(OPT) -pthread -I.
CXXFLAGS:= -std=c++17 $(WARN) $(OPT) -pthread -I.
LDLIBS  := -lm
ifeq ($(SAN),address)
  SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
endif
ifeq ($(SAN),thread)
  SANFLAGS := -fsanitize=thread
endif

TEST_PROGS := $(patsubst tests/%.c,$(BUILD)/%,$(wildcard tests/test_*.c))
EXAMPLES := $(patsubst examples/%.c,$(BUILD)/%,$(wildcard examples/*.c))
BENCHES  := $(patsubst bench/%.c,$(BUILD)/%,$(wildcard bench/*.c))
TOOLS    := $(BUILD)/ddprun

.PHONY: all test test-quick clean header check demo demo-check demo-ft bench-ft
all: $(TOOLS) $(TEST_PROGS) $(EXAMPLES) $(BENCHES) $(BUILD)/demo_check

# ddp.h is generated from src/ and committed. Building and testing use the committed copy and never
# regenerate it: `make header` is the one way to write it (python3 amalgamate.py), and `make check`
# (CI's first step) fails when it differs from what src/ gives.
header:
	python3 amalgamate.py
# (ddp.h is generated from src/: a build after an edit there regenerates it first)
ddp.h: $(wildcard src/*.c src/*.h src/*.txt) amalgamate.py
	python3 amalgamate.py
check:
	python3 amalgamate.py --check

$(BUILD):
	mkdir -p $(BUILD)
$(BUILD)/ddprun: tools/ddprun.c ddp.h | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ $< $(LDLIBS)
# The implementation is compiled once per build (ddp_impl.o, with the build's sanitizer) and linked into
# every test that includes testlib.h and uses only the public API; the others (private ddp__ names,
# their own DDP_MALLOC or testlib.h's allocation hooks, TL_ALLOC_HOOKS) compile it themselves. The
# sanitizer runs build ~20 tests: this saves minutes.
PRIVATE_NAMES := ddp__\|DDP__
SHARED_IMPL_TESTS := $(patsubst tests/%.c,$(BUILD)/%,$(shell grep -l 'testlib.h' tests/test_*.c | xargs grep -L '$(PRIVATE_NAMES)\|DDP_MALLOC\|TL_ALLOC_HOOKS'))
$(BUILD)/ddp_impl.o: ddp.h | $(BUILD)
	printf '#define DDP_IMPLEMENTATION\n#include "ddp.h"\n' | $(CC) $(CFLAGS) $(SANFLAGS) -x c -c - -o $@
$(SHARED_IMPL_TESTS): $(BUILD)/test_%: tests/test_%.c $(wildcard tests/*.h) ddp.h $(BUILD)/ddp_impl.o | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -DDDP_TEST_SHARED_IMPLEMENTATION -o $@ $< $(BUILD)/ddp_impl.o $(LDLIBS)
$(BUILD)/test_%: tests/test_%.c $(wildcard tests/*.h) ddp.h | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ $< $(LDLIBS)
# the demo's step-by-step checker: includes examples/train_demo.c (its main renamed)
$(BUILD)/demo_check: tests/demo_check.c examples/train_demo.c ddp.h | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ $< $(LDLIBS)
# make GPU=1: ddp_cuda.cu is compiled by nvcc; the examples are compiled by $(CC) with DDP_CUDA (ddp.h then
# declares the ddp_cuda_* entry points) and linked by nvcc with ddp_cuda.o and the CUDA runtime.
NVCC    ?= $(or $(shell command -v nvcc 2>/dev/null),/usr/local/cuda/bin/nvcc)
NVARCH  ?= -gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
NVFLAGS := -std=c++17 -O2 $(NVARCH) -Xcompiler -Wall,-Wextra -I.
$(BUILD)/ddp_cuda.o: ddp_cuda.cu ddp.h | $(BUILD)
	$(NVCC) $(NVFLAGS) -c $< -o $@
ifeq ($(GPU),1)
all: $(BUILD)/ddp_cuda.o $(BUILD)/train_gpu
$(BUILD)/%: examples/%.c ddp.h $(BUILD)/ddp_cuda.o | $(BUILD)
	$(CC) $(CFLAGS) -DDDP_CUDA -c -o $@.o $<
	$(NVCC) $(NVARCH) -Xcompiler -pthread -o $@ $@.o $(BUILD)/ddp_cuda.o -lnccl $(LDLIBS)
# examples/gpu: CUDA programs (nccl backend, ddp.h's implementation compiled by nvcc as C++), built only
# with GPU=1. 1675: nvcc's front end does not know `#pragma GCC unroll` (src/syncbn.c's DDP__BN_UNROLL).
$(BUILD)/%: examples/gpu/%.cu ddp.h $(BUILD)/ddp_cuda.o | $(BUILD)
	$(NVCC) $(NVFLAGS) -Werror all-warnings -Xcompiler -Werror,-pthread -o $@ $< \
	    $(BUILD)/ddp_cuda.o -lnccl $(LDLIBS)
else
# The examples, and the benches that use only the public API, keep their `#define DDP_IMPLEMENTATION` (one
# file, as a program of a user's is) but are compiled with DDP_NO_IMPLEMENTATION and linked with the build's
# ddp_impl.o (the same flags): the implementation is compiled once per build instead of once per program
# (~20 s each at -O2, ~35 s under ASan). Programs that compile it themselves: ddprun, demo_check, the
# benches below, the tests that use private names.
$(BUILD)/%: examples/%.c ddp.h $(BUILD)/ddp_impl.o | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -DDDP_NO_IMPLEMENTATION -o $@ $< $(BUILD)/ddp_impl.o $(LDLIBS)
endif
# bench/*.h: helpers the bench programs share (bench_util.h)
$(BUILD)/%: bench/%.c $(wildcard bench/*.h) ddp.h $(BUILD)/ddp_impl.o | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -DDDP_NO_IMPLEMENTATION -o $@ $< $(BUILD)/ddp_impl.o $(LDLIBS)
BENCHES_PRIVATE := $(patsubst bench/%.c,$(BUILD)/%,$(shell grep -l '$(PRIVATE_NAMES)' bench/*.c))
$(BENCHES_PRIVATE): $(BUILD)/%: bench/%.c $(wildcard bench/*.h) ddp.h | $(BUILD)
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ $< $(LDLIBS)

# The README's main job: train examples/train_demo.c on 4 CPU ranks launched by ddprun, on a free port
# (--standalone). DEMO_FLAGS=--resume continues from the last checkpoint; DEMO_FLAGS=--timeline has ddprun
# write the job's timeline to $(BUILD)/demo_timeline.json (docs/TIMELINE.md). make demo-check: a short run
# (--quick) keeping a checkpoint after every step, then tests/demo_check.c retakes each step as one
# process and prints the largest difference (DEMO_FLAGS go to both).
DEMO_TIMELINE = $(if $(filter --timeline,$(DEMO_FLAGS)),--timeline $(BUILD)/demo_timeline.json)
demo: $(BUILD)/ddprun $(BUILD)/train_demo
	$(BUILD)/ddprun --standalone --nproc-per-node 4 $(DEMO_TIMELINE) $(BUILD)/train_demo --dir $(BUILD)/demo_ckpt \
	    $(filter-out --timeline,$(DEMO_FLAGS))
demo-check: $(BUILD)/ddprun $(BUILD)/train_demo $(BUILD)/demo_check
	$(BUILD)/ddprun --standalone --nproc-per-node 4 $(BUILD)/train_demo --quick --save-every 1 --keep 0 \
	    --dir $(BUILD)/demo_check_ckpt $(DEMO_FLAGS)
	$(BUILD)/demo_check --quick --dir $(BUILD)/demo_check_ckpt $(DEMO_FLAGS)
# make demo-ft: the demo in fault-tolerant mode (--ft) under ddprun --ft on 4 ranks, twice: uninterrupted, then
# with rank 2 SIGKILLed mid-run (DEMO_FT_KILL, DDP_FT_TEST_KILL's id:step:point: step 1310 of the run's 2520
# -- 126 a default epoch: 125 of training and its end --, while its first bucket is in flight). The others
# log the view change and go on on 3 ranks; ddprun (--max-restarts 1) starts rank 2 again as a joiner, which
# is admitted with the members' state and finishes with them on 4; demo_check --compare prints the largest
# difference between the two runs' final weights. It is float rounding magnified by training: on 3 ranks the
# sums go in another order. Kills at steps 20 to 190 of test_demo.sh's 192-step run end within 1e-5 (7e-7 at most), but over
# the default run's remaining 1200 steps it grows to about 2e-3; the same uninterrupted run over TCP instead
# of shared memory (another summation order, nothing lost) ends 8e-2 from it.
DEMO_FT_KILL ?= 2:1310:bucket
demo-ft: $(BUILD)/ddprun $(BUILD)/train_demo $(BUILD)/demo_check
	rm -f $(BUILD)/demo_ft/final.safetensors $(BUILD)/demo_ft_kill/final.safetensors
	$(BUILD)/ddprun --ft --standalone --nproc-per-node 4 $(BUILD)/train_demo --ft --dir $(BUILD)/demo_ft $(DEMO_FLAGS)
	DDP_FT_TEST_KILL=$(DEMO_FT_KILL) $(BUILD)/ddprun --ft --max-restarts 1 --standalone --nproc-per-node 4 \
	    $(BUILD)/train_demo --ft --dir $(BUILD)/demo_ft_kill $(DEMO_FLAGS) 2>&1 | tee $(BUILD)/demo_ft_kill.log
	@grep -q "ranks go on" $(BUILD)/demo_ft_kill.log || \
	    { echo "make demo-ft: no rank was lost (DEMO_FT_KILL=$(DEMO_FT_KILL) past the run's end?)"; exit 1; }
	@grep -q "replacement admitted" $(BUILD)/demo_ft_kill.log || \
	    { echo "make demo-ft: the replacement was not admitted before the run ended"; exit 1; }
	$(BUILD)/demo_check --compare $(BUILD)/demo_ft/final.safetensors $(BUILD)/demo_ft_kill/final.safetensors $(DEMO_FLAGS)
# make bench-ft: what fault tolerance costs when nothing fails (FT.md's G7): bench/bench_ft.sh prints bench_ft's
# table (ddp_ft_commit against the plain 8-byte all_reduce, 2 ranks, medians) and times the demo with and without
# --ft on 4 ranks (RUNS, NPROC, DEMO_FLAGS); a report, no threshold.
bench-ft: $(BUILD)/bench_ft $(BUILD)/ddprun $(BUILD)/train_demo
	BUILD=$(BUILD) bench/bench_ft.sh

# make test: every test (the full tier). make test-quick: the unit and multi-process correctness tests
# that need only a C compiler (a few minutes). tests/README.md lists the tests and their tiers.
test: all
	BUILD=$(BUILD) SAN=$(SAN) SANFLAGS="$(SANFLAGS)" TIER=full tests/run_tests.sh
test-quick: $(TOOLS) $(TEST_PROGS) $(EXAMPLES) $(BUILD)/demo_check
	BUILD=$(BUILD) SAN=$(SAN) SANFLAGS="$(SANFLAGS)" TIER=quick tests/run_tests.sh

clean:
	rm -rf build build-address build-address-scripts build-thread
