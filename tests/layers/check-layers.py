#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The daemon keeps to docs/design.md, "Where things live": every call from
one file of aoqd-core to a function defined in another is to a file the
table lets it call.  Calls are read from the compiled objects (nm: each
object's undefined aoqd_ symbols, matched to the object defining them), so
a call the table forbids fails this test whatever the includes say.

usage: check-layers.py DESIGN_MD NM LIBAOQD_CORE_A
"""
import os
import re
import subprocess
import sys

def table(path):
    """{file stem: set of stems it may call} from the "Where things live" table."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^## \d+\. Where things live$(.*?)^## ", text, re.S | re.M)
    if not m:
        raise SystemExit("no \"Where things live\" section in %s" % path)
    allowed = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`(\w+)\.c`", cells[0])
        may = set(re.findall(r"[a-z]+", re.sub(r"\(.*?\)", "", cells[2])))
        for n in names:
            allowed[n] = may
    return allowed


def symbols(nm, lib):
    defined, undefined = {}, {}
    out = subprocess.run([nm, "-A", lib], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"(.*?):\s*(?:[0-9a-f]+)?\s+([TUDBR])\s+(aoqd_\w+)$", line)
        if not m:
            continue
        stem = os.path.basename(m.group(1).split(":")[-1])
        stem = stem.split(".")[0]
        if m.group(2) == "U":
            undefined.setdefault(stem, set()).add(m.group(3))
        else:
            defined[m.group(3)] = stem
    return defined, undefined


def main():
    design, nm, lib = sys.argv[1:4]
    allowed = table(design)
    defined, undefined = symbols(nm, lib)
    stems = set(defined.values()) | set(undefined)
    bad = []
    for stem in sorted(stems):
        if stem not in allowed:
            bad.append("%s.c is not in the table" % stem)
    for stem, syms in sorted(undefined.items()):
        for sym in sorted(syms):
            owner = defined.get(sym)
            if owner is None or owner == stem:
                continue
            if owner not in allowed.get(stem, set()):
                bad.append("%s.c calls %s (%s.c), against the table" % (stem, sym, owner))
    for b in bad:
        print("FAIL:", b)
    print("%d files, %d cross-file calls checked" % (len(stems), sum(len(s) for s in undefined.values())))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
