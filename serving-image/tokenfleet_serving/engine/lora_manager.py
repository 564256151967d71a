"""The engine's LoRA adapters: which are servable, which are loaded, which are in use, and their tokens.

Bounds, by vLLM's names:

* ``max_loras``: distinct adapters among the running requests of a step (the scheduler holds back a request
  whose adapter would be one too many);
* ``max_lora_rank``: the largest ``r`` an adapter may have (refused at load above it);
* ``max_cpu_loras``: adapters kept loaded. A registered adapter that is not loaded is read again from its
  directory on its next request; the least recently used adapter that no request holds makes room.

Unloading an adapter that requests are using stops new requests for it at once; the adapter goes when the
last of them finishes, and then its prefix-cache blocks and its token counts are forgotten
(``BlockPool.forget_chains``; its per-adapter metrics go with the counts).

Reading an adapter's files (``read``) changes nothing here and takes no lock: the engine reads first and then
installs what it read under its lock (``install``, ``register_read``, ``acquire``), so a slow or large adapter
never holds up a step. Each request holds the adapter it was admitted with (``acquire``): a reload under the
same name serves new requests with the new files while the running ones finish with the old, and the two
versions' blocks chain from different roots (``LoRAAdapter.root_hash``).

An adapter's name follows the rule of ``--served-model-name`` (``serve_args.SERVED_MODEL_NAME``).
"""
from __future__ import annotations

import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig
from .lora_adapter import LoRAAdapter, load_adapter

# --served-model-name's rule (serve_args.SERVED_MODEL_NAME; the operator's CRD has the same): 1-128
# characters, no whitespace, not starting with '-'
_NAME = re.compile(r"[^\s-][^\s]{0,127}")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None     # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")

    @property
    def kept_loaded(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass
class AdapterTokens:
    prompt: int = 0
    generation: int = 0
    requests: int = 0


class UnknownAdapter(KeyError):
    """No adapter of that name is servable here."""


@dataclass
class LoRAManager:
    config: LoRAConfig
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    base_names: set[str] = field(default_factory=set)
    paths: dict[str, str] = field(default_factory=dict)              # registered: name -> directory
    loaded: OrderedDict[str, LoRAAdapter] = field(default_factory=OrderedDict)   # least recently used first
    in_use: Counter = field(default_factory=Counter)                 # name -> unfinished requests
    draining: set[str] = field(default_factory=set)                  # unload asked, requests still running
    tokens: dict[str, AdapterTokens] = field(default_factory=dict)
    load_seconds: dict[str, float] = field(default_factory=dict)     # time each adapter's last load took
    roots: dict[str, set[bytes]] = field(default_factory=dict)       # name -> roots of every version installed
    stale_roots: list[bytes] = field(default_factory=list)           # of adapters gone: their blocks to forget
    root_of: dict[str, bytes] = field(default_factory=dict)          # name -> root of the version new requests get

    def check_name(self, name: str) -> None:
        """ValueError unless ``name`` may name an adapter: the served-model-name rule, not the base model's
        name, not one being unloaded."""
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not name.isprintable():
            shown = repr(name) if len(str(name)) <= 140 else f"of {len(name)} characters"
            raise ValueError(f"adapter name {shown} is not a valid model name: 1-128 printable characters, no "
                             f"whitespace, not starting with '-'")
        if name in self.base_names:
            raise ValueError(f"adapter name {name!r} names the base model")
        if name in self.draining:
            raise ValueError(f"adapter {name!r} is being unloaded; load it again once its requests finish")

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check the adapter ``name`` in ``path`` (``AdapterError`` naming file and field, ValueError
        for the name); nothing here changes. Takes no lock: call it before taking the engine's."""
        self.check_name(name)
        started = time.perf_counter()
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device,
                               self.base_names)
        adapter.read_seconds = time.perf_counter() - started
        return adapter

    def install(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Serve ``adapter`` (from ``read``) under its name, kept in memory; it replaces any earlier one of that
        name for new requests."""
        self.check_name(adapter.name)
        name = adapter.name
        self.load_seconds[name] = adapter.read_seconds
        self.paths[name] = adapter.path
        self.loaded.pop(name, None)
        self._make_room()
        self.loaded[name] = adapter
        self.roots.setdefault(name, set()).add(adapter.root_hash)
        self.root_of[name] = adapter.root_hash
        self.tokens.setdefault(name, AdapterTokens())
        return adapter

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Register and load ``name`` from ``path`` (refused with ``AdapterError`` naming file and field)."""
        return self.install(self.read(name, path))

    def register_read(self, adapter: LoRAAdapter) -> None:
        """Make ``adapter``'s name servable from its directory without keeping it in memory (its files were
        read and checked by ``read``); its first request reads them again."""
        self.check_name(adapter.name)
        current = self.loaded.get(adapter.name)
        if current is not None and current.fingerprint != adapter.fingerprint:
            self.loaded.pop(adapter.name)        # other files: the copy in memory is stale
        self.paths[adapter.name] = adapter.path
        self.root_of[adapter.name] = adapter.root_hash
        self.tokens.setdefault(adapter.name, AdapterTokens())

    def register(self, name: str, path: str | Path) -> None:
        """``read`` then ``register_read``."""
        self.register_read(self.read(name, path))

    def _make_room(self) -> None:
        idle = [n for n in self.loaded if not self.in_use[n]]
        while len(self.loaded) >= self.config.kept_loaded and idle:
            del self.loaded[idle.pop(0)]

    def servable(self, name: str) -> bool:
        return name in self.paths and name not in self.draining

    def to_read(self, name: str) -> str | None:
        """The directory to ``read`` before ``acquire`` can take ``name`` (None: it is in memory)."""
        if not self.servable(name):
            raise UnknownAdapter(name)
        return None if name in self.loaded else self.paths[name]

    def acquire(self, name: str, read: LoRAAdapter | None = None) -> LoRAAdapter | None:
        """Take ``name`` for a new request: the adapter in memory, or ``read`` (its files, read beforehand from
        ``to_read``'s directory) installed. None when it is not in memory and ``read`` is missing or came from
        another directory: read it again (off the lock) and retry."""
        if not self.servable(name):
            raise UnknownAdapter(name)
        adapter = self.loaded.get(name)
        if adapter is None:
            if read is None or read.name != name or read.path != self.paths[name]:
                return None
            adapter = self.install(read)
        self.loaded.move_to_end(name)
        self.in_use[name] += 1
        return adapter

    def acquire_under(self, lock, name: str, read: LoRAAdapter | None) -> LoRAAdapter:
        """``acquire`` with ``lock`` (the engine's) held. When what was read beforehand went stale (the adapter
        was reloaded from elsewhere or let go meanwhile), it is read again with the lock released, a few times,
        so no adapter's files are read under the lock."""
        for _ in range(3):
            adapter = self.acquire(name, read)
            if adapter is not None:
                return adapter
            directory = self.to_read(name)
            lock.release()
            try:
                read = None if directory is None else self.read(name, directory)
            finally:
                lock.acquire()
        raise ValueError(f"LoRA adapter {name!r} kept changing while it was read; retry the request")

    def release(self, name: str, prompt_tokens: int) -> bool:
        """A request of ``name`` finished; True when that let a draining adapter go (its blocks are stale)."""
        self.in_use[name] -= 1
        t = self.tokens.setdefault(name, AdapterTokens())
        t.prompt += prompt_tokens
        t.requests += 1
        if self.in_use[name] <= 0:
            del self.in_use[name]
            if name in self.draining:
                self._drop(name)
                return True
        return False

    def unload(self, name: str) -> bool:
        """Stop serving ``name``. True: gone now; False: it goes when its running requests finish."""
        if not self.servable(name):
            raise UnknownAdapter(name)
        if self.in_use[name]:
            self.draining.add(name)
            return False
        self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        self.draining.discard(name)
        self.paths.pop(name, None)
        self.loaded.pop(name, None)
        self.tokens.pop(name, None)          # its metrics go with it
        self.load_seconds.pop(name, None)
        self.stale_roots += self.roots.pop(name, set())
        self.root_of.pop(name, None)

    def take_stale_roots(self) -> list[bytes]:
        """The roots whose blocks are stale since the last call (of adapters that went)."""
        roots, self.stale_roots = self.stale_roots, []
        return roots

    @property
    def names(self) -> list[str]:
        """Servable adapters, in the order they were registered."""
        return [n for n in self.paths if n not in self.draining]
