#!/bin/bash
# SPDX-License-Identifier: MIT
# GPU tests and benchmark of the CUDA backend.
#
#   tests/gpu/run-gpu-tests.sh [BIN] [LOGDIR]
#
# BIN: a folder holding aoqd, aoqctl, test-cuda, test-cuda-nodev, bench-cuda,
# bench-restart, bench-shmem, bench-kernels and lib/ (libaoq.so.N, its soname, plus any shared library the machine lacks), as made by
# `run-gpu-tests.sh pack BUILD_DIR BIN`; without it the script builds with
# meson into build-gpu (needs libuv, protobuf-c, nvcc).  Logs go to LOGDIR
# (default $OUT, else ./gpu-logs): tests.log, sanitizer.log, bench.log and
# summary.txt (at most a few files: the device tool returns 8).
#
# Environment: AOQ_GPU_BUDGET (seconds for the whole run, default 540; a
# step that would start past it is skipped and reported), AOQ_GPU_SKIP
# (space-separated step names to skip), AOQ_BENCH_ARGS (bench-cuda options).
set -u

if [ "${1:-}" = pack ]; then
	build=${2:?build dir}; bin=${3:?destination}
	mkdir -p "$bin/lib"
	cp "$build/daemon/aoqd" "$build/client/tools/aoqctl" "$build/tests/gpu/test-cuda" \
	   "$build/tests/gpu/test-cuda-nodev" "$build/tests/gpu/bench-cuda" "$bin/"
	# the host-side benchmarks a GPU machine's cores and memory run too
	# (tests/bench/restart_table.sh --bin BIN, bench-shmem; bench-kernels,
	# which tests/bench/offload_table.sh --bin BIN runs for the host's triad)
	for b in tests/bench/bench-restart tests/bench/bench-shmem kernels/cpu/bench-kernels; do
		[ -x "$build/$b" ] && cp "$build/$b" "$bin/"
	done
	soname=$(objdump -p "$build/client/libaoq.so" | awk '/SONAME/ { print $2 }')
	cp -L "$build/client/$soname" "$bin/lib/"
	for l in libuv.so.1 libprotobuf-c.so.1 libze_loader.so.1 libjson-c.so.5; do
		cp -L "/usr/lib/x86_64-linux-gnu/$l" "$bin/lib/"
	done
	exit 0
fi

bin=${1:-}
logs=${2:-${OUT:-$PWD/gpu-logs}}
mkdir -p "$logs"
budget=${AOQ_GPU_BUDGET:-540}
start=$SECONDS
summary=$logs/summary.txt
: >"$summary"

if [ -z "$bin" ]; then
	meson setup build-gpu -Dcuda=enabled >/dev/null && ninja -C build-gpu >"$logs/build.log" 2>&1 || {
		echo "build failed (see build.log)" | tee -a "$summary"; exit 1; }
	bin=$PWD/build-gpu/gpu-bin
	"$0" pack build-gpu "$bin"
fi
bin=$(cd "$bin" && pwd)
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export AOQ_TEST_SLOW=1
aoqd=$bin/aoqd

# cuBLAS for the benchmark (dlopen'ed): the toolkit's, else PyTorch's wheel.
if [ -z "${AOQ_CUBLAS:-}" ]; then
	AOQ_CUBLAS=$(find /usr/local/cuda*/ /usr/local/cuda/lib64 /opt /usr/lib -name 'libcublas.so.13*' 2>/dev/null | head -1)
	export AOQ_CUBLAS
fi

failures=0
# step NAME LOG TIMEOUT EXPECT CMD...: runs CMD, appends its output to LOG.
step() {
	local name=$1 log=$2 to=$3 expect=$4; shift 4
	case " ${AOQ_GPU_SKIP:-} " in *" $name "*) echo "| $name | skipped (AOQ_GPU_SKIP) | |" >>"$summary"; return;; esac
	local left=$((budget - (SECONDS - start)))
	if [ "$left" -lt 20 ]; then
		echo "| $name | not run: time budget | |" >>"$summary"; return
	fi
	[ "$to" -le "$left" ] || to=$left
	local t0=$SECONDS
	echo "==== $name: $*" >>"$log"
	timeout -k 10 "$to" "$@" >>"$log" 2>&1
	local rc=$?
	local res=ok
	[ "$rc" -eq "$expect" ] || { res="FAIL (exit $rc)"; failures=$((failures + 1)); }
	echo "==== $name: exit $rc, $((SECONDS - t0)) s" >>"$log"
	echo "| $name | $res | $((SECONDS - t0)) s |" >>"$summary"
}

T=$logs/tests.log S=$logs/sanitizer.log B=$logs/bench.log
{
	echo "# GPU run $(date -u +%FT%TZ)"
	nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
	nproc; uname -r; echo "cuBLAS: ${AOQ_CUBLAS:-none}"
	command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>&1
} >"$T" 2>&1
echo "| step | result | time |" >>"$summary"
echo "|---|---|---|" >>"$summary"

step cuda-no-device "$T" 30 77 "$bin/test-cuda-nodev"
step kernels "$T" 60 0 "$bin/test-cuda" kernels "$aoqd"
step correct "$T" 120 0 "$bin/test-cuda" correct "$aoqd"
step timeline "$T" 60 0 "$bin/test-cuda" timeline "$aoqd"
step race "$T" 150 0 "$bin/test-cuda" race "$aoqd"
step race-bf16 "$T" 150 0 env AOQT_RACE_BF16=1 "$bin/test-cuda" race "$aoqd"
step race-q8 "$T" 150 0 env AOQT_RACE_Q8=1 "$bin/test-cuda" race "$aoqd"
step race-q8-delayed "$T" 150 0 env AOQT_RACE_Q8=1 AOQT_RACE_DELAYED=1 "$bin/test-cuda" race "$aoqd"
step race-q4 "$T" 150 0 env AOQT_RACE_Q4=1 "$bin/test-cuda" race "$aoqd"
step race-q8-m24 "$T" 150 0 env AOQT_RACE_Q8=1 AOQT_RACE_M24=1 "$bin/test-cuda" race "$aoqd"
# shellcheck disable=SC2086
step bench "$B" 240 0 "$bin/bench-cuda" --aoqd "$aoqd" ${AOQ_BENCH_ARGS:-}

cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
csargs=(--target-processes application-only --error-exitcode 99 --print-limit 20)
step memcheck-kernels "$S" 120 0 "$cs" --tool memcheck "${csargs[@]}" "$bin/test-cuda" kernels "$aoqd" small
step memcheck-correct "$S" 120 0 "$cs" --tool memcheck "${csargs[@]}" "$bin/test-cuda" correct "$aoqd" small
step memcheck-race "$S" 120 0 "$cs" --tool memcheck "${csargs[@]}" "$bin/test-cuda" race "$aoqd" small
step memcheck-race-q8 "$S" 120 0 env AOQT_RACE_Q8=1 "$cs" --tool memcheck "${csargs[@]}" "$bin/test-cuda" race "$aoqd" small
step memcheck-race-q4 "$S" 120 0 env AOQT_RACE_Q4=1 "$cs" --tool memcheck "${csargs[@]}" "$bin/test-cuda" race "$aoqd" small
step racecheck-race "$S" 120 0 "$cs" --tool racecheck "${csargs[@]}" "$bin/test-cuda" race "$aoqd" small
step racecheck-kernels "$S" 120 0 "$cs" --tool racecheck "${csargs[@]}" "$bin/test-cuda" kernels "$aoqd" small

{
	echo
	echo "failures: $failures; total $((SECONDS - start)) s"
	echo
	grep -h -E '^(ok:|timeline:|\| [0-9])' "$T" 2>/dev/null
	echo
	grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$S" 2>/dev/null
	echo
	grep -v -E '^(==== )' "$B" 2>/dev/null | tail -25
} >>"$summary"
cat "$summary"
[ "$failures" -eq 0 ]
