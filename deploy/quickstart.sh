#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Quick start on a fresh Debian 12 machine (as root): installs what aoq
# needs, builds it, starts aoqd in the background on a private socket, trains
# the demo MLP through it (on cuda:0 when the build has CUDA and nvidia-smi
# sees a GPU, else on the CPU), prints `aoqctl stats` (taken while the demo
# trains) and stops the daemon.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== installing packages"
bash deploy/install-deps.sh

echo "== building (build/)"
if [[ ! -f build/meson-private/coredata.dat ]]; then
	meson setup build
fi
ninja -C build

aoqd=build/daemon/aoqd
aoqctl=build/client/tools/aoqctl
demo=build/client/examples/aoq-demo

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
if grep -q '^#define AOQ_HAVE_CUDA 1' build/aoq-config.h &&
	command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
	device=cuda:0
fi

echo "== training the demo MLP through aoqd (device $device)"
# 1000 steps (the loss is printed every 10th); aoqctl takes its snapshot while
# the session is training, half-way through.
status=0
"$demo" --socket "$sock" --device "$device" --job quickstart --steps 1000 >"$tmp/demo.log" 2>&1 &
demo_pid=$!
snapshot=
while kill -0 "$demo_pid" 2>/dev/null; do
	steps=$("$aoqctl" --socket "$sock" stats --json 2>/dev/null |
		grep -oE '"steps": *[0-9]+' | head -n1 | grep -oE '[0-9]+$' || true)
	if [[ -n $steps ]] && ((steps >= 500)); then
		snapshot=$("$aoqctl" --socket "$sock" stats 2>&1) || status=$?
		break
	fi
	sleep 0.02
done
wait "$demo_pid" || status=$?
cat "$tmp/demo.log"

echo "== aoqctl stats (taken while the demo trained)"
if [[ -n $snapshot ]]; then
	echo "$snapshot"
else
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
