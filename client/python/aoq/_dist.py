# SPDX-License-Identifier: MIT
"""aoq.torch under torch.distributed: DTensor shards (FSDP2), the DDP
communication hook that pushes averaged buckets, the names DCP gives
parameters, the rank, job name and seed a process registers with, the local
group of a replica group (shared=True), and _Distributed, the optimizer's
methods for DDP and FSDP2 modules."""
import itertools
import os
import sys
import warnings
import weakref

def _is_dtensor(t):
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")


def _local(t):
    """The tensor aoq reads and writes for t: a DTensor's local shard
    (FSDP2's sharded parameters and gradients), else t itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    return DistributedDataParallel


def _is_fsdp2(mod):
    """mod is a fully_shard (FSDP2) module (only when the program imported FSDP)."""
    m = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(m, "FSDPModule", None) if m is not None else None
    return cls is not None and isinstance(mod, cls)


def _like_param(p, t):
    """A state tensor t (local, p's local shape) as p is: a DTensor with p's
    mesh and placements for an FSDP2 parameter (so DCP shards and reshards
    it), else t."""
    if not _is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _fsdp_unit_params(mod):
    """The parameters an FSDP2 module all-gathers in its pre-forward: those of
    its subtree that no nested fully_shard module owns."""
    out, stack = [], [mod]
    while stack:
        m = stack.pop()
        out.extend(p for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m.children() if not _is_fsdp2(c))
    return out


def _ddp_comm_hook(state, bucket):
    """DistributedDataParallel communication hook of an OffloadOptimizer:
    averages the bucket as DDP's default hook does (divide by the world
    size, all-reduce), and once the all-reduce has completed pushes the
    bucket's gradients to aoqd (OffloadOptimizer._ddp_push)."""
    ref, group = state
    import torch.distributed as dist
    buf = bucket.buffer()
    buf.div_(group.size() if group is not None else dist.get_world_size())
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    opt = ref()
    if opt is None:
        return fut.then(lambda f: f.value()[0])
    opt._queue_seen()
    params, grads = bucket.parameters(), bucket.gradients()

    def done(f):
        t = f.value()[0]
        o = ref()
        if o is not None:
            o._ddp_push(params, grads)
        return t
    return fut.then(done)

def _canon_fqn(name):
    """A parameter name without the wrappers' components (DDP's "module.",
    torch.compile's "_orig_mod."), as torch.distributed.checkpoint names
    parameters."""
    return ".".join(x for x in name.split(".") if x not in ("module", "_orig_mod"))


def _dist_rank():
    """torch.distributed's global rank when a process group is up, else $RANK, else 0."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


_jobs_made = itertools.count(1)
_optimizers_made = itertools.count(1)


def _replica_seed(seed):
    """The stochastic rounding seed to register.  seed=0 in a process group
    of more than one rank: every rank's n-th OffloadOptimizer gets the same
    seed, so data-parallel replicas round alike (with the daemon's own pick,
    one per session, their bf16 masters and q8 moments drifted apart).
    Alone: 0, the daemon picks.  Counts every optimizer, so that the n-th
    matches across ranks whatever each was given."""
    n = next(_optimizers_made)
    if seed:
        return seed
    try:
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except ImportError:
        world = 1
    if max(world, int(os.environ.get("WORLD_SIZE", "1"))) < 2:
        return 0
    return (0x9e3779b97f4a7c15 * (n + 0x5eed)) % (1 << 64) or 1


def _mix64(x):
    """splitmix64's finalizer of x + the golden ratio, as a 64-bit int."""
    m = (1 << 64) - 1
    z = (x + 0x9e3779b97f4a7c15) & m
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & m
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & m
    return z ^ (z >> 31)


def _shard_seed(seed, params):
    """The seed of a session that holds FSDP2 shards: the ranks' common seed
    (_replica_seed) with this rank's place on the mesh's sharded dimensions
    mixed in.  aoqd draws a tensor's random bits from (seed, tensor, step,
    element index in what the session holds), so with one seed every shard
    of a tensor would round its element i as the others do, and the
    rounding errors of the whole tensor would repeat from shard to shard;
    the ranks that hold the same shard (HSDP's replicas, the mesh's
    Replicate dimensions) keep one seed and stay identical.  seed 0 (the
    daemon picks one per session) and a session of no DTensor shard are
    left alone."""
    if not seed:
        return seed
    for p in params:
        if not _is_dtensor(p):
            continue
        coord = p.device_mesh.get_coordinate()
        if coord is None:
            continue
        key = [c for c, pl in zip(coord, p.placements) if pl.is_shard()]
        if not key:
            continue
        h = 0
        for c in key:
            h = _mix64(h ^ (c + 1))
        return (seed ^ h) or 1
    return seed


def _job_default():
    """torch-PID for a process's first optimizer without a job name,
    torch-PID-2, -3, ... for the next ones (two optimizers of one process,
    a GAN's say, are two sessions; the same name would be refused BUSY)."""
    n = next(_jobs_made)
    return "torch-%d" % os.getpid() if n == 1 else "torch-%d-%d" % (os.getpid(), n)


def _local_group():
    """(local world size, local rank) of this data-parallel rank on its node:
    torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK, else (with a process group
    up and neither set) the whole world as one node.  (0, 0) when alone."""
    lw, lr = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
    if lw is not None and lr is not None:
        lw, lr = int(lw), int(lr)
    else:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("shared=True needs torch.distributed initialized, or LOCAL_WORLD_SIZE and LOCAL_RANK "
                             "(torchrun sets them)")
        lw, lr = dist.get_world_size(), dist.get_rank()
    if lw < 2:
        return 0, 0
    if not 0 <= lr < lw or lw > 64:
        raise ValueError("shared=True: local rank %d of local world size %d (2 to 64 ranks)" % (lr, lw))
    return lw, lr


def _shared_job_default():
    """A job name every rank of the job agrees on: global rank 0's
    torch-PID, broadcast (every node's daemon sees only its own ranks)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shared=True without torch.distributed: give job= (the same on every local rank)")
    name = [_job_default()]
    dist.broadcast_object_list(name, src=0)
    return name[0]



class _Distributed:
    """OffloadOptimizer's DDP and FSDP2 methods (a mixin: the state is the
    optimizer's own)."""

    def _fsdp_unit(self, mod):
        """For an FSDP2 (fully_shard) module: the parameters its pre-forward
        all-gathers (their local shards must hold the update first), else
        None."""
        unit = self._fsdp_units.get(mod)
        if unit is None:
            if not _is_fsdp2(mod):
                return None
            unit = self._fsdp_units[mod] = [p for p in _fsdp_unit_params(mod) if p in self._slot_of]
        return unit

    def _attach_ddp(self, ddp):
        """Parameters owned by a DistributedDataParallel module are pushed
        only once DDP has averaged them: a communication hook all-reduces
        each bucket as DDP's default hook does and pushes the bucket's
        gradients when its all-reduce completes (_ddp_push).  When the DDP
        module already has a communication hook, they are pushed at step()
        instead (averaged too; no overlap with backward)."""
        if ddp in self._ddps:
            return
        self._ddps.add(ddp)
        slots = [self._slot_of[p] for p in ddp.module.parameters() if p in self._slot_of]
        if not slots:
            return
        for s in slots:
            s.ddp = True
        try:
            ddp.register_comm_hook((weakref.ref(self), ddp.process_group), _ddp_comm_hook)
        except RuntimeError as e:
            warnings.warn("aoq: cannot register aoq's communication hook on this DistributedDataParallel module "
                          "(%s); its gradients are pushed at step(), once DDP has averaged them, without overlap "
                          "with backward" % (str(e).splitlines()[0] if str(e) else type(e).__name__,),
                          RuntimeWarning, stacklevel=3)

    def _queue_seen(self):
        """From the DDP communication hook or an FSDP2 parameter's hook
        (autograd's thread, in backward): at the end of this backward, after
        DDP has written the averaged gradients into p.grad (FSDP2 bumps the
        version counter of an accumulated gradient shard after its hook, not
        its values), note them as the gradients backward left: the
        reference for detecting edits between backward and step().  DDP and
        FSDP2 queue their own end-of-backward callbacks before this is
        called or after the first hook; a callback queued from a callback
        runs after every one queued before it."""
        if self._seen_queued:
            return
        from torch.autograd import Variable
        engine = Variable._execution_engine
        ref = weakref.ref(self)

        def after_backward():
            o = ref()
            if o is None:
                return
            o._seen_queued = False
            for s in o._slots:
                g = s.p.grad
                if (s.ddp or s.x is not s.p) and g is not None:
                    g = _local(g)
                    s.seen, s.seen_ver = g, g._version
                    if o.offload_gradients and s.final and s.ddp:
                        s.p.grad = None     # pushed: the device copy goes (DDP's bucket keeps its own)
        try:
            engine.queue_callback(lambda: engine.queue_callback(after_backward))
            self._seen_queued = True
        except RuntimeError:
            pass

    def _ddp_push(self, params, grads):
        """The averaged gradients of one DDP bucket (from its all-reduce's
        future: a process group thread with gloo, inline with NCCL): the
        final micro-batch's go to aoqd.  A learning step, or a loop that
        edits gradients, pushes at step() instead."""
        k = self._learned if self._edits is False else None
        if k is None or self._client is None:
            return
        with self._lock:
            for p, g in zip(params, grads):
                s = self._slot_of.get(p)
                if s is None or not s.ddp:
                    continue
                if s.final:
                    raise RuntimeError(
                        "aoq: parameter %r got a gradient after its final push of this step (%d backward passes "
                        "per step assumed); pass grad_accumulation_steps=N to OffloadOptimizer" % (s.name, k))
                if s.count == k:
                    self._push(s, g, final=True)
