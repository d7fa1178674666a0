#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# deploy/quickstart.sh as README's quick start runs it, on this build
# directory and without the package step (AOQ_QUICKSTART_NO_INSTALL): its
# package set holds what building and running need and none of the test
# tools; it builds aoqd, aoqctl and the demo only; the demo trains and its
# `aoqctl stats` sample has rates (the session's STEP/s, IN/s and OUT/s are
# numbers, not '-').
#   test-quickstart.sh SOURCE_ROOT BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
fail=0
say() { echo "test-quickstart: $*"; }

pkgs=$(AOQ_DEPS_LIST=1 bash "$src/deploy/install-deps.sh" build)
tests=$(AOQ_DEPS_LIST=1 bash "$src/deploy/install-deps.sh" test)
say "build set: $(tr '\n' ' ' <<<"$pkgs")"
for p in clang libclang-rt-14-dev valgrind libze-dev mandoc python3-prometheus-client; do
	grep -qx "$p" <<<"$pkgs" && { say "FAIL: the quick start installs the test tool $p"; fail=1; }
	grep -qx "$p" <<<"$tests" || { say "FAIL: the test set lacks $p"; fail=1; }
done
for p in gcc meson ninja-build pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler libjson-c-dev; do
	grep -qx "$p" <<<"$pkgs" || { say "FAIL: the quick start does not install $p"; fail=1; }
done
grep -q 'install-deps.sh test' "$src/.ci/run" || { say "FAIL: .ci/run does not install the test set"; fail=1; }
grep -qE '^ninja -C "\$build" daemon/aoqd client/tools/aoqctl client/examples/aoq-demo$' "$src/deploy/quickstart.sh" ||
	{ say "FAIL: the quick start builds more (or other) than aoqd, aoqctl and the demo"; fail=1; }

out=$(AOQ_QUICKSTART_NO_INSTALL=1 AOQ_QUICKSTART_BUILD="$build" bash "$src/deploy/quickstart.sh" 2>&1) || {
	echo "$out"
	say "FAIL: deploy/quickstart.sh exited non-zero"
	exit 1
}
echo "$out"
grep -q "== installing packages" <<<"$out" && { say "FAIL: packages were installed"; fail=1; }
sample=$(sed -n '/^== aoqctl stats (taken while the demo trained)$/,/^== stopping aoqd$/p' <<<"$out")
# the session row: ID JOB(quickstart) RANK UID PARAMS STEPS STEP/s IN/s OUT/s ...
row=$(grep -E '^ *[0-9]+ +quickstart ' <<<"$sample" | head -1)
read -r -a f <<<"$row"
if [[ ${#f[@]} -lt 11 ]] || ! [[ ${f[6]} =~ ^[0-9]+\.[0-9]+$ && ${f[7]} =~ ^[0-9.]+$ && ${f[9]} =~ ^[0-9.]+$ ]]; then
	say "FAIL: the stats sample's session row has no rates: '$row'"
	fail=1
else
	say "sample: ${f[6]} steps/s, ${f[7]} ${f[8]} in"
fi
grep -q "ratio .*: ok" <<<"$out" || { say "FAIL: the demo's loss did not fall"; fail=1; }
((fail == 0)) && say "ok"
exit $fail
