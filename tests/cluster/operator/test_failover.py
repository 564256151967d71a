"""Two operator replicas on the real control plane: one leads (holds the Lease), the other stands by. The
leader is SIGKILLed in the middle of a scale-up; the standby takes over within 15 s and finishes the job, with
no duplicate or orphaned children, and only one replica ever binds pods."""
from __future__ import annotations

import time

import pytest

from harness.operator_cluster import (
    OPERATOR_NAMESPACE,
    Operator,
    apply,
    children,
    expected,
    get_json,
    install,
    isvc,
    names,
    ready_with,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def binds(op: Operator) -> float:
    """Gangs this replica has bound (its tokenfleet_gang_binds_total{result="bound"})."""
    for line in op.metrics().splitlines():
        if line.startswith('tokenfleet_gang_binds_total{result="bound"}'):
            return float(line.split()[-1])
    return 0.0


def test_the_standby_takes_over_a_scale_up_when_the_leader_is_killed(cluster, namespace, tmp_path):
    install(cluster)
    a = Operator(cluster, namespace, tmp_path / "a.log", identity="op-a").start()
    b = Operator(cluster, namespace, tmp_path / "b.log", identity="op-b").start()
    try:
        leader = wait_for("a leader", lambda: a if a.is_leader() else b if b.is_leader() else None, 60, a)
        standby = b if leader is a else a
        apply(cluster, isvc("svc", replicas=2), namespace)
        wait_for("2 ready replicas", lambda: ready_with(cluster, namespace, "svc", 2), 120, leader)
        assert not standby.is_leader() and binds(standby) == 0 and binds(leader) == 2

        cluster.kubectl("scale", "inferenceservice/svc", "-n", namespace, "--replicas=6")
        # kill the leader once the scale-up is under way: some new Slices exist, not all are Ready yet
        wait_for("the scale-up under way", lambda: len(names(cluster, "slices", namespace)) > 2, 60, leader)
        assert binds(standby) == 0                       # the standby never bound anything while it stood by
        leader.kill()
        killed = time.monotonic()
        wait_for("the standby to lead", standby.is_leader, 30, standby)
        takeover = time.monotonic() - killed
        assert takeover < 15, f"the standby took {takeover:.1f} s to take over"

        wait_for("6 ready replicas", lambda: ready_with(cluster, namespace, "svc", 6), 180, standby)
        assert wait_for("exact children", lambda: children(cluster, namespace) == expected("svc", 6) or None, 30, standby)
        time.sleep(3)                                    # resyncs of the new leader add nothing
        assert children(cluster, namespace) == expected("svc", 6)
        for s in names(cluster, "slices", namespace):
            assert get_json(cluster, "slice", s, "-n", namespace)["status"]["restarts"] == 0
        # every member pod is bound once, and none was bound by two replicas (a second bind of a bound pod
        # fails with 409, which would have rolled its gang back and shown as a BindFailed event)
        events = cluster.kubectl("get", "events", "-n", namespace, "-o", "name", "--field-selector",
                                 "reason=BindFailed").stdout.strip()
        assert events == ""
        lease = get_json(cluster, "lease", f"tokenfleet-operator-{namespace}", "-n", OPERATOR_NAMESPACE)
        assert lease["spec"]["holderIdentity"] == standby.identity and lease["spec"]["leaseTransitions"] >= 1
    finally:
        a.stop()
        b.stop()


def test_an_operator_whose_lease_namespace_is_missing_exits_saying_what_to_do(cluster, namespace, tmp_path):
    """Issue 37, defect 10: it used to warn every 2 s and never reconcile. As the operator's ServiceAccount the
    API server answers 403 (RBAC is checked before the namespace), so the operator looks the namespace up."""
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "op.log", extra=("--lease-namespace=no-such-namespace",)).start()
    try:
        assert op.proc is not None
        code = op.proc.wait(timeout=60)
        log = op.log()
        assert code == 2, log
        assert "error: the leader Lease's namespace 'no-such-namespace' does not exist" in log
        assert "kubectl create namespace no-such-namespace" in log and "--no-leader-election" in log
    finally:
        op.kill()
