#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The GPU share's q8 step on the device (libaoq's aoq_device_adam_q8)
against its ceiling, the device's copy bandwidth measured in the same run,
with a separate fp32 master and with the split one (the bf16 parameter its
high half), and against what the share ran before for the default: torch's
fused AdamW on an fp32 master with fp32 moments (after the gradient's fp32
copy).  Prints seconds per step, bytes per element, GB/s and the ratio to
the copy bandwidth, and the device bytes of state per parameter.

    python3 tests/bench/q8_share_bench.py [--numel 67108864] [--repeat 20]

Needs a CUDA device and a libaoq built with CUDA (AOQ_LIBRARY)."""
import argparse
import sys

import torch

import aoq._q8 as q8
from aoq import _lib


def timed(fn, repeat):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeat):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / repeat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    n, dev = a.numel, torch.device("cuda", 0)
    lib = _lib.load()
    g = torch.randn(n, device=dev, dtype=torch.bfloat16) * 1e-2
    p = torch.randn(n, device=dev, dtype=torch.bfloat16)
    master = p.float()
    mc, vc, ms, vs = q8.state_from(torch.randn(n, device=dev) * 1e-3, torch.rand(n, device=dev) * 1e-6)
    step = [0]

    def kernel():
        step[0] += 1
        assert q8._device_step(lib, p, g, master, mc, vc, ms, vs, (1e-4, 0.9, 0.999, 1e-8, 0.1, True, step[0], 7,
                                                                    1.0))

    lo = torch.zeros(n, device=dev, dtype=torch.int16)
    pb = p.clone()

    def kernel_split():
        step[0] += 1
        assert q8._device_step(lib, pb, g, None, mc, vc, ms, vs, (1e-4, 0.9, 0.999, 1e-8, 0.1, True, step[0], 7,
                                                                  1.0), lo=lo)

    src = torch.empty(n * 4, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), a.repeat)
    copy_bw = 2 * src.numel() / t_copy
    t_q8 = timed(kernel, a.repeat)
    q8_bytes = 2 + 8 + 2 + 2 + 2 + 16 / q8.BLOCK     # grad, master r+w, m r+w, v r+w, param, scales r+w
    t_split = timed(kernel_split, a.repeat)
    split_bytes = 2 + 4 + 4 + 2 + 2 + 16 / q8.BLOCK  # grad, param r+w, low halves r+w, m, v, scales
    mt = master.clone().requires_grad_(False)
    opt = torch.optim.AdamW([mt], lr=1e-4, weight_decay=0.1, fused=True)

    def fused():
        mt.grad = g.float()
        opt.step()
        p.copy_(mt)
    t_f = timed(fused, a.repeat)
    print("device copy (the ceiling): %.1f GB/s (%d MiB read and written)" % (copy_bw / 1e9, src.numel() >> 20))
    print("q8 share step, %d elements: %.3f ms, %.2f B/element, %.1f GB/s = %.2f of the copy bandwidth; "
          "state %.2f B/parameter" % (n, 1e3 * t_q8, q8_bytes, q8_bytes * n / t_q8 / 1e9,
                                      q8_bytes * n / t_q8 / copy_bw, 6 + 8 / q8.BLOCK))
    print("q8 share step, split master (the default's, bf16 parameters): %.3f ms, %.2f B/element, %.1f GB/s = "
          "%.2f of the copy bandwidth; state %.2f B/parameter" % (
              1e3 * t_split, split_bytes, split_bytes * n / t_split / 1e9, split_bytes * n / t_split / copy_bw,
              4 + 8 / q8.BLOCK))
    print("fp32 share step (gradient to fp32, torch fused AdamW, parameter copy): %.3f ms (%.2fx the q8 step); "
          "state 12 B/parameter + 4 B/parameter of gradient copy" % (1e3 * t_f, t_f / t_q8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
