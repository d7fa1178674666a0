#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Lease and resume (README): a trainer process trains STEPS1 steps through
OffloadOptimizer, pushes some gradients of the next step and dies
(os._exit, no goodbye); constructing OffloadOptimizer again with the same
job resumes (a warning naming the step), the model's parameters become the
daemon's, state_dict's steps are the resumed ones, and training on to
STEPS equals torch.optim.AdamW run without interruption (assert_close).
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
import os
import subprocess
import sys
import warnings

from testenv import exit_with, require_torch  # sets sys.path: this folder and the package

torch = require_torch()
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402
from torch_cases import batches, make_model, same  # noqa: E402

W = 256
STEPS1 = 5
STEPS = 12
KW = dict(lr=3e-3, weight_decay=0.01, minimal_size=1)


def run(model, opt, start, stop):
    data = batches(8, "cpu")
    for i in range(start, stop):
        x, y = data[i % len(data)]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def first_trainer(socket):
    """The process that dies: STEPS1 steps, then a backward (its gradients
    stream to aoqd) and no step(): the interrupted step."""
    model = make_model(W, "cpu")
    opt = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, socket=socket, job="resume", **KW)
    run(model, opt, 0, STEPS1)
    opt.synchronize()
    x, y = batches(8, "cpu")[STEPS1 % 8]
    torch.nn.functional.mse_loss(model(x), y).backward()   # pushes every gradient of step STEPS1 + 1
    os._exit(0)   # no goodbye: the lease keeps the state


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--first":
        first_trainer(sys.argv[2])
        return 0
    with aoq.Daemon(threads=2) as d:
        env = dict(os.environ)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--first", d.socket], env=env)
        assert r.returncode == 0, "the first trainer failed (%d)" % r.returncode
        # Other initial values of the trained parameters: the resumed ones
        # must come from aoqd.
        model = make_model(W, "cpu")
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1.0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, socket=d.socket, job="resume", **KW)
        msgs = [str(x.message) for x in w if "resumed" in str(x.message)]
        assert len(msgs) == 1 and "resumed job resume rank 0 at step %d from aoqd" % STEPS1 in msgs[0], msgs
        assert opt.resumed_step == STEPS1, opt.resumed_step
        steps = {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
        assert steps and all(v == STEPS1 for v in steps.values()), steps
        ref = make_model(W, "cpu")
        ropt = torch.optim.AdamW(ref.parameters(), **{k: v for k, v in KW.items() if k != "minimal_size"})
        run(ref, ropt, 0, STEPS1)
        same(model, ref, "parameters after resume (step %d)" % STEPS1, rtol=1e-5, atol=1e-6)
        run(model, opt, STEPS1, STEPS)
        run(ref, ropt, STEPS1, STEPS)
        opt.synchronize()
        same(model, ref, "resumed run vs torch AdamW without interruption (%d steps)" % STEPS, rtol=1e-5, atol=1e-6)
        steps = {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
        assert all(v == STEPS for v in steps.values()), steps
        opt.close() if hasattr(opt, "close") else None
    print("ok")
    return 0


if __name__ == "__main__":
    exit_with(main)
