#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Where the device sat idle in a torch.profiler trace (train_gpt.py
--profile DIR writes one per mode): the busy time of the device's kernels
(any stream), the idle gaps between them longer than --min-gap ms, each
with its place in the step and the kernels on both sides, and the CPU-side
calls that overlap the longest gaps.

    python3 tests/bench/trace_gaps.py DIR/aoq-fp32-swap.json DIR/aoq-fp32-compile.json

A trace holds two steps; a step starts where the device idles longest
(train_gpt.py synchronizes after each step), so the figures are per step
and the gaps listed are inside steps."""
import argparse
import json
import sys


def intervals(events, cats):
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e:
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")))
    out.sort()
    return out


def busy_gaps(iv):
    """The union of the intervals: (busy microseconds, [(gap start, gap
    end, kernel before, kernel after)])."""
    gaps, busy = [], 0.0
    cur_s, cur_e, last = None, None, None
    for s, e, n in iv:
        if cur_e is None:
            cur_s, cur_e, last = s, e, n
            continue
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s, last, n))
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
        if e >= cur_e:
            last = n
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, gaps


def short(name, n=60):
    return name if len(name) <= n else name[:n - 3] + "..."


def report(path, min_gap_ms, top):
    with open(path) as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    kern = intervals(ev, {"kernel", "gpu_memcpy", "gpu_memset"})
    if not kern:
        print("%s: no device events (a CPU run?)" % path)
        return
    busy, gaps = busy_gaps(kern)
    # the steps: split at the longest gap (the synchronize between steps)
    split = max(gaps, key=lambda g: g[1] - g[0]) if gaps else None
    steps = [(kern[0][0], split[0]), (split[1], kern[-1][1])] if split else [(kern[0][0], kern[-1][1])]
    cpu = intervals(ev, {"cpu_op", "python_function", "user_annotation", "cuda_runtime"})
    print("== %s" % path)
    for i, (s0, s1) in enumerate(steps):
        iv = [k for k in kern if k[0] >= s0 and k[1] <= s1]
        b, g = busy_gaps(iv)
        long = [x for x in g if (x[1] - x[0]) >= min_gap_ms * 1000]
        print("step %d: device span %.1f ms, busy %.1f ms, idle %.1f ms (%d gaps >= %.2f ms: %.1f ms)"
              % (i, (s1 - s0) / 1000, b / 1000, (s1 - s0 - b) / 1000, len(long), min_gap_ms,
                 sum(x[1] - x[0] for x in long) / 1000))
        for gs, ge, before, after in sorted(long, key=lambda x: x[0] - x[1])[:top]:
            over = {}
            for cs, ce, cn in cpu:
                if ce > gs and cs < ge:
                    over[cn] = over.get(cn, 0.0) + min(ce, ge) - max(cs, gs)
            names = ", ".join("%s %.1f" % (short(n, 40), t / 1000)
                              for n, t in sorted(over.items(), key=lambda x: -x[1])[:4])
            print("  at %7.1f ms: %6.2f ms idle, after %s, before %s; CPU: %s"
                  % ((gs - s0) / 1000, (ge - gs) / 1000, short(before), short(after), names))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-gap", type=float, default=0.2, metavar="MS")
    ap.add_argument("--top", type=int, default=12, help="gaps listed per step, longest first")
    a = ap.parse_args()
    for p in a.traces:
        report(p, a.min_gap, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
