#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A model onto the GPU and into aoqd two ways, each in its own process,
against the same private aoqd settings: `cpu` builds it on the CPU in fp32
and moves it (model.to(device, bf16)); `meta` builds it on the meta device
and lets aoq.materialize move and initialise it one module at a time.  Then
OffloadOptimizer registers it and one step runs.  Prints per mode: the
trainer's peak host RSS (VmHWM) and aoqd's, the device peak
(torch.cuda.max_memory_allocated), the model's bytes in fp32 and bf16 and
its largest tensor, and the seconds to build and to register.

  python3 tests/bench/materialize_bench.py --device cuda --d-model 4096 --layers 16
  python3 tests/bench/materialize_bench.py --device cpu --d-model 1024 --layers 4   # a quick look
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))

GIB = 2**30


def hwm(pid="self"):
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def model_of(torch, d, layers):
    """A GPT block's weights without attention's arithmetic: per layer q, k,
    v, o (d x d) and the MLP (d x 4d, 4d x d), with biases and norms."""
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), torch.nn.LayerNorm(d),
                   torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)]
    return torch.nn.Sequential(*blocks)


def child(a):
    import torch
    import aoq
    from aoq.materialize import materialize
    from aoq.torch import OffloadOptimizer
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    out = {"mode": a.child}
    t0 = time.perf_counter()
    if a.child == "cpu":
        model = model_of(torch, a.d_model, a.layers).to(dev, torch.bfloat16)
    else:
        with torch.device("meta"):
            model = model_of(torch, a.d_model, a.layers)
        materialize(model, dev, dtype=torch.bfloat16)
    if cuda:
        torch.cuda.synchronize()
    out["build_s"] = time.perf_counter() - t0
    ps = list(model.parameters())
    out["params"] = sum(p.numel() for p in ps)
    out["largest"] = max(p.numel() for p in ps)
    out["host_after_build"] = hwm()
    out["dev_after_build"] = torch.cuda.max_memory_allocated(dev) if cuda else 0
    with aoq.Daemon(threads=max(1, (os.cpu_count() or 2) - 1)) as d:
        t1 = time.perf_counter()
        opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, socket=d.socket)
        out["register_s"] = time.perf_counter() - t1
        x = {w: torch.randn(8, w, device=dev, dtype=torch.bfloat16) for w in (a.d_model, 4 * a.d_model)}
        loss = sum(m(x[getattr(m, "in_features", a.d_model)]).float().pow(2).mean() for m in model
                   if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)))   # every weight, each module alone
        loss.backward()
        opt.step()
        opt.synchronize()
        out["aoqd_host"] = hwm(d.proc.pid)
        opt.close()
    out["host"] = hwm()
    out["dev"] = torch.cuda.max_memory_allocated(dev) if cuda else 0
    print("RESULT " + json.dumps(out))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--modes", default="cpu,meta")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    for mode in a.modes.split(","):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--device", a.device,
                            "--d-model", str(a.d_model), "--layers", str(a.layers)], capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode or not line:
            print("%s: failed (exit %d)\n%s%s" % (mode, p.returncode, p.stdout, p.stderr))
            return 1
        r = json.loads(line[-1][7:])
        n = r["params"]
        print("%-4s %.3f G params (fp32 %.2f GiB, bf16 %.2f GiB, largest tensor fp32 %.3f GiB): build %.1f s, "
              "register %.1f s; trainer host peak %.2f GiB (after build %.2f), aoqd peak %.2f GiB, device peak "
              "%.2f GiB (after build %.2f)" %
              (mode, n / 1e9, 4 * n / GIB, 2 * n / GIB, 4 * r["largest"] / GIB, r["build_s"], r["register_s"],
               r["host"] / GIB, r["host_after_build"] / GIB, r["aoqd_host"] / GIB, r["dev"] / GIB,
               r["dev_after_build"] / GIB), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
