/* [SECTION] registry: which groups and work handles are alive, so that a call on a destroyed group or
   a spent ddp_work is an error instead of a use after free

   A freed object cannot be inspected (its memory may be reused, and AddressSanitizer rightly flags the
   read), so liveness is never asked of the object itself: one process-wide set holds the address of
   every live group (from ddp__group_alloc to ddp__group_free) and of every work handle not yet waited
   on (from its async call to ddp_wait, or to its group's end). A public entry point looks the pointer
   up before it dereferences it.

   The set is an open-addressing hash table (linear probing, deletion by backward shift, so no
   tombstones), resized to keep it at most half full, under one mutex. Each entry carries its kind, so a
   group's address never passes for a work handle. The table is freed when it empties, so a program that
   destroys everything leaves nothing behind. Limitation: once the allocator reuses a freed handle's
   address for a newer handle, the old pointer reads as that newer handle; a spent handle is recognized
   until then (always, in the common case of waiting twice in a row). */
#include "internal.h"

typedef struct ddp__live_entry {
    const void *p; /* NULL: empty slot */
    int kind;
} ddp__live_entry;

static pthread_mutex_t ddp__live_mu = PTHREAD_MUTEX_INITIALIZER;
static ddp__live_entry *ddp__live_table;
static size_t ddp__live_cap, ddp__live_n; /* cap: a power of two, or 0 */

static size_t ddp__live_slot(const void *p, size_t cap) {
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (cap - 1);
}

/* The slot holding p, or the empty slot where it would go. Needs cap > n. */
static size_t ddp__live_find(const void *p) {
    size_t i = ddp__live_slot(p, ddp__live_cap);
    while (ddp__live_table[i].p && ddp__live_table[i].p != p) i = (i + 1) & (ddp__live_cap - 1);
    return i;
}

static int ddp__live_grow(void) {
    size_t cap = ddp__live_cap ? ddp__live_cap * 2 : 64, i;
    ddp__live_entry *old = ddp__live_table, *t = (ddp__live_entry *)ddp__calloc(cap, sizeof *t);
    size_t old_cap = ddp__live_cap;
    if (!t) return 0;
    ddp__live_table = t;
    ddp__live_cap = cap;
    for (i = 0; i < old_cap; i++)
        if (old[i].p) ddp__live_table[ddp__live_find(old[i].p)] = old[i];
    ddp__free(old);
    return 1;
}

static int ddp__live_add(const void *p, int kind) {
    int ok = 1;
    pthread_mutex_lock(&ddp__live_mu);
    if (2 * (ddp__live_n + 1) > ddp__live_cap) ok = ddp__live_grow();
    if (ok) {
        size_t i = ddp__live_find(p);
        if (!ddp__live_table[i].p) ddp__live_n++;
        ddp__live_table[i].p = p;
        ddp__live_table[i].kind = kind;
    }
    pthread_mutex_unlock(&ddp__live_mu);
    return ok;
}

/* Remove slot i, shifting later entries of its probe run back so every lookup still finds them. */
static void ddp__live_erase(size_t i) {
    size_t j = i, mask = ddp__live_cap - 1;
    ddp__live_table[i].p = NULL;
    for (;;) {
        size_t home;
        j = (j + 1) & mask;
        if (!ddp__live_table[j].p) break;
        home = ddp__live_slot(ddp__live_table[j].p, ddp__live_cap);
        /* move j back to i when i lies cyclically in [home, j) */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            ddp__live_table[i] = ddp__live_table[j];
            ddp__live_table[j].p = NULL;
            i = j;
        }
    }
    if (--ddp__live_n == 0) {
        ddp__free(ddp__live_table);
        ddp__live_table = NULL;
        ddp__live_cap = 0;
    }
}

/* Every call on a group asks whether the group is live, and a mutex costs more than a small collective
   (perf: the two lock/unlock pairs and lookups were a sixth of a call on a group of one). So each thread remembers
   the last group it found live and how many groups had been removed then: while that number stays the
   same, no group has gone, so the same pointer is still live. Only a group's removal changes it. */
static uint64_t ddp__live_groups_removed; /* atomic: written under ddp__live_mu, read without it */
static DDP__THREAD_LOCAL const void *ddp__live_last_group;
static DDP__THREAD_LOCAL uint64_t ddp__live_last_removed;

/* 1 when p is live as kind; with take, it is removed as well (so two callers cannot both take it). */
static int ddp__live_check(const void *p, int kind, int take) {
    int found = 0;
    uint64_t removed;
    if (!p) return 0;
    if (kind == DDP__LIVE_GROUP && !take && p == ddp__live_last_group &&
        __atomic_load_n(&ddp__live_groups_removed, __ATOMIC_ACQUIRE) == ddp__live_last_removed)
        return 1;
    pthread_mutex_lock(&ddp__live_mu);
    removed = ddp__live_groups_removed;
    if (ddp__live_cap) {
        size_t i = ddp__live_find(p);
        found = ddp__live_table[i].p == p && ddp__live_table[i].kind == kind;
        if (found && take) ddp__live_erase(i);
    }
    if (found && kind == DDP__LIVE_GROUP) {
        if (take) __atomic_store_n(&ddp__live_groups_removed, removed + 1, __ATOMIC_RELEASE);
        else ddp__live_last_group = p, ddp__live_last_removed = removed;
    }
    pthread_mutex_unlock(&ddp__live_mu);
    return found;
}

static int ddp__live_has(const void *p, int kind) { return ddp__live_check(p, kind, 0); }
static int ddp__live_take(const void *p, int kind) { return ddp__live_check(p, kind, 1); }
static void ddp__live_remove(const void *p, int kind) { (void)ddp__live_check(p, kind, 1); }

/* The check at the top of every public entry point that takes a group. */
static ddp_result ddp__group_check(const ddp_group *g, const char *fn) {
    if (!g) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the group is NULL (did ddp_init succeed?)", fn);
    if (!ddp__live_has(g, DDP__LIVE_GROUP))
        return ddp__fail(NULL, DDP_ERR_STATE, "%s: group %p was destroyed (or was never returned by ddp_init or "
                         "ddp_new_group); a destroyed group cannot be used, and ddp_destroy of a group also destroys "
                         "its subgroups", fn, (const void *)g);
    return DDP_SUCCESS;
}

/* A destroyed group's message went with it: this thread's last error then. */
DDP_API const char *ddp_last_error(const ddp_group *g) {
    return g && ddp__live_has(g, DDP__LIVE_GROUP) ? g->error : ddp__error_buffer(NULL);
}
