#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The host memory a GPU's copies take from the CPU update, and the step it sets.

With nothing on the GPU every step moves each parameter's gradient to the host
(D2H) and its new value back (H2D). Those copies are DMA into and out of the
same DRAM the CPU update streams through: per parameter and step, 2 B written
by the copy engines and 2 B read by them (bf16), on top of the kernel's own
bytes (kernels/README.md, "Bytes per parameter per step"). This benchmark
measures, in one run on one host:

  - the kernels' streaming rates and the non-temporal triad (bench-kernels
    --modes, 15 threads as aoqd's default workers on 16 vCPUs), alone;
  - the same while two CUDA streams copy pinned buffers at PACE GB/s each way
    (the rate a step of --params bf16 parameters needs to finish in --target
    seconds), and while they copy as fast as they can;

and prints the step the CPU update alone sets for --params parameters under
each load, against --target (by default 1.25 x --gpu-step, the goal
"bf16 master + q8 + delayed <= 1.25x on-GPU AdamW with nothing on the GPU").

  python3 tests/bench/dma_share.py --bench-kernels B [--gpu-step S | --target S]
      [--params N] [-n ELEMS] [-t THREADS] [-r REPS] [--rounds K] [--loads none,pace,max]

The copies need torch with CUDA (--loads none runs without). Figures: tests/bench/RESULTS.md.
"""
import argparse
import collections
import re
import subprocess
import sys
import threading
import time

# kernel bytes per parameter per step (kernels/README.md), the copy engines'
# (bf16 gradient down, bf16 parameter up)
KBYTES = {"fp32": 28.0, "q8": 16.0625, "bf16q8": 12.0625, "bf16q8_noparam": 10.0625}
DMA_BYTES = 4.0


class Load:
    """Copies pinned host memory to and from the device on two streams,
    each way at `rate` bytes/s (0: as fast as they go), over rings larger
    than any cache, until stopped; counts the bytes each way."""

    def __init__(self, torch, rate, ring=1 << 30, chunk=32 << 20):
        self.torch, self.rate, self.chunk = torch, rate, chunk
        self.nchunks = ring // chunk
        self.h_src = torch.empty(ring, dtype=torch.uint8, pin_memory=True)
        self.h_dst = torch.empty(ring, dtype=torch.uint8, pin_memory=True)
        self.h_src.fill_(1)
        self.h_dst.fill_(2)
        self.d_src = torch.ones(ring, dtype=torch.uint8, device="cuda")
        self.d_dst = torch.empty(ring, dtype=torch.uint8, device="cuda")
        self.s_down = torch.cuda.Stream()
        self.s_up = torch.cuda.Stream()
        self.done = 0  # bytes each way whose copies have completed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        torch = self.torch
        pending = collections.deque()
        t0 = time.perf_counter()
        issued = 0
        k = 0
        while not self.stop.is_set():
            o = (k % self.nchunks) * self.chunk
            k += 1
            sl = slice(o, o + self.chunk)
            with torch.cuda.stream(self.s_down):
                self.h_dst[sl].copy_(self.d_src[sl], non_blocking=True)
                e1 = torch.cuda.Event()
                e1.record(self.s_down)
            with torch.cuda.stream(self.s_up):
                self.d_dst[sl].copy_(self.h_src[sl], non_blocking=True)
                e2 = torch.cuda.Event()
                e2.record(self.s_up)
            pending.append((e1, e2))
            issued += self.chunk
            while len(pending) > 3:
                a, b = pending.popleft()
                a.synchronize()
                b.synchronize()
                self.done += self.chunk
            if self.rate:
                ahead = t0 + issued / self.rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
        for a, b in pending:
            a.synchronize()
            b.synchronize()
            self.done += self.chunk

    def __enter__(self):
        self.thread.start()
        time.sleep(0.5)  # past the first copies
        self.t0, self.b0 = time.perf_counter(), self.done
        return self

    def __exit__(self, *exc):
        self.gbs = (self.done - self.b0) / (time.perf_counter() - self.t0) * 1e-9
        self.stop.set()
        self.thread.join()


def bench_kernels(args):
    cmd = [args.bench_kernels, "--modes", "-n", str(args.n), "-t", str(args.threads), "-r", str(args.reps)]
    if args.kernel:
        cmd += ["-k", args.kernel]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        m = re.match(r"RESULT (\S+) gparams_per_s=(\S+) gbps=(\S+)", line)
        if not m:
            continue
        name, gp, gb = m.group(1), float(m.group(2)), float(m.group(3))
        if name == "stream_triad_nt":
            res["triad"] = gb
        elif name == "stream_triad_nt_again":
            res["triad_end"] = gb
        else:
            for key, suffix in (("fp32", "_fp32_bf16_bf16"), ("q8", "_q8_bf16_bf16"),
                                ("bf16q8", "_bf16q8_bf16_bf16"), ("bf16q8_noparam", "_bf16q8_bf16_bf16_noparam")):
                if name.endswith(suffix) and not name.startswith("memonly") and key not in res:
                    res[key] = gp
    missing = [k for k in ("triad", "fp32", "q8", "bf16q8", "bf16q8_noparam") if k not in res]
    if missing:
        sys.exit("dma_share: bench-kernels printed no %s:\n%s" % (", ".join(missing), out))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench-kernels", required=True, help="the bench-kernels binary")
    ap.add_argument("--params", type=float, default=3.49e9, help="parameters of the model (default 3.49e9: GPT 3.48 B)")
    ap.add_argument("--gpu-step", type=float, default=None, help="the same call's on-GPU AdamW step (s)")
    ap.add_argument("--target", type=float, default=None, help="step to reach (s; default 1.25 x --gpu-step)")
    ap.add_argument("-n", type=int, default=1 << 28, help="bench-kernels -n (elements per tensor)")
    ap.add_argument("-t", "--threads", type=int, default=15, help="bench-kernels -t (default 15, aoqd's workers)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-k", "--kernel", default=None, help="bench-kernels -k (default: its best)")
    ap.add_argument("--loads", default="none,pace,max")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.target is None:
        if args.gpu_step is None:
            ap.error("give --gpu-step (the on-GPU step of the same call) or --target")
        args.target = 1.25 * args.gpu_step
    loads = args.loads.split(",")
    for name in loads:
        if name not in ("none", "pace", "max"):
            ap.error("--loads: none, pace or max, not %r" % name)

    torch = None
    if any(name != "none" for name in loads):
        import torch
        if not torch.cuda.is_available():
            sys.exit("dma_share: the copies need a CUDA device (--loads none runs without)")
    pace = 2.0 * args.params / args.target  # bytes/s each way
    print("# %s, params %.3g, target step %.3f s: pace %.1f GB/s each way; bench-kernels -t %d -n %d -r %d"
          % (torch.cuda.get_device_name() if torch else "no device", args.params, args.target, pace * 1e-9, args.threads, args.n, args.reps),
          flush=True)

    rows = []
    for rnd in range(args.rounds):
        for name in loads:
            if name == "none":
                res = bench_kernels(args)
                res["dma"] = 0.0
            else:
                with Load(torch, pace if name == "pace" else 0) as ld:
                    res = bench_kernels(args)
                res["dma"] = ld.gbs
                del ld
                torch.cuda.empty_cache()
            res["load"], res["round"] = name, rnd + 1
            rows.append(res)
            print("round %d load %-4s DMA %5.1f GB/s each way  triad %6.1f GB/s  fp32 %.2f  q8 %.2f  bf16q8 %.2f"
                  "  bf16q8 no param %.2f G params/s" % (rnd + 1, name, res["dma"], res["triad"], res["fp32"], res["q8"],
                                                        res["bf16q8"], res["bf16q8_noparam"]), flush=True)

    P = args.params
    print()
    print("| round | load | DMA GB/s each way | NT triad GB/s (CPU, under the load) | bf16 master + q8 G params/s "
          "| its update of %.2f G params (s) | / target %.3f s | q8 | fp32 |" % (P * 1e-9, args.target))
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = P / (r["bf16q8"] * 1e9)
        print("| %d | %s | %.1f | %.1f | %.2f | %.3f | %.2f | %.2f | %.2f |"
              % (r["round"], r["load"], r["dma"], r["triad"], r["bf16q8"], t, t / args.target, r["q8"], r["fp32"]))
    none = [r for r in rows if r["load"] == "none"]
    if none:
        b = sorted(r["triad"] for r in none)[len(none) // 2] * 1e9
        print()
        print("Floor from bytes alone, at the median triad with no copies (%.1f GB/s), any kernel:" % (b * 1e-9))
        for key, label in (("bf16q8", "bf16 master + q8, delayed (a parameter copy)"),
                           ("bf16q8_noparam", "bf16 master + q8, the master as the parameter")):
            kb = KBYTES[key]
            t = P * (kb + DMA_BYTES) / b
            print("  %-46s %.4g + %.0f B/param: %.3f s per step = %.2f x the target; the target needs %.0f GB/s"
                  % (label, kb, DMA_BYTES, t, t / args.target, P * (kb + DMA_BYTES) / args.target * 1e-9))
    pace_rows = [r for r in rows if r["load"] == "pace"]
    if pace_rows:
        ts = sorted(P / (r["bf16q8"] * 1e9) for r in pace_rows)
        print("With the copies at the target's pace the update of %.2f G params takes %s s (target %.3f s)"
              % (P * 1e-9, ", ".join("%.3f" % t for t in ts), args.target))


if __name__ == "__main__":
    main()
