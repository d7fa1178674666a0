#!/bin/bash
# Runs one train_gpt.py mode with a deadline; if it has not finished by then,
# dumps every thread's native stack (cuda-gdb) and Python stack, for a hang.
#   tests/gpu/diag-train-gpt.sh BIN SECONDS [train_gpt options]
set -u
bin=$(cd "$1" && pwd); limit=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
logs=${OUT:-$PWD}
export LD_LIBRARY_PATH=$bin/lib PYTHONUNBUFFERED=1 AOQ_LIBRARY=$(ls "$bin"/lib/libaoq.so.* | head -n 1) AOQD=$bin/aoqd \
       PYTHONPATH=$root/client/python
python3 -X faulthandler "$root/tests/bench/train_gpt.py" "$@" >"$logs/diag.log" 2>&1 &
pid=$!
for _ in $(seq "$limit"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
if kill -0 $pid 2>/dev/null; then
	echo "== still running after $limit s: stacks" >>"$logs/diag.log"
	timeout 60 cuda-gdb -batch -p $pid -ex "thread apply all bt" >"$logs/stacks.log" 2>&1 || true
	kill -ABRT $pid 2>/dev/null   # faulthandler prints the Python stacks
	sleep 2; kill -9 $pid 2>/dev/null
fi
wait $pid; echo "exit $?" >>"$logs/diag.log"
