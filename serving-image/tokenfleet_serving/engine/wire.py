"""The encoding of what the ranks of a tensor-parallel replica send each other: data only, never code.

A message is a tree of None, bool, int, float, str, lists, tuples, dicts with str keys, torch dtypes, CPU
tensors, numpy arrays of plain numbers, and the dataclasses registered with ``wire_type`` (a step's batch,
``RankSetup``). It travels as a JSON header that describes the tree, followed by the raw bytes of its arrays::

    u32 header length | header (JSON) | padding to 16 | array bytes, each at a multiple of 16

Decoding builds only those types: a class is looked up in the registry by name, a dtype in a fixed table,
and every array's bytes are checked to lie inside the frame, so a frame can carry wrong numbers but never
make the receiver run anything (unlike pickle, whose frames name any callable to call). A frame that breaks
these rules is ``WireError``.

Speed: a 64-sequence decode batch encodes in about 0.06 ms and decodes in about 0.05 ms (the numpy-backed
pickle this replaced: 0.04 and 0.02 ms, measured together on the development host); the batch is on the
critical path of every step on both sides.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, TypeVar

import numpy as np
import torch

ALIGN = 16
_HEAD = struct.Struct("<I")

_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.int64, torch.bool)}
_NUMPY_DTYPES = {np.dtype(d).str: np.dtype(d) for d in (
    np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
    np.uint64, np.bool_)}
_TYPES: dict[str, type] = {}
_SCALARS = (type(None), bool, int, float, str)

T = TypeVar("T", bound=type)


class WireError(ValueError):
    """A frame this encoding does not describe: an unknown tag, class or dtype, or an array outside the frame."""


def wire_type(cls: T) -> T:
    """Register a dataclass as one a message may carry (its init fields go by name)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    _TYPES[cls.__name__] = cls
    return cls


class _Encoder:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def _array(self, flat: np.ndarray) -> int:
        self.size += -self.size % ALIGN
        at = self.size
        self.arrays.append(flat)
        self.size += flat.nbytes
        return at

    def tree(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _SCALARS:
            return obj
        if kind is list:
            return [self.tree(x) for x in obj]
        if kind is tuple:
            return {"T": [self.tree(x) for x in obj]}
        if kind is torch.Tensor:
            return self._tensor(obj)
        if kind is np.ndarray:
            dtype = obj.dtype.str
            if dtype not in _NUMPY_DTYPES:
                raise TypeError(f"a numpy array of dtype {obj.dtype} cannot be sent to the other ranks")
            flat = np.ascontiguousarray(obj).reshape(-1)
            return {"N": [dtype, list(obj.shape), self._array(flat.view(np.uint8))]}
        if kind is dict:
            if not all(type(k) is str for k in obj):
                raise TypeError("a dict sent to the other ranks must have str keys")
            return {"M": list(obj), "v": [self.tree(v) for v in obj.values()]}
        if isinstance(obj, torch.dtype):
            return {"d": str(obj).removeprefix("torch.")}
        if kind in (np.int64, np.int32, np.float32, np.float64, np.bool_):
            return obj.item()
        name = kind.__name__
        if _TYPES.get(name) is not kind:
            raise TypeError(f"{name} is not a type the ranks send each other (engine/wire.py: wire_type)")
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return {"D": name, "k": fields, "v": [self.tree(getattr(obj, f)) for f in fields]}

    def _tensor(self, t: torch.Tensor) -> Any:
        if t.device.type != "cpu":
            raise TypeError("tensors sent to the other ranks must be on the CPU")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _TORCH_DTYPES:
            raise TypeError(f"a tensor of dtype {t.dtype} cannot be sent to the other ranks")
        flat = t.detach().reshape(-1)
        if flat.stride(0) != 1:          # an expanded tensor (one element seen many times), or an empty one
            flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
        return {"A": [dtype, list(t.shape), self._array(flat.view(torch.uint8).numpy())]}

    def frame(self, tree: Any) -> bytearray:
        header = json.dumps(tree, separators=(",", ":")).encode()
        start = _HEAD.size + len(header)
        pad = -start % ALIGN
        out = bytearray(start + pad + self.size)
        _HEAD.pack_into(out, 0, len(header))
        out[_HEAD.size:start] = header
        base = start + pad
        view = memoryview(out)
        at = 0
        for a in self.arrays:
            at += -at % ALIGN
            view[base + at:base + at + a.nbytes] = a.data.cast("B")
            at += a.nbytes
        return out                                  # a bytearray: the receiver's views need no copy


def encode(message: Any) -> bytearray:
    """``message`` as a frame; TypeError naming what it holds that the other ranks may not receive."""
    encoder = _Encoder()
    tree = encoder.tree(message)
    return encoder.frame(tree)


class _Decoder:
    def __init__(self, frame: bytes | bytearray):
        if len(frame) < _HEAD.size:
            raise WireError(f"a frame of {len(frame)} bytes is shorter than its header")
        (length,) = _HEAD.unpack_from(frame, 0)
        start = _HEAD.size + length
        if start > len(frame):
            raise WireError(f"a header of {length} bytes does not fit a frame of {len(frame)}")
        try:
            self.header = json.loads(bytes(frame[_HEAD.size:start]))
        except (ValueError, RecursionError) as e:
            raise WireError(f"the frame's header is not JSON: {e}") from e
        self.buf = frame if isinstance(frame, bytearray) else bytearray(frame)
        self.base = start + (-start % ALIGN)

    def _bytes_at(self, shape: Any, offset: Any, itemsize: int) -> tuple[tuple[int, ...], int, int]:
        if (type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) or type(offset) is not int
                or offset < 0):
            raise WireError("an array with a malformed shape or offset")
        count = 1
        for n in shape:
            count *= n
        at = self.base + offset
        if at + count * itemsize > len(self.buf):
            raise WireError(f"an array of {count * itemsize} bytes at {offset} lies outside the frame")
        return tuple(shape), count, at

    def tree(self, node: Any) -> Any:
        kind = type(node)
        if kind in _SCALARS:
            return node
        if kind is list:
            return [self.tree(x) for x in node]
        if kind is not dict or len(node) not in (1, 2, 3):
            raise WireError(f"an unknown node in the frame: {str(node)[:80]}")
        if "T" in node:
            return tuple(self.tree(x) for x in node["T"])
        if "A" in node:
            dtype, shape, offset = node["A"]
            torch_dtype = _TORCH_DTYPES.get(dtype) if type(dtype) is str else None
            if torch_dtype is None:
                raise WireError(f"a tensor of an unknown dtype {str(dtype)[:40]}")
            size, count, at = self._bytes_at(shape, offset, torch.empty(0, dtype=torch_dtype).element_size())
            if count == 0:
                return torch.empty(size, dtype=torch_dtype)
            return torch.frombuffer(self.buf, dtype=torch_dtype, count=count, offset=at).reshape(size)
        if "N" in node:
            dtype, shape, offset = node["N"]
            np_dtype = _NUMPY_DTYPES.get(dtype) if type(dtype) is str else None
            if np_dtype is None:
                raise WireError(f"a numpy array of an unknown dtype {str(dtype)[:40]}")
            size, count, at = self._bytes_at(shape, offset, np_dtype.itemsize)
            return np.frombuffer(self.buf, dtype=np_dtype, count=count, offset=at).reshape(size)
        if "d" in node:
            found = _TORCH_DTYPES.get(node["d"]) if type(node["d"]) is str else None
            if found is None:
                raise WireError(f"an unknown dtype {str(node['d'])[:40]}")
            return found
        if "M" in node:
            keys, values = node["M"], node.get("v")
            if type(keys) is not list or type(values) is not list or len(keys) != len(values) or \
                    not all(type(k) is str for k in keys):
                raise WireError("a malformed dict in the frame")
            return {k: self.tree(v) for k, v in zip(keys, values)}
        if "D" in node:
            return self._dataclass(node)
        raise WireError(f"an unknown node in the frame: {str(node)[:80]}")

    def _dataclass(self, node: dict) -> Any:
        cls = _TYPES.get(node["D"]) if type(node["D"]) is str else None
        if cls is None:
            raise WireError(f"an unknown type {str(node['D'])[:40]} in the frame")
        names, values = node.get("k"), node.get("v")
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        if type(names) is not list or type(values) is not list or len(names) != len(values) or \
                not all(type(n) is str and n in allowed for n in names):
            raise WireError(f"malformed fields of {cls.__name__} in the frame")
        try:
            return cls(**{n: self.tree(v) for n, v in zip(names, values)})
        except TypeError as e:
            raise WireError(f"{cls.__name__}: {e}") from e


def decode(frame: bytes | bytearray) -> Any:
    """The message a frame carries (its arrays are views of ``frame``, copied once into a bytearray when it is
    bytes); WireError when the frame is not one ``encode`` makes."""
    decoder = _Decoder(frame)
    return decoder.tree(decoder.header)
