/* [SECTION] store-state: the store's constants, its handle, and the calls between its pieces
   store.c (the protocol, key text, the hash table), store_server.c (the server), store_client.c (the
   ddp_store handle's errors and the TCP client), store_file.c (the file store) and store_api.c (the calls on
   either kind) share these; nothing else in the library does (internal.h declares what the rest calls). */
#ifndef DDP__STORE_STATE_H
#define DDP__STORE_STATE_H
/* (each piece includes internal.h first) */

#define DDP__STORE_MAX_KEY ((size_t)4096)           /* bytes in one key, prefix included */
#define DDP__STORE_MAX_VALUE ((size_t)64 << 20)     /* bytes in one value */
#define DDP__STORE_MAX_WAIT_KEYS ((uint64_t)16384)  /* keys in one WAIT or CHECK */
#define DDP__STORE_MAX_HELD ((size_t)1 << 30)       /* server: stored keys and values plus every buffer */
#define DDP__STORE_MIN_HELD ((size_t)1 << 20)       /* the least DDP_STORE_MAX_BYTES may set */
#define DDP__STORE_SMALL_ENTRY ((size_t)64 << 10)   /* entries that may use the budget's reserved last eighth */
#define DDP__STORE_ANNOUNCE "\0ddp.h/status"        /* CHECK of this key alone: answer my next request's status */
#define DDP__STORE_ANNOUNCE_LEN ((size_t)13)
#define DDP__STATUS_DONE 0
#define DDP__STATUS_REFUSED 2
#define DDP__STORE_OUT_HIGH ((size_t)1 << 20)       /* server: replies piled up for a client that does not read */
#define DDP__STORE_FILE_REFS "ddp/file_store_users" /* file store: how many handles have it open */
#define DDP__STORE_FILE_MAGIC "DDPFS001"            /* file store: the first 8 bytes of the file */

/* torch 1.13's c10d::QueryType, CheckResponseType and WaitResponseType. */
#define DDP__Q_SET 0
#define DDP__Q_COMPARE_SET 1
#define DDP__Q_GET 2
#define DDP__Q_ADD 3
#define DDP__Q_CHECK 4
#define DDP__Q_WAIT 5
#define DDP__Q_GETNUMKEYS 6
#define DDP__Q_WATCH_KEY 7
#define DDP__Q_DELETE_KEY 8
#define DDP__CHECK_READY 0
#define DDP__CHECK_NOT_READY 1
#define DDP__WAIT_STOP_WAITING 0
#define DDP__WAIT_CANCELED 1
/* Queries only torch 2.x's protocol has, by the numbers the store's pieces use inside (never on the wire as these). */
#define DDP__Q_VALIDATE 0x40
#define DDP__Q_APPEND 0x41
#define DDP__Q_MULTI_GET 0x42
#define DDP__Q_MULTI_SET 0x43
#define DDP__Q_CANCEL_WAIT 0x44
#define DDP__Q_PING 0x45
#define DDP__Q_UNKNOWN 0xff
/* torch 2.x (c10d::detail::QueryType in TCPStoreBackend.hpp): VALIDATE 0, SET 1, COMPARE_SET 2, GET 3, ADD 4,
   CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13,
   then QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS (not served here). Every connection's first query is
   VALIDATE with this magic (a uint32); VALIDATE has no reply. */
#define DDP__V2_MAGIC 0x3C85F7CEu
#define DDP__V2_VALIDATE 0
#define DDP__V2_PING 13

/* ---- the hash table's entries (store.c; the server's data, a file store's replayed state) ---- */

typedef struct ddp__kv {
    struct ddp__kv *next;
    void *owner; /* server: the ddp__store_conn charged for it (NULL: its writer left; always NULL in a file store) */
    uint64_t hash;
    size_t key_len, value_len;
    unsigned char *value;
    char *key; /* allocated with the entry, right after it */
} ddp__kv;

typedef struct ddp__kv_table {
    ddp__kv **slots;
    size_t nslots, count;
    size_t bytes; /* entries, keys and values: what the server counts against its budget */
} ddp__kv_table;

#define DDP__KV_ENTRY_BYTES(klen, vlen) (sizeof(ddp__kv) + (klen) + (vlen))

/* ---- a store handle: its kind's operations (the TCP client's or the file store's) and its state ---- */

typedef struct ddp__store_ops {
    ddp_result (*set)(ddp_store *s, const char *key, const void *value, size_t size);
    ddp_result (*get)(ddp_store *s, const char *key, void *value, size_t capacity, size_t *size);
    ddp_result (*add)(ddp_store *s, const char *key, int64_t delta, int64_t *result);
    ddp_result (*check)(ddp_store *s, const char *const *keys, int n, int *exists);
    ddp_result (*wait)(ddp_store *s, const char *const *keys, int n, double timeout);
    ddp_result (*del)(ddp_store *s, const char *key, int *deleted);
    ddp_result (*compare_set)(ddp_store *s, const char *key, const void *expected, size_t expected_size,
                              const void *desired, size_t desired_size, void *current, size_t capacity, size_t *size);
    ddp_result (*num_keys)(ddp_store *s, int64_t *n);
    void (*close)(ddp_store *s);
} ddp__store_ops;

struct ddp_store {
    const ddp__store_ops *ops;
    double timeout;
    char where[320]; /* "the store at host:port", "the file store /path": for messages */
    char error[DDP__ERR_MAX];
    /* tcp */
    char *host, *prefix;
    int port, fd;
    int proto;          /* 1: torch 1.13's protocol, 2: torch 2.x's, 0: not known yet (found out on connecting) */
    const char *proto_why; /* how it was chosen, for messages */
    int own_server;        /* this process serves the store (rank 0's own client): messages say so */
    size_t prefix_len;
    unsigned char *msg; /* the request being built */
    unsigned char msg_type;
    size_t msg_type_at; /* where the request's type byte is: after the announcing CHECK, or 0 */
    size_t msg_len, msg_cap;
    int msg_oom;
    /* file */
    char *path;
    int file_fd;
    ddp__kv_table kv; /* the file's records replayed up to file_off */
    uint64_t file_off;
    dev_t file_dev;
    ino_t file_ino;
};

/* ---- store.c: the protocol's query numbers, pieces shared by the server, the client and the file store ---- */
static DDP__UNUSED unsigned char ddp__store_wire_type(int proto, int q);
static DDP__UNUSED int ddp__store_query_of(int proto, unsigned char b);
static DDP__UNUSED const char *ddp__store_key_text(const void *key, size_t n, char *buf, size_t cap);
static DDP__UNUSED uint64_t ddp__store_hash(const void *p, size_t n);
static DDP__UNUSED int ddp__store_parse_int(const unsigned char *v, size_t n, int64_t *out);
static DDP__UNUSED int ddp__store_add_int(int64_t old, int64_t delta, int64_t *sum);
static DDP__UNUSED ddp__kv *ddp__kv_find(const ddp__kv_table *t, const void *key, size_t n, uint64_t h);
static DDP__UNUSED int ddp__kv_put(ddp__kv_table *t, const void *key, size_t n, uint64_t h, unsigned char *value, size_t vlen);
static DDP__UNUSED int ddp__kv_remove(ddp__kv_table *t, const void *key, size_t n, uint64_t h);
static DDP__UNUSED void ddp__kv_clear(ddp__kv_table *t);
static DDP__UNUSED unsigned char *ddp__store_dup(const void *p, size_t n);

/* ---- store_client.c: a handle's errors and allocation (for store_file.c and store_api.c) ---- */
static DDP__UNUSED ddp_result ddp__store_fail(ddp_store *s, ddp_result code, const char *fmt, ...) DDP__PRINTF(3, 4);
static DDP__UNUSED const char *ddp__store_keys_text(const char *const *keys, int n, char *buf, size_t cap);
static DDP__UNUSED ddp_store *ddp__store_alloc(const ddp__store_ops *ops, double timeout);

#endif /* DDP__STORE_STATE_H */
