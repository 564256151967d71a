"""Run Argo CD health checks (resource_customizations/<group>/<Kind>/health.lua) the way Argo CD does: the
object as the Lua global ``obj``, the script's returned table read as ``{status, message}``. The runtime is
Debian's lua5.4 (Argo CD embeds gopher-lua, a Lua 5.1: the scripts use nothing newer)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CUSTOMIZATIONS = REPO / "manifests" / "argocd" / "resource_customizations"


def lua() -> str:
    path = shutil.which("lua5.4")
    if path is None:
        raise RuntimeError("lua5.4 is missing: hack/setup.sh installs Debian's lua5.4 package")
    return path


def _string(text: str) -> str:
    out = []
    for byte in text.encode():
        ch = chr(byte)
        out.append(ch if 32 <= byte < 127 and ch not in '"\\' else f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


def to_lua(value: Any) -> str:
    """A JSON-like value as a Lua expression (objects: tables with string keys; lists: sequences from 1)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "{" + ", ".join(to_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{_string(str(k))}] = {to_lua(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot pass {type(value).__name__} to Lua")


def health(kind: str, obj: dict[str, Any], group: str = "tokenfleet.dev") -> dict[str, str]:
    script = (CUSTOMIZATIONS / group / kind / "health.lua").read_text()
    program = (f"obj = {to_lua(obj)}\nlocal function health()\n{script}\nend\nlocal hs = health()\n"
               'io.write(hs.status, "\\n", hs.message or "")\n')
    run = subprocess.run([lua(), "-"], input=program, capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise RuntimeError(f"{kind}/health.lua failed: {run.stderr}")
    status, _, message = run.stdout.partition("\n")
    return {"status": status, "message": message}


def health_tests(kind: str, group: str = "tokenfleet.dev") -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """(input path, expected, actual) for every case of <Kind>/health_test.yaml, as Argo CD's own test runs them."""
    folder = CUSTOMIZATIONS / group / kind
    cases = yaml.safe_load((folder / "health_test.yaml").read_text())["tests"]
    out = []
    for case in cases:
        obj = yaml.safe_load((folder / case["inputPath"]).read_text())
        out.append((case["inputPath"], case["healthStatus"], health(kind, obj, group)))
    return out
