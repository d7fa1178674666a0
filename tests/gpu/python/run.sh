#!/bin/bash
# SPDX-License-Identifier: MIT
# The Python GPU tests (aoq.torch against torch on the GPU) on a CUDA machine:
#   tests/gpu/python/run.sh [BUILD_DIR] [--device cuda:0]
# Needs torch with CUDA; libaoq and aoqd from BUILD_DIR (default: build).
# Prints one line per test and "N passed, M failed, K skipped"; exits 1 on a failure.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${1:-$root/build}
[ $# -gt 0 ] && shift
export AOQ_LIBRARY=${AOQ_LIBRARY:-$build/client/libaoq.so}
export AOQD=${AOQD:-$build/daemon/aoqd}
# a build directory, or a packed BIN (run-gpu-tests.sh pack) with aoqctl at its top
[ -x "$build/aoqctl" ] && export AOQCTL=${AOQCTL:-$build/aoqctl}
export AOQCTL=${AOQCTL:-$build/client/tools/aoqctl}
export PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
pass=0 fail=0 skip=0
# each entry: a script (beside this one, or under the root) and its own arguments
for t in test_offload.py test_gpt_bf16.py "test_gpt_bf16.py --state-precision default" test_distributed_gpu.py test_masters_memfds.py \
	"client/python/tests/test_torch_policy.py --device cuda:0" "client/python/tests/test_q8_share.py --device cuda:0"; do
	echo "== $t $*"
	read -r -a cmd <<<"$t"
	script=$here/${cmd[0]}
	[ -f "$script" ] || script=$root/${cmd[0]}
	"$py" "$script" "${cmd[@]:1}" "$@"
	rc=$?
	case $rc in
	0) pass=$((pass + 1)); echo "PASS $t" ;;
	77) skip=$((skip + 1)); echo "SKIP $t" ;;
	*) fail=$((fail + 1)); echo "FAIL $t (exit $rc)" ;;
	esac
done
echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
