#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The optimizer classes aoqd runs besides Adam/AdamW: torch.optim.SGD
(momentum 0 and 0.9, nesterov, dampening, weight decay) and aoq.torch.Lion
through OffloadOptimizer equal torch.optim.SGD / aoq.torch.Lion on the CPU
(user clipping, StepLR), run in the daemon (no fallback warning), and their
state_dict holds torch's keys; aoq.torch.Lion equals a reference Lion; SGD
with maximize=True falls back with a warning.
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
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


def loop(model, opt, steps, edit=None, scaler=None, inject=None, start=0, unscale=True):
    """A plain training loop; edit(model, step) runs between backward and step()."""
    data = batches(8, "cpu")
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


def clip(m, i):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


def trainable(m):
    return [p for p in m.parameters() if p.requires_grad]


class RefLion(torch.optim.Optimizer):
    """Lion written out from the paper's Algorithm 2 / lion-pytorch, in
    double, rounded to the parameter's dtype once per step: the reference
    of aoq.torch.Lion."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            lr, (b1, b2), wd = g["lr"], g["betas"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p, dtype=torch.float64))
                x, gr = p.double(), p.grad.double()
                x = x * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * gr)
                m.copy_(b2 * m + (1 - b2) * gr)
                p.copy_(x)


def case_daemon_classes():
    from aoq.torch import Lion
    # SGD and Lion run in aoqd (no fallback warning); SGD with maximize and
    # RMSprop step host copies with a one-line warning.
    for cls, kw, daemon in ((torch.optim.SGD, dict(lr=1e-2), True),
                            (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), True),
                            (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01), True),
                            (torch.optim.SGD, dict(lr=1e-2, momentum=0.5, dampening=0.3, weight_decay=0.01), True),
                            (Lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), True),
                            (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, maximize=True), False),
                            (torch.optim.RMSprop, dict(lr=1e-3), False)):
        m1 = make_model(W, "cpu")
        o1 = cls(trainable(m1), **kw)
        sched1 = torch.optim.lr_scheduler.StepLR(o1, 3, 0.5)
        m2 = make_model(W, "cpu")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            o2 = OffloadOptimizer(m2.named_parameters(), cls, socket=SOCKET, minimal_size=0, **kw)
        fell_back = any("not offloaded to aoqd" in str(x.message) for x in w)
        assert fell_back != daemon, (cls.__name__, kw, [str(x.message) for x in w])
        assert (o2._client is not None) == daemon, (cls.__name__, kw)
        sched2 = torch.optim.lr_scheduler.StepLR(o2, 3, 0.5)
        for i in range(STEPS):
            loop(m1, o1, 1, clip, start=i)
            sched1.step()
            loop(m2, o2, 1, clip, start=i)
            sched2.step()
        o2.synchronize()   # the daemon's last update lands (otherwise at the next forward)
        same(m2, m1, "%s %s (%s, user clipping, StepLR)" % (cls.__name__, kw, "aoqd" if daemon else "host copies"))
        if daemon:   # the state dict holds torch's keys: momentum_buffer (SGD), exp_avg (Lion)
            sd = o2.state_dict()
            p1 = dict(m1.named_parameters())
            assert len(sd["state"]) == len(trainable(m1))
            for i, ps in sd["state"].items():
                ref = o1.state[p1[sd["aoq"]["names"][i]]]
                if cls is Lion:
                    torch.testing.assert_close(ps["exp_avg"], ref["exp_avg"])
                elif kw.get("momentum"):
                    torch.testing.assert_close(ps["momentum_buffer"], ref["momentum_buffer"])
                    assert "exp_avg_sq" not in ps
                else:
                    assert ps.get("momentum_buffer") is None
        o2.close()
    # torch.optim.SGD's state dict (momentum_buffer, no step) loaded, then
    # continued: equals torch continued
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)
    m1, m2 = make_model(W, "cpu"), make_model(W, "cpu")
    o1 = torch.optim.SGD(trainable(m1), **kw)
    loop(m1, o1, 3)
    m2.load_state_dict(m1.state_dict())
    o2 = OffloadOptimizer([(n, p) for n, p in m2.named_parameters() if p.requires_grad], torch.optim.SGD,
                          socket=SOCKET, minimal_size=0, **kw)
    o2.load_state_dict(o1.state_dict())
    loop(m1, o1, 3, start=3)
    loop(m2, o2, 3, start=3)
    o2.synchronize()
    same(m2, m1, "torch SGD state dict loaded and continued")
    o2.close()
    # aoq.torch.Lion against the reference written out above
    m1, m2 = make_model(W, "cpu"), make_model(W, "cpu")
    o1 = RefLion(trainable(m1), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    o2 = Lion(trainable(m2), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for i in range(STEPS):
        loop(m1, o1, 1, start=i)
        loop(m2, o2, 1, start=i)
    same(m2, m1, "aoq.torch.Lion == reference Lion")
    print("ok: SGD and Lion in the daemon")


def main():
    global SOCKET
    torch.set_num_threads(2)
    with aoq.Daemon(threads=2) as d:
        SOCKET = d.socket
        try:
            case_daemon_classes()
        except Exception:
            traceback.print_exc()
            print(d.log_text()[-3000:])
            print("FAIL")
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
