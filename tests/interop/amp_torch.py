"""ddp.h's GradScaler and clip coefficient against current torch (tests/test_interop_torch_current.sh).

    python3 amp_torch.py AMP_PEER

Runs AMP_PEER (tests/interop/amp_peer.c) and checks its lines against torch:
  scaler: torch.amp.GradScaler("cpu", init_scale, growth_factor, backoff_factor, growth_interval) driven the
          way a program drives it (scale(loss), a gradient that is inf in the steps found_inf(k) says, step(opt),
          update()): after each step the scale equals ddp_grad_scaler_update's exactly and the optimizer step
          ran exactly when it returned 1.
  clip:   torch.nn.utils.clip_grad_norm_ on the same gradient with max_norm 1.0: the total norm within 1e-6
          (torch sums in f32) and the coefficient (torch's clipped element 0, whose gradient is 1) within one
          f32 ulp of ddp_reducer_clip_coef."""
import math
import subprocess
import sys

import torch

CONFIGS = [(65536.0, 2.0, 0.5, 7), (1000.1, 1.5, 0.7, 3)]


def found_inf(k):
    return k % 11 == 3 or k % 17 == 5


def grad_value(i):
    return 1.0 if i == 0 else ((i * 37) % 101 - 50) / 16.0


def f32_ulp(x):
    return math.ldexp(1.0, math.frexp(abs(x))[1] - 24)


def main():
    out = subprocess.run([sys.argv[1]], check=True, capture_output=True, text=True).stdout.split("\n")
    ours = {}
    clip = None
    for line in out:
        f = line.split()
        if f and f[0] == "scaler":
            ours[(int(f[1]), int(f[2]))] = (float(f[3]), int(f[4]))
        elif f and f[0] == "clip":
            clip = (float(f[1]), float(f[2]))
    for c, (init, growth, backoff, interval) in enumerate(CONFIGS):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        steps = []
        sgd_step = opt.step
        opt.step = lambda *a, **kw: (steps.append(1), sgd_step(*a, **kw))[1]  # counts the steps GradScaler takes
        scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                                      growth_interval=interval)
        for k in range(2000):
            scaler.scale(torch.ones(()))
            taken = len(steps)
            p.grad = torch.tensor([math.inf if found_inf(k) else 1.0])
            scaler.step(opt)
            scaler.update()
            stepped = len(steps) - taken
            scale, step = ours[(c, k)]
            if scale != scaler.get_scale() or step != stepped:
                sys.exit(f"scaler config {c} step {k}: ddp.h scale {scale!r} step {step}; torch {scaler.get_scale()!r} "
                         f"step {stepped}")
    print(f"GradScaler: 2 x 2000 steps, the scale and the skip decisions equal torch {torch.__version__}'s")
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = torch.tensor([grad_value(i) for i in range(1000)], dtype=torch.float32)
    total = float(torch.nn.utils.clip_grad_norm_([p], 1.0))
    coef = float(p.grad[0])
    norm, ours_coef = clip
    if abs(norm - total) > 1e-6 * total or abs(ours_coef - coef) > f32_ulp(coef):
        sys.exit(f"clip_grad_norm_: ddp.h norm {norm!r} coefficient {ours_coef!r}; torch {total!r} {coef!r}")
    print(f"clip_grad_norm_: norm {norm:.9g} (torch {total:.9g}), coefficient {ours_coef:.9g} (torch {coef:.9g}, "
          f"{abs(ours_coef - coef) / f32_ulp(coef):.2f} f32 ulp apart)")


if __name__ == "__main__":
    main()
