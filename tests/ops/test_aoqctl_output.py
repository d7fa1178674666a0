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
            check(name == current, f"{where}: sample outside its family's block (family {current})")
            lab = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
            fams.setdefault(name, {"samples": []})["samples"].append((name, lab, float(value)))
    for name, f in fams.items():
        check("type" in f and "help" in f, f"prometheus: {name} lacks HELP or TYPE")
        if f.get("type") == "counter":
            check(name.endswith("_total"), f"prometheus: counter {name} does not end in _total")
        seen = set()
        for s in f["samples"]:
            key = tuple(sorted(s[1].items()))
            check(key not in seen, f"prometheus: {name} repeats labels {key}")
            seen.add(key)
    return fams


def client_prometheus(text):
    """prometheus_client's parser, here or in Debian's python3; None when absent."""
    code = ("import sys\nfrom prometheus_client.parser import text_string_to_metric_families as p\n"
            "fams = list(p(sys.stdin.read()))\nprint(sum(len(f.samples) for f in fams))\n")
    for py in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(py):
            continue
        r = subprocess.run([py, "-c", "import prometheus_client"], capture_output=True)
        if r.returncode != 0:
            continue
        r = subprocess.run([py, "-c", code], input=text, capture_output=True, text=True)
        check(r.returncode == 0, f"prometheus_client rejects the text: {r.stderr[-2000:]}")
        return int(r.stdout) if r.returncode == 0 else -1
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
                        "optimizer_cpu_seconds", "rates", "state_bytes"):
                check(key in s, f"session has {key}")
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

        # ---- table
        t = aoqctl(sock, "stats").stdout
        check("JOBS" in t and "UIDS" in t and "alpha" in t, "the table has job and uid sections")
        check(re.match(r"\d{4}-\d\d-\d\dT", t) is not None, "the table starts with the timestamp")

        # ---- Prometheus
        text = aoqctl(sock, "stats", "--prometheus").stdout
        fams = strict_prometheus(text)
        for name, typ in (("aoq_session_bytes_in_total", "counter"), ("aoq_session_steps_total", "counter"),
                          ("aoq_session_optimizer_cpu_seconds_total", "counter"),
                          ("aoq_session_state_bytes", "gauge"), ("aoq_daemon_threads", "gauge"),
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
        n = client_prometheus(text)
        if n is None:
            print("note: prometheus_client is not installed; only the strict line check ran")
        else:
            check(n > 20, f"prometheus_client parsed {n} samples")

        # ---- -o FILE: written whole, then renamed
        out = os.path.join(tmp, "aoq.prom")
        aoqctl(sock, "stats", "--prometheus", "-o", out)
        with open(out) as f:
            strict_prometheus(f.read())
        check(not [x for x in os.listdir(tmp) if ".tmp." in x], "no temporary file left")

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
