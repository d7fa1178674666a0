# SPDX-License-Identifier: MIT
"""A private aoqd: the caller creates the listening socket, so there is no
race and no sleep -- a client may connect as soon as the object exists.
It ends with its owner: stop(), the with-block, the object's collection,
interpreter exit, and on Linux the owner's death by any signal
(PR_SET_PDEATHSIG: SIGTERM when the thread that made it ends, so make it in
the main thread or one that lives as long)."""
import ctypes
import functools
import os
import signal
import shutil
import socket as _socket
import subprocess
import tempfile
import weakref

_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, looked up in the parent (before fork), or None."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent(prctl, parent):
    """In the child before exec: SIGTERM when the parent (thread) ends; if
    it already has, exit at once."""
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _end(proc, path):
    """SIGTERM, a short wait, SIGKILL; the temp directory goes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(path, ignore_errors=True)


def find_aoqd():
    """$AOQD, else the aoqd a wheel carries (aoq/_native/aoqd), else the
    build tree of this checkout, else aoqd on $PATH."""
    exe = os.environ.get("AOQD")
    if exe:
        return exe
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "_native", "aoqd")
    if os.access(bundled, os.X_OK):
        return bundled
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    for b in ["build"] + sorted(d for d in os.listdir(repo) if d.startswith("build-")) if os.path.isdir(repo) else []:
        p = os.path.join(repo, b, "daemon", "aoqd")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("aoqd")


class Daemon:
    """Starts `aoqd --listen-fd N --threads T` on a socket in a fresh temp
    directory.  .socket is its path; stop() (or the with-block) ends it."""

    def __init__(self, exe=None, threads=2, args=(), log=None):
        exe = exe or find_aoqd()
        if not exe:
            raise FileNotFoundError("aoqd not found: set AOQD to its path")
        self.dir = tempfile.mkdtemp(prefix="aoq-py-")
        self.socket = os.path.join(self.dir, "aoqd.sock")
        self.log = log or os.path.join(self.dir, "aoqd.log")
        args = list(args)
        if "--state-dir" not in args and "--config" not in args:
            # a private daemon never restores the node's snapshots: its own
            # (empty) directory, made here so that aoqd has nothing to warn about
            state = os.path.join(self.dir, "state")
            os.mkdir(state, 0o700)
            args += ["--state-dir", state]
        if "--config" not in args:
            # A private daemon serves its owner alone: no per-uid memory
            # quota (a node's aoqd keeps max_state_bytes_per_uid, a fair
            # share of 90% of memory by default), so a model that fits the
            # host trains without a config change.
            conf = os.path.join(self.dir, "aoqd.conf")
            with open(conf, "w") as f:
                f.write("max_state_bytes_per_uid = 0\n")
            args += ["--config", conf]
        prctl = _prctl() if os.uname().sysname == "Linux" else None
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.bind(self.socket)
            s.listen(128)
            with open(self.log, "ab") as logf:
                self.proc = subprocess.Popen([exe, "--listen-fd", str(s.fileno()), "--threads", str(threads)]
                                             + list(args), pass_fds=(s.fileno(),), stdin=subprocess.DEVNULL,
                                             stdout=logf, stderr=subprocess.STDOUT,
                                             preexec_fn=functools.partial(_die_with_parent, prctl, os.getpid())
                                             if prctl is not None else None)
        finally:
            s.close()  # the daemon holds its own copy
        self._end = weakref.finalize(self, _end, self.proc, self.dir)

    def log_text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout=30):
        """SIGTERM, wait; returns the exit status."""
        self._end.detach()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
