"""KWOK's lifecycle stages for the local cluster.

KWOK v0.8 ships no built-in stages, so we load the upstream "fast" stages
from the kwok module and change one thing: pods whose image is the project's
own serving image, or a vLLM image (``launch.image_runtime``), are left alone, because the local pod runner really runs
them (and reports their readiness honestly).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from .launch import VLLM_IMAGE_JQ

STAGE_FILES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
)


def runner_exclusion(image_prefix: str) -> dict:
    """A stage selector term that matches only pods NOT run by the pod runner."""
    return {
        "key": f'[.spec.containers[].image | select(startswith("{image_prefix}") or {VLLM_IMAGE_JQ})] | length',
        "operator": "In",
        "values": ["0"],
    }


def stages(source: Path, image_prefix: str) -> list[dict]:
    docs = []
    for rel in STAGE_FILES:
        for doc in yaml.safe_load_all((source / rel).read_text()):
            if not doc:
                continue
            if doc["spec"]["resourceRef"]["kind"] == "Pod":
                sel = doc["spec"].setdefault("selector", {})
                sel.setdefault("matchExpressions", []).append(runner_exclusion(image_prefix))
            docs.append(doc)
    return docs


def write(path: Path, source: Path, image_prefix: str) -> Path:
    path.write_text("\n---\n".join(yaml.safe_dump(d, sort_keys=False) for d in stages(source, image_prefix)))
    return path
