# SPDX-License-Identifier: MIT
"""A Pythonic session over libaoq.

Buffers are given as numpy arrays (C-contiguous; float32, float16, or uint16
holding bf16 bits with an explicit dtype) or as raw addresses (int) with an
explicit element count and dtype.  Raw addresses are device addresses for a
device session ("cuda:N") and host addresses for "cpu".
"""
import ctypes
import errno as _errno
from collections import namedtuple

from . import _lib
from ._lib import AoqError, check

DTYPES = {"fp32": _lib.FP32, "float32": _lib.FP32, "bf16": _lib.BF16, "bfloat16": _lib.BF16,
          "fp16": _lib.FP16, "float16": _lib.FP16}
PRECISIONS = {"fp32": _lib.STATE_FP32, "q8": _lib.STATE_Q8, "bf16": _lib.STATE_BF16,
              "bf16-q8": _lib.STATE_BF16_Q8, "bf16_q8": _lib.STATE_BF16_Q8,
              "bf16-all": _lib.STATE_BF16_ALL, "bf16_all": _lib.STATE_BF16_ALL, "q4": _lib.STATE_Q4,
              "bf16-q4": _lib.STATE_BF16_Q4, "bf16_q4": _lib.STATE_BF16_Q4}
KINDS = {"adamw": _lib.ADAMW, "adam": _lib.ADAM, "sgd": _lib.SGD, "lion": _lib.LION}
WHAT = {"master": _lib.MASTER, "param": _lib.MASTER, "exp_avg": _lib.EXP_AVG, "exp_avg_sq": _lib.EXP_AVG_SQ}
_SIZE = {_lib.FP32: 4, _lib.BF16: 2, _lib.FP16: 2}

StepResult = namedtuple("StepResult", "step grad_sumsq nonfinite skipped clip_scale tensors_updated")
Hyperparams = namedtuple("Hyperparams", "kind lr betas eps weight_decay momentum dampening nesterov",
                         defaults=(0.0, 0.0, False))


def _choice(table, value, what, codes=()):
    """table[value] for a name, or value itself when it is one of `codes`;
    a ValueError naming the value and the allowed ones otherwise (never a
    bare KeyError)."""
    if isinstance(value, int) and not isinstance(value, bool) and value in codes:
        return value
    if isinstance(value, str) and value.lower() in table:
        return table[value.lower()]
    raise ValueError("unknown %s %r; allowed: %s" % (what, value, ", ".join(repr(k) for k in table)))


def check_device(device):
    """A device string libaoq accepts: "cpu", "cuda[:N]", "xpu[:N]"."""
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind in ("cpu", "cuda", "xpu") and (idx == "" or (idx.isdigit() and kind != "cpu")):
            return device
    raise ValueError("unknown device %r; allowed: 'cpu', 'cuda', 'cuda:N', 'xpu', 'xpu:N'" % (device,))


def dtype_code(d):
    """aoq dtype code of a name ("fp32", "bf16", "fp16"), a code, a numpy
    dtype (float32/float16) or a torch dtype."""
    if isinstance(d, int) and not isinstance(d, bool):
        if d not in _SIZE:
            raise ValueError("unknown aoq dtype code %r; allowed: %s (fp32, bf16, fp16)" % (d, sorted(_SIZE)))
        return d
    s = str(d).replace("torch.", "").lower()
    if s in DTYPES:
        return DTYPES[s]
    raise ValueError("unsupported dtype %r; allowed: 'fp32', 'bf16', 'fp16' (or float32, bfloat16, float16)" % (d,))


def _np_dtype_code(a):
    import numpy as np
    if a.dtype == np.float32:
        return _lib.FP32
    if a.dtype == np.float16:
        return _lib.FP16
    return None  # uint16 (bf16 bits) needs an explicit dtype


def _addr(buf, what, writable=False):
    """(address, numel, dtype code or None, keepalive) of a buffer."""
    if buf is None:
        return None, None, None, None
    if isinstance(buf, int):
        return buf, None, None, None
    if hasattr(buf, "__array_interface__"):
        ai = buf.__array_interface__
        if not buf.flags["C_CONTIGUOUS"]:
            raise ValueError("%s: the array must be C-contiguous" % what)
        if writable and ai["data"][1]:
            raise ValueError("%s: the array must be writable" % what)
        return ai["data"][0], buf.size, _np_dtype_code(buf), buf
    raise TypeError("%s: expected a numpy array or an address (int), got %r" % (what, type(buf)))


class Client:
    """One daemon session (uid, job, rank).

    >>> c = Client(job="demo", device="cpu")
    >>> g = c.add_group(lr=1e-3, weight_decay=0.01)
    >>> t = c.add_tensor("w", w, grad=gw, group=g)   # numpy float32 arrays
    >>> c.register()
    >>> c.push_grad(t); c.step_end(); c.sync()        # w now holds the update
    """

    def __init__(self, socket=None, job="default", rank=0, device="cpu", precision="fp32", window=0,
                 seed=0, max_grad_norm=0.0, skip_nonfinite=False, delayed_update=False, cuda_stream=None,
                 timeout=None, lease=None, local_world=0, local_rank=0, master_bits=0):
        self._lib = _lib.load()
        self._h = None
        self._keep = []          # buffers libaoq points into
        self._groups = []
        self._tensors = []       # (name, numel, param_dtype, grad_dtype)
        self.registered = False
        o = self._lib.Options()
        check_device(device)
        self._strings = [s.encode() if s is not None else None for s in (socket, job, device)]
        o.socket, o.job, o.device = self._strings
        o.rank = rank
        o.precision = _choice(PRECISIONS, precision, "state precision", codes=set(PRECISIONS.values()))
        o.window = window
        o.seed = seed
        o.cuda_stream = cuda_stream
        o.max_grad_norm = float(max_grad_norm or 0.0)
        o.skip_nonfinite = bool(skip_nonfinite)
        o.delayed_update = bool(delayed_update)
        # Deadline of connect, each request and each wait, in seconds (None:
        # libaoq's default, 120 s; 0 or less: wait forever).
        o.timeout_ms = 0 if timeout is None else (0xFFFFFFFF if timeout <= 0 else max(1, min(int(timeout * 1000), 0xFFFFFFFE)))
        # Lease (README, "Lease and resume"): seconds aoqd keeps the state
        # after this process dies, for a trainer of the same job and rank to
        # resume; None: the daemon's lease_seconds; 0: none.
        o.lease_seconds = 0 if lease is None else (0xFFFFFFFF if lease <= 0 else min(int(lease), 0xFFFFFFFE))
        # Replica group (docs/python.md, "One state for data-parallel
        # replicas"): local_world >= 2 ranks of this job on this node share
        # one optimizer state; each pushes its slice of every gradient.
        o.local_world = int(local_world)
        o.local_rank = int(local_rank)
        # The bits of a split master (an fp32 master beside a bf16 parameter
        # with q8 or q4 moments): 0 or 32 all of them, 24 the 24-bit master
        # (kernels/README.md, "The 24-bit master").
        if master_bits not in (0, 24, 32):
            raise ValueError("master_bits must be 0 or 32 (an fp32 master) or 24 (the 24-bit master), got %r"
                             % (master_bits,))
        o.master_bits = master_bits
        self.device = device
        self.delayed_update = bool(delayed_update)
        h = ctypes.c_void_p()
        try:
            check(self._lib.aoq_connect(ctypes.byref(h), ctypes.byref(o)), "aoq_connect")
        except AoqError as e:
            if "cannot connect" not in str(e):
                raise
            raise AoqError(e.errno, "%s; or start a private aoqd from Python: d = aoq.Daemon(), then pass "
                           "socket=d.socket (it ends with this process)" % e.strerror) from None
        self._h = h

    # -- description -------------------------------------------------------
    def add_group(self, kind="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  momentum=0.0, dampening=0.0, nesterov=False):
        """kind: "adamw", "adam", "sgd" (momentum, dampening, nesterov,
        weight_decay as torch.optim.SGD's) or "lion" (betas, decoupled
        weight_decay).  SGD and Lion run in fp32, bf16 and bf16-all state."""
        hp = Hyperparams(kind, lr, tuple(betas), eps, weight_decay, momentum, dampening, bool(nesterov))
        g = self._group_struct(hp)
        r = check(self._lib.aoq_add_group(self._handle(), ctypes.byref(g)), "aoq_add_group")
        self._groups.append(hp)
        return r

    def add_tensor(self, name, param, grad=None, *, numel=None, param_dtype=None, grad_dtype=None, group=0,
                   init=None, init_dtype=None):
        """Describes a tensor; returns its index.  `param` (updates land in
        it; its value at register() is the initial master unless `init` is
        given), `grad` (optional; else give a buffer per push) and `init`
        (host memory) are numpy arrays or addresses."""
        pa, pn, pd, pk = _addr(param, "param", writable=True)
        ga, gn, gd, gk = _addr(grad, "grad")
        ia, inn, idt, ik = _addr(init, "init")
        numel = numel or pn
        if not numel:
            raise ValueError("tensor %r: numel unknown (give numel= with an address)" % name)
        for n, what in ((pn, "param"), (gn, "grad"), (inn, "init")):
            if n is not None and n != numel:
                raise ValueError("tensor %r: %s has %d elements, expected %d" % (name, what, n, numel))
        pdt = dtype_code(param_dtype) if param_dtype is not None else pd
        if pdt is None:
            pdt = _lib.FP32
        gdt = dtype_code(grad_dtype) if grad_dtype is not None else (gd if gd is not None else pdt)
        idt = dtype_code(init_dtype) if init_dtype is not None else (idt if idt is not None else _lib.FP32)
        bname = name.encode()
        t = _lib.Tensor(bname, numel, pdt, gdt, group, pa, ga, ia, idt)
        r = check(self._lib.aoq_add_tensor(self._handle(), ctypes.byref(t)), "aoq_add_tensor %s" % name)
        self._keep += [k for k in (pk, gk, ik) if k is not None]
        self._tensors.append((name, numel, pdt, gdt))
        return r

    def register(self):
        check(self._lib.aoq_register(self._handle()), "aoq_register")
        self.registered = True
        # init buffers are read at register(); param/grad stay referenced.

    @property
    def resumed(self):
        """After register(): the last completed step of the leased session
        this registration resumed (training goes on at that step + 1; the
        parameters were copied from aoqd), or None when it started afresh."""
        step = ctypes.c_uint64()
        return step.value if self._lib.aoq_resumed(self._handle(), ctypes.byref(step)) == 1 else None

    @property
    def seed(self):
        """The session's stochastic rounding seed (after register()): pass it
        as seed= when restoring a checkpoint so a bf16 master continues bit
        for bit."""
        return self._lib.aoq_session_seed(self._handle())

    # -- steps -------------------------------------------------------------
    @property
    def current_step(self):
        return self._lib.aoq_current_step(self._handle())

    def push_grad(self, t, grad=None, accumulate=False, stream=None):
        """Pushes tensor t's gradient: its registered grad buffer, or `grad`
        (a numpy array or an address).  accumulate=True: a non-final
        micro-batch (summed in fp32 by the daemon; the final push updates)."""
        flags = _lib.PUSH_ACCUMULATE if accumulate else 0
        if grad is None:
            r = self._lib.aoq_push_grad(self._handle(), t, flags, stream)
        else:
            a, n, d, _ = _addr(grad, "grad")
            if n is not None and n != self._tensors[t][1]:
                raise ValueError("tensor %d: gradient has %d elements, expected %d" % (t, n, self._tensors[t][1]))
            if d is not None and d != self._tensors[t][3]:
                raise ValueError("tensor %d: gradient dtype does not match the registered one" % t)
            r = self._lib.aoq_push_grad_ptr(self._handle(), t, a, flags, stream)
        check(r, "aoq_push_grad %d" % t)

    def grad_copied(self, t):
        """Blocks until tensor t's pushed gradients have been copied off the device."""
        check(self._lib.aoq_grad_copied(self._handle(), t), "aoq_grad_copied")

    def grad_pending(self, t):
        """How many of tensor t's gradient copies are still running (no blocking)."""
        r = self._lib.aoq_grad_pending(self._handle(), t)
        check(r, "aoq_grad_pending")
        return r

    def wait_param(self, t, stream=None):
        check(self._lib.aoq_wait_param(self._handle(), t, stream), "aoq_wait_param")

    def sync_param(self, t):
        check(self._lib.aoq_sync_param(self._handle(), t), "aoq_sync_param")

    @staticmethod
    def _group_struct(hp):
        return _lib.Group(_choice(KINDS, hp.kind, "optimizer kind", codes=set(KINDS.values())), hp.lr, hp.betas[0],
                          hp.betas[1], hp.eps, hp.weight_decay, hp.momentum, hp.dampening, bool(hp.nesterov))

    def set_hyperparams(self, g, kind=None, lr=None, betas=None, eps=None, weight_decay=None,
                        momentum=None, dampening=None, nesterov=None):
        """Changes group g from the next step on (call between step_end() and
        the next step's first push).  Unnamed values stay."""
        old = self._groups[g]
        hp = Hyperparams(old.kind if kind is None else kind, old.lr if lr is None else lr,
                         old.betas if betas is None else tuple(betas), old.eps if eps is None else eps,
                         old.weight_decay if weight_decay is None else weight_decay,
                         old.momentum if momentum is None else momentum,
                         old.dampening if dampening is None else dampening,
                         old.nesterov if nesterov is None else bool(nesterov))
        s = self._group_struct(hp)
        check(self._lib.aoq_set_hyperparams(self._handle(), g, ctypes.byref(s)), "aoq_set_hyperparams")
        self._groups[g] = hp

    def hyperparams(self, g):
        return self._groups[g]

    def step_end(self):
        check(self._lib.aoq_step_end(self._handle()), "aoq_step_end")

    def sync(self):
        """Host barrier: every pushed gradient's parameter has landed and
        every ended step is done.  Returns the last ended step's StepResult."""
        r = self._lib.StepResult()
        check(self._lib.aoq_sync(self._handle(), ctypes.byref(r)), "aoq_sync")
        return StepResult(r.step, r.grad_sumsq, bool(r.nonfinite), bool(r.skipped), r.clip_scale,
                          r.tensors_updated)

    def flush(self):
        """Delayed update: lands every pending updated parameter now."""
        check(self._lib.aoq_flush(self._handle()), "aoq_flush")

    # -- state -------------------------------------------------------------
    def read_state(self, t, what, dtype="fp32", offset=0, count=None, out=None):
        """State `what` (0/"master", 1/"exp_avg", 2/"exp_avg_sq") of tensor t
        as a numpy array (float32; uint16 bf16 bits for dtype "bf16")."""
        import numpy as np
        what = _choice(WHAT, what, "state", codes=set(WHAT.values()))
        dt = dtype_code(dtype)
        if count is None:
            count = self._tensors[t][1] - offset
        if out is None:
            out = np.empty(count, dtype={_lib.FP32: np.float32, _lib.FP16: np.float16, _lib.BF16: np.uint16}[dt])
        a, n, _, _ = _addr(out, "out", writable=True)
        if n is not None and n != count:
            raise ValueError("out has %d elements, expected %d" % (n, count))
        check(self._lib.aoq_read_state(self._handle(), t, what, dt, offset, count, a), "aoq_read_state")
        return out

    def load_state(self, t, what, data, dtype=None, offset=0):
        """Loads state `what` of tensor t from `data` (numpy array)."""
        what = _choice(WHAT, what, "state", codes=set(WHAT.values()))
        a, n, d, keep = _addr(data, "data")
        dt = dtype_code(dtype) if dtype is not None else d
        if dt is None:
            raise ValueError("load_state: give dtype= for this array")
        check(self._lib.aoq_load_state(self._handle(), t, what, dt, offset, n, a), "aoq_load_state")
        del keep

    def get_tensor_steps(self, first=0, n=None):
        if n is None:
            n = len(self._tensors) - first
        buf = (ctypes.c_uint64 * n)()
        check(self._lib.aoq_get_tensor_steps(self._handle(), first, n, buf), "aoq_get_tensor_steps")
        return list(buf)

    def set_tensor_steps(self, steps, first=0):
        steps = list(steps)
        buf = (ctypes.c_uint64 * len(steps))(*steps)
        check(self._lib.aoq_set_tensor_steps(self._handle(), first, len(steps), buf), "aoq_set_tensor_steps")

    def release_tensors(self, tensors):
        """Tensors whose state the caller keeps from now on (read it first):
        aoqd frees theirs (aoq_release_tensors).  Returns the bytes aoqd
        gave back, or None where this libaoq or aoqd cannot release (the
        state then stays in aoqd, unused)."""
        ts = sorted(set(int(t) for t in tensors))
        if not ts:
            return 0
        if not hasattr(self._lib, "aoq_release_tensors"):
            return None
        buf = (ctypes.c_uint32 * len(ts))(*ts)
        out = ctypes.c_uint64(0)
        r = self._lib.aoq_release_tensors(self._handle(), buf, len(ts), ctypes.byref(out))
        if r == -_errno.EOPNOTSUPP:
            return None
        check(r, "aoq_release_tensors")
        return out.value

    # -- lifetime ----------------------------------------------------------
    @property
    def ntensors(self):
        return len(self._tensors)

    def tensor_info(self, t):
        """(name, numel, param dtype code, grad dtype code) of tensor t."""
        return self._tensors[t]

    def _handle(self):
        if self._h is None:
            raise AoqError(9, "the aoq session is closed")
        return self._h

    def close(self):
        """Ends the session cleanly (Bye).  Idempotent."""
        if self._h is not None:
            self._lib.aoq_close(self._h)
            self._h = None
            self._keep = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
