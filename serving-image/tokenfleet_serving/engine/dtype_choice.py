"""``dtype: auto``: the fastest correct dtype on the host at hand, measured rather than guessed.

A CPU flag says what a host *can* do, not which path is faster there: on an AVX-512 EPYC with native bf16
units, the engine's fp32 path (compiled C kernels) still beats its bf16 path (plain PyTorch), while on
other hosts and models it may not. So on a CPU ``auto`` runs a probe:

* candidates: float32 and bfloat16, on every CPU (float16 is no candidate: its range overflows on
  checkpoints trained in bf16, so it is correct only when a user asks for it);
* each candidate builds a two-layer model with the checkpoint's own shapes (hidden size, heads, MLP width,
  vocabulary; random weights, since speed does not depend on their values) and runs a small W1-like step
  sequence: a prefill of ``PROBE_SEQS`` x ``PROBE_PROMPT`` tokens, then ``PROBE_DECODES`` decode steps;
* the candidates alternate for ``PROBE_ROUNDS`` rounds, each keeps its best time, and the one with the most
  tokens per second wins; a candidate whose logits are not finite is not correct and never wins.

The result is cached on disk (next to the compiled kernels), keyed by everything it depends on: the CPU
model and the flags the engine sees, ``TOKENFLEET_CPU_ISA``, torch's version and thread count, whether the
C kernels are on, and the probe model's shapes. A restart of the same server on the same host skips the
probe. On CUDA ``auto`` is bfloat16 where the GPU supports it, else float16.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cpu_features, cpu_kernels
from .batch import SeqChunk, build_batch
from .config import ModelConfig

log = logging.getLogger("tokenfleet.engine")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

PROBE_LAYERS = 2
PROBE_SEQS, PROBE_PROMPT, PROBE_DECODES, PROBE_ROUNDS = 16, 32, 16, 3
PROBE_BLOCK = 16


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    how: str                                          # "requested", "cuda", "measured" or "cached"
    probe_tokens_per_second: dict[str, float] = field(default_factory=dict)   # dtype name -> probe speed

    @property
    def name(self) -> str:
        return NAMES[self.dtype]


def parse_dtype(requested: str) -> torch.dtype | None:
    """None for 'auto'; raises ValueError for a name that is no dtype."""
    if requested == "auto":
        return None
    if requested not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
    return DTYPES[requested]


def cpu_candidates() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16]


def choose_dtype(requested: str, device: torch.device, config: ModelConfig | None = None,
                 use_kernels: bool = True, quantization: str = "none") -> DtypeChoice:
    """The dtype to compute in; with ``quantization`` 'int8' the probe models hold int8 weights, so the
    choice is between computing in fp32 (the kernels' int8 GEMM) and bf16 (torch's int8 paths)."""
    fixed = parse_dtype(requested)
    if fixed is not None:
        return DtypeChoice(fixed, "requested")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16, "cuda")
    if config is None:
        raise ValueError("dtype 'auto' on a CPU needs the model's config to measure the candidates")
    candidates = cpu_candidates()
    key = _cache_key(config, candidates, use_kernels, quantization)
    cached = _read_cache(key)
    if cached is not None:
        return cached
    speeds = measure(config, candidates, use_kernels, quantization)
    best = max(speeds, key=lambda name: speeds[name])
    choice = DtypeChoice(DTYPES[best], "measured", speeds)
    log.info("dtype auto: %s (probe tokens/s: %s)", choice.name,
             ", ".join(f"{name} {speed:.0f}" for name, speed in speeds.items()))
    _write_cache(key, choice)
    return choice


# ---- the probe -------------------------------------------------------------------
def probe_config(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, num_layers=min(config.num_layers, PROBE_LAYERS))


def probe_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights with the checkpoint's shapes (norms at one, as trained models keep them near)."""
    from .loader import expected_tensors

    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.ones(shape) if len(shape) == 1 and name.endswith("norm.weight")
                   else torch.randn(shape, generator=gen) * 0.02)
            for name, shape in expected_tensors(config).items()}


def _run_probe(model, vocab: int, seed: int) -> tuple[float, bool]:
    """Seconds for one prefill of PROBE_SEQS x PROBE_PROMPT tokens and PROBE_DECODES decode steps; and whether
    every logit was finite."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(PROBE_PROMPT + PROBE_DECODES) // PROBE_BLOCK)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(PROBE_SEQS)]
    prompts = torch.randint(0, vocab, (PROBE_SEQS, PROBE_PROMPT), generator=gen).tolist()
    finite = True
    started = time.perf_counter()
    chunks = [SeqChunk(prompts[s], 0, tables[s], True) for s in range(PROBE_SEQS)]
    logits = model.forward(build_batch(chunks, PROBE_BLOCK, model.device, model.compiled_prefill))
    for step in range(PROBE_DECODES):
        finite = finite and bool(torch.isfinite(logits).all())
        tokens = logits.argmax(dim=-1).tolist()
        chunks = [SeqChunk([tokens[s]], PROBE_PROMPT + step, tables[s], True) for s in range(PROBE_SEQS)]
        logits = model.forward(build_batch(chunks, PROBE_BLOCK, model.device, model.compiled_prefill))
    finite = finite and bool(torch.isfinite(logits).all())
    return time.perf_counter() - started, finite


def measure(config: ModelConfig, candidates: list[torch.dtype], use_kernels: bool = True,
            quantization: str = "none") -> dict[str, float]:
    """Probe tokens per second of each candidate (0 for one whose logits were not finite)."""
    from .model_runner import ModelRunner

    small = probe_config(config)
    weights = probe_weights(small)
    max_len = min(small.max_model_len, PROBE_PROMPT + PROBE_DECODES + PROBE_BLOCK)
    models = {}
    for dtype in candidates:
        model = ModelRunner(small, weights, dtype, torch.device("cpu"), max_len, use_kernels=use_kernels,
                           quantization=quantization)
        model.allocate_kv_cache(PROBE_SEQS * -(-(PROBE_PROMPT + PROBE_DECODES) // PROBE_BLOCK), PROBE_BLOCK)
        _run_probe(model, small.vocab_size, seed=1)                 # warm-up: kernels, oneDNN primitives
        models[NAMES[dtype]] = model
    best = dict.fromkeys(models, float("inf"))
    correct = dict.fromkeys(models, True)
    for round_ in range(PROBE_ROUNDS):                              # alternate, so both see the same moments
        for name, model in models.items():
            seconds, finite = _run_probe(model, small.vocab_size, seed=2 + round_)
            best[name] = min(best[name], seconds)
            correct[name] = correct[name] and finite
    tokens = PROBE_SEQS * (PROBE_DECODES + 1)
    return {name: (tokens / best[name] if correct[name] else 0.0) for name in models}


# ---- the cache ---------------------------------------------------------------------
def _cache_key(config: ModelConfig, candidates: list[torch.dtype], use_kernels: bool, quantization: str = "none") -> str:
    small = probe_config(config)
    shape = {f.name: getattr(small, f.name) for f in dataclasses.fields(small)
             if f.name not in ("eos_token_ids", "bos_token_id", "torch_dtype", "max_position_embeddings")}
    parts = {
        "cpu": cpu_features.cpu_model(), "flags": sorted(cpu_features.cpu_flags()), "cap": cpu_features.isa_cap(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "candidates": [NAMES[d] for d in candidates],
        "kernels": cpu_kernels.library_path().name if use_kernels else None, "shape": shape,
        "probe": [PROBE_LAYERS, PROBE_SEQS, PROBE_PROMPT, PROBE_DECODES, PROBE_ROUNDS],
    }
    if quantization != "none":            # (absent otherwise, so the choices cached before int8 stay valid)
        parts["quantization"] = quantization
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cache_file() -> Path:
    return cpu_kernels.cache_dir().parent / "dtype-choice.json"


def _read_cache(key: str) -> DtypeChoice | None:
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
        if entry is None or entry["dtype"] not in DTYPES:
            return None
        return DtypeChoice(DTYPES[entry["dtype"]], "cached", dict(entry["probe_tokens_per_second"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(key: str, choice: DtypeChoice) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        entries[key] = {"dtype": choice.name, "probe_tokens_per_second": choice.probe_tokens_per_second}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".dtype-choice-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:       # a read-only image: probe again next time
        log.debug("could not cache the dtype choice in %s: %s", path, e)
