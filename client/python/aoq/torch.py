# SPDX-License-Identifier: MIT
"""OffloadOptimizer: Adam/AdamW, SGD and Lion in aoqd, as a torch.optim.Optimizer.

    from aoq.torch import OffloadOptimizer
    opt = OffloadOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    opt.attach(model)            # optional: per-module waits instead of one at step()

Gradient pushes (docs/python.md has the full story):
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
import collections
import os
import threading
import warnings
import weakref

import torch

from . import _lib
from ._compat import routed
from ._dist import (_Distributed, _dist_rank, _is_dtensor, _job_default, _local, _local_group, _replica_seed,
                    _shard_seed, _shared_job_default)
from ._graph import _OPTIMIZERS
from ._hooks import _PushPath, _Slot
from ._kinds import (_AOQ_DTYPE, _DAEMON_CLASSES, _DEFAULT_BF16_MOMENTS, _MASTER_DTYPES, _PRECISION, _STATE_KEYS,
                     _STATE_PRECISIONS, Lion, _check_hp, _default_policy, _number, _parse_params)
from . import _share
from ._share import _AUTO_PROBE_STEP, DEFAULT_SHARE, _AutoSplit, _DeviceShare, _share_bytes
from ._state import _HostFallback, _StateDict
from .client import Client

__all__ = ["OffloadOptimizer", "Lion", "staging_window_for", "STAGING_BUDGET", "DEFAULT_SHARE"]

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


def _take_over(params, new):
    """Parameters that an earlier OffloadOptimizer of this process still
    hooks (one whose aoqd restarted, or was left without close(), before
    the optimizer was built again: README, "Lease and resume") become
    `new`'s: the earlier one is closed, so that its hooks no longer see
    their gradients."""
    old = []
    for p in params:
        r = getattr(p, "_aoq_optimizer", None)
        o = r() if r is not None else None
        if o is not None and o is not new and o not in old:
            old.append(o)
        try:
            p._aoq_optimizer = weakref.ref(new)
        except (AttributeError, TypeError):
            pass
    for o in old:
        if getattr(o, "_client", None) is None:
            o._unhook()
            continue
        warnings.warn("aoq: parameters of an earlier OffloadOptimizer (job %s) are this one's now: the earlier one "
                      "is closed" % (getattr(o, "job", None) or "?"), stacklevel=3)
        try:
            o.close()
        except Exception:       # its daemon is gone: let go of what is left
            o._unhook()
            try:
                o._client.close()
            except Exception:
                pass
            o._client = None
            o._slots = []


@routed
class OffloadOptimizer(_PushPath, _Distributed, _StateDict, _AutoSplit, torch.optim.Optimizer):
    """torchao's CPUOffloadOptimizer constructor plus aoq's options.

    params: tensors, (name, tensor) pairs (named_parameters()) or param
    groups whose "params" hold either.  state_dict() keys the state by
    position, as torch's optimizers do; the names (the given ones, else
    "0", "1", ...) are in sd["aoq"]["names"].
    optimizer_class: torch.optim.AdamW, Adam, SGD or aoq.torch.Lion (the
    daemon's kinds); it also steps the parameters smaller than minimal_size on the
    device.  kwargs: lr, betas, eps, weight_decay (defaults of
    optimizer_class) and options of optimizer_class for the small ones.
    device: the aoq device ("cuda:0", "cpu", "xpu:0") when not the
    parameters'; copy_mode: "native" (libaoq copies with the CUDA backend or
    host memory) or "framework" (torch copies through pinned host buffers;
    default for devices libaoq cannot drive).  master_dtype None|"fp32"|
    "bf24"|"bf16": None (default) is an fp32 master (_default_policy): with
    bf16 parameters and Adam/AdamW beside _DEFAULT_BF16_MOMENTS moments,
    otherwise fp32 moments (torch's AdamW bit for bit); "bf24" (Adam/AdamW,
    q8 or q4 moments, q8 by default) keeps the master of a bf16 parameter in
    24 bits, the parameter and 8 more bits, rounded stochastically at each
    update (2 bytes per parameter and step less for aoqd to move; fp32
    parameters keep an fp32 master; docs/python.md, "The 24-bit master");
    "bf16" is the fast option for bf16 parameters (the master is the
    parameter itself, with stochastic rounding).  state_precision, the moments: None (with the
    default for bf16 parameters the compressed moments above; else the
    master's dtype: fp32, or with master_dtype=
    "bf16" bf16, the all-bf16 state of torchao's full-bf16 offload, 6 bytes
    per parameter), "fp32", "q8" (blockwise 8-bit), "q4" (blockwise 4-bit,
    kernels/README.md "q4 moments"), "bf16" (with a bf16 master only).
    opt.master_dtype and opt.state_precision say what the optimizer chose.
    max_grad_norm / skip_nonfinite: global clipping and step skipping in the
    daemon (every parameter is then offloaded, so the norm is global).
    delayed_update: ZeRO-Offload's DPU (parameters one step stale); call
    flush() before evaluating or saving the model.
    gpu_state_budget: bytes of device memory for optimizer state kept on
    the device (partial offload): the first parameters in order (the last
    gradients of backward) whose state fits are stepped there by
    optimizer_class (fused on CUDA), on an fp32 master where aoq's would be
    one; 0: everything in aoqd; None (default): the default share, "auto"
    within DEFAULT_SHARE (1.5 %) of the device peak measured with
    everything offloaded, where the device keeps the state in aoqd's own
    format (a CUDA device, an fp32 master with q8 or q4 moments, Adam or
    AdamW, not shared=, not master_dtype="bf24"), else 0 (docs/python.md,
    "The default share");
    "auto": measured at the probe
    steps, within max_device_bytes= (bytes, or a fraction in (0, 1] of the
    device's free memory) or by default within the device peak of the same
    model with torch's optimizer on the device (_AutoSplit._auto_cap).  Not
    with max_grad_norm / skip_nonfinite (they need every gradient in the
    daemon).
    host_share: with "auto" or the default share, late parameters that the
    device's cap leaves with aoqd may move to the host share: their state
    (q8 moments and the master's low halves, 4.03 bytes per parameter) in
    the trainer's pinned host memory, stepped by the device over PCIe as
    each gradient is final, during backward, while the daemon updates the
    rest; no device memory (default
    False; a CUDA device, q8 in the share, bf16 or fp32 parameters of 1 Mi
    elements or more; docs/python.md, "The host share").
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
                 seed=0, job=None, rank=None, model=None, grad_edits=None, gpu_state_budget=None, lease=None,
                 staging_window=None, timeout=None, graph_push=True, shared=False, max_device_bytes=None,
                 host_share=False, **kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError("optimizer_class must be a torch.optim.Optimizer subclass, got %r" % (optimizer_class,))
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError("unknown master_dtype %r; allowed: None, 'fp32', 'bf24', 'bf16' (or torch.float32, "
                             "torch.bfloat16)" % (master_dtype,))
        if state_precision not in _STATE_PRECISIONS:
            raise ValueError("unknown state_precision %r; allowed: None, 'fp32', 'q8', 'q4', 'bf16' (with "
                             "master_dtype='bf16')" % (state_precision,))
        master = "bf16" if master_dtype in ("bf16", torch.bfloat16) else None
        m24 = master_dtype == "bf24"
        if m24 and state_precision not in (None, "q8", "q4"):
            raise ValueError("master_dtype='bf24' keeps q8 or q4 moments (state_precision None, 'q8' or 'q4'), got "
                             "state_precision=%r" % (state_precision,))
        if m24 and state_precision is None:
            state_precision = _DEFAULT_BF16_MOMENTS
        if master_dtype is not None and (state_precision, master) not in _PRECISION:
            raise ValueError("state_precision %r needs master_dtype='bf16' (allowed with an fp32 master: None, "
                             "'fp32', 'q8', 'q4')" % (state_precision,))
        if copy_mode not in (None, "native", "framework"):
            raise ValueError("unknown copy_mode %r; allowed: None, 'native', 'framework'" % (copy_mode,))
        if grad_edits not in (None, True, False):
            raise ValueError("grad_edits must be None (detect), True or False, got %r" % (grad_edits,))
        if gpu_state_budget not in (None, "auto") and (isinstance(gpu_state_budget, bool)
                                                       or not isinstance(gpu_state_budget, int) or gpu_state_budget < 0):
            raise ValueError("gpu_state_budget must be None (the default share), a number of bytes >= 0 (0: "
                             "everything in aoqd) or 'auto', got %r" % (gpu_state_budget,))
        if max_device_bytes is not None:
            if gpu_state_budget != "auto":
                raise ValueError("max_device_bytes caps gpu_state_budget='auto' (got gpu_state_budget=%r)"
                                 % (gpu_state_budget,))
            if isinstance(max_device_bytes, bool) or not (
                    (isinstance(max_device_bytes, int) and max_device_bytes >= 0)
                    or (isinstance(max_device_bytes, float) and 0 < max_device_bytes <= 1)):
                raise ValueError("max_device_bytes must be None (the device peak of torch's optimizer on the "
                                 "device), bytes >= 0 or a fraction in (0, 1] of the free device memory, got %r"
                                 % (max_device_bytes,))
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
        self.master_dtype = self.state_precision = None     # what aoqd keeps (none on host copies)
        self._master_bits = 0           # 24: the 24-bit master (master_dtype="bf24")
        if optimizer_class not in _DAEMON_CLASSES or (optimizer_class is torch.optim.SGD and kwargs.get("maximize")):
            self._init_fallback(params, optimizer_class, kwargs)
            return
        kind, wd_default = _DAEMON_CLASSES[optimizer_class]
        if m24 and kind not in ("adam", "adamw"):
            raise ValueError("master_dtype='bf24' is for Adam and AdamW (q8 or q4 moments), not %s"
                             % optimizer_class.__name__)
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
        _take_over([p for g in clean for p in g["params"]], self)
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
        if master_dtype is None:
            # the default: the offloaded parameters' dtype decides, as torch's AdamW
            state_precision, master = _default_policy(kind, state_precision, [
                p.dtype for g in self.param_groups for p in g["params"]
                if p.requires_grad and (offload_all or p.numel() >= minimal_size)])
            if (state_precision, master) not in _PRECISION:
                raise ValueError("state_precision %r needs master_dtype='bf16' or bf16 parameters (allowed with "
                                 "an fp32 master: None, 'fp32', 'q8', 'q4')" % (state_precision,))
        self.master_dtype = "bf24" if m24 else "fp32" if master is None else "bf16"
        self.state_precision = state_precision or self.master_dtype
        self._master_bits = 24 if m24 else 0
        self._fp32_master = master is None
        # the GPU share keeps q8 moments where aoqd keeps an fp32 master and
        # 8- or 4-bit moments (Adam/AdamW; _share_bytes); FSDP2's shards
        # (DTensors) keep torch's optimizer there, which steps DTensors
        self._share_q8 = (master is None and state_precision in ("q8", "q4") and kind in ("adam", "adamw")
                          and not any(_is_dtensor(p) for g in self.param_groups for p in g["params"]))
        self._max_device_bytes = max_device_bytes   # "auto": the cap (None: torch's optimizer's device peak)
        self._host_share = bool(host_share)         # "auto": late state past the cap may go to pinned host memory
        self._host_share_kernel = None              # ...and this libaoq steps it there (_AutoSplit._host_share_ok)
        self._host_slots = []                       # the slots whose state moved to the host share
        self._auto_bound = None         # "auto", default cap: the device peak on-GPU state would reach (bytes)
        self._auto_state = 0            # "auto", default cap: the bytes of that state (torch's optimizer's)
        self._auto_peak = 0             # "auto": the largest device peak a probe measured
        self._auto_free0 = None         # "auto", a fraction as cap: the free device memory at the first probe
        self._auto_cost = 0             # "auto": device bytes of the moved state and its step-time copies
        self._released = 0              # bytes of moved tensors' state aoqd freed (ReleaseTensors)
        self._auto_lease_warned = False  # "auto" in a leased session: its move warned once
        self._nstep = 0
        self._push_log = None           # "auto": the slots in the order of their final push, on the probe step
        self.auto_split = None          # "auto": what the last probe measured, what all moved (a dict)
        self._auto_probe = _AUTO_PROBE_STEP   # "auto": the step (count) whose end probes next; None: done
        self._auto_dist = False         # "auto": torch.distributed when the replicas agree on splits (_dist_group)
        self._probe_fwd_armed = False   # "auto": mark the next forward's start (the probe step's)
        self._probe_fwd = self._probe_fwd_last = None   # "auto": marks of the probe step's forward
        self._auto_frac = None          # the default share: its cap, a fraction of the offloaded device peak
        share_left = 0 if offload_all or gpu_state_budget in (None, "auto") else gpu_state_budget
        share = []                                 # (group, parameter)
        for gi, g in enumerate(self.param_groups):
            sg = {k: v for k, v in g.items() if k != "params"}
            sg["params"] = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if offload_all or p.numel() >= minimal_size:
                    cost = _share_bytes(p, kind, master, self._share_q8)
                    if cost <= share_left:
                        share_left -= cost
                        share.append((gi, p))
                    else:
                        share_left = 0             # the share is the first parameters, without gaps
                        big.append((gi, p))
                else:
                    sg["params"].append(p)
            small_groups.append(sg)
        # an explicit seed (a checkpoint's, for a bit-exact continuation)
        # is the session's as given; the common one of the ranks takes the
        # rank's shard in
        seed = _replica_seed(seed) if seed else _shard_seed(_replica_seed(0), [p for _, p in big])
        self._seed = seed
        self._share = _DeviceShare(share, self.param_groups, optimizer_class, self._dev_kwargs, kind,
                                   fp32_master=master is None, q8=self._share_q8, seed=seed) if share else None
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
                     timeout=timeout, local_world=local_world, local_rank=local_rank,
                     master_bits=self._master_bits)
        self.local_world, self.local_rank = local_world, local_rank
        self._leased = lease != 0       # a lease may keep aoqd's state for a resume
        if (gpu_state_budget is None and self._share_q8 and self._master_bits != 24 and not offload_all
                and local_world <= 1 and not self._leased and _share._device_memory(tdev) is not None
                and not _share._dist_many()):
            # the default share (docs/decisions.md): "auto" within
            # DEFAULT_SHARE of the device peak measured with everything
            # offloaded, where the device keeps the state as aoqd does
            # (not with the 24-bit master, which the share keeps in 16
            # low bits: a tensor would step otherwise on the device);
            # not under torch.distributed (its split takes collectives),
            # not with a lease (a resume would find the moved tensors'
            # state in aoqd as it was at the move)
            self._auto, self._auto_frac = True, DEFAULT_SHARE
        if self._host_share and not (self._auto and self._share_q8 and tdev.type == "cuda"):
            warnings.warn("aoq: host_share=True has no effect here: it needs gpu_state_budget='auto' or the default "
                          "share, q8 moments with an fp32 master (Adam/AdamW) and a CUDA device (docs/python.md, "
                          "\"The host share\")", stacklevel=3)
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
            self._grad_handles = [s.p.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self._slots]
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
            self._install_global_hooks(graph_push)
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
        for s in self._host_slots:          # the host share's early steps (_on_grad) count afresh
            s.count = 0
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
        share_end = None
        if self._share is not None:
            self._share.step(self.param_groups)
            if t_backward is not None:
                share_end = self._mark()    # "auto": the share's step timed on the probe step
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
                self._auto_split(t_backward, share_end)
            elif self._auto and self._auto_probe is not None and self._nstep == self._auto_probe - 1:
                self._push_log = []
                if self._share is not None:
                    self._share.timing = []     # the probe step times the host share's early steps
                self._probe_fwd, self._probe_fwd_armed = None, True   # marked at the probe step's first forward hook
                self._probe_fwd_last = None
        return loss

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

    def close(self):
        """Ends the daemon session (also done at exit)."""
        self._unhook()
        if self._client is not None:
            self.synchronize()
            self._client.close()
            self._client = None
            self._slots = []

    def _unhook(self):
        """Takes every hook of ours off the parameters and modules."""
        self._remove_global_hooks()
        _OPTIMIZERS.pop(getattr(self, "_oid", None), None)
        for h in list(getattr(self, "_mod_handles", ())) + list(getattr(self, "_grad_handles", ())):
            h.remove()
        self._mod_handles = []
        self._grad_handles = []

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

    def __del__(self):
        try:
            self._remove_global_hooks()
            _OPTIMIZERS.pop(getattr(self, "_oid", None), None)
            if getattr(self, "_client", None) is not None:
                self._client.close()
        except Exception:
            pass
