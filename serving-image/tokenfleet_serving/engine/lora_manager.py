"""The engine's LoRA adapters: which are servable, which are loaded, which are in use, and their tokens.

Bounds, by vLLM's names:

* ``max_loras``: distinct adapters among the running requests of a step (the scheduler holds back a request
  whose adapter would be one too many);
* ``max_lora_rank``: the largest ``r`` an adapter may have (refused at load above it);
* ``max_cpu_loras``: adapters kept loaded. A registered adapter that is not loaded is read again from its
  directory on its next request; the least recently used adapter that no request holds makes room.

Unloading an adapter that requests are using stops new requests for it at once; the adapter goes when the
last of them finishes, and then its prefix-cache blocks are forgotten (``BlockPool.forget_chains``).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig
from .lora_adapter import LoRAAdapter, load_adapter


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

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Register and load ``name`` from ``path`` (refused with ``AdapterError`` naming file and field)."""
        import time

        if not name or name in self.base_names:
            raise ValueError(f"adapter name {name!r} is empty or names the base model")
        if name in self.draining:
            raise ValueError(f"adapter {name!r} is being unloaded; load it again once its requests finish")
        started = time.perf_counter()
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device,
                               self.base_names)
        self.load_seconds[name] = time.perf_counter() - started
        self.paths[name] = str(path)
        self.loaded.pop(name, None)
        self._make_room()
        self.loaded[name] = adapter
        self.tokens.setdefault(name, AdapterTokens())
        return adapter

    def register(self, name: str, path: str | Path) -> None:
        """Make ``name`` servable from ``path`` without keeping it in memory: its files are read and checked
        now (``AdapterError`` naming file and field), then let go; its first request reads them again."""
        if not name or name in self.base_names:
            raise ValueError(f"adapter name {name!r} is empty or names the base model")
        if name in self.draining:
            raise ValueError(f"adapter {name!r} is being unloaded; load it again once its requests finish")
        load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device,
                     self.base_names)
        if self.paths.get(name) != str(path) and not self.in_use[name]:
            self.loaded.pop(name, None)          # a new directory: the copy in memory is stale
        self.paths[name] = str(path)
        self.tokens.setdefault(name, AdapterTokens())

    def _make_room(self) -> None:
        idle = [n for n in self.loaded if not self.in_use[n]]
        while len(self.loaded) >= self.config.kept_loaded and idle:
            del self.loaded[idle.pop(0)]

    def servable(self, name: str) -> bool:
        return name in self.paths and name not in self.draining

    def get(self, name: str) -> LoRAAdapter:
        """The loaded adapter ``name``, read again from its directory if it was let go."""
        if not self.servable(name):
            raise UnknownAdapter(name)
        adapter = self.loaded.get(name)
        if adapter is None:
            return self.load(name, self.paths[name])
        self.loaded.move_to_end(name)
        return adapter

    def held(self, name: str) -> LoRAAdapter:
        """The adapter of a request that holds it (``acquire``), draining or not."""
        adapter = self.loaded.get(name)
        if adapter is None:                  # not let go while held, but a reload may have replaced it
            return self.load(name, self.paths[name])
        self.loaded.move_to_end(name)
        return adapter

    def acquire(self, name: str) -> LoRAAdapter:
        adapter = self.get(name)
        self.in_use[name] += 1
        return adapter

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

    @property
    def names(self) -> list[str]:
        """Servable adapters, in the order they were registered."""
        return [n for n in self.paths if n not in self.draining]
