#!/bin/sh
# SPDX-License-Identifier: MIT
# Build the kernels and their benchmark with gcc alone (no meson, no libuv or
# protobuf-c needed), run bench-kernels and the PyTorch comparison with the
# same size and threads, and write the logs to $OUT (default ./bench-out).
# The last lines (MODE, also in $OUT/modes.txt) give, for the default
# kernel, every state precision's bytes per parameter per step, G params/s,
# GB/s and ratio to the non-temporal STREAM triad of the same run (measured
# at the start and at the end of the run: the ratio to each and to the
# better of the two).
#
#   kernels/cpu/bench.sh [-n PARAMS] [-t THREADS] [-r REPS] [extra bench-kernels args]
#   kernels/cpu/bench.sh --resident [-r REPS]    # one thread, cache-resident (compute only)
#
# KEEP_BIN=path keeps the built bench-kernels there for more runs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/bench-out}
mkdir -p "$out"
params=$((256 << 20))
threads=$(nproc)
reps=5
extra=""
resident=""
while [ $# -gt 0 ]; do
	case "$1" in
	-n) params=$2; shift 2 ;;
	--resident*) resident=$1; shift ;;
	-t) threads=$2; shift 2 ;;
	-r) reps=$2; shift 2 ;;
	*) extra="$extra $1"; shift ;;
	esac
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc=${CC:-gcc}
base="-std=gnu11 -O2 -ffp-contract=off -fno-math-errno -I$here/.. -I$here"
a512="-mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -maes"
# the avx512bf16 variant: kernels/meson.build's flags for it (DQ classifies floats)
abf="$a512 -mavx512dq -mavx512bf16 -mavx512vbmi -mvaes -DAOQK_AVX512BF16"
{
	echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm)"
	echo "# $($cc --version | head -1)"
	lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3|MHz' || true
	grep -m1 -o 'avx512_bf16' /proc/cpuinfo || echo "no avx512_bf16"
	cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true
} | tee "$out/host.txt"
t0=$(date +%s)
$cc $base -c "$here/kernel-scalar.c" -o "$tmp/scalar.o" &
$cc $base -mavx2 -mfma -mf16c -maes -c "$here/kernel-avx2.c" -o "$tmp/avx2.o" &
$cc $base $a512 -c "$here/kernel-avx512.c" -o "$tmp/avx512.o" &
$cc $base $abf -c "$here/kernel-avx512.c" -o "$tmp/avx512bf16.o" &
for d in decode hash encode; do
	D=$(echo $d | tr a-z A-Z)
	$cc $base $abf -DAOQK_KVAR=q8_no$d -DAOQK_DROP_$D=1 \
		-c "$here/kernel-avx512.c" -o "$tmp/drop-$d.o" &
done
# the divider's share: no sqrt (1), no sqrt and no division (2)
for d in 1 2; do
	$cc $base $abf -DAOQK_KVAR=q8_nodiv$d -DAOQK_DROP_DIV=$d \
		-c "$here/kernel-avx512.c" -o "$tmp/drop-div$d.o" &
done
# the q8 update with IEEE's sqrt and division (the library's approximates):
# the A/B of "q8: the approximate divider" in one run
$cc $base $abf -DAOQK_KVAR=q8_exact -DAOQK_Q8_EXACT=1 \
	-c "$here/kernel-avx512.c" -o "$tmp/q8-exact.o" &
$cc $base -DAOQK_HAVE_AVX2 -DAOQK_HAVE_AVX512 -DAOQK_HAVE_AVX512BF16 -c "$here/dispatch.c" -o "$tmp/dispatch.o" &
$cc $base -c "$here/bench-kernels.c" -o "$tmp/bench.o" &
wait
$cc "$tmp"/*.o -lpthread -lm -o "$tmp/bench-kernels"
[ -n "${KEEP_BIN:-}" ] && cp "$tmp/bench-kernels" "$KEEP_BIN"
echo "# built in $(( $(date +%s) - t0 )) s"
if [ -n "$resident" ]; then
	# compute only, one thread: every precision of the default kernel and
	# the stage-dropping builds (q8_no*), per element
	"$tmp/bench-kernels" "$resident" -r "$reps" $extra | tee "$out/bench-resident.log"
	exit 0
fi
"$tmp/bench-kernels" -n "$params" -t "$threads" -r "$reps" $extra | tee "$out/bench-kernels.log"
triad=$(sed -n 's/^RESULT stream_triad_nt gparams_per_s=[^ ]* gbps=\([^ ]*\) .*/\1/p' "$out/bench-kernels.log")
if python3 -c 'import torch' 2>/dev/null; then
	python3 "$here/bench_torch.py" --params "$params" --threads "$threads" --reps "$reps" \
		--triad-gbps "${triad:-0}" | tee "$out/bench-torch.log"
else
	echo "no PyTorch here: torch comparison skipped" | tee "$out/bench-torch.log"
fi
# speedups against torch, then every RESULT line last
grep -h '^RESULT' "$out/bench-kernels.log" "$out/bench-torch.log" > "$out/results.txt" || true
awk '
/^RESULT/ { split($3, a, "="); g[$2] = a[2] }
END {
	ta = g["torch_adamw_fused_fp32"]; tb = g["torch_way_fp32_bf16_bf16"]
	n = split("avx512bf16 avx512bf16_cached avx512 avx512_cached avx2 avx2_cached scalar", v, " ")
	for (i = 1; i <= n; i++) {
		k = v[i]
		if (!((k "_fp32_bf16_bf16") in g)) continue
		if (tb > 0) printf("SPEEDUP %s fp32 state bf16/bf16 vs torch (b): %.2fx\n", k, g[k "_fp32_bf16_bf16"] / tb)
		if (ta > 0) printf("SPEEDUP %s q8 vs torch (a): %.2fx   bf16q8 vs torch (a): %.2fx   fp32 fp32/fp32 vs torch (a): %.2fx\n", k, g[k "_q8_bf16_bf16"] / ta, g[k "_bf16q8_bf16_bf16"] / ta, g[k "_fp32_fp32_fp32"] / ta)
	}
}' "$out/results.txt" | tee "$out/speedup.txt"
cat "$out/results.txt"
# bytes per parameter per step of each state precision (kernels/README.md)
# and its rate and ratio to the non-temporal triad of this run
grep -h '^MODE' "$out/bench-kernels.log" | tee "$out/modes.txt"
