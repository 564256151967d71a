"""The serving image's Dockerfile and entrypoint, checked without a Docker daemon.

The entrypoint is run for real as a local process (that is how the local pod
runner uses it); the Dockerfile is checked for what the image must guarantee:
a non-root user, no compilers or package installs in the final stage, and the
same dependencies as pyproject's "serving" extra.
"""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "serving-image" / "Dockerfile"
ENTRYPOINT = ROOT / "serving-image" / "entrypoint.sh"


def stages() -> list[list[str]]:
    """Dockerfile instructions (continuations joined, comments dropped), split into stages."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def test_final_stage_runs_as_non_root_without_compilers():
    final = stages()[-1]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users, "final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root")
    runs = " ".join(line for line in final if line.upper().startswith("RUN "))
    for forbidden in ("apt-get install", "apk add", "gcc", "g++", "build-essential", "make ", "pip install"):
        assert forbidden not in runs, f"final stage runs {forbidden!r}"
    entry = [line for line in final if line.upper().startswith("ENTRYPOINT")]
    assert entry and "tokenfleet-entrypoint" in entry[-1]
    assert any(line.startswith("COPY --from=build") for line in final)


def stage(name: str) -> list[str]:
    """The instructions of the stage ``FROM ... AS name``."""
    [found] = [s for s in stages() if s[0].split()[-2:] == ["AS", name]]
    return found


def test_image_installs_the_serving_extra():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serving"]
    wanted = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() for d in extra}
    build = " ".join(stage("deps"))
    installed = {m.lower() for m in re.findall(r'"?([A-Za-z][A-Za-z0-9_-]*)(?:>=[^" ]+)?"?', build)}
    missing = sorted(wanted - installed)
    assert not missing, f"Dockerfile does not install serving dependencies {missing}"


def test_the_installed_package_carries_the_kernel_source_and_the_image_prebuilds_it(tmp_path):
    """The image installs a wheel (not the checkout): the C source must be package data, and the build
    stage must compile it where the final stage looks."""
    import shutil
    import sys
    import zipfile

    context = tmp_path / "context"          # what the Dockerfile copies, without the checkout's build leftovers
    for name in ("pyproject.toml", "README.md", "operator/tokenfleet_cli.py", "serving-image/tokenfleet_serving"):
        src, dst = ROOT / name, context / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(context)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("tokenfleet-*.whl")
    assert "tokenfleet_serving/engine/csrc/cpu_kernels.c" in zipfile.ZipFile(wheel).namelist()
    build, final = " ".join(stage("build")), " ".join(stages()[-1])
    assert "python -m tokenfleet_serving.engine.cpu_kernels --all-variants" in build
    assert "TOKENFLEET_KERNEL_CACHE=/opt/tokenfleet/kernels" in build
    assert "TOKENFLEET_KERNEL_CACHE=/opt/tokenfleet/kernels" in final and "/opt/tokenfleet" in final


@pytest.mark.parametrize("args", [["tokenfleet", "serve", "--help"], ["serve", "--help"]])
def test_entrypoint_runs_tokenfleet_subcommands_as_a_local_process(args):
    proc = subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout and "--drain-timeout" in proc.stdout


def test_entrypoint_passes_failures_through():
    proc = subprocess.run(["sh", str(ENTRYPOINT), "serve"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--model" in proc.stderr
