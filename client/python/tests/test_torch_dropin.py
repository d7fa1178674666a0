#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""OffloadOptimizer as a drop-in for torch's optimizers, on the
CPU against torch's own optimizers with the same user code:
  * in-place gradient changes after backward: user clip_grad_norm_, an edit
    of p.grad by assignment, GradScaler with an injected inf (a skipped
    step), a loop that starts editing late (warning, then torch semantics),
  * the import swap (no attach): per-module waits through the global
    forward pre-hook, and torch.compile without graph breaks,
  * model.state_dict() / load_state_dict() right after step() (import swap,
    no synchronize()): they wait for the pending updates; written weights
    become the daemon's master,
  * optimizer classes aoqd does not run (SGD with maximize=True, RMSprop):
    in place on the CPU or host copies, with a warning,
  * checkpoints: torch AdamW and torchao CPUOffloadOptimizer state dicts
    loaded, aoq's loaded into torch's AdamW, DCP's get_optimizer_state_dict
    without a hidden step, add_param_group,
  * ValueErrors naming the bad value for precision, dtype, device,
  * two optimizers in one process without job= (torch-PID, torch-PID-2),
  * a bf16 model with a bf16 master: the parameter is the master.
    test_torch_dropin.py [--device cuda:0] [--cases a,b]   (AOQ_TORCH_CASES=a,b too)
On a GPU machine (the issue's import swap and compile with CUDA):
    test_torch_dropin.py --device cuda:0
Exit 0 ok, 1 fail, 77 skip without torch or the device (1 when CI /
AOQ_REQUIRE_TORCH is set and torch is missing)."""
import os
import sys
import traceback
import warnings

from testenv import require_torch  # sets sys.path: this folder and the package

torch = require_torch()
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402
from torch_cases import batches, make_model, same  # noqa: E402

W = 256
STEPS = 8
SOCKET = None
DAEMON = None   # the aoq.Daemon at SOCKET
DEV = "cpu"     # --device cuda:0 runs the cases on a GPU (tests/gpu: the import swap and compile with CUDA)


def loop(model, opt, steps, edit=None, scaler=None, inject=None, start=0, unscale=True):
    """A plain training loop; edit(model, step) runs between backward and step()."""
    data = batches(8, DEV)
    for i in range(start, start + steps):
        x, y = data[i % len(data)]
        loss = torch.nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inject is not None and i == inject:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).grad[0, 0] = float("inf")
        if scaler is not None and unscale:
            scaler.unscale_(opt)
        if edit is not None:
            edit(model, i)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()


def trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


def aoq_opt(m, cls=torch.optim.AdamW, **kw):
    return OffloadOptimizer(m.named_parameters(), cls, socket=SOCKET, lr=kw.pop("lr", 1e-2), **kw)


def compare(what, edit=None, steps=STEPS, use_scaler=False, inject=None, expect_warning=False, unscale=True, **kw):
    m1 = make_model(W, DEV)
    s1 = torch.amp.GradScaler(torch.device(DEV).type, init_scale=2.0 ** 8) if use_scaler else None
    loop(m1, torch.optim.AdamW(trainable(m1), lr=1e-2), steps, edit, s1, inject, unscale=unscale)
    m2 = make_model(W, DEV)
    opt = aoq_opt(m2, **kw)
    s2 = torch.amp.GradScaler(torch.device(DEV).type, init_scale=2.0 ** 8) if use_scaler else None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loop(m2, opt, steps, edit, s2, inject, unscale=unscale)
    opt.synchronize()
    warned = [str(x.message) for x in w if "changed after backward" in str(x.message)]
    if expect_warning:
        assert warned, "%s: no warning about a gradient changed after its update started" % what
    else:
        assert not warned, "%s: unexpected warning %s" % (what, warned)
        same(m2, m1, what)
    if use_scaler:
        assert s1.get_scale() == s2.get_scale(), (s1.get_scale(), s2.get_scale())
    opt.close()
    return m2, m1


def clip(m, i):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


def clip_value(m, i):
    torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)


def reassign(m, i):
    for p in trainable(m):
        p.grad = p.grad * (0.5 if i % 2 else 2.0)


def late(m, i):
    if i >= 3:
        for p in trainable(m):
            p.grad.mul_(0.25)


def case_grad_edits():
    compare("user clip_grad_norm_ every step", clip)
    compare("user clip_grad_value_ every step", clip_value)
    compare("p.grad reassigned every step", reassign)
    compare("user clip_grad_norm_, grad_accumulation_steps=1 given", clip, grad_accumulation_steps=1)
    compare("GradScaler, no inf", use_scaler=True)
    compare("GradScaler with an inf injected at step 2 (step skipped)", use_scaler=True, inject=2)
    compare("GradScaler with an inf injected at step 0 (first step skipped)", use_scaler=True, inject=0)
    compare("GradScaler without unscale_, inf at step 3", use_scaler=True, inject=3, unscale=False)
    compare("GradScaler, unscale_ + user clipping, inf at step 1", clip, use_scaler=True, inject=1)
    # The first steps stream (no edits seen); an edit from step 3 on is detected
    # (warning), and later steps follow torch: not equal to torch as a whole, but
    # the edits after the warning step are honoured, so declaring them up front is.
    a, ref = compare("edits from step 3 on, undeclared", late, expect_warning=True)
    compare("edits from step 3 on, grad_edits=True", late, grad_edits=True)
    # Without any edit the fast path stays: gradients stream from the hooks.
    m = make_model(W, DEV)
    opt = aoq_opt(m)
    loop(m, opt, 3)
    assert opt._edits is False and opt._learned == 1, (opt._edits, opt._learned)
    opt.close()
    m = make_model(W, DEV)
    opt = aoq_opt(m)
    loop(m, opt, 3, clip)
    assert opt._edits is True, opt._edits
    opt.close()
    print("ok: gradient edits")


def case_import_swap():
    """No attach: the global forward pre-hook waits per module (a slot met in
    a forward is not waited for at step()); compiled modules wait outside
    the compiled code and the hooks do not break the graph."""
    m = make_model(W, DEV)
    opt = aoq_opt(m)
    loop(m, opt, 2)
    fwd = [s.name for s in opt._slots if s.fwd]
    assert len(fwd) == len(opt._slots), ("not every parameter waited for in forward", fwd)
    # After step() the update may still be pending; the next forward waits for it.
    x, y = batches(8, DEV)[0]
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    pending = [s for s in opt._slots if s.wait]
    assert pending, "step() waited for every update (no per-module waits)"
    m(x)
    assert not [s for s in opt._slots if s.wait], "the forward did not wait for its parameters"
    opt.close()
    # close() removes the global hook
    assert opt._global_hook is None

    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    m1 = make_model(W, DEV)
    loop(torch.compile(m1, backend=counter), torch.optim.AdamW(trainable(m1), lr=1e-2), 4)
    frames_ref = counter.frame_count
    torch._dynamo.reset()
    counter = CompileCounter()
    m2 = make_model(W, DEV)
    opt = aoq_opt(m2)
    c2 = torch.compile(m2, backend=counter)
    loop_compiled(c2, m2, opt, 4)
    # the original module's state_dict() right after step(), no synchronize()
    same_dicts(cloned(m2.state_dict()), m1.state_dict(), "torch.compile, import swap: state_dict() after step()")
    opt.synchronize()
    same(m2, m1, "torch.compile, import swap")
    assert counter.frame_count == frames_ref, ("graph breaks under compile", counter.frame_count, frames_ref)
    assert all(s.fwd for s in opt._slots), "the compiled module did not wait for its parameters"
    assert c2 in opt._graph_waits, "the compiled graph's own waits (aoq::wait_params) were not trusted"
    opt.close()
    compiled_waits_per_module("aot_eager")
    compiled_pushes_in_graph("aot_eager")
    regional_compile()
    if torch.device(DEV).type == "cuda":
        compiled_waits_per_module("inductor")      # CPU inductor needs a C++ toolchain and minutes: GPU only
    # the swap as a user may write it: `from aoq import OffloadOptimizer`,
    # while `import aoq` alone leaves torch unloaded
    assert aoq.OffloadOptimizer is OffloadOptimizer, "aoq.OffloadOptimizer is not aoq.torch's"
    import subprocess
    code = ("import sys, aoq; assert 'torch' not in sys.modules, 'import aoq loaded torch'; "
            "from aoq import OffloadOptimizer; assert 'torch' in sys.modules; "
            "assert OffloadOptimizer.__module__ == 'aoq.torch', OffloadOptimizer.__module__")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                       capture_output=True, text=True)
    assert r.returncode == 0, ("from aoq import OffloadOptimizer", r.stderr[-2000:])
    print("ok: import swap (per-module waits, compile with %d frame(s))" % frames_ref)


def compiled_pushes_in_graph(backend):
    """A whole compiled model: backward is one graph, whose end the
    post-accumulate-grad hooks wait for; the gradients are pushed from
    inside it instead (aoq::push_grad, as the graph computes each), every
    one before the first hook of the step, and training equals AdamW.  With
    graph_push=False the hooks push them, after the graph."""
    for graph_push in (True, False):
        torch._dynamo.reset()
        m1 = make_model(W, DEV)
        loop(m1, torch.optim.AdamW(trainable(m1), lr=1e-2), 5)
        torch._dynamo.reset()
        m2 = make_model(W, DEV)
        opt = aoq_opt(m2, graph_push=graph_push)
        c2 = torch.compile(m2, backend=backend)
        loop_compiled(c2, m2, opt, 4)
        events = []
        real_push, real_on_grad = opt._push, opt._on_grad

        def push(s, grad, final):
            events.append(("push", s.name))
            real_push(s, grad, final)

        def on_grad(s, p):
            events.append(("hook", s.name))
            real_on_grad(s, p)
        opt._push, opt._on_grad = push, on_grad
        data = batches(8, DEV)
        x, y = data[4 % len(data)]
        torch.nn.functional.mse_loss(c2(x), y).backward()
        opt.step()
        opt.zero_grad()
        opt._push, opt._on_grad = real_push, real_on_grad
        opt.synchronize()
        same(m2, m1, "torch.compile, whole model, graph_push=%s" % graph_push)
        pushes = [i for i, e in enumerate(events) if e[0] == "push"]
        hooks = [i for i, e in enumerate(events) if e[0] == "hook"]
        assert len(pushes) == len(opt._slots), ("one final push per parameter", events)
        if graph_push:
            assert all(s.graph_ok for s in opt._slots), [(s.name, s.graph_ok) for s in opt._slots]
            assert max(pushes) < min(hooks), ("gradients pushed after the compiled backward", events)
        else:
            assert min(pushes) > min(hooks), ("pushed without the hooks", events)
        opt.close()

    # A weight tied into two modules gets two partial gradients in the graph:
    # the hook pushes their sum, as without compile; the others go in-graph.
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32, bias=False)
            self.b = torch.nn.Linear(32, 32, bias=False)
            self.b.weight = self.a.weight
            self.c = torch.nn.Linear(32, 128)

        def forward(self, x):
            return self.c(self.b(torch.relu(self.a(x))))

    def tied():
        torch.manual_seed(5)
        return Tied().to(DEV)
    data = batches(8, DEV)
    torch._dynamo.reset()
    m1 = tied()
    loop(m1, torch.optim.AdamW(m1.parameters(), lr=1e-2), 4)
    torch._dynamo.reset()
    m2 = tied()
    opt = aoq_opt(m2, minimal_size=1)
    loop_compiled(torch.compile(m2, backend=backend), m2, opt, 4)
    opt.synchronize()
    same(m2, m1, "torch.compile, a tied weight")
    ok = {s.name: s.graph_ok for s in opt._slots}
    assert ok["a.weight"] is False and ok["c.weight"] is True and ok["c.bias"] is True, ok
    opt.close()


def regional_compile():
    """Blocks compiled one by one (torch's regional compilation), as
    torch.compile(block) and as block.compile() (which traces the module's
    hooks into the frame): identical blocks share one compiled frame with the
    in-graph waits and pushes as without aoq (nothing in the graph is specific
    to one block; ten blocks are more than dynamo's recompile limit of 8, past
    which the rest would run uncompiled), and training equals AdamW."""
    from torch._dynamo.testing import CompileCounterWithBackend
    n = 10

    def blocks(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
                                                             for _ in range(n)], torch.nn.Linear(64, 128))
        return m.to(DEV)

    def compiled(m, counter, in_place):
        for i in range(1, n + 1):
            if in_place:
                m[i].compile(backend=counter)
            else:
                m[i] = torch.compile(m[i], backend=counter)
        return m

    def run(m, opt):
        data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 128, device=DEV)) for _ in range(4)]
        pushed = []
        for i in range(5):
            x, y = data[i % len(data)]
            torch.nn.functional.mse_loss(m(x), y).backward()
            if isinstance(opt, OffloadOptimizer):
                pushed.append(sum(s.graph_pushed for s in opt._slots))
            opt.step()
            opt.zero_grad()
        return pushed

    for in_place in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(7)
        c1 = CompileCounterWithBackend("aot_eager")
        m1 = compiled(blocks(3), c1, in_place)
        run(m1, torch.optim.AdamW(m1.parameters(), lr=1e-2))
        torch._dynamo.reset()
        torch.manual_seed(7)
        c2 = CompileCounterWithBackend("aot_eager")
        m2 = compiled(blocks(3), c2, in_place)
        opt = aoq_opt(m2)
        assert len(opt._slots) == n + 2, "the blocks' weights are not offloaded"
        pushed = run(m2, opt)
        opt.synchronize()
        same(m2, m1, "regional compilation (%s)" % ("block.compile()" if in_place else "torch.compile(block)"))
        # (torch 2.11 compiles no frame for block.compile() without hooks, one with ours: at most one)
        assert c2.frame_count <= max(c1.frame_count, 1), ("recompiles with aoq's in-graph waits and pushes",
                                                          in_place, c2.frame_count, c1.frame_count)
        if in_place:
            # block.compile() keeps the block (no OptimizedModule to trust);
            # where torch compiled a frame, the hooks ran in it: every block's
            # weight pushed from the compiled backward (torch 2.11 on CUDA
            # compiles none without hooks, and then there is nothing to check)
            if c1.frame_count:
                assert pushed[-1] >= n, ("gradients not pushed from the compiled blocks' backward", pushed)
        else:
            assert all(m2[i] in opt._graph_waits for i in range(1, n + 1)), "compiled blocks not trusted"
        opt.close()


def compiled_waits_per_module(backend):
    """Inside a compiled graph each module waits for its own parameters, in
    forward order (aoq::wait_params), not all of them before the graph
    runs; through AOTAutograd (backend aot_eager: functionalization of the
    op's declared mutation) the result still equals eager AdamW."""
    torch._dynamo.reset()
    m1 = make_model(W, DEV)
    loop(m1, torch.optim.AdamW(trainable(m1), lr=1e-2), 4)
    torch._dynamo.reset()
    m2 = make_model(W, DEV)
    opt = aoq_opt(m2)
    c2 = torch.compile(m2, backend=backend)
    loop_compiled(c2, m2, opt, 3)
    assert c2 in opt._graph_waits, "compiled module not trusted after its first call"
    order = []
    real_wait = opt._wait

    def recording_wait(s):
        if s.wait:
            order.append(s.name)
        real_wait(s)
    opt._wait = recording_wait
    data = batches(8, DEV)
    x, y = data[3 % len(data)]
    pending = [s.name for s in opt._slots if s.wait]
    assert pending, "step() waited for every update"
    out = c2(x)
    # per module, in the order the forward meets the modules
    mods = [mod for mod in m2.modules() if any(p.requires_grad for p in mod.parameters(recurse=False))]
    names = {id(p): s.name for s in opt._slots for p in (s.p,)}
    expect = [names[id(p)] for mod in mods for p in mod.parameters(recurse=False) if names.get(id(p)) in pending]
    assert order == expect, ("in-graph waits", order, expect)
    opt._wait = real_wait
    torch.nn.functional.mse_loss(out, y).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    del opt._wait
    same(m2, m1, "torch.compile (%s): in-graph waits" % backend)
    opt.close()


def cloned(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def same_dicts(a, b, what):
    assert list(a) == list(b), (what, list(a), list(b))
    for k in a:
        try:
            torch.testing.assert_close(a[k], b[k])
        except AssertionError as e:
            raise AssertionError("%s: %s differs:\n%s" % (what, k, e)) from None
    print("ok: %s" % what)


def case_reads_after_step():
    """Import swap: the updates land in a parameter when its module next runs;
    model.state_dict() (torch.save, an EMA over it) and model.load_state_dict()
    right after step() wait for them first, without synchronize()."""
    steps = 4
    other = make_model(W, DEV, seed=7).state_dict()
    data = batches(8, DEV)

    def run(m, o):
        seen, emas = [], None
        for i in range(steps):
            x, y = data[i]
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
            sd = m.state_dict()                  # right after step(): what torch.save would write
            seen.append(cloned(sd))
            if emas is None:
                emas = cloned(sd)
            else:
                for k, v in sd.items():
                    emas[k].mul_(0.9).add_(v, alpha=0.1)
            if i == 1:
                m.load_state_dict(other)         # weights loaded right after step(): the next step starts there
        return seen, emas
    m1 = make_model(W, DEV)
    ref, ref_ema = run(m1, torch.optim.AdamW(trainable(m1), lr=1e-2))
    m2 = make_model(W, DEV)
    opt = aoq_opt(m2)
    got, got_ema = run(m2, opt)
    for i, (a, b) in enumerate(zip(got, ref)):
        same_dicts(a, b, "model.state_dict() right after step() %d (model weights loaded after step 1)" % i)
    same_dicts(got_ema, ref_ema, "an EMA of model.state_dict() taken after every step()")
    opt.synchronize()
    same(m2, m1, "model.load_state_dict() between steps")
    opt.close()
    print("ok: reads and writes of the model right after step()")


def loop_compiled(c, m, opt, steps):
    data = batches(8, DEV)
    for i in range(steps):
        x, y = data[i % len(data)]
        torch.nn.functional.mse_loss(c(x), y).backward()
        opt.step()
        opt.zero_grad()


def case_other_classes():
    from aoq.torch import _HostFallback
    # (SGD and Lion run in aoqd: test_torch_optimizers.py; maximize=True is not aoqd's)
    for in_place, cls, kw in ((True, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, maximize=True)),
                              (True, torch.optim.RMSprop, dict(lr=1e-3)),
                              (False, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, maximize=True)),
                              (False, torch.optim.RMSprop, dict(lr=1e-3))):
        _HostFallback.cpu_in_place = in_place
        m1 = make_model(W, DEV)
        o1 = cls(trainable(m1), **kw)
        sched1 = torch.optim.lr_scheduler.StepLR(o1, 3, 0.5)
        m2 = make_model(W, DEV)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            o2 = OffloadOptimizer(m2.named_parameters(), cls, socket=SOCKET, **kw)
        assert any("not offloaded to aoqd" in str(x.message) for x in w), [str(x.message) for x in w]
        sched2 = torch.optim.lr_scheduler.StepLR(o2, 3, 0.5)
        for i in range(STEPS):
            loop(m1, o1, 1, clip, start=i)
            sched1.step()
            loop(m2, o2, 1, clip, start=i)
            sched2.step()
        same(m2, m1, "%s %s (%s, user clipping, StepLR)" % (cls.__name__, kw, "in place on the CPU" if in_place
                                                              else "host copies"))
        o2.close()
    _HostFallback.cpu_in_place = True
    print("ok: other optimizer classes")


def torch_trained(steps):
    m = make_model(W, DEV)
    o = torch.optim.AdamW(trainable(m), lr=1e-2)
    loop(m, o, steps)
    return m, o


def case_checkpoints():
    # torch AdamW -> aoq, continued == torch continued.  The state dict of the
    # live optimizer (its tensors are o1's own, which keep stepping): aoq
    # must copy what it loads (it once kept the small parameters' moments
    # as views, so both optimizers stepped them).
    m1, o1 = torch_trained(4)
    sd = o1.state_dict()
    m2 = make_model(W, DEV)
    m2.load_state_dict(m1.state_dict())
    o2 = OffloadOptimizer(trainable_named(m2), torch.optim.AdamW, socket=SOCKET, lr=1e-2)
    o2.load_state_dict(sd)
    loop(m1, o1, 4, start=4)
    loop(m2, o2, 4, start=4)
    o2.synchronize()
    same(m2, m1, "torch AdamW state dict loaded, 4 more steps")
    # aoq -> torch AdamW, continued == aoq continued
    sd2 = o2.state_dict()
    m3 = make_model(W, DEV)
    m3.load_state_dict(m2.state_dict())
    o3 = torch.optim.AdamW(trainable(m3), lr=1e-2)
    o3.load_state_dict(sd2)
    loop(m2, o2, 3, start=8)
    loop(m3, o3, 3, start=8)
    o2.synchronize()
    same(m3, m2, "aoq state dict loaded into torch AdamW, 3 more steps")
    o2.close()

    # torchao CPUOffloadOptimizer's format (built from torch AdamW state the
    # way torchao lays it out: one single-parameter optimizer state dict per
    # parameter of >= 4096 elements, the rest positional in "on-device")
    m1, o1 = torch_trained(4)
    sd = o1.state_dict()
    ps = trainable(m1)
    hp = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    off, dev_state, dev_ids = [], {}, []
    for i, p in enumerate(ps):
        if p.numel() >= 4096:
            off.append({"state": {0: sd["state"][i]}, "param_groups": [dict(hp, params=[0])]})
        else:
            dev_state[len(dev_ids)] = sd["state"][i]
            dev_ids.append(len(dev_ids))
    tao = {"offloaded": off, "on-device": {"state": dev_state, "param_groups": [dict(hp, params=dev_ids)]}}
    m2 = make_model(W, DEV)
    m2.load_state_dict(m1.state_dict())
    o2 = OffloadOptimizer(m2.named_parameters(), torch.optim.AdamW, socket=SOCKET, lr=1e-2)
    o2.load_state_dict(saved(tao))
    loop(m1, o1, 4, start=4)
    loop(m2, o2, 4, start=4)
    o2.synchronize()
    same(m2, m1, "torchao CPUOffloadOptimizer state dict loaded, 4 more steps")

    o2.close()

    # SGD (run in aoqd since SGD is wired; the in_place flag only matters
    # to the fallback path): torch SGD's state dict loaded (through torch.save, as a checkpoint is), the model's
    # weights loaded after the optimizer was made, then aoq's state dict
    # loaded into torch's SGD; every continuation equal to torch's.
    for in_place in (True, False):
        sgd_checkpoint(in_place)
    print("ok: checkpoints (torch AdamW, torchao, aoq to torch AdamW, SGD both ways)")


def sgd_checkpoint(in_place):
    """in_place False: host copies of the CPU parameters, as for a device."""
    from aoq.torch import _HostFallback
    _HostFallback.cpu_in_place = in_place
    how = "in place" if in_place else "host copies"
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)
    m1 = make_model(W, DEV)
    o1 = torch.optim.SGD(trainable(m1), **kw)
    loop(m1, o1, 4)
    sd = saved(o1.state_dict())
    m2 = make_model(W, DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o2 = OffloadOptimizer(trainable_named(m2), torch.optim.SGD, socket=SOCKET, **kw)
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    loop(m1, o1, 4, start=4)
    loop(m2, o2, 4, start=4)
    o2.synchronize()    # SGD runs in aoqd: direct parameter reads wait first
    same(m2, m1, "torch SGD state dict loaded into aoq (%s), 4 more steps" % how)
    m3 = make_model(W, DEV)
    m3.load_state_dict(m2.state_dict())
    o3 = torch.optim.SGD(trainable(m3), **kw)
    o3.load_state_dict(saved(o2.state_dict()))
    loop(m2, o2, 3, start=8)
    loop(m3, o3, 3, start=8)
    o2.synchronize()
    same(m3, m2, "aoq SGD (%s) state dict loaded into torch SGD, 3 more steps" % how)
    o2.close()
    _HostFallback.cpu_in_place = True


def saved(sd):
    """sd after torch.save / torch.load (a checkpoint on disk)."""
    import io
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def case_dcp():
    # DCP's get_optimizer_state_dict must not step
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    m4 = make_model(W, DEV)
    o4 = OffloadOptimizer(m4.named_parameters(), torch.optim.AdamW, socket=SOCKET, lr=1e-2)
    before = [p.detach().clone() for p in m4.parameters()]
    dsd = get_optimizer_state_dict(m4, o4)
    o4.synchronize()
    for p, b in zip(m4.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    steps = o4._client.get_tensor_steps()
    assert all(int(x) == 0 for x in steps), ("DCP stepped the optimizer", list(steps))
    assert all(p.grad is None for p in m4.parameters())
    assert "0.weight" in dsd["state"], sorted(dsd["state"])
    o4.close()
    print("ok: DCP get_optimizer_state_dict without a hidden step")


def trainable_named(m):
    return [(n, p) for n, p in m.named_parameters() if p.requires_grad]


def case_add_param_group():
    def run(make_opt):
        m = make_model(W, DEV)
        extra = torch.nn.Linear(128, 128)
        torch.manual_seed(5)
        torch.nn.init.normal_(extra.weight, std=0.02)
        extra = extra.to(DEV)
        o = make_opt([p for n, p in m.named_parameters() if p.requires_grad and not n.startswith("6.")])
        data = batches(8, DEV)
        for i in range(STEPS):
            if i == 3:
                o.add_param_group({"params": list(m[6].parameters()) + list(extra.parameters()), "lr": 1e-3})
            x, y = data[i % len(data)]
            torch.nn.functional.mse_loss(extra(m(x)), y).backward()
            o.step()
            o.zero_grad()
        if hasattr(o, "close"):
            o.synchronize()
            sd = o.state_dict()
            assert len(sd["param_groups"]) == 2 and len(sd["param_groups"][1]["params"]) == 4
            o.close()
        return torch.nn.Sequential(m, extra)
    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(lambda ps: OffloadOptimizer(ps, torch.optim.AdamW, socket=SOCKET, lr=1e-2))
    # The added group is stepped on the device by torch's AdamW itself, from
    # inputs that aoq's first group produced; the daemon's fp32 update is not
    # bit-identical to torch's, and Adam's first steps amplify that for tiny
    # gradients (lr 3e-3 gave one element 1.008e-5 off): lr 1e-3 for the
    # added group keeps that below assert_close's default tolerance.
    same(got, ref, "add_param_group after 3 steps")
    print("ok: add_param_group")


def expect_value_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, "ValueError %r does not name %r" % (msg, n)
        return
    except Exception as e:   # a KeyError or anything else is the bug
        raise AssertionError("expected ValueError naming %s, got %s: %s" % (needles, type(e).__name__, e))
    raise AssertionError("expected ValueError naming %s, got nothing" % (needles,))


def case_errors():
    m = make_model(W, DEV)
    mk = lambda **kw: OffloadOptimizer(m.named_parameters(), socket=SOCKET, **kw)  # noqa: E731
    expect_value_error(lambda: mk(state_precision="q3"), "'q3'", "'q8'", "'q4'")
    expect_value_error(lambda: mk(state_precision="bf16"), "'bf16'", "master_dtype")
    expect_value_error(lambda: mk(master_dtype="fp8"), "'fp8'", "'bf16'")
    expect_value_error(lambda: mk(device="gpu:0"), "'gpu:0'", "'cuda:N'")
    expect_value_error(lambda: mk(copy_mode="zero"), "'zero'", "'framework'")
    # hyperparameters and options torch or aoqd would refuse later (or a
    # bare IndexError at the first step): refused at construction, by name
    expect_value_error(lambda: mk(betas=(0.9,)), "betas", "(0.9,)")
    expect_value_error(lambda: mk(betas=(0.9, 1.0)), "betas", "[0, 1)")
    expect_value_error(lambda: mk(lr=-1e-3), "lr", "-0.001")
    expect_value_error(lambda: mk(lr=float("inf")), "lr", "inf")
    expect_value_error(lambda: mk(eps="1e-8"), "eps", "'1e-8'")
    expect_value_error(lambda: mk(eps=0.0), "eps", "(0,")
    expect_value_error(lambda: mk(weight_decay=-0.1), "weight_decay", "-0.1")
    sgd = lambda **kw: OffloadOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, socket=SOCKET, **kw)  # noqa: E731
    expect_value_error(lambda: sgd(momentum=-0.9), "momentum", "-0.9")
    expect_value_error(lambda: sgd(momentum=1.5), "momentum", "1.5")
    expect_value_error(lambda: sgd(momentum=0.9, dampening=2), "dampening", "2")
    expect_value_error(lambda: sgd(momentum=0.9, dampening=0.1, nesterov=True), "nesterov", "0.1")
    expect_value_error(lambda: mk(lease=-1), "lease", "-1")
    expect_value_error(lambda: mk(max_grad_norm=-1.0), "max_grad_norm", "-1.0")
    expect_value_error(lambda: mk(timeout=0), "timeout", "0")
    mk(lr=torch.tensor(1e-3), betas=[0.9, 0.95], lease=0, max_grad_norm=1.0, timeout=30).close()  # all valid
    expect_value_error(lambda: OffloadOptimizer([torch.zeros(8192, dtype=torch.float64, requires_grad=True)],
                                                socket=SOCKET), "float64", "bf16")
    expect_value_error(lambda: OffloadOptimizer(m.parameters(), "adamw", socket=SOCKET), "'adamw'")
    expect_value_error(lambda: aoq.Client(socket=SOCKET, device="tpu"), "'tpu'", "'cpu'")
    expect_value_error(lambda: aoq.Client(socket=SOCKET, device="cpu", precision="fp64"), "'fp64'", "'q8'")
    c = aoq.Client(socket=SOCKET, job="errors", device="cpu")
    expect_value_error(lambda: c.add_group("lamb"), "'lamb'", "'adamw'")
    expect_value_error(lambda: aoq.client.dtype_code("int8"), "'int8'", "'bf16'")
    c.close()
    print("ok: errors")


def case_gpu_share():
    """gpu_state_budget: the first parameters' state stays on the device
    (stepped there by torch's optimizer), the rest in aoqd; training equals
    torch AdamW; state_dict() holds every parameter's state and loads into
    torch's AdamW; bf16 parameters keep an fp32 master on the device."""
    from aoq.torch import _share_bytes
    m1 = make_model(W, DEV)
    loop(m1, torch.optim.AdamW(trainable(m1), lr=1e-2), STEPS)
    m2 = make_model(W, DEV)
    big = [p for p in trainable(m2) if p.numel() >= 4096]
    assert len(big) >= 2, [p.numel() for p in trainable(m2)]
    budget = _share_bytes(big[0], "adamw", None)
    opt = aoq_opt(m2, gpu_state_budget=budget)
    assert opt._share is not None and opt._share.params == [big[0]], "the first parameter is not the device share"
    assert big[0] not in opt._slot_of and big[1] in opt._slot_of, "the share/offload split is not by budget"
    loop(m2, opt, STEPS)
    opt.synchronize()
    same(m2, m1, "gpu_state_budget: first parameter on the device")
    sd = opt.state_dict()
    trained = [i for i, p in enumerate(opt._positions()) if p.requires_grad]
    assert sorted(sd["state"]) == trained, ("state_dict misses a parameter's state", sorted(sd["state"]), trained)
    ref = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    ref.load_state_dict({"state": {k: {kk: vv for kk, vv in v.items() if kk != "master"} for k, v in sd["state"].items()},
                         "param_groups": sd["param_groups"]})
    ref2 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    loop(m1, ref2, STEPS)     # (fills ref2's state: the loaded one must hold the same keys and shapes)
    for k, st in ref.state_dict()["state"].items():
        for kk, v in ref2.state_dict()["state"][k].items():
            assert st[kk].shape == v.shape, (k, kk)
    opt.close()
    # bf16 parameters: the share keeps an fp32 master, as the daemon does: one step with and one
    # without the share agree (the same gradients; the fp32 masters to fp32 rounding)
    outs = []
    for b in (0, None):
        m = make_model(W, DEV).to(torch.bfloat16)
        first = [p for p in trainable(m) if p.numel() >= 4096][0]
        o = aoq_opt(m, master_dtype="fp32", gpu_state_budget=_share_bytes(first, "adamw", None) if b is None else 0)
        assert (o._share is not None) == (b is None)
        if o._share is not None:
            assert o._share.master[first].dtype == torch.float32
        x, y = batches(8, DEV)[0]
        torch.nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y).backward()
        o.step()
        o.synchronize()
        sd = o.state_dict()
        outs.append(([p.detach().float().clone() for p in m.parameters()],
                     {k: v["master"] for k, v in sd["state"].items() if "master" in v}))
        o.close()
    (pa, ma), (pb, mb) = outs
    assert sorted(ma) == sorted(mb), (sorted(ma), sorted(mb))
    for k in ma:    # (the share's master is on the device, as torch keeps state beside its parameter)
        torch.testing.assert_close(ma[k].cpu(), mb[k].cpu(), rtol=1e-5, atol=1e-7)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-5)     # one bf16 ulp
    # "auto": the choice from the measured tail (pure function)...
    import aoq._share as sh
    assert sh._auto_choice([10, 10, 10, 10], [80] * 4, 20, float("inf")) == [3, 2, 1]
    assert sh._auto_choice([10, 10, 10, 10], [80] * 4, 20, 200) == [3, 2]
    assert sh._auto_choice([10, 10, 10, 10], [80] * 4, 0, float("inf")) == []
    # the last pushed does not fit: the ones before it still move, in push order back
    # (M elements each: past such a gap only tensors of _AUTO_MIN_PASSED or more move)
    M = sh._AUTO_MIN_PASSED
    assert sh._auto_choice([10 * M, 10 * M, 10 * M, 40 * M], [80, 80, 80, 320], 100 * M, 200) == [2, 1]
    assert sh._auto_choice([10 * M, 40 * M, 10 * M, 10 * M], [80, 320, 80, 80], 100 * M, 250) == [3, 2, 0]
    assert sh._auto_choice([40 * M, 10 * M, 10 * M, 10 * M], [320, 80, 80, 80], 15 * M, 200) == [3, 2]
    # ...and a small one before the gap moves, one past it stays
    assert sh._auto_choice([M, M - 1, 40 * M, 10, M], [8, 8, 320, 8, 8], 100 * M, 200) == [4, 3, 0]
    # how many are late: the tail's share without a window (B0 = B)...
    assert sh._auto_late(1000, 0.3, 0.1) == (250, 0.3)
    assert sh._auto_late(1000, 0.3, 0.0005) == (0, 0.3)
    # ...and with one, a backward held back to the daemon's pace (B 0.75 s, a
    # forward of 0.1 s: B0 = 0.2 s) leaves late what it could not do in B0
    assert sh._auto_late(1000, 0.75, 0.01, fwd=0.1) == (1000 - int(1000 * 0.2 / 0.76), 0.2)
    assert sh._auto_late(1000, 0.3, 0.1, fwd=0.2) == (250, 0.3)    # not held back: as without a window
    # another probe while a probe moved state and more than 1% were late, at most _AUTO_ROUNDS
    assert sh._auto_again(late=20, offloaded=1000, moved=10, rounds=1)
    assert not sh._auto_again(late=10, offloaded=1000, moved=10, rounds=1)     # 1%: close enough
    assert not sh._auto_again(late=500, offloaded=1000, moved=0, rounds=1)     # nothing fits: no use
    assert not sh._auto_again(late=500, offloaded=1000, moved=10, rounds=sh._AUTO_ROUNDS)
    _PROBE = sh._AUTO_PROBE_STEP
    # A compiled model's probe ends F at its last in-graph wait (aoq::wait_params) before the
    # first final push, as an eager model's at its last forward pre-hook.
    torch._dynamo.reset()
    m3 = make_model(W, DEV)
    opt = aoq_opt(m3, gpu_state_budget="auto", staging_window=1 << 20)
    marks = []
    real_wig = opt._wait_in_graph

    def wig(params, originals):
        before = opt._probe_fwd_last
        real_wig(params, originals)
        if opt._probe_fwd is not None and opt._push_log == []:
            marks.append(opt._probe_fwd_last is not before)     # this wait marked
    opt._wait_in_graph = wig
    loop_compiled(torch.compile(m3, backend="aot_eager"), m3, opt, _PROBE)
    assert marks and all(marks), marks
    assert opt.auto_split is not None and opt.auto_split["forward_seconds"] is not None, opt.auto_split
    opt.close()
    torch._dynamo.reset()
    # The delayed update holds backward back as a window does (a tensor's push waits for
    # its previous update's answer), so its probes time the forward too.
    m4 = make_model(W, DEV)
    opt = aoq_opt(m4, gpu_state_budget="auto", delayed_update=True)
    loop(m4, opt, _PROBE)
    assert opt.auto_split is not None and opt.auto_split["forward_seconds"] is not None, opt.auto_split
    opt.close()
    # ...and the moves of the chosen state out of aoqd at the probe steps (3, then 5: the
    # second probe still finds some late), training on equal to AdamW
    m1 = make_model(W, DEV)
    loop(m1, torch.optim.AdamW(trainable(m1), lr=1e-2), STEPS + 2)
    m2 = make_model(W, DEV)
    big = [p for p in trainable(m2) if p.numel() >= 4096]
    # (with a staging window, which makes the probes time the forward too)
    opt = aoq_opt(m2, gpu_state_budget="auto", staging_window=1 << 20)
    assert opt._share is None
    real_choice, real_late = sh._auto_choice, sh._auto_late
    probes, fwds = [], []

    def late(total, span, tail, fwd=None):
        probes.append((opt._nstep, total))
        fwds.append(fwd)
        return (total if len(probes) < 3 else 0), span     # late after probes 1 and 2, none after 3

    sh._auto_choice = lambda numels, costs, late, cap: [len(numels) - 1] if late else []    # the last pushed one
    sh._auto_late = late
    try:
        loop(m2, opt, STEPS + 2)
    finally:
        sh._auto_choice, sh._auto_late = real_choice, real_late
    opt.synchronize()
    total = sum(p.numel() for p in big)
    assert probes == [(3, total), (5, total - big[0].numel()),
                      (7, total - big[0].numel() - big[1].numel())], probes
    assert opt.auto_split["rounds"] == 3 and opt._auto_probe is None, opt.auto_split
    # F: the forward's start to its last module's start, before the first final push
    assert len(fwds) == 3 and all(f is not None and f > 0 for f in fwds), fwds
    assert opt._probe_fwd is None and opt._probe_fwd_last is None
    assert opt._share is not None and opt._share.params == big[:2], opt.auto_split
    assert opt.auto_split["device_params"] == big[0].numel() + big[1].numel(), opt.auto_split
    assert all(p not in opt._slot_of for p in big[:2]) and len(opt._slots) == len(big) - 2
    same(m2, m1, "gpu_state_budget='auto': state moved to the device after two probe steps")
    sd = opt.state_dict()
    assert sorted(sd["state"]) == trained, ("state_dict after the moves", sorted(sd["state"]), trained)
    pos = opt._positions()
    for p in big[:2]:
        assert float(sd["state"][next(i for i, q in enumerate(pos) if q is p)]["step"]) == STEPS + 2
    opt.close()
    try:
        aoq_opt(make_model(W, DEV), gpu_state_budget="lots")
    except ValueError as e:
        assert "gpu_state_budget" in str(e), e
    else:
        raise AssertionError("gpu_state_budget='lots' accepted")
    print("ok: gpu_state_budget")


def case_two_optimizers():
    """Two optimizers in one process without job= (a GAN's generator and
    discriminator): two sessions, torch-PID and torch-PID-2, stepped in
    turn; each model ends equal to the same loop under torch's AdamW."""
    models = [make_model(W, DEV, seed=s) for s in (0, 1)]
    refs = [make_model(W, DEV, seed=s) for s in (0, 1)]
    env_job = os.environ.pop("AOQ_JOB", None)
    try:
        opts = [aoq_opt(m) for m in models]
    finally:
        if env_job is not None:
            os.environ["AOQ_JOB"] = env_job
    assert opts[0].job != opts[1].job, (opts[0].job, opts[1].job)
    assert opts[0].job.startswith("torch-%d" % os.getpid()), opts[0].job
    ropts = [torch.optim.AdamW(trainable(m), lr=1e-2) for m in refs]
    data = batches(8, DEV)
    for i in range(STEPS):
        x, y = data[i % len(data)]
        for m, opt in list(zip(models, opts)) + list(zip(refs, ropts)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    for k, opt in enumerate(opts):
        opt.synchronize()
        same(models[k], refs[k], "optimizer %d of two (%s)" % (k, opt.job))
        opt.close()
    print("ok: two optimizers in one process, jobs %s and %s, each equal to torch AdamW"
          % (opts[0].job, opts[1].job))


def case_master_param():
    """A bf16 model with master_dtype="bf16": aoqd shares each master, which
    is then the parameter (docs/decisions.md, "The master is the parameter").  After
    every step each offloaded parameter equals its master in state_dict()
    bit for bit, and the model equals the same loop on a daemon with
    master_param = no (the parameter written to the arena) bit for bit.  With
    delayed_update=True too: there each parameter is the master of the step
    before, and after flush() the master itself."""
    import re
    import tempfile
    for delayed in (False, True):
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            conf = os.path.join(tmp, "off.conf")
            with open(conf, "w") as f:
                f.write("master_param = no\n")
            with aoq.Daemon(threads=2, args=["--config", conf]) as off:
                for sock in (SOCKET, off.socket):
                    m = make_model(W, DEV).to(torch.bfloat16)
                    o = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, socket=sock, lr=1e-2,
                                         master_dtype="bf16", seed=1234, delayed_update=delayed)
                    data = batches(8, DEV)
                    params = list(m.parameters())    # state_dict's keys: positions among them
                    big = [k for k, p in enumerate(params) if p.requires_grad and p.numel() >= 4096]
                    assert big, "no parameter is offloaded"
                    prev = {k: params[k].detach().float().clone() for k in big}
                    for i in range(STEPS):
                        x, y = data[i % len(data)]
                        torch.nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y).backward()
                        o.step()
                        o.zero_grad()
                        o.synchronize()
                        if delayed and i == STEPS - 1:
                            o.flush()
                        lag = delayed and i < STEPS - 1
                        st = o.state_dict()["state"]
                        for k in big:
                            master = st[k]["master"].to(params[k].device).float()  # bf16 values exactly
                            p = params[k]
                            assert torch.equal(p.detach().float(), prev[k] if lag else master), \
                                "step %d parameter %d is not its master%s" % (i, k, " of the step before" if lag else "")
                            prev[k] = master
                    runs.append([p.detach().clone() for p in m.parameters()])
                    o.close()
                log = off.log_text()
        assert "masters shared 0 bytes" in log, log[-2000:]
        assert re.search(r"masters shared [1-9]", DAEMON.log_text()), "the default daemon shared no masters"
        for k, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                "delayed %s, parameter %d: master_param yes and no differ (max |d| %g)" % (
                    delayed, k, (a.float() - b.float()).abs().max())
        print("ok: bf16 model, bf16 master%s: every offloaded parameter is its master%s, the same bits as with "
              "master_param = no" % (", delayed update" if delayed else "", " (of the step before)" if delayed else ""))


def bf16_rounding(master, half_away):
    """The bf16 parameter a split master holds (kernels/README.md): an fp32
    master's rounding to nearest even, a 24-bit master's half away from
    zero (the top of its bits + 0x8000)."""
    if not half_away:
        return master.to(torch.bfloat16)
    b = master.contiguous().view(torch.int32).to(torch.int64)
    hi = ((b + 0x8000) >> 16) & 0xFFFF
    return hi.to(torch.int32).to(torch.int16).view(torch.bfloat16)   # low 16 bits as the bf16 pattern


def state_dict_round_trip(master, pdt, prec):
    """Trains a small model 4 steps with master_dtype=master and
    state_precision=prec on pdt parameters; state_dict() must hold fp32
    moments and, where aoqd splits the master (bf16 parameters, q8 or
    q4), an fp32 master whose bf16 rounding is the parameter (a 24-bit
    one: its low 8 bits zero); loaded into a second optimizer with the
    same seed it reads back bit for bit (every value read is its own
    nearest code) and both train 3 more steps to the same parameters bit
    for bit."""
    runs = []
    what = "%s master, %s moments, %s parameters" % (master, prec, str(pdt).split(".")[-1])
    for k in range(2):
        m = make_model(W, DEV).to(pdt)
        o = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, socket=SOCKET, lr=1e-2,
                             master_dtype=master, state_precision=prec, seed=99)
        assert o.state_precision == prec and o.master_dtype == master, (o.state_precision, o.master_dtype)
        data = batches(8, DEV)
        dt = pdt

        def train(first, n, m=m, o=o, data=data, dt=dt):    # this run's model and optimizer
            for i in range(first, first + n):
                x, y = data[i % len(data)]
                torch.nn.functional.mse_loss(m(x.to(dt)).float(), y).backward()
                o.step()
                o.zero_grad()
            o.synchronize()
        if k == 0:
            train(0, 4)
            sd = saved(o.state_dict())
            model_sd = {n_: t.clone() for n_, t in m.state_dict().items()}
            if master != "bf16" and pdt == torch.bfloat16:
                # the split master: fp32 in state_dict(), the parameter its
                # rounding (parameters the daemon steps; the rest have no master)
                split = 0
                for i, p_ in enumerate(m.parameters()):
                    mst = sd["state"].get(i, {}).get("master")
                    if mst is None:
                        continue
                    split += 1
                    assert mst.dtype == torch.float32, mst.dtype
                    assert torch.equal(bf16_rounding(mst, master == "bf24").reshape(p_.shape).cpu(),
                                       p_.detach().cpu()), "%s: the parameter %d is not the master's rounding" % (
                                           what, i)
                    assert not torch.equal(mst, mst.to(torch.bfloat16).float()), "%s: master %d: no low half kept" % (
                        what, i)
                    low = mst.view(torch.int32) & 0xFF
                    assert (master == "bf24") == bool((low == 0).all()), \
                        "%s: master %d: %d of %d values with low 8 bits" % (what, i, int((low != 0).sum()), low.numel())
                assert split > 0, "%s: no master in state_dict()" % what
        else:
            m.load_state_dict(model_sd)
            o.load_state_dict(sd)
            back = o.state_dict()["state"]
            for i, st in sd["state"].items():
                for key in ("exp_avg", "exp_avg_sq", "master"):
                    if key in st:
                        assert torch.equal(back[i][key], st[key]), "%s: %s of %d changed on load" % (what, key, i)
            o0 = runs[0][1]
            train(4, 3)
            o0_m = runs[0][0]
            runs[0][2](4, 3)
            for a, b in zip(o0_m.parameters(), m.parameters()):
                assert torch.equal(a.detach().float(), b.detach().float()), \
                    "%s: the loaded optimizer trains differently" % what
            o0.close()
            o.close()
        runs.append((m, o, train))
    print("ok: %s: state_dict round trip bit for bit, then the same training" % what)


def case_q4():
    """state_precision="q4" (kernels/README.md, "q4 moments") with an fp32
    master (fp32 parameters; bf16 parameters, where aoqd splits the master:
    kernels/README.md, "The split master"), with the 24-bit master and with
    a bf16 master: state_dict_round_trip."""
    for master, pdt in (("fp32", torch.float32), ("fp32", torch.bfloat16), ("bf24", torch.bfloat16),
                        ("bf16", torch.bfloat16)):
        state_dict_round_trip(master, pdt, "q4")


def case_bf24():
    """master_dtype="bf24" (docs/python.md, "The 24-bit master"): q8
    moments unless told; with bf16 parameters state_dict_round_trip (the
    master's low 8 bits zero, the parameter its rounding half away from
    zero); with fp32 parameters the master stays fp32 and the step is the
    fp32 master's bit for bit; it trains a bf16 model as the fp32 master
    does (the same loss within 2% after 30 steps); and the arguments it
    does not take are refused."""
    m = make_model(W, DEV).to(torch.bfloat16)
    o = OffloadOptimizer(m.parameters(), torch.optim.AdamW, socket=SOCKET, master_dtype="bf24")
    assert (o.master_dtype, o.state_precision) == ("bf24", "q8"), (o.master_dtype, o.state_precision)
    o.close()
    state_dict_round_trip("bf24", torch.bfloat16, "q8")
    # fp32 parameters: not split, so an fp32 master, as master_dtype="fp32"
    outs = []
    for master in ("fp32", "bf24"):
        torch.manual_seed(5)
        m = make_model(W, DEV)
        o = OffloadOptimizer(m.parameters(), torch.optim.AdamW, socket=SOCKET, lr=1e-2, master_dtype=master,
                             state_precision="q8", seed=7)
        for x, y in batches(4, DEV):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        o.synchronize()
        outs.append([p.detach().clone() for p in m.parameters()])
        o.close()
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "bf24 with fp32 parameters is not the fp32 master's step"
    # trains as the fp32 master does
    losses = {}
    for master in ("fp32", "bf24"):
        torch.manual_seed(6)
        m = make_model(W, DEV).to(torch.bfloat16)
        o = OffloadOptimizer(m.parameters(), torch.optim.AdamW, socket=SOCKET, lr=3e-3, master_dtype=master, seed=3)
        data = batches(8, DEV)
        tail = []
        for i in range(30):
            x, y = data[i % len(data)]
            loss = torch.nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            o.step()
            o.zero_grad()
            if i >= 25:
                tail.append(float(loss.detach()))
        o.close()
        losses[master] = sum(tail) / len(tail)
    rel = losses["bf24"] / losses["fp32"] - 1
    assert abs(rel) < 0.02, "bf24 %.6g against the fp32 master's %.6g" % (losses["bf24"], losses["fp32"])
    m = make_model(W, DEV).to(torch.bfloat16)
    for kw, what in ((dict(state_precision="fp32"), "q8 or q4"), (dict(state_precision="bf16"), "q8 or q4"),
                     (dict(optimizer_class=torch.optim.SGD), "Adam and AdamW")):
        cls = kw.pop("optimizer_class", torch.optim.AdamW)
        try:
            OffloadOptimizer(m.parameters(), cls, socket=SOCKET, lr=1e-2, master_dtype="bf24", **kw)
        except ValueError as e:
            assert what in str(e), e
        else:
            raise AssertionError("master_dtype='bf24' with %r was taken" % (kw or cls,))
    print("ok: master_dtype='bf24': q8 by default, fp32 parameters keep the fp32 master's step, the loss of 30 "
          "steps %+.2f%% from the fp32 master's, its bad arguments refused" % (100 * rel))


def case_exit():
    """A script that ends with optimizers alive in its globals (closed or
    not) exits quietly: their __del__ runs while the interpreter clears
    the modules' globals, and must not print "Exception ignored"."""
    import subprocess
    code = ("import sys, torch, aoq, aoq.torch as at\n"
            "m = torch.nn.Linear(8, 8)\n"
            "opt = at.OffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3, socket=sys.argv[1])\n"
            "m(torch.randn(2, 8)).sum().backward(); opt.step()\n"
            "opt2 = at.OffloadOptimizer(torch.nn.Linear(4, 4).parameters(), torch.optim.AdamW, socket=sys.argv[1])\n"
            "opt.close()\n")
    r = subprocess.run([sys.executable, "-c", code, SOCKET], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, \
        ("a script with live optimizers at exit", r.returncode, r.stderr[-2000:])
    print("ok: interpreter exit with optimizers alive, closed and not: nothing printed")


CASES = {"grad-edits": case_grad_edits, "import-swap": case_import_swap, "other-classes": case_other_classes,
         "reads-after-step": case_reads_after_step, "checkpoints": case_checkpoints, "dcp": case_dcp, "add-param-group": case_add_param_group,
         "errors": case_errors, "gpu-share": case_gpu_share, "two-optimizers": case_two_optimizers,
         "master-param": case_master_param, "q4": case_q4, "bf24": case_bf24, "exit": case_exit}
DEFAULT = list(CASES)


def main():
    global SOCKET, DAEMON, DEV
    torch.set_num_threads(1)
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", help="cpu (CI) or cuda:N")
    ap.add_argument("--cases", default=os.environ.get("AOQ_TORCH_CASES"),
                    help="cases separated by commas (default: all): " + ", ".join(CASES))
    a = ap.parse_args()
    DEV = a.device
    if torch.device(DEV).type == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    names = a.cases.split(",") if a.cases else DEFAULT
    with aoq.Daemon(threads=2) as d:
        SOCKET, DAEMON = d.socket, d
        for n in names:
            try:
                CASES[n]()
            except Exception:
                traceback.print_exc()
                print(d.log_text()[-3000:])
                print("FAIL: case %s" % n)
                return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
