"""One model replica across a multi-host Slice, on the real local plane with the bundled serving image.

An InferenceService with countPerHost 2 and hostsPerReplica 2 runs one model over 4 ranks: two member pods of
two ranks each, the leader serving the API, the other member headless. The local pod runner runs the pods as
local processes, each pod limited to one core (its CPU limit) and resolving the leader's headless-Service name
as cluster DNS would."""
from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from harness.operator_cluster import Operator, apply, condition, get_json, install, isvc, isvc_obj, names, ready_with, wait_for
from harness.processes import argv, cpu_seconds, pids, process_tree

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVING_IMAGE = "tokenfleet/serving:0.1.0"
NAME = "tp"


@pytest.fixture
def operator(cluster, namespace, tmp_path):
    install(cluster)
    op = Operator(cluster, namespace, tmp_path / "operator.log", router_image=SERVING_IMAGE).start()
    yield op
    op.stop()


def parallel_isvc(model: Path, **spec):
    body = isvc(NAME, model={"path": str(model), "servedModelNames": ["tiny"]}, replicas=1, image=SERVING_IMAGE,
                accelerator={"type": "nvidia-h100-80gb", "countPerHost": 2, "hostsPerReplica": 2, "topology": "2x2"},
                engine={"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 8, "maxNumBatchedTokens": 256,
                        "extraArgs": ["--kv-cache-mb", "32"]},
                resources={"limits": {"cpu": "1"}},          # each member pod: one core for its two ranks
                price={"acceleratorPerHour": 1.5, "overheadPerHour": 0.5},
                routing={"noReplicaHoldSeconds": 240},
                slicePolicy={"topologyKey": "tokenfleet.dev/block",
                             "restartPolicy": {"maxRestarts": 5, "backoffSeconds": 0, "maxBackoffSeconds": 1}})
    body["spec"].update(spec)
    return body


def pods(cluster, namespace, selector):
    return [p for p in (get_json(cluster, "pods", "-n", namespace, "-l", selector) or {}).get("items", [])
            if not p["metadata"].get("deletionTimestamp")]


def router_url(cluster, namespace):
    ready = [p for p in pods(cluster, namespace, "tokenfleet.dev/role=router")
             if condition(p, "Ready").get("status") == "True" and p["status"].get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:8080" if ready else None


def complete(url, prompt, max_tokens=8, timeout=180):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


# ---- local processes of a pod: the runner binds the server to the pod IP; its ranks are its descendants ----
def server_pid(pod_ip: str) -> int | None:
    """The `tokenfleet serve` process of a pod: the runner rewrote its --host 0.0.0.0 to the pod's IP (a
    member's argv also holds the leader's IP, as --master-addr)."""
    for pid in pids():
        args = argv(pid)
        if "serve" in args and "--host" in args and args[args.index("--host") + 1] == pod_ip:
            return pid
    return None


def cpu_group(pid: int) -> str:
    """The process's group in the cpu controller (cgroup v1 ``cpu``/``cpu,cpuacct``, or v2's unified one)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or controllers == "":
            return path
    return "/"


def quota_cores(group: str) -> float | None:
    """The CFS quota of a group in cores (None: no quota, or no such group here)."""
    v1 = [Path(f"/sys/fs/cgroup/{d}{group}") for d in ("cpu", "cpu,cpuacct")]
    for folder in v1:
        if (folder / "cpu.cfs_quota_us").exists():
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            return None if quota < 0 else quota / int((folder / "cpu.cfs_period_us").read_text())
    v2 = Path(f"/sys/fs/cgroup{group}/cpu.max")
    if v2.exists():
        quota, period = v2.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    return None


def test_a_two_host_replica_is_ready_serves_through_the_router_and_every_member_computes(
        cluster, namespace, operator, pod_model):
    apply(cluster, parallel_isvc(pod_model), namespace)
    obj = wait_for("the 4-rank replica Ready", lambda: ready_with(cluster, namespace, NAME, 1), 420, operator)

    # one replica: a Slice of two members, the rendezvous Service, the leader the only endpoint
    assert obj["status"]["cost"]["dollarsPerHour"] == 4 * 1.5 + 0.5          # every accelerator billed, as before
    assert obj["status"]["modelShape"]["attentionHeads"] == 4                 # read before the replica started
    service = get_json(cluster, "service", f"{NAME}-0", "-n", namespace)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["ownerReferences"][0]["kind"] == "Slice"
    members = {p["metadata"]["name"]: p for p in pods(cluster, namespace, f"tokenfleet.dev/slice={NAME}-0")}
    assert sorted(members) == [f"{NAME}-0-0", f"{NAME}-0-1"]
    for pod in members.values():
        assert pod["spec"]["subdomain"] == f"{NAME}-0" and pod["spec"]["hostname"] == pod["metadata"]["name"]
    endpoints = json.loads(get_json(cluster, "configmap", f"{NAME}-router", "-n", namespace)["data"]["endpoints.json"])
    assert [e["pod"] for e in endpoints] == [f"{NAME}-0-0"]
    assert names(cluster, "pods", namespace, "tokenfleet.dev/role=model-shape") == []    # read, then deleted

    url = wait_for("the router routes", lambda: router_url(cluster, namespace), 120, operator)
    wait_for("a first completion", lambda: complete(url, "hello there")["choices"][0]["text"], 240, operator)

    leader = server_pid(members[f"{NAME}-0-0"]["status"]["podIP"])
    member = server_pid(members[f"{NAME}-0-1"]["status"]["podIP"])
    assert leader and member
    trees = {"leader": process_tree(leader), "member": process_tree(member)}
    assert len(trees["member"]) >= 3 and len(trees["leader"]) >= 2, trees   # a process per rank (and the member's)
    for tree in trees.values():
        # every rank of a pod runs in the pod's group: together they get the pod's CPU limit, one core
        assert len({cpu_group(pid) for pid in tree}) == 1, tree
        group = cpu_group(tree[0])
        if group != "/":                       # "/": this host lets the runner enforce no CPU limit
            assert quota_cores(group) == 1.0, group
    before = {k: cpu_seconds(v) for k, v in trees.items()}
    for i in range(6):
        complete(url, f"question {i}: " + "tell me a long story " * 10, max_tokens=48)
    used = {k: cpu_seconds(v) - before[k] for k, v in trees.items()}
    print("CPU seconds under load:", used)
    assert used["leader"] > 0.5, used
    assert used["member"] >= 0.3 * used["leader"], used      # the headless member does its share of every step


def test_sigkill_of_a_member_under_streamed_load_restarts_the_slice_whole_and_loses_no_request(
        cluster, namespace, operator, pod_model):
    from tokenfleet_dev.bench.recovery import Load

    apply(cluster, parallel_isvc(pod_model), namespace)
    wait_for("the 4-rank replica Ready", lambda: ready_with(cluster, namespace, NAME, 1), 420, operator)
    url = wait_for("the router routes", lambda: router_url(cluster, namespace), 120, operator)
    wait_for("a first completion", lambda: complete(url, "warm up")["choices"][0]["text"], 240, operator)
    member = next(p for p in pods(cluster, namespace, f"tokenfleet.dev/slice={NAME}-0")
                  if p["metadata"]["labels"]["tokenfleet.dev/leader"] == "false")
    pid = server_pid(member["status"]["podIP"])
    assert pid

    load = Load(url, clients=3, prefixes=["a story about ranks", "a tale of two hosts"], max_tokens=24).start()
    try:
        wait_for("streams in flight", lambda: len(load.results) >= 2, 120, operator)
        # the restarts before the kill (a start that failed on a loaded host restarts the gang too)
        before = get_json(cluster, "slice", f"{NAME}-0", "-n", namespace)["status"].get("restarts", 0)
        os.kill(pid, signal.SIGKILL)

        def restarted_and_ready():
            s = get_json(cluster, "slice", f"{NAME}-0", "-n", namespace)
            current = pods(cluster, namespace, f"tokenfleet.dev/slice={NAME}-0")
            attempts = {p["metadata"]["labels"]["tokenfleet.dev/attempt"] for p in current}
            whole = len(current) == 2 and attempts == {str(before + 1)}
            return s if (s["status"].get("restarts") == before + 1 and s["status"]["phase"] == "Ready"
                         and whole) else None

        s = wait_for("the Slice restarted whole and Ready again", restarted_and_ready, 420, operator)
        assert s["status"]["lastRestart"]["member"] in (0, 1)
        done = len(load.results)
        wait_for("requests served after the restart", lambda: len(load.results) >= done + 3, 240, operator)
    finally:
        load.stop()
    failed = [r.error for r in load.results if not r.ok]
    assert load.results and not failed, failed
    assert ready_with(cluster, namespace, NAME, 1)


def test_sizes_the_replica_or_the_model_cannot_take_are_refused_naming_the_field(
        cluster, namespace, operator, pod_model):
    # the schema: tp * pp must use every accelerator of the replica
    out = apply(cluster, parallel_isvc(pod_model, engine={"tensorParallelSize": 2, "pipelineParallelSize": 1}),
                namespace, check=False)
    assert out.returncode != 0 and "spec.engine.tensorParallelSize" in out.stderr, out.stderr

    # the model: 4 attention heads do not split over 3 ranks; read from the model before any replica starts
    bad = parallel_isvc(pod_model, accelerator={"type": "nvidia-h100-80gb", "countPerHost": 3, "hostsPerReplica": 1})
    bad["metadata"]["name"] = "three"
    apply(cluster, bad, namespace)
    ready = wait_for("Ready=False ModelNotSplittable", lambda: (lambda c: c if c.get("reason") == "ModelNotSplittable"
                                                                else None)(
        condition(isvc_obj(cluster, namespace, "three"), "Ready")), 180, operator)
    assert ready["status"] == "False" and "spec.engine.tensorParallelSize" in ready["message"]
    assert "4 attention heads" in ready["message"]
    assert condition(isvc_obj(cluster, namespace, "three"), "Stalled").get("status") == "True"
    assert names(cluster, "slices", namespace) == []
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=three").stdout
    assert "ModelNotSplittable" in events

    # a fix the model can take starts the replica
    cluster.kubectl("patch", "inferenceservice/three", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"accelerator": {"countPerHost": 2, "hostsPerReplica": 1}}}))
    wait_for("the fixed service's Slice", lambda: names(cluster, "slices", namespace) == ["three-0"] or None,
             120, operator)


def test_a_member_that_cannot_reach_the_leader_says_so_in_the_slice_condition(cluster, namespace, operator, pod_model):
    """A user-made two-host Slice whose leader never opens the rendezvous port: the member resolves the leader
    through the Slice's headless Service, gives up within its bound, and its last words (rank and address)
    reach the Slice's conditions."""
    serve = ["tokenfleet", "serve", "--model", str(pod_model), "--host", "0.0.0.0", "--port", "8000",
             "--num-threads", "1", "--kv-cache-mb", "16"]
    member = [*serve, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "$(TOKENFLEET_MEMBER_INDEX)",
              "--headless", "--master-addr", "$(TOKENFLEET_LEADER_ADDRESS)", "--master-port", "29999",
              "--distributed-timeout-seconds", "5"]

    def template(command):
        # hosts of a replica prove a shared key at the rendezvous; a Slice made by hand gives them one
        env = [{"name": "TOKENFLEET_RENDEZVOUS_KEY", "value": "lonely's shared secret"}]
        return {"spec": {"containers": [{"name": "main", "image": SERVING_IMAGE, "command": command, "env": env}]}}

    gang = {"apiVersion": "tokenfleet.dev/v1alpha1", "kind": "Slice", "metadata": {"name": "lonely"},
            "spec": {"accelerator": {"type": "cpu"}, "hosts": 2, "restartPolicy": {"maxRestarts": 0},
                     "leaderTemplate": template(serve), "template": template(member)}}
    apply(cluster, gang, namespace)
    failed = wait_for("the Slice Failed", lambda: (lambda s: s if s and s.get("status", {}).get("phase") == "Failed"
                                                   else None)(get_json(cluster, "slice", "lonely", "-n", namespace)),
                      240, operator)
    message = condition(failed, "Failed")["message"]
    assert "rank 1 of 2 could not join" in message and ":29999" in message, message
    assert get_json(cluster, "service", "lonely", "-n", namespace)["spec"]["clusterIP"] == "None"


def test_a_max_model_len_the_kv_budget_cannot_hold_is_refused_naming_the_fields(cluster, namespace, operator, pod_model):
    """Issue 34: one replica on CPU whose kvCacheMemory cannot hold a context of maxModelLen once: the operator
    reads the model's shape (the pod runs), then refuses with KVCacheTooSmall before any Slice exists."""
    small = isvc("kvsmall", model={"path": str(pod_model), "servedModelNames": ["tiny"]}, replicas=1,
                 image=SERVING_IMAGE, accelerator={"type": "cpu"},
                 engine={"dtype": "float32", "maxModelLen": 512, "kvCacheMemory": "64Ki"})
    apply(cluster, small, namespace)
    ready = wait_for("Ready=False KVCacheTooSmall", lambda: (lambda c: c if c.get("reason") == "KVCacheTooSmall"
                                                             else None)(
        condition(isvc_obj(cluster, namespace, "kvsmall"), "Ready")), 180, operator)
    assert ready["status"] == "False"
    assert "maxModelLen 512" in ready["message"] and "spec.engine.kvCacheMemory" in ready["message"]
    assert names(cluster, "slices", namespace) == []
