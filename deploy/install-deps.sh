#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what building aoq needs on Debian 12 (run as root, or as a user
# with sudo):
#   install-deps.sh          what building and running need
#                            (deploy/quickstart.sh)
#   install-deps.sh test     that and the test tools (.ci/run)
#   AOQ_DEPS_LIST=1 install-deps.sh [build|test]   print the packages only
# torch is not here (not a Debian package): .ci/run adds a venv with it
# (deploy/python-venv.sh; python3-venv below makes the venv).
# CUDA is not a Debian package: the CUDA code is built when a toolkit is
# found at /usr/local/cuda (meson option -Dcudatoolkit=DIR).
set -euo pipefail

set_name=${1:-build}
# Building and running: the compiler, meson, and the libraries aoqd, libaoq
# and aoqctl link (libsystemd: socket activation and notify).
packages=(
	meson ninja-build pkg-config gcc
	libuv1-dev libprotobuf-c-dev protobuf-c-compiler
	libsystemd-dev libjson-c-dev zlib1g-dev
)
case $set_name in
build) ;;
test)
	packages+=(
		# the Level Zero backend (suite ze, with the test driver)
		libze-dev
		# valgrind runs; the python suite without torch; aoqctl's
		# Prometheus text through prometheus_client's parser; the man
		# pages' lint (ops-man)
		valgrind python3 python3-numpy python3-venv python3-prometheus-client mandoc
		# tests/run-all.sh phase fuzz: clang with libFuzzer.  The fuzzer's
		# runtime (libclang_rt.fuzzer) is in libclang-rt-14-dev, which clang
		# only recommends: --no-install-recommends would leave it out.
		clang libclang-rt-14-dev
	)
	;;
*)
	echo "usage: install-deps.sh [build|test]" >&2
	exit 2
	;;
esac

if [[ -n ${AOQ_DEPS_LIST:-} ]]; then
	printf '%s\n' "${packages[@]}"
	exit 0
fi

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
