"""The operator on the real control plane, running under its own
ServiceAccount (RBAC enforced)."""
from __future__ import annotations

import json
import time

import pytest

from harness.operator_cluster import (
    Operator,
    apply,
    children,
    condition,
    expected,
    get_json,
    install,
    isvc,
    isvc_obj,
    names,
    ready_with,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def operator(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log").start()
    yield op
    op.stop()


def router_endpoints(cluster, namespace, name="svc"):
    """(pod, ready) pairs of endpoints.json in the router ConfigMap; every entry must have an IP."""
    cm = get_json(cluster, "configmap", f"{name}-router", "-n", namespace)
    entries = json.loads(cm["data"]["endpoints.json"])
    assert all(e["ip"] and e["port"] == 8000 for e in entries), entries
    return sorted((e["pod"], e["ready"]) for e in entries)


def test_lifecycle_reconcile_scale_roll_delete(cluster, namespace, operator):
    # a replica removed by a lower spec.replicas is drained first; this router is a stand-in that no one reads,
    # so the drain ends at its timeout
    apply(cluster, isvc("svc", autoscaling={"drainTimeoutSeconds": 3}), namespace)
    obj = wait_for("2 ready replicas", lambda: ready_with(cluster, namespace, "svc", 2), 120, operator)
    assert wait_for("exact children", lambda: children(cluster, namespace) == expected("svc", 2) or None, 30, operator)
    leaders = [("svc-0-0", True), ("svc-1-0", True)]  # only leaders serve; members 1 are not routed to
    wait_for("router endpoints", lambda: router_endpoints(cluster, namespace) == leaders, 30, operator)
    assert obj["status"]["url"] == f"http://svc.{namespace}.svc"
    assert obj["status"]["cost"]["dollarsPerHour"] == 2 * (2 * 2.0 + 0.5)
    assert {c["type"] for c in obj["status"]["conditions"]} >= {"Ready", "SlicesReady", "RouterReady", "Degraded"}
    gang = get_json(cluster, "slice", "svc-0", "-n", namespace)
    assert gang["status"]["phase"] == "Ready" and gang["status"]["members"] == {"desired": 2, "scheduled": 2, "ready": 2}
    assert {p["domain"] for p in gang["status"]["placement"]} <= {"kwok-block-0", "kwok-block-1"}

    # printer columns
    table = cluster.kubectl("get", "inferenceservices", "-n", namespace).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "MODEL", "ACCELERATOR", "DESIRED", "READY", "UP-TO-DATE", "$/H", "$/MTOK", "GOODPUT", "REASON", "AGE"]
    assert table.splitlines()[1].split()[:7] == ["svc", "tiny", "nvidia-h100-80gb", "2", "2", "2", "9"]
    slices = cluster.kubectl("get", "tfslice", "-n", namespace).stdout.splitlines()
    assert slices[0].split() == ["NAME", "ACCELERATOR", "TOPOLOGY", "HOSTS", "READY", "PHASE", "RESTARTS", "AGE"]
    assert slices[1].split()[:7] == ["svc-0", "nvidia-h100-80gb", "2x1", "2", "2", "Ready", "0"]

    # the operator never writes the user's spec
    obj = get_json(cluster, "inferenceservice", "svc", "-n", namespace, "--show-managed-fields")
    managers = {m["manager"]: m for m in obj["metadata"]["managedFields"]}
    assert "f:spec" not in json.dumps(managers.get("tokenfleet", {}).get("fieldsV1", {}))
    assert managers["tokenfleet"]["subresource"] == "status"

    # scale up through the scale subresource, then down
    cluster.kubectl("scale", "inferenceservice/svc", "-n", namespace, "--replicas=3")
    wait_for("3 ready replicas", lambda: ready_with(cluster, namespace, "svc", 3), 120, operator)
    assert wait_for("3 replicas' children", lambda: children(cluster, namespace) == expected("svc", 3) or None, 30, operator)
    three = [(f"svc-{i}-0", True) for i in range(3)]
    wait_for("3 router endpoints", lambda: router_endpoints(cluster, namespace) == three, 30, operator)
    cluster.kubectl("patch", "inferenceservice/svc", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":1}}')
    wait_for("1 ready replica", lambda: ready_with(cluster, namespace, "svc", 1), 120, operator)
    assert wait_for("1 replica's children", lambda: children(cluster, namespace) == expected("svc", 1) or None, 60, operator)

    # a spec change rolls the replica: new revision on the Slice and its pods
    old_rev = get_json(cluster, "slice", "svc-0", "-n", namespace)["metadata"]["labels"]["tokenfleet.dev/revision"]
    cluster.kubectl("patch", "inferenceservice/svc", "-n", namespace, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":64}}}')

    def rolled():
        s = get_json(cluster, "slice", "svc-0", "-n", namespace)
        pods = (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/slice=svc-0") or {}).get("items", [])
        new_rev = s["metadata"]["labels"]["tokenfleet.dev/revision"]
        cmd_ok = all("64" in p["spec"]["containers"][0]["command"] for p in pods) and len(pods) == 2
        return new_rev != old_rev and cmd_ok and ready_with(cluster, namespace, "svc", 1)

    wait_for("the rollout", rolled, 120, operator)

    # deletion: the garbage collector takes every child (no finalizer holds it)
    obj = isvc_obj(cluster, namespace)
    assert not obj["metadata"].get("finalizers")
    cluster.kubectl("delete", "inferenceservice/svc", "-n", namespace, "--wait=true", "--timeout=60s")
    empty = {k: [] for k in expected("svc", 0)}
    wait_for("children garbage-collected", lambda: children(cluster, namespace) == empty or None, 120, operator)


def test_invalid_semantics_show_up_as_a_condition(cluster, namespace, operator):
    bad = isvc("bad", accelerator={"type": "nvidia-h100-80gb", "countPerHost": 1, "hostsPerReplica": 2, "topology": "4x4"})
    apply(cluster, bad, namespace)
    ready = wait_for("Ready=False TopologyMismatch",
                     lambda: condition(isvc_obj(cluster, namespace, "bad"), "Ready").get("reason") == "TopologyMismatch", 60, operator)
    assert ready
    c = condition(isvc_obj(cluster, namespace, "bad"), "Ready")
    assert c["status"] == "False" and "spec.accelerator.topology" in c["message"]
    assert names(cluster, "slices", namespace) == []
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=bad").stdout
    assert "TopologyMismatch" in events
    # a missing model PVC is a condition too, and resolves once the PVC exists
    apply(cluster, isvc("pvc", model={"pvc": {"claimName": "weights"}, "servedModelNames": ["m"]}), namespace)
    wait_for("ModelSourceNotFound",
             lambda: condition(isvc_obj(cluster, namespace, "pvc"), "Ready").get("reason") == "ModelSourceNotFound", 60, operator)


def test_gang_restarts_when_a_member_is_deleted(cluster, namespace, operator):
    apply(cluster, isvc("svc", replicas=1), namespace)
    wait_for("ready", lambda: ready_with(cluster, namespace, "svc", 1), 120, operator)
    cluster.kubectl("delete", "pod", "svc-0-1", "-n", namespace, "--wait=false")

    def restarted():
        s = get_json(cluster, "slice", "svc-0", "-n", namespace)
        pods = (get_json(cluster, "pods", "-n", namespace, "-l", "tokenfleet.dev/slice=svc-0") or {}).get("items", [])
        attempts = {p["metadata"]["labels"]["tokenfleet.dev/attempt"] for p in pods}
        return (s["status"].get("restarts") == 1 and s["status"]["phase"] == "Ready" and attempts == {"1"} and len(pods) == 2) and s

    s = wait_for("a whole-gang restart", restarted, 120, operator)
    assert s["status"]["lastRestart"]["reason"] in ("MemberDeleted", "MemberLost")
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=svc-0").stdout
    assert "GangRestart" in events


# Each step of a replica's creation, as the writes that make it (RBAC's verb and resource), and the how-manieth
# such write the operator dies right after (issue 37, defect 11: a kill could leave a Slice without its member).
# "create" makes a new service of 3 replicas; "change" scales a ready one from 2 to 3 and changes its engine, so
# every Slice is made again at a new revision. One step per kind of partial state: a second write of a kind
# the list already has (a second Slice, pod or decision) leaves the same kind of state behind, and each case
# costs CI about 30 s.
KILL_STEPS = [
    ("create", "apply slices 1"),               # the first Slice exists, nothing else
    ("create", "create pods 1"),                # a Slice with one of its two members
    ("create", "apply slices/status 1"),
    ("create", "create pods/binding 1"),        # a gang half bound
    ("create", "create pods/binding 2"),        # a gang bound, its decision not written
    ("create", "patch slices 1"),               # the first decision written
    ("create", "apply inferenceservices/status 1"),
    ("change", "apply slices 1"),               # the first Slice at the new revision, its pods still the old ones
    ("change", "delete pods 1"),                # an old member deleted, its partner not
    ("change", "create pods/binding 1"),
]


@pytest.mark.parametrize("scenario, step", KILL_STEPS, ids=[f"{c}-{s.replace(' ', '-')}" for c, s in KILL_STEPS])
def test_killing_the_operator_at_each_step_converges_without_duplicates(cluster, namespace, tmp_path, scenario, step):
    install(cluster)
    fast = ("--lease-seconds=3",)             # the next leader takes over about 4 s after the kill
    if scenario == "change":
        apply(cluster, isvc("svc", replicas=2), namespace)
        first = Operator(cluster, namespace, tmp_path / "first.log", extra=fast).start()
        try:
            wait_for("2 ready replicas", lambda: ready_with(cluster, namespace, "svc", 2), 120, first)
        finally:
            first.stop()
        apply(cluster, isvc("svc", replicas=3, engine={"maxNumSeqs": 128}), namespace)
    else:
        apply(cluster, isvc("svc", replicas=3), namespace)
    killed = Operator(cluster, namespace, tmp_path / "killed.log", extra=fast,
                      env={"TOKENFLEET_EXIT_AFTER": step}).start()
    try:
        assert killed.proc is not None and killed.proc.wait(timeout=120) == 137, killed.log()
    finally:
        killed.kill()
    second = Operator(cluster, namespace, tmp_path / "second.log", extra=fast).start()
    try:
        wait_for("3 ready replicas", lambda: ready_with(cluster, namespace, "svc", 3), 120, second)
        assert wait_for("exact children", lambda: children(cluster, namespace) == expected("svc", 3) or None, 30, second)
        time.sleep(3)  # a few more resyncs must not add anything
        assert children(cluster, namespace) == expected("svc", 3)
        for s in names(cluster, "slices", namespace):
            assert get_json(cluster, "slice", s, "-n", namespace)["status"]["restarts"] == 0
    finally:
        second.stop()
