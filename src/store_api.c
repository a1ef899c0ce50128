/* [SECTION] store-api: the store's calls on either kind of handle: ddp_store_* and their argument checks
   (the TCP client is store_client.c's, the file store store_file.c's; each fills the handle's ops). */
#include "internal.h"
#include "store_state.h"

/* Checks shared by the public calls; messages go to the store (or this thread's buffer without one). */
static ddp_result ddp__store_check_key(ddp_store *s, const char *key, const char *call) {
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (!key) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is NULL", call);
    if (strlen(key) + s->prefix_len >= DDP__STORE_MAX_KEY)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the key is %zu bytes long; keys (with the store's "
                                                            "prefix) must stay under %zu bytes",
                               call, strlen(key), DDP__STORE_MAX_KEY);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_value(ddp_store *s, const void *value, size_t size, const char *call) {
    if (!value && size) return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: the value is NULL but its size is %zu", call, size);
    if (size > DDP__STORE_MAX_VALUE)
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: a value of %zu bytes is over the store's limit of %zu "
                                                            "MiB; send large data with collectives instead",
                               call, size, DDP__STORE_MAX_VALUE >> 20);
    return DDP_SUCCESS;
}

static ddp_result ddp__store_check_keys(ddp_store *s, const char *const *keys, int n, const char *call) {
    int i;
    ddp_result r;
    if (!s) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "%s: the store is NULL", call);
    if (n < 0 || (uint64_t)n > DDP__STORE_MAX_WAIT_KEYS || (n > 0 && !keys))
        return ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "%s: %d keys%s (0 to %llu keys at once)", call, n,
                               n > 0 && !keys ? " in a NULL array" : "", (unsigned long long)DDP__STORE_MAX_WAIT_KEYS);
    for (i = 0; i < n; i++)
        if ((r = ddp__store_check_key(s, keys[i], call)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

static ddp_result ddp__store_compare_set(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                                         const void *desired, size_t desired_size, void *current, size_t capacity,
                                         size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, expected, expected_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, desired, desired_size, "ddp__store_compare_set");
    if (r == DDP_SUCCESS && !current && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp__store_compare_set: current is NULL but capacity is %zu",
                            capacity);
    if (r) return r;
    return s->ops->compare_set(s, key, expected, expected_size, desired, desired_size, current, capacity, size);
}

static ddp_result ddp__store_num_keys(ddp_store *s, int64_t *n) {
    if (!s || !n) return ddp__fail(NULL, DDP_ERR_INVALID_ARGUMENT, "ddp__store_num_keys: NULL store or result");
    return s->ops->num_keys(s, n);
}

DDP_API ddp_result ddp_store_set(ddp_store *s, const char *key, const void *value, size_t size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_set");
    if (r == DDP_SUCCESS) r = ddp__store_check_value(s, value, size, "ddp_store_set");
    return r ? r : s->ops->set(s, key, value, size);
}

DDP_API ddp_result ddp_store_get(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_get");
    if (r == DDP_SUCCESS && !value && capacity)
        r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_get: value is NULL but capacity is %zu", capacity);
    return r ? r : s->ops->get(s, key, value, capacity, size);
}

DDP_API ddp_result ddp_store_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_add");
    return r ? r : s->ops->add(s, key, delta, result);
}

DDP_API ddp_result ddp_store_check(ddp_store *s, const char *key, int *exists) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_check");
    if (r == DDP_SUCCESS && !exists) r = ddp__store_fail(s, DDP_ERR_INVALID_ARGUMENT, "ddp_store_check: exists is NULL");
    return r ? r : s->ops->check(s, &key, 1, exists);
}

DDP_API ddp_result ddp_store_wait(ddp_store *s, const char *const *keys, int n, double timeout_seconds) {
    ddp_result r = ddp__store_check_keys(s, keys, n, "ddp_store_wait");
    return r ? r : s->ops->wait(s, keys, n, timeout_seconds > 0 ? timeout_seconds : s->timeout);
}

DDP_API ddp_result ddp_store_delete(ddp_store *s, const char *key, int *deleted) {
    ddp_result r = ddp__store_check_key(s, key, "ddp_store_delete");
    return r ? r : s->ops->del(s, key, deleted);
}

DDP_API const char *ddp_store_last_error(const ddp_store *s) { return s ? s->error : ddp_last_error(NULL); }
