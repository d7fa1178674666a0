#!/bin/bash
# SPDX-License-Identifier: MIT
# Every GPU check in one run, so a GPU machine is held once:
#   tests/gpu/run-all-gpu.sh BIN [LOGDIR]
# BIN: made here by `tests/gpu/run-gpu-tests.sh pack build-gpu BIN` (aoqd, libaoq, test
# programs and the shared libraries the GPU machine lacks).  Runs, each within its own
# share of the time: the CUDA tests, compute-sanitizer and bench-cuda in its modes
# (tests/gpu), the Python GPU tests (tests/gpu/python) and train_gpt.py (tests/bench).
# Logs in LOGDIR (default $OUT): tests.log sanitizer.log bench.log summary.txt python.log
# train_gpt.log.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$(cd "${1:?BIN}" && pwd)
logs=${2:-${OUT:-$PWD/gpu-logs}}
mkdir -p "$logs"
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1

AOQ_GPU_BUDGET=${AOQ_CUDA_BUDGET:-250} \
AOQ_BENCH_ARGS=${AOQ_BENCH_ARGS:---modes unbounded,window256,delayed --tokens 8192,65536 --steps 4} \
	"$here/run-gpu-tests.sh" "$bin" "$logs"
echo "cuda tests: exit $?" >>"$logs/summary.txt"

AOQ_LIBRARY=$(ls "$bin"/lib/libaoq.so.* | head -n 1) AOQD=$bin/aoqd timeout -k 5 "${AOQ_PY_BUDGET:-150}" \
	"$here/python/run.sh" "$bin" >"$logs/python.log" 2>&1
echo "python gpu tests: exit $?" >>"$logs/summary.txt"

AOQ_LIBRARY=$(ls "$bin"/lib/libaoq.so.* | head -n 1) AOQD=$bin/aoqd PYTHONPATH=$root/client/python \
	timeout -k 5 "${AOQ_GPT_BUDGET:-150}" python3 "$root/tests/bench/train_gpt.py" --device cuda \
	--mode all --spawn-daemon --steps 5 --warmup 2 ${AOQ_GPT_ARGS:-} >"$logs/train_gpt.log" 2>&1
echo "train_gpt: exit $?" >>"$logs/summary.txt"
cat "$logs/summary.txt"
tail -n 30 "$logs/train_gpt.log"
