#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""An OffloadOptimizer built again over the same parameters in the same
process (after its aoqd restarted, or with the earlier one never closed):
the earlier one is closed with a warning, its hooks leave the parameters,
and the new one trains as a fresh optimizer would: no "gradient after its
final push" from the earlier one's hooks, the results torch.optim.AdamW's.

  rebuilt: two optimizers on one aoqd, the second built after two steps of
           the first (left open).
  gone:    the first optimizer's aoqd stopped after two steps, the second
           built on another aoqd.
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
import warnings

from testenv import exit_with, require_torch  # sets sys.path: this folder and the package

torch = require_torch()
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402
from torch_cases import batches, make_model, same  # noqa: E402

W = 128
KW = dict(lr=3e-3, weight_decay=0.01)


def run(model, opt, data, start, stop):
    for i in range(start, stop):
        x, y = data[i % len(data)]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def built_again(socket, job):
    """The second optimizer, with the warning it must give."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, socket=socket, job=job, minimal_size=1,
                               **KW)
    msgs = [str(x.message) for x in w if "earlier OffloadOptimizer" in str(x.message)]
    assert len(msgs) == 1 and "job first" in msgs[0] and "closed" in msgs[0], [str(x.message) for x in w]
    return opt


def check(case, model, opt, first, data):
    assert first._client is None, "%s: the earlier optimizer was not closed" % case
    ref = make_model(W, "cpu")
    ropt = torch.optim.AdamW(ref.parameters(), **KW)
    run(ref, ropt, data, 0, 2)
    ropt = torch.optim.AdamW(ref.parameters(), **KW)    # the second optimizer starts afresh
    run(model, opt, data, 2, 6)
    run(ref, ropt, data, 2, 6)
    opt.synchronize()
    same(model, ref, "%s: four steps of the optimizer built again vs torch AdamW" % case, rtol=1e-4, atol=2e-5)
    opt.close()
    print("%s: ok" % case)


def main():
    global model
    data = batches(8, "cpu")
    with aoq.Daemon(threads=2) as d:
        model = make_model(W, "cpu")
        first = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, socket=d.socket, job="first",
                                 minimal_size=1, **KW)
        run(model, first, data, 0, 2)
        first.synchronize()
        check("rebuilt", model, built_again(d.socket, "second"), first, data)

    d = aoq.Daemon(threads=2)
    model = make_model(W, "cpu")
    first = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, socket=d.socket, job="first",
                             minimal_size=1, **KW)
    run(model, first, data, 0, 2)
    first.synchronize()
    d.stop()    # its hooks would push the next gradients into a dead session
    with aoq.Daemon(threads=2) as d2:
        check("gone", model, built_again(d2.socket, "again"), first, data)
    print("ok")
    return 0


if __name__ == "__main__":
    exit_with(main)
