#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoqctl's outputs, checked by parsers: the JSON of `stats --json` (and of
every line of `--watch`), the Prometheus text of `stats --prometheus` (a
strict line-format check here, and prometheus_client's parser when it is
installed), the per-job and per-uid rollups, `-o FILE`, and usage errors.

    test_aoqctl_output.py AOQD AOQCTL AOQ_DEMO
"""
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

AOQD, AOQCTL, DEMO = sys.argv[1:4]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def aoqctl(sock, *args, ok=True):
    p = subprocess.run([AOQCTL, "--socket", sock, *args], capture_output=True, text=True, timeout=30)
    if ok and p.returncode != 0:
        raise SystemExit(f"aoqctl {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p


# ---- a strict check of the text exposition format 0.0.4 ----------------
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(rf"^({NAME})(\{{(?:{LABEL})(?:,{LABEL})*\}})? (\S+)$")
VALUE = re.compile(r"^(?:[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|NaN|[+-]Inf)$")


def strict_prometheus(text):
    """Returns {family: {"type", "help", "samples": [(name, labels, value)]}}."""
    fams, current = {}, None
    check(text.endswith("\n"), "prometheus: the text ends with a newline")
    for n, line in enumerate(text.split("\n")[:-1], 1):
        where = f"prometheus line {n}: {line!r}"
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            check(re.fullmatch(NAME, name) is not None, f"{where}: metric name")
            check(name not in fams or "help" not in fams[name], f"{where}: second HELP")
            check(help_.strip() != "", f"{where}: empty HELP")
            fams.setdefault(name, {"samples": []})["help"] = help_
            current = name
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            check(typ in ("counter", "gauge", "summary", "histogram", "untyped"), f"{where}: type")
            f = fams.setdefault(name, {"samples": []})
            check("type" not in f and not f["samples"], f"{where}: TYPE after samples or twice")
            f["type"] = typ
            current = name
        elif line.startswith("#"):
            continue
        else:
            m = SAMPLE.match(line)
            check(m is not None, f"{where}: not a sample line")
            if not m:
                continue
            name, labels, value = m.groups()
            check(VALUE.match(value) is not None, f"{where}: value")
            fam = name
            ctype = fams.get(current, {}).get("type")
            for suffix in ("_sum", "_count", "_bucket"):
                if ctype in ("summary", "histogram") and name == f"{current}{suffix}" and \
                        (suffix != "_bucket" or ctype == "histogram"):
                    fam = current
            check(fam == current, f"{where}: sample outside its family's block (family {current})")
            lab = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
            fams.setdefault(fam, {"samples": []})["samples"].append((name, lab, float(value)))
    # a summary's or histogram's samples carry the family's name with a suffix
    for name in list(fams):
        f = fams[name]
        if "type" in f or not f["samples"]:
            continue
        for suffix in ("_sum", "_count", "_bucket"):
            base = name[: -len(suffix)]
            if name.endswith(suffix) and fams.get(base, {}).get("type") in ("summary", "histogram"):
                check(False, f"prometheus: {name} has a block of its own, apart from {base}")
    for name, f in fams.items():
        check("type" in f and "help" in f, f"prometheus: {name} lacks HELP or TYPE")
        typ = f.get("type")
        for sname, lab, value in f["samples"]:
            check("quantile" not in lab or (typ == "summary" and sname == name),
                  f"prometheus: {sname}: a quantile label outside a summary's quantile samples")
            check("le" not in lab or (typ == "histogram" and sname == name + "_bucket"),
                  f"prometheus: {sname}: an le label outside a histogram's buckets")
        if typ in ("summary", "histogram"):
            groups = {}
            for sname, lab, value in f["samples"]:
                key = tuple(sorted((k, v) for k, v in lab.items() if k not in ("quantile", "le")))
                groups.setdefault(key, []).append((sname, lab, value))
            for key, ss in groups.items():
                names = [x[0] for x in ss]
                check(names.count(name + "_sum") == 1 and names.count(name + "_count") == 1,
                      f"prometheus: {typ} {name}{dict(key)} has one _sum and one _count: {names}")
                counts = [v for n_, _, v in ss if n_ == name + "_count"]
                check(all(c >= 0 and c == math.floor(c) for c in counts), f"prometheus: {name}_count {counts}")
                if typ == "summary":
                    qs = [(float(lab["quantile"]), v) for n_, lab, v in ss if n_ == name]
                    check(qs and all(0 <= q <= 1 for q, _ in qs), f"prometheus: {name} quantiles {qs}")
                    check(all(n_ in (name, name + "_sum", name + "_count") for n_ in names),
                          f"prometheus: summary {name} sample names {names}")
                else:
                    bs = sorted((float(lab["le"]), v) for n_, lab, v in ss if n_ == name + "_bucket")
                    check(bs and math.isinf(bs[-1][0]), f"prometheus: histogram {name} has a +Inf bucket")
                    check(all(a[1] <= b[1] for a, b in zip(bs, bs[1:])), f"prometheus: {name} buckets grow")
                    check(bs and counts and bs[-1][1] == counts[0], f"prometheus: {name}'s +Inf bucket is _count")
        if f.get("type") == "counter":
            check(name.endswith("_total"), f"prometheus: counter {name} does not end in _total")
        seen = set()
        for s in f["samples"]:
            key = (s[0],) + tuple(sorted(s[1].items()))
            check(key not in seen, f"prometheus: {name} repeats labels {key}")
            seen.add(key)
    return fams


def client_prometheus(text):
    """prometheus_client's parser, here or in Debian's python3: (samples, {family: type});
    None when absent."""
    code = ("import json, sys\nfrom prometheus_client.parser import text_string_to_metric_families as p\n"
            "fams = list(p(sys.stdin.read()))\n"
            "print(json.dumps([sum(len(f.samples) for f in fams), {f.name: f.type for f in fams}]))\n")
    for py in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(py):
            continue
        r = subprocess.run([py, "-c", "import prometheus_client"], capture_output=True)
        if r.returncode != 0:
            continue
        r = subprocess.run([py, "-c", code], input=text, capture_output=True, text=True)
        check(r.returncode == 0, f"prometheus_client rejects the text: {r.stderr[-2000:]}")
        return json.loads(r.stdout) if r.returncode == 0 else (-1, {})
    return None


def main():
    tmp = tempfile.mkdtemp(prefix="aoq-ctl-")
    sock = os.path.join(tmp, "aoqd.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(sock)
    lst.listen(64)
    daemon = subprocess.Popen([AOQD, "--listen-fd", str(lst.fileno()), "--threads", "1", "--log-level", "warn"],
                              pass_fds=[lst.fileno()])
    lst.close()
    weird = 'we"ird\\job é'
    demos = []
    try:
        for job, rank in (("alpha", 0), ("alpha", 1), (weird, 0)):
            demos.append(subprocess.Popen([DEMO, "--socket", sock, "--device", "cpu", "--job", job, "--rank",
                                           str(rank), "--steps", "10000000"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # wait until the three sessions train
        for _ in range(200):
            st = json.loads(aoqctl(sock, "stats", "--json").stdout)
            if len(st["sessions"]) == 3 and all(s["steps"] > 0 for s in st["sessions"]):
                break
            time.sleep(0.05)
        check(len(st["sessions"]) == 3, f"3 sessions, got {len(st['sessions'])}")

        # ---- JSON
        p = aoqctl(sock, "stats", "--json")
        raw = p.stdout
        st = json.loads(raw)
        check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", st["timestamp"]) is not None,
              f"timestamp {st['timestamp']}")
        check(abs(st["timestamp_unix"] - time.time()) < 60, "timestamp_unix is now")
        digits = [len(re.sub(r"\D", "", m).lstrip("0")) for m in re.findall(r"-?\d+\.\d+", raw)]
        check(digits and max(digits) <= 13, f"floats print short (%.6g, or %.3f for times): {max(digits)} digits")
        for key in ("version", "pid", "threads", "kernel", "locked_bytes", "rss_bytes", "uptime_seconds",
                    "loop_spin_us", "loop_spin_seconds", "loop_spin_takes", "loop_spin_busy",
                    "sessions", "jobs", "uids"):
            check(key in st, f"JSON has {key}")
        ss = st["sessions"]
        for s in ss:
            for key in ("id", "job", "rank", "uid", "steps", "parameters", "bytes_in", "bytes_out",
                        "optimizer_cpu_seconds", "rates", "state_bytes", "tensors_released"):
                check(key in s, f"session has {key}")
            check(s["tensors_released"] == 0, f"session {s['id']}: {s['tensors_released']} tensors released")
        check(weird in [s["job"] for s in ss], "the odd job name survives JSON escaping")
        jobs = {(j["uid"], j["job"]): j for j in st["jobs"]}
        check(len(jobs) == 2, f"two job rows, got {list(jobs)}")
        alpha = [s for s in ss if s["job"] == "alpha"]
        ja = jobs.get((os.getuid(), "alpha"), {})
        check(ja.get("sessions") == 2, "job alpha has 2 sessions")
        check(ja.get("parameters") == sum(s["parameters"] for s in alpha), "job parameters are the sum")
        check(ja.get("bytes_in") == sum(s["bytes_in"] for s in alpha), "job bytes_in is the sum")
        check(ja.get("steps_max") == max(s["steps"] for s in alpha), "job steps_max is the max")
        uids = st["uids"]
        check(len(uids) == 1 and uids[0]["sessions"] == 3 and uids[0]["jobs"] == 2,
              f"one uid row with 3 sessions in 2 jobs: {uids}")
        check(uids[0]["parameters"] == sum(s["parameters"] for s in ss), "uid parameters are the sum")

        # ---- rates: the daemon's last interval (1 s); wait for one to end
        for _ in range(100):
            st = json.loads(aoqctl(sock, "stats", "--json").stdout)
            if all(s["rates"] and s["rates"]["steps_per_second"] > 0 for s in st["sessions"]):
                break
            time.sleep(0.1)
        check(abs(st["timestamp_unix"] - time.time()) < 5, "the daemon's timestamp is now")
        for s in st["sessions"]:
            r = s["rates"]
            check(r is not None, f"session {s['id']} has rates")
            if not r:
                continue
            check(0.5 <= r.get("interval_seconds", 0) <= 3, f"rate interval {r.get('interval_seconds')}")
            sps = r["steps_per_second"]
            check(sps > 0, f"steps_per_second {sps} > 0")
            if sps > 0:
                # each step updates every parameter: params/s = parameters x steps/s
                # (the interval's edges cut steps, hence the factor)
                ratio = r["params_per_second"] / (s["parameters"] * sps)
                check(0.5 <= ratio <= 2, f"params_per_second {r['params_per_second']} vs parameters "
                      f"{s['parameters']} x steps/s {sps}: ratio {ratio}")
                check(r["bytes_in_per_second"] >= r["params_per_second"] * 2 * 0.99,
                      f"bytes_in/s {r['bytes_in_per_second']} covers 2+ bytes a parameter")
                check(r["bytes_out_per_second"] > 0, f"bytes_out/s {r['bytes_out_per_second']}")

        # ---- versions: the daemon's and aoqctl's, each the release and the build
        ctl_v = subprocess.run([AOQCTL, "--version"], capture_output=True, text=True).stdout.split()
        d_v = subprocess.run([AOQD, "--version"], capture_output=True, text=True).stdout.split()
        check(len(ctl_v) >= 2 and len(d_v) >= 2 and re.fullmatch(r"\d+\.\d+\.\d+(\+[\w.-]+)?", d_v[1]) is not None,
              f"--version: aoqd {d_v}, aoqctl {ctl_v}")
        check(st["version"] == d_v[1] and st.get("client_version") == ctl_v[1],
              f"stats --json: version {st['version']} (aoqd --version {d_v[1]}), client_version "
              f"{st.get('client_version')} (aoqctl --version {ctl_v[1]})")

        # ---- table
        t = aoqctl(sock, "stats").stdout
        check(f"aoqd {d_v[1]}" in t and f"aoqctl {ctl_v[1]}" in t, "the table shows both versions")
        check("JOBS" in t and "UIDS" in t and "alpha" in t, "the table has job and uid sections")
        check(re.match(r"\d{4}-\d\d-\d\dT", t) is not None, "the table starts with the timestamp")

        # ---- Prometheus
        text = aoqctl(sock, "stats", "--prometheus").stdout
        fams = strict_prometheus(text)
        for name, typ in (("aoq_session_bytes_in_total", "counter"), ("aoq_session_steps_total", "counter"),
                          ("aoq_session_optimizer_cpu_seconds_total", "counter"),
                          ("aoq_session_state_bytes", "gauge"), ("aoq_session_tensors_released", "gauge"),
                          ("aoq_daemon_threads", "gauge"),
                          ("aoq_daemon_loop_spin_setting_seconds", "gauge"),
                          ("aoq_daemon_loop_spin_seconds_total", "counter"),
                          ("aoq_daemon_loop_spin_takes_total", "counter"),
                          ("aoq_daemon_loop_spin_busy_total", "counter")):
            check(fams.get(name, {}).get("type") == typ, f"{name} is a {typ}")
        samples = fams.get("aoq_session_bytes_in_total", {}).get("samples", [])
        check(len(samples) == 3, "a bytes_in sample per session")
        for _, lab, _ in samples:
            check(set(lab) == {"session", "job", "rank", "uid"}, f"labels session/job/rank/uid: {lab}")
        check(any(lab.get("job") == 'we\\"ird\\\\job é' for _, lab, _ in samples),
              "the odd job name is escaped in its label")
        # the latency quantiles: summaries, with a _sum and a _count per session
        for name in ("aoq_session_chunk_latency_seconds", "aoq_session_record_latency_seconds"):
            f = fams.get(name, {})
            check(f.get("type") == "summary", f"{name} is a summary, not {f.get('type')}")
            got = f.get("samples", [])
            for sid in {lab["session"] for _, lab, _ in got}:
                mine = {(n_, lab.get("quantile")): v for n_, lab, v in got if lab["session"] == sid}
                q50, q99 = mine.get((name, "0.5")), mine.get((name, "0.99"))
                total, count = mine.get((name + "_sum", None)), mine.get((name + "_count", None))
                check(None not in (q50, q99, total, count), f"{name} session {sid}: p50, p99, sum, count: {mine}")
                if None in (q50, q99, total, count):
                    continue
                check(count > 0 and total > 0, f"{name} session {sid}: count {count}, sum {total} of a training session")
                check(0 < q50 <= q99 < 10, f"{name} session {sid}: 0 < p50 {q50} <= p99 {q99} < 10 s")
                if count > 0:
                    # the mean against the quantiles: buckets are 1/8 octave wide
                    check(total / count < q99 * 10 and total / count > q50 / 100,
                          f"{name} session {sid}: mean {total / count} beside p50 {q50}, p99 {q99}")
            check(len({lab["session"] for _, lab, _ in got}) == 3, f"{name}: three sessions")
        n = client_prometheus(text)
        if n is None:
            if os.environ.get("CI"):
                check(False, "prometheus_client is not installed (python3-prometheus-client), and CI is set")
            print("note: prometheus_client is not installed; only the strict line check ran")
        else:
            check(n[0] > 20, f"prometheus_client parsed {n[0]} samples")
            for name in ("aoq_session_chunk_latency_seconds", "aoq_session_record_latency_seconds"):
                check(n[1].get(name) == "summary", f"prometheus_client reads {name} as {n[1].get(name)}")
            check(n[1].get("aoq_session_steps") == "counter", f"prometheus_client: steps_total {n[1]}")

        # ---- -o FILE: written whole, then renamed
        out = os.path.join(tmp, "aoq.prom")
        aoqctl(sock, "stats", "--prometheus", "-o", out)
        with open(out) as f:
            strict_prometheus(f.read())
        check(not [x for x in os.listdir(tmp) if ".tmp." in x], "no temporary file left")
        # the table to a file too, and nothing on stdout
        tout = os.path.join(tmp, "aoq.txt")
        p = aoqctl(sock, "stats", "-o", tout)
        check(p.stdout == "", f"stats -o FILE prints nothing: {p.stdout[:200]!r}")
        with open(tout) as f:
            t = f.read()
        check("JOBS" in t and "UIDS" in t and "alpha" in t, f"stats -o FILE holds the table: {t[:200]!r}")
        os.unlink(tout)
        p = aoqctl(sock, "stats", "--json", "-o", tout)
        with open(tout) as f:
            check(len(json.load(f)["sessions"]) == 3 and p.stdout == "", "stats --json -o FILE")
        os.unlink(tout)

        # ---- --watch: one JSON object per line, ends cleanly on SIGINT
        w = subprocess.Popen([AOQCTL, "--socket", sock, "stats", "--json", "--watch", "0.2"],
                             stdout=subprocess.PIPE, text=True)
        time.sleep(1.1)
        w.send_signal(signal.SIGINT)
        wout, _ = w.communicate(timeout=10)
        check(w.returncode == 0, f"--watch exits 0 on SIGINT, got {w.returncode}")
        lines = [x for x in wout.split("\n") if x]
        check(len(lines) >= 3, f"--watch 0.2 printed {len(lines)} objects in 1.1 s")
        ts = []
        for x in lines:
            try:
                ts.append(json.loads(x)["timestamp_unix"])
            except (ValueError, KeyError) as e:
                check(False, f"--watch line is not a stats object: {e}")
        check(ts == sorted(ts) and len(set(ts)) == len(ts), "--watch timestamps advance")
        # "--watch 0" (a space): as often as --watch allows (0.1 s), as --watch=0
        for form in (["--watch", "0"], ["--watch=0"], ["-w", "0"]):
            w = subprocess.Popen([AOQCTL, "--socket", sock, "stats", "--json", *form],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.75)
            w.send_signal(signal.SIGINT)
            wout, werr = w.communicate(timeout=10)
            lines = [x for x in wout.split("\n") if x]
            check(w.returncode == 0 and 3 <= len(lines) <= 10,
                  f"stats --json {' '.join(form)}: rc {w.returncode}, {len(lines)} objects in 0.75 s, {werr!r}")

        # ---- trace: 3 steps of a training session, the daemon's spans
        s0 = ss[0]
        tfile = os.path.join(tmp, "t.json")
        aoqctl(sock, "trace", str(s0["id"]), "--steps", "3", "-o", tfile)
        with open(tfile) as f:
            tr = json.load(f)
        spans = [e for e in tr["traceEvents"] if e.get("ph") in ("X", "b", "e")]
        steps = sorted({e["args"]["step"] for e in spans if "args" in e})
        check(len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3)),
              f"the trace holds 3 consecutive steps: {steps}")
        for step in steps:
            cpu = [e for e in spans if e["ph"] == "X" and e.get("cat") == "CPU update" and e["args"]["step"] == step]
            queue = [e for e in spans if e["ph"] == "b" and e["args"]["step"] == step]
            tensors = {e["args"]["tensor"] for e in cpu}
            check(len(tensors) == s0["tensors"], f"step {step}: CPU updates of {len(tensors)} tensors, "
                  f"want {s0['tensors']}")
            check(sum(e["args"]["count"] for e in cpu) == s0["parameters"],
                  f"step {step}: the CPU spans cover every parameter once")
            check(len(queue) == len({(e["args"]["tensor"], e["args"]["offset"]) for e in cpu}) and queue,
                  f"step {step}: a queue-wait span per record ({len(queue)})")
            check(all(e["dur"] >= 0 for e in cpu), "durations are not negative")
            # the trainer's copies (libaoq, host backend): a D2H and an H2D span
            # per record, the D2H over before the record's first CPU chunk
            # starts, the H2D after its last chunk ends (ts and dur in us)
            recs = {(e["args"]["tensor"], e["args"]["offset"], e["args"]["count"]) for e in queue}
            for cat in ("D2H", "H2D"):
                got = [e for e in spans if e["ph"] == "X" and e.get("cat") == cat and e["args"]["step"] == step]
                have = {(e["args"]["tensor"], e["args"]["offset"], e["args"]["count"]) for e in got}
                check(len(got) == len(recs) and have == recs,
                      f"step {step}: a {cat} span per record ({len(got)} spans, {len(recs)} records)")
                for e in got:
                    name, off, cnt = e["args"]["tensor"], e["args"]["offset"], e["args"]["count"]
                    mine = [x for x in cpu if x["args"]["tensor"] == name and off <= x["args"]["offset"] < off + cnt]
                    if not mine:
                        check(False, f"step {step}: no CPU update for the {cat} of {name}@{off}")
                        continue
                    if cat == "D2H":
                        first = min(x["ts"] for x in mine)
                        check(e["ts"] + e["dur"] <= first + 0.002,
                              f"step {step}: D2H of {name}@{off} ends {e['ts'] + e['dur']} after its update "
                              f"starts {first}")
                    else:
                        last = max(x["ts"] + x["dur"] for x in mine)
                        check(e["ts"] >= last - 0.002,
                              f"step {step}: H2D of {name}@{off} starts {e['ts']} before its update ends {last}")
                    check(e["dur"] >= 0 and e["dur"] < 10e6, f"step {step}: {cat} duration {e['dur']} us")
        names = {e["args"]["name"] for e in tr["traceEvents"] if e.get("ph") == "M"}
        check("worker 0" in " ".join(names) or any("worker" in n for n in names), f"a worker lane: {names}")
        # a session nobody may trace: refused, no file
        p = aoqctl(sock, "trace", "999999", "--steps", "3", "-o", os.path.join(tmp, "t2.json"), ok=False)
        check(p.returncode != 0 and not os.path.exists(os.path.join(tmp, "t2.json")),
              f"trace of no session fails: {p.returncode} {p.stderr!r}")
        check("is aoqd running" not in p.stderr and "999999" in p.stderr,
              f"trace of no session names the session, not a daemon that is not running: {p.stderr!r}")
        p = subprocess.run([AOQCTL, "--socket", os.path.join(tmp, "none.sock"), "stats"], capture_output=True,
                           text=True, timeout=30)
        check(p.returncode == 1 and "is aoqd running" in p.stderr, f"no daemon: the hint: {p.stderr!r}")

        # ---- a job name that would drive a terminal: C0 (ESC) and C1 (CSI)
        # controls, bidi overrides and isolates, zero-width and other format
        # characters; each is one '?' in the tables, U+FFFD in JSON
        evil = "ev\x1b[2Jil\u009b31m\u202egnp.exe\u2066x\u2069\u200b\u00ad\ufeff\U000e0041\u061cé"
        bad = "\x1b\u009b\u202e\u2066\u2069\u200b\u00ad\ufeff\U000e0041\u061c"
        d = subprocess.Popen([DEMO, "--socket", sock, "--device", "cpu", "--job", evil, "--steps", "10000000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        demos.append(d)
        for _ in range(200):
            st = json.loads(aoqctl(sock, "stats", "--json").stdout)
            if len(st["sessions"]) == 4:
                break
            time.sleep(0.05)
        check(len(st["sessions"]) == 4, "the fourth session (the odd name) is up")
        for cmd in (["stats"], ["sessions"]):
            raw = subprocess.run([AOQCTL, "--socket", sock, *cmd], capture_output=True, timeout=30).stdout
            txt = raw.decode("utf-8", "strict")
            check(not any(c in txt for c in bad) and not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", txt),
                  f"aoqctl {cmd[0]}: no control or format character reaches the terminal")
            want = "ev?[2Jil?31m?gnp.exe?x??????é"
            check(want in txt, f"aoqctl {cmd[0]}: each such character is one '?': {want!r} not in the table")
        js = aoqctl(sock, "stats", "--json").stdout
        check(not any(c in js for c in bad) and "\\u001b" not in js, "JSON: no control or format character")
        jobs = [s["job"] for s in json.loads(js)["sessions"]]
        check("ev\ufffd[2Jil\ufffd31m\ufffdgnp.exe\ufffdx" + "\ufffd" * 6 + "é" in jobs,
              f"JSON: each such character is one U+FFFD: {jobs}")
        pr = aoqctl(sock, "stats", "--prometheus").stdout
        check(not any(c in pr for c in bad), "Prometheus labels: no control or format character")
        d.kill()
        d.wait()

        # ---- usage errors (exit 2, naming the option)
        for args, want in ((["stats", "--json", "--prometheus"], "--json and --prometheus"),
                           (["stats", "--watch=abc"], "--watch: 'abc'"),
                           (["stats", "--prometheus", "--watch"], "--watch does not go with --prometheus"),
                           (["trace"], "trace: which session?"),
                           (["trace", "x", "-o", "f"], "'x' is not a session id"),
                           (["trace", "1"], "-o FILE is required"),
                           (["drop"], "drop: which session?"),
                           (["drop", "abc"], "drop: 'abc' is not a session id"),
                           (["drop", "3", "4"], "unexpected argument '4'"),
                           (["snapshot", "0"], "snapshot: '0' is not a session id"),
                           (["trace", "1", "--steps", "0", "-o", "f"], "--steps: '0'"),
                           (["sessions", "--json"], "--json goes with 'stats'"),
                           (["stats", "extra"], "unexpected argument 'extra'")):
            p = aoqctl(sock, *args, ok=False)
            check(p.returncode == 2 and want in p.stderr, f"aoqctl {args}: {p.returncode} {p.stderr!r}")
    finally:
        for d in demos:
            d.kill()
            d.wait()
        daemon.terminate()
        daemon.wait(timeout=30)
        for x in os.listdir(tmp):
            os.unlink(os.path.join(tmp, x))
        os.rmdir(tmp)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


sys.exit(main())
