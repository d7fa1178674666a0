#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# README's install sections run in the order written, against a DESTDIR: in a
# copy of the source tree, the quick start's build directory is configured
# as deploy/quickstart.sh configures it (build/, prefix /usr/local), then the
# commands of "As a system service" run as README.md has them, with three
# changes: each `meson setup` gets $fast (no SIMD kernel variants, no CUDA,
# no test programs: compile time; the prefixes are what is tested), `ninja ... install` gets
# DESTDIR, and systemd-sysusers, systemd-tmpfiles and systemctl get --root
# (systemctl: enable only, no daemon-reload or --now; usermod is left out).
# Then aoqd and aoqctl are under /usr, nothing under /usr/local, the unit's
# ExecStart is /usr/sbin/aoqd with /etc/aoq/aoqd.conf, which is installed.
#   test-readme-install.sh SOURCE_ROOT
set -euo pipefail
src=$(cd "$1" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-readme.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/root
fast="-Dkernel_variants=none -Dcuda=disabled -Dtests=false"
fail=0
say() { echo "test-readme-install: $*"; }

# The source tree without build directories or git (the build is then the
# release alone).
mkdir "$tmp/src"
(cd "$src" && tar --exclude='./build*' --exclude=./.git --exclude=./.carry -cf - .) | (cd "$tmp/src" && tar -xf -)
cd "$tmp/src"

# The commands of a README section's first ```sh block.
section() {
	awk -v h="$1" '
		$0 == h { on = 1; next }
		on && /^#/ { exit }
		on && /^```sh$/ { blk = 1; next }
		on && blk && /^```$/ { exit }
		on && blk { print }
	' README.md
}
cmds=$(section "### As a system service")
[[ -n $cmds ]] || { say "FAIL: no sh block under '### As a system service' in README.md"; exit 1; }
grep -q 'meson setup "\$build"' deploy/quickstart.sh && grep -q 'build=\${AOQ_QUICKSTART_BUILD:-build}' deploy/quickstart.sh ||
	{ say "FAIL: deploy/quickstart.sh no longer configures build/ as this test assumes"; exit 1; }

# The quick start first: build/ at the default prefix (/usr/local).
# shellcheck disable=SC2086
meson setup build $fast >"$tmp/qs.log" 2>&1 || { cat "$tmp/qs.log"; say "FAIL: the quick start's meson setup build"; exit 1; }

start=$SECONDS
while IFS= read -r line; do
	line=${line%%#*}
	[[ -z ${line// /} ]] && continue
	run=$line
	run=$(sed -E "s/meson setup ([^ &;]+)/meson setup \1 $fast/g" <<<"$run")
	run=$(sed -E "s|ninja -C ([^ &;]+) install|DESTDIR='$dest' ninja -C \1 install|g" <<<"$run")
	run=$(sed -E "s#systemd-sysusers#systemd-sysusers --root='$dest'#; s#systemd-tmpfiles #systemd-tmpfiles --root='$dest' #" <<<"$run")
	if [[ $run == *usermod* ]]; then
		say "skipped: $line"
		continue
	fi
	if [[ $run == *systemctl* ]]; then
		run="systemctl --root='$dest' enable aoqd.socket"
	fi
	for tool in systemd-sysusers systemd-tmpfiles systemctl; do
		if [[ $run == *$tool* ]] && ! command -v "$tool" >/dev/null; then
			say "skipped (no $tool here): $line"
			continue 2
		fi
	done
	say "README: $line"
	say "  runs: $run"
	if ! bash -c "set -e; $run" >"$tmp/step.log" 2>&1; then
		tail -n 30 "$tmp/step.log"
		say "FAIL: $line"
		exit 1
	fi
	grep -i "already configured" "$tmp/step.log" && { say "FAIL: $line reused a configured directory"; fail=1; }
done <<<"$cmds"
say "the service section took $((SECONDS - start)) s"

for f in /usr/sbin/aoqd /usr/bin/aoqctl /etc/aoq/aoqd.conf; do
	[[ -e $dest$f ]] || { say "FAIL: $f not installed"; fail=1; }
done
if [[ -d $dest/usr/local ]] && [[ -n $(find "$dest/usr/local" -type f | head -1) ]]; then
	say "FAIL: files under /usr/local: $(find "$dest/usr/local" -type f | head -5 | tr '\n' ' ')"
	fail=1
fi
unit=$(find "$dest" -name aoqd.service -path '*/system/*' | head -1)
if [[ -z $unit ]]; then
	if grep -q '^#define AOQ_HAVE_SYSTEMD 1' build-system/aoq-config.h 2>/dev/null; then
		say "FAIL: no aoqd.service installed"
		fail=1
	fi
else
	exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
	say "ExecStart=$exec_start"
	[[ $exec_start == "/usr/sbin/aoqd --config /etc/aoq/aoqd.conf"* ]] ||
		{ say "FAIL: ExecStart is not /usr/sbin/aoqd with /etc/aoq/aoqd.conf"; fail=1; }
	if command -v systemctl >/dev/null && [[ ! -L $dest/etc/systemd/system/sockets.target.wants/aoqd.socket ]]; then
		say "FAIL: aoqd.socket not enabled in the root"
		fail=1
	fi
fi
# outside a git checkout the version is the release alone
release=$(sed -n "s/^  version: '\(.*\)',$/\1/p" meson.build | head -1)
v=$("$dest/usr/sbin/aoqd" --version) || { say "FAIL: the installed aoqd does not run"; fail=1; }
say "$v"
[[ $v == "aoqd $release (protocol "* ]] || { say "FAIL: '$v' is not the release $release alone"; fail=1; }
((fail == 0)) && say "ok"
exit $fail
