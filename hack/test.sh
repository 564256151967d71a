#!/usr/bin/env bash
# The test command (README, CI): set up a fresh machine, then run every test.
# Cluster tests start a real local control plane (built from Go modules).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash hack/setup.sh
start=$(date +%s)
set +e
"${PYTHON:-python3}" -m pytest -v -rfE --durations=25 "$@"
rc=$?
set -e
echo "tests took $(( $(date +%s) - start ))s"
# pytest's 5 means "no tests collected": that is a failure here.
exit $rc
