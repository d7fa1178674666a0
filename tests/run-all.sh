#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Builds aoq in every configuration CI checks and runs its tests:
#
#   build          default features (auto: CUDA code compiles when
#                  /usr/local/cuda is there), every suite
#   build-asan     AddressSanitizer + UndefinedBehaviorSanitizer, CUDA off,
#                  suites unit, integration, hostile, kernels; kernels plain
#                  C, AVX2, and AVX-512 BF16 where the CPU runs it
#                  (AOQ_ASAN_KERNELS), with ASan only (kernels/meson.build)
#   build          again, `meson test --setup valgrind --suite unit`
#   build-minimal  every optional feature off (cuda, level_zero, systemd),
#                  the suites their absence reaches (unit, faults, ops,
#                  layers, with the demo and a group's restart; the phase
#                  says why); its kernels plain C only, as in
#                  build-fuzz and build-tsan (AOQ_SIDE_KERNELS)
#   build-fuzz     clang, -Dfuzz=true, address+undefined: the libFuzzer
#                  targets of tests/fuzz replay their seed corpus (suite
#                  fuzz), then fuzz for a while, two at a time (a crash, a
#                  leak or a hang fails the phase when its input fails
#                  again in a replay; one that does not fail in 3 replays,
#                  timing-dependent, is reported with its stack in the
#                  summary but not counted)
#   build-tsan     ThreadSanitizer (gcc), CUDA off: the unit tests and the
#                  concurrency-heavy integration tests
#
# The last line of output is "N passed, M failed" (", K skipped" when tests
# were skipped); the exit status is non-zero when anything failed, a build
# included.  Tools needed: meson, ninja, gcc, pkg-config and the libraries in
# .ci/run (which installs them and then runs this script).
#
# Environment:
#   AOQ_PHASES   which phases to run (default "main asan valgrind minimal
#                fuzz tsan")
#   AOQ_FUZZ_SECONDS  how long the fuzz phase fuzzes (default 40): the
#                session target for 1.5x that, the frame target for 0.5x
#                and then the ring target for 1x, the two lines at once
#   AOQ_FUZZ_KEEP     a directory: the fuzz phase leaves there the inputs it
#                found (new corpus entries and crashes), else they go
#   AOQ_WERROR   1 (default): warnings are errors in build and build-minimal
#   AOQ_SIDE_KERNELS  the kernel variants of build-minimal, build-fuzz and
#                build-tsan (meson -Dkernel_variants; default none: plain C
#                only, "all" for every one); AOQ_ASAN_KERNELS those of
#                build-asan (default avx2, and avx512bf16 where the CPU has
#                AVX-512 BF16)
#   AOQ_PYTHON   the interpreter of the python suite (meson -Dpython=); default
#                $AOQ_VENV/bin/python (AOQ_VENV: /opt/aoq-venv, the venv with
#                torch that deploy/python-venv.sh makes) when it exists, else
#                Debian's python3 (test_torch.py then skips, or fails when CI
#                is set: CI must run the torch tests)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

phases=${AOQ_PHASES:-main asan valgrind minimal fuzz tsan}
werror=${AOQ_WERROR:-1}
# The CPU kernels' SIMD variants take most of a build's time on a small
# machine (gcc -O2, 2-core VM: about 30 s of CPU each, plain C 10 s; with
# ASan, 64 s for AVX2).
# main builds and tests all of them (suite kernels: every variant the CPU
# runs, bit-identical).  asan builds the ones it can run of avx2 and
# avx512bf16 (avx512 is avx512bf16's source without its bf16 conversions:
# the same loads and stores); a variant the CPU cannot run would only be
# compiled again.  minimal, fuzz and tsan test the daemon around the
# kernels and build plain C only (meson -Dkernel_variants=none).
side_kernels=(-Dkernel_variants=${AOQ_SIDE_KERNELS:-none})
asan_default=avx2
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then
	asan_default=avx2,avx512bf16
fi
asan_kernels=(-Dkernel_variants=${AOQ_ASAN_KERNELS:-$asan_default})
logdir=$(mktemp -d "${TMPDIR:-/tmp}/aoq-run-all.XXXXXX")
trap 'rm -rf "$logdir"' EXIT

total_pass=0
total_fail=0
total_skip=0
summary=()
start=$SECONDS

log() { printf '\n=== %s\n' "$*"; }

# configure DIR MESON_ARGS...: (re)configure a build directory with exactly
# these options.
configure() {
	local dir=$1
	shift
	if [[ -f $dir/meson-private/coredata.dat ]]; then
		meson setup --reconfigure "$dir" "$@" || meson setup --wipe "$dir" "$@"
	else
		meson setup "$dir" "$@"
	fi
}

# build LABEL DIR MESON_ARGS...: configure and compile; a failure counts as
# one failed test.
build() {
	local label=$1 dir=$2
	shift 2
	log "$label: configure and build $dir"
	if configure "$dir" "$@" && ninja -C "$dir"; then
		return 0
	fi
	summary+=("$label: BUILD FAILED")
	total_fail=$((total_fail + 1))
	return 1
}

# count FILE KEY: the number after "KEY:" in meson test's summary.
count() {
	awk -v key="$2:" 'index($0, key) == 1 { n = $NF } END { print n + 0 }' "$1"
}

# run_tests LABEL DIR MESON_TEST_ARGS...: runs meson test and adds its
# summary to the totals.
run_tests() {
	local label=$1 dir=$2
	shift 2
	local out="$logdir/${label//[^a-zA-Z0-9_-]/_}.log"
	log "$label: meson test -C $dir $*"
	meson test -C "$dir" --print-errorlogs "$@" 2>&1 | tee "$out"
	local rc=${PIPESTATUS[0]}
	local ok xfail fail xpass skip timeout
	ok=$(count "$out" "Ok")
	xfail=$(count "$out" "Expected Fail")
	fail=$(count "$out" "Fail")
	xpass=$(count "$out" "Unexpected Pass")
	skip=$(count "$out" "Skipped")
	timeout=$(count "$out" "Timeout")
	local p=$((ok + xfail)) f=$((fail + xpass + timeout))
	if ((rc != 0 && f == 0)); then
		# meson test itself failed (unknown setup, build error, ...).
		f=1
		summary+=("$label: meson test failed with status $rc before reporting results")
	elif ((p + f + skip == 0)); then
		# a selection that matches no test ("No suitable tests defined.")
		f=1
		summary+=("$label: no test ran (a suite or test name that matches nothing?)")
	fi
	total_pass=$((total_pass + p))
	total_fail=$((total_fail + f))
	total_skip=$((total_skip + skip))
	summary+=("$label: $p passed, $f failed, $skip skipped")
}

werror_arg=()
if [[ $werror == 1 ]]; then
	werror_arg=(-Dwerror=true)
fi

python=${AOQ_PYTHON:-}
if [[ -z $python && -x ${AOQ_VENV:-/opt/aoq-venv}/bin/python ]]; then
	python=${AOQ_VENV:-/opt/aoq-venv}/bin/python
fi
# -Dpython= (empty) resets a value an earlier run configured.
python_arg=(-Dpython="$python")
echo "run-all.sh: python suite interpreter: ${python:-/usr/bin/python3 (no torch venv)}"

# 0: not built yet, 1: built, 2: its build failed (counted once).
main_state=0
build_main() {
	if ((main_state == 0)); then
		if build main build -Dcuda=auto -Dlevel_zero=auto -Dsystemd=auto "${werror_arg[@]}" \
			"${python_arg[@]}"; then
			main_state=1
		else
			main_state=2
		fi
	fi
	((main_state == 1))
}

# build_only LABEL DIR "TARGETS" MESON_ARGS...: configure, then build only
# these targets; a failure counts as one failed test.
build_only() {
	local label=$1 dir=$2 targets=$3
	shift 3
	log "$label: configure $dir, build $targets"
	# shellcheck disable=SC2086 # the targets are words
	if configure "$dir" "$@" && ninja -C "$dir" $targets; then
		return 0
	fi
	summary+=("$label: BUILD FAILED")
	total_fail=$((total_fail + 1))
	return 1
}

# fuzz_run NAME SECONDS: runs target NAME for SECONDS on a scratch copy of
# its corpus; writes its verdict to $logdir/fuzz-NAME.rc.
fuzz_run() {
	local name=$1 secs=$2
	local work=$logdir/corpus-$name art=$logdir/crash-$name
	mkdir -p "$work" "$art"
	nice -n 10 build-fuzz/tests/fuzz/fuzz-"$name" -max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 \
		-print_final_stats=1 -artifact_prefix="$art/" "$work" tests/fuzz/corpus/"$name" \
		>"$logdir/fuzz-$name.log" 2>&1
	echo $? >"$logdir/fuzz-$name.rc"
}

# fuzz_flaky NAME: true when target NAME left inputs and none fails again
# in 3 replays each.
fuzz_flaky() {
	local name=$1 a k n=0
	for a in "$logdir/crash-$name"/*; do
		[[ -f $a ]] || continue
		n=$((n + 1))
		for k in 1 2 3; do
			if ! build-fuzz/tests/fuzz/fuzz-"$name" -timeout=120 -rss_limit_mb=2048 "$a" \
				>>"$logdir/fuzz-$name.replay.log" 2>&1; then
				return 1
			fi
		done
	done
	((n > 0))
}

for phase in $phases; do
	t0=$SECONDS
	case $phase in
	main)
		if build_main; then
			run_tests main build
		fi
		;;
	asan)
		if build asan build-asan -Db_sanitize=address,undefined -Db_lundef=false \
			-Dcuda=disabled -Dlevel_zero=auto -Dsystemd=auto "${asan_kernels[@]}"; then
			# limits-rollstall and -byestall with 64 Mi parameters
			# (AOQT_STALL_MI) instead of 256 and 384: the same
			# rollback and release code under the sanitizers, in 3-4
			# s instead of 25 and 19; the main build checks their
			# bounds at full size.
			AOQT_STALL_MI=${AOQT_STALL_MI:-64} run_tests asan build-asan --timeout-multiplier 3 \
				--suite unit --suite integration --suite hostile --suite kernels
		fi
		;;
	valgrind)
		if build_main; then
			run_tests valgrind build --setup valgrind --suite unit
		else
			summary+=("valgrind: not run (the main build failed)")
		fi
		;;
	minimal)
		if build minimal build-minimal -Dcuda=disabled -Dlevel_zero=disabled \
			-Dsystemd=disabled "${side_kernels[@]}" "${werror_arg[@]}" "${python_arg[@]}"; then
			# What the optional features reach: libsystemd's calls
			# (daemon/server.c, fdstore.c, statemem.c: notify, the
			# watchdog, socket activation, the fd store; the states are
			# memfds only under systemd's NOTIFY_SOCKET, which no test
			# but the fd store's sets) and the GPU backends (client/,
			# the stub without them).  So the suites where their absence
			# shows: unit, faults (a restart then restores the
			# snapshots), ops (the units built without libsystemd, the
			# quick start, the demo's errors for a missing backend) and
			# layers, with the demo and a replica group's restart.  The
			# other integration and hostile tests, the python suite, the
			# kernels, the loop's stall tests and ops-readme-install
			# (suite install: it builds from the source tree with options
			# of its own) run the same code as in main: not run twice.
			run_tests minimal build-minimal --suite unit --suite faults --suite ops --suite layers --no-suite install
			run_tests minimal-demo build-minimal --no-rebuild demo integration-shared-restart
		fi
		;;
	fuzz)
		fuzz_targets="tests/fuzz/fuzz-frame tests/fuzz/fuzz-session tests/fuzz/fuzz-ring"
		if ! command -v clang >/dev/null; then
			summary+=("fuzz: clang not found (deploy/install-deps.sh installs it)")
			total_fail=$((total_fail + 1))
		elif CC=clang build_only fuzz build-fuzz "$fuzz_targets" -Dfuzz=true \
			-Db_lundef=false -Dcuda=disabled -Dlevel_zero=disabled \
			-Dsystemd=disabled "${side_kernels[@]}"; then
			# The seeds and the crashes found before must pass.
			run_tests fuzz-corpus build-fuzz --no-rebuild --suite fuzz
			secs=${AOQ_FUZZ_SECONDS:-40}
			log "fuzz: fuzzing for about $((secs * 3 / 2)) s, two targets at a time"
			fuzz_run session $((secs * 3 / 2)) &
			pid_session=$!
			fuzz_run frame $((secs / 2))
			fuzz_run ring "$secs"
			wait "$pid_session"
			p=0 f=0
			for name in frame session ring; do
				rc=$(cat "$logdir/fuzz-$name.rc" 2>/dev/null || echo 1)
				grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)' \
					"$logdir/fuzz-$name.log" | sed "s/^/  fuzz-$name: /"
				# A find whose input does not fail again in 3 replays
				# (a timeout or a timing-dependent report on a loaded
				# machine) is reported, not counted as a failure.
				verdict=FAILED
				if [[ $rc != 0 ]] && fuzz_flaky "$name"; then
					verdict="found something that did not fail again in 3 replays"
				fi
				if [[ $rc == 0 ]]; then
					p=$((p + 1))
				elif [[ $verdict != FAILED ]]; then
					p=$((p + 1))
					echo "fuzz-$name: $verdict; the end of its log:"
					tail -n 60 "$logdir/fuzz-$name.log"
					summary+=("fuzz-$name (status $rc) $verdict:")
					while IFS= read -r line; do
						summary+=("  $line")
					done < <(grep -E '^(==[0-9]+==ERROR|SUMMARY|[[:space:]]+#[0-9] )' \
						"$logdir/fuzz-$name.log" | head -n 12)
				else
					f=$((f + 1))
					echo "fuzz-$name FAILED (status $rc): the end of its log, then the input:"
					tail -n 60 "$logdir/fuzz-$name.log"
					ls -l "$logdir/crash-$name"
					# Again in the summary, which ends the output (CI
					# shows only its end): the verdict, the top of the
					# stack and the input (base64) to replay it.
					summary+=("fuzz-$name FAILED (status $rc):")
					while IFS= read -r line; do
						summary+=("  $line")
					done < <(grep -E '^(==[0-9]+==ERROR|SUMMARY|[[:space:]]+#[0-9] |artifact_prefix|Test unit written)' \
						"$logdir/fuzz-$name.log" | head -n 16)
					for a in "$logdir/crash-$name"/*; do
						[[ -f $a && $(stat -c %s "$a") -le 3072 ]] || continue
						summary+=("  input $(basename "$a"): $(base64 -w0 "$a")")
					done
				fi
			done
			if [[ -n ${AOQ_FUZZ_KEEP:-} ]]; then
				mkdir -p "$AOQ_FUZZ_KEEP" && cp -r "$logdir"/corpus-* "$logdir"/crash-* "$AOQ_FUZZ_KEEP"/
			fi
			total_pass=$((total_pass + p))
			total_fail=$((total_fail + f))
			summary+=("fuzz: $p passed, $f failed (targets fuzzed)")
		fi
		;;
	tsan)
		# The concurrency-heavy tests: the pool, the rings, the snapshot
		# writer waiting for the pool's idle times, a session's last two
		# references dropped on two threads, a new state faulted in
		# beside its loads, libaoq's
		# progress thread against the daemon's workers, a killed aoqd's
		# journal replayed on threads, dead trainers' steps rolled back
		# off the loop beside two other trainers (both built with
		# TSan; a report makes aoqd or the test exit 66).  integration-train
		# and demo-deterministic add little beyond these and take minutes
		# under TSan; push-stress runs 15 steps instead of 60 (and again
		# with the loop's spin, loop_spin_us), faults-kill 20 kills
		# instead of 100.
		tsan_tests="unit-ring unit-pool unit-fdstore unit-wire unit-account unit-snapshot-pace unit-session-refs unit-populate integration-push-stress
			integration-push-stress-spin integration-loop-spin integration-accumulate integration-modes integration-optimizers integration-timeout
			integration-populate faults-kill demo"
		tsan_targets="daemon/aoqd client/examples/aoq-demo tests/unit/test-ring tests/unit/test-pool tests/unit/test-fdstore
			tests/unit/test-wire tests/unit/test-account tests/unit/test-snapshot-pace tests/unit/test-session-refs tests/unit/test-populate tests/integration/test-push-stress tests/integration/test-loop-spin
			tests/integration/test-accumulate tests/integration/test-modes tests/integration/test-optimizers
			tests/integration/test-timeout tests/integration/test-populate tests/faults/test-faults"
		# Not -Dwerror, and -Wno-tsan: gcc warns that TSan does not model
		# atomic_thread_fence, which the rings use (proto/aoq-arena.h)
		# next to acquire/release atomics that TSan does see (a fence it
		# missed would show as a report, which fails the test); the main
		# build checks every other warning.
		if build_only tsan build-tsan "$tsan_targets" -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled \
			-Dlevel_zero=disabled -Dsystemd=disabled -Dwerror=false -Dc_args=-Wno-tsan "${side_kernels[@]}"; then
			# shellcheck disable=SC2086 # the tests are words
			TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
				AOQ_STRESS_STEPS=${AOQ_STRESS_STEPS:-15} AOQT_KILLS=${AOQT_KILLS:-20} \
				run_tests tsan build-tsan --no-rebuild --timeout-multiplier 3 $tsan_tests
		fi
		;;
	*)
		echo "run-all.sh: unknown phase '$phase'" >&2
		summary+=("$phase: unknown phase")
		total_fail=$((total_fail + 1))
		;;
	esac
	summary+=("  ($phase took $((SECONDS - t0)) s)")
done

log "summary ($((SECONDS - start)) s)"
for line in "${summary[@]}"; do
	echo "  $line"
done
if ((total_skip > 0)); then
	echo "$total_pass passed, $total_fail failed, $total_skip skipped"
else
	echo "$total_pass passed, $total_fail failed"
fi
((total_fail == 0))
