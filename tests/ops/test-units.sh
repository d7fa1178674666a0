#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The generated systemd units: `systemd-analyze verify` is clean and the
# service's offline exposure (systemd-analyze security --offline=true) is at
# most 2.0.  Skips (77) without systemd-analyze.
#   test-units.sh AOQD_SERVICE AOQD_SOCKET AOQD_BINARY
set -uo pipefail
service=$1 socket_unit=$2 aoqd=$(realpath "$3")
command -v systemd-analyze >/dev/null || { echo "no systemd-analyze: skipped"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-units.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# verify checks that ExecStart= exists: point it at the built daemon.
sbin=$(sed -n 's#^ExecStart=\([^ ]*\).*#\1#p' "$service")
sed "s#$sbin#$aoqd#" "$service" >"$tmp/aoqd.service"
[[ -f $socket_unit ]] && cp "$socket_unit" "$tmp/aoqd.socket"
fail=0
units=("$tmp/aoqd.service")
[[ -f $tmp/aoqd.socket ]] && units+=("$tmp/aoqd.socket")
if ! out=$(systemd-analyze verify "${units[@]}" 2>&1) || [[ -n $out ]]; then
	echo "FAIL: systemd-analyze verify:"
	echo "$out"
	fail=1
fi
cd "$tmp" || exit 1
sec=$(systemd-analyze security --offline=true aoqd.service 2>&1)
level=$(sed -n 's/.*Overall exposure level for aoqd.service: \([0-9.]*\).*/\1/p' <<<"$sec")
echo "exposure: ${level:-?}"
if [[ -z $level ]] || ! awk -v l="$level" 'BEGIN { exit !(l <= 2.0) }'; then
	echo "FAIL: exposure ${level:-unknown} > 2.0"
	echo "$sec"
	fail=1
fi
exit $fail
