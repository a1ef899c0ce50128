#!/usr/bin/env bash
# ddp_cuda.cu compiles with nvcc, every warning an error (nvcc's, the host compiler's -Wall -Wextra, ptxas'),
# for each of sm_70, sm_75, sm_80, sm_90 that this nvcc supports (CUDA 13 dropped sm_70: the script says
# which were built and which skipped). Then: a C99 program that includes ddp.h with DDP_CUDA links
# against it (the C declarations match the definitions) and gets argument errors from the SyncBN and
# the reducer entry points without touching a GPU; and ddp_cuda.cu refuses a ddp.h of another version.
# Skips (77) when nvcc is absent. (The kernels themselves run on the CPU in test_cuda_kernels.sh.)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; else
    echo "skipped: nvcc not found (set NVCC or install the CUDA toolkit)"; exit 77
  fi
fi
mkdir -p "$BUILD"
listed=$("$NVCC" --list-gpu-arch 2>/dev/null)
gencode=() built="" skipped=""
for sm in 70 75 80 90; do
  if grep -qx "compute_$sm" <<<"$listed"; then
    gencode+=(-gencode "arch=compute_$sm,code=sm_$sm"); built="$built sm_$sm"
  else
    skipped="$skipped sm_$sm"
  fi
done
echo "$("$NVCC" --version | tail -n 1)"
echo "building for:$built${skipped:+; not supported by this nvcc (skipped):$skipped}"
if [ ${#gencode[@]} -eq 0 ]; then echo "FAIL: this nvcc supports none of sm_70/75/80/90"; exit 1; fi
strict=(-std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -Xptxas -Werror -I.)
if ! "$NVCC" "${strict[@]}" "${gencode[@]}" -c ddp_cuda.cu -o "$BUILD/ddp_cuda.o"; then
  echo "FAIL: ddp_cuda.cu does not compile cleanly"; exit 1
fi

# The C side: declarations only (no implementation needed), C99 -pedantic, linked by nvcc with cudart.
cat >"$BUILD/cuda_link_check.c" <<'EOF'
#define DDP_CUDA
#include "ddp.h"
#include <stdio.h>
#include <string.h>
int main(void) {
    char err[256] = "";
    ddp_cuda_bn_args a;
    ddp_cuda_grads_args g;
    float work[96], mean[1], invstd[1];
    double record[3];
    int64_t numel = 4, offset = 2;
    void *grad = work;
    memset(&a, 0, sizeof a);
    a.dtype = DDP_F32;
    a.err = err;
    a.err_size = sizeof err;
    if (ddp_cuda_bn_stats(&a, NULL, work, record) != DDP_ERR_INVALID_ARGUMENT || !strstr(err, "channels is 0")) {
        printf("stats with C=0: \"%s\"\n", err);
        return 1;
    }
    a.channels = 1;
    a.dtype = DDP_I32;
    if (ddp_cuda_bn_elemt(&a, NULL, NULL, NULL, NULL, mean, invstd) != DDP_ERR_UNSUPPORTED || !strstr(err, "DDP_BF16")) {
        printf("elemt with i32: \"%s\"\n", err);
        return 1;
    }
    a.dtype = DDP_BF16;
    a.batch = -1;
    if (ddp_cuda_bn_backward_reduce(&a, NULL, NULL, mean, invstd, work, record, NULL, NULL) != DDP_ERR_INVALID_ARGUMENT) {
        printf("backward_reduce with batch -1: \"%s\"\n", err);
        return 1;
    }
    if (ddp_cuda_bn_gather_stats(&a, record, 0, 1e-5, 0.1, NULL, NULL, mean, invstd, record) != DDP_ERR_INVALID_ARGUMENT ||
        !strstr(err, "nranks")) {
        printf("gather_stats with 0 ranks: \"%s\"\n", err);
        return 1;
    }
    memset(&g, 0, sizeof g);
    g.count = 1;
    g.grads = &grad;
    g.numels = &numel;
    g.dtype = DDP_F32;
    g.err = err;
    g.err_size = sizeof err;
    if (ddp_cuda_bucket_copy_in(&g, work, DDP_F16, 5, &offset, 0.5) != DDP_ERR_INVALID_ARGUMENT ||
        !strstr(err, "does not fit in the bucket of 5 elements")) {
        printf("bucket_copy_in past the bucket: \"%s\"\n", err);
        return 1;
    }
    printf("C program linked against ddp_cuda.o; argument errors reported\n");
    return 0;
}
EOF
if ! ${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -I. -c "$BUILD/cuda_link_check.c" -o "$BUILD/cuda_link_check.o" ||
   ! "$NVCC" "$BUILD/cuda_link_check.o" "$BUILD/ddp_cuda.o" -lnccl -o "$BUILD/cuda_link_check"; then
  echo "FAIL: a C program cannot use ddp_cuda.o through ddp.h's declarations"; exit 1
fi
"$BUILD/cuda_link_check" || { echo "FAIL: argument checks"; exit 1; }

# The version guard: a ddp.h with another DDP_VERSION_NUMBER is refused with a clear message.
other=$(mktemp -d)
trap 'rm -rf "$other"' EXIT
sed 's/^#define DDP_VERSION_PATCH .*/#define DDP_VERSION_PATCH 99/' ddp.h >"$other/ddp.h"
cp ddp_cuda.cu "$other/"
if "$NVCC" -std=c++17 -I"$other" "${gencode[@]:0:2}" -c "$other/ddp_cuda.cu" -o "$other/x.o" 2>"$other/log"; then
  echo "FAIL: ddp_cuda.cu built against a ddp.h of another version"; exit 1
fi
grep -q "ddp_cuda.cu was written for ddp.h" "$other/log" || { cat "$other/log"; echo "FAIL: unclear version error"; exit 1; }
echo "version guard: refused a ddp.h with DDP_VERSION_PATCH 99"
# make GPU=1: an example compiled with DDP_CUDA and linked by nvcc with ddp_cuda.o runs (cpu backend, 1 rank)
if ! make -s GPU=1 BUILD="$BUILD/gpu" NVCC="$NVCC" "$BUILD/gpu/hello_collectives" >"$BUILD/gpu_make.log" 2>&1; then
  cat "$BUILD/gpu_make.log"; echo "FAIL: make GPU=1 could not build an example"; exit 1
fi
"$BUILD/gpu/hello_collectives" >/dev/null || { echo "FAIL: the GPU=1 build of hello_collectives does not run"; exit 1; }
echo "make GPU=1: hello_collectives built with nvcc and ran"
echo "ok"
