#!/usr/bin/env bash
# Installs everything tokenfleet needs on a fresh machine: Debian packages,
# the Python packages (torch included; pip's cache serves it after the first
# time) and the control-plane binaries built from Go modules (cached in
# .cache/bin; a cold build takes tens of minutes on 2 cores, a warm one none).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "setup: $*"; }

need_apt=()
command -v openssl >/dev/null || need_apt+=(openssl)
command -v git >/dev/null || need_apt+=(git)
python3 -c 'import venv' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
if ! command -v go >/dev/null; then
  [ -x /usr/local/go/bin/go ] && export PATH=/usr/local/go/bin:$PATH
fi
command -v go >/dev/null || { echo "setup: Go >= 1.24 is required to build the control plane (found none)" >&2; exit 1; }

PY=${PYTHON:-python3}
if ! "$PY" -c 'import tokenfleet_cli, torch, transformers, kopf, hypothesis, openai' 2>/dev/null \
   || [ pyproject.toml -nt .cache/pip-installed ]; then
  say "installing Python packages (pip install -e '.[dev]')"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
  mkdir -p .cache && touch .cache/pip-installed
fi
bash hack/build-kube-bins.sh
