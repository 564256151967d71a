"""safetensors files as memory maps: every tensor a view of the file's pages, with no copy of its own.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and the
tensors' bytes. The file is mapped private (copy on write) with ``torch.UntypedStorage.from_file``, and each
tensor is a view of its byte range: reading the weights costs page faults served from the OS page cache
(or the disk), and the model's own packing reads them once. ``safe_open(...).get_tensor`` instead copies
every tensor into new memory first, which the model then copies again when it fuses and packs it.

A tensor whose byte range is not aligned to its element size (possible when dtypes are mixed) is copied.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 * 2**20


class SafetensorsError(ValueError):
    """The file is not a safetensors file this reader understands; the message says where."""


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the tensor data, header) of a safetensors file."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError("shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise SafetensorsError(f"header length {length} is beyond {MAX_HEADER}")
        raw = f.read(length)
    if len(raw) != length:
        raise SafetensorsError("truncated header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SafetensorsError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    return 8 + length, header


def mapped_tensors(path: str | Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one file (those in ``names``, or all) as views of the private memory map of the file."""
    path = Path(path)
    start, header = read_header(path)
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"tensor '{name}': bad header entry ({exc})") from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        if begin < 0 or end != begin + count * itemsize or start + end > size:
            raise SafetensorsError(f"tensor '{name}': byte range [{begin}, {end}) does not fit its shape "
                                   f"{shape} or the file")
        raw = whole[start + begin:start + end]
        if (start + begin) % itemsize:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return out
