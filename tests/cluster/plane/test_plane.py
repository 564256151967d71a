"""The local control plane is a real Kubernetes: CRDs, scheduling, GC, RBAC, node failure."""
from __future__ import annotations

import json
import textwrap
import time
import urllib.request
import uuid

import pytest

from tokenfleet_dev.localcluster.nodes import NodePool
from tokenfleet_dev.localcluster.podrunner import STATUS_CHECK_SECONDS

from harness.support import wait_until


def wait_for(predicate, timeout=60.0, interval=0.3, what="condition"):
    return wait_until(predicate, timeout, interval, what)          # checks run kubectl: poll gently


def get_json(cluster, *args):
    out = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def test_version_is_the_pinned_release(cluster):
    info = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert info["serverVersion"]["gitVersion"].startswith("v1.34.")
    assert info["clientVersion"]["gitVersion"] == info["serverVersion"]["gitVersion"]


def test_a_crd_is_served(cluster, namespace):
    crd = textwrap.dedent("""
        apiVersion: apiextensions.k8s.io/v1
        kind: CustomResourceDefinition
        metadata: {name: widgets.test.tokenfleet.dev}
        spec:
          group: test.tokenfleet.dev
          scope: Namespaced
          names: {plural: widgets, singular: widget, kind: Widget}
          versions:
          - name: v1
            served: true
            storage: true
            schema:
              openAPIV3Schema:
                type: object
                properties:
                  spec:
                    type: object
                    properties:
                      size: {type: integer, minimum: 1}
        """)
    cluster.kubectl("apply", "-f", "-", input=crd)
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.test.tokenfleet.dev", "--timeout=30s")
    w = "apiVersion: test.tokenfleet.dev/v1\nkind: Widget\nmetadata: {name: w1}\nspec: {size: %s}\n"
    wait_for(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input=w % 3, check=False).returncode == 0,
             30, what="the new resource to be served")
    assert get_json(cluster, "widget", "w1", "-n", namespace)["spec"]["size"] == 3
    bad = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=(w % 0).replace("w1", "w2"), check=False)
    assert bad.returncode != 0 and "spec.size" in bad.stderr


def test_deployment_pods_run_on_kwok_accelerator_nodes_with_loopback_ips(cluster, namespace):
    dep = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gpu-app"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "gpu-app"}},
                 "template": {"metadata": {"labels": {"app": "gpu-app"}},
                              "spec": {"containers": [{"name": "c", "image": "example.com/app:1",
                                                       "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dep))

    def running():
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=gpu-app")["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return ok if len(ok) == 3 else None
    pods = wait_for(running, 90, what="3 Running pods")
    for p in pods:
        assert p["status"]["podIP"].startswith("127.1."), p["status"]["podIP"]
        node = get_json(cluster, "node", p["spec"]["nodeName"])
        assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 2
    wait_for(lambda: get_json(cluster, "deployment", "gpu-app", "-n", namespace)["status"].get("readyReplicas") == 3,
             60, what="deployment ready")


def test_deleting_an_owner_garbage_collects_dependents(cluster, namespace):
    cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=a=b")
    uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    dependent = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "dependent", "ownerReferences": [
                     {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]},
                 "data": {"x": "y"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dependent))
    assert get_json(cluster, "configmap", "dependent", "-n", namespace) is not None
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(lambda: get_json(cluster, "configmap", "dependent", "-n", namespace) is None, 60,
             what="garbage collection of the dependent")


def test_service_account_rbac_is_enforced(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    kc = cluster.sa_kubeconfig(namespace, "reader")
    denied = cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=kc, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    assert f"system:serviceaccount:{namespace}:reader" in denied.stderr
    cluster.kubectl("create", "role", "cm-reader", "-n", namespace, "--verb=get,list", "--resource=configmaps")
    cluster.kubectl("create", "rolebinding", "cm-reader", "-n", namespace, "--role=cm-reader",
                    f"--serviceaccount={namespace}:reader")
    wait_for(lambda: cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=kc, check=False).returncode == 0,
             30, what="the new rule to take effect")
    # The rule grants reading only.
    write = cluster.kubectl("create", "configmap", "x", "-n", namespace, kubeconfig=kc, check=False)
    assert write.returncode != 0 and "forbidden" in write.stderr.lower()


def test_a_not_ready_node_gets_its_pods_evicted(cluster, namespace):
    suffix = uuid.uuid4().hex[:5]
    (node,) = cluster.add_nodes([NodePool(count=1, prefix=f"evict{suffix}", per_node=1)])
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "victim"},
               "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                        "containers": [{"name": "c", "image": "example.com/app:1"}]}}
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
        wait_for(lambda: (get_json(cluster, "pod", "victim", "-n", namespace) or {}).get("status", {})
                 .get("phase") == "Running", 60, what="victim Running")
        tolerations = get_json(cluster, "pod", "victim", "-n", namespace)["spec"]["tolerations"]
        assert {t["key"]: t["tolerationSeconds"] for t in tolerations} == {
            "node.kubernetes.io/not-ready": 5, "node.kubernetes.io/unreachable": 5}
        t0 = time.monotonic()
        cluster.fail_node(node, "not-ready")
        wait_for(lambda: get_json(cluster, "pod", "victim", "-n", namespace) is None, 60, what="eviction")
        took = time.monotonic() - t0
        taints = [t["key"] for t in get_json(cluster, "node", node)["spec"].get("taints", [])]
        assert "node.kubernetes.io/not-ready" in taints
        assert took < 45, f"eviction took {took:.1f}s"
    finally:
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)


SERVER = textwrap.dedent("""
    import http.server, os, signal, sys, time
    time.sleep(float(os.environ.get("DELAY", "0")))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello from {os.environ['POD_NAME']} on {os.environ['POD_IP']}".encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    srv = http.server.HTTPServer((os.environ["POD_IP"], 8080), H)
    def term(*_):
        open(os.environ["MARK"], "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    srv.serve_forever()
    """)


def test_pod_runner_serves_http_on_the_pod_ip_and_stops_on_delete(cluster, namespace, tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    mark = tmp_path / "terminated"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
           "spec": {"terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "srv", "image": "tokenfleet/serving:test",
                        "command": ["python3", "/work/server.py"],
                        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "DELAY", "value": "3"},
                                {"name": "MARK", "value": "/work/terminated"}],
                        "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}],
                    "volumes": [{"name": "work", "hostPath": {"path": str(tmp_path)}}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def status():
        return (get_json(cluster, "pod", "web", "-n", namespace) or {}).get("status", {})

    def ready(s):
        return any(c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", []))

    # Running (process started) but not Ready while the server sleeps before listening.
    s = wait_for(lambda: (lambda s: s if s.get("phase") == "Running" else None)(status()), 60, 0.1,
                 what="web Running")
    assert not ready(s), "Ready before the readiness probe could pass"
    ip = s["podIP"]
    assert ip.startswith("127.2.")
    wait_for(lambda: ready(status()), 60, what="web Ready")
    with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as r:
        assert r.read().decode() == f"hello from web on {ip}"

    cluster.kubectl("delete", "pod", "web", "-n", namespace, "--wait=false")
    wait_for(lambda: get_json(cluster, "pod", "web", "-n", namespace) is None, 30, what="pod object removed")
    assert mark.read_text() == "SIGTERM"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{ip}:8080/", timeout=2)


def test_pod_runner_kills_a_process_that_ignores_sigterm_after_the_grace_period(cluster, namespace):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stubborn"},
           "spec": {"terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "c", "image": "tokenfleet/serving:test",
                                    "command": ["python3", "-c",
                                                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    wait_for(lambda: ((get_json(cluster, "pod", "stubborn", "-n", namespace) or {}).get("status", {})
                      .get("phase") == "Running"), 60, what="stubborn Running")
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    wait_for(lambda: get_json(cluster, "pod", "stubborn", "-n", namespace) is None, 30, what="deletion")
    took = time.monotonic() - t0
    assert 1.5 <= took < 15, took


def test_non_serving_pods_stay_with_kwok(cluster, namespace):
    """KWOK's stages skip our image and still handle every other pod."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
           "spec": {"containers": [{"name": "c", "image": "example.com/tokenfleet/serving-lookalike:1"}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    s = wait_for(lambda: (lambda s: s if s.get("phase") == "Running" else None)(
        (get_json(cluster, "pod", "plain", "-n", namespace) or {}).get("status", {})), 60, what="plain Running")
    assert s["podIP"].startswith("127.1.")


def node_ready_status(cluster, node):
    n = get_json(cluster, "node", node)
    return next(c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready")


def test_lease_loss_makes_a_node_unknown_and_unreachable_then_it_recovers(cluster):
    (node,) = cluster.add_nodes([NodePool(count=1, prefix=f"lease{uuid.uuid4().hex[:5]}", per_node=1)])
    try:
        assert node_ready_status(cluster, node) == "True"
        cluster.fail_node(node, "lease-loss")
        wait_for(lambda: node_ready_status(cluster, node) == "Unknown", 60, what="Ready=Unknown")
        wait_for(lambda: "node.kubernetes.io/unreachable" in
                 [t["key"] for t in get_json(cluster, "node", node)["spec"].get("taints", [])], 30,
                 what="unreachable taint")
        cluster.recover_node(node)
        wait_for(lambda: node_ready_status(cluster, node) == "True", 60, what="recovery")
    finally:
        cluster.fail_node(node, "delete")
    wait_for(lambda: get_json(cluster, "node", node) is None, 30, what="node deletion")


def pod_ready_status(cluster, namespace, name):
    s = (get_json(cluster, "pod", name, "-n", namespace) or {}).get("status", {})
    return next((c["status"] for c in s.get("conditions", []) if c["type"] == "Ready"), None)


def test_a_pod_marked_not_ready_with_its_node_is_ready_again_once_the_node_is(cluster, namespace):
    """The node lifecycle controller marks a node's pods not ready when its lease lapses; the pod runner, like
    a kubelet, must say they are ready again once the node is (a loaded host lapses KWOK's leases now and then,
    and without this every replica on the node stayed unready for good)."""
    (node,) = cluster.add_nodes([NodePool(count=1, prefix=f"flap{uuid.uuid4().hex[:5]}", per_node=1)])
    tolerate = [{"key": k, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 600}
                for k in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "steady"},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": tolerate,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "c", "image": "tokenfleet/serving:test",
                                    "command": ["python3", "-c", "import time; time.sleep(600)"]}]}}
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
        wait_for(lambda: pod_ready_status(cluster, namespace, "steady") == "True", 60, what="steady Ready")
        cluster.fail_node(node, "lease-loss")
        wait_for(lambda: node_ready_status(cluster, node) == "Unknown", 60, what="Ready=Unknown")
        wait_for(lambda: pod_ready_status(cluster, namespace, "steady") == "False", 60,
                 what="the pod marked not ready by the node lifecycle controller")
        time.sleep(2 * STATUS_CHECK_SECONDS + 1)     # while the node is not Ready, the controller's word stands
        assert pod_ready_status(cluster, namespace, "steady") == "False"
        cluster.recover_node(node)
        wait_for(lambda: node_ready_status(cluster, node) == "True", 60, what="node recovery")
        wait_for(lambda: pod_ready_status(cluster, namespace, "steady") == "True", 30,
                 what="the pod Ready again once its node is")
    finally:
        cluster.kubectl("delete", "pod", "steady", "-n", namespace, "--wait=false", check=False)
        cluster.fail_node(node, "delete")


def test_pod_security_admission_is_enforced(cluster, namespace):
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "priv"},
           "spec": {"containers": [{"name": "c", "image": "example.com/app:1",
                                    "securityContext": {"privileged": True}}]}}
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False)
    assert out.returncode != 0 and "violates PodSecurity" in out.stderr, out.stderr


def test_pod_runner_materialises_config_map_volumes_and_env(cluster, namespace):
    cluster.kubectl("create", "configmap", "cfg", "-n", namespace, "--from-literal=msg=first")
    code = ("import http.server, os\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        b = (open(os.environ['MSG_FILE']).read() + '|' + os.environ['GREETING']).encode()\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b)\n"
            "http.server.HTTPServer((os.environ['POD_IP'], 8080), H).serve_forever()\n")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cfgreader"},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "c", "image": "tokenfleet/serving:test", "command": ["python3", "-c", code],
                                    "env": [{"name": "MSG_FILE", "value": "/etc/cfg/msg"},
                                            {"name": "GREETING",
                                             "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "msg"}}}],
                                    "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}],
                                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}],
                    "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def ready_ip():
        s = (get_json(cluster, "pod", "cfgreader", "-n", namespace) or {}).get("status", {})
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", []))
        return s.get("podIP") if ok else None
    ip = wait_for(ready_ip, 60, what="cfgreader Ready")

    def served():
        with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as r:
            return r.read().decode()
    assert served() == "first|first"
    cluster.kubectl("patch", "configmap", "cfg", "-n", namespace, "-p", '{"data":{"msg":"second"}}')
    # Files follow the ConfigMap; environment variables keep the value the container started with.
    wait_for(lambda: served() == "second|first", 20, what="the refreshed file")
