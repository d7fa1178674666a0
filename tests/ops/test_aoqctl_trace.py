#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""aoqctl trace against a stand-in daemon: a socket here answers Hello with
Welcome and TraceRequest with two Trace frames (more = true, then false) of
a 3-step run, encoded by hand from proto/aoq.proto's field numbers (the real
aoqd has no trace recorder yet).  The file aoqctl writes must parse as
Chrome trace-event JSON with, per step and tensor, the D2H, queue wait, CPU
update and H2D spans at the right times.

    test_aoqctl_trace.py AOQCTL
"""
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

AOQCTL = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def field_bytes(num, b):
    return varint(num << 3 | 2) + varint(len(b)) + b


def read_varint(buf, i):
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def fields(buf):
    """Top-level fields of a message: {number: value or bytes}."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            out[num], i = read_varint(buf, i)
        elif wt == 2:
            ln, i = read_varint(buf, i)
            out[num] = buf[i:i + ln]
            i += ln
        else:
            raise ValueError(f"wire type {wt}")
    return out


def recv_frame(conn):
    hdr = b""
    while len(hdr) < 4:
        c = conn.recv(4 - len(hdr))
        if not c:
            return None
        hdr += c
    n = struct.unpack("<I", hdr)[0]
    body = b""
    while len(body) < n:
        body += conn.recv(n - len(body))
    return fields(body)


def send_frame(conn, env):
    conn.sendall(struct.pack("<I", len(env)) + env)


SESSION, T0 = 7, 5_000_000_000
TENSORS = ["w1", "b1", "w2"]
# kind: 0 D2H, 1 queue wait, 2 CPU update, 3 H2D
SPANS = []
for step in (1, 2, 3):
    for t in range(3):
        base = T0 + step * 1_000_000 + t * 100_000
        SPANS += [(step, t, 0, base, 20_000, 0), (step, t, 1, base + 20_000, 5_000, 0),
                  (step, t, 2, base + 25_000, 30_000, t % 2), (step, t, 3, base + 55_000, 20_000, 0)]


def span_msg(s):
    step, t, kind, start, dur, worker = s
    return (field_varint(1, step) + field_varint(2, t) + field_varint(3, kind) + field_varint(4, start) +
            field_varint(5, dur) + field_varint(6, worker) + field_varint(7, 0) + field_varint(8, 64))


requests = []


def server(lst):
    conn, _ = lst.accept()
    with conn:
        hello = recv_frame(conn)
        requests.append(("hello", hello))
        send_frame(conn, field_bytes(3, field_varint(1, 99)))  # Welcome{session_id = 99}
        req = recv_frame(conn)
        requests.append(("trace", req))
        half = len(SPANS) // 2
        first = (field_varint(1, SESSION) + b"".join(field_bytes(2, n.encode()) for n in TENSORS) +
                 b"".join(field_bytes(3, span_msg(s)) for s in SPANS[:half]) + field_varint(4, 1) +
                 field_bytes(5, b"llama") + field_varint(6, 2))
        second = (field_varint(1, SESSION) + b"".join(field_bytes(3, span_msg(s)) for s in SPANS[half:]))
        send_frame(conn, field_bytes(18, first))
        send_frame(conn, field_bytes(18, second))
        recv_frame(conn)  # Bye


def main():
    tmp = tempfile.mkdtemp(prefix="aoq-trace-")
    sock = os.path.join(tmp, "fake.sock")
    out = os.path.join(tmp, "trace.json")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(sock)
    lst.listen(1)
    th = threading.Thread(target=server, args=(lst,), daemon=True)
    th.start()
    p = subprocess.run([AOQCTL, "--socket", sock, "trace", str(SESSION), "--steps", "3", "-o", out],
                       capture_output=True, text=True, timeout=30)
    th.join(timeout=10)
    check(p.returncode == 0, f"aoqctl trace exited {p.returncode}: {p.stderr}")
    req = dict(requests).get("trace", {})
    tr = fields(req.get(17, b""))
    check(tr.get(1) == SESSION and tr.get(2) == 3, f"TraceRequest{{session 7, steps 3}}: {tr}")
    try:
        with open(out) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        check(False, f"trace file: {e}")
        doc = {"traceEvents": []}
    ev = doc.get("traceEvents")
    check(isinstance(ev, list), "traceEvents is a list")
    for e in ev:
        check(e.get("ph") in ("X", "b", "e", "M"), f"phase of {e}")
        check(isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int), f"pid/tid of {e}")
        if e["ph"] in ("X", "b", "e"):
            check(isinstance(e.get("ts"), (int, float)), f"ts of {e}")
        if e["ph"] == "X":
            check(isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, f"dur of {e}")
    xs = [e for e in ev if e["ph"] == "X"]
    begins = [e for e in ev if e["ph"] == "b"]
    ends = [e for e in ev if e["ph"] == "e"]
    for cat, n in (("D2H", 9), ("CPU update", 9), ("H2D", 9)):
        got = [e for e in xs if e.get("cat") == cat]
        check(len(got) == n, f"{n} {cat} spans, got {len(got)}")
    check(len(begins) == 9 and len(ends) == 9, f"9 queue waits (b/e), got {len(begins)}/{len(ends)}")
    check(sorted(e["id"] for e in begins) == sorted(e["id"] for e in ends), "queue b/e ids pair up")
    per = {}
    for e in xs + begins:
        a = e.get("args", {})
        per.setdefault((a.get("step"), a.get("tensor")), set()).add(e.get("cat"))
    want = {(s, n) for s in (1, 2, 3) for n in TENSORS}
    check(set(per) == want, f"spans for every step and tensor: {sorted(per)}")
    check(all(v == {"D2H", "queue", "CPU update", "H2D"} for v in per.values()), "four kinds per step and tensor")
    # times: microseconds from the first span; step 2, tensor b1's CPU update
    cpu = [e for e in xs if e["cat"] == "CPU update" and e["args"]["step"] == 2 and e["args"]["tensor"] == "b1"]
    if cpu:
        want_ts = (2 * 1_000_000 + 100_000 + 25_000 - 1_000_000) / 1000
        check(abs(cpu[0]["ts"] - want_ts) < 1e-3 and abs(cpu[0]["dur"] - 30) < 1e-3,
              f"CPU update ts {cpu[0]['ts']} (want {want_ts}), dur {cpu[0]['dur']} (want 30)")
        check(cpu[0]["tid"] != next(e["tid"] for e in xs if e["cat"] == "D2H"), "CPU updates on worker lanes")
    names = {(e.get("name"), e["args"].get("name")) for e in ev if e["ph"] == "M"}
    check(("process_name", "session 7 (llama rank 2)") in names, f"process name: {names}")
    check(("thread_name", "worker 1") in names, "a lane per worker")
    for x in os.listdir(tmp):
        os.unlink(os.path.join(tmp, x))
    os.rmdir(tmp)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


sys.exit(main())
