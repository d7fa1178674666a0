# SPDX-License-Identifier: MIT
"""aoq.torch's hooks and push path: the per-parameter slot, the
post-accumulate-grad hook that pushes a final gradient, the pushes
themselves and the copies in flight, the waits before a module runs (the
global forward pre-hook, attach(), a module's state_dict hooks, the in-graph
ops of compiled code), and the global hooks' life."""
import warnings
import weakref

import torch

from ._dist import _ddp_class, _local
from ._graph import _OPTIMIZERS, _PUSH_OP, _WAIT_OP, _GraphTap, _is_compiling, _next_optimizer_id


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


class _PushPath:
    """OffloadOptimizer's hooks, pushes and waits (a mixin: the state is the
    optimizer's own)."""

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
        if p.grad is None or self._client is None:
            return
        if s.moved:
            # the host share: a final gradient (the loop known not to edit
            # gradients, not DDP's, which averages after this hook) steps
            # now on the device, beside the rest of backward
            sh = self._share
            if (sh is not None and p.is_cuda and not s.ddp and self._edits is False and self._learned is not None
                    and sh.is_host(s.p)):
                s.count += 1
                if s.count == self._learned:
                    sh.step_early(s.p, self.param_groups)
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

    def _install_global_hooks(self, graph_push):
        """The constructor's global module hooks (the optimizer has slots).
        Import swap = attach: before any module runs, the current stream
        waits for that module's own parameters only (no host sync), through
        a weak reference: the global registry must not keep the optimizer
        alive."""
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
