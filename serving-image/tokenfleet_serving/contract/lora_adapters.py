"""The adapters file: which LoRA adapters a replica serves, written by the operator (the ConfigMap
``<service>-adapters``, key ``adapters.json``, mounted into every serving pod) and followed by the server
(``tokenfleet serve --lora-modules-file``, ``server/lora_file.py``), which loads, registers and unloads
adapters as the file changes, without a restart.

Shape::

    {"adapters": [{"name": "sql", "root": "adapters-3f2a9c1e", "path": "sql/v2", "hot": true},
                  {"name": "chat", "path": "/models/adapters/chat"}]}

An entry's ``path`` is absolute, or relative to the directory of the volume ``root`` names; the server learns
each root's directory from ``--lora-root NAME=DIR``. Roots keep the file free of mount paths, which are part
of the pod template (the pod runner may move them; the file's contents it never rewrites). ``hot``: loaded at
once and kept in memory; otherwise registered (its files read and checked, then let go) and read again on its
first request.

What the server made of each entry comes back on its /metrics: ``tokenfleet:lora_adapter_loaded{adapter}``
for a servable one, ``tokenfleet:lora_adapter_error_info{adapter,file,field,reason}`` for one it refused
(``ADAPTER_ERROR_METRIC``); the operator reads both into ``status.adapters`` and its conditions.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

ADAPTERS_KEY = "adapters.json"
ADAPTER_LOADED_METRIC = "tokenfleet:lora_adapter_loaded"
ADAPTER_ERROR_METRIC = "tokenfleet:lora_adapter_error_info"
ADAPTER_PROMPT_TOKENS_METRIC = "tokenfleet:lora_prompt_tokens_total"
ADAPTER_GENERATION_TOKENS_METRIC = "tokenfleet:lora_generation_tokens_total"
# {adapter, root}: the hex root its requests' prefix blocks chain from (engine/block_pool.py), which depends on
# the adapter's files; the router hashes a request for the adapter from it
ADAPTER_ROOT_METRIC = "tokenfleet:lora_adapter_root_info"


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str                   # absolute, or relative to ``root``'s directory
    root: str | None = None     # a volume named by --lora-root
    hot: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": self.path}
        if self.root is not None:
            out["root"] = self.root
        if self.hot:
            out["hot"] = True
        return out

    def directory(self, roots: dict[str, str]) -> str:
        """The adapter's directory in this process; ``KeyError`` for a root no --lora-root names."""
        if self.root is None:
            return self.path
        return posixpath.join(roots[self.root], self.path)


def adapters_json(entries: list[AdapterEntry]) -> str:
    return json.dumps({"adapters": [e.to_json() for e in entries]}, indent=2, sort_keys=True)


def parse_adapters(text: str) -> list[AdapterEntry]:
    """The entries of an adapters file; ValueError naming what is wrong."""
    try:
        doc = json.loads(text) if text.strip() else {"adapters": []}
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    raw = doc.get("adapters") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        raise ValueError("'adapters' must be a list")
    out: list[AdapterEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"] \
                or not isinstance(item.get("path"), str) or not item["path"]:
            raise ValueError(f"adapters[{i}] needs a non-empty 'name' and 'path'")
        if item["name"] in seen:
            raise ValueError(f"adapters[{i}]: the name {item['name']!r} comes twice")
        seen.add(item["name"])
        root = item.get("root")
        if root is not None and not isinstance(root, str):
            raise ValueError(f"adapters[{i}].root must be a string")
        out.append(AdapterEntry(item["name"], item["path"], root, bool(item.get("hot", False))))
    return out
