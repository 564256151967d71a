"""``--lora-modules-file``: the server follows an adapters file (``contract/lora_adapters.py``).

Every ``interval`` seconds it reads the file; when its text changed it makes the engine match it:

- a new entry (or one whose directory or ``hot`` changed): ``hot`` ones are loaded (kept in memory), the
  others registered (files read and checked, then let go until their first request);
- an entry that is gone: unloaded; requests already running with it finish first (the engine's unload);
- an entry the engine refused (``AdapterError``: base mismatch, rank over --max-lora-rank, unknown target
  module, a missing or corrupt file) is kept in ``errors`` with its file and field, exported on /metrics as
  ``tokenfleet:lora_adapter_error_info``, and tried again every ``retry_s`` seconds (its files may be fixed in
  place), logging only when the reason changes. An entry that was served and whose new directory is refused
  keeps serving the old one until the file is fixed or the entry removed.

Only adapters the file brought are unloaded by it: ``--lora-modules`` and ``/v1/load_lora_adapter`` adapters
are left alone. A file that cannot be read or parsed changes nothing (the last good one stays in force).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet_serving.contract.lora_adapters import AdapterEntry, parse_adapters
from tokenfleet_serving.engine.lora_adapter import AdapterError
from tokenfleet_serving.engine.lora_manager import UnknownAdapter

log = logging.getLogger("tokenfleet.server.lora")


@dataclass(frozen=True)
class EntryError:
    """Why an entry is not served: the adapter file and the field or tensor, as ``AdapterError`` names them."""

    file: str
    field: str
    reason: str


class AdapterFile:
    def __init__(self, engine: Any, path: str | Path, roots: dict[str, str], *, interval: float = 1.0,
                 retry_s: float = 5.0):
        self.engine, self.path, self.roots = engine, Path(path), dict(roots)
        self.interval, self.retry_s = interval, retry_s
        self.applied: dict[str, tuple[str, bool]] = {}       # name -> (directory, hot) the engine serves
        self.errors: dict[str, EntryError] = {}
        self.file_error: str | None = None
        self._text: str | None = None
        self._entries: list[AdapterEntry] = []
        self._next_retry = 0.0
        self.on_change: Callable[[], None] | None = None     # called on the event loop after a change applied

    def sync(self) -> bool:
        """Read the file and apply what changed (and retry refused entries when due); True if anything was
        applied. Blocking (the engine reads the adapters' files, with its lock released); run it off the event
        loop."""
        try:
            text = self.path.read_text()
        except OSError as e:
            self._set_file_error(f"cannot read {self.path}: {e.strerror or e}")
            return False
        retry = bool(self.errors) and time.monotonic() >= self._next_retry
        if text == self._text and not retry:
            return False
        if text != self._text:
            try:
                entries = parse_adapters(text)
            except ValueError as e:
                self._set_file_error(f"{self.path}: {e}")
                self._text = text
                return False
            self._text, self._entries = text, entries
            self._set_file_error(None)
        changed = self._apply(self._entries)
        self._next_retry = time.monotonic() + self.retry_s
        return changed

    def _apply(self, entries: list[AdapterEntry]) -> bool:
        changed = False
        wanted = {e.name for e in entries}
        for name in [n for n in self.applied if n not in wanted]:
            try:
                gone = self.engine.unload_lora_adapter(name)
                log.info("LoRA adapter %r unloaded%s", name, "" if gone else " (after its running requests)")
            except UnknownAdapter:
                pass
            del self.applied[name]
            changed = True
        for name in [n for n in self.errors if n not in wanted]:
            del self.errors[name]
            changed = True
        for entry in entries:
            try:
                directory = entry.directory(self.roots)
            except KeyError:
                changed |= self._refuse(entry.name, EntryError("", "root", f"no --lora-root names {entry.root!r}"))
                continue
            if self.applied.get(entry.name) == (directory, entry.hot) and entry.name not in self.errors:
                continue
            try:
                if entry.hot:
                    seconds = self.engine.load_lora_adapter(entry.name, directory)
                    log.info("LoRA adapter %r loaded from %s in %.3f s", entry.name, directory, seconds)
                else:
                    self.engine.register_lora_adapter(entry.name, directory)
                    log.info("LoRA adapter %r registered from %s (read on its first request)", entry.name,
                             directory)
            except AdapterError as e:
                changed |= self._refuse(entry.name, EntryError(e.file, e.field, e.why))
                continue
            except (ValueError, OSError) as e:
                changed |= self._refuse(entry.name, EntryError("", "name" if isinstance(e, ValueError) else "path",
                                                               str(e)))
                continue
            self.applied[entry.name] = (directory, entry.hot)
            self.errors.pop(entry.name, None)
            changed = True
        return changed

    def _refuse(self, name: str, error: EntryError) -> bool:
        if self.errors.get(name) == error:
            return False
        log.error("LoRA adapter %r refused: %s: %s: %s", name, error.file or "-", error.field, error.reason)
        self.errors[name] = error
        return True

    def _set_file_error(self, message: str | None) -> None:
        if message != self.file_error and message is not None:
            log.error("adapters file: %s (the last good one stays in force)", message)
        self.file_error = message

    async def run(self) -> None:
        """Follow the file until cancelled."""
        while True:
            try:
                if await asyncio.to_thread(self.sync) and self.on_change is not None:
                    self.on_change()
            except Exception:  # noqa: BLE001 - following the file must never stop the server
                log.exception("applying the adapters file failed")
            await asyncio.sleep(self.interval)
