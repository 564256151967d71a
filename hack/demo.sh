#!/usr/bin/env bash
# The main job (README): set up a fresh machine, then run the end-to-end local
# demo — control plane, operator, a served model, a streamed answer, kubectl.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash hack/setup.sh
exec python3 -m tokenfleet_cli demo "$@"
