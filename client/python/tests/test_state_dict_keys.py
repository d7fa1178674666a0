#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""OffloadOptimizer.state_dict()'s keys are what README.md and docs/python.md
say: torch's form, state and param_groups' "params" keyed by position over
the groups (0, 1, ... as torch numbers them), the parameter names in
sd["aoq"]["names"], one per position.  Checked against the real state_dict
of an optimizer given named parameters in two groups, with one parameter
stepped on the device (below minimal_size), after a few steps on a private
aoqd; then torch.optim.AdamW loads it as it is and each position's state is
its parameter's (shape, step, exp_avg equal to the daemon's).  Also checks
that the two documents state that key form.
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
import os
import sys
import traceback

from testenv import HERE, require_torch  # sets sys.path: this folder and the package

torch = require_torch()
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402

ROOT = os.path.join(HERE, "..", "..", "..")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def check_docs():
    """Both documents give the positional form and sd["aoq"]["names"]."""
    for rel in ("README.md", "docs/python.md"):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = " ".join(f.read().split())
        assert "keyed by parameter name" not in text, "%s says state_dict() is keyed by parameter name" % rel
        assert "keyed by position" in text, "%s does not say state_dict() is keyed by position" % rel
        assert '["aoq"]["names"]' in text, '%s does not name sd["aoq"]["names"]' % rel


def main():
    check_docs()
    m = model()
    named = list(m.named_parameters())
    # Two groups in an order other than the model's: the positions follow
    # the groups, the names stay the parameters'.
    g0 = [named[2], named[3]]     # 2.weight (4x32), 2.bias (4: below minimal_size, on the device)
    g1 = [named[0], named[1]]     # 0.weight, 0.bias
    order = [n for n, _ in g0 + g1]
    params = {n: p for n, p in named}
    with aoq.Daemon(threads=1) as d:
        opt = OffloadOptimizer([{"params": g0, "lr": 1e-2}, {"params": g1, "lr": 3e-3}], torch.optim.AdamW,
                               socket=d.socket, minimal_size=8, weight_decay=0.01)
        x = torch.randn(8, 16)
        y = torch.randn(8, 4)
        for _ in range(3):
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()

        n = len(order)
        assert sorted(sd["state"].keys()) == list(range(n)), "state keys %r, want positions 0..%d" % (
            sorted(sd["state"].keys(), key=repr), n - 1)
        assert all(type(k) is int for k in sd["state"]), "state keys are not ints: %r" % list(sd["state"])
        got = [list(g["params"]) for g in sd["param_groups"]]
        assert got == [[0, 1], [2, 3]], "param_groups' params %r, want [[0, 1], [2, 3]]" % got
        assert [g["lr"] for g in sd["param_groups"]] == [1e-2, 3e-3], "group lrs %r" % sd["param_groups"]
        names = sd["aoq"]["names"]
        assert names == order, "sd['aoq']['names'] %r, want %r" % (names, order)
        for i, name in enumerate(names):
            st = sd["state"][i]
            p = params[name]
            for k in ("exp_avg", "exp_avg_sq"):
                assert st[k].shape == p.shape, "position %d (%s): %s shape %s, parameter %s" % (
                    i, name, k, tuple(st[k].shape), tuple(p.shape))
            assert float(st["step"]) == 3.0, "position %d (%s): step %r" % (i, name, st["step"])
            # A daemon-stepped parameter's master is the parameter (fp32).
            if "master" in st:
                assert torch.equal(st["master"], p.detach()), "position %d (%s): master is not the parameter" % (
                    i, name)
        assert "master" not in sd["state"][1], "2.bias (4 elements) should be stepped on the device"
        assert "master" in sd["state"][0], "2.weight should be stepped in aoqd"

        # torch.optim.AdamW given the same groups loads it as it is: each
        # position's state lands on that position's parameter.
        ref = torch.optim.AdamW([{"params": [p for _, p in g0], "lr": 1e-2},
                                 {"params": [p for _, p in g1], "lr": 3e-3}], weight_decay=0.01)
        ref.load_state_dict(sd)
        for i, name in enumerate(names):
            st = ref.state[params[name]]
            assert torch.equal(st["exp_avg"], sd["state"][i]["exp_avg"]), "AdamW: %s's exp_avg is not position %d's" % (
                name, i)
        opt.close()
    print("ok: state_dict keyed by position 0..%d over the groups, names in sd['aoq']['names'], AdamW loads it" %
          (n - 1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        print("FAIL")
        sys.exit(1)
