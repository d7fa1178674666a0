#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""`systemctl restart aoqd.service` under a PyTorch trainer that lives on,
run by tests/ops/unit-ns.sh inside a namespace whose PID 1 is systemd
($AOQ_SOCKET: the unit's socket).  A bf16 model (the default for bf16
parameters: an fp32 master split, its high half the parameter in a
masters memfd, and q8 moments) trains AT steps, backward of the
next one, aoqd restarted: step() raises AoqError, the optimizer built
again with the same job resumes at step AT (one warning each: the resume
and the earlier optimizer closed), and training on ends bit for bit where
an undisturbed run of the same job and seed ends.
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
import os
import subprocess
import warnings

from testenv import exit_with, require_torch  # sets sys.path: this folder and the package

torch = require_torch()
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402

STEPS, AT = 8, 5
KW = dict(lr=1e-3, minimal_size=1, seed=1234, job="unit-restart")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256)).to(torch.bfloat16)


def loss(m, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)
    return torch.nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)


def train(m, o, start, stop):
    for i in range(start, stop):
        loss(m, i).backward()
        o.step()
        o.zero_grad()


def main():
    sock = os.environ.get("AOQ_SOCKET")
    if not sock or not os.environ.get("AOQ_UNIT_LOG"):
        print("runs under tests/ops/unit-ns.sh: skipped")
        return 77
    ref = model()
    o = OffloadOptimizer(ref.named_parameters(), torch.optim.AdamW, **KW)
    train(ref, o, 0, STEPS)
    o.close()   # its state ends: the job starts afresh below

    m = model()
    o = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, **KW)
    assert o.state_precision == "q8" and o.master_dtype == "fp32", (o.state_precision, o.master_dtype)
    train(m, o, 0, AT)
    o.synchronize()
    loss(m, AT).backward()          # step AT + 1's gradients go out
    subprocess.run(["systemctl", "restart", "aoqd.service"], check=True)
    try:
        o.step()
        raise AssertionError("a step went through a restarted aoqd")
    except aoq.AoqError:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        o = OffloadOptimizer(m.named_parameters(), torch.optim.AdamW, **KW)
    msgs = [str(x.message) for x in w]
    assert any("resumed job unit-restart rank 0 at step %d" % AT in x for x in msgs), msgs
    assert any("earlier OffloadOptimizer" in x for x in msgs), msgs
    assert o.resumed_step == AT, o.resumed_step
    o.zero_grad()
    train(m, o, AT, STEPS)
    o.synchronize()
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), "%s differs from the undisturbed run's" % n
    o.close()
    log = open(os.environ["AOQ_UNIT_LOG"]).read()
    assert "taken back from the fd store" in log and "from its snapshot" not in log, log[-2000:]
    print("ok: resumed at step %d after systemctl restart, bit-exact after %d steps" % (AT, STEPS))
    return 0


if __name__ == "__main__":
    exit_with(main)
