"""InferenceService: a model served by N replicas, each replica one Slice,
behind an operator-managed router.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field
from pydantic.json_schema import JsonDict

from tokenfleet_operator.api.common import (
    ABSOLUTE_PATH_PATTERN,
    DNS_LABEL_PATTERN,
    IMAGE_PATTERN,
    LABEL_KEY_PATTERN,
    QUANTITY_PATTERN,
    RELATIVE_PATH_PATTERN,
    TOPOLOGY_PATTERN,
    AcceleratorBase,
    ApiModel,
    Conditions,
    CrdInfo,
    PrinterColumn,
    Quantity,
    Resource,
    ResourceRequirements,
    rule,
    with_rules,
)
from tokenfleet_operator.api.model_source import HostPathSource, ModelSource
from tokenfleet_operator.api.pod_template import DNS_SUBDOMAIN_PATTERN
from tokenfleet_operator.api.slice import DEFAULT_TOPOLOGY_KEY, CheckpointSpec, RestartPolicy
from tokenfleet_serving.contract.router_files import DEFAULT_LOAD_FACTOR, DEFAULT_LOAD_SLACK, DEFAULT_MAX_RECORDED_BLOCKS

DEFAULT_IMAGE = "tokenfleet/serving:0.1.0"
# What `tokenfleet serve --served-model-name` accepts (tokenfleet_serving.server.main.SERVED_MODEL_NAME).
SERVED_MODEL_NAME_PATTERN = r"^[^\s-]\S{0,127}$"


def _defaulted(model: type[ApiModel], description: str):
    """A sub-object that is always present: the API server fills in its defaults even when the user omits it.

    The default is the fully defaulted object (not {}), because the API server
    checks defaults against the CEL rules before filling in nested defaults."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": model().to_wire()})


class ModelSpec(ModelSource):
    """Where the weights come from (exactly one of path, pvc or hostPath; pvc and hostPath are mounted read-only
    at /models) and the names clients use for the model."""

    served_model_names: list[Annotated[str, Field(min_length=1, max_length=128, pattern=SERVED_MODEL_NAME_PATTERN)]] = Field(
        description="Names clients pass as 'model' in OpenAI requests; the first one is shown by kubectl get. Each "
                    "has 1-128 characters, no whitespace, and does not start with '-'.",
        min_length=1,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class AdapterHostPathSource(HostPathSource):
    """An adapter in a directory on every node, mounted read-only: path is the volume (under a prefix the
    operator allows), subPath the adapter's directory inside it."""

    sub_path: str | None = Field(
        default=None,
        description="The adapter's directory inside path; relative, without '..'. Adapters that share a path share "
                    "one volume, so adding one more below it changes no pod.",
        max_length=1024, pattern=RELATIVE_PATH_PATTERN,
    )


class AdapterSpec(ModelSource):
    """A LoRA adapter of the served model (PEFT's layout: adapter_config.json and adapter_model.safetensors),
    served by every replica under its own model name. Exactly one of path, pvc or hostPath."""

    name: str = Field(
        description="The model name clients pass as 'model' for this adapter; unique among spec.adapters and "
                    "distinct from spec.model.servedModelNames. 1-128 characters, no whitespace, not starting with "
                    "'-'.",
        min_length=1, max_length=128, pattern=SERVED_MODEL_NAME_PATTERN,
    )
    path: str | None = Field(
        default=None,
        description="Absolute directory inside the serving container, other than / and without '..': in the image, "
                    "or below /models when the model comes from a pvc or hostPath (the model's own volume). Changes "
                    "no pod when added or removed.",
        max_length=1024, pattern=ABSOLUTE_PATH_PATTERN,
    )
    host_path: AdapterHostPathSource | None = Field(
        default=None,
        description="Load the adapter from a directory on the node, if a cluster administrator allowed it (the "
                    "operator's --allow-host-path).",
    )
    hot: bool = Field(
        default=False,
        description="Load the adapter into every replica at once and keep it there; otherwise a replica checks its "
                    "files when it is listed and reads it on its first request (the router prefers replicas that "
                    "have it in memory).",
    )


class AcceleratorSpec(AcceleratorBase):
    """The accelerators of one replica: countPerHost on each of hostsPerReplica hosts."""

    hosts_per_replica: int = Field(
        default=1, description="Hosts (member pods) per replica; more than one makes a multi-host slice.", ge=1, le=256
    )
    topology: str | None = Field(
        default=None,
        description="Accelerator topology of one replica, e.g. 2x4; its product must equal countPerHost * hostsPerReplica.",
        max_length=16,
        pattern=TOPOLOGY_PATTERN,
    )
    memory_per_device: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, max_length=64,
        description="Memory of one accelerator, e.g. 80Gi. Unset: the operator's table for the type (docs/operator.md: "
        "nvidia-h100-80gb, nvidia-h200, nvidia-a100-40gb, nvidia-l4, tpu-v5e, ...); for a type not in it the server "
        "reads the device. The KV-cache budget of engine.acceleratorMemoryUtilization is a fraction of it.",
    )


class SpeculativeDecoding(ApiModel):
    """Speculative decoding: propose several tokens cheaply and verify them in one step. Output is exactly what
    decoding without it gives (greedy token for token, sampling in distribution); the engine speculates only in
    steps where it expects more tokens per second (small batches, drafts that hold)."""

    model_config = with_rules(
        rule(
            "self.method != 'draft' || has(self.draftModel)",
            "method draft needs draftModel",
            field_path=".draftModel",
        ),
        rule(
            "self.method != 'ngram' || !has(self.draftModel)",
            "method ngram takes no draftModel",
            field_path=".draftModel",
        ),
    )

    method: Literal["ngram", "draft"] = Field(
        description="ngram proposes the tokens that followed the longest earlier match of the request's last tokens "
        "(prompt lookup: for answers that copy from the prompt); draft runs the smaller draftModel."
    )
    num_speculative_tokens: int = Field(default=4, description="Tokens proposed per request and step, at most.", ge=1, le=16)
    draft_model: ModelSource | None = Field(
        default=None, description="The draft model (method draft): a Llama-family checkpoint with the served model's "
        "tokenizer; it takes engine.quantization too. Exactly one of path, pvc (the model's own claim too, with "
        "another subPath) or hostPath; pvc and hostPath are mounted read-only at /draft-model.",
    )


class KVOffloadSpec(ApiModel):
    """Host-memory and disk tiers under the accelerator's prefix cache (tokenfleet serve --kv-offload-*): blocks the
    accelerator's KV cache evicts keep their hashes and KV in host memory, then on disk, each tier a least-recently-
    used cache of its own; a prompt whose prefix is found there gets it copied back instead of recomputed, and the
    router prefers an accelerator hit, then a host hit, then a miss. Not with tensor parallelism above 1 yet."""

    host_memory: Quantity | None = Field(
        default=None, description="Host memory for the host tier, per replica (--kv-offload-host-mb, whole MiB); "
        "it comes on top of the container's other memory, so raise its memory limit by as much. Unset or 0: none.")
    disk_path: str | None = Field(
        default=None, description="Directory of the disk tier in the serving container (--kv-offload-disk-path): a "
        "volume the pod template mounts there. One checksummed file per block, tied to the model, revision, dtype, "
        "KV dtype and block size; a corrupt or foreign block is never loaded, and an unwritable or full directory "
        "switches the tier off (tokenfleet:kv_offload_tier_enabled 0) while the replica keeps serving. With "
        "warmRestart enabled and no diskPath, the tier lives in slicePolicy.checkpoint.store, one directory per "
        "replica member, and is the warm-restart store.", max_length=1024, pattern=r"^/[^\s$]*$")
    disk_size: Quantity | None = Field(
        default=None, description="Most bytes of block files the disk tier keeps (--kv-offload-disk-mb, whole MiB; "
        "least recently used go first). Unset: 4Gi.")


class EngineSpec(ApiModel):
    """Settings of the continuously batched engine."""

    model_config = with_rules(
        rule(
            "!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
            "maxNumBatchedTokens must be at least maxNumSeqs (every running sequence needs a token per step)",
            field_path=".maxNumBatchedTokens",
        ),
        rule(
            "self.runtime == oldSelf.runtime",
            "engine.runtime cannot change: an InferenceService runs one runtime (its replicas and its router speak "
            "it); create another InferenceService with the other runtime, a fleet may hold both",
            field_path=".runtime",
        ),
        rule(
            "[has(self.kvCacheMb), has(self.kvCacheMemory), has(self.acceleratorMemoryUtilization)]"
            ".filter(x, x).size() <= 1",
            "set at most one of kvCacheMemory, acceleratorMemoryUtilization and kvCacheMb: each sizes the KV cache",
            field_path=".kvCacheMemory",
        ),
        rule(
            "self.quantization in ['none', 'int8'] || self.dtype != 'float32'",
            "quantized weights need dtype auto, float16 or bfloat16, not float32 (int8 takes any dtype)",
            field_path=".dtype",
        ),
    )

    runtime: Literal["tokenfleet", "vllm"] = Field(
        default="tokenfleet",
        description="The engine the replicas run (docs/runtimes.md): tokenfleet, the bundled engine ('tokenfleet "
        "serve'), or vllm ('vllm serve' in spec.image, a vLLM image such as vllm/vllm-openai). The operator builds "
        "the engine's command line, probes and API key from the fields of this spec; a field the chosen runtime "
        "cannot honour makes the service Ready=False with reason NotSupportedByRuntime, naming the field. The "
        "router always runs from the operator's own image. One runtime per InferenceService.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Activation and weight dtype; auto uses the model's own."
    )
    max_model_len: int | None = Field(
        default=None, description="Maximum context (prompt + output tokens); unset uses the model's.", ge=16, le=1048576
    )
    kv_block_size: Literal[8, 16, 32, 64, 128] = Field(default=16, description="Tokens per KV-cache block.")
    max_num_batched_tokens: int | None = Field(
        default=None, description="Token budget of one engine step (prefill chunks plus decodes).", ge=16, le=1048576
    )
    max_num_seqs: int = Field(default=256, description="Sequences running at once.", ge=1, le=4096)
    kv_cache_mb: int | None = Field(
        default=None, description="Memory for the KV cache of each replica, in MiB (tokenfleet serve --kv-cache-mb); "
        "it bounds how many tokens of running requests and of cached prefixes a replica holds. Unset uses the "
        "server's default (512). Prefer kvCacheMemory.", ge=1, le=16777216,
    )
    kv_cache_memory: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, max_length=64,
        description="Memory for the KV cache of each rank (each accelerator; on CPU the replica's), e.g. 20Gi "
        "(tokenfleet serve --kv-cache-memory-bytes, as vLLM's flag). At most one of kvCacheMemory, "
        "acceleratorMemoryUtilization and kvCacheMb. Unset, with neither of the others: on an accelerator 0.9 of "
        "its memory less the weights and 1 GiB of headroom (acceleratorMemoryUtilization 0.9); on CPU the same "
        "fraction of resources.limits.memory when the replica has a memory limit, else (accelerator.type cpu) the "
        "server's 512 MiB; a rank that runs on the CPU whatever its type takes at most its memory limit, and "
        "without one at most 4 GiB. A "
        "maxModelLen whose context the budget cannot hold once is refused (reason KVCacheTooSmall), and so is a "
        "size larger than a rank's memory as the operator knows it (resources.limits.memory on CPU, else "
        "accelerator.memoryPerDevice or the accelerator type's; reason KVCacheTooLarge).",
    )
    accelerator_memory_utilization: float | None = Field(
        default=None,
        description="Size the KV cache of each rank as this fraction of the accelerator's memory "
        "(accelerator.memoryPerDevice, or the operator's table for accelerator.type; on CPU resources.limits.memory) "
        "less the rank's weights and 1 GiB of headroom (tokenfleet serve --gpu-memory-utilization, vLLM's flag).",
        gt=0, le=1,
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        default="auto",
        description="Storage of the KV cache (tokenfleet serve --kv-cache-dtype, vLLM's flag). auto: the compute "
        "dtype. int8: one bf16 scale per token and KV head, about half the bytes of bf16 (twice the tokens in one "
        "budget) at a small cost in accuracy (docs/engine.md). fp8 is not implemented by the bundled serving image "
        "(NotInServingImage); another image may.",
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prompt prefixes.")
    kv_offload: KVOffloadSpec | None = Field(
        default=None, description="Host-memory and disk tiers of the prefix cache; unset: the accelerator's KV "
        "cache alone (with warmRestart, a disk tier in the checkpoint store).")
    quantization: Literal["none", "int8", "fp8", "awq", "gptq"] = Field(
        default="none",
        description="Weight quantization. int8: weight-only, one scale per output channel, quantized at load from the "
        "bf16/fp16/fp32 checkpoint (the serving image computes in the faster of fp32 and bf16 on the host). fp8, awq "
        "and gptq are not implemented by the bundled serving image yet (NotInServingImage); another image may.",
    )
    speculative_decoding: SpeculativeDecoding | None = Field(default=None, description="Unset disables speculative decoding.")
    tensor_parallel_size: int | None = Field(
        default=None,
        description="Ranks that split every layer of the model (attention heads, MLP, vocabulary) between them "
        "(tokenfleet serve --tensor-parallel-size); one rank per accelerator. tensorParallelSize * "
        "pipelineParallelSize must equal accelerator.countPerHost * accelerator.hostsPerReplica, so that every "
        "accelerator a replica holds (and is billed for) runs a rank. Unset: countPerHost * hostsPerReplica / "
        "pipelineParallelSize. It must divide the model's attention heads and MLP intermediate size, and divide "
        "or be a multiple of its key/value heads; the operator checks the model before it starts the replicas (reason "
        "ModelNotSplittable).",
        ge=1, le=1024,
    )
    pipeline_parallel_size: int | None = Field(
        default=None,
        description="Stages the model's layers are split into, one after the other "
        "(tokenfleet serve --pipeline-parallel-size). Unset: 1, or countPerHost * hostsPerReplica / "
        "tensorParallelSize when only that is set. It must not exceed the model's layers. The bundled serving "
        "image does not implement pipeline parallelism yet: above 1 with it, the service is Ready=False with "
        "reason NotInServingImage (another image may implement it).",
        ge=1, le=1024,
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="How the server reads tool calls out of the model's text, for chat requests with tools and "
        "tool_choice auto (tokenfleet serve --tool-call-parser, vLLM's names). The bundled serving image has hermes "
        "(Hermes 2 Pro, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3) and mistral; another name is refused for it "
        "(NotInServingImage). Unset: requests with tool_choice auto get a 400; required and named tool choices "
        "need no parser.",
        max_length=64, pattern=r"^[a-z0-9_]+$",
    )
    extra_args: list[Annotated[str, Field(max_length=256)]] | None = Field(
        default=None,
        description=(
            "Extra command-line flags appended to the server's command line verbatim. With the bundled "
            "tokenfleet/serving image they are checked against 'tokenfleet serve' itself: an unknown flag, a bad "
            "value, or a flag the operator sets from another field (--model, --host, --port, --api-key, "
            "--served-model-name, --dtype, ...) makes the service Ready=False with reason InvalidEngineArgs "
            "instead of crash-looping pods. With runtime vllm, a flag the operator sets (listed in "
            "docs/runtimes.md), its alias or abbreviation makes the service Ready=False with reason "
            "ExtraArgsCollision naming it; other flags go to vllm serve as they are (one it refuses fails the "
            "replica at once with its error)."
        ),
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )


class SessionAffinity(ApiModel):
    """Send requests of one session to one replica so its KV cache is reused."""

    enabled: bool = Field(default=False, description="Whether session affinity is on.")
    header: str = Field(
        default="x-session-id", description="Request header that names the session.", max_length=128, pattern=r"^[A-Za-z0-9-]+$"
    )
    ttl_seconds: int = Field(default=600, description="Idle seconds after which a session may move.", ge=1, le=86400)


class RoutingSpec(ApiModel):
    """How the router spreads requests over replicas, and the router's own Deployment."""

    policy: Literal["round-robin", "least-load", "prefix-aware", "kv-aware"] = Field(
        default="prefix-aware",
        description=(
            "round-robin cycles; least-load picks the replica with the fewest queued and running requests; prefix-aware "
            "prefers the replica that served the longest shared prompt prefix; kv-aware also weighs KV-cache usage."
        ),
    )
    session_affinity: SessionAffinity = _defaulted(SessionAffinity, "Session affinity.")
    load_factor: float = Field(
        default=DEFAULT_LOAD_FACTOR, description="The load bound of prefix-aware, kv-aware and session routing: a "
        "replica takes a request only while its requests in flight, this one included, are at most loadFactor "
        "times the mean over the replicas plus loadSlack; otherwise the request goes to the next-best replica "
        "within the bound (the least-loaded one always is). Higher keeps more requests on the replica that holds "
        "their prefix, at the cost of a larger imbalance.", ge=1, le=100,
    )
    load_slack: int = Field(
        default=DEFAULT_LOAD_SLACK, description="Requests a replica may carry above loadFactor times the mean "
        "before the load bound applies, so that at low load a cache hit is not given up for an imbalance of one "
        "or two requests.", ge=0, le=10000,
    )
    prefix_source: Literal["routed", "kvEvents"] | None = Field(
        default=None, description="vLLM replicas only: how the router learns which prompt blocks a replica holds, "
        "for prefix-aware and kv-aware routing. routed: its own record of the prompt blocks it sent each replica, "
        "as large as the replica's KV cache (vllm:cache_config_info), which misses what the replica evicted "
        "early; kvEvents: the replica's own KV-cache events (vLLM's --kv-events-config, published over ZeroMQ "
        "on port 5557 and followed by the router, which asks the replica's replay socket on port 5558 for batches "
        "it missed or that came before it followed; a replica that has sent no event yet is routed by the routed "
        "record). Unset: kvEvents. The bundled engine reports its blocks itself "
        "(/cache/blocks), so setting this with runtime tokenfleet is refused.",
    )
    max_recorded_blocks: int = Field(
        default=DEFAULT_MAX_RECORDED_BLOCKS, description="vLLM replicas only: the most prompt blocks the router "
        "records per replica, in its routed record and in its record of the replica's KV events each (the "
        "replica's own num_gpu_blocks when smaller; the least recently stored goes first). About 0.5 KB of "
        "router memory per block and replica, however large a cache a replica claims.", ge=1024, le=16 * 2**20,
    )
    replicas: int = Field(
        default=2, description="Router pods. The router Service spreads connections over them; with 2 or more, "
        "a router pod that dies costs only the streams that were on it, and a rolling update of the router "
        "costs none (a PodDisruptionBudget lets one pod go at a time, and the pods spread over nodes). Session, "
        "hold and load state are each pod's own.", ge=1, le=16,
    )
    drain_seconds: int = Field(
        default=30, description="Seconds a router pod that is told to stop (rolling update, scale-down, node "
        "drain) has to finish its open streams: it turns its readiness to 503 at once, keeps serving what "
        "reaches it while the Service takes it out of its endpoints, and exits when no request is left open, "
        "or when this time is up (the pod's terminationGracePeriodSeconds is this plus 5).", ge=1, le=3600,
    )
    resources: ResourceRequirements | None = Field(default=None, description="Resources of each router pod.")
    migration_limit: int = Field(
        default=3, description="Times one streamed request may be moved to another replica when its replica fails "
        "mid-stream (the router continues it there from the tokens already delivered); 0 turns stream migration "
        "off. A stream that cannot be continued ends with an OpenAI error event.", ge=0, le=10,
    )
    no_replica_hold_seconds: int = Field(
        default=30, description="Seconds a request that finds no ready replica (all of them failed or restarting at "
        "once) waits at the router for one before it gets 503; a broken stream waits as long for a replica to "
        "continue on. 0 answers 503 at once. With minReplicas 0, autoscaling.pendingTimeoutSeconds applies instead.",
        ge=0, le=3600,
    )


class AuthSpec(ApiModel):
    """Who may call the service: clients authenticate at the router with keys from a Secret."""

    client_keys_secret_name: str = Field(
        description=(
            "Name of a Secret in the service's namespace that holds the client API keys. Each data key of the "
            "Secret is a file of keys, one per line (blank lines and # comments are ignored); a request needs "
            "'Authorization: Bearer <one of them>'. The router re-reads the Secret within a second of a change. "
            "The router reaches the replicas with a key of its own (Secret <name>-replica-key, made by the "
            "operator), which clients never see."
        ),
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
    )


class SloSpec(ApiModel):
    """Latency objectives, measured at the router. A request meets them when its time to first token and its
    time per output token are within the targets; goodput is the share of requests (and of tokens) that do."""

    time_to_first_token_ms: int | None = Field(
        default=None, description="Target time to first token in milliseconds (arrival at the router to the first "
        "token of a streamed response).", ge=1, le=600000
    )
    time_per_output_token_ms: int | None = Field(
        default=None, description="Target time per output token after the first, in milliseconds.", ge=1, le=60000
    )
    percentile: float = Field(
        default=95, description="The share of requests, in percent, that must meet the targets: status.goodput "
        "reports the observed latencies at this percentile, and the autoscaler adds replicas while fewer than this "
        "share of requests meet them. In (0, 100].", gt=0, le=100,
    )


# The API server checks a fractional minimum against an integer value truncated (0 passes minimum 0.01), so the
# autoscaler's targets carry the bound as a CEL rule too (issue 37, defect 2).
AT_LEAST_A_HUNDREDTH: JsonDict = {"x-kubernetes-validations": [rule("self >= 0.01", "must be at least 0.01")]}


class AutoscalingSpec(ApiModel):
    """The built-in autoscaler, on when maxReplicas is set: it runs between minReplicas and maxReplicas replicas
    and reports the count it runs in status.desiredReplicas (spec.replicas is then only the starting count; it is
    never written). For an HPA or KEDA, leave maxReplicas unset and let them scale spec.replicas through the scale
    subresource instead."""

    target_requests_per_replica: float = Field(
        default=8, description="Waiting plus running requests per ready replica that the autoscaler aims for; at "
        "least 0.01.", ge=0.01, le=100000, json_schema_extra=AT_LEAST_A_HUNDREDTH,
    )
    target_kv_cache_usage: float = Field(
        default=0.8, description="Mean KV-cache usage of the ready replicas (0.01..1) that the autoscaler aims for.",
        ge=0.01, le=1, json_schema_extra=AT_LEAST_A_HUNDREDTH,
    )
    target_waiting_per_replica: float | None = Field(
        default=None, description="Requests waiting for a batch slot per ready replica that the autoscaler aims for: the "
        "engines' queues (vllm:num_requests_waiting) plus the requests the router holds. Unset: the queue is no signal "
        "of its own (it still counts in targetRequestsPerReplica). At least 0.01.", ge=0.01, le=100000,
        json_schema_extra=AT_LEAST_A_HUNDREDTH,
    )
    metric_window_seconds: int = Field(
        default=30, description="The load signals (requests, waiting requests, KV-cache usage) are their mean over the "
        "router readings of this many seconds, so that one busy moment neither adds a replica nor keeps one; a load "
        "over the last tenth of the window (at least two readings) that is at least twice what the replicas asked for "
        "(ready or starting) are sized for is acted on at once. While no replica starts, a scale-up looks one replica "
        "startup plus half this window ahead along the requests' rise over twice this window. 0: the latest reading "
        "alone, and no look-ahead. SLO attainment "
        "is taken over the same window (at least 10 s) since the number of ready replicas last changed.",
        ge=0, le=600,
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, description="A scale-up takes the lowest recommendation of this window (0: at once).", ge=0, le=3600
    )
    scale_down_stabilization_seconds: int = Field(
        default=120, description="A scale-down takes the highest recommendation of this window, and waits until the "
        "autoscaler has watched for that long.", ge=0, le=3600
    )
    max_scale_up_replicas: int = Field(default=4, description="Replicas added in one step at most.", ge=1, le=1000)
    max_scale_down_replicas: int = Field(default=1, description="Replicas removed in one step at most.", ge=1, le=1000)
    scale_to_zero_after_seconds: int = Field(
        default=300, description="With minReplicas 0: seconds without a request after which the service scales to "
        "zero, counted back no further than the Ready transition of its longest-ready replica. The router then holds "
        "new requests while a replica comes up.", ge=1, le=86400
    )
    max_pending_requests: int = Field(
        default=64, description="With minReplicas 0: requests the router holds while no replica is ready; more get "
        "503 with Retry-After.", ge=1, le=100000
    )
    pending_timeout_seconds: int = Field(
        default=300, description="With minReplicas 0: seconds a held request waits for a replica before it gets 503 "
        "with Retry-After.", ge=1, le=3600
    )
    drain_timeout_seconds: int = Field(
        default=60, description="A replica chosen for removal (by the autoscaler or a lower spec.replicas) first gets "
        "no new requests; it is deleted once its open requests finished, or after this many seconds.", ge=0, le=3600
    )


class PriceSpec(ApiModel):
    """What the fleet costs, to report dollars per hour and per million tokens."""

    accelerator_per_hour: float = Field(default=0.0, description="Price of one accelerator for one hour.", ge=0, le=10000)
    overhead_per_hour: float = Field(
        default=0.0, description="Other cost of one replica per hour (CPU, memory, network).", ge=0, le=100000
    )
    currency: str = Field(default="USD", description="ISO 4217 currency code of the prices.", pattern=r"^[A-Z]{3}$")


class SlicePolicy(ApiModel):
    """How the Slice of each replica is placed and restarted."""

    topology_key: str = Field(
        default=DEFAULT_TOPOLOGY_KEY,
        description="Node label naming a topology domain; all hosts of a replica are placed in one domain.",
        max_length=317,
        pattern=LABEL_KEY_PATTERN,
    )
    priority: int = Field(default=0, description="Placement priority of the replicas' slices.", ge=-1000, le=1000000)
    queue: str = Field(default="default", description="Admission queue of the replicas' slices.", max_length=63, pattern=DNS_LABEL_PATTERN)
    restart_policy: RestartPolicy = _defaulted(RestartPolicy, "Gang restart budget and backoff of each replica.")
    checkpoint: CheckpointSpec | None = Field(default=None, description="Warm-restart checkpoint settings of each replica.")


class WarmRestartSpec(ApiModel):
    """Warm restart from a prefix-cache checkpoint. Every replica saves its hottest prefix-cache blocks (token ids,
    chained block hashes and KV tensors, tied to the model's config hash, revision and dtype) to
    slicePolicy.checkpoint.store, every slicePolicy.checkpoint.intervalSeconds and when it drains; a replacement
    loads them before it turns ready, so prompts sharing a cached prefix hit at once. A checkpoint written by
    another model, revision or dtype is refused, and a corrupt one ignored: the replica then starts cold and its
    log says why."""

    enabled: bool = Field(default=False, description="Whether replicas save and load prefix-cache checkpoints.")
    max_megabytes: int = Field(
        default=256, description="Most megabytes of KV blocks one replica's checkpoint holds, hottest first.",
        ge=1, le=1048576,
    )


class RolloutSpec(ApiModel):
    """How a spec change rolls over the replicas."""

    max_unavailable: int = Field(
        default=1, description="Ready replicas that may be replaced at the same time during a rollout.", ge=1, le=1000
    )


class InferenceServiceSpec(ApiModel):
    """Desired state of an InferenceService."""

    model_config = with_rules(
        rule(
            "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas",
            field_path=".minReplicas",
        ),
        rule(
            "!has(self.minReplicas) || self.replicas >= self.minReplicas",
            "replicas must be at least minReplicas",
            field_path=".replicas",
        ),
        rule(
            "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "replicas must not exceed maxReplicas",
            field_path=".replicas",
        ),
        rule(
            "!self.warmRestart.enabled || has(self.slicePolicy.checkpoint)",
            "warmRestart needs slicePolicy.checkpoint.store: the replicas save their prefix cache there",
            field_path=".warmRestart.enabled",
        ),
        rule(
            "!has(self.engine.tensorParallelSize) || !has(self.engine.pipelineParallelSize) || "
            "self.engine.tensorParallelSize * self.engine.pipelineParallelSize == "
            "self.accelerator.countPerHost * self.accelerator.hostsPerReplica",
            "engine.tensorParallelSize * engine.pipelineParallelSize must equal accelerator.countPerHost * "
            "accelerator.hostsPerReplica: one rank per accelerator of a replica",
            field_path=".engine.tensorParallelSize",
        ),
        rule(
            "!has(self.engine.tensorParallelSize) || has(self.engine.pipelineParallelSize) || "
            "(self.accelerator.countPerHost * self.accelerator.hostsPerReplica) % self.engine.tensorParallelSize == 0",
            "engine.tensorParallelSize must divide accelerator.countPerHost * accelerator.hostsPerReplica (the "
            "pipeline stages are the quotient)",
            field_path=".engine.tensorParallelSize",
        ),
        rule(
            "!has(self.engine.pipelineParallelSize) || has(self.engine.tensorParallelSize) || "
            "(self.accelerator.countPerHost * self.accelerator.hostsPerReplica) % self.engine.pipelineParallelSize "
            "== 0",
            "engine.pipelineParallelSize must divide accelerator.countPerHost * accelerator.hostsPerReplica (the "
            "tensor-parallel ranks are the quotient)",
            field_path=".engine.pipelineParallelSize",
        ),
        rule(
            "!has(self.adapters) || self.adapters.all(a, !(a.name in self.model.servedModelNames))",
            "adapter names must differ from model.servedModelNames (each is a model name of its own)",
            field_path=".adapters",
        ),
        rule(
            "!self.warmRestart.enabled || self.engine.enablePrefixCaching",
            "warmRestart restores the prefix cache: engine.enablePrefixCaching must be true",
            field_path=".engine.enablePrefixCaching",
        ),
        rule(
            "!has(self.engine.kvOffload) || self.engine.enablePrefixCaching",
            "engine.kvOffload keeps prefix-cache blocks: engine.enablePrefixCaching must be true",
            field_path=".engine.kvOffload",
        ),
        rule(
            "!has(self.engine.kvOffload) || !has(self.engine.kvOffload.diskSize) || "
            "has(self.engine.kvOffload.diskPath) || self.warmRestart.enabled",
            "engine.kvOffload.diskSize sizes a disk tier: set diskPath, or enable warmRestart (its store holds the tier)",
            field_path=".engine.kvOffload.diskSize",
        ),
    )

    model: ModelSpec = Field(description="The model to serve.")
    adapters: list[AdapterSpec] | None = Field(
        default=None,
        description="LoRA adapters of the model, each served as a model of its own by every replica (bundled "
        "serving image, one rank per replica). Adding or removing one restarts no replica: the operator renders them "
        "into the ConfigMap <name>-adapters, which each replica follows within seconds (loading, registering or "
        "unloading; requests running with a removed adapter finish first). Only a pvc claim or hostPath path no "
        "earlier adapter used adds a volume to the pods and rolls the replicas once; so does setting this field "
        "from unset (it turns LoRA on in the engine) or unsetting it. An empty list keeps LoRA on. Adapter size "
        "bounds are the engine's: add --max-lora-rank, --max-loras or --max-cpu-loras to engine.extraArgs. An "
        "adapter a replica refuses (base model mismatch, rank over --max-lora-rank, unknown target module, corrupt "
        "files) shows in the AdaptersReady condition, naming the adapter, file and field.",
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    replicas: int = Field(default=1, description="Serving replicas; each replica is one Slice.", ge=0, le=1000)
    min_replicas: int | None = Field(
        default=None, description="Lower bound for the built-in autoscaler (default 1; 0 scales to zero when idle).",
        ge=0, le=1000,
    )
    max_replicas: int | None = Field(
        default=None, description="Upper bound for the built-in autoscaler; setting it turns the autoscaler on "
        "(spec.autoscaling).", ge=1, le=1000,
    )
    autoscaling: AutoscalingSpec = _defaulted(AutoscalingSpec, "Targets and pace of the built-in autoscaler, and the "
                                              "drain before any scale-down.")
    accelerator: AcceleratorSpec = Field(description="Accelerators of one replica.")
    engine: EngineSpec = _defaulted(EngineSpec, "Engine settings.")
    routing: RoutingSpec = _defaulted(RoutingSpec, "Routing policy and the router Deployment.")
    slo: SloSpec = _defaulted(SloSpec, "Latency objectives.")
    price: PriceSpec = _defaulted(PriceSpec, "Prices used for cost reporting.")
    image: str = Field(default=DEFAULT_IMAGE, description="Serving image, without whitespace: the bundled "
                       "tokenfleet/serving for engine.runtime tokenfleet, a vLLM image (e.g. vllm/vllm-openai) for "
                       "vllm. The router runs from the operator's own image (its --router-image), whatever this is.",
                       min_length=1, max_length=512, pattern=IMAGE_PATTERN)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the serving and router containers."
    )
    resources: ResourceRequirements = _defaulted(
        ResourceRequirements, "CPU and memory of each serving pod (accelerators come from accelerator)."
    )
    slice_policy: SlicePolicy = _defaulted(SlicePolicy, "Placement and restart policy of each replica's Slice.")
    rollout: RolloutSpec = _defaulted(RolloutSpec, "How spec changes roll over the replicas.")
    auth: AuthSpec | None = Field(
        default=None,
        description="Client authentication at the router. Unset: the router lets every client in (the replicas "
                    "still take requests only from the router).",
    )
    warm_restart: WarmRestartSpec = _defaulted(WarmRestartSpec, "Warm restart of replicas from a prefix-cache "
                                               "checkpoint in slicePolicy.checkpoint.store.")


class SliceSummary(ApiModel):
    """One replica's Slice as seen by its InferenceService."""

    name: str = Field(description="Name of the Slice.")
    phase: str = Field(default="Pending", description="The Slice's phase.")
    ready: bool = Field(default=False, description="Whether every member of the Slice is ready.")
    updated: bool = Field(default=False, description="Whether the Slice runs the current spec.")


class CapacityStatus(ApiModel):
    """The cheapest cost per token the service has shown it can serve within its SLO."""

    tokens_per_hour_per_replica: float = Field(
        description="The highest output tokens per hour per ready replica over a minute in which the SLO was met.",
        ge=0,
    )
    cost_per_million_tokens: float = Field(
        description="Price of one replica per hour / tokensPerHourPerReplica * 1e6: what a token costs when the "
        "service runs at that load.", ge=0,
    )
    measured_at: str = Field(description="When that minute ended (RFC 3339).", json_schema_extra={"format": "date-time"})


class ModelShapeStatus(ApiModel):
    """The model dimensions a tensor/pipeline split depends on, read from the model's config.json by a short pod
    before the first replica of a split model starts (only for the bundled serving image)."""

    source: str = Field(description="Hash of the model source and image the shape was read from; a change reads "
                                    "it again.", max_length=64)
    layers: int = Field(description="Decoder layers (num_hidden_layers).", ge=0)
    attention_heads: int = Field(description="Attention heads (num_attention_heads).", ge=0)
    key_value_heads: int = Field(description="Key/value heads (num_key_value_heads).", ge=0)
    intermediate_size: int = Field(description="Width of the MLP (intermediate_size).", ge=0)
    head_dim: int | None = Field(default=None, description="Width of one attention head.", ge=0)
    dtype_bytes: int | None = Field(default=None, description="Bytes per weight of the checkpoint's torch_dtype.", ge=0)
    weight_bytes: int | None = Field(default=None, description="Bytes of the checkpoint's safetensors files.", ge=0)


class CostStatus(ApiModel):
    """What the service costs: the price of its replicas over the tokens it delivered (accelerator $/h / tokens/h)."""

    dollars_per_hour: float | None = Field(
        default=None, description="Replicas * (accelerators per replica * acceleratorPerHour + overheadPerHour), in price.currency."
    )
    window: str | None = Field(default=None, description="The window tokensPerHour and costPerMillionTokens are measured over.")
    tokens_per_hour: float | None = Field(
        default=None,
        description="Output tokens per hour the router delivered over the window "
        "(tokenfleet_router_output_tokens_total).",
    )
    cost_per_million_tokens: float | None = Field(
        default=None, description="Mean dollarsPerHour over the window / tokensPerHour * 1e6; absent while fewer than "
        "minTokens tokens flowed in the window (an idle service has no cost per token, not an infinite one).",
    )
    min_tokens: int | None = Field(default=None, description="Tokens the window needs before costPerMillionTokens is shown.")
    capacity: CapacityStatus | None = Field(default=None, description="The cost per token at the highest load that still met the SLO.")


class GoodputStatus(ApiModel):
    """How much of the traffic met spec.slo, measured at the router over a window."""

    window: str | None = Field(default=None, description="The window, e.g. 5m.")
    requests: int | None = Field(default=None, description="Requests finished in the window.", ge=0)
    request_ratio: float | None = Field(default=None, description="Share of those requests that met the SLO.", ge=0, le=1)
    token_ratio: float | None = Field(
        default=None, description="Share of their output tokens that belong to requests that met the SLO.", ge=0, le=1
    )
    percentile: float | None = Field(default=None, description="spec.slo.percentile.")
    time_to_first_token_seconds: float | None = Field(default=None, description="Observed time to first token at that percentile.")
    time_per_output_token_seconds: float | None = Field(default=None, description="Observed time per output token at that percentile.")
    met: bool | None = Field(default=None, description="Whether at least percentile percent of the requests met the SLO.")


class DrainingReplica(ApiModel):
    """A replica being removed: it gets no new requests and is deleted once its open requests finished."""

    name: str = Field(description="The replica's Slice.")
    since: str = Field(description="When its drain started (RFC 3339).", json_schema_extra={"format": "date-time"})


class AutoscalingStatus(ApiModel):
    """What the built-in autoscaler decided last, and what it saw."""

    reason: str | None = Field(default=None, description="Why it chose status.desiredReplicas, e.g. RequestsPerReplica.")
    message: str | None = Field(default=None, description="The signal and its target, in words.")
    last_scale_time: str | None = Field(default=None, description="When the replica count last changed (RFC 3339).")
    requests_per_replica: float | None = Field(default=None, description="Waiting + running requests per ready replica.")
    waiting_per_replica: float | None = Field(
        default=None, description="Requests waiting for a batch slot (the engines' queues and the router's held ones) "
        "per ready replica.")
    running_per_replica: float | None = Field(default=None, description="Requests in the engines' batches per ready replica.")
    kv_cache_usage: float | None = Field(default=None, description="Mean KV-cache usage of the ready replicas.")
    pending_requests: int | None = Field(default=None, description="Requests the router holds because no replica is ready.")
    requests_rise_per_second: float | None = Field(
        default=None, description="How fast the requests in flight rise (their least-squares slope over twice "
        "metricWindowSeconds since the ready replicas last changed, where clear of noise; 0 when flat or falling): "
        "while no replica starts, a scale-up adds what they will need one replica startup (at most the trend window) "
        "plus half metricWindowSeconds ahead.")
    replica_startup_seconds: float | None = Field(
        default=None, description="Seconds from a replica's Slice creation (or its leader pod's, if later) to that pod "
        "Ready, measured on the newest ready replica: how far ahead a scale-up looks along a rise, and how long a "
        "replica that is not Ready counts as starting (3 startups, at least 60 s).")
    last_cold_start_seconds: float | None = Field(
        default=None, description="Mean arrival-to-first-token of the requests that last found no replica ready."
    )


class AdapterStatus(ApiModel):
    """One LoRA adapter of spec.adapters as the ready replicas report it (read every --collect-seconds)."""

    name: str = Field(description="The adapter's model name.")
    replicas: list[str] | None = Field(
        default=None, description="Serving pods (one per replica) that hold the adapter in memory; the router "
        "prefers them for its requests.")
    serving_replicas: int = Field(default=0, description="Ready replicas that serve the adapter, in memory or read "
                                  "again on its next request.", ge=0)
    prompt_tokens: int = Field(default=0, description="Prompt tokens of its finished requests, summed over the "
                               "ready replicas since each started.", ge=0)
    generation_tokens: int = Field(default=0, description="Tokens generated with it, summed over the ready replicas "
                                   "since each started.", ge=0)
    token_share: float | None = Field(
        default=None, description="Its generationTokens over every model's generated tokens on the same replicas "
        "(base model and all adapters); absent before any token was generated.", ge=0, le=1)
    dollars_per_hour: float | None = Field(
        default=None, description="Its share of status.cost.dollarsPerHour: the service's cost split by generated "
        "tokens (tokenShare * dollarsPerHour). A token of any adapter costs the same, status.cost."
        "costPerMillionTokens.", ge=0)
    refused: str | None = Field(
        default=None, description="Why a replica refused the adapter: the adapter file, the field or tensor, and "
        "the reason (a base-model mismatch, a rank over --max-lora-rank, an unknown target module, a missing or "
        "corrupt file).")


class InferenceServiceStatus(ApiModel):
    """Observed state of an InferenceService, written only by the operator."""

    replicas: int = Field(default=0, description="Slices that exist for this service.", ge=0)
    ready_replicas: int = Field(default=0, description="Slices whose members are all ready.", ge=0)
    updated_replicas: int = Field(default=0, description="Slices running the current spec.", ge=0)
    selector: str | None = Field(default=None, description="Label selector of the serving pods (for the scale subresource).")
    url: str | None = Field(default=None, description="In-cluster URL of the router.")
    slices: list[SliceSummary] | None = Field(
        default=None,
        description="The replicas' Slices.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    desired_replicas: int | None = Field(
        default=None, description="The replica count the operator converges to: spec.replicas, or the built-in "
        "autoscaler's choice between minReplicas and maxReplicas.", ge=0,
    )
    draining: list[DrainingReplica] | None = Field(
        default=None, description="Replicas being drained before they are removed.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The built-in autoscaler's last decision.")
    cost: CostStatus | None = Field(default=None, description="Cost at the current size, and per token.")
    goodput: GoodputStatus | None = Field(default=None, description="SLO goodput over a recent window.")
    model_shape: ModelShapeStatus | None = Field(default=None, description="The model's split dimensions, once "
                                                 "read (replicas split over several ranks only).")
    adapters: list[AdapterStatus] | None = Field(
        default=None, description="spec.adapters as the replicas serve them: where each is loaded, its tokens and "
        "its share of the cost.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: Conditions | None = Field(
        default=None,
        description=(
            "Ready, SlicesReady, RouterReady and Degraded, plus kstatus' Reconciling (the operator works toward the "
            "spec) and Stalled (only a new spec or a person helps), each with a reason and a message; with the "
            "autoscaler also ScalingLimited; with spec.adapters also AdaptersReady (False with reason "
            "AdapterRefused naming the adapter, file and field of one a replica refused)."
        ),
    )


class InferenceService(Resource):
    """An InferenceService serves one model from N replicas behind a router."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="InferenceService",
        plural="inferenceservices",
        singular="inferenceservice",
        short_names=("tfis", "infsvc"),
        categories=("tokenfleet",),
        description=(
            "An InferenceService serves one model from spec.replicas replicas. Each replica is a Slice (a gang of "
            "hosts placed and restarted together); a router Deployment spreads requests over them."
        ),
        printer_columns=(
            PrinterColumn("Model", "string", ".spec.model.servedModelNames[0]", "First served model name"),
            PrinterColumn("Accelerator", "string", ".spec.accelerator.type", "Accelerator type"),
            PrinterColumn("Desired", "integer", ".status.desiredReplicas", "Replicas the operator converges to"),
            PrinterColumn("Ready", "integer", ".status.readyReplicas", "Ready replicas"),
            PrinterColumn("Up-to-date", "integer", ".status.updatedReplicas", "Replicas running the current spec"),
            PrinterColumn("$/h", "number", ".status.cost.dollarsPerHour", "Cost per hour at the current size"),
            PrinterColumn("$/MTok", "number", ".status.cost.costPerMillionTokens", "Cost per million tokens"),
            PrinterColumn("Goodput", "number", ".status.goodput.requestRatio", "Share of requests within the SLO"),
            PrinterColumn("Reason", "string", '.status.conditions[?(@.type=="Ready")].reason', "Reason of the Ready condition"),
            PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
            PrinterColumn("URL", "string", ".status.url", "Router URL", priority=1),
            PrinterColumn("Topology", "string", ".spec.accelerator.topology", "Topology of one replica", priority=1),
            PrinterColumn("Runtime", "string", ".spec.engine.runtime", "Engine the replicas run", priority=1),
        ),
        scale=True,
        root_validations=(
            rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 40",
                "metadata.name must be a DNS-1035 label of at most 40 characters (it names Services and Slices)",
                reason="FieldValueInvalid",
            ),
        ),
    )

    kind: str = Field(default="InferenceService", description="InferenceService")
    spec: InferenceServiceSpec = Field(description="Desired state of the service.")
    status: InferenceServiceStatus | None = Field(default=None, description="Observed state of the service.")
