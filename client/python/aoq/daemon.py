# SPDX-License-Identifier: MIT
"""A private aoqd: the caller creates the listening socket, so there is no
race and no sleep -- a client may connect as soon as the object exists."""
import os
import shutil
import socket as _socket
import subprocess
import tempfile


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
        if "--state-dir" not in args and "--config" not in args:   # a private daemon never restores the node's snapshots
            args += ["--state-dir", os.path.join(self.dir, "state")]
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.bind(self.socket)
            s.listen(128)
            with open(self.log, "ab") as logf:
                self.proc = subprocess.Popen([exe, "--listen-fd", str(s.fileno()), "--threads", str(threads)]
                                             + list(args), pass_fds=(s.fileno(),), stdin=subprocess.DEVNULL,
                                             stdout=logf, stderr=subprocess.STDOUT)
        finally:
            s.close()  # the daemon holds its own copy

    def log_text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout=30):
        """SIGTERM, wait; returns the exit status."""
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
