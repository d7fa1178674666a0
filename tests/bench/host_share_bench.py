#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The GPU share's q8 step with its state in pinned host memory.

libaoq's aoq_device_adam_q8 steps a bf16 parameter whose fp32 master is
split (the parameter its high half, 16 bits beside it) with q8 moments, on
the device.  Here the state (low halves, codes, scales: 4.03 bytes per
parameter) lives in pinned host memory, which the kernel reads and writes
over PCIe; the parameter and gradient stay on the device.  Printed, in one
run on one device:

  ceiling   pinned copies host->device, device->host and both at once (GB/s)
  device    the kernel with its state on the device (G params/s)
  host      the kernel with its state in pinned host memory, and its PCIe
            traffic (4.03 bytes per parameter each way) against the
            ceiling of both directions at once
  with h2d  the same while a host->device copy of 2 bytes per parameter
            (a parameter's way back from aoqd) runs on another stream
  matmul    bf16 matmuls alone, then for each grid cap (--blocks, blocks
            of 256 threads, 0: none) the host-state kernel alone and beside
            matmuls (backward's work sharing the device with the step)

and that the host-state step equals the device-state step bit for bit.

  python3 tests/bench/host_share_bench.py [--numel N] [--repeat R]
(AOQ_LIBRARY: a libaoq built with CUDA)."""
import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/client/python")
from aoq import _lib, _q8  # noqa: E402


def state(n, dev, pin):
    kw = dict(device=dev) if not pin else dict(pin_memory=True)
    nb = _q8.blocks(n)
    lo = torch.zeros(n, dtype=torch.int16, **kw)
    mc = torch.zeros(n, dtype=torch.uint8, **kw)
    vc = torch.zeros(n, dtype=torch.uint8, **kw)
    ms = torch.zeros(nb, dtype=torch.float32, **kw)
    vs = torch.zeros(nb, dtype=torch.float32, **kw)
    return [lo, mc, vc, ms, vs]


def step(lib, p, g, st, k, blocks=0):
    lo, mc, vc, ms, vs = st
    _q8._device_step(lib, p, g, None, mc, vc, ms, vs, (1e-3, 0.9, 0.999, 1e-8, 0.1, True, k, 7, 1.0), lo=lo,
                     max_blocks=blocks)


def timed(fn, reps, dev):
    s = torch.cuda.current_stream(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    a.record(s)
    for _ in range(reps):
        fn()
    b.record(s)
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--blocks", type=lambda v: [int(x) for x in v.split(",")], default=[0, 8, 16, 32, 64, 132, 264],
                    help="grid caps to try for the host-state step beside matmuls (0: none)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.cuda.set_device(dev)
    lib = _lib.load()
    n, r = a.numel, a.repeat
    per = 2 + 2 + 8 / _q8.BLOCK     # low half, two codes, two scales per block
    print("host_share_bench: %d parameters, %s, %s" % (n, torch.cuda.get_device_name(dev), time.strftime("%F %T")))

    # the ceiling: pinned copies
    hb = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    hb2 = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    db = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    db2 = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    h2d = (1 << 30) / timed(lambda: db.copy_(hb, non_blocking=True), r, dev) / 1e9
    d2h = (1 << 30) / timed(lambda: hb.copy_(db, non_blocking=True), r, dev) / 1e9
    s2 = torch.cuda.Stream(dev)

    def both():
        s2.wait_stream(torch.cuda.current_stream(dev))
        db.copy_(hb, non_blocking=True)
        with torch.cuda.stream(s2):
            hb2.copy_(db2, non_blocking=True)
        torch.cuda.current_stream(dev).wait_stream(s2)
    bidir = (1 << 30) / timed(both, r, dev) / 1e9
    print("ceiling: pinned copies host->device %.1f GB/s, device->host %.1f GB/s, both at once %.1f GB/s each way"
          % (h2d, d2h, bidir))

    g = (torch.randn(n, device=dev) * 1e-2).to(torch.bfloat16)
    p0 = torch.randn(n, device=dev).to(torch.bfloat16)
    pd, ph = p0.clone(), p0.clone()
    sd, sh = state(n, dev, False), state(n, dev, True)
    for k in (1, 2, 3):                          # the same three steps both ways
        step(lib, pd, g, sd, k)
        step(lib, ph, g, sh, k)
    torch.cuda.synchronize(dev)
    same = torch.equal(pd, ph) and all(torch.equal(x.cpu(), y) for x, y in zip(sd, sh))
    print("equal: the host-state step %s the device-state step after 3 steps" % ("equals" if same else
                                                                               "DIFFERS FROM"))
    kk = [4]

    def dstep():
        step(lib, pd, g, sd, kk[0])

    def hstep():
        step(lib, ph, g, sh, kk[0])
    td = timed(dstep, r, dev)
    th = timed(hstep, r, dev)
    print("device: %.2f G params/s (%.1f ms)" % (n / td / 1e9, td * 1e3))
    print("host: %.2f G params/s (%.1f ms), %.1f GB/s each way = %.2f of the copies both at once"
          % (n / th / 1e9, th * 1e3, n * per / th / 1e9, n * per / th / 1e9 / bidir))

    # beside a parameter's way back from aoqd: 2 bytes per parameter host->device
    pb = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    pdst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    cur = torch.cuda.current_stream(dev)
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    s2.wait_stream(cur)
    e0.record(cur)
    with torch.cuda.stream(s2):
        pdst.copy_(pb, non_blocking=True)
        e2.record(s2)
    hstep()
    e1.record(cur)
    torch.cuda.synchronize(dev)
    tk, tc = e0.elapsed_time(e1) / 1e3, e0.elapsed_time(e2) / 1e3
    print("with h2d: the host-state step %.2f G params/s (%.1f ms) beside a %.2f GB copy host->device that took "
          "%.1f ms (%.1f GB/s)" % (n / tk / 1e9, tk * 1e3, 2 * n / 1e9, tc * 1e3, 2 * n / tc / 1e9))

    # backward's work beside it, the host-state step's grid capped at B blocks of 256 threads
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = 40
    ta = timed(lambda: [torch.mm(x, y) for _ in range(mm)], 2, dev)
    fl = 2 * 8192 ** 3 * mm
    print("matmul: alone %.0f TFLOP/s (%.1f ms)" % (fl / ta / 1e12, ta * 1e3))
    for blocks in a.blocks:
        tb = timed(lambda: step(lib, ph, g, sh, kk[0], blocks), r, dev)
        s2.wait_stream(cur)
        e0.record(cur)
        with torch.cuda.stream(s2):
            for _ in range(mm):
                torch.mm(x, y)
            e2.record(s2)
        for _ in range(2):
            step(lib, ph, g, sh, kk[0], blocks)
        e1.record(cur)
        torch.cuda.synchronize(dev)
        tm, tk = e0.elapsed_time(e2) / 1e3, e0.elapsed_time(e1) / 1e3 / 2
        print("blocks %4d: the host-state step alone %.2f G params/s (%.1f GB/s each way); beside matmuls %.2f G "
              "params/s, the matmuls at %.2f of alone" % (blocks, n / tb / 1e9, n * per / tb / 1e9, n / tk / 1e9,
                                                          ta / tm))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
