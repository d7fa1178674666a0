#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The Python package keeps to docs/design.md, "Where things live": every
module of client/python/aoq/ has a row, and imports only the package's
modules its row names, each of them below it in the table (so no import runs
upward and there is no cycle).  Imports are read from the modules' syntax
trees (relative imports, and absolute ones of aoq.X), wherever they stand,
inside functions too.

usage: check-python.py DESIGN_MD PACKAGE_DIR
"""
import ast
import os
import re
import sys

PREFIX = "client/python/aoq/"


def table(path):
    """[(module, set of modules it may import)] in table order."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^## \d+\. Where things live$(.*?)^## ", text, re.S | re.M)
    if not m:
        raise SystemExit("no \"Where things live\" section in %s" % path)
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            continue
        f = re.fullmatch(r"`%s([\w]+)\.py`" % re.escape(PREFIX), cells[0])
        if not f:
            continue
        may = set(re.findall(r"\b_?[a-z][a-z0-9_]*\b", cells[2])) - {"nothing", "in", "the", "package"}
        rows.append((f.group(1), may))
    return rows


def imports(path, modules):
    """The package's modules that the module at path imports."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            if n.level == 1 and n.module is None:          # from . import x
                out.update(a.name for a in n.names if a.name in modules)
            elif n.level == 1:
                out.add(n.module.split(".")[0])
            elif n.level == 0 and n.module and n.module.split(".")[0] == "aoq":
                parts = n.module.split(".")
                if len(parts) > 1:
                    out.add(parts[1])
                else:
                    out.update(a.name for a in n.names if a.name in modules)
            elif n.level > 1:
                out.add("..")
        elif isinstance(n, ast.Import):
            for a in n.names:
                parts = a.name.split(".")
                if parts[0] == "aoq" and len(parts) > 1:
                    out.add(parts[1])
    return out


def main():
    design, pkg = sys.argv[1:3]
    rows = table(design)
    if not rows:
        raise SystemExit("no %s rows in the \"Where things live\" section of %s" % (PREFIX, design))
    order = {name: i for i, (name, _) in enumerate(rows)}
    allowed = dict(rows)
    files = sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py"))
    modules = set(files)
    bad = []
    for name in files:
        if name not in allowed:
            bad.append("%s.py has no row in the table" % name)
    for name, may in rows:
        if name not in modules:
            bad.append("%s.py is in the table but not in %s" % (name, pkg))
        for m in sorted(may):
            if m in order and order[m] <= order[name]:
                bad.append("%s.py may import %s.py, which is not below it in the table" % (name, m))
    n = 0
    for name in files:
        if name not in allowed:
            continue
        for m in sorted(imports(os.path.join(pkg, name + ".py"), modules)):
            n += 1
            if m == name:
                continue
            if m not in allowed[name]:
                bad.append("%s.py imports %s, against the table" % (name, m))
    for b in bad:
        print("FAIL: %s" % b)
    print("aoq (Python): %d modules, %d imports checked" % (len(files), n))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
