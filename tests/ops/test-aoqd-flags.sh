#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Every bad flag and config line gives an error that names the
# flag or key (and the file and line) and a non-zero exit; good forms work.
#   test-aoqd-flags.sh PATH/TO/aoqd
set -uo pipefail
aoqd=$1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-flags.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fails=0
n=0

fail() {
	echo "FAIL: $*"
	fails=$((fails + 1))
}

# bad WANT ARGS...: aoqd ARGS exits non-zero with WANT (a fixed string) in stderr.
bad() {
	local want=$1
	shift
	n=$((n + 1))
	local rc=0
	timeout 10 "$aoqd" "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
	if ((rc == 0)); then
		fail "aoqd $* exited 0 (wanted an error containing: $want)"
	elif ((rc == 124)); then
		fail "aoqd $* ran (timed out) instead of refusing"
	elif ! grep -qF -- "$want" "$tmp/err"; then
		fail "aoqd $*: stderr lacks '$want':"
		sed 's/^/    /' "$tmp/err"
	fi
}

# good WANT ARGS...: aoqd --check-config ARGS exits 0 and prints WANT.
good() {
	local want=$1
	shift
	n=$((n + 1))
	local rc=0
	timeout 10 "$aoqd" --check-config "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
	if ((rc != 0)); then
		fail "aoqd --check-config $* exited $rc:"
		sed 's/^/    /' "$tmp/err"
	elif ! grep -qxF -- "$want" "$tmp/out"; then
		fail "aoqd --check-config $*: output lacks the line '$want':"
		sed 's/^/    /' "$tmp/out"
	fi
}

# badconf WANT LINE: a config file holding LINE (on line 3) is refused with WANT.
badconf() {
	local want=$1 line=$2
	printf '# test\n\n%s\n' "$line" >"$tmp/c.conf"
	bad "$tmp/c.conf:3: $want" --check-config --config "$tmp/c.conf"
}

sock="$tmp/s.sock"

# Flags.
bad "--threads: 'abc' is not a whole number" --threads abc --socket "$sock"
bad "--threads: '1.5' is not a whole number" --threads 1.5 --socket "$sock"
bad "--threads: '-1' is not a whole number" --threads -1 --socket "$sock"
bad "--threads: 100000000 is out of range (0..1024)" --threads 100000000 --socket "$sock"
bad "--threads: 18446744073709551616 is out of range" --threads 18446744073709551616 --socket "$sock"
bad "--threads: ' 4' is not a whole number" --threads " 4" --socket "$sock"
bad "--lock-memory: 'bogus' is not one of no, try or yes" --lock-memory bogus --socket "$sock"
bad "--log-level: 'bogus' is not one of error, warn, info or debug" --log-level bogus --socket "$sock"
bad "--kernel: 'sse9' is not one of" --kernel sse9 --socket "$sock"
bad "--listen-fd: 'abc' is not a file descriptor number" --listen-fd abc
bad "--listen-fd: '-3' is not a file descriptor number" --listen-fd -3
bad "listen fd 250 is not open" --listen-fd 250
bad "listen fd 0 is not a Unix stream socket" --listen-fd 0 </dev/null
bad "unexpected argument 'extra'" --socket "$sock" extra
bad "unknown option '--bogus'" --bogus
bad "unknown option '-x'" -x
bad "option '--threads' needs a value" --threads
bad "--config: given twice" --config /dev/null --config /dev/null
bad "cannot read $tmp/missing.conf: No such file or directory" --config="$tmp/missing.conf"
AOQ_KERNEL=nope bad "AOQ_KERNEL: 'nope' is not one of" --check-config --socket "$sock"

# Socket paths over sun_path (107 bytes + NUL) are refused before binding.
long="$tmp/$(printf 'x%.0s' {1..120}).sock"
bad "--socket: socket path is" --socket "$long"
bad "a Unix socket path has at most 107" --socket "$long"
printf 'socket = %s\n' "$long" >"$tmp/long.conf"
bad "$tmp/long.conf:1: socket: socket path is" --config "$tmp/long.conf"
if compgen -G "$tmp/x*" >/dev/null; then
	fail "a socket file was created for the over-long path: $(ls "$tmp")"
fi
# Exactly 107 bytes is accepted.
p107="$tmp/"
p107="$p107$(printf 'y%.0s' $(seq 1 $((107 - ${#p107}))))"
good "socket = $p107" --socket "$p107"

# Config lines.
badconf "unknown key 'thread' (did you mean 'threads'?)" "thread = 4"
badconf "unknown key 'loop_spin' (did you mean 'loop_spin_us'?)" "loop_spin = 5"
badconf "unknown key 'colour'" "colour = blue"
badconf "threads: 'abc' is not a whole number" "threads = abc"
badconf "threads: '1.5' is not a whole number" "threads = 1.5"
badconf "threads: '-1' is not a whole number" "threads = -1"
badconf "threads: 100000000 is out of range" "threads = 100000000"
badconf "threads: needs a value" "threads ="
badconf "lock_memory: 'bogus' is not one of no, try or yes" "lock_memory = bogus"
badconf "log_level: 'loud' is not one of" "log_level = loud"
badconf "kernel: 'x' is not one of" "kernel = x"
badconf "max_connections: 4294967297 is out of range" "max_connections = 4294967297"
badconf "max_tensors: 4294967296 is out of range" "max_tensors = 4294967296"
badconf "max_sessions_per_uid: 0 is out of range" "max_sessions_per_uid = 0"
badconf "max_arena_bytes: 99999999999T is out of range" "max_arena_bytes = 99999999999T"
badconf "max_arena_bytes: '1X' is not a whole number" "max_arena_bytes = 1X"
badconf "max_tensor_elems: '1 G' is not a whole number" "max_tensor_elems = 1 G"
badconf "max_state_bytes_per_uid: 18446744073709551616 is out of range" "max_state_bytes_per_uid = 18446744073709551616"
badconf "admin_gid: 'no-such-group-aoq' is neither a gid nor a known group name" "admin_gid = no-such-group-aoq"
badconf "admin_gid: 4294967295 is out of range" "admin_gid = 4294967295"
badconf "expected 'key = value', got 'threads 4'" "threads 4"
badconf "a value without a key" "= 4"
badconf "unknown key 'Threads' (did you mean 'threads'?)" "Threads = 4"

# Good forms: '=' flags, trailing comments, suffixes, the command line wins.
good "threads = 3" --threads=3
good "threads = 10" --threads 010
good "threads = 16" --threads 0x10
bad "--threads: '0x' is not a whole number" --threads 0x --socket "$sock"
bad "--threads: '0x-1' is not a whole number" --threads 0x-1 --socket "$sock"
good "lock_memory = no" --lock-memory=no
good "loop_spin_us = auto" --socket "$sock"
printf 'loop_spin_us = 0\n' >"$tmp/spin.conf"
good "loop_spin_us = 0" --config "$tmp/spin.conf" --socket "$sock"
printf 'loop_spin_us = 20\n' >"$tmp/spin.conf"
good "loop_spin_us = 20" --config "$tmp/spin.conf" --socket "$sock"
printf 'loop_spin_us = auto\n' >"$tmp/spin.conf"
good "loop_spin_us = auto" --config "$tmp/spin.conf" --socket "$sock"
badconf "loop_spin_us: 'fast' is not a whole number or auto" "loop_spin_us = fast"
badconf "loop_spin_us: 10001 is out of range (0..10000)" "loop_spin_us = 10001"
good "log_level = debug" --log-level debug
cat >"$tmp/ok.conf" <<CONF
# a comment line
threads = 2   # a trailing comment
lock_memory = yes
max_arena_bytes = 2G
max_connections = 0x100
socket = $tmp/with#hash.sock
admin_gid = none
CONF
good "threads = 2" --config "$tmp/ok.conf"
good "lock_memory = yes" --config="$tmp/ok.conf"
good "max_arena_bytes = 2147483648" --config "$tmp/ok.conf"
good "max_connections = 256" --config "$tmp/ok.conf"
good "socket = $tmp/with#hash.sock" --config "$tmp/ok.conf"
good "threads = 7" --threads 7 --config "$tmp/ok.conf"
good "threads = 7" --config "$tmp/ok.conf" --threads 7
printf 'admin_gid = root\n' >"$tmp/gid.conf"
good "admin_gid = 0" --config "$tmp/gid.conf"

# -h and --help print the usage and exit 0; --version too.
for h in -h --help; do
	n=$((n + 1))
	if ! "$aoqd" "$h" >"$tmp/out" 2>&1 || ! grep -q '^usage: aoqd' "$tmp/out"; then
		fail "aoqd $h did not print the usage with status 0"
	fi
done

# A good configuration starts: the daemon binds, and a clean stop removes
# the socket.
n=$((n + 1))
"$aoqd" --socket "$sock" --threads 1 --config "$tmp/ok.conf" --log-level error &
pid=$!
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.05; done
if [[ ! -S $sock ]]; then
	fail "aoqd did not bind $sock"
fi
kill -TERM "$pid"
wait "$pid" || fail "aoqd exited $? after SIGTERM"
[[ -e $sock ]] && fail "socket $sock left after a clean stop"

# A state_dir chosen by hand that does not exist: a warning naming it at
# start, not an error at the first snapshot.
n=$((n + 1))
"$aoqd" --socket "$sock" --threads 1 --state-dir "$tmp/no-such-dir" 2>"$tmp/err" &
pid=$!
for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.05; done
kill -TERM "$pid"
wait "$pid"
grep -qF "state_dir $tmp/no-such-dir does not exist: snapshots fail until it is created" "$tmp/err" ||
	fail "no warning for a missing state_dir: $(cat "$tmp/err")"
[[ -e $tmp/no-such-dir ]] && fail "aoqd created the missing state_dir"

echo "$n checks, $fails failed"
((fails == 0))
