#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch doing the kernels' jobs, for bench.sh (same size, same threads).

(a) torch.optim.AdamW(fused=True): fp32 params, grads and moments.
(b) the aoq headline job the way torch users do it: fp32 master, bf16 grad in
    (cast into master.grad), fused fp32 AdamW, bf16 param out (cast).
GB/s counts the bytes the job must move (28 B/param for both), like
bench-kernels; ratio_to_triad uses the non-temporal triad of the same run.
"""
import argparse
import statistics
import time

import torch


def timeit(fn, reps):
    fn()  # warm-up (creates the optimizer state)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--triad-gbps", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = a.params
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {n} params", flush=True)
    results = []

    def record(name, t, bytes_per):
        gps = n / t * 1e-9
        gbps = n * bytes_per / t * 1e-9
        ratio = gbps / a.triad_gbps if a.triad_gbps > 0 else 0.0
        print(f"{name:40s} {t * 1e3:9.2f} ms {gps:8.3f} Gparam/s {gbps:8.1f} GB/s", flush=True)
        results.append((name, gps, gbps, ratio))

    with torch.no_grad():
        # (a) fused AdamW, everything fp32
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, fused=True)
        record("torch_adamw_fused_fp32", timeit(opt.step, a.reps), 28)
        del opt, p

        # (b) bf16 grad in, cast, fused fp32 AdamW, cast to bf16 param out
        master = torch.nn.Parameter(torch.randn(n))
        master.grad = torch.empty(n)
        g16 = (torch.randn(n) * 1e-2).to(torch.bfloat16)
        out16 = torch.empty(n, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([master], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, fused=True)

        def step_b():
            master.grad.copy_(g16)
            opt.step()
            out16.copy_(master)

        record("torch_way_fp32_bf16_bf16", timeit(step_b, a.reps), 28)
        # its parts, to see where torch's time goes
        record("torch_way_part_gradcast", timeit(lambda: master.grad.copy_(g16), a.reps), 6)
        record("torch_way_part_step", timeit(opt.step, a.reps), 28)
        record("torch_way_part_paramcast", timeit(lambda: out16.copy_(master), a.reps), 6)

    for name, gps, gbps, ratio in results:
        print(f"RESULT {name} gparams_per_s={gps:.4f} gbps={gbps:.2f} ratio_to_triad={ratio:.3f}")


if __name__ == "__main__":
    main()
