"""Prefix-block hashes of a prompt, computed exactly as the engine computes them.

The engine's spec (docs/engine.md, ``engine/block_pool.py``)::

    ROOT      = 32 zero bytes
    hash(b_i) = sha256(hash(b_{i-1}) or ROOT || uint32_le(t_{iB}) || ... || uint32_le(t_{iB+B-1}))

Only full blocks are hashed; digests are compared as lowercase hex, the form
the serving server's ``/cache/blocks`` returns. This is a separate, torch-free
implementation (importing ``tokenfleet_serving.engine`` pulls in torch); the
tests check it against the engine's own function.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = bytes(32)
HASH_SCHEME = "sha256-chain-uint32le"


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> tuple[str, ...]:
    """Hex hashes of the full blocks of ``token_ids`` (at most ``max_blocks`` of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    out = []
    parent = ROOT
    for i in range(count):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest()
        out.append(parent.hex())
    return tuple(out)
