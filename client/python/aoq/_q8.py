# SPDX-License-Identifier: MIT
"""q8 moments on the device: the GPU share's state for aoqd's default
precision (fp32 master, q8 moments).  The format is aoqd's
(kernels/README.md, "q8 moments", format 2): blocks of 256 elements with an
fp32 scale each (the block's max |m|, max sqrt(v)); m a sign and a 7-bit
code, sqrt(v) an 8-bit code, each the top bits of the fp32 pattern of
x * TOP / scale + K; stochastic rounding in code space for the step,
nearest for loaded state.  An fp32 master and these moments take 6.03
bytes per parameter on the device, fp32 moments 12; with bf16 parameters
the master is split (the parameter its high half, 16 more bits beside it:
split_master), 4.03 bytes per parameter, about what torch's AdamW keeps
for the same parameters (two bf16 moments, 4).

_Q8Adam steps a list of (fp32 master, parameter) pairs with Adam/AdamW: on
CUDA through libaoq's aoq_device_adam_q8 (kernels/cuda, one kernel per
tensor); elsewhere, or where this libaoq has no CUDA, through step_torch,
the same arithmetic in torch operations (the tests' reference).  Both draw
the random bits from mix32(element index ^ key(seed, step)), the hash of
kernels/cuda/aoq-cuda-kernels.h."""
import ctypes
import errno
import math
import struct

import torch

from . import _lib
from ._dist import _local

BLOCK = 256
_M_MB, _U_MB = 4, 5                       # m: e3m4, sqrt(v): e3m5
M_SHIFT, U_SHIFT = 23 - _M_MB, 23 - _U_MB
M_C0 = (127 << _M_MB) + (1 << _M_MB) - 1 - 127
U_C0 = (127 << _U_MB) + (1 << _U_MB) - 1 - 255
_CHUNK = 1 << 20                          # torch path: elements per pass (a multiple of BLOCK)
_LOAD_PIECE = 1 << 24                     # set_moments: elements per piece (a multiple of BLOCK)
# The host share's grid (blocks of 256 threads): its kernel waits on PCIe,
# and at 32 blocks an H100's bf16 matmuls beside it kept 0.99 of their
# speed while it stepped 6 G parameters/s (64: 8.4 G/s, matmuls 0.80; no
# cap: 9.9 G/s, 0.57; tests/bench/RESULTS.md, "The host share")
HOST_BLOCKS = 32


def _u2f(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


M_K, U_K = _u2f(M_C0 << M_SHIFT), _u2f(U_C0 << U_SHIFT)
M_TOP = _f32(_u2f((M_C0 + 127) << M_SHIFT) - M_K)
U_TOP = _f32(_u2f((U_C0 + 255) << U_SHIFT) - U_K)
_FLT_MAX = 3.4028234663852886e38
_MASK = 0xFFFFFFFF


def mix32(x):
    """Wellons' lowbias32 of a Python int (the C header's aoq_cuda_mix32)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    x ^= x >> 16
    return x


def q8_key(seed, step):
    return mix32((seed & _MASK) ^ mix32(((seed >> 32) & _MASK) ^ mix32(step & _MASK)))


def _mul32(x, c):
    """(x * c) mod 2^32 of an int64 tensor x < 2^32, in two halves of c so
    that no product leaves int64."""
    lo = (x * (c & 0xFFFF)) & _MASK
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK


def _mix32_t(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(begin, n, key, device):
    """The 32 random bits of elements begin..begin+n-1 (int64 tensor)."""
    i = torch.arange(begin, begin + n, dtype=torch.int64, device=device) & _MASK
    return _mix32_t(i ^ key)


def blocks(n):
    return (n + BLOCK - 1) // BLOCK


def _as_blocks(x, nb):
    """x (1-D, at most nb * BLOCK elements) as [nb, BLOCK], zero-padded."""
    pad = nb * BLOCK - x.numel()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(nb, BLOCK)


def _inv(top, s):
    """TOP / the block's scale, 0 for an empty block, FLT_MAX where it
    overflows (aoqk_q8_inv)."""
    q = torch.clamp(top / s, max=_FLT_MAX)
    return torch.where(s > 0, q, torch.zeros_like(q))


def decode(mc, vc, ms, vs):
    """m and sqrt(v) (fp32, [nb, BLOCK]) of codes [nb, BLOCK] (uint8) with
    scales [nb]."""
    c = (mc.to(torch.int32) & 0x7F) + M_C0
    y = (c << M_SHIFT).view(torch.float32) - M_K
    m = y * (ms / M_TOP).unsqueeze(1)
    m = torch.where((mc & 0x80) != 0, -m, m)
    y = ((vc.to(torch.int32) + U_C0) << U_SHIFT).view(torch.float32) - U_K
    u = y * (vs / U_TOP).unsqueeze(1)
    return m, u


def encode(m, u, bits=None):
    """Codes and scales of m and u = sqrt(v) ([nb, BLOCK] fp32): (m codes,
    v codes, m scales, v scales).  bits (int64 [nb, BLOCK]): stochastic
    rounding with its low 16 bits (0..7: v, 8..15: m); None: nearest."""
    ms = m.abs().amax(dim=1)
    vs = u.amax(dim=1)
    if bits is None:
        rm, ru = 1 << (M_SHIFT - 1), 1 << (U_SHIFT - 1)
    else:
        rm = (((bits >> 8) & 0xFF) << (M_SHIFT - 8) | 1 << (M_SHIFT - 9)).to(torch.int32)
        ru = ((bits & 0xFF) << (U_SHIFT - 8) | 1 << (U_SHIFT - 9)).to(torch.int32)
    x = m.abs() * _inv(M_TOP, ms).unsqueeze(1) + M_K
    c = torch.clamp(((x.view(torch.int32) + rm) >> M_SHIFT) - M_C0, max=127)
    mc = (c | torch.signbit(m).to(torch.int32) << 7).to(torch.uint8)
    y = u * _inv(U_TOP, vs).unsqueeze(1) + U_K
    q = torch.clamp(((y.view(torch.int32) + ru) >> U_SHIFT) - U_C0, max=255)
    q = torch.where((q == 0) & (u > 0), torch.ones_like(q), q)
    return mc, q.to(torch.uint8), ms, vs


class _Consts:
    """One step's constants, as aoqd's kernels compute them (float32 values
    of the same double expressions)."""

    def __init__(self, lr, beta1, beta2, eps, wd, decoupled, step, seed, gscale=1.0):
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        self.w1 = _f32(1.0 - beta1)
        self.w1c = _f32(1.0 - self.w1)
        self.b2, self.w2 = _f32(beta2), _f32(1.0 - beta2)
        self.nstep = _f32(-(lr / bc1))
        self.inv_bc2s = _f32(1.0 / math.sqrt(bc2))
        self.eps = _f32(eps)
        self.decay = _f32(1.0 - lr * wd)
        self.wd = _f32(wd)
        self.gscale = _f32(gscale)
        self.adamw = decoupled and wd != 0.0
        self.l2 = not decoupled and wd != 0.0
        self.key = q8_key(seed, step)


def _to16(x):
    """int64 values in [0, 2^16) as int16 bits."""
    return (x - ((x >= 0x8000).to(torch.int64) << 16)).to(torch.int16)


def join_master(pb, lo):
    """fp32 masters from bf16 parameters and their low halves (int16 bits),
    as kernels/cuda's join_master: the high half is the parameter, less one
    where the low half is above one half (the rounding went up)."""
    p = pb.view(torch.int16).to(torch.int64) & 0xFFFF
    low = lo.to(torch.int64) & 0xFFFF
    b = ((p - (low > 0x8000).to(torch.int64)) << 16 | low) & _MASK
    return (b - ((b >= 1 << 31).to(torch.int64) << 32)).to(torch.int32).view(torch.float32)


def split_master(w):
    """(bf16 parameters, int16 low halves) of fp32 masters w, as
    kernels/cuda's split_master: the parameter is w rounded to nearest even
    (NaN: a quiet NaN); a w whose low half is exactly 0x8000 moves one ulp
    toward the side its rounding takes, so the pair is unambiguous."""
    b = w.contiguous().view(torch.int32).to(torch.int64) & _MASK
    odd = (b >> 16) & 1
    b = torch.where((b & 0xFFFF) == 0x8000, torch.where(odd == 1, b + 1, b - 1), b)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    pb = torch.where(nan, (b >> 16) | 0x40, (b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return _to16(pb).view(torch.bfloat16), _to16(b & 0xFFFF)


def param24(w):
    """The bf16 parameter aoqd keeps for fp32 masters w loaded into the
    24-bit master (daemon/convert.c aoqd_master_split, kernels/aoq-kernel.h
    aoqk_split8): w rounded to 24 bits to nearest even, then to bf16 half
    away from zero (NaN: a quiet NaN)."""
    b = w.contiguous().view(torch.int32).to(torch.int64) & _MASK
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    r = ((b + 0x7F + ((b >> 8) & 1)) & 0xFFFFFF00) & _MASK
    pb = torch.where(nan, (b >> 16) | 0x40, ((r + 0x8000) & _MASK) >> 16) & 0xFFFF
    return _to16(pb).view(torch.bfloat16)


def step_torch(param, grad, master, mc, vc, ms, vs, k, lo=None):
    """One step of a flat tensor in torch operations (k: _Consts).  param
    may be master itself (an fp32 parameter); master None: the master is
    split, lo its low halves beside bf16 parameters (split_master)."""
    n = param.numel()
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        nb = blocks(b - a)
        bl = slice(a // BLOCK, a // BLOCK + nb)
        g = _as_blocks(grad[a:b].to(torch.float32), nb)
        if k.gscale != 1.0:
            g = g * k.gscale
        w = _as_blocks(master[a:b] if lo is None else join_master(param[a:b], lo[a:b]), nb).clone()
        if k.l2:
            g = g + k.wd * w
        if k.adamw:
            w = w * k.decay
        m, u = decode(_as_blocks(mc[a:b], nb), _as_blocks(vc[a:b], nb), ms[bl], vs[bl])
        d = g - m
        m = m + k.w1 * d if abs(k.w1) < 0.5 else g - d * k.w1c
        v = u * u * k.b2 + k.w2 * (g * g)
        u = torch.sqrt(v)
        w = w + k.nstep * (m / (u * k.inv_bc2s + k.eps))
        w = w.view(-1)[: b - a]
        if lo is not None:
            hi, low = split_master(w)
            param[a:b].copy_(hi)
            lo[a:b].copy_(low)
        else:
            master[a:b].copy_(w)
            if param is not master:
                param[a:b].copy_(w)
        cm, cv, sm, sv = encode(m, u, random_bits(a, nb * BLOCK, k.key, param.device).view(nb, BLOCK))
        mc[a:b].copy_(cm.view(-1)[: b - a])
        vc[a:b].copy_(cv.view(-1)[: b - a])
        ms[bl].copy_(sm)
        vs[bl].copy_(sv)


def state_from(m, v):
    """(m codes, v codes, m scales, v scales) of fp32 moments (any shape):
    nearest codes, as aoqd encodes loaded state."""
    n = m.numel()
    nb = blocks(n)
    u = torch.sqrt(torch.clamp(v.reshape(-1).to(torch.float32), min=0))
    mc, vc, ms, vs = encode(_as_blocks(m.reshape(-1).to(torch.float32), nb), _as_blocks(u, nb))
    return mc.view(-1)[:n].clone(), vc.view(-1)[:n].clone(), ms, vs


def state_to(mc, vc, ms, vs):
    """fp32 m and v (flat) of the codes."""
    n = mc.numel()
    nb = blocks(n)
    m, u = decode(_as_blocks(mc, nb), _as_blocks(vc, nb), ms, vs)
    return m.reshape(-1)[:n].clone(), (u * u).reshape(-1)[:n].clone()


_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _device_step(lib, param, grad, master, mc, vc, ms, vs, hp, lo=None, max_blocks=0):
    """One step through libaoq's aoq_device_adam_q8 on the current stream
    (master None: split, lo its low halves; max_blocks: the grid's cap);
    True, or AoqError where it fails (ENOTSUP: a libaoq without CUDA)."""
    s = _lib.DeviceStep(param.device.index or 0, param.data_ptr(), _DTYPE[param.dtype], grad.data_ptr(),
                        _DTYPE[grad.dtype], None if master is None else master.data_ptr(),
                        None if lo is None else lo.data_ptr(), mc.data_ptr(), vc.data_ptr(), ms.data_ptr(),
                        vs.data_ptr(), param.numel(), *hp, max_blocks)
    stream = torch.cuda.current_stream(param.device).cuda_stream
    _lib.check(lib.aoq_device_adam_q8(ctypes.byref(s), ctypes.c_void_p(stream)), "aoq_device_adam_q8")
    return True


def has_kernel():
    """True when this libaoq steps on CUDA (aoq_device_adam_q8): a struct
    too small for its size field, which the CUDA entry refuses with EINVAL
    and a libaoq without CUDA with ENOTSUP; nothing is launched."""
    try:
        lib = _lib.load()
    except OSError:
        return False
    s = _lib.DeviceStep()
    s.size = 8
    return lib.aoq_device_adam_q8(ctypes.byref(s), None) == -errno.EINVAL


class _Q8Adam(torch.optim.Optimizer):
    """Adam/AdamW on fp32 masters with q8 moments (aoqd's format), for the GPU
    share.  params: what it steps, each t one of: an fp32 parameter (its own
    master), an fp32 master of another parameter (param_of[t], whose .grad
    it reads and which it writes), or a bf16 parameter whose fp32 master is
    split (the parameter its high half, state["master_lo"] its low 16 bits:
    2 bytes per parameter instead of 4); seed_of: t -> its random key's
    seed.  state[t]: "step" (a float tensor, as torch's), the codes and
    scales ("m_codes", "v_codes", "m_scale", "v_scale"), "master_lo";
    moments()/set_moments() decode and encode them.  The tensors in host
    (a set) keep that state in pinned host memory, which libaoq's kernel
    reads and writes over PCIe (the host share: no device memory; a libaoq
    with CUDA, has_kernel); beside a CPU parameter it is plain host memory,
    stepped as any."""

    def __init__(self, params, param_of, seed_of, decoupled, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, **_):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.param_of = param_of
        self.seed_of = seed_of
        self.decoupled = decoupled
        self.host = set()
        self.use_kernel = None      # None: try libaoq's kernel on CUDA at the first step

    @staticmethod
    def split(t):
        """t's master is split (a bf16 parameter stepped as itself)."""
        return t.dtype == torch.bfloat16

    def _zeros(self, t, n, dtype):
        if t in self.host and t.is_cuda:
            return torch.zeros(n, dtype=dtype, pin_memory=True)
        return torch.zeros(n, dtype=dtype, device=t.device)

    def _init_state(self, t):
        n = t.numel()
        st = self.state[t]
        st["step"] = torch.tensor(0.0)
        if self.split(t):
            # the parameter as it is: its master's low half zero
            st["master_lo"] = self._zeros(t, n, torch.int16)
        st["m_codes"] = self._zeros(t, n, torch.uint8)
        st["v_codes"] = self._zeros(t, n, torch.uint8)
        st["m_scale"] = self._zeros(t, blocks(n), torch.float32)
        st["v_scale"] = self._zeros(t, blocks(n), torch.float32)
        return st

    def moments(self, t):
        st = self.state.get(t)
        if not st:
            return None
        dev = t.device
        m, v = state_to(*(st[k].to(dev) for k in ("m_codes", "v_codes", "m_scale", "v_scale")))
        d = {"step": st["step"].clone(), "exp_avg": m.view(t.shape), "exp_avg_sq": v.view(t.shape)}
        if self.split(t):
            d["master"] = join_master(_local(t.detach()).reshape(-1), st["master_lo"].to(dev)).view(t.shape)
        return d

    def set_moments(self, t, d, master=None):
        """Loads "step", "exp_avg" and "exp_avg_sq" of d (to the nearest
        codes) and, for a split master, master (an fp32 tensor; without it
        the parameter as it is).  In pieces of _LOAD_PIECE elements (whole
        blocks, so the codes are the whole tensor's): a split and an encode
        take several int64 and fp32 copies of what they convert, which for
        a 134 M-element embedding were gigabytes of device memory."""
        st = self._init_state(t)
        if d.get("step") is not None:
            st["step"] = torch.tensor(float(d["step"]))
        split = master is not None and self.split(t)
        both = d.get("exp_avg") is not None and d.get("exp_avg_sq") is not None
        if not split and not both:
            return
        n = t.numel()
        w = master.reshape(-1) if split else None
        m = _local(d["exp_avg"]).reshape(-1) if both else None
        v = _local(d["exp_avg_sq"]).reshape(-1) if both else None
        tv = _local(t.data).view(-1)
        for a in range(0, n, _LOAD_PIECE):
            b = min(n, a + _LOAD_PIECE)
            if split:
                hi, low = split_master(w[a:b].to(device=t.device, dtype=torch.float32))
                with torch.no_grad():
                    tv[a:b].copy_(hi)
                st["master_lo"][a:b].copy_(low)
            if both:
                mc, vc, ms, vs = state_from(m[a:b].to(t.device), v[a:b].to(t.device))
                st["m_codes"][a:b].copy_(mc)
                st["v_codes"][a:b].copy_(vc)
                st["m_scale"][a // BLOCK:blocks(b)].copy_(ms)
                st["v_scale"][a // BLOCK:blocks(b)].copy_(vs)

    @torch.no_grad()
    def step(self, closure=None, skip=()):
        """Steps every tensor with a gradient but those in skip (a set: the
        host share's, stepped early, _share._DeviceShare.step_early)."""
        for g in self.param_groups:
            for t in g["params"]:
                if t not in skip:
                    self.step_tensor(t, g)

    @torch.no_grad()
    def step_tensor(self, t, g):
        """One tensor's step with its group g's hyperparameters, on the
        current stream."""
        b1, b2 = g["betas"]
        p = self.param_of[t]
        grad = p.grad
        if grad is None:
            return
        grad = _local(grad).contiguous().view(-1)
        st = self.state.get(t) or self._init_state(t)
        st["step"] += 1
        step = int(st["step"].item())
        pv = _local(p.data)
        pl = pv.view(-1) if pv.is_contiguous() else pv.reshape(-1).clone()
        split = self.split(t)
        lo = st["master_lo"] if split else None
        master = None if split else pl if p is t else t.view(-1)
        args = (pl, grad, master, st["m_codes"], st["v_codes"], st["m_scale"], st["v_scale"])
        hp = (g["lr"], b1, b2, g["eps"], g["weight_decay"], self.decoupled, step, self.seed_of[t], 1.0)
        if t in self.host and pl.is_cuda:   # pinned state: the kernel only (_host_share_ok checked it)
            _device_step(_lib.load(), *args, hp, lo=lo, max_blocks=HOST_BLOCKS)
        elif not self._kernel_step(args, hp, lo):
            step_torch(*args, _Consts(*hp), lo=lo)
        if pl.data_ptr() != pv.data_ptr():
            pv.copy_(pl.view(pv.shape))

    def _kernel_step(self, args, hp, lo):
        if self.use_kernel is False or args[0].device.type != "cuda":
            return False
        try:
            self.use_kernel = _device_step(_lib.load(), *args, hp, lo=lo)
        except _lib.AoqError as e:
            if e.errno != errno.ENOTSUP:    # a libaoq without CUDA; anything else is a failure
                raise
            self.use_kernel = False
        return self.use_kernel
