#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what building and testing aoq needs on Debian 12 (run as root, or
# as a user with sudo).  Used by .ci/run and deploy/quickstart.sh.  torch is
# not here (not a Debian package): .ci/run adds a venv with it
# (deploy/python-venv.sh; python3-venv below makes the venv).
# CUDA is not a Debian package: the CUDA code is built when a toolkit is
# found at /usr/local/cuda (meson option -Dcudatoolkit=DIR).
set -euo pipefail

packages=(
	meson ninja-build pkg-config gcc
	libuv1-dev libprotobuf-c-dev protobuf-c-compiler
	libsystemd-dev libze-dev libjson-c-dev zlib1g-dev
	valgrind python3 python3-numpy python3-venv python3-prometheus-client
	# tests/run-all.sh phase fuzz: clang with libFuzzer.  The fuzzer's
	# runtime (libclang_rt.fuzzer) is in libclang-rt-14-dev, which clang
	# only recommends: --no-install-recommends would leave it out.
	clang libclang-rt-14-dev
)

sudo=()
if [[ $(id -u) != 0 ]]; then
	if command -v sudo >/dev/null; then
		sudo=(sudo)
	else
		echo "install-deps.sh: run as root (or install sudo)" >&2
		exit 1
	fi
fi

export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
