#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The generated aoqd.service and aoqd.socket under a real systemd, booted as
# PID 1 of its own PID and mount namespaces, then CMD run inside them:
#
#   unit-ns.sh AOQD_SERVICE AOQD_SOCKET AOQD [--conf FILE] [--state DIR] -- CMD [ARG...]
#
# CMD runs as root in the namespaces' mounts with
#   AOQ_SOCKET=/run/aoq/aoqd.sock    the socket unit's socket
#   AOQ_UNIT_LOG=/run/aoq-unit/aoqd.log   aoqd's stdout and stderr
# and may call `systemctl restart aoqd.service` or `systemctl kill
# --signal=SIGKILL aoqd.service` (Restart=on-failure starts it again).  The
# exit status is CMD's; 77 (skip) when this machine cannot boot systemd so:
# not root, no unshare or systemd, or no "running" state within 30 s.
#
# What is real: the units as meson generated them (Type=notify, the
# watchdog, socket activation, FileDescriptorStoreMax=, User=aoq and every
# hardening setting), systemd's fd store and restart logic.  What is not:
#   - ExecStart= runs a copy of the built aoqd (the build tree may be where
#     ProtectHome= or PrivateTmp= hide it) with --conf FILE (default: an
#     empty file, every default) from /run/aoq-unit;
#   - a drop-in sends aoqd's output to AOQ_UNIT_LOG (no journald runs);
#   - the namespace's systemd sees no unit of the host: /usr/lib/systemd/system
#     and /etc/systemd/system are empty tmpfs there, with the two units and
#     the few targets their default dependencies name, so nothing of the
#     host's boot (tmpfiles, sysusers, journald) runs against its files;
#   - the user aoq is added to bind-mounted copies of /etc/passwd and
#     /etc/group; /var/lib (StateDirectory=) is a tmpfs, with DIR bind-mounted
#     on /var/lib/aoq for --state DIR (snapshots on disk, not in memory).
set -uo pipefail
service=$1 socket_unit=$2 aoqd=$(realpath "$3")
shift 3
conf= statedir=
while [[ ${1:-} == --conf || ${1:-} == --state ]]; do
	case $1 in
	--conf) conf=$(realpath "$2") ;;
	--state) statedir=$(realpath "$2") ;;
	esac
	shift 2
done
[[ ${1:-} == -- ]] && shift
(($#)) || { echo "usage: unit-ns.sh SERVICE SOCKET AOQD [--conf FILE] [--state DIR] -- CMD..." >&2; exit 2; }

skip() { echo "unit-ns: $*: skipped"; exit 77; }
((EUID == 0)) || skip "not root"
systemd=/usr/lib/systemd/systemd
[[ -x $systemd ]] || skip "no $systemd"
command -v unshare >/dev/null && command -v nsenter >/dev/null || skip "no unshare/nsenter"
[[ -f $service && -f $socket_unit ]] || skip "no units generated (built without libsystemd)"

# One namespace at a time: every namespace's systemd makes its cgroups at the
# same paths of the host's hierarchy (system.slice/aoqd.service), and two of
# them would see and kill each other's aoqd.
exec 9>/run/lock/aoq-unit-ns.lock 2>/dev/null || exec 9>/tmp/aoq-unit-ns.lock
flock 9

tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-unit-ns.XXXXXX")
pid1=
cleanup() {
	if [[ -n $pid1 ]] && kill -0 "$pid1" 2>/dev/null; then
		# a clean stop first: PrivateTmp='s directory goes with the unit
		timeout 20 nsenter -t "$pid1" -m -p systemctl stop aoqd.service aoqd.socket >/dev/null 2>&1
		kill -9 "$pid1" 2>/dev/null # the namespace's PID 1: every process in it goes
		for _ in $(seq 50); do kill -0 "$pid1" 2>/dev/null || break; sleep 0.1; done
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT
trap "exit 143" TERM INT

# The namespace's files, staged here and copied into its /run at boot.
mkdir -p "$tmp/units/aoqd.service.d" "$tmp/unit"
cp "$aoqd" "$tmp/unit/aoqd"
if [[ -n $conf ]]; then cp "$conf" "$tmp/unit/aoqd.conf"; else : >"$tmp/unit/aoqd.conf"; fi
sbin=$(sed -n 's#^ExecStart=\([^ ]*\).*#\1#p' "$service")
sed -e "s#^ExecStart=.*#ExecStart=/run/aoq-unit/aoqd --config /run/aoq-unit/aoqd.conf#" "$service" \
	>"$tmp/units/aoqd.service"
grep -q '^ExecStart=/run/aoq-unit/aoqd' "$tmp/units/aoqd.service" || { echo "no ExecStart= ($sbin)"; exit 1; }
cp "$socket_unit" "$tmp/units/aoqd.socket"
cat >"$tmp/units/aoqd.service.d/output.conf" <<'EOF'
[Service]
StandardOutput=append:/run/aoq-unit/aoqd.log
StandardError=inherit
EOF
# The targets and the slice the units' default dependencies name, and the
# one the namespace boots into; none pulls anything else.
for u in sysinit.target basic.target sockets.target shutdown.target; do
	printf '[Unit]\nDescription=%s (aoq unit test)\nDefaultDependencies=no\n' "$u" >"$tmp/units/$u"
done
printf '[Unit]\nDescription=system.slice (aoq unit test)\nDefaultDependencies=no\n' >"$tmp/units/system.slice"
printf '[Unit]\nDescription=aoq unit test\nDefaultDependencies=no\nWants=aoqd.socket\n' >"$tmp/units/aoq-unit.target"
# The user aoq, in copies of the account files.
uid=999
while getent passwd "$uid" >/dev/null || getent group "$uid" >/dev/null; do uid=$((uid - 1)); done
cp /etc/passwd "$tmp/passwd"
cp /etc/group "$tmp/group"
getent passwd aoq >/dev/null || echo "aoq:x:$uid:$uid:aoq optimizer daemon:/var/lib/aoq:/usr/sbin/nologin" >>"$tmp/passwd"
getent group aoq >/dev/null || echo "aoq:x:$uid:" >>"$tmp/group"

cat >"$tmp/init.sh" <<EOF
#!/bin/bash
set -e
mount -t proc proc /proc
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/aoq-unit
cp "$tmp/unit/aoqd" "$tmp/unit/aoqd.conf" /run/aoq-unit/
chmod 0755 /run/aoq-unit/aoqd && chmod 0644 /run/aoq-unit/aoqd.conf
mount -t tmpfs -o mode=0755 tmpfs /usr/lib/systemd/system
mount -t tmpfs -o mode=0755 tmpfs /etc/systemd/system
mount -t tmpfs -o mode=0755 tmpfs /var/lib
if [[ -n "$statedir" ]]; then mkdir /var/lib/aoq && mount --bind "$statedir" /var/lib/aoq; fi
cp -r "$tmp/units/." /etc/systemd/system/
mount --bind "$tmp/passwd" /etc/passwd
mount --bind "$tmp/group" /etc/group
exec env -i container=aoq-unit-test PATH=/usr/sbin:/usr/bin:/sbin:/bin $systemd --system --unit=aoq-unit.target \\
	--log-target=console --log-level=notice
EOF
chmod +x "$tmp/init.sh"
# --kill-child: should this script die, the namespace goes with unshare
unshare --pid --fork --kill-child --mount --uts --propagation private "$tmp/init.sh" >"$tmp/systemd.log" 2>&1 &
ushare=$!
# PID 1 of the namespace: unshare's child
for _ in $(seq 100); do
	read -r pid1 _ <"/proc/$ushare/task/$ushare/children" 2>/dev/null
	[[ -n $pid1 ]] && break
	kill -0 "$ushare" 2>/dev/null || break
	sleep 0.1
done
[[ -n $pid1 ]] || { kill -9 "$ushare" 2>/dev/null; cat "$tmp/systemd.log"; skip "unshare started no namespace"; }
ns() { nsenter -t "$pid1" -m -p --wd="$PWD" "$@"; }
state=
for _ in $(seq 300); do
	kill -0 "$pid1" 2>/dev/null || break
	state=$(ns systemctl is-system-running 2>/dev/null)
	[[ $state == running || $state == degraded ]] && break
	sleep 0.1
done
if [[ $state != running ]]; then
	cat "$tmp/systemd.log"
	ns systemctl --no-pager --failed 2>/dev/null
	[[ $state == degraded ]] && { echo "FAIL: the namespace's systemd is degraded"; exit 1; }
	skip "systemd in a namespace did not come up (state '${state:-none}')"
fi
echo "unit-ns: systemd $(ns systemctl --version | sed -n '1s/^systemd \([0-9]*\).*/\1/p') is PID 1 of its namespace; aoqd.socket $(ns systemctl is-active aoqd.socket)"
# CAP_SYS_RESOURCE (bit 24) lets systemd raise LimitMEMLOCK= past the host's limit
bnd=$(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status)
if ((((16#$bnd) >> 24 & 1) == 0)); then
	echo "unit-ns: root has no CAP_SYS_RESOURCE here: aoqd gets the host's locked-memory limit ($(ulimit -l) KiB), not LimitMEMLOCK=infinity"
fi
ns env AOQ_SOCKET=/run/aoq/aoqd.sock AOQ_UNIT_LOG=/run/aoq-unit/aoqd.log "$@"
rc=$?
if ((rc != 0 && rc != 77)); then
	echo "--- aoqd.service ---"
	ns systemctl --no-pager status aoqd.service 2>&1 | head -20
	echo "--- aoqd's output ---"
	ns tail -50 /run/aoq-unit/aoqd.log
	echo "--- systemd ---"
	tail -30 "$tmp/systemd.log"
fi
exit $rc
