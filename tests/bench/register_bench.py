#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""How fast a model's parameters get into aoqd: registration and the initial
state transfer (aoq_register: the Register frames, the state allocated, every
parameter loaded into its master through the arena's transfer area), timed
through the Python binding, against memcpy of the same bytes in the same run.

A benchmark, not a test: it prints figures and fails only when registration
fails.  The ceiling is two memcpys of the parameters' bytes, one tensor at a
time, into a buffer the size of the largest tensor: into fresh memory (first
touch, as the daemon's state is) and into memory already written.  The
registration is repeated (a new session each time, the old one closed): the
first meets fresh pages in aoqd, the later ones pages the kernel has just
freed.

  python3 tests/bench/register_bench.py                      # 1 G bf16 params, cpu
  python3 tests/bench/register_bench.py --device cuda --params 24.7e9 --numel 67108864
"""
import argparse
import ctypes
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))

import torch  # noqa: E402

from aoq.client import Client  # noqa: E402
from aoq.daemon import Daemon  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def memcpy_gbs(tensors, fresh):
    """GB/s of memcpy over every tensor's bytes, one tensor at a time, into
    one buffer the size of the largest (fresh: a new buffer per tensor, so
    every destination page is touched for the first time).  From a GPU the
    destination is pinned, as the arena's transfer area is."""
    big = max(t.numel() * t.element_size() for t in tensors)
    pin = tensors[0].device.type == "cuda"
    dst = None if fresh else torch.empty(big, dtype=torch.uint8, pin_memory=pin)
    if dst is not None:
        dst.fill_(1)
    total = 0
    t0 = time.perf_counter()
    for t in tensors:
        n = t.numel() * t.element_size()
        d = torch.empty(n, dtype=torch.uint8, pin_memory=pin) if fresh else dst
        if t.device.type == "cpu":
            ctypes.memmove(d.data_ptr(), t.data_ptr(), n)
        else:
            d[:n].copy_(t.view(-1).view(torch.uint8))
            torch.cuda.synchronize(t.device)
        total += n
        del d
    return total / 1e9 / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="parameters in all (default 1e9)")
    ap.add_argument("--numel", type=int, default=16 << 20, help="elements per tensor (default 16 Mi)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--precision", default="bf16-q8", help="state precision (default bf16-q8: bf16 master, q8 moments)")
    ap.add_argument("--device", default="cpu", help="where the parameters live: cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="aoqd workers")
    ap.add_argument("--repeat", type=int, default=2, help="registrations, each a new session (default 2)")
    ap.add_argument("--window", type=int, default=1 << 30,
                    help="the staging window in bytes (default 1 GiB, OffloadOptimizer's for a model larger than "
                         "that; 0: a slot per tensor, the arena as large as the gradients)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the memcpy ceiling (a large model's takes a while)")
    ap.add_argument("--aoqd-arg", action="append", default=[], help="an extra aoqd argument (repeatable)")
    a = ap.parse_args()

    dt = DTYPES[a.dtype]
    count = max(1, int(round(a.params / a.numel)))
    dev = torch.device(a.device)
    torch.manual_seed(0)
    tensors = [torch.empty(a.numel, dtype=dt, device=dev).normal_() for _ in range(count)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    params = count * a.numel
    print("register_bench: %d tensors x %d = %.3f G %s parameters (%.2f GB) on %s; state %s; window %d; aoqd %d "
          "workers; %d cores" % (count, a.numel, params / 1e9, a.dtype, nbytes / 1e9, a.device, a.precision,
                                 a.window, a.threads, os.cpu_count() or 0), flush=True)
    fresh = warm = float("nan")
    if not a.no_ceiling:
        fresh = memcpy_gbs(tensors, True)
        warm = memcpy_gbs(tensors, False)
        print("memcpy ceiling: %.2f GB/s into fresh memory, %.2f GB/s into written memory" % (fresh, warm),
              flush=True)

    cdev = "cpu" if dev.type == "cpu" else "cuda:%d" % (dev.index or 0)
    code = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}[a.dtype]
    with Daemon(threads=a.threads, args=a.aoqd_arg) as d:
        best = None
        for rep in range(a.repeat):
            c = Client(socket=d.socket, device=cdev, precision=a.precision, window=a.window)
            c.add_group("adamw", lr=1e-4)
            t0 = time.perf_counter()
            for i, t in enumerate(tensors):
                c.add_tensor("t%d" % i, t.data_ptr(), numel=t.numel(), param_dtype=code, group=0)
            t1 = time.perf_counter()
            c.register()
            t2 = time.perf_counter()
            gbs = nbytes / 1e9 / (t2 - t0)
            best = gbs if best is None else max(best, gbs)
            print("registration %d: %.3f s (describe %.3f s) = %.2f GB/s of parameters, %.2f of fresh memcpy, "
                  "%.2f of written memcpy; %.1f s per 24.7 G params at this rate" %
                  (rep + 1, t2 - t0, t1 - t0, gbs, gbs / fresh, gbs / warm, 24.7e9 * nbytes / params / 1e9 / gbs),
                  flush=True)
            c.close()
    print("best %.2f GB/s; trainer peak RSS %.2f GiB" %
          (best, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
