"""Leader election over a Lease store with the API server's optimistic concurrency (a 409 on a stale
resourceVersion): one leader at a time, takeover only after the lease expired on the standby's own clock,
a leader that cannot renew stops before anyone may take over."""
from __future__ import annotations

import copy

import pytest

from tokenfleet_operator.controller.leader import ElectionConfig, LeaderElector, LeaseNamespaceMissing
from tokenfleet_operator.kube import KubeError


class LeaseStore:
    """The one Lease object, as the API server keeps it (the elector's only dependency)."""

    def __init__(self):
        self.obj, self.rv, self.down = None, 0, False
        self.namespace_exists, self.rbac = True, True    # the Lease's namespace; a Role that lets us at Leases

    def get(self, api_version, kind, namespace, name):
        if self.down:
            raise KubeError(0, "connection refused")
        if kind == "Namespace":
            return {"metadata": {"name": name}} if self.namespace_exists else None
        if not self.rbac:                                  # the API server checks RBAC before the namespace
            raise KubeError(403, "leases is forbidden")
        return copy.deepcopy(self.obj) if self.namespace_exists else None

    def create(self, manifest):
        if self.down:
            raise KubeError(0, "connection refused")
        if not self.rbac:
            raise KubeError(403, "leases is forbidden")
        if not self.namespace_exists:
            raise KubeError(404, 'namespaces "ns" not found', reason="NotFound")
        if self.obj is not None:
            return None
        self.rv += 1
        self.obj = copy.deepcopy(manifest) | {"metadata": {**manifest["metadata"], "resourceVersion": str(self.rv)}}
        return self.obj

    def replace(self, manifest):
        if self.down:
            raise KubeError(0, "connection refused")
        if manifest["metadata"].get("resourceVersion") != str(self.rv):
            raise KubeError(409, "conflict")
        self.rv += 1
        self.obj = copy.deepcopy(manifest)
        self.obj["metadata"]["resourceVersion"] = str(self.rv)
        return self.obj

    @property
    def holder(self):
        return (self.obj or {}).get("spec", {}).get("holderIdentity")


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def elector(store, name, clock, events):
    cfg = ElectionConfig("ns", "lease", name, lease_seconds=10, renew_deadline=7, retry_period=2)
    return LeaderElector(store, cfg, on_started=lambda: events.append(("start", name)),
                         on_stopped=lambda: events.append(("stop", name)), clock=clock, wall_clock=clock)


def test_one_leader_and_a_standby_takes_over_only_after_the_lease_expires():
    store, clock, events = LeaseStore(), Clock(), []
    a, b = elector(store, "a", clock, events), elector(store, "b", clock, events)
    assert a.try_acquire_or_renew() and store.holder == "a"
    assert not b.try_acquire_or_renew()                    # b sees a's fresh lease
    for _ in range(4):                                     # a renews every 2 s; b keeps seeing new records
        clock.t += 2
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    # a dies: b has seen no change for the lease duration only after 10 s on its own clock
    clock.t += 9
    assert not b.try_acquire_or_renew()
    clock.t += 2
    assert b.try_acquire_or_renew() and store.holder == "b"
    assert store.obj["spec"]["leaseTransitions"] == 1


def test_clock_skew_between_replicas_does_not_matter():
    store, events = LeaseStore(), []
    a = elector(store, "a", Clock(1000.0), events)
    b_clock = Clock(999_999.0)                             # b's wall clock is days ahead
    b = elector(store, "b", b_clock, events)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()                    # the renewTime looks ancient to b, but b just saw it change
    b_clock.t += 5
    assert not b.try_acquire_or_renew()


def test_a_leader_that_cannot_renew_stops_before_the_lease_can_expire():
    store, clock, events = LeaseStore(), Clock(), []
    a = elector(store, "a", clock, events)
    a.step()
    renewed = clock.t
    assert a.leading and events == [("start", "a")]
    store.down = True                                      # the API server is unreachable from a
    lost_at = None
    for _ in range(20):
        clock.t += 1
        a.step()
        if not a.leading:
            lost_at = clock.t
            break
    assert events == [("start", "a"), ("stop", "a")]
    # it kept leading through short outages, and stopped before a standby could take the lease
    assert a.config.renew_deadline < lost_at - renewed < a.config.lease_seconds


def test_release_lets_the_standby_take_over_at_once():
    store, clock, events = LeaseStore(), Clock(), []
    a, b = elector(store, "a", clock, events), elector(store, "b", clock, events)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.leading = True
    a.release()
    clock.t += 2
    assert b.try_acquire_or_renew() and store.holder == "b"


def test_two_replicas_racing_for_a_free_lease_never_both_win():
    store, clock, events = LeaseStore(), Clock(), []
    a, b = elector(store, "a", clock, events), elector(store, "b", clock, events)
    assert a.try_acquire_or_renew()
    a.leading = True
    a.release()
    # both read the released lease, then both try to write it
    lease_seen = store.get(None, None, None, None)
    wins = []
    for e in (a, b):
        try:
            store.replace(e._lease_body(lease_seen))
            wins.append(e.config.identity)
        except KubeError as err:
            assert err.status == 409
    assert len(wins) == 1


@pytest.mark.parametrize("rbac", [True, False], ids=["admin", "operator-role"])
def test_a_missing_lease_namespace_is_an_error_that_says_what_to_do(rbac):
    """Issue 37, defect 10: an operator whose Lease namespace does not exist warned every 2 s and never led."""
    store, clock, events = LeaseStore(), Clock(), []
    store.namespace_exists, store.rbac = False, rbac
    a = elector(store, "a", clock, events)
    with pytest.raises(LeaseNamespaceMissing) as missing:
        a.step()
    message = str(missing.value)
    assert "'ns' does not exist" in message and "kubectl create namespace ns" in message
    assert "--lease-namespace" in message and "--no-leader-election" in message
    assert not a.leading and events == []


def test_no_right_to_leases_in_an_existing_namespace_is_retried_not_fatal():
    store, clock, events = LeaseStore(), Clock(), []
    store.rbac = False
    a = elector(store, "a", clock, events)
    a.step()                                               # a warning; the Role may be applied in a moment
    store.rbac = True
    a.step()
    assert a.leading and events == [("start", "a")]


def test_a_lease_namespace_deleted_under_a_standby_stops_it():
    store, clock, events = LeaseStore(), Clock(), []
    a, b = elector(store, "a", clock, events), elector(store, "b", clock, events)
    a.step()
    store.namespace_exists = False                         # the namespace goes, with the Lease in it
    b.start()
    b._thread.join(timeout=5)
    assert not b._thread.is_alive() and events == [("start", "a"), ("stop", "b")]
