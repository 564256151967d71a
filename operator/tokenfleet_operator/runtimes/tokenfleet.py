"""The bundled engine: ``tokenfleet serve`` from the tokenfleet/serving image (or an image built from it).

Its command line is checked by the server's own argument parser before any pod starts, and the levers the
bundled engine lacks are refused with NotInServingImage (``validation.py``, which this module hands the spec
to). A headless member runs ``--headless`` and serves /health and /metrics only.
"""
from __future__ import annotations

from typing import Any

from tokenfleet_operator.api.common import quantity_value
from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.builders.adapters import lora_args
from tokenfleet_operator.kv_budget import kv_budget
from tokenfleet_operator.runtimes.base import (
    STARTUP_FAILURES,
    STARTUP_PERIOD_S,
    Launch,
    MetricsEndpoint,
    Probes,
    Runtime,
    http_probe,
    looks_like_vllm,
    not_supported,
)
from tokenfleet_operator.validation import Problem
from tokenfleet_serving.contract.pod_env import PodEnv

REPLICA_KEY_ENV = "TOKENFLEET_API_KEY"          # tokenfleet serve --api-key's default
PREFIX_CHECKPOINT_SUBDIR = "prefix-cache"


def parallel_args(launch: Launch) -> list[str]:
    """The flags that make this member one host of the replica's ranks; none for a replica of one rank. Every
    member but the leader is headless and takes its host index from its Slice."""
    sizes = launch.sizes
    if sizes.world == 1:
        return []
    args = ["--tensor-parallel-size", str(sizes.tensor), "--pipeline-parallel-size", str(sizes.pipeline)]
    if sizes.hosts > 1:
        rank = "0" if launch.leader else f"$({PodEnv.MEMBER_INDEX.value})"
        args += ["--nnodes", str(sizes.hosts), "--node-rank", rank,
                 "--master-addr", f"$({PodEnv.LEADER_ADDRESS.value})", "--master-port", str(launch.rendezvous_port)]
        if not launch.leader:
            args.append("--headless")
    return args


def warm_restart_args(spec: InferenceServiceSpec) -> list[str]:
    """The server's prefix-checkpoint flags: the Slice mounts the store and sets TOKENFLEET_CHECKPOINT_DIR
    (``builders/slice_pods.py``); each member saves under its Slice's name and index, so a replacement of a
    replica loads its predecessor's blocks. The kubelet expands the $(VAR) references."""
    checkpoint = spec.slice_policy.checkpoint
    if not spec.warm_restart.enabled or checkpoint is None:
        return []
    return ["--prefix-checkpoint-dir", f"$(TOKENFLEET_CHECKPOINT_DIR)/{PREFIX_CHECKPOINT_SUBDIR}",
            "--prefix-checkpoint-name", "$(TOKENFLEET_SLICE)-$(TOKENFLEET_MEMBER_INDEX)",
            "--prefix-checkpoint-interval", str(checkpoint.interval_seconds),
            "--prefix-checkpoint-max-mb", str(spec.warm_restart.max_megabytes)]


def _mebibytes(quantity: int | str) -> int:
    value = quantity_value(quantity) or 0
    return max(1, int(value // 2**20)) if value > 0 else 0


def kv_offload_args(spec: InferenceServiceSpec) -> list[str]:
    """The server's KV offload flags (engine.kvOffload). With warmRestart and no diskPath the server keeps its disk
    tier in the checkpoint store (``--prefix-checkpoint-dir``/its name), which diskSize then bounds."""
    offload = spec.engine.kv_offload
    if offload is None:
        return []
    args: list[str] = []
    if offload.host_memory is not None and _mebibytes(offload.host_memory):
        args += ["--kv-offload-host-mb", str(_mebibytes(offload.host_memory))]
    if offload.disk_path is not None:
        args += ["--kv-offload-disk-path", offload.disk_path]
    if offload.disk_size is not None:
        args += ["--kv-offload-disk-mb", str(max(1, _mebibytes(offload.disk_size)))]
    return args


class TokenfleetRuntime(Runtime):
    name = "tokenfleet"
    router_backend = "tokenfleet"
    metrics = MetricsEndpoint("/metrics", 8000, running="vllm:num_requests_running",
                              waiting="vllm:num_requests_waiting", kv_cache_usage="vllm:kv_cache_usage_perc")
    reads_model_shape = True

    def command(self, spec: InferenceServiceSpec, launch: Launch) -> list[str]:
        eng = spec.engine
        args = ["tokenfleet", "serve", "--model", launch.model_dir, "--host", "0.0.0.0", "--port", str(launch.port)]
        for name in spec.model.served_model_names:
            args.append(f"--served-model-name={name}")     # one token: a name can never be read as a flag
        args += ["--dtype", eng.dtype, "--block-size", str(eng.kv_block_size), "--max-num-seqs", str(eng.max_num_seqs)]
        if eng.max_model_len is not None:
            args += ["--max-model-len", str(eng.max_model_len)]
        if eng.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
        args += list(kv_budget(spec).flags)
        if eng.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", eng.kv_cache_dtype]
        if not eng.enable_prefix_caching:
            args.append("--no-prefix-caching")
        if eng.quantization != "none":
            args += ["--quantization", eng.quantization]
        if eng.speculative_decoding is not None:
            sd = eng.speculative_decoding
            args += ["--speculative-method", sd.method, "--num-speculative-tokens", str(sd.num_speculative_tokens)]
            if launch.draft_model_dir:
                args += ["--speculative-draft-model", launch.draft_model_dir]
        if eng.tool_call_parser is not None:
            args += ["--tool-call-parser", eng.tool_call_parser]
        if launch.price_per_replica_hour > 0:
            args += ["--price-per-hour", f"{launch.price_per_replica_hour:g}"]
        args += warm_restart_args(spec)
        args += kv_offload_args(spec)
        args += parallel_args(launch)
        args += lora_args(spec)
        args += list(eng.extra_args or [])
        return args

    def env(self, key_ref: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": REPLICA_KEY_ENV, "valueFrom": key_ref}]

    def probes(self, launch: Launch) -> Probes:
        # /ready turns true once the engine has warmed up; a headless member is ready while its ranks are joined.
        return Probes(startup=http_probe("/health", STARTUP_PERIOD_S, STARTUP_FAILURES),
                      liveness=http_probe("/health", 10, 3),
                      readiness=http_probe("/ready" if launch.leader else "/health", 5, 3))

    def problems(self, spec: InferenceServiceSpec) -> list[Problem]:
        from tokenfleet_operator.validation import bundled_server_problems
        if looks_like_vllm(spec.image):
            return [not_supported(self.name, "spec.image", f"runs 'tokenfleet serve', which the vLLM image "
                                  f"{spec.image} does not have; set spec.engine.runtime to vllm")]
        if spec.routing.prefix_source is not None:
            return [not_supported(self.name, "spec.routing.prefixSource", "reports the prompt blocks each replica "
                                  "holds on /cache/blocks, which the router reads; remove prefixSource (it chooses "
                                  "between two sources for vLLM replicas)")]
        return bundled_server_problems(spec)
