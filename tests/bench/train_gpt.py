#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Step time and peak device memory of a GPT-like model trained with on-device
AdamW and with aoq.torch.OffloadOptimizer (the options of torchao's low-bit
optimizer benchmark plus aoq's modes), and the PCIe floor: every gradient
down and every parameter up through pinned buffers, measured in the same run.

    python3 tests/bench/train_gpt.py --mode gpu-adamw
    python3 tests/bench/train_gpt.py --mode aoq-fp32 --socket /tmp/aoq.sock   # or --spawn-daemon
    python3 tests/bench/train_gpt.py --mode all --spawn-daemon               # every mode, one table
    python3 tests/bench/train_gpt.py --mode dropin --spawn-daemon            # the drop-in targets (below)

The peers and the default (tests/bench/offload_table.sh runs them all at the two sizes):
aoq-default is the import swap with no aoq argument at all (OffloadOptimizer(model.parameters(),
torch.optim.AdamW, lr=, weight_decay=): the default precision for the parameters' dtype);
every other aoq mode names its precision (aoq-fp32, aoq-q8, aoq-q4, aoq-delayed*: an fp32 master;
aoq-bf24 / aoq-bf24-q4: the 24-bit master (master_dtype="bf24") with 8- or 4-bit moments;
aoq-bf16: a bf16 master beside fp32 moments; aoq-bf16master: all bf16; aoq-*bf16-q8 / -q4: a bf16
master with 8- or 4-bit moments; gpu-adamw-sr: the bf16 master's numerics done by torch on the device;
gpu-adamw-sr24: the same with a master of 24 bits beside each bf16 parameter, its rounding;
gpu-none: forward and backward with no optimizer step at all, the floor of any optimizer's step).
torchao is torchao's CPUOffloadOptimizer (fused CPU AdamW), deepspeed DeepSpeed ZeRO-2 with
offload_optimizer to the CPU (pinned), a process group of one; either prints a row saying why
when it does not import here.  An aoq mode ending in -auto adds gpu_state_budget="auto"
(with --max-device, max_device_bytes=), one ending in -off gpu_state_budget=0 (everything
offloaded; without either, aoq's default share, docs/python.md "The default share"), one
ending in -host host_share=True (docs/python.md, "The host share").  The last table: s/step, the ratios to gpu-adamw,
torchao and gpu-none (where they ran), the device peaks over the whole run (max_memory_allocated and max_memory_reserved), the
final loss and the mean loss of the last --loss-tail steps against --loss-ref's, and with
--host-triad BENCH_KERNELS the host's memory bandwidth (bench-kernels --triad) before and
after each mode: an offloaded step is the host's memory traffic, and on a shared host the
bandwidth moves within minutes.  The
default against the fp32 master over a long run (the loss curve's tail):

    python3 tests/bench/train_gpt.py --spawn-daemon --mode gpu-adamw,aoq-default,aoq-fp32 --steps 200 \
        --warmup 3 --lr 3e-4 --data markov --loss-tail 50

A mode name may end in -swap, -attach or -compile (aoq-fp32-swap, aoq-q8-compile,
gpu-adamw-compile, ...): -swap is the import swap (OffloadOptimizer, nothing else:
the global forward pre-hook waits per module), -attach adds opt.attach(model),
-compile is the import swap with torch.compile(model); -rcompile compiles each
block on its own (regional compilation), so the waits run between blocks.  Without a suffix the
--attach/--no-attach and --compile flags decide, as before.  --mode dropin runs
%s
and prints the drop-in targets: import swap <= 1.02x attach, compiled <= eager,
fp32 state <= 1.2x on-device AdamW, q8 <= 1.08x.

Multi-rank modes (--ranks N processes, spawned; NCCL on cuda:0..N-1, gloo on the CPU;
one daemon for the node): ddp-gpu (DDP + on-device fused AdamW), ddp-aoq-fp32,
ddp-aoq-q8, ddp-aoq-bf16 (DDP + OffloadOptimizer, a session per rank; bf16: bf16 master
and moments), ddp-shared-fp32/-q8/-bf16 (the same with shared=True: one state for the
node's replicas, each rank pushing its slice),
fsdp-gpu (FSDP2 fully_shard per block + root, on-device AdamW), fsdp-aoq-fp32/-q8/-bf16,
fsdp-cpuoffload (FSDP2 with CPUOffloadPolicy: torch's AdamW on the CPU in each rank).
--mode ddp / fsdp / dist run the groups; each prints s/step (the slowest rank's
median), the ratio to ddp-gpu / fsdp-gpu and the largest peak device memory of a rank:

    python3 tests/bench/train_gpt.py --device cuda --ranks 2 --mode dist --spawn-daemon
    python3 tests/bench/train_gpt.py --device cpu --ranks 2 --mode dist --spawn-daemon \
        --d-model 64 --layers 2 --heads 4 --vocab 512 --seq 32 --batch 2 --steps 2 --warmup 1

Needs a running aoqd (--socket / $AOQ_SOCKET) or --spawn-daemon (build/daemon/aoqd
or $AOQD).  Results go to tests/bench/RESULTS.md by hand.  --profile DIR runs two more
steps of each mode under torch.profiler and writes DIR/MODE.json; trace_gaps.py (beside
this file) says where the device sat idle in them.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))

MODES = ["gpu-none", "gpu-adamw", "gpu-adamw-master", "gpu-adamw-sr", "gpu-adamw-sr24", "aoq-default", "aoq-fp32", "aoq-q8", "aoq-q4", "aoq-bf24", "aoq-bf24-q4", "aoq-bf16",
         "aoq-bf16master", "aoq-delayed", "aoq-delayed-q8", "aoq-bf16-q8", "aoq-delayed-bf16-q8", "aoq-bf16-q4", "aoq-delayed-bf16-q4", "torchao",
         "deepspeed"]
VARIANTS = ("swap", "attach", "compile", "rcompile", "auto", "off", "host")
DROPIN = ["gpu-adamw", "gpu-adamw-compile", "gpu-adamw-rcompile", "aoq-fp32-swap", "aoq-fp32-attach",
          "aoq-fp32-compile", "aoq-fp32-rcompile", "aoq-q8-swap", "aoq-q8-attach", "aoq-q8-compile",
          "aoq-q8-rcompile"]
DIST_MODES = ["ddp-gpu", "ddp-aoq-fp32", "ddp-aoq-q8", "ddp-aoq-bf16", "ddp-shared-fp32", "ddp-shared-q8",
              "ddp-shared-bf16", "fsdp-gpu", "fsdp-aoq-fp32", "fsdp-aoq-q8", "fsdp-aoq-bf16", "fsdp-cpuoffload"]
__doc__ = __doc__ % ", ".join(DROPIN)


def parse_mode(name):
    """(base mode, variant or None): "aoq-q8-compile" -> ("aoq-q8", "compile")."""
    for v in VARIANTS:
        if name.endswith("-" + v) and name[:-len(v) - 1] in MODES:
            if v not in ("compile", "rcompile") and not name.startswith("aoq"):
                return None
            return name[:-len(v) - 1], v
    return (name, None) if name in MODES else None


def variant_flags(mode, args):
    """(attach, compile) of a mode; compile is False, "model" (torch.compile
    of the whole model) or "regional" (each block compiled on its own,
    torch's regional compilation: the waits run between the blocks)."""
    base, v = parse_mode(mode)
    if v is None or v in ("auto", "off", "host"):
        return args.attach and not args.compile, "model" if args.compile else False
    return v == "attach", {"compile": "model", "rcompile": "regional"}.get(v, False)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=32000, d=2048, layers=16, heads=16, seq=2048):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def loss_of(model, idx, amp):
    ctx = torch.autocast(device_type=idx.device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx:
        logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def dev_mod(device):
    return getattr(torch, torch.device(device).type, None)


def synchronize(device):
    m = dev_mod(device)
    if m is not None and hasattr(m, "synchronize") and torch.device(device).type != "cpu":
        m.synchronize()


def peak_bytes(device):
    m = dev_mod(device)
    if torch.device(device).type == "cpu" or not hasattr(m, "max_memory_allocated"):
        return 0
    return m.max_memory_allocated()


def allocated(device):
    m = dev_mod(device)
    if torch.device(device).type == "cpu" or not hasattr(m, "memory_allocated"):
        return 0
    return m.memory_allocated()


def peak_reserved(device):
    m = dev_mod(device)
    if torch.device(device).type == "cpu" or not hasattr(m, "max_memory_reserved"):
        return 0
    return m.max_memory_reserved()


def reset_peak(device):
    m = dev_mod(device)
    if torch.device(device).type != "cpu" and hasattr(m, "reset_peak_memory_stats"):
        m.reset_peak_memory_stats()


class MasterAdamW:
    """gpu-adamw-master: torch's fused AdamW on fp32 master copies of the
    bf16 parameters, on the device, each parameter the master rounded after
    the step: the numerics of aoq's fp32 state (fp32 master and moments), as
    the reference for its loss (gpu-adamw keeps bf16 parameters and state)."""

    def __init__(self, params, **kw):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, **kw)

    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None


class SRAdamW:
    """gpu-adamw-sr: AdamW on the device with each bf16 parameter its own
    master, rounded to bf16 stochastically after every step (16 random bits
    from torch's generator added below the bf16 mantissa, then truncated),
    beside fp32 moments: the numerics of aoq's bf16 master
    (master_dtype="bf16", state_precision="fp32") computed by torch, which
    tells what the rounding costs apart from the offload."""

    def __init__(self, params, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8, low_bits=16):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.wd, (self.b1, self.b2), self.eps = lr, weight_decay, betas, eps
        self.m = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.v = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        # low_bits < 16 (gpu-adamw-sr24): a master of 32 - low_bits bits
        # beside each bf16 parameter, which is its rounding to nearest
        self.low = low_bits
        self.master = [p.detach().float() if low_bits < 16 and p.dtype == torch.bfloat16 else None
                       for p in self.params]
        self.t = 0
        self.state = {}

    @torch.no_grad()
    def step(self):
        self.t += 1
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for p, m, v, w in zip(self.params, self.m, self.v, self.master):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.lerp_(g, 1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            x = (p.float() if w is None else w).mul_(1 - self.lr * self.wd)
            x.addcdiv_(m, (v / bc2).sqrt_().add_(self.eps), value=-self.lr / bc1)
            if p.dtype == torch.bfloat16:
                r = torch.randint(0, 1 << self.low, x.shape, device=x.device, dtype=torch.int32)
                x = ((x.view(torch.int32) + r) & -(1 << self.low)).view(torch.float32)
                if w is not None:
                    w.copy_(x)
            p.copy_(x)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class Unavailable(Exception):
    """A peer that does not run here (torchao or DeepSpeed missing): its
    row says why, the other modes go on."""


class DeepSpeedOffload:
    """deepspeed: DeepSpeed ZeRO-2 with offload_optimizer to the CPU
    (pinned), its DeepSpeedCPUAdam in AdamW mode, in this one process (a
    process group of world size 1).  forward is the engine; backward and
    step() are the engine's."""

    def __init__(self, model, args):
        try:
            import deepspeed
        except Exception as e:      # not installed, or it does not import (its ops, its dependencies)
            raise Unavailable("deepspeed does not import (%s: %s)" % (type(e).__name__, e))
        import socket as so
        import torch.distributed as dist
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            with so.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        cuda = torch.device(args.device).type == "cuda"
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        self.grad_accum = args.grad_accum
        cfg = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": args.grad_accum,
            "bf16": {"enabled": not args.amp},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1, "betas": [0.9, 0.999],
                                                      "eps": 1e-8}},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        try:
            self.engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=[
                p for p in model.parameters() if p.requires_grad])
        except Exception as e:      # e.g. its CPU Adam op does not build here
            raise Unavailable("deepspeed.initialize failed (%s: %s)" % (type(e).__name__, e))
        self.forward_module = self.engine
        self.micro = 0

    def backward(self, loss):
        # the micro-batch's loss, undivided: the engine divides by its
        # gradient_accumulation_steps and steps at the boundary, so every
        # micro-batch but the last steps here
        self.engine.backward(loss)
        self.micro += 1
        if self.micro < self.grad_accum:
            self.engine.step()

    def step(self):
        self.engine.step()
        self.micro = 0

    def zero_grad(self, set_to_none=True):
        pass                        # engine.step() zeroes the gradients

    def close(self):
        destroy = getattr(self.engine, "destroy", None)    # (not in every DeepSpeed release)
        if destroy is not None:
            destroy()


class NoStep(torch.optim.Optimizer):
    """gpu-none: no update at all (the gradients dropped): forward and
    backward alone, which no optimizer's step can undercut."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def make_optimizer(mode, model, args, socket):
    attach, _ = variant_flags(mode, args)
    mode, variant = parse_mode(mode)
    auto = variant == "auto"
    if mode == "deepspeed":
        return DeepSpeedOffload(model, args)
    if mode == "torchao":
        # torchao's CPUOffloadOptimizer (the peer): the step on the trainer's CPU after backward.
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as e:
            raise Unavailable("torchao does not import (%s: %s)" % (type(e).__name__, e))
        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=args.offload_gradients,
                                   fused=True, lr=args.lr, weight_decay=0.1)
    if mode == "gpu-adamw-master":
        return MasterAdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                           fused=torch.device(args.device).type == "cuda")
    if mode == "gpu-adamw-sr":
        return SRAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if mode == "gpu-adamw-sr24":
        return SRAdamW(model.parameters(), lr=args.lr, weight_decay=0.1, low_bits=8)
    if mode == "gpu-none":
        return NoStep(model.parameters())
    if mode == "gpu-adamw":
        fused = torch.device(args.device).type == "cuda"
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=fused)
    from aoq.torch import OffloadOptimizer
    # None: the default share (aoq's default); -off: 0, everything offloaded
    budget = "auto" if auto else 0 if variant == "off" else args.gpu_state_budget
    budget = budget if budget in ("auto", None) else int(float(budget) * 2 ** 30)
    if mode == "aoq-default":
        # the import swap and nothing else: no aoq argument (the daemon's
        # socket from $AOQ_SOCKET), no attach() unless -attach; -auto adds
        # gpu_state_budget="auto"
        if socket:
            os.environ["AOQ_SOCKET"] = socket
        kw = dict(lr=args.lr, weight_decay=0.1)
        if args.offload_gradients:
            kw["offload_gradients"] = True
        if budget is not None:
            kw["gpu_state_budget"] = budget
        if budget == "auto" and args.max_device is not None:
            kw["max_device_bytes"] = args.max_device if args.max_device <= 1 else int(args.max_device * 2 ** 30)
        if variant == "host":
            kw["host_share"] = True
        opt = OffloadOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        if variant == "attach":      # the swap alone waits per module through the global pre-hook
            opt.attach(model)
        return opt
    kw = dict(lr=args.lr, weight_decay=0.1, socket=socket, offload_gradients=args.offload_gradients,
              grad_accumulation_steps=args.grad_accum, job="bench-%s-%d" % (mode, os.getpid()),
              lease=None if args.lease else 0)
    # each mode names its precision: aoq-fp32, aoq-q8 and aoq-delayed(-q8)
    # an fp32 master, whatever the default for the parameters' dtype is
    kw["master_dtype"] = "bf24" if "bf24" in mode else "bf16" if "bf16" in mode else "fp32"
    if mode.endswith("q8") or mode == "aoq-bf24":
        kw["state_precision"] = "q8"
    elif mode.endswith("q4"):
        kw["state_precision"] = "q4"
    elif mode == "aoq-bf16master":
        kw["state_precision"] = "bf16"
    else:
        kw["state_precision"] = "fp32"
    if args.copy_mode:
        kw["copy_mode"] = args.copy_mode
    if args.staging_window is not None:
        kw["staging_window"] = int(args.staging_window * 2 ** 30)
    if mode.startswith("aoq-delayed"):
        kw["delayed_update"] = True
    if budget is not None:
        kw["gpu_state_budget"] = budget
    if budget == "auto" and args.max_device is not None:
        kw["max_device_bytes"] = args.max_device if args.max_device <= 1 else int(args.max_device * 2 ** 30)
    if variant == "host":
        kw["host_share"] = True
    opt = OffloadOptimizer(model.named_parameters(), torch.optim.AdamW, **kw)
    if attach:
        opt.attach(model)
    return opt


def pcie_floor(model, device, reps=3):
    """All gradients device->host and all parameters host->device through
    pinned buffers, as one-tensor-at-a-time copies (what aoq moves per step)."""
    if torch.device(device).type == "cpu":
        return 0.0
    ps = [p for p in model.parameters() if p.requires_grad]
    pin = torch.device(device).type == "cuda"
    hbuf = [torch.empty(p.numel(), dtype=p.dtype, pin_memory=pin) for p in ps]
    best = math.inf
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        for p, h in zip(ps, hbuf):
            h.copy_(p.detach().reshape(-1), non_blocking=True)
        for p, h in zip(ps, hbuf):
            p.data.view(-1).copy_(h, non_blocking=True)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del hbuf
    return best


def run_mode(mode, args, socket):
    torch.manual_seed(0)
    dev = args.device
    if args.init_on_device:
        # Built where it trains, in bf16: a model larger than host memory
        # allows as fp32 on the CPU (the largest-model runs).
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32 if args.amp else torch.bfloat16)
        try:
            with torch.device(dev):
                model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq + 1)
        finally:
            torch.set_default_dtype(dtype)
    else:
        model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq + 1)
        if not args.amp:
            model = model.to(torch.bfloat16)
        model = model.to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    how = variant_flags(mode, args)[1]
    if how == "regional":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b)
    fwd = torch.compile(model) if how == "model" else model
    t_reg = time.perf_counter()
    opt = make_optimizer(mode, model, args, socket)
    ds = isinstance(opt, DeepSpeedOffload)
    if ds:
        fwd = opt.forward_module
    print("# %s: %.3fB parameters, optimizer ready in %.1f s" % (mode, nparams * 1e-9, time.perf_counter() - t_reg),
          file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(1)
    if args.data == "markov":
        data = markov_batches(args, gen, (args.warmup + args.steps + (2 if args.profile else 0)) * args.grad_accum)
        data = [x.to(dev) for x in data]
    else:
        data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(dev) for _ in range(4)]
    times, losses = [], []
    mem_fwd = mem_bwd = 0   # allocated after the loss (activations) and after backward (gradients)
    prof = None
    timed = args.warmup + args.steps
    warm_peak = warm_reserved = 0   # the warm-up steps' (and the setup's) peaks, before the reset
    for step in range(timed + (2 if args.profile else 0)):
        if step == args.warmup:
            synchronize(dev)
            warm_peak, warm_reserved = peak_bytes(dev), peak_reserved(dev)
            reset_peak(dev)
        if step == timed:
            prof = start_profile(dev)     # two more steps, not timed
        t0 = time.perf_counter()
        for k in range(args.grad_accum):
            loss = loss_of(fwd, data[(step * args.grad_accum + k) % len(data)], args.amp)
            mem_fwd = max(mem_fwd, allocated(dev))
            if ds:
                opt.backward(loss)
            else:
                (loss / args.grad_accum).backward()
            mem_bwd = max(mem_bwd, allocated(dev))
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(dev)   # step time as the trainer sees it (the next forward's waits are in it)
        if step >= timed:
            print("#   step %d (profiled): %.3f s" % (step, time.perf_counter() - t0), file=sys.stderr, flush=True)
            continue
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print("#   step %d: %.3f s  loss %.4f" % (step, times[-1], losses[-1]), file=sys.stderr, flush=True)
    if prof is not None:
        prof.__exit__(None, None, None)
        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, "%s.json" % mode)
        prof.export_chrome_trace(path)
        print("# %s: trace of two steps after the timed ones in %s (tests/bench/trace_gaps.py reads it)" % (mode, path),
              file=sys.stderr, flush=True)
    peak = peak_bytes(dev)
    reserved = max(warm_reserved, peak_reserved(dev))
    base_mode = parse_mode(mode)[0]
    floor = pcie_floor(model, dev) if mode == "gpu-adamw" else None
    # what the on-device optimizer keeps on the device: its gradients and state
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state_bytes = 0
    if base_mode == "gpu-adamw":
        for st in opt.state.values():
            state_bytes += sum(v.numel() * v.element_size() for v in st.values()
                               if torch.is_tensor(v) and v.device.type != "cpu")
    split = getattr(opt, "auto_split", None)
    if split:
        print("# gpu_state_budget auto: %s" % split, file=sys.stderr, flush=True)
    if hasattr(opt, "close"):
        opt.close()
    del opt, model, fwd, data
    gc.collect()
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()
    st = sorted(times[args.warmup:])
    tail = losses[-min(len(losses), args.loss_tail):]
    return dict(mode=mode, params=nparams, step_s=st[len(st) // 2], step_min_s=st[0], peak_gib=peak / 2 ** 30,
                run_peak_gib=max(peak, warm_peak) / 2 ** 30, reserved_gib=reserved / 2 ** 30,
                loss_tail=sum(tail) / len(tail), loss_tail_steps=len(tail),
                pcie_floor_s=floor, loss=losses[-1], grad_gib=grad_bytes / 2 ** 30, state_gib=state_bytes / 2 ** 30,
                after_loss_gib=mem_fwd / 2 ** 30, after_backward_gib=mem_bwd / 2 ** 30,
                times=times)


def markov_batches(args, gen, n):
    """n fresh batches of a learnable Markov chain over 256 tokens (as
    tests/gpu/python/test_gpt_bf16.py draws them): x' = (5 x + 17 + e) mod
    256 with e uniform in 0..15, so the loss falls from log(vocab) towards
    log(16) = 2.77 and is never memorised: a long run's loss compares
    training, not the chaos of memorising four batches."""
    v = min(256, args.vocab)
    x = torch.empty(n * args.batch, args.seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, v, (n * args.batch,), generator=gen)
    e = torch.randint(0, 16, (n * args.batch, args.seq + 1), generator=gen)
    for t in range(1, args.seq + 1):
        x[:, t] = (5 * x[:, t - 1] + 17 + e[:, t]) % v
    return list(x.split(args.batch))


def start_profile(dev):
    """torch.profiler over the CPU and the device (--profile)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU]
    if torch.device(dev).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    p = profile(activities=acts)
    p.__enter__()
    return p


def _dist_rank(rank, mode, args, socket, store, out):
    """One rank of a multi-rank mode (torch.multiprocessing.spawn target)."""
    import torch.distributed as dist
    cpu = torch.device(args.device).type == "cpu"
    if cpu:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method="file://" + store, rank=rank,
                            world_size=args.ranks)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq + 1)
    if not args.amp:
        model = model.to(torch.bfloat16)
    kind, _, opt_kind = mode.partition("-")
    offload_policy = opt_kind == "cpuoffload"
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = model.to(dev)
        fwd = DDP(model) if cpu else DDP(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=not cpu)) if offload_policy else {}
        model = model.to(dev)
        for b in model.blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
        fwd = model
    nparams = sum(p.numel() for p in model.parameters())
    if opt_kind in ("gpu", "cpuoffload"):
        fused = not cpu and not offload_policy
        opt = torch.optim.AdamW(fwd.parameters(), lr=args.lr, weight_decay=0.1, fused=fused)
    else:
        from aoq.torch import OffloadOptimizer
        st = opt_kind.split("-")[-1]
        kw = dict(lr=args.lr, weight_decay=0.1, socket=socket, grad_accumulation_steps=args.grad_accum,
                  job="bench-%s" % mode, lease=None if args.lease else 0)   # as the single-rank modes
        # fp32 and q8 an fp32 master, bf16 everything in bf16, whatever the
        # default for the parameters' dtype is
        kw["master_dtype"] = "bf16" if st == "bf16" else "fp32"
        kw["state_precision"] = st
        if opt_kind.startswith("shared"):
            kw["shared"] = True     # one state for the node's replicas (a replica group)
        opt = OffloadOptimizer(fwd.named_parameters(), torch.optim.AdamW, **kw)
    gen = torch.Generator().manual_seed(1 + rank)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(dev) for _ in range(4)]
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize(dev)
            reset_peak(dev)
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(args.grad_accum):
            sync = k == args.grad_accum - 1 or kind != "ddp"
            with (contextlib.nullcontext() if sync else fwd.no_sync()):
                loss = loss_of(fwd, data[(step * args.grad_accum + k) % len(data)], args.amp)
                (loss / args.grad_accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = peak_bytes(dev)
    if hasattr(opt, "close"):
        opt.close()
    st = sorted(times[args.warmup:])
    res = torch.tensor([st[len(st) // 2], float(peak)], dtype=torch.float64)
    if not cpu:
        res = res.to(dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)      # the slowest rank, the largest peak
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(mode=mode, ranks=args.ranks, params=nparams, step_s=float(res[0]),
                           peak_gib=float(res[1]) / 2 ** 30, loss=losses[-1]), f)
    dist.destroy_process_group()


def run_dist(modes, args, socket, daemon_pid=None):
    """The multi-rank modes, each in --ranks fresh processes (aoqd's peak RSS
    per aoq mode when daemon_pid is given)."""
    import tempfile
    import torch.multiprocessing as tmp_mp
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="aoq-bench-") as d:
            out = os.path.join(d, "result.json")
            with RssPeak(daemon_pid if ("aoq" in mode or "shared" in mode) else None) as rss:
                tmp_mp.spawn(_dist_rank, args=(mode, args, socket, os.path.join(d, "store"), out),
                             nprocs=args.ranks)
            with open(out) as f:
                r = json.load(f)
        results.append(r)
        if rss.peak:
            r["daemon_rss_gib"] = rss.peak / 2 ** 30
            print("%-16s aoqd peak RSS %.2f GiB = %.2f B per parameter of the model" % (
                mode, rss.peak / 2 ** 30, rss.peak / r["params"]), flush=True)
        print("%-16s %d ranks  params %.3fB  step %.3f s  peak %.2f GiB per rank  loss %.4f"
              % (mode, r["ranks"], r["params"] / 1e9, r["step_s"], r["peak_gib"], r["loss"]), flush=True)
    for kind in ("ddp", "fsdp"):
        base = next((r for r in results if r["mode"] == kind + "-gpu"), None)
        if base is None:
            continue
        for r in results:
            if r["mode"].startswith(kind + "-"):
                print("%-16s %.2fx %s-gpu step, peak %+.2f GiB per rank" % (
                    r["mode"], r["step_s"] / base["step_s"], kind, r["peak_gib"] - base["peak_gib"]))
    # the multi-rank targets (DDP 1.25x, FSDP2 1.15x on-GPU AdamW), when the modes ran
    by = {r["mode"]: r["step_s"] for r in results}
    off = by.get("fsdp-cpuoffload")
    for mode, base, limit in (("ddp-shared-fp32", "ddp-gpu", 1.25), ("ddp-aoq-fp32", "ddp-gpu", 1.25),
                              ("fsdp-aoq-fp32", "fsdp-gpu", 1.15)):
        if mode in by and base in by:
            ratio = by[mode] / by[base]
            print("target %-16s <= %.2fx %s: %.3f %s%s" % (
                mode, limit, base, ratio, "met" if ratio <= limit else "MISSED",
                "" if off is None else ", %s than fsdp-cpuoffload (%.3f s vs %.3f s)" % (
                    "faster" if by[mode] < off else "NOT faster", by[mode], off)))
    return results


def spawn_daemon(args):
    """--spawn-daemon: a private aoqd (its own state directory)."""
    import tempfile
    import aoq
    extra = []
    if args.daemon_config:
        extra = ["--config", args.daemon_config, "--state-dir", tempfile.mkdtemp(prefix="aoq-bench-state-")]
    return aoq.Daemon(threads=args.daemon_threads, args=extra)


class RssPeak:
    """The largest resident set of a process (aoqd: the host bytes a mode
    costs), sampled every 0.2 s while the block runs."""

    def __init__(self, pid):
        self.pid, self.peak = pid, 0

    def sample(self):
        try:
            with open("/proc/%d/status" % self.pid) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
        except OSError:
            pass

    def __enter__(self):
        import threading
        self.stop = threading.Event()
        if self.pid:
            def loop():
                while not self.stop.wait(0.2):
                    self.sample()
            self.thread = threading.Thread(target=loop, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.pid:
            self.thread.join()
        return False


def run_child(mode, args, socket):
    """One mode in a fresh process: its peak device memory is its own."""
    import subprocess
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode]
    skip = {"mode", "spawn_daemon", "json", "child", "socket", "in_process", "attach", "mode_timeout", "host_triad"}
    for k, v in vars(args).items():
        if k in skip or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    argv.append("--attach" if args.attach else "--no-attach")
    if socket:
        argv += ["--socket", socket]
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, timeout=args.mode_timeout)
    except subprocess.TimeoutExpired:
        return dict(mode=mode, failed="still running after --mode-timeout %d s, killed" % args.mode_timeout)
    if proc.returncode != 0:
        # Its error (an out-of-memory above all: the largest-model runs) is on
        # stderr above; the other modes go on.
        return dict(mode=mode, failed="exit status %d" % proc.returncode)
    # the last JSON line (a peer may print on stdout too)
    return json.loads([ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")][-1])


def host_triad(path):
    """The host's memory bandwidth now: bench-kernels --triad's non-temporal
    triad in GB/s (64 Mi elements, every core, median of 3), or None.  A
    host-bound step follows it, and on a shared host it moves within
    minutes."""
    import subprocess
    if not path:
        return None
    try:
        out = subprocess.run([path, "--triad", "-n", "67108864", "-r", "3"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=120).stdout.decode()
    except (OSError, subprocess.TimeoutExpired) as e:
        print("host triad: %s did not run (%s)" % (path, e), flush=True)
        return None
    line = next((ln.split() for ln in out.splitlines() if ln.startswith("TRIAD nt ")), None)
    return float(line[2]) if line else None


def run_or_say(mode, args, socket):
    """run_mode, or the row of a peer that does not run here."""
    try:
        return run_mode(mode, args, socket)
    except Unavailable as e:
        return dict(mode=mode, unavailable=str(e))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda | xpu | cpu (or cuda:N)")
    ap.add_argument("--mode", default="all", help="all, dropin, or modes separated by commas: " + ", ".join(MODES)
                    + " (each may end in -swap, -attach or -compile)")
    ap.add_argument("--amp", action="store_true", help="bf16 autocast with fp32 parameters (default: full bf16)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--offload-gradients", action="store_true")
    ap.add_argument("--lease", action="store_true", help="aoq modes: lease the session (undo copy of the state)")
    ap.add_argument("--gpu-state-budget", default=None, metavar="GIB|auto",
                    help="aoq modes: GiB of optimizer state kept on the device, or auto (gpu_state_budget=; "
                         "default: aoq's own default, the default share)")
    ap.add_argument("--attach", action="store_true", default=True, help="per-module waits (default)")
    ap.add_argument("--no-attach", dest="attach", action="store_false")
    ap.add_argument("--staging-window", type=float, default=None, metavar="GIB",
                    help="aoq modes: the staging window in GiB (default: the optimizer's own default)")
    ap.add_argument("--copy-mode", default=None, choices=("native", "framework"),
                    help="aoq modes but aoq-default: OffloadOptimizer's copy_mode= (default: its own choice)")
    ap.add_argument("--init-on-device", action="store_true",
                    help="build the model on the device in its training dtype (models larger than host memory)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--socket", default=None, help="aoqd socket (default: $AOQ_SOCKET)")
    ap.add_argument("--spawn-daemon", action="store_true", help="start a private aoqd ($AOQD or the build tree)")
    ap.add_argument("--daemon-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--daemon-config", default=None, metavar="FILE",
                    help="--spawn-daemon: aoqd's configuration (e.g. a larger max_state_bytes_per_uid than the "
                         "default: a fair share of 90%% of RAM among its users, for the largest models)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed steps, two more under torch.profiler, traced to DIR/MODE.json")
    ap.add_argument("--data", default="random", choices=("random", "markov"),
                    help="random: four batches of random tokens, cycled (step time); markov: a fresh batch of a "
                         "learnable Markov chain every step (a long run's loss)")
    ap.add_argument("--loss-tail", type=int, default=10, metavar="N",
                    help="the table's loss: the mean over the last N steps (warm-up steps included)")
    ap.add_argument("--loss-ref", default="aoq-fp32", metavar="MODE",
                    help="the mode whose mean loss the table compares every mode's with (default aoq-fp32)")
    ap.add_argument("--max-device", type=float, default=None, metavar="GIB|FRACTION",
                    help="-auto modes: max_device_bytes=, GiB above 1, else a fraction of free device memory")
    ap.add_argument("--mode-timeout", type=int, default=None, metavar="S",
                    help="each mode's process is killed after S seconds (its row says so)")
    ap.add_argument("--host-triad", default=None, metavar="BENCH_KERNELS",
                    help="bench-kernels to measure the host's memory bandwidth (--triad) before and after "
                         "each mode; the table gets a column of it")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-process", action="store_true", help="every mode in this process (default: one each)")
    ap.add_argument("--ranks", type=int, default=2, help="processes of the ddp-* and fsdp-* modes")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_or_say(args.mode, args, args.socket)))
        return

    daemon = None
    socket = args.socket
    groups = {"dist": DIST_MODES, "ddp": [m for m in DIST_MODES if m.startswith("ddp")],
              "fsdp": [m for m in DIST_MODES if m.startswith("fsdp")]}
    if args.mode in groups or args.mode.split(",")[0] in DIST_MODES:
        modes = groups.get(args.mode) or args.mode.split(",")
        for m in modes:
            if m not in DIST_MODES:
                ap.error("unknown multi-rank mode %r (modes: %s)" % (m, ", ".join(DIST_MODES)))
        if args.spawn_daemon and any("aoq" in m for m in modes):
            daemon = spawn_daemon(args)
            socket = daemon.socket
        try:
            results = run_dist(modes, args, socket, daemon.proc.pid if daemon is not None else None)
        finally:
            if daemon is not None:
                daemon.stop()
        if args.json:
            print(json.dumps(dict(args=vars(args), results=results)))
        return
    modes = MODES if args.mode == "all" else DROPIN if args.mode == "dropin" else args.mode.split(",")
    for m in modes:
        if parse_mode(m) is None:
            ap.error("unknown mode %r (modes: %s, each may end in -swap, -attach or -compile; gpu-adamw only in "
                     "-compile)" % (m, ", ".join(MODES)))
    if any(m.startswith("aoq") for m in modes) and args.spawn_daemon:
        daemon = spawn_daemon(args)
        socket = daemon.socket
    results, missing = [], []
    try:
        for m in modes:
            triad = host_triad(args.host_triad)
            with RssPeak(daemon.proc.pid if daemon is not None and m.startswith("aoq") else None) as rss:
                r = run_or_say(m, args, socket) if args.in_process or len(modes) == 1 else run_child(m, args, socket)
            if args.host_triad:
                r["triad_gbps"] = (triad, host_triad(args.host_triad))
                print("%-16s host triad %s GB/s before, %s after" % (
                    m, *("%.1f" % t if t else "?" for t in r["triad_gbps"])), flush=True)
            if rss.peak and not r.get("failed"):
                r["daemon_rss_gib"] = rss.peak / 2 ** 30
                print("%-16s aoqd peak RSS %.2f GiB = %.2f B per parameter" % (
                    m, rss.peak / 2 ** 30, rss.peak / r["params"]), flush=True)
            if r.get("failed"):
                print("%-16s FAILED (%s; its error is above)" % (m, r["failed"]), flush=True)
                missing.append(r)
                continue
            if r.get("unavailable"):
                print("%-16s not run: %s" % (m, r["unavailable"]), flush=True)
                missing.append(r)
                continue
            results.append(r)
            print("%-16s params %.3fB  step %.3f s (min %.3f)  peak %.2f GiB (allocated after the loss %.2f, "
                  "after backward %.2f)  loss %.4f%s" % (
                m, r["params"] / 1e9, r["step_s"], r["step_min_s"], r["peak_gib"], r["after_loss_gib"],
                r["after_backward_gib"], r["loss"],
                "  PCIe floor %.3f s" % r["pcie_floor_s"] if r["pcie_floor_s"] else ""), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
    base = next((r for r in results if r["mode"] == "gpu-adamw"), None)
    if base:
        # the memory target: the on-device peak less the gradients and
        # the optimizer state (the staging window is what aoq adds back)
        target = base["peak_gib"] - base["grad_gib"] - base["state_gib"]
        print("on-device AdamW: peak %.2f GiB = gradients %.2f + optimizer state %.2f + the rest; "
              "peak less both %.2f GiB" % (base["peak_gib"], base["grad_gib"], base["state_gib"], target))
        for r in results:
            print("%-16s %.2fx on-device AdamW step, peak %+.2f GiB (%+.2f vs the peak less gradients and state)"
                  % (r["mode"], r["step_s"] / base["step_s"], r["peak_gib"] - base["peak_gib"],
                     r["peak_gib"] - target))
    targets(results)
    peer_table(results, missing, args)
    if args.json:
        print(json.dumps(dict(args=vars(args), results=results, missing=missing)))


def peer_table(results, missing, args):
    """One row per mode: s/step, its ratios to on-GPU AdamW, to torchao's
    CPUOffloadOptimizer and to the floor (gpu-none: forward and backward
    with no step), each where that mode ran, the device peaks (allocated
    and reserved by torch's caching allocator, over the whole run: setup,
    warm-up and timed steps), the final loss and the mean loss of the last
    --loss-tail steps, against --loss-ref's."""
    def ratio(r, mode):
        b = next((x for x in results if x["mode"] == mode), None)
        return "%.2f" % (r["step_s"] / b["step_s"]) if b else "-"
    ref = next((r for r in results if r["mode"] == args.loss_ref), None)
    tri = bool(args.host_triad)
    print("| mode | s/step | x on-GPU AdamW | x torchao | x the floor | device peak GiB (allocated) | reserved GiB | "
          "final loss | loss, mean of the last steps | vs %s |%s"
          % (args.loss_ref, " host triad GB/s, before / after |" * tri))
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|" * tri)
    for r in results:
        print("| %s | %.3f | %s | %s | %s | %.2f | %.2f | %.4f | %.4f (%d) | %s |%s" % (
            r["mode"], r["step_s"], ratio(r, "gpu-adamw"), ratio(r, "torchao"), ratio(r, "gpu-none"),
            r["run_peak_gib"], r["reserved_gib"], r["loss"], r["loss_tail"], r["loss_tail_steps"],
            "%+.2f%%" % (100 * (r["loss_tail"] / ref["loss_tail"] - 1)) if ref else "-",
            " %s |" % " / ".join("%.1f" % t if t else "?" for t in r.get("triad_gbps", (None, None))) * tri))
    for r in missing:
        print("| %s | not run: %s | | | | | | | | |%s"
              % (r["mode"], r.get("unavailable") or r.get("failed"), " |" * tri))


def targets(results):
    """The drop-in targets over whichever of their modes ran."""
    t = {r["mode"]: r["step_s"] for r in results}
    rows = []
    for st in ("fp32", "q8"):
        rows.append(("aoq-%s-swap / aoq-%s-attach" % (st, st), "aoq-%s-swap" % st, "aoq-%s-attach" % st, 1.02))
    for st in ("fp32", "q8"):
        rows.append(("aoq-%s-compile / aoq-%s-swap (compiled vs eager)" % (st, st), "aoq-%s-compile" % st,
                     "aoq-%s-swap" % st, 1.0))
    for st in ("fp32", "q8"):
        rows.append(("aoq-%s-rcompile / aoq-%s-swap (blocks compiled vs eager)" % (st, st), "aoq-%s-rcompile" % st,
                     "aoq-%s-swap" % st, 1.0))
    rows.append(("gpu-adamw-compile / gpu-adamw (for reference)", "gpu-adamw-compile", "gpu-adamw", None))
    rows.append(("gpu-adamw-rcompile / gpu-adamw (for reference)", "gpu-adamw-rcompile", "gpu-adamw", None))
    for st, limit in (("fp32", 1.2), ("q8", 1.08)):
        for v in ("swap", "attach"):
            rows.append(("aoq-%s-%s / gpu-adamw" % (st, v), "aoq-%s-%s" % (st, v), "gpu-adamw", limit))
        rows.append(("aoq-%s-compile / gpu-adamw-compile" % st, "aoq-%s-compile" % st, "gpu-adamw-compile", limit))
        rows.append(("aoq-%s-rcompile / gpu-adamw-rcompile" % st, "aoq-%s-rcompile" % st, "gpu-adamw-rcompile",
                     limit))
    shown = [(label, t[a] / t[b], limit) for label, a, b, limit in rows if a in t and b in t]
    if shown:
        print("drop-in targets (median step time ratios):")
    for label, ratio, limit in shown:
        verdict = "" if limit is None else ("  target <= %.2f: %s" % (limit, "met" if ratio <= limit else "MISSED"))
        print("  %-52s %.3f%s" % (label, ratio, verdict))


if __name__ == "__main__":
    main()
