"""What a prefix-cache block was made by: the identity a disk-tier block file carries (``kv_offload.py``) and
the ranks of a tensor-parallel replica compare (``distributed.py``).

The identity is the sha256 of the model's ``config.json``, the model's revision (given, or a fingerprint of
the weight files), the dtype, the KV cache's dtype (``auto`` or ``int8``), the block size, the per-block KV
shape, and the format and hash scheme of the blocks. A block made under another identity is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import LLMEngine

VERSION = 1
HASH_SCHEME = "sha256-chain-uint32le"
_SAMPLES, _SAMPLE_BYTES = 16, 64 * 1024


def config_sha256(model_dir: str | Path) -> str:
    """sha256 of config.json with its keys sorted, so formatting does not matter."""
    data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of the weights: every safetensors file's name, size and header, plus 16 samples of
    64 KiB spread over its data. Two trainings of one architecture differ in every sample; a file that was
    not rewritten reads the same (about 1 MiB per file is read)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(head + f.read(min(header_len, 100 * 2**20)))
            start = 8 + header_len
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                f.seek(start + span * i // max(_SAMPLES - 1, 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def engine_identity(engine: LLMEngine, revision: str | None = None) -> dict[str, Any]:
    """What a block of ``engine``'s cache must have been made under to be loaded by it."""
    model_dir = engine.config.model
    pool = engine.runner.kv_pool
    return {
        "kv_cache_dtype": engine.runner.kv_cache_dtype,
        "format": VERSION,
        "hash_scheme": HASH_SCHEME,
        "model_config_sha256": config_sha256(model_dir),
        "revision": revision or f"weights:{weights_fingerprint(model_dir)}",
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "block_size": engine.kv.block_size,
        "kv_block_shape": [pool.shape[0], pool.shape[1], pool.shape[2], pool.shape[4], pool.shape[5]],
    }
