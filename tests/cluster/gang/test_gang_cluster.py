"""Gang scheduling on the real control plane (KWOK nodes, RBAC enforced).

Each test adds its own nodes with an accelerator type no other test uses, so
its Slices see only that capacity, and deletes them afterwards.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tokenfleet_dev.localcluster.nodes import NodePool

from harness.operator_cluster import FAKE_IMAGE, Operator, apply, condition, get_json, install, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def gang_install(cluster):
    install(cluster)
    cluster.kubectl("wait", "--for=condition=Established", "crd/slicequeues.tokenfleet.dev", "--timeout=60s")


@pytest.fixture
def pool(cluster):
    """Two 8-GPU nodes in one block, of an accelerator type private to the test."""
    tag = f"g{uuid.uuid4().hex[:6]}"
    names = cluster.add_nodes([NodePool(count=2, per_node=8, nodes_per_block=2, prefix=tag, accelerator_type=f"gang-{tag}")])
    yield {"accel": f"gang-{tag}", "nodes": names, "block": f"{tag}-block-0"}
    cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


@pytest.fixture
def operator(cluster, namespace, gang_install, tmp_path):
    # the batch test's checkpoint store is a host path under tmp_path: the administrator's opt-in allows it
    op = Operator(cluster, namespace, tmp_path / "operator.log", extra=("--allow-host-path", str(tmp_path))).start()
    yield op
    op.stop()


def gang(name: str, accel: str, *, hosts: int = 2, per_host: int = 8, priority: int = 0, queue: str = "default") -> dict:
    return {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice", "metadata": {"name": name},
        "spec": {
            "accelerator": {"type": accel, "resourceName": "nvidia.com/gpu", "countPerHost": per_host},
            "hosts": hosts, "topologyKey": "tokenfleet.dev/block", "priority": priority, "queue": queue,
            "template": {"spec": {"containers": [{"name": "main", "image": FAKE_IMAGE}]}},
            "restartPolicy": {"backoffSeconds": 1},
        },
    }


def members(cluster, namespace: str, name: str) -> list[dict]:
    return (get_json(cluster, "pods", "-n", namespace, "-l", f"tokenfleet.dev/slice={name}") or {}).get("items", [])


def bound(pods: list[dict]) -> list[dict]:
    return [p for p in pods if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]


def slice_obj(cluster, namespace, name):
    return get_json(cluster, "slice", name, "-n", namespace)


def phase_is(cluster, namespace, name, phase):
    obj = slice_obj(cluster, namespace, name)
    return obj if ((obj or {}).get("status") or {}).get("phase") == phase else None


def test_slice_that_cannot_fit_binds_no_pod_and_says_why(cluster, namespace, pool, operator):
    apply(cluster, gang("big", pool["accel"], hosts=3), namespace)
    obj = wait_for("a reason on Admitted", lambda: condition(slice_obj(cluster, namespace, "big"), "Admitted").get("reason")
                   == "DomainTooSmall" and slice_obj(cluster, namespace, "big"), 60, operator)
    message = condition(obj, "Admitted")["message"]
    assert "needs 24 × nvidia.com/gpu (3 hosts × 8)" in message and "only 2 matching hosts" in message, message
    assert obj["status"]["phase"] == "Pending" and obj["status"]["admission"]["queuedAt"]
    assert condition(obj, "Ready")["reason"] == "DomainTooSmall"
    # the members exist for the gang scheduler, and none is bound, now or a few passes later
    pods = wait_for("3 unbound members", lambda: len(members(cluster, namespace, "big")) == 3
                    and members(cluster, namespace, "big"), 30, operator)
    assert all(p["spec"]["schedulerName"] == "tokenfleet" for p in pods)
    for _ in range(6):
        assert bound(members(cluster, namespace, "big")) == []
        time.sleep(1)
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=big",
                             "-o", "jsonpath={.items[*].reason}").stdout.split()
    assert "Waiting" in events
    wide = cluster.kubectl("get", "tfslice", "big", "-n", namespace, "-o", "wide").stdout
    assert "Pending" in wide and "DomainTooSmall" in wide


def test_two_competing_slices_are_never_both_partial(cluster, namespace, pool, operator):
    # Both want the whole block (2 hosts × 8); only one can have it.
    apply(cluster, gang("one", pool["accel"]), namespace)
    apply(cluster, gang("two", pool["accel"]), namespace)
    deadline = time.monotonic() + 45
    winner = None
    while time.monotonic() < deadline:
        pods = {n: bound(members(cluster, namespace, n)) for n in ("one", "two")}
        holding = [n for n, p in pods.items() if p]
        assert len(holding) <= 1, f"both Slices hold capacity: {pods}"
        per_node: dict[str, int] = {}
        for p in pods["one"] + pods["two"]:
            per_node[p["spec"]["nodeName"]] = per_node.get(p["spec"]["nodeName"], 0) + 8
        assert all(v <= 8 for v in per_node.values()), per_node
        ready = [n for n in ("one", "two") if phase_is(cluster, namespace, n, "Ready")]
        if ready:
            winner = ready[0]
            break
        time.sleep(0.3)
    assert winner, f"no Slice became Ready\n{operator.log()}"
    loser = "two" if winner == "one" else "one"
    assert len(bound(members(cluster, namespace, winner))) == 2
    assert {p["spec"]["nodeName"] for p in bound(members(cluster, namespace, winner))} == set(pool["nodes"])
    obj = wait_for("the loser waits with a reason", lambda: condition(slice_obj(cluster, namespace, loser), "Admitted")
                   .get("reason") == "InsufficientCapacity" and slice_obj(cluster, namespace, loser), 30, operator)
    assert obj["status"]["phase"] == "Pending" and bound(members(cluster, namespace, loser)) == []
    assert "needs 16 × nvidia.com/gpu (2 hosts × 8)" in condition(obj, "Admitted")["message"]
    placed = slice_obj(cluster, namespace, winner)
    assert condition(placed, "Admitted")["reason"] == "Placed"
    assert {m["domain"] for m in placed["status"]["placement"]} == {pool["block"]}
    assert placed["status"]["admission"]["admittedAt"] and placed["status"]["admission"]["waitSeconds"] >= 0


def test_freed_capacity_admits_the_next_slice_in_priority_order(cluster, namespace, pool, operator):
    apply(cluster, gang("first", pool["accel"]), namespace)
    wait_for("first Ready", lambda: phase_is(cluster, namespace, "first", "Ready"), 60, operator)
    apply(cluster, gang("low", pool["accel"], priority=0), namespace)
    time.sleep(1.5)  # low is older than high
    apply(cluster, gang("high", pool["accel"], priority=10), namespace)
    for name in ("low", "high"):
        wait_for(f"{name} waiting", lambda name=name: condition(slice_obj(cluster, namespace, name), "Admitted").get("reason")
                 == "InsufficientCapacity", 30, operator)
    cluster.kubectl("delete", "slice", "first", "-n", namespace)
    wait_for("high Ready", lambda: phase_is(cluster, namespace, "high", "Ready"), 60, operator)
    assert bound(members(cluster, namespace, "low")) == []
    assert phase_is(cluster, namespace, "low", "Pending")
    cluster.kubectl("delete", "slice", "high", "-n", namespace)
    wait_for("low Ready", lambda: phase_is(cluster, namespace, "low", "Ready"), 60, operator)


def test_pods_the_operator_does_not_watch_still_hold_their_accelerators(cluster, namespace, pool, operator):
    """The pass reads tokenfleet's pods from the watch cache and lists the rest from the API server's watch
    cache (resourceVersion=0): a plain pod anywhere, and a tokenfleet-labelled pod in a namespace this operator
    does not serve, each holding one node's 8 GPUs, keep a 2-node gang out until they are gone."""
    other = f"hogs-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", other)

    def hog(name, node, labels):
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": FAKE_IMAGE, "resources": {
                    "requests": {"nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}}]}}
    try:
        for name, node, labels in (("plain", pool["nodes"][0], {}),
                                   ("elsewhere", pool["nodes"][1], {"app.kubernetes.io/managed-by": "tokenfleet"})):
            apply(cluster, hog(name, node, labels), other)
        apply(cluster, gang("blocked", pool["accel"]), namespace)
        wait_for("the gang waits for capacity", lambda: condition(slice_obj(cluster, namespace, "blocked"), "Admitted")
                 .get("reason") == "InsufficientCapacity", 60, operator)
        cluster.kubectl("delete", "pod", "plain", "-n", other, "--grace-period=0", "--force")
        for _ in range(4):          # one node free is not enough for two members
            assert bound(members(cluster, namespace, "blocked")) == []
            time.sleep(1)
        cluster.kubectl("delete", "pod", "elsewhere", "-n", other, "--grace-period=0", "--force")
        wait_for("the gang placed once both are gone", lambda: phase_is(cluster, namespace, "blocked", "Ready"), 60, operator)
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_operator_metrics_report_admission_wait_pending_and_pass_duration(cluster, namespace, pool, operator):
    import urllib.request

    apply(cluster, gang("m", pool["accel"]), namespace)
    apply(cluster, gang("wait", pool["accel"], hosts=3), namespace)
    wait_for("m Ready", lambda: phase_is(cluster, namespace, "m", "Ready"), 60, operator)

    def scrape():
        with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    text = wait_for("metrics", lambda: 'tokenfleet_slices_pending{queue="default"} 1.0' in scrape() and scrape(), 30, operator)
    assert 'tokenfleet_slice_admission_wait_seconds_count{queue="default"}' in text
    assert 'tokenfleet_placement_duration_seconds_count{stage="total"}' in text
    assert 'tokenfleet_gang_binds_total{result="bound"}' in text


def test_queue_quota_and_missing_queue(cluster, namespace, pool, operator):
    qname = f"q-{namespace}"
    cluster.kubectl("apply", "-f", "-", input=(
        "apiVersion: tokenfleet.dev/v1alpha1\nkind: SliceQueue\n"
        f"metadata: {{name: {qname}}}\nspec: {{quota: {{nvidia.com/gpu: 8}}}}\n"))
    try:
        apply(cluster, gang("fits", pool["accel"], hosts=1, queue=qname), namespace)
        apply(cluster, gang("over", pool["accel"], hosts=1, queue=qname), namespace)
        apply(cluster, gang("lost", pool["accel"], hosts=1, queue="no-such-queue"), namespace)
        wait_for("fits Ready", lambda: phase_is(cluster, namespace, "fits", "Ready"), 60, operator)
        over = wait_for("quota reason", lambda: condition(slice_obj(cluster, namespace, "over"), "Admitted").get("reason")
                        == "QuotaExceeded" and slice_obj(cluster, namespace, "over"), 30, operator)
        assert f"queue {qname} has 8 of its quota of 8 in use, 0 left" in condition(over, "Admitted")["message"]
        wait_for("missing queue reason", lambda: condition(slice_obj(cluster, namespace, "lost"), "Admitted").get("reason")
                 == "QueueNotFound", 30, operator)
        status = wait_for("queue status", lambda: (get_json(cluster, "slicequeue", qname) or {}).get("status", {})
                          .get("admittedSlices") == 1 and get_json(cluster, "slicequeue", qname)["status"], 30, operator)
        assert {k: status.get(k) for k in ("pendingSlices", "admittedSlices", "usage")} == \
            {"pendingSlices": 1, "admittedSlices": 1, "usage": {"nvidia.com/gpu": 8}}
        assert status["observedGeneration"] == 1 and condition({"status": status}, "Ready")["status"] == "True"
        # validation by the API server
        bad = cluster.kubectl("apply", "-f", "-", check=False, input=(
            "apiVersion: tokenfleet.dev/v1alpha1\nkind: SliceQueue\nmetadata: {name: bad-q}\n"
            "spec: {quota: {nvidia.com/gpu: -1}, requeue: {baseSeconds: 100, maxSeconds: 10}}\n"))
        assert bad.returncode != 0 and "quota" in bad.stderr and "baseSeconds must not exceed maxSeconds" in bad.stderr
    finally:
        cluster.kubectl("delete", "slicequeue", qname, "--wait=false", check=False)


def test_a_failed_bind_rolls_the_whole_slice_back_in_the_same_pass(cluster, namespace, pool, gang_install):
    """The scheduler runs in-process with a hook that binds member 1 elsewhere
    between plan and bind, so the scheduler's own bind of member 1 fails."""
    from kubernetes import config as kconfig

    from tokenfleet_operator.controller.manager import Manager
    from tokenfleet_operator.gang.decision import GangDecision
    from tokenfleet_operator.gang.scheduler import GangScheduler
    from tokenfleet_operator.kube import Kube
    from tokenfleet_operator.reconcile.slice import reconcile_slice

    kube = Kube(kconfig.new_client_from_config(str(cluster.kubeconfig)))
    interfered = []

    def steal(bind, pod, node):
        if pod.name.endswith("-1") and not interfered:
            other = next(n for n in pool["nodes"] if n != node)
            kube.bind(namespace, pod.name, other, uid=pod.uid)  # someone else binds it first
            interfered.append(pod.name)

    scheduler = GangScheduler(kube, [namespace], before_bind=steal)
    apply(cluster, gang("rb", pool["accel"]), namespace)

    # the operator's Slice reconcile, in-process, over a cache listed afresh before each pass
    manager = Manager(kube, {"Slice": reconcile_slice}, gang_pass=lambda: 5.0, namespaces=[namespace])

    def reconcile():
        manager.prime()
        manager.process(("Slice", namespace, "rb"))

    reconcile()
    assert len(members(cluster, namespace, "rb")) == 2 and bound(members(cluster, namespace, "rb")) == []
    plan = scheduler.run_pass()
    assert [b.slice_key for b in plan.binds] == [f"{namespace}/rb"] and interfered == ["rb-1"]
    # Right after the pass: member 0 was bound, member 1's bind failed, and every member is being deleted.
    assert bound(members(cluster, namespace, "rb")) == [], members(cluster, namespace, "rb")
    assert GangDecision.from_object(slice_obj(cluster, namespace, "rb")).reason == "BindFailed"
    reconcile()
    obj = slice_obj(cluster, namespace, "rb")
    assert condition(obj, "Admitted")["reason"] == "BindFailed" and obj["status"]["restarts"] == 0
    assert "deleted all 2 members (1 already bound)" in condition(obj, "Admitted")["message"]

    # The gang is made again and placed whole on the next pass.
    def placed():
        reconcile()
        if len(members(cluster, namespace, "rb")) == 2 and not any(
                p["metadata"].get("deletionTimestamp") for p in members(cluster, namespace, "rb")):
            scheduler.run_pass()
        return len(bound(members(cluster, namespace, "rb"))) == 2

    wait_for("the gang bound whole", placed, 60)
    reconcile()
    obj = slice_obj(cluster, namespace, "rb")
    assert condition(obj, "Admitted")["reason"] == "Placed" and obj["status"]["restarts"] == 0


def test_a_partly_bound_slice_found_by_the_operator_is_rolled_back(cluster, namespace, pool, operator):
    """A Slice left half-bound (an operator that died mid-bind, or a bind by
    someone else) is rolled back by the next pass."""
    from kubernetes import config as kconfig

    from tokenfleet_operator.kube import Kube

    apply(cluster, gang("half", pool["accel"], hosts=3), namespace)  # cannot fit: stays unbound
    wait_for("3 members", lambda: len(members(cluster, namespace, "half")) == 3, 60, operator)
    pod = members(cluster, namespace, "half")[0]
    Kube(kconfig.new_client_from_config(str(cluster.kubeconfig))).bind(
        namespace, pod["metadata"]["name"], pool["nodes"][0], uid=pod["metadata"]["uid"])
    wait_for("the bound member deleted", lambda: not any(
        p["metadata"]["uid"] == pod["metadata"]["uid"] and not p["metadata"].get("deletionTimestamp")
        for p in members(cluster, namespace, "half")), 30, operator)
    # the pass records its Event right after the deletion: wait for it rather than race it
    wait_for("the GangRolledBack event", lambda: "GangRolledBack" in cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=half",
        "-o", "jsonpath={.items[*].reason}").stdout.split(), 30, operator)
    assert slice_obj(cluster, namespace, "half")["status"]["restarts"] == 0


# ---------------------------------------------------------------- checkpointed batch gang

def _member_pid(input_path: Path, member: int, attempt: int) -> int | None:
    """The local process of one member of the batch job that reads ``input_path``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(input_path).encode() not in (proc / "cmdline").read_bytes():
                continue
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if env.get(b"TOKENFLEET_MEMBER_INDEX") == str(member).encode() and env.get(b"TOKENFLEET_ATTEMPT") == str(attempt).encode():
            return int(proc.name)
    return None


def test_a_batch_gang_resumes_from_its_checkpoint_when_a_member_dies(cluster, namespace, pool, operator, tmp_path):
    """Member 1 is SIGKILLed after the first commit. The whole gang restarts, resumes after the latest
    commit (not from the start), finishes, and the job's results hold every item exactly once, with the
    tokens the engine gives for them."""
    import json
    import os
    import signal

    from tokenfleet_serving.batch.checkpoint_store import CheckpointStore
    from tokenfleet_serving.engine import LLMEngine, SamplingParams
    from tokenfleet_serving.testing_models import create_random_checkpoint

    model = create_random_checkpoint(tmp_path / "tiny", max_position_embeddings=512)
    prompts = [f"batch item {i} about {i * 13}" for i in range(40)]
    inp = tmp_path / "items.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": 32}) + "\n" for i, p in enumerate(prompts)))
    store_dir = tmp_path / "ck"
    manifest = gang("job", pool["accel"], hosts=2, per_host=4)
    spec = manifest["spec"]
    spec |= {"role": "batch", "checkpoint": {"store": f"hostpath://{store_dir}"},
             "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 1}}
    spec["template"]["spec"] = {"containers": [{
        "name": "main", "image": "tokenfleet/serving:test",
        "command": ["tokenfleet", "batch", "--model", str(model), "--input", str(inp), "--items-per-round", "1",
                    "--host", "0.0.0.0", "--port", "8000", "--num-threads", "1", "--kv-cache-mb", "32",
                    "--dtype", "float32"],   # token equality is an fp32 property
        "ports": [{"name": "metrics", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    }]}
    apply(cluster, manifest, namespace)
    store = CheckpointStore(store_dir)
    wait_for("member 1's process", lambda: _member_pid(inp, 1, 0), 120, operator)
    deadline = time.monotonic() + 120
    while not (store_dir.exists() and store.latest()) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(_member_pid(inp, 1, 0), signal.SIGKILL)
    killed_after = store.latest()
    assert not killed_after.finished

    done = wait_for("Succeeded", lambda: phase_is(cluster, namespace, "job", "Succeeded"), 240, operator)
    status = done["status"]
    assert status["restarts"] == 1 and status["lastRestart"]["reason"] == "MemberFailed"
    assert condition(done, "Complete")["status"] == "True"
    assert status["members"]["succeeded"] == 2
    head = store.latest()
    assert head.finished and status["checkpoint"]["latest"] == head.id and status["checkpoint"]["restoredAt"]
    chain = store.chain(head)
    runs = [c.run for c in chain]
    # rounds up to the kill were committed by attempt 0 and kept; attempt 1 resumed after them
    assert runs[0].endswith("-a0-scratch") and runs[-1].split("-a")[1].startswith("1-")
    resumed_at = next(i for i, r in enumerate(runs) if r != runs[0])
    assert resumed_at >= killed_after.round

    result = [json.loads(line) for line in (store_dir / "RESULT.jsonl").read_text().splitlines()]
    assert [r["id"] for r in result] == [f"q{i}" for i in range(40)]
    engine = LLMEngine.from_pretrained(model, dtype="float32", device="cpu", kv_cache_bytes=64 * 2**20)
    expected = engine.generate([engine.tokenizer.encode(p) for p in prompts],
                               SamplingParams(max_tokens=32, temperature=0.0))
    assert [r["token_ids"] for r in result] == [e.new_token_ids for e in expected]
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=job").stdout
    assert "GangRestart" in events and "Completed" in events
