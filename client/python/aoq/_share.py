# SPDX-License-Identifier: MIT
"""aoq.torch's GPU share (gpu_state_budget=): the parameters whose optimizer
state stays on the device (_DeviceShare), and "auto"'s arithmetic: which
updates of a probe step end late (_auto_late), which parameters move
(_auto_choice), whether to probe again (_auto_again), and how the ranks of a
data-parallel job agree on one split (_dist_group, _agree, _first_ranks);
the device bytes a share takes (_share_bytes, _share_step_bytes) against
those torch's optimizer would (_torch_state_bytes); _AutoSplit,
OffloadOptimizer's methods that time the probe step, cap the move by the
device's measured memory (_auto_cap, _device_memory) and move the state."""
import logging
import time
import warnings

import torch

from . import _q8
from ._dist import _mix64


def _state_copy(p, key, v):
    """A loaded optimizer state value for parameter p, as torch's
    Optimizer.load_state_dict casts it (floating state to p's dtype and
    device, "step" as it is), but always a copy of the loaded tensor."""
    if not torch.is_tensor(v):
        return v
    v = v.detach()
    if key == "step":
        return v.clone()
    if v.is_floating_point() and p.is_floating_point():
        return v.to(device=p.device, dtype=p.dtype, copy=True)
    return v.to(device=p.device, copy=True)


# The default share (gpu_state_budget=None): "auto" within this fraction of
# the device peak its first probe measures with everything offloaded (bf16
# parameters, an fp32 master and q8 or q4 moments; docs/decisions.md)
DEFAULT_SHARE = 0.015
_AUTO_PROBE_STEP = 3      # "auto" measures the third step: the first learns the pushes, the second streams
_AUTO_ROUNDS = 3          # "auto" probes at most this often, two steps apart (the step after a move settles)
_AUTO_MIN_LATE = 0.01     # ...and again only while more than this share of the offloaded parameters was late
_AUTO_MIN_PASSED = 1 << 20  # past a tensor too large for the cap, smaller ones stay on the host (_auto_choice)
_AUTO_LATE_S = 1e-3       # a tail shorter than this is none


def _auto_late(total, span, tail, fwd=None):
    """gpu_state_budget="auto": (late, B0), the number of the total offloaded
    parameters whose update ends too late, from the probe step's timeline:
    span B (the first final push to the end of backward, on the device),
    tail T (the end of backward to the last update landed) and, with a
    staging window or the delayed update, fwd F (the forward's start to the
    first final push).

    The daemon updated the total in B + T at one pace; it can keep what it
    does within B0, the backward the device alone would take, and the rest
    is late.  Without a window B0 = B.  With one, a daemon slower than
    backward holds gradients back (a push waits for a free slot; with the
    delayed update, for the tensor's previous update to be answered): backward
    stretches to the daemon's pace and the tail stays short.  The forward is
    not held back, and backward takes about twice a forward's time (twice
    its FLOPs): B0 = min(B, 2 F)."""
    b0 = span if fwd is None else min(span, 2 * fwd)
    if span + tail <= 0 or (tail <= _AUTO_LATE_S and b0 >= span):
        return 0, b0
    return max(0, total - int(total * b0 / (span + tail))), b0


def _auto_again(late, offloaded, moved, rounds):
    """gpu_state_budget="auto", after a probe that moved `moved` parameters
    of `offloaded` (late of them were late), the `rounds`-th: probe again
    (two steps on) while state still moves and more than _AUTO_MIN_LATE of
    the offloaded parameters were late.  One probe can misjudge the
    daemon's pace (the host's memory bandwidth moves between steps, and the
    move itself changes what the daemon shares the host with), so the split
    converges over a few probes; state never moves back."""
    return rounds < _AUTO_ROUNDS and moved > 0 and late > offloaded * _AUTO_MIN_LATE


def _dist_group(numels):
    """gpu_state_budget="auto": torch.distributed's module when a default
    group of 2+ ranks is up and every rank offloads tensors of these sizes
    (data-parallel replicas), else None: then each rank splits alone (e.g.
    pipeline stages, whose layouts differ).  A collective: every rank calls
    it at its first probe."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    h = hash(tuple(numels)) & ((1 << 52) - 1)      # ints hash alike in every process
    hi, neg_lo = _agree(dist, h, -h)
    return dist if hi == -neg_lo else None


def _dist_many():
    """True when a torch.distributed default group of 2+ ranks is up: the
    default share (DEFAULT_SHARE) is off there, as its split would need
    collectives the user did not ask for."""
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _agree(dist, *values):
    """gpu_state_budget="auto" under torch.distributed (dist: _dist_group's
    answer): the largest of each value over the ranks of the default
    process group (the values as they are without one).  Every replica must
    take the same split: replicas that step a parameter in different places
    (aoqd's kernel here, torch's AdamW there) drift apart in the last bits,
    and a replica group's state is one for all.  A collective, so every
    rank probes at the same steps; exact for integers below 2^53."""
    if dist is None:
        return values
    dev = torch.device("cpu")
    if dist.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([max(-2.0 ** 62, min(2.0 ** 62, float(v))) for v in values], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())


def _first_ranks(dist, chosen, slots):
    """gpu_state_budget="auto" under torch.distributed: rank 0's choice
    (elements of slots) on every rank.  The order of the final pushes, from
    which each rank chooses, differs between DDP ranks (their buckets'
    all-reduces finish in any order), so equal counts are not enough."""
    if dist is None:
        return chosen
    pos = {id(s): i for i, s in enumerate(slots)}
    box = [[pos[id(s)] for s in chosen]]
    dist.broadcast_object_list(box, src=0)
    return [slots[i] for i in box[0]]


def _auto_choice(numels, costs, late, cap, margin=1.1):
    """gpu_state_budget="auto": indices (into push order) of the parameters
    to keep on the device: the parameters pushed last first, until they hold
    margin x late parameters; one whose state (costs, bytes) does not fit in
    what is left of cap bytes is passed over for those pushed before it (a
    large embedding pushed last must not keep the first layers, which fit,
    on the host: every parameter moved is host work the step no longer
    waits for).  Past such a gap only tensors of _AUTO_MIN_PASSED elements
    or more move: there a small one (a layer norm) no longer shortens the
    step's tail, and its host update costs less than its own step on the
    device's side (a Python loop turn and kernel launches per tensor)."""
    need, got, used, chosen, gap = late * margin, 0, 0, [], False
    for i in reversed(range(len(numels))):
        if got >= need:
            break
        if used + costs[i] > cap:
            gap = True
            continue
        if gap and numels[i] < _AUTO_MIN_PASSED:
            continue
        chosen.append(i)
        got += numels[i]
        used += costs[i]
    return chosen


def _host_need(late, total, host, rc, rg):
    """gpu_state_budget="auto", the host share: how many more parameters'
    state should move to it.  The host share steps its tensors on the
    device during backward, as their gradients arrive, while the daemon
    updates the rest: the daemon at rc parameters/s, the share at rg.  Of
    all total + host parameters (host: those in the share already) the
    share should hold rg / (rc + rg), so that both end together; no more
    than the late parameters (those the daemon could not update within the
    device's backward), and none move back."""
    if rc <= 0 or rg <= 0 or late <= 0:
        return 0
    return max(0, min(late, int((total + host) * rg / (rc + rg)) - host))


def _host_choice(numels, ok, taken, need):
    """gpu_state_budget="auto", the host share: indices (into push order)
    of the parameters whose state moves to pinned host memory, stepped by
    the device over PCIe as soon as their gradient is final
    (_DeviceShare.step_early): need parameters, the ones pushed first
    first, whose step then has the rest of backward to run beside it (the
    device share takes those pushed last: taken, this probe's indices).
    ok[i] False (not a bf16 or fp32 parameter, or smaller than
    _AUTO_MIN_PASSED: a Python call and kernel launch per tensor) passes one
    over."""
    got, chosen, skip = 0, [], set(taken)
    for i in range(len(numels)):
        if got >= need:
            break
        if i in skip or not ok[i]:
            continue
        chosen.append(i)
        got += numels[i]
    return chosen


def _share_bytes(p, kind, master, q8=False):
    """Device bytes of p's optimizer state in the GPU share, the cheapest
    with the numerics of the offloaded state.  q8 (aoqd keeps an fp32
    master and q8 moments, Adam/AdamW): the q8 codes and scales (2.03
    bytes/parameter, aoq/_q8.py) and the master: the low halves of a split
    one beside bf16 parameters (2 bytes/parameter), fp16's own 4, none for
    fp32.  Otherwise the moments (two for Adam/AdamW, one for SGD
    with momentum and Lion) in p's dtype, as torch's optimizer keeps them
    when it steps p itself (a bf16 master's share: bf16 moments, 4
    bytes/parameter for AdamW); where the state's master is fp32 and p is
    not, an fp32 master and fp32 moments (12 bytes/parameter)."""
    moments = 2 if kind in ("adam", "adamw") else 1
    n = p.numel()
    if q8 and moments == 2:
        # the master: none beside an fp32 parameter, its low halves beside a
        # bf16 one (_q8.split_master), else its own 4 bytes
        own = 0 if master is not None or p.dtype == torch.float32 else 2 if p.dtype == torch.bfloat16 else 4
        return own * n + 2 * n + 8 * _q8.blocks(n)
    if master is None and p.dtype != torch.float32:
        return (moments + 1) * 4 * n
    return moments * p.element_size() * n


def _share_step_bytes(p, master, q8=False):
    """Device bytes the share allocates for p only while it steps: the fp32
    copy of the gradient where an fp32 master steps a parameter that is not
    fp32 with torch's optimizer (_DeviceShare.step); none with q8 moments,
    whose step reads the gradient as it is."""
    return 4 * p.numel() if master is None and p.dtype != torch.float32 and not q8 else 0


def _alloc_bytes(n):
    """The bytes torch's CUDA caching allocator takes for an n-byte tensor
    (blocks of 512 bytes)."""
    return (n + 511) // 512 * 512


def _torch_state_bytes(params, kind, momentum):
    """The device bytes torch's optimizer (kind) allocates for its state of
    params (local tensors) when it steps them on the device, as on-GPU AdamW
    does: two moments each in the parameter's dtype for Adam/AdamW, one for
    Lion and for SGD with momentum (momentum: per parameter), none for SGD
    without."""
    total = 0
    for p, mom in zip(params, momentum):
        n = 2 if kind in ("adam", "adamw") else 1 if kind == "lion" or mom else 0
        total += n * _alloc_bytes(p.numel() * p.element_size())
    return total


def _device_memory(dev):
    """(the device's peak of allocated bytes so far, its free bytes) for
    "auto"'s cap, or None where torch keeps no such counts (the CPU: no cap).
    One function, so a test can fake a device."""
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return torch.cuda.max_memory_allocated(dev), free


class _DeviceShare:
    """The GPU share (gpu_state_budget=): parameters whose optimizer state
    stays on the device, stepped there at step() by optimizer_class (fused
    on CUDA where torch has it), on an fp32 master where the parameter is not
    fp32 and aoq's master would be, so the numerics are those of the
    offloaded part.  With q8 (aoqd keeps an fp32 master and q8 moments,
    Adam/AdamW) the moments are q8 codes in aoqd's format too, stepped by
    _q8._Q8Adam.  They are the first parameters in order: the last
    gradients of backward, whose update would otherwise end after it."""

    def __init__(self, share, groups, optimizer_class, kwargs, kind, fp32_master, q8=False, seed=0, host=False):
        self.fp32_master = fp32_master
        self.q8 = q8                # the caller's _share_q8: Adam/AdamW, fp32 master, q8 or q4 in aoqd
        self.seed = seed
        self.host = set()           # q8: the tensors stepped whose state is in pinned host memory
        self.early = set()          # ...those of them stepped early this step (step_early)
        self.side = None            # ...the stream those early steps run on
        self.timing = None          # a list: step_early records (start, end) events of each step in it
        self.params = []
        self.master = {}
        self.param_of = {}       # q8: the tensor stepped (master) -> its parameter
        self.seed_of = {}        # q8: the tensor stepped -> its random bits' seed
        self.group_of = []
        self.group_index = {}    # the tensor stepped -> its group's index in self.opt.param_groups
        per_group = self._take(share, groups, host)
        opt_groups = []
        for gi in sorted(per_group):
            self.group_index.update((t, len(opt_groups)) for t in per_group[gi])
            opt_groups.append(self._group(groups, gi, per_group[gi]))
            self.group_of.append(gi)
        if self.q8:
            self.opt = _q8._Q8Adam(opt_groups, self.param_of, self.seed_of, decoupled=kind == "adamw")
            self.opt.host = self.host
            return
        kw = {k: v for k, v in kwargs.items()
              if k not in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")}
        dev = self.params[0].device
        if (dev.type == "cuda" and kind in ("adam", "adamw") and "fused" not in kw and "foreach" not in kw):
            kw["fused"] = True
        self.opt = optimizer_class(opt_groups, **kw)

    def _take(self, share, groups, host=False):
        """The tensors the device optimizer steps for share's (group,
        parameter) pairs, by group: the parameter, or its fp32 master (host:
        their state in pinned host memory; q8 beside bf16 or fp32
        parameters only, whose master is the parameter)."""
        per_group = {}
        index = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
        for gi, p in share:
            t = p
            # q8 beside bf16 parameters: the master split, stepped as the parameter
            if self.fp32_master and p.dtype != torch.float32 and not (self.q8 and p.dtype == torch.bfloat16):
                t = p.detach().to(torch.float32).clone()
                self.master[p] = t
            self.params.append(p)
            self.param_of[t] = p
            # the parameter's place in the optimizer mixed into the seed:
            # every tensor its own bits, every replica the same
            self.seed_of[t] = _mix64(self.seed ^ _mix64(index[id(p)]))
            if host:
                assert self.q8 and t is p, "the host share: q8 beside a bf16 or fp32 parameter"
                self.host.add(t)
            per_group.setdefault(gi, []).append(t)
        return per_group

    @staticmethod
    def _group(groups, gi, tensors):
        g = {k: v for k, v in groups[gi].items() if k != "params"}
        g["params"] = tensors
        return g

    def add(self, share, groups, host=False):
        """More parameters (gpu_state_budget="auto" moves them in)."""
        for gi, ts in sorted(self._take(share, groups, host).items()):
            if gi in self.group_of:
                i = self.group_of.index(gi)
                self.opt.param_groups[i]["params"].extend(ts)
            else:
                i = len(self.group_of)
                self.opt.add_param_group(self._group(groups, gi, ts))
                self.group_of.append(gi)
            self.group_index.update((t, i) for t in ts)

    @staticmethod
    def _hyper(og, g):
        for k in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov"):
            if k in g and k in og:
                og[k] = g[k]

    def is_host(self, p):
        """p's state is in the host share."""
        return self.master.get(p, p) in self.host

    def step_early(self, p, groups):
        """The host share: p's gradient is final (backward goes on), so its
        step runs now on a side stream, which waits for the work queued so
        far (the gradient) and holds the gradient's memory until it is
        done; step() skips p and makes the next work wait for that stream.
        Its PCIe-bound kernel overlaps backward and the daemon's updates."""
        t = self.master.get(p, p)
        i = self.group_index[t]
        og = self.opt.param_groups[i]
        self._hyper(og, groups[self.group_of[i]])
        cur = torch.cuda.current_stream(p.device)
        if self.side is None:
            self.side = torch.cuda.Stream(p.device)
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            ev = None
            if self.timing is not None:
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
            self.opt.step_tensor(t, og)
            if ev is not None:
                ev[1].record()
                self.timing.append(ev)
        p.grad.record_stream(self.side)
        self.early.add(t)

    def step(self, groups):
        for og, gi in zip(self.opt.param_groups, self.group_of):
            self._hyper(og, groups[gi])
        if self.q8:
            self.opt.step(skip=self.early)      # reads p.grad, writes the master and p
            if self.side is not None:
                torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.early.clear()
            return
        for p, m in self.master.items():
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        self.opt.step()
        with torch.no_grad():
            for p, m in self.master.items():
                if m.grad is not None:
                    p.copy_(m)
                m.grad = None

    def live_state(self, p):
        """p's state as torch's optimizer keeps it (q8: decoded copies), or
        None before its first step."""
        t = self.master.get(p, p)
        return self.opt.moments(t) if self.q8 else self.opt.state.get(t)

    def state_items(self):
        """(parameter, its state as torch's optimizer keeps it, plus
        "master" where the share keeps one)."""
        for p in self.params:
            t = self.master.get(p, p)
            st = self.live_state(p)
            if not st:
                continue
            d = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            if t is not p:
                d["master"] = t.detach().clone()
            yield p, d

    def load(self, entries):
        mine = set(self.params)
        for p, st in entries:
            if p not in mine or st is None:
                continue
            t = self.master.get(p, p)
            with torch.no_grad():
                if t is not p:
                    t.copy_(st["master"].to(t.device, t.dtype).view(t.shape) if st.get("master") is not None
                            else p.detach().to(torch.float32))
                    p.copy_(t)
                elif st.get("master") is not None:
                    p.copy_(st["master"].to(p.device, p.dtype).view(p.shape))
            if self.q8:
                # fp32 values, encoded by set_moments (not cast to a bf16 t's dtype)
                self.opt.set_moments(t, {k: v for k, v in st.items() if k != "master"}, master=st.get("master"))
                continue
            d = {k: _state_copy(t, k, v) for k, v in st.items() if k != "master"}
            if torch.is_tensor(d.get("step")) and self.opt.defaults.get("fused"):
                d["step"] = d["step"].to(device=t.device, dtype=torch.float32)   # fused keeps it there
            self.opt.state[t] = d


class _AutoSplit:
    """OffloadOptimizer's gpu_state_budget="auto": the probe step's timeline
    and the move of state from aoqd to the device share (a mixin: the state
    is the optimizer's own)."""

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

    def _auto_split(self, t_backward, share_end=None):
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
        if self._auto_frac is not None and _dist_many():
            # the default share, with a process group started after the
            # optimizer: off (no collectives unasked)
            self._auto, self._auto_probe = False, None
            self.synchronize()
            return
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
        cap, peak = self._auto_cap()
        # every replica of a process group the same: the most late, the least room
        if self._auto_dist is False:
            self._auto_dist = _dist_group([s.numel for s in self._slots])
        dist = self._auto_dist
        late, neg_cap = _agree(dist, late, -cap)
        late, cap = int(late), -neg_cap
        master = None if self._fp32_master else "bf16"
        q8 = self._share_q8
        chosen = _auto_choice([s.numel for s in order], [_share_bytes(s.p, self._kind, master, q8) +
                                                         _share_step_bytes(s.p, master, q8) for s in order], late, cap)
        moved = _first_ranks(dist, [order[i] for i in chosen], self._slots)
        self._auto_cost += sum(_share_bytes(s.p, self._kind, master, q8) + _share_step_bytes(s.p, master, q8)
                               for s in moved)
        prev = self.auto_split or {}
        h = self._since(t_backward, share_end) if share_end is not None else 0.0
        hs = 0.0        # the host share's early steps on this probe step: their kernels' time
        if self._share is not None and self._share.timing:
            hs = sum(a.elapsed_time(b) for a, b in self._share.timing) / 1e3
        if self._share is not None:
            self._share.timing = None
        hosted = []
        defer = False       # the host share waits for the next probe
        rest = max(0, late - sum(order[i].numel for i in chosen))
        host_ok = self._host_share_ok()
        if host_ok and not prev and chosen:
            # the first probe: the device share moves first, and what is
            # still late after it is measured at the next probe (where the
            # device share alone ended the tail, GPT 0.94 B, a host share
            # moved on this probe's count cost 5-7 %: tests/bench/RESULTS.md,
            # "The host share")
            defer = True
        elif host_ok and rest > total * _AUTO_MIN_LATE:
            # the daemon's pace as _auto_late takes it (the first final push
            # to the end of backward, then its tail); the host share's from
            # its early steps' kernels
            host = prev.get("host_params", 0)
            rc = total / (span + tail) if span + tail > 0 else 0.0
            # before the share has stepped, half the daemon's pace: its kernel
            # waits on PCIe beside the daemon's copies, and state never moves
            # back, so the first move errs small (tests/bench/RESULTS.md,
            # "The host share": 3.8-4.3 G/s against the daemon's 7)
            rg = host / hs if host and hs > 0 else rc / 2
            need = _host_need(rest, total, host, rc, rg)
            ok = [s.numel >= _AUTO_MIN_PASSED and s.p.dtype in (torch.bfloat16, torch.float32) for s in order]
            hosted = _first_ranks(dist, [order[i] for i in _host_choice([s.numel for s in order], ok, chosen, need)],
                                  self._slots)
        if moved or hosted:
            if self._leased and not self._auto_lease_warned:
                # aoqd keeps the moved tensors registered with their state
                # as of now: a resume from the lease would take it
                self._auto_lease_warned = True
                warnings.warn("aoq: gpu_state_budget='auto' moved optimizer state to the device in a leased session: "
                              "a resume from aoqd's lease gets the moved parameters and their state as of step %d; "
                              "the trainer's own checkpoint must hold them (docs/python.md, \"The default share\")"
                              % self._nstep)
            if self.delayed_update:
                # every update pending in aoqd lands now: the moved
                # parameters' last one is in the master _move_to_share
                # reads, and none may land on them later (flush() would
                # put that old value back)
                self.flush()
            if moved:
                self._move_to_share(moved)
            if hosted:
                self._move_to_share(hosted, host=True)
        rounds = prev.get("rounds", 0) + 1
        n_host = sum(s.numel for s in hosted)
        n_moved = sum(s.numel for s in moved) + n_host
        # the last probe's measurements; device_* count every probe's moves
        self.auto_split = dict(backward_seconds=span, tail_seconds=tail, forward_seconds=fwd,
                               device_backward_seconds=b0, late_params=late, params=total,
                               moved_params=n_moved, rounds=rounds, share_seconds=h, host_step_seconds=hs,
                               device_params=prev.get("device_params", 0) + n_moved - n_host,
                               device_bytes=prev.get("device_bytes", 0) + sum(
                                   _share_bytes(s.p, self._kind, master, q8) for s in moved),
                               host_params=prev.get("host_params", 0) + n_host,
                               host_bytes=prev.get("host_bytes", 0) + sum(
                                   _share_bytes(s.p, self._kind, master, q8) for s in hosted),
                               device_cap_bytes=cap, peak_bytes=peak, peak_bound_bytes=self._auto_bound,
                               aoqd_released_bytes=self._released)
        again = bool(_agree(dist, int(_auto_again(late, total, n_moved, rounds) or defer))[0])   # any rank: all probe
        self._auto_probe = self._nstep + 2 if again else None
        logging.getLogger("aoq").info(
            "aoq: gpu_state_budget='auto', probe %d: the update ended %.1f ms after backward (%.1f ms after the "
            "first push; ~%d of %d offloaded parameters late); %d parameters' state moved to the device, %d "
            "(%.2f GiB) in all, %d to the host share (%d, %.2f GiB of pinned memory, in all; its steps %.1f ms), "
            "within %s%s", rounds, 1e3 * tail, 1e3 * span, late, total, n_moved - n_host,
            self.auto_split["device_params"], self.auto_split["device_bytes"] / 2 ** 30, n_host,
            self.auto_split["host_params"], self.auto_split["host_bytes"] / 2 ** 30, 1e3 * hs,
            "no device cap" if cap == float("inf") else "%.2f GiB (device peak %.2f GiB%s)" % (
                cap / 2 ** 30, (peak or 0) / 2 ** 30, "" if self._auto_bound is None else
                ", the default share's bound %.2f GiB" % (self._auto_bound / 2 ** 30) if self._auto_frac else
                ", on-GPU state's %.2f GiB" % (self._auto_bound / 2 ** 30)),
            "; probing again at step %d" % self._auto_probe if again else "")

    def _auto_cap(self):
        """(the device bytes this probe may move, the device peak measured),
        both from the device's memory counts (_device_memory; no cap and
        None where there are none).  Never more than the free memory less
        max(2 GiB, 10%).  max_device_bytes bytes: that many in all (state
        and the share's step-time copies, _share_step_bytes); a fraction: of
        the free memory at the first probe.  None (default): the device peak
        the same model has with torch's optimizer on the device.  The first
        probe, with everything offloaded, measures the run's device peak and
        adds the bytes torch's optimizer state takes for the offloaded
        parameters (_torch_state_bytes): that bound is on-GPU AdamW's peak.
        Each probe may then move the least of that state's bytes less what
        moved (counted) and the bound less the largest peak measured so far
        (what moved measured), so the share takes no more than offloading
        freed, and a share that measures larger than counted stops the
        moves.  The default share (gpu_state_budget=None) is the same with
        DEFAULT_SHARE of the first probe's peak in place of torch's state."""
        mem = _device_memory(self.device)
        if mem is None:
            return 0 if self._auto_frac else float("inf"), None
        peak, free = mem
        self._auto_peak = max(self._auto_peak, peak)
        room = max(0, free - max(2 << 30, free // 10))
        lim = self._max_device_bytes
        if isinstance(lim, float):
            if self._auto_free0 is None:
                self._auto_free0 = free
            return max(0, int(lim * self._auto_free0) - self._auto_cost), peak
        if lim is not None:
            return min(room, max(0, lim - self._auto_cost)), peak
        if self._auto_bound is None and self._auto_frac is not None:
            # the default share: a fraction of the peak with everything
            # offloaded (this first probe's), the share measured as it grows
            self._auto_state = int(self._auto_frac * peak)
            self._auto_bound = peak + self._auto_state
        if self._auto_bound is None:
            state = _torch_state_bytes([s.x for s in self._slots], self._kind, [
                bool(self.param_groups[s.group].get("momentum", 0)) for s in self._slots])
            self._auto_state = state
            self._auto_bound = peak + state
        return min(room, max(0, self._auto_state - self._auto_cost),
                   max(0, self._auto_bound - self._auto_peak)), peak

    def _host_share_ok(self):
        """The host share may take state: host_share=True, q8 moments in the
        share, a CUDA device and a libaoq that steps there (_q8.has_kernel)."""
        if self._host_share_kernel is None:
            self._host_share_kernel = bool(self._host_share and self._share_q8 and self.device.type == "cuda"
                                           and _q8.has_kernel())
            if self._host_share and self._share_q8 and self.device.type == "cuda" and not self._host_share_kernel:
                warnings.warn("aoq: host_share=True has no effect: this libaoq was built without CUDA "
                              "(aoq_device_adam_q8)")
        return self._host_share_kernel

    def _move_to_share(self, slots, host=False):
        """The state of slots (synchronized; with the delayed update,
        flushed) leaves aoqd for the device share (host: for the host share,
        its state in pinned host memory)."""
        steps = self._client.get_tensor_steps()
        entries = []
        for s in slots:
            st = {"step": torch.tensor(float(steps[s.t]))}
            for key, w in self._state_keys(s) + (("master", "master"),):
                st[key] = torch.from_numpy(self._client.read_state(s.t, w)).view(s.x.shape)
            entries.append((s.p, st))
        if self._share is None:
            self._share = _DeviceShare([(s.group, s.p) for s in slots], self.param_groups, self._optimizer_class,
                                       self._dev_kwargs, self._kind, fp32_master=self._fp32_master,
                                       q8=self._share_q8, seed=self._seed, host=host)
        else:
            self._share.add([(s.group, s.p) for s in slots], self.param_groups, host=host)
        self._share.load(entries)
        gone = set(slots)
        if host:
            self._host_slots.extend(slots)
        for s in slots:
            s.moved = True
            del self._slot_of[s.p]
        if not self._leased and self.local_world <= 1:
            # aoqd lets their state go: the share holds it now.  Not with a
            # lease (a resume takes aoqd's state) nor in a replica group
            # (one state for every rank); an older aoqd keeps it (None).
            self._released += self._client.release_tensors([s.t for s in slots]) or 0
        self._slots = [s for s in self._slots if s not in gone]
        self._slot_by_addr = {}
