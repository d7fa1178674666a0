#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The man pages as built: `mandoc -Tlint -Wstyle` says nothing about any of
# them, and aoqctl(1)'s synopsis renders snapshot and drop as alternatives
# and aoqd(8)'s names --state-dir.  Skips (77) without mandoc unless CI is
# set (Debian package mandoc, in deploy/install-deps.sh's test set).
#   test-man.sh PAGE...
set -uo pipefail
if ! command -v mandoc >/dev/null; then
	if [[ -n ${CI:-} ]]; then
		echo "FAIL: mandoc is not installed and CI is set"
		exit 1
	fi
	echo "SKIP: no mandoc"
	exit 77
fi
fail=0
for page in "$@"; do
	out=$(mandoc -Tlint -Wstyle "$page" 2>&1)
	rc=$?
	if [[ -n $out || $rc != 0 ]]; then
		echo "FAIL: mandoc -Tlint $page (rc $rc):"
		echo "$out"
		fail=1
	fi
	case $(basename "$page") in
	aoqctl.1)
		syn=$(mandoc -Tascii -Owidth=200 "$page" | sed $'s/.\b//g' | sed -n '/^SYNOPSIS/,/^DESCRIPTION/p')
		if ! grep -qE '^ *aoqctl \[--socket PATH\] \(snapshot \| drop\) SESSION *$' <<<"$syn"; then
			echo "FAIL: aoqctl(1)'s synopsis lacks 'aoqctl [--socket PATH] (snapshot | drop) SESSION':"
			echo "$syn"
			fail=1
		fi
		;;
	aoqd.8)
		syn=$(mandoc -Tascii -Owidth=200 "$page" | sed $'s/.\b//g' | sed -n '/^SYNOPSIS/,/^DESCRIPTION/p')
		if ! grep -q -- '\[--state-dir DIR\]' <<<"$syn"; then
			echo "FAIL: aoqd(8)'s synopsis lacks [--state-dir DIR]:"
			echo "$syn"
			fail=1
		fi
		;;
	esac
	if grep -q '@VERSION@' "$page"; then
		echo "FAIL: $page: @VERSION@ not filled in"
		fail=1
	fi
done
((fail == 0)) && echo "ok: $# pages"
exit $fail
