/* libFuzzer target for the store server's request handling (src/store_server.c): what a hostile or broken
   client can send. The input is cut into messages for two in-memory connections (no sockets): each
   piece starts with one control byte, whose low bit picks the connection and whose other bits how
   many of the following bytes arrive now (so requests are also seen split across reads, and a WAIT on
   one connection is woken by a SET on the other). Nothing may crash, leak, trip the sanitizers, or
   hold more than the server's budget; dropped clients are fine (that is the server refusing).
   Build and bounded run: tests/test_fuzz_protocols.sh. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static ddp__store_conn *fake_conn(ddp__store_server *s) {
    ddp__store_conn *c = (ddp__store_conn *)ddp__calloc(1, sizeof *c);
    if (!c) abort();
    c->fd = -1;
    snprintf(c->peer, sizeof c->peer, "fuzz");
    if (ddp__srv_room_for_client(s) != 0) abort(); /* the server's own arrays: conns and the round's touched list */
    c->slot = s->nconns;
    s->conns[s->nconns++] = c;
    s->buffers += sizeof *c;
    return c;
}

/* What the server's read loop does with bytes that arrived: append, then handle complete requests. */
static void deliver(ddp__store_server *s, ddp__store_conn *c, const uint8_t *p, size_t n) {
    if (c->dead || n == 0) return;
    if (c->in_cap - c->in_len < n && ddp__srv_grow(s, c, &c->in, &c->in_cap, c->in_len + n) != 0) return;
    memcpy(c->in + c->in_len, p, n);
    c->in_len += n;
    ddp__srv_process(s, c);
    c->out_off = c->out_len; /* the client read every reply */
    while (c->ready && !c->dead) {
        ddp__srv_process(s, c);
        c->out_off = c->out_len;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ddp__store_server *s = (ddp__store_server *)ddp__calloc(1, sizeof *s);
    ddp__store_conn *c[2];
    size_t at = 0;
    if (!s) abort();
    s->listen_fd = s->pipe_rd = s->pipe_wr = -1;
    s->log_level = DDP_LOG_NONE;
    ddp__srv_set_budget(s, (size_t)16 << 10); /* small (a share is 2 KiB), so that refusals are reached too */
    c[0] = fake_conn(s);
    c[1] = fake_conn(s);
    while (at < size) {
        uint8_t ctl = data[at++];
        size_t n = DDP__MIN((size_t)(ctl >> 1) + 1, size - at);
        deliver(s, c[ctl & 1], data + at, n);
        at += n;
        if (s->kv.bytes + s->buffers > s->max_held) abort();
        if (c[0]->held + c[1]->held > s->kv.bytes || c[0]->held > s->share || c[1]->held > s->share) abort();
    }
    ddp__store_server_close(s); /* closes fd -1: EBADF, harmless */
    return 0;
}
