"""The runtime contract: everything the operator needs to know about the engine an InferenceService runs.

A runtime (``spec.engine.runtime``) says, from the spec and the few facts the builders add (``Launch``):

- ``command``: the serving container's command line (the leader, or a headless member of a multi-host replica);
- ``env``: the container's environment (the replica key, under the name the engine reads);
- ``probes``: the startup, liveness and readiness probes of the leader and of a headless member;
- ``volumes``: volumes the engine needs besides the model's (vLLM: a memory-backed /dev/shm for NCCL);
- ``metrics``: where the engine serves Prometheus metrics (the router reads its load from there);
- ``router_backend``: what the router is told the replicas speak (``tokenfleet route --backend-runtime``);
- ``kv_events``: where a replica publishes the KV-cache events the router follows, and replays those a router
  missed, if it does;
- ``problems``: the fields of the spec the runtime cannot honour, and ``engine.extraArgs`` that collide with a
  flag the operator sets (each a Problem naming the field or the flag);
- ``reads_model_shape``: whether the operator checks the model's split with the image's ``tokenfleet
  model-shape`` before a split replica starts.

The builders and the reconcile only ever call these; a runtime is one module in this package and one entry in
``RUNTIMES`` (``runtimes/__init__.py``), plus its name in the API's ``engine.runtime`` enum.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenfleet_operator.api.inference_service import InferenceServiceSpec
from tokenfleet_operator.parallelism import ParallelSizes
from tokenfleet_operator.validation import Problem

# Loading weights can take many minutes: a startup probe every 5 s allows 30 of them.
STARTUP_PERIOD_S = 5
STARTUP_FAILURES = 360


@dataclass(frozen=True)
class KvEventPorts:
    """A replica's KV-cache event ports: ``publish`` streams every batch, ``replay`` (if any) sends a router the
    past batches it asks for (from a sequence number on), so that one that missed some, or started late,
    catches up."""

    publish: int
    replay: int | None = None

    def container_ports(self) -> list[dict[str, Any]]:
        named = [("kv-events", self.publish), ("kv-replay", self.replay)]
        return [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in named if p is not None]


@dataclass(frozen=True)
class Launch:
    """What a command line is made of beyond the spec: where the builders mount the model (and the draft
    model), the replica's parallel sizes, which member this is (0: the leader, which serves the API), the
    serving port and the price of one replica per hour."""

    model_dir: str
    sizes: ParallelSizes
    member: int = 0
    draft_model_dir: str | None = None
    port: int = 8000
    price_per_replica_hour: float = 0.0
    rendezvous_port: int = 29500

    @property
    def leader(self) -> bool:
        return self.member == 0


@dataclass(frozen=True)
class Probes:
    """Kubernetes probes of the serving container; None leaves a probe out."""

    startup: dict[str, Any] | None = None
    liveness: dict[str, Any] | None = None
    readiness: dict[str, Any] | None = None

    def to_container(self) -> dict[str, Any]:
        out = {}
        for key, probe in (("startupProbe", self.startup), ("livenessProbe", self.liveness),
                           ("readinessProbe", self.readiness)):
            if probe is not None:
                out[key] = probe
        return out


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where a replica serves its Prometheus metrics, and the names of its load gauges."""

    path: str
    port: int
    running: str               # requests in the engine's batch
    waiting: str               # requests queued for a batch slot
    kv_cache_usage: str        # share of the KV cache in use, 0..1


def http_probe(path: str, period: int, failures: int, port: str = "http") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


@dataclass(frozen=True)
class OwnedFlag:
    """A flag the operator sets on the engine's command line, and the field that sets it."""

    flag: str
    owner: str
    aliases: tuple[str, ...] = field(default=())


class Runtime(abc.ABC):
    """One engine the replicas may run. Subclasses are stateless; ``RUNTIMES`` holds one instance of each."""

    name: ClassVar[str]                  # the value of spec.engine.runtime
    router_backend: ClassVar[str]        # what the router is told the replicas speak

    @property
    def router_args(self) -> tuple[str, ...]:
        """The router's flags for this runtime: ``--backend-runtime NAME``, left out for the router's default
        (tokenfleet), so that a router image older than the flag still runs the bundled engine's services."""
        return () if self.router_backend == "tokenfleet" else ("--backend-runtime", self.router_backend)
    metrics: ClassVar[MetricsEndpoint]
    reads_model_shape: ClassVar[bool] = False

    @abc.abstractmethod
    def command(self, spec: InferenceServiceSpec, launch: Launch) -> list[str]:
        """The serving container's command line, engine.extraArgs last."""

    @abc.abstractmethod
    def env(self, key_ref: dict[str, Any]) -> list[dict[str, Any]]:
        """The container's environment; ``key_ref`` is the valueFrom of the replica key Secret."""

    @abc.abstractmethod
    def probes(self, launch: Launch) -> Probes:
        """The probes of the leader (``launch.member`` 0) or of a headless member."""

    def volumes(self, launch: Launch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(pod volumes, container mounts) the engine needs besides the model's; none by default."""
        return [], []

    def kv_events(self, spec: InferenceServiceSpec) -> KvEventPorts | None:
        """Where a replica publishes its KV-cache events for the router to follow, or None when the router
        learns a replica's prompt blocks another way (``spec.routing.prefixSource``)."""
        return None

    @abc.abstractmethod
    def problems(self, spec: InferenceServiceSpec) -> list[Problem]:
        """Fields this runtime cannot honour and extraArgs it refuses, first the most useful to fix."""


def image_path(image: str) -> list[str]:
    """The path segments of an image reference, without tag or digest: 'docker.io/vllm/vllm-openai:v1' ->
    ['docker.io', 'vllm', 'vllm-openai']."""
    head, _, last = image.split("@", 1)[0].rpartition("/")
    return [*(head.split("/") if head else []), last.split(":", 1)[0]]


def looks_like_vllm(image: str) -> bool:
    """An image vLLM publishes or one named after it (vllm/vllm-openai, .../vllm-cpu-release-repo, ...)."""
    path = image_path(image)
    return "vllm" in path[:-1] or path[-1] == "vllm" or path[-1].startswith("vllm-")


def not_supported(runtime: str, field_name: str, message: str) -> Problem:
    """The condition of a field a runtime cannot honour."""
    return Problem("NotSupportedByRuntime", field_name, f"runtime {runtime} {message}")
