"""``tokenfleet serve``'s flags as one typed configuration, :class:`ServeArgs` (as vLLM's ``engine/arg_utils.py``).

Each field is one flag: its name with ``-`` for ``_`` (``max_num_seqs`` is ``--max-num-seqs``), its default,
and its check. The argument parser is built from the fields, so a flag cannot drift from its field.

This module imports no torch and writes nothing: the server parses its command line with it, and the operator
checks a pod's command line with it (``argument_error``) before the pod runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_serving.contract.levers import MAX_SPECULATIVE_TOKENS, QuantizationError, parse_kv_cache_dtype, parse_quantization
from tokenfleet_serving.contract.termination import ArgumentParser
from tokenfleet_serving.openai.tool_parsers import TOOL_PARSERS

# What `--served-model-name` accepts: 1-128 characters, no whitespace, not starting with '-' (so a
# name can never be taken for a flag). The operator's CRD validates servedModelNames with the same rule.
SERVED_MODEL_NAME = re.compile(r"[^\s-][^\s]{0,127}")

PROG = "tokenfleet serve"
WARM_RESTART = "warm restart (prefix-cache checkpoints; docs/recovery.md)"
LORA = "LoRA adapters (vLLM's flags; docs/engine.md)"
KV_OFFLOAD = "KV offload (host-memory and disk tiers of the prefix cache; docs/engine.md)"
PARALLEL = "parallelism (one replica over several accelerators or hosts; docs/engine.md)"


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1 (also used by ``tokenfleet bench engine``)."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


# The longest wait or interval any flag takes: a day. The server waits on threads and sockets with these, and
# the platform refuses a timeout past ~292 years (OverflowError at the first wait, a 500 for every request that
# waits); no deployment needs more than a day.
MAX_SECONDS = 86400.0


def _seconds(text: str) -> float:
    """argparse type: a duration in seconds, > 0 and at most MAX_SECONDS."""
    v = float(text)
    if not 0 < v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be seconds in (0, {MAX_SECONDS:g}], got {text}")
    return v


# The largest memory a flag may size: 1 PiB, more than any host or accelerator holds. A larger size could only
# fail at start (or overflow the allocation's arithmetic); the operator checks sizes against the memory it
# knows (kv_budget.py) below this.
MAX_BYTES = 1 << 50
MAX_THREADS = 4096
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def _bounded_int(low: int, high: int, unit: str = ""):
    """argparse type: an int in [low, high]."""
    def parse(text: str) -> int:
        v = int(text)
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}]{unit}, got {v}")
        return v
    return parse


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


def _device(text: str) -> str:
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _non_negative_seconds(text: str) -> float:
    v = float(text)
    if not 0 <= v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be seconds in [0, {MAX_SECONDS:g}], got {text}")
    return v


def served_model_name(text: str) -> str:
    """argparse type: a model name clients send as 'model'."""
    if not SERVED_MODEL_NAME.fullmatch(text) or not text.isprintable():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a valid model name: 1-128 characters, no whitespace, not starting with '-'")
    return text


def _quantization(text: str) -> str:
    try:
        return parse_quantization(text, "--quantization")
    except QuantizationError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--quantization: ").removeprefix("--quantization ")) from e


def _kv_cache_dtype(text: str) -> str:
    try:
        return parse_kv_cache_dtype(text, "--kv-cache-dtype")
    except QuantizationError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-cache-dtype: ").removeprefix("--kv-cache-dtype ")) from e


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def _speculative_tokens(text: str) -> int:
    v = int(text)
    if not 1 <= v <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {v}")
    return v


def _lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH of a LoRA adapter."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return served_model_name(name), path


def _lora_root(text: str) -> tuple[str, str]:
    """NAME=DIR of a volume the adapters file names."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name, path


def _flag(default: Any = None, help: str | None = None, **argparse_options: Any) -> Any:
    """A field of ServeArgs and how its flag is parsed (``type``, ``choices``, ``action``, ``required``, ``group``)."""
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass(frozen=True)
class ServeArgs:
    """Every flag of ``tokenfleet serve``, parsed and checked."""

    model: str = _flag(required=True, help="Hugging Face checkpoint directory")
    served_model_name: tuple[str, ...] | None = _flag(
        action="append", type=served_model_name,
        help="name clients send as 'model' (repeatable; default: the --model value); 1-128 characters, "
             "no whitespace, not starting with '-'")
    host: str = _flag("0.0.0.0")
    port: int = _flag(8000, type=int)
    api_key: str | None = _flag(help="require 'Authorization: Bearer KEY' on /v1 and /cache "
                                     "(default: $TOKENFLEET_API_KEY if set)")
    max_body_bytes: int = _flag(4 * 2**20, type=positive_int)
    max_prompt_tokens: int | None = _flag(type=positive_int, help="default: context - 1")
    max_tokens_limit: int | None = _flag(type=positive_int, help="largest max_tokens accepted")
    max_queue: int = _flag(256, type=positive_int, help="waiting requests beyond this get 429 with Retry-After")
    drain_timeout: float = _flag(25.0, type=_non_negative_seconds,
                                 help="seconds SIGTERM waits for in-flight requests before aborting them")
    header_timeout: float = _flag(
        10.0, type=_seconds,
        help="seconds a client has, from connecting or from the first byte of a request, to send the "
             "request line and headers; then 408 and the connection is closed")
    body_timeout: float = _flag(30.0, type=_seconds,
                                help="seconds a client has to send the whole request body after its headers; then 408")
    engine_stall_timeout: float = _flag(
        120.0, type=_seconds,
        help="an engine step running longer than this is a stuck engine: in-flight requests get 503 "
             "and /health fails, so the pod is restarted")
    price_per_hour: float | None = _flag(type=_non_negative_float,
                                         help="accelerator $/h, for the tokenfleet:cost_per_million_tokens_usd gauge")
    dtype: str = _flag("auto")
    device: str = _flag("auto", type=_device, help="auto (an accelerator when there is one), cpu, cuda or cuda:N")
    kv_cache_mb: int | None = _flag(type=_bounded_int(1, MAX_BYTES >> 20, " MiB"),
                                    help="KV cache per rank in MiB (default 512, unless --kv-cache-memory-bytes or "
                                         "--gpu-memory-utilization sizes it)")
    kv_cache_memory_bytes: int | None = _flag(type=_bounded_int(1, MAX_BYTES, " bytes"),
                                              help="KV cache per rank in bytes (vLLM's flag)")
    gpu_memory_utilization: float | None = _flag(
        type=_fraction,
        help="size the KV cache per rank as this fraction of the accelerator's memory (on CPU: of the memory "
             "limit) less the rank's weights and 1 GiB of headroom (vLLM's flag)")
    accelerator_memory_bytes: int | None = _flag(
        type=_bounded_int(1, MAX_BYTES, " bytes"),
        help="the memory of one accelerator (CPU: the memory limit) that --gpu-memory-utilization takes a fraction "
             "of (default: what the device or the cgroup reports)")
    block_size: int = _flag(16, type=positive_int)
    max_num_seqs: int = _flag(256, type=positive_int)
    max_num_batched_tokens: int = _flag(2048, type=positive_int)
    max_model_len: int | None = _flag(type=positive_int)
    no_prefix_caching: bool = _flag(False, action="store_true")
    num_threads: int | None = _flag(type=_bounded_int(1, MAX_THREADS), help="CPU threads for torch")
    quantization: str = _flag("none", type=_quantization,
                              help="weight quantization: none, or int8 (weight-only, per output channel, quantized at load)")
    kv_cache_dtype: str = _flag("auto", type=_kv_cache_dtype,
                                help="KV cache storage: auto (the compute dtype), or int8 (a bf16 scale per token "
                                     "and KV head: about twice the tokens of bf16 in the same --kv-cache-mb)")
    speculative_method: str | None = _flag(
        choices=("ngram", "draft"),
        help="speculative decoding: ngram (prompt lookup) or draft (--speculative-draft-model)")
    num_speculative_tokens: int | None = _flag(type=_speculative_tokens,
                                               help="draft tokens verified per step, 1-16 (default 4)")
    speculative_draft_model: str | None = _flag(
        help="checkpoint directory of the draft model (method draft; the target's tokenizer)")
    prompt_lookup_min: int | None = _flag(type=positive_int, help="smallest n-gram matched (ngram)")
    prompt_lookup_max: int | None = _flag(type=positive_int, help="largest n-gram matched (ngram)")
    tool_call_parser: str | None = _flag(
        choices=tuple(sorted(TOOL_PARSERS)),
        help="how tool calls are read out of the model's text, for tool_choice auto (vLLM's names): "
             + ", ".join(sorted(TOOL_PARSERS)) + " (docs/serving.md); unset: auto is refused")
    enable_auto_tool_choice: bool = _flag(
        False, action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone enables tool_choice auto; this flag "
             "needs it")
    structured_output_timeout: float = _flag(
        10.0, type=_seconds,
        help="seconds a request's grammar (response_format, structured_outputs, a required tool choice) may take "
             "to compile, on a worker thread; then the request is a 400 and the engine serves on")
    structured_output_cache_size: int = _flag(256, type=positive_int,
                                              help="compiled grammars kept, least recently used dropped first")
    load_format: str = _flag(
        "mmap", choices=("mmap", "read"),
        help="mmap: the weight files are read ahead from the process start (while torch is imported) and "
             "the weights are views of the memory-mapped files until the model packs them (no copy of "
             "their own); read: each tensor is read into memory first (the former way)")
    prefix_checkpoint_dir: str | None = _flag(
        group=WARM_RESTART,
        help="warm-restart store: the KV disk tier lives in DIR/NAME (unless --kv-offload-disk-path names "
             "it); the hottest prefix-cache blocks are written there periodically and on drain, and loaded "
             "from it at start (default: $TOKENFLEET_PREFIX_CHECKPOINT_DIR; unset: off)")
    prefix_checkpoint_name: str | None = _flag(
        group=WARM_RESTART,
        help="this replica's directory in that store (default: the host name); a replacement "
             "given the same name starts from its predecessor's blocks")
    prefix_checkpoint_interval: float = _flag(
        60.0, type=_seconds, group=WARM_RESTART,
        help="seconds between saves (a save writes only the hottest blocks the store lacks)")
    prefix_checkpoint_max_mb: int = _flag(256, type=positive_int, group=WARM_RESTART,
                                          help="most megabytes of KV blocks a save writes, and a start loads into "
                                               "the accelerator tier (the disk tier itself: --kv-offload-disk-mb)")
    model_revision: str | None = _flag(
        group=WARM_RESTART,
        help="the model's revision, which a stored KV block must match to be loaded (default: a "
             "fingerprint of the weight files)")
    kv_offload_host_mb: int = _flag(
        0, type=_bounded_int(0, MAX_BYTES >> 20, " MiB"), group=KV_OFFLOAD,
        help="host memory (MiB) that keeps prefix-cache blocks evicted from the accelerator's KV cache, with "
             "their hashes, so a later hit copies them back instead of recomputing them (pinned on CUDA); 0: off")
    kv_offload_disk_path: str | None = _flag(
        group=KV_OFFLOAD,
        help="directory of a disk tier below the host tier (one checksummed file per block); a replica that "
             "mounts the directory of the one it replaces starts with the tier filled. Unwritable or full: the "
             "tier switches itself off and serving goes on")
    kv_offload_disk_mb: int = _flag(4096, type=_bounded_int(1, MAX_BYTES >> 20, " MiB"), group=KV_OFFLOAD,
                                    help="most MiB of block files the disk tier keeps (least recently used go first)")
    enable_lora: bool = _flag(False, action="store_true", group=LORA, help="serve LoRA adapters of this model")
    lora_modules: tuple[tuple[str, str], ...] | None = _flag(
        nargs="+", type=_lora_module, metavar="NAME=PATH", group=LORA,
        help="adapters to load at start (PEFT directories); more come with /v1/load_lora_adapter")
    lora_modules_file: str | None = _flag(
        metavar="PATH", group=LORA,
        help="a JSON file of adapters to serve, followed while serving (checked every second): new entries "
             "are loaded (hot) or registered, removed ones unloaded; refused ones are reported on /metrics "
             "(the operator's adapters ConfigMap)")
    lora_root: tuple[tuple[str, str], ...] | None = _flag(
        nargs="+", type=_lora_root, metavar="NAME=DIR", group=LORA,
        help="the directory of a volume that --lora-modules-file entries name as their root")
    max_loras: int = _flag(4, type=positive_int, group=LORA, help="distinct adapters in one batch")
    max_lora_rank: int = _flag(16, type=positive_int, group=LORA, help="largest adapter rank accepted")
    max_cpu_loras: int | None = _flag(type=positive_int, group=LORA,
                                      help="adapters kept loaded (default: --max-loras); others are read again on use")
    tensor_parallel_size: int = _flag(
        1, type=positive_int, group=PARALLEL,
        help="ranks the model's weights and KV cache are split over; on one host this process starts "
             "the other ranks itself, one process per local accelerator (CPU: per share of the cores)")
    pipeline_parallel_size: int = _flag(1, type=positive_int, group=PARALLEL,
                                        help="pipeline stages: not implemented yet, a value above 1 is refused")
    nnodes: int = _flag(1, type=positive_int, group=PARALLEL, help="hosts in the replica")
    node_rank: int = _flag(0, type=int, group=PARALLEL, help="this host's index in the replica, 0 = the leader")
    master_addr: str | None = _flag(group=PARALLEL,
                                    help="the leader's address (a DNS name), required when --nnodes > 1")
    master_port: int = _flag(29500, type=int, group=PARALLEL, help="rendezvous port on the leader")
    headless: bool = _flag(
        False, action="store_true", group=PARALLEL,
        help="serve no OpenAI API, only /health and /metrics on --port, and run this host's ranks "
             "(every --node-rank > 0)")
    distributed_timeout_seconds: float = _flag(
        60.0, type=_seconds, group=PARALLEL,
        help="bound for joining the replica and for every collective; a rank that cannot reach the "
             "leader, or whose peer is gone, exits non-zero within it naming the rank and address")
    log_level: str = _flag("info", type=_log_level)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> ServeArgs:
        values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
        if values["served_model_name"] is not None:
            values["served_model_name"] = tuple(values["served_model_name"])
        if values["lora_modules"] is not None:
            values["lora_modules"] = tuple(values["lora_modules"])
        if values["lora_root"] is not None:
            values["lora_root"] = tuple(values["lora_root"])
        return cls(**values)

    def problem(self) -> str | None:
        """What the flags get wrong together, which no single flag's check sees (None: nothing)."""
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            return "--enable-auto-tool-choice needs --tool-call-parser"
        if self.lora_modules and not self.enable_lora:
            return "--lora-modules needs --enable-lora"
        if self.lora_modules_file and not self.enable_lora:
            return "--lora-modules-file needs --enable-lora"
        if self.enable_lora and (self.kv_offload_disk_path or self.prefix_checkpoint_dir):
            tier = "--kv-offload-disk-path" if self.kv_offload_disk_path else "--prefix-checkpoint-dir, warm restart's store"
            return (f"--enable-lora with a KV disk tier ({tier}) is not implemented yet: an unloaded adapter's "
                    "blocks on disk could not be forgotten")
        speculative = [flag_name(f) for f in ("num_speculative_tokens", "speculative_draft_model", "prompt_lookup_min",
                                              "prompt_lookup_max") if getattr(self, f) is not None]
        if speculative and self.speculative_method is None:
            return f"{', '.join(speculative)} need --speculative-method"
        budgets = [f for f, v in (("--kv-cache-mb", self.kv_cache_mb), ("--kv-cache-memory-bytes", self.kv_cache_memory_bytes),
                                  ("--gpu-memory-utilization", self.gpu_memory_utilization)) if v is not None]
        if len(budgets) > 1:
            return f"{' and '.join(budgets)} both size the KV cache: give one"
        return None

    @property
    def kv_cache_bytes(self) -> int:
        """The explicit KV budget per rank (the default 512 MiB when none is given)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return (self.kv_cache_mb or 512) * 2**20

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.served_model_name or (self.model,)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tokenfleet serve``, one flag per field of :class:`ServeArgs`."""
    parser = ArgumentParser(prog=PROG, description="serve a model over the OpenAI-compatible API")
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(ServeArgs):
        options = dict(f.metadata)
        group = options.pop("group", None)
        target = parser if group is None else groups.setdefault(group, parser.add_argument_group(group))
        if not options.get("required"):
            options["default"] = f.default
        if options.get("help") is None:
            options.pop("help")
        target.add_argument(flag_name(f.name), **options)
    return parser


class ServeArgsError(ValueError):
    """A command line ``tokenfleet serve`` would exit 2 on; the message is the line it would print."""


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """``argv`` as ``tokenfleet serve`` reads it, without printing or exiting: ServeArgsError when it would refuse."""
    parser = build_parser()

    def refuse(message: str):
        raise ServeArgsError(f"{parser.prog}: error: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    args = ServeArgs.from_cli_args(parser.parse_args(argv))
    problem = args.problem()
    if problem is not None:
        refuse(problem)
    return args


def argument_error(argv: list[str]) -> str | None:
    """The one-line error ``tokenfleet serve`` would exit 2 with for ``argv``, or None when it takes them.
    Imports no torch, writes nothing: for validating a pod's arguments before the pod runs."""
    try:
        parse_serve_args(argv)
    except ServeArgsError as exc:
        return str(exc)
    return None
