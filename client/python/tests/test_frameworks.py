#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoq.torch.OffloadOptimizer inside the trainers people use, on the CPU,
with tiny models built from configs (no downloads): each case trains with
aoq and with torch.optim.AdamW in the same framework, with clipping,
gradient accumulation and an LR scheduler, and compares final parameters
and losses (torch.testing.assert_close defaults); then a run saved halfway
and resumed equals the uninterrupted one.

    test_frameworks.py --cases api,lightning,hf,accelerate,torchtune,dcp

api: the optimizer as torch's where frameworks look (a wrapper cannot close
it, load_state_dict keeps the saved groups whole, opt.state[p], keyword
typos, the clipping warning, a private daemon's life).  Exit 0 ok, 1 fail,
77 skip (a framework not installed; with CI or AOQ_REQUIRE_TORCH set that
fails instead)."""
import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

REQUIRE = any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH"))


class Missing(Exception):
    pass


def need(module):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise Missing("%s is not installed (%s); deploy/python-venv.sh installs it" % (module, e))


try:
    import torch
except ImportError as e:
    if REQUIRE:
        print("FAIL: torch is required here (CI / AOQ_REQUIRE_TORCH is set) but %s" % (e,))
        sys.exit(1)
    print("SKIP: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import aoq  # noqa: E402
from aoq.torch import OffloadOptimizer  # noqa: E402

SOCKET = None
LR = 1e-2


def aoq_kw(**kw):
    return dict(socket=SOCKET, minimal_size=1, **kw)


def params_of(model):
    """The model's final parameters, read as docs/python.md ("When the
    parameters are current") says: model.state_dict() waits for the updates
    still landing (p.detach() right after step() may miss the last one)."""
    return [t.detach().clone() for t in model.state_dict().values()]


def same(a, b, what):
    assert len(a) == len(b), (what, len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        try:
            torch.testing.assert_close(x, y)
        except AssertionError as e:
            raise AssertionError("%s, item %d: %s" % (what, i, e)) from None
    print("  ok: %s (%d)" % (what, len(a)))


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


# ---------------------------------------------------------------- api
def case_api(tmp):
    m = mlp()
    x, y = data()
    # A keyword typo names the closest keyword, before AdamW sees it.
    for bad, hint in (("offload_gradient", "offload_gradients"), ("minimal_sise", "minimal_size"),
                      ("weight_decy", "weight_decay")):
        try:
            OffloadOptimizer(m.parameters(), **aoq_kw(**{bad: 1}))
        except TypeError as e:
            assert "did you mean %r" % hint in str(e), str(e)
        else:
            raise AssertionError("%s= was taken" % bad)
    print("  ok: keyword typos name the keyword meant")

    # A Lightning-style wrapper: a class built from the optimizer's own
    # class, forwarding unknown attributes; dropping it (its __del__ runs)
    # leaves the optimizer open, and its methods act on the optimizer.
    opt = OffloadOptimizer(m.parameters(), lr=LR, **aoq_kw())

    class Wrapper:
        def __init__(self, o):
            self._optimizer = o
            self.__class__ = type("Wrapped" + o.__class__.__name__, (self.__class__, o.__class__), {})

        def __getattr__(self, k):
            return getattr(self._optimizer, k)

    class Copy:          # older Lightning: a copy of the optimizer's __dict__
        def __init__(self, o):
            self.__dict__ = dict(o.__dict__)
            self.__class__ = type("Copied" + o.__class__.__name__, (self.__class__, o.__class__), {})

    for make in (Wrapper, Copy):
        w = make(opt)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        w.step()
        w.zero_grad()
        assert opt._any_wait or not w.__dict__.get("_any_wait", False)
        del w
        gc.collect()
        assert opt._client is not None, "a wrapper closed the optimizer"
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()          # still open
    opt.zero_grad()
    print("  ok: a wrapper's __del__ leaves the optimizer open; its calls act on the optimizer")

    # opt.state[p]: read from aoqd, what state_dict() says.
    sd = opt.state_dict()
    ps = list(m.parameters())
    for i, p in enumerate(ps):
        st = opt.state[p]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[k], sd["state"][i][k])
    assert len(opt.state) == len(ps) and set(opt.state) == set(ps)
    assert all(isinstance(v, dict) and "exp_avg" in v for v in opt.state.values())
    try:
        opt.state[ps[0]] = {}
    except TypeError:
        pass
    else:
        raise AssertionError("opt.state[p] = ... was taken for an offloaded parameter")
    print("  ok: opt.state[p] holds the state read from aoqd")

    # load_state_dict keeps every saved group key (a scheduler's initial_lr),
    # so a scheduler built after loading with last_epoch finds it.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    sched.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["custom_key"] = 7
    opt.close()
    opt2 = OffloadOptimizer(mlp().parameters(), lr=LR, **aoq_kw())
    opt2.load_state_dict(saved)
    g = opt2.param_groups[0]
    assert g["initial_lr"] == LR and g["custom_key"] == 7 and g["lr"] == LR * 0.5, g
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s, last_epoch=0)
    opt2.close()
    print("  ok: load_state_dict keeps the saved groups whole (initial_lr, any key)")

    # Offloaded gradients meet torch's clipping: a warning says it saw none.
    m = mlp()
    opt = OffloadOptimizer(m.parameters(), lr=LR, offload_gradients=True, **aoq_kw())
    torch.nn.functional.mse_loss(m(x), y).backward()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    assert any("offload_gradients=True" in str(x.message) and "max_grad_norm" in str(x.message) for x in w), \
        [str(x.message) for x in w]
    opt.step()
    opt.close()
    m2 = mlp()
    opt = OffloadOptimizer(m2.parameters(), lr=LR, **aoq_kw())     # gradients kept: no warning
    torch.nn.functional.mse_loss(m2(x), y).backward()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
    assert not [x for x in w if "aoq" in str(x.message)], [str(x.message) for x in w]
    opt.step()
    opt.close()
    print("  ok: torch's clipping of offloaded gradients warns")

    # Without a daemon, the error names aoq.Daemon().
    try:
        OffloadOptimizer(mlp().parameters(), socket=os.path.join(tmp, "none.sock"), minimal_size=1)
    except aoq.AoqError as e:
        assert "aoq.Daemon()" in str(e), str(e)
    else:
        raise AssertionError("connected to no daemon")
    # A private daemon warns about nothing it was not asked for, and dies
    # with the process that made it, however that process ends.
    with aoq.Daemon() as d:
        c = aoq.Client(socket=d.socket)
        c.close()
        log = d.log_text()
    assert " warn " not in log and "state_dir" not in log, log
    code = ("import sys; sys.path.insert(0, %r); import aoq, time; d = aoq.Daemon(); print(d.proc.pid, flush=True); "
            "time.sleep(60)" % os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline())
    p.kill()
    p.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("aoqd %d outlived the process that made it (SIGKILL)" % pid)
    print("  ok: a private daemon: no warnings, ends with its owner (SIGKILL)")


# ---------------------------------------------------------------- DCP, one process
def case_dcp(tmp):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    x, y = data()

    def run(make_opt, steps, start=0, model=None, opt=None):
        losses = []
        for i in range(start, start + steps):
            xb, yb = x[(i * 8) % 64:(i * 8) % 64 + 8], y[(i * 8) % 64:(i * 8) % 64 + 8]
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    for named in (False, True):
        ref = mlp()
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
        rl = run(None, 6, model=ref, opt=ropt)
        m = mlp()
        ps = m.named_parameters() if named else m.parameters()
        opt = OffloadOptimizer(ps, lr=LR, **aoq_kw())
        la = run(None, 3, model=m, opt=opt)
        sd = get_optimizer_state_dict(m, opt)
        set_optimizer_state_dict(m, opt, sd)            # into the same optimizer
        m2 = mlp(5)
        m2.load_state_dict(m.state_dict())
        opt2 = OffloadOptimizer(m2.named_parameters() if named else m2.parameters(), lr=LR, **aoq_kw())
        set_optimizer_state_dict(m2, opt2, get_optimizer_state_dict(m, opt))   # into a new one
        opt.close()
        la += run(None, 3, start=3, model=m2, opt=opt2)
        same(la, rl, "DCP get/set (%s parameters): losses equal torch AdamW's" % ("named" if named else "unnamed"))
        same(params_of(m2), params_of(ref), "DCP get/set: parameters equal torch AdamW's")
        opt2.close()


# ---------------------------------------------------------------- Lightning
def case_lightning(tmp):
    L = need("lightning")
    x, y = data()

    class Mod(L.LightningModule):
        def __init__(self, use_aoq):
            super().__init__()
            self.net = mlp()
            self.use_aoq = use_aoq
            self.losses = []

        def training_step(self, batch, i):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            if self.use_aoq:
                opt = OffloadOptimizer(self.parameters(), lr=LR, weight_decay=0.01, **aoq_kw())
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def loader():
        # one epoch = half the run (3 steps of 2 batches of 8), so the
        # checkpoint ends an epoch and the resumed run reads the same batches
        ds = torch.utils.data.TensorDataset(x[:48], y[:48])
        return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)

    def fit(use_aoq, steps, ckpt=None, save_every=None):
        mod = Mod(use_aoq)
        cbs = [L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), every_n_train_steps=save_every,
                                                   save_top_k=-1)] if save_every else []
        tr = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=0.05,
                       accumulate_grad_batches=2, logger=False, enable_checkpointing=bool(save_every),
                       callbacks=cbs, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        tr.fit(mod, loader(), ckpt_path=ckpt)
        return mod, params_of(mod)

    steps = 6
    ref, rp = fit(False, steps)
    full, fp = fit(True, steps, save_every=steps // 2)
    same(full.losses, ref.losses, "Lightning: losses equal torch AdamW's")
    same(fp, rp, "Lightning: parameters equal torch AdamW's")
    ck = os.path.join(tmp, "ckpt", "epoch=0-step=%d.ckpt" % (steps // 2))
    rest, pp = fit(True, steps, ckpt=ck)
    same(rest.losses, full.losses[steps // 2 * 2:], "Lightning: resumed (ckpt_path=) losses")
    same(pp, fp, "Lightning: saved + resumed parameters equal the uninterrupted run's")


# ---------------------------------------------------------------- Hugging Face Trainer
def case_hf(tmp):
    tf = need("transformers")
    cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    ds = [{"input_ids": r, "labels": r} for r in ids]

    def train(use_aoq, out, steps, resume=None, save_steps=None):
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(cfg)
        args = tf.TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4,
                                    gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=LR,
                                    weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=2,
                                    logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                    save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                                    dataloader_num_workers=0)
        kw = {}
        if use_aoq:
            kw["optimizer_cls_and_kwargs"] = (OffloadOptimizer, aoq_kw(lr=LR))
        tr = tf.Trainer(model=model, args=args, train_dataset=ds, **kw)
        tr.train(resume_from_checkpoint=resume)
        losses = [torch.tensor(e["loss"]) for e in tr.state.log_history if "loss" in e]
        if use_aoq:
            getattr(tr.optimizer, "optimizer", tr.optimizer).close()
        return losses, params_of(model)

    steps = 6
    rl, rp = train(False, os.path.join(tmp, "ref"), steps)
    al, ap = train(True, os.path.join(tmp, "aoq"), steps, save_steps=steps // 2)
    same(al, rl, "HF Trainer: losses equal torch AdamW's")
    same(ap, rp, "HF Trainer: parameters equal torch AdamW's")
    ck = os.path.join(tmp, "aoq", "checkpoint-%d" % (steps // 2))
    sl, sp = train(True, os.path.join(tmp, "resumed"), steps, resume=ck)
    # the resumed trainer's log history starts with the checkpoint's
    same(sl, al, "HF Trainer: resumed (resume_from_checkpoint=) losses")
    same(sp, ap, "HF Trainer: resumed parameters equal the uninterrupted run's")


# ---------------------------------------------------------------- accelerate
def case_accelerate(tmp):
    acc = need("accelerate")
    x, y = data()
    steps, accum = 6, 2

    def run(use_aoq, start, stop, load=None, save_at=None):
        acc.utils.set_seed(0)
        a = acc.Accelerator(cpu=True, gradient_accumulation_steps=accum)
        m = mlp()
        opt = (OffloadOptimizer(m.parameters(), lr=LR, weight_decay=0.01, **aoq_kw()) if use_aoq else
               torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
        m, opt, dl, sched = a.prepare(m, opt, dl, sched)
        if load:
            a.load_state(load)
        batches = list(dl)
        losses = []
        for i in range(start * accum, stop * accum):
            xb, yb = batches[i % len(batches)]
            with a.accumulate(m):
                loss = torch.nn.functional.mse_loss(m(xb), yb)
                a.backward(loss)
                losses.append(loss.detach())
                if a.sync_gradients:
                    a.clip_grad_norm_(m.parameters(), 0.05)
                opt.step()
                sched.step()
                opt.zero_grad()
            if save_at is not None and (i + 1) == save_at * accum:
                a.save_state(os.path.join(tmp, "state"))
        p = params_of(m)
        if use_aoq:
            opt.optimizer.close()
        return losses, p

    rl, rp = run(False, 0, steps)
    al, ap = run(True, 0, steps, save_at=steps // 2)
    same(al, rl, "accelerate: losses equal torch AdamW's")
    same(ap, rp, "accelerate: parameters equal torch AdamW's")
    sl, sp = run(True, steps // 2, steps, load=os.path.join(tmp, "state"))
    same(sl, al[steps // 2 * accum:], "accelerate: load_state losses")
    same(sp, ap, "accelerate: save_state + load_state parameters equal the uninterrupted run's")


# ---------------------------------------------------------------- torchtune
def case_torchtune(tmp):
    """torchtune's recipe pattern: the optimizer from a config's _component_,
    its state loaded on resume, the scheduler built after loading with
    last_epoch set, clipping with torch.nn.utils.clip_grad_norm_."""
    need("torchtune")
    from omegaconf import OmegaConf
    from torchtune import config
    from torchtune.models.llama2 import llama2
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 64, (24, 12), generator=g)
    steps, accum = 6, 2

    def model():
        torch.manual_seed(0)
        return llama2(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=32, max_seq_len=16)

    def run(component, start, stop, saved=None, save_at=None):
        m = model()
        extra = dict(socket=SOCKET, minimal_size=1) if component.startswith("aoq") else {}
        cfg = OmegaConf.create({"optimizer": dict({"_component_": component, "lr": LR, "weight_decay": 0.01},
                                                  **extra)})
        opt = config.instantiate(cfg.optimizer, m.parameters())
        if saved is not None:
            m.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps,
                                                last_epoch=start - 1)
        losses, out = [], None
        for step in range(start, stop):
            for k in range(accum):
                b = tokens[(step * accum + k) % len(tokens):][:4]
                logits = m(b[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), b[:, 1:].reshape(-1))
                (loss / accum).backward()
                losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if save_at is not None and step + 1 == save_at:
                out = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "optimizer": opt.state_dict()}
                path = os.path.join(tmp, "tt.pt")
                torch.save(out, path)
                out = torch.load(path, weights_only=False)
        p = params_of(m)
        if hasattr(opt, "close"):
            opt.close()
        return losses, p, out

    rl, rp, _ = run("torch.optim.AdamW", 0, steps)
    al, ap, saved = run("aoq.torch.OffloadOptimizer", 0, steps, save_at=steps // 2)
    same(al, rl, "torchtune: losses equal torch AdamW's")
    same(ap, rp, "torchtune: parameters equal torch AdamW's")
    sl, sp, _ = run("aoq.torch.OffloadOptimizer", steps // 2, steps, saved=saved)
    same(sl, al[steps // 2 * accum:], "torchtune: resumed losses (scheduler built after loading, last_epoch)")
    same(sp, ap, "torchtune: resumed parameters equal the uninterrupted run's")


CASES = {"api": case_api, "dcp": case_dcp, "lightning": case_lightning, "hf": case_hf,
         "accelerate": case_accelerate, "torchtune": case_torchtune}


def main():
    global SOCKET
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    torch.set_num_threads(1)
    failed = skipped = 0
    for name in a.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="aoq-fw-") as tmp, aoq.Daemon(threads=2) as d:
            SOCKET = d.socket
            t0 = time.monotonic()
            print("case %s" % name, flush=True)
            try:
                CASES[name](tmp)
                print("ok: %s, %.1f s" % (name, time.monotonic() - t0), flush=True)
            except Missing as e:
                if REQUIRE:
                    print("FAIL: %s: %s (CI / AOQ_REQUIRE_TORCH is set)" % (name, e))
                    failed += 1
                else:
                    print("SKIP: %s: %s" % (name, e))
                    skipped += 1
            except Exception:
                traceback.print_exc()
                print("FAIL: %s\n--- aoqd log ---\n%s" % (name, d.log_text()[-3000:]))
                failed += 1
    if failed:
        return 1
    return 77 if skipped and skipped == len(a.cases.split(",")) else 0


if __name__ == "__main__":
    sys.exit(main())
