# SPDX-License-Identifier: MIT
"""aoq.torch inside torch.compile'd code: the custom ops that compiled
graphs call for the per-module wait (aoq::wait_params) and the in-graph
gradient push (aoq::push_grad), and the registry through which they reach
their optimizer.  OffloadOptimizer (torch.py) puts them in the graph from
its global forward pre-hook while dynamo traces it."""
import itertools
import warnings

import torch


def _is_compiling():
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(f and f())


# Waits inside torch.compile'd code.  The global forward pre-hook is traced
# into compiled graphs; there it calls this op on the module's own
# parameters.  The op "mutates" them (to torch's eyes), so inductor keeps
# it before every kernel that reads them, and calls it in place, no copy;
# at run time it is the same per-module wait as in eager mode.  The int
# names the optimizer in _OPTIMIZERS (weak references).
_OPTIMIZERS = {}
_optimizer_ids = itertools.count(1)


def _next_optimizer_id():
    return next(_optimizer_ids)


def _wait_params_impl(params: "list[torch.Tensor]", originals: "list[torch.Tensor]", opt: int) -> None:
    ref = _OPTIMIZERS.get(opt)
    o = ref() if ref is not None else None
    if o is not None:
        o._wait_in_graph(params, originals)


def _wait_params_fake(params, originals, opt):
    return None


def _define_op(name, impl, fake, mutates, schema, lost):
    """torch.ops.aoq.<name>.default, defined with torch.library.custom_op, or
    None where torch cannot define it (lost: what compiled code does
    instead, for the warning)."""
    if hasattr(getattr(torch.ops, "aoq", None), name):
        return None          # this module imported twice (importlib.reload): the op calls the first copy
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None
    try:
        op = custom_op("aoq::" + name, impl, mutates_args=mutates, schema=schema)
        op.register_fake(fake)
    except Exception as e:   # noqa: BLE001 -- any failure only costs the in-graph op
        warnings.warn("aoq: cannot define the in-graph op aoq::%s (%s); %s" % (name, e, lost), RuntimeWarning)
        return None
    return getattr(torch.ops.aoq, name).default


_WAIT_OP = _define_op("wait_params", _wait_params_impl, _wait_params_fake, ("params",),
                      "(Tensor(a!)[] params, Tensor[] originals, int opt) -> ()",
                      "compiled modules wait for all their parameters before they run")


# Pushes inside torch.compile'd backward.  A compiled model's backward is
# one graph: the post-accumulate-grad hooks fire only after all of it, so
# the update of the first gradient would start at the end of backward.  In
# compiled code the global forward pre-hook hands the module a view of
# each parameter through _GraphTap (in the module's __dict__, which
# attribute lookup reads before _parameters; the forward hook removes it);
# the view's backward calls aoq::push_grad on the parameter's gradient as
# soon as the graph has computed it, and returns the gradient unchanged.
# The op "mutates" the gradient so that nothing removes or moves it.  The
# parameter is named by a 0-d int64 CPU tensor holding (optimizer id << 32)
# | aoq tensor id, which the pre-hook reads from the parameter's
# _aoq_tap<optimizer id> attribute while tracing: in the graph the parameter
# itself may be a copy (the in-graph wait's declared mutation,
# functionalized), so its address names nothing.  A tensor, not an int: an
# int would be a constant of the graph, so identical blocks compiled one by
# one (regional compilation) would each compile again and, past dynamo's
# recompile limit (8), run uncompiled.  A tensor is a graph input; at run time
# the op checks it is the very tensor the optimizer made (a parameter
# unpickled with its __dict__ carries a copy, whose gradients are not ours).
def _push_grad_impl(grad: torch.Tensor, tap: torch.Tensor) -> None:
    v = int(tap)
    ref = _OPTIMIZERS.get(v >> 32)
    o = ref() if ref is not None else None
    if o is not None:
        o._push_in_graph(grad, v & 0xFFFFFFFF, tap)


_PUSH_OP = _define_op("push_grad", _push_grad_impl, lambda grad, tap: None, ("grad",),
                      "(Tensor(a!) grad, Tensor tap) -> ()", "compiled models push their gradients after backward")


class _GraphTap(torch.autograd.Function):
    """A parameter's view whose backward pushes the parameter's gradient
    (aoq::push_grad) inside the compiled backward."""

    @staticmethod
    def forward(ctx, p, tap):
        ctx.save_for_backward(tap)
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        _PUSH_OP(g, ctx.saved_tensors[0])
        return g, None
