# SPDX-License-Identifier: MIT
"""aoq.torch's saved state: state_dict() and load_state_dict() of the
offloaded optimizer (torch's positional format plus aoq's names; torch's
Adam/AdamW and torchao's CPUOffloadOptimizer loaded too), and _HostFallback,
the optimizer classes aoqd does not run, stepped on host copies."""
import torch

from ._dist import _canon_fqn, _is_dtensor, _like_param, _local
from ._kinds import _STATE_KEYS, _check_hp
from ._q8 import param24
from ._share import _state_copy


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
            _take_group(g, hg)


def _take_group(g, saved, keep=()):
    """Live group g takes the saved group's keys whole, as torch's
    load_state_dict does (a scheduler's initial_lr too), its own params
    kept; of g's other keys only those in keep stay."""
    params = g["params"]
    kept = {k: g[k] for k in keep if k in g and k not in saved}
    g.clear()
    g["params"] = params
    for k, v in saved.items():
        if k != "params":
            g[k] = tuple(v) if k == "betas" else v
    g.update(kept)


def _copied_state_dict(sd):
    """sd with every state tensor copied (torch's load_state_dict keeps views
    of the loaded tensors where dtype and device already match)."""
    state = {k: ({kk: (vv.detach().clone() if torch.is_tensor(vv) else vv) for kk, vv in st.items()}
                 if isinstance(st, dict) else st) for k, st in sd["state"].items()}
    return dict(sd, state=state)


class _StateDict:
    """OffloadOptimizer's state_dict and load_state_dict (a mixin: the state
    is the optimizer's own)."""

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
                state[index[s.p]] = self._slot_state(s, steps, sync=False)
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

    def _slot_state(self, s, steps=None, sync=True):
        """Offloaded slot s's state as torch keeps it: "step", the moments
        and "master", fp32 CPU tensors read from aoqd (after a host barrier
        unless sync=False), DTensors for an FSDP2 parameter."""
        if sync:
            self.synchronize()
        if steps is None:
            steps = self._client.get_tensor_steps()
        st = {"step": torch.tensor(float(steps[s.t]))}
        for key, w in self._state_keys(s) + (("master", "master"),):
            a = self._client.read_state(s.t, w)
            st[key] = _like_param(s.p, torch.from_numpy(a).view(s.x.shape))
        if self._kind == "sgd" and not self._state_keys(s):
            st["momentum_buffer"] = None
        return st

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
            # Names (torch.distributed.checkpoint's FQNs) are checked against
            # the names this optimizer was given; unnamed parameters (their
            # positions) match by position, as torch's optimizers match any.
            if ids and all(isinstance(i, str) for i in ids):
                bad = [(i, self._names[p]) for i, p in zip(ids, g["params"])
                       if not self._names[p].isdigit() and _canon_fqn(i) != _canon_fqn(self._names[p])]
                if bad:
                    raise ValueError("loaded state dict's parameter names differ from this optimizer's (%s)"
                                     % ", ".join("%r for %r" % b for b in bad[:3]))
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
            _take_group(g, lg, keep=("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov"))
            _check_hp(self._kind, g)
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
                    if self._master_bits == 24 and s.x.dtype == torch.bfloat16:
                        # aoqd's parameter of a 24-bit master (a tie rounds up;
                        # with aoqd.conf master_param = no nothing is split, and
                        # a tie's parameter is one ulp off until the next step)
                        s.x.copy_(param24(master.to("cpu", torch.float32)).to(s.x.device).view(s.x.shape))
                    else:
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
