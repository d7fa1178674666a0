#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A model whose masters come in several memfds (aoq-arena.h: one per 64 MiB
of bf16 masters) on the GPU: the CUDA backend pins each memfd's mapping and
copies every parameter from the right one.  The same bf16 model (four
tensors, 200 MiB of masters: three memfds) trains 3 steps with aoq's default
for bf16 parameters (the split fp32 master, its high half the parameter in
the masters memfds) on the GPU and on the host, with the same gradients; the
parameters must be equal bit for bit after every step, and libaoq must not
warn that it copies from pageable memory (a memfd it could not pin).

    tests/gpu/python/test_masters_memfds.py [--device cuda:0]
Exit 0 ok, 1 fail, 77 skip (no torch / no such device)."""
import argparse
import os
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402

SIZES = (40 << 20, 5, 30 << 20, 30 << 20)  # bf16 elements: 200 MiB of masters, memfds {0}, {1, 2}, {3}


def train(device, socket, steps):
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter((torch.rand(n, generator=gen) - 0.5).to(torch.bfloat16).to(device)) for n in SIZES]
    # the same seed for both: the q8 moments round stochastically
    opt = OffloadOptimizer([("t%d" % i, p) for i, p in enumerate(params)], torch.optim.AdamW, lr=1e-3,
                           weight_decay=0.01, socket=socket, gpu_state_budget=0, seed=0x5eed)
    out = []
    for k in range(steps):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = ((torch.rand(p.numel(), generator=g) - 0.5) * 0.1).to(torch.bfloat16).to(device)
        opt.step()
        opt.synchronize()   # the parameters' copies landed (a forward would wait for them)
        opt.zero_grad()
        out.append([p.detach().to("cpu").clone() for p in params])
    opt.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    steps = 3
    with aoq.Daemon(threads=4) as d:
        # libaoq warns on the process's stderr (fd 2) when a pin fails
        saved = os.dup(2)
        with tempfile.TemporaryFile() as err:
            os.dup2(err.fileno(), 2)
            try:
                gpu = train(a.device, d.socket, steps)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            said = err.read().decode(errors="replace")
        host = train("cpu", d.socket, steps)
        log = d.log_text()
    sys.stderr.write(said)
    if "pageable" in said:
        print("FAIL: libaoq could not pin every masters memfd:\n" + said)
        return 1
    if log.count("in 3 memfds") < 2:
        print("FAIL: the masters did not come in 3 memfds (aoqd's log):\n" + log[-2000:])
        return 1
    for k in range(steps):
        for i, (x, y) in enumerate(zip(gpu[k], host[k])):
            if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                bad = (x.view(torch.int16) != y.view(torch.int16)).sum().item()
                print("FAIL: step %d tensor %d: %d parameters differ between the GPU and the host" % (k + 1, i, bad))
                return 1
    moved = (gpu[0][3] != gpu[-1][3]).sum().item()
    if moved < SIZES[3] // 2:
        print("FAIL: only %d parameters of tensor 3 moved from step 1 to step %d" % (moved, steps))
        return 1
    print("ok: %d steps, %d tensors, 200 MiB of masters in 3 memfds, GPU == host bit for bit (%d moved)" %
          (steps, len(SIZES), moved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
