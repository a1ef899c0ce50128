/* [SECTION] store-file: the file store: an append-only log of records under flock(), as torch's FileStore
   (store.c's head comment describes it; store_state.h the handle it fills). */
#include "internal.h"
#include "store_state.h"

/* Take the file's lock (LOCK_SH or LOCK_EX) before the deadline: a holder only keeps it for one operation. */
static ddp_result ddp__file_lock(ddp_store *s, int how, double deadline, const char *doing) {
    double backoff = 0.001;
    for (;;) {
        if (flock(s->file_fd, how | LOCK_NB) == 0) return DDP_SUCCESS;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot lock %s while %s: %s", s->where, doing, strerror(errno));
        if (ddp__now() + backoff > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for the lock on %s while %s; "
                                                       "is a process holding it stuck?", s->timeout, s->where, doing);
        ddp__sleep(backoff);
        backoff = DDP__MIN(backoff * 2, 0.05);
    }
}

static void ddp__file_unlock(ddp_store *s) { flock(s->file_fd, LOCK_UN); }

/* Apply the records in buf[0 .. n) (whole records only: written under the exclusive lock). */
static ddp_result ddp__file_apply(ddp_store *s, const unsigned char *buf, size_t n) {
    size_t at = 0;
    while (at < n) {
        unsigned char op = buf[at];
        uint64_t klen, vlen = 0;
        const unsigned char *key, *value = NULL;
        if (n - at < 9 || (op != 'S' && op != 'D')) break;
        memcpy(&klen, buf + at + 1, 8);
        if (klen > DDP__STORE_MAX_KEY || n - at - 9 < klen) break;
        key = buf + at + 9;
        at += 9 + (size_t)klen;
        if (op == 'S') {
            unsigned char *copy;
            if (n - at < 8) break;
            memcpy(&vlen, buf + at, 8);
            if (vlen > DDP__STORE_MAX_VALUE || n - at - 8 < vlen) break;
            value = buf + at + 8;
            at += 8 + (size_t)vlen;
            copy = ddp__store_dup(value, (size_t)vlen);
            if (!copy || ddp__kv_put(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen), copy, (size_t)vlen) < 0)
                return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %s", s->where);
        } else {
            ddp__kv_remove(&s->kv, key, (size_t)klen, ddp__store_hash(key, (size_t)klen));
        }
    }
    if (at == n) return DDP_SUCCESS;
    return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is damaged: a bad or cut-off record %llu bytes into it (was a "
                                              "writer killed?); delete the file and start every rank again",
                           s->where, (unsigned long long)(s->file_off + at));
}

/* Under the lock: check that the file is still the one at the path, and replay what this handle has not
   seen yet. */
static ddp_result ddp__file_sync(ddp_store *s) {
    struct stat st, at_path;
    unsigned char *buf;
    size_t n, got = 0;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (stat(s->path, &at_path) != 0 || at_path.st_ino != st.st_ino || at_path.st_dev != st.st_dev)
        return ddp__store_fail(s, DDP_ERR_STATE, "%s was deleted or replaced (the last of its users closed it); "
                                                 "every rank must open the store before any closes it", s->where);
    if ((uint64_t)st.st_size == s->file_off) return DDP_SUCCESS;
    if ((uint64_t)st.st_size < s->file_off)
        return ddp__store_fail(s, DDP_ERR_FORMAT, "%s shrank from %llu to %llu bytes; something else writes to it",
                               s->where, (unsigned long long)s->file_off, (unsigned long long)st.st_size);
    n = (size_t)((uint64_t)st.st_size - s->file_off);
    if (!(buf = (unsigned char *)ddp__malloc(n)))
        return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory reading %zu bytes of %s", n, s->where);
    while (got < n) {
        ssize_t k = pread(s->file_fd, buf + got, n - got, (off_t)(s->file_off + got));
        if (k > 0) {
            got += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        ddp__free(buf);
        return ddp__store_fail(s, DDP_ERR_IO, "cannot read %s: %s", s->where, k < 0 ? strerror(errno) : "short read");
    }
    if (s->file_off == 0) { /* a new handle: the file must start with the magic */
        if (n < 8 || memcmp(buf, DDP__STORE_FILE_MAGIC, 8) != 0) {
            ddp__free(buf);
            return ddp__store_fail(s, DDP_ERR_FORMAT, "%s is not a ddp.h file store (another program's file, or one "
                                                      "left by another tool?); use a new path", s->where);
        }
        r = ddp__file_apply(s, buf + 8, n - 8);
    } else {
        r = ddp__file_apply(s, buf, n);
    }
    ddp__free(buf);
    if (r == DDP_SUCCESS) s->file_off = (uint64_t)st.st_size;
    return r;
}

static ddp_result ddp__file_write(ddp_store *s, const void *buf, size_t n) {
    const char *p = (const char *)buf;
    while (n > 0) {
        ssize_t k = write(s->file_fd, p, n);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        return ddp__store_fail(s, DDP_ERR_IO, "cannot write to %s: %s", s->where, k < 0 ? strerror(errno) : "no space");
    }
    return DDP_SUCCESS;
}

/* Under the exclusive lock, after ddp__file_sync: append a record ('S' with a value, 'D' without) and apply it. */
static ddp_result ddp__file_append(ddp_store *s, char op, const char *key, size_t klen, const void *value, size_t vlen) {
    size_t n = 9 + klen + (op == 'S' ? 8 + vlen : 0);
    unsigned char *rec = (unsigned char *)ddp__malloc(n);
    uint64_t k64 = klen, v64 = vlen;
    ddp_result r;
    if (!rec) return ddp__store_fail(s, DDP_ERR_OUT_OF_MEMORY, "out of memory writing %s", s->where);
    rec[0] = (unsigned char)op;
    memcpy(rec + 1, &k64, 8);
    memcpy(rec + 9, key, klen);
    if (op == 'S') {
        memcpy(rec + 9 + klen, &v64, 8);
        if (vlen) memcpy(rec + 17 + klen, value, vlen);
    }
    r = ddp__file_write(s, rec, n);
    if (r == DDP_SUCCESS) r = ddp__file_apply(s, rec, n);
    if (r == DDP_SUCCESS) s->file_off += n;
    ddp__free(rec);
    return r;
}

/* Run body (one of the ddp__file_*_locked functions) under the lock, after catching up with the file. */
#define DDP__FILE_LOCKED(s, how, doing, call)                                    \
    do {                                                                         \
        ddp_result r_ = ddp__file_lock(s, how, ddp__now() + (s)->timeout, doing); \
        if (r_ != DDP_SUCCESS) return r_;                                        \
        r_ = ddp__file_sync(s);                                                  \
        if (r_ == DDP_SUCCESS) r_ = (call);                                      \
        ddp__file_unlock(s);                                                     \
        return r_;                                                               \
    } while (0)

static ddp__kv *ddp__file_find(ddp_store *s, const char *key) {
    size_t n = strlen(key);
    return ddp__kv_find(&s->kv, key, n, ddp__store_hash(key, n));
}

static ddp_result ddp__file_set(ddp_store *s, const char *key, const void *value, size_t size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "setting a key", ddp__file_append(s, 'S', key, strlen(key), value, size));
}

static ddp_result ddp__file_add_locked(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp__kv *kv = ddp__file_find(s, key);
    int64_t old = 0, now;
    char text[32], name[96];
    int n;
    if (kv && ddp__store_parse_int(kv->value, kv->value_len, &old) != 0)
        return ddp__store_fail(s, DDP_ERR_STATE, "cannot add to key '%s' in %s: its value is not an integer",
                               ddp__store_key_text(key, strlen(key), name, sizeof name), s->where);
    if (ddp__store_add_int(old, delta, &now) != 0)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "cannot add %lld to key '%s' in %s: it holds %lld, and the "
                                                            "sum would overflow int64 (the store does not wrap around)",
                               (long long)delta, ddp__store_key_text(key, strlen(key), name, sizeof name), s->where,
                               (long long)old);
    n = snprintf(text, sizeof text, "%lld", (long long)now);
    if (result) *result = now;
    return ddp__file_append(s, 'S', key, strlen(key), text, (size_t)n);
}

static ddp_result ddp__file_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    DDP__FILE_LOCKED(s, LOCK_EX, "adding to a key", ddp__file_add_locked(s, key, delta, result));
}

static ddp_result ddp__file_check_locked(ddp_store *s, const char *const *keys, int n, int *exists) {
    int i;
    *exists = 1;
    for (i = 0; i < n; i++)
        if (!ddp__file_find(s, keys[i])) *exists = 0;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_check(ddp_store *s, const char *const *keys, int n, int *exists) {
    DDP__FILE_LOCKED(s, LOCK_SH, "checking keys", ddp__file_check_locked(s, keys, n, exists));
}

/* Poll until every key exists; with want_value, copy keys[0]'s value out while still holding the lock. */
static ddp_result ddp__file_poll(ddp_store *s, const char *const *keys, int n, double timeout, int want_value,
                                 void *value, size_t capacity, size_t *size) {
    double deadline = ddp__now() + timeout, backoff = 0.001;
    char names[300];
    int first = 1;
    for (;;) {
        struct stat st;
        /* nothing new in the file since the last look: no need to take the lock */
        if (first || fstat(s->file_fd, &st) != 0 || (uint64_t)st.st_size != s->file_off) {
            int all = 0;
            ddp_result r = ddp__file_lock(s, LOCK_SH, deadline, "waiting for keys");
            if (r) return r;
            r = ddp__file_sync(s);
            if (r == DDP_SUCCESS) ddp__file_check_locked(s, keys, n, &all);
            if (r == DDP_SUCCESS && all && want_value) {
                ddp__kv *kv = ddp__file_find(s, keys[0]);
                if (capacity) memcpy(value, kv->value, DDP__MIN(capacity, kv->value_len));
                if (size) *size = kv->value_len;
            }
            ddp__file_unlock(s);
            if (r) return r;
            if (all) return DDP_SUCCESS;
            first = 0;
        }
        if (ddp__now() >= deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out after %.3g s waiting for %s in %s; is every rank "
                                                       "running and doing the same steps? (DDP_TIMEOUT sets the timeout)",
                                   timeout, ddp__store_keys_text(keys, n, names, sizeof names), s->where);
        ddp__sleep(DDP__MIN(backoff, DDP__MAX(deadline - ddp__now(), 0.0)));
        backoff = DDP__MIN(backoff * 1.5, 0.05);
    }
}

static ddp_result ddp__file_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    return ddp__file_poll(s, &key, 1, s->timeout, 1, value, capacity, size);
}

static ddp_result ddp__file_wait(ddp_store *s, const char *const *keys, int n, double timeout) {
    return ddp__file_poll(s, keys, n, timeout, 0, NULL, 0, NULL);
}

static ddp_result ddp__file_delete_locked(ddp_store *s, const char *key, int *deleted) {
    int there = ddp__file_find(s, key) != NULL;
    if (deleted) *deleted = there;
    return there ? ddp__file_append(s, 'D', key, strlen(key), NULL, 0) : DDP_SUCCESS;
}

static ddp_result ddp__file_delete(ddp_store *s, const char *key, int *deleted) {
    DDP__FILE_LOCKED(s, LOCK_EX, "deleting a key", ddp__file_delete_locked(s, key, deleted));
}

static ddp_result ddp__file_compare_set_locked(ddp_store *s, const char *key, const void *expected, size_t elen,
                                               const void *desired, size_t dlen, void *current, size_t capacity,
                                               size_t *size) {
    ddp__kv *kv = ddp__file_find(s, key);
    ddp_result r;
    if (!kv && elen != 0) { /* torch answers with expected here */
        if (current) memcpy(current, expected, DDP__MIN(capacity, elen));
        if (size) *size = elen;
        return DDP_SUCCESS;
    }
    if (!kv || (kv->value_len == elen && memcmp(kv->value, expected, elen) == 0)) {
        if ((r = ddp__file_append(s, 'S', key, strlen(key), desired, dlen)) != DDP_SUCCESS) return r;
        kv = ddp__file_find(s, key);
    }
    if (current) memcpy(current, kv->value, DDP__MIN(capacity, kv->value_len));
    if (size) *size = kv->value_len;
    return DDP_SUCCESS;
}

static ddp_result ddp__file_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                        const void *desired, size_t desired_size, void *current, size_t capacity,
                                        size_t *size) {
    DDP__FILE_LOCKED(s, LOCK_EX, "compare-setting a key",
                     ddp__file_compare_set_locked(s, key, expected, expected_size, desired, desired_size, current,
                                                  capacity, size));
}

static ddp_result ddp__file_num_keys_locked(ddp_store *s, int64_t *n) {
    *n = (int64_t)s->kv.count - (ddp__file_find(s, DDP__STORE_FILE_REFS) ? 1 : 0);
    return DDP_SUCCESS;
}

static ddp_result ddp__file_num_keys(ddp_store *s, int64_t *n) {
    DDP__FILE_LOCKED(s, LOCK_SH, "counting keys", ddp__file_num_keys_locked(s, n));
}

/* The last user to leave deletes the file, as torch's FileStore does. */
static void ddp__file_close(ddp_store *s) {
    if (s->file_fd >= 0 && s->file_off > 0 &&
        ddp__file_lock(s, LOCK_EX, ddp__now() + s->timeout, "closing") == DDP_SUCCESS) {
        int64_t users = 1;
        if (ddp__file_sync(s) == DDP_SUCCESS && ddp__file_add_locked(s, DDP__STORE_FILE_REFS, -1, &users) == DDP_SUCCESS &&
            users <= 0)
            unlink(s->path);
        ddp__file_unlock(s);
    }
    if (s->file_fd >= 0) close(s->file_fd);
    s->file_fd = -1;
    ddp__kv_clear(&s->kv);
    ddp__free(s->path);
}

static const ddp__store_ops ddp__file_ops = {ddp__file_set,    ddp__file_get,         ddp__file_add,
                                             ddp__file_check,  ddp__file_wait,        ddp__file_delete,
                                             ddp__file_compare_set, ddp__file_num_keys, ddp__file_close};

/* Open the file and lock it, making sure the locked file is still the one at the path: the last user of an
   old store may have deleted it between our open and our lock. */
static ddp_result ddp__file_open_locked(ddp_store *s, double deadline) {
    for (;;) {
        struct stat st, at_path;
        ddp_result r;
        s->file_fd = open(s->path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (s->file_fd < 0)
            return ddp__store_fail(s, DDP_ERR_IO, "cannot open %s: %s (its directory must exist and be writable by "
                                                  "every rank)", s->where, strerror(errno));
        if ((r = ddp__file_lock(s, LOCK_EX, deadline, "opening it")) != DDP_SUCCESS) return r;
        if (fstat(s->file_fd, &st) == 0 && stat(s->path, &at_path) == 0 && st.st_ino == at_path.st_ino &&
            st.st_dev == at_path.st_dev)
            return DDP_SUCCESS;
        close(s->file_fd); /* closing drops the lock */
        s->file_fd = -1;
        if (ddp__now() > deadline)
            return ddp__store_fail(s, DDP_ERR_TIMEOUT, "timed out opening %s: it keeps being replaced", s->where);
    }
}

static ddp_result ddp__file_open_body(ddp_store *s) {
    struct stat st;
    ddp_result r;
    if (fstat(s->file_fd, &st) != 0)
        return ddp__store_fail(s, DDP_ERR_IO, "cannot stat %s: %s", s->where, strerror(errno));
    if (st.st_size == 0 && (r = ddp__file_write(s, DDP__STORE_FILE_MAGIC, 8)) != DDP_SUCCESS) return r;
    if ((r = ddp__file_sync(s)) != DDP_SUCCESS) return r;
    return ddp__file_add_locked(s, DDP__STORE_FILE_REFS, 1, NULL);
}

static ddp_result ddp__store_open_file(const char *path, double timeout, ddp_store **out, char *err) {
    ddp_store *s;
    ddp_result r;
    *out = NULL;
    if (!path || !*path) return ddp__fail_to(err, DDP_ERR_INVALID_ARGUMENT, "the file store needs a path");
    if (!(s = ddp__store_alloc(&ddp__file_ops, timeout)) || !(s->path = ddp__strdup(path))) {
        ddp__free(s);
        return ddp__fail_to(err, DDP_ERR_OUT_OF_MEMORY, "out of memory opening the file store");
    }
    snprintf(s->where, sizeof s->where, "the file store %s", path);
    r = ddp__file_open_locked(s, ddp__now() + s->timeout);
    if (r == DDP_SUCCESS) {
        r = ddp__file_open_body(s);
        ddp__file_unlock(s);
    }
    if (r != DDP_SUCCESS) {
        ddp__fail_to(err, r, "%s", s->error);
        s->file_off = 0; /* not counted as a user: leave the count alone when closing */
        ddp__store_free(s);
        return r;
    }
    *out = s;
    return DDP_SUCCESS;
}
