# SPDX-License-Identifier: MIT
"""The console scripts `aoqd` and `aoqctl` of an installed wheel: each execs
the binary the wheel carries (aoq/_native/), with the same arguments, so the
program's exit status, signals and standard streams are its own.  Also
`python -m aoq aoqd|aoqctl ARGS...` (aoq/__main__.py)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def native(name):
    """The path of aoq/_native/NAME when it is there and executable, else
    None."""
    p = os.path.join(_HERE, "_native", name)
    return p if os.access(p, os.X_OK) else None


def find(name):
    """The program NAME ('aoqd' or 'aoqctl'): $AOQD / $AOQCTL, else the
    wheel's copy, else NAME on $PATH that is not this launcher."""
    env = os.environ.get(name.upper())
    if env:
        return env
    p = native(name)
    if p:
        return p
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    for d in os.environ.get("PATH", "").split(os.pathsep):
        c = os.path.join(d, name)
        if os.access(c, os.X_OK) and os.path.realpath(c) != me and not _is_launcher(c):
            return c
    return None


def _is_launcher(path):
    """A console script pip wrote (a Python file naming aoq._launch)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and b"aoq._launch" in head


def run(name, args):
    exe = find(name)
    if not exe:
        sys.stderr.write("aoq: %s not found: this aoq package carries none (not a wheel install?); set %s to its "
                         "path\n" % (name, name.upper()))
        return 127
    os.execv(exe, [name] + list(args))
    return 127  # not reached


def aoqd():
    return run("aoqd", sys.argv[1:])


def aoqctl():
    return run("aoqctl", sys.argv[1:])
