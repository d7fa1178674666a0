#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoq.torch.OffloadOptimizer on the CPU (host backend) against
torch.optim.AdamW: the GPU test's cases at a smaller width, plus the
save/load round trip through a new process and daemon.  Exit 77 (skip)
without torch, or 1 (fail) when the environment says torch must be there:
CI or AOQ_REQUIRE_TORCH set to anything but "", "0", "false"."""
import os
import sys
import traceback

try:
    import torch  # noqa: F401
except ImportError as e:
    if any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH")):
        print("FAIL: torch is required here (CI / AOQ_REQUIRE_TORCH is set) but %s: %s (python %s); make the venv "
              "with deploy/python-venv.sh" % (type(e).__name__, e, sys.executable))
        sys.exit(1)
    print("SKIP: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import aoq  # noqa: E402
import torch_cases  # noqa: E402


def main():
    torch.set_num_threads(1)
    cases = os.environ.get("AOQ_TORCH_CASES")
    with aoq.Daemon(threads=2) as d:
        try:
            torch_cases.run_cases("cpu", 256, d.socket, cases.split(",") if cases else
                                  ["basic", "accum", "offload", "offload-explicit", "attach", "framework",
                                   "adam-groups", "clip", "window"])
        except Exception:
            traceback.print_exc()
            print(d.log_text()[-3000:])
            return 1
    try:
        torch_cases.resume_case(256, "cpu", 3, lambda: aoq.Daemon(threads=2))
    except Exception:
        traceback.print_exc()
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
