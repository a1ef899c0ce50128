/* tests/cuda_harness/cuda_runtime.h — a CPU execution harness for the source of CUDA kernels.
   With -Itests/cuda_harness, a host C++17 compiler (g++, clang++) builds a .cu file unchanged (as
   `-x c++`): <cuda_runtime.h>, <cuda_fp16.h> and <cuda_bf16.h> resolve to this folder, and kernels
   launched through the source's launch macro run on the CPU (ddp_cuda.cu's
   DDP__CU_LAUNCH(kernel, grid, block, shmem, stream)(args...) is kernel<<<grid, block, shmem,
   stream>>>(args...) under nvcc and ddp_harness::launch(kernel, grid, block, shmem, stream)(args...)
   here). This is how ddp.h's kernels are tested without a GPU (tests/test_cuda_kernels.sh).

   Execution model:
   - A launch runs to completion before it returns; streams are ignored (any stream order holds).
     Blocks run one after another. The threads of a block are fibers on the calling OS thread: each
     runs without interruption until it reaches a barrier (__syncthreads, a warp shuffle or vote,
     __syncwarp) or returns.
   - __syncthreads is a block barrier that every thread of the block must reach: threads that have
     returned while others wait at one are reported (undefined in CUDA), as is a deadlock.
   - Warp operations are warp barriers with a value exchange. Every lane named in the mask must reach
     the same operation (same kind, mask, width and value size); the mask must contain the caller and
     name only lanes that exist and have not returned; a shuffle must not read a lane outside the mask.
     All of these are reported, not guessed at.
   - Races show: the threads of a block start, and resume after each barrier, in an order that changes
     from block to block and launch to launch (forward, reversed, pseudo-random), so a read of another
     thread's write that no barrier separates from it sees the wrong value in some block.
   - __shared__ variables are function statics (blocks run one at a time, the fibers of a block share
     them). A block finds what the previous block left there (zeros before the first), much as on a GPU.
   - A reported problem stops the launch (its remaining threads and blocks do not run), is printed to
     stderr, and the next cudaGetLastError() returns cudaErrorLaunchFailure, whose cudaGetErrorString
     is the report (the real runtime would say "unspecified launch failure"). A launch with an invalid
     configuration (a block of 0 or more than 1024 threads, a grid beyond CUDA's limits) runs nothing
     and sets cudaErrorInvalidConfiguration; a nonzero dynamic shared memory size, which is not
     emulated, sets cudaErrorInvalidValue.
   Not emulated, so using them is a compile error rather than a silent mistake: atomics, dynamic
   shared memory, __constant__, textures, cooperative groups, device-side launches. Kernels may be
   passed ordinary host pointers; the memory API at the end of this file (cudaMalloc, cudaMallocHost,
   cudaMemcpy(Async), streams, events, cudaPointerGetAttributes) emulates device memory that the host
   cannot touch, for the code that stages device buffers (tests/test_cuda_devbuf.sh).

   Fibers switch with a few lines of x86-64 assembly (the callee-saved registers and the stack
   pointer); on other machines, or with -DDDP_HARNESS_UCONTEXT, with ucontext's swapcontext (portable
   but ~20x slower: a system call per switch). Under AddressSanitizer the switches are announced to it.
   The harness is single-threaded: one launch at a time per process.

   Half types: __half and __nv_bfloat16 hold the bits; __half2float, __float2half(_rn),
   __bfloat162float and __float2bfloat16(_rn) convert with round-to-nearest-even, written here from the
   IEEE formats (binary16: 1 sign, 5 exponent, 10 fraction bits; bfloat16: the top half of a binary32). */
#ifndef DDP_CUDA_HARNESS_RUNTIME_H
#define DDP_CUDA_HARNESS_RUNTIME_H
#if defined(__CUDACC__)
#error "tests/cuda_harness stands in for the CUDA runtime under a host compiler: keep it off nvcc's include path"
#endif
#define DDP_CUDA_HARNESS 1

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <utility>

#if !defined(__x86_64__) && !defined(DDP_HARNESS_UCONTEXT)
#define DDP_HARNESS_UCONTEXT
#endif
#ifdef DDP_HARNESS_UCONTEXT
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DDP_HARNESS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DDP_HARNESS_ASAN 1
#endif
#endif
#ifdef DDP_HARNESS_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

/* ---- CUDA keywords. Device functions and kernels become inline functions, device code is host code. */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

/* ---- built-in types and variables (set per fiber by the scheduler) ---- */
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline constexpr int warpSize = 32;

/* ---- runtime API: the error calls; launches run synchronously, so synchronising has nothing to do ---- */
typedef struct CUstream_st *cudaStream_t;
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719
} cudaError_t;

namespace ddp_harness {

enum fiber_state { READY, AT_SYNC, AT_WARP, DONE };
enum warp_op { OP_SYNCWARP, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT };

struct fiber {
#ifdef DDP_HARNESS_UCONTEXT
    ucontext_t uc;
#else
    void *sp;
#endif
    char *stack; /* lowest usable byte; a PROT_NONE guard page lies below it */
    void *fake_stack; /* AddressSanitizer's state of this fiber while it is switched out */
    uint3 tid;
    int state;
    /* the warp operation it waits at */
    int op, width;
    int64_t arg;
    unsigned mask, size;
    uint64_t value, result;
};

constexpr size_t stack_bytes = 256 * 1024;
constexpr size_t guard_bytes = 64 * 1024;
constexpr int max_threads = 1024;

struct state_t {
    fiber *fibers;   /* max_threads of them; [0, stacks) have a stack */
    int *order;      /* the order of this block's fibers */
    int stacks;
    int nthreads;    /* of each block of the running launch */
    fiber *cur;      /* the running fiber; NULL in the scheduler */
#ifdef DDP_HARNESS_UCONTEXT
    ucontext_t sched;
#else
    void *sched_sp;
#endif
    void *sched_fake;         /* AddressSanitizer: the scheduler's state and stack */
    const void *sched_bottom;
    size_t sched_size;
    void (*body)(const void *); /* runs the kernel with its arguments */
    const void *ctx;
    bool active, failed;
    cudaError_t last_error;
    uint64_t launches;
    char message[1024];
};
inline state_t S;

} // namespace ddp_harness

#ifndef DDP_HARNESS_UCONTEXT
/* ddp_harness_swap(save, load): push the callee-saved registers, store the stack pointer in *save, load
   `load` as the stack pointer, pop that fiber's registers and return into it. A new fiber's stack is
   laid out like a suspended one whose return address is the fiber entry. The floating-point control
   words are not switched: kernels do not change them. Defined once per program (a comdat group). */
extern "C" void ddp_harness_swap(void **save, void *load);
__asm__(".pushsection .text.ddp_harness_swap,\"axG\",@progbits,ddp_harness_swap,comdat\n"
        ".weak ddp_harness_swap\n"
        ".type ddp_harness_swap,@function\n"
        "ddp_harness_swap:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size ddp_harness_swap, .-ddp_harness_swap\n"
        ".popsection\n");
#endif

namespace ddp_harness {

/* Record the first problem of a launch; the scheduler stops at it. */
__attribute__((format(printf, 1, 2))) inline void report(const char *fmt, ...) {
    va_list ap;
    int n;
    if (S.failed) return;
    S.failed = true;
    n = snprintf(S.message, sizeof S.message, "cuda harness: block (%u,%u,%u) of grid (%u,%u,%u), block size (%u,%u,%u): ",
                 blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y, blockDim.z);
    if (n < 0 || (size_t)n >= sizeof S.message) n = 0;
    va_start(ap, fmt);
    vsnprintf(S.message + n, sizeof S.message - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", S.message);
}

/* Device code called outside a launch is a bug of the test program, not of a kernel. */
inline fiber *current(const char *what) {
    if (!S.active || !S.cur) {
        fprintf(stderr, "cuda harness: %s called outside a kernel launch\n", what);
        abort();
    }
    return S.cur;
}

inline void fiber_main();

/* ---- switching: scheduler -> fiber (resume) and fiber -> scheduler (yield) ----
   The switching functions are not instrumented by AddressSanitizer: a fiber's last frames never return,
   and instrumented ones would leave poisoned stack behind for the next block's fiber. */
#ifdef DDP_HARNESS_ASAN
#define DDP_HARNESS_NO_ASAN __attribute__((no_sanitize_address))
#else
#define DDP_HARNESS_NO_ASAN
#endif

DDP_HARNESS_NO_ASAN inline void resume(fiber *f) {
    S.cur = f;
    threadIdx = f->tid;
#ifdef DDP_HARNESS_ASAN
    __sanitizer_start_switch_fiber(&S.sched_fake, f->stack, stack_bytes);
#endif
#ifdef DDP_HARNESS_UCONTEXT
    swapcontext(&S.sched, &f->uc);
#else
    ddp_harness_swap(&S.sched_sp, f->sp);
#endif
#ifdef DDP_HARNESS_ASAN
    __sanitizer_finish_switch_fiber(S.sched_fake, nullptr, nullptr);
#endif
    S.cur = nullptr;
}

/* exiting: the fiber will not be resumed (AddressSanitizer frees its state). */
DDP_HARNESS_NO_ASAN inline void yield(fiber *f, bool exiting) {
#ifdef DDP_HARNESS_ASAN
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake_stack, S.sched_bottom, S.sched_size);
#else
    (void)exiting;
#endif
#ifdef DDP_HARNESS_UCONTEXT
    swapcontext(&f->uc, &S.sched);
#else
    ddp_harness_swap(&f->sp, S.sched_sp);
#endif
#ifdef DDP_HARNESS_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, &S.sched_bottom, &S.sched_size);
#endif
}

DDP_HARNESS_NO_ASAN inline void fiber_main() {
    fiber *f;
#ifdef DDP_HARNESS_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &S.sched_bottom, &S.sched_size);
#endif
    f = S.cur;
    S.body(S.ctx);
    f->state = DONE;
    yield(f, true);
    abort(); /* a finished fiber is never resumed */
}

/* Make f start at fiber_main on its own stack when next resumed. */
inline void prepare(fiber *f) {
    f->fake_stack = nullptr;
#ifdef DDP_HARNESS_UCONTEXT
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = stack_bytes;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_main, 0);
#else
    {
        /* From the top: a null return address for fiber_main (so it is entered with the stack aligned as
           after a call), fiber_main as the return address of ddp_harness_swap, six zero registers. */
        void (*entry)() = fiber_main;
        char *top = (char *)((uintptr_t)(f->stack + stack_bytes) & ~(uintptr_t)15);
        char *sp = top - 8 * sizeof(void *);
        memset(sp, 0, 8 * sizeof(void *));
        memcpy(top - 2 * sizeof(void *), &entry, sizeof entry);
        f->sp = sp;
    }
#endif
}

inline void ensure_fibers(int n) {
    if (!S.fibers) {
        S.fibers = (fiber *)calloc(max_threads, sizeof(fiber));
        S.order = (int *)calloc(max_threads, sizeof(int));
        if (!S.fibers || !S.order) {
            fprintf(stderr, "cuda harness: out of memory\n");
            abort();
        }
    }
    while (S.stacks < n) {
        char *m = (char *)mmap(nullptr, stack_bytes + guard_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == (char *)MAP_FAILED || mprotect(m, guard_bytes, PROT_NONE) != 0) {
            fprintf(stderr, "cuda harness: cannot map a fiber stack\n");
            abort();
        }
        S.fibers[S.stacks++].stack = m + guard_bytes;
    }
}

/* ---- barriers ---- */

inline const char *op_name(int op) {
    switch (op) {
    case OP_SYNCWARP: return "__syncwarp";
    case OP_SHFL_IDX: return "__shfl_sync";
    case OP_SHFL_UP: return "__shfl_up_sync";
    case OP_SHFL_DOWN: return "__shfl_down_sync";
    case OP_SHFL_XOR: return "__shfl_xor_sync";
    default: return "__ballot_sync/__any_sync/__all_sync";
    }
}

/* Wait (in a fiber) until the scheduler releases the barrier. */
inline void wait_at(fiber *f, int state) {
    f->state = state;
    yield(f, false);
}

template <typename T>
inline T warp_exchange(int op, unsigned mask, T var, int64_t arg, int width) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "warp operations exchange values of up to 8 bytes");
    fiber *f = current(op_name(op));
    T out;
    if (width < 1 || width > warpSize || (width & (width - 1)) != 0)
        report("thread (%u,%u,%u): %s with width %d; it must be a power of 2 in [1, 32]", f->tid.x, f->tid.y, f->tid.z,
               op_name(op), width);
    f->op = op;
    f->mask = mask;
    f->arg = arg;
    f->width = width;
    f->size = (unsigned)sizeof(T);
    f->value = 0;
    memcpy(&f->value, &var, sizeof(T));
    wait_at(f, AT_WARP);
    memcpy(&out, &f->result, sizeof(T));
    return out;
}

/* The lane whose value lane `lane` receives from shuffle f (lane itself: it keeps its own value). */
inline int shuffle_source(const fiber *f, int lane) {
    const int seg = lane & ~(f->width - 1), pos = lane - seg;
    switch (f->op) {
    case OP_SHFL_IDX: return seg + (int)((uint64_t)f->arg % (uint64_t)f->width);
    case OP_SHFL_UP: return f->arg >= 0 && pos - f->arg >= 0 ? lane - (int)f->arg : lane;
    case OP_SHFL_DOWN: return f->arg >= 0 && pos + f->arg < f->width ? lane + (int)f->arg : lane;
    default: { /* xor: lanes of later width-groups are out of reach */
        const int64_t src = (int64_t)lane ^ f->arg;
        return src >= 0 && src < seg + f->width ? (int)src : lane;
    }
    }
}

/* The lanes of mask (warp at fibers[base], `lanes` of them) have all arrived: deliver the results. */
inline bool exchange(fiber *w, unsigned mask) {
    const int op = w[__builtin_ctz(mask)].op;
    unsigned ballot = 0;
    for (int l = 0; l < warpSize; l++)
        if (mask >> l & 1u && w[l].value) ballot |= 1u << l;
    for (int l = 0; l < warpSize; l++) {
        if (!(mask >> l & 1u)) continue;
        if (op == OP_BALLOT) {
            w[l].result = ballot;
        } else if (op != OP_SYNCWARP) {
            const int src = shuffle_source(&w[l], l);
            if (!(mask >> src & 1u)) {
                report("thread (%u,%u,%u), lane %d: %s reads lane %d, which is not in the mask 0x%08x (undefined on a GPU)",
                       w[l].tid.x, w[l].tid.y, w[l].tid.z, l, op_name(op), src, mask);
                return false;
            }
            w[l].result = w[src].value;
        }
    }
    for (int l = 0; l < warpSize; l++)
        if (mask >> l & 1u) w[l].state = READY;
    return true;
}

/* Release the warp operations whose lanes have all arrived. Returns whether any was released. */
inline bool settle_warps(int n) {
    bool released = false;
    for (int base = 0; base < n; base += warpSize) {
        fiber *w = S.fibers + base;
        const int lanes = n - base < warpSize ? n - base : warpSize;
        for (int l = 0; l < lanes; l++) {
            const fiber *f = &w[l];
            bool all = true;
            if (f->state != AT_WARP) continue;
            if (!(f->mask >> l & 1u)) {
                report("thread (%u,%u,%u): %s with mask 0x%08x, which does not contain its own lane %d", f->tid.x, f->tid.y,
                       f->tid.z, op_name(f->op), f->mask, l);
                return false;
            }
            if (lanes < warpSize && f->mask >> lanes) {
                report("thread (%u,%u,%u): %s with mask 0x%08x names lanes that do not exist (warp %d has %d lanes)",
                       f->tid.x, f->tid.y, f->tid.z, op_name(f->op), f->mask, base / warpSize, lanes);
                return false;
            }
            for (int b = 0; b < lanes; b++) {
                const fiber *g = &w[b];
                if (!(f->mask >> b & 1u)) continue;
                if (g->state == DONE) {
                    report("thread (%u,%u,%u): %s with mask 0x%08x, but lane %d (thread (%u,%u,%u)) has returned",
                           f->tid.x, f->tid.y, f->tid.z, op_name(f->op), f->mask, b, g->tid.x, g->tid.y, g->tid.z);
                    return false;
                }
                if (g->state != AT_WARP) {
                    all = false;
                } else if (g->op != f->op || g->mask != f->mask || g->width != f->width || g->size != f->size) {
                    report("lanes %d and %d of warp %d wait at different warp operations: %s (mask 0x%08x, width %d, "
                           "%u-byte value) and %s (mask 0x%08x, width %d, %u-byte value)",
                           l, b, base / warpSize, op_name(f->op), f->mask, f->width, f->size, op_name(g->op), g->mask,
                           g->width, g->size);
                    return false;
                }
            }
            if (!all) continue;
            if (!exchange(w, f->mask)) return false;
            released = true;
        }
    }
    return released;
}

/* Every fiber is at a barrier or done: release what can be released. false: the block is over
   (finished, or a problem was reported). */
inline bool settle(int n) {
    int done = 0, at_sync = 0;
    const fiber *waiting = nullptr, *exited = nullptr;
    for (int i = 0; i < n; i++) {
        const fiber *f = &S.fibers[i];
        if (f->state == DONE) done++, exited = f;
        if (f->state == AT_SYNC) at_sync++;
        if (f->state == AT_WARP && !waiting) waiting = f;
    }
    if (done == n) return false;
    if (settle_warps(n)) return true;
    if (S.failed) return false;
    if (at_sync + done == n) {
        if (done) {
            report("%d threads wait at __syncthreads, but %d threads of the block have returned (e.g. thread (%u,%u,%u)): "
                   "every thread of a block must reach each __syncthreads",
                   at_sync, done, exited->tid.x, exited->tid.y, exited->tid.z);
            return false;
        }
        for (int i = 0; i < n; i++) S.fibers[i].state = READY;
        return true;
    }
    report("deadlock: %d threads wait at __syncthreads and %d at warp operations whose lanes cannot all arrive (e.g. "
           "thread (%u,%u,%u) at %s with mask 0x%08x)",
           at_sync, n - at_sync - done, waiting->tid.x, waiting->tid.y, waiting->tid.z, op_name(waiting->op),
           waiting->mask);
    return false;
}

inline uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The order in which a block's fibers run: forward, reversed or shuffled, changing per block and launch. */
inline void make_order(int n, uint64_t launch, uint64_t block) {
    const uint64_t kind = (launch + block) % 3;
    uint64_t r = mix(launch * 0x100000001b3ull ^ block);
    for (int i = 0; i < n; i++) S.order[i] = kind == 1 ? n - 1 - i : i;
    if (kind == 2)
        for (int i = n - 1; i > 0; i--) {
            const int j = (int)((r = mix(r)) % (uint64_t)(i + 1)), t = S.order[i];
            S.order[i] = S.order[j];
            S.order[j] = t;
        }
}

inline void run_block(uint64_t launch, uint64_t block) {
    const int n = S.nthreads;
    for (int i = 0; i < n; i++) {
        fiber *f = &S.fibers[i];
        f->tid.x = (unsigned)i % blockDim.x;
        f->tid.y = (unsigned)i / blockDim.x % blockDim.y;
        f->tid.z = (unsigned)i / (blockDim.x * blockDim.y);
        f->state = READY;
        prepare(f);
    }
    make_order(n, launch, block);
    do {
        for (int k = 0; k < n; k++) {
            fiber *f = &S.fibers[S.order[k]];
            if (f->state != READY) continue;
            resume(f);
            if (S.failed) return;
        }
    } while (settle(n));
}

inline void set_error(cudaError_t e, const char *msg) {
    S.last_error = e;
    snprintf(S.message, sizeof S.message, "cuda harness: %s", msg);
    fprintf(stderr, "%s\n", S.message);
}

inline void run(dim3 grid, dim3 block, size_t shmem, void (*body)(const void *), const void *ctx) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (S.active) {
        fprintf(stderr, "cuda harness: a kernel launched a kernel (device-side launches are not emulated)\n");
        abort();
    }
    if (threads < 1 || threads > (uint64_t)max_threads || block.z > 64 || grid.x < 1 || grid.x > 0x7fffffffu ||
        grid.y < 1 || grid.y > 65535 || grid.z < 1 || grid.z > 65535) {
        char msg[200];
        snprintf(msg, sizeof msg, "invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u)", grid.x, grid.y, grid.z,
                 block.x, block.y, block.z);
        set_error(cudaErrorInvalidConfiguration, msg);
        return;
    }
    if (shmem) {
        set_error(cudaErrorInvalidValue, "dynamic shared memory (a nonzero shmem launch argument) is not emulated");
        return;
    }
    ensure_fibers((int)threads);
    S.active = true;
    S.failed = false;
    S.body = body;
    S.ctx = ctx;
    S.nthreads = (int)threads;
    blockDim = block;
    gridDim = grid;
    const uint64_t launch = S.launches++;
    for (unsigned z = 0; z < grid.z && !S.failed; z++)
        for (unsigned y = 0; y < grid.y && !S.failed; y++)
            for (unsigned x = 0; x < grid.x && !S.failed; x++) {
                blockIdx.x = x;
                blockIdx.y = y;
                blockIdx.z = z;
                run_block(launch, ((uint64_t)z * grid.y + y) * grid.x + x);
            }
    S.active = false;
    if (!S.failed) return;
    S.last_error = cudaErrorLaunchFailure;
#ifdef DDP_HARNESS_ASAN
    /* the abandoned fibers' frames never returned: their stacks are clean again for the next launch */
    for (int i = 0; i < S.stacks; i++) __asan_unpoison_memory_region(S.fibers[i].stack, stack_bytes);
#endif
}

/* The memory API's part in a launch (below): queued copies run first, and the kernel may touch device
   memory while it runs. */
inline void memory_before_launch();
inline void memory_after_launch();

/* What DDP__CU_LAUNCH(kernel, grid, block, shmem, stream) becomes: launch(...)(args...) converts the
   arguments to the kernel's parameter types, as a <<<>>> launch does, and runs the grid. Every thread
   calls the kernel with its own copy of the arguments. */
template <typename... P>
struct launcher {
    void (*kernel)(P...);
    dim3 grid, block;
    size_t shmem;
    void operator()(P... args) const {
        struct call {
            void (*kernel)(P...);
            std::tuple<P...> args;
        } c = {kernel, std::tuple<P...>(args...)};
        memory_before_launch();
        run(grid, block, shmem, [](const void *p) {
            const call *k = static_cast<const call *>(p);
            std::apply(k->kernel, k->args);
        }, &c);
        memory_after_launch();
    }
};

/* The stream of the last launch: streams are otherwise ignored, but a test can check where a library
   queued its kernels (e.g. on the stream its copies use). */
inline cudaStream_t last_launch_stream;

template <typename... P>
inline launcher<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem, cudaStream_t stream) {
    last_launch_stream = stream;
    return launcher<P...>{kernel, grid, block, shmem};
}

} // namespace ddp_harness

/* ---- device intrinsics ---- */

inline void __syncthreads() { ddp_harness::wait_at(ddp_harness::current("__syncthreads"), ddp_harness::AT_SYNC); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)ddp_harness::warp_exchange(ddp_harness::OP_SYNCWARP, mask, 0u, 0, warpSize);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    return ddp_harness::warp_exchange(ddp_harness::OP_SHFL_IDX, mask, var, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ddp_harness::warp_exchange(ddp_harness::OP_SHFL_UP, mask, var, delta, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ddp_harness::warp_exchange(ddp_harness::OP_SHFL_DOWN, mask, var, delta, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    return ddp_harness::warp_exchange(ddp_harness::OP_SHFL_XOR, mask, var, lane_mask, width);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return ddp_harness::warp_exchange(ddp_harness::OP_BALLOT, mask, (unsigned)(predicate != 0), 0, warpSize);
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

/* ---- runtime API ---- */

inline cudaError_t cudaGetLastError() {
    const cudaError_t e = ddp_harness::S.last_error;
    ddp_harness::S.last_error = cudaSuccess;
    return e;
}
inline cudaError_t cudaPeekAtLastError() { return ddp_harness::S.last_error; }
namespace ddp_harness {
inline void flush_all_copies(); /* the memory API's (below): queued copies run */
}
inline cudaError_t cudaDeviceSynchronize() {
    ddp_harness::flush_all_copies();
    return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
    ddp_harness::flush_all_copies();
    return cudaSuccess;
}

inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    }
    return "cudaErrorUnknown";
}

/* The harness's report for the errors it raises (the last one's); the runtime's own text for the
   status codes that are no failure of a launch or a copy. */
inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return ddp_harness::S.message;
    }
}

/* ---- half types ---- */

struct __half {
    unsigned short __x;
};
struct __nv_bfloat16 {
    unsigned short __x;
};

namespace ddp_harness {
inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* x >> shift, rounded to nearest, ties to even (shift in [1, 31]). */
inline uint32_t shift_rne(uint32_t x, int shift) {
    const uint32_t q = x >> shift, rem = x & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}
} // namespace ddp_harness

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.__x & 0x8000u) << 16, e = (h.__x >> 10) & 0x1fu, m = h.__x & 0x3ffu;
    if (e == 0x1f) return ddp_harness::bits_f32(sign | 0x7f800000u | m << 13); /* inf, NaN (payload kept) */
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in binary32 */
        const float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    return ddp_harness::bits_f32(sign | (e + 112u) << 23 | m << 13); /* rebias 15 -> 127 */
}

inline __half __float2half_rn(float f) {
    const uint32_t u = ddp_harness::f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    __half h;
    if (a > 0x7f800000u) {
        h.__x = (unsigned short)(sign | 0x7e00u | (a >> 13 & 0x1ffu)); /* NaN stays a (quiet) NaN */
    } else if (a >= 0x477ff000u) {
        h.__x = (unsigned short)(sign | 0x7c00u); /* >= 65520 (half-way above the largest half) and inf */
    } else if (a >= 0x38800000u) { /* normal: drop 13 fraction bits; a carry into the exponent is right */
        h.__x = (unsigned short)(sign | ddp_harness::shift_rne(a - (112u << 23), 13));
    } else if (a > 0x33000000u) { /* subnormal: multiples of 2^-24; 2^-25 itself is a tie that goes to 0 */
        const uint32_t e = a >> 23, sig = (a & 0x7fffffu) | 0x800000u; /* value = sig * 2^(e - 150) */
        h.__x = (unsigned short)(sign | ddp_harness::shift_rne(sig, (int)(126u - e)));
    } else {
        h.__x = (unsigned short)sign;
    }
    return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) { return ddp_harness::bits_f32((uint32_t)b.__x << 16); }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t u = ddp_harness::f32_bits(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        b.__x = (unsigned short)((u >> 16) | 0x40u); /* NaN: keep it one after truncation */
    else
        b.__x = (unsigned short)((u >> 16) + ((u & 0xffffu) > 0x8000u || ((u & 0xffffu) == 0x8000u && (u >> 16 & 1u))));
    return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

/* ---- memory API: device allocations the host cannot touch, pinned host memory, copies that run when
   synchronised (tests/test_cuda_devbuf.sh; the kernels' test passes ordinary pointers and needs none).
   - cudaMalloc gives pages of their own mapped PROT_NONE: a host access to device memory that does
     not go through this API is a SIGSEGV. The API's own copies and memsets, and kernels while they
     run, open them (PROT_READ|PROT_WRITE) and close them again.
   - cudaMallocHost is "pinned" host memory (ordinary memory, recorded); everything else is pageable.
   - cudaMemcpyAsync only queues its copy (checked at once: a device range must lie inside one
     allocation). Queued copies run in queue order when something synchronises: cudaStreamSynchronize
     or cudaDeviceSynchronize (all of them; a legal schedule for any stream), cudaEventSynchronize (those
     queued before the event was recorded), cudaMemcpy, cudaFree(Host) and kernel launches (all). So a
     program that reads a copy's destination, or writes its source, before synchronising sees the
     difference, as it could on a GPU. An async copy between device and pageable host memory runs at
     once (the runtime stages those synchronously) and is counted in memory_stats.pageable_async.
   - cudaPointerGetAttributes: cudaMemoryTypeDevice inside a cudaMalloc'd range, cudaMemoryTypeHost
     inside a cudaMallocHost'd one, cudaMemoryTypeUnregistered otherwise.
   - cudaMallocAsync, cudaFreeAsync and cudaMemsetAsync run at once, after the queued copies (a legal
     schedule: the host cannot look at device memory in between).
   - Streams are tokens (cudaStreamCreate); memory_stats counts the async copies per direction and
     remembers the last stream one was queued on. One thread at a time, as the rest of the harness.
   - Events: cudaEventSynchronize runs the copies queued before the event was recorded. cudaEventQuery
     answers cudaErrorNotReady to the first query after each cudaEventRecord (so that a program's
     polling loop turns at least once), then runs those copies and answers cudaSuccess; an event never
     recorded is complete, as in CUDA.
   - Devices: cudaGetDeviceCount reports DDP_HARNESS_DEVICES (0-64; 0 is cudaErrorNoDevice) or by default 1,
     4 with the fake NCCL (DDP_HARNESS_NCCL: tests/cuda_harness/nccl.h, one device per rank of up to 4
     ranks on a host); cudaSetDevice only records the current device (cudaGetDevice, and the device of
     later allocations in cudaPointerGetAttributes): all devices share the process's memory. */
#include <unistd.h>
#include <vector>

typedef struct CUevent_st *cudaEvent_t;
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3 };
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};
struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
};
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02

namespace ddp_harness {

struct allocation {
    char *p;
    size_t bytes, mapped;
    bool device;
    int ordinal; /* the current device when it was allocated */
};
struct queued_copy {
    void *dst;
    const void *src;
    size_t bytes;
    uint64_t seq;
};
struct memory_stats_t {
    uint64_t async_d2h, async_h2d, async_d2d, pageable_async, syncs;
    cudaStream_t last_stream; /* of the last async copy */
};
inline std::vector<allocation> allocations;
inline std::vector<queued_copy> queued;
inline uint64_t copy_seq;
inline memory_stats_t memory_stats;
inline int current_device;
inline size_t page_bytes() { return (size_t)sysconf(_SC_PAGESIZE); }

/* The devices cudaGetDeviceCount reports: DDP_HARNESS_DEVICES, else 1 (4 with the fake NCCL). */
inline int device_count() {
    const char *v = getenv("DDP_HARNESS_DEVICES");
    char *end = nullptr;
    long n;
    if (!v || !*v) {
#ifdef DDP_HARNESS_NCCL
        return 4;
#else
        return 1;
#endif
    }
    n = strtol(v, &end, 10);
    if (*end || n < 0 || n > 64) {
        fprintf(stderr, "cuda harness: DDP_HARNESS_DEVICES=%s is not a number of devices in [0, 64]\n", v);
        abort();
    }
    return (int)n;
}

inline allocation *find_allocation(const void *p) {
    for (auto &a : allocations)
        if ((const char *)p >= a.p && (const char *)p < a.p + a.bytes) return &a;
    return nullptr;
}
inline void protect(const allocation *a, bool open) {
    if (a && a->device && mprotect(a->p, a->mapped, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) {
        perror("cuda harness: mprotect");
        abort();
    }
}
inline void run_copy(const queued_copy &c) {
    allocation *d = find_allocation(c.dst), *s = find_allocation(c.src);
    protect(d, true);
    protect(s, true);
    memmove(c.dst, c.src, c.bytes);
    protect(d, false);
    protect(s, false);
}
/* Run the queued copies numbered below `until` (all: UINT64_MAX), in queue order. */
inline void flush_copies(uint64_t until = UINT64_MAX) {
    size_t i = 0;
    while (i < queued.size() && queued[i].seq < until) run_copy(queued[i++]);
    queued.erase(queued.begin(), queued.begin() + (std::ptrdiff_t)i);
}
/* A range of bytes at p: inside one allocation when p is in one (else host memory the caller owns). */
inline bool range_ok(const void *p, size_t bytes) {
    const allocation *a = find_allocation(p);
    return !a || (size_t)((const char *)a->p + a->bytes - (const char *)p) >= bytes;
}
inline bool is_device(const void *p) {
    const allocation *a = find_allocation(p);
    return a && a->device;
}
inline cudaError_t check_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    char msg[200];
    if (!dst || !src || !range_ok(dst, bytes) || !range_ok(src, bytes)) {
        snprintf(msg, sizeof msg, "cudaMemcpy of %zu bytes from %p to %p: a pointer is NULL or the range runs past its "
                 "allocation", bytes, src, dst);
        set_error(cudaErrorInvalidValue, msg);
        return cudaErrorInvalidValue;
    }
    if ((kind == cudaMemcpyHostToDevice && (is_device(src) || !is_device(dst))) ||
        (kind == cudaMemcpyDeviceToHost && (!is_device(src) || is_device(dst))) ||
        (kind == cudaMemcpyDeviceToDevice && (!is_device(src) || !is_device(dst))) ||
        (kind == cudaMemcpyHostToHost && (is_device(src) || is_device(dst)))) {
        snprintf(msg, sizeof msg, "cudaMemcpy kind %d does not match the memory at %p -> %p", (int)kind, src, dst);
        set_error(cudaErrorInvalidValue, msg);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}
inline void flush_all_copies() {
    memory_stats.syncs++;
    flush_copies();
}
inline void memory_before_launch() {
    flush_copies();
    for (auto &a : allocations) protect(&a, true);
}
inline void memory_after_launch() {
    for (auto &a : allocations) protect(&a, false);
}

} // namespace ddp_harness

inline cudaError_t cudaMalloc(void **p, size_t bytes) {
    using namespace ddp_harness;
    const size_t mapped = ((bytes ? bytes : 1) + page_bytes() - 1) / page_bytes() * page_bytes();
    void *m = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    *p = nullptr;
    if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
    allocations.push_back(allocation{(char *)m, bytes ? bytes : 1, mapped, true, current_device});
    *p = m;
    return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaMalloc(T **p, size_t bytes) {
    return cudaMalloc((void **)p, bytes);
}
inline cudaError_t cudaFree(void *p) {
    using namespace ddp_harness;
    if (!p) return cudaSuccess;
    flush_copies();
    for (size_t i = 0; i < allocations.size(); i++)
        if (allocations[i].p == p && allocations[i].device) {
            munmap(p, allocations[i].mapped);
            allocations.erase(allocations.begin() + (std::ptrdiff_t)i);
            return cudaSuccess;
        }
    set_error(cudaErrorInvalidValue, "cudaFree of a pointer that cudaMalloc did not return");
    return cudaErrorInvalidValue;
}
inline cudaError_t cudaMallocHost(void **p, size_t bytes) {
    using namespace ddp_harness;
    void *m = malloc(bytes ? bytes : 1);
    *p = m;
    if (!m) return cudaErrorMemoryAllocation;
    allocations.push_back(allocation{(char *)m, bytes ? bytes : 1, 0, false, current_device});
    return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void *p) {
    using namespace ddp_harness;
    if (!p) return cudaSuccess;
    flush_copies();
    for (size_t i = 0; i < allocations.size(); i++)
        if (allocations[i].p == p && !allocations[i].device) {
            free(p);
            allocations.erase(allocations.begin() + (std::ptrdiff_t)i);
            return cudaSuccess;
        }
    set_error(cudaErrorInvalidValue, "cudaFreeHost of a pointer that cudaMallocHost did not return");
    return cudaErrorInvalidValue;
}
inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    using namespace ddp_harness;
    cudaError_t e = check_copy(dst, src, bytes, kind);
    if (e != cudaSuccess || !bytes) return e;
    flush_copies();
    run_copy(queued_copy{dst, src, bytes, 0});
    return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = 0) {
    using namespace ddp_harness;
    cudaError_t e = check_copy(dst, src, bytes, kind);
    const allocation *d = find_allocation(dst), *s = find_allocation(src);
    if (e != cudaSuccess || !bytes) return e;
    memory_stats.last_stream = stream;
    if (is_device(src) && is_device(dst)) memory_stats.async_d2d++;
    else if (is_device(src)) memory_stats.async_d2h++;
    else if (is_device(dst)) memory_stats.async_h2d++;
    if ((is_device(src) || is_device(dst)) && (!d || !s)) { /* pageable host memory: synchronous */
        memory_stats.pageable_async++;
        flush_copies();
        run_copy(queued_copy{dst, src, bytes, 0});
        return cudaSuccess;
    }
    queued.push_back(queued_copy{dst, src, bytes, copy_seq++});
    return cudaSuccess;
}
inline cudaError_t cudaMemset(void *dst, int value, size_t bytes) {
    using namespace ddp_harness;
    allocation *a = find_allocation(dst);
    if (!range_ok(dst, bytes)) {
        set_error(cudaErrorInvalidValue, "cudaMemset runs past its allocation");
        return cudaErrorInvalidValue;
    }
    flush_copies();
    protect(a, true);
    memset(dst, value, bytes);
    protect(a, false);
    return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *at, const void *p) {
    const ddp_harness::allocation *a = ddp_harness::find_allocation(p);
    at->type = !a ? cudaMemoryTypeUnregistered : a->device ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    at->device = a ? a->ordinal : -2;
    at->devicePointer = a && a->device ? (void *)p : nullptr;
    at->hostPointer = a && !a->device ? (void *)p : nullptr;
    return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int *count) {
    *count = ddp_harness::device_count();
    if (*count > 0) return cudaSuccess;
    ddp_harness::S.last_error = cudaErrorNoDevice; /* as the runtime: also the next cudaGetLastError */
    return cudaErrorNoDevice;
}
inline cudaError_t cudaGetDevice(int *device) {
    *device = ddp_harness::current_device;
    return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= ddp_harness::device_count()) {
        ddp_harness::S.last_error = cudaErrorInvalidDevice;
        return cudaErrorInvalidDevice;
    }
    ddp_harness::current_device = device;
    return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
inline cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); } /* after the queued copies */
inline cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t = 0) {
    return cudaMemset(dst, value, bytes);
}
inline cudaError_t cudaStreamCreate(cudaStream_t *s) {
    *s = (cudaStream_t)malloc(1);
    return *s ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
    ddp_harness::flush_copies();
    free((void *)s);
    return cudaSuccess;
}
/* An event: the number of the next copy to be queued when it was recorded (0 before the first record:
   nothing to wait for), and the queries since. */
namespace ddp_harness {
struct event_t {
    uint64_t seq;
    int queries;
};
inline event_t *event_of(cudaEvent_t e) { return (event_t *)(void *)e; }
} // namespace ddp_harness
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = (cudaEvent_t)calloc(1, sizeof(ddp_harness::event_t));
    if (*e) ddp_harness::event_of(*e)->queries = 1; /* not recorded: complete */
    return *e ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0) {
    (void)s;
    if (!e) return cudaErrorInvalidResourceHandle;
    ddp_harness::event_of(e)->seq = ddp_harness::copy_seq;
    ddp_harness::event_of(e)->queries = 0;
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return cudaErrorInvalidResourceHandle;
    ddp_harness::memory_stats.syncs++;
    ddp_harness::flush_copies(ddp_harness::event_of(e)->seq);
    return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (!e) return cudaErrorInvalidResourceHandle;
    if (ddp_harness::event_of(e)->queries++ == 0) return cudaErrorNotReady;
    ddp_harness::flush_copies(ddp_harness::event_of(e)->seq);
    return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    free((void *)e);
    return cudaSuccess;
}

#endif /* DDP_CUDA_HARNESS_RUNTIME_H */
