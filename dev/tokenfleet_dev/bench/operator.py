"""``tokenfleet bench operator``: the operator at scale, on a real local control plane.

Starts a fresh local plane with KWOK GPU nodes, installs the CRDs and the
operator's RBAC, runs ``tokenfleet operator`` under its ServiceAccount, creates
``--services`` InferenceServices of 1-4 replicas at once (seeded) and measures
the operator as a black box: from outside (readiness of every service through
a watch, its process's RSS and CPU in /proc) and through its Prometheus metrics
(reconciles, reconcile durations, API requests, reconciles per object).

Phases, in order:

1. **ramp**: create every service; wait until all are Ready (condition
   Ready=True and status.observedGeneration current, all at the same time).
2. **settle** (``--settle-seconds``), then **idle** (``--idle-seconds``): nothing
   changes; the operator's CPU, reconciles (its resyncs) and API requests.
3. **trigger** (``--trigger-seconds``): two kinds of change, each made once
   on a few services (``--touched`` each): an annotation, and a spec change
   that alters no child (``spec.rollout.maxUnavailable`` 1 -> 2). The
   reconciles of those services and of their Slices, next to those of every
   untouched service over the same window (the difference is what one trigger
   caused; the resyncs that fall in the window hit all groups alike), and for
   the spec change the seconds until the service is Ready at its new
   generation (the window stretches, up to ``TRIGGER_MAX_SECONDS``, until every
   changed service is).
4. **waiting probe** (``--probe-seconds``): one more service whose PVC does not
   exist; its reconciles in each ``PROBE_INTERVAL`` seconds since it was
   created, so that a rate that grows while it waits shows.

Serving pods run no model: their image is not the serving image, so the local
pod runner leaves them to KWOK, which makes them Running and Ready; the router
Deployments' pods likewise. The Slices ask for GPUs, so the gang scheduler
places and binds every member (a cpu Slice would skip it and flatter the
operator); the nodes are sized so that every Slice fits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tokenfleet_dev.bench.audit_log import count_requests
from tokenfleet_dev.bench.operator_metrics import Scrape, beyond_last_bucket, histogram_quantile, parse, spread

GROUP, VERSION = "tokenfleet.dev", "v1alpha1"
SERVICE_LABEL = f"{GROUP}/inference-service"
FAKE_IMAGE = "example.invalid/fake-serving:1"  # not tokenfleet/serving*: KWOK fakes these pods Ready
NAMESPACE = "bench"
OPERATOR_USER = "system:serviceaccount:tokenfleet-system:tokenfleet-operator"
ACCELERATOR_TYPE = "nvidia-h100-80gb"
BLOCK_LABEL = "tokenfleet.dev/block"
TOUCH_ANNOTATION = "bench.tokenfleet.dev/touched-at"
SPEC_CHANGE = {"spec": {"rollout": {"maxUnavailable": 2}}}  # changes the generation and no child
TRIGGER_MAX_SECONDS = 300.0
WAITING_SERVICE = "waiting-for-pvc"
PROBE_INTERVAL = 15.0
# Shapes of one replica: (weight, hosts, GPUs per host). About 2.7 GPUs per replica.
SHAPES = ((50, 1, 1), (20, 1, 2), (15, 1, 4), (5, 1, 8), (10, 2, 4))
GPUS_PER_NODE = 64
PODS_PER_NODE = 250
NODES_PER_BLOCK = 8
HEADROOM = 1.25  # spare capacity, so that no Slice waits for room
TARGETS = {"seconds_to_all_ready": 600.0, "peak_rss_mb": 300.0, "idle_cpu_cores": 0.1}


# ------------------------------------------------------------------ workload (pure)
@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    hosts: int
    per_host: int

    @property
    def gpus(self) -> int:
        return self.replicas * self.hosts * self.per_host

    @property
    def pods(self) -> int:
        return self.replicas * self.hosts + 1  # member pods and one router pod


def workload(count: int, seed: int) -> list[Workload]:
    """``count`` services: 1-4 replicas each, replica shapes drawn from SHAPES."""
    rng = random.Random(seed)
    weights = [w for w, *_ in SHAPES]
    out = []
    for i in range(count):
        _, hosts, per_host = rng.choices(SHAPES, weights)[0]
        out.append(Workload(f"svc-{i:04d}", rng.randint(1, 4), hosts, per_host))
    return out


def service_manifest(w: Workload, namespace: str, image: str = FAKE_IMAGE, pvc: str | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"pvc": {"claimName": pvc}} if pvc else {"path": "/models/bench"}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
        "metadata": {"name": w.name, "namespace": namespace},
        "spec": {
            "model": {**model, "servedModelNames": ["bench"]},
            "replicas": w.replicas,
            "accelerator": {"type": ACCELERATOR_TYPE, "resourceName": "nvidia.com/gpu", "countPerHost": w.per_host,
                            "hostsPerReplica": w.hosts, "topology": f"{w.hosts}x{w.per_host}"},
            "image": image,
            "price": {"acceleratorPerHour": 2.0, "overheadPerHour": 0.25},
            "slicePolicy": {"topologyKey": BLOCK_LABEL},
        },
    }


def node_count(services: list[Workload]) -> int:
    """KWOK nodes (GPUS_PER_NODE GPUs, PODS_PER_NODE pods each, whole blocks) with HEADROOM to spare."""
    by_gpus = sum(w.gpus for w in services) * HEADROOM / GPUS_PER_NODE
    by_pods = sum(w.pods for w in services) * HEADROOM / PODS_PER_NODE
    blocks = max(1, math.ceil(max(by_gpus, by_pods) / NODES_PER_BLOCK))
    return blocks * NODES_PER_BLOCK


def is_ready(obj: dict[str, Any]) -> bool:
    """Ready=True, computed from the current generation."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    generation = meta.get("generation")
    if status.get("observedGeneration") != generation:
        return False
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True" and c.get("observedGeneration", generation) == generation
    return False


# ------------------------------------------------------------------ the shell: samplers
class ProcessSampler:
    """Samples a process's CPU seconds and RSS from /proc every ``period`` seconds."""

    def __init__(self, pid: int, t0: float, period: float = 1.0):
        self.pid, self.t0, self.period = pid, t0, period
        self.samples: list[tuple[float, float, float]] = []  # (t, cpu seconds, rss MB)
        self.load: list[tuple[float, float]] = []            # (t, 1-minute loadavg)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime, all threads

    def _status_kb(self, key: str) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
        return 0.0

    def rss_mb(self) -> float:
        return self._status_kb("VmRSS") / 1024

    def peak_rss_mb(self) -> float:
        """The kernel's high-water mark of the RSS (VmHWM): no peak between samples is missed."""
        return self._status_kb("VmHWM") / 1024

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.cpu_seconds(), self.rss_mb()))
                self.load.append((time.monotonic() - self.t0, os.getloadavg()[0]))
            except OSError:
                return  # the process is gone
            self._stop.wait(self.period)

    def start(self) -> ProcessSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def process_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of each named process that is still alive."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds each process spent between two readings, largest first (processes in both only)."""
    spent = {name: round(after[name] - before[name], 1) for name in after if name in before}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


class ReadyWatcher:
    """Follows the InferenceServices of a namespace through a watch and records when each is
    Ready; ``wait_all`` returns once every expected one is Ready at the same time."""

    def __init__(self, kubeconfig: Path, namespace: str, expected: set[str], t0: float):
        from kubernetes import config
        self.api_client = config.new_client_from_config(str(kubeconfig))
        self.namespace, self.expected, self.t0 = namespace, expected, t0
        self.ready: dict[str, bool] = {}
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]  # (t, services Ready)
        self.first_ready: dict[str, float] = {}
        self.ready_since: dict[str, float] = {}  # the last time each became Ready
        self.events = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-watch", daemon=True)

    def _note(self, obj: dict[str, Any], deleted: bool = False) -> None:
        name = obj["metadata"]["name"]
        if name not in self.expected:
            return
        with self._cond:
            self.events += 1
            now = time.monotonic() - self.t0
            ready = is_ready(obj) and not deleted
            if self.ready.get(name) != ready:
                self.ready[name] = ready
                if ready:
                    self.first_ready.setdefault(name, now)
                    self.ready_since[name] = now
                self.timeline.append((now, self.ready_count()))
                self._cond.notify_all()

    def ready_count(self) -> int:
        return sum(1 for v in self.ready.values() if v)

    def _loop(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException
        api = client.CustomObjectsApi(self.api_client)
        args = (GROUP, VERSION, self.namespace, "inferenceservices")
        version = None
        while not self._stop.is_set():
            try:
                if version is None:
                    listed = api.list_namespaced_custom_object(*args)
                    version = listed["metadata"]["resourceVersion"]
                    for obj in listed["items"]:
                        self._note(obj)
                w = watch.Watch()
                for event in w.stream(api.list_namespaced_custom_object, *args, resource_version=version,
                                      timeout_seconds=20, allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        version = None  # expired: list again
                        break
                    version = obj["metadata"].get("resourceVersion", version)
                    if event["type"] != "BOOKMARK":
                        self._note(obj, deleted=event["type"] == "DELETED")
            except ApiException as e:
                if e.status == 410:
                    version = None
                self._stop.wait(0.5)
            except Exception:  # a dropped connection: watch again from the last version
                self._stop.wait(0.5)

    def wait_all(self, timeout: float) -> float | None:
        """Seconds since t0 when every expected service was Ready at once; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.ready_count() < len(self.expected):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))
            return self.timeline[-1][0]

    def start(self) -> ReadyWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=25)


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return parse(r.read().decode())


def hardware() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    memory_gb = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            memory_gb = round(int(f.readline().split()[1]) / 1024 ** 2, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "logical_cpus": os.cpu_count(),
            "memory_gb": memory_gb, "python": platform.python_version(), "platform": platform.platform()}


# ------------------------------------------------------------------ summary (pure)
@dataclass
class Phases:
    """Raw measurements of one run, in seconds since the services were created (t0)."""

    services: list[Workload]
    nodes: int
    create_seconds: float
    all_ready_at: float | None
    ramp: Scrape                      # metrics from t0 to all Ready (or to the timeout)
    ramp_cpu_seconds: float
    ramp_plane_cpu_seconds: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the ramp
    ramp_end: float = 0.0             # when the ramp's metrics were read
    ready_at_ramp_end: int | None = None
    idle: Scrape | None = None
    idle_window: tuple[float, float] | None = None
    idle_cpu_seconds: float | None = None
    trigger: Scrape | None = None
    trigger_window: tuple[float, float] | None = None
    touched: list[str] = field(default_factory=list)               # services annotated once each
    changed: dict[str, float] = field(default_factory=dict)        # spec changed once: service -> when (s since t0)
    observed: dict[str, float] = field(default_factory=dict)       # ... -> when it was Ready at its new generation
    slices_of: dict[str, list[str]] = field(default_factory=dict)  # service -> its Slices
    probe: Scrape | None = None
    probe_window: tuple[float, float] | None = None
    probe_intervals: list[tuple[float, float, float | None]] = field(default_factory=list)  # (from, to, reconciles)
    cpu_seconds_total: float = 0.0
    peak_rss_mb: float = 0.0
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    ready_timeline: list[tuple[float, int]] = field(default_factory=list)
    load: list[tuple[float, float]] = field(default_factory=list)
    watch_events: int = 0
    audit: dict[str, Counter] | None = None  # window name -> (verb, resource) -> requests, from the audit log
    extra: dict[str, Any] = field(default_factory=dict)

    def windows(self) -> dict[str, tuple[float, float]]:
        """The phases that happened, as [start, end) in seconds since t0."""
        out = {"ramp": (0.0, self.all_ready_at if self.all_ready_at is not None else self.ramp_end)}
        for name in ("idle", "trigger", "probe"):
            window = getattr(self, f"{name}_window")
            if window:
                out[name] = window
        return out


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _per(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _group_counts(s: Scrape, namespace: str, services: list[str], slices_of: dict[str, list[str]]) -> dict[str, Any]:
    """Mean reconciles per service of a group, and per Slice of those services, in one window."""
    slices = [n for svc in services for n in slices_of.get(svc, [])]
    out: dict[str, Any] = {"services": len(services), "slices": len(slices)}
    if s.has_objects and services:
        out["reconciles_per_service"] = round(
            sum(s.object_count("InferenceService", namespace, n) or 0 for n in services) / len(services), 3)
        out["reconciles_per_slice"] = round(
            sum(s.object_count("Slice", namespace, n) or 0 for n in slices) / len(slices), 3) if slices else None
    return out


def touched_sample(services: list[Workload], k: int) -> list[str]:
    """``k`` services spread evenly over the list (deterministic)."""
    k = max(1, min(k, len(services) - 1)) if len(services) > 1 else 1
    step = len(services) / k
    return [services[int(i * step)].name for i in range(k)]


def summarize(p: Phases, namespace: str = NAMESPACE) -> dict[str, Any]:
    """The result: the issue's fields first, then the details behind them."""
    ramp = p.ramp
    span = p.all_ready_at
    ramp_seconds = span if span is not None else p.ramp_end  # to all Ready, or to the timeout
    reconciles = ramp.total_reconciles
    result: dict[str, Any] = {
        "services": len(p.services),
        "seconds_to_all_ready": _round(span, 2),
        "reconciles_per_second": _round(_per(reconciles, ramp_seconds), 2),
        "reconcile_p50_seconds": _round(histogram_quantile(0.5, ramp.merged_buckets()), 4),
        "reconcile_p99_seconds": _round(histogram_quantile(0.99, ramp.merged_buckets()), 4),
        # True: the quantile fell in the histogram's +Inf bucket, so the value is its highest finite bound, a floor
        "reconcile_p99_beyond_histogram": beyond_last_bucket(0.99, ramp.merged_buckets()),
        "api_requests_per_reconcile": _round(_per(ramp.total_api_requests, reconciles), 2),
        "peak_rss_mb": _round(p.peak_rss_mb, 1),
        "cpu_seconds": _round(p.ramp_cpu_seconds, 2),
        "idle_cpu_cores": None,
        "hardware": {},
        "all_ready": span is not None,
        "ready_at_end_of_ramp": p.ready_at_ramp_end,
        "ramp_seconds": _round(ramp_seconds, 2),
        "replicas": sum(w.replicas for w in p.services),
        "member_pods": sum(w.replicas * w.hosts for w in p.services),
        "gpus_requested": sum(w.gpus for w in p.services),
        "nodes": p.nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "create_seconds": _round(p.create_seconds, 2),
        "reconciles": reconciles,
        "reconciles_by_kind": dict(sorted(ramp.reconciles.items())),
        "reconcile_quantiles_by_kind": {
            kind: {"p50": _round(histogram_quantile(0.5, b), 4), "p99": _round(histogram_quantile(0.99, b), 4)}
            for kind, b in sorted(ramp.buckets.items())},
        "api_requests": ramp.total_api_requests,
        "api_requests_by_verb": {f"{verb} {resource}": n for (verb, resource), n in
                                 sorted(ramp.api_requests.items(), key=lambda kv: -kv[1]) if n} if ramp.has_api_requests else None,
        "cpu_seconds_total": _round(p.cpu_seconds_total, 2),
        # every process of the plane (the operator included) in the ramp: where the two cores went
        "ramp_cpu_seconds_by_process": p.ramp_plane_cpu_seconds,
        "harness_watch_events": p.watch_events,
    }
    if ramp.has_objects:
        services = [ramp.object_count("InferenceService", namespace, w.name) or 0 for w in p.services]
        slices = [v for (kind, ns, _), v in ramp.objects.items() if kind == "Slice" and ns == namespace]
        result["ramp_reconciles_per_object"] = {"InferenceService": spread(services), "Slice": spread(slices)}
    if p.idle is not None and p.idle_window is not None and p.idle_cpu_seconds is not None:
        seconds = p.idle_window[1] - p.idle_window[0]
        idle = p.idle
        result["idle_cpu_cores"] = _round(p.idle_cpu_seconds / seconds, 4)
        block: dict[str, Any] = {
            "seconds": _round(seconds, 1), "cpu_seconds": _round(p.idle_cpu_seconds, 2),
            "reconciles": idle.total_reconciles, "reconciles_by_kind": dict(sorted(idle.reconciles.items())),
            "api_requests": idle.total_api_requests,
            "api_requests_by_verb": {f"{v} {r}": n for (v, r), n in sorted(idle.api_requests.items(), key=lambda kv: -kv[1]) if n}
            if idle.has_api_requests else None,
        }
        if idle.has_objects:
            per_minute = 60.0 / seconds
            services = [(idle.object_count("InferenceService", namespace, w.name) or 0) * per_minute for w in p.services]
            slices = [v * per_minute for (kind, ns, _), v in idle.objects.items() if kind == "Slice" and ns == namespace]
            block["reconciles_per_object_per_minute"] = {"InferenceService": spread(services), "Slice": spread(slices)}
        result["idle"] = block
    if p.trigger is not None and p.trigger_window and (p.touched or p.changed):
        untouched = [w.name for w in p.services if w.name not in set(p.touched) | set(p.changed)]
        control = _group_counts(p.trigger, namespace, untouched, p.slices_of)
        block: dict[str, Any] = {"window_seconds": _round(p.trigger_window[1] - p.trigger_window[0], 1), "untouched": control}
        for key, what, names in (("annotation", f"annotation {TOUCH_ANNOTATION} set once", p.touched),
                                 ("spec_change", "spec.rollout.maxUnavailable 1 -> 2, once (no child changes)",
                                  list(p.changed))):
            if not names:
                continue
            touched = _group_counts(p.trigger, namespace, names, p.slices_of)
            caused = None
            if p.trigger.has_objects and untouched:
                per_slice = None if touched["reconciles_per_slice"] is None or control["reconciles_per_slice"] is None \
                    else round(touched["reconciles_per_slice"] - control["reconciles_per_slice"], 3)
                caused = {"service": round(touched["reconciles_per_service"] - control["reconciles_per_service"], 3),
                          "per_slice": per_slice,
                          "slices_of_one_service": None if per_slice is None else round(per_slice * touched["slices"] / len(names), 3)}
            block[key] = {"trigger": what, "touched": touched, "caused_by_one_trigger": caused}
        if p.changed:
            delays = [p.observed[n] - t for n, t in p.changed.items() if n in p.observed]
            block["spec_change"]["seconds_to_observed"] = {
                "observed": len(delays), "of": len(p.changed),
                **({"p50": round(sorted(delays)[len(delays) // 2], 2), "max": round(max(delays), 2)} if delays else {})}
        result["reconciles_per_object_per_trigger"] = block
    if p.probe is not None and p.probe_window:
        seconds = p.probe_window[1] - p.probe_window[0]
        count = p.probe.object_count("InferenceService", namespace, WAITING_SERVICE)
        last = p.probe_intervals[-1] if p.probe_intervals else None
        result["waiting_service"] = {
            "what": "one InferenceService whose spec.model.pvc names a claim that does not exist, from its creation on",
            "window_seconds": _round(seconds, 1), "reconciles": count,
            "reconciles_per_minute": _round(_per(count * 60.0 if count is not None else None, seconds), 2),
            "reconciles_by_interval": [{"from_seconds": round(a, 1), "to_seconds": round(b, 1), "reconciles": n}
                                       for a, b, n in p.probe_intervals],
            "reconciles_per_minute_last_interval": None if last is None or last[2] is None
            else round(last[2] * 60.0 / max(last[1] - last[0], 1e-9), 2),
        }
    if p.audit is not None:
        reconciles_in = {"ramp": reconciles, "idle": p.idle.total_reconciles if p.idle else None,
                         "trigger": p.trigger.total_reconciles if p.trigger else None,
                         "probe": p.probe.total_reconciles if p.probe else None}
        result["apiserver_audit"] = {
            "what": f"requests of {OPERATOR_USER} in the API server's audit log, by when they were received "
                    "(Kopf's own patches included; open watches are counted when they end)",
            **{name: {"requests": sum(c.values()),
                      "per_reconcile": _round(_per(float(sum(c.values())), reconciles_in.get(name)), 2),
                      "by_verb": {f"{v} {r}": n for (v, r), n in sorted(c.items(), key=lambda kv: -kv[1])}}
               for name, c in p.audit.items()},
        }
    result["targets"] = {
        "seconds_to_all_ready_under_600": span is not None and span < TARGETS["seconds_to_all_ready"],
        "peak_rss_mb_under_300": p.peak_rss_mb < TARGETS["peak_rss_mb"],
        "idle_cpu_cores_under_0.1": result["idle_cpu_cores"] is not None and result["idle_cpu_cores"] < TARGETS["idle_cpu_cores"],
    }
    result["series"] = {
        "ready": [[round(t, 2), n] for t, n in p.ready_timeline],
        "operator": [[round(t, 1), round(c, 2), round(r, 1)] for t, c, r in p.samples],  # t, cpu s, rss MB
        "loadavg_1m": [[round(t, 1), round(v, 2)] for t, v in p.load[::5]],
        "phases": {"all_ready": _round(p.all_ready_at, 2), "idle": p.idle_window, "trigger": p.trigger_window,
                   "probe": p.probe_window},
    }
    result.update(p.extra)
    return result


# ------------------------------------------------------------------ the run (shell)
def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _wait_metrics(port: int, proc_alive, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc_alive():
            raise RuntimeError("the operator exited while starting; see its log")
        try:
            scrape(port)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the operator's /metrics on port {port} did not answer in {timeout:.0f}s")


def _slices_by_service(plane) -> dict[str, list[str]]:
    out = plane.kubectl("get", "slices", "-n", NAMESPACE, "-o",
                        "jsonpath={range .items[*]}{.metadata.name} {.metadata.labels." + SERVICE_LABEL.replace(".", "\\.")
                        + "}{\"\\n\"}{end}")
    by_service: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        name, _, service = line.partition(" ")
        if service:
            by_service.setdefault(service, []).append(name)
    return by_service


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenfleet_dev.localcluster.nodes import NodePool
    from tokenfleet_dev.localcluster.plane import LocalCluster, free_port, pid_alive

    source = Path(args.operator_source).resolve() if args.operator_source else Path(__file__).resolve().parents[3]
    base = Path(args.workdir or tempfile.mkdtemp(prefix="tokenfleet-bench-operator-"))
    base.mkdir(parents=True, exist_ok=True)
    services = workload(args.services, args.seed)
    nodes = node_count(services)
    load_start = os.getloadavg()
    # The kubelet's and the node controller's defaults (node Leases of 40 s, renewed every 10 s; NotReady after
    # 50 s without one), not the test plane's 8 s and 10 s: those, chosen for quick failure tests, make the
    # nodes' heartbeats most of the plane's writes and let heartbeats that lag on the loaded cores evict pods.
    plane = LocalCluster(base / "plane", pools=[], tie_to_parent=True, log=_log,
                         audit_users=None if args.no_audit else [OPERATOR_USER], node_monitor_grace="50s",
                         node_lease_seconds=40)
    sampler = watcher = None
    phases: Phases | None = None
    started = time.monotonic()
    try:
        plane.up()
        plane_seconds = time.monotonic() - started
        t = time.monotonic()
        plane.add_nodes([NodePool(count=nodes, per_node=GPUS_PER_NODE, nodes_per_block=NODES_PER_BLOCK,
                                  pods=str(PODS_PER_NODE), cpu="256", memory="2Ti", prefix="bench",
                                  accelerator_type=ACCELERATOR_TYPE)], timeout=max(120, nodes))
        nodes_seconds = time.monotonic() - t
        plane.kubectl("apply", "--server-side", "-k", str(source / "manifests" / "base"))
        for crd in ("slices", "slicequeues", "inferenceservices"):
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}.{GROUP}", "--timeout=60s")
        plane.kubectl("create", "namespace", NAMESPACE)
        kubeconfig = plane.sa_kubeconfig("tokenfleet-system", "tokenfleet-operator", duration_seconds=6 * 3600)
        port = free_port()
        env = {"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1", "KUBERNETES_SERVICE_HOST": ""}
        if args.operator_source:
            env["PYTHONPATH"] = os.pathsep.join(str(source / d) for d in ("operator", "dev", "serving-image"))
        # the routers, like the replicas, are pods KWOK fakes (an operator older than --router-image ran them
        # from the service's image, FAKE_IMAGE)
        takes_router_image = "--router-image" in (source / "operator" / "tokenfleet_operator" / "main.py").read_text()
        cmd = [sys.executable, "-m", "tokenfleet_cli", "operator", "-n", NAMESPACE,
               f"--metrics-port={port}", "--health-port=0",
               *([f"--router-image={FAKE_IMAGE}"] if takes_router_image else []), *args.operator_arg]
        pid = plane.start_process("operator", cmd, env=env)
        _log(f"operator pid {pid}: {' '.join(cmd[1:])} (log: {plane.dir / 'logs' / 'operator.log'})")
        _wait_metrics(port, lambda: pid_alive(pid))
        time.sleep(args.warmup_seconds)  # let it list and watch (not counted)

        t0, wall0 = time.monotonic(), time.time()
        sampler = ProcessSampler(pid, t0).start()
        watcher = ReadyWatcher(plane.kubeconfig, NAMESPACE, {w.name for w in services}, t0).start()
        before, cpu0 = scrape(port), sampler.cpu_seconds()
        pids = {name: proc["pid"] for name, proc in plane.state()["processes"].items()}
        plane_cpu0 = process_cpu_seconds(pids)
        text = "\n---\n".join(yaml.safe_dump(service_manifest(w, NAMESPACE)) for w in services)
        plane.kubectl("create", "-f", "-", input=text, timeout=600)
        create_seconds = time.monotonic() - t0
        _log(f"{len(services)} InferenceServices created in {create_seconds:.1f}s on {nodes} nodes; waiting for Ready")
        all_ready = watcher.wait_all(args.timeout)
        ramp_end = scrape(port)
        cpu_ready = sampler.cpu_seconds()
        plane_cpu = cpu_delta(plane_cpu0, process_cpu_seconds(pids))
        phases = Phases(services=services, nodes=nodes, create_seconds=create_seconds, all_ready_at=all_ready,
                        ramp=ramp_end - before, ramp_cpu_seconds=cpu_ready - cpu0, ramp_plane_cpu_seconds=plane_cpu,
                        ramp_end=time.monotonic() - t0,
                        ready_at_ramp_end=watcher.ready_count())
        if all_ready is None:
            _log(f"not all Ready after {args.timeout:.0f}s: {watcher.ready_count()}/{len(services)}")
        else:
            _log(f"all {len(services)} Ready after {all_ready:.1f}s; settling {args.settle_seconds:.0f}s, "
                 f"then {args.idle_seconds:.0f}s idle")
            time.sleep(args.settle_seconds)
            # idle: nothing changes; the resyncs still run
            s0 = scrape(port)
            w0, c0 = time.monotonic() - t0, sampler.cpu_seconds()
            time.sleep(args.idle_seconds)
            w1, c1 = time.monotonic() - t0, sampler.cpu_seconds()
            phases.idle, phases.idle_window, phases.idle_cpu_seconds = scrape(port) - s0, (w0, w1), c1 - c0
            # triggers: an annotation on a few services, a spec change on a few others; the rest is the control group
            sample = touched_sample(services, 2 * args.touched)
            phases.touched, changed = sample[0::2], sample[1::2]
            phases.slices_of = _slices_by_service(plane)
            s0 = scrape(port)
            w0 = time.monotonic() - t0
            if phases.touched:
                plane.kubectl("annotate", "inferenceservice", *phases.touched, "-n", NAMESPACE,
                              f"{TOUCH_ANNOTATION}={time.time():.3f}", "--overwrite")
            for name in changed:
                phases.changed[name] = time.monotonic() - t0  # when the request left: an upper bound on the delay
                plane.kubectl("patch", "inferenceservice", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(SPEC_CHANGE))
            time.sleep(args.trigger_seconds)
            deadline = time.monotonic() + TRIGGER_MAX_SECONDS - args.trigger_seconds
            while True:
                ready_since = dict(watcher.ready_since)
                phases.observed = {n: ready_since[n] for n, t in phases.changed.items()
                                   if watcher.ready.get(n) and ready_since.get(n, -1.0) > t}
                if len(phases.observed) == len(phases.changed) or time.monotonic() >= deadline:
                    break
                time.sleep(1.0)
            phases.trigger, phases.trigger_window = scrape(port) - s0, (w0, time.monotonic() - t0)
            # a service waiting for a PVC that does not exist, from its creation on
            waiting = Workload(WAITING_SERVICE, 1, 1, 1)
            first = last = scrape(port)
            w0 = time.monotonic() - t0
            plane.kubectl("create", "-f", "-", input=yaml.safe_dump(service_manifest(waiting, NAMESPACE, pvc="missing-weights")))
            end, since = w0 + args.probe_seconds, 0.0
            while (now := time.monotonic() - t0) < end - 0.5:
                time.sleep(min(PROBE_INTERVAL, end - now))
                current, until = scrape(port), time.monotonic() - t0 - w0
                count = (current - last).object_count("InferenceService", NAMESPACE, WAITING_SERVICE)
                phases.probe_intervals.append((since, until, count))
                last, since = current, until
            phases.probe, phases.probe_window = last - first, (w0, time.monotonic() - t0)
        sampler.stop()
        watcher.stop()
        watcher.timeline.append((time.monotonic() - t0, watcher.ready_count()))  # the line runs to the end
        phases.cpu_seconds_total = sampler.cpu_seconds()
        phases.peak_rss_mb = sampler.peak_rss_mb()
        phases.samples, phases.load = sampler.samples, sampler.load
        phases.ready_timeline, phases.watch_events = watcher.timeline, watcher.events
        phases.extra = {
            "seed": args.seed,
            "plane_start_seconds": round(plane_seconds, 1),
            "add_nodes_seconds": round(nodes_seconds, 1),
            "operator_command": " ".join(["tokenfleet", *cmd[3:]]),
            "operator_source": str(source),
            "workdir": str(base),
        }
        hw = {**hardware(), "loadavg_start": [round(x, 2) for x in load_start],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "loadavg_1m_max": round(max((v for _, v in sampler.load), default=0.0), 2)}
    finally:
        for helper in (sampler, watcher):
            if helper is not None:
                helper.stop()
        plane.down()
    if plane.audit_users is not None and plane.audit_log.exists():
        windows = {name: (wall0 + a, wall0 + b) for name, (a, b) in phases.windows().items()}
        with open(plane.audit_log, encoding="utf-8", errors="replace") as lines:
            phases.audit = count_requests(lines, OPERATOR_USER, windows)
    result = summarize(phases)
    result["hardware"] = hw
    return result


# ------------------------------------------------------------------ output
def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def table(result: dict[str, Any]) -> list[tuple[str, str]]:
    hw = result["hardware"]
    rows = [(k, _fmt(result.get(k))) for k in (
        "services", "replicas", "member_pods", "nodes", "seconds_to_all_ready", "ready_at_end_of_ramp", "reconciles_per_second",
        "reconcile_p50_seconds", "reconcile_p99_seconds", "api_requests_per_reconcile", "peak_rss_mb",
        "cpu_seconds", "idle_cpu_cores")]
    idle = result.get("idle") or {}
    per_object = idle.get("reconciles_per_object_per_minute") or {}
    for kind, stats in per_object.items():
        if stats:
            rows.append((f"idle reconciles/min per {kind}", f"p50 {stats['p50']:.2f}, max {stats['max']:.2f}"))
    trig = result.get("reconciles_per_object_per_trigger") or {}
    for key, label in (("annotation", "one annotation"), ("spec_change", "one spec change")):
        caused = (trig.get(key) or {}).get("caused_by_one_trigger")
        if caused:
            rows.append((f"{label}: reconciles it caused ({trig['window_seconds']:g}s)",
                         f"{caused['service']:+g} of the service, {_fmt(caused.get('slices_of_one_service'))} of its Slices"))
    observed = (trig.get("spec_change") or {}).get("seconds_to_observed")
    if observed:
        rows.append(("spec change -> Ready at the new generation (s)",
                     f"p50 {_fmt(observed.get('p50'))}, max {_fmt(observed.get('max'))} ({observed['observed']}/{observed['of']})"))
    waiting = result.get("waiting_service")
    if waiting:
        by_interval = [i["reconciles"] for i in waiting["reconciles_by_interval"]]
        rows.append(("service waiting for its PVC: reconciles/min", f"{_fmt(waiting['reconciles_per_minute'])} "
                     f"(per {PROBE_INTERVAL:g}s: {by_interval})"))
    targets = result.get("targets") or {}
    rows.append(("targets met", ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in targets.items())))
    rows.append(("hardware", f"{hw.get('cpu')}, {hw.get('cores')} cores, {hw.get('memory_gb')} GB"))
    rows.append(("loadavg start / end / max 1m", f"{hw.get('loadavg_start')} / {hw.get('loadavg_end')} / {hw.get('loadavg_1m_max')}"))
    return rows


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    ready = series["ready"]
    op = series["operator"]
    waiting = result.get("waiting_service") or {}
    intervals = waiting.get("reconciles_by_interval") or []
    fig, axes = plt.subplots(4 if intervals else 3, 1, figsize=(9, 12 if intervals else 9), sharex=True)
    axes[0].step([t for t, _ in ready], [n for _, n in ready], where="post")
    axes[0].set_ylabel("services Ready")
    axes[0].set_title(f"tokenfleet bench operator: {result['services']} InferenceServices, {result['nodes']} KWOK nodes")
    axes[1].plot([t for t, _, _ in op], [r for _, _, r in op])
    axes[1].set_ylabel("operator RSS (MB)")
    cores = [(op[i][0], (op[i][1] - op[i - 1][1]) / max(op[i][0] - op[i - 1][0], 1e-9)) for i in range(1, len(op))]
    axes[2].plot([t for t, _ in cores], [c for _, c in cores], linewidth=0.8)
    axes[2].set_ylabel("operator CPU (cores)")
    phases = series["phases"]
    if intervals:
        start = phases["probe"][0]
        axes[3].bar([start + i["from_seconds"] for i in intervals], [i["reconciles"] or 0 for i in intervals],
                    width=[i["to_seconds"] - i["from_seconds"] for i in intervals], align="edge", color="purple", alpha=0.6)
        axes[3].set_ylabel(f"reconciles of the service\nwaiting for its PVC, per {PROBE_INTERVAL:g}s", fontsize="small")
    axes[-1].set_xlabel("seconds since the services were created")
    for ax in axes:
        if phases.get("all_ready") is not None:
            ax.axvline(phases["all_ready"], color="green", linestyle="--", linewidth=0.8)
        for name, color in (("idle", "grey"), ("trigger", "orange"), ("probe", "purple")):
            if phases.get(name):
                ax.axvspan(*phases[name], color=color, alpha=0.15, label=name)
    if any(phases.get(name) for name in ("idle", "trigger", "probe")):
        axes[0].legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfleet bench operator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=1000, help="InferenceServices to create (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the services' replicas and shapes")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="draw Ready services, operator RSS and CPU over time")
    parser.add_argument("--timeout", type=float, default=1800, help="give up waiting for all Ready after this many seconds")
    parser.add_argument("--warmup-seconds", type=float, default=3, help="after /metrics answers, before creating (not counted)")
    parser.add_argument("--settle-seconds", type=float, default=20, help="after all Ready, before the idle window")
    parser.add_argument("--idle-seconds", type=float, default=60, help="the idle window (include a resync or two)")
    parser.add_argument("--trigger-seconds", type=float, default=30,
                        help="window after the triggers (longer while a changed spec is not yet observed)")
    parser.add_argument("--touched", type=int, default=10,
                        help="services annotated once each, and as many others whose spec changes once")
    parser.add_argument("--probe-seconds", type=float, default=120,
                        help=f"how long to follow the service waiting for its PVC (in {PROBE_INTERVAL:g}s intervals)")
    parser.add_argument("--workdir", help="directory for the plane and the operator log (default: a temp dir)")
    parser.add_argument("--operator-source", metavar="DIR",
                        help="a tokenfleet checkout whose operator, CRDs and RBAC to run (default: this one), "
                             "so one harness measures two versions")
    parser.add_argument("--no-audit", action="store_true",
                        help="no API server audit log (it counts every request the operator's credentials make)")
    parser.add_argument("--operator-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument for 'tokenfleet operator' (repeatable), e.g. --operator-arg=--resync-seconds=60")
    args = parser.parse_args(argv)
    if args.services < 3:
        parser.error("--services must be at least 3 (the triggers compare touched and untouched services)")
    if args.touched < 1:
        parser.error("--touched must be at least 1")
    for name in ("timeout", "idle_seconds", "trigger_seconds", "probe_seconds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("warmup_seconds", "settle_seconds"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if args.operator_source and not (Path(args.operator_source) / "operator" / "tokenfleet_cli.py").is_file():
        parser.error(f"--operator-source {args.operator_source}: no operator/tokenfleet_cli.py there")

    # `kill` runs the cleanup too: the plane's processes are stopped by pid, none is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    rows = table(result)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
            out.write("\n")
    if args.plot:
        plot(result, args.plot)
    return 0 if result["all_ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
