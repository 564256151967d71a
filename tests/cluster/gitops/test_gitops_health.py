"""What GitOps tools read from tokenfleet's objects on the real plane: kstatus (Flux, kpt) through the real
library, Argo CD's health.lua, `kubectl wait`, and that a sync applying the same manifests again changes nothing
and starts no reconcile loop.

One InferenceService (and its Slice, and a SliceQueue) is taken through the states a pipeline sees: new (the
operator has not seen it), progressing (waiting for capacity), ready, degraded (a replica restarting) and failed
(a replica that spent its restart budget). A TokenRoute is seen new, ready (over that service, whose router pod
KWOK marks Ready like the route's own) and degraded (a route naming a missing target: Stalled). With
TOKENFLEET_CAPTURE_ARGO_TESTDATA=1 the objects are written to the health checks' testdata (manifests/argocd/...),
which health_test.yaml and the unit tests read.
"""
from __future__ import annotations

import copy
import os
import re
import time
import uuid

import pytest
import yaml

from tokenfleet_dev.localcluster.nodes import NodePool

from harness import kstatus
from harness.argo_health import CUSTOMIZATIONS, health
from harness.operator_cluster import FAKE_IMAGE, Operator, condition, get_json, install, wait_for

pytestmark = [pytest.mark.slow]

CAPTURE = os.environ.get("TOKENFLEET_CAPTURE_ARGO_TESTDATA") == "1"
SYNC_MANAGER = "argocd-controller"     # the field manager of a GitOps sync (Argo CD's; Flux uses kustomize-controller)
PLURAL = {"InferenceService": "inferenceservice", "Slice": "slice", "SliceQueue": "slicequeue",
          "TokenRoute": "tokenroute"}


def service(name: str, accel: str, *, max_restarts: int, backoff: int) -> dict:
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"path": "/models/tiny", "servedModelNames": ["tiny"]}, "replicas": 1,
                     "accelerator": {"type": accel, "countPerHost": 1, "hostsPerReplica": 1, "topology": "1"},
                     "image": FAKE_IMAGE, "price": {"acceleratorPerHour": 2.0, "overheadPerHour": 0.5},
                     "slicePolicy": {"topologyKey": "tokenfleet.dev/block",
                                     "restartPolicy": {"maxRestarts": max_restarts, "backoffSeconds": backoff,
                                                       "maxBackoffSeconds": max(backoff, 300)}}}}


def token_route(name: str, *targets: str) -> dict:
    return {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "TokenRoute", "metadata": {"name": name},
            "spec": {"model": "chat", "targets": [{"inferenceService": t} for t in targets]}}


def sync(cluster, manifest: dict, namespace: str | None) -> str:
    """A GitOps sync: server-side apply of the manifest under the sync's field manager. Returns resourceVersion."""
    args = ["apply", "--server-side", f"--field-manager={SYNC_MANAGER}", "-f", "-", "-o", "jsonpath={.metadata.resourceVersion}"]
    if namespace:
        args[1:1] = ["-n", namespace]
    return cluster.kubectl(*args, input=yaml.safe_dump(manifest)).stdout


class Observer:
    """Reads objects, asks kstatus and the Argo CD health check about them, and captures them as testdata."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.namespace, self.seen = cluster, namespace, []

    def look(self, kind: str, name: str, state: str, want_kstatus: str, want_argo: str) -> dict:
        args = [PLURAL[kind], name] + ([] if kind == "SliceQueue" else ["-n", self.namespace])
        obj = get_json(self.cluster, *args)
        ks, argo = kstatus.compute(obj), health(kind, obj)
        self.seen.append((kind, state, ks["status"], argo["status"]))
        assert (ks["status"], argo["status"]) == (want_kstatus, want_argo), (kind, name, state, ks, argo, obj.get("status"))
        if CAPTURE:
            self._capture(kind, state, obj, argo)
        return obj

    def _capture(self, kind: str, state: str, obj: dict, argo: dict) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"].pop("managedFields", None)
        text = yaml.safe_dump(obj, sort_keys=False).replace(self.namespace, "demo")
        folder = CUSTOMIZATIONS / "tokenfleet.dev" / kind
        (folder / "testdata" / f"{state}.yaml").write_text(text)
        test_file = folder / "health_test.yaml"
        tests = yaml.safe_load(test_file.read_text())["tests"] if test_file.exists() else []
        tests = [t for t in tests if t["inputPath"] != f"testdata/{state}.yaml"]
        tests.append({"healthStatus": {"status": argo["status"], "message": argo["message"].replace(self.namespace, "demo")},
                      "inputPath": f"testdata/{state}.yaml"})
        test_file.write_text(yaml.safe_dump({"tests": tests}, sort_keys=False, width=200))


def reconciles(op: Operator) -> dict[str, float]:
    """tokenfleet_reconcile_total of the InferenceService and Slice kinds, summed over results."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^tokenfleet_reconcile_total\{kind="(\w+)",result="\w+"\} ([0-9.e+]+)$', op.metrics(), re.M):
        if m.group(1) in ("InferenceService", "Slice"):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def settled(op: Operator, quiet_s: float = 3.0) -> dict[str, float]:
    """Wait until the work queue is empty and no InferenceService or Slice pass ran for quiet_s seconds."""
    def still():
        before = reconciles(op)
        time.sleep(quiet_s)
        after = reconciles(op)
        return after if after == before and "tokenfleet_workqueue_depth 0.0" in op.metrics() else None
    return wait_for("the operator to settle", still, 90, op)


def test_gitops_tools_read_each_state_and_a_repeated_sync_changes_nothing(cluster, namespace, tmp_path):
    install(cluster)
    tag = f"g{uuid.uuid4().hex[:6]}"
    accel = f"gitops-{tag}"
    nodes = cluster.add_nodes([NodePool(count=2, per_node=8, nodes_per_block=2, prefix=tag, accelerator_type=accel)])
    queue = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "SliceQueue", "metadata": {"name": f"q-{tag}"},
             "spec": {"quota": {"nvidia.com/gpu": 8}}}
    svc = service("svc", accel, max_restarts=1, backoff=1)
    deg = service("deg", accel, max_restarts=2, backoff=3600)
    waiting = service("wait", f"none-{tag}", max_restarts=1, backoff=1)    # no node has this accelerator
    route = token_route("chat", "svc")
    broken = token_route("broken", "svc", "missing")                          # no InferenceService "missing"
    see = Observer(cluster, namespace)
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--resync-seconds=3600",))
    try:
        # new: the operator has not seen the objects yet
        for manifest in (svc, deg, waiting, route, broken):
            sync(cluster, manifest, namespace)
        sync(cluster, queue, None)
        see.look("InferenceService", "svc", "new", "InProgress", "Progressing")
        see.look("SliceQueue", queue["metadata"]["name"], "new", "InProgress", "Progressing")
        see.look("TokenRoute", "chat", "new", "InProgress", "Progressing")

        op.start()
        waited = cluster.kubectl("wait", "--for=condition=Ready", "inferenceservice/svc", "inferenceservice/deg",
                                 "-n", namespace, "--timeout=180s", check=False, timeout=200)
        assert waited.returncode == 0, waited.stderr + op.log()
        not_ready = cluster.kubectl("wait", "--for=condition=Ready", "inferenceservice/wait", "-n", namespace,
                                    "--timeout=3s", check=False)
        assert not_ready.returncode != 0 and "timed out" in not_ready.stderr

        # progressing: waiting for capacity that does not exist
        wait_for("wait's Slice pending", lambda: (get_json(cluster, "slice", "wait-0", "-n", namespace) or {})
                 .get("status", {}).get("phase") == "Pending", 60, op)
        see.look("InferenceService", "wait", "progressing", "InProgress", "Progressing")
        see.look("Slice", "wait-0", "progressing", "InProgress", "Progressing")
        # ready
        see.look("InferenceService", "svc", "ready", "Current", "Healthy")
        see.look("Slice", "svc-0", "ready", "Current", "Healthy")
        wait_for("the queue's status", lambda: (get_json(cluster, "slicequeue", queue["metadata"]["name"]) or {})
                 .get("status", {}).get("observedGeneration") == 1, 60, op)
        see.look("SliceQueue", queue["metadata"]["name"], "ready", "Current", "Healthy")
        # a route over svc is Ready once its own router pod and svc's router pod are; one naming a missing
        # target is Stalled (only a person helps), whatever its other target does
        waited = cluster.kubectl("wait", "--for=condition=Ready", "tokenroute/chat", "-n", namespace,
                                 "--timeout=60s", check=False, timeout=80)
        assert waited.returncode == 0, waited.stderr + op.log()
        see.look("TokenRoute", "chat", "ready", "Current", "Healthy")
        wait_for("broken stalled", lambda: condition(get_json(cluster, "tokenroute", "broken", "-n", namespace),
                                                     "Stalled").get("status") == "True", 30, op)
        obj = see.look("TokenRoute", "broken", "degraded", "Failed", "Degraded")
        assert "InferenceService missing does not exist" in condition(obj, "TargetsResolved")["message"]

        # a GitOps sync of the same manifests changes nothing and starts no reconcile
        before = settled(op)
        manifests = [(svc, namespace), (deg, namespace), (waiting, namespace), (route, namespace), (queue, None)]
        versions = [sync(cluster, m, ns) for m, ns in manifests]
        for _ in range(2):
            assert [sync(cluster, m, ns) for m, ns in manifests] == versions
        time.sleep(8)                               # longer than a gang pass (5 s) and a collector period
        assert reconciles(op) == before
        rv = versions[0]
        assert get_json(cluster, "inferenceservice", "svc", "-n", namespace)["metadata"]["resourceVersion"] == rv
        # ... while a real change is reconciled, once, and then the operator is quiet again
        changed = copy.deepcopy(svc)
        changed["metadata"]["labels"] = {"team": "research"}
        assert sync(cluster, changed, namespace) != rv
        after = settled(op)
        assert after["InferenceService"] > before["InferenceService"]
        time.sleep(5)
        assert reconciles(op) == after

        # degraded: a replica lost its member and waits out its restart backoff (an hour)
        cluster.kubectl("delete", "pod", "deg-0-0", "-n", namespace, "--wait=false")
        wait_for("deg-0 restarting", lambda: (get_json(cluster, "slice", "deg-0", "-n", namespace) or {})
                 .get("status", {}).get("phase") == "Restarting", 60, op)
        wait_for("deg degraded", lambda: condition(get_json(cluster, "inferenceservice", "deg", "-n", namespace),
                                                   "Degraded").get("status") == "True", 60, op)
        see.look("InferenceService", "deg", "degraded", "InProgress", "Degraded")
        see.look("Slice", "deg-0", "degraded", "InProgress", "Degraded")

        # failed: svc's replica fails twice; its budget is one restart
        cluster.kubectl("delete", "pod", "svc-0-0", "-n", namespace, "--wait=false")
        wait_for("svc-0 restarted and ready", lambda: (s := (get_json(cluster, "slice", "svc-0", "-n", namespace) or {})
                                                      .get("status", {})).get("restarts") == 1 and s.get("phase") == "Ready",
                 120, op)
        cluster.kubectl("delete", "pod", "svc-0-0", "-n", namespace, "--wait=false")
        wait_for("svc-0 failed", lambda: (get_json(cluster, "slice", "svc-0", "-n", namespace) or {})
                 .get("status", {}).get("phase") == "Failed", 120, op)
        wait_for("svc stalled", lambda: condition(get_json(cluster, "inferenceservice", "svc", "-n", namespace),
                                                  "Stalled").get("status") == "True", 60, op)
        see.look("InferenceService", "svc", "failed", "Failed", "Degraded")
        see.look("Slice", "svc-0", "failed", "Failed", "Degraded")
        failed_wait = cluster.kubectl("wait", "--for=condition=Ready", "inferenceservice/svc", "-n", namespace,
                                      "--timeout=2s", check=False)
        assert failed_wait.returncode != 0
    finally:
        op.stop()
        cluster.kubectl("delete", "node", *nodes, "--wait=false", check=False)
        cluster.kubectl("delete", "slicequeue", queue["metadata"]["name"], "--wait=false", check=False)
