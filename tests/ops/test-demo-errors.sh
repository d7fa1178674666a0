#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# aoq-demo's errors: each names its cause once (no "cannot connect to aoqd:
# cannot connect to aoqd", no errno twice), a device error is not called a
# connection error, and a bad argument is named.
#   test-demo-errors.sh AOQ_DEMO
set -uo pipefail
demo=$1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-demo-err.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fails=0

# run WANT_RC WANT ARGS...: exit status WANT_RC and stderr containing WANT
# (fixed string); prints stderr into $tmp/err.
run() {
	local want_rc=$1 want=$2
	shift 2
	local rc=0
	"$demo" "$@" >/dev/null 2>"$tmp/err" || rc=$?
	if ((rc != want_rc)) || ! grep -qF -- "$want" "$tmp/err"; then
		echo "FAIL: aoq-demo $*: status $rc (want $want_rc), stderr lacks '$want':"
		sed 's/^/    /' "$tmp/err"
		fails=$((fails + 1))
	fi
}

run 1 "aoq-demo: starting a session on cpu: cannot connect to aoqd at $tmp/none.sock: No such file or directory" \
	--device cpu --socket "$tmp/none.sock"
if [[ $(grep -o "cannot connect" "$tmp/err" | wc -l) != 1 || $(grep -o "No such file or directory" "$tmp/err" | wc -l) != 1 ]]; then
	echo "FAIL: the connection error repeats itself:"
	cat "$tmp/err"
	fails=$((fails + 1))
fi
run 1 "starting a session on gpu:0: unknown device 'gpu:0'" --device gpu:0 --socket "$tmp/none.sock"
if grep -q "connect" "$tmp/err"; then
	echo "FAIL: a device error is labelled as a connection error: $(cat "$tmp/err")"
	fails=$((fails + 1))
fi
run 2 "--steps: 'abc' is not a whole number" --steps abc
run 2 "--rank: '-1' is not a whole number" --rank -1
run 2 "--lr: '0' is not a positive number" --lr 0
run 2 "unexpected argument 'extra'" extra
run 2 "unknown option '--bogus'" --bogus
run 2 "option '--steps' needs a value" --steps
echo "$fails failed"
((fails == 0))
