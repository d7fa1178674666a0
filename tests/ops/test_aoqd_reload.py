#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""SIGHUP reloads aoqd's config file: the log level changes at run time
(debug lines appear), limits change, settings that take a restart are named
and kept, the command line still wins, and a bad file keeps the old
settings with the daemon running.  Observers' (aoqctl's) connections log at
debug only.

    test_aoqd_reload.py AOQD AOQCTL
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

AOQD, AOQCTL = sys.argv[1:3]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def main():
    tmp = tempfile.mkdtemp(prefix="aoq-reload-")
    sock = os.path.join(tmp, "aoqd.sock")
    conf = os.path.join(tmp, "aoqd.conf")
    logf = os.path.join(tmp, "aoqd.log")

    def write_conf(text):
        with open(conf + ".new", "w") as f:
            f.write(text)
        os.rename(conf + ".new", conf)

    def log():
        with open(logf) as f:
            return f.read()

    def wait_log(what, since, timeout=10):
        end = time.time() + timeout
        while time.time() < end:
            if what in log()[since:]:
                return True
            time.sleep(0.05)
        return False

    def stats():
        p = subprocess.run([AOQCTL, "--socket", sock, "stats", "--json"], capture_output=True, text=True,
                           timeout=30)
        return p.returncode

    write_conf("log_level = info\nmax_sessions_per_uid = 64\n")
    with open(logf, "w") as lf:
        d = subprocess.Popen([AOQD, "--socket", sock, "--config", conf, "--threads", "1"], stderr=lf,
                             stdout=lf)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        check(stats() == 0, "aoqctl stats works")
        time.sleep(0.2)
        check("observer" not in log() and "session 1" not in log(),
              f"an observer's connection logs nothing at info: {log()[-600:]!r}")

        # log level info -> debug, a limit, a restart-only setting, the command line winning
        n = len(log())
        write_conf("log_level = debug\nmax_sessions_per_uid = 8\nkernel = scalar\nthreads = 3\nworker_spin_us = 7\n"
                   "loop_spin_us = 5\n")
        d.send_signal(signal.SIGHUP)
        check(wait_log("reload: log_level info -> debug", n), "the reload logs the new log level")
        check(wait_log("reload: max_sessions_per_uid 64 -> 8", n), "the reload logs the new limit")
        check(wait_log("kernel auto -> scalar takes a restart", n), "kernel is named as taking a restart")
        check(wait_log("worker_spin_us 50 -> 7 takes a restart", n), "worker_spin_us is named as taking a restart")
        check(wait_log("reload: loop_spin_us: the loop now polls", n), "loop_spin_us changes on reload")
        time.sleep(0.2)
        check("threads" not in log()[n:], "--threads 1 on the command line wins over the file's threads = 3")
        n = len(log())
        check(stats() == 0, "aoqctl stats works after the reload")
        check(wait_log("(observer)", n), f"debug lines appear after the reload: {log()[n:]!r}")

        # a bad file: the daemon stays, with the old settings
        n = len(log())
        write_conf("log_level = debug\nmax_sessions_per_uid = lots\n")
        d.send_signal(signal.SIGHUP)
        check(wait_log("keeping the settings in use", n), f"a bad file is reported: {log()[n:]!r}")
        check(wait_log("max_sessions_per_uid", n), "the error names the key")
        time.sleep(0.3)
        check(d.poll() is None, "the daemon runs on after a bad config")
        n = len(log())
        check(stats() == 0, "aoqctl stats works after the bad reload")
        check(wait_log("(observer)", n), "the old settings (debug) stay")

        # back to warn: debug and info lines stop
        n = len(log())
        write_conf("log_level = warn\n")
        d.send_signal(signal.SIGHUP)
        check(wait_log("reload: log_level debug -> warn", n), "the level goes down again")
        time.sleep(0.2)
        n = len(log())
        check(stats() == 0, "stats at warn")
        time.sleep(0.2)
        check(log()[n:] == "", f"nothing logged at warn for an observer: {log()[n:]!r}")

        # the config file gone: an error, the daemon stays
        n = len(log())
        os.unlink(conf)
        d.send_signal(signal.SIGHUP)
        check(wait_log("keeping the settings in use", n), "a missing file is reported")
        time.sleep(0.2)
        check(d.poll() is None, "the daemon runs on without its file")
    finally:
        d.terminate()
        rc = d.wait(timeout=30)
        check(rc == 0, f"aoqd exits 0 on SIGTERM, got {rc}")
        shutil.rmtree(tmp)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


sys.exit(main())
