"""Prefix-block hashes of a prompt, as hex strings.

The hash is the engine's own (``engine/block_pool.py``, spec in
docs/engine.md): each full block's sha256 chained with its parent's. The
serving server's ``/cache/blocks`` returns the same digests in hex.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenfleet_serving.engine.block_pool import adapter_root_hash, hash_prefix_blocks

HASH_SCHEME = "sha256-chain-uint32le"


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 adapter: str | None = None, root: bytes | None = None) -> tuple[str, ...]:
    """Hex hashes of the full blocks of ``token_ids`` (at most ``max_blocks`` of them), chained from ``root``
    (the LoRA adapter's root its replicas report), else from the root of the ``adapter`` name."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks is not None:
        token_ids = token_ids[:max_blocks * block_size]
    parent = root if root is not None and adapter else adapter_root_hash(adapter)
    return tuple(h.hex() for h in hash_prefix_blocks(token_ids, block_size, parent=parent))
