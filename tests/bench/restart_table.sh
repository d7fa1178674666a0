#!/bin/bash
# SPDX-License-Identifier: MIT
# The restart table: bench-restart under the host's shmem_enabled settings
# `never` and `advise` in turn (ROUNDS rounds, default 1: never, advise),
# then the setting the host had; one summary line per run with the pauses
# (SIGTERM, SIGKILL, snapshot, SIGTERM again) and the parts of the first
# restart.  Root only (it writes /sys/kernel/mm/transparent_hugepage/
# shmem_enabled).
#
#   tests/bench/restart_table.sh [--bin DIR] PARAMS [TENSORS [PRECISION [nosnapshot]]]
#
# --bin DIR: a packed build (DIR/aoqd, DIR/lib, DIR/bench-restart, as
# tests/gpu/run-gpu-tests.sh pack makes it with bench-restart copied in);
# else the build tree's.  Each run's whole output goes to
# $OUT/restart-PARAMS-SETTING-ROUND.log when OUT is set, else to a temp dir
# printed at the end.  bench-restart's own supervisor does what systemd
# does; tests/ops/unit-ns.sh runs it under systemd itself (RESULTS.md,
# "Restart under systemd").
set -u
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
bench=$root/build/tests/bench/bench-restart
aoqd=$root/build/daemon/aoqd
if [ "${1:-}" = "--bin" ]; then
	bin=$(cd "$2" && pwd); shift 2
	export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	bench=$bin/bench-restart aoqd=$bin/aoqd
fi
[ $# -ge 1 ] || { echo "usage: restart_table.sh [--bin DIR] PARAMS [TENSORS [PRECISION [nosnapshot]]]" >&2; exit 2; }
[ -x "$bench" ] && [ -x "$aoqd" ] || { echo "restart_table.sh: no $bench or $aoqd" >&2; exit 2; }
knob=/sys/kernel/mm/transparent_hugepage/shmem_enabled
[ -w "$knob" ] || { echo "restart_table.sh: cannot write $knob (root, and a kernel with shmem THP)" >&2; exit 2; }
was=$(sed -n 's/.*\[\(.*\)\].*/\1/p' "$knob")
trap 'echo "$was" > "$knob"' EXIT
logs=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/restart-table.XXXXXX")}
mkdir -p "$logs"
echo "restart_table: $(nproc) cpus, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), shmem_enabled was '$was', bench-restart $*"
for round in $(seq "${ROUNDS:-1}"); do
	for setting in never advise; do
		echo "$setting" > "$knob" || exit 1
		log=$logs/restart-$1-$setting-$round.log
		AOQD=$aoqd "$bench" "$@" > "$log" 2>&1
		rc=$?
		pauses=$(sed -n 's/^\(fd store (SIGTERM)\|fd store (SIGKILL)\|snapshot (SIGKILL)\|fd store again\) *pause *\([0-9.]*\) s.*/\2/p' "$log" | paste -sd/)
		first=$(grep -m1 '^fd store (SIGTERM)' "$log" | sed 's/.*pause *[0-9.]* s *//')
		step=$(sed -n 's/^undisturbed step: //p' "$log")
		printf '%-7s round %d  rc %d  undisturbed step %s  pauses (TERM/KILL/snapshot/again) %s s\n    first: %s\n' \
			"$setting" "$round" "$rc" "${step:-?}" "${pauses:-none}" "${first:-none}"
	done
done
echo "restart_table: logs in $logs"
