#!/bin/sh
# SPDX-License-Identifier: MIT
# The demo prints what README.md's quick start says it prints: a line naming
# its tensors, parameters, dtypes and device, then "step N loss L" at step 1,
# every 10th step and the last (every step with 200 steps or fewer), and a
# last line with the first and last loss and their ratio.  Checked for 1000
# steps (the quick start's count), 205 (the last step off the 10s) and 200.
#   demo-output.sh AOQ_DEMO AOQD
set -u
demo=$1 aoqd=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for steps in 1000 205 200; do
	if ! "$demo" --spawn-daemon "$aoqd" --device cpu --steps "$steps" >"$tmp/out" 2>"$tmp/err"; then
		echo "--steps $steps failed:"; cat "$tmp/out" "$tmp/err"
		exit 1
	fi
	if ! head -n 1 "$tmp/out" | grep -Eq '^aoq-demo: [0-9]+ tensors, [0-9]+ parameters, .* device cpu$'; then
		echo "--steps $steps: the first line is not the setup line:"; head -n 1 "$tmp/out"
		exit 1
	fi
	if ! tail -n 1 "$tmp/out" | grep -Eq '^first loss [^,]+, last loss [^,]+, ratio [0-9.]+x \(need 10x\): '; then
		echo "--steps $steps: the last line is not the loss ratio:"; tail -n 1 "$tmp/out"
		exit 1
	fi
	# The steps printed, against the rule.
	grep -E '^step [0-9]+ loss ' "$tmp/out" | awk '{ print $2 }' >"$tmp/got"
	awk -v n="$steps" 'BEGIN { every = n > 200 ? 10 : 1;
		for (s = 1; s <= n; s++) if (s == 1 || s % every == 0 || s == n) print s }' >"$tmp/want"
	if ! cmp -s "$tmp/got" "$tmp/want"; then
		echo "--steps $steps: the loss lines are not where the quick start says (want < got >):"
		diff "$tmp/want" "$tmp/got" | head -n 10
		exit 1
	fi
	others=$(grep -Evc '^(aoq-demo: |step [0-9]+ loss |first loss )' "$tmp/out")
	if [ "$others" -ne 0 ]; then
		echo "--steps $steps: $others lines of another kind:"; grep -Ev '^(aoq-demo: |step [0-9]+ loss |first loss )' "$tmp/out" | head -n 5
		exit 1
	fi
	echo "--steps $steps: $(wc -l <"$tmp/got") loss lines, as the quick start says"
done
