"""The placer's input and output: plain frozen values, validated on construction.

The Kopf shell converts Kubernetes objects (Nodes, Pods, Slices, queues) into
these values, calls :func:`tokenfleet_operator.gang.placement.place`, and turns the
returned plan into Binding API calls, evictions and status. Nothing here knows
about the API server; every field is checked when the value is built, and a
bad field raises ``ValueError`` naming the object and the field.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TOLERATION_OPERATORS = ("Equal", "Exists")
QUEUEING_STRATEGIES = ("BestEffortFIFO", "StrictFIFO")
PREEMPTION_POLICIES = ("Never", "LowerPriority")

DEFAULT_HOST_INDEX_LABEL = "tokenfleet.dev/host-index"


def _frozen_counts(owner: str, name: str, value: Mapping[str, int]) -> Mapping[str, int]:
    """Copy a resource -> count mapping, rejecting negative or non-integer counts."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{owner}.{name} must be a mapping of resource name to count, got {type(value).__name__}")
    out: dict[str, int] = {}
    for resource, count in value.items():
        if not isinstance(resource, str) or not resource:
            raise ValueError(f"{owner}.{name} has an empty or non-string resource name: {resource!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{owner}.{name}[{resource!r}] must be a non-negative integer, got {count!r}")
        out[resource] = count
    return MappingProxyType(out)


def _frozen_labels(owner: str, name: str, value: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{owner}.{name} must be a mapping of label to value, got {type(value).__name__}")
    for key, val in value.items():
        if not isinstance(key, str) or not key or not isinstance(val, str):
            raise ValueError(f"{owner}.{name} must map non-empty strings to strings, got {key!r}: {val!r}")
    return MappingProxyType(dict(value))


def parse_topology(topology: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``. Raises ValueError for anything but positive ``AxB[xC...]``."""
    parts = topology.lower().split("x")
    if not topology or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise ValueError(f"topology {topology!r} is not of the form AxB (positive integers, e.g. 2x4)")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("Taint.key must not be empty")
        if self.effect not in TAINT_EFFECTS:
            raise ValueError(f"Taint({self.key}).effect must be one of {TAINT_EFFECTS}, got {self.effect!r}")


@dataclass(frozen=True)
class Toleration:
    """Kubernetes toleration semantics: empty key with Exists tolerates every taint;
    empty effect matches every effect."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def __post_init__(self) -> None:
        if self.operator not in TOLERATION_OPERATORS:
            raise ValueError(f"Toleration({self.key}).operator must be one of {TOLERATION_OPERATORS}, got {self.operator!r}")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"Toleration({self.key}).value must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("Toleration.key may be empty only with operator Exists")
        if self.effect and self.effect not in TAINT_EFFECTS:
            raise ValueError(f"Toleration({self.key}).effect must be empty or one of {TAINT_EFFECTS}, got {self.effect!r}")


@dataclass(frozen=True)
class Node:
    name: str
    allocatable: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    ready: bool = True
    unschedulable: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Node.name must not be empty")
        owner = f"Node({self.name})"
        object.__setattr__(self, "allocatable", _frozen_counts(owner, "allocatable", self.allocatable))
        object.__setattr__(self, "labels", _frozen_labels(owner, "labels", self.labels))
        object.__setattr__(self, "taints", tuple(self.taints))
        for taint in self.taints:
            if not isinstance(taint, Taint):
                raise ValueError(f"{owner}.taints must hold Taint values, got {taint!r}")


@dataclass(frozen=True)
class BoundPod:
    """A pod already bound to a node. ``gang`` is the key of the running Slice it
    belongs to (``namespace/name``), or None for any other pod."""

    node: str
    requests: Mapping[str, int]
    gang: str | None = None

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("BoundPod.node must not be empty")
        object.__setattr__(self, "requests", _frozen_counts(f"BoundPod(on {self.node})", "requests", self.requests))


@dataclass(frozen=True)
class SliceRequest:
    """One Slice as the placer sees it: ``hosts`` member pods, each needing
    ``per_host`` units of ``resource``, all inside one value of ``domain_label``.

    ``topology`` (e.g. ``"2x4"``) describes either the host grid (product =
    ``hosts``) or the accelerator grid of the whole Slice, as Slice.spec.topology
    does (product = ``hosts * per_host``). Either way it asks for one thing of the
    placer: the members occupy a run of consecutive ``host_index_label`` values
    (member i on index start+i). ``domain_label=None`` means the whole cluster
    is one domain. ``created`` orders Slices of equal priority (FIFO); the shell
    passes the requeue time for a Slice that was requeued after a timeout.
    """

    key: str
    resource: str
    per_host: int
    hosts: int = 1
    topology: str | None = None
    domain_label: str | None = None
    host_index_label: str = DEFAULT_HOST_INDEX_LABEL
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    priority: int = 0
    queue: str = "default"
    created: float = 0.0

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("SliceRequest.key must not be empty")
        owner = f"SliceRequest({self.key})"
        if not self.resource:
            raise ValueError(f"{owner}.resource must not be empty")
        for name in ("per_host", "hosts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")
        if self.topology is not None:
            try:
                dims = parse_topology(self.topology)
            except ValueError as exc:
                raise ValueError(f"{owner}.topology: {exc}") from None
            if math.prod(dims) not in (self.hosts, self.hosts * self.per_host):
                raise ValueError(
                    f"{owner}.topology {self.topology!r} has {math.prod(dims)} cells but hosts is {self.hosts} "
                    f"and hosts × per_host is {self.hosts * self.per_host}")
            if not self.host_index_label:
                raise ValueError(f"{owner}.host_index_label must not be empty when topology is set")
        if self.domain_label is not None and not self.domain_label:
            raise ValueError(f"{owner}.domain_label must be a label name or None, not empty")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{owner}.priority must be an integer, got {self.priority!r}")
        if isinstance(self.created, bool) or not isinstance(self.created, (int, float)) or math.isnan(self.created):
            raise ValueError(f"{owner}.created must be a number, got {self.created!r}")
        if not self.queue:
            raise ValueError(f"{owner}.queue must not be empty")
        object.__setattr__(self, "node_selector", _frozen_labels(owner, "node_selector", self.node_selector))
        object.__setattr__(self, "tolerations", tuple(self.tolerations))
        for toleration in self.tolerations:
            if not isinstance(toleration, Toleration):
                raise ValueError(f"{owner}.tolerations must hold Toleration values, got {toleration!r}")

    @property
    def accelerators(self) -> int:
        return self.per_host * self.hosts


@dataclass(frozen=True)
class Queue:
    """A cluster-scoped queue: accelerator quota per resource, a queueing strategy
    and a preemption policy (see docs/placement.md)."""

    name: str
    quota: Mapping[str, int] = field(default_factory=dict)
    strategy: str = "BestEffortFIFO"
    preemption: str = "Never"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Queue.name must not be empty")
        owner = f"Queue({self.name})"
        object.__setattr__(self, "quota", _frozen_counts(owner, "quota", self.quota))
        if self.strategy not in QUEUEING_STRATEGIES:
            raise ValueError(f"{owner}.strategy must be one of {QUEUEING_STRATEGIES}, got {self.strategy!r}")
        if self.preemption not in PREEMPTION_POLICIES:
            raise ValueError(f"{owner}.preemption must be one of {PREEMPTION_POLICIES}, got {self.preemption!r}")


# --- output -------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Every member of the Slice with its node; member i is ``members[i]``."""

    slice_key: str
    domain_label: str | None
    domain: str | None
    members: tuple[tuple[int, str], ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node for _, node in self.members)


# Codes an Unplaced decision can carry.
QUEUE_NOT_FOUND = "QueueNotFound"
QUOTA_TOO_SMALL = "QuotaTooSmall"          # the Slice alone exceeds its queue's quota: never admitted
QUOTA_EXCEEDED = "QuotaExceeded"           # waits for quota to be released
NO_MATCHING_NODES = "NoMatchingNodes"      # no node passes readiness, resource, selector, taints, labels
DOMAIN_TOO_SMALL = "DomainTooSmall"        # no domain could hold the Slice even if it were empty
INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # would fit an empty domain; none has room now
PREEMPTING = "Preempting"                  # lower-priority gangs are being evicted for it
BLOCKED_BY_QUEUE_HEAD = "BlockedByQueueHead"    # StrictFIFO: an earlier Slice of the queue waits


@dataclass(frozen=True)
class Unplaced:
    slice_key: str
    code: str
    reason: str


@dataclass(frozen=True)
class Preemption:
    """Evict every pod of each victim gang so that ``preemptor`` can later be placed
    on ``members`` in ``domain``; the capacity is held for it in this pass."""

    preemptor: str
    victims: tuple[str, ...]
    domain: str | None
    members: tuple[tuple[int, str], ...]


Decision = Placement | Unplaced


@dataclass(frozen=True)
class PlacementPlan:
    """Decisions in queue order (priority, then FIFO), and the preemptions to start."""

    decisions: tuple[Decision, ...]
    preemptions: tuple[Preemption, ...] = ()

    def by_key(self) -> dict[str, Decision]:
        return {d.slice_key: d for d in self.decisions}

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(d for d in self.decisions if isinstance(d, Placement))

    @property
    def unplaced(self) -> tuple[Unplaced, ...]:
        return tuple(d for d in self.decisions if isinstance(d, Unplaced))
