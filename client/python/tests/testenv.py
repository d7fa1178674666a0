# SPDX-License-Identifier: MIT
"""What a torch test needs before it imports torch or aoq: this folder and
the package on sys.path, and torch itself, or exit 77 (skip) without it, or
1 where CI / AOQ_REQUIRE_TORCH says torch must be there."""
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(HERE, ".."), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def require_torch():
    """torch, or the exit that says why not."""
    try:
        import torch
    except ImportError as e:
        if any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH")):
            print("FAIL: torch is required here (CI / AOQ_REQUIRE_TORCH is set): %s" % e)
            sys.exit(1)
        print("SKIP: torch is not installed")
        sys.exit(77)
    return torch


def exit_with(main):
    """Exits with main()'s status, or 1 with the traceback of what it raised."""
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
