"""Compare ddp.h's SyncBatchNorm (files written by tests/interop/syncbn_dump.c) with PyTorch.

For every case and every group of ranks that share statistics (the world, or each half when the case
uses subgroups), torch.nn.BatchNorm1d/2d/3d in training mode runs forward + backward on the
concatenation of the ranks' batches, in float64 on the very f32 inputs ddp.h saw. Checked, within
RTOL = 1e-5 relative: y and grad_input of every rank (its slice of the concatenated result),
running_mean, running_var and num_batches_tracked on every rank, and the SUM over the ranks of the local
grad_weight and grad_bias (what the gradient reducer's average reconstructs, times the rank count).
Then an eval step on each rank's own last batch: y, grad_input, grad_weight, grad_bias.
A tensor passes when |got - ref| <= RTOL * |ref| + RTOL * max|ref| elementwise.
Usage: syncbn_check.py DIR...   (one folder per syncbn_dump run; exit 0 = all passed)."""
import os
import sys

import numpy as np
import torch

RTOL = 1e-5
worst = 0.0
failures = []


def load(d, name):
    return np.fromfile(os.path.join(d, name + ".f32"), dtype=np.float32).astype(np.float64)


def to_cf(flat, batch, C, dims, channels_last):
    """ddp.h's memory layout -> a torch tensor (N, C, *dims)."""
    if channels_last:
        t = torch.from_numpy(flat).reshape(batch, *dims, C)
        return t.permute(0, len(dims) + 1, *range(1, len(dims) + 1)).contiguous()
    return torch.from_numpy(flat).reshape(batch, C, *dims)


def from_cf(t, channels_last):
    """torch (N, C, *dims) -> flat numpy in ddp.h's layout."""
    if channels_last:
        t = t.permute(0, *range(2, t.dim()), 1)
    return t.detach().contiguous().reshape(-1).numpy()


def check(what, got, ref):
    global worst
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    if got.shape != ref.shape:
        failures.append(f"{what}: {got.size} values, expected {ref.size}")
        return
    if ref.size == 0:
        return
    scale = float(np.max(np.abs(ref)))
    err = np.abs(got - ref)
    rel = float(np.max(err)) / scale if scale > 0 else float(np.max(err))
    worst = max(worst, rel)
    if not np.all(err <= RTOL * np.abs(ref) + RTOL * scale):
        i = int(np.argmax(err - RTOL * np.abs(ref)))
        failures.append(f"{what}: max relative error {rel:.3g}; at {i}: got {got[i]!r}, torch {ref[i]!r}")


def make_bn(meta, affine):
    cls = [torch.nn.BatchNorm1d, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d][meta["ndim"]]
    m = meta["momentum"]
    momentum = None if m < 0 else (m if m > 0 else 0.1)
    eps = meta["eps"] if meta["eps"] > 0 else 1e-5
    return cls(meta["C"], eps=eps, momentum=momentum, affine=affine,
               track_running_stats=bool(meta["track"])).double()


def run_group(d, meta, ranks, label):
    C, cl, steps, R = meta["C"], meta["channels_last"], meta["steps"], meta["ranks"]
    dims = meta["dims"][:meta["ndim"]]
    S = int(np.prod(dims)) if dims else 1
    batches = meta["batches"]
    bn = make_bn(meta, bool(meta["affine"]))
    aux = make_bn(meta, True)  # weight 1, bias 0: the reference of grad_weight/bias when affine=False
    with torch.no_grad():
        aux.weight.fill_(1.0)
        aux.bias.zero_()
        if meta["affine"]:
            bn.weight.copy_(torch.from_numpy(load(d, "init_w")))
            bn.bias.copy_(torch.from_numpy(load(d, "init_b")))
        if meta["track"]:
            for m in (bn, aux):
                m.running_mean.copy_(torch.from_numpy(load(d, "init_rm")))
                m.running_var.copy_(torch.from_numpy(load(d, "init_rv")))
    for step in range(steps):
        nb = [batches[step * R + r] for r in ranks]
        xs = [to_cf(load(d, f"s{step}_r{r}_x"), n, C, dims, cl) for r, n in zip(ranks, nb)]
        dys = [to_cf(load(d, f"s{step}_r{r}_dy"), n, C, dims, cl) for r, n in zip(ranks, nb)]
        x = torch.cat(xs).requires_grad_(True)
        dy = torch.cat(dys)
        bn.zero_grad()
        y = bn(x)
        y.backward(dy)
        xa = torch.cat(xs).requires_grad_(True)
        aux.zero_grad()
        aux(xa).backward(dy)
        ref_gw = (bn if meta["affine"] else aux).weight.grad
        ref_gb = (bn if meta["affine"] else aux).bias.grad
        off = 0
        gw = np.zeros(C)
        gb = np.zeros(C)
        for r, n in zip(ranks, nb):
            tag = f"{label} step {step} rank {r} (batch {n})"
            check(f"{tag} y", load(d, f"s{step}_r{r}_y"), from_cf(y[off:off + n], cl))
            check(f"{tag} grad_input", load(d, f"s{step}_r{r}_dx"), from_cf(x.grad[off:off + n], cl))
            if meta["track"]:
                check(f"{tag} running_mean", load(d, f"s{step}_r{r}_rm"), bn.running_mean.numpy())
                check(f"{tag} running_var", load(d, f"s{step}_r{r}_rv"), bn.running_var.numpy())
                nbt = int(load(d, f"s{step}_r{r}_nbt")[0])
                if nbt != int(bn.num_batches_tracked):
                    failures.append(f"{tag} num_batches_tracked {nbt}, torch {int(bn.num_batches_tracked)}")
            gw += load(d, f"s{step}_r{r}_gw")
            gb += load(d, f"s{step}_r{r}_gb")
            off += n
        check(f"{label} step {step} sum over ranks of grad_weight", gw, ref_gw.numpy())
        check(f"{label} step {step} sum over ranks of grad_bias", gb, ref_gb.numpy())
    # eval: each rank alone, on its last batch
    bn.eval()
    aux.eval()
    for r in ranks:
        n = batches[(steps - 1) * R + r]
        if n * S == 0 or (not meta["track"] and n * S < 2):
            continue
        x = to_cf(load(d, f"se_r{r}_x"), n, C, dims, cl).requires_grad_(True)
        dy = to_cf(load(d, f"se_r{r}_dy"), n, C, dims, cl)
        bn.zero_grad()
        y = bn(x)
        y.backward(dy)
        xa = x.detach().clone().requires_grad_(True)
        aux.zero_grad()
        aux(xa).backward(dy)
        tag = f"{label} eval rank {r}"
        check(f"{tag} y", load(d, f"se_r{r}_y"), from_cf(y, cl))
        check(f"{tag} grad_input", load(d, f"se_r{r}_dx"), from_cf(x.grad, cl))
        check(f"{tag} grad_weight", load(d, f"se_r{r}_gw"), (bn if meta["affine"] else aux).weight.grad.numpy())
        check(f"{tag} grad_bias", load(d, f"se_r{r}_gb"), (bn if meta["affine"] else aux).bias.grad.numpy())


def parse(line):
    meta = {}
    for kv in line.split():
        k, v = kv.split("=", 1)
        if k in ("dims", "batches"):
            meta[k] = [int(s) for s in v.split(",")]
        elif k in ("momentum", "eps"):
            meta[k] = float(v)
        else:
            meta[k] = int(v)
    return meta


def main():
    ncases = 0
    for top in sys.argv[1:]:
        ncases += check_run(top)
    for msg in failures:
        print("FAIL", msg)
    print(f"syncbn_check: {ncases} cases, {len(failures)} failures, largest relative error {worst:.2g} "
          f"(tolerance {RTOL:g}) against torch {torch.__version__}")
    return 1 if failures else 0


def check_run(top):
    ncases = 0
    with open(os.path.join(top, "meta.txt")) as f:
        for line in f:
            if not line.strip():
                continue
            meta = parse(line)
            d = os.path.join(top, f"case{meta['case']}")
            R = meta["ranks"]
            kind = ["BatchNorm1d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"][meta["ndim"]]
            groups = [list(range(R))]
            if meta["subgroups"]:
                groups = [list(range(R // 2)), list(range(R // 2, R))]
            for g in groups:
                run_group(d, meta, g, f"case {meta['case']} ({kind}, C={meta['C']}, "
                          f"{'channels_last' if meta['channels_last'] else 'channels_first'}, ranks {g})")
            ncases += 1
    print(f"{top}: {ncases} cases on {R} rank(s) checked")
    return ncases


if __name__ == "__main__":
    sys.exit(main())
