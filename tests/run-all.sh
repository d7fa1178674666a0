#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Builds aoq in every configuration CI checks and runs its tests:
#
#   build          default features (auto: CUDA code compiles when
#                  /usr/local/cuda is there), every suite
#   build-asan     AddressSanitizer + UndefinedBehaviorSanitizer, CUDA off,
#                  suites unit, integration, hostile, kernels
#   build          again, `meson test --setup valgrind --suite unit`
#   build-minimal  every optional feature off (cuda, level_zero, systemd),
#                  every suite
#
# The last line of output is "N passed, M failed" (", K skipped" when tests
# were skipped); the exit status is non-zero when anything failed, a build
# included.  Tools needed: meson, ninja, gcc, pkg-config and the libraries in
# .ci/run (which installs them and then runs this script).
#
# Environment:
#   AOQ_PHASES   which phases to run (default "main asan valgrind minimal")
#   AOQ_WERROR   1 (default): warnings are errors in build and build-minimal
#   AOQ_PYTHON   the interpreter of the python suite (meson -Dpython=); default
#                $AOQ_VENV/bin/python (AOQ_VENV: /opt/aoq-venv, the venv with
#                torch that deploy/python-venv.sh makes) when it exists, else
#                Debian's python3 (test_torch.py then skips, or fails when CI
#                is set: CI must run the torch tests)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

phases=${AOQ_PHASES:-main asan valgrind minimal}
werror=${AOQ_WERROR:-1}
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
			-Dcuda=disabled -Dlevel_zero=auto -Dsystemd=auto; then
			run_tests asan build-asan --timeout-multiplier 3 \
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
			-Dsystemd=disabled "${werror_arg[@]}" "${python_arg[@]}"; then
			run_tests minimal build-minimal
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
