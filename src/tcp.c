/* [SECTION] tcp: the tcp backend, collective algorithms over the TCP mesh (Gloo's and MPI's ring,
   recursive-doubling and Bruck algorithms)

   Every algorithm is built from ring steps: in each step a rank sends to its right neighbour
   (rank + 1) and receives from its left (rank - 1) at the same time.

       rank 0 --> rank 1 --> rank 2 --> rank 3 --+
         ^                                       |
         +---------------------------------------+

   all_reduce = reduce-scatter then all-gather, with the buffer cut into n chunks. In the
   reduce-scatter, chunk c starts at rank c+1 and travels once around the ring, each rank adding its
   own part, and ends complete at rank c; the all-gather then passes each complete chunk around.
   Cost for N bytes on n ranks: 2(n-1) steps, each rank sending 2(n-1)/n * N bytes (bandwidth-optimal).
   Up to DDP__RD_MAX_BYTES all_reduce uses recursive doubling instead (log2(n) steps; see below).
   barrier, and broadcast up to DDP__BROADCAST_TREE_MAX_BYTES, use dissemination: ceil(log2 n) steps,
   in step k each rank sending to rank + 2^k (a binomial tree carries the broadcast's data; see below).
   all_gather up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered runs Bruck's algorithm on the same peers
   (ceil(log2 n) steps, each rank's blocks doubling; see below), the ring above. ddp_init's set-up
   gathers (the host keys, shared memory's cross-memory-attach probe, NCCL's id) are this size.

   Why a mismatch is an error on every rank (the program is wrong at collective #X: two ranks call
   something different there; transport.c explains how each rank checks what it receives):
   1. No rank finishes #X. Every algorithm here makes each rank's finish depend, through a chain of
      received frames, on every other rank having sent in #X (the ring passes data from every rank to
      every rank; recursive doubling, dissemination and Bruck's all_gather too; the chain broadcast ends
      with a token pass and reduce starts with a reduce-scatter for this). Each frame on the chain was
      checked by its receiver, so a rank that finishes proves that every rank called the same #X.
   2. Some rank sees the difference. Group the ranks by the call they make at #X. A group in which some
      rank sends without receiving first is "active": every rank of a ring algorithm (all_reduce,
      all_gather, reduce_scatter, reduce), the root of a chain broadcast, every rank of dissemination
      (barrier, small broadcast), of Bruck's all_gather and of recursive doubling (the folded pair
      2i+1 -> 2i answers at once for this reason). An active group that is not every rank sends to a
      rank outside it before it can get stuck: the first step of the ring, of dissemination and of
      Bruck's all_gather goes to rank+1; a broadcast chain passes every rank; recursive doubling's
      partners cover ever larger blocks and so leave the group. That
      frame reaches a rank waiting in #X, which checks every frame that reaches it, whichever peer it
      waits on (transport.c), and fails with DDP_ERR_MISMATCH. Every rank sends or receives something
      at #X unless every group is a chain broadcast (above DDP__BROADCAST_TREE_MAX_BYTES) whose root is
      outside it (every rank calls a large broadcast and none names itself root): that case alone ends
      in DDP_ERR_TIMEOUT.
   3. The rank that saw it breaks the group (an ABORT frame to every peer), and every rank, all stuck
      in #X by (1), fails with that code and message. A rank still finishing #X-1 when a faster rank
      finds the mismatch at #X fails there (or in ddp_init, whose own barrier comes first): the group
      is broken at once, so its last call is the one that reports it. */
#include "internal.h"

static int ddp__mod(int a, int n) { return ((a % n) + n) % n; }

/* One step of the algorithm: send `sbytes` of `sbuf` to `to` while receiving `rbytes` into `rbuf`
   from `from` (-1: no such side). */
static ddp_result ddp__send_recv(ddp_group *g, const ddp__coll *c, int to, const void *sbuf, size_t sbytes, int from,
                                 void *rbuf, size_t rbytes) {
    ddp__step st;
    memset(&st, 0, sizeof st);
    st.send_peer = to;
    st.send_buf = sbuf;
    st.send_bytes = sbytes;
    st.recv_peer = from;
    st.recv_buf = rbuf;
    st.recv_bytes = rbytes;
    return ddp__exchange(g, c, &st);
}

/* Ring reduce-scatter in place: afterwards chunk `rank` of buf is reduced over all ranks (op AVG is
   left as the sum). In step s, send chunk rank-s-1 and add the received chunk rank-s-2. */
static ddp_result ddp__ring_reduce_scatter(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t,
                                           ddp_op op) {
    int n = g->world_size, r = g->rank, s;
    size_t es = ddp_dtype_size(t), off, len, max_len = (count + (size_t)n - 1) / (size_t)n;
    char *tmp = (char *)ddp__scratch(g, max_len * es);
    if (!tmp && max_len) return ddp__no_memory(g, max_len * es);
    for (s = 0; s < n - 1; s++) {
        size_t roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 2, n), &roff, &rlen);
        if ((res = ddp__send_recv(g, c, ddp__mod(r + 1, n), buf + off * es, len * es, ddp__mod(r - 1, n), tmp, rlen * es)) !=
            DDP_SUCCESS)
            return res;
        ddp__reduce(buf + roff * es, tmp, rlen, t, op);
    }
    return DDP_SUCCESS;
}

/* Ring all-gather in place: chunk `rank` of buf is this rank's; afterwards every chunk is filled.
   In step s, send chunk rank-s and receive chunk rank-s-1 straight into place. */
static ddp_result ddp__ring_all_gather(ddp_group *g, const ddp__coll *c, char *buf, size_t count, size_t es) {
    int n = g->world_size, r = g->rank, s;
    for (s = 0; s < n - 1; s++) {
        size_t off, len, roff, rlen;
        ddp_result res;
        ddp__chunk(count, n, ddp__mod(r - s, n), &off, &len);
        ddp__chunk(count, n, ddp__mod(r - s - 1, n), &roff, &rlen);
        if ((res = ddp__send_recv(g, c, ddp__mod(r + 1, n), buf + off * es, len * es, ddp__mod(r - 1, n), buf + roff * es,
                                  rlen * es)) != DDP_SUCCESS)
            return res;
    }
    return DDP_SUCCESS;
}

/* This rank's chunk of an AVG: divide once, after the sum is complete. */
static void ddp__finish_avg(ddp_group *g, char *buf, size_t count, ddp_dtype t, ddp_op op) {
    size_t off, len;
    if (op != DDP_AVG) return;
    ddp__chunk(count, g->world_size, g->rank, &off, &len);
    ddp__divide(buf + off * ddp_dtype_size(t), len, t, g->world_size);
}

/* ---- recursive doubling (MPICH's small-message allreduce), for all_reduce up to DDP__RD_MAX_BYTES ----
   (Gloo and NCCL's tree do the same job: few steps for latency-bound sizes.)

   p = the largest power of two <= n; the first 2(n - p) ranks pair up (2i, 2i+1) and fold:

       fold:    2i --data--> 2i+1   (2i+1 answers with an empty frame, so that every rank sends first)
       rounds:  the p ranks left (new rank i = 2i+1 for i < n - p, else rank - (n - p)) exchange the
                whole buffer with new rank ^ 1, ^ 2, ^ 4 ... and combine: log2(p) rounds
       unfold:  2i+1 --result--> 2i

   Cost for N bytes: log2(p) + 2 [fold] steps, each sending N bytes (the ring: 2(n-1) steps of N/n).
   Every combine computes (lower rank's block) op (higher rank's block), so partners compute the same
   bits and every rank ends with the same result, floats included (MIN/MAX of -0.0 and +0.0 and
   NaN payloads depend on the order). AVG divides once, at the end, as the ring does.
   The threshold is measured (bench/README.md, DDP_TRANSPORT=tcp on loopback): recursive doubling took
   0.5x the ring's time up to 8 KiB and 0.85x at 32 KiB on 2 ranks, 0.4-0.6x up to 32 KiB and 0.9x at
   256 KiB on 4; the ring won from 64 KiB on 2 ranks. It is no setting: ranks that disagreed on it would
   run different algorithms for the same call, which no fingerprint catches. */


/* Combine this rank's block (buf) with the block just received from `peer` (tmp) as (lower rank's
   block) op (higher rank's block), into buf; tmp is clobbered. Both partners compute the same bits. */
static void ddp__combine_ordered(ddp_group *g, int peer, char *buf, char *tmp, size_t count, ddp_dtype t, ddp_op op) {
    if (peer > g->rank) {
        ddp__reduce(buf, tmp, count, t, op);
        return;
    }
    ddp__reduce(tmp, buf, count, t, op);
    if (count) memcpy(buf, tmp, count * ddp_dtype_size(t));
}

static int ddp__rd_old_rank(int new_rank, int extra) { return new_rank < extra ? 2 * new_rank + 1 : new_rank + extra; }

static ddp_result ddp__rd_all_reduce(ddp_group *g, const ddp__coll *c, char *buf, size_t count, ddp_dtype t, ddp_op op) {
    int n = g->world_size, r = g->rank, p = 1, extra, me, mask;
    size_t bytes = count * ddp_dtype_size(t);
    char *tmp = (char *)ddp__scratch(g, bytes);
    ddp_result res;
    if (!tmp && bytes) return ddp__no_memory(g, bytes);
    while (p * 2 <= n) p *= 2;
    extra = n - p;
    if (r < 2 * extra && r % 2 == 0) { /* folded away: hand the data over, wait for the result */
        if ((res = ddp__send_recv(g, c, r + 1, buf, bytes, r + 1, NULL, 0)) != DDP_SUCCESS) return res;
        return ddp__send_recv(g, c, -1, NULL, 0, r + 1, buf, bytes);
    }
    if (r < 2 * extra) {
        if ((res = ddp__send_recv(g, c, r - 1, NULL, 0, r - 1, tmp, bytes)) != DDP_SUCCESS) return res;
        ddp__combine_ordered(g, r - 1, buf, tmp, count, t, op);
    }
    me = r < 2 * extra ? r / 2 : r - extra;
    for (mask = 1; mask < p; mask <<= 1) {
        int peer = ddp__rd_old_rank(me ^ mask, extra);
        if ((res = ddp__send_recv(g, c, peer, buf, bytes, peer, tmp, bytes)) != DDP_SUCCESS) return res;
        ddp__combine_ordered(g, peer, buf, tmp, count, t, op);
    }
    if (op == DDP_AVG) ddp__divide(buf, count, t, n);
    if (r < 2 * extra) return ddp__send_recv(g, c, r - 1, buf, bytes, -1, NULL, 0);
    return DDP_SUCCESS;
}

/* all_reduce over TCP: recursive doubling for small messages (latency-bound: log2(n) steps), the ring
   above for the rest (bandwidth-bound). The choice depends only on the fingerprint (count, dtype) and
   the world size, so ranks that agree on the call run the same algorithm; ranks that disagree are
   caught as the comment at the top explains. */
static ddp_result ddp__do_all_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp_result r;
    if (count * ddp_dtype_size(t) <= DDP__RD_MAX_BYTES) return ddp__rd_all_reduce(g, c, (char *)buf, count, t, op);
    if ((r = ddp__ring_reduce_scatter(g, c, (char *)buf, count, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, (char *)buf, count, t, op);
    return ddp__ring_all_gather(g, c, (char *)buf, count, ddp_dtype_size(t));
}

/* Reduce to root: reduce-scatter, then every rank sends its complete chunk to the root. Non-roots
   work on a copy, since their buffer must stay unchanged. */
static ddp_result ddp__do_reduce(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, ddp_op op,
                                 int root) {
    int n = g->world_size, k;
    size_t es = ddp_dtype_size(t), off, len;
    char *work = (char *)buf;
    ddp_result r;
    if (g->rank != root) {
        size_t bytes = count * es, max_len = (count + (size_t)n - 1) / (size_t)n;
        char *mem = (char *)ddp__scratch(g, bytes + max_len * es);
        if (!mem && bytes) return ddp__no_memory(g, bytes + max_len * es);
        /* the reduce-scatter receives into the first max_len elements of the scratch; the copy follows */
        work = mem + max_len * es;
        if (bytes) memcpy(work, buf, bytes);
    }
    if ((r = ddp__ring_reduce_scatter(g, c, work, count, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, work, count, t, op);
    for (k = 0; k < n; k++) {
        ddp__step st;
        memset(&st, 0, sizeof st);
        st.send_peer = st.recv_peer = -1;
        if (k == root) continue;
        ddp__chunk(count, n, k, &off, &len);
        if (g->rank == root) {
            st.recv_peer = k;
            st.recv_buf = (char *)buf + off * es;
            st.recv_bytes = len * es;
        } else if (g->rank == k) {
            st.send_peer = root;
            st.send_buf = work + off * es;
            st.send_bytes = len * es;
        } else {
            continue;
        }
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    return DDP_SUCCESS;
}

/* ---- dissemination (Hensgen, Finkel and Manber's barrier), for barrier and small broadcasts ----

   In round k (k = 0, 1, ... while 2^k < n) every rank sends one frame to rank + 2^k and receives one
   from rank - 2^k (mod n), at the same time:

       round 0:  0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 0        (n = 6; every rank sends and receives)
       round 1:  0 -> 2, 1 -> 3, 2 -> 4, 3 -> 5, 4 -> 0, 5 -> 1
       round 2:  0 -> 4, 1 -> 5, 2 -> 0, 3 -> 1, 4 -> 2, 5 -> 3

   After round k a rank has heard, through a chain of frames, from the 2^(k+1) - 1 ranks before it, so
   after ceil(log2 n) rounds from every rank: no rank finishes before every rank has entered the call
   (the barrier's promise, and point 1 of the top comment), for any n, in ceil(log2 n) steps where the
   ring took n - 1.

   A small broadcast rides on the same frames: with pos = (rank - root) mod n, the ranks with
   pos < 2^k hold the data before round k, and in round k the frame from pos to pos + 2^k (when that is
   < n) carries the payload; every other frame is an empty token. The payload frames form the binomial
   tree of the root (pos 0 -> 1; 0 -> 2, 1 -> 3; 0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7 ...), each rank takes
   the data exactly once, from one sender, so it ends equal to the root's buffer, and the tokens make
   the broadcast complete only when every rank has entered it, as the chain's final token pass did.
   Every rank sends before it waits (round 0), so a broadcast meeting another call, or ranks that name
   different roots, is a mismatch that the first frames show. Cost: ceil(log2 n) steps, each rank
   sending at most ceil(log2 n) payloads; above DDP__BROADCAST_TREE_MAX_BYTES the pipelined chain below
   moves the data instead (each link carries it once). */
static ddp_result ddp__dissemination(ddp_group *g, const ddp__coll *c, char *buf, size_t bytes, int root) {
    int n = g->world_size, r = g->rank, pos = ddp__mod(r - root, n), dist;
    ddp_result res;
    for (dist = 1; dist < n; dist *= 2) {
        int gives = pos < dist && pos + dist < n, takes = pos >= dist && pos < 2 * dist;
        if ((res = ddp__send_recv(g, c, ddp__mod(r + dist, n), buf, gives ? bytes : 0, ddp__mod(r - dist, n), buf,
                                  takes ? bytes : 0)) != DDP_SUCCESS)
            return res;
    }
    return DDP_SUCCESS;
}

/* Broadcast of large messages: a pipelined chain root -> root+1 -> ... -> root-1 in slices, so every
   link carries the data once and the slices overlap; then a token goes from the last rank through the
   root to the others, so that no rank finishes before every rank has checked its neighbour's
   fingerprint. */
#define DDP__BROADCAST_SLICE ((size_t)256 << 10)
static ddp_result ddp__chain_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t bytes, int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n);
    int left = ddp__mod(g->rank - 1, n), right = ddp__mod(g->rank + 1, n);
    size_t i, slices = bytes ? (bytes + DDP__BROADCAST_SLICE - 1) / DDP__BROADCAST_SLICE : 1;
    char *p = (char *)buf;
    ddp__step st;
    ddp_result r;
    /* Step i: the root sends slice i; the others receive slice i and forward slice i-1. */
    for (i = 0; i <= slices; i++) {
        size_t send_slice = pos == 0 ? i : i - 1;
        int sends = pos < n - 1 && (pos == 0 ? i < slices : i >= 1);
        int receives = pos > 0 && i < slices;
        memset(&st, 0, sizeof st);
        st.send_peer = st.recv_peer = -1;
        if (sends) {
            size_t o = send_slice * DDP__BROADCAST_SLICE;
            st.send_peer = right;
            st.send_buf = p + o;
            st.send_bytes = DDP__MIN(DDP__BROADCAST_SLICE, bytes - o);
        }
        if (receives) {
            size_t o = i * DDP__BROADCAST_SLICE;
            st.recv_peer = left;
            st.recv_buf = p + o;
            st.recv_bytes = DDP__MIN(DDP__BROADCAST_SLICE, bytes - o);
        }
        if ((sends || receives) && (r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    /* The token: last -> root -> root+1 -> ... -> root-2; each rank passes it on after receiving it. */
    memset(&st, 0, sizeof st);
    st.send_peer = -1;
    if (pos != n - 1) {
        st.recv_peer = left;
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    st.recv_peer = -1;
    if (pos == n - 1 || pos < n - 2) {
        st.send_peer = right;
        if ((r = ddp__exchange(g, c, &st)) != DDP_SUCCESS) return r;
    }
    return DDP_SUCCESS;
}

/* Broadcast: the binomial tree on dissemination's frames up to DDP__BROADCAST_TREE_MAX_BYTES
   (latency-bound: ceil(log2 n) steps), the pipelined chain above (bandwidth-bound). Like all_reduce's
   threshold, the choice depends only on the fingerprint and the world size, and is no setting. */
static ddp_result ddp__do_broadcast(ddp_group *g, const ddp__coll *c, void *buf, size_t count, ddp_dtype t, int root) {
    size_t bytes = count * ddp_dtype_size(t);
    if (bytes <= DDP__BROADCAST_TREE_MAX_BYTES) return ddp__dissemination(g, c, (char *)buf, bytes, root);
    return ddp__chain_broadcast(g, c, buf, bytes, root);
}

/* ---- Bruck's all_gather (Bruck et al. 1997; MPICH's MPIR_Allgather_intra_brucks), for all_gather up
   to DDP__ALLGATHER_BRUCK_MAX_BYTES in all ----

   A rank gathers the blocks of the ranks before it, in a work buffer of n blocks filled from its end:
   its own block goes last (slot n-1), and after the round with distance d it holds the 2d blocks of
   ranks rank-2d+1 .. rank in slots n-2d .. n-1. In the round with distance d = 1, 2, 4 ... (d <= n/2)
   every rank sends its d blocks to rank + d and receives rank - d's d blocks (ranks rank-2d+1 ..
   rank-d) into the d slots before them; when n is no power of two a last round with d = p (the largest
   power of two <= n) moves the rem = n - p blocks still missing (the sender's last rem slots, received
   into slots 0 .. rem-1):

       n = 5, rank 3     slots 0 1 2 3 4      (r-k: rank 3-k's block)
       start                     . . . . 3
       d = 1, from 2             . . . 2 3
       d = 2, from 1             . 0 1 2 3
       d = 4 (rem 1), from 4     4 0 1 2 3    then rotate: slot s holds rank (rank + 1 + s) mod n

   ceil(log2 n) rounds, the peers those of dissemination (rank + 2^k, so a barrier's connections serve
   too), each rank sending n-1 blocks in all as in the ring (n-1 rounds of one block). Two copies of the
   result's bytes are the price (into the work buffer, and the rotation out of it), so the ring stays
   above the threshold. Every rank sends in round 0 before it waits, and its finish depends on every
   rank's block (each reaches it through a chain of frames), as the top comment needs.
   The threshold is measured (bench/README.md, DDP_TRANSPORT=tcp on loopback, Bruck's against the ring
   at one revision): Bruck's took 0.75-0.9x the ring's time up to 32 KiB gathered on 4 ranks, 0.55-0.7x
   up to 64 KiB on 8, 0.3-0.4x on 16; the ring won from 128 KiB on 4 ranks, 256 KiB on 8, 1 MiB on 16
   (MPICH's own line is 80 KiB). On 2 ranks both are one and the same exchange, and the ring saves
   the copies. Like the other thresholds it is no setting. */
static ddp_result ddp__bruck_all_gather(ddp_group *g, const ddp__coll *c, const void *send, char *recv, size_t cpr,
                                        size_t es) {
    int n = g->world_size, r = g->rank, d, head;
    size_t block = cpr * es, total = block * (size_t)n;
    char *work = (char *)ddp__scratch(g, total);
    ddp_result res;
    if (!work && total) return ddp__no_memory(g, total);
    if (block) memcpy(work + (size_t)(n - 1) * block, send, block);
    for (d = 1; d < n; d *= 2) {
        /* we and rank - d hold d blocks each; we miss n - d (fewer than d only in the last round) */
        int blocks = DDP__MIN(d, n - d);
        const char *out = work + (size_t)(n - blocks) * block; /* the sender's last `blocks` slots */
        char *in = work + (size_t)(n - d - blocks) * block;     /* just before the d we hold */
        if ((res = ddp__send_recv(g, c, ddp__mod(r + d, n), out, (size_t)blocks * block, ddp__mod(r - d, n), in,
                                  (size_t)blocks * block)) != DDP_SUCCESS)
            return res;
    }
    /* slot s holds rank (r + 1 + s) mod n: slots 0 .. n-r-2 are ranks r+1 .. n-1, the rest 0 .. r */
    head = n - r - 1;
    if (total) {
        memcpy(recv + (size_t)(r + 1) * block, work, (size_t)head * block);
        memcpy(recv, work + (size_t)head * block, (size_t)(r + 1) * block);
    }
    return DDP_SUCCESS;
}

/* all_gather: Bruck's in ceil(log2 n) steps up to DDP__ALLGATHER_BRUCK_MAX_BYTES gathered (latency-bound:
   ddp_init's set-up gathers are this size) on more than 2 ranks, else our part in place in recv and the
   ring with chunks of count_per_rank. The choice depends only on the fingerprint and the world size,
   like all_reduce's. */
static ddp_result ddp__do_all_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr, ddp_dtype t) {
    size_t es = ddp_dtype_size(t);
    char *mine = (char *)recv + (size_t)g->rank * cpr * es;
    if (g->world_size > 2 && cpr * es * (size_t)g->world_size <= DDP__ALLGATHER_BRUCK_MAX_BYTES)
        return ddp__bruck_all_gather(g, c, send, (char *)recv, cpr, es);
    if (cpr && (const char *)send != mine) memmove(mine, send, cpr * es);
    return ddp__ring_all_gather(g, c, (char *)recv, cpr * (size_t)g->world_size, es);
}

/* reduce_scatter: reduce-scatter a copy of send (send is const and may alias recv), keep our chunk. */
static ddp_result ddp__do_reduce_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t cpr,
                                         ddp_dtype t, ddp_op op) {
    size_t es = ddp_dtype_size(t), total = cpr * (size_t)g->world_size;
    char *mem = (char *)ddp__scratch(g, (cpr + total) * es), *work;
    ddp_result r;
    if (!mem && total) return ddp__no_memory(g, (cpr + total) * es);
    work = mem + cpr * es; /* the reduce-scatter receives into the first cpr elements of the scratch */
    if (total) memcpy(work, send, total * es);
    if ((r = ddp__ring_reduce_scatter(g, c, work, total, t, op)) != DDP_SUCCESS) return r;
    ddp__finish_avg(g, work, total, t, op);
    if (cpr) memcpy(recv, work + (size_t)g->rank * cpr * es, cpr * es);
    return DDP_SUCCESS;
}

/* barrier: dissemination with empty frames; each rank finishes only after hearing (through a chain
   of frames) from every other rank, in ceil(log2 n) steps. */
static ddp_result ddp__do_barrier(ddp_group *g, const ddp__coll *c) { return ddp__dissemination(g, c, NULL, 0, 0); }

/* ---- gather and scatter: binomial trees (MPICH's), after an agreement ----

   The data moves on the binomial tree of the root over the positions pos = (rank - root) mod n: a rank
   at pos holds the blocks of positions pos .. pos + m - 1, m being the lowest set bit of pos (all n at
   the root). gather: in the round with distance d = 1, 2, 4 ..., a rank whose pos has bit d sends what
   it holds to pos - d and is done; the others receive pos + d's blocks behind their own. scatter runs
   the same tree the other way, largest distance first. Cost: ceil(log2 n) rounds, the root's link
   carrying (n-1) blocks as in a linear algorithm; a rank forwards at most its subtree.

   The tree alone would break the top comment's two points: in a gather, a leaf finishes as soon as it
   has sent, and ranks that disagree about the root could all wait on a parent that never sends. So
   both first run an agreement on the call (dissemination with empty frames, as barrier: every rank
   sends before it waits, and none finishes before every rank has entered the same call, root and
   count included). Past it nothing can differ: the sizes follow from the fingerprint. */
static ddp_result ddp__agree(ddp_group *g, const ddp__coll *c) { return ddp__dissemination(g, c, NULL, 0, 0); }

/* Blocks held by the rank at position pos in a binomial tree over n positions (the root's subtree is all). */
static int ddp__tree_blocks(int pos, int n) { return pos == 0 ? n : DDP__MIN(pos & -pos, n - pos); }

/* Relative order (block i is rank (root + i) mod n) <-> rank order, between two buffers of n blocks. */
static void ddp__rotate_blocks(char *dst, const char *src, int root, int n, size_t block, int to_rank_order) {
    size_t head = (size_t)(n - root) * block, tail = (size_t)root * block; /* ranks root .. n-1, then 0 .. root-1 */
    if (to_rank_order) {
        memcpy(dst + tail, src, head);
        memcpy(dst, src + head, tail);
    } else {
        memcpy(dst, src + tail, head);
        memcpy(dst + head, src, tail);
    }
}

static ddp_result ddp__do_gather(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count, ddp_dtype t,
                                 int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n), have = 1, d;
    size_t block = count * ddp_dtype_size(t), need = (size_t)ddp__tree_blocks(pos, n) * block;
    char *work = pos == 0 && root == 0 ? (char *)recv : (char *)ddp__scratch(g, need);
    ddp_result r;
    if (!work && need) return ddp__no_memory(g, need);
    if ((r = ddp__agree(g, c)) != DDP_SUCCESS) return r;
    if (block && work != (const char *)send) memmove(work, send, block); /* in place on root 0: already there */
    for (d = 1; d < n; d *= 2) {
        if (pos & d) return ddp__send_recv(g, c, ddp__mod(pos - d + root, n), work, (size_t)have * block, -1, NULL, 0);
        if (pos + d < n) {
            int blocks = DDP__MIN(d, n - pos - d);
            if ((r = ddp__send_recv(g, c, -1, NULL, 0, ddp__mod(pos + d + root, n), work + (size_t)have * block,
                                    (size_t)blocks * block)) != DDP_SUCCESS)
                return r;
            have += blocks;
        }
    }
    if (work != (char *)recv && block) ddp__rotate_blocks((char *)recv, work, root, n, block, 1);
    return DDP_SUCCESS;
}

static ddp_result ddp__do_scatter(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count, ddp_dtype t,
                                  int root) {
    int n = g->world_size, pos = ddp__mod(g->rank - root, n), blocks = ddp__tree_blocks(pos, n), d;
    size_t block = count * ddp_dtype_size(t), need = (size_t)blocks * block;
    const char *work = (const char *)send;
    ddp_result r;
    if (pos != 0 || root != 0) { /* the root other than 0 reorders; the others receive their subtree's blocks */
        char *tmp = blocks == 1 ? (char *)recv : (char *)ddp__scratch(g, need);
        if (!tmp && need) return ddp__no_memory(g, need);
        if (pos == 0 && block) ddp__rotate_blocks(tmp, (const char *)send, root, n, block, 0);
        work = tmp;
    }
    if ((r = ddp__agree(g, c)) != DDP_SUCCESS) return r;
    if (pos != 0) {
        int up = pos & -pos;
        if ((r = ddp__send_recv(g, c, -1, NULL, 0, ddp__mod(pos - up + root, n), (void *)work, need)) != DDP_SUCCESS) return r;
    }
    for (d = 1; d < blocks; d *= 2) /* the largest distance below the subtree's size first */
        ;
    for (d /= 2; d >= 1; d /= 2) { /* the child at pos + d (< n: d < blocks <= n - pos) */
        if ((r = ddp__send_recv(g, c, ddp__mod(pos + d + root, n), work + (size_t)d * block,
                                (size_t)DDP__MIN(d, n - pos - d) * block, -1, NULL, 0)) != DDP_SUCCESS)
            return r;
    }
    if (block && work != (const char *)recv) memmove(recv, work, block); /* in place on root 0: already there */
    return DDP_SUCCESS;
}

/* ---- all_to_all, all_to_all_v, all_gather_v ----

   all_to_all: pairwise exchange (MPICH's and Gloo's for large messages): in step k = 1 .. n-1 rank r
   sends its block for r + k and receives the block of r - k. Every rank sends before it waits and hears
   from every other rank directly, so the top comment's points hold without more. Only the peers of a
   rank's own steps are dialed: all n - 1 of them, as all_to_all needs.
   all_to_all_v runs the same steps with each pair's own sizes. The sizes are the one thing the
   fingerprint cannot carry (they differ by rank), so each frame's size is checked by its receiver
   against its recv_counts (transport.c: DDP_ERR_MISMATCH naming both), and an agreement ends the
   call: a rank that found a wrong size broke the group before it, so nobody finishes. all_gather_v
   moves rank r's counts[r] elements around the ring (n - 1 steps, each block passing every link once),
   then agrees the same way (the fingerprint carries the sum of the counts, not each one). */

/* Where each of n blocks of the given sizes starts, as elements (n + 1 entries; NULL when out of memory). */
static size_t *ddp__displacements(const size_t *counts, int n) {
    size_t *at = (size_t *)ddp__malloc(((size_t)n + 1) * sizeof *at);
    int i;
    if (!at) return NULL;
    at[0] = 0;
    for (i = 0; i < n; i++) at[i + 1] = at[i] + counts[i]; /* validated: the sums fit */
    return at;
}

/* The pairwise steps; send_at / recv_at NULL: blocks of `count` elements. */
static ddp_result ddp__pairwise(ddp_group *g, const ddp__coll *c, const char *send, const size_t *send_at, char *recv,
                                const size_t *recv_at, size_t count, size_t es) {
    int n = g->world_size, r = g->rank, k;
    for (k = 1; k < n; k++) {
        int to = ddp__mod(r + k, n), from = ddp__mod(r - k, n);
        size_t so = send_at ? send_at[to] : (size_t)to * count, sn = send_at ? send_at[to + 1] - send_at[to] : count;
        size_t ro = recv_at ? recv_at[from] : (size_t)from * count, rn = recv_at ? recv_at[from + 1] - recv_at[from] : count;
        ddp_result res = ddp__send_recv(g, c, to, send + so * es, sn * es, from, recv + ro * es, rn * es);
        if (res) return res;
    }
    return DDP_SUCCESS;
}

static ddp_result ddp__do_all_to_all(ddp_group *g, const ddp__coll *c, const void *send, void *recv, size_t count,
                                     ddp_dtype t) {
    size_t es = ddp_dtype_size(t), block = count * es, all = block * (size_t)g->world_size;
    const char *from = (const char *)send;
    if (from < (const char *)recv + all && (const char *)recv < from + all && all) { /* in place: send a copy */
        char *copy = (char *)ddp__scratch(g, all);
        if (!copy) return ddp__no_memory(g, all);
        memcpy(copy, send, all);
        from = copy;
    }
    if (block && from + (size_t)g->rank * block != (const char *)recv + (size_t)g->rank * block)
        memcpy((char *)recv + (size_t)g->rank * block, from + (size_t)g->rank * block, block);
    return ddp__pairwise(g, c, from, NULL, (char *)recv, NULL, count, es);
}

static ddp_result ddp__do_all_to_all_v(ddp_group *g, const ddp__coll *c, const void *send, const size_t *send_counts,
                                       void *recv, const size_t *recv_counts, ddp_dtype t) {
    size_t es = ddp_dtype_size(t), *send_at = ddp__displacements(send_counts, g->world_size);
    size_t *recv_at = ddp__displacements(recv_counts, g->world_size);
    int r = g->rank;
    ddp_result res = DDP_SUCCESS;
    if (!send_at || !recv_at) {
        res = ddp__no_memory(g, 2 * ((size_t)g->world_size + 1) * sizeof(size_t));
    } else {
        if (send_counts[r]) memmove((char *)recv + recv_at[r] * es, (const char *)send + send_at[r] * es, send_counts[r] * es);
        if ((res = ddp__pairwise(g, c, (const char *)send, send_at, (char *)recv, recv_at, 0, es)) == DDP_SUCCESS)
            res = ddp__agree(g, c);
    }
    ddp__free(send_at);
    ddp__free(recv_at);
    return res;
}

static ddp_result ddp__do_all_gather_v(ddp_group *g, const ddp__coll *c, const void *send, void *recv, const size_t *counts,
                                       ddp_dtype t) {
    int n = g->world_size, r = g->rank, s;
    size_t es = ddp_dtype_size(t), *at = ddp__displacements(counts, n);
    char *out = (char *)recv;
    ddp_result res = DDP_SUCCESS;
    if (!at) return ddp__no_memory(g, ((size_t)n + 1) * sizeof *at);
    if (counts[r] && (const char *)send != out + at[r] * es) memmove(out + at[r] * es, send, counts[r] * es);
    for (s = 0; s < n - 1 && res == DDP_SUCCESS; s++) {
        int give = ddp__mod(r - s, n), take = ddp__mod(r - s - 1, n);
        res = ddp__send_recv(g, c, ddp__mod(r + 1, n), out + at[give] * es, counts[give] * es, ddp__mod(r - 1, n),
                             out + at[take] * es, counts[take] * es);
    }
    ddp__free(at);
    return res == DDP_SUCCESS ? ddp__agree(g, c) : res;
}

/* ---- monitored_barrier (torch's, over Gloo: rank 0 hears from every rank, then answers each) ----
   Every other rank sends rank 0 an empty frame and waits for its answer. Rank 0 takes the frames rank
   by rank until timeout_seconds have passed; after that a rank whose frame is not already there
   counts as missing. None missing: rank 0 answers every rank (they return). Some missing: rank 0 fails
   naming them all, and breaking the group sends its message to every rank connected to it: all that
   arrived (they dialed it to report). The others wait the timeout and the group's timeout beyond it. */
static ddp_result ddp__do_monitored_barrier(ddp_group *g, const ddp__coll *c, double seconds) {
    int n = g->world_size, j, missing = 0, unlisted = 0;
    double wait = seconds > 0 ? seconds : g->timeout, until = ddp__now() + wait;
    char list[DDP__ERR_MAX / 2] = "", name[DDP__PEER_NAME_MAX], more[48] = "";
    ddp__step st;
    ddp_result r;
    memset(&st, 0, sizeof st);
    st.send_peer = st.recv_peer = -1;
    if (g->rank != 0) {
        if ((r = ddp__send_recv(g, c, 0, NULL, 0, -1, NULL, 0)) != DDP_SUCCESS) return r;
        st.recv_peer = 0;
        st.deadline = ddp__now() + wait + g->timeout;
        return ddp__exchange(g, c, &st);
    }
    for (j = 1; j < n; j++) {
        st.recv_peer = j;
        st.deadline = DDP__MAX(until, ddp__now() + (g->mesh.peers[j].fd >= 0 ? 0.01 : 0));
        st.soft = 1;
        r = ddp__exchange(g, c, &st);
        if (r == DDP_ERR_TIMEOUT && !g->broken) { /* name as many as fit, then count the rest */
            size_t len = strlen(list);
            if (len + 100 < sizeof list)
                snprintf(list + len, sizeof list - len, "%s%d (%.80s)", missing ? ", " : "", j,
                         ddp__peer_name(g, j, name, sizeof name));
            else
                unlisted++;
            missing++;
        } else if (r) {
            return r;
        }
    }
    if (unlisted) snprintf(more, sizeof more, " and %d more", unlisted);
    if (missing)
        return ddp__coll_fail(g, DDP_ERR_TIMEOUT, "monitored_barrier: %d of %d ranks did not arrive within %.3g s: rank%s "
                              "%s%s. Every rank must call it; look at what those ranks were doing (DDP_TRACE_DIR, "
                              "ddprun's summary)", missing, n, wait, missing > 1 ? "s" : "", list, more);
    for (j = 1; j < n; j++)
        if ((r = ddp__send_recv(g, c, j, NULL, 0, -1, NULL, 0)) != DDP_SUCCESS) return r;
    return DDP_SUCCESS;
}

/* ---- the backend ---- */

static ddp_result ddp__tcp_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    switch (k->kind) {
    case DDP__ALL_REDUCE: return ddp__do_all_reduce(g, c, k->buf, k->count, k->dtype, k->op);
    case DDP__BROADCAST: return ddp__do_broadcast(g, c, k->buf, k->count, k->dtype, k->root);
    case DDP__REDUCE: return ddp__do_reduce(g, c, k->buf, k->count, k->dtype, k->op, k->root);
    case DDP__ALL_GATHER: return ddp__do_all_gather(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__REDUCE_SCATTER: return ddp__do_reduce_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->op);
    case DDP__BARRIER: return ddp__do_barrier(g, c);
    case DDP__GATHER: return ddp__do_gather(g, c, k->send, k->buf, k->count, k->dtype, k->root);
    case DDP__SCATTER: return ddp__do_scatter(g, c, k->send, k->buf, k->count, k->dtype, k->root);
    case DDP__ALL_TO_ALL: return ddp__do_all_to_all(g, c, k->send, k->buf, k->count, k->dtype);
    case DDP__ALL_TO_ALL_V: return ddp__do_all_to_all_v(g, c, k->send, k->send_counts, k->buf, k->recv_counts, k->dtype);
    case DDP__ALL_GATHER_V: return ddp__do_all_gather_v(g, c, k->send, k->buf, k->recv_counts, k->dtype);
    case DDP__MONITORED_BARRIER: return ddp__do_monitored_barrier(g, c, k->seconds);
    default: return ddp__coll_fail(g, DDP_ERR_STATE, "internal error: unknown collective %d", (int)k->kind);
    }
}

static void ddp__tcp_backend_close(ddp_group *g, int orderly) { (void)g, (void)orderly; } /* the mesh is group.c's */

/* Every group starts on it (set-up runs over the mesh) and keeps it when its ranks share no host. */
static const ddp__backend ddp__backend_tcp = {
    "tcp", "cpu", ddp__tcp_run, NULL, NULL, NULL, ddp__tcp_backend_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out,
    ddp__host_accumulate,
    NULL, NULL, NULL, NULL};

/* A single rank has nobody to talk to: only the data movement of the collective remains. */
static ddp_result ddp__alone_run(ddp_group *g, const ddp__call *k, const ddp__coll *c) {
    size_t bytes = k->count * ddp_dtype_size(k->dtype);
    (void)g, (void)c;
    if (k->kind == DDP__ALL_TO_ALL_V) bytes = k->send_counts[0] * ddp_dtype_size(k->dtype); /* = recv_counts[0] */
    switch (k->kind) {
    case DDP__ALL_GATHER:
    case DDP__REDUCE_SCATTER:
    case DDP__GATHER:
    case DDP__SCATTER:
    case DDP__ALL_TO_ALL:
    case DDP__ALL_TO_ALL_V:
    case DDP__ALL_GATHER_V:
        if (bytes && k->send != k->buf) memmove(k->buf, k->send, bytes);
        break;
    default: break;
    }
    return DDP_SUCCESS;
}

static void ddp__alone_close(ddp_group *g, int orderly) { (void)g, (void)orderly; }

/* A group of one rank: no mesh. */
static const ddp__backend ddp__backend_alone = {
    "alone", "cpu", ddp__alone_run, NULL, NULL, NULL, ddp__alone_close,
    ddp__host_alloc, ddp__host_release, ddp__host_zero, ddp__host_copy_in_scaled, ddp__host_copy_out,
    ddp__host_accumulate,
    NULL, NULL, NULL, NULL};

static const ddp__backend *ddp__initial_backend(int world_size) {
    return world_size > 1 ? &ddp__backend_tcp : &ddp__backend_alone;
}

/* ---- set-up collectives over the mesh (ddp__collective_on with this backend) ---- */

static ddp_result ddp__mesh_all_gather(ddp_group *g, const void *send, void *recv, size_t count, ddp_dtype t) {
    ddp__call k = ddp__make_call(DDP__ALL_GATHER, send, recv, count, t, DDP_SUM, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_broadcast(ddp_group *g, void *buf, size_t count, ddp_dtype t, int root) {
    ddp__call k = ddp__make_call(DDP__BROADCAST, NULL, buf, count, t, DDP_SUM, root);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_all_reduce(ddp_group *g, void *buf, size_t count, ddp_dtype t, ddp_op op) {
    ddp__call k = ddp__make_call(DDP__ALL_REDUCE, NULL, buf, count, t, op, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
static ddp_result ddp__mesh_barrier(ddp_group *g) {
    ddp__call k = ddp__make_call(DDP__BARRIER, NULL, NULL, 0, DDP_U8, DDP_SUM, -1);
    return ddp__collective_on(g, &ddp__backend_tcp, &k);
}
