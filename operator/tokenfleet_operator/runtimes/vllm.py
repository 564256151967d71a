"""vLLM: ``vllm serve`` from a vLLM image (vllm/vllm-openai on NVIDIA GPUs, vLLM's CPU build, ...).

Every flag comes from a field of the spec (``FIELD_FLAGS`` says which); the operator image holds no vLLM and
never runs it, so the flags are vLLM's documented names and a unit test holds them to the parser of the vLLM
build this project installs (``.cache/vllm-venv``). engine.extraArgs go last, after a check against
``OWNED_FLAGS``: a flag the operator sets (or one that would override every flag, --config) is refused with
reason ExtraArgsCollision naming it; any other flag is vLLM's to judge. A flag vLLM does not know makes it exit
2, which fails the replica's Slice at once with vLLM's own last log line (a configuration error, no
crash-loop: ``gang/slice_state.py``, ``pod_failure.py``).

The replica key reaches vLLM as ``VLLM_API_KEY`` (what ``--api-key`` sets, kept off the command line); vLLM
checks it on /v1/*, and leaves /health and /metrics open, so the probes and the router's /metrics reads need
no key. A multi-host replica runs vLLM's multi-node mode: every member ``--nnodes``, ``--node-rank``,
``--master-addr`` (the leader's name in the Slice's headless Service) and ``--master-port``; the members but
the leader run ``--headless`` (no API server, so no HTTP probe: they are ready while they run, and a member
that exits fails the gang).
"""
from __future__ import annotations

import json
from typing import Any

from tokenfleet_operator.api.common import quantity_value
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.runtimes.base import (
    STARTUP_FAILURES,
    STARTUP_PERIOD_S,
    KvEventPorts,
    Launch,
    MetricsEndpoint,
    OwnedFlag,
    Probes,
    Runtime,
    http_probe,
    not_supported,
)
from tokenfleet_operator.validation import Problem, runs_bundled_server
from tokenfleet_serving.contract.pod_env import PodEnv
from tokenfleet_serving.contract.router_files import DEFAULT_KV_EVENTS_PORT, DEFAULT_KV_EVENTS_REPLAY_PORT

NAME = "vllm"
API_KEY_ENV = "VLLM_API_KEY"
REPLICA_KEY_ENV = "TOKENFLEET_API_KEY"
SHM_VOLUME = "dshm"

# spec.engine.quantization -> vLLM's --quantization. int8 is tokenfleet's weight-only int8 with one scale per
# output channel, quantized at load: vLLM's online shorthand for the same scheme.
QUANTIZATIONS = {"fp8": "fp8", "awq": "awq", "gptq": "gptq", "int8": "int8_per_channel_weight_only"}

# Every engine field, by what this runtime does with it: a flag (FLAG_FIELDS) or a refusal (problems). A field
# added to EngineSpec is neither until it is written here: a unit test holds the two together, so that no field
# is silently dropped for vLLM.
FLAG_FIELDS = frozenset({"runtime", "dtype", "max_model_len", "kv_block_size", "max_num_batched_tokens",
                         "max_num_seqs", "kv_cache_mb", "kv_cache_memory", "accelerator_memory_utilization",
                         "kv_cache_dtype", "enable_prefix_caching", "quantization",
                         "speculative_decoding", "tensor_parallel_size", "pipeline_parallel_size", "tool_call_parser",
                         "extra_args"})
REFUSED_FIELDS: frozenset[str] = frozenset({"kv_offload"})

# Multi-host replicas on vLLM: its multi-node mode (torch.distributed over the Slice's headless Service). Set to
# False to refuse hostsPerReplica > 1 with a condition, should the vLLM build in use not run it.
MULTI_HOST = True

# spec.routing.prefixSource kvEvents: vLLM publishes its KV-cache events on the first port (ZeroMQ PUB), which the
# router subscribes to, and replays the batches a router asks for on the second (ZeroMQ ROUTER; vLLM keeps the
# last KV_EVENTS_REPLAY_BATCHES of them)
KV_EVENTS = KvEventPorts(DEFAULT_KV_EVENTS_PORT, DEFAULT_KV_EVENTS_REPLAY_PORT)
KV_EVENTS_REPLAY_BATCHES = 10_000
KV_EVENTS_TOPIC = "kv"

# The flags the operator sets (or refuses, because they would change what it set), with the field to set
# instead. Short aliases are vLLM's own; every flag's abbreviation (argparse accepts unique prefixes) counts too.
OWNED_FLAGS: tuple[OwnedFlag, ...] = (
    OwnedFlag("--model", "spec.model (the positional model of vllm serve)"),
    OwnedFlag("--config", "the operator: a config file would set the flags it owns"),
    OwnedFlag("--host", "the operator (the Services and probes use 0.0.0.0:8000)"),
    OwnedFlag("--port", "the operator (the Services and probes use 0.0.0.0:8000)"),
    OwnedFlag("--api-key", "the operator (the replica key Secret, given as $VLLM_API_KEY)"),
    OwnedFlag("--served-model-name", "spec.model.servedModelNames"),
    OwnedFlag("--dtype", "spec.engine.dtype"),
    OwnedFlag("--max-model-len", "spec.engine.maxModelLen"),
    OwnedFlag("--max-num-seqs", "spec.engine.maxNumSeqs"),
    OwnedFlag("--max-num-batched-tokens", "spec.engine.maxNumBatchedTokens"),
    OwnedFlag("--enable-prefix-caching", "spec.engine.enablePrefixCaching", ("--no-enable-prefix-caching",)),
    OwnedFlag("--block-size", "spec.engine.kvBlockSize"),
    OwnedFlag("--kv-cache-memory-bytes", "spec.engine.kvCacheMemory (or kvCacheMb)"),
    OwnedFlag("--quantization", "spec.engine.quantization", ("-q",)),
    OwnedFlag("--speculative-config", "spec.engine.speculativeDecoding", ("-sc",)),
    OwnedFlag("--tool-call-parser", "spec.engine.toolCallParser"),
    OwnedFlag("--enable-auto-tool-choice", "spec.engine.toolCallParser", ("--no-enable-auto-tool-choice",)),
    OwnedFlag("--tensor-parallel-size", "spec.engine.tensorParallelSize", ("-tp",)),
    OwnedFlag("--pipeline-parallel-size", "spec.engine.pipelineParallelSize", ("-pp",)),
    OwnedFlag("--data-parallel-size", "spec.replicas (one engine per replica; the router spreads the load)",
              ("-dp",)),
    OwnedFlag("--nnodes", "spec.accelerator.hostsPerReplica", ("-n",)),
    OwnedFlag("--node-rank", "the operator (each member's index in its Slice)", ("-r",)),
    OwnedFlag("--master-addr", "the operator (the leader's name in its Slice's headless Service)"),
    OwnedFlag("--master-port", "the operator"),
    OwnedFlag("--headless", "the operator (every member but the leader)"),
    OwnedFlag("--kv-events-config", "spec.routing.prefixSource"),
)


def _flag_name(token: str) -> str | None:
    """The flag a command-line token names, as vLLM reads it ('--max_model_len=8' -> '--max-model-len',
    '--speculative-config.method' -> '--speculative-config'); None for a value."""
    if not token.startswith("-") or token == "-" or token[1:2].isdigit():
        return None
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name


def extra_args_collision(extra: list[str]) -> tuple[str, OwnedFlag] | None:
    """(the token, the flag it collides with) of the first extra argument that sets an owned flag, if any."""
    for token in extra:
        name = _flag_name(token)
        if name is None:
            continue
        for owned in OWNED_FLAGS:
            names = (owned.flag, *owned.aliases)
            if name in names or (name.startswith("--") and len(name) > 3
                                 and any(n.startswith(name) for n in names if n.startswith("--"))):
                return token, owned
    return None


def speculative_config(spec: InferenceServiceSpec, launch: Launch) -> str | None:
    sd = spec.engine.speculative_decoding
    if sd is None:
        return None
    config: dict[str, Any] = {"num_speculative_tokens": sd.num_speculative_tokens}
    if sd.method == "ngram":
        config["method"] = "ngram"
    else:
        config["method"] = "draft_model"
        config["model"] = launch.draft_model_dir
        if spec.engine.quantization != "none":
            config["quantization"] = QUANTIZATIONS.get(spec.engine.quantization, spec.engine.quantization)
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


class VllmRuntime(Runtime):
    name = NAME
    router_backend = NAME
    metrics = MetricsEndpoint("/metrics", 8000, running="vllm:num_requests_running",
                              waiting="vllm:num_requests_waiting", kv_cache_usage="vllm:kv_cache_usage_perc")

    def command(self, spec: InferenceServiceSpec, launch: Launch) -> list[str]:
        eng = spec.engine
        args = ["vllm", "serve", launch.model_dir, "--host", "0.0.0.0", "--port", str(launch.port),
                "--served-model-name", *spec.model.served_model_names,
                "--dtype", eng.dtype, "--block-size", str(eng.kv_block_size), "--max-num-seqs", str(eng.max_num_seqs)]
        if eng.max_model_len is not None:
            args += ["--max-model-len", str(eng.max_model_len)]
        if eng.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
        if eng.kv_cache_memory is not None:
            args += ["--kv-cache-memory-bytes", str(int(quantity_value(eng.kv_cache_memory) or 0))]
        elif eng.kv_cache_mb is not None:
            args += ["--kv-cache-memory-bytes", str(eng.kv_cache_mb * 1024 * 1024)]
        elif eng.accelerator_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{eng.accelerator_memory_utilization:g}"]
        if eng.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", eng.kv_cache_dtype]
        args.append("--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching")
        if eng.quantization != "none":
            args += ["--quantization", QUANTIZATIONS.get(eng.quantization, eng.quantization)]
        speculative = speculative_config(spec, launch)
        if speculative is not None:
            args.append(f"--speculative-config={speculative}")
        if eng.tool_call_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", eng.tool_call_parser]
        sizes = launch.sizes
        if sizes.world > 1:
            args += ["--tensor-parallel-size", str(sizes.tensor), "--pipeline-parallel-size", str(sizes.pipeline)]
        if self.kv_events(spec) is not None and launch.leader:
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS.publish}",
                      "replay_endpoint": f"tcp://*:{KV_EVENTS.replay}", "buffer_steps": KV_EVENTS_REPLAY_BATCHES,
                      "topic": KV_EVENTS_TOPIC}
            args.append(f"--kv-events-config={json.dumps(events, separators=(',', ':'), sort_keys=True)}")
        if sizes.hosts > 1:
            rank = "0" if launch.leader else f"$({PodEnv.MEMBER_INDEX.value})"
            args += ["--nnodes", str(sizes.hosts), "--node-rank", rank,
                     "--master-addr", f"$({PodEnv.LEADER_ADDRESS.value})", "--master-port", str(launch.rendezvous_port)]
            if not launch.leader:
                args.append("--headless")
        args += list(eng.extra_args or [])
        return args

    def kv_events(self, spec: InferenceServiceSpec) -> KvEventPorts | None:
        # kvEvents unless routed is asked for: measured no worse in W4 (docs/results/runtimes.md), exact where the
        # routed record guesses (evictions, restarts, several router pods each seeing part of the traffic)
        return None if spec.routing.prefix_source == "routed" else KV_EVENTS

    def env(self, key_ref: dict[str, Any]) -> list[dict[str, Any]]:
        # The pod runs as a non-root uid on a read-only root filesystem: vLLM's caches (~/.cache/vllm, Triton's
        # ~/.triton) go under the writable /tmp, and it sends no usage statistics from inside a cluster.
        return [{"name": REPLICA_KEY_ENV, "valueFrom": key_ref}, {"name": API_KEY_ENV, "valueFrom": key_ref},
                {"name": "HOME", "value": "/tmp"}, {"name": "VLLM_NO_USAGE_STATS", "value": "1"}]

    def volumes(self, launch: Launch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Ranks on one host talk through shared memory (NCCL, vLLM's shm broadcast), more than a container's
        64 MiB /dev/shm holds: a memory-backed emptyDir there, counted against the pod's memory."""
        if launch.sizes.ranks_per_host < 2:
            return [], []
        return ([{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
                [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}])

    def probes(self, launch: Launch) -> Probes:
        if not launch.leader:
            return Probes()           # --headless serves no HTTP
        # vLLM listens only once the engine is up; /health answers 200 while the engine lives.
        return Probes(startup=http_probe("/health", STARTUP_PERIOD_S, STARTUP_FAILURES),
                      liveness=http_probe("/health", 10, 3),
                      readiness=http_probe("/health", 5, 3))

    def problems(self, spec: InferenceServiceSpec) -> list[Problem]:
        problems: list[Problem] = []
        if runs_bundled_server(spec.image):
            problems.append(not_supported(
                NAME, "spec.image", f"runs 'vllm serve', which the bundled serving image {spec.image} does not "
                "have; set spec.image to a vLLM image (vllm/vllm-openai:<version> on NVIDIA GPUs)"))
        if spec.warm_restart.enabled:
            problems.append(not_supported(
                NAME, "spec.warmRestart.enabled", "does not implement warm restart from a prefix-cache checkpoint "
                "(the bundled engine does); disable warmRestart"))
        if spec.engine.quantization not in ("none", *QUANTIZATIONS):
            problems.append(not_supported(
                NAME, "spec.engine.quantization", f"does not list quantization {spec.engine.quantization}; it "
                f"takes {', '.join(sorted(QUANTIZATIONS))}"))
        if spec.engine.kv_cache_dtype == "int8":
            problems.append(not_supported(
                NAME, "spec.engine.kvCacheDtype", "has no int8 KV cache (its --kv-cache-dtype takes auto, bfloat16 "
                "and the fp8 variants); set kvCacheDtype to fp8 or auto, or use the tokenfleet runtime"))
        if spec.engine.kv_offload is not None:
            problems.append(not_supported(
                NAME, "spec.engine.kvOffload", "has no host-memory or disk tier configured by this operator (vLLM "
                "offloads through a KV connector such as LMCache, which extraArgs may set); remove kvOffload"))
        if spec.accelerator.hosts_per_replica > 1 and not MULTI_HOST:
            problems.append(not_supported(
                NAME, "spec.accelerator.hostsPerReplica", "cannot run a replica over several hosts with this "
                "operator's vLLM build; set hostsPerReplica to 1"))
        problems += extra_args_problems(spec)
        return problems


def extra_args_problems(spec: InferenceServiceSpec) -> list[Problem]:
    extra = list(spec.engine.extra_args or [])
    if any(_flag_name(t) in ("-h", "--help") or (t.startswith("--help=")) for t in extra):
        return [Problem("ExtraArgsCollision", "spec.engine.extraArgs", "asks vllm serve for its help: it would "
                                                                       "print it and exit instead of serving")]
    hit = extra_args_collision(extra)
    if hit is None:
        # flags vLLM users pass in extraArgs, which the operator sets only when their field is set
        eng = spec.engine
        for flag, field, is_set in (("--gpu-memory-utilization", "spec.engine.acceleratorMemoryUtilization",
                                     eng.accelerator_memory_utilization is not None),
                                    ("--kv-cache-dtype", "spec.engine.kvCacheDtype", eng.kv_cache_dtype != "auto")):
            if is_set and any(_flag_name(t) == flag for t in extra):
                return [Problem("ExtraArgsCollision", "spec.engine.extraArgs",
                                f"{flag} is set by {field}; set it there or in extraArgs, not both")]
        return []
    token, owned = hit
    shown = owned.flag if _flag_name(token) == owned.flag else f"{token} ({owned.flag})"
    return [Problem("ExtraArgsCollision", "spec.engine.extraArgs",
                    f"{shown} is set by {owned.owner}; extraArgs may add vLLM flags, not change the ones the "
                    "operator sets")]
