# SPDX-License-Identifier: MIT
"""What aoqd runs for aoq.torch: the optimizer classes it steps (with Lion),
the state each keeps, the dtypes and state precisions it takes, and the
checks of what a user passes (parameter groups, hyperparameters) before the
daemon sees them."""
import math

import torch

from . import _lib

_AOQ_DTYPE = {torch.float32: _lib.FP32, torch.bfloat16: _lib.BF16, torch.float16: _lib.FP16}


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), as the lion-pytorch package computes it:
    decoupled weight decay, the sign of an interpolation of the momentum and
    the gradient, then the momentum update.  Runs anywhere torch does, and in
    aoqd through OffloadOptimizer(params, aoq.torch.Lion, ...)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if not lr >= 0 or not all(0 <= b < 1 for b in betas) or not weight_decay >= 0:
            raise ValueError("Lion: lr %r betas %r weight_decay %r out of range" % (lr, betas, weight_decay))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            lr, (b1, b2), wd = g["lr"], g["betas"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_(m.mul(b1).add_(p.grad, alpha=1 - b1).sign_(), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


# The optimizer classes aoqd runs: exact class -> (the daemon's kind, default
# weight_decay).  Subclasses and every other torch.optim.Optimizer run on host
# copies in this process (_HostFallback).  Each is one entry here plus its
# hyperparameters in OffloadOptimizer._hp_of.  SGD with maximize=True falls
# back (aoqd does not implement it).
_DAEMON_CLASSES = {
    torch.optim.AdamW: ("adamw", 1e-2),
    torch.optim.Adam: ("adam", 0.0),
    torch.optim.SGD: ("sgd", 0.0),
    Lion: ("lion", 0.0),
}
# Per kind: (torch state key, the daemon's state kind) of the moments kept.
_STATE_KEYS = {"adamw": (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")),
               "adam": (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")),
               "sgd": (("momentum_buffer", "exp_avg"),), "lion": (("exp_avg", "exp_avg"),)}
_MASTER_DTYPES = (None, "fp32", "bf24", "bf16", torch.float32, torch.bfloat16)
_STATE_PRECISIONS = (None, "fp32", "q8", "q4", "bf16")
# (moments, master) -> the daemon's state precision; moments None: the master's dtype
_PRECISION = {("fp32", None): _lib.STATE_FP32, ("q8", None): _lib.STATE_Q8, (None, None): _lib.STATE_FP32,
              ("fp32", "bf16"): _lib.STATE_BF16, ("q8", "bf16"): _lib.STATE_BF16_Q8,
              ("bf16", "bf16"): _lib.STATE_BF16_ALL, (None, "bf16"): _lib.STATE_BF16_ALL,
              ("q4", None): _lib.STATE_Q4, ("q4", "bf16"): _lib.STATE_BF16_Q4}
# The moments of the default for bf16 parameters (no master_dtype, no
# state_precision) with Adam/AdamW: compressed, beside an fp32 master.  One
# constant (docs/python.md, "The default precision").
_DEFAULT_BF16_MOMENTS = "q8"


def _default_policy(kind, state_precision, dtypes):
    """(state_precision, master) for _PRECISION when master_dtype is None.
    Every offloaded parameter bf16: an fp32 master and, unless
    state_precision says otherwise, _DEFAULT_BF16_MOMENTS moments for
    Adam/AdamW (fp32 for SGD and Lion, which aoqd keeps in no 8-bit form);
    state_precision="bf16" alone means the all-bf16 state (bf16 moments
    exist only beside a bf16 master).  A bf16 master is never the default:
    over 200 steps of a 0.94 B GPT it trained to a loss 6-46 % above the fp32
    master's (tests/bench/RESULTS.md, "The default precision").  Anything
    else (fp32, fp16, fp32 beside bf16, nothing offloaded): an fp32 master
    and fp32 moments unless state_precision says otherwise: torch's AdamW
    bit for bit."""
    if dtypes and all(d == torch.bfloat16 for d in dtypes):
        if state_precision is None and kind in ("adam", "adamw"):
            state_precision = _DEFAULT_BF16_MOMENTS
        if state_precision == "bf16":
            return state_precision, "bf16"
    return state_precision, None



def _number(x):
    """A real number as torch takes one (int, float, numpy scalar, a
    one-element tensor); not a bool or a string."""
    if isinstance(x, (bool, str, bytes)):
        return False
    try:
        float(x)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _check_hp(kind, g):
    """A parameter group's hyperparameters, checked as torch's optimizers
    check theirs and in the ranges aoqd takes (daemon/state.c,
    aoqd_hp_valid): a ValueError naming the value, before aoqd sees it."""
    def bad(k, want):
        raise ValueError("OffloadOptimizer: %s must be %s, got %r" % (k, want, g.get(k)))

    def num(k, lo, hi=math.inf, lo_open=False, hi_open=False):
        v = g.get(k)
        if v is None:
            return
        if not _number(v) or not math.isfinite(float(v)):
            bad(k, "a finite number")
        v = float(v)
        if v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
            bad(k, "in %s%g, %g%s" % ("(" if lo_open else "[", lo, hi, ")" if hi_open else "]"))

    num("lr", 0)
    num("weight_decay", 0)
    if kind == "sgd":
        num("momentum", 0, 1, hi_open=True)
        num("dampening", 0, 1)
        if g.get("nesterov") and not (float(g.get("momentum", 0)) > 0 and float(g.get("dampening", 0)) == 0):
            raise ValueError("OffloadOptimizer: nesterov=True needs momentum > 0 and dampening 0 (as torch's SGD), "
                             "got momentum %r dampening %r" % (g.get("momentum"), g.get("dampening")))
        return
    if kind != "lion":
        num("eps", 0, lo_open=True)
    b = g.get("betas")
    try:
        ok = len(b) == 2 and all(_number(x) and 0 <= float(x) < 1 for x in b)
    except TypeError:
        ok = False
    if not ok:
        bad("betas", "a pair (beta1, beta2), each in [0, 1)")

def _parse_params(params, start=0, taken=()):
    """(param groups with plain tensors, {param: name}): params are tensors,
    (name, tensor) pairs or groups of either; unnamed ones are named by
    their position ("0", "1", ...)."""
    names = {}
    groups = list(params) if not isinstance(params, torch.Tensor) else [params]
    if not groups:
        raise ValueError("OffloadOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    clean, pos = [], start
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError("a parameter group must be a dict with 'params', got %r" % (type(g),))
        g = dict(g)
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) or (isinstance(ps, tuple) and len(ps) == 2
                                                       and isinstance(ps[0], str)) else list(ps)
        plist = []
        for x in ps:
            if isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str):
                n, x = x
            else:
                n = str(pos)
            if not isinstance(x, torch.Tensor):
                raise ValueError("parameter %s: expected a torch.Tensor, got %r" % (n, type(x)))
            if n in names.values() or n in taken:
                raise ValueError("duplicate parameter name %r" % n)
            names[x] = n
            plist.append(x)
            pos += 1
        g["params"] = plist
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        clean.append(g)
    return clean, names
