# SPDX-License-Identifier: MIT
"""OffloadOptimizer correctness cases, shared by the CI test on the CPU
(client/python/tests/test_torch.py) and the GPU tests (tests/gpu/python/).

Each case trains a model with aoq.torch.OffloadOptimizer and the same model
with torch.optim.AdamW on the same device, same data, and compares the
parameters with torch.testing.assert_close (default tolerances for fp32).
"""
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from aoq.torch import OffloadOptimizer  # noqa: E402


def make_model(width, device, seed=0):
    """Linear(32->width) -> Linear(width->64, frozen) -> Linear(64->64) -> Linear(64->128)."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 64),
                            torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 128))
    m[2].requires_grad_(False)
    return m.to(device)


def batches(n, device, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g).to(device), torch.randn(batch, 128, generator=g).to(device))
            for _ in range(n)]


def train(model, opt, data, steps, accum=1, sched=None, autocast=None, fwd=None, clip=None, start=0):
    fwd = fwd or model
    losses = []
    for i in range(start, start + steps):
        for k in range(accum):
            x, y = data[(i * accum + k) % len(data)]
            if autocast is not None:
                with torch.autocast(device_type=x.device.type, dtype=autocast):
                    loss = torch.nn.functional.mse_loss(fwd(x).float(), y)
            else:
                loss = torch.nn.functional.mse_loss(fwd(x), y)
            (loss / accum).backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def reference(width, device, steps, accum=1, lr=1e-3, clip=None, autocast=None, compile_=False, wd=0.01):
    m = make_model(width, device)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    fwd = torch.compile(m) if compile_ else m
    train(m, opt, batches(8, device), steps, accum, sched, autocast=autocast, fwd=fwd, clip=clip)
    return m


def offloaded(width, device, steps, accum=1, lr=1e-3, socket=None, attach=False, autocast=None, compile_=False,
              wd=0.01, **kw):
    m = make_model(width, device)
    opt = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, lr=lr, weight_decay=wd, socket=socket, **kw)
    if attach:
        opt.attach(m)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    fwd = torch.compile(m) if compile_ else m
    train(m, opt, batches(8, device), steps, accum, sched, autocast=autocast, fwd=fwd)
    opt.synchronize()
    opt.close()
    return m


def same(a, b, what, exact=False, **tol):
    """assert_close on every parameter (exact: bit for bit); prints how many
    elements differ at all."""
    ndiff = nall = 0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        x, y = p.detach().float().cpu(), q.detach().float().cpu()
        ndiff += int((x != y).sum())
        nall += x.numel()
        try:
            torch.testing.assert_close(x, y, **(dict(rtol=0, atol=0) if exact else tol))
        except AssertionError as e:
            raise AssertionError("%s: parameter %s differs:\n%s" % (what, n, e)) from None
    print("ok: %s (%d of %d elements not bit-identical)" % (what, ndiff, nall))


def run_cases(device, width, socket, cases=None, steps=10):
    """The correctness cases on `device`; raises on the first failure."""
    want = set(cases or ["basic", "accum", "offload", "offload-explicit", "attach", "framework", "adam-groups",
                         "clip", "autocast", "compile"])
    ref = reference(width, device, steps)
    # On CUDA the daemon's fp32 update is torch's foreach AdamW rounding for
    # rounding (kernels/README.md, "Numerics"): the plain case must be exact.
    cuda = torch.device(device).type == "cuda"
    if "basic" in want:
        same(offloaded(width, device, steps, socket=socket), ref, "AdamW + CosineAnnealingLR, %d steps" % steps,
             exact=cuda)
    if "attach" in want:
        same(offloaded(width, device, steps, socket=socket, attach=True), ref, "with attach(model)")
    if "framework" in want:
        same(offloaded(width, device, steps, socket=socket, copy_mode="framework"), ref, "framework-copy mode")
    if "accum" in want or "offload" in want or "offload-explicit" in want:
        ref2 = reference(width, device, steps, accum=2)
        if "accum" in want:
            same(offloaded(width, device, steps, accum=2, socket=socket), ref2, "gradient accumulation 2")
        if "offload" in want:
            same(offloaded(width, device, steps, accum=2, socket=socket, offload_gradients=True), ref2,
                 "accumulation 2 with offload_gradients")
            same(offloaded(width, device, steps, socket=socket, offload_gradients=True), ref,
                 "offload_gradients without accumulation")
        if "offload-explicit" in want:
            same(offloaded(width, device, steps, accum=2, socket=socket, offload_gradients=True,
                           grad_accumulation_steps=2, attach=True), ref2,
                 "accumulation 2, offload_gradients, grad_accumulation_steps=2, attach")
    if "adam-groups" in want:
        adam_groups(width, device, socket, steps)
    if "window" in want:
        window_case(device, socket)
    if "clip" in want:
        same(offloaded(width, device, steps, socket=socket, max_grad_norm=0.05),
             reference(width, device, steps, clip=0.05), "max_grad_norm 0.05 in the daemon")
    if "autocast" in want and device != "cpu":
        same(offloaded(width, device, steps, socket=socket, autocast=torch.bfloat16),
             reference(width, device, steps, autocast=torch.bfloat16), "bf16 autocast")
    if "autocast-cpu" in want:
        # Under autocast the weights are cast to bf16 for every matmul.  torch's
        # CPU AdamW does not round like its CUDA one (which aoq follows): an
        # fp32 ulp of difference can flip a bf16 rounding and the gradient by
        # a bf16 ulp, so the defaults are loosened to bf16 scale.
        same(offloaded(width, device, steps, socket=socket, autocast=torch.bfloat16),
             reference(width, device, steps, autocast=torch.bfloat16), "bf16 autocast (CPU)", rtol=1e-2, atol=1e-4)
    if "compile" in want:
        same(offloaded(width, device, steps, socket=socket, compile_=True),
             reference(width, device, steps, compile_=True), "torch.compile")


def arena_bytes():
    """Bytes of aoq arenas this process maps (libaoq maps the session's
    arena memfd, named "aoq-arena", whole)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:aoq-arena" in line:
                a, b = line.split()[0].split("-")
                total += int(b, 16) - int(a, 16)
    return total


def window_case(device, socket, steps=6):
    """staging_window smaller than the model: 16 layers of 256x256 (8 MiB of
    gradients and parameters) through a 1 MiB window of two slots, so every
    step reuses each slot eight times.  Equals torch AdamW, and the arena
    (what the session pins on the host) stays near the window; the default
    picks the window once the model passes STAGING_BUDGET."""
    import aoq.torch as at

    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(16)]).to(device)

    data = [(torch.randn(8, 256, generator=torch.Generator().manual_seed(i)).to(device),
             torch.randn(8, 256, generator=torch.Generator().manual_seed(100 + i)).to(device)) for i in range(4)]
    ref = model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    train(ref, ropt, data, steps)
    model_bytes = sum(2 * p.numel() * 4 for p in ref.parameters())
    xfer = 4 * 256 * 256  # the transfer area holds the biggest tensor in fp32
    for what, kw, budget in (("staging_window=1 MiB", dict(staging_window=1 << 20), None),
                             ("default window past STAGING_BUDGET", {}, 1 << 20)):
        old = at.STAGING_BUDGET
        if budget is not None:
            at.STAGING_BUDGET = budget
        try:
            m = model()
            before = arena_bytes()
            opt = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01,
                                   socket=socket, **kw)
            arena = arena_bytes() - before
        finally:
            at.STAGING_BUDGET = old
        if opt.staging_window != 1 << 20:
            raise AssertionError("%s: staging_window %r, want 1 MiB" % (what, opt.staging_window))
        if not (0 < arena <= (1 << 20) + xfer + (64 << 10)) or arena >= model_bytes:
            raise AssertionError("%s: the arena is %d bytes; want at most the window + transfer area + 64 KiB "
                                 "(%d) and less than the model's %d" % (what, arena, (1 << 20) + xfer + (64 << 10),
                                                                       model_bytes))
        train(m, opt, data, steps)
        opt.synchronize()
        opt.close()
        same(m, ref, "%s (arena %d bytes, model %d)" % (what, arena, model_bytes))
    small = OffloadOptimizer(model().named_parameters(), torch.optim.AdamW, socket=socket)
    if small.staging_window != 0:
        raise AssertionError("an 8 MiB model under the 1 GiB budget: staging_window %r, want 0"
                             % small.staging_window)
    small.close()
    print("ok: staging window")


def adam_groups(width, device, socket, steps):
    """torch.optim.Adam, two groups with their own lr/wd, small tensors on the device."""
    def build(cls, **kw):
        m = make_model(width, device)
        named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        groups = [{"params": [x for x in named if x[0].startswith("0.")], "lr": 3e-3},
                  {"params": [x for x in named if not x[0].startswith("0.")], "weight_decay": 0.1}]
        if cls is OffloadOptimizer:
            opt = OffloadOptimizer(groups, torch.optim.Adam, lr=1e-3, betas=(0.8, 0.95), socket=socket, **kw)
        else:
            opt = torch.optim.Adam([{**g, "params": [p for _, p in g["params"]]} for g in groups], lr=1e-3,
                                   betas=(0.8, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
        train(m, opt, batches(8, device), steps, 1, sched)
        if cls is OffloadOptimizer:
            opt.close()
        return m
    same(build(OffloadOptimizer, minimal_size=100), build(torch.optim.Adam), "Adam, 2 groups, StepLR")


def resume_child(path, width, device, socket, steps, phase):
    """In a fresh process: phase 'save' trains `steps` and saves model +
    optimizer; phase 'load' loads them into a new daemon session and trains
    `steps` more, then saves the model."""
    m = make_model(width, device)
    opt = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01, socket=socket,
                           offload_gradients=True, job="resume-%s" % phase)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * steps)
    data = batches(8, device)
    start = 0
    if phase == "load":
        ck = torch.load(path, weights_only=False)
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = steps
    train(m, opt, data, steps, 1, sched, start=start)
    opt.synchronize()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    opt.close()


def resume_case(width, device, steps, daemon_factory):
    """save after `steps` -> load in a new process and daemon -> `steps` more
    == 2*steps uninterrupted (AdamW on the device)."""
    m = make_model(width, device)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * steps)
    train(m, opt, batches(8, device), 2 * steps, 1, sched)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck.pt")
        for phase in ("save", "load"):
            with daemon_factory() as d:
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "resume-child", path, str(width),
                                    device, d.socket, str(steps), phase])
                if r.returncode != 0:
                    print(d.log_text()[-2000:])
                    raise AssertionError("resume child (%s) failed with %d" % (phase, r.returncode))
        ck = torch.load(path, weights_only=False)
        m2 = make_model(width, device)
        m2.load_state_dict(ck["model"])
        # the optimizer state after load + 3 steps matches the uninterrupted one
        for i, (n, p) in enumerate(m.named_parameters()):   # state_dict keys: positions, as torch's
            if p.requires_grad and p.numel() >= 4096:
                assert ck["opt"]["aoq"]["names"][i] == n
                st = ck["opt"]["state"][i]
                torch.testing.assert_close(st["exp_avg"].to(p.device), opt.state[p]["exp_avg"])
                torch.testing.assert_close(st["exp_avg_sq"].to(p.device), opt.state[p]["exp_avg_sq"])
                torch.testing.assert_close(st["master"].to(p.device), p.detach())
                assert float(st["step"]) == float(opt.state[p]["step"]), n
    same(m2, m, "save after %d steps, load in a new process and daemon, %d more" % (steps, steps))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "resume-child":
    _, _, path, width, device, socket, steps, phase = sys.argv
    resume_child(path, int(width), device, socket, int(steps), phase)
