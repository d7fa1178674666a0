#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Snapshots opened the way users will open them: for fp32, bf16, q8 and q4
state, a Client trains a few steps, `aoqctl snapshot ID` writes the file and
prints its path, and the file is read with the `safetensors` library (numpy
framework where numpy has the dtype) and with torch
(safetensors.torch.load_file).  Every array, decoded as docs/snapshots.md
says (bf16 master, q8 codes and scales), must equal what the session reads
back through libaoq (Client.read_state) bit for bit, and the metadata
(step, key, per-tensor steps, hyperparameters) must be the session's.
Exit 0 ok, 1 fail, 77 skip (no numpy, safetensors or torch)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import numpy as np
    import safetensors
    import safetensors.numpy
    import safetensors.torch
    import torch
except ImportError as e:
    if os.environ.get("CI") or os.environ.get("AOQ_REQUIRE_TORCH"):
        print("FAIL: %s (CI needs numpy, safetensors and torch)" % e)
        sys.exit(1)
    print("SKIP: %s" % e)
    sys.exit(77)

import aoq  # noqa: E402

FAILED = []
AOQCTL = os.environ.get("AOQCTL")


def check(cond, msg):
    if not cond:
        FAILED.append(msg)
        print("FAIL:", msg)


def same_bits(a, b, msg):
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    ok = a.shape == b.shape and bool(np.all(a.view(np.uint32) == b.view(np.uint32)))
    if not ok and a.shape == b.shape:
        i = int(np.argmax(a.view(np.uint32) != b.view(np.uint32)))
        msg += " (first difference at %d: %r vs %r)" % (i, a[i], b[i])
    check(ok, msg)


def _u2f(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


# q8 code format 2 (kernels/aoq-convert.h, docs/snapshots.md): 8-bit floats
# against the block's scale: m e3m4 plus a sign bit, sqrt(v) e3m5.
_M_C0, _M_SHIFT, _U_C0, _U_SHIFT = 1920, 19, 3840, 18
_M_K, _U_K = _u2f(_M_C0 << _M_SHIFT), _u2f(_U_C0 << _U_SHIFT)
_M_TOP = _u2f((_M_C0 + 127) << _M_SHIFT) - _M_K
_U_TOP = _u2f((_U_C0 + 255) << _U_SHIFT) - _U_K


def q8_m(codes, scale):
    c = codes.astype(np.uint32)
    y = _u2f(((c & 0x7F) + _M_C0) << _M_SHIFT) - _M_K
    s = np.repeat(scale.astype(np.float32) / _M_TOP, 256)[: len(c)]
    x = y * s
    return np.where((c & 0x80) != 0, -x, x).astype(np.float32)


def q8_v(codes, scale):
    c = codes.astype(np.uint32)
    y = _u2f((c + _U_C0) << _U_SHIFT) - _U_K
    s = np.repeat(scale.astype(np.float32) / _U_TOP, 256)[: len(c)]
    u = y * s
    return u * u


# q4 (kernels/README.md, "q4 moments"; docs/snapshots.md): two codes a byte,
# element i of each 32 in byte i % 16 of their 16 (bits 4-7 for i % 32 >= 16);
# m e1m2 plus a sign bit (bit 3), sqrt(v) e2m2; blocks of 128.
_Q4M_C0, _Q4M_SHIFT, _Q4U_C0, _Q4U_SHIFT = 504, 21, 496, 21
_Q4M_K, _Q4U_K = _u2f(_Q4M_C0 << _Q4M_SHIFT), _u2f(_Q4U_C0 << _Q4U_SHIFT)
_Q4M_TOP = _u2f((_Q4M_C0 + 7) << _Q4M_SHIFT) - _Q4M_K
_Q4U_TOP = _u2f((_Q4U_C0 + 15) << _Q4U_SHIFT) - _Q4U_K


def q4_codes(packed, n):
    b = packed.astype(np.uint32).reshape(-1, 16)
    return np.concatenate([b & 15, b >> 4], axis=1).reshape(-1)[:n]


def q4_m(packed, scale, n):
    c = q4_codes(packed, n)
    y = _u2f(((c & 7) + _Q4M_C0) << _Q4M_SHIFT) - _Q4M_K
    x = y * np.repeat(scale.astype(np.float32) / _Q4M_TOP, 128)[:n]
    return np.where((c & 8) != 0, -x, x).astype(np.float32)


def q4_v(packed, scale, n):
    c = q4_codes(packed, n)
    y = _u2f((c + _Q4U_C0) << _Q4U_SHIFT) - _Q4U_K
    u = y * np.repeat(scale.astype(np.float32) / _Q4U_TOP, 128)[:n]
    return u * u


def decode(precision, what, codes, scale, n):
    """exp_avg / exp_avg_sq of a q8 or q4 file, as ReadState gives them."""
    if precision == "q4":
        return (q4_m if what == "exp_avg" else q4_v)(codes, scale, n)
    return (q8_m if what == "exp_avg" else q8_v)(codes, scale)


def session_id(sock, job):
    out = subprocess.run([AOQCTL, "--socket", sock, "sessions"], capture_output=True, text=True, check=True).stdout
    ids = [int(line.split()[0]) for line in out.splitlines()[1:] if line.split()[1:2] == [job]]
    check(len(ids) == 1, "aoqctl sessions lists job %s once: %r" % (job, out))
    return ids[0]


def run(d, sd, precision):
    rng = np.random.default_rng()
    sizes = [1000, 513, 7]
    job = "py-snap-" + precision
    c = aoq.Client(socket=d.socket, job=job, rank=1, precision=precision)
    g = c.add_group(kind="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    grads = [np.zeros(n, dtype=np.float32) for n in sizes]
    names = ["model.layers.%d.weight" % i for i in range(len(sizes))]
    for i, n in enumerate(sizes):
        c.add_tensor(names[i], params[i], grad=grads[i], group=g)
    c.register()
    for step in range(3):
        for i in reversed(range(len(sizes))):
            if step == 2 and i == 2:
                continue  # a tensor left out of a step: its own step count
            grads[i][:] = rng.standard_normal(sizes[i]).astype(np.float32)
            c.push_grad(i)
        c.step_end()
        c.sync()
    sid = session_id(d.socket, job)
    p = subprocess.run([AOQCTL, "--socket", d.socket, "snapshot", str(sid)], capture_output=True, text=True)
    check(p.returncode == 0, "%s: aoqctl snapshot exited %d: %s" % (precision, p.returncode, p.stderr))
    path = p.stdout.strip()
    check(path.startswith(sd) and os.path.isfile(path), "%s: aoqctl printed %r" % (precision, path))
    if not os.path.isfile(path):
        c.close()
        return
    steps = c.get_tensor_steps()
    want = {}
    for i in range(len(sizes)):
        for k, what in enumerate(("master", "exp_avg", "exp_avg_sq")):
            want[(i, what)] = c.read_state(i, k).copy()

    # the safetensors library itself
    with safetensors.safe_open(path, framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    check(meta["format"] == "aoq-optimizer-state" and meta["format_version"] == "1", "%s: format" % precision)
    check(meta["step"] == "3" and meta["job"] == job and meta["rank"] == "1" and meta["uid"] == str(os.getuid()),
          "%s: key and step in metadata: %r" % (precision, {k: meta[k] for k in ("step", "job", "rank", "uid")}))
    check(meta["precision"] == precision, "%s: precision %s" % (precision, meta["precision"]))
    tens = json.loads(meta["tensors"])
    check([t["name"] for t in tens] == names and [t["steps"] for t in tens] == steps,
          "%s: tensors %r, steps %r" % (precision, tens, steps))
    groups = json.loads(meta["groups"])
    check(groups[0]["kind"] == "adamw" and groups[0]["lr"] == 3e-3 and groups[0]["beta2"] == 0.95,
          "%s: groups %r" % (precision, groups))
    expect_keys = {"%s.%s" % (n, a) for n in names for a in ("master", "exp_avg", "exp_avg_sq")}
    if precision in ("q8", "q4"):
        expect_keys |= {"%s.%s.scale" % (n, a) for n in names for a in ("exp_avg", "exp_avg_sq")}
    check(keys == expect_keys, "%s: keys %r" % (precision, sorted(keys)))

    # torch
    td = safetensors.torch.load_file(path)
    for i, n in enumerate(names):
        m = td[n + ".master"]
        check(m.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32), "%s: master dtype" % precision)
        same_bits(m.float().numpy(), want[(i, "master")], "%s: torch %s.master" % (precision, n))
        if precision in ("q8", "q4"):
            check(td[n + ".exp_avg"].dtype == torch.uint8 and td[n + ".exp_avg_sq"].dtype == torch.uint8,
                  "%s: code dtypes" % precision)
            for what in ("exp_avg", "exp_avg_sq"):
                same_bits(decode(precision, what, td[n + "." + what].numpy(), td[n + "." + what + ".scale"].numpy(),
                                 sizes[i]), want[(i, what)], "%s: torch %s.%s decoded" % (precision, n, what))
        else:
            for what in ("exp_avg", "exp_avg_sq"):
                same_bits(td["%s.%s" % (n, what)].numpy(), want[(i, what)], "%s: torch %s.%s" % (precision, n, what))

    # safetensors' numpy framework (no bf16 in numpy: the fp32 and q8 files)
    if precision != "bf16":
        nd = safetensors.numpy.load_file(path)
        for i, n in enumerate(names):
            same_bits(nd[n + ".master"], want[(i, "master")], "%s: numpy %s.master" % (precision, n))
            if precision == "fp32":
                same_bits(nd[n + ".exp_avg_sq"], want[(i, "exp_avg_sq")], "fp32: numpy %s.exp_avg_sq" % n)
            else:
                same_bits(decode(precision, "exp_avg", nd[n + ".exp_avg"], nd[n + ".exp_avg.scale"], sizes[i]),
                          want[(i, "exp_avg")], "%s: numpy %s.exp_avg decoded" % (precision, n))
    # training goes on after the snapshot
    for i in reversed(range(len(sizes))):
        c.push_grad(i)
    c.step_end()
    c.sync()
    c.close()


def main():
    if not AOQCTL:
        print("FAIL: set AOQCTL to the built aoqctl")
        return 1
    sd = tempfile.mkdtemp(prefix="aoq-py-snap-")
    d = aoq.Daemon(args=["--state-dir", sd])
    try:
        for precision in ("fp32", "bf16", "q8", "q4"):
            run(d, sd, precision)
    finally:
        rc = d.stop()
        check(rc == 0, "aoqd exited %r" % rc)
        if FAILED:
            print(d.log_text()[-3000:])
        shutil.rmtree(sd, ignore_errors=True)
    print("%d failures" % len(FAILED) if FAILED else "ok")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
