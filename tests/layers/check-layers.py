#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The daemon keeps to docs/design.md, "Where things live": every call from
one file of aoqd-core to a function defined in another is to a file the
table lets it call.  Calls are read from the compiled objects (nm: each
object's undefined aoqd_ symbols, matched to the object defining them), so
a call the table forbids fails this test whatever the includes say.

libaoq keeps to its own table in the same section (rows of `client/` files),
checked the same way on an archive of libaoq's objects: every global symbol
one of its C files uses from another.

aoqctl's files keep theirs (rows of `client/tools/` files), checked on an
archive of aoqctl's objects: every ctl_ function one file uses from another.

usage: check-layers.py DESIGN_MD NM LIBAOQD_CORE_A [LIBAOQ_OBJECTS_A [AOQCTL_OBJECTS_A]]
"""
import os
import re
import subprocess
import sys

def table(path, prefix=""):
    """{file stem: set of stems it may call} from the "Where things live"
    rows whose files lie under prefix ("": the daemon's, "client/": libaoq's;
    a file in a folder below it is named folder_file, as meson names its
    object)."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^## \d+\. Where things live$(.*?)^## ", text, re.S | re.M)
    if not m:
        raise SystemExit("no \"Where things live\" section in %s" % path)
    allowed = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([\w/-]+)\.c`", cells[0])
        may = re.findall(r"[a-z][\w/-]*", re.sub(r"\(.*?\)", "", cells[2]))
        may = {w.replace("/", "_") for w in may}
        for n in names:
            if "/" in n and not prefix:
                continue
            if prefix and not n.startswith(prefix):
                continue
            allowed[n[len(prefix):].replace("/", "_")] = may
    return allowed


def symbols(nm, lib, names=r"aoqd_\w+", c_only=False):
    defined, undefined = {}, {}
    out = subprocess.run([nm, "-A", lib], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"(.*?):\s*(?:[0-9a-f]+)?\s+([TUDBR])\s+(" + names + r")$", line)
        if not m:
            continue
        stem = os.path.basename(m.group(1).split(":")[-1])
        if c_only and not stem.endswith(".c.o"):
            continue  # an object built elsewhere (the CUDA kernels): outside
        stem = stem.split(".")[0]
        if m.group(2) == "U":
            undefined.setdefault(stem, set()).add(m.group(3))
        else:
            defined[m.group(3)] = stem
    return defined, undefined


def check(allowed, defined, undefined, always, what):
    stems = set(defined.values()) | set(undefined)
    bad = []
    for stem in sorted(stems):
        if stem not in allowed:
            bad.append("%s.c is not in the table" % stem)
    for stem, syms in sorted(undefined.items()):
        for sym in sorted(syms):
            owner = defined.get(sym)
            if owner is None or owner == stem or sym in always:
                continue
            if owner not in allowed.get(stem, set()):
                bad.append("%s.c calls %s (%s.c), against the table" % (stem, sym, owner))
    for b in bad:
        print("FAIL: %s: %s" % (what, b))
    print("%s: %d files, %d cross-file calls checked" % (what, len(stems), sum(len(s) for s in undefined.values())))
    return len(bad)


def main():
    design, nm, lib = sys.argv[1:4]
    bad = check(table(design), *symbols(nm, lib), set(), "aoqd")
    if len(sys.argv) > 4:
        client = table(design, "client/")
        if not client:
            raise SystemExit("no client/ rows in the \"Where things live\" section of %s" % design)
        bad += check(client, *symbols(nm, sys.argv[4], r"\w+", True), set(), "libaoq")
    if len(sys.argv) > 5:
        tools = table(design, "client/tools/")
        if not tools:
            raise SystemExit("no client/tools/ rows in the \"Where things live\" section of %s" % design)
        bad += check(tools, *symbols(nm, sys.argv[5], r"ctl_\w+", True), set(), "aoqctl")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
