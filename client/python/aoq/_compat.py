# SPDX-License-Identifier: MIT
"""Where frameworks look at aoq.torch's optimizer as at torch's own: a
wrapper that forwards attributes (Lightning's LightningOptimizer, a subclass
built from the optimizer's class) acts on the optimizer it wraps and never
closes it; aoq's keywords checked with a did-you-mean before
optimizer_class sees the rest; opt.state[p], read from aoqd on access; a
warning when torch's clipping finds no gradients because offload_gradients
sent them to aoqd; at interpreter exit, every live optimizer's updates
landed in the parameters.  routed() applies them to OffloadOptimizer."""
import atexit
import collections
import difflib
import functools
import inspect
import warnings
import weakref

import torch

# OffloadOptimizer's methods that act on the optimizer itself: called
# through a wrapper, they run on the wrapped optimizer (its attributes, not
# the wrapper's copy or shadow of them).
_ROUTED = ("step", "zero_grad", "synchronize", "flush", "close", "attach", "state_dict", "load_state_dict",
           "add_param_group")


def _owner(obj):
    """The OffloadOptimizer obj is or wraps: the one whose constructor ran
    (its weak reference to itself, reached through any forwarding)."""
    try:
        ref = obj.__dict__.get("_aoq_self")
        if ref is None:
            ref = getattr(obj, "_aoq_self", None)
    except Exception:
        ref = None
    o = ref() if ref is not None else None
    return o if o is not None else obj


def _is_owner(obj):
    """obj ran OffloadOptimizer's constructor itself (a wrapper's __dict__,
    copied or not, never holds a reference to the wrapper)."""
    ref = obj.__dict__.get("_aoq_self")
    if ref is None:
        return False
    o = ref()
    return o is None or o is obj      # None: obj itself is being collected (a cycle: references cleared first)


def _keywords(fn):
    """(names fn takes as keywords, whether it takes **kwargs)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    names = {n for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}
    return names, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def check_keywords(init, optimizer_class, kwargs):
    """TypeError for a keyword that neither OffloadOptimizer (init) nor
    optimizer_class takes, naming the closest of either's keywords."""
    ours, _ = _keywords(init)
    theirs, any_kw = _keywords(optimizer_class.__init__)
    if any_kw:
        return
    for k in kwargs:
        if k in theirs:
            continue
        close = difflib.get_close_matches(k, sorted(ours | theirs - {"params"}), n=1, cutoff=0.6)
        raise TypeError("OffloadOptimizer got an unexpected keyword argument %r%s (aoq's keywords: %s; %s's: %s)"
                        % (k, "; did you mean %r?" % close[0] if close else "", ", ".join(sorted(ours - {"params"})),
                           optimizer_class.__name__, ", ".join(sorted(theirs - {"params"}))))


def routed(cls):
    """cls (OffloadOptimizer) with its constructor checking keywords first
    and leaving a weak reference to the optimizer in it, its _ROUTED
    methods acting on the optimizer a wrapper wraps, and __del__ closing
    only the optimizer itself."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, params, optimizer_class=torch.optim.AdamW, **kwargs):
        if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
            check_keywords(init, optimizer_class, {k: v for k, v in kwargs.items()
                                                   if k not in _keywords(init)[0]})
        self.__dict__["_aoq_self"] = weakref.ref(self)
        init(self, params, optimizer_class, **kwargs)
        _LIVE.add(self)
        if getattr(self, "_slots", None) or getattr(self, "_fallback", None) is not None:
            self.state = _StateView(self, self.state)
        if getattr(self, "offload_gradients", False) and getattr(self, "_slots", None):
            _watch_clips(self)
    cls.__init__ = __init__

    for name in _ROUTED:
        fn = getattr(cls, name)

        def make(fn):
            @functools.wraps(fn)
            def method(self, *args, **kwargs):
                return fn(_owner(self), *args, **kwargs)
            return method
        setattr(cls, name, make(fn))

    dele = cls.__del__

    # is_owner bound here: at interpreter exit the module's globals may be
    # None before the last optimizer is collected
    def __del__(self, is_owner=_is_owner):
        try:
            owner = is_owner(self)
        except Exception:
            return
        if owner:
            dele(self)
    cls.__del__ = __del__
    return cls


class _StateView(collections.defaultdict):
    """opt.state: torch's {param: {key: value}}.  An offloaded parameter's
    entry is read from aoqd on every access (a host barrier first, then
    "step", the moments and "master" as fp32 CPU tensors: a copy, so writing
    into it changes nothing in aoqd; load_state_dict() does).  Assigning
    opt.state[p] for an offloaded parameter raises.  Parameters stepped on
    the device (smaller than minimal_size, the GPU share, host copies of a
    class aoqd does not run) give optimizer_class's own live state, as
    torch's optimizers do."""

    def __init__(self, opt, old):
        super().__init__(dict)
        self._opt = weakref.ref(opt)
        for p, st in old.items():
            dict.__setitem__(self, p, st)

    def _live(self, p):
        """(True, the state) for p, or (False, None) when p is neither
        offloaded nor stepped by a device or host optimizer of opt."""
        opt = self._opt()
        if opt is None:
            return False, None
        s = opt._slot_of.get(p) if getattr(opt, "_slot_of", None) else None
        if s is not None and opt._client is not None:
            return True, opt._slot_state(s)
        fb = getattr(opt, "_fallback", None)
        if fb is not None and p in fb.host:
            return True, fb.opt.state[fb.host[p]]
        dev = getattr(opt, "_dev_opt", None)
        if dev is not None and p in dev.state:
            return True, dev.state[p]
        share = getattr(opt, "_share", None)
        if share is not None and p in share.params:
            st = share.live_state(p)
            if st:
                return True, st
        return False, None

    def __getitem__(self, p):
        ok, st = self._live(p)
        return st if ok else super().__getitem__(p)

    def get(self, p, default=None):
        ok, st = self._live(p)
        return st if ok else dict.get(self, p, default)

    def __setitem__(self, p, value):
        opt = self._opt()
        if opt is not None and p in (getattr(opt, "_slot_of", None) or {}):
            raise TypeError("aoq: the state of an offloaded parameter lives in aoqd; opt.state[p] is read from it. "
                            "Change it with opt.load_state_dict()")
        dict.__setitem__(self, p, value)

    def _keys(self):
        keys = list(dict.keys(self))
        opt = self._opt()
        seen = set(keys)
        dev, share = getattr(opt, "_dev_opt", None), getattr(opt, "_share", None)
        # the share's state is held by its masters' keys: its parameters
        for ps in (dev.state if dev is not None else (), share.params if share is not None else ()):
            for p in ps:
                if p not in seen and self._live(p)[0]:
                    keys.append(p)
                    seen.add(p)
        fb = getattr(opt, "_fallback", None)
        if fb is not None:
            for p, h in fb.host.items():
                if p not in seen and h in fb.opt.state:
                    keys.append(p)
                    seen.add(p)
        return keys

    def keys(self):
        return self._keys()

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def __contains__(self, p):
        return dict.__contains__(self, p) or self._live(p)[0]

    def values(self):
        return [self[p] for p in self._keys()]

    def items(self):
        return [(p, self[p]) for p in self._keys()]

    def __repr__(self):
        return "aoq state view of %d parameters" % len(self)


# Every optimizer not yet collected: at interpreter exit (this module's
# atexit handler, which runs after those registered later) their pending
# updates land in the parameters.
_LIVE = weakref.WeakSet()


@atexit.register
def _land_all():
    for opt in list(_LIVE):
        try:
            if getattr(opt, "_client", None) is not None:
                opt.synchronize()
        except Exception:       # a daemon gone at exit: nothing to land
            pass


# Optimizers with offload_gradients whose dropped gradients torch's clipping
# would miss, and the clipping functions wrapped to say so.
_WATCHED = weakref.WeakSet()
_CLIPS = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm")
_patched = False


def _missing(params):
    """[(optimizer, names)] of the watched optimizers whose offloaded
    parameters among params had gradients this step that aoq dropped."""
    out = []
    ps = [p for p in params if torch.is_tensor(p) and p.grad is None]
    for opt in list(_WATCHED):
        if getattr(opt, "_clip_warned", False):
            continue
        names = [s.name for p in ps for s in (opt._slot_of.get(p),) if s is not None and (s.count or s.final)]
        if names:
            out.append((opt, names))
    return out


def _wrap_clip(fn, what):
    @functools.wraps(fn)
    def clip(parameters, *args, **kwargs):
        if torch.is_tensor(parameters):
            parameters = [parameters]
        elif not isinstance(parameters, (list, tuple)):
            parameters = list(parameters)
        if _WATCHED:
            for opt, names in _missing(parameters if what != "get_total_norm" else ()):
                opt._clip_warned = True
                warnings.warn(
                    "aoq: torch.nn.utils.%s found no gradient for %d parameters (%s): offload_gradients=True sends "
                    "them to aoqd during backward and drops p.grad, so this clipping measured and changed none of "
                    "them and the step differs from one clipped in torch. Clip in aoqd with OffloadOptimizer(..., "
                    "max_grad_norm=X), or use offload_gradients=False" % (what, len(names), ", ".join(names[:3])),
                    RuntimeWarning, stacklevel=2)
        return fn(parameters, *args, **kwargs)
    clip._aoq_wrapped = fn
    return clip


def _watch_clips(opt):
    """Watch torch's clipping for opt's dropped gradients (offload_gradients)."""
    global _patched
    _WATCHED.add(opt)
    if _patched:
        return
    _patched = True
    import torch.nn.utils as nu
    import torch.nn.utils.clip_grad as cg
    for name in _CLIPS:
        for mod in (nu, cg):
            fn = getattr(mod, name, None)
            if fn is not None and not hasattr(fn, "_aoq_wrapped"):
                setattr(mod, name, _wrap_clip(fn, name))
