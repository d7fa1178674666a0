# SPDX-License-Identifier: MIT
"""python -m aoq                    the package's version, libaoq's release and
                                    build, and the programs it runs
python -m aoq aoqd ARGS...          runs the aoqd the wheel carries
python -m aoq aoqctl ARGS...        runs the aoqctl the wheel carries"""
import sys

from . import _launch


def main(argv):
    if argv and argv[0] in ("aoqd", "aoqctl"):
        return _launch.run(argv[0], argv[1:])
    if argv and argv[0] not in ("-h", "--help", "--version", "version"):
        sys.stderr.write("usage: python -m aoq [aoqd|aoqctl ARGS...]\n")
        return 2
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    import aoq
    print("aoq %s" % aoq.__version__)
    try:
        print("libaoq %s (%s)" % (aoq.version(), aoq._lib.load().path))
    except (ImportError, OSError) as e:
        print("libaoq: not loadable: %s" % e)
    for name in ("aoqd", "aoqctl"):
        print("%s: %s" % (name, _launch.find(name) or "not found"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
