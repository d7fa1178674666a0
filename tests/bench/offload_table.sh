#!/bin/bash
# SPDX-License-Identifier: MIT
# The offload table: the floor (gpu-none: forward and backward with no
# step), on-GPU fused AdamW, the peers (torchao's CPUOffloadOptimizer,
# DeepSpeed ZeRO-2 with its optimizer offloaded to the CPU) and aoq's modes
# at one model size, each mode in its own process, one aoqd for all;
# tests/bench/train_gpt.py prints per mode s/step, its ratios to on-GPU
# AdamW, to torchao and to the floor, the device peak (allocated and
# reserved) and the loss.
#
#   tests/bench/offload_table.sh [--bin DIR] 0.94|3.48 [train_gpt.py options]
#
# 0.94: GPT d_model 2048, 16 layers, 16 heads, batch 8 x 2048 (0.94 B parameters).
# 3.48: d_model 4096, 16 layers, 32 heads, batch 4 x 2048, built on the device.
# Both bf16, AdamW lr 3e-4, weight decay 0.1 (so aoq-default, the import swap with no
# aoq argument, is the fp32 master with q8 moments and the default share, aoq-default-off
# the same with everything offloaded; aoq-fp32 the fp32 master and fp32
# moments; aoq-bf16-q8 the bf16 master with q8 moments).  Each size is meant to fit in
# about 5 minutes of one H200 machine (16 cores): 8 warm-up steps (the
# -auto modes probe at steps 3, 5 and 7) and 8 (0.94) or 4 (3.48) timed ones.
# torchao and DeepSpeed are imported as they are (e.g. from wheels installed
# with pip --target and PYTHONPATH); a peer that does not import gets a row
# saying why.  --bin DIR: a packed build (DIR/aoqd, DIR/lib/libaoq.so.*, as
# tests/gpu/run-gpu-tests.sh pack makes it); else $AOQD / $AOQ_LIBRARY or the
# build tree.  The log goes to $OUT/offload-SIZE.log when OUT is set (made if
# missing; and to stdout).  MODES, STEPS, WARMUP override the mode list and the step counts,
# PYTHON the interpreter (python3).  The host's memory bandwidth is measured
# before and after each mode (train_gpt.py --host-triad: bench-kernels --triad,
# from --bin DIR, else the build tree; HOST_TRIAD=PATH to name another, or
# HOST_TRIAD= to skip it), a column of the table: aoq's host-bound steps follow
# it, and on a shared host it moves within minutes.
set -u
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
if [ "${1:-}" = "--bin" ]; then
	bin=$(cd "$2" && pwd); shift 2
	export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	export AOQ_LIBRARY=$(ls "$bin"/lib/libaoq.so.* | head -n 1) AOQD=$bin/aoqd
fi
triad=${HOST_TRIAD-${bin:-$root/build/kernels/cpu}/bench-kernels}
[ -n "$triad" ] && [ ! -x "$triad" ] && triad=
size=${1:?usage: offload_table.sh [--bin DIR] 0.94|3.48 [train_gpt.py options]}; shift
case $size in
0.94)
	shape=(--d-model 2048 --layers 16 --heads 16 --batch 8 --seq 2048)
	steps=${STEPS:-8}
	modes=${MODES:-gpu-none,gpu-adamw,torchao,deepspeed,aoq-default,aoq-default-off,aoq-fp32,aoq-bf16-q8,aoq-bf16master,aoq-bf16-q4,aoq-delayed-bf16-q4,aoq-default-auto,aoq-fp32-auto,aoq-delayed-bf16-q8-auto,aoq-delayed-bf16-q4-auto}
	;;
3.48)
	shape=(--d-model 4096 --layers 16 --heads 32 --batch 4 --seq 2048 --init-on-device)
	steps=${STEPS:-4}
	modes=${MODES:-gpu-none,gpu-adamw,torchao,deepspeed,aoq-default,aoq-default-off,aoq-fp32,aoq-bf16-q8,aoq-delayed-bf16-q4,aoq-default-auto,aoq-fp32-auto,aoq-delayed-bf16-q8-auto}
	;;
*)
	echo "offload_table.sh: size 0.94 or 3.48, not $size" >&2; exit 2 ;;
esac
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
log=/dev/null
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && log=$OUT/offload-$size.log
{
	echo "== offload_table.sh $size at $(git -C "$root" rev-parse --short HEAD 2>/dev/null) on $(hostname)," \
	     "$(nproc) cores, $(date -u +%FT%TZ)"
	nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
	"$py" -c 'import torch; print("torch", torch.__version__)'
	"$py" -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -n 1
	"$py" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>&1 | tail -n 1
	start=$(date +%s)
	"$py" "$root/tests/bench/train_gpt.py" --device cuda --spawn-daemon "${shape[@]}" --lr 3e-4 \
		--warmup "${WARMUP:-8}" --steps "$steps" --loss-tail "$steps" --mode-timeout 150 --mode "$modes" ${triad:+--host-triad "$triad"} "$@"
	rc=$?
	echo "== $size: $(( $(date +%s) - start )) s, exit $rc"
	exit $rc
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
