#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoq.torch.OffloadOptimizer under torch.distributed: DDP and FSDP2
(fully_shard) ranks against the same training with torch.optim.AdamW,
checkpoints through torch.distributed.checkpoint at another world size,
several daemons (one per simulated node), a rank killed mid-step.

Each case runs its ranks as processes (fork on the CPU with gloo, spawn with
NCCL on GPUs), each with its own aoqd session; the parent starts the
daemons.  Usage:

    test_distributed.py [--device cpu|cuda] [--cases a,b] [--world N] [--one-gpu]

Exit 0 ok, 1 fail, 77 skip (no torch, or fewer GPUs than ranks)."""
import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time
import traceback

try:
    import torch
except ImportError as e:
    if any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH")):
        print("FAIL: torch is required here (CI / AOQ_REQUIRE_TORCH is set) but %s" % (e,))
        sys.exit(1)
    print("SKIP: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import aoq  # noqa: E402
import aoq.torch  # noqa: E402,F401

STEPS = 5
LR = 1e-2


# ---------------------------------------------------------------- helpers
def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 64))


def batch(step, micro, rank, dev):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(16, 32, generator=g).to(dev), torch.randn(16, 64, generator=g).to(dev)


def train(model, opt, rank, dev, steps, start=0, accum=1, no_sync=False, after_backward=None):
    for i in range(start, start + steps):
        for j in range(accum):
            x, y = batch(i, j, rank, dev)
            ctx = model.no_sync() if no_sync and j < accum - 1 else contextlib.nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(model(x), y).backward()
            if after_backward is not None:
                after_backward(i, j)
        opt.step()
        opt.zero_grad()


def count_pushes(opt):
    """Counts the optimizer's pushes to aoqd (wraps its client's push_grad)."""
    n = [0]
    c = opt._client
    orig = c.push_grad

    def push(*a, **k):
        n[0] += 1
        return orig(*a, **k)
    c.push_grad = push
    return n


def flat_params(model):
    ps = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        ps.append(p.detach().reshape(-1).float())
    return torch.cat(ps)


def same_across_ranks(model, what):
    import torch.distributed as dist
    f = flat_params(model)
    out = [torch.empty_like(f) for _ in range(dist.get_world_size())]
    dist.all_gather(out, f)
    for r, o in enumerate(out):
        if not torch.equal(o, out[0]):
            raise AssertionError("%s: rank %d's parameters differ from rank 0's (max |d| %g)"
                                 % (what, r, (o - out[0]).abs().max().item()))


def close_to(model, ref, what):
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        torch.testing.assert_close(a.detach(), b.detach(), msg=lambda m: "%s, %s: %s" % (what, n, m))


def steps_of(opt):
    return [int(x) for x in opt._client.get_tensor_steps()]


def Offload(params, env, **kw):
    return aoq.torch.OffloadOptimizer(params, torch.optim.AdamW, socket=env["socket"], lr=LR, weight_decay=0.1,
                                      timeout=env.get("timeout", 60), **kw)


class _Bf16(torch.nn.Module):
    """A model in bf16 that takes and gives fp32."""

    def __init__(self, m):
        super().__init__()
        self.m = m.to(torch.bfloat16)

    def forward(self, x):
        return self.m(x.to(torch.bfloat16)).float()


def ddp(model, env, **kw):
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = env["dev"]
    kw.setdefault("bucket_cap_mb", 0.02)       # several buckets: pushes from several all-reduces
    if dev.type == "cuda":
        return DDP(model.to(dev), device_ids=[dev.index], **kw)
    return DDP(model, **kw)


# ------------------------------------------------------------------ cases
def case_ddp(rank, ws, env):
    """DDP + aoq: replicas bit-identical, equal to DDP + torch AdamW; from the
    second step on every gradient is pushed by the communication hook, before
    step() (streaming)."""
    dev = env["dev"]
    refs = {}
    # grad_edits=False: streaming is forced (no edit detection at the first step, which would otherwise notice
    # that DDP rewrote p.grad after the gradient hooks and push at step())
    for view, edits in ((False, None), (False, False), (True, None)):
        what = "DDP (gradient_as_bucket_view=%s, grad_edits=%s, %d ranks)" % (view, edits, ws)
        if view not in refs:
            refs[view] = ref = ddp(make_model(), env, gradient_as_bucket_view=view)
            train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS)
        ref = refs[view]
        m = ddp(make_model(), env, gradient_as_bucket_view=view)
        o = Offload(m.named_parameters(), env, grad_edits=edits)
        streamed = []
        train(m, o, rank, dev, STEPS, after_backward=lambda i, j: streamed.append(sum(s.final for s in o._slots)))
        o.synchronize()
        assert o._slots and all(s.ddp for s in o._slots), "DDP was not detected"
        assert streamed[0] == 0 and streamed[1:] == [len(o._slots)] * (STEPS - 1), \
            "%s: pushed before step() per step: %s" % (what, streamed)
        same_across_ranks(m, what)
        close_to(m, ref, what + " vs DDP + torch AdamW")
        o.close()
    # stochastic rounding (bf16 master, q8 moments) without seed=: every
    # rank's optimizer draws the same bits, so the replicas stay identical
    for prec, master in (("q8", "bf16"), (None, "bf16")):
        what = "DDP, state_precision=%s, master_dtype=%s, no seed= (%d ranks)" % (prec, master, ws)
        m = ddp(make_model(), env)
        o = Offload(m.named_parameters(), env, state_precision=prec, master_dtype=master)
        train(m, o, rank, dev, STEPS)
        o.synchronize()
        same_across_ranks(m, what)
        o.close()


def case_ddp_auto(rank, ws, env):
    """DDP + gpu_state_budget="auto": the ranks measure different timelines
    (here: only the last rank finds updates late at the first probe), yet
    every rank moves the same parameters (rank 0's choice) to its device
    share at the same probe, so the replicas stay bit-identical, equal to
    DDP + torch AdamW within assert_close (the share steps with torch's
    AdamW, aoqd the rest).  Ranks with different tensors (pipeline stages)
    each split alone.  bf16 parameters with a share in the default's q8
    format stay bit-identical too (the same random bits on every rank)."""
    import torch.distributed as dist
    import aoq._share as sh
    dev = env["dev"]
    ref = ddp(make_model(), env)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS + 2)
    m = ddp(make_model(), env)
    o = Offload(m.named_parameters(), env, grad_edits=False, gpu_state_budget="auto")
    probes = []
    real_late = sh._auto_late

    def late(total, span, tail, fwd=None):
        probes.append(total)
        return (total // 10 if rank == ws - 1 and len(probes) == 1 else 0), span    # one weight moves
    sh._auto_late = late
    try:
        train(m, o, rank, dev, STEPS + 2)
    finally:
        sh._auto_late = real_late
    o.synchronize()
    assert len(probes) == 2 and o.auto_split["rounds"] == 2, (probes, o.auto_split)
    assert o._share is not None and len(o._share.params) == 1, o.auto_split
    names = {id(p): n for n, p in m.named_parameters()}
    mine = sorted(names[id(p)] for p in o._share.params)
    every = [None] * ws
    dist.all_gather_object(every, mine)
    assert all(x == every[0] for x in every), "ranks moved different parameters: %s" % (every,)
    same_across_ranks(m, "DDP + auto (%d ranks)" % ws)
    close_to(m, ref, "DDP + auto vs DDP + torch AdamW")
    assert o._auto_dist is not None, "the replicas did not agree on the split"
    o.close()
    # bf16 parameters at the default precision: the share keeps the state as
    # aoqd does (q8 moments, the master split beside the parameter; aoq/_q8.py)
    # and every replica draws the same random bits: still bit-identical
    mb = ddp(_Bf16(make_model()), env)
    first = [p for p in mb.parameters() if p.numel() >= 4096][0]
    o = Offload(mb.named_parameters(), env, grad_edits=False,
                gpu_state_budget=sh._share_bytes(first, "adamw", None, q8=True))
    assert o.state_precision == "q8" and o._share is not None and o._share.q8 and o._share.params == [first]
    train(mb, o, rank, dev, STEPS)
    o.synchronize()
    same_across_ranks(mb, "DDP + a q8 share, bf16 parameters (%d ranks)" % ws)
    o.close()
    # Ranks whose offloaded tensors differ (as pipeline stages' do) split alone, without a hang.
    torch.manual_seed(rank)
    stage = torch.nn.Sequential(torch.nn.Linear(32, 128 + 32 * rank), torch.nn.Tanh(),
                                torch.nn.Linear(128 + 32 * rank, 64)).to(dev)
    o = Offload(stage.named_parameters(), env, gpu_state_budget="auto")
    train(stage, o, rank, dev, STEPS + 2)
    o.synchronize()
    assert o._auto_dist is None and o.auto_split is not None, (o._auto_dist, o.auto_split)
    o.close()


def _aoqctl():
    """aoqctl: $AOQCTL, else the build tree's (meson sets AOQCTL for the tests)."""
    path = os.environ.get("AOQCTL") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                                    "build", "client", "tools", "aoqctl")
    if not os.access(path, os.X_OK):
        raise RuntimeError("aoqctl not found at %s: set AOQCTL to the built client/tools/aoqctl" % path)
    return path


def _stats_rows(sock):
    import json
    import subprocess
    out = subprocess.run([_aoqctl(), "--socket", sock, "stats", "--json"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)["sessions"]


def case_shared(rank, ws, env):
    """DDP + aoq with one state for the node's ranks (shared=True): equal to
    DDP + torch AdamW, replicas bit-identical, every gradient streamed by the
    communication hook from the second step on, and the daemon holds the
    state of one replica (its state bytes equal a lone session's)."""
    import torch.distributed as dist
    dev = env["dev"]
    for view in (False, True):
        what = "DDP + shared aoq (gradient_as_bucket_view=%s, %d ranks)" % (view, ws)
        ref = ddp(make_model(), env, gradient_as_bucket_view=view)
        train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS)
        m = ddp(make_model(), env, gradient_as_bucket_view=view)
        o = Offload(m.named_parameters(), env, grad_edits=False, shared=True)
        assert (o.local_world, o.local_rank) == (ws, rank), (o.local_world, o.local_rank)
        streamed = []
        train(m, o, rank, dev, STEPS, after_backward=lambda i, j: streamed.append(sum(s.final for s in o._slots)))
        o.synchronize()
        assert o._slots and all(s.ddp for s in o._slots), "DDP was not detected"
        assert streamed[1:] == [len(o._slots)] * (STEPS - 1), "%s: pushed before step(): %s" % (what, streamed)
        same_across_ranks(m, what)
        close_to(m, ref, what + " vs DDP + torch AdamW")
        assert steps_of(o) == [STEPS] * len(o._slots), "%s: tensor steps %s" % (what, steps_of(o))
        dist.barrier()
        if rank == 0:
            lone = Offload(make_model().named_parameters(), env, job="lone-%d" % os.getpid(), lease=0)  # one replica
            rows = _stats_rows(env["socket"])
            group = [r for r in rows if r["job"] == o.job]
            single = [r for r in rows if r["job"] == lone.job]
            assert len(group) == ws and len(single) == 1, "%s: stats rows %r" % (what, rows)
            # aoqctl shows the group: one id, every local rank once, one owner row
            gs = [r["group"] for r in group]
            assert all(g and g["local_world"] == ws for g in gs) and single[0]["group"] is None, \
                "%s: group fields %r / %r" % (what, gs, single[0]["group"])
            assert len({g["id"] for g in gs}) == 1 and sorted(g["local_rank"] for g in gs) == list(range(ws)) \
                and sum(g["owner"] for g in gs) == 1, "%s: group fields %r" % (what, gs)
            table = subprocess.run([_aoqctl(), "--socket", env["socket"], "sessions"],
                                   capture_output=True, text=True, check=True).stdout
            assert "GROUP" in table and ("%d:0/%d" % (gs[0]["id"], ws)) in table, table
            held = sum(r["state_bytes"] for r in group)
            assert held == single[0]["state_bytes"] > 0, \
                "%s: the group holds %d bytes of state, one replica %d" % (what, held, single[0]["state_bytes"])
            lone.close()
        dist.barrier()
        o.close()


def case_nosync(rank, ws, env):
    """Gradient accumulation: with no_sync() nothing is pushed until the
    syncing backward; without it (an all-reduce every micro-batch) only the
    last micro-batch's averaged gradient is pushed."""
    dev = env["dev"]
    for no_sync in (True, False):
        what = "DDP accumulation (3 micro-batches, no_sync=%s)" % no_sync
        ref = ddp(make_model(1), env)
        train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS, accum=3,
              no_sync=no_sync)
        m = ddp(make_model(1), env)
        o = Offload(m.named_parameters(), env, model=m)
        n = count_pushes(o)
        log = []
        step = o.step

        def logged_step(*a):
            r = step(*a)
            log.append(("step", n[0]))
            return r
        o.step = logged_step
        train(m, o, rank, dev, STEPS, accum=3, no_sync=no_sync, after_backward=lambda i, j: log.append((j, n[0])))
        o.synchronize()
        # per step: [(0, pushes), (1, pushes), (2, pushes), ("step", pushes)]; the first step pushes at step()
        per = [log[4 * i:4 * i + 4] for i in range(STEPS)]
        start = [0] + [n_ for (_, n_) in (log[4 * i + 3] for i in range(STEPS - 1))]
        for i in range(1, STEPS):
            got = [x[1] - start[i] for x in per[i]]
            want = [0, 0, len(o._slots), len(o._slots)]
            assert got == want, "%s: step %d pushes after micro-batches 0, 1, 2 and at step(): %s, want %s" \
                % (what, i, got, want)
        same_across_ranks(m, what)
        close_to(m, ref, what + " vs DDP + torch AdamW")
        o.close()


def _ref_adamw_state(sd):
    """aoq's state_dict as torch AdamW's (no master, no "aoq")."""
    st = {k: {kk: vv for kk, vv in v.items() if kk != "master"} for k, v in sd["state"].items()}
    return {"state": st, "param_groups": sd["param_groups"]}


def case_dcp_save(rank, ws, env):
    """DDP + aoq trains STEPS steps and saves model and optimizer with
    torch.distributed.checkpoint; neither get_state_dict nor dcp.save moves
    the daemon's step counters.  Rank 0 also keeps a torch.save reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    dev = env["dev"]
    m = ddp(make_model(), env)
    o = Offload(m.named_parameters(), env)
    train(m, o, rank, dev, STEPS)
    o.synchronize()
    before = steps_of(o)
    assert before == [STEPS] * len(before), before
    params = [p.detach().clone() for p in m.parameters()]
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(env["tmp"], "ck"))
    assert steps_of(o) == before, "a hidden step in get_state_dict/dcp.save: %s -> %s" % (before, steps_of(o))
    for p, q in zip(m.parameters(), params):
        assert torch.equal(p.detach(), q), "get_state_dict changed a parameter"
    if rank == 0:
        torch.save({"params": [p.detach().cpu() for p in m.module.parameters()], "opt": o.state_dict()},
                   os.path.join(env["tmp"], "ref.pt"))
    o.close()


def case_dcp_load(rank, ws, env):
    """At another world size: a fresh model and session load the checkpoint
    (no hidden step: the counters go from 0 to the saved STEPS), match the
    reference exactly, and train on as DDP + torch AdamW loaded from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    dev = env["dev"]
    refsd = torch.load(os.path.join(env["tmp"], "ref.pt"), weights_only=False)
    m = ddp(make_model(seed=99), env)
    o = Offload(m.named_parameters(), env)
    assert steps_of(o) == [0] * len(o._slots)
    msd, osd = get_state_dict(m, o)
    assert steps_of(o) == [0] * len(o._slots), "a hidden step in get_state_dict: %s" % steps_of(o)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(env["tmp"], "ck"))
    set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
    assert steps_of(o) == [STEPS] * len(o._slots), "loaded step counters %s (want %d)" % (steps_of(o), STEPS)
    for p, q in zip(m.module.parameters(), refsd["params"]):
        assert torch.equal(p.detach().cpu(), q), "loaded parameter differs"
    got = o.state_dict()
    for k, st in refsd["opt"]["state"].items():
        for kk, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][k][kk]).cpu(), torch.as_tensor(v).cpu()), \
                "state %s %s differs after the DCP round trip (%d -> %d ranks)" % (k, kk, env["saved_ws"], ws)
    ref = ddp(make_model(seed=98), env)
    with torch.no_grad():
        for p, q in zip(ref.module.parameters(), refsd["params"]):
            p.copy_(q)
    ro = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    ro.load_state_dict(_ref_adamw_state(refsd["opt"]))
    train(ref, ro, rank, dev, 3, start=STEPS)
    train(m, o, rank, dev, 3, start=STEPS)
    o.synchronize()
    same_across_ranks(m, "after loading at %d ranks" % ws)
    close_to(m, ref, "loaded at %d ranks, 3 more steps, vs DDP + torch AdamW" % ws)
    o.close()


def case_dcp_ddp(rank, ws, env):
    """In one job, under DDP, with an optimizer of m.parameters() (unnamed):
    get_optimizer_state_dict then set_optimizer_state_dict into the same
    optimizer and into a fresh one, training on between, equals DDP + torch
    AdamW trained straight through."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    dev = env["dev"]
    ref = ddp(make_model(), env)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, 6)
    m = ddp(make_model(), env)
    o = Offload(m.parameters(), env)
    train(m, o, rank, dev, 3)
    set_optimizer_state_dict(m, o, get_optimizer_state_dict(m, o))
    train(m, o, rank, dev, 1, start=3)
    m2 = ddp(make_model(seed=7), env)
    m2.load_state_dict(m.state_dict())
    o2 = Offload(m2.parameters(), env)
    set_optimizer_state_dict(m2, o2, get_optimizer_state_dict(m, o))
    o.close()
    train(m2, o2, rank, dev, 2, start=4)
    o2.synchronize()
    same_across_ranks(m2, "DCP get/set under DDP")
    close_to(m2, ref, "DCP get/set under DDP (unnamed parameters), vs DDP + torch AdamW")
    o2.close()


def case_nodes(rank, ws, env):
    """One daemon per simulated node: each rank on its node's socket."""
    dev = env["dev"]
    ref = ddp(make_model(2), env)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS)
    m = ddp(make_model(2), env)
    o = Offload(m.named_parameters(), env)
    assert o._client is not None and env["socket"] == env["sockets"][rank * len(env["sockets"]) // ws]
    train(m, o, rank, dev, STEPS)
    o.synchronize()
    same_across_ranks(m, "two daemons")
    close_to(m, ref, "two daemons vs DDP + torch AdamW")
    o.close()


def case_disconnect(rank, ws, env):
    """Rank 1 dies in step 2's backward.  Rank 0's collective fails (gloo's
    timeout); its aoq calls then finish within aoq's timeout, never hang."""
    dev = env["dev"]
    m = ddp(make_model(3), env)
    o = Offload(m.named_parameters(), env)
    train(m, o, rank, dev, 2)
    x, y = batch(2, 0, rank, dev)
    out = m(x)
    if rank == 1:
        out.register_hook(lambda g: os._exit(3))
    t0 = time.monotonic()
    try:
        torch.nn.functional.mse_loss(out, y).backward()
    except Exception as e:
        print("rank %d: backward failed as expected after %.1f s: %s" % (rank, time.monotonic() - t0,
                                                                        str(e).splitlines()[0][:200]))
    else:
        raise AssertionError("backward succeeded with a dead peer")
    t1 = time.monotonic()
    o.synchronize()
    sd = o.state_dict()
    o.close()
    took = time.monotonic() - t1
    assert took < env["timeout"] + 5, "aoq calls took %.1f s after the failure" % took
    assert all(int(st["step"]) == 2 for k, st in sd["state"].items() if "master" in st), sd["state"].keys()
    print("rank 0: aoq synchronize/state_dict/close after the failure: %.2f s" % took)


def wait_peer_lost(o, rank, limit=10.0):
    """After a rank of the replica group died: synchronize() raises PEER_LOST
    within `limit` seconds (never hangs).  The daemon's error reaches the
    client's progress thread asynchronously, and a rank whose all-reduce
    failed before it pushed anything has nothing pending, so synchronize()
    returns until the error has arrived: it is called again until it raises.
    Returns the seconds it took and the error."""
    t0 = time.monotonic()
    while True:
        try:
            o.synchronize()
        except Exception as e:
            assert "PEER_LOST" in str(e), "rank %d: synchronize after a lost rank: %r" % (rank, e)
            return time.monotonic() - t0, e
        took = time.monotonic() - t0
        assert took < limit, "rank %d: no PEER_LOST %.1f s after a rank died" % (rank, took)
        time.sleep(0.02)


def case_shared_disconnect(rank, ws, env):
    """shared=True, and rank 1 dies in step 3's backward: aoqd fails the
    others' sessions at once with PEER_LOST (their gloo collective fails
    later, at its own timeout); their aoq calls then raise that error at
    once (aoq's timeout here is 60 s: a hang would show), never hang."""
    dev = env["dev"]
    m = ddp(make_model(3), env)
    o = Offload(m.named_parameters(), env, shared=True)
    train(m, o, rank, dev, 2)
    x, y = batch(2, 0, rank, dev)
    out = m(x)
    if rank == 1:
        out.register_hook(lambda g: os._exit(3))
    try:
        torch.nn.functional.mse_loss(out, y).backward()
    except Exception as e:
        print("rank %d: backward failed as expected: %s" % (rank, str(e).splitlines()[0][:200]))
    took, err = wait_peer_lost(o, rank)
    try:
        o.close()
    except Exception:
        pass
    print("rank %d: %s (%.3f s)" % (rank, str(err)[:160], took))


def case_shared_resume(rank, ws, env):
    """shared=True with a named job and a lease.  Phase "die": two steps,
    then rank 1 dies in step 3's backward; the others get PEER_LOST.  aoqd
    keeps the group's state (leased, rank "group" in aoqctl sessions).
    Phase "resume": the job's ranks start again; the optimizer resumes the
    group's state at step 2 (and says so), and three more steps equal DDP +
    torch AdamW trained five steps without the interruption.  minimal_size=1:
    parameters stepped in the trainer are the trainer's to restore
    (docs/python.md, "Resuming after a crash")."""
    import warnings
    dev = env["dev"]
    job = "shared-resume-%s" % os.path.basename(env["tmp"])
    m = ddp(make_model(3), env)
    if env["phase"] == "die":
        o = Offload(m.named_parameters(), env, shared=True, job=job, lease=60, minimal_size=1)
        train(m, o, rank, dev, 2)
        x, y = batch(2, 0, rank, dev)
        out = m(x)
        if rank == 1:
            out.register_hook(lambda g: os._exit(3))
        try:
            torch.nn.functional.mse_loss(out, y).backward()
        except Exception:
            pass
        wait_peer_lost(o, rank)
        try:
            o.close()
        except Exception:
            pass
        return
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        o = Offload(m.named_parameters(), env, shared=True, job=job, lease=60, minimal_size=1)
    assert o.resumed_step == 2, "rank %d: resumed_step %r" % (rank, o.resumed_step)
    assert any("resumed job %s" % job in str(x.message) for x in w), [str(x.message) for x in w]
    if rank == 0:
        table = subprocess.run([_aoqctl(), "--socket", env["socket"], "sessions"],
                               capture_output=True, text=True, check=True).stdout
        assert " group " not in table, "the leased group is still listed after the resume:\n" + table
    train(m, o, rank, dev, STEPS - 2, start=2)
    o.synchronize()
    ref = ddp(make_model(3), env)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS)
    same_across_ranks(m, "resumed group")
    close_to(m, ref, "resumed group vs DDP + torch AdamW")
    assert steps_of(o) == [STEPS] * len(o._slots), steps_of(o)
    o.close()


def fsdp_model(env, seed, reshard):
    from torch.distributed.fsdp import fully_shard
    f = make_model(seed).to(env["dev"])
    # Two sharded blocks of two modules each; the root's own unit is the last
    # Linear (the root's pre-forward all-gathers it: the wait covers units).
    m = torch.nn.Sequential(torch.nn.Sequential(f[0], f[1]), torch.nn.Sequential(f[2], f[3]), f[4])
    for i in (0, 1):
        fully_shard(m[i], reshard_after_forward=reshard)
    fully_shard(m, reshard_after_forward=reshard)
    return m


def case_fsdp(rank, ws, env):
    """FSDP2 + aoq (each rank's shards in its session) against FSDP2 + torch
    AdamW: reshard_after_forward True and False, with 2 micro-batches; with
    a bf16 master, each rank's session has its own rounding seed."""
    dev = env["dev"]
    for reshard in (True, False):
        for accum in (1, 2):
            what = "FSDP2 (reshard_after_forward=%s, %d micro-batches, %d ranks)" % (reshard, accum, ws)
            ref = fsdp_model(env, 4, reshard)
            train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1), rank, dev, STEPS, accum=accum)
            m = fsdp_model(env, 4, reshard)
            o = Offload(m.named_parameters(), env, minimal_size=1024)
            assert o._slots and all(s.x.numel() < s.p.numel() for s in o._slots), "not sharded"
            streamed = []
            train(m, o, rank, dev, STEPS, accum=accum,
                  after_backward=lambda i, j: streamed.append(sum(s.final for s in o._slots)) if j == accum - 1
                  else None)
            o.synchronize()
            assert streamed[1:] == [len(o._slots)] * (STEPS - 1), "%s: not streamed: %s" % (what, streamed)
            # each update is waited for before the all-gather of its FSDP unit, not at step()
            assert all(s.fwd for s in o._slots), "%s: the forward did not wait for %s" \
                % (what, [s.name for s in o._slots if not s.fwd])
            close_to(m, ref, what + " vs FSDP2 + torch AdamW")
            o.close()
    # A bf16 master and q8 moments without seed=: each rank's shards round
    # with their own random bits (aoq._dist._shard_seed), not the same bits
    # at the same index of every shard.
    import torch.distributed as dist
    m = fsdp_model(env, 4, True)
    o = Offload(m.named_parameters(), env, minimal_size=1024, master_dtype="bf16", state_precision="q8")
    train(m, o, rank, dev, 2)
    o.synchronize()
    seeds = [None] * ws
    dist.all_gather_object(seeds, o.state_dict()["aoq"]["seed"])
    assert len(set(seeds)) == ws and 0 not in seeds, "FSDP2 shards with one stochastic rounding seed: %s" % seeds
    o.close()
    # bf16 shards at the default precision with a GPU share: torch's
    # optimizer steps the share's DTensors (fp32 state), not the q8 share,
    # whose state is per local tensor
    m = fsdp_model(env, 4, True)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16)
    big = [p for p in m.parameters() if p.numel() >= 1024]
    o = Offload(m.named_parameters(), env, minimal_size=1024, gpu_state_budget=12 * big[0].numel())
    assert o.state_precision == "q8" and not o._share_q8 and o._share is not None and not o._share.q8, \
        (o.state_precision, o._share_q8)
    o.close()
    # HSDP: the ranks of one shard (a Replicate mesh dimension apart) keep
    # one seed, those of different shards do not.
    from aoq._dist import _shard_seed

    class Shard:
        def is_shard(self):
            return True

    class Replicate:
        def is_shard(self):
            return False

    class Mesh:
        def __init__(self, coord):
            self.coord = coord

        def get_coordinate(self):
            return self.coord

    def dtensor(coord):
        return type("DTensor", (), dict(_local_tensor=None, device_mesh=Mesh(coord),
                                        placements=(Replicate(), Shard())))()

    s = {c: _shard_seed(12345, [torch.zeros(1), dtensor(c)]) for c in ((0, 0), (1, 0), (0, 1), (1, 1))}
    assert s[(0, 0)] == s[(1, 0)] and s[(0, 1)] == s[(1, 1)] and s[(0, 0)] != s[(0, 1)], s
    assert _shard_seed(12345, [torch.zeros(1)]) == 12345 and _shard_seed(0, [dtensor((0, 1))]) == 0


def case_fsdp_dcp(rank, ws, env):
    """FSDP2: the optimizer state goes through DCP sharded (DTensors) and
    loads at another world size; no hidden step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    dev = env["dev"]
    ck = os.path.join(env["tmp"], "fsdp-ck")
    m = fsdp_model(env, 5, True)
    o = Offload(m.named_parameters(), env, minimal_size=1024)
    if env["phase"] == "save":
        train(m, o, rank, dev, STEPS)
        o.synchronize()
        before = steps_of(o)
        msd, osd = get_state_dict(m, o)
        st = osd["state"]["1.0.weight"]["exp_avg"]
        assert type(st).__name__ == "DTensor" and st.to_local().numel() < st.numel(), type(st)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
        assert steps_of(o) == before, "hidden step: %s -> %s" % (before, steps_of(o))
        full = {k: {kk: (v.full_tensor() if hasattr(v, "full_tensor") else v) for kk, v in s.items()}
                for k, s in osd["state"].items()}
        if rank == 0:
            torch.save(full, os.path.join(env["tmp"], "fsdp-ref.pt"))
    else:
        assert steps_of(o) == [0] * len(o._slots)
        msd, osd = get_state_dict(m, o)
        assert steps_of(o) == [0] * len(o._slots), "hidden step in get_state_dict"
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ck)
        set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
        assert steps_of(o) == [STEPS] * len(o._slots), steps_of(o)
        ref = torch.load(os.path.join(env["tmp"], "fsdp-ref.pt"), weights_only=False)
        _, osd2 = get_state_dict(m, o)
        for k, s in ref.items():
            for kk, v in s.items():
                got = osd2["state"][k][kk]
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                assert torch.equal(torch.as_tensor(got).cpu(), torch.as_tensor(v).cpu()), \
                    "%s %s differs after DCP at %d ranks" % (k, kk, ws)
        master = dict(m.named_parameters())["1.0.weight"].full_tensor()
        assert torch.equal(master.cpu(), ref["1.0.weight"]["master"].cpu()), "parameter is not the loaded master"
    o.close()


CASES = {"ddp": case_ddp, "ddp_auto": case_ddp_auto, "shared": case_shared, "shared_disconnect": case_shared_disconnect,
         "shared_resume": case_shared_resume, "nosync": case_nosync, "dcp_save": case_dcp_save, "dcp_load": case_dcp_load,
         "dcp_ddp": case_dcp_ddp,
         "nodes": case_nodes, "disconnect": case_disconnect, "fsdp": case_fsdp, "fsdp_dcp": case_fsdp_dcp}


# ---------------------------------------------------------------- launcher
def _worker(rank, ws, case, env):
    import torch.distributed as dist
    res = os.path.join(env["tmp"], "result-%s-%d" % (case, rank))
    try:
        torch.set_num_threads(1)
        if env["device"] == "cuda":
            # --one-gpu: every rank on GPU 0 (NCCL refuses two ranks on one
            # GPU, so gloo, which takes CUDA tensors too)
            gpu = 0 if env.get("one_gpu") else rank
            torch.cuda.set_device(gpu)
            env["dev"] = torch.device("cuda", gpu)
            backend = "gloo" if env.get("one_gpu") else "nccl"
        else:
            env["dev"] = torch.device("cpu")
            backend = "gloo"
        socks = env["sockets"]
        env["socket"] = socks[rank * len(socks) // ws]      # the daemon of this rank's node
        dist.init_process_group(backend, init_method="file://" + env["store"],
                                rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=env.get("pg_timeout", 60)))
        CASES[case](rank, ws, env)
        with open(res, "w") as f:
            f.write("ok")
        dist.destroy_process_group()
        os._exit(0)
    except BaseException:
        msg = traceback.format_exc()
        with open(res, "w") as f:
            f.write(msg)
        sys.stderr.write("rank %d: %s" % (rank, msg))
        sys.stderr.flush()
        os._exit(1)


def launch(case, ws, env, limit=120, expect_dead=()):
    """Runs case on ws processes; each must pass within limit seconds (the
    ranks in expect_dead may die instead).  Raises on a failure or hang."""
    import multiprocessing as mpm
    ctx = mpm.get_context("spawn" if env["device"] == "cuda" else "fork")
    store = tempfile.mktemp(prefix="store-", dir=env["tmp"])      # a fresh rendezvous file per launch
    for r in range(ws):
        path = os.path.join(env["tmp"], "result-%s-%d" % (case, r))
        if os.path.exists(path):
            os.unlink(path)
    procs = [ctx.Process(target=_worker, args=(r, ws, case, dict(env, store=store))) for r in range(ws)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1, limit - (time.monotonic() - t0)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise AssertionError("%s (%d ranks): ranks %s still running after %d s" % (case, ws, hung, limit))
    bad = []
    for r, p in enumerate(procs):
        if r in expect_dead:
            continue
        path = os.path.join(env["tmp"], "result-%s-%d" % (case, r))
        txt = open(path).read() if os.path.exists(path) else "no result (exit %s)" % p.exitcode
        if txt != "ok" or p.exitcode != 0:
            bad.append("rank %d: %s" % (r, txt))
    if bad:
        raise AssertionError("%s (%d ranks) failed:\n%s" % (case, ws, "\n".join(bad)))
    print("ok: %s, %d ranks, %.1f s" % (case, ws, time.monotonic() - t0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cases", default=os.environ.get("AOQ_DIST_CASES", ""))
    ap.add_argument("--world", type=int, default=0, help="ranks (default: 2 and 3 on the CPU, 2 on GPUs)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="cuda: every rank on GPU 0 with gloo (a machine with one GPU)")
    a = ap.parse_args()
    need = 1 if a.one_gpu else 2
    if a.device == "cuda" and torch.cuda.device_count() < need:
        print("SKIP: %d CUDA devices (%d needed)" % (torch.cuda.device_count(), need))
        return 77
    sizes = [a.world] if a.world else ([2] if a.device == "cuda" else [2, 3])
    want = a.cases.split(",") if a.cases else ["ddp", "ddp_auto", "shared", "shared_disconnect", "shared_resume", "nosync", "dcp", "dcp_ddp", "nodes", "disconnect", "fsdp", "fsdp_dcp"]
    failed = 0
    for case in want:
        with tempfile.TemporaryDirectory(prefix="aoq-dist-") as tmp, aoq.Daemon(threads=2) as d:
            env = {"tmp": tmp, "device": a.device, "sockets": [d.socket], "timeout": 60, "one_gpu": a.one_gpu}
            try:
                if case == "dcp":
                    launch("dcp_save", 2, dict(env))
                    for ws in (3, 1) if a.device == "cpu" else (1,):
                        launch("dcp_load", ws, dict(env, saved_ws=2))
                elif case == "fsdp_dcp":
                    launch("fsdp_dcp", 2, dict(env, phase="save"))
                    launch("fsdp_dcp", 3 if a.device == "cpu" else 1, dict(env, phase="load"))
                elif case == "nodes":
                    with aoq.Daemon(threads=1) as d2:
                        launch("nodes", 2 if a.device == "cuda" else 4, dict(env, sockets=[d.socket, d2.socket]))
                elif case == "disconnect":
                    launch("disconnect", 2, dict(env, timeout=10, pg_timeout=10), limit=60, expect_dead=(1,))
                elif case == "shared_disconnect":
                    launch("shared_disconnect", 3, dict(env, timeout=60, pg_timeout=10), limit=60, expect_dead=(1,))
                elif case == "shared_resume":
                    launch("shared_resume", 3, dict(env, timeout=60, pg_timeout=10, phase="die"), limit=60,
                           expect_dead=(1,))
                    t0 = time.monotonic()
                    while True:         # the last rank's close reaches aoqd after the rank is gone
                        rows = _stats_rows(d.socket)
                        leased = [r for r in rows if r["state"] == "leased" and r["group"]]
                        if leased or time.monotonic() - t0 > 10:
                            break
                        time.sleep(0.05)
                    assert len(leased) == 1 and leased[0]["last_step"] == 2, rows
                    table = subprocess.run([_aoqctl(), "--socket", d.socket, "sessions"],
                                           capture_output=True, text=True, check=True).stdout
                    assert " group " in table and "leased" in table, table
                    print(table)
                    launch("shared_resume", 3, dict(env, phase="resume"))
                else:
                    for ws in sizes:
                        launch(case, ws, dict(env))
            except Exception:
                failed += 1
                traceback.print_exc()
                print(d.log_text()[-2000:])
    print("%s" % ("FAIL" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
