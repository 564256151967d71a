"""What the operator measures from pods, read off the reconcile path on its own timer.

Reconciles never wait on a pod: they read the collector's latest values. The collector has its own work
queue and two workers; each tracked object is one item, read every ``period`` seconds:

- an InferenceService: its router pods' metrics (``contract.router_metrics``), combined into one reading and
  kept as a ten-minute history: the replicas' load and KV usage, the requests and tokens that met the SLO,
  the tokens delivered (the denominator of the cost per token), held requests. A service scaled to zero is
  read every ``fast_period`` seconds, so that a held request brings a replica up quickly;
- a batch Slice with checkpoints: the checkpoint its leader reports while it runs;
- an InferenceService with spec.adapters: also each ready serving replica's adapters (loaded, refused, their
  tokens; ``pod_metrics.adapters_from_metrics``), read in the same pass.

When a value changes, the owner is queued for a reconcile (``on_change``), which writes it into status. A
target that cannot be read is retried with a doubling delay (up to 5 minutes), so unreachable pods cost
little. Only the leader replica collects.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator import conditions as cond
from tokenfleet_operator import metrics
from tokenfleet_operator.autoscale.measure import KEEP_S, Entry, ReadingHistory, combine
from tokenfleet_operator.controller.cache import ObjectCache
from tokenfleet_operator.controller.triggers import Key
from tokenfleet_operator.controller.workqueue import WorkQueue
from tokenfleet_operator.naming import LEADER_LABEL, ROLE_LABEL, ROUTER_PORT, SERVICE_LABEL, SLICE_LABEL
from tokenfleet_operator.pod_metrics import ReplicaAdapters, adapters_from_metrics, checkpoint_from_metrics, fetch, metrics_url
from tokenfleet_serving.contract.router_metrics import RouterReading

log = logging.getLogger("tokenfleet.collector")

MAX_BACKOFF = 300.0


def _pods(cache: ObjectCache, namespace: str, service: str, role: str) -> list[dict[str, Any]]:
    return [p for p in cache.by_label("Pod", namespace, SERVICE_LABEL, service)
            if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == role and (p.get("status") or {}).get("podIP")
            and cond.is_ready(p) and not p["metadata"].get("deletionTimestamp")]


def router_metrics_urls(cache: ObjectCache, namespace: str, service: str) -> list[str]:
    """The /metrics URLs of a service's ready router pods."""
    return [f"http://{p['status']['podIP']}:{ROUTER_PORT}/metrics" for p in _pods(cache, namespace, service, "router")]


def routers_started(cache: ObjectCache, namespace: str, service: str, first: Entry) -> Entry | None:
    """A reading of zeros when the oldest ready router started, if that is less than ``KEEP_S`` before the first
    reading: a router's counters start at zero with its process, so what it counted before the operator first
    read it (the first requests after the service came up, or all since a failover of the operator) belongs
    to the window between its start and that reading, not before it."""
    starts = []
    for pod in _pods(cache, namespace, service, "router"):
        try:
            starts.append(dt.datetime.fromisoformat(pod["status"]["startTime"].replace("Z", "+00:00")).timestamp())
        except (KeyError, TypeError, ValueError, AttributeError):
            return None                       # a router whose start is unknown: no baseline to assume
    if not starts or not 0 < first.wall - min(starts) < KEEP_S:
        return None
    age = first.wall - min(starts)
    return Entry(first.at - age, first.wall - age, RouterReading(), 0, baseline=True)


def ready_serving_pods(cache: ObjectCache, namespace: str, service: str) -> set[str]:
    """The service's ready serving (leader) pods: the replicas the router may send requests to."""
    return {p["metadata"]["name"] for p in _pods(cache, namespace, service, "serve")
            if (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"}


def leader_pod(cache: ObjectCache, namespace: str, slice_name: str) -> dict[str, Any] | None:
    leaders = [p for p in cache.by_label("Pod", namespace, SLICE_LABEL, slice_name)
               if (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"
               and not p["metadata"].get("deletionTimestamp")]
    return leaders[0] if len(leaders) == 1 else None


@dataclass(frozen=True)
class AdapterReadings:
    """The LoRA adapters each ready serving replica of a service reports; ``changed_at`` moves only when what
    they report changed (the reconcile's fingerprint reads it)."""

    replicas: tuple[tuple[str, ReplicaAdapters], ...]    # serving pod name -> its report
    changed_at: float


class Collector:
    def __init__(self, cache: ObjectCache, *, on_change: Callable[[Key], None], period: float = 10.0,
                 fast_period: float = 1.0, checkpoint_period: float = 5.0, timeout: float = 0.5, workers: int = 2):
        self.cache, self.on_change = cache, on_change
        self.period, self.fast_period = period, fast_period
        self.checkpoint_period, self.timeout = checkpoint_period, timeout
        self.queue = WorkQueue("collector", base_delay=period, max_delay=MAX_BACKOFF)
        self._workers = workers
        self._lock = threading.Lock()
        self._values: dict[Key, Any] = {}
        self._adapters: dict[Key, AdapterReadings] = {}
        self._tracked: set[Key] = set()
        self._threads: list[threading.Thread] = []

    # ---- what reconciles read ---------------------------------------------------------
    def router_history(self, namespace: str, service: str) -> ReadingHistory | None:
        with self._lock:
            return self._values.get(("InferenceService", namespace, service))

    def checkpoint(self, namespace: str, slice_name: str) -> dict[str, str] | None:
        with self._lock:
            return self._values.get(("Slice", namespace, slice_name))

    def adapter_readings(self, namespace: str, service: str) -> AdapterReadings | None:
        with self._lock:
            return self._adapters.get(("InferenceService", namespace, service))

    # ---- what is read -----------------------------------------------------------------
    def track(self, key: Key) -> None:
        """Start reading for this InferenceService or batch Slice (once; later calls do nothing)."""
        with self._lock:
            if key in self._tracked:
                return
            self._tracked.add(key)
        self.queue.add(key)

    def _untrack(self, key: Key) -> None:
        with self._lock:
            self._tracked.discard(key)
            self._values.pop(key, None)
            self._adapters.pop(key, None)

    def collect(self, key: Key) -> float | None:
        """Read one target now and store what it says; returns the delay until the next read (None: stop)."""
        kind, namespace, name = key
        assert namespace is not None
        started = time.perf_counter()
        if kind == "InferenceService":
            service = self.cache.get("InferenceService", namespace, name)
            if service is None:
                return None
            reached = self._read_routers(key, namespace, name)
            if (service.get("spec") or {}).get("adapters") is not None:
                self._read_adapters(key, namespace, name)
            scaled_to_zero = (service.get("status") or {}).get("desiredReplicas") == 0
            metrics.COLLECT_SECONDS.labels(kind=kind).observe(time.perf_counter() - started)
            if not reached:
                return -1.0
            self.queue.forget(key)
            return self.fast_period if scaled_to_zero else self.period
        obj = self.cache.get("Slice", namespace, name)
        if obj is None or (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None
        value, reached = self._checkpoint(namespace, name)
        metrics.COLLECT_SECONDS.labels(kind=kind).observe(time.perf_counter() - started)
        with self._lock:
            old = self._values.get(key)
            if value is not None:
                self._values[key] = value
        if value is not None and old != value:
            self.on_change(key)
        if reached:
            self.queue.forget(key)
            return self.checkpoint_period
        return -1.0                           # unreachable: back off

    def _read_routers(self, key: Key, namespace: str, service: str) -> bool:
        """Read every ready router pod of the service and add the combined reading to its history; False when
        none could be read. The owner is queued when the reading moved."""
        urls = router_metrics_urls(self.cache, namespace, service)
        readings = [r for r in (RouterReading.from_text(t) for t in (fetch(u, self.timeout) for u in urls)
                                if t is not None) if r is not None]
        if not readings:
            return not urls               # no ready router: nothing to read, and no failure either
        entry = Entry(time.monotonic(), time.time(), combine(readings), len(ready_serving_pods(self.cache, namespace, service)))
        with self._lock:
            history = self._values.setdefault(key, ReadingHistory())
            before = history.latest
            if before is None and (start := routers_started(self.cache, namespace, service, entry)) is not None:
                history.add(start)
            history.add(entry)
        if before is None or _moved(before.reading, entry.reading) or before.ready_replicas != entry.ready_replicas:
            self.on_change(key)
        return True

    def _read_adapters(self, key: Key, namespace: str, service: str) -> None:
        """Read what each ready serving replica says about its adapters; the owner is queued when that
        changed. A replica that cannot be read keeps its last report until it is no longer ready."""
        pods = [p for p in _pods(self.cache, namespace, service, "serve")
                if (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"]
        with self._lock:
            before = self._adapters.get(key)
        old = dict(before.replicas) if before is not None else {}
        now: dict[str, ReplicaAdapters] = {}
        for pod in pods:
            url, name = metrics_url(pod), pod["metadata"]["name"]
            text = fetch(url, self.timeout) if url else None
            if text is not None:
                now[name] = adapters_from_metrics(text)
            elif name in old:
                now[name] = old[name]
        replicas = tuple(sorted(now.items()))
        if before is not None and before.replicas == replicas:
            return
        with self._lock:
            self._adapters[key] = AdapterReadings(replicas, time.monotonic())
        self.on_change(key)

    def _checkpoint(self, namespace: str, slice_name: str) -> tuple[dict[str, str] | None, bool]:
        pod = leader_pod(self.cache, namespace, slice_name)
        url = metrics_url(pod) if pod is not None else None
        if url is None:
            return None, True                 # nothing running to read yet: not a failure
        text = fetch(url, self.timeout)
        return (checkpoint_from_metrics(text) if text is not None else None), text is not None

    # ---- the loop ---------------------------------------------------------------------
    def _read(self, key: Key) -> None:
        """Read one target and schedule its next read."""
        try:
            delay = self.collect(key)
        except Exception:          # noqa: BLE001 - a reading must never stop the collector
            log.exception("collecting %s failed", key)
            delay = -1.0
        if delay is None:
            self._untrack(key)
        elif delay < 0:
            self.queue.add_rate_limited(key)
        else:
            self.queue.add_after(key, delay)

    def _work(self) -> None:
        self.queue.work(self._read)

    def start(self) -> None:
        for i in range(self._workers):
            t = threading.Thread(target=self._work, name=f"tokenfleet-collector-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self.queue.shutdown()
        for t in self._threads:
            t.join(timeout=5)


def _moved(old: RouterReading, new: RouterReading) -> bool:
    """Worth a look by the owner: traffic flowed, requests wait, or a replica's load or drain changed."""
    return (old.output_tokens != new.output_tokens or old.slo_requests != new.slo_requests or new.pending > 0
            or old.pending != new.pending or old.backend_load != new.backend_load
            or old.backend_inflight != new.backend_inflight or old.backend_draining != new.backend_draining)
