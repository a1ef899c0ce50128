/* libFuzzer target for what a peer rank can send on the mesh (src/transport.c): the first bytes of the
   input are the frame header this rank just received while running a collective (all_reduce of 100
   f32, collective #5); the rest is what the peer's connection holds after it (an ABORT's message,
   a data payload to skip, more frames) before the peer hangs up. Every outcome must be a clean
   result -- success, DDP_ERR_FORMAT, MISMATCH, PEER_LOST or the code an ABORT carries -- with a
   message, and nothing may crash, leak, read past what arrived, or trip the sanitizers.
   Build and bounded run: tests/test_fuzz_protocols.sh. */
#define DDP_IMPLEMENTATION
#include "ddp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static ddp_group *group(void) {
    static ddp_group *g;
    if (!g) g = ddp__group_alloc(0, 2);
    if (!g) abort();
    g->log_level = DDP_LOG_NONE;
    g->broken = DDP_SUCCESS;
    g->broken_msg[0] = '\0';
    g->mesh.peers[1].gone = 0;
    g->mesh.peers[1].send_owed = 0;
    return g;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ddp__frame f;
    ddp__coll c;
    ddp_group *g = group();
    int sv[2];
    ddp_result r;
    if (size < sizeof f) return 0;
    memcpy(&f, data, sizeof f);
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) abort();
    /* the rest arrives and the peer hangs up (inputs are small: the socket buffer holds them) */
    if (size > sizeof f && write(sv[1], data + sizeof f, size - sizeof f) != (ssize_t)(size - sizeof f)) abort();
    close(sv[1]);
    g->mesh.peers[1].fd = sv[0];
    memset(&c, 0, sizeof c);
    c.seq = 5;
    c.count = 100;
    c.kind = DDP__ALL_REDUCE;
    c.dtype = DDP_F32;
    c.op = DDP_SUM;
    c.root = -1;
    r = ddp__check_frame(g, &c, 1, &f, 400);
    if (r != DDP_SUCCESS && (!g->broken || !g->broken_msg[0] || g->broken != r)) abort();
    if (r == DDP_SUCCESS && (f.magic != DDP__FRAME_MAGIC || f.kind != DDP__FRAME_DATA || f.bytes != 400)) abort();
    close(sv[0]);
    g->mesh.peers[1].fd = -1;
    return 0;
}
