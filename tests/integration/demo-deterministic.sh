#!/bin/sh
# SPDX-License-Identifier: MIT
# The cpu device keeps torch's step semantics: an updated parameter lands in
# the trainer's buffer only when the trainer waits for it, never while its
# backward may still read the old value.  Then the demo's loss trajectory is
# the same in every run; six runs must agree line for line.
#   demo-deterministic.sh AOQ_DEMO AOQD [DEMO_ARGS...]
set -u
demo=$1 aoqd=$2
shift 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for i in 1 2 3 4 5 6; do
	if ! "$demo" --spawn-daemon "$aoqd" --device cpu --steps 300 "$@" >"$tmp/out" 2>"$tmp/err"; then
		echo "run $i failed:"; cat "$tmp/out" "$tmp/err"
		exit 1
	fi
	grep '^step ' "$tmp/out" >"$tmp/loss$i"
	[ -s "$tmp/loss$i" ] || { echo "run $i printed no loss"; exit 1; }
	if [ "$i" -gt 1 ] && ! cmp -s "$tmp/loss1" "$tmp/loss$i"; then
		echo "run $i's losses differ from run 1's:"
		diff "$tmp/loss1" "$tmp/loss$i" | head -n 10
		exit 1
	fi
done
echo "6 runs, $(wc -l <"$tmp/loss1") loss lines each, identical"
