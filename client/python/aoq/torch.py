# SPDX-License-Identifier: MIT
"""OffloadOptimizer: Adam/AdamW in aoqd, as a torch.optim.Optimizer.

    from aoq.torch import OffloadOptimizer
    opt = OffloadOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    opt.attach(model)            # optional: per-module waits instead of one at step()

Gradient pushes (README-python.md has the full story):
  * A post-accumulate-grad hook per parameter pushes the gradient as soon as
    it is final for the step, so the CPU update overlaps the rest of backward.
  * "Final" needs the number of backward passes per step (micro-batches).
    Give grad_accumulation_steps=N, or leave it None: the first step that has
    gradients pushes everything at step() and counts the backward passes;
    later steps stream with that count.  A step with fewer passes is
    completed at step(); one with more raises (the update already started).
  * offload_gradients=True: every non-final micro-batch is pushed at once
    with AOQ_PUSH_ACCUMULATE (the daemon sums in fp32) and param.grad is
    dropped, so gradients never accumulate on the device.  A step that ends
    before its final push (fewer passes than counted) pushes zeros as final.
"""
import itertools
import math
import collections
import logging
import os
import time
import sys
import threading
import warnings
import weakref

import torch

from . import _lib
from ._graph import _OPTIMIZERS, _PUSH_OP, _WAIT_OP, _GraphTap, _is_compiling, _next_optimizer_id
from ._share import (_AUTO_PROBE_STEP, _DeviceShare, _agree, _auto_again, _auto_choice, _auto_late,  # noqa: F401
                     _dist_group, _first_ranks, _share_bytes, _state_copy)
from .client import Client

__all__ = ["OffloadOptimizer", "Lion"]

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
_MASTER_DTYPES = (None, "fp32", "bf16", torch.float32, torch.bfloat16)

# The staging window's default (docs/python.md, "Staging window"): a model
# whose gradients and parameters fit in this many bytes gets a slot per
# tensor; a larger one streams through a window of this size.
STAGING_BUDGET = 1 << 30


def staging_window_for(params, staging_window=None, delayed_update=False):
    """The Register.window (bytes, 0 = a slot per tensor) for the offloaded
    parameters: staging_window when given, else 0 when every gradient and
    parameter fit in STAGING_BUDGET (or with the delayed update, which needs
    a slot per tensor), else STAGING_BUDGET."""
    if staging_window is not None:
        if isinstance(staging_window, bool) or not isinstance(staging_window, int) or staging_window < 0:
            raise ValueError("staging_window must be None or a number of bytes >= 0, got %r" % (staging_window,))
        if staging_window and delayed_update:
            raise ValueError("staging_window needs delayed_update=False (the delayed update keeps a slot per "
                             "tensor)")
        return staging_window
    if delayed_update:
        return 0
    need = sum(2 * p.numel() * p.element_size() for p in params)
    return 0 if need <= STAGING_BUDGET else STAGING_BUDGET
_STATE_PRECISIONS = (None, "fp32", "q8", "bf16")
# (moments, master) -> the daemon's state precision; moments None: the master's dtype
_PRECISION = {("fp32", None): _lib.STATE_FP32, ("q8", None): _lib.STATE_Q8, (None, None): _lib.STATE_FP32,
              ("fp32", "bf16"): _lib.STATE_BF16, ("q8", "bf16"): _lib.STATE_BF16_Q8,
              ("bf16", "bf16"): _lib.STATE_BF16_ALL, (None, "bf16"): _lib.STATE_BF16_ALL}


class _Slot:
    """One parameter stepped by aoqd."""
    __slots__ = ("t", "p", "x", "name", "group", "numel", "host_param", "host_grad", "count", "final", "held",
                 "inflight", "wait", "covered", "seen", "seen_ver", "fwd", "ver", "ddp", "in_graph", "moved",
                 "graph_calls", "graph_ok", "graph_pushed", "tap")

    def __init__(self, t, p, name, group):
        self.t, self.p, self.name, self.group = t, p, name, group
        self.x = _local(p)      # what aoqd steps: p, or an FSDP2 parameter's local shard
        self.numel = self.x.numel()
        self.ddp = False        # owned by a DistributedDataParallel: pushed once averaged (comm hook)
        self.host_param = self.host_grad = None
        self.count = 0          # backward passes of this step that reached the parameter
        self.final = False      # the step's final gradient has been pushed
        self.held = None        # offload_gradients, learning step: the latest micro-batch's gradient
        self.inflight = []      # device gradients whose copy may still run (CUDA)
        self.wait = False       # an update was pushed that the device has not waited for
        self.covered = False    # a forward pre-hook (attach) waits for it
        self.seen = None        # p.grad at the last hook (or push) and its version counter: a change
        self.seen_ver = -1      # after that is a user edit (clipping, GradScaler.unscale_, ...)
        self.fwd = False        # the global forward pre-hook met it in a forward (outside compiled code)
        self.ver = self.x._version   # x's version counter after our last write: another value is a user write
        self.in_graph = False   # the in-graph wait (aoq::wait_params) reached it since the last probe
        self.moved = False      # gpu_state_budget="auto" moved its state to the device share
        self.graph_calls = 0    # aoq::push_grad calls this step (compiled backward)
        self.graph_ok = None    # one call per backward pass (not tied twice into a graph): may push in-graph
        self.graph_pushed = False   # this step's final gradient went from the compiled backward
        self.tap = None         # the 0-d tensor that names it in compiled backward (aoq::push_grad)


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


def _is_dtensor(t):
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _local(t):
    """The tensor aoq reads and writes for t: a DTensor's local shard
    (FSDP2's sharded parameters and gradients), else t itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    return DistributedDataParallel


def _is_fsdp2(mod):
    """mod is a fully_shard (FSDP2) module (only when the program imported FSDP)."""
    m = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(m, "FSDPModule", None) if m is not None else None
    return cls is not None and isinstance(mod, cls)


def _like_param(p, t):
    """A state tensor t (local, p's local shape) as p is: a DTensor with p's
    mesh and placements for an FSDP2 parameter (so DCP shards and reshards
    it), else t."""
    if not _is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _fsdp_unit_params(mod):
    """The parameters an FSDP2 module all-gathers in its pre-forward: those of
    its subtree that no nested fully_shard module owns."""
    out, stack = [], [mod]
    while stack:
        m = stack.pop()
        out.extend(p for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m.children() if not _is_fsdp2(c))
    return out


def _ddp_comm_hook(state, bucket):
    """DistributedDataParallel communication hook of an OffloadOptimizer:
    averages the bucket as DDP's default hook does (divide by the world
    size, all-reduce), and once the all-reduce has completed pushes the
    bucket's gradients to aoqd (OffloadOptimizer._ddp_push)."""
    ref, group = state
    import torch.distributed as dist
    buf = bucket.buffer()
    buf.div_(group.size() if group is not None else dist.get_world_size())
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    opt = ref()
    if opt is None:
        return fut.then(lambda f: f.value()[0])
    opt._queue_seen()
    params, grads = bucket.parameters(), bucket.gradients()

    def done(f):
        t = f.value()[0]
        o = ref()
        if o is not None:
            o._ddp_push(params, grads)
        return t
    return fut.then(done)


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


class _HostFallback:
    """An optimizer class aoqd does not run: optimizer_class steps host
    copies of the parameters in this process, as torchao's
    CPUOffloadOptimizer does (gradients copied to the host at step(), the
    updated parameters copied back).  Synchronous; the state lives in
    self.opt (positional torch state_dict).  Parameters already on the CPU
    are stepped in place (their own tensors, torch's numerics exactly); a
    device parameter changed since the last step (its version counter
    moved: model.load_state_dict, a user edit) is copied to the host again
    before the step, so the host copy never overwrites it with stale values."""

    # False: CPU parameters get host copies too (the tests run the device
    # path, copies and staleness checks, on a CPU-only machine this way).
    cpu_in_place = True

    def __init__(self, owner, optimizer_class, kwargs):
        self.owner = owner
        self.host = {}                               # device param -> host copy (CPU params: itself)
        self.ver = {}                                # device param -> its version after our last write
        host_groups = []
        for g in owner.param_groups:
            hg = {k: v for k, v in g.items() if k != "params"}
            hg["params"] = [self._host_of(p) for p in g["params"]]
            host_groups.append(hg)
        self.opt = optimizer_class(host_groups, **kwargs)

    def _host_of(self, p):
        h = self.host.get(p)
        if h is None:
            if p.device.type == "cpu" and self.cpu_in_place:
                h = p
            else:
                pin = p.device.type == "cuda" and torch.cuda.is_available()
                h = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                with torch.no_grad():
                    h.copy_(p.detach())
                h.requires_grad_(p.requires_grad)
                self.ver[p] = p._version
            self.host[p] = h
        return h

    def add_group(self, g):
        hg = {k: v for k, v in g.items() if k != "params"}
        hg["params"] = [self._host_of(p) for p in g["params"]]
        self.opt.add_param_group(hg)

    def step(self, loss):
        for g, hg in zip(self.owner.param_groups, self.opt.param_groups):
            for k, v in g.items():          # LR schedulers change the owner's groups
                if k != "params":
                    hg[k] = v
            for p, h in zip(g["params"], hg["params"]):
                if h is p:
                    continue
                if p._version != self.ver[p]:   # changed on the device since our last copy
                    h.copy_(p.detach())
                if p.grad is None:
                    h.grad = None
                    continue
                if h.grad is None:
                    h.grad = torch.empty_like(h)
                h.grad.copy_(p.grad)
        self.opt.step()
        for p, h in self.host.items():
            if h is not p and p.grad is not None:
                p.copy_(h)
                self.ver[p] = p._version
        return loss

    def zero_grad(self, set_to_none=True):
        for g in self.owner.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(_copied_state_dict(sd))
        for g, hg in zip(self.owner.param_groups, self.opt.param_groups):
            for k, v in hg.items():
                if k != "params":
                    g[k] = v


def _copied_state_dict(sd):
    """sd with every state tensor copied (torch's load_state_dict keeps views
    of the loaded tensors where dtype and device already match)."""
    state = {k: ({kk: (vv.detach().clone() if torch.is_tensor(vv) else vv) for kk, vv in st.items()}
                 if isinstance(st, dict) else st) for k, st in sd["state"].items()}
    return dict(sd, state=state)


def _canon_fqn(name):
    """A parameter name without the wrappers' components (DDP's "module.",
    torch.compile's "_orig_mod."), as torch.distributed.checkpoint names
    parameters."""
    return ".".join(x for x in name.split(".") if x not in ("module", "_orig_mod"))


def _dist_rank():
    """torch.distributed's global rank when a process group is up, else $RANK, else 0."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


_jobs_made = itertools.count(1)
_optimizers_made = itertools.count(1)


def _replica_seed(seed):
    """The stochastic rounding seed to register.  seed=0 in a process group
    of more than one rank: every rank's n-th OffloadOptimizer gets the same
    seed, so data-parallel replicas round alike (with the daemon's own pick,
    one per session, their bf16 masters and q8 moments drifted apart).
    Alone: 0, the daemon picks.  Counts every optimizer, so that the n-th
    matches across ranks whatever each was given."""
    n = next(_optimizers_made)
    if seed:
        return seed
    try:
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except ImportError:
        world = 1
    if max(world, int(os.environ.get("WORLD_SIZE", "1"))) < 2:
        return 0
    return (0x9e3779b97f4a7c15 * (n + 0x5eed)) % (1 << 64) or 1


def _job_default():
    """torch-PID for a process's first optimizer without a job name,
    torch-PID-2, -3, ... for the next ones (two optimizers of one process,
    a GAN's say, are two sessions; the same name would be refused BUSY)."""
    n = next(_jobs_made)
    return "torch-%d" % os.getpid() if n == 1 else "torch-%d-%d" % (os.getpid(), n)


def _local_group():
    """(local world size, local rank) of this data-parallel rank on its node:
    torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK, else (with a process group
    up and neither set) the whole world as one node.  (0, 0) when alone."""
    lw, lr = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
    if lw is not None and lr is not None:
        lw, lr = int(lw), int(lr)
    else:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("shared=True needs torch.distributed initialized, or LOCAL_WORLD_SIZE and LOCAL_RANK "
                             "(torchrun sets them)")
        lw, lr = dist.get_world_size(), dist.get_rank()
    if lw < 2:
        return 0, 0
    if not 0 <= lr < lw or lw > 64:
        raise ValueError("shared=True: local rank %d of local world size %d (2 to 64 ranks)" % (lr, lw))
    return lw, lr


def _shared_job_default():
    """A job name every rank of the job agrees on: global rank 0's
    torch-PID, broadcast (every node's daemon sees only its own ranks)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shared=True without torch.distributed: give job= (the same on every local rank)")
    name = [_job_default()]
    dist.broadcast_object_list(name, src=0)
    return name[0]


class OffloadOptimizer(torch.optim.Optimizer):
    """torchao's CPUOffloadOptimizer constructor plus aoq's options.

    params: tensors, (name, tensor) pairs (named_parameters()) or param
    groups whose "params" hold either.  Names key state_dict(); without
    them a parameter is named by its position ("0", "1", ...).
    optimizer_class: torch.optim.AdamW or torch.optim.Adam (the daemon's
    kinds); it also steps the parameters smaller than minimal_size on the
    device.  kwargs: lr, betas, eps, weight_decay (defaults of
    optimizer_class) and options of optimizer_class for the small ones.
    device: the aoq device ("cuda:0", "cpu", "xpu:0") when not the
    parameters'; copy_mode: "native" (libaoq copies with the CUDA backend or
    host memory) or "framework" (torch copies through pinned host buffers;
    default for devices libaoq cannot drive).  master_dtype None|"bf16"
    (bf16 master with stochastic rounding); state_precision, the moments:
    None (the master's dtype: fp32, or with master_dtype="bf16" bf16, the
    all-bf16 state of torchao's full-bf16 offload, 6 bytes per parameter),
    "fp32", "q8" (blockwise 8-bit), "bf16" (with master_dtype="bf16" only).
    max_grad_norm / skip_nonfinite: global clipping and step skipping in the
    daemon (every parameter is then offloaded, so the norm is global).
    delayed_update: ZeRO-Offload's DPU (parameters one step stale); call
    flush() before evaluating or saving the model.
    gpu_state_budget: bytes of device memory for optimizer state kept on
    the device (partial offload): the first parameters in order (the last
    gradients of backward) whose state fits are stepped there by
    optimizer_class (fused on CUDA), on an fp32 master where aoq's would be
    one; 0 (default): everything in aoqd.  Not with max_grad_norm /
    skip_nonfinite (they need every gradient in the daemon).
    staging_window: bytes of host staging (the session's arena) that
    gradients and parameters stream through; 0 = a copy of every gradient
    and parameter on the host; None (default): 0 when that is at most
    STAGING_BUDGET (1 GiB), else 1 GiB (see staging_window_for).
    graph_push: inside a torch.compile'd backward, push each gradient as
    the graph computes it (aoq::push_grad) instead of from the hook after
    the whole graph (default True; docs/python.md, "Import swap").
    shared: True: the data-parallel ranks of this job on this node share one
    optimizer state in aoqd (a replica group, docs/python.md "One state for
    data-parallel replicas"): local world and rank from LOCAL_WORLD_SIZE and
    LOCAL_RANK (torchrun), else the whole process group as one node; the job
    name is global rank 0's unless job= is given; a slot per tensor, no
    delayed update.  A rank lost mid-step makes the others' next call raise
    (PEER_LOST); with a named job (job= or AOQ_JOB) and a lease, the group's
    state is then leased and the next group of the job resumes it.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, offload_gradients=False, minimal_size=4096,
                 device=None, socket=None, state_precision=None, master_dtype=None, max_grad_norm=None,
                 delayed_update=False, skip_nonfinite=False, grad_accumulation_steps=None, copy_mode=None,
                 seed=0, job=None, rank=None, model=None, grad_edits=None, gpu_state_budget=0, lease=None,
                 staging_window=None, timeout=None, graph_push=True, shared=False, **kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError("optimizer_class must be a torch.optim.Optimizer subclass, got %r" % (optimizer_class,))
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError("unknown master_dtype %r; allowed: None, 'fp32', 'bf16' (or torch.float32, "
                             "torch.bfloat16)" % (master_dtype,))
        if state_precision not in _STATE_PRECISIONS:
            raise ValueError("unknown state_precision %r; allowed: None, 'fp32', 'q8', 'bf16' (with master_dtype="
                             "'bf16')" % (state_precision,))
        master = "bf16" if master_dtype in ("bf16", torch.bfloat16) else None
        if (state_precision, master) not in _PRECISION:
            raise ValueError("state_precision %r needs master_dtype='bf16' (allowed with an fp32 master: None, "
                             "'fp32', 'q8')" % (state_precision,))
        if copy_mode not in (None, "native", "framework"):
            raise ValueError("unknown copy_mode %r; allowed: None, 'native', 'framework'" % (copy_mode,))
        if grad_edits not in (None, True, False):
            raise ValueError("grad_edits must be None (detect), True or False, got %r" % (grad_edits,))
        if gpu_state_budget != "auto" and (isinstance(gpu_state_budget, bool) or not isinstance(gpu_state_budget, int)
                                           or gpu_state_budget < 0):
            raise ValueError("gpu_state_budget must be a number of bytes >= 0 (0: everything in aoqd) or 'auto', "
                             "got %r" % (gpu_state_budget,))
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int) or lease < 0):
            raise ValueError("lease must be None (the daemon's lease_seconds), 0 (none) or seconds > 0, got %r"
                             % (lease,))
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not _number(max_grad_norm)
                                          or not max_grad_norm >= 0):
            raise ValueError("max_grad_norm must be None or a number >= 0 (0: no clipping), got %r" % (max_grad_norm,))
        if timeout is not None and (isinstance(timeout, bool) or not _number(timeout) or not timeout > 0):
            raise ValueError("timeout must be None (120 s) or seconds > 0, got %r" % (timeout,))
        if device is not None:
            from .client import check_device
            check_device(device)
        self._constructed = False
        self._fallback = None
        self._global_hook = self._global_post = None
        self._slots = []
        self._share = None
        self._client = None
        if optimizer_class not in _DAEMON_CLASSES or (optimizer_class is torch.optim.SGD and kwargs.get("maximize")):
            self._init_fallback(params, optimizer_class, kwargs)
            return
        kind, wd_default = _DAEMON_CLASSES[optimizer_class]
        for k in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(k):
                raise ValueError("OffloadOptimizer: %s=True is not supported by aoqd" % k)
        self._kind = kind
        self._optimizer_class = optimizer_class
        self._dev_kwargs = dict(kwargs)
        defaults = dict(lr=kwargs.pop("lr", 1e-4 if kind == "lion" else 1e-3),
                        betas=tuple(kwargs.pop("betas", (0.9, 0.99) if kind == "lion" else (0.9, 0.999))),
                        eps=kwargs.pop("eps", 1e-8), weight_decay=kwargs.pop("weight_decay", wd_default))
        if kind == "sgd":
            defaults.update(momentum=kwargs.pop("momentum", 0.0), dampening=kwargs.pop("dampening", 0.0),
                            nesterov=bool(kwargs.pop("nesterov", False)))

        clean, names = _parse_params(params)
        super().__init__(clean, defaults)
        for g in self.param_groups:
            _check_hp(kind, g)
        self._names = names                       # param -> name
        self._by_name = {n: p for p, n in names.items()}
        # Gradient edits between backward and step(): None learns them at the
        # first step.  offload_gradients drops p.grad in the hook, so there is
        # nothing to edit (clip with max_grad_norm= there).
        if offload_gradients and grad_edits:
            raise ValueError("grad_edits=True needs offload_gradients=False (offload_gradients drops p.grad in "
                             "the hook; use max_grad_norm= for clipping)")
        self._edits = False if offload_gradients else grad_edits
        # GradScaler hands this optimizer grad_scale / found_inf instead of
        # unscaling in place behind its back (its unscale kernel does not bump
        # the gradients' version counters): step() unscales and skips.
        self._step_supports_amp_scaling = True
        self._edit_warned = False

        self.offload_gradients = bool(offload_gradients)
        self.grad_accumulation_steps = grad_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.delayed_update = bool(delayed_update)
        self._learned = None if grad_accumulation_steps is None else int(grad_accumulation_steps)
        offload_all = bool(max_grad_norm) or bool(skip_nonfinite)

        # Split: aoqd steps the large trainable parameters, optimizer_class the rest on the device,
        # and the GPU share (gpu_state_budget) the first large ones on the device too.
        big, small_groups = [], []
        self._auto = gpu_state_budget == "auto" and not offload_all
        self._fp32_master = master is None
        self._nstep = 0
        self._push_log = None           # "auto": the slots in the order of their final push, on the probe step
        self.auto_split = None          # "auto": what the last probe measured, what all moved (a dict)
        self._auto_probe = _AUTO_PROBE_STEP   # "auto": the step (count) whose end probes next; None: done
        self._auto_dist = False         # "auto": torch.distributed when the replicas agree on splits (_dist_group)
        self._probe_fwd_armed = False   # "auto": mark the next forward's start (the probe step's)
        self._probe_fwd = self._probe_fwd_last = None   # "auto": marks of the probe step's forward
        share_left = 0 if offload_all or gpu_state_budget == "auto" else gpu_state_budget
        share = []                                 # (group, parameter)
        for gi, g in enumerate(self.param_groups):
            sg = {k: v for k, v in g.items() if k != "params"}
            sg["params"] = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if offload_all or p.numel() >= minimal_size:
                    cost = _share_bytes(p, kind, master)
                    if cost <= share_left:
                        share_left -= cost
                        share.append((gi, p))
                    else:
                        share_left = 0             # the share is the first parameters, without gaps
                        big.append((gi, p))
                else:
                    sg["params"].append(p)
            small_groups.append(sg)
        self._share = _DeviceShare(share, self.param_groups, optimizer_class, self._dev_kwargs, kind,
                                   fp32_master=master is None) if share else None
        self._small_params = [p for g in small_groups for p in g["params"]]
        dev_kwargs = {k: v for k, v in self._dev_kwargs.items()
                      if k not in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")}
        self._dev_only_kwargs = dev_kwargs
        self._dev_opt = (optimizer_class([g for g in small_groups if g["params"]] or small_groups[:1], **dev_kwargs)
                         if self._small_params else None)
        self._dev_group_of = [i for i, g in enumerate(small_groups) if g["params"]]

        # Device and copy mode.
        devs = {p.device for _, p in big}
        if len(devs) > 1:
            raise ValueError("OffloadOptimizer: parameters on several devices %s (one optimizer per device)" % devs)
        tdev = devs.pop() if devs else torch.device("cpu")
        self.device = tdev
        if device is None:
            device = "cpu" if tdev.type == "cpu" else "%s:%d" % (tdev.type, tdev.index or 0)
        if copy_mode is None:
            copy_mode = "native" if tdev.type in ("cpu", "cuda") else "framework"
        if copy_mode not in ("native", "framework"):
            raise ValueError("copy_mode must be 'native' or 'framework'")
        named = bool(job or os.environ.get("AOQ_JOB"))
        local_world, local_rank = _local_group() if shared else (0, 0)
        if local_world > 1:
            # One state for the node's data-parallel ranks (docs/python.md,
            # "One state for data-parallel replicas"): the same job name on
            # every rank, a slot per tensor, no delayed update.  A named job
            # gets the daemon's lease as any session does: a group whose
            # rank died is resumed by the next group of the job.
            if delayed_update:
                raise ValueError("shared=True does not work with delayed_update")
            if staging_window:
                raise ValueError("shared=True needs staging_window=0 (a slot per tensor)")
            staging_window = 0
            if not named:
                job = _shared_job_default()
        job = job or os.environ.get("AOQ_JOB") or _job_default()
        seed = _replica_seed(seed)
        if lease is None and not named:
            # torch-PID never resumes, and a lease costs an undo copy of the
            # state at every update (README, "Lease and resume"): none.
            lease = 0
        if rank is None:
            rank = _dist_rank()
        self.staging_window = staging_window_for([p for _, p in big], staging_window, delayed_update)
        copts = dict(socket=socket, job=job, rank=rank, precision=_PRECISION[(state_precision, master)],
                     max_grad_norm=max_grad_norm or 0.0, skip_nonfinite=skip_nonfinite,
                     delayed_update=delayed_update, seed=seed, lease=lease, window=self.staging_window,
                     timeout=timeout, local_world=local_world, local_rank=local_rank)
        self.local_world, self.local_rank = local_world, local_rank
        self.job = job
        self._client = None
        self.resumed_step = None   # the last completed step when this resumed a leased session
        if big:
            if copy_mode == "native" and tdev.type == "cuda":
                try:
                    self._client = Client(device=device, **copts)
                except _lib.AoqError as e:
                    warnings.warn("aoq: no CUDA backend for %s (%s); using framework copies (slower, host "
                                  "synchronous)" % (device, e.strerror))
                    copy_mode = "framework"
            if self._client is None:
                self._client = Client(device="cpu" if copy_mode == "framework" else device, **copts)
        self.copy_mode = copy_mode
        self._cuda = copy_mode == "native" and tdev.type == "cuda"
        self._framework = copy_mode == "framework"

        # Describe and register.
        self._slots = []
        self._slot_of = {}
        self._sent_hp = []
        if big:
            c = self._client
            for g in self.param_groups:
                hp = self._hp_of(g)
                c.add_group(kind, lr=hp[0], betas=hp[1], eps=hp[2], weight_decay=hp[3], momentum=hp[4],
                            dampening=hp[5], nesterov=hp[6])
                self._sent_hp.append(hp)
            for gi, p in big:
                if p.dtype not in _AOQ_DTYPE:
                    raise ValueError("parameter %s: dtype %s (aoq has fp32, bf16, fp16)" % (names[p], p.dtype))
                x = _local(p)
                if not x.is_contiguous():
                    raise ValueError("parameter %s is not contiguous" % names[p])
                if x.numel() == 0:
                    raise ValueError("parameter %s: this rank's shard is empty (%s sharded over more ranks than its "
                                     "first dimension has rows); raise minimal_size above %d so it is stepped on "
                                     "the device" % (names[p], tuple(p.shape), p.numel()))
                s = _Slot(len(self._slots), p, names[p], gi)
                dt = _AOQ_DTYPE[p.dtype]
                if self._framework:
                    pin = torch.cuda.is_available()
                    s.host_param = torch.empty(x.numel(), dtype=p.dtype, pin_memory=pin)
                    s.host_grad = torch.empty(x.numel(), dtype=p.dtype, pin_memory=pin)
                    s.host_param.copy_(x.detach().reshape(-1))
                    addr = s.host_param.data_ptr()
                else:
                    addr = x.data_ptr()
                c.add_tensor(s.name, addr, numel=x.numel(), param_dtype=dt, grad_dtype=dt, group=gi)
                self._slots.append(s)
                self._slot_of[p] = s
            c.register()
            self.resumed_step = c.resumed
            if self.resumed_step is not None:
                # aoqd's state is the truth: libaoq wrote the parameters
                # (into the host copies in framework mode).
                if self._framework:
                    with torch.no_grad():
                        for s in self._slots:
                            s.p.view(-1).copy_(s.host_param)
                msg = "resumed job %s rank %d at step %d from aoqd" % (job, rank, self.resumed_step)
                warnings.warn("aoq: " + msg)
            # The state lives in aoqd (state_dict() reads it).  A non-empty
            # self.state tells torch.distributed.checkpoint's
            # get_optimizer_state_dict that the state exists, so it does not
            # run a hidden zero-gradient step() to create it.
            for s in self._slots:
                self.state[s.p] = {}
            for s in self._slots:
                s.p.register_post_accumulate_grad_hook(self._make_hook(s))
        self._step_started = False
        self._hooks_pushed = False
        self._inflight_bytes = 0
        self._inflight_fifo = collections.deque()
        self.offload_window_bytes = 1 << 30 if self.offload_gradients else 0
        self.last_result = None
        self._any_wait = False          # some slot may have s.wait set (module state_dict hooks check it)
        self._hooked = weakref.WeakSet()    # modules with our state_dict / load_state_dict pre-hooks
        self._ddps = weakref.WeakSet()      # DistributedDataParallel modules whose comm hook is ours
        self._fsdp_units = weakref.WeakKeyDictionary()   # FSDP2 module -> slots its pre-forward all-gathers
        self._lock = threading.RLock()      # DDP pushes come from the process group's threads
        self._seen_queued = False
        self._mod_handles = []
        self._slot_by_addr = {}           # data_ptr -> slot, for the in-graph waits
        self._not_slots = set()           # data_ptrs of parameters in compiled graphs that are not ours
        self._graph_waits = weakref.WeakSet()   # compiled modules whose graphs wait per module (aoq::wait_params)
        self._tapped = weakref.WeakKeyDictionary()   # compiled module -> its (module, name) of our parameters
        self._constructed = True
        if self._slots:
            # Import swap = attach: before any module runs, the current stream
            # waits for that module's own parameters only (no host sync).
            # (through a weak reference: the global registry must not keep the optimizer alive)
            ref = weakref.ref(self)

            oid = _next_optimizer_id()
            _OPTIMIZERS[oid] = ref
            self._oid = oid
            wait_op = _WAIT_OP
            taps = _PUSH_OP is not None and graph_push
            self._slot_by_t = {}
            tap_attr = self._tap_attr = "_aoq_tap%d" % oid
            if taps:
                for s in self._slots:
                    if s.x is s.p:        # not an FSDP2 shard (DTensor)
                        s.tap = torch.tensor((oid << 32) | s.t, dtype=torch.int64)
                        setattr(s.p, tap_attr, s.tap)
                        self._slot_by_t[s.t] = s

            def pre(mod, args):
                if _is_compiling():
                    # traced into the graph: an opaque op that waits at run time
                    # (the parameters twice: AOTAutograd may hand the mutated list over as
                    # copies, the read-only one stays the parameters themselves)
                    if wait_op is not None:
                        ps = [p for p in mod._parameters.values() if p is not None]
                        if ps:
                            with torch.no_grad():
                                wait_op(ps, ps, oid)
                    if taps and torch.is_grad_enabled():
                        for name, p in mod._parameters.items():
                            tap = getattr(p, tap_attr, None) if p is not None else None
                            if tap is not None and p.requires_grad:
                                mod.__dict__[name] = _GraphTap.apply(p, tap)
                    return
                opt = ref()
                if opt is not None:
                    opt._global_pre(mod, args)

            def post(mod, args, out):
                # The view goes; the parameter itself stays in __dict__ (torch
                # 2.11's dynamo cannot trace a __dict__ deletion), removed by
                # the eager pre-hook of the compiled module before its next call.
                if taps and _is_compiling():
                    for name, p in mod._parameters.items():
                        if name in mod.__dict__:
                            mod.__dict__[name] = p
            self._global_hook = torch.nn.modules.module.register_module_forward_pre_hook(pre)
            self._global_post = torch.nn.modules.module.register_module_forward_hook(post) if taps else None
            # torch warns at every compiled module's call that a global hook
            # fires for the OptimizedModule too: ours is meant to (it waits
            # there on the first call, then leaves the waits to the graph).
            warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
                                    category=UserWarning)
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------------
    @staticmethod
    def _hp_of(g):
        """(lr, betas, eps, weight_decay, momentum, dampening, nesterov); the
        keys a kind lacks (SGD: betas, eps; the others: SGD's) as defaults."""
        b = g.get("betas", (0.9, 0.999))
        return (float(g["lr"]), (float(b[0]), float(b[1])), float(g.get("eps", 1e-8)), float(g["weight_decay"]),
                float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0)), bool(g.get("nesterov", False)))

    def _state_keys(self, s):
        """(torch state key, daemon state kind) of the moments slot s keeps
        (SGD registered with momentum 0 keeps none)."""
        if self._kind == "sgd" and self._sent_hp[s.group][4] == 0:
            return ()
        return _STATE_KEYS[self._kind]

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self._cuda else None

    def _begin_step(self):
        """Before the first push of a step: the groups' hyperparameters (an
        LR scheduler changes them after step()) go to the daemon."""
        if self._step_started:
            return
        self._step_started = True
        self._reload_written()
        for gi in range(len(self._sent_hp)):      # groups added later (add_param_group) are on the device
            hp = self._hp_of(self.param_groups[gi])
            if hp != self._sent_hp[gi]:
                self._client.set_hyperparams(gi, lr=hp[0], betas=hp[1], eps=hp[2], weight_decay=hp[3],
                                             momentum=hp[4], dampening=hp[5], nesterov=hp[6])
                self._sent_hp[gi] = hp

    def _push(self, s, grad, final):
        with self._lock:        # the hooks' pushes and the DDP hook's (another thread) never interleave
            self._push_locked(s, grad, final)

    def _push_locked(self, s, grad, final):
        self._begin_step()
        grad = _local(grad)
        s.seen, s.seen_ver = grad, grad._version
        if grad.dtype != s.p.dtype or not grad.is_contiguous():
            grad = grad.to(s.p.dtype).contiguous()
        if self._framework:
            s.host_grad.copy_(grad.reshape(-1))          # blocking: the host buffer is read at once
            self._client.push_grad(s.t, s.host_grad.data_ptr(), accumulate=not final)
        else:
            self._client.push_grad(s.t, grad.data_ptr(), accumulate=not final, stream=self._stream())
            if self._cuda:   # the copy runs after the call returns: keep the memory alive
                s.inflight.append(grad)
                self._inflight_fifo.append((s, grad))
                self._inflight_bytes += grad.numel() * grad.element_size()
                self._reap()
                if self.offload_window_bytes:
                    self._trim_inflight()
        if final:
            s.final = True
            s.wait = True
            self._any_wait = True
            if self._push_log is not None:
                if not self._push_log:      # the probe step's first final push: the update starts
                    self._probe_start = self._mark()
                self._push_log.append(s)
            if self._framework and self.delayed_update:
                self._copy_in(s)

    def _drop_oldest(self):
        s, g = self._inflight_fifo.popleft()
        for i, x in enumerate(s.inflight):
            if x is g:
                del s.inflight[i]
                self._inflight_bytes -= g.numel() * g.element_size()
                break

    def _reap(self):
        """CUDA: lets go of the pushed gradients whose copy off the device
        has finished (no blocking), oldest first, so the caching allocator
        can reuse their memory during the rest of backward."""
        fifo = self._inflight_fifo
        while fifo:
            s, g = fifo[0]
            if not any(x is g for x in s.inflight):   # released by _release already
                fifo.popleft()
                continue
            if self._client.grad_pending(s.t):
                break
            self._drop_oldest()

    def _trim_inflight(self):
        """offload_gradients on CUDA: bounds the device memory held by
        gradients whose copy has not finished (waits for the oldest)."""
        while self._inflight_bytes > self.offload_window_bytes and self._inflight_fifo:
            s, g = self._inflight_fifo[0]
            if any(x is g for x in s.inflight):
                self._client.grad_copied(s.t)
                self._drop_oldest()
            else:
                self._inflight_fifo.popleft()

    def _release(self, s):
        """s's update has landed, so its gradient copies are done."""
        for g in s.inflight:
            self._inflight_bytes -= g.numel() * g.element_size()
        s.inflight = []     # the FIFO's entries go at the next _reap

    def _copy_in(self, s):
        with torch.no_grad():
            s.x.view(-1).copy_(s.host_param, non_blocking=s.host_param.is_pinned())
        s.ver = s.x._version

    def _wait_all(self):
        """The current stream waits for every pending update (no host sync
        on the CUDA backend): what a module's state_dict() and
        load_state_dict() do before they touch the parameters."""
        if not self._any_wait:
            return
        self._any_wait = False
        for s in self._slots:
            if s.wait:
                self._wait(s)
        if self._inflight_fifo:
            self._reap()

    def _reload_written(self):
        """Parameters the user wrote since our last write (their version
        counter moved: model.load_state_dict, an in-place edit under
        no_grad) become the daemon's master before the next update, as a
        torch optimizer would step the written values.  Host-synchronous,
        only when something was written."""
        changed = [s for s in self._slots if s.x._version != s.ver]
        if not changed:
            return
        import numpy as np
        self.synchronize()
        for s in changed:
            a = np.ascontiguousarray(s.x.detach().to("cpu", torch.float32).reshape(-1).numpy())
            self._client.load_state(s.t, "master", a)
            if self._framework:
                s.host_param.copy_(s.x.detach().reshape(-1))
            s.ver = s.x._version

    def _hook_module(self, mod):
        """On the first forward of mod (global pre-hook) or at attach():
        mod.state_dict() and mod.load_state_dict() first wait for the
        pending updates (torch.save(model.state_dict()), an EMA over the
        state dict, loading weights right after step())."""
        if mod in self._hooked:
            return
        self._hooked.add(mod)
        ref = weakref.ref(self)

        def wait(*args, **kwargs):
            opt = ref()
            if opt is not None and opt._any_wait and not _is_compiling():
                opt._wait_all()
        sd = getattr(mod, "register_state_dict_pre_hook", None)
        if sd is not None:
            self._mod_handles.append(sd(wait))
        ld = getattr(mod, "register_load_state_dict_pre_hook", None)
        if ld is not None:
            self._mod_handles.append(ld(wait))
        elif hasattr(mod, "_register_load_state_dict_pre_hook"):
            self._mod_handles.append(mod._register_load_state_dict_pre_hook(wait, with_module=True))

    def _wait(self, s):
        """The current stream waits for s's update (host-blocking on the host
        backend and in framework mode); its pushed gradients may then go."""
        if not s.wait:
            return
        s.wait = False
        if self._framework:
            self._client.sync_param(s.t)
            if not self.delayed_update:
                self._copy_in(s)
        else:
            self._client.wait_param(s.t, self._stream())
        self._release(s)

    def _make_hook(self, s):
        def hook(p):
            self._on_grad(s, p)
        return hook

    def _on_grad(self, s, p):
        if p.grad is None or self._client is None or s.moved:
            return
        s.count += 1
        if s.ddp:       # pushed by the DDP communication hook once averaged (or at step())
            return
        g = _local(p.grad)
        s.seen, s.seen_ver = g, g._version
        if s.x is not s.p:
            self._queue_seen()
        if s.graph_pushed:      # pushed from the compiled backward (aoq::push_grad); p.grad holds the same values
            return
        # Final pushes from the hook only once the loop is known not to edit
        # gradients between backward and step() (else step() pushes them).
        k = self._learned if self._edits is False else None
        if s.final:
            raise RuntimeError(
                "aoq: parameter %r got a gradient after its final push of this step (%d backward passes per "
                "step assumed); pass grad_accumulation_steps=N to OffloadOptimizer" % (s.name, k or 1))
        streaming = k is not None
        if streaming and s.count == k:
            self._push(s, p.grad, final=True)
            if self.offload_gradients:
                p.grad = None
        elif self.offload_gradients:
            if streaming:
                self._push(s, p.grad, final=False)
            else:  # learning: push the previous micro-batch, hold this one (it may be the last)
                if s.held is not None:
                    self._push(s, s.held, final=False)
                s.held = p.grad
            p.grad = None

    def _global_pre(self, mod, args):
        """The global forward pre-hook (every module, installed by the
        constructor), outside compiled code: the current stream waits for the
        updates of the module's own parameters.

        A torch.compile'd module (OptimizedModule) runs the hooks of the
        modules inside it as the in-graph op aoq::wait_params, which waits
        per module as eager code does.  Its first call (and any call after
        one where that op did not reach all its parameters, e.g. a torch
        that does not trace global hooks) waits for every parameter before
        it runs; the forward post-hook then checks that the op reached them
        all, and from the next call on the compiled graph waits alone."""
        slot_of = self._slot_of
        if self._probe_fwd_armed and not _is_compiling():   # "auto": the probe step's forward starts
            self._probe_fwd_armed = False
            self._probe_fwd = self._mark()
        elif self._probe_fwd is not None and self._push_log == [] and not _is_compiling():
            self._probe_fwd_last = self._mark()     # ...and a module of it starts (before any final push)
        if mod not in self._hooked:
            self._hook_module(mod)
            orig = getattr(mod, "_orig_mod", None)
            if isinstance(orig, torch.nn.Module):     # torch.compile: the user holds the original module
                for m in orig.modules():
                    self._hook_module(m)
                if _WAIT_OP is not None:
                    self._mod_handles.append(mod.register_forward_hook(self._compiled_post))
            ddp = _ddp_class()
            if ddp is not None and isinstance(mod, ddp):
                self._attach_ddp(mod)
        unit = self._fsdp_unit(mod)
        if unit is not None:
            params = unit
        elif type(mod).__name__ == "OptimizedModule":
            self._untap(mod)
            if mod in self._graph_waits:
                return
            for p in mod.parameters():
                s = slot_of.get(p)
                if s is not None:
                    s.in_graph = False
            params = mod.parameters()
        else:
            params = mod._parameters.values()
        for p in params:
            s = slot_of.get(p) if p is not None else None
            if s is not None:
                s.fwd = True
                if s.wait:
                    self._wait(s)
        if self._inflight_fifo:
            self._reap()

    def _compiled_post(self, mod, args, out):
        """Forward post-hook of a compiled module in probation: trust its
        in-graph waits once they reached every one of its parameters."""
        if mod in self._graph_waits:
            return
        slots = [self._slot_of[p] for p in mod.parameters() if p in self._slot_of]
        if all(s.in_graph for s in slots):
            self._graph_waits.add(mod)

    def _untap(self, compiled):
        """Before a compiled module's call (eager): the parameters its last
        call left in its modules' __dict__ (the global forward hook puts
        them back there after their _GraphTap views) go, so attribute lookup
        finds _parameters again as it did when the graph was traced."""
        pairs = self._tapped.get(compiled)
        if pairs is None:
            orig = getattr(compiled, "_orig_mod", None)
            pairs = [] if not isinstance(orig, torch.nn.Module) else [
                (m, name) for m in orig.modules() for name, p in m._parameters.items() if p in self._slot_of]
            self._tapped[compiled] = pairs
        for m, name in pairs:
            d = m.__dict__
            if name in d and d[name] is m._parameters.get(name):
                del d[name]

    def _slot_at(self, addr):
        """The slot whose parameter's data is at addr (compiled code hands
        the parameters over as tensors), or None."""
        s = self._slot_by_addr.get(addr)
        if s is None or s.x.data_ptr() != addr:
            if s is None and addr in self._not_slots:
                return None                   # a parameter this optimizer does not step
            # first use, or a parameter's storage was replaced (p.data = ...)
            self._slot_by_addr = {x.x.data_ptr(): x for x in self._slots}
            self._not_slots = set()
            s = self._slot_by_addr.get(addr)
            if s is None:
                self._not_slots.add(addr)
        return s

    def _push_in_graph(self, grad, t, tap):
        """aoq::push_grad at run time (compiled backward): param's gradient
        of this backward pass, as soon as the graph has it.  Pushed as the
        step's final gradient where the hook would push this very gradient:
        once gradients stream (after the first step), one backward pass per
        step, no gradient offload, no DDP, and one call per backward for
        this parameter (a parameter tied into the graph twice gets two
        partial gradients: its hook pushes the sum as before)."""
        s = self._slot_by_t.get(t)
        if s is None or s.moved or self._client is None or tap.data_ptr() != s.tap.data_ptr():
            return
        s.graph_calls += 1
        k = self._learned if self._edits is False else None
        if (s.graph_ok and k == 1 and s.count == 0 and not s.final and not s.ddp and not self.offload_gradients
                and grad.shape == s.p.shape):
            self._push(s, grad, final=True)
            s.graph_pushed = True

    def _wait_in_graph(self, params, originals):
        """aoq::wait_params at run time (compiled code): the per-module wait.

        originals are the module's parameters (or aliases of them: found by
        data address); params are what the graph holds for them: the same
        tensors, or, where AOTAutograd functionalized the op's declared
        mutation without putting it back in place, copies taken before it.
        The op must leave the updated values in what it was given, so a copy
        gets them from the parameter (stream-ordered after the wait)."""
        if self._probe_fwd is not None and self._push_log == []:
            self._probe_fwd_last = self._mark()     # "auto": a compiled module of the probe step's forward starts
        for t, p in zip(params, originals):
            addr = p.data_ptr()
            s = self._slot_at(addr)
            if s is None:
                continue
            s.fwd = True
            s.in_graph = True
            if s.wait:
                self._wait(s)
            if t.data_ptr() != addr:
                t.copy_(p)
            s.ver = s.x._version      # the op's own version bump is no user write
        if self._inflight_fifo:
            self._reap()

    def _fsdp_unit(self, mod):
        """For an FSDP2 (fully_shard) module: the parameters its pre-forward
        all-gathers (their local shards must hold the update first), else
        None."""
        unit = self._fsdp_units.get(mod)
        if unit is None:
            if not _is_fsdp2(mod):
                return None
            unit = self._fsdp_units[mod] = [p for p in _fsdp_unit_params(mod) if p in self._slot_of]
        return unit

    def _attach_ddp(self, ddp):
        """Parameters owned by a DistributedDataParallel module are pushed
        only once DDP has averaged them: a communication hook all-reduces
        each bucket as DDP's default hook does and pushes the bucket's
        gradients when its all-reduce completes (_ddp_push).  When the DDP
        module already has a communication hook, they are pushed at step()
        instead (averaged too; no overlap with backward)."""
        if ddp in self._ddps:
            return
        self._ddps.add(ddp)
        slots = [self._slot_of[p] for p in ddp.module.parameters() if p in self._slot_of]
        if not slots:
            return
        for s in slots:
            s.ddp = True
        try:
            ddp.register_comm_hook((weakref.ref(self), ddp.process_group), _ddp_comm_hook)
        except RuntimeError as e:
            warnings.warn("aoq: cannot register aoq's communication hook on this DistributedDataParallel module "
                          "(%s); its gradients are pushed at step(), once DDP has averaged them, without overlap "
                          "with backward" % (str(e).splitlines()[0] if str(e) else type(e).__name__,),
                          RuntimeWarning, stacklevel=3)

    def _queue_seen(self):
        """From the DDP communication hook or an FSDP2 parameter's hook
        (autograd's thread, in backward): at the end of this backward, after
        DDP has written the averaged gradients into p.grad (FSDP2 bumps the
        version counter of an accumulated gradient shard after its hook, not
        its values), note them as the gradients backward left: the
        reference for detecting edits between backward and step().  DDP and
        FSDP2 queue their own end-of-backward callbacks before this is
        called or after the first hook; a callback queued from a callback
        runs after every one queued before it."""
        if self._seen_queued:
            return
        from torch.autograd import Variable
        engine = Variable._execution_engine
        ref = weakref.ref(self)

        def after_backward():
            o = ref()
            if o is None:
                return
            o._seen_queued = False
            for s in o._slots:
                g = s.p.grad
                if (s.ddp or s.x is not s.p) and g is not None:
                    g = _local(g)
                    s.seen, s.seen_ver = g, g._version
                    if o.offload_gradients and s.final and s.ddp:
                        s.p.grad = None     # pushed: the device copy goes (DDP's bucket keeps its own)
        try:
            engine.queue_callback(lambda: engine.queue_callback(after_backward))
            self._seen_queued = True
        except RuntimeError:
            pass

    def _ddp_push(self, params, grads):
        """The averaged gradients of one DDP bucket (from its all-reduce's
        future: a process group thread with gloo, inline with NCCL): the
        final micro-batch's go to aoqd.  A learning step, or a loop that
        edits gradients, pushes at step() instead."""
        k = self._learned if self._edits is False else None
        if k is None or self._client is None:
            return
        with self._lock:
            for p, g in zip(params, grads):
                s = self._slot_of.get(p)
                if s is None or not s.ddp:
                    continue
                if s.final:
                    raise RuntimeError(
                        "aoq: parameter %r got a gradient after its final push of this step (%d backward passes "
                        "per step assumed); pass grad_accumulation_steps=N to OffloadOptimizer" % (s.name, k))
                if s.count == k:
                    self._push(s, g, final=True)

    # ------------------------------------------------------------------
    def attach(self, model):
        """Forward pre-hooks on model's modules: before a module runs, the
        current stream waits for its own parameters' updates (no host sync
        between steps).  Parameters of no attached module are waited for at
        the end of step().  Not for models under torch.compile (the hooks
        would break the graph): there step() waits for everything."""
        handles = []
        ddp = _ddp_class()
        for m in model.modules():
            self._hook_module(m)
            if ddp is not None and isinstance(m, ddp):
                self._attach_ddp(m)
            unit = self._fsdp_unit(m)
            ps = unit if unit is not None else m.parameters(recurse=False)
            slots = [self._slot_of[p] for p in ps if p in self._slot_of]
            if not slots:
                continue
            for s in slots:
                s.covered = True

            def pre(mod, args, slots=slots):
                for s in slots:
                    self._wait(s)
                if self._inflight_fifo:
                    self._reap()
            handles.append(m.register_forward_pre_hook(pre, prepend=True))   # before FSDP2's all-gather
        return handles

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fallback is not None:
            return self._fallback.step(loss)
        t_backward = None
        if self._push_log is not None:      # "auto": the probe step; when did backward end on the device?
            t_backward = self._mark()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:           # called by GradScaler.step
            if self._edits is not True:
                self._edits = True          # the gradients are unscaled (edited) every step
                if any(s.final for s in self._slots):
                    warnings.warn("aoq: GradScaler started after gradients had streamed; this step used the "
                                  "scaled gradients. Pass grad_edits=True with GradScaler.", RuntimeWarning,
                                  stacklevel=2)
            if float(found_inf) != 0:       # GradScaler skips the step (GradScaler itself syncs here too)
                for s in self._slots:
                    if not s.final:
                        s.count, s.held, s.seen = 0, None, None
                        s.graph_calls = 0
                return loss
            scale = getattr(self, "grad_scale", None)
            if scale is not None:           # not unscaled yet: unscale as GradScaler.unscale_ does
                grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
                if grads:
                    inv = scale.double().reciprocal().float()
                    dummy = torch.zeros(1, device=inv.device)
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, dummy, inv)
        if self._slots:
            self._begin_step()
            counts = [s.count for s in self._slots]
            edited, stale = False, []
            for s in self._slots:
                g = s.p.grad
                g = _local(g) if g is not None else None
                changed = g is not None and (g is not s.seen or g._version != s.seen_ver)
                if s.final:
                    if changed:
                        stale.append(s.name)
                    continue
                edited = edited or (changed and s.count > 0)
                if self.offload_gradients and not s.ddp:
                    if s.held is not None:
                        self._push(s, s.held, final=True)
                    elif s.count > 0:   # accumulated in the daemon, no final push yet: zeros end it
                        z = (s.host_grad.zero_() if self._framework else
                             torch.zeros(s.numel, dtype=s.x.dtype, device=s.x.device))
                        self._push(s, z, final=True)
                elif s.p.grad is not None:
                    self._push(s, s.p.grad, final=True)
            if self._learned is None and max(counts) > 0:
                self._learned = max(counts)
            if self._edits is None and max(counts) > 0:
                self._edits = edited      # an edit at the first step: final pushes wait for step() from now on
            if stale:
                self._edits = True
                if not self._edit_warned:
                    self._edit_warned = True
                    warnings.warn("aoq: the gradient of %s was changed after backward (clipping, GradScaler, an "
                                  "edit of p.grad) once its update had started, so this step used the gradient as "
                                  "backward left it; from the next step on, gradients are pushed at step(). Pass "
                                  "grad_edits=True when the training loop edits gradients (max_grad_norm= clips "
                                  "in the daemon, overlapped)" % ", ".join(stale[:3]), RuntimeWarning, stacklevel=2)
        if self._dev_opt is not None:
            for dg, gi in zip(self._dev_opt.param_groups, self._dev_group_of):
                g = self.param_groups[gi]
                for k in ("lr", "betas", "eps", "weight_decay"):
                    dg[k] = g[k]
            self._dev_opt.step()
        if self._share is not None:
            self._share.step(self.param_groups)
        if self._slots:
            self._client.step_end()
            if self._cuda:
                # DDP's bucket views are written again by the next backward:
                # their copies off the device must be done by then.
                for s in self._slots:
                    if s.ddp and s.inflight:
                        self._client.grad_copied(s.t)
            if self._inflight_fifo:
                self._reap()
            for s in self._slots:
                if s.graph_calls and s.graph_ok is None:
                    s.graph_ok = s.graph_calls == s.count
                s.graph_calls, s.graph_pushed = 0, False
                s.count, s.final, s.held, s.seen = 0, False, None, None
                if not (s.covered or s.fwd):
                    self._wait(s)
            self._step_started = False
            self._nstep += 1
            if t_backward is not None:
                self._auto_split(t_backward)
            elif self._auto and self._auto_probe is not None and self._nstep == self._auto_probe - 1:
                self._push_log = []
                self._probe_fwd, self._probe_fwd_armed = None, True   # marked at the probe step's first forward hook
                self._probe_fwd_last = None
        return loss

    def _mark(self):
        """A point in the step's timeline: a CUDA event on the current
        stream (timed on the device), else the host clock."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _since(self, a, b):
        """Seconds from mark a to mark b (both passed)."""
        if self.device.type == "cuda":
            return a.elapsed_time(b) / 1e3
        return b - a

    def _auto_split(self, t_backward):
        """gpu_state_budget="auto", at the end of the probe step.  Measures
        B, from the step's first final push to the end of backward (on the
        device), and T, from there until every update has landed (the
        step's tail, host-synchronous once), and with a staging window F,
        the forward's start to the first final push; _auto_late says how
        many parameters' updates end late.  The parameters pushed last (the
        first layers), that many plus 10%, move with their state to the
        device share, within the device's free memory less a margin.  While
        a probe moves state and finds more than 1% late, the step after next
        probes again (_auto_again), at most _AUTO_ROUNDS probes in all."""
        log, self._push_log = self._push_log, None
        self._probe_fwd_armed = False
        pushed = set(log)
        order = [s for s in log if not s.moved] + [s for s in self._slots if s not in pushed]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_end_backward = time.perf_counter()
        self.synchronize()
        tail = time.perf_counter() - t_end_backward
        start = getattr(self, "_probe_start", None)
        span = self._since(start, t_backward) if start is not None else 0.0
        total = sum(s.numel for s in order)
        fwd_start, fwd_last = self._probe_fwd, self._probe_fwd_last
        fwd = None
        # a daemon behind backward holds it back (the tail stays short) with a
        # staging window (a push waits for a free slot) and with the delayed
        # update (a tensor's push waits for its previous update's answer)
        if (self.staging_window or self.delayed_update) and fwd_start is not None and start is not None:
            # F: to the last module's start (a forward pre-hook, or a compiled
            # module's in-graph wait): the first push comes after the loss and
            # the last layer's backward, which 2F would count twice; without
            # such a mark, to the first final push
            fwd = self._since(fwd_start, fwd_last if fwd_last is not None else start)
        self._probe_fwd = self._probe_fwd_last = None
        late, b0 = _auto_late(total, span, tail, fwd)
        cap = float("inf")
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            cap = max(0, free - max(2 << 30, free // 10))
        # every replica of a process group the same: the most late, the least room
        if self._auto_dist is False:
            self._auto_dist = _dist_group([s.numel for s in self._slots])
        dist = self._auto_dist
        late, neg_cap = _agree(dist, late, -cap)
        late, cap = int(late), -neg_cap
        master = None if self._fp32_master else "bf16"
        chosen = _auto_choice([s.numel for s in order], [_share_bytes(s.p, self._kind, master) for s in order],
                              late, cap)
        moved = _first_ranks(dist, [order[i] for i in chosen], self._slots)
        if moved:
            self._move_to_share(moved)
        prev = self.auto_split or {}
        rounds = prev.get("rounds", 0) + 1
        n_moved = sum(s.numel for s in moved)
        # the last probe's measurements; device_* count every probe's moves
        self.auto_split = dict(backward_seconds=span, tail_seconds=tail, forward_seconds=fwd,
                               device_backward_seconds=b0, late_params=late, params=total,
                               moved_params=n_moved, rounds=rounds,
                               device_params=prev.get("device_params", 0) + n_moved,
                               device_bytes=prev.get("device_bytes", 0) + sum(
                                   _share_bytes(s.p, self._kind, master) for s in moved))
        again = bool(_agree(dist, int(_auto_again(late, total, n_moved, rounds)))[0])   # any rank: all probe
        self._auto_probe = self._nstep + 2 if again else None
        logging.getLogger("aoq").info(
            "aoq: gpu_state_budget='auto', probe %d: the update ended %.1f ms after backward (%.1f ms after the "
            "first push; ~%d of %d offloaded parameters late); %d parameters' state moved to the device, %d "
            "(%.2f GiB) in all%s", rounds, 1e3 * tail, 1e3 * span, late, total, n_moved,
            self.auto_split["device_params"], self.auto_split["device_bytes"] / 2 ** 30,
            "; probing again at step %d" % self._auto_probe if again else "")

    def _move_to_share(self, slots):
        """The state of slots (synchronized) leaves aoqd for the device share."""
        steps = self._client.get_tensor_steps()
        entries = []
        for s in slots:
            st = {"step": torch.tensor(float(steps[s.t]))}
            for key, w in self._state_keys(s) + (("master", "master"),):
                st[key] = torch.from_numpy(self._client.read_state(s.t, w)).view(s.x.shape)
            entries.append((s.p, st))
        if self._share is None:
            self._share = _DeviceShare([(s.group, s.p) for s in slots], self.param_groups, self._optimizer_class,
                                       self._dev_kwargs, self._kind, fp32_master=self._fp32_master)
        else:
            self._share.add([(s.group, s.p) for s in slots], self.param_groups)
        self._share.load(entries)
        gone = set(slots)
        for s in slots:
            s.moved = True
            del self._slot_of[s.p]
        self._slots = [s for s in self._slots if s not in gone]
        self._slot_by_addr = {}

    def zero_grad(self, set_to_none=True):
        if self._fallback is not None:
            return self._fallback.zero_grad(set_to_none)
        for s in self._slots:
            # Backward passes since the last step() that no step() took (e.g.
            # GradScaler skipped the step for an inf): forget them.
            if s.count and not s.final:
                s.count, s.held, s.seen = 0, None, None
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                s = self._slot_of.get(p)
                if set_to_none:
                    p.grad = None          # an in-flight copy keeps its own reference
                else:
                    if s is not None and s.inflight:
                        self._wait(s)      # the copy must finish before the buffer is zeroed
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        if self._inflight_fifo:
            self._reap()

    def synchronize(self):
        """Host barrier: every update has landed in the parameters."""
        if not self._slots:
            return None
        self.last_result = self._client.sync()
        self._any_wait = False
        for s in self._slots:
            if s.wait:
                s.wait = False
                if self._framework and not self.delayed_update:
                    self._copy_in(s)
            self._release(s)
        if self._cuda or self._framework:
            torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
        return self.last_result

    def flush(self):
        """Delayed update: lands the pending updates (before eval/saving)."""
        if self._slots:
            self.synchronize()
            self._client.flush()
            if self._framework:
                for s in self._slots:
                    self._copy_in(s)
            self.synchronize()

    def _remove_global_hooks(self):
        for name in ("_global_hook", "_global_post"):
            h = getattr(self, name, None)
            if h is not None:
                h.remove()
                setattr(self, name, None)
        attr = getattr(self, "_tap_attr", None)
        for s in getattr(self, "_slot_by_t", {}).values():
            if getattr(s.p, attr, None) is s.tap:
                delattr(s.p, attr)
        self._slot_by_t = {}

    def close(self):
        """Ends the daemon session (also done at exit)."""
        self._remove_global_hooks()
        _OPTIMIZERS.pop(getattr(self, "_oid", None), None)
        for h in getattr(self, "_mod_handles", ()):
            h.remove()
        self._mod_handles = []
        if self._client is not None:
            self.synchronize()
            self._client.close()
            self._client = None
            self._slots = []

    # ------------------------------------------------------------------
    def _init_fallback(self, params, optimizer_class, kwargs):
        warnings.warn("aoq: %s is not offloaded to aoqd (aoqd runs %s); it steps host copies of the parameters in "
                      "this process" % (optimizer_class.__name__, ", ".join(c.__name__ for c in _DAEMON_CLASSES)),
                      stacklevel=3)
        clean, names = _parse_params(params)
        super().__init__(clean, {})
        self._names = names
        self._by_name = {n: p for p, n in names.items()}
        self._slot_of = {}
        self._kind = optimizer_class.__name__
        self._optimizer_class = optimizer_class
        self._fallback = _HostFallback(self, optimizer_class, kwargs)
        self.defaults = dict(self._fallback.opt.defaults)
        for g, hg in zip(self.param_groups, self._fallback.opt.param_groups):
            for k, v in hg.items():
                if k != "params":
                    g[k] = v
        self.device = next((p.device for g in clean for p in g["params"]), torch.device("cpu"))
        self.last_result = None
        self._constructed = True

    def add_param_group(self, param_group):
        """torch's add_param_group.  A group added after construction is not
        offloaded: optimizer_class steps it on the device (aoqd's session
        is registered already)."""
        if not getattr(self, "_constructed", False):
            return super().add_param_group(param_group)
        clean, names = _parse_params([param_group], start=len(self._names), taken=set(self._names.values()))
        for p in clean[0]["params"]:
            if p in self._names:
                raise ValueError("some parameters appear in more than one parameter group")
        super().add_param_group(clean[0])
        self._names.update(names)
        self._by_name.update({n: p for p, n in names.items()})
        g = self.param_groups[-1]
        if self._fallback is not None:
            self._fallback.add_group(g)
            return
        trainable = [p for p in g["params"] if p.requires_grad]
        dg = {k: v for k, v in g.items() if k != "params"}
        dg["params"] = trainable
        if self._dev_opt is None:
            self._dev_opt = self._optimizer_class([dg], **self._dev_only_kwargs)
        else:
            self._dev_opt.add_param_group(dg)
        self._dev_group_of.append(len(self.param_groups) - 1)
        self._small_params.extend(trainable)
        if trainable and self._slots:
            warnings.warn("aoq: a parameter group added after construction is stepped on the device by %s, not "
                          "offloaded to aoqd" % self._optimizer_class.__name__, stacklevel=2)

    def _positions(self):
        """Every parameter of param_groups, in order (torch's positional ids)."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self):
        """torch's format: {"state": {position: {...}}, "param_groups": [...
        "params": [positions]]} (positions over param_groups, as torch's
        optimizers number them), plus "aoq": {"names": [name per position],
        ...}.  A daemon-stepped parameter's state is {"step", "master",
        "exp_avg", "exp_avg_sq"} as fp32 CPU tensors read from the daemon
        (q8 and bf16 states converted); a device-stepped one's is
        optimizer_class's own.  torch.optim.AdamW/Adam load it as it is."""
        pos = self._positions()
        index = {p: i for i, p in enumerate(pos)}
        meta = {"kind": self._kind, "format": 2, "names": [self._names[p] for p in pos],
                "seed": self._client.seed if self._client else 0}
        if self._fallback is not None:
            sd = self._fallback.state_dict()
            sd["aoq"] = meta
            return sd
        state = {}
        if self._slots:
            self.synchronize()
            steps = self._client.get_tensor_steps()
            for s in self._slots:
                st = {"step": torch.tensor(float(steps[s.t]))}
                for key, w in self._state_keys(s) + (("master", "master"),):
                    a = self._client.read_state(s.t, w)
                    st[key] = _like_param(s.p, torch.from_numpy(a).view(s.x.shape))
                if self._kind == "sgd" and not self._state_keys(s):
                    st["momentum_buffer"] = None
                state[index[s.p]] = st
        if self._dev_opt is not None:
            for p, st in self._dev_opt.state.items():
                state[index[p]] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for p in self._small_params:
                if p not in self._dev_opt.state and p in index:
                    # Not stepped yet: the state optimizer_class's first step starts from (step 0, zero
                    # moments), so a template for torch.distributed.checkpoint has every entry without the
                    # zero-gradient step DCP would otherwise run.
                    st = {"step": torch.tensor(0.0)}
                    for key, _ in _STATE_KEYS[self._kind] if not (self._kind == "sgd" and not
                                                                   self._dev_opt.defaults.get("momentum")) else ():
                        st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state[index[p]] = st
        if self._share is not None:
            for p, st in self._share.state_items():
                state[index[p]] = st
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index[p] for p in g["params"]]
            groups.append(d)
        return {"state": dict(sorted(state.items())), "param_groups": groups, "aoq": meta}

    def _entries(self, state_dict):
        """[(param, its state or None)] and [loaded group hyperparameters]
        from a state dict of aoq (formats 1 and 2), torch's Adam/AdamW
        (positional ids) or torchao's CPUOffloadOptimizer ("offloaded")."""
        if not isinstance(state_dict, dict):
            raise ValueError("load_state_dict: expected a dict, got %r" % (type(state_dict),))
        if "offloaded" in state_dict:
            return self._entries_torchao(state_dict)
        if "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("load_state_dict: not an optimizer state dict (keys %s; expected 'state' and "
                             "'param_groups', or torchao's 'offloaded')" % sorted(state_dict))
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has %d parameter groups, this optimizer %d"
                             % (len(groups), len(self.param_groups)))
        out = []
        state = state_dict["state"]
        for g, lg in zip(self.param_groups, groups):
            ids = list(lg["params"])
            if len(ids) != len(g["params"]):
                raise ValueError("loaded state dict's group has %d parameters, this optimizer's %d"
                                 % (len(ids), len(g["params"])))
            if ids and all(isinstance(i, str) for i in ids) and \
                    [_canon_fqn(i) for i in ids] != [_canon_fqn(self._names[p]) for p in g["params"]]:
                raise ValueError("loaded state dict's parameter names differ from this optimizer's")
            for i, p in zip(ids, g["params"]):
                out.append((p, state.get(i)))
        return out, [{k: v for k, v in lg.items() if k != "params"} for lg in groups]

    def _entries_torchao(self, sd, minimal_size=4096):
        """torchao's CPUOffloadOptimizer.state_dict(): "offloaded", one
        single-parameter optimizer state dict per offloaded parameter (the
        trainable ones of at least minimal_size elements, in order), and
        "on-device" (the others, positional)."""
        off = list(sd["offloaded"])
        dev = sd.get("on-device") or {"state": {}, "param_groups": []}
        train = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        big = [p for p in train if p.numel() >= minimal_size]
        small = [p for p in train if p.numel() < minimal_size]
        if len(big) != len(off):
            raise ValueError("torchao state dict has %d offloaded parameters; this optimizer has %d trainable "
                             "parameters of at least %d elements" % (len(off), len(big), minimal_size))
        out, hps = [], {}
        for p, o in zip(big, off):
            st = o["state"].get(0, o["state"].get("0")) if o.get("state") else None
            if st is not None and tuple(st["exp_avg"].shape) != tuple(p.shape):
                raise ValueError("torchao state dict: parameter %s has shape %s, the state %s"
                                 % (self._names[p], tuple(p.shape), tuple(st["exp_avg"].shape)))
            out.append((p, st))
            if o.get("param_groups"):
                hps.setdefault(id(p), {k: v for k, v in o["param_groups"][0].items() if k != "params"})
        dev_ids = [i for g in dev["param_groups"] for i in g["params"]]
        if dev_ids and len(dev_ids) != len(small):
            raise ValueError("torchao state dict has %d on-device parameters, this optimizer %d below %d elements"
                             % (len(dev_ids), len(small), minimal_size))
        for i, p in zip(dev_ids, small):
            out.append((p, dev["state"].get(i)))
        groups = []
        for g in self.param_groups:
            hp = next((hps[id(p)] for p in g["params"] if id(p) in hps), None)
            groups.append(hp or {k: v for k, v in g.items() if k != "params"})
        return out, groups

    def load_state_dict(self, state_dict):
        """Loads aoq's state_dict(), torch.optim.AdamW/Adam's (positional; the
        parameters' current values become the master) or torchao's
        CPUOffloadOptimizer's.  Into a new process and daemon session: master,
        moments, per-tensor step counts and hyperparameters; the device
        parameters get the loaded master."""
        import numpy as np
        if self._fallback is not None:
            sd = {k: v for k, v in state_dict.items() if k != "aoq"}
            return self._fallback.load_state_dict(sd)
        entries, groups = self._entries(state_dict)
        for g, lg in zip(self.param_groups, groups):
            for k, v in lg.items():
                if k in g or k in ("lr", "betas", "eps", "weight_decay"):
                    g[k] = tuple(v) if k == "betas" else v
        for p, st in entries:
            if st is not None and st.get("max_exp_avg_sq") is not None and p in self._slot_of:
                raise ValueError("load_state_dict: parameter %s has amsgrad state (max_exp_avg_sq); aoqd runs "
                                 "Adam/AdamW without amsgrad" % self._names[p])
        if self._slots:
            self.synchronize()
            steps = self._client.get_tensor_steps()
            for p, st in entries:
                s = self._slot_of.get(p)
                if s is None or st is None:
                    continue
                master = st.get("master")
                if master is None:          # torch / torchao: the parameter is the master
                    master = s.x.detach()
                master = _local(master)
                for w, v in (("master", master),) + tuple((w, _local(st[key])) for key, w in self._state_keys(s)):
                    if v.numel() != s.numel:
                        raise ValueError("load_state_dict: %s of parameter %s has %d elements, expected %d%s"
                                         % (w, s.name, v.numel(), s.numel,
                                            " (this rank's shard; load sharded state through "
                                            "torch.distributed.checkpoint)" if _is_dtensor(s.p) else ""))
                    a = np.ascontiguousarray(v.detach().to("cpu", torch.float32).reshape(-1).numpy())
                    self._client.load_state(s.t, w, a)
                steps[s.t] = int(float(st.get("step", 1)))   # torch's SGD keeps no step: a buffer means >= 1
                with torch.no_grad():   # the device parameter follows the loaded master
                    s.x.copy_(master.to(s.x.device, s.x.dtype).view(s.x.shape))
                    if self._framework:
                        s.host_param.copy_(s.x.reshape(-1))
                s.ver = s.x._version
            self._client.set_tensor_steps(steps)
            self._step_started = False
            self._begin_step()      # the loaded hyperparameters
            self._step_started = False
        if self._share is not None:
            self._share.load(entries)
        if self._dev_opt is not None:
            small = set(self._small_params)
            for p, st in entries:
                if p in small and st is not None:
                    # Copies, never views of the caller's tensors: a state dict of a live optimizer
                    # (or one loaded twice) would otherwise be stepped by both.
                    self._dev_opt.state[p] = {k: _state_copy(p, k, v) for k, v in st.items() if k != "master"}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __del__(self):
        try:
            self._remove_global_hooks()
            _OPTIMIZERS.pop(getattr(self, "_oid", None), None)
            if getattr(self, "_client", None) is not None:
                self._client.close()
        except Exception:
            pass
