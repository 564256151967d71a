"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Every replica of the operator watches and caches; only the holder of the Lease works its queues. The holder
renews the Lease every ``retry_period``; a replica that cannot renew within ``renew_deadline`` stops leading
at once (the operator process exits and Kubernetes restarts it), well before the others may take over. A
standby takes the Lease once it has seen no renewal for ``lease_seconds``: it measures that on its own clock,
from the moment it last saw the Lease's record change, so clocks that differ between nodes do not matter.
A replica that stops on purpose releases the Lease, so a standby takes over at its next try.

With the defaults (10 s lease, 7 s renew deadline, 2 s retry) a standby leads at most about 12 s after the
leader's last renewal.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenfleet_operator.kube import Kube, KubeError

log = logging.getLogger("tokenfleet.leader")

LEASE_API = "coordination.k8s.io/v1"


def _micro_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseNamespaceMissing(RuntimeError):
    """The Lease's namespace does not exist: no replica can ever lead, so the operator exits and says what to do
    (as controller-runtime does for a leader-election namespace it cannot use)."""

    def __init__(self, namespace: str):
        super().__init__(
            f"the leader Lease's namespace {namespace!r} does not exist, so this operator can never lead: create it "
            f"(kubectl create namespace {namespace}, or apply manifests/base), or pass --lease-namespace with an "
            "existing namespace, or --no-leader-election (a single replica only)")
        self.namespace = namespace


@dataclass(frozen=True)
class ElectionConfig:
    namespace: str
    name: str = "tokenfleet-operator"
    identity: str = ""
    lease_seconds: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs an identity (the pod name)")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_seconds:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration")


class LeaderElector:
    def __init__(self, kube: Kube, config: ElectionConfig, *, on_started: Callable[[], None],
                 on_stopped: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.kube, self.config = kube, config
        self.on_started, self.on_stopped = on_started, on_stopped
        self.clock, self.wall_clock = clock, wall_clock
        self.leading = False
        self.transitions = 0
        self._observed_record: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- one try ------------------------------------------------------------------
    def _lease_body(self, old: dict[str, Any] | None) -> dict[str, Any]:
        c, now = self.config, _micro_time(self.wall_clock())
        spec = dict((old or {}).get("spec") or {})
        taking = spec.get("holderIdentity") != c.identity
        spec.update(holderIdentity=c.identity, leaseDurationSeconds=int(c.lease_seconds), renewTime=now)
        if taking:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if old else 0)
        meta: dict[str, Any] = {"name": c.name, "namespace": c.namespace}
        if old is not None:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        return {"apiVersion": LEASE_API, "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True if this replica holds the Lease afterwards. Raises LeaseNamespaceMissing when the
        Lease's namespace does not exist."""
        c = self.config
        now = self.clock()
        try:
            lease = self.kube.get(LEASE_API, "Lease", c.namespace, c.name)
            created = self.kube.create(self._lease_body(None)) if lease is None else None
        except KubeError as e:
            # 404 on a create: the namespace is missing; 403: RBAC is checked first, so it may be missing too
            if e.status in (403, 404) and self._namespace_missing():
                raise LeaseNamespaceMissing(c.namespace) from e
            raise
        if lease is None:
            return created is not None
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed_record:
            self._observed_record, self._observed_at = record, now
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or c.lease_seconds)
        if holder and holder != c.identity and now < self._observed_at + duration:
            return False                     # someone else holds a lease that has not expired
        try:
            self.kube.replace(self._lease_body(lease))
        except KubeError as e:
            if e.status == 409:              # another replica wrote it first
                return False
            raise
        return True

    def _namespace_missing(self) -> bool:
        try:
            return self.kube.get("v1", "Namespace", None, self.config.namespace) is None
        except KubeError:
            return False                     # cannot tell (no right to read namespaces): keep trying

    def release(self) -> None:
        """Give the Lease up (a clean stop), so a standby need not wait for it to expire."""
        c = self.config
        try:
            lease = self.kube.get(LEASE_API, "Lease", c.namespace, c.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == c.identity:
                body = self._lease_body(lease)
                body["spec"].update(holderIdentity="", renewTime=_micro_time(self.wall_clock() - 3600))
                self.kube.replace(body)
        except KubeError as e:
            log.warning("could not release the leader Lease: %s", e)

    # ---- the loop -----------------------------------------------------------------
    def step(self) -> None:
        """One round: try to acquire or renew, and start or stop leading accordingly. Raises
        LeaseNamespaceMissing, which no later round can mend."""
        c = self.config
        try:
            held = self.try_acquire_or_renew()
        except KubeError as e:
            log.warning("leader election: %s", e)
            held = False
        now = self.clock()
        if held:
            self._last_renew = now
            if not self.leading:
                self.leading = True
                self.transitions += 1
                log.info("%s is the leader now (Lease %s/%s)", c.identity, c.namespace, c.name)
                self.on_started()
        elif self.leading and now - self._last_renew > c.renew_deadline:
            self.leading = False
            log.error("%s could not renew the leader Lease for %.1f s: stopping", c.identity, now - self._last_renew)
            self.on_stopped()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except LeaseNamespaceMissing as e:       # deleted after the start: no replica can lead any more
                log.critical("%s", e)
                self.leading = False
                self.on_stopped()
                return
            self._stop.wait(self.config.retry_period)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenfleet-leader-election", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        if release and self.leading:
            self.leading = False
            self.release()
