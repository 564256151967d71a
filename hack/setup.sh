#!/usr/bin/env bash
# Installs everything tokenfleet needs on a fresh machine: the Python
# packages (torch included; pip's cache serves it after the first time) and the control-plane binaries built from Go modules (cached in
# .cache/bin; a cold build takes tens of minutes on 2 cores, a warm one none).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "setup: $*"; }

# Debian packages: only gcc (installed below when missing) beyond what the machine image has
# (Python 3.11 with pip, Go >= 1.24); certificates are made with the 'cryptography' package.
if ! command -v go >/dev/null; then
  [ -x /usr/local/go/bin/go ] && export PATH=/usr/local/go/bin:$PATH
fi
command -v go >/dev/null || { echo "setup: Go >= 1.24 is required to build the control plane (found none)" >&2; exit 1; }

# The serving engine compiles its CPU kernels with the system C compiler on first use.
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  command -v apt-get >/dev/null || { echo "setup: a C compiler (gcc) is required" >&2; exit 1; }
  sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  say "installing gcc"
  $sudo apt-get install -y -q gcc || { $sudo apt-get update -q && $sudo apt-get install -y -q gcc; }
fi

PY=${PYTHON:-python3}
# (Re)install when anything is missing, when the installed tokenfleet is
# another checkout's (an editable install points at one folder), or when
# pyproject.toml changed since the last install.
if ! "$PY" -c 'import sys, tokenfleet_cli, torch, transformers, kopf, hypothesis, openai
sys.exit(not tokenfleet_cli.__file__.startswith(sys.argv[1] + "/"))' "$root" 2>/dev/null \
   || [ pyproject.toml -nt .cache/pip-installed ]; then
  say "installing Python packages (pip install -e '.[dev]')"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
  mkdir -p .cache && touch .cache/pip-installed
fi
bash hack/build-kube-bins.sh
