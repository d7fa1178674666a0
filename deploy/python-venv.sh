#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Makes the Python environment the torch tests run in: a venv of Debian's
# python3 (apt package python3-venv, installed by install-deps.sh) at
# $AOQ_VENV (default /opt/aoq-venv) with torch, numpy, pytest and safetensors
# from PyPI.  A venv whose python already imports torch is reused as it is,
# so a second run costs nothing.  Prints the venv's python on its last line.
# Used by .ci/run; deploy/quickstart.sh does not need torch.  PyPI's torch
# wheel for Linux x86_64 brings its CUDA libraries (about 5 GiB, ~2 min); it
# runs on the CPU too.  AOQ_TORCH_SPEC overrides the requirement ("torch").
set -euo pipefail

venv=${AOQ_VENV:-/opt/aoq-venv}
py=$venv/bin/python
if [[ -x $py ]] && version=$("$py" -c 'import numpy, torch; print(torch.__version__)' 2>/dev/null); then
	echo "python-venv.sh: reusing $venv (torch $version)" >&2
	echo "$py"
	exit 0
fi
echo "python-venv.sh: creating $venv (torch from PyPI)" >&2
/usr/bin/python3 -m venv "$venv"
# --no-deps would not do: torch needs its nvidia-* wheels even on the CPU.
"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
	"${AOQ_TORCH_SPEC:-torch}" numpy pytest safetensors >&2
"$py" -c 'import torch; print("python-venv.sh: torch", torch.__version__, file=__import__("sys").stderr)'
echo "$py"
