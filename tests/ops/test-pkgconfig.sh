#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# (Also: the man pages are installed.)
# aoq.pc works on a machine with only libaoq installed: a DESTDIR install of
# the runtime and devel parts, pkg-config restricted to that tree (so the
# system's level-zero.pc and libprotobuf-c.pc are not found), then a program
# compiled and linked with `pkg-config --cflags --libs aoq` runs.
#   test-pkgconfig.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-pc.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/root

meson install -C "$build" --no-rebuild --quiet --destdir "$dest" --tags runtime,devel,man >"$tmp/install.log" 2>&1 || {
	cat "$tmp/install.log"
	echo "FAIL: meson install"
	exit 1
}
pc=$(find "$dest" -name aoq.pc -path '*/pkgconfig/*')
[[ -n $pc ]] || { echo "FAIL: no aoq.pc installed"; exit 1; }
echo "installed: ${pc#"$dest"}"
cat "$pc"

fail=0
# The man pages come with the install and format without warnings.
for page in man8/aoqd.8 man5/aoqd.conf.5 man1/aoqctl.1; do
	f=$(find "$dest" -path "*/share/man/$page" | head -1)
	if [[ -z $f ]]; then
		echo "FAIL: man page $page not installed"
		fail=1
	elif command -v groff >/dev/null && [[ -n $(LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -z "$f" 2>&1) ]]; then
		echo "FAIL: groff warns about $page"
		fail=1
	fi
done
# The library's file name follows its soname: libaoq.so.N.x.y for soname
# libaoq.so.N, and the soname's N is the header's AOQ_ABI_VERSION.
lib=$(find "$dest" -name 'libaoq.so.*.*.*' -type f | head -1)
if [[ -z $lib ]]; then
	echo "FAIL: no libaoq.so.N.x.y installed: $(find "$dest" -name 'libaoq.so*' | tr '\n' ' ')"
	fail=1
else
	soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
	abi=$(sed -n 's/^#define AOQ_ABI_VERSION \([0-9]*\).*/\1/p' "$(find "$dest" -path '*/aoq/aoq.h' | head -1)")
	echo "library: $(basename "$lib"), soname $soname, AOQ_ABI_VERSION $abi"
	case $(basename "$lib") in
	"$soname".*.*) ;;
	*) echo "FAIL: $(basename "$lib") does not start with its soname $soname"; fail=1 ;;
	esac
	[[ $soname == "libaoq.so.$abi" ]] || { echo "FAIL: soname $soname, AOQ_ABI_VERSION $abi"; fail=1; }
	[[ -L $(dirname "$lib")/$soname ]] || { echo "FAIL: no $soname link"; fail=1; }
fi
# No build-machine paths: every path is under ${prefix} (or the install's own
# absolute libdir/includedir).
prefix=$(sed -n 's/^prefix=//p' "$pc")
if grep -E '(^|[ =])/' "$pc" | grep -v "^prefix=" | grep -vF "$prefix" | grep -q .; then
	echo "FAIL: a path outside the prefix in aoq.pc"
	fail=1
fi
if grep -qE 'level-zero|level_zero|cudart|/cuda|Requires' "$pc"; then
	echo "FAIL: aoq.pc names Level Zero, CUDA or a Requires line"
	fail=1
fi

# pkg-config sees only the installed tree.
export PKG_CONFIG_LIBDIR=$(dirname "$pc")
export PKG_CONFIG_PATH=
if PKG_CONFIG_LIBDIR=$PKG_CONFIG_LIBDIR pkg-config --exists level-zero 2>/dev/null; then
	echo "FAIL: level-zero.pc is still visible; the test would prove nothing"
	exit 1
fi
flags=$(pkg-config --define-variable=prefix="$dest$prefix" --cflags --libs aoq) || { echo "FAIL: pkg-config --cflags --libs aoq"; exit 1; }
echo "pkg-config --cflags --libs aoq: $flags"
pkg-config --define-variable=prefix="$dest$prefix" --static --cflags --libs aoq >/dev/null || { echo "FAIL: pkg-config --static"; fail=1; }
case $flags in
*"$dest"*) ;;
*) echo "FAIL: --define-variable=prefix did not point into the DESTDIR tree"; fail=1 ;;
esac

cat >"$tmp/use.c" <<'C'
#include <aoq/aoq.h>
#include <stdio.h>
#include <string.h>
int main(void)
{
	const char *n = aoq_dtype_name(AOQ_BF16);
	printf("aoq_dtype_name(AOQ_BF16) = %s\n", n);
	return n && strcmp(n, "bf16") == 0 ? 0 : 1;
}
C
# shellcheck disable=SC2086
cc -std=gnu11 -o "$tmp/use" "$tmp/use.c" $flags || { echo "FAIL: compile and link with aoq.pc's flags"; exit 1; }
libdir=$(pkg-config --define-variable=prefix="$dest$prefix" --variable=libdir aoq)
LD_LIBRARY_PATH=$libdir "$tmp/use" || { echo "FAIL: the program linked with aoq.pc does not run"; fail=1; }
((fail == 0)) && echo "ok"
exit $fail
