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
import collections
import os
import warnings

import torch

from . import _lib
from .client import Client

__all__ = ["OffloadOptimizer"]

_AOQ_DTYPE = {torch.float32: _lib.FP32, torch.bfloat16: _lib.BF16, torch.float16: _lib.FP16}
# (moments, master) -> the daemon's state precision; moments None: the master's dtype
_PRECISION = {("fp32", None): _lib.STATE_FP32, ("q8", None): _lib.STATE_Q8, (None, None): _lib.STATE_FP32,
              ("fp32", "bf16"): _lib.STATE_BF16, ("q8", "bf16"): _lib.STATE_BF16_Q8,
              ("bf16", "bf16"): _lib.STATE_BF16_ALL, (None, "bf16"): _lib.STATE_BF16_ALL}


class _Slot:
    """One parameter stepped by aoqd."""
    __slots__ = ("t", "p", "name", "group", "numel", "host_param", "host_grad", "count", "final", "held",
                 "inflight", "wait", "covered")

    def __init__(self, t, p, name, group):
        self.t, self.p, self.name, self.group = t, p, name, group
        self.numel = p.numel()
        self.host_param = self.host_grad = None
        self.count = 0          # backward passes of this step that reached the parameter
        self.final = False      # the step's final gradient has been pushed
        self.held = None        # offload_gradients, learning step: the latest micro-batch's gradient
        self.inflight = []      # device gradients whose copy may still run (CUDA)
        self.wait = False       # an update was pushed that the device has not waited for
        self.covered = False    # a forward pre-hook (attach) waits for it


def _job_default():
    return "torch-%d" % os.getpid()


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
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, offload_gradients=False, minimal_size=4096,
                 device=None, socket=None, state_precision=None, master_dtype=None, max_grad_norm=None,
                 delayed_update=False, skip_nonfinite=False, grad_accumulation_steps=None, copy_mode=None,
                 seed=0, job=None, rank=None, model=None, **kwargs):
        if optimizer_class is torch.optim.AdamW or getattr(optimizer_class, "__name__", "") == "AdamW":
            kind, wd_default = "adamw", 1e-2
        elif optimizer_class is torch.optim.Adam or getattr(optimizer_class, "__name__", "") == "Adam":
            kind, wd_default = "adam", 0.0
        else:
            raise ValueError("aoqd runs Adam and AdamW; optimizer_class %r is not supported" % (optimizer_class,))
        for k in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(k):
                raise ValueError("OffloadOptimizer: %s=True is not supported by aoqd" % k)
        if master_dtype not in (None, "fp32", "bf16", torch.bfloat16, torch.float32):
            raise ValueError("master_dtype must be None/'fp32' or 'bf16'")
        master = "bf16" if master_dtype in ("bf16", torch.bfloat16) else None
        if (state_precision, master) not in _PRECISION:
            raise ValueError("state_precision must be None, 'fp32', 'q8', or 'bf16' with master_dtype='bf16'")
        self._kind = kind
        self._optimizer_class = optimizer_class
        self._dev_kwargs = dict(kwargs)
        defaults = dict(lr=kwargs.pop("lr", 1e-3), betas=tuple(kwargs.pop("betas", (0.9, 0.999))),
                        eps=kwargs.pop("eps", 1e-8), weight_decay=kwargs.pop("weight_decay", wd_default))

        # Names: accept named_parameters() pairs anywhere.
        names = {}
        groups = list(params) if not isinstance(params, torch.Tensor) else [params]
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        clean, pos = [], 0
        for g in groups:
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
                if n in names.values():
                    raise ValueError("duplicate parameter name %r" % n)
                names[x] = n
                plist.append(x)
                pos += 1
            g["params"] = plist
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
            clean.append(g)
        super().__init__(clean, defaults)
        self._names = names                       # param -> name
        self._by_name = {n: p for p, n in names.items()}

        self.offload_gradients = bool(offload_gradients)
        self.grad_accumulation_steps = grad_accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.delayed_update = bool(delayed_update)
        self._learned = None if grad_accumulation_steps is None else int(grad_accumulation_steps)
        offload_all = bool(max_grad_norm) or bool(skip_nonfinite)

        # Split: aoqd steps the large trainable parameters, optimizer_class the rest on the device.
        big, small_groups = [], []
        for gi, g in enumerate(self.param_groups):
            sg = {k: v for k, v in g.items() if k != "params"}
            sg["params"] = []
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if offload_all or p.numel() >= minimal_size:
                    big.append((gi, p))
                else:
                    sg["params"].append(p)
            small_groups.append(sg)
        self._small_params = [p for g in small_groups for p in g["params"]]
        dev_kwargs = {k: v for k, v in self._dev_kwargs.items() if k not in ("lr", "betas", "eps", "weight_decay")}
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
        job = job or os.environ.get("AOQ_JOB") or _job_default()
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        copts = dict(socket=socket, job=job, rank=rank, precision=_PRECISION[(state_precision, master)],
                     max_grad_norm=max_grad_norm or 0.0, skip_nonfinite=skip_nonfinite,
                     delayed_update=delayed_update, seed=seed)
        self._client = None
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
                c.add_group(kind, lr=hp[0], betas=hp[1], eps=hp[2], weight_decay=hp[3])
                self._sent_hp.append(hp)
            for gi, p in big:
                if p.dtype not in _AOQ_DTYPE:
                    raise ValueError("parameter %s: dtype %s (aoq has fp32, bf16, fp16)" % (names[p], p.dtype))
                if not p.is_contiguous():
                    raise ValueError("parameter %s is not contiguous" % names[p])
                s = _Slot(len(self._slots), p, names[p], gi)
                dt = _AOQ_DTYPE[p.dtype]
                if self._framework:
                    pin = torch.cuda.is_available()
                    s.host_param = torch.empty(p.numel(), dtype=p.dtype, pin_memory=pin)
                    s.host_grad = torch.empty(p.numel(), dtype=p.dtype, pin_memory=pin)
                    s.host_param.copy_(p.detach().reshape(-1))
                    addr = s.host_param.data_ptr()
                else:
                    addr = p.data_ptr()
                c.add_tensor(s.name, addr, numel=p.numel(), param_dtype=dt, grad_dtype=dt, group=gi)
                self._slots.append(s)
                self._slot_of[p] = s
            c.register()
            for s in self._slots:
                s.p.register_post_accumulate_grad_hook(self._make_hook(s))
        self._step_started = False
        self._hooks_pushed = False
        self._inflight_bytes = 0
        self._inflight_fifo = collections.deque()
        self.offload_window_bytes = 1 << 30 if self.offload_gradients else 0
        self.last_result = None
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------------
    @staticmethod
    def _hp_of(g):
        return (float(g["lr"]), (float(g["betas"][0]), float(g["betas"][1])), float(g["eps"]),
                float(g["weight_decay"]))

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self._cuda else None

    def _begin_step(self):
        """Before the first push of a step: the groups' hyperparameters (an
        LR scheduler changes them after step()) go to the daemon."""
        if self._step_started:
            return
        self._step_started = True
        for gi, g in enumerate(self.param_groups):
            hp = self._hp_of(g)
            if hp != self._sent_hp[gi]:
                self._client.set_hyperparams(gi, lr=hp[0], betas=hp[1], eps=hp[2], weight_decay=hp[3])
                self._sent_hp[gi] = hp

    def _push(self, s, grad, final):
        self._begin_step()
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
            s.p.view(-1).copy_(s.host_param, non_blocking=s.host_param.is_pinned())

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
        if p.grad is None or self._client is None:
            return
        s.count += 1
        k = self._learned
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

    # ------------------------------------------------------------------
    def attach(self, model):
        """Forward pre-hooks on model's modules: before a module runs, the
        current stream waits for its own parameters' updates (no host sync
        between steps).  Parameters of no attached module are waited for at
        the end of step().  Not for models under torch.compile (the hooks
        would break the graph): there step() waits for everything."""
        handles = []
        for m in model.modules():
            slots = [self._slot_of[p] for p in m.parameters(recurse=False) if p in self._slot_of]
            if not slots:
                continue
            for s in slots:
                s.covered = True

            def pre(mod, args, slots=slots):
                for s in slots:
                    self._wait(s)
                if self._inflight_fifo:
                    self._reap()
            handles.append(m.register_forward_pre_hook(pre))
        return handles

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._slots:
            self._begin_step()
            counts = [s.count for s in self._slots]
            for s in self._slots:
                if s.final:
                    continue
                if self.offload_gradients:
                    if s.held is not None:
                        self._push(s, s.held, final=True)
                    elif s.count > 0:   # accumulated in the daemon, no final push yet: zeros end it
                        z = (s.host_grad.zero_() if self._framework else
                             torch.zeros(s.numel, dtype=s.p.dtype, device=s.p.device))
                        self._push(s, z, final=True)
                elif s.p.grad is not None:
                    self._push(s, s.p.grad, final=True)
            if self._learned is None and max(counts) > 0:
                self._learned = max(counts)
        if self._dev_opt is not None:
            for dg, gi in zip(self._dev_opt.param_groups, self._dev_group_of):
                g = self.param_groups[gi]
                for k in ("lr", "betas", "eps", "weight_decay"):
                    dg[k] = g[k]
            self._dev_opt.step()
        if self._slots:
            self._client.step_end()
            if self._inflight_fifo:
                self._reap()
            for s in self._slots:
                s.count, s.final, s.held = 0, False, None
                if not s.covered:
                    self._wait(s)
            self._step_started = False
        return loss

    def zero_grad(self, set_to_none=True):
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
        if self._client is not None:
            self.synchronize()
            self._client.close()
            self._client = None
            self._slots = []

    # ------------------------------------------------------------------
    def state_dict(self):
        """{"state": {name: {"step", "master", "exp_avg", "exp_avg_sq"}},
        "param_groups": [... "params": [names]]}.  Daemon states are read
        as fp32 (q8 and bf16 states converted by the daemon)."""
        state = {}
        if self._slots:
            self.synchronize()
            steps = self._client.get_tensor_steps()
            for s in self._slots:
                st = {"step": torch.tensor(float(steps[s.t]))}
                for w in ("master", "exp_avg", "exp_avg_sq"):
                    a = self._client.read_state(s.t, w)
                    st[w] = torch.from_numpy(a).view(s.p.shape)
                state[s.name] = st
        if self._dev_opt is not None:
            for p, st in self._dev_opt.state.items():
                state[self._names[p]] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [self._names[p] for p in g["params"]]
            groups.append(d)
        return {"state": state, "param_groups": groups, "aoq": {"kind": self._kind, "format": 1,
                                                                     "seed": self._client.seed if self._client else 0}}

    def load_state_dict(self, state_dict):
        import numpy as np
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has %d parameter groups, this optimizer %d"
                             % (len(groups), len(self.param_groups)))
        for g, lg in zip(self.param_groups, groups):
            if [self._names[p] for p in g["params"]] != list(lg["params"]):
                raise ValueError("loaded state dict's parameter names differ from this optimizer's")
            for k, v in lg.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
        state = state_dict["state"]
        if self._slots:
            self.synchronize()
            steps = self._client.get_tensor_steps()
            for s in self._slots:
                st = state.get(s.name)
                if st is None:
                    continue
                for w in ("master", "exp_avg", "exp_avg_sq"):
                    a = np.ascontiguousarray(st[w].detach().to("cpu", torch.float32).reshape(-1).numpy())
                    self._client.load_state(s.t, w, a)
                steps[s.t] = int(st["step"])
                with torch.no_grad():   # the device parameter follows the loaded master
                    s.p.copy_(st["master"].to(s.p.device, s.p.dtype).view(s.p.shape))
                    if self._framework:
                        s.host_param.copy_(s.p.reshape(-1))
            self._client.set_tensor_steps(steps)
            self._step_started = False
            self._begin_step()      # the loaded hyperparameters
            self._step_started = False
        if self._dev_opt is not None:
            for p in self._small_params:
                st = state.get(self._names[p])
                if st is not None:
                    self._dev_opt.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and k != "step" else
                                                  (v.clone() if torch.is_tensor(v) else v)) for k, v in st.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __del__(self):
        try:
            if getattr(self, "_client", None) is not None:
                self._client.close()
        except Exception:
            pass
