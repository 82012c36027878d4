#!/usr/bin/env bash
# The flakiness check for the room tests: the failure and lifecycle tests plus the
# in-process tier, N times in a row (default 5) while two busy loops load both cores.
# Usage: scripts/busy-check.sh [N]   (uses .venv; prints one line per run, exits 1 on any failure)
set -u
cd "$(dirname "$0")/.."
runs=${1:-5}
python3 -c 'while True: pass' & b1=$!
python3 -c 'while True: pass' & b2=$!
trap 'kill $b1 $b2 2>/dev/null' EXIT
rc=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  out=$(.venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_failures.py \
        tests/integration/test_lifecycle.py tests/inproc 2>&1) || rc=1
  echo "run $i: $(( $(date +%s) - start )) s: $(echo "$out" | tail -1)"
done
exit $rc
