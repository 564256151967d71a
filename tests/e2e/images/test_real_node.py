"""A real node on the local plane: the kubelet (built from the pinned Kubernetes module), containerd, runc
and CNI in a network namespace the plane creates, beside the KWOK nodes.

The images are loaded into the node's containerd; the operator runs as the Deployment of manifests/base
(PodSecurity restricted, in-cluster ServiceAccount token) and an InferenceService runs its serving pod and
its router from the serving image, all pinned to the node by their namespaces' node selector. The official
``openai`` client talks to the router through a forward into the node's network. Pods have ordinary
private addresses, so EndpointSlices list them.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from tokenfleet_dev import images
from tokenfleet_dev.demo import pinned_namespace, pod_startup_seconds, wait_routable
from tokenfleet_dev.localcluster import realnode
from tokenfleet_dev.localcluster.binaries import REPO_ROOT
from tokenfleet_dev.localcluster.nodes import NodePool
from tokenfleet_dev.localcluster.plane import LocalCluster

from harness.operator_cluster import OPERATOR_NAMESPACE, condition, get_json, wait_for

POD_NETWORK = ipaddress.ip_network(realnode.POD_CIDR)
NAMESPACE = "on-kubelet"


@pytest.fixture(scope="module")
def plane_dir(built_images):
    """One folder for the module's planes, kept between runs (ignored .cache/e2e/real-node, or
    $TOKENFLEET_TEST_REAL_NODE_DIR): the node's containerd keeps the images there, so a later run skips
    an unchanged image and stores and unpacks only the changed layers of another. Held under a lock:
    one real-node plane per folder at a time."""
    if os.geteuid() != 0:
        pytest.fail("a real node needs root (network namespace, mounts, cgroups); CI runs as root")
    d = Path(os.environ.get("TOKENFLEET_TEST_REAL_NODE_DIR") or REPO_ROOT / ".cache" / "e2e" / "real-node")
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield d


def test_demo_real_node_runs_the_service_in_real_containers(plane_dir):
    """`tokenfleet demo --real-node`, as a user runs it: it loads the images into the node (so the plane
    below finds them there), and everything it runs is on the kubelet node with a pod-network address."""
    run = subprocess.run([sys.executable, "-m", "tokenfleet_cli", "demo", "--real-node", "--nodes", "2",
                          "--dir", str(plane_dir), "--down"],
                         capture_output=True, text=True, timeout=1500, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = run.stdout
    assert run.returncode == 0, out[-5000:] + run.stderr[-3000:]
    usages = [json.loads(m) for m in re.findall(r"usage: (\{.*\})", out)]
    assert len(usages) == 2 and all(u["completion_tokens"] == 48 for u in usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[1]["prompt_tokens"] // 16 * 16
    # $/h, $/MTok and Goodput measured, then the reason
    assert re.search(r"tiny-llama\s+tiny-llama\s+cpu\s+2\s+2\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+Serving", out), out[-3000:]
    pods = re.findall(r"(tiny-llama-\S+)\s+1/1\s+Running\s+\d+\s+\S+\s+(\S+)\s+(\S+)", out)
    assert len(pods) == 4, out[-3000:]              # two replicas and two router pods (routing.replicas' default)
    assert all(node == "kubelet-0" and ipaddress.ip_address(ip) in POD_NETWORK for _, ip, node in pods)
    startup = re.search(r"node kubelet-0 Ready ([\d.]+)s after it started; serving pods created → Ready in (.*)", out)
    assert startup, out[-3000:]
    loaded = re.search(r"tokenfleet/operator:\S+ tokenfleet/serving:\S+: (.*)", out)
    print(f"demo --real-node: {startup.group(0)}; images {loaded.group(1) if loaded else '?'}")


@pytest.fixture(scope="module")
def plane(plane_dir):
    p = LocalCluster(plane_dir, pools=[NodePool(count=2, accelerator="gpu", per_node=8)], tie_to_parent=True,
                     real_node=True, log=lambda m: print(f"[plane] {m}"))
    p.up()
    try:
        t0 = time.monotonic()
        loaded = images.load_into_node(p.node_layout())
        print(f"[plane] loaded {loaded or 'nothing (already there)'} into {p.node_layout().name} "
              f"in {time.monotonic() - t0:.0f}s")
        yield p
    finally:
        p.down()


def ready_pods(plane, namespace: str, selector: str) -> list[dict]:
    items = (get_json(plane, "pods", "-n", namespace, "-l", selector) or {}).get("items", [])
    return [p for p in items if condition(p, "Ready").get("status") == "True"]


def test_the_node_joins_beside_the_kwok_nodes(plane):
    layout = plane.node_layout()
    node = get_json(plane, "node", layout.name)
    assert condition(node, "Ready")["status"] == "True"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.4"
    assert {"type": "InternalIP", "address": realnode.GATEWAY} in node["status"]["addresses"]
    assert node["metadata"]["labels"][realnode.NODE_LABEL] == realnode.NODE_KIND
    kwok = [n for n in get_json(plane, "nodes")["items"] if n["metadata"]["name"].startswith("kwok-")]
    assert len(kwok) == 2 and all(condition(n, "Ready")["status"] == "True" for n in kwok)
    startup = plane.state()["real_node"]["startup_seconds"]
    print(f"real node Ready {startup:.1f}s after the plane started it")


@pytest.fixture(scope="module")
def operator_pods(plane, tiny_model) -> list[dict]:
    """manifests/base applied, its namespace pinned to the node, and the administrator's opt-in for the test
    model's host path added to the operator's flags; the operator Deployment's Ready pods."""
    pinned_namespace(plane, OPERATOR_NAMESPACE, plane.node_layout().name)
    plane.kubectl("apply", "--server-side", "-k", str(REPO_ROOT / "manifests" / "base"))
    plane.kubectl("patch", "deployment", "-n", OPERATOR_NAMESPACE, "tokenfleet-operator", "--type=json", "-p",
                  json.dumps([{"op": "add", "path": "/spec/template/spec/containers/0/args/-",
                               "value": f"--allow-host-path={tiny_model.parent}"}]))
    for crd in ("inferenceservices.tokenfleet.dev", "slices.tokenfleet.dev"):
        plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    out = plane.kubectl("rollout", "status", "deployment/tokenfleet-operator", "-n", OPERATOR_NAMESPACE,
                        "--timeout=300s", check=False, timeout=320)
    pods = get_json(plane, "pods", "-n", OPERATOR_NAMESPACE)["items"]
    assert out.returncode == 0, (out.stderr, _pod_logs(plane, pods))
    return [p for p in pods if condition(p, "Ready").get("status") == "True"]


def test_the_operator_deployment_from_manifests_base_runs_on_the_node(plane, operator_pods):
    node = plane.node_layout().name
    ready = operator_pods
    assert ready and all(p["spec"]["nodeName"] == node for p in ready)
    assert all(ipaddress.ip_address(p["status"]["podIP"]) in POD_NETWORK for p in ready)
    # The restricted namespace admitted it, and the kubelet ran it with the image's user and no capabilities.
    assert yaml.safe_load(plane.kubectl("get", "ns", OPERATOR_NAMESPACE, "-o", "yaml").stdout)["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"] == "restricted"
    # The metrics Service gets endpoints: the pod address is not loopback.
    slices = get_json(plane, "endpointslices", "-n", OPERATOR_NAMESPACE, "-l",
                      "kubernetes.io/service-name=tokenfleet-operator-metrics")["items"]
    addresses = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert {p["status"]["podIP"] for p in ready} <= addresses


def test_an_inference_service_serves_from_the_serving_image_on_the_node(plane, operator_pods, tiny_model):
    node = plane.node_layout().name
    pinned_namespace(plane, NAMESPACE, node)
    body = {
        "apiVersion": "tokenfleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "tiny", "namespace": NAMESPACE},
        "spec": {"model": {"hostPath": {"path": str(tiny_model)}, "servedModelNames": ["tiny"]},
                 "replicas": 1, "accelerator": {"type": "cpu"},
                 "engine": {"dtype": "float32", "maxModelLen": 256, "maxNumSeqs": 4},
                 "routing": {"policy": "prefix-aware"}, "image": images.ref("serving")},
    }
    plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(body))
    try:
        wait_for("InferenceService Ready", lambda: condition(get_json(plane, "inferenceservice", "tiny", "-n", NAMESPACE),
                                                             "Ready").get("status") == "True", timeout=900)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_pod_logs(plane, get_json(plane, 'pods', '-n', NAMESPACE)['items'])}") from None
    engines = ready_pods(plane, NAMESPACE, "tokenfleet.dev/inference-service=tiny,tokenfleet.dev/role=serve")
    routers = ready_pods(plane, NAMESPACE, "tokenfleet.dev/inference-service=tiny,tokenfleet.dev/role=router")
    assert len(engines) == 1 and len(routers) == 2         # routing.replicas defaults to 2
    for pod in engines + routers:
        assert pod["spec"]["nodeName"] == node
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_NETWORK
        assert pod["status"]["containerStatuses"][0]["image"] == images.runtime_ref("serving")
    print(f"serving pod created -> Ready in {pod_startup_seconds(engines[0]):.0f}s on {node}")
    slices = get_json(plane, "endpointslices", "-n", NAMESPACE)["items"]
    addresses = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert {p["status"]["podIP"] for p in engines + routers} <= addresses

    port = plane.expose("tiny-router", routers[0]["status"]["podIP"], 8080)
    # the service is Ready when its pods are; the kubelet updates the router's mounted endpoints file up to a
    # minute later (docs/routing.md), and until then the router answers 503 with Retry-After
    wait_routable(f"http://127.0.0.1:{port}", timeout=180)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, temperature=0)
    assert whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_down_stops_the_node_and_leaves_nothing_on_the_host(plane):
    layout = plane.node_layout()
    plane.down()
    assert not layout.netns_path.exists()
    assert realnode.leftover_shims(layout) == []
    assert realnode.unmount_under([layout.dir, layout.run_dir]) == []
    assert not any(Path(d).exists() for d in realnode._cgroup_dirs(layout))
    assert not layout.run_dir.exists()


def _pod_logs(plane, pods: list[dict]) -> str:
    """The containers' logs as the kubelet wrote them (the API server cannot reach the node for `kubectl logs`)."""
    out = []
    logs = plane.node_layout().pod_logs
    for pod in pods:
        m = pod["metadata"]
        out.append(f"--- {m['namespace']}/{m['name']}: {json.dumps(pod['status'].get('containerStatuses'))[:800]}")
        for f in sorted(logs.glob(f"{m['namespace']}_{m['name']}_*/*/*.log")):
            out.append(f"{f.name}: {f.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)

