"""The pod runner's pure part: what process a pod becomes."""
import socket
import sys

import pytest

from tokenfleet_dev.localcluster.launch import LaunchError, bind_to_pod_ip, container_launches, expand

PREFIX = "tokenfleet/serving"


def pod(containers, volumes=(), name="p", ns="ns1"):
    return {"metadata": {"name": name, "namespace": ns, "uid": "u-1", "labels": {"app": "x"}},
            "spec": {"nodeName": "node-a", "containers": list(containers), "volumes": list(volumes)}}


def launch(p, **kw):
    return container_launches(p, "127.2.0.9", "127.10.0.1", {"PATH": "/bin", "SECRET_OF_RUNNER": "x"},
                              "/tmp/scratch", PREFIX, **kw)


def test_expand_follows_kubelet_rules():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("no refs", env) == "no refs"


def test_only_containers_of_the_serving_image_are_launched():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["echo"]},
             {"name": "side", "image": "busybox", "command": ["sleep"]}])
    assert [c.name for c in launch(p)] == ["srv"]


def test_env_downward_api_and_argv_expansion():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1",
              "command": ["tokenfleet", "serve"], "args": ["--host", "$(MY_IP)", "--name=$(POD_NAME)"],
              "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                      {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                      {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                      {"name": "GREETING", "value": "hi $(POD_NAME)"}]}])
    (c,) = launch(p)
    assert c.argv == (sys.executable, "-m", "tokenfleet_cli", "serve", "--host", "127.2.0.9", "--name=p")
    assert c.env["MY_IP"] == "127.2.0.9" and c.env["APP"] == "x" and c.env["GREETING"] == "hi p"
    assert c.env["PATH"] == "/bin" and "SECRET_OF_RUNNER" not in c.env


def test_host_path_mounts_are_mapped_in_args_and_env():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["run"],
              "args": ["--model", "/models/tiny", "--cache=/scratch/c", "/modelsX"],
              "env": [{"name": "M", "value": "/models/tiny/config.json"}],
              "volumeMounts": [{"name": "m", "mountPath": "/models"}, {"name": "s", "mountPath": "/scratch"}]}],
            volumes=[{"name": "m", "hostPath": {"path": "/srv/weights"}}, {"name": "s", "emptyDir": {}}])
    (c,) = launch(p)
    assert c.argv[1:] == ("--model", "/srv/weights/tiny", "--cache=/tmp/scratch/volumes/s/c", "/modelsX")
    assert c.env["M"] == "/srv/weights/tiny/config.json"
    assert c.empty_dirs == ("/tmp/scratch/volumes/s",)        # made before the process starts


def test_readiness_probe_by_named_port():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["x"],
              "ports": [{"name": "http", "containerPort": 8000}],
              "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2,
                                 "initialDelaySeconds": 1}}])
    (c,) = launch(p)
    assert (c.readiness.kind, c.readiness.port, c.readiness.path, c.readiness.period) == ("http", 8000, "/ready", 2)


@pytest.mark.parametrize("container, volumes, message", [
    ({"readinessProbe": {"exec": {"command": ["true"]}}}, [], "only httpGet and tcpSocket"),
    ({"readinessProbe": {"tcpSocket": {"port": "nope"}}}, [], "names no containerPort"),
    ({"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}}]}, [], "status.podIPs"),
    ({"volumeMounts": [{"name": "ghost", "mountPath": "/g"}]}, [], "names no volume"),
    ({"volumeMounts": [{"name": "n", "mountPath": "/n"}]}, [{"name": "n", "nfs": {"server": "s", "path": "/"}}],
     "only hostPath, emptyDir, configMap, secret and projected"),
    ({"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}, [], "no key"),
])
def test_unsupported_or_broken_pods_fail_with_a_message(container, volumes, message):
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["x"], **container}], volumes)
    with pytest.raises(LaunchError, match=message):
        launch(p, lookup=lambda *a: None)


def test_config_map_references_resolve_through_lookup():
    seen = []
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["x"],
              "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}])
    (c,) = launch(p, lookup=lambda *a: seen.append(a) or "value")
    assert c.env["X"] == "value" and seen == [("configmap", "ns1", "cm", "k")]


def test_config_map_and_secret_volumes_become_local_file_folders():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["run", "--config", "/etc/app/router.json"],
              "volumeMounts": [{"name": "cfg", "mountPath": "/etc/app"}, {"name": "key", "mountPath": "/secrets"}]}],
            volumes=[{"name": "cfg", "configMap": {"name": "router"}},
                     {"name": "key", "secret": {"secretName": "api", "items": [{"key": "k", "path": "api-key"}],
                                                "optional": True}}])
    (c,) = launch(p)
    assert c.argv[1:] == ("--config", "/tmp/scratch/volumes/cfg/router.json")
    cfg, key = c.volumes
    assert (cfg.kind, cfg.source, cfg.dir, cfg.items, cfg.optional) == ("configmap", "router", "/tmp/scratch/volumes/cfg", (), False)
    assert (key.kind, key.source, key.items, key.optional) == ("secret", "api", (("k", "api-key"),), True)


@pytest.mark.parametrize("arg, expected", [
    ("0.0.0.0", "127.2.0.9"), ("::", "127.2.0.9"), ("--host=0.0.0.0", "--host=127.2.0.9"),
    ("0.0.0.0:8000", "127.2.0.9:8000"), ("--bind=[::]:80", "--bind=127.2.0.9:80"),
    ("10.0.0.0", "10.0.0.0"), ("0.0.0.0.tar", "0.0.0.0.tar"), ("x=1", "x=1"),
    ('--kv-events-config={"endpoint":"tcp://*:5557","topic":"kv"}',
     '--kv-events-config={"endpoint":"tcp://[::ffff:127.2.0.9]:5557","topic":"kv"}')])
def test_wildcard_bind_addresses_become_the_pod_ip(arg, expected):
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["serve", arg]}])
    (c,) = launch(p)
    assert c.argv[1] == expected


def test_zeromq_binds_the_ipv4_mapped_endpoint_to_the_pod_ip_alone():
    """What the ZeroMQ rewrite relies on: two publishers on one port, each on its pod's IP, and a subscriber of
    one pod's IP reaches that pod's publisher."""
    import time

    import zmq

    ctx = zmq.Context.instance()
    with socket.socket() as s:
        s.bind(("127.2.0.9", 0))
        port = s.getsockname()[1]
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    sub = ctx.socket(zmq.SUB)
    try:
        for pub, ip in zip(pubs, ("127.2.0.9", "127.2.0.10")):
            pub.bind(bind_to_pod_ip(f"tcp://*:{port}", ip))
            assert pub.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{ip}:{port}"
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.2.0.10:{port}")
        got = None
        for _ in range(100):
            pubs[0].send(b"pod 9")
            pubs[1].send(b"pod 10")
            if sub.poll(50):
                got = sub.recv()
                break
            time.sleep(0.01)
        assert got == b"pod 10"
    finally:
        for sock in (*pubs, sub):
            sock.close(linger=0)


def test_a_capped_cpu_reaches_the_pods_as_it_would_on_a_node_of_that_cpu():
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1", "command": ["tokenfleet", "serve"]}])
    (c,) = container_launches(p, "127.2.0.9", "127.10.0.1", {"PATH": "/bin", "TOKENFLEET_CPU_ISA": "avx2"},
                              "/tmp/scratch", PREFIX)
    assert c.env["TOKENFLEET_CPU_ISA"] == "avx2"


def test_pod_dns_names_become_the_addresses_cluster_dns_would_answer():
    from tokenfleet_dev.localcluster.launch import pod_dns_names

    leader = "s-0.s.ns1.svc"
    p = pod([{"name": "srv", "image": f"{PREFIX}:0.1",
              "command": ["tokenfleet", "serve", "--master-addr", "$(LEADER)", f"--peer={leader}:29500",
                          "--other", "s-0.s.ns1.svc.cluster.local", "--not-a-pod", "example.com"],
              "env": [{"name": "LEADER", "value": leader}]}])
    assert pod_dns_names(p) == {leader, "s-0.s.ns1.svc.cluster.local"}
    [c] = launch(p, addresses={leader: "127.2.0.7"})
    assert c.env["LEADER"] == "127.2.0.7"
    assert list(c.argv[4:]) == ["--master-addr", "127.2.0.7", "--peer=127.2.0.7:29500",
                                "--other", "s-0.s.ns1.svc.cluster.local",       # no record given: left as is
                                "--not-a-pod", "example.com"]


def test_vllm_images_run_vllm_serve_from_the_cpu_builds_venv(tmp_path, monkeypatch):
    from tokenfleet_dev.localcluster.launch import image_runtime

    assert image_runtime("vllm/vllm-openai:v0.32.0", PREFIX) == "vllm"
    assert image_runtime("docker.io/vllm/vllm-openai:latest", PREFIX) == "vllm"
    assert image_runtime("localhost:5000/vllm/vllm-cpu:1", PREFIX) == "vllm"
    assert image_runtime("myorg/vllm:1", PREFIX) is None and image_runtime("vllmx/server", PREFIX) is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text("")
    monkeypatch.setenv("TOKENFLEET_VLLM_VENV", str(tmp_path))
    p = pod([{"name": "engine", "image": "vllm/vllm-openai:v0.32.0",
              "args": ["/models/m", "--host", "0.0.0.0", "--port", "8000"],
              "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"}],
              "resources": {"limits": {"cpu": "1500m"}}}])
    (c,) = container_launches(p, "127.2.0.9", "127.10.0.1", {"PATH": "/bin", "PYTHONPATH": "/src"}, "/tmp/s", PREFIX)
    # the image's entrypoint (vllm serve) when the pod gives no command, bound to the pod's address
    assert c.argv == (str(tmp_path / "bin" / "vllm"), "serve", "/models/m", "--host", "127.2.0.9", "--port", "8000")
    assert "PYTHONPATH" not in c.env and c.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert c.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and c.env["OMP_NUM_THREADS"] == "2" and c.env["HF_HUB_OFFLINE"] == "1"
    sized = pod([{"name": "engine", "image": "vllm/vllm-openai:v0.32.0",
                  "args": ["/models/m", "--kv-cache-memory-bytes", "12582912"]}])
    (c3,) = container_launches(sized, "127.2.0.9", "127.10.0.1", {}, "/tmp/s", PREFIX)
    assert "VLLM_CPU_KVCACHE_SPACE" not in c3.env          # it would override the operator's flag
    p2 = pod([{"name": "engine", "image": "vllm/vllm-openai:v0.32.0",
               "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}])
    (c2,) = container_launches(p2, "127.2.0.9", "127.10.0.1", {}, "/tmp/s", PREFIX)
    assert c2.argv[0] == str(tmp_path / "bin" / "python")
    monkeypatch.setenv("TOKENFLEET_VLLM_VENV", str(tmp_path / "missing"))
    with pytest.raises(LaunchError, match="hack/vllm-cpu.sh"):
        container_launches(p, "127.2.0.9", "127.10.0.1", {}, "/tmp/s", PREFIX)
