"""ddp.h's reducer against torch DistributedDataParallel (gloo): torch 1.13 (tests/test_interop_reducer.sh)
and torch 2.x (tests/test_interop_torch_current.sh, in the chroot of tools/torch-current.sh, with USE_LIBUV=0
for its libuv-less tcp:// rendezvous and GLOO_SOCKET_IFNAME=lo).

    /usr/bin/python3 tests/interop/reducer_torch.py PEER WORKDIR

PEER is the compiled tests/interop/reducer_peer.c. For each variant, torch writes the MLP's initial weights
and the data, trains 20 SGD steps with DDP on 2 ranks (gloo), and the peer trains the same with ddp.h
from the same files; the final weights must agree within the variant's tolerance (max over elements of
|ddp - torch| / max(|torch|, 0.01)). Variants:
    plain   DDP defaults                                                                     1e-5
    accum   2 micro-batches per step, the first under no_sync(); gradient_as_bucket_view;   1e-5
            small buckets
    fp16    fp16_compress_hook (torch) vs comm_dtype = DDP_F16 (ddp.h)                       1e-3
            For 2 ranks both round x/2 to f16 and sum in f16, bit for bit (checked against torch's own
            gradients while developing this), but the local f32 gradients differ in the last bits
            (torch's BLAS sums in another order than the C loops), and now and then such a difference
            falls on an f16 rounding boundary and moves one gradient element by one f16 unit (2^-11).
            Where torch's gloo has no float16 all_reduce (Debian's torch 2.14: "Invalid scalar type"),
            torch's side uses fp16_wide_sum_hook below instead (the same compression; the 2-rank sum
            done exactly in f64 and rounded to f16 once, which is the f16 sum) and prints a SKIP-PART
            line for fp16_compress_hook itself.
    join    uneven inputs on 3 ranks: rank r trains JOIN_STEPS[r] steps (rank 2: none) under   1e-5
            `with ddp.join():` (torch) / then ddp_reducer_join (ddp.h); no_sync and views as accum;
            the last rank's final weights (it ran out first: the final model sync is checked)
    joinfail  the same with throw_on_early_termination=True / join_fail_early = 1, shards       1e-5
            JOINFAIL_STEPS: every rank stops at the step where rank 2 runs out
    zero    ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW, lr 1e-2) with DDP     1e-4
            (torch) vs zero_stage = 1 with AdamW on ddp_reducer_shards, small buckets so that
            slices cut parameters (ddp.h); and torch's consolidate_state_dict() exp_avg and
            exp_avg_sq against ddp_reducer_consolidate_state's (same tolerance, relative to
            max(|torch|, 1e-2 of the largest value)). torch assigns whole parameters to ranks,
            ddp.h slices of buckets: AdamW is element-wise, so only rounding differs (torch's
            BLAS sums the gradients in another order); 1e-4 as Adam divides by sqrt(v) and
            turns a last-bit gradient difference into a larger relative one where v is small.
    zerojoin  ZeRO-1 + uneven inputs on 3 ranks (rank 2: no data): ZeroRedundancyOptimizer(AdamW,     1e-4
            lr 1e-2, weight_decay 1e-2) with DDP under `with Join([ddp, opt]):` / zero_stage = 1,
            AdamW on ddp_reducer_shards, the ddp_reducer_join_step loop; the last rank's final weights.
            torch's _ZeROJoinHook steps a joined rank's partition with whatever its param.grad holds,
            because DDP's join hook throws away the all-reduce of zeros (_match_all_reduce_for_bwd_pass):
            its stale last gradient (measured: 8.3 max rel diff from ddp.h; in a 12-step trial 0.09
            absolute from the serial run). ddp.h gives a joined rank's shards that step's average (the
            serial run's gradient), so torch's side replaces that one DDP method with the same
            all-reduce whose result it writes into param.grad (averaged_join_hook below); with it torch
            equals the serial run to 6e-8 in that trial, and ddp.h within 2.1e-7 absolute. Tolerance
            1e-4: AdamW moves every weight by ~lr a step whatever its gradient's size, so a weight near
            zero (the 0.01 floor) carries ~1e-7 of rounding, 1e-5 relative.
    zerounused  ZeRO with find_unused_parameters=True (torch) / zero_stage = 1 and,           1e-4
    zero2unused  zero_stage = 2, with find_unused_parameters (ddp.h): the last Linear is one of two
            heads of the same shape (heads.0, heads.1, registered last); step s on rank r uses
            head_of(r, s): each rank its own (a head unused here, used there), and in every third
            step both use head 0 (head 1 unused everywhere: DDP leaves its .grad None, and AdamW
            skips it; ddp.h's side skips the shards for which ddp_reducer_param_used is 0).
            torch zeroes gradients with set_to_none=True here.
Then the bucket layouts: torch's own dist._compute_bucket_assignment_by_size against the reducer's initial
(reverse registration order) and rebuilt (ready order) buckets. Exit 0 when everything matches."""
import os
import socket
import subprocess
import time
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

DIMS = [16, 32, 24, 8]
R, B, STEPS, LR = 2, 4, 20, 0.1
TOL = {"plain": 1e-5, "accum": 1e-5, "fp16": 1e-3, "join": 1e-5, "joinfail": 1e-5, "zero": 1e-4, "zerojoin": 1e-4,
       "zerounused": 1e-4, "zero2unused": 1e-4}
SEED = {"plain": 0, "accum": 1, "fp16": 2, "join": 3, "joinfail": 4, "zero": 5, "zerojoin": 6, "zerounused": 7,
        "zero2unused": 7}
ZERO_LR, ZERO_WD = 1e-2, 1e-2  # zero, zerojoin: AdamW (weight_decay: torch.optim.AdamW's default)
JOIN_STEPS = {"join": [STEPS, 9, 0], "joinfail": [STEPS, 11, 7], "zerojoin": [STEPS, 9, 0]}


def averaged_join_hook(self):
    """DDP._match_all_reduce_for_bwd_pass (a joined rank's shadow of one backward pass: the same bucketed
    all-reduces of zeros), keeping the result: each parameter's .grad becomes that step's average over the
    ranks with data, as ddp_reducer_join_step gives a joined rank's shards (see zerojoin above)."""
    pending = [(b, self.reducer._run_comm_hook(b)) for b in self.reducer._get_zeros_like_grad_buckets()]
    for bucket, fut in pending:
        buf = fut.wait()
        buf = buf[0] if isinstance(buf, list) else buf
        off = 0
        for p in bucket.parameters():
            p.grad = buf[off:off + p.numel()].view_as(p).clone()
            off += p.numel()


def ranks(variant):
    return 3 if variant in JOIN_STEPS else R


def head_of(rank, step):
    """The unused variants' head of rank in step (reducer_peer.c: the same)."""
    return 0 if step % 3 == 2 else (rank + step) % 2


class TwoHeads(torch.nn.Module):
    """The MLP with its last Linear as one of two heads: forward(x, k) = heads[k](trunk(x))."""

    def __init__(self):
        super().__init__()
        layers = []
        for i in range(len(DIMS) - 2):
            layers += [torch.nn.Linear(DIMS[i], DIMS[i + 1]), torch.nn.Tanh()]
        self.trunk = torch.nn.Sequential(*layers)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(DIMS[-2], DIMS[-1]) for _ in range(2)])

    def forward(self, x, k):
        return self.heads[k](self.trunk(x))


def make_model(variant="plain"):
    if variant.endswith("unused"):
        return TwoHeads()
    layers = []
    for i in range(len(DIMS) - 1):
        layers.append(torch.nn.Linear(DIMS[i], DIMS[i + 1]))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def fp16_wide_sum_hook(process_group, bucket):
    """fp16_compress_hook for a gloo without float16 all_reduce: x.to(f16) / R as torch's hook does, the
    sum over the ranks in f64 (exact for two f16 values), rounded to f16 once, back into the f32 bucket."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float16).div_(group.size()).double()

    def decompress(fut):
        buffer.copy_(fut.value()[0].to(torch.float16))
        return buffer

    return dist.all_reduce(wide, group=group, async_op=True).get_future().then(decompress)


def gloo_has_f16():
    """Whether this torch's gloo all_reduces float16 (refused locally, on every rank alike, if not)."""
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.float16))
        return True
    except RuntimeError as e:
        if "Invalid scalar type" not in str(e):
            raise
        return False


def worker(rank, workdir, variant, accum, port):
    torch.set_num_threads(1)
    R = ranks(variant)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    model = make_model(variant)
    unused = variant.endswith("unused")
    init = torch.from_numpy(_read(workdir, "init.bin"))
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(init[off:off + p.numel()].reshape(p.shape))
            off += p.numel()
    kwargs = {}
    if variant in ("accum", "join"):
        kwargs = dict(gradient_as_bucket_view=True, bucket_cap_mb=1024 / 2**20)
    if unused:
        kwargs = dict(find_unused_parameters=True)
    ddp = DDP(model, **kwargs)
    if variant == "fp16":
        native = int(torch.__version__.split(".")[0]) < 2 or gloo_has_f16()  # 1.13: as before, no probe
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if native else fp16_wide_sum_hook)
        if rank == 0:
            with open(os.path.join(workdir, "hook.txt"), "w") as f:
                f.write("fp16_compress_hook" if native else "fp16_wide_sum_hook")
    data = torch.from_numpy(_read(workdir, "data.bin"))
    n = STEPS * accum * R * B
    x = data[: n * DIMS[0]].reshape(STEPS, accum, R * B, DIMS[0])
    t = data[n * DIMS[0]:].reshape(STEPS, accum, R * B, DIMS[-1])
    if variant.startswith("zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        if variant == "zerojoin":
            DDP._match_all_reduce_for_bwd_pass = averaged_join_hook
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=ZERO_LR,
                                      weight_decay=ZERO_WD)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    loss_fn = torch.nn.MSELoss()

    def train(steps):
        for step in range(steps):
            opt.zero_grad(set_to_none=unused)
            for micro in range(accum):
                xs = x[step, micro, rank * B:(rank + 1) * B]
                ts = t[step, micro, rank * B:(rank + 1) * B]
                args = (xs, head_of(rank, step)) if unused else (xs,)
                if micro < accum - 1:
                    with ddp.no_sync():
                        loss_fn(ddp(*args), ts).backward()
                else:
                    loss_fn(ddp(*args), ts).backward()
            opt.step()

    if variant == "zerojoin":
        from torch.distributed.algorithms.join import Join
        with Join([ddp, opt]):
            train(JOIN_STEPS[variant][rank])
    elif variant in JOIN_STEPS:
        try:
            with ddp.join(throw_on_early_termination=variant == "joinfail"):
                train(JOIN_STEPS[variant][rank])
        except RuntimeError as e:
            if variant != "joinfail" or "exhausted" not in str(e):
                raise
    else:
        train(STEPS)
    if rank == (R - 1 if variant in JOIN_STEPS else 0):
        flat(model).numpy().tofile(os.path.join(workdir, "torch_final.bin"))
    if variant == "zero":
        opt.consolidate_state_dict(to=0)  # collective: every rank sends its partition's state to rank 0
        if rank == 0:
            state = opt.state_dict()["state"]  # keyed by the parameter's index in model.parameters()
            n = len(list(model.parameters()))
            for key in ("exp_avg", "exp_avg_sq"):
                torch.cat([state[i][key].reshape(-1) for i in range(n)]).numpy().tofile(
                    os.path.join(workdir, f"torch_{key}.bin"))
    dist.barrier()  # nobody tears its connections down while a peer still uses them (see run_torch)
    dist.destroy_process_group()


def _read(workdir, name):
    import numpy as np
    return np.fromfile(os.path.join(workdir, name), dtype="<f4")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(workdir, variant, accum, seconds=25, attempts=6):
    """torch's side, the reference (a few seconds: 5-6 s for joinfail on the loaded 2-core machine). torch 1.13's
    gloo has been seen to leave a worker spinning after its peer finished (about once in five CI runs, fp16
    variant; four times in a row once, joinfail variant), and to abort a worker in C++ ("terminate called
    without an active exception", SIGABRT; once in CI, zerounused or zero2unused). Such a run is killed after
    `seconds` (or when a worker dies of a signal) and tried again on a new port, up to `attempts` times. A Python
    exception in a worker is no such case: it fails at once. The reference only ever waits on torch itself;
    ddp.h's side runs afterwards in its own process."""
    for attempt in range(1, attempts + 1):
        ctx = mp.start_processes(worker, args=(workdir, variant, accum, free_port()), nprocs=ranks(variant),
                                 start_method="spawn", join=False)
        deadline = time.time() + seconds
        why = f"did not finish within {seconds} s"
        try:
            while not ctx.join(timeout=1):
                if time.time() > deadline:
                    break
            else:
                return
        except mp.ProcessExitedException as e:  # a signal or a C++ abort: torch's own failure (above)
            why = str(e)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        print(f"torch reference ({variant}) {why} (attempt {attempt}); killed it", flush=True)
    raise RuntimeError(f"torch reference ({variant}) failed {attempts} times")


def run_variant(peer, workdir, variant):
    import numpy as np
    accum = 2 if variant in ("accum", "join") else 1
    R = ranks(variant)
    torch.manual_seed(SEED[variant])
    flat(make_model(variant)).numpy().astype("<f4").tofile(os.path.join(workdir, "init.bin"))
    if variant in JOIN_STEPS:
        with open(os.path.join(workdir, "steps.txt"), "w") as f:
            f.write(" ".join(str(n) for n in JOIN_STEPS[variant]) + "\n")
    x = torch.randn(STEPS, accum, R * B, DIMS[0])
    t = torch.randn(STEPS, accum, R * B, DIMS[-1])
    torch.cat([x.reshape(-1), t.reshape(-1)]).numpy().astype("<f4").tofile(os.path.join(workdir, "data.bin"))
    if os.path.exists(os.path.join(workdir, "hook.txt")):
        os.remove(os.path.join(workdir, "hook.txt"))
    run_torch(workdir, variant, accum)
    if variant == "fp16":
        with open(os.path.join(workdir, "hook.txt")) as f:
            hook = f.read()
        if hook != "fp16_compress_hook":
            print(f"SKIP-PART reducer fp16 (torch's fp16_compress_hook): torch {torch.__version__}'s gloo refuses "
                  f"float16 all_reduce (\"Invalid scalar type\"); compared with {hook} (the same f16 "
                  "compression and f16 sum of 2 ranks) instead", flush=True)
    lr = ZERO_LR if variant.startswith("zero") else LR
    subprocess.run([peer, "train", workdir, variant, str(R), str(B), str(STEPS), str(accum), str(lr)]
                   + [str(d) for d in DIMS], check=True)
    a = _read(workdir, "ddp_final.bin").astype(np.float64)
    b = _read(workdir, "torch_final.bin").astype(np.float64)
    i0 = _read(workdir, "init.bin").astype(np.float64)
    diff = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 0.01)))
    moved = float(np.max(np.abs(b - i0)))
    tol = TOL[variant]
    print(f"{variant:6s} max rel diff ddp.h vs torch DDP: {diff:.2e} (tolerance {tol:.0e}); weights moved by up to {moved:.3f}")
    ok = diff <= tol and moved > 1e-2
    for key in ("exp_avg", "exp_avg_sq") if variant == "zero" else ():
        a = _read(workdir, f"ddp_{key}.bin").astype(np.float64)
        b = _read(workdir, f"torch_{key}.bin").astype(np.float64)
        d = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-2 * np.max(np.abs(b)))))
        print(f"{variant:6s} consolidated {key}: ddp_reducer_consolidate_state vs torch's consolidate_state_dict: "
              f"max rel diff {d:.2e} (tolerance {tol:.0e}), {a.size} elements")
        ok &= a.size == b.size and d <= tol
    return ok


def torch_layout(sizes, walk, first, cap):
    """torch's assignment walking the parameters in `walk` order (as its rebuild does); bucket of each."""
    tensors = [torch.empty(sizes[i]) for i in walk]
    res = dist._compute_bucket_assignment_by_size(tensors, [first, cap], [False] * len(walk), list(walk))
    buckets = res[0] if isinstance(res, tuple) else res
    where = [None] * len(sizes)
    for b, members in enumerate(buckets):
        for i in members:
            where[i] = b
    return where


def check_layouts(peer):
    ok = True
    g = torch.Generator().manual_seed(5)
    cases = [
        (0, 0, [300000, 1, 262143, 700000, 5000000, 6000000, 20, 262144, 9000000]),
        (1000, 5000, [int(v) for v in torch.randint(1, 1500, (40,), generator=g)]),
    ]
    for first, cap, sizes in cases:
        n = len(sizes)
        order = [int(v) for v in torch.randperm(n, generator=g)]
        out = subprocess.run([peer, "layout", str(first), str(cap), str(n)] + [str(s) for s in sizes] + [str(o) for o in order],
                             check=True, capture_output=True, text=True).stdout.split("\n")
        ours_initial = [int(v) for v in out[0].split()[1:]]
        ours_rebuilt = [int(v) for v in out[1].split()[1:]]
        f, c = first or 2**20, cap or 25 * 2**20
        want_initial = torch_layout(sizes, list(reversed(range(n))), f, c)
        want_rebuilt = torch_layout(sizes, order, f, c)
        same = ours_initial == want_initial and ours_rebuilt == want_rebuilt
        print(f"layout first={f} cap={c} {n} params: {max(want_rebuilt) + 1} buckets rebuilt, "
              f"{'same as' if same else 'DIFFERENT from'} torch's _compute_bucket_assignment_by_size")
        if not same:
            print("  ours initial", ours_initial, "\n  torch       ", want_initial)
            print("  ours rebuilt", ours_rebuilt, "\n  torch       ", want_rebuilt)
        ok &= same
    return ok


def main():
    peer, workdir = sys.argv[1], sys.argv[2]
    ok = True
    variants = sys.argv[3:] or ["plain", "accum", "fp16", "join", "joinfail", "zero", "zerojoin", "zerounused", "zero2unused"]
    for variant in variants:
        ok &= run_variant(peer, workdir, variant)
    ok &= check_layouts(peer)
    print("reducer interop:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
