#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The project speaks of itself alone: no file says how it was made.

A reader can act on a date, a commit, a machine and a command, not on the
numbered stretch of work that wrote a line, a tracker's issue number, the
accelerator budget or the machine the work was done on, the document the
work was asked for in, or an assistant that did it.  This check reads every
tracked file (git ls-files; the source tree without hidden and build folders
when the tree is not a git checkout), skips binary files and the fuzzers'
corpus, and fails naming file:line and the kind of phrase for each hit.

An aoq session (the daemon's per-trainer object) is a domain word: "a second
session", "the session's lease" pass.  The patterns below are therefore the
phrases the project's history used, each with the narrowest context that
tells the two apart (PATTERNS says which).

Usage: check-words.py [SOURCE_ROOT]   (default: two folders above this file)
Exit 0: clean; 1: hits (listed); 2: usage.
"""
import os
import re
import subprocess
import sys

ORDINALS = ("fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth "
            "fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth").split()
UNITS = "first second third fourth fifth sixth seventh eighth ninth".split()
ORDINAL = ("(?:" + "|".join(ORDINALS + ["(?:twenty|thirty)-(?:%s)" % "|".join(UNITS)]) +
           r"|\d+(?:st|nd|rd|th))")

PATTERNS = [
    (re.compile(r"\b%s(?:\s+and\s+%s)?[\s,]+(?:work\s+)?sessions?\b" % (ORDINAL, ORDINAL), re.I),
     "a work session by its number"),
    # the fourth aoq session is common in the tests; the other use of the
    # ordinal came in brackets or with a possessive.
    (re.compile(r"(?:\(|, )fourth\s+sessions?\b|\bfourth\s+session(?:'s|\))", re.I), "a work session by its number"),
    (re.compile(r"\bwork\s+sessions?\b", re.I), "a work session"),
    (re.compile(r"\b(?:this|that|the\s+last|the\s+previous|an\s+earlier)\s+session(?:'s)?\s+"
                r"(?:aoqd|build|commits?|figures?|machine|measurements?|runs?|changes?|work|code)\b", re.I),
     "a work session"),
    (re.compile(r"\b(?:measured|built|run|ran|added|found|tried)\s+(?:in|during|by)\s+(?:this|that)\s+session\b",
                re.I), "a work session"),
    (re.compile(r"\bdevice[\s-]+time\b", re.I), "the accelerator budget"),
    (re.compile(r"\b(?:development|dev)\s+VMs?\b", re.I), "the machine of the work"),
    (re.compile(r"\b(?:the|design|team|project's)\s+brief\b|\bbrief's\b", re.I), "the document the work was asked in"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"#\d+\b(?=\s+(?:item|issue))", re.I), "an issue number"),
    (re.compile(r"\bhelpers?\s+`[\w-]+`", re.I), "a helper (assistant)"),
    (re.compile(r"\bmerged\s+helpers?\b|\bhelpers?'\s+(?:branch|branches|work)\b|\bsub-?agents?\b", re.I),
     "a helper (assistant)"),
]

SKIP_DIRS = ("tests/fuzz/corpus/",)


def tracked_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        files = [f for f in out.decode("utf-8", "surrogateescape").split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(root):
        rel = os.path.relpath(d, root)
        # Hidden folders (.git, local scratch) and build trees are not the source.
        dirs[:] = [x for x in dirs if not (x.startswith(".") or (rel == "." and x.startswith("build")))]
        for n in names:
            files.append(os.path.normpath(os.path.join(rel, n)))
    return files


def main(argv):
    if len(argv) > 2:
        print("usage: check-words.py [SOURCE_ROOT]", file=sys.stderr)
        return 2
    root = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    me = os.path.realpath(os.path.abspath(__file__))
    hits = 0
    checked = 0
    for rel in sorted(tracked_files(root)):
        if any(rel.startswith(s) for s in SKIP_DIRS):
            continue
        path = os.path.join(root, rel)
        if os.path.realpath(path) == me or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            print("%s: cannot read: %s" % (rel, e))
            hits += 1
            continue
        if b"\0" in data[:65536]:
            continue   # binary
        checked += 1
        text = data.decode("utf-8", "replace")
        # Phrases may wrap: match over the text with line breaks (and a
        # comment's leading "#", "//", "*") folded into one blank.
        folded = re.sub(r"\n[ \t]*(?:#+|//+|\*+|;+|--)?[ \t]*", " ", text)
        # Map a position in `folded` back to a line: fold again, counting.
        fold_map = []
        for m in re.finditer(r"\n[ \t]*(?:#+|//+|\*+|;+|--)?[ \t]*", text):
            fold_map.append((m.start(), m.end()))

        def line_at(fpos):
            shift = 0
            ln = 1
            for s, e in fold_map:
                if s - shift > fpos:
                    break
                shift += (e - s) - 1
                ln += 1
            return ln

        for rx, what in PATTERNS:
            for m in rx.finditer(folded):
                print("%s:%d: %s: '%s'" % (rel, line_at(m.start()), what, m.group(0)))
                hits += 1
    if hits:
        print("check-words: %d phrase(s) about how the project was made, in %d files checked; name a date, "
              "a commit, a machine and a command instead" % (hits, checked))
        return 1
    print("check-words: %d files, no word about how the project was made" % checked)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
