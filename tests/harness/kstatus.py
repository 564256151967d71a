"""kstatus (sigs.k8s.io/cli-utils/pkg/kstatus, what Flux and kpt compute from an object), built from Go modules by
hack/build-tools.sh into .cache/bin/tools (or $TOKENFLEET_TOOLS_DIR)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def binary() -> Path:
    path = Path(os.environ.get("TOKENFLEET_TOOLS_DIR") or REPO / ".cache" / "bin" / "tools") / "kstatus"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run bash hack/build-tools.sh (hack/setup.sh does)")
    return path


def compute(obj: dict[str, Any]) -> dict[str, str]:
    """{kind, name, status, message}: status is InProgress, Current, Failed, Terminating, NotFound or Unknown."""
    run = subprocess.run([str(binary())], input=json.dumps(obj), capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise RuntimeError(f"kstatus failed: {run.stderr}")
    return json.loads(run.stdout)
