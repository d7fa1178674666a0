# SPDX-License-Identifier: MIT
"""aoq: the optimizer step in a host daemon (aoqd), from Python.

aoq.Client      a session over libaoq (ctypes; numpy arrays or raw addresses)
aoq.Daemon      starts a private aoqd on a socket it created (tests, notebooks)
aoq.torch       OffloadOptimizer, a drop-in torch.optim.Optimizer; aoq.OffloadOptimizer is
                the same class, and `import aoq` alone does not import torch
"""
from ._lib import (ADAM, ADAMW, BF16, EXP_AVG, EXP_AVG_SQ, FP16, FP32, MASTER, PUSH_ACCUMULATE, STATE_BF16,
                   STATE_BF16_ALL, STATE_BF16_Q4, STATE_BF16_Q8, STATE_FP32, STATE_Q4, STATE_Q8, AoqError)
from .client import Client, Hyperparams, StepResult
from .daemon import Daemon

from ._lib import PACKAGE_VERSION as __version__  # noqa: E402  (libaoq's version, checked at load)


def version():
    """The release and the build of the libaoq in use ("0.1.0+<git describe>";
    the release alone when it was not built from a git checkout); its release
    is __version__."""
    from ._lib import check_library
    return check_library()

def __getattr__(name):
    # `from aoq import OffloadOptimizer` as well as `from aoq.torch import
    # OffloadOptimizer`: aoq.torch (and torch) load on the first use only.
    if name == "OffloadOptimizer":
        from .torch import OffloadOptimizer
        return OffloadOptimizer
    raise AttributeError("module 'aoq' has no attribute %r" % name)


__all__ = ["Client", "Daemon", "AoqError", "StepResult", "Hyperparams", "FP32", "BF16", "FP16", "ADAMW", "ADAM",
           "STATE_FP32", "STATE_Q8", "STATE_BF16", "STATE_BF16_Q8", "STATE_BF16_ALL", "STATE_Q4", "STATE_BF16_Q4",
           "PUSH_ACCUMULATE", "MASTER", "EXP_AVG", "EXP_AVG_SQ"]
