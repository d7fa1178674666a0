#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""GPU correctness tests of aoq.torch.OffloadOptimizer against
torch.optim.AdamW on the GPU in fp32 (torch.testing.assert_close defaults):
Linear(32->131072) -> Linear(131072->64, frozen) -> Linear(64->64) ->
Linear(64->128), 10 steps with CosineAnnealingLR; with gradient accumulation
2; with offload_gradients; under bf16 autocast; under torch.compile; save
after 3 steps -> load in a new process and daemon -> 3 more == uninterrupted.

    tests/gpu/python/test_offload.py [--device cuda:0] [--width 131072] [--cases a,b]
Exit 0 ok, 1 fail, 77 skip (no torch / no such device)."""
import argparse
import os
import sys
import traceback

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python", "tests"))
import aoq  # noqa: E402
import torch_cases  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--width", type=int, default=131072)
    ap.add_argument("--cases", default="basic,accum,offload,offload-explicit,attach,framework,adam-groups,clip,"
                                       "autocast,compile")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--threads", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cases = [c for c in a.cases.split(",") if c]
    if "autocast" in cases and dev.type == "cpu":
        cases[cases.index("autocast")] = "autocast-cpu"
    try:
        with aoq.Daemon(threads=a.threads) as d:
            try:
                torch_cases.run_cases(a.device, a.width, d.socket, cases)
            except Exception:
                print(d.log_text()[-3000:])
                raise
        if not a.no_resume:
            torch_cases.resume_case(a.width, a.device, 3, lambda: aoq.Daemon(threads=a.threads))
    except Exception:
        traceback.print_exc()
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
