/* [SECTION] alloc: ddp_alloc / ddp_free, library buffers that collectives use in place
   On a group whose ranks share one host, every rank maps one shared segment (shm.c), which ends with
   an arena per rank: address space reserved for ddp_alloc, taking memory only where blocks are handed
   out. A buffer in an arena can be read and written by every rank of the group, so collectives on it
   need no staging copies (shm.c's single-copy algorithms ask ddp__lib_offset whether a buffer is one).
   Elsewhere, or when the arena is full, ddp_alloc gives plain aligned heap memory.

   This rank's arena is carved into page-multiple blocks, listed in offset order: first fit, else the
   top grows. A block's pages are reserved with fallocate when it is handed out (a full /dev/shm then
   means plain memory instead of SIGBUS later) and punched out when it is freed, so a block always
   starts zero-filled and freed memory goes back to the system. One spin lock (g->lib.lock) guards the
   block list and the heap list: ddp_alloc and ddp_free may be called from any thread. */
#include "internal.h"

#include <sys/statvfs.h>

static void ddp__lib_lock(ddp_group *g) {
    while (__atomic_exchange_n(&g->lib.lock, 1, __ATOMIC_ACQUIRE)) sched_yield();
}
static void ddp__lib_unlock(ddp_group *g) { __atomic_store_n(&g->lib.lock, 0, __ATOMIC_RELEASE); }

/* The index of the arena block holding offset off (the blocks cover [0, top)); -1 when off >= top. */
static long ddp__block_find(const ddp__arena *a, size_t off) {
    size_t lo = 0, hi = a->nblocks;
    if (off >= a->top) return -1;
    while (hi - lo > 1) { /* the last block whose start is <= off */
        size_t mid = lo + (hi - lo) / 2;
        if (a->blocks[mid].off <= off)
            lo = mid;
        else
            hi = mid;
    }
    return (long)lo;
}

/* The arena offset of [p, p + bytes) when it lies inside one live block of this rank's arena. */
static uint64_t ddp__lib_offset(ddp_group *g, const void *p, size_t bytes) {
    ddp__arena *a = g->lib.arena;
    uint64_t off = DDP__SHM_NOT_LIB;
    long i;
    size_t at;
    if (!a || !a->base) return off;
    at = (size_t)((uintptr_t)p - (uintptr_t)(a->base + (size_t)g->rank * a->bytes));
    if ((uintptr_t)p < (uintptr_t)a->base || at >= a->bytes) return off;
    ddp__lib_lock(g);
    i = ddp__block_find(a, at);
    if (i >= 0 && a->blocks[i].state == 1 && bytes <= a->blocks[i].off + a->blocks[i].size - at) off = at;
    ddp__lib_unlock(g);
    return off;
}

/* Each rank's arena (rank 0 decides): DDP_SHM_ARENA_BYTES, else what /dev/shm can hold (the machine's
   memory when /dev/shm is unlimited), at most 64 GiB, and at most 8 TiB of address space over all ranks
   (every rank maps every arena). Only address space: pages are taken as blocks are allocated. */
static size_t ddp__arena_size(ddp_group *g, int fd) {
    char err[DDP__ERR_MAX];
    long v = 0;
    struct statvfs st;
    uint64_t want = 0, cap = DDP__MIN((uint64_t)64 << 30, ((uint64_t)8 << 40) / (uint64_t)g->world_size);
    int k = ddp__env_int("DDP_SHM_ARENA_BYTES", 0, (long)((uint64_t)1 << 46), &v, err);
    if (k < 0) ddp__log(g, DDP_LOG_WARN, "%s; using the default arena size", err);
    if (k > 0) return (size_t)((uint64_t)v & ~(uint64_t)(DDP__LIB_PAGE - 1));
    if (fstatvfs(fd, &st) == 0) want = (uint64_t)st.f_blocks * (uint64_t)st.f_frsize;
    if (want == 0) want = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    want = DDP__MIN(want, cap);
    if (want > (uint64_t)(SIZE_MAX / 4)) want = (uint64_t)(SIZE_MAX / 4);
    return (size_t)(want & ~(uint64_t)(DDP__ARENA_ALIGN - 1));
}


/* ---- the arena's block list ---- */

/* Insert a block before index i of this rank's list. 0 when out of memory. */
static int ddp__block_insert(ddp__arena *a, size_t i, size_t off, size_t size, int state) {
    if (a->nblocks == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 16;
        ddp__block *b = (ddp__block *)ddp__malloc(cap * sizeof *b);
        if (!b) return 0;
        if (a->nblocks) memcpy(b, a->blocks, a->nblocks * sizeof *b);
        ddp__free(a->blocks);
        a->blocks = b;
        a->cap = cap;
    }
    memmove(a->blocks + i + 1, a->blocks + i, (a->nblocks - i) * sizeof *a->blocks);
    a->blocks[i].off = off;
    a->blocks[i].size = size;
    a->blocks[i].state = state;
    a->nblocks++;
    return 1;
}

static void ddp__block_remove(ddp__arena *a, size_t i) {
    memmove(a->blocks + i, a->blocks + i + 1, (a->nblocks - i - 1) * sizeof *a->blocks);
    a->nblocks--;
}

/* Mark block i free and merge it with free neighbours; a free block at the end goes back above top. */
static void ddp__block_release(ddp__arena *a, size_t i) {
    a->blocks[i].state = 0;
    if (i + 1 < a->nblocks && a->blocks[i + 1].state == 0) {
        a->blocks[i].size += a->blocks[i + 1].size;
        ddp__block_remove(a, i + 1);
    }
    if (i > 0 && a->blocks[i - 1].state == 0) {
        a->blocks[i - 1].size += a->blocks[i].size;
        ddp__block_remove(a, i--);
    }
    if (i + 1 == a->nblocks) {
        a->top = a->blocks[i].off;
        ddp__block_remove(a, i);
    }
}

/* Take need bytes (whole pages) of this rank's arena: the block's offset, or -1 when there is no room. */
static long ddp__block_take(ddp__arena *a, size_t need) {
    size_t i, off;
    for (i = 0; i < a->nblocks; i++) {
        if (a->blocks[i].state != 0 || a->blocks[i].size < need) continue;
        if (a->blocks[i].size > need && !ddp__block_insert(a, i + 1, a->blocks[i].off + need, a->blocks[i].size - need, 0))
            return -1;
        a->blocks[i].size = need;
        a->blocks[i].state = 1;
        return (long)a->blocks[i].off;
    }
    if (need > a->bytes - a->top || !ddp__block_insert(a, a->nblocks, a->top, need, 1)) return -1;
    off = a->top;
    a->top += need;
    return (long)off;
}

static void *ddp__arena_alloc(ddp_group *g, size_t bytes) {
    ddp__arena *a = g->lib.arena;
    size_t need = (DDP__MAX(bytes, (size_t)1) + DDP__LIB_PAGE - 1) & ~(DDP__LIB_PAGE - 1);
    char *mine;
    long off;
    int err;
    if (!a || !a->base) return NULL;
    mine = a->base + (size_t)g->rank * a->bytes;
    ddp__lib_lock(g);
    off = ddp__block_take(a, need);
    ddp__lib_unlock(g);
    if (off < 0) return NULL;
    err = posix_fallocate(a->fd, a->file_off + (off_t)((size_t)g->rank * a->bytes + (size_t)off), (off_t)need);
    if (err != 0) {
        ddp__log(g, DDP_LOG_INFO, "ddp_alloc: cannot reserve %zu bytes of shared memory (%s): plain memory instead, "
                 "which collectives stage through the segment", need, strerror(err));
        ddp__lib_lock(g);
        ddp__block_release(a, (size_t)ddp__block_find(a, (size_t)off));
        ddp__lib_unlock(g);
        return NULL;
    }
    return mine + off;
}

/* 1 when p was a live block of this rank's arena (now freed), 0 when it is not one. */
static int ddp__arena_free(ddp_group *g, void *p) {
    ddp__arena *a = g->lib.arena;
    size_t at, size;
    off_t file_at;
    long i;
    if (!a || !a->base || (uintptr_t)p < (uintptr_t)(a->base + (size_t)g->rank * a->bytes)) return 0;
    at = (size_t)((uintptr_t)p - (uintptr_t)(a->base + (size_t)g->rank * a->bytes));
    if (at >= a->bytes) return 0;
    ddp__lib_lock(g);
    i = ddp__block_find(a, at);
    if (i < 0 || a->blocks[i].off != at || a->blocks[i].state != 1) {
        ddp__lib_unlock(g);
        return 0;
    }
    a->blocks[i].state = 2; /* being freed: neither handed out again nor freed twice meanwhile */
    size = a->blocks[i].size;
    ddp__lib_unlock(g);
    /* give the pages back; should the file system refuse, zero them so the next block starts zero-filled */
    file_at = a->file_off + (off_t)((size_t)g->rank * a->bytes + at);
    if (fallocate(a->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, file_at, (off_t)size) != 0) memset(p, 0, size);
    ddp__lib_lock(g);
    ddp__block_release(a, (size_t)ddp__block_find(a, at));
    ddp__lib_unlock(g);
    return 1;
}

static void *ddp__heap_alloc(ddp_group *g, size_t bytes) {
    char *raw = (char *)ddp__malloc(bytes + 63), *user;
    int ok = 1;
    if (!raw) return NULL;
    user = (char *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
    if (bytes) memset(user, 0, bytes);
    ddp__lib_lock(g);
    if (g->lib.heap_n == g->lib.heap_cap) {
        size_t cap = g->lib.heap_cap ? 2 * g->lib.heap_cap : 16;
        ddp__heap_block *b = (ddp__heap_block *)ddp__malloc(cap * sizeof *b);
        if (b) {
            if (g->lib.heap_n) memcpy(b, g->lib.heap, g->lib.heap_n * sizeof *b);
            ddp__free(g->lib.heap);
            g->lib.heap = b;
            g->lib.heap_cap = cap;
        } else {
            ok = 0;
        }
    }
    if (ok) {
        g->lib.heap[g->lib.heap_n].user = user;
        g->lib.heap[g->lib.heap_n++].raw = raw;
    }
    ddp__lib_unlock(g);
    if (!ok) ddp__free(raw);
    return ok ? user : NULL;
}

/* 1 when p was a live heap block (now freed), 0 when it is not one. */
static int ddp__heap_free(ddp_group *g, void *p) {
    void *raw = NULL;
    size_t i;
    ddp__lib_lock(g);
    for (i = 0; i < g->lib.heap_n && !raw; i++)
        if (g->lib.heap[i].user == p) {
            raw = g->lib.heap[i].raw;
            g->lib.heap[i] = g->lib.heap[--g->lib.heap_n];
        }
    ddp__lib_unlock(g);
    ddp__free(raw);
    return raw != NULL;
}

DDP_API void *ddp_alloc(ddp_group *g, size_t bytes) {
    void *p;
    if (ddp__group_check(g, "ddp_alloc") != DDP_SUCCESS) return NULL;
    if (bytes > SIZE_MAX / 4) {
        ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "ddp_alloc: %zu bytes is more than any machine can hold", bytes);
        return NULL;
    }
    if ((p = ddp__arena_alloc(g, bytes)) == NULL && (p = ddp__heap_alloc(g, bytes)) == NULL)
        ddp__fail(g, DDP_ERR_OUT_OF_MEMORY, "ddp_alloc: out of memory for %zu bytes", bytes);
    return p;
}

DDP_API void ddp_free(ddp_group *g, void *p) {
    char msg[DDP__ERR_MAX];
    if (!p) return;
    if (!g) {
        ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp_free: the group is NULL; pass the group the memory came from");
        return;
    }
    if (ddp__group_check(g, "ddp_free") != DDP_SUCCESS) return; /* its blocks went with it */
    if (ddp__arena_free(g, p) || ddp__heap_free(g, p)) return;
    snprintf(msg, sizeof msg, "ddp_free: %p is not a live block from ddp_alloc on this group (rank %d): freed already, "
             "allocated on another group, or not from ddp_alloc; it was left alone", p, g->rank);
    ddp__log(g, DDP_LOG_ERROR, "%s", msg);
    ddp__fail(g, DDP_ERR_INVALID_ARGUMENT, "%s", msg);
}

static void ddp__lib_free_all(ddp_group *g) {
    size_t i;
    for (i = 0; i < g->lib.heap_n; i++) ddp__free(g->lib.heap[i].raw);
    ddp__free(g->lib.heap);
    g->lib.heap = NULL;
    g->lib.heap_n = g->lib.heap_cap = 0;
}
