"""The operator image, run under a real OCI runtime (podman + runc) against the local plane.

Its only credential is the ServiceAccount token, mounted the way the kubelet mounts it
(``/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}``, read-only) with
``KUBERNETES_SERVICE_HOST/PORT`` pointing at the API server, so the operator logs in through in-cluster
configuration and RBAC is enforced. The container is locked down like a restricted pod
(``harness.containers.HARDENED``). It must reconcile an InferenceService: create its Slices, router and
Services, and report it Ready once KWOK has the (fake-image) pods running.
"""
from __future__ import annotations

import json
import socket
import urllib.request

from harness.containers import HARDENED, Container, effective_capabilities, podman, uids, wait_http
from harness.operator_cluster import OPERATOR_NAMESPACE, OPERATOR_SA, apply, condition, get_json, install, isvc, names, wait_for

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_account_volume(cluster, folder) -> None:
    """What the kubelet's projected kube-api-access volume holds: a bound token, the cluster CA, the namespace."""
    folder.mkdir()
    token = cluster.kubectl("create", "token", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--duration=3600s").stdout.strip()
    (folder / "token").write_text(token)
    (folder / "ca.crt").write_bytes((cluster.dir / "pki" / "ca.crt").read_bytes())
    (folder / "namespace").write_text(OPERATOR_NAMESPACE)
    for f in folder.iterdir():
        f.chmod(0o644)


def test_the_image_holds_no_torch_no_compiler_and_no_dev_code(built_images):
    out = podman("run", "--rm", "--network=none", *HARDENED, "--entrypoint=python3", built_images["operator"], "-c",
                 "import importlib.util as u, json, shutil;"
                 "print(json.dumps({'modules': [m for m in ('torch', 'tokenfleet_dev', 'transformers') if u.find_spec(m)],"
                 " 'compilers': [c for c in ('cc', 'gcc', 'clang') if shutil.which(c)],"
                 " 'operator': bool(u.find_spec('tokenfleet_operator.main'))}))")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"modules": [], "compilers": [], "operator": True}


def test_the_operator_container_reconciles_an_inference_service(built_images, cluster, namespace, tmp_path):
    install(cluster)
    sa = tmp_path / "serviceaccount"
    service_account_volume(cluster, sa)
    api_port = cluster.state()["ports"]["apiserver"]
    health, metrics = free_port(), free_port()
    # The token is the container's only credential: no kubeconfig, no admin certificate.
    c = Container(built_images["operator"],
                  args=["operator", "-n", namespace, f"--metrics-port={metrics}", f"--health-port={health}",
                        "--resync-seconds=3"],
                  options=[f"--volume={sa}:{SA_DIR}:ro", "--env=KUBERNETES_SERVICE_HOST=127.0.0.1",
                           f"--env=KUBERNETES_SERVICE_PORT={api_port}"])
    c.start()
    try:
        wait_http(f"http://127.0.0.1:{health}/healthz", timeout=120, container=c)
        status = c.process_status()
        assert set(uids(status)) == {65532} and effective_capabilities(status) == 0
        assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"

        apply(cluster, isvc("tiny", replicas=2), namespace)
        try:
            wait_for("two Slices", lambda: len(names(cluster, "slices", namespace)) == 2, timeout=120)
            wait_for("router Deployment and Services",
                     lambda: names(cluster, "deployments", namespace) == ["tiny-router"]
                     and "tiny" in names(cluster, "services", namespace), timeout=60)
            ready = wait_for("InferenceService Ready",
                             lambda: condition(get_json(cluster, "inferenceservice", "tiny", "-n", namespace), "Ready")
                             .get("status") == "True", timeout=240)
            assert ready
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- operator container log ---\n{c.logs()}") from None
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            assert r.status == 200 and b"# TYPE" in r.read()
        assert c.stop(timeout=30) == 0, c.logs()
    finally:
        c.remove()

