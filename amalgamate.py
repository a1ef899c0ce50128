#!/usr/bin/env python3
"""Pack the pieces under src/ into the single header ddp.h.

    python3 amalgamate.py           # write ddp.h
    python3 amalgamate.py --check   # exit 1 if ddp.h differs from a fresh build

The manifest below is the order of the header. Public declarations come first, inside the
include guard; the implementation follows under DDP_IMPLEMENTATION. A piece may say
`#include "internal.h"` (or any other src/ file) so that editors and linters understand it on
its own; such local includes are dropped here, since the manifest already orders the pieces.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# Public API: every declaration a user program sees.
PUBLIC = [
    "src/ddp_api.h",        # version, results, dtypes, ops, logging, groups, collectives, store, launch
    "src/reducer.h",        # [SECTION] reducer: DistributedDataParallel's gradient Reducer
    "src/sampler.h",        # [SECTION] sampler: torch.utils.data.distributed.DistributedSampler
    "src/syncbn.h",         # [SECTION] syncbn: torch.nn.SyncBatchNorm
    "src/checkpoint.h",     # [SECTION] checkpoint: safetensors save/load, resume state
    "src/cuda_api.h",       # [SECTION] cuda: entry points implemented in ddp_cuda.cu
]
# Implementation: compiled once, in the file that defines DDP_IMPLEMENTATION.
IMPLEMENTATION = [
    "src/internal.h",       # includes, allocator hooks, private types shared by the pieces
    "src/util.c",           # [SECTION] util: errors, logging, environment parsing, time
    "src/dtype.c",          # [SECTION] dtype: sizes, f16/bf16 conversion, element-wise reduction
    "src/net.c",            # [SECTION] net: sockets with deadlines
    "src/auth.c",           # [SECTION] auth: DDP_AUTH_TOKEN, HMAC-SHA256 challenge on every connection
    "src/store.c",          # [SECTION] store: rendezvous key-value store (c10d TCPStore protocol), file store
    "src/transport.c",      # [SECTION] transport: framed messages between ranks, abort propagation
    "src/collectives.c",    # [SECTION] collectives: validation, fingerprints, dispatch, async work
    "src/tcp.c",            # [SECTION] tcp: the tcp backend, ring and recursive doubling over the mesh
    "src/alloc.c",          # [SECTION] alloc: ddp_alloc, library buffers in shared-memory arenas
    "src/shm.c",            # [SECTION] shm: the shared-memory backend within one host
    "src/hier.c",           # [SECTION] hier: the hierarchical backend for groups spanning hosts
    "src/mpi.c",            # [SECTION] mpi: the mpi backend (collectives through MPI, with -DDDP_MPI)
    "src/nccl.c",           # [SECTION] nccl: the nccl backend (NCCL on device memory, with -DDDP_CUDA)
    "src/group.c",          # [SECTION] group: ddp_init, rendezvous, the mesh, the backend, subgroups
    "src/launcher.c",       # [SECTION] launcher: ddp_spawn, ddprun
    "src/reducer.c",
    "src/sampler.c",
    "src/syncbn.c",
    "src/safetensors.c",    # [SECTION] safetensors: the file format, CRC32C, UTF-8, header parser and writer, ddp_meta
    "src/checkpoint.c",
]

LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def piece(path):
    text = (ROOT / path).read_text()
    lines = [l for l in text.splitlines() if not (LOCAL_INCLUDE.match(l) and
                                                 (ROOT / "src" / LOCAL_INCLUDE.match(l).group(1)).exists())]
    body = "\n".join(lines).strip("\n")
    return f"/* {'=' * 20} begin {path} {'=' * 20} */\n{body}\n/* {'=' * 20} end {path} {'=' * 20} */\n"


def sections():
    """The [SECTION] index at the top of ddp.h, read from the banners in the pieces."""
    found = []
    for path in PUBLIC + IMPLEMENTATION:
        for line in (ROOT / path).read_text().splitlines():
            m = re.search(r"\[SECTION\]\s*(.+?)\s*(\*/)?$", line)
            if m:
                found.append(f"   [SECTION] {m.group(1):<58} {path}")
    return "\n".join(found)


def build():
    preamble = (ROOT / "src" / "preamble.txt").read_text().rstrip("\n")
    out = [preamble.replace("@SECTIONS@", sections()), ""]
    out.append("#ifndef DDP_H_INCLUDED\n#define DDP_H_INCLUDED\n")
    out.append("#ifdef __cplusplus\nextern \"C\" {\n#endif\n")
    out += [piece(p) for p in PUBLIC]
    out.append("#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n")
    out.append("#endif /* DDP_H_INCLUDED */\n")
    out.append("#if defined(DDP_IMPLEMENTATION) && !defined(DDP__IMPLEMENTATION_DONE)\n"
               "#define DDP__IMPLEMENTATION_DONE\n")
    out += [piece(p) for p in IMPLEMENTATION]
    out.append("#endif /* DDP_IMPLEMENTATION */\n")
    return "\n".join(out)


def main():
    fresh = build()
    target = ROOT / "ddp.h"
    if "--check" in sys.argv[1:]:
        if not target.exists() or target.read_text() != fresh:
            print("ddp.h is stale: run `python3 amalgamate.py` and commit ddp.h", file=sys.stderr)
            return 1
        print("ddp.h is up to date")
        return 0
    target.write_text(fresh)
    print(f"wrote ddp.h ({fresh.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
