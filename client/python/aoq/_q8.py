# SPDX-License-Identifier: MIT
"""q8 moments on the device: the GPU share's state for aoqd's default
precision (fp32 master, q8 moments).  The format is aoqd's
(kernels/README.md, "q8 moments", format 2): blocks of 256 elements with an
fp32 scale each (the block's max |m|, max sqrt(v)); m a sign and a 7-bit
code, sqrt(v) an 8-bit code, each the top bits of the fp32 pattern of
x * TOP / scale + K; stochastic rounding in code space for the step,
nearest for loaded state.  An fp32 master and these moments take 6.03
bytes per parameter on the device, fp32 moments 12.

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

from ._dist import _local

BLOCK = 256
_M_MB, _U_MB = 4, 5                       # m: e3m4, sqrt(v): e3m5
M_SHIFT, U_SHIFT = 23 - _M_MB, 23 - _U_MB
M_C0 = (127 << _M_MB) + (1 << _M_MB) - 1 - 127
U_C0 = (127 << _U_MB) + (1 << _U_MB) - 1 - 255
_CHUNK = 1 << 20                          # torch path: elements per pass (a multiple of BLOCK)


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


def step_torch(param, grad, master, mc, vc, ms, vs, k):
    """One step of a flat tensor in torch operations (k: _Consts).  param
    may be master itself (an fp32 parameter)."""
    n = master.numel()
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        nb = blocks(b - a)
        bl = slice(a // BLOCK, a // BLOCK + nb)
        g = _as_blocks(grad[a:b].to(torch.float32), nb)
        if k.gscale != 1.0:
            g = g * k.gscale
        w = _as_blocks(master[a:b], nb).clone()
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
        master[a:b].copy_(w)
        if param is not master:
            param[a:b].copy_(w)
        cm, cv, sm, sv = encode(m, u, random_bits(a, nb * BLOCK, k.key, master.device).view(nb, BLOCK))
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


def _device_step(lib, param, grad, master, mc, vc, ms, vs, hp):
    """One step through libaoq's aoq_device_adam_q8 on the current stream;
    False where it cannot run here (no such function, no CUDA in it)."""
    from . import _lib
    s = _lib.DeviceStep(master.device.index or 0, param.data_ptr(), _DTYPE[param.dtype], grad.data_ptr(),
                        _DTYPE[grad.dtype], master.data_ptr(), mc.data_ptr(), vc.data_ptr(), ms.data_ptr(),
                        vs.data_ptr(), master.numel(), *hp)
    stream = torch.cuda.current_stream(master.device).cuda_stream
    r = lib.aoq_device_adam_q8(ctypes.byref(s), ctypes.c_void_p(stream))
    if r == 0:
        return True
    _lib.check(r, "aoq_device_adam_q8")
    return False


class _Q8Adam(torch.optim.Optimizer):
    """Adam/AdamW on fp32 masters with q8 moments (aoqd's format), for the GPU
    share.  params: the masters; param_of: master -> the parameter it steps
    (whose .grad it reads and which it writes); seed_of: master -> its
    random key's seed.  state[master]: "step" (a float tensor, as torch's),
    and the codes and scales ("m_codes", "v_codes", "m_scale", "v_scale");
    moments()/set_moments() decode and encode them."""

    def __init__(self, params, param_of, seed_of, decoupled, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, **_):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.param_of = param_of
        self.seed_of = seed_of
        self.decoupled = decoupled
        self.use_kernel = None      # None: try libaoq's kernel on CUDA at the first step

    def _init_state(self, t):
        n = t.numel()
        st = self.state[t]
        st["step"] = torch.tensor(0.0)
        st["m_codes"] = torch.zeros(n, dtype=torch.uint8, device=t.device)
        st["v_codes"] = torch.zeros(n, dtype=torch.uint8, device=t.device)
        st["m_scale"] = torch.zeros(blocks(n), dtype=torch.float32, device=t.device)
        st["v_scale"] = torch.zeros(blocks(n), dtype=torch.float32, device=t.device)
        return st

    def moments(self, t):
        st = self.state.get(t)
        if not st:
            return None
        m, v = state_to(st["m_codes"], st["v_codes"], st["m_scale"], st["v_scale"])
        return {"step": st["step"].clone(), "exp_avg": m.view(t.shape), "exp_avg_sq": v.view(t.shape)}

    def set_moments(self, t, d):
        st = self._init_state(t)
        if torch.is_tensor(d.get("step")) or d.get("step") is not None:
            st["step"] = torch.tensor(float(d["step"]))
        if d.get("exp_avg") is not None and d.get("exp_avg_sq") is not None:
            mc, vc, ms, vs = state_from(d["exp_avg"].to(t.device), d["exp_avg_sq"].to(t.device))
            st["m_codes"], st["v_codes"], st["m_scale"], st["v_scale"] = mc, vc, ms, vs

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for t in g["params"]:
                p = self.param_of[t]
                grad = p.grad
                if grad is None:
                    continue
                grad = _local(grad).contiguous().view(-1)
                st = self.state.get(t) or self._init_state(t)
                st["step"] += 1
                step = int(st["step"].item())
                pv = t if p is t else _local(p.data)
                pl = pv.view(-1) if pv.is_contiguous() else torch.empty(pv.numel(), dtype=pv.dtype, device=pv.device)
                args = (pl, grad, t.view(-1), st["m_codes"], st["v_codes"], st["m_scale"], st["v_scale"])
                if not self._kernel_step(args, (g["lr"], b1, b2, g["eps"], g["weight_decay"], self.decoupled,
                                                step, self.seed_of[t], 1.0)):
                    step_torch(*args, _Consts(g["lr"], b1, b2, g["eps"], g["weight_decay"], self.decoupled, step,
                                              self.seed_of[t]))
                if pl is not pv and pl.data_ptr() != pv.data_ptr():
                    pv.copy_(pl.view(pv.shape))

    def _kernel_step(self, args, hp):
        if self.use_kernel is False or args[2].device.type != "cuda":
            return False
        from . import _lib
        try:
            ok = _device_step(_lib.load(), *args, hp)
        except _lib.AoqError as e:
            if e.errno != errno.ENOTSUP:    # a libaoq without CUDA; anything else is a failure
                raise
            ok = False
        self.use_kernel = ok
        return ok
