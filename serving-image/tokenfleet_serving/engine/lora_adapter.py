"""A LoRA adapter in PEFT's layout, read and checked against the served model.

A PEFT adapter directory holds ``adapter_config.json`` (``peft_type`` "LORA", ``r``, ``lora_alpha``,
``target_modules``, ``base_model_name_or_path``, ...) and ``adapter_model.safetensors`` with, per targeted
projection, ``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r].
A targeted projection computes ``y = x W^T + scaling * (x A^T) B^T``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``).

The engine fuses Q/K/V into one ``qkv`` matmul and gate/up into one ``gate_up``; an adapter's projections
are grouped the same way (``FusedLoRA``): one matmul by the adapter's A matrices of every targeted slice
side by side, then one by the slices' B matrices (scaling folded in) laid out block-diagonally, each
into its own columns of the fused output.

Everything that does not fit is refused at load with the file and field named (``AdapterError``): a config
that is not LoRA, a rank over ``--max-lora-rank``, a target module the engine does not have, features the
engine does not implement (DoRA, trained biases, ``modules_to_save``, per-module rank or alpha patterns), a
base model of another name or other shapes, a missing or corrupt file, a NaN or infinite ``lora_alpha`` or
weight (also one that the scaling or the serving dtype makes infinite).

The files come from whoever can write the adapter's directory, so their sizes are checked before anything
is read: ``adapter_config.json`` at most ``MAX_CONFIG_BYTES``, the safetensors header at most
``MAX_HEADER_BYTES``, and the whole weights file at most what an adapter of rank ``--max-lora-rank`` for
this model can hold (``max_weights_bytes``). A ``target_modules`` regular expression is matched in a child
process with a time bound (``lora_targets.py``). ``load_adapter`` holds no lock: the engine reads an
adapter before it takes its lock, and only installs it under the lock.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .block_pool import adapter_root_hash
from .config import ModelConfig
from .lora_targets import TargetPatternError, select_by_pattern

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# the engine's fused matmul each projection is a slice of, and the slice's position in it
FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
         "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: ``file`` and ``field`` say where the problem is."""

    def __init__(self, name: str, file: str, field_: str, why: str):
        super().__init__(f"LoRA adapter {name!r}: {file}: {field_}: {why}")
        self.adapter, self.file, self.field, self.why = name, file, field_, why


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target, for one whole (unsplit) model."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass
class FusedLoRA:
    """One adapter's share of one fused matmul of one layer: ``a`` [sum of ranks, in] (the targeted slices'
    A side by side) and ``b`` [out1 - out0, sum of ranks]: each slice's B (scaling folded in) in its own
    rows and rank columns, zeros elsewhere, covering the output columns [out0, out1) of the fused matmul."""
    a: torch.Tensor
    b: torch.Tensor
    out0: int
    out1: int

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """``y`` += this adapter's delta of ``x`` (rows of one adapter), in place."""
        y[:, self.out0:self.out1].addmm_(x @ self.a.T, self.b.T)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    fingerprint: str                       # sha256 of the config and weights files (hex)
    layers: list[dict[str, FusedLoRA]] = field(default_factory=list)   # per layer: fused name -> FusedLoRA
    weight_bytes: int = 0
    read_seconds: float = 0.0              # how long reading and checking its files took

    @property
    def root_hash(self) -> bytes:
        """What its requests' first blocks chain from: its name and its files' content (``block_pool.py``), so
        the KV of another adapter, or of an earlier version of this one, is never reused for it."""
        return adapter_root_hash(self.name, self.fingerprint)


def _read_config(name: str, directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(name, str(path), "(file)", "not found; a PEFT LoRA adapter directory has one")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(name, str(path), "(file)", f"{size} bytes; an adapter config may have at most "
                                                      f"{MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise AdapterError(name, str(path), "(file)", f"not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(name, str(path), "(file)", "not a JSON object")
    return cfg


def _check_config(name: str, cfg: dict, file: str, max_rank: int, base_names: set[str]) -> tuple[int, float, float]:
    def bad(field_: str, why: str) -> AdapterError:
        return AdapterError(name, file, field_, why)

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad("peft_type", f"{cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_rank:
        raise bad("r", f"rank {r} exceeds --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a finite number, got {alpha!r}")
    for flag, why in (("use_dora", "DoRA adapters are not supported"),
                      ("fan_in_fan_out", "only [out, in] (nn.Linear) weights are supported")):
        if cfg.get(flag):
            raise bad(flag, why)
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"{cfg.get('bias')!r}: trained biases are not supported (only 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise bad(key, "not supported (must be empty)")
    targets = cfg.get("target_modules")
    names = list(ATTENTION + MLP) if targets == "all-linear" else targets
    if isinstance(names, str):
        try:
            names = select_by_pattern(names, ATTENTION + MLP)
        except TargetPatternError as e:
            raise bad("target_modules", str(e)) from None
    if not isinstance(names, list) or not names or not all(isinstance(t, str) for t in names):
        raise bad("target_modules", f"must be a non-empty list of module names, got {targets!r}")
    names = [t.rsplit(".", 1)[-1] for t in names]     # PEFT matches a module by its name's last part
    unknown = sorted(set(names) - set(ATTENTION + MLP))
    if unknown:
        raise bad("target_modules", f"{unknown} are not projections this engine can adapt "
                                    f"(known: {', '.join(ATTENTION + MLP)})")
    base = cfg.get("base_model_name_or_path")
    if base and base_names and Path(str(base).rstrip("/")).name not in base_names:
        raise bad("base_model_name_or_path", f"{base!r} is not the served model ({', '.join(sorted(base_names))})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(alpha), scaling


def max_weights_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest weights file an adapter for a model of ``config`` can need: every projection of every
    layer adapted at rank ``max_rank`` in 8-byte values, plus the largest header."""
    per_layer = sum(max_rank * (out + inp) for out, inp in projection_shapes(config).values())
    return 8 + MAX_HEADER_BYTES + 8 * per_layer * config.num_layers


def _check_weights_size(name: str, path: Path, limit: int) -> None:
    """Refuse a weights file larger than ``limit`` or with a header over ``MAX_HEADER_BYTES`` before it is
    parsed (safetensors reads the whole header into memory)."""
    size = path.stat().st_size
    if size > limit:
        raise AdapterError(name, str(path), "(file)", f"{size} bytes; an adapter of this model with r <= "
                                                      f"--max-lora-rank holds at most {limit} bytes")
    with path.open("rb") as f:
        head = f.read(8)
    header = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < header <= MAX_HEADER_BYTES or header + 8 > size:
        raise AdapterError(name, str(path), "(file)", f"says its safetensors header has {header} bytes, in a file "
                                                      f"of {size}; a header may have at most {MAX_HEADER_BYTES} bytes")


def _read_weights(name: str, directory: Path, limit: int) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(name, str(path), "(file)", "not found (adapter_model.bin is not read: convert it to "
                                                      "safetensors)")
    _check_weights_size(name, path, limit)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(name, str(path), "(file)", f"not a readable safetensors file ({exc})") from exc
    for key, t in tensors.items():
        if not (t.is_floating_point() and bool(torch.isfinite(t).all())):
            raise AdapterError(name, str(path), key, "holds NaN or infinite values" if t.is_floating_point()
                               else f"dtype {t.dtype} is not a floating-point type")
    return tensors, str(path)


def fingerprint(directory: Path, limit: int | None = None) -> str:
    """sha256 of the config and weights files (each read up to ``limit`` bytes: the size checks passed)."""
    h = hashlib.sha256()
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        left = limit if limit is not None else 1 << 62
        with open(directory / f, "rb") as fh:
            while left > 0:
                block = fh.read(min(1 << 20, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
    return h.hexdigest()


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor], file: str, config: ModelConfig, rank: int
                  ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, projection) -> {"A": lora_A, "B": lora_B}, every key, layer and shape checked."""
    shapes = projection_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(name, file, key, "not a LoRA A/B weight of a decoder layer's projection")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if module not in shapes:
            raise AdapterError(name, file, key, f"{module!r} is not a projection this engine can adapt")
        if layer >= config.num_layers:
            raise AdapterError(name, file, key, f"layer {layer} does not exist: the base model has "
                                                f"{config.num_layers} layers")
        out, inp = shapes[module]
        want = (rank, inp) if ab == "A" else (out, rank)
        if tuple(t.shape) != want:
            raise AdapterError(name, file, key, f"shape {list(t.shape)} does not match the base model "
                                                f"and r={rank}: expected {list(want)}")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise AdapterError(name, file, "(tensors)", "no lora_A/lora_B weights")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(name, file, f"layers.{layer}.{module}.lora_{missing}.weight", "missing")
    return pairs


def _fuse_layer(adapter: LoRAAdapter, layer: int, pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
                shapes: dict[str, tuple[int, int]], scaling: float, dtype: torch.dtype, device: torch.device,
                file: str) -> dict[str, FusedLoRA]:
    """One layer's fused matmuls of the adapter; ``AdapterError`` if the scaling or ``dtype`` makes a weight
    infinite."""
    offsets = {"qkv": [0, shapes["q_proj"][0], shapes["q_proj"][0] + shapes["k_proj"][0]],
               "o": [0], "gate_up": [0, shapes["gate_proj"][0]], "down": [0]}
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for module in adapter.target_modules:
        ab = pairs.get((layer, module))
        if ab is not None:
            group, index = FUSED[module]
            parts.setdefault(group, []).append((offsets[group][index], ab["A"], ab["B"].float() * scaling))
    fused: dict[str, FusedLoRA] = {}
    for group, slices in parts.items():
        out0 = min(o for o, _, _ in slices)
        out1 = max(o + b.shape[0] for o, _, b in slices)
        b_full = torch.zeros(out1 - out0, adapter.rank * len(slices))
        for i, (o, _, b) in enumerate(slices):
            b_full[o - out0:o - out0 + b.shape[0], i * adapter.rank:(i + 1) * adapter.rank] = b
        a_full = torch.cat([a for _, a, _ in slices])
        fused[group] = FusedLoRA(a_full.to(device=device, dtype=dtype).contiguous(),
                                 b_full.to(device=device, dtype=dtype).contiguous(), out0, out1)
        if not (bool(torch.isfinite(fused[group].a).all()) and bool(torch.isfinite(fused[group].b).all())):
            raise AdapterError(adapter.name, file, f"layers.{layer}.{group}",
                               f"lora_alpha / r = {scaling:g} times the weights, in {dtype}, is not finite")
    return fused


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device, base_names: set[str] = frozenset()) -> LoRAAdapter:  # type: ignore[assignment]
    """Read, check and fuse the adapter in ``path`` for a model of ``config`` (weights in ``dtype`` on
    ``device``). ``base_names``: names the served base model goes by (empty: the name is not checked).
    Holds no lock and changes nothing outside the adapter it returns."""
    directory = Path(path)
    cfg = _read_config(name, directory)
    cfg_file = str(directory / CONFIG_FILE)
    rank, alpha, scaling = _check_config(name, cfg, cfg_file, max_rank, set(base_names))
    tensors, weights_file = _read_weights(name, directory, max_weights_bytes(config, max_rank))
    pairs = _pair_tensors(name, tensors, weights_file, config, rank)
    targets = tuple(sorted({mod for _, mod in pairs}, key=list(FUSED).index))
    listed = ({t.rsplit(".", 1)[-1] for t in cfg["target_modules"]} if isinstance(cfg.get("target_modules"), list)
              else None)
    if listed is not None and not set(targets) <= set(listed):
        raise AdapterError(name, cfg_file, "target_modules", f"the weights adapt {sorted(set(targets) - set(listed))}"
                                                             f", which target_modules does not list")
    adapter = LoRAAdapter(name, str(directory), rank, alpha, targets,
                          fingerprint(directory, max_weights_bytes(config, max_rank)))
    shapes = projection_shapes(config)
    adapter.layers = [_fuse_layer(adapter, layer, pairs, shapes, scaling, dtype, device, weights_file)
                      for layer in range(config.num_layers)]
    adapter.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return adapter
