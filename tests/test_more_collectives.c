/* gather, scatter, all_to_all, all_to_all_v, all_gather_v, broadcast_bytes and monitored_barrier
   (issue #19) on world sizes 1, 2, 3, 4 and 8, real processes over real sockets, against a serial
   reference computed here: rank r's element i is a value every dtype holds exactly, so each received
   element is compared bit for bit with what the sending rank must have sent. Every call runs on every
   dtype, synchronous and async, in place where the call allows it, with zero, one and uneven counts
   (the split sizes of all_to_all_v and all_gather_v differ by rank and include zeros), over shared
   memory (the default on one host) and TCP (DDP_TRANSPORT=tcp). Then the failures: a rank that disagrees
   on the root, on the split sizes or on the counts, or calls another collective, is DDP_ERR_MISMATCH on
   every rank (a rank that ran ahead of a small scatter over shared memory gets it from its next call),
   and no rank's receive buffer gets wrong data meanwhile (root_data: 18 cases of gathers and scatters
   with mismatched roots, 2-4 ranks, both transports; each block is the sentinel or exactly the rank's
   own call's result); so is a recv of another size than its send, or one that meets the peer's next
   collective. Small gathers and scatters that run ahead deliver every block right (run_ahead: 600 calls
   in runs of 100 with late consumers, every block checked; fails when a writer may run one slot further).
   ddp_send / ddp_recv around the ring (every dtype, up to 1 MiB while the peer sends too, tags out of
   order, a message crossing a collective), ddp_irecv posted before ddp_isend on every rank, before a
   barrier, and finished by ddp_test; overlapping all_to_all_v buffers are refused; a rank that does not
   come to monitored_barrier is named by it, also right after a small scatter that ran ahead of it.
   Large calls over shared memory (big_worker: 70,001-300,000 elements a rank, staged and single-copy,
   library and plain buffers, DDP_SHM_CMA=0 at 8 ranks) match the reference and go single-copy on library
   buffers. Usage: test_more_collectives [world sizes...]; test_more_collectives --root-data [N] runs only
   the mismatched-root data check, N times over both transports. */
#include "testlib.h"

static const ddp_dtype dtypes[] = {DDP_F32, DDP_F64, DDP_F16, DDP_BF16, DDP_I8, DDP_U8, DDP_I32, DDP_I64};
#define NDT (sizeof dtypes / sizeof dtypes[0])

/* The element that rank `from` sends to rank `to` at index i of their block (tag: which call). */
static int64_t value(int from, int to, size_t i, int tag) {
    uint64_t h = (uint64_t)i * 2654435761u + (uint64_t)from * 40503u + (uint64_t)to * 9973u + (uint64_t)tag * 977u;
    return (int64_t)(h % 100); /* 0..99: exact in every dtype, u8 and i8 included */
}

static void put(void *buf, size_t i, ddp_dtype t, int64_t v) {
    switch (t) {
    case DDP_F32: ((float *)buf)[i] = (float)v; break;
    case DDP_F64: ((double *)buf)[i] = (double)v; break;
    case DDP_F16: ((uint16_t *)buf)[i] = ddp_f32_to_f16((float)v); break;
    case DDP_BF16: ((uint16_t *)buf)[i] = ddp_f32_to_bf16((float)v); break;
    case DDP_I8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case DDP_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case DDP_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    default: ((int64_t *)buf)[i] = v; break;
    }
}

static int64_t get(const void *buf, size_t i, ddp_dtype t) {
    switch (t) {
    case DDP_F32: return (int64_t)((const float *)buf)[i];
    case DDP_F64: return (int64_t)((const double *)buf)[i];
    case DDP_F16: return (int64_t)ddp_f16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_BF16: return (int64_t)ddp_bf16_to_f32(((const uint16_t *)buf)[i]);
    case DDP_I8: return ((const int8_t *)buf)[i];
    case DDP_U8: return ((const uint8_t *)buf)[i];
    case DDP_I32: return ((const int32_t *)buf)[i];
    default: return ((const int64_t *)buf)[i];
    }
}

/* Check n elements of buf at element offset `at` against what `from` sent `to` (indices from 0). */
static void expect_block(const void *buf, size_t at, size_t n, ddp_dtype t, int from, int to, int tag, const char *what) {
    size_t i;
    for (i = 0; i < n; i++) {
        int64_t want = value(from, to, i, tag), got = get(buf, at + i, t);
        CHECK(got == want, "%s (%s): element %zu of the block from rank %d to rank %d is %lld, expected %lld", what,
              ddp_dtype_name(t), i, from, to, (long long)got, (long long)want);
    }
}

/* all_to_all_v's split sizes: rank `from` sends rank `to` this many elements (zeros included). */
static size_t split(int from, int to, size_t base) { return base ? (size_t)((from * 7 + to * 3) % 5) * base / 2 : 0; }
/* all_gather_v's counts: rank r's block (rank 1's is empty). */
static size_t gcount(int r, size_t base) { return r == 1 ? 0 : base + (size_t)r * 3; }

/* Run a call synchronously (async 0) or as its _async variant followed by ddp_wait. */
#define RUN(async, sync_call, async_call, g)  \
    do {                                      \
        if (async) {                          \
            ddp_work *w_ = NULL;              \
            CHECK_OK(async_call, g);          \
            CHECK_OK(ddp_wait(w_), g);        \
        } else {                              \
            CHECK_OK(sync_call, g);           \
        }                                     \
    } while (0)

/* The buffers of the calls below: from ddp_alloc on lib_group when it is set, else malloc. */
static ddp_group *lib_group;
static unsigned char *xbuf(size_t bytes) {
    unsigned char *p = lib_group ? (unsigned char *)ddp_alloc(lib_group, bytes) : (unsigned char *)tl_xalloc(bytes);
    CHECK(p != NULL, "ddp_alloc of %zu bytes: %s", bytes, ddp_last_error(lib_group));
    return p;
}
static void xfree(void *p) {
    if (lib_group) ddp_free(lib_group, p);
    else free(p);
}

static void rooted(ddp_group *g, int rank, int n, ddp_dtype t, size_t count, int async, int in_place, int tag) {
    size_t es = ddp_dtype_size(t), i;
    unsigned char *all = xbuf(count * es * (size_t)n + 1), *one = xbuf(count * es + 1);
    int root = tag % n, r;
    char what[96];
    /* gather: rank r's block (what r sends root) lands at r*count on the root */
    for (i = 0; i < count; i++) put(in_place && rank == root ? all + (size_t)root * count * es : one, i, t, value(rank, root, i, tag));
    snprintf(what, sizeof what, "gather root %d count %zu%s%s", root, count, async ? " async" : "", in_place ? " in place" : "");
    {
        const void *send = in_place && rank == root ? all + (size_t)root * count * es : one;
        void *recv = rank == root ? all : NULL;
        RUN(async, ddp_gather(g, send, recv, count, t, root), ddp_gather_async(g, send, recv, count, t, root, &w_), g);
    }
    if (rank == root)
        for (r = 0; r < n; r++) expect_block(all, (size_t)r * count, count, t, r, root, tag, what);
    /* scatter: root's block r goes to rank r */
    tag++;
    memset(one, 0xEE, count * es);
    if (rank == root)
        for (r = 0; r < n; r++)
            for (i = 0; i < count; i++) put(all, (size_t)r * count + i, t, value(root, r, i, tag));
    snprintf(what, sizeof what, "scatter root %d count %zu%s%s", root, count, async ? " async" : "", in_place ? " in place" : "");
    {
        void *recv = in_place && rank == root ? all + (size_t)root * count * es : one;
        const void *send = rank == root ? all : NULL;
        RUN(async, ddp_scatter(g, send, recv, count, t, root), ddp_scatter_async(g, send, recv, count, t, root, &w_), g);
        expect_block(recv, 0, count, t, root, rank, tag, what);
    }
    xfree(all);
    xfree(one);
}

static void all_to_all(ddp_group *g, int rank, int n, ddp_dtype t, size_t count, int async, int in_place, int tag) {
    size_t es = ddp_dtype_size(t), i;
    unsigned char *send = xbuf(count * es * (size_t)n + 1), *recv = in_place ? send : xbuf(count * es * (size_t)n + 1);
    int r;
    char what[96];
    for (r = 0; r < n; r++)
        for (i = 0; i < count; i++) put(send, (size_t)r * count + i, t, value(rank, r, i, tag));
    snprintf(what, sizeof what, "all_to_all count %zu%s%s", count, async ? " async" : "", in_place ? " in place" : "");
    RUN(async, ddp_all_to_all(g, send, recv, count, t), ddp_all_to_all_async(g, send, recv, count, t, &w_), g);
    for (r = 0; r < n; r++) expect_block(recv, (size_t)r * count, count, t, r, rank, tag, what);
    if (!in_place) xfree(recv);
    xfree(send);
}

static void all_to_all_v(ddp_group *g, int rank, int n, ddp_dtype t, size_t base, int async, int tag) {
    size_t es = ddp_dtype_size(t), sc[TL_MAX_RANKS], rc[TL_MAX_RANKS], stot = 0, rtot = 0, at, i;
    unsigned char *send, *recv;
    int r;
    char what[96];
    for (r = 0; r < n; r++) {
        sc[r] = split(rank, r, base), rc[r] = split(r, rank, base);
        stot += sc[r], rtot += rc[r];
    }
    send = xbuf(stot * es + 1), recv = xbuf(rtot * es + 1);
    for (r = 0, at = 0; r < n; at += sc[r], r++)
        for (i = 0; i < sc[r]; i++) put(send, at + i, t, value(rank, r, i, tag));
    snprintf(what, sizeof what, "all_to_all_v base %zu%s", base, async ? " async" : "");
    RUN(async, ddp_all_to_all_v(g, send, sc, recv, rc, t), ddp_all_to_all_v_async(g, send, sc, recv, rc, t, &w_), g);
    for (r = 0, at = 0; r < n; at += rc[r], r++) expect_block(recv, at, rc[r], t, r, rank, tag, what);
    xfree(send);
    xfree(recv);
}

static void all_gather_v(ddp_group *g, int rank, int n, ddp_dtype t, size_t base, int async, int in_place, int tag) {
    size_t es = ddp_dtype_size(t), counts[TL_MAX_RANKS], tot = 0, mine = 0, at, i;
    unsigned char *recv, *send;
    int r;
    char what[96];
    for (r = 0; r < n; r++) {
        counts[r] = gcount(r, base);
        if (r < rank) mine += counts[r];
        tot += counts[r];
    }
    recv = xbuf(tot * es + 1);
    send = in_place ? recv + mine * es : xbuf(counts[rank] * es + 1);
    for (i = 0; i < counts[rank]; i++) put(send, i, t, value(rank, -1, i, tag));
    snprintf(what, sizeof what, "all_gather_v base %zu%s%s", base, async ? " async" : "", in_place ? " in place" : "");
    RUN(async, ddp_all_gather_v(g, send, counts[rank], recv, counts, t),
        ddp_all_gather_v_async(g, send, counts[rank], recv, counts, t, &w_), g);
    for (r = 0, at = 0; r < n; at += counts[r], r++) expect_block(recv, at, counts[r], t, r, -1, tag, what);
    if (!in_place) xfree(send);
    xfree(recv);
}

static void bytes(ddp_group *g, int rank, int n, size_t size, int async, int tag) {
    int root = (tag / 3) % n;
    unsigned char *data = NULL;
    size_t got = 12345, i;
    void *p;
    if (rank == root) {
        data = tl_xalloc(size + 1);
        for (i = 0; i < size; i++) data[i] = (unsigned char)value(root, -2, i, tag);
        got = size;
    }
    p = data;
    RUN(async, ddp_broadcast_bytes(g, &p, &got, root), ddp_broadcast_bytes_async(g, &p, &got, root, &w_), g);
    CHECK(got == size, "broadcast_bytes: rank %d got size %zu, root %d sent %zu", rank, got, root, size);
    CHECK(p != NULL, "broadcast_bytes: rank %d got a NULL buffer for %zu bytes", rank, size);
    for (i = 0; i < size; i++)
        CHECK(((unsigned char *)p)[i] == (unsigned char)value(root, -2, i, tag), "broadcast_bytes: byte %zu on rank %d", i, rank);
    if (rank == root) {
        CHECK(p == data, "broadcast_bytes: the root's pointer changed");
        free(data);
    } else {
        ddp_free_bytes(p);
    }
}

static void point_to_point(ddp_group *g, int rank, int n);

static int worker(int rank, int n, void *arg) {
    static const size_t counts[] = {0, 1, 5, 3000};
    ddp_group *g;
    size_t di, ci;
    int tag = 0, async;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (di = 0; di < NDT; di++)
        for (ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
            for (async = 0; async < 2; async++) {
                int in_place = (int)((di + ci) & 1);
                tag += 7;
                rooted(g, rank, n, dtypes[di], counts[ci], async, in_place, tag);
                all_to_all(g, rank, n, dtypes[di], counts[ci], async, in_place, tag + 2);
                all_to_all_v(g, rank, n, dtypes[di], counts[ci], async, tag + 3);
                all_gather_v(g, rank, n, dtypes[di], counts[ci], async, in_place, tag + 4);
                if (di == 0) bytes(g, rank, n, counts[ci] * 3, async, tag + 5);
            }
    point_to_point(g, rank, n);
    CHECK_OK(ddp_monitored_barrier(g, 30), g);
    { /* async calls queued back to back, then waited in order */
        float a[8], b[8 * TL_MAX_RANKS / 64 + 8];
        ddp_work *w1, *w2;
        int i;
        for (i = 0; i < 8; i++) a[i] = (float)(rank * 10 + i);
        CHECK(n <= 8, "the queued check assumes at most 8 ranks");
        CHECK_OK(ddp_gather_async(g, a, rank == 0 ? b : NULL, 1, DDP_F32, 0, &w1), g);
        CHECK_OK(ddp_monitored_barrier_async(g, 10, &w2), g);
        CHECK_OK(ddp_wait(w1), g);
        CHECK_OK(ddp_wait(w2), g);
        for (i = 0; rank == 0 && i < n; i++) CHECK(b[i] == (float)(i * 10), "queued gather: element %d is %g", i, b[i]);
    }
    { /* all_to_all_v does not run in place: overlapping buffers are refused before anything is sent */
        float buf[4 * 8];
        size_t c1[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        CHECK(ddp_all_to_all_v(g, buf, c1, buf, c1, DDP_F32) == DDP_ERR_INVALID_ARGUMENT &&
                  strstr(ddp_last_error(NULL), "overlap"),
              "overlapping all_to_all_v buffers: %s", ddp_last_error(NULL));
        CHECK_OK(ddp_barrier(g), g); /* the group is fine */
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* ---- point-to-point ---- */

/* Messages around the ring (each rank sends to rank + 1 before it receives from rank - 1), every dtype,
   counts 0 / 1 / uneven / 1 MiB (a send that cannot fit the socket buffers while its receiver sends
   too), tags taken out of order, and a message that crosses a collective on its way. */
static void point_to_point(ddp_group *g, int rank, int n) {
    static const size_t counts[] = {0, 1, 7, 1 << 18};
    int right = (rank + 1) % n, left = (rank + n - 1) % n, tag = 100;
    size_t di, ci;
    if (n < 2) return;
    for (di = 0; di < NDT; di++)
        for (ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
            ddp_dtype t = dtypes[di];
            size_t count = counts[ci], es = ddp_dtype_size(t), i;
            unsigned char *out = tl_xalloc(count * es + 1), *in = tl_xalloc(count * es + 1);
            char what[64];
            if (count > 1000 && di > 1) { free(out), free(in); continue; } /* large: f32 and f64 */
            tag++;
            for (i = 0; i < count; i++) put(out, i, t, value(rank, right, i, tag));
            snprintf(what, sizeof what, "send/recv around the ring, count %zu", count);
            CHECK_OK(ddp_send(g, out, count, t, right, tag), g);
            CHECK_OK(ddp_recv(g, in, count, t, left, tag), g);
            expect_block(in, 0, count, t, left, rank, tag, what);
            free(out);
            free(in);
        }
    /* two tags, received in the other order; the second message crosses an all_reduce */
    if (rank == 0) {
        int64_t a = 11, b = 22;
        float x = 1;
        CHECK_OK(ddp_send(g, &a, 1, DDP_I64, 1, 1), g);
        CHECK_OK(ddp_send(g, &b, 1, DDP_I64, 1, 2), g);
        CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM), g);
    } else {
        int64_t a = 0, b = 0;
        float x = 1;
        if (rank == 1) CHECK_OK(ddp_recv(g, &b, 1, DDP_I64, 0, 2), g);
        CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM), g);
        if (rank == 1) {
            CHECK_OK(ddp_recv(g, &a, 1, DDP_I64, 0, 1), g);
            CHECK(a == 11 && b == 22, "tags out of order: got %lld and %lld, want 11 and 22", (long long)a, (long long)b);
        }
        CHECK(x == (float)n, "the all_reduce between the messages gave %g", x);
    }
    /* isend / irecv: every rank posts its irecv before its isend (the pattern a queue would deadlock), small
       and 1 MiB, waited in either order */
    {
        static const size_t sizes[] = {3, 1 << 18};
        size_t si, i;
        for (si = 0; si < 2; si++) {
            size_t count = sizes[si];
            float *out = (float *)tl_xalloc(count * 4), *in = (float *)tl_xalloc(count * 4);
            ddp_work *wr, *ws;
            tag++;
            for (i = 0; i < count; i++) out[i] = (float)value(rank, right, i, tag);
            CHECK_OK(ddp_irecv(g, in, count, DDP_F32, left, tag, &wr), g);
            CHECK_OK(ddp_isend(g, out, count, DDP_F32, right, tag, &ws), g);
            CHECK_OK(ddp_wait(count > 3 ? ws : wr), g);
            CHECK_OK(ddp_wait(count > 3 ? wr : ws), g);
            expect_block(in, 0, count, DDP_F32, left, rank, tag, "irecv before isend around the ring");
            free(out);
            free(in);
        }
    }
    /* an irecv posted before a barrier whose sender sends after it; ddp_test polls another until it comes */
    {
        int64_t got = -1, got2 = -1, mine = 1000 + rank;
        ddp_work *w;
        int polls = 0;
        CHECK_OK(ddp_irecv(g, &got, 1, DDP_I64, left, 7, &w), g);
        CHECK_OK(ddp_barrier(g), g);
        CHECK_OK(ddp_send(g, &mine, 1, DDP_I64, right, 7), g);
        CHECK_OK(ddp_wait(w), g);
        CHECK(got == 1000 + left, "irecv across a barrier: %lld", (long long)got);
        CHECK_OK(ddp_irecv(g, &got2, 1, DDP_I64, left, 8, &w), g);
        if (rank % 2 == 0) usleep(20000); /* half the ranks send late */
        CHECK_OK(ddp_send(g, &mine, 1, DDP_I64, right, 8), g);
        while (!ddp_test(w)) polls++;
        CHECK_OK(ddp_wait(w), g);
        CHECK(got2 == 1000 + left, "irecv finished by ddp_test: %lld (after %d polls)", (long long)got2, polls);
    }
    /* bad arguments are refused without breaking the group */
    CHECK(ddp_send(g, &tag, 1, DDP_I32, rank, 0) == DDP_ERR_INVALID_ARGUMENT, "send to itself: %s", ddp_last_error(g));
    CHECK(ddp_recv(g, &tag, 1, DDP_I32, n, 0) == DDP_ERR_INVALID_ARGUMENT, "recv from rank n: %s", ddp_last_error(g));
    CHECK(ddp_send(g, &tag, 1, DDP_I32, right, -1) == DDP_ERR_INVALID_ARGUMENT, "negative tag: %s", ddp_last_error(g));
    CHECK_OK(ddp_barrier(g), g);
}

/* ---- failures ---- */

/* ddp_init, then a barrier: the scenarios' failing call is then collective #2 of the program. A rank
   still finishing #1 when a faster rank finds the mismatch at #2 fails in #1 (tcp.c, point 3), with the
   same code and message: the scenarios pass that result on instead of making their call. */
static ddp_group *join(ddp_result *first) {
    ddp_group *g;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    *first = ddp_barrier(g);
    return g;
}
#define AFTER_JOIN(first, call) ((first) != DDP_SUCCESS ? (first) : (call))

/* The call ended with `want` on this rank, and the message says `needle`. */
static void expect_failure(ddp_result got, ddp_result want, const char *needle, int rank, const char *what) {
    CHECK(got == want, "%s: rank %d got %s (%s), expected %s", what, rank, ddp_result_string(got), ddp_last_error(NULL),
          ddp_result_string(want));
    CHECK(strstr(ddp_last_error(NULL), needle), "%s: rank %d's message does not say \"%s\": %s", what, rank, needle,
          ddp_last_error(NULL));
}

static int root_mismatch(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    float x[8] = {0}, all[8 * 8];
    (void)arg;
    ddp_result r;
    g = join(&first);
    /* the last rank names another root: every rank fails, none waits for a parent that never sends.
       Over shared memory a small scatter runs ahead (src/shm.c, "Running ahead"): the root waits for
       nobody and the others for the root alone, so a call may return before its rank has compared every
       fingerprint; then its next call must fail. */
    r = AFTER_JOIN(first, ddp_scatter(g, all, x, 1, DDP_F32, rank == n - 1 ? 1 : 0));
    if (r == DDP_SUCCESS && strcmp(getenv("DDP_TRANSPORT"), "tcp") != 0)
        expect_failure(ddp_barrier(g), DDP_ERR_MISMATCH, "mismatch", rank, "the call after a scatter with two roots");
    else
        expect_failure(r, DDP_ERR_MISMATCH, "mismatch", rank, "scatter with two roots");
    ddp_destroy(g);
    return 0;
}

/* Running ahead (src/shm.c): small gathers and scatters let their writers return at once, up to a
   ring of slots ahead. Runs of 100 calls alike (scatter from rank 0, gather to rank 1, ...) whose
   consumers start 50 ms late, so the writers fill the ring and must wait for slots to free; the roots
   rotate (every rank writes and reads), an all_reduce every 137 calls makes every rank catch up, and
   every block of every call is compared with the serial reference. A writer that reused a slot too
   early, or a reader that read one too late, shows as a wrong block. */
static int run_ahead(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    int64_t send[8 * 5], recv[8 * 5], sum;
    int call, i, j;
    (void)arg;
    g = join(&first);
    CHECK_OK(first, g);
    for (call = 0; call < 600; call++) {
        int root = (call / 100) % n, scatter = (call / 100) % 2 == 0, cpr = 1 + call % 5;
        int late = (call % 100 == 0) && (scatter ? rank != root : rank == root);
        if (late) usleep(50 * 1000); /* the consumers come late: the writers run ahead until the ring is full */
        if (scatter) {
            for (j = 0; j < n && rank == root; j++)
                for (i = 0; i < cpr; i++) send[j * cpr + i] = value(root, j, (size_t)i, call);
            CHECK_OK(ddp_scatter(g, send, recv, (size_t)cpr, DDP_I64, root), g);
            expect_block(recv, 0, (size_t)cpr, DDP_I64, root, rank, call, "scatter running ahead");
        } else {
            for (i = 0; i < cpr; i++) send[i] = value(rank, root, (size_t)i, call);
            CHECK_OK(ddp_gather(g, send, recv, (size_t)cpr, DDP_I64, root), g);
            for (j = 0; j < n && rank == root; j++) expect_block(recv, (size_t)j * cpr, (size_t)cpr, DDP_I64, j, root, call, "gather running ahead");
        }
        for (i = 0; i < 8 * 5; i++) send[i] = -1; /* the writer's buffer is its own again at once */
        if (call % 137 == 136) {
            sum = rank;
            CHECK_OK(ddp_all_reduce(g, &sum, 1, DDP_I64, DDP_SUM), g);
            CHECK(sum == (int64_t)n * (n - 1) / 2, "all_reduce between run-ahead calls: %lld", (long long)sum);
        }
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Mismatched roots never deliver wrong data (README, "errors"): ranks call the same gather or scatter
   with different roots. Small calls over shared memory run ahead, so a rank may return DDP_SUCCESS and
   get DDP_ERR_MISMATCH from its next collective (a barrier here); every rank gets it at the call or
   there. Meanwhile every receive buffer (filled with a sentinel first, also on ranks that are not a
   root in their own view) holds, block by block, either the untouched sentinel or exactly what a
   correct call with this rank's root delivers there: a gather root's block j is what rank j sends that
   root, a scatter's buffer what that root sends this rank (value() depends on both ends, so data meant
   for another root would show). The cases: 2, 3 and 4 ranks; roots that make every rank a root, none,
   or some; counts that go through the ring slots (running ahead) and one that goes in steps. */
typedef struct root_case {
    int scatter, n, roots[4];
    size_t count;
} root_case;
static const root_case root_cases[] = {
    {1, 2, {0, 1}, 1},       {1, 2, {1, 0}, 3},       {1, 3, {0, 0, 1}, 5},    {1, 3, {0, 1, 2}, 2},
    {1, 3, {2, 0, 0}, 4},    {1, 4, {0, 0, 0, 1}, 1}, {1, 4, {1, 1, 0, 0}, 7}, {1, 4, {3, 2, 1, 0}, 3},
    {1, 4, {2, 2, 2, 0}, 100},
    {0, 2, {0, 1}, 1},       {0, 2, {1, 0}, 3},       {0, 3, {0, 0, 1}, 5},    {0, 3, {0, 1, 2}, 2},
    {0, 3, {2, 0, 0}, 4},    {0, 4, {0, 0, 0, 1}, 1}, {0, 4, {1, 1, 0, 0}, 7}, {0, 4, {3, 2, 1, 0}, 3},
    {0, 4, {1, 2, 2, 2}, 300},
};
#define N_ROOT_CASES (sizeof root_cases / sizeof root_cases[0])
#define SENTINEL (-7)

/* The n elements of buf at `at`: all the sentinel (1), all what `from` sends `to` (2), or neither (0). */
static int block_state(const int64_t *buf, size_t at, size_t n, int from, int to, int tag) {
    size_t i, sentinel = 0, right = 0;
    for (i = 0; i < n; i++) {
        sentinel += buf[at + i] == SENTINEL;
        right += buf[at + i] == value(from, to, i, tag);
    }
    return sentinel == n ? 1 : right == n ? 2 : 0;
}

static int root_data(int rank, int n, void *arg) {
    const root_case *rc = (const root_case *)arg;
    const int root = rc->roots[rank], tag = (int)(rc - root_cases) + 1000;
    const size_t count = rc->count;
    const char *kind = rc->scatter ? "scatter" : "gather";
    int64_t send[4 * 300], recv[4 * 300];
    ddp_group *g;
    ddp_result first, r, at;
    size_t i;
    int j, st;
    g = join(&first);
    CHECK_OK(first, g);
    for (i = 0; i < 4 * 300; i++) send[i] = -1, recv[i] = SENTINEL;
    if (rc->scatter) {
        for (j = 0; j < n && rank == root; j++)
            for (i = 0; i < count; i++) send[(size_t)j * count + i] = value(root, j, i, tag);
        r = ddp_scatter(g, rank == root ? send : NULL, recv, count, DDP_I64, root);
    } else {
        for (i = 0; i < count; i++) send[i] = value(rank, root, i, tag);
        r = ddp_gather(g, send, recv, count, DDP_I64, root); /* recv also on the others: it must stay untouched */
    }
    at = r; /* where the error surfaced: at the call, or at the next collective */
    if (r == DDP_SUCCESS) {
        CHECK(rc->scatter || rank != root, "%s with roots differing on %d ranks: rank %d returned success as a gather root",
              kind, n, rank);
        r = ddp_barrier(g);
    }
    expect_failure(r, DDP_ERR_MISMATCH, "mismatch", rank, at == DDP_SUCCESS ? "the call after a gather or scatter with "
                   "another root on some rank" : "gather or scatter with another root on some rank");
    /* only now look: after the error, wherever it surfaced */
    if (rc->scatter) {
        st = block_state(recv, 0, count, root, rank, tag);
        CHECK(st, "scatter (count %zu) on %d ranks, rank %d (root %d): its receive buffer holds neither the sentinel nor "
              "root %d's block for it", count, n, rank, root, root);
    } else {
        for (j = 0; j < n; j++) {
            st = block_state(recv, (size_t)j * count, count, j, root, tag);
            CHECK(rank == root ? st != 0 : st == 1, "gather (count %zu) on %d ranks, rank %d (root %d): block %d of its "
                  "receive buffer %s", count, n, rank, root, j, rank == root ? "holds neither the sentinel nor what "
                  "that rank sends this root" : "was written, but this rank is not its root");
        }
    }
    for (i = (rc->scatter ? 1 : (size_t)n) * count; i < 4 * 300; i++)
        CHECK(recv[i] == SENTINEL, "%s on %d ranks, rank %d: element %zu past the receive buffer's end was written", kind,
              n, rank, i);
    ddp_destroy(g);
    return 0;
}

/* Every root_case, each in fresh processes, over the transport that DDP_TRANSPORT names. */
static void root_data_cases(const char *transport) {
    size_t k;
    for (k = 0; k < N_ROOT_CASES; k++)
        CHECK(tl_run_ranks(root_cases[k].n, root_data, (void *)&root_cases[k], 60) == 0,
              "%s with roots %d %d %d %d on %d ranks, count %zu, over %s: no rank may get wrong data",
              root_cases[k].scatter ? "scatter" : "gather", root_cases[k].roots[0], root_cases[k].roots[1],
              root_cases[k].roots[2], root_cases[k].roots[3], root_cases[k].n, root_cases[k].count, transport);
}

static int split_mismatch(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    size_t sc[TL_MAX_RANKS], rc[TL_MAX_RANKS];
    float send[3 * TL_MAX_RANKS] = {0}, recv[3 * TL_MAX_RANKS];
    int r;
    (void)arg;
    g = join(&first);
    for (r = 0; r < n; r++) sc[r] = rc[r] = 2;
    if (rank == 1) sc[n - 1] = 3; /* rank 1 sends the last rank 3 elements; it expects 2 */
    expect_failure(AFTER_JOIN(first, ddp_all_to_all_v(g, send, sc, recv, rc, DDP_F32)), DDP_ERR_MISMATCH,
                   "split sizes differ", rank, "all_to_all_v with a wrong split size");
    if (rank == n - 1 || rank == 1)
        CHECK(strstr(ddp_last_error(NULL), "rank 1 sends 3 elements"), "rank %d: the message does not name both sizes: %s",
              rank, ddp_last_error(NULL));
    ddp_destroy(g);
    return 0;
}

static int counts_mismatch(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    size_t counts[8];
    float send[8] = {0}, recv[64];
    int r;
    (void)arg;
    g = join(&first);
    for (r = 0; r < n; r++) counts[r] = 2;
    if (rank == 0) counts[n - 1] = 3, counts[n - 2] = 1; /* same total, different counts */
    expect_failure(AFTER_JOIN(first, ddp_all_gather_v(g, send, counts[rank], recv, counts, DDP_F32)), DDP_ERR_MISMATCH, "counts differ", rank,
                   "all_gather_v with different counts");
    ddp_destroy(g);
    return 0;
}

/* The last rank does not come to the monitored barrier; rank 0 names it within the barrier's timeout
   and every rank that came fails with that message. */
static int monitored_missing(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    double t0;
    ddp_result r;
    float x[TL_MAX_RANKS] = {0}, y;
    g = join(&first);
    /* arg: the others first make a small scatter, which runs ahead of the missing rank over shared
       memory; what rank 0 owes for it must not hold monitored_barrier past its timeout */
    if (arg && rank != n - 1) CHECK_OK(AFTER_JOIN(first, ddp_scatter(g, x, &y, 1, DDP_F32, 0)), g);
    if (rank == n - 1) {
        sleep(4); /* busy elsewhere, then finds the group broken */
        r = AFTER_JOIN(first, ddp_barrier(g));
        CHECK(r != DDP_SUCCESS, "the late rank's barrier succeeded after the monitored barrier failed");
        ddp_destroy(g);
        return 0;
    }
    t0 = tl_now();
    r = AFTER_JOIN(first, ddp_monitored_barrier(g, 1.0));
    expect_failure(r, DDP_ERR_TIMEOUT, "did not arrive", rank, "monitored_barrier with a rank missing");
    {
        char needle[32];
        snprintf(needle, sizeof needle, "rank %d (", n - 1);
        CHECK(strstr(ddp_last_error(NULL), needle), "rank %d: the message does not name rank %d: %s", rank, n - 1,
              ddp_last_error(NULL));
    }
    CHECK(tl_now() - t0 < 3.5, "rank %d: monitored_barrier(1 s) took %.1f s to fail", rank, tl_now() - t0);
    ddp_destroy(g);
    return 0;
}

/* A recv whose count differs from its send's, and a recv that meets the peer's next collective instead
   of the message: DDP_ERR_MISMATCH, on the receiver at once and on every rank by the next call. */
static int p2p_mismatch(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first, r;
    float x[8] = {0};
    int which = *(int *)arg;
    g = join(&first);
    if (which == 0) { /* sizes */
        if (rank == 0) CHECK(AFTER_JOIN(first, ddp_send(g, x, 5, DDP_F32, 1, 3)) == DDP_SUCCESS, "send: %s", ddp_last_error(g));
        if (rank == 1) {
            r = AFTER_JOIN(first, ddp_recv(g, x, 4, DDP_F32, 0, 3));
            expect_failure(r, DDP_ERR_MISMATCH, "rank 0 sent 5 elements of f32 with tag 3 where this rank expects 4", rank,
                           "recv of another count");
        }
    } else { /* rank 0 goes on to a barrier without sending what rank 1 waits for */
        if (rank == 1) {
            r = AFTER_JOIN(first, ddp_recv(g, x, 4, DDP_F32, 0, 3));
            expect_failure(r, DDP_ERR_MISMATCH, "before sending what this rank's recv", rank, "recv that meets a barrier");
        }
    }
    r = rank == 1 ? ddp_barrier(g) : AFTER_JOIN(first, ddp_barrier(g)); /* every rank learns of it here at the latest */
    expect_failure(r, rank == 1 ? DDP_ERR_STATE : DDP_ERR_MISMATCH,
                   rank == 1 ? "broken" : which == 0 ? "where this rank expects 4" : "before sending", rank,
                   "the next call after a point-to-point mismatch");
    (void)n;
    ddp_destroy(g);
    return 0;
}

/* A rank that calls another collective at the same number (over shared memory, the others' call
   runs over the mesh after one step in the segment): DDP_ERR_MISMATCH on every rank. */
static int kind_mismatch(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_result first;
    float x[64] = {0}, y[64];
    size_t counts[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    (void)arg;
    g = join(&first);
    if (rank == n - 1)
        expect_failure(AFTER_JOIN(first, ddp_all_reduce(g, x, 4, DDP_F32, DDP_SUM)), DDP_ERR_MISMATCH, "mismatch", rank,
                       "all_reduce against all_gather_v");
    else
        expect_failure(AFTER_JOIN(first, ddp_all_gather_v(g, x, 1, y, counts, DDP_F32)), DDP_ERR_MISMATCH, "mismatch", rank,
                       "all_gather_v against all_reduce");
    ddp_destroy(g);
    return 0;
}

/* Large calls over shared memory (issue #19: src/shm.c's own algorithms instead of TCP): blocks of
   70,001 and 100,000 elements (all_gather_v: 3x; whole buffers above the single-copy size at every world
   size; staged in several rounds when in place at 8 ranks, and at 8 ranks with DDP_SHM_CMA=0), on
   ddp_alloc and on malloc buffers, against the serial reference; on library buffers gather, scatter,
   all_to_all_v, all_gather_v and (not in place) all_to_all must say at debug level that they went
   single-copy on every rank. */
static int single_copies; /* debug messages of this process saying a collective ran single-copy */
static void watch_log(ddp_log_level level, int rank, const char *msg, void *user) {
    (void)user;
    if (strstr(msg, "single-copy")) __atomic_add_fetch(&single_copies, 1, __ATOMIC_RELAXED);
    else if (level <= DDP_LOG_WARN) fprintf(stderr, "[ddp rank %d] %s\n", rank, msg);
}

static int big_worker(int rank, int n, void *arg) {
    static const ddp_dtype big_dtypes[] = {DDP_F32, DDP_F16};
    static const size_t big_counts[] = {100000, 70001};
    ddp_group *g = tl_init_logged(watch_log);
    int lib, d, in_place, tag = 9000;
    (void)arg;
    for (lib = 0; lib < 2; lib++)
        for (d = 0; d < 2; d++)
            for (in_place = 0; in_place < 2; in_place++) {
                int before = __atomic_load_n(&single_copies, __ATOMIC_RELAXED), want = 4 + !in_place;
                lib_group = lib ? g : NULL;
                tag += 7;
                rooted(g, rank, n, big_dtypes[d], big_counts[d], in_place, in_place, tag);
                all_to_all(g, rank, n, big_dtypes[d], big_counts[d], !in_place, in_place, tag + 2);
                all_to_all_v(g, rank, n, big_dtypes[d], big_counts[d], in_place, tag + 3);
                all_gather_v(g, rank, n, big_dtypes[d], big_counts[d] * 3, !in_place, in_place, tag + 4);
                if (lib)
                    CHECK(__atomic_load_n(&single_copies, __ATOMIC_RELAXED) - before >= want, "rank %d of %d: gather, scatter, "
                          "all_to_all(_v) and all_gather_v of %zu elements%s on ddp_alloc buffers: %d of them said single-copy, want %d", rank, n,
                          big_counts[d], in_place ? " (in place)" : "", __atomic_load_n(&single_copies, __ATOMIC_RELAXED) - before,
                          want);
            }
    lib_group = NULL;
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* After the sweep's runs over shared memory on 2 or more ranks: the large calls (big_worker). */
static void big_runs(int n, int t) {
    int cma;
    if (t != 0 || n < 2) return;
    for (cma = 1; cma >= (n == 8 ? 0 : 1); cma--) { /* plain buffers staged in rounds at 8 ranks */
        double t0 = tl_now();
        setenv("DDP_SHM_CMA", cma ? "1" : "0", 1);
        CHECK(tl_run_ranks(n, big_worker, NULL, 600) == 0, "large calls, world size %d over shared memory%s failed", n,
              cma ? "" : " with DDP_SHM_CMA=0");
        printf("world size %d over shared memory%s: gather, scatter, all_to_all(_v), all_gather_v of 70,001-300,000 "
               "elements per rank, library and plain buffers, match the serial reference, single-copy on library "
               "buffers (%.1f s)\n", n, cma ? "" : " (DDP_SHM_CMA=0)", tl_now() - t0);
    }
    unsetenv("DDP_SHM_CMA");
}

int main(int argc, char **argv) {
    int i, t;
    setenv("DDP_TIMEOUT", "60", 0);
    if (argc > 1 && strcmp(argv[1], "--root-data") == 0) { /* only the mismatched-root data check, N times */
        int times = argc > 2 ? atoi(argv[2]) : 1;
        setenv("DDP_TIMEOUT", "20", 1);
        for (i = 0; i < times; i++)
            for (t = 0; t < 2; t++) {
                setenv("DDP_TRANSPORT", tl_transport(t), 1);
                root_data_cases(tl_transport(t));
            }
        printf("mismatched roots: no wrong data, DDP_ERR_MISMATCH on every rank (%d rounds)\n", times);
        return 0;
    }
    tl_sweep(argc, argv, worker, 600, "gather, scatter, all_to_all(_v), all_gather_v, broadcast_bytes, monitored_barrier "
             "match the serial reference", big_runs);
    setenv("DDP_TIMEOUT", "20", 1);
    for (t = 0; t < 2; t++) {
        setenv("DDP_TRANSPORT", tl_transport(t), 1);
        CHECK(tl_run_ranks(4, root_mismatch, NULL, 60) == 0, "root mismatch over %s", tl_transport(t));
        root_data_cases(tl_transport(t));
        for (i = 2; i <= 3; i++) /* at 2 ranks a scatter's other rank owes nothing; at 3 it owes the third */
            CHECK(tl_run_ranks(i, run_ahead, NULL, 60) == 0, "small gathers and scatters running ahead on %d ranks over %s", i,
                  tl_transport(t));
        CHECK(tl_run_ranks(4, split_mismatch, NULL, 60) == 0, "split-size mismatch over %s", tl_transport(t));
        /* above 32 ranks shared memory checks rows and columns, not the whole matrix (src/shm.c) */
        CHECK(tl_run_ranks(34, split_mismatch, NULL, 120) == 0, "split-size mismatch on 34 ranks over %s", tl_transport(t));
        CHECK(tl_run_ranks(3, counts_mismatch, NULL, 60) == 0, "counts mismatch over %s", tl_transport(t));
        CHECK(tl_run_ranks(4, monitored_missing, NULL, 60) == 0, "monitored_barrier with a rank missing over %s", tl_transport(t));
        if (t == 0)
            CHECK(tl_run_ranks(4, monitored_missing, &t, 60) == 0, "monitored_barrier with a rank missing after a small scatter");
        CHECK(tl_run_ranks(4, kind_mismatch, NULL, 60) == 0, "all_gather_v against all_reduce over %s", tl_transport(t));
        {
            int which;
            for (which = 0; which < 2; which++)
                CHECK(tl_run_ranks(3, p2p_mismatch, &which, 60) == 0, "point-to-point mismatch %d over %s", which, tl_transport(t));
        }
        printf("over %s: roots, split sizes, counts and calls that differ are DDP_ERR_MISMATCH on every rank; "
               "monitored_barrier names the missing rank\n", tl_transport_name(t));
    }
    return 0;
}
