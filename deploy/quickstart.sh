#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Quick start on a fresh Debian 12 machine (as root): installs what building
# and running aoq need (not the test tools: .ci/run adds those), builds
# aoqd, aoqctl and the demo into build/, starts aoqd in the background on a
# private socket, trains the demo MLP through it (on cuda:0 when the build has
# CUDA and nvidia-smi sees a GPU, else on the CPU), prints `aoqctl stats`
# (taken while the demo trains, once the daemon has its rates) and stops the
# daemon.
#   AOQ_QUICKSTART_NO_INSTALL=1  skip the packages (they are there already)
#   AOQ_QUICKSTART_BUILD=DIR     build in DIR (default build; an existing
#                                configured build directory is used as it is)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z ${AOQ_QUICKSTART_NO_INSTALL:-} ]]; then
	echo "== installing packages"
	bash deploy/install-deps.sh build
fi

build=${AOQ_QUICKSTART_BUILD:-build}
echo "== building aoqd, aoqctl and the demo ($build/)"
if [[ ! -f $build/meson-private/coredata.dat ]]; then
	meson setup "$build"
fi
ninja -C "$build" daemon/aoqd client/tools/aoqctl client/examples/aoq-demo

aoqd=$build/daemon/aoqd
aoqctl=$build/client/tools/aoqctl
demo=$build/client/examples/aoq-demo

tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-quickstart.XXXXXX")
sock=$tmp/aoqd.sock
daemon_pid=
cleanup() {
	if [[ -n $daemon_pid ]]; then
		kill -TERM "$daemon_pid" 2>/dev/null || true
		wait "$daemon_pid" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT

echo "== starting aoqd on $sock (log: $tmp/aoqd.log)"
"$aoqd" --socket "$sock" >"$tmp/aoqd.log" 2>&1 &
daemon_pid=$!
# Wait until it answers (at most 10 s).
for ((i = 0; ; i++)); do
	if "$aoqctl" --socket "$sock" stats >/dev/null 2>&1; then
		break
	fi
	if ! kill -0 "$daemon_pid" 2>/dev/null || ((i >= 100)); then
		echo "aoqd did not come up; its log:" >&2
		cat "$tmp/aoqd.log" >&2
		exit 1
	fi
	sleep 0.1
done

device=cpu
if grep -q '^#define AOQ_HAVE_CUDA 1' "$build/aoq-config.h" &&
	command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
	device=cuda:0
fi

echo "== training the demo MLP through aoqd (device $device)"
# 10000 steps (a few seconds; the loss is printed every 10th step).  The
# daemon's rates are over its last whole second: aoqctl takes its sample
# once the session has them (steps/s, in and out bytes/s), while it trains.
status=0
"$demo" --socket "$sock" --device "$device" --job quickstart --steps 10000 >"$tmp/demo.log" 2>&1 &
demo_pid=$!
sample=
while kill -0 "$demo_pid" 2>/dev/null; do
	if "$aoqctl" --socket "$sock" stats --json 2>/dev/null | grep -qE '"steps_per_second": *[1-9]'; then
		sample=$("$aoqctl" --socket "$sock" stats 2>&1) || status=$?
		break
	fi
	sleep 0.05
done
wait "$demo_pid" || status=$?
# the first lines (tensors, the first steps) and the last (the loss's ratio)
head -n 6 "$tmp/demo.log"
echo "..."
tail -n 3 "$tmp/demo.log"

echo "== aoqctl stats (taken while the demo trained)"
if [[ -n $sample ]]; then
	echo "$sample"
else
	echo "(the demo ended before the daemon's first rates)"
	"$aoqctl" --socket "$sock" stats || status=$?
fi

echo "== stopping aoqd"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
if ((rc != 0 && rc != 143)); then
	echo "aoqd did not exit cleanly; its log:" >&2
	cat "$tmp/aoqd.log" >&2
	status=1
fi
daemon_pid=
if ((status != 0)); then
	echo "quick start FAILED (status $status); aoqd's log:" >&2
	cat "$tmp/aoqd.log" >&2
	exit "$status"
fi
echo "== quick start done"
