#!/usr/bin/env python3
"""Pack the pieces under src/ into the single header ddp.h.

    python3 amalgamate.py           # write ddp.h
    python3 amalgamate.py --check   # exit 1 if ddp.h differs from a fresh build, if the code reads an
                                    # environment variable that the header's ENVIRONMENT block omits,
                                    # or if a piece of src/ does not compile on its own

The manifest below is the order of the header. Public declarations come first, inside the
include guard; then private declarations that the implementation and ddp_cuda.cu see (a user's
program does not); the implementation follows under DDP_IMPLEMENTATION; the licence (LICENSE) ends
the file. A piece may say `#include "internal.h"` (or any other src/ file) so that editors and
linters understand it on its own; such local includes are dropped here, since the manifest already
orders the pieces.
"""
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# Public API: every declaration a user program sees.
PUBLIC = [
    "src/ddp_api.h",        # version, results, dtypes, ops, logging, groups, collectives, store, launch
    "src/amp.h",            # [SECTION] amp: torch.amp.GradScaler, the inf/NaN check, the gradient norm's parts
    "src/reducer.h",        # [SECTION] reducer: DistributedDataParallel's gradient Reducer
    "src/ft.h",             # [SECTION] ft: per-step fault tolerance: the step a view runs (the sampler uses it)
    "src/sampler.h",        # [SECTION] sampler: torch.utils.data.distributed.DistributedSampler
    "src/syncbn.h",         # [SECTION] syncbn: torch.nn.SyncBatchNorm
    "src/checkpoint.h",     # [SECTION] checkpoint: safetensors save/load, resume state
    "src/cuda_api.h",       # [SECTION] cuda: entry points implemented in ddp_cuda.cu
]
# Private declarations, for the implementation (DDP_IMPLEMENTATION) and ddp_cuda.cu (DDP__CUDA_GLUE);
# each piece guards itself, so a user's program sees none of it.
PRIVATE = [
    "src/bn_math.h",        # [SECTION] bn-math: SyncBatchNorm formulas shared by the CPU code and the kernels
    "src/cuda_glue.h",      # [SECTION] cuda-glue: the nccl backend's calls into ddp_cuda.cu (with DDP_CUDA)
]
# Implementation: compiled once, in the file that defines DDP_IMPLEMENTATION.
IMPLEMENTATION = [
    "src/internal.h",       # includes, allocator hooks, private types shared by the pieces
    "src/util.c",           # [SECTION] util: errors, logging, environment parsing, time
    "src/registry.c",       # [SECTION] registry: live groups and work handles (no use after free)
    "src/dtype.c",          # [SECTION] dtype: sizes, f16/bf16 conversion, element-wise reduction
    "src/alloc.c",          # [SECTION] alloc: ddp_alloc, library buffers in shared-memory arenas
    "src/crc32c.c",         # [SECTION] crc32c: CRC-32C (checkpoints' checksums, fault tolerance's state transfer)
    "src/net.c",            # [SECTION] net: sockets with deadlines
    "src/auth.c",           # [SECTION] auth: DDP_AUTH_TOKEN, HMAC-SHA256 challenge on every connection
    "src/store_state.h",    # [SECTION] store-state: the store's constants, its handle, the calls between its pieces
    "src/store.c",          # [SECTION] store: rendezvous key-value store (c10d TCPStore protocols), wire numbers, hash table
    "src/store_server.c",   # [SECTION] store-server: the server: one thread, an epoll loop, parsing and answering requests
    "src/store_client.c",   # [SECTION] store-client: a handle's errors, the TCP client of either protocol
    "src/store_file.c",     # [SECTION] store-file: the file store, an append-only log under flock() (torch's FileStore)
    "src/store_api.c",      # [SECTION] store-api: ddp_store_* on either kind of handle, their argument checks
    "src/trace.c",          # [SECTION] trace: the flight recorder, each group's last collectives
    "src/timeline.c",       # [SECTION] timeline: Chrome trace events of collectives, reducer passes, saves, ranges
    "src/ft_view.h",        # [SECTION] ft-view-state: the view change's data: views, ballots, messages, a member
    "src/ft_view.c",        # [SECTION] ft-view: the view change of fault tolerance, pure (no I/O): quorum, verdict, next view
    "src/link.c",           # [SECTION] link: connections between ranks, made on first use
    "src/transport.c",      # [SECTION] transport: framed messages between ranks, abort propagation
    "src/devbuf.c",         # [SECTION] devbuf: device buffers on the cpu and mpi backends, staged through pinned host memory
    "src/hostmem.c",        # [SECTION] hostmem: the memory slots of the host backends (ddp_alloc, conversions, staging)
    "src/collectives.c",    # [SECTION] collectives: validation, fingerprints, dispatch, async work
    "src/tcp.c",            # [SECTION] tcp: the tcp backend, ring and recursive doubling over the mesh
    "src/shm.c",            # [SECTION] shm: the shared-memory backend within one host
    "src/hier.c",           # [SECTION] hier: the hierarchical backend for groups spanning hosts
    "src/mpi.c",            # [SECTION] mpi: the mpi backend (collectives through MPI, with -DDDP_MPI)
    "src/nccl.c",           # [SECTION] nccl: the nccl backend (NCCL on device memory, with -DDDP_CUDA)
    "src/launch_env.c",     # [SECTION] launch-env: rank, world size, rank 0's address from the launcher
    "src/rendezvous.c",     # [SECTION] rendezvous: records, rank 0's table, the job's identity, lost ranks
    "src/group.c",          # [SECTION] group: ddp_init, the mesh, the backend, subgroups, ddp_destroy
    "src/ft.c",             # [SECTION] ft-run: fault tolerance at run time: control connections, ddp_ft_begin/commit, new views
    "src/launcher.c",       # [SECTION] launcher: ddp_spawn, ddprun
    "src/amp.c",            # [SECTION] amp-impl: GradScaler's update, the inf/NaN check, a pass's gradient statistics
    "src/reducer_state.h",  # [SECTION] reducer-state: the Reducer's state, shared by its three pieces
    "src/reducer.c",        # [SECTION] reducer: DistributedDataParallel's Reducer: the model, finalize, buckets, timing
    "src/reducer_fsdp.c",   # [SECTION] reducer-fsdp: FSDP units: zero_stage 3's gather pool and unit gradients
    "src/reducer_zero.c",   # [SECTION] reducer-zero: ZeRO stage 1 and 2: slices of the buckets, the comm pool
    "src/reducer_pass.c",   # [SECTION] reducer-pass: backward, between passes, uneven inputs (Join)
    "src/reducer_amp.c",    # [SECTION] reducer-amp: grad_stats and loss_scale: the norm, found_inf, clipping
    "src/zero_state.c",     # [SECTION] zero-state: ZeRO-1 optimizer state consolidated on one rank, split back
    "src/sampler.c",        # [SECTION] sampler: DistributedSampler, MT19937 and torch.randperm, streaming permutation
    "src/syncbn.c",         # [SECTION] syncbn: SyncBatchNorm on the CPU, f32 data, f64 statistics
    "src/safetensors.c",    # [SECTION] safetensors: the file format, CRC32C, UTF-8, header parser and writer, ddp_meta
    "src/checkpoint.c",     # [SECTION] checkpoint: atomic save, load everywhere or broadcast, shards, keep_last, async
    "src/reshard.c",        # [SECTION] reshard: slices of global tensors, saved by N ranks and loaded by M
    "src/fsdp_checkpoint.c", # [SECTION] fsdp-checkpoint: a zero_stage 3 model saved whole, unit by unit
]

LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def piece(path):
    text = (ROOT / path).read_text()
    lines = [l for l in text.splitlines() if not (LOCAL_INCLUDE.match(l) and
                                                 (ROOT / "src" / LOCAL_INCLUDE.match(l).group(1)).exists())]
    body = "\n".join(lines).strip("\n")
    return f"/* {'=' * 20} begin {path} {'=' * 20} */\n{body}\n/* {'=' * 20} end {path} {'=' * 20} */\n"


def sections():
    """The [SECTION] index at the top of ddp.h, read from the banners in the pieces: a line that opens
    a comment with [SECTION] (a mention of a section inside a comment's text is no banner). A title
    that its first line leaves unfinished (open brackets, or a last word such as "or" or a comma)
    runs on over the banner's next lines, so that the index never cuts one mid-phrase."""
    def unfinished(title):
        return (title.count("(") > title.count(")") or title.endswith(",")
                or title.split()[-1] in ("or", "and", "of", "the", "a", "to", "in"))

    found = []
    for path in PUBLIC + PRIVATE + IMPLEMENTATION:
        lines = (ROOT / path).read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"/\*\s*\[SECTION\]\s*(.+?)\s*(\*/)?$", line)
            if not m:
                continue
            title, ended = m.group(1), bool(m.group(2))
            for more in lines[i + 1:]:
                if ended or not unfinished(title) or not more.strip():
                    break
                words = more.strip()
                ended = words.endswith("*/")
                title += " " + (words[:-2].rstrip() if ended else words)
            found.append(f"   [SECTION] {title}\n{'':<15}{path}")
    return "\n".join(found)


BANNER = re.compile(r"/\*\s*=+\s*(begin|end)\s+src/")


def banners_inside():
    """Lines of the pieces that look like the begin/end banners piece() writes: pasted from ddp.h,
    they would end up in it twice and mislead a reader about where a piece ends."""
    return [f"{path}:{n}: {line.strip()}" for path in PUBLIC + PRIVATE + IMPLEMENTATION
            for n, line in enumerate((ROOT / path).read_text().splitlines(), 1) if BANNER.search(line)]


def build():
    preamble = (ROOT / "src" / "preamble.txt").read_text().rstrip("\n")
    out = [preamble.replace("@SECTIONS@", sections()), ""]
    out.append("/* DDP_NO_IMPLEMENTATION (COMPILE-TIME OPTIONS): this file's DDP_IMPLEMENTATION is ignored; the rest of\n"
               "   the file compiles as it would with it (_GNU_SOURCE, which ddp_api.h defines for the implementation) */\n"
               "#if defined(DDP_NO_IMPLEMENTATION) && defined(DDP_IMPLEMENTATION)\n#undef DDP_IMPLEMENTATION\n"
               "#ifndef _GNU_SOURCE\n#define _GNU_SOURCE\n#endif\n#endif\n")
    out.append("#ifndef DDP_H_INCLUDED\n#define DDP_H_INCLUDED\n")
    out.append("#ifdef __cplusplus\nextern \"C\" {\n#endif\n")
    out += [piece(p) for p in PUBLIC]
    out.append("#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n")
    out.append("#endif /* DDP_H_INCLUDED */\n")
    out.append("#ifdef __cplusplus\nextern \"C\" {\n#endif\n")
    out += [piece(p) for p in PRIVATE]
    out.append("#ifdef __cplusplus\n} /* extern \"C\" */\n#endif\n")
    out.append("#if defined(DDP_IMPLEMENTATION) && !defined(DDP__IMPLEMENTATION_DONE)\n"
               "#define DDP__IMPLEMENTATION_DONE\n")
    out += [piece(p) for p in IMPLEMENTATION]
    out.append("#endif /* DDP_IMPLEMENTATION */\n")
    out.append(licence())
    return "\n".join(out)


def licence():
    """LICENSE as the closing comment of ddp.h (line 1 of the header points there)."""
    text = (ROOT / "LICENSE").read_text().strip("\n")
    if "*/" in text:
        sys.exit("LICENSE contains */, which would end the comment it is written into")
    rule = "-" * 78
    return f"/*\n{rule}\nddp.h is available under the MIT License (the file LICENSE):\n\n{text}\n{rule}\n*/\n"


# The environment: every variable the library reads must be listed in the ENVIRONMENT block of
# src/preamble.txt. "Reads" means: a string literal passed to getenv / ddp__env / ddp__env_int, or
# an all-capitals string in one of the tables of names that the code passes to them (ENV_TABLES).
# Variables the library only sets for its workers (launcher.c's setenv) are not read and need no
# entry. NOT_SETTINGS are read but are no setting of the library.
ENV_CALL = re.compile(r'\b(?:getenv|ddp__env|ddp__env_int)\s*\(\s*"([^"]+)"')
ENV_TABLES = ["ddp__launchers", "job_ids"]  # group.c: launchers' rank/size variables, job ids for the port
ENV_NAME = re.compile(r'"([A-Z][A-Za-z0-9_]*)"')  # OMPI_MCA_ess_base_jobid; not "SLURM (SLURM_PROCID, ...)"
NOT_SETTINGS = {"PATH"}  # launcher.c looks a worker program up in PATH, as execvp does


def env_read():
    """{variable: first src/ file that reads it}."""
    found = {}
    for path in sorted((ROOT / "src").glob("*.[ch]")):
        text = path.read_text()
        names = ENV_CALL.findall(text)
        for table in ENV_TABLES:
            m = re.search(r"\b" + table + r"\s*\[\s*\]\s*=\s*\{(.*?)\};", text, re.S)
            if m:
                names += ENV_NAME.findall(m.group(1))
        for name in names:
            found.setdefault(name, f"src/{path.name}")
    return found


def env_listed():
    """The words of the ENVIRONMENT block of src/preamble.txt (up to its first blank line); a word
    ending in _* (OMPI_COMM_WORLD_*) stands for every name it starts."""
    block = (ROOT / "src" / "preamble.txt").read_text().split("ENVIRONMENT", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"[A-Z][A-Za-z0-9_]*\*?", block))


def env_missing():
    listed = env_listed()
    prefixes = [w[:-1] for w in listed if w.endswith("*")]
    return {name: path for name, path in env_read().items()
            if name not in listed and name not in NOT_SETTINGS and not any(name.startswith(p) for p in prefixes)}


def pieces_alone():
    """Each implementation piece must compile on its own, as a reader or an editor sees it
    (`cc -std=c99 -fsyntax-only -Isrc src/X.c`; internal.h gives it the whole public part and every
    cross-file declaration). The compiler's error lines, by piece; empty when all compile or no cc."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        print("amalgamate.py: no C compiler found; the pieces were not compiled one by one", file=sys.stderr)
        return {}
    failed = {}
    for path in IMPLEMENTATION:
        if not path.endswith(".c"):
            continue
        run = subprocess.run([cc, "-std=c99", "-fsyntax-only", "-Werror=implicit-function-declaration", "-Isrc", path], cwd=ROOT,
                             capture_output=True, text=True)
        errors = [l for l in run.stderr.splitlines() if " error: " in l]
        if run.returncode != 0 or errors:
            failed[path] = errors or run.stderr.splitlines()[-3:]
    return failed


# The layers: the implementation's pieces in manifest order are its layers, bottom up (internal.h says
# what each is for). A piece may call what an earlier piece defines, never what a later one does: a
# lower layer reaches up only through a table or hook that the upper one fills (ddp__backend's slots,
# the set-up's hooks). upward_calls() is that check, over a call graph read from the source: every
# function a piece defines at file scope, and every ddp_/ddp__ name another piece mentions (a call, or
# a function put in a table).
def strip_comments_and_strings(text):
    """The code without its comments, string literals and character literals (one pass, left to right, so
    that "tcp://" is a string and '"' a character, not the start of a comment or a string); newlines kept."""
    token = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)

    def blank(m):
        word = m.group(0)
        return "\n" * word.count("\n") if word[0] == "/" else word[0] * 2
    return token.sub(blank, text)


def defined_functions(text):
    """Names of the functions a piece defines: a name and its parameter list at the start of a line,
    followed by a body."""
    names = []
    for m in re.finditer(r"^[A-Za-z][^;={}()\n]*?\b(ddp_\w+)\s*\(", text, re.M):
        depth, j = 0, m.end() - 1
        while j < len(text):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if text[j + 1:j + 80].lstrip().startswith("{"):
            names.append(m.group(1))
    return names


def upward_calls():
    """[(caller's file, line, name, callee's file)]: each place where a piece names a function that a later
    piece of the manifest defines (once per piece and name)."""
    pieces = [p for p in IMPLEMENTATION if p.endswith(".c")]
    texts = {p: strip_comments_and_strings((ROOT / p).read_text()) for p in pieces}
    owner = {}
    for p in pieces:
        for name in defined_functions(texts[p]):
            owner.setdefault(name, p)
    found = []
    for i, p in enumerate(pieces):
        seen = set()
        for m in re.finditer(r"\b(ddp_\w+)\b", texts[p]):
            callee = owner.get(m.group(1))
            if callee and pieces.index(callee) > i and m.group(1) not in seen:
                seen.add(m.group(1))
                found.append((p, texts[p].count("\n", 0, m.start()) + 1, m.group(1), callee))
    return found


def main():
    fresh = build()
    target = ROOT / "ddp.h"
    if "--check" in sys.argv[1:]:
        ok = True
        missing = env_missing()
        for name, path in sorted(missing.items()):
            print(f"environment variable {name} (read in {path}) is missing from the ENVIRONMENT block "
                  f"of src/preamble.txt: add a line saying what it does", file=sys.stderr)
            ok = False
        for table in ENV_TABLES:
            if not any(re.search(r"\b" + table + r"\s*\[\s*\]\s*=", p.read_text()) for p in (ROOT / "src").glob("*.[ch]")):
                print(f"amalgamate.py: the table {table} (ENV_TABLES) is not in src/ any more: update ENV_TABLES",
                      file=sys.stderr)
                ok = False
        for where in banners_inside():
            print(f"{where}: a begin/end banner inside a piece (amalgamate.py writes those): delete it",
                  file=sys.stderr)
            ok = False
        for caller, line, name, callee in upward_calls():
            print(f"{caller}:{line}: names {name}, which {callee} defines: a piece calls only the pieces before it "
                  f"in amalgamate.py's manifest (the layers, internal.h); move the code down, or reach up through "
                  f"a table or hook that the upper piece fills", file=sys.stderr)
            ok = False
        for path, errors in pieces_alone().items():
            print(f"{path} does not compile on its own (cc -std=c99 -fsyntax-only -Isrc {path}): declare what it "
                  f"uses from other pieces in src/internal.h", file=sys.stderr)
            for line in errors[:5]:
                print(f"    {line}", file=sys.stderr)
            ok = False
        if not target.exists() or target.read_text() != fresh:
            print("ddp.h is stale: run `python3 amalgamate.py` and commit ddp.h", file=sys.stderr)
            ok = False
        if not ok:
            return 1
        print("ddp.h is up to date; its ENVIRONMENT block lists every variable the code reads; every piece "
              "compiles on its own and calls only the pieces before it")
        return 0
    if target.exists() and target.read_text() == fresh:  # (a build that finds it fresh leaves it alone)
        os.utime(target)
        print("ddp.h is up to date")
        return 0
    partial = target.with_name(f".ddp.h.{os.getpid()}")  # whole or not at all: a compiler may be reading it
    partial.write_text(fresh)
    os.replace(partial, target)
    print(f"wrote ddp.h ({fresh.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
