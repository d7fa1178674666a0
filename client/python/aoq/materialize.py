# SPDX-License-Identifier: MIT
"""aoq.materialize: a model onto its device one module at a time.

    with torch.device("meta"):
        model = GPT(cfg)                       # no memory anywhere
    materialize(model, "cuda", dtype=torch.bfloat16)   # reset_parameters() per module
    opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)

Each module's own parameters and buffers are moved (a meta tensor: made
empty on the device, then initialised by `init(module)` there, in the dtype
the model was built in), and only then are its floating parameters converted
to `dtype`, so that the device holds the converted model so far plus one
module's tensors in their built dtype, never the whole model at that dtype;
a model built on the CPU loses each tensor's host storage as it moves (when
nothing else holds it).  The principle is torchao's (PR 699): move each
parameter, then convert.  Registration (OffloadOptimizer) then loads each
parameter into aoqd through the arena's transfer area, a piece at a time:
the trainer's host peak is one module's tensors, aoqd's is its state.
"""
import warnings

import torch

__all__ = ["materialize"]


def _reset(module):
    """The default init: the module's own reset_parameters(), if it has one."""
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        fn()
    elif any(True for _ in module.parameters(recurse=False)):
        warnings.warn("aoq.materialize: %s has no reset_parameters(): its parameters are left uninitialised; "
                      "pass init= (a function of the module)" % type(module).__name__, stacklevel=3)


def _moved(t, device):
    if t.is_meta:
        return torch.empty_like(t, device=device)
    return t.detach().to(device)


def materialize(module, device, dtype=None, init=None):
    """Moves module's parameters and buffers to `device` one module at a time
    and returns module.

    device  where the tensors go ("cuda", "cuda:1", "cpu", a torch.device)
    dtype   the floating parameters' dtype once on the device (None: as
            built); buffers keep theirs
    init    init(module), called with torch.no_grad() for each module that
            had a meta tensor, once its own tensors are on the device (in the
            dtype built) and before they are converted; None: the module's
            reset_parameters() if it has one.  A meta tensor that init leaves
            alone holds whatever the allocator gave it.

    A parameter shared by several modules (tied weights) moves once and
    stays shared; parameters become new torch.nn.Parameter objects, so
    build the optimizer afterwards.  requires_grad is kept."""
    device = torch.device(device)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError("materialize: dtype must be a floating dtype, got %s" % (dtype,))
    init = _reset if init is None else init
    done = {}   # id(old parameter) -> new parameter (tied weights)
    for mod in module.modules():
        params = [(n, p) for n, p in mod._parameters.items() if p is not None]
        bufs = [(n, b) for n, b in mod._buffers.items() if b is not None]
        if not params and not bufs:
            continue
        meta = any(t.is_meta for _, t in params + bufs if id(t) not in done)
        fresh = []
        for n, p in params:
            if id(p) in done:
                mod._parameters[n] = done[id(p)]
                continue
            q = torch.nn.Parameter(_moved(p, device), requires_grad=p.requires_grad)
            mod._parameters[n] = q
            done[id(p)] = q
            fresh.append((n, q, id(p)))
        for n, b in bufs:
            mod._buffers[n] = _moved(b, device)
        if meta:
            with torch.no_grad():
                init(mod)
        if dtype is None:
            continue
        for n, _, old in fresh:
            q = mod._parameters[n]
            if q is not None and q.is_floating_point() and q.dtype != dtype:
                r = torch.nn.Parameter(q.detach().to(dtype), requires_grad=q.requires_grad)
                mod._parameters[n] = r
                done[old] = r
        del fresh
    return module
