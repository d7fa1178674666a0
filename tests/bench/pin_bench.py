#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""How fast shared memory gets pinned for DMA: the masters memfd of a large
model (aoq-arena.h, "The master as the parameter") is mapped by the trainer
and pinned with cudaHostRegister before the first copy, and at 24.7 G
parameters that is 49 GB.  This times, on one memfd of --gib GiB:

  - faulting its pages in (MADV_POPULATE_WRITE) on 1..N threads;
  - pinning it whole with cuMemHostRegister, writable and read-only;
  - pinning it in slices on 1..N threads at once (one registration each);
  - an H2D copy out of a sliced registration, against one out of a
    cudaHostAlloc buffer (the ceiling: PCIe with pinned memory).

A benchmark, not a test.  Needs a CUDA device and torch (for the device and
the copies); the driver API is called through ctypes, which drops the GIL,
so the threads pin at once.

  python3 tests/bench/pin_bench.py --gib 16 --threads 1,4,8,16
"""
import argparse
import ctypes
import mmap
import os
import threading
import time

import torch

MADV_POPULATE_WRITE = 23
REG_RO = 8  # CU_MEMHOSTREGISTER_READ_ONLY


def libs():
    cuda = ctypes.CDLL("libcuda.so.1")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cuda.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    return cuda, libc


def slices(base, size, n, align):
    """n slices of [base, base + size), each a multiple of align."""
    per = (size // n + align - 1) // align * align
    out, off = [], 0
    while off < size:
        out.append((base + off, min(per, size - off)))
        off += per
    return out


def run_threads(fn, parts):
    errs = []

    def one(p):
        r = fn(*p)
        if r:
            errs.append(r)
    ts = [threading.Thread(target=one, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise RuntimeError("errors %s" % errs[:3])
    return dt


def h2d_gbs(host):
    """GB/s of three copies of the host tensor to the device, after one."""
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * host.numel() / 1e9 / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--threads", default="1,4,8,16")
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",")]
    size = int(a.gib * (1 << 30)) // (2 << 20) * (2 << 20)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    cuda, libc = libs()
    ctx = ctypes.c_void_p()
    cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print("pin_bench: %.1f GiB memfd, shmem THP: %s, %d CPUs, %s" % (
        size / 2 ** 30, thp, os.cpu_count(), torch.cuda.get_device_name()))

    def fresh():
        fd = os.memfd_create("pin-bench")
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        return mm, base

    def populate(p, n):
        return 0 if libc.madvise(p, n, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    def pin(flags):
        def f(p, n):
            cuda.cuCtxSetCurrent(ctx)
            return cuda.cuMemHostRegister_v2(p, n, flags)
        return f

    def unpin(p, n):
        cuda.cuCtxSetCurrent(ctx)
        return cuda.cuMemHostUnregister(p)

    gb = size / 1e9
    for t in threads:
        mm, base = fresh()
        dt = run_threads(populate, slices(base, size, t, 2 << 20))
        print("populate  %2d threads: %6.2f s  %6.2f GB/s" % (t, dt, gb / dt))
        del base
        mm.close()

    # fallocate: the memfd's pages allocated without mapping them (one
    # call: shmem serialises fallocate per file), then mapped
    fd = os.memfd_create("pin-bench")
    os.ftruncate(fd, size)
    t0 = time.perf_counter()
    os.posix_fallocate(fd, 0, size)
    dt = time.perf_counter() - t0
    print("fallocate  1 thread:   %6.2f s  %6.2f GB/s" % (dt, gb / dt))
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    dt = run_threads(populate, slices(base, size, threads[-1], 2 << 20))
    print("  then populate %d threads: %6.2f s  %6.2f GB/s" % (threads[-1], dt, gb / dt))
    del base
    mm.close()

    for flags, name in ((0, "writable"), (REG_RO, "read-only")):
        for t in threads:
            mm, base = fresh()
            run_threads(populate, slices(base, size, 16, 2 << 20))
            parts = slices(base, size, t, 2 << 20)
            dt = run_threads(pin(flags), parts)
            print("pin %-9s %2d slices/threads: %6.2f s  %6.2f GB/s" % (name, t, dt, gb / dt))
            if t == threads[-1]:
                # a copy out of one slice, at pinned speed?
                host = torch.frombuffer(mm, dtype=torch.uint8, count=parts[0][1])
                print("  H2D from a slice: %.2f GB/s" % h2d_gbs(host))
                del host
            t0 = time.perf_counter()
            run_threads(unpin, parts)
            print("  unpin: %.2f s" % (time.perf_counter() - t0))
            del base
            mm.close()
        # unpopulated: the pin faults the pages itself
        mm, base = fresh()
        parts = slices(base, size, threads[-1], 2 << 20)
        dt = run_threads(pin(flags), parts)
        print("pin %-9s %2d threads, not populated: %6.2f s  %6.2f GB/s" % (name, threads[-1], dt, gb / dt))
        run_threads(unpin, parts)
        del base
        mm.close()

    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    print("ceiling: H2D from cudaHostAlloc memory %.2f GB/s" % h2d_gbs(host))


if __name__ == "__main__":
    main()
