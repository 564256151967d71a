"""Kubernetes objects -> the placer's values, as pure functions.

The gang scheduler lists Nodes, Pods, Slices and SliceQueues and hands them
here; nothing in this module talks to the API server. Every function takes
the plain dicts the API server returns.
"""
from __future__ import annotations

import copy
import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenfleet_operator import conditions as cond
from tokenfleet_operator.api.slice import SliceSpec
from tokenfleet_operator.api.slice_queue import DEFAULT_QUEUE, SliceQueueSpec
from tokenfleet_operator.conditions import parse_rfc3339
from tokenfleet_operator.gang.placement import BoundPod, Node, Queue, SliceRequest, Taint, Toleration
from tokenfleet_operator.gang.placement.requeue import DEFAULT_BASE_SECONDS, DEFAULT_CAP_SECONDS, requeue_delay
from tokenfleet_operator.naming import ACCELERATOR_NODE_LABEL

T = TypeVar("T")

# The quota of the implicit default queue: no limit in practice.
UNLIMITED = 10**12

TERMINAL_PHASES = ("Succeeded", "Failed")


def _extended_count(value: Any) -> int | None:
    """An extended resource quantity as an integer; None for anything else ("500m", "1Gi")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def extended_resources(counts: dict[str, Any] | None) -> dict[str, int]:
    """Keep the extended resources (names with a '/', e.g. nvidia.com/gpu) that are whole numbers."""
    out = {}
    for name, value in (counts or {}).items():
        if "/" in name and not name.startswith("kubernetes.io/") and not name.startswith("hugepages-"):
            count = _extended_count(value)
            if count is not None:
                out[name] = count
    return out


def node_from_object(obj: dict[str, Any]) -> Node:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    ready = cond.is_ready(obj)
    taints = []
    for t in spec.get("taints") or []:
        if t.get("key") and t.get("effect") in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            taints.append(Taint(t["key"], t.get("value") or "", t["effect"]))
    return Node(
        name=meta["name"],
        allocatable=extended_resources(status.get("allocatable")),
        labels=dict(meta.get("labels") or {}),
        taints=tuple(taints),
        ready=ready,
        unschedulable=bool(spec.get("unschedulable")),
    )


def _container_counts(container: Any) -> dict[str, int]:
    """A container's extended resources: its requests, or its limits where it requests nothing."""
    resources = (container.get("resources") or {}) if isinstance(container, dict) else {}
    return extended_resources(resources.get("limits")) | extended_resources(resources.get("requests"))


def _add(total: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    return {name: total.get(name, 0) + counts.get(name, 0) for name in total.keys() | counts.keys()}


def pod_spec_requests(pod_spec: dict[str, Any]) -> dict[str, int]:
    """Extended resources a pod holds, as the kubelet and the scheduler count them: every container runs at
    once, and so do sidecars (init containers with restartPolicy Always) from their start; a plain init
    container runs alone with the sidecars started before it. The pod holds the larger of the two peaks."""
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for init in pod_spec.get("initContainers") or []:
        counts = _container_counts(init)
        if isinstance(init, dict) and init.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, counts)
        else:
            during = _add(sidecars, counts)
            init_peak = {n: max(init_peak.get(n, 0), during.get(n, 0)) for n in init_peak.keys() | during.keys()}
    running = dict(sidecars)
    for container in pod_spec.get("containers") or []:
        running = _add(running, _container_counts(container))
    out = {n: max(running.get(n, 0), init_peak.get(n, 0)) for n in running.keys() | init_peak.keys()}
    return {n: c for n, c in sorted(out.items()) if c}


def pod_requests(pod: dict[str, Any]) -> dict[str, int]:
    """Extended resources a pod holds (``pod_spec_requests`` of its spec)."""
    return pod_spec_requests(pod.get("spec") or {})


_SPEC_MEMO: dict[tuple[str, str, Any], Any] = {}
_SPEC_MEMO_LIMIT = 50_000


def per_spec(obj: dict[str, Any], what: str, compute: Callable[[], T], *, version: str = "generation") -> T:
    """``compute()``, a pure function of the object's spec, remembered per (uid, generation): the API server
    bumps a custom resource's generation with every spec change, so a pass over thousands of unchanged Slices
    validates and measures each spec once, not once per pass. ``version="resourceVersion"`` for kinds whose
    generation does not cover what is computed (a pod's resources). Objects without both (the pure tests'
    dicts) are computed every time; an exception is never remembered."""
    meta = obj.get("metadata") or {}
    uid, generation = meta.get("uid"), meta.get(version)
    if not uid or generation is None or isinstance(generation, bool):
        return compute()
    key = (what, uid, generation)
    try:
        value: T = _SPEC_MEMO[key]
        return value
    except KeyError:
        pass
    value = compute()
    if len(_SPEC_MEMO) >= _SPEC_MEMO_LIMIT:
        _SPEC_MEMO.clear()
    _SPEC_MEMO[key] = value
    return value


def member_accelerators(spec: SliceSpec) -> int:
    """Accelerators one member pod of the Slice holds: countPerHost in the main container (the operator sets
    it there) plus whatever the template's other containers and init containers request of the same
    resource, counted as ``pod_spec_requests`` counts a running pod. A cpu Slice holds none."""
    if spec.accelerator.type == "cpu":
        return 0
    from tokenfleet_operator.builders.slice_pods import with_accelerator

    pod_spec = copy.deepcopy(spec.template.spec)
    containers = pod_spec.get("containers") or [{}]
    pod_spec["containers"] = containers
    with_accelerator(containers[0], spec)
    return pod_spec_requests(pod_spec).get(spec.accelerator.resource_name, 0)


def holds_capacity(pod: dict[str, Any]) -> bool:
    """A pod bound to a node and not finished holds its requests there, terminating or not."""
    return bool((pod.get("spec") or {}).get("nodeName")) and (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES


def bound_pod(pod: dict[str, Any], gang: str | None) -> BoundPod:
    return BoundPod(node=pod["spec"]["nodeName"], requests=per_spec(pod, "requests", lambda: pod_requests(pod),
                                                                    version="resourceVersion"), gang=gang)


def tolerations_of(pod_spec: dict[str, Any]) -> tuple[Toleration, ...]:
    out = []
    for t in pod_spec.get("tolerations") or []:
        out.append(Toleration(key=t.get("key") or "", operator=t.get("operator") or "Equal",
                              value=t.get("value") or "", effect=t.get("effect") or ""))
    return tuple(out)


def slice_key(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def slice_request(obj: dict[str, Any], spec: SliceSpec, created: float) -> SliceRequest:
    """The placer's view of a Slice. Raises ValueError naming the field when the
    template cannot be expressed (e.g. a malformed toleration)."""
    pod_spec = spec.template.spec
    selector = dict(pod_spec.get("nodeSelector") or {})
    selector[ACCELERATOR_NODE_LABEL] = spec.accelerator.type
    per_host = per_spec(obj, "per_host", lambda: member_accelerators(spec))
    # spec.topology describes countPerHost per host; when other containers add accelerators, only its host
    # count still holds (both forms ask the placer for the same run of consecutive host indices).
    topology = spec.topology if per_host == spec.accelerator.count_per_host or spec.topology is None else str(spec.hosts)
    return SliceRequest(
        key=slice_key(obj),
        resource=spec.accelerator.resource_name,
        per_host=per_host,
        hosts=spec.hosts,
        topology=topology,
        domain_label=spec.topology_key,
        node_selector=selector,
        tolerations=per_spec(obj, "tolerations", lambda: tolerations_of(pod_spec)),
        priority=spec.priority,
        queue=spec.queue,
        created=created,
    )


@dataclass(frozen=True)
class QueueConfig:
    """A queue as the placer sees it, plus the shell's admission-timeout settings."""

    queue: Queue
    admission_timeout: float | None = None
    requeue_base: float = DEFAULT_BASE_SECONDS
    requeue_cap: float = DEFAULT_CAP_SECONDS
    exists: bool = True  # False for the implicit default queue


def queue_from_object(obj: dict[str, Any]) -> QueueConfig:
    """A SliceQueue object -> QueueConfig. Raises ValueError naming the queue and field."""
    name = obj["metadata"]["name"]
    try:
        spec = SliceQueueSpec.model_validate(obj.get("spec") or {})
    except Exception as e:  # pydantic ValidationError
        raise ValueError(f"SliceQueue {name}: invalid spec: {e}") from None
    if spec.requeue.base_seconds > spec.requeue.max_seconds:
        raise ValueError(f"SliceQueue {name}: spec.requeue.baseSeconds must not exceed maxSeconds")
    return QueueConfig(
        queue=Queue(name=name, quota=dict(spec.quota), strategy=spec.queueing_strategy, preemption=spec.preemption),
        admission_timeout=float(spec.admission_timeout_seconds) if spec.admission_timeout_seconds else None,
        requeue_base=float(spec.requeue.base_seconds),
        requeue_cap=float(spec.requeue.max_seconds),
    )


def default_queue(resources: set[str]) -> QueueConfig:
    """The implicit queue 'default' used when no SliceQueue of that name exists: no quota limit, no timeout."""
    return QueueConfig(Queue(DEFAULT_QUEUE, {r: UNLIMITED for r in sorted(resources)}), exists=False)


def timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return parse_rfc3339(text).timestamp()
    except ValueError:
        return None


def to_rfc3339(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Timeline:
    """Where a waiting Slice stands on its admission-timeout schedule."""

    requeues: int          # timeouts so far
    queued_since: float    # start of the current wait: its place in the FIFO
    held_until: float | None = None  # set while held back after a timeout


def admission_timeline(queued_at: float, now: float, timeout: float | None,
                       base: float = DEFAULT_BASE_SECONDS, cap: float = DEFAULT_CAP_SECONDS) -> Timeline:
    """Replay the schedule wait `timeout`, hold back `requeue_delay(n)`, wait again, ...
    from `queued_at` to `now`. It depends on nothing but these numbers, so the
    scheduler needs to store no requeue state: every pass recomputes it."""
    if timeout is None or now < queued_at + timeout:
        return Timeline(0, queued_at)
    start, n = queued_at, 0
    while True:
        if now < start + timeout:
            return Timeline(n, start)
        n += 1
        delay = requeue_delay(n, base, cap)
        if now < start + timeout + delay:
            return Timeline(n, start, start + timeout + delay)
        start += timeout + delay
        if delay >= cap:  # every later period is timeout + cap long: jump over the whole ones
            skip = math.floor((now - start) / (timeout + cap))
            if skip > 0:
                start += skip * (timeout + cap)
                n += skip
