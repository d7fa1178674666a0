#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Diagnostic (not a test): which roundings does torch.optim.AdamW (foreach,
the default) perform on this device?  Runs 5 steps on random data and
replays them on the CPU in float64 with float32 roundings, once for every
choice of fused multiply-add in lerp_, addcmul_ (L: (value * g) * g) and
addcdiv_, and prints
how many elements of p, m, v each choice gets wrong.  The daemon's kernels
(kernels/README.md, "Numerics") use the choice that comes out at zero.

    python3 tests/gpu/python/diag_adamw_rounding.py [--device cuda]
"""
import argparse
import itertools

import torch


def f32(x):
    return x.to(torch.float32).to(torch.float64)


def fma(a, b, c):
    # a*b is exact in float64 for float32 inputs; one more rounding to float64
    # before float32 differs from a true fma only in rare double-rounding ties
    return f32(a * b + c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=1 << 20)
    a = ap.parse_args()
    torch.manual_seed(0)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    p0 = torch.randn(a.n)
    p = p0.clone().to(a.device).requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    grads = [torch.randn(a.n) * 10 ** (k % 3 - 1) for k in range(5)]
    combos = list(itertools.product([False, True], [False, True, "left", "leftF"], [False, True]))
    emu = {c: [p0.double(), torch.zeros(a.n, dtype=torch.float64), torch.zeros(a.n, dtype=torch.float64)]
           for c in combos}
    w1, w2 = f32(torch.tensor(1 - b1, dtype=torch.float64)), f32(torch.tensor(1 - b2, dtype=torch.float64))
    fb2, feps = f32(torch.tensor(b2, dtype=torch.float64)), f32(torch.tensor(eps, dtype=torch.float64))
    dec = f32(torch.tensor(1 - lr * wd, dtype=torch.float64))
    for k, g in enumerate(grads, 1):
        p.grad = g.to(a.device)
        opt.step()
        bc1, bc2 = 1 - b1 ** k, 1 - b2 ** k
        nss = f32(torch.tensor(-(lr / bc1), dtype=torch.float64))
        bc2s = f32(torch.tensor(bc2 ** 0.5, dtype=torch.float64))
        st = opt.state[p]
        tp, tm, tv = (x.detach().cpu().double() for x in (p, st["exp_avg"], st["exp_avg_sq"]))
        gd = g.double()
        line = []
        for c in combos:
            fl, fc, fd = c
            ep, em, ev = emu[c]
            ep = f32(ep * dec)
            em = fma(w1, f32(gd - em), em) if fl else f32(em + f32(w1 * f32(gd - em)))
            ev = f32(ev * fb2)
            gg = f32(gd * gd)
            if fc == "left":   # (value * t1) * t2, then the sum
                ev = f32(ev + f32(f32(w2 * gd) * gd))
            elif fc == "leftF":  # fma(value * t1, t2, self)
                ev = fma(f32(w2 * gd), gd, ev)
            else:
                ev = fma(w2, gg, ev) if fc else f32(ev + f32(w2 * gg))
            den = f32(f32(f32(ev.sqrt()) / bc2s) + feps)
            q = f32(em / den)
            ep = fma(nss, q, ep) if fd else f32(ep + f32(nss * q))
            emu[c] = [ep, em, ev]
            line.append("lerp%s addcmul%s addcdiv%s: p %d m %d v %d" % (
                "F" if fl else "-", "L" if fc == "left" else "LF" if fc == "leftF" else "F" if fc else "-", "F" if fd else "-",
                int((ep != tp).sum()), int((em != tm).sum()), int((ev != tv).sum())))
        print("step %d (torch %s on %s)" % (k, torch.__version__, a.device))
        for x in line:
            print("  " + x)


if __name__ == "__main__":
    main()
