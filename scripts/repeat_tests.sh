#!/usr/bin/env bash
# Run a pytest selection N times in a row and say, per test case, how many of the N runs failed: the check
# that a suite passes every time, not just once (issue #40). Every run writes its own JUnit report and log
# to a temp dir and the next run starts whatever the last one returned; scripts/repeat_tests_report.py
# then reads the reports and prints the cases that failed at least once, per module and a summary line.
#
#   scripts/repeat_tests.sh 5 tests/test_store_node.py tests/test_store_pool.py -x
#   PY=.venv-vllm/bin/python KVPOOL_VLLM_TESTS=1 scripts/repeat_tests.sh 5 tests/vllm_connector
#
# Environment: PY          the interpreter whose pytest runs the tests (default .venv/bin/python)
#              REPEAT_DIR  where the reports and logs go (default: a new mktemp -d dir, printed; kept)
# Exit 0 when every case passed in every run; 1 when any case failed (or errored) at least once, or a run
# left no report (pytest killed, or a usage error); 2 on a bad command line.
set -uo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 N [pytest args...]   (N >= 1: how many runs)" >&2
    exit 2
fi
N=$1
shift
PY=${PY:-.venv/bin/python}
DIR=${REPEAT_DIR:-$(mktemp -d -t kvpool-repeat.XXXXXX)}
mkdir -p "$DIR"
HERE=$(cd "$(dirname "$0")" && pwd)

echo "[repeat] $N runs of: $PY -m pytest $*" >&2
echo "[repeat] reports and logs: $DIR" >&2
for ((i = 1; i <= N; i++)); do
    start=$(date +%s)
    "$PY" -m pytest -q --junitxml="$DIR/run-$i.xml" "$@" >"$DIR/run-$i.log" 2>&1
    rc=$?
    echo "$rc" >"$DIR/run-$i.rc"
    # pytest's own last line: "3 failed, 120 passed in 95.1s" (or why it stopped)
    echo "[repeat] run $i/$N: rc $rc, $(($(date +%s) - start)) s: $(tail -n 1 "$DIR/run-$i.log")" >&2
done

"$PY" "$HERE/repeat_tests_report.py" "$DIR" "$N"
