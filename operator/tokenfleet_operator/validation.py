"""Semantic checks the API server's schema cannot express.

Each check returns Problems; the handlers turn the first one into a
Ready=False condition with the problem's reason and an Event, and stop
reconciling the object until its spec changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator.api.inference_service import DEFAULT_IMAGE, InferenceServiceSpec
from tokenfleet_operator.api.slice import SliceSpec


@dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, used as the condition reason
    field: str  # the offending field, e.g. spec.accelerator.topology
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def topology_size(topology: str) -> int:
    """Chips in a topology string: '2x4' -> 8. The schema guarantees the format."""
    return math.prod(int(part) for part in topology.split("x"))


def _topology_problem(topology: str | None, hosts: int, per_host: int, field: str, hosts_field: str) -> list[Problem]:
    if topology is None:
        return []
    size = topology_size(topology)
    if size != hosts * per_host:
        return [
            Problem(
                "TopologyMismatch",
                field,
                f"topology {topology} has {size} accelerators but {hosts_field} * countPerHost = {hosts} * {per_host} = "
                f"{hosts * per_host}; change one of them so they agree",
            )
        ]
    return []


BUNDLED_REPOSITORY = DEFAULT_IMAGE.rsplit(":", 1)[0]      # tokenfleet/serving


def runs_bundled_server(image: str) -> bool:
    """True for the bundled serving image under any registry, tag or digest."""
    head, _, last = image.split("@", 1)[0].rpartition("/")
    path = f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
    return path == BUNDLED_REPOSITORY or path.endswith("/" + BUNDLED_REPOSITORY)


def _levers_the_bundled_server_lacks(spec: InferenceServiceSpec) -> list[Problem]:
    """The bundled server does not implement quantization or speculative decoding yet; without this check
    its pods would crash-loop on the flags (another image may implement them)."""
    if not runs_bundled_server(spec.image):
        return []
    problems = []
    if spec.engine.quantization != "none":
        problems.append(Problem(
            "NotInServingImage", "spec.engine.quantization",
            f"the bundled serving image {spec.image} does not implement {spec.engine.quantization} quantization yet; "
            "set quantization to none, or set spec.image to a server that accepts --quantization"))
    if spec.engine.speculative_decoding is not None:
        problems.append(Problem(
            "NotInServingImage", "spec.engine.speculativeDecoding",
            f"the bundled serving image {spec.image} does not implement speculative decoding yet; remove "
            "speculativeDecoding, or set spec.image to a server that accepts --speculative-method"))
    return problems


def check_inference_service(spec: InferenceServiceSpec) -> list[Problem]:
    acc = spec.accelerator
    problems = _topology_problem(
        acc.topology, acc.hosts_per_replica, acc.count_per_host, "spec.accelerator.topology", "hostsPerReplica"
    )
    if acc.type == "cpu" and acc.count_per_host != 1:
        problems.append(
            Problem("CpuAcceleratorCount", "spec.accelerator.countPerHost", "type cpu requests no accelerator; set countPerHost to 1")
        )
    spec_dec = spec.engine.speculative_decoding
    if spec_dec and spec.engine.max_model_len is not None and spec_dec.num_speculative_tokens >= spec.engine.max_model_len:
        problems.append(
            Problem(
                "SpeculationLongerThanContext",
                "spec.engine.speculativeDecoding.numSpeculativeTokens",
                f"{spec_dec.num_speculative_tokens} speculative tokens do not fit a context of {spec.engine.max_model_len}",
            )
        )
    return problems + _levers_the_bundled_server_lacks(spec)


def _template_problems(template_spec: dict[str, Any]) -> list[Problem]:
    containers = template_spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [Problem("InvalidTemplate", "spec.template.spec.containers", "the member template needs at least one container")]
    problems = []
    for i, container in enumerate(containers):
        if not isinstance(container, dict) or not container.get("name") or not container.get("image"):
            problems.append(
                Problem("InvalidTemplate", f"spec.template.spec.containers[{i}]", "every container needs a name and an image")
            )
    return problems


def check_slice(spec: SliceSpec) -> list[Problem]:
    problems = _topology_problem(spec.topology, spec.hosts, spec.accelerator.count_per_host, "spec.topology", "hosts")
    problems += _template_problems(spec.template.spec)
    return problems
