#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The wheel: the repository root's build backend (pyproject.toml,
meson-python, as `pip wheel .` runs it) builds libaoq and aoqd and bundles them; the wheel installed
into a fresh venv (with its numpy extra) trains a small model with
aoq.Daemon() and OffloadOptimizer, equal to torch's AdamW, from a directory
outside the repository with AOQ_LIBRARY, AOQD and PYTHONPATH unset.

The fresh venv sees this interpreter's site-packages through a .pth file
(torch and numpy are not installed again).  The meson build directory of
the wheel is $AOQ_WHEEL_BUILD_DIR when set, else one per checkout and user
under $TMPDIR that is kept, so the suite's second configuration (run-all.sh
runs it in build and build-minimal) compiles nothing.
Exit 0 ok, 1 fail, 77 skip without meson-python or torch (1 when CI /
AOQ_REQUIRE_TORCH is set)."""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
# The wheel of the test: no GPU backends (CI has none; the build stays
# short), and the CPU kernels in plain C only unless $AOQ_WHEEL_KERNELS
# names variants (meson -Dkernel_variants): each SIMD variant is minutes of
# compile time on a 2-core machine (all four made this test 381 s of CI's
# main phase), and they are the same sources the suite "kernels" tests;
# what this test checks is the packaging.  A wheel built with `pip install
# .` has every variant (the option's default).
SETUP_ARGS = ["-Dcuda=disabled", "-Dlevel_zero=disabled", "-Dsystemd=disabled",
              "-Dkernel_variants=" + (os.environ.get("AOQ_WHEEL_KERNELS") or "none")]

TRAIN = r'''
import importlib.metadata, os, sys
import torch
import aoq, aoq._lib, aoq.daemon
from aoq.torch import OffloadOptimizer
venv = os.path.realpath(sys.prefix)
for what, path in (("aoq", aoq.__file__), ("libaoq", aoq._lib.load().path), ("aoqd", aoq.daemon.find_aoqd())):
    assert os.path.realpath(path).startswith(venv + os.sep), "%s from %s, not from the venv %s" % (what, path, venv)
    print("%s: %s" % (what, path))
assert importlib.metadata.version("aoq") == aoq.__version__, (importlib.metadata.version("aoq"), aoq.__version__)
import numpy  # the [numpy] extra

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))

def train(m, opt):
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 64, generator=g)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()

torch.set_num_threads(1)
ref = model()
train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
with aoq.Daemon(threads=1) as d:
    m = model()
    opt = OffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, minimal_size=1024, socket=d.socket)
    assert opt._slots, "nothing offloaded"
    train(m, opt)
    sd = m.state_dict()
    opt.close()
for (n, a), b in zip(sd.items(), ref.state_dict().values()):
    torch.testing.assert_close(a, b, msg=lambda s: "%s: %s" % (n, s))
print("ok: trained with the wheel's libaoq and aoqd")
'''


def default_build_dir():
    """One per checkout and user, kept between runs (the suite runs in two
    configurations; the second compiles nothing)."""
    import hashlib
    key = hashlib.sha1(REPO.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "aoq-wheel-build-%d-%s" % (os.getuid(), key))


def run(cmd, **kw):
    t0 = time.monotonic()
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, **kw)
    print(r.stdout[-6000:], end="")
    print("  (%.0f s, exit %d)" % (time.monotonic() - t0, r.returncode), flush=True)
    if r.returncode != 0:
        raise SystemExit("FAIL: %s exited %d" % (cmd[:4], r.returncode))
    return r.stdout


def main():
    required = any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH"))
    missing = []
    for mod in ("mesonpy", "torch", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        print("%s: %s not importable by %s (deploy/python-venv.sh installs them)"
              % ("FAIL" if required else "SKIP", ", ".join(missing), sys.executable))
        return 1 if required else 77

    tmp = tempfile.mkdtemp(prefix="aoq-wheel-")
    try:
        build_dir = os.environ.get("AOQ_WHEEL_BUILD_DIR") or default_build_dir()
        dist = os.path.join(tmp, "dist")
        # What `pip wheel --no-build-isolation .` does, with the backend called
        # directly: pip before 23.1 keeps one value per --config-settings key.
        os.mkdir(dist)
        build = ("import mesonpy, sys; print(mesonpy.build_wheel(sys.argv[1], {'build-dir': sys.argv[2], "
                 "'setup-args': sys.argv[3:]}))")
        run([sys.executable, "-c", build, dist, build_dir] + SETUP_ARGS, cwd=REPO)
        wheels = glob.glob(os.path.join(dist, "aoq-*.whl"))
        assert len(wheels) == 1, wheels
        names = run([sys.executable, "-m", "zipfile", "-l", wheels[0]])
        for f in ("aoq/_native/libaoq.so", "aoq/_native/aoqd", "aoq/torch.py"):
            assert f in names, "%s is not in the wheel" % f

        venv = os.path.join(tmp, "venv")
        run([sys.executable, "-m", "venv", venv])
        vpy = os.path.join(venv, "bin", "python")
        purelib = run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip().splitlines()[-1]
        with open(os.path.join(purelib, "_aoq_test_outer_site.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")       # torch and numpy of this interpreter
        run([vpy, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "--no-cache-dir",
             "aoq[numpy] @ file://" + wheels[0]])

        env = {k: v for k, v in os.environ.items()
               if k not in ("AOQ_LIBRARY", "AOQD", "PYTHONPATH", "AOQ_SOCKET", "VIRTUAL_ENV")}
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        with open(os.path.join(work, "train.py"), "w") as f:
            f.write(TRAIN)
        run([vpy, "train.py"], cwd=work, env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
