"""What the router needs to know about the engine its replicas run (``tokenfleet route --backend-runtime``).

The router speaks to every replica through the OpenAI API and reads its load from vLLM's metric names, which
the bundled engine exports too. The runtimes differ in three places, each named here:

- which prompt blocks a replica caches: the bundled engine says so on ``/cache/blocks``; for vLLM the router
  keeps its own record of the blocks it sent there (``RoutedBlocks``), an LRU as large as the replica's KV cache
  (``num_gpu_blocks`` of ``vllm:cache_config_info``);
- readiness: ``tokenfleet:ready`` and the pod's condition; for vLLM the pod's condition, and a replica that
  answers ``/metrics`` with vLLM's metrics has loaded its model (its HTTP server starts after the engine);
- stream migration: ``continuation`` in the original request (``engine/continuation.py``); for vLLM a
  ``/v1/completions`` request whose prompt is the prompt's token ids plus the delivered ones
  (``migration.vllm_continuation``); a stream vLLM cannot continue that way fails cleanly.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

TOKENFLEET = "tokenfleet"
VLLM = "vllm"
RUNTIMES = (TOKENFLEET, VLLM)

# the router's record of a vLLM replica's cache, when the replica does not say how large its cache is
DEFAULT_RECORDED_BLOCKS = 4096


@dataclass(frozen=True)
class BackendRuntime:
    name: str
    polls_cache_blocks: bool      # GET /cache/blocks for the cached block hashes
    records_routed_blocks: bool   # the router's own record of routed blocks stands in for the cache
    metrics_mean_ready: bool      # a replica that answers /metrics with its engine's metrics has its model loaded


RUNTIME = {
    TOKENFLEET: BackendRuntime(TOKENFLEET, polls_cache_blocks=True, records_routed_blocks=False,
                               metrics_mean_ready=False),
    VLLM: BackendRuntime(VLLM, polls_cache_blocks=False, records_routed_blocks=True, metrics_mean_ready=True),
}


class RoutedBlocks:
    """The block hashes the router sent to one backend, most recently used last, at most ``capacity``: an
    approximation of an LRU prefix cache of that many blocks that only this router fills (as the Gateway API
    Inference Extension's approximate prefix scorer keeps one)."""

    def __init__(self, capacity: int = DEFAULT_RECORDED_BLOCKS):
        self.capacity = max(1, capacity)
        self.blocks: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
        self.trim()

    def discard(self, h: str) -> None:
        self.blocks.pop(h, None)

    def clear(self) -> None:
        self.blocks.clear()

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.trim()

    def trim(self) -> None:
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def __contains__(self, h: object) -> bool:
        return h in self.blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)
