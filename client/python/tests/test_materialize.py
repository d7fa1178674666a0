#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoq.materialize on the CPU device (standing in for a GPU): a model built
on the meta device is materialised one module at a time, so the trainer's
peak host memory grows by the bf16 model plus one module's fp32 tensors,
not by the fp32 model as when the model is built on the CPU and converted;
the values are those of the model built in fp32 and converted, bit for bit;
tied weights stay tied; a model built on the CPU in fp32 shrinks as it
moves; OffloadOptimizer registers the materialised parameters and aoqd's
master equals them (a step at lr 0 leaves them unchanged).
Each case runs in its own process, its peak RSS (VmHWM) reset before it.
Exit 0 ok, 1 fail, 77 skip without torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
import json
import os
import subprocess
import sys

from testenv import require_torch  # sets sys.path: this folder and the package

torch = require_torch()

LAYERS, D_IN, D_OUT = 12, 1024, 4096
MIB = 1 << 20


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(D_IN, D_OUT) for _ in range(LAYERS)])


def rss():
    """(VmRSS, VmHWM) of this process in bytes."""
    v = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, rest = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                v[k] = int(rest.split()[0]) * 1024
    return v["VmRSS"], v["VmHWM"]


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(case):
    from aoq.materialize import materialize
    # torch's first use of its kernels and threads (code pages, stacks: some
    # 35 MiB) is not the model's: paid before the peak is reset
    with torch.device("meta"):
        warm = torch.nn.Linear(64, 64)
    materialize(warm, "cpu", dtype=torch.bfloat16)
    torch.nn.Linear(64, 64).to(torch.bfloat16)
    del warm
    out = {}
    if case == "meta":
        reset_peak()
        before, _ = rss()
        with torch.device("meta"):
            model = build()
        torch.manual_seed(0)
        materialize(model, "cpu", dtype=torch.bfloat16)
        out["growth"] = rss()[1] - before
        ref = build().to(torch.bfloat16)
        out["same"] = all(torch.equal(a, b) and a.dtype == torch.bfloat16 and not a.is_meta
                          for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
        # registered as is: aoqd's master is the parameter (a step at lr 0)
        import aoq
        from aoq.torch import OffloadOptimizer
        with aoq.Daemon(threads=1) as d:
            opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=0.0, weight_decay=0.0,
                                   socket=d.socket, minimal_size=0)
            before = [p.detach().clone() for p in model.parameters()]
            x = torch.randn(4, D_IN, dtype=torch.bfloat16)
            sum(layer(x).float().pow(2).mean() for layer in model).backward()   # each layer alone
            opt.step()
            opt.synchronize()
            out["kept"] = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            grads = all(p.grad is not None for p in model.parameters())
            opt.close()
        out["grads"] = grads
    elif case == "tied":
        with torch.device("meta"):
            emb = torch.nn.Embedding(64, 32)
            head = torch.nn.Linear(32, 64, bias=False)
            head.weight = emb.weight
            m = torch.nn.ModuleDict({"emb": emb, "head": head})
        materialize(m, "cpu", dtype=torch.bfloat16)
        out["tied"] = m["head"].weight is m["emb"].weight and m["emb"].weight.dtype == torch.bfloat16
        calls = []
        with torch.device("meta"):
            n = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        materialize(n, "cpu", init=lambda mod: (calls.append(type(mod).__name__),
                                                [torch.nn.init.constant_(p, 0.5) for p in mod.parameters(False)]))
        out["init"] = calls == ["Linear", "LayerNorm"] and all(bool((p == 0.5).all()) for p in n.parameters())
        out["fp32"] = all(p.dtype == torch.float32 for p in n.parameters())
    elif case == "cpu":
        model = build()
        reset_peak()
        before, _ = rss()
        materialize(model, "cpu", dtype=torch.bfloat16)
        after, peak = rss()
        out["growth"] = peak - before
        out["shrink"] = before - after
    elif case == "baseline":
        reset_peak()
        before, _ = rss()
        model = build().to(torch.bfloat16)
        out["growth"] = rss()[1] - before
    print("RESULT " + json.dumps(out))
    return 0


def run(case):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")   # big tensors go back to the system when freed
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case], env=env,
                       capture_output=True, text=True, timeout=300)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise AssertionError("case %s: exit %d\n%s\n%s" % (case, p.returncode, p.stdout, p.stderr))
    return json.loads(line[-1][len("RESULT "):])


def main():
    fp32_layer = (D_IN * D_OUT + D_OUT) * 4
    bf16_model = LAYERS * fp32_layer // 2
    fp32_model = LAYERS * fp32_layer
    slack = 24 * MIB
    fails = []
    meta, cpu, base, tied = run("meta"), run("cpu"), run("baseline"), run("tied")
    print("materialize from meta: peak +%.1f MiB (bf16 model %.1f MiB + largest fp32 module %.1f MiB); "
          "built on the CPU and converted: +%.1f MiB (fp32 model %.1f MiB); from a CPU fp32 model: peak +%.1f MiB, "
          "%.1f MiB freed" % (meta["growth"] / MIB, bf16_model / MIB, fp32_layer / MIB, base["growth"] / MIB,
                               fp32_model / MIB, cpu["growth"] / MIB, cpu["shrink"] / MIB))
    if meta["growth"] > bf16_model + fp32_layer + slack:
        fails.append("meta: peak grew %d bytes, more than the bf16 model + one fp32 module + slack (%d)" %
                     (meta["growth"], bf16_model + fp32_layer + slack))
    if base["growth"] < fp32_model:
        fails.append("baseline: built in fp32 on the CPU, peak grew only %d bytes (fp32 model %d): the "
                     "measurement does not see the model" % (base["growth"], fp32_model))
    if not meta["growth"] < 0.75 * base["growth"]:
        fails.append("meta: peak +%d is not below 3/4 of the CPU-built model's +%d" % (meta["growth"], base["growth"]))
    for k, why in (("same", "values differ from the model built in fp32 and converted"),
                   ("kept", "a step at lr 0 changed a parameter: aoqd's master is not the parameter"),
                   ("grads", "no gradient on a materialised parameter")):
        if not meta.get(k):
            fails.append("meta: " + why)
    if cpu["growth"] > 2 * fp32_layer + slack:
        fails.append("cpu: converting a CPU model grew the peak by %d bytes (one module: %d)" %
                     (cpu["growth"], fp32_layer))
    if cpu["shrink"] < fp32_model - bf16_model - slack:
        fails.append("cpu: the fp32 storage was not freed (%d bytes less, expected about %d)" %
                     (cpu["shrink"], fp32_model - bf16_model))
    for k, why in (("tied", "tied weights untied"), ("init", "init(module) not called per module, in order"),
                   ("fp32", "dtype=None converted the parameters")):
        if not tied.get(k):
            fails.append("tied: " + why)
    for f in fails:
        print("FAIL:", f)
    if not fails:
        print("PASS: materialize")
    return 1 if fails else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2]))
    sys.exit(main())
