#!/bin/bash
# SPDX-License-Identifier: MIT
# The multi-GPU checks and figures in one device call, on a machine with 2+
# GPUs (nvidia-h200-x2):
#   tests/gpu/run-multi-gpu.sh BIN [LOGDIR]
# BIN as for run-all-gpu.sh (`tests/gpu/run-gpu-tests.sh pack build BIN`).
# Runs test_distributed_gpu.py with NCCL (DDP, the shared state, no_sync,
# DCP, two daemons, FSDP2 and its DCP round trip, one GPU per rank), then
# train_gpt.py's multi-rank modes (the multi-GPU benchmark: DDP + on-GPU AdamW,
# DDP + aoq per rank and shared in fp32 / q8 / bf16, FSDP2 + on-GPU AdamW,
# FSDP2 + aoq, FSDP2 + CPUOffloadPolicy; 0.94 B GPT per rank by default),
# each within its share of the time.  Logs in LOGDIR (default $OUT):
# distributed.log, train_gpt_dist.log, summary.txt.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$(cd "${1:?BIN}" && pwd)
logs=${2:-${OUT:-$PWD/gpu-logs}}
mkdir -p "$logs"
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1 PYTHONPATH=$root/client/python
export AOQ_LIBRARY=$(ls "$bin"/lib/libaoq.so.* | head -n 1) AOQD=$bin/aoqd AOQCTL=$bin/aoqctl
: >"$logs/summary.txt"

timeout -k 5 "${AOQ_DIST_BUDGET:-200}" python3 "$here/python/test_distributed_gpu.py" \
	>"$logs/distributed.log" 2>&1
echo "distributed (NCCL): exit $?" >>"$logs/summary.txt"

timeout -k 5 "${AOQ_GPT_BUDGET:-330}" python3 "$root/tests/bench/train_gpt.py" --device cuda \
	--ranks "${AOQ_RANKS:-2}" --mode "${AOQ_DIST_MODES:-dist}" --spawn-daemon --steps 6 --warmup 3 \
	${AOQ_GPT_ARGS:-} >"$logs/train_gpt_dist.log" 2>&1
echo "train_gpt multi-rank: exit $?" >>"$logs/summary.txt"
cat "$logs/summary.txt"
grep -E '^(ok|FAIL)' "$logs/distributed.log"
grep -v 'aoqd info' "$logs/train_gpt_dist.log" | tail -n 40
